// fm_shared_a.cuh - fused_mlp_sm90.cu's cluster form (FM_CLUSTER >= 1): each layer's output through its warpgroup's
// A buffer in shared memory, exchanged between a cluster's CTAs. Included by fused_mlp_sm90.cu after the register-A
// layers, whose epilogue helpers and output stage (fm_out) it shares, and before the kernel.
// ------------------------------------------------------------------------------------------------ A in shared memory
//
// FM_CLUSTER >= 1 (plan.c, fm_plan_cluster): the form for networks whose hidden layers are too wide for the register
// fragments of the register-A form (a 256-wide layer's accumulators plus its input and output fragments are over 255
// registers) or whose weights are too large for one CTA (siren256: 280 KB). A layer's output goes to its warpgroup's A buffer in
// shared memory (64 rows x the widest input, wgmma's K-major no-swizzle layout: 8-column chunk c at c * 1024 bytes,
// row r at r * 16 in it), which the next layer's wgmma reads through a descriptor. A cluster of FM_CLUSTER CTAs runs
// the same rows: CTA r holds rows [r, r + 1) * NC of every hidden layer's weights and computes those columns, stores
// them into its own A buffer, and copies them (cp.async.bulk, 64 x NC x 2 bytes) into the same place in the others'
// buffers. The last layer too, where it is wider than 16 columns (SPLIT_LAST), each CTA then storing its columns of y;
// a narrower one runs whole in CTA 0, which alone writes y. A residual is the layer's own input: the same
// columns of the A buffer as the ones the layer's output overwrites (layer 0: x's fragments).
//
// Per warpgroup and CTA, two mbarriers order the exchange of each hidden layer's output ("exchange" e):
// - full: its buffer holds the next layer's whole input. One arrival (this warpgroup's copying thread, announcing
//   the bytes the others send), completed by the others' copies (complete_tx).
// - empty: every other CTA's warpgroup has finished reading its buffer (its MMA is done), so this one may copy
//   into them. FM_CLUSTER - 1 arrivals, remote.
// Both complete once per exchange, in order, so one parity bit tracks them. With FM_CLUSTER == 1 there is nothing to
// exchange: a named barrier of the warpgroup orders its four warps' stores before the next MMA.

constexpr int CL = FM_CLUSTER > 0 ? FM_CLUSTER : 1;

// The widest input of layers 1.. (the A buffer's columns; layer 0's A is x, in registers), as plan.c's
// fm_plan_cluster_kmax.
template <int L> __device__ constexpr int fm_kmax() {
    if constexpr (L > LAST)
        return 16;
    else
        return Layer<L>::K > fm_kmax<L + 1>() ? Layer<L>::K : fm_kmax<L + 1>();
}
constexpr int ABUF_B = FM_CLUSTER > 0 ? 64 * fm_kmax<1>() * EB : 0;  // one warpgroup's A buffer, bytes
constexpr int CHUNK_B = 64 * 16;                                       // one 8-column chunk of it
// Whether any of layers L.. has a norm.
template <int L> __device__ constexpr bool fm_any_norm() {
    if constexpr (L > LAST)
        return false;
    else
        return Layer<L>::NORM != 0 || fm_any_norm<L + 1>();
}
// A cluster's norm layers exchange each row's partial statistics (fm_cl_norm): per warpgroup two rounds' slots of CL x
// 64 rows x (mean, M2) floats, then two mbarriers (plan.c, fm_plan_wgmma_layout, counts them the same way).
constexpr bool CL_NORM = FM_CLUSTER > 1 && fm_any_norm<0>();
constexpr int NSTAT_SLOT_B = 64 * 8;  // one CTA's statistics of the warpgroup's 64 rows
constexpr int NSTAT_B = CL_NORM ? 2 * CL * NSTAT_SLOT_B + 16 : 0;

__device__ __forceinline__ void fm_wg_bar(int wg) {  // the warpgroup's four warps (barrier 0 is __syncthreads)
    asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
}

// What a warpgroup's thread carries through the layers of the shared-memory-A form.
struct fm_cl_state {
    fm_u32 abuf;      // the warpgroup's A buffer (shared window)
    fm_u32 full;      // its mbarriers
    fm_u32 empty;
    fm_u32 rank;      // this CTA's rank in the cluster
    fm_u32 parity;    // of the next exchange
    fm_u32 st_lane;   // this lane's stmatrix row address in chunk 0 of the buffer
    fm_u32 stats;     // CL_NORM: the warpgroup's norm statistics slots and their two mbarriers (fm_cl_norm)
    fm_u32 nround;    // CL_NORM: norm exchanges done so far
    int wg, lane;
};

