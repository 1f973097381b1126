package mooncake

import (
	"bytes"
	_ "embed"
)

// ConversationName names the embedded trace in errors and summaries
// (trace.LineError.File).
const ConversationName = "embedded mooncake_conversation_trace.jsonl"

// ConversationRequests is the number of requests in the embedded trace.
const ConversationRequests = 12031

//go:embed mooncake_conversation_trace.jsonl
var conversation []byte

// Conversation returns a reader over the embedded trace's JSONL bytes
// (about 3 MB). Each call returns a fresh reader positioned at the start.
func Conversation() *bytes.Reader { return bytes.NewReader(conversation) }
