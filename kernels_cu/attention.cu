// Fused (flash-style) scaled-dot-product attention, bf16 in / bf16 out, fp32 softmax and accumulation.
//
// Math, per batch b and query head h (K/V head j = h / G with G = H / Hkv: grouped-query attention):
//   s[i, n] = scale * <q_i, k_n>,  masked to -inf where n >= Tk or (causal and n > i + Tk - Tq)
//             or (with a sliding window W, causal) i + Tk - Tq - n >= W
//             or (with a key-padding mask) key_mask[b, n] == 0
//   lse_i   = log sum_n exp(s[i, n]),  p[i, n] = exp(s[i, n] - lse_i),  o_i = sum_n p[i, n] v_n
// Backward (dO given):  delta_i = <dO_i, o_i>,  dP = dO V^T,  dS = P * (dP - delta)  (row-wise),
//   dQ = scale * dS K,  dK = scale * dS^T Q,  dV = P^T dO   (dK, dV summed over the G query heads of a group).
//
// Why: the materialised path (GEMM -> [B, H, Tq, Tk] scores -> softmax -> GEMM) moves the score matrix through
// HBM six times per layer in training; at B8 x T1024 x 32 heads that is 537 MB per pass in bf16, ~1.3 ms per
// layer on an H200. Here a block keeps a 64-row query tile on chip and streams 64-key K/V tiles through shared
// memory with an online softmax, so only q, k, v, o, dO and the per-row lse / delta touch HBM, and the causal
// upper triangle is never computed (half the FLOPs).
//
// Design (sm_80+, runs on sm_90 through the same instructions):
//   * Tensor cores through mma.sync.m16n8k16 (bf16 x bf16 -> fp32) with ldmatrix fragments; 4 warps per block,
//     each warp owns 16 rows of the 64-row tile; the S = Q K^T accumulators are re-packed in registers into the
//     A operand of the next product (P V, dS K ...), never written to shared memory.
//   * Tiles are copied global -> shared with cp.async (16-byte chunks, zero-filled past the sequence end) into
//     two stages, so the next tile's copy overlaps this tile's math. Shared rows are padded by 16 bytes: 8
//     consecutive rows of a 64-wide tile then start in 8 different bank groups, so ldmatrix is conflict-free.
//   * Backward = two kernels, no atomics (deterministic): attn_bwd_dq (one block per query tile, loops over its
//     key tiles, also writes delta) then attn_bwd_dkdv (one block per key tile of a K/V head, loops over the G
//     query heads and their query tiles). P is recomputed from lse in both: 7 tile products instead of 5,
//     against one float atomic per dQ element in the 5-product form.
//   * exp2 with scale * log2(e) folded in; lse is stored in natural-log units (the public contract) and
//     converted on load.
//   * Causal blocks are scheduled heaviest first (the longest key loops start in the first wave).
//   * Sliding windows (Mistral's sliding_window) in separate *_sw instantiations: the key tiles below every row's
//     window are neither loaded nor computed (fwd, dq), nor the query tiles past them (dkdv); see below.
//   * Key-padding masks ([B, Tk], Hugging Face's attention_mask) in separate *_km instantiations: per-column
//     keep bits from a warp ballot per key tile, tiles of padding only skipped (neither loaded nor computed), a
//     row that sees no real key gives o = 0, lse = -inf and contributes nothing to the backward.
//   * q, k, v, dO may be strided views ([B, T, heads, D] with any batch / token / head strides that are multiples
//     of 8 elements, 16-byte aligned): the projections' outputs are read in place, no transposes.
#include "common/entry.cuh"
#include "common/vec.cuh"
#include "common/mma.cuh"

namespace {

constexpr int NW = 4;          // warps per block
constexpr int NT = NW * 32;    // threads per block
constexpr int BM = NW * 16;    // query (dq, fwd) or key (dkdv) rows per block: 16 per warp
constexpr float LOG2E = 1.4426950408889634f;

// PTX helpers (cp.async, ldmatrix, mma.sync, ex2) and the Q K^T / P V fragment loops: common/mma.cuh.

// ------------------------------------------------------------------------------------------ tiles
// A [rows x D] bf16 tile in shared memory, rows padded to D + 8 elements (see the header comment).

// Copy rows [r0, r0 + ROWS) of a [T, D] slab (row stride `ld` elements) into shared `dst`; rows >= T are zeros.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, long long ld, int r0, int T) {
  constexpr int CH = D / 8;  // 16-byte chunks per row
#pragma unroll
  for (int i = 0; i < (ROWS * CH + NT - 1) / NT; ++i) {
    const int c = threadIdx.x + i * NT;
    if ((ROWS * CH) % NT != 0 && c >= ROWS * CH) break;
    const int r = c / CH, k = (c % CH) * 8;
    const bool ok = r0 + r < T;
    const bf16* s = src + (ok ? (long long)(r0 + r) * ld : 0) + k;
    cp_async16(dst + r * Tile<D>::LD + k, s, ok);
  }
}

// Key/value tile `jb` (rows jb * BN ..) into stage `st` of the double-buffered K and V areas ([2][BN][LD] each).
template <int D, int BN>
__device__ __forceinline__ void load_kv(bf16* Ks, bf16* Vs, int st, const bf16* kp, const bf16* vp, long long kld,
                                        long long vld, int jb, int Tk) {
  load_tile<D, BN>(Ks + st * BN * Tile<D>::LD, kp, kld, jb * BN, Tk);
  load_tile<D, BN>(Vs + st * BN * Tile<D>::LD, vp, vld, jb * BN, Tk);
}