// Layer L's residual operand (its own input) at this warp's rows and the 16 columns c0 + 16 p.. of its output, in the
// A fragment order of fm_cl_store's h: for layer 0 from x's fragments a (this CTA's share of them picked by rank; a
// group past x's columns is padding, which the epilogue zeroes), for the others from the A buffer, where this CTA
// itself stored those columns of the layer's input (the layers of a residual are as wide as their input, so they
// split their columns alike). Read before the layer's output overwrites them.
template <int L>
__device__ __forceinline__ void fm_cl_residual(fm_u32 (&r)[4], const fm_u32 (&a)[IN_PAD / 16][4], int p, int c0,
                                               fm_u32 rank, fm_u32 st_lane) {
    if constexpr (L == 0) {
        constexpr int S = IN_PAD / 16;
#pragma unroll
        for (int q = 0; q < CL; ++q) {
            const int s = q * (Layer<0>::NC / 16) + p < S ? q * (Layer<0>::NC / 16) + p : S - 1;
            if (q == 0 || rank == (fm_u32)q) {
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    r[i] = a[s][i];
            }
        }
    } else {
        fm_ldmatrix_x4(r, st_lane + (fm_u32)(c0 / 8 + 2 * p) * CHUNK_B);
    }
}

// The packed epilogue results h of layer L's 16-column group p (columns c0 + 16 p..) of this lane's rows, in the A
// fragment order, from the accumulators d and the residual operand r (that order too).
template <int L, bool FAST>
__device__ __forceinline__ void fm_cl_group(fm_u32 (&h)[4], const float (&d)[Layer<L>::NC / 2], const fm_u32 (&r)[4],
                                            int p, int c0, int t, bool (&f)[4]) {
    typedef Layer<L> Ly;
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
        const int j = 2 * p + jj, col = c0 + 8 * j + 2 * t;
        const bool live = Ly::NR == Ly::N || c0 + 8 * j < Ly::NR;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float r0 = 0.0f, r1 = 0.0f;
            if constexpr (Ly::RES != 0)
                fm_unpack2(r[2 * jj + hh], r0, r1);
            h[2 * jj + hh] = live ? fm_epilogue16<L, FM_PREC + 1, FAST>(d[4 * j + 2 * hh], d[4 * j + 2 * hh + 1], r0,
                                                                        r1, col, f[2 * jj + hh])
                                  : 0u;
        }
    }
}

// Whether layer L redoes a far argument's 16-column group before storing it, rather than storing all its columns a
// second time after the first store (fm_cl_layer): a residual layer >= 1, whose operand the first store overwrites.
template <int L> __device__ constexpr bool fm_cl_redo_by_group() { return L > 0 && Layer<L>::RES != 0; }

// Layer L's output columns [c0, c0 + NC) of this warp's rows into the warpgroup's A buffer: 16 columns (two 8-column
// tiles: one stmatrix of four 8x8 matrices) at a time, in the A fragment order (rows g and g + 8 of the first tile,
// then of the second), each with its residual operand (fm_cl_residual). FAST: through act_t, noting in far where act
// is needed instead (or, fm_cl_redo_by_group, redoing those groups through act).
template <int L, bool FAST>
__device__ __forceinline__ void fm_cl_store(const float (&d)[Layer<L>::NC / 2], const fm_u32 (&a)[IN_PAD / 16][4],
                                            int c0, int t, const fm_cl_state &s, bool &far) {
    typedef Layer<L> Ly;
    constexpr bool REDO_HERE = FAST && fm_cl_redo_by_group<L>();
    bool f[4] = {false, false, false, false};  // four flags, not one: each FSETP.OR waits for the last's predicate
#pragma unroll
    for (int p = 0; p < Ly::NC / 16; ++p) {
        fm_u32 r[4] = {0u, 0u, 0u, 0u}, h[4];
        if constexpr (Ly::RES != 0)
            fm_cl_residual<L>(r, a, p, c0, s.rank, s.st_lane);
        fm_cl_group<L, FAST>(h, d, r, p, c0, t, f);
        if constexpr (REDO_HERE) {
            if (__any_sync(0xffffffffu, (f[0] || f[1]) || (f[2] || f[3]))) {
                fm_cl_group<L, false>(h, d, r, p, c0, t, f);
                f[0] = f[1] = f[2] = f[3] = false;
            }
        }
        fm_stmatrix_x4(s.st_lane + (c0 / 8 + 2 * p) * CHUNK_B, h);
    }
    far |= (f[0] || f[1]) || (f[2] || f[3]);
}

