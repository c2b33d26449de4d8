// D += A * B with fp32 accumulate: A 16 x 32 bytes of k (row-major), B 32 bytes of k x 8 (column-major), i.e. one
// m16n8k16 for fp16/bf16, one m16n8k8 for tf32 and one m16n8k32 for 8-bit codes; the fragments are what
// fm_ldmatrix_x4 returns for all: the PTX ISA's m16n8k32 .s8/.e4m3 A and B fragments hold the same bytes per lane
// as m16n8k16's halves (a0: row g, bytes 4t..4t+3; a1: row g + 8; a2, a3: bytes 16 on; b0, b1 likewise down k), and
// its accumulators the same (row, column) pairs. int8 accumulates in s32: c holds the integers' bits until the
// epilogue converts them (fm_acc_value), exact below 2^24 (127 * 127 * K for K <= 1040); or, for layers whose sums
// stay below 2^22, c starts at FM_MAGIC's bits and one FADD converts it (fused_mlp.cu, fm_acc_magic).
__device__ __forceinline__ void fm_mma(float c[4], const fm_u32 a[4], fm_u32 b0, fm_u32 b1) {
#if FM_PREC == 3
    int d0 = __float_as_int(c[0]), d1 = __float_as_int(c[1]), d2 = __float_as_int(c[2]), d3 = __float_as_int(c[3]);
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(d0), "+r"(d1), "+r"(d2), "+r"(d3)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    c[0] = __int_as_float(d0), c[1] = __int_as_float(d1), c[2] = __int_as_float(d2), c[3] = __int_as_float(d3);
#elif FM_PREC == 4
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif FM_PREC == 2
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif FM_PREC == 1
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif __CUDA_ARCH__ >= 800
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

#if FM_PREC >= 3
// An accumulator as a float: int8's s32 bits converted (exact, see fm_mma), e4m3's float32 as it is.
__device__ __forceinline__ float fm_acc_value(float c) {
#if FM_PREC == 3
    return (float)__float_as_int(c);
#else
    return c;
#endif
}
#endif
