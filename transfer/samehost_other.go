//go:build !linux

package transfer

import (
	"errors"
	"fmt"
	"net"
	"os"
)

// sameHostSupported: the same-host path needs Linux (SCM_RIGHTS,
// SO_PEERCRED, /proc/self/fd); READs go over QUIC elsewhere.
const sameHostSupported = false

var errNoSameHost = fmt.Errorf("transfer: the same-host path needs Linux: %w", errors.ErrUnsupported)

func peerUID(*net.UnixConn) (int, int, error)                          { return 0, 0, errNoSameHost }
func reopenReadOnly(*os.File) (*os.File, error)                        { return nil, errNoSameHost }
func reserveWindow(uint64) ([]byte, error)                             { return nil, errNoSameHost }
func mapInto([]byte, uint64, *os.File, uint64, uint64) ([]byte, error) { return nil, errNoSameHost }
func unmap([]byte) error                                               { return errNoSameHost }
