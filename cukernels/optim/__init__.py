"""The optimizer: :class:`AdamW` over flat buffers laid out as the shards of a process group (a world of one: the
plain optimizer; N ranks: ZeRO-1, see :mod:`.zero` for the layout and the one ``state_dict`` format), bf16 shadows,
sparse embedding rows, device step/lr; :class:`ZeroAdamW` is AdamW over the default process group; and
:class:`CompositeAdamW` (plain array ops, the baseline) with the same interface and format."""
from .adamw import ALIGN, AdamW, WarmupCosine, ZeroAdamW
from .composite import CompositeAdamW
from .zero import consolidate_state, shard_layout

__all__ = ["AdamW", "CompositeAdamW", "WarmupCosine", "ALIGN", "ZeroAdamW", "consolidate_state", "shard_layout"]
