package transfer

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"testing/iotest"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

func TestCapability(t *testing.T) {
	k := NewCapabilityKey()
	good := k.Issue("req-1", 7, 3, 3, 1000000)
	tampered := bytes.Clone(good)
	tampered[2]++ // first delta: claims other blocks
	tests := []struct {
		name   string
		cap    []byte
		req    string
		blocks []uint32
		want   error
	}{
		{"covered subset", good, "req-1", []uint32{3, 1000000}, nil},
		{"no blocks", good, "req-1", nil, nil},
		{"uncovered block", good, "req-1", []uint32{3, 4}, ErrCapabilityDenied},
		{"other request", good, "req-2", []uint32{3}, ErrCapabilityDenied},
		{"other key", NewCapabilityKey().Issue("req-1", 3), "req-1", []uint32{3}, ErrCapabilityDenied},
		{"tampered block list", tampered, "req-1", []uint32{3}, ErrCapabilityDenied},
		{"truncated", good[:len(good)-1], "req-1", []uint32{3}, ErrCapabilityDenied},
		{"empty", nil, "req-1", []uint32{3}, ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := k.Verify(tt.cap, tt.req, tt.blocks)
			if tt.want == nil {
				require.NoError(t, err)
				return
			}
			if tt.name == "truncated" {
				// Truncation breaks either the encoding or the tag.
				require.True(t, errors.Is(err, ErrCapabilityDenied) || errors.Is(err, ErrInvalidArgument), "got %v", err)
				return
			}
			require.ErrorIs(t, err, tt.want)
		})
	}
}

func TestWatchdog(t *testing.T) {
	tests := []struct {
		name      string
		steps     []time.Duration // sleep, then report progress
		wantStall time.Duration   // 0: no stall before stop
	}{
		{"stalls one interval after start", nil, time.Second},
		{"progress pushes the deadline", []time.Duration{600 * time.Millisecond, 600 * time.Millisecond}, 2200 * time.Millisecond},
		{"steady progress never stalls", []time.Duration{900 * time.Millisecond, 900 * time.Millisecond, 900 * time.Millisecond}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				start := time.Now()
				var stalledAt time.Duration
				w := startWatchdog(time.Second, func() { stalledAt = time.Since(start) })
				for _, d := range tt.steps {
					time.Sleep(d)
					w.progress(1)
				}
				if tt.wantStall == 0 {
					w.stop()
					require.Zero(t, stalledAt)
					return
				}
				time.Sleep(5 * time.Second)
				synctest.Wait()
				w.stop()
				require.Equal(t, tt.wantStall, stalledAt)
			})
		})
	}
}

func TestBudget(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := newBudget(100)
		never := make(chan struct{})
		noCause := func() error { return nil }
		require.NoError(t, b.acquire(never, noCause, 60))
		got := make(chan uint64, 2)
		go func() {
			_ = b.acquire(never, noCause, 50)
			got <- 50
		}()
		synctest.Wait()
		require.Empty(t, got, "60+50 exceeds 100: must wait")
		b.release(60)
		synctest.Wait()
		require.Equal(t, uint64(50), <-got)
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		// 50 held + 90 exceeds 100: waits until the deadline.
		err := b.acquire(ctx.Done(), func() error { return context.Cause(ctx) }, 90)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		b.release(50)
		require.NoError(t, b.acquire(never, noCause, 500), "a request larger than the bound runs alone")
		require.Equal(t, uint64(500), b.used)
	})
}

func TestConfigValidate(t *testing.T) {
	srv, _ := testTLS(t)
	noCA := srv.Clone()
	noCA.ClientCAs = nil
	tests := []struct {
		name string
		cfg  *Config
		want string
	}{
		{"nil config", nil, ""},
		{"negative progress timeout", &Config{ProgressTimeout: -1}, "ProgressTimeout"},
		{"tiny staging", &Config{StagingBytes: 10}, "StagingBytes"},
		{"conn window below stream window", &Config{MaxStreamWindow: 1 << 20, MaxConnWindow: 1 << 19}, "MaxConnWindow"},
		{"server without client CAs", &Config{ServerTLS: noCA}, "ClientCAs"},
		{"region of zero length", &Config{Regions: []Region{{Base: 4096, Mem: SliceMemory(nil)}}}, "Len must be > 0"},
		{"overflowing region", &Config{Regions: []Region{{Base: math.MaxUint64, Len: 2, Mem: SliceMemory(nil)}}}, "overflows"},
		{"negative prepared bound", &Config{MaxPreparedDescsPerConn: -1}, "Config.MaxPreparedDescsPerConn -1 must be >= 1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.withDefaults().validate()
			if tt.want == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tt.want)
		})
	}
}

