package mooncake_test

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvsidecar/kvsidecar/cmd/kvsidecar/internal/trace"
	"github.com/kvsidecar/kvsidecar/cmd/kvsidecar/internal/trace/mooncake"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestConversationEmbedded(t *testing.T) {
	reqs, err := trace.Read(mooncake.Conversation(), mooncake.ConversationName, 0)
	require.NoError(t, err)
	require.Len(t, reqs, mooncake.ConversationRequests)
	require.Equal(t, trace.Request{Timestamp: 0, InputLength: 6758, OutputLength: 500,
		HashIDs: []int64{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}}, reqs[0])
	var tokens int
	for _, r := range reqs {
		tokens += r.InputLength
	}
	require.Equal(t, 12035, tokens/len(reqs), "average input tokens (the trace README says 12,035)")

	// Each call starts over.
	first, err := trace.Read(mooncake.Conversation(), mooncake.ConversationName, 5)
	require.NoError(t, err)
	require.Equal(t, reqs[:5], first)
}

func TestAttributionKept(t *testing.T) {
	b, err := os.ReadFile("README.md")
	require.NoError(t, err)
	for _, want := range []string{"kvcache-ai/Mooncake", "Apache License 2.0", "Copied unchanged"} {
		require.True(t, strings.Contains(string(b), want), "README.md lost %q", want)
	}
}
