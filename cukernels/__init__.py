"""cukernels: hand-written CUDA kernels for LLM training on CuPy arrays, with NumPy reference paths."""
from ._backend import bfloat16, gpu_available
from ._loader import KernelCompileError
from .blas import matmul
from .ops.rms_norm import rms_norm, rms_norm_backward

__version__ = "0.1.0"
# autograd, layers, autocast, LLaMA (issue 6)
from .autograd import Function, Tensor, no_grad, tensor
from . import functional, nn, amp
from .amp import autocast
from .models.llama import Llama, LlamaConfig
