/*
 * cuda.c - the CUDA driver API, opened at run time from libcuda.so.1 (no CUDA headers, no link-time dependency).
 *
 * Entry points are resolved once by dlsym of their explicit versioned names (cuMemAlloc_v2, ...), the names
 * cuda.h's macros expand to for the legacy default stream; a missing one is named in FM_ERR_LIBRARY. Work runs
 * in the device's primary context, the one PyTorch and CuPy use, so their pointers and streams are valid here.
 * The only mutable global is the table below, written once under a lock and read-only once published: every
 * other function may be called from several threads at once (the driver itself is thread-safe).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dladdr */
#endif
#include "fm.h"

#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* The slice of cuda.h used here. Enum values as in cuda.h (CUdevice_attribute, CUfunction_attribute, CUresult). */
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef unsigned long long CUdeviceptr;
/* cuda.h's CUlaunchAttribute (CUDA 11.8+): an id, padding to 8 bytes, a 64-byte value union; only the
 * programmatic-stream-serialization id and its int value are used. */
typedef struct fm_launch_attr {
    int id;
    char pad[4];
    union {
        char bytes[64];
        int value;
        void *align; /* (the union holds pointers: 8-byte aligned) */
    } value;
} fm_launch_attr;
enum { CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6 };
/* cuda.h's CUlaunchConfig (CUDA 11.8+), for the cluster occupancy query and a dependent launch (cuLaunchKernelEx). */
typedef struct fm_launch_config {
    unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, smem_bytes;
    CUstream stream;
    fm_launch_attr *attrs;
    unsigned num_attrs;
} fm_launch_config;

enum {
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97,
    CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3,
    CU_FUNC_ATTRIBUTE_NUM_REGS = 4,
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
};
enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_STUB_LIBRARY = 34,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
};

/* Without opting in, a block gets at most 48 KiB of dynamic shared memory (CUDA C++ Programming Guide, "Shared
 * Memory" of compute capability 7.x and later). */
#define FM_SMEM_DEFAULT_LIMIT (48u * 1024u)

typedef struct fm_cuda_api {
    CUresult (*cuGetErrorName)(CUresult error, const char **str);
    CUresult (*cuGetErrorString)(CUresult error, const char **str);
    CUresult (*cuInit)(unsigned int flags);
    CUresult (*cuDriverGetVersion)(int *version);
    CUresult (*cuDeviceGetCount)(int *count);
    CUresult (*cuDeviceGet)(CUdevice *device, int ordinal);
    CUresult (*cuDeviceGetAttribute)(int *value, int attrib, CUdevice dev);
    CUresult (*cuDeviceGetName)(char *name, int len, CUdevice dev);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *pctx, CUdevice dev);
    CUresult (*cuDevicePrimaryCtxRelease)(CUdevice dev);
    CUresult (*cuCtxSetCurrent)(CUcontext ctx);
    CUresult (*cuModuleLoadData)(CUmodule *module, const void *image);
    CUresult (*cuModuleGetFunction)(CUfunction *hfunc, CUmodule hmod, const char *name);
    CUresult (*cuModuleUnload)(CUmodule hmod);
    CUresult (*cuFuncSetAttribute)(CUfunction hfunc, int attrib, int value);
    CUresult (*cuFuncGetAttribute)(int *value, int attrib, CUfunction hfunc);
    CUresult (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int *num_blocks, CUfunction func, int block_size,
                                                            size_t dynamic_smem_size);
    /* Optional (NULL on drivers before CUDA 11.8, which run no sm_90 cluster kernels anyway). */
    CUresult (*cuOccupancyMaxActiveClusters)(int *num_clusters, CUfunction func, const fm_launch_config *config);
    CUresult (*cuLaunchKernel)(CUfunction f, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                               unsigned block_y, unsigned block_z, unsigned smem_bytes, CUstream stream,
                               void **params, void **extra);
    /* Optional (CUDA 12.0+): a launch with attributes, here programmatic dependent launch (fm_kernel_launch). */
    CUresult (*cuLaunchKernelEx)(const fm_launch_config *config, CUfunction f, void **params, void **extra);
    CUresult (*cuMemAlloc)(CUdeviceptr *dptr, size_t bytes);
    /* Optional (CUDA 10.1+): lets fm_mem_alloc run while the thread captures a CUDA graph, as PyTorch's allocator does. */
    CUresult (*cuThreadExchangeStreamCaptureMode)(int *mode);
    CUresult (*cuMemFree)(CUdeviceptr dptr);
    CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream);
    CUresult (*cuMemcpyDtoHAsync)(void *dst, CUdeviceptr src, size_t bytes, CUstream stream);
    CUresult (*cuMemsetD8Async)(CUdeviceptr dst, unsigned char value, size_t n, CUstream stream);
    CUresult (*cuStreamSynchronize)(CUstream stream);
    CUresult (*cuCtxSynchronize)(void);
    CUresult (*cuStreamCreate)(CUstream *stream, unsigned int flags);
    CUresult (*cuStreamDestroy)(CUstream stream);
    CUresult (*cuMemAllocHost)(void **p, size_t bytes);
    CUresult (*cuMemFreeHost)(void *p);
    CUresult (*cuEventCreate)(void **event, unsigned int flags);
    CUresult (*cuEventRecord)(void *event, CUstream stream);
    CUresult (*cuEventSynchronize)(void *event);
    CUresult (*cuEventElapsedTime)(float *ms, void *start, void *end);
    CUresult (*cuEventDestroy)(void *event);
    /* Optional (CUDA 11.4+; programmatic edges in a capture 12.3+): a chain's launches captured once and replayed as
     * one graph launch (fm_graph_*). */
    CUresult (*cuStreamBeginCapture)(CUstream stream, int mode);
    CUresult (*cuStreamEndCapture)(CUstream stream, void **graph);
    CUresult (*cuStreamIsCapturing)(CUstream stream, int *status);
    CUresult (*cuGraphInstantiateWithFlags)(void **exec, void *graph, unsigned long long flags);
    CUresult (*cuGraphLaunch)(void *exec, CUstream stream);
    CUresult (*cuGraphExecDestroy)(void *exec);
    CUresult (*cuGraphDestroy)(void *graph);
    /* the node a capture added last (CUDA 12.3's form with edge data; else 11.3's), and a kernel node's arguments
     * changed in an instantiated graph (CUDA 12.0's params struct) */
    CUresult (*cuStreamGetCaptureInfo3)(CUstream stream, int *status, unsigned long long *id, void **graph,
                                        void *const **deps, const void **edges, size_t *n);
    CUresult (*cuStreamGetCaptureInfo2)(CUstream stream, int *status, unsigned long long *id, void **graph,
                                        void *const **deps, size_t *n);
    CUresult (*cuGraphExecKernelNodeSetParams)(void *exec, void *node, const void *params);
    /* Optional (CUDA 12.0+; sm_90's TMA): a tensor map of a tiled array (fm_tensor_map_2d); cuda.h's enums as ints. */
    CUresult (*cuTensorMapEncodeTiled)(fm_tensor_map *map, int dtype, unsigned rank, void *base,
                                       const unsigned long long *dims, const unsigned long long *strides,
                                       const unsigned *box, const unsigned *elem_strides, int interleave, int swizzle,
                                       int l2_promotion, int oob_fill);
} fm_cuda_api;

