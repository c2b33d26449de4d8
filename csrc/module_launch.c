/* module_launch.c - the Kernel type: Plan.load puts a CUBIN and the packed weights on the device; run (host arrays,
 * synchronous), launch (device pointers on the caller's stream) and time (the tuner's measurement). */
#include "module_internal.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    PyObject_HEAD PlanObject *plan;
    GpuObject *gpu;
    fm_kernel k;
    int loaded;
    fm_devptr w, b;          /* packed weights and biases on the device */
    fm_devptr x_buf, y_buf;  /* staging for host arrays, grown on demand */
    size_t x_cap, y_cap;
    PyThread_type_lock lock; /* one launch at a time per kernel: the staging buffers are shared */
} KernelObject;

static void Kernel_free_device(KernelObject *self) {
    if (self->gpu != NULL && self->gpu->open) {
        fm_error err = {0};
        fm_gpu_activate(&self->gpu->gpu, &err); /* teardown: failures (driver already shut down) are ignored */
        fm_error_clear(&err);
    }
    fm_mem_free(self->x_buf);
    fm_mem_free(self->y_buf);
    fm_mem_free(self->w);
    fm_mem_free(self->b);
    self->x_buf = self->y_buf = self->w = self->b = 0;
    if (self->loaded)
        fm_kernel_unload(&self->k);
    self->loaded = 0;
}

/* One launch's kernel arguments (params, for cuLaunchKernel): the seven every template takes (x, y, weights, biases,
 * rows, a GEMM's concat part x1 and residual operand res), then, for a GEMM reading A by tensor maps
 * (fm_plan.gemm_tma), the maps of its two input parts for this x, x1 and rows (part 1's a copy of part 0's where
 * the layer has no concat), and for one storing y by TMA (fm_plan.gemm_tma_store) y's map. A kernel ignores
 * arguments past its own. */
typedef struct {
    fm_devptr x, y, x1, res;
    long long rows;
    fm_tensor_map maps[3];
    void *params[10];
} KernelArgs;

static fm_status Kernel_args(KernelObject *self, KernelArgs *a, fm_devptr x, fm_devptr y, long long rows, fm_devptr x1,
                             fm_devptr res, fm_error *err) {
    a->x = x;
    a->y = y;
    a->x1 = x1;
    a->res = res;
    a->rows = rows;
    void *params[] = {&a->x, &a->y, &self->w, &self->b, &a->rows, &a->x1, &a->res, &a->maps[0], &a->maps[1],
                      &a->maps[2]};
    memcpy(a->params, params, sizeof params);
    const fm_plan *p = &self->plan->plan;
    if (!p->gemm_tma && !p->gemm_tma_store)
        return FM_OK;
    if (rows > INT_MAX) /* (a TMA copy's coordinates are 32-bit) */
        return fm_fail(err, FM_ERR_LIMIT, "a GEMM reading its input or storing y by tensor maps takes at most %d rows a "
                       "launch (got %lld): split the batch", INT_MAX, rows);
    memset(a->maps, 0, sizeof a->maps);
    const int l = p->gemm_layer, eb = p->elem_bytes, ob = (int)fm_dtype_size(p->out_dtype);
    fm_status st = FM_OK;
    /* A: a box is a stage's rows of a part, 128 bytes of K (the swizzle's row) by the tile's rows; the parts are the
     * compute dtype's storage (gemm.c's fm_gemm_parts_raw) */
    for (int part = 0; p->gemm_tma && part < 2 && st == FM_OK; ++part) {
        if (part == 1 && p->a1_dtype < 0)
            a->maps[1] = a->maps[0];
        else
            st = fm_tensor_map_2d(&a->maps[part], eb, part ? x1 : x, (unsigned long long)fm_gemm_part_row(p, l, part),
                                  (unsigned long long)rows, (unsigned)(128 / eb), (unsigned)p->gemm_bm, err);
    }
    /* y: a box is a warp's staged slab, 16 rows by 128 bytes (gemm_layer.cu, fm_ts_store) */
    if (p->gemm_tma_store && st == FM_OK)
        st = fm_tensor_map_2d(&a->maps[2], ob, y, (unsigned long long)p->n_real[l], (unsigned long long)rows,
                              (unsigned)(128 / ob), 16u, err);
    return st;
}

