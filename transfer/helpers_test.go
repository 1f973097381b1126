package transfer

import (
	"context"
	"crypto/tls"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
)

// TestMain makes the package's shared dev CA before any test runs, on the
// real clock: made lazily by whichever test came first, it was made inside a
// synctest bubble when a bubble test came first (its clock starts at
// 2000-01-01), and every later test on the real clock then failed with
// "certificate has expired". Tests in a bubble use simTLS instead.
func TestMain(m *testing.M) {
	ca, err := devtls.NewCA()
	if err != nil {
		panic(err)
	}
	if caSrv, err = ca.ServerConfig(); err != nil {
		panic(err)
	}
	if caCli, err = ca.ClientConfig(); err != nil {
		panic(err)
	}
	goleak.VerifyTestMain(m)
}

// caSrv and caCli are the package's shared mutual-TLS configs, set by TestMain.
var caSrv, caCli *tls.Config

// testTLS returns mutual-TLS configs from the dev CA shared by the package;
// its certificates are valid on the real clock only (see simTLS).
func testTLS(t testing.TB) (srv, cli *tls.Config) {
	t.Helper()
	return caSrv.Clone(), caCli.Clone()
}

// mmapRegion maps size bytes of anonymous page memory (size rounded up to
// pages) between two PROT_NONE guard pages, so any access outside it
// faults. It is unmapped when the test ends.
func mmapRegion(t testing.TB, size int) []byte {
	t.Helper()
	pg := unix.Getpagesize()
	size = (size + pg - 1) / pg * pg
	all, err := unix.Mmap(-1, 0, size+2*pg, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, unix.Munmap(all)) })
	mid := all[pg : pg+size : pg+size]
	require.NoError(t, unix.Mprotect(mid, unix.PROT_READ|unix.PROT_WRITE))
	return mid
}

// fill writes a pattern derived from seed into b.
func fill(b []byte, seed byte) {
	x := uint32(seed)*2654435761 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b[i] = byte(x)
	}
}

// startAgent starts an agent that both serves and dials and closes it at
// the end of the test.
func startAgent(t testing.TB, cfg Config) *Agent {
	t.Helper()
	if cfg.ServerTLS == nil || cfg.ClientTLS == nil {
		srv, cli := testTLS(t)
		if cfg.ServerTLS == nil {
			cfg.ServerTLS = srv
		}
		if cfg.ClientTLS == nil {
			cfg.ClientTLS = cli
		}
	}
	if cfg.ProgressTimeout == 0 {
		// Real loopback on a loaded machine (the race detector, other
		// builds) can starve an agent for seconds; a test that times the
		// progress watchdog sets its own.
		cfg.ProgressTimeout = testutil.Scaled(time.Minute) // wallclock: real UDP between two agents
	}
	a, err := New(&cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Close() })
	return a
}

// allowAll authorizes every transfer.
func allowAll(context.Context, *Access) error { return nil }
