// Flash attention forward and backward on Hopper's warpgroup MMA (sm_90a only): bf16 in / bf16 out, fp32 softmax
// and accumulation; the same math, masks, GQA mapping, lse format and deterministic two-kernel backward split as
// attention.cu (either family's backward consumes either forward's o / lse). No key-padding mask (attention.cu's
// *_km kernels keep those calls).
//
// Why: attention.cu's mma.sync forward runs B8 x H32/8 x T1024 x D64 causal in 0.192 ms on an H200, PyTorch's
// SDPA (cuDNN / FA3 class, wgmma) in 0.114 ms. mma.sync m16n8k16 issues 4 KFLOP per warp instruction and needs
// every B fragment re-read from shared memory through ldmatrix by every warp; wgmma m64n128k16 issues 262 KFLOP
// per warpgroup instruction with both smem operands read by the tensor core itself (no ldmatrix, no fragment
// registers for K and V), which is what lets Hopper reach its 989 dense bf16 TFLOP/s.
//
// Design (a work tile = 128 query rows of one (batch, head); 384 threads = 3 warpgroups; the _wg3 forward: 192
// rows, 512 threads = a producer and 3 consumers):
//   * warpgroup 0 is the producer: it copies the Q tile once and then the K/V tiles of the key loop into a
//     STAGES-deep ring in shared memory with cp.async (16-byte chunks, zero-filled past the sequence end, written
//     at the 128-byte-swizzled positions wgmma's descriptors expect), and signals each stage's "full" mbarrier
//     with cp.async.mbarrier.arrive.noinc (the arrive fires when the thread's copies have landed). No TMA: a
//     CUtensorMap would have to be encoded on the host by cuTensorMapEncodeTiled, which CuPy does not expose, and
//     cp.async handles strided [B, T, heads, D] views and the ragged tail rows the same way attention.cu does.
//     The producer gives registers back (setmaxnreg.dec to 56; 32 in _wg3); the consumers take them
//     (setmaxnreg.inc to 224; 160 in _wg3).
//   * warpgroups 1 and 2 (and 3) are consumers, 64 query rows each: S = Q K^T by wgmma m64n{BN}k16 with both
//     operands in shared memory (Q and K K-major, 128-byte swizzle), online softmax in registers (exp2 with
//     scale * log2(e) folded in: common/mma.cuh's online_softmax_step, whose per-thread row layout is also
//     wgmma's accumulator layout), P rounded to bf16 in registers as the A operand of O += P V (wgmma
//     m64n{D}k16, A from registers, B = V from shared memory, MN-major: V is stored [key][d] with d contiguous,
//     the transpose bit set). Then the stage's "empty" mbarrier is arrived on so the producer may refill it.
//   * Consumer schedule (attn_sm90_fwd_d{D}, FlashAttention-3's): per tile, one "GEMM block" issues S for tile
//     j + 1 and P V for tile j back to back; the softmax of tile j + 1 runs while P V is still on the tensor
//     cores; two named barriers make the consumer warpgroups take turns issuing GEMM blocks (ping-pong), so one
//     warpgroup's exp2s overlap the other's wgmmas. _overlap: the same loop without the turns; _wg3: three
//     consumers in the _overlap loop; _serial: S, softmax, P V one after the other (same tiles and shared
//     memory). Which one is faster depends on the loop length (session 10's sweep, NOTES): the Python launcher
//     picks per call (ck.settings.attention_sm90_variant = "auto").
//   * Shared tiles: rows of 64 bf16 = 128 bytes; a D = 128 tile is two such column blocks one after the other.
//     16-byte chunk c of row r lives at byte r * 128 + ((c ^ (r & 7)) << 4) of its column block (Swizzle<3,4,3>
//     on the address: bits 4-6 ^= bits 7-9), 8-row groups 1024 bytes apart, every tile 1024-byte aligned.
//     The NumPy model of this layout, of the descriptors and of the fragment ownership is in
//     tests/test_attention_sm90.py (CPU), checked before any GPU run.
//   * Causal: key tiles past the CTA's last visible key are never loaded; a consumer whose 64 rows see none of a
//     tile's keys skips its math (it still releases the stage); only tiles crossing the diagonal (or Tk) are
//     masked. Work tiles are taken heaviest first.
//   * Sliding window (the SW = true instantiations, entry points *_sw*; one more argument W, 1 <= W < Tk, always
//     causal): query i sees key n iff i + off - W < n <= i + off. The same rule on the band's lower edge: the key
//     loops of fwd / dq start at the first tile the work tile's first query sees (window_first), dkdv's query
//     loop ends at the last query tile that sees its last key, tiles a consumer's rows see none of are skipped
//     like the causal ones, and only tiles crossing the edge are masked. The work per tile stays monotone in the
//     tile index (fwd / dq: nondecreasing, dkdv: nonincreasing), so the heaviest-first orders hold; the fused
//     backward's dQ semaphores count from the first key tile that sees the query tile. Separate instantiations
//     (not a run-time W in the plain kernels), as attention.cu's: the plain kernels' PTX is unchanged.
//   * Persistent CTAs (one per SM, a snake walk over the work tiles): the producer loads the next tile's Q (into
//     the second Q buffer) and first K / V stages while the consumers finish the current one; a "Q empty"
//     mbarrier per buffer, arrived on once the tile's last S has read Q, orders its reuse (the backward kernels'
//     fixed tiles likewise).
#include "common/entry.cuh"
#include "common/vec.cuh"
#include "common/mma.cuh"
#include "common/hopper.cuh"

namespace {

constexpr int NTHREADS = 3 * WG;    // producer + 2 consumers
constexpr int BM = 128;             // query rows per CTA (64 per consumer warpgroup)
constexpr float LOG2E = 1.4426950408889634f;

// -inf for the scores of a warp's [16 x N] tile (rows row0 + g, + 8; columns col0 + 8 nt + 2 c + {0, 1}) that
// lie past Tk or above the causal diagonal (key > query + off); SW: or below the window (query + off - key >= W).
template <int N, bool SW = false>
__device__ __forceinline__ void mask_tile(float (&s)[N / 8][4], int row0, int col0, int Tk, int off, bool causal,
                                          int lane, int W = 0) {
  const int g = lane >> 2, c2 = (lane & 3) * 2;
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = row0 + g + (e >> 1) * 8, c = col0 + nt * 8 + c2 + (e & 1);
      if (c >= Tk || (causal && c > r + off) || (SW && r + off - c >= W)) s[nt][e] = -CK_INF;
    }
  }
}
// Sliding window: the first key a query from row q0 on can see (0 when the window reaches back past key 0); the
// last query that sees one of the keys up to k1, or -1; whether the window hides the pair (query qb, key ka).
__device__ __forceinline__ int window_first(int q0, int off, int W) { return max(0, q0 + off - W + 1); }
__device__ __forceinline__ int window_last_query(int k1, int off, int W) { return max(-1, k1 - off + W - 1); }
__device__ __forceinline__ bool window_cuts(int qb, int ka, int off, int W) { return qb + off - ka >= W; }

