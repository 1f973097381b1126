package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/kvgen"
	"github.com/kvsidecar/kvsidecar/internal/testutil"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// node is one network namespace joined to the host by a veth pair, with
// test-owned addresses in 10.213.0.0/16 that exist only on that pair.
type node struct {
	NS     string // namespace name
	HostIP string // the host end of the veth
	IP     string // the namespace end
}

// ipCmd runs `ip args...` with a deadline and returns its combined output.
func ipCmd(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), testutil.Scaled(10*time.Second))
	defer cancel()
	out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// twoNodes creates two namespaces, each joined to the host by its own veth
// pair, and removes both (and the veths) when the test ends. The subnets
// derive from the pid so that test binaries running at once do not clash.
// It skips the test, saying why, where namespaces cannot be made.
func twoNodes(t *testing.T) [2]node {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces (run the e2e tests as root for the two-node topology)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs the ip command (iproute2) for network namespaces")
	}
	pid := os.Getpid() % 100000
	var nodes [2]node
	for i := range nodes {
		octet := (pid%120)*2 + i
		n := node{NS: fmt.Sprintf("kvse2e-%d-%d", pid, i), HostIP: fmt.Sprintf("10.213.%d.1", octet), IP: fmt.Sprintf("10.213.%d.2", octet)}
		hostVeth, nsVeth := fmt.Sprintf("kv%dh%d", pid, i), fmt.Sprintf("kv%dn%d", pid, i)
		if _, err := ipCmd("netns", "add", n.NS); err != nil {
			if i == 0 {
				t.Skipf("cannot create a network namespace here: %v", err)
			}
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = ipCmd("netns", "del", n.NS) })
		_, err := ipCmd("link", "add", hostVeth, "type", "veth", "peer", "name", nsVeth)
		require.NoError(t, err)
		t.Cleanup(func() { _, _ = ipCmd("link", "del", hostVeth) })
		for _, args := range [][]string{
			{"link", "set", nsVeth, "netns", n.NS},
			{"addr", "add", n.HostIP + "/24", "dev", hostVeth},
			{"link", "set", hostVeth, "up"},
			{"netns", "exec", n.NS, "ip", "addr", "add", n.IP + "/24", "dev", nsVeth},
			{"netns", "exec", n.NS, "ip", "link", "set", nsVeth, "up"},
			{"netns", "exec", n.NS, "ip", "link", "set", "lo", "up"},
			// Replies to the host's address on the other pair go back
			// through this pair's host end.
			{"netns", "exec", n.NS, "ip", "route", "add", "default", "via", n.HostIP},
		} {
			_, err := ipCmd(args...)
			require.NoError(t, err)
		}
		nodes[i] = n
	}
	return nodes
}

// fillShape and checkShape are engine.fill/check for one rank's heads.
func (e *engine) fillShape(t testing.TB, s kvgen.Shape, key uint64, blocks []uint32) {
	t.Helper()
	for r := range int(e.info.GetNumRegions()) {
		for k, id := range blocks {
			b, err := e.Block(r, int(id))
			require.NoError(t, err)
			kvgen.FillBlock(b, s, key, r, k*16)
		}
	}
}

func (e *engine) checkShape(t testing.TB, s kvgen.Shape, key uint64, blocks []uint32) {
	t.Helper()
	for r := range int(e.info.GetNumRegions()) {
		for k, id := range blocks {
			b, err := e.Block(r, int(id))
			require.NoError(t, err)
			bad, first := kvgen.CheckBlock(b, s, key, r, k*16)
			require.Zero(t, bad, "region %d block %d: %d bytes differ, first at %d", r, id, bad, first)
		}
	}
}

// TestFaultPrefillAcrossNetns: one prefill instance of TP 2 spans two
// "nodes" (network namespaces with distinct addresses), rank r in node r; a
// decode instance of TP 4 on the host reads through remote_rank_addrs, each
// decode rank from the prefill rank that holds its heads: rank d gets heads
// 2d, 2d+1 from prefill rank d/2. The bytes prove the heads came from the
// right rank (another rank holds other heads), and each prefill rank served
// exactly its two decode ranks.
//
// fault-matrix: prefill-across-nodes
func TestFaultPrefillAcrossNetns(t *testing.T) {
	nodes := twoNodes(t)
	env := NewEnv(t)
	const port = "47000" // free in a fresh namespace
	rankAddrs := []string{net.JoinHostPort(nodes[0].IP, port), net.JoinHostPort(nodes[1].IP, port)}
	const n = 64
	const key = 1234

	pre := make([]*side, 2)
	var src []uint32
	for r := range pre {
		s := env.StartSidecar(t, SidecarOpts{Engine: "spread", TPRank: r, TPSize: 2, Netns: nodes[r].NS,
			Listen: rankAddrs[r], MetricsAddr: net.JoinHostPort(nodes[r].IP, "0"),
			Args: faultArgs("--rank-addrs", strings.Join(rankAddrs, ","))})
		pre[r] = attachSide(t, s, 1024)
		ids, err := pre[r].e.Alloc(t.Context(), n)
		require.NoError(t, err)
		if r == 0 {
			src = ids
		}
		require.Equal(t, src, ids, "lockstep allocation")
		pre[r].e.fillShape(t, kvgen.Shape{BlockSize: 16, RowBytes: 128, FirstHead: 4 * r, Heads: 4}, key, ids)
	}
	var parts []*v1.KVTransferParams
	for r := range pre {
		p, err := pre[r].e.RequestFinished(t.Context(), "req", src, v1.FinishStatus_FINISH_STATUS_LENGTH, &v1.KVTransferParams{DoRemoteDecode: true})
		require.NoError(t, err)
		parts = append(parts, p)
	}
	params, err := connector.MergeExports(parts...)
	require.NoError(t, err)
	require.Equal(t, rankAddrs, params.GetRemoteRankAddrs(), "the params carry every prefill rank's node address")

	dec := make([]*side, 4)
	dst := make([][]uint32, 4)
	for d := range dec {
		// --role decode: a TP 4 decode on port 0 needs no --rank-addrs (peers never look it up).
		s := env.StartSidecar(t, SidecarOpts{Engine: "dec", Role: "decode", TPRank: d, TPSize: 4, Listen: net.JoinHostPort(nodes[0].HostIP, "0"), Args: faultArgs()})
		dec[d] = attachSide(t, s, 1024)
		dst[d] = dec[d].load(t, "req", params)
	}
	for d := range dec {
		f := dec[d].outcome(t, "req", 30*time.Second)
		require.Nil(t, f, "decode rank %d failed: %v", d, f.GetError())
		dec[d].e.checkShape(t, kvgen.Shape{BlockSize: 16, RowBytes: 128, FirstHead: 2 * d, Heads: 2}, key, dst[d])
	}
	for r := range pre {
		pre[r].waitSent(t, "req", 30*time.Second)
		slice := float64(n * dec[0].e.info.GetNumRegions() * uint32(dec[0].e.info.GetBlockLen()))
		pre[r].WaitMetric(t, "kvsidecar_transfer_bytes_total", 2*slice) // two decode ranks' slices
		pre[r].requireIdle(t)
	}
	for d := range dec {
		dec[d].free(t, dst[d])
		dec[d].requireIdle(t)
	}
}
