/* pack.c - a plan's weights and float blob in the layouts its kernel reads (fm_plan_w_index), rounded on the host to
 * the compute precision (or to 8-bit codes), so the kernel reads ready operands. Plan.load packs once per kernel and
 * FusedMLP.set_weights (Network.assign) again for every loaded kernel, so packing is spread over threads by rows. */
#define _DEFAULT_SOURCE /* sysconf(_SC_NPROCESSORS_ONLN) under -std=c11 */
#include "fm.h"

#include <pthread.h>
#include <string.h>
#include <unistd.h>

enum {
    FM_PACK_SLICE = 256,           /* a row's weights rounded at a time (fm_round_row) */
    FM_PACK_ELEMS_PER_THREAD = 8192, /* weights a thread takes at least (~50 us of packing; a thread starts in ~20) */
    FM_PACK_THREADS = 8,           /* at most */
};

static void fm_pack_store(const fm_plan *plan, void *w_blob, size_t at, uint32_t bits) {
    if (plan->elem_bytes == 1)
        ((uint8_t *)w_blob)[at] = (uint8_t)bits;
    else if (plan->elem_bytes == 2)
        ((uint16_t *)w_blob)[at] = (uint16_t)bits;
    else
        ((uint32_t *)w_blob)[at] = bits;
}

/* Rows [n0, n1) of layer l (their stored elements alone: jobs on other rows write elsewhere). */
typedef struct {
    const fm_plan *plan;
    const float *w;          /* layer l's weights, n_real x k_real row-major */
    const double *col_mean;  /* a centred layer's column means over its outputs (fm_plan.centred), else NULL */
    void *w_blob;
    int l, n0, n1;
} fm_pack_job;

/* A row's weights are rounded a slice at a time in one loop (fm_round_row), and each 16-byte piece of a stored row,
 * whose elements every layout keeps together and in order but for the packed codes' permutation (fm_plan.k_perm),
 * is placed by one fm_plan_w_index: an index with its integer divisions and a rounding call for each element made
 * packing ~25 ns an element (rec1024's 1024 x 1024 GEMM 29 ms on one core). */
static void fm_pack_rows(const fm_pack_job *job) {
    const fm_plan *plan = job->plan;
    const int l = job->l, kr = plan->k_real[l];
    /* Input column k of nn.Linear's weight: the first concat part's columns, then the second part's at k0_pad. */
    const int k0r = plan->k0_real[l], shift = plan->k0_pad[l] - k0r;
    /* x_split: the columns [x0, x0 + xw) of the stored input that are x's take three parts (fm_plan.x_split) */
    const int xw = plan->x_split && (l == 0 || plan->cat[l] != FM_CAT_NONE) ? plan->k0_real[0] : 0;
    const int x0 = l == 0 || plan->cat[l] == FM_CAT_BEFORE ? 0 : k0r;
    const int per16 = 16 / plan->elem_bytes, runs = !plan->k_perm[l], quant = fm_prec_is_8bit(plan->prec);
    float vals[FM_PACK_SLICE];
    uint32_t bits[FM_PACK_SLICE];
    for (int n = job->n0; n < job->n1; ++n) {
        size_t at = 0;
        int left = 0; /* elements the piece at `at` has left */
        const float *row = job->w + (size_t)n * kr;
        for (int k0 = 0; k0 < kr; k0 += FM_PACK_SLICE) {
            const int len = kr - k0 < FM_PACK_SLICE ? kr - k0 : FM_PACK_SLICE;
            for (int i = 0; i < len; ++i) { /* (an 8-bit weight's code: of w / w_scale[l][n], as ref.c takes it) */
                const float wc = job->col_mean ? (float)((double)row[k0 + i] - job->col_mean[k0 + i]) : row[k0 + i];
                vals[i] = quant ? (float)((double)wc / (double)plan->w_scale[l][n]) : wc;
            }
            fm_round_row(vals, len, plan->prec, bits);
            for (int i = 0; i < len; ++i, ++at, --left) {
                const int k = k0 + i, kk = k < k0r ? k : k + shift; /* the stored column */
                if (left <= 0 || k == k0r) {
                    at = fm_plan_w_index(plan, l, n, kk);
                    left = runs ? per16 - kk % per16 : 1;
                }
                fm_pack_store(plan, job->w_blob, at, bits[i]);
                if (k >= x0 && k < x0 + xw) { /* W_hi again at x_lo's column, W_lo (exact difference) at x_hi's */
                    const float lo = vals[i] - fm_bits_value(bits[i], plan->prec);
                    fm_pack_store(plan, job->w_blob, fm_plan_w_index(plan, l, n, kk + xw), bits[i]);
                    fm_pack_store(plan, job->w_blob, fm_plan_w_index(plan, l, n, kk + 2 * xw),
                                  fm_round_bits(lo, plan->prec));
                }
            }
        }
    }
}

