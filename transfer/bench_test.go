package transfer

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/benchxfer"
)

// BenchmarkReadVsBaselines runs, in each iteration, a raw quic-go one-stream
// transfer, Go TLS 1.3 over TCP, and a sidecar READ of 64 × 2 MiB
// descriptors, all of 128 MiB on loopback, and reports each throughput and
// the ratios sidecar/quic (the target: ≥ 0.85) and sidecar/tls-tcp.
func BenchmarkReadVsBaselines(b *testing.B) {
	const (
		descs   = 64
		descLen = 2 << 20
		total   = descs * descLen
	)
	srvTLS, cliTLS := testTLS(b)
	srvMem, cliMem := mmapRegion(b, total), mmapRegion(b, total)
	fill(srvMem, 5)
	srvReg, cliReg := SliceRegion(srvMem, 0, 0), SliceRegion(cliMem, 0, 0)
	srv := startAgent(b, Config{Regions: []Region{srvReg}, Authorize: allowAll})
	cli := startAgent(b, Config{Regions: []Region{cliReg}})
	x := &Xfer{Op: OpRead, Peer: srv.Addr().String()}
	for i := range descs {
		off := uint64(i * descLen)
		x.Local = append(x.Local, Desc{Addr: cliReg.Base + off, Len: descLen})
		x.Remote = append(x.Remote, Desc{Addr: srvReg.Base + off, Len: descLen})
	}
	ctx := context.Background()
	// Warm the connection so the sidecar, like the baselines, is measured
	// without its handshake.
	_, err := cli.Transfer(ctx, x)
	require.NoError(b, err)

	var quicD, tcpD, sideD time.Duration
	b.SetBytes(total)
	b.ReportAllocs()
	for b.Loop() {
		d, err := benchxfer.RawQUIC(ctx, total, descLen, srvTLS, cliTLS, QUICConfig(nil))
		require.NoError(b, err)
		quicD += d
		d, err = benchxfer.TLSTCP(ctx, total, descLen, srvTLS, cliTLS)
		require.NoError(b, err)
		tcpD += d
		res, err := cli.Transfer(ctx, x)
		require.NoError(b, err)
		sideD += res.Duration
	}
	mbps := func(d time.Duration) float64 { return float64(total) * float64(b.N) / d.Seconds() / 1e6 }
	b.ReportMetric(mbps(quicD), "quic-MB/s")
	b.ReportMetric(mbps(tcpD), "tlstcp-MB/s")
	b.ReportMetric(mbps(sideD), "sidecar-MB/s")
	b.ReportMetric(quicD.Seconds()/sideD.Seconds(), "sidecar/quic")
	b.ReportMetric(tcpD.Seconds()/sideD.Seconds(), "sidecar/tlstcp")
}

// BenchmarkSmallRead times, per iteration, a READ of one 4 KiB descriptor
// on a warm connection, and reports next to it a raw quic-go 4 KiB
// request/response on a new stream of a warm connection (same TLS and
// quic-go configuration), and their ratio (the target: ≤ 1.3).
func BenchmarkSmallRead(b *testing.B) {
	const n = 4 << 10
	srvTLS, cliTLS := testTLS(b)
	srvMem, cliMem := make([]byte, n), make([]byte, n)
	fill(srvMem, 3)
	srvReg, cliReg := SliceRegion(srvMem, 0, 0), SliceRegion(cliMem, 0, 0)
	srv := startAgent(b, Config{Regions: []Region{srvReg}, Authorize: allowAll})
	cli := startAgent(b, Config{Regions: []Region{cliReg}})
	x := &Xfer{Op: OpRead, Peer: srv.Addr().String(),
		Local: []Desc{{Addr: cliReg.Base, Len: n}}, Remote: []Desc{{Addr: srvReg.Base, Len: n}}}
	ctx := context.Background()
	_, err := cli.Transfer(ctx, x)
	require.NoError(b, err)
	rt, err := benchxfer.NewRoundTripper(ctx, srvTLS, cliTLS, QUICConfig(nil))
	require.NoError(b, err)
	defer rt.Close()

	var sideD, rawD time.Duration
	b.SetBytes(n)
	b.ReportAllocs()
	for b.Loop() {
		start := time.Now()
		_, err := cli.Transfer(ctx, x)
		require.NoError(b, err)
		sideD += time.Since(start)
		d, err := rt.RoundTrip(ctx, n)
		require.NoError(b, err)
		rawD += d
	}
	us := func(d time.Duration) float64 { return d.Seconds() * 1e6 / float64(b.N) }
	b.ReportMetric(us(sideD), "sidecar-us/read")
	b.ReportMetric(us(rawD), "quic-us/read")
	b.ReportMetric(sideD.Seconds()/rawD.Seconds(), "sidecar/quic")
}
