package demo

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/kvsidecar/kvsidecar/transfer"
)

// LaneSweep is the READ lane counts (transfer.Config.ReadLanes) the
// transfer bench's lane rows measure.
var LaneSweep = []int{1, 2, 4}

// LaneRow is the bulk READ of the bulk comparison (BulkBytes in
// descriptors of BulkBlockSize) striped over K READ lanes. GBPerS is the
// best of BulkRounds READs, in 10^9 bytes per wall-clock second;
// GBPerCPUSecond is the bytes of all of them over the process's user and
// system CPU time while they ran (getrusage), which counts both agents,
// since both run in this process: the cost of a byte on both sides.
type LaneRow struct {
	K              int     `json:"k"`
	GBPerS         float64 `json:"gb_per_s"`
	GBPerCPUSecond float64 `json:"gb_per_cpu_second"`
}

// lanes measures the lane rows: per lane count a fresh dialing agent with
// that many READ lanes (striping any READ: ReadLaneMinBytes 1), warmed by
// one bulk READ and, once all its lanes are up, another, then
// BulkRounds bulk READs, the lane counts interleaved round by round so
// that a change of machine load hits each of them alike.
func (b *xferBench) lanes(ctx context.Context, res *TransferResult, ct *tls.Config) (err error) {
	bs, n := b.c.bulkPlan()
	total := bs * n
	x := &transfer.Xfer{Op: transfer.OpRead, Peer: b.peer}
	for i := range n {
		off := uint64(i * bs)
		x.Local = append(x.Local, transfer.Desc{Addr: b.cliReg.Base + off, Len: uint64(bs)})
		x.Remote = append(x.Remote, transfer.Desc{Addr: b.srvReg.Base + off, Len: uint64(bs)})
	}
	agents := make([]*transfer.Agent, len(LaneSweep))
	defer func() {
		for _, a := range agents {
			if a != nil {
				err = errors.Join(err, a.Close())
			}
		}
	}()
	read := func(i int) error {
		if b.c.Check {
			clear(b.cliMem[:total])
		}
		if _, err := agents[i].Transfer(ctx, x); err != nil {
			return fmt.Errorf("demo: transfer bench READ of %d B on %d lanes: %w", total, LaneSweep[i], err)
		}
		if b.c.Check {
			if j := firstDiff(b.srvMem[:total], b.cliMem[:total]); j >= 0 {
				return fmt.Errorf("demo: transfer bench READ of %d B on %d lanes: byte %d differs", total, LaneSweep[i], j)
			}
		}
		return nil
	}
	for i, k := range LaneSweep {
		a, err := transfer.New(&transfer.Config{ClientTLS: ct, Regions: []transfer.Region{b.cliReg}, Logger: b.c.Logger,
			ReadLanes: k, ReadLaneMinBytes: 1})
		if err != nil {
			return err
		}
		agents[i] = a
		if err := read(i); err != nil {
			return err
		}
		if err := lanesUp(ctx, a, b.peer, k); err != nil {
			return err
		}
		if err := read(i); err != nil { // on all K lanes
			return err
		}
	}
	best := make([]time.Duration, len(LaneSweep))
	cpu := make([]time.Duration, len(LaneSweep))
	for range b.c.BulkRounds {
		for i := range LaneSweep {
			c0, err := cpuTime()
			if err != nil {
				return err
			}
			start := time.Now()
			if err := read(i); err != nil {
				return err
			}
			d := time.Since(start)
			c1, err := cpuTime()
			if err != nil {
				return err
			}
			cpu[i] += c1 - c0
			if best[i] == 0 || d < best[i] {
				best[i] = d
			}
		}
	}
	for i, k := range LaneSweep {
		res.Lanes = append(res.Lanes, LaneRow{K: k,
			GBPerS:         round(float64(total)/best[i].Seconds()/1e9, 4),
			GBPerCPUSecond: round(float64(total*b.c.BulkRounds)/cpu[i].Seconds()/1e9, 4)})
	}
	return nil
}

// lanesUp waits until a has k READ lanes up to peer: they are dialed in
// the background once the first READ's connection is up.
func lanesUp(ctx context.Context, a *transfer.Agent, peer string, k int) error {
	deadline := time.Now().Add(transfer.DefaultHandshakeTimeout)
	for {
		info, err := a.PeerInfo(ctx, peer)
		if err != nil {
			return err
		}
		if info.ReadLanes == k {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("demo: transfer bench: %d of %d READ lanes up after %v", info.ReadLanes, k, transfer.DefaultHandshakeTimeout)
		}
		select {
		case <-time.After(time.Millisecond):
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

// cpuTime is the user plus system CPU time this process used so far.
func cpuTime() (time.Duration, error) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, fmt.Errorf("demo: getrusage: %w", err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), nil
}