func TestRegisterRejectsOverlap(t *testing.T) {
	a, err := New(nil)
	require.NoError(t, err)
	defer a.Close()
	mem := mmapRegion(t, 1<<16)
	require.NoError(t, a.Register(SliceRegion(mem, 0, 0)))
	err = a.Register(SliceRegion(mem[4096:8192], 0, 0))
	require.ErrorContains(t, err, "overlaps")
}

// fuzzAgent is an agent-less serving half for decoder fuzzing: one 1 MiB
// region at 1 MiB with 64 KiB blocks, and a prepared list.
func fuzzAgent() (*server, *servedConn) {
	a := &server{core: &core{cfg: (&Config{}).withDefaults()}}
	a.regions = regionSet{{Base: 1 << 20, Len: 1 << 20, BlockLen: 64 << 10, Mem: SliceMemory(make([]byte, 1<<20))}}
	sc := &servedConn{budget: newBudget(1 << 30), dlists: map[uint64][]span{}}
	_ = a.prepare(sc, &v1.PrepDescList{DlistId: 1, Descs: descsToProto([]Desc{{Addr: 1 << 20, Len: 4096}})})
	return a, sc
}

func frame(tb testing.TB, m *v1.PeerRequest) []byte {
	b, err := wire.AppendFrame(nil, m, 0)
	require.NoError(tb, err)
	return b
}

// FuzzPeerRequest decodes a request frame as the serving side does and runs
// the descriptor checks of prepared lists, explicit lists and indices.
func FuzzPeerRequest(f *testing.F) {
	v := v1.WireVersion_WIRE_VERSION_1
	f.Add(frame(f, &v1.PeerRequest{WireVersion: v, Body: &v1.PeerRequest_Xfer{Xfer: &v1.XferRequest{Op: v1.XferOp_XFER_OP_READ,
		Descs: &v1.XferRequest_List{List: descsToProto([]Desc{{Addr: 1 << 20, Len: 8192}})}, TotalLen: 8192}}}))
	f.Add(frame(f, &v1.PeerRequest{WireVersion: v, Body: &v1.PeerRequest_Xfer{Xfer: &v1.XferRequest{Op: v1.XferOp_XFER_OP_WRITE,
		Descs: &v1.XferRequest_Indexed{Indexed: &v1.IndexedDescs{DlistId: 1, Indices: []uint32{0, 0, 5}}}}}}))
	f.Add(frame(f, &v1.PeerRequest{WireVersion: v, Body: &v1.PeerRequest_Prep{Prep: &v1.PrepDescList{DlistId: 2,
		Descs: descsToProto([]Desc{{Addr: 1<<20 + 4096, Len: 1 << 19}, {Addr: math.MaxUint64, Len: 2}})}}}))
	f.Add(frame(f, &v1.PeerRequest{WireVersion: v, Body: &v1.PeerRequest_Unprep{Unprep: &v1.UnprepDescList{DlistId: 1}}}))
	f.Add(frame(f, &v1.PeerRequest{WireVersion: v, Body: &v1.PeerRequest_Notification{Notification: &v1.Notification{RequestId: "r", Payload: []byte("x")}}}))
	f.Fuzz(func(t *testing.T, data []byte) {
		a, sc := fuzzAgent()
		var req v1.PeerRequest
		if err := wire.NewReader(bytes.NewReader(data), 1<<16).ReadMsg(&req); err != nil {
			return
		}
		switch body := req.GetBody().(type) {
		case *v1.PeerRequest_Prep:
			before := sc.prepared
			if a.prepare(sc, body.Prep) == nil {
				require.Equal(t, before+len(body.Prep.GetDescs().GetDescs()), sc.prepared)
			}
		case *v1.PeerRequest_Unprep:
			err := a.unprepare(sc, body.Unprep)
			if body.Unprep.GetDlistId() == 1 {
				require.NoError(t, err, "list 1 is prepared by fuzzAgent")
				require.Zero(t, sc.prepared)
			} else {
				require.ErrorIs(t, err, ErrNotFound)
			}
		case *v1.PeerRequest_Notification:
			require.ErrorIs(t, a.notify(context.Background(), sc, body.Notification), func() error {
				if body.Notification.GetRequestId() == "" {
					return ErrInvalidArgument
				}
				return ErrNotFound
			}())
		case *v1.PeerRequest_Xfer:
			spans, total, err := a.servedSpans(sc, body.Xfer, nil)
			if err != nil {
				return
			}
			var sum uint64
			for _, s := range spans {
				require.NotZero(t, s.n)
				require.LessOrEqual(t, s.off+s.n, s.reg.Len, "span leaves its region")
				sum += s.n
			}
			require.Equal(t, sum, total)
			ids, err := blockIDs(spans)
			require.NoError(t, err, "16 blocks are far below the limit")
			for _, id := range ids {
				require.Less(t, id, uint32(16))
			}
		}
	})
}

