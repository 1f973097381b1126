// fakecuda.c: a stand-in for the NVIDIA CUDA driver library (libcuda.so.1)
// on machines without a GPU. It exports the driver API entry points that
// kvsidecar's vmm/cuda loads with dlopen/dlsym — the _v2 ones where the
// driver has both, and nothing else, so a load of a legacy 32-bit entry point
// fails here as a missing symbol — and emulates them with host memory:
//
//   - an allocation (cuMemCreate) is a memfd of its size;
//   - a reserved range (cuMemAddressReserve) is an anonymous PROT_NONE
//     mapping and stays PROT_NONE whatever is mapped into it, so host code
//     that dereferences a device address faults (SIGSEGV), as it would on a
//     GPU; the bytes move only through cuMemcpyHtoD_v2/cuMemcpyDtoH_v2
//     (pwrite/pread on the memfd of the mapping that covers the address);
//   - an exported POSIX file descriptor is an O_PATH descriptor of the
//     memfd: it can be passed over SCM_RIGHTS and imported by another process
//     (which reopens the memfd through /proc/self/fd), but mmap of it fails
//     with EBADF, as mmap of a real driver's exported descriptor fails; the
//     memfd's name carries the device the memory lives on, so an import
//     knows it as the driver does;
//   - page-locked host memory (cuMemHostAlloc) is an anonymous mapping the
//     fake remembers, so an asynchronous copy knows whether its host side is
//     pinned;
//   - a stream is a queue: an asynchronous copy that the reference lets run
//     after the call returns (pinned host memory, device to device) is only
//     queued, and runs when the stream is synchronized (cuStreamSynchronize,
//     cuEventSynchronize of an event recorded after it, cuStreamDestroy_v2,
//     or a call with synchronous behaviour such as cuMemUnmap), so a caller
//     that touches a buffer before waiting sees the old bytes, as it may on
//     a GPU.
//
// Every rule below comes from the CUDA Driver API reference (CUDA 12.x:
// "6.14 Virtual Memory Management", cited per function as [VMM]; "6.3
// Initialization", "6.5 Device Management", "6.7 Primary Context Management",
// "6.8 Context Management" and "6.13 Memory Management" as [Init], [Device],
// [Primary], [Ctx] and [Mem]; "Stream Management", "Event Management" and
// "Peer Context Memory Access" as [Stream], [Event] and [Peer]; its
// introduction's "API synchronization behavior" as [Sync]; the device
// attributes and CUmemAllocationProp from the comments of cuda.h 12.x as
// [cuda.h]),
// and a call that breaks one returns the CUresult that section documents for
// it. Where the reference is silent, the comment says so and what the fake
// does instead.
//
// Configuration, read from the environment at each cuInit (a test sets it
// before the code under test initialises the driver):
//   FAKECUDA_DEVICES        number of devices (default 1, at most 16)
//   FAKECUDA_GRANULARITY    bytes cuMemGetAllocationGranularity reports
//                           (default 2097152; any value, to test callers'
//                           checks of a bad one)
//   FAKECUDA_DEVICE_MEMORY  bytes of cuMemCreate allocations each device
//                           holds before CUDA_ERROR_OUT_OF_MEMORY (default
//                           16 GiB; memfd pages are only used when written)
//   FAKECUDA_NO_POSIX_FD=1  the devices cannot export POSIX file descriptors
//                           (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_
//                           DESCRIPTOR_SUPPORTED is 0)
//   FAKECUDA_NO_PEER_ACCESS=1
//                           no device can access another's memory
//                           (cuDeviceCanAccessPeer is 0 for every pair;
//                           default 1 for every pair of distinct devices)
// and at every call, when their value changed:
//   FAKECUDA_FAIL=name:k:result[,...]
//                           the k-th call of entry point name, counted from
//                           the first call that saw this value, returns
//                           result without doing anything (fault injection)
//   FAKECUDA_TRACE=path     append one line per call to path:
//                           "<name> <CUresult>[ key=value...][ injected|
//                           why: <text>]", the key=value arguments for the
//                           calls that have them: bytes=, host=pinned or
//                           host=pageable (the host side of a copy),
//                           stream= (a handle, 0 for the NULL stream),
//                           flags=, and ops= (queued copies a
//                           synchronization ran)
//   FAKECUDA_VERBOSE=1      also print every refused call to stderr
//
// Test hooks exported besides the driver API: fakecuda_calls(name) (calls of
// an entry point since load), fakecuda_last_error() (why this thread's last
// refused call was refused), fakecuda_live(what) (what the driver holds now:
// "mappings", "allocations", "reservations", "host", "streams", "events",
// "queued").

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

#include "cuda_abi.h"

// The CUDA version this fake reports and whose reference it follows.
#define FAKE_DRIVER_VERSION 12040
#define MAX_DEVICES 16

// Entry points, for counting, tracing and fault injection.
enum {
	C_Init, C_DriverGetVersion, C_DeviceGet, C_DeviceGetAttribute, C_DevicePrimaryCtxRetain,
	C_DevicePrimaryCtxRelease, C_CtxSetCurrent, C_MemGetAllocationGranularity, C_MemAddressReserve,
	C_MemAddressFree, C_MemCreate, C_MemRelease, C_MemMap, C_MemUnmap, C_MemSetAccess,
	C_MemExportToShareableHandle, C_MemImportFromShareableHandle, C_MemcpyHtoD, C_MemcpyDtoH,
	C_MemHostAlloc, C_MemFreeHost, C_StreamCreate, C_StreamDestroy, C_StreamSynchronize, C_EventCreate,
	C_EventRecord, C_EventSynchronize, C_EventDestroy, C_MemcpyHtoDAsync, C_MemcpyDtoHAsync, C_MemcpyDtoDAsync,
	C_DeviceCanAccessPeer, C_MemGetAllocationPropertiesFromHandle, C_N
};
static const char *const names[C_N] = {
	"cuInit", "cuDriverGetVersion", "cuDeviceGet", "cuDeviceGetAttribute", "cuDevicePrimaryCtxRetain",
	"cuDevicePrimaryCtxRelease_v2", "cuCtxSetCurrent", "cuMemGetAllocationGranularity", "cuMemAddressReserve",
	"cuMemAddressFree", "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess",
	"cuMemExportToShareableHandle", "cuMemImportFromShareableHandle", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2",
	"cuMemHostAlloc", "cuMemFreeHost", "cuStreamCreate", "cuStreamDestroy_v2", "cuStreamSynchronize", "cuEventCreate",
	"cuEventRecord", "cuEventSynchronize", "cuEventDestroy_v2", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2",
	"cuMemcpyDtoDAsync_v2", "cuDeviceCanAccessPeer", "cuMemGetAllocationPropertiesFromHandle",
};

struct alloc {
	CUmemGenericAllocationHandle handle;
	int fd;          // the memfd, read-write
	char *view;      // read-only host mapping of fd, made at the first device-to-device copy from it
	size_t size;
	size_t gran;     // granularity of its properties
	int dev;
	int handleTypes; // requestedHandleTypes at create (or of the import)
	int imported;
	int released;    // cuMemRelease called; freed once maps drops to 0
	int maps;
};

struct mapping {
	uintptr_t base;
	size_t size;
	struct alloc *a;
	int access[MAX_DEVICES]; // CU_MEM_ACCESS_FLAGS_* of each device
};

// hostAlloc is page-locked host memory from cuMemHostAlloc.
struct hostAlloc {
	uintptr_t base;
	size_t size;   // as asked
	size_t mapped; // size rounded up to the host page
};

// op is a copy queued on a stream; it runs when the stream is synchronized.
enum { OP_HTOD, OP_DTOH, OP_DTOD };
struct op {
	int kind;
	CUdeviceptr dst, src; // the device sides
	char *host;           // the host side: page-locked memory
	size_t n;
};

// A stream is never freed, so a destroyed one is still recognised.
struct CUstream_st {
	int live;
	int dev;
	int blocking;              // created with CU_STREAM_DEFAULT: synchronizes with the NULL stream
	struct op *ops;
	size_t head, nops, capops; // ops[head, nops) wait to run
	unsigned long long enq;    // copies queued since creation
	unsigned long long done;   // of those, run
	CUresult sticky;           // the first failure of a queued copy, reported by every later synchronization
};

// An event is never freed either.
struct CUevent_st {
	int live;
	int dev;
	struct CUstream_st *s;  // where it was last recorded; NULL: never, or on the NULL stream
	unsigned long long at;  // s->enq when recorded: complete once s->done reaches it
};

struct reservation {
	uintptr_t base;
	size_t size;
};

