"""Process-group setup for ``torchrun`` data parallelism (gloo on CPU, NCCL on GPU).

We never launch processes ourselves: ``torchrun --nproc_per_node N -m prismlm.cli train ...`` sets
RANK / WORLD_SIZE / LOCAL_RANK and this module joins the group it describes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from prismlm.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """``auto`` → this process's GPU if CUDA is available, else CPU."""
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as e:  # torch's message: "Invalid device string: 'tpu9'"
        raise ConfigError(f"device {spec!r} is not a torch device ({e})", fix="use auto, cpu or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {spec!r} requested but CUDA is not available", fix="use auto or cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    return device


def init_distributed(device_spec: str) -> tuple[DistInfo, torch.device]:
    """Join the torchrun process group if WORLD_SIZE > 1; returns (info, this process's device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo(), resolve_device(device_spec)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_spec, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank), device


def barrier(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.barrier()


def all_reduce_mean(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled and dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= info.world_size
    return value


def cleanup(info: DistInfo) -> None:
    """Leave the process group. The barrier first: every rank's last collective (and gloo's clean-up of
    it, which needs the GIL this thread releases while waiting) is done before the group is destroyed."""
    if info.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