// Set to -inf the elements of a warp's [16 x N] score tile (rows row0 + g, row0 + g + 8; columns col0 + ...)
// that the mask hides. ROWS_ARE_QUERIES: fwd / dq tiles (rows = queries, columns = keys); else dkdv's
// transposed tiles (rows = keys, columns = queries). Called only on tiles that touch the mask boundary.
// SW (the sliding-window instantiations, always causal): also key k < q + off - W + 1, out of the query's W keys.
template <int N, bool ROWS_ARE_QUERIES, bool SW = false>
__device__ __forceinline__ void apply_mask(float (&s)[N / 8][4], int row0, int col0, int Tk, int off, bool causal,
                                           int W = 0) {
  const int l = threadIdx.x & 31, g = l >> 2, c2 = (l & 3) * 2;
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = row0 + g + (e >> 1) * 8, c = col0 + nt * 8 + c2 + (e & 1);
      const int q = ROWS_ARE_QUERIES ? r : c, k = ROWS_ARE_QUERIES ? c : r;
      if (k >= Tk || (causal && k > q + off) || (SW && q + off - k >= W)) s[nt][e] = -CK_INF;
    }
  }
}

// ------------------------------------------------------------------------------------------ sliding window
// The SW = true instantiations (entry points *_sw, *_km_sw; one more argument, the window W >= 1, W < Tk: the
// launcher sends W >= Tk to the plain kernels, where it changes nothing) restrict the causal mask to a band:
// query i sees key n iff i + off - W < n <= i + off (Hugging Face's sliding_window_overlay). Tiles outside the
// band are never loaded or computed: fwd / dq start their key loop at the first tile the tile's first query can
// see (window_first), dkdv stops its query loop after the last query tile that sees the block's last key
// (window_last_query); only tiles that cross the band's lower edge take the element mask (window_cuts).
// At B2 x T8192 causal, W = 4096: 0.756 of the causal tile pairs at head_dim 128 (benchmarks/NOTES.md,
// "flash_attention").
//
// The first key a query tile starting at row q0 can see, or 0 (rows before the window's reach, or Tq > Tk).
__device__ __forceinline__ int window_first(int q0, int off, int W) { return max(0, q0 + off - W + 1); }
// The last query that sees one of keys [.., k1] (k1 the block's last real key), or -1 when none does.
__device__ __forceinline__ int window_last_query(int k1, int off, int W) { return max(-1, k1 - off + W - 1); }
// Whether the window hides one pair of a tile of queries [qa, qb] and keys [ka, ..]: the latest query against
// the earliest key.
__device__ __forceinline__ bool window_cuts(int qb, int ka, int off, int W) { return qb + off - ka >= W; }

// ------------------------------------------------------------------------------------------ key-padding mask
// The KM = true instantiations (entry points *_km) take a [B, Tk] key mask of 1-, 2-, 4- or 8-byte entries
// (bool / integer; nonzero = keep), row stride by value, read in place: no converted copy, no [Tq, Tk] mask.
// A key tile's mask is BN entries (64 bytes as uint8, 512 as int64) against 2 * BN * (D + 8) * 2 bytes of K/V
// (18 KB at D = 64): the read is noise. Each warp reads the tile's entries itself (lane l: keys n0 + l and
// n0 + 32 + l) and reduces them with warp votes: per key-loop iteration, two flags for the next tile (does it
// hold a real key; is it all real keys), and only for a partly padded tile the per-column keep bits (a ballot).
// No shared memory, no extra barrier; all warps read the same immutable entries, so every warp (and every
// block-level decision made from them, such as skipping a tile of padding) agrees.
struct KeyMask {
  const unsigned char* row;  // this batch row's first entry
  int esz;                   // bytes per entry: 1, 2, 4 or 8
};

// Keys past the sequence end count as padding. The load is clamped to the last key (Tk >= 1 wherever this is
// called) rather than skipped, so that a lane's loads are straight-line code and all in flight at once.
template <typename T> __device__ __forceinline__ bool kept_t(const unsigned char* row, int n, int Tk) {
  const T x = __ldg(reinterpret_cast<const T*>(row) + min(n, Tk - 1));
  return (n < Tk) & (x != 0);
}
__device__ __forceinline__ bool key_kept(const KeyMask& m, int n, int Tk) {
  switch (m.esz) {
    case 1: return kept_t<unsigned char>(m.row, n, Tk);
    case 2: return kept_t<unsigned short>(m.row, n, Tk);
    case 4: return kept_t<unsigned>(m.row, n, Tk);
    default: return kept_t<unsigned long long>(m.row, n, Tk);
  }
}

// Keep bits of key tile [n0, n0 + N): bit c of kw[w] <-> key n0 + 32 w + c (0 past Tk); the same in every lane.
// One switch on the entry size, then straight-line loads: a lane's N / 32 loads are in flight together.
template <typename T, int N>
__device__ __forceinline__ void tile_keep_t(unsigned (&kw)[N / 32], const unsigned char* row, int n0, int Tk) {
  const int l = threadIdx.x & 31;
  bool c[N / 32];
#pragma unroll
  for (int w = 0; w < N / 32; ++w) c[w] = kept_t<T>(row, n0 + 32 * w + l, Tk);
#pragma unroll
  for (int w = 0; w < N / 32; ++w) kw[w] = __ballot_sync(0xffffffffu, c[w]);
}
template <int N>
__device__ __forceinline__ void tile_keep(unsigned (&kw)[N / 32], const KeyMask& m, int n0, int Tk) {
  static_assert(N % 32 == 0, "key tiles are whole multiples of a warp's ballot");
  switch (m.esz) {
    case 1: tile_keep_t<unsigned char, N>(kw, m.row, n0, Tk); break;
    case 2: tile_keep_t<unsigned short, N>(kw, m.row, n0, Tk); break;
    case 4: tile_keep_t<unsigned, N>(kw, m.row, n0, Tk); break;
    default: tile_keep_t<unsigned long long, N>(kw, m.row, n0, Tk); break;
  }
}

