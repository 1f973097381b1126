package e2e

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/devtls"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	"github.com/kvsidecar/kvsidecar/localapi"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// TestAllowPeersNoDatagram: kv_transfer_params edited to name a plain UDP
// listener on loopback outside the decode's --allow-peers make the load fail
// at once, naming the address and the flag; the listener receives no
// datagram (it got ten 1280-byte QUIC Initials and the load failed after the
// 5 s handshake timeout before). The same decode still loads from the
// allowed prefill.
//
// fault-matrix: params-outside-allow-peers
func TestAllowPeersNoDatagram(t *testing.T) {
	env := NewEnv(t)
	pre := env.StartSidecar(t, SidecarOpts{Engine: "prefill-ap", Role: "prefill", Args: geomFlags})
	dec := env.StartSidecar(t, SidecarOpts{Engine: "decode-ap", Role: "decode",
		Args: append([]string{"--allow-peers", "127.0.0.1/32"}, geomFlags...)})
	pe, de := attach(t, pre, 256), attach(t, dec, 256)
	trap, err := net.ListenPacket("udp", "127.0.0.3:0") // loopback, outside 127.0.0.1/32
	require.NoError(t, err)
	defer trap.Close()
	dst, err := de.Alloc(t.Context(), 2)
	require.NoError(t, err)

	_, p := prefillRequest(t, pe, "req-trap", 5, 2)
	_, port, err := net.SplitHostPort(trap.LocalAddr().String())
	require.NoError(t, err)
	n, err := strconv.Atoi(port)
	require.NoError(t, err)
	p.RemoteRankAddrs, p.RemoteHost, p.RemotePort = nil, "127.0.0.3", uint32(n)
	start := time.Now()
	failed := de.load(t, "req-trap", dst, p)
	took := time.Since(start)
	require.NotNil(t, failed, "the load must fail")
	require.Equal(t, v1.Code_CODE_INVALID_ARGUMENT, failed.GetError().GetCode(), failed.GetError().GetMessage())
	require.Contains(t, failed.GetError().GetMessage(), "peer "+trap.LocalAddr().String()+" is outside --allow-peers=127.0.0.1/32")
	require.Less(t, took, 5*time.Second, "at once, not after the QUIC handshake timeout")
	require.NoError(t, trap.SetReadDeadline(time.Now()))
	_, _, err = trap.ReadFrom(make([]byte, 2048))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "the listener outside --allow-peers received no datagram")
	require.Zero(t, dec.Metric(t, "kvsidecar_transfer_dials_total"), "no QUIC dial was started")

	_, p = prefillRequest(t, pe, "req-ok", 6, 2)
	require.Nil(t, de.load(t, "req-ok", dst, p), "an allowed prefill is read")
	de.check(t, 6, dst)
}

// geomWith is geomFlags with one flag's value replaced.
func geomWith(flag, value string) []string {
	out := append([]string(nil), geomFlags...)
	for i := 0; i+1 < len(out); i += 2 {
		if out[i] == flag {
			out[i+1] = value
		}
	}
	return out
}

