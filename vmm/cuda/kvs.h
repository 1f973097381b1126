// kvs.h: the table of driver entry points that vmm/cuda loads with dlopen
// (cuda.go's kvs_load fills it), for every cgo file of the package: each
// file's small C functions (one per Go call, setting the context first) call
// the driver through it.
#ifndef KVSIDECAR_KVS_H
#define KVSIDECAR_KVS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cuda_abi.h"

// kvs_lib is the entry points of one loaded driver library.
typedef struct {
	CUresult (*cuInit)(unsigned int);
	CUresult (*cuDriverGetVersion)(int *);
	CUresult (*cuDeviceGet)(CUdevice *, int);
	CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
	CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
	CUresult (*cuCtxSetCurrent)(CUcontext);
	CUresult (*cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
	CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
	CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
	CUresult (*cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
	CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
	CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
	CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
	CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
	CUresult (*cuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
	CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
	CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
	CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
	CUresult (*cuMemHostAlloc)(void **, size_t, unsigned int);
	CUresult (*cuMemFreeHost)(void *);
	CUresult (*cuStreamCreate)(CUstream *, unsigned int);
	CUresult (*cuStreamDestroy)(CUstream);
	CUresult (*cuStreamSynchronize)(CUstream);
	CUresult (*cuEventCreate)(CUevent *, unsigned int);
	CUresult (*cuEventRecord)(CUevent, CUstream);
	CUresult (*cuEventSynchronize)(CUevent);
	CUresult (*cuEventDestroy)(CUevent);
	CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
	CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
	CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
	CUresult (*cuDeviceCanAccessPeer)(int *, CUdevice, CUdevice);
	CUresult (*cuMemGetAllocationPropertiesFromHandle)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
} kvs_lib;

// The virtual memory management calls of both the backend's own pages
// (cuda.go) and a peer's (cuda_peer.go). Every call sets the context
// first: the calling OS thread may be any.

static inline CUresult kvs_reserve(const kvs_lib *l, CUcontext ctx, size_t size, size_t align, CUdeviceptr *ptr) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuMemAddressReserve(ptr, size, align, 0, 0);
}

static inline CUresult kvs_free(const kvs_lib *l, CUcontext ctx, CUdeviceptr ptr, size_t size) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuMemAddressFree(ptr, size);
}

static inline CUresult kvs_release(const kvs_lib *l, CUcontext ctx, CUmemGenericAllocationHandle h) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuMemRelease(h);
}

static inline CUresult kvs_map(const kvs_lib *l, CUcontext ctx, CUdeviceptr ptr, size_t size, CUmemGenericAllocationHandle h) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuMemMap(ptr, size, 0, h, 0);
}

static inline CUresult kvs_unmap(const kvs_lib *l, CUcontext ctx, CUdeviceptr ptr, size_t size) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuMemUnmap(ptr, size);
}

// kvs_set_access grants device dev the access flags (CU_MEM_ACCESS_FLAGS_*).
static inline CUresult kvs_set_access(const kvs_lib *l, CUcontext ctx, CUdevice dev, CUdeviceptr ptr, size_t size, int flags) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	if (r) return r;
	CUmemAccessDesc d;
	memset(&d, 0, sizeof d);
	d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	d.location.id = dev;
	d.flags = flags;
	return l->cuMemSetAccess(ptr, size, &d, 1);
}

static inline CUresult kvs_import(const kvs_lib *l, CUcontext ctx, int fd, CUmemGenericAllocationHandle *h) {
	CUresult r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuMemImportFromShareableHandle(h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
}

#endif
