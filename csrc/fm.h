/*
 * fm.h - the whole boundary of the fusedmlp C core.
 *
 * Stages, one file each: spec (validate the MLP) -> expr (custom activations) -> plan (padding, tiles, shared
 * memory budget) -> render (template -> CUDA source) -> nvrtc (source -> CUBIN) -> cuda (load, launch) and
 * ref (the CPU forward). Only module.c includes Python.h. The core never prints, exits or aborts: every fallible
 * function returns an fm_status and fills an fm_error.
 */
#ifndef FM_H
#define FM_H

#include <stddef.h>
#include <stdint.h>

#define FM_MAX_LAYERS 64     /* layers per network; a deeper MLP is a spec error */
#define FM_MAX_FUSED_WIDTH 256 /* widest layer one fused kernel holds on chip (the plan checks shared memory too) */

/* ------------------------------------------------------------------------------------------------ errors */

typedef enum fm_status {
    FM_OK = 0,
    FM_ERR_VALUE,    /* a bad argument value (activation name, option) */
    FM_ERR_SHAPE,    /* shapes that do not chain, wrong ranks */
    FM_ERR_EXPR,     /* an activation expression that does not parse; fm_error.column says where */
    FM_ERR_LIMIT,    /* valid, but beyond what the fused kernel holds (width, shared memory) */
    FM_ERR_NOMEM,    /* host allocation failed */
    FM_ERR_LIBRARY,  /* libcuda.so.1 or NVRTC missing or lacking a symbol */
    FM_ERR_COMPILE,  /* NVRTC rejected the generated source; fm_error.log holds its log */
    FM_ERR_CUDA,     /* a driver call failed; fm_error.code is the CUresult, fm_error.message has its name */
    FM_ERR_TEMPLATE, /* a kernel template with an unknown or unused placeholder */
    FM_ERR_INTERNAL
} fm_status;

const char *fm_status_to_string(fm_status st);

typedef struct fm_error {
    fm_status status;  /* FM_OK while nothing failed */
    int code;          /* CUresult or nvrtcResult that failed, else 0 */
    int column;        /* 1-based column of an expression error, else 0 */
    char message[1024];/* what failed: the field, the value and the rule */
    char hint[512];    /* what to do about it, may be empty */
    char *log;         /* NVRTC log (heap, owned; fm_error_clear frees it), or NULL */
} fm_error;

/* Fills err (status, printf-style message) and returns st, so callers can write `return fm_fail(err, ...)`.
 * A second failure does not overwrite the first: the root cause is what the user needs. */
