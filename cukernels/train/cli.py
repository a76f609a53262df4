"""``python examples/train.py --config examples/configs/tiny.yaml [key=value ...]`` (or ``python -m
cukernels.train``): the command line over :func:`cukernels.train.train`."""
from __future__ import annotations

import argparse
import sys

from ..io.checkpoint import CheckpointError
from ..io.hf_folder import HFFormatError
from .config import ConfigError, describe, load_config
from .trainer import train


def main(argv=None, prog=None):
    ap = argparse.ArgumentParser(prog=prog, description="Train a language model with cukernels (no PyTorch).",
                                 epilog="config keys (key=value overrides; model.<field> reaches the model):\n"
                                        + describe(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML config (examples/configs/*.yaml); defaults when omitted")
    ap.add_argument("--resume", default=None, metavar="PATH|latest",
                    help="continue from a checkpoint file or folder (or the newest in ckpt_dir with 'latest')")
    ap.add_argument("overrides", nargs="*", help="key=value overrides (model.hidden_size=256, fused=false, ...)")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.config, a.overrides + ([f"resume={a.resume}"] if a.resume else []))
        train(cfg)
    except (ConfigError, CheckpointError, HFFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted (the last checkpoint, if any, is intact: --resume latest continues)", file=sys.stderr)
        return 130
    return 0
