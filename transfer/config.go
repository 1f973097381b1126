package transfer

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/qlogwriter"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// ALPN is the application protocol agents negotiate.
const ALPN = "kvsidecar/1"

// Flow-control and window defaults, sized so one stream can keep a 2 MiB
// descriptor and its successor in flight on a fast link (quic-go defaults
// are 6 MiB per stream and 15 MiB per connection). They bound a READ only
// where bandwidth × RTT exceeds them: on loopback, where a READ is bound by
// the CPU (see QUICConfig), a 128 MiB READ ran the same with 4/8 MiB,
// 32/96 MiB and 128/384 MiB windows (stream/connection) and with initial
// windows equal to the maximum (0.49–0.52 GB/s against TLS 1.3 over TCP's
// 1.26–1.35 in the same runs, 2-core host).
const (
	DefaultMaxStreamWindow     = 32 << 20
	DefaultMaxConnWindow       = 96 << 20
	DefaultProgressTimeout     = 10 * time.Second
	DefaultMaxInflightPerPeer  = 1 << 30
	DefaultStagingBytes        = 1 << 20
	DefaultKeepAlivePeriod     = 5 * time.Second
	DefaultMaxIdleTimeout      = 30 * time.Second
	DefaultHandshakeTimeout    = 5 * time.Second
	DefaultMaxIncomingStreams  = 1024
	DefaultMaxDescsPerTransfer = 1 << 16
	// DefaultMaxPreparedDescsPerConn is 16 full lists of
	// DefaultMaxDescsPerTransfer, about 40 MiB of server state per
	// connection at 40 bytes a descriptor.
	DefaultMaxPreparedDescsPerConn = 1 << 20
)

// Access is what the serving agent asks Config.Authorize about before it
// touches memory for a READ or WRITE.
type Access struct {
	// Peer is the dialer's address.
	Peer string
	// Op is the dialer's operation: OpRead reads this agent's memory.
	Op Op
	// RequestID, ExportID and Capability come from the XferRequest, and
	// ConsumerEngineID and ConsumerTPRank (who the READ says it is for;
	// empty when it does not say).
	RequestID        string
	ExportID         uint64
	Capability       []byte
	ConsumerEngineID string
	ConsumerTPRank   uint32
	// Descs are the validated descriptors, in transfer order.
	Descs []Desc
	// BlockIDs are the sorted block ids the descriptors touch
	// (offset in region / Region.BlockLen).
	BlockIDs []uint32
	// Abort, set by the agent, resets the served transfer's stream with
	// err's code (a READ's reader fails with that class). The owner of the
	// memory may call it at any time after Authorize allowed the access,
	// e.g. to stop serving when it shuts down; after the transfer ended it
	// does nothing.
	Abort func(err error)
	// Err is set by the agent before it calls Config.Release: nil when the
	// transfer was served to its end, else why it failed.
	Err error
	// Early is true when the READ arrived in 0-RTT data and the
	// connection's TLS handshake had not completed when it was authorized.
	// Such a request may be a replay of a captured flight (TLS 1.3 0-RTT
	// has no replay protection, RFC 8446 section 8): its bytes can only
	// reach the holder of the session's keys, but it must change no lasting
	// state (no lease extended, notified, released or marked as read).
	// The agent sets it again before Release: still true then means the
	// handshake never completed while the READ was served (a replay, or a
	// peer gone before its handshake ended); false means the dialer proved
	// it holds the keys, so the READ was genuine.
	Early bool
}