/* CTAs per cluster of a fused kernel: the cluster form's (fm_plan.cluster) or the streamed form's split
 * (fm_plan.split), else 1. */
static int fm_fused_cluster(const fm_plan *p) { return p->cluster > 1 ? p->cluster : p->split > 1 ? p->split : 1; }

/* The plan's weights and float blob packed from its network as it is now into the kernel's device buffers,
 * allocated here where `alloc`, else rewritten in place after every stream's work so far (which may still read them:
 * fm_ctx_sync); synchronous. */
static fm_status Kernel_put_weights(KernelObject *self, int alloc, fm_error *err) {
    const fm_plan *p = &self->plan->plan;
    const NetworkObject *net = self->plan->net;
    const size_t w_bytes = p->w_elems * (size_t)p->elem_bytes, b_bytes = (p->b_floats ? p->b_floats : 4) * 4;
    void *wh = malloc(w_bytes ? w_bytes : 1);
    float *bf = malloc(b_bytes);
    fm_status st = FM_OK;
    if (wh == NULL || bf == NULL)
        st = fm_fail(err, FM_ERR_NOMEM, "out of host memory packing %zu weights", p->w_elems);
    if (st == FM_OK) {
        fm_plan_pack(p, (const float *const *)net->w, (const float *const *)net->b, wh, bf);
        fm_plan_pack_norms(p, &net->spec, bf);
        st = alloc ? fm_mem_alloc(&self->w, w_bytes, err) : fm_ctx_sync(err);
    }
    if (st == FM_OK && alloc)
        st = fm_mem_alloc(&self->b, b_bytes, err);
    if (st == FM_OK)
        st = fm_memcpy_htod(self->w, wh, w_bytes, NULL, err);
    if (st == FM_OK && p->b_floats)
        st = fm_memcpy_htod(self->b, bf, p->b_floats * 4, NULL, err);
    if (st == FM_OK)
        st = fm_stream_sync(NULL, err);
    free(wh);
    free(bf);
    return st;
}

/* Uploads the packed weights and loads the module; runs with the GIL released. */
static fm_status Kernel_setup(KernelObject *self, const void *cubin, const char *name, fm_error *err) {
    const fm_plan *p = &self->plan->plan;
    fm_status st = fm_gpu_activate(&self->gpu->gpu, err);
    if (st != FM_OK)
        return st;
    if ((st = fm_kernel_load(&self->gpu->gpu, cubin, name, p->smem_bytes, p->warps * 32, &self->k, err)) != FM_OK)
        return st;
    self->loaded = 1;
    /* (a GEMM's grid is one CTA a tile whatever runs at once: the query only checks that a cluster fits) */
    const int cluster = p->gemm ? p->gemm_cluster : fm_fused_cluster(p);
    if (cluster > 1 && (st = fm_kernel_cluster_occupancy(&self->k, cluster, err)) != FM_OK)
        return st;
    return Kernel_put_weights(self, 1, err);
}

fm_status Kernel_upload(PyObject *kernel, fm_error *err) {
    KernelObject *self = (KernelObject *)kernel;
    fm_status st = fm_gpu_activate(&self->gpu->gpu, err);
    if (st != FM_OK)
        return st;
    PyThread_acquire_lock(self->lock, WAIT_LOCK); /* (not under a run() of this kernel on another thread) */
    st = Kernel_put_weights(self, 0, err);
    PyThread_release_lock(self->lock);
    return st;
}

