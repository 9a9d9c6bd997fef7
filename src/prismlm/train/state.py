"""The training state: the model, its optimizer and parallel wrapper, the batch feed, and how a run builds or
restores them. Invariant: built in one fixed order (seed → init → load → shard → optimizer → restore →
per-rank seed → wrap), so a resumed run continues bit-for-bit. The loop that uses it: ``prismlm.train.loop``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from prismlm.config import RunConfig
from prismlm.errors import CheckpointError, ConfigError, DataError
from prismlm.model import PrismLM
from prismlm.train import fsdp
from prismlm.train.checkpoint import Checkpoint, RngState, TrainerState
from prismlm.train.distributed import DistInfo
from prismlm.train.sampler import SequenceSampler

if TYPE_CHECKING:
    from torch.optim.optimizer import StateDict

    from prismlm.data.shards import ShardSet
    from prismlm.data.stream import StreamingData, TokenStream


@dataclass
class TrainResult:
    run_dir: Path
    checkpoint: Path
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    """The last validation metrics (rank 0; empty on the other ranks of a torchrun job)."""
    model: PrismLM | None = None


def round_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Pad the embedding to a multiple of 64 (GPT-2's 50,257 → 50,304): faster matmuls, no effect on outputs."""
    return int(math.ceil(vocab_size / multiple) * multiple)


def build_optimizer(model: PrismLM, cfg: RunConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only. Prototypes are not decayed: shrinking them would shrink the
    reconstruction ẑ = Σ a_i p_i they must provide (a ≤ 1 is a cosine, so scale lives in ‖p_i‖).

    Every parameter that ``cfg.train.trainable`` can ever train is in a group from the start (so the
    optimizer state of a retrofit keeps one shape through both stages); each group's ``lr_scale`` (1 for the
    bank, ``train.backbone_lr_ratio`` for the rest) multiplies the scheduled learning rate."""
    allowed = trainable_names(model, cfg.train.trainable)
    ratio = cfg.train.backbone_lr_ratio
    groups: dict[str, list[torch.nn.Parameter]] = {"decay": [], "no_decay": [], "prototypes": []}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if name not in allowed or id(p) in seen:
            continue
        seen.add(id(p))
        is_bank = name.startswith("prototypes.")
        # Why the bank joins no_decay when the ratios agree: the two-group layout of every earlier run, so
        # their optimizer states still load when they are resumed.
        kind = "decay" if p.dim() >= 2 and not is_bank else "prototypes" if is_bank and ratio != 1.0 else "no_decay"
        groups[kind].append(p)
    spec = [
        {"params": groups["decay"], "weight_decay": cfg.train.weight_decay, "lr_scale": ratio},
        {"params": groups["no_decay"], "weight_decay": 0.0, "lr_scale": ratio},
        {"params": groups["prototypes"], "weight_decay": 0.0, "lr_scale": 1.0},
    ]
    return torch.optim.AdamW(
        [g for g in spec if g["params"]], lr=cfg.train.lr, betas=cfg.train.betas, fused=device.type == "cuda"
    )


def trainable_names(model: PrismLM, policy: str) -> set[str]:
    """Names of the parameters a ``train.trainable`` policy trains (tied weights under every name):
    ``all``; ``prototypes`` (the bank only); ``last-N`` (the bank, the last N blocks, the final norm)."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if policy == "all":
        return names
    keep = {n for n in names if n.startswith("prototypes.")}
    if policy == "prototypes":
        return keep
    if policy == "lora":
        adapters = {n for n in names if ".lora_" in n}
        if not adapters:
            raise ConfigError("train.trainable=lora but the model has no LoRA adapters", fix="set model.lora_rank")
        return keep | adapters
    n_last = int(policy.removeprefix("last-"))
    blocks, final_norms = model.block_prefixes(), model.final_norm_prefixes()
    if n_last > len(blocks):
        raise ConfigError(
            f"train.trainable={policy}: the model has only {len(blocks)} blocks", fix=f"use last-{len(blocks)} or all"
        )
    prefixes = tuple(blocks[-n_last:]) + tuple(final_norms)
    return keep | {n for n in names if n.startswith(prefixes)}


