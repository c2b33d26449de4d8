/*
 * expr_range.c - interval arithmetic over an expression tree (fm_expr_range): what the plan and the residual checks
 * know of an activation's values, and the largest argument its sin/cos may see.
 */
#include "expr_internal.h"

#include <math.h>

/* Interval arithmetic over the tree: [lo, hi] holds every non-NaN value a node takes for x in the input interval
 * (NaN results are left out: the kernels' sin/cos give NaN for NaN in either form). Anything not modelled below is
 * the whole line, so the answer is always an enclosure, often a loose one. `trig` collects the largest |argument|
 * any sin/cos node may see. */
typedef struct fm_iv {
    double lo, hi;
} fm_iv;

static fm_iv fm_iv_all(void) { return (fm_iv){-INFINITY, INFINITY}; }
static fm_iv fm_iv_of(double a, double b) { return isnan(a) || isnan(b) ? fm_iv_all() : (fm_iv){a, b}; }
static double fm_iv_mag(fm_iv a) { return fmax(fabs(a.lo), fabs(a.hi)); }
/* The smallest |x| in a: 0 where it holds 0. */
static double fm_iv_mig(fm_iv a) { return a.lo <= 0.0 && a.hi >= 0.0 ? 0.0 : fmin(fabs(a.lo), fabs(a.hi)); }
static fm_iv fm_iv_mul(fm_iv a, fm_iv b) {
    double p[4] = {a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi}, lo = p[0], hi = p[0];
    for (int i = 0; i < 4; i++) {
        if (isnan(p[i])) /* 0 * inf */
            return fm_iv_all();
        lo = fmin(lo, p[i]);
        hi = fmax(hi, p[i]);
    }
    return (fm_iv){lo, hi};
}
/* a^k for a whole k >= 0: monotone for odd k, through |a| for even k. */
static fm_iv fm_iv_powi(fm_iv a, int k) {
    if (k % 2)
        return fm_iv_of(pow(a.lo, k), pow(a.hi, k));
    return fm_iv_of(pow(fm_iv_mig(a), k), pow(fm_iv_mag(a), k));
}

/* Function nd (a whitelist call) at the single value x, its 2nd and 3rd arguments p[0], p[1]. */
static double fm_range_at(const fm_node *nd, double x, const double *p) {
    double d;
    const double *args[FM_EXPR_MAX_ARGS] = {&x, &p[0], &p[1]};
    fm_funcs[nd->func].cpu(&d, args, 1);
    return d;
}

/* A call's value over [lo, hi] where it is monotone: non-decreasing (up) or non-increasing, from its endpoints. */
static fm_iv fm_range_monotone(const fm_node *nd, double lo, double hi, const double *p, int up) {
    const double a = fm_range_at(nd, lo, p), b = fm_range_at(nd, hi, p);
    return up ? fm_iv_of(a, b) : fm_iv_of(b, a);
}

