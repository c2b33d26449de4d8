// fused_mlp.cu - the fused MLP forward: one launch runs every layer, activations never leave the chip.
//
// Rendered by csrc/render.c: every double-brace placeholder below is filled from the plan (csrc/plan.c); an unknown
// or unused placeholder is an error. Compiled by NVRTC with no include path, so Tensor Core, ldmatrix, cp.async and
// fp16 conversions are inline PTX and halves are raw 16-bit patterns.
//
// Shape of the work:
// - A CTA of WARPS warps owns ROWS_CTA consecutive rows of the batch; a persistent grid loops over row tiles.
// - Each warp owns a private strip of ROWS_W = 16 * M_TILES rows and BUFFERS activation buffers for it, so layers
//   inside a strip need only __syncwarp, never a CTA barrier. The plan assigns the buffers like registers (plan.c,
//   fm_plan_buffers): x arrives in buffer 0; a layer that is one accumulator chunk and whose input nobody reads
//   later is updated in place; values read again later (a residual operand, x for a concat) keep their buffer.
// - Activations and weights on chip are act_t: fp16 or bf16 bits, float32 rounded to TF32, or 8-bit codes (int8,
//   e4m3) of values divided by their scale (PREC). The mma fragments of all of them come from the same ldmatrix byte
//   offsets (a 16-byte row of 8 halves, 4 floats or 16 codes), so only the mma instruction and the conversions
//   differ; k advances 32 bytes per mma (k16 halves, k8 floats, k32 codes). 8-bit accumulators start at zero (or,
//   int8, at fm_acc_magic's constant) and are dequantised (times act_scale * w_scale[n], plus the bias) before the
//   norm and the epilogue, whose result is stored as the next layer's codes (times its input's inverse scale, QOUT).
// - Weights sit in shared memory in the layout the host packed them in (row n of layer l: K elements + 16 bytes,
//   the pad makes the 8 rows an ldmatrix touches fall in 8 different bank groups). RESIDENT: all layers are loaded
//   once per CTA. Otherwise each (layer, column chunk) stage is streamed with cp.async into one of two slots while
//   the previous stage computes.
// - Each layer: mma.sync (fp32 accumulate) fed by ldmatrix, over one input buffer or, for an input concat, two (the
//   weight columns of the second part start at K0); in registers: bias, activation, an optional residual
//   y = post(act(.) op r) with r read from its buffer at the same (row, col), padded output columns forced to zero
//   (act(0) need not be 0, e.g. sigmoid); the result goes to the layer's output buffer. The last layer stages its
//   output (as out_t) for coalesced stores.
// - Input and output are read and written once, converting in the kernel; 16-byte accesses where the row width
//   allows, otherwise contiguous coalesced scalars. Rows past the batch are zero-filled and never stored.
//
// Plan: {{PLAN_COMMENT}}

#define FM_WARPS {{WARPS}}
#define FM_M_TILES {{M_TILES}}
#define FM_RESIDENT {{RESIDENT}}
#define FM_BUFFERS {{BUFFERS}}          // activation buffers per warp
constexpr int ROWS_W = 16 * FM_M_TILES;          // rows per warp strip

#include "fm_common.cuh"

// The last layer stages its output in the activation buffer it writes, as out_t rows with a bank-breaking 16-byte pad
// (the warpgroup kernel's stage of its own has rows of STAGE_W).
constexpr int STAGE_STRIDE = OUT_PAD + 16 / (int)sizeof(out_t);  // in out_t elements
static_assert(STAGE_STRIDE * (int)sizeof(out_t) <= ROW_B, "output staging must fit an activation row");

constexpr int ROWS_CTA = ROWS_W * FM_WARPS;      // rows per CTA tile
constexpr int W_SLOT_ELEMS = {{W_SLOT_ELEMS}};   // one streamed slot (0 when resident)
static_assert(FM_RESIDENT || W_SLOT_ELEMS > 0, "streamed weights need a slot");
constexpr int BUF_B = ROWS_W * ROW_B;            // bytes per activation buffer
static_assert(W_SMEM_ELEMS * EB + B_FLOATS * 4 + FM_WARPS * FM_BUFFERS * BUF_B == SMEM_BYTES,
              "the layout below is the plan's (plan.c, fm_plan_layout)");

