// Package cuda is the CUDA virtual memory management backend of vmm: the only
// cgo package of kvsidecar. libcuda.so.1 is loaded with dlopen at run time
// with vendored minimal typedefs, so it builds with no CUDA toolkit; with
// CGO_ENABLED=0 or off Linux a stub returns errors wrapping
// errors.ErrUnsupported. Only cmd and this package's own tests import it.
package cuda
