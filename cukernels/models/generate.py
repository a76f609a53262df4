"""Text generation for every model class: :class:`GenerationMixin` gives ``model.generate`` (``CausalLM`` inherits
it, as transformers' models inherit theirs), :func:`generate` is the same as a function (``ck.generate``,
``cukernels.generation.generate``). Here, in the models layer, so that the method is the class's own and the engine
imports nothing from the layers above it (``cukernels.generation`` re-exports it and loads models from files).

:func:`generate` runs the prompt once through the model with a :class:`cukernels.nn.KVCache` (the prefill;
only the last position goes through the output projection), then one token per forward: each new token's
keys and values are appended to the cache and its query attends to the cached prefix, so nothing before it
is recomputed. ``use_cache=False`` recomputes the whole sequence every token (the reference the KV-cache path
is tested against). The next token is drawn on the host from the last position's logits (one [B, V] read per
token, needed anyway to print it) with a NumPy ``Generator``: the same seed gives the same samples on the CPU
and the GPU for the same logits. ``temperature <= 0`` is greedy (argmax). The static engine (bf16 on the GPU)
samples on the device and replays a captured decode step.
"""
from __future__ import annotations

import time

import numpy as np

from .. import _backend as B
from .._backend import bfloat16
from ..amp import autocast as _autocast
from ..autograd import Tensor, no_grad
from ..graph import CapturedStep
from ..nn import Attention
from ..ops import _launch
from ..ops.decode_attention import HEAD_DIMS as DECODE_HEAD_DIMS
from ..ops.decode_attention import kv_cache_write
from ..ops.sampling import sample_tokens, sample_workspace

__all__ = ["GenerationMixin", "generate", "sample"]


class GenerationMixin:
    """``model.generate(ids, max_new_tokens, **kw)``: every registered model class has it (``CausalLM`` inherits
    this mixin); the arguments and the engines are :func:`generate`'s."""

    def generate(self, ids, max_new_tokens, **kw):
        """Continue ``ids`` ([B, T] or [T] ints) by ``max_new_tokens`` tokens: :func:`generate` with this model
        (``ck.generate(model, ids, max_new_tokens, **kw)``)."""
        return generate(self, ids, max_new_tokens, **kw)


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _model_xp(model):
    return model.parameters()[0].xp


def sample(logits, *, temperature=1.0, top_k=None, rng=None):
    """Next token ids [B] (int64) from logits [B, V] (host or device): greedy when ``temperature <= 0``,
    else a draw from ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits."""
    B.check_array("logits", logits)
    lg = _host(logits).astype(np.float64)
    if lg.ndim != 2:
        raise ValueError(f"logits: expected [B, V]; got shape {lg.shape}")
    temperature = _check_temperature(temperature)
    top_k = _check_top_k(top_k)
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng: expected a numpy.random.Generator or None; got {B._got(rng)}")
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


def _check_temperature(t):
    """None or a finite real number (<= 0: greedy). A NaN temperature sampled garbage tokens."""
    return None if t is None else B.check_real("temperature", t)


def _check_top_k(k):
    """None or an integer >= 0 (0 and None: no top-k). A negative one was silently treated as off."""
    return None if k is None else B.check_int("top_k", k, min=0)


def _check_eos(eos, V):
    """``eos_token_id``: None, an int in [0, V), or a non-empty list / tuple of them -> None or a list of ints."""
    if eos is None:
        return None
    items = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    if not items:
        raise ValueError("eos_token_id: expected an int or a non-empty list of ints; got an empty list")
    out = []
    for i, e in enumerate(items):
        name = "eos_token_id" if not isinstance(eos, (list, tuple)) else f"eos_token_id[{i}]"
        if isinstance(e, (bool, np.bool_)) or not isinstance(e, (int, np.integer)):
            raise TypeError(f"{name}: expected an int token id or a list of them; got {B._got(e)}")
        out.append(B.check_int(name, e, min=0, max=V - 1))
    return out


