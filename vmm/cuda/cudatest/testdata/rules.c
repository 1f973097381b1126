// rules.c: breaks one rule of the CUDA driver API against a driver library
// (fakecuda.c) and prints what the driver answered, for cudatest's
// TestFakeRules. Usage: rules LIBRARY RULE. It prints the CUresult of the
// call under test on the first line ("errno N" for a host call) and the
// library's reason (fakecuda_last_error) on the second; the rule
// "host-touch" is expected to die of SIGSEGV instead. Exit status 2: the
// set-up failed or the rule is unknown.

#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cuda_abi.h"

typedef CUmemGenericAllocationHandle CUhandle;

static CUresult (*cuInit)(unsigned int);
static CUresult (*cuDeviceGet)(CUdevice *, int);
static CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*cuCtxSetCurrent)(CUcontext);
static CUresult (*cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
static CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
static CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
static CUresult (*cuMemCreate)(CUhandle *, size_t, const CUmemAllocationProp *, unsigned long long);
static CUresult (*cuMemRelease)(CUhandle);
static CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUhandle, unsigned long long);
static CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
static CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
static CUresult (*cuMemExportToShareableHandle)(void *, CUhandle, int, unsigned long long);
static CUresult (*cuMemImportFromShareableHandle)(CUhandle *, void *, int);
static CUresult (*cuMemcpyHtoD_v2)(CUdeviceptr, const void *, size_t);
static CUresult (*cuMemcpyDtoH_v2)(void *, CUdeviceptr, size_t);
static CUresult (*cuMemHostAlloc)(void **, size_t, unsigned int);
static CUresult (*cuMemFreeHost)(void *);
static CUresult (*cuStreamCreate)(CUstream *, unsigned int);
static CUresult (*cuStreamDestroy_v2)(CUstream);
static CUresult (*cuStreamSynchronize)(CUstream);
static CUresult (*cuEventCreate)(CUevent *, unsigned int);
static CUresult (*cuEventRecord)(CUevent, CUstream);
static CUresult (*cuEventSynchronize)(CUevent);
static CUresult (*cuEventDestroy_v2)(CUevent);
static CUresult (*cuMemcpyHtoDAsync_v2)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*cuMemcpyDtoHAsync_v2)(void *, CUdeviceptr, size_t, CUstream);
static CUresult (*cuMemcpyDtoDAsync_v2)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
static CUresult (*cuDeviceCanAccessPeer)(int *, CUdevice, CUdevice);
static CUresult (*cuMemGetAllocationPropertiesFromHandle)(CUmemAllocationProp *, CUhandle);
static const char *(*fakecuda_last_error)(void);
static unsigned long long (*fakecuda_calls)(const char *);
static long long (*fakecuda_live)(const char *);

static size_t G;
static CUmemAllocationProp prop;
static CUcontext ctx;

static void die(const char *what, CUresult r) {
	fprintf(stderr, "rules: set-up %s: CUresult %d: %s\n", what, r, fakecuda_last_error ? fakecuda_last_error() : "");
	exit(2);
}

#define MUST(call) do { CUresult r_ = (call); if (r_) die(#call, r_); } while (0)

static void report(CUresult r) {
	printf("%d\n%s\n", r, fakecuda_last_error());
	exit(0);
}

static void init(void) {
	CUdevice dev;
	MUST(cuInit(0));
	MUST(cuDeviceGet(&dev, 0));
	MUST(cuDevicePrimaryCtxRetain(&ctx, dev));
	MUST(cuCtxSetCurrent(ctx));
	memset(&prop, 0, sizeof prop);
	prop.type = 1;                 // CU_MEM_ALLOCATION_TYPE_PINNED
	prop.requestedHandleTypes = 1; // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
	prop.location.type = 1;        // CU_MEM_LOCATION_TYPE_DEVICE
	prop.location.id = dev;
	MUST(cuMemGetAllocationGranularity(&G, &prop, 0));
}

static CUdeviceptr reserve(size_t n) {
	CUdeviceptr p;
	MUST(cuMemAddressReserve(&p, n, G, 0, 0));
	return p;
}

