// fm_common.cuh - what both kernel templates share: types, PTX helpers, the Layer<l> descriptions and the
// input/output paths. Pasted in place of its #include when a template is read (python/fusedmlp/_api.py), so the
// rendered source is one self-contained file. The including template defines ROWS_W (rows per warp strip) first.

typedef unsigned short fm_half;  // IEEE binary16 or bfloat16 bits
typedef unsigned int fm_u32;
struct alignas(16) fm_v4 { fm_u32 x, y, z, w; };  // no CUDA headers: our own 16- and 8-byte vectors
struct alignas(8) fm_v2 { fm_u32 x, y; };

#define FM_BLOCKS_PER_SM {{BLOCKS_PER_SM}} // the plan's occupancy: caps registers at 64K / (threads * this)
#define FM_NUM_LAYERS {{NUM_LAYERS}}
#define FM_PREC {{PREC}}          // on-chip weights and activations: 0 fp16, 1 bf16, 2 tf32, 3 int8, 4 e4m3
#define FM_IN_TYPE {{IN_TYPE}}    // x in global memory: 0 float32, 1 float16, 2 bfloat16 (3: 8-bit codes, GEMMs)
#define FM_OUT_TYPE {{OUT_TYPE}}  // y in global memory: same codes

constexpr int THREADS = FM_WARPS * 32;
constexpr int ACT_STRIDE = {{ACT_STRIDE}};       // act_t elements per row of an activation buffer
constexpr int W_SMEM_ELEMS = {{W_SMEM_ELEMS}};   // weight region: whole blob (resident) or two slots (streamed)
constexpr int B_FLOATS = {{B_FLOATS}};           // all layers' padded biases
constexpr int SMEM_BYTES = {{SMEM_BYTES}};       // the dynamic shared memory the launch gives (the template checks)


#if FM_PREC == 2
typedef float act_t;
#elif FM_PREC >= 3
typedef unsigned char act_t;  // an 8-bit code (int8 or e4m3) of value / its layer input's scale (Layer<l>::QIN)
#else
typedef fm_half act_t;
#endif
#if FM_IN_TYPE == 0
typedef float in_t;
#elif FM_IN_TYPE == 3
typedef unsigned char in_t;  // an 8-bit network's codes (gemm_layer.cu only: a value between segments)
#else
typedef fm_half in_t;
#endif
#if FM_OUT_TYPE == 0
typedef float out_t;
#elif FM_OUT_TYPE == 3
typedef unsigned char out_t;
#else
typedef fm_half out_t;
#endif
constexpr int EB = (int)sizeof(act_t);                   // bytes per on-chip element
constexpr int ROW_B = ACT_STRIDE * EB;                   // bytes per activation buffer row
static_assert(ROW_B % 16 == 0, "activation rows must keep 16-byte alignment for ldmatrix");
static_assert((W_SMEM_ELEMS * EB) % 16 == 0 && B_FLOATS % 4 == 0, "regions must keep 16-byte alignment");

// ------------------------------------------------------------------------------------------------ PTX helpers

__device__ __forceinline__ float fm_h2f(fm_half h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float fm_bf2f(fm_half h) { return __uint_as_float((fm_u32)h << 16); }
// float of 16-bit storage bits of type T (1: float16, 2: bfloat16)
template <int T> __device__ __forceinline__ float fm_16_to_f(fm_half h) { return T == 2 ? fm_bf2f(h) : fm_h2f(h); }
// Two floats as 16-bit type T, lo in the low half.
template <int T> __device__ __forceinline__ fm_u32 fm_pack2(float lo, float hi) {
    fm_u32 r;
#if __CUDA_ARCH__ >= 800
    if constexpr (T == 2)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else  // one instruction instead of two conversions, a shift and an or
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else  // sm_75: float16 only (the plan refuses bfloat16 there)
    fm_half l, h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(l) : "f"(lo));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(hi));
    r = (fm_u32)l | ((fm_u32)h << 16);
#endif
    return r;
}
__device__ __forceinline__ fm_u32 fm_tf32(float f) {  // nearest TF32, as float32 bits (the mma's operand format)
    fm_u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
    return r;
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
__device__ __forceinline__ void fm_st_shared(fm_u32 addr, fm_u32 v) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void fm_st_shared(fm_u32 addr, fm_u32 lo, fm_u32 hi) {
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(addr), "r"(lo), "r"(hi) : "memory");
}
// The two 16-bit act_t halves of a 32-bit word (an mma fragment register), as floats, lo first.
__device__ __forceinline__ void fm_unpack2(fm_u32 r, float &v0, float &v1) {
    v0 = fm_16_to_f<FM_PREC + 1>((fm_half)(r & 0xffffu));
    v1 = fm_16_to_f<FM_PREC + 1>((fm_half)(r >> 16));
}
#if FM_PREC >= 3
// ------------------------------------------------------------------------------------------------ 8-bit codes
// What csrc/util.c's fm_quant8 / fm_dequant8 compute on the host (the CPU path emulates these, bit for bit): int8
// clamps with fmaxf/fminf (NaN meets fmaxf first: -127) and rounds to nearest even; e4m3 rounds to nearest even and
// saturates at +-448 (cvt.rn.satfinite, sm_89+).

