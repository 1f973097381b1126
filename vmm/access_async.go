package vmm

import (
	"errors"
	"fmt"
)

// HostBuffer returns n bytes of host memory from which CopyOutAsync and
// CopyInAsync run in the background (page-locked memory of the CUDA
// backend), and free, which gives it back; buf is valid until free or the
// backend's Close. A backend that is not an AsyncCopier (the host backend:
// use HostBytes) returns an error wrapping errors.ErrUnsupported.
func (p *Pool) HostBuffer(n int) (buf []byte, free func() error, err error) {
	ac, ok := p.be.(AsyncCopier)
	if !ok {
		return nil, nil, fmt.Errorf("vmm: host buffer: backend %T has no asynchronous copies: %w", p.be, errors.ErrUnsupported)
	}
	return ac.HostBuffer(n)
}

// CopyOutAsync starts a copy of bytes [off, off+len(dst)) of region into
// dst and returns wait, which blocks until it is done and returns its
// error. dst stays untouched, and the blocks in the range allocated (or
// pinned), until wait returns. With dst from HostBuffer the copy runs while
// the caller does other work (double buffering); on a backend that is not
// an AsyncCopier the copy is done (CopyOut) before CopyOutAsync returns and
// wait returns nil. Errors as for CopyOut.
func (p *Pool) CopyOutAsync(region int, off uint64, dst []byte) (wait func() error, err error) {
	return p.copyAsync("read", region, off, dst)
}

// CopyInAsync starts a copy of src into bytes [off, off+len(src)) of
// region; src stays unchanged until wait returns. As CopyOutAsync
// otherwise.
func (p *Pool) CopyInAsync(region int, off uint64, src []byte) (wait func() error, err error) {
	return p.copyAsync("write", region, off, src)
}

// copyAsync is CopyOutAsync (op "read") and CopyInAsync (op "write").
func (p *Pool) copyAsync(op string, region int, off uint64, buf []byte) (func() error, error) {
	addr, err := p.checkRange(op, region, off, uint64(len(buf)))
	if err != nil {
		return nil, err
	}
	if len(buf) == 0 {
		return doneWait, nil
	}
	ac, async := p.be.(AsyncCopier)
	switch {
	case async && op == "read":
		return ac.CopyOutAsync(addr, buf)
	case async:
		return ac.CopyInAsync(addr, buf)
	case op == "read":
		err = p.be.CopyOut(addr, buf)
	default:
		err = p.be.CopyIn(addr, buf)
	}
	if err != nil {
		return nil, err
	}
	return doneWait, nil
}

func doneWait() error { return nil }
