"""LoRA: low-rank adapters on chosen Linear layers, with PEFT's names, math and initialisation.

An adapted Linear computes (PEFT's ``lora.Linear``, one adapter)::

    y = x W^T (+ b) + s * (dropout(x) A^T) B^T          A [r, in], B [out, r], s = alpha / r  (alpha / sqrt(r): rsLoRA)

with the base W (and b) frozen; A starts kaiming-uniform(a = sqrt(5)) -- U(-1/sqrt(in), 1/sqrt(in)) -- and B at zero,
so a fresh adapter changes nothing. Parameter names are PEFT's without the adapter name: ``<module>.lora_A.weight``,
``<module>.lora_B.weight`` (``cukernels.io.peft`` adds PEFT's ``base_model.model.`` prefix in the files); the base
keeps its own names (``<module>.weight``), so the base model's checkpoints and Hugging Face folders are unchanged.

The work of one adapted Linear -- or of several that read one input and are consumed side by side (LLaMA's q / k /
v, gate / up: ``layers.project_packed`` hands them here) -- is one autograd Function, :class:`LoRAF`:

* forward: ``u = x [A_1; ...; A_k]^T`` (one GEMM for the group: [N, sum r]), each delta ``s_i u_i B_i^T`` written
  straight into its columns of y (cuBLAS alpha = s_i, beta = 0), then the base GEMM ``y += x W^T`` with beta = 1.
  The skinny delta GEMMs (K = r) are memory-bound: each writes its slice of y once, and the compute-bound base GEMM
  reads it back in its epilogue, instead of a second skinny GEMM reading and writing y (LLaMA-1B's gate / up output
  is [8192, 16384] bf16 = 268 MB a layer at B8xT1024; ``benchmarks/NOTES.md``, LoRA).
* backward: ``gu_i = s_i g_i B_i`` ([N, r] each), ``dB_i = s_i g_i^T u_i`` and ``dA = gu^T x`` (one GEMM for the
  group when the A gradients lie back to back, as :func:`trainable_parameters` orders them for the optimizer's flat
  buffers) accumulated straight into the fp32 ``.grad`` buffers, then ``dx = gu [A_1; ...; A_k]`` (skinny, written)
  and the base ``dx += g W`` with beta = 1. No GEMM touches the base weight's gradient: W does not require one
  (``ctx.needs_input_grad``), and neither does x in the first layer (a frozen embedding and norm before it).
* dropout (p > 0, training): each adapter draws its own mask on its own input copy, as PEFT's per-adapter
  ``nn.Dropout`` does, so the A GEMMs are one per adapter; p = 0 costs nothing.

``fused=False`` (the layer's composite path) is the same math as plain ``F.linear`` Functions on the tape: the
reference the Function is checked against.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional, Union

import numpy as np

from .. import _backend as B
from .. import functional as F
from ..autograd import Function, Tensor, _xp
from ..blas import layout_ok, matmul
from ..functional.array_ops import _ones_row, _weight_grad, joined_rows
from ..ops.elementwise import add as _ck_add
from .dropout import Dropout, DropoutRNG
from .layers import Linear, autocast_input, check_input, project, weight_for_gemm
from .module import Module, Parameter

__all__ = ["LoraConfig", "LoRALinear", "LoRAF", "apply_lora", "merge_lora", "remove_lora", "pack_frozen",
           "lora_modules", "lora_state_dict", "load_lora_state_dict", "trainable_parameters", "target_matches",
           "ALL_LINEAR"]

ALL_LINEAR = "all-linear"  # PEFT's shorthand: every Linear but the output head


# ================================================================================================ config
@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """What :func:`apply_lora` adds, under PEFT's ``LoraConfig`` field names and meanings.

    Args:
        r: the rank (an integer >= 1).
        lora_alpha: the scale numerator (a number > 0): s = lora_alpha / r, or lora_alpha / sqrt(r) with
            ``use_rslora``.
        lora_dropout: dropout on the adapter's input while training, in [0, 1).
        target_modules: which Linears get an adapter, matched against module names as PEFT matches them: a list of
            names (a module whose name is one of them or ends with ``.<name>``), a regular expression string (the
            whole name must match, ``re.fullmatch``), or ``"all-linear"`` (every Linear but the output head).
        use_rslora: rank-stabilised scaling lora_alpha / sqrt(r).
        rank_pattern, alpha_pattern: ``{pattern: r}`` / ``{pattern: alpha}`` overrides per module, PEFT's
            semantics (a pattern matches a name that ends with it after a dot, as a regex).
    """

    r: int = 8
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    target_modules: Union[tuple, str] = ALL_LINEAR
    use_rslora: bool = False
    rank_pattern: dict = dataclasses.field(default_factory=dict)
    alpha_pattern: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        B.check_size("r", self.r)
        B.check_real("lora_alpha", self.lora_alpha, min=0, min_open=True)
        B.check_real("lora_dropout", self.lora_dropout, min=0, max=1, max_open=True)
        B.check_bool("use_rslora", self.use_rslora)
        t = self.target_modules
        if isinstance(t, str):
            if not t:
                raise ValueError("target_modules: expected module names or a regular expression; got ''")
            if t.lower() != ALL_LINEAR:
                try:
                    re.compile(t)
                except re.error as e:
                    raise ValueError(f"target_modules: {t!r} is not a valid regular expression ({e})") from None
        elif isinstance(t, (list, tuple)) and t and all(isinstance(s, str) and s for s in t):
            object.__setattr__(self, "target_modules", tuple(t))
        else:
            raise TypeError(f"target_modules: expected a list of module names (['q_proj', 'v_proj']), a regular "
                            f"expression string or 'all-linear'; got {B._got(t)}")
        checks = (("rank_pattern", self.rank_pattern, lambda k, v: B.check_size(f"rank_pattern[{k!r}]", v)),
                  ("alpha_pattern", self.alpha_pattern,
                   lambda k, v: B.check_real(f"alpha_pattern[{k!r}]", v, min=0, min_open=True)))
        for name, pat, check in checks:
            if not isinstance(pat, dict) or not all(isinstance(k, str) and k for k in pat):
                raise TypeError(f"{name}: expected a dict {{module pattern: value}}; got {B._got(pat)}")
            for k, v in pat.items():
                check(k, v)
        if self.use_rslora and (self.rank_pattern or self.alpha_pattern):
            raise ValueError("use_rslora: PEFT does not combine rsLoRA with rank_pattern / alpha_pattern")

    def is_all_linear(self):
        return isinstance(self.target_modules, str) and self.target_modules.lower() == ALL_LINEAR

    def rank_for(self, name):
        return int(self.rank_pattern.get(_pattern_key(self.rank_pattern, name), self.r))

    def alpha_for(self, name):
        return float(self.alpha_pattern.get(_pattern_key(self.alpha_pattern, name), self.lora_alpha))

    def scaling_for(self, name):
        """s of the module ``name``: alpha / r (alpha / sqrt(r) with rsLoRA), after the patterns."""
        r, a = self.rank_for(name), self.alpha_for(name)
        return a / math.sqrt(r) if self.use_rslora else a / r

    def to_dict(self):
        d = dataclasses.asdict(self)
        d["target_modules"] = list(self.target_modules) if isinstance(self.target_modules, tuple) else \
            self.target_modules
        return d


def _pattern_key(patterns, name):
    """PEFT's ``get_pattern_key``: the first pattern that matches the end of ``name`` after a dot (or all of it)."""
    for k in patterns:
        if re.match(rf"(.*\.)?({k})$", name):
            return k
    return name


