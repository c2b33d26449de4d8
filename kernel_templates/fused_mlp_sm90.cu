// fused_mlp_sm90.cu - the fused MLP forward for sm_90a (Hopper): warpgroup MMA, activations in registers.
//
// Rendered by csrc/render.c like fused_mlp.cu (the mma.sync kernel, which runs everywhere else and every network
// this one does not take: plan.c, fm_plan_wgmma_unfit). Compiled by NVRTC for sm_90a.
//
// Why a second kernel: mma.sync reads each weight fragment from shared memory once per 16 or 32 rows and round-trips
// every activation through shared memory; on an H100 that kept the tensor pipe about half busy. wgmma reads the
// weights once per 64 rows straight from shared memory (a descriptor, no registers), and the fp32 accumulator
// fragment of one layer is, element for element, the A fragment of the next: a thread holds (row g, cols 2t, 2t+1)
// and (row g+8, same cols) of each 8-column tile in both. So between layers the activations never leave registers.
//
// Shape of the work:
// - A CTA is WARPS/4 warpgroups; each owns 64 consecutive rows of a row tile (warp w of it: rows 16w..16w+15) and
//   a persistent grid loops over row tiles. Warpgroups run their layers independently: while one waits on its MMAs,
//   another's epilogue (bias, activation, packing) issues, which is what keeps the tensor pipe fed.
// - Weights (all layers, resident) sit in shared memory in wgmma's K-major no-swizzle layout: 8 rows x 16 bytes core
//   matrices of 128 contiguous bytes, k fastest (LBO = 128 bytes, SBO = K * EB * 8 bytes); packed so on the host
//   (plan.c, fm_plan_w_index) and copied flat. Where they do not fit, or a layer's accumulators and fragments do not
//   fit the registers at once, they stream from global memory through slots of shared memory a column group at a
//   time (FM_STREAM, "streamed weights": fm_stream.cuh).
// - Each layer: one wgmma m64nNk16 per 16 inputs (A from registers, fp32 accumulators, N up to 256), then in
//   registers: bias, activation, the residual y = post(act(.) op r) with r the layer's
//   own input (the same thread holds the same (row, col) of it), padded columns forced to zero, packed to the next
//   layer's A fragments. The last layer writes out_t to a per-warp stage for coalesced stores.
// - Input: each warp's next 16 rows of x are in flight (cp.async) while it computes the current ones: straight into
//   its input buffer's rows when x is already act_t in rows of whole 16-byte pieces (tcnn64, tcnn128 and res128 in
//   float16), otherwise as raw bytes converted into the input buffer when they are needed. The first layer's A
//   fragments come from the input buffer by ldmatrix. Without the prefetch, the wait for x was tcnn64's largest
//   stall (ncu, H100: long scoreboard), with only 4 warps per scheduler to hide it.
//
// Plan: {{PLAN_COMMENT}}

#define FM_WARPS {{WARPS}}
#define FM_CLUSTER {{CLUSTER}}  // 0: activations in registers; n >= 1: in shared memory, clusters of n (fm_shared_a.cuh)
#define FM_KPIPE {{KPIPE}}      // 1: layers with Layer<>::PIPE run their epilogue under the next layer's MMAs
#define FM_STREAM {{STREAM_SLOTS}}  // 0: resident weights; n > 0: streamed through n slots (fm_stream.cuh)
#define FM_WIDE_LOOP {{WIDE_LOOP}}  // 1: FM_STREAM's wide layers run their column groups as a loop (fm_wide_layer)
#define FM_SPLIT {{SPLIT}}  // n > 1: FM_STREAM's wide layers split over clusters of n CTAs (fm_split_layer)
#define FM_IN_SHARED {{IN_SHARED}}  // 1: each warp's input buffer in its wide buffer's bytes (fm_plan.in_shared)
#define FM_SLOT_ELEMS {{W_SLOT_ELEMS}}
constexpr int ROWS_W = 16;  // rows per warp
static_assert({{M_TILES}} == 1 && {{BUFFERS}} == 1 && ({{RESIDENT}} == 1) == (FM_SLOT_ELEMS == 0),
              "the wgmma plan: 16 rows per warp, its own per-warp buffers; weights resident or in stream slots");

#include "fm_common.cuh"

static_assert(FM_WARPS % 4 == 0, "whole warpgroups");
static_assert(FM_PREC != 2, "the wgmma kernel takes float16, bfloat16, int8 or float8 (e4m3)");
static_assert(FM_PREC < 3 || (FM_CLUSTER == 0 && !FM_KPIPE), "8-bit: the register-A form, not K-pipelined");
static_assert(FM_STREAM == 0 || (FM_CLUSTER == 0 && !FM_KPIPE && {{RESIDENT}} == 0),
              "streamed weights: the register-A form, not K-pipelined");
constexpr int KE = 32 / EB;            // elements of one k step (32 bytes): k16 halves, k32 e4m3 codes
constexpr int WGS = FM_WARPS / 4;      // warpgroups per CTA
constexpr int ROWS_CTA = 64 * WGS;     // rows per CTA tile

// ------------------------------------------------------------------------------------------------ wgmma

#include "fm_wgmma.cuh"

// Accumulators of columns c0 + 8 j + 2 t (+ 1), rows g and g + 8, set to the bias (B) or zero: the MMAs then
// accumulate onto them (scale-d 1).
template <int L, int W, bool B>
__device__ __forceinline__ void fm_d_init(float (&d)[W / 2], int c0, int t, const float *bias) {
#pragma unroll
    for (int j = 0; j < W / 8; ++j) {
        const int col = c0 + 8 * j + 2 * t;
        const float b0 = B ? bias[Layer<L>::B_OFF + col] : 0.0f, b1 = B ? bias[Layer<L>::B_OFF + col + 1] : 0.0f;
        d[4 * j] = d[4 * j + 2] = b0;
        d[4 * j + 1] = d[4 * j + 3] = b1;
    }
}

// A layer's k steps over its input fragments a into d (W columns from descriptor desc), issued after a's registers are
// fenced; D_SET: d holds this thread's starting values (the bias, or zeros), else the first step's scale-d is 0.
// S0, SN: only k steps S0 .. S0 + SN - 1, their weights at desc (a streamed K piece).
template <int W, int KS, int S0 = 0, int SN = KS>
__device__ __forceinline__ void fm_mma_issue(float (&d)[W / 2], fm_u32 (&a)[KS][4], unsigned long long desc,
                                             bool d_set) {
    fm_fence_regs(a);
    fm_wg_fence();
#pragma unroll
    for (int s = 0; s < SN; ++s)  // k step s: two core matrices (32 bytes of k) further along each row group
        fm_wgmma<W>::run(d, a[S0 + s], desc + (unsigned long long)(s * 2 * 128 / 16), s > 0 || d_set ? 1 : 0);
}
// Commits the issued k steps and waits for them, d and a pinned around the wait.
template <int ND, int KS> __device__ __forceinline__ void fm_mma_wait(float (&d)[ND], fm_u32 (&a)[KS][4]) {
    fm_wg_commit();
    fm_fence_regs(d);
    fm_wg_wait();
    fm_fence_regs(d);
    fm_fence_regs(a);
}

