/*
 * A fake CUDA driver library (libcuda.so.1) for vmkv's tests: no GPU needed.
 *
 * The real cuda-bindings package loads it like the real driver: it dlopens "libcuda.so.1" and
 * looks every entry point up through cuGetProcAddress_v2. It implements the driver calls the CUDA
 * backend uses, enforcing the driver's documented virtual-memory (VMM) rules, and returns the
 * CUresult a rule break deserves (CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_CONTEXT, ...):
 *
 *   - every call but the version/proc-address/error-name queries needs cuInit first;
 *   - every memory call needs a current context (cuDevicePrimaryCtxRetain + cuCtxPushCurrent or
 *     cuCtxSetCurrent), per thread, like the real driver's thread-local context stack;
 *   - sizes and addresses are multiples of the granularity; cuMemMap maps from offset 0, at most
 *     the handle's size, inside one reservation, never over a mapped granule; a new mapping has
 *     no access until cuMemSetAccess, which needs a fully mapped range; cuMemUnmap takes whole
 *     mappings only; cuMemAddressFree takes exactly a reservation with nothing mapped in it;
 *     cuMemRelease may be called while the handle is still mapped (the memory goes when the
 *     last mapping does), never twice; cuMemsetD8 needs mapped, writable memory.
 *
 * Device memory is host memory: a handle is a memfd, a reservation is a PROT_NONE host range
 * at the very address the driver returns, cuMemMap maps the memfd there and cuMemSetAccess
 * sets the protection (read-only stays read-only: writing there is a SIGSEGV, the host's
 * illegal-address fault). So data written through one mapping is read through another mapping
 * of the same handle, and a test can read "device" memory through a CPU tensor at the device
 * address. cuMemCreate fills new memory with 0xFF bytes (NaN in every float format), as
 * uninitialised device memory may hold anything.
 *
 * cuMemsetD8 is asynchronous on a real GPU: the fake marks the written handles "pending" until
 * cuCtxSynchronize, and unmapping a pending handle is recorded as a hazard (the real driver
 * would unmap under a running kernel).
 *
 * Test controls (fake_cuda_*): configure/reset, inject a failure at the n-th call of a name,
 * read the call log, the live state (JSON) and the hazard count.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct fake_ctx *CUcontext;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

/* CUDA 12/13 layouts, checked against cuda-bindings' cydriver.pxd. */
typedef struct {
    int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int id;
} CUmemLocation;
typedef struct {
    int type; /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    unsigned char compressionType, gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
} CUmemAllocationProp;
typedef struct {
    CUmemLocation location;
    int flags; /* PROT_NONE 0, PROT_READ 1, PROT_READWRITE 3 */
} CUmemAccessDesc;

#define LOCATION_DEVICE 1
#define ALLOCATION_PINNED 1
#define ATTR_VMM_SUPPORTED 102
#define MAX_DEVICES 8
#define MAX_STACK 16
#define MAX_FAILS 16
#define HANDLE_BASE 0x1000 /* handle ids are not small integers: a page index is never a handle */

/* ---- state ------------------------------------------------------------------------------- */
struct fake_ctx {
    int device;
    int retains; /* cuDevicePrimaryCtxRetain minus Release; active while > 0 */
};

struct handle {
    unsigned long long id;
    size_t size;
    int fd;
    int released; /* cuMemRelease was called */
    int maps;     /* live mappings of it */
    int pending;  /* written by async device work not yet synchronized */
};

struct mapping {
    CUdeviceptr addr;
    size_t size;
    struct handle *h;
};

struct reservation {
    CUdeviceptr addr;
    size_t size;
    void *region; /* the host range holding it (aligned inside) */
    size_t region_size;
    struct mapping **slots; /* one per granule: the mapping covering it, or NULL */
    unsigned char *access;  /* one per granule: access flags */
    struct reservation *next;
};

struct fail_rule {
    char name[64]; /* "" matches every call */
    long countdown; /* fail when it reaches 0; -1 = every matching call */
    int result;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static size_t granularity = 2u << 20;
static size_t device_memory = 1u << 30;
static int vmm_supported = 1;
static int read_only_supported = 1; /* some devices may refuse CU_MEM_ACCESS_FLAGS_PROT_READ */
static int device_count = 1;
static int initialized = 0;
static size_t memory_used = 0;
static struct fake_ctx contexts[MAX_DEVICES];
static struct handle **handles = NULL;
static size_t handle_count = 0, handle_cap = 0;
static struct reservation *reservations = NULL;
static struct fail_rule fails[MAX_FAILS];
static int fail_count = 0;
static long hazards = 0;
static char *log_buf = NULL;
static size_t log_len = 0, log_cap = 0;
static char *state_buf = NULL;
static __thread CUcontext ctx_stack[MAX_STACK];
static __thread int ctx_depth = 0;

/* ---- the call log ------------------------------------------------------------------------ */
static void log_append(const char *text) {
    size_t n = strlen(text);
    if (log_len + n + 1 > log_cap) {
        size_t cap = log_cap ? log_cap * 2 : 1 << 16;
        while (cap < log_len + n + 1) cap *= 2;
        char *grown = realloc(log_buf, cap);
        if (!grown) return;
        log_buf = grown;
        log_cap = cap;
    }
    memcpy(log_buf + log_len, text, n + 1);
    log_len += n;
}

static const char *result_name(CUresult r) {
    switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_NOT_PERMITTED: return "CUDA_ERROR_NOT_PERMITTED";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    default: return "CUDA_ERROR_UNKNOWN";
    }
}