// The state of key tile [n0, n0 + N), read once per key-loop iteration for the tile about to be prefetched:
// TILE_LIVE, it holds a real key (else it is neither loaded nor computed); TILE_FULL, all N keys are real
// (never for a tile that reaches past Tk): then only the causal rule can mask, and the keep bits are not needed.
// Two flags instead of the tile's keep words keep the loop at fwd d64's 168-register cap (carrying the words
// spilled); a partial tile (at most one or two per query tile for contiguous padding) reads its bits again.
constexpr int TILE_LIVE = 1, TILE_FULL = 2;
template <typename T, int N> __device__ __forceinline__ int tile_state_t(const unsigned char* row, int n0, int Tk) {
  const int l = threadIdx.x & 31;
  bool c[N / 32];
#pragma unroll
  for (int w = 0; w < N / 32; ++w) c[w] = kept_t<T>(row, n0 + 32 * w + l, Tk);
  bool any = false, all = true;
#pragma unroll
  for (int w = 0; w < N / 32; ++w) {
    any |= c[w];
    all &= c[w];
  }
  return (__any_sync(0xffffffffu, any) ? TILE_LIVE : 0) | (__all_sync(0xffffffffu, all) ? TILE_FULL : 0);
}
template <int N> __device__ __forceinline__ int tile_state(const KeyMask& m, int n0, int Tk) {
  switch (m.esz) {
    case 1: return tile_state_t<unsigned char, N>(m.row, n0, Tk);
    case 2: return tile_state_t<unsigned short, N>(m.row, n0, Tk);
    case 4: return tile_state_t<unsigned, N>(m.row, n0, Tk);
    default: return tile_state_t<unsigned long long, N>(m.row, n0, Tk);
  }
}
// apply_mask for the fwd / dq tiles (rows = queries) of a masked call: the key's keep bit (which also hides
// keys >= Tk) and the causal rule. Called only on tiles that are not TILE_FULL (a padding key, or keys >= Tk).
// A thread's columns are nt * 8 + c2 + {0, 1}: one run-time shift by c2 per word, then constant bit positions.
template <int N, bool SW = false>
__device__ __forceinline__ void apply_key_mask(float (&s)[N / 8][4], int row0, int col0, int off, bool causal,
                                               const unsigned (&kw)[N / 32], int W = 0) {
  const int l = threadIdx.x & 31, g = l >> 2, c2 = (l & 3) * 2;
#pragma unroll
  for (int w = 0; w < N / 32; ++w) {
    const unsigned bits = kw[w] >> c2;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int nt = w * 4 + t;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = row0 + g + (e >> 1) * 8, c = col0 + nt * 8 + c2 + (e & 1);
        if (!((bits >> (t * 8 + (e & 1))) & 1u) || (causal && c > r + off) || (SW && r + off - c >= W))
          s[nt][e] = -CK_INF;
      }
    }
  }
}


// Store a warp's 16 x D fp32 accumulator tile (times `mul`) as bf16 rows [row0, row0 + 16) of a [T, ld] slab.
template <int D>
__device__ __forceinline__ void store_rows(bf16* dst, long long ld, int row0, int T, const float (&acc)[D / 8][4],
                                           float mul0, float mul1) {
  const int l = threadIdx.x & 31, g = l >> 2, c = (l & 3) * 2;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    if (row0 + g < T)
      *reinterpret_cast<unsigned*>(dst + (long long)(row0 + g) * ld + nt * 8 + c) =
          pack_bf16(acc[nt][0] * mul0, acc[nt][1] * mul0);
    if (row0 + g + 8 < T)
      *reinterpret_cast<unsigned*>(dst + (long long)(row0 + g + 8) * ld + nt * 8 + c) =
          pack_bf16(acc[nt][2] * mul1, acc[nt][3] * mul1);
  }
}

struct Strides {
  long long b, t, h;
};

}  // namespace

