"""Optimizers over the autograd's parameters: :class:`AdamW` (flat buffers, one fused kernel launch per group, bf16
shadows, sparse embedding rows, device step/lr) and :class:`CompositeAdamW` (plain array ops, the baseline); both
share one ``state_dict`` format."""
from .adamw import ALIGN, AdamW, WarmupCosine
from .composite import CompositeAdamW
from .zero import ZeroAdamW, consolidate_state, shard_layout

__all__ = ["AdamW", "CompositeAdamW", "WarmupCosine", "ALIGN", "ZeroAdamW", "consolidate_state", "shard_layout"]
