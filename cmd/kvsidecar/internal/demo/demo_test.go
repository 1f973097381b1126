package demo

import (
	"context"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/cmd/kvsidecar/internal/trace"
	"github.com/kvsidecar/kvsidecar/cmd/kvsidecar/internal/trace/mooncake"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// tinyGQA: 2 layers × 8 KV heads × 64 × bf16 × K,V = 4 KiB of KV per token.
var tinyGQA = &v1.ModelGeometry{Model: "tiny-gqa8", NumLayers: 2, NumKvHeads: 8, HeadDim: 64,
	Dtype: v1.DType_DTYPE_BFLOAT16, BlockSize: 16, Layout: v1.Layout_LAYOUT_HND, Attention: v1.Attention_ATTENTION_GQA}

// tinyMLA: one 576-element latent per layer, replicated on every rank; its
// 18 KiB blocks do not divide a 2 MiB page.
var tinyMLA = &v1.ModelGeometry{Model: "tiny-mla", NumLayers: 2, NumKvHeads: 1, HeadDim: 576,
	Dtype: v1.DType_DTYPE_BFLOAT16, BlockSize: 16, Layout: v1.Layout_LAYOUT_HND, Attention: v1.Attention_ATTENTION_MLA}

// sharedTrace: request 1 extends request 0's two hash blocks, request 2 is
// request 0 again (a full hit: 1024 tokens, two whole hash blocks), request
// 3 shares nothing.
const sharedTrace = `{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}
{"timestamp": 5, "input_length": 1300, "output_length": 10, "hash_ids": [1, 2, 3]}
{"timestamp": 9, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}

{"timestamp": 12, "input_length": 600, "output_length": 10, "hash_ids": [4, 5]}
`

func writeTrace(t testing.TB, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "trace.jsonl")
	require.NoError(t, os.WriteFile(p, []byte(text), 0o644))
	return p
}

func TestRunPrefixReuse(t *testing.T) {
	var calls []Progress
	s, err := Run(t.Context(), &Config{Geometry: tinyGQA, TracePath: writeTrace(t, sharedTrace), Requests: 4,
		Concurrency: 1, Progress: func(p Progress) { calls = append(calls, p) }})
	require.NoError(t, err)
	// Imported blocks of 16 tokens: 64 + (82-64) + 0 (full hit) + 38.
	const wantBytes = (64 + 18 + 0 + 38) * 16 * 4096
	require.Equal(t, 4, s.Requests)
	require.Equal(t, int64(1024+1300+1024+600), s.PromptTokens)
	require.Equal(t, int64(2*1024), s.PrefixTokensReused)
	require.Equal(t, 1, s.FullHits)
	require.Equal(t, uint64(wantBytes), s.BytesMoved)
	require.Equal(t, s.BytesMoved, s.BytesVerified)
	require.Zero(t, s.Mismatches)
	require.Zero(t, s.FailedRequests)
	require.Zero(t, s.PagesMappedAfter, "every block freed, every page unmapped")
	require.Positive(t, s.PeakPagesPrefill)
	require.Positive(t, s.PeakPagesDecode)
	// Piggyback: each of 4 decode ranks contacts its one prefill rank once:
	// one QUIC handshake and one exchange each.
	require.Equal(t, 4, s.Dials)
	require.Equal(t, 4, s.Handshakes)
	require.Equal(t, 8, s.HandshakeRTTs)
	require.Positive(t, s.P50Ms)
	require.GreaterOrEqual(t, s.P99Ms, s.P50Ms)
	require.Positive(t, s.ThroughputGBPerS)
	require.Equal(t, 4, s.LatencySamples)
	// Transfer throughput counts only the time loads were in flight: the
	// trace's arrival gaps (5, 4 and 3 ms apart) are not in it.
	require.Positive(t, s.TransferSeconds)
	require.LessOrEqual(t, s.TransferSeconds, s.WallSeconds)
	require.InDelta(t, float64(s.BytesMoved)/s.TransferSeconds/1e9, s.ThroughputGBPerS, 1e-9)
	require.InDelta(t, float64(s.BytesMoved)/s.WallSeconds/1e9, s.WallGBPerS, 1e-9)
	require.GreaterOrEqual(t, s.ThroughputGBPerS, s.WallGBPerS)
	require.True(t, s.OK())
	require.Len(t, calls, 4)
	require.Equal(t, Progress{Done: 4, Total: 4, BytesMoved: wantBytes, Elapsed: calls[3].Elapsed}, calls[3])
}

