// fused_mlp.cu - the fused MLP forward: one launch runs every layer, activations never leave the chip.
//
// Rendered by csrc/render.c: every double-brace placeholder below is filled from the plan (csrc/plan.c); an unknown
// or unused placeholder is an error. Compiled by NVRTC with no include path, so Tensor Core, ldmatrix, cp.async and
// fp16 conversions are inline PTX and halves are raw 16-bit patterns.
//
// Shape of the work:
// - A CTA of WARPS warps owns ROWS_CTA consecutive rows of the batch; a persistent grid loops over row tiles.
// - Each warp owns a private strip of ROWS_W = 16 * M_TILES rows and its fp16 activation buffer(s), so layers inside
//   a strip need only __syncwarp, never a CTA barrier. When every layer is one accumulator chunk, a layer has read
//   all its input before its epilogue writes: one buffer, updated in place. Otherwise two (ping-pong).
// - Weights sit in shared memory in the layout the host packed them in (row n of layer l: K + 8 halves, the 16-byte
//   pad makes the 8 rows an ldmatrix touches fall in 8 different bank groups). RESIDENT: all layers are loaded once
//   per CTA. Otherwise each (layer, column chunk) stage is streamed with cp.async into one of two slots while the
//   previous stage computes.
// - Each layer: mma.sync m16n8k16 (fp32 accumulate) fed by ldmatrix; in registers: bias, activation, an optional
//   residual with the layer's own input (y = post(act(.) op x)), padded output columns forced to zero (act(0) need
//   not be 0, e.g. sigmoid); the fp16 result goes back in place or to the other buffer. The last layer stages its
//   output (as out_t) for coalesced stores; with a residual there, that forces two buffers (another layout).
// - Input and output are read and written once, converting in the kernel; 16-byte accesses where the row width
//   allows, otherwise contiguous coalesced scalars. Rows past the batch are zero-filled and never stored.
//
// Plan: {{PLAN_COMMENT}}

typedef unsigned short fm_half;  // IEEE binary16 bits
typedef unsigned int fm_u32;
struct alignas(16) fm_v4 { fm_u32 x, y, z, w; };  // no CUDA headers: our own 16- and 8-byte vectors
struct alignas(8) fm_v2 { fm_u32 x, y; };

#define FM_WARPS {{WARPS}}
#define FM_M_TILES {{M_TILES}}
#define FM_RESIDENT {{RESIDENT}}
#define FM_BUFFERS {{BUFFERS}}          // activation buffers per warp: 1 = in place (every layer is one chunk)
#define FM_BLOCKS_PER_SM {{BLOCKS_PER_SM}} // the plan's occupancy: caps registers at 64K / (threads * this)
#define FM_NUM_LAYERS {{NUM_LAYERS}}
#define FM_IN_FLOAT {{IN_FLOAT}}    // 1: x is float32, 0: float16
#define FM_OUT_FLOAT {{OUT_FLOAT}}  // 1: y is float32, 0: float16

constexpr int THREADS = FM_WARPS * 32;
constexpr int ROWS_W = 16 * FM_M_TILES;          // rows per warp strip
constexpr int ROWS_CTA = ROWS_W * FM_WARPS;      // rows per CTA tile
constexpr int ACT_STRIDE = {{ACT_STRIDE}};       // halves per row of an activation buffer
constexpr int W_SMEM_HALVES = {{W_SMEM_HALVES}}; // weight region: whole blob (resident) or two slots (streamed)
constexpr int W_SLOT_HALVES = {{W_SLOT_HALVES}}; // one streamed slot (0 when resident)
static_assert(FM_RESIDENT || W_SLOT_HALVES > 0, "streamed weights need a slot");
constexpr int B_FLOATS = {{B_FLOATS}};           // all layers' padded biases
static_assert(ACT_STRIDE % 8 == 0, "activation rows must keep 16-byte alignment for ldmatrix");
static_assert(W_SMEM_HALVES % 8 == 0 && B_FLOATS % 4 == 0, "regions must keep 16-byte alignment");

