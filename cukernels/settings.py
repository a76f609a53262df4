"""``ck.settings``: the switches and tunables that users and benchmarks flip, in one object.

::

    ck.settings.pdl = False                        # type-checked; an unknown name is refused (did you mean ...?)
    with ck.settings(pdl=False, gemv_depth=4):     # restored on exit (also a decorator)
        ...
    print(ck.settings.describe())                  # every setting: value, default, type, where, why
    CUKERNELS_PDL=0 python examples/train.py       # environment: CUKERNELS_<NAME>, read once at import

Each setting is read where it is used, when the op is called (a plain attribute read), so a CUDA graph keeps the
kernels chosen while it was captured and a setting changed later applies to the next capture. The settings are
process-wide (like a module global): a ``with ck.settings(...)`` block in one thread is seen by the others; the
block's set and its restore are each atomic (a lock), enough for tests. Defaults are the measured best on one H200;
each one's line below says what it does and the measurement behind it (``benchmarks/NOTES.md`` has the rows).

Environment values are text: booleans ``1 0 true false yes no on off``, integers, ``none`` for an optional one,
a string setting's choice. A malformed one fails the import with a ValueError naming the variable.

True constants (tile sizes and tables the kernels mirror, limits of the hardware) stay module constants beside
their kernels; only what an A/B row or a user turns lives here. Adding a setting: one ``Field`` line in
``FIELDS`` (name, default, type, the module that reads it, the doc with its measured reason), then read
``settings.<name>`` at call time where it is used. This module imports nothing from the package.

The module ``cukernels.settings`` is shadowed by the object of the same name in the package namespace
(``ck.settings``, ``from cukernels import settings``); the class is ``type(ck.settings)``.
"""
from __future__ import annotations

import contextlib
import difflib
import os
import threading
import warnings
from dataclasses import dataclass

__all__ = ["settings", "Field"]

ENV_PREFIX = "CUKERNELS_"
# Other CUKERNELS_* variables the package reads (not settings): not reported as misspelled settings.
OTHER_ENV = ("CUKERNELS_PREBUILT",)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_TYPE_NAME = {bool: "a bool", int: "an integer", float: "a number", str: "a string"}


@dataclass(frozen=True)
class Field:
    """One setting: ``name`` (an identifier; its environment variable is CUKERNELS_<NAME>), ``default``, ``type``
    (bool, int, float or str), ``where`` (the module that reads it), ``doc`` (one line: what it does and the
    measurement behind the default); optional ``choices`` (str), ``min`` / ``max`` (numbers), ``optional`` (None
    allowed)."""

    name: str
    default: object
    type: type
    where: str
    doc: str
    choices: tuple = ()
    min: float | None = None
    max: float | None = None
    optional: bool = False

    def check(self, value, *, what=None):
        """``value`` if it is valid for this setting (an int for a float setting becomes a float), else
        TypeError / ValueError naming the setting."""
        what = what or f"settings.{self.name}"
        if value is None:
            if self.optional:
                return None
            raise TypeError(f"{what}: expected {_TYPE_NAME[self.type]}; got None")
        t = self.type
        ok = (isinstance(value, bool) if t is bool
              else isinstance(value, (int, float)) and not isinstance(value, bool) if t is float
              else isinstance(value, t) and not isinstance(value, bool) if t is int
              else isinstance(value, t))
        if not ok:
            raise TypeError(f"{what}: expected {_TYPE_NAME[t]}{' or None' if self.optional else ''}; got "
                            f"{type(value).__name__} {value!r}")
        if t is float:
            value = float(value)
        if self.choices and value not in self.choices:
            raise ValueError(f"{what}: expected one of {', '.join(map(repr, self.choices))}; got {value!r}")
        if self.min is not None and value < self.min or self.max is not None and value > self.max:
            lo = "" if self.min is None else f">= {self.min}"
            hi = "" if self.max is None else f"<= {self.max}"
            raise ValueError(f"{what}: expected a value {' and '.join(s for s in (lo, hi) if s)}; got {value!r}")
        return value

    def parse(self, text: str, *, what=None):
        """The value written as ``text`` (an environment variable, a benchmark's --ab row), checked."""
        what = what or f"settings.{self.name}"
        s = str(text).strip()
        if self.optional and s.lower() in ("none", ""):
            return None
        if self.type is bool:
            if s.lower() in _TRUE:
                return True
            if s.lower() in _FALSE:
                return False
            raise ValueError(f"{what}: expected a bool (1 0 true false yes no on off); got {s!r}")
        if self.type in (int, float):
            try:
                value = self.type(s)
            except ValueError:
                raise ValueError(f"{what}: expected {_TYPE_NAME[self.type]}; got {s!r}") from None
            return self.check(value, what=what)
        return self.check(s, what=what)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


