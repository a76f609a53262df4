"""cukernels: hand-written CUDA kernels for LLM training on CuPy arrays, with NumPy reference paths.

Layers, each importing only from those before it (tests/test_layering.py checks it):
ops (kernels + references) -> autograd -> functional -> nn / optim / io -> models -> generation -> train.
"""
from ._backend import bfloat16, gpu_available
from ._loader import KernelCompileError
from .settings import settings
from .blas import matmul
from .ops.rms_norm import add_rms_norm, add_rms_norm_backward, rms_norm, rms_norm_backward
from .ops.layer_norm import layer_norm, layer_norm_backward
from .ops.attention import flash_attention, flash_attention_backward
from .ops.softmax import attn_softmax, attn_softmax_backward, softmax, softmax_backward
from .ops.cross_entropy import cross_entropy, cross_entropy_backward, cross_entropy_error, cross_entropy_fused
from .ops.embedding import SparseRowGrad, embedding, embedding_backward, embedding_error
from .ops.rope import rope, rope_backward, rope_cache
from .ops.activations import gelu, gelu_backward, swiglu, swiglu_backward, swiglu_packed, swiglu_packed_backward
from .ops.elementwise import add, cast, mul
from .ops.adam import adam_error, adam_step, adam_step_rows, clip_scale, global_norm, zero_rows
from .ops.dropout import dropout, dropout_add, dropout_backward
from .ops.linear_cross_entropy import linear_cross_entropy
from .ops.decode_attention import (decode_attention, decode_attention_rope, decode_attention_workspace, kv_cache_write,
                                   rope_kv_write)
from .ops.gemv import gemv
from .ops.attention_sm90 import flash_attention_backward_sm90, flash_attention_sm90, flash_attention_sm90_supported
from .ops.sampling import sample_tokens, sample_workspace
from .autograd import Function, Tensor, no_grad, tensor
from .amp import autocast
from . import distributed, functional, graph, io, nn, optim
from .io import checkpoint
from .models import GPT2, GPT2Config, Llama, LlamaConfig, from_pretrained
from . import models, generation
from .generation import generate
from .tokenizer import ByteTokenizer, TextStream, Tokenizer

__version__ = "0.2.0"