// Four 8x8 matrices of 16-bit values to shared memory, one row address per lane (the inverse of ldmatrix.x4): an A
// fragment's registers in its order.
__device__ __forceinline__ void fm_stmatrix_x4(fm_u32 addr, const fm_u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

// ------------------------------------------------------------------------------------------------ clusters, mbarriers
//
// Used by the streamed weights (fm_stream.cuh, next) and the cluster exchange (fm_shared_a.cuh, below).

#include "fm_cluster.cuh"

#include "fm_stream.cuh"

// ------------------------------------------------------------------------------------------------ the layers

// A streamed group's MMAs over its input fragments a into d (W columns) from chunk J's K piece P on: chunk J (CH
// columns, the group's columns J CH.., accumulators d[J CH / 2..]), k steps P KP.. (KP per piece) from its slot,
// waited for, then released (fill Q of the tile sequence), then the chunk's next piece, then the next chunk.
template <int W, int CH, int KS, int KP, int J, int P, int Q>
__device__ __forceinline__ void fm_stream_group(float (&d)[W / 2], fm_u32 (&a)[KS][4], fm_stream &st, bool d_set,
                                                int lane) {
    constexpr int CW = W - J * CH < CH ? W - J * CH : CH;
    constexpr int S0 = P * KP, SN = KS - S0 < KP ? KS - S0 : KP;  // this piece's k steps
    constexpr fm_u32 SBO = SN * 32 * 8;                            // its rows of SN k steps, 8 rows per core matrix
    float(&dj)[CW / 2] = *reinterpret_cast<float(*)[CW / 2]>(d + J * CH / 2);
    fm_mma_issue<CW, KS, S0, SN>(dj, a, fm_desc(fm_stream_acquire(st), SBO), d_set || P > 0);
    fm_mma_wait(dj, a);
    fm_stream_release<Q>(st, lane);
    if constexpr (S0 + SN < KS)
        fm_stream_group<W, CH, KS, KP, J, P + 1, Q + 1>(d, a, st, d_set, lane);
    else if constexpr ((J + 1) * CH < W)
        fm_stream_group<W, CH, KS, KP, J + 1, 0, Q + 1>(d, a, st, d_set, lane);
}

// Where the last layer's results go. 16-bit y: the warp's output stage, which fm_store_output then copies to y in
// 16-byte pieces. float32 y: y itself, each lane's two columns as one 8-byte store (four lanes fill a 32-byte sector
// of a row), so no stage: a float32 stage row is twice a 16-bit x row, and with it res128 (float32 x and y) fitted
// one warpgroup per CTA.
constexpr bool OUT_DIRECT = FM_OUT_TYPE == 0;
// The cluster kernel's last layer split over the CTAs like the hidden layers (plan.c: wider than 16 columns), each
// CTA computing and storing its share of y's columns; else CTA 0 computes it whole.
constexpr bool SPLIT_LAST = FM_CLUSTER > 1 && Layer<LAST>::NC < Layer<LAST>::N;
// out_t elements per stage row: the columns this CTA computes in the last layer (a cluster plan's n_chunk), and a
// 16-byte pad (plan.c, fm_stage_row_bytes).
constexpr int STAGE_W = (FM_CLUSTER > 0 ? Layer<LAST>::NC : OUT_PAD) + 16 / (int)sizeof(out_t);
struct fm_out {
    fm_u32 stage;    // staged: this lane's byte address in the warp's stage at (row g, col 0)
    out_t *y;        // direct: y
    long long row;   // direct: this lane's row g of the warp's strip
    int rows;        // direct: the strip's rows from row g on that are in y (<= 0: none)
    fm_u32 wide;     // this lane's ldmatrix / stmatrix row address in chunk 0 of the warp's wide buffer (below)
    fm_u32 wide_st;  // FM_SPLIT: this lane's word of a 16-column group's first matrix in that buffer (fm_split_copy)
};

// The warp's wide buffer (streamed weights, plan.c: fm_plan.wide_out): where a layer wider than 256 in or out puts its
// 16 rows of output, 16 columns at a time (one stmatrix of the A fragment the epilogue packed), for the next layer to
// load as its A fragments (fm_wide_reload): with that layer's input fragments and accumulators they would not fit the
// registers (a 512 -> 512 layer: 128 + 128 + 64). 8-column chunk c at 256 c, row r at 16 r in it: each 8-lane phase
// of an ldmatrix / stmatrix touches 128 contiguous bytes. It shares its bytes with the output stage: the last layer's
// input is in registers before its epilogue writes the stage.
template <int L> __device__ constexpr int fm_wide_n() {
    if constexpr (L >= LAST)
        return 0;
    else
        return Layer<L>::WIDE && Layer<L>::N > fm_wide_n<L + 1>() ? Layer<L>::N : fm_wide_n<L + 1>();
}
constexpr int WIDE_B = 16 * fm_wide_n<0>() * EB;
enum : fm_u32 { WIDE_STEP = 2 * 16 * 16 };  // bytes from one 16-column group (two chunks) to the next

// FM_SPLIT: the A fragment hq of a split layer's 16-column group s (stored into this CTA's wide buffer by stmatrix)
// into the same place of the wide buffers of the cluster's other CTAs, whose warp of the same strip reads it next.
// hq[m] is matrix m of the stmatrix: rows 8 (m & 1).., chunk m >> 1 of the group; this lane's word of it is row
// lane / 4, bytes 4 (lane % 4) (wide_st).
__device__ __forceinline__ void fm_split_copy(const fm_u32 (&hq)[4], fm_u32 at, fm_u32 rank) {
#pragma unroll
    for (int r = 1; r < SPLIT_N; ++r) {
        const fm_u32 peer = (rank + (fm_u32)r) % (fm_u32)SPLIT_N;
#pragma unroll
        for (int m = 0; m < 4; ++m)
            asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(fm_mapa(at + (m >> 1) * 256 + (m & 1) * 128, peer)),
                         "r"(hq[m])
                         : "memory");
    }
}
// The split layers' hand-over (FM_SPLIT): every CTA's columns are in every wide buffer once all CTAs arrived after
// their copies (release) and this one waited (acquire); a CTA's next copies wait until all have read the buffer.
// Each thread alternates arrive and wait: one arrival at the start, then per split layer a wait before its copies,
// an arrival and a wait after them, an arrival once the next layer's fragments are loaded; a wait at the end.
__device__ __forceinline__ void fm_split_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void fm_split_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The last layer's result at (row g + 8 hh, cols col, col + 1) of this warp's strip, from the accumulators v0, v1
// (and the residual operand r0, r1), into the warp's output stage at column scol (zeros where the tile is padding:
// live false), or into y (its real columns only).
template <int L>
__device__ __forceinline__ void fm_stage_pair(const fm_out &out, int hh, int col, int scol, bool live, float v0,
                                              float v1, float r0, float r1) {
    if constexpr (OUT_DIRECT) {
        if (!live || 8 * hh >= out.rows)
            return;
        fm_epilogue<L>(v0, v1, r0, r1, col);
        out_t *const p = out.y + (out.row + 8 * hh) * OUT_REAL + col;  // out_t is float here
        if constexpr (OUT_REAL % 2 == 0) {  // col is even: an 8-byte aligned pair
            if (col < OUT_REAL)
                asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(v0), "f"(v1) : "memory");
        } else {
            if (col < OUT_REAL)
                p[0] = (out_t)v0;
            if (col + 1 < OUT_REAL)
                p[1] = (out_t)v1;
        }
    } else {
        const fm_u32 addr = out.stage + 8 * hh * STAGE_W * (int)sizeof(out_t) + scol * (int)sizeof(out_t);
        fm_st_shared(addr, live ? fm_epilogue16<L, FM_OUT_TYPE>(v0, v1, r0, r1, col) : 0u);
    }
}

// Whether any of layers 0..L adds a residual.
template <int L> __device__ constexpr bool fm_has_residual() {
    if constexpr (L < 0)
        return false;
    else
        return Layer<L>::RES != 0 || fm_has_residual<L - 1>();
}

// The value layer L's residual reads: L - Layer<L>::RES_FROM (L - 1 its own input; -1 the network input x); -2 none.
template <int L> __device__ constexpr int fm_res_src() { return Layer<L>::RES != 0 ? L - Layer<L>::RES_FROM : -2; }
// The value kept in registers entering layer L for a later layer's residual (fm_network's ka): the value v <= L - 1
// that a layer J >= L with v <= J - 2 reads; -2 none (plan_sm90.c's fm_plan_kept_at: one at a time).
template <int L, int J = L> __device__ constexpr int fm_kept_at() {
    if constexpr (J > LAST) {
        return -2;
    } else {
        constexpr int v = fm_res_src<J>();
        return v != -2 && v <= L - 1 && v <= J - 2 ? v : fm_kept_at<L, J + 1>();
    }
}
// Whether layer L's residual reads a value from further back than its own input (kept in registers: ka).
template <int L> __device__ constexpr bool fm_res_kept() { return Layer<L>::RES != 0 && Layer<L>::RES_FROM > 1; }
// Whether any layer's residual does (the layers then run unrolled: fm_loop_len).
template <int L = 0> __device__ constexpr bool fm_keeps_values() {
    if constexpr (L > LAST)
        return false;
    else
        return fm_res_kept<L>() || fm_keeps_values<L + 1>();
}
// Layer L's residual operand's fragments: its own input a, or the value kept since (ka).
template <int L, int KA, int KK>
__device__ __forceinline__ decltype(auto) fm_res_operand(const fm_u32 (&a)[KA][4], const fm_u32 (&ka)[KK][4]) {
    if constexpr (fm_res_kept<L>()) {
        static_assert(fm_kept_at<L>() == fm_res_src<L>() && KK * KE == Layer<L>::N, "the kept value, as wide as the "
                                                                                     "layer's output");
        return ka;
    } else {
        return a;
    }
}

