// Token embedding: gather rows of a [V, D] table, and its gradient (dense, and sparse rows with a row list).
//
//   forward    out[p, :] = table[ids[p], :]                      p over all token positions (n of them)
//   backward   dtable[v, :] = sum over p with ids[p] == v of dout[p, :]   (rows never referenced stay 0)
//
// Out-of-range ids can never read or write outside the table: every kernel clamps an id to [0, V-1] and ORs 1
// into a device error word (a 0-d int32 array the caller inspects later; no host sync).
//
// Design (numbers for an H200, copy ceiling ~4.2 TB/s):
// - Forward is a pure gather: 2 * n * D * sizeof(T) bytes (one table row read, one output row written per
//   token). A row is split over TPR threads (32..1024, rows of fewer than 256 threads share a block), each
//   thread moving up to 4 packs of 16 bytes with all 4 loads issued before the stores (several in flight).
//   VEC=true needs D % (16 / sizeof(T)) == 0 and 16-byte aligned table and out (the launcher checks);
//   VEC=false moves single elements: any D, any alignment.
// - Backward is deterministic: no float atomics. The token positions are sorted by id with a stable LSD radix
//   sort on the device (8-bit digits: 1 pass for V <= 256, 2 for V <= 65536, 3 for V <= 2^24 (LLaMA-3's
//   128256 -> 3 passes); per pass: digit histogram per 2048-key tile, one-block exclusive scan of the
//   digit-major histogram, stable scatter where a key's rank inside its tile comes from __match_any_sync and
//   per-warp digit counters in shared memory, so equal ids keep position order). Integer atomics only
//   (shared-memory histogram), which are deterministic.
//   Then one warp per (run of equal ids, 64-pack column chunk) sums the run's dout rows in position order in
//   fp32 (4 rows x 2 packs = 8 independent 16-byte loads in flight per lane) and writes the row once: the
//   summation order is fixed by the data, so results are bit-identical run to run (and, in fp32, equal to
//   NumPy's np.add.at, which also adds in position order). The warp at a run's first position owns the run;
//   warps at other positions of the run exit at once.
//   Dense gradient without accumulate (emb_bwd_dense): run starts per table row by a binary search over the
//   sorted ids, then every table row written exactly once by its owner (zeros where no position refers to it):
//   no memset, no second write of the touched rows. accumulate (and the sparse rows) keep emb_bwd_reduce.
//   Known cost: a very long run (one id repeated thousands of times) is summed by one warp per column chunk
//   serially; a two-stage split of long runs would fix it (see benchmarks/NOTES.md).
// - Sparse rows (SparseRowGrad): the same sort + reduce adds into a persistent gradient buffer that is all
//   zero except the rows touched since the last zero(); the owner of a run records its id once per
//   generation: atomicExch(stamps[id], gen) != gen -> rows[atomicAdd(count, 1)] = id. zero() clears only
//   rows[0:count] (count read on the device) and bumps the generation on the device.
#include "common/entry.cuh"
#include "common/vec.cuh"

#define EMB_ERR_ID 1  // error word bit: an id outside [0, V) was clamped

