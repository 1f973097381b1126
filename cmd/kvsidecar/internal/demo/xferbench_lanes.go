package demo

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/kvsidecar/kvsidecar/internal/benchxfer"
	"github.com/kvsidecar/kvsidecar/transfer"
)

// DefaultLanes is the READ lane counts (transfer.Config.ReadLanes) of the
// path rows when TransferConfig.Lanes is empty.
var DefaultLanes = []int{1, 2, 4}

// DefaultPathBlockBytes is the descriptor size of the path rows' READs
// when TransferConfig.PathBlockBytes is 0: 1 MiB.
const DefaultPathBlockBytes = 1 << 20

// LaneRow is the path rows' READ of PathBytes in descriptors of
// PathBlockBytes on K READ lanes (transfer.Config.ReadLanes; the
// same-host path copies on K goroutines, the QUIC path stripes over K
// connections), on each path, beside the floors of the same run.
// Throughputs are the best of BulkRounds READs, in 10^9 bytes per
// wall-clock second (the _seconds fields are those best READs);
// GB per CPU-second is the bytes of all rounds over the process's user and
// system CPU time while they ran (getrusage; both agents run in this
// process, so it is the cost of a byte on both sides). Every ratio is the
// quotient of the two throughputs it names; a checksum share is
// (ChecksumRecordSeconds + ChecksumVerifySeconds) of the result over the
// READ's seconds; the QUIC ratios are over the raw quic-go and TLS
// figures of the path rounds (TransferResult.PathRawQUICGBPerS and
// PathTLSTCPGBPerS). Host backend: MemcpyFloorGBPerS is the memcpy of the
// same descriptors on K threads, and RatioSameHostOverMemcpy the
// same-host READ over it; cuda backend: RatioSameHostOverDeviceCopy is
// the same-host READ over the device copy floor (one batch, K plays no
// part in it).
type LaneRow struct {
	K                           int     `json:"k"`
	MemcpyFloorGBPerS           float64 `json:"memcpy_floor_gb_per_s,omitempty"`
	SameHostReadSeconds         float64 `json:"same_host_read_seconds"`
	SameHostReadGBPerS          float64 `json:"same_host_read_gb_per_s"`
	SameHostReadGBPerCPUSecond  float64 `json:"same_host_read_gb_per_cpu_second"`
	RatioSameHostOverMemcpy     float64 `json:"ratio_same_host_over_memcpy,omitempty"`
	RatioSameHostOverDeviceCopy float64 `json:"ratio_same_host_over_device_copy,omitempty"`
	SameHostChecksumShareOfRead float64 `json:"same_host_checksum_share_of_read"`
	QUICReadSeconds             float64 `json:"quic_read_seconds"`
	QUICReadGBPerS              float64 `json:"quic_read_gb_per_s"`
	QUICReadGBPerCPUSecond      float64 `json:"quic_read_gb_per_cpu_second"`
	RatioQUICOverRawQUIC        float64 `json:"ratio_quic_over_raw_quic"`
	RatioQUICOverTLSTCP         float64 `json:"ratio_quic_over_tls_tcp"`
	QUICChecksumShareOfRead     float64 `json:"quic_checksum_share_of_read"`
	RatioSameHostOverQUIC       float64 `json:"ratio_same_host_over_quic"`
}

// laneSet is the lane counts of the path rows: 1 (the headline figures'),
// then the others of c.Lanes in their order.
func (c *TransferConfig) laneSet() []int {
	out := []int{1}
	for _, k := range c.Lanes {
		if k != 1 {
			out = append(out, k)
		}
	}
	return out
}

// pathPlan is the path rows' descriptors: PathBlockBytes (at most the
// bulk's bytes, rounded up to 4 KiB) and as many of them as the bulk's
// bytes fill, at least one.
func (c *TransferConfig) pathPlan(bulkBytes int) (blockBytes, descs int) {
	blockBytes = min(c.PathBlockBytes, (bulkBytes+4095)&^4095)
	return blockBytes, max(1, bulkBytes/blockBytes)
}

