package handshake

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"math/bits"
	"strings"

	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// WireVersion is the protocol version this build speaks.
const WireVersion = v1.WireVersion_WIRE_VERSION_1

// Sentinel error classes. Each maps to one wire code (codes.Of).
var (
	// ErrInvalidMetadata: metadata that breaks a structural rule (no regions,
	// a region of zero length, block_len * num_blocks beyond the region).
	ErrInvalidMetadata = codes.New(v1.Code_CODE_INVALID_ARGUMENT, "handshake: invalid agent metadata")
	// ErrIncompatible: model hash, geometry or wire version differ.
	ErrIncompatible = codes.New(v1.Code_CODE_INCOMPATIBLE_MODEL, "handshake: incompatible peer")
	// ErrTPMismatch: the peer's tp_size differs from what the request said.
	ErrTPMismatch = codes.New(v1.Code_CODE_TP_MISMATCH, "handshake: tp_size mismatch")
	// ErrUnknownEngine: the peer is not the engine id or rank expected.
	ErrUnknownEngine = codes.New(v1.Code_CODE_NOT_FOUND, "handshake: unknown engine")
)

// Region is one registered region of a peer rank.
type Region struct {
	// Base is the virtual address in the peer's address space.
	Base uint64
	// Len is the region's length in bytes.
	Len uint64
	// BlockLen is the bytes of one block of this region on the peer rank.
	BlockLen uint64
	// DevID is the peer's device id of the region (NIXL devID).
	DevID uint32
	Layer uint32
	Kind  v1.RegionKind
	// PageSize is the peer's page size in bytes; blocks never straddle a
	// page. 0: blocks are packed back to back.
	PageSize uint64
}

// Packing returns how the region's blocks sit in its pages.
func (r Region) Packing() kvgeom.Packing {
	return kvgeom.Packing{BlockLen: r.BlockLen, PageSize: r.PageSize}
}

// BlockOffset returns the byte offset of block b inside the region:
// r.Packing().Offset(b).
func (r Region) BlockOffset(b int) uint64 {
	return r.Packing().Offset(kvgeom.BlockID(b))
}

// Metadata is the validated AgentMetadata of one rank: what it tells a peer
// about its memory. Source: the handshake response of that rank.
type Metadata struct {
	EngineID  string
	AgentName string
	// Incarnation is random per process start of the peer.
	Incarnation uint64
	TPRank      int
	TPSize      int
	PPRank      int
	DeviceID    uint32
	// ModelHash is ModelHash(Geometry) as the peer computed it.
	ModelHash []byte
	// Geometry is the whole-model KV geometry (a private copy).
	Geometry *v1.ModelGeometry
	// BlockSize is tokens per block.
	BlockSize int
	// NumBlocks is blocks per region.
	NumBlocks int
	// HeadsPerRank is the KV heads held by the peer rank.
	HeadsPerRank int
	// Regions in order: per layer K then V, or one compound region.
	Regions []Region
	// Addr is the QUIC address the peer advertises (host:port).
	Addr string
	// CapabilityKeyID is the fingerprint of the peer's capability key
	// (transfer.CapabilityKey.ID); "" when the peer does not say.
	CapabilityKeyID string
	// SameHost is the peer's offer of its pages to readers on its host;
	// nil when it makes none.
	SameHost *SameHost
}

// SameHost is a rank's offer of its pages to readers on its own host
// (AgentMetadata.same_host).
type SameHost struct {
	// HostID identifies the host (its Linux boot id).
	HostID string
	// Socket is the path of the rank's same-host unix socket.
	Socket string
	// Token is what the socket's hello carries.
	Token []byte
	// PageKind is the kind of pages the rank passes.
	PageKind v1.PageKind
}

