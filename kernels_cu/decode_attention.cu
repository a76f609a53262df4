// Decode attention (flash-decoding, split-KV, ONE launch): a few new query tokens against a long static KV cache,
// bf16 in / bf16 out, fp32 softmax and accumulation.
//
// Math, per batch b, query token t (position p_t = L - Tq + t, L = cache_len read from device memory) and query
// head h (K/V head j = h / G, G = H / Hkv):
//   s[t, h, n] = scale * <q[b, t, h], k[b, n, j]>   for keys n < L with n <= p_t and key_mask[b, n] != 0
//   o[b, t, h] = sum_n softmax_n(s) v[b, n, j]       (no visible key: o = 0)
// Split-KV: the key range [0, L) is cut into `splits` chunks; block (split, j, b) computes, for every row
// (t, h of group j), the partial max m, sum l = sum exp(s - m) and acc = sum exp(s - m) v over its chunk
// (log2 units: exp2 with scale * log2(e) folded into one FMA), into an fp32 workspace. The LAST block of the
// (b, j, row group) to finish -- found with an int counter per group at the end of the workspace (threadfence,
// atomicAdd, the block that sees active - 1) -- then forms o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s
// with M = max_s m_s, reading the partials splits in order (deterministic: the arithmetic of the former
// separate combine kernel, expression for expression, so reruns are bit-identical whichever block is last),
// and resets the counter to 0 for the next launch / graph replay. Float atomics: none.
//
// Why one kernel: session 5's decode step profile (LLaMA-3.2-1B, B1, <= 384 cached keys) had the split kernel
// at 4.4 us and the combine launch at 2.6 us per layer: the combine's work is ~6 KB of L2 reads, its cost was
// the second launch and its DRAM / L2 round trips. Folded in, it costs the last block a fence, an atomic and
// one pass over the partials (~1 us, three dependent L2 round trips).
//
// Why split: at decode time one query token per sequence meets L cached keys. A grid of one block per (b, K/V
// head) has B * Hkv blocks (8 at B1 for LLaMA-3.2-1B, 6 % of the 132 SMs, each waiting for its stages one DRAM
// round trip at a time). Splitting the keys gives B * Hkv * splits blocks; the host picks `splits` from
// max_len with a latency / bandwidth model (decode_attention.py: _choose_splits), and the partials are small
// (Tq * H * (D + 2) floats per split).
//
// Design:
//   * One block = one (split, K/V head, batch) with ALL G query heads of that K/V head and all Tq queries as the
//     rows of the tile: R = G * Tq rows (4 for LLaMA-3.2-1B at Tq = 1), so each K/V byte is read once per K/V
//     head, not once per query head. Rows are padded to 16 (the tensor-core tile); a block holds MTB row tiles
//     of 16 (MTB = 1, 2 or 4; more rows -> several row groups, each re-reading its K/V: only when G * Tq > 64).
//   * Tensor cores through mma.sync.m16n8k16 (bf16 -> fp32), the same fragment code as attention.cu: the
//     padded rows cost tensor-core issue slots that a memory-bound kernel has spare (at Tq = 1, G = 4 the
//     m16 tile is 1/4 used; the mma rate still exceeds the K/V read rate ~8x).
//   * 4 warps; warp w takes row tile w % MTB and key group w / MTB: with MTB = 1 the four warps split each
//     64-key stage (16 keys each), then merge their (m, l, acc) through shared memory at the end.
//   * K/V stages of KG * 16 keys copied global -> shared with cp.async, two stages in flight. Keys at or past
//     the split end (and so past L: the cache tail is never read, it may hold NaN) and keys the key_mask drops
//     are zero-filled by the copy (src-size 0, nothing read) and masked to -inf in the scores, so a masked
//     cache row holding garbage cannot leak NaN through 0 * NaN in P V.
//   * key_mask (any 1/2/4/8-byte integer or bool dtype, nonzero = keep, read in place): the block first turns
//     its chunk's entries into bits in shared memory (<= 8192 + 128 keys per split, enforced by the launcher,
//     1 KB), so the copy issue and the score mask read a bit, not global memory.
//   * L comes from device memory (a captured decode step replays with the new length): the chunk length
//     ceil(L / splits) rounded up to a stage is computed on the device; active = ceil(L / chunk) splits hold
//     keys (1 when L = 0: split 0 then runs with no keys and the combine writes zeros); blocks of the other
//     splits exit at once without touching the counter.
//   * splits == 1: the block normalises and writes o directly (no workspace, no counter).
//   * PDL (common/pdl.cuh): pdl_wait() first -- the kernel before it (rope_kv_write) writes q and the cache,
//     and the workspace / counters / o may still be read by the kernels before -- then pdl_trigger().
//
// Workspace (splits > 1): acc [B, Hkv, splits, R, D] fp32, (m, l) [B, Hkv, splits, R, 2] fp32, then
// counters int32 [B, Hkv * RG]. The counters must be zero before the first launch (decode_attention_workspace()
// returns them zeroed; the launcher zeroes a pool temporary) and are zero again after every launch. Two
// launches in flight at once must not share a workspace.
#include "common/vec.cuh"
#include "common/mma.cuh"
#include "common/pointwise.cuh"
#include "common/pdl.cuh"

