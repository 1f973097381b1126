package tpgroup

import (
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
	"github.com/kvsidecar/kvsidecar/vmm"
)

// The coordinator is rank 0's vmm.PageHook and a *vmm.Pool serves followers.
var (
	_ vmm.PageHook = coordinator{}
	_ PagePool     = (*vmm.Pool)(nil)
)

// notMappedCode is the code a follower's pool answers for "page not mapped"
// (vmm.ErrNotMapped); repairs treat it as done.
var notMappedCode = vmm.CodeOf(vmm.ErrNotMapped)

// poolCode maps an error of the follower's pool to its wire code.
func poolCode(err error) v1.Code { return vmm.CodeOf(err) }
