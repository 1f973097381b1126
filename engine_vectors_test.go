package kvsidecar_test

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	"github.com/kvsidecar/kvsidecar/internal/unixsock"
	"github.com/kvsidecar/kvsidecar/localapi"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm"
)

var update = flag.Bool("update", false, "rewrite testdata/engine_vectors.json from the Go functions")

// vectorsPath is the file of cases both languages are held to.
const vectorsPath = "testdata/engine_vectors.json"

const vectorsAbout = "Cases of the rules the Python client follows beside the Go code: block offsets " +
	"(kvgeom.Packing), local API socket paths (localapi.SocketPath), export merges (connector.MergeExports) and " +
	"token digests (connector.TokenDigests). " +
	"Written by `go test -run TestEngineVectors -update .` (engine_vectors_test.go) from the Go functions; " +
	"TestEngineVectors fails when the file differs from them, python/tests/test_engine_vectors.py when the " +
	"Python functions do. Do not edit by hand. offsets: [block, byte offset of the block in its region]; " +
	"block_at: [byte offset, block holding it]; an error names the fields (block offsets) or the code and " +
	"reason (socket paths, merges; a merge refusal also the part and the field), never a message."

// TestEngineVectors computes every case of testdata/engine_vectors.json with
// the Go functions and compares the file with them; -update rewrites it.
// The Python test asserts the same answers from the same file, so a rule
// changed in one language fails a test until the other follows.
func TestEngineVectors(t *testing.T) {
	got := normalize(t, map[string]any{
		"about":         vectorsAbout,
		"block_offsets": blockOffsetVectors(t),
		"socket_paths":  socketPathVectors(),
		"export_merges": mergeVectors(t),
		"token_digests": tokenDigestVectors(),
	})
	if *update {
		var b bytes.Buffer
		writeJSON(&b, got, "")
		b.WriteByte('\n')
		require.NoError(t, os.MkdirAll("testdata", 0o755))
		require.NoError(t, os.WriteFile(vectorsPath, b.Bytes(), 0o644))
	}
	raw, err := os.ReadFile(vectorsPath)
	require.NoError(t, err, "run go test -run TestEngineVectors -update . to write it")
	want := decodeJSON(t, raw).(map[string]any)
	require.ElementsMatch(t, slices.Collect(maps.Keys(want)), slices.Collect(maps.Keys(got)))
	require.Equal(t, want["about"], got["about"])
	for _, section := range []string{"block_offsets", "socket_paths", "export_merges", "token_digests"} {
		w, g := want[section].([]any), got[section].([]any)
		require.Len(t, w, len(g), "%s: cases in the file", section)
		for i := range g {
			name := g[i].(map[string]any)["name"]
			require.Equal(t, w[i], g[i], "%s[%d] %q: the file says otherwise than the Go functions (go test -run TestEngineVectors -update .)", section, i, name)
		}
	}
}

