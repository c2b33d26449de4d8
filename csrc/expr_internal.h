/*
 * expr_internal.h - what the activation-expression files (csrc/expr_*.c) share; not part of the core's interface
 * (fm.h). An expression goes through them in this order:
 *
 *   expr_funcs.c  the whitelist: each function's arguments, defaults, CUDA spelling and float64 definition
 *   expr_parse.c  text -> checked tree: number scanning, lexer, recursive-descent parser (fm_expr_parse)
 *   expr_emit.c   tree -> CUDA text and canonical text (fm_expr_emit_cuda, fm_expr_to_string), float64 evaluator
 *   expr_range.c  tree -> an interval enclosing its values over an input interval (fm_expr_range)
 *
 * The expression is user input that ends up inside generated CUDA source, so the user's text is never copied out:
 * the emitter writes only fixed spellings from the function table, the caller's variable name and numbers it
 * formats itself. Every tree is at most FM_EXPR_MAX_DEPTH levels high, so the recursive walks cannot overflow the
 * stack whatever the input.
 */
#ifndef FM_EXPR_INTERNAL_H
#define FM_EXPR_INTERNAL_H

#include "fm.h"

#include <math.h>
#include <stddef.h>

#define FM_EXPR_MAX_LEN 4096  /* characters of one expression */
#define FM_EXPR_MAX_DEPTH 64  /* tree height (operations nested in operations); bounds every tree walk here */
/* Parser frames (parentheses, unary signs, calls, powers): twice the tree height plus slack, because the canonical
 * text spends two frames on each unary minus and power ("(-(...))"); with the same limit for both, the canonical
 * text of an accepted 33-deep "-(-(...x))" did not parse back. */
#define FM_EXPR_MAX_SYNTAX_DEPTH (2 * FM_EXPR_MAX_DEPTH + 2)
#define FM_EXPR_MAX_ARGS 3    /* softplus(x, beta, threshold) and hardtanh(x, min, max) take the most */
#define FM_EXPR_MAX_POWI 16   /* x^n with integer |n| <= 16 becomes multiplications: exact for small n, no powf */
#define FM_EXPR_CHUNK 256     /* values per evaluation pass: 256 doubles per temporary keeps them all in L1 */

static const double fm_pi = 3.14159265358979323846;
static const double fm_e = 2.71828182845904523536;

/* ------------------------------------------------------------------------------------------------ functions */

/* Comparisons (gt, ge, lt, le, eq: 1 where the relation holds, else 0, so 0 for NaN operands as ONNX's Greater etc.)
 * and where(c, a, b) (a where c is not 0, NaN included, as a float's cast to bool; else b: the other argument's NaN
 * or infinity does not reach the result) are what ONNX exporters write for thresholds (torch's Softplus, Threshold,
 * Hardshrink and Softshrink by its dynamo exporter). */
/* The whitelist, one row per function: name, fewest and most arguments, the defaults of the 2nd and 3rd arguments
 * (torch.nn.functional's), the float32 CUDA spelling (a CUDA math function or an fm_ helper from
 * kernel_templates/activations.cuh; "" emits the argument itself) and the float64 definition in x, p, q (the
 * arguments), spelled as PyTorch's CPU kernels spell it (aten/src/ATen/native/cpu/Activation.cpp), so the CPU
 * forward is the oracle for the GPU. NaN propagates through every one, as in PyTorch, but the comparisons and where
 * (above). */
