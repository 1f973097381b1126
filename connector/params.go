package connector

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"strconv"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"

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
	// Field is the JSON field name, e.g. "tp_size", or its path,
	// "rank_exports[1].tp_rank".
	Field string
	// Value is the offending value as text ("" when missing).
	Value string
	// Rule says what was expected.
	Rule string
	// Reason is the rule's stable name (codes.ReasonParamsMissing, ...),
	// sent as v1.Error.reason; callers branch on it and Field, never on
	// Rule.
	Reason codes.Reason
}

func (e *ParamsError) Error() string { return "connector: kv_transfer_params: " + e.detail() }

// detail is the message without the package prefix.
func (e *ParamsError) detail() string {
	if e.Value == "" {
		return fmt.Sprintf("%s: %s", e.Field, e.Rule)
	}
	return fmt.Sprintf("%s=%s: %s", e.Field, e.Value, e.Rule)
}

// Unwrap returns ErrInvalidParams.
func (e *ParamsError) Unwrap() error { return ErrInvalidParams }

// Code is CODE_INVALID_ARGUMENT: bad params are the caller's error, also
// when they cross the local API.
func (e *ParamsError) Code() v1.Code { return v1.Code_CODE_INVALID_ARGUMENT }

// ErrorReason returns Reason (codes.Reasoner).
func (e *ParamsError) ErrorReason() codes.Reason { return e.Reason }

// PartError is a refusal of MergeExports: its part number Part (an index
// into the parts) broke the rule of Err. errors.As finds both, and
// codes.Of and codes.ReasonOf read Err's code and reason.
type PartError struct {
	// Part is the index of the refused part.
	Part int
	// Err names the field and the rule.
	Err *ParamsError
}

func (e *PartError) Error() string {
	return fmt.Sprintf("connector: MergeExports: part %d: %s", e.Part, e.Err.detail())
}

// Unwrap returns Err.
func (e *PartError) Unwrap() error { return e.Err }

var paramsJSON = protojson.MarshalOptions{UseProtoNames: true}

// undecodableField returns the proto name of the field of data, a JSON
// object of message md, whose value protojson cannot decode: the first in
// key order whose value alone fails, the innermost where the value is a
// message or a list of them (rank_exports[0].capability gives
// "capability"); "kv_transfer_params" when data is no JSON object or no
// field fails alone (a repeated key). It reads the JSON, never the text of
// protojson's error.
func undecodableField(md protoreflect.MessageDescriptor, data []byte) string {
	if f := badField(md, data); f != "" {
		return f
	}
	return "kv_transfer_params"
}

