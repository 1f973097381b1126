package connector

import "context"

// SetAfterRead makes r call f once a load's READs all succeeded, before
// its checksums are verified: tests change the landed bytes there.
func SetAfterRead(r *Rank, f func(requestID string)) { r.afterRead = f }

// FollowerFree is what a coordinated follower answers to rank 0's free of
// blocks, as BuildRank's TP group OnFree does: it ends every export of r
// holding one of them, then waits, within ctx (the group's deadline), for
// the transfers pinning them.
func FollowerFree(ctx context.Context, r *Rank, blocks []int) error {
	r.ownerFreed(blocks)
	return r.pool.WaitUnpinned(ctx, blocks)
}
