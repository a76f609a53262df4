"""What every causal language model here shares: the config base, the input handling of ``forward``, the output
head (tied or not), the loss, the KV cache, Hugging Face import/export through the model's name map, and the
registry keyed by Hugging Face's ``model_type``.

A model family is one file: a :class:`ModelConfig` dataclass (Hugging Face field names), a :class:`CausalLM`
subclass that builds its modules under Hugging Face's parameter names and defines ``embed`` (ids -> hidden
states), ``layers`` (the blocks, each called as ``block(x, **attention_kwargs)``), ``final_norm`` and
``output_weight``, and ``@register``.
"""
from __future__ import annotations

import dataclasses
import difflib
import numbers

import numpy as np

from .. import _backend as B
from .. import amp
from .. import functional as F
from ..autograd import Tensor, is_grad_enabled, no_grad
from ..io import hf_folder
from ..io import peft as _peft
from ..io.checkpoint import CheckpointError, check_compatible
from ..nn import (Attention, Dropout, KVCache, Module, Residual, StaticKVCache, autocast_input, init_context,
                  project, weight_for_gemm)
from ..nn import decode as _decode
from ..nn import lora as _lora
from ..nn import dropout as _dropout
from ..ops.decode_attention import HEAD_DIMS as DECODE_HEAD_DIMS
from ..ops import _launch
from ..ops.gemv import gemv
from ..settings import settings
from .generate import GenerationMixin

REGISTRY: dict = {}
RECOMPUTE_MODES = ("none", "attention", "full")


def register(cls):
    """Class decorator: make ``cls`` the model of ``cls.model_type`` for ``ck.from_pretrained`` and the trainer."""
    REGISTRY[cls.model_type] = cls
    return cls


def model_class(model_type):
    if model_type not in REGISTRY:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {sorted(REGISTRY)}")
    return REGISTRY[model_type]


def suggest(key, choices):
    m = difflib.get_close_matches(str(key), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {m[0]!r}?)" if m else ""


