package connector

import (
	"errors"
	"fmt"
	"net"
	"regexp"
	"slices"
	"strconv"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// MaxTPSize is the largest tensor-parallel size accepted anywhere (tp_size in
// kv_transfer_params, group configs): kvgeom.MaxTPSize.
const MaxTPSize = kvgeom.MaxTPSize

// ErrInvalidParams is wrapped by every *ParamsError, and by every error of
// UnmarshalKVTransferParams. Its class is CODE_INVALID_ARGUMENT: bad params
// are the caller's error.
var ErrInvalidParams = codes.New(v1.Code_CODE_INVALID_ARGUMENT, "invalid kv_transfer_params")

// ParamsError names the kv_transfer_params field that broke a rule.
// errors.Is(err, ErrInvalidParams) is true.
type ParamsError struct {
	// Field is the JSON field name, e.g. "tp_size".
	Field string
	// Value is the offending value as text ("" when missing).
	Value string
	// Rule says what was expected.
	Rule string
}

func (e *ParamsError) Error() string {
	if e.Value == "" {
		return fmt.Sprintf("connector: kv_transfer_params: %s: %s", e.Field, e.Rule)
	}
	return fmt.Sprintf("connector: kv_transfer_params: %s=%s: %s", e.Field, e.Value, e.Rule)
}

// Unwrap returns ErrInvalidParams.
func (e *ParamsError) Unwrap() error { return ErrInvalidParams }

// Code is CODE_INVALID_ARGUMENT: bad params are the caller's error, also
// when they cross the local API.
func (e *ParamsError) Code() v1.Code { return v1.Code_CODE_INVALID_ARGUMENT }

var paramsJSON = protojson.MarshalOptions{UseProtoNames: true}

// decodeFieldRe finds the field a protojson decode error names (by its
// JSON name, tpSize; snakeCase gives the proto name, tp_size).
var decodeFieldRe = regexp.MustCompile(`field ([A-Za-z_][A-Za-z0-9_]*)`)

// snakeCase turns a protojson JSON name into the proto field name:
// remoteBlockIds -> remote_block_ids.
func snakeCase(s string) string {
	var b []byte
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'A' && c <= 'Z' {
			b = append(b, '_', c+'a'-'A')
			continue
		}
		b = append(b, c)
	}
	return string(b)
}

// MarshalKVTransferParams encodes p as the kv_transfer_params JSON object,
// with vLLM NixlConnector field names (remote_engine_id, remote_block_ids,
// remote_host, remote_port, remote_request_id, tp_size, do_remote_prefill,
// do_remote_decode) plus kvsidecar's. 64-bit integers (remote_incarnation,
// lease_expires_unix_ms) are JSON strings, as protojson writes them; the
// decoder takes numbers or strings.
func MarshalKVTransferParams(p *v1.KVTransferParams) ([]byte, error) {
	b, err := paramsJSON.Marshal(p)
	if err != nil {
		return nil, fmt.Errorf("connector: encode kv_transfer_params: %w", err)
	}
	return b, nil
}

// UnmarshalKVTransferParams decodes the kv_transfer_params JSON object.
// Unknown fields are ignored (vLLM adds its own). Params that ask decode to
// pull from a remote prefill (anything but a bare do_remote_decode request)
// are validated with ValidateRemotePrefill; a violation is a *ParamsError
// naming the field.
func UnmarshalKVTransferParams(data []byte) (*v1.KVTransferParams, error) {
	var p v1.KVTransferParams
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(data, &p); err != nil {
		// protojson names the field whose value it could not read.
		field := "kv_transfer_params"
		if m := decodeFieldRe.FindStringSubmatch(err.Error()); m != nil {
			field = snakeCase(m[1])
		}
		return nil, &ParamsError{Field: field, Rule: "cannot be decoded: " + err.Error()}
	}
	if p.GetDoRemoteDecode() && !p.GetDoRemotePrefill() {
		return &p, nil
	}
	if err := ValidateRemotePrefill(&p); err != nil {
		return nil, err
	}
	return &p, nil
}

