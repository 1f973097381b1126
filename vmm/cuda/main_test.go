package cuda

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvsidecar/kvsidecar/vmm/cuda/cudatest"
)

func TestMain(m *testing.M) {
	code := m.Run()
	cudatest.Cleanup()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			os.Stderr.WriteString("goleak: " + err.Error() + "\n")
			code = 1
		}
	}
	os.Exit(code)
}
