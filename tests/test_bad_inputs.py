"""A newcomer's bad inputs to the kernel ops (issue 13): each raises TypeError / ValueError naming the argument.

CPU cases run on NumPy arrays (the reference path, which shares every check with the kernel path). Device
hyperparameters of Adam (0-d CuPy arrays) cannot be checked on the host without a sync: the kernels check
them, write nothing, and set the error word (GPU cases at the end).
"""
import numpy as np
import pytest

import cukernels as ck
from cukernels.ops import adam as A
from helpers import randn, to_host

F32, BF16 = np.float32, np.dtype(ck.bfloat16)


def f(*shape, dtype=F32):
    return np.zeros(shape, dtype)


def ro(*shape, dtype=F32):
    """A read-only NumPy array (np.broadcast_to views, np.frombuffer of bytes, ... are read-only)."""
    a = np.zeros(shape, dtype)
    a.flags.writeable = False
    return a


def adam_bufs(n=8):
    return f(n), f(n), f(n), f(n)


def rows_bufs():
    return f(4, 3), f(4, 3), f(4, 3), f(4, 3), np.array([0, 2], np.int32), np.array(2, np.int32)


def tensor(a, requires_grad=True):
    return ck.Tensor(a, requires_grad=requires_grad)


LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def llama3(**kw):
    return dict(LLAMA3, **kw)


def rope_cache(**kw):
    return ck.rope_cache(**dict(dict(seq_len=4, head_dim=8, xp=np), **kw))


def adam(**kw):
    return ck.adam_step(*adam_bufs(), **dict(dict(lr=1e-3, step=1), **kw))


def adam_rows(**kw):
    return ck.adam_step_rows(*rows_bufs(), **dict(dict(lr=1e-3, step=1), **kw))