// blockOffsetVectors: kvgeom.Packing for every region layout the sidecar
// makes (each built-in model at each TP size its heads allow, in host
// pages), hand-picked sizes that are not powers of two, page size 0, and
// every packing Check refuses.
func blockOffsetVectors(t *testing.T) []any {
	type pk struct {
		name               string
		blockLen, pageSize uint64
	}
	cases := []pk{
		{"page size 0: blocks back to back", 18432, 0},
		{"page size 0, one byte blocks", 1, 0},
		{"a block per page", 4096, 4096},
		{"3000-byte blocks in 8 KiB pages: 2192 bytes of padding", 3000, 8192},
		{"5-byte blocks in 7-byte pages", 5, 7},
		{"7-byte blocks in 64-byte pages", 7, 64},
		{"MLA latent (576 bf16 x 16 tokens) in 2 MiB pages", 18432, 2 << 20},
		{"a 3 x 4 KiB block in 64 KiB pages", 12288, 64 << 10},
		{"a block per 2 MiB page", 2 << 20, 2 << 20},
		{"refused: block_len 0", 0, 4096},
		{"refused: block_len 0, page size 0", 0, 0},
		{"refused: block_len > page_size", 8192, 4096},
		{"refused: one byte over the page", 2<<20 + 1, 2 << 20},
	}
	// The layouts of the built-in models, one case per block_len: every
	// region of a rank has the same block_len and page size.
	layouts := map[uint64][]string{}
	for _, name := range kvgeom.ModelNames() {
		g, err := kvgeom.Model(name)
		require.NoError(t, err)
		for _, tp := range []int{1, 2, 4, 8, 16} {
			l, err := vmm.LayoutFor(g, 0, tp)
			if err != nil {
				continue // a TP size the model's heads do not split over
			}
			layouts[l.BlockLen()] = append(layouts[l.BlockLen()], fmt.Sprintf("%s tp_size=%d", name, tp))
		}
	}
	for _, bl := range slices.Sorted(maps.Keys(layouts)) {
		cases = append(cases, pk{"host pages of " + strings.Join(layouts[bl], ", "), bl, vmm.DefaultHostPageSize})
	}
	out := make([]any, 0, len(cases))
	for _, c := range cases {
		v := map[string]any{"name": c.name, "block_len": c.blockLen, "page_size": c.pageSize}
		p, err := kvgeom.NewPacking(c.blockLen, c.pageSize)
		if err != nil {
			var ke *kvgeom.Error
			require.ErrorAs(t, err, &ke, c.name)
			v["error"] = map[string]any{"fields": ke.Fields}
			out = append(out, v)
			continue
		}
		per := p.BlocksPerPage()
		v["blocks_per_page"] = per
		var offsets [][2]uint64
		for _, b := range probeBlocks(per) {
			offsets = append(offsets, [2]uint64{b, p.Offset(kvgeom.BlockID(b))})
		}
		v["offsets"] = offsets
		var at [][2]uint64
		for _, off := range probeOffsets(c.blockLen, c.pageSize, per) {
			at = append(at, [2]uint64{off, p.BlockAt(off)})
		}
		v["block_at"] = at
		out = append(out, v)
	}
	return out
}

// probeBlocks are the blocks whose offsets a case lists: the first ones,
// both sides of each of the first page boundaries, and large ids up to
// the largest block id of a pool (2^31 - 1).
func probeBlocks(per uint64) []uint64 {
	s := []uint64{0, 1, 2, 1000, 65535, 123457, 1<<31 - 1}
	if per > 0 {
		s = append(s, per-1, per, per+1, 2*per-1, 2*per, 7*per+3)
	}
	return sortedUnique(s, 1<<31-1)
}

// probeOffsets are the byte offsets a case asks the block of: the edges
// of the first blocks and pages, a page's padding, and a large offset.
func probeOffsets(bl, ps, per uint64) []uint64 {
	s := []uint64{0, 1, bl - 1, bl, bl + 1, 3*bl + 2, 1_000_000_007}
	if ps > 0 {
		s = append(s, per*bl-1, per*bl, ps-1, ps, ps+bl-1, ps+bl, 5*ps+per*bl)
	}
	return sortedUnique(s, 1<<62)
}

func sortedUnique(s []uint64, limit uint64) []uint64 {
	s = slices.DeleteFunc(s, func(x uint64) bool { return x > limit })
	slices.Sort(s)
	return slices.Compact(s)
}

