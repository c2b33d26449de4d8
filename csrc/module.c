/* module.c - the CPython binding: NumPy arrays in, fusedmlp.errors exceptions out. The only file with Python.h.
 *
 * Types: Network (validated spec + float32 weights; the CPU forward), Plan (one fm_plan: renders the source and
 * later fills the launch, so the two cannot drift), Gpu (a device's retained primary context), Kernel (a loaded
 * CUBIN with the weights on the device). The GIL is released around compiles, the CPU forward and GPU work. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#include <numpy/arrayobject.h>

#include "fm.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------------ errors */

/* Raises the fusedmlp.errors class for err's status. The classes are looked up when an error happens (not cached
 * in globals): errors are rare, and this keeps the module free of state. */
static PyObject *fm_raise(const fm_error *err) {
    if (err->status == FM_ERR_NOMEM)
        return PyErr_NoMemory();
    const char *cls_name = "FusedMLPError";
    switch (err->status) {
    case FM_ERR_VALUE: cls_name = "ArgumentError"; break;
    case FM_ERR_SHAPE: cls_name = "ShapeError"; break;
    case FM_ERR_EXPR: cls_name = "ExpressionError"; break;
    case FM_ERR_LIMIT: cls_name = "LimitError"; break;
    case FM_ERR_LIBRARY: cls_name = "LibraryNotFoundError"; break;
    case FM_ERR_COMPILE: cls_name = "CompileError"; break;
    case FM_ERR_CUDA: cls_name = "CudaError"; break;
    case FM_ERR_TEMPLATE: cls_name = "TemplateError"; break;
    default: break;
    }
    PyObject *mod = PyImport_ImportModule("fusedmlp.errors");
    if (mod == NULL)
        return NULL;
    PyObject *cls = PyObject_GetAttrString(mod, cls_name);
    Py_DECREF(mod);
    if (cls == NULL)
        return NULL;
    PyObject *kwargs = NULL;
    if (err->status == FM_ERR_COMPILE)
        kwargs = Py_BuildValue("{s:s}", "log", err->log ? err->log : "");
    else if (err->status == FM_ERR_CUDA) {
        /* The driver's error name is the CUDA_ERROR_* word in the message. */
        const char *name = strstr(err->message, "CUDA_ERROR_");
        size_t len = 0;
        while (name && (name[len] == '_' || (name[len] >= 'A' && name[len] <= 'Z') || (name[len] >= '0' && name[len] <= '9')))
            ++len;
        kwargs = Py_BuildValue("{s:i,s:s#}", "code", err->code, "name", name ? name : "", (Py_ssize_t)len);
    } else if (err->status == FM_ERR_EXPR)
        kwargs = Py_BuildValue("{s:i}", "column", err->column);
    else
        kwargs = PyDict_New();
    PyObject *args = kwargs ? Py_BuildValue("(ss)", err->message, err->hint) : NULL;
    PyObject *exc = args ? PyObject_Call(cls, args, kwargs) : NULL;
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_DECREF(cls);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static PyObject *fm_raise_clear(fm_error *err) {
    fm_raise(err);
    fm_error_clear(err);
    return NULL;
}

static int fm_dtype_from_str(const char *s, fm_dtype *d) {
    for (int i = FM_F32; i <= FM_BF16; ++i)
        if (strcmp(s, fm_dtype_name((fm_dtype)i)) == 0) {
            *d = (fm_dtype)i;
            return 0;
        }
    PyErr_Format(PyExc_ValueError, "dtype '%s' is not one of float32, float16, bfloat16", s);
    return -1;
}

static int fm_prec_from_str(const char *s, fm_prec *p) {
    for (int i = FM_PREC_F16; i <= FM_PREC_TF32; ++i)
        if (strcmp(s, fm_prec_name((fm_prec)i)) == 0) {
            *p = (fm_prec)i;
            return 0;
        }
    PyErr_Format(PyExc_ValueError, "precision '%s' is not one of float16, bfloat16, tf32", s);
    return -1;
}

/* NumPy type of a kernel's x or y: bfloat16 travels as its uint16 bits (NumPy has no bfloat16 of its own). */
static int fm_npy_type(fm_dtype d) { return d == FM_F32 ? NPY_FLOAT32 : d == FM_F16 ? NPY_FLOAT16 : NPY_UINT16; }

/* Returns a new reference to `obj` as an aligned C-contiguous array of `type` with `ndim` dimensions; no casting:
 * the Python layer converts, this only guards the boundary. */
static PyArrayObject *fm_array(PyObject *obj, int type, int ndim, const char *what) {
    if (!PyArray_Check(obj) || PyArray_TYPE((PyArrayObject *)obj) != type ||
        PyArray_NDIM((PyArrayObject *)obj) != ndim ||
        !PyArray_ISCARRAY_RO((PyArrayObject *)obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous %d-D %s array", what, ndim,
                     type == NPY_FLOAT32 ? "float32" : type == NPY_FLOAT16 ? "float16" : type == NPY_UINT16 ? "uint16 (bfloat16 bits)" : "float64");
        return NULL;
    }
    Py_INCREF(obj);
    return (PyArrayObject *)obj;
}

/* UTF-8 of a str without embedded NULs: the C core sees text up to the first NUL, so "x\0; asm(...)" must be an error
 * here rather than silently parse as "x". */
static const char *fm_text(PyObject *obj, const char *what) {
    Py_ssize_t size = 0;
    const char *text = PyUnicode_Check(obj) ? PyUnicode_AsUTF8AndSize(obj, &size) : NULL;
    if (text == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "%s must be a str, not %.100s", what, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    if ((size_t)size != strlen(text)) {
        PyErr_Format(PyExc_ValueError, "%s contains a NUL character at position %zd", what, (Py_ssize_t)strlen(text));
        return NULL;
    }
    return text;
}

/* ------------------------------------------------------------------------------------------------ expressions */

static PyObject *py_parse_expr(PyObject *self, PyObject *arg) {
    (void)self;
    const char *text = fm_text(arg, "expression");
    if (text == NULL)
        return NULL;
    fm_error err = {0};
    fm_expr *e = NULL;
    if (fm_expr_parse(text, &e, &err) != FM_OK)
        return fm_raise_clear(&err);
    fm_str canon = {0}, cuda = {0};
    fm_expr_to_string(e, &canon);
    fm_status st = fm_expr_emit_cuda(e, "x", &cuda, &err);
    fm_expr_free(e);
    PyObject *res = st == FM_OK ? Py_BuildValue("(ss)", canon.data, cuda.data) : fm_raise(&err);
    fm_str_free(&canon);
    fm_str_free(&cuda);
    fm_error_clear(&err);
    return res;
}

/* expr_range(text, lo, hi) -> (lo, hi, trig): fm_expr_range's enclosure of the expression over [lo, hi] and its
 * bound on sin/cos arguments. */
static PyObject *py_expr_range(PyObject *self, PyObject *args) {
    (void)self;
    const char *text;
    double lo, hi, out_lo, out_hi;
    if (!PyArg_ParseTuple(args, "sdd", &text, &lo, &hi))
        return NULL;
    fm_error err = {0};
    fm_expr *e = NULL;
    if (fm_expr_parse(text, &e, &err) != FM_OK)
        return fm_raise_clear(&err);
    double trig = fm_expr_range(e, lo, hi, &out_lo, &out_hi);
    fm_expr_free(e);
    return Py_BuildValue("(ddd)", out_lo, out_hi, trig);
}

static PyObject *py_eval_expr(PyObject *self, PyObject *args) {
    (void)self;
    const char *text;
    PyObject *xobj;
    if (!PyArg_ParseTuple(args, "sO", &text, &xobj))
        return NULL;
    PyArrayObject *x = fm_array(xobj, NPY_FLOAT64, 1, "x");
    if (x == NULL)
        return NULL;
    fm_error err = {0};
    fm_expr *e = NULL;
    PyArrayObject *y = NULL;
    if (fm_expr_parse(text, &e, &err) != FM_OK)
        goto fail;
    y = (PyArrayObject *)PyArray_SimpleNew(1, PyArray_DIMS(x), NPY_FLOAT64);
    if (y == NULL)
        goto done;
    if (fm_expr_eval(e, PyArray_DATA(x), PyArray_DATA(y), (size_t)PyArray_SIZE(x), &err) != FM_OK) {
        Py_CLEAR(y);
        goto fail;
    }
    goto done;
fail:
    fm_raise(&err);
done:
    fm_expr_free(e);
    fm_error_clear(&err);
    Py_DECREF(x);
    return (PyObject *)y;
}

static PyObject *py_expr_functions(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    PyObject *list = PyList_New(0);
    for (const char *const *f = fm_expr_functions(); list && *f; ++f) {
        PyObject *s = PyUnicode_FromString(*f);
        if (s == NULL || PyList_Append(list, s) < 0) {
            Py_XDECREF(s);
            Py_CLEAR(list);
            break;
        }
        Py_DECREF(s);
    }
    return list;
}

/* ------------------------------------------------------------------------------------------------ NVRTC */

static PyObject *py_nvrtc_load(PyObject *self, PyObject *arg) {
    (void)self;
    const char *hint = arg == Py_None ? NULL : PyUnicode_AsUTF8(arg);
    if (hint == NULL && arg != Py_None)
        return NULL;
    fm_error err = {0};
    fm_status st;
    Py_BEGIN_ALLOW_THREADS st = fm_nvrtc_load(hint, &err);
    Py_END_ALLOW_THREADS if (st != FM_OK) return fm_raise_clear(&err);
    int major = 0, minor = 0;
    if (fm_nvrtc_version(&major, &minor, &err) != FM_OK)
        return fm_raise_clear(&err);
    const char *path = fm_nvrtc_library_path();
    return Py_BuildValue("(s(ii))", path ? path : "", major, minor);
}

static PyObject *py_nvrtc_compile(PyObject *self, PyObject *args) {
    (void)self;
    const char *source, *name;
    int arch, arch_a;
    PyObject *opts_obj;
    if (!PyArg_ParseTuple(args, "ssipO!", &source, &name, &arch, &arch_a, &PyTuple_Type, &opts_obj))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(opts_obj);
    const char **opts = PyMem_Calloc((size_t)n + 1, sizeof *opts);
    if (opts == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; ++i) {
        opts[i] = PyUnicode_AsUTF8(PyTuple_GET_ITEM(opts_obj, i));
        if (opts[i] == NULL) {
            PyMem_Free(opts);
            return NULL;
        }
    }
    fm_error err = {0};
    void *cubin = NULL;
    size_t size = 0;
    char *log = NULL;
    fm_status st;
    Py_BEGIN_ALLOW_THREADS st = fm_nvrtc_compile(source, name, arch, arch_a, opts, (int)n, &cubin, &size, &log, &err);
    Py_END_ALLOW_THREADS PyMem_Free(opts);
    if (st != FM_OK) {
        free(log);
        return fm_raise_clear(&err);
    }
    PyObject *res = Py_BuildValue("(y#s)", (const char *)cubin, (Py_ssize_t)size, log ? log : "");
    free(cubin);
    free(log);
    return res;
}

/* ------------------------------------------------------------------------------------------------ Gpu */

typedef struct {
    PyObject_HEAD fm_gpu gpu;
    int open;
} GpuObject;

static PyObject *py_cuda_device_count(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    fm_error err = {0};
    int count = 0;
    fm_status st;
    Py_BEGIN_ALLOW_THREADS st = fm_cuda_load(&err);
    if (st == FM_OK)
        st = fm_cuda_device_count(&count, &err);
    Py_END_ALLOW_THREADS if (st != FM_OK) return fm_raise_clear(&err);
    return PyLong_FromLong(count);
}

static int Gpu_init(GpuObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ordinal", NULL};
    int ordinal = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", kwlist, &ordinal))
        return -1;
    if (self->open) {
        PyErr_SetString(PyExc_RuntimeError, "Gpu is already initialised");
        return -1;
    }
    fm_error err = {0};
    fm_status st;
    Py_BEGIN_ALLOW_THREADS st = fm_cuda_load(&err);
    if (st == FM_OK)
        st = fm_gpu_open(ordinal, &self->gpu, &err);
    Py_END_ALLOW_THREADS if (st != FM_OK) {
        fm_raise_clear(&err);
        return -1;
    }
    self->open = 1;
    return 0;
}

static void Gpu_dealloc(GpuObject *self) {
    if (self->open)
        fm_gpu_close(&self->gpu);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Gpu_get_info(GpuObject *self, void *closure) {
    (void)closure;
    if (!self->open) {
        PyErr_SetString(PyExc_RuntimeError, "Gpu is not initialised");
        return NULL;
    }
    return Py_BuildValue("{s:i,s:s,s:i,s:i,s:n,s:n}", "ordinal", self->gpu.ordinal, "name", self->gpu.name, "arch",
                         self->gpu.arch, "sm_count", self->gpu.sm_count, "smem_per_block",
                         (Py_ssize_t)self->gpu.smem_per_block_optin, "smem_per_sm", (Py_ssize_t)self->gpu.smem_per_sm);
}

static PyGetSetDef Gpu_getset[] = {
    {"info", (getter)Gpu_get_info, NULL, "dict: ordinal, name, arch, sm_count, smem_per_block, smem_per_sm", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject GpuType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fusedmlp._core.Gpu",
    .tp_basicsize = sizeof(GpuObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Gpu(ordinal): a CUDA device with its primary context retained.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Gpu_init,
    .tp_dealloc = (destructor)Gpu_dealloc,
    .tp_getset = Gpu_getset,
};

/* ------------------------------------------------------------------------------------------------ Network */

typedef struct {
    PyObject_HEAD fm_spec spec;
    int has_spec;
    float *w[FM_MAX_LAYERS]; /* owned copies, n x k row-major */
    float *b[FM_MAX_LAYERS]; /* owned copies or NULL */
} NetworkObject;

static void Network_release(NetworkObject *self) {
    for (int l = 0; l < FM_MAX_LAYERS; ++l) {
        PyMem_RawFree(self->w[l]);
        PyMem_RawFree(self->b[l]);
        self->w[l] = self->b[l] = NULL;
    }
    if (self->has_spec)
        fm_spec_free(&self->spec);
    self->has_spec = 0;
}

/* Copies the float32 arrays into owned memory: later changes to the caller's arrays must not change the model. */
static int Network_copy_arrays(NetworkObject *self, PyObject *weights, PyObject *biases, Py_ssize_t n) {
    for (Py_ssize_t l = 0; l < n; ++l) {
        PyArrayObject *w = fm_array(PyList_GET_ITEM(weights, l), NPY_FLOAT32, 2, "weights[l]");
        if (w == NULL)
            return -1;
        size_t bytes = (size_t)PyArray_NBYTES(w);
        self->w[l] = PyMem_RawMalloc(bytes ? bytes : 1);
        if (self->w[l] != NULL)
            memcpy(self->w[l], PyArray_DATA(w), bytes);
        Py_DECREF(w);
        if (self->w[l] == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        PyObject *bobj = PyList_GET_ITEM(biases, l);
        if (bobj == Py_None)
            continue;
        PyArrayObject *b = fm_array(bobj, NPY_FLOAT32, 1, "biases[l]");
        if (b == NULL)
            return -1;
        bytes = (size_t)PyArray_NBYTES(b);
        self->b[l] = PyMem_RawMalloc(bytes ? bytes : 1);
        if (self->b[l] != NULL)
            memcpy(self->b[l], PyArray_DATA(b), bytes);
        Py_DECREF(b);
        if (self->b[l] == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

/* residuals: a list with, per layer, None or (op, post, src): op 1 = add, 2 = mul with value src (-1: the network
 * input, l - 1: the layer's own input, k: layer k's output). */
static int Network_set_residuals(NetworkObject *self, PyObject *residuals, Py_ssize_t n) {
    if (!PyList_Check(residuals) || PyList_GET_SIZE(residuals) != n) {
        PyErr_Format(PyExc_TypeError, "residuals must be a list with one entry per layer (%zd)", n);
        return -1;
    }
    for (Py_ssize_t l = 0; l < n; ++l) {
        PyObject *item = PyList_GET_ITEM(residuals, l);
        if (item == Py_None)
            continue;
        int op, src;
        PyObject *post_obj;
        if (!PyArg_ParseTuple(item, "iUi", &op, &post_obj, &src))
            return -1;
        const char *post = fm_text(post_obj, "residual activation");
        if (post == NULL)
            return -1;
        fm_error err = {0};
        if (fm_spec_set_residual(&self->spec, (int)l, op, post, src, &err) != FM_OK) {
            fm_raise_clear(&err);
            return -1;
        }
    }
    return 0;
}

static int Network_init(NetworkObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"weights", "biases", "activations", "residuals", "concat", NULL};
    PyObject *weights, *biases, *acts, *residuals = Py_None, *concat = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!|OO", kwlist, &PyList_Type, &weights, &PyList_Type, &biases,
                                     &PyList_Type, &acts, &residuals, &concat))
        return -1;
    Network_release(self);
    Py_ssize_t n = PyList_GET_SIZE(weights);
    if (n < 1 || n > FM_MAX_LAYERS || PyList_GET_SIZE(biases) != n || PyList_GET_SIZE(acts) != n) {
        PyErr_Format(PyExc_ValueError, "a network needs 1..%d layers and one bias and activation per layer", FM_MAX_LAYERS);
        return -1;
    }
    int64_t shapes[2 * FM_MAX_LAYERS], bias_len[FM_MAX_LAYERS];
    int cat[FM_MAX_LAYERS] = {0};
    const char *act_text[FM_MAX_LAYERS];
    if (concat != Py_None) { /* one FM_CAT_* per layer */
        if (!PyList_Check(concat) || PyList_GET_SIZE(concat) != n) {
            PyErr_Format(PyExc_TypeError, "concat must be a list with one mode per layer (%zd)", n);
            return -1;
        }
        for (Py_ssize_t l = 0; l < n; ++l) {
            long mode = PyLong_AsLong(PyList_GET_ITEM(concat, l));
            if (mode == -1 && PyErr_Occurred())
                return -1;
            cat[l] = mode < 0 || mode > 2 ? 99 : (int)mode; /* fm_spec_init reports the bad mode */
        }
    }
    for (Py_ssize_t l = 0; l < n; ++l) {
        PyArrayObject *w = fm_array(PyList_GET_ITEM(weights, l), NPY_FLOAT32, 2, "weights[l]");
        if (w == NULL)
            return -1;
        shapes[2 * l] = PyArray_DIM(w, 0);
        shapes[2 * l + 1] = PyArray_DIM(w, 1);
        Py_DECREF(w);
        PyObject *b = PyList_GET_ITEM(biases, l);
        bias_len[l] = b == Py_None ? -1 : (PyArray_Check(b) ? PyArray_SIZE((PyArrayObject *)b) : -2);
        act_text[l] = fm_text(PyList_GET_ITEM(acts, l), "activation");
        if (act_text[l] == NULL)
            return -1;
    }
    fm_error err = {0};
    if (fm_spec_init(&self->spec, (int)n, shapes, bias_len, act_text, cat, &err) != FM_OK) {
        fm_raise_clear(&err);
        return -1;
    }
    self->has_spec = 1;
    if (residuals != Py_None && Network_set_residuals(self, residuals, n) < 0) {
        Network_release(self);
        return -1;
    }
    if (Network_copy_arrays(self, weights, biases, n) < 0) {
        Network_release(self);
        return -1;
    }
    fm_spec_bound_preacts(&self->spec, (const float *const *)self->w, (const float *const *)self->b);
    return 0;
}

static void Network_dealloc(NetworkObject *self) {
    Network_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Network_ready(NetworkObject *self) {
    if (!self->has_spec) {
        PyErr_SetString(PyExc_RuntimeError, "Network is not initialised");
        return 0;
    }
    return 1;
}

/* preact_bounds() -> [float]: per layer, the weights' bound on |W h + b| over every input (inf: none). */
static PyObject *Network_preact_bounds(NetworkObject *self, PyObject *unused) {
    (void)unused;
    if (!Network_ready(self))
        return NULL;
    PyObject *list = PyList_New(self->spec.num_layers);
    for (int l = 0; list != NULL && l < self->spec.num_layers; ++l) {
        PyObject *v = PyFloat_FromDouble(self->spec.z_bound[l]);
        if (v == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, l, v);
    }
    return list;
}

/* forward_cpu(x: float32 (rows, in) array, any strides) -> float32 (rows, out) array */
static PyObject *Network_forward_cpu(NetworkObject *self, PyObject *xobj) {
    if (!Network_ready(self))
        return NULL;
    if (!PyArray_Check(xobj) || PyArray_TYPE((PyArrayObject *)xobj) != NPY_FLOAT32 ||
        PyArray_NDIM((PyArrayObject *)xobj) != 2 || !PyArray_ISALIGNED((PyArrayObject *)xobj)) {
        PyErr_SetString(PyExc_TypeError, "x must be an aligned 2-D float32 array");
        return NULL;
    }
    PyArrayObject *x = (PyArrayObject *)xobj;
    if (PyArray_DIM(x, 1) != self->spec.width[0]) {
        PyErr_Format(PyExc_ValueError, "x has %zd features; the network takes %d", (Py_ssize_t)PyArray_DIM(x, 1),
                     self->spec.width[0]);
        return NULL;
    }
    npy_intp dims[2] = {PyArray_DIM(x, 0), self->spec.width[self->spec.num_layers]};
    PyArrayObject *y = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    if (y == NULL)
        return NULL;
    fm_error err = {0};
    fm_status st;
    int64_t srow = PyArray_STRIDE(x, 0) / 4, scol = PyArray_STRIDE(x, 1) / 4;
    Py_BEGIN_ALLOW_THREADS st = fm_ref_forward(&self->spec, (const float *const *)self->w,
                                               (const float *const *)self->b, PyArray_DATA(x), dims[0], srow, scol,
                                               PyArray_DATA(y), &err);
    Py_END_ALLOW_THREADS if (st != FM_OK) {
        Py_DECREF(y);
        return fm_raise_clear(&err);
    }
    return (PyObject *)y;
}

static PyObject *Network_get_widths(NetworkObject *self, void *closure) {
    (void)closure;
    if (!Network_ready(self))
        return NULL;
    PyObject *t = PyTuple_New(self->spec.num_layers + 1);
    for (int l = 0; t && l <= self->spec.num_layers; ++l)
        PyTuple_SET_ITEM(t, l, PyLong_FromLong(self->spec.width[l]));
    return t;
}

static PyObject *Network_get_activations(NetworkObject *self, void *closure) {
    (void)closure;
    if (!Network_ready(self))
        return NULL;
    PyObject *t = PyTuple_New(self->spec.num_layers);
    for (int l = 0; t && l < self->spec.num_layers; ++l) {
        fm_str s = {0};
        fm_expr_to_string(self->spec.act[l], &s);
        PyTuple_SET_ITEM(t, l, PyUnicode_FromString(s.data ? s.data : ""));
        fm_str_free(&s);
    }
    return t;
}

static PyObject *Network_plan(NetworkObject *self, PyObject *args, PyObject *kwds);
static PyObject *Network_gemm_plan(NetworkObject *self, PyObject *args, PyObject *kwds);

static PyMethodDef Network_methods[] = {
    {"forward_cpu", (PyCFunction)Network_forward_cpu, METH_O, "forward_cpu(x) -> y: the CPU forward (float64 accumulate)."},
    {"preact_bounds", (PyCFunction)Network_preact_bounds, METH_NOARGS,
     "preact_bounds() -> [float]: per layer, a bound on |W h + b| for every input (inf: none known)."},
    {"plan", (PyCFunction)(void (*)(void))Network_plan, METH_VARARGS | METH_KEYWORDS,
     "plan(arch, smem_per_block=0, sm_count=0, in_dtype='float32', out_dtype='float32', warps=0, m_tiles=0, "
     "n_chunk=0, resident=-1, smem_per_sm=0, precision='float16', wgmma=-1, cluster=0, kpipe=0) -> Plan"},
    {"gemm_plan", (PyCFunction)(void (*)(void))Network_gemm_plan, METH_VARARGS | METH_KEYWORDS,
     "gemm_plan(layer, arch, smem_per_block, sm_count, a0, a1, res, out, smem_per_sm=0, precision='float16', bm=0, "
     "bn=0) -> Plan: the layer alone as a GEMM (dtype names; a1, res None where the layer has no concat/residual)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Network_getset[] = {
    {"widths", (getter)Network_get_widths, NULL, "feature counts: input, then each layer's output", NULL},
    {"activations", (getter)Network_get_activations, NULL, "canonical text of each layer's activation", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject NetworkType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fusedmlp._core.Network",
    .tp_basicsize = sizeof(NetworkObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Network(weights, biases, activations): a validated MLP with float32 weights (PyTorch layout).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Network_init,
    .tp_dealloc = (destructor)Network_dealloc,
    .tp_methods = Network_methods,
    .tp_getset = Network_getset,
};

/* ------------------------------------------------------------------------------------------------ Plan */

typedef struct {
    PyObject_HEAD NetworkObject *net;
    fm_plan plan;
    fm_target target;
} PlanObject;

static PyTypeObject PlanType;

static PyObject *Network_plan(NetworkObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"arch", "smem_per_block", "sm_count", "in_dtype", "out_dtype", "warps", "m_tiles",
                             "n_chunk", "resident", "smem_per_sm", "precision", "wgmma", "cluster", "kpipe",
                             NULL};
    int arch, sm_count = 0;
    Py_ssize_t smem = 0, smem_sm = 0;
    const char *in_s = "float32", *out_s = "float32", *prec_s = "float16";
    fm_plan_opts opts = {0, 0, 0, -1, -1, 0, 0};
    if (!Network_ready(self) ||
        !PyArg_ParseTupleAndKeywords(args, kwds, "i|niss$iiiinsiii", kwlist, &arch, &smem, &sm_count, &in_s, &out_s,
                                     &opts.warps, &opts.m_tiles, &opts.n_chunk, &opts.resident, &smem_sm, &prec_s,
                                     &opts.wgmma, &opts.cluster, &opts.kpipe))
        return NULL;
    fm_dtype in_d, out_d;
    fm_prec prec;
    if (fm_dtype_from_str(in_s, &in_d) < 0 || fm_dtype_from_str(out_s, &out_d) < 0 ||
        fm_prec_from_str(prec_s, &prec) < 0)
        return NULL;
    PlanObject *p = PyObject_New(PlanObject, &PlanType);
    if (p == NULL)
        return NULL;
    Py_INCREF(self);
    p->net = self;
    fm_error err = {0};
    if (fm_target_for_arch(arch, &p->target, &err) != FM_OK)
        goto fail;
    if (smem > 0)
        p->target.smem_per_block = (size_t)smem;
    if (smem_sm > 0)
        p->target.smem_per_sm = (size_t)smem_sm;
    p->target.sm_count = sm_count;
    if (fm_plan_make(&self->spec, &p->target, &opts, prec, in_d, out_d, &p->plan, &err) != FM_OK)
        goto fail;
    return (PyObject *)p;
fail:
    Py_DECREF(p);
    return fm_raise_clear(&err);
}

/* A dtype name or None (-1) for gemm_plan's optional operands. */
static int fm_dtype_or_none(PyObject *o, int *d) {
    if (o == Py_None) {
        *d = -1;
        return 0;
    }
    const char *s = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
    fm_dtype v;
    if (s == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "a GEMM operand dtype is a name or None, not %R", o);
        return -1;
    }
    if (fm_dtype_from_str(s, &v) < 0)
        return -1;
    *d = (int)v;
    return 0;
}

static PyObject *Network_gemm_plan(NetworkObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"layer", "arch", "smem_per_block", "sm_count", "a0", "a1", "res", "out", "smem_per_sm",
                             "precision", "bm", "bn", NULL};
    int layer, arch, sm_count, bm = 0, bn = 0, a1, res;
    Py_ssize_t smem, smem_sm = 0;
    const char *a0_s, *out_s, *prec_s = "float16";
    PyObject *a1_o, *res_o;
    if (!Network_ready(self) ||
        !PyArg_ParseTupleAndKeywords(args, kwds, "iinisOOs|$nsii", kwlist, &layer, &arch, &smem, &sm_count, &a0_s,
                                     &a1_o, &res_o, &out_s, &smem_sm, &prec_s, &bm, &bn))
        return NULL;
    fm_dtype a0, out;
    fm_prec prec;
    if (fm_dtype_from_str(a0_s, &a0) < 0 || fm_dtype_from_str(out_s, &out) < 0 || fm_prec_from_str(prec_s, &prec) < 0 ||
        fm_dtype_or_none(a1_o, &a1) < 0 || fm_dtype_or_none(res_o, &res) < 0)
        return NULL;
    PlanObject *p = PyObject_New(PlanObject, &PlanType);
    if (p == NULL)
        return NULL;
    Py_INCREF(self);
    p->net = self;
    fm_error err = {0};
    if (fm_target_for_arch(arch, &p->target, &err) != FM_OK)
        goto fail;
    if (smem > 0)
        p->target.smem_per_block = (size_t)smem;
    if (smem_sm > 0)
        p->target.smem_per_sm = (size_t)smem_sm;
    p->target.sm_count = sm_count;
    if (fm_plan_gemm(&self->spec, layer, &p->target, prec, a0, a1, res, out, bm, bn, &p->plan, &err) != FM_OK)
        goto fail;
    return (PyObject *)p;
fail:
    Py_DECREF(p);
    return fm_raise_clear(&err);
}

static void Plan_dealloc(PlanObject *self) {
    Py_XDECREF(self->net);
    PyObject_Free(self);
}

static PyObject *Plan_render(PlanObject *self, PyObject *args) {
    const char *prelude, *tmpl, *name;
    if (!PyArg_ParseTuple(args, "sss", &prelude, &tmpl, &name))
        return NULL;
    fm_error err = {0};
    fm_str out = {0};
    if (fm_render(&self->net->spec, &self->plan, prelude, tmpl, name, &out, &err) != FM_OK) {
        fm_str_free(&out);
        return fm_raise_clear(&err);
    }
    PyObject *res = PyUnicode_FromStringAndSize(out.data, (Py_ssize_t)out.len);
    fm_str_free(&out);
    return res;
}

static PyObject *Plan_get_info(PlanObject *self, void *closure) {
    (void)closure;
    const fm_plan *p = &self->plan;
    PyObject *info = Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:n,s:i,s:s,s:s,s:s}", "arch", p->arch, "wgmma",
                         p->wgmma, "cluster", p->cluster, "kpipe", p->kpipe,
                         "warps", p->warps,
                         "m_tiles", p->m_tiles, "rows_per_cta", p->rows_per_cta, "resident", p->resident, "buffers",
                         p->buffers, "blocks_per_sm", p->blocks_per_sm, "smem_bytes", (Py_ssize_t)p->smem_bytes,
                         "threads", p->warps * 32, "in_dtype", fm_dtype_name(p->in_dtype), "out_dtype",
                         fm_dtype_name(p->out_dtype), "precision", fm_prec_name(p->prec));
    if (info != NULL && p->gemm) {
        PyObject *g = Py_BuildValue("{s:i,s:i,s:i,s:i,s:i}", "gemm", 1, "gemm_layer", p->gemm_layer, "bm", p->gemm_bm,
                                    "bn", p->gemm_bn, "stages", p->gemm_stages);
        if (g == NULL || PyDict_Update(info, g) < 0) {
            Py_XDECREF(g);
            Py_DECREF(info);
            return NULL;
        }
        Py_DECREF(g);
    }
    return info;
}

static PyObject *Plan_load(PlanObject *self, PyObject *args);

static PyMethodDef Plan_methods[] = {
    {"render", (PyCFunction)Plan_render, METH_VARARGS, "render(prelude, template, kernel_name) -> CUDA source"},
    {"load", (PyCFunction)Plan_load, METH_VARARGS, "load(gpu, cubin, kernel_name) -> Kernel"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Plan_getset[] = {
    {"info", (getter)Plan_get_info, NULL, "dict describing the chosen tiles and budget", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fusedmlp._core.Plan",
    .tp_basicsize = sizeof(PlanObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A kernel plan for one network, target and dtype pair (made by Network.plan).",
    .tp_dealloc = (destructor)Plan_dealloc,
    .tp_methods = Plan_methods,
    .tp_getset = Plan_getset,
};

/* ------------------------------------------------------------------------------------------------ Kernel */

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

static PyTypeObject KernelType;

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

/* Uploads the packed weights and loads the module; runs with the GIL released. */
static fm_status Kernel_setup(KernelObject *self, const void *cubin, const char *name, fm_error *err) {
    const fm_plan *p = &self->plan->plan;
    const NetworkObject *net = self->plan->net;
    fm_status st = fm_gpu_activate(&self->gpu->gpu, err);
    if (st != FM_OK)
        return st;
    if ((st = fm_kernel_load(&self->gpu->gpu, cubin, name, p->smem_bytes, p->warps * 32, &self->k, err)) != FM_OK)
        return st;
    self->loaded = 1;
    if (p->cluster > 1 && (st = fm_kernel_cluster_occupancy(&self->k, p->cluster, err)) != FM_OK)
        return st;
    size_t w_bytes = p->w_elems * (size_t)p->elem_bytes;
    void *wh = malloc(w_bytes);
    float *bf = malloc((p->b_floats ? p->b_floats : 4) * sizeof *bf);
    if (wh == NULL || bf == NULL)
        st = fm_fail(err, FM_ERR_NOMEM, "out of host memory packing %zu weights", p->w_elems);
    if (st == FM_OK) {
        fm_plan_pack(p, (const float *const *)net->w, (const float *const *)net->b, wh, bf);
        st = fm_mem_alloc(&self->w, w_bytes, err);
    }
    if (st == FM_OK)
        st = fm_mem_alloc(&self->b, (p->b_floats ? p->b_floats : 4) * 4, err);
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

static PyObject *Plan_load(PlanObject *self, PyObject *args) {
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
    return (PyObject *)k;
}

static void Kernel_dealloc(KernelObject *self) {
    Kernel_free_device(self);
    if (self->lock)
        PyThread_free_lock(self->lock);
    Py_XDECREF(self->plan);
    Py_XDECREF(self->gpu);
    PyObject_Free(self);
}

static unsigned Kernel_grid(const KernelObject *self, int64_t rows) {
    const fm_plan *p = &self->plan->plan;
    if (p->gemm) /* one CTA per tile of y, column tiles fastest (gemm_layer.cu) */
        return (unsigned)((rows + p->gemm_bm - 1) / p->gemm_bm * (p->n_pad[p->gemm_layer] / p->gemm_bn));
    /* A cluster plan's CTAs come in clusters of p->cluster, all of one cluster on the same row tile; as many clusters
     * as can run at once (the GPCs' SM counts decide, not the SM count alone). */
    int64_t cl = p->cluster > 1 ? p->cluster : 1;
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

/* Makes the context current, sizes the staging buffers for rows and copies the host input x into them (on the
 * legacy default stream); *y_bytes receives the output's size. Called with the kernel lock held. */
static fm_status Kernel_stage(KernelObject *self, const void *x, int64_t rows, size_t *y_bytes, fm_error *err) {
    const fm_plan *p = &self->plan->plan;
    size_t x_bytes = (size_t)rows * (size_t)p->k_real[0] * fm_dtype_size(p->in_dtype);
    if (p->gemm) /* one buffer wide enough for any of the GEMM's operands in float32 (time(): x, x1 and res) */
        x_bytes = (size_t)rows * 4 *
                  (size_t)(p->k_real[p->gemm_layer] > p->n_real[p->gemm_layer] ? p->k_real[p->gemm_layer]
                                                                                  : p->n_real[p->gemm_layer]);
    *y_bytes = (size_t)rows * (size_t)p->n_real[p->num_layers - 1] * fm_dtype_size(p->out_dtype);
    fm_status st = fm_gpu_activate(&self->gpu->gpu, err);
    if (st == FM_OK)
        st = Kernel_reserve(&self->x_buf, &self->x_cap, x_bytes, err);
    if (st == FM_OK)
        st = Kernel_reserve(&self->y_buf, &self->y_cap, *y_bytes, err);
    if (st == FM_OK)
        st = fm_memcpy_htod(self->x_buf, x, x_bytes, NULL, err);
    return st;
}

static fm_status Kernel_run_locked(KernelObject *self, const void *x, void *y, int64_t rows, int poison,
                                   fm_error *err) {
    size_t y_bytes = 0;
    fm_status st = Kernel_stage(self, x, rows, &y_bytes, err);
    if (st == FM_OK && poison) /* 0xFF.. is NaN in float16 and float32: an unwritten element cannot pass */
        st = fm_memset_d8(self->y_buf, 0xFF, y_bytes, NULL, err);
    if (st == FM_OK) {
        long long n = (long long)rows;
        void *params[] = {&self->x_buf, &self->y_buf, &self->w, &self->b, &n, &self->x_buf, &self->x_buf};
        st = fm_kernel_launch(&self->k, Kernel_grid(self, rows), NULL, params, err);
    }
    if (st == FM_OK)
        st = fm_memcpy_dtoh(y, self->y_buf, y_bytes, NULL, err);
    if (st == FM_OK)
        st = fm_stream_sync(NULL, err);
    return st;
}

/* run(x, poison=False) -> y: x a C-contiguous array of the plan's input dtype with >= 1 row. */
static PyObject *Kernel_run(KernelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"x", "poison", NULL};
    PyObject *xobj;
    int poison = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|p", kwlist, &xobj, &poison))
        return NULL;
    const fm_plan *p = &self->plan->plan;
    int in_type = fm_npy_type(p->in_dtype), out_type = fm_npy_type(p->out_dtype);
    PyArrayObject *x = fm_array(xobj, in_type, 2, "x");
    if (x == NULL)
        return NULL;
    if (PyArray_DIM(x, 1) != p->k_real[0] || PyArray_DIM(x, 0) < 1) {
        PyErr_Format(PyExc_ValueError, "x has shape (%zd, %zd); the kernel takes (rows >= 1, %d)",
                     (Py_ssize_t)PyArray_DIM(x, 0), (Py_ssize_t)PyArray_DIM(x, 1), p->k_real[0]);
        Py_DECREF(x);
        return NULL;
    }
    npy_intp dims[2] = {PyArray_DIM(x, 0), p->n_real[p->num_layers - 1]};
    PyArrayObject *y = (PyArrayObject *)PyArray_SimpleNew(2, dims, out_type);
    if (y == NULL) {
        Py_DECREF(x);
        return NULL;
    }
    fm_error err = {0};
    fm_status st;
    Py_BEGIN_ALLOW_THREADS PyThread_acquire_lock(self->lock, WAIT_LOCK);
    st = Kernel_run_locked(self, PyArray_DATA(x), PyArray_DATA(y), dims[0], poison, &err);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS Py_DECREF(x);
    if (st != FM_OK) {
        Py_DECREF(y);
        return fm_raise_clear(&err);
    }
    return (PyObject *)y;
}

/* launch(x_ptr, y_ptr, rows, stream=0, x1_ptr=0, res_ptr=0): device pointers (16-byte aligned, C-contiguous),
 * asynchronous; x1 and res are a GEMM plan's concat part and residual operand (unused by the fused kernels). */
static PyObject *Kernel_launch(KernelObject *self, PyObject *args) {
    unsigned long long xp, yp, stream = 0, x1p = 0, resp = 0;
    long long rows;
    if (!PyArg_ParseTuple(args, "KKL|KKK", &xp, &yp, &rows, &stream, &x1p, &resp))
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
    fm_devptr x = xp, y = yp, x1 = x1p, res = resp;
    Py_BEGIN_ALLOW_THREADS st = fm_gpu_activate(&self->gpu->gpu, &err);
    if (st == FM_OK) {
        void *params[] = {&x, &y, &self->w, &self->b, &rows, &x1, &res};
        st = fm_kernel_launch(&self->k, Kernel_grid(self, rows), (fm_stream)(uintptr_t)stream, params, &err);
    }
    Py_END_ALLOW_THREADS if (st != FM_OK) return fm_raise_clear(&err);
    Py_RETURN_NONE;
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
    size_t x_count = (size_t)rows * (size_t)p->k_real[0], y_bytes = 0;
    void *host = malloc(x_count ? x_count * fm_dtype_size(p->in_dtype) : 1);
    if (host == NULL)
        return fm_fail(err, FM_ERR_NOMEM, "out of host memory for a %zu-value tuning input", x_count);
    Kernel_fill_random(host, x_count, p->in_dtype);
    fm_status st = Kernel_stage(self, host, rows, &y_bytes, err);
    if (st == FM_OK) /* the copy reads host asynchronously: finish it before host can be freed on any path */
        st = fm_stream_sync(NULL, err);
    long long n = (long long)rows;
    /* (a GEMM's two more operands, its concat part and residual, read the input buffer) */
    void *params[] = {&self->x_buf, &self->y_buf, &self->w, &self->b, &n, &self->x_buf, &self->x_buf};
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
     "run(x, poison=False) -> y: copy x in, launch, copy y out (synchronous)."},
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

static PyTypeObject KernelType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fusedmlp._core.Kernel",
    .tp_basicsize = sizeof(KernelObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A loaded fused-MLP kernel with its weights on the device (made by Plan.load).",
    .tp_dealloc = (destructor)Kernel_dealloc,
    .tp_methods = Kernel_methods,
    .tp_getset = Kernel_getset,
};

/* ------------------------------------------------------------------------------------------------ Buffer */

/* Device memory owned by a Python object: a segmented network's workspace and its host-array staging
 * (python/fusedmlp/_segments.py). Copies are synchronous, on the legacy default stream. */
typedef struct {
    PyObject_HEAD GpuObject *gpu;
    fm_devptr ptr;
    size_t bytes;
} BufferObject;

static int Buffer_init(BufferObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"gpu", "nbytes", NULL};
    GpuObject *gpu;
    Py_ssize_t bytes;
    if (self->gpu != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Buffer is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!n", kwlist, &GpuType, &gpu, &bytes))
        return -1;
    if (!gpu->open || bytes < 1) {
        PyErr_Format(PyExc_ValueError, "Buffer needs an open Gpu and nbytes >= 1 (got %zd)", bytes);
        return -1;
    }
    fm_error err = {0};
    fm_status st;
    fm_devptr ptr = 0;
    Py_BEGIN_ALLOW_THREADS st = fm_gpu_activate(&gpu->gpu, &err);
    if (st == FM_OK)
        st = fm_mem_alloc(&ptr, (size_t)bytes, &err);
    Py_END_ALLOW_THREADS if (st != FM_OK) {
        fm_raise_clear(&err);
        return -1;
    }
    Py_INCREF(gpu);
    self->gpu = gpu;
    self->ptr = ptr;
    self->bytes = (size_t)bytes;
    return 0;
}

static void Buffer_dealloc(BufferObject *self) {
    if (self->gpu != NULL && self->gpu->open) {
        fm_error err = {0};
        fm_gpu_activate(&self->gpu->gpu, &err); /* teardown: failures (driver already shut down) are ignored */
        fm_error_clear(&err);
        fm_mem_free(self->ptr);
    }
    Py_XDECREF(self->gpu);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The C-contiguous array `o` (writable for reads) if it fits the buffer, else NULL with the exception set. */
static PyArrayObject *Buffer_array(BufferObject *self, PyObject *o, int writable) {
    if (self->gpu == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Buffer is not initialised");
        return NULL;
    }
    if (!PyArray_Check(o) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o) ||
        (writable && !PyArray_ISWRITEABLE((PyArrayObject *)o))) {
        PyErr_SetString(PyExc_ValueError, "a Buffer copies C-contiguous NumPy arrays (writable ones for read)");
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)o;
    if ((size_t)PyArray_NBYTES(a) > self->bytes) {
        PyErr_Format(PyExc_ValueError, "the array has %zd bytes; the Buffer holds %zu", (Py_ssize_t)PyArray_NBYTES(a),
                     self->bytes);
        return NULL;
    }
    return a;
}

/* Copies between the buffer's first bytes and a host array (to_device: host -> device), then synchronises. */
static PyObject *Buffer_copy(BufferObject *self, PyObject *o, int to_device) {
    PyArrayObject *a = Buffer_array(self, o, !to_device);
    if (a == NULL)
        return NULL;
    fm_error err = {0};
    fm_status st;
    size_t n = (size_t)PyArray_NBYTES(a);
    void *host = PyArray_DATA(a);
    Py_BEGIN_ALLOW_THREADS st = fm_gpu_activate(&self->gpu->gpu, &err);
    if (st == FM_OK && n > 0)
        st = to_device ? fm_memcpy_htod(self->ptr, host, n, NULL, &err) : fm_memcpy_dtoh(host, self->ptr, n, NULL, &err);
    if (st == FM_OK)
        st = fm_stream_sync(NULL, &err);
    Py_END_ALLOW_THREADS if (st != FM_OK) return fm_raise_clear(&err);
    Py_RETURN_NONE;
}

static PyObject *Buffer_write(BufferObject *self, PyObject *o) { return Buffer_copy(self, o, 1); }
static PyObject *Buffer_read(BufferObject *self, PyObject *o) { return Buffer_copy(self, o, 0); }

static PyObject *Buffer_fill(BufferObject *self, PyObject *arg) {
    long byte = PyLong_AsLong(arg);
    if (byte == -1 && PyErr_Occurred())
        return NULL;
    if (self->gpu == NULL || byte < 0 || byte > 255) {
        PyErr_Format(PyExc_ValueError, "fill takes a byte value 0..255 on an initialised Buffer (got %ld)", byte);
        return NULL;
    }
    fm_error err = {0};
    fm_status st;
    Py_BEGIN_ALLOW_THREADS st = fm_gpu_activate(&self->gpu->gpu, &err);
    if (st == FM_OK)
        st = fm_memset_d8(self->ptr, (unsigned char)byte, self->bytes, NULL, &err);
    if (st == FM_OK)
        st = fm_stream_sync(NULL, &err);
    Py_END_ALLOW_THREADS if (st != FM_OK) return fm_raise_clear(&err);
    Py_RETURN_NONE;
}

static PyObject *Buffer_get_ptr(BufferObject *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong((unsigned long long)self->ptr);
}

static PyObject *Buffer_get_nbytes(BufferObject *self, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(self->bytes);
}

static PyMethodDef Buffer_methods[] = {
    {"write", (PyCFunction)Buffer_write, METH_O, "write(array): host -> device into the first bytes, synchronous."},
    {"read", (PyCFunction)Buffer_read, METH_O, "read(array): device -> host from the first bytes, synchronous."},
    {"fill", (PyCFunction)Buffer_fill, METH_O, "fill(byte): every byte set (0xFF poisons float16 and float32)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Buffer_getset[] = {
    {"ptr", (getter)Buffer_get_ptr, NULL, "device address", NULL},
    {"nbytes", (getter)Buffer_get_nbytes, NULL, "size in bytes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fusedmlp._core.Buffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Buffer(gpu, nbytes): device memory freed with the object.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Buffer_init,
    .tp_dealloc = (destructor)Buffer_dealloc,
    .tp_methods = Buffer_methods,
    .tp_getset = Buffer_getset,
};

/* ------------------------------------------------------------------------------------------------ module */

static PyMethodDef module_methods[] = {
    {"parse_expr", py_parse_expr, METH_O, "parse_expr(text) -> (canonical, cuda): checks an activation expression."},
    {"eval_expr", py_eval_expr, METH_VARARGS, "eval_expr(text, x: float64 1-D array) -> array (CPU, float64)."},
    {"expr_range", py_expr_range, METH_VARARGS,
     "expr_range(text, lo, hi) -> (lo, hi, trig): an enclosure of the values over [lo, hi], a bound on sin/cos args."},
    {"expr_functions", py_expr_functions, METH_NOARGS, "expr_functions() -> list of whitelisted function names."},
    {"nvrtc_load", py_nvrtc_load, METH_O, "nvrtc_load(search_path or None) -> (library path, (major, minor))."},
    {"nvrtc_compile", py_nvrtc_compile, METH_VARARGS,
     "nvrtc_compile(source, name, arch, arch_a, options: tuple) -> (cubin, log)."},
    {"cuda_device_count", py_cuda_device_count, METH_NOARGS, "cuda_device_count() -> int (raises without a driver)."},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *m) {
    if (PyArray_ImportNumPyAPI() < 0)
        return -1;
    PyTypeObject *types[] = {&GpuType, &NetworkType, &PlanType, &KernelType, &BufferType};
    const char *names[] = {"Gpu", "Network", "Plan", "Kernel", "Buffer"};
    for (size_t i = 0; i < sizeof types / sizeof *types; ++i) {
        if (PyType_Ready(types[i]) < 0)
            return -1;
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            return -1;
        }
    }
    return PyModule_AddIntConstant(m, "MAX_FUSED_WIDTH", FM_MAX_FUSED_WIDTH) < 0 ||
                   PyModule_AddIntConstant(m, "MAX_LAYERS", FM_MAX_LAYERS) < 0
               ? -1
               : 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, (void *)module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, .m_name = "fusedmlp._core", .m_doc = "fusedmlp's C core.", .m_size = 0,
    .m_methods = module_methods, .m_slots = module_slots,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&module_def); }
