//go:build !linux

package demo

import (
	"errors"
	"time"

	"github.com/kvsidecar/kvsidecar/transfer"
)

// mapUnmap is the same-host path's page mapping, which runs on Linux only.
func (p *pathBench) mapUnmap(*transfer.Xfer) (time.Duration, error) {
	return 0, errors.ErrUnsupported
}
