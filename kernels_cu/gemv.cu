// Decode GEMV with a fused prologue (RMSNorm / LayerNorm of x) and epilogue (bias, SwiGLU / GELU, residual add):
//
//   xn[b, :]  = x[b, :]                                                      (norm = none)
//             = round_T(x * r * nw),          r = 1 / sqrt(mean(x^2) + eps)  (rms: ck.rms_norm's formula)
//             = round_T((x - mu) * r * nw + nb), r = 1 / sqrt(var + eps)     (layer: ck.layer_norm's formula)
//   y[b, n]   = sum_k xn[b, k] * W[n, k]                                     (fp32 accumulation)
//   y         = rmid(rmid(y) + bias[n])                                      (bias: matmul, then ck.add)
//   a         = y | rmid(silu(y[:, j]) * y[:, N/2 + j]) | rmid(gelu(y))      (act)
//   out[b, j] = round_O(residual[b, j] + a[b, j])  or  round_O(a[b, j])
//
// rmid() rounds to bf16 when x and out are both bf16, else it is the identity: the unfused composition is
// ck.matmul(xn, W^T) whose output dtype is out's (bf16 inputs) or fp32 (fp32 inputs, or the LM head's bf16 x
// with fp32 logits: cuBLAS accumulates and stores fp32), then ck.add / ck.swiglu_packed / ck.gelu / ck.add,
// each computing in fp32 and rounding once to that dtype. Rounding y at the same points makes the fused and
// the unfused paths agree to the last bit wherever the fp32 dot product itself agrees (only the summation
// order differs), instead of the fused path being "more exact" and so different by 1 bf16 ulp at random.
//
// Design (LLaMA-1B decode on an H200: K = 2048 / 8192, N = 2048 .. 128256, B = 1 .. 8; copy ~4.2 TB/s):
// - One warp per output row (RPW = 2 for SwiGLU: rows j and N/2 + j, so the packed gate/up halves are read
//   by the same warp and the activation needs no second pass), warps grid-stride over the rows; each lane
//   reads 16-byte packs of W (8 bf16 / 4 fp32), U = 4 / RPW packs per row per chunk. With 16-byte-aligned W
//   (VEC) the chunks stream through a per-lane cp.async ring of `depth` stages in shared memory (WTile<..,
//   true>, session 6): the warp's first `depth` chunks are requested before pdl_wait and before x is staged,
//   and each consumed stage is refilled with the chunk `depth` steps ahead, so a warp keeps depth x 2 KB in
//   flight (3 stages: 4 blocks x 8 warps x 6 KB = 192 KB a SM, far over Little's ~25 KB at 4.2 TB/s / 132 SMs
//   x ~800 ns). The register tile it replaced held one chunk a warp: a K = 8192 row was 8 dependent round
//   trips. Unaligned W (not VEC) keeps that register tile (element loads, one chunk in flight). B <= 8 rows of
//   x share every W load: NB accumulators per row in registers; NB is 1, 2, 4 or 8 (B rounded up; padded rows
//   are zeros, never stored).
// - xn lives in shared memory as x's own dtype (it is rounded to x.dtype anyway, so this loses nothing), rows
//   Kp = K rounded up to 8 apart (16-byte aligned rows): NB x Kp x sizeof(T) bytes. Why not fp32 always: bf16
//   B = 8, K = 8192 would be 256 KB (over the 227 KB a block may have); as bf16 it is 128 KB. The launcher
//   caps it at 128 KiB (gemv.py SMEM_CAP: bf16 B <= 8 up to K = 8192, fp32 B <= 8 up to K = 4096, B <= 2 up to
//   K = 16384) and takes the unfused path beyond.
// - Each block stages x itself (and recomputes the row statistics): with a one-wave grid that is <= ~132 x
//   (1..8) blocks x B x K x 2 B from L2 (K = 2048, B = 1: 4 KB a block, ~2 MB in all against 8+ MB of W),
//   cheaper than a separate norm launch (~3 us in a graph) and its round trip through HBM.
// - Reading x from shared memory: a lane's 16-byte W pack covers 8 consecutive k, so it reads B x 8 values of
//   xn (one LDS.128 per row for bf16): conflict-free (lanes read consecutive 16-byte chunks). B = 1 costs ~1
//   FMA + 1 widening per W element: far under the issue rate. At B = 8 every 16-byte W pack needs 8 LDS.128
//   (128 B of shared memory, the SM's whole 128 B/clock at the ~1 pack/clock/SM that 4.2 TB/s means), 64 FMAs
//   and 64 + 8 bf16 -> fp32 widenings (integer pipe, 64/clock/SM): ~145 instructions a pack, issue- and
//   shared-bound near 60-70 % of the copy rate. So from NB = 4 a warp takes G = 2 adjacent output columns
//   (G = 1 kernels are kept for comparison, ck.settings.gemv_pair_min_nb): every xn value read and widened serves two W
//   rows, ~112 instructions and 64 B of shared memory a pack, at the price of half as many warps (N = 2048:
//   128 blocks, one a SM). SwiGLU at G = 2 holds 4 rows a warp (2 columns x gate/up). Next lever: mma.sync
//   m16n8k16 with x as the n = 8 operand.
// - The warp reduction is a butterfly (every lane gets every sum); lane b then finishes row b's epilogue, so
//   the B outputs of a warp are written by B lanes in parallel. Each output (and its residual) is read and
//   written by one thread, so residual may be the very array out is (the in-place residual stream).
// - VEC = true: W rows 16-byte aligned (pointer and row stride) and K % (16 / sizeof(W)) == 0; VEC = false:
//   element loads of W, any K, any alignment. x is staged with 16-byte loads when its rows allow (x_vec).
// - Programmatic dependent launch (sm_90, inside ops/_launch.pdl_scope(): the fused decode step): the first
//   `depth` W chunks and the norm weight are requested before pdl_wait(), so a GEMV's launch and first DRAM
//   round trips overlap the tail of the kernel before it. Session 6, B1 in a captured chain (us, register
//   tile -> ring + one-pass prologue): qkv+rms 6.1 -> 5.2, gate_up+rms 21.3 -> 18.2, down 11.9 -> 11.4 (10.5
//   at depth 4), o 3.3 -> 3.5; the LLaMA-1B step 1.207 -> 1.161 ms.
// - Deterministic: the order of every sum is fixed by the shape (no atomics), so reruns are bit-identical.
#include "common/entry.cuh"
#include "common/vec.cuh"
#include "common/pointwise.cuh"
#include "common/pdl.cuh"
#include "common/mma.cuh"