_F = Field
# One line a setting: name, default, type, the module that reads it, what it does and why the default.
FIELDS = (
    # launches
    _F("pdl", True, bool, "ops/_launch.py",
       "programmatic dependent launch for the launches that ask for it (the fused decode step, sm_90): each kernel "
       "starts under the previous one's tail; LLaMA-1B B1 step 1.273 -> 1.182 ms"),
    _F("pdl_carveout", 100, int, "ops/_launch.py",
       "shared-memory carveout (%) of every pdl launch, so neighbours do not drain an SM for a carveout change; "
       "-1 = the driver's per kernel. LLaMA-1B B1 step 1.161 ms at 100 vs 1.175 at the default", min=-1, max=100),
    # attention
    _F("attention_wgmma", True, bool, "ops/attention.py",
       "ck.flash_attention on sm_90 (no key mask, head_dim 64 / 128) runs the wgmma kernels of ops/attention_sm90.py; "
       "fwd+bwd B8xT1024 H32/8 D64 causal 0.580 vs 0.818 ms for the mma.sync ones"),
    _F("attention_sm90_variant", "auto", str, "ops/attention_sm90.py",
       "the wgmma forward's consumer loop: auto = D64 _overlap below 2048 keys (512 non-causal), _wg3 from there, "
       "D128 _serial (dev/attention_sweep.py: causal T4096 _wg3 345 us vs ping-pong 369); '' = ping-pong",
       choices=("auto", "", "_serial", "_overlap", "_wg3")),
    _F("attention_sm90_bwd_variant", "", str, "ops/attention_sm90.py",
       "the wgmma backward's loop: '' = the consumer warpgroups taking turns (ping-pong), '_serial' = no turns",
       choices=("", "_serial")),
    _F("attention_sm90_bwd_dq", "fused", str, "ops/attention_sm90.py",
       "head_dim 64 backward's dq: fused (dkdv sums dS K into an fp32 accumulator: 5 products a pair) or kernel "
       "(a dq kernel recomputing S and dP: 7); B8xT1024 H32/8 causal 0.329 vs 0.375 ms",
       choices=("fused", "kernel")),
    _F("attention_sm90_persistent", True, bool, "ops/attention_sm90.py",
       "the wgmma kernels walk the work tiles on at most one CTA an SM (False: one CTA a tile, same kernels); "
       "fwd+bwd B8xT1024 0.580 -> 0.514 ms"),
    _F("attention_sm90_grid_cap", None, int, "ops/attention_sm90.py",
       "caps the persistent grid below one CTA an SM (tests run many tiles through one CTA's mbarrier phases); "
       "None = no cap", min=1, optional=True),
    _F("rope_in_attention_backward", True, bool, "functional/attention.py",
       "the packed attention's rope backward inside the sm_90 attention backward's store instead of one "
       "ck.rope_backward launch after it: LLaMA-1B B4xT64 -0.04 ms a step, one rounding instead of two"),
    # decode and generation
    _F("decode_fused_attention", True, bool, "nn/decode.py",
       "the fused decode step's rotary + cache append + attention in one launch (ck.decode_attention_rope; False: "
       "ck.rope_kv_write then ck.decode_attention, bit-identical): -85 to -140 us a LLaMA-1B B1 step"),
    _F("decode_max_rows", 1, int, "nn/decode.py",
       "batch rows the fused decode step takes (ck.gemv: at most 8): LLaMA-1B B1 1.255 ms vs 1.754 for the generic "
       "forward, but B8 2.85 ms vs 1.86 through cuBLAS", min=1, max=8),
    # layers, autograd, the loss head
    _F("pack_projections", True, bool, "nn/layers.py",
       "fused modules run bias-free projections of one input (q / k / v, gate / up) as one PackedLinear GEMM each "
       "way: LLaMA-1B B4xT64 bf16 gradients 15.60 -> 14.82 ms a step"),
    _F("fast_cast", True, bool, "autograd.py",
       "stale-gradient overwrites through ck.cast's 16-byte kernel: CuPy's fp32 -> bf16 copy ran at ~1.3 TB/s "
       "(the LM head's dW into a bf16 .grad: 1.24 ms of the B8xT1024 step)"),
    _F("head_workspace", 1 << 30, int, "functional/linear_cross_entropy.py",
       "bytes of logits a chunk of the model's fused LM head (twice the op's default: taller GEMMs); B8xT1024 "
       "fp32 grads 115.7 ms / 36.5 GiB vs 116.2 / 36.0 at half; lower it for memory", min=1),
    _F("ce_cache_hints", True, bool, "ops/cross_entropy.py",
       "evict-first loads / stores in the fused cross-entropy's second pass (the rows still waiting stay in L2): "
       "4096 x 128256 bf16 0.727 vs 0.810 ms, the same bits"),
    _F("lce_stage_weight", True, bool, "ops/linear_cross_entropy.py",
       "stage a head weight with unaligned rows (GPT-2's [50257, H]) into a zero-padded copy: 8192 x 768 x 50257 "
       "3.5 ms vs 13.6 on cuBLAS' align1 kernels"),
    _F("graph_memset_nodes", "kernel", str, "graph.py",
       "small memset nodes of a captured graph become kernel nodes before instantiation ('keep': as captured): "
       "LLaMA-1B B4xT64 16.15 vs 16.25 ms a step", choices=("kernel", "keep")),
    # gemv (the decode GEMVs)
    _F("gemv_prefetch_kb", 4, int, "ops/gemv.py",
       "KB of its first rows each GEMV warp asks into L2 before it waits on the previous kernel (a hint: same "
       "results); LLaMA-1B B1 step 1.184 ms at 0, 1.182 at 4, 1.244 at 8", min=0, max=255),
    _F("gemv_depth", 3, int, "ops/gemv.py",
       "stages of the GEMV's cp.async weight ring for K < 4096 (fewer where shared memory is short): gate_up "
       "19.8 / 18.2 / 17.5 us at 2 / 3 / 4, qkv 5.73 / 5.75 / 6.00", min=1),
    _F("gemv_depth_long", 4, int, "ops/gemv.py",
       "stages of the ring for K >= 4096: down (K 8192) 11.3 / 11.4 / 10.5 us at 2 / 3 / 4", min=1),
    _F("gemv_pair_min_nb", 4, int, "ops/gemv.py",
       "from this many (padded) batch rows a GEMV warp takes two output columns: ~25 % fewer instructions a weight "
       "byte where B8 is issue-bound; > 8 = never", min=1),
    # rope, sampling
    _F("rope_head_round", 4, int, "ops/rope.py",
       "a rope thread's head chunk rounded to the nearest multiple of this (the kernel's 4 heads in flight; 1 = "
       "none): LLaMA-1B packed q + k at 8192 tokens 33.7 -> 30.5 us", min=1),
    _F("greedy_split", True, bool, "ops/sampling.py",
       "greedy sampling spreads a row over blocks (then one combines); False: one block a row. B1 x 128256 fp32 "
       "3.7 vs 26.1 us", ),
    _F("greedy_slice_bytes", 8192, int, "ops/sampling.py",
       "bytes of a row each greedy block reads (8 KB: one round of 2 x 16-byte loads a thread); 4 / 16 KB within "
       "0.4 us at B1", min=16),
    # softmax
    _F("softmax_cluster", True, bool, "ops/softmax.py",
       "rows past the register kernels take the thread-block-cluster kernels on sm_90: 2048 x 32768 bf16 76.5 vs "
       "107.6 us (83 vs 59 % of copy)"),
    _F("softmax_cluster_threads", 512, int, "ops/softmax.py",
       "threads a CTA the cluster plan aims for (512: two CTAs an SM at <= 64 registers; 256 equal within 1 %)",
       min=32, max=1024),
    _F("softmax_cluster_fwd_from_f32", 16384, int, "ops/softmax.py",
       "fp32 forward rows longer than this take the cluster kernel (16384: every row past the register kernels; "
       "2048 x 32768 130.8 vs 152.3 us)", min=0),
    _F("softmax_cluster_fwd_from_bf16", 16384, int, "ops/softmax.py",
       "bf16 forward rows longer than this take the cluster kernel (2048 x 32768 76.5 vs 107.6 us)", min=0),
    _F("softmax_cluster_max_grid", 2**31 - 1, int, "ops/softmax.py",
       "CTAs of the cluster kernels at most, in whole clusters (default: one cluster a row; 264 = one wave walking "
       "the rows measured slower)", min=8),
    # layer_norm, rms_norm
    _F("layer_norm_target_vpt", 2, int, "ops/layer_norm.py",
       "16-byte packs a thread the layer_norm planner aims for (backward, element forward): 2, as measured best "
       "for rms_norm's identical structure", min=1),
    _F("layer_norm_fwd_target_vpt", 2, int, "ops/layer_norm.py",
       "the fp32 vector forward's target (4 lost: 92 -> 88 % of copy at 8192 x 2048)", min=1),
    _F("layer_norm_fwd_target_vpt_bf16", 4, int, "ops/layer_norm.py",
       "the bf16 vector forward's target (4 instead of 2: 8192 x 2048 64 -> 69 % of copy, 65536 x 1000 72 -> 88)",
       min=1),
    _F("layer_norm_pipe_threads", 256, int, "ops/layer_norm.py",
       "threads a block of the pipelined backward (256: three blocks an SM; 512: one, +6 to +20 %)",
       choices=(256, 512)),
    _F("layer_norm_pipe_stages", 2, int, "ops/layer_norm.py",
       "cp.async row groups in flight a block of the pipelined backward (2..4; 2 stages 2-3 % faster than 3)",
       min=2, max=4),
    _F("layer_norm_pipe_min_tpr", 32, int, "ops/layer_norm.py",
       "rows of fewer threads than this keep the register backward (the slots' in-order combine would be a long "
       "serial loop)", min=1),
    _F("layer_norm_bwd_kernel", "warp", str, "ops/layer_norm.py",
       "bf16 rows of 65..128 packs (C 520..1024) take the one-warp-a-row backward ('pipe': ln_bwd_pipe): 8192 x 768 "
       "18.2 vs 22.1 us", choices=("warp", "pipe")),
    _F("layer_norm_warp_rows", 4, int, "ops/layer_norm.py",
       "rows each warp of the one-warp-a-row backward takes (with 4 warps a block: ceil(rows / 16) blocks)", min=1),
    _F("rms_norm_pipe", True, bool, "ops/rms_norm.py",
       "the cp.async pipelined backward for rows of 1, 2 or 4 packs a thread (False: the register kernel); "
       "dev/tune_rms_norm.py times both"),
    _F("rms_norm_pipe_threads", 512, int, "ops/rms_norm.py",
       "threads a block of the pipelined backward at 1 or 2 packs a thread (4 packs: 256, the kernels' bound); "
       "dev/tune_norm_backward.py times 256", choices=(256, 512)),
    _F("rms_norm_pipe_stages_bf16", 2, int, "ops/rms_norm.py",
       "cp.async row groups in flight a block of the pipelined bf16 backward (3 or 4: 6-8 % slower at 8192 x 2048)",
       min=2, max=4),
    _F("rms_norm_pipe_stages_f32", 3, int, "ops/rms_norm.py",
       "the same for fp32 rows (3: 2-3 % faster than 2 at 8192 x 2048)", min=2, max=4),
    # ZeRO-1 (several ranks only)
    _F("zero_adam_occupancy", 1.0, float, "optim/adamw.py",
       "waves of blocks in the AdamW update's grid while collectives run beside it (sm_margin 0, > 1 rank); 1 = one "
       "persistent wave", min=0.0),
    _F("zero_eager_gathers", 1, int, "optim/adamw.py",
       "with overlap_gather, buckets (the first in forward order) step() still all-gathers itself; 2 x H200 "
       "B8xT1024: 126.9 ms at 0 against 125.4 at 1", min=0),
    _F("zero_cast_on_compute_stream", True, bool, "optim/adamw.py",
       "bf16 wire: each bucket's fp32 -> bf16 cast on the compute stream (True) or the side stream; 2 x H200 "
       "B8xT1024 126.44 against 128.14 ms"),
    _F("zero_side_priority", -100, int, "optim/adamw.py",
       "the collectives' side stream priority (-100 is clamped to the device's highest)"),
)
del _F


