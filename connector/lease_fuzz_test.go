package connector

import (
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/transfer"
)

// FuzzLeaseTable is the property test of the lease tables of two ranks: a
// random sequence of exports, READs, notifications, heartbeats, READ ends
// and clock steps, with request ids and blocks reused
// and export ids that collide across the ranks (each rank numbers its own),
// where every message names an export through params issued earlier, stale
// or live, presented to its own rank or the other one. The serving checks
// are those of Rank.authorize and onNotification: the export's capability
// (rank-bound) and its blocks. Properties:
//
//   - a READ that is allowed reads only blocks holding its own export's
//     bytes (each block is tagged with the rank and export that wrote it);
//   - a lease is freed only with no READ open on it, and frees only blocks
//     still tagged with its own export;
//   - a notification that releases a lease releases its own export's, and
//     one for an ended export is acknowledged only as a resend of a
//     consumer that had notified it;
//   - a heartbeat extends only its own, live export.
//
// fault-matrix: stale-reused-request-id
func FuzzLeaseTable(f *testing.F) {
	// Seeds: export A on rank 0 then read, notify, re-export A over the
	// same block, read and notify with the stale params; a foreign-rank
	// read with a colliding export id; expiry while a READ is open;
	// heartbeats; duplicate notifications.
	f.Add([]byte{0, 0, 0, 1, 0, 1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 1, 1, 0, 0, 2, 0, 1})
	f.Add([]byte{0, 0, 0, 2, 0, 1, 0, 1, 0, 1, 0, 2, 1, 0, 1, 2, 1, 1, 0, 2, 0, 0})
	f.Add([]byte{0, 0, 1, 3, 1, 1, 2, 0, 1, 0, 3, 5, 10, 5, 30, 4, 0, 2, 0, 0, 0})
	f.Add([]byte{0, 0, 0, 2, 3, 0, 5, 9, 3, 0, 2, 0, 0, 2, 0, 0, 2, 0, 1, 0, 1, 0, 0, 1, 2})
	f.Add([]byte{0, 1, 2, 4, 0, 0, 2, 1, 1, 0, 1, 1, 2, 1, 0, 4, 0, 0, 1, 3, 0, 1, 0, 0})
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) > 512 {
			return
		}
		synctest.Test(t, func(t *testing.T) { runLeaseModel(t, ops) })
	})
}

// tag names the export whose bytes a block holds (rank, export id); the
// zero tag is a free block.
type tag struct {
	rank   int
	export uint64
}

// issued is one set of params a decode may present, stale or not.
type issued struct {
	id     string
	rank   int
	export uint64
	blocks []uint32 // token order
	cap    []byte
}

const (
	modelRanks  = 2
	modelBlocks = 8 // block ids 1..7 on each rank
	modelTTL    = 10 * time.Second
)

