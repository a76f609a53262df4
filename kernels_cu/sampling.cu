// Token sampling on the device: greedy argmax, temperature, top-k, top-p, repetition penalty, a counter-based
// uniform (Philox4x32-10) from (seed, offset, row). One block per row of logits [B, V], V up to 128256 and
// beyond; no host sync, no allocation, graph-capturable (seed / offset / prev_len may live in device memory).
//
// Semantics, per row b (cukernels/ops/sampling.py's NumPy reference computes exactly this):
//   x_i  = logits[b, i] in fp32; repetition penalty (HF): a token present in prev_tokens[b, :prev_len] gets
//          x_i * (1 / penalty) if x_i > 0 else x_i * penalty (each token once, however often it appeared)
//   temperature <= 0: the argmax of x (ties -> lowest index; NaN never wins unless the row is all NaN -> 0)
//   v_i  = x_i * (1 / temperature); the row max m = max v (a non-finite m: the argmax of v, as greedy)
//   key  = the order-preserving uint32 image of v (NaN -> 0, -0 -> +0); thresholds are keys, ties kept
//   top-k: keep key >= the k-th largest key
//   mass_i = floor(expf(v_i - m) * 2^44) as uint64 (fixed point: every sum below is an exact integer sum, so
//          it does not depend on the summation order -- deterministic across block shapes and equal to the
//          reference bit for bit wherever expf agrees; a token below exp(-30.5) of the max has mass 0)
//   top-p: Z = sum of the top-k-kept masses, P = max(1, floor(double(top_p) * double(Z))); keep a token iff
//          the mass of kept tokens with a strictly larger key is < P (the smallest top set reaching top_p,
//          with all ties at the boundary)
//   draw: r = Philox4x32-10(counter = (b, 0, offset lo, offset hi), key = (seed lo, seed hi)), words 0 and 1
//          as one 64-bit integer; Z' = sum of the kept masses; target = floor(Z' * r / 2^64); the token is the
//          smallest index i (vocabulary order) whose inclusive prefix sum of kept masses exceeds target.
//
// Design: a row is too long to keep on chip (128256 fp32 = 513 KB), so each step is a pass over the row
// (from L2 after the first): pass 1 max + argmax; top-k and top-p each a windowed radix select of <= 3 passes
// (2048-bin histograms in shared memory, integer atomics only: counts, fixed-point masses); the draw one
// pass that sums each 32-lane chunk's kept mass into a per-chunk slot, a one-warp scan over <= 2048 slots,
// and a walk of the one chunk holding the crossing. No sort.
//   * Windowed radix select: the first window is the 2^24 keys below the row max (about two binades of v), in
//     2048 bins of 2^13 keys; elements above the window are counted in registers, elements below skipped. A
//     window holds few logits in practice (LLM logits bunch far below the max), so few shared-memory atomics
//     collide on one bin; a threshold below the window costs one extra pass over [0, window). Each pass
//     narrows the window to the one bin holding the threshold (2^13 -> 2^2 -> 1 key); it stops early when the
//     bin boundary already is an exact threshold (top-k: exactly k kept; top-p: one element in the bin).
//   * 512 threads, 16 warps; a warp reads a contiguous run of 16-byte packs, 4 in flight per lane (32 KB per
//     SM in flight: one row alone on an SM reads at ~100+ GB/s). Rows need not be 16-byte aligned (V = 50257):
//     the pass runs over the aligned packs around the row; only the two partial end packs use element loads.
//   * The penalty's token set is a V-bit bitmap in shared memory (16 KB at V = 128256), built per block.
//
// Greedy (temperature <= 0) has its own kernel, sample_greedy_*: one block per row reads 513 KB (fp32, V =
// 128256) through one SM's load pipe at ~17 GB/s (29.8 us on the H200, session 5), while the argmax is a pure
// streaming reduction. The row is cut into S slices of ~8 KB (S = 63 at fp32 V = 128256, chosen by the host:
// cukernels/ops/sampling.py greedy_splits), grid B * S blocks of 256 threads; each block reduces its slice to
// one (key, index) partial, stores it in a workspace, __threadfence() and bumps its row's int counter; the
// block that sees S - 1 is the row's last: it reduces the S partials, writes the token and puts the counter
// back to 0 (so the next launch or graph replay starts from zero without a memset). (key, index) is one
// 64-bit code, key << 32 | ~index: the max of the codes is the largest key with the lowest index, a total
// order, so the result is the same whatever order blocks finish in (no float atomics, integer max only).
// PDL-ready: pdl_wait() before any global access (logits, prev_tokens, prev_len, the workspace), then
// pdl_trigger(); nothing is read before the wait.
#include "common/entry.cuh"
#include "common/pdl.cuh"
#include "common/vec.cuh"

