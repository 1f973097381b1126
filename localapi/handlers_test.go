package localapi

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestHandlersCoverEveryCall: every field of LocalRequest's call oneof has
// a handler and a metric label of its own name, and nothing else does.
func TestHandlersCoverEveryCall(t *testing.T) {
	fields := callOneof.Fields()
	var want []string
	for i := range fields.Len() {
		want = append(want, string(fields.Get(i).Name()))
	}
	slices.Sort(want)
	require.Equal(t, want, callNames())
	require.Len(t, want, 11)
	require.Equal(t, "set_limit", callName(&v1.LocalRequest{Call: &v1.LocalRequest_SetLimit{}}))
	require.Equal(t, "unknown", callName(&v1.LocalRequest{}), "no call set")
}