func runLeaseModel(t *testing.T, ops []byte) {
	key := transfer.NewCapabilityKeyFromSecret([]byte("fuzz-lease-table-secret"))
	// The model's state is also changed by the free callback, which the
	// reaper goroutine runs: mu guards it, never held across a table call
	// (the callback also runs inside notify and unpin).
	var (
		mu       sync.Mutex
		content  [modelRanks][modelBlocks]tag
		next     [modelRanks]uint64 // each rank numbers its exports: ids collide across ranks
		tables   [modelRanks]*leaseTable
		freedBy  = map[tag]bool{}              // exports whose lease was freed
		reading  = map[tag]int{}               // READs open per export
		notified = map[tag]map[consumer]bool{} // consumers a lease accepted
		params   []issued
		open     []struct {
			r int
			l *lease
		}
	)
	locked := func(f func()) {
		mu.Lock()
		defer mu.Unlock()
		f()
	}
	for r := range modelRanks {
		tables[r] = newLeaseTable(modelTTL, r, func(l *lease, _ bool) {
			locked(func() {
				tg := tag{r, l.export}
				assert.Zero(t, reading[tg], "rank %d export %d freed with a READ open", r, l.export)
				assert.False(t, freedBy[tg], "rank %d export %d freed twice", r, l.export)
				freedBy[tg] = true
				for _, b := range l.blocks {
					assert.Equal(t, tg, content[r][b], "rank %d block %d freed by export %d holds %v", r, b, l.export, content[r][b])
					content[r][b] = tag{}
				}
			})
		})
	}
	defer func() {
		for _, o := range open {
			locked(func() { reading[tag{o.r, o.l.export}]-- })
			tables[o.r].unpin(o.l, consumer{"d", 0}, true, true)
		}
		for _, lt := range tables {
			lt.close()
		}
	}()
	ref := func(p issued) transfer.ExportRef {
		return transfer.ExportRef{RequestID: p.id, TPRank: uint32(p.rank), ExportID: p.export}
	}
	byte_ := func(i *int) int {
		if *i >= len(ops) {
			return 0
		}
		*i++
		return int(ops[*i-1])
	}
	pick := func(i *int) (issued, bool) {
		if len(params) == 0 {
			return issued{}, false
		}
		return params[byte_(i)%len(params)], true
	}
	for i := 0; i < len(ops); {
		switch byte_(&i) % 7 {
		case 0: // export: rank, request id, block count, first block
			r, id, n, first := byte_(&i)%modelRanks, fmt.Sprintf("R%d", byte_(&i)%3), 1+byte_(&i)%3, byte_(&i)
			var blocks []int
			locked(func() {
				for k := 0; k < modelBlocks-1 && len(blocks) < n; k++ {
					b := 1 + (first+k)%(modelBlocks-1)
					if content[r][b] == (tag{}) {
						blocks = append(blocks, b)
					}
				}
			})
			if len(blocks) == 0 {
				continue
			}
			next[r]++
			p := issued{id: id, rank: r, export: next[r]}
			for _, b := range blocks {
				p.blocks = append(p.blocks, uint32(b))
			}
			p.cap = key.IssueExport(ref(p), p.blocks)
			if _, err := tables[r].add(id, p.export, blocks, 0, func() []byte { return p.cap }); err != nil {
				continue // the request id holds a live lease on r
			}
			locked(func() {
				for _, b := range blocks {
					content[r][b] = tag{r, p.export}
				}
				notified[tag{r, p.export}] = map[consumer]bool{}
			})
			params = append(params, p)
		case 1: // READ: params, serving rank, which blocks (0: all of the params', else one block id)
			p, ok := pick(&i)
			r, which := byte_(&i)%modelRanks, byte_(&i)%modelBlocks
			if !ok {
				continue
			}
			want := p.blocks
			if which != 0 {
				want = []uint32{uint32(which)}
			}
			l, err := tables[r].pin(exportRef{p.id, p.export}, consumer{"d", 0}, true, func(l *lease) error {
				if err := key.VerifyExport(p.cap, transfer.ExportRef{RequestID: l.id, TPRank: uint32(r), ExportID: l.export}, l.tokens()); err != nil {
					return err
				}
				for _, b := range want {
					if !l.has(b) {
						return fmt.Errorf("%w: block %d", ErrCapabilityDenied, b)
					}
				}
				return nil
			})
			if err != nil {
				continue
			}
			locked(func() {
				for _, b := range want {
					assert.Equal(t, tag{p.rank, p.export}, content[r][b], "a READ of rank %d export %d (params of rank %d) read block %d of %v",
						r, p.export, p.rank, b, content[r][b])
				}
				reading[tag{r, l.export}]++
			})
			open = append(open, struct {
				r int
				l *lease
			}{r, l})
		case 2: // notification: params, serving rank, consumer, count
			p, ok := pick(&i)
			r, c, count := byte_(&i)%modelRanks, consumer{"d", uint32(byte_(&i) % 2)}, 1+byte_(&i)%2
			if !ok {
				continue
			}
			tg := tag{r, p.export}
			var wasFreed, wasNotified bool
			locked(func() { wasFreed, wasNotified = freedBy[tg], notified[tg][c] })
			done, err := tables[r].notify(exportRef{p.id, p.export}, c, count, p.cap, func(l *lease) error {
				return key.VerifyExport(p.cap, transfer.ExportRef{RequestID: l.id, TPRank: uint32(r), ExportID: l.export}, l.tokens())
			})
			if err != nil {
				continue
			}
			require.Equal(t, p.rank, r, "rank %d accepted a notification of rank %d's export %d", r, p.rank, p.export)
			if wasFreed {
				require.True(t, wasNotified, "an ended export's notification is acknowledged only as a resend")
				require.False(t, done)
				continue
			}
			locked(func() {
				notified[tg][c] = true
				if done && reading[tg] == 0 {
					assert.True(t, freedBy[tg], "the notification released its own export")
				}
			})
		case 3: // heartbeat: params, serving rank
			p, ok := pick(&i)
			r := byte_(&i) % modelRanks
			if !ok {
				continue
			}
			dl := tables[r].extend([]exportRef{{p.id, p.export}}, func(_ int, l *lease) error {
				return key.VerifyExport(p.cap, transfer.ExportRef{RequestID: l.id, TPRank: uint32(r), ExportID: l.export}, l.tokens())
			})
			if !dl[0].IsZero() {
				require.Equal(t, p.rank, r, "rank %d extended rank %d's export %d", r, p.rank, p.export)
				locked(func() { assert.False(t, freedBy[tag{r, p.export}], "an ended export was extended") })
			}
		case 4: // a READ ends
			if len(open) == 0 {
				continue
			}
			k := byte_(&i) % len(open)
			o := open[k]
			open = append(open[:k], open[k+1:]...)
			locked(func() { reading[tag{o.r, o.l.export}]-- })
			tables[o.r].unpin(o.l, consumer{"d", 0}, true, true)
		case 5, 6: // the clock moves: 0..15 s
			time.Sleep(time.Duration(byte_(&i)%16) * time.Second)
			synctest.Wait()
		}
	}
}
