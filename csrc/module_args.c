/* module_args.c - the binding's boundary checks: an fm_error becomes its fusedmlp.errors exception, and arguments
 * (dtype names, arrays, text) are checked and converted before the core sees them. */
#include "module_internal.h"

#include <string.h>

/* ------------------------------------------------------------------------------------------------ errors */

/* Raises the fusedmlp.errors class for err's status. The classes are looked up when an error happens (not cached
 * in globals): errors are rare, and this keeps the module free of state. */
PyObject *fm_raise(const fm_error *err) {
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

PyObject *fm_raise_clear(fm_error *err) {
    fm_raise(err);
    fm_error_clear(err);
    return NULL;
}

/* ------------------------------------------------------------------------------------------------ arguments */

int fm_dtype_from_str(const char *s, fm_dtype *d) {
    for (int i = FM_F32; i <= FM_CODES; ++i)
        if (strcmp(s, fm_dtype_name((fm_dtype)i)) == 0) {
            *d = (fm_dtype)i;
            return 0;
        }
    PyErr_Format(PyExc_ValueError, "dtype '%s' is not one of float32, float16, bfloat16 (or codes, an 8-bit network's "
                 "values between its GEMMs)", s);
    return -1;
}

int fm_prec_from_str(const char *s, fm_prec *p) {
    for (int i = FM_PREC_F16; i <= FM_PREC_E4M3; ++i)
        if (strcmp(s, fm_prec_name((fm_prec)i)) == 0) {
            *p = (fm_prec)i;
            return 0;
        }
    PyErr_Format(PyExc_ValueError, "precision '%s' is not one of float16, bfloat16, tf32, int8, float8", s);
    return -1;
}

/* NumPy type of a kernel's x or y: bfloat16 travels as its uint16 bits (NumPy has no bfloat16 of its own). */
int fm_npy_type(fm_dtype d) { return d == FM_F32 ? NPY_FLOAT32 : d == FM_F16 ? NPY_FLOAT16 : NPY_UINT16; }

/* Returns a new reference to `obj` as an aligned C-contiguous array of `type` with `ndim` dimensions; no casting:
 * the Python layer converts, this only guards the boundary. */
PyArrayObject *fm_array(PyObject *obj, int type, int ndim, const char *what) {
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
const char *fm_text(PyObject *obj, const char *what) {
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

/* A dtype name or None (-1) for gemm_plan's optional operands. */
int fm_dtype_or_none(PyObject *o, int *d) {
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
