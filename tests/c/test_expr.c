/*
 * test_expr.c - pins down the activation-expression parser (errors and their columns, limits, hostile input), the
 * float64 value of every whitelisted function, the canonical text, the CUDA text, and fm_spec_init's checks.
 *
 *   gcc -std=c11 -Wall -Wextra -Werror -fsanitize=address,undefined -g -Icsrc csrc/util.c csrc/expr_*.c csrc/spec.c \
 *       tests/c/test_expr.c -lm -o /tmp/test_expr && /tmp/test_expr
 */
#include "fm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* ------------------------------------------------------------------------------------------------ helpers */

static fm_expr *parse_ok(const char *text) {
    fm_error err = {0};
    fm_expr *e = NULL;
    fm_status st = fm_expr_parse(text, &e, &err);
    CHECK(st == FM_OK && e != NULL, "parse(\"%s\") failed: %s", text, err.message);
    fm_error_clear(&err);
    return e;
}

/* Parsing must fail with FM_ERR_EXPR at `column`, with `needle` in the message. Returns the message. */
static void expect_error_at(int line, const char *text, int column, const char *needle) {
    fm_error err = {0};
    fm_expr *e = NULL;
    fm_status st = fm_expr_parse(text, &e, &err);
    g_checks++;
    if (st != FM_ERR_EXPR || e != NULL || err.status != FM_ERR_EXPR || err.column != column ||
        strstr(err.message, needle) == NULL) {
        g_failures++;
        printf("FAIL line %d: parse(\"%.60s\") gave status %d column %d message \"%s\"; wanted column %d and \"%s\"\n",
               line, text ? text : "(null)", (int)st, err.column, err.message, column, needle);
    }
    fm_expr_free(e);
    fm_error_clear(&err);
}
#define EXPECT_ERROR(text, column, needle) expect_error_at(__LINE__, text, column, needle)

static double eval1(const char *text, double x) {
    fm_expr *e = parse_ok(text);
    double y = NAN;
    if (e != NULL) {
        fm_error err = {0};
        CHECK(fm_expr_eval(e, &x, &y, 1, &err) == FM_OK, "eval(\"%s\") failed", text);
    }
    fm_expr_free(e);
    return y;
}

static int close_to(double got, double want, double rel) {
    if (isnan(want))
        return isnan(got);
    if (isinf(want))
        return got == want;
    return fabs(got - want) <= rel * fmax(fabs(want), 1e-300) || got == want;
}

#define EXPECT_VALUE(text, x, want)                                                                                 \
    do {                                                                                                            \
        double got_ = eval1(text, x);                                                                               \
        CHECK(close_to(got_, want, 1e-14), "%s at x=%.17g: got %.17g, want %.17g", text, (double)(x), got_,         \
              (double)(want));                                                                                      \
    } while (0)

/* Emitted CUDA text for `text`, in terms of the variable v (caller frees). */
static char *emit(const char *text) {
    fm_expr *e = parse_ok(text);
    fm_str s = {0};
    if (e != NULL) {
        fm_error err = {0};
        CHECK(fm_expr_emit_cuda(e, "v", &s, &err) == FM_OK, "emit(\"%s\") failed: %s", text, err.message);
    }
    fm_expr_free(e);
    return s.data != NULL ? s.data : calloc(1, 1);
}

static int only_safe_chars(const char *s) {
    for (; *s; s++) {
        char c = *s;
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || strchr("_.+-*/(), ", c);
        if (!ok)
            return 0;
    }
    return 1;
}

static char *canonical(const char *text) {
    fm_expr *e = parse_ok(text);
    fm_str s = {0};
    fm_expr_to_string(e, &s);
    fm_expr_free(e);
    return s.data != NULL ? s.data : calloc(1, 1);
}

static char *repeat(const char *piece, int times, const char *middle, const char *closing) {
    size_t n = strlen(piece) * (size_t)times + strlen(middle) + strlen(closing) * (size_t)times + 1;
    char *s = malloc(n);
    s[0] = '\0';
    for (int i = 0; i < times; i++)
        strcat(s, piece);
    strcat(s, middle);
    for (int i = 0; i < times; i++)
        strcat(s, closing);
    return s;
}

/* ------------------------------------------------------------------------------------------------ reference values */

/* Each whitelisted one-argument function at several points, negative and large |x| included. Values from PyTorch's
 * formulas (aten/src/ATen/native/cpu/Activation.cpp) evaluated in Python float64. */