/* One log line: "name(args) -> RESULT [reason]". Returns r. Called with the lock held. */
static CUresult done(const char *name, const char *args, CUresult r, const char *why, ...) {
    char reason[256] = "";
    if (why) {
        va_list ap;
        va_start(ap, why);
        vsnprintf(reason, sizeof reason, why, ap);
        va_end(ap);
    }
    char line[768];
    snprintf(line, sizeof line, "%s(%s) -> %s%s%s%s\n", name, args, result_name(r), why ? " [" : "", reason,
             why ? "]" : "");
    log_append(line);
    return r;
}

/* An injected failure for this call, or CUDA_SUCCESS. */
static CUresult injected(const char *name) {
    for (int i = 0; i < fail_count; i++) {
        struct fail_rule *rule = &fails[i];
        if (rule->name[0] && strcmp(rule->name, name) != 0) continue;
        if (rule->countdown < 0) return rule->result;
        if (rule->countdown == 0) continue; /* already fired */
        if (--rule->countdown == 0) return rule->result;
    }
    return CUDA_SUCCESS;
}

#define FORMAT(...) char args[256]; snprintf(args, sizeof args, __VA_ARGS__)
/* Start of every counted entry point: take the lock, format the args, apply injections. */
#define ENTER(NAME, ...)                                                                  \
    pthread_mutex_lock(&lock);                                                           \
    FORMAT(__VA_ARGS__);                                                                 \
    CUresult forced_ = injected(NAME);                                                   \
    if (forced_ != CUDA_SUCCESS) {                                                       \
        done(NAME, args, forced_, "injected");                                          \
        pthread_mutex_unlock(&lock);                                                     \
        return forced_;                                                                  \
    }
#define LEAVE(NAME, R, ...)                                                               \
    do {                                                                                 \
        CUresult r_ = done(NAME, args, (R), __VA_ARGS__);                                \
        pthread_mutex_unlock(&lock);                                                     \
        return r_;                                                                       \
    } while (0)
#define OK(NAME) LEAVE(NAME, CUDA_SUCCESS, NULL)
/* the driver's first checks: cuInit was called, the device ordinal exists */
#define REQUIRE_INIT(NAME) \
    if (!initialized) LEAVE(NAME, CUDA_ERROR_NOT_INITIALIZED, "cuInit was not called")
#define REQUIRE_DEVICE(NAME, DEV) \
    if (!valid_device(DEV)) LEAVE(NAME, CUDA_ERROR_INVALID_DEVICE, "no device %d", (DEV))

/* ---- helpers (lock held) ----------------------------------------------------------------- */
static int valid_device(int dev) { return dev >= 0 && dev < device_count; }

static CUcontext current_ctx(void) { return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL; }

/* The reason a memory call cannot run now (no cuInit / no usable current context), or NULL. */
static const char *no_context(CUresult *r) {
    if (!initialized) {
        *r = CUDA_ERROR_NOT_INITIALIZED;
        return "cuInit was not called";
    }
    CUcontext ctx = current_ctx();
    if (!ctx || ctx->retains <= 0) {
        *r = CUDA_ERROR_INVALID_CONTEXT;
        return ctx ? "the current context was released" : "no current context on this thread";
    }
    return NULL;
}

static struct reservation *reservation_holding(CUdeviceptr addr, size_t size) {
    for (struct reservation *r = reservations; r; r = r->next)
        if (addr >= r->addr && size <= r->size && addr - r->addr <= r->size - size) return r;
    return NULL;
}

static struct handle *find_handle(unsigned long long id) {
    if (id < HANDLE_BASE || id - HANDLE_BASE >= handle_count) return NULL;
    return handles[id - HANDLE_BASE];
}

static void destroy_handle(struct handle *h) {
    memory_used -= h->size;
    close(h->fd);
    handles[h->id - HANDLE_BASE] = NULL;
    free(h);
}

static const char *check_prop(const CUmemAllocationProp *prop) {
    if (!prop) return "prop is NULL";
    if (prop->type != ALLOCATION_PINNED) return "prop.type is not CU_MEM_ALLOCATION_TYPE_PINNED";
    if (prop->location.type != LOCATION_DEVICE) return "prop.location.type is not CU_MEM_LOCATION_TYPE_DEVICE";
    if (!valid_device(prop->location.id)) return "prop.location.id is not a device";
    return NULL;
}