// ValidateRemotePrefill checks the params a decode rank needs to pull KV:
// tp_size present and in [1, MaxTPSize]; remote_engine_id and
// remote_request_id set; remote_rank_addrs either empty (then remote_host
// and remote_port locate rank 0 and rank r is at remote_port+r) or exactly
// tp_size valid host:port entries; lease_expires_unix_ms not negative.
func ValidateRemotePrefill(p *v1.KVTransferParams) error {
	if p == nil {
		return &ParamsError{Field: "kv_transfer_params", Rule: "missing"}
	}
	if p.TpSize == nil {
		return &ParamsError{Field: "tp_size", Rule: "missing; the prefill TP size is required and never defaulted to 1"}
	}
	tp := p.GetTpSize()
	if tp < 1 || tp > MaxTPSize {
		return &ParamsError{Field: "tp_size", Value: strconv.FormatUint(uint64(tp), 10), Rule: fmt.Sprintf("must be in [1, %d]", MaxTPSize)}
	}
	if p.GetRemoteEngineId() == "" {
		return &ParamsError{Field: "remote_engine_id", Rule: "missing"}
	}
	if p.GetRemoteRequestId() == "" {
		return &ParamsError{Field: "remote_request_id", Rule: "missing"}
	}
	if n := len(p.GetRemoteRankAddrs()); n > 0 {
		if n != int(tp) {
			return &ParamsError{Field: "remote_rank_addrs", Value: fmt.Sprintf("%d entries", n),
				Rule: fmt.Sprintf("must have exactly tp_size=%d entries, one per prefill rank", tp)}
		}
		for i, a := range p.GetRemoteRankAddrs() {
			if err := checkHostPort(a); err != nil {
				return &ParamsError{Field: fmt.Sprintf("remote_rank_addrs[%d]", i), Value: strconv.Quote(a), Rule: err.Error()}
			}
		}
	} else {
		if p.GetRemoteHost() == "" {
			return &ParamsError{Field: "remote_host", Rule: "missing while remote_rank_addrs is empty"}
		}
		port := p.GetRemotePort()
		if port < 1 || uint64(port)+uint64(tp)-1 > 65535 {
			return &ParamsError{Field: "remote_port", Value: strconv.FormatUint(uint64(port), 10),
				Rule: fmt.Sprintf("must be in [1, %d] so that ranks 0..%d fit at remote_port+rank", 65536-tp, tp-1)}
		}
	}
	if p.GetLeaseExpiresUnixMs() < 0 {
		return &ParamsError{Field: "lease_expires_unix_ms", Value: strconv.FormatInt(p.GetLeaseExpiresUnixMs(), 10), Rule: "must not be negative"}
	}
	seen := make(map[uint32]int, len(p.GetRankExports()))
	for i, e := range p.GetRankExports() {
		field := func(f string) string { return fmt.Sprintf("rank_exports[%d].%s", i, f) }
		switch {
		case e.GetTpRank() >= tp:
			return &ParamsError{Field: field("tp_rank"), Value: strconv.FormatUint(uint64(e.GetTpRank()), 10), Rule: fmt.Sprintf("must be below tp_size=%d", tp)}
		case e.GetExportId() == 0:
			return &ParamsError{Field: field("export_id"), Rule: "missing (0)"}
		case len(e.GetCapability()) == 0:
			return &ParamsError{Field: field("capability"), Rule: "missing"}
		case len(e.GetBlockIds()) != 0 && len(e.GetBlockIds()) != len(p.GetRemoteBlockIds()):
			return &ParamsError{Field: field("block_ids"), Value: fmt.Sprintf("%d entries", len(e.GetBlockIds())),
				Rule: fmt.Sprintf("must be empty (the rank holds remote_block_ids) or hold one id per remote block (%d)", len(p.GetRemoteBlockIds()))}
		}
		if j, dup := seen[e.GetTpRank()]; dup {
			return &ParamsError{Field: field("tp_rank"), Value: strconv.FormatUint(uint64(e.GetTpRank()), 10),
				Rule: fmt.Sprintf("rank_exports[%d] names the same rank; each rank exports a request once", j)}
		}
		seen[e.GetTpRank()] = i
	}
	return nil
}

