/*
 * nvrtc.c - CUDA source -> CUBIN through NVRTC, found and opened at run time (no CUDA headers, no link-time
 * dependency: importing fusedmlp needs no CUDA at all).
 *
 * Search order of fm_nvrtc_load(path_hint), first library that opens and has every symbol wins:
 *   1. path_hint: a ':'-separated list of candidates, tried left to right. A file is dlopen'ed as is; for a
 *      directory, libnvrtc.so.13, libnvrtc.so.12 and libnvrtc.so inside it. The Python layer passes
 *      FUSEDMLP_NVRTC first, then the pip wheel folders it finds on sys.path (nvidia/cu13/lib,
 *      nvidia/cuda_nvrtc/lib), which the C core cannot know.
 *   2. a libnvrtc already loaded in the process (PyTorch, CuPy): RTLD_NOLOAD of libnvrtc.so.13, .12, .so.
 *   3. $CUDA_PATH/lib64, $CUDA_HOME/lib64, /usr/local/cuda/lib64 (same three names in each).
 *   4. the plain sonames libnvrtc.so.13, libnvrtc.so.12 (LD_LIBRARY_PATH, ldconfig cache).
 * Once loaded, later calls return at once and ignore their hint. A failed search is not cached: the next call
 * searches again (the user may have installed the wheel meanwhile).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dladdr, RTLD_NOLOAD */
#endif
#include "fm.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* The slice of nvrtc.h used here; these signatures are stable since CUDA 11.1 (nvrtcGetCUBIN appeared then). */
typedef int nvrtcResult; /* enum; NVRTC_SUCCESS = 0 */
typedef struct _nvrtcProgram *nvrtcProgram;
enum { NVRTC_SUCCESS = 0, NVRTC_ERROR_OUT_OF_MEMORY = 1 };

typedef struct fm_nvrtc_api {
    nvrtcResult (*nvrtcVersion)(int *major, int *minor);
    const char *(*nvrtcGetErrorString)(nvrtcResult result);
    nvrtcResult (*nvrtcCreateProgram)(nvrtcProgram *prog, const char *src, const char *name, int num_headers,
                                      const char *const *headers, const char *const *include_names);
    nvrtcResult (*nvrtcCompileProgram)(nvrtcProgram prog, int num_options, const char *const *options);
    nvrtcResult (*nvrtcGetProgramLogSize)(nvrtcProgram prog, size_t *size);
    nvrtcResult (*nvrtcGetProgramLog)(nvrtcProgram prog, char *log);
    nvrtcResult (*nvrtcGetCUBINSize)(nvrtcProgram prog, size_t *size);
    nvrtcResult (*nvrtcGetCUBIN)(nvrtcProgram prog, char *cubin);
    nvrtcResult (*nvrtcDestroyProgram)(nvrtcProgram *prog);
} fm_nvrtc_api;