PyObject *Plan_load(PlanObject *self, PyObject *args) {
    GpuObject *gpu;
    const char *cubin, *name;
    Py_ssize_t cubin_len;
    if (!PyArg_ParseTuple(args, "O!y#s", &GpuType, &gpu, &cubin, &cubin_len, &name))
        return NULL;
    if (!gpu->open) {
        PyErr_SetString(PyExc_RuntimeError, "Gpu is not initialised");
        return NULL;
    }
    KernelObject *k = PyObject_New(KernelObject, &KernelType);
    if (k == NULL)
        return NULL;
    memset((char *)k + offsetof(KernelObject, plan), 0, sizeof *k - offsetof(KernelObject, plan));
    Py_INCREF(self);
    k->plan = self;
    Py_INCREF(gpu);
    k->gpu = gpu;
    k->lock = PyThread_allocate_lock();
    if (k->lock == NULL) {
        Py_DECREF(k);
        return PyErr_NoMemory();
    }
    fm_error err = {0};
    fm_status st;
    Py_BEGIN_ALLOW_THREADS st = Kernel_setup(k, cubin, name, &err);
    Py_END_ALLOW_THREADS if (st != FM_OK) {
        Py_DECREF(k);
        return fm_raise_clear(&err);
    }
    if (Network_add_kernel(self->net, (PyObject *)k) < 0) {
        Py_DECREF(k);
        return NULL;
    }
    return (PyObject *)k;
}

static void Kernel_dealloc(KernelObject *self) {
    if (self->plan != NULL)
        Network_drop_kernel(self->plan->net, (PyObject *)self);
    Kernel_free_device(self);
    if (self->lock)
        PyThread_free_lock(self->lock);
    Py_XDECREF(self->plan);
    Py_XDECREF(self->gpu);
    PyObject_Free(self);
}

static unsigned Kernel_grid(const KernelObject *self, int64_t rows) {
    const fm_plan *p = &self->plan->plan;
    if (p->gemm_norm || p->gemm_pad) /* a norm layer's second kernel, x's pad pass: a CTA per rows_per_cta rows */
        return (unsigned)((rows + p->rows_per_cta - 1) / p->rows_per_cta);
    if (p->gemm) { /* one CTA per tile of y, column tiles fastest; clusters: row tiles in pairs (gemm_layer.cu) */
        const int64_t pair = p->gemm_cluster > 1 ? p->gemm_cluster : 1;
        const int64_t row_tiles = (rows + p->gemm_bm - 1) / p->gemm_bm;
        const int64_t items = (row_tiles + pair - 1) / pair * (p->n_pad[p->gemm_layer] / p->gemm_bn); /* a cluster's */
        if (p->gemm_ws >= 2) { /* persistent: the clusters that fit at once, each taking every grid-th item */
            int64_t slots = (int64_t)(self->gpu->gpu.sm_count > 0 ? self->gpu->gpu.sm_count : 1) *
                            (p->blocks_per_sm > 0 ? p->blocks_per_sm : 1) / pair;
            if (pair > 1 && self->k.max_clusters > 0)
                slots = self->k.max_clusters;
            return (unsigned)((items < slots ? items : slots > 0 ? slots : 1) * pair);
        }
        return (unsigned)(items * pair);
    }
    /* A cluster plan's CTAs come in clusters of p->cluster, all of one cluster on the same row tile; as many clusters
     * as can run at once (the GPCs' SM counts decide, not the SM count alone). */
    int64_t cl = fm_fused_cluster(p);
    int64_t tiles = (rows + p->rows_per_cta - 1) / p->rows_per_cta;
    int64_t slots = (int64_t)self->gpu->gpu.sm_count * (self->k.blocks_per_sm > 0 ? self->k.blocks_per_sm : 1) / cl;
    if (cl > 1 && self->k.max_clusters > 0)
        slots = self->k.max_clusters;
    int64_t grid = tiles < slots ? tiles : slots;
    return (unsigned)((grid > 0 ? grid : 1) * cl);
}

/* Grows a device staging buffer; called with the kernel lock held. */
static fm_status Kernel_reserve(fm_devptr *buf, size_t *cap, size_t bytes, fm_error *err) {
    if (bytes <= *cap)
        return FM_OK;
    fm_mem_free(*buf);
    *buf = 0;
    *cap = 0;
    fm_status st = fm_mem_alloc(buf, bytes, err);
    if (st == FM_OK)
        *cap = bytes;
    return st;
}

