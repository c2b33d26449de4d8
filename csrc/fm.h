/*
 * fm.h - the whole boundary of the fusedmlp C core.
 *
 * Stages, one file each: spec (validate the MLP) -> expr (custom activations) -> plan (padding, tiles, shared
 * memory budget) -> render (template -> CUDA source) -> nvrtc (source -> CUBIN) -> cuda (load, launch) and
 * ref (the CPU forward). Only the binding (module*.c) includes Python.h. The core never prints, exits or aborts:
 * every fallible function returns an fm_status and fills an fm_error.
 */
#ifndef FM_H
#define FM_H

#include <stddef.h>
#include <stdint.h>

#define FM_MAX_LAYERS 64     /* layers per network; a deeper MLP is a spec error */
#define FM_ACT_PIECES 8      /* column pieces of one layer's activation (fm_spec.act_pieces) */
#define FM_MAX_FUSED_WIDTH 512 /* widest layer any fused kernel holds (sm_90a's streamed warpgroup form, fm_plan_stream;
                                  the plan checks registers and shared memory too) */
#define FM_MAX_ONCHIP_WIDTH 256 /* widest layer of every other fused form: the mma.sync kernel, the warpgroup kernel's
                                   resident and cluster forms */

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
/* When e is one whitelisted function of x alone ("relu" for relu(x)): its name; "" for x itself (none, identity);
 * NULL for anything else. The renderer gives such activations a two-column form. */
const char *fm_expr_unary(const fm_expr *e);
/* The kernels' two-column form of activation e where it has one (x itself: "fm_pack2"; relu: "fm_relu2"): a pair of
 * results stored in 16 bits is then one conversion. NULL otherwise. */
const char *fm_expr_pair_fn(const fm_expr *e);
/* Evaluates e in double precision on n values; in and out may alias. Returns FM_ERR_NOMEM only. */
fm_status fm_expr_eval(const fm_expr *e, const double *in, double *out, size_t n, fm_error *err);
/* For x anywhere in [lo, hi] (infinite ends allowed): an interval [*out_lo, *out_hi] holding every non-NaN value of
 * e, and the return value, a bound on |argument| of every sin/cos in e (0 without any; INFINITY where unbounded).
 * Conservative: what the analysis does not model counts as the whole line. */
double fm_expr_range(const fm_expr *e, double lo, double hi, double *out_lo, double *out_hi);
/* Whitelisted function names, NULL-terminated (for error messages and docs). */
const char *const *fm_expr_functions(void);

/* ------------------------------------------------------------------------------------------------ spec */

/* Global-memory types. FM_CODES: an 8-bit network's codes between segments (a GEMM's operand or result, never a
 * fused kernel's x or y), each value's codes with the scale of the layer reading it (fm_spec.act_scale). */
typedef enum fm_dtype { FM_F32 = 0, FM_F16 = 1, FM_BF16 = 2, FM_CODES = 3 } fm_dtype;
const char *fm_dtype_name(fm_dtype d);
size_t fm_dtype_size(fm_dtype d);

/* Tensor Core compute precision: what the weights and the activations between layers are stored as on chip; every
 * path accumulates in float32. TF32 keeps float32's range (and storage) with fp16's 10-bit mantissa per product.
 * The 8-bit ones (issue 26) store scaled codes: int8 (s8 x s8 -> s32 accumulate) and float8 e4m3 (f32 accumulate),
 * with per-output-channel weight scales and one scale per layer input (fm_spec.quant, csrc/quant.c). */
typedef enum fm_prec {
    FM_PREC_F16 = 0,
    FM_PREC_BF16 = 1,
    FM_PREC_TF32 = 2,
    FM_PREC_INT8 = 3, /* int8 codes, s32 accumulation (exact) */
    FM_PREC_E4M3 = 4  /* float8 e4m3 codes ("float8"), f32 accumulation */
} fm_prec;
const char *fm_prec_name(fm_prec p); /* "float16", "bfloat16", "tf32", "int8", "float8" */
size_t fm_prec_size(fm_prec p); /* bytes per stored element: 2, 2, 4, 1, 1 */
/* 75 for fp16 (m16n8k8 pairs), 80 for bf16, tf32 and int8 mma (m16n8k32 .s8), 89 for e4m3 mma (m16n8k32 .e4m3) */
int fm_prec_min_arch(fm_prec p);
/* 1 for the 8-bit precisions */
int fm_prec_is_8bit(fm_prec p);

/* Rounds f to the precision (nearest even) and returns the stored bits: binary16, bfloat16 (16 bits) or the float32
 * bits of the nearest TF32 value (the low 13 mantissa bits zero); for the 8-bit ones the code of f, already divided
 * by its scale (fm_quant8). */
uint32_t fm_round_bits(float f, fm_prec p);
/* fm_round_bits of src[0..n) into bits[0..n) (a weight row's packing: fm_plan_pack). */
void fm_round_row(const float *src, int n, fm_prec p, uint32_t *bits);
/* The float value of those bits. */
float fm_bits_value(uint32_t bits, fm_prec p);

/* A validated MLP. Values: v = -1 is the network input x, v = l the output of layer l; width[v + 1] is value v's
 * feature count. Layer l reads value l - 1 (its hidden input h), or with an input concat torch.cat([h, x]) /
 * torch.cat([x, h]) (NeRF's skip), and writes value l. */
