package connector

import (
	"cmp"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/transfer"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// End-to-end checksums of the KV (RankExport.block_checksums). QUIC's AEAD
// proves bytes were not changed on the wire, not that they are the bytes
// the prefill engine wrote into those blocks: a wrong region, a page
// remapped under a READ or a block overwritten after the export all arrive
// intact. So the exporting rank records, when the request finishes, a
// CRC-32C per block and KV head over that head's bytes in every region (in
// (layer, K before V) order), and the decode rank checks the heads it read
// once they are in its memory, before it reports the load done. A KV head
// is the unit because a decode rank of a larger TP size reads only some
// heads of a prefill rank's block (HND layout: heads outermost, so a head
// is a byte range of the block in each region).

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// ChecksumError is a load whose bytes landed but differ, in some blocks,
// from the checksums the prefill recorded: it reports exactly those local
// blocks for recompute. Its class is CODE_DATA_LOSS.
type ChecksumError struct {
	// RequestID is the decode-side request id.
	RequestID string
	// Blocks are the local block ids whose bytes differ, ascending.
	Blocks []int
	// Checked is how many local blocks were checked.
	Checked int
	// First describes the first difference found.
	First string
	// Sampled, when the load verified a sample of its blocks (the
	// same-host path, Config.SameHostVerifyEvery), are the sampled blocks
	// that differ; Blocks is then every block of the load, since those
	// not sampled may differ too.
	Sampled []int
}

func (e *ChecksumError) Error() string {
	if e.Sampled != nil {
		return fmt.Sprintf("connector: load %q: %d sampled blocks differ from the CRC-32C their prefill recorded when the request finished (local blocks %v; first: %s); all %d blocks of the load are reported for recompute",
			e.RequestID, len(e.Sampled), e.Sampled, e.First, len(e.Blocks))
	}
	return fmt.Sprintf("connector: load %q: %d of %d blocks differ from the CRC-32C their prefill recorded when the request finished (local blocks %v; first: %s); they are reported for recompute",
		e.RequestID, len(e.Blocks), e.Checked, e.Blocks, e.First)
}

// Code is CODE_DATA_LOSS.
func (e *ChecksumError) Code() v1.Code { return v1.Code_CODE_DATA_LOSS }

// checksumOrder returns the indices of regions in the order checksums run
// over them: by layer, K before V (a vmm layout's own order).
func checksumOrder(regions []vmm.RegionInfo) []int {
	order := make([]int, len(regions))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		return cmp.Or(cmp.Compare(regions[a].Layer, regions[b].Layer), cmp.Compare(regions[a].Kind, regions[b].Kind))
	})
	return order
}

// maxRunBytes bounds the bytes headCRCs reads of a region at once.
const maxRunBytes = 4 << 20

// headCRCs sets crcs[k·units+u] to the CRC-32C of KV head u of blocks[k]:
// bytes [off+u·hb, off+(u+1)·hb) of the block in every region of order,
// for u in [0, units). It reads each region once per run of blocks that lie
// back to back in memory (a request's blocks mostly do), not once per
// block. buf is a staging buffer for memory that is not host-addressable
// (device pages).
func headCRCs(p *vmm.Pool, regions []vmm.RegionInfo, order []int, blocks []int, off, hb, units uint64, crcs []uint32, buf *[]byte) error {
	clear(crcs)
	for _, ri := range order {
		reg := regions[ri]
		for i := 0; i < len(blocks); {
			first := reg.BlockOffset(blocks[i])
			j := i + 1
			for j < len(blocks) && reg.BlockOffset(blocks[j]) == reg.BlockOffset(blocks[j-1])+reg.BlockLen &&
				reg.BlockOffset(blocks[j])+reg.BlockLen-first <= maxRunBytes {
				j++
			}
			n := reg.BlockOffset(blocks[j-1]) + reg.BlockLen - first
			bs, err := p.HostBytes(reg.Index, first, n)
			if err != nil {
				if uint64(cap(*buf)) < n {
					*buf = make([]byte, n)
				}
				bs = (*buf)[:n]
				if err := p.CopyOut(reg.Index, first, bs); err != nil {
					return fmt.Errorf("block %d: %w", blocks[i], err)
				}
			}
			for k := i; k < j; k++ {
				at := reg.BlockOffset(blocks[k]) - first + off
				for u := range units {
					c := &crcs[uint64(k)*units+u]
					*c = crc32.Update(*c, castagnoli, bs[at+u*hb:at+(u+1)*hb])
				}
			}
			i = j
		}
	}
	return nil
}