/* Give [addr, addr+size) back to the reservation: PROT_NONE anonymous memory, no access. */
static void restore_reserved(struct reservation *r, CUdeviceptr addr, size_t size) {
    mmap((void *)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    size_t first = (addr - r->addr) / granularity, n = size / granularity;
    memset(r->access + first, 0, n);
}

static void drop_mapping(struct reservation *r, struct mapping *m) {
    size_t first = (m->addr - r->addr) / granularity, n = m->size / granularity;
    for (size_t i = 0; i < n; i++) r->slots[first + i] = NULL;
    restore_reserved(r, m->addr, m->size);
    struct handle *h = m->h;
    if (h->pending) hazards++;
    h->maps--;
    if (h->released && h->maps == 0) destroy_handle(h);
    free(m);
}

static void free_reservation(struct reservation *r) {
    size_t n = r->size / granularity;
    for (size_t i = 0; i < n; i++)
        if (r->slots[i] && r->slots[i]->addr == r->addr + i * granularity) drop_mapping(r, r->slots[i]);
    munmap(r->region, r->region_size);
    free(r->slots);
    free(r->access);
    struct reservation **link = &reservations;
    while (*link != r) link = &(*link)->next;
    *link = r->next;
    free(r);
}

/* ---- initialisation and devices ---------------------------------------------------------- */
EXPORT CUresult cuInit(unsigned int flags) {
    ENTER("cuInit", "flags=%u", flags);
    if (flags != 0) LEAVE("cuInit", CUDA_ERROR_INVALID_VALUE, "flags must be 0");
    initialized = 1;
    OK("cuInit");
}

EXPORT CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = 13000;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *count) {
    ENTER("cuDeviceGetCount", "%s", "");
    REQUIRE_INIT("cuDeviceGetCount");
    *count = device_count;
    OK("cuDeviceGetCount");
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    ENTER("cuDeviceGet", "ordinal=%d", ordinal);
    REQUIRE_INIT("cuDeviceGet");
    REQUIRE_DEVICE("cuDeviceGet", ordinal);
    *device = ordinal;
    OK("cuDeviceGet");
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    ENTER("cuDeviceGetName", "dev=%d", dev);
    REQUIRE_INIT("cuDeviceGetName");
    REQUIRE_DEVICE("cuDeviceGetName", dev);
    snprintf(name, (size_t)len, "vmkv fake CUDA device %d", dev);
    OK("cuDeviceGetName");
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    ENTER("cuDeviceTotalMem", "dev=%d", dev);
    REQUIRE_INIT("cuDeviceTotalMem");
    REQUIRE_DEVICE("cuDeviceTotalMem", dev);
    *bytes = device_memory;
    OK("cuDeviceTotalMem");
}

EXPORT CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice dev) {
    ENTER("cuDeviceGetAttribute", "attribute=%d, dev=%d", attribute, dev);
    REQUIRE_INIT("cuDeviceGetAttribute");
    REQUIRE_DEVICE("cuDeviceGetAttribute", dev);
    if (attribute != ATTR_VMM_SUPPORTED)
        LEAVE("cuDeviceGetAttribute", CUDA_ERROR_INVALID_VALUE, "the fake knows only attribute %d", ATTR_VMM_SUPPORTED);
    *value = vmm_supported;
    OK("cuDeviceGetAttribute");
}

/* ---- contexts ---------------------------------------------------------------------------- */
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRetain", "dev=%d", dev);
    REQUIRE_INIT("cuDevicePrimaryCtxRetain");
    REQUIRE_DEVICE("cuDevicePrimaryCtxRetain", dev);
    contexts[dev].device = dev;
    contexts[dev].retains++;
    *pctx = &contexts[dev];
    OK("cuDevicePrimaryCtxRetain");
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRelease", "dev=%d", dev);
    REQUIRE_INIT("cuDevicePrimaryCtxRelease");
    REQUIRE_DEVICE("cuDevicePrimaryCtxRelease", dev);
    if (contexts[dev].retains <= 0)
        LEAVE("cuDevicePrimaryCtxRelease", CUDA_ERROR_INVALID_CONTEXT, "the primary context is not retained");
    contexts[dev].retains--;
    OK("cuDevicePrimaryCtxRelease");
}