// ================================================================================================ forward
// Grid (ceil(Tq / 64), H, B); 128 threads; dynamic shared memory: Q tile + 2 stages of (K, V) tiles.
// KM: a key-padding mask `km` (else unused). Key tiles whose keys are all masked are neither loaded nor
// computed: their scores would all be -inf, which leaves the online-softmax state (m, l, acc) unchanged.
// SW: the sliding window W (else unused): the key loop starts at the tile of window_first(q0).
template <int D, int BN, bool KM, bool SW>
__device__ __forceinline__ void attn_fwd(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                         const bf16* __restrict__ v, bf16* __restrict__ o, float* __restrict__ lse,
                                         Strides sq, Strides sk, Strides sv, int Tq, int Tk, int H, int Hkv,
                                         float scale, bool causal, KeyMask km, int W) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int LD = Tile<D>::LD;
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
  bf16* Ks = Qs + BM * LD;        // [2][BN][LD]
  bf16* Vs = Ks + 2 * BN * LD;    // [2][BN][LD]
  const int mb = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z, j = h / (H / Hkv);
  const int q0 = mb * BM, warp = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2;
  const int off = Tk - Tq;  // causal alignment: query i sees keys <= i + off
  const bf16* qp = q + b * sq.b + h * sq.h;
  const bf16* kp = k + b * sk.b + j * sk.h;
  const bf16* vp = v + b * sv.b + j * sv.h;
  const float sl2 = scale * LOG2E;

  int kend = Tk;
  if (causal) kend = min(Tk, q0 + BM + off);
  const int nkb = kend > 0 ? (kend + BN - 1) / BN : 0;
  const int jb0 = SW ? min(nkb, window_first(q0, off, W) / BN) : 0;  // first key tile (0 without a window)

  load_tile<D, BM>(Qs, qp, sq.t, q0, Tq);
  cp_async_commit();
  // KM: the tile about to be computed holds a real key (`live`) / only real keys (`full`), read by tile_state
  // when its prefetch was issued.
  bool live = nkb > jb0, full = true;
  if (KM && live) {
    const int t = tile_state<BN>(km, jb0 * BN, Tk);
    live = t & TILE_LIVE;
    full = t & TILE_FULL;
  }
  if (live) load_kv<D, BN>(Ks, Vs, 0, kp, vp, sk.t, sv.t, jb0, Tk);
  cp_async_commit();
  cp_async_wait<1>();  // Q has landed (the first K/V tile may still be in flight)
  __syncthreads();
  unsigned qf[D / 16][4];
  load_a_frags<D>(qf, Qs, warp * 16);

  float acc[D / 8][4];
  zero(acc);
  float m0 = -CK_INF, m1 = -CK_INF, l0 = 0.f, l1 = 0.f;  // rows g and g + 8 of this warp (log2 units)
  const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;

  for (int jb = jb0; jb < nkb; ++jb) {
    const int st = (jb - jb0) & 1;
    const bool live_cur = live, full_cur = full;
    live = jb + 1 < nkb;
    if (KM && live) {
      const int t = tile_state<BN>(km, (jb + 1) * BN, Tk);
      live = t & TILE_LIVE;
      full = t & TILE_FULL;
    }
    if (live) load_kv<D, BN>(Ks, Vs, st ^ 1, kp, vp, sk.t, sv.t, jb + 1, Tk);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    // A tile of padding only was not loaded and adds nothing. Every warp read the same state, so all skip
    // together, and the closing barrier can go too: nobody reads stage st in this iteration.
    if (KM && !live_cur) continue;

    float s[BN / 8][4];
    zero(s);
    mma_abt<D, BN, LD>(s, qf, Ks + st * BN * LD);

    const int n0 = jb * BN;
    // SW: the tile crosses the window's lower edge for the warp's last row (the tile start was chosen for the
    // block's first row, so later rows may still see none of its first keys).
    const bool cut = SW && window_cuts(q0 + warp * 16 + 15, n0, off, W);
    if (KM) {
      if (!full_cur) {  // padding in the tile, or keys past Tk: the keep bits (read again, L1 hits) and causal
        unsigned kw[BN / 32];
        tile_keep<BN>(kw, km, n0, Tk);
        apply_key_mask<BN, SW>(s, q0 + warp * 16, n0, off, causal, kw, W);
      } else if (cut || (causal && n0 + BN - 1 > q0 + warp * 16 + off)) {
        apply_mask<BN, true, SW>(s, q0 + warp * 16, n0, Tk, off, causal, W);
      }
    } else if (n0 + BN > Tk || (causal && n0 + BN - 1 > q0 + warp * 16 + off) || cut) {
      apply_mask<BN, true, SW>(s, q0 + warp * 16, n0, Tk, off, causal, W);
    }
    online_softmax_step<BN, D>(s, acc, m0, m1, l0, l1, sl2);
    mma_pb<BN, D, LD>(acc, s, Vs + st * BN * LD);
    __syncthreads();  // the next iteration's prefetch overwrites the stage just read
  }
  cp_async_wait<0>();

  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  // Output [B, Tq, H, D] contiguous; lse [B, H, Tq]. A row that saw no key (Tq > Tk under the causal
  // alignment, or every key it may see is padding) gets o = 0 and lse = -inf.
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  store_rows<D>(o + ((long long)b * Tq * H + h) * D, (long long)H * D, q0 + warp * 16, Tq, acc, inv0, inv1);
  if ((l & 3) == 0) {
    float* lp = lse + ((long long)b * H + h) * Tq;
    if (r0 < Tq) lp[r0] = l0 > 0.f ? (m0 + __log2f(l0)) / LOG2E : -CK_INF;
    if (r1 < Tq) lp[r1] = l1 > 0.f ? (m1 + __log2f(l1)) / LOG2E : -CK_INF;
  }
}