// recordChecksums returns RankExport.block_checksums of blocks (in token
// order) on this rank and the heads per block they cover.
func (r *Rank) recordChecksums(blocks []int) ([]byte, uint32, error) {
	start := time.Now()
	hb := r.shape.HeadBlockBytes
	units := r.regions[0].BlockLen / hb
	var buf []byte
	crcs := make([]uint32, uint64(len(blocks))*units)
	if err := headCRCs(r.pool, r.regions, r.crcOrder, blocks, 0, hb, units, crcs, &buf); err != nil {
		return nil, 0, fmt.Errorf("connector: checksums: %w", err)
	}
	out := make([]byte, 0, 4*len(crcs))
	for _, crc := range crcs {
		out = binary.LittleEndian.AppendUint32(out, crc)
	}
	r.observeChecksum("record", start)
	return out, uint32(units), nil
}

// checkChecksumParams checks export e's checksums against the blocks it
// names: 4 bytes per block and head. k is e's index in rank_exports.
func checkChecksumParams(p *v1.KVTransferParams, k int, e *v1.RankExport) error {
	sums, units := e.GetBlockChecksums(), uint64(e.GetChecksumHeads())
	if len(sums) == 0 && units == 0 {
		return nil
	}
	field := func(f string) string { return fmt.Sprintf("rank_exports[%d].%s", k, f) }
	n := uint64(len(sourceBlocks(p, e)))
	switch {
	case units == 0:
		return &ParamsError{Field: field("checksum_heads"), Rule: "missing (0) while block_checksums is set", Reason: codes.ReasonParamsMissing}
	case uint64(len(sums)) != 4*n*units:
		return &ParamsError{Field: field("block_checksums"), Value: fmt.Sprintf("%d bytes", len(sums)),
			Rule:   fmt.Sprintf("must be 4 bytes per block and head: 4 × %d blocks × %d heads = %d", n, units, 4*n*units),
			Reason: codes.ReasonParamsCountMismatch}
	}
	return nil
}

// checkChecksumHeads checks that export e's checksums (k in rank_exports)
// cover the heads source s read. It runs once the READs succeeded, when
// the source's handshake confirmed the TP mapping: before, an edited
// tp_size is best named by the handshake.
func (r *Rank) checkChecksumHeads(l *load, i int) error {
	s, e := l.plan.Sources[i], l.exports[i]
	hb, units := r.shape.HeadBlockBytes, uint64(e.GetChecksumHeads())
	if (s.RemoteOffset+s.Len)/hb <= units {
		return nil
	}
	return &ParamsError{Field: fmt.Sprintf("rank_exports[%d].checksum_heads", slices.Index(l.params.GetRankExports(), e)), Value: strconv.FormatUint(units, 10),
		Rule:   fmt.Sprintf("prefill rank %d's checksums must cover heads %d..%d that decode rank %d reads", s.PrefillRank, s.RemoteOffset/hb, (s.RemoteOffset+s.Len)/hb-1, r.cfg.TPRank),
		Reason: codes.ReasonParamsOutOfRange}
}