// ------------------------------------------------------------------------------------------------ mma.sync

#include "fm_mma_sync.cuh"

// acc += this warp's strip of an input part (KLEN elements, row-major at a_lane's buffer) times its weight columns
// (rows of WSB bytes from b_lane). Addresses are this lane's ldmatrix addresses (shared window, bytes).
template <int KLEN, int NT, int WSB>
__device__ __forceinline__ void fm_accumulate(float (&acc)[FM_M_TILES][NT][4], fm_u32 a_lane, fm_u32 b_lane) {
    // K in blocks of at most 128 bytes, unrolled inside a rolled loop: a fully unrolled 256-wide K kept too many
    // fragments live (255 registers and spills) and made a deep network's compile take tens of seconds.
    constexpr int KB = KLEN * EB;
    constexpr int BLOCK = KB < 128 ? KB : 128;
    static_assert(KB % 32 == 0, "input parts are whole 32-byte mma steps");
#pragma unroll 1
    for (int kb = 0; kb < KB; kb += BLOCK)
#pragma unroll
    for (int kk = 0; kk < BLOCK && kb + kk < KB; kk += 32) {
        const int k0 = kb + kk;
        fm_u32 a[FM_M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < FM_M_TILES; ++mt)
            fm_ldmatrix_x4(a[mt], a_lane + mt * 16 * ROW_B + k0);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            fm_u32 b[4];
            fm_ldmatrix_x4(b, b_lane + nt * 8 * WSB + k0);
#pragma unroll
            for (int mt = 0; mt < FM_M_TILES; ++mt) {
                fm_mma(acc[mt][nt], a[mt], b[0], b[1]);
                fm_mma(acc[mt][nt + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

#if FM_PREC >= 3
// int8 layers whose sums stay below 2^22 in magnitude (127 * 127 * K < 2^22: K <= 256, every layer without a concat,
// since 8-bit layers are at most 256 wide) start their s32 accumulators at FM_MAGIC's bits (fm_common.cuh): the sum
// s then leaves FM_MAGIC_BITS + s, whose bits are the float FM_MAGIC + s (ulp 1 between 2^23 and 2^24), and one
// exact FADD gives s where an I2FP (a conversion) did. Wider sums (a concat) keep zero and the conversion.
template <int L> struct fm_acc_magic {
    static constexpr bool ON = FM_PREC == 3 && Layer<L>::K * 127 * 127 < (1 << 22);
};
template <int L> __device__ __forceinline__ float fm_acc_to_f(float c) {
    if constexpr (fm_acc_magic<L>::ON)
        return __fsub_rn(c, FM_MAGIC);  // exact: an integer below 2^22
    else
        return fm_acc_value(c);
}

// 8-bit: the accumulators of columns n0 + 8 nt + 2t (+1) become W h + b: times the column's act_scale * w_scale
// (Ly::DQ_OFF in the float blob), plus its bias, in one fma (csrc/ref.c's emulation rounds these in float64).
template <int L, int NT>
__device__ __forceinline__ void fm_dequant(float (&acc)[FM_M_TILES][NT][4], const float *bias, int n0, int t) {
    typedef Layer<L> Ly;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int col = n0 + nt * 8 + 2 * t;
        const float d0 = bias[Ly::DQ_OFF + col], d1 = bias[Ly::DQ_OFF + col + 1];
        const float b0 = Ly::BIAS ? bias[Ly::B_OFF + col] : 0.0f, b1 = Ly::BIAS ? bias[Ly::B_OFF + col + 1] : 0.0f;
#pragma unroll
        for (int mt = 0; mt < FM_M_TILES; ++mt)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                acc[mt][nt][i] = fmaf(fm_acc_to_f<L>(acc[mt][nt][i]), i & 1 ? d1 : d0, i & 1 ? b1 : b0);
    }
}
#endif

// A norm layer of more than one chunk (plan.c, fm_plan_layout) runs its chunks twice (fm_layer): first for the rows'
// statistics, kept here per lane for its rows g and g + 8 of each m tile, then for the output. Pass 1 merges each
// chunk's mean and M2 = sum (z - mean)^2 over its real columns into the running ones (Chan et al.'s pairwise update:
// no E[z^2] - mean^2 cancellation); rmsnorm and a centred layernorm (fm_norm_mean) sum z^2 alone (mean stays 0); a
// softmax keeps the max and the sum of exp(z - max) there (fm_soft_*; every chunk has a real column).
struct fm_row_stats {
    float mean[FM_M_TILES][2], m2[FM_M_TILES][2];
};

template <int L, int NT>
__device__ __forceinline__ void fm_row_stats_add(const float (&acc)[FM_M_TILES][NT][4], int n0, int t,
                                                 fm_row_stats &st) {
    typedef Layer<L> Ly;
    // Real columns in this chunk and before it: >= 1 and n0 (every chunk but the last is all real columns, and a
    // layer's padding is under 16 columns, a chunk 16 or more).
    const float nb = (float)(Ly::NR - n0 < NT * 8 ? Ly::NR - n0 : NT * 8), na = (float)n0;
#pragma unroll
    for (int mt = 0; mt < FM_M_TILES; ++mt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float *v = &acc[mt][0][0];
            if constexpr (fm_norm_soft<L>()) {  // mean: the max so far, m2: the sum of exp(z - max)
                const float mb = fm_quad_max(fm_soft_max_part<L, NT>(v, n0, t, hh));
                const float sb = fm_quad_sum(fm_soft_sum_part<L, NT, false>(v, n0, t, hh, mb));
                const float m = n0 == 0 ? mb : fmaxf(st.mean[mt][hh], mb);
                st.m2[mt][hh] = n0 == 0 ? sb : st.m2[mt][hh] * __expf(st.mean[mt][hh] - m) + sb * __expf(mb - m);
                st.mean[mt][hh] = m;
            } else if constexpr (fm_norm_mean<L>()) {
                const float mb = fm_quad_sum(fm_norm_part<L, NT, false>(v, n0, t, hh, 0.0f)) / nb;
                const float m2b = fm_quad_sum(fm_norm_part<L, NT, true>(v, n0, t, hh, mb));
                const float delta = mb - st.mean[mt][hh];
                st.mean[mt][hh] += delta * (nb / (na + nb));
                st.m2[mt][hh] += m2b + delta * delta * (na * nb / (na + nb));
            } else {
                st.m2[mt][hh] += fm_quad_sum(fm_norm_part<L, NT, true>(v, n0, t, hh, 0.0f));
            }
        }
    }
}

// Accumulates columns [n0, n0 + NCC) of layer L for this warp's strip and runs the epilogue. act: the warp's
// buffer 0 (shared window byte address; buffer i at act + i * BUF_B); w: row 0 of the layer's weights (row n at
// w + n * WSB). PASS (norm layers of more than one chunk): 1 only adds the chunk to the row statistics st, 2 normalizes
// with the finished st; 0: a layer in one pass (a norm layer then one chunk, its statistics from the registers).
template <int L, int NCC, int PASS = 0>
__device__ __forceinline__ void fm_layer_chunk(fm_u32 act, fm_u32 w, const float *bias, int n0, int lane,
                                               fm_row_stats &st) {
    typedef Layer<L> Ly;
    constexpr int NT = NCC / 8;  // n8 tiles, even because NCC is a multiple of 16
    constexpr int WSB = Ly::K * EB + 16;
    static_assert(NCC % 16 == 0 && NCC > 0, "chunks are whole 16-column groups");

    // Accumulator fragment: c0,c1 at (row g, cols 2t, 2t+1), c2,c3 at (row g+8, same cols). They start at the
    // bias (zero without one), so the epilogue has none to add; 8-bit ones at zero (fm_dequant adds it), or for
    // int8 at FM_MAGIC's bits (fm_acc_magic).
    const int g = lane >> 2, t = lane & 3;
    float acc[FM_M_TILES][NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#if FM_PREC == 3
        float b0 = fm_acc_magic<L>::ON ? __uint_as_float(FM_MAGIC_BITS) : 0.0f, b1 = b0;
#else
        float b0 = 0.0f, b1 = 0.0f;
#endif
        if constexpr (Ly::BIAS && FM_PREC < 3) {
            b0 = bias[Ly::B_OFF + n0 + nt * 8 + 2 * t];
            b1 = bias[Ly::B_OFF + n0 + nt * 8 + 2 * t + 1];
        }
#pragma unroll
        for (int mt = 0; mt < FM_M_TILES; ++mt) {
            acc[mt][nt][0] = acc[mt][nt][2] = b0;
            acc[mt][nt][1] = acc[mt][nt][3] = b1;
        }
    }

    // ldmatrix lane roles (byte offsets, the same for 2- and 4-byte elements). A (16 rows x 32 bytes, row-major
    // activations): lane l gives row l % 16, bytes 16 * (l / 16). B (weights W[n][k] are B^T, i.e. B column-major):
    // lane l gives row n = 8 * (l / 16) + l % 8, bytes 16 * (l / 8 % 2).
    const fm_u32 a_off = (lane & 15) * ROW_B + (lane >> 4) * 16;
    const fm_u32 b_lane = w + (n0 + (lane >> 4) * 8 + (lane & 7)) * WSB + ((lane >> 3) & 1) * 16;
    fm_accumulate<Ly::K0, NT, WSB>(acc, act + Ly::A0_BUF * BUF_B + a_off, b_lane);
    if constexpr (Ly::A1_BUF >= 0)  // the concat's second part: weight columns from K0 on
        fm_accumulate<Ly::K - Ly::K0, NT, WSB>(acc, act + Ly::A1_BUF * BUF_B + a_off, b_lane + Ly::K0 * EB);
#if FM_PREC >= 3
    fm_dequant<L, NT>(acc, bias, n0, t);
#endif
    if constexpr (PASS == 1) {
        fm_row_stats_add<L, NT>(acc, n0, t, st);
        return;
    } else if constexpr (PASS == 2) {
        constexpr float INV_N = 1.0f / (float)Ly::NR;
#pragma unroll
        for (int mt = 0; mt < FM_M_TILES; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                if constexpr (fm_norm_soft<L>())
                    fm_soft_apply<L, NT, false>(&acc[mt][0][0], n0, t, hh, st.mean[mt][hh], st.m2[mt][hh], 0.0f);
                else
                    fm_norm_apply<L, NT>(&acc[mt][0][0], n0, t, hh, st.mean[mt][hh],
                                         rsqrtf(st.m2[mt][hh] * INV_N + Ly::EPS), bias);
            }
    } else if constexpr (Ly::NORM != 0) {  // one chunk: the quads hold whole rows
        static_assert(NCC == Ly::N, "a norm layer in one pass is one chunk");
#pragma unroll
        for (int mt = 0; mt < FM_M_TILES; ++mt)
            fm_norm_tiles<L, NT>(&acc[mt][0][0], 0, t, bias);
    }

    if constexpr (Ly::OUT_BUF == Ly::A0_BUF || Ly::OUT_BUF == Ly::A1_BUF)
        __syncwarp();  // in place: every lane's reads of the input precede any lane's write of the output
    // Epilogue.
    constexpr int OUT_ROW_B = L == LAST ? STAGE_STRIDE * (int)sizeof(out_t) : ROW_B;
    constexpr int OUT_COL_B = L == LAST ? (int)sizeof(out_t) : EB;
    const fm_u32 e_lane = act + Ly::OUT_BUF * BUF_B + g * OUT_ROW_B + (n0 + 2 * t) * OUT_COL_B;
    // The residual operand: this lane's two elements of value r, at the same (row, col) as its outputs. When r is
    // also the buffer written (in place), each element is read here before this same lane overwrites it; no other
    // lane writes it (the plan never stages the last layer's output over its residual operand).
    const fm_u32 r_lane = act + (Ly::RES_BUF < 0 ? 0 : Ly::RES_BUF) * BUF_B + g * ROW_B + (n0 + 2 * t) * EB;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int col = n0 + nt * 8 + 2 * t;
        // An n8 tile wholly in the padding only writes zeros: its activations would be masked anyway (pinn50's 50
        // columns pad to 64, so this saves an eighth of its tanh). Uniform across the warp; folded where n0 is known.
        const bool live = Ly::NR == Ly::N || n0 + nt * 8 < Ly::NR;
#pragma unroll
        for (int mt = 0; mt < FM_M_TILES; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float v0 = acc[mt][nt][2 * h], v1 = acc[mt][nt][2 * h + 1], r0 = 0.0f, r1 = 0.0f;
                if constexpr (Ly::RES != 0) {
                    if (live)
                        fm_ld_act2(r_lane + (mt * 16 + 8 * h) * ROW_B + nt * 8 * EB, r0, r1);
#if FM_PREC >= 3  // codes -> values
                    r0 *= Ly::RSCALE;
                    r1 *= Ly::RSCALE;
#endif
                }
                const fm_u32 addr = e_lane + (mt * 16 + 8 * h) * OUT_ROW_B + nt * 8 * OUT_COL_B;
                // The result's storage: out_t for the last layer, act_t for the others; 16-bit pairs take the
                // layer's pair form where it has one. 8-bit: the next layer's codes (T 0, then times QOUT).
                constexpr int T = L == LAST ? FM_OUT_TYPE : (FM_PREC == 2 || FM_PREC >= 3 ? 0 : FM_PREC + 1);
#if FM_PREC >= 3
                if constexpr (L != LAST && Ly::QFOLD != 0) {  // v0, v1 are times QOUT already (fm_plan.q_fold)
                    if (!live || col >= Ly::NR)
                        v0 = 0.0f;
                    if (!live || col + 1 >= Ly::NR)
                        v1 = 0.0f;
                    fm_st_code2(addr, Ly::QFOLD == 2 ? fm_quant2_relu(v0, v1) : fm_quant2(v0, v1));
                } else
#endif
                if constexpr (T == 0) {
                    if (live)
                        fm_epilogue<L>(v0, v1, r0, r1, col);
                    else
                        v0 = v1 = 0.0f;
                    if constexpr (L == LAST) {
                        fm_st_out2(addr, v0, v1);
                    } else {
#if FM_PREC >= 3
                        v0 *= Ly::QOUT;
                        v1 *= Ly::QOUT;
#endif
                        fm_st_act2(addr, v0, v1);
                    }
                } else {
                    fm_st_shared(addr, live ? fm_epilogue16<L, T>(v0, v1, r0, r1, col) : 0u);
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------ the network

// Shared memory: [weights | biases | per-warp activation buffers (FM_BUFFERS x ROWS_W x ACT_STRIDE act_t each)].
struct fm_smem {
    act_t *w;
    float *bias;
    act_t *act;
    fm_u32 w_addr;  // shared-window address of w
};

// Layer L for this warp's strip: NCH chunks of NC columns, the last one TAIL columns wide. Streamed mode: every chunk
// is a stage whose weights arrive in `slot` while the previous stage computes; the stage after the network's last
// is the next tile's first (when this CTA has one).
template <int L> struct fm_chunks {
    static constexpr int NCH = (Layer<L>::N + Layer<L>::NC - 1) / Layer<L>::NC;
    static constexpr int TAIL = Layer<L>::N - (NCH - 1) * Layer<L>::NC;
    static constexpr int WS = Layer<L>::K + 16 / EB;                           // elements per weight row
    static constexpr int FIRST_ELEMS = (NCH > 1 ? Layer<L>::NC : TAIL) * WS;  // elements of the first stage
};

// Chunk ch of layer L (NC columns; the last one TAIL) in pass PASS (fm_layer_chunk).
template <int L, int PASS>
__device__ __forceinline__ void fm_chunk_at(fm_u32 act, fm_u32 w, const float *bias, int ch, int lane,
                                            fm_row_stats &st) {
    typedef Layer<L> Ly;
    typedef fm_chunks<L> C;
    if constexpr (C::TAIL == Ly::NC) {
        fm_layer_chunk<L, Ly::NC, PASS>(act, w, bias, ch * Ly::NC, lane, st);
    } else {
        if (ch + 1 < C::NCH)
            fm_layer_chunk<L, Ly::NC, PASS>(act, w, bias, ch * Ly::NC, lane, st);
        else
            fm_layer_chunk<L, C::TAIL, PASS>(act, w, bias, ch * Ly::NC, lane, st);
    }
}

template <int L>
__device__ __forceinline__ void fm_layer(const fm_smem &s, const act_t *__restrict__ wg, fm_u32 act, int &slot,
                                         bool more_tiles, int lane) {
    typedef Layer<L> Ly;
    typedef fm_chunks<L> C;
    constexpr bool TWO = Ly::NORM != 0 && C::NCH > 1;  // a norm over chunks: every chunk for the statistics first
    fm_row_stats st = {};
#if FM_RESIDENT
    const fm_u32 w = s.w_addr + EB * Ly::W_OFF;
    if constexpr (TWO) {
#pragma unroll 1
        for (int c = 0; c < C::NCH - 1; ++c)
            fm_layer_chunk<L, Ly::NC, 1>(act, w, s.bias, c * Ly::NC, lane, st);
        fm_layer_chunk<L, C::TAIL, 1>(act, w, s.bias, (C::NCH - 1) * Ly::NC, lane, st);
    }
#pragma unroll 1
    for (int c = 0; c < C::NCH - 1; ++c)
        fm_layer_chunk<L, Ly::NC, TWO ? 2 : 0>(act, w, s.bias, c * Ly::NC, lane, st);
    fm_layer_chunk<L, C::TAIL, TWO ? 2 : 0>(act, w, s.bias, (C::NCH - 1) * Ly::NC, lane, st);
#else
    constexpr int STAGES = TWO ? 2 * C::NCH : C::NCH;  // TWO streams the layer's weights twice
#pragma unroll 1
    for (int c = 0; c < STAGES; ++c) {
        const int ch = c < C::NCH ? c : c - C::NCH;  // this stage's chunk
        // Prefetch the next stage into the other slot; the barrier that ended the previous stage freed it.
        const act_t *src = nullptr;
        int elems = 0;
        if (c + 1 < STAGES) {
            const int next = c + 1 < C::NCH ? c + 1 : c + 1 - C::NCH;
            src = wg + Ly::W_OFF + next * Ly::NC * C::WS;
            elems = (next + 1 < C::NCH ? Ly::NC : C::TAIL) * C::WS;
        } else if (L < LAST) {
            constexpr int L2 = L < LAST ? L + 1 : 0;
            src = wg + Layer<L2>::W_OFF;
            elems = fm_chunks<L2>::FIRST_ELEMS;
        } else if (more_tiles) {
            src = wg + Layer<0>::W_OFF;
            elems = fm_chunks<0>::FIRST_ELEMS;
        }
        if (src != nullptr)
            fm_copy_block(s.w + (slot ^ 1) * W_SLOT_ELEMS, src, elems);
        fm_copy_commit();
        fm_copy_wait<1>();
        __syncthreads();
        // The slot holds only this chunk's rows: shift the base back so row n of the layer is at w + n * WS.
        const fm_u32 w = s.w_addr + EB * (slot * W_SLOT_ELEMS - ch * Ly::NC * C::WS);
        if constexpr (TWO) {
            if (c < C::NCH)
                fm_chunk_at<L, 1>(act, w, s.bias, ch, lane, st);
            else
                fm_chunk_at<L, 2>(act, w, s.bias, ch, lane, st);
        } else {
            fm_chunk_at<L, 0>(act, w, s.bias, ch, lane, st);
        }
        __syncthreads();
        slot ^= 1;
    }
#endif
}

// Layers L.. of the network, each reading and writing the buffers the plan gave it.
template <int L>
__device__ __forceinline__ void fm_network(const fm_smem &s, const act_t *__restrict__ wg, fm_u32 act, int &slot,
                                           bool more_tiles, int lane) {
    fm_layer<L>(s, wg, act, slot, more_tiles, lane);
    if constexpr (L < LAST) {
        __syncwarp();
        fm_network<L + 1>(s, wg, act, slot, more_tiles, lane);
    }
}

static_assert(Layer<0>::A0_BUF == 0 && Layer<0>::A1_BUF < 0, "x arrives in buffer 0 and layer 0 reads only x");

extern "C" __global__ void __launch_bounds__(THREADS, FM_BLOCKS_PER_SM)
{{KERNEL_NAME}}(const in_t *__restrict__ x,       // rows x IN_REAL, row-major, 16-byte aligned
                out_t *__restrict__ y,            // rows x OUT_REAL, row-major, 16-byte aligned
                const act_t *__restrict__ w,      // packed weights: W_OFF/K/N of each Layer<l>
                const float *__restrict__ bias,   // packed biases: B_OFF/N of each Layer<l>
                long long rows)                   // batch size, >= 1
{
    extern __shared__ __attribute__((aligned(16))) unsigned char fm_smem_raw[];
    fm_smem s;
    s.w = (act_t *)fm_smem_raw;
    s.bias = (float *)(s.w + W_SMEM_ELEMS);
    s.act = (act_t *)(s.bias + B_FLOATS);
    s.w_addr = fm_smem_addr(s.w);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    act_t *buf0 = s.act + warp * FM_BUFFERS * ROWS_W * ACT_STRIDE;
    const act_t *out_buf = buf0 + Layer<LAST>::OUT_BUF * ROWS_W * ACT_STRIDE;

    for (int i = threadIdx.x; i < B_FLOATS; i += THREADS)
        s.bias[i] = bias[i];
#if FM_RESIDENT
    fm_copy_block(s.w, w, W_SMEM_ELEMS);
    fm_copy_commit();
    fm_copy_wait<0>();
#else
    fm_copy_block(s.w, w + Layer<0>::W_OFF, fm_chunks<0>::FIRST_ELEMS);
    fm_copy_commit();
#endif
    __syncthreads();
    fm_grid_wait();  // (fm_common.cuh) the kernel before this one on the stream is done: x may be read, y written

    const long long tiles = (rows + ROWS_CTA - 1) / ROWS_CTA;
    int slot = 0;
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        if (tile + gridDim.x >= tiles)
            fm_grid_release();  // the CTA's last tile: the next kernel's CTAs may be scheduled (fm_common.cuh)
        const long long r0 = tile * ROWS_CTA + warp * ROWS_W;
        const long long left = rows - r0;
        const int nrows = left <= 0 ? 0 : (left < ROWS_W ? (int)left : ROWS_W);
        fm_load_input(buf0, x, r0, nrows, lane);
        __syncwarp();
        fm_network<0>(s, w, fm_smem_addr(buf0), slot, tile + gridDim.x < tiles, lane);
        __syncwarp();
        if (nrows > 0)
            fm_store_output<OUT_REAL, STAGE_STRIDE>(y, out_buf, r0, nrows, 0, lane);
        __syncwarp();
    }
#if !FM_RESIDENT
    fm_copy_wait<0>();  // leave no copy in flight at exit
#endif
}