// ================================================================================================ backward: dQ
// Grid (ceil(Tq / 64), H, B). Shared: Q, dO tiles (O staged in the first K/V stage for delta), 2 stages of K, V.
// Also writes delta[B, H, Tq] = rowsum(dO * O) for attn_bwd_dkdv. KM: as in attn_fwd (tiles of padding only
// are skipped: their P is 0, so they add nothing to dQ). SW: as in attn_fwd (the same key tiles).
template <int D, int BN, bool FR, bool KM, bool SW>
__device__ __forceinline__ void attn_bwd_dq(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                            const bf16* __restrict__ v, const bf16* __restrict__ o,
                                            const bf16* __restrict__ dout, const float* __restrict__ lse,
                                            float* __restrict__ delta, bf16* __restrict__ dq, Strides sq,
                                            Strides sk, Strides sv, Strides sdo, int Tq, int Tk, int H, int Hkv,
                                            float scale, bool causal, KeyMask km, int W) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int LD = Tile<D>::LD;
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
  bf16* dOs = Qs + BM * LD;
  bf16* Ks = dOs + BM * LD;      // [2][BN][LD]
  bf16* Vs = Ks + 2 * BN * LD;   // [2][BN][LD]
  float* dls = reinterpret_cast<float*>(Vs + 2 * BN * LD);  // [BM] delta of the tile's rows
  const int mb = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z, j = h / (H / Hkv);
  const int q0 = mb * BM, warp = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2;
  const int off = Tk - Tq;
  const bf16* qp = q + b * sq.b + h * sq.h;
  const bf16* kp = k + b * sk.b + j * sk.h;
  const bf16* vp = v + b * sv.b + j * sv.h;
  const bf16* dop = dout + b * sdo.b + h * sdo.h;
  const bf16* op = o + ((long long)b * Tq * H + h) * D;  // o is our own contiguous [B, Tq, H, D]
  const float sl2 = scale * LOG2E;

  int kend = Tk;
  if (causal) kend = min(Tk, q0 + BM + off);
  const int nkb = kend > 0 ? (kend + BN - 1) / BN : 0;
  const int jb0 = SW ? min(nkb, window_first(q0, off, W) / BN) : 0;  // first key tile (0 without a window)

  // Stage 0: Q, dO and O. O is parked in K's stage 1 followed by V's two stages (3 * BN rows), which the key
  // loop only starts filling after the delta pass and a barrier.
  static_assert(3 * BN >= BM, "the O staging area needs 3 * BN >= BM rows");
  bf16* Os = Ks + BN * LD;
  load_tile<D, BM>(Qs, qp, sq.t, q0, Tq);
  load_tile<D, BM>(dOs, dop, sdo.t, q0, Tq);
  load_tile<D, BM>(Os, op, (long long)H * D, q0, Tq);
  cp_async_commit();
  bool live = nkb > jb0, full = true;  // KM: as in attn_fwd (this read's latency overlaps the copies above)
  if (KM && live) {
    const int t = tile_state<BN>(km, jb0 * BN, Tk);
    live = t & TILE_LIVE;
    full = t & TILE_FULL;
  }
  cp_async_wait<0>();
  __syncthreads();
  {  // delta: 2 threads per row
    const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < D / 2; ++c) {
      const int col = half * (D / 2) + c;
      acc += to_f32(dOs[r * LD + col]) * to_f32(Os[r * LD + col]);
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if (!half) {
      dls[r] = acc;
      if (q0 + r < Tq) delta[((long long)b * H + h) * Tq + q0 + r] = acc;
    }
  }
  // FR: the Q and dO fragments live in registers for the whole loop; else they are re-read from the (unchanged)
  // shared tiles before each product, 32 fewer live registers at D = 64 (a third resident block).
  unsigned qf[D / 16][4], dof[D / 16][4];
  if (FR) {
    load_a_frags<D>(qf, Qs, warp * 16);
    load_a_frags<D>(dof, dOs, warp * 16);
  }
  __syncthreads();  // O no longer needed: its area is reused by the K/V stages
  const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
  const float* lsp = lse + ((long long)b * H + h) * Tq;
  // lse in log2 units; padded rows and rows that saw no key (lse = -inf) get +inf: p = 2^(-inf) = 0, no NaN.
  auto lse2 = [&](int r) { const float x = r < Tq ? lsp[r] : CK_INF; return x == -CK_INF ? CK_INF : x * LOG2E; };
  const float lse0 = lse2(r0), lse1 = lse2(r1);
  const float dl0 = dls[warp * 16 + g], dl1 = dls[warp * 16 + g + 8];

  if (live) load_kv<D, BN>(Ks, Vs, 0, kp, vp, sk.t, sv.t, jb0, Tk);
  cp_async_commit();
  float acc[D / 8][4];
  zero(acc);
  for (int jb = jb0; jb < nkb; ++jb) {
    const int st = (jb - jb0) & 1;
    const bool live_cur = live, full_cur = full;
    live = jb + 1 < nkb;
    if (KM && live) {
      const int t = tile_state<BN>(km, (jb + 1) * BN, Tk);
      live = t & TILE_LIVE;
      full = t & TILE_FULL;
    }
    if (live) load_kv<D, BN>(Ks, Vs, st ^ 1, kp, vp, sk.t, sv.t, jb + 1, Tk);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (KM && !live_cur) continue;  // padding only: not loaded, adds nothing (see attn_fwd)
    float s[BN / 8][4], dp[BN / 8][4];
    zero(s);
    zero(dp);
    if (!FR) load_a_frags<D>(qf, Qs, warp * 16);
    mma_abt<D, BN, LD>(s, qf, Ks + st * BN * LD);
    if (!FR) load_a_frags<D>(dof, dOs, warp * 16);
    mma_abt<D, BN, LD>(dp, dof, Vs + st * BN * LD);
    const int n0 = jb * BN;
    // SW: the tile crosses the window's lower edge for the warp's last row (the tile start was chosen for the
    // block's first row, so later rows may still see none of its first keys).
    const bool cut = SW && window_cuts(q0 + warp * 16 + 15, n0, off, W);
    if (KM) {
      if (!full_cur) {  // padding in the tile, or keys past Tk: the keep bits (read again, L1 hits) and causal
        unsigned kw[BN / 32];
        tile_keep<BN>(kw, km, n0, Tk);
        apply_key_mask<BN, SW>(s, q0 + warp * 16, n0, off, causal, kw, W);
      } else if (cut || (causal && n0 + BN - 1 > q0 + warp * 16 + off)) {
        apply_mask<BN, true, SW>(s, q0 + warp * 16, n0, Tk, off, causal, W);
      }
    } else if (n0 + BN > Tk || (causal && n0 + BN - 1 > q0 + warp * 16 + off) || cut) {
      apply_mask<BN, true, SW>(s, q0 + warp * 16, n0, Tk, off, causal, W);
    }
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p0 = ex2(fmaf(s[nt][e], sl2, -lse0)), p1 = ex2(fmaf(s[nt][2 + e], sl2, -lse1));
        s[nt][e] = p0 * (dp[nt][e] - dl0);  // dS
        s[nt][2 + e] = p1 * (dp[nt][2 + e] - dl1);
      }
    }
    mma_pb<BN, D, LD>(acc, s, Ks + st * BN * LD);
    __syncthreads();
  }
  cp_async_wait<0>();
  store_rows<D>(dq + ((long long)b * Tq * H + h) * D, (long long)H * D, q0 + warp * 16, Tq, acc, scale, scale);
}

