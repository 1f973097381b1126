// cuda_abi.h: the part of the CUDA driver API's ABI (types, enum values)
// that kvsidecar uses, vendored from cuda.h 12.x so nothing needs a CUDA
// toolkit. It is the one copy: vmm/cuda's cgo code calls the driver through
// it, and vmm/cuda/cudatest compiles the fake driver (fakecuda.c) and its
// rules program against it. Since both sides read the same header, the
// layouts are checked here against the reference (LP64) at every compile,
// so a wrong one fails both builds instead of passing both.
//
// Values and layouts from the CUDA Driver API reference: CUdeviceptr is
// 64-bit (the _v2 API); CUmemAllocationProp and CUmemAccessDesc as in
// "Virtual Memory Management"; CUstream and CUevent are opaque handles
// ("Stream Management", "Event Management"); the enum values as in cuda.h.
#ifndef KVSIDECAR_CUDA_ABI_H
#define KVSIDECAR_CUDA_ABI_H

#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
	int type;
	int requestedHandleTypes;
	CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_OUT_OF_MEMORY = 2,
	CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_NO_DEVICE = 100,
	CUDA_ERROR_INVALID_DEVICE = 101,
	CUDA_ERROR_INVALID_CONTEXT = 201,
	CUDA_ERROR_OPERATING_SYSTEM = 304,
	CUDA_ERROR_INVALID_HANDLE = 400,
	CUDA_ERROR_ILLEGAL_ADDRESS = 700,
	CUDA_ERROR_NOT_SUPPORTED = 801,
};
enum {
	CU_MEM_ALLOCATION_TYPE_PINNED = 1,
	CU_MEM_LOCATION_TYPE_DEVICE = 1,
	CU_MEM_HANDLE_TYPE_NONE = 0,
	CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
	CU_MEM_ACCESS_FLAGS_PROT_NONE = 0,
	CU_MEM_ACCESS_FLAGS_PROT_READ = 1,
	CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
	CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
	CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1,
	CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
	CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103,
};
// Flags of cuMemHostAlloc (CU_MEMHOSTALLOC_*), cuStreamCreate
// (CUstream_flags) and cuEventCreate (CUevent_flags).
enum {
	CU_MEMHOSTALLOC_PORTABLE = 0x01,
	CU_MEMHOSTALLOC_DEVICEMAP = 0x02,
	CU_MEMHOSTALLOC_WRITECOMBINED = 0x04,
};
enum {
	CU_STREAM_DEFAULT = 0x0,
	CU_STREAM_NON_BLOCKING = 0x1,
};
enum {
	CU_EVENT_DEFAULT = 0x0,
	CU_EVENT_BLOCKING_SYNC = 0x1,
	CU_EVENT_DISABLE_TIMING = 0x2,
	CU_EVENT_INTERPROCESS = 0x4,
};

_Static_assert(sizeof(size_t) == 8, "LP64: size_t is 64-bit, as vmm/cuda passes []uint64 as size_t arrays");
_Static_assert(sizeof(CUdeviceptr) == 8, "CUdeviceptr is 64-bit (the _v2 API)");
_Static_assert(sizeof(CUmemGenericAllocationHandle) == 8, "CUmemGenericAllocationHandle is 64-bit");
_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation is {type, id}");
_Static_assert(offsetof(CUmemAllocationProp, location) == 8, "CUmemAllocationProp.location");
_Static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16, "CUmemAllocationProp.win32HandleMetaData");
_Static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24, "CUmemAllocationProp.allocFlags");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp is 32 bytes");
_Static_assert(offsetof(CUmemAccessDesc, flags) == 8, "CUmemAccessDesc.flags");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc is 12 bytes");

#endif
