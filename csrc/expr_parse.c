/*
 * expr_parse.c - activation expressions, text to tree: a recursive-descent parser (grammar in fm.h) to a checked tree
 * (expr_internal.h), with an error that names the column and what was expected there.
 */
#include "expr_internal.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------------ numbers */

/* Scans a decimal number at s (digits [. digits] [e [+-] digits], at least one mantissa digit) and returns its
 * length, 0 if there is none. The value goes through strtod as "<digits>e<exp>" with the point removed, because
 * strtod reads the decimal point of the C locale, and a host application may have called setlocale(). */
size_t fm_scan_number(const char *s, double *value) {
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

/* ------------------------------------------------------------------------------------------------ tree */

static void fm_node_free(fm_node *n) {
    if (n == NULL)
        return;
    for (int i = 0; i < n->nargs; i++)
        fm_node_free(n->arg[i]);
    free(n);
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
