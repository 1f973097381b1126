package wire_test

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"testing"
	"testing/iotest"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protodelim"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/kvsidecar/kvsidecar/internal/wire"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// allMessages returns one populated instance of every message of the
// kvsidecar.v1 package, so a new message is covered without editing the test.
func allMessages(t testing.TB) []proto.Message {
	t.Helper()
	_ = v1.File_kvsidecar_v1_xfer_proto // make sure the package is linked
	var out []proto.Message
	protoregistry.GlobalTypes.RangeMessages(func(mt protoreflect.MessageType) bool {
		if mt.Descriptor().ParentFile().Package() != "kvsidecar.v1" {
			return true
		}
		m := mt.New()
		fill(m, 0)
		out = append(out, m.Interface())
		return true
	})
	require.GreaterOrEqual(t, len(out), 30, "kvsidecar.v1 messages found")
	return out
}

// fill sets every field of m to a non-default value (one element for lists),
// recursing into message fields up to a small depth.
func fill(m protoreflect.Message, depth int) {
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if oo := fd.ContainingOneof(); oo != nil && !oo.IsSynthetic() && oo.Fields().Get(0) != fd {
			continue // one member per oneof
		}
		switch {
		case fd.IsList():
			l := m.Mutable(fd).List()
			if fd.Kind() == protoreflect.MessageKind {
				if depth < 4 {
					e := l.NewElement()
					fill(e.Message(), depth+1)
					l.Append(e)
				}
			} else {
				l.Append(scalar(fd, i))
			}
		case fd.IsMap():
		case fd.Kind() == protoreflect.MessageKind:
			if depth < 4 {
				fill(m.Mutable(fd).Message(), depth+1)
			}
		default:
			m.Set(fd, scalar(fd, i))
		}
	}
}

func scalar(fd protoreflect.FieldDescriptor, i int) protoreflect.Value {
	n := int64(i + 1)
	switch fd.Kind() {
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(true)
	case protoreflect.EnumKind:
		vals := fd.Enum().Values()
		return protoreflect.ValueOfEnum(vals.Get(vals.Len() - 1).Number())
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return protoreflect.ValueOfInt32(int32(-n))
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return protoreflect.ValueOfInt64(-n << 40)
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return protoreflect.ValueOfUint32(uint32(n) << 20)
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return protoreflect.ValueOfUint64(uint64(n) << 50)
	case protoreflect.StringKind:
		return protoreflect.ValueOfString("s-" + string(fd.Name()))
	case protoreflect.BytesKind:
		return protoreflect.ValueOfBytes([]byte{0, byte(n), 0xff})
	case protoreflect.FloatKind:
		return protoreflect.ValueOfFloat32(float32(n) / 2)
	case protoreflect.DoubleKind:
		return protoreflect.ValueOfFloat64(float64(n) / 2)
	}
	panic("unhandled kind " + fd.Kind().String())
}

func TestRoundTripEveryMessage(t *testing.T) {
	msgs := allMessages(t)
	var stream bytes.Buffer
	for _, m := range msgs {
		require.NoError(t, wire.WriteMsg(&stream, m, 0), "%T", m)
	}
	// Raw payload bytes after the last frame must come out of Read intact.
	payload := bytes.Repeat([]byte{0xA5, 0x5A}, 100_000)
	stream.Write(payload)

	r := wire.NewReader(&stream, 0)
	for _, want := range msgs {
		got := want.ProtoReflect().New().Interface()
		require.NoError(t, r.ReadMsg(got), "%T", want)
		require.True(t, proto.Equal(want, got), "%T: got %v, want %v", want, got, want)
		if want.ProtoReflect().Descriptor().Fields().Len() > 0 {
			require.False(t, proto.Equal(got, got.ProtoReflect().New().Interface()), "%T was filled with non-default values", want)
		}
	}
	rest, err := io.ReadAll(r)
	require.NoError(t, err)
	require.Equal(t, payload, rest)
	require.ErrorIs(t, r.ReadMsg(&v1.Error{}), io.EOF)
}

