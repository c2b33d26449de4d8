/* host_pipe.c - a large host-array call in pieces, each piece's host copy, bus copies and kernel under the others'.
 *
 * One copy each way through pageable memory is what the driver does for a plain cuMemcpyHtoD: it copies the array
 * into its own page-locked buffers with one CPU thread, then the copy engine moves them. On the H200 machine that ran
 * 6.8 GB/s host to device and 13.1 back, against 54 GB/s each way from page-locked memory, while one thread copies
 * host memory at 10 GB/s and eight at 39 (bench/results/h200-host-pipe/host_probe.txt). So 2^24 rows of tcnn64
 * (2 GB of x, 1 GB of y) took 317 ms for a 0.86 ms kernel. Here up to FM_PIPE_WORKERS threads each take a
 * contiguous share of the rows and run it in pieces through FM_PIPE_SLOTS slots of their own: copy a piece of x
 * into the slot's page-locked buffer, then on the slot's stream copy it to the device, launch, copy y's piece back;
 * the piece's y is copied out of the slot when the slot comes round again, after its stream has finished. The
 * kernel is the caller's, unchanged, on fewer rows a launch: a row's outputs do not depend on the other rows, so
 * the bits are those of one launch over all rows. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#endif
#include "fm.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef __linux__
#include <sched.h>
#endif

/* x and y together below this go as one copy each way: two slots' worth, where a piece's copies could overlap. */
size_t fm_pipe_min_bytes(void) { return 2 * (size_t)FM_PIPE_SLOT_BYTES; }

/* y's part starts 256 bytes past x's in a slot (device pointers stay 256-byte aligned, as cuMemAlloc's are). */
int64_t fm_pipe_piece_rows(size_t x_row, size_t y_row) {
    return (int64_t)((FM_PIPE_SLOT_BYTES - 256) / (x_row + y_row));
}

typedef struct {
    fm_pipe *pipe;
    const fm_gpu *gpu;
    int worker;
    const char *x;
    char *y;
    int64_t rows, piece_rows, first, end; /* this worker's pieces: [first, end) */
    size_t x_row, y_row, y_offset;        /* y_offset: where y's piece starts in a slot, 256-byte aligned */
    int poison;
    fm_pipe_launch launch;
    void *ctx;
    atomic_int *stop; /* set by the first worker that fails */
    fm_status st;
    fm_error err;
} pipe_job;

/* Makes a slot's stream and buffers on first use. */
static fm_status pipe_slot_ready(fm_pipe_slot *s, fm_error *err) {
    fm_status st = FM_OK;
    if (s->stream == NULL)
        st = fm_stream_create(&s->stream, err);
    if (st == FM_OK && s->host == NULL)
        st = fm_host_alloc(&s->host, FM_PIPE_SLOT_BYTES, err);
    if (st == FM_OK && s->dev == 0)
        st = fm_mem_alloc(&s->dev, FM_PIPE_SLOT_BYTES, err);
    return st;
}

static int64_t pipe_piece_rows(const pipe_job *j, int64_t piece) {
    int64_t r0 = piece * j->piece_rows;
    return j->rows - r0 < j->piece_rows ? j->rows - r0 : j->piece_rows;
}

/* Waits for piece's work on the slot's stream, then copies its outputs into y. */
static fm_status pipe_drain(pipe_job *j, fm_pipe_slot *s, int64_t piece) {
    fm_status st = fm_stream_sync(s->stream, &j->err);
    if (st == FM_OK)
        memcpy(j->y + (size_t)(piece * j->piece_rows) * j->y_row, (const char *)s->host + j->y_offset,
               (size_t)pipe_piece_rows(j, piece) * j->y_row);
    return st;
}

/* Host copy of piece's x into the slot, then its device copy, launch and copy back on the slot's stream. */
static fm_status pipe_issue(pipe_job *j, fm_pipe_slot *s, int64_t piece) {
    const size_t n = (size_t)pipe_piece_rows(j, piece), x_bytes = n * j->x_row, y_bytes = n * j->y_row;
    memcpy(s->host, j->x + (size_t)(piece * j->piece_rows) * j->x_row, x_bytes);
    fm_status st = fm_memcpy_htod(s->dev, s->host, x_bytes, s->stream, &j->err);
    if (st == FM_OK && j->poison) /* 0xFF.. is NaN in float16 and float32: an unwritten element cannot pass */
        st = fm_memset_d8(s->dev + j->y_offset, 0xFF, y_bytes, s->stream, &j->err);
    if (st == FM_OK)
        st = j->launch(j->ctx, (int)(s - j->pipe->slot[0]), s->dev, s->dev + j->y_offset, (int64_t)n, s->stream,
                       &j->err);
    if (st == FM_OK)
        st = fm_memcpy_dtoh((char *)s->host + j->y_offset, s->dev + j->y_offset, y_bytes, s->stream, &j->err);
    return st;
}

