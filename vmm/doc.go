// Package vmm owns a rank's KV cache as elastic pages, the way kvcached does
// inside an engine: a virtual range is reserved once per region, a physical
// page (one granularity, 2 MiB on current GPUs) is mapped when a block in it
// is first allocated, and it is unmapped and released when its last block is
// freed. It holds the Backend interface, the host backend (memfd + mmap), the
// block Pool and the KV layout of a rank; the geometry every layer shares
// (model table, dtype sizes, head split, block packing) is internal/kvgeom.
// vmm/cuda is the device backend and vmm/vmmtest the conformance suite every
// backend passes.
//
// The smallest real use:
//
//	g, _ := kvgeom.Model("llama-3.1-8b")
//	layout, err := vmm.LayoutFor(g, tpRank, tpSize)
//	pool, err := vmm.NewPool(ctx, &vmm.Config{Layout: layout, NumBlocks: 4096})
//	defer pool.Close()
//	ids, err := pool.Alloc(ctx, 16) // maps pages as needed, all-or-nothing
//	err = pool.CopyIn(region, pool.BlockOffset(ids[0]), kv)
//	err = pool.Free(ctx, ids)       // unmaps pages whose last block went
//
// Two optional backend interfaces serve the data plane where the pages are
// device memory: AsyncCopier (Pool.HostBuffer, CopyOutAsync, CopyInAsync:
// staging copies through page-locked buffers that run while the caller
// sends the previous buffer) and PeerCopier (Pool.ImportPeer, CopyFromPeer:
// a peer sidecar's exported pages mapped read-only and copied device to
// device, contiguous runs coalesced by CoalesceCopies).
//
// Errors are sentinels (ErrAlreadyMapped, ErrNotMapped, ErrOverLimit,
// ErrBlockOutOfRange, ErrDoubleFree, ErrNullBlock, ErrBackend,
// ErrInvalidConfig) wrapped in struct types that name the page, block or
// address; each sentinel is a *codes.Error of one class, so codes.Of
// (internal/codes) maps them to v1.Code.
//
// vmm must not import transfer, handshake or connector.
package vmm