// The activations, with the very formulas of activations.cu (silu_f, gelu_f, gelu_erf_f), so that the fused
// epilogue and ck.swiglu / ck.gelu agree bit for bit on the same rounded inputs.
constexpr float GEMV_GELU_K = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float GEMV_GELU_C = 0.044715f;
constexpr float GEMV_RSQRT2 = 0.7071067811865476f;
__device__ __forceinline__ float gemv_silu(float g) {
  float s, oms;
  sigmoid2(g, s, oms);
  return g * s;
}
__device__ __forceinline__ float gemv_gelu_tanh(float x) {
  float s, oms;
  sigmoid2(2.f * GEMV_GELU_K * (x + GEMV_GELU_C * x * x * x), s, oms);
  return x * s;
}
__device__ __forceinline__ float gemv_gelu_erf(float x) { return 0.5f * x * (1.f + erff(x * GEMV_RSQRT2)); }

// Flags (bit set by the launcher).
constexpr unsigned GEMV_OUT_F32 = 1u;    // out (and residual) are fp32, else bf16
constexpr unsigned GEMV_BIAS_F32 = 2u;   // bias is fp32, else bf16
constexpr unsigned GEMV_NW_F32 = 4u;     // norm_weight / norm_bias are fp32, else bf16
constexpr unsigned GEMV_ROUND_MID = 8u;  // intermediates rounded to bf16 (x and out both bf16)
constexpr unsigned GEMV_X_VEC = 16u;     // x rows 16-byte aligned with K % (16 / sizeof(T)) == 0
// flags bits 8-15: KB of its first rows a warp asks into L2 before the wait (ck.settings.gemv_prefetch_kb)
// norm: 0 none, 1 rms, 2 layer.   act: 0 none, 1 swiglu, 2 gelu (tanh), 3 gelu (erf).