// int8 without the conversion unit. FM_MAGIC = 1.5 * 2^23: between 2^23 and 2^24 a float's ulp is 1, so for |v| <=
// 2^22, FM_MAGIC + v rounds v to an integer k, to nearest even (FM_MAGIC is even, so k's parity is the sum's): the
// rounding cvt.rni makes. The sum's bits are FM_MAGIC's plus k, whose low byte is k's two's complement code. One
// FADD (FMA pipe) replaces a cvt.rni.s32.f32 (F2I, a conversion: 16 a clock per SM on sm_80/90 by the CUDA
// Programming Guide's throughput table), and a byte permute packs two codes (the F2I path needed masks and shifts).
constexpr float FM_MAGIC = 12582912.0f;
constexpr fm_u32 FM_MAGIC_BITS = 0x4b400000u;
__device__ __forceinline__ fm_u32 fm_prmt(fm_u32 a, fm_u32 b, fm_u32 sel) {
    fm_u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
// int8 codes of two floats clamped to [least, 127] (NaN meets fmaxf first: `least`), then rounded as cvt.rni
// (above); __fadd_rn is never contracted. lo in the low byte.
__device__ __forceinline__ unsigned short fm_quant2_s8(float lo, float hi, float least) {
    const float a = __fadd_rn(fminf(fmaxf(lo, least), 127.0f), FM_MAGIC);
    const float b = __fadd_rn(fminf(fmaxf(hi, least), 127.0f), FM_MAGIC);
    return (unsigned short)fm_prmt(__float_as_uint(a), __float_as_uint(b), 0x0040u);  // a's low byte, b's above it
}
// Two floats, already times the inverse scale, as two codes: lo in the low byte.
__device__ __forceinline__ unsigned short fm_quant2(float lo, float hi) {
#if FM_PREC == 3
    return fm_quant2_s8(lo, hi, -127.0f);
#else
    unsigned short r;  // the PTX ISA's cvt: operand a goes to the upper byte, b to the lower
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}
// fm_quant2 of relu(lo), relu(hi) (fm_plan.q_fold's relu layers): e4m3 in the one instruction (negatives to +0, NaN
// stays NaN: relu's float32 form's results, as codes); int8 in the clamp, at 0 instead of -127 (NaN meets fmaxf
// first: code 0, where relu's float32 form and the clamp give -127).
__device__ __forceinline__ unsigned short fm_quant2_relu(float lo, float hi) {
#if FM_PREC == 4
    unsigned short r;
    asm("cvt.rn.satfinite.relu.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return fm_quant2_s8(lo, hi, 0.0f);
#endif
}
// Four floats (times the inverse scale) as four codes, the first in the lowest byte.
__device__ __forceinline__ fm_u32 fm_quant4(float a, float b, float c, float d) {
    return (fm_u32)fm_quant2(a, b) | ((fm_u32)fm_quant2(c, d) << 16);
}
// The values of two codes (lo: the low byte), as floats; times the scale is the value they stand for.
__device__ __forceinline__ void fm_code2_to_f(unsigned short c2, float &v0, float &v1) {
#if FM_PREC == 3
    // Without the conversion unit (I2F.S8) either: code c ^ 0x80 is c + 128 in 0..255; placed in FM_MAGIC's low byte
    // (which is zero) it makes the float FM_MAGIC + c + 128, and subtracting FM_MAGIC + 128 leaves c, exactly.
    const fm_u32 u = (fm_u32)c2 ^ 0x8080u;
    v0 = __fsub_rn(__uint_as_float(fm_prmt(u, FM_MAGIC_BITS, 0x7650u)), FM_MAGIC + 128.0f);
    v1 = __fsub_rn(__uint_as_float(fm_prmt(u, FM_MAGIC_BITS, 0x7651u)), FM_MAGIC + 128.0f);
#else
    fm_u32 h2;  // e4m3 -> f16 is exact (f16 has more exponent and mantissa bits)
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(c2));
    v0 = fm_h2f((fm_half)(h2 & 0xffffu));
    v1 = fm_h2f((fm_half)(h2 >> 16));
#endif
}
__device__ __forceinline__ void fm_st_code2(fm_u32 addr, unsigned short c2) {
    asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(c2) : "memory");
}
#endif

// Two act_t elements at a shared address, as floats (a residual operand), and back (an epilogue result). 8-bit: the
// codes' values (the caller multiplies by the value's scale).
__device__ __forceinline__ void fm_ld_act2(fm_u32 addr, float &v0, float &v1) {
#if FM_PREC >= 3
    unsigned short c2;
    asm volatile("ld.shared.b16 %0, [%1];" : "=h"(c2) : "r"(addr) : "memory");
    fm_code2_to_f(c2, v0, v1);
#elif FM_PREC == 2
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v0), "=f"(v1) : "r"(addr) : "memory");
#else
    fm_u32 r;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(r) : "r"(addr) : "memory");
    fm_unpack2(r, v0, v1);