// FuzzPeerResponse decodes a response frame (READ header and final status,
// WRITE ack, notification ack) as the dialing side does.
func FuzzPeerResponse(f *testing.F) {
	for _, m := range []*v1.PeerResponse{
		{Body: &v1.PeerResponse_Xfer{Xfer: &v1.XferStatus{Bytes: 4096, Checksums: []uint32{1, 2}}}},
		{Body: &v1.PeerResponse_Xfer{Xfer: &v1.XferStatus{Error: &v1.Error{Code: v1.Code_CODE_OUT_OF_RANGE, Message: "x"}}}},
		{Body: &v1.PeerResponse_Notification{Notification: &v1.NotificationAck{Error: &v1.Error{Code: v1.Code_CODE_NOT_FOUND}}}},
	} {
		b, err := wire.AppendFrame(nil, m, 0)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var resp v1.PeerResponse
		if err := wire.NewReader(bytes.NewReader(data), 1<<16).ReadMsg(&resp); err != nil {
			return
		}
		st := resp.GetXfer()
		err := compareChecksums(st.GetChecksums(), []uint32{1, 2})
		if len(st.GetChecksums()) != 2 {
			require.ErrorIs(t, err, ErrDataLoss)
		}
		_ = resp.GetNotification().GetError().GetCode().String()
	})
}

// FuzzCapability decodes arbitrary tokens: no panic, and no allocation
// beyond one block id per input byte.
func FuzzCapability(f *testing.F) {
	k := NewCapabilityKey()
	f.Add(k.Issue("r", 1, 2, 3))
	f.Add(k.Issue("r"))
	f.Add([]byte{1, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, data []byte) {
		ids, err := decodeCapability(data)
		if err != nil {
			return
		}
		require.LessOrEqual(t, len(ids), len(data))
		for i := 1; i < len(ids); i++ {
			require.Less(t, ids[i-1], ids[i])
		}
		require.Error(t, k.Verify(data, "other-request", nil), "a decodable token must still fail its tag")
	})
}

func TestQlog(t *testing.T) {
	dir := t.TempDir()
	srv := startAgent(t, Config{QlogDir: dir})
	cli := startAgent(t, Config{})
	_, err := cli.Handshake(t.Context(), srv.Addr().String(), &v1.HandshakeRequest{})
	require.NoError(t, err)
	require.NoError(t, srv.Close())
	files, err := filepath.Glob(filepath.Join(dir, "*_server.sqlog"))
	require.NoError(t, err)
	require.Len(t, files, 1)
	b, err := os.ReadFile(files[0])
	require.NoError(t, err)
	require.Contains(t, string(b), "quic-14")
}

