/* module_pipe.c - large host-array calls in pieces from Python (host_pipe.c): the layout of a piece, and a
 * segmented network's chain run over the pieces with a workspace per staging slot (Chain._run_pieces). A fused
 * kernel's pieces are Kernel.run's (module_launch.c). */
#include "module_internal.h"

#include <stdlib.h>

/* A segmented network's pieces through the device's staging (host_pipe.c): the chain's steps on every piece, each
 * staging slot with a workspace of its own at base + slot * stride (one piece at a time uses a slot). */
typedef struct {
    const FastStep *steps;
    int n;
    fm_devptr base;
    size_t stride;
} PipeChain;

static fm_status pipe_chain_launch(void *ctx, int slot, fm_devptr x, fm_devptr y, int64_t rows, fm_stream stream,
                                   fm_error *err) {
    const PipeChain *c = ctx;
    return chain_steps_launch(c->steps, c->n, x, y, c->base + (fm_devptr)slot * c->stride, rows, stream, NULL, err);
}

/* pipe_layout(x_row_bytes, y_row_bytes) -> (piece rows, staging slots): what a pipelined run of such rows uses. */
PyObject *py_pipe_layout(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t x_row, y_row;
    if (!PyArg_ParseTuple(args, "nn", &x_row, &y_row))
        return NULL;
    if (x_row < 0 || y_row < 0 || x_row + y_row < 1 || x_row + y_row > FM_PIPE_SLOT_BYTES / 2) {
        PyErr_Format(PyExc_ValueError, "pipe_layout: rows of %zd + %zd bytes; a row takes 1 to %d bytes", x_row, y_row,
                     FM_PIPE_SLOT_BYTES / 2);
        return NULL;
    }
    return Py_BuildValue("(Li)", (long long)fm_pipe_piece_rows((size_t)x_row, (size_t)y_row),
                         FM_PIPE_WORKERS * FM_PIPE_SLOTS);
}

/* pipe_chain(gpu, x, y, steps, base, stride, poison): y = the chain on x (2-D C-contiguous host arrays, y writable),
 * in pieces (fm_pipe_run); steps as FastPath.add_chain's, offsets into a workspace of pipe_layout's piece rows; slot
 * s's workspace at base + s * stride. Synchronous. */
PyObject *py_pipe_chain(PyObject *self, PyObject *args) {
    (void)self;
    GpuObject *gpu;
    PyArrayObject *x, *y;
    PyObject *steps;
    unsigned long long base;
    Py_ssize_t stride;
    int poison;
    if (!PyArg_ParseTuple(args, "O!O!O!OKnp", &GpuType, &gpu, &PyArray_Type, &x, &PyArray_Type, &y, &steps, &base,
                          &stride, &poison))
        return NULL;
    if (!gpu->open || PyArray_NDIM(x) != 2 || PyArray_NDIM(y) != 2 || !PyArray_IS_C_CONTIGUOUS(x) ||
        !PyArray_IS_C_CONTIGUOUS(y) || !PyArray_ISWRITEABLE(y) || PyArray_DIM(x, 0) != PyArray_DIM(y, 0) ||
        PyArray_DIM(x, 0) < 1 || stride < 0 || base % 256) {
        PyErr_SetString(PyExc_ValueError, "pipe_chain: needs an open Gpu, C-contiguous 2-D x and writable y of the same "
                                          ">= 1 rows, and a 256-byte aligned workspace");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(steps, "pipe_chain: steps must be a sequence");
    if (seq == NULL)
        return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    FastStep *parsed = calloc(n > 0 ? (size_t)n : 1, sizeof *parsed);
    if (parsed == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    int ok = n >= 1;
    for (Py_ssize_t i = 0; ok && i < n; ++i) /* borrowed kernels: seq holds them for the call */
        ok = chain_step_parse(PySequence_Fast_GET_ITEM(seq, i), i, "pipe_chain", &parsed[i]) == 0;
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "pipe_chain: needs at least one step");
        free(parsed);
        Py_DECREF(seq);
        return NULL;
    }
    const size_t x_row = (size_t)PyArray_DIM(x, 1) * (size_t)PyArray_ITEMSIZE(x);
    const size_t y_row = (size_t)PyArray_DIM(y, 1) * (size_t)PyArray_ITEMSIZE(y);
    PipeChain chain = {parsed, (int)n, (fm_devptr)base, (size_t)stride};
    fm_error err = {0};
    fm_status st;
    Py_BEGIN_ALLOW_THREADS st = fm_gpu_activate(&gpu->gpu, &err);
    if (st == FM_OK) {
        PyThread_acquire_lock(gpu->pipe_lock, WAIT_LOCK);
        st = fm_pipe_run(&gpu->pipe, &gpu->gpu, PyArray_DATA(x), PyArray_DATA(y), PyArray_DIM(x, 0), x_row, y_row,
                         poison, pipe_chain_launch, &chain, &err);
        PyThread_release_lock(gpu->pipe_lock);
    }
    Py_END_ALLOW_THREADS free(parsed);
    Py_DECREF(seq);
    if (st != FM_OK)
        return fm_raise_clear(&err);
    Py_RETURN_NONE;
}