#endif
}
__device__ __forceinline__ void fm_st_act2(fm_u32 addr, float v0, float v1) {
#if FM_PREC >= 3  // v0, v1 already times the inverse scale
    fm_st_code2(addr, fm_quant2(v0, v1));
#elif FM_PREC == 2
    fm_st_shared(addr, fm_tf32(v0), fm_tf32(v1));
#else
    fm_st_shared(addr, fm_pack2<FM_PREC + 1>(v0, v1));
#endif
}
// Two out_t elements of the staged output.
__device__ __forceinline__ void fm_st_out2(fm_u32 addr, float v0, float v1) {
#if FM_OUT_TYPE == 0
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(v0), "f"(v1) : "memory");
#else
    fm_st_shared(addr, fm_pack2<FM_OUT_TYPE>(v0, v1));
#endif
}
// 16 bytes of registers to global memory at p (16-byte aligned) in one store. Assigning an fm_v4 built from registers
// compiled to four 4-byte STG.E (NVRTC 13, sm_90), each writing 8 of every 32-byte sector it touches (ncu on rec1024's
// GEMM, bench/results/h100-gemm-persistent/); a copy from memory (fm_store_output's) compiles to one STG.E.128.
// (No "memory" clobber: what it stores nothing in the kernel reads, and the clobber's fence on the compiler's
// scheduling cost the residual GEMMs 16 bytes of spills.)
__device__ __forceinline__ void fm_stg16(void *p, fm_v4 v) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
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
// Copies `elems` (a multiple of 16 bytes' worth) contiguous act_t from global to shared memory with the whole CTA.
__device__ __forceinline__ void fm_copy_block(act_t *dst, const act_t *src, int elems) {
    constexpr int E16 = 16 / EB;
    for (int i = threadIdx.x * E16; i < elems; i += THREADS * E16)
        fm_copy16(dst + i, src + i);
}

// Programmatic dependent launch (sm_90+). A chain's kernels after its first are launched as dependents of the one
// before them on the stream (csrc/cuda.c, fm_kernel_launch's `after`): a kernel's CTAs may start while the kernel
// before it still runs, so its launch and set-up hide under that kernel's last tiles. fm_grid_wait() returns once
// every earlier kernel has finished and its writes are visible (at once after a plain launch); every kernel calls it
// before it reads a value an earlier kernel wrote or writes memory an earlier kernel reads (a workspace slot is
// reused), and only weights, biases and shared memory are touched before it. fm_grid_release() (its CTA's first call
// counts) lets the next kernel's CTAs be scheduled once every CTA of this one has called it or exited; they then wait
// in their fm_grid_wait on SMs this kernel still runs on. Called late: a CTA's last tile, the GEMM's last stages.
// Released at the top, the waiting CTAs of rec1024's next GEMM shared the SMs from the start: its chain at 1024 rows
// ran 36.6 us against 29.3 launched plainly (H100, bench/results/h100-gemm-small/pdl_steps_top.txt).
__device__ __forceinline__ void fm_grid_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void fm_grid_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// One element of x as a float, and a float as act_t.
__device__ __forceinline__ float fm_in_to_f(in_t v) {
#if FM_IN_TYPE == 0
    return v;
#else
    return fm_16_to_f<FM_IN_TYPE>(v);
#endif
}
__device__ __forceinline__ act_t fm_f_to_act(float f) {
#if FM_PREC == 2
    return __uint_as_float(fm_tf32(f));
#else
    return (act_t)(fm_pack2<FM_PREC + 1>(f, 0.0f) & 0xffffu);
#endif
}
// x's 16-bit type is the on-chip one: the input is copied, not converted.
constexpr bool IN_RAW = FM_IN_TYPE != 0 && FM_PREC != 2 && FM_IN_TYPE == FM_PREC + 1;

// ------------------------------------------------------------------------------------------------ pair activations

// Layer<l>::PAIR = T (1 float16, 2 bfloat16) marks a layer whose activation has a pair form act2(x0, x1): two
// columns' results straight as the stored 16-bit pair, in fewer instructions than two act() and a cvt (render.c
// chooses it). Identity and relu are one cvt for both (cvt.rn.relu clamps as it rounds and keeps NaN, as torch.relu
// does): tcnn64's relu epilogue was FADD + FSETP + FSEL per element and a cvt per pair, which kept the ALU pipe 64%
// busy (ncu, H100), and the pair form took its kernel from 0.140 to 0.094 ms. (tanh.approx.f16x2 for float16 tanh
// was tried and dropped: ptxas splits it into two MUFU.TANH.F16, no faster than the float32 form (pinn50 0.212 vs
// 0.198 ms), and it evaluates tanh at the argument rounded to float16, 1.1x the rounding bound where the float32
// form is at 0.4x: results/h100/act16_probe.txt.)
template <int T> __device__ __forceinline__ fm_u32 fm_relu2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    fm_u32 r;
    if constexpr (T == 2)
        asm("cvt.rn.relu.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.relu.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return fm_pack2<T>(fm_relu(lo), fm_relu(hi));
#endif
}