# ------------------------------------------------------------------------------------------------ config
def check_int(where, name, v, minimum=1, maximum=2**31 - 1):
    """A config size: an integer in [minimum, maximum] (the kernels index sizes in int32), named
    ``<where>.<name>`` (the _backend vocabulary's wording)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{where}.{name}: expected an integer; got {type(v).__name__} {v!r}")
    if v < minimum:
        raise ValueError(f"{where}.{name}: expected an integer >= {minimum}; got {v}")
    if v > maximum:
        raise ValueError(f"{where}.{name}: expected an integer <= {maximum} (sizes are indexed in int32); got {v}")


def check_real(where, name, v, *, positive=True):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{where}.{name}: expected a finite number; got {type(v).__name__} {v!r}")
    if not np.isfinite(float(v)):
        raise ValueError(f"{where}.{name}: expected a finite number; got {v!r}")
    if positive and v <= 0:
        raise ValueError(f"{where}.{name}: expected a number > 0; got {v}")


class ModelConfig:
    """Mixin of the model config dataclasses: ``from_dict`` (unknown keys are errors naming the closest field),
    ``to_dict``, and ``validate`` (called at construction)."""

    model_type = ""

    def __post_init__(self):
        self.validate()

    def validate(self):
        pass

    @classmethod
    def field_names(cls):
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d, *, strict=True, where=None):
        """A config from a dict of field values. ``strict``: an unknown key is a ValueError that names it and
        the closest field (``num_layers`` -> ``num_hidden_layers``); else unknown keys are ignored (config.json
        files carry many)."""
        names = cls.field_names()
        where = where or cls.__name__
        d = {k: v for k, v in dict(d).items() if k not in ("model_type", "type")}
        unknown = [k for k in d if k not in names]
        if strict and unknown:
            k = unknown[0]
            raise ValueError(f"{where}: unknown key {k!r}{suggest(k, names)}; the keys of {cls.__name__} are "
                             f"{', '.join(names)}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self):
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------------ model
class CausalLM(GenerationMixin, Module):
    """Base of the decoder-only language models; ``generate(ids, max_new_tokens, ...)`` is
    :class:`GenerationMixin`'s (``cukernels/models/generate.py``: the static and dynamic engines).

    ``forward(ids, targets=None, *, attention_mask=None, position_ids=None, kv_cache=None, ignore_index=-100)``
    has Hugging Face's meanings: ``attention_mask`` [B, T] (1 = keep, 0 = padding, left or right; with a cache,
    [B, cached + T]) removes padded keys; ``position_ids`` [B, T] (or [T]) default to 0..T-1 after what the cache
    holds. Returns the logits [B, T, V] (with ``kv_cache``: only the last position's, [B, 1, V]), or with
    ``targets`` [B, T] the mean token cross-entropy over targets != ignore_index as a 0-d fp32 device Tensor (the
    logits are not kept: the fused loss writes dlogits over them), or ``(loss, logits)`` with
    ``return_logits=True``. Padded positions should carry ignore_index targets; their logits are finite but
    meaningless.

    Loss path: a fused model (``fused`` on the model and on the head) with ``fused_head_loss`` (default True)
    computes the head and the loss together (``ck.linear_cross_entropy`` through
    ``functional.linear_cross_entropy.LinearCrossEntropyF``: no [B*T, V] logits; the head weight's gradient is written
    into its ``.grad`` during the forward, so back-propagate such a loss, unscaled, or compute it under
    ``no_grad()``); otherwise the head's logits and then the fused cross-entropy in place.

    ids may be anything integer a user holds: a list, NumPy or CuPy, int64 or int32, a slice ``batch[:, :-1]``,
    a 1-D sequence (taken as a batch of one): the model makes the one small contiguous int32 copy itself, on its
    own device. The kernel ops stay strict; this is where convenience lives.
    """

    model_type = ""
    config_class = None
    fused_head_loss = True  # forward(ids, targets): the head and the loss in one chunked op (see above)
    recompute = "none"  # activation recompute per block: set_recompute()
    hf_head = "lm_head.weight"
    hf_ignored_suffixes: tuple = ()

    # -- what each family defines ---------------------------------------------------------------------------
    def embed(self, ids, position_ids):
        raise NotImplementedError

    def layers(self):
        raise NotImplementedError

    def final_norm(self, x):
        raise NotImplementedError

    def output_weight(self):
        """``(module whose fused flag applies, weight [V, hidden], bias or None)`` of the output projection."""
        raise NotImplementedError

    def input_embedding(self):
        """The token :class:`cukernels.nn.Embedding` (sparse-row gradients attach to its weight)."""
        raise NotImplementedError

    def rope_tables(self, n, xp):
        """``(cos, sin)`` covering positions [0, n) for rotary models; ``(None, None)`` otherwise."""
        return None, None

    def max_positions(self):
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @classmethod
    def hf_rename(cls, hf_name) -> str:
        """Our parameter name for a Hugging Face tensor name (identity: our modules carry HF's names)."""
        return hf_name

    @classmethod
    def hf_transposed(cls, name) -> bool:
        """True for parameters stored transposed in Hugging Face files (GPT-2's Conv1D weights)."""
        return False

    # -- inputs -----------------------------------------------------------------------------------------------
    def _as_int(self, name, a, xp, floats=False, **bounds):
        """``a`` (a list, a NumPy / CuPy array, a Tensor) as contiguous int32 on ``xp``, checked before the cast
        (``cukernels._backend.token_ids_int32``: ``bounds`` = vocab_size / low / high / sentinel): int64 or uint64
        ids of 2**32 + 3 are out of range, never id 3. Floats are refused (not truncated), except for masks
        (``floats``: nonzero = keep)."""
        a = a.data if isinstance(a, Tensor) else a
        if isinstance(a, (list, tuple)) or np.isscalar(a):
            a = np.asarray(a)
        kind = B._kind(a)
        if kind is None:
            raise TypeError(f"{name}: expected integer token ids (a list, NumPy or CuPy array); got "
                            f"{type(a).__name__}")
        if floats and (a.dtype.kind == "f" or a.dtype == B.bfloat16):
            a = a != 0
        if a.dtype == np.bool_:
            a = a.view(np.uint8)
        return B.token_ids_int32(name, a, xp, **bounds)

    def _prepare(self, ids, targets, attention_mask, position_ids, kv_cache, ignore_index=-100):
        xp = self.xp
        V = self.config.vocab_size
        # ids >= vocab_size are errors on the host; 64-bit CuPy ids out of range become V (the embedding kernel
        # clamps them and sets ck.embedding_error()), never their low 32 bits.
        ids = self._as_int("ids", ids, xp, vocab_size=V)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2:
            raise ValueError(f"ids: expected [batch, seq] (or [seq]); got shape {tuple(ids.shape)}")
        Bsz, T = ids.shape
        if Bsz == 0 or T == 0:
            raise ValueError(f"ids: expected a non-empty batch of non-empty sequences; got shape {tuple(ids.shape)}")
        static = isinstance(kv_cache, StaticKVCache)
        p0 = kv_cache.pos if isinstance(kv_cache, KVCache) else 0
        if static:
            if position_ids is None:
                raise ValueError("position_ids: a StaticKVCache forward needs the tokens' positions (device "
                                 "[B, T] int32; cukernels.generation makes them)")
            if kv_cache.prefilled and attention_mask is not None:
                raise ValueError("attention_mask: after the prefill a StaticKVCache uses its own key_mask")
        if p0 + T > self.max_positions():
            raise ValueError(f"ids: {p0 + T} positions exceed max_position_embeddings = {self.max_positions()} of "
                             f"this model{self._positions_note()}")
        if targets is not None:
            # Targets may hold ignore_index (negative); their range is the loss's to check. Only values that
            # would wrap in int32 are caught here: on the host an error, on the device a target of V (or V + 1
            # when that is ignore_index), out of range for the loss kernel, which flags it.
            targets = self._as_int("targets", targets, xp, low=B.INT32_MIN, high=B.INT32_MAX + 1,
                                   sentinel=V if ignore_index != V else V + 1)
            if targets.ndim == 1 and Bsz == 1:
                targets = targets[None]
            if tuple(targets.shape) != (Bsz, T):
                raise ValueError(f"targets: expected the shape of ids {(Bsz, T)}; got {tuple(targets.shape)}")
        if attention_mask is not None:
            m = self._as_int("attention_mask", attention_mask, xp, floats=True)
            if m.ndim == 1 and Bsz == 1:
                m = m[None]
            if tuple(m.shape) != (Bsz, p0 + T):
                raise ValueError(f"attention_mask: expected shape {(Bsz, p0 + T)} ([batch, cached + new tokens]); "
                                 f"got {tuple(m.shape)}")
            attention_mask = xp.ascontiguousarray(m != 0)
        if position_ids is not None:
            # Positions index the rope tables: negative ones indexed from the end on the NumPy path (silently)
            position_ids = self._as_int("position_ids", position_ids, xp, high=self.max_positions(),
                                        what="max_position_embeddings")
            if tuple(position_ids.shape) not in ((T,), (Bsz, T)):
                raise ValueError(f"position_ids: expected shape ({T},) or ({Bsz}, {T}); got "
                                 f"{tuple(position_ids.shape)}")
        return ids, targets, attention_mask, position_ids

    def _positions_note(self):
        return ""

    # -- forward ---------------------------------------------------------------------------------------------
    def forward(self, ids, targets=None, *, attention_mask=None, position_ids=None, kv_cache=None,
                ignore_index=-100, return_logits=False):
        ids, targets, attention_mask, position_ids = self._prepare(ids, targets, attention_mask, position_ids,
                                                                    kv_cache, B.check_int("ignore_index", ignore_index))
        if kv_cache is not None:
            with no_grad():
                return self._run(ids, None, attention_mask, position_ids, kv_cache, ignore_index)
        drng = getattr(self, "dropout_rng", None)
        if self.training and drng is not None and (_dropout.current() or (None,))[0] is not drng:
            # LoRA dropout in a family without dropout of its own (apply_lora gave the model a DropoutRNG; GPT-2
            # opens this scope in its own forward): the masks' offset advances once per training forward
            with drng.forward_pass():
                return self._run(ids, targets, attention_mask, position_ids, None, ignore_index, return_logits)
        return self._run(ids, targets, attention_mask, position_ids, None, ignore_index, return_logits)

    def _run(self, ids, targets, attention_mask, position_ids, kv_cache, ignore_index, return_logits=False):
        xp = self.xp
        Bsz, T = ids.shape
        if self._fast_decode_ok(ids, position_ids, kv_cache):
            return self._decode_fast(ids, position_ids, kv_cache)
        p0 = kv_cache.pos if isinstance(kv_cache, KVCache) else 0
        cos, sin = self.rope_tables(self.max_positions() if position_ids is not None else p0 + T, xp)
        x = self.embed(ids, position_ids if position_ids is not None else p0)
        caches = kv_cache.layers if kv_cache is not None else [None] * len(self.layers())
        mode = self.recompute if kv_cache is None and is_grad_enabled() else "none"
        for block, lc in zip(self.layers(), caches):
            kw = dict(cos=cos, sin=sin, position_ids=position_ids, attention_mask=attention_mask, kv_cache=lc)
            x = block(x, **kw) if mode == "none" else _recomputed_block(block, x, kw, mode)
        if isinstance(kv_cache, StaticKVCache) and not kv_cache.prefilled:
            kv_cache.prefilled = True
            kv_cache.length[...] = T  # (the prefill runs eagerly: a host write)
        if kv_cache is not None:  # only the last position's logits are needed to sample
            last = lambda a: F.contiguous(F.getitem(a, (slice(None), slice(T - 1, T))))  # noqa: E731
            x = x.map(last) if isinstance(x, Residual) else last(x)
        x = self.final_norm(x)
        if targets is not None and not return_logits:
            loss = self.head_loss(x, targets, ignore_index)
            if loss is not None:
                return loss
        logits = self.head(x)
        if targets is None:
            return logits
        loss = F.cross_entropy(F.reshape(logits, (Bsz * T, -1)), targets.reshape(-1), ignore_index=ignore_index,
                               fused=self.fused, inplace=not return_logits)
        return (loss, logits) if return_logits else loss

    def set_recompute(self, mode="full"):
        """Activation recompute for the blocks of a forward that records a gradient (a training forward):

        * ``"none"``: every block keeps its activations for the backward (~82 KiB per token per layer at the
          LLaMA-1B shape under bf16 autocast; benchmarks/NOTES.md, "Activation recompute");
        * ``"attention"``: each block's attention sub-block (q/k/v projection, attention, output projection) runs
          without keeping its inner activations (qkv, the attention output, its log-sum-exp: ~10 KiB per token
          per layer at that shape; GPT-2 under attention dropout also the [B, H, T, T] probabilities) and runs
          again in the backward;
        * ``"full"``: each whole block keeps only its input (the pending residual pair, 8 KiB per token per layer)
          and runs its forward again in the backward (about one more forward of the blocks a step).

        Gradients equal those without recompute (the same Functions on the same values; dropout replays its
        masks from the forward's offset; autocast is restored). Forwards under ``no_grad`` and with a KV cache
        are unaffected. Returns the model. See :func:`cukernels.functional.recompute`.

        Example::

            >>> model.set_recompute("full")   # T=16384 at B1: ~2 GiB of activations kept instead of ~21
        """
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute: expected one of {list(RECOMPUTE_MODES)}; got {mode!r}"
                             f"{suggest(mode, RECOMPUTE_MODES) if isinstance(mode, str) else ''}")
        self.recompute = mode
        return self

    # -- the fused decode step ---------------------------------------------------------------------------------
    fast_decode = True  # False: decode through the generic forward (to compare, or to debug)

    def decode_final_norm(self):
        """The final norm module, for the fused decode step's head GEMV prologue (None: no fused decode)."""
        return None

    def _fast_decode_ok(self, ids, position_ids, kv_cache):
        """The fused decode step (:mod:`cukernels.nn.decode`) applies: one new token per row of a prefilled
        static cache, at most ``ck.settings.decode_max_rows`` rows, explicit positions, bf16 inference weights (the
        packing makes parameters views of a packed buffer: never done to training weights an optimizer holds),
        a decode kernel for the head size, no active dropout, and every block and the model define it."""
        if not (self.fast_decode and self.fused and isinstance(kv_cache, StaticKVCache) and kv_cache.prefilled
                and ids.shape[1] == 1 and ids.shape[0] <= settings.decode_max_rows and position_ids is not None
                and self.decode_final_norm() is not None):
            return False
        ok = self.__dict__.get("_fast_decode_checked")
        if ok is None:
            mods = list(self.modules())
            ok = (all(p.dtype == B.bfloat16 for p in self.parameters())
                  and all(hasattr(b, "decode") for b in self.layers())
                  and all(m.D in DECODE_HEAD_DIMS for m in mods if isinstance(m, Attention))
                  and not any(isinstance(m, _lora.LoRALinear) for m in mods))  # (merge_adapter() first)
            self.__dict__["_fast_decode_checked"] = ok
        return ok and not any(isinstance(m, Dropout) and m.active() for m in self.modules())

    def _decode_fast(self, ids, position_ids, cache):
        """Logits [B, 1, V] of one decode step through the fused per-block kernels, arrays only (no tape)."""
        Bsz = ids.shape[0]
        xp = self.xp
        cos, sin = self.rope_tables(self.max_positions(), xp)
        pos = position_ids if position_ids.ndim == 2 else xp.broadcast_to(position_ids, (Bsz, 1))
        x = self.embed(ids, pos)
        x = xp.ascontiguousarray((x.data if isinstance(x, Tensor) else x).reshape(Bsz, -1))  # (fresh: in place)
        _, w, b = self.output_weight()
        # Programmatic dependent launch for the step's kernels (ops/_launch.py): each may start its weight loads
        # while the previous kernel finishes; no kernel here writes a weight (inference weights, no optimizer).
        with _launch.pdl_scope():
            for block, lc in zip(self.layers(), cache.layers):
                block.decode(x, lc, cos=cos, sin=sin, positions=pos)
            logits = gemv(x, w.data, bias=b.data if b is not None else None,
                          **_decode.norm_args(self.decode_final_norm()))
        return Tensor(logits.reshape(Bsz, 1, -1))

    def head_loss(self, x, targets, ignore_index):
        """The head and the mean loss in one op (LinearCrossEntropyF) when the model and its head are fused, the
        head has no bias and the operands suit the op; else None (the caller takes the logits path)."""
        mod, w, b = self.output_weight()
        if not (self.fused_head_loss and self.fused and mod.fused):
            return None
        if not w.requires_grad and is_grad_enabled():
            # A frozen head (LoRA): ck.linear_cross_entropy computes dW whenever it computes dx (4.3 TFLOP and a
            # 1.05 GB fp32 buffer at LLaMA-1B, B8xT1024, dropped); the logits path's GEMMs skip it for the same
            # peak (2.1 GB of bf16 logits against the op's 1 GiB workspace + that buffer). NOTES, "LoRA".
            return None
        x = autocast_input(x)
        wt, wl = weight_for_gemm(mod, w)
        if not F.linear_cross_entropy_ok(x, wt, wl, b):
            return None
        return F.linear_cross_entropy(x, wt, targets, w_lowp=wl, ignore_index=ignore_index,
                                      grad_fp8=_head_grad_fp8(x, wl if wl is not None else wt),
                                      grad_fp8_dw=_head_fp8_dw())

    def head(self, x):
        """The output projection (its own ``lm_head`` or the tied token embedding), autocast like a Linear."""
        mod, w, b = self.output_weight()
        return project(mod, x, w, b, pad_rows=True)  # (logits rows 64-aligned when the vocabulary is not)

    def positions(self, position_ids, T, xp):
        """``position_ids`` as an int32 array [T] or [B, T] (an int offset p0 -> p0..p0+T-1)."""
        if isinstance(position_ids, (int, np.integer)):
            return xp.arange(int(position_ids), int(position_ids) + T, dtype=np.int32)
        return position_ids

    # -- inference --------------------------------------------------------------------------------------------
    def new_static_cache(self, batch, max_len, *, dtype=None):
        """A :class:`cukernels.nn.StaticKVCache` for ``batch`` rows of up to ``max_len`` positions, in the
        parameters' dtype (bf16 inference weights) or ``dtype``."""
        if max_len > self.max_positions():
            raise ValueError(f"max_len: {max_len} positions exceed max_position_embeddings = "
                             f"{self.max_positions()}{self._positions_note()}")
        atts = [m for m in self.modules() if isinstance(m, Attention)]
        a = atts[0]
        dt = dtype or self.parameters()[0].dtype
        return StaticKVCache(len(atts), batch, max_len, a.Hkv, a.D, xp=self.xp, dtype=dt)

    def new_kv_cache(self, max_len):
        """An empty :class:`cukernels.nn.KVCache` for up to ``max_len`` positions (prompt + new tokens)."""
        if max_len > self.max_positions():
            raise ValueError(f"max_len: {max_len} positions exceed max_position_embeddings = "
                             f"{self.max_positions()}{self._positions_note()}")
        return KVCache(len(self.layers()), max_len)

    # -- Hugging Face -------------------------------------------------------------------------------------------
    @classmethod
    def _hf_state(cls, tensors, config, where, expected):
        """Hugging Face tensors (a lazy mapping) -> {our name: lazily converted array}, every name and shape
        checked first (HFFormatError naming ``where`` and what disagrees)."""
        tied = bool(getattr(config, "tie_word_embeddings", False))
        names = {}  # our name -> HF name
        for k in tensors:
            if cls.hf_ignored_suffixes and k.endswith(cls.hf_ignored_suffixes):
                continue
            ours = cls.hf_rename(k)
            if ours == cls.hf_head and tied:
                continue  # tied: the embedding table is the output projection
            names[ours] = k
        shapes = {}
        for ours, k in names.items():
            shape, dt = tensors.info(k) if hasattr(tensors, "info") else (tensors[k].shape, tensors[k].dtype)
            if np.dtype(dt).kind != "f" and np.dtype(dt) != B.bfloat16:
                raise hf_folder.HFFormatError(f"{where}: {k}: dtype {dt}; expected a floating-point tensor")
            shapes[ours] = _Spec(tuple(reversed(shape)) if cls.hf_transposed(ours) else shape)
        try:
            check_compatible(where, shapes, expected, "model", dtypes=False)
        except CheckpointError as e:
            raise hf_folder.HFFormatError(str(e)) from None
        return _Converted(tensors, names, cls.hf_transposed)

    @classmethod
    def from_pretrained(cls, path, *, xp=np, dtype=None, fused=True, adapter=None, **kw):
        """Load a Hugging Face checkpoint folder of this family (``config.json`` + ``model.safetensors`` or a
        sharded index; bf16, fp16 or fp32 tensors). Parameters become float32, or ``dtype`` (``ck.bfloat16`` for
        inference: no fp32 copy is ever made). Every name and shape is checked before anything is copied; the
        tensors are then copied one at a time (host memory stays near one tensor). ``adapter``: a PEFT LoRA folder
        added on top (:meth:`load_adapter`).

        Example::

            >>> model = ck.Llama.from_pretrained("Llama-3.2-1B", xp=cupy, dtype=ck.bfloat16)
        """
        d, where = hf_folder.read_config(path)
        mt = d.get("model_type", cls.model_type)
        if mt != cls.model_type:
            raise hf_folder.HFFormatError(f"{where}: model_type {mt!r}; {cls.__name__} reads {cls.model_type!r} "
                                          f"(ck.from_pretrained picks the class from model_type)")
        config = cls.config_class.from_hf(d, where=where)
        tensors = hf_folder.read_weights(path)
        with init_context(empty=True, dtype=dtype):
            model = cls(config, xp=xp, fused=fused, **kw)
        sd = cls._hf_state(tensors, config, str(hf_folder.weights_path(path)), model.state_dict())
        model.load_state_dict(sd)
        model.__dict__["base_path"] = str(hf_folder.folder_of(path).resolve())  # (an adapter's base_model_name_or_path)
        if adapter is not None:
            model.load_adapter(adapter)
        return model

    def save_pretrained(self, path, *, dtype=np.float32, max_shard_size=None):
        """Write the Hugging Face layout into folder ``path``: ``config.json`` and ``model.safetensors`` (or
        shards of at most ``max_shard_size`` bytes plus the index), tensors in ``dtype`` (float32, ck.bfloat16 or
        float16), streamed one at a time, so ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads it.
        """
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float32), B.bfloat16, np.dtype(np.float16)):
            raise TypeError(f"dtype: expected float32, bfloat16 or float16; got {dt}")
        if self.has_adapter():
            raise ValueError("save_pretrained: the model has LoRA adapters; merge_adapter() first to export the "
                             "adapted model, or save_adapter(folder) to write the adapter alone (PEFT's format)")
        state = self.state_dict()
        tr = type(self).hf_transposed
        specs = {k: (tuple(reversed(a.shape)) if tr(k) else tuple(a.shape), dt) for k, a in state.items()}

        def get(k):
            a = state[k].astype(dt)
            return a.T if tr(k) else a
        return hf_folder.save_folder(path, self.config.to_hf(dt), specs, get, max_shard_size=max_shard_size)

    # -- LoRA adapters: PEFT's names and folder format (cukernels/nn/lora.py, cukernels/io/peft.py) -------------
    lora_config = None  # the adapters' cukernels.nn.LoraConfig (set by apply_lora, cleared by merge_adapter)
    base_path = None  # the folder or checkpoint the base weights came from (from_pretrained), or None

    def lora_exclude(self):
        """``{module name: reason}`` of the Linears no adapter can go on (:func:`cukernels.nn.apply_lora` asks): the
        output head, whose weight the fused head + loss reads directly."""
        mod = self.output_weight()[0]
        return {n: "it is the output head (the fused head + loss reads its weight directly); adapt the blocks' "
                   "projections" for n, m in self.named_modules() if n and m is mod}

    def has_adapter(self) -> bool:
        """Whether LoRA adapters are attached (unmerged)."""
        return bool(_lora.lora_modules(self))

    def add_adapter(self, config=None, **kw):
        """Add LoRA adapters and freeze every base parameter: :func:`cukernels.nn.apply_lora` (a
        :class:`cukernels.nn.LoraConfig`, or its keywords ``r``, ``alpha``, ``dropout``, ``target_modules``,
        ``use_rslora``; ``seed``, ``dtype``). Returns the config.

        Example::

            >>> model.add_adapter(r=16, alpha=32, target_modules=["q_proj", "v_proj"])
            >>> opt = ck.optim.AdamW(model.trainable_parameters(), lr=2e-4)
        """
        return _lora.apply_lora(self, config, **kw)

    def load_adapter(self, path):
        """Add the LoRA adapter of a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``: PEFT's
        ``save_pretrained`` or :meth:`save_adapter`). The folder is checked (:mod:`cukernels.io.peft`), then its
        fit: its targets match Linears of this model and every tensor has the shape the adapter there needs; on
        any disagreement the model is left as it was and PeftFormatError names the folder. Returns the model."""
        if self.has_adapter():
            raise ValueError("load_adapter: the model has LoRA adapters already; one adapter a model: merge_adapter() "
                             "first, or load the base again")
        cfg, tensors = _peft.read(path)
        lcfg = _lora.LoraConfig(**{k: cfg[k] for k in ("r", "lora_alpha", "lora_dropout", "target_modules",
                                                        "use_rslora", "rank_pattern", "alpha_pattern")})
        frozen = {id(p): p.requires_grad for p in self.parameters()}
        try:
            _lora.apply_lora(self, lcfg, strict=False, init=False)
            _lora.load_lora_state_dict(self, tensors, where=str(_peft.WEIGHTS))
        except (TypeError, ValueError) as e:
            _lora.remove_lora(self)
            for p in self.parameters():
                p.requires_grad = frozen.get(id(p), p.requires_grad)
            raise _peft.PeftFormatError(f"{path}: {e}") from None
        return self

    def save_adapter(self, path, *, dtype=None):
        """Write the adapters as a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``, keys
        ``base_model.model.<module>.lora_A.weight``; tensors in ``dtype``, default as held: fp32) that
        ``peft.PeftModel.from_pretrained(base, path)`` and :meth:`load_adapter` load. Returns the folder."""
        if not self.has_adapter():
            raise ValueError("save_adapter: the model has no LoRA adapter (add_adapter() or load_adapter() first)")
        tr = type(self).hf_transposed
        return _peft.write(path, self.lora_config.to_dict(), _lora.lora_state_dict(self),
                           base_model_name_or_path=self.base_path, dtype=dtype,
                           fan_in_fan_out=any(tr(n + ".weight") for n in _lora.lora_modules(self)))

    def merge_adapter(self):
        """Fold every adapter into its base weight (``W += scaling * B @ A`` in fp32, rounded once into W's dtype)
        and remove the adapters: plain Linears again, so the fused decode step and :meth:`save_pretrained` (a merged
        Hugging Face folder) apply. Returns the model."""
        _lora.merge_lora(self)
        return self

    def named_trainable_parameters(self):
        """``[(name, parameter)]`` of the parameters that require a gradient, in the optimizer's order
        (:func:`cukernels.nn.lora.trainable_parameters`: the A matrices of sibling adapters back to back). Without
        adapters: every parameter, in ``named_parameters()`` order."""
        return _lora.trainable_parameters(self)

    def trainable_parameters(self):
        """The parameters that require a gradient (:meth:`named_trainable_parameters`' order): what an optimizer
        takes. With LoRA adapters only the adapters: the frozen base has no gradient and no optimizer state."""
        return [p for _, p in self.named_trainable_parameters()]

    def extra_repr(self):
        return f"params={self.num_parameters() / 1e6:.2f}M, fused={self.fused}"


