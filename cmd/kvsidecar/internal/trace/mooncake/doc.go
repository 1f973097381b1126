// Package mooncake embeds the Mooncake conversation trace (12,031 requests
// of one hour of a production conversation workload, released by
// kvcache-ai/Mooncake under the Apache License 2.0; see README.md here) so
// that `kvsidecar demo` replays it wherever the binary runs.
//
//	reqs, err := trace.Read(mooncake.Conversation(), mooncake.ConversationName, 8)
package mooncake