// ------------------------------------------------------------------------------------------------ the layers

// Layer<l>: compile-time description of layer l, rendered from the plan.
//   K, KR: padded / real input width (elements); K0: padded width of the input's first part (K without a concat);
//   N, NR: padded / real output width; NC: output columns accumulated at once; BIAS: adds a bias;
//   W_OFF: first element of the layer in the weight blob (N rows of K + 16 bytes); B_OFF: first float of its bias;
//   REPEAT: how many layers from this one on (itself included) have its code, all but the offsets above;
//   A0_BUF, A1_BUF: activation buffers holding input columns [0, K0) and [K0, K) (-1: no second part);
//   OUT_BUF: where the output goes; RES (0 none, 1 add, 2 mul) and RES_BUF: the residual y = post(act(.) op r);
//   act, post: emitted from the checked expression ASTs;
//   NORM (0 none, 1 layernorm, 2 rmsnorm, 3 softmax, 4 log_softmax) and EPS: W h + b normalized over the row's NR
//   columns before act, with gamma and beta at B_OFF + N and B_OFF + 2 N of the bias blob (fm_norm_*, fm_soft_*,
//   below; a softmax has none);
//   8-bit plans only: DQ_OFF, the float blob's act_scale * w_scale[n] per column (accumulator -> W h); QIN and QOUT,
//   the inverse scales of the layer's input and output values (QOUT 0 for the last layer, stored unscaled); RSCALE,
//   the scale of the residual operand's value (its codes times this are its values); KPERM, QFOLD (the float8
//   register-A kernel's, fm_plan.k_perm and q_fold): its input codes arrive permuted within each 32 columns, and its
//   DQ and bias come times QOUT (1: no activation, 2: relu, left to the rounding).
template <int L> struct Layer;
{{LAYERS}}

constexpr int LAST = FM_NUM_LAYERS - 1;
constexpr int IN_REAL = {{X_FEATURES}};  // x's features (its columns in global memory)
constexpr int IN_PAD = Layer<0>::K;
// fm_plan.x_split: 3 where the input buffer holds x as [x_hi | x_lo | x_hi] (16-bit parts, x_lo = x - x_hi rounded)
// and the layers reading x store [W_hi | W_hi | W_lo] for those columns, so that their MMAs sum W x to about float32's
// rounding; else 1.
constexpr int X_PARTS = {{X_PARTS}};
// fm_spec's input encoding (ENC_COLS 0: none): the layers see ENC_COLS = Layer<0>::KR columns made from x's IN_REAL
// features as x is loaded (fm_load_input), column C x[Enc<C>::SRC] (SCALE x + PHASE where those are not 1 and 0) or,
// where Enc<C>::SIN, sin(SCALE x[SRC] + PHASE) in float32 (NeRF's positional encoding; cos z is sin(z + pi / 2)).
constexpr int ENC_COLS = {{ENC_COLS}};
template <int C> struct Enc;
{{ENCODING}}
// IN_COLS: the input buffer's columns written (the rest, to IN_PAD, stay zero).
constexpr int IN_COLS = ENC_COLS ? ENC_COLS : IN_REAL * X_PARTS;
static_assert(X_PARTS == 1 || (FM_PREC <= 1 && IN_COLS <= IN_PAD), "x splits in 16-bit plans, within its k step");
static_assert(ENC_COLS == 0 || X_PARTS == 1, "an encoded x is never split (fm_plan_x_splits)");
constexpr int OUT_REAL = Layer<LAST>::NR;
constexpr int OUT_PAD = Layer<LAST>::N;
// ------------------------------------------------------------------------------------------------ norms

// Whether layer L's norm subtracts the row mean: a layernorm, unless its weights and bias come centred (CENTRED,
// plan.c's fm_plan_pack: each weight column and the bias less its mean over the outputs), so that W h + b has a zero
// row mean for any h and its statistics are rmsnorm's, one reduction and no subtractions.
template <int L> __device__ constexpr bool fm_norm_mean() { return Layer<L>::NORM == 1 && !Layer<L>::CENTRED; }

// A layer with NORM normalizes each row of z = W h + b (bias included: the accumulators start at it) over its NR real
// columns before the activation, in float32: layernorm (z - mean) * rsqrt(var + eps) * gamma + beta with the
// variance about the mean (two passes over the registers, not E[z^2] - mean^2, which cancels where |mean| >> std),
// rmsnorm (and a centred layernorm, fm_norm_mean) z * rsqrt(mean(z^2) + eps) * gamma + beta. In both kernels'
// accumulator fragments (mma.sync's m16n8 tiles, wgmma's m64nN) a lane holds columns 8 j + 2 t, + 1 of rows g and
// g + 8, and the four lanes of a quad (t = 0..3) hold all of a row's columns: a row's sum is the lane's own, then two
// shuffles. v: the lane's NT 8-column tiles, columns c0 + 8 j + 2 t (+ 1) of row g + 8 hh at v[4 j + 2 hh] (+ 1).

