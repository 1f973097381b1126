package demo

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"slices"

	"github.com/kvsidecar/kvsidecar/cmd/kvsidecar/internal/trace"
	"github.com/kvsidecar/kvsidecar/cmd/kvsidecar/internal/trace/mooncake"
	"github.com/kvsidecar/kvsidecar/internal/kvgeom"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// ErrMemoryBudget: the estimated peak of a run exceeds Config.MemoryBudget;
// the *MemoryError wrapping it names the request and the bytes.
var ErrMemoryBudget = errors.New("demo: memory budget exceeded")

// MemoryError is returned by CheckMemory and Run, before anything starts,
// when the pages the run would map at its peak exceed Config.MemoryBudget.
// It wraps ErrMemoryBudget.
type MemoryError struct {
	// Trace names the trace; Line is the 1-based line of the request in it
	// (blank lines count); Index the request's 0-based position.
	Trace       string
	Line, Index int
	// Tokens is the request's input_length.
	Tokens int
	// RequestBytes is what this request alone maps, prefill and decode
	// ranks together; PeakBytes the estimated peak of the run once it is
	// replayed (the null blocks, a full prefix cache and the largest
	// Concurrency requests so far in flight); Budget is
	// Config.MemoryBudget. All in bytes.
	RequestBytes, PeakBytes, Budget uint64
	// Concurrency is Config.Concurrency after defaults.
	Concurrency int
}

func (e *MemoryError) Error() string {
	return fmt.Sprintf("demo: request at %s:%d (%d tokens) maps %s; with up to %d in flight and the prefix cache the peak is %s, over the memory budget of %s",
		e.Trace, e.Line, e.Tokens, FormatBytes(e.RequestBytes), e.Concurrency, FormatBytes(e.PeakBytes), FormatBytes(e.Budget))
}

// Unwrap returns ErrMemoryBudget.
func (e *MemoryError) Unwrap() error { return ErrMemoryBudget }