// Issue (not wait for) S = Q K^T over the D / 16 k-steps; k-step kk reads 32 bytes at column block kk / 4, byte
// (kk % 4) * 32 of every row of the Q (this warpgroup's 64 rows) and K tiles. Both K-major, SBO = 1024. k-step 0
// runs with scale-d = 0 (D = A B, the old accumulator ignored), so s needs no zeroing before it: 64 (fwd) or
// 32 + 32 (dq / dkdv: S and dP) moves a thread and tile saved. The k-step descriptors: desc_plus (common/hopper.cuh).
template <int D, int BN, int AROWS = BM>  // AROWS: rows of the A tile (its column blocks are AROWS * 128 B apart)
__device__ __forceinline__ void issue_s(float (&s)[BN / 8][4], unsigned qaddr, unsigned kaddr) {
  const unsigned long long da0 = make_desc(qaddr, 16, 1024), db0 = make_desc(kaddr, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<BN>(s, desc_plus(da0, (kk >> 2) * (AROWS * 128) + (kk & 3) * 32),
                 desc_plus(db0, (kk >> 2) * (BN * 128) + (kk & 3) * 32), kk > 0);
}
// Issue O += P V: V is MN-major (the transpose bit), k-step kk = key rows 16 kk .. 16 kk + 15 (2048 bytes per
// step), LBO = the next 64-wide column block of d (D = 128), SBO = 1024 between 8-key groups.
template <int D, int BN>
__device__ __forceinline__ void issue_pv(float (&acc)[D / 8][4], const unsigned (&pa)[BN / 16][4], unsigned vaddr) {
#pragma unroll
  const unsigned long long d0 = make_desc(vaddr, BN * 128, 1024);
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs<D>(acc, pa[kk], desc_plus(d0, kk * 2048));
}
// P (bf16) as wgmma's register A operand: k-step kk = keys 16 kk .. 16 kk + 15 = accumulator columns of n-blocks
// 2 kk and 2 kk + 1, in the m16n8k16 A-fragment order (g, 2c), (g + 8, 2c), (g, 2c + 8), (g + 8, 2c + 8).
template <int BN>
__device__ __forceinline__ void pack_p(unsigned (&pa)[BN / 16][4], const float (&s)[BN / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    pa[kk][0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
    pa[kk][1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
    pa[kk][2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[kk][3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}
// online_softmax_step (common/mma.cuh) without the accumulator rescale: updates the running max / sum of the
// thread's two rows, turns s into p, and returns the factors acc must be multiplied by (applied by the caller
// once the P V product that is still in flight on acc has completed).
template <int BN>
__device__ __forceinline__ void softmax_rows(float (&s)[BN / 8][4], float& m0, float& m1, float& l0, float& l1,
                                             float sl2, float& cr0, float& cr1) {
  // Row maxima in two independent chains a row (half the dependent-fmax latency of one chain).
  float a0 = -CK_INF, a1 = -CK_INF, b0 = -CK_INF, b1 = -CK_INF;
#pragma unroll
  for (int nt = 0; nt < BN / 8; nt += 2) {
    a0 = fmaxf(a0, fmaxf(s[nt][0], s[nt][1]));
    a1 = fmaxf(a1, fmaxf(s[nt][2], s[nt][3]));
    b0 = fmaxf(b0, fmaxf(s[nt + 1][0], s[nt + 1][1]));
    b1 = fmaxf(b1, fmaxf(s[nt + 1][2], s[nt + 1][3]));
  }
  float mx0 = fmaxf(a0, b0), mx1 = fmaxf(a1, b1);
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float mn0 = fmaxf(m0, mx0 * sl2), mn1 = fmaxf(m1, mx1 * sl2);
  const float base0 = mn0 == -CK_INF ? 0.f : mn0, base1 = mn1 == -CK_INF ? 0.f : mn1;
  cr0 = ex2(m0 - base0);
  cr1 = ex2(m1 - base1);
  m0 = mn0;
  m1 = mn1;
  float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt) {
    s[nt][0] = ex2(fmaf(s[nt][0], sl2, -base0));
    s[nt][1] = ex2(fmaf(s[nt][1], sl2, -base0));
    s[nt][2] = ex2(fmaf(s[nt][2], sl2, -base1));
    s[nt][3] = ex2(fmaf(s[nt][3], sl2, -base1));
    ps0 += s[nt][0] + s[nt][1];
    ps1 += s[nt][2] + s[nt][3];
  }
  l0 = l0 * cr0 + ps0;
  l1 = l1 * cr1 + ps1;
}
// Named barriers 1 and 2 (0 is __syncthreads): "consumer warpgroup 0 / 1 may issue its tensor-core work".
__device__ __forceinline__ void named_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }

// Ping-pong turns of the backward kernels' serial loops (PP = true): every tensor-core block (issue + commit) of
// consumer warpgroup cw is preceded by a sync on its barrier (1 + cw) and followed by an arrive on the other's,
// so the two warpgroups issue alternately and one's elementwise work (exp2, dS) overlaps the other's wgmmas.
// Warpgroup 1 opens with one arrive and leaves out its very last one (when last is set), so that over NB blocks
// per warpgroup each barrier sees exactly NB syncs and NB arrivals (tests/test_attention_sm90.py models it).
// A tile a warpgroup skips (causal) still takes its turns, without the wgmmas.
template <bool PP> struct Turns {
  int mine, other, cw;
  __device__ __forceinline__ Turns(int cw_) : mine(1 + cw_), other(2 - cw_), cw(cw_) {}
  __device__ __forceinline__ void open(bool any) const {
    if (PP && cw == 1 && any) named_arrive(other);
  }
  __device__ __forceinline__ void begin() const {
    if (PP) named_sync(mine);
  }
  __device__ __forceinline__ void end(bool last) const {
    if (PP && (cw == 0 || !last)) named_arrive(other);
  }
  // A tile this warpgroup skips: its two blocks' turns without the wgmmas; on the work tile's last key (query)
  // tile it also releases the fixed operands (fixfree: their "empty" mbarrier).
  __device__ __forceinline__ void skip(bool last, unsigned fixfree) const {
    begin();
    end(false);
    if (last) mbar_arrive(fixfree);
    begin();
    end(last);
  }
};

struct Strides {
  long long b, t, h;
};

// Registers per thread after setmaxnreg: 128 x 56 + 256 x 224 = 64512 <= 65536 (the SM's register file at one
// CTA per SM; 384 threads launch with 168 each).
constexpr int PRODUCER_REGS = 56;
constexpr int CONSUMER_REGS = 224;
// The fused backward (dkdvq): its producer warpgroup also holds the dQ writers; at 64 / 224 ptxas spilled 4 bytes
// there (28 at 56 / 224). setmaxnreg.inc waits for registers that .dec released, so the split must fit the launch
// allocation, 384 x 168 = 64512, not the SM's 65536: 128 x 72 + 256 x 216 = 64512 (no spills). (128 x 80 +
// 256 x 216 = 65536 left the consumers waiting forever: session 13, run D.)
constexpr int PRODUCER_REGS_FQ = 72;
constexpr int CONSUMER_REGS_FQ = 216;
// The forward's three-consumer variant (_wg3: 512 threads, 192 query rows): 128 x 32 + 384 x 160 = 65536 (24 for
// the producer, as FlashAttention-3's TMA producer has, spilled 16 bytes of our cp.async address math).
constexpr int PRODUCER_REGS3 = 32;
constexpr int CONSUMER_REGS3 = 160;

// Persistent CTAs: the grid is at most one CTA per SM and each CTA walks an ordered list of work tiles (heaviest
// first), so the producer loads the next tile's Q (or K / V) and first stages while the consumers finish the
// current tile (last products, epilogue). Measured before (session 10, run A, the sweep fit of
// benchmarks/attention_sweep.py): a CTA cost ~3.9 us beyond its tiles (fwd; dq 4.0, dkdv ~11), 41 % of the
// forward at B8 x T1024 causal. Tile t = (r, rest): r = t / (heads * B) is the row block (heaviest first under
// the causal mask), rest % heads the head, rest / heads the batch (the G query heads of a K/V head adjacent).
// The walk is a snake: round k takes tiles k * grid .. (k + 1) * grid - 1, CTA c the c-th of them in even rounds
// and the (grid - 1 - c)-th in odd ones, so the CTA that drew the heaviest tile of a round draws the lightest of
// the next (static stride instead: the dkdv kernel at B2 x T4096 causal would give its busiest CTA 672 query
// tiles against a mean of 543; the snake gives 544).
struct TileIdx {
  int blk, h, b;
};
__device__ __forceinline__ TileIdx tile_at(int t, int nblk, int heads, int B, bool rev) {
  const int per = heads * B, r = t / per, rest = t - r * per;
  return TileIdx{rev ? nblk - 1 - r : r, rest % heads, rest / heads};
}
// Key tiles of BN a work tile of query rows [.., qend) loads: all of Tk, or under the causal mask (query i sees
// keys <= i + off) those up to qend - 1 + off.
__device__ __forceinline__ int key_tiles(int qend, int Tk, int off, bool causal, int bn) {
  const int kend = causal ? min(Tk, qend + off) : Tk;
  return kend > 0 ? (kend + bn - 1) / bn : 0;
}
// dkdv's work tile of keys from k0: the first query tile (of bq rows) that can see one of its keys (query i sees key
// n when n <= i + off) and how many query tiles from there; the producer and the consumers walk the same range.
// SW: up to the last query tile that sees its last key k1 (window_last_query); end is one past that range.
struct QueryTiles {
  int first, n, end;
};
template <bool SW = false>
__device__ __forceinline__ QueryTiles query_tiles(int k0, int off, bool causal, int nqb, int bq, int k1 = 0,
                                                  int W = 0) {
  const int first = causal ? max(0, (k0 - off) / bq) : 0;
  const int end = SW ? min(nqb, (window_last_query(k1, off, W) + bq) / bq) : nqb;
  return QueryTiles{first, max(0, end - first), end};
}
__device__ __forceinline__ int snake_tile(int k) {
  return k * gridDim.x + ((k & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
}
// A running ring position: stage index and mbarrier phase of the n-th use of a STAGES-deep ring.
template <int STAGES> struct Ring {
  int st = 0, ph = 0;
  __device__ __forceinline__ void next() {
    if (++st == STAGES) {
      st = 0;
      ph ^= 1;
    }
  }
};

// QB = 1 or 2 buffers of a kernel's per-tile fixed operands (fwd: Q; dq: Q, dO, O; dkdv: K, V). With two, the
// producer fills the next work tile's buffer while the consumers still read the current one, and its first K / V
// stages follow at once instead of after the current tile's last S (run C: the consumers waited ~28 spins of
// mbarrier try_wait on the first K / V stage of every work tile). Buffer and phase of the tc-th tile a CTA takes:
template <int QB> __device__ __forceinline__ int fix_buf(int tc) { return QB == 2 ? (tc & 1) : 0; }
template <int QB> __device__ __forceinline__ unsigned fix_par(int tc) { return QB == 2 ? (tc >> 1) & 1 : tc & 1; }

template <int D, int BN, int STAGES, int QB, int ROWS = BM> struct Smem {
  static constexpr int Q = ROWS * D * 2;     // Q tile bytes
  static constexpr int KV = BN * D * 2;      // one K (or V) stage
  static constexpr int BARS = 8 * (2 * QB + 2 * STAGES);  // Q full and empty per buffer, full and empty per stage
  static constexpr int BYTES = QB * Q + 2 * STAGES * KV + BARS + 1024;  // + 1024: the base is aligned up at run time
};

}  // namespace

// ================================================================================================ forward
// Grid: min(tiles, SMs) persistent CTAs over ceil(Tq / 128) x H x B tiles; 384 threads; dynamic shared memory
// Smem<D, BN, STAGES>::BYTES.
// MODE: 0 = serial loop, 1 = pipelined loop with ping-pong turns, 2 = the pipelined loop without the turns
// (each warpgroup issues its GEMM block as soon as its own softmax is done: FlashAttention-3's intra-warpgroup
// overlap alone, its choice at head_dim 64).
// SW: the sliding window W (else unused): key tiles jb0 .. nkb - 1 only (jb0 = 0 without).
template <int D, int BN, int STAGES, int QB, int MODE, int NC, bool SW>
__device__ __forceinline__ void attn_fwd_sm90(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                              const bf16* __restrict__ v, bf16* __restrict__ o,
                                              float* __restrict__ lse, Strides sq, Strides sk, Strides sv, int Tq,
                                              int Tk, int H, int Hkv, float scale, bool causal, int Bsz, int W) {
  // NC consumer warpgroups of 64 query rows each: BMF rows a work tile (2: 128, the production shape; 3: 192,
  // FlashAttention-3's choice at head_dim 64, registers 24 / 160 instead of 56 / 224).
  constexpr int BMF = 64 * NC;
  using SM = Smem<D, BN, STAGES, QB, BMF>;
  static_assert(D % 64 == 0 && BN % 64 == 0, "tiles are whole 128-byte swizzle rows / wgmma N steps");
  static_assert(NC == 2 || NC == 3, "two or three consumer warpgroups");
  static_assert(MODE != 1 || NC == 2, "the ping-pong turns pair two consumer warpgroups");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The swizzle is a function of address bits 7-9, so every tile must start on a 1024-byte boundary.
  unsigned char* base = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* Qs = base;                    // [QB][BMF x D]
  unsigned char* Ks = base + QB * SM::Q;       // [STAGES][BN x D]
  unsigned char* Vs = Ks + STAGES * SM::KV;    // [STAGES][BN x D]
  const unsigned qbar = smem_addr(Vs + STAGES * SM::KV), qempty = qbar + 8 * QB;  // [QB] each
  const unsigned full0 = qbar + 16 * QB, empty0 = full0 + 8 * STAGES;

  const int tid = threadIdx.x, wg = tid / WG;
  const int off = Tk - Tq;  // causal alignment: query i sees keys <= i + off
  const int nmb = (Tq + BMF - 1) / BMF, ntiles = nmb * H * Bsz;

  if (tid == 0) {
    for (int i = 0; i < QB; ++i) {
      mbar_init(qbar + 8 * i, WG);        // one cp.async arrive per producer thread
      mbar_init(qempty + 8 * i, NC * WG);  // one arrive per consumer thread: the tile's last S has read Q
    }
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, WG);
      mbar_init(empty0 + 8 * s, NC * WG);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // ---------------------------------------------------------------- producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(NC == 2 ? PRODUCER_REGS : PRODUCER_REGS3));
    Ring<STAGES> ring;
    int tc = 0;
    for (int t = snake_tile(0); t < ntiles; t = snake_tile(++tc)) {
      const TileIdx ti = tile_at(t, nmb, H, Bsz, causal);  // heaviest causal tiles first
      const int q0 = ti.blk * BMF, j = ti.h / (H / Hkv);
      const int nkb = key_tiles(q0 + BMF, Tk, off, causal, BN);
      const int jb0 = SW ? min(nkb, window_first(q0, off, W) / BN) : 0;
      const bf16* kp = k + ti.b * sk.b + j * sk.h;
      const bf16* vp = v + ti.b * sv.b + j * sv.h;
      // The consumers release a Q buffer after the last S of its tile (the first wait on each buffer asks for
      // the phase "before" a fresh barrier's and passes at once).
      const int qb = fix_buf<QB>(tc);
      mbar_wait(qempty + 8 * qb, fix_par<QB>(tc) ^ 1);
      load_swz<D, BMF>(Qs + qb * SM::Q, q + ti.b * sq.b + ti.h * sq.h, sq.t, q0, Tq, tid);
      cp_async_arrive(qbar + 8 * qb);
      for (int jb = jb0; jb < nkb; ++jb, ring.next()) {
        // This stage was last filled STAGES uses ago (possibly for the previous tile); wait for its release.
        mbar_wait(empty0 + 8 * ring.st, ring.ph ^ 1);
        load_swz<D, BN>(Ks + ring.st * SM::KV, kp, sk.t, jb * BN, Tk, tid);
        load_swz<D, BN>(Vs + ring.st * SM::KV, vp, sv.t, jb * BN, Tk, tid);
        cp_async_arrive(full0 + 8 * ring.st);
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    return;
  }

  // ---------------------------------------------------------------------------------- consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(NC == 2 ? CONSUMER_REGS : CONSUMER_REGS3));
  const int cw = wg - 1, ct = tid - wg * WG, warp = ct >> 5, lane = ct & 31, g = lane >> 2;
  const float sl2 = scale * LOG2E;
  Ring<STAGES> ring;
  int tc = 0;
  for (int t = snake_tile(0); t < ntiles; t = snake_tile(++tc)) {
    const TileIdx ti = tile_at(t, nmb, H, Bsz, causal);
    const int h = ti.h, b = ti.b, q0 = ti.blk * BMF;
    const int nkb = key_tiles(q0 + BMF, Tk, off, causal, BN);
    const int jb0 = SW ? min(nkb, window_first(q0, off, W) / BN) : 0;  // as the producer's
    const int rbase = q0 + cw * 64, row0 = rbase + warp * 16;
    const int qb = fix_buf<QB>(tc);
    const unsigned qaddr = smem_addr(Qs + qb * SM::Q) + cw * 64 * 128;  // this warpgroup's 64 rows a column block
    const unsigned qfree = qempty + 8 * qb;

    float acc[D / 8][4];
    zero(acc);
    float m0 = -CK_INF, m1 = -CK_INF, l0 = 0.f, l1 = 0.f;  // rows g and g + 8 of this warp (log2 units)
    mbar_wait(qbar + 8 * qb, fix_par<QB>(tc));

    if constexpr (MODE == 0) {
      // Serial: S, softmax, P V one after the other per tile; the two consumer warpgroups overlap only as the
      // warp schedulers happen to interleave them.
      for (int jb = jb0; jb < nkb; ++jb, ring.next()) {
        const int st = ring.st, n0 = jb * BN;
        mbar_wait(full0 + 8 * st, ring.ph);
        // A tile whose first key is past this warpgroup's last row's diagonal adds nothing (all -inf): release
        // it. SW: so does a tile whose last key is below its first row's window.
        if ((causal && n0 > rbase + 63 + off) || (SW && window_cuts(rbase, n0 + BN - 1, off, W))) {
          mbar_arrive(empty0 + 8 * st);
          continue;
        }
        fence_proxy_async();
        float s[BN / 8][4];
        fence_regs(s);
        wgmma_fence();
        issue_s<D, BN, BMF>(s, qaddr, smem_addr(Ks + st * SM::KV));
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(s);
        if (n0 + BN > Tk || (causal && n0 + BN - 1 > row0 + off) || (SW && window_cuts(row0 + 15, n0, off, W)))
          mask_tile<BN, SW>(s, row0, n0, Tk, off, causal, lane, W);
        online_softmax_step<BN, D>(s, acc, m0, m1, l0, l1, sl2);
        unsigned pa[BN / 16][4];
        pack_p<BN>(pa, s);
        fence_regs(acc);
        wgmma_fence();
        issue_pv<D, BN>(acc, pa, smem_addr(Vs + st * SM::KV));
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(acc);
        fence_regs(pa);
        mbar_arrive(empty0 + 8 * st);  // the stage's K and V have been read (wait_group 0 above)
      }
      mbar_arrive(qfree);
    } else if (nkb > jb0) {
      // Pipelined (FlashAttention-3's schedule): each "GEMM block" issues S for tile j + 1 and P V for tile j
      // back to back, then the softmax of tile j + 1 runs while P V (tile j) is still on the tensor cores
      // (wait_group 1: S, committed first, is done). Ping-pong: named barrier 1 + cw lets warpgroup cw issue its
      // GEMM block, after which it lets the other one go, so one warpgroup's exponentials overlap the other's
      // GEMMs (at D = 64 the 16 K exp2 of a 128 x 128 tile take ~1000 cycles of the SM's MUFU, about as long as
      // its 4.2 MFLOP of wgmma). Block count per warpgroup: 1 (S of tile 0) + nkb; every sync on a barrier is
      // matched by exactly one arrive of the other warpgroup (warpgroup 1 opens with one, and skips its very
      // last), so none is left pending at the end of a work tile. Both warpgroups run every tile (no
      // per-warpgroup causal skip here: it would unbalance the barriers; the -inf rows of a fully masked tile
      // leave the softmax state unchanged).
      constexpr bool PP = MODE == 1;
      const int mine = 1 + cw, other = 2 - cw;
      if (PP && cw == 1) named_arrive(other);
      float s[BN / 8][4];
      unsigned pa[BN / 16][4];
      mbar_wait(full0 + 8 * ring.st, ring.ph);
      fence_proxy_async();
      if (PP) named_sync(mine);
      fence_regs(s);
      wgmma_fence();
      issue_s<D, BN, BMF>(s, qaddr, smem_addr(Ks + ring.st * SM::KV));
      wgmma_commit();
      if (PP) named_arrive(other);
      wgmma_wait<0>();
      fence_regs(s);
      if (nkb - jb0 == 1) mbar_arrive(qfree);  // the tile's last S has read Q
      const int nf = jb0 * BN;  // the first key tile's first key (0 without a window)
      if (nf + BN > Tk || (causal && nf + BN - 1 > row0 + off) || (SW && window_cuts(row0 + 15, nf, off, W)))
        mask_tile<BN, SW>(s, row0, nf, Tk, off, causal, lane, W);
      float cr0, cr1;
      softmax_rows<BN>(s, m0, m1, l0, l1, sl2, cr0, cr1);  // acc is still 0: no rescale needed
      pack_p<BN>(pa, s);
      // Blocks 1 .. nkb - 1: S of tile jb + 1 and P V of tile jb. Straight-line wgmma issue (no branch between
      // the issues and their waits: ptxas serialises every wgmma of a function whose pipeline it cannot follow
      // through a divergent path).
      for (int jb = jb0; jb + 1 < nkb; ++jb) {
        const int st = ring.st, n1 = (jb + 1) * BN;
        ring.next();
        const int st1 = ring.st;
        mbar_wait(full0 + 8 * st1, ring.ph);
        fence_proxy_async();
        if (PP) named_sync(mine);
        fence_regs(s);
        fence_regs(acc);
        fence_regs(pa);
        wgmma_fence();
        issue_s<D, BN, BMF>(s, qaddr, smem_addr(Ks + st1 * SM::KV));
        wgmma_commit();
        issue_pv<D, BN>(acc, pa, smem_addr(Vs + st * SM::KV));
        wgmma_commit();
        if (PP) named_arrive(other);
        wgmma_wait<1>();  // S of tile jb + 1 is done; P V of tile jb may still run
        fence_regs(s);
        if (n1 + BN > Tk || (causal && n1 + BN - 1 > row0 + off) || (SW && window_cuts(row0 + 15, n1, off, W)))
          mask_tile<BN, SW>(s, row0, n1, Tk, off, causal, lane, W);
        softmax_rows<BN>(s, m0, m1, l0, l1, sl2, cr0, cr1);
        wgmma_wait<0>();
        fence_regs(acc);
        fence_regs(pa);
        mbar_arrive(empty0 + 8 * st);  // V of tile jb read (its K was read before the previous block ended)
        if (jb + 2 == nkb) mbar_arrive(qfree);  // S of the last tile has read Q
        rescale_rows(acc, cr0, cr1);
        pack_p<BN>(pa, s);
      }
      // Last block: P V of tile nkb - 1 (warpgroup 1 does not open another block of warpgroup 0's).
      const int st = ring.st;
      ring.next();
      if (PP) named_sync(mine);
      fence_regs(acc);
      fence_regs(pa);
      wgmma_fence();
      issue_pv<D, BN>(acc, pa, smem_addr(Vs + st * SM::KV));
      wgmma_commit();
      if (PP && cw == 0) named_arrive(other);
      wgmma_wait<0>();
      fence_regs(acc);
      fence_regs(pa);
      mbar_arrive(empty0 + 8 * st);
    } else {
      mbar_arrive(qfree);  // no key visible (Tk = 0, or every key past the causal bound): Q unused
    }

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    // o [B, Tq, H, D] contiguous; lse [B, H, Tq] in natural-log units (attention.cu's format). A row that saw no
    // key (Tq > Tk under the causal alignment) gets o = 0 and lse = -inf.
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    const int r0 = row0 + g, r1 = r0 + 8, c2 = (lane & 3) * 2;
    bf16* op = o + ((long long)b * Tq * H + h) * D;
    const long long ld = (long long)H * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      if (r0 < Tq)
        *reinterpret_cast<unsigned*>(op + r0 * ld + nt * 8 + c2) = pack_bf16(acc[nt][0] * inv0, acc[nt][1] * inv0);
      if (r1 < Tq)
        *reinterpret_cast<unsigned*>(op + r1 * ld + nt * 8 + c2) = pack_bf16(acc[nt][2] * inv1, acc[nt][3] * inv1);
    }
    if ((lane & 3) == 0) {
      float* lp = lse + ((long long)b * H + h) * Tq;
      if (r0 < Tq) lp[r0] = l0 > 0.f ? (m0 + __log2f(l0)) / LOG2E : -CK_INF;
      if (r1 < Tq) lp[r1] = l1 > 0.f ? (m1 + __log2f(l1)) / LOG2E : -CK_INF;
    }
  }
}

// ================================================================================================ backward
// Same split as attention.cu's backward (deterministic, no atomics): attn_sm90_bwd_dq (one CTA per 128 query rows,
// loops over the key tiles; also writes delta = rowsum(dO * O)) then attn_sm90_bwd_dkdv (one CTA per 128 keys of
// a K/V head, loops over the G query heads of its group and their query tiles, reading delta). P is recomputed
// from lse in both. Same producer / consumer split, swizzled tiles and serial consumer loop as the forward.
//   dq:   S = Q K^T, dP = dO V^T (both smem x smem, K-major), dS = P * (dP - delta), dQ += dS K (dS from
//         registers, K MN-major: [key][d] with d contiguous is the [K x N] operand transposed).
//   dkdv: S^T = K Q^T, dP^T = V dO^T (smem x smem), dS^T = P^T * (dP^T - delta), dV += P^T dO, dK += dS^T Q
//         (P^T, dS^T from registers; dO, Q MN-major).
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0));
}

// Store a warpgroup's [64 x D] fp32 accumulator (times mul) as bf16 rows row0 + g, row0 + g + 8 (row0 = the
// warp's first row) of a [T, ld] slab.
template <int D>
__device__ __forceinline__ void store_acc(bf16* dst, long long ld, int row0, int T, const float (&acc)[D / 8][4],
                                          float mul, int lane) {
  const int r0 = row0 + (lane >> 2), r1 = r0 + 8, c2 = (lane & 3) * 2;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    if (r0 < T)
      *reinterpret_cast<unsigned*>(dst + r0 * ld + nt * 8 + c2) = pack_bf16(acc[nt][0] * mul, acc[nt][1] * mul);
    if (r1 < T)
      *reinterpret_cast<unsigned*>(dst + r1 * ld + nt * 8 + c2) = pack_bf16(acc[nt][2] * mul, acc[nt][3] * mul);
  }
}

// The rope's backward fused into the gradient store (dq, dk of q / k that the caller rotated with ck.rope before
// the forward): rows rotated by -angle, (x1 c + x2 sn, x2 c - x1 sn) with pairs (i, i + D/2), in fp32 before the one
// rounding to bf16 (the separate ck.rope_backward launch re-read the stored bf16 gradient: 2 x 16 MB a layer at
// B8xT1024 x H32/8 x D64, ~36 us, and rounded twice). A thread holds columns nt * 8 + c2 (+1) of its two rows, so
// the pair (i, i + D/2) is accumulator tiles nt and nt + D/16 of the same thread. mode < 0: no rope; 0: row t at
// position t; 1: positions[t]; 2: positions[b * T + t] (int32); positions clamped into the table's L rows, as
// ck.rope does.
struct RopeTab {
  const float* c;
  const float* s;
  const int* pos;
  int mode, L;
};

template <int D>
__device__ __forceinline__ void store_acc_rope(bf16* dst, long long ld, int row0, int T, const float (&acc)[D / 8][4],
                                               float mul, int lane, const RopeTab& rt, long long pos_base) {
  if (rt.mode < 0) {
    store_acc<D>(dst, ld, row0, T, acc, mul, lane);
    return;
  }
  constexpr int H2 = D / 16;
  const int c2 = (lane & 3) * 2;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = row0 + (lane >> 2) + 8 * hr;
    if (r >= T) continue;
    long long p = rt.mode == 0 ? r : (long long)rt.pos[rt.mode == 1 ? r : pos_base + r];
    p = p < 0 ? 0 : (p >= rt.L ? rt.L - 1 : p);
    const float* cr = rt.c + p * (D / 2);
    const float* sr = rt.s + p * (D / 2);
#pragma unroll
    for (int nt = 0; nt < H2; ++nt) {
      const int i = nt * 8 + c2;
      const float2 c = *reinterpret_cast<const float2*>(cr + i);
      const float2 sn = *reinterpret_cast<const float2*>(sr + i);
      const float a0 = acc[nt][2 * hr] * mul, a1 = acc[nt][2 * hr + 1] * mul;
      const float b0 = acc[nt + H2][2 * hr] * mul, b1 = acc[nt + H2][2 * hr + 1] * mul;
      *reinterpret_cast<unsigned*>(dst + r * ld + i) = pack_bf16(a0 * c.x + b0 * sn.x, a1 * c.y + b1 * sn.y);
      *reinterpret_cast<unsigned*>(dst + r * ld + i + D / 2) = pack_bf16(b0 * c.x - a0 * sn.x, b1 * c.y - a1 * sn.y);
    }
  }
}

