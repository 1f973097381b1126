package tpgroup

import (
	"fmt"
	"slices"
	"strings"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/unixsock"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Sentinel errors. Each is a *codes.Error of the class named, so codes.Of
// maps it to that v1.Code.
var (
	// ErrInvalidConfig: a Member or Config field breaks a rule
	// (CODE_INVALID_ARGUMENT).
	ErrInvalidConfig = codes.New(v1.Code_CODE_INVALID_ARGUMENT, "tpgroup: invalid config")
	// ErrInvalidArgument: a malformed message or argument, e.g. an empty page
	// list or a page op sent to rank 0 (CODE_INVALID_ARGUMENT).
	ErrInvalidArgument = codes.New(v1.Code_CODE_INVALID_ARGUMENT, "tpgroup: invalid argument")
	// ErrTPMismatch: a message or a peer claims a TP size other than the one
	// this group was started with (CODE_TP_MISMATCH).
	ErrTPMismatch = codes.New(v1.Code_CODE_TP_MISMATCH, "tpgroup: tp_size mismatch")
	// ErrSocketInUse: the rank's socket path is served by a live process;
	// the group refuses to steal it (CODE_ALREADY_EXISTS). It is the one
	// error of both kvsidecar sockets (the local API's too).
	ErrSocketInUse = unixsock.ErrSocketInUse
	// ErrUnsafeDir: the socket directory is not a directory owned by this
	// user with mode 0700 or stricter (CODE_INVALID_ARGUMENT). The same
	// error as the local API's.
	ErrUnsafeDir = unixsock.ErrUnsafeDir
	// ErrPeerUnavailable: a peer rank could not be reached or its connection
	// broke (CODE_UNAVAILABLE).
	ErrPeerUnavailable = codes.New(v1.Code_CODE_UNAVAILABLE, "tpgroup: peer unavailable")
	// ErrNotCoordinator: a coordinated page op was asked of a member that is
	// not rank 0 of a coordinated group (CODE_INVALID_ARGUMENT).
	ErrNotCoordinator = codes.New(v1.Code_CODE_INVALID_ARGUMENT, "tpgroup: not the coordinator")
)

// RankError is the failure of one operation on one peer rank. It unwraps to
// the cause: context.DeadlineExceeded (or the ctx's cause) on a timeout,
// ErrPeerUnavailable on a dial or I/O failure, ErrTPMismatch, or a
// *RemoteError carrying the peer's reply.
type RankError struct {
	// Rank is the peer's tp_rank.
	Rank int
	// Op is "map", "unmap", "free", "sync" (bringing the peer in line
	// with rank 0's pages first), "repair", "resync" or "ping".
	Op string
	// Err is the cause.
	Err error
}

func (e *RankError) Error() string {
	return fmt.Sprintf("tpgroup: rank %d: %s: %v", e.Rank, e.Op, e.Err)
}

// Unwrap returns the cause.
func (e *RankError) Unwrap() error { return e.Err }

// RemoteError is a non-OK reply of a peer.
type RemoteError struct {
	// Code is the peer's error code.
	Code v1.Code
	// Message is the peer's message.
	Message string
}

func (e *RemoteError) Error() string {
	return fmt.Sprintf("peer replied %s: %s", e.Code, e.Message)
}

// Is lets errors.Is(err, ErrTPMismatch) hold for a peer's CODE_TP_MISMATCH.
func (e *RemoteError) Is(target error) bool {
	return target == ErrTPMismatch && e.Code == v1.Code_CODE_TP_MISMATCH
}

// Unwrap returns the class of the peer's code (codes.Sentinel(Code)), so
// codes.Of gives the peer's code and errors.Is matches its class.
func (e *RemoteError) Unwrap() error { return codes.Sentinel(e.Code) }

// OpError is the failure of a coordinated map or unmap on ranks 1..N-1.
// errors.As(err, &*RankError) finds the first failed rank; Ranks lists all.
type OpError struct {
	// Op is "map" or "unmap".
	Op string
	// Pages is the number of pages of the operation.
	Pages int
	// Failed holds one *RankError per rank that failed, by rank.
	Failed []*RankError
	// RolledBack lists the ranks that had mapped and were unmapped again
	// (map only).
	RolledBack []int
	// RollbackFailed holds the ranks whose rollback unmap failed too; their
	// pages are unmapped before the next message to them (map only).
	RollbackFailed []*RankError
}

// Ranks returns the failed ranks in ascending order.
func (e *OpError) Ranks() []int {
	r := make([]int, len(e.Failed))
	for i, f := range e.Failed {
		r[i] = f.Rank
	}
	return r
}

func (e *OpError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "tpgroup: %s of %d pages failed on rank", e.Op, e.Pages)
	if len(e.Failed) > 1 {
		b.WriteString("s")
	}
	for i, f := range e.Failed {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, " %d (%s)", f.Rank, f.Err)
	}
	if len(e.RolledBack) > 0 {
		fmt.Fprintf(&b, "; rolled back ranks %v", e.RolledBack)
	}
	for _, f := range e.RollbackFailed {
		fmt.Fprintf(&b, "; rollback on rank %d failed (%s)", f.Rank, f.Err)
	}
	return b.String()
}

// Code is the wire code of the operation's failure: that of the lowest
// failed rank (codes.Of), so a follower over its memory limit reaches the
// engine as CODE_BUSY, as the coordinator's own limit would, not as
// CODE_INTERNAL.
func (e *OpError) Code() v1.Code {
	if len(e.Failed) == 0 {
		return v1.Code_CODE_INTERNAL
	}
	return codes.Of(e.Failed[0])
}

// Unwrap returns the failed ranks' errors, then the failed rollbacks'.
func (e *OpError) Unwrap() []error {
	out := make([]error, 0, len(e.Failed)+len(e.RollbackFailed))
	for _, f := range e.Failed {
		out = append(out, f)
	}
	for _, f := range e.RollbackFailed {
		out = append(out, f)
	}
	return out
}

func sortRankErrors(s []*RankError) {
	slices.SortFunc(s, func(a, b *RankError) int { return a.Rank - b.Rank })
}