template <int N, typename O>
__device__ __forceinline__ void store_f32(O* p, const float (&f)[N], bool vec) {
  constexpr int PER = 16 / sizeof(O);
  if constexpr (N * sizeof(O) % 16 == 0) {
    if (vec) {
#pragma unroll
      for (int c = 0; c < N / PER; ++c) {
        Pack<O, PER> r;
#pragma unroll
        for (int i = 0; i < PER; ++i) r.v[i] = from_f32<O>(f[c * PER + i]);
        store_pack<O, PER>(p + c * PER, r);
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) p[i] = from_f32<O>(f[i]);
}

template <typename I>
__device__ __forceinline__ long long clamp_id(I raw, long long V, int* err) {
  long long id = (long long)raw;
  if (id < 0 || id >= V) {
    atomicOr(err, EMB_ERR_ID);
    id = id < 0 ? 0 : V - 1;
  }
  return id;
}

// ---------------------------------------------------------------- forward: gather
// Block (TPR, RPB): threadIdx.y picks the token, threadIdx.x strides over the row's packs.
template <typename T, typename I, bool VEC>
__device__ __forceinline__ void emb_fwd(const I* __restrict__ ids, const T* __restrict__ table, T* __restrict__ out,
                                        int* __restrict__ err, long long n, long long V, int D) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  constexpr int U = 4;
  const int units = D / E;
  for (long long r = (long long)blockIdx.x * blockDim.y + threadIdx.y; r < n;
       r += (long long)gridDim.x * blockDim.y) {
    long long id = (long long)ids[r];
    if (id < 0 || id >= V) {
      if (threadIdx.x == 0) atomicOr(err, EMB_ERR_ID);
      id = id < 0 ? 0 : V - 1;
    }
    const T* src = table + id * D;
    T* dst = out + r * D;
    for (int u0 = threadIdx.x; u0 < units; u0 += U * blockDim.x) {
      Pack<T, E> p[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int u = u0 + k * blockDim.x;
        if (u < units) p[k] = load_pack<T, E>(src + (long long)u * E);
      }
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int u = u0 + k * blockDim.x;
        if (u < units) store_pack<T, E>(dst + (long long)u * E, p[k]);
      }
    }
  }
}

// ---------------------------------------------------------------- backward: stable radix sort of positions by id
constexpr int RS_THREADS = 256;  // 8 warps
constexpr int RS_ITEMS = 8;      // keys per thread
constexpr int RS_TILE = RS_THREADS * RS_ITEMS;
constexpr int RS_WARPS = RS_THREADS / 32;

// keys[p] = clamped id, vals[p] = p.
template <typename I>
__device__ __forceinline__ void emb_sort_prep(const I* __restrict__ ids, int n, long long V, int* __restrict__ keys,
                                              int* __restrict__ vals, int* __restrict__ err) {
  for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < n; p += gridDim.x * blockDim.x) {
    keys[p] = (int)clamp_id(ids[p], V, err);
    vals[p] = p;
  }
}

// hist[d * nblocks + b] = number of keys in tile b whose digit is d (all 256 digits written).
__device__ __forceinline__ void rs_hist(const int* __restrict__ keys, int n, int shift, int* __restrict__ hist) {
  __shared__ int cnt[256];
  for (int d = threadIdx.x; d < 256; d += blockDim.x) cnt[d] = 0;
  __syncthreads();
  const long long base = (long long)blockIdx.x * RS_TILE;
#pragma unroll
  for (int j = 0; j < RS_ITEMS; ++j) {
    const long long p = base + j * RS_THREADS + threadIdx.x;
    if (p < n) atomicAdd(&cnt[(keys[p] >> shift) & 255], 1);
  }
  __syncthreads();
  for (int d = threadIdx.x; d < 256; d += blockDim.x) hist[(long long)d * gridDim.x + blockIdx.x] = cnt[d];
}

// In-place exclusive scan of m ints by one block of 1024 threads, tiles of 4096 (4 consecutive per thread).
__device__ __forceinline__ void scan_excl_1block(int* __restrict__ a, long long m) {
  __shared__ int wsum[32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int carry = 0;
  for (long long base = 0; base < m; base += 4 * 1024) {
    int v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const long long i = base + tid * 4 + k;
      v[k] = i < m ? a[i] : 0;
    }
    const int tsum = v[0] + v[1] + v[2] + v[3];
    int incl = tsum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += t;
    }
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      int w = wsum[lane];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += t;
      }
      wsum[lane] = w;
    }
    __syncthreads();
    int run = carry + (warp ? wsum[warp - 1] : 0) + incl - tsum;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const long long i = base + tid * 4 + k;
      if (i < m) a[i] = run;
      run += v[k];
    }
    carry += wsum[31];
    __syncthreads();  // wsum is rewritten by the next tile
  }
}

