package transfer

import (
	"errors"
	"fmt"
)

// AsyncMemory is a Memory that is not host-addressable (device memory)
// and copies to and from host buffers asynchronously: a transfer then
// stages its bytes through two page-locked buffers, so the copies of one
// run overlap the stream I/O of the other (double buffering), and packs
// many small descriptors into one buffer with one wait per buffer. The
// connector's adapter of a vmm pool on the CUDA backend implements it
// (vmm.Pool.HostBuffer, CopyOutAsync, CopyInAsync).
type AsyncMemory interface {
	Memory
	// HostBuffer returns n bytes of host memory the copies run from in
	// the background (page-locked), and free, which gives it back.
	HostBuffer(n int) (buf []byte, free func() error, err error)
	// CopyOutAsync starts a copy of bytes [off, off+len(dst)) into dst
	// and returns wait, which blocks until it is done. Copies started
	// through the AsyncMemory of an agent's regions complete in the order
	// they were started (one stream per device), so waiting for the last
	// one waits for all. dst stays untouched until wait returns.
	CopyOutAsync(off uint64, dst []byte) (wait func() error, err error)
	// CopyInAsync starts a copy of src into bytes [off, off+len(src));
	// src stays unchanged until wait returns. As CopyOutAsync otherwise.
	CopyInAsync(off uint64, src []byte) (wait func() error, err error)
}

// eachRun hands fn the bytes of spans, in order, with the span's index and
// the run's offset in the span: host memory as the mapped bytes themselves
// (one run per span); AsyncMemory through two staging buffers, several
// spans packed into one (filled before fn when !in, copied into memory
// after fn when in); other memory through one staging buffer
// (Memory.CopyOut, CopyIn). It returns only once no copy it started runs.
func (c *core) eachRun(spans []span, in bool, fn func(i int, off uint64, b []byte) error) error {
	var sync []byte // the staging buffer of memory that has neither
	for i := 0; i < len(spans); {
		s := spans[i]
		if b, err := s.reg.Mem.HostBytes(s.off, s.n); err == nil {
			if err := fn(i, 0, b); err != nil {
				return err
			}
			i++
			continue
		}
		if am, ok := s.reg.Mem.(AsyncMemory); ok {
			// The run of spans of async memory from i on.
			j := i + 1
			for j < len(spans) {
				if _, ok := spans[j].reg.Mem.(AsyncMemory); !ok {
					break
				}
				if _, err := spans[j].reg.Mem.HostBytes(spans[j].off, min(spans[j].n, 1)); err == nil {
					break
				}
				j++
			}
			err := c.eachRunAsync(am, spans[i:j], in, func(k int, off uint64, b []byte) error { return fn(i+k, off, b) })
			if !errors.Is(err, errNoPinned) {
				if err != nil {
					return err
				}
				i = j
				continue
			}
		}
		if sync == nil {
			sync = make([]byte, c.cfg.StagingBytes)
		}
		if err := c.eachRunSync(s, sync, in, func(off uint64, b []byte) error { return fn(i, off, b) }); err != nil {
			return err
		}
		i++
	}
	return nil
}

// eachRunSync moves span s through buf with synchronous copies.
func (c *core) eachRunSync(s span, buf []byte, in bool, fn func(off uint64, b []byte) error) error {
	for done := uint64(0); done < s.n; {
		b := buf[:min(uint64(len(buf)), s.n-done)]
		if !in {
			if err := s.reg.Mem.CopyOut(s.off+done, b); err != nil {
				return fmt.Errorf("%w: transfer: copy out of region %#x: %w", ErrInternal, s.reg.Base, err)
			}
		}
		if err := fn(done, b); err != nil {
			return err
		}
		if in {
			if err := s.reg.Mem.CopyIn(s.off+done, b); err != nil {
				return fmt.Errorf("%w: transfer: copy into region %#x: %w", ErrInternal, s.reg.Base, err)
			}
		}
		done += uint64(len(b))
	}
	return nil
}