#if FM_PREC >= 3
// float8, a residual from the layer's own input (its k32 A fragments a): the values at (row g + 8 hh, cols 8 j + 2 t,
// + 1), codes times the input's scale RSCALE. Where the input was packed by fm_epi_codes (KPERM), that pair is the
// lane's own: half j % 2 of register 2 ((j % 4) / 2) + hh of fragment j / 4. Layer 0's input (x, in column order)
// has it in lane 2 (j % 2) + t / 2 of the quad, half t % 2: all lanes shuffle the same register, each from its own
// source lane.
template <int L, int KF>
__device__ __forceinline__ void fm_res_codes(const fm_u32 (&a)[KF][4], int j, int hh, int lane, float &r0,
                                             float &r1) {
    const int t = lane & 3;
    const fm_u32 r = a[j / 4][2 * ((j % 4) / 2) + hh];
    if constexpr (Layer<L>::KPERM)
        fm_code2_to_f((unsigned short)(r >> ((j % 2) * 16)), r0, r1);
    else
        fm_code2_to_f((unsigned short)(__shfl_sync(0xffffffffu, r, (lane & ~3) | (2 * (j % 2) + (t >> 1))) >>
                                       ((t & 1) * 16)), r0, r1);
    r0 *= Layer<L>::RSCALE;
    r1 *= Layer<L>::RSCALE;
}
#endif

// The epilogue of layer L's 8-column tile J for this lane (v: its accumulators, (row g, cols 8 J + 2 t, + 1) at v[0],
// v[1] and row g + 8's at v[2], v[3]): the bias where it is not in the accumulators (ADD_BIAS), activation, the
// residual (a: its operand's fragments, fm_res_operand), into hq, the next layer's A fragment J / 2 (its half J % 2,
// or HALF where J is known at run time only: fm_wide_layer), or for the last layer into the output stage.
template <int L, bool ADD_BIAS, int HALF = -1, int RK>
__device__ __forceinline__ void fm_epi_tile(const float *v, int J, const fm_u32 (&a)[RK][4], fm_u32 (&hq)[4],
                                            const float *bias, const fm_out &stage, int t) {
    typedef Layer<L> Ly;
    const int col = 8 * J + 2 * t;  // this lane's columns col, col + 1 in rows g and g + 8
    float b0 = 0.0f, b1 = 0.0f;
    if constexpr (ADD_BIAS) {
        b0 = bias[Ly::B_OFF + col];
        b1 = bias[Ly::B_OFF + col + 1];
    }
    const bool live = Ly::NR == Ly::N || 8 * J < Ly::NR;  // compile-time: a padding tile writes zeros
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float v0 = v[2 * hh], v1 = v[2 * hh + 1], r0 = 0.0f, r1 = 0.0f;
        if constexpr (ADD_BIAS) {
            v0 += b0;
            v1 += b1;
        }
        if constexpr (Ly::RES != 0) {  // the own input at the same (row, col): fragment J/2, half J%2
#if FM_PREC >= 3
            fm_res_codes<L>(a, J, hh, (int)(threadIdx.x & 31), r0, r1);  // k32 fragments of codes
#else
            fm_unpack2(a[J / 2][(J % 2) * 2 + hh], r0, r1);
#endif
        }
        if constexpr (L == LAST)
            fm_stage_pair<L>(stage, hh, col, col, live, v0, v1, r0, r1);
        else
            hq[(HALF >= 0 ? HALF : J % 2) * 2 + hh] =
                live ? fm_epilogue16<L, FM_PREC + 1>(v0, v1, r0, r1, col) : 0u;
    }
}

#if FM_PREC >= 3
// 8-bit: the accumulators of columns c0 + 8 j + 2 t (+1) (d[4 j + 2 hh], rows g + 8 hh) become W h + b: times the
// column's act_scale * w_scale (Ly::DQ_OFF in the float blob), plus its bias, as fused_mlp.cu's fm_dequant. int8's s32
// sums started at FM_MAGIC's bits (fm_layer_cols): |sum| <= 127^2 K < 2^22 for K <= 256, so the bits are the float
// FM_MAGIC + sum, and one exact FADD leaves the sum.
template <int L, int W>
__device__ __forceinline__ void fm_dequant_d(float (&d)[W / 2], int c0, int t, const float *bias) {
    typedef Layer<L> Ly;
#pragma unroll
    for (int j = 0; j < W / 8; ++j) {
        const int col = c0 + 8 * j + 2 * t;
        const float q0 = bias[Ly::DQ_OFF + col], q1 = bias[Ly::DQ_OFF + col + 1];
        const float b0 = Ly::BIAS ? bias[Ly::B_OFF + col] : 0.0f, b1 = Ly::BIAS ? bias[Ly::B_OFF + col + 1] : 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            d[4 * j + i] = fmaf(FM_PREC == 3 ? __fsub_rn(d[4 * j + i], FM_MAGIC) : d[4 * j + i], i & 1 ? q1 : q0,
                                i & 1 ? b1 : b0);
    }
}

// float8: hidden layer L's epilogue (activation, residual from its input a, mask) over all its columns, stored as the
// next layer's A fragments of codes (times QOUT, the next input's inverse scale; with QFOLD the accumulators already
// are, and relu is the rounding's). A k32 A register of lane (g, t) holds row g + 8 (q % 2), four consecutive k
// positions 32 s + 16 (q / 2) + 4 t .. + 3 (the PTX ISA's wgmma / mma m16n8k32 8-bit A layout); a lane's accumulators
// are columns 8 j + 2 t, + 1 of each 8-column tile j. The lane packs its own: register q takes the pairs of tiles
// 4 s + 2 (q / 2) and + 1, and the next layer's weights are in that K order (fm_plan.k_perm): no shuffles.
template <int L>
__device__ __forceinline__ void fm_epi_codes(float (&d)[Layer<L>::N / 2], const fm_u32 (&a)[Layer<L>::K / KE][4],
                                             fm_u32 (&h)[Layer<L>::N / KE][4], int lane) {
    typedef Layer<L> Ly;
    static_assert(Ly::N % 32 == 0, "8-bit widths are padded to whole k32 steps (plan.c)");
    static_assert(Layer<L + 1>::KPERM, "the next layer's weights take the packed order (fm_plan.k_perm)");
    const int t = lane & 3;
    fm_u32 pairs[Ly::N / 8][2];  // tile j, row g + 8 hh: the codes of columns 8 j + 2 t, + 1 (low 16 bits)
#pragma unroll
    for (int j = 0; j < Ly::N / 8; ++j) {
        const int col = 8 * j + 2 * t;
        const bool live = Ly::NR == Ly::N || 8 * j < Ly::NR;  // compile-time: a padding tile holds zeros
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float v0 = d[4 * j + 2 * hh], v1 = d[4 * j + 2 * hh + 1], r0 = 0.0f, r1 = 0.0f;
            if constexpr (Ly::QFOLD != 0) {
                if constexpr (Ly::NR < Ly::N) {  // padded columns: 0, whatever the accumulators hold
                    if (col >= Ly::NR) v0 = 0.0f;
                    if (col + 1 >= Ly::NR) v1 = 0.0f;
                }
                pairs[j][hh] = !live ? 0u : Ly::QFOLD == 2 ? (fm_u32)fm_quant2_relu(v0, v1) : (fm_u32)fm_quant2(v0, v1);
            } else {
                if constexpr (Ly::RES != 0)
                    fm_res_codes<L>(a, j, hh, lane, r0, r1);
                if (live)
                    fm_epilogue<L>(v0, v1, r0, r1, col);
                pairs[j][hh] = live ? (fm_u32)fm_quant2(v0 * Ly::QOUT, v1 * Ly::QOUT) : 0u;
            }
        }
    }
#pragma unroll
    for (int s = 0; s < Ly::N / 32; ++s)
#pragma unroll
        for (int q = 0; q < 4; ++q)
            h[s][q] = pairs[4 * s + 2 * (q >> 1)][q & 1] | (pairs[4 * s + 2 * (q >> 1) + 1][q & 1] << 16);
}
#endif