// Stable scatter of tile b: warp w owns tile positions [w * 32 * ITEMS, (w + 1) * 32 * ITEMS), visited in
// order, 32 consecutive keys per step. Rank of a key = (scanned histogram: keys of smaller digits anywhere and
// of its digit in earlier tiles) + (its digit in earlier warps of this tile) + (its digit earlier in this warp).
__device__ __forceinline__ void rs_scatter(const int* __restrict__ kin, const int* __restrict__ vin,
                                           int* __restrict__ kout, int* __restrict__ vout, int n, int shift,
                                           const int* __restrict__ hist) {
  __shared__ int wcnt[RS_WARPS][256];
  __shared__ int gbase[256];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int d = threadIdx.x; d < 256; d += blockDim.x) {
#pragma unroll
    for (int w = 0; w < RS_WARPS; ++w) wcnt[w][d] = 0;
    gbase[d] = hist[(long long)d * gridDim.x + blockIdx.x];
  }
  __syncthreads();
  const long long wbase = (long long)blockIdx.x * RS_TILE + warp * 32 * RS_ITEMS;
  const unsigned lt = (1u << lane) - 1u;
  int key[RS_ITEMS], rank[RS_ITEMS];
#pragma unroll
  for (int j = 0; j < RS_ITEMS; ++j) {
    const long long p = wbase + j * 32 + lane;
    const bool valid = p < n;
    key[j] = valid ? kin[p] : 0;
    const int d = (key[j] >> shift) & 255;
    const unsigned mask = __match_any_sync(0xffffffffu, valid ? d : -1);
    const int leader = __ffs(mask) - 1;
    int before = 0;
    if (lane == leader && valid) {
      before = wcnt[warp][d];
      wcnt[warp][d] = before + __popc(mask);
    }
    before = __shfl_sync(0xffffffffu, before, leader);
    rank[j] = before + __popc(mask & lt);
    __syncwarp();
  }
  __syncthreads();
  // Exclusive prefix over warps, per digit.
  for (int d = threadIdx.x; d < 256; d += blockDim.x) {
    int run = 0;
#pragma unroll
    for (int w = 0; w < RS_WARPS; ++w) {
      const int c = wcnt[w][d];
      wcnt[w][d] = run;
      run += c;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < RS_ITEMS; ++j) {
    const long long p = wbase + j * 32 + lane;
    if (p < n) {
      const int d = (key[j] >> shift) & 255;
      const int dst = gbase[d] + wcnt[warp][d] + rank[j];
      kout[dst] = key[j];
      vout[dst] = vin[p];
    }
  }
}

// ---------------------------------------------------------------- backward: sum each run of equal ids
// Block (32, 8): warp (blockIdx.x * 8 + threadIdx.y) takes sorted position i; blockIdx.y picks a chunk of 64
// packs (VPT = 2 per lane) of the row. Only the warp at the first position of a run works; it sums the run's
// dout rows in position order (the sort is stable) into fp32 registers, starting from the current out row
// when `accumulate`, and writes the row once. With `stamps` non-null (sparse rows) the chunk-0 warp of a run
// records the id once per generation.
template <typename T, typename O, bool VEC>
__device__ __forceinline__ void emb_bwd_reduce(const int* __restrict__ sk, const int* __restrict__ sv,
                                               const T* __restrict__ dout, O* __restrict__ out, int n, int D,
                                               bool accumulate, bool o_vec, int* __restrict__ stamps,
                                               const int* __restrict__ gen, int* __restrict__ rows,
                                               int* __restrict__ count) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  constexpr int VPT = 2, UNR = 4;
  const long long i = (long long)blockIdx.x * blockDim.y + threadIdx.y;
  if (i >= n) return;
  const int id = sk[i];
  if (i > 0 && sk[i - 1] == id) return;  // not the first position of its run
  if (stamps != nullptr && blockIdx.y == 0 && threadIdx.x == 0) {
    const int g = *gen;
    if (atomicExch(&stamps[id], g) != g) rows[atomicAdd(count, 1)] = id;
  }
  const int units = D / E;
  const int ubase = blockIdx.y * (32 * VPT) + threadIdx.x;
  O* orow = out + (long long)id * D;
  float acc[VPT][E];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int u = ubase + k * 32;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[k][e] = 0.f;
    if (accumulate && u < units) load_f32<E>(orow + (long long)u * E, acc[k], o_vec);
  }
  for (long long j = i;; j += UNR) {
    int p[UNR];
#pragma unroll
    for (int q = 0; q < UNR; ++q) {
      const long long idx = j + q;
      p[q] = (idx < n && sk[idx] == id) ? sv[idx] : -1;
    }
    Pack<T, E> v[UNR][VPT];
#pragma unroll
    for (int q = 0; q < UNR; ++q)
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int u = ubase + k * 32;
        if (p[q] >= 0 && u < units) v[q][k] = load_pack<T, E>(dout + (long long)p[q] * D + (long long)u * E);
      }
