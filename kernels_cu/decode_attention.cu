// Decode attention (flash-decoding, split-KV, ONE launch): a few new query tokens against a long static KV cache,
// bf16 in / bf16 out, fp32 softmax and accumulation.
//
// Math, per batch b, query token t (position p_t = L - Tq + t, L = cache_len read from device memory) and query
// head h (K/V head j = h / G, G = H / Hkv):
//   s[t, h, n] = scale * <q[b, t, h], k[b, n, j]>   for keys n < L with n <= p_t and key_mask[b, n] != 0
//                                                    and, with a sliding window W, p_t - n < W
//   o[b, t, h] = sum_n softmax_n(s) v[b, n, j]       (no visible key: o = 0)
// Split-KV: the key range [lo, L) is cut into `splits` chunks (lo = 0, or with a window W the first key the
// first query sees, max(0, L - Tq + 1 - W), computed on the device from L: rows before it are neither loaded nor
// computed, so a 4096-key window over a 32768-row cache reads 4096 rows); block (split, j, b) computes, for every row
// (t, h of group j), the partial max m, sum l = sum exp(s - m) and acc = sum exp(s - m) v over its chunk
// (log2 units: exp2 with scale * log2(e) folded into one FMA), into an fp32 workspace. The LAST block of the
// (b, j, row group) to finish -- found with an int counter per group at the start of the workspace (threadfence,
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
//   * L comes from device memory (a captured decode step replays with the new length): the key range [lo, L),
//     the chunk length ceil((L - lo) / splits) rounded up to a stage are computed on the device; active =
//     ceil((L - lo) / chunk) splits hold keys (1 when L = lo: split 0 then runs with no keys and the combine
//     writes zeros); blocks of the other splits exit at once without touching the counter. The launcher plans
//     `splits` on the longest range a launch can see: max_len, or min(max_len, W + Tq - 1) with a window.
//   * Sliding window (window = W, or INT_MAX for none: the launcher's "no window"): query t sees keys n with
//     p_t - n < W. With Tq = 1 every key of [lo, L) is inside; with Tq > 1 keys below L - W (the last query's
//     window start) are masked per row, on the warps whose keys reach below it (the causal test's twin).
//   * splits == 1: the block normalises and writes o directly (no workspace, no counter).
//   * PDL (common/pdl.cuh): pdl_wait() first -- the kernel before it (rope_kv_write) writes q and the cache,
//     and the workspace / counters / o may still be read by the kernels before -- then pdl_trigger().
//   * dattn_rope (decode_attention_rope, session 6): the same body with rope_kv_write folded in for one new
//     token; it loads the length, key_mask, cos / sin and the cached K/V stages BEFORE pdl_wait (see "split
//     kernels" below for why that is safe and the round-trip count).
//
// Workspace (splits > 1): counters int32 [B, Hkv * RG] FIRST (padded to a multiple of 4: 16-byte aligned
// partials), then acc [B, Hkv, splits, R, D] fp32, (m, l) [B, Hkv, splits, R, 2] fp32. The counters sit at a
// place that does not depend on `splits`, so launches of different split counts (a sliding-window layer plans
// its splits on the window, a full layer on max_len) may take turns on one buffer: one launch's partials never
// land on another's counters. The counters must be zero before the first launch (decode_attention_workspace()
// returns them zeroed; the launcher zeroes a pool temporary) and are zero again after every launch. Two
// launches in flight at once must not share a workspace.
#include "common/entry.cuh"
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

// Keys per split: ceil(L / splits) rounded up to whole stages (0 when L == 0). Both kernels use this.
__device__ __forceinline__ int chunk_length(int L, int splits, int stage) {
  const int per = (L + splits - 1) / splits;
  return (per + stage - 1) / stage * stage;
}

