// Package vmm owns a rank's KV cache as elastic pages, the way kvcached does
// inside an engine: a virtual range is reserved once per region, a physical
// page (one granularity, 2 MiB on current GPUs) is mapped when a block in it
// is first allocated, and it is unmapped and released when its last block is
// freed. It holds the Backend interface, the host backend (memfd + mmap), the
// block Pool and the KV layout arithmetic.
//
// vmm must not import transfer, handshake or connector.
package vmm