static int valid_ctx(CUcontext ctx) {
    for (int i = 0; i < device_count; i++)
        if (ctx == &contexts[i]) return ctx->retains > 0;
    return 0;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
    ENTER("cuCtxGetCurrent", "%s", "");
    REQUIRE_INIT("cuCtxGetCurrent");
    *pctx = current_ctx();
    OK("cuCtxGetCurrent");
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    ENTER("cuCtxSetCurrent", "ctx=%p", (void *)ctx);
    REQUIRE_INIT("cuCtxSetCurrent");
    if (!ctx) {
        if (ctx_depth) ctx_depth--;
        OK("cuCtxSetCurrent");
    }
    if (!valid_ctx(ctx)) LEAVE("cuCtxSetCurrent", CUDA_ERROR_INVALID_CONTEXT, "not an active context");
    if (ctx_depth) ctx_stack[ctx_depth - 1] = ctx;
    else ctx_stack[ctx_depth++] = ctx;
    OK("cuCtxSetCurrent");
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    ENTER("cuCtxPushCurrent", "ctx=%p", (void *)ctx);
    REQUIRE_INIT("cuCtxPushCurrent");
    if (!valid_ctx(ctx)) LEAVE("cuCtxPushCurrent", CUDA_ERROR_INVALID_CONTEXT, "not an active context");
    if (ctx_depth == MAX_STACK) LEAVE("cuCtxPushCurrent", CUDA_ERROR_INVALID_VALUE, "context stack full");
    ctx_stack[ctx_depth++] = ctx;
    OK("cuCtxPushCurrent");
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    ENTER("cuCtxPopCurrent", "%s", "");
    REQUIRE_INIT("cuCtxPopCurrent");
    if (!ctx_depth) LEAVE("cuCtxPopCurrent", CUDA_ERROR_INVALID_CONTEXT, "no current context to pop");
    CUcontext ctx = ctx_stack[--ctx_depth];
    if (pctx) *pctx = ctx;
    OK("cuCtxPopCurrent");
}

EXPORT CUresult cuCtxGetDevice(CUdevice *device) {
    ENTER("cuCtxGetDevice", "%s", "");
    CUresult r;
    const char *why = no_context(&r);
    if (why) LEAVE("cuCtxGetDevice", r, "%s", why);
    *device = current_ctx()->device;
    OK("cuCtxGetDevice");
}

EXPORT CUresult cuCtxSynchronize(void) {
    ENTER("cuCtxSynchronize", "%s", "");
    CUresult r;
    const char *why = no_context(&r);
    if (why) LEAVE("cuCtxSynchronize", r, "%s", why);
    for (size_t i = 0; i < handle_count; i++)
        if (handles[i]) handles[i]->pending = 0;
    OK("cuCtxSynchronize");
}

/* ---- physical memory --------------------------------------------------------------------- */
EXPORT CUresult cuMemGetAllocationGranularity(size_t *out, const CUmemAllocationProp *prop, int option) {
    ENTER("cuMemGetAllocationGranularity", "option=%d", option);
    REQUIRE_INIT("cuMemGetAllocationGranularity");
    const char *bad = check_prop(prop);
    if (bad) LEAVE("cuMemGetAllocationGranularity", CUDA_ERROR_INVALID_VALUE, "%s", bad);
    if (option != 0 && option != 1) LEAVE("cuMemGetAllocationGranularity", CUDA_ERROR_INVALID_VALUE, "bad option");
    *out = granularity;
    OK("cuMemGetAllocationGranularity");
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    ENTER("cuMemGetInfo", "%s", "");
    CUresult r;
    const char *why = no_context(&r);
    if (why) LEAVE("cuMemGetInfo", r, "%s", why);
    *free_bytes = device_memory - memory_used;
    *total = device_memory;
    OK("cuMemGetInfo");
}

static int fill_uninitialised(int fd, size_t size) {
    static unsigned char junk[1 << 16];
    if (!junk[0]) memset(junk, 0xFF, sizeof junk);
    for (size_t done_bytes = 0; done_bytes < size;) {
        size_t n = size - done_bytes < sizeof junk ? size - done_bytes : sizeof junk;
        ssize_t w = pwrite(fd, junk, n, (off_t)done_bytes);
        if (w <= 0) return -1;
        done_bytes += (size_t)w;
    }
    return 0;
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *out, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
    ENTER("cuMemCreate", "size=%zu, flags=%llu", size, flags);
    CUresult r;
    const char *why = no_context(&r);
    if (why) LEAVE("cuMemCreate", r, "%s", why);
    const char *bad = check_prop(prop);
    if (bad) LEAVE("cuMemCreate", CUDA_ERROR_INVALID_VALUE, "%s", bad);
    if (flags) LEAVE("cuMemCreate", CUDA_ERROR_INVALID_VALUE, "flags must be 0");
    if (!size || size % granularity) LEAVE("cuMemCreate", CUDA_ERROR_INVALID_VALUE, "size is not a multiple of the granularity");
    if (size > device_memory - memory_used) LEAVE("cuMemCreate", CUDA_ERROR_OUT_OF_MEMORY, "device memory is full");
    int fd = memfd_create("fake-cuda-allocation", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0 || fill_uninitialised(fd, size) != 0) {
        if (fd >= 0) close(fd);
        LEAVE("cuMemCreate", CUDA_ERROR_OUT_OF_MEMORY, "host memfd failed: errno %d", errno);
    }
    if (handle_count == handle_cap) {
        size_t cap = handle_cap ? handle_cap * 2 : 256;
        struct handle **grown = realloc(handles, cap * sizeof *grown);
        if (!grown) {
            close(fd);
            LEAVE("cuMemCreate", CUDA_ERROR_OUT_OF_MEMORY, "host realloc failed");
        }
        handles = grown;
        handle_cap = cap;
    }
    struct handle *h = calloc(1, sizeof *h);
    h->id = HANDLE_BASE + handle_count;
    h->size = size;
    h->fd = fd;
    handles[handle_count++] = h;
    memory_used += size;
    *out = h->id;
    snprintf(args + strlen(args), sizeof args - strlen(args), " => handle=%#llx", h->id);
    OK("cuMemCreate");
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle id) {
    ENTER("cuMemRelease", "handle=%#llx", id);
    CUresult r;
    const char *why = no_context(&r);
    if (why) LEAVE("cuMemRelease", r, "%s", why);
    struct handle *h = find_handle(id);
    if (!h || h->released) LEAVE("cuMemRelease", CUDA_ERROR_INVALID_VALUE, "%s", h ? "released twice" : "not a handle");
    h->released = 1;
    if (h->maps == 0) destroy_handle(h);
    OK("cuMemRelease");
}

