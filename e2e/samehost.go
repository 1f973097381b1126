package e2e

import (
	"bufio"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// SameHostOn reports whether the sidecars this package starts read from
// each other through the same-host path: `serve --same-host` is on unless
// KVSIDECAR_SAME_HOST (its environment variable, which the sidecars
// inherit) turns it off. make test runs the package both ways.
func SameHostOn() bool {
	v := strings.ToLower(os.Getenv("KVSIDECAR_SAME_HOST"))
	return v != "off" && v != "false" && v != "0"
}

// RequirePath checks that the READs dec dialed took the path the
// environment asks for: some bytes through mapped pages and no fallback to
// QUIC with the same-host path on, none with it off.
func RequirePath(t testing.TB, dec *Sidecar) {
	t.Helper()
	local := dec.Metric(t, "kvsidecar_transfer_same_host_bytes_total", `role="client"`)
	if SameHostOn() {
		require.Positive(t, local, "%s READ through the same-host path", dec.Name)
		require.Zero(t, dec.Metric(t, "kvsidecar_transfer_same_host_fallbacks_total"), "%s fell back to QUIC", dec.Name)
	} else {
		require.Zero(t, local, "%s: --same-host=off, yet bytes moved through mapped pages", dec.Name)
	}
}

// MemfdInodes returns the inodes of the memfds process pid holds open
// (its KV pages on the host backend).
func MemfdInodes(t testing.TB, pid int) []uint64 {
	t.Helper()
	dir := "/proc/" + strconv.Itoa(pid) + "/fd"
	es, err := os.ReadDir(dir)
	require.NoError(t, err)
	var out []uint64
	for _, e := range es {
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil || !strings.HasPrefix(target, "/memfd:") {
			continue
		}
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(dir, e.Name()), &st); err == nil {
			out = append(out, st.Ino)
		}
	}
	return out
}

// HoldsInode reports how many mappings (/proc/<pid>/maps) and open
// descriptors (/proc/<pid>/fd) of process pid name inode.
func HoldsInode(t testing.TB, pid int, inode uint64) (maps, fds int) {
	t.Helper()
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/maps")
	require.NoError(t, err)
	defer f.Close()
	want := strconv.FormatUint(inode, 10)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fs := strings.Fields(sc.Text()); len(fs) >= 5 && fs[4] == want {
			maps++
		}
	}
	require.NoError(t, sc.Err())
	dir := "/proc/" + strconv.Itoa(pid) + "/fd"
	es, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range es {
		var st syscall.Stat_t
		if syscall.Stat(filepath.Join(dir, e.Name()), &st) == nil && st.Ino == inode {
			fds++
		}
	}
	return maps, fds
}
