// Package kvgeom is the KV-cache geometry every layer of kvsidecar shares,
// written once: the built-in model table, element sizes of the wire dtypes,
// the split of a model's KV heads over a tensor-parallel group, the placement
// of page-padded blocks inside a region, and the BlockID type. It imports
// only the generated wire types (proto/kvsidecar/v1) and the standard
// library, so vmm, handshake, transfer and connector can all use it.
//
// The smallest real use:
//
//	g, err := kvgeom.Model("llama-3.1-8b")
//	heads, err := kvgeom.RankHeads(int(g.GetNumKvHeads()), tpSize, tpRank)
//	pk, err := kvgeom.NewPacking(blockLen, pageSize)
//	off := pk.Offset(kvgeom.BlockID(7)) // byte offset of block 7 in its region
//
// A value that breaks a rule is an *Error naming the fields and the rule;
// each caller wraps it in its own error class (vmm.ErrInvalidConfig,
// connector.ErrTPMapping, ...), which carries the wire code.
package kvgeom
