//go:build linux

package demo

import (
	"errors"
	"fmt"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvsidecar/kvsidecar/transfer"
)

// mapUnmap maps every page a same-host READ of x maps (the serving side's
// Share answer), as the reader does (read-only with MAP_POPULATE, into one
// reserved window), then unmaps the window, without copying a byte: the
// part of a same-host READ that the memcpy floor does not pay. Host
// backend only.
func (p *pathBench) mapUnmap(x *transfer.Xfer) (_ time.Duration, err error) {
	sp, err := p.srcMem.Share(x.Remote)
	if err != nil {
		return 0, err
	}
	defer func() { err = errors.Join(err, sp.Close()) }()
	var size uint64
	for _, pg := range sp.Pages {
		size += pg.Len
	}
	start := time.Now()
	window, err := unix.Mmap(-1, 0, int(size), unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return 0, fmt.Errorf("demo: transfer bench: reserve %d bytes: %w", size, err)
	}
	var at uint64
	for _, pg := range sp.Pages {
		if _, err := unix.MmapPtr(int(sp.Files[pg.File].Fd()), int64(pg.FileOffset), unsafe.Pointer(&window[at]), uintptr(pg.Len),
			unix.PROT_READ, unix.MAP_SHARED|unix.MAP_FIXED|unix.MAP_POPULATE); err != nil {
			_ = unix.Munmap(window)
			return 0, fmt.Errorf("demo: transfer bench: mmap %d bytes of the source pages: %w", pg.Len, err)
		}
		at += pg.Len
	}
	if err := unix.Munmap(window); err != nil {
		return 0, fmt.Errorf("demo: transfer bench: munmap the source pages: %w", err)
	}
	return time.Since(start), nil
}