__device__ __forceinline__ float ld_any(const void* p, long long i, bool f32) {
  return f32 ? reinterpret_cast<const float*>(p)[i] : to_f32(reinterpret_cast<const bf16*>(p)[i]);
}
__device__ __forceinline__ float round_bf16(float v) { return to_f32(from_f32<bf16>(v)); }

// W pack of E elements as fp32 into f[0..E).
template <typename W, int E>
__device__ __forceinline__ void widen(const Pack<W, E>& p, float (&f)[E]) {
#pragma unroll
  for (int i = 0; i < E; ++i) f[i] = to_f32(p.v[i]);
}

// One chunk of a warp's W rows in registers: RPW = G x HALVES rows (G adjacent output columns, each with its
// up row N/2 further for SwiGLU), U = 4 / RPW loads per row per lane (16-byte packs when VEC, else single
// elements widened on load: a 2-byte struct array made ptxas spill), then the FMAs against xn in shared
// memory. Slot r = h * G + g holds W row (j G + g) + h N/2; a column past n_out (the last group of an odd
// n_out) reads row n_out - 1 again and is never stored. CHUNK elements of each row per chunk.
template <int G, int HALVES>
__device__ __forceinline__ long long tile_row(long long j, int r, int half, int n_out) {
  long long col = j * G + r % G;
  if (col >= n_out) col = n_out - 1;
  return col + (long long)(r / G) * half;
}

template <typename T, typename W, int NB, int G, int HALVES, bool VEC>
struct WTile;

// VEC = true: the weight streams through a ring of `depth` stages in shared memory, private to each lane
// (cp.async.cg, 16 bytes a copy: no registers hold the bytes in flight, no barrier: a lane only ever reads back
// what it copied itself, so cp.async.wait_group alone orders it). A stage is one chunk: U packs of each of the
// RPW rows, 64 bytes a lane, 2 KB a warp. Why (session 6, H200, captured chain under PDL): the register tile
// held one chunk in flight a warp, so a K = 8192 row (down) was 8 dependent DRAM round trips (11.9 us against an
// 8.0 us floor), and everything after the first chunk waited on the post-wait critical path; with the ring the
// first `depth` chunks of a warp go out before pdl_wait (a whole K = 2048 row of qkv / o at depth >= 2) and a
// warp keeps `depth` chunks in flight: 3 blocks x 8 warps x 3 x 2 KB = 144 KB a SM, against Little's ~25 KB.
template <typename T, typename W, int NB, int G, int HALVES>
struct WTile<T, W, NB, G, HALVES, true> {
  static constexpr bool ASYNC = true;
  static constexpr int RPW = G * HALVES, E = 16 / sizeof(W), U = 4 / RPW, CHUNK = 32 * U * E, SLOT = RPW * U;
  uint4* ring;  // this warp's stages: [depth][SLOT][32 lanes] 16-byte packs
  __device__ __forceinline__ void issue(int st, const W* w, long long ldw, long long j, int half, int n_out, int k0,
                                        int K, int lane, bool valid) {
    if (valid) {
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const W* row = w + tile_row<G, HALVES>(j, r, half, n_out) * ldw;
#pragma unroll
        for (int i = 0; i < U; ++i) {
          const int k = k0 + (lane + 32 * i) * E;
          if (k < K) cp_async16(ring + (st * SLOT + r * U + i) * 32 + lane, row + k, true);
        }
      }
    }
    cp_async_commit();  // one group a step, empty or not: wait(depth) then always means "this step's copies"
  }
  // This lane's copies of the oldest of `depth` outstanding steps have landed.
  __device__ __forceinline__ void wait(int depth) const {
    if (depth >= 4) cp_async_wait<3>();
    else if (depth == 3) cp_async_wait<2>();
    else if (depth == 2) cp_async_wait<1>();
    else cp_async_wait<0>();
  }
  __device__ __forceinline__ void fma(int st, float (&acc)[RPW][NB], const T* xs, int Kp, int k0, int K, int lane) const {
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int k = k0 + (lane + 32 * i) * E;
      if (k < K) {
        float wf[RPW][E];
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          Pack<W, E> p;
          *reinterpret_cast<uint4*>(&p) = ring[(st * SLOT + r * U + i) * 32 + lane];
          widen<W, E>(p, wf[r]);
        }
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          // E consecutive xn values of row b: 16-byte shared loads (E * sizeof(T) is 8, 16 or 32 bytes).
          float xf[E];
          if constexpr (E * sizeof(T) >= 16) {
            constexpr int XP = 16 / sizeof(T);
#pragma unroll
            for (int c = 0; c < E / XP; ++c) {
              const Pack<T, XP> xv = load_pack<T, XP>(xs + b * Kp + k + c * XP);
#pragma unroll
              for (int q = 0; q < XP; ++q) xf[c * XP + q] = to_f32(xv.v[q]);
            }
          } else {
            const Pack<T, E> xv = load_pack<T, E>(xs + b * Kp + k);
#pragma unroll
            for (int q = 0; q < E; ++q) xf[q] = to_f32(xv.v[q]);
          }
#pragma unroll
          for (int r = 0; r < RPW; ++r)
#pragma unroll
            for (int q = 0; q < E; ++q) acc[r][b] = fmaf(wf[r][q], xf[q], acc[r][b]);
        }
      }
    }
  }
};

