package e2e

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
)

// peerTLS returns a client TLS config whose certificate the env's CA
// signed: what a legitimate (or a compromised but certified) peer holds.
func peerTLS(t testing.TB, env *Env, name string) *tls.Config {
	t.Helper()
	f := env.TLS(t, name)
	_, cli, err := transfer.LoadTLSFiles(f.CA, f.Cert, f.Key)
	require.NoError(t, err)
	return cli
}

// dialAgent starts a dial-only transfer agent with tlsConf and closes it at
// the end of the test. It registers local, when not nil, as memory to READ
// into.
func dialAgent(t testing.TB, tlsConf *tls.Config, local []byte) *transfer.Agent {
	t.Helper()
	cfg := &transfer.Config{ClientTLS: tlsConf, HandshakeTimeout: testutil.Scaled(5 * time.Second)}
	if local != nil {
		cfg.Regions = []transfer.Region{transfer.SliceRegion(local, 0, 0)}
	}
	a, err := transfer.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Close() })
	return a
}

// peerHandshake asks the rank at addr for its metadata through a real
// handshake, as a decode rank would, and validates it.
func peerHandshake(t testing.TB, a *transfer.Agent, addr, engine string) *handshake.Metadata {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), testutil.Scaled(10*time.Second))
	defer cancel()
	resp, err := a.Handshake(ctx, addr, &v1.HandshakeRequest{WireVersion: handshake.WireVersion,
		ExpectedEngineId: engine, ExpectedTpSize: 1})
	require.NoError(t, err)
	require.Nil(t, resp.GetError(), "handshake answered with %v", resp.GetError())
	md, err := handshake.FromProto(resp.GetMetadata())
	require.NoError(t, err)
	return md
}

// rawPeer is a QUIC connection speaking the transfer protocol frame by
// frame, so a test can send what the transfer package's client never would
// (zero-length or overflowing descriptors, a wrong total, WRITEs into
// exported blocks).
type rawPeer struct {
	conn *quic.Conn
}

// dialRaw connects to the agent at addr with tlsConf (ALPN and TLS 1.3
// forced on a copy).
func dialRaw(t testing.TB, addr string, tlsConf *tls.Config) *rawPeer {
	t.Helper()
	host, _, err := net.SplitHostPort(addr)
	require.NoError(t, err)
	c := tlsConf.Clone()
	c.NextProtos = []string{transfer.ALPN}
	c.MinVersion = tls.VersionTLS13
	c.ServerName = host
	ctx, cancel := context.WithTimeout(t.Context(), testutil.Scaled(10*time.Second))
	defer cancel()
	conn, err := quic.DialAddr(ctx, addr, c, &quic.Config{HandshakeIdleTimeout: testutil.Scaled(5 * time.Second)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.CloseWithError(0, "test done") })
	return &rawPeer{conn: conn}
}

// rawReply is the served side's answer to one raw request.
type rawReply struct {
	// Code is the error code of the reply (CODE_OK when accepted), or of
	// the stream reset when the peer reset the stream without a reply.
	Code v1.Code
	// Msg is the reply's error message.
	Msg string
	// Data is the payload of an accepted READ.
	Data []byte
	// Final is the status after an accepted READ's payload.
	Final *v1.XferStatus
}

// send writes req on a new stream, closes the send side and reads the
// answer: the first PeerResponse, and for an accepted READ the payload of
// readLen bytes and the final status. Every step has a deadline.
func (p *rawPeer) send(t testing.TB, req *v1.PeerRequest, readLen uint64) rawReply {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), testutil.Scaled(10*time.Second))
	defer cancel()
	str, err := p.conn.OpenStreamSync(ctx)
	require.NoError(t, err)
	dl, _ := ctx.Deadline()
	require.NoError(t, str.SetDeadline(dl))
	defer str.CancelRead(0)
	require.NoError(t, wire.WriteMsg(str, req, 0))
	// The request is out; a refusing peer may already have stopped our
	// send side (STOP_SENDING), so Close may fail: the reply says why.
	_ = str.Close()
	r := wire.NewReader(str, 0)
	var resp v1.PeerResponse
	if err := r.ReadMsg(&resp); err != nil {
		var se *quic.StreamError
		require.True(t, errors.As(err, &se), "neither a reply nor a stream reset: %v", err)
		return rawReply{Code: v1.Code(se.ErrorCode), Msg: err.Error()}
	}
	var e *v1.Error
	switch b := resp.GetBody().(type) {
	case *v1.PeerResponse_Xfer:
		e = b.Xfer.GetError()
	case *v1.PeerResponse_Prep:
		e = b.Prep
	case *v1.PeerResponse_Handshake:
		e = b.Handshake.GetError()
	case *v1.PeerResponse_Notification:
		e = b.Notification.GetError()
	case *v1.PeerResponse_Heartbeat:
		e = b.Heartbeat.GetError()
	}
	out := rawReply{Code: e.GetCode(), Msg: e.GetMessage()}
	if out.Code != v1.Code_CODE_OK || req.GetXfer().GetOp() != v1.XferOp_XFER_OP_READ {
		return out
	}
	out.Data = make([]byte, readLen)
	_, err = io.ReadFull(r, out.Data)
	require.NoError(t, err)
	var fin v1.PeerResponse
	require.NoError(t, r.ReadMsg(&fin))
	out.Final = fin.GetXfer()
	return out
}

// readReq is a READ request for descs of requestID's export, under its
// capability.
func readReq(requestID string, export uint64, capability []byte, descs ...transfer.Desc) *v1.PeerRequest {
	x := &v1.XferRequest{Op: v1.XferOp_XFER_OP_READ, RequestId: requestID, ExportId: export, Capability: capability, XferId: 1,
		Descs: &v1.XferRequest_List{List: descList(descs...)}}
	for _, d := range descs {
		x.TotalLen += d.Len
	}
	return &v1.PeerRequest{WireVersion: v1.WireVersion_WIRE_VERSION_1, Body: &v1.PeerRequest_Xfer{Xfer: x}}
}

func descList(descs ...transfer.Desc) *v1.DescriptorList {
	l := &v1.DescriptorList{}
	for _, d := range descs {
		l.Descs = append(l.Descs, &v1.Descriptor{Addr: d.Addr, Len: d.Len, DevId: d.DevID})
	}
	return l
}

// blockDesc names block b of region r of md, whole.
func blockDesc(md *handshake.Metadata, r int, b uint32) transfer.Desc {
	reg := md.Regions[r]
	return transfer.Desc{Addr: reg.Base + reg.BlockOffset(int(b)), Len: reg.BlockLen, DevID: reg.DevID}
}

// rankAddr is the QUIC address of prefill rank 0 from its params.
func rankAddr(p *v1.KVTransferParams) string {
	if a := p.GetRemoteRankAddrs(); len(a) > 0 {
		return a[0]
	}
	return net.JoinHostPort(p.GetRemoteHost(), strconv.Itoa(int(p.GetRemotePort())))
}
