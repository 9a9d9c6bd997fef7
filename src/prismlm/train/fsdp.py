"""Fully sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``) for the large presets.

Every transformer block is its own FSDP unit and the root (embeddings, prototype bank, final norm, W) one
more, because the prototype layer needs the whole bank and W at once. Invariant: checkpoints stay usable by
every tool: weights are consolidated on rank 0 into the ordinary ``model.safetensors``; the optimizer state
is written in per-rank shards (``sharded/``) and resharded on resume. See docs/modules.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from prismlm.errors import CheckpointError
from prismlm.model import PrismLM

SHARDED_DIR = "sharded"
"""The folder of a checkpoint that holds the per-rank optimizer shards (DCP format)."""


def shard_model(model: PrismLM) -> None:
    """Shard ``model`` in place over the default process group: one FSDP unit per transformer block, the
    rest (embeddings, bank, final norm, W) in the root unit. Parameters become ``DTensor`` shards; build
    the optimizer after this call so that it holds the shards."""
    for prefix in model.block_prefixes():
        fully_shard(model.get_submodule(prefix.rstrip(".")))
    fully_shard(model)


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """FSDP's ``no_sync``: skip the gradient reduce-scatter on micro-batches before the last one."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)


def full_value(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a ``DTensor`` result (e.g. the gradient norm); other tensors unchanged."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def consolidated_model(model: PrismLM, is_main: bool) -> PrismLM | None:
    """The full weights of a sharded model as an ordinary ``PrismLM`` on the CPU of rank 0 (``None`` on the
    other ranks). A collective: every rank must call it."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return None
    full = PrismLM(model.config)
    full.load_state_dict(state)
    return full


def save_sharded_optimizer(model: PrismLM, optimizer: torch.optim.Optimizer, folder: Path, is_main: bool) -> None:
    """Every rank writes its optimizer shard into ``folder`` (DCP: ``__<rank>_0.distcp`` + ``.metadata``).
    A collective; a stale folder from a crash is removed by rank 0 first."""
    if is_main:
        shutil.rmtree(folder, ignore_errors=True)
    torch.distributed.barrier()
    state = get_optimizer_state_dict(model, optimizer)
    dcp.save({"optimizer": state}, checkpoint_id=str(folder))


def load_sharded_optimizer(model: PrismLM, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Each rank reads its part of the optimizer state saved by ``save_sharded_optimizer`` (a collective)."""
    if not (folder / ".metadata").exists():
        raise CheckpointError(
            f"{folder.parent} was saved by FSDP but its optimizer shards ({folder}) are missing",
            fix="resume from an earlier checkpoint, or start again with `overwrite`",
            path=folder,
            param="overwrite",
        )
    state = get_optimizer_state_dict(model, optimizer)  # the template: this rank's shapes and placements
    dcp.load({"optimizer": state}, checkpoint_id=str(folder))
    set_optimizer_state_dict(model, optimizer, state)