static const struct {
    const char *name;
    double x, y;
} g_table[] = {
    {"abs", -2.5, 2.5}, {"abs", -0.5, 0.5}, {"abs", 0.0, 0.0}, {"abs", 3.0, 3.0}, {"abs", 1e+30, 1e+30},
    {"sqrt", 0.0, 0.0}, {"sqrt", 0.25, 0.5}, {"sqrt", 2.0, 1.4142135623730951}, {"sqrt", 10000000000.0, 100000.0},
    {"exp", -30.0, 9.357622968840175e-14}, {"exp", -2.5, 0.0820849986238988}, {"exp", 0.0, 1.0},
    {"exp", 0.75, 2.117000016612675}, {"exp", 3.0, 20.085536923187668}, {"exp", 80.0, 5.54062238439351e+34},
    {"exp2", -3.0, 0.125}, {"exp2", 0.5, 1.4142135623730951}, {"exp2", 10.0, 1024.0},
    {"log", 1e-10, -23.025850929940457}, {"log", 0.5, -0.6931471805599453}, {"log", 1.0, 0.0},
    {"log", 3.0, 1.0986122886681098}, {"log", 1e+30, 69.07755278982137}, {"log2", 0.125, -3.0},
    {"log2", 3.0, 1.584962500721156}, {"log2", 1024.0, 10.0}, {"log10", 0.001, -3.0},
    {"log10", 3.0, 0.47712125471966244}, {"log10", 100000.0, 5.0}, {"log1p", -0.5, -0.6931471805599453},
    {"log1p", 1e-12, 9.999999999995e-13}, {"log1p", 3.0, 1.3862943611198906}, {"expm1", -30.0, -0.9999999999999064},
    {"expm1", -1e-10, -9.999999999500001e-11}, {"expm1", 1e-10, 1.00000000005e-10},
    {"expm1", 3.0, 19.085536923187668}, {"sin", -2.5, -0.5984721441039565}, {"sin", 0.75, 0.6816387600233341},
    {"sin", 30.0, -0.9880316240928618}, {"cos", -2.5, -0.8011436155469337}, {"cos", 0.75, 0.7316888688738209},
    {"cos", 30.0, 0.15425144988758405}, {"tan", -2.5, 0.7470222972386603}, {"tan", 0.75, 0.9315964599440725},
    {"tan", 1.5, 14.101419947171719}, {"asin", -0.5, -0.5235987755982989}, {"asin", 0.75, 0.848062078981481},
    {"asin", 1.0, 1.5707963267948966}, {"acos", -0.5, 2.0943951023931957}, {"acos", 0.75, 0.7227342478134157},
    {"acos", 1.0, 0.0}, {"atan", -30.0, -1.5374753309166493}, {"atan", 0.75, 0.6435011087932844},
    {"atan", 10000000000.0, 1.5707963266948965}, {"sinh", -2.5, -6.0502044810397875},
    {"sinh", 0.75, 0.82231673193583}, {"sinh", 30.0, 5343237290762.231}, {"cosh", -2.5, 6.132289479663686},
    {"cosh", 0.75, 1.2946832846768448}, {"cosh", 30.0, 5343237290762.231}, {"tanh", -30.0, -1.0},
    {"tanh", -0.5, -0.46211715726000974}, {"tanh", 0.75, 0.6351489523872873}, {"tanh", 1000.0, 1.0},
    {"tanh", -1000.0, -1.0}, {"erf", -3.0, -0.9999779095030014}, {"erf", -0.5, -0.5204998778130465},
    {"erf", 0.75, 0.7111556336535151}, {"erf", 10.0, 1.0}, {"floor", -2.5, -3.0}, {"floor", -0.5, -1.0},
    {"floor", 0.75, 0.0}, {"floor", 3.0, 3.0}, {"ceil", -2.5, -2.0}, {"ceil", -0.5, 0.0}, {"ceil", 0.75, 1.0},
    {"ceil", 3.0, 3.0}, {"none", -2.5, -2.5}, {"none", 3.0, 3.0}, {"identity", -2.5, -2.5}, {"identity", 3.0, 3.0},
    {"relu", -1000.0, 0.0}, {"relu", -2.5, 0.0}, {"relu", 0.0, 0.0}, {"relu", 0.75, 0.75}, {"relu", 1000.0, 1000.0},
    {"leaky_relu", -1000.0, -10.0}, {"leaky_relu", -2.5, -0.025}, {"leaky_relu", 0.75, 0.75},
    {"leaky_relu", 1000.0, 1000.0}, {"elu", -1000.0, -1.0}, {"elu", -2.5, -0.9179150013761013},
    {"elu", -0.5, -0.3934693402873666}, {"elu", 0.75, 0.75}, {"elu", 1000.0, 1000.0},
    {"selu", -1000.0, -1.7580993408473766}, {"selu", -2.5, -1.6137857588732425}, {"selu", -0.5, -0.6917581878028713},
    {"selu", 0.75, 0.7880257405166103}, {"selu", 1000.0, 1050.7009873554805}, {"gelu", -1000.0, -0.0},
    {"gelu", -30.0, -0.0}, {"gelu", -2.5, -0.015524163314440398}, {"gelu", -0.5, -0.15426876936299344},
    {"gelu", 0.75, 0.5800294857173488}, {"gelu", 3.0, 2.99595030590511}, {"gelu", 1000.0, 1000.0},
    {"gelu_tanh", -1000.0, -0.0}, {"gelu_tanh", -30.0, -0.0}, {"gelu_tanh", -2.5, -0.015084266089998577},
    {"gelu_tanh", -0.5, -0.15428599017485606}, {"gelu_tanh", 0.75, 0.5799605551656203},
    {"gelu_tanh", 3.0, 2.996362607918227}, {"gelu_tanh", 1000.0, 1000.0}, {"silu", -1000.0, -0.0},
    {"silu", -30.0, -2.8072868906517896e-12}, {"silu", -2.5, -0.18964545005310887},
    {"silu", -0.5, -0.1887703343990727}, {"silu", 0.75, 0.5093840243815447}, {"silu", 3.0, 2.8577223804672998},
    {"silu", 1000.0, 1000.0}, {"sigmoid", -1000.0, 0.0}, {"sigmoid", -700.0, 9.85967654375977e-305},
    {"sigmoid", -30.0, 9.3576229688393e-14}, {"sigmoid", -2.5, 0.07585818002124356}, {"sigmoid", 0.0, 0.5},
    {"sigmoid", 0.75, 0.679178699175393}, {"sigmoid", 30.0, 0.9999999999999065}, {"sigmoid", 1000.0, 1.0},
    {"softplus", -1000.0, 0.0}, {"softplus", -30.0, 9.357622968839737e-14}, {"softplus", -2.5, 0.07888973429254963},
    {"softplus", 0.0, 0.6931471805599453}, {"softplus", 0.75, 1.1368710061148999},
    {"softplus", 19.5, 19.500000003398267}, {"softplus", 20.5, 20.5}, {"softplus", 1000.0, 1000.0},
    {"mish", -1000.0, -0.0}, {"mish", -30.0, -2.807286890651921e-12}, {"mish", -2.5, -0.19681620390653337},
    {"mish", -0.5, -0.22074377465173}, {"mish", 0.75, 0.6100183352182934}, {"mish", 3.0, 2.9865350049679575},
    {"mish", 1000.0, 1000.0}, {"square", -2.5, 6.25}, {"square", 3.0, 9.0}, {"square", 10000000000.0, 1e+20},
    {"hardtanh", -1000.0, -1.0}, {"hardtanh", -2.5, -1.0}, {"hardtanh", -0.5, -0.5}, {"hardtanh", 0.75, 0.75},
    {"hardtanh", 1000.0, 1.0}, {"hardsigmoid", -1000.0, 0.0}, {"hardsigmoid", -3.5, 0.0},
    {"hardsigmoid", -0.5, 0.4166666666666667}, {"hardsigmoid", 0.0, 0.5}, {"hardsigmoid", 0.75, 0.625},
    {"hardsigmoid", 3.5, 1.0}, {"hardsigmoid", 1000.0, 1.0}, {"hardswish", -1000.0, -0.0}, {"hardswish", -3.5, -0.0},
    {"hardswish", -0.5, -0.20833333333333334}, {"hardswish", 0.75, 0.46875}, {"hardswish", 1.0, 0.6666666666666666},
    {"hardswish", 3.5, 3.5}, {"hardswish", 1000.0, 1000.0}, {"softsign", -1000.0, -0.999000999000999},
    {"softsign", -2.5, -0.7142857142857143}, {"softsign", 0.0, 0.0}, {"softsign", 0.75, 0.42857142857142855},
    {"softsign", 3.0, 0.75},
};

