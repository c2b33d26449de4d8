/* module.c - the CPython binding fusedmlp._core: NumPy arrays in, fusedmlp.errors exceptions out. This file holds
 * the module itself (functions table, types registered, init); module_internal.h lists the other binding files, the
 * only ones that include Python.h. */
#define FM_MODULE_IMPORTS_NUMPY
#include "module_internal.h"

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
    {"pipe_layout", py_pipe_layout, METH_VARARGS,
     "pipe_layout(x_row_bytes, y_row_bytes) -> (piece rows, staging slots) of a pipelined host-array call."},
    {"pipe_chain", py_pipe_chain, METH_VARARGS,
     "pipe_chain(gpu, x, y, steps, base, stride, poison): a segmented network on host arrays in pieces."},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *m) {
    if (PyArray_ImportNumPyAPI() < 0)
        return -1;
    PyTypeObject *types[] = {&GpuType, &NetworkType, &PlanType, &KernelType, &BufferType, &FastPathType};
    const char *names[] = {"Gpu", "Network", "Plan", "Kernel", "Buffer", "FastPath"};
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
                   PyModule_AddIntConstant(m, "MAX_ONCHIP_WIDTH", FM_MAX_ONCHIP_WIDTH) < 0 ||
                   PyModule_AddIntConstant(m, "MAX_LAYERS", FM_MAX_LAYERS) < 0 ||
                   PyModule_AddIntConstant(m, "ACT_PIECES", FM_ACT_PIECES) < 0 ||
                   PyModule_AddIntConstant(m, "PIPE_MIN_BYTES", (long)fm_pipe_min_bytes()) < 0
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
