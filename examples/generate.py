#!/usr/bin/env python
"""Sample text from a model trained here (or loaded from Hugging Face weights), streaming it as it is sampled:

    python examples/generate.py --checkpoint runs/tiny --prompt "ROMEO:" --max-new-tokens 200 --top-k 40
    python examples/generate.py --checkpoint runs/small --prompt "ROMEO:" --temperature 0.8 --top-k 40 --seed 1
    python examples/generate.py --checkpoint path/to/Llama-3.2-1B --prompt "The capital of France is" --temperature 0

The same command as ``python -m cukernels.sample`` (``--help`` for every option): a thin script over
:mod:`cukernels.sample`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a source checkout, uninstalled

from cukernels.sample import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="examples/generate.py"))
