package localapi_test

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/localapi"
)

// TestLocalClientHostBlockCopy: ReadBlock, WriteBlock and BlockAddr work on
// host memory too, on the same bytes as Block.
func TestLocalClientHostBlockCopy(t *testing.T) {
	s := newLocalSidecar(t, "host-copy", nil)
	c := dialLocal(t, s)
	_, err := c.Attach(t.Context(), createReq(gqa8, 256))
	require.NoError(t, err)
	ids, err := c.Alloc(t.Context(), 2)
	require.NoError(t, err)
	require.NoError(t, c.WriteBlock(1, int(ids[1]), []byte("host")))
	b, err := c.Block(1, int(ids[1]))
	require.NoError(t, err)
	require.Equal(t, "host", string(b[:4]))
	b[4] = '!'
	got := make([]byte, 5)
	require.NoError(t, c.ReadBlock(1, int(ids[1]), got))
	require.Equal(t, "host!", string(got))
	addr, err := c.BlockAddr(1, int(ids[1]))
	require.NoError(t, err)
	require.Equal(t, addr, uint64(uintptr(unsafe.Pointer(&b[0]))))
	_, err = c.BlockAddr(9, int(ids[1]))
	require.ErrorIs(t, err, localapi.ErrInvalidArgument)
}