static CUhandle create(size_t n) {
	CUhandle h;
	MUST(cuMemCreate(&h, n, &prop, 0));
	return h;
}

static void access_rw(CUdeviceptr p, size_t n) {
	CUmemAccessDesc d = {{1, 0}, 3}; // device 0, PROT_READWRITE
	MUST(cuMemSetAccess(p, n, &d, 1));
}

static CUstream stream(void) {
	CUstream s;
	MUST(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
	return s;
}

// imported maps, at a new reservation, an import of page h's export with
// the access flags for device 0.
static CUdeviceptr imported(CUhandle h, int flags) {
	int fd = -1;
	CUhandle h2;
	MUST(cuMemExportToShareableHandle(&fd, h, 1, 0));
	MUST(cuMemImportFromShareableHandle(&h2, (void *)(intptr_t)fd, 1));
	close(fd);
	CUdeviceptr p = reserve(G);
	MUST(cuMemMap(p, G, 0, h2, 0));
	CUmemAccessDesc d = {{1, 0}, flags};
	MUST(cuMemSetAccess(p, G, &d, 1));
	return p;
}

// mapped returns a reserved, mapped page with read-write access.
static CUdeviceptr mapped(CUhandle *h) {
	CUdeviceptr p = reserve(G);
	*h = create(G);
	MUST(cuMemMap(p, G, 0, *h, 0));
	access_rw(p, G);
	return p;
}

int main(int argc, char **argv) {
	if (argc != 3) {
		fprintf(stderr, "usage: rules LIBRARY RULE\n");
		return 2;
	}
	void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		fprintf(stderr, "rules: %s\n", dlerror());
		return 2;
	}
#define SYM(name) do { *(void **)(&name) = dlsym(lib, #name); if (!name) { fprintf(stderr, "rules: no %s\n", #name); return 2; } } while (0)
	SYM(cuInit); SYM(cuDeviceGet); SYM(cuDevicePrimaryCtxRetain); SYM(cuCtxSetCurrent);
	SYM(cuMemGetAllocationGranularity); SYM(cuMemAddressReserve); SYM(cuMemAddressFree);
	SYM(cuMemCreate); SYM(cuMemRelease); SYM(cuMemMap); SYM(cuMemUnmap); SYM(cuMemSetAccess);
	SYM(cuMemExportToShareableHandle); SYM(cuMemImportFromShareableHandle);
	SYM(cuMemcpyHtoD_v2); SYM(cuMemcpyDtoH_v2); SYM(fakecuda_last_error); SYM(fakecuda_calls);
	SYM(cuMemHostAlloc); SYM(cuMemFreeHost); SYM(cuStreamCreate); SYM(cuStreamDestroy_v2); SYM(cuStreamSynchronize);
	SYM(cuEventCreate); SYM(cuEventRecord); SYM(cuEventSynchronize); SYM(cuEventDestroy_v2);
	SYM(cuMemcpyHtoDAsync_v2); SYM(cuMemcpyDtoHAsync_v2); SYM(cuMemcpyDtoDAsync_v2);
	SYM(cuDeviceCanAccessPeer); SYM(cuMemGetAllocationPropertiesFromHandle); SYM(fakecuda_live);
	const char *rule = argv[2];
	CUhandle h, h2;
	CUdeviceptr p, p2;
	char buf[64] = "device bytes";
	CUstream s;
	CUevent ev;
	char *pin;

	if (strcmp(rule, "call-before-init") == 0) {
		report(cuMemCreate(&h, 2 << 20, &prop, 0));
	}
	init();
	if (strcmp(rule, "create-aligned") == 0) report(cuMemCreate(&h, G, &prop, 0));
	if (strcmp(rule, "create-misaligned-size") == 0) report(cuMemCreate(&h, G / 2, &prop, 0));
	if (strcmp(rule, "create-bad-properties") == 0) {
		prop.type = 0;
		report(cuMemCreate(&h, G, &prop, 0));
	}
	if (strcmp(rule, "create-over-device-memory") == 0) {
		// FAKECUDA_DEVICE_MEMORY holds one page.
		create(G);
		report(cuMemCreate(&h, G, &prop, 0));
	}
	if (strcmp(rule, "map-misaligned-address") == 0) {
		p = reserve(2 * G);
		report(cuMemMap(p + 4096, G, 0, create(G), 0));
	}
	if (strcmp(rule, "map-outside-reservation") == 0) {
		p = reserve(G);
		report(cuMemMap(p + G, G, 0, create(G), 0));
	}
	if (strcmp(rule, "map-over-mapping") == 0) {
		p = reserve(G);
		MUST(cuMemMap(p, G, 0, create(G), 0));
		report(cuMemMap(p, G, 0, create(G), 0));
	}
	if (strcmp(rule, "export-with-handle-type") == 0) {
		int fd = -1;
		report(cuMemExportToShareableHandle(&fd, create(G), 1, 0));
	}
	if (strcmp(rule, "export-without-handle-type") == 0) {
		prop.requestedHandleTypes = 0;
		int fd = -1;
		report(cuMemExportToShareableHandle(&fd, create(G), 1, 0));
	}
	if (strcmp(rule, "copy-before-set-access") == 0) {
		p = reserve(G);
		MUST(cuMemMap(p, G, 0, create(G), 0));
		report(cuMemcpyHtoD_v2(p, buf, sizeof buf));
	}
	if (strcmp(rule, "copy-after-set-access") == 0) {
		p = mapped(&h);
		report(cuMemcpyHtoD_v2(p, buf, sizeof buf));
	}
	if (strcmp(rule, "copy-without-context") == 0) {
		p = mapped(&h);
		MUST(cuCtxSetCurrent(NULL));
		report(cuMemcpyHtoD_v2(p, buf, sizeof buf));
	}
	if (strcmp(rule, "set-access-unmapped") == 0) {
		p = reserve(2 * G);
		MUST(cuMemMap(p, G, 0, create(G), 0));
		CUmemAccessDesc d = {{1, 0}, 3};
		report(cuMemSetAccess(p, 2 * G, &d, 1));
	}
	if (strcmp(rule, "unmap-sub-range") == 0) {
		p = reserve(2 * G);
		MUST(cuMemMap(p, 2 * G, 0, create(2 * G), 0));
		report(cuMemUnmap(p, G));
	}
	if (strcmp(rule, "free-reservation-with-mapping") == 0) {
		p = reserve(G);
		MUST(cuMemMap(p, G, 0, create(G), 0));
		report(cuMemAddressFree(p, G));
	}
	if (strcmp(rule, "free-reservation-wrong-size") == 0) {
		p = reserve(2 * G);
		report(cuMemAddressFree(p, G));
	}
	if (strcmp(rule, "release-while-mapped") == 0) {
		// Legal: the memory stays until the mapping goes.
		p = mapped(&h);
		MUST(cuMemcpyHtoD_v2(p, buf, sizeof buf));
		MUST(cuMemRelease(h));
		char got[64] = {0};
		CUresult r = cuMemcpyDtoH_v2(got, p, sizeof got);
		if (r == 0 && memcmp(got, buf, sizeof buf) != 0) {
			printf("mismatch\n\n");
			return 0;
		}
		report(r);
	}
	if (strcmp(rule, "import-shows-same-bytes") == 0) {
		p = mapped(&h);
		MUST(cuMemcpyHtoD_v2(p + 100, buf, sizeof buf));
		int fd = -1;
		MUST(cuMemExportToShareableHandle(&fd, h, 1, 0));
		MUST(cuMemImportFromShareableHandle(&h2, (void *)(intptr_t)fd, 1));
		close(fd);
		p2 = reserve(G);
		MUST(cuMemMap(p2, G, 0, h2, 0));
		access_rw(p2, G);
		char got[64] = {0};
		CUresult r = cuMemcpyDtoH_v2(got, p2 + 100, sizeof got);
		if (r == 0 && memcmp(got, buf, sizeof buf) != 0) {
			printf("mismatch\n\n");
			return 0;
		}
		report(r);
	}
	if (strcmp(rule, "import-foreign-fd") == 0) {
		int fd = memfd_create("not-exported", 0);
		report(cuMemImportFromShareableHandle(&h2, (void *)(intptr_t)fd, 1));
	}
	if (strcmp(rule, "host-mmap-exported-fd") == 0) {
		int fd = -1;
		MUST(cuMemExportToShareableHandle(&fd, create(G), 1, 0));
		void *m = mmap(NULL, G, PROT_READ, MAP_SHARED, fd, 0);
		printf("errno %d\n\n", m == MAP_FAILED ? errno : 0);
		return 0;
	}
	if (strcmp(rule, "calls-counted") == 0) {
		// One cuMemCreate refused, three made: all four counted.
		(void)cuMemCreate(&h, G / 2, &prop, 0);
		create(G);
		create(G);
		create(G);
		printf("%llu %llu\n\n", fakecuda_calls("cuMemCreate"), fakecuda_calls("cuInit"));
		return 0;
	}
	if (strcmp(rule, "async-pinned-runs-at-sync") == 0) {
		// A copy into pinned memory lands when the event after it is
		// waited for, not before.
		p = mapped(&h);
		MUST(cuMemcpyHtoD_v2(p, buf, sizeof buf));
		MUST(cuMemHostAlloc((void **)&pin, sizeof buf, CU_MEMHOSTALLOC_PORTABLE));
		strcpy(pin, "old");
		s = stream();
		MUST(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
		MUST(cuMemcpyDtoHAsync_v2(pin, p, sizeof buf, s));
		MUST(cuEventRecord(ev, s));
		printf("before %s, queued %lld", pin, fakecuda_live("queued"));
		MUST(cuEventSynchronize(ev));
		printf(", after %s, queued %lld\n\n", pin, fakecuda_live("queued"));
		return 0;
	}
	if (strcmp(rule, "async-pageable-runs-at-once") == 0) {
		// [Sync]: pageable memory makes the copy synchronous.
		p = mapped(&h);
		MUST(cuMemcpyHtoD_v2(p, buf, sizeof buf));
		char got[64] = "old";
		MUST(cuMemcpyDtoHAsync_v2(got, p, sizeof got, stream()));
		printf("after call %s, queued %lld\n\n", got, fakecuda_live("queued"));
		return 0;
	}
	if (strcmp(rule, "dtod-copies-bytes") == 0) {
		p = mapped(&h);
		MUST(cuMemcpyHtoD_v2(p + 7, buf, sizeof buf));
		p2 = mapped(&h2);
		s = stream();
		MUST(cuMemcpyDtoDAsync_v2(p2 + G - sizeof buf, imported(h, CU_MEM_ACCESS_FLAGS_PROT_READ) + 7, sizeof buf, s));
		MUST(cuStreamSynchronize(s));
		char got[64] = {0};
		MUST(cuMemcpyDtoH_v2(got, p2 + G - sizeof got, sizeof got));
		printf("%s\n\n", memcmp(got, buf, sizeof buf) == 0 ? "same" : "mismatch");
		return 0;
	}
	if (strcmp(rule, "dtod-into-read-only") == 0) {
		p = mapped(&h);
		report(cuMemcpyDtoDAsync_v2(imported(h, CU_MEM_ACCESS_FLAGS_PROT_READ), p, 64, stream()));
	}
	if (strcmp(rule, "dtod-from-no-access") == 0) {
		p = mapped(&h);
		report(cuMemcpyDtoDAsync_v2(p, imported(h, CU_MEM_ACCESS_FLAGS_PROT_NONE), 64, stream()));
	}
	if (strcmp(rule, "dtod-past-mapping") == 0) {
		p = mapped(&h);
		p2 = mapped(&h2);
		report(cuMemcpyDtoDAsync_v2(p2, p + 64, G, stream()));
	}
	if (strcmp(rule, "copy-on-destroyed-stream") == 0) {
		p = mapped(&h);
		s = stream();
		MUST(cuStreamDestroy_v2(s));
		report(cuMemcpyHtoDAsync_v2(p, buf, sizeof buf, s));
	}
	if (strcmp(rule, "record-on-destroyed-stream") == 0) {
		s = stream();
		MUST(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
		MUST(cuStreamDestroy_v2(s));
		report(cuEventRecord(ev, s));
	}
	if (strcmp(rule, "sync-destroyed-event") == 0) {
		MUST(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
		MUST(cuEventDestroy_v2(ev));
		report(cuEventSynchronize(ev));
	}
	if (strcmp(rule, "destroy-stream-runs-queued") == 0) {
		p = mapped(&h);
		MUST(cuMemHostAlloc((void **)&pin, sizeof buf, 0));
		strcpy(pin, "queued bytes");
		s = stream();
		MUST(cuMemcpyHtoDAsync_v2(p, pin, sizeof buf, s));
		printf("queued %lld", fakecuda_live("queued"));
		MUST(cuStreamDestroy_v2(s));
		char got[64] = {0};
		MUST(cuMemcpyDtoH_v2(got, p, sizeof got));
		printf(", then %lld: %s\n\n", fakecuda_live("queued"), got);
		return 0;
	}
	if (strcmp(rule, "unmap-runs-queued") == 0) {
		p = mapped(&h);
		MUST(cuMemHostAlloc((void **)&pin, sizeof buf, 0));
		s = stream();
		MUST(cuMemcpyDtoHAsync_v2(pin, p, sizeof buf, s));
		printf("queued %lld", fakecuda_live("queued"));
		MUST(cuMemUnmap(p, G));
		printf(", then %lld, mappings %lld\n\n", fakecuda_live("queued"), fakecuda_live("mappings"));
		return 0;
	}
	if (strcmp(rule, "stream-bad-flags") == 0) report(cuStreamCreate(&s, 4));
	if (strcmp(rule, "event-interprocess-with-timing") == 0) report(cuEventCreate(&ev, CU_EVENT_INTERPROCESS));
	if (strcmp(rule, "host-alloc-bad-flags") == 0) report(cuMemHostAlloc((void **)&pin, 64, 8));
	if (strcmp(rule, "host-alloc-without-context") == 0) {
		MUST(cuCtxSetCurrent(NULL));
		report(cuMemHostAlloc((void **)&pin, 64, 0));
	}
	if (strcmp(rule, "free-host-foreign") == 0) report(cuMemFreeHost(buf));
	if (strcmp(rule, "can-access-peer") == 0 || strcmp(rule, "can-access-peer-none") == 0) {
		// FAKECUDA_DEVICES=2.
		int a = -1, b = -1;
		MUST(cuDeviceCanAccessPeer(&a, 0, 1));
		MUST(cuDeviceCanAccessPeer(&b, 0, 0));
		printf("%d %d\n\n", a, b);
		return 0;
	}
	if (strcmp(rule, "import-keeps-device") == 0 || strncmp(rule, "set-access-with", 15) == 0) {
		// FAKECUDA_DEVICES=2: memory of device 1, imported in the context
		// of device 0.
		prop.location.id = 1;
		h = create(G);
		int fd = -1;
		MUST(cuMemExportToShareableHandle(&fd, h, 1, 0));
		MUST(cuMemImportFromShareableHandle(&h2, (void *)(intptr_t)fd, 1));
		CUmemAllocationProp got;
		MUST(cuMemGetAllocationPropertiesFromHandle(&got, h2));
		if (strcmp(rule, "import-keeps-device") == 0) {
			printf("device %d\n\n", got.location.id);
			return 0;
		}
		p = reserve(G);
		MUST(cuMemMap(p, G, 0, h2, 0));
		CUmemAccessDesc d = {{1, 0}, CU_MEM_ACCESS_FLAGS_PROT_READ};
		report(cuMemSetAccess(p, G, &d, 1));
	}
	if (strcmp(rule, "host-touch") == 0) {
		p = mapped(&h);
		MUST(cuMemcpyHtoD_v2(p, buf, sizeof buf));
		volatile char *host = (volatile char *)(uintptr_t)p;
		printf("read %d\n\n", host[0]); // faults: device memory is not host memory
		return 0;
	}
	fprintf(stderr, "rules: unknown rule %s\n", rule);
	return 2;
}