// ModelHash returns the model compatibility hash of g: SHA-256 over the
// deterministic encoding of the geometry (model name excluded, so two names
// of one geometry are compatible) and the wire version.
func ModelHash(g *v1.ModelGeometry) []byte {
	c := proto.Clone(g).(*v1.ModelGeometry)
	c.Model = ""
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(c)
	if err != nil {
		panic(fmt.Sprintf("handshake: marshal geometry: %v", err)) // cannot happen for a valid message
	}
	h := sha256.New()
	fmt.Fprintf(h, "kvsidecar-model/%d\x00", WireVersion)
	h.Write(b)
	return h.Sum(nil)
}

// FromProto converts and structurally validates wire metadata. Errors wrap
// ErrInvalidMetadata or ErrIncompatible and name the field.
func FromProto(m *v1.AgentMetadata) (*Metadata, error) {
	if m == nil {
		return nil, fmt.Errorf("%w: missing", ErrInvalidMetadata)
	}
	if m.GetWireVersion() != WireVersion {
		return nil, fmt.Errorf("%w: wire_version %d, want %d", ErrIncompatible, m.GetWireVersion(), WireVersion)
	}
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidMetadata, fmt.Sprintf(format, a...))
	}
	switch {
	case m.GetEngineId() == "":
		return nil, bad("engine_id is empty")
	case m.GetTpSize() < 1 || m.GetTpSize() > kvgeom.MaxTPSize:
		return nil, bad("tp_size=%d must be in [1, %d]", m.GetTpSize(), kvgeom.MaxTPSize)
	case m.GetTpRank() >= m.GetTpSize():
		return nil, bad("tp_rank=%d must be below tp_size=%d", m.GetTpRank(), m.GetTpSize())
	case m.GetGeometry() == nil:
		return nil, bad("geometry is missing")
	case m.GetNumBlocks() == 0:
		return nil, bad("num_blocks is 0")
	case len(m.GetRegions()) == 0:
		return nil, bad("no regions")
	case len(m.GetModelHash()) != sha256.Size:
		return nil, bad("model_hash has %d bytes, want %d", len(m.GetModelHash()), sha256.Size)
	}
	md := &Metadata{
		EngineID:        m.GetEngineId(),
		AgentName:       m.GetAgentName(),
		Incarnation:     m.GetIncarnation(),
		TPRank:          int(m.GetTpRank()),
		TPSize:          int(m.GetTpSize()),
		PPRank:          int(m.GetPpRank()),
		DeviceID:        m.GetDeviceId(),
		ModelHash:       append([]byte(nil), m.GetModelHash()...),
		Geometry:        proto.Clone(m.GetGeometry()).(*v1.ModelGeometry),
		BlockSize:       int(m.GetBlockSize()),
		NumBlocks:       int(m.GetNumBlocks()),
		HeadsPerRank:    int(m.GetHeadsPerRank()),
		Addr:            m.GetQuicAddr(),
		CapabilityKeyID: m.GetCapabilityKeyId(),
		Regions:         make([]Region, len(m.GetRegions())),
	}
	if sh := m.GetSameHost(); sh != nil {
		if sh.GetHostId() == "" || sh.GetSocket() == "" || len(sh.GetToken()) == 0 {
			return nil, bad("same_host names no host_id, socket or token")
		}
		md.SameHost = &SameHost{HostID: sh.GetHostId(), Socket: sh.GetSocket(), Token: append([]byte(nil), sh.GetToken()...), PageKind: sh.GetPageKind()}
	}
	for i, r := range m.GetRegions() {
		if _, err := kvgeom.NewPacking(r.GetBlockLen(), r.GetPageSize()); err != nil {
			return nil, bad("regions[%d]: %v", i, err)
		}
		if r.GetBase()+r.GetLen() < r.GetBase() {
			return nil, bad("regions[%d] base=%#x len=%d overflows", i, r.GetBase(), r.GetLen())
		}
		md.Regions[i] = Region{Base: r.GetBase(), Len: r.GetLen(), BlockLen: r.GetBlockLen(),
			DevID: r.GetDevId(), Layer: r.GetLayer(), Kind: r.GetKind(), PageSize: r.GetPageSize()}
		// The last block must end inside the region (no overflow: the
		// offset is below num_blocks × page_size, checked in 128 bits).
		last := md.Regions[i]
		if hi, _ := bits.Mul64(uint64(m.GetNumBlocks()), max(r.GetBlockLen(), r.GetPageSize())); hi != 0 {
			return nil, bad("regions[%d]: num_blocks=%d with block_len=%d overflows", i, m.GetNumBlocks(), r.GetBlockLen())
		}
		if end := last.BlockOffset(int(m.GetNumBlocks())-1) + r.GetBlockLen(); end > r.GetLen() {
			return nil, bad("regions[%d]: num_blocks=%d × block_len=%d (page_size %d) needs %d bytes, len=%d", i, m.GetNumBlocks(), r.GetBlockLen(), r.GetPageSize(), end, r.GetLen())
		}
	}
	return md, nil
}

