package codes_test

import (
	"errors"
	"fmt"
	"net"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm"
	"github.com/kvsidecar/kvsidecar/vmm/tpgroup"
)

// TestCodeOf: vmm's errors map through Of (vmm.CodeOf was the second map).
func TestCodeOf(t *testing.T) {
	tests := []struct {
		err  error
		want v1.Code
	}{
		{nil, v1.Code_CODE_OK},
		{&vmm.PageError{Op: "map", Page: 12, Region: -1, Err: vmm.ErrAlreadyMapped}, v1.Code_CODE_ALREADY_EXISTS},
		{&vmm.PageError{Op: "read", Page: 3, Region: 1, Err: vmm.ErrNotMapped}, v1.Code_CODE_NOT_FOUND},
		{&vmm.LimitError{Want: 4}, v1.Code_CODE_BUSY},
		{&vmm.BackendError{Op: "mmap", Err: errors.New("ENOMEM")}, v1.Code_CODE_INTERNAL},
		{&vmm.BlockError{Block: 7, NumBlocks: 64, Err: vmm.ErrNotAllocated}, v1.Code_CODE_INVALID_ARGUMENT},
	}
	for _, tc := range tests {
		t.Run(tc.want.String(), func(t *testing.T) {
			require.Equal(t, tc.want, codes.Of(tc.err))
		})
	}
	require.Equal(t, "vmm: map page 12: page already mapped", tests[1].err.Error())
}

// TestOfOrder: where a chain holds more than one class, the first decides;
// vmm and tpgroup order their wrapping so that it is the one their own maps
// gave precedence to.
func TestOfOrder(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want v1.Code
	}{
		{"driver out of memory beats ErrBackend", &vmm.BackendError{Op: "cuMemCreate", Err: fmt.Errorf("cuda: %w", vmm.ErrOverLimit)}, v1.Code_CODE_BUSY},
		{"a closed pool is unavailable", fmt.Errorf("vmm: pool: %w", net.ErrClosed), v1.Code_CODE_UNAVAILABLE},
		{"a backend failure on close stays internal", &vmm.BackendError{Op: "munmap", Err: net.ErrClosed}, v1.Code_CODE_INTERNAL},
		{"a follower's reply", &tpgroup.RankError{Rank: 2, Op: "map", Err: &tpgroup.RemoteError{Code: v1.Code_CODE_NOT_FOUND, Message: "vmm: page not mapped"}}, v1.Code_CODE_NOT_FOUND},
		{"a class and a deadline", fmt.Errorf("%w: dial: %w", tpgroup.ErrPeerUnavailable, os.ErrDeadlineExceeded), v1.Code_CODE_UNAVAILABLE},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, codes.Of(tc.err), "%v", tc.err)
		})
	}
	require.ErrorIs(t, tests[3].err, codes.Sentinel(v1.Code_CODE_NOT_FOUND), "a peer's reply matches its class")
	require.NotErrorIs(t, tests[3].err, vmm.ErrNotMapped, "but not another package's sentinel")
}
