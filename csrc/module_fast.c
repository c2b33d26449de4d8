/* module_fast.c - FastPath: a model's steady-state call on a CUDA tensor, in one call into C.
 *
 * A small batch's call is host time: at 1024 rows on the H100 the kernels take 4-10 us, and FusedMLP.__call__ in
 * Python took 16-21 us around them (attribute reads, dict lookups, torch.empty through Python; docs/performance.md,
 * "Small batches"). FastPath does the whole steady-state call here: it reads x (and out) through one DLPack export
 * (torch._C._to_dlpack: 0.26 us for pointer, shape, strides, dtype and device on that machine, against 0.08-0.16 us per
 * attribute; CuPy's toDlpack), finds the loaded kernel for the batch in a table keyed as FusedMLP._kernel keys its
 * calls, allocates the output through the library's own empty (torch's caching allocator, CuPy's pool: one
 * vectorcall), and launches on the library's current stream.
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
/* DLPack 1.0's versioned form ("dltensor_versioned" capsules): the tensor comes last. */
typedef struct fm_dl_managed_versioned {
    uint32_t major, minor;
    void *manager_ctx;
    void (*deleter)(struct fm_dl_managed_versioned *);
    uint64_t flags;
    fm_dl_tensor t;
} fm_dl_managed_versioned;