// Columns [C0, C0 + W) of layer L for this warpgroup's 64 rows, W = min(NC, N - C0): one wgmma group over the whole
// input, then the epilogue into the output fragments (h: the next layer's A, one [4] per 16 columns) or, for the last
// layer, into the warp's output stage; then the next group. A layer is one group unless a forced n_chunk splits it
// (NC < N). In the source each group is waited for and its epilogue run before the next starts, but ptxas issues the
// next group's MMAs before the previous group's epilogue (the register fences are empty asm it does not see), so the
// groups' accumulators are live together and a split saves no registers (docs/performance.md). a: the layer's input
// fragments; r: its residual operand's (fm_res_operand); w: the layer's first weight byte (shared window); stage:
// where the last layer's results go (fm_out).
template <int L, int C0, int RK>
__device__ __forceinline__ void fm_layer_cols(fm_u32 (&a)[Layer<L>::K / KE][4], const fm_u32 (&r)[RK][4],
                                              fm_u32 (&h)[Layer<L>::N / KE][4], fm_u32 w, const float *bias,
                                              const fm_out &stage, int lane, fm_stream &st) {
    typedef Layer<L> Ly;
    constexpr int W = Ly::N - C0 < Ly::NC ? Ly::N - C0 : Ly::NC;
    static_assert(W % 16 == 0 && C0 % 16 == 0, "whole 16-column groups");
    constexpr int KS = Ly::K / KE;               // k steps (32 bytes each)
    constexpr fm_u32 SBO = Ly::K * EB * 8;       // bytes from one 8-row group of weights to the next
    // The accumulators start at the bias (then every k step accumulates): no FADDs in the epilogue, and the bias
    // values' registers are the accumulators (flex's 128 bytes of spills went). Not in networks with residuals:
    // there ptxas hoists the next layer's bias loads while the input fragments are still live (res128 at 12 warps
    // went from 159 registers to 168 and 228 bytes of spills).
    // A norm layer has its bias in the accumulators in any network: its statistics are over W h + b.
    // float8: accumulators start at zero and fm_dequant_d adds the bias with the scales.
    constexpr bool BIAS_IN_D = FM_PREC < 3 && Ly::BIAS && (Ly::NORM != 0 || !fm_has_residual<LAST>());
    // A group of a split layer always starts from accumulators this thread wrote (the bias, or zeros): with scale-d
    // 0 on the first k step (the instruction ignores the accumulators' old values), the second group of a split
    // layer came out wrong on the H100 (NVRTC 13, results/h100/wgmma_split_diag.txt: every split layer without a bias
    // in the accumulators, every group after the first reusing the first's registers).
    // int8: its s32 sums start at FM_MAGIC's bits (fm_dequant_d).
    // float8 with streamed weights: a layer's chunks of columns read from several slots start from zeros this thread
    // wrote, as the groups of a split layer do.
    constexpr bool D_SET = BIAS_IN_D || W < Ly::N || FM_PREC == 3 || (FM_PREC == 4 && FM_STREAM > 0);
    const int t = lane & 3;
    float d[W / 2];  // this lane's (row g + 8 hh, cols C0 + 8 j + 2 t, + 1) at d[4 j + 2 hh], d[4 j + 2 hh + 1]
#if FM_PREC == 3
#pragma unroll
    for (int i = 0; i < W / 2; ++i)
        d[i] = FM_MAGIC;
#else
    if constexpr (D_SET)
        fm_d_init<L, W, BIAS_IN_D>(d, C0, t, bias);
#endif
    // the group's W weight rows: resident, or streamed through slots, each holding CH of them (a norm layer's group
    // is the whole row and may take several: it runs them one after another, each slot released as soon as its MMAs
    // are done, so that a warpgroup holds one slot at a time and the other warpgroup is not held back)
    if constexpr (FM_STREAM > 0) {
        constexpr int CH = fm_chunk_cols<L>();
        fm_stream_group<W, CH, KS, Ly::KC / KE, 0, 0, fm_group0<L>() + C0 / CH * fm_kpieces<L>()>(d, a, st, D_SET,
                                                                                                  lane);
    } else {
        fm_mma_issue<W, KS>(d, a, fm_desc(w + (C0 / 8) * SBO, SBO), D_SET);
        fm_mma_wait(d, a);
    }
#if FM_PREC >= 3
    fm_dequant_d<L, W>(d, C0, t, bias);
#endif
    static_assert(Ly::NORM == 0 || W == Ly::N, "a norm layer is one column group (plan.c)");
    fm_norm_tiles<L, W / 8>(d, C0, t, bias);

#if FM_PREC >= 3
    if constexpr (L != LAST) {  // the next layer's k32 fragments of codes
        static_assert(C0 == 0 && W == Ly::N, "float8: a layer is one column group (plan.c)");
        fm_epi_codes<L>(d, a, h, lane);
    } else
#endif
    if constexpr (Ly::WIDE) {  // 16 columns at a time into the warp's wide buffer (fm_wide_reload)
#pragma unroll
        for (int p = 0; p < W / 16; ++p) {
            fm_u32 hq[4];
            fm_epi_tile<L, Ly::BIAS && !BIAS_IN_D>(d + 8 * p, C0 / 8 + 2 * p, r, hq, bias, stage, t);
            fm_epi_tile<L, Ly::BIAS && !BIAS_IN_D>(d + 8 * p + 4, C0 / 8 + 2 * p + 1, r, hq, bias, stage, t);
            fm_stmatrix_x4(stage.wide + (fm_u32)(C0 / 16 + p) * WIDE_STEP, hq);
        }
    } else {
#pragma unroll
        for (int j = 0; j < W / 8; ++j)  // 8-column tile C0 / 8 + j of the output
            fm_epi_tile<L, FM_PREC < 3 && Ly::BIAS && !BIAS_IN_D>(
                d + 4 * j, C0 / 8 + j, r, h[L == LAST ? 0 : (C0 / 8 + j) / 2], bias, stage, t);  // (last: the stage)
    }
    if constexpr (C0 + W < Ly::N)
        fm_layer_cols<L, C0 + W>(a, r, h, w, bias, stage, lane, st);
}

// A looped group's K pieces P.. PE - 1 (KP k steps each; PE: to the last) into d (W columns), each from its slot,
// waited for and released as in fm_stream_group; q: the group's first fill in the tile sequence (run time), whose
// first piece is PF, so piece P is fill q + P - PF (PF > 0: a block's pieces, fm_blocks).
template <int W, int KS, int KP, int P, int PE = (KS + KP - 1) / KP, int PF = 0>
__device__ __forceinline__ void fm_stream_pieces(float (&d)[W / 2], fm_u32 (&a)[KS][4], fm_stream &st, int lane,
                                                 int q) {
    constexpr int S0 = P * KP, SN = KS - S0 < KP ? KS - S0 : KP;  // this piece's k steps
    constexpr fm_u32 SBO = SN * 32 * 8;                            // its rows of SN k steps, 8 rows per core matrix
    fm_mma_issue<W, KS, S0, SN>(d, a, fm_desc(fm_stream_acquire(st), SBO), true);
    fm_mma_wait(d, a);
    fm_stream_release_at(st, lane, q + P - PF);
    if constexpr (S0 + SN < KS && P + 1 < PE)
        fm_stream_pieces<W, KS, KP, P + 1, PE, PF>(d, a, st, lane, q);
}

// Block b's K pieces b KPB .. (b + 1) KPB - 1 of a looped group (fm_blocks: the other blocks' weights are zeros): the
// block's pieces named at compile time for each b (its k steps index the register fragments a).
template <int L, int W, int KS, int KPB, int BB = 0>
__device__ __forceinline__ void fm_block_pieces(int b, float (&d)[W / 2], fm_u32 (&a)[KS][4], fm_stream &st, int lane,
                                                int q) {
    constexpr int KP = Layer<L>::KC / KE;
    if (b == BB)
        fm_stream_pieces<W, KS, KP, BB * KPB, (BB + 1) * KPB, BB * KPB>(d, a, st, lane, q);
    else if constexpr (BB + 1 < fm_blocks<L>())
        fm_block_pieces<L, W, KS, KPB, BB + 1>(b, d, a, st, lane, q);
}

