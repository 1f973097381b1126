// Package connector is the engine-facing KV connector of kvsidecar.
//
// Scheduler side (prefill): RequestFinished turns a finished request's blocks
// into kv_transfer_params and holds them under a lease. Worker side (decode):
// StartLoad maps the decode rank to the prefill ranks that hold its heads,
// reads the blocks and reports them through GetFinished; Abort stops a
// request. It also holds the kv_transfer_params JSON codec. The local API
// that engines call over a unix socket is package localapi.
//
// connector never touches cgo.
package connector