/* ------------------------------------------------------------------------------------------------ tests */

static void test_errors_name_the_token_and_column(void) {
    EXPECT_ERROR("", 1, "empty expression");
    EXPECT_ERROR("  \t ", 1, "empty expression");
    EXPECT_ERROR(NULL, 1, "NULL");
    EXPECT_ERROR("foo", 1, "unknown name 'foo' at column 1; known functions: abs, sqrt, exp,");
    EXPECT_ERROR("x + foo(x)", 5, "unknown name 'foo' at column 5");
    EXPECT_ERROR("x + foo(x)", 5, "eq, where; constants: pi, e; variable: x");
    EXPECT_ERROR("Relu", 1, "unknown name 'Relu'");
    EXPECT_ERROR("(x + 1", 7, "expected ')' to close '(' at column 1, found end of expression at column 7");
    EXPECT_ERROR("tanh(x, 1", 10, "expected ')' to close '(' at column 5");
    EXPECT_ERROR("min(x)", 1, "'min' takes 2 arguments, got 1");
    EXPECT_ERROR("2 * max(x, 1, 2)", 5, "'max' takes 2 arguments, got 3");
    EXPECT_ERROR("relu()", 1, "'relu' takes 1 argument, got 0");
    EXPECT_ERROR("softplus(x, 1, 2, 3, 4)", 1, "'softplus' takes 1 to 3 arguments, got 5");
    EXPECT_ERROR("hardtanh(x, 1, -1)", 1, "min 1 greater than max -1");
    EXPECT_ERROR("x;", 2, "unexpected character ';' at column 2");
    EXPECT_ERROR("x $ 1", 3, "unexpected character '$' at column 3");
    EXPECT_ERROR("x + 1 # note", 7, "unexpected character '#'");
    EXPECT_ERROR("x\n", 2, "unexpected byte 0x0A at column 2");
    EXPECT_ERROR("\xc3\xa9", 1, "unexpected byte 0xC3 at column 1");
    EXPECT_ERROR("x +", 4, "found end of expression");
    EXPECT_ERROR("x x", 3, "unexpected 'x' at column 3 after a complete expression");
    EXPECT_ERROR("2 x", 3, "unexpected 'x' at column 3");
    EXPECT_ERROR("x)", 2, "unexpected ')' at column 2: it closes no '('");
    EXPECT_ERROR("x ** 2", 4, "found '*'");
    EXPECT_ERROR("x ^", 4, "found end of expression");
    EXPECT_ERROR("(,)", 2, "found ','");
    EXPECT_ERROR("relu + 1", 1, "function 'relu' at column 1 needs its arguments");
    EXPECT_ERROR("min", 1, "function 'min' at column 1 needs its arguments");
    EXPECT_ERROR("x(2)", 1, "'x' at column 1 is not a function");
    EXPECT_ERROR("pi(2)", 1, "'pi' at column 1 is not a function");
    EXPECT_ERROR(".", 1, "unexpected character '.'");

    /* numbers: decimal only, finite, within float32 */
    EXPECT_ERROR("1e999", 1, "number '1e999' at column 1 is beyond float32 range");
    EXPECT_ERROR("x * 1e39", 5, "beyond float32 range");
    EXPECT_ERROR("0x10", 1, "malformed number '0x10' at column 1");
    EXPECT_ERROR("1f", 1, "malformed number '1f'");
    EXPECT_ERROR("x + 1.0f", 5, "malformed number '1.0f'");
    EXPECT_ERROR("2x", 1, "malformed number '2x'");
    EXPECT_ERROR("1.2.3", 1, "malformed number '1.2.3'");
    EXPECT_ERROR("2e", 1, "malformed number '2e'");
    EXPECT_ERROR("1e+", 1, "malformed number '1e'");

    /* a case-only near miss gets a hint */
    fm_error err = {0};
    fm_expr *e = NULL;
    fm_expr_parse("GELU", &e, &err);
    CHECK(strstr(err.hint, "did you mean 'gelu'") != NULL, "hint for GELU: \"%s\"", err.hint);
    printf("example: %s [column %d] (hint: %s)\n", err.message, err.column, err.hint);
    fm_error_clear(&err);
    fm_expr_parse("x * tanh(softplus(x)", &e, &err);
    printf("example: %s [column %d]\n", err.message, err.column);
    fm_error_clear(&err);
}