#pragma unroll
    for (int q = 0; q < UNR; ++q)
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int u = ubase + k * 32;
        if (p[q] >= 0 && u < units)
#pragma unroll
          for (int e = 0; e < E; ++e) acc[k][e] += to_f32(v[q][k].v[e]);
      }
    if (p[UNR - 1] < 0) break;  // the run ended inside this group of UNR positions
  }
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int u = ubase + k * 32;
    if (u < units) store_f32<E>(orow + (long long)u * E, acc[k], o_vec);
  }
}

// ---------------------------------------------------------------- dense backward: one writer per table row
// start[v] = first sorted position whose id is >= v (lower bound), v = 0 .. V, so row v's positions are
// sv[start[v] .. start[v + 1]). One thread per v, a binary search over the sorted ids (17 dependent loads
// for n = 65536, from L2: the keys are 4n bytes): V + 1 = 128257 threads are half a wave, ~5-10 us whatever
// the ids are (a scan over the sorted keys writing the gaps would make one thread write all V entries when
// every id is equal).
__device__ __forceinline__ void run_starts(const int* __restrict__ sk, int n, long long V,
                                               int* __restrict__ start) {
  for (long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x; v <= V; v += (long long)gridDim.x * blockDim.x) {
    int lo = 0, hi = n;
    while (lo < hi) {
      const int mid = (int)(((unsigned)lo + (unsigned)hi) >> 1);
      if ((long long)sk[mid] < v) lo = mid + 1;
      else hi = mid;
    }
    start[v] = lo;
  }
}

// out[v, :] = sum of the dout rows of v's positions, for EVERY row v: rows nobody references are written as
// zeros here, so the V x D table is written exactly once (V D s + n D s + ~12 n bytes) instead of a memset of
// all V rows plus a second write of the u touched rows (u ~ 0.4 V for n = 65536 uniform ids over 128256:
// 210 MB of 1.0 GB at D = 2048 bf16). Block (TPR, RPB) as the forward: a row over TPR threads with U = 4
// packs each, rows of fewer than 256 threads sharing a block; per row the chain is start (L2) -> position
// (L2) -> dout row (DRAM) -> store. Latency-bound by design unless enough rows are in flight: one position a
// step (UNR = 1: a second position costs one more DRAM latency, but only ~0.28 extra positions per touched
// row at n = 65536, V = 128256) keeps the bf16 kernel at 74 registers under __launch_bounds__(256, 3)
// (UNR = 2: 98 registers, 2 blocks a SM), so 768 threads x 4 packs x 16 B = 48 KB of rows are in progress
// per SM: at a ~2 us chain that is ~24 GB/s of writes + ~12 of reads per SM, ~4.7 TB/s over 132 SMs.
// Sums are fp32 in position order (the sort is stable), the same order and the same additions from 0 as
// emb_bwd_reduce: the two kernels agree bit for bit.
template <typename T, typename O, bool VEC>
__device__ __forceinline__ void emb_bwd_dense(const int* __restrict__ start, const int* __restrict__ sv,
                                              const T* __restrict__ dout, O* __restrict__ out, long long V, int D,
                                              bool o_vec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  constexpr int U = 4, UNR = 1;
  const int units = D / E;
  for (long long v = (long long)blockIdx.x * blockDim.y + threadIdx.y; v < V; v += (long long)gridDim.x * blockDim.y) {
    const int s0 = start[v], s1 = start[v + 1];
    O* orow = out + v * D;
    for (int u0 = threadIdx.x; u0 < units; u0 += U * blockDim.x) {
      float acc[U][E];
#pragma unroll
      for (int k = 0; k < U; ++k)
#pragma unroll
        for (int e = 0; e < E; ++e) acc[k][e] = 0.f;
      for (int j = s0; j < s1; j += UNR) {
        int p[UNR];
#pragma unroll
        for (int q = 0; q < UNR; ++q) p[q] = j + q < s1 ? sv[j + q] : -1;
        Pack<T, E> w[UNR][U];
#pragma unroll
        for (int q = 0; q < UNR; ++q)
#pragma unroll
          for (int k = 0; k < U; ++k) {
            const int u = u0 + k * blockDim.x;
            if (p[q] >= 0 && u < units) w[q][k] = load_pack<T, E>(dout + (long long)p[q] * D + (long long)u * E);
          }
#pragma unroll
        for (int q = 0; q < UNR; ++q)  // position order for every element
#pragma unroll
          for (int k = 0; k < U; ++k) {
            const int u = u0 + k * blockDim.x;
            if (p[q] >= 0 && u < units)
#pragma unroll
              for (int e = 0; e < E; ++e) acc[k][e] += to_f32(w[q][k].v[e]);
          }
      }
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int u = u0 + k * blockDim.x;
        if (u < units) store_f32<E>(orow + (long long)u * E, acc[k], o_vec);
      }
    }
  }
}

