/* check.h - the C tests' one assertion: counts checks, prints each failure with file:line, never aborts (so one run
 * reports every failure). A test's main prints "ok: N checks, 0 failed" or "FAILED: ..." and returns g_failures != 0. */
#ifndef FM_TEST_CHECK_H
#define FM_TEST_CHECK_H

#include <stdio.h>

static int g_checks, g_failures;

#define CHECK(cond, ...)                                                                                            \
    do {                                                                                                            \
        g_checks++;                                                                                                 \
        if (!(cond)) {                                                                                              \
            g_failures++;                                                                                           \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                                             \
            printf(__VA_ARGS__);                                                                                    \
            printf("\n");                                                                                           \
        }                                                                                                           \
    } while (0)

#endif