def target_matches(target_modules, name) -> bool:
    """Whether the module ``name`` is a LoRA target under PEFT's rules (``check_target_module_exists``): a string is
    a regular expression the whole name must match; a list matches a name equal to one of its entries or ending with
    ``.<entry>``. (``"all-linear"`` is resolved by :func:`apply_lora`, which knows the output head.)"""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return name in target_modules or any(name.endswith("." + t) for t in target_modules)


# ================================================================================================ the Function
def _mm(a, b, *, trans_a=False, trans_b=False, out=None, alpha=1.0, beta=0.0, out_dtype=None):
    """``ck.matmul`` on operands it takes as they are (row-strided column slices included), others copied."""
    xp = _xp(a)
    a = a if layout_ok(a) else xp.ascontiguousarray(a)
    b = b if layout_ok(b) else xp.ascontiguousarray(b)
    return matmul(a, b, trans_a=trans_a, trans_b=trans_b, out=out, alpha=alpha, beta=beta,
                  out_dtype=out_dtype if out is None else None)


def _rows(arrays):
    """``[A_1; ...; A_k]``: a view when they lie back to back (the optimizer's flat buffers), else a copy (r x in
    elements each: ~65 KB a projection at r = 16)."""
    if len(arrays) == 1:
        return arrays[0]
    joined = joined_rows(arrays)
    return joined if joined is not None else _xp(arrays[0]).concatenate(arrays, axis=0)