namespace {

constexpr int NT = 512;
constexpr int NWARP = NT / 32;
constexpr int U = 4;             // 16-byte packs per lane in flight
constexpr int NBIN = 2048;       // histogram bins (11 bits)
constexpr int HPAD = NBIN + NBIN / 64;  // one pad slot per 64 bins: a lane's 64-bin group starts in its own bank
constexpr unsigned WINDOW0 = 1u << 24;  // first window: the 2^24 keys below the row max
constexpr float MASS_ONE = 17592186044416.f;  // 2^44
constexpr unsigned KEY_MIN_FINITE = 0x00800000u;  // key(-FLT_MAX)
constexpr unsigned KEY_MAX_FINITE = 0xff7fffffu;  // key(+FLT_MAX)

__device__ __forceinline__ int hidx(int b) { return b + (b >> 6); }

// Order-preserving map float -> uint32 (NaN -> 0, the lowest; -0 and +0 -> the same key). Integer tests only:
// the kernels are built by CuPy with flush-to-zero float compares, under which `v == 0.f` held for subnormals
// and a row of subnormals lost its argmax to index 0 (session 5, H200: 1e-39 vs 3e-39 in fp32 and bf16).
__device__ __forceinline__ unsigned f2key(float v) {
  const unsigned b = __float_as_uint(v), mag = b & 0x7fffffffu;
  if (mag > 0x7f800000u) return 0u;            // NaN
  if (mag == 0u) return 0x80000000u;           // +-0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key2f(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ unsigned long long mass_of(float v, float m) {
  if ((__float_as_uint(v) & 0x7fffffffu) > 0x7f800000u) return 0ull;  // NaN (on the bits)
  // v <= m: expf in (0, 1]; truncated like NumPy's cast. __fsub_rn / __fmul_rn: never contracted into an FMA
  // with the products that made v, so the operands are the rounded fp32 values the reference sees.
  return (unsigned long long)__fmul_rn(expf(__fsub_rn(v, m)), MASS_ONE);
}

// ------------------------------------------------------------------------------------------ Philox4x32-10
// (Salmon et al., SC11; Random123's philox4x32 with its multipliers and Weyl key increments. The dropout family
// carries its own copy of the same generator.)
__device__ __forceinline__ void philox4x32_10(unsigned (&c)[4], unsigned k0, unsigned k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const unsigned lo0 = 0xD2511F53u * c[0], hi0 = __umulhi(0xD2511F53u, c[0]);
    const unsigned lo1 = 0xCD9E8D57u * c[2], hi1 = __umulhi(0xCD9E8D57u, c[2]);
    c[0] = hi1 ^ c[1] ^ k0;
    c[1] = lo1;
    c[2] = hi0 ^ c[3] ^ k1;
    c[3] = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// A seed / offset argument: by value, or read from a 0-d device array (kind 8: 64-bit; kind 4: int32,
// sign-extended).
__device__ __forceinline__ unsigned long long read_u64(const void* p, int kind, unsigned long long val) {
  if (p == nullptr) return val;
  if (kind == 4) return (unsigned long long)(long long)*reinterpret_cast<const int*>(p);
  return *reinterpret_cast<const unsigned long long*>(p);
}

// CuPy compiles every kernel with -ftz=true: a C++ float multiply becomes mul.rn.ftz.f32, which flushes a
// subnormal operand or product to 0 (x * 1 turned 1e-39 into 0), and a float compare becomes setp.ftz (a
// subnormal `> 0.f` or `== 0.f` tests as zero). NumPy (the reference) keeps subnormals, so the logit
// transform uses an IEEE multiply (mul.rn.f32 without .ftz: rounded, never contracted into an FMA, subnormals
// kept) and decides the sign on the bits.
__device__ __forceinline__ float fmul_ieee(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// x > 0 on the bits: sign clear and not +0 (a NaN counts as positive: x * pen and x * inv_pen are both NaN,
// as the reference's NaN * pen is).
__device__ __forceinline__ bool pos_bits(float x) { return (int)__float_as_uint(x) > 0; }

// ------------------------------------------------------------------------------------------ row access
// The transform applied to every raw logit (fp32): repetition penalty, then the temperature.
struct RowCtx {
  const unsigned* bitmap;  // shared: bit i set <=> token i is penalised
  float inv_temp, pen, inv_pen;
  bool use_pen;
  __device__ __forceinline__ float value(int i, float x) const {
    if (use_pen && ((bitmap[i >> 5] >> (i & 31)) & 1u)) x = fmul_ieee(x, pos_bits(x) ? inv_pen : pen);
    // x * 1 is x: skipped (greedy, temperature 1), so a subnormal logit is never at the mercy of a multiply.
    return inv_temp == 1.f ? x : fmul_ieee(x, inv_temp);
  }
};

// A row seen as 16-byte packs: position j = i + off, where off = the row's element offset inside its aligned
// pack, so packs at j = 0, E, 2E ... are 16-byte aligned. Chunk c = 32 lanes x E positions [c * 32E, ...).
template <typename T> struct RowView {
  static constexpr int E = 16 / sizeof(T);
  static constexpr int CH = 32 * E;
  const T* base;  // 16-byte aligned; never dereferenced below `off`
  int off, n;     // valid positions: [off, n), n = off + V
  __device__ __forceinline__ RowView(const T* row, int V) {
    off = (int)((reinterpret_cast<unsigned long long>(row) / sizeof(T)) % E);
    base = row - off;
    n = off + V;
  }
  __device__ __forceinline__ int chunks() const { return (n + CH - 1) / CH; }
  __device__ __forceinline__ int packs() const { return (n + E - 1) / E; }
  // Pack q (positions [qE, qE + E)) and the bit mask of its valid elements; only a row's two end packs can
  // be partial (element loads there).
  __device__ __forceinline__ unsigned load_at(int q, Pack<T, E>& p) const {
    const int j0 = q * E;
    if (j0 >= off && j0 + E <= n) {
      p = load_pack<T, E>(base + j0);
      return (1u << E) - 1u;
    }
    unsigned vm = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int j = j0 + e;
      const bool ok = j >= off && j < n;
      if (ok) p.v[e] = base[j];
      vm |= (unsigned)ok << e;
    }
    return vm;
  }
  // Lane `lane`'s E raw values of chunk c (kept as storage type: 4 registers for 8 bf16) and the bit mask of
  // the valid ones.
  __device__ __forceinline__ unsigned load(int c, int lane, Pack<T, E>& p) const {
    return load_at(c * 32 + lane, p);  // (positions c * CH + lane * E: pack c * 32 + lane)
  }
};

// One pass over the row: f(i, x) for every element (i = token index, x = raw fp32 logit). Warp w takes the
// contiguous chunk range [w * per, (w + 1) * per); U chunks' loads in flight per lane.
template <typename T, class F>
__device__ __forceinline__ void row_pass(const RowView<T>& rv, F&& f) {
  constexpr int E = RowView<T>::E, CH = RowView<T>::CH;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nch = rv.chunks(), per = (nch + NWARP - 1) / NWARP;
  const int c0 = warp * per, c1 = min(nch, c0 + per);
  for (int c = c0; c < c1; c += U) {
    Pack<T, E> x[U];
    unsigned vm[U];
#pragma unroll
    for (int u = 0; u < U; ++u) vm[u] = c + u < c1 ? rv.load(c + u, lane, x[u]) : 0u;
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int e = 0; e < E; ++e)
        if ((vm[u] >> e) & 1u) f((c + u) * CH + lane * E + e - rv.off, to_f32(x[u].v[e]));
  }
}

// ------------------------------------------------------------------------------------------ block helpers
struct Smem {
  unsigned hc[HPAD];                 // histogram counts
  unsigned long long hm[HPAD];       // histogram masses; the draw's per-chunk slot sums
  unsigned long long red[3][NWARP];  // block reductions
  unsigned redk[NWARP];
  int redi[NWARP];
  unsigned long long bc[4];          // results broadcast from warp 0
};

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// Exclusive prefix sum over lanes (lane 0 first) and the warp total.
__device__ __forceinline__ unsigned long long warp_excl_u64(unsigned long long v, unsigned long long& total) {
  const int lane = threadIdx.x & 31;
  unsigned long long inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long t = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += t;
  }
  total = __shfl_sync(0xffffffffu, inc, 31);
  return inc - v;
}

