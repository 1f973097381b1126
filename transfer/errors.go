package transfer

import (
	"errors"
	"fmt"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Sentinel error classes. Each maps 1:1 to a v1.Code (codes.Of); errors
// returned by this package and errors decoded from a peer's reply both match
// them with errors.Is.
var (
	// ErrInvalidArgument: a malformed message or a descriptor of length 0.
	ErrInvalidArgument = codes.Sentinel(v1.Code_CODE_INVALID_ARGUMENT)
	// ErrNotFound: unknown request id or descriptor list id.
	ErrNotFound = codes.Sentinel(v1.Code_CODE_NOT_FOUND)
	// ErrOutOfRange: a descriptor outside every registered region, an
	// overflowing addr+len, a wrong device id, or an index beyond a list.
	ErrOutOfRange = codes.Sentinel(v1.Code_CODE_OUT_OF_RANGE)
	// ErrCapabilityDenied: the capability does not cover the named blocks.
	ErrCapabilityDenied = codes.Sentinel(v1.Code_CODE_CAPABILITY_DENIED)
	// ErrLeaseExpired: the request's lease has expired.
	ErrLeaseExpired = codes.Sentinel(v1.Code_CODE_LEASE_EXPIRED)
	// ErrBusy: back-pressure; try again later.
	ErrBusy = codes.Sentinel(v1.Code_CODE_BUSY)
	// ErrAborted: the transfer was aborted by either side.
	ErrAborted = codes.Sentinel(v1.Code_CODE_ABORTED)
	// ErrInternal: a bug or a memory backend failure on the replying side.
	ErrInternal = codes.Sentinel(v1.Code_CODE_INTERNAL)
	// ErrTimeout: the progress deadline or the caller's deadline passed.
	ErrTimeout = codes.Sentinel(v1.Code_CODE_TIMEOUT)
	// ErrUnavailable: the peer is gone, shutting down, or serves no such call.
	ErrUnavailable = codes.Sentinel(v1.Code_CODE_UNAVAILABLE)
	// ErrDataLoss: bytes arrived but do not match their checksum.
	ErrDataLoss = codes.Sentinel(v1.Code_CODE_DATA_LOSS)
	// ErrIncompatible: the peer speaks another wire version.
	ErrIncompatible = codes.Sentinel(v1.Code_CODE_INCOMPATIBLE_MODEL)
)

// errorf returns an error of class c whose message is "transfer: " + format.
func errorf(c v1.Code, format string, a ...any) error {
	return codes.New(c, "transfer: "+format, a...)
}

// XferError reports a failed READ or WRITE with how far it got. It matches
// its class sentinel (ErrTimeout, ErrAborted, ...) through errors.Is, and
// codes.Of(err) is Code.
type XferError struct {
	// Op is OpRead or OpWrite.
	Op Op
	// Peer is the remote agent's address, host:port.
	Peer string
	// XferID is the transfer's id (Result.XferID).
	XferID uint64
	// Bytes is how many bytes landed: in local memory for a READ; for a
	// WRITE, what the receiver acknowledged (0 without an ack).
	Bytes uint64
	// Sent is, for a WRITE, how many bytes were handed to the stream.
	Sent uint64
	// Total is the transfer's size in bytes.
	Total uint64
	// Err is the cause; codes.Of(Err) gives the class.
	Err error
}

func (e *XferError) Error() string {
	s := fmt.Sprintf("transfer: %s %d with %s failed after %d of %d bytes", e.Op, e.XferID, e.Peer, e.Bytes, e.Total)
	if e.Op == OpWrite && e.Sent != e.Bytes {
		s += fmt.Sprintf(" (%d sent, unacknowledged)", e.Sent)
	}
	return s + ": " + e.Err.Error()
}

// Unwrap returns the cause.
func (e *XferError) Unwrap() error { return e.Err }

// Code is the error class of the cause.
func (e *XferError) Code() v1.Code { return codes.Of(e.Err) }

// isClass reports whether err has class c.
func isClass(err error, c v1.Code) bool { return errors.Is(err, codes.Sentinel(c)) }
