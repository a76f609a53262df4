"""cukernels: hand-written CUDA kernels for LLM training on CuPy arrays, with NumPy reference paths."""
from ._backend import bfloat16, gpu_available
from ._loader import KernelCompileError
from .ops.rms_norm import rms_norm, rms_norm_backward
from .ops.layer_norm import layer_norm, layer_norm_backward
from .ops.softmax import attn_softmax, attn_softmax_backward, softmax, softmax_backward

__version__ = "0.1.0"