template <typename T, typename W, int NB, int G, int HALVES>
struct WTile<T, W, NB, G, HALVES, false> {
  // Element loads into registers, one chunk in flight (depth 1: `st` is ignored, `wait` is a no-op).
  static constexpr bool ASYNC = false;
  static constexpr int RPW = G * HALVES, U = 4 / RPW, CHUNK = 32 * U;
  float v[RPW][U];
  __device__ __forceinline__ void issue(int, const W* w, long long ldw, long long j, int half, int n_out, int k0,
                                        int K, int lane, bool valid) {
    if (!valid) return;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const W* row = w + tile_row<G, HALVES>(j, r, half, n_out) * ldw;
#pragma unroll
      for (int i = 0; i < U; ++i) {
        const int k = k0 + lane + 32 * i;
        v[r][i] = k < K ? to_f32(row[k]) : 0.f;
      }
    }
  }
  __device__ __forceinline__ void wait(int) const {}
  __device__ __forceinline__ void fma(int, float (&acc)[RPW][NB], const T* xs, int Kp, int k0, int K, int lane) const {
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int k = k0 + lane + 32 * i;
      if (k < K)
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          const float xf = to_f32(xs[b * Kp + k]);
#pragma unroll
          for (int r = 0; r < RPW; ++r) acc[r][b] = fmaf(v[r][i], xf, acc[r][b]);
        }
    }
  }
};

// The epilogue of output column ``col`` of batch row b from its fp32 dot products y[h] (W rows col + h * half):
// bias, activation, residual, with the rounding points of the unfused composition (the header).
template <int HALVES>
__device__ __forceinline__ void gemv_store(const float (&acc)[HALVES], long long col, int b, const void* bias,
                                           const void* res, long long ldr, void* out, long long ldo, int half,
                                           int act, unsigned flags) {
  const bool rmid = flags & GEMV_ROUND_MID, of32 = flags & GEMV_OUT_F32;
  float y[HALVES];
#pragma unroll
  for (int h = 0; h < HALVES; ++h) {
    y[h] = rmid ? round_bf16(acc[h]) : acc[h];
    if (bias != nullptr) {
      y[h] += ld_any(bias, col + (long long)h * half, flags & GEMV_BIAS_F32);
      if (rmid) y[h] = round_bf16(y[h]);
    }
  }
  float v = y[0];
  if (act != 0) {
    if (HALVES == 2) v = gemv_silu(y[0]) * y[HALVES - 1];
    else if (act == 2) v = gemv_gelu_tanh(y[0]);
    else v = gemv_gelu_erf(y[0]);
    if (rmid) v = round_bf16(v);
  }
  if (res != nullptr) v = ld_any(res, b * ldr + col, of32) + v;
  if (of32) reinterpret_cast<float*>(out)[b * ldo + col] = v;
  else reinterpret_cast<bf16*>(out)[b * ldo + col] = from_f32<bf16>(v);
}