func TestBlockIDs(t *testing.T) {
	contig := &Region{Len: 1 << 20, BlockLen: 4096}
	// 4 blocks of 1000 bytes per 4096-byte page, 96 bytes of padding.
	padded := &Region{Len: 1 << 20, BlockLen: 1000, PageSize: 4096}
	tests := []struct {
		name  string
		spans []span
		want  []uint32
	}{
		{"one block", []span{{reg: contig, off: 4096, n: 4096}}, []uint32{1}},
		{"straddles two", []span{{reg: contig, off: 4095, n: 2}}, []uint32{0, 1}},
		{"dedup across spans", []span{{reg: contig, off: 0, n: 10}, {reg: contig, off: 5, n: 10}, {reg: contig, off: 8192, n: 1}}, []uint32{0, 2}},
		{"padded: second page first block", []span{{reg: padded, off: 4096, n: 1000}}, []uint32{4}},
		{"padded: last block and padding", []span{{reg: padded, off: 3000, n: 1096}}, []uint32{3}},
		{"padded: whole second page", []span{{reg: padded, off: 4096, n: 4096}}, []uint32{4, 5, 6, 7}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ids, err := blockIDs(tt.spans)
			require.NoError(t, err)
			require.Equal(t, tt.want, ids)
		})
	}
}

func TestBlockIDsBounded(t *testing.T) {
	// Regions are never touched here: only their geometry counts.
	bytewise := &Region{Len: 1 << 40, BlockLen: 1}
	tests := []struct {
		name    string
		spans   []span
		want    error
		wantMsg string
		wantN   int
	}{
		{"exactly the limit", []span{{reg: bytewise, off: 0, n: MaxBlocksPerTransfer}}, nil, "", MaxBlocksPerTransfer},
		{"duplicates count before merging", []span{{reg: bytewise, off: 0, n: MaxBlocksPerTransfer}, {reg: bytewise, off: 0, n: 1}}, ErrInvalidArgument,
			"descriptors touch 1048577 blocks, more than the limit of 1048576 per transfer", 0},
		{"whole region", []span{{reg: bytewise, off: 0, n: 1 << 32}}, ErrInvalidArgument, "4294967296 blocks", 0},
		{"65536 whole-region spans", slices.Repeat([]span{{reg: bytewise, off: 0, n: 1 << 32}}, 1<<16), ErrInvalidArgument, "281474976710656 blocks", 0},
		{"block id beyond uint32", []span{{reg: bytewise, off: 1 << 32, n: 1}}, ErrOutOfRange, "descriptor 0 reaches block 4294967296", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ids, err := blockIDs(tt.spans)
			if tt.want == nil {
				require.NoError(t, err)
				require.Len(t, ids, tt.wantN)
				require.Equal(t, uint32(tt.wantN-1), ids[len(ids)-1])
				return
			}
			require.ErrorIs(t, err, tt.want)
			require.ErrorContains(t, err, tt.wantMsg)
			require.Nil(t, ids)
		})
	}
}

func TestCapabilityKeyFromSecret(t *testing.T) {
	secret := []byte("0123456789abcdef-shared")
	a, b := NewCapabilityKeyFromSecret(secret), NewCapabilityKeyFromSecret(secret)
	require.NoError(t, b.Verify(a.Issue("r", 4), "r", []uint32{4}), "ranks sharing a secret verify each other")
	require.ErrorIs(t, NewCapabilityKeyFromSecret([]byte("another-secret-16b")).Verify(a.Issue("r", 4), "r", []uint32{4}), ErrCapabilityDenied)

	// The key id: the same for one secret in every process, another for
	// another secret, 16 hex digits that reveal nothing of the key.
	require.Equal(t, a.ID(), b.ID())
	require.Regexp(t, "^[0-9a-f]{16}$", a.ID())
	require.NotEqual(t, a.ID(), NewCapabilityKeyFromSecret([]byte("another-secret-16b")).ID())
	require.NotContains(t, a.ID(), hex.EncodeToString(secret)[:8])
	// A fixed vector, so the id an operator compares never changes across
	// releases: HMAC-SHA256(secret, "kvsidecar capability key id v1")[:8].
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte("kvsidecar capability key id v1"))
	require.Equal(t, hex.EncodeToString(mac.Sum(nil)[:8]), a.ID())
}

// recordingWriter records the size of every Write; it fails once failAfter
// writes succeeded (failAfter < 0: never).
type recordingWriter struct {
	sizes     []int
	failAfter int
}

var errWriteRefused = errors.New("write refused")

func (w *recordingWriter) Write(b []byte) (int, error) {
	if w.failAfter >= 0 && len(w.sizes) == w.failAfter {
		return 0, errWriteRefused
	}
	w.sizes = append(w.sizes, len(b))
	return len(b), nil
}