/* Written once under g_lock, published through g_ready (release), read-only afterwards. */
static fm_cuda_api g_api;
static void *g_handle;
static int g_driver_version; /* e.g. 13000 for CUDA 13.0 */
static atomic_int g_ready;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

#define FM_NO_DRIVER_HINT "no NVIDIA driver found: install the NVIDIA driver, or use device='cpu'"

/* Adds a hint for the results a user can do something about. */
static void cu_hint(fm_error *err, CUresult r) {
    switch (r) {
    case CUDA_ERROR_OUT_OF_MEMORY:
        fm_error_hint(err, "the GPU is out of memory: free tensors (torch.cuda.empty_cache()) or use smaller batches");
        break;
    case CUDA_ERROR_NO_DEVICE:
        fm_error_hint(err, "no CUDA GPU is visible: check nvidia-smi and CUDA_VISIBLE_DEVICES, or use device='cpu'");
        break;
    case CUDA_ERROR_INVALID_CONTEXT:
        fm_error_hint(err, "this thread has no current CUDA context: fm_gpu_activate must run on it first");
        break;
    case CUDA_ERROR_INVALID_IMAGE:
    case CUDA_ERROR_NO_BINARY_FOR_GPU:
    case CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
        fm_error_hint(err, "the CUBIN does not fit this GPU or driver (driver supports CUDA %d.%d): compile for the "
                      "GPU's compute capability, or update the NVIDIA driver to at least NVRTC's CUDA version",
                      g_driver_version / 1000, g_driver_version % 1000 / 10);
        break;
    case CUDA_ERROR_ILLEGAL_ADDRESS:
        fm_error_hint(err, "a kernel accessed memory it does not own (from a launch with a bad pointer, or any earlier "
                      "asynchronous work); fusedmlp's cluster kernels also stop this way where an exchange waits for "
                      "over a minute, which is a deadlock and a fusedmlp bug: please report it with the model's widths "
                      "and activations. The CUDA context is unusable now: restart the process");
        break;
    default:
        break;
    }
}

/* Records a failed driver call: "<call> failed: CUDA_ERROR_NAME: description (file:line)"; err->code = r. */
static fm_status cu_failed(fm_error *err, fm_status st, CUresult r, const char *call, const char *file, int line) {
    const char *name = NULL, *text = NULL;
    if (g_api.cuGetErrorName == NULL || g_api.cuGetErrorName(r, &name) != CUDA_SUCCESS || name == NULL)
        name = "CUDA_ERROR_UNKNOWN_CODE";
    if (g_api.cuGetErrorString == NULL || g_api.cuGetErrorString(r, &text) != CUDA_SUCCESS || text == NULL)
        text = "no description";
    if (err != NULL && err->status == FM_OK)
        err->code = r;
    fm_fail(err, st, "%s failed: %s: %s (CUresult %d) (%s:%d)", call, name, text, r, file, line);
    cu_hint(err, r);
    return st;
}

/* Every driver call goes through here: on failure record it and jump to cleanup (`st` must be in scope). The
 * recorded text is the call as written, e.g. "cuMemAlloc(&p, bytes)". */