// Layer L's second store, where its first found a far argument (rare): fm_cl_store through act. Without a residual,
// one 16-column group's code runs in a loop, its accumulators rotated by a group each round, instead of NC / 16
// unrolled groups of act's per-element branch and out-of-line sinf call. siren256 (hidden layers bounded, fm_sin_b;
// only layer 0 has the redo) against the unrolled redo: 3.4% faster at 2^21 rows on the H100, 244 -> 193 registers,
// compile 0.80 -> 0.74 s on the dev machine (bench/results/h100/ab_probe_s13.txt).
template <int L>
__device__ __forceinline__ void fm_cl_store_again(const float (&d)[Layer<L>::NC / 2], const fm_u32 (&a)[IN_PAD / 16][4],
                                                  int c0, int t, const fm_cl_state &s, bool &far) {
    typedef Layer<L> Ly;
    if constexpr (Ly::RES != 0) {
        fm_cl_store<L, false>(d, a, c0, t, s, far);
    } else {
        constexpr int E = Ly::NC / 2;  // this lane's accumulators; a 16-column group's are the first 8
        float e[E];
#pragma unroll
        for (int i = 0; i < E; ++i)
            e[i] = d[i];
        const fm_u32 r[4] = {0u, 0u, 0u, 0u};
#pragma unroll 1
        for (int p = 0; p < Ly::NC / 16; ++p) {
            fm_u32 h[4];
            bool f[4] = {false, false, false, false};
            fm_cl_group<L, false>(h, e, r, 0, c0 + 16 * p, t, f);
            fm_stmatrix_x4(s.st_lane + (fm_u32)(c0 / 8 + 2 * p) * CHUNK_B, h);
            float first[8];
#pragma unroll
            for (int i = 0; i < 8; ++i)
                first[i] = e[i];
#pragma unroll
            for (int i = 0; i + 8 < E; ++i)
                e[i] = e[i + 8];
#pragma unroll
            for (int i = 0; i < 8; ++i)
                e[E - 8 + i] = first[i];
        }
    }
}