# ------------------------------------------------------------------------------------------------ recompute
class _dropout_offset:
    """Dropout's forward-pass state (the model's DropoutRNG and its offset snapshot, nn/dropout.py) set to ``snap``
    for the block's second forward inside the backward, where no forward pass is running: the counter-based masks
    are drawn again from the same (seed, offset), bit for bit."""

    def __init__(self, snap):
        self.snap = snap

    def __enter__(self):
        self.prev, _dropout._current[0] = _dropout._current[0], self.snap

    def __exit__(self, *exc):
        _dropout._current[0] = self.prev


def _head_grad_fp8(x, w):
    """The FP8 format of the head's dlogits when the active FP8 recipe asks for the head's gradient GEMMs in FP8
    (``Float8Recipe(head_grad_dtype=)``) and the operands suit them (bf16, H and the vocabulary rows multiples of
    16), else None (bf16 GEMMs)."""
    r = amp.get_fp8_recipe()
    if r is None or r.head_grad_dtype is None or not is_grad_enabled():
        return None
    xd = x.data if isinstance(x, Tensor) else x
    wd = w.data if isinstance(w, Tensor) else w
    if xd.dtype != B.bfloat16 or xd.shape[-1] % 16:
        return None
    if wd.shape[0] % 16 and B._kind(wd) is np:
        return None  # (on the GPU a vocabulary that is no multiple of 64 runs on rows padded to one)
    return r.head_grad_dtype