def _check_generate_args(model, ids, max_new_tokens, temperature, top_k, top_p, repetition_penalty, seed, rng,
                         use_cache, eos_token_id, autocast, on_token, attention_mask, static, graph, stats):
    """Every argument of :func:`generate`, checked before anything runs (TypeError / ValueError naming it).
    Returns ``(prompt int64 [B, T], one_d, mask or None, eos list or None, autocast dtype or None)``."""
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"model: expected a cukernels model (ck.Llama, ck.GPT2, ...); got {B._got(model)}")
    V = model.config.vocab_size
    if isinstance(ids, Tensor):
        ids = ids.data
    if isinstance(ids, (list, tuple)) or np.isscalar(ids):
        ids = np.asarray(ids)
    if B._kind(ids) is None:
        raise TypeError(f"ids: expected integer token ids (a list, NumPy or CuPy array); got {B._got(ids)}")
    host = _host(ids)
    B.check_token_ids("ids", host, V)  # (every integer dtype, checked before any cast: no wrap-around)
    prompt = host.astype(np.int64)
    one_d = prompt.ndim == 1
    prompt = prompt[None] if one_d else prompt
    if prompt.ndim != 2 or prompt.shape[1] == 0 or prompt.shape[0] == 0:
        raise ValueError(f"ids: expected a non-empty [B, T] or [T] prompt; got shape {host.shape}")
    n = B.check_int("max_new_tokens", max_new_tokens, min=0)
    P = model.max_positions()
    if prompt.shape[1] + n > P:
        raise ValueError(f"max_new_tokens: the prompt's {prompt.shape[1]} tokens + {n} new ones exceed "
                         f"max_position_embeddings = {P} of this model")
    _check_temperature(temperature)
    _check_top_k(top_k)
    if top_p is not None:
        B.check_real("top_p", top_p, min=0, min_open=True, max=1)
    if repetition_penalty is not None:
        B.check_real("repetition_penalty", repetition_penalty, min=0, min_open=True)
    if seed is not None:
        B.check_int("seed", seed, min=0, max=2**64 - 1)
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng: expected a numpy.random.Generator or None; got {B._got(rng)}")
    B.check_bool("use_cache", use_cache)
    B.check_bool("graph", graph)
    if static is not None:
        B.check_bool("static", static)
    eos = _check_eos(eos_token_id, V)
    ac = None if autocast is None else B.check_dtype_arg("autocast", autocast, (bfloat16,))
    if on_token is not None:
        B.check_callable("on_token", on_token, "a callable taking the new ids [B]")
    if stats is not None and not isinstance(stats, dict):
        raise TypeError(f"stats: expected a dict (it receives the timings) or None; got {B._got(stats)}")
    mask = None
    if attention_mask is not None:
        if isinstance(attention_mask, (list, tuple)):
            attention_mask = np.asarray(attention_mask)
        B.check_array("attention_mask", attention_mask)
        m = _host(attention_mask)
        if m.dtype.kind not in "biuf" and m.dtype != bfloat16:
            raise TypeError(f"attention_mask: expected 0 / 1 values (bool, integer or float); got dtype {m.dtype}")
        if m.shape != host.shape:
            raise ValueError(f"attention_mask: expected the shape of ids {tuple(host.shape)}; got {tuple(m.shape)}")
        mask = m.reshape(prompt.shape) != 0
        if not mask[:, -1].all() or (np.diff(mask.astype(np.int8), axis=1) < 0).any():
            raise ValueError("attention_mask: expected left padding (each row's zeros first, then ones)")
    on_gpu = _model_xp(model) is not np
    if static and not on_gpu:
        raise ValueError("static: the static engine runs on the GPU (a model on CuPy); this model is on NumPy: "
                         "pass static=None or False")
    if static and not use_cache:
        raise ValueError("static: the static engine is a KV cache engine; it cannot run with use_cache=False")
    return prompt, one_d, mask, eos, ac


