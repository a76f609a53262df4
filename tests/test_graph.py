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
