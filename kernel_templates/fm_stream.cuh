// fm_stream.cuh - fused_mlp_sm90.cu's streamed weights (FM_STREAM > 0): the slots, their mbarriers and counters, and
// the order of the column groups through them. Included by fused_mlp_sm90.cu after the clusters' helpers
// (fm_cluster.cuh), whose mbarrier functions it uses, and before the layers that run the groups.
// ------------------------------------------------------------------------------------------------ streamed weights
//
// FM_STREAM > 0 (plan.c, fm_plan_stream): the register-A form for networks whose weights do not stay in shared memory
// or whose layers are too wide for all their accumulators and fragments at once (256 -> 256: 128 + 64 + 64 registers).
// The weights stay in global memory (read from L2: a 256-wide layer is 128 KB) and pass through FM_STREAM slots of
// SLOT_B bytes. Each layer runs as column groups of Layer<L>::NC columns; a group's weights (NC rows of the layer in
// the core-matrix layout) are contiguous in the blob, so filling a slot is one cp.async.bulk that completes on the
// slot's `full` mbarrier, and the group's wgmma reads the slot through the same descriptor form as resident weights.
// Every warp runs the same groups in the same order (layer by layer, tile by tile: Q groups per tile), so the CTA's
// group number seq uses slot seq % FM_STREAM, in that slot's fill seq / FM_STREAM (the barrier's phase parity). A warp
// done with a group's MMAs adds one to its slot's counter; the warp whose addition completes the CTA's count refills
// the slot with group seq + FM_STREAM. So no warp waits to refill and none is a dedicated producer; FM_STREAM slots
// keep that many groups in flight ahead of the slowest warp.
constexpr int SLOT_B = FM_STREAM ? FM_SLOT_ELEMS * EB : 0;
constexpr fm_u32 NSLOT = FM_STREAM > 0 ? FM_STREAM : 1;  // (a divisor NVRTC sees even where the form is off)
// The stream's barriers after the per-warp buffers: FM_STREAM `full` mbarriers, then FM_STREAM counters.
constexpr int STREAM_BAR_B = FM_STREAM ? (12 * FM_STREAM + 15) / 16 * 16 : 0;

// Layer L's columns per slot: its column group (Layer<L>::NC), or for a norm layer, whose group is the whole row
// (fm_norm_tiles needs all its accumulators), and for every layer of an 8-bit network (fm_epi_codes packs the whole
// row's codes), as many columns as a slot holds: such a group's MMAs read several slots.
// A slot holds Layer<L>::KC of the K inputs of those columns: a layer wider than 256 has its groups' weights arrive in
// K pieces (plan.c, fm_plan.k_chunk), one after another into the same accumulators.
template <int L> __device__ constexpr int fm_chunk_cols() {
    typedef Layer<L> Ly;
    static_assert(Ly::KC == Ly::K || (FM_STREAM > 0 && Ly::NORM == 0 && Ly::KC % KE == 0),
                  "K pieces: streamed weights, not a norm layer, whole k steps");
    static_assert(!Ly::WIDE || (FM_STREAM > 0 && L != LAST), "wide layers: streamed weights; not the last (its output "
                                                             "goes to the stage)");
    if constexpr (FM_STREAM == 0) {
        return Ly::NC;
    } else {
        constexpr int fit = SLOT_B / (Ly::KC * EB) / 16 * 16;
        static_assert(fit >= 16 && (fit >= Ly::NC || Ly::NC == Ly::N), "a slot holds a group, or a norm layer's "
                                                                        "16-column pieces");
        return fit < Ly::NC ? fit : Ly::NC;
    }
}
// Layer L's K pieces per chunk of columns.
template <int L> __device__ constexpr int fm_kpieces() { return (Layer<L>::K + Layer<L>::KC - 1) / Layer<L>::KC; }
// FM_SPLIT (plan.c, fm_plan.split): whether layer L is split over the cluster's CTAs, each computing 1/FM_SPLIT of
// its column groups (a wide layer, looped: fm_wide_layer) and storing them into every CTA's wide buffer.
template <int L> __device__ constexpr bool fm_split_layer() { return FM_SPLIT > 1 && Layer<L>::WIDE; }
// Whether layer L is the tile's last split layer (its hand-over's last arrival waits for the tile's y: fm_wide_reload).
template <int L> __device__ constexpr bool fm_split_after() {
    if constexpr (L > LAST)
        return false;
    else
        return fm_split_layer<L>() || fm_split_after<L + 1>();
}
template <int L> __device__ constexpr bool fm_last_split() { return fm_split_layer<L>() && !fm_split_after<L + 1>(); }
// FM_WIDE_LOOP (plan.c, fm_plan.wide_loop): whether layer L's whole column groups run as one loop over one group's
// code (fm_wide_layer) rather than unrolled: a wide layer (WIDE; or the last layer, whose output goes to the stage,
// where it is as wide: over 256 in or out) of two groups or more, each one slot's chunk, with no residual (its
// operand, the input fragment of the group's columns, would be a register array indexed at run time) and no norm.
template <int L> __device__ constexpr bool fm_wide_looped() {
    if constexpr (!FM_WIDE_LOOP || FM_STREAM == 0 || FM_PREC >= 3) {
        return false;
    } else {
        typedef Layer<L> Ly;
        constexpr bool wide = L == LAST ? Ly::K > 256 || Ly::N > 256 : Ly::WIDE;
        return wide && Ly::RES == 0 && Ly::NORM == 0 && Ly::N / Ly::NC >= 2 && fm_chunk_cols<L>() == Ly::NC;
    }
}