struct CUctx_st { int dev; };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static int ndev = 1;
static size_t granularity = 2u << 20;
static unsigned long long devmem = 16ull << 30;
static unsigned long long used[MAX_DEVICES];
static int posixSupported = 1;
static int peerAccess = 1;
static struct CUctx_st ctxs[MAX_DEVICES];
static int retained[MAX_DEVICES];
static __thread CUcontext current;
static __thread char why[512];

static struct alloc **allocs;
static size_t nallocs, capallocs;
static struct mapping *maps;
static size_t nmaps, capmaps;
static struct reservation *res;
static size_t nres, capres;
static CUmemGenericAllocationHandle nextHandle = 0x100;
static struct hostAlloc *hosts;
static size_t nhosts, caphosts;
static struct CUstream_st **streams;
static size_t nstreams, capstreams;
static struct CUevent_st **events;
static size_t nevents, capevents;

static unsigned long long calls[C_N];

// Fault injection state: the spec last seen and the calls counted since.
#define MAX_FAULTS 16
static char *failSpec;
static struct { int call; unsigned long long nth; CUresult result; } faults[MAX_FAULTS];
static int nfaults;
static unsigned long long since[C_N];

static char *tracePath;
static int traceFd = -1;
static int verbose;
// The key=value arguments of this thread's current call, for its trace line.
static __thread char args[256];

static int envInt(const char *name, long long def, long long *out) {
	const char *s = getenv(name);
	if (!s || !*s) {
		*out = def;
		return 0;
	}
	char *end;
	errno = 0;
	long long v = strtoll(s, &end, 0);
	if (errno || *end) {
		*out = def;
		return -1;
	}
	*out = v;
	return 0;
}

static int callByName(const char *s, size_t n) {
	for (int i = 0; i < C_N; i++) {
		if (strlen(names[i]) == n && strncmp(names[i], s, n) == 0) return i;
	}
	return -1;
}

// refresh picks up a changed FAKECUDA_FAIL or FAKECUDA_TRACE. Caller holds mu.
static void refresh(void) {
	const char *f = getenv("FAKECUDA_FAIL");
	if (!f) f = "";
	if (!failSpec || strcmp(f, failSpec) != 0) {
		free(failSpec);
		failSpec = strdup(f);
		nfaults = 0;
		memset(since, 0, sizeof since);
		const char *p = f;
		while (*p && nfaults < MAX_FAULTS) {
			const char *colon = strchr(p, ':');
			if (!colon) break;
			int c = callByName(p, (size_t)(colon - p));
			char *end;
			unsigned long long nth = strtoull(colon + 1, &end, 10);
			if (*end != ':') break;
			long r = strtol(end + 1, &end, 10);
			if (c >= 0 && nth > 0) {
				faults[nfaults].call = c;
				faults[nfaults].nth = nth;
				faults[nfaults].result = (CUresult)r;
				nfaults++;
			} else {
				fprintf(stderr, "fakecuda: FAKECUDA_FAIL: cannot use %.*s\n", (int)(end - p), p);
			}
			p = *end == ',' ? end + 1 : end;
		}
	}
	const char *t = getenv("FAKECUDA_TRACE");
	if (!t) t = "";
	if (!tracePath || strcmp(t, tracePath) != 0) {
		free(tracePath);
		tracePath = strdup(t);
		if (traceFd >= 0) close(traceFd);
		traceFd = *t ? open(t, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600) : -1;
	}
	const char *v = getenv("FAKECUDA_VERBOSE");
	verbose = v && strcmp(v, "1") == 0;
}

// enter counts the call and returns the injected result, if any.
static CUresult enter(int c) {
	pthread_mutex_lock(&mu);
	refresh();
	calls[c]++;
	unsigned long long n = ++since[c];
	why[0] = 0;
	args[0] = 0;
	for (int i = 0; i < nfaults; i++) {
		if (faults[i].call == c && faults[i].nth == n) {
			snprintf(why, sizeof why, "injected by FAKECUDA_FAIL (call %llu)", n);
			return faults[i].result;
		}
	}
	return CUDA_SUCCESS;
}

static CUresult leave(int c, CUresult r, int injected) {
	const char *sep = args[0] ? " " : "";
	if (r != CUDA_SUCCESS) {
		char line[1000];
		int n = snprintf(line, sizeof line, "%s %d%s%s %s%s\n", names[c], r, sep, args, injected ? "injected" : "why: ", injected ? "" : why);
		if (traceFd >= 0) (void)!write(traceFd, line, n > 0 && (size_t)n < sizeof line ? (size_t)n : strlen(line));
		if (verbose) fprintf(stderr, "fakecuda: %s", line);
	} else if (traceFd >= 0) {
		char line[400];
		int n = snprintf(line, sizeof line, "%s 0%s%s\n", names[c], sep, args);
		(void)!write(traceFd, line, n > 0 && (size_t)n < sizeof line ? (size_t)n : strlen(line));
	}
	pthread_mutex_unlock(&mu);
	return r;
}

// arg appends "key=value" to this call's trace arguments. Caller holds mu.
static void arg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void arg(const char *fmt, ...) {
	size_t n = strlen(args);
	if (n && n + 1 < sizeof args) args[n++] = ' ';
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(args + n, sizeof args - n, fmt, ap);
	va_end(ap);
}