namespace {

constexpr int NW = 4;          // warps per block
constexpr int NT = NW * 32;    // threads per block
constexpr int BN = 16;         // keys per warp per stage
constexpr float LOG2E = 1.4426950408889634f;
constexpr int MASK_BITS = 8192 + 128;  // key_mask bits a split can hold (launcher: ceil(L_max / splits) <= 8192)
constexpr int MASK_WORDS = MASK_BITS / 32;

// PTX helpers (cp.async, ldmatrix, mma.sync, ex2) and the Q K^T / P V fragment loops: common/mma.cuh.

// The current cache length, clamped to [0, Lmax] (a device value outside it is not trusted blindly).
__device__ __forceinline__ int cache_length(const int* len_ptr, int len_val, int Lmax) {
  const int L = len_ptr != nullptr ? *len_ptr : len_val;
  return min(max(L, 0), Lmax);
}

// Keys per split: ceil(L / splits) rounded up to whole stages (0 when L == 0). Both kernels use this.
__device__ __forceinline__ int chunk_length(int L, int splits, int stage) {
  const int per = (L + splits - 1) / splits;
  return (per + stage - 1) / stage * stage;
}

template <typename T> __device__ __forceinline__ bool nonzero_at(const unsigned char* row, int n) {
  return __ldg(reinterpret_cast<const T*>(row) + n) != 0;
}
__device__ __forceinline__ bool mask_keep(const unsigned char* row, int n, int esz) {
  switch (esz) {
    case 1: return nonzero_at<unsigned char>(row, n);
    case 2: return nonzero_at<unsigned short>(row, n);
    case 4: return nonzero_at<unsigned>(row, n);
    default: return nonzero_at<unsigned long long>(row, n);
  }
}

// Shared memory of one block (dynamic): Q tile, then the K/V stages (re-used by the end-of-block merge), then
// the key_mask bits. The launcher computes the same size (decode_attention.py: _smem).
template <int D, int MTB> struct Layout {
  static constexpr int LD = Tile<D>::LD;
  static constexpr int KG = NW / MTB;                   // key groups
  static constexpr int STAGE = KG * BN;                 // keys per stage
  static constexpr int Q_BYTES = MTB * 16 * LD * 2;
  static constexpr int KV_BYTES = 2 * 2 * STAGE * LD * 2;   // K and V, two stages
  static constexpr int ACC_LD = D + 4;                  // merge area row (floats), padded against bank conflicts
  static constexpr int MERGE_BYTES = (NW * 32 + NW * 16 * ACC_LD) * 4;
  static constexpr int AREA = KV_BYTES > MERGE_BYTES ? KV_BYTES : MERGE_BYTES;
  static constexpr int BYTES = Q_BYTES + AREA + MASK_WORDS * 4;
};

}  // namespace

