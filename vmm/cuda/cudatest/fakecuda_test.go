package cudatest

import (
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// CUresults of the CUDA driver API (cuda.h 12.x).
const (
	success        = "0"
	invalidValue   = "1"
	outOfMemory    = "2"
	notInitialized = "3"
	invalidContext = "201"
)

// TestFakeRules breaks each rule the fake enforces, in a separate process
// (testdata/rules.c) that calls the fake as a careless client would, and
// checks the fake answers with the CUresult the driver documents, and
// the reason names the rule; the "-ok" cases are the same calls made
// correctly, which succeed.
func TestFakeRules(t *testing.T) {
	lib, prog := Library(t), rulesProgram(t)
	tests := []struct {
		rule string
		env  []string
		want string // the program's first line
		why  string // in its second line
	}{
		{"call-before-init", nil, notInitialized, "cuInit was not called"},
		{"create-aligned", nil, success, ""},
		{"create-misaligned-size", nil, invalidValue, "not a positive multiple of the granularity 2097152"},
		{"create-bad-properties", nil, invalidValue, "prop.type 0 is not CU_MEM_ALLOCATION_TYPE_PINNED"},
		{"create-over-device-memory", []string{EnvDeviceMemory + "=2097152"}, outOfMemory, "FAKECUDA_DEVICE_MEMORY"},
		{"map-misaligned-address", nil, invalidValue, "must be multiples of the granularity"},
		{"map-outside-reservation", nil, invalidValue, "not inside one reservation"},
		{"map-over-mapping", nil, invalidValue, "already mapped"},
		{"export-with-handle-type", nil, success, ""},
		{"export-without-handle-type", nil, invalidValue, "created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"},
		{"copy-before-set-access", nil, invalidValue, "mapped without read-write access: cuMemSetAccess first"},
		{"copy-after-set-access", nil, success, ""},
		{"copy-without-context", nil, invalidContext, "no current context"},
		{"set-access-unmapped", nil, invalidValue, "not a fully mapped range"},
		{"unmap-sub-range", nil, invalidValue, "not a run of whole mappings"},
		{"free-reservation-with-mapping", nil, invalidValue, "still has mappings"},
		{"free-reservation-wrong-size", nil, invalidValue, "size 2097152 of the reservation"},
		{"release-while-mapped", nil, success, ""},
		{"import-shows-same-bytes", nil, success, ""},
		{"import-foreign-fd", nil, invalidValue, "is not a descriptor cuMemExportToShareableHandle made"},
		{"host-mmap-exported-fd", nil, "errno " + strconv.Itoa(int(syscall.EBADF)), ""},
		{"calls-counted", nil, "4 1", ""}, // fakecuda_calls: cuMemCreate, cuInit
	}
	for _, tc := range tests {
		t.Run(tc.rule, func(t *testing.T) {
			cmd := exec.Command(prog, lib, tc.rule)
			cmd.Env = append(os.Environ(), tc.env...)
			var stderr strings.Builder
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			require.NoError(t, err, "rules %s: %s", tc.rule, stderr.String())
			first, second, _ := strings.Cut(string(out), "\n")
			require.Equal(t, tc.want, first, "result of %s (reason %q)", tc.rule, second)
			require.Contains(t, second, tc.why)
		})
	}
	t.Run("host-touch", func(t *testing.T) {
		// Host code reading a device address dies, as on a GPU.
		cmd := exec.Command(prog, lib, "host-touch")
		out, err := cmd.Output()
		var ee *exec.ExitError
		require.True(t, errors.As(err, &ee), "the read of device memory did not crash: %q", out)
		ws := ee.Sys().(syscall.WaitStatus)
		require.True(t, ws.Signaled(), "exit %v", ee)
		require.Equal(t, syscall.SIGSEGV, ws.Signal())
		require.NotContains(t, string(out), "read ")
	})
}

// TestReadTrace: a trace records every call with its result, an
// injected fault is marked, and Held balances creates against releases.
func TestReadTrace(t *testing.T) {
	p := NewTrace(t, "x").Path
	require.NoError(t, os.WriteFile(p, []byte("cuInit 0\ncuMemCreate 2 injected\ncuMemCreate 0\ncuMemMap 1 why: [0x1, +2) is not inside one reservation\ncuMemMap 0\ncuMemUnmap 0\n"), 0o600))
	calls, err := ReadTrace(p)
	require.NoError(t, err)
	require.Equal(t, []string{"cuInit", "cuMemCreate", "cuMemCreate", "cuMemMap", "cuMemMap", "cuMemUnmap"}, Names(calls))
	require.True(t, calls[1].Injected)
	require.Equal(t, []Call{{Name: "cuMemMap", Result: 1, Why: "[0x1, +2) is not inside one reservation"}}, Refused(calls))
	h, m := Held(calls)
	require.Equal(t, 1, h)
	require.Zero(t, m)
	require.Equal(t, "cuMemCreate=2 (injected)", calls[1].String())

	require.NoError(t, os.WriteFile(p, []byte("garbage\n"), 0o600))
	_, err = ReadTrace(p)
	require.ErrorContains(t, err, `"garbage" is not`)
	require.Equal(t, "cuMemCreate:3:2,cuMemMap:1:1", Spec(Fault{"cuMemCreate", 3, 2}, Fault{"cuMemMap", 1, 1}))
}
