// Package kvgen generates deterministic KV-cache content so every byte that
// crosses the wire can be checked: the bytes of one row (one head of one
// token in one region, HND layout) are a function of a content key (a
// prefix-block hash, so requests sharing a prefix share its KV), the region
// (layer and K/V), the head, the token position and the byte offset.
package kvgen