class Settings:
    """The switches and tunables users and benchmarks flip, one object (``ck.settings``).

    ``ck.settings.<name>`` reads a setting (a plain attribute); ``ck.settings.<name> = value`` sets it (checked: its
    type, range or choices; an unknown name is refused with the nearest one); ``with ck.settings(name=value, ...):``
    sets several for a block (or a decorated function) and restores them after it. ``describe()`` lists them all
    with their defaults, types, the module that reads each and the measurement behind its default; ``changed()``,
    ``as_dict()``, ``reset(*names)``, ``field(name)`` and ``parse(name, text)`` (the ``CUKERNELS_<NAME>``
    environment's text form) complete it. Settings are read when an op is called: a CUDA graph keeps the values
    of its capture.

    Example::

        >>> ck.settings.pdl = False                 # programmatic dependent launch off
        >>> with ck.settings(attention_wgmma=False):
        ...     o = ck.flash_attention(q, k, v)     # the mma.sync kernels on Hopper too
    """

    def __init__(self, fields, environ=None):
        by_name = {}
        for f in fields:
            if not f.name.isidentifier() or f.name.startswith("_") or f.name in by_name or hasattr(Settings, f.name):
                raise ValueError(f"settings: bad or repeated field name {f.name!r}")
            f.check(f.default, what=f"settings.{f.name} (its default)")
            by_name[f.name] = f
        object.__setattr__(self, "_fields", by_name)
        object.__setattr__(self, "_lock", threading.RLock())
        env = os.environ if environ is None else environ
        from_env = {}
        for f in fields:
            text = env.get(f.env)
            value = f.default if text is None else f.parse(text, what=f.env)
            if text is not None:
                from_env[f.name] = text
            object.__setattr__(self, f.name, value)
        object.__setattr__(self, "_from_env", from_env)
        object.__setattr__(self, "_initial", {n: getattr(self, n) for n in by_name})
        known = {f.env for f in fields} | set(OTHER_ENV)
        for var in env:
            if var.startswith(ENV_PREFIX) and var not in known:
                near = difflib.get_close_matches(var, sorted(known), n=1)
                if near:
                    warnings.warn(f"{var}: not a cukernels setting; did you mean {near[0]}?", RuntimeWarning,
                                  stacklevel=2)

    # --- attribute access ---------------------------------------------------------------------------------------
    def _unknown(self, name):
        near = difflib.get_close_matches(name, list(self._fields), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else " (ck.settings.describe() lists them)"
        return f"settings: no setting {name!r}{hint}"

    def __getattr__(self, name):  # only reached for a name that is not a setting
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(self._unknown(name))

    def __setattr__(self, name, value):
        f = self._fields.get(name)
        if f is None:
            raise AttributeError(self._unknown(name))
        value = f.check(value)
        with self._lock:
            object.__setattr__(self, name, value)

    def __delattr__(self, name):
        raise AttributeError(f"settings: a setting cannot be deleted ({name!r}); use settings.reset({name!r})")

    def __dir__(self):
        return sorted(set(super().__dir__()) - {"_fields", "_lock", "_from_env", "_initial"})

    def __iter__(self):
        return iter(self._fields)

    def __contains__(self, name):
        return name in self._fields

    # --- the context manager ------------------------------------------------------------------------------------
    def _field(self, name):
        f = self._fields.get(name)
        if f is None:
            raise TypeError(self._unknown(name))
        return f

    @contextlib.contextmanager
    def _override(self, values):
        with self._lock:
            old = {n: getattr(self, n) for n in values}
            for n, v in values.items():
                object.__setattr__(self, n, v)
        try:
            yield self
        finally:
            with self._lock:
                for n, v in old.items():
                    object.__setattr__(self, n, v)

    def __call__(self, **overrides):
        """``with ck.settings(name=value, ...):`` -- a context manager (and decorator) that sets ``overrides`` for
        its block and restores the previous values on exit; every value is checked before any is set."""
        return self._override({n: self._field(n).check(v) for n, v in overrides.items()})

    # --- text, defaults, the table -------------------------------------------------------------------------------
    def field(self, name) -> Field:
        """The :class:`Field` of ``name`` (its default, type, doc)."""
        return self._field(name)

    def parse(self, name, text):
        """The value of setting ``name`` written as ``text`` (the environment's form: ``pdl=0`` -> False)."""
        return self._field(name).parse(text)

    def reset(self, *names):
        """Back to the values at import (the defaults with the environment's overrides): ``names``, or all."""
        for n in names or self._fields:
            self._field(n)
        with self._lock:
            for n in names or self._fields:
                object.__setattr__(self, n, self._initial[n])

    def as_dict(self) -> dict:
        """``{name: value}`` of every setting."""
        return {n: getattr(self, n) for n in self._fields}

    def changed(self) -> dict:
        """``{name: value}`` of the settings that differ from their defaults (what a benchmark row records)."""
        return {n: getattr(self, n) for n, f in self._fields.items() if getattr(self, n) != f.default}

    def describe(self) -> str:
        """Every setting, one block each: ``name = value`` (``default ...`` when it differs, and the environment
        variable that set it), its type, the module that reads it, and its doc."""
        lines = []
        for n, f in self._fields.items():
            v = getattr(self, n)
            kind = f"{f.type.__name__}{' or None' if f.optional else ''}"
            if f.choices:
                kind += f" in {{{', '.join(map(repr, f.choices))}}}"
            note = "" if v == f.default else f"  (default {f.default!r})"
            if n in self._from_env:
                note += f"  [{f.env}={self._from_env[n]}]"
            lines.append(f"{n} = {v!r}{note}\n    {kind}; {f.env}; {f.where}\n    {f.doc}")
        return "\n".join(lines)

    def __repr__(self):
        ch = self.changed()
        return f"<cukernels settings: {len(self._fields)}, changed: {ch if ch else 'none'}>"


settings = Settings(FIELDS)