// The exchange of layer L's output (this CTA's columns, stored and fenced by the warpgroup): once the other CTAs have
// finished reading their buffers (empty), the warpgroup's elected thread copies the columns into them, and announces on
// `full` the bytes the others send it. Where the last layer is not split (!SPLIT_LAST), its input (L + 1 == LAST) goes
// to CTA 0 only; there the others' `full` is completed by CTA 0's arrival once CTA 0 has passed its wait on `empty`.
// Without that, nothing held a CTA r > 0 back: it went on to the next tile and arrived on CTA 0's `empty` again (after
// its next layer 0 MMA), and where CTA 0 was slow to reach its wait (its far-argument redo, H100), that barrier
// completed a second phase first and the wait on the parity of the first never returned
// (results/h100/sin_hang_probe.txt). It runs while the warpgroup's first MMAs of layer L + 1 are in flight, so it has
// no branch: every thread waits on `empty`, and the elected thread's copies and arrivals are predicated (a divergent
// path there made ptxas serialize every wgmma of the kernel, its warning C7519).
template <int L> __device__ __forceinline__ void fm_cl_send(const fm_cl_state &s) {
    if constexpr (CL > 1) {
        constexpr fm_u32 bytes = Layer<L>::NC * 64 * EB;
        constexpr bool to_all = L + 1 < LAST || SPLIT_LAST;
        const fm_u32 elected = (threadIdx.x & 127) == 0;
        const fm_u32 src = s.abuf + s.rank * (Layer<L>::NC / 8) * CHUNK_B;
        fm_mbar_expect(elected & (to_all || s.rank == 0), s.full, (CL - 1) * bytes);
        fm_mbar_wait(s.empty, s.parity);
#pragma unroll
        for (int q = 1; q < CL; ++q) {
            const fm_u32 peer = (s.rank + q) % CL;
            fm_bulk_to_peer(elected & (to_all || peer == 0), fm_mapa(src, peer), src, bytes, fm_mapa(s.full, peer));
            if constexpr (!to_all)  // CTA 0 has waited on its `empty`: the others' `full` of this exchange completes
                fm_mbar_arrive_cluster(elected & (s.rank == 0), fm_mapa(s.full, peer));
        }
        // Nothing waits for the copies here: `full` completes with the others' bytes, and the next epilogue, which
        // overwrites src, first waits for these copies to have read it (fm_cl_copies_read).
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
}
// The exchange of layer L's output, then the wait for the others' columns: layer L + 1's input is whole.
template <int L> __device__ __forceinline__ void fm_cl_exchange(fm_cl_state &s) {
    fm_cl_send<L>(s);
    fm_mbar_wait(s.full, s.parity);
    s.parity ^= 1u;
}
// Before a hidden layer's epilogue overwrites this CTA's columns of the buffer: the last exchange's copies have read
// them (the elected thread's wait, then the warpgroup's barrier; the four warps come out of the same wgmma wait, so
// it costs little). Waiting for that read before announcing `full` was 16% of siren256's stall samples.
__device__ __forceinline__ void fm_cl_copies_read(const fm_cl_state &s) {
    if constexpr (CL > 1) {
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        fm_wg_bar(s.wg);
    }
}

// The real columns of split layer L that CTA r computes: [r NC, (r + 1) NC) below NR.
template <int L> __device__ constexpr int fm_cl_real_cols(int r) {
    return Layer<L>::NR - r * Layer<L>::NC < 0 ? 0
           : Layer<L>::NR - r * Layer<L>::NC < Layer<L>::NC ? Layer<L>::NR - r * Layer<L>::NC : Layer<L>::NC;
}

__device__ __forceinline__ void fm_st_shared_f2(fm_u32 on, fm_u32 addr, float v0, float v1) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %0, 0;\n@p st.shared.v2.f32 [%1], {%2, %3};\n}" ::"r"(on),
                 "r"(addr), "f"(v0), "f"(v1)
                 : "memory");
}