// ================================================================================================ split kernel
// Grid (splits, Hkv * RG, B); 128 threads. Workspace rows (splits > 1): ((b * Hkv + j) * splits + split) * R + rr,
// R = G * Tq, row rr = t * G + (h - j * G); counter of (b, j, row group rg): b * Hkv * RG + j * RG + rg.
template <int D, int MTB>
__device__ __forceinline__ void dattn_split(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                            const bf16* __restrict__ v, const int* __restrict__ len_ptr,
                                            int len_val, const unsigned char* __restrict__ mask, long long mask_b,
                                            int mask_esz, float* __restrict__ ws, bf16* __restrict__ out,
                                            long long qb, long long qt, long long qh, long long kb, long long kt,
                                            long long kh, long long vb, long long vt, long long vh, int Tq, int H,
                                            int Hkv, int Lmax, int splits, int RG, float scale, int direct) {
  using LY = Layout<D, MTB>;
  constexpr int LD = LY::LD, KG = LY::KG, STAGE = LY::STAGE, CH = D / 8;  // CH: 16-byte chunks per row
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
  bf16* Ks = reinterpret_cast<bf16*>(smem_raw + LY::Q_BYTES);  // [2][STAGE][LD]
  bf16* Vs = Ks + 2 * STAGE * LD;                               // [2][STAGE][LD]
  unsigned* bits = reinterpret_cast<unsigned*>(smem_raw + LY::Q_BYTES + LY::AREA);

  const int split = blockIdx.x, j = blockIdx.y / RG, rg = blockIdx.y % RG, b = blockIdx.z;
  const int G = H / Hkv, R = G * Tq;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c2 = (lane & 3) * 2;
  const int rt = warp % MTB, kg = warp / MTB;

  // Everything below reads what the previous kernel may write (q, the cache, cache_len) or writes what the
  // kernels before may still read (ws, o): wait for them first, then let the next PDL kernel be scheduled.
  pdl_wait();
  pdl_trigger();

  const int L = cache_length(len_ptr, len_val, Lmax);
  const int chunk = chunk_length(L, splits, STAGE);
  const long long k0l = (long long)split * chunk;
  const int k0 = (int)min(k0l, (long long)L);
  const int kend = (int)min(k0l + chunk, (long long)L);
  // Splits that hold keys: ceil(L / chunk) (<= splits since chunk >= L / splits); with L == 0 split 0 still
  // runs (no keys: m = -inf, l = 0) so that the combine writes the zeros.
  const int active = chunk > 0 ? (L + chunk - 1) / chunk : 1;
  if (!direct && split >= active) return;  // nothing of this split is in the cache: not counted, not combined
  const int ntiles = kend > k0 ? (kend - k0 + STAGE - 1) / STAGE : 0;
  const bool has_mask = mask != nullptr;

  // ---- Q tile: block rows r -> (t, head) of this K/V head's group; rows >= R are zeros.
  const int row0 = rg * MTB * 16;
#pragma unroll
  for (int i = 0; i < (MTB * 16 * CH + NT - 1) / NT; ++i) {
    const int c = threadIdx.x + i * NT;
    if ((MTB * 16 * CH) % NT != 0 && c >= MTB * 16 * CH) break;
    const int r = c / CH, kc = (c % CH) * 8, rr = row0 + r;
    const bool ok = rr < R;
    const bf16* src = q + (ok ? b * qb + (long long)(rr / G) * qt + (long long)(j * G + rr % G) * qh + kc : 0);
    cp_async16(Qs + r * LD + kc, src, ok);
  }
  cp_async_commit();

  // ---- key_mask bits of [k0, kend): bit i of the chunk <-> key k0 + i.
  const unsigned char* mrow = has_mask ? mask + b * mask_b * mask_esz : nullptr;
  if (has_mask) {
    const int nwords = (kend - k0 + 31) / 32;
    for (int w0 = warp * 8; w0 < nwords; w0 += NW * 8) {
      bool keep[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {  // all 8 loads issued before the first vote
        const int n = k0 + (w0 + u) * 32 + lane;
        keep[u] = n < kend && mask_keep(mrow, n, mask_esz);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const unsigned bal = __ballot_sync(0xffffffffu, keep[u]);
        if (lane == 0 && w0 + u < nwords) bits[w0 + u] = bal;
      }
    }
    __syncthreads();
  }
  auto kept = [&](int n) {  // key n in [k0, kend)
    return !has_mask || ((bits[(n - k0) >> 5] >> ((n - k0) & 31)) & 1u);
  };

  const bf16* kp = k + b * kb + j * kh;
  const bf16* vp = v + b * vb + j * vh;
  auto load_stage = [&](int st, int tile) {
    const int n0 = k0 + tile * STAGE;
#pragma unroll
    for (int i = 0; i < (STAGE * CH + NT - 1) / NT; ++i) {
      const int c = threadIdx.x + i * NT;
      if ((STAGE * CH) % NT != 0 && c >= STAGE * CH) break;
      const int r = c / CH, kc = (c % CH) * 8, n = n0 + r;
      const bool ok = n < kend && kept(n);
      cp_async16(Ks + (st * STAGE + r) * LD + kc, kp + (ok ? (long long)n * kt + kc : 0), ok);
      cp_async16(Vs + (st * STAGE + r) * LD + kc, vp + (ok ? (long long)n * vt + kc : 0), ok);
    }
  };

  if (ntiles > 0) load_stage(0, 0);
  cp_async_commit();
  cp_async_wait<1>();  // Q has landed
  __syncthreads();
  unsigned qf[D / 16][4];
  load_a_frags<D>(qf, Qs, rt * 16);

  // This thread's two rows (g, g + 8 of the warp's row tile) and the last key each may see (causal).
  const int rr0 = row0 + rt * 16 + g, rr1 = rr0 + 8;
  const int lim0 = L - Tq + rr0 / G, lim1 = L - Tq + rr1 / G;
  const int causal_from = L - Tq + 1;  // the first key some query cannot see
  const float sl2 = scale * LOG2E;

  float acc[D / 8][4];
  zero(acc);
  float m0 = -CK_INF, m1 = -CK_INF, l0 = 0.f, l1 = 0.f;  // log2 units

  for (int it = 0; it < ntiles; ++it) {
    const int st = it & 1;
    if (it + 1 < ntiles) load_stage(st ^ 1, it + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    const int nb = k0 + it * STAGE + kg * BN;  // this warp's first key
    if (nb < kend) {                           // warp-uniform
      float s[BN / 8][4];
      zero(s);
      mma_abt<D, BN, LD>(s, qf, Ks + (st * STAGE + kg * BN) * LD);
      if (has_mask || nb + BN > min(kend, causal_from)) {
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int n = nb + nt * 8 + c2 + (e & 1);
            const int lim = (e >> 1) ? lim1 : lim0;
            if (n >= kend || n > lim || !kept(n)) s[nt][e] = -CK_INF;
          }
        }
      }
      online_softmax_step<BN, D>(s, acc, m0, m1, l0, l1, sl2);
      mma_pb<BN, D, LD>(acc, s, Vs + (st * STAGE + kg * BN) * LD);
    }
    __syncthreads();  // the next iteration's prefetch overwrites the stage just read
  }
  cp_async_wait<0>();
  __syncthreads();  // (ntiles == 0: the Q / empty groups are drained before the area is re-used)

  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);

  // ---- merge the KG key groups of each row tile through shared memory (the K/V area is free now).
  float* mml = reinterpret_cast<float*>(smem_raw + LY::Q_BYTES);  // [NW][16][2]: (m, l)
  float* macc = mml + NW * 32;                                      // [NW][16][ACC_LD]
  if ((lane & 3) == 0) {
    mml[(warp * 16 + g) * 2] = m0;
    mml[(warp * 16 + g) * 2 + 1] = l0;
    mml[(warp * 16 + g + 8) * 2] = m1;
    mml[(warp * 16 + g + 8) * 2 + 1] = l1;
  }
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    *reinterpret_cast<float2*>(macc + (warp * 16 + g) * LY::ACC_LD + nt * 8 + c2) = make_float2(acc[nt][0], acc[nt][1]);
    *reinterpret_cast<float2*>(macc + (warp * 16 + g + 8) * LY::ACC_LD + nt * 8 + c2) =
        make_float2(acc[nt][2], acc[nt][3]);
  }
  __syncthreads();

  const long long nrow_total = (long long)gridDim.z * Hkv * splits * R;  // rows of the workspace
  for (int idx = threadIdx.x; idx < MTB * 16 * D; idx += NT) {
    const int r = idx / D, d = idx % D, rtile = r / 16, rl = r % 16, rr = row0 + r;
    if (rr >= R) continue;
    float M = -CK_INF;
#pragma unroll
    for (int gk = 0; gk < KG; ++gk) M = fmaxf(M, mml[((gk * MTB + rtile) * 16 + rl) * 2]);
    float A = 0.f, Ls = 0.f;
#pragma unroll
    for (int gk = 0; gk < KG; ++gk) {  // fixed order: deterministic
      const int w = gk * MTB + rtile;
      const float m = mml[(w * 16 + rl) * 2];
      const float sc = m == -CK_INF ? 0.f : ex2(m - M);
      A += sc * macc[(w * 16 + rl) * LY::ACC_LD + d];
      Ls += sc * mml[(w * 16 + rl) * 2 + 1];
    }
    if (direct) {
      const int t = rr / G, h = j * G + rr % G;
      out[(((long long)b * Tq + t) * H + h) * D + d] = from_f32<bf16>(Ls > 0.f ? A / Ls : 0.f);
    } else {
      const long long wr = (((long long)b * Hkv + j) * splits + split) * R + rr;
      ws[wr * D + d] = A;
      if (d == 0) {
        ws[nrow_total * D + wr * 2] = M;
        ws[nrow_total * D + wr * 2 + 1] = Ls;
      }
    }
  }
  if (direct) return;

  // ---- the last of the group's `active` blocks to get here combines them (threadFenceReduction pattern).
  __shared__ int s_last;
  __threadfence();   // this thread's partials are visible device-wide before the block is counted
  __syncthreads();
  int* cnt = reinterpret_cast<int*>(ws + nrow_total * (D + 2)) + (long long)b * gridDim.y + blockIdx.y;
  if (threadIdx.x == 0) {
    const int seen = atomicAdd(cnt, 1);
    const int last = seen == active - 1;
    if (last) atomicExch(cnt, 0);  // every live block has counted: zero for the next launch / graph replay
    __threadfence();  // (acquire side) the others' partials are read after the count that saw them
    s_last = last;
  }
  __syncthreads();
  if (!s_last) return;

  // One thread per (row, 4 columns); the splits in order, the former combine kernel's expressions (one warp
  // lane per row there, the same per-element arithmetic). __ldcg: read through L2, never a stale L1 line.
  const float* ml = ws + nrow_total * D;
  const long long gbase = ((long long)b * Hkv + j) * splits * R;  // row rr of split s: gbase + s * R + rr
  const int nr = min(MTB * 16, R - row0);
  constexpr int Q4 = D / 4;
  // Loads of AU splits in flight per thread (one L2 round trip, ~0.2 us, per AU splits); AU = 4 at D = 128
  // spills under the 170-register cap of 3 blocks / SM (ptxas, sm_90), 2 does not.
  constexpr int AU = D == 128 ? 2 : 4;
  for (int u = threadIdx.x; u < nr * Q4; u += NT) {
    const int rr = row0 + u / Q4, c = (u % Q4) * 4;
    const long long w0 = gbase + rr;
    float M = -CK_INF;
#pragma unroll 8
    for (int s = 0; s < active; ++s) M = fmaxf(M, __ldcg(ml + (w0 + (long long)s * R) * 2));
    float A0 = 0.f, A1 = 0.f, A2 = 0.f, A3 = 0.f, Ls = 0.f;
#pragma unroll AU
    for (int s = 0; s < active; ++s) {  // splits in order: deterministic
      const long long wr = w0 + (long long)s * R;
      const float m = __ldcg(ml + wr * 2);
      const float sc = m == -CK_INF ? 0.f : ex2(m - M);
      Ls += sc * __ldcg(ml + wr * 2 + 1);
      const float4 x = __ldcg(reinterpret_cast<const float4*>(ws + wr * D + c));
      A0 += sc * x.x;
      A1 += sc * x.y;
      A2 += sc * x.z;
      A3 += sc * x.w;
    }
    const float inv = Ls > 0.f ? 1.f / Ls : 0.f;
    const int t = rr / G, h = j * G + rr % G;
    bf16* o = out + (((long long)b * Tq + t) * H + h) * D + c;  // (out may sit 2 bytes off 8: scalar stores)
    o[0] = from_f32<bf16>(A0 * inv);
    o[1] = from_f32<bf16>(A1 * inv);
    o[2] = from_f32<bf16>(A2 * inv);
    o[3] = from_f32<bf16>(A3 * inv);
  }
}