// TestIncompatibleGeometryNamesBothValues: a prefill with another block size
// (32 vs the decode's 16), dtype or head dim makes the first request fail
// naming both values, not a model hash; no byte is written into the decode's
// blocks and nothing is served.
//
// fault-matrix: incompatible-geometry
func TestIncompatibleGeometryNamesBothValues(t *testing.T) {
	env := NewEnv(t)
	dec := env.StartSidecar(t, SidecarOpts{Engine: "decode-g", Role: "decode", Args: geomFlags})
	de := attach(t, dec, 256)
	const sentinel = 77
	dst, err := de.Alloc(t.Context(), 2)
	require.NoError(t, err)
	de.fill(t, sentinel, dst)

	tests := []struct {
		name  string
		args  []string
		edit  func(p *v1.KVTransferParams)
		local int  // local blocks for the prefill's one
		sync  bool // StartLoad itself refuses
		want  string
	}{
		// The reported inputs: 2 local blocks for 1 remote gave "... local
		// block_ids for ... remote_block_ids"; 1 for 1 a model hash and
		// only the prefill's 32.
		{"block size, two local blocks", geomWith("--block-size", "32"), nil, 2, true,
			"kv_transfer_params block_size=32 (prefill engine \"prefill-block-size-two-local-blocks\") differs from this rank's block_size=16"},
		{"block size, one local block", geomWith("--block-size", "32"), nil, 1, true, "block_size=32"},
		// Params made elsewhere carry no block_size: the handshake names it.
		{"block size, params without it", geomWith("--block-size", "32"), func(p *v1.KVTransferParams) { p.BlockSize = 0 }, 1, false,
			"differ in block_size: peer 32, local 16"},
		{"dtype", geomWith("--dtype", "float16"), nil, 1, false, "differ in dtype: peer DTYPE_FLOAT16, local DTYPE_BFLOAT16"},
		{"head dim", geomWith("--head-dim", "128"), nil, 1, false, "differ in head_dim: peer 128, local 64"},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			engine := "prefill-" + strings.ReplaceAll(strings.ReplaceAll(tc.name, ",", ""), " ", "-")
			pre := env.StartSidecar(t, SidecarOpts{Engine: engine, Role: "prefill", Args: tc.args})
			pe := attachOwnGeometry(t, pre, 256)
			src, err := pe.Alloc(t.Context(), 1)
			require.NoError(t, err)
			p, err := pe.RequestFinished(t.Context(), "req-g", src, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
			require.NoError(t, err)
			if tc.edit != nil {
				tc.edit(p)
			}
			id := "geom-" + strconv.Itoa(i)
			meta := &v1.ReqMeta{RequestId: id, LocalBlockIds: dst[:tc.local], Params: p}
			var code v1.Code
			var msg string
			if tc.sync {
				err := de.StartLoad(t.Context(), meta)
				code, msg = codes.Of(err), fmt.Sprint(err)
			} else {
				failed := de.load(t, id, dst[:tc.local], p)
				require.NotNil(t, failed, "the load must fail")
				code, msg = failed.GetError().GetCode(), failed.GetError().GetMessage()
			}
			require.Equal(t, v1.Code_CODE_INCOMPATIBLE_MODEL, code, msg)
			require.Contains(t, msg, tc.want)
			require.Zero(t, pre.Metric(t, "kvsidecar_transfer_bytes_total", `role="server"`), "nothing was served")
			de.check(t, sentinel, dst)
		})
	}
	require.Zero(t, dec.Metric(t, "kvsidecar_transfer_bytes_total"), "the decode read nothing at all")
}