class _Plan:
    """The static shape of one :class:`LoRAF` call: n base projections (their output cuts), which of them carry an
    adapter (``adapted``: member indices; ``rcuts``: their column ranges in u), the scalings, the low-precision
    arrays the GEMMs read (or None: cast here), whether a bias and per-adapter dropout inputs follow."""

    __slots__ = ("n", "cuts", "adapted", "rcuts", "scales", "lows", "bias", "dropout")

    def __init__(self, outs, ranks, scales, lows, bias, dropout):
        self.n = len(outs)
        self.cuts = np.cumsum([0] + list(outs)).tolist()
        self.adapted = [i for i, r in enumerate(ranks) if r]
        self.rcuts = np.cumsum([0] + [ranks[i] for i in self.adapted]).tolist()
        self.scales = [float(scales[i]) for i in self.adapted]
        self.lows, self.bias, self.dropout = lows, bias, dropout

    # positions of apply()'s arguments: x, plan, W_1..W_n, (A_j, B_j) per adapter, [bias], [xd_j per adapter]
    def iw(self, i):
        return 2 + i

    def ia(self, j):
        return 2 + self.n + 2 * j

    def ib(self, j):
        return 3 + self.n + 2 * j

    def ibias(self):
        return 2 + self.n + 2 * len(self.adapted)

    def ixd(self, j):
        return self.ibias() + (1 if self.bias else 0) + j