// Layer L's norm of this lane's rows (d: its accumulators of this CTA's columns [c0, c0 + NC), waited), fm_norm_tiles
// where the CTA holds whole rows. A split layer's rows are spread over the cluster, so its statistics are too: each
// CTA reduces its own columns (n real ones) to a partial mean m and M2 = sum (z - m)^2 per row (rmsnorm: m = 0), and
// every CTA combines all CTAs' partials in rank order, the same sums in the same order everywhere, as Chan et al.'s
// pairwise update: mean = sum n_r m_r / NR, M2 = sum (M2_r + n_r (m_r - mean)^2); a softmax's partials are each
// CTA's max and sum of exp(z - max) (fm_soft_*), combined as m = max m_r, s = sum s_r exp(m_r - m). The exchange is the activation
// exchange's protocol on slots of its own: the quad's first lane stores its two rows' partials into this CTA's slot,
// the warpgroup's barrier (after a proxy fence), and the elected thread copies the slot (cp.async.bulk, 512 bytes) into
// the same slot of every other CTA, completing bytes on their mbarrier of the round; every thread then waits for
// this CTA's mbarrier, which completes once the others' slots have arrived. Rounds alternate between two slots and two
// mbarriers: a CTA can be one round ahead of another (it waits for the others' partials of each round before the
// next), never two, so round k + 2 finds round k's slot read and its mbarrier phase complete. The caller has waited for
// this CTA's earlier copies to have read their source (fm_cl_copies_read) before the stores into its own slot.
template <int L>
__device__ __forceinline__ void fm_cl_norm(float (&d)[Layer<L>::NC / 2], int c0, int t, const float *bias,
                                           fm_cl_state &s) {
    typedef Layer<L> Ly;
    constexpr int NC = Ly::NC, NT = NC / 8;
    if constexpr (Ly::NORM != 0 && (CL == 1 || NC == Ly::N)) {
        fm_norm_tiles<L, NT>(d, c0, t, bias);
    } else if constexpr (Ly::NORM != 0) {
        static_assert(CL_NORM && NC * CL == Ly::N, "a split layer: NC of the row's columns in each CTA");
        constexpr float INV_N = 1.0f / (float)Ly::NR;
        const int mine = fm_cl_real_cols<L>((int)s.rank);
        const fm_u32 slots = s.stats + (s.nround & 1u) * (CL * NSTAT_SLOT_B);
        const fm_u32 bar = s.stats + 2 * CL * NSTAT_SLOT_B + 8 * (s.nround & 1u);
        const fm_u32 row_b = (fm_u32)(16 * ((threadIdx.x >> 5) & 3) + (s.lane >> 2)) * 8;  // row g's (m, M2)
        const fm_u32 own = slots + s.rank * NSTAT_SLOT_B;
        constexpr bool EXP = Ly::NORM == 3;  // a softmax's numerators exp(z - m_own) in place (fm_soft_sum_part)
        float m_own[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            if constexpr (fm_norm_soft<L>()) {  // (max, sum of exp(z - max)) over this CTA's columns; (-inf, 0): none
                m_own[hh] = fm_quad_max(fm_soft_max_part<L, NT>(d, c0, t, hh));
                const float se = fm_quad_sum(fm_soft_sum_part<L, NT, EXP>(d, c0, t, hh, m_own[hh]));
                fm_st_shared_f2(t == 0, own + row_b + 64 * hh, m_own[hh], se);
                continue;
            }
            float m = 0.0f;
            if constexpr (fm_norm_mean<L>()) {
                const float sum = fm_quad_sum(fm_norm_part<L, NT, false>(d, c0, t, hh, 0.0f));
                m = mine > 0 ? sum / (float)mine : 0.0f;
            }
            const float m2 = fm_quad_sum(fm_norm_part<L, NT, true>(d, c0, t, hh, m));
            fm_st_shared_f2(t == 0, own + row_b + 64 * hh, m, m2);
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stores, before the async proxy reads them
        fm_wg_bar(s.wg);
        const fm_u32 elected = (threadIdx.x & 127) == 0;
        fm_mbar_expect(elected, bar, (CL - 1) * NSTAT_SLOT_B);
#pragma unroll
        for (int q = 1; q < CL; ++q) {
            const fm_u32 peer = (s.rank + q) % CL;
            fm_bulk_to_peer(elected, fm_mapa(own, peer), own, NSTAT_SLOT_B, fm_mapa(bar, peer));
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        fm_mbar_wait(bar, (s.nround >> 1) & 1u);
        s.nround += 1u;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float m[CL], m2[CL], mean = 0.0f, var = 0.0f;
#pragma unroll
            for (int r = 0; r < CL; ++r) {
                asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];"
                             : "=f"(m[r]), "=f"(m2[r])
                             : "r"(slots + r * NSTAT_SLOT_B + row_b + 64 * hh)
                             : "memory");
            }
            if constexpr (fm_norm_soft<L>()) {  // the same sums in the same order in every CTA
                float mx = m[0], se = 0.0f;
#pragma unroll
                for (int r = 1; r < CL; ++r)
                    mx = fmaxf(mx, m[r]);
#pragma unroll
                for (int r = 0; r < CL; ++r)
                    se += m2[r] * __expf(m[r] - mx);
                fm_soft_apply<L, NT, EXP>(d, c0, t, hh, mx, se, m_own[hh]);
                continue;
            }
            if constexpr (fm_norm_mean<L>()) {
#pragma unroll
                for (int r = 0; r < CL; ++r)
                    mean += (float)fm_cl_real_cols<L>(r) * m[r];
                mean *= INV_N;
            }
#pragma unroll
            for (int r = 0; r < CL; ++r) {
                const float dm = m[r] - mean;
                var += fm_norm_mean<L>() ? m2[r] + (float)fm_cl_real_cols<L>(r) * dm * dm : m2[r];
            }
            fm_norm_apply<L, NT>(d, c0, t, hh, mean, rsqrtf(var * INV_N + Ly::EPS), bias);
        }
    }
}

// Layer L >= 1's k steps over input columns [q0, q0 + QK) x 16 (the columns one CTA computed in layer L - 1).
template <int L, int QK>
__device__ __forceinline__ void fm_cl_mma_part(float (&d)[Layer<L>::NC / 2], unsigned long long adesc,
                                               unsigned long long desc, int q0) {
    adesc += (unsigned long long)(q0 * 2 * CHUNK_B / 16);
    desc += (unsigned long long)(q0 * 2 * 128 / 16);
#pragma unroll
    for (int k = 0; k < QK; ++k)  // k step: 32 bytes further along the weight rows, 2 chunks along the buffer
        fm_wgmma<Layer<L>::NC>::run_ss(d, adesc + (unsigned long long)(k * 2 * CHUNK_B / 16),
                                       desc + (unsigned long long)(k * 2 * 128 / 16), 1);
}