// paths measures the path rows and the floors beside them: per lane count
// a reader warmed by one QUIC READ, and once all its lanes are up another,
// and one same-host READ; then BulkRounds rounds, each measuring the
// floors once and, per lane count, the memcpy floor on K threads (host
// backend), the same-host READ and the QUIC READ, so that a change of
// machine load hits each of them alike. The floors include raw quic-go
// and Go TLS 1.3 over TCP moving the same bytes in chunks of the
// descriptor size.
func (b *xferBench) paths(ctx context.Context, res *TransferResult, st, ct *tls.Config) (err error) {
	p := b.pb
	sh, quic := p.xfer(true), p.xfer(false)
	for i, k := range p.lanes {
		if err := p.read(ctx, i, quic); err != nil {
			return err
		}
		if err := lanesUp(ctx, p.readers[i], quic.Peer, k); err != nil {
			return err
		}
		if err := p.read(ctx, i, quic); err != nil { // on all K lanes
			return err
		}
		if err := p.read(ctx, i, sh); err != nil {
			return err
		}
	}
	var dev *deviceFloors
	if p.device {
		if dev, err = p.newDeviceFloors(); err != nil {
			return err
		}
		defer func() { err = errors.Join(err, dev.close()) }()
	}
	unit, err := checksumUnit()
	if err != nil {
		return err
	}
	nl := len(p.lanes)
	memcpy, same, overQUIC := make([]time.Duration, nl), make([]time.Duration, nl), make([]time.Duration, nl)
	sameCPU, quicCPU := make([]time.Duration, nl), make([]time.Duration, nl)
	var record, verify, mapping, rawQUIC, tlsTCP time.Duration
	var buf []byte
	if p.device {
		buf = make([]byte, min(p.total(), maxChecksumRun))
	}
	timed := func(cpu *time.Duration, fn func() error) (time.Duration, error) {
		c0, err := cpuTime()
		if err != nil {
			return 0, err
		}
		start := time.Now()
		if err := fn(); err != nil {
			return 0, err
		}
		d := time.Since(start)
		c1, err := cpuTime()
		if err != nil {
			return 0, err
		}
		*cpu += c1 - c0
		return d, nil
	}
	for range b.c.BulkRounds {
		if dev != nil {
			if err := p.deviceFloorRound(dev); err != nil {
				return err
			}
		} else {
			d, err := p.mapUnmap(sh)
			if err != nil {
				return err
			}
			keepBest(&mapping, d)
		}
		d, err := benchxfer.RawQUIC(ctx, p.total(), p.blockBytes, st, ct, transfer.QUICConfig(nil))
		if err != nil {
			return fmt.Errorf("demo: raw quic-go floor: %w", err)
		}
		keepBest(&rawQUIC, d)
		if d, err = benchxfer.TLSTCP(ctx, p.total(), p.blockBytes, st, ct); err != nil {
			return fmt.Errorf("demo: TLS-over-TCP floor: %w", err)
		}
		keepBest(&tlsTCP, d)
		if d, err = checksumPass(p.src, p.srcR, p.srcOff, p.blockBytes, unit, buf); err != nil {
			return fmt.Errorf("demo: transfer bench: checksums of the source: %w", err)
		}
		keepBest(&record, d)
		if d, err = checksumPass(p.dst, p.dstR, p.dstOff, p.blockBytes, unit, buf); err != nil {
			return fmt.Errorf("demo: transfer bench: checksums of the destination: %w", err)
		}
		keepBest(&verify, d)
		for i, k := range p.lanes {
			if !p.device {
				d, err := p.memcpyFloor(k)
				if err != nil {
					return err
				}
				keepBest(&memcpy[i], d)
			}
			d, err := timed(&sameCPU[i], func() error { return p.read(ctx, i, sh) })
			if err != nil {
				return err
			}
			keepBest(&same[i], d)
			if d, err = timed(&quicCPU[i], func() error { return p.read(ctx, i, quic) }); err != nil {
				return err
			}
			keepBest(&overQUIC[i], d)
		}
	}
	total := float64(p.total())
	gbps := func(d time.Duration) float64 { return total / d.Seconds() / 1e9 }
	perCPU := func(cpu time.Duration) float64 { return total * float64(b.c.BulkRounds) / cpu.Seconds() / 1e9 }
	sums := record + verify
	res.PathBlockBytes, res.PathBytes = p.blockBytes, p.total()
	res.PathMemory = "host"
	res.PathRawQUICGBPerS, res.PathTLSTCPGBPerS = gbps(rawQUIC), gbps(tlsTCP)
	res.ChecksumRecordSeconds, res.ChecksumVerifySeconds = record.Seconds(), verify.Seconds()
	if p.device {
		res.PathMemory = "device"
		res.DeviceToHostFloorGBPerS, res.HostToDeviceFloorGBPerS = gbps(dev.toHost), gbps(dev.toDevice)
		res.DeviceCopyFloorGBPerS = gbps(dev.devToDev)
	} else {
		res.MemcpyFloorGBPerS = gbps(memcpy[0])
		res.MapUnmapSeconds = mapping.Seconds()
		res.MapUnmapShareOfSameHostRead = mapping.Seconds() / same[0].Seconds()
	}
	for i, k := range p.lanes {
		r := LaneRow{K: k,
			SameHostReadSeconds: same[i].Seconds(), SameHostReadGBPerS: gbps(same[i]), SameHostReadGBPerCPUSecond: perCPU(sameCPU[i]),
			SameHostChecksumShareOfRead: sums.Seconds() / same[i].Seconds(),
			QUICReadSeconds:             overQUIC[i].Seconds(), QUICReadGBPerS: gbps(overQUIC[i]), QUICReadGBPerCPUSecond: perCPU(quicCPU[i]),
			QUICChecksumShareOfRead: sums.Seconds() / overQUIC[i].Seconds()}
		r.RatioQUICOverRawQUIC = r.QUICReadGBPerS / res.PathRawQUICGBPerS
		r.RatioQUICOverTLSTCP = r.QUICReadGBPerS / res.PathTLSTCPGBPerS
		r.RatioSameHostOverQUIC = r.SameHostReadGBPerS / r.QUICReadGBPerS
		if p.device {
			r.RatioSameHostOverDeviceCopy = r.SameHostReadGBPerS / res.DeviceCopyFloorGBPerS
		} else {
			r.MemcpyFloorGBPerS = gbps(memcpy[i])
			r.RatioSameHostOverMemcpy = r.SameHostReadGBPerS / r.MemcpyFloorGBPerS
		}
		res.Lanes = append(res.Lanes, r)
	}
	one := res.Lanes[0]
	res.SameHostReadGBPerS, res.QUICReadGBPerS = one.SameHostReadGBPerS, one.QUICReadGBPerS
	res.RatioSameHostOverMemcpy, res.RatioSameHostOverDeviceCopy = one.RatioSameHostOverMemcpy, one.RatioSameHostOverDeviceCopy
	res.RatioSameHostOverQUIC = one.RatioSameHostOverQUIC
	res.SameHostChecksumShareOfRead, res.QUICChecksumShareOfRead = one.SameHostChecksumShareOfRead, one.QUICChecksumShareOfRead
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