typedef struct fm_spec {
    int num_layers;                   /* 1..FM_MAX_LAYERS */
    int width[FM_MAX_LAYERS + 1];     /* real (unpadded) feature counts of the values, all >= 1 */
    int cat[FM_MAX_LAYERS];           /* FM_CAT_NONE, or where x joins layer l's input: FM_CAT_AFTER / FM_CAT_BEFORE h */
    int has_bias[FM_MAX_LAYERS];      /* 1 when layer l adds a bias */
    fm_expr *act[FM_MAX_LAYERS];      /* activation applied after layer l (owned); with pieces, the first piece's */
    /* Column pieces of the last layer's activation ("sigmoid:3 | none:1": NeRF's rgb and density in one output):
     * act_pieces[l] pieces (0: one activation for every column), piece i applying act_piece[l][i] (owned; [0] is
     * act[l] itself, not owned twice) to the act_cols[l][i] columns after the pieces before it. */
    int act_pieces[FM_MAX_LAYERS];
    fm_expr *act_piece[FM_MAX_LAYERS][FM_ACT_PIECES];
    int act_cols[FM_MAX_LAYERS][FM_ACT_PIECES];
    /* Residual epilogue of layer l (CUTLASS's LinearCombinationResidualBlock): y = post(op(act(W x + b), r)) with r
     * value res_src[l] (the layer's own input h = value l - 1, an earlier layer's output, or x = -1), as wide as the
     * layer's output. res_op: FM_RES_NONE, FM_RES_ADD or FM_RES_MUL. */
    int res_op[FM_MAX_LAYERS];
    int res_src[FM_MAX_LAYERS];       /* value index -1..l-1 (meaningful when res_op is not FM_RES_NONE) */
    fm_expr *res_post[FM_MAX_LAYERS]; /* the unary after the binary op (owned; NULL when res_op is FM_RES_NONE) */
    /* A bound on |W x + b| of layer l for every input, from the weights (fm_spec_bound_preacts; INFINITY: none). */
    double z_bound[FM_MAX_LAYERS];
    /* Layer l's weights block-diagonal in blocks[l] equal blocks (fm_spec_find_blocks; 1: not): output block i reads
     * input block i alone, the rest are exact zeros (parallel stacks of Linears read as one network). */
    int blocks[FM_MAX_LAYERS];
    /* Normalization of layer l's z = W h + b over its width[l + 1] outputs, before the activation (issue 30):
     * FM_NORM_LAYER z' = (z - mean) / sqrt(var + eps) * gamma + beta (var biased, as torch.nn.LayerNorm),
     * FM_NORM_RMS z' = z / sqrt(mean(z^2) + eps) * gamma + beta (torch.nn.RMSNorm, plus an optional beta),
     * FM_NORM_SOFTMAX z' = exp(z - max) / sum exp(z - max) (torch.softmax over the features; no eps, gamma or beta),
     * FM_NORM_LOG_SOFTMAX z' = z - max - log(sum exp(z - max)) (torch.log_softmax). A classifier's head is its last
     * layer with a softmax norm and the identity activation. */
    int norm[FM_MAX_LAYERS];          /* FM_NORM_* */
    double norm_eps[FM_MAX_LAYERS];   /* eps, >= 0 */
    float *norm_w[FM_MAX_LAYERS];     /* gamma, width[l + 1] floats (owned), or NULL: ones */
    float *norm_b[FM_MAX_LAYERS];     /* beta, width[l + 1] floats (owned), or NULL: zeros */
    /* Low-bit operands (issue 26; fm_spec_set_quant). quant: FM_PREC_INT8 or FM_PREC_E4M3 where the network runs with
     * 8-bit weights and activations, FM_PREC_F16 (0) where it does not. w_scale[l]: layer l's per-output-channel weight
     * scales (width[l + 1] floats, owned): W[n][k] is stored as the code of W[n][k] / w_scale[l][n]. act_scale[l]:
     * the scale of layer l's input (the value it reads; a concat layer's two parts share it with layer 0's, x), 0
     * until calibrated: a stored activation v is the code of v * (1 / act_scale). */
    fm_prec quant;
    float *w_scale[FM_MAX_LAYERS];
    float act_scale[FM_MAX_LAYERS];
    /* An input encoding computed as x is loaded (fm_spec_set_encoding; enc_cols 0: none): the layers see value -1 as
     * enc_cols = width[0] columns made from x's x_features features, column j x[enc_src[j]] where enc_sin[j] is 0
     * (fmaf(enc_scale[j], x, enc_phase[j]) where those are not 1 and 0), else sin(enc_scale[j] * x[enc_src[j]] +
     * enc_phase[j]) in float32 (NeRF's positional encoding, cos z being sin(z + pi / 2)). x_features: the features
     * of x in memory, width[0] without an encoding. */
    int x_features;
    int enc_cols;
    int *enc_src, *enc_sin;       /* (owned) */
    float *enc_scale, *enc_phase; /* (owned) */
} fm_spec;

enum { FM_RES_NONE = 0, FM_RES_ADD = 1, FM_RES_MUL = 2 };
enum { FM_CAT_NONE = 0, FM_CAT_AFTER = 1, FM_CAT_BEFORE = 2 };
enum { FM_NORM_NONE = 0, FM_NORM_LAYER = 1, FM_NORM_RMS = 2, FM_NORM_SOFTMAX = 3, FM_NORM_LOG_SOFTMAX = 4 };
/* Whether an FM_NORM_* is a softmax (its statistics the row's max and sum of exponentials, no affine). */
#define FM_NORM_IS_SOFT(kind) ((kind) == FM_NORM_SOFTMAX || (kind) == FM_NORM_LOG_SOFTMAX)

/* Checks that weight shapes chain and parses every activation; shapes[2*l] = out_l, shapes[2*l+1] = in_l
 * (PyTorch's nn.Linear.weight layout), bias_len[l] = -1 for no bias, concat[l] an FM_CAT_* (NULL: none; layer 0
 * cannot have one: its input is x). A concat layer's in_l is width(h) + width(x). On failure nothing needs freeing. */
fm_status fm_spec_init(fm_spec *spec, int num_layers, const int64_t *shapes, const int64_t *bias_len,
                       const char *const *activations, const int *concat, fm_error *err);
void fm_spec_free(fm_spec *spec);
/* Sets z_bound from the weights (w[l]: out x in row-major float32; b[l]: NULL or out floats). Where layer l's input is
 * only the layer before's output (no concat, no residual there) and that layer's activation is bounded
 * (fm_expr_range over the whole line: sin, tanh, sigmoid...), |z_j| <= sum_k |W_jk| M + |b_j|, with 1% for the
 * 16-bit rounding of weights and values on chip. Layer 0 (x is anything) and the rest: INFINITY. */
void fm_spec_bound_preacts(fm_spec *spec, const float *const *w, const float *const *b);
/* blocks[l] for every layer from its weights: the most equal blocks (up to FM_MAX_BLOCKS) in which layer l's real
 * weights are block-diagonal, 1 where none (a concat layer, or widths no count divides). */
#define FM_MAX_BLOCKS 8
void fm_spec_find_blocks(fm_spec *spec, const float *const *w);
/* Layer l's input features: width(h), plus width(x) with a concat. */
int fm_spec_in_features(const fm_spec *spec, int l);
/* Whether an 8-bit network's norm layers store z = W h + b in float16 between their GEMM and their row pass: a value
 * wider than FM_MAX_ONCHIP_WIDTH, which no fused 8-bit kernel holds, makes every layer a GEMM
 * (python/fusedmlp/_segments.py), and the CPU emulation rounds those layers' z as the GEMMs store it. */
