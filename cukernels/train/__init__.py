"""Training as library code: the config schema and its typed sections (:mod:`.config`), the loop
(:mod:`.trainer`), the checkpoints (:mod:`.checkpoint`), the console and log (:mod:`.console`) and the command line
(:mod:`.cli`, ``examples/train.py``)."""
from .config import SCHEMA, ConfigError, TrainConfig, load_config, validate
from .trainer import evaluate, lr_at, train, train_step

__all__ = ["SCHEMA", "ConfigError", "TrainConfig", "load_config", "validate", "train", "train_step", "evaluate",
           "lr_at"]