static void test_hostile_input_is_rejected_with_a_column(void) {
    EXPECT_ERROR("x); asm(\"trap\"); (", 2, "unexpected ')' at column 2");
    EXPECT_ERROR("#include <x>", 1, "unexpected character '#'");
    EXPECT_ERROR("x/*", 3, "found '*'");
    EXPECT_ERROR("x//", 3, "found '/'");
    EXPECT_ERROR("__syncthreads()", 1, "unknown name '__syncthreads'");
    EXPECT_ERROR("asm(\"trap\")", 1, "unknown name 'asm'");
    EXPECT_ERROR("x\"", 2, "unexpected character '\"'");
    EXPECT_ERROR("{x}", 1, "unexpected character '{'");
    EXPECT_ERROR("x ? 1 : 0", 3, "unexpected character '?'");
    EXPECT_ERROR("x \\\n", 3, "unexpected character '\\'");
    EXPECT_ERROR("x\x01", 2, "unexpected byte 0x01");
    EXPECT_ERROR("x\x7f", 2, "unexpected byte 0x7F");
    EXPECT_ERROR("x\r", 2, "unexpected byte 0x0D");
    EXPECT_ERROR("x, 1", 2, "unexpected ','");
    EXPECT_ERROR("expf(x)", 1, "unknown name 'expf'");
    EXPECT_ERROR("fm_relu(x)", 1, "unknown name 'fm_relu'");
    EXPECT_ERROR("x + var", 5, "unknown name 'var'");
    /* A C string ends at its NUL: what follows can neither parse nor reach the source (the Python binding must
     * refuse embedded NULs before calling in). */
    static const char nul_trick[] = "x\0); asm(\"trap\"); (x";
    char *s = emit(nul_trick);
    CHECK(strcmp(s, "v") == 0, "text after a NUL leaked: \"%s\"", s);
    free(s);
    EXPECT_ERROR("x + \0 1", 5, "at column 5, found end of expression");
}

static void test_limits_on_length_and_nesting(void) {
    char *s = repeat("(", 64, "x", ")");
    CHECK(eval1(s, 2.0) == 2.0, "64 nested parentheses should parse");
    free(s);
    s = repeat("(", 130, "x", ")");
    CHECK(eval1(s, 2.0) == 2.0, "130 nested parentheses should parse (the syntax limit is twice the tree height)");
    free(s);
    s = repeat("(", 131, "x", ")");
    EXPECT_ERROR(s, 132, "nests more than 130 levels deep");
    free(s);
    s = repeat("(", 2000, "x", ")");
    EXPECT_ERROR(s, 132, "nests more than 130 levels deep");
    free(s);
    s = repeat("-", 4000, "x", "");
    EXPECT_ERROR(s, 132, "nests more than 130 levels deep");
    free(s);
    s = repeat("sin(", 64, "x", ")");
    CHECK(close_to(eval1(s, 0.5), 0.5, 1.0), "64 nested sin() should parse");
    free(s);
    s = repeat("sin(", 65, "x", ")");
    EXPECT_ERROR(s, 1, "nests more than 64 operations deep");
    free(s);
    s = repeat("2^", 200, "x", "");
    EXPECT_ERROR(s, 263, "nests more than 130");
    free(s);
    /* a flat chain is as deep as it is long once parsed; the tree walks recurse, so it is bounded too */
    s = repeat("x+", 64, "x", "");
    CHECK(eval1(s, 1.5) == 97.5, "64 additions should parse");
    free(s);
    s = repeat("x+", 65, "x", "");
    EXPECT_ERROR(s, 130, "nests more than 64 operations deep at column 130");
    free(s);

    s = malloc(4098);
    s[0] = 'x';
    memset(s + 1, ' ', 4095);
    s[4096] = '\0';
    CHECK(eval1(s, 3.0) == 3.0, "4096 characters should parse");
    s[4096] = ' ';
    s[4097] = '\0';
    EXPECT_ERROR(s, 4097, "longer than 4096 characters");
    free(s);
    size_t big = (size_t)1 << 22; /* 4 MiB of '(': refused by length, without scanning it all */
    s = malloc(big + 1);
    memset(s, '(', big);
    s[big] = '\0';
    EXPECT_ERROR(s, 4097, "longer than 4096 characters");
    free(s);
}

/* Whether function f takes two arguments at least (min, max, pow and the comparisons; where takes three). */
static int two_arguments(const char *f) {
    static const char *const names[] = {"min", "max", "pow", "gt", "ge", "lt", "le", "eq", "where", NULL};
    for (const char *const *n = names; *n; n++)
        if (strcmp(*n, f) == 0)
            return 1;
    return 0;
}

