package demo

import (
	"errors"
	"fmt"
	"hash/crc32"
	"runtime"
	"time"

	"github.com/kvsidecar/kvsidecar/internal/benchxfer"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// The floors the path rows are compared with, measured on the same pools
// and descriptors as the READs: memcpy (host backend), pinned
// device↔host copies and the device copy between two imported mappings
// (cuda backend); and what the checksums cost on those bytes.

// memcpyFloor copies every source descriptor into its destination on k
// threads (host backend only).
func (p *pathBench) memcpyFloor(k int) (time.Duration, error) {
	src, err := hostDescs(p.src, p.srcR, p.srcOff, p.blockBytes)
	if err != nil {
		return 0, err
	}
	dst, err := hostDescs(p.dst, p.dstR, p.dstOff, p.blockBytes)
	if err != nil {
		return 0, err
	}
	return benchxfer.Memcpy(dst, src, k)
}

// runs returns offs (descriptors of n bytes) as runs contiguous in the
// region: start offsets and lengths.
func runs(offs []uint64, n int) (at, size []uint64) {
	for _, o := range offs {
		if k := len(at) - 1; k >= 0 && at[k]+size[k] == o {
			size[k] += uint64(n)
			continue
		}
		at, size = append(at, o), append(size, uint64(n))
	}
	return at, size
}

// deviceFloors are the cuda backend's floors, one round: the READ's
// source bytes copied device→host into a pinned buffer and from there
// host→device into the destination, each in runs contiguous in device
// memory, queued at once and waited for together; and the device copy
// from a mapping of the source pool's pages imported into the
// destination's backend (the way a same-host READ maps them) into the
// destination pages. pp is that mapping.
type deviceFloors struct {
	hostBuf   []byte
	free      func() error
	pp        *vmm.PeerPages
	ex        *vmm.Export
	src, dst  []uint64 // the device copies: peer addresses and destination offsets
	toHost    time.Duration
	toDevice  time.Duration
	devToDev  time.Duration
	hostBytes int
}

// newDeviceFloors allocates the pinned buffer and imports the source
// pool's pages into the destination's backend.
func (p *pathBench) newDeviceFloors() (_ *deviceFloors, err error) {
	f := &deviceFloors{}
	defer func() {
		if err != nil {
			err = errors.Join(err, f.close())
		}
	}()
	if f.hostBuf, f.free, err = p.dst.HostBuffer(p.total()); err != nil {
		return f, fmt.Errorf("demo: transfer bench: pinned host buffer: %w", err)
	}
	if f.ex, err = p.src.Export(nil); err != nil {
		return f, fmt.Errorf("demo: transfer bench: export the source pages: %w", err)
	}
	if f.pp, err = p.dst.ImportPeer(f.ex); err != nil {
		return f, fmt.Errorf("demo: transfer bench: import the source pages: %w", err)
	}
	for _, off := range p.srcOff {
		a, err := f.pp.Addr(p.srcR.Index, off, uint64(p.blockBytes))
		if err != nil {
			return f, err
		}
		f.src = append(f.src, a)
	}
	return f, nil
}

func (f *deviceFloors) close() error {
	var errs []error
	if f.pp != nil {
		errs = append(errs, f.pp.Release())
	}
	if f.ex != nil {
		errs = append(errs, f.ex.Close())
	}
	if f.free != nil {
		errs = append(errs, f.free())
	}
	return errors.Join(errs...)
}

// round measures each floor once and keeps each one's best.
func (p *pathBench) deviceFloorRound(f *deviceFloors) error {
	copyRuns := func(pool *vmm.Pool, ri vmm.RegionInfo, offs []uint64, out bool) (time.Duration, error) {
		at, size := runs(offs, p.blockBytes)
		start := time.Now()
		var waits []func() error
		var pos uint64
		for i := range at {
			buf := f.hostBuf[pos : pos+size[i]]
			pos += size[i]
			var w func() error
			var err error
			if out {
				w, err = pool.CopyOutAsync(ri.Index, at[i], buf)
			} else {
				w, err = pool.CopyInAsync(ri.Index, at[i], buf)
			}
			if err != nil {
				return 0, err
			}
			waits = append(waits, w)
		}
		var errs []error
		for _, w := range waits {
			errs = append(errs, w())
		}
		return time.Since(start), errors.Join(errs...)
	}
	d, err := copyRuns(p.src, p.srcR, p.srcOff, true)
	if err != nil {
		return fmt.Errorf("demo: transfer bench: pinned device→host floor: %w", err)
	}
	keepBest(&f.toHost, d)
	if d, err = copyRuns(p.dst, p.dstR, p.dstOff, false); err != nil {
		return fmt.Errorf("demo: transfer bench: pinned host→device floor: %w", err)
	}
	keepBest(&f.toDevice, d)
	copies := make([]vmm.PeerCopy, len(p.dstOff))
	for i, off := range p.dstOff {
		copies[i] = vmm.PeerCopy{Region: p.dstR.Index, Off: off, Src: f.src[i], Len: uint64(p.blockBytes)}
	}
	start := time.Now()
	if err := p.dst.CopyFromPeer(copies); err != nil {
		return fmt.Errorf("demo: transfer bench: device copy floor: %w", err)
	}
	keepBest(&f.devToDev, time.Since(start))
	return nil
}

// keepBest sets *cur to d when d is shorter or *cur is unset.
func keepBest(cur *time.Duration, d time.Duration) {
	if *cur == 0 || d < *cur {
		*cur = d
	}
}

// checksumPass is one pass of CRC-32C over the descriptors at offs of
// region ri of pool, in pieces of unit bytes, the way the connector
// records (prefill) and verifies (decode) them: the bytes in place on the
// host backend, staged through buf (CopyOut, at most maxChecksumRun bytes
// at a time) from device memory.
func checksumPass(pool *vmm.Pool, ri vmm.RegionInfo, offs []uint64, n, unit int, buf []byte) (time.Duration, error) {
	tab := crc32.MakeTable(crc32.Castagnoli)
	var sink uint32
	at, size := runs(offs, n)
	start := time.Now()
	for i := range at {
		for done := uint64(0); done < size[i]; {
			m := min(size[i]-done, maxChecksumRun)
			b, err := pool.HostBytes(ri.Index, at[i]+done, m)
			if err != nil {
				b = buf[:m]
				if err := pool.CopyOut(ri.Index, at[i]+done, b); err != nil {
					return 0, err
				}
			}
			for off := 0; off < len(b); off += unit {
				sink ^= crc32.Update(0, tab, b[off:min(off+unit, len(b))])
			}
			done += m
		}
	}
	d := time.Since(start)
	runtime.KeepAlive(sink)
	return d, nil
}

// maxChecksumRun bounds the bytes a checksum pass reads at once, as the
// connector's (4 MiB).
const maxChecksumRun = 4 << 20
