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
	invalidDevice  = "101"
	invalidContext = "201"
	invalidHandle  = "400"
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
		// Streams: a copy on pinned memory is queued until the event after
		// it is waited for; one on pageable memory is done when the call
		// returns; destroying the stream or unmapping runs what is queued.
		{"async-pinned-runs-at-sync", nil, "before old, queued 1, after device bytes, queued 0", ""},
		{"async-pageable-runs-at-once", nil, "after call device bytes, queued 0", ""},
		{"destroy-stream-runs-queued", nil, "queued 1, then 0: queued bytes", ""},
		{"unmap-runs-queued", nil, "queued 1, then 0, mappings 0", ""},
		{"dtod-copies-bytes", nil, "same", ""},
		{"dtod-into-read-only", nil, invalidValue, "is mapped read-only (CU_MEM_ACCESS_FLAGS_PROT_READ) for device 0: not a copy destination"},
		{"dtod-from-no-access", nil, invalidValue, "source 0x"},
		{"dtod-past-mapping", nil, invalidValue, "is not mapped"},
		{"copy-on-destroyed-stream", nil, invalidHandle, "is not a live stream"},
		{"record-on-destroyed-stream", nil, invalidHandle, "is not a live stream"},
		{"sync-destroyed-event", nil, invalidHandle, "is not a live event"},
		{"stream-bad-flags", nil, invalidValue, "only CU_STREAM_DEFAULT or CU_STREAM_NON_BLOCKING"},
		{"event-interprocess-with-timing", nil, invalidValue, "without CU_EVENT_DISABLE_TIMING"},
		{"host-alloc-bad-flags", nil, invalidValue, "only CU_MEMHOSTALLOC_PORTABLE"},
		{"host-alloc-without-context", nil, invalidContext, "no current context"},
		{"free-host-foreign", nil, invalidValue, "is not memory cuMemHostAlloc returned"},
		// Devices: an import stays on the exporter's device; another
		// device gets access only where cuDeviceCanAccessPeer says it can.
		{"can-access-peer", []string{EnvDevices + "=2"}, "1 0", ""},
		{"can-access-peer-none", []string{EnvDevices + "=2", EnvNoPeerAccess + "=1"}, "0 0", ""},
		{"import-keeps-device", []string{EnvDevices + "=2"}, "device 1", ""},
		{"set-access-with-peer", []string{EnvDevices + "=2"}, success, ""},
		{"set-access-without-peer", []string{EnvDevices + "=2", EnvNoPeerAccess + "=1"}, invalidDevice,
			"grants device 0 access to memory of device 1, which cuDeviceCanAccessPeer says it cannot access"},
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

	// Arguments come before the note; Left balances every kind of object.
	require.NoError(t, os.WriteFile(p, []byte("cuStreamCreate 0 flags=0x1 stream=0x55\n"+
		"cuMemHostAlloc 0 bytes=8 flags=0x1\ncuMemHostAlloc 2 bytes=8 flags=0x1 injected\n"+
		"cuMemcpyDtoHAsync_v2 0 bytes=8 host=pinned stream=0x55\n"+
		"cuMemcpyHtoDAsync_v2 400 bytes=2 host=pageable stream=0x1 why: stream 0x1 is not a live stream\n"+
		"cuEventCreate 0 flags=0x2\ncuMemAddressReserve 0\ncuMemFreeHost 0 ops=0\n"), 0o600))
	calls, err = ReadTrace(p)
	require.NoError(t, err)
	require.Equal(t, map[string]string{"flags": "0x1", "stream": "0x55"}, calls[0].Args)
	require.True(t, calls[2].Injected)
	require.Equal(t, map[string]string{"bytes": "8", "flags": "0x1"}, calls[2].Args)
	require.Equal(t, map[string]string{"bytes": "8", "host": "pinned", "stream": "0x55"}, calls[3].Args)
	require.Equal(t, "stream 0x1 is not a live stream", calls[4].Why)
	require.Equal(t, "pageable", calls[4].Args["host"])
	require.Equal(t, Outstanding{Reservations: 1, Streams: 1, Events: 1}, Left(calls))

	require.NoError(t, os.WriteFile(p, []byte("cuMemMap 0 bad\n"), 0o600))
	_, err = ReadTrace(p)
	require.ErrorContains(t, err, `"bad" is not key=value`)
	require.NoError(t, os.WriteFile(p, []byte("garbage\n"), 0o600))
	_, err = ReadTrace(p)
	require.ErrorContains(t, err, `"garbage" is not`)
	require.Equal(t, "cuMemCreate:3:2,cuMemMap:1:1", Spec(Fault{"cuMemCreate", 3, 2}, Fault{"cuMemMap", 1, 1}))
}