def _static_default(model, use_cache, on_gpu, autocast) -> bool:
    """Whether generate() takes the static engine by default: a cache, the GPU, bf16 weights or bf16 autocast, and
    every attention's head_dim one that ck.decode_attention takes (32, 64, 128; others decode on the dynamic
    engine, which takes any)."""
    bf16 = model.parameters()[0].dtype == bfloat16 or (autocast is not None and np.dtype(autocast) == bfloat16)
    return bool(use_cache and on_gpu and bf16
                and all(m.D in DECODE_HEAD_DIMS for m in model.modules() if isinstance(m, Attention)))


def generate(model, ids, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None, repetition_penalty=None,
             seed=None, rng=None, use_cache=True, eos_token_id=None, autocast=None, on_token=None,
             attention_mask=None, static=None, graph=True, stats=None):
    """Continue ``ids`` ([B, T] or [T] ints, host or device) by ``max_new_tokens`` tokens.

    Two engines:

    * **static** (default for a model on the GPU with bf16 weights, ``from_pretrained(..., dtype=ck.bfloat16)``,
      or under bf16 autocast, whose attention head_dim is 32, 64 or 128): a preallocated
      :class:`cukernels.nn.StaticKVCache`, the prompt once through the fused attention (prefill), then one decode
      step per token -- projections, ``ck.kv_cache_write`` at the device length, ``ck.decode_attention``
      (split-KV), the head and ``ck.sample_tokens`` on the device -- captured as one CUDA graph (``graph=True``)
      and replayed per token. The host reads the tokens back at the end (or every token when ``on_token`` streams
      them). Samples are reproducible by ``seed`` (Philox on the device: the same seed, prompt and weights give
      the same tokens).
    * **dynamic**: a growing :class:`cukernels.nn.KVCache` (or ``use_cache=False``: recompute everything, the
      reference), logits read to the host and sampled there with a NumPy ``Generator`` (``seed`` / ``rng``);
      works on NumPy and CuPy, any dtype.

    Args:
        model: any registered model (``ck.Llama``, ``ck.GPT2``, ...), on NumPy or CuPy.
        temperature, top_k, top_p, repetition_penalty: sampling (``temperature`` a finite number, ``<= 0`` or
            None: greedy; ``top_k`` an int >= 0, 0 or None: off; top_p in (0, 1] and the repetition penalty > 0
            on the static engine only). Every argument is checked before anything runs (TypeError / ValueError
            naming it).
        seed / rng: the sampling seed (a NumPy ``Generator`` on the dynamic engine).
        max_new_tokens: an integer >= 0; the prompt and the new tokens must fit max_position_embeddings.
        eos_token_id: an int or a list of ints: a row that produced one stops (its later tokens are the first
            eos id); the run stops when all have.
        autocast: None or ``ck.bfloat16`` (bf16 GEMMs).
        on_token: called with the new ids [B] (NumPy) after each token (streaming output).
        attention_mask: [B, T] for a batch of prompts of different lengths, left-padded (0 = padding): each row
            then gets the tokens it would get alone.
        static: force (True) or refuse (False) the static engine; default: as above.
        graph: capture the static engine's decode step as a CUDA graph.
        stats: an optional dict that receives timings (``prefill_s``, ``decode_s``, ``new_tokens``).

    Returns:
        NumPy int64 [B, T + n] (or [T + n] for a 1-D prompt): the prompt followed by the n <= max_new_tokens
        generated tokens.
    """
    prompt, one_d, mask, eos_token_id, autocast = _check_generate_args(
        model, ids, max_new_tokens, temperature, top_k, top_p, repetition_penalty, seed, rng, use_cache,
        eos_token_id, autocast, on_token, attention_mask, static, graph, stats)
    max_new_tokens = int(max_new_tokens)
    xp = _model_xp(model)
    if static is None:
        static = _static_default(model, use_cache, xp is not np, autocast)
    if (top_p is not None or repetition_penalty is not None) and not static:
        raise ValueError("top_p, repetition_penalty: sampled on the device by the static engine (a model on the GPU "
                         "with bf16 weights or bf16 autocast, use_cache=True)")
    was_training = model.training
    model.eval()
    stats = stats if stats is not None else {}
    try:
        with no_grad(), _autocast(autocast, enabled=autocast is not None):
            if static:
                res = _generate_static(model, prompt, mask, max_new_tokens, temperature, top_k, top_p,
                                       repetition_penalty, seed, eos_token_id, on_token, graph, stats)
            else:
                res = _generate_dynamic(model, prompt, mask, max_new_tokens, temperature, top_k,
                                        rng if rng is not None else np.random.default_rng(seed), use_cache,
                                        eos_token_id, on_token, stats)
    finally:
        model.train(was_training)
    return res[0] if one_d else res


