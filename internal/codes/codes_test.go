package codes_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

type classErr struct{}

func (classErr) Error() string { return "x: busy" }
func (classErr) Code() v1.Code { return v1.Code_CODE_BUSY }

func TestOf(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want v1.Code
	}{
		{"nil", nil, v1.Code_CODE_OK},
		{"wrapped coder", fmt.Errorf("ctx: %w", classErr{}), v1.Code_CODE_BUSY},
		{"deadline", fmt.Errorf("read: %w", context.DeadlineExceeded), v1.Code_CODE_TIMEOUT},
		{"canceled", context.Canceled, v1.Code_CODE_ABORTED},
		{"plain", errors.New("boom"), v1.Code_CODE_INTERNAL},
		{"explicit", codes.New(v1.Code_CODE_LEASE_EXPIRED, "lease of %q expired", "r1"), v1.Code_CODE_LEASE_EXPIRED},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, codes.Of(tc.err))
		})
	}
}

func TestWireRoundTrip(t *testing.T) {
	require.Nil(t, codes.ToProto(nil))
	require.NoError(t, codes.FromProto("p", nil))
	require.NoError(t, codes.FromProto("p", &v1.Error{}))

	pe := codes.ToProto(fmt.Errorf("transfer: %w", codes.New(v1.Code_CODE_TP_MISMATCH, "tp_size 2 != 4")))
	require.Equal(t, v1.Code_CODE_TP_MISMATCH, pe.GetCode())
	err := codes.FromProto("10.0.0.1:5600", pe)
	require.EqualError(t, err, "10.0.0.1:5600: transfer: tp_size 2 != 4 (CODE_TP_MISMATCH)")
	require.Equal(t, v1.Code_CODE_TP_MISMATCH, codes.Of(err))
	require.ErrorIs(t, err, codes.Sentinel(v1.Code_CODE_TP_MISMATCH))
	require.NotErrorIs(t, err, codes.Sentinel(v1.Code_CODE_BUSY))
}