// Config configures an Agent. The zero value works except that TLS and
// ListenAddr must be set for an agent that serves, and TLS for one that
// dials; a nil *Config is treated as the zero value.
type Config struct {
	// ListenAddr is the UDP address of the agent's single socket, e.g.
	// "127.0.0.1:0". Default "127.0.0.1:0". Ignored when PacketConn is set.
	ListenAddr string
	// PacketConn, when set, is used instead of opening ListenAddr; the agent
	// closes it on Close. It should be a *net.UDPConn (or implement
	// quic.OOBCapablePacketConn): quic-go then sends with GSO, reads in
	// batches and sizes its buffers (see QUICConfig); behind a plain
	// net.PacketConn it does none of these, and a bulk READ ran at 0.16–0.18
	// of TLS 1.3 over TCP instead of 0.36–0.42, dropping about 530
	// datagrams per 900 MiB read on loopback. Default nil.
	PacketConn net.PacketConn
	// ServerTLS is the TLS config for accepted connections. It must carry a
	// certificate and ClientCAs; the agent forces TLS 1.3, ALPN kvsidecar/1
	// and tls.RequireAndVerifyClientCert on a copy. Nil means the agent only
	// dials.
	ServerTLS *tls.Config
	// ClientTLS is the TLS config for dialed connections, with the client
	// certificate and RootCAs. Nil means the agent cannot dial. A session
	// cache is added when nil so returning peers get 0-RTT.
	ClientTLS *tls.Config
	// Regions are registered at start; more can be added with Register.
	Regions []Region
	// Authorize is called before any memory is touched for a READ or WRITE
	// this agent serves; a non-nil error refuses the transfer with its class
	// (ErrCapabilityDenied, ErrLeaseExpired, ErrNotFound, ...). Default: the
	// capability is verified with CapabilityKey; with neither set every
	// transfer is refused with ErrCapabilityDenied.
	Authorize func(ctx context.Context, a *Access) error
	// Release, when set, is called exactly once for every access Authorize
	// allowed, after the transfer stopped touching the memory (completed,
	// failed, reset or aborted; Access.Err says which), so an owner may pin
	// the memory in Authorize and free it only afterwards. Default nil.
	Release func(a *Access)
	// CapabilityKey verifies capabilities when Authorize is nil. Default nil.
	CapabilityKey *CapabilityKey
	// OnNotification handles a Notification; its error class goes back to the
	// sender in the ack. Called in order per connection. Default: every
	// notification is answered with ErrNotFound.
	OnNotification func(ctx context.Context, peer string, n *v1.Notification) error
	// OnHeartbeat answers a Heartbeat. Default: every request id is unknown.
	OnHeartbeat func(ctx context.Context, peer string, hb *v1.Heartbeat) *v1.HeartbeatAck
	// CheckExpect checks a request's PeerExpect (a READ that did not wait
	// for a handshake carries one) against this agent's own metadata before
	// anything else of the request is looked at; a non-nil error refuses it
	// with its class. When the expectation names the reader's layout
	// (PeerExpect.layout), regions maps the request's region i (as
	// BlockDescs name it) to the index of this agent's Regions entry that
	// holds it; nil means the indices are this agent's own. It may run in
	// 0-RTT and must not change state. Default nil: a request carrying a
	// PeerExpect is refused with CODE_UNAVAILABLE.
	CheckExpect func(ctx context.Context, e *v1.PeerExpect) (regions []int, err error)
	// OnHandshake answers a HandshakeRequest; it may run in 0-RTT and must be
	// idempotent. Default: answered with CODE_UNAVAILABLE.
	OnHandshake func(ctx context.Context, req *v1.HandshakeRequest) *v1.HandshakeResponse
	// OnPeerGone is called (from the agent's goroutine, must not block) when
	// a dialed connection is lost, so caches of that peer can be dropped.
	// Default nil.
	OnPeerGone func(addr string, err error)
	// AllowedPeers, when set, is the set of addresses the agent may dial: a
	// dial of any other address (after name resolution, before any packet
	// is sent to it) fails with ErrInvalidArgument naming the address and
	// AllowedPeers.Origin. It does not restrict who may connect to this
	// agent (mutual TLS does). Default nil: any address.
	AllowedPeers *AllowedPeers
	// StatelessResetKey, when set, lets the agent answer a packet of a
	// connection it does not know, such as one its previous process on the
	// same address had, with a QUIC stateless reset (RFC 9000 section
	// 10.3): the peer drops that connection at once instead of sending into
	// it until MaxIdleTimeout. To help after a restart the key must be the
	// same in the new process (derive it from a secret that persists);
	// whoever knows it can reset this agent's connections. Default nil: no
	// stateless resets.
	StatelessResetKey *quic.StatelessResetKey
	// ProgressTimeout is how long a transfer may go without a byte moving
	// before it fails with ErrTimeout. Default DefaultProgressTimeout (10 s).
	ProgressTimeout time.Duration
	// MaxInflightPerPeer bounds the bytes of transfers in flight to or from
	// one peer, in each role; more wait (back-pressure). A single transfer
	// larger than the bound runs alone. The dialer counts a transfer once,
	// whatever number of READ lanes it is striped over; the serving side
	// counts per accepted connection, so a dialer's READ lanes together
	// stay within the dialer's own bound. Default 1 GiB.
	MaxInflightPerPeer uint64
	// ReadLanes is the number of QUIC connections to one peer, each
	// dialed from its own UDP socket, that a READ of at least
	// ReadLaneMinBytes (Xfer.Remote or Xfer.RemoteBlocks) is striped
	// over, so that the READ runs on that many cores on each side. Lane 0
	// is the cached connection, which carries everything else; lanes
	// 1..ReadLanes-1 are dialed in the background once a READ succeeded
	// on lane 0, kept alive like it and closed with it; a READ uses the
	// lanes up when it starts and never waits for one. READs naming a
	// prepared list (Xfer.RemoteList) stay on lane 0, where the list is
	// prepared. A lane that cannot be dialed is left out until lane 0 is
	// redialed. Default 1 (no lanes); at most MaxReadLanes.
	ReadLanes int
	// ReadLaneMinBytes is the smallest READ striped over the lanes;
	// smaller ones stay on lane 0 and keep its latency. Default
	// DefaultReadLaneMinBytes (1 MiB).
	ReadLaneMinBytes uint64
	// LanePacketConn, when set, opens the UDP socket of READ lane i
	// (1..ReadLanes-1), once per lane index; the agent closes it on Close.
	// Default nil: a socket on the IP of the agent's own socket, any port.
	LanePacketConn func(lane int) (net.PacketConn, error)
	// LocalSocket, when set together with Share, is the path of the unix
	// socket on which the agent serves same-host READs (samehost.go), from
	// Start to Close; its directory must belong to this user with mode
	// 0700 (a stale socket of a dead process is replaced, a live one is
	// refused). Default "": no same-host path.
	LocalSocket string
	// Share returns the files that back ranges of the agent's registered
	// memory (absolute addresses, in Desc form, each inside one region)
	// for a same-host READ the agent admitted; the agent passes them to
	// the reader and closes them. Default nil: no same-host path.
	Share func(ranges []Desc) (*SharedPages, error)
	// ShareKind is the kind of pages Share returns, announced in the
	// socket's hello. Default v1.PageKind_PAGE_KIND_MEMFD.
	ShareKind v1.PageKind
	// PeerCopier maps a same-host peer's device pages and copies them into
	// this agent's device memory. Default nil: same-host READs land only
	// memfd pages in host memory; a READ of device pages goes over QUIC.
	PeerCopier PeerCopier
	// StagingBytes is the size of the staging buffer used when memory is not
	// host-addressable. Default 1 MiB.
	StagingBytes int
	// MaxStreamWindow and MaxConnWindow are quic-go's receive windows in
	// bytes: how far a READ's sender may run ahead of the reader, so a
	// path's bandwidth-delay product (bytes per second × RTT) above them
	// caps a READ at window/RTT. A connection starts with min(max, 8 MiB)
	// per stream and min(max, 16 MiB) in all, which quic-go grows towards
	// the maximum as the reader keeps up. Defaults DefaultMaxStreamWindow
	// (32 MiB), DefaultMaxConnWindow (96 MiB).
	MaxStreamWindow uint64
	MaxConnWindow   uint64
	// QUICTracer, when set, is quic-go's tracer of every connection the
	// agent dials or accepts (quic.Config.Tracer): qlog events such as
	// packets declared lost. Default nil: none.
	QUICTracer func(ctx context.Context, isClient bool, connID quic.ConnectionID) qlogwriter.Trace
	// KeepAlivePeriod is the QUIC keep-alive period; a dialed connection
	// also sends a probe datagram this often, large enough to draw a
	// stateless reset, so an idle connection to a peer restarted on its
	// address (with the same StatelessResetKey) ends within one period.
	// Default 5 s.
	KeepAlivePeriod time.Duration
	// MaxIdleTimeout closes a silent connection. Default 30 s.
	MaxIdleTimeout time.Duration
	// HandshakeTimeout bounds the QUIC/TLS handshake. Default 5 s.
	HandshakeTimeout time.Duration
	// MaxDescsPerTransfer bounds descriptors per transfer or prepared list.
	// Default 65,536.
	MaxDescsPerTransfer int
	// MaxPreparedDescsPerConn bounds the descriptors of all lists a peer
	// has prepared on one connection it dialed to this agent; a Prepare
	// beyond it is refused with ErrBusy until the peer releases lists
	// (DescList.Close) or reconnects. Default
	// DefaultMaxPreparedDescsPerConn (1,048,576).
	MaxPreparedDescsPerConn int
	// QlogDir, when set, receives one qlog file per connection
	// (<odcid>_<client|server>.sqlog). Default "" (off).
	QlogDir string
	// Logger receives logs; nil discards them.
	Logger *slog.Logger
	// Registerer receives the agent's metrics; nil registers none.
	Registerer prometheus.Registerer

	// testHook, when set by tests in this package, observes internal events
	// ("reset", "released", "before-ack").
	testHook func(event string, xferID uint64)
}

