/*
 * test_loaders.c - checks csrc/nvrtc.c and csrc/cuda.c end to end: NVRTC found and compiling Tensor Core PTX for
 * every supported arch, compile errors carrying their log, a missing driver reported (not crashed on), and, where
 * a driver and GPU exist, a kernel compiled, loaded, launched and its output checked.
 *
 * Build and run (NVRTC hint from argv[1] or FUSEDMLP_NVRTC; a ':'-separated list of files or folders):
 *   gcc -std=c11 -Wall -Wextra -Werror -fsanitize=address,undefined -g -Icsrc csrc/util.c csrc/nvrtc.c \
 *       csrc/cuda.c tests/c/test_loaders.c -ldl -lpthread -o /tmp/test_loaders
 *   /tmp/test_loaders /path/to/site-packages/nvidia/cu13/lib
 * Exit status 0 when every check passed.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* setenv, mkstemp */
#endif
#include "fm.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int g_failures;
static pthread_mutex_t g_print_lock = PTHREAD_MUTEX_INITIALIZER;

#define CHECK(cond, ...)                                                                                        \
    do {                                                                                                        \
        pthread_mutex_lock(&g_print_lock);                                                                      \
        if (cond) {                                                                                             \
            printf("  ok    ");                                                                                 \
        } else {                                                                                                \
            printf("  FAIL  (%s:%d: %s) ", __FILE__, __LINE__, #cond);                                          \
            g_failures++;                                                                                       \
        }                                                                                                       \
        printf(__VA_ARGS__);                                                                                    \
        printf("\n");                                                                                           \
        fflush(stdout);                                                                                         \
        pthread_mutex_unlock(&g_print_lock);                                                                    \
    } while (0)

static void show_error(const char *what, const fm_error *err) {
    printf("  %s -> %s\n        message: %s\n        hint:    %s\n", what, fm_status_to_string(err->status),
           err->message, err->hint);
}

static int contains(const char *hay, const char *needle) { return hay != NULL && strstr(hay, needle) != NULL; }

static int is_elf(const void *p, size_t n) { return n > 4 && memcmp(p, "\177ELF", 4) == 0; }

/* ------------------------------------------------------------------------------------------------ kernels */

/* One warp's m16n8k16 fp16 MMA with fp32 accumulation (PTX ISA, "Matrix multiply-accumulate", sm_80+). A holds
 * 4 registers of two halves per thread, B 2, C/D 4 floats. */
static const char k_mma_k16[] =
    "extern \"C\" __global__ void mma_k16(float *out, const unsigned *a, const unsigned *b) {\n"
    "  unsigned t = threadIdx.x;\n"
    "  unsigned a0 = a[4*t], a1 = a[4*t+1], a2 = a[4*t+2], a3 = a[4*t+3], b0 = b[2*t], b1 = b[2*t+1];\n"
    "  float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;\n"
    "  asm volatile(\"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 \"\n"
    "               \"{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\"\n"
    "               : \"+f\"(c0), \"+f\"(c1), \"+f\"(c2), \"+f\"(c3)\n"
    "               : \"r\"(a0), \"r\"(a1), \"r\"(a2), \"r\"(a3), \"r\"(b0), \"r\"(b1));\n"
    "  out[4*t] = c0; out[4*t+1] = c1; out[4*t+2] = c2; out[4*t+3] = c3;\n"
    "}\n";

/* sm_75 (Turing) has only the k8 shape for fp16: A 2 registers, B 1. */
static const char k_mma_k8[] =
    "extern \"C\" __global__ void mma_k8(float *out, const unsigned *a, const unsigned *b) {\n"
    "  unsigned t = threadIdx.x;\n"
    "  float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;\n"
    "  asm volatile(\"mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 \"\n"
    "               \"{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\"\n"
    "               : \"+f\"(c0), \"+f\"(c1), \"+f\"(c2), \"+f\"(c3)\n"
    "               : \"r\"(a[2*t]), \"r\"(a[2*t+1]), \"r\"(b[t]));\n"
    "  out[4*t] = c0; out[4*t+1] = c1; out[4*t+2] = c2; out[4*t+3] = c3;\n"
    "}\n";

/* wgmma exists only on sm_90a (the arch-specific target), not on plain sm_90. */
static const char k_wgmma_fence[] =
    "extern \"C\" __global__ void wgmma_fence(float *out) {\n"
    "  asm volatile(\"wgmma.fence.sync.aligned;\" ::: \"memory\");\n"
    "  out[threadIdx.x] = 1.0f;\n"
    "}\n";

/* Writes a hash pattern through dynamic shared memory, so a launch with > 48 KiB exercises the opt-in. */
static const char k_pattern[] =
    "extern \"C\" __global__ void pattern(unsigned *out, unsigned n, unsigned seed) {\n"
    "  extern __shared__ unsigned smem[];\n"
    "  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "  smem[threadIdx.x] = i * 2654435761u + seed;\n"
    "  __syncthreads();\n"
    "  if (i < n) out[i] = smem[threadIdx.x] ^ (i >> 3);\n"
    "}\n";

static unsigned pattern_value(unsigned i, unsigned seed) { return (i * 2654435761u + seed) ^ (i >> 3); }

/* Line 3 uses an undeclared name: the log must point at broken.cu(3). */
static const char k_broken[] =
    "extern \"C\" __global__ void broken(float *y) {\n"
    "  y[0] = 1.0f;\n"
    "  y[1] = undefined_thing;\n"
    "}\n";

/* ------------------------------------------------------------------------------------------------ NVRTC */

typedef struct compile_case {
    const char *label, *source, *name;
    int arch, arch_a;
    fm_status got;
    void *cubin;
    size_t size;
    char message[1024];
} compile_case;

static void *compile_thread(void *arg) {
    compile_case *c = arg;
    fm_error err = {0};
    char *log = NULL;
    c->got = fm_nvrtc_compile(c->source, c->name, c->arch, c->arch_a, NULL, 0, &c->cubin, &c->size, &log, &err);
    snprintf(c->message, sizeof c->message, "%s", err.message);
    free(log);
    fm_error_clear(&err);
    return NULL;
}

static void *load_thread(void *arg) {
    fm_error err = {0};
    fm_status *st = arg;
    *st = fm_nvrtc_load(getenv("TEST_LOADERS_HINT"), &err);
    fm_error_clear(&err);
    return NULL;
}

static void test_nvrtc_not_found(void) {
    printf("NVRTC: a hint that names no library\n");
    char junk[] = "/tmp/fm_test_not_a_library_XXXXXX";
    FILE *f = NULL;
    int fd = mkstemp(junk);
    if (fd >= 0 && (f = fdopen(fd, "w")) != NULL) {
        fputs("this is not an ELF file\n", f);
        fclose(f);
    }
    char hint[256];
    snprintf(hint, sizeof hint, "/nonexistent/fusedmlp/dir:%s", junk);
    fm_error err = {0};
    fm_status st = fm_nvrtc_load(hint, &err);
    if (st == FM_OK) {
        /* This machine also has NVRTC in a later place of the search (a CUDA toolkit): nothing to check. */
        printf("  skip  fallback found NVRTC at %s (a toolkit on this machine)\n", fm_nvrtc_library_path());
    } else {
        show_error("fm_nvrtc_load(bogus hint)", &err);
        CHECK(st == FM_ERR_LIBRARY, "bogus hint gives FM_ERR_LIBRARY");
        CHECK(contains(err.message, "/nonexistent/fusedmlp/dir"), "message lists the directory tried");
        CHECK(contains(err.message, junk), "message names the unloadable file and why");
        CHECK(contains(err.hint, "pip install nvidia-cuda-nvrtc") && contains(err.hint, "FUSEDMLP_NVRTC"),
              "hint says how to get NVRTC");
        CHECK(fm_nvrtc_library_path() == NULL, "no library path after a failed load");
    }
    fm_error_clear(&err);
    unlink(junk);
}

static void test_nvrtc_load(const char *hint) {
    printf("NVRTC: load with hint '%s' from 4 threads at once\n", hint ? hint : "(none)");
    if (hint != NULL)
        setenv("TEST_LOADERS_HINT", hint, 1);
    pthread_t th[4];
    fm_status st[4];
    for (int i = 0; i < 4; i++)
        pthread_create(&th[i], NULL, load_thread, &st[i]);
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    CHECK(st[0] == FM_OK && st[1] == FM_OK && st[2] == FM_OK && st[3] == FM_OK, "all four loads return FM_OK");

    fm_error err = {0};
    int major = 0, minor = 0;
    fm_status vs = fm_nvrtc_version(&major, &minor, &err);
    CHECK(vs == FM_OK && major >= 12, "NVRTC version %d.%d (12 or newer)", major, minor);
    const char *path = fm_nvrtc_library_path();
    CHECK(path != NULL && contains(path, "libnvrtc"), "library path: %s", path ? path : "(null)");
    fm_error_clear(&err);
}

static void test_nvrtc_compile_archs(void) {
    printf("NVRTC: Tensor Core PTX for each arch, compiled on 6 threads at once\n");
    compile_case cases[] = {
        {"m16n8k8  sm_75 ", k_mma_k8, "mma_k8.cu", 75, 0, 0, NULL, 0, ""},
        {"m16n8k16 sm_80 ", k_mma_k16, "mma_k16.cu", 80, 0, 0, NULL, 0, ""},
        {"m16n8k16 sm_86 ", k_mma_k16, "mma_k16.cu", 86, 0, 0, NULL, 0, ""},
        {"m16n8k16 sm_89 ", k_mma_k16, "mma_k16.cu", 89, 0, 0, NULL, 0, ""},
        {"m16n8k16 sm_90 ", k_mma_k16, "mma_k16.cu", 90, 0, 0, NULL, 0, ""},
        {"wgmma    sm_90a", k_wgmma_fence, "wgmma.cu", 90, 1, 0, NULL, 0, ""},
    };
    enum { N = sizeof cases / sizeof cases[0] };
    pthread_t th[N];
    for (int i = 0; i < N; i++)
        pthread_create(&th[i], NULL, compile_thread, &cases[i]);
    for (int i = 0; i < N; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < N; i++) {
        CHECK(cases[i].got == FM_OK && is_elf(cases[i].cubin, cases[i].size), "%s -> %zu-byte ELF CUBIN%s%s",
              cases[i].label, cases[i].size, cases[i].got == FM_OK ? "" : ": ", cases[i].message);
        free(cases[i].cubin);
    }
}

static void test_nvrtc_errors(void) {
    printf("NVRTC: errors\n");
    fm_error err = {0};
    void *cubin = (void *)1;
    size_t size = 7;
    char *log = (char *)1;
    fm_status st = fm_nvrtc_compile(k_broken, "broken.cu", 80, 0, NULL, 0, &cubin, &size, &log, &err);
    show_error("compile broken.cu", &err);
    CHECK(st == FM_ERR_COMPILE && err.status == FM_ERR_COMPILE, "broken source gives FM_ERR_COMPILE");
    CHECK(err.code == 6, "err.code is NVRTC_ERROR_COMPILATION (6), got %d", err.code);
    CHECK(contains(err.message, "NVRTC_ERROR_COMPILATION") && contains(err.message, "sm_80"),
          "message has the NVRTC error name and the arch");
    CHECK(err.log != NULL && contains(err.log, "broken.cu(3)") && contains(err.log, "undefined_thing"),
          "log points at broken.cu(3) and the undefined name");
    if (err.log != NULL)
        printf("        log: %.*s\n", (int)strcspn(err.log, "\n"), err.log);
    CHECK(cubin == NULL && size == 0 && log == NULL, "no CUBIN and no success log are handed out on failure");
    fm_error_clear(&err);

    const char *bad_opt[] = {"--no-such-nvrtc-option"};
    st = fm_nvrtc_compile(k_pattern, "pattern.cu", 80, 0, bad_opt, 1, &cubin, &size, NULL, &err);
    show_error("compile with --no-such-nvrtc-option", &err);
    CHECK(st == FM_ERR_COMPILE && err.code == 5 && contains(err.message, "NVRTC_ERROR_INVALID_OPTION"),
          "an unknown option gives FM_ERR_COMPILE with NVRTC_ERROR_INVALID_OPTION (5)");
    fm_error_clear(&err);

    /* Success: the log (warnings) is NULL or text, and the extra options reach NVRTC (-DSEED must define it). */
    const char *def[] = {"-DSEED=7u"};
    const char src[] = "extern \"C\" __global__ void seeded(unsigned *o) { o[0] = SEED; }\n";
    st = fm_nvrtc_compile(src, "seeded.cu", 80, 0, def, 1, &cubin, &size, &log, &err);
    CHECK(st == FM_OK && is_elf(cubin, size), "extra option -DSEED=7u reaches NVRTC (%zu-byte CUBIN)", size);
    CHECK(log == NULL || strlen(log) > 0, "success log is NULL or non-empty text");
    free(cubin);
    free(log);
    fm_error_clear(&err);
}

/* ------------------------------------------------------------------------------------------------ driver */

static void test_no_driver(const fm_error *load_err) {
    printf("CUDA: no usable driver on this machine\n");
    show_error("fm_cuda_load", load_err);
    CHECK(load_err->status == FM_ERR_LIBRARY, "fm_cuda_load gives FM_ERR_LIBRARY");
    CHECK(contains(load_err->message, "libcuda.so.1"), "message names libcuda.so.1");
    CHECK(contains(load_err->hint, "install the NVIDIA driver") && contains(load_err->hint, "device='cpu'"),
          "hint says to install the driver or use device='cpu'");

    fm_error err = {0};
    CHECK(fm_cuda_load(&err) == FM_ERR_LIBRARY, "a second fm_cuda_load retries and fails the same way");
    fm_error_clear(&err);
    fm_devptr p = 123;
    CHECK(fm_mem_alloc(&p, 64, &err) == FM_ERR_LIBRARY && p == 0, "fm_mem_alloc without a driver: FM_ERR_LIBRARY");
    fm_error_clear(&err);
    fm_gpu gpu;
    CHECK(fm_gpu_open(0, &gpu, &err) == FM_ERR_LIBRARY && gpu.ctx == NULL,
          "fm_gpu_open without a driver: FM_ERR_LIBRARY");
    fm_error_clear(&err);
    int count = -1;
    CHECK(fm_cuda_device_count(&count, &err) == FM_ERR_LIBRARY && count == 0, "device count without a driver: 0");
    fm_error_clear(&err);
    fm_kernel k;
    memset(&k, 0, sizeof k);
    fm_gpu_close(&gpu);
    fm_kernel_unload(&k);
    fm_mem_free(0);
    CHECK(1, "fm_gpu_close, fm_kernel_unload and fm_mem_free accept zeroed handles");
}

/* Compiles source for the GPU's arch and loads `name` from it. */
static fm_status build(const fm_gpu *gpu, const char *source, const char *name, size_t smem, int threads,
                       fm_kernel *k, fm_error *err) {
    void *cubin = NULL;
    size_t size = 0;
    fm_status st = fm_nvrtc_compile(source, name, gpu->arch, 0, NULL, 0, &cubin, &size, NULL, err);
    if (st == FM_OK)
        st = fm_kernel_load(gpu, cubin, name, smem, threads, k, err);
    free(cubin); /* the driver copied the image */
    return st;
}

typedef struct launch_job {
    const fm_gpu *gpu;
    const fm_kernel *k;
    unsigned seed, n;
    int ok;
    char message[1024];
} launch_job;

/* Fills a buffer with the pattern (n not a multiple of the block) and checks it and the untouched tail. */
static void *pattern_job(void *arg) {
    launch_job *j = arg;
    fm_error err = {0};
    fm_devptr d = 0;
    unsigned n = j->n, seed = j->seed, pad = 37;
    unsigned *host = malloc((size_t)(n + pad) * sizeof *host);
    void *params[] = {&d, &n, &seed};
    unsigned grid = (n + (unsigned)j->k->threads - 1) / (unsigned)j->k->threads;
    fm_status st = host ? FM_OK : FM_ERR_NOMEM;

    if (st == FM_OK) st = fm_gpu_activate(j->gpu, &err);
    if (st == FM_OK) st = fm_mem_alloc(&d, (size_t)(n + pad) * sizeof *host, &err);
    if (st == FM_OK) st = fm_memset_d8(d, 0xAB, (size_t)(n + pad) * sizeof *host, NULL, &err);
    if (st == FM_OK) st = fm_kernel_launch(j->k, grid, NULL, params, 0, &err);
    if (st == FM_OK) st = fm_memcpy_dtoh(host, d, (size_t)(n + pad) * sizeof *host, NULL, &err);
    if (st == FM_OK) st = fm_stream_sync(NULL, &err);
    j->ok = st == FM_OK;
    for (unsigned i = 0; j->ok && i < n + pad; i++) {
        unsigned want = i < n ? pattern_value(i, seed) : 0xABABABABu;
        if (host[i] != want) {
            snprintf(j->message, sizeof j->message, "word %u is %08x, want %08x", i, host[i], want);
            j->ok = 0;
        }
    }
    if (st != FM_OK)
        snprintf(j->message, sizeof j->message, "%s", err.message);
    fm_mem_free(d);
    free(host);
    fm_error_clear(&err);
    return NULL;
}

static void test_mma_on_gpu(const fm_gpu *gpu) {
    if (gpu->arch < 80)
        return;
    fm_error err = {0};
    fm_kernel k;
    fm_devptr d_out = 0, d_a = 0, d_b = 0;
    unsigned a[128], b[64];
    float out[128];
    /* A = 1.0 (fp16 0x3C00), B = 2.0 (0x4000): every D element is sum over k=16 of 1*2 = 32. */
    for (int i = 0; i < 128; i++) a[i] = 0x3C003C00u;
    for (int i = 0; i < 64; i++) b[i] = 0x40004000u;
    void *params[] = {&d_out, &d_a, &d_b};
    fm_status st = build(gpu, k_mma_k16, "mma_k16", 0, 32, &k, &err);
    if (st == FM_OK) st = fm_mem_alloc(&d_out, sizeof out, &err);
    if (st == FM_OK) st = fm_mem_alloc(&d_a, sizeof a, &err);
    if (st == FM_OK) st = fm_mem_alloc(&d_b, sizeof b, &err);
    if (st == FM_OK) st = fm_memcpy_htod(d_a, a, sizeof a, NULL, &err);
    if (st == FM_OK) st = fm_memcpy_htod(d_b, b, sizeof b, NULL, &err);
    if (st == FM_OK) st = fm_kernel_launch(&k, 1, NULL, params, 0, &err);
    if (st == FM_OK) st = fm_memcpy_dtoh(out, d_out, sizeof out, NULL, &err);
    if (st == FM_OK) st = fm_stream_sync(NULL, &err);
    int good = st == FM_OK;
    for (int i = 0; good && i < 128; i++)
        good = out[i] == 32.0f;
    CHECK(good, "m16n8k16 mma on the GPU: all 128 outputs are 32.0 (%s)", st == FM_OK ? "ran" : err.message);
    fm_mem_free(d_out);
    fm_mem_free(d_a);
    fm_mem_free(d_b);
    fm_kernel_unload(&k);
    fm_error_clear(&err);
}

static void test_gpu_errors(const fm_gpu *gpu) {
    fm_error err = {0};
    fm_kernel k;
    fm_status st = build(gpu, k_pattern, "no_such_kernel", 0, 128, &k, &err);
    show_error("fm_kernel_load(name='no_such_kernel')", &err);
    CHECK(st == FM_ERR_CUDA && err.code == 500 && contains(err.message, "CUDA_ERROR_NOT_FOUND") &&
              contains(err.message, "cuModuleGetFunction"),
          "missing kernel name: FM_ERR_CUDA, code 500, CUDA_ERROR_NOT_FOUND and the call in the message");
    CHECK(k.module == NULL && k.function == NULL, "the module is unloaded again after the failure");
    fm_error_clear(&err);

    st = build(gpu, k_pattern, "pattern", gpu->smem_per_block_optin + 1024, 128, &k, &err);
    show_error("fm_kernel_load(smem = opt-in limit + 1 KiB)", &err);
    CHECK(st == FM_ERR_LIMIT, "shared memory beyond the opt-in limit gives FM_ERR_LIMIT");
    fm_error_clear(&err);

    fm_devptr p = 0;
    st = fm_mem_alloc(&p, (size_t)1 << 50, &err);
    show_error("fm_mem_alloc(1 PiB)", &err);
    CHECK(st == FM_ERR_CUDA && err.code == 2 && contains(err.message, "CUDA_ERROR_OUT_OF_MEMORY") && p == 0,
          "1 PiB allocation: FM_ERR_CUDA with CUDA_ERROR_OUT_OF_MEMORY (2)");
    fm_error_clear(&err);

    fm_gpu bad;
    int count = 0;
    fm_cuda_device_count(&count, &err);
    st = fm_gpu_open(count, &bad, &err);
    CHECK(st == FM_ERR_VALUE && bad.ctx == NULL, "fm_gpu_open(%d) with %d devices gives FM_ERR_VALUE", count, count);
    fm_error_clear(&err);
}

static void test_gpu(void) {
    printf("CUDA: driver present\n");
    fm_error err = {0};
    int count = 0;
    fm_status st = fm_cuda_device_count(&count, &err);
    CHECK(st == FM_OK && count >= 1, "%d CUDA device(s)", count);
    fm_gpu gpu;
    st = fm_gpu_open(0, &gpu, &err);
    CHECK(st == FM_OK, "fm_gpu_open(0)%s%s", st == FM_OK ? "" : ": ", err.message);
    if (st != FM_OK) {
        fm_error_clear(&err);
        return;
    }
    printf("        name %s, sm_%d, %d SMs, smem opt-in %zu B/block, %zu B/SM\n", gpu.name, gpu.arch,
           gpu.sm_count, gpu.smem_per_block_optin, gpu.smem_per_sm);
    CHECK(gpu.arch >= 75 && gpu.sm_count > 0 && gpu.smem_per_block_optin >= 64 * 1024 &&
              gpu.smem_per_sm >= gpu.smem_per_block_optin,
          "device properties are plausible");

    fm_kernel k;
    size_t smem = 64 * 1024; /* above the 48 KiB default: needs cuFuncSetAttribute */
    st = build(&gpu, k_pattern, "pattern", smem, 128, &k, &err);
    CHECK(st == FM_OK && k.blocks_per_sm >= 1, "pattern kernel loaded with %zu B shared memory, %d block(s)/SM%s%s",
          smem, k.blocks_per_sm, st == FM_OK ? "" : ": ", err.message);
    fm_error_clear(&err);
    if (st == FM_OK) {
        printf("CUDA: pattern kernel launched from 4 threads, each its own buffer\n");
        launch_job jobs[4];
        pthread_t th[4];
        for (int i = 0; i < 4; i++) {
            memset(&jobs[i], 0, sizeof jobs[i]);
            jobs[i].gpu = &gpu;
            jobs[i].k = &k;
            jobs[i].seed = 0x9E3779B9u * (unsigned)(i + 1);
            jobs[i].n = 10000u + 333u * (unsigned)i;
            pthread_create(&th[i], NULL, pattern_job, &jobs[i]);
        }
        for (int i = 0; i < 4; i++) {
            pthread_join(th[i], NULL);
            CHECK(jobs[i].ok, "thread %d: %u words match the pattern, tail untouched%s%s", i, jobs[i].n,
                  jobs[i].ok ? "" : ": ", jobs[i].message);
        }
        CHECK(fm_kernel_launch(&k, 0, NULL, NULL, 0, &err) == FM_OK, "a zero grid is a no-op");
    }
    fm_kernel_unload(&k);
    test_mma_on_gpu(&gpu);
    test_gpu_errors(&gpu);
    fm_gpu_close(&gpu);
    CHECK(gpu.ctx == NULL, "fm_gpu_close zeroes the handle");
    fm_error_clear(&err);
}

int main(int argc, char **argv) {
    const char *hint = argc > 1 ? argv[1] : getenv("FUSEDMLP_NVRTC");
    setvbuf(stdout, NULL, _IOLBF, 0);

    test_nvrtc_not_found();
    test_nvrtc_load(hint);
    if (fm_nvrtc_library_path() != NULL) {
        test_nvrtc_compile_archs();
        test_nvrtc_errors();
    }

    fm_error err = {0};
    fm_status st = fm_cuda_load(&err);
    if (st == FM_OK)
        test_gpu();
    else if (st == FM_ERR_CUDA && contains(err.message, "CUDA_ERROR_NO_DEVICE"))
        show_error("fm_cuda_load: a driver but no GPU, GPU checks skipped", &err);
    else
        test_no_driver(&err);
    fm_error_clear(&err);

    printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "PASSED", g_failures);
    return g_failures ? 1 : 0;
}