__device__ __forceinline__ float fm_quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    return v;
}

// f(x, k) for each of this lane's values x of row hh (V: float, or const float where f only reads), at
// v[4 j + 2 hh + e], k = 8 j + e: its column is c0 + 2 t + k (f computes it where it needs it, after the value's
// own arithmetic, as the loops this walk replaced did: the same cubins, `probe same`). The norms' walk; the softmax
// helpers keep loops of their own, which through it ptxas scheduled differently (cls10's kernel: the same 2312
// instructions, 21 of them moved).
template <int NT, typename V, typename F>
__device__ __forceinline__ void fm_row_each(V *v, int hh, F f) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e)
            f(v[4 * j + 2 * hh + e], 8 * j + e);
    }
}

// This lane's part of row hh's sum over its real columns (d: subtracted first, squared when SQ), not yet over the
// quad. Padded columns hold zeros (zero weights and bias), but (0 - d)^2 does not vanish: they are masked.
template <int L, int NT, bool SQ>
__device__ __forceinline__ float fm_norm_part(const float *v, int c0, int t, int hh, float d) {
    float s = 0.0f;
    fm_row_each<NT>(v, hh, [&](float z, int k) {
        const float x = z - d;
        const float term = SQ ? x * x : x;
        if constexpr (Layer<L>::NR < Layer<L>::N)
            s += c0 + 2 * t + k < Layer<L>::NR ? term : 0.0f;
        else
            s += term;
    });
    return s;
}

// Row hh's normalized values in place: (v - mean) * rstd * gamma + beta, gamma and beta from the bias blob (bias: the
// blob's layer base, as the kernels pass it; zero in padded columns, so those stay zero).
template <int L, int NT>
__device__ __forceinline__ void fm_norm_apply(float *v, int c0, int t, int hh, float mean, float rstd,
                                              const float *bias) {
    typedef Layer<L> Ly;
    fm_row_each<NT>(v, hh, [&](float &x, int k) {
        const int col = c0 + 2 * t + k;
        x = (fm_norm_mean<L>() ? x - mean : x) * rstd * bias[Ly::B_OFF + Ly::N + col] +
            bias[Ly::B_OFF + 2 * Ly::N + col];
    });
}

// NORM 3 (softmax) and 4 (log_softmax): a row's statistics are its max m and s = sum exp(z - m) over its real
// columns; the value is exp(z - m) / s, or z - m - log s. Partial statistics of column sets (a multi-chunk layer's
// chunks, a cluster's CTAs) combine as m = max m_i, s = sum s_i exp(m_i - m); a set with no real column is
// (-inf, 0), which adds nothing. exp and log are the special-function unit's (ex2.approx, lg2.approx): relative errors
// near 2^-21, far under the 16-bit results' rounding and tf32's bound.
template <int L> __device__ constexpr bool fm_norm_soft() { return Layer<L>::NORM >= 3; }

__device__ __forceinline__ float fm_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// This lane's max of row hh over its real columns (-inf where it holds none), not yet over the quad.
template <int L, int NT> __device__ __forceinline__ float fm_soft_max_part(const float *v, int c0, int t, int hh) {
    float m = __int_as_float(0xff800000);  // -inf
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
            if (Layer<L>::NR == Layer<L>::N || c0 + 8 * j + 2 * t + e < Layer<L>::NR)
                m = fmaxf(m, v[4 * j + 2 * hh + e]);
    return m;
}

// This lane's part of row hh's sum of exp(z - m) over its real columns, not yet over the quad; EXP: v becomes
// exp(v - m) (a softmax's numerators, so that the apply is one multiply; V float then, else const float too).
template <int L, int NT, bool EXP, typename V>
__device__ __forceinline__ float fm_soft_sum_part(V *v, int c0, int t, int hh, float m) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            V &x = v[4 * j + 2 * hh + e];
            const float ex = __expf(x - m);
            if (Layer<L>::NR == Layer<L>::N || c0 + 8 * j + 2 * t + e < Layer<L>::NR)
                s += ex;
            if constexpr (EXP)
                x = ex;
        }
    }
    return s;
}

// Row hh's softmax (log_softmax) values in place from the row's m and s; EXPED: v already holds exp(z - m_own),
// m_own this lane's own max (a cluster CTA's partial), so that the value is v * exp(m_own - m) / s. Padded columns
// become zero.
template <int L, int NT, bool EXPED>
__device__ __forceinline__ void fm_soft_apply(float *v, int c0, int t, int hh, float m, float s, float m_own) {
    const float scale = EXPED ? __expf(m_own - m) / s : 1.0f / s, shift = m + __logf(s);
    typedef Layer<L> Ly;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int col = c0 + 8 * j + 2 * t + e;
            float &x = v[4 * j + 2 * hh + e];
            const float y = Ly::NORM == 4 ? x - shift : (EXPED ? x : __expf(x - m)) * scale;
            x = Ly::NR == Ly::N || col < Ly::NR ? y : 0.0f;
        }
    }
}