// lse (natural log, -inf for a query that sees no key) -> the exp2 offset: lse * log2(e), and +inf for -inf so
// that p = 2^(s - offset) = 0 instead of 2^(+inf).
__device__ __forceinline__ float lse_offset(float l) { return l == -CK_INF ? CK_INF : l * LOG2E; }

template <int D, int BN, int STAGES, int QB> struct SmemDq {
  static constexpr int FIX = 3 * BM * D * 2;  // Q, dO and O tiles (O: delta = rowsum(dO * O) from shared memory)
  static constexpr int KV = BN * D * 2;
  static constexpr int BYTES = QB * FIX + 2 * STAGES * KV + 8 * (2 * QB + 2 * STAGES) + 1024;
};

// Grid: min(tiles, SMs) persistent CTAs over ceil(Tq / 128) x H x B tiles; 384 threads; dynamic shared memory
// SmemDq<D, BN, STAGES>::BYTES.
template <int D, int BN, int STAGES, int QB, bool PP, bool SW>
__device__ __forceinline__ void attn_bwd_dq_sm90(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                 const bf16* __restrict__ v, const bf16* __restrict__ o,
                                                 const bf16* __restrict__ dout, const float* __restrict__ lse,
                                                 float* __restrict__ delta, bf16* __restrict__ dq, Strides sq,
                                                 Strides sk, Strides sv, Strides sdo, int Tq, int Tk, int H, int Hkv,
                                                 float scale, bool causal, int Bsz, Strides sgq, RopeTab rope,
                                                 int W) {
  using SM = SmemDq<D, BN, STAGES, QB>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* base = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* Fx = base;                  // [QB][Q, dO, O tiles]
  unsigned char* Ks = base + QB * SM::FIX;   // [STAGES][BN x D]
  unsigned char* Vs = Ks + STAGES * SM::KV;  // [STAGES][BN x D]
  const unsigned fixbar = smem_addr(Vs + STAGES * SM::KV), fixempty = fixbar + 8 * QB;  // [QB] each
  const unsigned full0 = fixbar + 16 * QB, empty0 = full0 + 8 * STAGES;

  const int tid = threadIdx.x, wg = tid / WG;
  const int off = Tk - Tq;
  const int nmb = (Tq + BM - 1) / BM, ntiles = nmb * H * Bsz;

  if (tid == 0) {
    for (int i = 0; i < QB; ++i) {
      mbar_init(fixbar + 8 * i, WG);
      mbar_init(fixempty + 8 * i, 2 * WG);  // the tile's last S / dP have read Q and dO
    }
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, WG);
      mbar_init(empty0 + 8 * s, 2 * WG);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // ---------------------------------------------------------------- producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
    Ring<STAGES> ring;
    int tc = 0;
    for (int t = snake_tile(0); t < ntiles; t = snake_tile(++tc)) {
      const TileIdx ti = tile_at(t, nmb, H, Bsz, causal);
      const int q0 = ti.blk * BM, j = ti.h / (H / Hkv);
      const int nkb = key_tiles(q0 + BM, Tk, off, causal, BN);
      const int jb0 = SW ? min(nkb, window_first(q0, off, W) / BN) : 0;
      const bf16* kp = k + ti.b * sk.b + j * sk.h;
      const bf16* vp = v + ti.b * sv.b + j * sv.h;
      const int fb = fix_buf<QB>(tc);
      unsigned char* Qs = Fx + fb * SM::FIX;
      mbar_wait(fixempty + 8 * fb, fix_par<QB>(tc) ^ 1);
      load_swz<D, BM>(Qs, q + ti.b * sq.b + ti.h * sq.h, sq.t, q0, Tq, tid);
      load_swz<D, BM>(Qs + BM * D * 2, dout + ti.b * sdo.b + ti.h * sdo.h, sdo.t, q0, Tq, tid);
      load_swz<D, BM>(Qs + 2 * BM * D * 2, o + ((long long)ti.b * Tq * H + ti.h) * D, (long long)H * D, q0, Tq, tid);
      cp_async_arrive(fixbar + 8 * fb);
      for (int jb = jb0; jb < nkb; ++jb, ring.next()) {
        mbar_wait(empty0 + 8 * ring.st, ring.ph ^ 1);
        load_swz<D, BN>(Ks + ring.st * SM::KV, kp, sk.t, jb * BN, Tk, tid);
        load_swz<D, BN>(Vs + ring.st * SM::KV, vp, sv.t, jb * BN, Tk, tid);
        cp_async_arrive(full0 + 8 * ring.st);
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    return;
  }

  // ---------------------------------------------------------------------------------- consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
  const int cw = wg - 1, ct = tid - wg * WG, warp = ct >> 5, lane = ct & 31, g = lane >> 2;
  const float sl2 = scale * LOG2E;
  const int lr0 = cw * 64 + warp * 16 + g, lr1 = lr0 + 8;  // this thread's two rows within the tile
  const Turns<PP> turns(cw);
  Ring<STAGES> ring;
  int tc = 0;
  for (int t = snake_tile(0); t < ntiles; t = snake_tile(++tc)) {
    const TileIdx ti = tile_at(t, nmb, H, Bsz, causal);
    const int h = ti.h, b = ti.b, q0 = ti.blk * BM;
    const int nkb = key_tiles(q0 + BM, Tk, off, causal, BN);
    const int jb0 = SW ? min(nkb, window_first(q0, off, W) / BN) : 0;  // as the producer's
    const int rbase = q0 + cw * 64, row0 = rbase + warp * 16, r0 = q0 + lr0, r1 = q0 + lr1;
    // lse loads issued before the wait, so their latency hides under it
    const float* lp = lse + ((long long)b * H + h) * Tq;
    const float lo0 = r0 < Tq ? lse_offset(lp[r0]) : CK_INF, lo1 = r1 < Tq ? lse_offset(lp[r1]) : CK_INF;
    const int fb = fix_buf<QB>(tc);
    const unsigned char* Qs = Fx + fb * SM::FIX;
    const unsigned char* dOs = Qs + BM * D * 2;
    const unsigned char* Os = Qs + 2 * BM * D * 2;
    const unsigned qaddr = smem_addr(Qs) + cw * 64 * 128, doaddr = smem_addr(dOs) + cw * 64 * 128;
    const unsigned fixfree = fixempty + 8 * fb;
    mbar_wait(fixbar + 8 * fb, fix_par<QB>(tc));

    // delta of rows r0, r1 = <dO_r, O_r> from the swizzled tiles: the quad's 4 lanes take D / 4 columns each
    // (D / 32 16-byte chunks, in column order), then a quad reduction; lane 0 of the quad writes it for
    // attn_sm90_bwd_dkdv. Rows past Tq are zero-filled (delta 0, not written).
    float dl0 = 0.f, dl1 = 0.f;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int lr = rr ? lr1 : lr0;
      float acc_d = 0.f;
#pragma unroll
      for (int cc = 0; cc < D / 32; ++cc) {
        const unsigned sw = swz<BM>(lr, (lane & 3) * (D / 32) + cc);
        const uint4 ov = *reinterpret_cast<const uint4*>(Os + sw);
        const uint4 dv = *reinterpret_cast<const uint4*>(dOs + sw);
        const unsigned ow[4] = {ov.x, ov.y, ov.z, ov.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc_d = fmaf(__uint_as_float(ow[e] << 16), __uint_as_float(dw[e] << 16), acc_d);
          acc_d = fmaf(__uint_as_float(ow[e] & 0xFFFF0000u), __uint_as_float(dw[e] & 0xFFFF0000u), acc_d);
        }
      }
      acc_d += __shfl_xor_sync(0xffffffffu, acc_d, 1);
      acc_d += __shfl_xor_sync(0xffffffffu, acc_d, 2);
      if (rr) dl1 = acc_d;
      else dl0 = acc_d;
    }
    if ((lane & 3) == 0) {
      float* dp = delta + ((long long)b * H + h) * Tq;
      if (r0 < Tq) dp[r0] = dl0;
      if (r1 < Tq) dp[r1] = dl1;
    }

    float acc[D / 8][4];
    zero(acc);
    turns.open(nkb > jb0);
    for (int jb = jb0; jb < nkb; ++jb, ring.next()) {
      const int st = ring.st, n0 = jb * BN;
      const bool last = jb + 1 == nkb;
      mbar_wait(full0 + 8 * st, ring.ph);
      // no key of the tile is visible to this warpgroup's rows (past the diagonal, or SW: below the window)
      if ((causal && n0 > rbase + 63 + off) || (SW && window_cuts(rbase, n0 + BN - 1, off, W))) {
        turns.skip(last, fixfree);
        mbar_arrive(empty0 + 8 * st);
        continue;
      }
      fence_proxy_async();
      const unsigned kaddr = smem_addr(Ks + st * SM::KV), vaddr = smem_addr(Vs + st * SM::KV);
      float s[BN / 8][4], dp[BN / 8][4];
      fence_regs(s);
      fence_regs(dp);
      turns.begin();
      wgmma_fence();
      issue_s<D, BN>(s, qaddr, kaddr);
      issue_s<D, BN>(dp, doaddr, vaddr);
      wgmma_commit();
      turns.end(false);
      wgmma_wait<0>();
      fence_regs(s);
      fence_regs(dp);
      if (last) mbar_arrive(fixfree);  // Q and dO read for the last time: this buffer may load again
      if (n0 + BN > Tk || (causal && n0 + BN - 1 > row0 + off) || (SW && window_cuts(row0 + 15, n0, off, W)))
        mask_tile<BN, SW>(s, row0, n0, Tk, off, causal, lane, W);
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {  // dS = P * (dP - delta), P = 2^(s * scale * log2(e) - lse * log2(e))
        dp[nt][0] = ex2(fmaf(s[nt][0], sl2, -lo0)) * (dp[nt][0] - dl0);
        dp[nt][1] = ex2(fmaf(s[nt][1], sl2, -lo0)) * (dp[nt][1] - dl0);
        dp[nt][2] = ex2(fmaf(s[nt][2], sl2, -lo1)) * (dp[nt][2] - dl1);
        dp[nt][3] = ex2(fmaf(s[nt][3], sl2, -lo1)) * (dp[nt][3] - dl1);
      }
      unsigned da[BN / 16][4];
      pack_p<BN>(da, dp);
      fence_regs(acc);
      turns.begin();
      wgmma_fence();
      issue_pv<D, BN>(acc, da, kaddr);  // dQ += dS K: K [key][d] read MN-major
      wgmma_commit();
      turns.end(last);
      wgmma_wait<0>();
      fence_regs(acc);
      fence_regs(da);
      mbar_arrive(empty0 + 8 * st);
    }
    if (nkb == jb0) mbar_arrive(fixfree);
    store_acc_rope<D>(dq + b * sgq.b + h * sgq.h, sgq.t, row0, Tq, acc, scale, lane, rope, (long long)b * Tq);
  }
}