// The norm weight (and bias) of the thread's first pack of K, read before pdl_wait (parameters: no kernel of the
// step writes them), so the prologue after the wait needs no round trip for them: K <= 256 x 8 = 2048 for bf16
// x is all of it (LLaMA-1B's qkv, gate_up and head); packs past the first read nw after the wait.
template <typename T>
struct NormPre {
  static constexpr int XE = 16 / sizeof(T);
  float g[XE], c[XE];
  __device__ __forceinline__ void load(const void* nw, const void* nb, int K, int norm, unsigned flags) {
    const bool nf32 = flags & GEMV_NW_F32;
    const int k0 = threadIdx.x * XE;
#pragma unroll
    for (int q = 0; q < XE; ++q) {
      const bool in = norm != 0 && k0 + q < K;
      g[q] = in ? ld_any(nw, k0 + q, nf32) : 0.f;
      c[q] = in && norm == 2 ? ld_any(nb, k0 + q, nf32) : 0.f;
    }
  }
};

// Sums of NB values over the block (256 threads, 8 warps) in a fixed order (warp butterflies, then warps 0..7):
// every thread gets every total. `red` is [8][NB] floats of shared memory; two barriers.
template <int NB>
__device__ __forceinline__ void block_sums(float (&v)[NB], float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int b = 0; b < NB; ++b) v[b] = warp_sum(v[b]);
  if (lane == 0)
#pragma unroll
    for (int b = 0; b < NB; ++b) red[warp * NB + b] = v[b];
  __syncthreads();
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) t += red[w * NB + b];
    v[b] = t;
  }
  __syncthreads();  // red may be written again
}