// Proto returns the wire form of md.
func (md *Metadata) Proto() *v1.AgentMetadata {
	m := &v1.AgentMetadata{
		WireVersion:     WireVersion,
		EngineId:        md.EngineID,
		AgentName:       md.AgentName,
		Incarnation:     md.Incarnation,
		TpRank:          uint32(md.TPRank),
		TpSize:          uint32(md.TPSize),
		PpRank:          uint32(md.PPRank),
		DeviceId:        md.DeviceID,
		ModelHash:       md.ModelHash,
		Geometry:        md.Geometry,
		BlockSize:       uint32(md.BlockSize),
		NumBlocks:       uint32(md.NumBlocks),
		HeadsPerRank:    uint32(md.HeadsPerRank),
		QuicAddr:        md.Addr,
		CapabilityKeyId: md.CapabilityKeyID,
	}
	if sh := md.SameHost; sh != nil {
		m.SameHost = &v1.SameHost{HostId: sh.HostID, Socket: sh.Socket, Token: sh.Token, PageKind: sh.PageKind}
	}
	for _, r := range md.Regions {
		m.Regions = append(m.Regions, &v1.Region{Base: r.Base, Len: r.Len, BlockLen: r.BlockLen,
			DevId: r.DevID, Layer: r.Layer, Kind: r.Kind, PageSize: r.PageSize})
	}
	return m
}

// Expect is what a dialer expects of a peer rank, from the request's
// kv_transfer_params and the local geometry. Zero fields are not checked.
type Expect struct {
	// EngineID of the prefill instance (remote_engine_id).
	EngineID string
	// TPRank the dialer wants to reach.
	TPRank int
	// TPSize from kv_transfer_params (tp_size); 0 = not known (legacy query).
	TPSize int
	// ModelHash of the local geometry; must equal the peer's.
	ModelHash []byte
	// Geometry is the local geometry ModelHash was computed from; when the
	// hashes differ, the error names every field that differs with both
	// values instead of the hashes. nil: the hashes are named.
	Geometry *v1.ModelGeometry
	// NumRegions the local layout has; the peer must have as many.
	NumRegions int
	// BlockLen the TP mapping requires of every peer region; 0 = any.
	BlockLen uint64
	// Incarnation from kv_transfer_params (remote_incarnation); 0 = any.
	// A cached entry of another incarnation is stale and refetched.
	Incarnation uint64
	// Layout is the peer's regions as the dialer names them (the dialer's
	// own regions' layer and kind, with the block length the TP mapping
	// needs): the peer must hold the same set, in any order (see
	// MatchLayout). nil = not checked.
	Layout []RegionShape
}

// RegionShape is what one region holds: the tensor (K, V, or one compound
// region) of one layer, and the bytes of one block of it.
type RegionShape struct {
	Layer uint32
	Kind  v1.RegionKind
	// BlockLen is the bytes of one block; 0 = not compared.
	BlockLen uint64
}