# (id, call, exception, regex): the regex must name the argument (and usually what was expected).
CASES = [
    # ---- Adam hyperparameters as plain numbers: torch.optim.AdamW's ranges
    ("adam-lr-negative", lambda: adam(lr=-1e-3), ValueError, r"^lr: expected a finite number >= 0"),
    ("adam-lr-nan", lambda: adam(lr=np.nan), ValueError, r"^lr: expected a finite number"),
    ("adam-lr-inf", lambda: adam(lr=np.inf), ValueError, r"^lr: expected a finite number"),
    ("adam-lr-str", lambda: adam(lr="1e-3"), TypeError, r"^lr: expected a number or a 0-d float32 array"),
    ("adam-lr-None", lambda: adam(lr=None), TypeError, r"^lr: expected a number"),
    ("adam-wd-negative", lambda: adam(weight_decay=-1), ValueError, r"^weight_decay: expected a finite number >= 0"),
    ("adam-wd-nan", lambda: adam(weight_decay=np.nan), ValueError, r"^weight_decay: expected a finite number"),
    ("adam-wd-str", lambda: adam(weight_decay="0.1"), TypeError, r"^weight_decay: expected a real number"),
    ("adam-beta1-one", lambda: adam(beta1=1.0), ValueError, r"^beta1: expected a finite number in \[0, 1\)"),
    ("adam-beta2-negative", lambda: adam(beta2=-0.1), ValueError, r"^beta2: expected a finite number in \[0, 1\)"),
    ("adam-beta1-str", lambda: adam(beta1="0.9"), TypeError, r"^beta1: expected a real number"),
    ("adam-eps-zero", lambda: adam(eps=0.0), ValueError, r"^eps: expected a finite number > 0"),
    ("adam-eps-underflows-fp32", lambda: adam(eps=1e-50), ValueError, r"^eps: expected a number > 0 in float32"),
    ("adam-eps-None", lambda: adam(eps=None), TypeError, r"^eps: expected a real number"),
    ("adam-step-1.5", lambda: adam(step=1.5), ValueError, r"^step: expected the 1-based step number, an integer >= 1"),
    ("adam-step-inf", lambda: adam(step=np.inf), ValueError, r"^step: expected the 1-based step number"),
    ("adam-step-nan", lambda: adam(step=np.nan), ValueError, r"^step: expected the 1-based step number"),
    ("adam-step-zero", lambda: adam(step=0), ValueError, r"^step: expected the 1-based step number"),
    ("adam-step-negative", lambda: adam(step=-3), ValueError, r"^step: expected the 1-based step number"),
    ("adam-step-huge", lambda: adam(step=2**60), ValueError, r"^step: .*at most 2\*\*53"),
    ("adam-step-bool", lambda: adam(step=True), TypeError, r"^step: expected the 1-based step number"),
    ("adam-step-str", lambda: adam(step="3"), TypeError, r"^step: expected the 1-based step number"),
    ("adam-grad_scale-negative", lambda: adam(grad_scale=-1.0), ValueError, r"^grad_scale: expected a finite number >= 0"),
    ("adam-grad_scale-nan", lambda: adam(grad_scale=np.nan), ValueError, r"^grad_scale: expected a finite number"),
    # ---- Adam hyperparameters as 0-d NumPy arrays: checked at once (they skipped the checks before)
    ("adam-lr-array-nan", lambda: adam(lr=np.array(np.nan, F32)), ValueError, r"^lr: the 0-d array holds nan"),
    ("adam-lr-array-negative", lambda: adam(lr=np.array(-1e-3, F32)), ValueError, r"^lr: the 0-d array holds"),
    ("adam-step-array-zero", lambda: adam(step=np.array(0)), ValueError, r"^step: the 0-d array holds 0;"),
    ("adam-step-array-negative", lambda: adam(step=np.array(-3, np.int32)), ValueError, r"^step: the 0-d array holds -3"),
    ("adam-step-array-nan", lambda: adam(step=np.array(np.nan, F32)), ValueError, r"^step: the 0-d array holds nan"),
    ("adam-step-array-1.5", lambda: adam(step=np.array(1.5, F32)), ValueError, r"^step: the 0-d array holds 1.5"),
    ("adam-grad_scale-array-nan", lambda: adam(grad_scale=np.array(np.nan, F32)), ValueError,
     r"^grad_scale: the 0-d array holds nan"),
    ("adam-grad_scale-array-inf", lambda: adam(grad_scale=np.array(np.inf, F32)), ValueError,
     r"^grad_scale: the 0-d array holds inf"),
    ("adam-step-array-int16", lambda: adam(step=np.array(1, np.int16)), TypeError, r"^step: expected dtype"),
    ("adam-param-float64", lambda: ck.adam_step(f(8).astype(np.float64), f(8), f(8), f(8), lr=1e-3, step=1),
     TypeError, r"^param: expected dtype float32; got float64 \(.*float32 or bfloat16 only"),
    ("adam-param-read-only", lambda: ck.adam_step(ro(8), f(8), f(8), f(8), lr=1e-3, step=1), ValueError,
     r"^param: is read-only"),
    ("adam-exp_avg_sq-read-only", lambda: ck.adam_step(f(8), f(8), f(8), ro(8), lr=1e-3, step=1), ValueError,
     r"^exp_avg_sq: is read-only"),
    ("adam-shadow-read-only", lambda: adam(shadow=ro(8, dtype=BF16)), ValueError, r"^shadow: is read-only"),
    ("adam-error-not-0d", lambda: adam(error=np.zeros(2, np.int32)), ValueError, r"^error: expected a 0-d array"),
    # ---- adam_step_rows: the same checks
    ("rows-lr-array-nan", lambda: adam_rows(lr=np.array(np.nan, F32)), ValueError, r"^lr: the 0-d array holds nan"),
    ("rows-step-array-zero", lambda: adam_rows(step=np.array(0, np.int32)), ValueError, r"^step: the 0-d array"),
    ("rows-grad_scale-array-nan", lambda: adam_rows(grad_scale=np.array(np.nan, F32)), ValueError, r"^grad_scale:"),
    ("rows-lr-negative", lambda: adam_rows(lr=-1.0), ValueError, r"^lr: expected a finite number >= 0"),
    ("rows-step-1.5", lambda: adam_rows(step=1.5), ValueError, r"^step: expected the 1-based step number"),
    ("rows-wd-negative", lambda: adam_rows(weight_decay=-0.1), ValueError, r"^weight_decay:"),
    ("zero_rows-buf-read-only", lambda: ck.zero_rows(ro(4, 3), np.zeros(1, np.int32), np.array(1, np.int32)),
     ValueError, r"^buf: is read-only"),
    # ---- tick / warmup_cosine / clip_scale / global_norm
    ("tick-increment-negative", lambda: A.tick(np.array(0, np.int32), np.array(0, F32), increment=-1), ValueError,
     r"^increment: expected an integer in \[0, "),
    ("tick-increment-float", lambda: A.tick(np.array(0, np.int32), np.array(0, F32), increment=1.5), TypeError,
     r"^increment: expected an integer"),
    ("tick-step-read-only", lambda: A.tick(ro(dtype=np.int32), np.array(0, F32)), ValueError, r"^step: is read-only"),
    ("tick-schedule-not-tuple", lambda: A.tick(np.array(0, np.int32), np.array(0, F32), schedule="cosine"),
     TypeError, r"^schedule: expected None or a \(max_lr, min_lr, warmup, total\)"),
    ("tick-schedule-total-lt-warmup", lambda: A.tick(np.array(0, np.int32), np.array(0, F32),
                                                     schedule=(1.0, 0.1, 10, 5)),
     ValueError, r"^schedule\[3\] \(total\): expected an integer in \[10, "),
    ("tick-schedule-max_lr-nan", lambda: A.tick(np.array(0, np.int32), np.array(0, F32),
                                                schedule=(np.nan, 0.1, 1, 5)),
     ValueError, r"^schedule\[0\] \(max_lr\): expected a finite number >= 0"),
    ("warmup_cosine-t-negative", lambda: A.warmup_cosine(-1, 1.0, 0.1, 10, 100), ValueError, r"^t: expected a finite number >= 0"),
    ("warmup_cosine-min_lr-negative", lambda: A.warmup_cosine(1, 1.0, -0.1, 10, 100), ValueError, r"^schedule\[1\] \(min_lr\)"),
    ("warmup_cosine-warmup-float", lambda: A.warmup_cosine(1, 1.0, 0.1, 2.5, 100), TypeError, r"^schedule\[2\] \(warmup\)"),
    ("clip_scale-max_norm-str", lambda: ck.clip_scale(np.array(1.0, F32), "1.0"), TypeError, r"^max_norm: expected a real number"),
    ("clip_scale-max_norm-zero", lambda: ck.clip_scale(np.array(1.0, F32), 0.0), ValueError, r"^max_norm: expected a finite number > 0"),
    ("clip_scale-max_norm-inf", lambda: ck.clip_scale(np.array(1.0, F32), np.inf), ValueError, r"^max_norm: expected a finite number"),
    ("clip_scale-out-read-only", lambda: ck.clip_scale(np.array(1.0, F32), 1.0, out=ro()), ValueError, r"^out: is read-only"),
    ("global_norm-out-read-only", lambda: ck.global_norm([f(3)], out=ro()), ValueError, r"^out: is read-only"),
    # ---- rope_cache: numbers and the scaling dict (factor 0.0 returned NaN tables, -1 was accepted)
    ("rope-linear-factor-zero", lambda: rope_cache(scaling={"rope_type": "linear", "factor": 0.0}), ValueError,
     r"^scaling\['factor'\]: expected a finite number > 0"),
    ("rope-linear-factor-negative", lambda: rope_cache(scaling={"rope_type": "linear", "factor": -1}), ValueError,
     r"^scaling\['factor'\]: expected a finite number > 0"),
    ("rope-linear-factor-nan", lambda: rope_cache(scaling={"type": "linear", "factor": np.nan}), ValueError,
     r"^scaling\['factor'\]"),
    ("rope-linear-factor-str", lambda: rope_cache(scaling={"rope_type": "linear", "factor": "2"}), TypeError,
     r"^scaling\['factor'\]: expected a real number"),
    ("rope-linear-factor-missing", lambda: rope_cache(scaling={"rope_type": "linear"}), ValueError,
     r"^scaling: rope_type 'linear' needs keys \['factor'\]"),
    ("rope-llama3-factor-zero", lambda: rope_cache(scaling=llama3(factor=0)), ValueError, r"^scaling\['factor'\]"),
    ("rope-llama3-low-zero", lambda: rope_cache(scaling=llama3(low_freq_factor=0.0)), ValueError,
     r"^scaling\['low_freq_factor'\]: expected a finite number > 0"),
    ("rope-llama3-high-not-above-low", lambda: rope_cache(scaling=llama3(high_freq_factor=1.0)), ValueError,
     r"^scaling\['high_freq_factor'\]: expected a number > low_freq_factor"),
    ("rope-llama3-orig-zero", lambda: rope_cache(scaling=llama3(original_max_position_embeddings=0)), ValueError,
     r"^scaling\['original_max_position_embeddings'\]: expected an integer >= 1"),
    ("rope-llama3-orig-float", lambda: rope_cache(scaling=llama3(original_max_position_embeddings=8192.5)), TypeError,
     r"^scaling\['original_max_position_embeddings'\]: expected an integer"),
    ("rope-llama3-missing-key", lambda: rope_cache(scaling={"rope_type": "llama3", "factor": 8.0}), ValueError,
     r"^scaling: rope_type 'llama3' needs keys"),
    ("rope-type-unknown", lambda: rope_cache(scaling={"rope_type": "yarn", "factor": 4.0}), ValueError,
     r"^scaling: rope_type 'yarn' is not supported"),
    ("rope-scaling-list", lambda: rope_cache(scaling=[("factor", 2.0)]), TypeError, r"^scaling: expected None or a dict"),
    ("rope-seq_len-str", lambda: rope_cache(seq_len="4"), TypeError, r"^seq_len: expected an integer"),
    ("rope-seq_len-zero", lambda: rope_cache(seq_len=0), ValueError, r"^seq_len: expected an integer >= 1"),
    ("rope-head_dim-odd", lambda: rope_cache(head_dim=7), ValueError, r"^head_dim: expected an even integer >= 2"),
    ("rope-head_dim-float", lambda: rope_cache(head_dim=8.0), TypeError, r"^head_dim: expected an integer"),
    ("rope-theta-zero", lambda: rope_cache(theta=0.0), ValueError, r"^theta: expected a finite number > 0"),
    ("rope-theta-None", lambda: rope_cache(theta=None), TypeError, r"^theta: expected a real number"),
    ("rope-xp-bad", lambda: rope_cache(xp="numpy"), TypeError, r"^xp: expected numpy, cupy or None"),
    ("rope-interleaved-str", lambda: ck.rope(f(1, 2, 1, 4), *ck.rope_cache(2, 4, xp=np), interleaved="no"), TypeError,
     r"^interleaved: expected True or False"),
    ("rope-out-read-only", lambda: ck.rope(f(1, 2, 1, 4), *ck.rope_cache(2, 4, xp=np), out=ro(1, 2, 1, 4)), ValueError,
     r"^out: is read-only"),
    # ---- eps and the other numbers of the norms, softmax, cross-entropy, embedding, elementwise, matmul
    ("rms_norm-eps-str", lambda: ck.rms_norm(f(2, 4), f(4), eps="1e-5"), TypeError, r"^eps: expected a real number; got str"),
    ("rms_norm-eps-None", lambda: ck.rms_norm(f(2, 4), f(4), eps=None), TypeError, r"^eps: expected a real number; got NoneType"),
    ("rms_norm-eps-zero", lambda: ck.rms_norm(f(2, 4), f(4), eps=0.0), ValueError, r"^eps: expected a finite number > 0"),
    ("rms_norm-eps-nan", lambda: ck.rms_norm(f(2, 4), f(4), eps=np.nan), ValueError, r"^eps: expected a finite number > 0"),
    ("rms_norm-eps-array", lambda: ck.rms_norm(f(2, 4), f(4), eps=np.array(1e-5)), TypeError, r"^eps: expected a real number"),
    ("rms_norm-return_rstd-str", lambda: ck.rms_norm(f(2, 4), f(4), return_rstd="yes"), TypeError, r"^return_rstd: expected True or False"),
    ("layer_norm-eps-str", lambda: ck.layer_norm(f(2, 4), f(4), f(4), eps="1e-5"), TypeError, r"^eps: expected a real number"),
    ("layer_norm-eps-negative", lambda: ck.layer_norm(f(2, 4), f(4), f(4), eps=-1e-5), ValueError, r"^eps: expected a finite number > 0"),
    ("layer_norm-return_stats-int", lambda: ck.layer_norm(f(2, 4), f(4), f(4), return_stats=1), TypeError, r"^return_stats:"),
    ("softmax-axis-str", lambda: ck.softmax(f(2, 4), axis="-1"), TypeError, r"^axis: expected an integer"),
    ("softmax-axis-first", lambda: ck.softmax(f(2, 4), axis=0), ValueError, r"^axis: only the last axis"),
    ("attn_softmax-scale-None", lambda: ck.attn_softmax(f(1, 1, 2, 2), scale=None), TypeError, r"^scale: expected a real number"),
    ("attn_softmax-scale-nan", lambda: ck.attn_softmax(f(1, 1, 2, 2), scale=np.nan), ValueError, r"^scale: expected a finite number"),
    ("attn_softmax-scale-huge", lambda: ck.attn_softmax(f(1, 1, 2, 2), scale=1e300), ValueError, r"^scale: .*finite in float32"),
    ("attn_softmax-causal-str", lambda: ck.attn_softmax(f(1, 1, 2, 2), causal="False"), TypeError, r"^causal: expected True or False"),
    ("attn_softmax_backward-scale-str", lambda: ck.attn_softmax_backward(f(1, 1, 2, 2), f(1, 1, 2, 2), scale="1"), TypeError, r"^scale:"),
    ("ce-ignore_index-float", lambda: ck.cross_entropy(f(2, 4), np.zeros(2, np.int32), ignore_index=-100.0), TypeError,
     r"^ignore_index: expected an integer"),
    ("ce-ignore_index-str", lambda: ck.cross_entropy(f(2, 4), np.zeros(2, np.int32), ignore_index="-100"), TypeError,
     r"^ignore_index: expected an integer"),
    ("ce-label_smoothing-above-1", lambda: ck.cross_entropy(f(2, 4), np.zeros(2, np.int32), label_smoothing=1.5), ValueError,
     r"^label_smoothing: expected a finite number in \[0, 1\]"),
    ("ce-label_smoothing-negative", lambda: ck.cross_entropy(f(2, 4), np.zeros(2, np.int32), label_smoothing=-0.1), ValueError,
     r"^label_smoothing: expected a finite number in \[0, 1\]"),
    ("ce-label_smoothing-str", lambda: ck.cross_entropy(f(2, 4), np.zeros(2, np.int32), label_smoothing="0.1"), TypeError,
     r"^label_smoothing: expected a real number"),
    ("ce-reduction-None", lambda: ck.cross_entropy(f(2, 4), np.zeros(2, np.int32), reduction=None), ValueError, r"^reduction: expected one of"),
    ("ce-return_lse-str", lambda: ck.cross_entropy(f(2, 4), np.zeros(2, np.int32), return_lse="no"), TypeError, r"^return_lse:"),
    ("ce-out-read-only", lambda: ck.cross_entropy(f(2, 4), np.zeros(2, np.int32), out=ro()), ValueError, r"^out: is read-only"),
    ("ce-out-wrong-shape", lambda: ck.cross_entropy(f(2, 4), np.zeros(2, np.int32), reduction="none", out=f(3)), ValueError,
     r"^out: expected shape \(2,\)"),
    ("ce_backward-dloss-nan", lambda: ck.cross_entropy_backward(f(2, 4), np.zeros(2, np.int32), f(2), np.nan), ValueError,
     r"^dloss: expected a finite number"),
    ("ce_backward-dloss-str", lambda: ck.cross_entropy_backward(f(2, 4), np.zeros(2, np.int32), f(2), "1"), TypeError, r"^dloss:"),
    ("ce_fused-out-read-only", lambda: ck.cross_entropy_fused(f(2, 4), np.zeros(2, np.int32), out=ro(2, 4)), ValueError,
     r"^out: is read-only"),
    ("embedding_backward-vocab_size-str", lambda: ck.embedding_backward(np.zeros(2, np.int32), f(2, 3), "10"), TypeError,
     r"^vocab_size: expected an integer"),
    ("embedding_backward-vocab_size-zero", lambda: ck.embedding_backward(np.zeros(2, np.int32), f(2, 3), 0), ValueError,
     r"^vocab_size: expected an integer >= 1"),
    ("embedding_backward-vocab_size-float", lambda: ck.embedding_backward(np.zeros(2, np.int32), f(2, 3), 10.0), TypeError,
     r"^vocab_size: expected an integer"),
    ("embedding_backward-accumulate-str", lambda: ck.embedding_backward(np.zeros(2, np.int32), f(2, 3), 4, out=f(4, 3),
                                                                          accumulate="yes"), TypeError, r"^accumulate:"),
    ("embedding-out-read-only", lambda: ck.embedding(np.zeros(2, np.int32), f(4, 3), out=ro(2, 3)), ValueError, r"^out: is read-only"),
    ("SparseRowGrad-vocab_size-zero", lambda: ck.SparseRowGrad(0, 4, xp=np), ValueError, r"^vocab_size: expected an integer >= 1"),
    ("SparseRowGrad-dim-str", lambda: ck.SparseRowGrad(4, "4", xp=np), TypeError, r"^dim: expected an integer"),
    ("SparseRowGrad-dtype-float64", lambda: ck.SparseRowGrad(4, 4, np.float64, xp=np), TypeError,
     r"^dtype: expected float32 or bfloat16; got float64"),
    ("add-alpha-str", lambda: ck.add(f(3), f(3), alpha="2"), TypeError, r"^alpha: expected a real number"),
    ("add-alpha-inf", lambda: ck.add(f(3), f(3), alpha=np.inf), ValueError, r"^alpha: expected a finite number"),
    ("add-dtype-float64", lambda: ck.add(f(3), f(3), dtype=np.float64), TypeError, r"^dtype: expected float32 or bfloat16"),
    ("add-out-read-only", lambda: ck.add(f(3), f(3), out=ro(3)), ValueError, r"^out: is read-only"),
    ("cast-dtype-int8", lambda: ck.cast(f(3), np.int8), TypeError, r"^dtype: expected float32 or bfloat16; got int8"),
    ("cast-dtype-None", lambda: ck.cast(f(3), None), TypeError, r"^dtype: expected float32 or bfloat16; got None"),
    ("cast-dtype-garbage", lambda: ck.cast(f(3), "fp33"), TypeError, r"^dtype: expected a dtype"),
    ("gelu-out-read-only", lambda: ck.gelu(f(3), out=ro(3)), ValueError, r"^out: is read-only"),
    ("swiglu_backward-out_dup-read-only", lambda: ck.swiglu_backward(f(3), f(3), f(3), out_dup=ro(3)), ValueError,
     r"^out_dup: is read-only"),
    ("softmax-out-read-only", lambda: ck.softmax(f(2, 3), out=ro(2, 3)), ValueError, r"^out: is read-only"),
    ("layer_norm_backward-out-read-only", lambda: ck.layer_norm_backward(f(2, 3), f(2, 3), f(3), f(2), f(2), out=ro(2, 3)),
     ValueError, r"^out: is read-only"),
    ("rms_norm-out-read-only", lambda: ck.rms_norm(f(2, 4), f(4), out=ro(2, 4)), ValueError, r"^out: is read-only"),
    ("matmul-alpha-str", lambda: ck.matmul(f(2, 3), f(3, 2), alpha="1"), TypeError, r"^alpha: expected a real number"),
    ("matmul-beta-nan", lambda: ck.matmul(f(2, 3), f(3, 2), out=f(2, 2), beta=np.nan), ValueError, r"^beta: expected a finite number"),
    ("matmul-trans_a-str", lambda: ck.matmul(f(3, 2), f(3, 2), trans_a="yes"), TypeError, r"^trans_a: expected True or False"),
    ("matmul-out_dtype-int8", lambda: ck.matmul(f(2, 3), f(3, 2), out_dtype=np.int8), TypeError, r"^out_dtype: expected"),
    ("matmul-out-read-only", lambda: ck.matmul(f(2, 3), f(3, 2), out=ro(2, 2)), ValueError, r"^out: is read-only"),
    # ---- NumPy's default float64: the message says float32 / bfloat16 only
    ("rms_norm-float64", lambda: ck.rms_norm(np.zeros((2, 4)), f(4)), TypeError,
     r"^x: expected dtype float32, bfloat16; got float64 \(the ops take float32 or bfloat16 only"),
    ("softmax-float64", lambda: ck.softmax(np.zeros((2, 4))), TypeError, r"^x: expected dtype .*float32 or bfloat16 only"),
    ("add-float64", lambda: ck.add(np.zeros(3), f(3)), TypeError, r"^a: expected dtype .*float32 or bfloat16 only"),
    ("gelu-float64", lambda: ck.gelu(np.zeros(3)), TypeError, r"^x: expected dtype .*x\.astype\(numpy\.float32\)"),
    # ---- an autograd Tensor given to a kernel op: use ck.functional.<op>, or pass .data
    ("tensor-rms_norm", lambda: ck.rms_norm(tensor(f(2, 4)), f(4)), TypeError,
     r"^x: got a cukernels autograd Tensor; ck\.rms_norm takes arrays: use ck\.functional\.rms_norm"),
    ("tensor-rms_norm-weight", lambda: ck.rms_norm(f(2, 4), tensor(f(4))), TypeError, r"^weight: .*ck\.functional\.rms_norm"),
    ("tensor-softmax", lambda: ck.softmax(tensor(f(2, 4))), TypeError, r"^x: .*ck\.functional\.softmax"),
    ("parameter-rms_norm-weight", lambda: ck.rms_norm(f(2, 4), ck.nn.Parameter(f(4))), TypeError,
     r"^weight: got a cukernels autograd Tensor; .*ck\.functional\.rms_norm"),
    ("tensor-layer_norm-kw", lambda: ck.layer_norm(x=tensor(f(2, 4)), gamma=f(4), beta=f(4)), TypeError,
     r"^x: .*ck\.functional\.layer_norm"),
    ("tensor-matmul", lambda: ck.matmul(tensor(f(2, 3)), f(3, 2)), TypeError, r"^a: .*ck\.functional\.matmul"),
    ("tensor-no-grad-cross_entropy", lambda: ck.cross_entropy(tensor(f(2, 4), False), np.zeros(2, np.int32)), TypeError,
     r"^logits: .*ck\.functional\.cross_entropy"),
    ("tensor-backward-op", lambda: ck.rms_norm_backward(tensor(f(2, 4)), f(2, 4), f(4), f(2)), TypeError,
     r"^dy: got a cukernels autograd Tensor; .*pass dy\.data"),
    ("tensor-adam", lambda: ck.adam_step(tensor(f(8)), f(8), f(8), f(8), lr=1e-3, step=1), TypeError, r"^param: .*pass param\.data"),
    ("tensor-global_norm-list", lambda: ck.global_norm([f(3), tensor(f(3))]), TypeError, r"^arrays\[1\]: .*cukernels autograd Tensor"),
    # ---- mixing, and things that are not arrays at all (unchanged behaviour, still named)
    ("list-as-array", lambda: ck.gelu([1.0, 2.0]), TypeError, r"^x: expected a numpy\.ndarray or cupy\.ndarray, got list"),
]


