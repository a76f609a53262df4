"""ck.flash_attention_sm90 (kernels_cu/attention_sm90.cu, wgmma on sm_90a).

CPU: a NumPy model of the kernel's index math, checked before any GPU run: the producer's swizzled shared-memory
placement (cp.async chunks), the wgmma shared-memory descriptors as the PTX ISA's canonical 128-byte-swizzle
layouts read them (K-major Q / K, MN-major V), the accumulator fragment (thread t, register i) -> (row, col) of
m64nNk16 and the register A fragment the P tile is packed into. A simulated CTA runs S = Q K^T and O += P V
through those descriptors on bytes placed by the producer model and must reproduce the matrix products.
Plus the NumPy reference path and validation. GPU (sm_90 only): the kernel against the NumPy reference and
against ck.flash_attention (mma.sync), lse, strided views, poisoned outputs, reruns bit-identical, large scores,
and the existing backward fed with this forward's o / lse.
"""
import re
from pathlib import Path

import numpy as np
import pytest

import cukernels as ck
from cukernels.ops import attention_sm90 as A90
from helpers import cp, to_host

BF16 = ck.bfloat16
CU = Path(__file__).resolve().parent.parent / "kernels_cu" / "attention_sm90.cu"
HOPPER = CU.parent / "common" / "hopper.cuh"  # the generic mbarrier / wgmma / descriptor / swizzle primitives

# ------------------------------------------------------------------------------------------------ model
# Every function below mirrors one piece of attention_sm90.cu or common/hopper.cuh (named in its docstring), except
# hw_addr and the fragment layouts acc_pos / a_pos, which are the hardware's side (PTX ISA: "Matrix Descriptor",
# "Shared Memory Matrix Layout" with 128-byte swizzling, "Register Fragments" of wgmma .m64nNk16 for .f32 / .bf16).
WG = 128
BM = 128


def swz(rows, r, c):
    """Kernel swz<ROWS>(r, c): byte offset of 16-byte chunk c of row r in a swizzled [rows x D] tile."""
    return (c >> 3) * (rows * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4)


