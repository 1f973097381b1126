package localapi

import (
	"errors"
	"fmt"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/unixsock"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Errors of the local API. A call refused by the sidecar reaches a Client
// as a *codes.Error with the sidecar's code (codes.Of).
var (
	// ErrInvalidArgument: a request, a reply or an argument breaks a rule
	// of the local API (CODE_INVALID_ARGUMENT).
	ErrInvalidArgument = codes.New(v1.Code_CODE_INVALID_ARGUMENT, "localapi: invalid argument")
	// ErrNotAttached: an engine call before CreateKVCache on this connection,
	// or a call that needs the cache before any engine created it
	// (CODE_UNAVAILABLE, reason NOT_ATTACHED: attach first).
	ErrNotAttached = codes.NewReason(v1.Code_CODE_UNAVAILABLE, codes.ReasonNotAttached, "localapi: no KV cache attached")
	// ErrGeometryRequired: a CreateKVCache without a geometry to a sidecar
	// started without one, before any engine created the cache
	// (CODE_INVALID_ARGUMENT, reason GEOMETRY_REQUIRED: attach again with
	// the engine's geometry). Once a cache exists, such a create takes its
	// geometry.
	ErrGeometryRequired = codes.NewReason(v1.Code_CODE_INVALID_ARGUMENT, codes.ReasonGeometryRequired, "localapi: geometry is required")
	// ErrBrokenConn: an earlier call on this Client failed mid-exchange
	// (timeout, bad reply), so the stream's state is unknown; dial again.
	ErrBrokenConn = errors.New("localapi: client: connection broken by an earlier error")
	// ErrDeviceMemory: a host-memory view (Region, Block) of a cache whose
	// pages are device memory; use BlockAddr, ReadBlock or WriteBlock. It wraps
	// errors.ErrUnsupported.
	ErrDeviceMemory = fmt.Errorf("localapi: client: the KV cache is device memory: %w", errors.ErrUnsupported)
	// ErrSocketInUse: another live process serves the socket path. It is the
	// one error of both kvsidecar sockets (tpgroup.ErrSocketInUse too).
	ErrSocketInUse = unixsock.ErrSocketInUse
)