int fm_spec_z16(const fm_spec *spec);
/* fm_expr_unary of layer l's activation; NULL where it has column pieces. */
const char *fm_spec_act_unary(const fm_spec *spec, int l);
/* Appends layer l's activation as canonical text ("sigmoid(x):3 | x:1" where it has pieces). */
void fm_spec_act_string(const fm_spec *spec, int l, fm_str *out);
/* Applies layer l's activation to rows x width[l + 1] row-major values in place (each piece to its columns). */
fm_status fm_spec_act_eval(const fm_spec *spec, int l, double *v, size_t rows, fm_error *err);
/* Appends layer l's activation as a float32 CUDA expression of `var` and, with pieces, the int `col` (its column). */
fm_status fm_spec_act_emit(const fm_spec *spec, int l, const char *var, fm_str *out, fm_error *err);
/* Gives layer l a residual epilogue: op FM_RES_ADD or FM_RES_MUL with value src (-1: the network input, l - 1: the
 * layer's own input h, k < l - 1: layer k's output), then post (an activation text; NULL or "none" for identity).
 * The value must be as wide as the layer's output. */
fm_status fm_spec_set_residual(fm_spec *spec, int layer, int op, const char *post, int src, fm_error *err);
/* Gives layer l a normalization of its W h + b before the activation: kind FM_NORM_*, eps >= 0 and finite, gamma /
 * beta (copied; NULL: ones / zeros) of weight_len / bias_len floats, each the layer's output width (a softmax takes
 * neither, and eps 0). Call before fm_spec_bound_preacts (a norm layer's pre-activations have no bound from the weights). */
fm_status fm_spec_set_norm(fm_spec *spec, int layer, int kind, double eps, const float *gamma, int64_t weight_len,
                           const float *beta, int64_t bias_len, fm_error *err);
/* Gives the network an input encoding (fm_spec.enc_*): cols columns, as many as layer 0 takes (width[0]), each
 * src[j] in [0, x_features), sin[j] 0 (scale[j] x + phase[j], x itself at 1 and 0) or 1 (sin(scale[j] x +
 * phase[j])), scale and phase finite; copied.
 * FM_ERR_SHAPE / FM_ERR_VALUE naming the column and the rule, FM_ERR_NOMEM. */
fm_status fm_spec_set_encoding(fm_spec *spec, int x_features, int cols, const int *src, const int *sin,
                               const float *scale, const float *phase, fm_error *err);
/* "layernorm", "rmsnorm", "softmax", "log_softmax" or "none" for an FM_NORM_* (anything else: "?"). */
const char *fm_norm_name(int kind);

/* ------------------------------------------------------------------------------------------------ quant */

/* The largest code magnitude of an 8-bit precision: 127 (int8, symmetric: -128 is never produced) or 448 (e4m3's
 * largest finite value). */
float fm_quant_max(fm_prec p);
/* The 8-bit code of v (already divided by its scale), as the kernels' conversions produce it. int8: v clamped to
 * [-127, 127] with fmaxf/fminf (so NaN becomes -127: fmaxf returns the number), then rounded to nearest even.
 * e4m3: rounded to nearest even, magnitudes past 448 saturating to 448 (cvt.rn.satfinite), NaN to the NaN code 0x7f. */
uint8_t fm_quant8(float v, fm_prec p);
/* The value of a code (e4m3's NaN codes: NaN). */
float fm_dequant8(uint8_t code, fm_prec p);
/* A per-channel weight scale: max |row[k]| / fm_quant_max, in float32, at least FLT_MIN (a row of float32 denormals
 * would otherwise get scale 0); 1 for an all-zero row (its codes are all zero whatever the scale). */
float fm_quant_weight_scale(const float *row, int k, fm_prec p);
/* Makes spec an 8-bit network of precision p (FM_PREC_F16: back to none): weight scales from w (as fm_plan_pack
 * takes them; computed once per precision, so plans' pointers to them stay valid across calibrations), activation
 * scales from act_scale (NULL: not calibrated yet, all 0; else num_layers floats, each finite, >= FLT_MIN, and a
 * concat layer's equal to layer 0's: its two parts share one scale). FM_ERR_VALUE naming the layer and the rule (the
 * scales before stay); FM_ERR_NOMEM. */
fm_status fm_spec_set_quant(fm_spec *spec, fm_prec p, const float *const *w, const float *act_scale, fm_error *err);
/* FM_OK where spec runs in 8 bits and is calibrated, or does not run in 8 bits; else FM_ERR_VALUE saying to call
 * calibrate (`what` names the operation refused). */
fm_status fm_spec_check_calibrated(const fm_spec *spec, const char *what, fm_error *err);

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
    int wgmma;        /* 1: the sm_90a warpgroup template (fused_mlp_sm90.cu); 0: the mma.sync one; -1: auto */
    int cluster;      /* sm_90a: 0 auto; -1 only the register-A warpgroup kernel; 1, 2 or 4: the shared-memory-A
                         warpgroup kernel on clusters of that many CTAs, each holding 1/cluster of every hidden layer's
                         weights and computing those columns (fm_plan.cluster) */
    int kpipe;        /* the register-A warpgroup kernel's K-pipelined layers (fm_plan.pipe): 0 auto, -1 off, 1 on */
    int k_chunk;      /* the streamed warpgroup kernel's K columns per weight slot fill (fm_plan.k_chunk; 0: auto) */
    int wide_loop;    /* the streamed warpgroup kernel's wide layers' column groups as a run-time loop
                         (fm_plan.wide_loop): 0 auto (looped), -1 off (unrolled), 1 on (a limit where none is wide) */
    int split;        /* the streamed warpgroup kernel's wide layers split over clusters of this many CTAs
                         (fm_plan.split; 0: none, 2, 4 or 8); the tuner tries 2 and 4 for small batches */
    int norm_half;    /* fm_plan.norm_half where it applies: 0 auto (on), -1 off (for A/B timing) */
    int in_shared;    /* the streamed warpgroup kernel's input buffers in its wide buffers' bytes (fm_plan.in_shared):
                         0 auto (where two warpgroups fit no other way), -1 off, 1 on (a limit where it cannot be) */
    int x_split;      /* fm_plan.x_split: 0 auto (where it applies), -1 off (for A/B), 1 on (a limit where it cannot) */
} fm_plan_opts;

