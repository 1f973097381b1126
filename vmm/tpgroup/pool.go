package tpgroup

import (
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// notMappedCode is the code a follower's pool answers for "page not mapped"
// (vmm.ErrNotMapped); repairs treat it as done.
var notMappedCode = v1.Code_CODE_NOT_FOUND

// poolCode maps an error of the follower's pool to its wire code.
func poolCode(err error) v1.Code { return v1.Code_CODE_INTERNAL }
