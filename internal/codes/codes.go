package codes

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Coder is implemented by errors that carry a wire code.
type Coder interface {
	Code() v1.Code
}

// Of returns the wire code of err: CODE_OK for nil, the code of the first
// Coder in the chain, CODE_TIMEOUT for deadline errors, CODE_ABORTED for
// cancellation, CODE_INTERNAL otherwise.
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
	}
	return v1.Code_CODE_INTERNAL
}

// Error is an error with a wire code: one received from a peer, or one a
// package returns to name its class.
type Error struct {
	C   v1.Code
	Msg string
}

// New returns an *Error with code c and a formatted message.
func New(c v1.Code, format string, a ...any) *Error {
	return &Error{C: c, Msg: fmt.Sprintf(format, a...)}
}

// Error returns the message. A sentinel (no message) reads as its code in
// words ("unavailable", "capability denied"), so a "%w: detail" wrapping of
// it reads "unavailable: detail" instead of ": detail".
func (e *Error) Error() string {
	if e.Msg == "" {
		return strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(e.C.String(), "CODE_")), "_", " ")
	}
	return e.Msg
}

// Code returns the wire code.
func (e *Error) Code() v1.Code { return e.C }

// Is matches another *Error with the same code, so
// errors.Is(err, codes.Sentinel(v1.Code_CODE_TP_MISMATCH)) works on remote errors.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Msg == "" && t.C == e.C
}

// Sentinel returns a message-less *Error matching every error of code c
// under errors.Is.
func Sentinel(c v1.Code) error { return &Error{C: c} }

// ToProto encodes err for the wire: nil for success.
func ToProto(err error) *v1.Error {
	if err == nil {
		return nil
	}
	return &v1.Error{Code: Of(err), Message: err.Error()}
}

// FromProto decodes a wire error: nil when e is nil or CODE_OK, otherwise an
// *Error with the peer's code and message prefixed by who said it.
func FromProto(peer string, e *v1.Error) error {
	if e.GetCode() == v1.Code_CODE_OK {
		return nil
	}
	msg := e.GetMessage()
	if peer != "" {
		msg = peer + ": " + msg
	}
	return &Error{C: e.GetCode(), Msg: fmt.Sprintf("%s (%s)", msg, e.GetCode())}
}
