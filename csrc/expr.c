/*
 * expr.c - activation expressions: a recursive-descent parser to a checked AST, and the three readers of that AST
 * (CUDA emitter, canonical text, vectorised float64 evaluator).
 *
 * The expression is user input that ends up inside generated CUDA source, so the user's text is never copied out:
 * the emitter writes only fixed spellings from the function table, the caller's variable name and numbers it
 * formats itself. Every tree is at most FM_EXPR_MAX_DEPTH levels high, so the recursive walks below cannot
 * overflow the stack whatever the input.
 */
#include "fm.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* The whitelist, one row per function: name, fewest and most arguments, the defaults of the 2nd and 3rd arguments
 * (torch.nn.functional's), the float32 CUDA spelling (a CUDA math function or an fm_ helper from
 * kernel_templates/activations.cuh; "" emits the argument itself) and the float64 definition in x, p, q (the
 * arguments), spelled as PyTorch's CPU kernels spell it (aten/src/ATen/native/cpu/Activation.cpp), so the CPU
 * forward is the oracle for the GPU. NaN propagates through every one, as in PyTorch. */
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
    X(softsign, 1, 1, 0.0, 0.0, "fm_softsign", fm_d_softsign(x))

/* One array kernel per function: d[i] = f(a[0][i], a[1][i], a[2][i]). d may alias a[0]; arguments a function does
 * not take point at a[0] and their loads are dead code. */
typedef void (*fm_cpu_fn)(double *d, const double *const *a, size_t n);

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

typedef struct fm_func {
    const char *name;
    int min_args, max_args;
    double defaults[FM_EXPR_MAX_ARGS - 1]; /* values of the 2nd and 3rd arguments when left out */
    const char *cuda;                      /* float32 spelling; "" is the identity */
    fm_cpu_fn cpu;                         /* float64 array kernel */
} fm_func;

#define FM_FUNC_ROW(n, lo, hi, d1, d2, cuda, f64) {#n, lo, hi, {d1, d2}, cuda, fm_cpu_##n},
#define FM_FUNC_NAME(n, lo, hi, d1, d2, cuda, f64) #n,
#define FM_FUNC_ENUM(n, lo, hi, d1, d2, cuda, f64) FM_FUNC_##n,

enum { FM_FUNCTIONS(FM_FUNC_ENUM) FM_FUNC_COUNT };
static const fm_func fm_funcs[] = {FM_FUNCTIONS(FM_FUNC_ROW)};
static const char *const fm_func_names[] = {FM_FUNCTIONS(FM_FUNC_NAME) NULL};

const char *const *fm_expr_functions(void) { return fm_func_names; }

static int fm_func_find(const char *name, size_t len) {
    for (int i = 0; i < FM_FUNC_COUNT; i++)
        if (strlen(fm_funcs[i].name) == len && memcmp(fm_funcs[i].name, name, len) == 0)
            return i;
    return -1;
}

/* ------------------------------------------------------------------------------------------------ numbers */

