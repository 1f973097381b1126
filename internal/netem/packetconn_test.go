package netem_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvsidecar/kvsidecar/internal/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestPacketConnKillAfter(t *testing.T) {
	a, b := testutil.ListenUDP(t, 0), testutil.ListenUDP(t, 1)
	buf := make([]byte, 64)
	_, err := a.WriteTo([]byte("hello"), b.LocalAddr())
	require.NoError(t, err)
	n, from, err := b.ReadFrom(buf)
	require.NoError(t, err)
	require.Equal(t, "hello", string(buf[:n]))

	// Delayed send from b still arrives.
	_, err = b.WriteTo([]byte("later"), from)
	require.NoError(t, err)
	n, _, err = a.ReadFrom(buf)
	require.NoError(t, err)
	require.Equal(t, "later", string(buf[:n]))

	a.KillAfter(3)
	_, err = a.WriteTo([]byte("dies"), b.LocalAddr())
	require.NoError(t, err, "a dark socket swallows writes")
	select {
	case <-a.Dead():
	default:
		t.Fatal("budget spent but socket not dark")
	}
	require.Equal(t, int64(9), a.SentBytes())
}