// bad records why the call is refused and returns r.
static CUresult bad(CUresult r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static CUresult bad(CUresult r, const char *fmt, ...) {
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(why, sizeof why, fmt, ap);
	va_end(ap);
	return r;
}

#define CALL(c, expr)                                     \
	do {                                                  \
		CUresult inj_ = enter(c);                         \
		if (inj_ != CUDA_SUCCESS) return leave(c, inj_, 1); \
		return leave(c, (expr), 0);                       \
	} while (0)

// CALLA is CALL for a call whose trace line carries arguments: describe
// (calls of arg) runs under the lock before the fault check, so an injected
// failure is traced with its arguments too.
#define CALLA(c, describe, expr)                          \
	do {                                                  \
		CUresult inj_ = enter(c);                         \
		describe;                                         \
		if (inj_ != CUDA_SUCCESS) return leave(c, inj_, 1); \
		return leave(c, (expr), 0);                       \
	} while (0)

#define NEED_INIT()                                                              \
	do {                                                                         \
		if (!initialized) return bad(CUDA_ERROR_NOT_INITIALIZED, "cuInit was not called"); \
	} while (0)

static int grow(void **p, size_t *cap, size_t n, size_t elem) {
	if (n < *cap) return 0;
	size_t c = *cap ? *cap * 2 : 64;
	void *q = realloc(*p, c * elem);
	if (!q) return -1;
	*p = q;
	*cap = c;
	return 0;
}

static struct alloc *findAlloc(CUmemGenericAllocationHandle h) {
	for (size_t i = 0; i < nallocs; i++) {
		if (allocs[i]->handle == h && !allocs[i]->released) return allocs[i];
	}
	return NULL;
}

// freeIfDone frees an allocation whose handle was released and that no
// mapping uses: [VMM] cuMemRelease "The memory allocation will be freed when
// all outstanding mappings to the memory are unmapped and when all
// outstanding references to the handle (including its shareable
// counterparts) are also released." The memfd stays alive while an exported
// descriptor (a shareable counterpart) is open, as the kernel keeps it.
static void freeIfDone(struct alloc *a) {
	if (!a->released || a->maps > 0) return;
	for (size_t i = 0; i < nallocs; i++) {
		if (allocs[i] == a) {
			allocs[i] = allocs[--nallocs];
			break;
		}
	}
	if (!a->imported) used[a->dev] -= a->size;
	if (a->view) munmap(a->view, a->size);
	close(a->fd);
	free(a);
}

static struct reservation *findRes(uintptr_t p, size_t n) {
	for (size_t i = 0; i < nres; i++) {
		if (p >= res[i].base && p + n >= p && p + n <= res[i].base + res[i].size) return &res[i];
	}
	return NULL;
}

// covered reports whether [p, p+n) is exactly a run of whole, adjacent
// mappings (first and last included), and counts them.
static int covered(uintptr_t p, size_t n, size_t *count) {
	uintptr_t at = p, end = p + n;
	*count = 0;
	while (at < end) {
		size_t i;
		for (i = 0; i < nmaps; i++) {
			if (maps[i].base == at) break;
		}
		if (i == nmaps || maps[i].base + maps[i].size > end) return 0;
		at += maps[i].size;
		(*count)++;
	}
	return at == end && n > 0;
}

static int overlapsMapping(uintptr_t p, size_t n) {
	for (size_t i = 0; i < nmaps; i++) {
		if (p < maps[i].base + maps[i].size && maps[i].base < p + n) return 1;
	}
	return 0;
}

static int isPow2(size_t v) { return v && (v & (v - 1)) == 0; }

// canPeer is [Peer] cuDeviceCanAccessPeer(dev, peer): distinct devices reach
// each other unless FAKECUDA_NO_PEER_ACCESS=1; a device and itself answer 0,
// as the driver does (a device's own memory needs no peer access).
static int canPeer(int dev, int peer) {
	return peerAccess && dev != peer && dev >= 0 && dev < ndev && peer >= 0 && peer < ndev;
}

// findMap returns the mapping that holds address p, or NULL.
static struct mapping *findMap(uintptr_t p) {
	for (size_t i = 0; i < nmaps; i++) {
		if (p >= maps[i].base && p < maps[i].base + maps[i].size) return &maps[i];
	}
	return NULL;
}

// moveHost moves n bytes between host memory and [dptr, dptr+n) (pwrite or
// pread on the memfd of each mapping the range covers); the caller checked
// the range.
static CUresult moveHost(CUdeviceptr dptr, char *host, size_t n, int write) {
	uintptr_t at = (uintptr_t)dptr, end = at + n;
	for (uintptr_t p = at; p < end;) {
		struct mapping *m = findMap(p);
		if (!m) return bad(CUDA_ERROR_ILLEGAL_ADDRESS, "%#lx was unmapped under a queued copy", (unsigned long)p);
		size_t chunk = m->base + m->size - p;
		if (chunk > end - p) chunk = end - p;
		off_t off = (off_t)(p - m->base);
		char *h = host + (p - at);
		size_t done = 0;
		while (done < chunk) {
			ssize_t k = write ? pwrite(m->a->fd, h + done, chunk - done, off + (off_t)done)
			                  : pread(m->a->fd, h + done, chunk - done, off + (off_t)done);
			if (k < 0 && errno == EINTR) continue;
			if (k <= 0) return bad(CUDA_ERROR_OPERATING_SYSTEM, "%s: %s", write ? "pwrite" : "pread", k < 0 ? strerror(errno) : "short");
			done += (size_t)k;
		}
		p += chunk;
	}
	return CUDA_SUCCESS;
}

// moveDev moves n bytes from [src, src+n) to [dst, dst+n): a pwrite into
// the destination's memfd from a read-only mapping of the source's, with
// no copy through a host buffer. The caller checked both ranges.
static CUresult moveDev(CUdeviceptr dst, CUdeviceptr src, size_t n) {
	for (size_t done = 0; done < n;) {
		struct mapping *dm = findMap((uintptr_t)dst + done), *sm = findMap((uintptr_t)src + done);
		if (!dm || !sm) return bad(CUDA_ERROR_ILLEGAL_ADDRESS, "%#llx or %#llx was unmapped under a queued copy", dst + done, src + done);
		size_t doff = (uintptr_t)dst + done - dm->base, soff = (uintptr_t)src + done - sm->base;
		size_t chunk = n - done;
		if (chunk > dm->size - doff) chunk = dm->size - doff;
		if (chunk > sm->size - soff) chunk = sm->size - soff;
		struct alloc *a = sm->a;
		if (!a->view) {
			void *v = mmap(NULL, a->size, PROT_READ, MAP_SHARED, a->fd, 0);
			if (v == MAP_FAILED) return bad(CUDA_ERROR_OPERATING_SYSTEM, "mmap of allocation %#llx: %s", a->handle, strerror(errno));
			a->view = v;
		}
		for (size_t k = 0; k < chunk;) {
			ssize_t w = pwrite(dm->a->fd, a->view + soff + k, chunk - k, (off_t)(doff + k));
			if (w < 0 && errno == EINTR) continue;
			if (w <= 0) return bad(CUDA_ERROR_OPERATING_SYSTEM, "pwrite: %s", w < 0 ? strerror(errno) : "short");
			k += (size_t)w;
		}
		done += chunk;
	}
	return CUDA_SUCCESS;
}

static CUresult runCopy(int kind, CUdeviceptr dst, CUdeviceptr src, char *host, size_t n) {
	switch (kind) {
	case OP_HTOD: return moveHost(dst, host, n, 1);
	case OP_DTOH: return moveHost(src, host, n, 0);
	}
	return moveDev(dst, src, n);
}

static int liveStream(struct CUstream_st *s) {
	for (size_t i = 0; i < nstreams; i++) {
		if (streams[i] == s) return s->live && retained[s->dev] > 0;
	}
	return 0;
}

// runUntil runs the copies queued on s until upto of them ran since its
// creation (or the queue is empty), and returns how many it ran. A copy that
// fails makes the stream's sticky error, as an asynchronous failure is
// reported by a later synchronization. The reason of the current call is
// kept.
static unsigned long long runUntil(struct CUstream_st *s, unsigned long long upto) {
	unsigned long long ran = 0;
	char saved[sizeof why];
	memcpy(saved, why, sizeof why);
	while (s->done < upto && s->head < s->nops) {
		struct op *o = &s->ops[s->head++];
		CUresult r = runCopy(o->kind, o->dst, o->src, o->host, o->n);
		if (r && !s->sticky) s->sticky = r;
		s->done++;
		ran++;
	}
	if (s->head == s->nops) s->head = s->nops = 0;
	memcpy(why, saved, sizeof why);
	return ran;
}

static unsigned long long drain(struct CUstream_st *s) { return runUntil(s, s->enq); }

// drainAll runs every queued copy of every stream (of device dev, or of
// every device when dev < 0), or only of the blocking streams.
static unsigned long long drainAll(int dev, int onlyBlocking) {
	unsigned long long ran = 0;
	for (size_t i = 0; i < nstreams; i++) {
		if ((dev < 0 || streams[i]->dev == dev) && (!onlyBlocking || streams[i]->blocking)) ran += drain(streams[i]);
	}
	return ran;
}

// legacySync is what work on the NULL (legacy default) stream of device dev
// waits for first: [Stream] "the NULL stream ... synchronizes with all other
// blocking streams" (those made with CU_STREAM_DEFAULT; CU_STREAM_NON_BLOCKING
// "Work running in the created stream may run concurrently with work in
// stream 0 (the NULL stream)"). The fake runs NULL-stream work at once.
static void legacySync(int dev) { drainAll(dev, 1); }

// enqueue queues a copy on s.
static CUresult enqueue(struct CUstream_st *s, int kind, CUdeviceptr dst, CUdeviceptr src, char *host, size_t n) {
	if (grow((void **)&s->ops, &s->capops, s->nops, sizeof *s->ops)) return bad(CUDA_ERROR_OUT_OF_MEMORY, "host out of memory");
	s->ops[s->nops++] = (struct op){.kind = kind, .dst = dst, .src = src, .host = host, .n = n};
	s->enq++;
	return CUDA_SUCCESS;
}

// checkProp validates allocation properties against [cuda.h]
// CUmemAllocationProp and [VMM] cuMemCreate.
static CUresult checkProp(const CUmemAllocationProp *p) {
	if (!p) return bad(CUDA_ERROR_INVALID_VALUE, "prop is NULL");
	if (p->type != CU_MEM_ALLOCATION_TYPE_PINNED)
		return bad(CUDA_ERROR_INVALID_VALUE, "prop.type %d is not CU_MEM_ALLOCATION_TYPE_PINNED", p->type);
	// The fake emulates device memory only; HOST and HOST_NUMA locations are
	// not emulated.
	if (p->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
		return bad(CUDA_ERROR_INVALID_VALUE, "prop.location.type %d is not CU_MEM_LOCATION_TYPE_DEVICE", p->location.type);
	if (p->location.id < 0 || p->location.id >= ndev)
		return bad(CUDA_ERROR_INVALID_DEVICE, "prop.location.id %d: %d devices", p->location.id, ndev);
	// [cuda.h] win32HandleMetaData: "In all other cases, this field is
	// required to be zero."
	if (p->win32HandleMetaData)
		return bad(CUDA_ERROR_INVALID_VALUE, "prop.win32HandleMetaData is set on Linux");
	if (p->requestedHandleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
		return bad(CUDA_ERROR_NOT_SUPPORTED, "prop.requestedHandleTypes %#x: only CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR is emulated", p->requestedHandleTypes);
	// [cuda.h] CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
	// "Device supports exporting memory to a posix file descriptor with
	// cuMemExportToShareableHandle, if requested via cuMemCreate".
	if ((p->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) && !posixSupported)
		return bad(CUDA_ERROR_NOT_SUPPORTED, "device %d cannot export POSIX file descriptors (FAKECUDA_NO_POSIX_FD)", p->location.id);
	if (p->allocFlags.compressionType != 0)
		return bad(CUDA_ERROR_NOT_SUPPORTED, "prop.allocFlags.compressionType %d: compression is not emulated", p->allocFlags.compressionType);
	return CUDA_SUCCESS;
}

// granularityOf is the granularity of valid properties p: the same for every
// set this fake accepts, as on current GPUs for device memory.
static size_t granularityOf(const CUmemAllocationProp *p) {
	(void)p;
	return granularity;
}

static CUresult doInit(unsigned int flags) {
	// [Init] cuInit: "Currently, the Flags parameter must be 0."
	if (flags != 0) return bad(CUDA_ERROR_INVALID_VALUE, "flags %u must be 0", flags);
	long long v;
	envInt("FAKECUDA_DEVICES", 1, &v);
	ndev = v < 0 ? 0 : v > MAX_DEVICES ? MAX_DEVICES : (int)v;
	envInt("FAKECUDA_GRANULARITY", 2 << 20, &v);
	granularity = (size_t)v;
	envInt("FAKECUDA_DEVICE_MEMORY", 16ll << 30, &v);
	devmem = (unsigned long long)v;
	const char *s = getenv("FAKECUDA_NO_POSIX_FD");
	posixSupported = !(s && strcmp(s, "1") == 0);
	s = getenv("FAKECUDA_NO_PEER_ACCESS");
	peerAccess = !(s && strcmp(s, "1") == 0);
	for (int i = 0; i < MAX_DEVICES; i++) ctxs[i].dev = i;
	initialized = 1;
	if (ndev == 0) return bad(CUDA_ERROR_NO_DEVICE, "FAKECUDA_DEVICES=0");
	return CUDA_SUCCESS;
}

static CUresult doDriverGetVersion(int *v) {
	if (!v) return bad(CUDA_ERROR_INVALID_VALUE, "driverVersion is NULL");
	*v = FAKE_DRIVER_VERSION;
	return CUDA_SUCCESS;
}

static CUresult doDeviceGet(CUdevice *d, int ordinal) {
	NEED_INIT();
	if (!d) return bad(CUDA_ERROR_INVALID_VALUE, "device is NULL");
	// [Device] cuDeviceGet returns CUDA_ERROR_INVALID_DEVICE for an ordinal
	// outside [0, cuDeviceGetCount()).
	if (ordinal < 0 || ordinal >= ndev) return bad(CUDA_ERROR_INVALID_DEVICE, "ordinal %d: %d devices", ordinal, ndev);
	*d = ordinal;
	return CUDA_SUCCESS;
}

static CUresult doDeviceGetAttribute(int *v, int attr, CUdevice d) {
	NEED_INIT();
	if (!v) return bad(CUDA_ERROR_INVALID_VALUE, "pi is NULL");
	if (d < 0 || d >= ndev) return bad(CUDA_ERROR_INVALID_DEVICE, "device %d: %d devices", d, ndev);
	switch (attr) {
	case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
		*v = 1;
		return CUDA_SUCCESS;
	case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
		*v = posixSupported;
		return CUDA_SUCCESS;
	}
	return bad(CUDA_ERROR_INVALID_VALUE, "attribute %d is not emulated", attr);
}

static CUresult doPrimaryCtxRetain(CUcontext *c, CUdevice d) {
	NEED_INIT();
	if (!c) return bad(CUDA_ERROR_INVALID_VALUE, "pctx is NULL");
	if (d < 0 || d >= ndev) return bad(CUDA_ERROR_INVALID_DEVICE, "device %d: %d devices", d, ndev);
	retained[d]++;
	*c = &ctxs[d];
	return CUDA_SUCCESS;
}

static CUresult doPrimaryCtxRelease(CUdevice d) {
	NEED_INIT();
	if (d < 0 || d >= ndev) return bad(CUDA_ERROR_INVALID_DEVICE, "device %d: %d devices", d, ndev);
	// [Primary] cuDevicePrimaryCtxRelease: the context is destroyed when the
	// usage count reaches 0; releasing one never retained is refused here.
	if (retained[d] == 0) return bad(CUDA_ERROR_INVALID_CONTEXT, "primary context of device %d is not retained", d);
	// A destroyed context takes its streams and events with it (liveStream,
	// liveEvent); the fake finishes their queued copies first.
	if (retained[d] == 1) drainAll(d, 0);
	retained[d]--;
	return CUDA_SUCCESS;
}

static int liveCtx(CUcontext c) {
	return c >= &ctxs[0] && c < &ctxs[ndev] && retained[c->dev] > 0;
}

static CUresult doCtxSetCurrent(CUcontext c) {
	NEED_INIT();
	// [Ctx] cuCtxSetCurrent: NULL unbinds; otherwise the context must be
	// valid (a primary context released to 0 is destroyed).
	if (c && !liveCtx(c)) return bad(CUDA_ERROR_INVALID_CONTEXT, "context %p is not a live primary context", (void *)c);
	current = c;
	return CUDA_SUCCESS;
}

static CUresult doGranularity(size_t *g, const CUmemAllocationProp *p, int option) {
	NEED_INIT();
	if (!g) return bad(CUDA_ERROR_INVALID_VALUE, "granularity is NULL");
	if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
		return bad(CUDA_ERROR_INVALID_VALUE, "option %d", option);
	CUresult r = checkProp(p);
	if (r) return r;
	*g = granularityOf(p);
	return CUDA_SUCCESS;
}

static CUresult doReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
	NEED_INIT();
	long page = sysconf(_SC_PAGESIZE);
	if (!ptr) return bad(CUDA_ERROR_INVALID_VALUE, "ptr is NULL");
	// [VMM] cuMemAddressReserve: flags "Currently unused, must be zero";
	// "The size and address parameters must be a multiple of the host page
	// size and the alignment must be a power of two or zero for default
	// alignment."
	if (flags) return bad(CUDA_ERROR_INVALID_VALUE, "flags %#llx must be 0", flags);
	if (size == 0 || size % (size_t)page) return bad(CUDA_ERROR_INVALID_VALUE, "size %zu is not a positive multiple of the %ld-byte host page", size, page);
	if (addr % (CUdeviceptr)page) return bad(CUDA_ERROR_INVALID_VALUE, "addr %#llx is not a multiple of the %ld-byte host page", addr, page);
	if (align && !isPow2(align)) return bad(CUDA_ERROR_INVALID_VALUE, "alignment %zu is not a power of two", align);
	if (align < (size_t)page) align = (size_t)page;
	if (grow((void **)&res, &capres, nres, sizeof *res)) return bad(CUDA_ERROR_OUT_OF_MEMORY, "host out of memory");
	// The address hint is a hint: the fake ignores it.
	size_t len = size + align;
	void *raw = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (raw == MAP_FAILED) return bad(CUDA_ERROR_OUT_OF_MEMORY, "mmap %zu bytes: %s", len, strerror(errno));
	uintptr_t base = ((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1);
	if (base > (uintptr_t)raw) munmap(raw, base - (uintptr_t)raw);
	uintptr_t end = (uintptr_t)raw + len;
	if (end > base + size) munmap((void *)(base + size), end - (base + size));
	res[nres].base = base;
	res[nres].size = size;
	nres++;
	*ptr = base;
	return CUDA_SUCCESS;
}

static CUresult doAddressFree(CUdeviceptr ptr, size_t size) {
	NEED_INIT();
	// [VMM] cuMemAddressFree: "The size must match what was given to
	// memAddressReserve and the ptr given must match what was returned from
	// memAddressReserve."
	size_t i;
	for (i = 0; i < nres; i++) {
		if (res[i].base == ptr) break;
	}
	if (i == nres) return bad(CUDA_ERROR_INVALID_VALUE, "%#llx is not the start of a reservation", ptr);
	if (res[i].size != size) return bad(CUDA_ERROR_INVALID_VALUE, "size %zu of the reservation at %#llx is %zu", size, ptr, res[i].size);
	// The reference does not say what freeing a range that still has
	// mappings does; the Programming Guide's VMM section tears down in the
	// order unmap, release, free the range. The fake refuses the free, so no
	// caller relies on either behaviour.
	if (overlapsMapping(ptr, size)) return bad(CUDA_ERROR_INVALID_VALUE, "the reservation at %#llx still has mappings: cuMemUnmap them first", ptr);
	munmap((void *)(uintptr_t)ptr, size);
	res[i] = res[--nres];
	return CUDA_SUCCESS;
}

static CUresult newAlloc(int fd, size_t size, size_t gran, int dev, int types, int imported, CUmemGenericAllocationHandle *h) {
	if (grow((void **)&allocs, &capallocs, nallocs, sizeof *allocs)) return bad(CUDA_ERROR_OUT_OF_MEMORY, "host out of memory");
	struct alloc *a = calloc(1, sizeof *a);
	if (!a) return bad(CUDA_ERROR_OUT_OF_MEMORY, "host out of memory");
	a->handle = nextHandle;
	nextHandle += 0x10;
	a->fd = fd;
	a->size = size;
	a->gran = gran;
	a->dev = dev;
	a->handleTypes = types;
	a->imported = imported;
	allocs[nallocs++] = a;
	*h = a->handle;
	return CUDA_SUCCESS;
}

static CUresult doCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *p, unsigned long long flags) {
	NEED_INIT();
	if (!h) return bad(CUDA_ERROR_INVALID_VALUE, "handle is NULL");
	// [VMM] cuMemCreate: flags "for future use, must be zero now".
	if (flags) return bad(CUDA_ERROR_INVALID_VALUE, "flags %#llx must be 0", flags);
	CUresult r = checkProp(p);
	if (r) return r;
	// [VMM] cuMemCreate: "The size of this allocation must be a multiple of
	// the the value given via cuMemGetAllocationGranularity with the
	// CU_MEM_ALLOC_GRANULARITY_MINIMUM flag" (for these properties).
	size_t g = granularityOf(p);
	if (size == 0 || g == 0 || size % g)
		return bad(CUDA_ERROR_INVALID_VALUE, "size %zu is not a positive multiple of the granularity %zu of these properties", size, g);
	int dev = p->location.id;
	if (used[dev] + size > devmem || used[dev] + size < used[dev])
		return bad(CUDA_ERROR_OUT_OF_MEMORY, "device %d holds %llu of %llu bytes (FAKECUDA_DEVICE_MEMORY)", dev, used[dev], devmem);
	// The name carries the device, for an import to read back.
	char name[32];
	snprintf(name, sizeof name, "fakecuda-alloc-dev%d", dev);
	int fd = memfd_create(name, MFD_CLOEXEC);
	if (fd < 0) return bad(CUDA_ERROR_OUT_OF_MEMORY, "memfd_create: %s", strerror(errno));
	if (ftruncate(fd, (off_t)size)) {
		close(fd);
		return bad(CUDA_ERROR_OUT_OF_MEMORY, "ftruncate %zu: %s", size, strerror(errno));
	}
	r = newAlloc(fd, size, g, dev, p->requestedHandleTypes, 0, h);
	if (r) {
		close(fd);
		return r;
	}
	used[dev] += size;
	return CUDA_SUCCESS;
}

static CUresult doRelease(CUmemGenericAllocationHandle h) {
	NEED_INIT();
	// [VMM] cuMemRelease: "If handle is not a valid handle the behavior is
	// undefined"; the fake refuses it (and a second release of one handle).
	struct alloc *a = findAlloc(h);
	if (!a) return bad(CUDA_ERROR_INVALID_VALUE, "handle %#llx is not a live allocation handle", h);
	// "The generic memory handle can be freed when there are still
	// outstanding mappings made with this handle": legal; the memory stays
	// until the last mapping is unmapped.
	a->released = 1;
	freeIfDone(a);
	return CUDA_SUCCESS;
}

static CUresult doMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
	NEED_INIT();
	// [VMM] cuMemMap: offset "currently must be zero"; flags "must be zero
	// now"; "This range must be an address reservation previously reserved
	// with cuMemAddressReserve, and offset + size must be less than the size
	// of the memory allocation. Both ptr, size, and offset must be a multiple
	// of the value given via cuMemGetAllocationGranularity with the
	// CU_MEM_ALLOC_GRANULARITY_MINIMUM flag."; "cuMemMap can only create
	// mappings on VA range reservations that are not currently mapped."
	if (flags) return bad(CUDA_ERROR_INVALID_VALUE, "flags %#llx must be 0", flags);
	if (offset) return bad(CUDA_ERROR_INVALID_VALUE, "offset %zu must be 0", offset);
	struct alloc *a = findAlloc(h);
	if (!a) return bad(CUDA_ERROR_INVALID_VALUE, "handle %#llx is not a live allocation handle", h);
	if (size == 0 || size % a->gran || ptr % a->gran)
		return bad(CUDA_ERROR_INVALID_VALUE, "ptr %#llx and size %zu must be multiples of the granularity %zu of the allocation", ptr, size, a->gran);
	if (offset + size > a->size) return bad(CUDA_ERROR_INVALID_VALUE, "offset %zu + size %zu exceeds the %zu-byte allocation", offset, size, a->size);
	if (!findRes((uintptr_t)ptr, size)) return bad(CUDA_ERROR_INVALID_VALUE, "[%#llx, +%zu) is not inside one reservation", ptr, size);
	if (overlapsMapping((uintptr_t)ptr, size)) return bad(CUDA_ERROR_INVALID_VALUE, "[%#llx, +%zu) is already mapped", ptr, size);
	if (grow((void **)&maps, &capmaps, nmaps, sizeof *maps)) return bad(CUDA_ERROR_OUT_OF_MEMORY, "host out of memory");
	// [VMM] cuMemMap: "calling cuMemMap does not make the address
	// accessible": the mapping starts with no access.
	maps[nmaps].base = (uintptr_t)ptr;
	maps[nmaps].size = size;
	maps[nmaps].a = a;
	memset(maps[nmaps].access, 0, sizeof maps[nmaps].access); // CU_MEM_ACCESS_FLAGS_PROT_NONE
	nmaps++;
	a->maps++;
	return CUDA_SUCCESS;
}

static CUresult doUnmap(CUdeviceptr ptr, size_t size) {
	NEED_INIT();
	// [VMM] cuMemUnmap: "The range must be the entire contiguous address
	// range that was mapped to. In other words, cuMemUnmap cannot unmap a
	// sub-range of an address range mapped by cuMemCreate / cuMemMap."
	size_t n;
	if (!covered((uintptr_t)ptr, size, &n))
		return bad(CUDA_ERROR_INVALID_VALUE, "[%#llx, +%zu) is not a run of whole mappings", ptr, size);
	// cuMemUnmap is marked "synchronous behavior for most use cases"
	// (\note_sync): the fake finishes every queued copy first, so none runs
	// on a range that is gone.
	drainAll(-1, 0);
	uintptr_t end = (uintptr_t)ptr + size;
	for (size_t i = 0; i < nmaps;) {
		if (maps[i].base >= (uintptr_t)ptr && maps[i].base < end) {
			struct alloc *a = maps[i].a;
			maps[i] = maps[--nmaps];
			a->maps--;
			// "Any backing memory allocations will be freed if there are no
			// existing mappings and there are no unreleased memory handles."
			freeIfDone(a);
			continue;
		}
		i++;
	}
	return CUDA_SUCCESS;
}

static CUresult doSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
	NEED_INIT();
	if (!desc || count == 0) return bad(CUDA_ERROR_INVALID_VALUE, "no access descriptors");
	for (size_t i = 0; i < count; i++) {
		if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE)
			return bad(CUDA_ERROR_INVALID_VALUE, "desc[%zu].location.type %d: only devices are emulated", i, desc[i].location.type);
		if (desc[i].location.id < 0 || desc[i].location.id >= ndev)
			return bad(CUDA_ERROR_INVALID_DEVICE, "desc[%zu].location.id %d: %d devices", i, desc[i].location.id, ndev);
		int f = desc[i].flags;
		if (f != CU_MEM_ACCESS_FLAGS_PROT_NONE && f != CU_MEM_ACCESS_FLAGS_PROT_READ && f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
			return bad(CUDA_ERROR_INVALID_VALUE, "desc[%zu].flags %d", i, f);
	}
	// [VMM] cuMemSetAccess: "The range must be a fully mapped address range
	// containing all allocations created by cuMemMap / cuMemCreate."
	size_t n;
	if (!covered((uintptr_t)ptr, size, &n))
		return bad(CUDA_ERROR_INVALID_VALUE, "[%#llx, +%zu) is not a fully mapped range of whole mappings", ptr, size);
	uintptr_t end = (uintptr_t)ptr + size;
	// The reference does not say what granting a device access to another
	// device's memory that it cannot reach returns; the fake refuses it with
	// CUDA_ERROR_INVALID_DEVICE, as [Peer] cuDeviceCanAccessPeer says the
	// access is impossible.
	for (size_t i = 0; i < nmaps; i++) {
		if (maps[i].base < (uintptr_t)ptr || maps[i].base >= end) continue;
		for (size_t k = 0; k < count; k++) {
			int d = desc[k].location.id, owner = maps[i].a->dev;
			if (desc[k].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && d != owner && !canPeer(d, owner))
				return bad(CUDA_ERROR_INVALID_DEVICE, "desc[%zu] grants device %d access to memory of device %d, which cuDeviceCanAccessPeer says it cannot access", k, d, owner);
		}
	}
	// Each device has its own access; a later descriptor for the same device
	// wins.
	for (size_t i = 0; i < nmaps; i++) {
		if (maps[i].base < (uintptr_t)ptr || maps[i].base >= end) continue;
		for (size_t k = 0; k < count; k++) maps[i].access[desc[k].location.id] = desc[k].flags;
	}
	return CUDA_SUCCESS;
}