/* The tensor a capsule holds, unversioned or versioned; NULL (no exception) when it is neither or already used. */
static const fm_dl_tensor *fast_capsule_tensor(PyObject *capsule) {
    const char *name = PyCapsule_GetName(capsule);
    if (name == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (strcmp(name, "dltensor") == 0) {
        const fm_dl_managed *m = PyCapsule_GetPointer(capsule, name);
        return m != NULL ? &m->t : NULL;
    }
    if (strcmp(name, "dltensor_versioned") == 0) {
        const fm_dl_managed_versioned *m = PyCapsule_GetPointer(capsule, name);
        return m != NULL && m->major == 1 ? &m->t : NULL;
    }
    return NULL;
}

enum { FAST_MAX_DIMS = 8, FAST_MAX_ENTRIES = 64, FAST_KINDS = 3, FAST_LIBS = 2 }; /* kinds: 0 f32, 1 f16, 2 bf16 */

/* A chain's launches for calls of `rows` rows, captured once and replayed as one graph launch (Fast_chain_graph). */
typedef struct {
    long long rows;
    fm_devptr x, y;          /* the addresses its nodes now take */
    fm_graph_exec exec;      /* NULL: an empty slot */
    void *graph;             /* the captured graph exec came from (its nodes are the handles node[] holds) */
    void **node;             /* per step, its kernel node where it reads x or writes y (their arguments change), else
                              * NULL */
    unsigned long long used; /* the chain's tick when last launched (the least recent slot is replaced) */
} FastGraph;

/* Batch sizes a chain keeps graphs for, and the largest batch that runs through them: below it a chain's launches
 * cost more than its kernels (docs/performance.md, "Segmented networks at small batches"). */
enum { FAST_GRAPHS = 8, FAST_GRAPH_MAX_ROWS = 1 << 16 };

typedef struct {
    int n;
    FastStep *steps;
    PyObject *owner;  /* the Chain: holds the workspace (never freed while it lives) */
    PyObject *lock;   /* its launch lock: two threads' sequences must not interleave on one stream */
    fm_stream stream; /* the stream the workspace belongs to: a call on another stream takes the checked path */
    fm_devptr base;   /* the workspace */
    long long cap;    /* its rows */
    int graphs;       /* replay small calls from graphs (add_chain's graphs, _env.chain_graphs; off after failures) */
    FastGraph graph[FAST_GRAPHS];
    fm_stream capture; /* the stream the launches are captured on (made at the first capture) */
    unsigned long long tick;
    long long graph_hits, graph_misses;
    char graph_error[1024]; /* why graphs went off (a capture or an update failed), or empty */
} FastChain;

typedef struct {
    int in, out;       /* kinds */
    long long bucket;  /* _tune.bucket(rows) */
    int size_class;    /* _tune.size_class(rows, sm_count) */
    char *autotune;    /* FUSEDMLP_AUTOTUNE when the entry was made (NULL: unset); part of FusedMLP._kernel's key */
    PyObject *kernel;  /* a fusedmlp._core.Kernel; NULL for a chain */
    FastChain *chain;  /* a segmented network's launches; NULL for one kernel */
} FastEntry;

/* An array library's pieces (torch, CuPy), given once by set_library: none is looked up per call. */
typedef struct {
    PyObject *type;      /* its array type, matched exactly (subclasses take the checked path) */
    PyObject *export;    /* export(x) -> "dltensor" capsule: torch._C._to_dlpack, cupy.ndarray.toDlpack */
    PyObject *stream;    /* stream(*stream_arg) -> the current stream: an int, or an object with .ptr (CuPy's) */
    PyObject *stream_arg; /* torch: the ordinal; NULL: called without arguments */
    PyObject *empty;     /* empty(*shape, **extra) (torch) or empty(shape, **extra) (CuPy, shape_tuple) */
    int shape_tuple;
    PyObject *extra;     /* a tuple of (name, value) pairs after dtype: torch's device */
    PyObject *kwnames;   /* ("dtype", *names of extra) */
    PyObject *bump;      /* bump(out) after writing into out (torch's version counter), or None */
    int check_grad;      /* refuse arrays whose requires_grad is True (torch) */
    PyObject *dtypes[FAST_KINDS]; /* the library's dtype objects by kind (None where it has none) */
} FastLib;

typedef struct {
    PyObject_HEAD int n_in, n_out, ordinal, sm_count;
    FastEntry entries[FAST_MAX_ENTRIES];
    int n_entries;
    FastLib libs[FAST_LIBS];
    long long calls, misses; /* how often the fast path answered, and how often it sent the call back */
} FastObject;

/* Attribute and method names the call reads, interned once (FastPath's constructor) instead of made per call. */
static PyObject *s_requires_grad, *s_acquire, *s_release;

static int fast_intern_names(void) {
    if (s_requires_grad == NULL)
        s_requires_grad = PyUnicode_InternFromString("requires_grad");
    if (s_acquire == NULL)
        s_acquire = PyUnicode_InternFromString("acquire");
    if (s_release == NULL)
        s_release = PyUnicode_InternFromString("release");
    return s_requires_grad != NULL && s_acquire != NULL && s_release != NULL ? 0 : -1;
}

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

static void Fast_free_chain(FastChain *c) {
    if (c == NULL)
        return;
    for (int i = 0; i < FAST_GRAPHS; ++i) {
        fm_graph_free(c->graph[i].exec, c->graph[i].graph);
        free(c->graph[i].node);
    }
    fm_stream_destroy(c->capture);
    for (int i = 0; i < c->n; ++i)
        Py_XDECREF(c->steps[i].kernel);
    free(c->steps);
    Py_XDECREF(c->owner);
    Py_XDECREF(c->lock);
    free(c);
}

static void Fast_clear_entries(FastObject *self) {
    for (int i = 0; i < self->n_entries; ++i) {
        free(self->entries[i].autotune);
        Py_CLEAR(self->entries[i].kernel);
        Fast_free_chain(self->entries[i].chain);
        self->entries[i].chain = NULL;
    }
    self->n_entries = 0;
}

/* The library's references, for traverse and clear alike. */
#define FAST_LIB_REFS(lib)                                                                                            \
    PyObject **refs[] = {&(lib)->type,  &(lib)->export,  &(lib)->stream,     &(lib)->stream_arg, &(lib)->empty,      \
                         &(lib)->extra, &(lib)->kwnames, &(lib)->bump,       &(lib)->dtypes[0],  &(lib)->dtypes[1], \
                         &(lib)->dtypes[2]}

static int Fast_traverse(FastObject *self, visitproc visit, void *arg) {
    for (int i = 0; i < self->n_entries; ++i) {
        Py_VISIT(self->entries[i].kernel);
        if (self->entries[i].chain != NULL) {
            Py_VISIT(self->entries[i].chain->owner);
            Py_VISIT(self->entries[i].chain->lock);
        }
    }
    for (int l = 0; l < FAST_LIBS; ++l) {
        FAST_LIB_REFS(&self->libs[l]);
        for (size_t i = 0; i < sizeof refs / sizeof *refs; ++i)
            Py_VISIT(*refs[i]);
    }
    return 0;
}

static void Fast_clear_lib(FastLib *lib) {
    FAST_LIB_REFS(lib);
    for (size_t i = 0; i < sizeof refs / sizeof *refs; ++i)
        Py_CLEAR(*refs[i]);
}

static int Fast_clear(FastObject *self) {
    Fast_clear_entries(self);
    for (int l = 0; l < FAST_LIBS; ++l)
        Fast_clear_lib(&self->libs[l]);
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
    if (fast_intern_names() < 0)
        return NULL;
    FastObject *self = (FastObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->n_in = n_in;
    self->n_out = n_out;
    self->ordinal = ordinal;
    return (PyObject *)self;
}

/* set_library(index, type, export, stream, stream_args, empty, shape_tuple, extra, bump, check_grad, dtypes):
 * index 0 torch, 1 CuPy; stream_args a tuple of zero or one argument; extra a tuple of (keyword, value) pairs
 * passed to empty after dtype; dtypes three dtype objects (float32, float16, bfloat16; None where there is none). */
static PyObject *Fast_set_library(FastObject *self, PyObject *args) {
    int index, shape_tuple, check_grad;
    PyObject *type, *export, *stream, *stream_args, *empty, *extra, *bump, *dtypes;
    if (!PyArg_ParseTuple(args, "iOOOO!OpO!OpO!", &index, &type, &export, &stream, &PyTuple_Type, &stream_args,
                          &empty, &shape_tuple, &PyTuple_Type, &extra, &bump, &check_grad, &PyTuple_Type, &dtypes))
        return NULL;
    if (index < 0 || index >= FAST_LIBS || !PyType_Check(type) || PyTuple_GET_SIZE(dtypes) != FAST_KINDS ||
        PyTuple_GET_SIZE(stream_args) > 1 || PyTuple_GET_SIZE(extra) > 4) {
        PyErr_Format(PyExc_ValueError, "set_library: index 0-%d, a type, at most one stream argument, at most 4 extra "
                     "keywords and three dtypes (float32, float16, bfloat16)", FAST_LIBS - 1);
        return NULL;
    }
    Py_ssize_t n_extra = PyTuple_GET_SIZE(extra);
    PyObject *kwnames = PyTuple_New(1 + n_extra), *values = PyTuple_New(n_extra);
    if (kwnames == NULL || values == NULL)
        goto fail;
    PyTuple_SET_ITEM(kwnames, 0, PyUnicode_InternFromString("dtype"));
    for (Py_ssize_t i = 0; i < n_extra; ++i) {
        PyObject *pair = PyTuple_GET_ITEM(extra, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(pair, 0))) {
            PyErr_SetString(PyExc_ValueError, "set_library: extra must hold (keyword, value) pairs");
            goto fail;
        }
        PyTuple_SET_ITEM(kwnames, 1 + i, Py_NewRef(PyTuple_GET_ITEM(pair, 0)));
        PyTuple_SET_ITEM(values, i, Py_NewRef(PyTuple_GET_ITEM(pair, 1)));
    }
    if (PyTuple_GET_ITEM(kwnames, 0) == NULL)
        goto fail;
    FastLib *lib = &self->libs[index];
    Fast_clear_lib(lib);
    *lib = (FastLib){.type = Py_NewRef(type), .export = Py_NewRef(export), .stream = Py_NewRef(stream),
                     .stream_arg = PyTuple_GET_SIZE(stream_args) ? Py_NewRef(PyTuple_GET_ITEM(stream_args, 0)) : NULL,
                     .empty = Py_NewRef(empty), .shape_tuple = shape_tuple, .extra = values, .kwnames = kwnames,
                     .bump = Py_NewRef(bump), .check_grad = check_grad};
    for (int i = 0; i < FAST_KINDS; ++i)
        lib->dtypes[i] = Py_NewRef(PyTuple_GET_ITEM(dtypes, i));
    Py_RETURN_NONE;
fail:
    Py_XDECREF(kwnames);
    Py_XDECREF(values);
    return NULL;
}

/* Puts kernel (a new reference, or NULL) or chain (owned, or NULL) in the table for calls like one of `rows` rows;
 * frees chain on failure. */
static PyObject *Fast_put(FastObject *self, int in, int out, long long rows, int sm_count, PyObject *kernel,
                          FastChain *chain) {
    if (in < 0 || in >= FAST_KINDS || out < 0 || out >= FAST_KINDS || rows < 1 || sm_count < 1) {
        PyErr_Format(PyExc_ValueError, "add(%d, %d, %lld, %d, ...): kinds are 0-2, rows and sm_count >= 1", in, out,
                     rows, sm_count);
        Py_XDECREF(kernel);
        Fast_free_chain(chain);
        return NULL;
    }
    const char *env = getenv("FUSEDMLP_AUTOTUNE");
    long long bucket = fast_bucket(rows);
    int size_class = fast_size_class(rows, sm_count);
    if (self->n_entries == FAST_MAX_ENTRIES)
        Fast_clear_entries(self); /* more shapes than the table holds: start over (a miss only costs the slow path) */
    self->sm_count = sm_count;
    FastEntry *e = NULL;
    for (int i = 0; i < self->n_entries && e == NULL; ++i) {
        FastEntry *o = &self->entries[i];
        if (o->in == in && o->out == out && o->bucket == bucket && o->size_class == size_class &&
            fast_same_env(o->autotune, env))
            e = o;
    }
    if (e == NULL) {
        char *copy = NULL;
        if (env != NULL && (copy = strdup(env)) == NULL) {
            Py_XDECREF(kernel);
            Fast_free_chain(chain);
            return PyErr_NoMemory();
        }
        e = &self->entries[self->n_entries++];
        *e = (FastEntry){in, out, bucket, size_class, copy, NULL, NULL};
    }
    Py_XSETREF(e->kernel, kernel);
    Fast_free_chain(e->chain);
    e->chain = chain;
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
    if (Kernel_is_gemm(kernel)) {
        PyErr_SetString(PyExc_ValueError, "add: a GEMM layer's kernel runs inside its network's chain, not alone");
        return NULL;
    }
    return Fast_put(self, in, out, rows, sm_count, Py_NewRef(kernel), NULL);
}

int chain_step_parse(PyObject *item, Py_ssize_t i, const char *who, FastStep *st) {
    if (!PyArg_ParseTuple(item, "O!LLLLp", &KernelType, &st->kernel, &st->x, &st->y, &st->x1, &st->res, &st->after))
        return -1;
    long long codes[] = {st->x, st->y, st->x1, st->res};
    for (int j = 0; j < 4; ++j)
        if (codes[j] < FAST_Y) {
            PyErr_Format(PyExc_ValueError, "%s: step %zd has operand code %lld (-3..-1 or an offset)", who, i, codes[j]);
            return -1;
        }
    return 0;
}

/* add_chain(in_kind, out_kind, rows, sm_count, owner, lock, stream, base, cap, steps, graphs=True): a segmented
 * network's launches for calls like one of `rows` rows on `stream`; steps a sequence of (kernel, x, y, x1, res, after)
 * with operand codes -1 x, -3 y, -2 none, >= 0 a byte offset from base (the workspace of cap rows), and after as
 * Kernel.launch's; graphs: replay small calls from CUDA graphs (Fast_chain_graph; _env.chain_graphs). */
static PyObject *Fast_add_chain(FastObject *self, PyObject *args) {
    int in, out, sm_count;
    long long rows, cap;
    unsigned long long stream, base;
    PyObject *owner, *lock, *steps;
    int graphs = 1;
    if (!PyArg_ParseTuple(args, "iiLiOOKKLO|p", &in, &out, &rows, &sm_count, &owner, &lock, &stream, &base, &cap,
                          &steps, &graphs))
        return NULL;
    PyObject *seq = PySequence_Fast(steps, "add_chain: steps must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    FastChain *c = calloc(1, sizeof *c);
    if (c == NULL || (c->steps = calloc(n > 0 ? (size_t)n : 1, sizeof *c->steps)) == NULL) {
        free(c);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    *c = (FastChain){.steps = c->steps, .owner = Py_NewRef(owner), .lock = Py_NewRef(lock),
                     .stream = (fm_stream)(uintptr_t)stream, .base = base, .cap = cap, .graphs = graphs && n > 1};
    for (Py_ssize_t i = 0; i < n; ++i) {
        FastStep *st = &c->steps[i];
        if (chain_step_parse(PySequence_Fast_GET_ITEM(seq, i), i, "add_chain", st) < 0) {
            Py_DECREF(seq);
            Fast_free_chain(c);
            return NULL;
        }
        Py_INCREF(st->kernel);
        c->n = (int)i + 1;
    }
    Py_DECREF(seq);
    if (n < 1 || cap < rows) {
        PyErr_Format(PyExc_ValueError, "add_chain: %zd steps, workspace of %lld rows for %lld: need >= 1 and >= rows",
                     n, cap, rows);
        Fast_free_chain(c);
        return NULL;
    }
    return Fast_put(self, in, out, rows, sm_count, NULL, c);
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

/* Exports t (lib's array type, exactly) through DLPack and checks what the kernel needs of it: on the model's GPU,
 * not tracked by autograd, float32/float16/bfloat16, C-contiguous (size-1 dimensions aside, as torch counts it),
 * 16-byte aligned, at most FAST_MAX_DIMS dimensions. Returns 1 when it qualifies (a->capsule then owned by the
 * caller), 0 when not (no exception set; the checked path will say why if it is an error), -1 on an exception. */
static int Fast_export(FastObject *self, const FastLib *lib, PyObject *t, FastArray *a) {
    a->capsule = NULL;
    if (Py_TYPE(t) != (PyTypeObject *)lib->type)
        return 0;
    if (lib->check_grad) {
        PyObject *rg = PyObject_GetAttr(t, s_requires_grad);
        if (rg == NULL)
            return -1;
        int tracked = rg == Py_True;
        Py_DECREF(rg);
        if (tracked)
            return 0;
    }
    PyObject *capsule = PyObject_CallOneArg(lib->export, t);
    if (capsule == NULL) { /* e.g. a conjugate view: the checked path deals with it */
        PyErr_Clear();
        return 0;
    }
    const fm_dl_tensor *d = PyCapsule_CheckExact(capsule) ? fast_capsule_tensor(capsule) : NULL;
    if (d == NULL) {
        Py_DECREF(capsule);
        PyErr_Clear();
        return 0;
    }
    /* device memory (kDLCUDA) or managed memory (kDLCUDAManaged, 13), which the kernel reads the same way */
    int ok = (d->device.device_type == 2 || d->device.device_type == 13) && d->device.device_id == self->ordinal &&
             d->ndim >= 1 &&
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

/* The kind of a dtype object given as out_dtype: -1 for None, -2 for anything else (the checked path). */
static int Fast_dtype_kind(const FastLib *lib, PyObject *dtype) {
    if (dtype == Py_None)
        return -1;
    for (int i = 0; i < FAST_KINDS; ++i)
        if (dtype == lib->dtypes[i])
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

/* lib's empty((*x.shape[:-1], n_out), dtype=..., **extra) through one vectorcall. */
static PyObject *Fast_empty(FastObject *self, const FastLib *lib, const fm_dl_tensor *x, int kind) {
    PyObject *dims[FAST_MAX_DIMS], *argv[FAST_MAX_DIMS + 8], *y = NULL, *shape = NULL;
    const int n = x->ndim;
    const Py_ssize_t n_kw = PyTuple_GET_SIZE(lib->kwnames);
    for (int i = 0; i < n; ++i) {
        if ((dims[i] = PyLong_FromLongLong(i == n - 1 ? self->n_out : x->shape[i])) == NULL) {
            while (i-- > 0)
                Py_DECREF(dims[i]);
            return NULL;
        }
    }
    int n_pos = n;
    if (lib->shape_tuple) { /* CuPy: one shape argument */
        if ((shape = PyTuple_New(n)) == NULL)
            goto done;
        for (int i = 0; i < n; ++i)
            PyTuple_SET_ITEM(shape, i, Py_NewRef(dims[i]));
        argv[0] = shape;
        n_pos = 1;
    } else {
        for (int i = 0; i < n; ++i)
            argv[i] = dims[i];
    }
    argv[n_pos] = lib->dtypes[kind];
    for (Py_ssize_t i = 1; i < n_kw && i < 8; ++i)
        argv[n_pos + i] = PyTuple_GET_ITEM(lib->extra, i - 1);
    y = PyObject_Vectorcall(lib->empty, argv, (size_t)n_pos, lib->kwnames);
done:
    Py_XDECREF(shape);
    for (int i = 0; i < n; ++i)
        Py_DECREF(dims[i]);
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

/* The library's current stream as a driver handle (torch: an int; CuPy: a Stream whose .ptr is one). */
static int Fast_stream(const FastLib *lib, fm_stream *stream) {
    PyObject *s = lib->stream_arg ? PyObject_CallOneArg(lib->stream, lib->stream_arg) : PyObject_CallNoArgs(lib->stream);
    if (s != NULL && !PyLong_Check(s))
        Py_SETREF(s, PyObject_GetAttrString(s, "ptr"));
    if (s == NULL)
        return -1;
    *stream = (fm_stream)(uintptr_t)PyLong_AsUnsignedLongLong(s);
    Py_DECREF(s);
    return PyErr_Occurred() ? -1 : 0;
}


/* Whether step s reads x or writes y: its kernel node's arguments change with the call's addresses. */
static int fast_step_moves(const FastStep *s) {
    const long long codes[] = {s->x, s->y, s->x1, s->res};
    for (int j = 0; j < 4; ++j)
        if (codes[j] == FAST_X || codes[j] == FAST_Y)
            return 1;
    return 0;
}

fm_status chain_steps_launch(const FastStep *steps, int n, fm_devptr x, fm_devptr y, fm_devptr base, long long rows,
                             fm_stream stream, void **nodes, fm_error *err) {
    fm_status st = FM_OK;
    for (int i = 0; i < n && st == FM_OK; ++i) {
        const FastStep *s = &steps[i];
        st = Kernel_launch_ptrs(s->kernel, fast_operand(s->x, x, y, base), fast_operand(s->y, x, y, base), rows, stream,
                                fast_operand(s->x1, x, y, base), fast_operand(s->res, x, y, base), s->after, err);
        if (st == FM_OK && nodes != NULL && fast_step_moves(s))
            st = fm_graph_last_node(stream, &nodes[i], err);
    }
    return st;
}

/* Captures the chain's launches for `rows` rows into g (a free or least recent slot): the same launches on a stream of
 * the chain's own, recorded rather than run, each x- or y-moving step's node noted, then instantiated. */
static fm_status Fast_chain_capture(FastChain *c, FastGraph *g, fm_devptr x, fm_devptr y, long long rows,
                                    fm_error *err) {
    void **node = calloc((size_t)c->n, sizeof *node);
    if (node == NULL)
        return fm_fail(err, FM_ERR_NOMEM, "out of memory for a chain graph's %d nodes", c->n);
    fm_graph_exec exec = NULL;
    void *graph = NULL;
    fm_status st = fm_graph_begin(&c->capture, err);
    if (st == FM_OK) {
        fm_status launched = chain_steps_launch(c->steps, c->n, x, y, c->base, rows, c->capture, node, err);
        st = fm_graph_end(c->capture, launched == FM_OK, &exec, &graph, launched == FM_OK ? err : NULL);
        st = launched != FM_OK ? launched : st;
    }
    if (st != FM_OK || exec == NULL) {
        free(node);
        return st != FM_OK ? st : fm_fail(err, FM_ERR_INTERNAL, "a chain's capture gave no graph");
    }
    fm_graph_free(g->exec, g->graph);
    free(g->node);
    *g = (FastGraph){rows, x, y, exec, graph, node, 0};
    c->graph_misses++;
    return FM_OK;
}

/* A small call's launches as one graph launch: the chain's graph for `rows` rows (Fast_chain_capture the first time),
 * its x- and y-moving nodes given this call's addresses where they differ from the last call's. One graph launch
 * replaces a launch per step on the host, and the GPU starts each kernel sooner after the one before (rec1024 at 1024
 * rows: 32.1 us launched, 28.4 us captured in a CUDA graph; docs/performance.md). Where capturing or an update fails (a
 * driver without them, say) the chain goes back to its launches for good; a call on a stream that is itself being
 * captured (the caller's own CUDA graph) launches as before, so that its graph records the kernels. Same kernels, same
 * arguments: the bits are the launches'. */
static fm_status Fast_chain_graph(FastChain *c, fm_devptr x, fm_devptr y, long long rows, fm_stream stream,
                                  fm_error *err) {
    FastGraph *g = NULL, *slot = &c->graph[0];
    for (int i = 0; i < FAST_GRAPHS; ++i) {
        FastGraph *o = &c->graph[i];
        if (o->exec != NULL && o->rows == rows)
            g = o;
        if (o->used < slot->used)
            slot = o;
    }
    fm_error local = {0};
    fm_status st = FM_OK;
    if (g == NULL) {
        st = Fast_chain_capture(c, slot, x, y, rows, &local);
        g = slot;
    } else {
        c->graph_hits++;
        if (g->x != x || g->y != y) {
            for (int i = 0; i < c->n && st == FM_OK; ++i) {
                const FastStep *s = &c->steps[i];
                if (g->node[i] != NULL)
                    st = Kernel_set_node(s->kernel, g->exec, g->node[i], fast_operand(s->x, x, y, c->base),
                                         fast_operand(s->y, x, y, c->base), rows, fast_operand(s->x1, x, y, c->base),
                                         fast_operand(s->res, x, y, c->base), &local);
            }
            g->x = x, g->y = y;
        }
    }
    if (st != FM_OK) { /* graphs off for good: the launches, and why, for stats */
        c->graphs = 0;
        snprintf(c->graph_error, sizeof c->graph_error, "%s", local.message);
        fm_error_clear(&local);
        return chain_steps_launch(c->steps, c->n, x, y, c->base, rows, stream, NULL, err);
    }
    fm_error_clear(&local);
    g->used = ++c->tick;
    return fm_graph_launch(g->exec, stream, err);
}

/* A chain's launches in order, under its launch lock (taken without waiting: held, the checked path waits for it). */
static fm_status Fast_run_chain(FastChain *c, fm_devptr x, fm_devptr y, long long rows, fm_stream stream,
                                fm_error *err) {
    PyObject *got = PyObject_CallMethodOneArg(c->lock, s_acquire, Py_False);
    if (got == NULL)
        return fm_fail(err, FM_ERR_VALUE, "a segmented call could not take its chain's launch lock");
    int held = got == Py_True;
    Py_DECREF(got);
    if (!held) { /* another thread is launching this chain: wait for it (the GIL is released while waiting) */
        if ((got = PyObject_CallMethodNoArgs(c->lock, s_acquire)) == NULL)
            return fm_fail(err, FM_ERR_VALUE, "a segmented call could not take its chain's launch lock");
        Py_DECREF(got);
    }
    fm_status st;
    if (c->graphs && rows <= FAST_GRAPH_MAX_ROWS && fm_stream_capturing(stream) == 0)
        st = Fast_chain_graph(c, x, y, rows, stream, err);
    else
        st = chain_steps_launch(c->steps, c->n, x, y, c->base, rows, stream, NULL, err);
    PyObject *released = PyObject_CallMethodNoArgs(c->lock, s_release);
    if (released == NULL) {
        PyErr_Clear();
        if (st == FM_OK)
            st = fm_fail(err, FM_ERR_VALUE, "a segmented call could not release its chain's launch lock");
    }
    Py_XDECREF(released);
    return st;
}

/* fp(x, out_dtype, out) -> y, or NotImplemented when the checked path must take the call. */
static PyObject *Fast_call(FastObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "FastPath.call takes (x, out_dtype, out)");
        return NULL;
    }
    PyObject *xobj = args[0], *out_dtype = args[1], *outobj = args[2], *y = NULL;
    const FastLib *lib = NULL;
    for (int l = 0; l < FAST_LIBS; ++l)
        if (self->libs[l].type != NULL && Py_TYPE(xobj) == (PyTypeObject *)self->libs[l].type)
            lib = &self->libs[l];
    if (self->n_entries == 0 || lib == NULL)
        goto miss;
    int want = Fast_dtype_kind(lib, out_dtype);
    if (want == -2)
        goto miss;
    FastArray x, o = {0};
    int r = Fast_export(self, lib, xobj, &x);
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
        if ((r = Fast_export(self, lib, outobj, &o)) <= 0) {
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
    if (e == NULL || lib->dtypes[out_kind] == Py_None)
        goto miss_xo;
    fm_stream stream;
    if (Fast_stream(lib, &stream) < 0)
        goto fail; /* (y is still NULL) */
    /* a chain's workspace is its stream's and as large as its largest call so far: others take the checked path */
    if (e->chain != NULL && (e->chain->stream != stream || e->chain->cap < rows))
        goto miss_xo;
    if (outobj == Py_None) {
        if ((y = Fast_empty(self, lib, xt, out_kind)) == NULL)
            goto fail;
        if ((r = Fast_export(self, lib, y, &o)) <= 0) {
            if (r < 0)
                goto fail;
            /* only where the library allocated elsewhere (CuPy's current device is not the model's): the checked
             * path allocates on the model's device */
            Py_CLEAR(y);
            goto miss_x;
        }
    } else {
        if (lib->bump != Py_None) { /* out's version counter, as torch's own out= ops bump it (_dlpack.py) */
            PyObject *bumped = PyObject_CallOneArg(lib->bump, outobj);
            if (bumped == NULL)
                goto fail;
            Py_DECREF(bumped);
        }
        y = Py_NewRef(outobj);
    }
    /* The launches keep the GIL: cuLaunchKernel only queues (3.6 us on the H100 machine), and a release and re-take
     * around it would cost more than it frees and can wait on another thread's switch interval. */
    fm_error err = {0};
    fm_status st = e->chain != NULL ? Fast_run_chain(e->chain, x.ptr, o.ptr, rows, stream, &err)
                                    : Kernel_launch_ptrs(e->kernel, x.ptr, o.ptr, rows, stream, 0, 0, 0, &err);
    if (st != FM_OK) {
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

/* export(x) -> dict: what the fast path reads of x through its library's export (for "why is this call slow?"), or
 * None where x is not an array of a library it knows. */
static PyObject *Fast_export_info(FastObject *self, PyObject *x) {
    const FastLib *lib = NULL;
    for (int l = 0; l < FAST_LIBS; ++l)
        if (self->libs[l].type != NULL && Py_TYPE(x) == (PyTypeObject *)self->libs[l].type)
            lib = &self->libs[l];
    if (lib == NULL)
        Py_RETURN_NONE;
    PyObject *capsule = PyObject_CallOneArg(lib->export, x);
    if (capsule == NULL)
        return NULL;
    const char *name = PyCapsule_GetName(capsule);
    const fm_dl_tensor *d = name != NULL ? fast_capsule_tensor(capsule) : NULL;
    PyObject *info = NULL, *shape = NULL, *strides = NULL;
    if (d == NULL) {
        info = Py_BuildValue("{s:s}", "capsule", name != NULL ? name : "?");
        goto done;
    }
    shape = PyTuple_New(d->ndim);
    strides = d->strides != NULL ? PyTuple_New(d->ndim) : Py_NewRef(Py_None);
    if (shape == NULL || strides == NULL)
        goto done;
    for (int i = 0; i < d->ndim; ++i) {
        PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(d->shape[i]));
        if (d->strides != NULL)
            PyTuple_SET_ITEM(strides, i, PyLong_FromLongLong(d->strides[i]));
    }
    info = Py_BuildValue("{s:s,s:(ii),s:(iii),s:O,s:O,s:K,s:K}", "capsule", name, "device", d->device.device_type,
                         d->device.device_id, "dtype", d->dtype.code, d->dtype.bits, d->dtype.lanes, "shape", shape,
                         "strides", strides, "data", (unsigned long long)(uintptr_t)d->data, "byte_offset",
                         (unsigned long long)d->byte_offset);
done:
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    Py_DECREF(capsule);
    return info;
}

static PyObject *Fast_get_stats(FastObject *self, void *closure) {
    (void)closure;
    long long hits = 0, misses = 0;
    const char *why = "";
    for (int i = 0; i < self->n_entries; ++i) {
        const FastChain *c = self->entries[i].chain;
        if (c != NULL) {
            hits += c->graph_hits, misses += c->graph_misses;
            why = c->graph_error[0] != '\0' ? c->graph_error : why;
        }
    }
    PyObject *d = Py_BuildValue("{s:L,s:L,s:i,s:L,s:L}", "calls", self->calls, "misses", self->misses, "entries",
                                self->n_entries, "graph_hits", hits, "graph_misses", misses);
    if (d != NULL && why[0] != '\0') { /* only where graphs went off: the reason */
        PyObject *text = PyUnicode_DecodeUTF8(why, (Py_ssize_t)strlen(why), "replace");
        if (text == NULL || PyDict_SetItemString(d, "graph_error", text) < 0)
            Py_CLEAR(d);
        Py_XDECREF(text);
    }
    return d;
}

static PyMethodDef Fast_methods[] = {
    {"call", (PyCFunction)(void (*)(void))Fast_call, METH_FASTCALL,
     "call(x, out_dtype, out) -> y, or NotImplemented when the checked Python path must take the call."},
    {"add_chain", (PyCFunction)Fast_add_chain, METH_VARARGS,
     "add_chain(in_kind, out_kind, rows, sm_count, owner, lock, stream, base, cap, steps, graphs=True): a segmented "
     "network (graphs: replay its small calls from CUDA graphs)."},
    {"add", (PyCFunction)Fast_add, METH_VARARGS,
     "add(in_kind, out_kind, rows, sm_count, kernel): kinds 0 float32, 1 float16, 2 bfloat16."},
    {"set_library", (PyCFunction)Fast_set_library, METH_VARARGS,
     "set_library(index, type, export, stream, stream_args, empty, shape_tuple, extra, bump, check_grad, dtypes)."},
    {"export", (PyCFunction)Fast_export_info, METH_O,
     "export(x) -> dict of what the fast path reads of x (capsule, device, dtype, shape, strides, data), or None."},
    {"clear", (PyCFunction)Fast_clear_method, METH_NOARGS, "clear(): forget every kernel (the next calls re-add)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Fast_getset[] = {
    {"stats", (getter)Fast_get_stats, NULL, "dict: calls answered, misses (sent to the checked path), entries, and "
     "the chains' graph replays (graph_hits) and captures (graph_misses); graph_error where a chain's graphs went off",
     NULL},
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
