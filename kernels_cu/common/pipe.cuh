// cp.async staging for the pipelined norm backwards (rms_norm.cu, layer_norm.cu).
//
// Unlike common/mma.cuh's helpers these carry a "memory" clobber: the pipelined kernels read a stage right after
// the wait with no __syncthreads in between (each thread reads only what it copied), so the compiler must not
// move those shared-memory loads above the wait, nor a stage's last reads below the copies that refill it.
// The stage count is a kernel argument (2..4 row groups in flight a block), so the wait takes it at run time.
#pragma once

__device__ __forceinline__ void cpa16(void* dst, const void* src) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(src) : "memory");
}
__device__ __forceinline__ void cpa_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cpa_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// Waits until at most n (0..3) committed groups are pending.
__device__ __forceinline__ void cpa_wait_n(int n) {
  if (n <= 0) cpa_wait<0>();
  else if (n == 1) cpa_wait<1>();
  else if (n == 2) cpa_wait<2>();
  else cpa_wait<3>();
}

// Hints that this thread's VPT packs of E elements of a weight row (packs threadIdx.x + k * blockDim.x) be brought
// into the SM's L1: every row group reads them, and the first touch then overlaps the first stage's DRAM latency
// instead of following it.
template <int VPT, int E, typename W> __device__ __forceinline__ void prefetch_row_l1(const W* w, int units) {
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int u = threadIdx.x + k * blockDim.x;
    if (u < units) asm volatile("prefetch.global.L1 [%0];" ::"l"(w + u * E));
  }
}

// The stage after s in a ring of n (a running index: a 64-bit i % n is a division, twice a row group).
__device__ __forceinline__ int ring_next(int s, int n) { return s + 1 == n ? 0 : s + 1; }
