"""cukernels: hand-written CUDA kernels for LLM training on CuPy arrays, with NumPy reference paths.

Layers, each importing only from those before it (tests/test_layering.py checks it):
ops (kernels + references) -> autograd -> functional -> nn / optim / io -> models -> generation -> train.
"""
from ._backend import bfloat16, float8_e4m3fn, float8_e5m2, gpu_available
from ._loader import KernelCompileError
from .settings import settings
from .blas import matmul
from ._public import reexport as _reexport
_reexport(f"{__name__}.ops", globals())  # the kernel ops: every ops/<family>.py's __all__
from .autograd import Function, Tensor, no_grad, tensor
from .amp import Float8Recipe, autocast, float8
from . import distributed, functional, graph, io, nn, optim
from .io import checkpoint
from .models import (GPT2, GPT2Config, Llama, LlamaConfig, Mistral, MistralConfig, Qwen2, Qwen2Config, Qwen3,
                     Qwen3Config, from_pretrained)
from . import models, generation
from .generation import generate
from .tokenizer import ByteTokenizer, TextStream, Tokenizer

__version__ = "0.2.0"