// ---------------------------------------------------------------- sparse rows: zero the listed rows, next generation
// Block (TPR, RPB), fixed grid striding over rows[0 : *count].
template <typename O, bool VEC>
__device__ __forceinline__ void emb_rows_zero(const int* __restrict__ rows, const int* __restrict__ count,
                                              O* __restrict__ buf, int D) {
  constexpr int E = VEC ? 16 / sizeof(O) : 1;
  const int units = D / E;
  const int c = *count;
  Pack<O, E> z;
#pragma unroll
  for (int e = 0; e < E; ++e) z.v[e] = from_f32<O>(0.f);
  for (int r = blockIdx.x * blockDim.y + threadIdx.y; r < c; r += gridDim.x * blockDim.y) {
    O* row = buf + (long long)rows[r] * D;
    for (int u = threadIdx.x; u < units; u += blockDim.x) store_pack<O, E>(row + (long long)u * E, z);
  }
}

// ---------------------------------------------------------------- sparse rows across ranks (ZeroAdamW)
// Data parallelism with a sparse table: each rank's batch touches its own rows. Each rank packs its listed rows
// (ids + fp32 rows in the wire dtype W), the ranks all-gather the packs, and every rank merges all packs into its
// fp32 gradient in rank order -> the same bits on every rank, the union of the rows listed once. At the LLaMA-1B
// shape (B8xT1024, ~5-8k distinct rows of 2048) a pack is <= 8192 x 4 KB of bf16 = 34 MB against 0.53 GB for the
// dense V x D gradient on the wire.
//
// pack: ids[i] = rows[i] and out[i, :] = W(grad[rows[i], :]) for i < min(count, cap); ids[i] = -1 for the
// rest up to cap. count > cap ORs EMB_ERR_CAP into err (the rows past cap are not sent).
#define EMB_ERR_CAP 2
template <typename W, bool VEC>
__device__ __forceinline__ void emb_rows_pack(const int* __restrict__ rows, const int* __restrict__ count,
                                              const float* __restrict__ grad, int* __restrict__ ids,
                                              W* __restrict__ out, int* __restrict__ err, int cap, int D) {
  constexpr int E = VEC ? 4 : 1;  // 4 fp32 = 16 bytes read, 4 W written
  const int c = *count;
  if (blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0 && c > cap) atomicOr(err, EMB_ERR_CAP);
  const int n = c < cap ? c : cap;
  const int units = D / E;
  for (int r = blockIdx.x * blockDim.y + threadIdx.y; r < cap; r += gridDim.x * blockDim.y) {
    if (r >= n) {
      if (threadIdx.x == 0) ids[r] = -1;
      continue;
    }
    const int v = rows[r];
    if (threadIdx.x == 0) ids[r] = v;
    const float* src = grad + (long long)v * D;
    W* dst = out + (long long)r * D;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      const Pack<float, E> a = load_pack<float, E>(src + (long long)u * E);
      Pack<W, E> b;
#pragma unroll
      for (int e = 0; e < E; ++e) b.v[e] = from_f32<W>(a.v[e]);
      store_pack<W, E>(dst + (long long)u * E, b);
    }
  }
}