// withDefaults returns a copy of c (nil ok) with defaults filled in.
func (c *Config) withDefaults() *Config {
	var out Config
	if c != nil {
		out = *c
	}
	if out.ListenAddr == "" {
		out.ListenAddr = "127.0.0.1:0"
	}
	if out.ProgressTimeout == 0 {
		out.ProgressTimeout = DefaultProgressTimeout
	}
	if out.MaxInflightPerPeer == 0 {
		out.MaxInflightPerPeer = DefaultMaxInflightPerPeer
	}
	if out.ReadLanes == 0 {
		out.ReadLanes = 1
	}
	if out.ReadLaneMinBytes == 0 {
		out.ReadLaneMinBytes = DefaultReadLaneMinBytes
	}
	if out.ShareKind == v1.PageKind_PAGE_KIND_UNSPECIFIED {
		out.ShareKind = v1.PageKind_PAGE_KIND_MEMFD
	}
	if out.StagingBytes == 0 {
		out.StagingBytes = DefaultStagingBytes
	}
	if out.MaxStreamWindow == 0 {
		out.MaxStreamWindow = DefaultMaxStreamWindow
	}
	if out.MaxConnWindow == 0 {
		out.MaxConnWindow = DefaultMaxConnWindow
	}
	if out.KeepAlivePeriod == 0 {
		out.KeepAlivePeriod = DefaultKeepAlivePeriod
	}
	if out.MaxIdleTimeout == 0 {
		out.MaxIdleTimeout = DefaultMaxIdleTimeout
	}
	if out.HandshakeTimeout == 0 {
		out.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if out.MaxDescsPerTransfer == 0 {
		out.MaxDescsPerTransfer = DefaultMaxDescsPerTransfer
	}
	if out.MaxPreparedDescsPerConn == 0 {
		out.MaxPreparedDescsPerConn = DefaultMaxPreparedDescsPerConn
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	out.Regions = append([]Region(nil), out.Regions...)
	return &out
}

// validate rejects nonsense in a defaulted config.
func (c *Config) validate() error {
	switch {
	case c.ProgressTimeout < 0:
		return fmt.Errorf("transfer: Config.ProgressTimeout %v must be >= 0", c.ProgressTimeout)
	case c.ReadLanes < 1 || c.ReadLanes > MaxReadLanes:
		return fmt.Errorf("transfer: Config.ReadLanes %d must be in [1, %d] (0 means 1)", c.ReadLanes, MaxReadLanes)
	case c.StagingBytes < 4096:
		return fmt.Errorf("transfer: Config.StagingBytes %d must be >= 4096", c.StagingBytes)
	case c.MaxStreamWindow < 64<<10:
		return fmt.Errorf("transfer: Config.MaxStreamWindow %d must be >= 65536", c.MaxStreamWindow)
	case c.MaxConnWindow < c.MaxStreamWindow:
		return fmt.Errorf("transfer: Config.MaxConnWindow %d must be >= MaxStreamWindow %d", c.MaxConnWindow, c.MaxStreamWindow)
	case c.KeepAlivePeriod < 0 || c.MaxIdleTimeout < 0 || c.HandshakeTimeout < 0:
		return fmt.Errorf("transfer: Config.KeepAlivePeriod, MaxIdleTimeout and HandshakeTimeout must be >= 0")
	case c.MaxDescsPerTransfer < 1:
		return fmt.Errorf("transfer: Config.MaxDescsPerTransfer %d must be >= 1", c.MaxDescsPerTransfer)
	case c.LocalSocket != "" && c.Share == nil:
		return fmt.Errorf("transfer: Config.LocalSocket %q needs Config.Share to pass pages", c.LocalSocket)
	case c.MaxPreparedDescsPerConn < 1:
		return fmt.Errorf("transfer: Config.MaxPreparedDescsPerConn %d must be >= 1", c.MaxPreparedDescsPerConn)
	case c.ServerTLS != nil && len(c.ServerTLS.Certificates) == 0 && c.ServerTLS.GetCertificate == nil && c.ServerTLS.GetConfigForClient == nil:
		return fmt.Errorf("transfer: Config.ServerTLS must carry a certificate")
	case c.ServerTLS != nil && c.ServerTLS.ClientCAs == nil && c.ServerTLS.GetConfigForClient == nil:
		return fmt.Errorf("transfer: Config.ServerTLS.ClientCAs must be set to verify client certificates")
	}
	for i, r := range c.Regions {
		if err := validateRegion(i, r); err != nil {
			return err
		}
	}
	return nil
}

// QUICConfig returns the quic-go configuration an agent with config c uses
// (nil c: the defaults), so benchmarks can run raw quic-go under the same
// windows and timeouts.
//
// What bounds a bulk READ is quic-go's cost per packet, and this quic-go
// (v0.65.0) has no setting that changes it. Measured with `kvsidecar bench
// transfer` and interleaved runs on a 2-core host, 128 MiB READs on
// loopback, as a ratio to Go TLS 1.3 over TCP in the same run:
//
//   - Packets are at most 1452 bytes (internal/protocol/protocol.go,
//     MaxPacketBufferSize), whatever the path's MTU; path MTU discovery
//     (on, the default) takes them from 1280 to 1441 bytes within a few
//     round trips, with it off a READ lost 12–18 %. InitialPacketSize 1452
//     gained nothing measurable and fails the handshake on a path with a
//     smaller MTU, so it is left at quic-go's default. Each packet is
//     sealed, framed, acknowledged and opened on one goroutine per
//     connection side: 0.24–0.30 GB per CPU-second against TLS over TCP's
//     0.63–0.76 (16 KiB records, 64 KiB segments), so a READ on one
//     connection runs at 0.36–0.42 of TLS over TCP. The same quic-go with
//     that constant raised to 8952 (a jumbo-frame MTU) ran the READ at
//     1.18–1.34 of TLS over TCP (1.56–1.63 GB/s), at 4052 0.87–0.89: the
//     packet size, not the windows, is the limit; sending 64 KiB per
//     sendmsg instead of 20 KiB at 1452 bytes gained nothing. READ lanes
//     (Config.ReadLanes) spread a READ over more cores instead.
//   - GSO: quic-go sends up to 20 KiB of packets per sendmsg where the
//     kernel has UDP_SEGMENT (sys_conn_helper_linux.go); with
//     QUIC_GO_DISABLE_GSO=1 a READ ran at 0.18–0.20 instead of 0.36–0.42.
//   - Socket buffers: quic-go raises both to 7 MiB (sys_conn_buffers.go;
//     SO_RCVBUFFORCE as root, else up to net.core.rmem_max/wmem_max). At
//     8 MiB no datagram was dropped; at 416 KiB (a stock kernel's limit for
//     an unprivileged process) 170–290 were per 1.1 GiB read and the READ
//     ran at 0.33 instead of 0.38–0.40; 64 MiB gained nothing.
//   - Cipher: crypto/tls does not let TLS 1.3 suites be chosen
//     (tls.Config.CipherSuites covers TLS 1.0–1.2); it picks AES-128-GCM
//     on a host with AES instructions, which seals a 1400-byte packet at
//     3.3 GB/s here, ChaCha20-Poly1305 at 2.0.
//   - ECN (QUIC_GO_DISABLE_ECN=1): no change; GOMAXPROCS 1 or 4 instead of
//     2: 0.32–0.34 (one core is more efficient, 0.33 GB per CPU-second,
//     but runs alone).
func QUICConfig(c *Config) *quic.Config {
	c = c.withDefaults()
	return &quic.Config{
		HandshakeIdleTimeout:           c.HandshakeTimeout,
		MaxIdleTimeout:                 c.MaxIdleTimeout,
		KeepAlivePeriod:                c.KeepAlivePeriod,
		InitialStreamReceiveWindow:     min(c.MaxStreamWindow, 8<<20),
		MaxStreamReceiveWindow:         c.MaxStreamWindow,
		InitialConnectionReceiveWindow: min(c.MaxConnWindow, 16<<20),
		MaxConnectionReceiveWindow:     c.MaxConnWindow,
		MaxIncomingStreams:             DefaultMaxIncomingStreams,
		MaxIncomingUniStreams:          -1,
		Allow0RTT:                      true,
		// Datagrams carry the keep-alive probes (Agent.probe).
		EnableDatagrams: true,
		Tracer:          c.QUICTracer,
	}
}