/* ---- address space ----------------------------------------------------------------------- */
EXPORT CUresult cuMemAddressReserve(CUdeviceptr *out, size_t size, size_t alignment, CUdeviceptr hint,
                                    unsigned long long flags) {
    ENTER("cuMemAddressReserve", "size=%zu, alignment=%zu, addr=%#llx, flags=%llu", size, alignment, hint, flags);
    CUresult r;
    const char *why = no_context(&r);
    if (why) LEAVE("cuMemAddressReserve", r, "%s", why);
    size_t host_page = (size_t)sysconf(_SC_PAGESIZE);
    if (flags) LEAVE("cuMemAddressReserve", CUDA_ERROR_INVALID_VALUE, "flags must be 0");
    if (!size || size % host_page) LEAVE("cuMemAddressReserve", CUDA_ERROR_INVALID_VALUE, "size is not a multiple of the host page size");
    if (alignment & (alignment - 1)) LEAVE("cuMemAddressReserve", CUDA_ERROR_INVALID_VALUE, "alignment is not a power of two");
    size_t align = alignment > granularity ? alignment : granularity;
    size_t region_size = size + align;
    void *region = mmap(NULL, region_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (region == MAP_FAILED) LEAVE("cuMemAddressReserve", CUDA_ERROR_OUT_OF_MEMORY, "host mmap failed: errno %d", errno);
    struct reservation *res = calloc(1, sizeof *res);
    size_t granules = (size + granularity - 1) / granularity;
    res->slots = calloc(granules, sizeof *res->slots);
    res->access = calloc(granules, 1);
    if (!res->slots || !res->access) {
        munmap(region, region_size);
        free(res->slots);
        free(res->access);
        free(res);
        LEAVE("cuMemAddressReserve", CUDA_ERROR_OUT_OF_MEMORY, "host calloc failed");
    }
    res->region = region;
    res->region_size = region_size;
    res->addr = ((CUdeviceptr)(uintptr_t)region + align - 1) / align * align;
    res->size = size;
    res->next = reservations;
    reservations = res;
    *out = res->addr;
    snprintf(args + strlen(args), sizeof args - strlen(args), " => %#llx", res->addr);
    OK("cuMemAddressReserve");
}

EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    ENTER("cuMemAddressFree", "ptr=%#llx, size=%zu", ptr, size);
    CUresult r;
    const char *why = no_context(&r);
    if (why) LEAVE("cuMemAddressFree", r, "%s", why);
    struct reservation *res = reservations;
    while (res && res->addr != ptr) res = res->next;
    if (!res) LEAVE("cuMemAddressFree", CUDA_ERROR_INVALID_VALUE, "ptr is not a reservation");
    if (res->size != size) LEAVE("cuMemAddressFree", CUDA_ERROR_INVALID_VALUE, "size %zu != reserved %zu", size, res->size);
    size_t granules = size / granularity;
    for (size_t i = 0; i < granules; i++)
        if (res->slots[i]) LEAVE("cuMemAddressFree", CUDA_ERROR_INVALID_VALUE, "still mapped at %#llx", res->addr + i * granularity);
    free_reservation(res);
    OK("cuMemAddressFree");
}