// socketPathVectors: localapi.SocketPath for plain, long, hashed and UTF-8
// engine ids, directories that need cleaning or are too long, and every
// refusal.
func socketPathVectors() []any {
	type sp struct {
		name, dir, id string
		rank          int
	}
	// room is what a directory of n bytes leaves for the id beside rank 0's
	// suffix: MaxPath - n - len("/kvsidecar-") - len("-tp0-api.sock").
	dirOf := func(n int) string { return "/" + strings.Repeat("d", n-1) }
	room := func(n int) int { return unixsock.MaxPath - n - len("/kvsidecar-") - len("-tp0-api.sock") }
	cases := []sp{
		{"plain id", "/run/kvsidecar", "prefill-a", 0},
		{"plain id, rank 3", "/run/kvsidecar", "prefill-a", 3},
		{"every allowed byte", "/run/kvsidecar", "AZaz09._-", 1},
		{"the largest rank", "/run/kvsidecar", "decode", connector.MaxTPSize - 1},
		{"a trailing slash is cleaned", "/run/kvsidecar/", "e", 0},
		{"dot segments and doubled slashes are cleaned", "//run//x/./../kvsidecar", "e", 0},
		{"the root directory", "/", "e", 0},
		{"a UTF-8 directory keeps its bytes", "/tmp/kvsidécar", "e", 0},
		{"an id that just fits", dirOf(40), strings.Repeat("a", room(40)), 0},
		{"an id one byte too long is hashed", dirOf(40), strings.Repeat("a", room(40)+1), 0},
		{"a long id is cut and hashed", "/run/kvsidecar", strings.Repeat("prefill-", 40), 7},
		{"UTF-8 id: each byte outside the set is _", "/run/kvsidecar", "préfill-ü", 0},
		{"CJK id", "/run/kvsidecar", "预填充", 2},
		{"a space and a slash", "/run/kvsidecar", "a b/c", 0},
		{"a colon, a tab and a NUL", "/run/kvsidecar", "a:b\tc\x00d", 0},
		{"an id that reads like a path", "/run/kvsidecar", "../../etc/passwd", 0},
		{"two ids that sanitize alike differ by hash: first", "/run/kvsidecar", "a b", 0},
		{"two ids that sanitize alike differ by hash: second", "/run/kvsidecar", "a/b", 0},
		{"a long directory leaves one byte of a hashed id", dirOf(room(0) - 14), "prefill a", 0},
		{"refused: a directory too long for a hashed id", dirOf(room(0) - 13), "prefill a", 0},
		{"the same directory fits a short plain id", dirOf(room(0) - 13), "prefill-a", 0},
		{"refused: a directory that leaves no room", dirOf(room(0)), "e", 0},
		{"refused: a directory longer than a socket path", dirOf(200), "e", 0},
		{"refused: a relative directory", "run/kvsidecar", "e", 0},
		{"refused: an empty directory", "", "e", 0},
		{"refused: an empty engine id", "/run/kvsidecar", "", 0},
		{"refused: a negative rank", "/run/kvsidecar", "e", -1},
		{"refused: rank MaxTPSize", "/run/kvsidecar", "e", connector.MaxTPSize},
	}
	out := make([]any, 0, len(cases))
	for _, c := range cases {
		v := map[string]any{"name": c.name, "dir": c.dir, "engine_id": c.id, "tp_rank": c.rank}
		path, err := localapi.SocketPath(c.dir, c.id, c.rank)
		if err != nil {
			v["error"] = errorVector(err)
		} else {
			v["path"] = path
		}
		out = append(out, v)
	}
	return out
}

// errorVector is what a vector says of an error: its code and, when it has
// one, its reason.
func errorVector(err error) map[string]any {
	v := map[string]any{"code": codes.Of(err).String()}
	if r := codes.ReasonOf(err); r != "" {
		v["reason"] = string(r)
	}
	return v
}

