package transfer

import (
	"errors"
	"fmt"
	"os"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// The same-host path: a second way for the bytes of a READ to travel,
// between two agents of one host. The serving agent listens on a unix
// socket (Config.LocalSocket) besides its QUIC socket; a reader that knows,
// from the serving agent's metadata, that the agent runs on its own host
// (Xfer.SameHost) sends the READ there instead of on a QUIC stream. The
// request, its checks (expectations, descriptors, capability: server.admit),
// the pins (Config.Authorize and Config.Release), the budget, the progress
// deadline, the completion and the checksums are those of a QUIC READ; only
// the bytes move otherwise: the server passes the files that back the
// served pages (Config.Share; SCM_RIGHTS), and the reader maps them
// read-only, copies the bytes into its own memory (memcpy, or device
// copies through Config.PeerCopier) and unmaps them before the READ
// returns. Notifications, heartbeats and handshakes stay on QUIC.
//
// Who may map what: the socket lives in a directory of the serving user
// with mode 0700 (internal/unixsock), and each side checks the other's
// uid (SO_PEERCRED) against its own: only a process of the same user,
// which could read the sidecar's memory through /proc anyway, ever gets a
// page. A memfd is passed reopened read-only, so the reader cannot write
// it; the reader gets the pages the READ touches, after the same
// capability check a QUIC READ passes, and holds them mapped only while
// the READ runs.

// SharedPages is what Config.Share returns for the ranges a same-host READ
// touches: the files that back them and where each page lies in them.
type SharedPages struct {
	// Kind says how a reader maps the files.
	Kind v1.PageKind
	// Files are passed to the reader with SCM_RIGHTS; the agent closes
	// them once sent.
	Files []*os.File
	// Pages cover every byte of the ranges Share was given, each in one
	// file.
	Pages []SharedPage
}

// SharedPage says that bytes [Addr, Addr+Len) of the agent's registered
// memory are bytes [FileOffset, FileOffset+Len) of Files[File].
type SharedPage struct {
	Addr, Len  uint64
	File       int
	FileOffset uint64
}

// Close closes every file.
func (s *SharedPages) Close() error {
	var errs []error
	for _, f := range s.Files {
		errs = append(errs, f.Close())
	}
	s.Files = nil
	return errors.Join(errs...)
}

// SameHostPeer names the same-host socket of the agent a READ is for, as
// its metadata offers it (AgentMetadata.same_host). Whoever sets it has
// checked that the offer comes from the peer (its authenticated metadata,
// never kv_transfer_params) and that its host identity is this host's.
type SameHostPeer struct {
	// Socket is the path of the peer's unix socket.
	Socket string
	// Token is the peer's token; the socket's hello must carry it.
	Token []byte
	// Kind is the kind of pages the peer passes.
	Kind v1.PageKind
}

// PeerCopier maps another process's device pages and copies from them into
// this process's device memory, for same-host READs of device memory
// (v1.PAGE_KIND_CUDA_POSIX_FD). vmm/cuda's Backend implements it.
type PeerCopier interface {
	// ImportPeerPages imports files[i] (one device page of sizes[i] bytes
	// each) and maps it with read access in this process; addrs[i] is its
	// device address. release unmaps and releases every page; it must be
	// called once the copies are done. An error (such as a device without
	// peer access to the pages' device) leaves nothing mapped.
	ImportPeerPages(files []*os.File, sizes []uint64) (addrs []uint64, release func() error, err error)
	// CopyDeviceToDevice copies n[i] bytes from device address src[i] to
	// dst[i] for every i and returns once every copy is done.
	CopyDeviceToDevice(dst, src, n []uint64) error
}

// errNotLocal marks a same-host READ that could not be sent (the socket is
// unreachable or served by another agent, another uid, page kinds this
// agent cannot map): the READ goes over QUIC instead, and nothing of it
// reached the peer.
var errNotLocal = errors.New("transfer: same-host path unavailable")

// errPeerChanged marks a same-host socket that is gone or served by
// another agent than the metadata that named it: the peer restarted (or
// moved), and what the caller learned of it is stale (Xfer.OnRedial).
var errPeerChanged = errors.New("transfer: the peer's same-host socket is gone or serves another agent")

// localFallback is a same-host path that could not be used, with why.
type localFallback struct {
	socket string
	why    error
}

func (f *localFallback) Error() string {
	return fmt.Sprintf("transfer: same-host path to %s unavailable, READs go over QUIC: %v", f.socket, f.why)
}

func (f *localFallback) Unwrap() []error { return []error{errNotLocal, f.why} }

// localProgressBytes is how many bytes a same-host reader copies between
// two progress frames: the serving side's progress deadline
// (Config.ProgressTimeout) sees them as QUIC's stream bytes.
const localProgressBytes = 16 << 20

// landChunk bounds the run of bytes a READ lands before it hands them to
// its checksum and Xfer.OnLanded, so they read bytes still in cache (a
// 256 KiB run fits the L2 cache of current server cores).
const landChunk = 256 << 10
