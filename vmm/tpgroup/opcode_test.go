package tpgroup

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestOpErrorCode: a failed coordinated op keeps the class of the lowest
// failed rank's error through the wrapping of the pool above it, so the
// engine sees CODE_BUSY for a follower over its memory limit (regression:
// codes.Of answered CODE_INTERNAL).
func TestOpErrorCode(t *testing.T) {
	tests := []struct {
		name   string
		failed []*RankError
		want   v1.Code
	}{
		{"follower over its limit", []*RankError{{Rank: 2, Op: "map", Err: &RemoteError{Code: v1.Code_CODE_BUSY, Message: "vmm: over the memory limit"}}}, v1.Code_CODE_BUSY},
		{"lowest failed rank decides", []*RankError{
			{Rank: 1, Op: "map", Err: fmt.Errorf("dial: %w", ErrPeerUnavailable)},
			{Rank: 3, Op: "map", Err: &RemoteError{Code: v1.Code_CODE_BUSY}},
		}, v1.Code_CODE_UNAVAILABLE},
		{"silent rank", []*RankError{{Rank: 1, Op: "map", Err: context.DeadlineExceeded}}, v1.Code_CODE_TIMEOUT},
		{"no rank named", nil, v1.Code_CODE_INTERNAL},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := fmt.Errorf("vmm: page hook map of pages [3]: %w", &OpError{Op: "map", Pages: 1, Failed: tc.failed})
			require.Equal(t, tc.want, codes.Of(err))
		})
	}
}