static CUresult doExport(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags) {
	NEED_INIT();
	if (!out) return bad(CUDA_ERROR_INVALID_VALUE, "shareableHandle is NULL");
	// [VMM] cuMemExportToShareableHandle: flags "Reserved, must be zero".
	if (flags) return bad(CUDA_ERROR_INVALID_VALUE, "flags %#llx must be 0", flags);
	if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
		return bad(CUDA_ERROR_NOT_SUPPORTED, "handle type %d: only CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR is emulated", type);
	struct alloc *a = findAlloc(h);
	if (!a) return bad(CUDA_ERROR_INVALID_VALUE, "handle %#llx is not a live allocation handle", h);
	// [cuda.h] CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
	// export to a POSIX fd works "if requested via cuMemCreate" (in
	// CUmemAllocationProp::requestedHandleTypes); the driver answers an export
	// of a type not requested with CUDA_ERROR_INVALID_VALUE.
	if (!(a->handleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
		return bad(CUDA_ERROR_INVALID_VALUE, "allocation %#llx was created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in prop.requestedHandleTypes", h);
	char path[64];
	snprintf(path, sizeof path, "/proc/self/fd/%d", a->fd);
	int fd = open(path, O_PATH | O_CLOEXEC);
	if (fd < 0) return bad(CUDA_ERROR_OPERATING_SYSTEM, "open %s: %s", path, strerror(errno));
	*(int *)out = fd;
	return CUDA_SUCCESS;
}

static CUresult doImport(CUmemGenericAllocationHandle *h, void *osHandle, int type) {
	NEED_INIT();
	if (!h) return bad(CUDA_ERROR_INVALID_VALUE, "handle is NULL");
	if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
		return bad(CUDA_ERROR_NOT_SUPPORTED, "handle type %d: only CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR is emulated", type);
	int fd = (int)(intptr_t)osHandle;
	// Only a descriptor cuMemExportToShareableHandle made (here or in
	// another process) imports: an O_PATH descriptor of a fakecuda memfd.
	int fl = fcntl(fd, F_GETFL);
	if (fl < 0) return bad(CUDA_ERROR_INVALID_VALUE, "fd %d: %s", fd, strerror(errno));
	char path[64], target[256];
	snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
	ssize_t n = readlink(path, target, sizeof target - 1);
	if (n < 0) return bad(CUDA_ERROR_INVALID_VALUE, "readlink %s: %s", path, strerror(errno));
	target[n] = 0;
	int dev;
	if (!(fl & O_PATH) || sscanf(target, "/memfd:fakecuda-alloc-dev%d", &dev) != 1)
		return bad(CUDA_ERROR_INVALID_VALUE, "fd %d (%s) is not a descriptor cuMemExportToShareableHandle made", fd, target);
	// The memory stays on the device that made it. The reference does not
	// say what importing memory of a device this process does not see
	// returns; the fake refuses it.
	if (dev < 0 || dev >= ndev) return bad(CUDA_ERROR_INVALID_DEVICE, "fd %d holds memory of device %d: %d devices", fd, dev, ndev);
	int rw = open(path, O_RDWR | O_CLOEXEC);
	if (rw < 0) return bad(CUDA_ERROR_OPERATING_SYSTEM, "reopen %s: %s", path, strerror(errno));
	struct stat st;
	if (fstat(rw, &st)) {
		close(rw);
		return bad(CUDA_ERROR_OPERATING_SYSTEM, "fstat: %s", strerror(errno));
	}
	CUresult r = newAlloc(rw, (size_t)st.st_size, granularity, dev, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 1, h);
	if (r) close(rw);
	return r;
}

// checkDev checks that every byte of [dptr, dptr+n) is mapped with at least
// the access need for the current context's device; role names the side in
// the reason. Caller checked the context.
static CUresult checkDev(CUdeviceptr dptr, size_t n, int need, const char *role) {
	uintptr_t at = (uintptr_t)dptr, end = at + n;
	if (end < at) return bad(CUDA_ERROR_INVALID_VALUE, "%s range wraps", role);
	// Check the whole range first: a refused copy moves no byte.
	for (uintptr_t p = at; p < end;) {
		struct mapping *m = findMap(p);
		if (!m) return bad(CUDA_ERROR_INVALID_VALUE, "%s %#lx is not mapped", role, (unsigned long)p);
		// [VMM] cuMemMap: "calling cuMemMap does not make the address
		// accessible, the caller needs to update accessibility of a
		// contiguous mapped VA range by calling cuMemSetAccess"; cuMemUnmap:
		// "all mappings start with no accessibility setup".
		int have = m->access[current->dev];
		if ((have & need) != need) {
			// The reference does not say what a copy into a range mapped
			// read-only (CU_MEM_ACCESS_FLAGS_PROT_READ: "Make the address
			// range read accessible") returns; the fake refuses it with
			// CUDA_ERROR_INVALID_VALUE, as any copy into memory the device
			// may not write.
			if (have == CU_MEM_ACCESS_FLAGS_PROT_READ)
				return bad(CUDA_ERROR_INVALID_VALUE, "%s %#lx is mapped read-only (CU_MEM_ACCESS_FLAGS_PROT_READ) for device %d: not a copy destination",
				           role, (unsigned long)p, current->dev);
			return bad(CUDA_ERROR_INVALID_VALUE, "%s %#lx is mapped without %s access: cuMemSetAccess first (device %d)", role, (unsigned long)p,
			           need == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? "read-write" : "read", current->dev);
		}
		p = m->base + m->size;
	}
	return CUDA_SUCCESS;
}

// pinnedHost reports whether [p, p+n) lies in one cuMemHostAlloc allocation.
static int pinnedHost(const void *p, size_t n) {
	uintptr_t at = (uintptr_t)p;
	for (size_t i = 0; i < nhosts; i++) {
		if (at >= hosts[i].base && at + n >= at && at + n <= hosts[i].base + hosts[i].size) return 1;
	}
	return 0;
}

// copySync is cuMemcpyHtoD_v2 / cuMemcpyDtoH_v2: it moves n bytes between
// host memory and [dptr, dptr+n), which must be mapped with the access the
// direction needs, on the NULL stream.
static CUresult copySync(CUdeviceptr dptr, void *host, size_t n, int write) {
	NEED_INIT();
	// [Mem] cuMemcpyHtoD/DtoH: CUDA_ERROR_INVALID_CONTEXT without a current
	// context.
	if (!current || !liveCtx(current)) return bad(CUDA_ERROR_INVALID_CONTEXT, "no current context");
	if (n == 0) return CUDA_SUCCESS;
	if (!host) return bad(CUDA_ERROR_INVALID_VALUE, "host pointer is NULL");
	CUresult r = checkDev(dptr, n, write ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ, write ? "destination" : "source");
	if (r) return r;
	legacySync(current->dev);
	return moveHost(dptr, host, n, write);
}

static CUresult doHostAlloc(void **pp, size_t n, unsigned int flags) {
	NEED_INIT();
	// [Mem] cuMemHostAlloc returns CUDA_ERROR_INVALID_CONTEXT (the memory
	// belongs to a context); Flags are CU_MEMHOSTALLOC_PORTABLE,
	// CU_MEMHOSTALLOC_DEVICEMAP and CU_MEMHOSTALLOC_WRITECOMBINED.
	if (!current || !liveCtx(current)) return bad(CUDA_ERROR_INVALID_CONTEXT, "no current context");
	if (!pp) return bad(CUDA_ERROR_INVALID_VALUE, "pp is NULL");
	if (flags & ~(unsigned)(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED))
		return bad(CUDA_ERROR_INVALID_VALUE, "flags %#x: only CU_MEMHOSTALLOC_PORTABLE, DEVICEMAP and WRITECOMBINED exist", flags);
	// The reference does not say what a size of 0 does; the fake refuses it.
	if (n == 0) return bad(CUDA_ERROR_INVALID_VALUE, "bytesize is 0");
	if (grow((void **)&hosts, &caphosts, nhosts, sizeof *hosts)) return bad(CUDA_ERROR_OUT_OF_MEMORY, "host out of memory");
	size_t page = (size_t)sysconf(_SC_PAGESIZE), len = (n + page - 1) / page * page;
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) return bad(CUDA_ERROR_OUT_OF_MEMORY, "mmap %zu bytes: %s", len, strerror(errno));
	hosts[nhosts++] = (struct hostAlloc){.base = (uintptr_t)p, .size = n, .mapped = len};
	*pp = p;
	return CUDA_SUCCESS;
}

static CUresult doFreeHost(void *p) {
	NEED_INIT();
	if (!current || !liveCtx(current)) return bad(CUDA_ERROR_INVALID_CONTEXT, "no current context");
	// [Mem] cuMemFreeHost: p must have come from cuMemHostAlloc (or
	// cuMemAllocHost, not emulated).
	size_t i;
	for (i = 0; i < nhosts; i++) {
		if (hosts[i].base == (uintptr_t)p) break;
	}
	if (i == nhosts) return bad(CUDA_ERROR_INVALID_VALUE, "%p is not memory cuMemHostAlloc returned", p);
	// The reference does not say whether freeing waits for queued copies
	// of the memory; the fake finishes them, and the trace's ops= says how
	// many there were (a caller that waited first sees ops=0).
	arg("ops=%llu", drainAll(-1, 0));
	munmap((void *)hosts[i].base, hosts[i].mapped);
	hosts[i] = hosts[--nhosts];
	return CUDA_SUCCESS;
}

static CUresult doStreamCreate(CUstream *ps, unsigned int flags) {
	NEED_INIT();
	if (!current || !liveCtx(current)) return bad(CUDA_ERROR_INVALID_CONTEXT, "no current context");
	if (!ps) return bad(CUDA_ERROR_INVALID_VALUE, "phStream is NULL");
	// [Stream] cuStreamCreate: Flags are CU_STREAM_DEFAULT or
	// CU_STREAM_NON_BLOCKING.
	if (flags & ~(unsigned)CU_STREAM_NON_BLOCKING) return bad(CUDA_ERROR_INVALID_VALUE, "flags %#x: only CU_STREAM_DEFAULT or CU_STREAM_NON_BLOCKING", flags);
	if (grow((void **)&streams, &capstreams, nstreams, sizeof *streams)) return bad(CUDA_ERROR_OUT_OF_MEMORY, "host out of memory");
	struct CUstream_st *s = calloc(1, sizeof *s);
	if (!s) return bad(CUDA_ERROR_OUT_OF_MEMORY, "host out of memory");
	s->live = 1;
	s->dev = current->dev;
	s->blocking = !(flags & CU_STREAM_NON_BLOCKING);
	streams[nstreams++] = s;
	*ps = s;
	arg("stream=%#lx", (unsigned long)(uintptr_t)s);
	return CUDA_SUCCESS;
}

static CUresult badStream(CUstream s) {
	return bad(CUDA_ERROR_INVALID_HANDLE, "stream %#lx is not a live stream (destroyed, or its context was)", (unsigned long)(uintptr_t)s);
}

static CUresult doStreamDestroy(CUstream s) {
	NEED_INIT();
	if (!liveStream(s)) return badStream(s);
	// [Stream] cuStreamDestroy: "In case the device is still doing work in
	// the stream hStream when cuStreamDestroy() is called, the function will
	// return immediately and the resources associated with hStream will be
	// released automatically once the device has completed all work in
	// hStream." The fake completes the work now.
	arg("ops=%llu", drain(s));
	s->live = 0;
	return CUDA_SUCCESS;
}

static CUresult doStreamSync(CUstream s) {
	NEED_INIT();
	if (!s) {
		// The NULL stream: its own work ran at once.
		if (!current || !liveCtx(current)) return bad(CUDA_ERROR_INVALID_CONTEXT, "no current context");
		legacySync(current->dev);
		return CUDA_SUCCESS;
	}
	if (!liveStream(s)) return badStream(s);
	// [Stream] cuStreamSynchronize: "Waits until the device has completed
	// all operations in the stream specified by hStream."
	arg("ops=%llu", drain(s));
	if (s->sticky) return bad(s->sticky, "a copy queued on stream %#lx failed", (unsigned long)(uintptr_t)s);
	return CUDA_SUCCESS;
}

static int liveEvent(struct CUevent_st *e) {
	for (size_t i = 0; i < nevents; i++) {
		if (events[i] == e) return e->live && retained[e->dev] > 0;
	}
	return 0;
}

static CUresult badEvent(CUevent e) {
	return bad(CUDA_ERROR_INVALID_HANDLE, "event %#lx is not a live event (destroyed, or its context was)", (unsigned long)(uintptr_t)e);
}

static CUresult doEventCreate(CUevent *pe, unsigned int flags) {
	NEED_INIT();
	if (!current || !liveCtx(current)) return bad(CUDA_ERROR_INVALID_CONTEXT, "no current context");
	if (!pe) return bad(CUDA_ERROR_INVALID_VALUE, "phEvent is NULL");
	// [Event] cuEventCreate: Flags are CU_EVENT_DEFAULT, BLOCKING_SYNC,
	// DISABLE_TIMING and INTERPROCESS, which needs DISABLE_TIMING.
	if (flags & ~(unsigned)(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS))
		return bad(CUDA_ERROR_INVALID_VALUE, "flags %#x", flags);
	if ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING))
		return bad(CUDA_ERROR_INVALID_VALUE, "CU_EVENT_INTERPROCESS without CU_EVENT_DISABLE_TIMING");
	if (grow((void **)&events, &capevents, nevents, sizeof *events)) return bad(CUDA_ERROR_OUT_OF_MEMORY, "host out of memory");
	struct CUevent_st *e = calloc(1, sizeof *e);
	if (!e) return bad(CUDA_ERROR_OUT_OF_MEMORY, "host out of memory");
	e->live = 1;
	e->dev = current->dev;
	events[nevents++] = e;
	*pe = e;
	return CUDA_SUCCESS;
}