typedef struct fm_plan {
    int num_layers;
    fm_prec prec;                    /* stored type of weights and activations on chip */
    int elem_bytes;                  /* fm_prec_size(prec) */
    int k_real[FM_MAX_LAYERS], n_real[FM_MAX_LAYERS];   /* real widths of layer l's input and output */
    int k_pad[FM_MAX_LAYERS], n_pad[FM_MAX_LAYERS];     /* padded to multiples of 16 (each concat part separately) */
    int k0_real[FM_MAX_LAYERS];      /* real width of the first part of layer l's input (k_real without a concat) */
    int k0_pad[FM_MAX_LAYERS];       /* its padded width: the second part starts at this k (k_pad without a concat) */
    int n_chunk[FM_MAX_LAYERS];      /* columns accumulated at once in layer l */
    int has_bias[FM_MAX_LAYERS];
    int res_op[FM_MAX_LAYERS];       /* the spec's residual op per layer (FM_RES_NONE when absent) */
    int res_src[FM_MAX_LAYERS];      /* the spec's residual operand (value index) per layer */
    int cat[FM_MAX_LAYERS];          /* the spec's concat mode per layer */
    /* Per-warp activation buffers (fm_plan_buffers): where layer l reads the first and second (concat; -1: none)
     * part of its input, where it writes its output and where its residual operand lives (-1: none). x arrives in
     * buffer 0; a layer writes in place when it is one chunk and its input dies with it. */
    int a0_buf[FM_MAX_LAYERS], a1_buf[FM_MAX_LAYERS], out_buf[FM_MAX_LAYERS], res_buf[FM_MAX_LAYERS];
    size_t w_offset[FM_MAX_LAYERS];  /* layer l's first element in the packed weight blob: n_pad rows of k_pad +
                                        16 / elem_bytes elements, the kernel's shared-memory layout (a flat copy) */
    size_t b_offset[FM_MAX_LAYERS];  /* layer l's first float in the packed bias blob (n_pad floats) */
    size_t w_elems;                  /* total elements in the packed weight blob */
    size_t b_floats;                 /* total floats in the packed bias blob */
    int warps, m_tiles, rows_per_cta; /* rows_per_cta = warps * m_tiles * 16 */
    int resident;                    /* 1 when every layer's weights live in shared memory for the whole kernel */
    int act_stride;                  /* elements per row of a warp's activation buffers */
    int buffers;                     /* activation buffers per warp */
    int blocks_per_sm;               /* CTAs the plan expects per SM (the kernel's __launch_bounds__ minimum) */
    size_t w_slot_elems;             /* streamed mode: elements per weight slot (mma.sync: two slots) */
    int stream_slots;                /* the warpgroup kernel's streamed form (fm_plan_stream): its weight slots, each
                                        holding one column group (n_chunk[l] rows) of a layer, or one K piece of it
                                        (k_chunk); 0: resident weights */
    /* The streamed form's K pieces: a slot holds k_chunk[l] of layer l's k_pad inputs of a column group (0 or k_pad:
     * the whole row). A group's pieces are contiguous in the blob, each in the core-matrix layout of its own width
     * (fm_plan_w_index). Networks with a layer wider than 256 only, whose groups would not fit two slots whole. */
    int k_chunk[FM_MAX_LAYERS];
    /* The streamed form's wide layers: wide_out[l] = 1 where layer l's output does not stay in registers as the next
     * layer's A fragments (with its input fragments and accumulators they would not fit: a layer wider than 256 in
     * or out) but goes, 16 columns at a time, to its warp's wide buffer in shared memory (16 rows x n_pad, 8-column
     * chunks of 256 bytes), from which the next layer loads its A fragments. The buffer doubles as the output stage. */
    int wide_out[FM_MAX_LAYERS];
    /* 1 (the default where the streamed form has wide layers; fm_plan_opts.wide_loop): the wide layers (wide_out) run
     * their whole column groups as one run-time loop over one group's code instead of a copy of it per group, each
     * group's K pieces still unrolled, the slot refills naming their weights from a table of the tile's fills
     * (fused_mlp_sm90.cu, fm_wide_layer): NVRTC is given a quarter of a 512-wide layer's code, and the SM a kernel
     * that fits its instruction cache (wide512 ran 0.71x the unrolled one's time on the H100; docs/performance.md).
     * 0: every group unrolled (wide_loop=-1, or no wide layer). */
    int wide_loop;
    /* 0, or n > 1 (asked for: fm_plan_opts.split; wide_loop plans only): clusters of n CTAs run the same row tile,
     * CTA r computing the column groups [r, r + 1) * G / n of each wide layer (G groups) and storing them into the
     * wide buffers of all n CTAs (distributed shared memory, a cluster barrier before the next layer reads them);
     * narrow layers run whole in every CTA, and CTA 0 stores y. So a small batch's few row tiles keep n times as many
     * SMs busy, each reading 1/n of the wide layers' weights. The output stage keeps sharing the wide buffer's bytes:
     * a tile's last hand-over arrival waits until its y is stored. */
    int split;
    /* 1 (the streamed form with a wide layer, where two warpgroups' buffers fit no other way): each warp's input
     * buffer takes the bytes of its wide buffer and output stage, so a warp holds one 16-row buffer of the widest
     * value instead of two (sdf512's stretches, whose 512-wide inputs and outputs left room for one warpgroup only).
     * The next tile's x then lands there once this tile's y is stored, not under its layers (a raw landing buffer,
     * where x's rows are converted, is its own and still fills under them). */
    int in_shared;
    size_t smem_bytes;               /* dynamic shared memory per CTA */
    fm_dtype in_dtype, out_dtype;    /* global-memory types of x and y */
    int arch;                        /* target compute capability */
    int wgmma;                       /* 1: sm_90a warpgroup kernel (wgmma, activations in registers, weights in
                                        the core-matrix layout, fm_plan_w_index); 0: the mma.sync kernel */
    /* The shared-memory-A form of the warpgroup kernel (0: not it). Layer outputs go to a per-warpgroup shared buffer
     * (core-matrix layout) that the next layer's wgmma reads; a cluster of `cluster` CTAs runs the same rows, CTA r
     * computing columns [r, r + 1) * n_chunk[l] of every layer and sending them to the others' buffers (distributed
     * shared memory); a last layer of up to 16 columns is not split (n_chunk = n_pad: CTA 0 computes it whole). So
     * each CTA holds 1/cluster of the weights: siren256's 280 KB do not fit one CTA, its halves do. Split widths are
     * padded to 16 * cluster. */
    int cluster;
    /* The register-A warpgroup kernel's K-pipelined steps: pipe[l] = 1 where layer l's epilogue runs 16 columns at a
     * time, each followed by layer l + 1's k step over them (fused_mlp_sm90.cu, FM_KPIPE), so the next layer's MMAs run
     * under this layer's activation. kpipe: any pipe[l] set. Only where layer l's activation is not one cvt per pair
     * (fm_expr_pair_fn), there is no residual, and both layers' accumulators fit the warps' registers. */
    int kpipe, pipe[FM_MAX_LAYERS];
    size_t w_rank_elems;             /* cluster plans: elements of one CTA's share of the blob (w_offset is within
                                        it; CTA r's share starts at r * w_rank_elems) */
    /* A GEMM plan (fm_plan_gemm; 0: a fused plan): layer gemm_layer of the spec alone as a tiled GEMM with the layer's
     * whole epilogue (gemm_layer.cu), for a layer or stretch the fused kernels cannot hold. Only that layer's entries
     * of the per-layer arrays are set (num_layers = gemm_layer + 1); its input parts are padded to whole 64-byte K
     * stages and its output to whole column tiles; the blob is n_pad rows of k_pad (row-major; gemm_cluster 2: in
     * tiles). in_dtype is part 0's dtype in global memory, a1_dtype the concat part's (-1: none), res_dtype the
     * residual operand's (-1: none). */
    int gemm, gemm_layer;
    int gemm_bm, gemm_bn, gemm_warps_m, gemm_stages; /* CTA tile rows and columns, warps along the rows, K stages */
    /* 2: the wgmma GEMM on clusters of two CTAs along the rows, sharing each stage's weight tile through one TMA
     * multicast per CTA; its blob is then one block per (column tile, K stage), BN rows x 128 bytes in the 128-byte
     * swizzle the wgmma descriptor reads (fm_plan_w_index). 1: one CTA per tile, the blob row-major. */
    int gemm_cluster;
    /* 1: the wgmma GEMM warp-specialised, one CTA a tile: a producer warpgroup (the last; warps counts it) fills the
     * stages, cp.async for A and one cp.async.bulk of B's block per stage (the blob in gemm_cluster 2's layout), and
     * the consumer warpgroups only multiply and store, each stage handed over by full/empty mbarriers. 2: the same
     * roles in turn ("ping-pong", CUTLASS's name): a persistent grid, each consumer warpgroup a 128 x BN tile of its
     * own (every other tile of its CTA), the producer filling the stages tile after tile, so that one warpgroup's
     * MMAs run while the other stores; each consumer warp stages its output in a buffer of its own after the stages.
     * The auto choice where gemm.c's fm_gemm_pp_auto says (8-bit layers mostly). */
    int gemm_ws;
    /* 1: a warp-specialised GEMM's producer loads each stage's A rows with one TMA copy (cp.async.bulk.tensor of a
     * tensor map per input part, 128-byte swizzle, zeros past the batch and the part's width) instead of its 128
     * threads' cp.async: every input part copied as it is (the compute dtype's storage, rows of whole 16-byte
     * pieces). The launch encodes the maps (cuTensorMapEncodeTiled) and passes them after the kernel's other
     * arguments. */
    int gemm_tma;
    /* 1: the persistent form's (gemm_ws 3) consumer warps store each staged slab of y (16 rows by 128 bytes) with one
     * TMA store of a tensor map of y instead of their 16-byte st.global, two slab buffers a warp in turn; the map is the
     * launch's third (after the two of gemm_tma, passed either way). */
    int gemm_tma_store;
    /* 1: a norm layer's second kernel (row_norm.cu), after the GEMM of the layer cut before its norm wrote z = W h + b
     * (python/fusedmlp/_segments.py): a warp a row, its statistics, then the rest of the layer's epilogue, y once.
     * in_dtype is z's global dtype; no weights (w_elems a dummy 16 bytes), the float blob n_pad floats (unused),
     * gamma, beta; warps rows a CTA, one CTA per warps rows. */
    int gemm_norm;
    /* 1: the pad pass (pad_rows.cu): x (in_dtype, the network input's width) copied to rows of gemm_a_row[0]
     * elements of the compute dtype's storage (whole 16-byte pieces, zeros after x's width), for a GEMM that reads x
     * as an input part whose rows are not whole 16-byte pieces (sdf512's 259 float16 columns: 518-byte rows, which
     * no cp.async size fits, so the GEMM converted them element pair by element pair on the way in). rows_per_cta
     * rows a CTA, staged through shared memory (smem_bytes). 16-bit compute dtypes; also an 8-bit network with an
     * input encoding, whose copy is the encoded x in float16 (every network with an encoding: the copy is encoded,
     * pad_rows.cu's Enc<C> columns, from x's x_features features). */
    int gemm_pad;
    /* A GEMM's input parts in global memory: elements a row of part 0 and part 1 (0: the part's width). More than the
     * width: a padded copy (the pad pass's), its extra columns zero, the weights' zero padding beyond the width. */
    int gemm_a_row[2];
    int a1_dtype, res_dtype;
    /* The spec's FM_NORM_* per layer. A norm layer's float blob holds n_pad floats of bias, then gamma, then beta
     * (b_offset[l], + n_pad, + 2 n_pad; fm_plan_pack_norms). Its row statistics need every column of a row: the
     * mma.sync kernel makes it one chunk where the accumulators allow, else runs its chunks twice (statistics, then
     * output); the register-A kernel keeps it one column group (K-pipelined too: the norm runs on the whole
     * accumulators before the pipelined epilogue); the cluster kernel's CTAs exchange partial statistics through
     * distributed shared memory. The GEMM form (fm_plan_gemm) refuses it: such a layer runs as a GEMM of the layer
     * without its norm, activation and residual, then its second kernel (fm_plan.gemm_norm). */
    int norm[FM_MAX_LAYERS];
    /* 1: a layernorm layer whose weights and bias fm_plan_pack stores centred (each input column's mean over the
     * outputs subtracted from it, the bias's mean from the bias), so that z = W h + b arrives with a zero row mean
     * whatever h is: the kernel skips the mean's reduction and its subtractions and runs rmsnorm's statistics
     * (Layer<L>::CENTRED). Every 16- and 32-bit plan's layernorm layers; 8-bit plans keep the mean (their codes and
     * the CPU emulation's are of the weights as given). */
    int centred[FM_MAX_LAYERS];
    /* 1: a norm layer whose activation is silu or sigmoid in its fast form (fm_plan_result_type != 0) takes
     * h = x / 2 (both are functions of tanh(x / 2)): fm_plan_pack_norms stores gamma / 2 and beta / 2, and the layer's
     * act is fm_silu_h / fm_sigmoid_h, so the norm's scale and shift yield h and the FMUL by 1/2 per element goes.
     * Halving is exact in float32, so the bits are those of the unhalved form. Fused 16-bit plans only. */
    int norm_half[FM_MAX_LAYERS];
    /* 1: x and the weights that multiply it enter the MMAs as two 16-bit parts each, x = x_hi + x_lo and
     * W = W_hi + W_lo (each lo the rounding of what its hi left): the input buffer's columns are [x_hi | x_lo | x_hi]
     * and every layer reading x (layer 0, a concat's x part) stores [W_hi | W_hi | W_lo] for them, so that its MMAs
     * sum W_hi x_hi + W_hi x_lo + W_lo x_hi in float32, W x to about float32's rounding where one 16-bit product of
     * rounded operands is off by 2^-11 or 2^-8 of each term. A sine first layer (SIREN's 30 x, Fourier features
     * 2 pi x B) turns that into a phase error the whole network carries. Fused 16-bit plans of at most 5 input features
     * (three parts fill the 16-column k step one part would have padded: no MMA more), no residual of x. */
    int x_split;
    /* x's features in global memory: k_real[0], or fewer where the spec has an input encoding (fm_spec.enc_*, which a
     * fused plan's loader computes, never with x_split, and a pad pass writes into x's copy). */
    int x_features;
    /* 8-bit plans (fm_prec_is_8bit(prec)): the weight blob holds codes (fm_quant8 of W / w_scale), the float blob
     * per layer also n_pad dequantisation factors act_scale[l] * w_scale[l][n] at dq_offset[l] (after the bias and a
     * norm's gamma and beta): the accumulators times these, plus the bias, are W h + b. act_scale[l] is the spec's
     * (layer l's input scale; the kernels take inverses and residual scales from the rendered source), w_scale[l]
     * points at the spec's weight scales (the spec outlives its plans). Widths are padded to 32: an 8-bit mma's k
     * step. */
    size_t dq_offset[FM_MAX_LAYERS];
    float act_scale[FM_MAX_LAYERS];
    const float *w_scale[FM_MAX_LAYERS];
    /* 8-bit codes in the register-A warpgroup kernel (their one sm_90 form; fm_plan_codes_in_place). Each lane packs
     * a hidden layer's codes from its own accumulators into the next layer's k32 A fragments, with no shuffles
     * between lanes, so layer l > 0 receives its inputs permuted within each 32 (fm_plan_k_perm) and k_perm[l] = 1
     * has its weights' K order permuted to match (fm_plan_w_index; x's part of an input concat, loaded from x in
     * column order, is not). q_fold[l] (float8 only): 1 (identity) or 2 (relu)
     * where hidden layer l's activation commutes with a positive factor and it has no residual or norm; its
     * dequantisation factors and bias are stored times the next layer's inverse input scale, so one fma gives the
     * value to round to a code, and relu is the rounding's .relu (cvt.rn.satfinite.relu). 0 elsewhere. */
    int k_perm[FM_MAX_LAYERS], q_fold[FM_MAX_LAYERS];
} fm_plan;

