// Tensor-core attention building blocks shared by attention.cu (training) and decode_attention.cu (decoding):
// cp.async copies (src-size 0 zero-fills the 16 destination bytes and reads nothing), ldmatrix loads, the
// m16n8k16 bf16 -> fp32 mma.sync, bf16 packing, one-MUFU exp2, and the Q K^T / P V fragment loops.
#pragma once
#include "vec.cuh"

namespace {

// A [rows x D] bf16 tile in shared memory, rows padded to D + 8 elements: 8 consecutive rows start in 8
// different bank groups, so ldmatrix reads them without conflicts.
template <int D> struct Tile {
  static constexpr int LD = D + 8;
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
// The cp.async helpers carry a "memory" clobber, as common/pipe.cuh's do: without it the compiler may move a
// thread's own shared-memory loads above the wait (gemv's per-lane ring reads its stage right after the wait, with
// no __syncthreads between them; session 15's audit).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  // src-size 0 zero-fills the 16 destination bytes (rows past the sequence end).
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
// c += a (16x16, row) * b (16x8, col), bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// A-operand fragments of a warp's 16 rows (starting at row m0 of a shared tile) for all D / 16 k-steps.
template <int D>
__device__ __forceinline__ void load_a_frags(unsigned (&f)[D / 16][4], const bf16* t, int m0) {
  const int l = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    ldsm_x4(f[kk], t + (m0 + (l & 7) + ((l >> 3) & 1) * 8) * Tile<D>::LD + kk * 16 + (l >> 4) * 8);
}
// acc[16 x N] += A (16 x K, registers) * X^T where X is a shared [N x K] tile (rows n0.., k-columns from 0):
// the "B = X^T" product (S = Q K^T, dP = dO V^T ...). N multiple of 16.
template <int K, int N, int LD>
__device__ __forceinline__ void mma_abt(float (&acc)[N / 8][4], const unsigned (&a)[K / 16][4], const bf16* x) {
  const int l = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
#pragma unroll
    for (int nn = 0; nn < N / 16; ++nn) {
      unsigned b[4];
      ldsm_x4(b, x + (nn * 16 + (l & 7) + (l >> 4) * 8) * LD + kk * 16 + ((l >> 3) & 1) * 8);
      mma(acc[2 * nn], a[kk], b[0], b[1]);
      mma(acc[2 * nn + 1], a[kk], b[2], b[3]);
    }
  }
}
// acc[16 x N] += P (16 x K, fp32 accumulators re-packed to bf16 A fragments) * X where X is a shared [K x N]
// tile (rows = the reduction index: keys for P V, queries for P^T dO ...).
template <int K, int N, int LD>
__device__ __forceinline__ void mma_pb(float (&acc)[N / 8][4], const float (&p)[K / 8][4], const bf16* x) {
  const int l = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    unsigned a[4];
    a[0] = pack_bf16(p[2 * kk][0], p[2 * kk][1]);
    a[1] = pack_bf16(p[2 * kk][2], p[2 * kk][3]);
    a[2] = pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    a[3] = pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3]);
#pragma unroll
    for (int nn = 0; nn < N / 16; ++nn) {
      unsigned b[4];
      ldsm_x4_t(b, x + (kk * 16 + (l & 7) + ((l >> 3) & 1) * 8) * LD + nn * 16 + (l >> 4) * 8);
      mma(acc[2 * nn], a, b[0], b[1]);
      mma(acc[2 * nn + 1], a, b[2], b[3]);
    }
  }
}
// 2^x in one MUFU.EX2 (flush-to-zero: exponents below -126 give 0, which is what a probability that small
// rounds to in bf16 anyway). exp2f without fast-math adds a denormal-range fix-up around the same instruction;
// at head_dim 64 one exp per (query, key) pair costs as much issue time as the two tile products.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
template <int N> __device__ __forceinline__ void zero(float (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) a[i][0] = a[i][1] = a[i][2] = a[i][3] = 0.f;
}

// One step of the online softmax over a warp's tile of scores s (raw q.k; two rows per thread, m/l in log2
// units): the running max and sum of both rows are updated, s becomes p = 2^(s * sl2 - max) (ready for the P V
// product) and the accumulators are rescaled by 2^(old max - new max). Shared by the training forward and the
// decode kernel.
// acc rows g and g + 8 of the thread times cr0 and cr1 (the online softmax's rescale of the running output).
template <int N> __device__ __forceinline__ void rescale_rows(float (&acc)[N][4], float cr0, float cr1) {
#pragma unroll
  for (int nt = 0; nt < N; ++nt) {
    acc[nt][0] *= cr0;
    acc[nt][1] *= cr0;
    acc[nt][2] *= cr1;
    acc[nt][3] *= cr1;
  }
}

template <int BN, int D>
__device__ __forceinline__ void online_softmax_step(float (&s)[BN / 8][4], float (&acc)[D / 8][4], float& m0,
                                                    float& m1, float& l0, float& l1, float sl2) {
  float mx0 = -CK_INF, mx1 = -CK_INF;  // raw scores: scale > 0, so max(s) * sl2 = max(s * sl2)
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt) {
    mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
    mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float mn0 = fmaxf(m0, mx0 * sl2), mn1 = fmaxf(m1, mx1 * sl2);
  // A row with nothing visible yet keeps max -inf: subtract 0 instead (exp2(-inf) = 0, no NaN).
  const float base0 = mn0 == -CK_INF ? 0.f : mn0, base1 = mn1 == -CK_INF ? 0.f : mn1;
  const float cr0 = ex2(m0 - base0), cr1 = ex2(m1 - base1);
  m0 = mn0;
  m1 = mn1;
  float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt) {  // p = 2^(s * scale * log2(e) - max): one FMA + one MUFU
    s[nt][0] = ex2(fmaf(s[nt][0], sl2, -base0));
    s[nt][1] = ex2(fmaf(s[nt][1], sl2, -base0));
    s[nt][2] = ex2(fmaf(s[nt][2], sl2, -base1));
    s[nt][3] = ex2(fmaf(s[nt][3], sl2, -base1));
    ps0 += s[nt][0] + s[nt][1];
    ps1 += s[nt][2] + s[nt][3];
  }
  l0 = l0 * cr0 + ps0;
  l1 = l1 * cr1 + ps1;
  rescale_rows(acc, cr0, cr1);
}

}  // namespace