template <int D, int BQ, int STAGES, int QB, bool FQ = false> struct SmemDkdv {
  static constexpr int FIX = 2 * BM * D * 2;  // K and V tiles (BM = 128 keys)
  static constexpr int QT = BQ * D * 2;       // one Q (or dO) stage
  static constexpr int VEC = BQ * 4;          // one lse (or delta) stage
  // FQ (the fused dQ): each consumer's dS^T tile [64 keys x BQ queries] bf16, and two hand-off buffers of the two
  // consumers' fp32 [BQ x D] dQ partials
  static constexpr int DS = FQ ? 2 * 64 * BQ * 2 : 0;
  static constexpr int PB = FQ ? 2 * 2 * BQ * D * 4 : 0;
  static constexpr int BYTES =
      QB * FIX + 2 * STAGES * QT + DS + PB + 2 * STAGES * VEC + 8 * (2 * QB + 2 * STAGES) + 1024;
};

// The fused backward's dQ (FQ): named barriers beyond the turns' 1 and 2, one per (hand-off buffer pb, consumer
// cw), each between that consumer warpgroup (128 threads) and the writer warp of the buffer (32): FULL (3 + 2 pb +
// cw) its partial is in the buffer, EMPTY (7 + 2 pb + cw) the writer has read it; DS (11 + cw, the warpgroup
// alone): its dS^T tile is in shared memory.
constexpr int BAR_FULL = 3, BAR_EMPTY = 7, BAR_DS = 11, HANDOFF_THREADS = WG + 32;
__device__ __forceinline__ void bar_sync_n(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ int ld_relaxed_gpu(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_gpu(int* p, int v) {
  asm volatile("st.relaxed.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void bar_arrive_n(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}
// Iteration `it` of a dkdv work tile: (query head within the group, query tile). Two-kernel backward: heads outer,
// query tiles ascending from the first visible one. Fused dQ: query tiles descending from the last, heads inner:
// every key tile of a (b, K/V head) walks the same sequence from the same start and stops at its own diagonal, so
// key tile j meets query tile i at the same iteration as key tile j - 1 and, after one wait, trails it by about a
// hand-off (the semaphore order is ascending j). Ascending from the diagonal, key tile j would start 2G
// iterations ahead of j - 1 on the query tiles they share, and wait that long. qend: one past the last query tile
// (nqb; under a sliding window QueryTiles::end, where key tile j starts 128 / BQ tiles above j - 1, so it trails j - 1
// on the query tiles they share, as before).
template <bool FQ>
__device__ __forceinline__ void dkdv_iter(int it, int G, int nq, int qstart, int qend, int& g, int& qi) {
  if (FQ) {
    g = it % G;
    qi = qend - 1 - it / G;
  } else {
    g = it / nq;
    qi = qstart + it % nq;
  }
}

// Grid: min(tiles, SMs) persistent CTAs over ceil(Tk / 128) x Hkv x B tiles (low key tiles first: under the
// causal mask they see the most queries); 384 threads; dynamic shared memory SmemDkdv<D, BQ, STAGES, QB, FQ>::BYTES.
//
// FQ = true (D = 64, BQ = 64; attn_sm90_bwd_dkdvq_d64): the five-product backward. The dq kernel recomputed S and
// dP (2 of its 3 products) for every (query tile, key tile) pair dkdv had already computed; here dkdv also issues
// dQ_part = dS K for each pair: each consumer stores its dS^T (64 keys x 64 queries, bf16) to shared memory and
// multiplies it by its 64 rows of K (both operands MN-major) in the same block as dV and dK, then stores its fp32
// partial into a hand-off buffer. Warps 2 and 3 of the producer warpgroup (the producer copies with warps 0-1)
// are the dQ writers, one per buffer: they sum the two partials in shared memory and add the pair's 128-key dQ
// into an fp32 accumulator dq_acc in global memory with one bulk reduce-add (cp.reduce.async.bulk .add.f32, 16 KB;
// dq_acc keeps the buffers' swizzled row order, which attn_sm90_bwd_dq_convert undoes). Deterministic: the key
// tiles of a query tile add in ascending order, one at a time, under a per-(b, h, query tile) semaphore sem = the
// number of key tiles that have added (key tile 0 bulk-copies instead of adding, so dq_acc needs no zeroing); a
// writer publishes sem = j + 1 once its bulk add has completed (wait_group 0, fence.acq_rel.gpu), and the next
// key tile's writer acquires it (relaxed poll, prefetched, then fence.acq_rel.gpu). Session 13 (NOTES) measured
// each step: done by consumer warpgroup 2 with red.global.add, the hand-off, the adds and the semaphore cost
// 32 + 64 + 105 us of the kernel's 409 at B8 x T1024 (the fifth product itself: 6 us); writer warps with 1024
// red.global.add.v4 a hand-off: 350 us; writer warps with the bulk reduce-add: ~275 us (dq + dkdv: 377).
// Deadlock-free: a writer waits only on key tiles before its own of the same (b, K/V head), which lie earlier in
// the list every CTA walks in order, with all CTAs resident (the grid is at most one CTA per SM; the launcher
// never runs this kernel one CTA per tile). attn_sm90_bwd_delta_d64 writes delta first,
// attn_sm90_bwd_dq_convert_d64 turns dq_acc into dq after (scale, the fused rope backward, zeros where no key
// tile added).
// SW: the sliding window W (else unused): query tiles up to the last one that sees the work tile's last key; the
// dQ semaphores of the fused backward count from the first key tile that sees the query tile.
template <int D, int BQ, int STAGES, int QB, bool PP, bool SW, bool FQ = false>
__device__ __forceinline__ void attn_bwd_dkdv_sm90(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                   const bf16* __restrict__ v, const bf16* __restrict__ dout,
                                                   const float* __restrict__ lse, const float* __restrict__ delta,
                                                   bf16* __restrict__ dk, bf16* __restrict__ dv, Strides sq,
                                                   Strides sk, Strides sv, Strides sdo, int Tq, int Tk, int H,
                                                   int Hkv, float scale, bool causal, int Bsz, Strides sgk,
                                                   RopeTab rope, int W, float* __restrict__ dq_acc = nullptr,
                                                   int* __restrict__ sem = nullptr) {
  using SM = SmemDkdv<D, BQ, STAGES, QB, FQ>;
  static_assert(!FQ || (D == 64 && BQ == 64), "the fused dQ is instantiated for D = 64, 64-query tiles");
  constexpr int NP = FQ ? 64 : WG;  // producer threads (FQ: warps 2 and 3 of the producer warpgroup write dQ)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* base = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* Fx = base;                     // [QB][K, V tiles]
  unsigned char* Qs = base + QB * SM::FIX;      // [STAGES][BQ x D]
  unsigned char* dOs = Qs + STAGES * SM::QT;    // [STAGES][BQ x D]
  unsigned char* dSs = dOs + STAGES * SM::QT;   // FQ: [2 consumers][64 keys x BQ] bf16, swizzled like V
  float* Pb = reinterpret_cast<float*>(dSs + SM::DS);           // FQ: [2 buffers][2 consumers][BQ x D] fp32
  float* Ls = reinterpret_cast<float*>(dSs + SM::DS + SM::PB);  // [STAGES][BQ]
  float* Ds = Ls + STAGES * BQ;                                  // [STAGES][BQ]
  const unsigned fixbar = smem_addr(Ds + STAGES * BQ), fixempty = fixbar + 8 * QB;  // [QB] each
  const unsigned full0 = fixbar + 16 * QB, empty0 = full0 + 8 * STAGES;

  const int tid = threadIdx.x, wg = tid / WG;
  const int G = H / Hkv, off = Tk - Tq;
  const int nkt = (Tk + BM - 1) / BM, ntiles = nkt * Hkv * Bsz;
  const int nqb = (Tq + BQ - 1) / BQ;

  if (tid == 0) {
    for (int i = 0; i < QB; ++i) {
      mbar_init(fixbar + 8 * i, NP);
      mbar_init(fixempty + 8 * i, 2 * WG);  // the tile's last S^T / dP^T (FQ: dQ) have read K and V
    }
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, NP);
      mbar_init(empty0 + 8 * s, 2 * WG);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(FQ ? PRODUCER_REGS_FQ : PRODUCER_REGS));
    if constexpr (FQ) {
      if (tid >= NP) {  // ------------------------------------------------------------ dQ writers
        // Warp w (2 or 3) takes the hand-offs pc with pc % 2 == w % 2, i.e. buffer pc % 2: it waits for both
        // consumers' partials, for the query tile's turn (sem == jr: the key tiles before j have added; jr = j, or
        // under a sliding window j minus the first key tile that sees the query tile, since those before it never
        // add), sums the partials (warpgroup 1's + warpgroup 2's) and stores (jr = 0) or adds them into dq_acc,
        // frees the buffer, then publishes sem = jr + 1 once its adds are performed (fence.acq_rel.gpu). The
        // consumers never wait on another CTA; they wait for this warp only when it is two hand-offs behind.
        const int wsel = (tid >> 5) & 1, lane = tid & 31;
        int pc = 0, tc = 0;
        for (int t = snake_tile(0); t < ntiles; t = snake_tile(++tc)) {
          const TileIdx ti = tile_at(t, nkt, Hkv, Bsz, false);
          const int j = ti.blk, b = ti.b, k0 = j * BM;
          const QueryTiles qt = query_tiles<SW>(k0, off, causal, nqb, BQ, min(k0 + BM, Tk) - 1, W);
          const int nit = G * qt.n;
          for (int it = 0; it < nit; ++it, ++pc) {
            if ((pc & 1) != wsel) continue;
            int gq, qi;
            dkdv_iter<true>(it, G, qt.n, qt.first, SW ? qt.end : nqb, gq, qi);
            const long long tile = ((long long)b * H + ti.h * G + gq) * nqb + qi;
            const int jr = SW ? j - window_first(qi * BQ, off, W) / BM : j;  // key tiles that added before
            int* semp = sem + tile;
            int semv = 0;
            if (lane == 0 && jr > 0) semv = ld_relaxed_gpu(semp);  // in flight while the consumers finish
            const int pb = pc & 1;
            bar_sync_n(BAR_FULL + 2 * pb, HANDOFF_THREADS);
            bar_sync_n(BAR_FULL + 2 * pb + 1, HANDOFF_THREADS);
            if (lane == 0 && jr > 0) {
              while (semv != jr) semv = ld_relaxed_gpu(semp);
              fence_acq_rel_gpu();
            }
            __syncwarp();
            // the two partials summed in place into warpgroup 1's (same swizzled positions), then one bulk copy
            // (key tile 0) or bulk reduce-add of the 16 KB tile into dq_acc, which keeps the swizzled order
            // (attn_sm90_bwd_dq_convert reads it back)
            const unsigned p0 = smem_addr(Pb) + 2 * pb * (BQ * D * 4), p1 = p0 + BQ * D * 4;
#pragma unroll 4
            for (int c = lane; c < BQ * D / 4; c += 32) {
              float4 a, e;
              asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                           : "=f"(a.x), "=f"(a.y), "=f"(a.z), "=f"(a.w) : "r"(p0 + 16 * c) : "memory");
              asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                           : "=f"(e.x), "=f"(e.y), "=f"(e.z), "=f"(e.w) : "r"(p1 + 16 * c) : "memory");
              asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(p0 + 16 * c), "f"(a.x + e.x),
                           "f"(a.y + e.y), "f"(a.z + e.z), "f"(a.w + e.w)
                           : "memory");
            }
            fence_proxy_async();  // the sums (generic proxy) before the bulk copy's (async proxy) reads
            __syncwarp();
            bar_arrive_n(BAR_EMPTY + 2 * pb + 1, HANDOFF_THREADS);  // warpgroup 2's partial is read
            float* dst = dq_acc + tile * (BQ * D);
            if (lane == 0) {
              if (jr == 0)
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(p0),
                             "n"(BQ * D * 4)
                             : "memory");
              else
                asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
                             "r"(p0), "n"(BQ * D * 4)
                             : "memory");
              asm volatile("cp.async.bulk.commit_group;" ::: "memory");
              asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            }
            __syncwarp();
            bar_arrive_n(BAR_EMPTY + 2 * pb, HANDOFF_THREADS);  // the sum is read: buffer free
            if (lane == 0) {
              asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // the adds performed
              fence_acq_rel_gpu();
              st_relaxed_gpu(semp, jr + 1);
            }
          }
        }
        return;
      }
    }
    // -------------------------------------------------------------------------------- producer
    Ring<STAGES> ring;
    int tc = 0;
    for (int t = snake_tile(0); t < ntiles; t = snake_tile(++tc)) {
      const TileIdx ti = tile_at(t, nkt, Hkv, Bsz, false);
      const int j = ti.h, b = ti.b, k0 = ti.blk * BM;
      const QueryTiles qt = query_tiles<SW>(k0, off, causal, nqb, BQ, min(k0 + BM, Tk) - 1, W);
      const int qstart = qt.first, nq = qt.n, nit = G * nq, qend = SW ? qt.end : nqb;
      const int fb = fix_buf<QB>(tc);
      mbar_wait(fixempty + 8 * fb, fix_par<QB>(tc) ^ 1);
      load_swz<D, BM, NP>(Fx + fb * SM::FIX, k + b * sk.b + j * sk.h, sk.t, k0, Tk, tid);
      load_swz<D, BM, NP>(Fx + fb * SM::FIX + BM * D * 2, v + b * sv.b + j * sv.h, sv.t, k0, Tk, tid);
      cp_async_arrive(fixbar + 8 * fb);
      for (int it = 0; it < nit; ++it, ring.next()) {
        int gq, qi;
        dkdv_iter<FQ>(it, G, nq, qstart, qend, gq, qi);
        const int st = ring.st, hq = j * G + gq, qb0 = qi * BQ;
        mbar_wait(empty0 + 8 * st, ring.ph ^ 1);
        load_swz<D, BQ, NP>(Qs + st * SM::QT, q + b * sq.b + hq * sq.h, sq.t, qb0, Tq, tid);
        load_swz<D, BQ, NP>(dOs + st * SM::QT, dout + b * sdo.b + hq * sdo.h, sdo.t, qb0, Tq, tid);
        const long long vrow = ((long long)b * H + hq) * Tq;
#pragma unroll
        for (int i = tid; i < 2 * BQ; i += NP) {  // lse and delta of the tile's queries, 4 bytes each (any Tq)
          const int c = i % BQ, ok = qb0 + c < Tq;
          const float* src = (i < BQ ? lse : delta) + vrow + (ok ? qb0 + c : 0);
          cp_async4((i < BQ ? Ls : Ds) + st * BQ + c, src, ok);
        }
        cp_async_arrive(full0 + 8 * st);
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    return;
  }

  // ---------------------------------------------------------------------------------- consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(FQ ? CONSUMER_REGS_FQ : CONSUMER_REGS));
  const int cw = wg - 1, ct = tid - wg * WG, warp = ct >> 5, lane = ct & 31, c2 = (lane & 3) * 2;
  const float sl2 = scale * LOG2E;
  const Turns<PP> turns(cw);
  Ring<STAGES> ring;
  int tc = 0;
  int pc = 0;  // FQ: hand-offs so far (the writers count the same iterations)
  const unsigned dsaddr = FQ ? smem_addr(dSs) + cw * (64 * BQ * 2) : 0u;
  for (int t = snake_tile(0); t < ntiles; t = snake_tile(++tc)) {
    const TileIdx ti = tile_at(t, nkt, Hkv, Bsz, false);
    const int j = ti.h, b = ti.b, k0 = ti.blk * BM;
    const QueryTiles qt = query_tiles<SW>(k0, off, causal, nqb, BQ, min(k0 + BM, Tk) - 1, W);
    const int qstart = qt.first, nq = qt.n, nit = G * nq, qend = SW ? qt.end : nqb;
    const int kbase = k0 + cw * 64, row0 = kbase + warp * 16;  // rows = keys

    const int fb = fix_buf<QB>(tc);
    const unsigned kaddr = smem_addr(Fx + fb * SM::FIX) + cw * 64 * 128;
    const unsigned vaddr = smem_addr(Fx + fb * SM::FIX + BM * D * 2) + cw * 64 * 128;
    const unsigned fixfree = fixempty + 8 * fb;

    float dka[D / 8][4], dva[D / 8][4];
    zero(dka);
    zero(dva);
    mbar_wait(fixbar + 8 * fb, fix_par<QB>(tc));
    turns.open(nit > 0);
    for (int it = 0; it < nit; ++it, ring.next()) {
      int gq, qi;
      dkdv_iter<FQ>(it, G, nq, qstart, qend, gq, qi);
      const int st = ring.st, qb0 = qi * BQ;
      const bool last = it + 1 == nit;
      float dqa[FQ ? D / 8 : 1][4];
      mbar_wait(full0 + 8 * st, ring.ph);
      // every query of the tile is before this warpgroup's keys, or (SW) past their window
      if ((causal && qb0 + BQ - 1 + off < kbase) || (SW && window_cuts(qb0, kbase + 63, off, W))) {
        turns.skip(last, fixfree);
        mbar_arrive(empty0 + 8 * st);
        if constexpr (FQ) zero(dqa);
      } else {
        fence_proxy_async();
        const unsigned qaddr = smem_addr(Qs + st * SM::QT), doaddr = smem_addr(dOs + st * SM::QT);
        float s[BQ / 8][4], dp[BQ / 8][4];  // S^T and dP^T: rows = keys, columns = queries
        fence_regs(s);
        fence_regs(dp);
        turns.begin();
        wgmma_fence();
        issue_s<D, BQ>(s, kaddr, qaddr);
        issue_s<D, BQ>(dp, vaddr, doaddr);
        wgmma_commit();
        turns.end(false);
        wgmma_wait<0>();
        fence_regs(s);
        fence_regs(dp);
        if (!FQ && last) mbar_arrive(fixfree);  // K and V read for the last time: this buffer may load again
        // Mask: queries >= Tq (zero-filled rows would give p = 2^(0 - lse)), keys >= Tk (never stored, but their
        // 2^(0 - lse) may overflow), the causal rule key > query + off, and (SW) query + off - key >= W.
        if (qb0 + BQ > Tq || row0 + 15 >= Tk || (causal && row0 + 15 > qb0 + off) ||
            (SW && window_cuts(qb0 + BQ - 1, row0, off, W))) {
          const int g = lane >> 2;
#pragma unroll
          for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = row0 + g + (e >> 1) * 8, qi_ = qb0 + nt * 8 + c2 + (e & 1);
              if (qi_ >= Tq || key >= Tk || (causal && key > qi_ + off) || (SW && qi_ + off - key >= W))
                s[nt][e] = -CK_INF;
            }
        }
        const float* Lt = Ls + st * BQ;
        const float* Dt = Ds + st * BQ;
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt) {
          const float2 lq = *reinterpret_cast<const float2*>(Lt + nt * 8 + c2);
          const float2 dq_ = *reinterpret_cast<const float2*>(Dt + nt * 8 + c2);
          const float lo0 = lse_offset(lq.x), lo1 = lse_offset(lq.y);
          const float p00 = ex2(fmaf(s[nt][0], sl2, -lo0)), p01 = ex2(fmaf(s[nt][1], sl2, -lo1));
          const float p10 = ex2(fmaf(s[nt][2], sl2, -lo0)), p11 = ex2(fmaf(s[nt][3], sl2, -lo1));
          s[nt][0] = p00;
          s[nt][1] = p01;
          s[nt][2] = p10;
          s[nt][3] = p11;
          dp[nt][0] = p00 * (dp[nt][0] - dq_.x);  // dS^T
          dp[nt][1] = p01 * (dp[nt][1] - dq_.y);
          dp[nt][2] = p10 * (dp[nt][2] - dq_.x);
          dp[nt][3] = p11 * (dp[nt][3] - dq_.y);
        }
        unsigned pa[BQ / 16][4], da[BQ / 16][4];
        pack_p<BQ>(pa, s);
        pack_p<BQ>(da, dp);
        if constexpr (FQ) {
          // dS^T to shared memory as dQ's A operand, [key][query] with the queries contiguous (128-byte rows,
          // the 128-byte swizzle: chunk nt of key row r at (nt ^ (r & 7)); r & 7 = g). A warp's 32 lanes write
          // 8 rows x 4 words of one chunk column: 32 distinct banks.
          // The previous iteration's dQ wgmma reads every row of this tile (warp w's queries across all keys),
          // and a warp's wgmma_wait covers its own part: without the ping-pong turns (whose first turn of the
          // iteration is a barrier of the whole warpgroup) nothing else holds a fast warp here until the slowest
          // has passed that wait in the first hand-offs (the writer's EMPTY barrier does from hand-off 3 on).
          if constexpr (!PP) bar_sync_n(BAR_DS + cw, WG);
          const int g = lane >> 2;
#pragma unroll
          for (int kk = 0; kk < BQ / 16; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int r = warp * 16 + g + (e & 1) * 8, nt = 2 * kk + (e >> 1);
              asm volatile("st.shared.b32 [%0], %1;" ::"r"(dsaddr + r * 128 + ((nt ^ g) << 4) + c2 * 2),
                           "r"(da[kk][e])
                           : "memory");
            }
          fence_proxy_async();  // generic-proxy stores before the tensor core's (async-proxy) reads
          bar_sync_n(BAR_DS + cw, WG);
        }
        fence_regs(dva);
        fence_regs(dka);
        turns.begin();
        wgmma_fence();
        issue_pv<D, BQ>(dva, pa, doaddr);  // dV += P^T dO (dO MN-major)
        issue_pv<D, BQ>(dka, da, qaddr);   // dK += dS^T Q (Q MN-major)
        if constexpr (FQ) {  // dQ_part = dS K over this warpgroup's 64 keys: A = dS^T, B = K, both MN-major
          const unsigned long long a0 = make_desc(dsaddr, 64 * 128, 1024), b0 = make_desc(kaddr, BM * 128, 1024);
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            wgmma_ss_n64_tt(dqa, desc_plus(a0, kk * 2048), desc_plus(b0, kk * 2048), kk > 0);
        }
        wgmma_commit();
        turns.end(last);
        wgmma_wait<0>();
        fence_regs(dva);
        fence_regs(dka);
        fence_regs(pa);
        fence_regs(da);
        if constexpr (FQ) {
          fence_regs(dqa);
          if (last) mbar_arrive(fixfree);  // K (dQ's B) and V read for the last time
        }
        mbar_arrive(empty0 + 8 * st);
      }
      if constexpr (FQ) {
        // Hand-off to the writer warp of buffer pc % 2: thread (warp, lane) holds dQ_part rows warp * 16 + g
        // (+ 8), columns nt * 8 + c2 (+ 1); float2 slot p = nt * 4 + (lane & 3) of row r is stored at
        // p ^ ((r & 7) << 2) (a warp's 32 float2 stores fill the 32 banks twice: 2 wavefronts, the minimum; the
        // writer's float4 c of row r sits at (c ^ ((r & 7) << 1)): 8 lanes of a phase, 8 distinct bank quads).
        const int g = lane >> 2, pb = pc & 1;
        float* P = Pb + (2 * pb + cw) * (BQ * D);
        if (pc >= 2) bar_sync_n(BAR_EMPTY + 2 * pb + cw, HANDOFF_THREADS);  // the writer has read hand-off pc - 2
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = warp * 16 + g + 8 * h, slot = (nt * 4 + (lane & 3)) ^ (g << 2);
            *reinterpret_cast<float2*>(P + r * D + slot * 2) = make_float2(dqa[nt][2 * h], dqa[nt][2 * h + 1]);
          }
        bar_arrive_n(BAR_FULL + 2 * pb + cw, HANDOFF_THREADS);
        ++pc;
      }
    }
    if (nit == 0) mbar_arrive(fixfree);
    store_acc_rope<D>(dk + b * sgk.b + j * sgk.h, sgk.t, row0, Tk, dka, scale, lane, rope, (long long)b * Tk);
    store_acc<D>(dv + b * sgk.b + j * sgk.h, sgk.t, row0, Tk, dva, 1.f, lane);
  }
  if constexpr (FQ) {  // the EMPTY arrivals not waited for (hand-offs pc - 2 and pc - 1)
    if (pc >= 2) bar_sync_n(BAR_EMPTY + 2 * (pc & 1) + cw, HANDOFF_THREADS);
    if (pc >= 1) bar_sync_n(BAR_EMPTY + 2 * ((pc - 1) & 1) + cw, HANDOFF_THREADS);
  }
}

