// Package localapi is the local API of a kvsidecar rank: the unix-socket
// server an engine (or an operator tool) calls to create the KV cache,
// allocate and free blocks, finish and load requests (the connector's
// RequestFinished, StartLoad, GetFinished, Abort) and read stats, and its Go
// client. Pages are shared, not copied: every reply carries the pages mapped
// and unmapped since the connection's previous reply, with their file
// descriptors (SCM_RIGHTS), and the Client maps them (memfds with mmap, CUDA
// pages through a DeviceImporter), so the engine's mapping of a page never
// outlives it. The wire messages are kvsidecar.v1's LocalRequest and
// LocalReply; docs/engine-integration.md is the contract.
//
// The sidecar side (what `kvsidecar serve` does):
//
//	path, err := localapi.SocketPath(dir, "prefill-a", tpRank)
//	srv, err := localapi.NewServer(ctx, &localapi.ServerConfig{Path: path, Open: open})
//	defer srv.Shutdown(ctx) // refuse new requests, drain the rank, close
//
// where open builds a *Cache (a vmm.Pool with a PageTracker as its page
// hook and a connector.Rank over it) for the first create call. The engine
// side:
//
//	c, err := localapi.Dial(ctx, path, nil)
//	defer c.Close()
//	info, err := c.Attach(ctx, &v1.CreateKVCache{Geometry: g, TpRank: 0, TpSize: 1})
//	ids, err := c.Alloc(ctx, 16)      // their pages are mapped here on return
//	b, err := c.Block(0, int(ids[0])) // region 0 of block ids[0], shared with the sidecar
//
// Sockets, their directory check and the stale-socket probe are shared with
// the TP group (internal/unixsock). localapi never links cgo.
package localapi
