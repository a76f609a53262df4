#!/usr/bin/env python
"""Train a language model with cukernels: tape autograd + kernel layers + AdamW, no PyTorch.

    python examples/train.py                                                # no --config: the tiny config
    python examples/train.py --config examples/configs/tiny.yaml            # CPU, NumPy path, ~1 min
    python examples/train.py --config examples/configs/small.yaml           # GPU, kernels, bf16 autocast
    python examples/train.py --config examples/configs/tiny.yaml max_steps=50 fused=false
    python examples/train.py --config examples/configs/small.yaml --resume latest

Overrides are ``key=value`` (YAML values; ``model.hidden_size=256`` reaches into the model section); ``--help``
lists every key (the model fields of each family too). The loop is library code: ``cukernels.train``; this script is
``python -m cukernels.train`` (``cukernels-train`` when installed).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a source checkout, uninstalled

from cukernels.train.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="examples/train.py"))