// mergeVectors: connector.MergeExports over parts of every shape it merges
// and every refusal, the parts and the result as kv_transfer_params JSON
// (MarshalKVTransferParams: proto field names, 64-bit integers as strings,
// bytes as base64).
func mergeVectors(t *testing.T) []any {
	// part is prefill rank r's RequestFinished params of request cmpl-1 of
	// tp_size tp: blocks ids, an export of rank r, a lease ending at exp.
	part := func(r, tp uint32, ids []uint32, exp int64) *v1.KVTransferParams {
		return &v1.KVTransferParams{
			DoRemotePrefill: true, RemoteEngineId: "prefill-a", RemoteRequestId: "cmpl-1",
			RemoteBlockIds: ids, RemoteHost: "10.0.0.1", RemotePort: 5600, TpSize: proto.Uint32(tp),
			RemoteIncarnation: 0xdeadbeefcafe0000 + uint64(r), LeaseExpiresUnixMs: exp, BlockSize: 16,
			RankExports: []*v1.RankExport{{TpRank: r, ExportId: 0x1000 + uint64(r), Capability: []byte{0xc0, byte(r)}}},
		}
	}
	// with returns a copy of p changed by fn.
	with := func(p *v1.KVTransferParams, fn func(*v1.KVTransferParams)) *v1.KVTransferParams {
		q := proto.Clone(p).(*v1.KVTransferParams)
		fn(q)
		return q
	}
	noExports := func(p *v1.KVTransferParams) { p.RankExports = nil }
	digests3 := connector.TokenDigests(vectorTokens(40), 16, nil)
	p0, p1 := part(0, 2, []uint32{7, 8, 9}, 2000), part(1, 2, []uint32{3, 2, 1}, 1000)
	q := func(r uint32, ids []uint32, exp int64) *v1.KVTransferParams { return part(r, 4, ids, exp) }
	type mc struct {
		name  string
		parts []*v1.KVTransferParams
	}
	cases := []mc{
		{"two ranks", []*v1.KVTransferParams{p0, p1}},
		{"rank 0's part is the base, whatever the order", []*v1.KVTransferParams{p1, p0}},
		{"block ids equal to the base's are left out", []*v1.KVTransferParams{p0, part(1, 2, []uint32{7, 8, 9}, 3000)}},
		{"an export's own block ids equal to the base's are left out", []*v1.KVTransferParams{p0, with(p1, func(p *v1.KVTransferParams) {
			p.RankExports[0].BlockIds = []uint32{7, 8, 9}
		})}},
		{"an export's own block ids that differ are kept", []*v1.KVTransferParams{p0, with(p1, func(p *v1.KVTransferParams) {
			p.RemoteBlockIds = []uint32{7, 8, 9}
			p.RankExports[0].BlockIds = []uint32{4, 5, 6}
		})}},
		{"the earliest lease; a part without one does not count", []*v1.KVTransferParams{q(0, []uint32{1, 2}, 5000), q(1, []uint32{3, 4}, 0),
			q(2, []uint32{1, 2}, 4000), q(3, []uint32{5, 6}, 4500)}},
		{"four ranks in any order", []*v1.KVTransferParams{q(3, []uint32{5, 6}, 1), q(1, []uint32{3, 4}, 1), q(0, []uint32{1, 2}, 1), q(2, []uint32{1, 2}, 1)}},
		{"no part exports rank 0: the first part is the base", []*v1.KVTransferParams{q(2, []uint32{5, 6}, 10), q(1, []uint32{3, 4}, 20)}},
		{"one part", []*v1.KVTransferParams{p0}},
		{"parts without rank_exports: the first part and the earliest lease", []*v1.KVTransferParams{
			with(p0, noExports), with(p1, noExports)}},
		{"parts without rank_exports, one without a lease", []*v1.KVTransferParams{
			with(p0, func(p *v1.KVTransferParams) { noExports(p); p.LeaseExpiresUnixMs = 0 }), with(p1, noExports)}},
		{"a part without rank_exports beside one with", []*v1.KVTransferParams{with(p1, noExports), p0}},
		{"per-rank addresses, checksums and a key id are carried", []*v1.KVTransferParams{
			with(p0, func(p *v1.KVTransferParams) {
				p.RemoteRankAddrs = []string{"10.0.0.1:5600", "[fd00::2]:5601"}
				p.Checksums = proto.Bool(true)
				p.RankExports[0].CapabilityKeyId = "k1"
				p.RankExports[0].BlockChecksums = []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
				p.RankExports[0].ChecksumHeads = 1
			}),
			with(p1, func(p *v1.KVTransferParams) { p.RemoteRankAddrs = []string{"10.0.0.1:5600", "[fd00::2]:5601"} })}},
		{"prompt_tokens and token digests are carried", []*v1.KVTransferParams{
			with(p0, func(p *v1.KVTransferParams) { p.PromptTokens = 40; p.TokenDigests = digests3 }),
			with(p1, func(p *v1.KVTransferParams) { p.PromptTokens = 40; p.TokenDigests = digests3 })}},
		{"a signed port reads as Go's strconv.Atoi reads it", []*v1.KVTransferParams{
			with(p0, func(p *v1.KVTransferParams) { p.RemoteRankAddrs = []string{"h:+5600", "h:05601"} }), p1}},

		{"refused: no part", nil},
		{"refused: another request", []*v1.KVTransferParams{p0, with(p1, func(p *v1.KVTransferParams) { p.RemoteRequestId = "cmpl-2" })}},
		{"refused: another engine", []*v1.KVTransferParams{p0, with(p1, func(p *v1.KVTransferParams) { p.RemoteEngineId = "prefill-b" })}},
		{"refused: another TP size", []*v1.KVTransferParams{p0, q(1, []uint32{3, 2, 1}, 1)}},
		{"refused: another number of blocks", []*v1.KVTransferParams{p0, part(1, 2, []uint32{3, 2}, 1)}},
		{"refused: a rank twice", []*v1.KVTransferParams{p0, p1, part(1, 2, []uint32{4, 5, 6}, 1)}},
		{"refused: another prompt length", []*v1.KVTransferParams{p0, with(p1, func(p *v1.KVTransferParams) { p.PromptTokens = 40 })}},
		{"refused: other token digests", []*v1.KVTransferParams{with(p0, func(p *v1.KVTransferParams) { p.TokenDigests = digests3 }),
			with(p1, func(p *v1.KVTransferParams) { p.TokenDigests = connector.TokenDigests(make([]uint32, 40), 16, nil) })}},
		{"refused: token digests beside none", []*v1.KVTransferParams{with(p0, func(p *v1.KVTransferParams) { p.TokenDigests = digests3 }), p1}},
		{"refused: rank 0 twice, the base first", []*v1.KVTransferParams{p0, part(0, 2, []uint32{7, 8, 9}, 1)}},
		{"refused: a rank twice in one part", []*v1.KVTransferParams{p0, with(p1, func(p *v1.KVTransferParams) {
			p.RankExports = append(p.RankExports, &v1.RankExport{TpRank: 1, ExportId: 9, Capability: []byte{9}})
		})}},
		{"refused: a part compared before the base is checked", []*v1.KVTransferParams{with(p1, func(p *v1.KVTransferParams) { p.RemoteRequestId = "cmpl-2" }),
			with(p0, func(p *v1.KVTransferParams) { p.RankExports[0].Capability = nil })}},
		{"refused: the base breaks a rule", []*v1.KVTransferParams{p1, with(p0, func(p *v1.KVTransferParams) { p.RankExports[0].Capability = nil })}},
	}
	// Every rule of ValidateRemotePrefill, broken by the second part.
	for _, b := range []struct {
		name string
		edit func(*v1.KVTransferParams)
	}{
		{"no tp_size", func(p *v1.KVTransferParams) { p.TpSize = nil }},
		{"tp_size 0", func(p *v1.KVTransferParams) { p.TpSize = proto.Uint32(0) }},
		{"tp_size past MaxTPSize", func(p *v1.KVTransferParams) { p.TpSize = proto.Uint32(connector.MaxTPSize + 1) }},
		{"no remote_engine_id", func(p *v1.KVTransferParams) { p.RemoteEngineId = "" }},
		{"no remote_request_id", func(p *v1.KVTransferParams) { p.RemoteRequestId = "" }},
		{"remote_rank_addrs of another length", func(p *v1.KVTransferParams) { p.RemoteRankAddrs = []string{"10.0.0.1:5600"} }},
		{"a rank address without a port", func(p *v1.KVTransferParams) { p.RemoteRankAddrs = []string{"10.0.0.1:5600", "10.0.0.2"} }},
		{"a rank address without a host", func(p *v1.KVTransferParams) { p.RemoteRankAddrs = []string{"10.0.0.1:5600", ":5600"} }},
		{"a rank address of port 0", func(p *v1.KVTransferParams) { p.RemoteRankAddrs = []string{"10.0.0.1:5600", "h:0"} }},
		{"a rank address of port 65536", func(p *v1.KVTransferParams) { p.RemoteRankAddrs = []string{"h:65536", "h:1"} }},
		{"a rank address of a named port", func(p *v1.KVTransferParams) { p.RemoteRankAddrs = []string{"h:http", "h:1"} }},
		{"a rank address of too many colons", func(p *v1.KVTransferParams) { p.RemoteRankAddrs = []string{"h:1", "a:b:2"} }},
		{"a bracketed rank address without a port", func(p *v1.KVTransferParams) { p.RemoteRankAddrs = []string{"h:1", "[fd00::2]"} }},
		{"a rank address with a stray bracket", func(p *v1.KVTransferParams) { p.RemoteRankAddrs = []string{"h]:1", "h:2"} }},
		{"no remote_host", func(p *v1.KVTransferParams) { p.RemoteHost = "" }},
		{"remote_port 0", func(p *v1.KVTransferParams) { p.RemotePort = 0 }},
		{"remote_port leaves no room for rank 1", func(p *v1.KVTransferParams) { p.RemotePort = 65535 }},
		{"a negative lease", func(p *v1.KVTransferParams) { p.LeaseExpiresUnixMs = -1 }},
		{"an export of a rank at tp_size", func(p *v1.KVTransferParams) { p.RankExports[0].TpRank = 2 }},
		{"an export without an id", func(p *v1.KVTransferParams) { p.RankExports[0].ExportId = 0 }},
		{"an export without a capability", func(p *v1.KVTransferParams) { p.RankExports[0].Capability = nil }},
		{"an export's block ids of another length", func(p *v1.KVTransferParams) { p.RankExports[0].BlockIds = []uint32{1} }},
		{"token digests of another length", func(p *v1.KVTransferParams) { p.TokenDigests = digests3[:16] }},
	} {
		cases = append(cases, mc{"refused: " + b.name, []*v1.KVTransferParams{p0, with(p1, b.edit)}})
	}
	cases = append(cases, mc{"refused: the first part breaks a rule", []*v1.KVTransferParams{with(p0, func(p *v1.KVTransferParams) { p.RemotePort = 0 }), p1}})

	out := make([]any, 0, len(cases))
	for _, c := range cases {
		parts := make([]any, len(c.parts))
		for i, p := range c.parts {
			parts[i] = paramsJSON(t, p)
		}
		v := map[string]any{"name": c.name, "parts": parts}
		merged, err := connector.MergeExports(c.parts...)
		if err != nil {
			v["refusal"] = refusalVector(t, err)
		} else {
			require.NoError(t, connector.ValidateRemotePrefill(merged), c.name)
			v["merged"] = paramsJSON(t, merged)
		}
		require.Equal(t, strings.HasPrefix(c.name, "refused: "), err != nil, "%s: %v", c.name, err)
		out = append(out, v)
	}
	return out
}

