package e2e

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvsidecar/kvsidecar/vmm/cuda/cudatest"
)

func TestMain(m *testing.M) {
	code := func() int {
		defer Cleanup()
		// goleak's VerifyTestMain exits; run it through a wrapper that
		// still removes the binary.
		return runWithLeakCheck(cudatest.M(m))
	}()
	os.Exit(code)
}

func runWithLeakCheck(m interface{ Run() int }) int {
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			os.Stderr.WriteString("goleak: " + err.Error() + "\n")
			return 1
		}
	}
	return code
}