// Block sums of up to three uint64 values (integer: exact in any order). Every thread gets the totals.
__device__ __forceinline__ void block_sum3(unsigned long long& a, unsigned long long& b, unsigned long long& c,
                                           Smem& sm) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  a = warp_sum_u64(a);
  b = warp_sum_u64(b);
  c = warp_sum_u64(c);
  __syncthreads();  // the previous reduction's readers are done
  if (lane == 0) {
    sm.red[0][warp] = a;
    sm.red[1][warp] = b;
    sm.red[2][warp] = c;
  }
  __syncthreads();
  a = b = c = 0;
#pragma unroll
  for (int w = 0; w < NWARP; ++w) {
    a += sm.red[0][w];
    b += sm.red[1][w];
    c += sm.red[2][w];
  }
}

__device__ __forceinline__ bool better(unsigned k, int i, unsigned k2, int i2) {
  return k > k2 || (k == k2 && i < i2);
}
// Block argmax of (key, index): the largest key, the lowest index among equal keys.
__device__ __forceinline__ void block_argmax(unsigned& k, int& i, Smem& sm) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned k2 = __shfl_xor_sync(0xffffffffu, k, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(k2, i2, k, i)) {
      k = k2;
      i = i2;
    }
  }
  __syncthreads();
  if (lane == 0) {
    sm.redk[warp] = k;
    sm.redi[warp] = i;
  }
  __syncthreads();
  k = sm.redk[0];
  i = sm.redi[0];
