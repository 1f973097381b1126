package fdpass_test

import (
	"bytes"
	"io"
	"net"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/kvsidecar/kvsidecar/internal/fdpass"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// pair returns two connected Conns over a real unix socket pair.
func pair(t testing.TB) (*fdpass.Conn, *fdpass.Conn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	conv := func(fd int) *fdpass.Conn {
		f := os.NewFile(uintptr(fd), "pair")
		c, err := net.FileConn(f)
		require.NoError(t, err)
		require.NoError(t, f.Close())
		return fdpass.New(c.(*net.UnixConn))
	}
	a, b := conv(fds[0]), conv(fds[1])
	t.Cleanup(func() { _ = a.Close(); _ = b.Close() })
	return a, b
}

// memfile returns a memfd holding content.
func memfile(t testing.TB, content string) *os.File {
	t.Helper()
	fd, err := unix.MemfdCreate("fdpass-test", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	f := os.NewFile(uintptr(fd), "memfd")
	t.Cleanup(func() { _ = f.Close() })
	_, err = f.WriteString(content)
	require.NoError(t, err)
	return f
}

func TestWriteWithFiles(t *testing.T) {
	tests := []struct {
		name   string
		files  int
		frame  int
		wantOK bool
	}{
		{"no files", 0, 10, true},
		{"one file", 1, 10, true},
		{"one batch full", fdpass.MaxFilesPerMsg, 10, true},
		{"three batches", 2*fdpass.MaxFilesPerMsg + 7, 10, true},
		{"more batches than bytes", 2*fdpass.MaxFilesPerMsg + 7, 2, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a, b := pair(t)
			files := make([]*os.File, tc.files)
			for i := range files {
				files[i] = memfile(t, string(rune('a'+i%26)))
			}
			frame := bytes.Repeat([]byte{'x'}, tc.frame)
			err := a.WriteWithFiles(frame, files)
			if !tc.wantOK {
				require.ErrorIs(t, err, fdpass.ErrTooManyFiles)
				return
			}
			require.NoError(t, err)
			got := make([]byte, tc.frame)
			_, err = io.ReadFull(b, got)
			require.NoError(t, err)
			require.Equal(t, frame, got)
			_, err = b.TakeFiles(tc.files + 1)
			require.ErrorIs(t, err, fdpass.ErrMissingFiles)
			recv, err := b.TakeFiles(tc.files)
			require.NoError(t, err)
			require.Len(t, recv, tc.files)
			for i, f := range recv {
				buf := make([]byte, 1)
				_, err := f.ReadAt(buf, 0)
				require.NoError(t, err)
				require.Equal(t, byte('a'+i%26), buf[0], "file %d arrived in order", i)
				require.NoError(t, f.Close())
			}
		})
	}
}

func TestDiscardAndClose(t *testing.T) {
	a, b := pair(t)
	require.NoError(t, a.WriteWithFiles([]byte("hi"), []*os.File{memfile(t, "1"), memfile(t, "2")}))
	got := make([]byte, 2)
	_, err := io.ReadFull(b, got)
	require.NoError(t, err)
	require.Equal(t, 2, b.DiscardFiles())
	require.Equal(t, 0, b.DiscardFiles())
	require.NoError(t, b.Close())
	require.ErrorIs(t, b.Close(), net.ErrClosed)
}