// String names the region as a layout lists it: "layer 0 K", "layer 3
// compound".
func (s RegionShape) String() string {
	k := "kind?"
	switch s.Kind {
	case v1.RegionKind_REGION_KIND_K:
		k = "K"
	case v1.RegionKind_REGION_KIND_V:
		k = "V"
	case v1.RegionKind_REGION_KIND_COMPOUND:
		k = "compound"
	}
	return fmt.Sprintf("layer %d %s", s.Layer, k)
}

// Shape is the region's RegionShape.
func (r Region) Shape() RegionShape {
	return RegionShape{Layer: r.Layer, Kind: r.Kind, BlockLen: r.BlockLen}
}

// Shapes returns the shapes of rs, in order.
func Shapes(rs []Region) []RegionShape {
	out := make([]RegionShape, len(rs))
	for i, r := range rs {
		out[i] = r.Shape()
	}
	return out
}

// MatchLayout maps a reader's layout onto a served rank's regions by layer
// and kind: regions[i] is the index in served of the region holding
// want[i]'s layer and kind, so a peer that lists the same regions in
// another order (all K before all V, V before K in a layer) is read
// correctly. The two must be the same set: equal counts, every (layer,
// kind) of want exactly once in served, and each with want's block length
// when want names one. Otherwise the error wraps ErrIncompatible and names
// the first region that differs and both layouts (servedName and
// wantName say whose they are in the message: "this agent", "reader").
func MatchLayout(served, want []RegionShape, servedName, wantName string) ([]int, error) {
	type key struct {
		layer uint32
		kind  v1.RegionKind
	}
	bad := func(format string, a ...any) ([]int, error) {
		return nil, fmt.Errorf("%w: region layouts differ: %s (%s: %s; %s: %s)", ErrIncompatible, fmt.Sprintf(format, a...),
			servedName, layoutString(served), wantName, layoutString(want))
	}
	if len(served) != len(want) {
		return bad("%s has %d regions, %s %d", servedName, len(served), wantName, len(want))
	}
	at := make(map[key]int, len(served))
	for i, s := range served {
		k := key{s.Layer, s.Kind}
		if j, dup := at[k]; dup {
			return bad("%s lists %v twice (regions[%d] and regions[%d])", servedName, s, j, i)
		}
		at[k] = i
	}
	out := make([]int, len(want))
	used := make([]bool, len(served))
	for i, w := range want {
		j, ok := at[key{w.Layer, w.Kind}]
		switch {
		case !ok:
			return bad("%s regions[%d] is %v, %s has no %v (its regions[%d] is %v)", wantName, i, w, servedName, w, i, served[i])
		case used[j]:
			return bad("%s lists %v twice", wantName, w)
		case w.BlockLen != 0 && served[j].BlockLen != w.BlockLen:
			return bad("%v: block_len %d on %s, %s needs %d", w, served[j].BlockLen, servedName, wantName, w.BlockLen)
		}
		used[j] = true
		out[i] = j
	}
	return out, nil
}

// layoutString lists a layout, "layer 0 K, layer 0 V, ..." (the first 8
// regions and a count of the rest).
func layoutString(rs []RegionShape) string {
	const show = 8
	var b strings.Builder
	for i, r := range rs {
		if i == show {
			fmt.Fprintf(&b, ", ... %d more", len(rs)-show)
			break
		}
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(r.String())
	}
	return "[" + b.String() + "]"
}