def set_trainable(model: PrismLM, names: set[str]) -> None:
    """``requires_grad`` on exactly ``names``: frozen parameters get no gradient, so backward stops at them
    (with a frozen backbone it never enters it)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in names:
            p.requires_grad_(True)


def autocast_for(cfg: RunConfig, device: torch.device) -> torch.autocast | None:
    dtype = cfg.train.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype == "float32":
        return None
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def rng_state(device: torch.device) -> RngState:
    """The RNG states a checkpoint records (dropout draws from them), copied now."""
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


# --- the batch feed: a prepared shard set (a pure function of the step) or a streamed corpus ----------------


class Batches(Protocol):
    """Where the training batches come from: each micro-batch is (B, T + 1) int64 tokens."""

    moves_per_micro: bool
    """True when the feed's position changes with each micro-batch (a stream): no consistent state to save
    in the middle of a step."""

    def batch(self, step: int, micro: int) -> np.ndarray: ...

    def epoch_at(self, step: int) -> float: ...

    def position(self, at_step: int) -> dict[str, object]:
        """The ``data`` entry of a checkpoint at ``at_step`` (a collective under torchrun for a stream)."""
        ...

    def describe(self, cfg: RunConfig) -> str: ...


class ShardBatches:
    """Training sequences of a prepared ``ShardSet`` in ``SequenceSampler`` order: resuming needs only the step."""

    moves_per_micro = False

    def __init__(self, shards: ShardSet, cfg: RunConfig, info: DistInfo) -> None:
        tc, self.T, self.rank = cfg.train, cfg.model.block_size, info.rank
        self.shards = shards
        self.sampler = SequenceSampler(
            shards.train.num_sequences(self.T), tc.batch_size, tc.grad_accum, info.world_size, tc.seed
        )

    def batch(self, step: int, micro: int) -> np.ndarray:
        return self.shards.train.sequences(self.sampler.micro_indices(step, micro, self.rank), self.T)

    def epoch_at(self, step: int) -> float:
        return self.sampler.epoch_at(step)

    def position(self, at_step: int) -> dict[str, object]:
        return {"sequences_consumed": at_step * self.sampler.global_batch, "epoch": self.sampler.epoch_at(at_step)}

    def describe(self, cfg: RunConfig) -> str:
        return f"train {len(self.shards.train):,} tokens / {self.sampler.n:,} sequences of {self.T}"


class StreamBatches:
    """This rank's ``TokenStream`` of a streamed corpus; a checkpoint records every rank's stream position."""

    moves_per_micro = True

    def __init__(self, stream: TokenStream, cfg: RunConfig, info: DistInfo) -> None:
        self.stream, self.info = stream, info
        tc = cfg.train
        self.batch_size, self.global_batch = tc.batch_size, tc.batch_size * tc.grad_accum * info.world_size

    def batch(self, step: int, micro: int) -> np.ndarray:
        return self.stream.batch(self.batch_size)

    def epoch_at(self, step: int) -> float:
        return float(self.stream.epoch)

    def position(self, at_step: int) -> dict[str, object]:
        positions: list[object] = [self.stream.state_dict()]
        if self.info.enabled:  # every rank's stream position, gathered to rank 0
            gathered: list[object] = [None] * self.info.world_size
            torch.distributed.all_gather_object(gathered, positions[0])
            positions = gathered
        return {"sequences_consumed": at_step * self.global_batch, "epoch": self.stream.epoch, "stream": positions}

    def describe(self, cfg: RunConfig) -> str:
        return (
            f"train streamed from {cfg.data.corpus} (shuffle buffer {cfg.data.shuffle_buffer} "
            f"sequences of {cfg.model.block_size})"
        )


def batches_for(
    cfg: RunConfig, data: ShardSet | StreamingData, info: DistInfo, resumed: Resumed | None, out_dir: Path
) -> Batches:
    """The feed of this rank; a resumed stream continues at the position its checkpoint holds."""
    from prismlm.data.stream import StreamingData

    if not isinstance(data, StreamingData):
        return ShardBatches(data, cfg, info)
    stream = data.stream(
        cfg.data, cfg.model.block_size, seed=cfg.train.seed, rank=info.rank, world_size=info.world_size
    )
    if resumed is not None:
        positions = resumed.saved["data"].get("stream")
        if not isinstance(positions, list) or len(positions) != info.world_size:
            raise DataError(
                f"{out_dir}: the checkpoint holds no stream position for {info.world_size} process(es)",
                fix="resume with the run's own data settings and process count",
            )
        stream.load_state_dict(positions[info.rank])
    return StreamBatches(stream, cfg, info)


# --- the state ------------------------------------------------------------------------------------------------


@dataclass
class Resumed:
    """The checkpoint a resumed run continues from and its trainer state (``trainer_state.pt``: step,
    optimizer, RNG, data position)."""

    checkpoint: Checkpoint
    saved: TrainerState

    @property
    def step(self) -> int:
        return int(self.saved["step"])


@dataclass
class TrainState:
    """What the loop trains and a checkpoint saves. ``fwd_model`` is what the forward pass calls: the model,
    its DDP wrapper, or either compiled; ``stage`` is ``frozen`` (a retrofit's bank-only stage 1) or ``main``."""

    cfg: RunConfig
    model: PrismLM
    optimizer: torch.optim.AdamW
    sharded: bool
    """FSDP: the model's parameters are this rank's shards (checkpoints and evaluation are collectives)."""
    ddp: DDP | None
    fwd_model: Callable[..., Any] | None  # Any: the module, its DDP wrapper or a torch.compile (untyped calls)
    """The module the forward pass calls, or its ``torch.compile``."""
    autocast: torch.autocast | None
    stage_names: dict[str, set[str]]
    """``frozen`` / ``main`` → the names of the parameters that stage trains."""
    stage: str

    def set_stage(self, stage: str) -> None:
        self.stage = stage
        set_trainable(self.model, self.stage_names[stage])

    def train_mode(self) -> None:
        """A frozen backbone runs in eval mode (no dropout): the bank learns the hidden states the model really
        produces. Re-applied after each validation, whose eval_mode restores train mode everywhere."""
        self.model.transformer.train(self.stage != "frozen")

    def release(self) -> None:
        """Drop the DDP wrapper (its gradient reducer holds the process group) while the group is still alive.
        Left to garbage collection, the reducer can drop the last reference to a gloo group after
        destroy_process_group, and ~ProcessGroupGloo then joins gloo's worker thread while holding the GIL
        that thread needs to free a finished all-gather: a hang at exit (seen in the 2-process tests)."""
        self.ddp = None
        self.fwd_model = None


def build_state(
    cfg: RunConfig,
    info: DistInfo,
    device: torch.device,
    resumed: Resumed | None,
    initial_state: dict[str, torch.Tensor] | None,
) -> TrainState:
    """Seed, build the model (the resumed checkpoint's or ``initial_state``'s weights), shard it under FSDP,
    build the optimizer, choose the stage, restore the optimizer and RNG states, wrap for DDP."""
    torch.manual_seed(cfg.train.seed)
    model = PrismLM(cfg.model).to(device)
    if resumed is not None:
        model.load_state_dict(resumed.checkpoint.model.state_dict())
    elif initial_state is not None:
        model.load_state_dict(initial_state)
    sharded = info.enabled and cfg.train.parallel == "fsdp"
    if sharded:  # before the optimizer is built, so that it holds (and steps) this rank's shards only
        fsdp.shard_model(model)
    optimizer = build_optimizer(model, cfg, device)
    stage_names = {"frozen": trainable_names(model, "prototypes"), "main": trainable_names(model, cfg.train.trainable)}
    start_step = resumed.step if resumed is not None else 0
    stage = "frozen" if start_step < cfg.train.frozen_steps else "main"
    set_trainable(model, stage_names[stage])
    if resumed is not None:
        restore_optimizer(resumed, model, optimizer, sharded=sharded, device=device)
    elif info.rank > 0:  # per-rank dropout streams differ; rank 0 keeps the single-process stream
        torch.manual_seed(cfg.train.seed + 1000 * info.rank)
    ddp = (
        DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if info.enabled and not sharded
        else None
    )
    wrapped: torch.nn.Module = ddp if ddp is not None else model
    return TrainState(
        cfg=cfg,
        model=model,
        optimizer=optimizer,
        sharded=sharded,
        ddp=ddp,
        fwd_model=torch.compile(wrapped) if cfg.train.compile else wrapped,
        autocast=autocast_for(cfg, device),
        stage_names=stage_names,
        stage=stage,
    )


def restore_optimizer(
    resumed: Resumed, model: PrismLM, optimizer: torch.optim.AdamW, *, sharded: bool, device: torch.device
) -> None:
    """The optimizer state and RNG states of a resumed run: a full state dict, or (FSDP) each rank's shard."""
    ckpt, state = resumed.checkpoint, resumed.saved
    if state["optimizer"] == fsdp.SHARDED_DIR:
        if not sharded:
            raise CheckpointError(
                f"{ckpt.path} holds FSDP optimizer shards; resume it under torchrun with train.parallel=fsdp",
                path=ckpt.path,
            )
        fsdp.load_sharded_optimizer(model, optimizer, ckpt.path / fsdp.SHARDED_DIR)
    elif sharded:
        raise CheckpointError(
            f"{ckpt.path} was saved without FSDP; its optimizer state is not sharded",
            fix="resume it with train.parallel=ddp (the config saved with the run)",
            path=ckpt.path,
        )
    else:
        optimizer.load_state_dict(cast("StateDict", state["optimizer"]))  # not SHARDED_DIR: a state dict
    torch.set_rng_state(state["rng"]["torch"])
    if device.type == "cuda" and (cuda_rng := state["rng"].get("cuda")) is not None:
        torch.cuda.set_rng_state(cuda_rng, device)