static int fm_is_digit(int c) { return c >= '0' && c <= '9'; }
static int fm_is_alpha(int c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static int fm_is_alnum(int c) { return fm_is_alpha(c) || fm_is_digit(c); }

/* Scans a decimal number at s (digits [. digits] [e [+-] digits], at least one mantissa digit) and returns its
 * length, 0 if there is none. The value goes through strtod as "<digits>e<exp>" with the point removed, because
 * strtod reads the decimal point of the C locale, and a host application may have called setlocale(). */
static size_t fm_scan_number(const char *s, double *value) {
    char buf[FM_EXPR_MAX_LEN + 32];
    size_t i = 0, nd = 0;
    long exp10 = 0;
    while (fm_is_digit(s[i]) && nd < FM_EXPR_MAX_LEN)
        buf[nd++] = s[i++];
    if (s[i] == '.') {
        i++;
        while (fm_is_digit(s[i]) && nd < FM_EXPR_MAX_LEN) {
            buf[nd++] = s[i++];
            exp10--;
        }
    }
    if (nd == 0)
        return 0;
    if ((s[i] == 'e' || s[i] == 'E') &&
        (fm_is_digit(s[i + 1]) || ((s[i + 1] == '+' || s[i + 1] == '-') && fm_is_digit(s[i + 2])))) {
        i++;
        int neg = s[i] == '-';
        if (s[i] == '+' || s[i] == '-')
            i++;
        long ev = 0;
        for (; fm_is_digit(s[i]); i++)
            if (ev < 100000) /* saturate: 1e100000 is inf and 1e-100000 is 0 either way */
                ev = ev * 10 + (s[i] - '0');
        exp10 += neg ? -ev : ev;
    }
    snprintf(buf + nd, sizeof buf - nd, "e%ld", exp10);
    *value = strtod(buf, NULL);
    return i;
}

/* Formats |v| with prec significant digits into buf, replacing the locale's decimal point (whatever its bytes)
 * with '.': %g prints only digits, 'e', signs and that point. */
static void fm_format_abs(double v, int prec, char *buf, size_t size) {
    char tmp[64];
    snprintf(tmp, sizeof tmp, "%.*g", prec, fabs(v));
    size_t j = 0;
    for (size_t i = 0; tmp[i] != '\0' && j + 1 < size; i++) {
        char c = tmp[i];
        if (fm_is_digit(c) || c == 'e' || c == '+' || c == '-')
            buf[j++] = c;
        else if (j == 0 || buf[j - 1] != '.')
            buf[j++] = '.';
    }
    buf[j] = '\0';
}

/* The shortest text that reads back as exactly |v| (for canonical text and cache keys), written without an
 * exponent up to 1e17: "20", not the "2e+01" that %.1g gives. */
static void fm_format_shortest(double v, char *buf, size_t size) {
    int prec = 1;
    for (; prec < 17; prec++) {
        double back = 0.0;
        fm_format_abs(v, prec, buf, size);
        if (fm_scan_number(buf, &back) == strlen(buf) && back == fabs(v))
            break;
    }
    char tmp[64];
    snprintf(tmp, sizeof tmp, "%.*e", prec - 1, fabs(v));
    const char *ex = strchr(tmp, 'e');
    int x10 = ex != NULL ? atoi(ex + 1) : 0; /* %g prints fixed-point when -4 <= x10 < precision */
    if (x10 >= prec && x10 < 17)
        prec = x10 + 1;
    fm_format_abs(v, prec, buf, size);
}

/* A float literal that rounds back to the same float: 9 significant digits suffice for binary32 (IEEE 754-2008,
 * 5.12.2). "1" gets ".0" because "1f" is not a C literal; negatives are parenthesised so that "-" never meets
 * another operator. */
static void fm_emit_float(fm_str *out, double v) {
    char buf[64];
    float f = (float)v;
    fm_format_abs((double)f, 9, buf, sizeof buf);
    if (strchr(buf, '.') == NULL && strchr(buf, 'e') == NULL)
        strcat(buf, ".0");
    fm_str_printf(out, signbit(f) ? "(-%sf)" : "%sf", buf);
}

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

static void fm_node_free(fm_node *n) {
    if (n == NULL)
        return;
    for (int i = 0; i < n->nargs; i++)
        fm_node_free(n->arg[i]);
    free(n);
}

/* The integer exponent of x^n when it is a constant with |n| <= FM_EXPR_MAX_POWI, else 0 with *ok = 0. */
static int fm_powi_exponent(const fm_node *n, int *ok) {
    const fm_node *ex = n->arg[1];
    *ok = ex->kind == FM_NODE_NUM && ex->value == floor(ex->value) && fabs(ex->value) <= FM_EXPR_MAX_POWI;
    return *ok ? (int)ex->value : 0;
}

/* ------------------------------------------------------------------------------------------------ parser */

typedef enum fm_tok_kind { FM_TOK_END, FM_TOK_NUM, FM_TOK_NAME, FM_TOK_PUNCT } fm_tok_kind;

typedef struct fm_parser {
    const char *text;
    size_t len;
    size_t pos;         /* next unread byte */
    fm_tok_kind kind;   /* the current token */
    size_t start, tlen; /* its bytes */
    double value;       /* its value, FM_TOK_NUM */
    int depth;          /* parse_unary frames open */
    int failed;         /* set by the first error, which alone is reported */
    fm_status status;   /* that error: FM_ERR_EXPR, or FM_ERR_NOMEM */
    fm_error *err;
} fm_parser;

/* Records the first syntax error: message plus 1-based column of byte `at`. */
static void fm_syntax(fm_parser *p, size_t at, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static void fm_syntax(fm_parser *p, size_t at, const char *fmt, ...) {
    if (p->failed)
        return;
    p->failed = 1;
    p->status = FM_ERR_EXPR;
    if (p->err == NULL || p->err->status != FM_OK)
        return;
    char msg[sizeof p->err->message];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fm_fail(p->err, FM_ERR_EXPR, "%s", msg);
    p->err->column = (int)at + 1;
}

static int fm_col(size_t at) { return (int)at + 1; }

/* The current token for a message: 'relu', '(' or "end of expression". Tokens hold only [A-Za-z0-9_.+-*^/(),]. */
static const char *fm_tok_text(const fm_parser *p, char *buf, size_t size) {
    if (p->kind == FM_TOK_END)
        return "end of expression";
    int n = p->tlen > 40 ? 40 : (int)p->tlen;
    snprintf(buf, size, "'%.*s%s'", n, p->text + p->start, p->tlen > 40 ? "..." : "");
    return buf;
}

static int fm_lex(fm_parser *p) {
    const char *s = p->text;
    while (p->pos < p->len && (s[p->pos] == ' ' || s[p->pos] == '\t'))
        p->pos++;
    p->start = p->pos;
    p->tlen = 0;
    if (p->pos >= p->len) {
        p->kind = FM_TOK_END;
        return 1;
    }
    unsigned char c = (unsigned char)s[p->pos];
    if (fm_is_digit(c) || (c == '.' && fm_is_digit(s[p->pos + 1]))) {
        size_t n = fm_scan_number(s + p->pos, &p->value);
        size_t end = p->pos + n;
        if (fm_is_alnum(s[end]) || s[end] == '.') {
            while (fm_is_alnum(s[end]) || s[end] == '.')
                end++;
            int shown = end - p->pos > 40 ? 40 : (int)(end - p->pos);
            fm_syntax(p, p->pos, "malformed number '%.*s' at column %d; numbers are decimal, like 2, 0.5, .5 or 1e-3 "
                      "(no hex, no suffixes, and write 2*x rather than 2x)", shown, s + p->pos, fm_col(p->pos));
            return 0;
        }
        p->kind = FM_TOK_NUM;
        p->tlen = n;
        p->pos = end;
        if (!isfinite(p->value) || fabs(p->value) > FLT_MAX) {
            int shown = n > 40 ? 40 : (int)n;
            fm_syntax(p, p->start, "number '%.*s' at column %d is beyond float32 range (largest finite is %.9g)",
                      shown, s + p->start, fm_col(p->start), (double)FLT_MAX);
            return 0;
        }
        return 1;
    }
    if (fm_is_alpha(c)) {
        while (fm_is_alnum(s[p->pos]))
            p->pos++;
        p->kind = FM_TOK_NAME;
        p->tlen = p->pos - p->start;
        return 1;
    }
    if (strchr("+-*/^(),", c) != NULL) { /* c != 0: pos < len */
        p->kind = FM_TOK_PUNCT;
        p->tlen = 1;
        p->pos++;
        return 1;
    }
    if (c >= 0x21 && c < 0x7f)
        fm_syntax(p, p->pos, "unexpected character '%c' at column %d", c, fm_col(p->pos));
    else
        fm_syntax(p, p->pos, "unexpected byte 0x%02X at column %d", c, fm_col(p->pos));
    fm_error_hint(p->err, "an expression holds only numbers, x, pi, e, function names, + - * / ^ ( ) , and spaces");
    return 0;
}

static int fm_is_punct(const fm_parser *p, char c) { return p->kind == FM_TOK_PUNCT && p->text[p->start] == c; }

/* Takes ownership of args (frees them on failure). Refuses trees higher than FM_EXPR_MAX_DEPTH levels: a long
 * chain like x+x+...+x is as deep as it is long, and every walk of the tree recurses. */
static fm_node *fm_node_new(fm_parser *p, fm_node_kind kind, size_t at, fm_node *const *args, int nargs) {
    int height = 1;
    for (int i = 0; i < nargs; i++)
        if (args[i]->height + 1 > height)
            height = args[i]->height + 1;
    fm_node *n = NULL;
    if (height > FM_EXPR_MAX_DEPTH + 1)
        fm_syntax(p, at, "expression nests more than %d operations deep at column %d", FM_EXPR_MAX_DEPTH, fm_col(at));
    else if ((n = calloc(1, sizeof *n)) == NULL && !p->failed) {
        p->failed = 1;
        p->status = FM_ERR_NOMEM;
        fm_fail(p->err, FM_ERR_NOMEM, "out of memory parsing an activation expression");
    }
    if (n == NULL) {
        for (int i = 0; i < nargs; i++)
            fm_node_free(args[i]);
        return NULL;
    }
    n->kind = kind;
    n->nargs = nargs;
    n->height = height;
    for (int i = 0; i < nargs; i++)
        n->arg[i] = args[i];
    return n;
}

static fm_node *fm_node_num(fm_parser *p, size_t at, double v) {
    fm_node *n = fm_node_new(p, FM_NODE_NUM, at, NULL, 0);
    if (n != NULL)
        n->value = v;
    return n;
}

static fm_node *fm_node_bin(fm_parser *p, fm_node_kind kind, size_t at, fm_node *a, fm_node *b) {
    fm_node *ab[2] = {a, b};
    return fm_node_new(p, kind, at, ab, 2);
}

static fm_node *fm_parse_expr(fm_parser *p);
static fm_node *fm_parse_unary(fm_parser *p);

static void fm_free_args(fm_node **args, int n) {
    for (int i = 0; i < n && i < FM_EXPR_MAX_ARGS; i++)
        fm_node_free(args[i]);
}

/* The call node for f(args[0..nargs-1]), missing optional arguments set to the table's defaults; pow(a, b) becomes
 * a ^ b. Takes ownership of args. */
static fm_node *fm_make_call(fm_parser *p, int f, size_t at, fm_node **args, int nargs) {
    const fm_func *fn = &fm_funcs[f];
    for (; nargs < fn->max_args; nargs++)
        if ((args[nargs] = fm_node_num(p, at, fn->defaults[nargs - 1])) == NULL)
            goto fail;
    if (f == FM_FUNC_hardtanh && args[1]->kind == FM_NODE_NUM && args[2]->kind == FM_NODE_NUM &&
        args[1]->value > args[2]->value) {
        /* torch.nn.Hardtanh refuses min_val > max_val as well */
        fm_syntax(p, at, "'hardtanh' at column %d has min %g greater than max %g", fm_col(at), args[1]->value,
                  args[2]->value);
        goto fail;
    }
    fm_node *n = fm_node_new(p, f == FM_FUNC_pow ? FM_NODE_POW : FM_NODE_CALL, at, args, nargs);
    if (n != NULL)
        n->func = f;
    return n;
fail:
    fm_free_args(args, nargs);
    return NULL;
}

/* After an opening '(' at byte `open`: the current token must close it. */
static int fm_expect_close(fm_parser *p, size_t open) {
    char buf[64];
    if (fm_is_punct(p, ')'))
        return 1;
    fm_syntax(p, p->start, "expected ')' to close '(' at column %d, found %s at column %d", fm_col(open),
              fm_tok_text(p, buf, sizeof buf), fm_col(p->start));
    return 0;
}

/* name '(' expr (',' expr)* ')', the current token being '('. Surplus arguments are parsed (to count them) and
 * dropped; missing optional ones get the table's defaults. */
static fm_node *fm_parse_call(fm_parser *p, int f, size_t at) {
    const fm_func *fn = &fm_funcs[f];
    fm_node *args[FM_EXPR_MAX_ARGS] = {NULL};
    int nargs = 0;
    size_t open = p->start;
    if (!fm_lex(p))
        return NULL;
    while (!fm_is_punct(p, ')')) {
        fm_node *a = fm_parse_expr(p);
        if (a == NULL)
            goto fail;
        if (nargs < FM_EXPR_MAX_ARGS)
            args[nargs] = a;
        else
            fm_node_free(a);
        nargs++;
        if (!fm_is_punct(p, ','))
            break;
        if (!fm_lex(p))
            goto fail;
    }
    if (!fm_expect_close(p, open))
        goto fail;
    if (nargs < fn->min_args || nargs > fn->max_args) {
        if (fn->min_args == fn->max_args)
            fm_syntax(p, at, "'%s' takes %d argument%s, got %d (at column %d)", fn->name, fn->min_args,
                      fn->min_args == 1 ? "" : "s", nargs, fm_col(at));
        else
            fm_syntax(p, at, "'%s' takes %d to %d arguments, got %d (at column %d)", fn->name, fn->min_args,
                      fn->max_args, nargs, fm_col(at));
        goto fail;
    }
    if (fm_lex(p))
        return fm_make_call(p, f, at, args, nargs);
fail:
    fm_free_args(args, nargs);
    return NULL;
}

static void fm_unknown_name(fm_parser *p) {
    char list[700] = "", name[48];
    int n = p->tlen > 40 ? 40 : (int)p->tlen;
    snprintf(name, sizeof name, "%.*s%s", n, p->text + p->start, p->tlen > 40 ? "..." : "");
    for (int i = 0; i < FM_FUNC_COUNT; i++) {
        size_t used = strlen(list);
        snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "", fm_funcs[i].name);
    }
    fm_syntax(p, p->start, "unknown name '%s' at column %d; known functions: %s; constants: pi, e; variable: x",
              name, fm_col(p->start), list);
    /* names are case-sensitive; point out the near miss */
    char lower[48];
    size_t k = 0;
    for (; k + 1 < sizeof lower && name[k] != '\0'; k++)
        lower[k] = (name[k] >= 'A' && name[k] <= 'Z') ? (char)(name[k] - 'A' + 'a') : name[k];
    lower[k] = '\0';
    if (strcmp(lower, name) != 0 && (fm_func_find(lower, k) >= 0 || strcmp(lower, "x") == 0 ||
                                     strcmp(lower, "pi") == 0 || strcmp(lower, "e") == 0))
        fm_error_hint(p->err, "names are case-sensitive: did you mean '%s'?", lower);
}

static fm_node *fm_parse_name(fm_parser *p) {
    const char *s = p->text + p->start;
    size_t at = p->start, len = p->tlen;
    fm_node_kind leaf = FM_NODE_CALL;
    if (len == 1 && s[0] == 'x')
        leaf = FM_NODE_VAR;
    else if (len == 2 && memcmp(s, "pi", 2) == 0)
        leaf = FM_NODE_PI;
    else if (len == 1 && s[0] == 'e')
        leaf = FM_NODE_E;
    if (leaf != FM_NODE_CALL) {
        if (!fm_lex(p))
            return NULL;
        if (fm_is_punct(p, '(')) {
            fm_syntax(p, at, "'%.*s' at column %d is not a function", (int)len, s, fm_col(at));
            return NULL;
        }
        return fm_node_new(p, leaf, at, NULL, 0);
    }
    int f = fm_func_find(s, len);
    if (f < 0) {
        fm_unknown_name(p);
        return NULL;
    }
    if (!fm_lex(p))
        return NULL;
    if (!fm_is_punct(p, '(')) {
        fm_syntax(p, at, "function '%s' at column %d needs its arguments, as in %s(x); a bare name means name(x) "
                  "only when it is the whole expression", fm_funcs[f].name, fm_col(at), fm_funcs[f].name);
        return NULL;
    }
    return fm_parse_call(p, f, at);
}

static fm_node *fm_parse_atom(fm_parser *p) {
    char buf[64];
    if (p->kind == FM_TOK_NUM) {
        size_t at = p->start;
        double v = p->value;
        return fm_lex(p) ? fm_node_num(p, at, v) : NULL;
    }
    if (p->kind == FM_TOK_NAME)
        return fm_parse_name(p);
    if (fm_is_punct(p, '(')) {
        size_t open = p->start;
        if (!fm_lex(p))
            return NULL;
        fm_node *n = fm_parse_expr(p);
        if (n != NULL && (!fm_expect_close(p, open) || !fm_lex(p))) {
            fm_node_free(n);
            n = NULL;
        }
        return n;
    }
    fm_syntax(p, p->start, "expected a number, x, a function call or '(' at column %d, found %s", fm_col(p->start),
              fm_tok_text(p, buf, sizeof buf));
    return NULL;
}

/* atom ('^' unary)?: right-associative, and 2^-1 is allowed because the exponent is a unary. */
static fm_node *fm_parse_power(fm_parser *p) {
    fm_node *base = fm_parse_atom(p);
    if (base == NULL || !fm_is_punct(p, '^'))
        return base;
    size_t at = p->start;
    fm_node *ex = fm_lex(p) ? fm_parse_unary(p) : NULL;
    if (ex == NULL) {
        fm_node_free(base);
        return NULL;
    }
    return fm_node_bin(p, FM_NODE_POW, at, base, ex);
}

/* Every cycle of the grammar's recursion passes through here, so counting frames here bounds the C stack. */
static fm_node *fm_parse_unary(fm_parser *p) {
    if (++p->depth > FM_EXPR_MAX_SYNTAX_DEPTH + 1) {
        fm_syntax(p, p->start, "expression nests more than %d levels deep at column %d", FM_EXPR_MAX_SYNTAX_DEPTH,
                  fm_col(p->start));
        p->depth--;
        return NULL;
    }
    fm_node *n;
    if (fm_is_punct(p, '-') || fm_is_punct(p, '+')) {
        int neg = fm_is_punct(p, '-');
        size_t at = p->start;
        n = fm_lex(p) ? fm_parse_unary(p) : NULL;
        if (n != NULL && neg) {
            if (n->kind == FM_NODE_NUM) /* -2 is the number -2: exact, and lets x^-2 unroll */
                n->value = -n->value;
            else
                n = fm_node_new(p, FM_NODE_NEG, at, &n, 1);
        }
    } else {
        n = fm_parse_power(p);
    }
    p->depth--;
    return n;
}

/* expr (sums, additive = 1) and term (products, additive = 0): left-associative chains of their operands. */
static fm_node *fm_parse_chain(fm_parser *p, int additive) {
    char op_a = additive ? '+' : '*', op_b = additive ? '-' : '/';
    fm_node *lhs = additive ? fm_parse_chain(p, 0) : fm_parse_unary(p);
    while (lhs != NULL && (fm_is_punct(p, op_a) || fm_is_punct(p, op_b))) {
        fm_node_kind kind = fm_is_punct(p, op_a) ? (additive ? FM_NODE_ADD : FM_NODE_MUL)
                                                 : (additive ? FM_NODE_SUB : FM_NODE_DIV);
        size_t at = p->start;
        fm_node *rhs = !fm_lex(p) ? NULL : additive ? fm_parse_chain(p, 0) : fm_parse_unary(p);
        if (rhs == NULL) {
            fm_node_free(lhs);
            return NULL;
        }
        lhs = fm_node_bin(p, kind, at, lhs, rhs);
    }
    return lhs;
}

static fm_node *fm_parse_expr(fm_parser *p) { return fm_parse_chain(p, 1); }

/* A whole expression that is one function name ("relu", " gelu ") means name(x). */
static fm_node *fm_parse_bare_name(fm_parser *p) {
    if (p->kind != FM_TOK_NAME)
        return NULL;
    int f = fm_func_find(p->text + p->start, p->tlen);
    size_t i = p->start + p->tlen;
    while (i < p->len && (p->text[i] == ' ' || p->text[i] == '\t'))
        i++;
    if (f < 0 || i != p->len || fm_funcs[f].min_args > 1)
        return NULL;
    fm_node *args[FM_EXPR_MAX_ARGS] = {fm_node_new(p, FM_NODE_VAR, p->start, NULL, 0)};
    fm_node *n = args[0] != NULL ? fm_make_call(p, f, p->start, args, 1) : NULL;
    p->pos = p->len;
    p->kind = FM_TOK_END;
    p->start = p->len;
    return n;
}

fm_status fm_expr_parse(const char *text, fm_expr **out, fm_error *err) {
    if (out == NULL)
        return fm_fail(err, FM_ERR_INTERNAL, "fm_expr_parse: out is NULL");
    *out = NULL;
    fm_parser p = {.text = text, .err = err};
    if (text == NULL) {
        fm_syntax(&p, 0, "activation expression is NULL");
        return FM_ERR_EXPR;
    }
    while (p.len <= FM_EXPR_MAX_LEN && text[p.len] != '\0') /* bounded: never walks a huge string to its end */
        p.len++;
    if (p.len > FM_EXPR_MAX_LEN) {
        fm_syntax(&p, FM_EXPR_MAX_LEN, "expression is longer than %d characters", FM_EXPR_MAX_LEN);
        return FM_ERR_EXPR;
    }
    if (!fm_lex(&p))
        return p.status;
    if (p.kind == FM_TOK_END) {
        fm_syntax(&p, 0, "empty expression");
        fm_error_hint(err, "write an activation name such as relu or an expression in x such as x * sigmoid(x)");
        return FM_ERR_EXPR;
    }
    fm_node *root = fm_parse_bare_name(&p);
    if (root == NULL && !p.failed)
        root = fm_parse_expr(&p);
    if (root != NULL && p.kind != FM_TOK_END) {
        char buf[64];
        if (fm_is_punct(&p, ')'))
            fm_syntax(&p, p.start, "unexpected ')' at column %d: it closes no '('", fm_col(p.start));
        else
            fm_syntax(&p, p.start, "unexpected %s at column %d after a complete expression",
                      fm_tok_text(&p, buf, sizeof buf), fm_col(p.start));
        fm_error_hint(err, "operators are + - * / ^; write 2*x, not 2x or 2 x");
        fm_node_free(root);
        root = NULL;
    }
    fm_expr *e = root != NULL ? malloc(sizeof *e) : NULL;
    if (e == NULL) {
        fm_node_free(root);
        if (!p.failed)
            return fm_fail(err, FM_ERR_NOMEM, "out of memory parsing an activation expression");
        return p.status;
    }
    e->root = root;
    *out = e;
    return FM_OK;
}

void fm_expr_free(fm_expr *e) {
    if (e == NULL)
        return;
    fm_node_free(e->root);
    free(e);
}

/* ------------------------------------------------------------------------------------------------ emit, text */

/* One walker writes both texts: CUDA when var is set (float literals, CUDA spellings, x^n unrolled), canonical when
 * var is NULL (shortest exact numbers, whitelist names, pi and e by name). Both are fully parenthesised. */
static void fm_write_node(const fm_node *n, const char *var, fm_str *out);

static void fm_write_number(double v, const char *var, fm_str *out) {
    char buf[64];
    if (var != NULL) {
        fm_emit_float(out, v);
        return;
    }
    fm_format_shortest(v, buf, sizeof buf);
    fm_str_printf(out, signbit(v) ? "(-%s)" : "%s", buf);
}

/* x^n with a small integer n: multiplications in the order fm_powi (activations.cuh) and the CPU use, inline for a
 * leaf base, through fm_powi otherwise so a subexpression is neither copied nor computed twice. */
static void fm_emit_powi(const fm_node *base, int k, const char *var, fm_str *out) {
    if (k == 0) {
        fm_str_append(out, "1.0f");
        return;
    }
    if (base->nargs > 0) {
        fm_str_append(out, "fm_powi(");
        fm_write_node(base, var, out);
        fm_str_printf(out, ", %d)", k);
        return;
    }
    fm_str_append(out, k < 0 ? "(1.0f / (" : "(");
    for (int i = 0; i < (k < 0 ? -k : k); i++) {
        fm_str_append(out, i > 0 ? " * " : "");
        fm_write_node(base, var, out);
    }
    fm_str_append(out, k < 0 ? "))" : ")");
}

static void fm_write_node(const fm_node *n, const char *var, fm_str *out) {
    static const char *const ops[] = {
        [FM_NODE_ADD] = " + ", [FM_NODE_SUB] = " - ", [FM_NODE_MUL] = " * ", [FM_NODE_DIV] = " / ", [FM_NODE_POW] = " ^ "};
    int ok = 0, k = n->kind == FM_NODE_POW ? fm_powi_exponent(n, &ok) : 0;
    switch (n->kind) {
    case FM_NODE_NUM: fm_write_number(n->value, var, out); return;
    case FM_NODE_VAR: fm_str_append(out, var != NULL ? var : "x"); return;
    case FM_NODE_PI: var != NULL ? fm_emit_float(out, fm_pi) : fm_str_append(out, "pi"); return;
    case FM_NODE_E: var != NULL ? fm_emit_float(out, fm_e) : fm_str_append(out, "e"); return;
    case FM_NODE_NEG: fm_str_append(out, "(-"); break;
    case FM_NODE_POW:
        if (var != NULL && ok) {
            fm_emit_powi(n->arg[0], k, var, out);
            return;
        }
        fm_str_append(out, var != NULL ? "powf(" : "(");
        break;
    case FM_NODE_ADD:
    case FM_NODE_SUB:
    case FM_NODE_MUL:
    case FM_NODE_DIV: fm_str_append(out, "("); break;
    case FM_NODE_CALL:
        fm_str_append(out, var != NULL ? fm_funcs[n->func].cuda : fm_funcs[n->func].name);
        fm_str_append(out, "(");
        break;
    }
    const char *sep = n->kind == FM_NODE_CALL || (n->kind == FM_NODE_POW && var != NULL) ? ", " : ops[n->kind];
    for (int i = 0; i < n->nargs; i++) {
        if (i > 0)
            fm_str_append(out, sep);
        fm_write_node(n->arg[i], var, out);
    }
    fm_str_append(out, ")");
}

fm_status fm_expr_emit_cuda(const fm_expr *e, const char *var, fm_str *out, fm_error *err) {
    if (e == NULL || var == NULL || out == NULL)
        return fm_fail(err, FM_ERR_INTERNAL, "fm_expr_emit_cuda: NULL argument");
    /* var comes from the renderer, but it lands in source too: only an identifier may */
    int ok = fm_is_alpha(var[0]);
    for (size_t i = 1; ok && var[i] != '\0'; i++)
        ok = fm_is_alnum(var[i]) && i < 64;
    if (!ok)
        return fm_fail(err, FM_ERR_INTERNAL, "fm_expr_emit_cuda: variable name is not a C identifier");
    fm_write_node(e->root, var, out);
    if (out->oom)
        return fm_fail(err, FM_ERR_NOMEM, "out of memory emitting an activation expression");
    return FM_OK;
}

void fm_expr_to_string(const fm_expr *e, fm_str *out) {
    if (e != NULL && out != NULL)
        fm_write_node(e->root, NULL, out);
}

const char *fm_expr_unary(const fm_expr *e) {
    const fm_node *n = e != NULL ? e->root : NULL;
    while (n != NULL && n->kind == FM_NODE_CALL && fm_funcs[n->func].cuda[0] == '\0') /* none(.), identity(.) */
        n = n->arg[0];
    if (n == NULL)
        return NULL;
    if (n->kind == FM_NODE_VAR)
        return "";
    if (n->kind == FM_NODE_CALL && n->nargs == 1 && n->arg[0]->kind == FM_NODE_VAR)
        return fm_funcs[n->func].name;
    return NULL;
}

const char *fm_expr_pair_fn(const fm_expr *e) {
    const char *name = fm_expr_unary(e);
    if (name == NULL)
        return NULL;
    if (strcmp(name, "") == 0)
        return "fm_pack2";
    return strcmp(name, "relu") == 0 ? "fm_relu2" : NULL;
}

/* ------------------------------------------------------------------------------------------------ eval */

static void fm_fill(double *d, double v, size_t n) {
    for (size_t i = 0; i < n; i++)
        d[i] = v;
}

/* Evaluates n (<= FM_EXPR_CHUNK) values of node into dst. The first operand is computed in dst itself, the others
 * in scratch buffers of FM_EXPR_CHUNK doubles; each level uses at most two, so 2 * height buffers suffice. */
static void fm_eval_node(const fm_node *nd, const double *x, double *dst, double *scratch, size_t n) {
    double *t = scratch, *more = scratch + (size_t)(nd->nargs > 1 ? nd->nargs - 1 : 0) * FM_EXPR_CHUNK;
    switch (nd->kind) {
    case FM_NODE_NUM: fm_fill(dst, nd->value, n); return;
    case FM_NODE_PI: fm_fill(dst, fm_pi, n); return;
    case FM_NODE_E: fm_fill(dst, fm_e, n); return;
    case FM_NODE_VAR: memcpy(dst, x, n * sizeof *dst); return;
    default: break;
    }
    fm_eval_node(nd->arg[0], x, dst, more, n);
    int ok = 0, k = nd->kind == FM_NODE_POW ? fm_powi_exponent(nd, &ok) : 0;
    if (nd->kind == FM_NODE_POW && ok) {
        int m = k < 0 ? -k : k;
        for (size_t i = 0; i < n; i++) {
            double b = dst[i], r = m > 0 ? b : 1.0;
            for (int j = 1; j < m; j++)
                r *= b;
            dst[i] = k < 0 ? 1.0 / r : r;
        }
        return;
    }
    for (int a = 1; a < nd->nargs; a++)
        fm_eval_node(nd->arg[a], x, t + (size_t)(a - 1) * FM_EXPR_CHUNK, more, n);
#define FM_EACH(stmt)                                                                                               \
    for (size_t i = 0; i < n; i++)                                                                                  \
        stmt;                                                                                                       \
    return
    switch (nd->kind) {
    case FM_NODE_NEG: FM_EACH(dst[i] = -dst[i]);
    case FM_NODE_ADD: FM_EACH(dst[i] += t[i]);
    case FM_NODE_SUB: FM_EACH(dst[i] -= t[i]);
    case FM_NODE_MUL: FM_EACH(dst[i] *= t[i]);
    case FM_NODE_DIV: FM_EACH(dst[i] /= t[i]);
    case FM_NODE_POW: FM_EACH(dst[i] = pow(dst[i], t[i]));
    case FM_NODE_CALL: {
        const double *args[FM_EXPR_MAX_ARGS] = {dst, nd->nargs > 1 ? t : dst, nd->nargs > 2 ? t + FM_EXPR_CHUNK : dst};
        fm_funcs[nd->func].cpu(dst, args, n);
        return;
    }
    default: return;
    }
#undef FM_EACH
}

fm_status fm_expr_eval(const fm_expr *e, const double *in, double *out, size_t n, fm_error *err) {
    if (e == NULL || n == 0)
        return FM_OK;
    /* buffer 0 holds a copy of the input chunk, so out may alias in; then 2 per tree level */
    size_t buffers = 1 + 2 * (size_t)e->root->height;
    double *pool = malloc(buffers * FM_EXPR_CHUNK * sizeof *pool);
    if (pool == NULL)
        return fm_fail(err, FM_ERR_NOMEM, "out of memory evaluating an activation expression (%zu bytes)",
                       buffers * FM_EXPR_CHUNK * sizeof *pool);
    for (size_t off = 0; off < n; off += FM_EXPR_CHUNK) {
        size_t m = n - off < FM_EXPR_CHUNK ? n - off : FM_EXPR_CHUNK;
        memcpy(pool, in + off, m * sizeof *pool);
        fm_eval_node(e->root, pool, out + off, pool + FM_EXPR_CHUNK, m);
    }
    free(pool);
    return FM_OK;
}

/* ------------------------------------------------------------------------------------------------ ranges */

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
    case FM_FUNC_hardsigmoid: return (fm_iv){0.0, 1.0};
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
