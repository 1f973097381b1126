package tpgroup

import (
	"github.com/kvsidecar/kvsidecar/internal/codes"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// The coordinator is rank 0's vmm.PageHook and a *vmm.Pool serves followers.
var (
	_ vmm.PageHook = coordinator{}
	_ PagePool     = (*vmm.Pool)(nil)
)

// notMappedCode is the code a follower's pool answers for "page not mapped"
// (vmm.ErrNotMapped); repairs treat it as done.
var notMappedCode = codes.Of(vmm.ErrNotMapped)