@pytest.mark.parametrize("call, exc, regex", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(call, exc, regex):
    with pytest.raises(exc, match=regex):
        call()


def test_case_ids_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))


def test_valid_edges_are_accepted():
    """The ranges are not too tight: the boundary values that are valid still work."""
    p, g, m, v = adam_bufs()
    ck.adam_step(p, g, m, v, lr=0.0, step=np.int64(1), beta1=0.0, beta2=0.0, weight_decay=0.0, eps=1e-30)
    ck.adam_step(p, g, m, v, lr=1e-3, step=2.0, grad_scale=0.0)  # an integral float step; a zero scale
    ck.adam_step(p, g, m, v, lr=np.array(0.0, F32), step=np.array(3, np.int64), grad_scale=np.array(0.0, F32))
    ck.adam_step(p, g, m, v, lr=1e-3, step=2**53)
    assert np.isfinite(p).all()
    assert A.warmup_cosine(0, 1.0, 0.0, 0, 0) == 0.0
    cos, sin = ck.rope_cache(16, 8, scaling={"rope_type": "linear", "factor": np.float32(2)}, xp=np)
    assert np.isfinite(cos).all() and np.isfinite(sin).all()
    ck.rope_cache(np.int64(16), np.int32(8), theta=np.float32(10000), scaling=llama3(), xp=np)
    ck.rms_norm(f(2, 4), f(4), eps=np.float32(1e-6), return_rstd=np.True_)
    ck.cross_entropy(f(2, 4), np.zeros(2, np.int32), ignore_index=np.int64(-1), label_smoothing=1)
    assert np.isclose(float(ck.clip_scale(np.array(3.0, F32), np.float64(1.0))), 1 / 3, rtol=1e-5)