#define FM_FUNCTIONS(X)                                                    \
    X(abs, 1, 1, 0.0, 0.0, "fabsf", fabs(x))                               \
    X(sqrt, 1, 1, 0.0, 0.0, "sqrtf", sqrt(x))                              \
    X(exp, 1, 1, 0.0, 0.0, "expf", exp(x))                                 \
    X(exp2, 1, 1, 0.0, 0.0, "exp2f", exp2(x))                              \
    X(log, 1, 1, 0.0, 0.0, "logf", log(x))                                 \
    X(log2, 1, 1, 0.0, 0.0, "log2f", log2(x))                              \
    X(log10, 1, 1, 0.0, 0.0, "log10f", log10(x))                           \
    X(log1p, 1, 1, 0.0, 0.0, "log1pf", log1p(x))                           \
    X(expm1, 1, 1, 0.0, 0.0, "expm1f", expm1(x))                           \
    X(sin, 1, 1, 0.0, 0.0, "fm_sin", sin(x))                                 \
    X(cos, 1, 1, 0.0, 0.0, "fm_cos", cos(x))                                 \
    X(tan, 1, 1, 0.0, 0.0, "tanf", tan(x))                                 \
    X(asin, 1, 1, 0.0, 0.0, "asinf", asin(x))                              \
    X(acos, 1, 1, 0.0, 0.0, "acosf", acos(x))                              \
    X(atan, 1, 1, 0.0, 0.0, "atanf", atan(x))                              \
    X(sinh, 1, 1, 0.0, 0.0, "sinhf", sinh(x))                              \
    X(cosh, 1, 1, 0.0, 0.0, "coshf", cosh(x))                              \
    X(tanh, 1, 1, 0.0, 0.0, "fm_tanh", tanh(x))                              \
    X(erf, 1, 1, 0.0, 0.0, "erff", erf(x))                                 \
    X(floor, 1, 1, 0.0, 0.0, "floorf", floor(x))                           \
    X(ceil, 1, 1, 0.0, 0.0, "ceilf", ceil(x))                              \
    X(min, 2, 2, 0.0, 0.0, "fm_min", fm_d_min(x, p))                       \
    X(max, 2, 2, 0.0, 0.0, "fm_max", fm_d_max(x, p))                       \
    X(pow, 2, 2, 0.0, 0.0, "powf", pow(x, p))                              \
    X(none, 1, 1, 0.0, 0.0, "", x)                                         \
    X(identity, 1, 1, 0.0, 0.0, "", x)                                     \
    X(relu, 1, 1, 0.0, 0.0, "fm_relu", fm_d_relu(x))                       \
    X(leaky_relu, 1, 2, 0.01, 0.0, "fm_leaky_relu", fm_d_leaky_relu(x, p)) \
    X(elu, 1, 2, 1.0, 0.0, "fm_elu", fm_d_elu(x, p))                       \
    X(selu, 1, 1, 0.0, 0.0, "fm_selu", fm_d_selu(x))                       \
    X(gelu, 1, 1, 0.0, 0.0, "fm_gelu", fm_d_gelu(x))                       \
    X(gelu_tanh, 1, 1, 0.0, 0.0, "fm_gelu_tanh", fm_d_gelu_tanh(x))        \
    X(silu, 1, 1, 0.0, 0.0, "fm_silu", fm_d_silu(x))                       \
    X(sigmoid, 1, 1, 0.0, 0.0, "fm_sigmoid", fm_d_sigmoid(x))              \
    X(softplus, 1, 3, 1.0, 20.0, "fm_softplus", fm_d_softplus(x, p, q))    \
    X(mish, 1, 1, 0.0, 0.0, "fm_mish", fm_d_mish(x))                       \
    X(square, 1, 1, 0.0, 0.0, "fm_square", x * x)                          \
    X(hardtanh, 1, 3, -1.0, 1.0, "fm_hardtanh", fm_d_hardtanh(x, p, q))    \
    X(hardsigmoid, 1, 1, 0.0, 0.0, "fm_hardsigmoid", fm_d_hardsigmoid(x))  \
    X(hardswish, 1, 1, 0.0, 0.0, "fm_hardswish", fm_d_hardswish(x))        \
    X(softsign, 1, 1, 0.0, 0.0, "fm_softsign", fm_d_softsign(x))          \
    X(gt, 2, 2, 0.0, 0.0, "fm_gt", (x > p ? 1.0 : 0.0))                     \
    X(ge, 2, 2, 0.0, 0.0, "fm_ge", (x >= p ? 1.0 : 0.0))                    \
    X(lt, 2, 2, 0.0, 0.0, "fm_lt", (x < p ? 1.0 : 0.0))                     \
    X(le, 2, 2, 0.0, 0.0, "fm_le", (x <= p ? 1.0 : 0.0))                    \
    X(eq, 2, 2, 0.0, 0.0, "fm_eq", (x == p ? 1.0 : 0.0))                    \
    X(where, 3, 3, 0.0, 0.0, "fm_where", (x != 0.0 ? p : q))

/* One array kernel per function: d[i] = f(a[0][i], a[1][i], a[2][i]). d may alias a[0]; arguments a function does
 * not take point at a[0] and their loads are dead code. */
typedef void (*fm_cpu_fn)(double *d, const double *const *a, size_t n);

typedef struct fm_func {
    const char *name;
    int min_args, max_args;
    double defaults[FM_EXPR_MAX_ARGS - 1]; /* values of the 2nd and 3rd arguments when left out */
    const char *cuda;                      /* float32 spelling; "" is the identity */
    fm_cpu_fn cpu;                         /* float64 array kernel */
} fm_func;

#define FM_FUNC_ENUM(n, lo, hi, d1, d2, cuda, f64) FM_FUNC_##n,

enum { FM_FUNCTIONS(FM_FUNC_ENUM) FM_FUNC_COUNT };
extern const fm_func fm_funcs[]; /* one row per FM_FUNC_*, in that order (expr_funcs.c) */

/* The FM_FUNC_* index of the function called name[0..len), or -1. */
int fm_func_find(const char *name, size_t len);

/* ------------------------------------------------------------------------------------------------ numbers */

static inline int fm_is_digit(int c) { return c >= '0' && c <= '9'; }
static inline int fm_is_alpha(int c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static inline int fm_is_alnum(int c) { return fm_is_alpha(c) || fm_is_digit(c); }

/* The length of the decimal number at s (0 if none) and its value (expr_parse.c). */
size_t fm_scan_number(const char *s, double *value);

/* ------------------------------------------------------------------------------------------------ tree */

typedef enum fm_node_kind {
    FM_NODE_NUM, /* value */
    FM_NODE_VAR, /* x */
    FM_NODE_PI,
    FM_NODE_E,
    FM_NODE_NEG, /* -arg[0] */
    FM_NODE_ADD,
    FM_NODE_SUB,
    FM_NODE_MUL,
    FM_NODE_DIV,
    FM_NODE_POW, /* arg[0] ^ arg[1]; pow(a, b) parses to this too */
    FM_NODE_CALL /* fm_funcs[func](arg[0..nargs-1]), defaults filled in */
} fm_node_kind;

typedef struct fm_node {
    fm_node_kind kind;
    int func;   /* FM_NODE_CALL: index into fm_funcs */
    int nargs;  /* children in arg[] */
    int height; /* 1 for a leaf; at most FM_EXPR_MAX_DEPTH + 1 */
    double value;
    struct fm_node *arg[FM_EXPR_MAX_ARGS];
} fm_node;

struct fm_expr {
    fm_node *root;
};

/* The integer exponent of x^n when it is a constant with |n| <= FM_EXPR_MAX_POWI, else 0 with *ok = 0. */
static inline int fm_powi_exponent(const fm_node *n, int *ok) {
    const fm_node *ex = n->arg[1];
    *ok = ex->kind == FM_NODE_NUM && ex->value == floor(ex->value) && fabs(ex->value) <= FM_EXPR_MAX_POWI;
    return *ok ? (int)ex->value : 0;
}

#endif /* FM_EXPR_INTERNAL_H */