#pragma unroll
  for (int w = 1; w < NWARP; ++w)
    if (better(sm.redk[w], sm.redi[w], k, i)) {
      k = sm.redk[w];
      i = sm.redi[w];
    }
}

// The smallest s with (NBIN << s) >= range: bins of 2^s keys cover the window.
__device__ __forceinline__ int shift_for(unsigned long long range) {
  int s = 0;
  while (((unsigned long long)NBIN << s) < range) ++s;
  return s;
}

__device__ __forceinline__ void clear_hist(Smem& sm, bool masses) {
  for (int i = threadIdx.x; i < HPAD; i += NT) {
    sm.hc[i] = 0u;
    if (masses) sm.hm[i] = 0ull;
  }
}

// ------------------------------------------------------------------------------------------ top-k
// The key tau with count(key >= tau) == the k kept tokens (tau = the k-th largest key, or a bin boundary that
// keeps exactly the same set). 1 <= k < V.
template <typename T>
__device__ unsigned select_topk(const RowView<T>& rv, const RowCtx& rc, unsigned maxkey, int k, Smem& sm) {
  const int lane = threadIdx.x & 31;
  unsigned long long hi = (unsigned long long)maxkey + 1;
  unsigned long long lo = hi > WINDOW0 ? hi - WINDOW0 : 0;
  for (int iter = 0; iter < 12; ++iter) {  // <= 3 narrowing passes (+1 per window miss); the cap is defensive
    const int s = shift_for(hi - lo);
    clear_hist(sm, false);
    __syncthreads();
    unsigned long long above = 0, below = 0, unused = 0;
    const unsigned hi32 = (unsigned)min(hi, 0xffffffffull), lo32 = (unsigned)lo;
    const bool hi_top = hi > 0xffffffffull;  // (never: maxkey is finite) keeps the compare exact
    row_pass(rv, [&](int i, float x) {
      const unsigned key = f2key(rc.value(i, x));
      if (!hi_top && key >= hi32) ++above;
      else if (key >= lo32) atomicAdd(&sm.hc[hidx((int)((key - lo32) >> s))], 1u);
      else ++below;
    });
    block_sum3(above, below, unused, sm);  // (its barriers also publish the histogram)
    if (threadIdx.x < 32) {
      // lane L: bins NBIN-1-64L down to NBIN-64-64L (top first)
      unsigned long long gs = 0;
#pragma unroll 4
      for (int t = 0; t < 64; ++t) gs += sm.hc[hidx(NBIN - 1 - lane * 64 - t)];
      unsigned long long total;
      unsigned long long run = warp_excl_u64(gs, total) + above;
      const bool mine = run < (unsigned long long)k && (unsigned long long)k <= run + gs;
      if (mine) {
#pragma unroll 4
        for (int t = 0; t < 64; ++t) {
          const int bin = NBIN - 1 - lane * 64 - t;
          run += sm.hc[hidx(bin)];
          if (run >= (unsigned long long)k) {
            sm.bc[0] = (unsigned long long)bin;
            sm.bc[1] = run;  // kept count through this bin
            break;
          }
        }
      }
      if (lane == 0 && above + total < (unsigned long long)k) sm.bc[0] = ~0ull;  // the k-th is below the window
    }
    __syncthreads();
    const unsigned long long bin = sm.bc[0], through = sm.bc[1];
    if (bin == ~0ull) {  // window miss: look below it
      if (below == 0 || lo == 0) return 0u;  // (cannot happen for k < V) keep everything
      hi = lo;
      lo = 0;
      continue;
    }
    const unsigned long long blo = lo + (bin << s);
    if (through == (unsigned long long)k || s == 0) return (unsigned)blo;
    lo = blo;
    hi = min(hi, blo + (1ull << s));
  }
  return 0u;
}

