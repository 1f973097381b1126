//go:build !linux

package vmm

import (
	"errors"
	"fmt"
)

// DefaultHostPageSize is the host backend's default page size: 2 MiB.
const DefaultHostPageSize = 2 << 20

// HostConfig configures NewHostBackend; see the Linux build.
type HostConfig struct {
	PageSize uint64
	Name     string
}

// HostBackend exists only on Linux (memfd).
type HostBackend struct{ Backend }

// NewHostBackend returns an error wrapping errors.ErrUnsupported off Linux.
func NewHostBackend(*HostConfig) (*HostBackend, error) {
	return nil, fmt.Errorf("vmm: host backend needs Linux memfd: %w", errors.ErrUnsupported)
}