// Layer L's norm of this lane's rows where its quad holds every column of them (all but a cluster's split layers).
template <int L, int NT>
__device__ __forceinline__ void fm_norm_tiles(float *v, int c0, int t, const float *bias) {
    typedef Layer<L> Ly;
    if constexpr (fm_norm_soft<L>()) {
        constexpr bool EXP = Ly::NORM == 3;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float m = fm_quad_max(fm_soft_max_part<L, NT>(v, c0, t, hh));
            const float s = fm_quad_sum(fm_soft_sum_part<L, NT, EXP>(v, c0, t, hh, m));
            fm_soft_apply<L, NT, EXP>(v, c0, t, hh, m, s, m);
        }
    } else if constexpr (Ly::NORM != 0) {
        constexpr float INV_N = 1.0f / (float)Ly::NR;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float mean =
                fm_norm_mean<L>() ? fm_quad_sum(fm_norm_part<L, NT, false>(v, c0, t, hh, 0.0f)) * INV_N : 0.0f;
            const float var = fm_quad_sum(fm_norm_part<L, NT, true>(v, c0, t, hh, mean)) * INV_N;
            fm_norm_apply<L, NT>(v, c0, t, hh, mean, rsqrtf(var + Ly::EPS), bias);
        }
    }
}

// ------------------------------------------------------------------------------------------------ the epilogue

// Layer L's epilogue for columns col, col + 1 of one row. v0, v1: the accumulators on entry (both kernels start
// them at the bias, so there is no bias to add here: that was two FADDs per pair, and the bias values' registers
// were live across the MMA), post(act(.) op r) on return, with r0, r1 the residual operand (read only when Ly::RES),
// zero in padded columns.
// FAST (the warpgroup kernels' hidden layers): through act_t, noting in far where its result needs act's instead.
template <int L, bool FAST = false>
__device__ __forceinline__ void fm_epilogue(float &v0, float &v1, float r0, float r1, int col, bool &far) {
    typedef Layer<L> Ly;
    if constexpr (FAST) {
        v0 = Ly::act_t(v0, col, far);
        v1 = Ly::act_t(v1, col + 1, far);
    } else {
        v0 = Ly::act(v0, col);
        v1 = Ly::act(v1, col + 1);
    }
    if constexpr (Ly::RES != 0) {
        v0 = Ly::post(Ly::RES == 1 ? v0 + r0 : v0 * r0);
        v1 = Ly::post(Ly::RES == 1 ? v1 + r1 : v1 * r1);
    }
    if constexpr (Ly::NR < Ly::N) {  // only layers with padded columns pay for the mask
        if (col >= Ly::NR) v0 = 0.0f;
        if (col + 1 >= Ly::NR) v1 = 0.0f;
    }
}
template <int L> __device__ __forceinline__ void fm_epilogue(float &v0, float &v1, float r0, float r1, int col) {
    bool far = false;
    fm_epilogue<L, false>(v0, v1, r0, r1, col, far);
}
// The same as the stored pair of 16-bit type T (lo: col), through the layer's pair form where it has one.
template <int L, int T, bool FAST = false>
__device__ __forceinline__ fm_u32 fm_epilogue16(float v0, float v1, float r0, float r1, int col, bool &far) {
    typedef Layer<L> Ly;
    if constexpr (Ly::PAIR == T && Ly::RES == 0) {
        fm_u32 w = Ly::act2(v0, v1);
        if constexpr (Ly::NR < Ly::N)
            w = col + 1 < Ly::NR ? w : (col < Ly::NR ? (w & 0xffffu) : 0u);
        return w;
    } else {
        fm_epilogue<L, FAST>(v0, v1, r0, r1, col, far);
        return fm_pack2<T>(v0, v1);
    }
}
template <int L, int T>
__device__ __forceinline__ fm_u32 fm_epilogue16(float v0, float v1, float r0, float r1, int col) {
    bool far = false;
    return fm_epilogue16<L, T, false>(v0, v1, r0, r1, col, far);
}

// ------------------------------------------------------------------------------------------------ input, output

// Stores NW 32-bit words at a shared address aligned to 4 * NW bytes (NW = 1, 2, 4 or 8).
template <int NW> __device__ __forceinline__ void fm_st_words(act_t *dst, const fm_u32 (&w)[NW]) {
    if constexpr (NW == 1) {  // 8-bit codes of four float32 elements
        *(fm_u32 *)dst = w[0];
    } else if constexpr (NW == 2) {
        *(fm_v2 *)dst = fm_v2{w[0], w[1]};
    } else {
#pragma unroll
        for (int i = 0; i < NW; i += 4)
            *(fm_v4 *)((char *)dst + 4 * i) = fm_v4{w[i], w[i + 1], w[i + 2], w[i + 3]};
    }
}

