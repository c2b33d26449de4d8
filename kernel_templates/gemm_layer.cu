// gemm_layer.cu - one layer of a network the fused kernels cannot hold on chip (a layer wider than they take, or a
// stretch whose weights fit no CTA or cluster), as a tiled Tensor Core GEMM whose epilogue is the layer's whole
// epilogue: y = post(act(x W^T + b) op r), converted to y's dtype in registers, then stored once (through shared
// memory in whole 32-byte sectors where y's rows allow: fm_epilogue_any). This is CUTLASS's residual-block epilogue
// Unary(Binary(Act(X.W + b), residual)) (NVIDIA/cutlass PR 391); there is no split-K, which the PR rules out where the
// activation is not the identity.
//
// Rendered by csrc/render.c from a GEMM plan (csrc/gemm.c); Layer<0> is the network's layer the plan names.
// Shape of the work:
// - A CTA computes a BM x BN tile of y; the grid is 1-D with the column tiles fastest, so the CTAs that read the same
//   rows of x run together and x's rows come from L2 after the first. (A persistent grid loading the next tile's first
//   stages under this tile's epilogue was measured and not kept: -4% to +1%, H100, docs/performance.md.)
// - K advances KT_B bytes per stage through FM_STAGES shared-memory stages filled by cp.async while earlier stages
//   compute (sm_80+; sm_75 copies synchronously).
// - Two ways to multiply, one per target (the plan's FM_WGMMA):
//   mma.sync (sm_75..sm_90): stages of 64 bytes of K in rows of 64 + 16 bytes (the 8 rows one ldmatrix reads then
//   fall in 8 different bank groups); each warp owns a (BM / WARPS_M) x (BN / WARPS_N) piece, fed by ldmatrix, as in
//   fused_mlp.cu.
//   wgmma (sm_90a): stages of 128 bytes of K in wgmma's K-major 128-byte-swizzle layout (a row's 16-byte chunks
//   permuted by the row's index mod 8, in atoms of 8 rows = 1024 bytes); each warpgroup owns 64 rows and all BN
//   columns, one m64nBNk16 per 16 of K with both operands from shared-memory descriptors, one wgmma group in flight
//   under the next stage's wait. (The no-swizzle layout of the fused kernels' weights, with both operands read from
//   shared memory, ran 1.5-2.4x slower than mma.sync here: H100, wide512 and rec1024 at 2^21 rows.)
// - Clusters of two (FM_GEMM_CLUSTER 2, wgmma only; the plan's gemm_cluster): the one-CTA form above reads a stage of
//   A (BM x 128 B) and B (BN x 128 B) per CTA, 48 KB for a 128 x 256 tile per ~1,024 cycles of MMA, about 11 TB/s
//   of L2 traffic over 132 SMs, twice what L2 delivers (docs/performance.md). So, as CUTLASS's sm90 kernels do, the
//   two CTAs of a cluster take adjacent row tiles of one column tile and share its B tile: the host lays B out as one
//   contiguous block per (column tile, K stage) in exactly the swizzled layout the descriptor reads (plan.c,
//   fm_plan_w_index), so each CTA's thread 0 copies half of a stage's B block to the same slot of both CTAs with one
//   cp.async.bulk ... multicast::cluster, and a CTA pair reads B once (32 KB a stage instead of 64). A stays as it
//   was (cp.async from every thread, or converted on the way), joining the same per-stage full mbarrier; a slot is
//   refilled once both CTAs' warps finished reading it (cluster-wide empty mbarriers). The protocol is at
//   fm_full_bar; all threads still both load and compute (no producer warp), FM_STAGES - 1 stages ahead. Not yet
//   timed on a GPU: gemm.c's FM_GEMM_CLUSTER_AUTO keeps the one-CTA form the default until it is.
// - The warp-specialised forms (FM_GEMM_WS): a producer warpgroup fills the stages, its thread 0 copying B's block with
//   one cp.async.bulk and, where every input part copies as it is, A's rows with one TMA copy of a tensor map
//   (FM_GEMM_TMA; else its 128 threads' cp.async); the persistent form may store y by TMA too (FM_GEMM_TMA_STORE).
// - The input is one part, or two for an input concat (NeRF's skip): part p is a row-major array of A<p>_REAL
//   elements a row, in its own dtype; its K range is padded to whole stages in the weights, so a stage reads one
//   part. A part already in the compute dtype with 16-byte rows is copied as it is; any other (float32 x of a float16
//   network, an odd width) is converted element by element on the way in.
// - 8-bit networks (FM_PREC 3 int8, 4 e4m3): the operands are codes, a stage's 128 (64) bytes of K are 128 (64)
//   elements, and each k step is a k32 MMA on the same 32 bytes as 16-bit's k16, so the shared-memory layouts, the
//   descriptors and ldmatrix are byte for byte the 16-bit ones. A value between segments is stored as the codes the
//   layer reading it multiplies (global dtype 3, its scale that layer's input scale); float32/16-bit parts (x, for
//   layer 0 or a concat) are quantised on the way in with the layer's QIN. The accumulators start at zero (int8's are
//   s32 bits) and the epilogue first makes them W h + b (times act_scale * w_scale[n], plus the bias), reads a
//   residual operand's codes times its scale, and stores the next layer's codes (times QOUT) or, for the network's
//   last layer, y. What it computes is csrc/ref.c's emulation, as the fused 8-bit kernels do.
// - Each warp owns a (BM / WARPS_M) x (BN / WARPS_N) piece of the tile: mma.sync fed by ldmatrix, as in fused_mlp.cu.
//
// Plan: {{PLAN_COMMENT}}

#define FM_WARPS {{WARPS}}
#define FM_WGMMA {{GEMM_WGMMA}}   // 1: warpgroup MMAs (sm_90a), 0: mma.sync
#define FM_STAGES {{STAGES}}
#define FM_GEMM_CLUSTER {{GEMM_CLUSTER}}  // 2: CTA pairs sharing each stage's weight tile (below), 1: a CTA a tile
#define FM_GEMM_WS {{GEMM_WS}}  // 1: warp-specialised, the last warpgroup loading the stages (below); 2: its consumers
                                // in turn; 3: as 1 on a persistent grid (each CTA every grid-th tile)
#define FM_GEMM_TMA {{GEMM_TMA}}  // 1: the producer loads A by tensor maps (one TMA copy a stage), 0: by cp.async
#define FM_GEMM_TMA_STORE {{GEMM_TMA_STORE}}  // 1: FM_GEMM_WS 3's staged slabs go to y by TMA stores (fm_stg_at)
#define FM_A1_TYPE {{A1_TYPE}}    // the concat's second part in global memory (-1: no concat), fm_dtype codes
#define FM_RES_TYPE {{RES_TYPE}}  // the residual operand in global memory (-1: no residual)
constexpr int ROWS_W = 16;        // (fm_common.cuh's input helper, which this kernel does not use, names it)
constexpr int BM = {{BM}}, BN = {{BN}}, WARPS_M = {{WARPS_M}};
constexpr int A0_REAL = {{A0_REAL}}, A1_REAL = {{A1_REAL}};  // real widths of the input's parts

#include "fm_common.cuh"
#include "fm_mma_sync.cuh"
#include "fm_wgmma.cuh"
#if FM_GEMM_CLUSTER > 1 || FM_GEMM_WS
#include "fm_cluster.cuh"
#endif

typedef Layer<0> Ly;
// FM_GEMM_WS 2, the consumers in turn (ping-pong): each consumer warpgroup a BM x BN tile of its own, every other tile
// of its CTA's, in two m64 MMAs a k step; a warp's rows 16 w.. and 64 + 16 w.. of it (w: its place in the warpgroup).
constexpr bool PP = FM_GEMM_WS == 2;
// FM_GEMM_WS 3, persistent (CUTLASS's cooperative persistent kernel): FM_GEMM_WS 1's tile and consumers, a CTA an SM
// taking tile blockIdx.x + j gridDim.x, the producer filling the stages tile after tile (fm_persist_produce), so that
// the next tile's first stages load while the consumers run this one's epilogue and store, and no CTA start or
// pipeline fill sits between two tiles. With FM_GEMM_CLUSTER 2 the cluster form's pairs: the two CTAs of a cluster take
// adjacent row tiles of one column tile, their producers each multicasting half of every stage's B tile into both.
constexpr bool PC = FM_GEMM_WS == 3;
constexpr int CWARPS = FM_WARPS - (FM_GEMM_WS ? 4 : 0);  // the warps that multiply (all but a producer warpgroup)
constexpr int WARPS_N = PP ? 1 : CWARPS / WARPS_M;
constexpr int TM = PP ? 32 : BM / WARPS_M, TN = BN / WARPS_N;  // a warp's piece of the tile (wgmma: 16 rows x BN)
constexpr int MT = TM / 16, NT = TN / 8;                       // its m16 and n8 mma tiles
constexpr int KT_B = FM_WGMMA ? 128 : 64;            // bytes of K per stage
constexpr int KT = KT_B / EB;                        // elements of K per stage
constexpr int CH = KT_B / 16;                        // 16-byte chunks of a row's K per stage
constexpr int SROW_B = FM_WGMMA ? KT_B : KT_B + 16;  // bytes per shared-memory row of a stage
constexpr int A_STAGE_B = BM * SROW_B, B_STAGE_B = BN * SROW_B, STAGE_B = A_STAGE_B + B_STAGE_B;
// mbarriers full[s], empty[s]; PP: then turn[0], turn[1] (fm_mainloop_pp)
constexpr int BAR_B = (FM_GEMM_CLUSTER > 1 || FM_GEMM_WS ? 16 * FM_STAGES : 0) + (FM_GEMM_WS == 2 ? 16 : 0);
static_assert(!FM_WGMMA || PP || (WARPS_M == CWARPS && BM == 64 * (CWARPS / 4) && FM_PREC != 2),
              "wgmma: each warpgroup 64 rows of all BN columns, 16- or 8-bit operands");
