"""The trainer: one function, ``train(cfg, out_dir)``, for a laptop CPU, one GPU, or ``torchrun``.

Per optimizer step: ``grad_accum`` micro-batches (DDP/FSDP gradient sync only on the last), AdamW with a
warm-up + cosine/WSD schedule, global-norm clipping, bf16 autocast on CUDA. Metrics go to
``metrics.jsonl`` (one JSON object per line) and a progress bar; validation runs every
``eval_interval`` steps; checkpoints are atomic and hold everything ``--resume`` needs to continue
bit-for-bit where the run stopped (weights, optimizer, RNG, data position). Under ``torchrun`` the model
is replicated (``train.parallel = "ddp"``) or sharded (``"fsdp"``, see ``prismlm.train.fsdp``).
"""

from __future__ import annotations

import errno
import gc
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from prismlm.artifacts import FileLock
from prismlm.config import RunConfig
from prismlm.errors import CheckpointError, ConfigError, DataError, RunError
from prismlm.progress import Progress, Reporter
from prismlm.train.checkpoint import find_checkpoint, load_checkpoint
from prismlm.train.distributed import DistInfo, barrier, cleanup, init_distributed
from prismlm.train.loop import Interrupts, TrainLoop, Where
from prismlm.train.records import MetricsLog, environment_info
from prismlm.train.run_folder import check_run_folder, clear_run_folder, restart_fix
from prismlm.train.state import (
    Batches,
    Resumed,
    TrainResult,
    TrainState,
    batches_for,
    build_state,
    round_vocab,
)

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.data.stream import StreamingData

__all__ = ["check_data", "train"]


def train(
    cfg: RunConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    shards: ShardSet | None = None,
    progress: Progress = True,
    stop_after: int | None = None,
    overwrite: bool = False,
    extend_to: int | None = None,
    initial_state: dict[str, torch.Tensor] | None = None,
) -> TrainResult:
    """Train ``cfg`` into ``out_dir``: setup (run folder, data, checks) → restore (``resume``) → build the
    state → the loop (step, evaluate, checkpoint; ``prismlm.train.loop``).

    ``shards``: a prepared ``ShardSet`` (else prepared from ``cfg.data``, once, by rank 0).
    ``resume``: continue from ``out_dir``'s latest checkpoint (the config saved there is used);
    ``extend_to``: with ``resume``, train until this step (the schedule is stretched to it); a finished run
    resumed without it is refused rather than silently doing nothing.
    ``overwrite``: replace a run already in ``out_dir`` (otherwise refused: a run is never lost to a re-run).
    A lock on ``out_dir/.lock`` refuses a second writer at once. A NaN/Inf loss stops training with
    ``RunError``; the last good checkpoint stays.
    ``initial_state``: start a new run from these weights (a ``PrismLM`` state dict: a pretrained backbone with
    a seeded bank, see ``prismlm.train.retrofit``) instead of a random init; the vocabulary is then the
    model's, not rounded. ``train.trainable`` / ``train.frozen_steps`` choose what trains.
    ``stop_after``: stop (with a checkpoint) after this many steps of *this* call — simulates an
    interruption in tests; the schedule still follows ``cfg.train.max_steps``.
    """
    out_dir = Path(out_dir)
    info, device = init_distributed(cfg.train.device)
    lock = FileLock(out_dir / ".lock", f"run folder {out_dir}") if info.is_main else None
    interrupts = Interrupts(enabled=not info.enabled)
    state: TrainState | None = None
    loop: TrainLoop | None = None
    try:
        if lock is not None:
            claim_run_folder(lock, out_dir, resume=resume, overwrite=overwrite)
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        resumed = restore(out_dir) if resume else None
        if resumed is not None:
            cfg = resumed_config(resumed, out_dir, extend_to)
        data = prepare_data(cfg, info, shards, progress)
        cfg = check_data(cfg, data, info, new_vocab=initial_state is None and resumed is None)
        feed = batches_for(cfg, data, info, resumed, out_dir)
        state = build_state(cfg, info, device, resumed, initial_state)
        start_step = resumed.step if resumed is not None else 0
        loop = open_loop(state, Where(out_dir, info, device, data), feed, start_step, resumed is not None, progress)
        end_step = cfg.train.max_steps if stop_after is None else min(cfg.train.max_steps, start_step + stop_after)
        return loop.fit(end_step, interrupts)
    except KeyboardInterrupt:
        if loop is not None and loop.running:
            interrupts.restore()  # a further Ctrl-C while saving stops at once
            loop.save_on_interrupt()
        raise
    except OSError as e:
        if e.errno in _WRITE_ERRORS:  # read-only folder, no permission, full disk: the user's to fix
            raise RunError(
                f"cannot write {e.filename or out_dir}: {e.strerror}",
                fix="free disk space or choose a writable run folder; resume later with `resume`",
                param="resume",
            ) from e
        raise
    finally:
        interrupts.restore()
        if lock is not None:
            lock.release()
        if state is not None:
            state.release()  # while the process group is still alive (see TrainState.release)
        gc.collect()
        cleanup(info)


_WRITE_ERRORS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}


# --- setup ----------------------------------------------------------------------------------------------------