// attachOwnGeometry is attach with a create call that carries no geometry:
// the engine takes the one the sidecar's flags give.
func attachOwnGeometry(t testing.TB, s *Sidecar, blocks uint32) *engine {
	t.Helper()
	c, err := localapi.Dial(t.Context(), s.Socket, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	info, err := c.Attach(t.Context(), &v1.CreateKVCache{TpRank: uint32(s.Opts.TPRank), TpSize: uint32(s.Opts.TPSize), NumBlocks: blocks})
	require.NoError(t, err)
	return &engine{Client: c, info: info}
}

// foreignTLS writes certificate files for the process name from another
// CA than env's, of another name: Go's TLS client presents no certificate
// to a server that names only other CAs as acceptable, so a CA of the
// env's own name would hide that.
func foreignTLS(t testing.TB, env *Env, name string) devtls.Files {
	t.Helper()
	other, err := devtls.NewNamedCA("another operator's CA")
	require.NoError(t, err)
	f, err := other.WriteFiles(filepath.Join(env.Dir, "foreign"), name)
	require.NoError(t, err)
	return f
}

// TestForeignCAPeerRefusedOnce: a decode whose certificate comes from
// another CA, of another name (its --tls-ca trusts both, so it starts and
// trusts the prefill), is refused by the prefill's TLS handshake as
// unknown_authority (it said no_certificate: the decode's TLS stack sent
// none, the prefill naming only its own CA as acceptable). The prefill logs it with the
// reason and the peer's address and counts it by reason (it logged and
// counted nothing before); the decode's failure names the refusal; each
// request makes one attempt (one dial), no retry loop.
//
// fault-matrix: foreign-ca-peer
func TestForeignCAPeerRefusedOnce(t *testing.T) {
	env := NewEnv(t)
	pre := env.StartSidecar(t, SidecarOpts{Engine: "prefill-ca", Role: "prefill", Args: geomFlags})
	foreign := foreignTLS(t, env, "decode-ca-tp0")
	own := env.TLS(t, "prefill-ca-tp0") // the env CA's files, for its ca.pem
	caPEM, err := os.ReadFile(own.CA)
	require.NoError(t, err)
	otherPEM, err := os.ReadFile(foreign.CA)
	require.NoError(t, err)
	bundle := filepath.Join(env.Dir, "both-cas.pem")
	require.NoError(t, os.WriteFile(bundle, append(caPEM, otherPEM...), 0o644))
	foreign.CA = bundle
	dec := env.StartSidecar(t, SidecarOpts{Engine: "decode-ca", Role: "decode", Args: geomFlags, TLS: &foreign})
	pe, de := attach(t, pre, 256), attach(t, dec, 256)
	const sentinel = 31
	dst, err := de.Alloc(t.Context(), 2)
	require.NoError(t, err)
	de.fill(t, sentinel, dst)

	for req := 1; req <= 2; req++ {
		id := "req-ca-" + strconv.Itoa(req)
		_, p := prefillRequest(t, pe, id, uint64(req), 2)
		failed := de.load(t, id, dst, p)
		require.NotNil(t, failed, "the load must fail")
		require.Equal(t, v1.Code_CODE_UNAVAILABLE, failed.GetError().GetCode(), failed.GetError().GetMessage())
		require.Contains(t, failed.GetError().GetMessage(), "refused this agent's TLS handshake")
		require.Contains(t, failed.GetError().GetMessage(), "tls: bad certificate")
		require.InDelta(t, float64(req), pre.Metric(t, "kvsidecar_transfer_tls_refused_total", `reason="unknown_authority"`), 0,
			"the serving side counts each refusal by reason")
		require.InDelta(t, float64(req), pre.Metric(t, "kvsidecar_transfer_tls_refused_total"), 0, "and nothing else")
		require.InDelta(t, float64(req), dec.Metric(t, "kvsidecar_transfer_dials_total"), 0, "one attempt per request")
	}
	refused := pre.WaitLog(t, "transfer: refused a peer's TLS handshake", StartTimeout)
	require.Equal(t, "unknown_authority", refused["reason"])
	require.Equal(t, "WARN", refused["level"])
	host, _, err := net.SplitHostPort(refused["peer"].(string))
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1", host, "the peer's address")
	require.Contains(t, refused["err"], "certificate signed by unknown authority")
	require.Zero(t, pre.Metric(t, "kvsidecar_transfer_bytes_total"), "nothing was served")
	de.check(t, sentinel, dst)
}

// TestCapabilityKeyIDs: each prefill rank signs and verifies its own export,
// so ranks of one engine started with different capability keys no longer
// refuse each other's loads (decode TP 2 and TP 4 read every byte); what an
// operator compares is the key id, a one-way fingerprint in each rank's
// "serving" line, its handshake metadata and its export in
// kv_transfer_params. A source whose key id is not the one its export was
// signed with (a rank restarted with another key, or edited params) fails
// the decode ranks reading from it before any READ, naming the prefill rank,
// the decode rank and both key ids; the other decode ranks read their
// slices, and the refused prefill rank serves no byte.
//
// fault-matrix: capability-key-mismatch
func TestCapabilityKeyIDs(t *testing.T) {
	env := NewEnv(t)
	otherKey := filepath.Join(env.Dir, "other.key")
	require.NoError(t, os.WriteFile(otherKey, []byte("another-capability-secret-987654"), 0o600))
	addrs := FreeUDPAddrs(t, "127.0.0.1", 2)
	pre := make([]*side, 2)
	keyIDs := make([]string, 2)
	for r := range pre {
		args := faultArgs("--rank-addrs", strings.Join(addrs, ","))
		if r == 1 {
			args = append(args, "--capability-key-file", otherKey) // the later flag wins
		}
		s := env.StartSidecar(t, SidecarOpts{Engine: "prefill-k", Role: "prefill", TPRank: r, TPSize: 2, Listen: addrs[r], Args: args})
		keyIDs[r], _ = s.WaitLog(t, "serving", StartTimeout)["capability_key_id"].(string)
		require.Regexp(t, "^[0-9a-f]{16}$", keyIDs[r], "rank %d's serving line", r)
		pre[r] = attachSide(t, s, 1024)
	}
	require.NotEqual(t, keyIDs[0], keyIDs[1], "the ranks' key ids show that their keys differ")

	const n = 8
	export := func(id string, key uint64) *v1.KVTransferParams {
		var parts []*v1.KVTransferParams
		for r, s := range pre {
			// The ranks' block ids may differ (rank 1 still holds the
			// blocks of a refused load under its lease): MergeExports
			// keeps each rank's.
			ids, err := s.e.Alloc(t.Context(), n)
			require.NoError(t, err)
			s.e.fillShape(t, kvgen.Shape{BlockSize: 16, RowBytes: 128, FirstHead: 4 * r, Heads: 4}, key, ids)
			p, err := s.e.RequestFinished(t.Context(), id, ids, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
			require.NoError(t, err)
			require.Equal(t, keyIDs[r], p.GetRankExports()[0].GetCapabilityKeyId(), "rank %d's export names its key id", r)
			parts = append(parts, p)
		}
		params, err := connector.MergeExports(parts...)
		require.NoError(t, err)
		return params
	}
	decodes := map[int][]*side{}
	for _, tp := range []int{2, 4} {
		for d := range tp {
			s := env.StartSidecar(t, SidecarOpts{Engine: "decode-k" + strconv.Itoa(tp), Role: "decode", TPRank: d, TPSize: tp, Args: faultArgs()})
			decodes[tp] = append(decodes[tp], attachSide(t, s, 1024))
		}
	}
	for _, tp := range []int{2, 4} {
		t.Run("tp"+strconv.Itoa(tp), func(t *testing.T) {
			dec := decodes[tp]
			heads := 8 / tp
			// Ranks with different keys: every decode rank reads its heads.
			ok := "ok-" + strconv.Itoa(tp)
			params := export(ok, uint64(100+tp))
			dst := make([][]uint32, tp)
			for d, s := range dec {
				dst[d] = s.load(t, ok, params)
			}
			for d, s := range dec {
				require.Nil(t, s.outcome(t, ok, 30*time.Second), "decode rank %d", d)
				s.e.checkShape(t, kvgen.Shape{BlockSize: 16, RowBytes: 128, FirstHead: heads * d, Heads: heads}, uint64(100+tp), dst[d])
				s.free(t, dst[d])
			}

			// Prefill rank 1's export names a key id it does not hold.
			bad := "bad-" + strconv.Itoa(tp)
			params = export(bad, uint64(200+tp))
			for _, e := range params.GetRankExports() {
				if e.GetTpRank() == 1 {
					e.CapabilityKeyId = keyIDs[0]
				}
			}
			served := pre[1].Metric(t, "kvsidecar_transfer_bytes_total")
			for d, s := range dec {
				dst[d] = s.load(t, bad, params)
			}
			for d, s := range dec {
				f := s.outcome(t, bad, 30*time.Second)
				if heads*d < 4 { // heads of prefill rank 0
					require.Nil(t, f, "decode rank %d reads from prefill rank 0", d)
					s.e.checkShape(t, kvgen.Shape{BlockSize: 16, RowBytes: 128, FirstHead: heads * d, Heads: heads}, uint64(200+tp), dst[d])
				} else {
					require.NotNil(t, f, "decode rank %d reads from prefill rank 1", d)
					require.Equal(t, v1.Code_CODE_CAPABILITY_DENIED, f.GetError().GetCode(), f.GetError().GetMessage())
					require.Contains(t, f.GetError().GetMessage(), fmt.Sprintf("prefill rank 1 (%s) of engine \"prefill-k\" holds capability key id %s, but its export in kv_transfer_params was signed with key id %s", addrs[1], keyIDs[1], keyIDs[0]))
					require.Contains(t, f.GetError().GetMessage(), fmt.Sprintf("decode rank %d reads nothing from it", d))
				}
				s.free(t, dst[d])
			}
			require.Equal(t, served, pre[1].Metric(t, "kvsidecar_transfer_bytes_total"), "prefill rank 1 served no byte")
		})
	}
}