/* Bytes of the input staging for rows: x's; for a GEMM plan (timed only: run() refuses it), a buffer wide enough for
 * any of its operands in float32, since time() passes it as the concat part and the residual operand too. */
static size_t Kernel_x_bytes(const fm_plan *p, int64_t rows) {
    if (!p->gemm)
        return (size_t)rows * (size_t)p->x_features * fm_dtype_size(p->in_dtype);
    const int l = p->gemm_layer;
    return (size_t)rows * 4 * (size_t)(p->k_real[l] > p->n_real[l] ? p->k_real[l] : p->n_real[l]);
}

/* Bytes of a row of the output y. */
static size_t Kernel_y_row(const fm_plan *p) {
    return (size_t)p->n_real[p->num_layers - 1] * fm_dtype_size(p->out_dtype);
}

/* Makes the context current, sizes the staging buffers for rows and copies the host input x (Kernel_x_bytes of it)
 * into them (on the legacy default stream); *y_bytes receives the output's size. Called with the kernel lock held. */
static fm_status Kernel_stage(KernelObject *self, const void *x, int64_t rows, size_t *y_bytes, fm_error *err) {
    const fm_plan *p = &self->plan->plan;
    size_t x_bytes = Kernel_x_bytes(p, rows);
    *y_bytes = (size_t)rows * Kernel_y_row(p);
    fm_status st = fm_gpu_activate(&self->gpu->gpu, err);
    if (st == FM_OK)
        st = Kernel_reserve(&self->x_buf, &self->x_cap, x_bytes, err);
    if (st == FM_OK)
        st = Kernel_reserve(&self->y_buf, &self->y_cap, *y_bytes, err);
    if (st == FM_OK)
        st = fm_memcpy_htod(self->x_buf, x, x_bytes, NULL, err);
    return st;
}

/* One piece of a pipelined run (fm_pipe_launch): the fused kernel on rows rows at device x into y. */
static fm_status Kernel_pipe_launch(void *ctx, int slot, fm_devptr x, fm_devptr y, int64_t rows, fm_stream stream,
                                    fm_error *err) {
    (void)slot;
    return Kernel_launch_ptrs((PyObject *)ctx, x, y, (long long)rows, stream, x, x, 0, err);
}

/* x's rows through the kernel into y: one copy each way through this kernel's staging, or, where pipeline says so
 * (-1: x and y of fm_pipe_min_bytes or more), in pieces through the device's page-locked staging (host_pipe.c).
 * Called with the kernel lock held and the GIL released. */
static fm_status Kernel_run_locked(KernelObject *self, const void *x, void *y, int64_t rows, int poison, int pipeline,
                                   fm_error *err) {
    const fm_plan *p = &self->plan->plan;
    const size_t x_row = Kernel_x_bytes(p, 1), y_row = Kernel_y_row(p);
    if (pipeline < 0)
        pipeline = (size_t)rows * (x_row + y_row) >= fm_pipe_min_bytes();
    if (pipeline) {
        fm_status st = fm_gpu_activate(&self->gpu->gpu, err);
        if (st != FM_OK)
            return st;
        PyThread_acquire_lock(self->gpu->pipe_lock, WAIT_LOCK);
        st = fm_pipe_run(&self->gpu->pipe, &self->gpu->gpu, x, y, rows, x_row, y_row, poison, Kernel_pipe_launch,
                         self, err);
        PyThread_release_lock(self->gpu->pipe_lock);
        return st;
    }
    size_t y_bytes = 0;
    fm_status st = Kernel_stage(self, x, rows, &y_bytes, err);
    if (st == FM_OK && poison) /* 0xFF.. is NaN in float16 and float32: an unwritten element cannot pass */
        st = fm_memset_d8(self->y_buf, 0xFF, y_bytes, NULL, err);
    KernelArgs a;
    if (st == FM_OK) /* (a GEMM's two more operands, its concat part and residual, read the input buffer) */
        st = Kernel_args(self, &a, self->x_buf, self->y_buf, (long long)rows, self->x_buf, self->x_buf, err);
    if (st == FM_OK)
        st = fm_kernel_launch(&self->k, Kernel_grid(self, rows), NULL, a.params, 0, err);
    if (st == FM_OK)
        st = fm_memcpy_dtoh(y, self->y_buf, y_bytes, NULL, err);
    if (st == FM_OK)
        st = fm_stream_sync(NULL, err);
    return st;
}