#define CU_CHECK(fn, args)                                                                                      \
    do {                                                                                                        \
        CUresult r_ = g_api.fn args;                                                                            \
        if (r_ != CUDA_SUCCESS) {                                                                               \
            st = cu_failed(err, FM_ERR_CUDA, r_, #fn #args, __FILE__, __LINE__);                                \
            goto cleanup;                                                                                       \
        }                                                                                                       \
    } while (0)

/* Fills api from handle; returns the first missing symbol's name, or NULL when all resolved. */
static const char *resolve_all(void *handle, fm_cuda_api *api) {
#define FM_RESOLVE(field, sym)                                                                                  \
    do {                                                                                                        \
        *(void **)&api->field = dlsym(handle, sym);                                                            \
        if (api->field == NULL)                                                                                 \
            return sym;                                                                                         \
    } while (0)
    FM_RESOLVE(cuGetErrorName, "cuGetErrorName");
    FM_RESOLVE(cuGetErrorString, "cuGetErrorString");
    FM_RESOLVE(cuInit, "cuInit");
    FM_RESOLVE(cuDriverGetVersion, "cuDriverGetVersion");
    FM_RESOLVE(cuDeviceGetCount, "cuDeviceGetCount");
    FM_RESOLVE(cuDeviceGet, "cuDeviceGet");
    FM_RESOLVE(cuDeviceGetAttribute, "cuDeviceGetAttribute");
    FM_RESOLVE(cuDeviceGetName, "cuDeviceGetName");
    FM_RESOLVE(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    FM_RESOLVE(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    FM_RESOLVE(cuCtxSetCurrent, "cuCtxSetCurrent");
    FM_RESOLVE(cuModuleLoadData, "cuModuleLoadData");
    FM_RESOLVE(cuModuleGetFunction, "cuModuleGetFunction");
    FM_RESOLVE(cuModuleUnload, "cuModuleUnload");
    FM_RESOLVE(cuFuncSetAttribute, "cuFuncSetAttribute");
    FM_RESOLVE(cuFuncGetAttribute, "cuFuncGetAttribute");
    FM_RESOLVE(cuOccupancyMaxActiveBlocksPerMultiprocessor, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
    FM_RESOLVE(cuLaunchKernel, "cuLaunchKernel");
    FM_RESOLVE(cuMemAlloc, "cuMemAlloc_v2");
    FM_RESOLVE(cuMemFree, "cuMemFree_v2");
    FM_RESOLVE(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
    FM_RESOLVE(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
    FM_RESOLVE(cuMemsetD8Async, "cuMemsetD8Async");
    FM_RESOLVE(cuStreamSynchronize, "cuStreamSynchronize");
    FM_RESOLVE(cuCtxSynchronize, "cuCtxSynchronize");
    FM_RESOLVE(cuStreamCreate, "cuStreamCreate");
    FM_RESOLVE(cuStreamDestroy, "cuStreamDestroy_v2");
    FM_RESOLVE(cuMemAllocHost, "cuMemAllocHost_v2");
    FM_RESOLVE(cuMemFreeHost, "cuMemFreeHost");
    FM_RESOLVE(cuEventCreate, "cuEventCreate");
    FM_RESOLVE(cuEventRecord, "cuEventRecord");
    FM_RESOLVE(cuEventSynchronize, "cuEventSynchronize");
    FM_RESOLVE(cuEventElapsedTime, "cuEventElapsedTime");
    FM_RESOLVE(cuEventDestroy, "cuEventDestroy_v2");
#undef FM_RESOLVE
    *(void **)&api->cuOccupancyMaxActiveClusters = dlsym(handle, "cuOccupancyMaxActiveClusters");
    *(void **)&api->cuLaunchKernelEx = dlsym(handle, "cuLaunchKernelEx");
    *(void **)&api->cuThreadExchangeStreamCaptureMode = dlsym(handle, "cuThreadExchangeStreamCaptureMode");
    *(void **)&api->cuStreamBeginCapture = dlsym(handle, "cuStreamBeginCapture_v2");
    *(void **)&api->cuStreamEndCapture = dlsym(handle, "cuStreamEndCapture");
    *(void **)&api->cuStreamIsCapturing = dlsym(handle, "cuStreamIsCapturing");
    *(void **)&api->cuGraphInstantiateWithFlags = dlsym(handle, "cuGraphInstantiateWithFlags");
    *(void **)&api->cuGraphLaunch = dlsym(handle, "cuGraphLaunch");
    *(void **)&api->cuGraphExecDestroy = dlsym(handle, "cuGraphExecDestroy");
    *(void **)&api->cuGraphDestroy = dlsym(handle, "cuGraphDestroy");
    *(void **)&api->cuStreamGetCaptureInfo3 = dlsym(handle, "cuStreamGetCaptureInfo_v3");
    *(void **)&api->cuStreamGetCaptureInfo2 = dlsym(handle, "cuStreamGetCaptureInfo_v2");
    *(void **)&api->cuGraphExecKernelNodeSetParams = dlsym(handle, "cuGraphExecKernelNodeSetParams_v2");
    *(void **)&api->cuTensorMapEncodeTiled = dlsym(handle, "cuTensorMapEncodeTiled");
    return NULL;
}

/* Called with g_lock held and g_ready == 0: opens the driver, resolves the table, runs cuInit. */
static fm_status load_locked(fm_error *err) {
    fm_status st = FM_OK;
    void *h = NULL;
    CUresult r;

    dlerror();
    h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        const char *why = dlerror();
        st = fm_fail(err, FM_ERR_LIBRARY, "libcuda.so.1 (the NVIDIA driver's CUDA library) could not be loaded: %s",
                     why ? why : "dlopen failed");
        fm_error_hint(err, FM_NO_DRIVER_HINT);
        goto cleanup;
    }
    const char *missing = resolve_all(h, &g_api);
    if (missing != NULL) {
        Dl_info info;
        const char *file = "libcuda.so.1";
        if (g_api.cuGetErrorName != NULL && dladdr(*(void **)&g_api.cuGetErrorName, &info) != 0 &&
            info.dli_fname != NULL)
            file = info.dli_fname;
        st = fm_fail(err, FM_ERR_LIBRARY, "%s lacks the symbol %s: the NVIDIA driver is too old", file, missing);
        fm_error_hint(err, "update the NVIDIA driver (CUDA 12 or newer), or use device='cpu'");
        goto cleanup;
    }
    r = g_api.cuInit(0);
    if (r == CUDA_ERROR_STUB_LIBRARY) {
        /* The toolkit's stub libcuda.so.1 links but has no driver behind it: to the user, no driver. */
        st = cu_failed(err, FM_ERR_LIBRARY, r, "cuInit(0)", __FILE__, __LINE__);
        fm_error_hint(err, FM_NO_DRIVER_HINT);
        goto cleanup;
    }
    if (r != CUDA_SUCCESS) {
        st = cu_failed(err, FM_ERR_CUDA, r, "cuInit(0)", __FILE__, __LINE__);
        goto cleanup;
    }
    CU_CHECK(cuDriverGetVersion, (&g_driver_version));
    g_handle = h;
    h = NULL;
    atomic_store_explicit(&g_ready, 1, memory_order_release);

cleanup:
    if (h != NULL) {
        memset(&g_api, 0, sizeof g_api); /* failures are not cached: the next call starts afresh */
        dlclose(h);
    }
    return st;
}

fm_status fm_cuda_load(fm_error *err) {
    if (atomic_load_explicit(&g_ready, memory_order_acquire))
        return FM_OK;
    fm_status st = FM_OK;
    pthread_mutex_lock(&g_lock);
    if (!atomic_load_explicit(&g_ready, memory_order_relaxed))
        st = load_locked(err);
    pthread_mutex_unlock(&g_lock);
    return st;
}

static int cu_is_ready(void) { return atomic_load_explicit(&g_ready, memory_order_acquire); }

fm_status fm_cuda_device_count(int *count, fm_error *err) {
    fm_status st = fm_cuda_load(err);
    *count = 0;
    if (st != FM_OK)
        return st;
    CU_CHECK(cuDeviceGetCount, (count));
cleanup:
    return st;
}

/* ------------------------------------------------------------------------------------------------ devices */

static fm_status read_attr(CUdevice dev, int attrib, int *value, fm_error *err) {
    fm_status st = FM_OK;
    CU_CHECK(cuDeviceGetAttribute, (value, attrib, dev));
cleanup:
    return st;
}

fm_status fm_gpu_open(int ordinal, fm_gpu *gpu, fm_error *err) {
    fm_gpu g;
    CUcontext ctx = NULL;
    int count = 0, major = 0, minor = 0, sms = 0, optin = 0, per_sm = 0;
    fm_status st;

    memset(&g, 0, sizeof g);
    memset(gpu, 0, sizeof *gpu);
    st = fm_cuda_load(err);
    if (st != FM_OK)
        return st;
    CU_CHECK(cuDeviceGetCount, (&count));
    if (ordinal < 0 || ordinal >= count) {
        st = fm_fail(err, FM_ERR_VALUE, "GPU ordinal %d out of range: %d CUDA device%s visible", ordinal, count,
                     count == 1 ? " is" : "s are");
        fm_error_hint(err, "pick a device in 0..%d, or check CUDA_VISIBLE_DEVICES", count - 1);
        goto cleanup;
    }
    g.ordinal = ordinal;
    CU_CHECK(cuDeviceGet, (&g.device, ordinal));
    if ((st = read_attr(g.device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, &major, err)) != FM_OK ||
        (st = read_attr(g.device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, &minor, err)) != FM_OK ||
        (st = read_attr(g.device, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, &sms, err)) != FM_OK ||
        (st = read_attr(g.device, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, &optin, err)) != FM_OK ||
        (st = read_attr(g.device, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, &per_sm, err)) != FM_OK)
        goto cleanup;
    g.arch = 10 * major + minor;
    g.sm_count = sms;
    g.smem_per_block_optin = (size_t)optin;
    g.smem_per_sm = (size_t)per_sm;
    CU_CHECK(cuDeviceGetName, (g.name, (int)sizeof g.name, g.device));
    g.name[sizeof g.name - 1] = '\0';
    CU_CHECK(cuDevicePrimaryCtxRetain, (&ctx, g.device));
    g.ctx = ctx;
    CU_CHECK(cuCtxSetCurrent, (ctx));
    *gpu = g;
    g.ctx = NULL; /* owned by *gpu now */

cleanup:
    if (g.ctx != NULL)
        g_api.cuDevicePrimaryCtxRelease(g.device);
    return st;
}

void fm_gpu_close(fm_gpu *gpu) {
    if (gpu == NULL)
        return;
    if (gpu->ctx != NULL && cu_is_ready())
        g_api.cuDevicePrimaryCtxRelease(gpu->device); /* a failure here leaves nothing the caller could do */
    memset(gpu, 0, sizeof *gpu);
}

fm_status fm_gpu_activate(const fm_gpu *gpu, fm_error *err) {
    fm_status st = FM_OK;
    if (gpu == NULL || gpu->ctx == NULL || !cu_is_ready())
        return fm_fail(err, FM_ERR_VALUE, "fm_gpu_activate: the GPU is not open (call fm_gpu_open first)");
    CU_CHECK(cuCtxSetCurrent, ((CUcontext)gpu->ctx));
cleanup:
    return st;
}

/* ------------------------------------------------------------------------------------------------ kernels */

/* The calling thread's stream-capture mode set to relaxed; returns the mode it had, for fm_capture_restore. An
 * allocation or a release is not a stream operation, but while any thread captures a CUDA graph in the default
 * (global) mode a thread in that mode may not call cuMemAlloc, cuMemFree, cuModuleUnload and the like: the call
 * fails and invalidates the capture. fusedmlp makes such calls at times no caller chooses: a segmented network's
 * first call of a batch size inside torch.cuda.graph allocates its workspace, and Python frees a model's buffers and
 * modules whenever it collects the model, which may be inside another model's capture (the benchmark's graph of
 * cls1000 at 1024 rows failed so once on an H100, after earlier models were dropped). */
static int fm_capture_relax(void) {
    int mode = 2; /* CU_STREAM_CAPTURE_MODE_RELAXED */
    if (g_api.cuThreadExchangeStreamCaptureMode != NULL)
        g_api.cuThreadExchangeStreamCaptureMode(&mode);
    return mode;
}

static void fm_capture_restore(int mode) {
    if (g_api.cuThreadExchangeStreamCaptureMode != NULL)
        g_api.cuThreadExchangeStreamCaptureMode(&mode);
}

fm_status fm_kernel_load(const fm_gpu *gpu, const void *cubin, const char *name, size_t smem_bytes, int threads,
                         fm_kernel *k, fm_error *err) {
    CUmodule mod = NULL;
    CUfunction fn = NULL;
    int blocks = 0;
    fm_status st;

    memset(k, 0, sizeof *k);
    if (cubin == NULL || name == NULL || threads < 1 || threads > 1024 || smem_bytes > (size_t)INT_MAX)
        return fm_fail(err, FM_ERR_VALUE, "fm_kernel_load: needs a CUBIN, a kernel name, 1..1024 threads (got %d) "
                       "and shared memory below 2 GiB (got %zu bytes)", threads, smem_bytes);
    if (gpu != NULL && gpu->smem_per_block_optin > 0 && smem_bytes > gpu->smem_per_block_optin) {
        st = fm_fail(err, FM_ERR_LIMIT, "kernel '%s' needs %zu bytes of shared memory per block, %s (sm_%d) allows "
                     "at most %zu", name, smem_bytes, gpu->name, gpu->arch, gpu->smem_per_block_optin);
        fm_error_hint(err, "use fewer warps or m_tiles, or stream the weights (resident=0)");
        return st;
    }
    st = fm_gpu_activate(gpu, err);
    if (st != FM_OK)
        return st;

    CU_CHECK(cuModuleLoadData, (&mod, cubin));
    CU_CHECK(cuModuleGetFunction, (&fn, mod, name));
    if (smem_bytes > FM_SMEM_DEFAULT_LIMIT)
        CU_CHECK(cuFuncSetAttribute, (fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)smem_bytes));
    CU_CHECK(cuOccupancyMaxActiveBlocksPerMultiprocessor, (&blocks, fn, threads, smem_bytes));
    CU_CHECK(cuFuncGetAttribute, (&k->regs, CU_FUNC_ATTRIBUTE_NUM_REGS, fn));
    CU_CHECK(cuFuncGetAttribute, (&k->local_bytes, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn));
    if (blocks < 1) {
        /* Registers x threads or shared memory exceed one SM: every launch would fail, so say so now. */
        st = fm_fail(err, FM_ERR_LIMIT, "kernel '%s' fits no block on an SM of %s with %d threads and %zu bytes of "
                     "shared memory (occupancy 0)", name, gpu->name, threads, smem_bytes);
        fm_error_hint(err, "use fewer warps per block or less shared memory");
        goto cleanup;
    }
    k->module = mod;
    k->function = fn;
    k->smem_bytes = smem_bytes;
    k->threads = threads;
    k->blocks_per_sm = blocks;
    mod = NULL; /* owned by *k now */

cleanup:
    if (mod != NULL)
        g_api.cuModuleUnload(mod);
    return st;
}

void fm_kernel_unload(fm_kernel *k) {
    if (k == NULL)
        return;
    if (k->module != NULL && cu_is_ready()) {
        const int mode = fm_capture_relax(); /* (a model collected during another's capture) */
        g_api.cuModuleUnload((CUmodule)k->module);
        fm_capture_restore(mode);
    }
    memset(k, 0, sizeof *k);
}

fm_status fm_kernel_cluster_occupancy(fm_kernel *k, int cluster, fm_error *err) {
    fm_status st = FM_OK;
    int clusters = 0;
    if (k == NULL || k->function == NULL || !cu_is_ready() || cluster < 2)
        return fm_fail(err, FM_ERR_VALUE, "fm_kernel_cluster_occupancy: needs a loaded kernel and a cluster of >= 2 "
                       "CTAs (got %d)", cluster);
    k->max_clusters = 0;
    if (g_api.cuOccupancyMaxActiveClusters == NULL)
        return FM_OK; /* the caller falls back to SMs x blocks per SM / cluster */
    /* The kernel's __cluster_dims__ gives the cluster shape; the grid must be a multiple of it. */
    fm_launch_config config = {(unsigned)cluster, 1, 1, (unsigned)k->threads, 1, 1, (unsigned)k->smem_bytes,
                               NULL, NULL, 0};
    CU_CHECK(cuOccupancyMaxActiveClusters, (&clusters, (CUfunction)k->function, &config));
    if (clusters < 1) {
        st = fm_fail(err, FM_ERR_LIMIT, "the kernel fits no cluster of %d CTAs with %d threads and %zu bytes of "
                     "shared memory each on this GPU (cluster occupancy 0)", cluster, k->threads, k->smem_bytes);
        fm_error_hint(err, "use a smaller cluster or fewer warps");
        goto cleanup;
    }
    k->max_clusters = clusters;
cleanup:
    return st;
}

fm_status fm_kernel_launch(const fm_kernel *k, unsigned grid, fm_stream stream, void **params, int after,
                           fm_error *err) {
    fm_status st = FM_OK;
    if (k == NULL || k->function == NULL || !cu_is_ready())
        return fm_fail(err, FM_ERR_VALUE, "fm_kernel_launch: the kernel is not loaded (call fm_kernel_load first)");
    if (grid == 0)
        return FM_OK; /* an empty batch: nothing to launch (the driver would call a zero grid invalid) */
    if (after && g_api.cuLaunchKernelEx != NULL) {
        fm_launch_attr attr;
        memset(&attr, 0, sizeof attr);
        attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.value = 1;
        fm_launch_config config = {grid, 1, 1, (unsigned)k->threads, 1, 1, (unsigned)k->smem_bytes,
                                   (CUstream)stream, &attr, 1};
        CU_CHECK(cuLaunchKernelEx, (&config, (CUfunction)k->function, params, NULL));
    } else {
        CU_CHECK(cuLaunchKernel, ((CUfunction)k->function, grid, 1, 1, (unsigned)k->threads, 1, 1,
                                  (unsigned)k->smem_bytes, (CUstream)stream, params, NULL));
    }
cleanup:
    return st;
}

/* cuda.h's CUtensorMapDataType UINT8 and UINT16 (TMA moves bytes: the element's size is what counts), INTERLEAVE_NONE,
 * SWIZZLE_128B, L2_PROMOTION_L2_256B (CUTLASS's choice for its sm90 GEMMs' operands), FLOAT_OOB_FILL_NONE (zeros). */
enum { FM_TMAP_UINT8 = 0, FM_TMAP_UINT16 = 1, FM_TMAP_UINT32 = 2, FM_TMAP_INTERLEAVE_NONE = 0, FM_TMAP_SWIZZLE_128B = 3,
       FM_TMAP_L2_256B = 3, FM_TMAP_OOB_ZERO = 0 };

fm_status fm_tensor_map_2d(fm_tensor_map *map, int elem_bytes, fm_devptr base, unsigned long long cols,
                           unsigned long long rows, unsigned box_cols, unsigned box_rows, fm_error *err) {
    fm_status st = FM_OK;
    const unsigned long long row_bytes = cols * (unsigned long long)elem_bytes;
    if (!cu_is_ready() || g_api.cuTensorMapEncodeTiled == NULL)
        return fm_fail(err, FM_ERR_CUDA, "this NVIDIA driver has no cuTensorMapEncodeTiled (CUDA 12.0+), which a GEMM "
                       "reading its input by TMA needs: update the driver");
    if ((elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4) || base % 16 || row_bytes % 16 ||
        box_cols * (unsigned)elem_bytes > 128)
        return fm_fail(err, FM_ERR_VALUE, "fm_tensor_map_2d: %d-byte elements, base %% 16 = %llu, rows of %llu bytes, "
                       "a box %u elements wide: 1, 2 or 4, 0, a multiple of 16, at most 128 bytes", elem_bytes,
                       (unsigned long long)(base % 16), row_bytes, box_cols);
    const unsigned long long dims[2] = {cols, rows}, strides[1] = {row_bytes};
    const unsigned box[2] = {box_cols, box_rows}, elem_strides[2] = {1, 1};
    const int dtype = elem_bytes == 1 ? FM_TMAP_UINT8 : elem_bytes == 2 ? FM_TMAP_UINT16 : FM_TMAP_UINT32;
    CU_CHECK(cuTensorMapEncodeTiled, (map, dtype, 2, (void *)(uintptr_t)base,
                                      dims, strides, box, elem_strides, FM_TMAP_INTERLEAVE_NONE, FM_TMAP_SWIZZLE_128B,
                                      FM_TMAP_L2_256B, FM_TMAP_OOB_ZERO));
cleanup:
    return st;
}

fm_status fm_kernel_time(const fm_kernel *k, unsigned grid, fm_stream stream, void **params, int launches, float *ms,
                         fm_error *err) {
    fm_status st = FM_OK;
    void *start = NULL, *end = NULL;
    *ms = 0.0f;
    if (launches < 1)
        return fm_fail(err, FM_ERR_VALUE, "fm_kernel_time: launches is %d; it must be >= 1", launches);
    CU_CHECK(cuEventCreate, (&start, 0));
    CU_CHECK(cuEventCreate, (&end, 0));
    CU_CHECK(cuEventRecord, (start, (CUstream)stream));
    for (int i = 0; i < launches && st == FM_OK; ++i)
        st = fm_kernel_launch(k, grid, stream, params, 0, err);
    if (st != FM_OK)
        goto cleanup;
    CU_CHECK(cuEventRecord, (end, (CUstream)stream));
    CU_CHECK(cuEventSynchronize, (end));
    CU_CHECK(cuEventElapsedTime, (ms, start, end));
    *ms /= (float)launches;
cleanup:
    if (end != NULL)
        g_api.cuEventDestroy(end);
    if (start != NULL)
        g_api.cuEventDestroy(start);
    return st;
}

static double fm_now_us(void) {
    struct timespec t;
    timespec_get(&t, TIME_UTC);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

fm_status fm_launch_floor(const fm_gpu *gpu, const void *cubin, const char *name, int calls, double *async_us,
                          double *sync_us, fm_error *err) {
    fm_kernel k = {0};
    *async_us = *sync_us = 0.0;
    if (calls < 1)
        return fm_fail(err, FM_ERR_VALUE, "fm_launch_floor: calls is %d; it must be >= 1", calls);
    fm_status st = fm_gpu_activate(gpu, err);
    if (st == FM_OK)
        st = fm_kernel_load(gpu, cubin, name, 0, 32, &k, err);
    fm_devptr none = 0;
    long long rows = 1;
    void *params[] = {&none, &none, &none, &none, &rows, &none, &none}; /* the fused kernels' argument list */
    for (int i = 0; i < 16 && st == FM_OK; ++i) /* warm: the first launches of a module cost more */
        st = fm_kernel_launch(&k, 1, NULL, params, 0, err);
    if (st == FM_OK)
        st = fm_stream_sync(NULL, err);
    double t = fm_now_us();
    for (int i = 0; i < calls && st == FM_OK; ++i)
        st = fm_kernel_launch(&k, 1, NULL, params, 0, err);
    *async_us = (fm_now_us() - t) / calls;
    if (st == FM_OK)
        st = fm_stream_sync(NULL, err);
    t = fm_now_us();
    for (int i = 0; i < calls && st == FM_OK; ++i) {
        st = fm_kernel_launch(&k, 1, NULL, params, 0, err);
        if (st == FM_OK)
            st = fm_stream_sync(NULL, err);
    }
    *sync_us = (fm_now_us() - t) / calls;
    if (k.module != NULL)
        fm_kernel_unload(&k);
    return st;
}

/* ------------------------------------------------------------------------------------------------ memory */

fm_status fm_mem_alloc(fm_devptr *p, size_t bytes, fm_error *err) {
    CUdeviceptr d = 0;
    fm_status st = fm_cuda_load(err);
    *p = 0;
    if (st != FM_OK || bytes == 0)
        return st; /* zero bytes: the null pointer, which fm_mem_free accepts */
    const int mode = fm_capture_relax();
    CUresult r = g_api.cuMemAlloc(&d, bytes);
    fm_capture_restore(mode);
    if (r != CUDA_SUCCESS)
        return cu_failed(err, FM_ERR_CUDA, r, "cuMemAlloc(&d, bytes)", __FILE__, __LINE__);
    *p = (fm_devptr)d;
    return st;
}

void fm_mem_free(fm_devptr p) {
    if (p != 0 && cu_is_ready()) {
        const int mode = fm_capture_relax();
        g_api.cuMemFree((CUdeviceptr)p);
        fm_capture_restore(mode);
    }
}

fm_status fm_memcpy_htod(fm_devptr dst, const void *src, size_t bytes, fm_stream stream, fm_error *err) {
    fm_status st = fm_cuda_load(err);
    if (st != FM_OK || bytes == 0)
        return st;
    CU_CHECK(cuMemcpyHtoDAsync, ((CUdeviceptr)dst, src, bytes, (CUstream)stream));
cleanup:
    return st;
}

fm_status fm_memcpy_dtoh(void *dst, fm_devptr src, size_t bytes, fm_stream stream, fm_error *err) {
    fm_status st = fm_cuda_load(err);
    if (st != FM_OK || bytes == 0)
        return st;
    CU_CHECK(cuMemcpyDtoHAsync, (dst, (CUdeviceptr)src, bytes, (CUstream)stream));
cleanup:
    return st;
}

fm_status fm_memset_d8(fm_devptr dst, unsigned char value, size_t bytes, fm_stream stream, fm_error *err) {
    fm_status st = fm_cuda_load(err);
    if (st != FM_OK || bytes == 0)
        return st;
    CU_CHECK(cuMemsetD8Async, ((CUdeviceptr)dst, value, bytes, (CUstream)stream));
cleanup:
    return st;
}

fm_status fm_stream_sync(fm_stream stream, fm_error *err) {
    fm_status st = fm_cuda_load(err);
    if (st != FM_OK)
        return st;
    CU_CHECK(cuStreamSynchronize, ((CUstream)stream));
cleanup:
    return st;
}

fm_status fm_ctx_sync(fm_error *err) {
    fm_status st = fm_cuda_load(err);
    if (st != FM_OK)
        return st;
    CU_CHECK(cuCtxSynchronize, ());
cleanup:
    return st;
}

/* A stream ordered after the legacy default stream's work (flags 0, not CU_STREAM_NON_BLOCKING): the weights' upload
 * on that stream comes before any kernel on it. */
fm_status fm_stream_create(fm_stream *stream, fm_error *err) {
    CUstream s = NULL;
    fm_status st = fm_cuda_load(err);
    *stream = NULL;
    if (st != FM_OK)
        return st;
    CU_CHECK(cuStreamCreate, (&s, 0));
    *stream = (fm_stream)s;
cleanup:
    return st;
}

void fm_stream_destroy(fm_stream stream) {
    if (stream != NULL && cu_is_ready()) {
        const int mode = fm_capture_relax();
        g_api.cuStreamDestroy((CUstream)stream);
        fm_capture_restore(mode);
    }
}

int fm_graph_available(void) {
    return cu_is_ready() && g_api.cuStreamBeginCapture != NULL && g_api.cuStreamEndCapture != NULL &&
           g_api.cuStreamIsCapturing != NULL && g_api.cuGraphInstantiateWithFlags != NULL &&
           g_api.cuGraphLaunch != NULL && g_api.cuGraphExecDestroy != NULL && g_api.cuGraphDestroy != NULL &&
           (g_api.cuStreamGetCaptureInfo3 != NULL || g_api.cuStreamGetCaptureInfo2 != NULL) &&
           g_api.cuGraphExecKernelNodeSetParams != NULL;
}

fm_status fm_graph_last_node(fm_stream stream, void **node, fm_error *err) {
    fm_status st = FM_OK;
    int status = 0;
    unsigned long long id = 0;
    void *graph = NULL;
    void *const *deps = NULL;
    const void *edges = NULL;
    size_t n = 0;
    *node = NULL;
    if (g_api.cuStreamGetCaptureInfo3 != NULL)
        CU_CHECK(cuStreamGetCaptureInfo3, ((CUstream)stream, &status, &id, &graph, &deps, &edges, &n));
    else
        CU_CHECK(cuStreamGetCaptureInfo2, ((CUstream)stream, &status, &id, &graph, &deps, &n));
    if (status != 1 || n != 1 || deps == NULL)
        return fm_fail(err, FM_ERR_INTERNAL, "a capture's last launch is %zu nodes (status %d), not one", n, status);
    *node = deps[0];
cleanup:
    return st;
}

/* CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h, CUDA 12.0+): func, or kern where func is NULL; ctx NULL: the current one. */
typedef struct {
    void *func;
    unsigned grid[3], block[3], smem;
    void **params, **extra;
    void *kern, *ctx;
} fm_kernel_node_params;

fm_status fm_graph_set_kernel(fm_graph_exec exec, void *node, const fm_kernel *k, unsigned grid, void **params,
                              fm_error *err) {
    fm_status st = FM_OK;
    const fm_kernel_node_params p = {k->function, {grid, 1, 1}, {(unsigned)k->threads, 1, 1}, (unsigned)k->smem_bytes,
                                     params, NULL, NULL, NULL};
    CU_CHECK(cuGraphExecKernelNodeSetParams, (exec, node, &p));
cleanup:
    return st;
}

int fm_stream_capturing(fm_stream stream) {
    int status = 0; /* CU_STREAM_CAPTURE_STATUS_NONE */
    if (!fm_graph_available() || g_api.cuStreamIsCapturing((CUstream)stream, &status) != CUDA_SUCCESS)
        return -1;
    return status != 0;
}

fm_status fm_graph_begin(fm_stream *stream, fm_error *err) {
    fm_status st = FM_OK;
    CUstream s = (CUstream)*stream;
    if (!fm_graph_available())
        return fm_fail(err, FM_ERR_LIBRARY, "the driver has no stream capture (CUDA 11.4+)");
    if (s == NULL) {
        CU_CHECK(cuStreamCreate, (&s, 1)); /* CU_STREAM_NON_BLOCKING: no implicit wait on the legacy stream */
        *stream = (fm_stream)s;
    }
    CU_CHECK(cuStreamBeginCapture, (s, 2)); /* CU_STREAM_CAPTURE_MODE_RELAXED: other threads' calls are theirs */
cleanup:
    return st;
}

fm_status fm_graph_end(fm_stream stream, int keep, fm_graph_exec *exec, void **graph, fm_error *err) {
    fm_status st = FM_OK;
    *exec = NULL;
    *graph = NULL;
    CU_CHECK(cuStreamEndCapture, ((CUstream)stream, graph));
    if (keep)
        CU_CHECK(cuGraphInstantiateWithFlags, (exec, *graph, 0));
cleanup:
    if ((st != FM_OK || !keep) && *graph != NULL) {
        g_api.cuGraphDestroy(*graph);
        *graph = NULL;
    }
    return st;
}

fm_status fm_graph_launch(fm_graph_exec exec, fm_stream stream, fm_error *err) {
    fm_status st = FM_OK;
    CU_CHECK(cuGraphLaunch, (exec, (CUstream)stream));
cleanup:
    return st;
}

void fm_graph_free(fm_graph_exec exec, void *graph) {
    if (exec != NULL && cu_is_ready())
        g_api.cuGraphExecDestroy(exec);
    if (graph != NULL && cu_is_ready())
        g_api.cuGraphDestroy(graph);
}

/* Page-locked host memory in the current context, which the copy engines read and write at the bus's rate. */
fm_status fm_host_alloc(void **p, size_t bytes, fm_error *err) {
    fm_status st = fm_cuda_load(err);
    *p = NULL;
    if (st != FM_OK)
        return st;
    CU_CHECK(cuMemAllocHost, (p, bytes));
cleanup:
    return st;
}

void fm_host_free(void *p) {
    if (p != NULL && cu_is_ready()) {
        const int mode = fm_capture_relax();
        g_api.cuMemFreeHost(p);
        fm_capture_restore(mode);
    }
}