// Layer L for this warpgroup's 64 rows and this CTA's columns [c0, c0 + NC) (the last layer: all of them, CTA 0
// only). a: x's fragments (layer 0's A; other layers read the A buffer). A layer L >= 1 starts with the k steps
// over the input columns this CTA computed itself, already in its buffer; under them the previous layer's exchange
// runs (fm_cl_send), and the other CTAs' columns follow once `full` says they have arrived: the exchange's copies and
// mbarrier round trips are no longer between one layer's epilogue and the next layer's first MMA.
template <int L>
__device__ __forceinline__ void fm_cl_layer(const fm_u32 (&a)[IN_PAD / 16][4], fm_u32 w_base, const float *bias,
                                            const fm_out &stage, fm_cl_state &s) {
    typedef Layer<L> Ly;
    constexpr int NC = Ly::NC;
    constexpr int KS = Ly::K / 16;
    constexpr fm_u32 SBO = Ly::K * EB * 8;
    static_assert((L == LAST && !SPLIT_LAST) || NC * CL == Ly::N, "each CTA computes NC of a split layer's columns");
    static_assert(Ly::RES == 0 || L == 0 || (L == LAST ? Ly::K >= Ly::N : Ly::K == Ly::N),
                  "a residual is the layer's own input, its columns split as the layer's (fm_cl_residual)");
    const int c0 = L == LAST && !SPLIT_LAST ? 0 : (int)s.rank * NC;
    const int t = s.lane & 3;
    float d[NC / 2];  // as in fm_layer_cols, for columns c0 + 8 j + 2 t (+ 1); starting at the bias, scale-d 1
    fm_d_init<L, NC, Ly::BIAS>(d, c0, t, bias);
    const unsigned long long desc = fm_desc(w_base + EB * Ly::W_OFF, SBO);
    if constexpr (L == 0) {
        fm_wg_fence();
#pragma unroll
        for (int k = 0; k < KS; ++k)
            fm_wgmma<NC>::run(d, a[k], desc + (unsigned long long)(k * 2 * 128 / 16), 1);
    } else {
        constexpr int QK = Layer<L - 1>::NC / 16;  // k steps per CTA's share of the input
        static_assert(QK * CL == KS, "layer L's input is the CTAs' shares of layer L - 1's output");
        const unsigned long long adesc = fm_desc2(s.abuf, CHUNK_B, 128);
        if constexpr (L == LAST && !SPLIT_LAST) {  // CTA 0 only: under `rank == 0`, where a wait between MMAs
                                                    // serializes them
            if constexpr (CL > 1)
                fm_cl_exchange<L - 1>(s);
            fm_wg_fence();
            fm_cl_mma_part<L, KS>(d, adesc, desc, 0);
        } else {
            fm_wg_fence();
            fm_cl_mma_part<L, QK>(d, adesc, desc, (int)s.rank * QK);
            if constexpr (CL > 1) {
                fm_wg_commit();
                fm_cl_exchange<L - 1>(s);  // the others' shares are here
                fm_wg_fence();
#pragma unroll
                for (int q = 1; q < CL; ++q)
                    fm_cl_mma_part<L, QK>(d, adesc, desc, (int)((s.rank + q) % CL) * QK);
            }
        }
    }
    fm_wg_commit();
    fm_fence_regs(d);
    fm_wg_wait();
    fm_fence_regs(d);

    if constexpr (L == LAST) {
        if constexpr (Ly::NORM != 0 && SPLIT_LAST)
            fm_cl_copies_read(s);  // before fm_cl_norm stores into the slot an earlier round's copy read
        fm_cl_norm<L>(d, c0, t, bias, s);
#pragma unroll
        for (int p = 0; p < NC / 16; ++p) {
            fm_u32 r[4] = {0u, 0u, 0u, 0u};
            if constexpr (Ly::RES != 0)
                fm_cl_residual<L>(r, a, p, c0, s.rank, s.st_lane);
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
                const int j = 2 * p + jj, col = c0 + 8 * j + 2 * t;
                const bool live = Ly::NR == Ly::N || c0 + 8 * j < Ly::NR;
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    float r0 = 0.0f, r1 = 0.0f;
                    if constexpr (Ly::RES != 0)
                        fm_unpack2(r[2 * jj + hh], r0, r1);
                    fm_stage_pair<L>(stage, hh, col, col - c0, live, d[4 * j + 2 * hh], d[4 * j + 2 * hh + 1], r0,
                                     r1);
                }
            }
        }
    } else {
        if (CL > 1 && (threadIdx.x & 127) == 0) {  // this buffer is read: the others may copy into it
#pragma unroll
            for (int q = 1; q < CL; ++q)
                fm_mbar_arrive_cluster(1u, fm_mapa(s.empty, (s.rank + q) % CL));
        }
        fm_cl_copies_read(s);
        fm_cl_norm<L>(d, c0, t, bias, s);
        // An activation with sin/cos goes through its branch-free form (act_t) and, where any lane's argument was
        // far, once more through act.
        bool far = false;
        fm_cl_store<L, Ly::FAR>(d, a, c0, t, s, far);
        if constexpr (Ly::FAR && !fm_cl_redo_by_group<L>()) {
            if (__any_sync(0xffffffffu, far))
                fm_cl_store_again<L>(d, a, c0, t, s, far);
        }
        // The stores were generic-proxy writes; the next wgmma and the bulk copies read through the async proxy.
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        fm_wg_bar(s.wg);
    }
}