class LoRAF(Function):
    """``y = x [W_1; ...; W_n]^T (+ b) + concat_i(s_i * (xd_i A_i^T) B_i^T)`` for n projections of one input x, some of
    them adapted (see the module docstring for the GEMM order and what the backward skips).

    ``apply(x, plan, *W, *(A_j, B_j), [bias], [xd_j])`` with a :class:`_Plan`; W_i [out_i, in], A_j [r_j, in],
    B_j [out_i, r_j]; ``xd_j`` the dropped-out input of adapter j when dropout is active (else A reads x).
    """

    @staticmethod
    def forward(ctx, x, plan, *params):
        n, k = plan.n, len(plan.adapted)
        xp = _xp(x)
        x2 = x.reshape(-1, x.shape[-1])
        if not layout_ok(x2):
            x2 = xp.ascontiguousarray(x2)
        dt = x2.dtype

        def low(p, lo):
            return lo if lo is not None else (p if p.dtype == dt else p.astype(dt))

        wls = [low(params[i], plan.lows[i]) for i in range(n)]
        als = [low(params[n + 2 * j], plan.lows[n + 2 * j]) for j in range(k)]
        bls = [low(params[n + 2 * j + 1], plan.lows[n + 2 * j + 1]) for j in range(k)]
        xds = None
        if plan.dropout:
            o = 2 * k + (1 if plan.bias else 0)
            xds = [params[n + o + j].reshape(-1, x2.shape[1]) for j in range(k)]
        N, cuts, rc = x2.shape[0], plan.cuts, plan.rcuts
        u = xp.empty((N, rc[-1]), dtype=dt)
        if xds is None:
            _mm(x2, _rows(als), trans_b=True, out=u)  # every adapter's x A_j^T in one GEMM
        else:
            for j in range(k):
                _mm(xds[j], als[j], trans_b=True, out=u[:, rc[j]:rc[j + 1]])
        y = xp.empty((N, cuts[-1]), dtype=dt)
        W = joined_rows(wls) if n > 1 else wls[0]
        if W is None and xp is np:
            W = np.concatenate(wls, axis=0)  # (the same products whatever the layout, as PackedLinear does)

        def delta(beta):
            for j, i in enumerate(plan.adapted):
                _mm(u[:, rc[j]:rc[j + 1]], bls[j], trans_b=True, out=y[:, cuts[i]:cuts[i + 1]],
                    alpha=plan.scales[j], beta=beta)

        def base(beta):
            if W is not None:
                _mm(x2, W, trans_b=True, out=y, beta=beta)
            else:
                for i in range(n):
                    _mm(x2, wls[i], trans_b=True, out=y[:, cuts[i]:cuts[i + 1]], beta=beta)

        if k == n:  # every column has a delta: write the deltas, then the base GEMM adds itself to them
            delta(0.0)
            base(1.0)
        else:
            base(0.0)
            delta(1.0)
        if plan.bias:
            b = params[n + 2 * k]
            if xp is np:
                y += b.astype(y.dtype)
            else:
                _ck_add(y, b, out=y)
        ctx.save_for_backward(x2, xds, u, wls, W, als, bls)
        ctx.xshape, ctx.plan = x.shape, plan
        return y.reshape(x.shape[:-1] + (cuts[-1],))

    @staticmethod
    def backward(ctx, g):
        x2, xds, u, wls, W, als, bls = ctx.saved_tensors
        plan, need = ctx.plan, ctx.needs_input_grad
        n, k, cuts, rc = plan.n, len(plan.adapted), plan.cuts, plan.rcuts
        xp = _xp(g)
        dt = x2.dtype
        g2 = g.reshape(-1, g.shape[-1])
        if g2.dtype != dt or not layout_ok(g2):
            g2 = xp.ascontiguousarray(g2.astype(dt, copy=False))
        cols = [g2[:, cuts[i]:cuts[i + 1]] for i in range(n)]
        gdt = np.float32 if dt == B.bfloat16 else dt  # a returned weight gradient: fp32 sums for bf16 operands
        N = g2.shape[0]
        want_a = [need[plan.ia(j)] for j in range(k)]
        want_xd = [plan.dropout and need[plan.ixd(j)] for j in range(k)]
        gu = None
        if need[0] or any(want_a) or any(want_xd):
            gu = xp.empty((N, rc[-1]), dtype=dt)
            for j, i in enumerate(plan.adapted):
                _mm(cols[i], bls[j], out=gu[:, rc[j]:rc[j + 1]], alpha=plan.scales[j])
        grads = [None] * (len(ctx.inputs))
        for j, i in enumerate(plan.adapted):  # dB_j = s_j g_i^T u_j, into B_j's .grad
            uj, s, c = u[:, rc[j]:rc[j + 1]], plan.scales[j], cols[i]
            grads[plan.ib(j)] = _weight_grad(ctx, plan.ib(j), lambda out, acc, uj=uj, s=s, c=c: _mm(
                c, uj, trans_a=True, out=out, alpha=s, beta=1.0 if acc else 0.0, out_dtype=gdt))
        # dA_j = gu_j^T x (or xd_j): one GEMM into the adjacent .grad buffers of the group when it can
        ia = [plan.ia(j) for j in range(k)]
        G = None
        if xds is None and k > 1 and all(want_a):
            G = joined_rows([ctx.leaf_grad(i) for i in ia])
            if G is not None and len({ctx.inputs[i].grad_stale for i in ia}) != 1:
                G = None
        if G is not None:
            acc = False
            for i in ia:
                _, acc = ctx.leaf_grad_write(i)
            _mm(gu, x2, trans_a=True, out=G, beta=1.0 if acc else 0.0)
        else:
            for j in range(k):
                src, gj = (xds[j] if xds is not None else x2), gu[:, rc[j]:rc[j + 1]] if gu is not None else None
                grads[ia[j]] = _weight_grad(ctx, ia[j], lambda out, acc, src=src, gj=gj: _mm(
                    gj, src, trans_a=True, out=out, beta=1.0 if acc else 0.0, out_dtype=gdt))
        if plan.dropout:
            for j in range(k):
                if want_xd[j]:
                    grads[plan.ixd(j)] = _mm(gu[:, rc[j]:rc[j + 1]], als[j]).reshape(ctx.xshape)
        if need[0]:
            if xds is None:  # the adapters' dx first (skinny, written), then the base dgrad adds itself (beta = 1)
                dx = _mm(gu, _rows(als))
                beta = 1.0
            else:
                dx, beta = xp.empty((N, x2.shape[1]), dtype=dt), 0.0
            if W is not None:
                _mm(g2, W, out=dx, beta=beta)
            else:
                for i in range(n):
                    _mm(cols[i], wls[i], out=dx, beta=1.0 if (i or beta) else 0.0)
            grads[0] = dx.reshape(ctx.xshape)
        for i in range(n):  # a base weight that does require a gradient (not the LoRA setting, but correct)
            c = cols[i]
            grads[plan.iw(i)] = _weight_grad(ctx, plan.iw(i), lambda out, acc, c=c: _mm(
                c, x2, trans_a=True, out=out, beta=1.0 if acc else 0.0, out_dtype=gdt))
        if plan.bias and need[plan.ibias()]:
            ones = _ones_row(xp, N, dt)
            gb = _weight_grad(ctx, plan.ibias(), lambda out, acc: _mm(
                ones, g2, out=None if out is None else out.reshape(1, -1), beta=1.0 if acc else 0.0, out_dtype=gdt))
            grads[plan.ibias()] = None if gb is None else gb.reshape(-1)
        return tuple(grads)