// A wide layer's whole column groups as a run-time loop (fm_wide_looped): group i's columns i NC.. from its K
// pieces' slots, its epilogue 16 columns at a time into the warp's wide buffer (the last layer: into the output
// stage), as fm_layer_cols does for each group unrolled (the same MMAs in the same order, the same epilogue: the same
// bits); then a last, narrower group (N not a multiple of NC) unrolled, its width known at compile time. The groups'
// bias reads, wide-buffer offsets and slot fills are at run time (fm_next_group names the refills). NVRTC is given
// one group's code instead of N / NC copies: wide512 (64-512x4-64 gelu) compiled in 2.2-2.7 s instead of 8.3-8.7
// (dev machine, NVRTC 13), 255 registers without the unrolled form's 44 bytes of spills; sdf512's two stretches in 4 s
// instead of 15.5 (docs/performance.md).
template <int L>
__device__ __forceinline__ void fm_wide_layer(fm_u32 (&a)[Layer<L>::K / KE][4], fm_u32 (&h)[Layer<L>::N / KE][4],
                                              fm_u32 w, const float *bias, const fm_out &stage, int lane,
                                              fm_stream &st) {
    typedef Layer<L> Ly;
    constexpr bool SPLIT = fm_split_layer<L>();
    constexpr int NC = Ly::NC, G = Ly::N / NC / (SPLIT ? FM_SPLIT : 1), KS = Ly::K / KE;
    static_assert(NC % 16 == 0 && G >= 1 && Ly::RES == 0 && Ly::NORM == 0, "whole 16-column groups, no residual");
    static_assert(!SPLIT || (G * NC * FM_SPLIT == Ly::N && L != LAST), "a split layer: whole groups in each CTA");
    constexpr bool BIAS_IN_D = FM_PREC < 3 && Ly::BIAS && (Ly::NORM != 0 || !fm_has_residual<LAST>());  // as there
    const int t = lane & 3;
    const int g0 = SPLIT ? (int)st.rank * G : 0;  // this CTA's first group
    if constexpr (SPLIT)
        fm_split_wait();  // every CTA has read the wide buffers' last values
    constexpr int B = fm_blocks<L>(), KPB = fm_kpieces<L>() / B;  // (B > 1: block b's groups, its pieces)
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll 1
    for (int gi = b * (G / B); gi < (b + 1) * (G / B); ++gi) {
        const int i = g0 + gi;
        float d[NC / 2];  // this lane's (row g + 8 hh, cols i NC + 8 j + 2 t, + 1), as in fm_layer_cols
        fm_d_init<L, NC, BIAS_IN_D>(d, i * NC, t, bias);  // (D_SET: a split layer's groups start from it)
        if constexpr (B == 1)
            fm_stream_pieces<NC, KS, Ly::KC / KE, 0>(d, a, st, lane, fm_group0<L>() + gi * fm_kpieces<L>());
        else
            fm_block_pieces<L, NC, KS, KPB>(b, d, a, st, lane, fm_group0<L>() + gi * KPB);
        if constexpr (L == LAST) {
#pragma unroll
            for (int j = 0; j < NC / 8; ++j)  // 8-column tile i NC / 8 + j of the output, into the stage
                fm_epi_tile<L, Ly::BIAS && !BIAS_IN_D>(d + 4 * j, i * (NC / 8) + j, a, h[0], bias, stage, t);
        } else {
#pragma unroll
            for (int p = 0; p < NC / 16; ++p) {  // 16-column group i NC / 16 + p of the output
                fm_u32 hq[4];
                const int j = i * (NC / 8) + 2 * p;
                fm_epi_tile<L, Ly::BIAS && !BIAS_IN_D, 0>(d + 8 * p, j, a, hq, bias, stage, t);
                fm_epi_tile<L, Ly::BIAS && !BIAS_IN_D, 1>(d + 8 * p + 4, j + 1, a, hq, bias, stage, t);
                fm_stmatrix_x4(stage.wide + (fm_u32)(i * (NC / 16) + p) * WIDE_STEP, hq);
                if constexpr (SPLIT)
                    fm_split_copy(hq, stage.wide_st + (fm_u32)(i * (NC / 16) + p) * WIDE_STEP, st.rank);
            }
        }
    }
    if constexpr (SPLIT)
        fm_split_arrive();  // this CTA's columns are in every wide buffer (the wait: fm_wide_reload)
    if constexpr (!SPLIT && G * NC < Ly::N)
        fm_layer_cols<L, G * NC>(a, a, h, w, bias, stage, lane, st);  // (no residual: a stands for its operand)
}

// Layer L for this warpgroup's 64 rows (see fm_layer_cols; FM_WIDE_LOOP: fm_wide_layer); r: its residual operand's
// fragments (fm_res_operand).
template <int L, int RK>
__device__ __forceinline__ void fm_layer(fm_u32 (&a)[Layer<L>::K / KE][4], const fm_u32 (&r)[RK][4],
                                         fm_u32 (&h)[Layer<L>::N / KE][4], fm_u32 w, const float *bias,
                                         const fm_out &stage, int lane, fm_stream &st) {
    static_assert(Layer<L>::A1_BUF < 0 && (Layer<L>::RES == 0 || RK * KE == Layer<L>::N),
                  "a concat arrives as one array (fm_network); a residual's operand as wide as the output");
    static_assert(!fm_split_layer<L>() || fm_wide_looped<L>(), "a split layer is looped (plan.c)");
    if constexpr (fm_wide_looped<L>())
        fm_wide_layer<L>(a, h, w, bias, stage, lane, st);
    else
        fm_layer_cols<L, 0>(a, r, h, w, bias, stage, lane, st);
}

// How many layers from L on run as one loop (fm_network): the layers with layer L's code
// (Layer<L>::REPEAT, from render.c), but not the last layer, whose code differs (it writes the output stage); and
// only where the stretch's straight-line code would be long (its layers' columns, summed, >= 384). Short stretches
// stay unrolled: ptxas schedules one layer's tail under the next one's start, which a loop prevents (H100, 2^21
// rows: tcnn64's three 64-wide layers 3% slower looped, pinn50's four 56-wide 2%; tcnn128's three 128-wide even,
// res128's four 128-wide 0.7% faster, and its compile 1.9 -> 0.5 s).
template <int L> __device__ constexpr int fm_loop_len() {
    // float8: each layer has its own scales (QOUT) in its code; streamed weights: each group's refill names its
    // successor's place at compile time (fm_stream_release)
    // a value kept for a later residual (fm_network's ka): each layer's operand is its own
    if constexpr (L >= LAST || FM_PREC >= 3 || FM_STREAM > 0 || fm_keeps_values()) {
        return 1;
    } else {
        constexpr int r = L + Layer<L>::REPEAT - 1 < LAST ? Layer<L>::REPEAT : LAST - L;
        return r * Layer<L>::N >= 384 ? r : 1;
    }
}
// Whether layers L + 1 .. L + R - 1 have their weights and biases at layer L's plus a multiple of the same step.
template <int L, int R> __device__ constexpr bool fm_even_offsets() {
    if constexpr (R <= 2)
        return true;
    else
        return Layer<L + 2>::W_OFF - Layer<L + 1>::W_OFF == Layer<L + 1>::W_OFF - Layer<L>::W_OFF &&
               Layer<L + 2>::B_OFF - Layer<L + 1>::B_OFF == Layer<L + 1>::B_OFF - Layer<L>::B_OFF &&
               fm_even_offsets<L + 1, R - 1>();
}

// The width of the value layer L reads from the layer before (x for layer 0): its whole input but x's part, where
// x joins it (Layer<L>::CAT, an input concat: streamed weights only, plan.c).
template <int L> __device__ constexpr int fm_hk() {
    if constexpr (L == 0)
        return Layer<0>::K;
    else
        return Layer<L - 1>::N;
}

// Layer L's output as the next layer's A fragments h where it went to the wide buffer (Layer<L>::WIDE): one ldmatrix
// per 16 columns, in the rows stmatrix stored them. __syncwarp orders the warp's stores before the loads, and the
// loads before the buffer's next stores (the next wide layer's, or the output stage's).
// FM_SPLIT: a split layer's fragments once every CTA's columns have arrived, and an arrival once they are loaded; for
// the tile's last split layer that arrival comes once the tile's y is stored (the main loop): the output stage shares
// its bytes with the wide buffer, which the peers' next copies overwrite.
template <int L> __device__ __forceinline__ void fm_wide_reload(fm_u32 (&h)[Layer<L>::N / KE][4], const fm_out &out) {
    if constexpr (Layer<L>::WIDE) {
        if constexpr (fm_split_layer<L>())
            fm_split_wait();
        __syncwarp();
#pragma unroll
        for (int s = 0; s < Layer<L>::N / 16; ++s)
            fm_ldmatrix_x4(h[s], out.wide + (fm_u32)s * WIDE_STEP);
        __syncwarp();
        if constexpr (fm_split_layer<L>() && !fm_last_split<L>())
            fm_split_arrive();
    }
}

// Layers L.. for this warpgroup's 64 rows, from layer L's input fragments a (xa: x's, for a later input concat; ka:
// the value kept for a later layer's residual, fm_kept_at, where there is one). A stretch of layers with the same code
// (res128's four residual blocks, tcnn128's three hidden layers) is one loop over their weights and biases, not
// that code once per layer: NVRTC's time grows with the instructions it is given (res128: 1.2 s in NVVM and 0.7 s
// in ptxas for six straight-line layers).
template <int L, int KK>
__device__ __forceinline__ void fm_network_next(fm_u32 (&h)[Layer<L>::N / KE][4], const fm_u32 (&xa)[IN_PAD / KE][4],
                                                const fm_u32 (&ka)[KK][4], fm_u32 w_base, const float *bias,
                                                const fm_out &stage, int lane, fm_stream &st);
