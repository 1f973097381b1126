package localapi

import (
	"errors"
	"slices"

	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// delta computes what the connection must map and unmap to match the pool,
// and exports the pages to map. A page unmapped while exporting is dropped
// (and reported unmapped if the engine had it); the next reply catches up.
func (s *Server) delta(st *connState) (*v1.MappingDelta, *vmm.Export) {
	cache := s.Cache()
	if cache == nil {
		return nil, nil
	}
	snap := cache.Tracker.Snapshot()
	var want []int
	for pg, g := range snap {
		if st.known[pg] != g {
			want = append(want, pg)
		}
	}
	d := &v1.MappingDelta{}
	for pg := range st.known {
		if _, ok := snap[pg]; !ok {
			d.UnmappedPages = append(d.UnmappedPages, uint32(pg))
			delete(st.known, pg)
		}
	}
	slices.Sort(want)
	var ex *vmm.Export
	for len(want) > 0 {
		var err error
		ex, err = cache.Pool.Export(want)
		if err == nil {
			break
		}
		var pe *vmm.PageError
		if !errors.As(err, &pe) || !slices.Contains(want, pe.Page) {
			s.cfg.Logger.Error("local API: export failed", "pages", len(want), "err", err)
			want = nil
			break
		}
		want = slices.DeleteFunc(want, func(p int) bool { return p == pe.Page })
		if _, had := st.known[pe.Page]; had {
			d.UnmappedPages = append(d.UnmappedPages, uint32(pe.Page))
			delete(st.known, pe.Page)
		}
	}
	if ex != nil {
		for _, m := range ex.Mappings {
			d.Map = append(d.Map, m.Proto())
		}
		d.NumFds = uint32(len(ex.Files))
		for _, pg := range want {
			st.known[pg] = snap[pg]
		}
	}
	slices.Sort(d.UnmappedPages)
	if len(d.Map) == 0 && len(d.UnmappedPages) == 0 {
		return nil, ex
	}
	return d, ex
}