// ================================================================================================ backward: dK, dV
// Grid (ceil(Tk / 64), Hkv, B): a block owns 64 keys of K/V head j (16 per warp) and loops over the G query
// heads of the group and their query tiles (BQ rows each), accumulating dK and dV in registers.
// Shared: K, V tiles, then 2 stages of (Q, dO, lse, delta).
// KM: a padding key's P column is 0 for every query, so its dK and dV rows are 0. A block whose keys are all
// padding loads nothing and stores zeros. Otherwise padding rows are computed like the others and replaced by
// zeros on the store (a select, not a multiply: their unmasked p may overflow to inf, and their dS to NaN).
// That is exact because every product here is row-separable: row n of S^T, dP^T, P^T dO and dS^T Q depends
// only on key n, so those values never reach a real key's row. The loop then carries no mask work at all.
// SW: the query loop stops after the last query tile that sees the block's last key (window_last_query).
template <int D, int BQ, bool FR, bool KM, bool SW>
__device__ __forceinline__ void attn_bwd_dkdv(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                              const bf16* __restrict__ v, const bf16* __restrict__ dout,
                                              const float* __restrict__ lse, const float* __restrict__ delta,
                                              bf16* __restrict__ dk, bf16* __restrict__ dv, Strides sq,
                                              Strides sk, Strides sv, Strides sdo, int Tq, int Tk, int H,
                                              int Hkv, float scale, bool causal, KeyMask km, int W) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int LD = Tile<D>::LD;
  bf16* Ks = reinterpret_cast<bf16*>(smem_raw);
  bf16* Vs = Ks + BM * LD;
  bf16* Qs = Vs + BM * LD;          // [2][BQ][LD]
  bf16* dOs = Qs + 2 * BQ * LD;     // [2][BQ][LD]
  float* Ls = reinterpret_cast<float*>(dOs + 2 * BQ * LD);  // [2][BQ] lse * log2(e)
  float* Dls = Ls + 2 * BQ;                                 // [2][BQ] delta
  const int nb = blockIdx.x;  // heaviest (first) key tiles first under the causal mask
  const int j = blockIdx.y, b = blockIdx.z, G = H / Hkv;
  const int k0 = nb * BM, warp = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, c2 = (l & 3) * 2;
  const int off = Tk - Tq;
  const float sl2 = scale * LOG2E;
  const bf16* kp = k + b * sk.b + j * sk.h;
  const bf16* vp = v + b * sv.b + j * sv.h;

  // KM: keep0 / keep1, this thread's two key rows (k0 + warp * 16 + g, + 8) are real (keys past Tk are not:
  // they are never stored). `live`: the block holds a real key (block-uniform: one barrier); if not, it loads
  // nothing, skips the loop and stores zeros. The two flags are parked for the store in the K tile's row
  // padding (columns D .. D + 7, which neither cp.async nor ldmatrix touches): held in registers through the
  // loop they cost d128 a spilled register (ptxas, sm_90), as did an early return for dead blocks.
  bool live = true;
  if (KM) {
    const bool keep0 = key_kept(km, k0 + warp * 16 + g, Tk), keep1 = key_kept(km, k0 + warp * 16 + g + 8, Tk);
    if ((l & 3) == 0) {
      reinterpret_cast<unsigned short*>(Ks)[(warp * 16 + g) * LD + D] = keep0;
      reinterpret_cast<unsigned short*>(Ks)[(warp * 16 + g + 8) * LD + D] = keep1;
    }
    live = __syncthreads_or(keep0 || keep1);
  }
  if (live) {
    load_tile<D, BM>(Ks, kp, sk.t, k0, Tk);
    load_tile<D, BM>(Vs, vp, sv.t, k0, Tk);
  }
  cp_async_commit();
  // First query row that can see key k0 (causal): i + off >= k0.
  const int qstart = causal ? max(0, k0 - off) / BQ : 0;
  int qend = (Tq + BQ - 1) / BQ;  // one past the last query tile
  if (SW) qend = min(qend, (window_last_query(min(k0 + BM, Tk) - 1, off, W) + BQ) / BQ);
  const int nqb = qend - qstart;
  const int total = nqb > 0 && live ? G * nqb : 0;

  auto issue = [&](int it, int st) {
    const int h = j * G + it / nqb, qb = qstart + it % nqb;
    const int r = qb * BQ;
    load_tile<D, BQ>(Qs + st * BQ * LD, q + b * sq.b + h * sq.h, sq.t, r, Tq);
    load_tile<D, BQ>(dOs + st * BQ * LD, dout + b * sdo.b + h * sdo.h, sdo.t, r, Tq);
    for (int i = threadIdx.x; i < BQ; i += NT) {
      const bool ok = r + i < Tq;
      const long long row = ((long long)b * H + h) * Tq + r + i;
      const float x = ok ? lse[row] : CK_INF;  // padded rows and rows with no visible key: p = 2^(-inf) = 0
      Ls[st * BQ + i] = x == -CK_INF ? CK_INF : x * LOG2E;
      Dls[st * BQ + i] = ok ? delta[row] : 0.f;
    }
  };
  if (total > 0) issue(0, 0);
  cp_async_commit();
  cp_async_wait<1>();  // K and V have landed
  __syncthreads();
  unsigned kf[D / 16][4], vf[D / 16][4];  // FR: in registers for the whole loop (as in attn_bwd_dq)
  if (FR) {
    load_a_frags<D>(kf, Ks, warp * 16);
    load_a_frags<D>(vf, Vs, warp * 16);
  }

  float dka[D / 8][4], dva[D / 8][4];
  zero(dka);
  zero(dva);

  for (int it = 0; it < total; ++it) {
    const int st = it & 1;
    if (it + 1 < total) issue(it + 1, st ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const bf16* Qt = Qs + st * BQ * LD;
    const bf16* dOt = dOs + st * BQ * LD;
    const float* Lt = Ls + st * BQ;
    const float* Dt = Dls + st * BQ;
    const int r = (qstart + it % nqb) * BQ;
    // S^T (keys x queries) and dP^T = V dO^T.
    float s[BQ / 8][4], dp[BQ / 8][4];
    zero(s);
    zero(dp);
    if (!FR) load_a_frags<D>(kf, Ks, warp * 16);
    mma_abt<D, BQ, LD>(s, kf, Qt);
    if (!FR) load_a_frags<D>(vf, Vs, warp * 16);
    mma_abt<D, BQ, LD>(dp, vf, dOt);
    // Padded keys (>= Tk) are never stored, so only the causal boundary (and the window's) needs masking here.
    if ((causal && r + off < k0 + warp * 16 + 15) || (SW && window_cuts(r + BQ - 1, k0 + warp * 16, off, W)))
      apply_mask<BQ, false, SW>(s, k0 + warp * 16, r, Tk, off, causal, W);
#pragma unroll
    for (int nt = 0; nt < BQ / 8; ++nt) {
      const float2 lq = *reinterpret_cast<const float2*>(Lt + nt * 8 + c2);
      const float2 dq_ = *reinterpret_cast<const float2*>(Dt + nt * 8 + c2);
      const float p00 = ex2(fmaf(s[nt][0], sl2, -lq.x)), p01 = ex2(fmaf(s[nt][1], sl2, -lq.y));
      const float p10 = ex2(fmaf(s[nt][2], sl2, -lq.x)), p11 = ex2(fmaf(s[nt][3], sl2, -lq.y));
      s[nt][0] = p00;
      s[nt][1] = p01;
      s[nt][2] = p10;
      s[nt][3] = p11;
      dp[nt][0] = p00 * (dp[nt][0] - dq_.x);  // dS^T
      dp[nt][1] = p01 * (dp[nt][1] - dq_.y);
      dp[nt][2] = p10 * (dp[nt][2] - dq_.x);
      dp[nt][3] = p11 * (dp[nt][3] - dq_.y);
    }
    mma_pb<BQ, D, LD>(dva, s, dOt);   // dV += P^T dO
    mma_pb<BQ, D, LD>(dka, dp, Qt);   // dK += dS^T Q
    __syncthreads();
  }
  cp_async_wait<0>();
  if (KM) {  // padding rows -> 0 (the flags were written by this warp before the loop's barriers)
    const bool keep0 = reinterpret_cast<const unsigned short*>(Ks)[(warp * 16 + g) * LD + D] != 0;
    const bool keep1 = reinterpret_cast<const unsigned short*>(Ks)[(warp * 16 + g + 8) * LD + D] != 0;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      if (!keep0) dka[nt][0] = dka[nt][1] = dva[nt][0] = dva[nt][1] = 0.f;
      if (!keep1) dka[nt][2] = dka[nt][3] = dva[nt][2] = dva[nt][3] = 0.f;
    }
  }
  store_rows<D>(dk + ((long long)b * Tk * Hkv + j) * D, (long long)Hkv * D, k0 + warp * 16, Tk, dka, scale, scale);
  store_rows<D>(dv + ((long long)b * Tk * Hkv + j) * D, (long long)Hkv * D, k0 + warp * 16, Tk, dva, 1.f, 1.f);
}