def test_adam_error_without_gpu_is_zero():
    if ck.gpu_available():
        pytest.skip("reads the real device word on a GPU machine (covered by the GPU tests below)")
    assert ck.ops.adam.adam_error() == 0
    assert "lr was NaN" in A.adam_error_message(A.ADAM_ERR_LR)
    assert A.adam_error_message(0) == "no Adam error"
    msg = A.adam_error_message(A.ADAM_ERR_STEP | A.ADAM_ERR_GRAD_SCALE)
    assert "step was not an integer" in msg and "grad_scale" in msg and "lr" not in msg.split(":")[1]


# ---------------------------------------------------------------- GPU: hyperparameters in device memory
# (name, value, dtype, expected error bits) for a 0-d device array given as lr / step / grad_scale.
DEVICE_BAD = [
    ("lr", np.nan, F32, A.ADAM_ERR_LR),
    ("lr", np.inf, F32, A.ADAM_ERR_LR),
    ("lr", -1e-3, F32, A.ADAM_ERR_LR),
    ("step", 0, np.int32, A.ADAM_ERR_STEP),
    ("step", -3, np.int64, A.ADAM_ERR_STEP),
    ("step", np.nan, F32, A.ADAM_ERR_STEP),
    ("step", np.inf, F32, A.ADAM_ERR_STEP),
    ("step", 1.5, F32, A.ADAM_ERR_STEP),
    ("grad_scale", np.nan, F32, A.ADAM_ERR_GRAD_SCALE),
    ("grad_scale", -np.inf, F32, A.ADAM_ERR_GRAD_SCALE),
    ("grad_scale", -0.5, F32, A.ADAM_ERR_GRAD_SCALE),
]


