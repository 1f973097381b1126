package codes

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Coder is implemented by errors that carry a wire code: *Error, and the
// struct errors of a package that name their class from their cause
// (transfer.XferError, tpgroup.OpError, connector.ParamsError).
type Coder interface {
	Code() v1.Code
}

// Of returns the wire code of err, the one mapping of the module:
//
//   - CODE_OK for nil;
//   - the code of the first Coder in the chain (errors.As order: depth first,
//     the errors of an Unwrap() []error in order);
//   - CODE_TIMEOUT for context.DeadlineExceeded or os.ErrDeadlineExceeded;
//   - CODE_ABORTED for context.Canceled;
//   - CODE_UNAVAILABLE for net.ErrClosed (a pool, group, server or client
//     used after its Close);
//   - CODE_INTERNAL otherwise.
func Of(err error) v1.Code {
	if err == nil {
		return v1.Code_CODE_OK
	}
	var c Coder
	if errors.As(err, &c) {
		return c.Code()
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded):
		return v1.Code_CODE_TIMEOUT
	case errors.Is(err, context.Canceled):
		return v1.Code_CODE_ABORTED
	case errors.Is(err, net.ErrClosed):
		return v1.Code_CODE_UNAVAILABLE
	}
	return v1.Code_CODE_INTERNAL
}

// Error is an error of one class: a class itself (Sentinel, no message), a
// package's sentinel or detailed error (New, NewReason), or an error
// received from a peer (FromProto).
type Error struct {
	// Class is the wire code the error maps to.
	Class v1.Code
	// Message is the text; empty only for a class (Sentinel).
	Message string
	// Reason says why, finer than Class (v1.Error.reason); empty when the
	// class says all a caller can act on.
	Reason Reason
}

// New returns an *Error of class c with a formatted message. A package
// declares its sentinels with it (var ErrNotMapped = codes.New(...)):
// errors.Is matches such a sentinel by identity, and it matches its class
// (Sentinel(c)) too.
func New(c v1.Code, format string, a ...any) *Error {
	return &Error{Class: c, Message: fmt.Sprintf(format, a...)}
}

// NewReason returns an *Error of class c and reason r with a formatted
// message. A package declares the sentinels that callers across the wire
// branch on with it: errors.Is matches such a sentinel by identity, every
// error of the same class and reason (a peer's reply too), and its class.
func NewReason(c v1.Code, r Reason, format string, a ...any) *Error {
	return &Error{Class: c, Message: fmt.Sprintf(format, a...), Reason: r}
}

// ErrorReason returns the reason (Reasoner).
func (e *Error) ErrorReason() Reason { return e.Reason }

// Error returns the message. A class (no message) reads as its code in
// words ("unavailable", "capability denied"), so a "%w: detail" wrapping of
// it reads "unavailable: detail" instead of ": detail".
func (e *Error) Error() string {
	if e.Message == "" {
		return strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(e.Class.String(), "CODE_")), "_", " ")
	}
	return e.Message
}

// Code returns the wire code.
func (e *Error) Code() v1.Code { return e.Class }

// Is matches a class (an *Error with no message) of the same code, so
// errors.Is(err, codes.Sentinel(v1.Code_CODE_TP_MISMATCH)) holds for every
// error of that class: a package's sentinel, a detailed error, a peer's.
// It matches a target with a reason (NewReason) when the class and the
// reason are the same, so a Go client's errors.Is(err,
// localapi.ErrGeometryRequired) holds for the sidecar's reply.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	switch {
	case !ok || t.Class != e.Class:
		return false
	case t.Reason != "":
		return t.Reason == e.Reason
	}
	return t.Message == ""
}

// Sentinel returns the class c: a message-less *Error matching every error
// of code c under errors.Is.
func Sentinel(c v1.Code) error { return &Error{Class: c} }

// ToProto encodes err for the wire: nil for success; otherwise its code
// (Of), its reason (ReasonOf) and its text.
func ToProto(err error) *v1.Error {
	if err == nil {
		return nil
	}
	return &v1.Error{Code: Of(err), Message: err.Error(), Reason: string(ReasonOf(err))}
}

// FromProto decodes a wire error: nil when e is nil or CODE_OK, otherwise an
// *Error with the peer's code and reason and its message prefixed by who
// said it.
func FromProto(peer string, e *v1.Error) error {
	if e.GetCode() == v1.Code_CODE_OK {
		return nil
	}
	msg := e.GetMessage()
	if peer != "" {
		msg = peer + ": " + msg
	}
	return &Error{Class: e.GetCode(), Message: fmt.Sprintf("%s (%s)", msg, e.GetCode()), Reason: Reason(e.GetReason())}
}