static void *fm_pack_worker(void *arg) {
    fm_pack_rows(arg);
    return NULL;
}

/* The threads that pack `elems` weights: one per FM_PACK_ELEMS_PER_THREAD, at most the CPUs and FM_PACK_THREADS. */
static int fm_pack_threads(size_t elems) {
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    size_t t = elems / FM_PACK_ELEMS_PER_THREAD;
    if (cpus > 0 && t > (size_t)cpus)
        t = (size_t)cpus;
    return t > FM_PACK_THREADS ? FM_PACK_THREADS : t < 1 ? 1 : (int)t;
}

/* Layer l's rows in `threads` jobs, the last on this thread (and all of them where a thread does not start). */
static void fm_pack_layer(const fm_plan *plan, const float *w, const double *col_mean, void *w_blob, int l) {
    const int nr = plan->n_real[l];
    int threads = fm_pack_threads((size_t)nr * (size_t)plan->k_real[l]);
    if (threads > nr)
        threads = nr;
    fm_pack_job jobs[FM_PACK_THREADS];
    pthread_t ids[FM_PACK_THREADS];
    int started[FM_PACK_THREADS] = {0};
    for (int t = 0; t < threads; ++t) {
        jobs[t] = (fm_pack_job){plan, w, col_mean, w_blob, l, (int)((long long)nr * t / threads),
                                (int)((long long)nr * (t + 1) / threads)};
        if (t < threads - 1)
            started[t] = pthread_create(&ids[t], NULL, fm_pack_worker, &jobs[t]) == 0;
    }
    fm_pack_rows(&jobs[threads - 1]);
    for (int t = 0; t < threads - 1; ++t) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            fm_pack_rows(&jobs[t]);
    }
}

void fm_plan_pack(const fm_plan *plan, const float *const *w, const float *const *b, void *w_blob, float *b_blob) {
    memset(w_blob, 0, plan->w_elems * (size_t)plan->elem_bytes);
    memset(b_blob, 0, plan->b_floats * sizeof *b_blob);
    for (int l = 0; l < plan->num_layers; ++l) {
        const int kr = plan->k_real[l], nr = plan->n_real[l];
        /* a centred layer (a fused plan's: its inputs at most two parts of FM_MAX_FUSED_WIDTH): W's columns less
         * their means over the outputs, in float64, then rounded */
        double col_mean[2 * FM_MAX_FUSED_WIDTH] = {0};
        for (int n = 0; plan->centred[l] && n < nr; ++n)
            for (int k = 0; k < kr; ++k)
                col_mean[k] += (double)w[l][(size_t)n * kr + k] / nr;
        if (kr > 0 && nr > 0)
            fm_pack_layer(plan, w[l], plan->centred[l] ? col_mean : NULL, w_blob, l);
        /* q_fold: both times the next input's inverse scale, the float32 quotient the kernels' QOUT is */
        const double fold = plan->q_fold[l] ? (double)(1.0f / plan->act_scale[l + 1]) : 1.0;
        const int has_b = b != NULL && b[l] != NULL && plan->has_bias[l];
        double b_mean = 0.0; /* a centred layer's bias less its mean */
        for (int n = 0; has_b && plan->centred[l] && n < nr; ++n)
            b_mean += (double)b[l][n] / nr;
        for (int n = 0; has_b && n < nr; ++n)
            b_blob[plan->b_offset[l] + n] = (float)(((double)b[l][n] - b_mean) * fold);
        for (int n = 0; fm_prec_is_8bit(plan->prec) && n < nr; ++n) /* padded columns: 0, their outputs stay 0 */
            b_blob[plan->dq_offset[l] + n] =
                (float)((double)plan->act_scale[l] * (double)plan->w_scale[l][n] * fold);
    }
}

void fm_plan_pack_norms(const fm_plan *plan, const fm_spec *spec, float *b_blob) {
    for (int l = 0; l < plan->num_layers; ++l) {
        if (!plan->norm[l])
            continue;
        float *gamma = b_blob + plan->b_offset[l] + plan->n_pad[l], *beta = gamma + plan->n_pad[l];
        const float scale = plan->norm_half[l] ? 0.5f : 1.0f; /* (exact) */
        for (int n = 0; n < plan->n_real[l]; ++n) {
            gamma[n] = scale * (spec->norm_w[l] != NULL ? spec->norm_w[l][n] : 1.0f);
            beta[n] = scale * (spec->norm_b[l] != NULL ? spec->norm_b[l][n] : 0.0f);
        }
    }
}
