"""Temporary module modes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["eval_mode"]


@contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``with eval_mode(net): …`` runs the block with ``net.eval()`` and restores the module's previous
    training flag afterwards (also when the block raises). Yields the module."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)