static_assert(!PP || (WARPS_M == 4 && CWARPS == 8 && BM == 128 && BN <= 128 && FM_PREC != 2),
              "in turn: two consumer warpgroups, each a 128-row tile of at most 128 columns");
static_assert(!FM_GEMM_WS || (FM_WGMMA && (FM_GEMM_CLUSTER == 1 || PC)),
              "warp specialisation: the wgmma form, on one CTA a tile but for PC");
static_assert(!FM_GEMM_TMA || FM_GEMM_WS, "A by tensor maps: a producer warpgroup's thread 0 issues the copies");
// The epilogue's staged output (fm_epilogue_any): a warp's TM rows of y in out_t, STG_COLS columns at a time (a slab),
// a row padded by 16 bytes. In the stages' bytes once the tile's MMAs are done (a slab is the warp's TN columns), or
// (PP and PC, whose producer is filling the stages meanwhile) in a buffer of each consumer warp's own after the stages
// and their mbarriers (from byte STG_AT): PP's its TN columns; PC's 128 bytes of a row (64 float16 columns: 2.3 KB a
// warp, so that four 48 KB stages still fit beside the eight warps' buffers).
// TS (FM_GEMM_TMA_STORE, PC only): each warp's slab goes to y as one TMA store of a tensor map of y (the kernel's
// last argument: boxes of TM rows by 128 bytes, 128-byte swizzle; the TMA unit clips rows past the batch), issued by
// lane 0 while the warp goes on to its next slab, so the slab's rows are unpadded and 128-byte swizzled (chunk c of
// row r at chunk c ^ (r % 8): a fragment store's 8 rows fall in 8 different bank groups, and the TMA reads it back in
// order), two buffers a warp in turn, 1024-byte aligned (the swizzle's atoms).
constexpr int OUT_B = (int)sizeof(out_t);
constexpr bool TS = FM_GEMM_TMA_STORE;
constexpr int STG_COLS = PC ? 128 / OUT_B : TN;
constexpr int STG_ROW_B = TS ? 128 : STG_COLS * OUT_B + 16, STG_SLAB_B = TM * STG_ROW_B;
constexpr int STG_WARP_B = STG_SLAB_B * (TS ? 2 : 1);
constexpr int STG_B = PC || (PP && OUT_B <= 2) ? CWARPS * STG_WARP_B : 0;  // (PP, float32 y: from the fragments)
static_assert(!PC || TN % STG_COLS == 0, "a persistent tile's columns in whole slabs");
static_assert(!TS || (PC && TM == 16 && STG_COLS * OUT_B == 128 && (TN / STG_COLS) % 2 == 0),
              "TMA stores: the persistent form's slabs of 16 rows by 128 bytes, an even count a tile");
static_assert(!FM_WGMMA || KT_B == 128, "the 128-byte swizzle: a stage's row of K is one swizzle row");
// Byte offset of (row r, byte b of K) in a stage's operand: padded rows, or the 128-byte swizzle (chunk b / 16 of row
// r at chunk (b / 16) ^ (r % 8); the 8 rows of an atom, whose chunk c then lie in 8 different bank groups).
__device__ __forceinline__ fm_u32 fm_sm_off(int r, int b) {
    if constexpr (FM_WGMMA)
        return (fm_u32)(r * 128 + ((((b >> 4) ^ (r & 7))) << 4) + (b & 15));
    else
        return (fm_u32)(r * SROW_B + b);
}
// The 16-byte chunk c of a stage's operand: row c / CH, chunk c % CH (consecutive threads: a row's chunks, contiguous
// in global memory and, padded or swizzled, in different bank groups).
__device__ __forceinline__ void fm_chunk(int c, int &r, int &q) {
    r = c / CH;
    q = c % CH;
}
// The shared-memory descriptor of a K-major 128-byte-swizzled operand at `addr` (1024-byte aligned atoms of 8 rows;
// a k step further is 32 bytes further): SBO 1024 bytes to the next 8 rows, LBO unused (1), layout type 1 (SW128).
__device__ __forceinline__ unsigned long long fm_desc_sw128(fm_u32 addr) {
    return (unsigned long long)((addr >> 4) & 0x3FFFu) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}
constexpr int KTILES = Ly::K / KT, K0TILES = Ly::K0 / KT;
static_assert((PP ? 2 : 1) * WARPS_M * WARPS_N == CWARPS && TM % 16 == 0 && TN % 16 == 0,
              "warp pieces are whole mma tiles");
// Row r of warp piece wm (wm = the warp's place in its warpgroup for PP) within its tile.
__device__ __forceinline__ int fm_tile_row(int wm, int r) {
    return PP ? (r >> 4) * 64 + wm * 16 + (r & 15) : wm * TM + r;
}
static_assert(Ly::K % KT == 0 && Ly::K0 % KT == 0 && Ly::N % BN == 0, "the plan pads K parts to stages, N to tiles");
constexpr int STG_AT = (FM_STAGES * STAGE_B + BAR_B + (TS ? 1023 : 0)) / (TS ? 1024 : 1) * (TS ? 1024 : 1);
static_assert((FM_WGMMA ? 1024 : 0) + STG_AT + STG_B == SMEM_BYTES,
              "the shared memory is the plan's (gemm.c)");
static_assert(FM_GEMM_CLUSTER == 1 || (FM_GEMM_CLUSTER == 2 && FM_WGMMA && BN % 16 == 0),
              "clusters of 2 in the wgmma form, each CTA copying whole swizzle atoms (8 rows) of the B tile");
static_assert((FM_A1_TYPE >= 0) == (Ly::K0 < Ly::K), "a second part exactly where the layer has a concat");

// 16 bytes global -> shared (a shared-window address); asynchronous on sm_80+.
__device__ __forceinline__ void fm_cp16(fm_u32 dst, const void *src) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
#else
    const fm_v4 v = *(const fm_v4 *)src;
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
#endif
}

// Floats i and i + 1 of the blob (i even; the blob's arrays start at multiples of 4 floats and run to N, a multiple of
// the tile: csrc/gemm.c) for an 8-bit epilogue's dequantisation: one 8-byte load instead of two 4-byte ones (its
// factors and bias took 512 LDG a thread a tile; 256 now, and 4096 -> 3664 instructions in all for rec1024's int8
// 1024 x 1024 GEMM), but in the form in turn, whose 168 registers the pairs spilled (12-16 bytes). (The 16-bit
// tiles' bias loads, once a tile, stay single: as pairs they spilled the persistent form's residual tiles.)
__device__ __forceinline__ fm_v2 fm_ld_pair(const float *__restrict__ blob, int i) {
    if constexpr (PP)
        return fm_v2{__float_as_uint(blob[i]), __float_as_uint(blob[i + 1])};
    else
        return *(const fm_v2 *)(blob + i);
}

// One global element of dtype T (fm_dtype codes) as a float (8-bit codes: the code's value, not yet times its scale).
template <int T> __device__ __forceinline__ float fm_ld_f(const void *p, long long i) {
    if constexpr (T == 0) {
        return ((const float *)p)[i];
    } else if constexpr (T == 3) {
#if FM_PREC >= 3
        float v, unused;
        fm_code2_to_f(((const unsigned char *)p)[i], v, unused);
        return v;
#else
        return 0.0f;  // (no 16-bit plan has codes: gemm.c)
#endif
    } else {
        return fm_16_to_f<T>(((const fm_half *)p)[i]);
    }
}

// The global dtype holding act_t as it is: float32 (tf32), float16, bfloat16, or an 8-bit network's codes.
constexpr int FM_ACT_TYPE = FM_PREC == 2 ? 0 : FM_PREC >= 3 ? 3 : FM_PREC + 1;

// Whether an input part (REAL elements a row, dtype T) is copied as it is: the compute dtype with 16-byte rows.
template <int T, int REAL> __device__ constexpr bool fm_a_raw() {
    return T == FM_ACT_TYPE && (REAL * EB) % 16 == 0;
}

