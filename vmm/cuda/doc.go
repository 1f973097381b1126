// Package cuda is the CUDA virtual memory management backend of vmm: the only
// cgo package of kvsidecar. The driver library (libcuda.so.1, or
// Config.Library) is loaded with dlopen at run time with vendored minimal
// typedefs, so it builds with no CUDA toolkit; with CGO_ENABLED=0 or off
// Linux a stub returns errors wrapping errors.ErrUnsupported. Programs (cmd,
// examples), test support and tests import it; libraries never do
// (layers_test.go at the module root): the local API's Go client takes it
// through an interface.
//
//	b, err := cuda.New(&cuda.Config{Device: 0}) // checks the device can serve pages
//	pool, err := vmm.NewPool(ctx, &vmm.Config{Backend: b, Layout: l, NumBlocks: n})
//	...
//	pool.Close(); b.Close()
//
// Besides the vmm.Backend calls, a Backend has a CUDA stream of its own for
// the copies that keep up with the network: HostBuffer (page-locked host
// memory), CopyOutAsync and CopyInAsync (staging copies completed through
// events, for double buffering), ImportPeerPages (another sidecar's pages
// mapped read-only) and CopyDeviceToDevice (coalesced device copies, one
// synchronization per batch); vmm reaches them through vmm.AsyncCopier and
// vmm.PeerCopier.
//
// Without a GPU its tests run against a fake driver library with the
// driver's rules (package cudatest); make gpu-check runs them on a GPU.
package cuda