// vectorTokens returns n token ids, from a 32-bit step so that every byte
// of their encoding varies.
func vectorTokens(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(i)*2654435761 + 12345
	}
	return out
}

// tokenDigestVectors: connector.TokenDigests of prompts of every shape a
// block can have (empty, one token, part full, full, several), block sizes
// of 1, 16 and 32, a salt, and a token of every byte (the largest id).
func tokenDigestVectors() []any {
	type dc struct {
		name      string
		tokens    []uint32
		blockSize int
		salt      string
	}
	cases := []dc{
		{"no tokens", nil, 16, ""},
		{"one token", []uint32{7}, 16, ""},
		{"a part-full block", vectorTokens(5), 16, ""},
		{"one full block", vectorTokens(16), 16, ""},
		{"a full block and one token", vectorTokens(17), 16, ""},
		{"three blocks and a part", vectorTokens(52), 16, ""},
		{"blocks of one token", vectorTokens(4), 1, ""},
		{"blocks of 32 tokens", vectorTokens(70), 32, ""},
		{"a salt", vectorTokens(20), 16, "lora:adapter-1"},
		{"the largest token id", []uint32{0xffffffff, 0, 1}, 2, ""},
	}
	out := make([]any, 0, len(cases))
	for _, c := range cases {
		tokens := make([]any, len(c.tokens))
		for i, tk := range c.tokens {
			tokens[i] = tk
		}
		out = append(out, map[string]any{"name": c.name, "tokens": tokens, "block_size": c.blockSize, "salt": c.salt,
			"digests": hex.EncodeToString(connector.TokenDigests(c.tokens, c.blockSize, []byte(c.salt)))})
	}
	return out
}