// Stage NB rows of x into shared memory xs (rows Kp apart; rows >= Bn and columns >= K are zeros: they add
// nothing to the dot products), then the norm prologue in place. Ends with a barrier.
// Session 6 (H200, captured chain under PDL, B1): qkv with the rms prologue 6.1 us, without it 4.1; gate_up
// 21.3 / 19.2. The old prologue ran after the wait as: x from L2, a barrier, ONE warp summing a row (64
// dependent shared loads at K = 2048), a barrier, norm_weight from L2, a barrier. Now every thread sums the
// packs it staged (registers, no re-read), one block reduction, the weight comes from registers (NormPre, read
// before the wait): one L2 round trip for x and 3 barriers (4 for LayerNorm's second pass) after the wait.
template <typename T, int NB>
__device__ __forceinline__ void gemv_stage_x(T* xs, int Kp, const T* __restrict__ x, long long ldx, int Bn, int K,
                                             const void* __restrict__ nw, const void* __restrict__ nb, float eps,
                                             float inv_k, int norm, unsigned flags, const NormPre<T>& pre) {
  __shared__ float red[8 * NB];
  const int tid = threadIdx.x;
  constexpr int XE = 16 / sizeof(T);
  const bool vec = flags & GEMV_X_VEC;
  float s[NB], ss[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) s[b] = ss[b] = 0.f;
  // A thread owns packs u = tid + i * blockDim (vec) or elements k = tid + i * blockDim (not vec) of every row,
  // through staging, statistics and the rewrite: it only ever re-reads xs values it wrote itself.
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    if (vec) {
      const int units = Kp / XE;  // K % XE == 0 here, so Kp / XE covers K plus zero packs
      for (int u = tid; u < units; u += blockDim.x) {
        Pack<T, XE> v;
        if (b < Bn && u * XE < K) {
          v = load_pack<T, XE>(x + b * ldx + u * XE);
        } else {
#pragma unroll
          for (int i = 0; i < XE; ++i) v.v[i] = from_f32<T>(0.f);
        }
        store_pack<T, XE>(xs + b * Kp + u * XE, v);
#pragma unroll
        for (int i = 0; i < XE; ++i) {
          const float f = to_f32(v.v[i]);
          s[b] += f;
          ss[b] = fmaf(f, f, ss[b]);
        }
      }
    } else {
      for (int k = tid; k < Kp; k += blockDim.x) {
        const T v = (b < Bn && k < K) ? x[b * ldx + k] : from_f32<T>(0.f);
        xs[b * Kp + k] = v;
        const float f = to_f32(v);
        s[b] += f;
        ss[b] = fmaf(f, f, ss[b]);
      }
    }
  }
  if (norm != 0) {
    float mu[NB], r[NB];
    if (norm == 1) {
      block_sums<NB>(ss, red);
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        // ck.rms_norm's ss / C, correctly rounded without the division instruction sequence: its slow-path
        // subroutine call made ptxas spill around it. inv_k = RN(1 / K) comes from the host; q = RN(ss * inv_k)
        // corrected once with the exact remainder ss - q K (an FMA) is the correctly rounded quotient
        // (Markstein's theorem; ss >= 0 and K <= 2^24 stay far from overflow and underflow).
        const float q0 = ss[b] * inv_k;
        mu[b] = 0.f;
        r[b] = rsqrtf(fmaf(fmaf(-q0, (float)K, ss[b]), inv_k, q0) + eps);
      }
    } else {
      // ck.layer_norm: mean = s * (1 / C), then the exact two-pass variance over the staged values
      block_sums<NB>(s, red);
      float q[NB];
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        mu[b] = s[b] * inv_k;
        q[b] = 0.f;
        const T* xr = xs + b * Kp;
        if (vec) {
          for (int u = tid; u * XE < K; u += blockDim.x) {
            const Pack<T, XE> v = load_pack<T, XE>(xr + u * XE);
#pragma unroll
            for (int i = 0; i < XE; ++i) {
              const float d = to_f32(v.v[i]) - mu[b];
              q[b] = fmaf(d, d, q[b]);
            }
          }
        } else {
          for (int k = tid; k < K; k += blockDim.x) {
            const float d = to_f32(xr[k]) - mu[b];
            q[b] = fmaf(d, d, q[b]);
          }
        }
      }
      block_sums<NB>(q, red);
#pragma unroll
      for (int b = 0; b < NB; ++b) r[b] = rsqrtf(q[b] * inv_k + eps);
    }
    // rewrite the thread's own values of the real rows as xn (padded rows stay zero)
    const bool nf32 = flags & GEMV_NW_F32;
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      if (b >= Bn) continue;
      T* xr = xs + b * Kp;
      if (vec) {
        for (int u = tid; u * XE < K; u += blockDim.x) {
          Pack<T, XE> v = load_pack<T, XE>(xr + u * XE);
#pragma unroll
          for (int i = 0; i < XE; ++i) {
            const int k = u * XE + i;
            const float f = to_f32(v.v[i]);
            const float g = u == tid ? pre.g[i] : ld_any(nw, k, nf32);
            const float c = norm == 1 ? 0.f : u == tid ? pre.c[i] : ld_any(nb, k, nf32);
            v.v[i] = from_f32<T>(norm == 1 ? f * r[b] * g : (f - mu[b]) * r[b] * g + c);
          }
          store_pack<T, XE>(xr + u * XE, v);
        }
      } else {
        for (int k = tid; k < K; k += blockDim.x) {
          const float f = to_f32(xr[k]);
          const float g = ld_any(nw, k, nf32);
          xr[k] = from_f32<T>(norm == 1 ? f * r[b] * g : (f - mu[b]) * r[b] * g + ld_any(nb, k, nf32));
        }
      }
    }
  }
  __syncthreads();
}

