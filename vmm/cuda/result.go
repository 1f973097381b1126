package cuda

import (
	"errors"
	"fmt"

	"github.com/kvsidecar/kvsidecar/vmm"
)

// ErrNoGPU: libcuda.so.1 could not be loaded, cuInit failed or there is no
// device with the requested ordinal. Tests skip on it.
var ErrNoGPU = errors.New("cuda: no usable GPU")

// Result is a CUresult of the CUDA driver API. It is an error whose message
// names the value from a built-in table, so it reads well even when the
// library (and cuGetErrorName) is absent.
type Result int32

// CUresult values used by this package, with the numbers of the driver API
// (cuda.h, enum cudaError_enum; NVIDIA CUDA Driver API reference, "Data
// types used by CUDA driver").
const (
	Success         Result = 0
	InvalidValue    Result = 1
	OutOfMemory     Result = 2
	NotInitialized  Result = 3
	Deinitialized   Result = 4
	NoDevice        Result = 100
	InvalidDevice   Result = 101
	InvalidContext  Result = 201
	AlreadyMapped   Result = 208
	NotMapped       Result = 211
	InvalidHandle   Result = 400
	NotSupported    Result = 801
	NotPermitted    Result = 800
	StubLibrary     Result = 34
	DeviceUnavail   Result = 46
	SystemNotReady  Result = 802
	DriverMismatch  Result = 803
	IllegalAddress  Result = 700
	Unknown         Result = 999
	OperatingSystem Result = 304
)

var resultNames = map[Result]string{
	0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
	3: "CUDA_ERROR_NOT_INITIALIZED", 4: "CUDA_ERROR_DEINITIALIZED", 5: "CUDA_ERROR_PROFILER_DISABLED",
	34: "CUDA_ERROR_STUB_LIBRARY", 35: "CUDA_ERROR_INSUFFICIENT_DRIVER", 46: "CUDA_ERROR_DEVICE_UNAVAILABLE",
	100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE", 102: "CUDA_ERROR_DEVICE_NOT_LICENSED",
	200: "CUDA_ERROR_INVALID_IMAGE", 201: "CUDA_ERROR_INVALID_CONTEXT", 202: "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
	205: "CUDA_ERROR_MAP_FAILED", 206: "CUDA_ERROR_UNMAP_FAILED", 207: "CUDA_ERROR_ARRAY_IS_MAPPED",
	208: "CUDA_ERROR_ALREADY_MAPPED", 209: "CUDA_ERROR_NO_BINARY_FOR_GPU", 210: "CUDA_ERROR_ALREADY_ACQUIRED",
	211: "CUDA_ERROR_NOT_MAPPED", 214: "CUDA_ERROR_ECC_UNCORRECTABLE", 216: "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
	304: "CUDA_ERROR_OPERATING_SYSTEM", 400: "CUDA_ERROR_INVALID_HANDLE", 401: "CUDA_ERROR_ILLEGAL_STATE",
	500: "CUDA_ERROR_NOT_FOUND", 600: "CUDA_ERROR_NOT_READY", 700: "CUDA_ERROR_ILLEGAL_ADDRESS",
	719: "CUDA_ERROR_LAUNCH_FAILED", 800: "CUDA_ERROR_NOT_PERMITTED", 801: "CUDA_ERROR_NOT_SUPPORTED",
	802: "CUDA_ERROR_SYSTEM_NOT_READY", 803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
	804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", 999: "CUDA_ERROR_UNKNOWN",
}

// Name returns the CUresult's symbolic name, or "CUDA_ERROR_<n>" for a value
// missing from the table.
func (r Result) Name() string {
	if n, ok := resultNames[r]; ok {
		return n
	}
	return fmt.Sprintf("CUDA_ERROR_%d", int32(r))
}

func (r Result) Error() string { return fmt.Sprintf("cuda: %s (%d)", r.Name(), int32(r)) }

// Unwrap returns the vmm sentinel a Result is, so errors.Is matches it and
// codes.Of gives its class: CUDA_ERROR_OUT_OF_MEMORY is vmm.ErrOverLimit,
// ALREADY_MAPPED is vmm.ErrAlreadyMapped, NOT_MAPPED is vmm.ErrNotMapped;
// nil for any other Result.
func (r Result) Unwrap() error {
	switch r {
	case OutOfMemory:
		return vmm.ErrOverLimit
	case AlreadyMapped:
		return vmm.ErrAlreadyMapped
	case NotMapped:
		return vmm.ErrNotMapped
	}
	return nil
}

// Is lets errors.Is match a Result against ErrNoGPU: NO_DEVICE,
// INVALID_DEVICE, STUB_LIBRARY and INSUFFICIENT_DRIVER are ErrNoGPU.
func (r Result) Is(target error) bool {
	return target == ErrNoGPU && (r == NoDevice || r == InvalidDevice || r == StubLibrary || r == 35)
}

// DefaultLibrary is the driver library New loads when Config.Library is
// empty: the soname the NVIDIA driver installs, found by the dynamic loader
// (LD_LIBRARY_PATH, then the ld.so cache).
const DefaultLibrary = "libcuda.so.1"

// Config configures New. The zero value and nil are valid.
type Config struct {
	// Device is the CUDA device ordinal. Default 0.
	Device int
	// Library is the driver library New loads with dlopen: a file name the
	// dynamic loader looks up, or a path (one with a slash). Default (""):
	// DefaultLibrary. Each library is loaded once per process; backends of
	// different libraries can coexist (each has its own entry points).
	Library string
}

func (c *Config) withDefaults() Config {
	var out Config
	if c != nil {
		out = *c
	}
	if out.Library == "" {
		out.Library = DefaultLibrary
	}
	return out
}

func call(op string, r Result) error {
	if r == Success {
		return nil
	}
	return &vmm.BackendError{Op: op, Err: r}
}