/* A call of f with as many arguments as it takes: "f" alone (f(x)), "f(x, 2)", or where's "where(x, 2, 3)". */
static const char *call_of(const char *f, char *text, size_t size) {
    snprintf(text, size, strcmp(f, "where") == 0 ? "%s(x, 2, 3)" : two_arguments(f) ? "%s(x, 2)" : "%s", f);
    return text;
}

static void test_every_function_matches_its_reference(void) {
    char text[64];
    for (size_t i = 0; i < sizeof g_table / sizeof g_table[0]; i++) {
        snprintf(text, sizeof text, "%s(x)", g_table[i].name);
        EXPECT_VALUE(text, g_table[i].x, g_table[i].y);
        /* the bare name means the same */
        EXPECT_VALUE(g_table[i].name, g_table[i].x, g_table[i].y);
    }
    /* every name in the whitelist is covered by the table or below */
    for (const char *const *f = fm_expr_functions(); *f != NULL; f++) {
        int found = two_arguments(*f); /* (those: below) */
        for (size_t i = 0; i < sizeof g_table / sizeof g_table[0]; i++)
            found |= strcmp(g_table[i].name, *f) == 0;
        CHECK(found, "no reference values for '%s'", *f);
    }
    /* the comparisons: 1 or 0, 0 for NaN; where: its second argument where the first is not 0 (NaN included; the
     * unchosen argument's NaN, log(-1)'s, does not reach the result) */
    static const struct {
        const char *text;
        double x, want;
    } choices[] = {{"gt(x, 2)", 3.0, 1.0}, {"gt(x, 2)", 2.0, 0.0}, {"ge(x, 2)", 2.0, 1.0}, {"lt(x, 2)", 1.0, 1.0},
                   {"le(x, 2)", 2.5, 0.0}, {"eq(x, 2)", 2.0, 1.0}, {"gt(x, 2)", NAN, 0.0},
                   {"where(gt(x, 0), x, -1)", 3.0, 3.0}, {"where(gt(x, 0), x, -1)", -3.0, -1.0},
                   {"where(x, 5, 7)", NAN, 5.0}, {"where(gt(x, 0), log(x), 0)", -1.0, 0.0}};
    for (size_t i = 0; i < sizeof choices / sizeof choices[0]; i++)
        EXPECT_VALUE(choices[i].text, choices[i].x, choices[i].want);
    /* hand-computed, and the optional parameters */
    EXPECT_VALUE("min(x, 2)", 3.0, 2.0);
    EXPECT_VALUE("min(x, 2)", -3.0, -3.0);
    EXPECT_VALUE("max(x, 2)", 3.0, 3.0);
    EXPECT_VALUE("max(-x, 2)", 3.0, 2.0);
    EXPECT_VALUE("pow(x, 0.5)", 2.25, 1.5);
    EXPECT_VALUE("pow(x, 3)", -2.0, -8.0);
    EXPECT_VALUE("leaky_relu(x)", -2.0, -0.02);
    EXPECT_VALUE("leaky_relu(x, 0.2)", -2.0, -0.4);
    EXPECT_VALUE("leaky_relu(x, 0.2)", 2.0, 2.0);
    EXPECT_VALUE("elu(x, 2)", -1.0, 2.0 * expm1(-1.0));
    EXPECT_VALUE("elu(x, 2)", 1.5, 1.5);
    EXPECT_VALUE("softplus(x, 2)", 9.0, log1p(exp(18.0)) / 2.0);
    EXPECT_VALUE("softplus(x, 2)", 10.5, 10.5);     /* 2*10.5 > 20: linear */
    EXPECT_VALUE("softplus(x, 2, 30)", 10.5, log1p(exp(21.0)) / 2.0);
    EXPECT_VALUE("softplus(x, 1, 20)", 20.0, log1p(exp(20.0))); /* threshold is strict: x*beta > threshold */
    EXPECT_VALUE("hardtanh(x, -2, 2)", -3.0, -2.0);
    EXPECT_VALUE("hardtanh(x, -2, 2)", 1.5, 1.5);
    EXPECT_VALUE("hardtanh(x, -2, 2)", 7.0, 2.0);
    EXPECT_VALUE("hardswish", 1.0, 2.0 / 3.0);
    EXPECT_VALUE("hardsigmoid", 0.0, 0.5);
    EXPECT_VALUE("softsign", 3.0, 0.75);
    EXPECT_VALUE("square", -3.0, 9.0);
    EXPECT_VALUE("relu", -0.0, -0.0);
    EXPECT_VALUE("sigmoid(x)", -745.0, exp(-745.0)); /* stable: the naive 1/(1+exp(745)) is 0 */
    EXPECT_VALUE("pi", 0.0, 3.14159265358979323846);
    EXPECT_VALUE("e", 0.0, 2.71828182845904523536);
    EXPECT_VALUE("2*pi*x", 0.5, 3.14159265358979323846);
    EXPECT_VALUE("e^x", 1.0, exp(1.0));
    /* NaN propagates through every activation, as in PyTorch */
    static const char *const acts[] = {"relu", "leaky_relu", "elu", "selu", "gelu", "gelu_tanh", "silu", "sigmoid",
                                       "softplus", "mish", "hardtanh", "hardsigmoid", "hardswish", "softsign",
                                       "min(x, 0)", "max(x, 0)", "min(0, x)", "max(0, x)", NULL};
    for (const char *const *a = acts; *a; a++)
        CHECK(isnan(eval1(*a, NAN)), "%s(NaN) is not NaN", *a);
}