// Columns [kcol, kcol + KT) of rows [row0, row0 + BM) of an input part (REAL elements a row, dtype T) into the stage's
// A rows at `dst` (shared-window bytes), zero past the batch and past the part's width; by threads tid of NTHR.
template <int T, int REAL, int NTHR = THREADS>
__device__ __forceinline__ void fm_load_a(fm_u32 dst, const void *__restrict__ src, long long row0, long long rows,
                                          int kcol, int tid = (int)threadIdx.x) {
    constexpr bool RAW = fm_a_raw<T, REAL>();
    if constexpr (RAW) {  // the compute dtype with 16-byte rows: cp.async, the hardware zero-filling what is outside
        constexpr int E16 = 16 / EB;
        for (int c = tid; c < BM * CH; c += NTHR) {
            int r, q;
            fm_chunk(c, r, q);
            const long long row = row0 + r;
            const int col = kcol + q * E16;
            const bool in = row < rows && col < REAL;
            const act_t *g = (const act_t *)src + (in ? row * REAL + col : 0);
#if __CUDA_ARCH__ >= 800
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst + fm_sm_off(r, q * 16)), "l"(g),
                         "r"(in ? 16 : 0));
#else
            fm_v4 v = in ? *(const fm_v4 *)g : fm_v4{0u, 0u, 0u, 0u};
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst + fm_sm_off(r, q * 16)), "r"(v.x),
                         "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#endif
        }
#if FM_PREC >= 3
    } else if constexpr (T != 3 && REAL % 8 == 0) {  // 8-bit, x: groups of 8 (16- or 32-byte loads, 8 codes stored)
        // (a count the compiler knows, unrolled: several groups' loads in flight, as the pairs below)
        constexpr int GROUPS = BM * (KT / 8), GITER = (GROUPS + NTHR - 1) / NTHR;
#pragma unroll 4
        for (int i = 0; i < GITER; ++i) {
            const int c = tid + i * NTHR;
            if (GROUPS % NTHR != 0 && c >= GROUPS)
                break;
            const int r = c / (KT / 8), k = (c % (KT / 8)) * 8;
            const long long row = row0 + r;
            const int col = kcol + k;
            float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            if (row < rows && col < REAL) {  // a whole group: REAL is a multiple of 8
                if constexpr (T == 0) {
                    const fm_v4 a = *(const fm_v4 *)((const float *)src + row * REAL + col);
                    const fm_v4 b = *(const fm_v4 *)((const float *)src + row * REAL + col + 4);
                    const fm_u32 u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                    for (int e = 0; e < 8; ++e)
                        v[e] = __uint_as_float(u[e]);
                } else {
                    const fm_v4 a = *(const fm_v4 *)((const fm_half *)src + row * REAL + col);
                    const fm_u32 u[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        v[2 * e] = fm_16_to_f<T>((fm_half)(u[e] & 0xffffu));
                        v[2 * e + 1] = fm_16_to_f<T>((fm_half)(u[e] >> 16));
                    }
                }
            }
            constexpr float Q = Ly::QIN;
            const fm_u32 lo = fm_quant4(v[0] * Q, v[1] * Q, v[2] * Q, v[3] * Q);
            const fm_u32 hi = fm_quant4(v[4] * Q, v[5] * Q, v[6] * Q, v[7] * Q);
            asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(dst + fm_sm_off(r, k)), "r"(lo), "r"(hi) : "memory");
        }
#endif
    } else {  // converted on the way: element pairs, a row's pairs over consecutive threads
        // A count of pairs a thread the compiler knows, unrolled by UNROLL: that many pairs' loads in flight before
        // the first is used (the loop of runtime count had four, each group waiting out a global load's latency);
        // more where one CTA an SM leaves the registers.
        constexpr int PAIRS = BM * (KT / 2), ITER = (PAIRS + NTHR - 1) / NTHR;
        constexpr int UNROLL = FM_BLOCKS_PER_SM > 1 ? 4 : 8;
#pragma unroll UNROLL
        for (int i = 0; i < ITER; ++i) {
            const int c = tid + i * NTHR;
            if (PAIRS % NTHR != 0 && c >= PAIRS)
                break;
            const int r = c / (KT / 2), k = (c % (KT / 2)) * 2;
            const long long row = row0 + r;
            const int col = kcol + k;
            float v0 = 0.0f, v1 = 0.0f;
            if (T != 3 && row < rows) {  // (codes: copied below)
                if (col < REAL)
                    v0 = fm_ld_f<T>(src, row * REAL + col);
                if (col + 1 < REAL)
                    v1 = fm_ld_f<T>(src, row * REAL + col + 1);
            }
            const fm_u32 at = dst + fm_sm_off(r, k * EB);
#if FM_PREC >= 3
            if constexpr (T == 3) {  // codes of a width that is not whole 16-byte rows: the bytes as they are
                unsigned short c2 = 0;
                if (row < rows && col < REAL)
                    c2 = ((const unsigned char *)src)[row * REAL + col];
                if (row < rows && col + 1 < REAL)
                    c2 |= (unsigned short)(((const unsigned char *)src)[row * REAL + col + 1] << 8);
                fm_st_code2(at, c2);
            } else {  // x: its codes with the layer's input scale (zeros stay zero codes)
                fm_st_code2(at, fm_quant2(v0 * Ly::QIN, v1 * Ly::QIN));
            }
#elif FM_PREC == 2
            fm_st_shared(at, fm_tf32(v0), fm_tf32(v1));
#else
            fm_st_shared(at, fm_pack2<FM_PREC + 1>(v0, v1));
#endif
        }
    }
}

// Stage `kt` of K (both operands) into shared-memory stage `s`.
__device__ __forceinline__ void fm_load_stage(fm_u32 smem, int s, int kt, const void *a0, const void *a1,
                                              const act_t *__restrict__ w, long long row0, long long rows, int n0) {
    const fm_u32 a_dst = smem + s * STAGE_B, b_dst = a_dst + A_STAGE_B;
#if FM_A1_TYPE >= 0
    if (kt >= K0TILES)
        fm_load_a<FM_A1_TYPE, A1_REAL>(a_dst, a1, row0, rows, (kt - K0TILES) * KT);
    else
#endif
        fm_load_a<FM_IN_TYPE, A0_REAL>(a_dst, a0, row0, rows, kt * KT);
    (void)a1;
    constexpr int E16 = 16 / EB;
    for (int c = threadIdx.x; c < BN * CH; c += THREADS) {  // weights: whole rows of N x K, never outside
        int r, q;
        fm_chunk(c, r, q);
        fm_cp16(b_dst + fm_sm_off(r, q * 16), w + (long long)(n0 + r) * Ly::K + kt * KT + q * E16);
    }
}

// Stages loaded ahead of the one computing. mma.sync: FM_STAGES - 1 (a stage is free once every warp passed the
// barrier after reading it). wgmma: FM_STAGES - 2, the load at step kt going to the stage step kt - 2 read, which every
// warpgroup's wgmma.wait_group 1 at step kt - 1 finished before the barrier at step kt.
constexpr int AHEAD = FM_WGMMA ? FM_STAGES - 2 : FM_STAGES - 1;
static_assert(AHEAD >= 1, "wgmma needs 3 or more stages, mma.sync 2");

// The first AHEAD stages of a tile, one cp.async group each (empty ones past K, so the counts stay the same).
__device__ __forceinline__ void fm_prefetch(fm_u32 smem, const void *x, const void *x1, const act_t *__restrict__ w,
                                            long long row0, long long rows, int n0) {
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
        if (s < KTILES)
            fm_load_stage(smem, s, s, x, x1, w, row0, rows, n0);
        fm_copy_commit();
    }
}

#if FM_WGMMA
// This warpgroup's MMAs on the stage at `stage` (its 64 rows of A at a_wg), left in flight while the stage before's
// are waited for (wgmma.wait_group 1): after it, that stage's slot may be refilled. d: the accumulators.
template <int W> __device__ __forceinline__ void fm_stage_wgmma(float (&d)[W], fm_u32 stage, fm_u32 a_wg) {
    const unsigned long long adesc = fm_desc_sw128(stage + a_wg), bdesc = fm_desc_sw128(stage + A_STAGE_B);
    fm_fence_regs(d);
    fm_wg_fence();
#pragma unroll
    for (int ks = 0; ks < CH / 2; ++ks)  // k16 steps: 32 bytes further along K each (2 in 16-byte units)
        fm_wgmma<BN>::run_ss(d, adesc + (unsigned long long)(ks * 2), bdesc + (unsigned long long)(ks * 2), 1);
    fm_wg_commit();
    fm_fence_regs(d);
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // the stage before's MMAs are done
    fm_fence_regs(d);
}
#endif

// acc += the tile's x rows [row0, row0 + BM) times weight rows [n0, n0 + BN), over all of K; its first AHEAD stages
// are loaded or in flight (fm_prefetch). Returns with every MMA done.
__device__ __forceinline__ void fm_mainloop(float (&acc)[MT][NT][4], fm_u32 smem, const void *x, const void *x1,
                                            const act_t *__restrict__ w, long long row0, long long rows, int n0,
                                            int warp, int lane) {
#if FM_WGMMA
    (void)lane;
    float (&d)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&acc[0][0][0]);  // wgmma's fragment is acc's, j-major
    const fm_u32 a_wg = (fm_u32)(warp >> 2) * 64 * 128;  // this warpgroup's 64 rows of the A stage