static CUresult doEventRecord(CUevent e, CUstream s) {
	NEED_INIT();
	if (!liveEvent(e)) return badEvent(e);
	if (!s) {
		// On the NULL stream: complete once the blocking streams are.
		legacySync(e->dev);
		e->s = NULL;
		return CUDA_SUCCESS;
	}
	if (!liveStream(s)) return badStream(s);
	// The reference has the event and the stream in one context; the fake
	// refuses a pair of different devices' contexts with
	// CUDA_ERROR_INVALID_HANDLE.
	if (s->dev != e->dev) return bad(CUDA_ERROR_INVALID_HANDLE, "event of device %d recorded on a stream of device %d", e->dev, s->dev);
	// [Event] cuEventRecord: "Captures in the event hEvent the contents of
	// hStream at the time of this call."
	e->s = s;
	e->at = s->enq;
	return CUDA_SUCCESS;
}

static CUresult doEventSync(CUevent e) {
	NEED_INIT();
	if (!liveEvent(e)) return badEvent(e);
	// [Event] cuEventSynchronize: "Waits until the completion of all work
	// currently captured in hEvent"; an event never recorded captured none.
	if (!e->s) return CUDA_SUCCESS;
	arg("ops=%llu", runUntil(e->s, e->at));
	if (e->s->sticky) return bad(e->s->sticky, "a copy queued before the event failed");
	return CUDA_SUCCESS;
}

