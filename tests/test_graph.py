"""CUDA-graph capture of whole training steps: the replayed step computes what the eager step computes."""
import os

import numpy as np
import pytest

from cukernels.train import cli, trainer
from cukernels.train import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CFG = os.path.join(ROOT, "examples", "configs", "tiny.yaml")
OVR = ["device=gpu", "fused=true", "max_steps=8", "eval_every=0", "log_every=1", "plot=false", "batch_size=4",
       "seq_len=32", "total_batch_size=256", "warmup_steps=3", "lr=3e-3"]


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], ["autocast=bf16", "sparse_embedding=true"],
                                   ["autocast=bf16", "sparse_embedding=true", "grad_dtype=bfloat16",
                                    "total_batch_size=128"]], ids=["fp32", "bf16-sparse", "bf16-grads"])
def test_graph_steps_equal_eager_steps(tmp_path, extra):
    """graph: true (capture after 2 warm-up steps, then replays with new batches copied into fixed buffers)
    gives the same losses and grad norms as graph: false, step for step (2 micro-batches per step; one with bf16
    gradient buffers)."""
    runs = {}
    for g in (False, True):
        cfg = load_config(CFG, OVR + extra + [f"graph={str(g).lower()}", f"out_dir={tmp_path / str(g)}"])
        rows = trainer.train(cfg, quiet=True)
        runs[g] = [(r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"]
    assert len(runs[True]) == 8
    np.testing.assert_allclose(np.array(runs[True]), np.array(runs[False]), rtol=1e-5, atol=1e-6)
    assert runs[True][-1][0] < runs[True][0][0]  # and it trains


@pytest.mark.gpu
def test_captured_step_replays_a_counter():
    import cupy as cp

    import cukernels as ck

    x = cp.zeros((), dtype=cp.float32)

    def fn():
        x[...] += 1.0
        return x

    s = ck.graph.CapturedStep(fn, warmup=1)
    for _ in range(5):
        out = s()
    assert float(out) == 5.0 and s.graph is not None


@pytest.mark.gpu
def test_captured_graph_keeps_node_priorities_and_a_side_stream():
    """The step is instantiated through the driver with per-node priorities (cukernels.graph.instantiate): work
    forked onto a high-priority side stream inside the captured function is replayed, joined back, in order."""
    import cupy as cp

    import cukernels as ck

    x = cp.zeros((1000,), dtype=cp.float32)
    y = cp.zeros((1000,), dtype=cp.float32)
    side = cp.cuda.Stream(non_blocking=True, priority=-100)  # clamped to the device's greatest priority

    def fn():
        x[...] += 1.0
        side.wait_event(cp.cuda.get_current_stream().record())
        with side:
            y[...] += x  # y_k = sum of x_1..x_k = k (k + 1) / 2
        cp.cuda.get_current_stream().wait_event(side.record())
        return y

    s = ck.graph.CapturedStep(fn, warmup=1)
    for _ in range(6):
        out = s()
    s.synchronize()
    assert isinstance(s.graph, ck.graph._PriorityGraph), type(s.graph)
    assert bool((out == 21.0).all())


# --- small memset nodes re-issued as kernel nodes (ck.settings.graph_memset_nodes, kernels_cu/graph_fill.cu) ---

@pytest.mark.parametrize("dst,pitch,value,elsize,width,height,want", [
    (0, 0, 0xAB, 1, 8, 1, (0, 0xABABABAB, 4, 2, 1)),         # aligned bytes -> words of the repeated byte
    (0, 12, 0x1FF, 1, 4, 3, (12, 0xFFFFFFFF, 4, 1, 3)),      # value masked to its low byte first
    (0, 10, 0xAB, 1, 4, 3, (10, 0xAB, 1, 4, 3)),             # rows 10 bytes apart: stays bytes
    (2, 0, 0xAB, 1, 8, 1, (0, 0xAB, 1, 8, 1)),               # misaligned address
    (0, 0, 0xAB, 1, 7, 1, (0, 0xAB, 1, 7, 1)),               # 7 bytes
    (0, 0, 0x12345, 2, 6, 1, (0, 0x23452345, 4, 3, 1)),      # halves -> words
    (0, 0, 0xDEADBEEF, 4, 5, 2, (0, 0xDEADBEEF, 4, 5, 2)),
])
def test_fill_plan(dst, pitch, value, elsize, width, height, want):
    from cukernels import graph

    assert graph.fill_plan(dst, pitch, value, elsize, width, height) == want
    # the plan writes the same bytes as the node (reference on a 64-byte buffer)
    buf = np.arange(64, dtype=np.uint8)
    p, v, e, w, h = want
    np.testing.assert_array_equal(graph.fill_reference(buf, dst, pitch, value, elsize, width, height),
                                  graph.fill_reference(buf, dst, p, v, e, w, h))


def test_fill_plan_rejects_bad_element_size():
    from cukernels import graph

    with pytest.raises(ValueError, match="elsize"):
        graph.fill_plan(0, 0, 0, 3, 4, 1)


def _capture_memsets(cp, lib, base, ops, mode):
    """Capture ``ops`` (driver memsets and a copy kernel between them) on a fresh stream, end the capture through
    cukernels.graph with ck.settings.graph_memset_nodes = ``mode``; returns the instantiated graph and the stream."""
    import ctypes

    from cukernels import graph, settings

    s = cp.cuda.Stream(non_blocking=True)
    u64, sz, st = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p(s.ptr)
    with settings(graph_memset_nodes=mode):
        s.begin_capture()
        try:
            for op in ops:
                kind = op[0]
                if kind == "copy":  # a kernel node between fills: bytes [a, a+n) -> [b, b+n)
                    _, a, b, n = op
                    with s:  # no temporary: nothing is allocated during the capture
                        cp.add(base[a:a + n], np.uint8(1), out=base[b:b + n])
                    continue
                _, off, pitch, value, elsize, width, height = op
                d = u64(base.data.ptr + off)
                if height == 1:
                    fn = {1: lib.cuMemsetD8Async, 2: lib.cuMemsetD16Async, 4: lib.cuMemsetD32Async}[elsize]
                    ct = {1: ctypes.c_ubyte, 2: ctypes.c_ushort, 4: ctypes.c_uint}[elsize]
                    r = fn(d, ct(value), sz(width), st)
                else:
                    fn = {1: lib.cuMemsetD2D8Async, 2: lib.cuMemsetD2D16Async, 4: lib.cuMemsetD2D32Async}[elsize]
                    ct = {1: ctypes.c_ubyte, 2: ctypes.c_ushort, 4: ctypes.c_uint}[elsize]
                    r = fn(d, sz(pitch), ct(value), sz(width), sz(height), st)
                assert r == 0, (op, r)
        finally:
            g = graph.end_capture(s)
    return g, s


@pytest.mark.gpu
def test_memset_nodes_become_kernels_with_the_same_bytes_and_order():
    """Memset nodes of 1 / 2 / 4-byte elements, 1-D and pitched, aligned and not, replayed as graph_fill kernel
    nodes, leave exactly the bytes the memsets leave (NumPy reference on a poisoned buffer), in stream order
    around a kernel that reads what one fill wrote; a fill above MEMSET_KERNEL_MAX_BYTES stays a memset node."""
    import cupy as cp

    from cukernels import _backend as B
    from cukernels import graph

    lib = B.libcuda()
    big = graph.MEMSET_KERNEL_MAX_BYTES + 4096
    n = 16384 + big + 64
    ops = [
        ("set", 0, 0, 0x5A, 1, 1001, 1),          # odd byte count
        ("set", 3, 0, 0xC3, 1, 64, 1),            # misaligned start, overwrites part of the first
        ("copy", 0, 2000, 40),                    # reads the two fills above: order matters
        ("set", 2002, 0, 0x77, 1, 8, 1),          # overwrites part of what the copy wrote
        ("set", 4096, 0, 0xBEEF, 2, 333, 1),
        ("set", 5002, 0, 0x1234, 2, 9, 1),        # 2-byte aligned only
        ("set", 6144, 0, 0xDEADBEEF, 4, 257, 1),
        ("set", 8192, 37, 0x11, 1, 29, 5),        # pitched bytes, odd pitch
        ("set", 8704, 64, 0x2233, 2, 24, 4),      # pitched halves -> words
        ("set", 9216, 128, 0x01020304, 4, 7, 3),
        ("copy", 9216, 9900, 100),
        ("set", 16384, 0, 0, 1, big, 1),          # above the threshold: stays a memset node
        ("set", 16384 + big - 5, 0, 0xEE, 1, 9, 1),
    ]
    n_small = sum(1 for o in ops if o[0] == "set" and o[4] * o[5] * o[6] <= graph.MEMSET_KERNEL_MAX_BYTES)
    rng = np.random.default_rng(7)
    poison = rng.integers(0, 256, n, dtype=np.uint8)
    want = poison.copy()
    for op in ops:
        if op[0] == "copy":
            _, a, b, m = op
            want[b:b + m] = want[a:a + m] + np.uint8(1)
        else:
            _, off, pitch, value, elsize, width, height = op
            want = graph.fill_reference(want, off, pitch, value, elsize, width, height)
    for mode, converted in (("kernel", n_small), ("keep", 0)):
        base = cp.asarray(poison)
        g, s = _capture_memsets(cp, lib, base, ops, mode)
        assert g.memsets_converted == converted, (mode, g.memsets_converted)
        for _ in range(2):  # a replay leaves the same bytes again
            base.set(poison)
            g.launch(s)
            s.synchronize()
            np.testing.assert_array_equal(cp.asnumpy(base), want, err_msg=mode)


@pytest.mark.gpu
def test_captured_gemms_with_memsets_as_kernels_equal_eager():
    """The LLaMA-1B step's GEMM shapes (cuBLAS puts a workspace memset before most of them: 168 a B8xT1024 step)
    captured with graph_memset_nodes = "kernel": the memsets are rewritten and the products are bit-identical to
    eager calls and to the graph captured with graph_memset_nodes = "keep"."""
    import cupy as cp

    import cukernels as ck

    rng = np.random.default_rng(3)
    shapes = [(8192, 2048, 3072), (8192, 2048, 16384), (8192, 8192, 2048), (2048, 8192, 2048), (16384, 8192, 2048)]
    ops = []
    for m, k, nn in shapes:
        a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32)).astype(ck.bfloat16)
        b = cp.asarray(rng.standard_normal((k, nn), dtype=np.float32)).astype(ck.bfloat16)
        ops.append((a, b, cp.empty((m, nn), dtype=cp.float32)))
    eager = [cp.asnumpy(ck.matmul(a, b, out_dtype=cp.float32)) for a, b, _ in ops]
    got = {}
    for mode in ("kernel", "keep"):
        with ck.settings(graph_memset_nodes=mode):
            def fn():
                for a, b, c in ops:
                    c.fill(np.nan)
                    ck.matmul(a, b, out=c)
                return [c for _, _, c in ops]

            step = ck.graph.CapturedStep(fn, warmup=1)
            step()
            out = step()
            step.synchronize()
        got[mode] = ([cp.asnumpy(c) for c in out], step.graph.memsets_converted)
    assert got["keep"][1] == 0
    assert got["kernel"][1] > 0, "cuBLAS issued no memset node for the step's shapes (nothing to rewrite?)"
    for e, k, kp in zip(eager, got["kernel"][0], got["keep"][0]):
        np.testing.assert_array_equal(k, e)
        np.testing.assert_array_equal(kp, e)
