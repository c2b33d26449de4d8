/* module_compile.c - the module's functions on text: activation expressions (parse, evaluate, range, the function
 * list) and NVRTC (load, compile to CUBIN; the GIL released while it runs). */
#include "module_internal.h"

#include <stdlib.h>

/* ------------------------------------------------------------------------------------------------ expressions */

PyObject *py_parse_expr(PyObject *self, PyObject *arg) {
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
PyObject *py_expr_range(PyObject *self, PyObject *args) {
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

PyObject *py_eval_expr(PyObject *self, PyObject *args) {
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

PyObject *py_expr_functions(PyObject *self, PyObject *noargs) {
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

PyObject *py_nvrtc_load(PyObject *self, PyObject *arg) {
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

PyObject *py_nvrtc_compile(PyObject *self, PyObject *args) {
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