// ------------------------------------------------------------------------------------------ top-p
// Among tokens with key >= tau_k: the smallest key x whose tokens are kept, i.e. mass(key > x) < P.
template <typename T>
__device__ unsigned select_topp(const RowView<T>& rv, const RowCtx& rc, unsigned maxkey, float m, unsigned tau_k,
                                float top_p, Smem& sm) {
  const int lane = threadIdx.x & 31;
  unsigned long long hi = (unsigned long long)maxkey + 1;
  unsigned long long lo = hi > WINDOW0 ? hi - WINDOW0 : 0;
  if (lo < tau_k) lo = tau_k;
  unsigned long long P = 0;
  for (int iter = 0; iter < 12; ++iter) {
    const int s = shift_for(hi - lo);
    clear_hist(sm, true);
    __syncthreads();
    unsigned long long am = 0, bm = 0, bcount = 0;
    const unsigned hi32 = (unsigned)min(hi, 0xffffffffull), lo32 = (unsigned)lo;
    const bool hi_top = hi > 0xffffffffull;
    row_pass(rv, [&](int i, float x) {
      const float v = rc.value(i, x);
      const unsigned key = f2key(v);
      if (key < tau_k) return;
      const unsigned long long ms = mass_of(v, m);
      if (!hi_top && key >= hi32) {
        am += ms;
      } else if (key >= lo32) {
        const int bin = hidx((int)((key - lo32) >> s));
        atomicAdd(&sm.hc[bin], 1u);
        if (ms) atomicAdd(&sm.hm[bin], ms);
      } else {
        bm += ms;
        ++bcount;
      }
    });
    block_sum3(am, bm, bcount, sm);
    if (threadIdx.x < 32) {
      unsigned long long gs = 0;
#pragma unroll 4
      for (int t = 0; t < 64; ++t) gs += sm.hm[hidx(NBIN - 1 - lane * 64 - t)];
      unsigned long long wmass;
      unsigned long long run = warp_excl_u64(gs, wmass) + am;  // mass of kept tokens above this lane's group
      unsigned long long p = P;
      if (p == 0) {  // first pass: Z = every top-k-kept token's mass
        const double z = (double)(am + wmass + bm);
        p = (unsigned long long)((double)top_p * z);
        if (p < 1) p = 1;
      }
      int cand = 0x7fffffff;  // the lowest non-empty bin whose mass above is < P
#pragma unroll 4
      for (int t = 0; t < 64; ++t) {
        const int bin = NBIN - 1 - lane * 64 - t;
        if (run < p && sm.hc[hidx(bin)] > 0u) cand = bin;
        run += sm.hm[hidx(bin)];
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) cand = min(cand, __shfl_xor_sync(0xffffffffu, cand, o));
      if (lane == 0) {
        const bool miss = am + wmass < p && bcount > 0;
        sm.bc[0] = miss || cand == 0x7fffffff ? ~0ull : (unsigned long long)cand;
        sm.bc[1] = cand == 0x7fffffff ? 0ull : sm.hc[hidx(cand)];
        sm.bc[2] = p;
      }
    }
    __syncthreads();
    const unsigned long long bin = sm.bc[0], cnt = sm.bc[1];
    P = sm.bc[2];
    if (bin == ~0ull) {  // the threshold lies below the window
      if (bcount == 0 || lo <= tau_k) return tau_k;  // (defensive: the window already reached tau_k)
      hi = lo;
      lo = tau_k;
      continue;
    }
    const unsigned long long blo = lo + (bin << s);
    if (cnt == 1 || s == 0) return (unsigned)blo;
    lo = blo;
    hi = min(hi, blo + (1ull << s));
  }
  return tau_k;
}