static void test_precedence_and_associativity(void) {
    EXPECT_VALUE("-2^2", 0.0, -4.0);
    EXPECT_VALUE("2^3^2", 0.0, 512.0);
    EXPECT_VALUE("2^-1", 0.0, 0.5);
    EXPECT_VALUE("1-2-3", 0.0, -4.0);
    EXPECT_VALUE("8/2/2", 0.0, 2.0);
    EXPECT_VALUE("-x^2", 3.0, -9.0);
    EXPECT_VALUE("--x", 3.0, 3.0);
    EXPECT_VALUE("+x", 3.0, 3.0);
    EXPECT_VALUE("2+3*x", 2.0, 8.0);
    EXPECT_VALUE("(2+3)*x", 2.0, 10.0);
    EXPECT_VALUE("x^-2", 2.0, 0.25);
    EXPECT_VALUE("x^0", NAN, 1.0);
    EXPECT_VALUE("x^16", 2.0, 65536.0);
    EXPECT_VALUE("x^17", 2.0, 131072.0);
    EXPECT_VALUE("x^2.5", 4.0, 32.0);
    EXPECT_VALUE("x^3 - 2*x^-2", -2.0, -8.5);
    EXPECT_VALUE("\t.5*x + 2.5E+4 - 1e-3", 2.0, 25000.0 + 1.0 - 0.001);
    EXPECT_VALUE("sin(30*x)", 0.1, sin(3.0));
}

static void test_canonical_text_round_trips(void) {
    static const struct {
        const char *in, *out;
    } cases[] = {
        {"relu", "relu(x)"},
        {"  gelu ", "gelu(x)"},
        {"leaky_relu", "leaky_relu(x, 0.01)"},
        {"softplus(x, 2)", "softplus(x, 2, 20)"},
        {"hardtanh", "hardtanh(x, (-1), 1)"},
        {"2*x+1", "((2 * x) + 1)"},
        {"x^-2", "(x ^ (-2))"},
        {"-x^2", "(-(x ^ 2))"},
        {"pow(x, 3)", "(x ^ 3)"},
        {"0.1 * x", "(0.1 * x)"},
        {"1e-3+2.5E+4", "(0.001 + 25000)"},
        {"x * 1e30", "(x * 1e+30)"},
        {"x * 123456789012345678", "(x * 1.2345678901234568e+17)"},
        {"x * 1234567890123456", "(x * 1234567890123456)"},
        {"x * 0.000012345", "(x * 1.2345e-05)"},
        {"x * 99.99", "(x * 99.99)"},
        {"3.141592653589793 * pi + e", "((3.141592653589793 * pi) + e)"},
        {"x * tanh(softplus(x))", "(x * tanh(softplus(x, 1, 20)))"},
        {"min(max(x, -1), 1)", "min(max(x, (-1)), 1)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *a = canonical(cases[i].in);
        CHECK(strcmp(a, cases[i].out) == 0, "canonical(\"%s\") = \"%s\", want \"%s\"", cases[i].in, a, cases[i].out);
        char *b = canonical(a);
        CHECK(strcmp(a, b) == 0, "canonical text is not a fixed point: \"%s\" -> \"%s\"", a, b);
        for (double x = -3.25; x < 3.5; x += 0.5) {
            double ya = eval1(cases[i].in, x), yb = eval1(a, x);
            CHECK(ya == yb || (isnan(ya) && isnan(yb)), "\"%s\" and \"%s\" differ at %g", cases[i].in, a, x);
        }
        free(a);
        free(b);
    }
    /* every function's canonical text parses back */
    char text[64];
    for (const char *const *f = fm_expr_functions(); *f != NULL; f++) {
        char *a = canonical(call_of(*f, text, sizeof text));
        char *b = canonical(a);
        CHECK(strcmp(a, b) == 0, "%s: \"%s\" -> \"%s\"", *f, a, b);
        free(a);
        free(b);
    }
}

static void test_cuda_text(void) {
    static const struct {
        const char *in, *out;
    } cases[] = {
        {"1", "1.0f"},
        {"-1", "(-1.0f)"},
        {"x", "v"},
        {"x + 1", "(v + 1.0f)"},
        {"0.1", "0.100000001f"},
        {"2.5E+4", "25000.0f"},
        {"1e-3", "0.00100000005f"},
        {"1e30", "1.00000002e+30f"},
        {"pi", "3.14159274f"},
        {"x^3", "(v * v * v)"},
        {"x^-2", "(1.0f / (v * v))"},
        {"x^0", "1.0f"},
        {"x^0.5", "powf(v, 0.5f)"},
        {"x^17", "powf(v, 17.0f)"},
        {"exp(x)^2", "fm_powi(expf(v), 2)"},
        {"relu", "fm_relu(v)"},
        {"none", "(v)"},
        {"leaky_relu", "fm_leaky_relu(v, 0.00999999978f)"},
        {"softplus", "fm_softplus(v, 1.0f, 20.0f)"},
        {"hardtanh", "fm_hardtanh(v, (-1.0f), 1.0f)"},
        {"min(max(x, -1), 1)", "fm_min(fm_max(v, (-1.0f)), 1.0f)"},
        {"-x", "(-v)"},
        {"x - -1", "(v - (-1.0f))"},
        {"x * tanh(softplus(x))", "(v * fm_tanh(fm_softplus(v, 1.0f, 20.0f)))"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *s = emit(cases[i].in);
        CHECK(strcmp(s, cases[i].out) == 0, "emit(\"%s\") = \"%s\", want \"%s\"", cases[i].in, s, cases[i].out);
        free(s);
    }
    char text[64];
    for (const char *const *f = fm_expr_functions(); *f != NULL; f++) {
        snprintf(text, sizeof text, "%s(-x * 2.5e-3, 1e-7, 3)", *f);
        fm_expr *e = NULL;
        fm_error err = {0};
        if (fm_expr_parse(text, &e, &err) != FM_OK) { /* fewer arguments */
            fm_error_clear(&err);
            snprintf(text, sizeof text, two_arguments(*f) ? "%s(-x, 1e-7)" : "%s(-x)", *f);
        }
        fm_expr_free(e);
        char *s = emit(text);
        CHECK(s[0] != '\0' && only_safe_chars(s), "emit(\"%s\") = \"%s\" has characters outside the safe set", text,
              s);
        free(s);
    }
    /* the variable name must be an identifier */
    fm_expr *e = parse_ok("x");
    fm_str out = {0};
    fm_error err = {0};
    CHECK(fm_expr_emit_cuda(e, "v;", &out, &err) == FM_ERR_INTERNAL, "a variable name with ';' was accepted");
    fm_error_clear(&err);
    fm_str_free(&out);
    fm_expr_free(e);
}

static double lcg_uniform(unsigned long long *state, double lo, double hi) {
    *state = *state * 6364136223846793005ULL + 1442695040888963407ULL;
    return lo + (hi - lo) * (double)(*state >> 11) * (1.0 / 9007199254740992.0);
}

static void test_eval_is_vectorised_and_may_alias(void) {
    const char *text = "x * tanh(softplus(x)) + sin(30*x) - x^3/7 + hardtanh(x, -2, 2) * sigmoid(x)";
    fm_expr *e = parse_ok(text);
    enum { N = 1000 }; /* several chunks and a partial one */
    static double in[N], out[N], ref[N];
    unsigned long long seed = 12345;
    for (int i = 0; i < N; i++) {
        double x = lcg_uniform(&seed, -10.0, 10.0);
        in[i] = out[i] = x;
        double sp = x > 20.0 ? x : log1p(exp(x));
        double ht = x < -2.0 ? -2.0 : (x > 2.0 ? 2.0 : x);
        double sg = x >= 0.0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x));
        ref[i] = x * tanh(sp) + sin(30.0 * x) - x * x * x / 7.0 + ht * sg;
    }
    fm_error err = {0};
    CHECK(fm_expr_eval(e, out, out, N, &err) == FM_OK, "eval failed");
    int bad = 0;
    for (int i = 0; i < N; i++)
        bad += !close_to(out[i], ref[i], 1e-12);
    CHECK(bad == 0, "%d of %d in-place values differ from the direct formula", bad, N);
    double y2[N];
    CHECK(fm_expr_eval(e, in, y2, N, &err) == FM_OK, "eval failed");
    CHECK(memcmp(y2, out, sizeof y2) == 0, "out-of-place and in-place evaluation differ");
    CHECK(fm_expr_eval(e, in, y2, 0, &err) == FM_OK, "n = 0 should be a no-op");
    fm_expr_free(e);
}

