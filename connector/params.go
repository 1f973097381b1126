package connector

import (
	"errors"
	"fmt"
	"net"
	"strconv"

	"google.golang.org/protobuf/encoding/protojson"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// MaxTPSize is the largest tensor-parallel size accepted anywhere (tp_size in
// kv_transfer_params, group configs).
const MaxTPSize = 1024

// ErrInvalidParams is wrapped by every *ParamsError.
var ErrInvalidParams = errors.New("invalid kv_transfer_params")

// ParamsError names the kv_transfer_params field that broke a rule.
// errors.Is(err, ErrInvalidParams) is true.
type ParamsError struct {
	// Field is the JSON field name, e.g. "tp_size".
	Field string
	// Value is the offending value as text ("" when missing).
	Value string
	// Rule says what was expected.
	Rule string
}

func (e *ParamsError) Error() string {
	if e.Value == "" {
		return fmt.Sprintf("connector: kv_transfer_params: %s: %s", e.Field, e.Rule)
	}
	return fmt.Sprintf("connector: kv_transfer_params: %s=%s: %s", e.Field, e.Value, e.Rule)
}

// Unwrap returns ErrInvalidParams.
func (e *ParamsError) Unwrap() error { return ErrInvalidParams }

// Code is CODE_INVALID_ARGUMENT: bad params are the caller's error, also
// when they cross the local API.
func (e *ParamsError) Code() v1.Code { return v1.Code_CODE_INVALID_ARGUMENT }

var paramsJSON = protojson.MarshalOptions{UseProtoNames: true}

// MarshalKVTransferParams encodes p as the kv_transfer_params JSON object,
// with vLLM NixlConnector field names (remote_engine_id, remote_block_ids,
// remote_host, remote_port, remote_request_id, tp_size, do_remote_prefill,
// do_remote_decode) plus kvsidecar's. 64-bit integers (remote_incarnation,
// lease_expires_unix_ms) are JSON strings, as protojson writes them; the
// decoder takes numbers or strings.
func MarshalKVTransferParams(p *v1.KVTransferParams) ([]byte, error) {
	b, err := paramsJSON.Marshal(p)
	if err != nil {
		return nil, fmt.Errorf("connector: encode kv_transfer_params: %w", err)
	}
	return b, nil
}

// UnmarshalKVTransferParams decodes the kv_transfer_params JSON object.
// Unknown fields are ignored (vLLM adds its own). Params that ask decode to
// pull from a remote prefill (anything but a bare do_remote_decode request)
// are validated with ValidateRemotePrefill; a violation is a *ParamsError
// naming the field.
func UnmarshalKVTransferParams(data []byte) (*v1.KVTransferParams, error) {
	var p v1.KVTransferParams
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(data, &p); err != nil {
		return nil, fmt.Errorf("connector: decode kv_transfer_params: %w: %w", ErrInvalidParams, err)
	}
	if p.GetDoRemoteDecode() && !p.GetDoRemotePrefill() {
		return &p, nil
	}
	if err := ValidateRemotePrefill(&p); err != nil {
		return nil, err
	}
	return &p, nil
}

// ValidateRemotePrefill checks the params a decode rank needs to pull KV:
// tp_size present and in [1, MaxTPSize]; remote_engine_id and
// remote_request_id set; remote_rank_addrs either empty (then remote_host
// and remote_port locate rank 0 and rank r is at remote_port+r) or exactly
// tp_size valid host:port entries; lease_expires_unix_ms not negative.
func ValidateRemotePrefill(p *v1.KVTransferParams) error {
	if p == nil {
		return &ParamsError{Field: "kv_transfer_params", Rule: "missing"}
	}
	if p.TpSize == nil {
		return &ParamsError{Field: "tp_size", Rule: "missing; the prefill TP size is required and never defaulted to 1"}
	}
	tp := p.GetTpSize()
	if tp < 1 || tp > MaxTPSize {
		return &ParamsError{Field: "tp_size", Value: strconv.FormatUint(uint64(tp), 10), Rule: fmt.Sprintf("must be in [1, %d]", MaxTPSize)}
	}
	if p.GetRemoteEngineId() == "" {
		return &ParamsError{Field: "remote_engine_id", Rule: "missing"}
	}
	if p.GetRemoteRequestId() == "" {
		return &ParamsError{Field: "remote_request_id", Rule: "missing"}
	}
	if n := len(p.GetRemoteRankAddrs()); n > 0 {
		if n != int(tp) {
			return &ParamsError{Field: "remote_rank_addrs", Value: fmt.Sprintf("%d entries", n),
				Rule: fmt.Sprintf("must have exactly tp_size=%d entries, one per prefill rank", tp)}
		}
		for i, a := range p.GetRemoteRankAddrs() {
			if err := checkHostPort(a); err != nil {
				return &ParamsError{Field: fmt.Sprintf("remote_rank_addrs[%d]", i), Value: strconv.Quote(a), Rule: err.Error()}
			}
		}
	} else {
		if p.GetRemoteHost() == "" {
			return &ParamsError{Field: "remote_host", Rule: "missing while remote_rank_addrs is empty"}
		}
		port := p.GetRemotePort()
		if port < 1 || uint64(port)+uint64(tp)-1 > 65535 {
			return &ParamsError{Field: "remote_port", Value: strconv.FormatUint(uint64(port), 10),
				Rule: fmt.Sprintf("must be in [1, %d] so that ranks 0..%d fit at remote_port+rank", 65536-tp, tp-1)}
		}
	}
	if p.GetLeaseExpiresUnixMs() < 0 {
		return &ParamsError{Field: "lease_expires_unix_ms", Value: strconv.FormatInt(p.GetLeaseExpiresUnixMs(), 10), Rule: "must not be negative"}
	}
	return nil
}

// RankAddr returns the QUIC address of prefill rank r from validated params:
// remote_rank_addrs[r], or remote_host:remote_port+r when that list is empty.
func RankAddr(p *v1.KVTransferParams, r int) (string, error) {
	tp := int(p.GetTpSize())
	if r < 0 || r >= tp {
		return "", &ParamsError{Field: "tp_size", Value: strconv.Itoa(tp), Rule: fmt.Sprintf("rank %d is not below it", r)}
	}
	if addrs := p.GetRemoteRankAddrs(); len(addrs) > 0 {
		return addrs[r], nil
	}
	return net.JoinHostPort(p.GetRemoteHost(), strconv.Itoa(int(p.GetRemotePort())+r)), nil
}

func checkHostPort(a string) error {
	host, port, err := net.SplitHostPort(a)
	if err != nil {
		return errors.New("must be host:port")
	}
	if host == "" {
		return errors.New("host must not be empty")
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 1 || n > 65535 {
		return errors.New("port must be in [1, 65535]")
	}
	return nil
}
