package transfer

import (
	"io"
	"sync"

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

// smallRead is the largest READ the server hands to quic-go in one write:
// status header, bytes and final status, so they leave in as few packets as
// the bytes need and the reader wakes once, at the price of one copy of at
// most this many bytes.
const smallRead = 64 << 10

// smallBufs keeps the buffers of those writes.
var smallBufs = sync.Pool{New: func() any {
	b := make([]byte, 0, smallRead+1024)
	return &b
}}

// gatherMax is the most a READ's small slices are gathered into before one
// stream write. A decode rank that holds some of a block's heads reads one
// slice of a few KiB per block per region: written one by one, each was a
// quic-go Stream.Write of its own (a lock and a wake-up of the send loop),
// which capped such loads near 0.17 GB/s where 16 KiB slices reached 0.38.
// Slices of at least gatherMax go out directly, without a copy.
const gatherMax = 256 << 10

// gatherBufs keeps the gather buffers.
var gatherBufs = sync.Pool{New: func() any {
	b := make([]byte, 0, gatherMax)
	return &b
}}

// gatherWriter writes a READ's bytes to its stream, gathering slices
// smaller than gatherMax into one write; sent and the watchdog count bytes
// as they reach the stream. flush writes what is gathered; release hands
// the buffer back.
type gatherWriter struct {
	w    io.Writer
	bp   *[]byte
	sent *uint64
	wd   *watchdog
}

func newGatherWriter(w io.Writer, sent *uint64, wd *watchdog) *gatherWriter {
	return &gatherWriter{w: w, bp: gatherBufs.Get().(*[]byte), sent: sent, wd: wd}
}

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
	return nil
}

func (g *gatherWriter) flush() error {
	if len(*g.bp) == 0 {
		return nil
	}
	err := writeChunks(g.w, *g.bp, g.sent, g.wd)
	*g.bp = (*g.bp)[:0]
	return err
}

func (g *gatherWriter) release() {
	*g.bp = (*g.bp)[:0]
	gatherBufs.Put(g.bp)
}