// Check validates md against e. Errors wrap ErrUnknownEngine, ErrTPMismatch
// or ErrIncompatible and name both values.
func (e Expect) Check(md *Metadata) error {
	switch {
	case e.EngineID != "" && md.EngineID != e.EngineID:
		return fmt.Errorf("%w: peer is engine_id %q, want %q", ErrUnknownEngine, md.EngineID, e.EngineID)
	case md.TPRank != e.TPRank:
		return fmt.Errorf("%w: peer is tp_rank %d, want %d", ErrUnknownEngine, md.TPRank, e.TPRank)
	case e.TPSize != 0 && md.TPSize != e.TPSize:
		return fmt.Errorf("%w: peer %s has tp_size=%d, kv_transfer_params said tp_size=%d", ErrTPMismatch, md.AgentName, md.TPSize, e.TPSize)
	case e.ModelHash != nil && string(md.ModelHash) != string(e.ModelHash):
		if d := GeometryDiff(md.Geometry, e.Geometry); e.Geometry != nil && d != "" {
			return fmt.Errorf("%w: peer %s (model %q) and this rank (model %q) differ in %s", ErrIncompatible, md.AgentName,
				md.Geometry.GetModel(), e.Geometry.GetModel(), d)
		}
		return fmt.Errorf("%w: peer %s model hash %x differs from local %x (peer geometry %v)", ErrIncompatible, md.AgentName, md.ModelHash[:6], e.ModelHash[:6], md.Geometry)
	case e.NumRegions != 0 && len(md.Regions) != e.NumRegions:
		return fmt.Errorf("%w: peer %s has %d regions, local layout has %d (region layout: %s on the peer)", ErrIncompatible, md.AgentName,
			len(md.Regions), e.NumRegions, regionLayout(md.Regions))
	case e.Incarnation != 0 && md.Incarnation != e.Incarnation:
		return fmt.Errorf("%w: peer %s incarnation %#x, kv_transfer_params said %#x (the prefill restarted; its blocks are gone)", ErrUnknownEngine, md.AgentName, md.Incarnation, e.Incarnation)
	}
	if e.Layout != nil {
		if _, err := MatchLayout(Shapes(md.Regions), e.Layout, "peer "+md.AgentName, "this rank"); err != nil {
			return err
		}
	}
	if e.BlockLen != 0 {
		for i, r := range md.Regions {
			if r.BlockLen != e.BlockLen {
				return fmt.Errorf("%w: peer %s regions[%d].block_len=%d, the TP mapping needs %d", ErrIncompatible, md.AgentName, i, r.BlockLen, e.BlockLen)
			}
		}
	}
	return nil
}

// GeometryDiff names every field in which the geometries a peer and this
// rank announce differ, with both values ("block_size: peer 32, local 16;
// dtype: peer DTYPE_FLOAT16, local DTYPE_BFLOAT16"), in the order of the
// fields of ModelGeometry; "" when none does. The model name is not
// compared (ModelHash excludes it: two names of one geometry are
// compatible).
func GeometryDiff(peer, local *v1.ModelGeometry) string {
	return geometryDiff(peer, local, "peer", "local")
}

// geometryDiff is GeometryDiff with the two sides named pName and lName.
func geometryDiff(peer, local *v1.ModelGeometry, pName, lName string) string {
	var d []string
	add := func(field string, p, l any) {
		if p != l {
			d = append(d, fmt.Sprintf("%s: %s %v, %s %v", field, pName, p, lName, l))
		}
	}
	add("num_layers", peer.GetNumLayers(), local.GetNumLayers())
	add("num_kv_heads", peer.GetNumKvHeads(), local.GetNumKvHeads())
	add("head_dim", peer.GetHeadDim(), local.GetHeadDim())
	add("dtype", peer.GetDtype(), local.GetDtype())
	add("block_size", peer.GetBlockSize(), local.GetBlockSize())
	add("layout", peer.GetLayout(), local.GetLayout())
	add("attention", peer.GetAttention(), local.GetAttention())
	return strings.Join(d, "; ")
}

// regionLayout counts regions by kind: "32 K, 32 V, 0 compound".
func regionLayout(rs []Region) string {
	k, v, c := 0, 0, 0
	for _, r := range rs {
		switch r.Kind {
		case v1.RegionKind_REGION_KIND_K:
			k++
		case v1.RegionKind_REGION_KIND_V:
			v++
		case v1.RegionKind_REGION_KIND_COMPOUND:
			c++
		}
	}
	return fmt.Sprintf("%d K, %d V, %d compound", k, v, c)
}

var errNilLocal = errors.New("handshake: local metadata is nil")