func TestReadErrors(t *testing.T) {
	valid, err := wire.AppendFrame(nil, &v1.Error{Code: v1.Code_CODE_BUSY, Message: "busy"}, 0)
	require.NoError(t, err)

	tests := []struct {
		name    string
		in      []byte
		max     int
		wantIs  error
		wantMsg string
	}{
		{name: "huge length prefix", in: protowire.AppendVarint(nil, 1<<62), wantIs: wire.ErrFrameTooLarge,
			wantMsg: "wire: frame of 4611686018427387904 bytes exceeds the limit of 4194304 bytes"},
		{name: "over a small limit", in: valid, max: 3, wantIs: wire.ErrFrameTooLarge},
		{name: "truncated body", in: valid[:len(valid)-1], wantIs: io.ErrUnexpectedEOF},
		{name: "truncated varint", in: []byte{0x80}, wantIs: io.ErrUnexpectedEOF},
		{name: "empty stream", in: nil, wantIs: io.EOF},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := wire.NewReader(bytes.NewReader(tc.in), tc.max).ReadMsg(&v1.Error{})
			require.ErrorIs(t, err, tc.wantIs)
			if tc.wantMsg != "" {
				require.EqualError(t, err, tc.wantMsg)
			}
		})
	}

	t.Run("varint overflow", func(t *testing.T) {
		in := bytes.Repeat([]byte{0xff}, 11)
		err := wire.NewReader(bytes.NewReader(in), 0).ReadMsg(&v1.Error{})
		require.ErrorContains(t, err, "wire: bad frame length")
	})

	// A stream that fails while the length is read is an I/O error, not a
	// malformed frame (ctl printed "bad frame length: ... i/o timeout").
	t.Run("stream error", func(t *testing.T) {
		boom := errors.New("read unix: i/o timeout")
		err := wire.NewReader(iotest.ErrReader(boom), 0).ReadMsg(&v1.Error{})
		require.ErrorIs(t, err, boom)
		require.EqualError(t, err, "wire: read frame: read unix: i/o timeout")
	})

	t.Run("garbage body", func(t *testing.T) {
		in := append(protowire.AppendVarint(nil, 3), 0xff, 0xff, 0xff)
		err := wire.NewReader(bytes.NewReader(in), 0).ReadMsg(&v1.Error{})
		require.ErrorContains(t, err, "wire: bad frame")
	})
}

func TestWriteTooLarge(t *testing.T) {
	m := &v1.Error{Message: string(bytes.Repeat([]byte("x"), 100))}
	var buf bytes.Buffer
	err := wire.WriteMsg(&buf, m, 64)
	var se *wire.SizeError
	require.True(t, errors.As(err, &se))
	require.Equal(t, 64, se.Max)
	require.Equal(t, uint64(proto.Size(m)), se.Size)
	require.Zero(t, buf.Len(), "nothing written")
}

// FuzzFrame feeds arbitrary bytes to the frame reader: it must return an
// error or a message, never panic, and never allocate a declared size.
func FuzzFrame(f *testing.F) {
	for _, m := range allMessages(f) {
		b, err := wire.AppendFrame(nil, m, 0)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Add(protowire.AppendVarint(nil, 1<<62))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01})
	f.Fuzz(func(t *testing.T, in []byte) {
		r := wire.NewReader(bytes.NewReader(in), 1<<16)
		for range 8 {
			var m v1.PeerRequest
			if err := r.ReadMsg(&m); err != nil {
				return
			}
		}
	})
}

