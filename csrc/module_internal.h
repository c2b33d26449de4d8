/* module_internal.h - what the CPython binding's files (csrc/module*.c) share; not part of the core's interface
 * (fm.h). These files, and no others, include Python.h (through this header):
 *
 *   module.c          the module: its functions table, the types registered, the init (PyInit__core)
 *   module_args.c     fm_error -> fusedmlp.errors exception; checks and conversions of arguments (dtypes, arrays, text)
 *   module_compile.c  the module's functions on expressions (parse, evaluate, range) and NVRTC (load, compile)
 *   module_network.c  Network: a validated spec with its own copy of the weights, and the CPU forward
 *   module_plan.c     Plan: Network.plan / Network.gemm_plan, the source it renders, its info
 *   module_gpu.c      Gpu (a device's retained primary context), cuda_device_count, Buffer (device memory)
 *   module_launch.c   Kernel: Plan.load (CUBIN and weights onto the device), run, launch, time
 *   module_fast.c     FastPath: a model's steady-state CUDA-tensor call in one call into C (DLPack in, torch.empty out)
 *
 * Types: Network (validated spec + float32 weights; the CPU forward), Plan (one fm_plan: renders the source and
 * later fills the launch, so the two cannot drift), Gpu (a device's retained primary context), Kernel (a loaded
 * CUBIN with the weights on the device), Buffer. The GIL is released around compiles, the CPU forward and GPU work. */
#ifndef FM_MODULE_INTERNAL_H
#define FM_MODULE_INTERNAL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
/* One NumPy C-API table for all the binding's files: module.c imports it (module_exec) and defines
 * FM_MODULE_IMPORTS_NUMPY; the other files only refer to it. */
#define PY_ARRAY_UNIQUE_SYMBOL fm_numpy_api
#ifndef FM_MODULE_IMPORTS_NUMPY
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include "fm.h"

/* ------------------------------------------------------------------------------------------------ objects */

typedef struct {
    PyObject_HEAD fm_gpu gpu;
    int open;
    fm_pipe pipe;                 /* staging for large host-array calls (host_pipe.c), made on first use */
    PyThread_type_lock pipe_lock; /* one such call at a time on the device; taken after a kernel's own lock */
} GpuObject;

typedef struct {
    PyObject_HEAD fm_spec spec;
    int has_spec;
    float *w[FM_MAX_LAYERS]; /* owned copies, n x k row-major */
    float *b[FM_MAX_LAYERS]; /* owned copies or NULL */
    /* The Kernels loaded from plans of this network, whose packed weights assign() rewrites in place: borrowed
     * references (a Kernel holds its plan, which holds this network, and removes itself as it goes). */
    PyObject **kernels;
    Py_ssize_t n_kernels, cap_kernels;
} NetworkObject;

typedef struct {
    PyObject_HEAD NetworkObject *net;
    fm_plan plan;
    fm_target target;
} PlanObject;

extern PyTypeObject GpuType, NetworkType, PlanType, KernelType, BufferType, FastPathType;

/* ------------------------------------------------------------------------------------------------ module_args.c */

PyObject *fm_raise(const fm_error *err);
PyObject *fm_raise_clear(fm_error *err);
int fm_dtype_from_str(const char *s, fm_dtype *d);
int fm_prec_from_str(const char *s, fm_prec *p);
int fm_dtype_or_none(PyObject *o, int *d);
int fm_npy_type(fm_dtype d);
PyArrayObject *fm_array(PyObject *obj, int type, int ndim, const char *what);
const char *fm_text(PyObject *obj, const char *what);

/* ------------------------------------------------------------------------------------------------ functions */

/* The module's functions, in module.c's table (module_compile.c, module_gpu.c, module_pipe.c). */

PyObject *py_parse_expr(PyObject *self, PyObject *arg);
PyObject *py_expr_range(PyObject *self, PyObject *args);
PyObject *py_eval_expr(PyObject *self, PyObject *args);
PyObject *py_expr_functions(PyObject *self, PyObject *noargs);
PyObject *py_nvrtc_load(PyObject *self, PyObject *arg);
PyObject *py_nvrtc_compile(PyObject *self, PyObject *args);
PyObject *py_cuda_device_count(PyObject *self, PyObject *noargs);
PyObject *py_pipe_layout(PyObject *self, PyObject *args);
PyObject *py_pipe_chain(PyObject *self, PyObject *args);

/* ------------------------------------------------------------------------------------------------ methods */

/* Methods in a type's table whose body is in another file. */

int Network_ready(NetworkObject *self);                                           /* module_network.c */
int Network_add_kernel(NetworkObject *self, PyObject *kernel);                    /* module_network.c */
void Network_drop_kernel(NetworkObject *self, PyObject *kernel);                  /* module_network.c */
fm_status Kernel_upload(PyObject *kernel, fm_error *err);                         /* module_launch.c */
PyObject *Network_plan(NetworkObject *self, PyObject *args, PyObject *kwds);      /* module_plan.c */
PyObject *Network_gemm_plan(NetworkObject *self, PyObject *args, PyObject *kwds); /* module_plan.c */
PyObject *Plan_load(PlanObject *self, PyObject *args);                            /* module_launch.c */

/* A segmented network's launches (python/fusedmlp/_segments.py, Chain.program), as FastPath.add_chain and
 * pipe_chain take them: each step's operands by code, FAST_X / FAST_Y the call's x and y, FAST_NONE absent, >= 0 a
 * byte offset into a workspace. */
enum { FAST_X = -1, FAST_NONE = -2, FAST_Y = -3 };
typedef struct {
    PyObject *kernel; /* a fusedmlp._core.Kernel: a fused stretch's or a GEMM layer's */
    long long x, y, x1, res;
    int after; /* launched as a dependent of the step before (Kernel.launch's after) */
} FastStep;

/* An operand's address for a call of x, y with the workspace at base. */
static inline fm_devptr fast_operand(long long code, fm_devptr x, fm_devptr y, fm_devptr base) {
    return code == FAST_X ? x : code == FAST_Y ? y : code == FAST_NONE ? 0 : base + (fm_devptr)code;
}

/* module_fast.c: step i of a sequence, (kernel, x, y, x1, res, after), into *st (the kernel borrowed); -1 with a
 * Python error naming `who`, the step and the code where it is not one. */
int chain_step_parse(PyObject *item, Py_ssize_t i, const char *who, FastStep *st);
/* module_fast.c: the n steps launched in order on stream for a call of x, y with the workspace at base (no lock:
 * the caller keeps two sequences of one workspace apart); the first failure stops the rest. Needs no GIL. nodes (or
 * NULL): a stream being captured, where each step that reads x or writes y gets its kernel node (fm_graph_last_node)
 * in nodes[i]. */
fm_status chain_steps_launch(const FastStep *steps, int n, fm_devptr x, fm_devptr y, fm_devptr base, long long rows,
                             fm_stream stream, void **nodes, fm_error *err);

/* module_launch.c, for module_fast.c and module_pipe.c: */
int Kernel_is_gemm(PyObject *kernel);
fm_status Kernel_launch_ptrs(PyObject *kernel, fm_devptr x, fm_devptr y, long long rows, fm_stream stream, fm_devptr x1,
                             fm_devptr res, int after, fm_error *err);
/* The same arguments into kernel node `node` of an instantiated graph (module_fast.c's chain graphs). */
fm_status Kernel_set_node(PyObject *kernel, fm_graph_exec exec, void *node, fm_devptr x, fm_devptr y, long long rows,
                          fm_devptr x1, fm_devptr res, fm_error *err);

#endif /* FM_MODULE_INTERNAL_H */
