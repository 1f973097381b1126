package vmm

import (
	"errors"
	"fmt"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Sentinel errors of package vmm. Callers branch on them with errors.Is; the
// returned errors are usually one of the struct types below wrapping one of
// these, so the message names the page, block or address. Each is a
// *codes.Error of the class named, so codes.Of maps it to that v1.Code.
var (
	// ErrAlreadyMapped: a page (or backend slot) that is already mapped was
	// asked to be mapped again. v1.Code_CODE_ALREADY_EXISTS.
	ErrAlreadyMapped = codes.New(v1.Code_CODE_ALREADY_EXISTS, "vmm: page already mapped")
	// ErrNotMapped: an unmapped page was asked to be unmapped, read or
	// written. v1.Code_CODE_NOT_FOUND.
	ErrNotMapped = codes.New(v1.Code_CODE_NOT_FOUND, "vmm: page not mapped")
	// ErrOverLimit: the memory limit, the reservation or the device memory
	// does not leave room for the request. v1.Code_CODE_BUSY.
	ErrOverLimit = codes.New(v1.Code_CODE_BUSY, "vmm: out of memory or over the memory limit")
	// ErrBlockOutOfRange: a block id outside [1, NumBlocks), or a byte range
	// outside a region. v1.Code_CODE_OUT_OF_RANGE.
	ErrBlockOutOfRange = codes.New(v1.Code_CODE_OUT_OF_RANGE, "vmm: block out of range")
	// ErrDoubleFree: a block that is not allocated was freed.
	// v1.Code_CODE_INVALID_ARGUMENT.
	ErrDoubleFree = codes.New(v1.Code_CODE_INVALID_ARGUMENT, "vmm: double free")
	// ErrNotAllocated: a block id in range that is not allocated now (free,
	// possibly in an empty reserve page that may be unmapped at any time)
	// was named where an allocated block is required (Pool.CheckAllocated).
	// v1.Code_CODE_INVALID_ARGUMENT.
	ErrNotAllocated = codes.New(v1.Code_CODE_INVALID_ARGUMENT, "vmm: block not allocated")
	// ErrNullBlock: block 0, the null block, was named in Free. It is
	// allocated at NewPool and never handed out. v1.Code_CODE_INVALID_ARGUMENT.
	ErrNullBlock = codes.New(v1.Code_CODE_INVALID_ARGUMENT, "vmm: block 0 is the reserved null block")
	// ErrBackend: the backend (mmap, fallocate, libcuda) failed.
	// v1.Code_CODE_INTERNAL.
	ErrBackend = codes.New(v1.Code_CODE_INTERNAL, "vmm: backend failure")
	// ErrInvalidConfig: a Config, Layout or geometry breaks a rule.
	// v1.Code_CODE_INVALID_ARGUMENT.
	ErrInvalidConfig = codes.New(v1.Code_CODE_INVALID_ARGUMENT, "vmm: invalid configuration")
)

// PageError reports a failure of one page index of a pool (page p of every
// region, or of the region named by Region when Region >= 0).
type PageError struct {
	Op     string // "map", "unmap", "read", "write", "export"
	Page   int    // page index within every region
	Region int    // region index, or -1 for "every region"
	Err    error  // a sentinel (ErrAlreadyMapped, ErrNotMapped, ...) or a backend error
}

func (e *PageError) Error() string {
	if e.Region < 0 {
		return fmt.Sprintf("vmm: %s page %d: %v", e.Op, e.Page, trimPrefix(e.Err))
	}
	return fmt.Sprintf("vmm: %s page %d of region %d: %v", e.Op, e.Page, e.Region, trimPrefix(e.Err))
}

func (e *PageError) Unwrap() error { return e.Err }

// BlockError reports a block id that breaks a rule of Free, CheckAllocated or
// CheckMapped.
type BlockError struct {
	Block     int   // the offending id
	NumBlocks int   // ids are valid in [1, NumBlocks)
	Err       error // ErrBlockOutOfRange, ErrDoubleFree, ErrNullBlock, ErrNotAllocated or ErrNotMapped
}

func (e *BlockError) Error() string {
	switch {
	case errors.Is(e.Err, ErrBlockOutOfRange):
		return fmt.Sprintf("vmm: block %d out of range [1, %d)", e.Block, e.NumBlocks)
	case errors.Is(e.Err, ErrDoubleFree):
		return fmt.Sprintf("vmm: block %d freed but not allocated (double free)", e.Block)
	default:
		return fmt.Sprintf("vmm: block %d: %v", e.Block, trimPrefix(e.Err))
	}
}

func (e *BlockError) Unwrap() error { return e.Err }

// LimitError reports an allocation or map that the memory limit, the
// reservation or the device refused. It wraps ErrOverLimit.
type LimitError struct {
	Want      int    // blocks (Alloc) or pages (MapPages) asked for
	Available int    // blocks (Alloc) or pages (MapPages) that were possible
	Limit     uint64 // memory limit in bytes, 0 = none
}

func (e *LimitError) Error() string {
	return fmt.Sprintf("vmm: want %d, only %d available under memory limit %d bytes (0 = none): out of memory or over the memory limit",
		e.Want, e.Available, e.Limit)
}

func (e *LimitError) Unwrap() error { return ErrOverLimit }

// AddrError reports a backend failure at a virtual address.
type AddrError struct {
	Op   string // backend operation: "map", "unmap", "set access", "copy in", ...
	Addr uint64 // virtual address (host pointer or CUdeviceptr)
	Err  error
}

func (e *AddrError) Error() string {
	return fmt.Sprintf("vmm: %s at %#x: %v", e.Op, e.Addr, trimPrefix(e.Err))
}

func (e *AddrError) Unwrap() error { return e.Err }

// BackendError wraps an error of the operating system or the driver; it
// matches ErrBackend with errors.Is, and the cause with errors.As/Is.
type BackendError struct {
	Op  string // e.g. "mmap", "fallocate", "cuMemCreate"
	Err error
}

func (e *BackendError) Error() string { return fmt.Sprintf("vmm: backend %s: %v", e.Op, e.Err) }

// Unwrap returns the cause, then ErrBackend: a cause of another class (a
// driver's out-of-memory is ErrOverLimit) decides the code (codes.Of finds
// the first class in the chain); any other failure is ErrBackend's
// CODE_INTERNAL.
func (e *BackendError) Unwrap() []error { return []error{e.Err, ErrBackend} }

// HookError reports that the PageHook failed. Op says which call; for
// "unmap" the local pool already finished its work (blocks freed, pages
// unmapped locally) and only the followers may still hold the pages.
type HookError struct {
	Op    string // "map" or "unmap"
	Pages []int
	Err   error
}

func (e *HookError) Error() string {
	return fmt.Sprintf("vmm: page hook %s of pages %v: %v", e.Op, e.Pages, e.Err)
}

func (e *HookError) Unwrap() error { return e.Err }

func configError(field, format string, args ...any) error {
	return fmt.Errorf("%w: %s: %s", ErrInvalidConfig, field, fmt.Sprintf(format, args...))
}

// trimPrefix drops the "vmm: " of a wrapped vmm error so nested messages
// read "vmm: map page 3: page already mapped" rather than repeating it.
func trimPrefix(err error) string {
	if err == nil {
		return "<nil>"
	}
	s := err.Error()
	if len(s) > 5 && s[:5] == "vmm: " {
		return s[5:]
	}
	return s
}