/* ---- mappings ---------------------------------------------------------------------------- */
EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle id,
                         unsigned long long flags) {
    ENTER("cuMemMap", "ptr=%#llx, size=%zu, offset=%zu, handle=%#llx, flags=%llu", ptr, size, offset, id, flags);
    CUresult r;
    const char *why = no_context(&r);
    if (why) LEAVE("cuMemMap", r, "%s", why);
    if (flags) LEAVE("cuMemMap", CUDA_ERROR_INVALID_VALUE, "flags must be 0");
    if (offset) LEAVE("cuMemMap", CUDA_ERROR_INVALID_VALUE, "offset must be 0");
    if (!size || size % granularity || ptr % granularity)
        LEAVE("cuMemMap", CUDA_ERROR_INVALID_VALUE, "ptr and size must be multiples of the granularity");
    struct handle *h = find_handle(id);
    if (!h || h->released) LEAVE("cuMemMap", CUDA_ERROR_INVALID_VALUE, "%s", h ? "handle was released" : "not a handle");
    if (size > h->size) LEAVE("cuMemMap", CUDA_ERROR_INVALID_VALUE, "size %zu > handle size %zu", size, h->size);
    struct reservation *res = reservation_holding(ptr, size);
    if (!res) LEAVE("cuMemMap", CUDA_ERROR_INVALID_VALUE, "range is not inside one reservation");
    size_t first = (ptr - res->addr) / granularity, n = size / granularity;
    for (size_t i = 0; i < n; i++)
        if (res->slots[first + i]) LEAVE("cuMemMap", CUDA_ERROR_INVALID_VALUE, "already mapped at %#llx", ptr + i * granularity);
    if (mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, 0) == MAP_FAILED)
        LEAVE("cuMemMap", CUDA_ERROR_OUT_OF_MEMORY, "host mmap failed: errno %d", errno);
    struct mapping *m = malloc(sizeof *m);
    m->addr = ptr;
    m->size = size;
    m->h = h;
    for (size_t i = 0; i < n; i++) res->slots[first + i] = m;
    h->maps++;
    OK("cuMemMap");
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    ENTER("cuMemUnmap", "ptr=%#llx, size=%zu", ptr, size);
    CUresult r;
    const char *why = no_context(&r);
    if (why) LEAVE("cuMemUnmap", r, "%s", why);
    struct reservation *res = size ? reservation_holding(ptr, size) : NULL;
    if (!res) LEAVE("cuMemUnmap", CUDA_ERROR_INVALID_VALUE, "range is not inside one reservation");
    /* whole mappings only: the range must start and end on mapping boundaries, with no gap */
    CUdeviceptr at = ptr;
    while (at < ptr + size) {
        struct mapping *m = (at - res->addr) % granularity ? NULL : res->slots[(at - res->addr) / granularity];
        if (!m) LEAVE("cuMemUnmap", CUDA_ERROR_INVALID_VALUE, "nothing mapped at %#llx", at);
        if (m->addr != at) LEAVE("cuMemUnmap", CUDA_ERROR_INVALID_VALUE, "%#llx is inside a mapping", at);
        at += m->size;
    }
    if (at != ptr + size) LEAVE("cuMemUnmap", CUDA_ERROR_INVALID_VALUE, "the range ends inside a mapping");
    long hazards_before = hazards;
    for (at = ptr; at < ptr + size;) {
        struct mapping *m = res->slots[(at - res->addr) / granularity];
        at += m->size;
        drop_mapping(res, m);
    }
    if (hazards != hazards_before) LEAVE("cuMemUnmap", CUDA_SUCCESS, "HAZARD: unmapped memory with unsynchronized device work");
    OK("cuMemUnmap");
}

EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    ENTER("cuMemSetAccess", "ptr=%#llx, size=%zu, flags=%d, count=%zu", ptr, size, desc && count ? desc[0].flags : -1, count);
    CUresult r;
    const char *why = no_context(&r);
    if (why) LEAVE("cuMemSetAccess", r, "%s", why);
    if (!desc || !count) LEAVE("cuMemSetAccess", CUDA_ERROR_INVALID_VALUE, "no access descriptor");
    int flags = -1;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != LOCATION_DEVICE || !valid_device(desc[i].location.id))
            LEAVE("cuMemSetAccess", CUDA_ERROR_INVALID_DEVICE, "descriptor %zu does not name a device", i);
        if (desc[i].flags != 0 && desc[i].flags != 1 && desc[i].flags != 3)
            LEAVE("cuMemSetAccess", CUDA_ERROR_INVALID_VALUE, "descriptor %zu: bad flags %d", i, desc[i].flags);
        if (desc[i].flags == 1 && !read_only_supported)
            LEAVE("cuMemSetAccess", CUDA_ERROR_NOT_SUPPORTED, "this device refuses read-only access");
        if (desc[i].location.id == current_ctx()->device) flags = desc[i].flags;
    }
    if (!size || size % granularity || ptr % granularity)
        LEAVE("cuMemSetAccess", CUDA_ERROR_INVALID_VALUE, "ptr and size must be multiples of the granularity");
    struct reservation *res = reservation_holding(ptr, size);
    if (!res) LEAVE("cuMemSetAccess", CUDA_ERROR_INVALID_VALUE, "range is not inside one reservation");
    size_t first = (ptr - res->addr) / granularity, n = size / granularity;
    for (size_t i = 0; i < n; i++)
        if (!res->slots[first + i]) LEAVE("cuMemSetAccess", CUDA_ERROR_INVALID_VALUE, "not mapped at %#llx", ptr + i * granularity);
    if (flags >= 0) {
        int prot = flags == 3 ? PROT_READ | PROT_WRITE : flags == 1 ? PROT_READ : PROT_NONE;
        if (mprotect((void *)ptr, size, prot) != 0)
            LEAVE("cuMemSetAccess", CUDA_ERROR_OUT_OF_MEMORY, "host mprotect failed: errno %d", errno);
        memset(res->access + first, flags, n);
    }
    OK("cuMemSetAccess");
}