template <typename T, typename W, int NB, int HALVES, int G, bool VEC>
__device__ __forceinline__ void gemv_body(const T* __restrict__ x, long long ldx, int Bn, int K,
                                          const W* __restrict__ w, long long ldw, const void* __restrict__ bias,
                                          const void* __restrict__ nw, const void* __restrict__ nb, float eps,
                                          float inv_k, const void* res, long long ldr, void* out, long long ldo,
                                          int n_out, int half, int norm, int act, unsigned flags, int depth) {
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  T* xs = reinterpret_cast<T*>(gemv_smem);
  const int Kp = (K + 7) & ~7;
  const int tid = threadIdx.x, lane = tid & 31;

  // The warp's first `depth` chunks of W are requested before the wait and before x is staged and normalised:
  // those copies do not depend on xn, so the prologue hides under their DRAM latency, and under PDL they go out
  // while the previous kernel still runs. G = 2: two adjacent output columns a warp, so each xn value read from
  // shared memory and widened serves two W rows (the launcher takes it from B = 3 up; see the header).
  constexpr int RPW = G * HALVES;
  using Tile = WTile<T, W, NB, G, HALVES, VEC>;
  Tile tile;
  if constexpr (Tile::ASYNC) {
    // the ring sits after xn (NB x Kp x sizeof(T), rounded up to 16 bytes): depth x 2 KB a warp
    const int xbytes = (NB * Kp * (int)sizeof(T) + 15) & ~15;
    tile.ring = reinterpret_cast<uint4*>(gemv_smem + xbytes) + (tid >> 5) * depth * Tile::SLOT * 32;
  } else {
    depth = 1;
  }
  const long long ngroups = ((long long)n_out + G - 1) / G;
  const long long gw = ((long long)blockIdx.x * blockDim.x + tid) >> 5;
  const long long nwg = ((long long)gridDim.x * blockDim.x) >> 5;
  // issue cursor: the (row group, chunk) step whose copies go out next
  long long ij = gw;
  int ik = 0;
  for (int st = 0; st < depth; ++st) {
    tile.issue(st, w, ldw, ij, half, n_out, ik, K, lane, ij < ngroups);
    ik += Tile::CHUNK;
    if (ik >= K) {
      ik = 0;
      ij += nwg;
    }
  }
  // ... and the rest of the warp's first rows, up to gemv_prefetch_kb KB a warp (flags), is asked into L2 (a hint: no
  // register holds it). 8 KB x ~2-3K warps would be 17-25 MB in flight in the 50 MB L2.
  {
    const long long rowbytes = (long long)K * sizeof(W);
    long long left = (long long)((flags >> 8) & 255u) * 1024;
    for (long long jj = gw; jj < ngroups && left > 0; jj += nwg, left -= RPW * rowbytes)
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const char* row = reinterpret_cast<const char*>(w + tile_row<G, HALVES>(jj, r, half, n_out) * ldw);
        for (long long off = (long long)lane * 128; off < rowbytes && off < left; off += 32 * 128)
          prefetch_l2(row + off);
      }
  }
  NormPre<T> pre;
  pre.load(nw, nb, K, norm, flags);
  // Everything above reads only W and the norm parameters. Under programmatic dependent launch (the fused
  // decode step: ops/_launch.py) the kernel gets here while the previous kernel still runs; x, the residual and
  // out belong to it until the wait returns (common/pdl.cuh).
  pdl_wait();
  pdl_trigger();

  gemv_stage_x<T, NB>(xs, Kp, x, ldx, Bn, K, nw, nb, eps, inv_k, norm, flags, pre);

  // ---- the dot products: warp per output row (pair), grid-stride over (row, chunk) steps. Each consumed stage
  // is refilled at once with the step `depth` ahead, so a warp keeps `depth` chunks in flight through the
  // reductions and epilogues of finished rows.
  float acc[RPW][NB];
  long long j = gw;
  int k0 = 0, st = 0;
  while (j < ngroups) {  // warp-uniform
    if (k0 == 0) {
#pragma unroll
      for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int b = 0; b < NB; ++b) acc[r][b] = 0.f;
    }
    tile.wait(depth);
    tile.fma(st, acc, xs, Kp, k0, K, lane);
    tile.issue(st, w, ldw, ij, half, n_out, ik, K, lane, ij < ngroups);
    ik += Tile::CHUNK;
    if (ik >= K) {
      ik = 0;
      ij += nwg;
    }
    st = st + 1 == depth ? 0 : st + 1;
    const long long grp = j;
    k0 += Tile::CHUNK;
    if (k0 < K) continue;  // more chunks of this row
    k0 = 0;
    j += nwg;

