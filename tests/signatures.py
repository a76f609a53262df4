"""The public API's signatures as a table (issue 36): for each public function and constructor, a valid call on
small NumPy arrays and the kind of each argument. ``tests/test_fuzz_signatures.py`` draws an invalid value of
each argument's kind and asserts a TypeError / ValueError whose message starts with the argument's name.

Kinds (what a valid value is; the invalid values drawn for each are in test_fuzz_signatures.BAD):

    farr      a required float32 / bfloat16 array       oarr    an optional float output array (None = default)
    iarr      a required integer (ids, targets) array   oiarr   an optional integer array
    pos_int   an integer >= 1                           nn_int  an integer >= 0
    int       any integer                               pos     a finite real number > 0
    nn        a finite real number >= 0                 real    a finite real number
    prob      a real number in [0, 1]                   p1      a real number in [0, 1) (dropout's p)
    bool      True or False                             choice  one of a few strings
    dtype     a float dtype (float32 / bfloat16)        seed    an integer in [0, 2**64)
    path      a writable file path                      amap    a {name: array} mapping
    meta      JSON metadata (a dict)                    smeta   safetensors metadata ({str: str})

``kind!label`` leaves out the invalid values of that label (``pos!None``: None is valid here, the default;
``pos_int!big``: a huge integer is valid, clamped; ``farr!f64``: float64 is valid on the NumPy path).
"""
from __future__ import annotations

import numpy as np

import cukernels as ck
from cukernels import nn, optim
from cukernels.io import checkpoint as C
from cukernels.io import safetensors as S

F32, BF16 = np.float32, np.dtype(ck.bfloat16)


def f(*shape, dtype=F32, fill=0.0):
    return np.full(shape, fill, dtype)


def r(*shape, dtype=F32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def i32(*vals):
    return np.array(vals, np.int32)


def _attn():
    q = r(1, 4, 2, 32, dtype=BF16)
    return dict(q=q, k=r(1, 4, 2, 32, dtype=BF16, seed=1), v=r(1, 4, 2, 32, dtype=BF16, seed=2))


def _attn_bwd():
    a = _attn()
    out, lse = ck.flash_attention(a["q"], a["k"], a["v"], return_lse=True)
    return dict(dout=r(1, 4, 2, 32, dtype=BF16, seed=3), out=out, lse=lse, **a)


def _dec():
    return dict(q=r(1, 1, 2, 32, dtype=BF16), k_cache=r(1, 8, 2, 32, dtype=BF16, seed=1),
                v_cache=r(1, 8, 2, 32, dtype=BF16, seed=2), cache_len=3)


def _rope():
    cos, sin = ck.rope_cache(8, 8, xp=np)
    return dict(x=r(1, 4, 2, 8), cos=cos, sin=sin)


def _rope_kv():
    cos, sin = ck.rope_cache(8, 32, xp=np)
    return dict(qkv=r(1, 1, 4 * 32, dtype=BF16), n_heads=2, n_kv_heads=1, k_cache=f(1, 8, 1, 32, dtype=BF16),
                v_cache=f(1, 8, 1, 32, dtype=BF16), cache_len=1, cos=cos, sin=sin)


def _adam():
    return dict(param=f(8), grad=r(8), exp_avg=f(8), exp_avg_sq=f(8), lr=1e-3, step=1)


def _adam_rows():
    return dict(param=f(4, 3), grad=r(4, 3), exp_avg=f(4, 3), exp_avg_sq=f(4, 3), rows=i32(0, 2),
                row_count=np.array(2, np.int32), lr=1e-3, step=1)


def _ln_bwd():
    x, g = r(2, 8), f(8, fill=1.0)
    _, mean, rstd = ck.layer_norm(x, g, f(8), return_stats=True)
    return dict(dy=r(2, 8, seed=1), x=x, gamma=g, mean=mean, rstd=rstd)


def _rms_bwd():
    x, w = r(2, 8), f(8, fill=1.0)
    _, rstd = ck.rms_norm(x, w, return_rstd=True)
    return dict(dy=r(2, 8, seed=1), x=x, weight=w, rstd=rstd)


def _add_rms_bwd():
    x, res, w = r(2, 8), r(2, 8, seed=1), f(8, fill=1.0)
    _, h, rstd = ck.add_rms_norm(x, res, w, return_rstd=True)
    return dict(dy=r(2, 8, seed=2), dh=r(2, 8, seed=3), h=h, weight=w, rstd=rstd)


def _ce_bwd():
    lg, t = r(3, 5), i32(0, 1, 4)
    _, lse = ck.cross_entropy(lg, t, return_lse=True)
    return dict(logits=lg, targets=t, lse=lse, dloss=1.0)


def _model():
    return ck.Llama(ck.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, max_position_embeddings=32))


