package demo

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestHandshakeBenchShape(t *testing.T) {
	const rtt = 10 * time.Millisecond
	res, err := RunHandshakeBench(t.Context(), &HandshakeConfig{PrefillTP: 2, DecodeTP: 4, RTT: rtt, Trials: 1})
	require.NoError(t, err)
	b, err := json.Marshal(res)
	require.NoError(t, err)
	var got struct {
		RTTMs float64 `json:"rtt_ms"`
		Modes map[string]struct {
			TargetRanks      []int     `json:"target_ranks"`
			FirstContactRTT  []float64 `json:"first_contact_rtt"`
			CachedRTT        []float64 `json:"cached_rtt"`
			Reconnect0RTTRTT []float64 `json:"reconnect_0rtt_rtt"`
		} `json:"modes"`
	}
	require.NoError(t, json.Unmarshal(b, &got))
	require.Equal(t, 10.0, got.RTTMs)
	require.Len(t, got.Modes, 2)
	for _, name := range []string{"piggyback", "legacy"} {
		m, ok := got.Modes[name]
		require.True(t, ok, name)
		require.Equal(t, []int{0, 0, 1, 1}, m.TargetRanks, name)
		require.Len(t, m.FirstContactRTT, 4)
		require.Len(t, m.CachedRTT, 4)
		require.Len(t, m.Reconnect0RTTRTT, 4)
		for d := range 4 {
			// The injected delay is a floor: a dial and an exchange take at
			// least two RTTs; CPU contention only adds time.
			require.GreaterOrEqual(t, m.FirstContactRTT[d], 1.95, "%s rank %d", name, d)
			require.Less(t, m.CachedRTT[d], 0.5, "%s rank %d: served from the cache", name, d)
			require.GreaterOrEqual(t, m.Reconnect0RTTRTT[d], 0.95, "%s rank %d", name, d)
		}
	}
	// Legacy asks rank 0 first: ranks whose target is rank 1 pay two more.
	require.GreaterOrEqual(t, got.Modes["legacy"].FirstContactRTT[2], 3.9)
}

func TestHandshakeConfigValidation(t *testing.T) {
	tests := []struct {
		name string
		cfg  HandshakeConfig
		want string
	}{
		{"rtt", HandshakeConfig{RTT: time.Microsecond}, "HandshakeConfig.RTT: 1µs must be at least 1ms"},
		{"trials", HandshakeConfig{Trials: -1}, "HandshakeConfig.Trials: -1 must be at least 1"},
		{"tp", HandshakeConfig{DecodeTP: 3}, "decode tp_size"},
		{"model", HandshakeConfig{Model: "nope"}, `HandshakeConfig.Model: vmm: invalid configuration: model: unknown "nope"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := RunHandshakeBench(t.Context(), &tc.cfg)
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.Contains(t, err.Error(), tc.want)
		})
	}
}
