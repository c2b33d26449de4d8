/* module_fast.c - FastPath: a model's steady-state call on a CUDA tensor, in one call into C.
 *
 * A small batch's call is host time: at 1024 rows on the H100 the kernels take 4-10 us, and FusedMLP.__call__ in
 * Python took 16-21 us around them (attribute reads, dict lookups, torch.empty through Python; docs/performance.md,
 * "Small batches"). FastPath does the whole steady-state call here: it reads x (and out) through one DLPack export
 * (torch._C._to_dlpack: 0.26 us for pointer, shape, strides, dtype and device on that machine, against 0.08-0.16 us per
 * attribute), finds the loaded kernel for the batch in a table keyed as FusedMLP._kernel keys its calls, allocates the
 * output through torch.empty (torch's caching allocator, one vectorcall), and launches on torch's current stream.
 *
 * Python stays the authority: a call FastPath cannot take as it is (a CPU tensor, a view, a dtype or batch size not
 * yet in its table, autograd tracking x, an out it cannot write in place, the model's check=True) returns
 * NotImplemented, and FusedMLP.__call__ takes its checked path, which raises the precise error or builds the kernel
 * and adds it here (python/fusedmlp/_dlpack.py). So no check is dropped: each one either passes here or sends the
 * call to the path that explains it. */
#include "module_internal.h"

#include <stdlib.h>
#include <string.h>

/* The DLPack ABI (dmlc/dlpack, unversioned capsules named "dltensor", which torch._C._to_dlpack returns): the fields
 * this file reads, laid out as the ABI fixes them. */
typedef struct {
    int32_t device_type; /* kDLCUDA = 2 */
    int32_t device_id;
} fm_dl_device;
typedef struct {
    uint8_t code; /* kDLFloat = 2, kDLBfloat = 4 */
    uint8_t bits;
    uint16_t lanes;
} fm_dl_dtype;
typedef struct {
    void *data;
    fm_dl_device device;
    int32_t ndim;
    fm_dl_dtype dtype;
    int64_t *shape;
    int64_t *strides; /* NULL: C-contiguous */
    uint64_t byte_offset;
} fm_dl_tensor;
typedef struct fm_dl_managed {
    fm_dl_tensor t;
    void *manager_ctx;
    void (*deleter)(struct fm_dl_managed *);
} fm_dl_managed;

enum { FAST_MAX_DIMS = 8, FAST_MAX_ENTRIES = 64, FAST_KINDS = 3 }; /* kinds: 0 float32, 1 float16, 2 bfloat16 */

typedef struct {
    int in, out;       /* kinds */
    long long bucket;  /* _tune.bucket(rows) */
    int size_class;    /* _tune.size_class(rows, sm_count) */
    char *autotune;    /* FUSEDMLP_AUTOTUNE when the entry was made (NULL: unset); part of FusedMLP._kernel's key */
    PyObject *kernel;  /* a fusedmlp._core.Kernel (fused plans only: a chain of segments stays in Python) */
} FastEntry;

typedef struct {
    PyObject_HEAD int n_in, n_out, ordinal, sm_count;
    FastEntry entries[FAST_MAX_ENTRIES];
    int n_entries;
    /* torch's pieces, given once by set_torch: none is looked up per call */
    PyObject *tensor_type, *to_dlpack, *raw_stream, *empty, *bump, *device, *ordinal_obj, *kwnames;
    PyObject *dtypes[FAST_KINDS];
    long long calls, misses; /* how often the fast path answered, and how often it sent the call back */
} FastObject;

static long long fast_bucket(long long rows) {
    long long b = 1;
    while (b < rows)
        b *= 4;
    return b;
}

static int fast_size_class(long long rows, int sm_count) {
    long long sm = sm_count > 0 ? sm_count : 1;
    return (rows >= 16 * sm) + (rows >= 64 * sm) + (rows >= 128 * sm);
}

static int fast_same_env(const char *a, const char *b) {
    return (a == NULL || b == NULL) ? a == b : strcmp(a, b) == 0;
}

static void Fast_clear_entries(FastObject *self) {
    for (int i = 0; i < self->n_entries; ++i) {
        free(self->entries[i].autotune);
        Py_CLEAR(self->entries[i].kernel);
    }
    self->n_entries = 0;
}

