/* module_gpu.c - the device side that is not a kernel: cuda_device_count, the Gpu type (a device's retained primary
 * context and its limits) and the Buffer type (device memory owned by a Python object). */
#include "module_internal.h"

/* ------------------------------------------------------------------------------------------------ Gpu */

PyObject *py_cuda_device_count(PyObject *self, PyObject *noargs) {
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
    if (self->pipe_lock == NULL && (self->pipe_lock = PyThread_allocate_lock()) == NULL) {
        PyErr_NoMemory();
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
    if (self->open) {
        fm_error err = {0};
        fm_gpu_activate(&self->gpu, &err); /* teardown: failures (driver already shut down) are ignored */
        fm_error_clear(&err);
        fm_pipe_free(&self->pipe);
        fm_gpu_close(&self->gpu);
    }
    if (self->pipe_lock != NULL)
        PyThread_free_lock(self->pipe_lock);
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

/* launch_floor(cubin, name, calls=2000) -> (async_us, sync_us): fm_launch_floor (the benchmark's launch floor). */
static PyObject *Gpu_launch_floor(GpuObject *self, PyObject *args) {
    const char *cubin, *name;
    Py_ssize_t cubin_len;
    int calls = 2000;
    if (!PyArg_ParseTuple(args, "y#s|i", &cubin, &cubin_len, &name, &calls))
        return NULL;
    if (!self->open) {
        PyErr_SetString(PyExc_RuntimeError, "Gpu is not initialised");
        return NULL;
    }
    fm_error err = {0};
    fm_status st;
    double async_us = 0.0, sync_us = 0.0;
    Py_BEGIN_ALLOW_THREADS st = fm_launch_floor(&self->gpu, cubin, name, calls, &async_us, &sync_us, &err);
    Py_END_ALLOW_THREADS if (st != FM_OK) return fm_raise_clear(&err);
    return Py_BuildValue("(dd)", async_us, sync_us);
}

static PyMethodDef Gpu_methods[] = {
    {"launch_floor", (PyCFunction)Gpu_launch_floor, METH_VARARGS,
     "launch_floor(cubin, name, calls=2000) -> (async_us, sync_us): host us per launch of an empty kernel."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject GpuType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fusedmlp._core.Gpu",
    .tp_basicsize = sizeof(GpuObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Gpu(ordinal): a CUDA device with its primary context retained.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Gpu_init,
    .tp_dealloc = (destructor)Gpu_dealloc,
    .tp_getset = Gpu_getset,
    .tp_methods = Gpu_methods,
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

PyTypeObject BufferType = {
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