#pragma unroll 1
    for (int kt = 0; kt < KTILES; ++kt) {
        fm_copy_wait<AHEAD - 1>();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // this thread's stage writes, to wgmma's proxy
        __syncthreads();
        const int next = kt + AHEAD;
        if (next < KTILES)
            fm_load_stage(smem, next % FM_STAGES, next, x, x1, w, row0, rows, n0);
        fm_copy_commit();
        fm_stage_wgmma(d, smem + (kt % FM_STAGES) * STAGE_B, a_wg);
    }
    fm_wg_wait();
    fm_fence_regs(d);
#else
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;
    // ldmatrix lane roles as in fused_mlp.cu: A lane l gives row l % 16, bytes 16 * (l / 16); B lane l gives row
    // 8 * (l / 16) + l % 8, bytes 16 * (l / 8 % 2).
    const fm_u32 a_lane = (wm * TM + (lane & 15)) * SROW_B + (lane >> 4) * 16;
    const fm_u32 b_lane = A_STAGE_B + (wn * TN + (lane >> 4) * 8 + (lane & 7)) * SROW_B + ((lane >> 3) & 1) * 16;
#pragma unroll 1
    for (int kt = 0; kt < KTILES; ++kt) {
        fm_copy_wait<AHEAD - 1>();
        __syncthreads();  // stage kt landed for every thread, and every warp is done with stage kt - 1
        const int next = kt + AHEAD;
        if (next < KTILES)
            fm_load_stage(smem, next % FM_STAGES, next, x, x1, w, row0, rows, n0);
        fm_copy_commit();
        const fm_u32 stage = smem + (kt % FM_STAGES) * STAGE_B;
#pragma unroll
        for (int kk = 0; kk < KT_B; kk += 32) {
            fm_u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                fm_ldmatrix_x4(a[mt], stage + a_lane + mt * 16 * SROW_B + kk);
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {
                fm_u32 b[4];
                fm_ldmatrix_x4(b, stage + b_lane + nt * 8 * SROW_B + kk);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    fm_mma(acc[mt][nt], a[mt], b[0], b[1]);
                    fm_mma(acc[mt][nt + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }
#endif
}

#if FM_GEMM_CLUSTER > 1 || FM_GEMM_WS
__device__ __forceinline__ fm_u32 fm_full_bar(fm_u32 bars, int s) { return bars + 8 * s; }
__device__ __forceinline__ fm_u32 fm_empty_bar(fm_u32 bars, int s) { return bars + 8 * (FM_STAGES + s); }

#if FM_GEMM_TMA || FM_GEMM_TMA_STORE
// The driver's CUtensorMap, a kernel argument (csrc/module_launch.c, Kernel_args, encodes them for each launch).
struct __align__(64) fm_tmap {
    unsigned long long v[16];
};
#endif
#if FM_GEMM_TMA
// A by tensor maps (FM_GEMM_TMA): the kernel's arguments after res, the tensor maps of input part 0 and 1 (a copy of
// part 0's without a concat), each a row-major array of its rows x A<p>_REAL elements, boxes of BM rows by KT_B
// bytes of K in the 128-byte swizzle: one copy lands a stage's A rows exactly where fm_sm_off puts them (the stage's
// base is 1024-byte aligned), zeros past the batch and the part's width. So stage kt's A rows (BM rows from row0) go
// into the slot at a_dst as one TMA copy from thread 0, completing A_STAGE_B bytes of the slot's full barrier's
// transaction count.
__device__ __forceinline__ void fm_tma_stage_a(fm_u32 a_dst, fm_u32 full, int kt, const fm_tmap *ta0,
                                               const fm_tmap *ta1, long long row0) {
    const bool second = FM_A1_TYPE >= 0 && kt >= K0TILES;
    const int kcol = (second ? kt - K0TILES : kt) * KT;
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                 "[%4];" ::"r"(a_dst), "l"((unsigned long long)(second ? ta1 : ta0)), "r"(kcol), "r"((int)row0),
                 "r"(full)
                 : "memory");
}
#endif

// Stage kt's A rows into the slot at a_dst by threads tid of NTHR, then each thread's arrival on the slot's full
// barrier: once its copies have landed (cp.async), or at once after its converting stores (which the arrival releases).
template <int NTHR>
__device__ __forceinline__ void fm_stage_a(fm_u32 a_dst, fm_u32 full, int kt, const void *a0, const void *a1,
                                           long long row0, long long rows, int tid) {
    bool raw = fm_a_raw<FM_IN_TYPE, A0_REAL>();
#if FM_A1_TYPE >= 0
    if (kt >= K0TILES) {
        fm_load_a<FM_A1_TYPE, A1_REAL, NTHR>(a_dst, a1, row0, rows, (kt - K0TILES) * KT, tid);
        raw = fm_a_raw<FM_A1_TYPE, A1_REAL>();
    } else
#endif
        fm_load_a<FM_IN_TYPE, A0_REAL, NTHR>(a_dst, a0, row0, rows, kt * KT, tid);
    (void)a1;
    if (raw)
        fm_mbar_arrive_copies(full);
    else
        fm_mbar_arrive(full);
}

// fm_stage_wgmma on stage kt once its full barrier says it landed (the mbarrier forms); after it the slot of stage
// kt - 1 may be released.
template <int W>
__device__ __forceinline__ void fm_stage_mma(float (&d)[W], fm_u32 smem, fm_u32 bars, long long kt, fm_u32 a_wg) {
    const int s = (int)(kt % FM_STAGES);
    fm_mbar_wait(fm_full_bar(bars, s), (fm_u32)(kt / FM_STAGES) & 1u);
    // the A rows other threads stored (cp.async, st.shared: the generic proxy), to wgmma's async proxy (a TMA copy's
    // are the async proxy's already)
    if constexpr (!FM_GEMM_TMA)
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    fm_stage_wgmma(d, smem + s * STAGE_B, a_wg);
}
#endif

#if FM_GEMM_WS
// The warp-specialised form (FM_GEMM_WS; CUTLASS's sm90 kernels' shape): the last warpgroup only loads, the others
// only multiply and store. Per stage slot s the cluster form's two mbarriers:
// - full[s]: 128 + 1 arrivals: each producer thread's once its A copies of the stage landed (or at once after its
//   converting stores), and thread 0's announcing B's B_STAGE_B bytes, which its one bulk copy completes.
// - empty[s]: CWARPS arrivals, each consumer warp's lane 0 once the warp's MMAs on the slot are done
//   (wgmma.wait_group), after which the producer refills it.
// Stage kt uses use kt / FM_STAGES of its slot: phase parity (kt / FM_STAGES) & 1. The producer runs up to FM_STAGES
// stages ahead of the MMAs, which never wait for a copy issued by their own threads.
__device__ __forceinline__ void fm_ws_produce(fm_u32 smem, fm_u32 bars, const void *a0, const void *a1,
                                              const act_t *__restrict__ w, long long row0, long long rows, int ntile,
                                              int ptid, const void *ta0, const void *ta1) {
#pragma unroll 1
    for (int kt = 0; kt < KTILES; ++kt) {
        const int s = kt % FM_STAGES;
        const fm_u32 full = fm_full_bar(bars, s), a_dst = smem + s * STAGE_B;
        if (kt >= FM_STAGES)
            fm_mbar_wait(fm_empty_bar(bars, s), (fm_u32)(kt / FM_STAGES - 1) & 1u);
        if (ptid == 0) {  // B: the blob's block (column tile, K stage) is the stage's B_STAGE_B bytes (plan.c)
            fm_mbar_expect(1u, full, (fm_u32)(B_STAGE_B + (FM_GEMM_TMA ? A_STAGE_B : 0)));
            fm_bulk_g2s(a_dst + A_STAGE_B, (const char *)w + ((long long)ntile * KTILES + kt) * B_STAGE_B,
                        (fm_u32)B_STAGE_B, full);
#if FM_GEMM_TMA
            fm_tma_stage_a(a_dst, full, kt, (const fm_tmap *)ta0, (const fm_tmap *)ta1, row0);
#endif
        }
#if !FM_GEMM_TMA
        fm_stage_a<128>(a_dst, full, kt, a0, a1, row0, rows, ptid);
#endif
    }
    (void)ta0;
    (void)ta1;
    asm volatile("cp.async.wait_all;" ::: "memory");  // leave no copy of this thread in flight at exit
}

// A consumer warp is done reading slot s: its lane 0 arrives on the slot's empty barrier, in every CTA of the cluster
// (whose producers multicast into this CTA's slot too).
__device__ __forceinline__ void fm_ws_release(fm_u32 bars, int s, int lane) {
#if FM_GEMM_CLUSTER > 1
#pragma unroll
    for (fm_u32 peer = 0; peer < FM_GEMM_CLUSTER; ++peer)
        fm_mbar_arrive_cluster(lane == 0, fm_mapa(fm_empty_bar(bars, s), peer));
#else
    if (lane == 0)
        fm_mbar_arrive(fm_empty_bar(bars, s));
#endif
}

// fm_mainloop's warp-specialised consumer side, the tile's stages from the CTA's stage seq0 on (0 but in the persistent
// form): every stage waited for on its full barrier, its slot released once the next stage's MMAs are issued and its
// own are done, the last one's after the final wait (the persistent producer's next tile refills it). Returns with
// every MMA done.
__device__ __forceinline__ void fm_mainloop_ws(float (&acc)[MT][NT][4], fm_u32 smem, fm_u32 bars, long long seq0,
                                               int warp, int lane) {
    float (&d)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&acc[0][0][0]);
    const fm_u32 a_wg = (fm_u32)(warp >> 2) * 64 * 128;
#pragma unroll 1
    for (int kt = 0; kt < KTILES; ++kt) {
        fm_stage_mma(d, smem, bars, seq0 + kt, a_wg);
        if (kt > 0)
            fm_ws_release(bars, (int)((seq0 + kt - 1) % FM_STAGES), lane);
    }
    fm_wg_wait();
    fm_fence_regs(d);
    fm_ws_release(bars, (int)((seq0 + KTILES - 1) % FM_STAGES), lane);
}

#if FM_GEMM_WS >= 2
// The persistent forms (PP, PC). The CTA's tiles are tile blockIdx.x + j gridDim.x (j = 0, 1, ...), column tiles
// fastest. The producer fills the stages tile after tile, stage kt of tile j being the CTA's stage j KTILES + kt (slot
// seq % FM_STAGES, use seq / FM_STAGES). PC: both consumer warpgroups compute every tile, as FM_GEMM_WS 1's; empty[s]
// counts their CWARPS warps, each of which waits for every use of every slot.
// The consumers in turn (PP): consumer warpgroup j % 2 computes tile j; empty[s] counts the one consuming
// warpgroup's 4 warps. A warpgroup starts a tile's stages only once the other has waited for every stage of the tile
// before (turn[wg], which the other's 128 threads arrive on after their last full wait): an mbarrier's parity tells
// its phases apart only for a waiter at most one phase ahead, and the warpgroup waiting for use u of a slot has not
// itself waited for use u - 1 (the other's). So the two warpgroups' mainloops take turns, each one's epilogue and
// store running under the other's MMAs (CUTLASS's ping-pong kernel orders its math warpgroups the same way).
// The work of a persistent grid: items i = c, c + C, c + 2 C, ... for cluster c of C (a CTA its own cluster where
// FM_GEMM_CLUSTER is 1), item i being column tile i % NTILES of the FM_GEMM_CLUSTER row tiles from (i / NTILES)
// FM_GEMM_CLUSTER on, one a CTA by its rank (a CTA past the batch still loads its share of B and stores nothing).
__device__ __forceinline__ long long fm_persist_items(long long rows) {
    const long long row_tiles = (rows + BM - 1) / BM;
    return (row_tiles + FM_GEMM_CLUSTER - 1) / FM_GEMM_CLUSTER * (Ly::N / BN);
}
__device__ __forceinline__ long long fm_persist_first() { return blockIdx.x / FM_GEMM_CLUSTER; }
__device__ __forceinline__ long long fm_persist_step() { return gridDim.x / FM_GEMM_CLUSTER; }
// Item i's column tile and this CTA's row tile of it (rank: the CTA's in its cluster).
__device__ __forceinline__ void fm_persist_tile(long long i, fm_u32 rank, int &ntile, long long &row0) {
    ntile = (int)(i % (Ly::N / BN));
    row0 = (i / (Ly::N / BN) * FM_GEMM_CLUSTER + rank) * BM;
}

// The producer of a persistent form: every item's stages in turn, each slot refilled once its previous use is
// released (by the consumers of every CTA of the cluster: each reads the B half the other multicast). B: the blob's
// block (column tile, K stage), as fm_ws_produce, or with clusters half `rank` of it into the slot of both CTAs (the
// cluster form's protocol: fm_cl_produce).
__device__ __forceinline__ void fm_persist_produce(fm_u32 smem, fm_u32 bars, const void *a0, const void *a1,
                                                   const act_t *__restrict__ w, long long rows, fm_u32 rank,
                                                   int ptid, const void *ta0, const void *ta1) {
    // (TMA: thread 0 issues every copy, the other threads only follow the slots; returning them at once made ptxas
    // spill 4 bytes in the consumers of a 768 x 768 gelu layer)
    // B kept in the slots: where the CTA's column tile never changes (a grid of whole rows of column tiles: item i's
    // column tile is then blockIdx.x % NTILES) and each slot always holds the same K stage (KTILES divides the
    // stages), a slot's B block is copied on its first use only and the stages carry A alone after that. H100, 2^21
    // rows (docs/performance.md): float8 wide512's 512 x 512 layers in turn 1.72 -> 1.61 ms, its chain 7.44 -> 6.94;
    // rec1024's 256 -> 1024 layer (a grid rounded down to whole rows of its 8 column tiles) 2.59 either way, so no
    // grid is rounded for it.
    const bool keep_b = FM_GEMM_CLUSTER == 1 && FM_STAGES % KTILES == 0 && gridDim.x % (Ly::N / BN) == 0;
    long long seq = 0;
#pragma unroll 1
    for (long long i = fm_persist_first(); i < fm_persist_items(rows); i += fm_persist_step()) {
        int ntile;
        long long row0;
        fm_persist_tile(i, rank, ntile, row0);
#pragma unroll 1
        for (int kt = 0; kt < KTILES; ++kt, ++seq) {
            const int s = (int)(seq % FM_STAGES);
            const fm_u32 full = fm_full_bar(bars, s), a_dst = smem + s * STAGE_B;
            if (seq >= FM_STAGES)
                fm_mbar_wait(fm_empty_bar(bars, s), (fm_u32)(seq / FM_STAGES - 1) & 1u);
            if (ptid == 0) {
                const char *block = (const char *)w + ((long long)ntile * KTILES + kt) * B_STAGE_B;
                const bool copy_b = !keep_b || seq < FM_STAGES;
                fm_mbar_expect(1u, full, (fm_u32)((copy_b ? B_STAGE_B : 0) + (FM_GEMM_TMA ? A_STAGE_B : 0)));
#if FM_GEMM_CLUSTER > 1
                constexpr fm_u32 HALF_B = B_STAGE_B / 2;
                fm_bulk_multicast(a_dst + A_STAGE_B + rank * HALF_B, block + rank * HALF_B, HALF_B, full, 0x3);
#else
                if (copy_b)
                    fm_bulk_g2s(a_dst + A_STAGE_B, block, (fm_u32)B_STAGE_B, full);
#endif
#if FM_GEMM_TMA
                fm_tma_stage_a(a_dst, full, kt, (const fm_tmap *)ta0, (const fm_tmap *)ta1, row0);
#endif
            }
#if !FM_GEMM_TMA
            fm_stage_a<128>(a_dst, full, kt, a0, a1, row0, rows, ptid);
#endif
        }
    }
    (void)ta0;
    (void)ta1;
    asm volatile("cp.async.wait_all;" ::: "memory");  // leave no copy of this thread in flight at exit
}

#endif
#if FM_GEMM_WS == 2
// A consumer warpgroup's MMAs of one tile, its stages from the CTA's stage seq0 on: the tile's rows 0-63 and 64-127
// (acc[0] and acc[1], each an m64 MMA's fragment) on each stage, the stage before released once this one's MMAs are
// issued and that one's are done, the last released after the final wait. Returns with every MMA done.
__device__ __forceinline__ void fm_mainloop_pp(float (&acc)[MT][NT][4], fm_u32 smem, fm_u32 bars, long long seq0,
                                               fm_u32 next_turn, int lane) {
    float (&d0)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&acc[0][0][0]);
    float (&d1)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&acc[1][0][0]);