#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int b = 0; b < NB; ++b) acc[r][b] = warp_sum(acc[r][b]);

    // ---- epilogue: lane b finishes batch row b (acc is indexed with compile-time b only: no local memory)
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      if (lane != b || b >= Bn) continue;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const long long col = grp * G + g;
        if (col >= n_out) continue;
        float y[HALVES];
#pragma unroll
        for (int h = 0; h < HALVES; ++h) y[h] = acc[h * G + g][b];
        gemv_store<HALVES>(y, col, b, bias, res, ldr, out, ldo, half, act, flags);
      }
    }
  }
}

// Entry points: gemv_<x dtype>_<W dtype>_b<NB>_r<HALVES>_g<G>_<v|s> (HALVES 2: SwiGLU; G 2 only for NB 4 / 8).
// 256 threads a block (the launcher's THREADS).
// Register budget: 4 blocks a SM (<= 64 registers) for NB = 1 (with the ring the weight holds no registers:
// 62-64, no spills; the shared memory of a K = 2048 ring also allows 4), 2 (<= 128) for NB 2-4, 1 for NB = 8
// (fp32 x with bf16 W hoists 8 rows x 2 LDS.128 of x: 150 registers). Without a min-blocks hint ptxas capped
// some kernels at 64 registers and spilled (ptxas -v, sm_90; tests/test_compile.py).
#define GEMV_ONE(T, W, TN, WN, NB, HALVES, G, VEC, VS)                                                         \
  CK_ENTRY(__launch_bounds__(256, NB == 1 ? 4 : NB < 8 ? 2 : 1),                                               \
      gemv_##TN##_##WN##_b##NB##_r##HALVES##_g##G##_##VS)(                                                      \
          const T* x, long long ldx, int Bn, int K, const W* w, long long ldw, const void* bias, const void* nw, \
          const void* nb, float eps, float inv_k, const void* res, long long ldr, void* out, long long ldo,      \
          int n_out, int half, int norm, int act, unsigned flags, int depth) {                                  \
    gemv_body<T, W, NB, HALVES, G, VEC>(x, ldx, Bn, K, w, ldw, bias, nw, nb, eps, inv_k, res, ldr, out, ldo,    \
                                        n_out, half, norm, act, flags, depth);                                  \
  }
#define GEMV_NB(T, W, TN, WN, HALVES, VEC, VS)    \
  GEMV_ONE(T, W, TN, WN, 1, HALVES, 1, VEC, VS)   \
  GEMV_ONE(T, W, TN, WN, 2, HALVES, 1, VEC, VS)   \
  GEMV_ONE(T, W, TN, WN, 4, HALVES, 1, VEC, VS)   \
  GEMV_ONE(T, W, TN, WN, 8, HALVES, 1, VEC, VS)   \
  GEMV_ONE(T, W, TN, WN, 4, HALVES, 2, VEC, VS)   \
  GEMV_ONE(T, W, TN, WN, 8, HALVES, 2, VEC, VS)
#define GEMV_ALL(T, W, TN, WN)          \
  GEMV_NB(T, W, TN, WN, 1, true, v)     \
  GEMV_NB(T, W, TN, WN, 2, true, v)     \
  GEMV_NB(T, W, TN, WN, 1, false, s)    \
  GEMV_NB(T, W, TN, WN, 2, false, s)

GEMV_ALL(bf16, bf16, bf16, bf16)
GEMV_ALL(bf16, float, bf16, f32)
GEMV_ALL(float, bf16, f32, bf16)
GEMV_ALL(float, float, f32, f32)