func TestRunTPAndModels(t *testing.T) {
	tests := []struct {
		name      string
		geom      *v1.ModelGeometry
		p, d      int
		perTok    uint64 // KV bytes per token that land on the decode side
		cacheOff  bool
		wantReuse int64
	}{
		{"gqa_P2_D1", tinyGQA, 2, 1, 4096, false, 2048},
		{"gqa_P1_D2", tinyGQA, 1, 2, 4096, false, 2048},
		{"gqa_P4_D2_no_cache", tinyGQA, 4, 2, 4096, true, 0},
		// MLA: every decode rank holds the whole latent.
		{"mla_P1_D2", tinyMLA, 1, 2, 2 * 2 * 576 * 2, false, 2048},
		{"mla_P2_D1", tinyMLA, 2, 1, 2 * 576 * 2, false, 2048},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := &Config{Geometry: tc.geom, PrefillTP: tc.p, DecodeTP: tc.d, TracePath: writeTrace(t, sharedTrace),
				Concurrency: 1, Speedup: 100}
			blocks := uint64(64 + 18 + 0 + 38)
			if tc.cacheOff {
				cfg.CacheEntries = -1
				blocks = 64 + 82 + 64 + 38
			}
			s, err := Run(t.Context(), cfg)
			require.NoError(t, err)
			require.Equal(t, blocks*16*tc.perTok, s.BytesMoved)
			require.Equal(t, s.BytesMoved, s.BytesVerified)
			require.Zero(t, s.Mismatches)
			require.Zero(t, s.FailedRequests)
			require.Equal(t, tc.wantReuse, s.PrefixTokensReused)
			require.Zero(t, s.PagesMappedAfter)
		})
	}
}

func TestRunConcurrent(t *testing.T) {
	// Every request at once, two in flight: the shared prefix may be
	// imported twice, but every byte still arrives and nothing leaks.
	s, err := Run(t.Context(), &Config{Geometry: tinyGQA, TracePath: writeTrace(t, sharedTrace), Concurrency: 4,
		CacheEntries: 1})
	require.NoError(t, err)
	require.Equal(t, 4, s.Requests)
	require.Equal(t, s.BytesMoved, s.BytesVerified)
	require.Positive(t, s.BytesMoved)
	require.Zero(t, s.Mismatches)
	require.Zero(t, s.FailedRequests)
	require.Zero(t, s.PagesMappedAfter)
}

func TestRunMalformedTrace(t *testing.T) {
	bad := strings.Replace(sharedTrace, `"input_length": 600`, `"input_length": "600"`, 1)
	path := writeTrace(t, bad)
	_, err := Run(t.Context(), &Config{Geometry: tinyGQA, TracePath: path})
	var le *trace.LineError
	require.ErrorAs(t, err, &le)
	require.Equal(t, path, le.File)
	require.Equal(t, 5, le.Line, "the blank line counts")
	require.Contains(t, err.Error(), path+":5:")
}

func TestRunTraceLength(t *testing.T) {
	path := writeTrace(t, sharedTrace)
	empty := writeTrace(t, "\n")
	tests := []struct {
		name      string
		cfg       Config
		wantHave  int
		wantWant  int
		wantTrace string
		want      string
	}{
		{"empty, default", Config{TracePath: empty}, 0, 0, empty, "has no requests"},
		{"empty, asked", Config{TracePath: empty, Requests: 3}, 0, 3, empty, "has no requests"},
		{"preloaded empty", Config{Trace: &Trace{Name: "mine"}}, 0, 0, "mine", "demo: trace mine has no requests"},
		{"beyond", Config{TracePath: path, Requests: 5}, 4, 5, path, "has 4 requests, fewer than Config.Requests=5"},
		{"embedded beyond", Config{Requests: 20000}, 12031, 20000, mooncake.ConversationName, "has 12031 requests"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Geometry = tinyGQA
			_, err := Run(t.Context(), &tc.cfg)
			var te *TraceLengthError
			require.ErrorAs(t, err, &te)
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.Equal(t, TraceLengthError{Trace: tc.wantTrace, Have: tc.wantHave, Want: tc.wantWant}, *te)
			require.Contains(t, err.Error(), tc.want)
		})
	}
}

func TestRunShortTraceWholeByDefault(t *testing.T) {
	// Fewer requests than DefaultRequests and no Requests: all of them.
	tr, err := LoadTrace(writeTrace(t, sharedTrace))
	require.NoError(t, err)
	s, err := Run(t.Context(), &Config{Geometry: tinyGQA, Trace: tr, Speedup: math.Inf(1)})
	require.NoError(t, err)
	require.Equal(t, 4, s.Requests)
	require.Equal(t, tr.Name, s.Trace)
}