// ================================================================================================ entry points
// dattn_split_d<D>_m<MTB>: MTB row tiles of 16 per block (1, 2, 4). __launch_bounds__ min blocks: register cap
// 65536 / (128 * MINB): D = 128 keeps 64 fp32 accumulators + 32 Q-fragment registers per thread (cap 170).
#define DATTN_SPLIT(D, MTB, MINB)                                                                               \
  extern "C" __global__ void __launch_bounds__(NT, MINB) dattn_split_d##D##_m##MTB(                             \
      const bf16* q, const bf16* k, const bf16* v, const int* len_ptr, int len_val, const unsigned char* mask,   \
      long long mask_b, int mask_esz, float* ws, bf16* out, long long qb, long long qt, long long qh,           \
      long long kb, long long kt, long long kh, long long vb, long long vt, long long vh, int Tq, int H, int Hkv, \
      int Lmax, int splits, int RG, float scale, int direct) {                                                  \
    dattn_split<D, MTB>(q, k, v, len_ptr, len_val, mask, mask_b, mask_esz, ws, out, qb, qt, qh, kb, kt, kh, vb, \
                        vt, vh, Tq, H, Hkv, Lmax, splits, RG, scale, direct);                                   \
  }
DATTN_SPLIT(32, 1, 4)
DATTN_SPLIT(32, 2, 4)
DATTN_SPLIT(32, 4, 4)
DATTN_SPLIT(64, 1, 4)
DATTN_SPLIT(64, 2, 4)
DATTN_SPLIT(64, 4, 4)
DATTN_SPLIT(128, 1, 3)
DATTN_SPLIT(128, 2, 3)
DATTN_SPLIT(128, 4, 3)