static int Fast_traverse(FastObject *self, visitproc visit, void *arg) {
    for (int i = 0; i < self->n_entries; ++i)
        Py_VISIT(self->entries[i].kernel);
    Py_VISIT(self->tensor_type);
    Py_VISIT(self->to_dlpack);
    Py_VISIT(self->raw_stream);
    Py_VISIT(self->empty);
    Py_VISIT(self->bump);
    Py_VISIT(self->device);
    for (int i = 0; i < FAST_KINDS; ++i)
        Py_VISIT(self->dtypes[i]);
    return 0;
}

static int Fast_clear(FastObject *self) {
    Fast_clear_entries(self);
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->to_dlpack);
    Py_CLEAR(self->raw_stream);
    Py_CLEAR(self->empty);
    Py_CLEAR(self->bump);
    Py_CLEAR(self->device);
    Py_CLEAR(self->ordinal_obj);
    Py_CLEAR(self->kwnames);
    for (int i = 0; i < FAST_KINDS; ++i)
        Py_CLEAR(self->dtypes[i]);
    return 0;
}

static void Fast_dealloc(FastObject *self) {
    PyObject_GC_UnTrack(self);
    Fast_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* FastPath(n_in, n_out, ordinal) */
static PyObject *Fast_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"n_in", "n_out", "ordinal", NULL};
    int n_in, n_out, ordinal;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iii", kwlist, &n_in, &n_out, &ordinal))
        return NULL;
    if (n_in < 1 || n_out < 1 || ordinal < 0) {
        PyErr_Format(PyExc_ValueError, "FastPath(n_in=%d, n_out=%d, ordinal=%d): each must be >= 1 (ordinal >= 0)",
                     n_in, n_out, ordinal);
        return NULL;
    }
    FastObject *self = (FastObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->n_in = n_in;
    self->n_out = n_out;
    self->ordinal = ordinal;
    return (PyObject *)self;
}

/* set_torch(tensor_type, to_dlpack, raw_stream, empty, bump, (float32, float16, bfloat16), device) */
static PyObject *Fast_set_torch(FastObject *self, PyObject *args) {
    PyObject *tensor_type, *to_dlpack, *raw_stream, *empty, *bump, *dtypes, *device;
    if (!PyArg_ParseTuple(args, "OOOOOO!O", &tensor_type, &to_dlpack, &raw_stream, &empty, &bump, &PyTuple_Type,
                          &dtypes, &device))
        return NULL;
    if (PyTuple_GET_SIZE(dtypes) != FAST_KINDS) {
        PyErr_SetString(PyExc_ValueError, "set_torch: dtypes must be (float32, float16, bfloat16)");
        return NULL;
    }
    PyObject *ordinal_obj = PyLong_FromLong(self->ordinal);
    PyObject *kwnames = Py_BuildValue("(ss)", "dtype", "device");
    if (ordinal_obj == NULL || kwnames == NULL) {
        Py_XDECREF(ordinal_obj);
        Py_XDECREF(kwnames);
        return NULL;
    }
    Fast_clear(self);
    PyObject **slots[] = {&self->tensor_type, &self->to_dlpack, &self->raw_stream, &self->empty, &self->bump,
                          &self->device};
    PyObject *values[] = {tensor_type, to_dlpack, raw_stream, empty, bump, device};
    for (size_t i = 0; i < sizeof slots / sizeof *slots; ++i) {
        Py_INCREF(values[i]);
        *slots[i] = values[i];
    }
    for (int i = 0; i < FAST_KINDS; ++i) {
        self->dtypes[i] = PyTuple_GET_ITEM(dtypes, i);
        Py_INCREF(self->dtypes[i]);
    }
    self->ordinal_obj = ordinal_obj;
    self->kwnames = kwnames;
    Py_RETURN_NONE;
}

/* add(in_kind, out_kind, rows, sm_count, kernel): the kernel FusedMLP._kernel gave for a call of `rows` rows (kinds: 0
 * float32, 1 float16, 2 bfloat16) answers every later call in the same batch bucket and size class. */
