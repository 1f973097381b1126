package tpgroup

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// BenchmarkCoordinatedMapUnmap measures one coordinated page map plus unmap
// fanned out from rank 0 to ranks 1..N-1 over real unix sockets into real
// host pools (the hook alone: rank 0's local map is not included).
func BenchmarkCoordinatedMapUnmap(b *testing.B) {
	for _, tp := range []int{2, 4, 8} {
		b.Run("tp="+string(rune('0'+tp)), func(b *testing.B) {
			groups, _, _ := coordinated(b, tp, &Config{Dir: sockDir(b)})
			hook := groups[0].Hook()
			pages := []int{1}
			b.ReportAllocs()
			for b.Loop() {
				require.NoError(b, hook.MapPages(b.Context(), pages))
				require.NoError(b, hook.UnmapPages(b.Context(), pages))
			}
		})
	}
}

// BenchmarkPing measures one ping round trip over a unix socket.
func BenchmarkPing(b *testing.B) {
	dir := sockDir(b)
	cfg := &Config{Dir: dir, Ownership: OwnershipLocal}
	g0 := startGroup(b, Member{EngineID: "eng", TPSize: 2}, nil, cfg)
	startGroup(b, Member{EngineID: "eng", TPSize: 2, TPRank: 1}, nil, cfg)
	b.ReportAllocs()
	for b.Loop() {
		require.NoError(b, g0.Ping(b.Context(), 1))
	}
}
