//go:build linux && cgo

package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/vmm/cuda/cudatest"
)

// cudaProps is how errors name the allocation properties of every page.
const cudaProps = "allocation properties {type: CU_MEM_ALLOCATION_TYPE_PINNED, location: CU_MEM_LOCATION_TYPE_DEVICE 0, requestedHandleTypes: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR}"

// TestServeCUDAStartChecks: serve --backend cuda on a device that cannot
// serve pages (the fake driver configured so) exits 1 before "serving",
// naming the granularity or the handle type and the allocation properties.
func TestServeCUDAStartChecks(t *testing.T) {
	lib := cudatest.Library(t)
	tests := []struct {
		name string
		env  map[string]string
		code int
		want []string
	}{
		{"granularity not a power of two", map[string]string{cudatest.EnvGranularity: "3000"}, 1,
			[]string{"kvsidecar serve: --backend cuda --device 0: cuda: device 0: granularity 3000 bytes from cuMemGetAllocationGranularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM) with " + cudaProps}},
		{"no POSIX file descriptors", map[string]string{cudatest.EnvNoPOSIXFD: "1"}, 1,
			[]string{"cannot export memory as CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0)", cudaProps}},
		{"no such device", nil, 1, []string{"--backend cuda --device 3: cuda: open device 3 with " + lib + ": cuda: CUDA_ERROR_INVALID_DEVICE (101)"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			env := newServeEnv(t)
			args := env.args("--backend", "cuda", "--cuda-library", lib)
			if tc.name == "no such device" {
				args = append(args, "--device", "3")
			}
			var errb bytes.Buffer
			code := run(t.Context(), args, io.Discard, &errb)
			require.Equal(t, tc.code, code, errb.String())
			for _, w := range tc.want {
				require.Contains(t, errb.String(), w)
			}
			require.NotContains(t, errb.String(), `"msg":"serving"`)
			_, err := os.Stat(env.socketDir)
			require.ErrorIs(t, err, os.ErrNotExist, "nothing created before the check")
		})
	}
	t.Run("cuda library with the host backend", func(t *testing.T) {
		var errb bytes.Buffer
		code := run(t.Context(), newServeEnv(t).args("--cuda-library", lib), io.Discard, &errb)
		require.Equal(t, 2, code, errb.String())
		require.Contains(t, errb.String(), "--cuda-library: \""+lib+"\": only the cuda backend loads a driver")
	})
}

// TestDemoCUDAFake: the demo on the cuda backend (what make gpu-check runs
// on a GPU) moves and verifies every byte through device pages of the fake
// driver, breaks none of its rules and gives every page back.
func TestDemoCUDAFake(t *testing.T) {
	lib := cudatest.Library(t)
	tr := cudatest.StartTrace(t)
	var out, errb bytes.Buffer
	code := run(t.Context(), []string{"demo", "--model", "qwen2.5-0.5b", "--prefill-tp", "1", "--decode-tp", "2",
		"--trace", writeFile(t, "t.jsonl", tinyTrace), "--speedup", "inf", "--backend", "cuda", "--cuda-library", lib, "--json"}, &out, &errb)
	require.Equal(t, 0, code, errb.String())
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	var s struct {
		Requests      int    `json:"requests"`
		BytesMoved    uint64 `json:"bytes_moved"`
		BytesVerified uint64 `json:"bytes_verified"`
		Mismatches    uint64 `json:"mismatches"`
	}
	require.NoError(t, json.Unmarshal([]byte(lines[len(lines)-1]), &s))
	require.Equal(t, 2, s.Requests)
	require.Positive(t, s.BytesVerified)
	require.Equal(t, s.BytesMoved, s.BytesVerified, "every byte moved was checked")
	require.Zero(t, s.Mismatches)
	calls := tr.Calls(t)
	require.Empty(t, cudatest.Refused(calls), "calls that broke the driver's rules")
	h, m := cudatest.Held(calls)
	require.Zero(t, h, "allocation handles left")
	require.Zero(t, m, "mappings left")

	var errh bytes.Buffer
	code = run(t.Context(), []string{"demo", "--cuda-library", lib}, io.Discard, &errh)
	require.Equal(t, 2, code)
	require.Contains(t, errh.String(), "--cuda-library \""+lib+"\": only the cuda backend loads a driver")
}