// ExportOf returns prefill rank r's entry of p.rank_exports, or nil.
func ExportOf(p *v1.KVTransferParams, r int) *v1.RankExport {
	for _, e := range p.GetRankExports() {
		if int(e.GetTpRank()) == r {
			return e
		}
	}
	return nil
}

// exportRanks lists the ranks p carries an export of, sorted.
func exportRanks(p *v1.KVTransferParams) []int {
	out := make([]int, 0, len(p.GetRankExports()))
	for _, e := range p.GetRankExports() {
		out = append(out, int(e.GetTpRank()))
	}
	slices.Sort(out)
	return out
}

// sourceBlocks returns the block ids of export e in token order: its own,
// or remote_block_ids when it carries none.
func sourceBlocks(p *v1.KVTransferParams, e *v1.RankExport) []uint32 {
	if ids := e.GetBlockIds(); len(ids) > 0 {
		return ids
	}
	return p.GetRemoteBlockIds()
}

// MergeExports merges the kv_transfer_params that the prefill ranks'
// RequestFinished calls returned for one request into the params a proxy
// hands to decode: every rank's entry of rank_exports, each rank's block
// ids kept only where they differ from the base's (the part of rank 0, or
// else the first part), whose remote_block_ids, addresses and incarnation
// the result carries. lease_expires_unix_ms is the earliest of the parts
// (every rank's lease must still hold). The parts must name the same
// request, engine, tp_size and number of blocks, and no rank twice; an
// error names the part and the field. Parts are not modified.
func MergeExports(parts ...*v1.KVTransferParams) (*v1.KVTransferParams, error) {
	if len(parts) == 0 {
		return nil, &ParamsError{Field: "kv_transfer_params", Rule: "MergeExports needs at least one part"}
	}
	base := parts[0]
	for _, p := range parts {
		if ExportOf(p, 0) != nil {
			base = p
			break
		}
	}
	out := proto.Clone(base).(*v1.KVTransferParams)
	out.RankExports = nil
	seen := map[uint32]int{}
	for i, p := range parts {
		bad := func(field, value, rule string) error {
			return &ParamsError{Field: fmt.Sprintf("part %d: %s", i, field), Value: value, Rule: rule}
		}
		if err := ValidateRemotePrefill(p); err != nil {
			return nil, fmt.Errorf("connector: MergeExports: part %d: %w", i, err)
		}
		switch {
		case p.GetRemoteRequestId() != base.GetRemoteRequestId():
			return nil, bad("remote_request_id", strconv.Quote(p.GetRemoteRequestId()), fmt.Sprintf("differs from %q", base.GetRemoteRequestId()))
		case p.GetRemoteEngineId() != base.GetRemoteEngineId():
			return nil, bad("remote_engine_id", strconv.Quote(p.GetRemoteEngineId()), fmt.Sprintf("differs from %q", base.GetRemoteEngineId()))
		case p.GetTpSize() != base.GetTpSize():
			return nil, bad("tp_size", strconv.FormatUint(uint64(p.GetTpSize()), 10), fmt.Sprintf("differs from %d", base.GetTpSize()))
		case len(p.GetRemoteBlockIds()) != len(base.GetRemoteBlockIds()):
			return nil, bad("remote_block_ids", fmt.Sprintf("%d entries", len(p.GetRemoteBlockIds())),
				fmt.Sprintf("every rank holds the same %d token blocks", len(base.GetRemoteBlockIds())))
		}
		if p.GetLeaseExpiresUnixMs() != 0 && (out.GetLeaseExpiresUnixMs() == 0 || p.GetLeaseExpiresUnixMs() < out.GetLeaseExpiresUnixMs()) {
			out.LeaseExpiresUnixMs = p.GetLeaseExpiresUnixMs()
		}
		for _, e := range p.GetRankExports() {
			if j, dup := seen[e.GetTpRank()]; dup {
				return nil, bad("rank_exports", fmt.Sprintf("rank %d", e.GetTpRank()), fmt.Sprintf("part %d exports the same rank", j))
			}
			seen[e.GetTpRank()] = i
			m := proto.Clone(e).(*v1.RankExport)
			if ids := sourceBlocks(p, e); slices.Equal(ids, out.GetRemoteBlockIds()) {
				m.BlockIds = nil
			} else {
				m.BlockIds = slices.Clone(ids)
			}
			out.RankExports = append(out.RankExports, m)
		}
	}
	slices.SortFunc(out.RankExports, func(a, b *v1.RankExport) int { return int(a.GetTpRank()) - int(b.GetTpRank()) })
	return out, nil
}

