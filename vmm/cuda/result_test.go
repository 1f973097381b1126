package cuda

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/vmm"
)

func TestResultMessages(t *testing.T) {
	tests := []struct {
		r    Result
		msg  string
		is   error
		code string
	}{
		{OutOfMemory, "cuda: CUDA_ERROR_OUT_OF_MEMORY (2)", vmm.ErrOverLimit, "CODE_BUSY"},
		{AlreadyMapped, "cuda: CUDA_ERROR_ALREADY_MAPPED (208)", vmm.ErrAlreadyMapped, "CODE_ALREADY_EXISTS"},
		{NotMapped, "cuda: CUDA_ERROR_NOT_MAPPED (211)", vmm.ErrNotMapped, "CODE_NOT_FOUND"},
		{NoDevice, "cuda: CUDA_ERROR_NO_DEVICE (100)", ErrNoGPU, "CODE_INTERNAL"},
		{Result(12345), "cuda: CUDA_ERROR_12345 (12345)", nil, "CODE_INTERNAL"},
	}
	for _, tc := range tests {
		t.Run(tc.r.Name(), func(t *testing.T) {
			require.Equal(t, tc.msg, tc.r.Error())
			err := call("cuMemCreate", tc.r)
			require.ErrorIs(t, err, vmm.ErrBackend)
			var r Result
			require.True(t, errors.As(err, &r))
			require.Equal(t, tc.r, r)
			if tc.is != nil {
				require.ErrorIs(t, err, tc.is)
			}
			require.Equal(t, tc.code, codes.Of(err).String())
		})
	}
	require.NoError(t, call("cuInit", Success))
}