static PyObject *Fast_add(FastObject *self, PyObject *args) {
    int in, out, sm_count;
    long long rows;
    PyObject *kernel;
    if (!PyArg_ParseTuple(args, "iiLiO!", &in, &out, &rows, &sm_count, &KernelType, &kernel))
        return NULL;
    if (in < 0 || in >= FAST_KINDS || out < 0 || out >= FAST_KINDS || rows < 1 || sm_count < 1) {
        PyErr_Format(PyExc_ValueError, "add(%d, %d, %lld, %d, kernel): kinds are 0-2, rows and sm_count >= 1", in, out,
                     rows, sm_count);
        return NULL;
    }
    if (Kernel_is_gemm(kernel)) {
        PyErr_SetString(PyExc_ValueError, "add: a GEMM layer's kernel runs inside its network's chain, not alone");
        return NULL;
    }
    const char *env = getenv("FUSEDMLP_AUTOTUNE");
    long long bucket = fast_bucket(rows);
    int size_class = fast_size_class(rows, sm_count);
    if (self->n_entries == FAST_MAX_ENTRIES)
        Fast_clear_entries(self); /* more shapes than the table holds: start over (a miss only costs the slow path) */
    self->sm_count = sm_count;
    for (int i = 0; i < self->n_entries; ++i) {
        FastEntry *e = &self->entries[i];
        if (e->in == in && e->out == out && e->bucket == bucket && e->size_class == size_class &&
            fast_same_env(e->autotune, env)) {
            Py_INCREF(kernel);
            Py_SETREF(e->kernel, kernel);
            Py_RETURN_NONE;
        }
    }
    char *copy = NULL;
    if (env != NULL && (copy = strdup(env)) == NULL)
        return PyErr_NoMemory();
    FastEntry *e = &self->entries[self->n_entries++];
    *e = (FastEntry){in, out, bucket, size_class, copy, kernel};
    Py_INCREF(kernel);
    Py_RETURN_NONE;
}