/* Whether out (not NULL) is an array the kernel can write y of dims into: the output dtype, C-contiguous, aligned,
 * writable; raises ValueError naming what is wrong otherwise. */
static int Kernel_out_ok(PyObject *out, int out_type, const npy_intp dims[2]) {
    if (!PyArray_Check(out)) {
        PyErr_SetString(PyExc_ValueError, "out must be a NumPy array");
        return 0;
    }
    PyArrayObject *o = (PyArrayObject *)out;
    if (PyArray_TYPE(o) != out_type || PyArray_NDIM(o) != 2 || PyArray_DIM(o, 0) != dims[0] ||
        PyArray_DIM(o, 1) != dims[1] || !PyArray_IS_C_CONTIGUOUS(o) || !PyArray_ISALIGNED(o) ||
        !PyArray_ISWRITEABLE(o)) {
        PyErr_Format(PyExc_ValueError, "out must be a writable, aligned, C-contiguous (%zd, %zd) array of the kernel's "
                     "output dtype (NumPy type %d)", (Py_ssize_t)dims[0], (Py_ssize_t)dims[1], out_type);
        return 0;
    }
    return 1;
}

/* run(x, poison=False, out=None, pipeline=-1) -> y: x a C-contiguous array of the plan's input dtype with >= 1 row;
 * y written into out where given (Kernel_out_ok), so a caller's array takes the device's copy with no array in
 * between; pipeline: 1 in pieces, 0 in one copy each way, -1 by size (Kernel_run_locked). */
static PyObject *Kernel_run(KernelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"x", "poison", "out", "pipeline", NULL};
    PyObject *xobj, *outobj = Py_None;
    int poison = 0, pipeline = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|pOi", kwlist, &xobj, &poison, &outobj, &pipeline))
        return NULL;
    const fm_plan *p = &self->plan->plan;
    if (p->gemm) { /* its operands come from its network's other values: python/fusedmlp/_segments.py's Chain */
        PyErr_SetString(PyExc_ValueError, "run() takes a fused kernel; a GEMM layer's kernel runs inside its network's "
                                          "chain (launch() with its operands' device pointers)");
        return NULL;
    }
    int in_type = fm_npy_type(p->in_dtype), out_type = fm_npy_type(p->out_dtype);
    PyArrayObject *x = fm_array(xobj, in_type, 2, "x");
    if (x == NULL)
        return NULL;
    if (PyArray_DIM(x, 1) != p->x_features || PyArray_DIM(x, 0) < 1) {
        PyErr_Format(PyExc_ValueError, "x has shape (%zd, %zd); the kernel takes (rows >= 1, %d)",
                     (Py_ssize_t)PyArray_DIM(x, 0), (Py_ssize_t)PyArray_DIM(x, 1), p->x_features);
        Py_DECREF(x);
        return NULL;
    }
    npy_intp dims[2] = {PyArray_DIM(x, 0), p->n_real[p->num_layers - 1]};
    PyArrayObject *y;
    if (outobj != Py_None) {
        if (!Kernel_out_ok(outobj, out_type, dims)) {
            Py_DECREF(x);
            return NULL;
        }
        Py_INCREF(outobj);
        y = (PyArrayObject *)outobj;
    } else {
        y = (PyArrayObject *)PyArray_SimpleNew(2, dims, out_type);
    }
    if (y == NULL) {
        Py_DECREF(x);
        return NULL;
    }
    fm_error err = {0};
    fm_status st;
    Py_BEGIN_ALLOW_THREADS PyThread_acquire_lock(self->lock, WAIT_LOCK);
    st = Kernel_run_locked(self, PyArray_DATA(x), PyArray_DATA(y), dims[0], poison, pipeline, &err);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS Py_DECREF(x);
    if (st != FM_OK) {
        Py_DECREF(y);
        return fm_raise_clear(&err);
    }
    return (PyObject *)y;
}

