package transfer

import (
	"encoding/binary"
	"io"
	"sync"

	"google.golang.org/protobuf/proto"

	"github.com/kvsidecar/kvsidecar/internal/wire"
)

// readers keeps the 64 KiB frame readers of finished streams: a small READ
// would otherwise allocate (and zero) one on each side.
var readers = sync.Pool{New: func() any { return wire.NewReader(nil, 0) }}

// getReader returns a frame reader of str; putReader hands it back once
// nothing reads through it any more.
func getReader(str io.Reader) *wire.Reader {
	r := readers.Get().(*wire.Reader)
	r.Reset(str)
	return r
}

func putReader(r *wire.Reader) {
	r.Reset(nil)
	readers.Put(r)
}

// gatherMax is the most a READ's bytes are gathered into before one stream
// write. A decode rank that holds some of a block's heads reads one slice
// of a few KiB per block per region: written one by one, each was a
// quic-go Stream.Write of its own (a lock and a wake-up of the send loop),
// which capped such loads near 0.17 GB/s where 16 KiB slices reached 0.38;
// and a small READ's status header, bytes and final status leave in one
// write, so its reader wakes once. Slices of at least gatherMax go out
// directly, without a copy.
const gatherMax = 256 << 10

// gatherBufs keeps the gather buffers.
var gatherBufs = sync.Pool{New: func() any {
	b := make([]byte, 0, gatherMax)
	return &b
}}

// gatherWriter writes a READ's frames and bytes to its stream, gathering
// frames and slices smaller than gatherMax into one write; sent and the
// watchdog count payload bytes (not frames) as they reach the stream.
// flush writes what is gathered; release hands the buffer back.
type gatherWriter struct {
	w       io.Writer
	bp      *[]byte
	payload int // bytes of *bp that are payload
	sent    *uint64
	wd      *watchdog
}

func newGatherWriter(w io.Writer, sent *uint64, wd *watchdog) *gatherWriter {
	return &gatherWriter{w: w, bp: gatherBufs.Get().(*[]byte), sent: sent, wd: wd}
}

// write gathers payload p, or writes it straight when it is gatherMax or
// more.
func (g *gatherWriter) write(p []byte) error {
	if len(p) >= gatherMax {
		if err := g.flush(); err != nil {
			return err
		}
		return writeChunks(g.w, p, g.sent, g.wd)
	}
	if len(*g.bp)+len(p) > gatherMax {
		if err := g.flush(); err != nil {
			return err
		}
	}
	*g.bp = append(*g.bp, p...)
	g.payload += len(p)
	return nil
}

// frame gathers one protocol frame of m.
func (g *gatherWriter) frame(m proto.Message) error {
	if len(*g.bp) > 0 && len(*g.bp)+proto.Size(m)+binary.MaxVarintLen64 > gatherMax {
		if err := g.flush(); err != nil {
			return err
		}
	}
	b, err := wire.AppendFrame(*g.bp, m, 0)
	if err != nil {
		return err
	}
	*g.bp = b
	return nil
}

// flush writes what is gathered.
func (g *gatherWriter) flush() error {
	if len(*g.bp) == 0 {
		return nil
	}
	_, err := g.w.Write(*g.bp)
	if err == nil && g.payload > 0 {
		*g.sent += uint64(g.payload)
		g.wd.progress(g.payload)
	}
	*g.bp, g.payload = (*g.bp)[:0], 0
	return err
}

func (g *gatherWriter) release() {
	*g.bp = (*g.bp)[:0]
	gatherBufs.Put(g.bp)
}
