package connector

import (
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/kvsidecar/kvsidecar/handshake"
	"github.com/kvsidecar/kvsidecar/internal/unixsock"
	"github.com/kvsidecar/kvsidecar/transfer"
)

// The same-host path (transfer's samehost.go) as a rank uses it: a rank
// with Config.SameHostSocket offers its pages on that socket, in its
// metadata with this host's identity; a decode rank reads from a prefill
// rank on the same host through it. Which sources are on this host is
// learned from their metadata (exchanged over QUIC under mutual TLS),
// never from kv_transfer_params: the params only say where to dial.

// SameHostSocketPath returns the path of the same-host socket of rank
// tpRank of engine engineID in dir: <dir>/kvsidecar-<id>-tp<rank>-peer.sock
// (unixsock.Path's rules for <id>). Errors wrap unixsock.ErrInvalidPath.
func SameHostSocketPath(dir, engineID string, tpRank int) (string, error) {
	return unixsock.Path(dir, engineID, "-tp"+strconv.Itoa(tpRank)+"-peer.sock")
}

// bootIDFile holds the Linux boot id, this host's identity for the
// same-host path: two processes that read the same one run on one kernel
// (proc(5): /proc/sys/kernel/random/boot_id).
const bootIDFile = "/proc/sys/kernel/random/boot_id"

// hostIdentity returns this host's identity (the boot id).
func hostIdentity() (string, error) {
	b, err := os.ReadFile(bootIDFile)
	if err != nil {
		return "", fmt.Errorf("connector: this host's identity: %w", err)
	}
	id := strings.TrimSpace(string(b))
	if id == "" {
		return "", fmt.Errorf("connector: this host's identity: %s is empty", bootIDFile)
	}
	return id, nil
}

// sameHostTransfer sets tc's same-host fields for a rank over pool with
// Config.SameHostSocket: the socket, the pages it shares and how, the
// device copier. It returns this host's identity, or "" (and logs why)
// when the path cannot be offered.
func (r *Rank) sameHostTransfer(tc *transfer.Config) string {
	if r.cfg.SameHostSocket == "" {
		return ""
	}
	id, err := hostIdentity()
	if err != nil {
		r.cfg.Logger.Warn("same-host path off: no host identity; READs between sidecars of this host go over QUIC", "err", err)
		return ""
	}
	tc.LocalSocket = r.cfg.SameHostSocket
	tc.Share, tc.ShareKind = r.mem.Share, r.mem.ShareKind()
	tc.PeerCopier = r.mem.PeerCopier()
	return id
}

// sameHostPeer returns the same-host path to the source whose metadata is
// md: its offer, when it made one with this host's identity and this rank
// offers the path too; nil otherwise (the READ goes over QUIC).
func (r *Rank) sameHostPeer(md *handshake.Metadata) *transfer.SameHostPeer {
	sh := md.SameHost
	if r.hostID == "" || sh == nil || sh.HostID != r.hostID || sh.Socket == "" {
		return nil
	}
	return &transfer.SameHostPeer{Socket: sh.Socket, Token: bytes.Clone(sh.Token), Kind: sh.PageKind}
}

// localIPs are this host's interface addresses, read once.
var localIPs = sync.OnceValue(func() map[netip.Addr]bool {
	ips := map[netip.Addr]bool{}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return ips
	}
	for _, a := range addrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil {
			ips[p.Addr().Unmap()] = true
		}
	}
	return ips
})

// mayBeSameHost reports whether addr (host:port) names an address of this
// host, so a load waits for that source's metadata (one round trip, none
// when cached) before its READ, to learn whether the same-host path
// reaches it. Only a hint: the metadata decides.
func (r *Rank) mayBeSameHost(addr string) bool {
	if r.hostID == "" {
		return false
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return false
	}
	ip = ip.Unmap()
	return ip.IsLoopback() || localIPs()[ip]
}