/* Where input k of a layer with fm_plan.k_perm sits in its weights' K order: within each 32 inputs, input
 * 8 j + 2 t + e (the accumulator column that lane t holds in 8-column tile j) at 16 (j / 2) + 4 t + 2 (j % 2) + e (its
 * byte in lane t's k32 A fragment register, rows g and g + 8 alike). */
int fm_plan_k_perm(int k);

fm_status fm_plan_make(const fm_spec *spec, const fm_target *target, const fm_plan_opts *opts, fm_prec prec,
                       fm_dtype in_dtype, fm_dtype out_dtype, fm_plan *plan, fm_error *err);

/* A GEMM plan's choices; zero fields (wgmma: -1) let the plan choose. */
typedef struct fm_gemm_opts {
    int bm, bn;  /* tile rows (64, 128) and columns (64, 128; 256 with wgmma) */
    int stages;  /* shared-memory K stages (mma.sync 2..8, wgmma 3..8) */
    int wgmma;   /* 1: the warpgroup form (sm_90a, 16-bit operands), 0: mma.sync, -1: wgmma where it can */
    int cluster; /* the wgmma form on clusters of 2 CTAs sharing the weight tile (fm_plan.gemm_cluster) or 1 CTA a
                    tile; 0: auto */
    int ws;      /* 1: the wgmma form warp-specialised (fm_plan.gemm_ws), 2: in turn (ping-pong), 3: as 1 on a
                  * persistent grid, -1: not, 0: auto */
    int norm_pass; /* 1: not the GEMM but the norm layer's second kernel (fm_plan.gemm_norm); a0 is then z's dtype */
    int pad_pass;  /* 1: not the GEMM but the pad pass of x (fm_plan.gemm_pad): a0 is x's dtype, a_row[0] the copy's */
    int a_row[2];  /* elements a row of input part 0 and 1 in memory (fm_plan.gemm_a_row); 0: the part's width */
    int tma;       /* 1: A by tensor maps (fm_plan.gemm_tma), -1: by cp.async, 0: auto (tensor maps where they can) */
    int tma_store; /* 1: y by TMA stores (fm_plan.gemm_tma_store), -1: not, 0: auto (gemm.c's FM_GEMM_TMA_STORE_AUTO) */
} fm_gemm_opts;