static PyObject *Fast_clear_method(FastObject *self, PyObject *noargs) {
    (void)noargs;
    Fast_clear_entries(self);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------------ the call */

typedef struct {
    PyObject *capsule; /* owns the export: its destructor calls the deleter */
    const fm_dl_tensor *t;
    fm_devptr ptr;
    int kind;
    long long numel;
} FastArray;

static int fast_kind(fm_dl_dtype d) {
    if (d.lanes != 1)
        return -1;
    if (d.code == 2 && d.bits == 32)
        return 0;
    if (d.code == 2 && d.bits == 16)
        return 1;
    if (d.code == 4 && d.bits == 16)
        return 2;
    return -1;
}

/* Exports t (a torch.Tensor, exactly) through DLPack and checks what the kernel needs of it: on the model's GPU, not
 * tracked by autograd, float32/float16/bfloat16, C-contiguous (size-1 dimensions aside, as torch counts it), 16-byte
 * aligned, at most FAST_MAX_DIMS dimensions. Returns 1 when it qualifies (a->capsule then owned by the caller), 0 when
 * not (no exception set; the checked path will say why if it is an error), -1 on an exception. */
static int Fast_export(FastObject *self, PyObject *t, FastArray *a) {
    a->capsule = NULL;
    if (Py_TYPE(t) != (PyTypeObject *)self->tensor_type)
        return 0;
    PyObject *rg = PyObject_GetAttrString(t, "requires_grad");
    if (rg == NULL)
        return -1;
    int tracked = rg == Py_True;
    Py_DECREF(rg);
    if (tracked)
        return 0;
    PyObject *capsule = PyObject_CallOneArg(self->to_dlpack, t);
    if (capsule == NULL) { /* e.g. a conjugate view: the checked path deals with it */
        PyErr_Clear();
        return 0;
    }
    const fm_dl_managed *m = PyCapsule_GetPointer(capsule, "dltensor");
    if (m == NULL) {
        Py_DECREF(capsule);
        PyErr_Clear();
        return 0;
    }
    const fm_dl_tensor *d = &m->t;
    int ok = d->device.device_type == 2 && d->device.device_id == self->ordinal && d->ndim >= 1 &&
             d->ndim <= FAST_MAX_DIMS && (a->kind = fast_kind(d->dtype)) >= 0;
    long long numel = 1;
    for (int i = d->ndim - 1; ok && i >= 0; --i) {
        if (d->strides != NULL && d->shape[i] != 1 && d->strides[i] != numel)
            ok = 0;
        numel *= d->shape[i];
    }
    a->ptr = (fm_devptr)(uintptr_t)d->data + d->byte_offset;
    if (!ok || numel < 1 || a->ptr % 16) {
        Py_DECREF(capsule);
        return 0;
    }
    a->capsule = capsule;
    a->t = d;
    a->numel = numel;
    return 1;
}

/* The kind of a torch dtype object given as out_dtype: -1 for None, -2 for anything else (the checked path). */
static int Fast_dtype_kind(FastObject *self, PyObject *dtype) {
    if (dtype == Py_None)
        return -1;
    for (int i = 0; i < FAST_KINDS; ++i)
        if (dtype == self->dtypes[i])
            return i;
    return -2;
}

static FastEntry *Fast_find(FastObject *self, int in, int out, long long rows) {
    long long bucket = fast_bucket(rows);
    int size_class = fast_size_class(rows, self->sm_count);
    const char *env = getenv("FUSEDMLP_AUTOTUNE");
    for (int i = 0; i < self->n_entries; ++i) {
        FastEntry *e = &self->entries[i];
        if (e->bucket == bucket && e->in == in && e->out == out && e->size_class == size_class &&
            fast_same_env(e->autotune, env))
            return e;
    }
    return NULL;
}

/* torch.empty((*x.shape[:-1], n_out), dtype=..., device=...) through one vectorcall. */
static PyObject *Fast_empty(FastObject *self, const fm_dl_tensor *x, int kind) {
    PyObject *argv[FAST_MAX_DIMS + 2];
    int n = x->ndim;
    for (int i = 0; i < n; ++i) {
        argv[i] = PyLong_FromLongLong(i == n - 1 ? self->n_out : x->shape[i]);
        if (argv[i] == NULL) {
            while (i-- > 0)
                Py_DECREF(argv[i]);
            return NULL;
        }
    }
    argv[n] = self->dtypes[kind];
    argv[n + 1] = self->device;
    PyObject *y = PyObject_Vectorcall(self->empty, argv, (size_t)n, self->kwnames);
    for (int i = 0; i < n; ++i)
        Py_DECREF(argv[i]);
    return y;
}

/* out qualifies for the kernel's writes: x's leading shape with n_out last, out_kind (or any kind when -1), and no
 * byte shared with x. */
static int Fast_out_fits(FastObject *self, const FastArray *x, const FastArray *o, int out_kind) {
    const fm_dl_tensor *a = x->t, *b = o->t;
    if (b->ndim != a->ndim || b->shape[b->ndim - 1] != self->n_out || (out_kind >= 0 && o->kind != out_kind))
        return 0;
    for (int i = 0; i < a->ndim - 1; ++i)
        if (a->shape[i] != b->shape[i])
            return 0;
    fm_devptr x_end = x->ptr + (fm_devptr)x->numel * (x->kind ? 2 : 4);
    fm_devptr o_end = o->ptr + (fm_devptr)o->numel * (o->kind ? 2 : 4);
    return o_end <= x->ptr || x_end <= o->ptr;
}

/* fp(x, out_dtype, out) -> y, or NotImplemented when the checked path must take the call. */
static PyObject *Fast_call(FastObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "FastPath.call takes (x, out_dtype, out)");
        return NULL;
    }
    PyObject *xobj = args[0], *out_dtype = args[1], *outobj = args[2], *y = NULL;
    if (self->n_entries == 0 || self->tensor_type == NULL)
        goto miss;
    int want = Fast_dtype_kind(self, out_dtype);
    if (want == -2)
        goto miss;
    FastArray x, o = {0};
    int r = Fast_export(self, xobj, &x);
    if (r <= 0) {
        if (r < 0)
            return NULL;
        goto miss;
    }
    const fm_dl_tensor *xt = x.t;
    long long rows = x.numel / self->n_in;
    if (xt->shape[xt->ndim - 1] != self->n_in)
        goto miss_x;
    int out_kind = want >= 0 ? want : x.kind;
    if (outobj != Py_None) {
        if ((r = Fast_export(self, outobj, &o)) <= 0) {
            Py_DECREF(x.capsule);
            if (r < 0)
                return NULL;
            goto miss;
        }
        if (!Fast_out_fits(self, &x, &o, want))
            goto miss_xo;
        out_kind = o.kind;
    }
    FastEntry *e = Fast_find(self, x.kind, out_kind, rows);
    if (e == NULL)
        goto miss_xo;
    if (outobj == Py_None) {
        if ((y = Fast_empty(self, xt, out_kind)) == NULL)
            goto fail;
        FastArray ya;
        if ((r = Fast_export(self, y, &ya)) <= 0) { /* torch.empty gave what we asked for: only an error lands here */
            if (r == 0)
                PyErr_SetString(PyExc_RuntimeError, "FastPath: torch.empty returned a tensor the kernel cannot write");
            goto fail;
        }
        o = ya;
    } else {
        if (self->bump != Py_None) { /* out's version counter, as torch's own out= ops bump it (_dlpack.py) */
            PyObject *bumped = PyObject_CallOneArg(self->bump, outobj);
            if (bumped == NULL)
                goto fail;
            Py_DECREF(bumped);
        }
        y = outobj;
        Py_INCREF(y);
    }
    PyObject *s = PyObject_CallOneArg(self->raw_stream, self->ordinal_obj);
    if (s == NULL)
        goto fail;
    fm_stream stream = (fm_stream)(uintptr_t)PyLong_AsUnsignedLongLong(s);
    Py_DECREF(s);
    if (PyErr_Occurred())
        goto fail;
    /* The launch keeps the GIL: cuLaunchKernel only queues (3.3 us on the H100 machine), and a release and re-take
     * around it would cost more than it frees and can wait on another thread's switch interval. */
    fm_error err = {0};
    if (Kernel_launch_ptrs(e->kernel, x.ptr, o.ptr, rows, stream, &err) != FM_OK) {
        fm_raise_clear(&err);
        goto fail;
    }
    Py_DECREF(x.capsule);
    Py_XDECREF(o.capsule);
    self->calls++;
    return y;
