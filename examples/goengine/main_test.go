package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvsidecar/kvsidecar/internal/testutil"
	"github.com/kvsidecar/kvsidecar/vmm/cuda/cudatest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(cudatest.M(removeBinary{m})) }

// built is the kvsidecar binary both tests run, built once.
var built struct {
	once      sync.Once
	dir, path string
	err       error
}

type removeBinary struct{ m *testing.M }

func (r removeBinary) Run() int {
	defer func() { _ = os.RemoveAll(built.dir) }()
	return r.m.Run()
}

// buildKvsidecar builds the binary once per test binary.
func buildKvsidecar(t *testing.T) string {
	t.Helper()
	built.once.Do(func() {
		if built.dir, built.err = os.MkdirTemp("", "goengine-bin"); built.err != nil {
			return
		}
		built.path = filepath.Join(built.dir, "kvsidecar")
		out, err := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-o", built.path, "../../cmd/kvsidecar").CombinedOutput()
		if err != nil {
			built.err = fmt.Errorf("go build: %w\n%s", err, out)
		}
	})
	require.NoError(t, built.err)
	return built.path
}

// TestExample runs the example against a freshly built kvsidecar: one
// request of 1000 tokens, prefill TP 2 -> decode TP 4, every byte checked.
func TestExample(t *testing.T) {
	bin := buildKvsidecar(t)
	// wallclock: the example runs real kvsidecar processes; a generous scaled bound on the whole run.
	ctx, cancel := context.WithTimeout(t.Context(), testutil.Scaled(2*time.Minute))
	defer cancel()
	var report strings.Builder
	require.NoError(t, run(ctx, bin, 1000, "", &report))
	t.Log(report.String())
	// 63 blocks × 32 regions × 16 KiB (8 heads × 16 tokens × 128 bytes),
	// over the four decode ranks.
	require.Contains(t, report.String(), "prefill TP 2 -> decode TP 4: 33030144 bytes verified, 0 mismatches")
	require.Regexp(t, `"tp_size":\s*2,`, report.String(), "the params carry the prefill TP size")
}
