package transfer

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
)

// TestStreamsServedConcurrently: the goroutine that accepted a stream
// serves it and passes the accepting on, so a READ held by its Authorize
// does not hold up the next READ on the same connection, and goroutines
// kept from earlier streams serve later ones.
func TestStreamsServedConcurrently(t *testing.T) {
	const n = 4 << 10
	srvMem, cliMem := make([]byte, 2*n), make([]byte, 2*n)
	fill(srvMem, 7)
	srvReg, cliReg := SliceRegion(srvMem, 0, 0), SliceRegion(cliMem, 0, 0)
	held, release := make(chan struct{}), make(chan struct{})
	srv := startAgent(t, Config{Regions: []Region{srvReg}, Authorize: func(_ context.Context, acc *Access) error {
		if acc.RequestID == "held" {
			close(held)
			<-release
		}
		return nil
	}})
	cli := startAgent(t, Config{Regions: []Region{cliReg}})
	read := func(id string, off uint64) *Xfer {
		return &Xfer{Op: OpRead, Peer: srv.Addr().String(), RequestID: id,
			Local: []Desc{{Addr: cliReg.Base + off, Len: n}}, Remote: []Desc{{Addr: srvReg.Base + off, Len: n}}}
	}
	// Several READs one after another first, so idle goroutines exist.
	for range 3 {
		_, err := cli.Transfer(t.Context(), read("warm", n))
		require.NoError(t, err)
	}
	heldErr := make(chan error, 1)
	go func() {
		_, err := cli.Transfer(t.Context(), read("held", 0))
		heldErr <- err
	}()
	<-held
	for range 3 {
		res, err := cli.Transfer(t.Context(), read("next", n))
		require.NoError(t, err, "a READ behind a held one on the same connection")
		require.Equal(t, uint64(n), res.Bytes)
	}
	require.Empty(t, heldErr, "the held READ finished before its Authorize returned")
	close(release)
	require.NoError(t, <-heldErr)
	require.Equal(t, srvMem, cliMem)
	require.Equal(t, 1, cli.DialCount(srv.Addr().String()), "one connection")
}

// TestMetricsSharedRegistry: agents sharing a registry count into the same
// series (the children each caches are the registered collector's).
func TestMetricsSharedRegistry(t *testing.T) {
	const n = 64 << 10
	srvMem, cliMem := make([]byte, n), make([]byte, n)
	srvReg, cliReg := SliceRegion(srvMem, 0, 0), SliceRegion(cliMem, 0, 0)
	reg := prometheus.NewRegistry()
	// The server counts a transfer after its last byte or ack went out,
	// when the client may have returned already: Release runs after that
	// count, so the test waits for it before reading the counters.
	released := make(chan struct{}, 3)
	srv := startAgent(t, Config{Regions: []Region{srvReg}, Authorize: allowAll, Registerer: reg,
		Release: func(*Access) { released <- struct{}{} }})
	cli := startAgent(t, Config{Regions: []Region{cliReg}, Registerer: reg})
	x := &Xfer{Op: OpRead, Peer: srv.Addr().String(), Local: []Desc{{Addr: cliReg.Base, Len: n}}, Remote: []Desc{{Addr: srvReg.Base, Len: n}}}
	for range 2 {
		_, err := cli.Transfer(t.Context(), x)
		require.NoError(t, err)
	}
	x.Op = OpWrite
	_, err := cli.Transfer(t.Context(), x)
	require.NoError(t, err)
	for range 3 {
		<-released
	}
	got := func(vec *prometheus.CounterVec, labels ...string) float64 {
		return promtest.ToFloat64(vec.WithLabelValues(labels...))
	}
	// Both agents hold the collectors the registry holds.
	require.Same(t, srv.m.xfers, cli.m.xfers)
	require.Equal(t, 2.0, got(cli.m.xfers, "read", "client", "ok"))
	require.Equal(t, 2.0, got(cli.m.xfers, "read", "server", "ok"))
	require.Equal(t, 1.0, got(cli.m.xfers, "write", "client", "ok"))
	require.Equal(t, 1.0, got(cli.m.xfers, "write", "server", "ok"))
	require.Equal(t, 2.0*n, got(cli.m.bytes, "read", "client"))
	require.Equal(t, 2.0*n, got(cli.m.bytes, "read", "server"))
	require.Equal(t, 1.0*n, got(cli.m.bytes, "write", "server"))
	require.Equal(t, 0.0, got(cli.m.xfers, "read", "client", "error"))
}