def _positions(mask):
    """Position of every prompt token: 0.. from each row's first real token (left padding)."""
    return np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int32)


def _generate_dynamic(model, prompt, mask, max_new_tokens, temperature, top_k, rng, use_cache, eos, on_token,
                      stats):
    xp = _model_xp(model)
    out = [prompt]
    done = np.zeros(prompt.shape[0], dtype=bool)
    Bsz, T0 = prompt.shape
    kw = {}
    if mask is not None:
        full_mask = mask.copy()
        pos = _positions(mask)
        kw = dict(attention_mask=xp.asarray(full_mask), position_ids=xp.asarray(pos))
    t0 = time.perf_counter()
    if use_cache:
        cache = model.new_kv_cache(T0 + max_new_tokens)
        logits = model(xp.asarray(prompt.astype(np.int32)), kv_cache=cache, **kw)
    for i in range(max_new_tokens):
        if not use_cache:
            seq = np.concatenate(out, axis=1).astype(np.int32)
            logits = model(xp.asarray(seq), **kw)
        last = (logits.data if isinstance(logits, Tensor) else logits)[:, -1, :]
        if i == 0:
            stats["prefill_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
        nxt = sample(last, temperature=temperature, top_k=top_k, rng=rng).astype(np.int64)
        if eos is not None:  # (a list of ids: a finished row repeats the first)
            nxt = np.where(done, eos[0], nxt)
        out.append(nxt[:, None])
        if on_token is not None:
            on_token(nxt)
        if eos is not None:
            done |= np.isin(nxt, eos)
            if done.all():
                break
        if mask is not None:
            full_mask = np.concatenate([full_mask, np.ones((Bsz, 1), bool)], axis=1)
            pos = pos[:, -1:] + 1
            kw = dict(attention_mask=xp.asarray(full_mask),
                      position_ids=xp.asarray(pos if use_cache else _positions(full_mask)))
        if use_cache and i + 1 < max_new_tokens:
            logits = model(xp.asarray(nxt[:, None].astype(np.int32)), kv_cache=cache, **kw)
    stats["decode_s"] = time.perf_counter() - t0
    res = np.concatenate(out, axis=1)
    stats["new_tokens"] = res.shape[1] - T0
    return res


def _generate_static(model, prompt, mask, max_new_tokens, temperature, top_k, top_p, repetition_penalty, seed,
                     eos, on_token, graph, stats):
    """The static-cache engine (see :func:`generate`): prefill eagerly, then a decode step captured once and
    replayed per token. Every buffer the step reads or writes is allocated here, before the capture."""
    import cupy as cp

    Bsz, T0 = prompt.shape
    L = T0 + max_new_tokens
    cache = model.new_static_cache(Bsz, L, dtype=bfloat16)  # bf16 weights, or bf16 activations under autocast
    mask = np.ones((Bsz, T0), bool) if mask is None else mask
    cache.key_mask[:, :T0] = cp.asarray(mask)
    pos0 = _positions(mask)
    tokens = cp.zeros((Bsz, L), dtype=np.int32)  # the prompt, then every sampled token (repetition penalty)
    tokens[:, :T0] = cp.asarray(prompt.astype(np.int32))
    ids = cp.zeros((Bsz, 1), dtype=np.int32)      # the token fed to the next decode step
    pos = cp.asarray(pos0[:, -1:] + 1)            # its position, per row
    offset = cp.zeros((), dtype=np.uint64)        # the sampler's Philox offset, one per token
    done = cp.zeros((Bsz,), dtype=np.bool_)
    workspace = sample_workspace()                # greedy's per-row partials and counters (left at 0 by each step)
    # eos: one id as a 0-d device int (as before), several as a [k] device array compared row by row
    eos_arr = None if eos is None else cp.asarray(np.int32(eos[0]) if len(eos) == 1 else np.array(eos, np.int32))
    skw = dict(temperature=float(temperature or 0.0), top_k=int(top_k or 0), top_p=1.0 if top_p is None else
               float(top_p), repetition_penalty=1.0 if repetition_penalty is None else float(repetition_penalty),
               prev_tokens=tokens if repetition_penalty not in (None, 1.0) else None,
               prev_len=cache.length if repetition_penalty not in (None, 1.0) else None,
               seed=(int(seed) if seed is not None else int(np.random.default_rng().integers(1 << 63)))
               & ((1 << 64) - 1),  # (no seed: a fresh one per call, as the host sampler's default Generator)
               workspace=workspace)

    def pick(logits):
        """Sample into ``ids``, hold finished rows at eos, append to ``tokens`` at the cache length."""
        with _launch.pdl_scope():  # (sample_tokens reads nothing before its pdl_wait(): no promise to keep)
            sample_tokens(logits.data.reshape(Bsz, -1), offset=offset, out=ids.reshape(-1), **skw)
        offset[...] += 1
        if eos_arr is not None and eos_arr.ndim == 0:
            cp.copyto(ids.reshape(-1), eos_arr, where=done)
            cp.logical_or(done, ids.reshape(-1) == eos_arr, out=done)
        elif eos_arr is not None:  # several eos ids: elementwise + a row reduction (capturable, no host read)
            cp.copyto(ids.reshape(-1), eos_arr[0], where=done)
            cp.logical_or(done, (ids.reshape(-1, 1) == eos_arr[None, :]).any(axis=1), out=done)

    def step():
        cache.length[...] += 1  # the position the fed token takes (device)
        kv_cache_write(ids, tokens, cache.length)  # (the token becomes history for the repetition penalty)
        logits = model(ids, position_ids=pos, kv_cache=cache)
        pos[...] += 1
        pick(logits)
        return ids

    if max_new_tokens < 1:
        return prompt
    t0 = time.perf_counter()
    logits = model(cp.asarray(prompt.astype(np.int32)), attention_mask=cp.asarray(mask),
                   position_ids=cp.asarray(pos0), kv_cache=cache)
    pick(logits)
    cp.cuda.get_current_stream().synchronize()
    stats["prefill_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    runner = CapturedStep(step, warmup=1, graph=graph)
    made = 1  # tokens sampled so far; the newest is in ids, not yet in tokens
    while True:
        if on_token is not None:
            on_token(ids.reshape(-1).get().astype(np.int64))
        if made == max_new_tokens or (eos is not None and (on_token is not None or made % 16 == 0)
                                      and bool(done.all())):
            break
        runner()
        made += 1
    cache.length[...] += 1
    kv_cache_write(ids, tokens, cache.length)  # the newest token
    res = tokens[:, :T0 + made].get().astype(np.int64)
    stats["decode_s"] = time.perf_counter() - t0
    stats["new_tokens"] = made
    return res
