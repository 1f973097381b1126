// Package tpgroup is the TP group of sidecars on one node: the N sidecars of
// one engine instance with tensor parallelism N, one per rank, and the
// coordination of elastic-page map/unmap between them.
//
// It is built so that none of the kvcached TP bugs can happen:
//
//   - the TP size is a constructor argument, recorded once and immutable; a
//     message that claims another size is refused with CODE_TP_MISMATCH;
//   - each rank listens on a unix socket whose path derives from the engine
//     id and tp_rank only (SocketPath), never from the device ordinal;
//   - in coordinated ownership rank 0 maps locally first (its vmm.Pool does
//     that), then asks ranks 1..N-1 — never itself — to map the same pages,
//     in parallel and with a deadline, checks every answer and rolls back
//     every rank that mapped when any rank fails;
//   - rank 0 sends a follower every page it mapped there (KIND_SYNC) first
//     on every connection it dials to it, and a follower that starts asks
//     for that (Sync) before its engine attaches, so a follower that was
//     killed and started again holds the pages of every block rank 0 hands
//     out;
//   - in local ownership nothing is broadcast at all.
//
// Rank 0 in coordinated mode:
//
//	g, err := tpgroup.New(ctx, tpgroup.Member{EngineID: "prefill-a", TPSize: 4, TPRank: 0}, nil, cfg)
//	if err != nil { ... }
//	defer g.Close()
//	pool, err := vmm.NewPool(ctx, &vmm.Config{PageHook: g.Hook(), ...})
//
// Ranks 1..3 create their pool first and hand it to the group, which serves
// the coordinator's page ops with it:
//
//	pool, err := vmm.NewPool(ctx, &vmm.Config{...})
//	g, err := tpgroup.New(ctx, tpgroup.Member{EngineID: "prefill-a", TPSize: 4, TPRank: 2}, pool, cfg)
//	defer g.Close()
//	err = g.Sync(ctx) // holds every page rank 0 has mapped before the engine attaches
package tpgroup
