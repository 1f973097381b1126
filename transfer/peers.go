package transfer

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
)

// AllowedPeers is the set of addresses an agent may dial
// (Config.AllowedPeers). Addresses come from kv_transfer_params, which a
// proxy forwards and which, in vLLM, a client's request can carry: an
// address outside the set gets no packet at all. It is immutable and safe
// for concurrent use.
type AllowedPeers struct {
	// Origin names where the set came from, for messages ("--allow-peers").
	Origin string

	spec     string
	prefixes []netip.Prefix          // any port
	addrs    map[netip.AddrPort]bool // this IP and port
	names    map[string]bool         // lower-case "name:port" as dialled
}

// ParseAllowedPeers parses spec, a comma-separated list of CIDR prefixes
// (10.0.0.0/8, fd00::/8: any port), IP addresses (10.0.0.5: any port) and
// host:port entries (10.0.0.5:5600, [fd00::5]:5600, prefill-0.internal:5600:
// that port only; a name matches a peer dialled by that name). origin names
// the setting in messages. Errors name the entry and why.
func ParseAllowedPeers(origin, spec string) (*AllowedPeers, error) {
	s := &AllowedPeers{Origin: origin, spec: spec, addrs: map[netip.AddrPort]bool{}, names: map[string]bool{}}
	for _, e := range strings.Split(spec, ",") {
		e = strings.TrimSpace(e)
		if e == "" {
			continue
		}
		if p, err := netip.ParsePrefix(e); err == nil {
			s.prefixes = append(s.prefixes, p.Masked())
			continue
		}
		if ip, err := netip.ParseAddr(e); err == nil {
			s.prefixes = append(s.prefixes, netip.PrefixFrom(ip.Unmap(), ip.Unmap().BitLen()))
			continue
		}
		host, port, err := net.SplitHostPort(e)
		if err != nil || host == "" {
			return nil, fmt.Errorf("transfer: %s: entry %q: want a CIDR prefix (10.0.0.0/8), an IP address or host:port", origin, e)
		}
		n, err := strconv.ParseUint(port, 10, 16)
		if err != nil || n == 0 {
			return nil, fmt.Errorf("transfer: %s: entry %q: port %q is not in [1, 65535]", origin, e, port)
		}
		if ip, err := netip.ParseAddr(host); err == nil {
			s.addrs[netip.AddrPortFrom(ip.Unmap(), uint16(n))] = true
		} else {
			s.names[strings.ToLower(net.JoinHostPort(host, port))] = true
		}
	}
	if len(s.prefixes)+len(s.addrs)+len(s.names) == 0 {
		return nil, fmt.Errorf("transfer: %s: %q names no peer", origin, spec)
	}
	return s, nil
}

// String is the list as given.
func (s *AllowedPeers) String() string { return s.spec }

// errNotAllowed is the class of a dial refused by AllowedPeers.
var errNotAllowed = errors.New("not an allowed peer")

// check allows a dial of addr (host:port as the caller named it), resolved
// to to, or returns an error of class ErrInvalidArgument naming both and
// the set.
func (s *AllowedPeers) check(addr string, to netip.AddrPort) error {
	to = netip.AddrPortFrom(to.Addr().Unmap(), to.Port())
	if s.addrs[to] || s.names[strings.ToLower(addr)] {
		return nil
	}
	for _, p := range s.prefixes {
		if p.Contains(to.Addr()) {
			return nil
		}
	}
	at := ""
	if host, _, _ := net.SplitHostPort(addr); host != to.Addr().String() {
		at = " (" + to.String() + ")"
	}
	return fmt.Errorf("%w: transfer: peer %s%s is outside %s=%s, so nothing was sent to it: %w", ErrInvalidArgument, addr, at, s.Origin, s.spec, errNotAllowed)
}
