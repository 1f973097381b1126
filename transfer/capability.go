package transfer

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"slices"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// capVersion is the first byte of every capability token.
const capVersion = 1

// capMACLen is the length of the HMAC-SHA256 tag at the end of a token.
const capMACLen = sha256.Size

// CapabilityKey issues and verifies capabilities: tokens that name a request
// id's block set and carry an HMAC-SHA256 tag over both, keyed by a secret
// that never leaves the exporting process. A peer can neither forge a token
// nor widen one to other blocks or another request. It is safe for
// concurrent use.
//
// Token layout: version byte 1, uvarint block count, the sorted block ids as
// uvarint deltas, then the 32-byte tag over
// "kvsidecar-cap-v1" | uvarint len(request id) | request id | the preceding bytes.
type CapabilityKey struct {
	key []byte
}

// NewCapabilityKey returns a key with 32 random bytes from crypto/rand.
func NewCapabilityKey() *CapabilityKey {
	k := &CapabilityKey{key: make([]byte, 32)}
	if _, err := rand.Read(k.key); err != nil {
		panic("transfer: crypto/rand failed: " + err.Error())
	}
	return k
}

// NewCapabilityKeyFromSecret returns a key using secret (copied) as the
// HMAC key, so every rank of an engine sharing the secret verifies the
// capabilities any of them issued. The secret should hold at least 16
// random bytes; the caller validates its length.
func NewCapabilityKeyFromSecret(secret []byte) *CapabilityKey {
	return &CapabilityKey{key: append([]byte(nil), secret...)}
}

// ID is a one-way fingerprint of the key: 16 hex digits of HMAC-SHA256
// under the key of a fixed label, so ranks, peers and operators can compare
// keys without any of them seeing one. The same secret gives the same ID in
// every process.
func (k *CapabilityKey) ID() string {
	h := hmac.New(sha256.New, k.key)
	h.Write([]byte("kvsidecar capability key id v1"))
	return hex.EncodeToString(h.Sum(nil)[:8])
}

// Issue returns a capability for requestID covering blockIDs (in any order;
// duplicates are ignored).
func (k *CapabilityKey) Issue(requestID string, blockIDs ...uint32) []byte {
	ids := slices.Clone(blockIDs)
	slices.Sort(ids)
	ids = slices.Compact(ids)
	b := make([]byte, 0, 1+binary.MaxVarintLen64+len(ids)*2+capMACLen)
	b = append(b, capVersion)
	b = binary.AppendUvarint(b, uint64(len(ids)))
	prev := uint32(0)
	for _, id := range ids {
		b = binary.AppendUvarint(b, uint64(id-prev))
		prev = id
	}
	return append(b, k.mac(requestID, b)...)
}

func (k *CapabilityKey) mac(requestID string, body []byte) []byte {
	h := hmac.New(sha256.New, k.key)
	h.Write([]byte("kvsidecar-cap-v1"))
	h.Write(binary.AppendUvarint(nil, uint64(len(requestID))))
	h.Write([]byte(requestID))
	h.Write(body)
	return h.Sum(nil)
}

// Verify checks that capability was issued by k for requestID and covers
// every id of blockIDs (sorted or not). It returns an error of class
// ErrCapabilityDenied naming the first uncovered block, or of class
// ErrInvalidArgument for a malformed token.
func (k *CapabilityKey) Verify(capability []byte, requestID string, blockIDs []uint32) error {
	covered, err := decodeCapability(capability)
	if err != nil {
		return err
	}
	body := capability[:len(capability)-capMACLen]
	if !hmac.Equal(k.mac(requestID, body), capability[len(capability)-capMACLen:]) {
		return errorf(v1.Code_CODE_CAPABILITY_DENIED, "capability is not valid for request %q", requestID)
	}
	for _, id := range blockIDs {
		if _, ok := slices.BinarySearch(covered, id); !ok {
			return errorf(v1.Code_CODE_CAPABILITY_DENIED, "block %d is not covered by the capability of request %q", id, requestID)
		}
	}
	return nil
}