func TestWriteChunks(t *testing.T) {
	tests := []struct {
		name      string
		n         int
		failAfter int
		want      error
		wantSizes []int
		wantSent  uint64
	}{
		{"below one chunk", 4096, -1, nil, []int{4096}, 4096},
		{"two and a half chunks", 5 * writeChunk / 2, -1, nil, []int{writeChunk, writeChunk, writeChunk / 2}, 5 * writeChunk / 2},
		{"fails on the second write", 3 * writeChunk, 1, errWriteRefused, []int{writeChunk}, writeChunk},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := &recordingWriter{failAfter: tt.failAfter}
			wd := startWatchdog(0, nil)
			var sent uint64
			err := writeChunks(w, make([]byte, tt.n), &sent, wd)
			require.ErrorIs(t, err, tt.want)
			require.Equal(t, tt.wantSizes, w.sizes)
			require.Equal(t, tt.wantSent, sent, "sent counts only bytes the writer took")
		})
	}
}

func TestReadFull(t *testing.T) {
	errReset := errors.New("stream reset")
	data := bytes.Repeat([]byte{7}, 100)
	tests := []struct {
		name    string
		r       io.Reader
		want    error
		wantMsg string
		wantGot uint64
	}{
		{"all bytes", bytes.NewReader(data), nil, "", 100},
		{"all bytes, EOF with the last", iotest.DataErrReader(bytes.NewReader(data)), nil, "", 100},
		{"one byte at a time", iotest.OneByteReader(bytes.NewReader(data)), nil, "", 100},
		{"peer closes early", bytes.NewReader(data[:60]), ErrDataLoss, "stream ended after 60 bytes, 40 bytes short", 60},
		{"peer closes at once", bytes.NewReader(nil), ErrDataLoss, "stream ended after 0 bytes, 100 bytes short", 0},
		{"reset mid-data", io.MultiReader(bytes.NewReader(data[:30]), iotest.ErrReader(errReset)), errReset, "stream reset", 30},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := make([]byte, len(data))
			var got uint64
			err := readFull(tt.r, b, &got, startWatchdog(0, nil))
			require.Equal(t, tt.wantGot, got)
			if tt.want == nil {
				require.NoError(t, err)
				require.Equal(t, data, b)
				return
			}
			require.ErrorIs(t, err, tt.want)
			require.ErrorContains(t, err, tt.wantMsg)
		})
	}
}

func TestResolveUDP(t *testing.T) {
	tests := []struct {
		name string
		addr string
		want string
		err  error
	}{
		{"IPv4 literal", "127.0.0.1:4791", "127.0.0.1:4791", nil},
		{"IPv6 literal", "[::1]:5", "[::1]:5", nil},
		{"localhost prefers IPv4", "localhost:7", "127.0.0.1:7", nil},
		{"no port", "127.0.0.1", "", ErrInvalidArgument},
		{"no host", ":4791", "", ErrInvalidArgument},
		{"bad port", "127.0.0.1:notaport", "", ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := resolveUDP(context.Background(), tt.addr)
			if tt.err != nil {
				require.ErrorIs(t, err, tt.err)
				require.ErrorContains(t, err, tt.addr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, got.String())
		})
	}
	t.Run("cancelled lookup", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err := resolveUDP(ctx, "kvsidecar-peer.example:4791")
		require.Error(t, err, "a name is not resolved under a cancelled context")
	})
}

func TestMergeSpans(t *testing.T) {
	a, b := &Region{Len: 1 << 20}, &Region{Len: 1 << 20}
	got := mergeSpans([]span{
		{reg: a, off: 0, n: 10, at: 0}, {reg: a, off: 10, n: 10, at: 10}, // continues: merged
		{reg: b, off: 20, n: 10, at: 20}, // another region
		{reg: b, off: 40, n: 10, at: 30}, // a gap in the region
		{reg: b, off: 50, n: 5, at: 40},  // continues the one before
	})
	require.Equal(t, []span{{reg: a, off: 0, n: 20, at: 0}, {reg: b, off: 20, n: 10, at: 20}, {reg: b, off: 40, n: 15, at: 30}}, got)
}

func TestDefaultReadLanes(t *testing.T) {
	for ncpu, want := range map[int]int{0: 1, 1: 1, 2: 2, 3: 3, 4: 4, 16: 4, 128: 4} {
		require.Equal(t, want, DefaultReadLanes(ncpu), "%d CPUs", ncpu)
	}
}
