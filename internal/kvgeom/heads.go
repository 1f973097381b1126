package kvgeom

// MaxTPSize is the largest tensor-parallel size accepted anywhere: tp_size
// in kv_transfer_params, the local API's create call, serve's --tp-size, a
// TP group and a peer's AgentMetadata.
const MaxTPSize = 1024

// HeadSpan is the KV heads a rank holds: [First, First+Count).
type HeadSpan struct {
	First, Count int
}

// Contains reports whether every head of o is one of s's.
func (s HeadSpan) Contains(o HeadSpan) bool {
	return o.First >= s.First && o.First+o.Count <= s.First+s.Count
}

// RankHeads returns the heads rank r of a TP group of size tp holds, for a
// model of h KV heads. With tp <= h the heads split evenly (h % tp == 0),
// rank r holding heads r·h/tp … (r+1)·h/tp−1; with tp > h every head is
// replicated on tp/h consecutive ranks (tp % h == 0), as vLLM does. MLA
// models hold their one latent on every rank: pass h = 1. It does not bound
// tp by MaxTPSize. Errors are an *Error naming num_kv_heads, tp_size or
// tp_rank and the rule: h < 1, tp < 1, r outside [0, tp), or sizes that do
// not divide.
func RankHeads(h, tp, r int) (HeadSpan, error) {
	switch {
	case h < 1:
		return HeadSpan{}, errorf([]string{"num_kv_heads"}, "num_kv_heads=%d must be at least 1", h)
	case tp < 1:
		return HeadSpan{}, errorf([]string{"tp_size"}, "tp_size=%d must be at least 1", tp)
	case r < 0 || r >= tp:
		return HeadSpan{}, errorf([]string{"tp_rank"}, "tp_rank=%d must be in [0, %d)", r, tp)
	case tp <= h && h%tp != 0:
		return HeadSpan{}, errorf([]string{"num_kv_heads", "tp_size"}, "tp_size=%d does not divide num_kv_heads=%d", tp, h)
	case tp > h && tp%h != 0:
		return HeadSpan{}, errorf([]string{"num_kv_heads", "tp_size"}, "num_kv_heads=%d does not divide tp_size=%d (replicated heads)", h, tp)
	case tp <= h:
		n := h / tp
		return HeadSpan{First: r * n, Count: n}, nil
	default:
		return HeadSpan{First: r / (tp / h), Count: 1}, nil
	}
}
