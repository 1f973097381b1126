package cuda

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestNoCgoInLibraries fails when connector, transfer or handshake import
// vmm/cuda, the only cgo package: only cmd may.
func TestNoCgoInLibraries(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("go command not found: %v", err)
	}
	const mod = "github.com/kvsidecar/kvsidecar/"
	for _, pkg := range []string{"connector", "transfer", "handshake"} {
		t.Run(pkg, func(t *testing.T) {
			out, err := exec.Command(goBin, "list", "-deps", mod+pkg).CombinedOutput()
			require.NoError(t, err, "go list -deps %s: %s", pkg, out)
			deps := strings.Fields(string(out))
			require.Contains(t, deps, mod+pkg, "go list listed nothing useful: %s", out)
			require.NotContains(t, deps, mod+"vmm/cuda", "%s imports vmm/cuda", pkg)
		})
	}
}