// merge (one launch per rank's pack, in rank order, the same launches on every rank): for each listed id =
// ids[i] in [0, V): grad[id, :] = (first listing of id in this generation ? 0 : grad[id, :]) + scale * in[i, :]
// (multiply, then add: two roundings, no FMA, as the NumPy reference), and a first listing appends id to
// rows[atomicAdd(count, 1)] (atomicExch(stamps[id], gen) != gen). One pack lists an id once, so no two blocks of
// a launch touch one row; the grid loop is block-uniform (the flag goes through shared memory).
template <typename W, bool VEC>
__device__ __forceinline__ void emb_rows_merge(const int* __restrict__ ids, const W* __restrict__ in,
                                               float* __restrict__ grad, int* __restrict__ stamps,
                                               const int* __restrict__ gen, int* __restrict__ rows,
                                               int* __restrict__ count, int cap, int D, long long V, float scale) {
  constexpr int E = VEC ? 4 : 1;
  __shared__ int first[32];
  const int g = *gen;
  const int units = D / E;
  for (int r0 = blockIdx.x * blockDim.y; r0 < cap; r0 += gridDim.x * blockDim.y) {
    const int r = r0 + threadIdx.y;
    const int v = r < cap ? ids[r] : -1;
    const bool ok = v >= 0 && v < V;
    if (threadIdx.x == 0 && ok) {
      const bool f = atomicExch(stamps + v, g) != g;
      if (f) rows[atomicAdd(count, 1)] = v;
      first[threadIdx.y] = f;
    }
    __syncthreads();
    if (ok) {
      const bool f = first[threadIdx.y];
      float* dst = grad + (long long)v * D;
      const W* src = in + (long long)r * D;
      for (int u = threadIdx.x; u < units; u += blockDim.x) {
        const Pack<W, E> a = load_pack<W, E>(src + (long long)u * E);
        Pack<float, E> b;
        if (!f) b = load_pack<float, E>(dst + (long long)u * E);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float x = __fmul_rn(scale, to_f32(a.v[e]));
          b.v[e] = f ? x : __fadd_rn(b.v[e], x);
        }
        store_pack<float, E>(dst + (long long)u * E, b);
      }
    }
    __syncthreads();
  }
}

// ---- extern "C" entry points, one per instantiation. Names: <kernel>_<dtypes>_<v|s>.
#define EMB_FWD(T, I, TN, IN, VEC, VS)                                                                          \
  CK_ENTRY(__launch_bounds__(1024),                                                                            \
      emb_fwd_##TN##_##IN##_##VS)(const I* ids, const T* table, T* out, int* err, long long n, long long V,     \
                                 int D) {                                                                      \
    emb_fwd<T, I, VEC>(ids, table, out, err, n, V, D);                                                         \
  }
#define EMB_FWD_ALL(T, TN)                                                                                      \
  EMB_FWD(T, int, TN, i32, true, v)                                                                             \
  EMB_FWD(T, int, TN, i32, false, s)                                                                            \
  EMB_FWD(T, long long, TN, i64, true, v)                                                                       \
  EMB_FWD(T, long long, TN, i64, false, s)
EMB_FWD_ALL(float, f32)
EMB_FWD_ALL(bf16, bf16)

CK_ENTRY(__launch_bounds__(256), emb_sort_prep_i32)(const int* ids, int n, long long V, int* keys,
                                                    int* vals, int* err) {
  emb_sort_prep<int>(ids, n, V, keys, vals, err);
}
CK_ENTRY(__launch_bounds__(256), emb_sort_prep_i64)(const long long* ids, int n, long long V,
                                                    int* keys, int* vals, int* err) {
  emb_sort_prep<long long>(ids, n, V, keys, vals, err);
}
CK_ENTRY(__launch_bounds__(RS_THREADS), emb_rs_hist)(const int* keys, int n, int shift, int* hist) {
  rs_hist(keys, n, shift, hist);
}
CK_ENTRY(__launch_bounds__(1024), emb_scan_excl)(int* a, long long m) { scan_excl_1block(a, m); }
CK_ENTRY(__launch_bounds__(RS_THREADS), emb_rs_scatter)(const int* kin, const int* vin, int* kout,
                                                        int* vout, int n, int shift,
                                                        const int* hist) {
  rs_scatter(kin, vin, kout, vout, n, shift, hist);
}