// Zeros the input buffer's padding columns [IN_COLS, IN_PAD) of the warp's first R rows: they meet zero weights, but
// must not hold NaN or Inf.
template <int R = ROWS_W> __device__ __forceinline__ void fm_zero_pad_columns(act_t *buf, int lane) {
    if constexpr (IN_PAD > IN_COLS) {
        constexpr int PADC = IN_PAD - IN_COLS > 0 ? IN_PAD - IN_COLS : 1;  // (NVRTC warns on a zero divisor)
        for (int i = lane; i < R * PADC; i += 32)
            buf[(i / PADC) * ACT_STRIDE + IN_COLS + i % PADC] = (act_t)0;
    }
}

// Column C of the input encoding, and C + H (where below ENC_COLS) in the lanes of `hi`, for the row whose features
// are v (float32), into `at` (the row's start in the input buffer), then the columns after them.
constexpr int ENC_X = ENC_COLS ? IN_REAL : 1;  // x's features a lane holds while it encodes a row (1: unused)

// An x column of the encoding (not a sine): x itself, or SCALE x + PHASE where the encoding scales it (NeuS's
// inputs * scale before its embedder).
template <int C> __device__ __forceinline__ float fm_enc_x(float xv) {
    if constexpr (Enc<C>::SCALE == 1.0f && Enc<C>::PHASE == 0.0f)
        return xv;
    else
        return fmaf(Enc<C>::SCALE, xv, Enc<C>::PHASE);
}
// Column C of the encoding of the row whose features are v (the pad pass's; the loader selects a lane's column first).
template <int C> __device__ __forceinline__ float fm_enc_value(const float (&v)[ENC_X]) {
    typedef Enc<C> E;
    return E::SIN ? fm_sin(fmaf(E::SCALE, v[E::SRC], E::PHASE)) : fm_enc_x<C>(v[E::SRC]);
}

template <int C, int H>
__device__ __forceinline__ void fm_encode_cols(act_t *at, const float (&v)[ENC_X], bool hi) {
    if constexpr (C < H) {
        constexpr int D = C + H < ENC_COLS ? C + H : C;  // (the hi lanes' column; C itself where there is none)
        if (!hi || C + H < ENC_COLS) {
            const float xv = hi ? v[Enc<D>::SRC] : v[Enc<C>::SRC];
            const bool sine = hi ? Enc<D>::SIN : Enc<C>::SIN;
            const float f = sine ? fm_sin(fmaf(hi ? Enc<D>::SCALE : Enc<C>::SCALE, xv,
                                               hi ? Enc<D>::PHASE : Enc<C>::PHASE))
                                 : (hi ? fm_enc_x<D>(xv) : fm_enc_x<C>(xv));
#if FM_PREC >= 3  // the value's code with layer 0's input scale
            at[hi ? D : C] = (act_t)(fm_quant2(f * Layer<0>::QIN, 0.0f) & 0xffu);
#else
            at[hi ? D : C] = fm_f_to_act(f);
#endif
        }
        fm_encode_cols<C + 1, H>(at, v, hi);
    }
}

// The input encoding of this warp's strip of x (rows [r0, r0 + nrows) of its ROWS_W) into `buf`: lane l takes the
// rows l % 16 + 16 i, the low half of the lanes the first half of each row's columns and the high half the rest;
// rows past nrows are zeros.
__device__ __forceinline__ void fm_encode_input(act_t *buf, const in_t *__restrict__ x, long long r0, int nrows,
                                                int lane) {
    for (int row = lane & 15; row < ROWS_W; row += 16) {
        act_t *at = buf + row * ACT_STRIDE;
        if (row < nrows) {
            float v[ENC_X];
#pragma unroll
            for (int i = 0; i < ENC_X; ++i)
                v[i] = fm_in_to_f(x[(r0 + row) * IN_REAL + i]);
            fm_encode_cols<0, (ENC_COLS + 1) / 2>(at, v, lane >= 16);
        } else {
            for (int c = lane >> 4; c < ENC_COLS; c += 2)
                at[c] = (act_t)0;
        }
    }
}