static CUresult doEventDestroy(CUevent e) {
	NEED_INIT();
	if (!liveEvent(e)) return badEvent(e);
	// [Event] cuEventDestroy: an event recorded and not yet complete is
	// released once the device completes it; the queued work stays queued.
	e->live = 0;
	return CUDA_SUCCESS;
}

// copyAsync is cuMemcpy{HtoD,DtoH,DtoD}Async_v2: the ranges are checked at
// once, and the copy is queued on s when the reference lets it run after the
// call returns.
static CUresult copyAsync(int kind, CUdeviceptr dst, CUdeviceptr src, void *host, size_t n, CUstream s) {
	NEED_INIT();
	if (!current || !liveCtx(current)) return bad(CUDA_ERROR_INVALID_CONTEXT, "no current context");
	if (s && !liveStream(s)) return badStream(s);
	// The reference does not say what a stream of another context returns;
	// the fake refuses it with CUDA_ERROR_INVALID_HANDLE.
	if (s && s->dev != current->dev) return bad(CUDA_ERROR_INVALID_HANDLE, "stream of device %d used in the context of device %d", s->dev, current->dev);
	if (n == 0) return CUDA_SUCCESS;
	if (kind != OP_DTOD && !host) return bad(CUDA_ERROR_INVALID_VALUE, "host pointer is NULL");
	CUresult r;
	if (kind != OP_DTOH && (r = checkDev(dst, n, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "destination"))) return r;
	if (kind != OP_HTOD && (r = checkDev(src, n, CU_MEM_ACCESS_FLAGS_PROT_READ, "source"))) return r;
	if (!s) {
		legacySync(current->dev);
		return runCopy(kind, dst, src, host, n);
	}
	// [Sync] Asynchronous: "For transfers between device memory and
	// pageable host memory, the function might be synchronous with respect
	// to host"; "If pageable memory must first be staged to pinned memory,
	// the driver may synchronize with the stream and stage the copy into
	// pinned memory"; "For all other transfers, the function should be fully
	// asynchronous." The fake synchronizes with the stream and copies
	// pageable memory before it returns, and queues the rest.
	if (kind != OP_DTOD && !pinnedHost(host, n)) {
		drain(s);
		return runCopy(kind, dst, src, host, n);
	}
	return enqueue(s, kind, dst, src, host, n);
}