// decodeCapability parses a token's block ids without checking its tag.
// It allocates at most one uint32 per byte of input.
func decodeCapability(b []byte) ([]uint32, error) {
	if len(b) < 2+capMACLen || b[0] != capVersion {
		return nil, errorf(v1.Code_CODE_INVALID_ARGUMENT, "capability of %d bytes is malformed (want version %d and a %d-byte tag)", len(b), capVersion, capMACLen)
	}
	body := b[1 : len(b)-capMACLen]
	n, w := binary.Uvarint(body)
	if w <= 0 || n > uint64(len(body)-w) {
		return nil, errorf(v1.Code_CODE_INVALID_ARGUMENT, "capability claims %d blocks in %d bytes", n, len(body))
	}
	body = body[w:]
	ids := make([]uint32, 0, n)
	var cur uint64
	for i := uint64(0); i < n; i++ {
		d, w := binary.Uvarint(body)
		if w <= 0 {
			return nil, errorf(v1.Code_CODE_INVALID_ARGUMENT, "capability block %d is truncated", i)
		}
		body = body[w:]
		cur += d
		if cur > 0xFFFFFFFF || (i > 0 && d == 0) {
			return nil, errorf(v1.Code_CODE_INVALID_ARGUMENT, "capability block %d (%d) is out of order or beyond uint32", i, cur)
		}
		ids = append(ids, uint32(cur))
	}
	if len(body) != 0 {
		return nil, errorf(v1.Code_CODE_INVALID_ARGUMENT, "capability has %d trailing bytes", len(body))
	}
	return ids, nil
}

// ExportRef names one export: the blocks one rank holds for one request
// under one lease (an entry of kv_transfer_params rank_exports). ExportID is
// chosen at random by the exporting rank, so a request id reused later names
// another export.
type ExportRef struct {
	RequestID string
	TPRank    uint32
	ExportID  uint64
}

func (e ExportRef) String() string {
	return fmt.Sprintf("export %016x of request %q on rank %d", e.ExportID, e.RequestID, e.TPRank)
}

// capExportVersion is the first byte of an export capability.
const capExportVersion = 2

// IssueExport returns the capability of export e over blockIDs, the rank's
// block ids in token order. Token layout: version byte 2, then the
// HMAC-SHA256 tag over "kvsidecar-export-v2" | uvarint len(request id) |
// request id | uvarint tp_rank | export id (8 bytes, big endian) | uvarint
// block count | each block id as a uvarint. The token names no block: the
// serving rank holds the export's blocks and recomputes the tag from them,
// so a token verifies only against the exact export it was issued for.
func (k *CapabilityKey) IssueExport(e ExportRef, blockIDs []uint32) []byte {
	return append([]byte{capExportVersion}, k.exportMAC(e, blockIDs)...)
}

func (k *CapabilityKey) exportMAC(e ExportRef, blockIDs []uint32) []byte {
	h := hmac.New(sha256.New, k.key)
	b := []byte("kvsidecar-export-v2")
	b = binary.AppendUvarint(b, uint64(len(e.RequestID)))
	b = append(b, e.RequestID...)
	b = binary.AppendUvarint(b, uint64(e.TPRank))
	b = binary.BigEndian.AppendUint64(b, e.ExportID)
	b = binary.AppendUvarint(b, uint64(len(blockIDs)))
	for _, id := range blockIDs {
		b = binary.AppendUvarint(b, uint64(id))
	}
	h.Write(b)
	return h.Sum(nil)
}

// VerifyExport checks that capability was issued by k for export e over
// blockIDs (in token order). It returns an error of class
// ErrCapabilityDenied naming the export, or of class ErrInvalidArgument for
// a token of the wrong form.
func (k *CapabilityKey) VerifyExport(capability []byte, e ExportRef, blockIDs []uint32) error {
	if len(capability) != 1+capMACLen || capability[0] != capExportVersion {
		return errorf(v1.Code_CODE_INVALID_ARGUMENT, "capability of %d bytes is not an export capability (want version %d and a %d-byte tag)",
			len(capability), capExportVersion, capMACLen)
	}
	if !hmac.Equal(k.exportMAC(e, blockIDs), capability[1:]) {
		return errorf(v1.Code_CODE_CAPABILITY_DENIED, "capability is not valid for %v", e)
	}
	return nil
}