// landVerifier folds the bytes one source's READs land into its
// per-block, per-head CRC-32C as they land (transfer.Xfer.OnLanded), so a
// decode rank verifies them while they are in cache instead of reading
// them again; only the blocks it samples (every one in every, phase
// chosen per load) are folded and checked.
type landVerifier struct {
	hb, nu, sliceLen uint64 // bytes of a head's slice, heads read, bytes read per block and region
	nregions         uint64
	every, phase     uint64
	crcs             []uint32 // per local block of the load (l.dst) and head read
	landed           atomic.Uint64
	want             uint64 // bytes the sampled blocks land
	nanos            atomic.Int64
}

// newLandVerifier is the verifier of source s of a load of n blocks into
// nregions regions, sampling one block in every (1: all).
func newLandVerifier(s Source, hb uint64, n, nregions int, every uint64) *landVerifier {
	v := &landVerifier{hb: hb, nu: s.Len / hb, sliceLen: s.Len, nregions: uint64(nregions), every: max(every, 1)}
	if v.every > 1 {
		var b [8]byte
		_, _ = rand.Read(b[:])
		v.phase = binary.LittleEndian.Uint64(b[:]) % v.every
	}
	v.crcs = make([]uint32, uint64(n)*v.nu)
	for k := range uint64(n) {
		if v.sampled(k) {
			v.want += v.sliceLen * v.nregions
		}
	}
	return v
}

// sampled reports whether local block k (index in the load's blocks) is
// verified.
func (v *landVerifier) sampled(k uint64) bool { return (k+v.phase)%v.every == 0 }

// onLanded is the OnLanded of the READ of the load's blocks [first,
// first+n): its local stream holds, for each region in order, the n
// blocks' slices back to back. The regions land in checksum order (the
// caller checked that the rank's regions are in it), each block's on one
// goroutine.
func (v *landVerifier) onLanded(first, n int) func(at uint64, b []byte) {
	regionLen := uint64(n) * v.sliceLen
	return func(at uint64, b []byte) {
		start := time.Now()
		folded := uint64(0)
		for len(b) > 0 {
			rem := at % regionLen
			k, within := uint64(first)+rem/v.sliceLen, rem%v.sliceLen
			m := min(uint64(len(b)), v.sliceLen-within) // this block's slice
			if v.sampled(k) {
				for off := uint64(0); off < m; {
					u, inHead := (within+off)/v.hb, (within+off)%v.hb
					c := min(m-off, v.hb-inHead)
					p := &v.crcs[k*v.nu+u]
					*p = crc32.Update(*p, castagnoli, b[off:off+c])
					off += c
				}
				folded += m
			}
			b, at = b[m:], at+m
		}
		if folded > 0 {
			v.landed.Add(folded)
			v.nanos.Add(int64(time.Since(start)))
		}
	}
}

// complete reports whether every byte of the sampled blocks went through
// onLanded (not when they never passed through host memory: a same-host
// READ of device pages).
func (v *landVerifier) complete() bool { return v.landed.Load() == v.want }

// verifierFor returns the landVerifier of source s of l (export e), read
// on the same-host path when sh is set: nil when e carries no checksums or
// they are not verified on the path. Over QUIC every block is verified;
// on the same-host path one block in Config.SameHostVerifyEvery, and none
// when the rank's memory is on a device (the bytes never pass through
// host memory there).
func (r *Rank) verifierFor(l *load, s Source, e *v1.RankExport, sh *transfer.SameHostPeer) *landVerifier {
	if s.NotifyOnly || len(e.GetBlockChecksums()) == 0 || len(l.dst) == 0 {
		return nil
	}
	every := uint64(1)
	if sh != nil {
		if r.cfg.SameHostVerifyEvery < 0 || !r.pool.HostAddressable() {
			return nil
		}
		every = uint64(r.cfg.SameHostVerifyEvery)
	}
	return newLandVerifier(s, r.shape.HeadBlockBytes, len(l.dst), len(r.regions), every)
}

