package unixsock

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
	"syscall"
	"time"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// MaxPath is the longest unix socket path in bytes: sun_path holds 108
// bytes on Linux, including the terminating NUL (unix(7)).
const MaxPath = 107

// HashDigits is the number of hex digits of the engine id's SHA-256
// appended to a sanitized or shortened engine id so distinct ids keep
// distinct paths.
const HashDigits = 12

// probeTimeout bounds the connect that tells a live socket from a stale one.
const probeTimeout = time.Second

// Errors. Each is a *codes.Error of the class named.
var (
	// ErrSocketInUse: a live process serves the socket path; it is not
	// stolen (CODE_ALREADY_EXISTS).
	ErrSocketInUse = codes.New(v1.Code_CODE_ALREADY_EXISTS, "unixsock: socket in use by a live process")
	// ErrUnsafeDir: the socket directory is not a directory owned by this
	// user with mode 0700 or stricter (CODE_INVALID_ARGUMENT).
	ErrUnsafeDir = codes.New(v1.Code_CODE_INVALID_ARGUMENT, "unixsock: unsafe socket directory")
	// ErrInvalidPath: no socket path can be made of the arguments (relative
	// directory, empty engine id, a directory too long for sun_path), or
	// the path holds a file that is not a socket (CODE_INVALID_ARGUMENT,
	// reason SOCKET_PATH_INVALID).
	ErrInvalidPath = codes.NewReason(v1.Code_CODE_INVALID_ARGUMENT, codes.ReasonSocketPathInvalid, "unixsock: invalid socket path")
)

// Path returns the socket path of engine engineID in dir:
// <dir>/kvsidecar-<id><suffix>, where the caller's suffix names the rank and
// the socket ("-tp3.sock", "-tp3-api.sock"). It depends on nothing else, in
// particular not on the device ordinal, so every process computes every
// other's path. <id> is engineID when it consists only of [A-Za-z0-9._-]
// and fits; otherwise the disallowed bytes are replaced with '_', the result
// is shortened to fit MaxPath, and "-" plus the first 12 hex digits of
// SHA-256(engineID) is appended, so distinct engine ids map to distinct
// paths. Errors wrap ErrInvalidPath: dir relative, engineID empty, or dir
// too long to leave room for any name.
func Path(dir, engineID, suffix string) (string, error) {
	switch {
	case !filepath.IsAbs(dir):
		return "", fmt.Errorf("%w: socket dir %q: must be an absolute path", ErrInvalidPath, dir)
	case engineID == "":
		return "", fmt.Errorf("%w: engine id is empty", ErrInvalidPath)
	}
	dir = filepath.Clean(dir)
	prefix := dir + string(filepath.Separator) + "kvsidecar-"
	room := MaxPath - len(prefix) - len(suffix)

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
	tag := "-" + hex.EncodeToString(sum[:])[:HashDigits]
	keep := room - len(tag)
	if keep < 1 {
		return "", fmt.Errorf("%w: socket dir %q is %d bytes: too long for a unix socket path of at most %d bytes",
			ErrInvalidPath, dir, len(dir), MaxPath)
	}
	return prefix + string(id[:min(len(id), keep)]) + tag + suffix, nil
}

// PrepareDir creates dir with mode 0700 if it is missing, then checks it as
// CheckDir does.
func PrepareDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("unixsock: create socket dir %q: %w", dir, err)
	}
	return CheckDir(dir)
}

// CheckDir checks that dir is a directory (not a symlink) owned by this
// user that grants nothing to group or others, so no other user can plant,
// replace or connect to a socket in it. Errors wrap ErrUnsafeDir, or are
// the lstat error.
func CheckDir(dir string) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("unixsock: socket dir: %w", err)
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

// Listen listens on path and makes the socket mode 0600; closing the
// listener removes the socket file. The directory of path must pass
// CheckDir. A socket file left by a dead process (connecting is refused) is
// removed and replaced; a socket that a live process serves is not touched
// (ErrSocketInUse); any other file at path is left alone (ErrInvalidPath).
// The probe connect ends with ctx or after a second.
func Listen(ctx context.Context, path string) (*net.UnixListener, error) {
	if err := CheckDir(filepath.Dir(path)); err != nil {
		return nil, err
	}
	if err := removeStale(ctx, path); err != nil {
		return nil, err
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("unixsock: listen on %q: %w", path, err)
	}
	ln.SetUnlinkOnClose(true)
	if err := os.Chmod(path, 0o600); err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("unixsock: chmod socket %q: %w", path, err)
	}
	return ln, nil
}

// removeStale removes a socket file at path that nobody accepts on.
func removeStale(ctx context.Context, path string) error {
	fi, err := os.Lstat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case err != nil:
		return fmt.Errorf("unixsock: socket %q: %w", path, err)
	case fi.Mode().Type() != fs.ModeSocket:
		return fmt.Errorf("%w: %q exists and is not a socket (%v); refusing to replace it", ErrInvalidPath, path, fi.Mode().Type())
	}
	d := net.Dialer{Timeout: probeTimeout}
	c, err := d.DialContext(ctx, "unix", path)
	switch {
	case err == nil:
		_ = c.Close()
		return fmt.Errorf("%w: %q accepts connections; is another sidecar of the same engine id and rank running?", ErrSocketInUse, path)
	case errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ENOENT):
		// Nobody listens: the file outlived its process (or went just now).
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("unixsock: remove stale socket %q: %w", path, err)
		}
		return nil
	}
	return fmt.Errorf("unixsock: probe existing socket %q: %w", path, err)
}
