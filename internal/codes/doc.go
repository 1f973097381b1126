// Package codes is the one map between Go errors and the wire error-code
// enum (v1.Code), in both directions, so every reply on every channel (QUIC
// streams, the handshake, the local API, the TP group socket) carries a code
// the peer can branch on. It imports only the proto package, so every layer,
// vmm included, can use it.
//
// The shape is containerd's errdefs + errgrpc: a small fixed set of classes
// (one per v1.Code), errors of every package that belong to one class, one
// function from an error to its code (Of) and one each way across the wire
// (ToProto, FromProto).
//
// There is one kind of sentinel, *Error:
//
//   - Sentinel(c) is the class c itself, with no message. errors.Is(err,
//     Sentinel(c)) holds for every *Error of code c in err's chain: a
//     package's sentinel, a detailed error, a peer's reply. transfer exports
//     its classes this way (transfer.ErrBusy is Sentinel(CODE_BUSY)).
//   - New(c, "pkg: what") is a package's own sentinel or a detailed error of
//     class c. errors.Is matches a sentinel declared with it by identity
//     (errors.Is(err, vmm.ErrNotMapped)), and it matches its class too.
//
// A class can be too coarse for a caller: CODE_INVALID_ARGUMENT for a create
// without a geometry asks the engine to send one, for a bad block id to fix
// its call. Such errors carry a Reason (reason.go, the module's one list,
// generated for Python by `make generate`): NewReason(c, r, "pkg: what")
// declares a sentinel of class c and reason r, ReasonOf finds the reason of
// the error that gives the code, ToProto and FromProto carry it in
// v1.Error.reason, and errors.Is matches a peer's reply against the
// sentinel. Nobody branches on a message.
//
// A struct error that names a page, a rank or a request wraps one of these
// with %w (or implements Coder when its class comes from its cause), and Of
// finds the first in the chain. Errors of no class map by their cause:
// deadlines to CODE_TIMEOUT, cancellation to CODE_ABORTED, net.ErrClosed to
// CODE_UNAVAILABLE, anything else to CODE_INTERNAL.
//
//	var ErrNotMapped = codes.New(v1.Code_CODE_NOT_FOUND, "vmm: page not mapped")
//	err := fmt.Errorf("vmm: read page %d: %w", 3, ErrNotMapped)
//	codes.Of(err)                                        // CODE_NOT_FOUND
//	errors.Is(err, codes.Sentinel(v1.Code_CODE_NOT_FOUND)) // true
//	rep.Error = codes.ToProto(err)                       // on the wire
//	err = codes.FromProto("10.0.0.1:5600", rep.Error)    // at the peer: same class
//
//	var ErrGeometryRequired = codes.NewReason(v1.Code_CODE_INVALID_ARGUMENT,
//		codes.ReasonGeometryRequired, "localapi: geometry is required")
//	codes.ReasonOf(fmt.Errorf("%w: create", ErrGeometryRequired)) // GEOMETRY_REQUIRED
package codes
