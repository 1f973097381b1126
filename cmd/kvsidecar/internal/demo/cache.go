package demo

import (
	"sync"

	lru "github.com/hashicorp/golang-lru/v2"
)

// prefixCache is the decode side's bounded cache of the 512-token prefix
// blocks it holds, keyed by the trace's hash id (Mooncake hash ids are
// prefix hashes: equal id at a position means equal prompt up to there).
// An entry owns the decode block ids of its tokens on every rank; they stay
// allocated while the entry is cached or pinned by a request reading it.
// An evicted entry frees its blocks once the last pin is gone.
type prefixCache struct {
	mu   sync.Mutex
	lru  *lru.Cache[int64, *cacheEntry]
	free func(ids []uint32)
}

type cacheEntry struct {
	blocks  []uint32
	pins    int
	evicted bool
}

// newPrefixCache holds at most entries hash blocks; free releases the
// blocks of an entry that is evicted and unpinned.
func newPrefixCache(entries int, free func([]uint32)) (*prefixCache, error) {
	c := &prefixCache{free: free}
	l, err := lru.NewWithEvict(entries, func(_ int64, e *cacheEntry) {
		// Called with c.mu held (every lru call below is under it).
		e.evicted = true
		if e.pins == 0 {
			c.free(e.blocks)
		}
	})
	if err != nil {
		return nil, err
	}
	c.lru = l
	return c, nil
}

// lookup pins the longest cached run of hashIDs[:limit] from the start and
// returns it; release unpins it.
func (c *prefixCache) lookup(hashIDs []int64, limit int) []*cacheEntry {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*cacheEntry
	for _, h := range hashIDs[:limit] {
		e, ok := c.lru.Get(h)
		if !ok {
			break
		}
		e.pins++
		out = append(out, e)
	}
	return out
}

// release unpins entries, freeing those evicted meanwhile.
func (c *prefixCache) release(entries []*cacheEntry) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range entries {
		e.pins--
		if e.pins == 0 && e.evicted {
			c.free(e.blocks)
		}
	}
}

// insert caches blocks under hashID and reports whether the cache took
// them; when it already holds hashID the caller keeps (and frees) blocks.
func (c *prefixCache) insert(hashID int64, blocks []uint32) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.lru.Contains(hashID) {
		return false
	}
	c.lru.Add(hashID, &cacheEntry{blocks: blocks})
	return true
}

// purge evicts every entry (freeing the unpinned ones).
func (c *prefixCache) purge() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lru.Purge()
}

// len is the number of cached hash blocks.
func (c *prefixCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lru.Len()
}