static CUresult doCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
	NEED_INIT();
	if (!can) return bad(CUDA_ERROR_INVALID_VALUE, "canAccessPeer is NULL");
	if (dev < 0 || dev >= ndev) return bad(CUDA_ERROR_INVALID_DEVICE, "dev %d: %d devices", dev, ndev);
	if (peer < 0 || peer >= ndev) return bad(CUDA_ERROR_INVALID_DEVICE, "peerDev %d: %d devices", peer, ndev);
	*can = canPeer(dev, peer);
	return CUDA_SUCCESS;
}

static CUresult doAllocProps(CUmemAllocationProp *p, CUmemGenericAllocationHandle h) {
	NEED_INIT();
	if (!p) return bad(CUDA_ERROR_INVALID_VALUE, "prop is NULL");
	struct alloc *a = findAlloc(h);
	if (!a) return bad(CUDA_ERROR_INVALID_VALUE, "handle %#llx is not a live allocation handle", h);
	// [VMM] cuMemGetAllocationPropertiesFromHandle: "Retrieve the contents
	// of the property structure defining properties for this handle"; an
	// imported handle names the device the memory lives on.
	memset(p, 0, sizeof *p);
	p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	p->requestedHandleTypes = a->handleTypes;
	p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	p->location.id = a->dev;
	return CUDA_SUCCESS;
}

