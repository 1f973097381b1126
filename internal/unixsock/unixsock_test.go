package unixsock_test

import (
	"crypto/sha256"
	"encoding/hex"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/unixsock"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

func hash12(id string) string {
	s := sha256.Sum256([]byte(id))
	return hex.EncodeToString(s[:])[:12]
}

func TestPath(t *testing.T) {
	tests := []struct {
		name, dir, engine, suffix string
		want                      string
	}{
		{"group socket", "/run/kvs", "prefill-a", "-tp0.sock", "/run/kvs/kvsidecar-prefill-a-tp0.sock"},
		{"local API socket", "/run/kvs/", "prefill-a", "-tp3-api.sock", "/run/kvs/kvsidecar-prefill-a-tp3-api.sock"},
		{"sanitized and hashed", "/run/kvs", "a/b c", "-tp0.sock", "/run/kvs/kvsidecar-a_b_c-" + hash12("a/b c") + "-tp0.sock"},
		{"long id shortened to the limit", "/r", strings.Repeat("x", 200), "-tp1-api.sock",
			"/r/kvsidecar-" + strings.Repeat("x", unixsock.MaxPath-len("/r/kvsidecar-")-len("-tp1-api.sock")-13) + "-" + hash12(strings.Repeat("x", 200)) + "-tp1-api.sock"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := unixsock.Path(tc.dir, tc.engine, tc.suffix)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
			require.LessOrEqual(t, len(got), unixsock.MaxPath)
		})
	}
	for _, tc := range []struct{ name, dir, engine, msg string }{
		{"relative dir", "run", "e", `socket dir "run": must be an absolute path`},
		{"empty engine id", "/run", "", "engine id is empty"},
		{"dir too long", "/" + strings.Repeat("d", 100), "e", "is 101 bytes: too long for a unix socket path of at most 107 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := unixsock.Path(tc.dir, tc.engine, "-tp0.sock")
			require.ErrorIs(t, err, unixsock.ErrInvalidPath)
			require.ErrorContains(t, err, tc.msg)
			require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err))
		})
	}
}

// sockDir returns a fresh directory of mode 0700 (t.TempDir's names can be
// too long for sun_path).
func sockDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "us")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

func TestListen(t *testing.T) {
	dir := sockDir(t)
	path := filepath.Join(dir, "a.sock")
	old := syscall.Umask(0o022) // read the umask: set it and put it back
	syscall.Umask(old)

	ln, err := unixsock.Listen(t.Context(), path)
	require.NoError(t, err)
	fi, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.ModeSocket|0o600, fi.Mode(), "chmod-ed after listen")
	now := syscall.Umask(old)
	require.Equal(t, old, now, "the process umask is left alone")

	_, err = unixsock.Listen(t.Context(), path)
	require.ErrorIs(t, err, unixsock.ErrSocketInUse, "a live socket is not stolen")
	require.ErrorContains(t, err, path)
	require.Equal(t, v1.Code_CODE_ALREADY_EXISTS, codes.Of(err))
	c, err := net.Dial("unix", path)
	require.NoError(t, err, "the live socket still serves")
	require.NoError(t, c.Close())

	require.NoError(t, ln.Close())
	_, err = os.Lstat(path)
	require.ErrorIs(t, err, os.ErrNotExist, "closing removes the socket file")
}

func TestListenReplacesStaleSocket(t *testing.T) {
	path := filepath.Join(sockDir(t), "stale.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	ln.SetUnlinkOnClose(false)
	require.NoError(t, ln.Close())
	fi, err := os.Lstat(path)
	require.NoError(t, err, "a dead listener leaves its file")
	require.Equal(t, os.ModeSocket, fi.Mode().Type())

	ln, err = unixsock.Listen(t.Context(), path)
	require.NoError(t, err)
	c, err := net.Dial("unix", path)
	require.NoError(t, err, "the new listener serves the path")
	require.NoError(t, c.Close())
	require.NoError(t, ln.Close())
}

func TestListenRefuses(t *testing.T) {
	t.Run("a file that is not a socket", func(t *testing.T) {
		path := filepath.Join(sockDir(t), "f.sock")
		require.NoError(t, os.WriteFile(path, []byte("keep"), 0o600))
		_, err := unixsock.Listen(t.Context(), path)
		require.ErrorIs(t, err, unixsock.ErrInvalidPath)
		require.ErrorContains(t, err, "exists and is not a socket")
		b, err := os.ReadFile(path)
		require.NoError(t, err)
		require.Equal(t, "keep", string(b), "left alone")
	})
	t.Run("a directory open to others", func(t *testing.T) {
		dir := sockDir(t)
		require.NoError(t, os.Chmod(dir, 0o755))
		_, err := unixsock.Listen(t.Context(), filepath.Join(dir, "s.sock"))
		require.ErrorIs(t, err, unixsock.ErrUnsafeDir)
		require.ErrorContains(t, err, "has mode 0755")
		require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, codes.Of(err))
	})
	t.Run("a symlink to a directory", func(t *testing.T) {
		dir := sockDir(t)
		link := filepath.Join(sockDir(t), "link")
		require.NoError(t, os.Symlink(dir, link))
		_, err := unixsock.Listen(t.Context(), filepath.Join(link, "s.sock"))
		require.ErrorIs(t, err, unixsock.ErrUnsafeDir)
		require.ErrorContains(t, err, "not a directory")
	})
}

func TestPrepareDir(t *testing.T) {
	dir := filepath.Join(sockDir(t), "a", "b")
	require.NoError(t, unixsock.PrepareDir(dir))
	fi, err := os.Stat(dir)
	require.NoError(t, err)
	require.Equal(t, os.ModeDir|0o700, fi.Mode())
	require.NoError(t, unixsock.PrepareDir(dir), "an existing safe dir is fine")

	file := filepath.Join(sockDir(t), "file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	err = unixsock.PrepareDir(file)
	require.Error(t, err)
	require.ErrorContains(t, err, "not a directory")
}