// Layer L's diagonal blocks whose column groups stream only their own K pieces: Layer<L>::BLOCKS (render.c: its
// weights block-diagonal, parallel stacks of Linears read as one network; fm_spec_find_blocks) where the layer's groups
// run as a loop (fm_wide_looped) unsplit, each block's column groups and K pieces whole; else 1. The pieces a group
// skips hold zeros: the same sums, bit for bit, with half (B = 2) the layer's MMAs and weight traffic.
template <int L> __device__ constexpr int fm_blocks() {
    if constexpr (!fm_wide_looped<L>() || fm_split_layer<L>()) {
        return 1;
    } else {
        typedef Layer<L> Ly;
        constexpr int B = Ly::BLOCKS;
        // (K a multiple of B KC: each block's K range is whole pieces, and the pieces divide among the blocks)
        return B > 1 && (Ly::N / Ly::NC) % B == 0 && Ly::K % (B * Ly::KC) == 0 ? B : 1;
    }
}
// Layer L's slot fills in this CTA ("chunks": its column groups, or a norm layer's pieces, each in K pieces; a split
// layer's own groups), and those of layers L.. together.
template <int L> __device__ constexpr int fm_groups() {
    return (Layer<L>::N + fm_chunk_cols<L>() - 1) / fm_chunk_cols<L>() * (fm_kpieces<L>() / fm_blocks<L>()) /
           (fm_split_layer<L>() ? FM_SPLIT : 1);
}
template <int L> __device__ constexpr int fm_groups_from() {
    if constexpr (L > LAST)
        return 0;
    else
        return fm_groups<L>() + fm_groups_from<L + 1>();
}
constexpr int STREAM_Q = fm_groups_from<0>();  // groups per tile
// The first group of layer L in a tile's sequence.
template <int L> __device__ constexpr int fm_group0() {
    if constexpr (L == 0)
        return 0;
    else
        return fm_group0<L - 1>() + fm_groups<L - 1>();
}
struct fm_group_span {
    unsigned long long off;  // bytes from the blob's start
    fm_u32 bytes;
};
// Group q of a tile's sequence in CTA `rank` of a cluster (layers L.. from group q of layer L on): its weights' place
// in the blob. (A split layer's groups in CTA r: its chunks r G / FM_SPLIT.., G the layer's chunks.)
template <int L> __device__ constexpr fm_group_span fm_group_at(int q, int rank = 0) {
    if constexpr (L > LAST) {
        return {0ull, 0u};
    } else {
        typedef Layer<L> Ly;
        if (q >= fm_groups<L>())
            return fm_group_at<L + 1>(q - fm_groups<L>(), rank);
        constexpr int CH = fm_chunk_cols<L>(), KP = fm_kpieces<L>() / fm_blocks<L>();  // (a chunk's own pieces)
        // chunk q / KP of columns (w of them from c0), its piece q % KP of its block's (kw inputs from k0): the
        // chunk's w rows in the blob from row c0 on, its pieces one after another (plan.c, fm_plan_w_index)
        const int own = fm_split_layer<L>() ? rank * (fm_groups<L>() / KP) : 0;  // this CTA's first chunk
        const int c0 = (own + q / KP) * CH, w = Ly::N - c0 < CH ? Ly::N - c0 : CH;
        const int blk = fm_blocks<L>() > 1 ? c0 / (Ly::N / fm_blocks<L>()) : 0;  // the chunk's block
        const int k0 = (blk * KP + q % KP) * Ly::KC;
        const int kw = Ly::K - k0 < Ly::KC ? Ly::K - k0 : Ly::KC;
        return {(unsigned long long)EB * ((unsigned long long)Ly::W_OFF + (unsigned long long)c0 * Ly::K +
                                          (unsigned long long)w * k0),
                (fm_u32)(EB * w * kw)};
    }
}

struct fm_stream {
    fm_u32 slots;  // shared: slot 0
    fm_u32 bars;   // shared: the `full` mbarriers, then the counters
    fm_u32 seq;    // the CTA's group this warp runs next
    fm_u32 total;  // the CTA's groups over its whole run (its tiles x STREAM_Q)
    const unsigned char *w;
    fm_u32 rank;   // FM_SPLIT: this CTA's rank in its cluster
};