// AlignBlocks returns how a load request lines its local blocks up with the
// remote ones: hit leading remote blocks are not read, and remote block
// hit+i lands in local_block_ids[i] for i < dst; the rest of the local
// blocks (local_surplus_blocks) are never written. A request that cannot be
// aligned is refused with ErrInvalidArgument naming the counts; blocks are
// never shifted to make them fit.
//
// vLLM aligns implicitly, and only to the tail (v0.10.0,
// vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py):
// NixlConnectorScheduler.get_num_new_matched_tokens asks for every prompt
// token past the local prefix hit, update_state_after_alloc passes
// blocks.get_unhashed_block_ids() (every allocated block past the hit) as
// the local block ids, and NixlConnectorWorker._read_blocks reads
// remote_block_ids[-num_local_blocks:] into them, asserting that the local
// blocks do not outnumber the remote ones. The scheduler's
// KVCacheManager.allocate_slots call for such a request
// (vllm/v1/core/sched/scheduler.py, Scheduler.schedule) also reserves
// num_lookahead_tokens, which can add blocks past the prompt that
// get_unhashed_block_ids includes. Here the decode states both numbers:
// remote_hit_blocks is its prefix hit counted in remote blocks (vLLM's
// num_computed_tokens / block_size) and local_surplus_blocks the trailing
// blocks past the prompt.
func AlignBlocks(meta *v1.ReqMeta) (hit, dst int, err error) {
	l, r := len(meta.GetLocalBlockIds()), len(meta.GetParams().GetRemoteBlockIds())
	s, h := int(meta.GetLocalSurplusBlocks()), int(meta.GetRemoteHitBlocks())
	bad := func(format string, a ...any) (int, int, error) {
		return 0, 0, fmt.Errorf("%w: %s", ErrInvalidArgument, fmt.Sprintf(format, a...))
	}
	switch {
	case meta.RemoteHitBlocks == nil && l > 0:
		return bad("remote_hit_blocks is required with %d local_block_ids: say how many leading remote blocks the decode already holds (0 for none)", l)
	case s > l:
		return bad("local_surplus_blocks=%d exceeds the %d local_block_ids", s, l)
	case h > r:
		return bad("remote_hit_blocks=%d exceeds the %d remote_block_ids", h, r)
	case l > 0 && l-s != r-h:
		return bad("local_block_ids (%d) minus local_surplus_blocks (%d) is %d blocks to fill, but remote_block_ids (%d) minus remote_hit_blocks (%d) is %d blocks to read: "+
			"they cannot be aligned", l, s, l-s, r, h, r-h)
	}
	return h, l - s, nil
}

// RankAddr returns the QUIC address of prefill rank r from validated params:
// remote_rank_addrs[r], or remote_host:remote_port+r when that list is empty.
func RankAddr(p *v1.KVTransferParams, r int) (string, error) {
	tp := int(p.GetTpSize())
	if r < 0 || r >= tp {
		return "", &ParamsError{Field: "tp_size", Value: strconv.Itoa(tp), Rule: fmt.Sprintf("rank %d is not below it", r)}
	}
	if addrs := p.GetRemoteRankAddrs(); len(addrs) > 0 {
		return addrs[r], nil
	}
	return net.JoinHostPort(p.GetRemoteHost(), strconv.Itoa(int(p.GetRemotePort())+r)), nil
}

func checkHostPort(a string) error {
	host, port, err := net.SplitHostPort(a)
	if err != nil {
		return errors.New("must be host:port")
	}
	if host == "" {
		return errors.New("host must not be empty")
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 1 || n > 65535 {
		return errors.New("port must be in [1, 65535]")
	}
	return nil
}