/* Whether a launch of self may be a programmatic dependent one (fm_kernel_launch's after): its CUBIN is for sm_90+,
 * where the templates' fm_grid_wait is griddepcontrol.wait (an older arch's CUBIN has no wait, and a dependent launch
 * of it could read its input before the kernel writing it is done), and one CTA fits an SM. A kernel of several CTAs
 * an SM (a small batch's 64-row GEMM tiles, the row passes) launches plainly: launched while the kernel before it
 * ran, its CTAs were placed where that kernel's left room, not one an SM, and rec1024's chain at 1024 rows took 37.3
 * us against 29.2 (H100, bench/results/h100-gemm-small/pdl_steps_late.txt); with only one-CTA kernels dependent it
 * took 28.5, and 44.4 against 46.4 at 4096 rows (pdl_steps_rule.txt). */
static int Kernel_after(const KernelObject *self, int after) {
    return after && self->plan->plan.arch >= 90 && self->k.blocks_per_sm <= 1;
}

/* launch(x_ptr, y_ptr, rows, stream=0, x1_ptr=0, res_ptr=0, after=False): device pointers (16-byte aligned,
 * C-contiguous), asynchronous; x1 and res are a GEMM plan's concat part and residual operand (unused by the fused
 * kernels); after: the launch before it on the stream is a kernel of the same chain (a dependent launch, sm_90+). */
static PyObject *Kernel_launch(KernelObject *self, PyObject *args) {
    unsigned long long xp, yp, stream = 0, x1p = 0, resp = 0;
    long long rows;
    int after = 0;
    if (!PyArg_ParseTuple(args, "KKL|KKKp", &xp, &yp, &rows, &stream, &x1p, &resp, &after))
        return NULL;
    const fm_plan *p = &self->plan->plan;
    if (p->gemm && ((p->a1_dtype >= 0 && (x1p == 0 || x1p % 16)) || (p->res_dtype >= 0 && (resp == 0 || resp % 16)))) {
        PyErr_Format(PyExc_ValueError, "this GEMM reads %s%s%s: pass them as 16-byte aligned device pointers",
                     p->a1_dtype >= 0 ? "a concat part (x1_ptr)" : "", p->a1_dtype >= 0 && p->res_dtype >= 0 ? " and " : "",
                     p->res_dtype >= 0 ? "a residual operand (res_ptr)" : "");
        return NULL;
    }
    if (rows < 1 || (xp % 16) != 0 || (yp % 16) != 0) {
        PyErr_Format(PyExc_ValueError, "launch needs rows >= 1 (got %lld) and 16-byte aligned pointers", rows);
        return NULL;
    }
    fm_error err = {0};
    fm_status st;
    KernelArgs a;
    Py_BEGIN_ALLOW_THREADS st = fm_gpu_activate(&self->gpu->gpu, &err);
    if (st == FM_OK)
        st = Kernel_args(self, &a, xp, yp, rows, x1p, resp, &err);
    if (st == FM_OK)
        st = fm_kernel_launch(&self->k, Kernel_grid(self, rows), (fm_stream)(uintptr_t)stream, a.params,
                              Kernel_after(self, after), &err);
    Py_END_ALLOW_THREADS if (st != FM_OK) return fm_raise_clear(&err);
    Py_RETURN_NONE;
}

int Kernel_is_gemm(PyObject *kernel) { return ((KernelObject *)kernel)->plan->plan.gemm != 0; }

