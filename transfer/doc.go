// Package transfer is the data plane: QUIC agents (quic-go, TLS 1.3 with
// mutual authentication, ALPN kvsidecar/1) that move KV bytes between
// registered memory of two ranks with NIXL-style descriptor lists, READ and
// WRITE, completion acks, notifications, abort, progress deadlines, bounds and
// capability checks, and per-peer back-pressure. It knows nothing about model
// geometry; the connector drives it and decides what a request may touch
// through Config.Authorize (or a CapabilityKey).
//
// # Use
//
//	key := transfer.NewCapabilityKey()
//	a, err := transfer.New(&transfer.Config{
//		ListenAddr: "0.0.0.0:5600", ServerTLS: srvTLS, ClientTLS: cliTLS,
//		Regions: []transfer.Region{{Base: base, Len: n, BlockLen: bl, Mem: mem}},
//		CapabilityKey: key,
//	})
//	defer a.Close()
//	res, err := a.Transfer(ctx, &transfer.Xfer{Op: transfer.OpRead, Peer: "10.0.0.2:5600",
//		RequestID: id, Capability: capab, Local: local, Remote: remote})
//
// New is NewUnstarted then Start: an owner whose serving callbacks need
// the agent itself (its address, a client calling through it) builds them
// between the two, and no peer is served before Start.
//
// # Wire
//
// Every exchange is one bidirectional stream opened by the dialer that starts
// with a PeerRequest frame (internal/wire). READ: the server answers with an
// XferStatus header, the raw bytes of each descriptor in order, and a final
// XferStatus (byte count, optional CRC-32C per descriptor). WRITE: the dialer
// sends the request, the bytes (and a checksum frame when asked); the server
// answers with an XferStatus ack only after every byte is in its memory, and
// the WRITE completes only on that ack. Bytes go between page memory and the
// stream without an intermediate copy when Memory.HostBytes works, through a
// bounded staging buffer otherwise. A refusal or an abort resets the stream
// with the v1.Code as application error code.
//
// # 0-RTT
//
// One connection per remote address, dialed with DialEarly and a session
// ticket cache keyed by address, so a returning peer reconnects in 0-RTT.
// Two requests travel in 0-RTT: the idempotent Handshake and a READ. So the
// first KV byte from a returning peer arrives one round trip after the
// dial, and from a new one two (QUIC and TLS, then the READ): a READ that
// names the peer's memory by region and block (Xfer.RemoteBlocks) and
// carries the handshake's expectations (Xfer.Expect) needs no metadata
// round trip before it. Heartbeat, Prepare and its release
// (DescList.Close), WRITE and notifications wait for the handshake to
// complete, on the dialer and again on the server.
//
// Why a READ in 0-RTT is safe to replay. TLS 1.3 early data has no replay
// protection (RFC 8446 section 8): anyone on the path can capture a
// dialer's first flight and send it again, and the server runs the READ
// again. What the replay can reach:
//
//   - The bytes. They go on the stream of the connection that asked,
//     sealed with that connection's 1-RTT keys, which come from the
//     dialer's ephemeral key share: a replayer without the dialer's
//     private key cannot read them, and cannot finish the handshake.
//   - The memory. The served memory is only read, and only under the same
//     checks as any READ (expectations, bounds, the export's capability);
//     the served blocks are pinned while the stream runs, so they are
//     never freed under it, and the pin ends with the stream (a replayed
//     connection never completes its handshake and ends at its handshake
//     timeout).
//   - Lasting state. None changes: Access.Early tells the owner the READ
//     came before the handshake completed, and the owner neither marks
//     the lease as read nor counts the READ until it did (a drain does not
//     wait for a replay); leases are extended only by heartbeats, released
//     only by notifications, and both wait for the handshake.
//   - Work. A replay costs the server what the original READ cost, bounded
//     per connection by MaxInflightPerPeer and by the handshake timeout.
//
// When the server rejects 0-RTT the request is resent on the completed
// connection (the redial rule below). Race builds open no stream before the
// handshake completes (quic-go/quic-go#4303).
//
// # Redial rule
//
// Every call that uses the cached connection to a peer (Handshake, READ and
// WRITE through Transfer, Notify, Heartbeat, Prepare) follows one rule,
// implemented in one place: when the connection died under the call, the
// agent dials once more and runs the call again on the new connection; if
// that dial fails too, the call fails with the original cause. A connection
// died when it ended without refusing anything: a stateless reset (the
// peer's address is now served by a process that does not know the
// connection, typically a restarted peer), an idle timeout, 0-RTT data the
// server rejected (the request is sent again once the handshake completes),
// or a clean close (application code 0: a peer going away). A refusal is
// never retried: a TLS alert (unknown or missing certificate), a stream reset
// or a reply with a code (ErrCapabilityDenied, ErrLeaseExpired,
// ErrIncompatible, a draining peer's ErrUnavailable, ...), a dial that does
// not complete, and the caller's own deadline. Before the new connection is
// used, OnPeerGone is told about the old one, prepared lists are prepared
// again on the new one, and Xfer.OnRedial may check that the memory the
// transfer names is still the peer's (a restarted peer lays it out anew).
// Every call is safe to send twice: handshakes and heartbeats are
// idempotent, a READ or WRITE moves the same bytes to the same place again,
// and a notification names its consumer, which the receiver counts once.
//
// A peer restarted on its address with the same StatelessResetKey answers
// the old connection's packets with a stateless reset, but quic-go sends
// one only in reply to a packet over 42 bytes, which its keep-alive PINGs
// are not: every dialed connection therefore sends a 48-byte probe
// datagram each KeepAlivePeriod, so an idle one learns of the restart
// within a period (OnPeerGone), and a busy one from its next request.
// While no agent serves a socket (a sidecar whose engine has not attached),
// a Standby answers on it: the same resets, and a refusal with a reason for
// every new connection, so nobody sends into an unread socket until a
// deadline.
//
// # READ lanes
//
// quic-go runs one connection's packets on one goroutine per side, so one
// connection moves a READ at about one core's speed. With Config.ReadLanes
// K > 1 a READ of at least Config.ReadLaneMinBytes (1 MiB) is cut into K
// parts, each read on its own lane: with explicit descriptors, K
// contiguous runs of its bytes (cuts 64 KiB aligned, a descriptor split
// where a cut falls inside it); by region and block, K contiguous chunks of
// its block ids, each read in every region, landing where those bytes land
// in the whole READ. Lane 0 is the cached connection, lanes 1..K-1
// are connections to the same peer dialed from K-1 more UDP sockets of this
// agent, in parallel and in the background, once a READ succeeded on lane
// 0 (so a peer that refuses this agent, or one it never READs from, gets
// none); they never send 0-RTT, each resumes its own session ticket, and
// they are kept alive by the same probes and closed with lane 0. Lanes 1..K-1 carry
// nothing but READ streams: handshakes, notifications, heartbeats, WRITEs,
// small READs and READs naming a prepared list (prepared on lane 0 only)
// stay on lane 0. A READ runs on the lanes up when it starts and never
// waits for one, so the first READ of a new connection (perhaps in 0-RTT)
// runs on lane 0 alone and keeps its latency. The serving side sees K
// ordinary READs, each checked (expectation included), authorized and
// released (Config.Release) on its own.
//
// A laned READ succeeds only when every lane landed all its bytes. When one
// lane fails, the others are aborted, and Transfer returns that lane's
// error only after every lane stopped touching local memory, never a
// partial success. A lane that failed on a stalled path or a dead
// connection is closed, so the next READ dials it anew; one whose
// connection died (the redial rule's condition) closes lane 0 too, so the
// redial rule sends the whole READ again, once, on new connections. A
// lane that cannot be dialed, or whose handshake fails, is left out of
// every READ until lane 0 is redialed; a refusal closes no lane.
//
// The dialer counts a laned READ once against its MaxInflightPerPeer; the
// serving side counts per connection, so the lanes of one dialer stay
// within the dialer's bound, as before.
//
// # The same-host path
//
// A READ with Xfer.SameHost goes to the peer's unix socket
// (Config.LocalSocket) instead of a QUIC stream: the serving agent runs
// the checks of any READ (admit), then passes the files that back the
// pages it would serve (Config.Share, SCM_RIGHTS; a memfd reopened
// read-only) and the reader maps them read-only for the READ's duration,
// copies (memcpy, or device to device through Config.PeerCopier) and
// reports progress and the end; the serving side answers the final status.
// Each side checks the other's uid (SO_PEERCRED); the hello carries the
// serving agent's token (Agent.SameHost, from its authenticated metadata).
// A socket that cannot be used sends the READ over QUIC. samehost.go has
// the details.
//
// # Device memory and landed bytes
//
// A region whose Memory is an AsyncMemory (device memory) is staged
// through two page-locked buffers with asynchronous copies that overlap
// the stream (staging.go). Xfer.OnLanded sees every run of a READ as it
// lands, while it is in cache.
//
// # Checks on the serving side
//
// Every descriptor, whether explicit, prepared or named by index, is checked
// before memory is touched: length > 0 (else ErrInvalidArgument), addr+len
// does not overflow, lies inside one registered region of the same device,
// index within the prepared list (else ErrOutOfRange), and the blocks it
// touches are authorized for the request (else ErrCapabilityDenied, or the
// class Authorize returns).
//
// # Deadlines and back-pressure
//
// A transfer fails with ErrTimeout when no byte moves for
// Config.ProgressTimeout, on either side; the caller's ctx aborts it with
// ErrAborted (or ErrTimeout for a deadline). Transfer returns only after the
// stream was reset or drained, so the local range is the caller's again.
// Bytes in flight per peer are bounded by Config.MaxInflightPerPeer.
package transfer
