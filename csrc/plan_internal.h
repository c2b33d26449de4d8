/* plan_internal.h - what plan.c (padding, the mma.sync plans, the choice among kernels, packing), plan_sm90.c (the
 * sm_90a warpgroup kernel's plans) and gemm.c (the GEMM layer's plans) share; not part of the core's boundary
 * (fm.h). */
#ifndef FM_PLAN_INTERNAL_H
#define FM_PLAN_INTERNAL_H

#include "fm.h"

/* plan.c */
int fm_round_up(int v, int m);
/* Bytes per row of a warp's output stage (16-bit y: its padded width and a 16-byte pad). */
int fm_stage_row_bytes(const fm_plan *p);
/* Elements per row of a warp's activation buffers for these padded values (stage: the output stage shares them). */
int fm_act_stride(const fm_plan *p, const int *value_pad, int num_values, int stage);
/* Weight and bias blob offsets per layer (w_offset, b_offset, dq_offset, w_elems, b_floats, w_rank_elems). */
void fm_plan_blobs(fm_plan *p);
/* Whether the target has the precision's mma and the spec what an 8-bit plan needs (its scales, calibrated). */
fm_status fm_plan_check_prec(const fm_spec *spec, const fm_target *target, fm_prec prec, fm_error *err);
/* An 8-bit plan's pointers to the spec's scales (plan->prec set; nothing for other precisions). */
void fm_plan_take_scales(const fm_spec *spec, fm_plan *plan);

/* plan_sm90.c */
/* Why the register-A form with resident weights cannot run this network (NULL: it can). */
const char *fm_plan_wgmma_unfit(const fm_plan *p, int widest);
/* Each layer one column group, unless a forced n_chunk (rounded up to 16) splits the wider ones. */
void fm_plan_wgmma_chunks(fm_plan *p, int forced);
/* fm_plan.pipe and kpipe of a register-A plan: on (where possible) or off. */
void fm_plan_pipe(fm_plan *p, const fm_spec *spec, int on);
/* The warpgroup kernel's shared-memory layout at `warps` warps (and blocks_per_sm); returns its bytes. */
size_t fm_plan_wgmma_layout(fm_plan *p, const fm_target *t, int warps, const int *value_pad);
/* A cluster plan of `cluster` CTAs (1, 2 or 4). */
fm_status fm_plan_cluster(fm_plan *p, const fm_target *t, const fm_plan_opts *opts, int cluster, int widest,
                          const int *value_pad, fm_error *err);
/* The first cluster shape of the auto order's entries [from, to) that fits: 1 with the plan in *p, else 0. */
int fm_plan_cluster_auto(fm_plan *p, const fm_target *t, const fm_plan_opts *opts, int widest, const int *value_pad,
                         int from, int to);
/* Whether a value of the network (x, a layer's output) is wider than 256: the streamed form's wide layers. */
int fm_plan_has_wide_value(const fm_plan *p);
/* The streamed register-A form. */
fm_status fm_plan_stream(fm_plan *p, const fm_target *t, const fm_plan_opts *opts, int widest, const int *value_pad,
                         fm_error *err);

#endif
