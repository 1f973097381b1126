package transfer

import (
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// asyncMemory is device-like memory (HostBytes refuses) whose asynchronous
// copies are only queued and run, in order, when a wait is called for them
// or a later one, as a GPU stream runs them: a transfer that reads a
// staging buffer, or returns, before waiting sees stale bytes.
type asyncMemory struct {
	mem []byte
	q   *copyQueue
}

// copyQueue is the one in-order stream of several regions' copies.
type copyQueue struct {
	mu      sync.Mutex
	pending []func()
	done    int // copies run
	started int
	// aheadAtWait counts waits that found copies queued after the one
	// waited for: the next buffer's copies overlapped this one's use.
	aheadAtWait int
	waits       int
	pinned      int // host buffers out
}

func (m asyncMemory) HostBytes(uint64, uint64) ([]byte, error) {
	return nil, errors.New("device memory is not host-addressable")
}
func (m asyncMemory) CopyOut(off uint64, dst []byte) error {
	return SliceMemory(m.mem).CopyOut(off, dst)
}
func (m asyncMemory) CopyIn(off uint64, src []byte) error { return SliceMemory(m.mem).CopyIn(off, src) }

func (m asyncMemory) HostBuffer(n int) ([]byte, func() error, error) {
	m.q.mu.Lock()
	m.q.pinned++
	m.q.mu.Unlock()
	return make([]byte, n), func() error {
		m.q.mu.Lock()
		m.q.pinned--
		m.q.mu.Unlock()
		return nil
	}, nil
}

func (m asyncMemory) queue(op func()) func() error {
	q := m.q
	q.mu.Lock()
	defer q.mu.Unlock()
	q.pending = append(q.pending, op)
	q.started++
	upto := q.started
	return func() error {
		q.mu.Lock()
		defer q.mu.Unlock()
		q.waits++
		if q.started > upto {
			q.aheadAtWait++
		}
		for q.done < upto {
			q.pending[0]()
			q.pending = q.pending[1:]
			q.done++
		}
		return nil
	}
}

func (m asyncMemory) CopyOutAsync(off uint64, dst []byte) (func() error, error) {
	if off+uint64(len(dst)) > uint64(len(m.mem)) {
		return nil, errors.New("out of range")
	}
	return m.queue(func() { copy(dst, m.mem[off:]) }), nil
}

func (m asyncMemory) CopyInAsync(off uint64, src []byte) (func() error, error) {
	if off+uint64(len(src)) > uint64(len(m.mem)) {
		return nil, errors.New("out of range")
	}
	return m.queue(func() { copy(m.mem[off:], src) }), nil
}

// snapshot returns a copy of the queue's counts, read under its lock.
func (q *copyQueue) snapshot() copyQueue {
	q.mu.Lock()
	defer q.mu.Unlock()
	return copyQueue{done: q.done, started: q.started, aheadAtWait: q.aheadAtWait, waits: q.waits, pinned: q.pinned}
}

// TestStagedCopiesOverlapAndPack: device memory on both sides of a READ
// and of a WRITE of strided 4 KiB descriptors is staged through two
// page-locked buffers: many descriptors share one buffer and one wait,
// descriptors back to back are one copy per buffer, the next buffer's
// copies are queued while the current one is used, every
// byte arrives, and no copy is left queued or buffer held when Transfer
// returns.
//
// fault-matrix: device-staging
func TestStagedCopiesOverlapAndPack(t *testing.T) {
	const size, piece = 4 << 20, 4 << 10
	srcQ, dstQ := &copyQueue{}, &copyQueue{}
	src := asyncMemory{mem: make([]byte, size), q: srcQ}
	dst := asyncMemory{mem: make([]byte, size), q: dstQ}
	fill(src.mem, 3)
	srvReg := Region{Base: 1 << 40, Len: size, Mem: src}
	cliReg := Region{Base: 2 << 40, Len: size, Mem: dst}
	released := make(chan struct{}, 2) // the serving side is done with a transfer's memory
	srv := startAgent(t, Config{Regions: []Region{srvReg}, Authorize: allowAll, StagingBytes: 256 << 10,
		Release: func(*Access) { released <- struct{}{} }})
	cli := startAgent(t, Config{Regions: []Region{cliReg}, StagingBytes: 256 << 10})
	// Every other 4 KiB of the source, packed back to back locally.
	var remote, local []Desc
	for i := range uint64(size / piece / 2) {
		remote = append(remote, Desc{Addr: srvReg.Base + 2*i*piece, Len: piece})
		local = append(local, Desc{Addr: cliReg.Base + i*piece, Len: piece})
	}
	_, err := cli.Transfer(t.Context(), &Xfer{Op: OpRead, Peer: srv.Addr().String(), RequestID: "r", Local: local, Remote: remote})
	require.NoError(t, err)
	<-released
	for i := range size / piece / 2 {
		require.Equal(t, src.mem[2*i*piece:(2*i+1)*piece], dst.mem[i*piece:(i+1)*piece], "piece %d", i)
	}
	// The serving side copies each strided descriptor; the reader's
	// descriptors lie back to back and land as one run, one copy per
	// staging buffer.
	copies := map[string]int{"serving": len(remote), "reading": size / 2 / (256 << 10)}
	for name, qp := range map[string]*copyQueue{"serving": srcQ, "reading": dstQ} {
		q := qp.snapshot()
		require.Equal(t, q.started, q.done, "%s side: every copy ran before the transfer returned", name)
		require.Equal(t, copies[name], q.started, "%s side: copies", name)
		require.Less(t, q.waits, len(remote)/16, "%s side: many descriptors share a buffer and a wait", name)
		require.Positive(t, q.aheadAtWait, "%s side: the next buffer's copies ran while one was used", name)
		require.Zero(t, q.pinned, "%s side: the staging buffers went back", name)
	}

	// A WRITE back, from the reader's device memory into the server's.
	clear(src.mem)
	_, err = cli.Transfer(t.Context(), &Xfer{Op: OpWrite, Peer: srv.Addr().String(), RequestID: "w", Local: local, Remote: remote})
	require.NoError(t, err)
	<-released // a WRITE is acknowledged once its bytes are in memory, then released
	for i := range size / piece / 2 {
		require.Equal(t, dst.mem[i*piece:(i+1)*piece], src.mem[2*i*piece:(2*i+1)*piece], "piece %d", i)
	}
	for _, qp := range []*copyQueue{srcQ, dstQ} {
		q := qp.snapshot()
		require.Equal(t, q.started, q.done)
		require.Zero(t, q.pinned)
	}
}
