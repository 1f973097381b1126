package demo

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/qlog"
	"github.com/quic-go/quic-go/qlogwriter"

	"github.com/kvsidecar/kvsidecar/internal/netem"
	"github.com/kvsidecar/kvsidecar/transfer"
)

// rttDesc is the descriptor size of the READ at an injected RTT.
const rttDesc = 1 << 20

// rttBulk runs the READ at an injected RTT between two new agents whose
// sockets delay each datagram by RTT/2, and fills res's RTT fields.
func (b *xferBench) rttBulk(ctx context.Context, res *TransferResult, st, ct *tls.Config) (err error) {
	rtt := b.c.RTT
	total := min(b.c.RTTBulkBytes, len(b.srvMem))
	// Receive windows of the bandwidth-delay product, at twice the
	// loopback READ throughput this run measured (at least 1 GB/s).
	bw := max(res.SidecarReadGBPerS, 1) * 2e9
	win := min(max(uint64(bw*rtt.Seconds()), transfer.DefaultMaxStreamWindow), 1<<30)
	win = (win + 1<<20 - 1) &^ (1<<20 - 1) // whole MiB
	var lost lossCounter
	agent := func(cfg transfer.Config) (*transfer.Agent, error) {
		udp, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			return nil, fmt.Errorf("demo: transfer bench at %v RTT: listen: %w", rtt, err)
		}
		cfg.PacketConn = netem.NewUDP(udp, rtt/2)
		cfg.MaxStreamWindow, cfg.MaxConnWindow = win, 2*win
		cfg.QUICTracer = lost.trace
		cfg.Logger = b.c.Logger
		a, err := transfer.New(&cfg)
		if err != nil {
			_ = cfg.PacketConn.Close()
		}
		return a, err
	}
	allow := func(context.Context, *transfer.Access) error { return nil }
	srv, err := agent(transfer.Config{ServerTLS: st, Regions: []transfer.Region{b.srvReg}, Authorize: allow})
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, srv.Close()) }()
	cli, err := agent(transfer.Config{ClientTLS: ct, Regions: []transfer.Region{b.cliReg}})
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, cli.Close()) }()
	x := &transfer.Xfer{Op: transfer.OpRead, Peer: srv.Addr().String()}
	for off := 0; off < total; off += rttDesc {
		n := uint64(min(rttDesc, total-off))
		x.Local = append(x.Local, transfer.Desc{Addr: b.cliReg.Base + uint64(off), Len: n})
		x.Remote = append(x.Remote, transfer.Desc{Addr: b.srvReg.Base + uint64(off), Len: n})
	}
	n := min(4096, uint64(total))
	warm := &transfer.Xfer{Op: transfer.OpRead, Peer: x.Peer,
		Local: []transfer.Desc{{Addr: b.cliReg.Base, Len: n}}, Remote: []transfer.Desc{{Addr: b.srvReg.Base, Len: n}}}
	if _, err := cli.Transfer(ctx, warm); err != nil {
		return fmt.Errorf("demo: transfer bench at %v RTT: first READ: %w", rtt, err)
	}
	var first, best time.Duration
	for i := range 1 + b.c.BulkRounds {
		r, err := cli.Transfer(ctx, x)
		if err != nil {
			return fmt.Errorf("demo: transfer bench at %v RTT: READ of %d B: %w", rtt, total, err)
		}
		switch {
		case i == 0:
			first = r.Duration
		case best == 0 || r.Duration < best:
			best = r.Duration
		}
	}
	res.RTTMs = round(float64(rtt)/1e6, 3)
	res.RTTBulkBytes = total
	res.RTTBulkGBPerS = round(float64(total)/first.Seconds()/1e9, 4)
	res.RTTBulkRTTs = round(float64(first)/float64(rtt), 2)
	res.RTTBulkWarmRTTs = round(float64(best)/float64(rtt), 2)
	res.RTTWindowBytes = win
	res.RTTBulkLostPackets = new(lost.n.Load())
	return nil
}

// lossCounter counts the packets quic-go declared lost on the connections
// it traces (transfer.Config.QUICTracer).
type lossCounter struct{ n atomic.Int64 }

func (l *lossCounter) trace(context.Context, bool, quic.ConnectionID) qlogwriter.Trace { return l }

// AddProducer implements qlogwriter.Trace.
func (l *lossCounter) AddProducer() qlogwriter.Recorder { return l }

// RecordEvent implements qlogwriter.Recorder.
func (l *lossCounter) RecordEvent(e qlogwriter.Event) {
	if _, ok := e.(qlog.PacketLost); ok {
		l.n.Add(1)
	}
}

// Close implements qlogwriter.Recorder.
func (l *lossCounter) Close() error { return nil }