// Before the fused backward: delta[b, h, t] = <dO[b, t, h], o[b, t, h]> (the dq kernel's job in the two-kernel
// backward). D / 8 threads a row of 16-byte chunks; rows in o's order (b, t, h): o is read contiguously.
template <int D>
__device__ __forceinline__ void bwd_delta(const bf16* __restrict__ o, const bf16* __restrict__ dout,
                                          float* __restrict__ delta, Strides sdo, int Tq, int H, int Bsz) {
  constexpr int TPR = D / 8;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, row = i / TPR;
  const int c = (int)(i % TPR);
  const bool ok = row < (long long)Bsz * Tq * H;
  const long long rr = ok ? row : 0;
  const int h = (int)(rr % H);
  const long long bt = rr / H;
  const int t = (int)(bt % Tq), b = (int)(bt / Tq);
  const uint4 ov = *reinterpret_cast<const uint4*>(o + rr * D + c * 8);
  const uint4 dv = *reinterpret_cast<const uint4*>(dout + b * sdo.b + t * sdo.t + h * sdo.h + c * 8);
  const unsigned ow[4] = {ov.x, ov.y, ov.z, ov.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
  float acc = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    acc = fmaf(__uint_as_float(ow[e] << 16), __uint_as_float(dw[e] << 16), acc);
    acc = fmaf(__uint_as_float(ow[e] & 0xFFFF0000u), __uint_as_float(dw[e] & 0xFFFF0000u), acc);
  }
#pragma unroll
  for (int m = 1; m < TPR; m <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (ok && c == 0) delta[((long long)b * H + h) * Tq + t] = acc;
}

// After the fused backward: dq[b, t, h] = scale * dq_acc[b, h, t] rounded to bf16 (rope backward fused, as in
// store_acc_rope), 0 where no key tile added (sem = 0: queries that see no key, Tq > Tk under the causal mask).
// D / 8 threads a row, each 4 columns of each half (the rope's pairs (i, i + D / 2)); rows in dq_acc's order.
template <int D, int BQ>
__device__ __forceinline__ void bwd_dq_convert(const float* __restrict__ acc, const int* __restrict__ sem,
                                               bf16* __restrict__ dq, Strides sgq, int Tq, int H, int Bsz,
                                               float scale, RopeTab rt) {
  constexpr int TPR = D / 8;
  const int nqb = (Tq + BQ - 1) / BQ;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, row = i / TPR;
  if (row >= (long long)Bsz * H * Tq) return;
  const int c = (int)(i % TPR) * 4, t = (int)(row % Tq);
  const long long bh = row / Tq;
  const int h = (int)(bh % H), b = (int)(bh / H);
  const bool any = sem[bh * nqb + t / BQ] > 0;
  // dq_acc rows keep the hand-off buffers' swizzle: float4 q of row r at q ^ ((r & 7) << 1)
  const float* src = acc + (bh * nqb * BQ + t) * D;
  const int sw = (t & 7) << 1;
  float4 a = any ? *reinterpret_cast<const float4*>(src + 4 * ((c >> 2) ^ sw)) : make_float4(0.f, 0.f, 0.f, 0.f);
  float4 z = any ? *reinterpret_cast<const float4*>(src + 4 * (((c + D / 2) >> 2) ^ sw))
                 : make_float4(0.f, 0.f, 0.f, 0.f);
  float x0[4] = {a.x * scale, a.y * scale, a.z * scale, a.w * scale};
  float x1[4] = {z.x * scale, z.y * scale, z.z * scale, z.w * scale};
  if (rt.mode >= 0) {  // rotate by -angle: (x1 c + x2 s, x2 c - x1 s)
    long long p = rt.mode == 0 ? t : (long long)rt.pos[rt.mode == 1 ? t : (long long)b * Tq + t];
    p = p < 0 ? 0 : (p >= rt.L ? rt.L - 1 : p);
    const float4 cs = *reinterpret_cast<const float4*>(rt.c + p * (D / 2) + c);
    const float4 sn = *reinterpret_cast<const float4*>(rt.s + p * (D / 2) + c);
    const float cc[4] = {cs.x, cs.y, cs.z, cs.w}, ss[4] = {sn.x, sn.y, sn.z, sn.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float u = x0[e], w = x1[e];
      x0[e] = u * cc[e] + w * ss[e];
      x1[e] = w * cc[e] - u * ss[e];
    }
  }
  bf16* d = dq + b * sgq.b + t * sgq.t + h * sgq.h + c;
  reinterpret_cast<unsigned*>(d)[0] = pack_bf16(x0[0], x0[1]);
  reinterpret_cast<unsigned*>(d)[1] = pack_bf16(x0[2], x0[3]);
  reinterpret_cast<unsigned*>(d + D / 2)[0] = pack_bf16(x1[0], x1[1]);
  reinterpret_cast<unsigned*>(d + D / 2)[1] = pack_bf16(x1[2], x1[3]);
}

// ================================================================================================ entry points
// attn_sm90_fwd_d{64,128}: same arguments as attention.cu's attn_fwd_d{D} (strides in elements: batch, token,
// head; the last axis contiguous) plus the batch size Bsz. Launch: 384 threads, a 1-D grid of at most
// ceil(Tq / 128) * H * Bsz persistent CTAs (one per SM), dynamic shared memory Smem<D, BN, STAGES>::BYTES
// (mirrored by cukernels/ops/attention_sm90.py's CONFIG). The sliding-window twin of each, attn_sm90_fwd_d{D}_sw{SUF},
// takes the window W (1 <= W < Tk, causal) after Bsz.
#define CK_ATTN90_FWD_2(D, BN, STAGES, QB, MODE, NC, SW, TAG, SUF, EXTRA, WIN)                                 \
  CK_ENTRY(__launch_bounds__((NC + 1) * WG, 1), attn_sm90_fwd_d##D##TAG##SUF)(                                 \
      const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, long long qb, long long qt,            \
      long long qh, long long kb, long long kt, long long kh, long long vb, long long vt, long long vh, int Tq, \
      int Tk, int H, int Hkv, float scale, bool causal, int Bsz EXTRA) {                                       \
    attn_fwd_sm90<D, BN, STAGES, QB, MODE, NC, SW>(q, k, v, o, lse, Strides{qb, qt, qh}, Strides{kb, kt, kh},  \
                                     Strides{vb, vt, vh}, Tq, Tk, H, Hkv, scale, causal, Bsz, WIN);            \
  }
#define CK_COMMA ,
#define CK_ATTN90_FWD_1(D, BN, STAGES, QB, MODE, NC, SUF)                                                      \
  CK_ATTN90_FWD_2(D, BN, STAGES, QB, MODE, NC, false, , SUF, , 0)                                              \
  CK_ATTN90_FWD_2(D, BN, STAGES, QB, MODE, NC, true, _sw, SUF, CK_COMMA int W, W)
// attn_sm90_fwd_d{D}: the pipelined ping-pong consumers; attn_sm90_fwd_d{D}_serial: the serial consumer loop (same
// tiles, same shared memory; the fallback and the reference point of the benchmark); attn_sm90_fwd_d{D}_overlap:
// the pipelined loop without the ping-pong turns. ck.settings.attention_sm90_variant picks the production one.
#define CK_ATTN90_FWD(D, BN, STAGES, QB)              \
  CK_ATTN90_FWD_1(D, BN, STAGES, QB, 1, 2, )          \
  CK_ATTN90_FWD_1(D, BN, STAGES, QB, 0, 2, _serial)   \
  CK_ATTN90_FWD_1(D, BN, STAGES, QB, 2, 2, _overlap)
// D = 64: 128-key tiles, 4 stages, 2 Q buffers: 2 x 16 KB + 4 x 32 KB K/V = 160 KB (one CTA per SM: 384 threads
// x 168 registers is the whole register file). D = 128: 128-key tiles, 2 stages, 2 Q buffers: 2 x 32 KB +
// 2 x 64 KB = 192 KB (of the 227 KB an SM gives one block).
CK_ATTN90_FWD(64, 128, 4, 2)
CK_ATTN90_FWD(128, 128, 2, 2)
// attn_sm90_fwd_d64_wg3: three consumer warpgroups (192 query rows a work tile, 512 threads, the overlap loop),
// FlashAttention-3's shape at head_dim 64: 2 x 24 KB Q + 4 x 32 KB K/V = 176 KB. D = 128 would need 64 + 64 + 32
// accumulator / score / P registers a thread, more than 160: not instantiated.
#define CK_ATTN90_FWD_WG3(D, BN, STAGES, QB) CK_ATTN90_FWD_1(D, BN, STAGES, QB, 2, 3, _wg3)
CK_ATTN90_FWD_WG3(64, 128, 4, 2)

// Backward entry points: attn_sm90_bwd_dq_d{D} and attn_sm90_bwd_dkdv_d{D}, same arguments as attention.cu's
// attn_bwd_dq_d{D} / attn_bwd_dkdv_d{D} plus Bsz, the element strides (batch, token, head) of the gradients they
// write (dq; dk and dv share theirs): [B, T, heads, D] C-contiguous, or the head slices of one packed dqkv, and the
// rope tables for the fused rope backward of dq and dk (RopeTab; rmode -1: none). 1-D grids of persistent CTAs
// over ceil(Tq / 128) * H * Bsz and ceil(Tk / 128) * Hkv * Bsz work tiles (at most one CTA per SM), 384 threads.
// The sliding-window twins attn_sm90_bwd_{dq,dkdv}_d{D}_sw{SUF} take the window W after rL.
#define CK_ATTN90_BWD_2(D, BN, STQ, BQ, STK, QBQ, QBK, PP, SW, TAG, SUF, EXTRA, WIN)                                   \
  CK_ENTRY(__launch_bounds__(NTHREADS, 1), attn_sm90_bwd_dq_d##D##TAG##SUF)(                                   \
      const bf16* q, const bf16* k, const bf16* v, const bf16* o, const bf16* dout, const float* lse,          \
      float* delta, bf16* dq, long long qb, long long qt, long long qh, long long kb, long long kt,             \
      long long kh, long long vb, long long vt, long long vh, long long db, long long dt, long long dh, int Tq, \
      int Tk, int H, int Hkv, float scale, bool causal, int Bsz, long long gb, long long gt, long long gh,      \
      const float* rc, const float* rs, const int* rp, int rmode, int rL EXTRA) {                             \
    attn_bwd_dq_sm90<D, BN, STQ, QBQ, PP, SW>(q, k, v, o, dout, lse, delta, dq, Strides{qb, qt, qh},                \
                                     Strides{kb, kt, kh}, Strides{vb, vt, vh}, Strides{db, dt, dh}, Tq, Tk, H, \
                                     Hkv, scale, causal, Bsz, Strides{gb, gt, gh}, RopeTab{rc, rs, rp, rmode, rL}, \
                                     WIN);                                                                     \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(NTHREADS, 1), attn_sm90_bwd_dkdv_d##D##TAG##SUF)(                                 \
      const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* delta,     \
      bf16* dk, bf16* dv, long long qb, long long qt, long long qh, long long kb, long long kt, long long kh,   \
      long long vb, long long vt, long long vh, long long db, long long dt, long long dh, int Tq, int Tk,      \
      int H, int Hkv, float scale, bool causal, int Bsz, long long gb, long long gt, long long gh,              \
      const float* rc, const float* rs, const int* rp, int rmode, int rL EXTRA) {                             \
    attn_bwd_dkdv_sm90<D, BQ, STK, QBK, PP, SW>(q, k, v, dout, lse, delta, dk, dv, Strides{qb, qt, qh},             \
                                       Strides{kb, kt, kh}, Strides{vb, vt, vh}, Strides{db, dt, dh}, Tq, Tk,  \
                                       H, Hkv, scale, causal, Bsz, Strides{gb, gt, gh},                        \
                                       RopeTab{rc, rs, rp, rmode, rL}, WIN);                                    \
  }
#define CK_ATTN90_BWD_1(D, BN, STQ, BQ, STK, QBQ, QBK, PP, SUF)                                  \
  CK_ATTN90_BWD_2(D, BN, STQ, BQ, STK, QBQ, QBK, PP, false, , SUF, , 0)                          \
  CK_ATTN90_BWD_2(D, BN, STQ, BQ, STK, QBQ, QBK, PP, true, _sw, SUF, CK_COMMA int W, W)
// attn_sm90_bwd_{dq,dkdv}_d{D}: ping-pong turns (Turns<true>); *_serial: the same loops without them.
#define CK_ATTN90_BWD(D, BN, STQ, BQ, STK, QBQ, QBK)             \
  CK_ATTN90_BWD_1(D, BN, STQ, BQ, STK, QBQ, QBK, true, )         \
  CK_ATTN90_BWD_1(D, BN, STQ, BQ, STK, QBQ, QBK, false, _serial)
// dq: 64-key tiles (S, dP: 32 registers each; dQ 32 / 64); dkdv: 64-query tiles at D = 64, 32 at D = 128 (dK and
// dV accumulators are 64 + 64 registers there). Stages and fixed-tile buffers as shared memory allows: dq D = 64
// 2 x 48 KB (Q, dO, O) + 4 x 16 KB = 160 KB; D = 128 1 x 96 KB + 3 x 32 KB = 192 KB; dkdv D = 64
// 2 x 32 KB (K, V) + 4 x 16.5 KB = 131 KB; D = 128 2 x 64 KB + 4 x 16.3 KB = 194 KB.
CK_ATTN90_BWD(64, 64, 4, 64, 4, 2, 2)
CK_ATTN90_BWD(128, 64, 3, 32, 4, 1, 2)

// The fused (five-product) backward at head_dim 64: attn_sm90_bwd_delta_d64, then attn_sm90_bwd_dkdvq_d64{,_serial}
// (dkdv's arguments plus dq_acc: fp32 [B, H, ceil(Tq / 64) * 64, 64], rows swizzled by 16-byte chunk, and sem:
// int32 [B, H, ceil(Tq / 64)], zeroed), then attn_sm90_bwd_dq_convert_d64. dkdvq: 64-query tiles, 4 stages, 2 K / V
// buffers, + 2 x 8 KB dS^T + 2 x 2 x 16 KB hand-off = 211 KB of shared memory. Its grid must be persistent (at
// most one CTA per SM). The sliding-window twins attn_sm90_bwd_dkdvq_d64_sw{SUF} take the window W after sem.
#define CK_ATTN90_BWD_FQ_2(D, BQ, STK, QBK, PP, SW, TAG, SUF, EXTRA, WIN)                                      \
  CK_ENTRY(__launch_bounds__(NTHREADS, 1), attn_sm90_bwd_dkdvq_d##D##TAG##SUF)(                                \
      const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* delta,     \
      bf16* dk, bf16* dv, long long qb, long long qt, long long qh, long long kb, long long kt, long long kh,   \
      long long vb, long long vt, long long vh, long long db, long long dt, long long dh, int Tq, int Tk,      \
      int H, int Hkv, float scale, bool causal, int Bsz, long long gb, long long gt, long long gh,              \
      const float* rc, const float* rs, const int* rp, int rmode, int rL, float* dq_acc, int* sem EXTRA) {    \
    attn_bwd_dkdv_sm90<D, BQ, STK, QBK, PP, SW, true>(q, k, v, dout, lse, delta, dk, dv, Strides{qb, qt, qh},   \
                                                  Strides{kb, kt, kh}, Strides{vb, vt, vh}, Strides{db, dt, dh}, \
                                                  Tq, Tk, H, Hkv, scale, causal, Bsz, Strides{gb, gt, gh},      \
                                                  RopeTab{rc, rs, rp, rmode, rL}, WIN, dq_acc, sem);            \
  }
#define CK_ATTN90_BWD_FQ_1(D, BQ, STK, QBK, PP, SUF)                       \
  CK_ATTN90_BWD_FQ_2(D, BQ, STK, QBK, PP, false, , SUF, , 0)               \
  CK_ATTN90_BWD_FQ_2(D, BQ, STK, QBK, PP, true, _sw, SUF, CK_COMMA int W, W)
CK_ATTN90_BWD_FQ_1(64, 64, 4, 2, true, )
CK_ATTN90_BWD_FQ_1(64, 64, 4, 2, false, _serial)

// 256 threads a block, ceil(rows * 8 / 256) blocks (rows = B * Tq * H).
CK_ENTRY(__launch_bounds__(256), attn_sm90_bwd_delta_d64)(const bf16* o, const bf16* dout,
                                                          float* delta, long long db, long long dt,
                                                          long long dh, int Tq, int H, int Bsz) {
  bwd_delta<64>(o, dout, delta, Strides{db, dt, dh}, Tq, H, Bsz);
}
CK_ENTRY(__launch_bounds__(256), attn_sm90_bwd_dq_convert_d64)(
    const float* acc, const int* sem, bf16* dq, long long gb, long long gt, long long gh, int Tq, int H, int Bsz,
    float scale, const float* rc, const float* rs, const int* rp, int rmode, int rL) {
  bwd_dq_convert<64, 64>(acc, sem, dq, Strides{gb, gt, gh}, Tq, H, Bsz, scale, RopeTab{rc, rs, rp, rmode, rL});
}