def _device_state(rng, shape, gdt):
    import cupy as cp

    host = [randn(rng, shape, F32), randn(rng, shape, gdt, 0.3), randn(rng, shape, F32, 0.05),
            (np.abs(randn(rng, shape, F32, 0.05)) + 1e-4).astype(F32), randn(rng, shape, BF16)]
    return host, [cp.asarray(a) for a in host]


def _bits(dev):
    return [to_host(a).view(np.uint8).tobytes() for a in dev]


@pytest.fixture
def clean_adam_word():
    A.adam_error()  # whatever an earlier test left
    yield
    A.adam_error()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [False, True], ids=["dense", "rows"])
@pytest.mark.parametrize("gdt", [F32, ck.bfloat16], ids=["g32", "gbf16"])
@pytest.mark.parametrize("name, value, dtype, bits", DEVICE_BAD, ids=[f"{n}={v}-{np.dtype(d)}" for n, v, d, _ in DEVICE_BAD])
def test_gpu_bad_device_hyperparameter_writes_nothing(rng, clean_adam_word, rows, gdt, name, value, dtype, bits):
    """(a) params, moments and shadow bit-unchanged; (b) ck.adam_error() names the problem, then reads 0;
    (c) a valid call afterwards updates exactly like the reference."""
    import cupy as cp

    shape = (301, 40) if rows else (10**5 + 3,)  # 10^5 + 3: the vector path, several blocks, a scalar tail
    host, dev = _device_state(rng, shape, gdt)
    p, g, m, v, sh = dev
    good = dict(lr=cp.array(1e-2, F32), step=cp.array(3, np.int32), grad_scale=cp.array(0.5, F32))
    bad = dict(good, **{name: cp.array(value, dtype)})
    extra = (cp.asarray(np.arange(0, 301, 2, dtype=np.int32)), cp.array(120, np.int32)) if rows else ()
    op = ck.adam_step_rows if rows else ck.adam_step
    before = _bits(dev)
    op(p, g, m, v, *extra, weight_decay=0.1, shadow=sh, **bad)
    assert _bits(dev) == before, "an invalid device hyperparameter must leave every buffer untouched"
    code = A.adam_error()
    assert code == bits, (code, bits)
    assert A.adam_error() == 0, "adam_error() clears the word"
    # (c) a valid call afterwards works (and reports nothing)
    op(p, g, m, v, *extra, weight_decay=0.1, shadow=sh, **good)
    hp, hg, hm, hv, hsh = (a.copy() for a in host)
    op(hp, hg, hm, hv, *(to_host(e) for e in extra), weight_decay=0.1, shadow=hsh, lr=1e-2, step=3,
       grad_scale=np.array(0.5, F32))
    np.testing.assert_allclose(to_host(p), hp, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(to_host(m), hm, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(to_host(v), hv, rtol=1e-5, atol=1e-9)
    if not rows:  # dense: the shadow is exactly the new param rounded to bf16
        assert np.array_equal(to_host(sh).view(np.uint16), to_host(p).astype(BF16).view(np.uint16))
    assert not np.array_equal(to_host(p), host[0]), "the valid step must move the parameters"
    assert A.adam_error() == 0


@pytest.mark.gpu
def test_gpu_several_bad_values_set_several_bits_and_own_word(rng, clean_adam_word):
    import cupy as cp

    host, dev = _device_state(rng, (1000,), F32)
    err = cp.zeros((), np.int32)
    before = _bits(dev)
    ck.adam_step(*dev[:4], lr=cp.array(np.nan, F32), step=cp.array(0, np.int32), grad_scale=cp.array(np.inf, F32),
                 shadow=dev[4], error=err)
    assert _bits(dev) == before
    assert int(err) == A.ADAM_ERR_LR | A.ADAM_ERR_STEP | A.ADAM_ERR_GRAD_SCALE
    assert A.adam_error() == 0, "an error= word of the caller's own is used instead of the module word"
    # rows with a device count of 0: nothing to update, but the bad value is still reported
    p2 = cp.asarray(host[0][:100].reshape(10, 10))
    ck.adam_step_rows(p2, p2.copy(), p2.copy(), p2.copy(), cp.zeros(4, np.int32), cp.zeros((), np.int32),
                      lr=cp.array(-1.0, F32), step=1)
    assert A.adam_error() == A.ADAM_ERR_LR


@pytest.mark.gpu
def test_gpu_bad_value_in_a_captured_step_is_skipped_then_recovers(rng, clean_adam_word):
    """The check lives in the captured kernel: a replay with a NaN grad_scale (a NaN gradient norm) changes
    nothing and flags it; the next replay with valid values updates as usual. No host sync in the step."""
    import cupy as cp

    host, dev = _device_state(rng, (5003,), ck.bfloat16)
    p, g, m, v, sh = dev
    lr_d, step_d, gs_d = cp.array(1e-2, F32), cp.array(1, np.int32), cp.array(1.0, F32)
    ck.adam_step(*(a.copy() for a in dev[:4]), lr=lr_d, step=step_d, grad_scale=gs_d)  # compile, word allocated
    A.adam_error()
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        ck.adam_step(p, g, m, v, lr=lr_d, step=step_d, shadow=sh, grad_scale=gs_d)
        graph = s.end_capture()
    before = _bits(dev)
    with s:
        gs_d.fill(np.nan)
    graph.launch(s)
    s.synchronize()
    assert _bits(dev) == before
    with s:
        assert A.adam_error() == A.ADAM_ERR_GRAD_SCALE
        gs_d.fill(0.5)
        step_d.fill(2)
    graph.launch(s)
    s.synchronize()
    hp, hg, hm, hv, hsh = (a.copy() for a in host)
    ck.adam_step(hp, hg, hm, hv, lr=1e-2, step=2, shadow=hsh, grad_scale=np.array(0.5, F32))
    np.testing.assert_allclose(to_host(p), hp, rtol=2e-6, atol=1e-6)
    with s:
        assert A.adam_error() == 0