static fm_iv fm_range_node(const fm_node *nd, fm_iv x, double *trig) {
    switch (nd->kind) {
    case FM_NODE_NUM: return (fm_iv){nd->value, nd->value};
    case FM_NODE_PI: return (fm_iv){fm_pi, fm_pi};
    case FM_NODE_E: return (fm_iv){fm_e, fm_e};
    case FM_NODE_VAR: return x;
    default: break;
    }
    fm_iv a[FM_EXPR_MAX_ARGS];
    for (int i = 0; i < nd->nargs; i++)
        a[i] = fm_range_node(nd->arg[i], x, trig);
    int ok = 0, k = nd->kind == FM_NODE_POW ? fm_powi_exponent(nd, &ok) : 0;
    switch (nd->kind) {
    case FM_NODE_NEG: return (fm_iv){-a[0].hi, -a[0].lo};
    case FM_NODE_ADD: return fm_iv_of(a[0].lo + a[1].lo, a[0].hi + a[1].hi);
    case FM_NODE_SUB: return fm_iv_of(a[0].lo - a[1].hi, a[0].hi - a[1].lo);
    case FM_NODE_MUL: return fm_iv_mul(a[0], a[1]);
    case FM_NODE_DIV:
        if (a[1].lo <= 0.0 && a[1].hi >= 0.0)
            return fm_iv_all();
        return fm_iv_mul(a[0], (fm_iv){1.0 / a[1].hi, 1.0 / a[1].lo});
    case FM_NODE_POW: return ok && k >= 0 ? fm_iv_powi(a[0], k) : fm_iv_all();
    case FM_NODE_CALL: break;
    default: return fm_iv_all();
    }
    const double lo = a[0].lo, hi = a[0].hi;
    /* The 2nd and 3rd arguments where they are single values (constants), else NaN: the defaults where left out. */
    double p[FM_EXPR_MAX_ARGS - 1];
    for (int i = 0; i < FM_EXPR_MAX_ARGS - 1; i++)
        p[i] = nd->nargs > i + 1 ? (a[i + 1].lo == a[i + 1].hi ? a[i + 1].lo : NAN) : fm_funcs[nd->func].defaults[i];
    switch (nd->func) {
    case FM_FUNC_sin:
    case FM_FUNC_cos:
        *trig = fmax(*trig, fm_iv_mag(a[0]));
        return (fm_iv){-1.0, 1.0};
    case FM_FUNC_tanh:
    case FM_FUNC_erf:
    case FM_FUNC_softsign: return (fm_iv){-1.0, 1.0};
    case FM_FUNC_sigmoid:
    case FM_FUNC_hardsigmoid:
    case FM_FUNC_gt:
    case FM_FUNC_ge:
    case FM_FUNC_lt:
    case FM_FUNC_le:
    case FM_FUNC_eq: return (fm_iv){0.0, 1.0};
    case FM_FUNC_where: return (fm_iv){fmin(a[1].lo, a[2].lo), fmax(a[1].hi, a[2].hi)};
    case FM_FUNC_atan: return (fm_iv){-fm_pi / 2, fm_pi / 2};
    case FM_FUNC_none:
    case FM_FUNC_identity: return a[0];
    case FM_FUNC_relu: return (fm_iv){fmax(lo, 0.0), fmax(hi, 0.0)};
    case FM_FUNC_abs: return (fm_iv){fm_iv_mig(a[0]), fm_iv_mag(a[0])};
    case FM_FUNC_square: return fm_iv_powi(a[0], 2);
    case FM_FUNC_min: return (fm_iv){fmin(lo, a[1].lo), fmin(hi, a[1].hi)};
    case FM_FUNC_max: return (fm_iv){fmax(lo, a[1].lo), fmax(hi, a[1].hi)};
    case FM_FUNC_exp: return (fm_iv){exp(lo), exp(hi)};
    case FM_FUNC_floor: return (fm_iv){floor(lo), floor(hi)};
    case FM_FUNC_ceil: return (fm_iv){ceil(lo), ceil(hi)};
    /* x sigmoid(x), x Phi(x), x tanh(softplus(x)): at least -0.31 (their minima: -0.2785, -0.1700, -0.3088) and at
     * most max(x, 0) */
    case FM_FUNC_silu:
    case FM_FUNC_gelu:
    case FM_FUNC_gelu_tanh:
    case FM_FUNC_mish: return (fm_iv){-0.31, fmax(hi, 0.0)};
    case FM_FUNC_hardswish: return (fm_iv){-0.375, fmax(hi, 0.0)}; /* its minimum, at x = -1.5 */
    /* Monotone, so the endpoints bound them (below their domains the values are NaN, which ranges leave out). */
    case FM_FUNC_exp2:
    case FM_FUNC_expm1:
    case FM_FUNC_sinh:
    case FM_FUNC_selu: return fm_range_monotone(nd, lo, hi, p, 1);
    case FM_FUNC_sqrt:
    case FM_FUNC_log:
    case FM_FUNC_log2:
    case FM_FUNC_log10: return hi < 0.0 ? fm_iv_all() : fm_range_monotone(nd, fmax(lo, 0.0), hi, p, 1);
    case FM_FUNC_log1p: return hi < -1.0 ? fm_iv_all() : fm_range_monotone(nd, fmax(lo, -1.0), hi, p, 1);
    case FM_FUNC_asin:
    case FM_FUNC_acos:
        if (hi < -1.0 || lo > 1.0)
            return fm_iv_all();
        return fm_range_monotone(nd, fmax(lo, -1.0), fmin(hi, 1.0), p, nd->func == FM_FUNC_asin);
    case FM_FUNC_cosh: /* even, increasing in |x| */
        return fm_iv_of(cosh(fm_iv_mig(a[0])), cosh(fm_iv_mag(a[0])));
    case FM_FUNC_leaky_relu: /* slope >= 0 */
    case FM_FUNC_elu:        /* alpha >= 0 */
        return p[0] >= 0.0 ? fm_range_monotone(nd, lo, hi, p, 1) : fm_iv_all();
    case FM_FUNC_hardtanh: /* min(max(x, lo), hi) for lo <= hi */
        return p[0] <= p[1] ? fm_range_monotone(nd, lo, hi, p, 1) : fm_iv_all();
    case FM_FUNC_softplus: {
        /* beta > 0: log1p(exp(beta x)) / beta up to x0 = threshold / beta, x past it; each piece increasing, and the
         * first ends a little above x0 (by about exp(-threshold) / beta), so the pieces' ends bound the jump. */
        const double x0 = p[1] / p[0];
        if (!(p[0] > 0.0) || isnan(x0))
            return fm_iv_all();
        fm_iv r = fm_range_monotone(nd, lo, hi, p, 1);
        if (lo <= x0 && hi > x0)
            r = fm_iv_of(fmin(r.lo, x0), fmax(r.hi, fm_range_at(nd, x0, p)));
        return r;
    }
    default: return fm_iv_all();
    }
}

double fm_expr_range(const fm_expr *e, double lo, double hi, double *out_lo, double *out_hi) {
    double trig = 0.0;
    fm_iv r = fm_range_node(e->root, (fm_iv){lo, hi}, &trig);
    *out_lo = r.lo;
    *out_hi = r.hi;
    return isnan(trig) ? INFINITY : trig;
}
