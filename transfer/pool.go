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
