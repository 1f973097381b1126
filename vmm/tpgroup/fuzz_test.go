package tpgroup

import (
	"bytes"
	"errors"
	"io"
	"net"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// FuzzServe feeds arbitrary bytes to a member's connection handler, the
// decoder of group requests: every frame gets exactly one well-formed answer
// carrying the member's fixed rank and size, and a malformed frame ends the
// stream after its answer.
func FuzzServe(f *testing.F) {
	for _, req := range []*v1.GroupRequest{
		pingReq("eng", 2, 0, 1),
		pingReq("eng", 4, 0, 1),
		pageOpRequest(pingReq("eng", 2, 0, 1), v1.PageOp_KIND_MAP, []int{0, 1, 2}),
		pageOpRequest(pingReq("eng", 2, 0, 1), v1.PageOp_KIND_UNMAP, []int{7}),
	} {
		b, err := wire.AppendFrame(nil, req, 0)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, data []byte) {
		ln := newPipeNet().listener(1, 1)
		g, err := newGroup(t.Context(), Member{EngineID: "eng", TPSize: 2, TPRank: 1}, nil,
			&Config{Dir: "/nonexistent", Ownership: OwnershipLocal, MaxFrame: 1 << 10}, ln, nil)
		require.NoError(t, err)
		defer g.Close()
		client, server := net.Pipe()
		done := make(chan struct{})
		go func() {
			defer close(done)
			g.serveConn(server)
		}()
		// Decode what the client sends the same way the member does, to know
		// how many answers to expect.
		r := wire.NewReader(bytes.NewReader(data), 1<<10)
		var frames int
		var bad bool
		for {
			var req v1.GroupRequest
			err := r.ReadMsg(&req)
			if err != nil {
				// A truncated frame only shows when the stream ends: the
				// member then has nobody to answer.
				bad = !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF)
				break
			}
			frames++
		}
		go func() {
			client.Write(data)
		}()
		cr := wire.NewReader(client, 0)
		want := frames
		if bad {
			want++
		}
		for range want {
			var resp v1.GroupResponse
			require.NoError(t, cr.ReadMsg(&resp))
			require.EqualValues(t, 1, resp.GetTpRank())
			require.EqualValues(t, 2, resp.GetTpSize())
		}
		client.Close()
		<-done
		require.Equal(t, uint64(want), g.Counters().Received)
	})
}
