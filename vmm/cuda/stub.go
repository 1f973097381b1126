//go:build !(linux && cgo)

package cuda

import (
	"errors"
	"fmt"
	"os"

	"github.com/kvsidecar/kvsidecar/vmm"
)

// Backend is the CUDA VMM backend; in this build (no cgo or not Linux) it
// cannot be created.
type Backend struct{}

var (
	_ vmm.Backend     = (*Backend)(nil)
	_ vmm.Importer    = (*Backend)(nil)
	_ vmm.AsyncCopier = (*Backend)(nil)
	_ vmm.PeerCopier  = (*Backend)(nil)
)

// New returns an error wrapping errors.ErrUnsupported and ErrNoGPU: this
// build has no cgo or is not Linux.
func New(*Config) (*Backend, error) {
	return nil, fmt.Errorf("cuda: built without cgo on Linux: %w", errors.Join(errors.ErrUnsupported, ErrNoGPU))
}

func unsupported() error { return fmt.Errorf("cuda: %w", errors.ErrUnsupported) }

// Granularity returns 0.
func (*Backend) Granularity() uint64 { return 0 }

// LibraryPath returns "".
func (*Backend) LibraryPath() string { return "" }

// DriverVersion returns 0.
func (*Backend) DriverVersion() int { return 0 }

// DevID returns -1.
func (*Backend) DevID() int { return -1 }

// Reserve is unsupported in this build.
func (*Backend) Reserve(uint64) (uint64, error) { return 0, unsupported() }

// FreeReservation is unsupported in this build.
func (*Backend) FreeReservation(uint64, uint64) error { return unsupported() }

// Create is unsupported in this build.
func (*Backend) Create() (vmm.Handle, error) { return 0, unsupported() }

// Release is unsupported in this build.
func (*Backend) Release(vmm.Handle) error { return unsupported() }

// Map is unsupported in this build.
func (*Backend) Map(uint64, vmm.Handle) error { return unsupported() }

// Unmap is unsupported in this build.
func (*Backend) Unmap(uint64) error { return unsupported() }

// SetAccess is unsupported in this build.
func (*Backend) SetAccess(uint64, uint64) error { return unsupported() }

// Export is unsupported in this build.
func (*Backend) Export(vmm.Handle) (*os.File, uint64, error) { return nil, 0, unsupported() }

// Import is unsupported in this build.
func (*Backend) Import(*os.File, uint64) (vmm.Handle, error) { return 0, unsupported() }

// CopyIn is unsupported in this build.
func (*Backend) CopyIn(uint64, []byte) error { return unsupported() }

// CopyOut is unsupported in this build.
func (*Backend) CopyOut(uint64, []byte) error { return unsupported() }

// HostBuffer is unsupported in this build.
func (*Backend) HostBuffer(int) ([]byte, func() error, error) { return nil, nil, unsupported() }

// CopyOutAsync is unsupported in this build.
func (*Backend) CopyOutAsync(uint64, []byte) (func() error, error) { return nil, unsupported() }

// CopyInAsync is unsupported in this build.
func (*Backend) CopyInAsync(uint64, []byte) (func() error, error) { return nil, unsupported() }

// ImportPeerPages is unsupported in this build.
func (*Backend) ImportPeerPages([]*os.File, []uint64) ([]uint64, func() error, error) {
	return nil, nil, unsupported()
}

// CopyDeviceToDevice is unsupported in this build.
func (*Backend) CopyDeviceToDevice(_, _, _ []uint64) error { return unsupported() }

// Close is unsupported in this build.
func (*Backend) Close() error { return unsupported() }
