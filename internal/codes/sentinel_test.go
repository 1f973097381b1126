package codes_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestSentinelMessage: a sentinel wrapped as "%w: detail" reads as its
// class in words (it read ": transfer: ..." in every failure a decode
// engine was handed) and still matches its class.
func TestSentinelMessage(t *testing.T) {
	tests := []struct {
		code v1.Code
		want string
	}{
		{v1.Code_CODE_UNAVAILABLE, "unavailable: transfer: dial 10.0.0.1:5600: refused"},
		{v1.Code_CODE_CAPABILITY_DENIED, "capability denied: transfer: dial 10.0.0.1:5600: refused"},
		{v1.Code_CODE_INCOMPATIBLE_MODEL, "incompatible model: transfer: dial 10.0.0.1:5600: refused"},
	}
	for _, tc := range tests {
		t.Run(tc.code.String(), func(t *testing.T) {
			err := fmt.Errorf("%w: transfer: dial 10.0.0.1:5600: refused", codes.Sentinel(tc.code))
			require.EqualError(t, err, tc.want)
			require.ErrorIs(t, err, codes.Sentinel(tc.code))
			require.Equal(t, tc.code, codes.Of(err))
			require.Equal(t, tc.want, codes.ToProto(err).GetMessage())
		})
	}
	require.EqualError(t, codes.New(v1.Code_CODE_BUSY, "pool full"), "pool full", "a message is kept as is")
}
