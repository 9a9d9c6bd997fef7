"""Training: trainer, checkpoints, data order, torchrun integration."""

from prismlm.train.checkpoint import Checkpoint, find_checkpoint, load_checkpoint, save_checkpoint
from prismlm.train.state import TrainResult
from prismlm.train.trainer import train

__all__ = ["Checkpoint", "TrainResult", "find_checkpoint", "load_checkpoint", "save_checkpoint", "train"]
