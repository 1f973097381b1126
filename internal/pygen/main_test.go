package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestGeneratedFilesAreCurrent: the Python modules checked in are what
// pygen writes now (make verify checks the same after make generate).
func TestGeneratedFilesAreCurrent(t *testing.T) {
	files, err := generate("../codes/reason.go")
	require.NoError(t, err)
	require.Len(t, files, 2)
	for name, want := range files {
		got, err := os.ReadFile(filepath.Join("../../python/kvsidecar", name))
		require.NoError(t, err)
		require.Equal(t, string(want), string(got), "python/kvsidecar/%s is stale: run make generate", name)
	}
}

// TestParseReasons reads the real reason.go: a reason's value, code and
// comment, in declaration order.
func TestParseReasons(t *testing.T) {
	b, err := os.ReadFile("../codes/reason.go")
	require.NoError(t, err)
	rs, err := parseReasons("reason.go", b)
	require.NoError(t, err)
	require.Equal(t, reason{goName: "ReasonGeometryRequired", value: "GEOMETRY_REQUIRED", code: "CODE_INVALID_ARGUMENT",
		doc: "CreateKVCache without a geometry to a sidecar that has none (started without --model or the geometry flags) and no KV cache yet. Attach again with the engine's geometry."}, rs[0])
	require.Equal(t, "CODE_UNAVAILABLE", rs[1].code)
}

// TestParseReasonsRefuses: a Reason constant that breaks a rule fails
// make generate, naming the constant.
func TestParseReasonsRefuses(t *testing.T) {
	tests := []struct{ name, decl, want string }{
		{"lower case", "// ReasonAbc (CODE_BUSY): x.\nReasonAbc Reason = \"abc\"", `"abc" is not UPPER_SNAKE`},
		{"misnamed", "// ReasonFoo (CODE_BUSY): x.\nReasonFoo Reason = \"BAR\"", "a reason BAR is named ReasonBar"},
		{"no code in the comment", "// ReasonBar is a reason.\nReasonBar Reason = \"BAR\"", "its comment must start"},
		{"not a code", "// ReasonBar (CODE_NOPE): x.\nReasonBar Reason = \"BAR\"", "CODE_NOPE is not an error code"},
		{"CODE_OK", "// ReasonBar (CODE_OK): x.\nReasonBar Reason = \"BAR\"", "CODE_OK is not an error code"},
		{"not a literal", "// ReasonBar (CODE_BUSY): x.\nReasonBar Reason = \"B\" + \"AR\"", "must be a string literal"},
		{"twice", "// ReasonBar (CODE_BUSY): x.\nReasonBar Reason = \"BAR\"\n// ReasonBar (CODE_BUSY): y.\nReasonBar Reason = \"BAR\"", "declared twice"},
		{"two a line", "// ReasonBar (CODE_BUSY): x.\nReasonBar, ReasonBaz Reason = \"BAR\", \"BAZ\"", "one Reason constant a line"},
		{"none", "other = 1", "no constant of type Reason"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseReasons("r.go", []byte("package codes\n\nconst (\n"+tc.decl+"\n)\n"))
			require.ErrorContains(t, err, tc.want)
		})
	}
}