/* The fast path's launch (module_fast.c): x, y (and a GEMM's x1 and res) are checked device pointers, rows >= 1;
 * the GIL stays held. */
fm_status Kernel_launch_ptrs(PyObject *kernel, fm_devptr x, fm_devptr y, long long rows, fm_stream stream, fm_devptr x1,
                             fm_devptr res, int after, fm_error *err) {
    KernelObject *self = (KernelObject *)kernel;
    fm_status st = fm_gpu_activate(&self->gpu->gpu, err);
    if (st != FM_OK)
        return st;
    KernelArgs a;
    st = Kernel_args(self, &a, x, y, rows, x1, res, err);
    return st != FM_OK ? st : fm_kernel_launch(&self->k, Kernel_grid(self, rows), stream, a.params,
                                               Kernel_after(self, after), err);
}

fm_status Kernel_set_node(PyObject *kernel, fm_graph_exec exec, void *node, fm_devptr x, fm_devptr y, long long rows,
                          fm_devptr x1, fm_devptr res, fm_error *err) {
    KernelObject *self = (KernelObject *)kernel;
    fm_status st = fm_gpu_activate(&self->gpu->gpu, err);
    if (st != FM_OK)
        return st;
    KernelArgs a;
    st = Kernel_args(self, &a, x, y, rows, x1, res, err);
    return st != FM_OK ? st : fm_graph_set_kernel(exec, node, &self->k, Kernel_grid(self, rows), a.params, err);
}

/* Fills the staging input with N(0,1)-like values (a sum of uniforms; timing must not run on zeros): the first 2^20
 * drawn, the rest copies of them. Drawing every value took seconds for a tuning batch of 2^21 rows of 64 features
 * (H100 host: 6.6 s for a first call at 2^21 rows of a network with 64 inputs, two candidates). */
static void Kernel_fill_random(void *x, size_t count, fm_dtype dtype) {
    const size_t drawn = count < ((size_t)1 << 20) ? count : ((size_t)1 << 20), size = fm_dtype_size(dtype);
    uint32_t state = 0x9e3779b9u;
    for (size_t i = 0; i < drawn; ++i) {
        float v = -2.0f;
        for (int j = 0; j < 4; ++j) {
            state = state * 1664525u + 1013904223u;
            v += (float)(state >> 8) * (1.0f / 16777216.0f);
        }
        v *= 1.7320508f; /* variance of a sum of 4 uniforms is 1/3 */
        if (dtype == FM_F32)
            ((float *)x)[i] = v;
        else
            ((uint16_t *)x)[i] = (uint16_t)fm_round_bits(v, dtype == FM_F16 ? FM_PREC_F16 : FM_PREC_BF16);
    }
    for (size_t at = drawn; at < count; at += drawn) {
        size_t n = count - at < drawn ? count - at : drawn;
        memcpy((char *)x + at * size, x, n * size);
    }
}