#pragma unroll 1
    for (int kt = 0; kt < KTILES; ++kt) {
        const long long seq = seq0 + kt;
        const int s = (int)(seq % FM_STAGES);
        fm_mbar_wait(fm_full_bar(bars, s), (fm_u32)(seq / FM_STAGES) & 1u);
        if constexpr (!FM_GEMM_TMA)
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // (as fm_stage_mma)
        const fm_u32 stage = smem + s * STAGE_B;
        const unsigned long long a0 = fm_desc_sw128(stage), a1 = fm_desc_sw128(stage + 64 * 128),
                                 b = fm_desc_sw128(stage + A_STAGE_B);
        fm_fence_regs(d0);
        fm_fence_regs(d1);
        fm_wg_fence();
#pragma unroll
        for (int ks = 0; ks < CH / 2; ++ks) {
            const unsigned long long k2 = (unsigned long long)(ks * 2);
            fm_wgmma<BN>::run_ss(d0, a0 + k2, b + k2, 1);
            fm_wgmma<BN>::run_ss(d1, a1 + k2, b + k2, 1);
        }
        fm_wg_commit();
        fm_fence_regs(d0);
        fm_fence_regs(d1);
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // the stage before's MMAs are done
        fm_fence_regs(d0);
        fm_fence_regs(d1);
        if (kt > 0 && lane == 0)
            fm_mbar_arrive(fm_empty_bar(bars, (int)((seq - 1) % FM_STAGES)));
    }
    fm_mbar_arrive(next_turn);  // every full wait of the tile is behind this thread: the other warpgroup's turn
    fm_wg_wait();
    fm_fence_regs(d0);
    fm_fence_regs(d1);
    if (lane == 0)
        fm_mbar_arrive(fm_empty_bar(bars, (int)((seq0 + KTILES - 1) % FM_STAGES)));
}
#endif
#endif

