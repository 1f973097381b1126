// Package cudaabi holds cuda_abi.h, the one copy of the CUDA driver API's
// types and enum values that kvsidecar uses: vmm/cuda's cgo code includes
// it from this directory, and vmm/cuda/cudatest compiles the fake driver
// against Header.
//
// vmm/cuda imports this package for the build cache's sake as well: the go
// command hashes only the headers in a package's own directory, and the
// import makes a change to this one rebuild vmm/cuda.
package cudaabi

import _ "embed"

// Header is the text of cuda_abi.h, for a C compiler run outside the go
// command.
//
//go:embed cuda_abi.h
var Header string