// ================================================================================================ cache append
// kv_write_w<W>: the Tq new tokens' rows src [B, Tq, R] (W-byte words, R words per token: Hkv * D bf16 keys or
// values, or one int32 token id) go to dst [B, Lmax, R] at rows L - Tq .. L - 1 with L read from device memory:
// the append of a captured decode step, whose length lives on the device. src rows and dst rows may be strided
// (a per-layer slice of [layers, B, Lmax, Hkv, D]; a column view of a token buffer); a row's words are
// contiguous. Rows outside [0, Lmax) are skipped (a full cache is the caller's error, checked on the host).
template <typename W>
__device__ void kv_write(const W* __restrict__ src, W* __restrict__ dst, const int* __restrict__ len_ptr,
                         int len_val, long long sb, long long st, long long db, long long dt, int Tq, int R,
                         int Lmax, long long n) {
  const int L = len_ptr ? *len_ptr : len_val;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const long long r = i % R, bt = i / R;
    const int t = (int)(bt % Tq);
    const long long b = bt / Tq;
    const int pos = L - Tq + t;
    if (pos < 0 || pos >= Lmax) continue;
    dst[b * db + (long long)pos * dt + r] = src[b * sb + t * st + r];
  }
}

#define KV_WRITE(BYTES, W)                                                                                        \
  extern "C" __global__ void __launch_bounds__(256) kv_write_w##BYTES(const W* src, W* dst, const int* len_ptr,  \
                                                         int len_val,                                            \
                                                         long long sb, long long st, long long db, long long dt, \
                                                         int Tq, int R, int Lmax, long long n) {                 \
    kv_write<W>(src, dst, len_ptr, len_val, sb, st, db, dt, Tq, R, Lmax, n);                                    \
  }