def claim_run_folder(lock: FileLock, out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Rank 0: refuse a folder that holds another run (unless ``overwrite``), take the lock, clear the old run."""
    check_run_folder(out_dir, resume=resume, overwrite=overwrite)
    lock.acquire()
    if overwrite and not resume:
        clear_run_folder(out_dir)


def restore(out_dir: Path) -> Resumed:
    """The latest checkpoint of ``out_dir`` and its trainer state; ``CheckpointError`` saying how to go on."""
    try:
        ckpt = load_checkpoint(find_checkpoint(out_dir), device="cpu")
    except CheckpointError as e:
        raise CheckpointError(f"cannot resume {out_dir}: {e}", fix=restart_fix(out_dir), param="overwrite") from e
    return Resumed(ckpt, ckpt.trainer_state())


def resumed_config(resumed: Resumed, out_dir: Path, extend_to: int | None) -> RunConfig:
    """The run's own config (a resumed run never silently changes its recipe), its schedule stretched to
    ``extend_to``; a run with nothing left to train is refused."""
    cfg, start_step = resumed.checkpoint.config, resumed.step
    if extend_to is not None:
        if extend_to <= start_step:
            raise RunError(
                f"{out_dir} is already at step {start_step}; `extend_to` {extend_to} would not train further",
                fix=f"pass `extend_to` greater than {start_step}",
                param="extend_to",
            )
        return cfg.override({"train.max_steps": extend_to})
    if start_step >= cfg.train.max_steps:
        raise RunError(
            f"{out_dir} already finished its {cfg.train.max_steps} steps; nothing to resume",
            fix=f"pass `resume` with `extend_to` N (> {start_step}) to train further",
            param=("resume", "extend_to"),
        )
    return cfg


def prepare_data(
    cfg: RunConfig, info: DistInfo, shards: ShardSet | None, progress: Progress
) -> ShardSet | StreamingData:
    """``shards``, or rank 0 prepares (or reuses) them from ``cfg.data`` while the others wait and load them;
    a streamed corpus (``data.streaming``) prepares only its small validation shard."""
    from prismlm.data.shards import prepare_from_config
    from prismlm.data.stream import prepare_stream

    if cfg.data.streaming:  # a streaming run reads its corpus itself: given shards are not used
        if info.is_main:
            streamed = prepare_stream(cfg.data)
            barrier(info)
            return streamed
        barrier(info)
        return prepare_stream(cfg.data)
    if shards is not None:
        return shards
    if info.is_main:
        shards = prepare_from_config(cfg.data, show_progress=progress)
        barrier(info)
        return shards
    barrier(info)
    return prepare_from_config(cfg.data, show_progress=False)


def check_data(cfg: RunConfig, data: ShardSet | StreamingData, info: DistInfo, *, new_vocab: bool) -> RunConfig:
    """A new model's vocabulary is the tokenizer's, rounded up (``round_vocab``); a given model's must hold the
    tokenizer's ids. Refuses, before any training, splits shorter than one block and a two-stage retrofit
    under DDP."""
    from prismlm.data.stream import StreamingData

    if new_vocab:
        vocab = round_vocab(data.tokenizer.vocab_size)
        if cfg.model.vocab_size != vocab:
            cfg = cfg.override({"model.vocab_size": vocab})
    elif cfg.model.vocab_size < data.tokenizer.vocab_size:
        raise DataError(
            f"the tokenizer of {data.root} has {data.tokenizer.vocab_size} ids but the model only "
            f"{cfg.model.vocab_size}",
            fix="prepare the corpus with the model's own tokenizer",
        )
    if info.enabled and cfg.train.frozen_steps > 0 and cfg.train.trainable != "prototypes":
        raise ConfigError(
            "train.frozen_steps (a two-stage retrofit) changes which parameters train mid-run, "
            "which DistributedDataParallel does not allow",
            fix="run it in one process",
        )
    T = cfg.model.block_size
    if not isinstance(data, StreamingData) and data.train.num_sequences(T) < 1:
        raise DataError("the training split is shorter than one block; use more data or a smaller block_size")
    if data.val.num_sequences(T) < 1:  # refused now, not at the first evaluation
        raise DataError(
            f"the validation split of {data.root} holds {len(data.val)} tokens, fewer than one block of {T + 1}",
            fix="use a corpus with more documents, a larger data.val_fraction, or a smaller model.block_size",
        )
    return cfg


def open_loop(
    state: TrainState, where: Where, feed: Batches, start_step: int, resumed: bool, progress: Progress
) -> TrainLoop:
    """Rank 0 writes ``config.json`` and ``env.json`` and opens the metrics log (cut back to the resumed
    step) and the progress bar; every rank gets the loop."""
    cfg, out_dir, info, device = state.cfg, where.out_dir, where.info, where.device
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        cfg.to_json(out_dir / "config.json")
        env = environment_info(info, device, cfg.train.seed)
        env["data_manifest"] = where.data.manifest
        (out_dir / "env.json").write_text(json.dumps(env, indent=2, default=str) + "\n")
    log = MetricsLog(out_dir / "metrics.jsonl", start_step if resumed else None, info.is_main)
    bar = Reporter(progress, "train", cfg.train.max_steps, unit="step", initial=start_step, enabled=info.is_main)
    if info.is_main:
        bar.message(model_line(state, feed, info, device))
    return TrainLoop(state, where, feed, log=log, bar=bar, start_step=start_step, resumed=resumed)


def model_line(state: TrainState, feed: Batches, info: DistInfo, device: torch.device) -> str:
    """The run's first line: the model, its size, the data, the global batch, the device."""
    model, cfg, tc = state.model, state.cfg, state.cfg.train
    kind = "PRISM" if model.is_prism else "dense"
    extra = (
        (
            f" (backbone {model.num_parameters(prototypes=False) / 1e6:.2f}M + prototypes "
            f"{model.prototypes.num_prototypes}×{cfg.model.n_embd})"
        )
        if model.prototypes is not None
        else ""
    )
    global_batch = tc.batch_size * tc.grad_accum * info.world_size
    return (
        f"[prismlm] {kind} model: {model.num_parameters() / 1e6:.2f}M parameters{extra}; {feed.describe(cfg)}; "
        f"global batch {global_batch} × {cfg.model.block_size} tokens; device {device}, world {info.world_size}"
    )