static void *pipe_worker(void *arg) {
    pipe_job *j = arg;
    fm_pipe_slot *slots = j->pipe->slot[j->worker];
    int64_t pending[FM_PIPE_SLOTS];
    for (int i = 0; i < FM_PIPE_SLOTS; i++)
        pending[i] = -1;
    fm_status st = fm_gpu_activate(j->gpu, &j->err);
    for (int64_t piece = j->first; st == FM_OK && piece < j->end; piece++) {
        if (atomic_load(j->stop))
            break;
        const int i = (int)((piece - j->first) % FM_PIPE_SLOTS);
        if (pending[i] >= 0)
            st = pipe_drain(j, &slots[i], pending[i]);
        pending[i] = -1;
        if (st == FM_OK)
            st = pipe_slot_ready(&slots[i], &j->err);
        if (st == FM_OK)
            st = pipe_issue(j, &slots[i], piece);
        if (st == FM_OK)
            pending[i] = piece;
    }
    /* Every stream is waited for, failed or not: no copy may still write a slot once the run returns. */
    for (int k = 0; k < FM_PIPE_SLOTS; k++) {
        const int i = (int)((j->end - j->first + k) % FM_PIPE_SLOTS); /* oldest first */
        if (pending[i] < 0)
            continue;
        if (st == FM_OK)
            st = pipe_drain(j, &slots[i], pending[i]);
        else
            fm_stream_sync(slots[i].stream, NULL);
    }
    if (st != FM_OK)
        atomic_store(j->stop, 1);
    j->st = st;
    return NULL;
}

/* Threads this process may run on (its affinity mask where Linux tells it), at least 1. */
static int pipe_cpus(void) {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

fm_status fm_pipe_run(fm_pipe *pipe, const fm_gpu *gpu, const void *x, void *y, int64_t rows, size_t x_row,
                      size_t y_row, int poison, fm_pipe_launch launch, void *ctx, fm_error *err) {
    if (rows < 1 || x_row + y_row == 0 || x_row + y_row > FM_PIPE_SLOT_BYTES / 2)
        return fm_fail(err, FM_ERR_VALUE, "fm_pipe_run: rows %lld of %zu + %zu bytes: needs rows >= 1 and 1 to %d "
                       "bytes a row", (long long)rows, x_row, y_row, FM_PIPE_SLOT_BYTES / 2);
    const int64_t piece_rows = fm_pipe_piece_rows(x_row, y_row);
    const size_t y_offset = ((size_t)piece_rows * x_row + 255) / 256 * 256;
    const int64_t pieces = (rows + piece_rows - 1) / piece_rows;
    int workers = pipe_cpus();
    if (workers > FM_PIPE_WORKERS)
        workers = FM_PIPE_WORKERS;
    if (workers > pieces)
        workers = (int)pieces;
    pipe_job jobs[FM_PIPE_WORKERS];
    pthread_t threads[FM_PIPE_WORKERS];
    int started[FM_PIPE_WORKERS] = {0};
    atomic_int stop = 0;
    for (int w = 0; w < workers; w++) {
        jobs[w] = (pipe_job){.pipe = pipe, .gpu = gpu, .worker = w, .x = x, .y = y, .rows = rows,
                             .piece_rows = piece_rows, .first = pieces * w / workers,
                             .end = pieces * (w + 1) / workers, .x_row = x_row, .y_row = y_row,
                             .y_offset = y_offset, .poison = poison, .launch = launch, .ctx = ctx, .stop = &stop};
    }
    /* worker 0 runs on this thread; one that cannot start runs here after it */
    for (int w = 1; w < workers; w++)
        started[w] = pthread_create(&threads[w], NULL, pipe_worker, &jobs[w]) == 0;
    pipe_worker(&jobs[0]);
    for (int w = 1; w < workers; w++) {
        if (started[w])
            pthread_join(threads[w], NULL);
        else
            pipe_worker(&jobs[w]);
    }
    fm_status st = FM_OK;
    for (int w = 0; w < workers; w++) {
        if (st == FM_OK && jobs[w].st != FM_OK) { /* the first failure is the cause; the others stopped for it */
            st = jobs[w].st;
            *err = jobs[w].err;
            jobs[w].err.log = NULL;
        }
        fm_error_clear(&jobs[w].err);
    }
    return st;
}

void fm_pipe_free(fm_pipe *pipe) {
    for (int w = 0; w < FM_PIPE_WORKERS; w++)
        for (int i = 0; i < FM_PIPE_SLOTS; i++) {
            fm_pipe_slot *s = &pipe->slot[w][i];
            fm_stream_destroy(s->stream);
            fm_host_free(s->host);
            fm_mem_free(s->dev);
            *s = (fm_pipe_slot){0};
        }
}