KV_WRITE(2, unsigned short)
KV_WRITE(4, unsigned int)

// ================================================================================================ rope + cache append
// rope_kv_<dtype>_<positions dtype>_<v|s>: one launch for what a decode step did in four (ck.rope on q, ck.rope
// on k, kv_cache_write of k and of v) plus the two contiguous copies of the packed q and k views rope needed:
// the packed projection qkv [B, T, (H + 2 Hkv) D] (rows strided: b * sb + t * st) is read once;
//   q heads  h < H:            rotated, to q_out [B, T, H, D] (rows strided: b * qb + t * qt)
//   k heads  H <= h < H + Hkv: rotated, to k_cache [b, pos, h - H]       pos = L - T + t, L read from device
//   v heads  the rest:         copied,  to v_cache [b, pos, h - H - Hkv]  memory (or len_val); rows with pos
//                                                                          outside [0, Lmax) are skipped
// Rotation: ck.rope's rotate-half form with the same fp32 expressions (y1 = x1 c - x2 sn, y2 = x2 c + x1 sn,
// c = cos[p, i], sn = sin[p, i], pair (i, i + D/2)), positions as ck.rope takes them (pos_mode 0: p = t, 1:
// positions[t], 2: positions[b, t]; clamped into [0, Lc)), rounded once to T. cos_t == nullptr: no rotation
// (GPT-2), every head is copied.
// Work unit: one 16-byte pack of each half of one head of one token (VEC; P = 8 bf16 / 4 fp32 pairs), a single
// pair otherwise (or, without rotation, one pack / element of the head: D need not be even); grid-stride, one
// 64-bit division chain per unit. A decode step (B1, 48 heads x 64 bf16) is 192 units: one block, latency-bound
// (one DRAM round trip for qkv, one for cos/sin, the stores); the kernel's point is the 5 launches it removes.
template <typename T, typename PT, bool VEC>
__device__ __forceinline__ void rope_kv(const T* qkv, long long sb, long long st, T* q_out, long long qb,
                                        long long qt, T* kc, long long kb, long long kt, T* vc, long long vb,
                                        long long vt, const int* __restrict__ len_ptr, int len_val,
                                        const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                        const PT* __restrict__ positions, int Bsz, int Tn, int H, int Hkv, int D,
                                        int Lc, int pos_mode, int Lmax, bool cs_vec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  const bool rot = cos_t != nullptr;
  const int half = D / 2;
  const int Du = rot ? half / E : D / E;  // units per head
  const int NH = H + 2 * Hkv;
  const long long n = (long long)Bsz * Tn * NH * Du;
  // PDL (common/pdl.cuh): qkv comes from the GEMV before; the cache and the length from earlier kernels
  pdl_wait();
  pdl_trigger();
  const int L = len_ptr ? *len_ptr : len_val;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const int cu = (int)(i % Du);
    const long long r = i / Du;
    const int hs = (int)(r % NH);
    const long long tok = r / NH;
    const int t = (int)(tok % Tn);
    const long long b = tok / Tn;
    const T* src = qkv + b * sb + t * st + (long long)hs * D + cu * E;
    T* dst;
    const bool rotate = rot && hs < H + Hkv;  // v heads are copied
    if (hs < H) {
      dst = q_out + b * qb + t * qt + (long long)hs * D + cu * E;
    } else {
      const int pos = L - Tn + t;
      if (pos < 0 || pos >= Lmax) continue;
      if (hs < H + Hkv) {
        dst = kc + b * kb + (long long)pos * kt + (long long)(hs - H) * D + cu * E;
      } else {
        dst = vc + b * vb + (long long)pos * vt + (long long)(hs - H - Hkv) * D + cu * E;
      }
    }
    Chunk<T, E, VEC> a, c2;
    a.load(src);
    if (!rot) {  // no rotary: the unit is one pack (or element) of the head
      a.store(dst);
      continue;
    }
    c2.load(src + half);
    if (!rotate) {  // v with rotary on: the unit's two packs copied as they are
      a.store(dst);
      c2.store(dst + half);
      continue;
    }
    long long p;
    if (pos_mode == 0) p = t;
    else if (pos_mode == 1) p = (long long)positions[t];
    else p = (long long)positions[tok];
    p = p < 0 ? 0 : (p >= Lc ? Lc - 1 : p);
    float c[E], sn[E];
    load_f32<E>(cos_t + p * half + cu * E, c, cs_vec);
    load_f32<E>(sin_t + p * half + cu * E, sn, cs_vec);
    float f1[E], f2[E];
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const float x1 = a.get(k), x2 = c2.get(k);
      f1[k] = x1 * c[k] - x2 * sn[k];  // rope.cu's expressions (same contraction by the compiler)
      f2[k] = x2 * c[k] + x1 * sn[k];
    }
    Chunk<T, E, VEC> o1, o2;
    o1.pack(f1);
    o2.pack(f2);
    o1.store(dst);
    o2.store(dst + half);
  }
}