// errNoPinned: no staging buffer could be had; the caller stages
// synchronously.
var errNoPinned = errors.New("transfer: no page-locked staging buffer")

// stagedRun is one run of bytes of a span packed into a staging buffer.
type stagedRun struct {
	k   int    // span index
	off uint64 // offset in the span
	b   []byte // its place in the buffer
}

// stage is one staging buffer and what is packed into it.
type stage struct {
	buf  []byte
	runs []stagedRun
	wait func() error // the last copy queued for it; nil: none
}

// drain waits for the stage's copies.
func (st *stage) drain() error {
	if st.wait == nil {
		return nil
	}
	w := st.wait
	st.wait = nil
	return w()
}

// eachRunAsync moves spans (all of AsyncMemory) through two page-locked
// buffers of Config.StagingBytes: while fn works on one, the copies of the
// other run. !in: the copies of the next buffer are queued, then the
// current one is waited for and handed to fn; in: fn fills a buffer, its
// copies are queued, and the other buffer is waited for before it is
// filled again.
func (c *core) eachRunAsync(am AsyncMemory, spans []span, in bool, fn func(k int, off uint64, b []byte) error) (err error) {
	var stages [2]stage
	for i := range stages {
		buf, free, err := am.HostBuffer(c.cfg.StagingBytes)
		if err != nil {
			if i == 1 {
				_ = stages[0].drain()
			}
			return errNoPinned
		}
		defer func() { _ = free() }()
		stages[i].buf = buf
	}
	defer func() {
		// Nothing returns while a copy it queued may still run.
		for i := range stages {
			if derr := stages[i].drain(); err == nil && derr != nil {
				err = fmt.Errorf("%w: transfer: staged copy: %w", ErrInternal, derr)
			}
		}
	}()
	k, off := 0, uint64(0) // the next byte to pack: span k, offset off
	// pack lays the next bytes out in st (up to its size), queuing their
	// copies out of memory when !in.
	pack := func(st *stage) error {
		st.runs = st.runs[:0]
		used := 0
		for k < len(spans) && used < len(st.buf) {
			s := spans[k]
			n := min(s.n-off, uint64(len(st.buf)-used))
			b := st.buf[used : used+int(n)]
			if !in {
				w, err := s.reg.Mem.(AsyncMemory).CopyOutAsync(s.off+off, b)
				if err != nil {
					return fmt.Errorf("%w: transfer: copy out of region %#x: %w", ErrInternal, s.reg.Base, err)
				}
				st.wait = w
			}
			st.runs = append(st.runs, stagedRun{k: k, off: off, b: b})
			used += int(n)
			if off += n; off == s.n {
				k, off = k+1, 0
			}
		}
		return nil
	}
	cur, next := &stages[0], &stages[1]
	if !in {
		if err := pack(cur); err != nil {
			return err
		}
		for len(cur.runs) > 0 {
			if err := pack(next); err != nil {
				return err
			}
			if err := cur.drain(); err != nil {
				return fmt.Errorf("%w: transfer: staged copy out: %w", ErrInternal, err)
			}
			for _, r := range cur.runs {
				if err := fn(r.k, r.off, r.b); err != nil {
					return err
				}
			}
			cur, next = next, cur
		}
		return nil
	}
	for k < len(spans) {
		if err := cur.drain(); err != nil {
			return fmt.Errorf("%w: transfer: staged copy in: %w", ErrInternal, err)
		}
		if err := pack(cur); err != nil {
			return err
		}
		for _, r := range cur.runs {
			if err := fn(r.k, r.off, r.b); err != nil {
				return err
			}
			s := spans[r.k]
			w, err := s.reg.Mem.(AsyncMemory).CopyInAsync(s.off+r.off, r.b)
			if err != nil {
				return fmt.Errorf("%w: transfer: copy into region %#x: %w", ErrInternal, s.reg.Base, err)
			}
			cur.wait = w
		}
		cur, next = next, cur
	}
	return nil
}
