"""The PyTorch data-parallel peer of the multi-GPU benchmarks (benchmarks/bench_torch_dist.py) runs on CPUs: two
ranks under our launcher with gloo, DDP and FSDP2 on the tiny shape. Both see the same initial weights and the same
per-rank batches, so their loss trajectories agree (float32 on CPUs): a harness that mis-wires the data, the
sharding or the optimizer shows here, before any GPU time is spent on it. Needs PyTorch and transformers."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.fsdp")

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path, mode):
    out = tmp_path / f"{mode}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "cukernels.run", "--nproc-per-node", "2", "benchmarks/bench_torch_dist.py", "--cpu",
           "--shape", "tiny", "--mode", mode, "--batch", "2", "--seq", "32", "--steps", "3", "--warmup", "1",
           "--json", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(out.read_text())


def test_ddp_and_fsdp2_peers_agree_on_cpus(tmp_path):
    ddp, fsdp = _run(tmp_path, "ddp"), _run(tmp_path, "fsdp2")
    for row in (ddp, fsdp):
        assert row["ranks"] == 2 and row["batch"] == 2 and row["seq"] == 32
        assert np.isfinite(row["ms"]) and row["ms"] > 0 and row["tok_s"] > 0
        assert len(row["losses"]) == 4 and np.isfinite(row["losses"]).all()
    assert ddp["params"] == fsdp["params"]  # the whole model counted under FSDP2 too
    np.testing.assert_allclose(fsdp["losses"], ddp["losses"], rtol=1e-4)
    assert fsdp["losses"][-1] != fsdp["losses"][0]  # the optimizer moved the weights
