package handshake

import (
	"context"
	"fmt"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Server answers handshake requests for one local rank. It is safe for
// concurrent use; its metadata is fixed at construction (tp_size included:
// no later request can change it).
type Server struct {
	local *v1.AgentMetadata
}

// NewServer returns a Server advertising local, which must pass FromProto.
func NewServer(local *Metadata) (*Server, error) {
	if local == nil {
		return nil, errNilLocal
	}
	p := local.Proto()
	if _, err := FromProto(p); err != nil {
		return nil, fmt.Errorf("handshake: local metadata: %w", err)
	}
	return &Server{local: p}, nil
}

// Handle answers req. A request for another engine id or rank is answered
// with CODE_NOT_FOUND, one that claims another tp_size with CODE_TP_MISMATCH,
// another wire version with CODE_INCOMPATIBLE_MODEL; the metadata is sent only
// on success. A request with expected_tp_size 0 (the legacy rank-0 query) is
// answered with the metadata, whose tp_size the dialer then learns.
func (s *Server) Handle(_ context.Context, req *v1.HandshakeRequest) *v1.HandshakeResponse {
	fail := func(err error) *v1.HandshakeResponse { return &v1.HandshakeResponse{Error: codes.ToProto(err)} }
	l := s.local
	switch {
	case req.GetWireVersion() != WireVersion:
		return fail(fmt.Errorf("%w: wire_version %d, this agent speaks %d", ErrIncompatible, req.GetWireVersion(), WireVersion))
	case req.GetExpectedEngineId() != "" && req.GetExpectedEngineId() != l.GetEngineId():
		return fail(fmt.Errorf("%w: this agent is engine_id %q, not %q", ErrUnknownEngine, l.GetEngineId(), req.GetExpectedEngineId()))
	case req.GetExpectedTpRank() != l.GetTpRank():
		return fail(fmt.Errorf("%w: this agent is tp_rank %d, not %d", ErrUnknownEngine, l.GetTpRank(), req.GetExpectedTpRank()))
	case req.GetExpectedTpSize() != 0 && req.GetExpectedTpSize() != l.GetTpSize():
		return fail(fmt.Errorf("%w: engine %q has tp_size=%d, the request said tp_size=%d", ErrTPMismatch, l.GetEngineId(), l.GetTpSize(), req.GetExpectedTpSize()))
	}
	return &v1.HandshakeResponse{Metadata: l}
}

// CheckExpect checks e, the expectations a READ carries when its dialer did
// not wait for a handshake, against this rank's metadata, so that a READ
// sent to the wrong peer fails with the handshake's classes and names both
// values: ErrUnknownEngine (engine_id, tp_rank, incarnation), ErrTPMismatch
// (tp_size), ErrIncompatible (model hash: the differing geometry fields
// when e carries its geometry; region count; block_len; a layout that is
// not this rank's set of regions, naming both) and CODE_CAPABILITY_DENIED
// (capability_key_id: the export was signed with another key). Zero fields
// are not checked. When e carries a layout, regions maps the reader's
// region i to this rank's (MatchLayout); nil otherwise. Safe in 0-RTT: it
// reads only.
func (s *Server) CheckExpect(_ context.Context, e *v1.PeerExpect) (regions []int, err error) {
	l := s.local
	switch {
	case e.GetEngineId() != "" && e.GetEngineId() != l.GetEngineId():
		return nil, fmt.Errorf("%w: this agent is engine_id %q, the READ expects %q", ErrUnknownEngine, l.GetEngineId(), e.GetEngineId())
	case e.GetTpRank() != l.GetTpRank():
		return nil, fmt.Errorf("%w: this agent is tp_rank %d, the READ expects %d", ErrUnknownEngine, l.GetTpRank(), e.GetTpRank())
	case e.GetTpSize() != 0 && e.GetTpSize() != l.GetTpSize():
		return nil, fmt.Errorf("%w: engine %q has tp_size=%d, kv_transfer_params said tp_size=%d", ErrTPMismatch, l.GetEngineId(), l.GetTpSize(), e.GetTpSize())
	case len(e.GetModelHash()) != 0 && string(e.GetModelHash()) != string(l.GetModelHash()):
		if d := geometryDiff(l.GetGeometry(), e.GetGeometry(), "this agent", "reader"); e.GetGeometry() != nil && d != "" {
			return nil, fmt.Errorf("%w: this agent (model %q) and the reader (model %q) differ in %s", ErrIncompatible,
				l.GetGeometry().GetModel(), e.GetGeometry().GetModel(), d)
		}
		return nil, fmt.Errorf("%w: this agent's model hash %x differs from the reader's %x", ErrIncompatible, l.GetModelHash()[:min(6, len(l.GetModelHash()))], e.GetModelHash()[:min(6, len(e.GetModelHash()))])
	case e.GetNumRegions() != 0 && int(e.GetNumRegions()) != len(l.GetRegions()):
		return nil, fmt.Errorf("%w: this agent has %d regions, the reader's layout has %d", ErrIncompatible, len(l.GetRegions()), e.GetNumRegions())
	case e.GetIncarnation() != 0 && e.GetIncarnation() != l.GetIncarnation():
		return nil, fmt.Errorf("%w: this agent is incarnation %#x, kv_transfer_params said %#x (the prefill restarted; its blocks are gone)", ErrUnknownEngine, l.GetIncarnation(), e.GetIncarnation())
	case e.GetCapabilityKeyId() != "" && l.GetCapabilityKeyId() != "" && e.GetCapabilityKeyId() != l.GetCapabilityKeyId():
		return nil, codes.New(v1.Code_CODE_CAPABILITY_DENIED, "this agent holds capability key id %s, the export was signed with key id %s (the rank restarted with another --capability-key-file, or the params were edited)",
			l.GetCapabilityKeyId(), e.GetCapabilityKeyId())
	}
	if bl := e.GetBlockLen(); bl != 0 {
		for i, r := range l.GetRegions() {
			if r.GetBlockLen() != bl {
				return nil, fmt.Errorf("%w: this agent's regions[%d].block_len=%d, the reader's TP mapping needs %d", ErrIncompatible, i, r.GetBlockLen(), bl)
			}
		}
	}
	if len(e.GetLayout()) == 0 {
		return nil, nil
	}
	served := make([]RegionShape, len(l.GetRegions()))
	for i, r := range l.GetRegions() {
		served[i] = RegionShape{Layer: r.GetLayer(), Kind: r.GetKind(), BlockLen: r.GetBlockLen()}
	}
	return MatchLayout(served, layoutFromProto(e.GetLayout()), "this agent", "the reader")
}

// ExpectOf is the wire form of e for a READ that carries it
// (transfer.Xfer.Expect), with the capability key id its export was signed
// with ("" = not checked).
func ExpectOf(e Expect, capabilityKeyID string) *v1.PeerExpect {
	x := &v1.PeerExpect{EngineId: e.EngineID, TpRank: uint32(e.TPRank), TpSize: uint32(e.TPSize), ModelHash: e.ModelHash,
		Geometry: e.Geometry, NumRegions: uint32(e.NumRegions), BlockLen: e.BlockLen, Incarnation: e.Incarnation, CapabilityKeyId: capabilityKeyID}
	for _, r := range e.Layout {
		x.Layout = append(x.Layout, &v1.RegionShape{Layer: r.Layer, Kind: r.Kind, BlockLen: r.BlockLen})
	}
	return x
}

// layoutFromProto converts a PeerExpect's layout.
func layoutFromProto(l []*v1.RegionShape) []RegionShape {
	out := make([]RegionShape, len(l))
	for i, r := range l {
		out[i] = RegionShape{Layer: r.GetLayer(), Kind: r.GetKind(), BlockLen: r.GetBlockLen()}
	}
	return out
}
