"""Text generation: sampling with a KV cache, and loading a model from any checkpoint we write or read.

:func:`generate` runs the prompt once through the model with a :class:`cukernels.nn.KVCache` (the prefill;
only the last position goes through the output projection), then one token per forward: each new token's
keys and values are appended to the cache and its query attends to the cached prefix, so nothing before it
is recomputed. ``use_cache=False`` recomputes the whole sequence every token (the reference the KV-cache path
is tested against). The next token is drawn on the host from the last position's logits (one [B, V] read per
token, needed anyway to print it) with a NumPy ``Generator``: the same seed gives the same samples on the CPU
and the GPU for the same logits. ``temperature <= 0`` is greedy (argmax).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .amp import autocast as _autocast
from .autograd import Tensor, no_grad
from .io import checkpoint as C
from .io import hf_folder
from .models import CausalLM, from_pretrained, model_class
from .nn import init_context


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _model_xp(model):
    return model.parameters()[0].xp


def sample(logits, *, temperature=1.0, top_k=None, rng=None):
    """Next token ids [B] (int64) from logits [B, V] (host or device): greedy when ``temperature <= 0``,
    else a draw from ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits."""
    lg = _host(logits).astype(np.float64)
    if lg.ndim != 2:
        raise ValueError(f"logits: expected [B, V]; got shape {lg.shape}")
    if temperature is None or temperature <= 0:
        return lg.argmax(axis=-1)
    rng = rng if rng is not None else np.random.default_rng()
    lg = lg / float(temperature)
    if top_k is not None and 0 < top_k < lg.shape[-1]:
        kth = np.partition(lg, -top_k, axis=-1)[:, -top_k][:, None]
        lg = np.where(lg < kth, -np.inf, lg)
    lg = lg - lg.max(axis=-1, keepdims=True)
    p = np.exp(lg)
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(lg.shape[0]) * cdf[:, -1]
    out = np.array([np.searchsorted(cdf[b], u[b], side="right") for b in range(lg.shape[0])])
    return np.minimum(out, lg.shape[-1] - 1)


def generate(model, ids, max_new_tokens, *, temperature=1.0, top_k=None, seed=None, rng=None, use_cache=True,
             eos_token_id=None, autocast=None, on_token=None):
    """Continue ``ids`` ([B, T] or [T] ints, host or device) by ``max_new_tokens`` tokens.

    Args:
        model: any registered model (``ck.Llama``, ...), on NumPy or CuPy (the ids are moved to its device).
        temperature, top_k: sampling (``temperature <= 0``: greedy).
        seed / rng: a NumPy ``Generator`` seed, or the generator itself.
        use_cache: True (KV cache) or False (recompute the whole sequence every token; for testing).
        eos_token_id: stop once every row has produced it.
        autocast: None or ``ck.bfloat16`` (bf16 GEMMs).
        on_token: called with the new ids [B] (NumPy) after each token (streaming output).

    Returns:
        NumPy int64 [B, T + n] (or [T + n] for a 1-D prompt): the prompt followed by the n <= max_new_tokens
        generated tokens.
    """
    prompt = _host(ids).astype(np.int64)
    one_d = prompt.ndim == 1
    prompt = prompt[None] if one_d else prompt
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"ids: expected a non-empty [B, T] or [T] prompt; got shape {_host(ids).shape}")
    V = model.config.vocab_size
    if prompt.min() < 0 or prompt.max() >= V:
        raise ValueError(f"ids: token ids must lie in [0, {V}); got [{prompt.min()}, {prompt.max()}]")
    rng = rng if rng is not None else np.random.default_rng(seed)
    xp = _model_xp(model)
    was_training = model.training
    model.eval()
    out = [prompt]
    done = np.zeros(prompt.shape[0], dtype=bool)
    try:
        with no_grad(), _autocast(autocast, enabled=autocast is not None):
            if use_cache:
                cache = model.new_kv_cache(prompt.shape[1] + max_new_tokens)
                logits = model(xp.asarray(prompt.astype(np.int32)), kv_cache=cache)
            for i in range(max_new_tokens):
                if not use_cache:
                    seq = np.concatenate(out, axis=1).astype(np.int32)
                    logits = model(xp.asarray(seq))
                last = (logits.data if isinstance(logits, Tensor) else logits)[:, -1, :]
                nxt = sample(last, temperature=temperature, top_k=top_k, rng=rng).astype(np.int64)
                out.append(nxt[:, None])
                if on_token is not None:
                    on_token(nxt)
                if eos_token_id is not None:
                    done |= nxt == eos_token_id
                    if done.all():
                        break
                if use_cache and i + 1 < max_new_tokens:
                    logits = model(xp.asarray(nxt[:, None].astype(np.int32)), kv_cache=cache)
    finally:
        model.train(was_training)
    res = np.concatenate(out, axis=1)
    return res[0] if one_d else res


def load_model(path, *, xp=np, fused=True, dtype=None):
    """A model from a Hugging Face folder (``config.json`` + safetensors; the class from its ``model_type``), a
    trainer checkpoint file (``step_*.ckpt``), or a folder holding trainer checkpoints (its newest, also looked
    for in ``<folder>/checkpoints``). ``dtype=ck.bfloat16`` loads inference weights (no fp32 copy). Returns
    ``(model, source description)``."""
    p = Path(path)
    if hf_folder.is_hf_folder(p):
        return from_pretrained(p, xp=xp, fused=fused, dtype=dtype), f"Hugging Face folder {p}"
    if p.is_dir():
        found = C.latest(p) or C.latest(p / "checkpoints")
        if found is None:
            raise C.CheckpointError(f"{p}: neither a Hugging Face folder (config.json) nor a folder with "
                                    f"step_*.ckpt checkpoints")
        p = found
    arrays, meta = C.read_training(p)
    cls = model_class(meta["model_type"])
    config = cls.config_class.from_dict(meta["model_config"], strict=False)
    with init_context(empty=True, dtype=dtype):
        model = cls(config, xp=xp, fused=fused)
    sd = C.model_arrays(arrays)
    C.check_compatible(p, {k: _Like(a.shape) for k, a in sd.items()},
                       {k: _Like(a.shape) for k, a in model.state_dict().items()}, "model")
    model.load_state_dict(sd)
    return model, f"trainer checkpoint {p} (step {meta.get('step')})"


class _Like:
    dtype = np.dtype(np.float32)  # names and shapes are checked; the dtype converts on load

    def __init__(self, shape):
        self.shape = tuple(shape)


def _generate_method(self, ids, max_new_tokens, **kw):
    """Sample continuations of ``ids`` [B, T] (int): see :func:`cukernels.generation.generate`."""
    return generate(self, ids, max_new_tokens, **kw)


CausalLM.generate = _generate_method  # every registered model gets model.generate (models sit below generation)

__all__ = ["generate", "sample", "load_model"]
