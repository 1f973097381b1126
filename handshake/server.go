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