// Fills the slot of group number seq with the weights at g (those of group seq % STREAM_Q of a tile's sequence),
// where `on`: one arrival announcing the bytes, and the copy completing them.
__device__ __forceinline__ void fm_stream_fill(fm_u32 on, const fm_stream &st, fm_u32 seq, fm_group_span g) {
    const fm_u32 slot = seq % NSLOT, bar = st.bars + 8 * slot;
    asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %0, 0;\n"
                 "@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [%1], %2;\n"
                 "@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%3], [%4], %2, [%1];\n}"
                 ::"r"(on), "r"(bar), "r"(g.bytes), "r"(st.slots + slot * SLOT_B), "l"(st.w + g.off)
                 : "memory");
}
// The slot of this warp's next chunk, once its weights have landed.
__device__ __forceinline__ fm_u32 fm_stream_acquire(const fm_stream &st) {
    const fm_u32 slot = st.seq % NSLOT;
    fm_mbar_wait(st.bars + 8 * slot, (st.seq / NSLOT) & 1u);
    return st.slots + slot * SLOT_B;
}
// After this warp's MMAs of a group are done: its arrival on the slot's counter and, from the CTA's last warp to
// arrive, the slot's refill with the group FM_STREAM later, whose weights are at next. Predicated, no branch: a
// divergent path near the MMAs made ptxas serialize every wgmma of the kernel (its warning C7519; see fm_cl_send).
__device__ __forceinline__ void fm_stream_release_to(fm_stream &st, int lane, fm_group_span next) {
    const fm_u32 slot = st.seq % NSLOT;
    const fm_u32 on = (lane == 0) & (st.seq + FM_STREAM < st.total);
    fm_u32 last;
    __syncwarp();  // every lane's wgmma wait has returned
    asm volatile("{\n.reg .pred p, q;\n.reg .b32 old, r;\nsetp.ne.u32 p, %1, 0;\nmov.u32 old, 0;\n"
                 "@p atom.shared.add.u32 old, [%2], 1;\n"
                 "rem.u32 r, old, %3;\nsetp.eq.u32 q, r, %4;\nand.pred q, q, p;\nselp.u32 %0, 1, 0, q;\n}"
                 : "=r"(last)
                 : "r"(on), "r"(st.bars + 8 * FM_STREAM + 4 * slot), "n"(FM_WARPS), "n"(FM_WARPS - 1)
                 : "memory");
    fm_stream_fill(last, st, st.seq + FM_STREAM, next);
    ++st.seq;
}
// FM_WIDE_LOOP: where group q is known at run time only (a wide layer's column groups run as a loop, fm_wide_layer),
// the place of each group's successor, group (q + FM_STREAM) % STREAM_Q, from a table of the tile's STREAM_Q groups in
// constant memory: one uniform load, no branch. A template, so that only a kernel that reads it has it. FM_SPLIT: a
// table per rank of the cluster (each CTA's split layers read their own chunks).
enum : int { SPLIT_N = FM_SPLIT > 1 ? FM_SPLIT : 1 };  // (an enum: no global in the cubin)
struct fm_next_groups {
    unsigned long long off[SPLIT_N * STREAM_Q];
    fm_u32 bytes[SPLIT_N * STREAM_Q];
};
template <int Z> __device__ constexpr fm_next_groups fm_next_groups_of() {
    fm_next_groups t{};
    for (int r = 0; r < SPLIT_N; ++r)
        for (int q = 0; q < STREAM_Q; ++q) {
            const fm_group_span g = fm_group_at<0>((q + FM_STREAM) % STREAM_Q, r);
            t.off[r * STREAM_Q + q] = g.off;
            t.bytes[r * STREAM_Q + q] = g.bytes;
        }
    return t;
}
template <int Z> __constant__ fm_next_groups fm_next_group = fm_next_groups_of<Z>();
template <int Z = 0> __device__ __forceinline__ void fm_stream_release_at(fm_stream &st, int lane, int q) {
    const int i = FM_SPLIT > 1 ? (int)st.rank * STREAM_Q + q : q;
    fm_stream_release_to(st, lane, fm_group_span{fm_next_group<Z>.off[i], fm_next_group<Z>.bytes[i]});
}
// The same after group Q (of the tile sequence), its successor's place named at compile time (FM_SPLIT: the table's,
// the successor depending on the CTA's rank).
template <int Q> __device__ __forceinline__ void fm_stream_release(fm_stream &st, int lane) {
    if constexpr (FM_SPLIT > 1) {
        fm_stream_release_at(st, lane, Q);
    } else {
        constexpr fm_group_span next = fm_group_at<0>((Q + FM_STREAM) % STREAM_Q);
        fm_stream_release_to(st, lane, next);
    }
}