/* Written once under g_lock, then published through g_ready (release) and only read afterwards. */
static fm_nvrtc_api g_api;
static void *g_handle;
static char g_path[4096];
static atomic_int g_ready;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *const k_sonames[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
#define FM_NUM_SONAMES ((int)(sizeof k_sonames / sizeof k_sonames[0]))

/* What a search saw, for the error message when nothing worked. */
typedef struct fm_search {
    fm_str tried;        /* "a, b, c" */
    char first_err[512]; /* first dlerror() of a file that exists, or of a library lacking a symbol */
} fm_search;

static void search_note(fm_search *s, const char *what) {
    if (s->tried.len > 0)
        fm_str_append(&s->tried, ", ");
    fm_str_append(&s->tried, what);
}

static void search_error(fm_search *s, const char *fmt, const char *a, const char *b) {
    if (s->first_err[0] == '\0')
        snprintf(s->first_err, sizeof s->first_err, fmt, a, b);
}

/* Resolves every entry point of g_api from handle; on a missing symbol records it and returns 0. */
static int resolve_all(void *handle, fm_nvrtc_api *api, const char *file, fm_search *s) {
#define FM_RESOLVE(sym)                                                                                         \
    do {                                                                                                        \
        *(void **)&api->sym = dlsym(handle, #sym);                                                             \
        if (api->sym == NULL) {                                                                                 \
            search_error(s, "%s lacks the symbol %s (NVRTC older than CUDA 11.1?)", file, #sym);               \
            return 0;                                                                                           \
        }                                                                                                       \
    } while (0)
    FM_RESOLVE(nvrtcVersion);
    FM_RESOLVE(nvrtcGetErrorString);
    FM_RESOLVE(nvrtcCreateProgram);
    FM_RESOLVE(nvrtcCompileProgram);
    FM_RESOLVE(nvrtcGetProgramLogSize);
    FM_RESOLVE(nvrtcGetProgramLog);
    FM_RESOLVE(nvrtcGetCUBINSize);
    FM_RESOLVE(nvrtcGetCUBIN);
    FM_RESOLVE(nvrtcDestroyProgram);
#undef FM_RESOLVE
    return 1;
}

/* NVRTC dlopens libnvrtc-builtins.so.<major>.<minor> by name at its first compile and finds it through its
 * RPATH $ORIGIN. That breaks when anything interposes dlopen (AddressSanitizer's interceptor makes the lookup use
 * libasan's RPATH) and for a copy without RPATH outside the loader's path. Loading the file beside libnvrtc by its
 * full path first makes NVRTC's by-name dlopen match it by SONAME. Missing is not an error here: NVRTC then
 * searches as usual and its log says what it could not open. The handle is kept for the process's lifetime. */
static void preload_builtins(const fm_nvrtc_api *api, const char *nvrtc_file) {
    int major = 0, minor = 0;
    const char *slash = strrchr(nvrtc_file, '/');
    char file[4096];
    if (slash == NULL || api->nvrtcVersion(&major, &minor) != NVRTC_SUCCESS)
        return;
    int n = snprintf(file, sizeof file, "%.*s/libnvrtc-builtins.so.%d.%d", (int)(slash - nvrtc_file), nvrtc_file,
                     major, minor);
    if (n > 0 && (size_t)n < sizeof file)
        (void)dlopen(file, RTLD_NOW | RTLD_LOCAL);
}

/* Opens `file` with `flags`; on success fills g_api/g_handle/g_path and returns 1. */
static int try_open(const char *file, int flags, fm_search *s) {
    dlerror();
    void *h = dlopen(file, flags);
    if (h == NULL) {
        struct stat st;
        const char *why = dlerror();
        /* A file that exists but does not open (wrong architecture, missing dependency) is worth reporting;
         * a name that is simply absent is the normal case of a search. */
        if (strchr(file, '/') != NULL && stat(file, &st) == 0)
            search_error(s, "%s%s", why ? "" : file, why ? why : ": dlopen failed"); /* dlerror names the file */
        return 0;
    }
    fm_nvrtc_api api;
    memset(&api, 0, sizeof api);
    if (!resolve_all(h, &api, file, s)) {
        dlclose(h);
        return 0;
    }
    /* dladdr names the file the loader actually mapped, also when we only gave a soname. */
    Dl_info info;
    const char *where = file;
    if (dladdr(*(void **)&api.nvrtcVersion, &info) != 0 && info.dli_fname != NULL && info.dli_fname[0] != '\0')
        where = info.dli_fname;
    snprintf(g_path, sizeof g_path, "%s", where);
    preload_builtins(&api, g_path);
    g_api = api;
    g_handle = h;
    return 1;
}

/* Tries the three names inside directory dir. */
static int try_dir(const char *dir, fm_search *s) {
    char file[4096];
    fm_str note = {0};
    fm_str_printf(&note, "%s/{libnvrtc.so.13,.12,.so}", dir);
    search_note(s, note.data ? note.data : dir);
    fm_str_free(&note);
    for (int i = 0; i < FM_NUM_SONAMES; i++) {
        int n = snprintf(file, sizeof file, "%s/%s", dir, k_sonames[i]);
        if (n < 0 || (size_t)n >= sizeof file)
            return 0;
        if (try_open(file, RTLD_NOW | RTLD_LOCAL, s))
            return 1;
    }
    return 0;
}

/* One entry of path_hint: a directory or a file. */
static int try_candidate(const char *path, fm_search *s) {
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
        return try_dir(path, s);
    search_note(s, path);
    return try_open(path, RTLD_NOW | RTLD_LOCAL, s);
}

static int try_hint_list(const char *hint, fm_search *s) {
    const char *p = hint;
    while (*p != '\0') {
        const char *end = strchr(p, ':');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n > 0 && n < 4096) {
            char path[4096];
            memcpy(path, p, n);
            path[n] = '\0';
            if (try_candidate(path, s))
                return 1;
        }
        if (end == NULL)
            break;
        p = end + 1;
    }
    return 0;
}

static int search(const char *hint, fm_search *s) {
    if (hint != NULL && hint[0] != '\0' && try_hint_list(hint, s))
        return 1;

    search_note(s, "already-loaded libnvrtc");
    for (int i = 0; i < FM_NUM_SONAMES; i++)
        if (try_open(k_sonames[i], RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD, s))
            return 1;

    const char *const envs[] = {"CUDA_PATH", "CUDA_HOME"};
    for (int i = 0; i < 2; i++) {
        const char *root = getenv(envs[i]);
        if (root == NULL || root[0] == '\0')
            continue;
        char dir[4096];
        int n = snprintf(dir, sizeof dir, "%s/lib64", root);
        if (n > 0 && (size_t)n < sizeof dir && try_dir(dir, s))
            return 1;
    }
    if (try_dir("/usr/local/cuda/lib64", s))
        return 1;

    for (int i = 0; i < 2; i++) {
        search_note(s, k_sonames[i]);
        if (try_open(k_sonames[i], RTLD_NOW | RTLD_LOCAL, s))
            return 1;
    }
    return 0;
}

fm_status fm_nvrtc_load(const char *path_hint, fm_error *err) {
    if (atomic_load_explicit(&g_ready, memory_order_acquire))
        return FM_OK;
    fm_status st = FM_OK;
    fm_search s;
    memset(&s, 0, sizeof s);

    pthread_mutex_lock(&g_lock);
    if (atomic_load_explicit(&g_ready, memory_order_relaxed))
        goto cleanup; /* another thread loaded it while we waited */
    if (search(path_hint, &s)) {
        atomic_store_explicit(&g_ready, 1, memory_order_release);
        goto cleanup;
    }
    st = fm_fail(err, FM_ERR_LIBRARY, "NVRTC (libnvrtc.so) not found%s%s; tried: %s",
                 s.first_err[0] ? "; " : "", s.first_err, s.tried.data ? s.tried.data : "(nothing)");
    fm_error_hint(err, "pip install nvidia-cuda-nvrtc (CUDA 13), or set FUSEDMLP_NVRTC to the path of libnvrtc.so");

cleanup:
    pthread_mutex_unlock(&g_lock);
    fm_str_free(&s.tried);
    return st;
}

const char *fm_nvrtc_library_path(void) {
    return atomic_load_explicit(&g_ready, memory_order_acquire) ? g_path : NULL;
}

/* Loads with the default search (no hint) when nobody called fm_nvrtc_load yet. */
static fm_status nvrtc_ready(fm_error *err) {
    if (atomic_load_explicit(&g_ready, memory_order_acquire))
        return FM_OK;
    return fm_nvrtc_load(NULL, err);
}

/* Records a failed NVRTC call: "<call> failed: NVRTC_ERROR_... (nvrtcResult N)[ compiling 'x.cu' for sm_XX]
 * (file:line)". */
static fm_status nvrtc_failed(fm_error *err, nvrtcResult r, const char *call, const char *target,
                              const char *file, int line) {
    fm_status st = r == NVRTC_ERROR_OUT_OF_MEMORY ? FM_ERR_NOMEM : FM_ERR_COMPILE;
    if (err != NULL && err->status == FM_OK)
        err->code = r;
    const char *name = g_api.nvrtcGetErrorString ? g_api.nvrtcGetErrorString(r) : NULL;
    return fm_fail(err, st, "%s failed: %s (nvrtcResult %d)%s%s (%s:%d)", call, name ? name : "unknown error", r,
                   target ? " compiling " : "", target ? target : "", file, line);
}

/* Every NVRTC call goes through here: on failure record it and jump to cleanup. `st` and `target` ("'x.cu' for
 * sm_90", or NULL) must be in scope. */
#define NVRTC_CHECK(fn, args)                                                                                   \
    do {                                                                                                        \
        nvrtcResult r_ = g_api.fn args;                                                                         \
        if (r_ != NVRTC_SUCCESS) {                                                                              \
            st = nvrtc_failed(err, r_, #fn #args, target, __FILE__, __LINE__);                                  \
            goto cleanup;                                                                                       \
        }                                                                                                       \
    } while (0)

fm_status fm_nvrtc_version(int *major, int *minor, fm_error *err) {
    const char *target = NULL; /* read by NVRTC_CHECK */
    fm_status st = nvrtc_ready(err);
    if (st != FM_OK)
        return st;
    NVRTC_CHECK(nvrtcVersion, (major, minor));
cleanup:
    return st;
}

/* Copies NVRTC's log out of prog; *out stays NULL when the log is empty. */
static fm_status read_log(nvrtcProgram prog, const char *target, char **out, fm_error *err) {
    fm_status st = FM_OK;
    size_t size = 0;
    char *log = NULL;
    *out = NULL;
    NVRTC_CHECK(nvrtcGetProgramLogSize, (prog, &size));
    if (size <= 1) /* the size counts the NUL */
        goto cleanup;
    log = malloc(size);
    if (log == NULL) {
        st = fm_fail(err, FM_ERR_NOMEM, "out of memory for a %zu-byte NVRTC log", size);
        goto cleanup;
    }
    NVRTC_CHECK(nvrtcGetProgramLog, (prog, log));
    log[size - 1] = '\0';
    *out = log;
    log = NULL;
cleanup:
    free(log);
    return st;
}

fm_status fm_nvrtc_compile(const char *source, const char *name, int arch, int arch_a, const char *const *extra_opts,
                           int num_extra_opts, void **cubin, size_t *cubin_size, char **log, fm_error *err) {
    char target[300], arch_opt[64];
    nvrtcProgram prog = NULL;
    const char **opts = NULL;
    char *plog = NULL;
    void *bin = NULL;
    size_t bin_size = 0;
    fm_status st;

    *cubin = NULL;
    *cubin_size = 0;
    if (log != NULL)
        *log = NULL;
    snprintf(target, sizeof target, "'%.200s' for sm_%d%s", name ? name : "fusedmlp.cu", arch, arch_a ? "a" : "");
    if (source == NULL || arch < 10 || arch > 1000 || num_extra_opts < 0 || (num_extra_opts > 0 && !extra_opts))
        return fm_fail(err, FM_ERR_VALUE, "fm_nvrtc_compile: needs source, an arch like 90 (got %d) and "
                       "num_extra_opts >= 0 with extra_opts (got %d)", arch, num_extra_opts);
    st = nvrtc_ready(err);
    if (st != FM_OK)
        return st;

    /* No include paths: the generated source is self-contained (the prelude declares what it needs). */
    snprintf(arch_opt, sizeof arch_opt, "--gpu-architecture=sm_%d%s", arch, arch_a ? "a" : "");
    int nopts = 3 + num_extra_opts;
    opts = malloc((size_t)nopts * sizeof *opts);
    if (opts == NULL) {
        st = fm_fail(err, FM_ERR_NOMEM, "out of memory for %d NVRTC options", nopts);
        goto cleanup;
    }
    opts[0] = arch_opt;
    opts[1] = "-std=c++17";
    opts[2] = "--fmad=true";
    for (int i = 0; i < num_extra_opts; i++)
        opts[3 + i] = extra_opts[i];

    NVRTC_CHECK(nvrtcCreateProgram, (&prog, source, name ? name : "fusedmlp.cu", 0, NULL, NULL));
    nvrtcResult compiled = g_api.nvrtcCompileProgram(prog, nopts, opts);
    st = read_log(prog, target, &plog, err);
    if (st != FM_OK)
        goto cleanup;
    if (compiled != NVRTC_SUCCESS) {
        int first = err == NULL || err->status == FM_OK;
        st = nvrtc_failed(err, compiled, "nvrtcCompileProgram(prog, nopts, opts)", target, __FILE__, __LINE__);
        if (first && err != NULL) {
            err->log = plog; /* the error owns it now; fm_error_clear frees it */
            plog = NULL;
        }
        if (err != NULL && err->log != NULL && strstr(err->log, "libnvrtc-builtins") != NULL)
            fm_error_hint(err, "NVRTC could not open its builtins library: keep libnvrtc-builtins.so.* in the "
                          "folder of %s (reinstall nvidia-cuda-nvrtc)", g_path);
        fm_error_hint(err, "NVRTC's log (fm_error.log) says what it rejected, with line numbers of '%s'",
                      name ? name : "fusedmlp.cu");
        goto cleanup;
    }

    NVRTC_CHECK(nvrtcGetCUBINSize, (prog, &bin_size));
    bin = malloc(bin_size ? bin_size : 1);
    if (bin == NULL) {
        st = fm_fail(err, FM_ERR_NOMEM, "out of memory for a %zu-byte CUBIN", bin_size);
        goto cleanup;
    }
    NVRTC_CHECK(nvrtcGetCUBIN, (prog, bin));
    *cubin = bin;
    *cubin_size = bin_size;
    bin = NULL;
    if (log != NULL) {
        *log = plog;
        plog = NULL;
    }

cleanup:
    if (prog != NULL) {
        /* Not through NVRTC_CHECK: a destroy failure must not mask the first error or leak on success. */
        nvrtcResult r = g_api.nvrtcDestroyProgram(&prog);
        if (r != NVRTC_SUCCESS && st == FM_OK)
            st = nvrtc_failed(err, r, "nvrtcDestroyProgram(&prog)", target, __FILE__, __LINE__);
    }
    if (st != FM_OK && *cubin != NULL) {
        free(*cubin);
        *cubin = NULL;
        *cubin_size = 0;
    }
    if (st != FM_OK && log != NULL && *log != NULL) {
        free(*log);
        *log = NULL;
    }
    free(bin);
    free(plog);
    free(opts);
    return st;
}