fail:
    Py_DECREF(x.capsule);
    Py_XDECREF(o.capsule);
    Py_XDECREF(y);
    return NULL;
miss_xo:
    Py_XDECREF(o.capsule);
miss_x:
    Py_DECREF(x.capsule);
miss:
    self->misses++;
    Py_RETURN_NOTIMPLEMENTED;
}

static PyObject *Fast_get_stats(FastObject *self, void *closure) {
    (void)closure;
    return Py_BuildValue("{s:L,s:L,s:i}", "calls", self->calls, "misses", self->misses, "entries", self->n_entries);
}

static PyMethodDef Fast_methods[] = {
    {"call", (PyCFunction)(void (*)(void))Fast_call, METH_FASTCALL,
     "call(x, out_dtype, out) -> y, or NotImplemented when the checked Python path must take the call."},
    {"add", (PyCFunction)Fast_add, METH_VARARGS,
     "add(in_kind, out_kind, rows, sm_count, kernel): kinds 0 float32, 1 float16, 2 bfloat16."},
    {"set_torch", (PyCFunction)Fast_set_torch, METH_VARARGS,
     "set_torch(Tensor, _to_dlpack, raw_stream, empty, bump, (float32, float16, bfloat16), device)."},
    {"clear", (PyCFunction)Fast_clear_method, METH_NOARGS, "clear(): forget every kernel (the next calls re-add)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Fast_getset[] = {
    {"stats", (getter)Fast_get_stats, NULL, "dict: calls answered, misses (sent to the checked path), entries", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject FastPathType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fusedmlp._core.FastPath",
    .tp_basicsize = sizeof(FastObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A model's steady-state CUDA-tensor call in C (python/fusedmlp/_dlpack.py fills its table).",
    .tp_new = Fast_new,
    .tp_dealloc = (destructor)Fast_dealloc,
    .tp_traverse = (traverseproc)Fast_traverse,
    .tp_clear = (inquiry)Fast_clear,
    .tp_methods = Fast_methods,
    .tp_getset = Fast_getset,
};