EXPORT CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr) {
    ENTER("cuMemGetAccess", "ptr=%#llx", ptr);
    CUresult r;
    const char *why = no_context(&r);
    if (why) LEAVE("cuMemGetAccess", r, "%s", why);
    if (!location || location->type != LOCATION_DEVICE || !valid_device(location->id))
        LEAVE("cuMemGetAccess", CUDA_ERROR_INVALID_DEVICE, "location does not name a device");
    struct reservation *res = reservation_holding(ptr, 1);
    if (!res || !res->slots[(ptr - res->addr) / granularity]) LEAVE("cuMemGetAccess", CUDA_ERROR_INVALID_VALUE, "not mapped");
    *flags = res->access[(ptr - res->addr) / granularity];
    OK("cuMemGetAccess");
}

EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) {
    ENTER("cuMemsetD8", "dst=%#llx, value=%u, n=%zu", dst, value, n);
    CUresult r;
    const char *why = no_context(&r);
    if (why) LEAVE("cuMemsetD8", r, "%s", why);
    if (!n) OK("cuMemsetD8");
    struct reservation *res = reservation_holding(dst, n);
    if (!res) LEAVE("cuMemsetD8", CUDA_ERROR_INVALID_VALUE, "range is not inside one reservation");
    size_t first = (dst - res->addr) / granularity, last = (dst + n - 1 - res->addr) / granularity;
    for (size_t i = first; i <= last; i++)
        if (!res->slots[i] || res->access[i] != 3)
            LEAVE("cuMemsetD8", CUDA_ERROR_INVALID_VALUE, "not mapped read-write at %#llx", res->addr + i * granularity);
    memset((void *)dst, value, n);
    for (size_t i = first; i <= last; i++) res->slots[i]->h->pending = 1;
    OK("cuMemsetD8");
}

/* ---- errors and the proc-address table --------------------------------------------------- */
EXPORT CUresult cuGetErrorName(CUresult error, const char **name) {
    *name = result_name(error);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char **text) {
    *text = result_name(error);
    return CUDA_SUCCESS;
}

struct entry {
    const char *name;
    void *fn;
};
static const struct entry table[] = {
    {"cuGetErrorName", (void *)cuGetErrorName},
    {"cuGetErrorString", (void *)cuGetErrorString},
    {"cuInit", (void *)cuInit},
    {"cuDriverGetVersion", (void *)cuDriverGetVersion},
    {"cuDeviceGet", (void *)cuDeviceGet},
    {"cuDeviceGetCount", (void *)cuDeviceGetCount},
    {"cuDeviceGetName", (void *)cuDeviceGetName},
    {"cuDeviceTotalMem", (void *)cuDeviceTotalMem_v2},
    {"cuDeviceGetAttribute", (void *)cuDeviceGetAttribute},
    {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", (void *)cuDevicePrimaryCtxRelease_v2},
    {"cuCtxGetCurrent", (void *)cuCtxGetCurrent},
    {"cuCtxSetCurrent", (void *)cuCtxSetCurrent},
    {"cuCtxPushCurrent", (void *)cuCtxPushCurrent_v2},
    {"cuCtxPopCurrent", (void *)cuCtxPopCurrent_v2},
    {"cuCtxGetDevice", (void *)cuCtxGetDevice},
    {"cuCtxSynchronize", (void *)cuCtxSynchronize},
    {"cuMemGetAllocationGranularity", (void *)cuMemGetAllocationGranularity},
    {"cuMemGetInfo", (void *)cuMemGetInfo_v2},
    {"cuMemCreate", (void *)cuMemCreate},
    {"cuMemRelease", (void *)cuMemRelease},
    {"cuMemAddressReserve", (void *)cuMemAddressReserve},
    {"cuMemAddressFree", (void *)cuMemAddressFree},
    {"cuMemMap", (void *)cuMemMap},
    {"cuMemUnmap", (void *)cuMemUnmap},
    {"cuMemSetAccess", (void *)cuMemSetAccess},
    {"cuMemGetAccess", (void *)cuMemGetAccess},
    {"cuMemsetD8", (void *)cuMemsetD8_v2},
};

/* cuda-bindings resolves every entry point through this call; unknown names are "not found"
 * (the bindings then raise a clear error if Python calls one). */
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status) {
    (void)version;
    (void)flags;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(table[i].name, symbol) == 0) {
            *pfn = table[i].fn;
            if (status) *status = 0; /* CU_GET_PROC_ADDRESS_SUCCESS */
            return CUDA_SUCCESS;
        }
    }
    *pfn = NULL;
    if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return CUDA_ERROR_NOT_FOUND;
}