// ------------------------------------------------------------------------------------------ the draw
// The smallest index whose inclusive prefix sum of kept masses (key >= tau) exceeds floor(Z * r / 2^64).
template <typename T>
__device__ int draw(const RowView<T>& rv, const RowCtx& rc, float m, unsigned tau, unsigned long long r,
                    int fallback, Smem& sm) {
  constexpr int E = RowView<T>::E, CH = RowView<T>::CH;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nch = rv.chunks();
  const int per_slot = (nch + NBIN - 1) / NBIN;  // chunks per slot: 1 up to V = 2048 * 32 * E - E
  const int nslots = (nch + per_slot - 1) / per_slot;
  for (int i = threadIdx.x; i < nslots; i += NT) sm.hm[hidx(i)] = 0ull;
  __syncthreads();
  auto lane_masses = [&](int c, unsigned long long (&ms)[E]) {
    Pack<T, E> x;
    const unsigned vm = rv.load(c, lane, x);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      ms[e] = 0ull;
      if ((vm >> e) & 1u) {
        const float v = rc.value(c * CH + lane * E + e - rv.off, to_f32(x.v[e]));
        if (f2key(v) >= tau) ms[e] = mass_of(v, m);
      }
    }
  };
  {  // per-chunk kept mass -> its slot (integer atomics: exact, order-free)
    const int per = (nch + NWARP - 1) / NWARP;
    const int c0 = warp * per, c1 = min(nch, c0 + per);
    for (int c = c0; c < c1; c += U) {
      Pack<T, E> x[U];
      unsigned vm[U];
#pragma unroll
      for (int u = 0; u < U; ++u) vm[u] = c + u < c1 ? rv.load(c + u, lane, x[u]) : 0u;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (c + u >= c1) break;  // warp-uniform
        unsigned long long t = 0;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          if ((vm[u] >> e) & 1u) {
            const float v = rc.value((c + u) * CH + lane * E + e - rv.off, to_f32(x[u].v[e]));
            if (f2key(v) >= tau) t += mass_of(v, m);
          }
        }
        t = warp_sum_u64(t);
        if (lane == 0 && t) atomicAdd(&sm.hm[hidx((c + u) / per_slot)], t);
      }
    }
  }
  __syncthreads();
  if (warp == 0) {
    int tok = fallback;
    // slots in index order: lane L holds slots [64L, 64L + 64)
    unsigned long long gs = 0;
#pragma unroll 4
    for (int t = 0; t < 64; ++t) {
      const int s = lane * 64 + t;
      if (s < nslots) gs += sm.hm[hidx(s)];
    }
    unsigned long long Z;
    unsigned long long run = warp_excl_u64(gs, Z);
    const unsigned long long target = __umul64hi(Z, r);  // < Z when Z > 0
    int slot = -1;
    unsigned long long before = 0;
    if (run <= target && target < run + gs) {
#pragma unroll 4
      for (int t = 0; t < 64; ++t) {
        const int s = lane * 64 + t;
        const unsigned long long w = s < nslots ? sm.hm[hidx(s)] : 0ull;
        if (run + w > target) {
          slot = s;
          before = run;
          break;
        }
        run += w;
      }
    }
    const unsigned who = __ballot_sync(0xffffffffu, slot >= 0);
    if (who != 0u) {
      const int src = __ffs(who) - 1;
      slot = __shfl_sync(0xffffffffu, slot, src);
      before = __shfl_sync(0xffffffffu, before, src);
      const int ce = min(nch, (slot + 1) * per_slot);
      for (int c = slot * per_slot; c < ce; ++c) {
        unsigned long long ms[E];
        lane_masses(c, ms);
        unsigned long long ls = 0;
#pragma unroll
        for (int e = 0; e < E; ++e) ls += ms[e];
        unsigned long long ctot;
        const unsigned long long ex = warp_excl_u64(ls, ctot);
        if (before + ctot > target) {
          const unsigned hit = __ballot_sync(0xffffffffu, before + ex + ls > target);
          const int hl = __ffs(hit) - 1;
          int found = -1;
          if (lane == hl) {
            unsigned long long acc = before + ex;
#pragma unroll
            for (int e = 0; e < E; ++e) {
              acc += ms[e];
              if (found < 0 && acc > target) found = c * CH + lane * E + e - rv.off;
            }
          }
          found = __shfl_sync(0xffffffffu, found, hl);
          if (found >= 0) tok = found;
          break;
        }
        before += ctot;
      }
    }
    if (lane == 0) sm.bc[3] = (unsigned long long)(unsigned)tok;
  }
  __syncthreads();
  return (int)(unsigned)sm.bc[3];
}

// The repetition-penalty bitmap of one row over tokens [t0, t1): bit (t - t0) set for every token t among the
// row's previous prev_len (device value, or prev_len_val) tokens, clamped to prev_cols. Block-wide (THR threads a block),
// ends with a barrier; bits as words of 32 in shared memory.
template <int THR>
__device__ __forceinline__ void mark_prev_tokens(unsigned* bits, int t0, int t1, const int* pr, int prev_cols,
                                                 const int* prev_len_ptr, int prev_len_val) {
  const int nw = t1 > t0 ? (t1 - t0 + 31) >> 5 : 0;
  for (int w = threadIdx.x; w < nw; w += THR) bits[w] = 0u;
  __syncthreads();
  int plen = prev_len_ptr != nullptr ? *prev_len_ptr : prev_len_val;
  plen = min(max(plen, 0), prev_cols);
  for (int i = threadIdx.x; i < plen; i += THR) {
    const int t = pr[i];
    if (t >= t0 && t < t1) atomicOr(&bits[(t - t0) >> 5], 1u << ((t - t0) & 31));
  }
  __syncthreads();
}

// ------------------------------------------------------------------------------------------ the kernel body