template <typename T> __device__ __forceinline__ bool nonzero_at(const unsigned char* row, int n) {
  return __ldcg(reinterpret_cast<const T*>(row) + n) != 0;  // (L2: read before pdl_wait by the fused kernel)
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

// ================================================================================================ split kernels
// One body, two entry families:
//   dattn_split_d<D>_m<MTB>  (FUSED = false): decode_attention. q [B, Tq, H, D] and the cache (the new tokens'
//       rows already appended by the kernel before: rope_kv_write / kv_cache_write) are read after pdl_wait.
//   dattn_rope_d<D>_m<MTB>   (FUSED = true, Tq = 1): decode_attention_rope. The kernel before it is the qkv GEMV;
//       the block rotates the newest token's q (its G heads) and k (K/V head j) from the packed projection
//       itself (rope_kv's rotation and rounding: rope_rotate below), the block whose split holds the newest
//       position appends that k / v row to the cache, and the newest key / value enter the K/V stage from
//       registers, never through the cache. Everything else is decode_attention's code path, so the result is
//       bit-identical to rope_kv_write followed by decode_attention (same q rounding, same split count -- the
//       launcher calls the same _splits --, same tiles, same combine).
//
// PDL and what may be read before pdl_wait (common/pdl.cuh). Every PDL kernel calls pdl_wait() then
// pdl_trigger(), and a kernel can only start after every block of the kernel before it has triggered (or
// exited). So when kernel N+1's pre-wait code runs, kernel N may still be running but N's pdl_wait has
// returned: N-1 and everything before it has completed and its writes are visible. Before its pdl_wait the
// fused kernel (N+1, launched right after the qkv GEMV N) reads only data written by kernels <= N-1 and writes
// nothing to global memory:
//   * the device length. Where it is advanced: cukernels/generation.py _generate_static step() runs
//     `cache.length[...] += 1` (a CuPy elementwise kernel), then kv_cache_write of the token, then the model's
//     _decode_fast (embedding, then per layer gemv(qkv) -> this kernel -> ...): >= 3 kernels before layer 0's
//     attention, and nothing in the step writes it again (models/base.py _decode_fast, nn/decode.py never do).
//     The prefill sets it with a host write before the graph exists.
//   * key_mask (written before the prefill, never during a step), cos / sin (built once), positions (advanced
//     at the end of the previous step, after the head), the cache rows [0, L - 1) of this layer (appended by
//     this same kernel in earlier steps, or by the prefill).
//   Loads that can see data of an earlier kernel go through L2 (ld.global.cg, cp.async.cg): L1 is not coherent.
//   The launcher only uses PDL inside _launch.pdl_scope(), whose opener vouches for the above (an eager call
//   outside it is a plain launch: everything before it has completed).
// After the wait the fused kernel reads only the newest token's q / k / v from qkv (the GEMV's output).
//
// Dependent global round trips after pdl_wait (~0.6-1 us each at an L2 hit; the B1 LLaMA step, 6 splits of
// 64 keys at max_len 384), before this change (rope_kv_write, then decode_attention):
//   rope_kv_write: positions -> cos / sin (1-2, in the kernel's own launch) + qkv (1) + the stores; then
//   decode_attention: length (1) -> key_mask bits + Q (1) -> the K/V stage (1) -> partial stores + fence (1)
//   -> counter atomic (1) -> counter reset + fence (1) -> the combine's m pass (1) -> its (m, l, acc) pass (1)
//   -> o stores: 8 round trips in decode_attention alone, ~11 with rope_kv_write, two launches.
// After (one launch; length, mask, positions, cos / sin and the cached K/V stages are loaded before the wait):
//   qkv q / k / v (1) -> partial stores + fence (1) -> counter atomic (1) -> the combine's single pass over
//   (m, l, acc) of <= CAP splits (1; CAP = 8, 2 at D = 128) -> o stores: 4 round trips (1 with one split).
//   decode_attention itself gets the last two changes (counter reset after the fence, one-pass combine): 8 -> 6.
//   Predicted at ~0.6-1 us a trip: rope_kv + dattn ~9.7 us -> ~3-4.5 us a layer (NOTES.md, session 6).
//
// Grid (splits, Hkv * RG, B); 128 threads. Workspace rows (splits > 1): ((b * Hkv + j) * splits + split) * R + rr,
// R = G * Tq, row rr = t * G + (h - j * G); counter of (b, j, row group rg): b * Hkv * RG + j * RG + rg.

// Arguments of one launch (the entry points fill it; the body is inlined into each).
struct DArgs {
  const bf16* q;                       // decode_attention: q [B, Tq, H, D] (element strides qb, qt, qh)
  long long qb, qt, qh;
  const bf16* qkv;                     // fused: the packed projection, batch stride sb (elements), 1 token
  long long sb;
  int qkv_vec;                         //   qkv pointer and sb 16-byte aligned: 16-byte loads, else 2-byte
  const float* cos_t;                  //   rotary tables [Lc, D / 2] (nullptr: no rotation, GPT-2)
  const float* sin_t;
  const void* positions;               //   int32 / int64 (pos_esz 4 / 8): pos_mode 0 none (p = 0), 1 [1], 2 [B, 1]
  int pos_esz, pos_mode, Lc, cs_vec;
  bf16* k;                             // caches [B, Lmax, Hkv, D] (element strides); written by the fused kernel
  bf16* v;
  long long kb, kt, kh, vb, vt, vh;
  const int* len_ptr;                  // the length (after the append) on the device, or len_val
  int len_val;
  const unsigned char* mask;           // key_mask [B, Lmax] (row stride mask_b elements of mask_esz bytes)
  long long mask_b;
  int mask_esz;
  float* ws;
  bf16* out;
  int Tq, H, Hkv, Lmax, splits, RG;
  float scale;
  int window;                          // sliding window in keys; INT_MAX: none
  int direct;
};

// rope_kv's rotation of one (x1, x2) pair, shared by rope_kv and the fused kernel: the roundings are spelled out
// (mul.rn / sub.rn / fma.rn) so that neither NVVM nor ptxas picks a different contraction in the two kernels
// (left to them, rope_kv compiled to mul, mul, sub / mul, fma and ptxas was free to fuse the first).
__device__ __forceinline__ void rope_rotate(float x1, float x2, float c, float sn, float& y1, float& y2) {
  y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, sn));
  y2 = __fmaf_rn(x1, sn, __fmul_rn(x2, c));
}