/* Features of input part p (0, 1) of GEMM plan `plan`'s layer l: part 1 is a concat's second part (0 without one). */
static inline int fm_gemm_part_width(const fm_plan *plan, int l, int p) {
    return p == 0 ? plan->k0_real[l] : plan->k_real[l] - plan->k0_real[l];
}

/* Elements a row of that part in global memory: its width, or the row of the padded copy it reads
 * (fm_plan.gemm_a_row). The plan (gemm.c) and the renderer (A0_REAL, A1_REAL) read it the same way. */
static inline int fm_gemm_part_row(const fm_plan *plan, int l, int p) {
    return plan->gemm_a_row[p] ? plan->gemm_a_row[p] : fm_gemm_part_width(plan, l, p);
}

/* The GEMM plan of spec layer l (see fm_plan.gemm): a0/a1/res are the global dtypes of its input parts and residual
 * operand (a1, res: -1 where the layer has none), out the result's; opts (NULL: all auto) forces the tile. FM_ERR_LIMIT
 * where the arch or shared memory cannot. */
fm_status fm_plan_gemm(const fm_spec *spec, int l, const fm_target *target, fm_prec prec, fm_dtype a0, int a1,
                       int res, fm_dtype out, const fm_gemm_opts *opts, fm_plan *plan, fm_error *err);

/* The type layer l's result is stored as, in fm_dtype's codes: 0 float32 (tf32 activations, a float32 output, or an
 * int8 plan's hidden layer, whose activations take the accurate float32 forms), 1 float16 (also a float8 plan's
 * hidden layer: its e4m3 codes round coarser than float16), 2 bfloat16. Where it is 16-bit the activation may use the
 * fast helpers, whose error is the size of that rounding, and relu/identity a two-column form that rounds as it
 * converts. */
int fm_plan_result_type(const fm_plan *plan, int l);

/* Elements per weight row of layer l in the mma.sync kernel's blob and shared memory: k_pad + one 16-byte pad. */
int fm_plan_w_stride(const fm_plan *plan, int l);