/* ---- test controls ----------------------------------------------------------------------- */
/* Forget everything (host memory included) and start over with this configuration. */
EXPORT void fake_cuda_reset(size_t gran, size_t memory, int vmm, int read_only, int devices) {
    pthread_mutex_lock(&lock);
    while (reservations) free_reservation(reservations);
    for (size_t i = 0; i < handle_count; i++)
        if (handles[i]) destroy_handle(handles[i]);
    handle_count = 0;
    memory_used = 0;
    memset(contexts, 0, sizeof contexts);
    granularity = gran;
    device_memory = memory;
    vmm_supported = vmm;
    read_only_supported = read_only;
    device_count = devices < 1 ? 1 : devices > MAX_DEVICES ? MAX_DEVICES : devices;
    initialized = 0;
    fail_count = 0;
    hazards = 0;
    log_len = 0;
    if (log_buf) log_buf[0] = 0;
    ctx_depth = 0; /* this thread's stack only: other threads' stacks name dead contexts */
    pthread_mutex_unlock(&lock);
}

/* Fail the nth next call of `name` ("" = any call) with `result`; nth < 0: every such call. */
EXPORT int fake_cuda_fail(const char *name, long nth, int result) {
    pthread_mutex_lock(&lock);
    int ok = fail_count < MAX_FAILS && nth != 0;
    if (ok) {
        struct fail_rule *rule = &fails[fail_count++];
        snprintf(rule->name, sizeof rule->name, "%s", name ? name : "");
        rule->countdown = nth;
        rule->result = result;
    }
    pthread_mutex_unlock(&lock);
    return ok;
}

EXPORT void fake_cuda_clear_failures(void) {
    pthread_mutex_lock(&lock);
    fail_count = 0;
    pthread_mutex_unlock(&lock);
}

/* The call log since the last reset or clear, one call per line (a copy the caller frees). */
EXPORT char *fake_cuda_log(int clear) {
    pthread_mutex_lock(&lock);
    char *copy = strdup(log_buf ? log_buf : "");
    if (clear) {
        log_len = 0;
        if (log_buf) log_buf[0] = 0;
    }
    pthread_mutex_unlock(&lock);
    return copy;
}

EXPORT void fake_cuda_free(char *text) { free(text); }

EXPORT long fake_cuda_hazards(void) { return hazards; }

static void state_append(size_t *len, size_t *cap, const char *fmt, ...) {
    char piece[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(piece, sizeof piece, fmt, ap);
    va_end(ap);
    if (*len + (size_t)n + 1 > *cap) {
        *cap = (*cap + (size_t)n + 1) * 2;
        state_buf = realloc(state_buf, *cap);
    }
    memcpy(state_buf + *len, piece, (size_t)n + 1);
    *len += (size_t)n;
}

/* Live objects as JSON: handles, reservations, mappings (with access), context retains. */
EXPORT char *fake_cuda_state(void) {
    pthread_mutex_lock(&lock);
    size_t len = 0, cap = 0;
    state_buf = NULL;
    state_append(&len, &cap, "{\"memory_used\": %zu, \"granularity\": %zu, \"handles\": [", memory_used, granularity);
    const char *sep = "";
    for (size_t i = 0; i < handle_count; i++) {
        struct handle *h = handles[i];
        if (!h) continue;
        state_append(&len, &cap, "%s{\"id\": %llu, \"size\": %zu, \"released\": %d, \"maps\": %d, \"pending\": %d}", sep, h->id,
                     h->size, h->released, h->maps, h->pending);
        sep = ", ";
    }
    state_append(&len, &cap, "], \"reservations\": [");
    sep = "";
    for (struct reservation *r = reservations; r; r = r->next) {
        state_append(&len, &cap, "%s{\"addr\": %llu, \"size\": %zu}", sep, r->addr, r->size);
        sep = ", ";
    }
    state_append(&len, &cap, "], \"mappings\": [");
    sep = "";
    for (struct reservation *r = reservations; r; r = r->next) {
        size_t n = r->size / granularity;
        for (size_t i = 0; i < n; i++) {
            struct mapping *m = r->slots[i];
            if (!m || m->addr != r->addr + i * granularity) continue;
            state_append(&len, &cap, "%s{\"addr\": %llu, \"size\": %zu, \"handle\": %llu, \"access\": %d}", sep, m->addr, m->size,
                         m->h->id, r->access[i]);
            sep = ", ";
        }
    }
    state_append(&len, &cap, "], \"context_retains\": [");
    for (int d = 0; d < device_count; d++) state_append(&len, &cap, "%s%d", d ? ", " : "", contexts[d].retains);
    state_append(&len, &cap, "], \"hazards\": %ld}", hazards);
    char *out = state_buf;
    state_buf = NULL;
    pthread_mutex_unlock(&lock);
    return out;
}