// ================================================================================================ entry points
// attn_{fwd,bwd_dq,bwd_dkdv}_d{32,64,128}{SUF} (SUF empty in production; tune_attention.py's variants set it),
// and the key-masked attn_..._d{D}_km{SUF}, which take three more arguments: the mask's data, its row stride
// in elements and its element size in bytes (1, 2, 4, 8). Two entry points rather than a run-time null check:
// the unmasked kernels compile to exactly the code they had before masks existed (same registers, same PTX).
// The sliding-window twins attn_..._d{D}_sw{SUF} and attn_..._d{D}_km_sw{SUF} take the window W (int) after
// those: separate instantiations for the same reason. A run-time W in the plain kernels would cost the live
// register of the window edge through their loops, where they sit at their caps: fwd d64 166 / 168 (3 blocks
// per SM), its _km twin 168 / 168, and dkdv d128 already spills on sm_80 (ptxas, see below and build.KNOWN_LOCAL);
// with twins the plain kernels' PTX is unchanged (checked against the pre-window source: identical entries).
// Strides are in elements: (batch, token, head); the last axis is
// contiguous. Launch: 128 threads, dynamic shared memory as computed by cukernels/ops/attention.py (TILES).
#define CK_KM_PARAMS const unsigned char *km, long long kmld, int kmesz
#define CK_KM_ROW KeyMask{km + (long long)blockIdx.z * kmld * kmesz, kmesz}
#define CK_ATTN_FWD_1(D, BN, MINB, KM, SW, TAG, SUF, EXTRA, MASK, WIN)                                     \
  CK_ENTRY(__launch_bounds__(NT, MINB), attn_fwd_d##D##TAG##SUF)(                                            \
      const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, long long qb, long long qt,            \
      long long qh, long long kb, long long kt, long long kh, long long vb, long long vt, long long vh, int Tq, \
      int Tk, int H, int Hkv, float scale, bool causal EXTRA) {                                                \
    attn_fwd<D, BN, KM, SW>(q, k, v, o, lse, Strides{qb, qt, qh}, Strides{kb, kt, kh}, Strides{vb, vt, vh},    \
                            Tq, Tk, H, Hkv, scale, causal, MASK, WIN);                                         \
  }
#define CK_ATTN_DQ_1(D, BN, FR, MINB, KM, SW, TAG, SUF, EXTRA, MASK, WIN)                                  \
  CK_ENTRY(__launch_bounds__(NT, MINB), attn_bwd_dq_d##D##TAG##SUF)(                                         \
      const bf16* q, const bf16* k, const bf16* v, const bf16* o, const bf16* dout, const float* lse,          \
      float* delta, bf16* dq, long long qb, long long qt, long long qh, long long kb, long long kt,             \
      long long kh, long long vb, long long vt, long long vh, long long db, long long dt, long long dh, int Tq, \
      int Tk, int H, int Hkv, float scale, bool causal EXTRA) {                                                \
    attn_bwd_dq<D, BN, FR, KM, SW>(q, k, v, o, dout, lse, delta, dq, Strides{qb, qt, qh}, Strides{kb, kt, kh}, \
                                   Strides{vb, vt, vh}, Strides{db, dt, dh}, Tq, Tk, H, Hkv, scale, causal,    \
                                   MASK, WIN);                                                                 \
  }