template <int L, int KK>
__device__ __forceinline__ void fm_network(fm_u32 (&a)[fm_hk<L>() / KE][4], const fm_u32 (&xa)[IN_PAD / KE][4],
                                           const fm_u32 (&ka)[KK][4], fm_u32 w_base, const float *bias,
                                           const fm_out &stage, int lane, fm_stream &st) {
    constexpr int R = fm_loop_len<L>();
    fm_u32 h[Layer<L>::N / KE][4];
    if constexpr (Layer<L>::CAT != 0) {  // x joins the input: its fragments before (CAT 2) or after (1) a's
        typedef Layer<L> Ly;
        constexpr int XS = IN_PAD / KE, HS = fm_hk<L>() / KE;
        static_assert(FM_STREAM > 0 && L > 0 && Ly::K == IN_PAD + fm_hk<L>() && Ly::RES == 0,
                      "an input concat: the streamed form, x and the previous layer's output, no residual");
        fm_u32 ac[Ly::K / KE][4];
#pragma unroll
        for (int s = 0; s < XS + HS; ++s)
#pragma unroll
            for (int q = 0; q < 4; ++q)
                ac[s][q] = Ly::CAT == 2 ? (s < XS ? xa[s][q] : a[s - XS][q]) : (s < HS ? a[s][q] : xa[s - HS][q]);
        fm_layer<L>(ac, ac, h, w_base + EB * Ly::W_OFF, bias, stage, lane, st);
        if constexpr (L < LAST) {
            fm_wide_reload<L>(h, stage);
            fm_network_next<L>(h, xa, ka, w_base, bias, stage, lane, st);
        }
    } else if constexpr (R > 1) {
        typedef Layer<L> Ly;
        static_assert(Ly::K == Ly::N && fm_even_offsets<L, R>(), "a loop's layers: as wide as their input, evenly "
                                                                  "spaced weights and biases");
        constexpr int W_STEP = Layer<L + 1>::W_OFF - Ly::W_OFF, B_STEP = Layer<L + 1>::B_OFF - Ly::B_OFF;
#pragma unroll 1
        for (int i = 0; i < R; ++i) {
            fm_layer<L>(a, a, h, w_base + EB * (Ly::W_OFF + i * W_STEP), bias + i * B_STEP, stage, lane, st);
#pragma unroll
            for (int s = 0; s < Ly::N / 16; ++s)
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    a[s][q] = h[s][q];
        }
        fm_network<L + R>(a, xa, ka, w_base, bias, stage, lane, st);  // the last layer, at least, follows the loop
    } else {
        fm_layer<L>(a, fm_res_operand<L>(a, ka), h, w_base + EB * Layer<L>::W_OFF, bias, stage, lane, st);
        if constexpr (L < LAST) {
            static_assert(Layer<L + 1>::CAT != 0 || Layer<L + 1>::K == Layer<L>::N,
                          "a layer's input is the previous layer's output");
            fm_wide_reload<L>(h, stage);
            fm_network_next<L>(h, xa, ka, w_base, bias, stage, lane, st);
        }
    }
}
// The layers after L from its output h: h is also the value kept from here on where a later residual reads it (its
// registers are then not written again: no layer writes its input's), else the kept value goes on as it was.
template <int L, int KK>
__device__ __forceinline__ void fm_network_next(fm_u32 (&h)[Layer<L>::N / KE][4], const fm_u32 (&xa)[IN_PAD / KE][4],
                                                const fm_u32 (&ka)[KK][4], fm_u32 w_base, const float *bias,
                                                const fm_out &stage, int lane, fm_stream &st) {
    if constexpr (fm_kept_at<L + 1>() == L)
        fm_network<L + 1>(h, xa, h, w_base, bias, stage, lane, st);
    else
        fm_network<L + 1>(h, xa, ka, w_base, bias, stage, lane, st);
}

// ------------------------------------------------------------------------------------------------ K-pipelined layers
//
// FM_KPIPE (plan.c, fm_plan_pipe): in fm_network a warpgroup's layer is MMAs, wait, epilogue, and only then the next
// layer's MMAs, so the warpgroup leaves the tensor pipe idle through each epilogue and the ALUs through each layer's
// MMAs; only other warpgroups on the SM fill those gaps. Here a layer with PIPE runs its epilogue 16 columns at a
// time, each 16 followed by the next layer's k step over them (the next layer's A fragment s is this layer's columns
// 16 s .. 16 s + 15): the next layer's MMAs run under this layer's activation. Both layers' accumulators are then live
// (plan.c's register estimate). A layer without PIPE (relu, the identity: one cvt per pair, nothing to hide) runs its
// whole epilogue, then all of the next layer's k steps. Networks without residuals (plan.c); every layer's
// accumulators start at its bias (without one, the first k step's scale-d is 0).

// Layer L's MMAs over its whole input a into d, waited for (the first layer's, before the pipeline starts).
template <int L>
__device__ __forceinline__ void fm_mma_all(float (&d)[Layer<L>::N / 2], fm_u32 (&a)[Layer<L>::K / KE][4], fm_u32 w,
                                           const float *bias, int t) {
    typedef Layer<L> Ly;
    constexpr fm_u32 SBO = Ly::K * EB * 8;
    if constexpr (Ly::BIAS)
        fm_d_init<L, Ly::N, true>(d, 0, t, bias);
    fm_mma_issue<Ly::N, Ly::K / KE>(d, a, fm_desc(w, SBO), Ly::BIAS);
    fm_mma_wait(d, a);
}

// Layer L's epilogue from its accumulators d into h (the next layer's input fragments; a: layer L's, unread without a
// residual) and layer L + 1's MMAs over h into dn, interleaved 16 columns at a time where Layer<L>::PIPE; then those
// MMAs waited for. w_next: layer L + 1's first weight byte.
template <int L>
__device__ __forceinline__ void fm_epi_mma(float (&d)[Layer<L>::N / 2], fm_u32 (&a)[Layer<L>::K / KE][4],
                                           fm_u32 (&h)[Layer<L>::N / KE][4], float (&dn)[Layer<L + 1>::N / 2],
                                           fm_u32 w_next, const float *bias, const fm_out &stage, int t) {
    typedef Layer<L + 1> Ln;
    static_assert(Ln::K == Layer<L>::N && Ln::NC == Ln::N && Layer<L>::RES == 0,
                  "unsplit layers without residuals, each the next one's input");
    constexpr bool PIPE = Layer<L>::PIPE;
    constexpr fm_u32 SBO = Ln::K * EB * 8;
    fm_norm_tiles<L, Layer<L>::N / 8>(d, 0, t, bias);  // all of d is here: the norm first, then the pipeline
    if constexpr (Ln::BIAS)
        fm_d_init<L + 1, Ln::N, true>(dn, 0, t, bias);
    const unsigned long long desc = fm_desc(w_next, SBO);
#pragma unroll
    for (int s = 0; s < Ln::K / KE; ++s) {
        fm_epi_tile<L, false>(d + 8 * s, 2 * s, a, h[s], bias, stage, t);
        fm_epi_tile<L, false>(d + 8 * s + 4, 2 * s + 1, a, h[s], bias, stage, t);
        if constexpr (PIPE) {
            fm_wg_fence();  // h[s] is written: the wgmma reads it
            fm_wgmma<Ln::N>::run(dn, h[s], desc + (unsigned long long)(s * 2 * 128 / 16), s > 0 || Ln::BIAS ? 1 : 0);
        }
    }
    if constexpr (!PIPE)
        fm_mma_issue<Ln::N, Ln::K / KE>(dn, h, desc, Ln::BIAS);
    fm_mma_wait(dn, h);
}

// Layers L.. for this warpgroup's 64 rows from layer L's accumulators d (waited) and input fragments a. Unrolled:
// plan.c pipelines no network with a stretch of layers fm_network would loop over (in a loop ptxas ran the pipelined
// MMAs one at a time, C7511 "insufficient register resources for the wgmma pipeline": the next pass's accumulators
// are this pass's, a copy it cannot rename).
template <int L>
__device__ __forceinline__ void fm_pnetwork(float (&d)[Layer<L>::N / 2], fm_u32 (&a)[Layer<L>::K / KE][4],
                                            fm_u32 w_base, const float *bias, const fm_out &stage, int t) {
    typedef Layer<L> Ly;
    fm_u32 h[Ly::N / KE][4];
    if constexpr (L == LAST) {
        fm_norm_tiles<L, Ly::N / 8>(d, 0, t, bias);
#pragma unroll
        for (int j = 0; j < Ly::N / 8; ++j)
            fm_epi_tile<L, false>(d + 4 * j, j, a, h[0], bias, stage, t);  // the last layer: into the stage
    } else {
        float dn[Layer<L + 1>::N / 2];
        fm_epi_mma<L>(d, a, h, dn, w_base + EB * Layer<L + 1>::W_OFF, bias, stage, t);
        fm_pnetwork<L + 1>(dn, h, w_base, bias, stage, t);
    }
}

#include "fm_shared_a.cuh"

// The network for one tile, in the kernel's form (a template, so only that form's code is instantiated).
template <int C>
__device__ __forceinline__ void fm_run_network(fm_u32 (&a)[IN_PAD / KE][4], fm_u32 w_base, const float *bias,
                                               const fm_out &stage, int lane, fm_cl_state &cl, fm_stream &st) {
#if FM_PREC < 3  // float8 has no cluster form (plan.c), and its fragments are not the cluster kernel's
    if constexpr (C > 0) {
        fm_cl_network<0>(a, w_base, bias, stage, cl);
    } else
#endif
    if constexpr (FM_KPIPE) {
        float d[Layer<0>::N / 2];
        fm_mma_all<0>(d, a, w_base + EB * Layer<0>::W_OFF, bias, lane & 3);
        fm_pnetwork<0>(d, a, w_base, bias, stage, lane & 3);
    } else {
        fm_network<0>(a, a, a, w_base, bias, stage, lane, st);  // (x is the value kept if a residual reads it later)
    }
}