// Loads this warp's strip of x (rows [r0, r0 + nrows)) into `buf` as act_t, zero-filling padded rows and (unless
// PAD_ZERO is false: a buffer whose padding columns nothing else writes) columns. x may be a shared-memory copy.
template <bool PAD_ZERO = true>
__device__ __forceinline__ void fm_load_input(act_t *buf, const in_t *__restrict__ x, long long r0, int nrows,
                                              int lane) {
    constexpr int VEC = 16 / (int)sizeof(in_t);  // elements per 16-byte load
    constexpr int NW = VEC * EB / 4;              // 32-bit words they become on chip
    if constexpr (ENC_COLS > 0) {
        fm_encode_input(buf, x, r0, nrows, lane);
    } else if constexpr (IN_REAL % VEC == 0 && X_PARTS == 1) {  // every row starts 16-byte aligned: vector loads
        constexpr int CHUNKS = IN_REAL >= VEC ? IN_REAL / VEC : 1;  // (NVRTC warns on a zero divisor)
        for (int i = lane; i < ROWS_W * CHUNKS; i += 32) {
            const int row = i / CHUNKS, c = (i % CHUNKS) * VEC;
            fm_u32 words[NW];
            if (row < nrows) {
                fm_v4 raw = *(const fm_v4 *)(x + (r0 + row) * IN_REAL + c);
                if constexpr (IN_RAW) {
                    const fm_u32 *u = (const fm_u32 *)&raw;
#pragma unroll
                    for (int j = 0; j < NW; ++j)
                        words[j] = u[j];
                } else {
                    const in_t *e = (const in_t *)&raw;
#if FM_PREC >= 3  // x's codes with layer 0's input scale
                    constexpr float Q = Layer<0>::QIN;
#pragma unroll
                    for (int j = 0; j < VEC; j += 4)
                        words[j / 4] = fm_quant4(fm_in_to_f(e[j]) * Q, fm_in_to_f(e[j + 1]) * Q,
                                                 fm_in_to_f(e[j + 2]) * Q, fm_in_to_f(e[j + 3]) * Q);
#else
#pragma unroll
                    for (int j = 0; j < VEC; j += 2) {
#if FM_PREC == 2
                        words[j] = fm_tf32(fm_in_to_f(e[j]));
                        words[j + 1] = fm_tf32(fm_in_to_f(e[j + 1]));
#else
                        words[j / 2] = fm_pack2<FM_PREC + 1>(fm_in_to_f(e[j]), fm_in_to_f(e[j + 1]));
#endif
                    }
#endif
                }
            } else {
#pragma unroll
                for (int j = 0; j < NW; ++j)
                    words[j] = 0u;
            }
            fm_st_words<NW>(buf + row * ACT_STRIDE + c, words);
        }
    } else {  // odd row widths, or x in parts (at most 5 features): a contiguous, coalesced element walk
        const long long base = r0 * IN_REAL;
        const int count = nrows * IN_REAL;
        for (int e = lane; e < ROWS_W * IN_REAL; e += 32) {
            const int row = e / IN_REAL, col = e % IN_REAL;
            act_t v = (act_t)0, lo = (act_t)0;
#if FM_PREC <= 1
            if constexpr (X_PARTS == 3) {  // x_lo: the rounding of what x_hi left (f - x_hi is exact in float32)
                const float f = e < count ? fm_in_to_f(x[base + e]) : 0.0f;
                v = fm_f_to_act(f);
                lo = fm_f_to_act(f - fm_16_to_f<FM_PREC + 1>(v));
            } else
#endif
            if (e < count) {
#if FM_PREC >= 3
                v = (act_t)(fm_quant2(fm_in_to_f(x[base + e]) * Layer<0>::QIN, 0.0f) & 0xffu);
#else
                if constexpr (IN_RAW)
                    v = x[base + e];
                else
                    v = fm_f_to_act(fm_in_to_f(x[base + e]));
#endif
            }
            act_t *at = buf + row * ACT_STRIDE + col;
            at[0] = v;
            if constexpr (X_PARTS == 3) {  // [x_hi | x_lo | x_hi]
                at[IN_REAL] = lo;
                at[2 * IN_REAL] = v;
            }
        }
    }
    if constexpr (PAD_ZERO)
        fm_zero_pad_columns(buf, lane);
}

// Writes columns [c0, c0 + W) of y in this warp's nrows staged rows from r0 on (rows of STRIDE out_t; stage column 0
// holds y's column c0) to y: in 16-byte pieces where every row's piece is whole and aligned (y's rows and W in whole
// pieces; c0 is a multiple of 16 columns), else element by element. Whole rows (W = OUT_REAL, c0 = 0) in both kernels;
// a split last layer's share in the cluster kernel.
template <int W, int STRIDE>
__device__ __forceinline__ void fm_store_output(out_t *__restrict__ y, const act_t *buf, long long r0, int nrows,
                                                int c0, int lane) {
    const out_t *stage = (const out_t *)buf;
    constexpr int VEC = 16 / (int)sizeof(out_t);
    if constexpr (W > 0 && OUT_REAL % VEC == 0 && W % VEC == 0) {
        constexpr int CHUNKS = W / VEC;
        for (int i = lane; i < nrows * CHUNKS; i += 32) {
            const int row = i / CHUNKS, c = (i % CHUNKS) * VEC;
            *(fm_v4 *)(y + (r0 + row) * OUT_REAL + c0 + c) = *(const fm_v4 *)(stage + row * STRIDE + c);
        }
    } else if constexpr (W == OUT_REAL) {  // whole rows: one run of y
        const long long base = r0 * OUT_REAL;
        for (int e = lane; e < nrows * W; e += 32)
            y[base + e] = stage[(e / W) * STRIDE + e % W];
    } else if constexpr (W > 0) {
        for (int e = lane; e < nrows * W; e += 32)
            y[(r0 + e / W) * OUT_REAL + c0 + e % W] = stage[(e / W) * STRIDE + e % W];
    }
}

