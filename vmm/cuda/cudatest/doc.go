// Package cudatest builds and inspects fakecuda, a stand-in for the CUDA
// driver library (libcuda.so.1) that tests load on machines without a GPU:
// vmm/cuda's own tests through cuda.Config.Library, the e2e tests and the
// `kvsidecar serve` processes they start through --cuda-library. The real
// vmm/cuda code loads it with dlopen and calls it as it calls the driver;
// the fake keeps device memory in memfds, leaves device addresses
// PROT_NONE to host code, and refuses every call that breaks a rule of the
// CUDA Driver API reference with the CUresult the reference documents
// (testdata/fakecuda.c says which rule comes from where).
//
//	lib := cudatest.Library(t)                 // gcc builds it once per test binary
//	tr := cudatest.StartTrace(t)               // every call from here on, in order
//	cudatest.Inject(t, cudatest.Fault{Call: "cuMemCreate", N: 3, Result: 2})
//	b, err := cuda.New(&cuda.Config{Library: lib})
//	...
//	require.Empty(t, cudatest.Refused(tr.Calls(t)))
//
// Without gcc, or when the build fails, Library skips the test — unless
// KVSIDECAR_REQUIRE_FAKECUDA=1 (set by .ci/run), which fails it. A real GPU
// is never replaced by the fake: only a test that asks for Library loads it.
package cudatest