#if FM_IN_FLOAT
typedef float in_t;
#else
typedef fm_half in_t;
#endif
#if FM_OUT_FLOAT
typedef float out_t;
#else
typedef fm_half out_t;
#endif

// ------------------------------------------------------------------------------------------------ PTX helpers

__device__ __forceinline__ fm_half fm_f2h(float f) {
    fm_half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float fm_h2f(fm_half h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ fm_u32 fm_pack2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    fm_u32 r;  // one instruction instead of two conversions, a shift and an or
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (fm_u32)fm_f2h(lo) | ((fm_u32)fm_f2h(hi) << 16);
#endif
}
__device__ __forceinline__ fm_u32 fm_smem_addr(const void *p) {
    unsigned long long a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (fm_u32)a;
}
// Shared-memory accesses of the hot loop take 32-bit shared-window addresses, computed once per lane: generic
// 64-bit pointers cost a cvta and two-instruction adds per access, and kept the integer pipe the busiest one
// (ncu, tcnn64 on H100: ALU 46%, tensor pipe far behind). ptxas folds the constant offsets into immediates.
__device__ __forceinline__ void fm_ldmatrix_x4(fm_u32 r[4], fm_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ fm_u32 fm_ld_shared(fm_u32 addr) {
    fm_u32 v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void fm_st_shared(fm_u32 addr, fm_u32 v) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void fm_st_shared(fm_u32 addr, float lo, float hi) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(lo), "f"(hi) : "memory");
}
// D += A(16x16, row) * B(16x8, col), fp16 in, fp32 accumulate.
__device__ __forceinline__ void fm_mma(float c[4], const fm_u32 a[4], fm_u32 b0, fm_u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else  // sm_75 (Turing) has only m16n8k8: the k16 step is two of them
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b0));
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[2]), "r"(a[3]), "r"(b1));
#endif
}
// 16-byte global -> shared copy; asynchronous where the hardware has cp.async (sm_80+).
__device__ __forceinline__ void fm_copy16(void *smem, const void *gmem) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(fm_smem_addr(smem)), "l"(gmem));
#else
    *(fm_v4 *)smem = *(const fm_v4 *)gmem;
#endif
}
__device__ __forceinline__ void fm_copy_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;");
#endif
}
template <int N> __device__ __forceinline__ void fm_copy_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
#endif
}
// Copies `halves` (a multiple of 8) contiguous halves from global to shared memory with the whole CTA.
__device__ __forceinline__ void fm_copy_block(fm_half *dst, const fm_half *src, int halves) {
    for (int i = threadIdx.x * 8; i < halves; i += THREADS * 8)
        fm_copy16(dst + i, src + i);
}

template <typename T> __device__ __forceinline__ float fm_load_f(const T *p);
template <> __device__ __forceinline__ float fm_load_f<float>(const float *p) { return *p; }
template <> __device__ __forceinline__ float fm_load_f<fm_half>(const fm_half *p) { return fm_h2f(*p); }

// ------------------------------------------------------------------------------------------------ the layers

// Layer<l>: compile-time description of layer l, rendered from the plan.
//   K, KR: padded / real input width; N, NR: padded / real output width; NC: output columns accumulated at once;
//   BIAS: adds a bias; W_OFF: first half of the layer in the weight blob (N rows of K + 8 halves);
//   B_OFF: first float of its bias; act: the activation, emitted from the checked expression AST;
//   RES, post: the residual epilogue y = post(act(.) op r), r the layer's own input (RES 1: add, 2: mul; 0: none).
template <int L> struct Layer;
{{LAYERS}}

constexpr int LAST = FM_NUM_LAYERS - 1;
constexpr int IN_REAL = Layer<0>::KR;
constexpr int IN_PAD = Layer<0>::K;
constexpr int OUT_REAL = Layer<LAST>::NR;
constexpr int OUT_PAD = Layer<LAST>::N;
// The last layer stages its output in the buffer it would write, as out_t with a bank-breaking pad.
constexpr int STAGE_STRIDE = FM_OUT_FLOAT ? OUT_PAD + 4 : OUT_PAD + 8;  // in out_t elements
static_assert(STAGE_STRIDE * (int)sizeof(out_t) <= ACT_STRIDE * 2, "output staging must fit an activation row");

