package connector

import (
	"errors"
	"fmt"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// ErrTPMapping is wrapped by every error of PlanRank: TP sizes that do not
// divide each other or the head count, or block lengths that disagree. It is
// a configuration error of the two instances, CODE_TP_MISMATCH, never
// CODE_INTERNAL.
var ErrTPMapping = codes.New(v1.Code_CODE_TP_MISMATCH, "connector: no TP mapping")

// HeadSpan is the KV heads a rank holds: [First, First+Count).
type HeadSpan = kvgeom.HeadSpan

// RankHeads returns the heads rank r of a TP group of size tp holds, for a
// model of h KV heads (kvgeom.RankHeads): with tp <= h the heads split
// evenly (h % tp == 0); with tp > h every head is replicated on tp/h
// consecutive ranks (tp % h == 0), as vLLM does. MLA models hold their one
// latent on every rank: pass h = 1. tp must be in [1, MaxTPSize]. Errors
// wrap ErrTPMapping and name the values and the rule.
func RankHeads(h, tp, r int) (HeadSpan, error) {
	if tp < 1 || tp > MaxTPSize {
		return HeadSpan{}, fmt.Errorf("%w: tp_size=%d must be in [1, %d]", ErrTPMapping, tp, MaxTPSize)
	}
	s, err := kvgeom.RankHeads(h, tp, r)
	var ke *kvgeom.Error
	if errors.As(err, &ke) {
		return HeadSpan{}, fmt.Errorf("%w: %s", ErrTPMapping, ke.Rule)
	}
	return s, err
}

// Source is one prefill rank a decode rank takes part of every block from.
type Source struct {
	// PrefillRank is the remote tp_rank.
	PrefillRank int
	// RemoteOffset is the byte offset of the slice inside each remote block
	// (of each region).
	RemoteOffset uint64
	// LocalOffset is the byte offset inside each local block where it lands.
	LocalOffset uint64
	// Len is the bytes of the slice per block per region; 0 when NotifyOnly.
	Len uint64
	// NotifyOnly: this prefill rank holds heads another source already
	// provides (replicated heads, MLA); it is only notified, never read.
	NotifyOnly bool
}

// Plan is how one decode rank imports a request's KV.
type Plan struct {
	// Sources in prefill rank order; every byte of the local block is
	// covered by exactly one reading source.
	Sources []Source
	// LocalBlockLen is the bytes of one local block per region.
	LocalBlockLen uint64
	// RemoteBlockLen is the bytes of one block per region on every prefill
	// rank; the handshake checks each peer's regions against it.
	RemoteBlockLen uint64
	// Consumers is how many decode ranks notify each prefill rank for one
	// request (the consumer count carried in every notification).
	Consumers int
}

// TPShape is the KV geometry the mapping needs.
type TPShape struct {
	// NumKVHeads of the model (1 for MLA: its latent is one replicated head).
	NumKVHeads int
	// HeadBlockBytes is the bytes of one head in one block of one region:
	// block_size × head_dim × dtype bytes (HND layout: heads outermost),
	// twice that when a region holds K and V of each head (the compound
	// layouts H2ND and HN2D).
	HeadBlockBytes uint64
}

// ShapeOf returns the TPShape of g.
func ShapeOf(g *v1.ModelGeometry) (TPShape, error) {
	size, err := kvgeom.DTypeBytes(g.GetDtype())
	switch {
	case err != nil:
		return TPShape{}, fmt.Errorf("%w: %w", ErrTPMapping, err)
	case g.GetBlockSize() == 0 || g.GetHeadDim() == 0 || g.GetNumKvHeads() == 0:
		return TPShape{}, fmt.Errorf("%w: block_size=%d, head_dim=%d, num_kv_heads=%d must all be positive",
			ErrTPMapping, g.GetBlockSize(), g.GetHeadDim(), g.GetNumKvHeads())
	}
	h := int(g.GetNumKvHeads())
	if g.GetAttention() == v1.Attention_ATTENTION_MLA {
		h = 1
	}
	hb := uint64(g.GetBlockSize()) * uint64(g.GetHeadDim()) * uint64(size)
	if kvgeom.CompoundKV(g.GetLayout()) {
		hb *= 2
	}
	return TPShape{NumKVHeads: h, HeadBlockBytes: hb}, nil
}

// PlanRank maps decode rank d of a decode group of size dTP to the prefill
// ranks (group size pTP) that hold its heads:
//
//   - dTP >= pTP (must divide): one source, prefill rank d / (dTP/pTP),
//     read from the offset of d's first head inside the remote block;
//   - pTP > dTP (must divide): prefill ranks d·r … d·r+r−1 (r = pTP/dTP),
//     each into its own chunk of the local block; a rank whose heads another
//     source already gives (replicated heads, MLA) is notify-only.
//
// Anything else fails with an error wrapping ErrTPMapping that names both
// sizes. It never guesses.
func PlanRank(s TPShape, pTP, dTP, d int) (Plan, error) {
	if pTP < 1 || dTP < 1 || (pTP%dTP != 0 && dTP%pTP != 0) {
		return Plan{}, fmt.Errorf("%w: prefill tp_size=%d and decode tp_size=%d must divide one another", ErrTPMapping, pTP, dTP)
	}
	local, err := RankHeads(s.NumKVHeads, dTP, d)
	if err != nil {
		return Plan{}, fmt.Errorf("decode side: %w", err)
	}
	remote0, err := RankHeads(s.NumKVHeads, pTP, 0)
	if err != nil {
		return Plan{}, fmt.Errorf("prefill side: %w", err)
	}
	hb := s.HeadBlockBytes
	plan := Plan{LocalBlockLen: uint64(local.Count) * hb, RemoteBlockLen: uint64(remote0.Count) * hb, Consumers: 1}

	if dTP >= pTP {
		r := dTP / pTP
		p := d / r
		rem, err := RankHeads(s.NumKVHeads, pTP, p)
		if err != nil {
			return Plan{}, err
		}
		if !rem.Contains(local) {
			return Plan{}, notInside("decode", d, local, "prefill", p, rem, pTP, dTP)
		}
		plan.Consumers = r
		plan.Sources = []Source{{PrefillRank: p, RemoteOffset: uint64(local.First-rem.First) * hb, Len: plan.LocalBlockLen}}
		return plan, nil
	}

	r := pTP / dTP
	covered := map[int]bool{}
	for p := d * r; p < (d+1)*r; p++ {
		rem, err := RankHeads(s.NumKVHeads, pTP, p)
		if err != nil {
			return Plan{}, err
		}
		if !local.Contains(rem) {
			return Plan{}, notInside("prefill", p, rem, "decode", d, local, pTP, dTP)
		}
		if covered[rem.First] {
			plan.Sources = append(plan.Sources, Source{PrefillRank: p, NotifyOnly: true})
			continue
		}
		for h := rem.First; h < rem.First+rem.Count; h++ {
			covered[h] = true
		}
		plan.Sources = append(plan.Sources, Source{PrefillRank: p, LocalOffset: uint64(rem.First-local.First) * hb, Len: uint64(rem.Count) * hb})
	}
	if len(covered) != local.Count {
		return Plan{}, fmt.Errorf("%w: prefill ranks %d..%d cover %d of decode rank %d's %d heads", ErrTPMapping, d*r, (d+1)*r-1, len(covered), d, local.Count)
	}
	return plan, nil
}

// notInside is the error of a rank whose heads are not all held by the rank
// of the other side it maps to; it wraps ErrTPMapping.
func notInside(side string, rank int, heads HeadSpan, otherSide string, otherRank int, otherHeads HeadSpan, pTP, dTP int) error {
	return fmt.Errorf("%w: %s rank %d (heads %d..%d) is not inside %s rank %d (heads %d..%d) for prefill tp_size=%d, decode tp_size=%d",
		ErrTPMapping, side, rank, heads.First, heads.First+heads.Count-1, otherSide, otherRank, otherHeads.First, otherHeads.First+otherHeads.Count-1, pTP, dTP)
}