template <typename T>
__device__ __forceinline__ void sample_row(const T* __restrict__ logits, long long ld, int V, int* __restrict__ out,
                                           float inv_temp, bool greedy, int top_k, float top_p, float pen,
                                           float inv_pen, const int* __restrict__ prev, long long prev_ld,
                                           int prev_cols, const int* __restrict__ prev_len_ptr, int prev_len_val,
                                           const void* seed_ptr, int seed_kind, unsigned long long seed_val,
                                           const void* off_ptr, int off_kind, unsigned long long off_val) {
  __shared__ Smem sm;
  extern __shared__ unsigned bitmap[];  // ceil(V / 32) words when the penalty is on
  const int b = blockIdx.x;
  const RowView<T> rv(logits + b * ld, V);
  RowCtx rc{bitmap, inv_temp, pen, inv_pen, prev != nullptr};

  if (rc.use_pen) {
    mark_prev_tokens<NT>(bitmap, 0, V, prev + b * prev_ld, prev_cols, prev_len_ptr, prev_len_val);
  }

  // pass 1: max and argmax of v
  unsigned bk = 0u;
  int bi = 0x7fffffff;
  row_pass(rv, [&](int i, float x) {
    const unsigned key = f2key(rc.value(i, x));
    if (better(key, i, bk, bi)) {
      bk = key;
      bi = i;
    }
  });
  block_argmax(bk, bi, sm);
  if (greedy || bk < KEY_MIN_FINITE || bk > KEY_MAX_FINITE) {
    if (threadIdx.x == 0) out[b] = bi;
    return;
  }
  const float m = key2f(bk);
  unsigned tau = 0u;
  if (top_k > 0 && top_k < V) tau = select_topk(rv, rc, bk, top_k, sm);
  if (top_p < 1.f) tau = select_topp(rv, rc, bk, m, tau, top_p, sm);

  const unsigned long long seed = read_u64(seed_ptr, seed_kind, seed_val);
  const unsigned long long offset = read_u64(off_ptr, off_kind, off_val);
  unsigned c[4] = {(unsigned)b, 0u, (unsigned)offset, (unsigned)(offset >> 32)};
  philox4x32_10(c, (unsigned)seed, (unsigned)(seed >> 32));
  const unsigned long long r = ((unsigned long long)c[0] << 32) | c[1];
  const int tok = draw(rv, rc, m, tau, r, bi, sm);
  if (threadIdx.x == 0) out[b] = tok;
}

// ------------------------------------------------------------------------------------------ greedy, split rows
constexpr int GNT = 256;          // threads of a greedy block
constexpr int GNW = GNT / 32;
constexpr int GU = 4;             // 16-byte packs a thread keeps in flight (an 8 KB slice: 2 a thread, 1 pass)