/* The inputs of layer l per slot fill of the streamed form (fm_plan.k_chunk), k_pad where its rows arrive whole. */
int fm_plan_k_chunk(const fm_plan *plan, int l);

/* Where weight (n, k) of layer l (padded coordinates) sits in the blob, as an element index. mma.sync: row-major
 * rows of fm_plan_w_stride. wgmma: wgmma's no-swizzle K-major layout, 8x16-byte core matrices of 128 contiguous
 * bytes, the K direction fastest (core matrix (n/8, 16-byte chunk c of k) at (n/8 * k_pad*elem/16 + c) * 128 bytes).
 * A GEMM plan: row-major n_pad x k_pad, or with gemm_cluster 2 the tiles its stages copy whole (fm_plan.gemm_cluster).
 */
size_t fm_plan_w_index(const fm_plan *plan, int l, int n, int k);

/* The sm_90a kernel's per-thread register estimate for a plan (accumulators, the input and output fragments, and
 * addressing), which sets how many warpgroups share an SM. */
int fm_plan_wgmma_regs(const fm_plan *plan);

/* The sm_90a kernel's per-warp raw landing buffer for x, in bytes: 0 when x's rows are copied verbatim into the
 * input buffer (x already in the compute dtype, rows a multiple of 16 bytes); else 16 rows of x as they are in
 * global memory, rounded up to 16 bytes (fused_mlp_sm90.cu's RAW_B). */
size_t fm_plan_wgmma_raw_bytes(const fm_plan *plan);

/* The sm_90a kernel's per-warp output stage, in bytes: 16 rows of the last layer's padded output in out_t plus a
 * 16-byte pad each (fused_mlp_sm90.cu's STAGE_B); 0 for float32 y, which the kernel stores from its registers. */
size_t fm_plan_wgmma_stage_bytes(const fm_plan *plan);

/* Packs PyTorch-layout float32 weights (w[l]: n_real x k_real, row-major) and biases (b[l] or NULL) into the
 * zero-padded blob of plan->w_elems elements of plan->elem_bytes (rounded to plan->prec) and the float blob
 * (plan->b_floats) that the kernel reads; a centred layer's (plan->centred) less their means over its outputs. */
void fm_plan_pack(const fm_plan *plan, const float *const *w, const float *const *b, void *w_blob, float *b_blob);
/* Writes the norm layers' gamma and beta (the spec's, ones / zeros where it has none; zero in padded columns) into
 * the float blob fm_plan_pack filled, beside each norm layer's bias. */
void fm_plan_pack_norms(const fm_plan *plan, const fm_spec *spec, float *b_blob);

/* ------------------------------------------------------------------------------------------------ render */

/* What layer l's rendered code takes from the weights rather than the architecture: its diagonal blocks
 * (fm_spec_find_blocks) and, where its activation has a sine, its bound class (fm_spec_bound_preacts). Two specs of
 * one architecture whose layers all have equal keys render every plan to the same source (Network.assign). */
int fm_render_weight_key(const fm_spec *spec, int l);

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
    int max_clusters;  /* clusters that can run at once (fm_kernel_cluster_occupancy), 0 where not known */
    int regs;          /* registers per thread, as compiled */
    int local_bytes;   /* local memory per thread: ptxas's spills and call frames (32 bytes for a sine's far sinf) */
} fm_kernel;

/* Loads a CUBIN, finds `name`, raises its dynamic shared-memory limit to smem_bytes and reads its occupancy. */
fm_status fm_kernel_load(const fm_gpu *gpu, const void *cubin, const char *name, size_t smem_bytes, int threads,
                         fm_kernel *k, fm_error *err);
void fm_kernel_unload(fm_kernel *k);
/* Reads into k->max_clusters how many clusters of `cluster` CTAs of k can run at once. A cluster's CTAs share one GPC,
 * so the SM count alone overstates it: the H100 of bench/results runs 30 clusters of 4 at one CTA per SM, not
 * 132 / 4 = 33 (a grid of 33 ran its last 3 as a second wave, 1.7x slower). Leaves 0 where the driver has no cluster
 * occupancy query. */
fm_status fm_kernel_cluster_occupancy(fm_kernel *k, int cluster, fm_error *err);
/* Launches k with a 1-D grid; params as for cuLaunchKernel. after: launch it as a programmatic dependent of the
 * kernel before it on the stream (CUDA 12+ drivers; a plain launch on older ones): its CTAs may start while that kernel
 * runs, so k must call griddepcontrol.wait before touching anything that kernel reads or writes (the templates'
 * fm_grid_wait, compiled for sm_90+; the caller checks the CUBIN's arch). */
fm_status fm_kernel_launch(const fm_kernel *k, unsigned grid, fm_stream stream, void **params, int after,
                           fm_error *err);
/* A TMA tensor map (the driver's CUtensorMap: 128 opaque bytes, 64-byte aligned), passed to a kernel by value. */
typedef struct fm_tensor_map {
    _Alignas(64) unsigned long long v[16];
} fm_tensor_map;
/* Encodes *map for TMA copies of box_rows x box_cols boxes of the contiguous row-major rows x cols array of
 * elem_bytes-byte (1, 2, 4) elements at base (16-byte aligned, rows of whole 16-byte pieces), in the 128-byte swizzle
 * (box_cols * elem_bytes <= 128), zeros for what lies outside the array (cuTensorMapEncodeTiled, CUDA 12.0+). */
fm_status fm_tensor_map_2d(fm_tensor_map *map, int elem_bytes, fm_devptr base, unsigned long long cols,
                           unsigned long long rows, unsigned box_cols, unsigned box_rows, fm_error *err);
/* Times `launches` back-to-back launches between two events on stream (synchronises); *ms is per launch. */
fm_status fm_kernel_time(const fm_kernel *k, unsigned grid, fm_stream stream, void **params, int launches, float *ms,
                         fm_error *err);

fm_status fm_mem_alloc(fm_devptr *p, size_t bytes, fm_error *err);
void fm_mem_free(fm_devptr p);
fm_status fm_memcpy_htod(fm_devptr dst, const void *src, size_t bytes, fm_stream stream, fm_error *err);
fm_status fm_memcpy_dtoh(void *dst, fm_devptr src, size_t bytes, fm_stream stream, fm_error *err);
fm_status fm_memset_d8(fm_devptr dst, unsigned char value, size_t bytes, fm_stream stream, fm_error *err);
fm_status fm_stream_sync(fm_stream stream, fm_error *err);
/* Waits for all work on the current context (every stream's): before device memory that kernels read is rewritten
 * in place (Network.assign's weight uploads). */
