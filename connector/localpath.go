package connector

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// maxSocketPath is sun_path (108 bytes) less its NUL.
const maxSocketPath = 107

// LocalSocketPath returns the local API socket of rank tpRank of engine
// engineID in dir: <dir>/kvsidecar-<id>-tp<rank>-api.sock. Like
// tpgroup.SocketPath it depends only on the engine id and the rank (never
// the device): <id> is engineID when it is only [A-Za-z0-9._-] and fits,
// otherwise a sanitized prefix plus "-" and 12 hex digits of its SHA-256.
// Errors (ErrInvalidArgument): dir not absolute or too long, empty engine
// id, rank outside [0, MaxTPSize).
func LocalSocketPath(dir, engineID string, tpRank int) (string, error) {
	switch {
	case !filepath.IsAbs(dir):
		return "", fmt.Errorf("%w: socket dir %q must be an absolute path", ErrInvalidArgument, dir)
	case engineID == "":
		return "", fmt.Errorf("%w: engine id is empty", ErrInvalidArgument)
	case tpRank < 0 || tpRank >= MaxTPSize:
		return "", fmt.Errorf("%w: tp_rank %d must be in [0, %d)", ErrInvalidArgument, tpRank, MaxTPSize)
	}
	prefix := filepath.Clean(dir) + string(filepath.Separator) + "kvsidecar-"
	suffix := "-tp" + strconv.Itoa(tpRank) + "-api.sock"
	room := maxSocketPath - len(prefix) - len(suffix)
	id, clean := []byte(engineID), true
	for i, c := range id {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			id[i], clean = '_', false
		}
	}
	if clean && len(id) <= room {
		return prefix + string(id) + suffix, nil
	}
	sum := sha256.Sum256([]byte(engineID))
	tag := "-" + hex.EncodeToString(sum[:])[:12]
	keep := room - len(tag)
	if keep < 1 {
		return "", fmt.Errorf("%w: socket dir %q is too long for a unix socket path of at most %d bytes", ErrInvalidArgument, dir, maxSocketPath)
	}
	return prefix + string(id[:min(len(id), keep)]) + tag + suffix, nil
}

// ErrSocketInUse: another live process serves the socket path.
var ErrSocketInUse = errors.New("connector: socket in use by a live process")

// listenLocal listens on path with mode 0600. A stale socket (nobody
// accepting) is replaced; a live one is not stolen (ErrSocketInUse); any
// other file at path is left alone and reported.
func listenLocal(path string) (*net.UnixListener, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("%w: %s exists and is not a socket", ErrInvalidArgument, path)
		}
		c, derr := net.DialTimeout("unix", path, time.Second)
		if derr == nil {
			_ = c.Close()
			return nil, fmt.Errorf("%w: %s", ErrSocketInUse, path)
		}
		if !errors.Is(derr, syscall.ECONNREFUSED) && !errors.Is(derr, syscall.ENOENT) {
			return nil, fmt.Errorf("connector: probing %s: %w", path, derr)
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("connector: removing stale socket %s: %w", path, err)
		}
	}
	old := syscall.Umask(0o177)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("connector: listen %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(true)
	if err := os.Chmod(path, 0o600); err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("connector: chmod %s: %w", path, err)
	}
	return ln, nil
}
