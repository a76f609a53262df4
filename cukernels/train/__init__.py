"""Training as library code: the config schema (:mod:`.config`), the loop with checkpoints and resume
(:mod:`.trainer`), the console and log (:mod:`.console`) and the command line (:mod:`.cli`,
``examples/train.py``)."""
from .config import SCHEMA, ConfigError, load_config, validate
from .trainer import evaluate, lr_at, train, train_step

__all__ = ["SCHEMA", "ConfigError", "load_config", "validate", "train", "train_step", "evaluate", "lr_at"]