_MODEL = []


def model():
    if not _MODEL:
        _MODEL.append(_model())
    return _MODEL[0]


def _params():
    return [("w", f(4, 4)), ("b", f(4))]


_TMP = []


def tmpdir():
    """One temporary folder for the file writers' calls (created on first use)."""
    import tempfile

    if not _TMP:
        _TMP.append(tempfile.mkdtemp(prefix="ck-signatures-"))
    return _TMP[0]


def _file(name):
    import os

    return os.path.join(tmpdir(), name)


REDUCTION = ("mean", "sum", "none")

# name -> (callable, valid keyword arguments (a function: fresh arrays every call), {argument: kind})
# The LLaMA-style families (Qwen2, Qwen3, Mistral): LlamaConfig's fields plus their own (two layers: one slides).
_LLAMA_SMALL = dict(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                    max_position_embeddings=32)
_LLAMA_KINDS = dict(vocab_size="pos_int", hidden_size="pos_int", intermediate_size="pos_int",
                    num_hidden_layers="pos_int", num_attention_heads="pos_int", num_key_value_heads="pos_int!None",
                    head_dim="pos_int!None", rms_norm_eps="pos", rope_theta="pos", tie_word_embeddings="bool",
                    max_position_embeddings="pos_int", initializer_range="nn")