#if FM_GEMM_CLUSTER > 1
// The cluster form. Per stage slot s two mbarriers, after the stages:
// - full[s]: the slot holds stage kt (this CTA's A rows and the whole B tile). THREADS + 1 arrivals: every thread's
//   once its A copies of the stage have landed (cp.async.mbarrier.arrive.noinc; a part converted on the way is stored
//   by the thread and arrives at once, the arrival releasing its stores), and thread 0's announcing the B tile's
//   B_STAGE_B bytes, which the two CTAs' multicasts complete (complete_tx), half each. A's completion joins B's barrier
//   this way rather than a second wait: one wait a stage.
// - empty[s]: both CTAs' warps have finished reading the slot (their wgmma.wait_group), so either CTA may refill it,
//   in its own shared memory (A) and in both (its half of B). 2 x FM_WARPS arrivals: each warp's lane 0 arrives on
//   the barrier of both CTAs. Arrivals and waits are CTA-scoped, as fm_cluster.cuh says why; what they order is the
//   async proxy's reads (wgmma) and writes (the bulk copies).
// Stage kt uses use kt / FM_STAGES of its slot, so phase parity (kt / FM_STAGES) & 1. A CTA's multicast into its
// partner's slot waits for that slot's empty phase, which needs the partner's consumers past the slot's previous use,
// hence past its full phase: the bytes it completes always land in the phase they belong to. Any transaction count
// that lands before thread 0's announcement leaves the phase incomplete (its arrival is still pending).

// Stage kt into its slot once both CTAs are done with the slot's previous use: this CTA's A rows (every thread's
// chunks), and half `rank` of the B tile (thread 0, one bulk copy to the same slot of both CTAs). The blob holds
// block (column tile, K stage) as the B_STAGE_B bytes the stage reads (plan.c, fm_plan_w_index).
__device__ __forceinline__ void fm_cl_produce(fm_u32 smem, fm_u32 bars, int kt, const void *a0, const void *a1,
                                              const act_t *__restrict__ w, long long row0, long long rows, int ntile,
                                              fm_u32 rank) {
    const int s = kt % FM_STAGES;
    const fm_u32 full = fm_full_bar(bars, s), a_dst = smem + s * STAGE_B;
    if (kt >= FM_STAGES)
        fm_mbar_wait(fm_empty_bar(bars, s), (fm_u32)(kt / FM_STAGES - 1) & 1u);
    if (threadIdx.x == 0) {
        constexpr fm_u32 HALF_B = B_STAGE_B / 2;
        const char *block = (const char *)w + ((long long)ntile * KTILES + kt) * B_STAGE_B;
        fm_mbar_expect(1u, full, (fm_u32)B_STAGE_B);
        fm_bulk_multicast(a_dst + A_STAGE_B + rank * HALF_B, block + rank * HALF_B, HALF_B, full, 0x3);
    }
    fm_stage_a<THREADS>(a_dst, full, kt, a0, a1, row0, rows, (int)threadIdx.x);
}

// Both CTAs' warps are done reading stage kt's slot: each warp's lane 0 tells the slot's empty barrier in both.
__device__ __forceinline__ void fm_cl_release(fm_u32 bars, int kt, int lane) {
    const fm_u32 empty = fm_empty_bar(bars, kt % FM_STAGES);
#pragma unroll
    for (fm_u32 peer = 0; peer < FM_GEMM_CLUSTER; ++peer)
        fm_mbar_arrive_cluster(lane == 0, fm_mapa(empty, peer));
}

// fm_mainloop's cluster form: FM_STAGES - 1 stages in flight ahead of the one computing (a slot is refilled once
// both CTAs' MMAs of its previous stage are done, not behind a CTA-wide barrier). Returns with every MMA done.
__device__ __forceinline__ void fm_mainloop_cluster(float (&acc)[MT][NT][4], fm_u32 smem, fm_u32 bars, const void *x,
                                                    const void *x1, const act_t *__restrict__ w, long long row0,
                                                    long long rows, int ntile, fm_u32 rank, int warp, int lane) {
    float (&d)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&acc[0][0][0]);
    const fm_u32 a_wg = (fm_u32)(warp >> 2) * 64 * 128;
#pragma unroll 1
    for (int kt = 0; kt < FM_STAGES - 1 && kt < KTILES; ++kt)
        fm_cl_produce(smem, bars, kt, x, x1, w, row0, rows, ntile, rank);
#pragma unroll 1
    for (int kt = 0; kt < KTILES; ++kt) {
        fm_stage_mma(d, smem, bars, kt, a_wg);
        if (kt > 0)
            fm_cl_release(bars, kt - 1, lane);
        if (kt + FM_STAGES - 1 < KTILES)  // into the slot of stage kt - 1
            fm_cl_produce(smem, bars, kt + FM_STAGES - 1, x, x1, w, row0, rows, ntile, rank);
    }
    fm_wg_wait();
    fm_fence_regs(d);
}
#endif

// The epilogue's output through shared memory (STAGED, where y's rows and the warp's columns are whole 16-byte
// chunks): each warp's TM x TN piece of y, converted, a slab of STG_COLS columns at a time into a buffer of its own
// (STG_B above), then to y in 16-byte stores, a row's chunks by consecutive lanes, so every store fills whole 32-byte
// sectors. The fragments' own stores put 4 bytes of a pair (2 for codes) at 8 rows at once: half (a quarter) of each
// sector they touch, and 16 (32) times the store instructions. A staged row is padded by 16 bytes, so the 8 rows of
// one fragment store fall 4 banks apart. Not in the cluster form, whose partner may still multicast into its stages
// while it stores (but for PC's, whose buffers are its own).
constexpr bool STAGED = (FM_GEMM_CLUSTER == 1 || PC) && (Ly::NR * OUT_B) % 16 == 0 && (STG_COLS * OUT_B) % 16 == 0 &&
                        (PP || PC ? STG_B > 0 : CWARPS * STG_WARP_B <= FM_STAGES * STAGE_B);

// Two converted outputs (out_t's bits in `bits`, OUT_B * 2 bytes) of row `row`, column `col`: into y (not STG), or
// at byte `at` of the warp's staged piece (STG).
template <bool STG>
__device__ __forceinline__ void fm_put2(out_t *__restrict__ y, long long row, int col, unsigned long long bits,
                                        fm_u32 at) {
    constexpr bool PAIRS = Ly::NR % 2 == 0;  // y's element pairs are whole aligned words
    if constexpr (STG) {
        if constexpr (OUT_B == 4)
            fm_st_shared(at, (fm_u32)bits, (fm_u32)(bits >> 32));
        else if constexpr (OUT_B == 2)
            fm_st_shared(at, (fm_u32)bits);
        else
            asm volatile("st.shared.b16 [%0], %1;" ::"r"(at), "h"((unsigned short)bits) : "memory");
    } else {
        out_t *p = y + row * Ly::NR + col;
        if constexpr (PAIRS) {
            if constexpr (OUT_B == 4)
                *(fm_v2 *)p = fm_v2{(fm_u32)bits, (fm_u32)(bits >> 32)};
            else if constexpr (OUT_B == 2)
                *(fm_u32 *)p = (fm_u32)bits;
            else
                *(unsigned short *)p = (unsigned short)bits;
        } else {
            constexpr int SH = 8 * OUT_B;
            constexpr unsigned long long M = (1ull << SH) - 1ull;
            if constexpr (OUT_B == 4) {
                p[0] = __uint_as_float((fm_u32)bits);
                if (col + 1 < Ly::NR)
                    p[1] = __uint_as_float((fm_u32)(bits >> 32));
            } else {  // (fm_half and the codes' unsigned char are integer types)
                p[0] = (out_t)(bits & M);
                if (col + 1 < Ly::NR)
                    p[1] = (out_t)(bits >> SH);
            }
        }
    }
}

// Byte b of staged row r of the slab at `slab` (TS: the 128-byte swizzle, else padded rows).
__device__ __forceinline__ fm_u32 fm_stg_at(fm_u32 slab, int r, int b) {
    if constexpr (TS)
        return slab + (fm_u32)(r * 128 + ((((b >> 4) ^ (r & 7))) << 4) + (b & 15));
    else
        return slab + (fm_u32)(r * STG_ROW_B + b);
}

