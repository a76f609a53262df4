"""cukernels: hand-written CUDA kernels for LLM training on CuPy arrays, with NumPy reference paths."""
from ._backend import bfloat16, gpu_available
from ._loader import KernelCompileError
from .ops.rms_norm import rms_norm, rms_norm_backward
from .ops.rope import rope, rope_backward, rope_cache
from .ops.activations import gelu, gelu_backward, swiglu, swiglu_backward, swiglu_packed, swiglu_packed_backward
from .ops.elementwise import add, cast, mul

__version__ = "0.1.0"