#define ROPE_KV(T, PT, TN, PN, VEC, VS)                                                                          \
  extern "C" __global__ void __launch_bounds__(256) rope_kv_##TN##_##PN##_##VS(                                  \
      const T* qkv, long long sb, long long st, T* q_out, long long qb, long long qt, T* kc, long long kb,         \
      long long kt, T* vc, long long vb, long long vt, const int* len_ptr, int len_val, const float* cos_t,       \
      const float* sin_t, const PT* positions, int Bsz, int Tn, int H, int Hkv, int D, int Lc, int pos_mode,      \
      int Lmax, bool cs_vec) {                                                                                    \
    rope_kv<T, PT, VEC>(qkv, sb, st, q_out, qb, qt, kc, kb, kt, vc, vb, vt, len_ptr, len_val, cos_t, sin_t,       \
                        positions, Bsz, Tn, H, Hkv, D, Lc, pos_mode, Lmax, cs_vec);                               \
  }
ROPE_KV(bf16, int, bf16, i32, true, v)
ROPE_KV(bf16, int, bf16, i32, false, s)
ROPE_KV(bf16, long long, bf16, i64, true, v)
ROPE_KV(bf16, long long, bf16, i64, false, s)
ROPE_KV(float, int, f32, i32, true, v)
ROPE_KV(float, int, f32, i32, false, s)
ROPE_KV(float, long long, f32, i64, true, v)
ROPE_KV(float, long long, f32, i64, false, s)