def _head_fp8_dw():
    """False when the active FP8 recipe keeps the head's dW GEMM in bf16 (``Float8Recipe(head_fp8_dw=False)``)."""
    r = amp.get_fp8_recipe()
    return r is None or r.head_fp8_dw


def _recomputed_block(block, x, kw, mode):
    """``block(x, **kw)`` with recompute ``mode`` ("attention" or "full"; see :meth:`CausalLM.set_recompute`)."""
    snap = _dropout.current()
    if mode == "attention":
        atts = [m for m in block.modules() if isinstance(m, Attention)]
        # The attention sub-block is called from inside the family's block.forward; for this call each Attention
        # module's forward is an instance attribute that recomputes (removed again below: nothing persists, and
        # the second forward calls the class's forward, so it does not recurse).
        for a in atts:
            a.__dict__["forward"] = lambda t, _a=a, **akw: F.recompute(
                lambda u: _replayed(snap, type(_a).forward, _a, u, **akw), t)
        try:
            return block(x, **kw)
        finally:
            for a in atts:
                a.__dict__.pop("forward", None)
    pair = isinstance(x, Residual)
    parts = (x.h, x.branch) if pair else (x,)
    kinds = []

    def run(*ts):
        out = _replayed(snap, block, Residual(*ts) if pair else ts[0], **kw)
        if not kinds:
            kinds.append(isinstance(out, Residual))
        return (out.h, out.branch) if isinstance(out, Residual) else out

    out = F.recompute(run, *parts)
    return Residual(*out) if kinds[0] else out


def _replayed(snap, fn, *a, **k):
    with _dropout_offset(snap):
        return fn(*a, **k)


class _Spec:
    """A shape without data (a Hugging Face tensor's, transposed where the name map says)."""

    def __init__(self, shape):
        self.shape = tuple(shape)


class _Converted:
    """{our name: array} over Hugging Face tensors, transposing the listed ones when read (one at a time)."""

    def __init__(self, tensors, names, transposed):
        self._t, self._names, self._tr = tensors, names, transposed

    def __contains__(self, k):
        return k in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)

    def keys(self):
        return self._names.keys()

    def __getitem__(self, k):
        a = self._t[self._names[k]]
        return np.ascontiguousarray(a.T) if self._tr(k) else a