func TestProtodelimCompatible(t *testing.T) {
	m := &v1.Error{Code: v1.Code_CODE_TIMEOUT, Message: "late"}
	var buf bytes.Buffer
	_, err := protodelim.MarshalTo(&buf, m)
	require.NoError(t, err)
	var got v1.Error
	require.NoError(t, wire.NewReader(&buf, 0).ReadMsg(&got))
	require.True(t, proto.Equal(m, &got))

	b, err := wire.AppendFrame(nil, m, 0)
	require.NoError(t, err)
	var back v1.Error
	require.NoError(t, protodelim.UnmarshalFrom(bufio.NewReader(bytes.NewReader(b)), &back))
	require.True(t, proto.Equal(m, &back))
}

// A frame that claims the full limit but sends a few bytes costs memory
// in proportion to the bytes that came, not to the claim.
func TestClaimedSizeDoesNotAllocate(t *testing.T) {
	in := append(protowire.AppendVarint(nil, wire.DefaultMaxFrame), 1, 2, 3)
	var ms runtimeMem
	before := ms.heap()
	err := wire.NewReader(bytes.NewReader(in), 0).ReadMsg(&v1.PeerRequest{})
	require.ErrorIs(t, err, wire.ErrTruncated)
	require.Less(t, ms.heap()-before, uint64(1<<20), "heap grew by the claimed size")
}

func TestHugePrefixDoesNotAllocate(t *testing.T) {
	in := protowire.AppendVarint(nil, 1<<62)
	allocs := testing.AllocsPerRun(10, func() {
		r := wire.NewReader(bytes.NewReader(in), 0)
		_ = r.ReadMsg(&v1.PeerRequest{})
	})
	// The bufio buffer, the reader and the error; never the declared size.
	require.Less(t, allocs, 10.0)
	var ms runtimeMem
	before := ms.heap()
	r := wire.NewReader(bytes.NewReader(in), 0)
	require.ErrorIs(t, r.ReadMsg(&v1.PeerRequest{}), wire.ErrFrameTooLarge)
	require.Less(t, ms.heap()-before, uint64(1<<20), "heap grew by the declared size")
}

// TestReaderReset: a Reader moved to another stream forgets what it had
// buffered from the first, frame and raw bytes alike.
func TestReaderReset(t *testing.T) {
	frame := func(id uint64, tail string) *bytes.Reader {
		b, err := wire.AppendFrame(nil, &v1.XferStatus{Bytes: id}, 0)
		require.NoError(t, err)
		return bytes.NewReader(append(b, tail...))
	}
	r := wire.NewReader(frame(1, "left over"), 0)
	var st v1.XferStatus
	require.NoError(t, r.ReadMsg(&st))
	require.Equal(t, uint64(1), st.GetBytes())
	require.Equal(t, len("left over"), r.Buffered())

	r.Reset(frame(2, "xy"))
	require.Zero(t, r.Buffered())
	require.NoError(t, r.ReadMsg(&st))
	require.Equal(t, uint64(2), st.GetBytes())
	rest, err := io.ReadAll(r)
	require.NoError(t, err)
	require.Equal(t, "xy", string(rest))
}

// TestFramesAroundTheBuffer: frames that fit the read buffer are decoded in
// place, larger ones through a copy; back to back, each ends where the next
// begins, and a stream that fails inside a body is an I/O error.
func TestFramesAroundTheBuffer(t *testing.T) {
	small := &v1.Error{Code: v1.Code_CODE_BUSY, Message: "small"}
	large := &v1.Error{Code: v1.Code_CODE_INTERNAL, Message: string(bytes.Repeat([]byte("x"), 200<<10))}
	var in []byte
	for _, m := range []*v1.Error{small, large, small} {
		var err error
		in, err = wire.AppendFrame(in, m, 0)
		require.NoError(t, err)
	}
	r := wire.NewReader(bytes.NewReader(append(in, "tail"...)), 0)
	for i, want := range []*v1.Error{small, large, small} {
		var got v1.Error
		require.NoError(t, r.ReadMsg(&got), "frame %d", i)
		require.True(t, proto.Equal(want, &got), "frame %d", i)
	}
	rest, err := io.ReadAll(r)
	require.NoError(t, err)
	require.Equal(t, "tail", string(rest))

	boom := errors.New("stream reset")
	head := protowire.AppendVarint(nil, 100)
	err = wire.NewReader(io.MultiReader(bytes.NewReader(append(head, 1, 2)), iotest.ErrReader(boom)), 0).ReadMsg(&v1.Error{})
	require.ErrorIs(t, err, boom)
	require.ErrorContains(t, err, "wire: read frame: ")
}

