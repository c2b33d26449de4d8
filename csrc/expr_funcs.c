/*
 * expr_funcs.c - the activation expressions' function whitelist (FM_FUNCTIONS in expr_internal.h): the float64
 * definition of every function, its array kernel for the evaluator, and the name lookup the parser uses.
 */
#include "expr_internal.h"

#include <math.h>
#include <string.h>

/* SELU's constants as torch.nn.functional.selu spells them (Klambauer et al. 2017, eq. 14). */
static const double fm_selu_alpha = 1.6732632423543772848170429916717;
static const double fm_selu_scale = 1.0507009873554804934193349852946;

static double fm_d_min(double a, double b) { return (a < b || isnan(a)) ? a : b; }
static double fm_d_max(double a, double b) { return (a > b || isnan(a)) ? a : b; }
static double fm_d_relu(double x) { return x < 0.0 ? 0.0 : x; }
static double fm_d_leaky_relu(double x, double slope) { return x > 0.0 ? x : x * slope; }
static double fm_d_elu(double x, double alpha) { return x <= 0.0 ? expm1(x) * alpha : x; }
static double fm_d_selu(double x) { return x <= 0.0 ? expm1(x) * (fm_selu_alpha * fm_selu_scale) : x * fm_selu_scale; }
static double fm_d_gelu(double x) { return x * 0.5 * (1.0 + erf(x * 0.70710678118654752440)); }
static double fm_d_gelu_tanh(double x) {
    const double beta = 0.79788456080286535588; /* sqrt(2/pi) */
    return 0.5 * x * (1.0 + tanh(beta * (x + 0.044715 * (x * x * x))));
}
/* 1/(1+exp(-x)) for x >= 0 and exp(x)/(1+exp(x)) below: exp never overflows, so no inf/inf and full relative
 * precision for very negative x. */
static double fm_d_sigmoid(double x) {
    if (x >= 0.0)
        return 1.0 / (1.0 + exp(-x));
    double t = exp(x);
    return t / (1.0 + t);
}
static double fm_d_silu(double x) { return x / (1.0 + exp(-x)); }
static double fm_d_softplus(double x, double beta, double threshold) {
    return x * beta > threshold ? x : log1p(exp(x * beta)) / beta;
}
static double fm_d_mish(double x) { return x * tanh(log1p(exp(x))); }
static double fm_d_hardtanh(double x, double lo, double hi) { return x < lo ? lo : (x > hi ? hi : x); }
static double fm_d_relu6(double x) { return x < 0.0 ? 0.0 : (x > 6.0 ? 6.0 : x); }
static double fm_d_hardsigmoid(double x) { return fm_d_relu6(x + 3.0) / 6.0; }
static double fm_d_hardswish(double x) { return x * fm_d_relu6(x + 3.0) / 6.0; }
static double fm_d_softsign(double x) { return x / (1.0 + fabs(x)); }

#define FM_FUNC_KERNEL(name, lo, hi, d1, d2, cuda, f64)                                                             \
    static void fm_cpu_##name(double *d, const double *const *a, size_t n) {                                       \
        const double *a0 = a[0], *a1 = a[1], *a2 = a[2];                                                            \
        for (size_t i = 0; i < n; i++) {                                                                            \
            double x = a0[i], p = a1[i], q = a2[i];                                                                 \
            (void)p, (void)q;                                                                                       \
            d[i] = (f64);                                                                                           \
        }                                                                                                           \
    }
FM_FUNCTIONS(FM_FUNC_KERNEL)

#define FM_FUNC_ROW(n, lo, hi, d1, d2, cuda, f64) {#n, lo, hi, {d1, d2}, cuda, fm_cpu_##n},
#define FM_FUNC_NAME(n, lo, hi, d1, d2, cuda, f64) #n,

const fm_func fm_funcs[] = {FM_FUNCTIONS(FM_FUNC_ROW)};
static const char *const fm_func_names[] = {FM_FUNCTIONS(FM_FUNC_NAME) NULL};

const char *const *fm_expr_functions(void) { return fm_func_names; }

int fm_func_find(const char *name, size_t len) {
    for (int i = 0; i < FM_FUNC_COUNT; i++)
        if (strlen(fm_funcs[i].name) == len && memcmp(fm_funcs[i].name, name, len) == 0)
            return i;
    return -1;
}