// ------------------------------------------------------------------------------------------------ input

// Per warp: the input buffer (ROWS_W rows of ROW_B: x as act_t, padding columns zero), the output stage (ROWS_W rows
// of STAGE_W out_t; none for float32 y, fm_out), which is also the wide buffer (WIDE_B), and, unless x's rows land in
// the input buffer verbatim (IN_DIRECT), a raw buffer holding the warp's 16 rows of x as they are in global memory
// (contiguous: a strip of x is one run of bytes). FM_IN_SHARED: the input buffer is the stage's and wide buffer's
// bytes, so its padding columns are zeroed again for each tile, and x lands in it only once the tile's y is stored.
constexpr bool IN_DIRECT = IN_RAW && (IN_REAL * EB) % 16 == 0 && X_PARTS == 1;
constexpr int RAW_B = IN_DIRECT ? 0 : (ROWS_W * IN_REAL * (int)sizeof(in_t) + 15) / 16 * 16;
constexpr int BUF_B = ROWS_W * ROW_B;
constexpr int STAGE_B = OUT_DIRECT ? 0 : ROWS_W * STAGE_W * (int)sizeof(out_t);
constexpr int SHARE_B = STAGE_B > WIDE_B ? STAGE_B : WIDE_B;  // the stage, and the wide buffer (fm_out)
constexpr int OUT_AT = FM_IN_SHARED ? 0 : BUF_B;              // the stage's offset in a warp's bytes
constexpr int RAW_AT = OUT_AT + (FM_IN_SHARED && BUF_B > SHARE_B ? BUF_B : SHARE_B);
constexpr int WARP_B = RAW_AT + RAW_B;
constexpr bool X_AFTER_Y = FM_IN_SHARED && IN_DIRECT;  // the next tile's x lands in the input buffer after y's store
// X_AFTER_Y: only x's rows [0, X_LATE) wait for y's store: those that share bytes with the stage or the wide buffer
// (the first SHARE_B bytes). Rows past them no layer writes, so the next tile's land there under this tile's layers,
// as in a buffer of their own (rec1024's 512 -> 256 -> 1 tail: a 256-wide buffer of 16 rows is 8 KB of x's 16.6).
constexpr int X_LATE = !X_AFTER_Y ? 0 : (SHARE_B + ROW_B - 1) / ROW_B < ROWS_W ? (SHARE_B + ROW_B - 1) / ROW_B
                                                                               : ROWS_W;
static_assert(W_SMEM_ELEMS * EB + B_FLOATS * 4 + FM_WARPS * WARP_B +
                      (FM_CLUSTER > 0 ? WGS * (ABUF_B + 16 + NSTAT_B) : 0) + STREAM_BAR_B == SMEM_BYTES,
              "the layout below is the plan's (plan.c: fm_plan_wgmma_layout, _stage_bytes, _raw_bytes)");

__device__ __forceinline__ void fm_copy16_async(fm_u32 dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
// The 16 bytes at dst: the first n elements of src (in_t), then zeros; synchronous. For the piece that straddles the
// end of x, where a cp.async would name bytes past it (its src-size form zero-fills them, but still names them, and
// compute-sanitizer reports that as an out-of-bounds read).
__device__ __forceinline__ void fm_copy16_tail(fm_u32 dst, const in_t *src, int n) {
    fm_u32 w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        if constexpr (sizeof(in_t) == 4) {
            w[k] = k < n ? __float_as_uint(src[k]) : 0u;
        } else {
            const fm_u32 lo = 2 * k < n ? (fm_u32)src[2 * k] : 0u, hi = 2 * k + 1 < n ? (fm_u32)src[2 * k + 1] : 0u;
            w[k] = lo | (hi << 16);
        }
    }
    fm_st_shared(dst, w[0], w[1]);
    fm_st_shared(dst + 8, w[2], w[3]);
}

// Starts this warp's copy of x rows [r0 + R0, r0 + R1) into its input buffer (IN_DIRECT: each row's 16-byte pieces
// to its padded row) or raw buffer (the strip's bytes: all 16 rows), as one cp.async group, so that it lands while the
// warp computes the tile before. What lies past the end of x is written as zeros.
template <int R0 = 0, int R1 = ROWS_W>
__device__ __forceinline__ void fm_prefetch_x(fm_u32 in_buf, fm_u32 raw, const in_t *__restrict__ x, long long r0,
                                              long long rows, int lane) {
    static_assert(0 <= R0 && R0 < R1 && R1 <= ROWS_W && (IN_DIRECT || (R0 == 0 && R1 == ROWS_W)),
                  "a range of rows: only where they land in the input buffer directly");
    if constexpr (IN_DIRECT) {
        // 16-byte pieces per row; 1 where this branch is discarded, which NVRTC still compiles (a zero here was its
        // warnings #39-D and #179-D, division by zero)
        constexpr int PIECES = IN_DIRECT ? IN_REAL * EB / 16 : 1;
#pragma unroll
        for (int i = lane; i < (R1 - R0) * PIECES; i += 32) {
            const int row = R0 + i / PIECES, c = i % PIECES;
            const fm_u32 dst = in_buf + row * ROW_B + 16 * c;
            if (r0 + row < rows) {
                fm_copy16_async(dst, x + (r0 + row) * IN_REAL + c * (16 / EB));
            } else {
                fm_st_shared(dst, 0u, 0u);
                fm_st_shared(dst + 8, 0u, 0u);
            }
        }
    } else {
        constexpr int E16 = 16 / (int)sizeof(in_t);  // elements per 16-byte piece
        const long long first = r0 * IN_REAL, end = rows * IN_REAL;  // elements of x (a strip starts 16-byte aligned)
#pragma unroll
        for (int i = lane; i < RAW_B / 16; i += 32) {
            const long long at = first + (long long)E16 * i;
            if (end - at >= E16)
                fm_copy16_async(raw + 16 * i, x + at);
            else
                fm_copy16_tail(raw + 16 * i, x + at, end > at ? (int)(end - at) : 0);
        }
    }
    fm_copy_commit();
}

// ------------------------------------------------------------------------------------------------ the network

// Row tiles go to clusters (all CTAs of one run the same tiles), else to CTAs.
#if FM_CLUSTER > 1 || FM_SPLIT > 1
#define FM_TILE0 ((long long)fm_cluster_id())
#define FM_TILE_STEP ((long long)fm_cluster_count())
#else
#define FM_TILE0 blockIdx.x
#define FM_TILE_STEP gridDim.x
#endif