#if FM_GEMM_TMA_STORE
// The warp's staged slab at `slab` to y's rows [row, row + TM), columns [col, col + STG_COLS), by lane 0: one TMA
// store (its own bulk group) of the tensor map ty, after the warp's stores into the slab are made visible to the async
// proxy. fm_ts_reuse before the buffer is written again.
__device__ __forceinline__ void fm_ts_store(const void *ty, fm_u32 slab, int col, long long row, int lane) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0) {
        asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                         (unsigned long long)ty),
                     "r"(col), "r"((int)row), "r"(slab)
                     : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
}
// Before the warp writes a slab buffer again: lane 0 waits until at most `pending` of its stores have not yet read
// their slab (two buffers in turn: 1, the other buffer's).
template <int PENDING> __device__ __forceinline__ void fm_ts_reuse(int lane) {
    if (lane == 0)
        asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(PENDING) : "memory");
    __syncwarp();
}
#endif

// The layer's epilogue on the tile's accumulators and the one store of y (STG: through the warp's staged piece at
// shared byte `stg`, STAGED above, a slab of STG_COLS columns at a time; TS: to y by the tensor map ty).
template <bool STG>
__device__ __forceinline__ void fm_epilogue_store(const float (&acc)[MT][NT][4], out_t *__restrict__ y,
                                                  const void *__restrict__ res, const float *__restrict__ bias,
                                                  long long row0, long long rows, int n0, int wm, int wn, int g,
                                                  int t, fm_u32 stg, int lane, const void *ty = nullptr) {
    // c0, c1 at (row g, columns 2t, 2t + 1) of each m16n8 tile, c2, c3 at row g + 8 (wgmma's fragment too).
    constexpr int SLABS = STG ? TN / STG_COLS : 1, SNT = NT / SLABS;  // n8 tiles a slab
    (void)ty;
#pragma unroll
    for (int slab = 0; slab < SLABS; ++slab) {
#if FM_GEMM_TMA_STORE
        const fm_u32 at = stg + (fm_u32)((slab & 1) * STG_SLAB_B);  // (SLABS is even: the buffers alternate)
        if constexpr (STG)
            fm_ts_reuse<1>(lane);
#else
        const fm_u32 at = stg;
#endif
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const long long row = row0 + fm_tile_row(wm, mt * 16 + g + 8 * h);
                if (row >= rows)
                    continue;
#pragma unroll
                for (int nt = slab * SNT; nt < (slab + 1) * SNT; ++nt) {
                    const int col = n0 + wn * TN + nt * 8 + 2 * t;
                    if (col >= Ly::NR)
                        continue;
                    float v0 = acc[mt][nt][2 * h], v1 = acc[mt][nt][2 * h + 1], r0 = 0.0f, r1 = 0.0f;
#if FM_PREC >= 3  // W h + b: the sums times act_scale * w_scale[n], plus the bias (fm_dequant in fused_mlp.cu;
                      // the blob's factors and bias are zero from NR to N)
                    const fm_v2 dq = fm_ld_pair(bias, Ly::DQ_OFF + col);
                    const fm_v2 b = Ly::BIAS ? fm_ld_pair(bias, col) : fm_v2{0u, 0u};
                    v0 = fmaf(fm_acc_value(v0), __uint_as_float(dq.x), __uint_as_float(b.x));
                    v1 = fmaf(fm_acc_value(v1), __uint_as_float(dq.y), __uint_as_float(b.y));
#else
                    (void)bias;
#endif
#if FM_RES_TYPE >= 0
                    r0 = fm_ld_f<FM_RES_TYPE>(res, row * Ly::NR + col);
                    if (col + 1 < Ly::NR)
                        r1 = fm_ld_f<FM_RES_TYPE>(res, row * Ly::NR + col + 1);
#if FM_PREC >= 3
                    if constexpr (FM_RES_TYPE != 3) {  // x: the codes an 8-bit network keeps of it (csrc/ref.c)
                        constexpr float RQ = 1.0f / Ly::RSCALE;
                        fm_code2_to_f(fm_quant2(r0 * RQ, r1 * RQ), r0, r1);
                    }
                    r0 *= Ly::RSCALE;
                    r1 *= Ly::RSCALE;
#endif
#endif
                    (void)res;
#if FM_OUT_TYPE == 3  // the next layer's codes
                    fm_epilogue<0>(v0, v1, r0, r1, col);
                    const unsigned long long bits = fm_quant2(v0 * Ly::QOUT, v1 * Ly::QOUT);
#elif FM_OUT_TYPE == 0
                    fm_epilogue<0>(v0, v1, r0, r1, col);
                    const unsigned long long bits =
                        (unsigned long long)__float_as_uint(v0) | (unsigned long long)__float_as_uint(v1) << 32;
#else
                    const unsigned long long bits = fm_epilogue16<0, FM_OUT_TYPE>(v0, v1, r0, r1, col);
#endif
                    const int scol = (nt - slab * SNT) * 8 + 2 * t;  // the column within the slab
                    fm_put2<STG>(y, row, col, bits, fm_stg_at(at, mt * 16 + g + 8 * h, scol * OUT_B));
                }
            }
        }
#if FM_GEMM_TMA_STORE
        if constexpr (STG)
            fm_ts_store(ty, at, n0 + wn * TN + slab * STG_COLS, row0 + fm_tile_row(wm, 0), lane);
#else
        if constexpr (STG) {  // the warp's staged slab to y, a row's 16-byte chunks by consecutive lanes
            constexpr int CPR = STG_COLS * OUT_B / 16;
            __syncwarp();
            // (PC with a residual: two 16-byte stores in flight, not four, whose aligned register quads spilled
            // 12 bytes at the 168 registers three warpgroups leave a thread)
            constexpr int UNROLL = PC && FM_RES_TYPE >= 0 ? 2 : 4;
#pragma unroll UNROLL
            for (int i = lane; i < TM * CPR; i += 32) {
                const int r = i / CPR, c = i % CPR;
                const long long row = row0 + fm_tile_row(wm, r);
                const int col = n0 + wn * TN + slab * STG_COLS + c * (16 / OUT_B);
                if (row < rows && col < Ly::NR) {
                    fm_v4 v;
                    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                                 : "r"(fm_stg_at(at, r, c * 16))
                                 : "memory");
                    fm_stg16(y + row * Ly::NR + col, v);
                }
            }
            __syncwarp();  // (the warp's buffer is written again for its next slab or tile)
        }
#endif
    }
}

// The epilogue, staged where the form allows and y is 16-byte aligned (Kernel.launch takes no other pointer; the
// check keeps the kernel safe on its own). Before staging, a barrier of the warps that multiply: every one of them
// is past its last read of the stages.
__device__ __forceinline__ void fm_epilogue_any(const float (&acc)[MT][NT][4], out_t *__restrict__ y,
                                                const void *__restrict__ res, const float *__restrict__ bias,
                                                long long row0, long long rows, int n0, int wm, int wn, int g, int t,
                                                fm_u32 smem, int warp, int lane, const void *ty = nullptr) {
    if constexpr (STAGED) {
        if (((unsigned long long)y & 15ull) == 0ull) {
            if constexpr (PP || PC) {  // (its own buffer after the stages: nothing to wait for)
                fm_epilogue_store<true>(acc, y, res, bias, row0, rows, n0, wm, wn, g, t,
                                        smem + (fm_u32)(STG_AT + warp * STG_WARP_B), lane, ty);
                return;
            }
            if constexpr (FM_GEMM_WS)
                asm volatile("bar.sync 1, %0;" ::"n"(CWARPS * 32) : "memory");
            else
                __syncthreads();
            fm_epilogue_store<true>(acc, y, res, bias, row0, rows, n0, wm, wn, g, t,
                                    smem + (fm_u32)(warp * STG_WARP_B), lane);
            return;
        }
    }
    fm_epilogue_store<false>(acc, y, res, bias, row0, rows, n0, wm, wn, g, t, 0u, lane);
}