# ================================================================================================ the layer
class _Adapter(Module):
    """One adapter matrix as a module with a ``weight`` (so its parameter is named ``lora_A.weight``, PEFT's)."""

    def __init__(self, data):
        self.weight = Parameter(data)

    def extra_repr(self):
        return f"{self.weight.shape[1]}, {self.weight.shape[0]}"


class LoRALinear(Linear):
    """A :class:`Linear` with a LoRA adapter: ``y = x W^T (+ b) + scaling * (dropout(x) A^T) B^T``.

    Shares the wrapped Linear's ``weight`` and ``bias`` parameters (frozen by :func:`apply_lora`); adds
    ``lora_A.weight`` [r, in], ``lora_B.weight`` [out, r], ``r``, ``lora_alpha``, ``scaling`` and ``lora_dropout``
    (a :class:`Dropout`, or None when p = 0). Made by :func:`apply_lora`; :func:`merge_lora` folds it back into a
    plain Linear.
    """

    def __init__(self, base, r, lora_alpha, scaling, A, *, dropout=None):
        if not isinstance(base, Linear) or isinstance(base, LoRALinear):
            raise TypeError(f"base: expected a cukernels.nn.Linear without an adapter; got {type(base).__name__}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.fused, self.training = base.fused, base.training
        self.r, self.lora_alpha, self.scaling = int(r), float(lora_alpha), float(scaling)
        xp = base.weight.xp
        self.lora_A = _Adapter(A)
        self.lora_B = _Adapter(xp.zeros((self.out_features, self.r), dtype=A.dtype))
        self.lora_dropout = dropout

    def forward(self, x):
        check_input(x, self.weight, self.in_features)
        if not self.fused:  # the composite reference: plain GEMM Functions on the tape
            y = project(self, x, self.weight, self.bias)
            xa = self.lora_dropout(x) if self.lora_dropout is not None else x
            d = project(self, project(self, xa, self.lora_A.weight), self.lora_B.weight)
            return F.add(y, F.mul(d, self.scaling))
        return lora_project(self, x, [self])

    @staticmethod
    def project_packed(module, x, linears):
        """``layers.project_packed``'s hook: the packed projections of a fused ``module`` (q / k / v, gate / up),
        some of them adapted, as one :class:`LoRAF`."""
        return lora_project(module, x, linears)

    def extra_repr(self):
        return super().extra_repr() + f", lora r={self.r}, alpha={self.lora_alpha:g}" + (
            f", dropout={self.lora_dropout.p:g}" if self.lora_dropout is not None else "")


def lora_project(module, x, linears):
    """``concat([lin(x) for lin in linears], axis=-1)`` through :class:`LoRAF`, autocast as ``layers.project``
    does: the GEMMs read the optimizer's bf16 shadows of the adapters, and the base weights as they are (bf16
    frozen weights) or their shadows. Linears without an adapter take part as plain projections."""
    x = autocast_input(x)
    ws, lows, ab, bias, xds, ranks, scales = [], [], [], [], [], [], []
    for lin in linears:
        wt, wl = weight_for_gemm(module, lin.weight)
        ws.append(wt)
        lows.append(wl)
    alows = []
    for lin in linears:
        if not isinstance(lin, LoRALinear):
            ranks.append(0)
            scales.append(0.0)
            continue
        ranks.append(lin.r)
        scales.append(lin.scaling)
        for p in (lin.lora_A.weight, lin.lora_B.weight):
            pt, pl = weight_for_gemm(module, p)
            ab.append(pt)
            alows.append(pl)
        d = lin.lora_dropout
        if d is not None and d.active():
            xds.append(d(x))
    if len(linears) == 1 and linears[0].bias is not None:
        bias.append(linears[0].bias)
    elif any(lin.bias is not None for lin in linears):
        raise ValueError("linears: packed projections with biases are not supported (packable() refuses them)")
    plan = _Plan([lin.out_features for lin in linears], ranks, scales, tuple(lows) + tuple(alows), bool(bias),
                 bool(xds))
    if xds and len(xds) != len(plan.adapted):
        raise RuntimeError("LoRA dropout is active on some adapters of a packed group and not others")
    return LoRAF.apply(x, plan, *ws, *ab, *bias, *xds)


# ================================================================================================ applying
def lora_modules(model):
    """``{name: LoRALinear}`` of the model, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def _parent(model, name):
    parent = model
    *path, leaf = name.split(".")
    for p in path:
        parent = getattr(parent, p)
    return parent, leaf


def _kaiming_a(rng, r, fan_in, dtype):
    """PEFT's A: ``nn.init.kaiming_uniform_(a=sqrt(5))``, i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return rng.uniform(-bound, bound, size=(r, fan_in)).astype(dtype)


def apply_lora(model, config: Optional[LoraConfig] = None, *, r=None, alpha=None, dropout=None, target_modules=None,
               use_rslora=None, exclude=None, seed=0, dtype=None, init=True, strict=True):
    """Add LoRA adapters to the Linears of ``model`` that ``target_modules`` names and freeze every other parameter
    (``requires_grad = False``: no gradient, no optimizer state). Returns the :class:`LoraConfig` applied.

    Args:
        model: any :class:`Module` (``ck.Llama``, ``ck.GPT2``, a block); models offer ``model.add_adapter``.
        config: a :class:`LoraConfig`, or build one from ``r`` (default 8), ``alpha`` (default r),
            ``dropout`` (0), ``target_modules`` (default ``"all-linear"``) and ``use_rslora`` (False).
        exclude: ``{module name: reason}`` of Linears that cannot take an adapter, added to what the model's own
            ``lora_exclude()`` names (a causal LM's output head, whose weight the fused head + loss reads directly);
            naming one is an error, ``all-linear`` skips them.
        seed: the NumPy seed of the A initialisation (the same on the CPU and the GPU).
        dtype: the adapters' dtype: float32 (default; the optimizer keeps fp32 masters and bf16 shadows of them),
            or float64 beside float64 weights (gradient checks).
        init: True: PEFT's initialisation (A kaiming-uniform, B zero); False: A zero as well (weights to be loaded).
        strict: every entry of a target list must match a Linear (a typo is an error; PEFT skips entries that
            match nothing as long as one does: ``strict=False``, what loading a PEFT folder uses).

    Raises ValueError when the targets match nothing (naming the model's Linears), a module that is not a Linear,
    an excluded one, or when the model already has adapters. The config is kept as ``model.lora_config``.

    Example::

        >>> model = ck.from_pretrained("Llama-3.2-1B", xp=cupy, dtype=ck.bfloat16)
        >>> ck.nn.apply_lora(model, r=16, alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        >>> [n for n, p in model.named_parameters() if p.requires_grad][:2]
        ['model.layers.0.self_attn.q_proj.lora_A.weight', 'model.layers.0.self_attn.k_proj.lora_A.weight']
    """
    if not isinstance(model, Module):
        raise TypeError(f"model: expected a cukernels.nn.Module; got {B._got(model)}")
    if config is None:
        rr = 8 if r is None else r
        config = LoraConfig(r=rr, lora_alpha=rr if alpha is None else alpha,
                            lora_dropout=0.0 if dropout is None else dropout,
                            target_modules=ALL_LINEAR if target_modules is None else target_modules,
                            use_rslora=False if use_rslora is None else use_rslora)
    elif not isinstance(config, LoraConfig):
        raise TypeError(f"config: expected a cukernels.nn.LoraConfig; got {B._got(config)}")
    elif any(v is not None for v in (r, alpha, dropout, target_modules, use_rslora)):
        raise TypeError("config: given together with r / alpha / dropout / target_modules / use_rslora; pass one")
    own = getattr(model, "lora_exclude", None)
    exclude = {**(own() if callable(own) else {}), **dict(exclude or {})}
    B.check_int("seed", seed, min=0)
    init, strict = B.check_bool("init", init), B.check_bool("strict", strict)
    existing = lora_modules(model)
    if existing:
        raise ValueError(f"model: already has LoRA adapters ({next(iter(existing))}, ...); merge_lora() or load a "
                         f"fresh model first (one adapter per model)")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    if config.is_all_linear():
        chosen = [n for n in linears if n not in exclude]
    else:
        t = config.target_modules
        hits = [n for n, m in model.named_modules() if n and target_matches(t, n)]
        bad = [n for n in hits if n not in linears]
        if bad:
            kind = type(dict(model.named_modules())[bad[0]]).__name__
            raise ValueError(f"target_modules: {bad[0]!r} is a {kind}; LoRA adapts Linear layers only (name its "
                             f"projections, e.g. {_examples(linears)})")
        for n in hits:
            if n in exclude:
                raise ValueError(f"target_modules: {n!r} cannot take an adapter: {exclude[n]}")
        chosen = hits
        if strict and isinstance(t, tuple):  # stricter than PEFT: every listed name must match (a typo is not skipped)
            unmatched = [e for e in t if not any(target_matches((e,), n) for n in hits)]
            if unmatched:
                raise ValueError(f"target_modules: {unmatched[0]!r} matches no Linear of this model; its Linears "
                                 f"are named {_examples(linears)}")
    if not chosen:
        raise ValueError(f"target_modules: {config.target_modules!r} matches no Linear of this model; its Linears "
                         f"are named {_examples(linears)}")
    first = next(iter(linears.values())).weight
    if dtype is None:
        dtype = np.float64 if first.dtype == np.float64 else np.float32
    dtype = B.check_dtype_arg("dtype", dtype, (np.dtype(np.float32), np.dtype(np.float64)))
    xp = first.xp
    rng = np.random.default_rng(seed)
    drng = None
    if config.lora_dropout > 0:
        drng = getattr(model, "dropout_rng", None)
        if drng is None:  # (GPT-2 has one; LLaMA gets one: the model's forward opens its scope, base.py)
            drng = model.__dict__["dropout_rng"] = DropoutRNG(seed, xp)
    for p in model.parameters():
        p.requires_grad = False
        p.grad = None
    for name in chosen:
        base = linears[name]
        r = config.rank_for(name)
        A = _kaiming_a(rng, r, base.in_features, dtype) if init else np.zeros((r, base.in_features), dtype)
        drop = Dropout(config.lora_dropout, drng.new_site()) if drng is not None else None
        if drop is not None:
            drop.training = base.training
        lin = LoRALinear(base, r, config.alpha_for(name), config.scaling_for(name), xp.asarray(A), dropout=drop)
        parent, leaf = _parent(model, name)
        setattr(parent, leaf, lin)
        for pn, p in (("lora_A.weight", lin.lora_A.weight), ("lora_B.weight", lin.lora_B.weight)):
            p.name = f"{name}.{pn}"
    pack_frozen(model)
    model.__dict__.pop("_fast_decode_checked", None)  # (a model's cached "fused decode applies": not any more)
    model.__dict__["lora_config"] = config
    return config


def pack_frozen(model):
    """Lay the frozen weights of sibling Linears that read one input back to back in one buffer (the parameters
    become row views of it, in attribute order: q, k, v, o; gate, up), so the packed projections' base GEMMs are
    one GEMM each way, as the optimizer's flat buffers make them in a full fine-tune (``functional.joined_rows``).
    One copy per group at a time; weights already adjacent, with a bias, trainable or of other widths stay as they
    are. Returns the number of groups packed."""
    done = 0
    for parent in model.modules():
        groups = {}
        for v in parent.__dict__.values():
            if isinstance(v, Linear) and v.bias is None and not v.weight.requires_grad:
                w = v.weight.data
                if w.ndim == 2 and w.flags.c_contiguous:
                    groups.setdefault((v.in_features, w.dtype.str, type(w)), []).append(v)
        for lins in groups.values():
            ws = [lin.weight.data for lin in lins]
            if len(ws) < 2 or joined_rows(ws) is not None:
                continue
            xp = _xp(ws[0])
            buf = xp.empty((sum(w.shape[0] for w in ws), ws[0].shape[1]), dtype=ws[0].dtype)
            row = 0
            for lin, w in zip(lins, ws):
                buf[row:row + w.shape[0]] = w
                lin.weight.data = buf[row:row + w.shape[0]]
                row += w.shape[0]
            done += 1
    return done


def _examples(linears, n=6):
    leaves = list(dict.fromkeys(k.rpartition(".")[2] for k in linears))
    return ", ".join(leaves[:n]) + (" ..." if len(leaves) > n else "") if leaves else "(none)"


def _plain(lin):
    """The plain :class:`Linear` under a LoRALinear (the same weight and bias parameters)."""
    base = Linear.__new__(Linear)
    base.in_features, base.out_features = lin.in_features, lin.out_features
    base.weight, base.bias = lin.weight, lin.bias
    base.fused, base.training = lin.fused, lin.training
    return base


def remove_lora(model):
    """Take every adapter off unmerged (the plain Linears back, the base weights untouched). Returns the names."""
    mods = lora_modules(model)
    for name, lin in mods.items():
        parent, leaf = _parent(model, name)
        setattr(parent, leaf, _plain(lin))
    model.__dict__.pop("lora_config", None)
    model.__dict__.pop("_fast_decode_checked", None)
    return list(mods)


def merge_lora(model):
    """Fold every adapter into its base weight, ``W += scaling * B @ A`` (computed in fp32, rounded once into W's
    dtype, in place: an optimizer's or a decode packing's views stay bound), and put the plain Linear back. Returns
    the names merged. The base parameters stay frozen."""
    mods = lora_modules(model)
    for name, lin in mods.items():
        W = lin.weight.data
        xp = _xp(W)
        Bm = lin.lora_B.weight.data.astype(np.float32, copy=False)
        Am = lin.lora_A.weight.data.astype(np.float32, copy=False)
        Wf = W.astype(np.float32) if W.dtype != np.float64 else W.copy()
        if Wf.dtype == np.float64:
            Wf += lin.scaling * (lin.lora_B.weight.data.astype(np.float64) @ lin.lora_A.weight.data.astype(np.float64))
        else:
            matmul(xp.ascontiguousarray(Bm), xp.ascontiguousarray(Am), out=Wf, alpha=lin.scaling, beta=1.0)
        W[...] = Wf.astype(W.dtype)
    remove_lora(model)
    return list(mods)


def lora_state_dict(model):
    """``{parameter name: array}`` of every adapter (``<module>.lora_A.weight`` / ``.lora_B.weight``)."""
    out = {}
    for name, lin in lora_modules(model).items():
        out[f"{name}.lora_A.weight"] = lin.lora_A.weight.data
        out[f"{name}.lora_B.weight"] = lin.lora_B.weight.data
    return out


def load_lora_state_dict(model, arrays, where="arrays"):
    """Copy ``{name: array}`` into the adapters in place, after checking the names and shapes are exactly the
    model's adapters' (ValueError naming ``where`` and the first disagreements; nothing is copied then)."""
    mine = lora_state_dict(model)
    missing = sorted(set(mine) - set(arrays))
    extra = sorted(set(arrays) - set(mine))
    problems = []
    if missing:
        problems.append(f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    if extra:
        problems.append(f"unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}")
    for k in sorted(set(mine) & set(arrays)):
        if tuple(arrays[k].shape) != tuple(mine[k].shape):
            problems.append(f"{k}: shape {tuple(arrays[k].shape)}, the model's adapter is {tuple(mine[k].shape)}")
    if problems:
        raise ValueError(f"{where}: does not fit this model's adapters: " + "; ".join(problems[:5]))
    params = {}
    for name, lin in lora_modules(model).items():
        params[f"{name}.lora_A.weight"] = lin.lora_A.weight
        params[f"{name}.lora_B.weight"] = lin.lora_B.weight
    for k, p in params.items():
        v = arrays[k]
        v = v.get() if (hasattr(v, "get") and p.xp is np) else v
        if p.xp is np:
            p.data[...] = np.asarray(v).astype(p.dtype, copy=False)
        else:
            if B._kind(v) is None:
                v = np.ascontiguousarray(np.asarray(v).astype(p.dtype, copy=False))
            p.data[...] = p.xp.asarray(v).astype(p.dtype, copy=False)


def trainable_parameters(model):
    """``[(name, parameter)]`` of the parameters that require a gradient, in the order an optimizer should lay them
    out: the model's order, except that the adapters of sibling projections come A's first, then B's
    (``q.lora_A, k.lora_A, v.lora_A, o.lora_A, q.lora_B, ...``), so the A matrices of a packed group and their
    gradients lie back to back in the flat buffers and :class:`LoRAF` reads and writes them as one GEMM operand."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = {}
    for name, lin in lora_modules(model).items():
        g = groups.setdefault(name.rpartition(".")[0], ([], []))
        g[0].append((f"{name}.lora_A.weight", lin.lora_A.weight))
        g[1].append((f"{name}.lora_B.weight", lin.lora_B.weight))
    where = {}
    for gname, (As, Bs) in groups.items():
        for _, p in As + Bs:
            where[id(p)] = gname
    out, done = [], set()
    for n, p in named:
        g = where.get(id(p))
        if g is None:
            out.append((n, p))
        elif g not in done:
            done.add(g)
            As, Bs = groups[g]
            out.extend((an, ap) for an, ap in As + Bs if ap.requires_grad)
    return out