/* Random token soup: every outcome is either a tree whose CUDA text is in the safe set and whose canonical text is a
 * fixed point, or FM_ERR_EXPR with a column inside the text (or just past it). */
static void test_random_input_never_escapes(void) {
    static const char *const pieces[] = {"x", "x", "+", "-", "*", "/", "^", "(", ")", ",", " ", "2", ".5", "1e3", "e",
                                         "pi", "relu", "sin", "min", "softplus", "hardtanh", ";", "#", "\"", "0x1"};
    unsigned long long seed = 99;
    int parsed = 0;
    for (int iter = 0; iter < 20000; iter++) {
        char text[200] = "";
        int n = 1 + (int)lcg_uniform(&seed, 0.0, 10.0);
        for (int i = 0; i < n; i++)
            strcat(text, pieces[(int)lcg_uniform(&seed, 0.0, sizeof pieces / sizeof pieces[0])]);
        fm_expr *e = NULL;
        fm_error err = {0};
        fm_status st = fm_expr_parse(text, &e, &err);
        if (st == FM_OK) {
            parsed++;
            fm_str c = {0}, c2 = {0}, cu = {0};
            fm_expr_to_string(e, &c);
            fm_expr *e2 = NULL;
            CHECK(fm_expr_parse(c.data, &e2, &err) == FM_OK, "canonical \"%s\" of \"%s\" does not parse", c.data, text);
            fm_expr_to_string(e2, &c2);
            CHECK(c2.data && strcmp(c.data, c2.data) == 0, "\"%s\": \"%s\" -> \"%s\"", text, c.data, c2.data);
            fm_expr_emit_cuda(e, "v", &cu, &err);
            CHECK(only_safe_chars(cu.data), "\"%s\" emits \"%s\"", text, cu.data);
            fm_expr_free(e2);
            fm_str_free(&c), fm_str_free(&c2), fm_str_free(&cu);
        } else {
            CHECK(st == FM_ERR_EXPR && err.column >= 1 && err.column <= (int)strlen(text) + 1,
                  "\"%s\": status %d column %d", text, (int)st, err.column);
        }
        fm_expr_free(e);
        fm_error_clear(&err);
    }
    CHECK(parsed > 500, "only %d of 20000 random inputs parsed: the generator is too hostile to test the happy path",
          parsed);
}

/* ------------------------------------------------------------------------------------------------ spec */

