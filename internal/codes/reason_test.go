package codes_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

var errNeedGeometry = codes.NewReason(v1.Code_CODE_INVALID_ARGUMENT, codes.ReasonGeometryRequired, "x: geometry is required")

// reasonErr is a struct error that names its class and reason itself.
type reasonErr struct{}

func (reasonErr) Error() string             { return "x: draining" }
func (reasonErr) Code() v1.Code             { return v1.Code_CODE_UNAVAILABLE }
func (reasonErr) ErrorReason() codes.Reason { return codes.ReasonDraining }

func TestReasonOf(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want codes.Reason
	}{
		{"nil", nil, ""},
		{"no class", errors.New("boom"), ""},
		{"a class without a reason", fmt.Errorf("%w: x", codes.Sentinel(v1.Code_CODE_BUSY)), ""},
		{"a wrapped reason sentinel", fmt.Errorf("%w: create: send one", errNeedGeometry), codes.ReasonGeometryRequired},
		{"a struct error", fmt.Errorf("outer: %w", reasonErr{}), codes.ReasonDraining},
		// The first class decides the code, so it decides the reason too:
		// an inner reason of another class is not reported beside it.
		{"the first class decides", fmt.Errorf("%w: %w", codes.New(v1.Code_CODE_BUSY, "x: busy"), errNeedGeometry), ""},
		{"the first class has one", fmt.Errorf("%w: %w", reasonErr{}, codes.New(v1.Code_CODE_BUSY, "x: busy")), codes.ReasonDraining},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, codes.ReasonOf(tc.err))
		})
	}
}

// TestReasonCrossesTheWire: ToProto sends the reason, FromProto keeps it,
// and the receiver's errors.Is matches the sender's reason sentinel, its
// class, and no sentinel of another reason.
func TestReasonCrossesTheWire(t *testing.T) {
	pe := codes.ToProto(fmt.Errorf("%w: create: send one", errNeedGeometry))
	require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, pe.GetCode())
	require.Equal(t, "GEOMETRY_REQUIRED", pe.GetReason())
	require.Equal(t, "x: geometry is required: create: send one", pe.GetMessage())

	err := codes.FromProto("kvsidecar", pe)
	require.Equal(t, codes.ReasonGeometryRequired, codes.ReasonOf(err))
	require.ErrorIs(t, err, errNeedGeometry, "the peer's reply matches the reason sentinel")
	require.ErrorIs(t, err, codes.Sentinel(v1.Code_CODE_INVALID_ARGUMENT))
	require.NotErrorIs(t, err, codes.NewReason(v1.Code_CODE_INVALID_ARGUMENT, codes.ReasonParamsMissing, "x"))
	require.NotErrorIs(t, err, codes.NewReason(v1.Code_CODE_BUSY, codes.ReasonGeometryRequired, "x"), "a reason belongs to its code")

	require.Empty(t, codes.ToProto(codes.New(v1.Code_CODE_BUSY, "x: busy")).GetReason())
	require.NotErrorIs(t, codes.FromProto("p", &v1.Error{Code: v1.Code_CODE_INVALID_ARGUMENT, Message: "m"}), errNeedGeometry,
		"a reply without the reason is not the reason's error")
}