fm_status fm_fail(fm_error *err, fm_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
void fm_error_hint(fm_error *err, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void fm_error_clear(fm_error *err);

/* ------------------------------------------------------------------------------------------------ strings */

/* A growable NUL-terminated string; starts zeroed ({0}), freed with fm_str_free. */
typedef struct fm_str {
    char *data;  /* NUL-terminated text, or NULL while empty */
    size_t len;  /* bytes before the NUL */
    size_t cap;  /* bytes allocated */
    int oom;     /* set once an append failed to allocate; later appends are no-ops */
} fm_str;

void fm_str_append(fm_str *s, const char *text);
void fm_str_appendn(fm_str *s, const char *text, size_t n);
void fm_str_printf(fm_str *s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void fm_str_free(fm_str *s);

/* IEEE binary16 bits of f, rounded to nearest even (overflow -> inf, NaN stays NaN), and back. */
uint16_t fm_float_to_half(float f);
float fm_half_to_float(uint16_t h);

/* ------------------------------------------------------------------------------------------------ expr */

/* A parsed, checked activation expression over the variable x. Grammar (precedence low to high):
 *   expr   := term (('+' | '-') term)*
 *   term   := unary (('*' | '/') unary)*
 *   unary  := ('-' | '+') unary | power
 *   power  := atom ('^' unary)?            (right-associative, binds tighter than unary minus on its left)
 *   atom   := number | 'x' | 'pi' | 'e' | name '(' expr (',' expr)* ')' | '(' expr ')'
 * A bare function name ("relu", "tanh") means name(x). Names come from a fixed whitelist (fm_expr_functions). */
typedef struct fm_expr fm_expr;

fm_status fm_expr_parse(const char *text, fm_expr **out, fm_error *err);
void fm_expr_free(fm_expr *e);
/* Appends a float32 CUDA/C expression computing e from the float variable `var`; it calls only the fm_* device
 * helpers that kernel_templates/activations.cuh defines and CUDA math functions. */
fm_status fm_expr_emit_cuda(const fm_expr *e, const char *var, fm_str *out, fm_error *err);
/* Appends a canonical, fully parenthesised text of e (for repr and cache keys). */
void fm_expr_to_string(const fm_expr *e, fm_str *out);
/* Evaluates e in double precision on n values; in and out may alias. Returns FM_ERR_NOMEM only. */
fm_status fm_expr_eval(const fm_expr *e, const double *in, double *out, size_t n, fm_error *err);
/* Whitelisted function names, NULL-terminated (for error messages and docs). */
const char *const *fm_expr_functions(void);

/* ------------------------------------------------------------------------------------------------ spec */

typedef enum fm_dtype { FM_F32 = 0, FM_F16 = 1, FM_BF16 = 2 } fm_dtype;
const char *fm_dtype_name(fm_dtype d);
size_t fm_dtype_size(fm_dtype d);

/* A validated MLP: layer l maps width[l] features to width[l + 1]. */
typedef struct fm_spec {
    int num_layers;                   /* 1..FM_MAX_LAYERS */
    int width[FM_MAX_LAYERS + 1];     /* real (unpadded) feature counts, all >= 1 */
    int has_bias[FM_MAX_LAYERS];      /* 1 when layer l adds a bias */
    fm_expr *act[FM_MAX_LAYERS];      /* activation applied after layer l (owned) */
    /* Residual epilogue of layer l (CUTLASS's LinearCombinationResidualBlock): y = post(op(act(W x + b), r)) with r
     * the layer's own input (width[l] == width[l + 1]). res_op: FM_RES_NONE, FM_RES_ADD or FM_RES_MUL. */
    int res_op[FM_MAX_LAYERS];
    fm_expr *res_post[FM_MAX_LAYERS]; /* the unary after the binary op (owned; NULL when res_op is FM_RES_NONE) */
} fm_spec;

enum { FM_RES_NONE = 0, FM_RES_ADD = 1, FM_RES_MUL = 2 };

/* Checks that weight shapes chain and parses every activation; shapes[2*l] = out_l, shapes[2*l+1] = in_l
 * (PyTorch's nn.Linear.weight layout), bias_len[l] = -1 for no bias. On failure nothing needs freeing. */
fm_status fm_spec_init(fm_spec *spec, int num_layers, const int64_t *shapes, const int64_t *bias_len,
                       const char *const *activations, fm_error *err);
void fm_spec_free(fm_spec *spec);
/* Gives layer l a residual epilogue: op FM_RES_ADD or FM_RES_MUL with the layer's own input, then post (an activation
 * text; NULL or "none" for identity). The layer's input and output widths must be equal. */
fm_status fm_spec_set_residual(fm_spec *spec, int layer, int op, const char *post, fm_error *err);

/* ------------------------------------------------------------------------------------------------ plan */

/* What the plan needs to know of the target GPU. For ahead-of-time compiles, fm_target_for_arch fills it from a
 * table of the published per-architecture limits. */
typedef struct fm_target {
    int arch;                 /* compute capability as 10*major+minor, e.g. 90 */
    int sm_count;             /* multiprocessors (0 when unknown: ahead-of-time) */
    size_t smem_per_block;    /* largest dynamic shared memory one block may opt into, bytes */
    size_t smem_per_sm;       /* shared memory per multiprocessor, bytes */
} fm_target;

fm_status fm_target_for_arch(int arch, fm_target *t, fm_error *err);

/* Tunable choices; zero fields mean "let the plan choose". */
typedef struct fm_plan_opts {
    int warps;        /* warps per CTA, each owning m_tiles*16 rows */
    int m_tiles;      /* 16-row mma tiles per warp */
    int n_chunk;      /* output columns one warp accumulates at once (multiple of 16) */
    int resident;     /* 1: all weights stay in shared memory; 0: stream per layer; -1: auto */
} fm_plan_opts;

typedef struct fm_plan {
    int num_layers;
    int k_real[FM_MAX_LAYERS], n_real[FM_MAX_LAYERS];   /* real widths of layer l's input and output */
    int k_pad[FM_MAX_LAYERS], n_pad[FM_MAX_LAYERS];     /* padded to multiples of 16 for m16n8k16 */
    int n_chunk[FM_MAX_LAYERS];                         /* columns accumulated at once in layer l */
    int has_bias[FM_MAX_LAYERS];
    int res_op[FM_MAX_LAYERS];       /* the spec's residual op per layer (FM_RES_NONE when absent) */
    size_t w_offset[FM_MAX_LAYERS];  /* layer l's first half in the packed weight blob: n_pad rows of k_pad + 8
                                        halves, the kernel's shared-memory layout, so loading it is a flat copy */
    size_t b_offset[FM_MAX_LAYERS];  /* layer l's first float in the packed bias blob (n_pad floats) */
    size_t w_halves;                 /* total halves in the packed weight blob */
    size_t b_floats;                 /* total floats in the packed bias blob */
    int warps, m_tiles, rows_per_cta; /* rows_per_cta = warps * m_tiles * 16 */
    int resident;                    /* 1 when every layer's weights live in shared memory for the whole kernel */
    int act_stride;                  /* halves per row of a warp's activation buffers */
    int buffers;                     /* activation buffers per warp: 1 (in place) when every layer is one chunk */
    int blocks_per_sm;               /* CTAs the plan expects per SM (the kernel's __launch_bounds__ minimum) */
    size_t w_slot_halves;            /* streamed mode: halves per weight slot (two slots) */
    size_t smem_bytes;               /* dynamic shared memory per CTA */
    fm_dtype in_dtype, out_dtype;    /* global-memory types of x and y */
    int arch;                        /* target compute capability */
} fm_plan;

fm_status fm_plan_make(const fm_spec *spec, const fm_target *target, const fm_plan_opts *opts, fm_dtype in_dtype,
                       fm_dtype out_dtype, fm_plan *plan, fm_error *err);

/* Packs PyTorch-layout float32 weights (w[l]: n_real x k_real, row-major) and biases (b[l] or NULL) into the
 * zero-padded fp16 blob (plan->w_halves) and float blob (plan->b_floats) that the kernel reads. */
void fm_plan_pack(const fm_plan *plan, const float *const *w, const float *const *b, uint16_t *w_blob, float *b_blob);

/* ------------------------------------------------------------------------------------------------ render */

/* Renders the fused-MLP template for spec+plan into CUDA source. The template's {{NAME}} placeholders must be
 * exactly the set the renderer provides: an unknown or unused one is FM_ERR_TEMPLATE. prelude is pasted first. */
fm_status fm_render(const fm_spec *spec, const fm_plan *plan, const char *prelude, const char *tmpl,
                    const char *kernel_name, fm_str *out, fm_error *err);

/* ------------------------------------------------------------------------------------------------ nvrtc */

/* Loads NVRTC once (search order in DESIGN.md; `path_hint` from FUSEDMLP_NVRTC may be NULL). Thread-safe. */
fm_status fm_nvrtc_load(const char *path_hint, fm_error *err);
fm_status fm_nvrtc_version(int *major, int *minor, fm_error *err);
const char *fm_nvrtc_library_path(void);  /* the file NVRTC was loaded from, or NULL */
/* Compiles source to a CUBIN for sm_<arch> (arch 90 with arch_a=1 targets sm_90a). On FM_ERR_COMPILE err->log
 * holds NVRTC's log. *cubin is malloc'd; *log (may be NULL) receives any warnings log, malloc'd. */
fm_status fm_nvrtc_compile(const char *source, const char *name, int arch, int arch_a, const char *const *extra_opts,
                           int num_extra_opts, void **cubin, size_t *cubin_size, char **log, fm_error *err);

/* ------------------------------------------------------------------------------------------------ cuda */

typedef uint64_t fm_devptr;
typedef void *fm_stream; /* CUstream; NULL is the legacy default stream */

/* Loads libcuda.so.1 and calls cuInit once. Thread-safe. FM_ERR_LIBRARY when there is no driver. */
fm_status fm_cuda_load(fm_error *err);
fm_status fm_cuda_device_count(int *count, fm_error *err);

typedef struct fm_gpu {
    int ordinal;               /* device index */
    int device;                /* CUdevice */
    void *ctx;                 /* retained primary context (shared with PyTorch and CuPy) */
    int arch;                  /* 10*major+minor */
    int sm_count;
    size_t smem_per_block_optin;
    size_t smem_per_sm;
    char name[256];
} fm_gpu;

/* Retains device `ordinal`'s primary context and reads its properties. */
fm_status fm_gpu_open(int ordinal, fm_gpu *gpu, fm_error *err);
void fm_gpu_close(fm_gpu *gpu);
/* Makes the GPU's primary context current on the calling thread (push semantics are not needed: primary). */
fm_status fm_gpu_activate(const fm_gpu *gpu, fm_error *err);

typedef struct fm_kernel {
    void *module;     /* CUmodule */
    void *function;   /* CUfunction */
    size_t smem_bytes;
    int threads;
    int blocks_per_sm; /* occupancy at smem_bytes */
} fm_kernel;

/* Loads a CUBIN, finds `name`, raises its dynamic shared-memory limit to smem_bytes and reads its occupancy. */
fm_status fm_kernel_load(const fm_gpu *gpu, const void *cubin, const char *name, size_t smem_bytes, int threads,
                         fm_kernel *k, fm_error *err);
void fm_kernel_unload(fm_kernel *k);
/* Launches k with a 1-D grid; params as for cuLaunchKernel. */
fm_status fm_kernel_launch(const fm_kernel *k, unsigned grid, fm_stream stream, void **params, fm_error *err);
/* Times `launches` back-to-back launches between two events on stream (synchronises); *ms is per launch. */
fm_status fm_kernel_time(const fm_kernel *k, unsigned grid, fm_stream stream, void **params, int launches, float *ms,
                         fm_error *err);

fm_status fm_mem_alloc(fm_devptr *p, size_t bytes, fm_error *err);
void fm_mem_free(fm_devptr p);
fm_status fm_memcpy_htod(fm_devptr dst, const void *src, size_t bytes, fm_stream stream, fm_error *err);
fm_status fm_memcpy_dtoh(void *dst, fm_devptr src, size_t bytes, fm_stream stream, fm_error *err);
fm_status fm_memset_d8(fm_devptr dst, unsigned char value, size_t bytes, fm_stream stream, fm_error *err);
fm_status fm_stream_sync(fm_stream stream, fm_error *err);

/* ------------------------------------------------------------------------------------------------ ref */

/* CPU forward with the kernel's semantics: float32 storage, float64 accumulation. x: rows x width[0] with
 * element strides (x_row, x_col) in floats; y: rows x width[L], C order. w[l]/b[l] as in fm_plan_pack.
 * Releases nothing; needs no GPU. */
fm_status fm_ref_forward(const fm_spec *spec, const float *const *w, const float *const *b, const float *x,
                         int64_t rows, int64_t x_row, int64_t x_col, float *y, fm_error *err);

#endif /* FM_H */