// appendRaw appends field name of md with the raw bytes v as its
// length-delimited value, valid or not.
func appendRaw(b []byte, md protoreflect.MessageDescriptor, name string, v []byte) []byte {
	b = protowire.AppendTag(b, md.Fields().ByName(protoreflect.Name(name)).Number(), protowire.BytesType)
	return protowire.AppendBytes(b, v)
}

// TestBadFrameNamesTheField: a frame that does not decode, and a message
// that does not encode, name the first field at fault by its path from the
// message framed, through nested messages and the index of a repeated one;
// a well-formed field of another wire type than declared is an unknown
// field, no error.
func TestBadFrameNamesTheField(t *testing.T) {
	pd := (&v1.KVTransferParams{}).ProtoReflect().Descriptor()
	ed := (&v1.RankExport{}).ProtoReflect().Descriptor()
	good, err := proto.Marshal(&v1.RankExport{TpRank: 1, CapabilityKeyId: "k"})
	require.NoError(t, err)
	cut := appendRaw(nil, ed, "capability", []byte("0123456789"))
	decode := []struct {
		name, want string
		params     []byte
	}{
		{"a string that is not UTF-8", "field remote_engine_id: ", appendRaw(nil, pd, "remote_engine_id", []byte{0xff})},
		{"the second of a repeated message", "field rank_exports[1].capability_key_id: ",
			appendRaw(appendRaw(nil, pd, "rank_exports", good), pd, "rank_exports", appendRaw(nil, ed, "capability_key_id", []byte{'a', 0xfe}))},
		{"cut short inside a nested field", "field rank_exports[0].capability: ", appendRaw(nil, pd, "rank_exports", cut[:len(cut)-2])},
		{"packed numbers cut short", "field remote_block_ids: ", appendRaw(nil, pd, "remote_block_ids", []byte{1, 0x80})},
	}
	for _, tc := range decode {
		t.Run("decode "+tc.name, func(t *testing.T) {
			frame := protowire.AppendBytes(nil, tc.params)
			err := wire.NewReader(bytes.NewReader(frame), 0).ReadMsg(&v1.KVTransferParams{})
			require.ErrorContains(t, err, "wire: bad frame: "+tc.want)
		})
	}
	t.Run("another wire type", func(t *testing.T) {
		tp := pd.Fields().ByName("tp_size").Number()
		frame := protowire.AppendBytes(nil, protowire.AppendString(protowire.AppendTag(nil, tp, protowire.BytesType), "two"))
		var p v1.KVTransferParams
		require.NoError(t, wire.NewReader(bytes.NewReader(frame), 0).ReadMsg(&p))
		require.Nil(t, p.TpSize)
	})

	encode := []struct {
		name, want string
		m          proto.Message
	}{
		{"a string that is not UTF-8", "field remote_engine_id: ", &v1.KVTransferParams{TpSize: new(uint32(2)), RemoteEngineId: "\xff"}},
		{"the second of a repeated message", "field meta.params.rank_exports[1].capability_key_id: ",
			&v1.StartLoad{Meta: &v1.ReqMeta{RequestId: "r", Params: &v1.KVTransferParams{
				RankExports: []*v1.RankExport{{CapabilityKeyId: "ok"}, {TpRank: 1, CapabilityKeyId: "\xfe"}}}}}},
	}
	for _, tc := range encode {
		t.Run("encode "+tc.name, func(t *testing.T) {
			_, err := wire.AppendFrame(nil, tc.m, 0)
			require.ErrorContains(t, err, "wire: encode frame: "+tc.want)
		})
	}
}