TABLE = {
    # ---------------------------------------------------------------------------------------------- ops
    "rms_norm": (ck.rms_norm, lambda: dict(x=r(2, 8), weight=f(8)),
                 dict(x="farr", weight="farr", eps="pos", return_rstd="bool", out="oarr")),
    "rms_norm_backward": (ck.rms_norm_backward, _rms_bwd,
                          dict(dy="farr", x="farr", weight="farr", rstd="farr", dh="oarr", out="oarr",
                               amax="oarr")),
    "add_rms_norm": (ck.add_rms_norm, lambda: dict(x=r(2, 8), residual=r(2, 8, seed=1), weight=f(8)),
                     dict(x="farr", residual="farr", weight="farr", eps="pos", return_rstd="bool", out="oarr",
                          out_sum="oarr")),
    "add_rms_norm_backward": (ck.add_rms_norm_backward, _add_rms_bwd,
                              dict(dy="farr", dh="oarr", h="farr", weight="farr", rstd="farr", out="oarr",
                                   amax="oarr")),
    "layer_norm": (ck.layer_norm, lambda: dict(x=r(2, 8), gamma=f(8), beta=f(8)),
                   dict(x="farr", gamma="farr", beta="farr", eps="pos", return_stats="bool", out="oarr")),
    "layer_norm_backward": (ck.layer_norm_backward, _ln_bwd,
                            dict(dy="farr", x="farr", gamma="farr", mean="farr", rstd="farr", out="oarr")),
    "softmax": (ck.softmax, lambda: dict(x=r(2, 8)), dict(x="farr", out="oarr")),
    "softmax_backward": (ck.softmax_backward, lambda: dict(y=ck.softmax(r(2, 8)), dy=r(2, 8, seed=1)),
                         dict(y="farr", dy="farr", out="oarr")),
    "attn_softmax": (ck.attn_softmax, lambda: dict(scores=r(1, 2, 4, 4)),
                     dict(scores="farr", causal="bool", scale="real", window="pos_int!None", out="oarr")),
    "attn_softmax_backward": (ck.attn_softmax_backward,
                              lambda: dict(probs=ck.attn_softmax(r(1, 2, 4, 4)), dprobs=r(1, 2, 4, 4, seed=1)),
                              dict(probs="farr", dprobs="farr", scale="real", out="oarr")),
    "cross_entropy": (ck.cross_entropy, lambda: dict(logits=r(3, 5), targets=i32(0, 1, 4)),
                      dict(logits="farr", targets="iarr", ignore_index="int", reduction=("choice", REDUCTION),
                           label_smoothing="prob", return_lse="bool", out="oarr")),
    "cross_entropy_backward": (ck.cross_entropy_backward, _ce_bwd,
                               dict(logits="farr", targets="iarr", lse="farr", dloss="real", ignore_index="int",
                                    reduction=("choice", REDUCTION), label_smoothing="prob", out="oarr")),
    "cross_entropy_fused": (ck.cross_entropy_fused, lambda: dict(logits=r(3, 5), targets=i32(0, 1, 4)),
                            dict(logits="farr", targets="iarr", ignore_index="int",
                                 reduction=("choice", REDUCTION), label_smoothing="prob", dloss="real",
                                 out="oarr")),
    "linear_cross_entropy": (ck.linear_cross_entropy,
                             lambda: dict(x=r(3, 4), weight=r(5, 4, seed=1), targets=i32(0, 1, 4)),
                             dict(x="farr", weight="farr", targets="iarr", ignore_index="int",
                                  reduction=("choice", REDUCTION), label_smoothing="prob", accumulate="bool",
                                  compute_grad="bool", chunk_rows="pos_int!big!None", dloss="real", grad_weight="oarr",
                                  grad_input="oarr", num_classes="pos_int!None", grad_fp8="dtype",
                                  grad_fp8_dw="bool")),
    "embedding": (ck.embedding, lambda: dict(ids=i32(0, 3), table=r(4, 8)),
                  dict(ids="iarr", table="farr", out="oarr")),
    "embedding_backward": (ck.embedding_backward, lambda: dict(ids=i32(0, 3), dout=r(2, 8), vocab_size=4),
                           dict(ids="iarr", dout="farr", vocab_size="pos_int", accumulate="bool", out="oarr")),
    "SparseRowGrad": (ck.SparseRowGrad, lambda: dict(vocab_size=4, dim=8, xp=np),
                      dict(vocab_size="pos_int", dim="pos_int", dtype="dtype")),
    "rope": (ck.rope, _rope, dict(x="farr", cos="farr", sin="farr", positions="oiarr", interleaved="bool",
                                  out="oarr")),
    "rope_backward": (ck.rope_backward, lambda: {("dy" if k == "x" else k): v for k, v in _rope().items()},
                      dict(dy="farr", cos="farr", sin="farr", positions="oiarr", interleaved="bool", out="oarr")),
    "rope_cache": (ck.rope_cache, lambda: dict(seq_len=4, head_dim=8, xp=np),
                   dict(seq_len="pos_int", head_dim="pos_int", theta="pos")),
    "gelu": (ck.gelu, lambda: dict(x=r(6)), dict(x="farr", approximate=("choice", ("tanh", "none")), out="oarr")),
    "gelu_backward": (ck.gelu_backward, lambda: dict(x=r(6), dy=r(6, seed=1)),
                      dict(x="farr", dy="farr", approximate=("choice", ("tanh", "none")), out="oarr")),
    "swiglu": (ck.swiglu, lambda: dict(gate=r(6), up=r(6, seed=1)), dict(gate="farr", up="farr", out="oarr")),
    "swiglu_backward": (ck.swiglu_backward, lambda: dict(gate=r(6), up=r(6, seed=1), dy=r(6, seed=2)),
                        dict(gate="farr", up="farr", dy="farr", out_dgate="oarr", out_dup="oarr")),
    "swiglu_packed": (ck.swiglu_packed, lambda: dict(gu=r(2, 8)), dict(gu="farr", out="oarr", amax="oarr")),
    "swiglu_packed_backward": (ck.swiglu_packed_backward, lambda: dict(gu=r(2, 8), dy=r(2, 4, seed=1)),
                               dict(gu="farr", dy="farr", out="oarr", amax="oarr")),
    "add": (ck.add, lambda: dict(a=r(6), b=r(6, seed=1)), dict(a="farr", b="farr", alpha="real", out="oarr",
                                                                dtype="dtype")),
    "mul": (ck.mul, lambda: dict(a=r(6), b=r(6, seed=1)), dict(a="farr", b="farr", out="oarr", dtype="dtype")),
    "cast": (ck.cast, lambda: dict(x=r(6), dtype=BF16), dict(x="farr", dtype="dtype", out="oarr")),
    "fp8_amax": (ck.fp8_amax, lambda: dict(x=r(2, 16)), dict(x="farr", out="oarr")),
    "fp8_scale": (ck.fp8_scale, lambda: dict(amax=np.array(2.0, F32)),
                  dict(amax="farr", dtype="dtype", margin="nn_int", out="oarr", out_inv="oarr")),
    "fp8_cast": (ck.fp8_cast, lambda: dict(x=r(2, 16), scale=4.0),
                 dict(x="farr", scale="pos", dtype="dtype", transpose="bool", out="oarr", out_t="oarr", amax="oarr")),
    "fp8_quantize": (ck.fp8_quantize, lambda: dict(x=r(2, 16)),
                     dict(x="farr", dtype="dtype", margin="nn_int", transpose="bool", history="oiarr", amax="oarr",
                          out="oarr", out_t="oarr", scale_inv="oarr")),
    "fp8_swiglu_quantize": (ck.fp8_swiglu_quantize,
                            lambda: dict(gu=r(16, 32, dtype=BF16), history=ck.fp8_history(r(16, 16))),
                            dict(gu="farr", history="iarr", dtype="dtype", margin="nn_int", out="oarr",
                                 out_t="oarr", scale_inv="oarr")),
    "fp8_history": (ck.fp8_history, lambda: dict(x=r(2, 16)), dict(x="farr")),
    "fp8_dequantize": (ck.fp8_dequantize, lambda: dict(q=np.zeros(6, np.uint8), scale_inv=0.5,
                                                       q_dtype=ck.float8_e4m3fn),
                       dict(q="farr", scale_inv="nn", q_dtype="dtype", dtype="dtype", out="oarr")),
    "fp8_transpose": (ck.fp8_transpose, lambda: dict(q=np.zeros((2, 16), np.uint8)), dict(q="farr", out="oarr")),
    "Fp8Shadow": (ck.Fp8Shadow, lambda: dict(param=r(64), ranges=[(0, (4, 4))]),
                  dict(param="farr", margin="nn_int", transpose="bool")),
    "Float8Recipe": (ck.Float8Recipe, lambda: dict(),
                     dict(grad_dtype="dtype", scaling=("choice", ("current", "delayed", "hybrid")), margin="nn_int",
                          fast_accum="bool", fast_accum_grad="bool", head_grad_dtype="dtype",
                          head_fp8_dw="bool")),
    "adam_step": (ck.adam_step, _adam, dict(param="farr", grad="farr", exp_avg="farr", exp_avg_sq="farr", lr="nn",
                                            step="pos_int!intfloat", beta1="p1", beta2="p1", eps="pos", weight_decay="nn",
                                            shadow="oarr")),
    "adam_step_rows": (ck.adam_step_rows, _adam_rows,
                       dict(param="farr", grad="farr", exp_avg="farr", exp_avg_sq="farr", rows="iarr", lr="nn",
                            step="pos_int!intfloat", beta1="p1", beta2="p1", eps="pos", weight_decay="nn", shadow="oarr")),
    "zero_rows": (ck.zero_rows, lambda: dict(buf=r(4, 3), rows=i32(0, 2), row_count=np.array(2, np.int32)),
                  dict(buf="farr", rows="iarr")),
    "global_norm": (ck.global_norm, lambda: dict(arrays=[r(6), r(3, seed=1)]), dict(out="oarr")),
    "clip_scale": (ck.clip_scale, lambda: dict(norm=np.array(2.0, F32), max_norm=1.0),
                   dict(norm="farr", max_norm="pos", out="oarr")),
    "dropout": (ck.dropout, lambda: dict(x=r(8), p=0.1, seed=1), dict(x="farr", p="p1", seed="seed",
                                                                     offset="seed", out="oarr", dtype="dtype")),
    "dropout_backward": (ck.dropout_backward, lambda: dict(dy=r(8), p=0.1, seed=1),
                         dict(dy="farr", p="p1", seed="seed", offset="seed", out="oarr", dtype="dtype")),
    "dropout_add": (ck.dropout_add, lambda: dict(x=r(8), residual=r(8, seed=1), p=0.1, seed=1),
                    dict(x="farr", residual="farr", p="p1", seed="seed", offset="seed", out="oarr",
                         dtype="dtype")),
    "flash_attention": (ck.flash_attention, _attn, dict(q="farr", k="farr", v="farr", causal="bool", scale="pos!None",
                                                        window="pos_int!None", out="oarr", return_lse="bool")),
    "flash_attention_backward": (ck.flash_attention_backward, _attn_bwd,
                                 dict(dout="farr", q="farr", k="farr", v="farr", out="farr", lse="farr",
                                      causal="bool", scale="pos!None", window="pos_int!None")),
    "decode_attention": (ck.decode_attention, _dec, dict(q="farr", k_cache="farr", v_cache="farr",
                                                         cache_len="nn_int", scale="pos!None", out="oarr",
                                                         num_splits="pos_int!None", window="pos_int!None")),
    "kv_cache_write": (ck.kv_cache_write, lambda: dict(new=r(1, 1, 2, 4), cache=f(1, 8, 2, 4), cache_len=1),
                       dict(new="farr", cache="farr!int", cache_len="nn_int")),
    "rope_kv_write": (ck.rope_kv_write, _rope_kv,
                      dict(qkv="farr", n_heads="pos_int", n_kv_heads="pos_int", k_cache="farr", v_cache="farr",
                           cache_len="nn_int", positions="oiarr", q_out="oarr")),
    "decode_attention_rope": (ck.decode_attention_rope, _rope_kv,
                              dict(qkv="farr", n_heads="pos_int", n_kv_heads="pos_int", k_cache="farr",
                                   v_cache="farr", cache_len="nn_int", scale="pos!None", positions="oiarr",
                                   out="oarr", num_splits="pos_int!None", window="pos_int!None")),
    "gemv": (ck.gemv, lambda: dict(x=r(2, 8), weight=r(4, 8, seed=1)),
             dict(x="farr", weight="farr", bias="oarr", eps="pos", residual="oarr", out="oarr",
                  act=("choice", (None, "gelu", "swiglu")))),
    "sample_tokens": (ck.sample_tokens, lambda: dict(logits=r(2, 10)),
                      dict(logits="farr", temperature="real", top_k="nn_int!big", top_p="prob", seed="seed",
                           offset="seed", repetition_penalty="pos", prev_tokens="oiarr")),
    "matmul": (ck.matmul, lambda: dict(a=r(2, 3), b=r(3, 4, seed=1)),
               dict(a="farr!f64", b="farr!f64", trans_a="bool", trans_b="bool", alpha="real", beta="real",
                    out="oarr!f64", out_dtype="dtype!f64", allow_tf32="bool")),
    # ---------------------------------------------------------------------------------------------- autograd
    "tensor": (ck.tensor, lambda: dict(data=[1.0, 2.0]), dict(requires_grad="bool")),
    # ---------------------------------------------------------------------------------------------- layers
    "nn.Linear": (nn.Linear, lambda: dict(in_features=4, out_features=3),
                  dict(in_features="pos_int", out_features="pos_int", bias="bool", std="nn", dtype="dtype!f64")),
    "nn.Embedding": (nn.Embedding, lambda: dict(num_embeddings=4, dim=3),
                     dict(num_embeddings="pos_int", dim="pos_int", sparse="bool", std="nn", dtype="dtype!f64")),
    "nn.RMSNorm": (nn.RMSNorm, lambda: dict(dim=4), dict(dim="pos_int", eps="pos", dtype="dtype!f64")),
    "nn.LayerNorm": (nn.LayerNorm, lambda: dict(dim=4), dict(dim="pos_int", eps="pos", dtype="dtype!f64")),
    "nn.SwiGLUMLP": (nn.SwiGLUMLP, lambda: dict(hidden=4, ffn=8),
                     dict(hidden="pos_int", ffn="pos_int", bias="bool", std="nn", dtype="dtype!f64")),
    "nn.Attention": (nn.Attention, lambda: dict(hidden=8, n_heads=2),
                     dict(hidden="pos_int", n_heads="pos_int", n_kv_heads="pos_int!None", head_dim="pos_int!None",
                          bias="bool", rope="bool", causal="bool", std="nn", dtype="dtype!f64")),
    "nn.Dropout": (nn.Dropout, lambda: dict(p=0.1, site=1), dict(p="p1", site="nn_int")),
    "nn.DropoutRNG": (nn.DropoutRNG, lambda: dict(seed=1), dict(seed="nn_int!big")),
    # ---------------------------------------------------------------------------------------------- optim
    "optim.AdamW": (optim.AdamW, lambda: dict(params=_params()),
                    dict(lr="nn", eps="pos", weight_decay="nn", grad_dtype="dtype")),
    "optim.CompositeAdamW": (optim.CompositeAdamW, lambda: dict(params=[nn.Parameter(f(4, 4), name="w")]),
                             dict(lr="nn", eps="pos", weight_decay="nn")),
    "optim.WarmupCosine": (optim.WarmupCosine, lambda: dict(max_lr=1e-3, total_steps=100, warmup_steps=10),
                           dict(max_lr="nn", total_steps="nn_int", warmup_steps="nn_int", min_lr="nn")),
    # ---------------------------------------------------------------------------------------------- models
    "LlamaConfig": (ck.LlamaConfig, lambda: dict(vocab_size=16, hidden_size=16, intermediate_size=32,
                                                 num_hidden_layers=1, num_attention_heads=2,
                                                 max_position_embeddings=32),
                    dict(vocab_size="pos_int", hidden_size="pos_int", intermediate_size="pos_int",
                         num_hidden_layers="pos_int", num_attention_heads="pos_int", num_key_value_heads="pos_int!None",
                         head_dim="pos_int!None", rms_norm_eps="pos", rope_theta="pos", tie_word_embeddings="bool",
                         max_position_embeddings="pos_int", initializer_range="nn")),
    "Qwen2Config": (ck.Qwen2Config, lambda: dict(_LLAMA_SMALL, use_sliding_window=True, sliding_window=4,
                                                 max_window_layers=1),
                    dict(_LLAMA_KINDS, use_sliding_window="bool", sliding_window="pos_int", max_window_layers="nn_int")),
    "Qwen3Config": (ck.Qwen3Config, lambda: dict(_LLAMA_SMALL, head_dim=8, use_sliding_window=True, sliding_window=4,
                                                 max_window_layers=1),
                    dict(_LLAMA_KINDS, use_sliding_window="bool", sliding_window="pos_int", max_window_layers="nn_int",
                         attention_bias="bool")),
    "MistralConfig": (ck.MistralConfig, lambda: dict(_LLAMA_SMALL, sliding_window=4),
                      dict(_LLAMA_KINDS, sliding_window="pos_int")),
    "GPT2Config": (ck.GPT2Config, lambda: dict(vocab_size=16, n_positions=32, n_embd=16, n_layer=1, n_head=2),
                   dict(vocab_size="pos_int", n_positions="pos_int", n_embd="pos_int", n_layer="pos_int",
                        n_head="pos_int", n_inner="pos_int!None", resid_pdrop="p1", embd_pdrop="p1", attn_pdrop="p1",
                        layer_norm_epsilon="pos", initializer_range="nn", tie_word_embeddings="bool",
                        activation_function=("choice", ("gelu_new", "gelu")))),
    # ---------------------------------------------------------------------------------------------- io
    "checkpoint.save": (C.save, lambda: dict(path=_file("a.ckpt"), arrays={"w": f(2, 3)}, meta={"step": 1}),
                        dict(path="path", arrays="amap", meta="meta")),
    "safetensors.write": (S.write, lambda: dict(path=_file("a.safetensors"), arrays={"w": f(2, 3)},
                                                metadata={"format": "pt"}),
                          dict(path="path", arrays="amap", metadata="smeta")),
    # ---------------------------------------------------------------------------------------------- generation
    "generate": (ck.generate, lambda: dict(model=model(), ids=[1, 2, 3], max_new_tokens=2, temperature=0),
                 dict(ids="iarr", max_new_tokens="nn_int", temperature="real!None", top_k="nn_int!big!None",
                      seed="seed!None", use_cache="bool", eos_token_id="nn_int!None", static="bool!None",
                      graph="bool", autocast="dtype!None", attention_mask="oiarr")),
}