extern "C" __global__ void __launch_bounds__(THREADS, FM_BLOCKS_PER_SM) {{CLUSTER_DIMS}}
{{KERNEL_NAME}}(const in_t *__restrict__ x,       // rows x IN_REAL, row-major, 16-byte aligned
                out_t *__restrict__ y,            // rows x OUT_REAL, row-major, 16-byte aligned
                const act_t *__restrict__ w,      // packed weights: W_OFF/K/N of each Layer<l>, core-matrix layout
                                                  // (FM_CLUSTER: one W_SMEM_ELEMS share per CTA of a cluster)
                const float *__restrict__ bias,   // packed biases: B_OFF/N of each Layer<l>
                long long rows)                   // batch size, >= 1
{
    // Shared memory: [weights (FM_STREAM: its slots) | biases | per warp: input buffer, output stage, raw x (WARP_B
    // bytes) | FM_CLUSTER: per warpgroup, its A buffer (ABUF_B) | its two mbarriers | CL_NORM: per warpgroup, its norm
    // slots (NSTAT_B) | FM_STREAM: the slots' mbarriers and counters (STREAM_BAR_B)].
    extern __shared__ __attribute__((aligned(128))) unsigned char fm_smem_raw[];
    act_t *s_w = (act_t *)fm_smem_raw;
    float *s_bias = (float *)(s_w + W_SMEM_ELEMS);
    unsigned char *s_warps = (unsigned char *)(s_bias + B_FLOATS);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wg = warp >> 2, wq = warp & 3;  // warpgroup, and this warp's quarter (rows 16 * wq..) of its 64 rows
    act_t *in_buf = (act_t *)(s_warps + warp * WARP_B);
    act_t *out_buf = (act_t *)(s_warps + warp * WARP_B + OUT_AT);
    const in_t *raw = (const in_t *)(s_warps + warp * WARP_B + RAW_AT);
    const fm_u32 in_addr = fm_smem_addr(in_buf), out_addr = fm_smem_addr(out_buf);
    const fm_u32 raw_addr = in_addr + RAW_AT;

    // The shared-memory-A form: which CTA of its cluster this is, and the warpgroup's buffer and barriers.
    fm_cl_state cl;
    const fm_u32 rank = FM_CLUSTER > 1 || FM_SPLIT > 1 ? fm_cluster_rank() : 0u;  // (FM_SPLIT: fm_stream.rank)
    if constexpr (FM_CLUSTER > 0) {
        const fm_u32 abufs = fm_smem_addr(s_warps + FM_WARPS * WARP_B);
        cl.abuf = abufs + wg * ABUF_B;
        cl.full = abufs + WGS * ABUF_B + 16 * wg;
        cl.empty = cl.full + 8;
        cl.rank = rank;
        cl.parity = 0u;
        cl.st_lane = cl.abuf + (lane >> 4) * CHUNK_B + (16 * wq + (lane & 7) + ((lane >> 3) & 1) * 8) * 16;
        cl.stats = abufs + WGS * (ABUF_B + 16) + wg * NSTAT_B;
        cl.nround = 0u;
        cl.wg = wg;
        cl.lane = lane;
        if (FM_CLUSTER > 1 && (threadIdx.x & 127) == 0) {
            fm_mbar_init(cl.full, 1);
            fm_mbar_init(cl.empty, CL - 1);
            if constexpr (CL_NORM) {
                fm_mbar_init(cl.stats + 2 * CL * NSTAT_SLOT_B, 1);
                fm_mbar_init(cl.stats + 2 * CL * NSTAT_SLOT_B + 8, 1);
            }
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
    }

    // The streamed weights' barriers, and the first FM_STREAM groups on their way (after the barrier below, which
    // orders the initialisation before any warp's wait).
    const long long tiles = (rows + ROWS_CTA - 1) / ROWS_CTA;
    fm_stream st;
    if constexpr (FM_STREAM > 0) {
        st.slots = fm_smem_addr(s_w);
        st.bars = fm_smem_addr(s_warps + FM_WARPS * WARP_B);
        st.seq = 0u;
        const long long t0 = FM_TILE0, step = FM_TILE_STEP;
        const long long mine = tiles > t0 ? (tiles - 1 - t0) / step + 1 : 0;
        st.total = (fm_u32)(mine * STREAM_Q);
        st.w = (const unsigned char *)w;
        st.rank = rank;
        if (threadIdx.x == 0) {
            for (int i = 0; i < FM_STREAM; ++i) {
                fm_mbar_init(st.bars + 8 * i, 1);
                fm_st_shared(st.bars + 8 * FM_STREAM + 4 * i, 0u);
            }
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
    }
    for (int i = threadIdx.x; i < B_FLOATS; i += THREADS)
        s_bias[i] = bias[i];
    // FM_CLUSTER: this CTA's share; a last layer not split has its weights (at the end of a share) only in CTA 0.
    // FM_STREAM: none (the slots fill as the groups run).
    fm_copy_block(s_w, w + (FM_CLUSTER > 0 ? (size_t)rank * W_SMEM_ELEMS : 0),
                  FM_STREAM > 0 ? 0
                  : FM_CLUSTER > 0 && !SPLIT_LAST && rank != 0 ? (int)Layer<LAST>::W_OFF : W_SMEM_ELEMS);
    fm_copy_commit();
    // The input buffer's padding columns stay zero: only x's columns are ever written into it (FM_IN_SHARED: until
    // the first tile's layers write the wide buffer; zeroed again for each tile after).
    for (int i = lane; i < BUF_B / 16; i += 32)
        *(fm_v4 *)((unsigned char *)in_buf + 16 * i) = fm_v4{0u, 0u, 0u, 0u};
    __syncwarp();
    const int strip = wg * 64 + wq * ROWS_W;  // this warp's first row in a tile
    fm_grid_wait();  // (fm_common.cuh) the kernel before this one on the stream is done: x may be read, y written
    if ((long long)FM_TILE0 < tiles)
        fm_prefetch_x(in_addr, raw_addr, x, FM_TILE0 * (long long)ROWS_CTA + strip, rows, lane);
    fm_copy_wait<1>();  // the weights (the older group)
    // The weights were written through the generic proxy; wgmma reads them through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if constexpr (FM_CLUSTER > 1)
        fm_cluster_sync();  // also: every CTA's barriers are initialised before any other CTA signals them
    else
        __syncthreads();
    if constexpr (FM_STREAM > 0) {
        if (threadIdx.x == 0)
            for (fm_u32 i = 0; i < NSLOT && i < st.total; ++i)
                fm_stream_fill(1u, st, i, fm_group_at<0>((int)(i % STREAM_Q), (int)rank));
    }
    if constexpr (FM_SPLIT > 1)
        fm_split_arrive();  // (fm_split_arrive: the hand-over's first arrival)

    const fm_u32 w_base = fm_smem_addr(s_w);
    const fm_u32 a_lane = in_addr + (lane & 15) * ROW_B + (lane >> 4) * 16;  // ldmatrix roles, as in fused_mlp.cu
    const fm_u32 stage_lane = out_addr + (lane >> 2) * STAGE_W * (int)sizeof(out_t);
    for (long long tile = FM_TILE0; tile < tiles; tile += FM_TILE_STEP) {
        if (tile + FM_TILE_STEP >= tiles)
            fm_grid_release();  // the CTA's last tile: the next kernel's CTAs may be scheduled (fm_common.cuh)
        const long long r0 = tile * ROWS_CTA + strip;
        const long long left = rows - r0;
        const int nrows = left <= 0 ? 0 : (left < ROWS_W ? (int)left : ROWS_W);
        fm_copy_wait<0>();  // this lane's part of the tile's x has landed
        __syncwarp();       // and every lane's
        if constexpr (!IN_DIRECT) {
            fm_load_input<FM_IN_SHARED>(in_buf, raw, 0, ROWS_W, lane);  // rows past x arrived as zeros
            __syncwarp();
        }
        fm_u32 a[IN_PAD / KE][4];  // ldmatrix's 16 x 32 bytes are a k16 (halves) or k32 (codes) A fragment
#pragma unroll
        for (int s = 0; s < IN_PAD / KE; ++s)
            fm_ldmatrix_x4(a[s], a_lane + s * 32);
        __syncwarp();  // every lane has its fragments before the next tile's x lands over them
        if (X_LATE < ROWS_W && tile + FM_TILE_STEP < tiles)  // (X_AFTER_Y: the rows no layer writes)
            fm_prefetch_x<X_LATE < ROWS_W ? X_LATE : 0>(in_addr, raw_addr, x, r0 + (long long)FM_TILE_STEP * ROWS_CTA,
                                                        rows, lane);
        // (FM_SPLIT: CTA 0 of the cluster stores y, the others compute the same last layer)
        const int live = FM_SPLIT > 1 && rank != 0 ? 0 : nrows;
        const fm_out out = {stage_lane, y, r0 + (lane >> 2), live - (lane >> 2),
                            out_addr + (fm_u32)((lane >> 4) * 256 + (lane & 15) * 16),
                            out_addr + (fm_u32)((lane >> 2) * 16 + (lane & 3) * 4)};
        fm_run_network<FM_CLUSTER>(a, w_base, s_bias, out, lane, cl, st);
        if constexpr (!OUT_DIRECT) {
            __syncwarp();
            if constexpr (SPLIT_LAST) {  // this CTA's columns of y (none past its real columns)
                constexpr int NCL = Layer<LAST>::NC;
                const int c0 = (int)rank * NCL;
                if (nrows > 0 && c0 + NCL <= OUT_REAL)
                    fm_store_output<NCL, STAGE_W>(y, out_buf, r0, nrows, c0, lane);
                else if (nrows > 0 && c0 < OUT_REAL)
                    fm_store_output<OUT_REAL % NCL, STAGE_W>(y, out_buf, r0, nrows, c0, lane);
            } else if (nrows > 0 && rank == 0) {
                fm_store_output<OUT_REAL, STAGE_W>(y, out_buf, r0, nrows, 0, lane);
            }
            __syncwarp();  // the stage is read before the next tile's last layer writes it
        }
        if constexpr (FM_SPLIT > 1)
            fm_split_arrive();  // the tile's last split layer's hand-over (fm_wide_reload): y is stored
        if constexpr (X_AFTER_Y) {
            __syncwarp();  // every lane's reads of the wide buffer and the stage are done
            if (tile + FM_TILE_STEP < tiles) {  // (X_LATE >= 1: the stage's rows)
                fm_zero_pad_columns<X_AFTER_Y ? X_LATE : ROWS_W>(in_buf, lane);
                fm_prefetch_x<0, X_AFTER_Y ? X_LATE : ROWS_W>(in_addr, raw_addr, x,
                                                              r0 + (long long)FM_TILE_STEP * ROWS_CTA, rows, lane);
            }
        }
    }
    if constexpr (FM_CLUSTER > 1) {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // this thread's last copies are done
        fm_cluster_sync();  // no CTA leaves while another may still signal its barriers
    }
    if constexpr (FM_SPLIT > 1)
        fm_split_wait();  // the hand-over's last wait: no CTA leaves while another may still copy into it
}