// How many hidden layers from L >= 1 on run as one loop in the shared-memory-A form (fm_cl_network): those with
// layer L's code (Layer<L>::REPEAT), not the last layer, and only where the exchange each of them starts with (of
// the layer before's output) is the same code too, which it is when layer L - 1 gives each CTA as many columns.
template <int L> __device__ constexpr int fm_cl_loop_len() {
    if constexpr (L == 0 || L >= LAST) {
        return 1;
    } else {
        constexpr int r = L + Layer<L>::REPEAT - 1 < LAST ? Layer<L>::REPEAT : LAST - L;
        return Layer<L - 1>::NC == Layer<L>::NC ? r : 1;
    }
}

// Layers L.. for this warpgroup's rows in the shared-memory-A form; a last layer not split (!SPLIT_LAST) in CTA 0 only
// (the others still send it their share of its input and wait for their `full`, keeping the exchanges in step). A
// stretch of hidden layers with the same code (siren256's two 256-wide ones) is one loop over their weights and biases,
// as in fm_network: NVRTC's time grows with the code it is given. siren256 on the H100: its cold first call (three
// tuning candidates compiled at once) 1.0-1.3 s -> 0.65-0.95 s, for 0.8% at 2^21 rows (ptxas no longer starts a layer
// under the last one's tail); a SIREN of five 256-wide hidden layers compiles in 0.42 s instead of 0.69 (dev machine).
template <int L>
__device__ __forceinline__ void fm_cl_network(const fm_u32 (&a)[IN_PAD / 16][4], fm_u32 w_base, const float *bias,
                                              const fm_out &stage, fm_cl_state &s) {
    constexpr int R = fm_cl_loop_len<L>();
    if constexpr (R > 1) {
        static_assert(fm_even_offsets<L, R>(), "a loop's layers: evenly spaced weights and biases");
        constexpr int W_STEP = Layer<L + 1>::W_OFF - Layer<L>::W_OFF, B_STEP = Layer<L + 1>::B_OFF - Layer<L>::B_OFF;
#pragma unroll 1
        for (int i = 0; i < R; ++i)  // layer L + i: layer L's code at its weights and biases
            fm_cl_layer<L>(a, w_base + EB * i * W_STEP, bias + i * B_STEP, stage, s);
        fm_cl_network<L + R>(a, w_base, bias, stage, s);
    } else if constexpr (L < LAST) {
        fm_cl_layer<L>(a, w_base, bias, stage, s);
        fm_cl_network<L + 1>(a, w_base, bias, stage, s);
    } else if (SPLIT_LAST || s.rank == 0) {
        fm_cl_layer<L>(a, w_base, bias, stage, s);
    } else if constexpr (CL > 1) {
        fm_cl_exchange<L - 1>(s);
    }
}