// verifyChecksums checks the heads every reading source of l wrote into
// l.dst against the checksums its export carries and returns a
// *ChecksumError naming the local blocks that differ (nil when none does,
// or no export carries checksums). A source whose bytes were folded as
// they landed (its landVerifier complete) is checked from those; any other
// reads its heads again (headCRCs). Only the blocks a source's verifier
// samples are checked.
func (r *Rank) verifyChecksums(l *load) error {
	start := time.Now()
	var folded time.Duration
	hb := r.shape.HeadBlockBytes
	bad := map[int]bool{}
	first := ""
	checked, sampled := false, false
	var buf []byte
	for i, s := range l.plan.Sources {
		e := l.exports[i]
		sums, units := e.GetBlockChecksums(), uint64(e.GetChecksumHeads())
		v := l.verifiers[i]
		if s.NotifyOnly || len(sums) == 0 || v == nil {
			continue
		}
		if err := r.checkChecksumHeads(l, i); err != nil {
			return fmt.Errorf("connector: load %q: %w", l.id, err)
		}
		checked = true
		sampled = sampled || v.every > 1
		u0, nu := s.RemoteOffset/hb, s.Len/hb
		crcs := v.crcs
		folded += time.Duration(v.nanos.Load())
		if !v.complete() {
			var blocks []int
			for k, b := range l.dst {
				if v.sampled(uint64(k)) {
					blocks = append(blocks, b)
				}
			}
			got := make([]uint32, uint64(len(blocks))*nu)
			if err := headCRCs(r.pool, r.regions, r.crcOrder, blocks, s.LocalOffset, hb, nu, got, &buf); err != nil {
				return fmt.Errorf("connector: load %q: checksums: %w", l.id, err)
			}
			crcs = make([]uint32, uint64(len(l.dst))*nu)
			j := 0
			for k := range l.dst {
				if v.sampled(uint64(k)) {
					copy(crcs[uint64(k)*nu:uint64(k+1)*nu], got[uint64(j)*nu:uint64(j+1)*nu])
					j++
				}
			}
		}
		for k, b := range l.dst {
			if !v.sampled(uint64(k)) {
				continue
			}
			rk := uint64(l.hit + k) // the block's index in the export
			for u, got := range crcs[uint64(k)*nu : uint64(k+1)*nu] {
				at := 4 * (rk*units + u0 + uint64(u))
				if want := binary.LittleEndian.Uint32(sums[at:]); got != want && !bad[b] {
					bad[b] = true
					if first == "" {
						first = fmt.Sprintf("local block %d (remote block %d of prefill rank %d), head %d: CRC-32C %08x, recorded %08x",
							b, sourceBlocks(l.params, e)[rk], s.PrefillRank, u0+uint64(u), got, want)
					}
				}
			}
		}
	}
	if checked {
		r.observeChecksumFor("verify", time.Since(start)+folded)
	}
	if len(bad) == 0 {
		return nil
	}
	r.m.checksumMismatches.Add(float64(len(bad)))
	blocks := make([]int, 0, len(bad))
	for b := range bad {
		blocks = append(blocks, b)
	}
	slices.Sort(blocks)
	ce := &ChecksumError{RequestID: l.id, Blocks: blocks, Checked: len(l.dst), First: first}
	if sampled {
		// The blocks not sampled may differ too: every block is
		// recomputed.
		ce.Sampled, ce.Blocks = blocks, slices.Clone(l.dst)
		slices.Sort(ce.Blocks)
	}
	return ce
}

// observeChecksum counts the time since start spent on checksums (op
// record or verify).
func (r *Rank) observeChecksum(op string, start time.Time) {
	r.observeChecksumFor(op, time.Since(start))
}

// observeChecksumFor counts d spent on checksums (op record or verify).
func (r *Rank) observeChecksumFor(op string, d time.Duration) {
	i := 0
	if op == "verify" {
		i = 1
	}
	r.crcNanos[i].Add(int64(d))
	r.m.checksumSeconds.WithLabelValues(op).Observe(d.Seconds())
}

var _ codes.Coder = (*ChecksumError)(nil)