def producer_chunks(D, rows, tid):
    """Kernel load_swz<D, ROWS>: the (row, chunk, byte offset) triples producer thread tid copies, in order."""
    ch = D // 8
    rpi = WG // ch
    r, c = tid // ch, tid % ch
    d = swz(rows, r, c)
    return [(r + rpi * i, c, d + i * rpi * 128) for i in range(rows // rpi)]


def place(smem, base, tile, rows):
    """Write tile ([rows, D] uint16 bf16 bits) into the byte array smem at base, as the producer's cp.asyncs do."""
    D = tile.shape[1]
    for tid in range(WG):
        for r, c, off in producer_chunks(D, rows, tid):
            smem[base + off:base + off + 16] = tile[r, 8 * c:8 * c + 8].view(np.uint8)


def make_desc(addr, lbo, sbo):
    """Kernel make_desc: 128-byte-swizzle matrix descriptor."""
    return ((addr & 0x3FFFF) >> 4) | (((lbo >> 4) & 0x3FFF) << 16) | (((sbo >> 4) & 0x3FFF) << 32) | (1 << 62)


def hw_addr(desc, mn, k, major):
    """Shared byte address the tensor core reads for element (mn, k) of a wgmma operand (k < 16) described by
    desc: the canonical SW128 layouts (cute's make_gmma_desc comments, in bytes; T = 16 bytes):
    K-major ((8, m), (T, 2)) : ((128 B, SBO), (2 B, 16 B)) -- rows of 128 bytes, 8-row groups SBO apart;
    MN-major ((64, n), (8, k)) : ((2 B, LBO), (128 B, SBO)) -- 64 contiguous elements, blocks of 64 LBO apart.
    Swizzle<3,4,3> on the final address: bits 4-6 ^= bits 7-9."""
    start = (desc & 0x3FFF) << 4
    lbo = ((desc >> 16) & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    assert desc >> 62 == 1, "128-byte swizzle"
    assert (desc >> 49) & 7 == 0, "base offset 0"
    if major == "K":
        a = start + (mn % 8) * 128 + (mn // 8) * sbo + 2 * k
    else:
        a = start + (mn % 64) * 2 + (mn // 64) * lbo + (k % 8) * 128 + (k // 8) * sbo
    return a ^ (((a >> 7) & 7) << 4)


def read_bf16(smem, addr):
    return float(np.frombuffer(bytes(smem[addr:addr + 2]), dtype=BF16)[0])


def wgmma_ss(d, smem, da, db):
    """d[64, N] += A B^T, A = 64 x 16 and B = N x 16, both K-major in shared memory."""
    N = d.shape[1]
    a = np.array([[read_bf16(smem, hw_addr(da, m, k, "K")) for k in range(16)] for m in range(64)])
    b = np.array([[read_bf16(smem, hw_addr(db, n, k, "K")) for k in range(16)] for n in range(N)])
    d += a @ b.T


def wgmma_rs(d, a, smem, db):
    """d[64, N] += A B, A = 64 x 16 (registers, given as a matrix), B = 16 x N MN-major (transpose bit set)."""
    N = d.shape[1]
    b = np.array([[read_bf16(smem, hw_addr(db, n, k, "MN")) for n in range(N)] for k in range(16)])
    d += a @ b


def acc_pos(t, i):
    """m64nNk16 f32 accumulator: thread t (0..127) of the warpgroup, register i -> (row, column)."""
    w, lane = divmod(t, 32)
    g, c = divmod(lane, 4)
    return 16 * w + g + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * c + (i % 2)


def a_pos(t, j, half):
    """m64k16 bf16 register A fragment: thread t, 32-bit register j (0..3), half (0 = low) -> (row, column)."""
    w, lane = divmod(t, 32)
    g, c = divmod(lane, 4)
    return 16 * w + g + 8 * (j % 2), 8 * (j // 2) + 2 * c + half


def kernel_pack(kk, j, half):
    """Kernel: pa[kk][j] = pack_bf16(s[nt][e], s[nt][e + 1]) (low half first) -> the (nt, e) of each half."""
    return 2 * kk + j // 2, 2 * (j % 2) + half


# ------------------------------------------------------------------------------------------------ model tests
@pytest.mark.parametrize("D,rows", [(64, 128), (64, 64), (128, 128), (128, 64)])
def test_producer_covers_each_chunk_once_without_bank_conflicts(D, rows):
    seen = {}
    for tid in range(WG):
        for r, c, off in producer_chunks(D, rows, tid):
            assert off == swz(rows, r, c)
            assert (r, c) not in seen
            seen[(r, c)] = off
    assert len(seen) == rows * D // 8
    assert sorted(seen.values()) == list(range(0, rows * D * 2, 16))  # a permutation of the tile's chunks
    # Each pass: 8 consecutive threads (one 128-byte shared wavefront) write 8 distinct 16-byte bank groups.
    for i in range(rows // (WG // (D // 8))):
        for t0 in range(0, WG, 8):
            offs = [producer_chunks(D, rows, t)[i][2] for t in range(t0, t0 + 8)]
            assert len({(o % 128) // 16 for o in offs}) == 8


def test_accumulator_and_a_fragments_are_bijections():
    for N in (64, 128):
        pos = {acc_pos(t, i) for t in range(WG) for i in range(N // 2)}
        assert pos == {(r, c) for r in range(64) for c in range(N)}
    apos = {a_pos(t, j, h) for t in range(WG) for j in range(4) for h in range(2)}
    assert apos == {(r, c) for r in range(64) for c in range(16)}


def test_rows_live_in_one_quad():
    """The online softmax reduces a row over lanes xor 1, 2 (common/mma.cuh): all of a row's accumulator
    elements must sit in the 4 lanes of one quad, two rows (g, g + 8) per thread."""
    owners = {}
    for t in range(WG):
        for i in range(64):
            owners.setdefault(acc_pos(t, i)[0], set()).add(t)
    for r, ts in owners.items():
        assert len(ts) == 4 and len({t // 4 for t in ts}) == 1, r
    for t in range(WG):
        assert {acc_pos(t, i)[0] for i in range(64)} == {acc_pos(t, 0)[0], acc_pos(t, 0)[0] + 8}


@pytest.mark.parametrize("BN", [64, 128])
def test_p_packing_matches_register_a_fragment(BN):
    """pa[kk] built from the S accumulators holds exactly P[:, 16 kk : 16 kk + 16] in the A-fragment order."""
    for t in range(WG):
        for kk in range(BN // 16):
            for j in range(4):
                for h in range(2):
                    nt, e = kernel_pack(kk, j, h)
                    r, c = acc_pos(t, 4 * nt + e)
                    ra, ca = a_pos(t, j, h)
                    assert (r, c) == (ra, 16 * kk + ca)


def _bf16_bits(rng, shape):
    return rng.standard_normal(shape).astype(np.float32).astype(BF16)


# (head_dim, rows of the streamed B tile): the forward's K / V tiles (128 keys), the dq kernel's K / V tiles (64
# keys), the dkdv kernel's Q / dO tiles (64 queries at D = 64, 32 at D = 128).
SS_RS_SHAPES = [(64, 128), (128, 128), (64, 64), (128, 64), (128, 32)]


@pytest.mark.parametrize("D,NB", SS_RS_SHAPES)
def test_simulated_cta_reproduces_the_products(rng, D, NB):
    """A CTA's shared memory (1024-aligned base: the fixed 128-row tile, then a streamed [NB x D] tile in stage 1
    of 2), filled by the producer model; each consumer warpgroup's descriptors (the kernel's issue_s / issue_pv
    formulas) through the hardware's reading must give the products exactly (fp64 sums of bf16 values):
    issue_s: X_wg Y^T (fwd S = Q K^T, dq dP = dO V^T, dkdv S^T = K Q^T ...), X the 128-row tile, Y the NB-row one;
    issue_pv: P Y with P (64 x NB) in the accumulator registers packed as the A fragment, Y read MN-major
    (fwd O += P V, dq dQ += dS K, dkdv dV += P^T dO, dK += dS^T Q)."""
    QB, KV = BM * D * 2, NB * D * 2
    base = 0x400  # a 1024-aligned shared address other than 0
    smem = np.zeros(base + QB + 2 * KV, np.uint8)
    x, y = _bf16_bits(rng, (BM, D)), _bf16_bits(rng, (NB, D))
    place(smem, base, x.view(np.uint16), BM)
    yaddr = base + QB + KV
    place(smem, yaddr, y.view(np.uint16), NB)
    xf, yf = x.astype(np.float64), y.astype(np.float64)
    for cw in range(2):
        xaddr = base + cw * 64 * 128  # this warpgroup's 64 rows in each column block
        s = np.zeros((64, NB))
        for kk in range(D // 16):  # issue_s<D, NB>
            da = make_desc(xaddr + (kk >> 2) * (BM * 128) + (kk & 3) * 32, 16, 1024)
            db = make_desc(yaddr + (kk >> 2) * (NB * 128) + (kk & 3) * 32, 16, 1024)
            wgmma_ss(s, smem, da, db)
        np.testing.assert_allclose(s, xf[64 * cw:64 * cw + 64] @ yf.T, rtol=1e-12, atol=1e-9)
        # P: any bf16 matrix placed in the S registers, packed as the kernel's pack_p packs it.
        p = _bf16_bits(rng, (64, NB)).astype(np.float64)
        regs = {(t, i): p[acc_pos(t, i)] for t in range(WG) for i in range(NB // 2)}
        o = np.zeros((64, D))
        for kk in range(NB // 16):  # issue_pv<D, NB>
            a = np.zeros((64, 16))
            for t in range(WG):
                for j in range(4):
                    for h in range(2):
                        nt, e = kernel_pack(kk, j, h)
                        a[a_pos(t, j, h)] = regs[(t, 4 * nt + e)]
            wgmma_rs(o, a, smem, make_desc(yaddr + kk * 2048, NB * 128, 1024))
        np.testing.assert_allclose(o, p @ yf, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("D,N", [(64, 128), (128, 128), (64, 64), (128, 64), (128, 32)])
def test_descriptor_offsets_add_in_the_address_field(D, N):
    """desc_plus: a k-step's descriptor is the first one plus (byte offset >> 4); for every tile the kernels place
    (any 16-byte aligned base below the 227 KB of shared memory) that equals make_desc of the offset address."""
    src = HOPPER.read_text()
    assert "  return d + (bytes >> 4);\n}" in src
    for base in (0, 1024, 0x20000, 227 * 1024 - 2 * N * D * 2):
        for lbo in (16, N * 128):
            d0 = make_desc(base, lbo, 1024)
            for off in [(kk >> 2) * (BM * 128) + (kk & 3) * 32 for kk in range(D // 16)] + \
                       [(kk >> 2) * (N * 128) + (kk & 3) * 32 for kk in range(D // 16)] + \
                       [kk * 2048 for kk in range(N // 16)]:
                if base + off < 227 * 1024:
                    assert d0 + (off >> 4) == make_desc(base + off, lbo, 1024)


def test_descriptor_fields_fit():
    """Shared addresses (< 228 KB + the 1024 alignment slack) and LBO / SBO fit their 14-bit (>> 4) fields."""
    for D in A90.HEAD_DIMS:
        assert max(A90.bwd_smem_bytes("dq", D), A90.bwd_smem_bytes("dkdv", D)) <= 227 * 1024
        nbytes = A90.smem_bytes(D)
        assert nbytes <= 227 * 1024  # the per-block opt-in limit on sm_90
        assert nbytes + 1024 < (1 << 18)
        BN = A90.CONFIG[D][0]
        assert (BN * 128) >> 4 < (1 << 14)
        d = make_desc(0x3FFF0, BN * 128, 1024)
        assert (d & 0x3FFF) << 4 == 0x3FFF0 and ((d >> 16) & 0x3FFF) << 4 == BN * 128


def test_config_mirrors_the_kernel_instantiations():
    src = CU.read_text()
    inst = {int(d): tuple(int(x) for x in rest) for d, *rest in
            re.findall(r"^CK_ATTN90_FWD\((\d+), (\d+), (\d+), (\d+)\)", src, re.M)}
    assert inst == A90.CONFIG
    bwd = {int(d): tuple(int(x) for x in rest) for d, *rest in
           re.findall(r"^CK_ATTN90_BWD\((\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+)\)", src, re.M)}
    assert bwd == A90.BWD_CONFIG
    assert "FIX = 3 * BM * D * 2;  // Q, dO and O tiles" in src  # SmemDq: bwd_smem_bytes("dq")
    assert "BYTES = QB * FIX + 2 * STAGES * KV + 8 * (2 * QB + 2 * STAGES) + 1024" in src
    assert re.search(r"BYTES =\s+QB \* FIX \+ 2 \* STAGES \* QT \+ DS \+ PB \+ 2 \* STAGES \* VEC \+ "
                     r"8 \* \(2 \* QB \+ 2 \* STAGES\) \+ 1024", src)  # SmemDkdv: bwd_smem_bytes("dkdv"/"dkdvq")
    assert "DS = FQ ? 2 * 64 * BQ * 2 : 0;" in src and "PB = FQ ? 2 * 2 * BQ * D * 4 : 0;" in src
    fq = [tuple(int(x) for x in m) for m in
          re.findall(r"^CK_ATTN90_BWD_FQ_1\((\d+), (\d+), (\d+), (\d+), (?:true|false), \w*\)", src, re.M)]
    assert fq and all(f == (64,) + A90.BWD_CONFIG[64][2:4] + A90.BWD_CONFIG[64][5:] for f in fq)
    assert A90.FUSED_DQ_DIMS == (64,) and A90.BWD_CONFIG[64][2] == A90.FUSED_BQ == 64
    assert A90.bwd_smem_bytes("dkdvq", 64) <= 227 * 1024
    assert "BARS = 8 * (2 * QB + 2 * STAGES);" in src  # Smem (forward): smem_bytes
    assert re.search(r"BYTES = QB \* Q \+ 2 \* STAGES \* KV \+ BARS \+ 1024", src), "update smem_bytes"
    assert re.search(r"constexpr int BM = 128;", src) and A90.BM == 128
    # setmaxnreg.inc waits for the registers .dec released: a split must fit the launch allocation (384 threads x
    # 168; the _wg3 forward 512 x 128), not merely the SM's 65536 (128 x 80 + 256 x 216 hung the fused backward)
    launch = 3 * WG * 168
    regs = dict(re.findall(r"constexpr int (PRODUCER_REGS|CONSUMER_REGS) = (\d+);", src))
    assert WG * int(regs["PRODUCER_REGS"]) + 2 * WG * int(regs["CONSUMER_REGS"]) <= launch
    for D in A90.HEAD_DIMS:  # every kernel fits the 227 KB of shared memory an SM gives one block
        assert max(A90.smem_bytes(D), A90.bwd_smem_bytes("dq", D), A90.bwd_smem_bytes("dkdv", D)) <= 227 * 1024
    wg3 = {int(d): tuple(int(x) for x in rest) for d, *rest in
           re.findall(r"^CK_ATTN90_FWD_WG3\((\d+), (\d+), (\d+), (\d+)\)", src, re.M)}
    assert wg3 == A90.WG3_CONFIG and all(A90.smem_bytes(D, "_wg3") <= 227 * 1024 for D in wg3)
    assert "CK_ATTN90_FWD_1(D, BN, STAGES, QB, 2, 3, _wg3)" in src  # overlap loop, 3 consumers: 192 rows, 512 thr
    assert A90.fwd_shape(64, "_wg3")[3:] == (192, 512) and A90.fwd_variant(128, "_wg3") == ""
    fqr = dict(re.findall(r"constexpr int (PRODUCER_REGS_FQ|CONSUMER_REGS_FQ) = (\d+);", src))
    assert WG * int(fqr["PRODUCER_REGS_FQ"]) + 2 * WG * int(fqr["CONSUMER_REGS_FQ"]) <= launch
    p3 = dict(re.findall(r"constexpr int (PRODUCER_REGS3|CONSUMER_REGS3) = (\d+);", src))
    assert WG * int(p3["PRODUCER_REGS3"]) + 3 * WG * int(p3["CONSUMER_REGS3"]) <= 65536


def dkdv_iters(fused, G, nq, qstart, qend):
    """Kernel: dkdv_iter<FQ> over a work tile's G * nq iterations -> [(query head in the group, query tile)]; qend is
    one past the last query tile (nqb, or QueryTiles::end under a sliding window)."""
    if fused:
        return [(it % G, qend - 1 - it // G) for it in range(G * nq)]
    return [(it // nq, qstart + it % nq) for it in range(G * nq)]


def query_tiles(k0, Tq, Tk, causal, bq, window=None, bm=128):
    """Kernel query_tiles<SW>: (first, n, end) of the query tiles a dkdv work tile of keys from k0 walks."""
    off, nqb = Tk - Tq, -(-Tq // bq)
    first = max(0, int((k0 - off) / bq)) if causal else 0  # C's truncating division
    end = nqb if window is None else min(nqb, (max(-1, min(k0 + bm, Tk) - 1 - off + window - 1) + bq) // bq)
    return first, max(0, end - first), end


def simulate_fused_schedule(Bsz, Tq, Tk, H, Hkv, causal, grid, window=None):
    """Kernel model of attn_sm90_bwd_dkdvq's dQ semaphores: `grid` persistent CTAs walk the snake list of work tiles
    (key tile j, K/V head, batch); every iteration of a work tile adds into dq_acc[b, h, query tile] once sem == jr
    (jr = j, or j minus the first key tile that sees the query tile under a sliding window; jr = 0 without waiting)
    and then publishes sem = jr + 1 (the dQ writer warps: each round every CTA that is not blocked moves one
    iteration; the writers' lag behind their consumers only delays). Returns the adds of each (b, h, query tile) in
    order, and raises on a deadlock (a round where no CTA moved)."""
    BQ, BMK = 64, 128
    off, nkt, nqb, G = Tk - Tq, -(-Tk // BMK), -(-Tq // BQ), H // Hkv
    ntiles = nkt * Hkv * Bsz
    per = Hkv * Bsz
    lists = [[] for _ in range(grid)]
    k = 0
    while k * grid < ntiles:
        for c in range(grid):
            t = k * grid + (grid - 1 - c if k & 1 else c)
            if t < ntiles:
                lists[c].append(t)
        k += 1
    work = []
    for tl in lists:
        its = []
        for t in tl:
            r, rest = divmod(t, per)
            hk, b = rest % Hkv, rest // Hkv
            first, nq, end = query_tiles(r * BMK, Tq, Tk, causal, BQ, window)
            its += [(r, b, hk * G + g, qi) for g, qi in dkdv_iters(True, G, nq, first, end)]
        work.append(its)
    sem, adds = {}, {}
    pos = [0] * grid
    while any(p < len(w) for p, w in zip(pos, work)):
        moved = False
        for c in range(grid):
            if pos[c] == len(work[c]):
                continue
            j, b, h, qi = work[c][pos[c]]
            key = (b, h, qi)
            jr = j if window is None else j - max(0, qi * BQ + off - window + 1) // BMK
            if jr > 0 and sem.get(key, 0) != jr:
                continue
            adds.setdefault(key, []).append(j)
            sem[key] = jr + 1
            pos[c] += 1
            moved = True
        if not moved:
            raise AssertionError(f"deadlock at {pos}")
    return adds


@pytest.mark.parametrize("case", [(1, 1024, 1024, 4, 1, True, 132), (2, 1000, 1000, 8, 2, True, 7),
                                  (2, 1000, 1000, 8, 2, False, 3), (1, 300, 700, 4, 2, True, 5),
                                  (1, 700, 300, 4, 4, True, 2), (3, 257, 257, 2, 1, True, 1),
                                  (8, 1024, 1024, 32, 8, True, 132), (2, 4096, 4096, 32, 8, True, 132)])
def test_fused_dq_semaphores_never_deadlock_and_add_in_key_order(case):
    """Every (b, h, query tile) gets one add from each key tile that sees it, in ascending key-tile order (the
    deterministic sum), on full and capped grids, Tq != Tk included, with no deadlock."""
    Bsz, Tq, Tk, H, Hkv, causal, grid = case
    adds = simulate_fused_schedule(Bsz, Tq, Tk, H, Hkv, causal, grid)
    off, nkt = Tk - Tq, -(-Tk // 128)
    for b in range(Bsz):
        for h in range(H):
            for qi in range(-(-Tq // 64)):
                last_key = min(Tk, qi * 64 + 64 + off) - 1 if causal else Tk - 1
                want = list(range(min(nkt - 1, last_key // 128) + 1)) if last_key >= 0 else []
                assert adds.get((b, h, qi), []) == want, (b, h, qi)


@pytest.mark.parametrize("case", [(1, 1024, 1024, 4, 1, 132, 300), (2, 1000, 1000, 8, 2, 7, 129),
                                  (1, 300, 700, 4, 2, 5, 64), (1, 700, 300, 4, 4, 2, 100), (3, 257, 257, 2, 1, 1, 1),
                                  (2, 4096, 4096, 32, 8, 132, 1024), (1, 2000, 2000, 8, 2, 3, 1999)])
def test_fused_dq_semaphores_under_a_window(case):
    """Under a sliding window the key tiles that see a query tile are a contiguous run from the first one (not key
    tile 0): each (b, h, query tile) gets one add from each key tile that has a visible pair with it (found here by
    brute force over the elements), in ascending order, the first of them a copy (jr = 0), with no deadlock."""
    Bsz, Tq, Tk, H, Hkv, grid, W = case
    adds = simulate_fused_schedule(Bsz, Tq, Tk, H, Hkv, True, grid, window=W)
    off, nkt = Tk - Tq, -(-Tk // 128)
    for qi in range(-(-Tq // 64)):
        i = np.arange(qi * 64, min(qi * 64 + 64, Tq))[:, None]
        want = []
        for j in range(nkt):
            n = np.arange(j * 128, min(j * 128 + 128, Tk))[None, :]
            if ((n <= i + off) & (i + off - n < W)).any():
                want.append(j)
        assert want == list(range(want[0], want[0] + len(want))) if want else True
        for b in range(Bsz):
            for h in range(H):
                assert adds.get((b, h, qi), []) == want, (b, h, qi)


def test_fused_dq_shared_layouts_are_bijective_and_conflict_free():
    """dS^T store: (warp, lane, kk, e) -> 4-byte word of the 64 x 64 bf16 [key][query] tile, the 128-byte swizzle
    (the same placement as the producer's V tiles, which wgmma reads MN-major); the hand-off buffer: float2 slot
    (nt * 4 + lane % 4) ^ (g << 2) of row r, i.e. float4 q of the row at q ^ ((r & 7) << 1), the order dq_acc keeps
    and the convert kernel undoes. Both cover their tile once; one warp instruction touches each bank at most once
    (dS^T) or twice (a float2 warp store: 256 bytes, two wavefronts)."""
    seen = set()
    for warp in range(4):
        for kk in range(4):
            for e in range(4):
                banks = []
                for lane in range(32):
                    g, c2 = lane >> 2, (lane & 3) * 2
                    r, nt = warp * 16 + g + (e & 1) * 8, 2 * kk + (e >> 1)
                    addr = r * 128 + ((nt ^ g) << 4) + c2 * 2
                    assert addr == swz(64, r, nt) + c2 * 2  # element (key r, query nt * 8 + c2) of a V-like tile
                    seen.add(addr)
                    banks.append((addr // 4) % 32)
                assert len(set(banks)) == 32
    assert len(seen) == 64 * 64 * 2 // 4
    slots = set()
    for warp in range(4):
        for nt in range(8):
            for h in range(2):
                words = []
                for lane in range(32):
                    g = lane >> 2
                    r, slot = warp * 16 + g + 8 * h, (nt * 4 + (lane & 3)) ^ (g << 2)
                    col = nt * 8 + (lane & 3) * 2
                    # the float4 the writer bulk-copies and attn_sm90_bwd_dq_convert reads: q ^ ((r & 7) << 1)
                    assert slot >> 1 == (col >> 2) ^ ((r & 7) << 1) and slot & 1 == (col >> 1) & 1
                    slots.add((r, slot))
                    words += [(r * 64 + slot * 2) % 32, (r * 64 + slot * 2 + 1) % 32]
                assert max(words.count(w) for w in set(words)) == 2
    assert len(slots) == 64 * 32


def _vis(i, n, Tq, Tk, W):
    off = Tk - Tq
    return (i < Tq) & (n < Tk) & (n <= i + off) & (i + off - n < W)


def _check_rows_kernel(Tq, Tk, W, rows, BN, skip):
    """attn_sm90_fwd (rows 128 or 192, BN 128) / attn_sm90_bwd_dq (rows 128, BN 64) with SW: key tiles [jb0, nkb) of a
    work tile; a consumer warpgroup (64 rows) skips a tile (skip: the serial forward and dq) when it sees none of it,
    a warp (16 rows) masks a tile unless every pair of its real rows is visible."""
    off = Tk - Tq
    for q0 in range(0, Tq, rows):
        kend = min(Tk, q0 + rows + off)
        nkb = -(-kend // BN) if kend > 0 else 0
        jb0 = min(nkb, max(0, q0 + off - W + 1) // BN)
        for cw in range(rows // 64):
            rbase = q0 + 64 * cw
            done = set()
            for jb in range(jb0, nkb):
                n0 = jb * BN
                if skip and (n0 > rbase + 63 + off or rbase + off - (n0 + BN - 1) >= W):
                    continue
                done.update(range(n0, n0 + BN))
                for w in range(4):
                    r0 = rbase + 16 * w
                    masked = n0 + BN > Tk or n0 + BN - 1 > r0 + off or r0 + 15 + off - n0 >= W
                    i = np.arange(r0, min(r0 + 16, Tq))[:, None]
                    if not masked and i.size:
                        assert _vis(i, np.arange(n0, n0 + BN)[None, :], Tq, Tk, W).all(), (Tq, Tk, W, r0, n0)
            for i in range(rbase, min(rbase + 64, Tq)):  # every visible key of every row was computed
                n = np.arange(Tk)[_vis(i, np.arange(Tk), Tq, Tk, W)]
                assert set(n.tolist()) <= done, (Tq, Tk, W, rows, BN, i)


def _check_dkdv_kernel(Tq, Tk, W, BQ):
    """attn_sm90_bwd_dkdv(q) with SW: work tiles of 128 keys (consumer warpgroups of 64, warps of 16), query tiles of
    BQ from query_tiles; a warpgroup skips a query tile it has no visible pair with, a warp masks unless all pairs of
    the tile (real queries and keys included) are visible."""
    off = Tk - Tq
    for k0 in range(0, Tk, 128):
        first, nq, end = query_tiles(k0, Tq, Tk, True, BQ, W)
        for cw in range(2):
            kbase = k0 + 64 * cw
            done = set()
            for qi in range(first, first + nq):
                qb0 = qi * BQ
                if qb0 + BQ - 1 + off < kbase or qb0 + off - (kbase + 63) >= W:
                    continue
                done.update(range(qb0, qb0 + BQ))
                for w in range(4):
                    r0 = kbase + 16 * w
                    masked = qb0 + BQ > Tq or r0 + 15 >= Tk or r0 + 15 > qb0 + off or qb0 + BQ - 1 + off - r0 >= W
                    if not masked:
                        assert _vis(np.arange(qb0, qb0 + BQ)[None, :], np.arange(r0, r0 + 16)[:, None], Tq, Tk,
                                    W).all(), (Tq, Tk, W, r0, qb0)
            for n in range(kbase, min(kbase + 64, Tk)):
                i = np.arange(Tq)[_vis(np.arange(Tq), n, Tq, Tk, W)]
                assert set(i.tolist()) <= done, (Tq, Tk, W, BQ, n)


@pytest.mark.parametrize("Tq,Tk", [(130, 130), (300, 300), (200, 450), (450, 200), (1000, 1000)])
def test_window_tile_ranges_cover_every_visible_pair(Tq, Tk):
    """The sliding window's loops in attention_sm90.cu, modelled: fwd (128- and 192-row work tiles; the serial
    loop's per-warpgroup skips and the pipelined loops without them), dq, dkdv / dkdvq (64- and 32-query tiles):
    every visible pair is computed and a tile left unmasked holds visible pairs only."""
    src = CU.read_text()
    assert src.count("const int jb0 = SW ? min(nkb, window_first(q0, off, W) / BN) : 0;") == 4  # fwd, dq x 2 each
    assert src.count("(SW && window_cuts(row0 + 15, n0, off, W))") == 2  # serial fwd, dq
    assert "(SW && window_cuts(rbase, n0 + BN - 1, off, W))" in src
    assert "(SW && window_cuts(qb0, kbase + 63, off, W))" in src
    assert "(SW && window_cuts(qb0 + BQ - 1, row0, off, W))" in src
    assert "const int end = SW ? min(nqb, (window_last_query(k1, off, W) + bq) / bq) : nqb;" in src
    for W in sorted({1, 37, 64, 100, 128, 129, 300, Tk - 1}):
        for rows, BN, skip in ((128, 128, True), (128, 128, False), (192, 128, False), (128, 64, True)):
            _check_rows_kernel(Tq, Tk, W, rows, BN, skip)
        for BQ in (64, 32):
            _check_dkdv_kernel(Tq, Tk, W, BQ)


def turn_events(cw, nblocks):
    """Kernel: the named-barrier operations of consumer warpgroup cw over nblocks tensor-core blocks, in program
    order: ('s', id) = bar.sync, ('a', id) = bar.arrive; mine = 1 + cw, other = 2 - cw. The forward's ping-pong
    (nblocks = nkb + 1: S of tile 0, then S(j + 1) + P V(j) ..., P V of the last tile) and Turns<true> of the
    backward kernels (nblocks = 2 per tile: S, dP then the dS / P products; skipped tiles keep their turns):
    warpgroup 1 opens with an arrive and leaves out its last one."""
    if nblocks == 0:
        return []
    mine, other = 1 + cw, 2 - cw
    ev = [("a", other)] if cw == 1 else []
    for i in range(nblocks):
        ev.append(("s", mine))
        if cw == 0 or i + 1 < nblocks:
            ev.append(("a", other))
    return ev


@pytest.mark.parametrize("nblocks", [0, 1, 2, 3, 4, 7, 12])
def test_pingpong_barriers_alternate_and_balance(nblocks):
    """Simulate bar.sync / bar.arrive (256 threads = both warpgroups) over the two consumers' event lists: no
    deadlock, the blocks strictly alternate (warpgroup 0 first), and no barrier is left with arrivals."""
    ev = [turn_events(0, nblocks), turn_events(1, nblocks)]
    pos, waiting, pending, order = [0, 0], [None, None], {1: 0, 2: 0}, []
    while pos[0] < len(ev[0]) or pos[1] < len(ev[1]) or any(w is not None for w in waiting):
        progressed = False
        for w in (0, 1):
            if waiting[w] is not None:
                continue
            if pos[w] < len(ev[w]):
                kind, bid = ev[w][pos[w]]
                pos[w] += 1
                progressed = True
                if kind == "a":
                    pending[bid] += 1
                else:
                    waiting[w] = bid
        for w in (0, 1):  # a sync completes when the other warpgroup's arrival is there (128 + 128 threads)
            bid = waiting[w]
            if bid is not None and pending[bid] > 0:
                pending[bid] -= 1
                waiting[w] = None
                order.append(w)
                progressed = True
        assert progressed, f"deadlock at {pos}, waiting {waiting}"
    assert pending == {1: 0, 2: 0}
    assert order == [0, 1] * nblocks


def test_kernel_turn_structure_matches_the_model():
    """The kernel source has the structure turn_events models: Turns opens / begins / ends as described, and the
    forward's ping-pong opens with warpgroup 1's arrive and skips its last one."""
    src = CU.read_text()
    assert "if (PP && cw == 1 && any) named_arrive(other);" in src
    assert "if (PP) named_sync(mine);" in src
    assert "if (PP && (cw == 0 || !last)) named_arrive(other);" in src
    assert "const int mine = 1 + cw, other = 2 - cw;" in src and "if (PP && cw == 1) named_arrive(other);" in src
    assert "if (PP && cw == 0) named_arrive(other);" in src  # the forward's last block
    # every begin() / named_sync in the loops is followed by exactly one end() / arrive in the same block
    assert src.count("turns.begin();") == src.count("turns.end(")


# ------------------------------------------------------------------------------------------------ reference / API
def qkv(rng, Bsz, Tq, Tk, H, Hkv, D, scale=1.0):
    f = lambda *s: (rng.standard_normal(s) * scale).astype(np.float32).astype(BF16)  # noqa: E731
    return f(Bsz, Tq, H, D), f(Bsz, Tk, Hkv, D), f(Bsz, Tk, Hkv, D)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_is_flash_attentions(rng, causal):
    q, k, v = qkv(rng, 2, 9, 13, 4, 2, 64)
    o, lse = ck.flash_attention(q, k, v, causal=causal, return_lse=True)
    o2, lse2 = A90.flash_attention_sm90(q, k, v, causal=causal, return_lse=True)
    np.testing.assert_array_equal(o.view(np.uint16), o2.view(np.uint16))
    np.testing.assert_array_equal(lse, lse2)


def test_validation():
    q, k, v = qkv(np.random.default_rng(0), 1, 4, 4, 2, 1, 32)
    with pytest.raises(ValueError, match="q: head_dim must be one of \\(64, 128\\)"):
        A90.flash_attention_sm90(q, k, v)
    q, k, v = qkv(np.random.default_rng(0), 1, 4, 4, 2, 1, 64)
    with pytest.raises(TypeError, match="q"):
        A90.flash_attention_sm90(q.astype(np.float32), k, v)
    with pytest.raises(ValueError, match="kv_heads"):
        A90.flash_attention_sm90(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
    with pytest.raises(TypeError, match="causal"):
        A90.flash_attention_sm90(q, k, v, causal=1)
    with pytest.raises(ValueError, match="scale"):
        A90.flash_attention_sm90(q, k, v, scale=-1.0)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_backward_is_flash_attention_backwards(rng, causal):
    q, k, v = qkv(rng, 2, 9, 13, 4, 2, 128)
    w = qkv(rng, 2, 9, 13, 4, 2, 128)[0]
    o, lse = ck.flash_attention(q, k, v, causal=causal, return_lse=True)
    a = A90.flash_attention_backward_sm90(w, q, k, v, o, lse, causal=causal)
    b = ck.flash_attention_backward(w, q, k, v, o, lse, causal=causal)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.view(np.uint16), y.view(np.uint16))


def test_backward_validation():
    q, k, v = qkv(np.random.default_rng(0), 1, 4, 4, 2, 1, 32)
    o, lse = ck.flash_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="q: head_dim must be one of \\(64, 128\\)"):
        A90.flash_attention_backward_sm90(o, q, k, v, o, lse)
    q, k, v = qkv(np.random.default_rng(0), 1, 4, 4, 2, 1, 64)
    o, lse = ck.flash_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse: expected shape"):
        A90.flash_attention_backward_sm90(o, q, k, v, o, lse[:, :1])
    with pytest.raises(ValueError, match="dout"):
        A90.flash_attention_backward_sm90(o[:, :2], q, k, v, o, lse)


@pytest.mark.parametrize("W", [1, 5, 12, 13, 100])
def test_reference_window_is_flash_attentions(rng, W):
    q, k, v = qkv(rng, 2, 9, 13, 4, 2, 64)
    w = qkv(rng, 2, 9, 13, 4, 2, 64)[0]
    o, lse = ck.flash_attention(q, k, v, window=W, return_lse=True)
    o2, lse2 = A90.flash_attention_sm90(q, k, v, window=W, return_lse=True)
    np.testing.assert_array_equal(o.view(np.uint16), o2.view(np.uint16))
    np.testing.assert_array_equal(lse, lse2)
    for x, y in zip(A90.flash_attention_backward_sm90(w, q, k, v, o, lse, window=W),
                    ck.flash_attention_backward(w, q, k, v, o, lse, window=W)):
        np.testing.assert_array_equal(x.view(np.uint16), y.view(np.uint16))


def test_window_validation():
    q, k, v = qkv(np.random.default_rng(0), 1, 4, 4, 2, 1, 64)
    o, lse = ck.flash_attention(q, k, v, return_lse=True)
    for call in (lambda **kw: A90.flash_attention_sm90(q, k, v, **kw),
                 lambda **kw: A90.flash_attention_backward_sm90(o, q, k, v, o, lse, **kw)):
        with pytest.raises(ValueError, match="^window: a sliding window .* needs causal=True"):
            call(causal=False, window=2)
        with pytest.raises(TypeError, match="^window: expected an integer >= 1"):
            call(window=2.5)
        with pytest.raises(ValueError, match="^window: expected an integer >= 1"):
            call(window=0)


# ------------------------------------------------------------------------------------------------ GPU (sm_90)
def _sm90():
    return ck.gpu_available() and A90.supported()


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (H100 / H200)")


@pytest.fixture(params=A90.VARIANTS, ids=lambda v: v.strip("_") or "pingpong")
def variant(request, monkeypatch):
    """The GPU tests run every forward variant (ping-pong, serial, overlap without turns) and every backward one
    (ping-pong, serial; the overlap case runs the default backward)."""
    monkeypatch.setattr(ck.settings, "attention_sm90_variant", request.param)
    monkeypatch.setattr(ck.settings, "attention_sm90_bwd_variant",
                        request.param if request.param in A90.BWD_VARIANTS else "")
    return request.param


def close(got, ref, tol, what):
    got, ref = to_host(got).astype(np.float64), np.asarray(to_host(ref), dtype=np.float64)
    assert got.shape == ref.shape, what
    assert np.isfinite(got).all(), f"{what}: non-finite output (unwritten?)"
    err = np.abs(got - ref).max() if got.size else 0.0
    lim = tol * max(1.0, np.abs(ref).max() if ref.size else 0.0)
    assert err <= lim, f"{what}: max error {err:.4g} > {lim:.4g}"


def lse_equal(got, ref, what="lse"):
    g, r = to_host(got), to_host(ref)
    np.testing.assert_array_equal(np.isinf(g), np.isinf(r), err_msg=what)
    fin = np.isfinite(r)
    np.testing.assert_allclose(g[fin], r[fin], rtol=1e-4, atol=1e-4, err_msg=what)


GPU_GRID = [(Bsz, T, H, Hkv, D, causal) for Bsz in (1, 2) for T in (1, 17, 128, 1000, 1024)
            for H, Hkv in ((4, 4), (32, 8)) for D in (64, 128) for causal in (True, False)]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", GPU_GRID, ids=lambda c: "B%dT%dH%d/%dD%d%s" % (*c[:5], "c" if c[5] else "f"))
def test_gpu_matches_reference_and_mma_sync(rng, variant, case):
    Bsz, T, H, Hkv, D, causal = case
    q, k, v = qkv(rng, Bsz, T, T, H, Hkv, D)
    Q, K, V = cp().asarray(q), cp().asarray(k), cp().asarray(v)
    out = cp().full(q.shape, np.nan, dtype=BF16)  # poisoned: every element must be written
    o, lse = A90.flash_attention_sm90(Q, K, V, causal=causal, out=out, return_lse=True)
    assert o is out
    # The mma.sync kernels: same bf16 P rounding, fp32 accumulation in another order (a few bf16 ulps).
    mo, ml = ck.flash_attention(Q, K, V, causal=causal, return_lse=True)
    close(o, mo, 1.6e-2, "o vs flash_attention")
    lse_equal(lse, ml, "lse vs flash_attention")
    # The NumPy reference (seconds per call on the host) on the smaller shapes, once per case (the ping-pong
    # variant); the larger ones and the serial variant are held to the mma.sync kernels, which test_attention.py
    # holds to the same reference.
    if variant == "" and Bsz * H * T * T <= 4_200_000:
        ro, rl = ck.flash_attention(q, k, v, causal=causal, return_lse=True)
        close(o, ro, 2e-2, "o vs reference")
        lse_equal(lse, rl, "lse vs reference")


CROSS = [(1, 7, 12, 2, 2, 64, True), (1, 12, 5, 2, 1, 64, True), (1, 300, 130, 4, 2, 128, True),
         (2, 130, 700, 8, 2, 64, True), (1, 257, 1000, 4, 1, 128, False), (2, 1, 513, 4, 4, 64, True)]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", CROSS)
def test_gpu_seq_q_differs_from_seq_k(rng, variant, case):
    """Causal alignment at the end (Tq < Tk), rows that see no key (Tq > Tk: o = 0, lse = -inf)."""
    Bsz, Tq, Tk, H, Hkv, D, causal = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)
    ro, rl = ck.flash_attention(q, k, v, causal=causal, return_lse=True)
    o, lse = A90.flash_attention_sm90(*(cp().asarray(x) for x in (q, k, v)), causal=causal, return_lse=True)
    close(o, ro, 2e-2, "o")
    lse_equal(lse, rl)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_strided_views_and_backward_consumes_lse(rng, variant, D):
    """q, k, v as slices of one fused [B, T, H + 2 Hkv, D] projection; the existing backward run from this
    forward's o / lse equals the one run from flash_attention's."""
    Bsz, T, H, Hkv = 2, 333, 8, 2
    qkv_ = rng.standard_normal((Bsz, T, H + 2 * Hkv, D)).astype(np.float32).astype(BF16)
    G = cp().asarray(qkv_)
    q, k, v = G[:, :, :H], G[:, :, H:H + Hkv], G[:, :, H + Hkv:]
    ro, rl = ck.flash_attention(qkv_[:, :, :H], qkv_[:, :, H:H + Hkv], qkv_[:, :, H + Hkv:], return_lse=True)
    o, lse = A90.flash_attention_sm90(q, k, v, return_lse=True)
    close(o, ro, 2e-2, "o")
    lse_equal(lse, rl)
    do = cp().asarray(qkv(rng, Bsz, T, T, H, Hkv, D)[0])
    mo, ml = ck.flash_attention(q, k, v, return_lse=True)
    a = ck.flash_attention_backward(do, q, k, v, o, lse)
    b = ck.flash_attention_backward(do, q, k, v, mo, ml)
    for x, y, n in zip(a, b, ("dq", "dk", "dv")):
        close(x, y, 3e-2, n)


@pytest.mark.gpu
@needs_sm90
def test_gpu_large_scores_and_determinism(rng, variant):
    """Scores of +-1e3 (q, k scaled by 40): no overflow in the online softmax; reruns bit-identical."""
    Bsz, T, H, Hkv, D = 2, 1000, 4, 2, 64
    q, k, v = qkv(rng, Bsz, T, T, H, Hkv, D)
    q, k = (q.astype(np.float32) * 40).astype(BF16), (k.astype(np.float32) * 40).astype(BF16)
    ro, rl = ck.flash_attention(q, k, v, return_lse=True)
    Q, K, V = (cp().asarray(x) for x in (q, k, v))
    o1, l1 = A90.flash_attention_sm90(Q, K, V, return_lse=True)
    o2, l2 = A90.flash_attention_sm90(Q, K, V, return_lse=True)
    close(o1, ro, 2e-2, "o")
    lse_equal(l1, rl)
    np.testing.assert_array_equal(to_host(o1).view(np.uint16), to_host(o2).view(np.uint16))
    np.testing.assert_array_equal(to_host(l1), to_host(l2))


@pytest.mark.gpu
@needs_sm90
def test_gpu_scale_and_empty_shapes(rng, variant):
    q, k, v = qkv(rng, 1, 200, 200, 4, 2, 128)
    ro = ck.flash_attention(q, k, v, scale=0.3)
    o = A90.flash_attention_sm90(*(cp().asarray(x) for x in (q, k, v)), scale=0.3)
    close(o, ro, 2e-2, "o scale=0.3")
    z = cp().zeros((2, 0, 4, 64), dtype=BF16)
    kz = cp().zeros((2, 5, 2, 64), dtype=BF16)
    o, lse = A90.flash_attention_sm90(z, kz, kz, return_lse=True)
    assert o.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0)
    # seq_k = 0: every row sees no key.
    qz = cp().asarray(qkv(rng, 1, 3, 3, 2, 1, 64)[0])
    o, lse = A90.flash_attention_sm90(qz, cp().zeros((1, 0, 1, 64), dtype=BF16), cp().zeros((1, 0, 1, 64), dtype=BF16),
                                      causal=False, return_lse=True)
    assert (to_host(o).astype(np.float32) == 0).all() and np.isneginf(to_host(lse)).all()


@pytest.mark.gpu
@needs_sm90
def test_gpu_misaligned_view_is_refused(rng):
    q, k, v = (cp().asarray(x) for x in qkv(rng, 1, 8, 8, 2, 1, 64))
    buf = cp().zeros(q.size + 1, dtype=BF16)
    with pytest.raises(ValueError, match="q: the kernels read 16-byte chunks"):
        A90.flash_attention_sm90(buf[1:].reshape(q.shape), k, v)
    with pytest.raises(ValueError, match="out: the data pointer must be 4-byte aligned"):
        A90.flash_attention_sm90(q, k, v, out=buf[1:].reshape(q.shape))
    o, lse = A90.flash_attention_sm90(q, k, v, return_lse=True)
    ob = cp().zeros(q.size + 8, dtype=BF16)
    ob[1:1 + q.size] = o.ravel()
    with pytest.raises(ValueError, match="out: the data pointer must be 16-byte aligned"):
        A90.flash_attention_backward_sm90(o, q, k, v, ob[1:1 + q.size].reshape(q.shape), lse)
    with pytest.raises(ValueError, match="dout: the kernels read 16-byte chunks"):
        A90.flash_attention_backward_sm90(buf[1:].reshape(q.shape), q, k, v, o, lse)


@pytest.mark.gpu
def test_gpu_other_architectures_are_refused(rng):
    if A90.supported():
        pytest.skip("this device is sm_90")
    q, k, v = (cp().asarray(x) for x in qkv(rng, 1, 8, 8, 2, 1, 64))
    with pytest.raises(ValueError, match="compute capability 9.0"):
        A90.flash_attention_sm90(q, k, v)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", GPU_GRID, ids=lambda c: "B%dT%dH%d/%dD%d%s" % (*c[:5], "c" if c[5] else "f"))
def test_gpu_backward_matches_reference_and_mma_sync(rng, variant, case):
    """Both backwards from the same o / lse (the mma.sync forward's); the wgmma one is also rerun: bit-identical."""
    Bsz, T, H, Hkv, D, causal = case
    q, k, v = qkv(rng, Bsz, T, T, H, Hkv, D)
    w = qkv(rng, Bsz, T, T, H, Hkv, D)[0]
    Q, K, V, W = (cp().asarray(x) for x in (q, k, v, w))
    o, lse = ck.flash_attention(Q, K, V, causal=causal, return_lse=True)
    a = A90.flash_attention_backward_sm90(W, Q, K, V, o, lse, causal=causal)
    b = ck.flash_attention_backward(W, Q, K, V, o, lse, causal=causal)
    for x, y, n in zip(a, b, ("dq", "dk", "dv")):
        close(x, y, 3e-2, n + " vs flash_attention_backward")
    if variant == "" and Bsz * H * T * T <= 4_200_000:  # as in the forward grid test
        ref = ck.flash_attention_backward(w, q, k, v, to_host(o), to_host(lse), causal=causal)
        for x, y, n in zip(a, ref, ("dq", "dk", "dv")):
            close(x, y, 3e-2, n + " vs reference")
    a2 = A90.flash_attention_backward_sm90(W, Q, K, V, o, lse, causal=causal)
    for x, y in zip(a, a2):
        np.testing.assert_array_equal(to_host(x).view(np.uint16), to_host(y).view(np.uint16))


FUSED = [(1, 1024, 1024, 32, 8, True), (2, 1000, 1000, 4, 4, False), (1, 300, 700, 4, 2, True),
         (1, 700, 300, 4, 1, True), (2, 65, 65, 8, 2, True), (1, 1, 1, 2, 1, False)]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", FUSED, ids=lambda c: "B%dTq%dTk%dH%d/%d%s" % (*c[:5], "c" if c[5] else "f"))
def test_gpu_fused_dq_matches_the_two_kernel_backward(rng, variant, monkeypatch, case):
    """Head_dim 64: the five-product backward (attention_sm90_bwd_dq "fused", the default) against the two-kernel one
    ("kernel", kept as the A/B reference) and the mma.sync backward, into NaN-poisoned buffers (every dq row written:
    rows that see no key get 0); bit-identical when rerun and on grids capped to 1 and 5 CTAs."""
    Bsz, Tq, Tk, H, Hkv, causal = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, 64)
    w = qkv(rng, Bsz, Tq, Tk, H, Hkv, 64)[0]
    Q, K, V, W = (cp().asarray(x) for x in (q, k, v, w))
    o, lse = A90.flash_attention_sm90(Q, K, V, causal=causal, return_lse=True)

    def run(mode):
        monkeypatch.setattr(ck.settings, "attention_sm90_bwd_dq", mode)
        outs = tuple(cp().full(x.shape, np.nan, dtype=BF16) for x in (Q, K, K))
        got = A90.flash_attention_backward_sm90(W, Q, K, V, o, lse, causal=causal, grads_out=outs)
        return [to_host(x) for x in got]

    fused, two = run("fused"), run("kernel")
    ref = ck.flash_attention_backward(W, Q, K, V, o, lse, causal=causal)
    for x, y, z, n in zip(fused, two, ref, ("dq", "dk", "dv")):
        close(x, y, 2e-2, n + " fused vs two kernels")
        close(x, z, 3e-2, n + " fused vs flash_attention_backward")
    for cap in (1, 5):
        monkeypatch.setattr(ck.settings, "attention_sm90_grid_cap", cap)
        for x, y, n in zip(run("fused"), fused, ("dq", "dk", "dv")):
            np.testing.assert_array_equal(x.view(np.uint16), y.view(np.uint16), err_msg=f"{n}, grid cap {cap}")
    with pytest.raises(ValueError, match="attention_sm90_bwd_dq"):
        ck.settings.attention_sm90_bwd_dq = "bogus"


WINDOWS = [  # (B, Tq, Tk, H, Hkv, D, window)
    (1, 1000, 1000, 4, 2, 64, 1), (2, 1024, 1024, 32, 8, 64, 256), (1, 1000, 1000, 4, 4, 128, 129),
    (2, 777, 777, 8, 2, 64, 100), (1, 300, 700, 4, 2, 128, 300), (1, 700, 300, 4, 1, 64, 64),
    (2, 200, 200, 4, 2, 64, 5), (1, 4097, 4097, 4, 2, 64, 1000), (1, 2100, 2100, 4, 2, 128, 2048),
    (1, 2500, 2500, 4, 1, 64, 2049)]


def _mma_sync(fn, *a, **kw):
    """fn through ck.flash_attention's mma.sync kernels (attention_wgmma off)."""
    with ck.settings(attention_wgmma=False):
        return fn(*a, **kw)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", WINDOWS, ids=lambda c: "B%dTq%dTk%dH%d/%dD%dW%d" % c)
def test_gpu_window_matches_reference_and_mma_sync(rng, variant, case):
    """Sliding windows (W = 1, below, across and above the 64 / 128 / 192-row tiles, Tq != Tk) through every forward
    and backward variant: o (poisoned out=), lse, dq, dk, dv against the mma.sync *_sw kernels (and the reference on
    the smaller shapes); the backward rerun bit-identical."""
    Bsz, Tq, Tk, H, Hkv, D, W = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)
    w = qkv(rng, Bsz, Tq, Tq, H, Hkv, D)[0]
    Q, K, V, Wd = (cp().asarray(x) for x in (q, k, v, w))
    out = cp().full(q.shape, np.nan, dtype=BF16)
    o, lse = A90.flash_attention_sm90(Q, K, V, window=W, out=out, return_lse=True)
    assert o is out
    mo, ml = _mma_sync(ck.flash_attention, Q, K, V, window=W, return_lse=True)
    close(o, mo, 1.6e-2, "o vs mma.sync")
    lse_equal(lse, ml, "lse vs mma.sync")
    outs = tuple(cp().full(x.shape, np.nan, dtype=BF16) for x in (Q, K, K))
    a = A90.flash_attention_backward_sm90(Wd, Q, K, V, mo, ml, window=W, grads_out=outs)
    b = _mma_sync(ck.flash_attention_backward, Wd, Q, K, V, mo, ml, window=W)
    for x, y, n in zip(a, b, ("dq", "dk", "dv")):
        close(x, y, 3e-2, n + " vs mma.sync")
    if variant == "" and Bsz * H * Tq * Tk <= 4_200_000:
        ro, rl = ck.flash_attention(q, k, v, window=W, return_lse=True)
        close(o, ro, 2e-2, "o vs reference")
        lse_equal(lse, rl, "lse vs reference")
        for x, y, n in zip(a, ck.flash_attention_backward(w, q, k, v, to_host(mo), to_host(ml), window=W),
                           ("dq", "dk", "dv")):
            close(x, y, 3e-2, n + " vs reference")
    a2 = A90.flash_attention_backward_sm90(Wd, Q, K, V, mo, ml, window=W)
    for x, y in zip(a, a2):
        np.testing.assert_array_equal(to_host(x).view(np.uint16), to_host(y).view(np.uint16))


WINDOW_GRIDS = [(2, 1000, 1000, 8, 2, 64, 300), (1, 300, 700, 4, 2, 64, 129), (1, 700, 300, 4, 1, 64, 64),
                (2, 500, 500, 4, 4, 128, 100), (3, 130, 130, 2, 1, 64, 1)]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", WINDOW_GRIDS, ids=lambda c: "B%dTq%dTk%dH%d/%dD%dW%d" % c)
def test_gpu_window_fused_dq_and_persistent_grids_are_bit_identical(rng, variant, monkeypatch, case):
    """Under a window: the fused (five-product) backward's semaphores, which count from each query tile's first
    seeing key tile, against the two-kernel backward; fwd and bwd bit-identical on grids capped to 1 and 3 CTAs and
    with one CTA per tile (fused dq: 1 and 5 CTAs; it needs all CTAs resident)."""
    Bsz, Tq, Tk, H, Hkv, D, W = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)
    w = qkv(rng, Bsz, Tq, Tq, H, Hkv, D)[0]
    Q, K, V, Wd = (cp().asarray(x) for x in (q, k, v, w))

    def run():
        o, lse = A90.flash_attention_sm90(Q, K, V, window=W, return_lse=True)
        outs = tuple(cp().full(x.shape, np.nan, dtype=BF16) for x in (Q, K, K))
        g = A90.flash_attention_backward_sm90(Wd, Q, K, V, o, lse, window=W, grads_out=outs)
        return [to_host(x) for x in (o, lse, *g)]

    ref = run()
    if D in A90.FUSED_DQ_DIMS:
        monkeypatch.setattr(ck.settings, "attention_sm90_bwd_dq", "kernel")
        for x, y, n in zip(run()[2:], ref[2:], ("dq", "dk", "dv")):
            close(x, y, 2e-2, n + " fused vs two kernels")
        monkeypatch.setattr(ck.settings, "attention_sm90_bwd_dq", "fused")
    for cap, persistent in ((1, True), (3, True), (5, True), (None, False)):
        monkeypatch.setattr(ck.settings, "attention_sm90_grid_cap", cap)
        monkeypatch.setattr(ck.settings, "attention_sm90_persistent", persistent)
        for x, y, n in zip(run(), ref, ("o", "lse", "dq", "dk", "dv")):
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=f"{n}, grid cap {cap}")
    mo, ml = _mma_sync(ck.flash_attention, Q, K, V, window=W, return_lse=True)
    close(ref[0], mo, 1.6e-2, "o vs mma.sync")
    for x, y, n in zip(ref[2:], _mma_sync(ck.flash_attention_backward, Wd, Q, K, V, mo, ml, window=W),
                       ("dq", "dk", "dv")):
        close(x, y, 3e-2, n + " vs mma.sync")


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", CROSS)
def test_gpu_backward_seq_q_differs_from_seq_k(rng, variant, case):
    """Tq != Tk under the causal alignment: rows that see no key (dq = 0), keys no query sees (dk = dv = 0)."""
    Bsz, Tq, Tk, H, Hkv, D, causal = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)
    w = qkv(rng, Bsz, Tq, Tq, H, Hkv, D)[0]
    o, lse = ck.flash_attention(q, k, v, causal=causal, return_lse=True)
    ref = ck.flash_attention_backward(w, q, k, v, o, lse, causal=causal)
    got = A90.flash_attention_backward_sm90(*(cp().asarray(x) for x in (w, q, k, v, o, lse)), causal=causal)
    for x, y, n in zip(got, ref, ("dq", "dk", "dv")):
        close(x, y, 3e-2, n)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_backward_strided_views_and_wgmma_forward(rng, variant, D):
    """Fused-QKV slices for q, k, v, dO as a transposed [B, H, T, D] buffer; the wgmma backward fed the wgmma
    forward's o / lse against the reference."""
    Bsz, T, H, Hkv = 2, 300, 8, 2
    qkv_ = rng.standard_normal((Bsz, T, H + 2 * Hkv, D)).astype(np.float32).astype(BF16)
    do = np.ascontiguousarray(rng.standard_normal((Bsz, H, T, D)).astype(np.float32).astype(BF16))
    hq, hk, hv = qkv_[:, :, :H], qkv_[:, :, H:H + Hkv], qkv_[:, :, H + Hkv:]
    ro, rl = ck.flash_attention(hq, hk, hv, return_lse=True)
    ref = ck.flash_attention_backward(do.transpose(0, 2, 1, 3), hq, hk, hv, ro, rl)
    G = cp().asarray(qkv_)
    q, k, v = G[:, :, :H], G[:, :, H:H + Hkv], G[:, :, H + Hkv:]
    o, lse = A90.flash_attention_sm90(q, k, v, return_lse=True)
    got = A90.flash_attention_backward_sm90(cp().asarray(do).transpose(0, 2, 1, 3), q, k, v, o, lse)
    for x, y, n in zip(got, ref, ("dq", "dk", "dv")):
        close(x, y, 3e-2, n)


@pytest.mark.gpu
@needs_sm90
def test_gpu_backward_large_scores(rng, variant):
    """Scores of +-1e3: P is 0 / 1 almost everywhere, dS must stay finite."""
    Bsz, T, H, Hkv, D = 1, 700, 4, 2, 64
    q, k, v = qkv(rng, Bsz, T, T, H, Hkv, D)
    q, k = (q.astype(np.float32) * 40).astype(BF16), (k.astype(np.float32) * 40).astype(BF16)
    w = qkv(rng, Bsz, T, T, H, Hkv, D)[0]
    o, lse = ck.flash_attention(q, k, v, return_lse=True)
    ref = ck.flash_attention_backward(w, q, k, v, o, lse)
    got = A90.flash_attention_backward_sm90(*(cp().asarray(x) for x in (w, q, k, v, o, lse)))
    for x, y, n in zip(got, ref, ("dq", "dk", "dv")):
        close(x, y, 3e-2, n)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_smoke(rng, variant, D):
    """One small call of each kernel (fwd, dq, dkdv) against the reference: run first with -k smoke, under a short
    timeout, so that a hang (a barrier protocol error) or a descriptor misread shows which kernel and variant."""
    q, k, v = qkv(rng, 1, 200, 200, 4, 2, D)
    w = qkv(rng, 1, 200, 200, 4, 2, D)[0]
    ro, rl = ck.flash_attention(q, k, v, return_lse=True)
    o, lse = A90.flash_attention_sm90(*(cp().asarray(x) for x in (q, k, v)), return_lse=True)
    close(o, ro, 2e-2, "o")
    lse_equal(lse, rl)
    ref = ck.flash_attention_backward(w, q, k, v, ro, rl)
    got = A90.flash_attention_backward_sm90(*(cp().asarray(x) for x in (w, q, k, v, ro, rl)))
    for x, y, n in zip(got, ref, ("dq", "dk", "dv")):
        close(x, y, 3e-2, n)


PERSIST = [(2, 300, 300, 4, 2, 64, True), (3, 130, 700, 8, 2, 64, True), (2, 300, 130, 4, 2, 128, True),
           (1, 257, 1000, 4, 1, 128, False), (2, 1000, 1000, 8, 8, 64, True)]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", PERSIST, ids=lambda c: "B%dTq%dTk%dH%d/%dD%d%s" % (*c[:6], "c" if c[6] else "f"))
def test_gpu_persistent_grid_is_bit_identical(rng, variant, monkeypatch, case):
    """The persistent kernels stride over the work tiles: with the grid capped at 1 and 3 CTAs (every CTA takes
    many tiles of different lengths through the same mbarrier rings, Q / fixed-tile release included, and tiles
    with no visible key: Tq > Tk, causal) and with one CTA per tile, fwd, dq, dk and dv are bit-identical to the
    default grid (the per-tile math does not depend on which CTA runs it)."""
    Bsz, Tq, Tk, H, Hkv, D, causal = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)
    w = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)[0]
    Q, K, V, W = (cp().asarray(x) for x in (q, k, v, w))

    def run():
        o, lse = A90.flash_attention_sm90(Q, K, V, causal=causal, return_lse=True)
        return [to_host(x) for x in (o, lse, *A90.flash_attention_backward_sm90(W, Q, K, V, o, lse, causal=causal))]

    ref = run()
    for cap, persistent in ((1, True), (3, True), (None, False)):
        monkeypatch.setattr(ck.settings, "attention_sm90_grid_cap", cap)
        monkeypatch.setattr(ck.settings, "attention_sm90_persistent", persistent)
        for x, y, n in zip(run(), ref, ("o", "lse", "dq", "dk", "dv")):
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=f"{n}, grid cap {cap}")
    mo, ml = ck.flash_attention(Q, K, V, causal=causal, return_lse=True)  # and right, not only stable
    close(ref[0], mo, 1.6e-2, "o vs flash_attention")
    for x, y, n in zip(ref[2:], ck.flash_attention_backward(W, Q, K, V, mo, ml, causal=causal), ("dq", "dk", "dv")):
        close(x, y, 3e-2, n + " vs flash_attention_backward")


@pytest.mark.parametrize("ntiles,grid", [(1, 1), (7, 3), (2048, 132), (512, 132), (133, 132), (10, 10)])
def test_snake_walk_takes_every_tile_once(ntiles, grid):
    """snake_tile (the kernels' walk): round k gives CTA c tile k * grid + c (k even) or + grid - 1 - c (k odd);
    a CTA stops at its first tile past the end. Every tile is taken exactly once."""
    src = CU.read_text()
    assert "return k * gridDim.x + ((k & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);" in src
    # fwd, dq, dkdv: producer and consumers; dkdv's FQ instantiation also the dQ writers
    assert src.count("for (int t = snake_tile(0); t < ntiles; t = snake_tile(++tc)) {") == 7
    seen = []
    for c in range(grid):
        k = 0
        while (t := k * grid + ((grid - 1 - c) if k & 1 else c)) < ntiles:
            seen.append(t)
            k += 1
    assert sorted(seen) == list(range(ntiles))


def test_auto_variant_policy(monkeypatch):
    """attention_sm90_variant = "auto": head_dim 64 takes _overlap below WG3_MIN_SEQ keys (WG3_MIN_SEQ_FULL unmasked)
    and _wg3 from there; head_dim 128 D128_AUTO (_serial); an explicit variant is kept where it is instantiated."""
    monkeypatch.setattr(ck.settings, "attention_sm90_variant", "auto")
    assert A90.fwd_variant(64, seq_k=1024) == "_overlap" and A90.fwd_variant(64, seq_k=A90.WG3_MIN_SEQ) == "_wg3"
    assert A90.fwd_variant(64, seq_k=A90.WG3_MIN_SEQ_FULL, causal=False) == "_wg3"
    assert A90.fwd_variant(64, seq_k=256, causal=False) == "_overlap"
    assert A90.fwd_variant(128, seq_k=8192) == A90.D128_AUTO == "_serial"
    assert A90.fwd_variant(64, seq_k=2048) == "_wg3" and A90.fwd_variant(64, seq_k=2047) == "_overlap"
    assert A90.fwd_variant(64, seq_k=512, causal=False) == "_wg3"
    assert A90.fwd_variant(64, "_serial", seq_k=8192) == "_serial" and A90.fwd_variant(128, "_wg3") == ""


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("T,D,causal", [(1000, 64, True), (2100, 64, True), (300, 64, False), (600, 64, False),
                                         (1000, 128, True), (700, 128, False)])
def test_gpu_auto_variant_matches_mma_sync(rng, monkeypatch, T, D, causal):
    """The default dispatch (auto) against the mma.sync kernels, fwd + bwd, on each of its picks."""
    monkeypatch.setattr(ck.settings, "attention_sm90_variant", "auto")
    q, k, v = qkv(rng, 1, T, T, 4, 2, D)
    w = qkv(rng, 1, T, T, 4, 2, D)[0]
    Q, K, V, W = (cp().asarray(x) for x in (q, k, v, w))
    o, lse = A90.flash_attention_sm90(Q, K, V, causal=causal, return_lse=True)
    mo, ml = ck.flash_attention(Q, K, V, causal=causal, return_lse=True)
    close(o, mo, 1.6e-2, "o vs flash_attention")
    lse_equal(lse, ml)
    for x, y, n in zip(A90.flash_attention_backward_sm90(W, Q, K, V, o, lse, causal=causal),
                       ck.flash_attention_backward(W, Q, K, V, mo, ml, causal=causal), ("dq", "dk", "dv")):
        close(x, y, 3e-2, n)


def test_grid_is_one_cta_per_sm_at_most(monkeypatch):
    monkeypatch.setattr(A90.B, "sm_target", lambda: 132)
    assert A90.grid(2048) == 132 and A90.grid(5) == 5 and A90.grid(0) == 1
    monkeypatch.setattr(A90.B, "sm_target", lambda: 116)  # ZeroAdamW(sm_margin=16) while a collective runs
    assert A90.grid(2048) == 116
    monkeypatch.setattr(ck.settings, "attention_sm90_grid_cap", 3)
    assert A90.grid(2048) == 3
    monkeypatch.setattr(ck.settings, "attention_sm90_persistent", False)
    assert A90.grid(2048) == 2048


@pytest.mark.gpu
@needs_sm90
def test_gpu_blas_sm_target_bounds_the_persistent_grid():
    """ZeroAdamW(sm_margin=) lowers cuBLAS's SM target while its collectives run; the persistent attention grid
    follows it (and comes back with it)."""
    from cukernels import blas
    full = ck._backend.sm_count()
    old = blas.set_sm_count_target(full - 16)
    try:
        assert A90.grid(10_000) == full - 16
    finally:
        blas.set_sm_count_target(old)
    assert A90.grid(10_000) == full


def test_flash_attention_picks_its_backend_in_one_place(monkeypatch):
    """ops/attention.py imports attention_sm90 directly (no registration) and chooses in _use_sm90: the wgmma kernels
    on a 9.0 device for calls without a key mask at head_dim 64 / 128, unless ck.settings.attention_wgmma is off."""
    from cukernels.ops import attention as A
    assert A._sm90 is A90 and not hasattr(A, "_SM90_IMPL")
    import types

    import cupy
    monkeypatch.setattr(cupy.cuda, "Device", lambda: types.SimpleNamespace(id=12345))  # (no GPU needed)
    for supported in (True, False):
        monkeypatch.setitem(A._SM90, 12345, supported)
        assert A._use_sm90(None, 64) is supported and A._use_sm90(None, 128) is supported
        assert A._use_sm90(None, 32) is False and A._use_sm90((np.int64(8), np.int32(1)), 64) is False
        with ck.settings(attention_wgmma=False):
            assert A._use_sm90(None, 64) is False