// Accumulates columns [n0, n0 + NCC) of layer L for this warp's strip and runs the epilogue. Addresses are shared
// window byte addresses: in/out of the warp's activation buffers, w of row 0 of the layer's weights (row n at
// w + 2 n (K + 8)).
template <int L, int NCC>
__device__ __forceinline__ void fm_layer_chunk(fm_u32 in, fm_u32 out, fm_u32 w, const float *bias, int n0, int lane) {
    typedef Layer<L> Ly;
    constexpr int NT = NCC / 8;  // n8 tiles, even because NCC is a multiple of 16
    constexpr int WS = Ly::K + 8;
    static_assert(NCC % 16 == 0 && NCC > 0, "chunks are whole 16-column groups");

    float acc[FM_M_TILES][NT][4];
#pragma unroll
    for (int mt = 0; mt < FM_M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                acc[mt][nt][i] = 0.0f;

    // ldmatrix lane roles. A (16x16, row-major activations): lane l gives row l % 16, columns 8 * (l / 16).
    // B (weights W[n][k] are B^T, i.e. B column-major): lane l gives row n = 8 * (l / 16) + l % 8, k = 8 * (l / 8 % 2).
    const fm_u32 a_lane = in + 2 * ((lane & 15) * ACT_STRIDE + (lane >> 4) * 8);
    const fm_u32 b_lane = w + 2 * ((n0 + (lane >> 4) * 8 + (lane & 7)) * WS + ((lane >> 3) & 1) * 8);
    // K in blocks of at most 64, unrolled inside a rolled loop: a fully unrolled 256-wide K kept too many fragments
    // live (255 registers and spills) and made a deep network's compile take tens of seconds.
    constexpr int KB = Ly::K < 64 ? Ly::K : 64;
#pragma unroll 1
    for (int kb = 0; kb < Ly::K; kb += KB)
#pragma unroll
    for (int kk = 0; kk < KB && kb + kk < Ly::K; kk += 16) {
        const int k0 = kb + kk;
        fm_u32 a[FM_M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < FM_M_TILES; ++mt)
            fm_ldmatrix_x4(a[mt], a_lane + 2 * (mt * 16 * ACT_STRIDE + k0));
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            fm_u32 b[4];
            fm_ldmatrix_x4(b, b_lane + 2 * (nt * 8 * WS + k0));
#pragma unroll
            for (int mt = 0; mt < FM_M_TILES; ++mt) {
                fm_mma(acc[mt][nt], a[mt], b[0], b[1]);
                fm_mma(acc[mt][nt + 1], a[mt], b[2], b[3]);
            }
        }
    }

    if constexpr (FM_BUFFERS == 1)
        __syncwarp();  // in place: every lane's reads of the input precede any lane's write of the output
    // Epilogue. Accumulator fragment: c0,c1 at (row g, cols 2t, 2t+1), c2,c3 at (row g+8, same cols).
    const int g = lane >> 2, t = lane & 3;
    constexpr int ROW_BYTES = L == LAST ? STAGE_STRIDE * (int)sizeof(out_t) : 2 * ACT_STRIDE;
    constexpr int COL_BYTES = L == LAST ? (int)sizeof(out_t) : 2;
    const fm_u32 e_lane = out + g * ROW_BYTES + (n0 + 2 * t) * COL_BYTES;
    // The residual operand: this lane's two elements of the layer's input, same (row, col) as its outputs. In place
    // (one buffer) each element is read here before this same lane overwrites it; no other lane writes it.
    const fm_u32 r_lane = in + 2 * (g * ACT_STRIDE + n0 + 2 * t);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int col = n0 + nt * 8 + 2 * t;
        float b0 = 0.0f, b1 = 0.0f;
        if constexpr (Ly::BIAS) {
            b0 = bias[Ly::B_OFF + col];
            b1 = bias[Ly::B_OFF + col + 1];
        }
#pragma unroll
        for (int mt = 0; mt < FM_M_TILES; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float v0 = Ly::act(acc[mt][nt][2 * h] + b0);
                float v1 = Ly::act(acc[mt][nt][2 * h + 1] + b1);
                if constexpr (Ly::RES != 0) {
                    const fm_u32 r = fm_ld_shared(r_lane + 2 * ((mt * 16 + 8 * h) * ACT_STRIDE + nt * 8));
                    const float r0 = fm_h2f((fm_half)(r & 0xffffu)), r1 = fm_h2f((fm_half)(r >> 16));
                    v0 = Ly::post(Ly::RES == 1 ? v0 + r0 : v0 * r0);
                    v1 = Ly::post(Ly::RES == 1 ? v1 + r1 : v1 * r1);
                }
                if constexpr (Ly::NR < Ly::N) {  // only layers with padded columns pay for the mask
                    if (col >= Ly::NR) v0 = 0.0f;
                    if (col + 1 >= Ly::NR) v1 = 0.0f;
                }
                const fm_u32 addr = e_lane + (mt * 16 + 8 * h) * ROW_BYTES + nt * 8 * COL_BYTES;
                if constexpr (L == LAST && FM_OUT_FLOAT)
                    fm_st_shared(addr, v0, v1);
                else
                    fm_st_shared(addr, fm_pack2(v0, v1));
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------ input, output

// Loads this warp's strip of x (rows [r0, r0 + nrows)) into `buf` as fp16, zero-filling padded rows and columns.
__device__ __forceinline__ void fm_load_input(fm_half *buf, const in_t *__restrict__ x, long long r0, int nrows,
                                              int lane) {
    constexpr int VEC = 16 / (int)sizeof(in_t);
    if constexpr (IN_REAL % VEC == 0) {  // every row starts 16-byte aligned: vector loads
        constexpr int CHUNKS = IN_REAL / VEC;
        for (int i = lane; i < ROWS_W * CHUNKS; i += 32) {
            const int row = i / CHUNKS, c = (i % CHUNKS) * VEC;
            fm_u32 packed[VEC / 2];
            if (row < nrows) {
                fm_v4 raw = *(const fm_v4 *)(x + (r0 + row) * IN_REAL + c);
                if constexpr (FM_IN_FLOAT) {
                    const float *f = (const float *)&raw;
#pragma unroll
                    for (int j = 0; j < VEC / 2; ++j)
                        packed[j] = fm_pack2(f[2 * j], f[2 * j + 1]);
                } else {
                    const fm_u32 *u = (const fm_u32 *)&raw;
#pragma unroll
                    for (int j = 0; j < VEC / 2; ++j)
                        packed[j] = u[j];
                }
            } else {
#pragma unroll
                for (int j = 0; j < VEC / 2; ++j)
                    packed[j] = 0u;
            }
            fm_half *dst = buf + row * ACT_STRIDE + c;
            if constexpr (VEC == 8)
                *(fm_v4 *)dst = fm_v4{packed[0], packed[1], packed[2 % (VEC / 2)], packed[3 % (VEC / 2)]};
            else
                *(fm_v2 *)dst = fm_v2{packed[0], packed[1 % (VEC / 2)]};
        }
    } else {  // odd row widths: a contiguous, coalesced element walk over the strip
        const long long base = r0 * IN_REAL;
        const int count = nrows * IN_REAL;
        for (int e = lane; e < ROWS_W * IN_REAL; e += 32) {
            const int row = e / IN_REAL, col = e % IN_REAL;
            buf[row * ACT_STRIDE + col] = e < count ? fm_f2h(fm_load_f(x + base + e)) : (fm_half)0;
        }
    }
    if constexpr (IN_PAD > IN_REAL) {  // padded input columns meet zero weights, but must not hold NaN/Inf garbage
        constexpr int PADC = IN_PAD - IN_REAL;
        for (int i = lane; i < ROWS_W * PADC; i += 32)
            buf[(i / PADC) * ACT_STRIDE + IN_REAL + i % PADC] = (fm_half)0;
    }
}

// Writes the staged output of this warp's strip to y.
__device__ __forceinline__ void fm_store_output(out_t *__restrict__ y, const fm_half *buf, long long r0, int nrows,
                                                int lane) {
    const out_t *stage = (const out_t *)buf;
    constexpr int VEC = 16 / (int)sizeof(out_t);
    if constexpr (OUT_REAL % VEC == 0) {
        constexpr int CHUNKS = OUT_REAL / VEC;
        for (int i = lane; i < nrows * CHUNKS; i += 32) {
            const int row = i / CHUNKS, c = (i % CHUNKS) * VEC;
            *(fm_v4 *)(y + (r0 + row) * OUT_REAL + c) = *(const fm_v4 *)(stage + row * STAGE_STRIDE + c);
        }
    } else {
        const long long base = r0 * OUT_REAL;
        const int count = nrows * OUT_REAL;
        for (int e = lane; e < count; e += 32)
            y[base + e] = stage[(e / OUT_REAL) * STAGE_STRIDE + e % OUT_REAL];
    }
}

// ------------------------------------------------------------------------------------------------ the network

// Shared memory: [weights | biases | per-warp activation buffers (FM_BUFFERS x ROWS_W x ACT_STRIDE halves each)].
struct fm_smem {
    fm_half *w;
    float *bias;
    fm_half *act;
    fm_u32 w_addr;  // shared-window address of w
};

// Layer L for this warp's strip: NCH chunks of NC columns, the last one TAIL columns wide. Streamed mode: every chunk
// is a stage whose weights arrive in `slot` while the previous stage computes; the stage after the network's last
// is the next tile's first (when this CTA has one).
template <int L> struct fm_chunks {
    static constexpr int NCH = (Layer<L>::N + Layer<L>::NC - 1) / Layer<L>::NC;
    static constexpr int TAIL = Layer<L>::N - (NCH - 1) * Layer<L>::NC;
    static constexpr int WS = Layer<L>::K + 8;
    static constexpr int FIRST_HALVES = (NCH > 1 ? Layer<L>::NC : TAIL) * WS;  // halves of the first stage
};

template <int L>
__device__ __forceinline__ void fm_layer(const fm_smem &s, const fm_half *__restrict__ wg, fm_u32 in, fm_u32 out,
                                         int &slot, bool more_tiles, int lane) {
    typedef Layer<L> Ly;
    typedef fm_chunks<L> C;
#if FM_RESIDENT
    const fm_u32 w = s.w_addr + 2 * Ly::W_OFF;
#pragma unroll 1
    for (int c = 0; c < C::NCH - 1; ++c)
        fm_layer_chunk<L, Ly::NC>(in, out, w, s.bias, c * Ly::NC, lane);
    fm_layer_chunk<L, C::TAIL>(in, out, w, s.bias, (C::NCH - 1) * Ly::NC, lane);
#else
#pragma unroll 1
    for (int c = 0; c < C::NCH; ++c) {
        // Prefetch the next stage into the other slot; the barrier that ended the previous stage freed it.
        const fm_half *src = nullptr;
        int halves = 0;
        if (c + 1 < C::NCH) {
            src = wg + Ly::W_OFF + (c + 1) * Ly::NC * C::WS;
            halves = (c + 2 < C::NCH ? Ly::NC : C::TAIL) * C::WS;
        } else if (L < LAST) {
            constexpr int L2 = L < LAST ? L + 1 : 0;
            src = wg + Layer<L2>::W_OFF;
            halves = fm_chunks<L2>::FIRST_HALVES;
        } else if (more_tiles) {
            src = wg + Layer<0>::W_OFF;
            halves = fm_chunks<0>::FIRST_HALVES;
        }
        if (src != nullptr)
            fm_copy_block(s.w + (slot ^ 1) * W_SLOT_HALVES, src, halves);
        fm_copy_commit();
        fm_copy_wait<1>();
        __syncthreads();
        // The slot holds only this chunk's rows: shift the base back so row n of the layer is at w + n * WS.
        const fm_u32 w = s.w_addr + 2 * (slot * W_SLOT_HALVES - c * Ly::NC * C::WS);
        if constexpr (C::TAIL == Ly::NC) {
            fm_layer_chunk<L, Ly::NC>(in, out, w, s.bias, c * Ly::NC, lane);
        } else {
            if (c + 1 < C::NCH)
                fm_layer_chunk<L, Ly::NC>(in, out, w, s.bias, c * Ly::NC, lane);
            else
                fm_layer_chunk<L, C::TAIL>(in, out, w, s.bias, c * Ly::NC, lane);
        }
        __syncthreads();
        slot ^= 1;
    }
#endif
}

// Layers L.. of the network; layer l reads buffer l % 2 and writes the other.
template <int L>
__device__ __forceinline__ void fm_network(const fm_smem &s, const fm_half *__restrict__ wg, fm_u32 in, fm_u32 out,
                                           int &slot, bool more_tiles, int lane) {
    fm_layer<L>(s, wg, in, out, slot, more_tiles, lane);
    if constexpr (L < LAST) {
        __syncwarp();
        fm_network<L + 1>(s, wg, out, in, slot, more_tiles, lane);
    }
}

// Which buffer the last layer writes: layer l writes buffer (l + 1) % 2.
constexpr int OUT_BUF = FM_NUM_LAYERS % 2;

extern "C" __global__ void __launch_bounds__(THREADS, FM_BLOCKS_PER_SM)
{{KERNEL_NAME}}(const in_t *__restrict__ x,       // rows x IN_REAL, row-major, 16-byte aligned
                out_t *__restrict__ y,            // rows x OUT_REAL, row-major, 16-byte aligned
                const fm_half *__restrict__ w,    // packed weights: W_OFF/K/N of each Layer<l>
                const float *__restrict__ bias,   // packed biases: B_OFF/N of each Layer<l>
                long long rows)                   // batch size, >= 1
{
    extern __shared__ __attribute__((aligned(16))) unsigned char fm_smem_raw[];
    fm_smem s;
    s.w = (fm_half *)fm_smem_raw;
    s.bias = (float *)(s.w + W_SMEM_HALVES);
    s.act = (fm_half *)(s.bias + B_FLOATS);
    s.w_addr = fm_smem_addr(s.w);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    fm_half *buf0 = s.act + warp * FM_BUFFERS * ROWS_W * ACT_STRIDE;
    fm_half *buf1 = buf0 + (FM_BUFFERS - 1) * ROWS_W * ACT_STRIDE;

    for (int i = threadIdx.x; i < B_FLOATS; i += THREADS)
        s.bias[i] = bias[i];
#if FM_RESIDENT
    fm_copy_block(s.w, w, W_SMEM_HALVES);
    fm_copy_commit();
    fm_copy_wait<0>();
#else
    fm_copy_block(s.w, w + Layer<0>::W_OFF, fm_chunks<0>::FIRST_HALVES);
    fm_copy_commit();
#endif
    __syncthreads();

    const long long tiles = (rows + ROWS_CTA - 1) / ROWS_CTA;
    int slot = 0;
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const long long r0 = tile * ROWS_CTA + warp * ROWS_W;
        const long long left = rows - r0;
        const int nrows = left <= 0 ? 0 : (left < ROWS_W ? (int)left : ROWS_W);
        fm_load_input(buf0, x, r0, nrows, lane);
        __syncwarp();
        fm_network<0>(s, w, fm_smem_addr(buf0), fm_smem_addr(buf1), slot, tile + gridDim.x < tiles, lane);
        __syncwarp();
        if (nrows > 0)
            fm_store_output(y, OUT_BUF ? buf1 : buf0, r0, nrows, lane);
        __syncwarp();
    }
#if !FM_RESIDENT
    fm_copy_wait<0>();  // leave no copy in flight at exit
#endif
}