fm_status fm_ctx_sync(fm_error *err);
fm_status fm_stream_create(fm_stream *stream, fm_error *err);
void fm_stream_destroy(fm_stream stream);
/* A chain's launches captured once and replayed as one graph launch (module_fast.c): a captured graph, instantiated. */
typedef void *fm_graph_exec;
/* Whether the driver has stream capture and graph launches (CUDA 11.4+). */
int fm_graph_available(void);
/* 1 while `stream` captures a graph (work enqueued on it is recorded, not run), 0 when not, -1 when unknown. */
int fm_stream_capturing(fm_stream stream);
/* Starts capturing the work enqueued on *stream (relaxed mode), first creating it (non-blocking) where it is NULL. */
fm_status fm_graph_begin(fm_stream *stream, fm_error *err);
/* Ends the capture on `stream` (always, so that the stream runs work again); keep: instantiates what it recorded into
 * *exec and keeps the graph in *graph (its nodes are the handles fm_graph_set_kernel takes); else, and on failure,
 * both are NULL. */
fm_status fm_graph_end(fm_stream stream, int keep, fm_graph_exec *exec, void **graph, fm_error *err);
/* The kernel node the last launch on the capturing `stream` added. */
fm_status fm_graph_last_node(fm_stream stream, void **node, fm_error *err);
/* Gives kernel node `node` of `exec` new arguments (k's function and block, grid CTAs): later launches of exec use
 * them, launches already enqueued keep theirs. */
fm_status fm_graph_set_kernel(fm_graph_exec exec, void *node, const fm_kernel *k, unsigned grid, void **params,
                              fm_error *err);
fm_status fm_graph_launch(fm_graph_exec exec, fm_stream stream, fm_error *err);
/* Frees an instantiated graph and the graph it came from (either may be NULL). */
void fm_graph_free(fm_graph_exec exec, void *graph);
fm_status fm_host_alloc(void **p, size_t bytes, fm_error *err);
void fm_host_free(void *p);
/* The launch floor: host microseconds per launch of `name` (an empty kernel taking the fused kernels' arguments) from
 * `cubin`, one CTA of 32 threads, `calls` back to back (*async_us: no wait between them) and each followed by a
 * synchronize (*sync_us): what no call into the driver can beat (issue 25's benchmark). */
fm_status fm_launch_floor(const fm_gpu *gpu, const void *cubin, const char *name, int calls, double *async_us,
                          double *sync_us, fm_error *err);

/* ------------------------------------------------------------------------------------------------ ref */

/* CPU forward with the kernel's semantics: float32 storage, float64 accumulation. x: rows x width[0] with
 * element strides (x_row, x_col) in floats; y: rows x width[L], C order. w[l]/b[l] as in fm_plan_pack.
 * Releases nothing; needs no GPU. An 8-bit spec (fm_spec.quant) runs quantised, as fm_ref_forward_ex with quant 1. */
fm_status fm_ref_forward(const fm_spec *spec, const float *const *w, const float *const *b, const float *x,
                         int64_t rows, int64_t x_row, int64_t x_col, float *y, fm_error *err);
/* The same with options. quant 1: emulate the spec's 8-bit quantisation as the kernel computes it (x and every value
 * between layers stored as codes with their layer-input scale and read back as code * scale, weights as code *
 * w_scale); the spec must be calibrated. quant 0: float32 storage whatever the spec says. amax: NULL, or num_layers +
 * 1 doubles that receive, per value v = -1 .. L-1 at amax[v + 1], the largest |v| over the rows as stored (NaN where
 * any element was NaN): what calibration scales from. */
fm_status fm_ref_forward_ex(const fm_spec *spec, const float *const *w, const float *const *b, const float *x,
                            int64_t rows, int64_t x_row, int64_t x_col, float *y, int quant, double *amax,
                            fm_error *err);

/* ------------------------------------------------------------------------------------------------ host_pipe.c */

/* A large host-array call in pieces: worker threads copy each piece of x into page-locked staging, the copy engines
 * move it to the device, the kernel runs, and the piece's outputs come back the same way, every stage of one piece
 * under the others' (docs/performance.md, "Large host batches"). */
enum {
    FM_PIPE_WORKERS = 8,           /* threads at most: 8 filled the H200 machine's copies (39 GB/s, 16 threads 43) */
    FM_PIPE_SLOTS = 2,             /* pieces in flight a worker: one copied on the host while one is on the device */
    FM_PIPE_SLOT_BYTES = 8 << 20,  /* a piece's x and y together, page-locked and on the device */
};
typedef struct {
    fm_stream stream; /* the piece's copies and launches, in order */
    void *host;       /* FM_PIPE_SLOT_BYTES page-locked: x's piece, then y's */
    fm_devptr dev;    /* FM_PIPE_SLOT_BYTES on the device, the same split */
} fm_pipe_slot;
/* A device's staging, made on first use and kept (256 MB at most, half of it page-locked); one run at a time. */
typedef struct fm_pipe {
    fm_pipe_slot slot[FM_PIPE_WORKERS][FM_PIPE_SLOTS];
} fm_pipe;

/* Launches the kernel (or kernels) on rows rows of x into y, both device pointers, on stream; slot (0 to
 * FM_PIPE_WORKERS * FM_PIPE_SLOTS - 1) names the staging slot, whose pieces run one after another, so a chain's
 * workspace for slot s is used by one piece at a time. */
typedef fm_status (*fm_pipe_launch)(void *ctx, int slot, fm_devptr x, fm_devptr y, int64_t rows, fm_stream stream,
                                    fm_error *err);

/* The bytes of x and y at which fm_pipe_run pays: below it one copy each way is as fast. */
size_t fm_pipe_min_bytes(void);
/* Rows a piece holds at most (x_row + y_row bytes a row; 1 to FM_PIPE_SLOT_BYTES / 2). */
int64_t fm_pipe_piece_rows(size_t x_row, size_t y_row);
/* y = launch(x) for rows rows (rows of x_row and y_row bytes; 1 <= x_row + y_row <= FM_PIPE_SLOT_BYTES / 2), in
 * pieces through pipe's staging; poison fills each piece's device output with 0xFF before its launch. Returns once
 * every piece's outputs are in y; the first failure stops the rest. Called with the GPU's context usable. */
fm_status fm_pipe_run(fm_pipe *pipe, const fm_gpu *gpu, const void *x, void *y, int64_t rows, size_t x_row,
                      size_t y_row, int poison, fm_pipe_launch launch, void *ctx, fm_error *err);
/* Frees the staging (the GPU's context must still exist). */
void fm_pipe_free(fm_pipe *pipe);

#endif /* FM_H */