static void expect_spec_error(int line, int layers, const int64_t *shapes, const int64_t *bias, const char *const *acts,
                              fm_status status, int column, const char *message) {
    fm_spec spec;
    memset(&spec, 0x5a, sizeof spec);
    fm_error err = {0};
    fm_status st = fm_spec_init(&spec, layers, shapes, bias, acts, NULL, &err);
    int zeroed = spec.num_layers == 0 && spec.width[0] == 0;
    for (int l = 0; l < FM_MAX_LAYERS; l++)
        zeroed &= spec.act[l] == NULL;
    g_checks++;
    if (st != status || err.status != status || err.column != column || strstr(err.message, message) == NULL ||
        !zeroed) {
        g_failures++;
        printf("FAIL line %d: fm_spec_init gave status %d column %d zeroed %d message \"%s\"; wanted %d, %d, \"%s\"\n",
               line, (int)st, err.column, zeroed, err.message, (int)status, column, message);
    }
    fm_error_clear(&err);
}
#define EXPECT_SPEC_ERROR(...) expect_spec_error(__LINE__, __VA_ARGS__)

static void test_spec(void) {
    const int64_t shapes[] = {64, 32, 64, 64, 10, 64};
    const int64_t bias[] = {64, -1, 10};
    const char *const acts[] = {"relu", " x * sigmoid(1.702 * x) ", NULL};
    fm_spec spec;
    fm_error err = {0};
    CHECK(fm_spec_init(&spec, 3, shapes, bias, acts, NULL, &err) == FM_OK, "valid spec refused: %s", err.message);
    CHECK(spec.num_layers == 3 && spec.width[0] == 32 && spec.width[1] == 64 && spec.width[2] == 64 &&
              spec.width[3] == 10, "widths %d %d %d %d", spec.width[0], spec.width[1], spec.width[2], spec.width[3]);
    CHECK(spec.has_bias[0] == 1 && spec.has_bias[1] == 0 && spec.has_bias[2] == 1, "has_bias");
    CHECK(spec.act[0] && spec.act[1] && spec.act[2], "every layer gets an activation (NULL text is identity)");
    double x = -1.5, y = 0;
    fm_expr_eval(spec.act[2], &x, &y, 1, &err);
    CHECK(y == -1.5, "NULL activation should be the identity, got %g", y);
    fm_spec_free(&spec);
    CHECK(spec.act[0] == NULL && spec.num_layers == 0, "fm_spec_free should zero the spec");
    CHECK(fm_spec_init(&spec, 3, shapes, NULL, NULL, NULL, &err) == FM_OK, "NULL biases and activations refused");
    CHECK(spec.has_bias[0] == 0, "NULL bias_len means no biases");
    fm_spec_free(&spec);

    const int64_t chain[] = {64, 32, 64, 32};
    EXPECT_SPEC_ERROR(2, chain, NULL, NULL, FM_ERR_SHAPE, 0,
                      "weights[1] has shape (64, 32) but weights[0] has shape (64, 32): layer 1 takes 32 input "
                      "features while layer 0 produces 64");
    const int64_t zero[] = {64, 32, 64, 64, 0, 64};
    EXPECT_SPEC_ERROR(3, zero, NULL, NULL, FM_ERR_SHAPE, 0,
                      "weights[2] has shape (0, 64); every dimension must be >= 1");
    const int64_t b63[] = {-1, 63};
    EXPECT_SPEC_ERROR(2, shapes, b63, NULL, FM_ERR_SHAPE, 0,
                      "biases[1] has 63 elements; layer 1 has 64 outputs (weights[1].shape[0])");
    const char *const bad[] = {"relu", "x +* 2"};
    EXPECT_SPEC_ERROR(2, shapes, bias, bad, FM_ERR_EXPR, 4,
                      "activation of layer 1 ('x +* 2'): expected a number, x, a function call or '(' at column 4");
    const char *const bad0[] = {"softmax", "relu"};
    EXPECT_SPEC_ERROR(2, shapes, bias, bad0, FM_ERR_EXPR, 1, "activation of layer 0 ('softmax'): unknown name");
    EXPECT_SPEC_ERROR(0, shapes, NULL, NULL, FM_ERR_VALUE, 0, "the network has 0 layers");
    EXPECT_SPEC_ERROR(FM_MAX_LAYERS + 1, shapes, NULL, NULL, FM_ERR_LIMIT, 0, "at most 64");
    const int64_t huge[] = {(int64_t)1 << 40, 8};
    EXPECT_SPEC_ERROR(1, huge, NULL, NULL, FM_ERR_LIMIT, 0, "weights[0] has shape (1099511627776, 8)");

    fm_spec_init(&spec, 2, chain, NULL, NULL, NULL, &err);
    printf("example: %s (hint: %s)\n", err.message, err.hint);
    fm_error_clear(&err);
    fm_spec_init(&spec, 2, shapes, bias, bad, NULL, &err);
    printf("example: %s [column %d]\n", err.message, err.column);
    fm_error_clear(&err);
}

int main(void) {
    test_errors_name_the_token_and_column();
    test_hostile_input_is_rejected_with_a_column();
    test_limits_on_length_and_nesting();
    test_every_function_matches_its_reference();
    test_precedence_and_associativity();
    test_canonical_text_round_trips();
    test_cuda_text();
    test_eval_is_vectorised_and_may_alias();
    test_random_input_never_escapes();
    test_spec();
    printf("%s: %d checks, %d failed\n", g_failures ? "FAILED" : "ok", g_checks, g_failures);
    return g_failures != 0;
}