#define EMB_BWD(T, O, TN, ON, VEC, VS)                                                                          \
  CK_ENTRY(__launch_bounds__(256),                                                                             \
      emb_bwd_##TN##_##ON##_##VS)(const int* sk, const int* sv, const T* dout, O* out, int n, int D,            \
                                 bool accumulate, bool o_vec, int* stamps, const int* gen, int* rows,          \
                                 int* count) {                                                                 \
    emb_bwd_reduce<T, O, VEC>(sk, sv, dout, out, n, D, accumulate, o_vec, stamps, gen, rows, count);           \
  }
#define EMB_BWD_ALL(T, O, TN, ON)                                                                               \
  EMB_BWD(T, O, TN, ON, true, v)                                                                                \
  EMB_BWD(T, O, TN, ON, false, s)
EMB_BWD_ALL(float, float, f32, f32)
EMB_BWD_ALL(float, bf16, f32, bf16)
EMB_BWD_ALL(bf16, float, bf16, f32)
EMB_BWD_ALL(bf16, bf16, bf16, bf16)

CK_ENTRY(__launch_bounds__(256), emb_run_starts)(const int* sk, int n, long long V, int* start) {
  run_starts(sk, n, V, start);
}
#define EMB_DENSE(T, O, TN, ON, VEC, VS)                                                                        \
  CK_ENTRY(__launch_bounds__(256, 3),                                                                          \
      emb_bwd_dense_##TN##_##ON##_##VS)(const int* start, const int* sv, const T* dout, O* out, long long V,    \
                                       int D, bool o_vec) {                                                    \
    emb_bwd_dense<T, O, VEC>(start, sv, dout, out, V, D, o_vec);                                               \
  }
#define EMB_DENSE_ALL(T, O, TN, ON)                                                                             \
  EMB_DENSE(T, O, TN, ON, true, v)                                                                              \
  EMB_DENSE(T, O, TN, ON, false, s)
EMB_DENSE_ALL(float, float, f32, f32)
EMB_DENSE_ALL(float, bf16, f32, bf16)
EMB_DENSE_ALL(bf16, float, bf16, f32)
EMB_DENSE_ALL(bf16, bf16, bf16, bf16)

#define EMB_ZERO(O, ON, VEC, VS)                                                                                \
  CK_ENTRY(__launch_bounds__(1024),                                                                            \
      emb_rows_zero_##ON##_##VS)(const int* rows, const int* count, O* buf, int D) {                            \
    emb_rows_zero<O, VEC>(rows, count, buf, D);                                                                \
  }
EMB_ZERO(float, f32, true, v)
EMB_ZERO(float, f32, false, s)
EMB_ZERO(bf16, bf16, true, v)
EMB_ZERO(bf16, bf16, false, s)

// count = 0, generation += 1 (kept >= 1: stamps start at 0). One thread; runs after emb_rows_zero on the stream.
CK_ENTRY(, emb_rows_reset)(int* count, int* gen) {
  *count = 0;
  const int g = *gen + 1;
  *gen = g > 0 ? g : 1;
}

#define EMB_XCHG(W, WN, VEC, VS)                                                                                \
  CK_ENTRY(__launch_bounds__(1024),                                                                            \
      emb_rows_pack_##WN##_##VS)(const int* rows, const int* count, const float* grad, int* ids, W* out,        \
                                int* err, int cap, int D) {                                                    \
    emb_rows_pack<W, VEC>(rows, count, grad, ids, out, err, cap, D);                                           \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(1024),                                                                            \
      emb_rows_merge_##WN##_##VS)(const int* ids, const W* in, float* grad, int* stamps, const int* gen,        \
                                 int* rows, int* count, int cap, int D, long long V, float scale) {            \
    emb_rows_merge<W, VEC>(ids, in, grad, stamps, gen, rows, count, cap, D, V, scale);                          \
  }
EMB_XCHG(float, f32, true, v)
EMB_XCHG(float, f32, false, s)
EMB_XCHG(bf16, bf16, true, v)
EMB_XCHG(bf16, bf16, false, s)
