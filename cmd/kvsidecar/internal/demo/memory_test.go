package demo

import (
	"math"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/vmm"
)

// bigTrace: a small request, a blank line, then one prompt of 40,000
// tokens (79 hash blocks), then a small one again.
const bigTrace = `{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}

{"timestamp": 1, "input_length": 40000, "output_length": 1, "hash_ids": [` + hashes79 + `]}
{"timestamp": 2, "input_length": 512, "output_length": 1, "hash_ids": [1]}
`

const hashes79 = "100,101,102,103,104,105,106,107,108,109,110,111,112,113,114,115,116,117,118,119," +
	"120,121,122,123,124,125,126,127,128,129,130,131,132,133,134,135,136,137,138,139," +
	"140,141,142,143,144,145,146,147,148,149,150,151,152,153,154,155,156,157,158,159," +
	"160,161,162,163,164,165,166,167,168,169,170,171,172,173,174,175,176,177,178"

func TestCheckMemory(t *testing.T) {
	const page = vmm.DefaultHostPageSize
	// tinyGQA at TP 1 on both sides: 4 regions of 16 KiB blocks, 128 blocks
	// a page. 512 tokens = 32 blocks: one page per region per side.
	small := uint64(2 * 4 * page)    // one request of 512 tokens, both sides
	nulls := uint64(2 * 4 * page)    // the null blocks
	big := uint64(2 * 4 * 20 * page) // 40,000 tokens = 2500 blocks = 20 pages a region
	tests := []struct {
		name     string
		cfg      Config
		wantPeak uint64
		wantLine int // 0: fits
	}{
		{"fits, one in flight, no cache", Config{Concurrency: 1, CacheEntries: -1}, nulls + big, 0},
		{"two in flight", Config{Concurrency: 2, CacheEntries: -1}, nulls + big + small, 0},
		// The cache holds at most 4 hash blocks = 128 blocks: one decode page a region.
		{"cache capped by entries", Config{Concurrency: 1, CacheEntries: 4}, nulls + big + 4*page, 0},
		// 80 distinct hash blocks = 2560 blocks: 20 decode pages a region.
		{"cache capped by the trace", Config{Concurrency: 1, CacheEntries: 1000}, nulls + big + 20*4*page, 0},
		{"big request over", Config{Concurrency: 1, CacheEntries: -1, MemoryBudget: nulls + big - 1}, nulls + big, 3},
		{"first request over", Config{Concurrency: 1, CacheEntries: -1, MemoryBudget: 1}, nulls + small, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Geometry, tc.cfg.PrefillTP, tc.cfg.DecodeTP = tinyGQA, 1, 1
			tc.cfg.TracePath = writeTrace(t, bigTrace)
			peak, err := CheckMemory(&tc.cfg)
			require.Equal(t, tc.wantPeak, peak)
			if tc.wantLine == 0 {
				require.NoError(t, err)
				return
			}
			var me *MemoryError
			require.ErrorAs(t, err, &me)
			require.ErrorIs(t, err, ErrMemoryBudget)
			require.Equal(t, tc.wantLine, me.Line)
			require.Equal(t, tc.cfg.MemoryBudget, me.Budget)
			require.Equal(t, tc.wantPeak, me.PeakBytes)
			require.Contains(t, err.Error(), tc.cfg.TracePath+":"+strconv.Itoa(tc.wantLine)+" (")
		})
	}
}

// TestRunRefusesOverBudget: nothing starts, so nothing is mapped or leaks.
func TestRunRefusesOverBudget(t *testing.T) {
	s, err := Run(t.Context(), &Config{Geometry: tinyGQA, TracePath: writeTrace(t, bigTrace), MemoryBudget: 1 << 20,
		Speedup: math.Inf(1)})
	require.ErrorIs(t, err, ErrMemoryBudget)
	require.Zero(t, s.Requests)
	var me *MemoryError
	require.ErrorAs(t, err, &me)
	require.Equal(t, 512, me.Tokens)
	require.Equal(t, 2, me.Concurrency, "the default")
}

// TestCheckMemoryDefaultDemo: the default run (what `make demo` replays)
// fits in a few GiB.
func TestCheckMemoryDefaultDemo(t *testing.T) {
	peak, err := CheckMemory(nil)
	require.NoError(t, err)
	require.Greater(t, peak, uint64(1<<30))
	require.Less(t, peak, uint64(6<<30))
	t.Logf("default demo peak: %s", FormatBytes(peak))
}

func TestFormatBytes(t *testing.T) {
	for in, want := range map[uint64]string{0: "0 B", 1023: "1023 B", 1536: "1.5 KiB", 3 << 30: "3.0 GiB", math.MaxUint64: "16.0 EiB"} {
		require.Equal(t, want, FormatBytes(in), in)
	}
}
