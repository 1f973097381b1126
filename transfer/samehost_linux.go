//go:build linux

package transfer

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

// sameHostSupported: the same-host path runs on Linux (SCM_RIGHTS,
// SO_PEERCRED, /proc/self/fd).
const sameHostSupported = true

// peerUID returns the uid and pid of the process at the other end of c
// (SO_PEERCRED, unix(7)).
func peerUID(c *net.UnixConn) (uid, pid int, err error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, 0, err
	}
	var cred *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, 0, err
	}
	if serr != nil {
		return 0, 0, fmt.Errorf("transfer: SO_PEERCRED: %w", serr)
	}
	return int(cred.Uid), int(cred.Pid), nil
}

// reopenReadOnly opens the file behind f anew, read-only (through
// /proc/self/fd, which a memfd allows), so whoever gets the new descriptor
// can map it PROT_READ only.
func reopenReadOnly(f *os.File) (*os.File, error) {
	ro, err := os.OpenFile("/proc/self/fd/"+strconv.Itoa(int(f.Fd())), os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("transfer: reopen %s read-only: %w", f.Name(), err)
	}
	return ro, nil
}

// reserveWindow reserves size bytes of address space with no access and
// no memory behind it, for mapInto to map a peer's pages into: one munmap
// of the window then removes them all (one TLB shootdown, not one per
// page).
func reserveWindow(size uint64) ([]byte, error) {
	b, err := unix.Mmap(-1, 0, int(size), unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, fmt.Errorf("transfer: reserve %d bytes of address space for a peer's pages: %w", size, err)
	}
	return b, nil
}

// mapInto maps bytes [off, off+n) of f read-only and shared at window[at:],
// page tables filled at once (MAP_POPULATE: the copy that follows touches
// every byte), and returns that part of the window.
func mapInto(window []byte, at uint64, f *os.File, off, n uint64) ([]byte, error) {
	if at+n > uint64(len(window)) {
		return nil, fmt.Errorf("transfer: %d bytes at %d overrun the %d-byte window", n, at, len(window))
	}
	if _, err := unix.MmapPtr(int(f.Fd()), int64(off), unsafe.Pointer(&window[at]), uintptr(n), unix.PROT_READ,
		unix.MAP_SHARED|unix.MAP_FIXED|unix.MAP_POPULATE); err != nil {
		return nil, fmt.Errorf("transfer: mmap %d bytes at offset %d of a peer's page file: %w", n, off, err)
	}
	return window[at : at+n : at+n], nil
}

// unmap removes a window and everything mapped into it.
func unmap(b []byte) error { return unix.Munmap(b) }