// refusalVector is what a vector says of a MergeExports refusal: the part
// (absent when no part is to blame), the field, the code and the reason.
func refusalVector(t *testing.T, err error) map[string]any {
	var pe *connector.ParamsError
	require.ErrorAs(t, err, &pe)
	require.NotEmpty(t, pe.Reason, "every refusal has a reason: %v", err)
	v := errorVector(err)
	v["field"] = pe.Field
	if part := (*connector.PartError)(nil); errors.As(err, &part) {
		v["part"] = part.Part
	}
	return v
}

// paramsJSON is p as MarshalKVTransferParams writes it, decoded.
func paramsJSON(t *testing.T, p *v1.KVTransferParams) any {
	b, err := connector.MarshalKVTransferParams(p)
	require.NoError(t, err)
	return decodeJSON(t, b)
}

// normalize returns v as encoding/json decodes its encoding (numbers as
// json.Number), the form the file is compared in.
func normalize(t *testing.T, v map[string]any) map[string]any {
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return decodeJSON(t, b).(map[string]any)
}

func decodeJSON(t *testing.T, b []byte) any {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	require.NoError(t, d.Decode(&v))
	return v
}

// writeJSON writes v, decoded JSON, for review: keys sorted, two spaces a
// level, and an array of numbers or strings on one line.
func writeJSON(b *bytes.Buffer, v any, indent string) {
	inner := indent + "  "
	switch x := v.(type) {
	case map[string]any:
		if len(x) == 0 {
			b.WriteString("{}")
			return
		}
		b.WriteString("{\n")
		for i, k := range slices.Sorted(maps.Keys(x)) {
			if i > 0 {
				b.WriteString(",\n")
			}
			b.WriteString(inner)
			writeJSON(b, k, inner)
			b.WriteString(": ")
			writeJSON(b, x[k], inner)
		}
		b.WriteString("\n" + indent + "}")
	case []any:
		flat := !slices.ContainsFunc(x, func(e any) bool {
			switch e.(type) {
			case map[string]any, []any:
				return true
			}
			return false
		})
		if flat || len(x) == 0 {
			b.WriteString("[")
			for i, e := range x {
				if i > 0 {
					b.WriteString(", ")
				}
				writeJSON(b, e, inner)
			}
			b.WriteString("]")
			return
		}
		b.WriteString("[\n")
		for i, e := range x {
			if i > 0 {
				b.WriteString(",\n")
			}
			b.WriteString(inner)
			writeJSON(b, e, inner)
		}
		b.WriteString("\n" + indent + "]")
	default:
		e := json.NewEncoder(b)
		e.SetEscapeHTML(false)
		_ = e.Encode(x)
		b.Truncate(b.Len() - 1) // Encode's newline
	}
}