using Chunk8 = Chunk<bf16, 8, true>;  // 8 bf16 in 4 registers

// 8 bf16 from p: one 16-byte load when vec (p 16-byte aligned), else eight 2-byte loads (a misaligned view).
__device__ __forceinline__ void load8(Chunk8& c, const bf16* p, bool vec) {
  if (vec) {
    c.load(p);
    return;
  }
  const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) c.w[0].v[i] = (unsigned)s[2 * i] | ((unsigned)s[2 * i + 1] << 16);
}

__device__ __forceinline__ void zero8(Chunk8& c) {
#pragma unroll
  for (int i = 0; i < 4; ++i) c.w[0].v[i] = 0u;
}

// The pair (x1 = first-half chunk, x2 = second-half chunk) rotated with the 8 (cos, sin) of its columns and
// rounded once to bf16: rope_kv's arithmetic (f1 = y1 -> dst, f2 = y2 -> dst + D / 2).
__device__ __forceinline__ void rotate8(Chunk8& x1, Chunk8& x2, const float (&c)[8], const float (&sn)[8]) {
  float f1[8], f2[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) rope_rotate(x1.get(k), x2.get(k), c[k], sn[k], f1[k], f2[k]);
  x1.pack(f1);
  x2.pack(f2);
}

// The last block's combine of the `active` split partials of its rows (splits in order: deterministic; shared
// by both kernels, so their outputs agree bit for bit). One thread per (row, 4 columns). With at most
// CAP splits a thread issues every (m, l, acc) load of its unit at once (one L2 round trip) and then
// does the arithmetic from registers; with more, the former two passes (m, then (m, l, acc), AU splits' loads in
// flight). Either way: M = max_s m_s, then in split order sc = 2^(m_s - M) (0 for an empty split),
// L += sc * l_s, A += sc * acc_s; o = A / L (0 when L = 0). __ldcg: through L2, never a stale L1 line.
template <int D, int MTB>
__device__ __forceinline__ void combine_splits(const float* __restrict__ ws, bf16* __restrict__ out,
                                               long long nrow_total, int b, int j, int Hkv, int splits, int R,
                                               int row0, int G, int Tq, int H, int active) {
  const float* ml = ws + nrow_total * D;
  const long long gbase = ((long long)b * Hkv + j) * splits * R;  // row rr of split s: gbase + s * R + rr
  const int nr = min(MTB * 16, R - row0);
  constexpr int Q4 = D / 4;
  // Loads of AU splits in flight per thread on the long path; AU = 4 at D = 128 spills under the 170-register
  // cap of 3 blocks / SM (ptxas, sm_90), 2 does not. CAP splits in registers: 6 floats a split
  // (48 registers at 8); at D = 128 CAP = 4 spilled dattn_split_d128_m1/m2 under the same cap (ptxas, sm_90:
  // 8-16 bytes of stack), 2 does not.
  constexpr int AU = D == 128 ? 2 : 4;
  constexpr int CAP = D == 128 ? 2 : 8;
  for (int u = threadIdx.x; u < nr * Q4; u += NT) {
    const int rr = row0 + u / Q4, c = (u % Q4) * 4;
    const long long w0 = gbase + rr;
    float M = -CK_INF;
    float A0 = 0.f, A1 = 0.f, A2 = 0.f, A3 = 0.f, Ls = 0.f;
    if (active <= CAP) {
      float mv[CAP], lv[CAP];
      float4 xv[CAP];
#pragma unroll
      for (int s = 0; s < CAP; ++s) {
        if (s < active) {
          const long long wr = w0 + (long long)s * R;
          mv[s] = __ldcg(ml + wr * 2);
          lv[s] = __ldcg(ml + wr * 2 + 1);
          xv[s] = __ldcg(reinterpret_cast<const float4*>(ws + wr * D + c));
        }
      }
#pragma unroll
      for (int s = 0; s < CAP; ++s)
        if (s < active) M = fmaxf(M, mv[s]);
#pragma unroll
      for (int s = 0; s < CAP; ++s) {
        if (s < active) {  // splits in order: deterministic
          const float sc = mv[s] == -CK_INF ? 0.f : ex2(mv[s] - M);
          Ls += sc * lv[s];
          A0 += sc * xv[s].x;
          A1 += sc * xv[s].y;
          A2 += sc * xv[s].z;
          A3 += sc * xv[s].w;
        }
      }
    } else {
#pragma unroll 8
      for (int s = 0; s < active; ++s) M = fmaxf(M, __ldcg(ml + (w0 + (long long)s * R) * 2));
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

template <int D, int MTB, bool FUSED>
__device__ __forceinline__ void dattn(const DArgs& a) {
  using LY = Layout<D, MTB>;
  constexpr int LD = LY::LD, KG = LY::KG, STAGE = LY::STAGE, CH = D / 8;  // CH: 16-byte chunks per row
  constexpr int HALF = D / 2, CU = D / 16;         // fused: 8-element chunks per half head
  constexpr int QU = MTB * 16 * CU;                 // fused: Q-tile units (row, chunk pair)
  constexpr int QI = (QU + NT - 1) / NT;            //   per thread (NT is a multiple of CU: a thread keeps one cu)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
  bf16* Ks = reinterpret_cast<bf16*>(smem_raw + LY::Q_BYTES);  // [2][STAGE][LD]
  bf16* Vs = Ks + 2 * STAGE * LD;                               // [2][STAGE][LD]
  unsigned* bits = reinterpret_cast<unsigned*>(smem_raw + LY::Q_BYTES + LY::AREA);

  const int split = blockIdx.x, j = blockIdx.y / a.RG, rg = blockIdx.y % a.RG, b = blockIdx.z;
  const int Tq = FUSED ? 1 : a.Tq;
  const int H = a.H, Hkv = a.Hkv, splits = a.splits;
  const int G = H / Hkv, R = G * Tq;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c2 = (lane & 3) * 2;
  const int rt = warp % MTB, kg = warp / MTB;

  if (!FUSED) {
    // Everything below reads what the previous kernel may write (q, the cache, cache_len) or writes what the
    // kernels before may still read (ws, o): wait for them first, then let the next PDL kernel be scheduled.
    pdl_wait();
    pdl_trigger();
  }

  const int Lraw = a.len_ptr != nullptr ? __ldcg(a.len_ptr) : a.len_val;
  const int L = min(max(Lraw, 0), a.Lmax);  // (a device value outside [0, Lmax] is not trusted blindly)
  // The fused kernel's newest position: where rope_kv_write would have appended (none when the raw length is
  // outside [1, Lmax]: then it writes nothing and every key comes from the cache, as in the composition).
  const int newest = FUSED && Lraw >= 1 && Lraw <= a.Lmax ? Lraw - 1 : -1;
  // The first key any query sees: the first query (position L - Tq) sees back to L - Tq + 1 - W (64-bit: no
  // window is W = INT_MAX). The splits share [lo, L).
  const int lo = (int)max(0LL, (long long)L - Tq + 1 - a.window);
  const int span = L - lo;
  const int chunk = chunk_length(span, splits, STAGE);
  const long long k0l = lo + (long long)split * chunk;
  const int k0 = (int)min(k0l, (long long)L);
  const int kend = (int)min(k0l + chunk, (long long)L);
  // Splits that hold keys: ceil(span / chunk) (<= splits since chunk >= span / splits); with span == 0 split 0
  // still runs (no keys: m = -inf, l = 0) so that the combine writes the zeros.
  const int active = chunk > 0 ? (span + chunk - 1) / chunk : 1;
  if (!a.direct && split >= active) return;  // nothing of this split is in the cache: not counted, not combined
  const int ntiles = kend > k0 ? (kend - k0 + STAGE - 1) / STAGE : 0;
  const bool has_mask = a.mask != nullptr;
  const int row0 = rg * MTB * 16;

  // ---- decode_attention: the Q tile (rows r -> (t, head) of this K/V head's group; rows >= R zeros), in the
  // cp.async group of the first K/V stage.
  if (!FUSED) {
#pragma unroll
    for (int i = 0; i < (MTB * 16 * CH + NT - 1) / NT; ++i) {
      const int c = threadIdx.x + i * NT;
      if ((MTB * 16 * CH) % NT != 0 && c >= MTB * 16 * CH) break;
      const int r = c / CH, kc = (c % CH) * 8, rr = row0 + r;
      const bool ok = rr < R;
      const bf16* src =
          a.q + (ok ? b * a.qb + (long long)(rr / G) * a.qt + (long long)(j * G + rr % G) * a.qh + kc : 0);
      cp_async16(Qs + r * LD + kc, src, ok);
    }
  }

  // ---- key_mask bits of [k0, kend): bit i of the chunk <-> key k0 + i.
  const unsigned char* mrow = has_mask ? a.mask + b * a.mask_b * a.mask_esz : nullptr;
  if (has_mask) {
    const int nwords = (kend - k0 + 31) / 32;
    for (int w0 = warp * 8; w0 < nwords; w0 += NW * 8) {
      bool keep[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {  // all 8 loads issued before the first vote
        const int n = k0 + (w0 + u) * 32 + lane;
        keep[u] = n < kend && mask_keep(mrow, n, a.mask_esz);
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

  // The fused kernel: does this block hold the newest key (tile tn, stage row rn), and is this thread one of
  // the 2 CU that carry its k (threads < CU) / v (CU <= thread < 2 CU) chunk pairs?
  const bool has_new = FUSED && newest >= k0 && newest < kend;
  const int tn = has_new ? (newest - k0) / STAGE : -1, rn = has_new ? (newest - k0) % STAGE : 0;
  const bool nthr = has_new && threadIdx.x < 2 * CU;
  const int cu = threadIdx.x % CU;

  const bf16* kp = a.k + b * a.kb + j * a.kh;
  const bf16* vp = a.v + b * a.vb + j * a.vh;
  // Cached rows of one tile into stage buffer st. Keys at or past kend and masked keys are zero-filled
  // (src-size 0, nothing read); the fused kernel's newest row is not touched at all (it is stored from
  // registers: put_newest).
  auto load_stage = [&](int st, int tile) {
    const int n0 = k0 + tile * STAGE;
#pragma unroll
    for (int i = 0; i < (STAGE * CH + NT - 1) / NT; ++i) {
      const int c = threadIdx.x + i * NT;
      if ((STAGE * CH) % NT != 0 && c >= STAGE * CH) break;
      const int r = c / CH, kc = (c % CH) * 8, n = n0 + r;
      if (FUSED && n == newest) continue;
      const bool ok = n < kend && kept(n);
      cp_async16(Ks + (st * STAGE + r) * LD + kc, kp + (ok ? (long long)n * a.kt + kc : 0), ok);
      cp_async16(Vs + (st * STAGE + r) * LD + kc, vp + (ok ? (long long)n * a.vt + kc : 0), ok);
    }
  };
  // Two stages in flight from the start (both buffers are free): one cp.async group per tile, the Q tile of
  // decode_attention in tile 0's group. Fused: issued before pdl_wait (cached rows only).
  if (ntiles > 0) load_stage(0, 0);
  cp_async_commit();
  if (ntiles > 1) load_stage(1, 1);
  cp_async_commit();

  // ---- fused: the rotary (cos, sin) of this thread's 8 columns cu * 8 .. + 7, before the wait.
  const bool rot = FUSED && a.cos_t != nullptr;
  float cz[8], sz[8];
  if (rot) {
    long long p = 0;  // rope_kv's positions for token t = 0: mode 0 -> t, 1 -> positions[t], 2 -> positions[b, t]
    if (a.pos_mode != 0) {
      const long long i = a.pos_mode == 1 ? 0 : b;
      p = a.pos_esz == 8 ? (long long)__ldcg(reinterpret_cast<const long long*>(a.positions) + i)
                         : (long long)__ldcg(reinterpret_cast<const int*>(a.positions) + i);
    }
    p = p < 0 ? 0 : (p >= a.Lc ? a.Lc - 1 : p);
    load_f32<8>(a.cos_t + p * HALF + cu * 8, cz, a.cs_vec != 0);
    load_f32<8>(a.sin_t + p * HALF + cu * 8, sz, a.cs_vec != 0);
  }

  Chunk8 n1, n2;  // fused: the newest k or v chunk pair of this thread (nthr)
  auto put_newest = [&](int st) {  // into its stage row (zeros when the mask drops it, as a zero-filled copy)
    bf16* row = (threadIdx.x < CU ? Ks : Vs) + (st * STAGE + rn) * LD + cu * 8;
    n1.store(row);
    n2.store(row + HALF);
  };

  if (FUSED) {
    pdl_wait();  // the qkv GEMV has completed: its output is visible; the workspace, o and the cache row may be
    pdl_trigger();  // written (the kernels before have finished reading them)
    // One round trip: every q chunk pair of the Q tile and this thread's newest k / v pair, loaded together.
    const bf16* src = a.qkv + b * a.sb;
    Chunk8 x1[QI], x2[QI];
#pragma unroll
    for (int i = 0; i < QI; ++i) {
      const int u = threadIdx.x + i * NT, rr = row0 + u / CU;
      if (u < QU && rr < R) {
        const bf16* s = src + (long long)(j * G + rr) * D + cu * 8;  // Tq = 1: row rr is head j * G + rr
        load8(x1[i], s, a.qkv_vec);
        load8(x2[i], s + HALF, a.qkv_vec);
      }
    }
    if (nthr) {
      const bf16* s = src + (long long)(threadIdx.x < CU ? H + j : H + Hkv + j) * D + cu * 8;
      load8(n1, s, a.qkv_vec);
      load8(n2, s + HALF, a.qkv_vec);
    }
#pragma unroll
    for (int i = 0; i < QI; ++i) {
      const int u = threadIdx.x + i * NT, r = u / CU, rr = row0 + r;
      if (u < QU) {
        if (rr < R) {
          if (rot) rotate8(x1[i], x2[i], cz, sz);
        } else {
          zero8(x1[i]);
          zero8(x2[i]);
        }
        x1[i].store(Qs + r * LD + cu * 8);
        x2[i].store(Qs + r * LD + cu * 8 + HALF);
      }
    }
    if (nthr) {
      if (rot && threadIdx.x < CU) rotate8(n1, n2, cz, sz);
      if (rg == 0) {  // the append: one block per (b, j) writes the row (row group 0 of the newest's split)
        bf16* dst = threadIdx.x < CU ? a.k + b * a.kb + (long long)newest * a.kt + j * a.kh + cu * 8
                                     : a.v + b * a.vb + (long long)newest * a.vt + j * a.vh + cu * 8;
        n1.store(dst);
        n2.store(dst + HALF);
      }
      if (!kept(newest)) {
        zero8(n1);
        zero8(n2);
      }
      if (tn < 2) put_newest(tn);  // its buffer row is untouched by the copies and not yet read
    }
  }

  cp_async_wait<1>();  // tile 0 (and decode_attention's Q tile) has landed
  __syncthreads();     // (fused: the Q tile and the newest row stored by other threads)
  unsigned qf[D / 16][4];
  load_a_frags<D>(qf, Qs, rt * 16);

  // This thread's two rows (g, g + 8 of the warp's row tile) and the last key each may see (causal); a key n <=
  // lim is inside the row's window when lim - n < W.
  const int rr0 = row0 + rt * 16 + g, rr1 = rr0 + 8;
  const int lim0 = L - Tq + rr0 / G, lim1 = L - Tq + rr1 / G;
  const int causal_from = L - Tq + 1;  // the first key some query cannot see
  const float sl2 = a.scale * LOG2E;

  float acc[D / 8][4];
  zero(acc);
  float m0 = -CK_INF, m1 = -CK_INF, l0 = 0.f, l1 = 0.f;  // log2 units

  for (int it = 0; it < ntiles; ++it) {
    const int st = it & 1;
    cp_async_wait<1>();  // groups committed: tiles 0 .. it + 1: all but the newest (it + 1) complete
    __syncthreads();

    const int nb = k0 + it * STAGE + kg * BN;  // this warp's first key
    if (nb < kend) {                           // warp-uniform
      float s[BN / 8][4];
      zero(s);
      mma_abt<D, BN, LD>(s, qf, Ks + (st * STAGE + kg * BN) * LD);
      // Per-key masking where some key of the warp may be dropped: the key mask, past kend or the diagonal, or
      // (window, Tq > 1) below L - W, where some query's window starts (L - nb > W; never without a window).
      // The fused kernel (Tq = 1) has no such key: [lo, L) is its one query's window (and the check cost
      // dattn_rope_d64_m4 8 more bytes of spill on sm_80, ptxas 12.9).
      if (has_mask || nb + BN > min(kend, causal_from) || (!FUSED && L - nb > a.window)) {
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int n = nb + nt * 8 + c2 + (e & 1);
            const int lim = (e >> 1) ? lim1 : lim0;
            if (n >= kend || n > lim || (!FUSED && lim - n >= a.window) || !kept(n)) s[nt][e] = -CK_INF;
          }
        }
      }
      online_softmax_step<BN, D>(s, acc, m0, m1, l0, l1, sl2);
      mma_pb<BN, D, LD>(acc, s, Vs + (st * STAGE + kg * BN) * LD);
    }
    __syncthreads();  // the stage just read is refilled next
    if (it + 2 < ntiles) {
      load_stage(st, it + 2);
      if (FUSED && nthr && it + 2 == tn) put_newest(st);
    }
    cp_async_commit();  // (possibly empty: keeps one group per tile)
  }
  cp_async_wait<0>();
  __syncthreads();  // (ntiles == 0: the empty groups are drained before the area is re-used)

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
  // The counters (one per (b, j, row group): gridDim.z * gridDim.y) come first, padded to 16 bytes.
  int* const counters = reinterpret_cast<int*>(a.ws);
  float* const part = a.ws + (((long long)gridDim.z * gridDim.y + 3) & ~3LL);
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
    if (a.direct) {
      const int t = rr / G, h = j * G + rr % G;
      a.out[(((long long)b * Tq + t) * H + h) * D + d] = from_f32<bf16>(Ls > 0.f ? A / Ls : 0.f);
    } else {
      const long long wr = (((long long)b * Hkv + j) * splits + split) * R + rr;
      part[wr * D + d] = A;
      if (d == 0) {
        part[nrow_total * D + wr * 2] = M;
        part[nrow_total * D + wr * 2 + 1] = Ls;
      }
    }
  }
  if (a.direct) return;

  // ---- the last of the group's `active` blocks to get here combines them (threadFenceReduction pattern).
  __shared__ int s_last;
  __threadfence();   // this thread's partials are visible device-wide before the block is counted
  __syncthreads();
  int* cnt = counters + (long long)b * gridDim.y + blockIdx.y;
  if (threadIdx.x == 0) {
    const int seen = atomicAdd(cnt, 1);
    const int last = seen == active - 1;
    __threadfence();  // (acquire side) the others' partials are read after the count that saw them
    // Every live block has counted: zero for the next launch / graph replay. After the fence, so that nothing
    // waits for it (kernel completion makes it visible to the next launch).
    if (last) atomicExch(cnt, 0);
    s_last = last;
  }
  __syncthreads();
  if (!s_last) return;
  combine_splits<D, MTB>(part, a.out, nrow_total, b, j, Hkv, splits, R, row0, G, Tq, H, active);
}

// ================================================================================================ entry points
// dattn_split_d<D>_m<MTB> / dattn_rope_d<D>_m<MTB>: MTB row tiles of 16 per block (1, 2, 4). __launch_bounds__
// min blocks: register cap 65536 / (128 * MINB): D = 128 keeps 64 fp32 accumulators + 32 Q-fragment registers
// per thread (cap 170).
#define DATTN_SPLIT(D, MTB, MINB)                                                                               \
  CK_ENTRY(__launch_bounds__(NT, MINB), dattn_split_d##D##_m##MTB)(                                             \
      const bf16* q, const bf16* k, const bf16* v, const int* len_ptr, int len_val, const unsigned char* mask,   \
      long long mask_b, int mask_esz, float* ws, bf16* out, long long qb, long long qt, long long qh,           \
      long long kb, long long kt, long long kh, long long vb, long long vt, long long vh, int Tq, int H, int Hkv, \
      int Lmax, int splits, int RG, float scale, int window, int direct) {                                      \
    DArgs a;                                                                                                    \
    a.q = q; a.qb = qb; a.qt = qt; a.qh = qh;                                                                   \
    a.qkv = nullptr; a.sb = 0; a.qkv_vec = 0;                                                                   \
    a.cos_t = nullptr; a.sin_t = nullptr; a.positions = nullptr; a.pos_esz = 4; a.pos_mode = 0; a.Lc = 1;       \
    a.cs_vec = 0;                                                                                               \
    a.k = const_cast<bf16*>(k); a.v = const_cast<bf16*>(v);                                                     \
    a.kb = kb; a.kt = kt; a.kh = kh; a.vb = vb; a.vt = vt; a.vh = vh;                                           \
    a.len_ptr = len_ptr; a.len_val = len_val; a.mask = mask; a.mask_b = mask_b; a.mask_esz = mask_esz;          \
    a.ws = ws; a.out = out; a.Tq = Tq; a.H = H; a.Hkv = Hkv; a.Lmax = Lmax; a.splits = splits; a.RG = RG;       \
    a.scale = scale; a.window = window; a.direct = direct;                                                      \
    dattn<D, MTB, false>(a);                                                                                    \
  }
#define DATTN_ROPE(D, MTB, MINB)                                                                                \
  CK_ENTRY(__launch_bounds__(NT, MINB), dattn_rope_d##D##_m##MTB)(                                              \
      const bf16* qkv, long long sb, int qkv_vec, bf16* k, bf16* v, const int* len_ptr, int len_val,            \
      const float* cos_t, const float* sin_t, const void* positions, int pos_esz, int pos_mode, int Lc,          \
      int cs_vec, const unsigned char* mask, long long mask_b, int mask_esz, float* ws, bf16* out,              \
      long long kb, long long kt, long long kh, long long vb, long long vt, long long vh, int H, int Hkv,        \
      int Lmax, int splits, int RG, float scale, int window, int direct) {                                      \
    DArgs a;                                                                                                    \
    a.q = nullptr; a.qb = 0; a.qt = 0; a.qh = 0;                                                                \
    a.qkv = qkv; a.sb = sb; a.qkv_vec = qkv_vec;                                                                \
    a.cos_t = cos_t; a.sin_t = sin_t; a.positions = positions; a.pos_esz = pos_esz; a.pos_mode = pos_mode;      \
    a.Lc = Lc; a.cs_vec = cs_vec;                                                                               \
    a.k = k; a.v = v; a.kb = kb; a.kt = kt; a.kh = kh; a.vb = vb; a.vt = vt; a.vh = vh;                         \
    a.len_ptr = len_ptr; a.len_val = len_val; a.mask = mask; a.mask_b = mask_b; a.mask_esz = mask_esz;          \
    a.ws = ws; a.out = out; a.Tq = 1; a.H = H; a.Hkv = Hkv; a.Lmax = Lmax; a.splits = splits; a.RG = RG;        \
    a.scale = scale; a.window = window; a.direct = direct;                                                      \
    dattn<D, MTB, true>(a);                                                                                     \
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
DATTN_ROPE(32, 1, 4)
DATTN_ROPE(32, 2, 4)
DATTN_ROPE(32, 4, 4)
DATTN_ROPE(64, 1, 4)
DATTN_ROPE(64, 2, 4)
DATTN_ROPE(64, 4, 4)
DATTN_ROPE(128, 1, 3)
DATTN_ROPE(128, 2, 3)
DATTN_ROPE(128, 4, 3)

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
  CK_ENTRY(__launch_bounds__(256), kv_write_w##BYTES)(const W* src, W* dst, const int* len_ptr,                  \
                                                      int len_val,                                               \
                                                      long long sb, long long st, long long db, long long dt,    \
                                                      int Tq, int R, int Lmax, long long n) {                    \
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
// Rotation: ck.rope's rotate-half form (y1 = x1 c - x2 sn, y2 = x2 c + x1 sn, c = cos[p, i], sn = sin[p, i],
// pair (i, i + D/2)) in fp32 with the roundings spelled out (rope_rotate, shared with dattn_rope; ck.rope's
// compiler may contract differently: ~1 fp32 ulp), positions as ck.rope takes them (pos_mode 0: p = t, 1:
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
      rope_rotate(x1, x2, c[k], sn[k], f1[k], f2[k]);  // (shared with the fused kernel: the same bits)
    }
    Chunk<T, E, VEC> o1, o2;
    o1.pack(f1);
    o2.pack(f2);
    o1.store(dst);
    o2.store(dst + half);
  }
}

#define ROPE_KV(T, PT, TN, PN, VEC, VS)                                                                          \
  CK_ENTRY(__launch_bounds__(256), rope_kv_##TN##_##PN##_##VS)(                                                  \
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
