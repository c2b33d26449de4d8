// fm_cluster.cuh - thread-block clusters and mbarriers (sm_90): the cluster kernel's exchange (fused_mlp_sm90.cu)
// and the GEMM's clusters of two (gemm_layer.cu, FM_GEMM_CLUSTER) use these.

__device__ __forceinline__ fm_u32 fm_cluster_rank() {
    fm_u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ fm_u32 fm_cluster_id() {
    fm_u32 r;
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
    return r;
}
__device__ __forceinline__ fm_u32 fm_cluster_count() {
    fm_u32 r;
    asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
    return r;
}
// The address of the same shared-memory byte in CTA `rank` of the cluster.
__device__ __forceinline__ fm_u32 fm_mapa(fm_u32 addr, fm_u32 rank) {
    fm_u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ void fm_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void fm_mbar_init(fm_u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// (This, fm_mbar_arrive_cluster and fm_bulk_to_peer act only where `on` is not zero, by a predicate rather than a
// branch: see fm_cl_send.)
__device__ __forceinline__ void fm_mbar_expect(fm_u32 on, fm_u32 bar, fm_u32 bytes) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %0, 0;\n"
                 "@p mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%1], %2;\n}" ::"r"(on), "r"(bar),
                 "r"(bytes)
                 : "memory");
}
// The exchange's arrivals and waits are CTA-scoped (release.cta, acquire.cta: the defaults), as CUTLASS's cluster
// pipelines are: what they order is async-proxy traffic (wgmma reads finished by wgmma.wait_group, bulk copies that
// complete_tx on the barrier), not generic loads. Cluster scope cost a CCTL.IVALL (an L1 invalidation) after every
// wait and MEMBAR.ALL.GPU before every remote arrival: 14% and 3% of siren256's stall samples (ncu, H100).
__device__ __forceinline__ void fm_mbar_arrive_cluster(fm_u32 on, fm_u32 bar_cluster) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %0, 0;\n@p mbarrier.arrive.shared::cluster.b64 _, [%1];\n}" ::"r"(on),
                 "r"(bar_cluster)
                 : "memory");
}
__device__ __forceinline__ fm_u32 fm_mbar_try_wait(fm_u32 bar, fm_u32 parity) {
    fm_u32 done;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
    return done;
}
// An exchange's waits last microseconds. One past FM_WAIT_LIMIT_CYCLES (2^37: 70-120 s at the H100's clocks) means
// the protocol is broken (session 9's cluster deadlock hung its callers for good). The waiting thread then stores to
// address 0, so the kernel ends and the call fails with the driver's CUDA_ERROR_ILLEGAL_ADDRESS instead of never
// returning. Not __trap(): an exit on a divergent path makes ptxas serialize every wgmma of the kernel (its C7518;
// siren256 +22%), and a predicated store is no exit. The SM's cycle counter is read only once a try has failed.
#ifndef FM_WAIT_LIMIT_CYCLES
#define FM_WAIT_LIMIT_CYCLES (1ll << 37)
#endif
__device__ __forceinline__ void fm_mbar_wait(fm_u32 bar, fm_u32 parity) {
    if (fm_mbar_try_wait(bar, parity))
        return;
    const long long start = clock64();
    while (!fm_mbar_try_wait(bar, parity))
        asm volatile("{\n.reg .pred p;\nsetp.gt.s64 p, %0, %1;\n@p st.global.u32 [%2], 0;\n}" ::"l"(clock64() - start),
                     "l"(FM_WAIT_LIMIT_CYCLES), "l"(0ull)
                     : "memory");
}
// Copies `bytes` of this CTA's shared memory at src to dst in another CTA (a shared::cluster address), completing
// `bytes` of the transaction count of the mbarrier bar there.
__device__ __forceinline__ void fm_bulk_to_peer(fm_u32 on, fm_u32 dst, fm_u32 src, fm_u32 bytes, fm_u32 bar) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %0, 0;\n"
                 "@p cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%1], [%2], %3, [%4];\n}"
                 ::"r"(on), "r"(dst), "r"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// Copies `bytes` of global memory at src to the same offset `dst` of the shared memory of every CTA of the cluster
// in `mask` (bit r: CTA r), completing `bytes` of the transaction count of the mbarrier at offset `bar` in each.
// (One bulk copy, the TMA unit's; src, dst and bytes multiples of 16.)
__device__ __forceinline__ void fm_bulk_multicast(fm_u32 dst, const void *src, fm_u32 bytes, fm_u32 bar,
                                                  unsigned short mask) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
                 "[%0], [%1], %2, [%3], %4;" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "h"(mask)
                 : "memory");
}
// Copies `bytes` of global memory at src to this CTA's shared memory at dst (one bulk copy, the TMA unit's; src, dst
// and bytes multiples of 16), completing `bytes` of the transaction count of the mbarrier at `bar`.
__device__ __forceinline__ void fm_bulk_g2s(fm_u32 dst, const void *src, fm_u32 bytes, fm_u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// One arrival on a barrier of this CTA, once this thread's earlier cp.async copies have landed (.noinc: the arrival
// is one of the barrier's expected count, not an extra one).
__device__ __forceinline__ void fm_mbar_arrive_copies(fm_u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// One arrival on a barrier of this CTA, now (release: this thread's earlier shared-memory stores come with it).
__device__ __forceinline__ void fm_mbar_arrive(fm_u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