// (key, index) as one integer: a larger code is a larger key, or an equal key at a lower index. 0 (key 0 =
// NaN at "index -1") is below every real element, so an empty slice contributes nothing.
__device__ __forceinline__ unsigned long long gcode(unsigned key, int i) {
  return ((unsigned long long)key << 32) | (unsigned)~i;
}
__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// Block (s, b) = blockIdx.x = b * S + s: the argmax of slice s of row b (packs [s * pps, (s + 1) * pps) of
// the row's aligned packs, pps = ceil(packs / S)); with S > 1 the row's last block combines the S partials.
// Workspace (int32): [0, 2 * slots) the partials as (code >> 32, code & 0xffffffff) pairs at b * S + s;
// [2 * slots, 2 * slots + B) the per-row counters, 0 between launches.
template <typename T>
__device__ __forceinline__ void greedy_slice(const T* __restrict__ logits, long long ld, int V, int* __restrict__ out,
                                             int* __restrict__ ws, int slots, int S, float pen, float inv_pen,
                                             const int* __restrict__ prev, long long prev_ld, int prev_cols,
                                             const int* __restrict__ prev_len_ptr, int prev_len_val) {
  constexpr int E = RowView<T>::E;
  extern __shared__ unsigned sbits[];  // the penalty's bitmap of this slice's tokens (bit i - t0)
  __shared__ unsigned long long wred[GNW];
  pdl_wait();  // the logits (and prev_len, the workspace) come from the kernels before this one
  pdl_trigger();
  const int b = blockIdx.x / S, s = blockIdx.x - b * S;
  const RowView<T> rv(logits + b * ld, V);
  const int npk = rv.packs(), pps = (npk + S - 1) / S;
  const int p0 = s * pps, p1 = min(npk, p0 + pps);

  // The first loads go out before the penalty's bitmap is built: its prev_tokens reads overlap them.
  Pack<T, E> x[GU];
  unsigned vm[GU];
  int p = p0 + (int)threadIdx.x;
#pragma unroll
  for (int u = 0; u < GU; ++u) vm[u] = p + u * GNT < p1 ? rv.load_at(p + u * GNT, x[u]) : 0u;

  const bool use_pen = prev != nullptr;
  const int t0 = max(p0 * E - rv.off, 0), t1 = min(p1 * E - rv.off, V);  // the slice's tokens [t0, t1)
  if (use_pen) {  // (block-uniform)
    mark_prev_tokens<GNT>(sbits, t0, t1, prev + b * prev_ld, prev_cols, prev_len_ptr, prev_len_val);
  }

  unsigned long long best = 0ull;
  for (;;) {  // per-thread loop: no barrier inside
#pragma unroll
    for (int u = 0; u < GU; ++u)
#pragma unroll
      for (int e = 0; e < E; ++e)
        if ((vm[u] >> e) & 1u) {
          const int i = (p + u * GNT) * E + e - rv.off;
          float v = to_f32(x[u].v[e]);
          if (use_pen && ((sbits[(i - t0) >> 5] >> ((i - t0) & 31)) & 1u))
            v = fmul_ieee(v, pos_bits(v) ? inv_pen : pen);
          const unsigned long long c = gcode(f2key(v), i);
          best = c > best ? c : best;
        }
    p += GNT * GU;
    if (p >= p1) break;
#pragma unroll
    for (int u = 0; u < GU; ++u) vm[u] = p + u * GNT < p1 ? rv.load_at(p + u * GNT, x[u]) : 0u;
  }

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  best = warp_max_u64(best);
  if (lane == 0) wred[warp] = best;
  __syncthreads();
  if (warp != 0) return;
  best = warp_max_u64(lane < GNW ? wred[lane] : 0ull);
  if (S == 1) {
    if (lane == 0) out[b] = (int)~(unsigned)best;
    return;
  }
  int* cnt = ws + 2 * slots + b;
  unsigned last = 0u;
  if (lane == 0) {
    int* part = ws + 2 * (b * S + s);
    part[0] = (int)(unsigned)(best >> 32);
    part[1] = (int)(unsigned)best;
    __threadfence();  // the partial is visible device-wide before the count says so
    last = atomicAdd(cnt, 1) == S - 1 ? 1u : 0u;
  }
  if (!__shfl_sync(0xffffffffu, last, 0)) return;
  __threadfence();  // (acquire: the other blocks' partials, read from L2 below)
  unsigned long long m = 0ull;
  for (int t = lane; t < S; t += 32) {
    const unsigned* q = reinterpret_cast<const unsigned*>(ws) + 2 * (b * S + t);
    const unsigned long long c = ((unsigned long long)__ldcg(q) << 32) | __ldcg(q + 1);
    m = c > m ? c : m;
  }
  m = warp_max_u64(m);  // a max: the same token whichever block came last
  if (lane == 0) {
    out[b] = (int)~(unsigned)m;
    *cnt = 0;  // ready for the next launch / graph replay
  }
}

}  // namespace

#define GREEDY_KERNEL(TAG, T)                                                                                   \
  CK_ENTRY(__launch_bounds__(GNT), sample_greedy_##TAG)(                                                     \
      const T* logits, long long ld, int V, int* out, int* ws, int slots, int S, float pen, float inv_pen,       \
      const int* prev, long long prev_ld, int prev_cols, const int* prev_len_ptr, int prev_len_val) {            \
    greedy_slice<T>(logits, ld, V, out, ws, slots, S, pen, inv_pen, prev, prev_ld, prev_cols, prev_len_ptr,    \
                    prev_len_val);                                                                             \
  }

GREEDY_KERNEL(f32, float)
GREEDY_KERNEL(bf16, bf16)

#define SAMPLE_KERNEL(TAG, T)                                                                                   \
  CK_ENTRY(__launch_bounds__(NT), sample_tokens_##TAG)(                                                      \
      const T* logits, long long ld, int V, int* out, float inv_temp, bool greedy, int top_k, float top_p,       \
      float pen, float inv_pen, const int* prev, long long prev_ld, int prev_cols, const int* prev_len_ptr,      \
      int prev_len_val, const void* seed_ptr, int seed_kind, unsigned long long seed_val, const void* off_ptr,   \
      int off_kind, unsigned long long off_val) {                                                                \
    sample_row<T>(logits, ld, V, out, inv_temp, greedy, top_k, top_p, pen, inv_pen, prev, prev_ld, prev_cols,  \
                  prev_len_ptr, prev_len_val, seed_ptr, seed_kind, seed_val, off_ptr, off_kind, off_val);        \
  }

SAMPLE_KERNEL(f32, float)
SAMPLE_KERNEL(bf16, bf16)
