"""cukernels: hand-written CUDA kernels for LLM training on CuPy arrays, with NumPy reference paths."""
from ._backend import bfloat16, gpu_available
from ._loader import KernelCompileError
from .blas import matmul
from .ops.rms_norm import rms_norm, rms_norm_backward

__version__ = "0.1.0"