// A tile's accumulators at the start, this warp's columns from c0: the bias, as in the fused kernels (no bias add in
// the epilogue), or zero for 8-bit (the epilogue's dequantisation adds the bias).
__device__ __forceinline__ void fm_acc_init(float (&acc)[MT][NT][4], int c0, int t, const float *__restrict__ bias) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int col = c0 + nt * 8 + 2 * t;
        const bool b = Ly::BIAS && FM_PREC < 3;
        const float b0 = b ? bias[col] : 0.0f, b1 = b ? bias[col + 1] : 0.0f;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            acc[mt][nt][0] = acc[mt][nt][2] = b0;
            acc[mt][nt][1] = acc[mt][nt][3] = b1;
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, FM_BLOCKS_PER_SM) {{CLUSTER_DIMS}}
{{KERNEL_NAME}}(const void *__restrict__ x,      // input part 0: rows x A0_REAL of dtype FM_IN_TYPE
                out_t *__restrict__ y,            // rows x NR of out_t
                const act_t *__restrict__ w,      // N x K act_t: nn.Linear's weight, zero-padded, part 1 at K0
                const float *__restrict__ bias,   // N floats (zero without a bias)
                long long rows,                   // batch size, >= 1
                const void *__restrict__ x1,      // input part 1 (a concat's): rows x A1_REAL of FM_A1_TYPE, or null
                const void *__restrict__ res      // the residual operand: rows x NR of FM_RES_TYPE, or null
#if FM_GEMM_TMA || FM_GEMM_TMA_STORE
                ,
                const __grid_constant__ fm_tmap ta0,  // input part 0's tensor map (fm_tma_stage_a)
                const __grid_constant__ fm_tmap ta1   // part 1's (part 0's without a concat)
#endif
#if FM_GEMM_TMA_STORE
                ,
                const __grid_constant__ fm_tmap ty  // y's (fm_ts_store)
#endif
) {
    // the tensor maps' addresses: A's parts for the producer (FM_GEMM_TMA), y's for the consumers (FM_GEMM_TMA_STORE)
#if FM_GEMM_TMA
    const void *tmap0 = &ta0, *tmap1 = &ta1;
#else
    const void *tmap0 = nullptr, *tmap1 = nullptr;
#endif
#if FM_GEMM_TMA_STORE
    const void *tmap_y = &ty;
#else
    const void *tmap_y = nullptr;
#endif
    (void)tmap0;
    (void)tmap1;
    (void)tmap_y;
    extern __shared__ __attribute__((aligned(16))) unsigned char fm_smem_raw[];
    // wgmma's swizzle atoms are 1024-byte aligned: the plan gives that much more shared memory to align the stages
    const fm_u32 smem = FM_WGMMA ? (fm_smem_addr(fm_smem_raw) + 1023u) & ~1023u : fm_smem_addr(fm_smem_raw);
    constexpr int NTILES = Ly::N / BN;
    fm_grid_wait();  // (fm_common.cuh) the kernel before this one on the stream is done: x may be read, y written
#if FM_GEMM_CLUSTER > 1 && !FM_GEMM_WS
    // A cluster takes adjacent row tiles of one column tile (so its CTAs share B), column tiles fastest; a CTA whose
    // rows are all past the batch (the grid's row tiles are even) loads its half of B and stores nothing.
    const fm_u32 rank = fm_cluster_rank();
    const long long pair = blockIdx.x / FM_GEMM_CLUSTER;
    const int ntile = (int)(pair % NTILES), n0 = ntile * BN;
    const long long row0 = (pair / NTILES * FM_GEMM_CLUSTER + rank) * BM;
    const fm_u32 bars = smem + FM_STAGES * STAGE_B;
    if (threadIdx.x == 0) {
        for (int s = 0; s < FM_STAGES; ++s) {
            fm_mbar_init(fm_full_bar(bars, s), THREADS + 1);
            fm_mbar_init(fm_empty_bar(bars, s), 2 * FM_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    fm_cluster_sync();  // every CTA's barriers are initialised before the other's copies and arrivals reach them
#else
    const long long tile = blockIdx.x;
    const int ntile = (int)(tile % NTILES), n0 = ntile * BN;
    const long long row0 = tile / NTILES * BM;
#endif
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;
    const int g = lane >> 2, t = lane & 3;

#if FM_GEMM_WS
    const fm_u32 bars = smem + FM_STAGES * STAGE_B;
    if (threadIdx.x == 0) {
        for (int s = 0; s < FM_STAGES; ++s) {
            fm_mbar_init(fm_full_bar(bars, s), FM_GEMM_TMA ? 1 : 128 + 1);  // (TMA: thread 0's arrival alone)
            // PP: the consuming warpgroup's warps; clusters: every CTA's consumer warps (fm_ws_release)
            fm_mbar_init(fm_empty_bar(bars, s), PP ? 4 : CWARPS * FM_GEMM_CLUSTER);
        }
        if (PP) {  // turn[0], turn[1]: a warpgroup's 128 threads each
            fm_mbar_init(bars + 16 * FM_STAGES, 128);
            fm_mbar_init(bars + 16 * FM_STAGES + 8, 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
#if FM_GEMM_CLUSTER > 1
    const fm_u32 rank = fm_cluster_rank();
    fm_cluster_sync();  // every CTA's barriers are initialised before the other's copies and arrivals reach them
#else
    const fm_u32 rank = 0;
    __syncthreads();
#endif
#if FM_GEMM_WS >= 2
    (void)ntile;
    (void)row0;
    (void)n0;
    if (warp >= CWARPS) {
        fm_persist_produce(smem, bars, x, x1, w, rows, rank, (int)threadIdx.x - CWARPS * 32, tmap0, tmap1);
        fm_grid_release();  // the CTA's last stages are loading: the next kernel's CTAs may be scheduled
    } else {
#if FM_GEMM_WS == 2
        const int wg = warp >> 2, wq = warp & 3;
        const fm_u32 turn = bars + 16 * FM_STAGES;  // turn[wg] at turn + 8 wg
        long long j = 0, mine = 0;                  // the CTA's tile j, and this warpgroup's tiles so far
#pragma unroll 1
        for (long long tl = fm_persist_first(); tl < fm_persist_items(rows); tl += fm_persist_step(), ++j) {
            if ((int)(j & 1) != wg)
                continue;
            // turn[0]'s phase k - 1 lets warpgroup 0 start its tile k (its first needs none), turn[1]'s phase k
            // warpgroup 1's tile k
            if (wg == 1 || mine > 0)
                fm_mbar_wait(turn + 8 * wg, (fm_u32)((wg == 0 ? mine - 1 : mine) & 1));
            ++mine;
            int ntile_t;
            long long row0_t;
            fm_persist_tile(tl, rank, ntile_t, row0_t);
            const int n0_t = ntile_t * BN;
            float acc[MT][NT][4];
            fm_acc_init(acc, n0_t, t, bias);
            fm_mainloop_pp(acc, smem, bars, j * KTILES, turn + 8 * (wg ^ 1), lane);
            fm_epilogue_any(acc, y, res, bias, row0_t, rows, n0_t, wq, 0, g, t, smem, warp, lane);
        }
#else
        long long seq0 = 0;  // the CTA's stage at the tile's first
#pragma unroll 1
        for (long long i = fm_persist_first(); i < fm_persist_items(rows); i += fm_persist_step(), seq0 += KTILES) {
            int ntile_t;
            long long row0_t;
            fm_persist_tile(i, rank, ntile_t, row0_t);
            const int n0_t = ntile_t * BN;
            float acc[MT][NT][4];
            fm_acc_init(acc, n0_t + wn * TN, t, bias);
            fm_mainloop_ws(acc, smem, bars, seq0, warp, lane);
            fm_epilogue_any(acc, y, res, bias, row0_t, rows, n0_t, wm, wn, g, t, smem, warp, lane, tmap_y);
        }
#if FM_GEMM_TMA_STORE
        if (lane == 0)  // the warp's last stores done before its CTA leaves
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
#endif
    }
#if FM_GEMM_CLUSTER > 1
    fm_cluster_sync();  // no CTA leaves while its partner may still multicast into it or arrive on its barriers
#endif
    (void)wm;
    (void)wn;
    (void)rank;
    return;
#endif
    // (No setmaxnreg: the consumers fit the launch bound's even share, 168 registers, without spills.)
    if (warp >= CWARPS) {
        fm_ws_produce(smem, bars, x, x1, w, row0, rows, ntile, (int)threadIdx.x - CWARPS * 32, tmap0, tmap1);
        fm_grid_release();  // the tile's last stages are loading: the next kernel's CTAs may be scheduled
    } else {
#elif FM_GEMM_CLUSTER == 1
    (void)ntile;
    fm_prefetch(smem, x, x1, w, row0, rows, n0);
#endif
    float acc[MT][NT][4];
    fm_acc_init(acc, n0 + wn * TN, t, bias);
#if FM_GEMM_CLUSTER > 1 && !FM_GEMM_WS
    fm_mainloop_cluster(acc, smem, bars, x, x1, w, row0, rows, ntile, rank, warp, lane);
    fm_grid_release();  // (fm_common.cuh) the next kernel's CTAs may be scheduled
    // No CTA may leave while the other can still arrive on its barriers: the last arrivals came before this.
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    fm_epilogue_store<false>(acc, y, res, bias, row0, rows, n0, wm, wn, g, t, 0u, lane);
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#elif FM_GEMM_WS
    fm_mainloop_ws(acc, smem, bars, 0, warp, lane);
    fm_epilogue_any(acc, y, res, bias, row0, rows, n0, wm, wn, g, t, smem, warp, lane);
    }  // (the consumers' branch)
#else
    fm_mainloop(acc, smem, x, x1, w, row0, rows, n0, warp, lane);
    fm_grid_release();  // (fm_common.cuh) the next kernel's CTAs may be scheduled
    fm_copy_wait<0>();  // leave no copy in flight at exit (the last stages' groups are empty)
    fm_epilogue_any(acc, y, res, bias, row0, rows, n0, wm, wn, g, t, smem, warp, lane);
#endif
}