#define CK_ATTN_DKDV_1(D, BQ, FR, MINB, KM, SW, TAG, SUF, EXTRA, MASK, WIN)                                \
  CK_ENTRY(__launch_bounds__(NT, MINB), attn_bwd_dkdv_d##D##TAG##SUF)(                                       \
      const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* delta,     \
      bf16* dk, bf16* dv, long long qb, long long qt, long long qh, long long kb, long long kt, long long kh,   \
      long long vb, long long vt, long long vh, long long db, long long dt, long long dh, int Tq, int Tk,      \
      int H, int Hkv, float scale, bool causal EXTRA) {                                                        \
    attn_bwd_dkdv<D, BQ, FR, KM, SW>(q, k, v, dout, lse, delta, dk, dv, Strides{qb, qt, qh},                   \
                                     Strides{kb, kt, kh}, Strides{vb, vt, vh}, Strides{db, dt, dh}, Tq, Tk, H, \
                                     Hkv, scale, causal, MASK, WIN);                                           \
  }
#define CK_COMMA ,
// Each instantiation defines the plain, the key-masked, the sliding-window and the masked sliding-window entry
// point with the same tiles and occupancy (the launcher's shared-memory sizes and grids serve all four).
#define CK_ATTN_FWD(D, BN, MINB, SUF)                                                                        \
  CK_ATTN_FWD_1(D, BN, MINB, false, false, , SUF, , KeyMask{}, 0)                                          \
  CK_ATTN_FWD_1(D, BN, MINB, true, false, _km, SUF, CK_COMMA CK_KM_PARAMS, CK_KM_ROW, 0)                   \
  CK_ATTN_FWD_1(D, BN, MINB, false, true, _sw, SUF, CK_COMMA int W, KeyMask{}, W)                          \
  CK_ATTN_FWD_1(D, BN, MINB, true, true, _km_sw, SUF, CK_COMMA CK_KM_PARAMS CK_COMMA int W, CK_KM_ROW, W)
#define CK_ATTN_DQ(D, BN, FR, MINB, SUF)                                                                     \
  CK_ATTN_DQ_1(D, BN, FR, MINB, false, false, , SUF, , KeyMask{}, 0)                                       \
  CK_ATTN_DQ_1(D, BN, FR, MINB, true, false, _km, SUF, CK_COMMA CK_KM_PARAMS, CK_KM_ROW, 0)                \
  CK_ATTN_DQ_1(D, BN, FR, MINB, false, true, _sw, SUF, CK_COMMA int W, KeyMask{}, W)                       \
  CK_ATTN_DQ_1(D, BN, FR, MINB, true, true, _km_sw, SUF, CK_COMMA CK_KM_PARAMS CK_COMMA int W, CK_KM_ROW, W)
#define CK_ATTN_DKDV(D, BQ, FR, MINB, SUF)                                                                   \
  CK_ATTN_DKDV_1(D, BQ, FR, MINB, false, false, , SUF, , KeyMask{}, 0)                                     \
  CK_ATTN_DKDV_1(D, BQ, FR, MINB, true, false, _km, SUF, CK_COMMA CK_KM_PARAMS, CK_KM_ROW, 0)              \
  CK_ATTN_DKDV_1(D, BQ, FR, MINB, false, true, _sw, SUF, CK_COMMA int W, KeyMask{}, W)                     \
  CK_ATTN_DKDV_1(D, BQ, FR, MINB, true, true, _km_sw, SUF, CK_COMMA CK_KM_PARAMS CK_COMMA int W, CK_KM_ROW, W)

// Tiles and resident blocks (benchmarks/tune_attention.py, H200, B8 x T1024 causal, D = 64; NOTES.md):
//   fwd  64-key tiles, 3 blocks per SM (166 registers): 205.7 us against 217.5 at 2 blocks (177 registers);
//   dq   32-key tiles, 3 blocks per SM (162 registers): 261.9 us against 282.3 with 64-key tiles at 2 blocks;
//   dkdv 64-query tiles, 2 blocks per SM (236 registers): 379.9 us; 32-query tiles at 3 blocks ran 423 us
//        (the K/V fragments kept in registers matter more there than the third block).
// 128-wide heads take 32-row tiles so that the fp32 accumulators fit in registers without spilling.
// The *_km kernels (ptxas, sm_90) stay at the same occupancy: fwd d64 168 registers, dq d64 162, dkdv d64 226;
// so do the *_sw / *_km_sw ones: fwd d64 168 / 168, dq d64 160 / 166, dkdv d64 236 / 230 (sm_80: 163 / 165,
// 156 / 160, 220 / 218; no spills but dkdv d128's on sm_80, as its twins': build.KNOWN_LOCAL).
// cukernels/ops/attention.py's TILES mirrors the tile columns.
CK_ATTN_FWD(32, 64, 1, )
CK_ATTN_FWD(64, 64, 3, )
CK_ATTN_FWD(128, 32, 1, )
CK_ATTN_DQ(32, 64, true, 1, )
CK_ATTN_DQ(64, 32, true, 3, )
CK_ATTN_DQ(128, 32, true, 1, )
CK_ATTN_DKDV(32, 64, true, 1, )
CK_ATTN_DKDV(64, 64, true, 1, )
CK_ATTN_DKDV(128, 32, true, 1, )