static const char *hostKind(const void *p, size_t n) { return pinnedHost(p, n) ? "pinned" : "pageable"; }

API CUresult cuInit(unsigned int flags) { CALL(C_Init, doInit(flags)); }
API CUresult cuDriverGetVersion(int *v) { CALL(C_DriverGetVersion, doDriverGetVersion(v)); }
API CUresult cuDeviceGet(CUdevice *d, int ordinal) { CALL(C_DeviceGet, doDeviceGet(d, ordinal)); }
API CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) { CALL(C_DeviceGetAttribute, doDeviceGetAttribute(v, attr, d)); }
API CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { CALL(C_DevicePrimaryCtxRetain, doPrimaryCtxRetain(c, d)); }
API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { CALL(C_DevicePrimaryCtxRelease, doPrimaryCtxRelease(d)); }
API CUresult cuCtxSetCurrent(CUcontext c) { CALL(C_CtxSetCurrent, doCtxSetCurrent(c)); }
API CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p, int option) {
	CALL(C_MemGetAllocationGranularity, doGranularity(g, p, option));
}
API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
	CALL(C_MemAddressReserve, doReserve(ptr, size, align, addr, flags));
}
API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) { CALL(C_MemAddressFree, doAddressFree(ptr, size)); }
API CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *p, unsigned long long flags) {
	CALL(C_MemCreate, doCreate(h, size, p, flags));
}
API CUresult cuMemRelease(CUmemGenericAllocationHandle h) { CALL(C_MemRelease, doRelease(h)); }
API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
	CALL(C_MemMap, doMap(ptr, size, offset, h, flags));
}
API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) { CALL(C_MemUnmap, doUnmap(ptr, size)); }
API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
	CALL(C_MemSetAccess, doSetAccess(ptr, size, desc, count));
}
API CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags) {
	CALL(C_MemExportToShareableHandle, doExport(out, h, type, flags));
}
API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *osHandle, int type) {
	CALL(C_MemImportFromShareableHandle, doImport(h, osHandle, type));
}
API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
	CALLA(C_MemcpyHtoD, arg("bytes=%zu host=%s", n, hostKind(src, n)), copySync(dst, (void *)(uintptr_t)src, n, 1));
}
API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
	CALLA(C_MemcpyDtoH, arg("bytes=%zu host=%s", n, hostKind(dst, n)), copySync(src, dst, n, 0));
}
API CUresult cuMemHostAlloc(void **pp, size_t n, unsigned int flags) {
	CALLA(C_MemHostAlloc, arg("bytes=%zu flags=%#x", n, flags), doHostAlloc(pp, n, flags));
}
API CUresult cuMemFreeHost(void *p) { CALL(C_MemFreeHost, doFreeHost(p)); }
API CUresult cuStreamCreate(CUstream *ps, unsigned int flags) { CALLA(C_StreamCreate, arg("flags=%#x", flags), doStreamCreate(ps, flags)); }
API CUresult cuStreamDestroy_v2(CUstream s) {
	CALLA(C_StreamDestroy, arg("stream=%#lx", (unsigned long)(uintptr_t)s), doStreamDestroy(s));
}
API CUresult cuStreamSynchronize(CUstream s) {
	CALLA(C_StreamSynchronize, arg("stream=%#lx", (unsigned long)(uintptr_t)s), doStreamSync(s));
}
API CUresult cuEventCreate(CUevent *pe, unsigned int flags) { CALLA(C_EventCreate, arg("flags=%#x", flags), doEventCreate(pe, flags)); }
API CUresult cuEventRecord(CUevent e, CUstream s) {
	CALLA(C_EventRecord, arg("stream=%#lx", (unsigned long)(uintptr_t)s), doEventRecord(e, s));
}
API CUresult cuEventSynchronize(CUevent e) { CALL(C_EventSynchronize, doEventSync(e)); }
API CUresult cuEventDestroy_v2(CUevent e) { CALL(C_EventDestroy, doEventDestroy(e)); }
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
	CALLA(C_MemcpyHtoDAsync, arg("bytes=%zu host=%s stream=%#lx", n, hostKind(src, n), (unsigned long)(uintptr_t)s),
	      copyAsync(OP_HTOD, dst, 0, (void *)(uintptr_t)src, n, s));
}
API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
	CALLA(C_MemcpyDtoHAsync, arg("bytes=%zu host=%s stream=%#lx", n, hostKind(dst, n), (unsigned long)(uintptr_t)s),
	      copyAsync(OP_DTOH, 0, src, dst, n, s));
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
	CALLA(C_MemcpyDtoDAsync, arg("bytes=%zu stream=%#lx", n, (unsigned long)(uintptr_t)s), copyAsync(OP_DTOD, dst, src, NULL, n, s));
}
API CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
	CALLA(C_DeviceCanAccessPeer, arg("dev=%d peer=%d", dev, peer), doCanAccessPeer(can, dev, peer));
}
API CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *p, CUmemGenericAllocationHandle h) {
	CALL(C_MemGetAllocationPropertiesFromHandle, doAllocProps(p, h));
}

// fakecuda_calls returns how many times entry point name (as in names[])
// was called since the library was loaded; 0 for an unknown name.
API unsigned long long fakecuda_calls(const char *name) {
	int c = name ? callByName(name, strlen(name)) : -1;
	if (c < 0) return 0;
	pthread_mutex_lock(&mu);
	unsigned long long n = calls[c];
	pthread_mutex_unlock(&mu);
	return n;
}

// fakecuda_last_error returns why this thread's last refused call was
// refused ("" after a call that succeeded).
API const char *fakecuda_last_error(void) { return why; }

// fakecuda_live returns how many of what the driver holds now: "mappings",
// "allocations" (handles not released, and released ones still mapped),
// "reservations", "host" (cuMemHostAlloc memory), "streams", "events" (live
// ones) or "queued" (copies waiting on a stream); -1 for another word.
API long long fakecuda_live(const char *what) {
	long long n = -1;
	pthread_mutex_lock(&mu);
	if (!what) {
	} else if (strcmp(what, "mappings") == 0) {
		n = (long long)nmaps;
	} else if (strcmp(what, "allocations") == 0) {
		n = (long long)nallocs;
	} else if (strcmp(what, "reservations") == 0) {
		n = (long long)nres;
	} else if (strcmp(what, "host") == 0) {
		n = (long long)nhosts;
	} else if (strcmp(what, "streams") == 0 || strcmp(what, "events") == 0 || strcmp(what, "queued") == 0) {
		n = 0;
		if (what[0] == 'e') {
			for (size_t i = 0; i < nevents; i++) n += liveEvent(events[i]);
		} else {
			for (size_t i = 0; i < nstreams; i++) n += what[0] == 's' ? liveStream(streams[i]) : (long long)(streams[i]->nops - streams[i]->head);
		}
	}
	pthread_mutex_unlock(&mu);
	return n;
}