// FormatBytes prints n in the largest binary unit that keeps it >= 1, with
// one decimal: "1.5 GiB", "512 B".
func FormatBytes(n uint64) string {
	units := []string{"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}
	if n < 1<<10 {
		return fmt.Sprintf("%d B", n)
	}
	v, u := float64(n)/(1<<10), 0
	for v >= 1<<10 && u < len(units)-1 {
		v /= 1 << 10
		u++
	}
	return fmt.Sprintf("%.1f %s", v, units[u])
}

// CheckMemory estimates, without starting anything, the bytes of pages
// Run(ctx, cfg) maps at its peak over both instances, all ranks: the null
// block of every pool, the decode prefix cache at capacity (capped by the
// distinct whole hash blocks of the replayed requests), and the largest
// Config.Concurrency requests in flight, each mapping its prompt's blocks
// on every prefill rank and again on every decode rank (blocks × regions
// × block bytes, rounded up to whole pages of vmm.DefaultHostPageSize per
// region). It returns the peak; when cfg.MemoryBudget > 0 and the peak
// exceeds it, a *MemoryError naming the first request at which it does.
// Config and trace errors are those of Run.
func CheckMemory(cfg *Config) (uint64, error) {
	c, tr, reqs, err := cfg.prepare()
	if err != nil {
		return 0, err
	}
	return c.checkMemory(tr, reqs)
}

// sideCost prices n blocks on every rank of one instance.
type sideCost struct {
	ranks []rankCost
}

type rankCost struct {
	regions uint64
	bpp     uint64 // blocks per page; 0: a block spans pagesPerBlock pages
	ppb     uint64 // pages per block when bpp is 0
}

func (c *Config) sideCost(tp int) (sideCost, error) {
	var s sideCost
	for r := range tp {
		l, err := vmm.LayoutFor(c.Geometry, r, tp)
		if err != nil {
			return s, fmt.Errorf("%w: Config.PrefillTP/DecodeTP: %v", ErrInvalidConfig, err)
		}
		bl := l.BlockLen()
		pk := kvgeom.Packing{BlockLen: bl, PageSize: vmm.DefaultHostPageSize}
		rc := rankCost{regions: uint64(l.NumRegions()), bpp: pk.BlocksPerPage()}
		if rc.bpp == 0 {
			rc.ppb = (bl + vmm.DefaultHostPageSize - 1) / vmm.DefaultHostPageSize
		}
		s.ranks = append(s.ranks, rc)
	}
	return s, nil
}

// bytes is what n blocks map on every rank, all regions, in whole pages.
func (s sideCost) bytes(n int) uint64 {
	var total uint64
	for _, r := range s.ranks {
		pages := uint64(n) * r.ppb
		if r.bpp > 0 {
			pages = (uint64(n) + r.bpp - 1) / r.bpp
		}
		total += pages * r.regions * vmm.DefaultHostPageSize
	}
	return total
}

func (c *Config) checkMemory(tr *Trace, reqs []trace.Request) (uint64, error) {
	pre, err := c.sideCost(c.PrefillTP)
	if err != nil {
		return 0, err
	}
	dec, err := c.sideCost(c.DecodeTP)
	if err != nil {
		return 0, err
	}
	bs := int(c.Geometry.GetBlockSize())
	perHash := trace.HashBlockTokens / bs
	base := pre.bytes(1) + dec.bytes(1) // the null blocks
	seen := map[int64]struct{}{}
	var top []uint64 // the largest Concurrency request costs, ascending
	var inFlight, peak uint64
	for i, q := range reqs {
		n := (q.InputLength + bs - 1) / bs
		cost := pre.bytes(n) + dec.bytes(n)
		if c.CacheEntries > 0 {
			for _, h := range q.HashIDs[:q.InputLength/trace.HashBlockTokens] {
				seen[h] = struct{}{}
			}
		}
		at, _ := slices.BinarySearch(top, cost)
		top = slices.Insert(top, at, cost)
		inFlight += cost
		if len(top) > c.Concurrency {
			inFlight -= top[0]
			top = top[1:]
		}
		cache := dec.bytes(min(len(seen), max(c.CacheEntries, 0)) * perHash)
		peak = base + cache + inFlight
		if c.MemoryBudget > 0 && peak > c.MemoryBudget {
			return peak, &MemoryError{Trace: tr.Name, Line: tr.line(i), Index: i, Tokens: q.InputLength,
				RequestBytes: cost, PeakBytes: peak, Budget: c.MemoryBudget, Concurrency: c.Concurrency}
		}
	}
	return peak, nil
}

// line is the 1-based trace line of request i.
func (t *Trace) line(i int) int {
	if i < len(t.Lines) {
		return t.Lines[i]
	}
	return i + 1
}

// readTrace reads the first n requests of the trace in r (all when n <= 0)
// and the line each came from, in a second pass over r.
func readTrace(r io.ReadSeeker, name string, n int) (*Trace, error) {
	reqs, err := trace.Read(r, name, n)
	if err != nil {
		return nil, err
	}
	t := &Trace{Name: name, Requests: reqs, Lines: make([]int, 0, len(reqs))}
	if _, err := r.Seek(0, io.SeekStart); err != nil {
		return nil, fmt.Errorf("trace: %s: %w", name, err)
	}
	// trace.Reader skips exactly the lines that are blank after trimming;
	// every line up to the last request read was accepted by it.
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for ln := 1; len(t.Lines) < len(reqs) && sc.Scan(); ln++ {
		if len(bytes.TrimSpace(sc.Bytes())) > 0 {
			t.Lines = append(t.Lines, ln)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("trace: %s: %w", name, err)
	}
	return t, nil
}

// readEmbedded reads the first n requests of the embedded trace.
func readEmbedded(n int) (*Trace, error) {
	return readTrace(mooncake.Conversation(), mooncake.ConversationName, n)
}