func badField(md protoreflect.MessageDescriptor, data []byte) string {
	var obj map[string]json.RawMessage
	if json.Unmarshal(data, &obj) != nil {
		return ""
	}
	for _, k := range slices.Sorted(maps.Keys(obj)) {
		fd := md.Fields().ByJSONName(k)
		if fd == nil {
			fd = md.Fields().ByTextName(k)
		}
		if fd == nil {
			continue // unknown fields are discarded
		}
		one, err := json.Marshal(map[string]json.RawMessage{k: obj[k]})
		if err != nil {
			return string(fd.Name())
		}
		if (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(one, dynamicpb.NewMessage(md)) == nil {
			continue
		}
		if fd.Message() != nil && !fd.IsMap() {
			elems := []json.RawMessage{obj[k]}
			if fd.IsList() {
				_ = json.Unmarshal(obj[k], &elems)
			}
			for _, e := range elems {
				if f := badField(fd.Message(), e); f != "" {
					return f
				}
			}
		}
		return string(fd.Name())
	}
	return ""
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
		return nil, &ParamsError{Field: undecodableField(p.ProtoReflect().Descriptor(), data),
			Rule: "cannot be decoded: " + err.Error(), Reason: codes.ReasonParamsUndecodable}
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
// tp_size valid host:port entries; token_digests empty or TokenDigestLen
// bytes per remote block; lease_expires_unix_ms not negative;
// rank_exports entries of ranks below tp_size, each with an export_id, a
// capability and no block_ids or one per remote block, no rank twice. A
// violation is a *ParamsError naming the field and the reason.
func ValidateRemotePrefill(p *v1.KVTransferParams) error {
	if pe := validateRemotePrefill(p); pe != nil {
		return pe
	}
	return nil
}

func validateRemotePrefill(p *v1.KVTransferParams) *ParamsError {
	if p == nil {
		return &ParamsError{Field: "kv_transfer_params", Rule: "missing", Reason: codes.ReasonParamsMissing}
	}
	if p.TpSize == nil {
		return &ParamsError{Field: "tp_size", Rule: "missing; the prefill TP size is required and never defaulted to 1", Reason: codes.ReasonParamsMissing}
	}
	tp := p.GetTpSize()
	if tp < 1 || tp > MaxTPSize {
		return &ParamsError{Field: "tp_size", Value: strconv.FormatUint(uint64(tp), 10), Rule: fmt.Sprintf("must be in [1, %d]", MaxTPSize), Reason: codes.ReasonParamsOutOfRange}
	}
	if p.GetRemoteEngineId() == "" {
		return &ParamsError{Field: "remote_engine_id", Rule: "missing", Reason: codes.ReasonParamsMissing}
	}
	if p.GetRemoteRequestId() == "" {
		return &ParamsError{Field: "remote_request_id", Rule: "missing", Reason: codes.ReasonParamsMissing}
	}
	if n := len(p.GetRemoteRankAddrs()); n > 0 {
		if n != int(tp) {
			return &ParamsError{Field: "remote_rank_addrs", Value: fmt.Sprintf("%d entries", n),
				Rule: fmt.Sprintf("must have exactly tp_size=%d entries, one per prefill rank", tp), Reason: codes.ReasonParamsCountMismatch}
		}
		for i, a := range p.GetRemoteRankAddrs() {
			if err := checkHostPort(a); err != nil {
				return &ParamsError{Field: fmt.Sprintf("remote_rank_addrs[%d]", i), Value: strconv.Quote(a), Rule: err.Error(), Reason: codes.ReasonParamsBadAddress}
			}
		}
	} else {
		if p.GetRemoteHost() == "" {
			return &ParamsError{Field: "remote_host", Rule: "missing while remote_rank_addrs is empty", Reason: codes.ReasonParamsMissing}
		}
		port := p.GetRemotePort()
		if port < 1 || uint64(port)+uint64(tp)-1 > 65535 {
			return &ParamsError{Field: "remote_port", Value: strconv.FormatUint(uint64(port), 10),
				Rule: fmt.Sprintf("must be in [1, %d] so that ranks 0..%d fit at remote_port+rank", 65536-tp, tp-1), Reason: codes.ReasonParamsOutOfRange}
		}
	}
	if pe := checkTokenDigestCount("token_digests", p.GetTokenDigests(), len(p.GetRemoteBlockIds())); pe != nil {
		return pe
	}
	if p.GetLeaseExpiresUnixMs() < 0 {
		return &ParamsError{Field: "lease_expires_unix_ms", Value: strconv.FormatInt(p.GetLeaseExpiresUnixMs(), 10), Rule: "must not be negative", Reason: codes.ReasonParamsOutOfRange}
	}
	seen := make(map[uint32]int, len(p.GetRankExports()))
	for i, e := range p.GetRankExports() {
		field := func(f string) string { return fmt.Sprintf("rank_exports[%d].%s", i, f) }
		switch {
		case e.GetTpRank() >= tp:
			return &ParamsError{Field: field("tp_rank"), Value: strconv.FormatUint(uint64(e.GetTpRank()), 10), Rule: fmt.Sprintf("must be below tp_size=%d", tp), Reason: codes.ReasonParamsOutOfRange}
		case e.GetExportId() == 0:
			return &ParamsError{Field: field("export_id"), Rule: "missing (0)", Reason: codes.ReasonParamsMissing}
		case len(e.GetCapability()) == 0:
			return &ParamsError{Field: field("capability"), Rule: "missing", Reason: codes.ReasonParamsMissing}
		case len(e.GetBlockIds()) != 0 && len(e.GetBlockIds()) != len(p.GetRemoteBlockIds()):
			return &ParamsError{Field: field("block_ids"), Value: fmt.Sprintf("%d entries", len(e.GetBlockIds())),
				Rule:   fmt.Sprintf("must be empty (the rank holds remote_block_ids) or hold one id per remote block (%d)", len(p.GetRemoteBlockIds())),
				Reason: codes.ReasonParamsCountMismatch}
		}
		if j, dup := seen[e.GetTpRank()]; dup {
			return &ParamsError{Field: field("tp_rank"), Value: strconv.FormatUint(uint64(e.GetTpRank()), 10),
				Rule:   fmt.Sprintf("rank_exports[%d] names the same rank; each rank exports a request once", j),
				Reason: codes.ReasonParamsRankRepeated}
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
// request, engine, tp_size, number of blocks, prompt_tokens and
// token_digests, and no rank twice, and
// each must pass ValidateRemotePrefill. A refusal of a part is a
// *PartError naming the part, whose *ParamsError names the field and the
// reason (codes.ReasonMergePartsDiffer, codes.ReasonParamsRankRepeated, or
// the one ValidateRemotePrefill gave); no part is a *ParamsError with
// codes.ReasonMergeNoParts. Parts are not modified.
func MergeExports(parts ...*v1.KVTransferParams) (*v1.KVTransferParams, error) {
	if len(parts) == 0 {
		return nil, &ParamsError{Field: "kv_transfer_params", Rule: "MergeExports needs at least one part", Reason: codes.ReasonMergeNoParts}
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
		differs := func(field, value, rule string) error {
			return &PartError{Part: i, Err: &ParamsError{Field: field, Value: value, Rule: rule, Reason: codes.ReasonMergePartsDiffer}}
		}
		if pe := validateRemotePrefill(p); pe != nil {
			return nil, &PartError{Part: i, Err: pe}
		}
		switch {
		case p.GetRemoteRequestId() != base.GetRemoteRequestId():
			return nil, differs("remote_request_id", strconv.Quote(p.GetRemoteRequestId()), fmt.Sprintf("differs from %q", base.GetRemoteRequestId()))
		case p.GetRemoteEngineId() != base.GetRemoteEngineId():
			return nil, differs("remote_engine_id", strconv.Quote(p.GetRemoteEngineId()), fmt.Sprintf("differs from %q", base.GetRemoteEngineId()))
		case p.GetTpSize() != base.GetTpSize():
			return nil, differs("tp_size", strconv.FormatUint(uint64(p.GetTpSize()), 10), fmt.Sprintf("differs from %d", base.GetTpSize()))
		case len(p.GetRemoteBlockIds()) != len(base.GetRemoteBlockIds()):
			return nil, differs("remote_block_ids", fmt.Sprintf("%d entries", len(p.GetRemoteBlockIds())),
				fmt.Sprintf("every rank holds the same %d token blocks", len(base.GetRemoteBlockIds())))
		case p.GetPromptTokens() != base.GetPromptTokens():
			return nil, differs("prompt_tokens", strconv.FormatUint(uint64(p.GetPromptTokens()), 10), fmt.Sprintf("differs from %d", base.GetPromptTokens()))
		case !bytes.Equal(p.GetTokenDigests(), base.GetTokenDigests()):
			return nil, differs("token_digests", hex.EncodeToString(p.GetTokenDigests()),
				fmt.Sprintf("differs from %s: every rank holds the KV of the same tokens", hex.EncodeToString(base.GetTokenDigests())))
		}
		if p.GetLeaseExpiresUnixMs() != 0 && (out.GetLeaseExpiresUnixMs() == 0 || p.GetLeaseExpiresUnixMs() < out.GetLeaseExpiresUnixMs()) {
			out.LeaseExpiresUnixMs = p.GetLeaseExpiresUnixMs()
		}
		for _, e := range p.GetRankExports() {
			if j, dup := seen[e.GetTpRank()]; dup {
				return nil, &PartError{Part: i, Err: &ParamsError{Field: "rank_exports", Value: fmt.Sprintf("rank %d", e.GetTpRank()),
					Rule: fmt.Sprintf("part %d exports the same rank", j), Reason: codes.ReasonParamsRankRepeated}}
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
		return "", &ParamsError{Field: "tp_size", Value: strconv.Itoa(tp), Rule: fmt.Sprintf("rank %d is not below it", r), Reason: codes.ReasonParamsOutOfRange}
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
