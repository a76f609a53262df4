"""``python -m cukernels.train [--config tiny|FILE.yaml] [key=value ...]`` (or ``examples/train.py``): the command line
over :func:`cukernels.train.train`. Without ``--config`` it trains the tiny config (a CPU run of about a minute).
A user error (a config key, a path, a checkpoint) is one line and exit code 2 (``--debug``: the traceback)."""
from __future__ import annotations

import argparse
import sys

from .._cli import add_debug, run
from ..io.checkpoint import CheckpointError
from ..io.hf_folder import HFFormatError
from .config import ConfigError, config_path, describe, load_config, shipped_configs
from .trainer import train

DEFAULT_CONFIG = "tiny"


def main(argv=None, prog=None):
    names = ", ".join(shipped_configs()) or "none found"
    ap = argparse.ArgumentParser(prog=prog, description="Train a language model with cukernels (no PyTorch).",
                                 epilog="config keys (key=value overrides; model.<field> reaches the model):\n"
                                        + describe(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help=f"a YAML config file, or the name of a shipped one ({names}); default: "
                                     f"{DEFAULT_CONFIG}, the CPU run of about a minute")
    ap.add_argument("--resume", default=None, metavar="PATH|latest",
                    help="continue from a checkpoint file or folder (or the newest in ckpt_dir with 'latest')")
    add_debug(ap)
    ap.add_argument("overrides", nargs="*", help="key=value overrides (model.hidden_size=256, fused=false, ...)")
    a = ap.parse_args(argv)

    def body():
        path = a.config
        if path is None:
            path = config_path(DEFAULT_CONFIG)
            print(f"no --config: training the {DEFAULT_CONFIG} config ({path}); the shipped configs: {names}",
                  file=sys.stderr)
        cfg = load_config(path, a.overrides + ([f"resume={a.resume}"] if a.resume else []))
        train(cfg)
    return run(body, debug=a.debug, user_errors=(ConfigError, CheckpointError, HFFormatError),
               interrupted="interrupted (the last checkpoint, if any, is intact: --resume latest continues)")
