#!/usr/bin/env python
"""Does transformers load what ``python -m cukernels.export`` writes, with no warning about the special-token ids,
and compute our logits? (Issue 35: the GPT-2 export had no bos/eos ids, so transformers warned and assumed 50256 on
a 256-token model.) Run where PyTorch and transformers are installed (the GPU machine):

    PYTHONPATH=. python tests/gpu_export_check.py

For the tiny LLaMA and the tiny GPT-2 config: a few training steps on the NumPy path, the run exported, then
``transformers.AutoModelForCausalLM.from_pretrained`` with transformers' log and Python's warnings captured: no
message may name bos/eos/pad or a token id, the config's and the generation config's ids must be null, and the
logits must equal ours (fp32, atol 1e-4). Without PyTorch only ``AutoConfig`` is checked (``--config-only``
is then implied). Exit status 1 on any failure.
"""
import argparse
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cukernels as ck  # noqa: E402
from cukernels.export import export  # noqa: E402
from cukernels.train import load_config, train  # noqa: E402

SMALL = ["max_steps=4", "eval_every=0", "log_every=1", "plot=false", "sample_chars=0", "batch_size=4", "seq_len=32",
         "total_batch_size=128", "device=cpu", "progress=lines"]
IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def captured(fn):
    """``(fn(), every message transformers logged or Python warned meanwhile)``."""
    import transformers
    records = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = records.append
    lg = logging.getLogger("transformers")
    old = lg.level
    lg.addHandler(handler)
    transformers.logging.set_verbosity_warning()
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = fn()
    finally:
        lg.removeHandler(handler)
        lg.setLevel(old)
    return out, [r.getMessage() for r in records if r.levelno >= logging.WARNING] + [str(x.message) for x in w]


def check(name, config_only, tmp):
    import transformers
    run = Path(tmp) / name
    cfgs = {"llama": "tiny", "gpt2": "gpt2-tiny"}
    train(load_config(cfgs[name], SMALL + [f"out_dir={run}"]), quiet=True)
    hf, _ = export(run, Path(tmp) / f"{name}-hf")
    bad = []
    cfg, msgs = captured(lambda: transformers.AutoConfig.from_pretrained(hf))
    ids = tuple(getattr(cfg, k) for k in IDS)
    if ids != (None, None, None):
        bad.append(f"{name}: AutoConfig ids {dict(zip(IDS, ids))}, expected nulls")
    if not config_only:
        import torch
        model, more = captured(lambda: transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32))
        msgs += more
        gc = model.generation_config
        if any(getattr(gc, k, None) is not None for k in IDS):
            bad.append(f"{name}: generation_config ids {[getattr(gc, k, None) for k in IDS]}, expected nulls")
        ours = ck.from_pretrained(hf)
        ours.eval()
        x = np.array([[82, 79, 77, 69, 79, 58, 10, 73, 32, 97, 109]])
        mine = ours(x).data
        with torch.no_grad():
            theirs = model.eval()(torch.tensor(x)).logits.float().numpy()
        err = float(np.abs(mine - theirs).max())
        print(f"{name}: logits max |ours - transformers| = {err:.2e}")
        if err > 1e-4:
            bad.append(f"{name}: logits differ by {err:.2e}")
    about_ids = [m for m in msgs if any(s in m for s in ("token_id", "bos", "eos", "pad_token"))]
    if about_ids:
        bad.append(f"{name}: transformers said: {about_ids}")
    for m in msgs:
        print(f"{name}: (other message) {m}")
    return bad


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-only", action="store_true", help="AutoConfig only (no PyTorch needed)")
    a = ap.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: nothing to check", file=sys.stderr)
        return 1
    try:
        import torch  # noqa: F401
    except ImportError:
        a.config_only = True
    print(f"transformers {transformers.__version__}{' (config only)' if a.config_only else ''}")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        bad = check("llama", a.config_only, tmp) + check("gpt2", a.config_only, tmp)
    for b in bad:
        print(f"FAIL {b}")
    print("OK: the exports load in transformers with no warning about their special-token ids" if not bad else
          f"{len(bad)} failure(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
