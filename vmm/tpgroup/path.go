package tpgroup

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

// maxSocketPath is the longest unix socket path in bytes: sun_path holds
// 108 bytes on Linux, including the terminating NUL (unix(7)).
const maxSocketPath = 107

// hashLen is the number of hex digits of the engine id's SHA-256 appended to
// a sanitized or shortened engine id so distinct ids keep distinct paths.
const hashLen = 12

// SocketPath returns the socket path of rank tpRank of engine engineID in
// dir: <dir>/kvsidecar-<id>-tp<rank>.sock. It depends on nothing else — in
// particular not on the device ordinal — so every member computes every
// other member's path. <id> is engineID when it consists only of
// [A-Za-z0-9._-] and fits; otherwise the disallowed bytes are replaced with
// '_', the result is shortened to fit sun_path (107 bytes plus NUL), and
// "-" plus the first 12 hex digits of SHA-256(engineID) is appended, so
// distinct engine ids map to distinct paths. It fails when dir is relative or
// too long to leave room for any name, or when the arguments break the
// Member rules.
func SocketPath(dir, engineID string, tpRank int) (string, error) {
	if !filepath.IsAbs(dir) {
		return "", fmt.Errorf("%w: socket dir %q: must be an absolute path", ErrInvalidConfig, dir)
	}
	if tpRank < 0 || tpRank >= MaxTPSize {
		return "", fmt.Errorf("%w: TPRank=%d: must be in [0, %d)", ErrInvalidConfig, tpRank, MaxTPSize)
	}
	if err := (Member{EngineID: engineID, TPSize: tpRank + 1, TPRank: tpRank}).validate(); err != nil {
		return "", err
	}
	dir = filepath.Clean(dir)
	suffix := "-tp" + strconv.Itoa(tpRank) + ".sock"
	prefix := dir + string(filepath.Separator) + "kvsidecar-"
	room := maxSocketPath - len(prefix) - len(suffix)

	clean := true
	id := []byte(engineID)
	for i, c := range id {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			id[i] = '_'
			clean = false
		}
	}
	if clean && len(id) <= room {
		return prefix + string(id) + suffix, nil
	}
	sum := sha256.Sum256([]byte(engineID))
	tag := "-" + hex.EncodeToString(sum[:])[:hashLen]
	keep := room - len(tag)
	if keep < 1 {
		return "", fmt.Errorf("%w: socket dir %q is %d bytes: too long for a unix socket path of at most %d bytes", ErrInvalidConfig, dir, len(dir), maxSocketPath)
	}
	if len(id) > keep {
		id = id[:keep]
	}
	return prefix + string(id) + tag + suffix, nil
}

// prepareDir creates dir with mode 0700 if missing and checks that it is a
// directory (not a symlink) owned by this user that grants nothing to group
// or others, so no other user can plant or connect to the group's sockets.
func prepareDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("tpgroup: create socket dir %q: %w", dir, err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("tpgroup: socket dir: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("%w: %q is a %v, not a directory", ErrUnsafeDir, dir, fi.Mode().Type())
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return fmt.Errorf("%w: %q has mode %04o; want 0700 (nothing for group or others)", ErrUnsafeDir, dir, perm)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Getuid() {
		return fmt.Errorf("%w: %q is owned by uid %d, not by this process's uid %d", ErrUnsafeDir, dir, st.Uid, os.Getuid())
	}
	return nil
}

// listenUnix listens on path, created with mode 0600. A socket file left by
// a dead process (connecting is refused) is removed and replaced; a socket
// that a live process serves is not touched (ErrSocketInUse); any other
// file at path is an error.
func listenUnix(ctx context.Context, path string) (*net.UnixListener, error) {
	fi, err := os.Lstat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return nil, fmt.Errorf("tpgroup: socket %q: %w", path, err)
	case fi.Mode().Type() != fs.ModeSocket:
		return nil, fmt.Errorf("%w: %q exists and is not a socket (%v); refusing to replace it", ErrInvalidConfig, path, fi.Mode().Type())
	default:
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", path)
		switch {
		case err == nil:
			c.Close()
			return nil, fmt.Errorf("%w: %q accepts connections; is another sidecar of the same engine id and rank running?", ErrSocketInUse, path)
		case errors.Is(err, syscall.ECONNREFUSED):
			// Nobody listens: the file outlived its process. Replace it.
			if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return nil, fmt.Errorf("tpgroup: remove stale socket %q: %w", path, err)
			}
		default:
			return nil, fmt.Errorf("tpgroup: probe existing socket %q: %w", path, err)
		}
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("tpgroup: listen on %q: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("tpgroup: chmod socket %q: %w", path, err)
	}
	ln.SetUnlinkOnClose(true)
	return ln, nil
}