static fm_status Kernel_time_locked(KernelObject *self, int64_t rows, int reps, float *best_ms, fm_error *err) {
    const fm_plan *p = &self->plan->plan;
    size_t x_bytes = Kernel_x_bytes(p, rows), x_count = x_bytes / fm_dtype_size(p->in_dtype), y_bytes = 0;
    void *host = malloc(x_bytes ? x_bytes : 1);
    if (host == NULL)
        return fm_fail(err, FM_ERR_NOMEM, "out of host memory for a %zu-value tuning input", x_count);
    Kernel_fill_random(host, x_count, p->in_dtype);
    fm_status st = Kernel_stage(self, host, rows, &y_bytes, err);
    if (st == FM_OK) /* the copy reads host asynchronously: finish it before host can be freed on any path */
        st = fm_stream_sync(NULL, err);
    /* (a GEMM's two more operands, its concat part and residual, read the input buffer) */
    KernelArgs a;
    if (st == FM_OK)
        st = Kernel_args(self, &a, self->x_buf, self->y_buf, (long long)rows, self->x_buf, self->x_buf, err);
    void **params = a.params;
    /* Enough launches per measurement to cover ~1 ms, so event resolution and launch gaps do not decide. */
    float once = 0.0f, ms = 0.0f;
    if (st == FM_OK)
        st = fm_kernel_time(&self->k, Kernel_grid(self, rows), NULL, params, 3, &once, err);
    int launches = once > 0.0f ? (int)(1.0f / once) + 1 : 1;
    launches = launches > 1000 ? 1000 : launches;
    *best_ms = 0.0f;
    for (int r = 0; r < reps && st == FM_OK; ++r) {
        st = fm_kernel_time(&self->k, Kernel_grid(self, rows), NULL, params, launches, &ms, err);
        if (st == FM_OK && (r == 0 || ms < *best_ms))
            *best_ms = ms;
    }
    free(host);
    /* The staging goes: the tuner times up to 2^21 rows (_tune.TUNE_MAX_ROWS; a GEMM's input buffer is float32 of its
     * widest operand, 8 GB at 1024 features), and the winner kept them for the life of the model while its large
     * calls run through the device's pieces (host_pipe.c). A later small run() makes them again. */
    fm_mem_free(self->x_buf);
    fm_mem_free(self->y_buf);
    self->x_buf = self->y_buf = 0;
    self->x_cap = self->y_cap = 0;
    return st;
}

/* time(rows, reps=5) -> ms: the kernel's time per launch on `rows` random rows (best of reps), for the tuner. */
static PyObject *Kernel_time(KernelObject *self, PyObject *args) {
    long long rows;
    int reps = 5;
    if (!PyArg_ParseTuple(args, "L|i", &rows, &reps))
        return NULL;
    if (rows < 1 || reps < 1) {
        PyErr_Format(PyExc_ValueError, "time needs rows >= 1 and reps >= 1 (got %lld, %d)", rows, reps);
        return NULL;
    }
    fm_error err = {0};
    fm_status st;
    float ms = 0.0f;
    Py_BEGIN_ALLOW_THREADS PyThread_acquire_lock(self->lock, WAIT_LOCK);
    st = Kernel_time_locked(self, rows, reps, &ms, &err);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS if (st != FM_OK) return fm_raise_clear(&err);
    return PyFloat_FromDouble((double)ms);
}

static PyObject *Kernel_get_info(KernelObject *self, void *closure) {
    (void)closure;
    return Py_BuildValue("{s:i,s:i,s:n,s:i,s:i,s:i}", "blocks_per_sm", self->k.blocks_per_sm, "max_clusters",
                         self->k.max_clusters, "smem_bytes", (Py_ssize_t)self->k.smem_bytes, "threads",
                         self->k.threads, "regs", self->k.regs, "local_bytes", self->k.local_bytes);
}

static PyMethodDef Kernel_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Kernel_run, METH_VARARGS | METH_KEYWORDS,
     "run(x, poison=False, out=None, pipeline=-1) -> y: copy x in, launch, copy y out (synchronous); into out where "
     "given; pipeline 1/0/-1: in pieces through page-locked staging / one copy each way / by size."},
    {"launch", (PyCFunction)Kernel_launch, METH_VARARGS,
     "launch(x_ptr, y_ptr, rows, stream=0, x1_ptr=0, res_ptr=0): asynchronous."},
    {"time", (PyCFunction)Kernel_time, METH_VARARGS, "time(rows, reps=5) -> ms per launch on random rows (best)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Kernel_getset[] = {
    {"info", (getter)Kernel_get_info, NULL,
     "dict: blocks_per_sm, max_clusters (0: not a cluster kernel), smem_bytes, threads, regs (per thread), "
     "local_bytes (per thread: spills and call frames)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject KernelType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fusedmlp._core.Kernel",
    .tp_basicsize = sizeof(KernelObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A loaded fused-MLP kernel with its weights on the device (made by Plan.load).",
    .tp_dealloc = (destructor)Kernel_dealloc,
    .tp_methods = Kernel_methods,
    .tp_getset = Kernel_getset,
};