func TestRunEmbeddedTrace(t *testing.T) {
	s, err := Run(t.Context(), &Config{Geometry: tinyGQA, Requests: 2, Speedup: math.Inf(1)})
	require.NoError(t, err)
	require.Equal(t, mooncake.ConversationName, s.Trace)
	require.Equal(t, 2, s.Requests)
	// The prompt tokens of the embedded trace's first two requests.
	first, err := trace.Read(mooncake.Conversation(), mooncake.ConversationName, 2)
	require.NoError(t, err)
	require.Equal(t, int64(first[0].InputLength+first[1].InputLength), s.PromptTokens)
	require.True(t, s.OK())
}

func TestRunMissingTrace(t *testing.T) {
	_, err := Run(t.Context(), &Config{Geometry: tinyGQA, TracePath: filepath.Join(t.TempDir(), "nope.jsonl")})
	require.ErrorIs(t, err, os.ErrNotExist)
}

func TestConfigValidation(t *testing.T) {
	odd := &v1.ModelGeometry{Model: "odd", NumLayers: 2, NumKvHeads: 8, HeadDim: 64, Dtype: v1.DType_DTYPE_BFLOAT16,
		BlockSize: 24, Layout: v1.Layout_LAYOUT_HND}
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"unknown model", Config{Model: "gpt-9"}, `Config.Model: kvgeom: model: unknown "gpt-9"`},
		{"block size", Config{Geometry: odd}, "Config.Geometry: block_size=24 must divide 512"},
		{"prefill tp", Config{PrefillTP: 2048}, "Config.PrefillTP: 2048 must be in [1, 1024]"},
		{"decode tp", Config{DecodeTP: -1}, "Config.DecodeTP: -1 must be in [1, 1024]"},
		{"tp vs heads", Config{DecodeTP: 3}, "Config.PrefillTP/DecodeTP: model llama-3.2-1b"},
		{"requests", Config{Requests: -2}, "Config.Requests: -2 must not be negative"},
		{"speedup", Config{Speedup: -1}, "Config.Speedup: -1 must be > 0"},
		{"concurrency", Config{Concurrency: -1}, "Config.Concurrency: -1 must be at least 1"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Run(t.Context(), &tc.cfg)
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.Contains(t, err.Error(), tc.want)
		})
	}
}

func TestRunCancelled(t *testing.T) {
	ctx, cancel := context.WithCancelCause(t.Context())
	cause := errors.New("operator pressed ^C")
	cancel(cause)
	_, err := Run(ctx, &Config{Geometry: tinyGQA, TracePath: writeTrace(t, sharedTrace)})
	require.ErrorIs(t, err, cause)
}

// TestRunProgressTicks: with ProgressInterval set, Progress is also called
// on a ticker while the run lasts (the trace's arrival gaps keep it going
// for ~100 ms here), each tick with the bytes the decode ranks moved so far,
// never more than the run moved in the end.
func TestRunProgressTicks(t *testing.T) {
	const gapped = `{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}
{"timestamp": 50, "input_length": 600, "output_length": 10, "hash_ids": [3, 4]}
{"timestamp": 100, "input_length": 600, "output_length": 10, "hash_ids": [5, 6]}
`
	var ticks, finishes []Progress
	s, err := Run(t.Context(), &Config{Geometry: tinyGQA, TracePath: writeTrace(t, gapped), Requests: 3, Speedup: 1,
		Concurrency: 1, ProgressInterval: time.Millisecond, Progress: func(p Progress) {
			if p.Tick {
				ticks = append(ticks, p)
			} else {
				finishes = append(finishes, p)
			}
		}})
	require.NoError(t, err)
	require.Len(t, finishes, 3)
	require.NotEmpty(t, ticks)
	for i, p := range ticks {
		require.Equal(t, 3, p.Total)
		require.LessOrEqual(t, p.BytesMoved, s.BytesMoved)
		require.GreaterOrEqual(t, p.InFlight, 0)
		if i > 0 {
			require.GreaterOrEqual(t, p.BytesMoved, ticks[i-1].BytesMoved, "bytes so far never go back")
			require.GreaterOrEqual(t, p.Done, ticks[i-1].Done)
		}
	}
	require.Equal(t, s.BytesMoved, finishes[2].BytesMoved)
}
