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
import math
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from prismlm.artifacts import RUN, RUN_FILES, FileLock, check_out_folder, folder_kind
from prismlm.config import RunConfig
from prismlm.errors import CheckpointError, ConfigError, DataError, RunError
from prismlm.eval.metrics import evaluate
from prismlm.model import PrismLM
from prismlm.progress import Progress, Reporter
from prismlm.train import fsdp
from prismlm.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from prismlm.train.distributed import DistInfo, all_reduce_mean, barrier, cleanup, init_distributed
from prismlm.train.sampler import SequenceSampler

if TYPE_CHECKING:
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
        # their optimizer states still load on --resume.
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


def _git_revision() -> str | None:
    try:
        root = Path(__file__).resolve().parents[3]
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
        )
        if rev.returncode != 0:
            return None
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment_info(info: DistInfo, device: torch.device, seed: int) -> dict[str, Any]:
    """What a reader needs to reproduce a run: code revision, package versions, hardware, seed."""
    versions: dict[str, str | None] = {}
    for pkg in ("prismlm", "torch", "numpy", "tokenizers", "safetensors"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "git_revision": _git_revision(),
        "command": sys.argv,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "device": str(device),
        "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "world_size": info.world_size,
        "torch_threads": torch.get_num_threads(),
        "seed": seed,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _records(text: str) -> list[str]:
    """The complete JSON lines of a metrics log; a torn line (a kill or a full disk mid-write) is dropped."""
    out = []
    for ln in text.splitlines():
        try:
            if ln.strip() and isinstance(json.loads(ln), dict):
                out.append(ln)
        except json.JSONDecodeError:
            continue
    return out


class MetricsLog:
    """Append-only JSONL log; on resume, lines past the resumed step (and torn lines) are dropped so the log
    stays exact."""

    def __init__(self, path: Path, resume_step: int | None, enabled: bool):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        if path.is_dir():
            raise RunError(
                f"{path} is a folder, but it is where the run's training log (a file) goes",
                fix=f"move that folder out of {path.parent} and run again",
                path=path,
            )
        if resume_step is not None and path.exists():
            kept = [
                ln for ln in _records(path.read_text(errors="replace")) if json.loads(ln).get("step", 0) <= resume_step
            ]
            path.write_text("".join(ln + "\n" for ln in kept))
        elif resume_step is None:
            path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


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
    """Train ``cfg`` into ``out_dir``.

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
    from prismlm.data.shards import prepare_from_config

    out_dir = Path(out_dir)
    info, device = init_distributed(cfg.train.device)
    lock = FileLock(out_dir / ".lock", f"run folder {out_dir}") if info.is_main else None
    interrupts = _Interrupts(enabled=not info.enabled)
    on_interrupt: Callable[[], None] | None = None  # set while the training loop runs
    try:
        if lock is not None:
            check_run_folder(out_dir, resume=resume, overwrite=overwrite)
            lock.acquire()
            if overwrite and not resume:
                clear_run_folder(out_dir)
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        start_step, state = 0, None
        if resume:
            try:
                ckpt = load_checkpoint(find_checkpoint(out_dir), device="cpu")
            except CheckpointError as e:
                raise CheckpointError(f"cannot resume {out_dir}: {e}", fix=_restart_fix(out_dir)) from e
            cfg = ckpt.config  # the run's own config; a resumed run never silently changes its recipe
            state = ckpt.trainer_state()
            start_step = int(state["step"])
            if extend_to is not None:
                if extend_to <= start_step:
                    raise RunError(
                        f"{out_dir} is already at step {start_step}; --steps {extend_to} would not train further",
                        fix=f"pass --steps greater than {start_step}",
                    )
                cfg = cfg.override({"train.max_steps": extend_to})
            elif start_step >= cfg.train.max_steps:
                raise RunError(
                    f"{out_dir} already finished its {cfg.train.max_steps} steps; nothing to resume",
                    fix=f"pass --steps N (> {start_step}) with --resume to train further",
                )
        # --- data: rank 0 prepares (or reuses) the shards; the others wait and load them
        data: ShardSet | StreamingData | None = shards
        if cfg.data.streaming:  # stream the corpus (prismlm.data.stream): only a small val shard is prepared
            from prismlm.data.stream import prepare_stream

            shards = None  # a streaming run reads its corpus itself
            if info.is_main:
                data = prepare_stream(cfg.data)
                barrier(info)
            else:
                barrier(info)
                data = prepare_stream(cfg.data)
        elif shards is None:
            if info.is_main:
                shards = prepare_from_config(cfg.data, show_progress=progress)
                barrier(info)
            else:
                barrier(info)
                shards = prepare_from_config(cfg.data, show_progress=False)
            data = shards
        assert data is not None
        if initial_state is None and not resume:
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
        if shards is not None and shards.train.num_sequences(cfg.model.block_size) < 1:
            raise DataError("the training split is shorter than one block; use more data or a smaller block_size")
        if data.val.num_sequences(cfg.model.block_size) < 1:  # refused now, not at the first evaluation
            raise DataError(
                f"the validation split of {data.root} holds {len(data.val)} tokens, fewer than one "
                f"block of {cfg.model.block_size + 1}",
                fix="use a corpus with more documents, a larger --set data.val_fraction, or a smaller model.block_size",
            )

        torch.manual_seed(cfg.train.seed)
        model = PrismLM(cfg.model).to(device)
        if resume:
            model.load_state_dict(ckpt.model.state_dict())
        elif initial_state is not None:
            model.load_state_dict(initial_state)
        sharded = info.enabled and cfg.train.parallel == "fsdp"
        if sharded:  # before the optimizer is built, so that it holds (and steps) this rank's shards only
            fsdp.shard_model(model)
        optimizer = build_optimizer(model, cfg, device)
        stage_names = {
            "frozen": trainable_names(model, "prototypes"),
            "main": trainable_names(model, cfg.train.trainable),
        }
        stage = "frozen" if start_step < cfg.train.frozen_steps else "main"
        set_trainable(model, stage_names[stage])
        if state is not None:
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
                optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"]["torch"])
            if device.type == "cuda" and state["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state(state["rng"]["cuda"], device)
        # Per-rank dropout streams differ; rank 0 keeps the single-process stream.
        if info.rank > 0 and state is None:
            torch.manual_seed(cfg.train.seed + 1000 * info.rank)
        ddp = (
            DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
            if info.enabled and not sharded
            else None
        )
        ddp_model: torch.nn.Module = ddp if ddp is not None else model
        fwd_model = torch.compile(ddp_model) if cfg.train.compile else ddp_model
        autocast = autocast_for(cfg, device)

        T = cfg.model.block_size
        tc = cfg.train
        stream: TokenStream | None = None
        if shards is None:  # streaming: this rank's stream, at the checkpoint's position on --resume
            from prismlm.data.stream import StreamingData

            assert isinstance(data, StreamingData)
            stream = data.stream(cfg.data, T, seed=tc.seed, rank=info.rank, world_size=info.world_size)
            if state is not None:
                saved = state["data"].get("stream")
                if not isinstance(saved, list) or len(saved) != info.world_size:
                    raise DataError(
                        f"{out_dir}: the checkpoint holds no stream position for {info.world_size} process(es)",
                        fix="resume with the run's own data settings and process count",
                    )
                stream.load_state_dict(saved[info.rank])
        else:
            sampler = SequenceSampler(
                shards.train.num_sequences(T), tc.batch_size, tc.grad_accum, info.world_size, tc.seed
            )
        if info.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            cfg.to_json(out_dir / "config.json")
            env = environment_info(info, device, tc.seed)
            env["data_manifest"] = data.manifest
            (out_dir / "env.json").write_text(json.dumps(env, indent=2, default=str) + "\n")
            n_params = model.num_parameters()
            kind = "PRISM" if model.is_prism else "dense"
            extra = (
                (
                    f" (backbone {model.num_parameters(prototypes=False) / 1e6:.2f}M + prototypes "
                    f"{model.prototypes.num_prototypes}×{cfg.model.n_embd})"
                )
                if model.prototypes is not None
                else ""
            )
            train_line = (
                f"train {len(shards.train):,} tokens / {sampler.n:,} sequences of {T}"
                if shards is not None
                else f"train streamed from {cfg.data.corpus} (shuffle buffer {cfg.data.shuffle_buffer} "
                f"sequences of {T})"
            )
            global_batch = tc.batch_size * tc.grad_accum * info.world_size
            model_line = (
                f"[prismlm] {kind} model: {n_params / 1e6:.2f}M parameters{extra}; {train_line}; "
                f"global batch {global_batch} × {T} tokens; device {device}, world {info.world_size}"
            )
        log = MetricsLog(out_dir / "metrics.jsonl", start_step if resume else None, info.is_main)

        def do_eval() -> dict[str, float]:
            return evaluate(
                model,
                data.val,
                seq_len=T,
                batch_size=tc.batch_size,
                max_batches=tc.eval_batches,
                device=device,
                autocast=autocast,
                loss_weights=cfg.loss.weights_at(step),
            )

        def do_checkpoint(at_step: int, rng: dict[str, Any] | None = None) -> tuple[Path | None, PrismLM | None]:
            """Save a checkpoint (rank 0 writes it; under FSDP every rank takes part). Returns its folder and
            the model it holds (rank 0; ``None`` elsewhere). ``rng``: the RNG states to record (default: now)."""
            path = None
            saved_model: PrismLM | None = model if info.is_main else None
            shard_dir: Path | None = None
            if sharded:  # collectives: consolidate the weights on rank 0, every rank writes its optimizer shard
                saved_model = fsdp.consolidated_model(model, info.is_main)
                shard_dir = out_dir / "checkpoints" / f"step-{at_step:06d}.sharded.tmp"
                fsdp.save_sharded_optimizer(model, optimizer, shard_dir, info.is_main)
            positions: list[Any] = []
            if stream is not None:  # every rank's stream position, gathered to rank 0
                positions = [stream.state_dict()]
                if info.enabled:
                    gathered: list[Any] = [None] * info.world_size
                    torch.distributed.all_gather_object(gathered, positions[0])
                    positions = gathered
            if info.is_main:
                assert saved_model is not None
                trainer_state = {
                    "step": at_step,
                    "optimizer": fsdp.SHARDED_DIR if sharded else optimizer.state_dict(),
                    "rng": rng or _rng_state(device),
                    "data": (
                        {"sequences_consumed": at_step * sampler.global_batch, "epoch": sampler.epoch_at(at_step)}
                        if stream is None
                        else {
                            "sequences_consumed": at_step * tc.batch_size * tc.grad_accum * info.world_size,
                            "epoch": stream.epoch,
                            "stream": positions,
                        }
                    ),
                }
                path = save_checkpoint(
                    out_dir,
                    at_step,
                    saved_model,
                    cfg,
                    trainer_state=trainer_state,
                    tokenizer=data.tokenizer,
                    data_manifest=data.manifest,
                    keep=tc.keep_checkpoints,
                    sharded=shard_dir,
                )
            barrier(info)
            return path, saved_model

        end_step = tc.max_steps if stop_after is None else min(tc.max_steps, start_step + stop_after)
        bar = Reporter(progress, "train", tc.max_steps, unit="step", initial=start_step, enabled=info.is_main)
        if info.is_main:
            bar.message(model_line)
        model.train()
        # A frozen backbone runs in eval mode (no dropout): the bank learns the hidden states the model really
        # produces. Re-applied after each validation, whose eval_mode restores train mode everywhere.
        model.transformer.train(stage != "frozen")
        step = start_step
        last_eval: dict[str, float] = {}
        t_last, tokens_since = time.perf_counter(), 0
        # What an interrupt can save: the weights and optimizer after ``completed`` steps and the RNG states
        # right after that step (nothing draws from them between steps). ``consistent`` is False while the
        # optimizer updates the weights and, for a streamed corpus (its position moves per micro-batch), during
        # the micro-batches too.
        completed, completed_rng, consistent, saved_at = start_step, _rng_state(device), True, -1

        def save_on_interrupt() -> None:
            # A torchrun job's ranks cannot agree on a step here (periodic checkpoints cover it); in the middle
            # of an update nothing consistent is left to save.
            if not info.enabled and consistent and saved_at != completed and (completed > start_step or not resume):
                do_checkpoint(completed, completed_rng)
            has_ckpt = (out_dir / "checkpoints" / "latest").exists()
            bar.message(
                f"interrupted after step {completed}: "
                + (
                    f"checkpoint {find_checkpoint(out_dir)}; continue with --resume"
                    if has_ckpt
                    else "no checkpoint was saved"
                )
            )
            bar.close(stopped=True)

        on_interrupt = save_on_interrupt
        interrupts.install()
        for step in range(start_step, end_step):
            consistent = stream is None  # a stream's position moves with each micro-batch
            lr = tc.lr_at(step)
            if stage == "frozen" and step >= tc.frozen_steps:  # retrofit stage 2: the backbone joins
                stage = "main"
                set_trainable(model, stage_names[stage])
                model.transformer.train()
                bar.message(f"step {step}: stage 2, training {tc.trainable} parameters")
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            weights = cfg.loss.weights_at(step)
            terms_sum: dict[str, float] = {}
            for micro in range(tc.grad_accum):
                if stream is not None:
                    batch = torch.from_numpy(stream.batch(tc.batch_size)).to(device, non_blocking=True)
                else:
                    assert shards is not None
                    ids = sampler.micro_indices(step, micro, info.rank)
                    batch = torch.from_numpy(shards.train.sequences(ids, T)).to(device, non_blocking=True)
                x, y = batch[:, :-1], batch[:, 1:]  # (B, T) each
                last_micro = micro == tc.grad_accum - 1
                sync = nullcontext() if (ddp is None or last_micro) else ddp.no_sync()
                fsdp.set_gradient_sync(model, last_micro)
                with sync:
                    with autocast or nullcontext():
                        out = fwd_model(x, y, loss_weights=weights)
                    (out.loss / tc.grad_accum).backward()
                for name, value in out.losses.items():
                    terms_sum[name] = terms_sum.get(name, 0.0) + float(value.detach()) / tc.grad_accum
                terms_sum["loss"] = terms_sum.get("loss", 0.0) + float(out.loss.detach()) / tc.grad_accum
                tokens_since += x.numel() * info.world_size
            if not math.isfinite(terms_sum["loss"]):  # diverged: stop before the optimizer spreads it
                last = find_checkpoint(out_dir) if (out_dir / "checkpoints" / "latest").exists() else None
                raise RunError(
                    f"the training loss became {terms_sum['loss']} at step {step + 1} of {out_dir}"
                    + (f"; the last good checkpoint is {last}" if last else "; no checkpoint was saved"),
                    fix="lower train.lr (or raise train.warmup_steps / lower train.grad_clip) and "
                    "resume with --resume, or start again with --overwrite",
                )
            grad_norm = fsdp.full_value(
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip or float("inf"))
            )
            consistent = False  # the update below changes the weights and the optimizer state
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done = step + 1
            completed, completed_rng, consistent = done, _rng_state(device), True
            shown: dict[str, float] = {}
            if done % tc.log_interval == 0 or done == tc.max_steps:
                # (2,): the weighted total (CE + REC + R1 + R2, what is minimised) and the CE alone, the
                # quantity validation reports, both averaged over the ranks
                loss_t, ce_t = all_reduce_mean(
                    torch.tensor([terms_sum["loss"], terms_sum["ce"]], device=device), info
                ).tolist()
                now = time.perf_counter()
                record = {
                    "step": done,
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    **{f"train_{k}": v for k, v in terms_sum.items()},
                    "train_loss": float(loss_t),
                    "tokens_per_s": tokens_since / max(now - t_last, 1e-9),
                    "epoch": sampler.epoch_at(done) if stream is None else float(stream.epoch),
                }
                t_last, tokens_since = now, 0
                log.write(record)
                shown = {
                    "ce": ce_t,
                    **({"total": loss_t} if model.is_prism else {}),
                    "tokens_per_s": round(record["tokens_per_s"]),
                }
            bar.update(1, **shown)
            # Validation on rank 0 only: every rank would compute the same numbers on the same fixed
            # sample; the other ranks wait at their next gradient all-reduce. A sharded model's forward is a
            # collective (each unit all-gathers its weights), so under FSDP every rank evaluates.
            if (info.is_main or sharded) and (done % tc.eval_interval == 0 or done == tc.max_steps):
                last_eval = do_eval()
                model.transformer.train(stage != "frozen")
                if info.is_main:
                    log.write({"step": done, **last_eval})
                    bar.message(format_eval_line(done, last_eval, terms_sum["ce"]))
            if tc.checkpoint_due(done) and done != end_step:
                do_checkpoint(done)
                saved_at = done
            if interrupts.requested and done != end_step:  # a signal asked to stop: at this step boundary
                raise KeyboardInterrupt(interrupts.requested)
        on_interrupt = None
        interrupts.restore()
        bar.close()
        final_step = max(end_step, start_step)
        ckpt_path, final_model = do_checkpoint(final_step)
        return TrainResult(
            run_dir=out_dir,
            checkpoint=ckpt_path or find_checkpoint(out_dir),
            step=final_step,
            metrics=last_eval if info.is_main else {},
            model=final_model,
        )
    except KeyboardInterrupt:
        if on_interrupt is not None:
            interrupts.restore()  # a further Ctrl-C while saving stops at once
            on_interrupt()
        raise
    except OSError as e:
        if e.errno in _WRITE_ERRORS:  # read-only folder, no permission, full disk: the user's to fix
            raise RunError(
                f"cannot write {e.filename or out_dir}: {e.strerror}",
                fix="free disk space or choose a writable --out; resume later with --resume",
            ) from e
        raise
    finally:
        interrupts.restore()
        if lock is not None:
            lock.release()
        # Free the DDP wrapper (its gradient reducer holds the process group) while the group is still alive.
        # Left to the frame's teardown, the reducer can drop the last reference to a gloo group after
        # destroy_process_group, and ~ProcessGroupGloo then joins gloo's worker thread while holding the GIL
        # that thread needs to free a finished all-gather: a hang at exit (seen in the 2-process tests).
        with suppress(NameError):  # unbound when an error came before they were made
            del ddp, ddp_model, fwd_model
        gc.collect()
        cleanup(info)


def _rng_state(device: torch.device) -> dict[str, torch.Tensor | None]:
    """The RNG states a checkpoint records (dropout draws from them), copied now."""
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


class _Interrupts:
    """Ctrl-C (SIGINT) or SIGTERM while training: the first asks the loop to stop at the end of the current
    step, which then saves a checkpoint there (``requested`` names the signal); a second one stops at once
    (``KeyboardInterrupt`` wherever the loop is). Installed only in the main thread of a single process:
    under torchrun every rank would have to stop at the same step."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def install(self) -> None:
        if self.enabled and not self._previous:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()


_WRITE_ERRORS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}
STORED_Z_DIR = "stored-z"
"""Where a retrofit keeps the frozen backbone's stored z: ``RUN/stored-z`` (``prismlm.train.stored_z``)."""


def _holds_run(folder: Path) -> bool:
    """A run folder, even one stopped before env.json was written (its config.json is a RunConfig) or a
    retrofit stopped in its z pass (only ``RUN/stored-z`` so far)."""
    if folder_kind(folder) == RUN or (folder / STORED_Z_DIR / "manifest.json").exists():
        return True
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "model" in cfg and "train" in cfg


def _has_checkpoint(out_dir: Path) -> bool:
    try:
        find_checkpoint(out_dir)
    except CheckpointError:
        return False
    return True


def _restart_fix(out_dir: Path) -> str:
    """How to go on with a run folder that has nothing to resume."""
    if not any((out_dir / name).exists() for name in RUN_FILES) and (out_dir / STORED_Z_DIR).is_dir():
        return "its z pass was interrupted: run the same prism retrofit command again (without --resume) to continue it"
    if _holds_run(out_dir):
        return (
            "nothing to resume: start it again with --overwrite (a retrofit's stored z is kept and reused), "
            "or choose another --out"
        )
    return "start it without --resume"


def check_run_folder(out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to start a new run in a folder that holds one, unless ``overwrite``; refuse to resume a
    folder that does not exist (before the lock would create it); refuse a file, a run's checkpoints or a
    non-empty folder that holds no run whatever the flags (``check_out_folder``)."""
    if resume and not out_dir.exists():
        raise CheckpointError(f"cannot resume {out_dir}: no such run", fix="start it without --resume")
    check_out_folder(out_dir, "run", holds=_holds_run, overwrite=True)  # the run itself: decided below
    if resume or overwrite or not out_dir.exists():
        return
    held = [name for name in RUN_FILES if (out_dir / name).exists()]
    if held and not _has_checkpoint(out_dir):  # stopped before its first checkpoint: --resume has nothing
        raise RunError(
            f"{out_dir} already holds a run stopped before its first checkpoint ({', '.join(held)})",
            fix=_restart_fix(out_dir),
        )
    if held:
        raise RunError(
            f"{out_dir} already holds a run ({', '.join(held)})",
            fix="continue it with --resume, replace it with --overwrite, or choose another --out",
        )


def clear_run_folder(out_dir: Path) -> None:
    """``--overwrite``: remove the previous run's files (only those a run writes)."""
    import shutil

    for name in RUN_FILES:
        p = out_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def format_eval_line(step: int, m: dict[str, float], train_ce: float | None = None) -> str:
    """The validation line: val CE (``val_loss`` is the CE alone) beside the train CE of this step's batch
    (not the weighted total loss, which adds REC, R1 and R2); ``None`` when no CE was computed (a bank-only
    stage on stored z, where the logits are the frozen model's)."""
    s = f"step {step}: val CE {m['val_loss']:.4f} (ppl {m['val_ppl']:.1f})"
    if train_ce is not None:
        s += f", train CE {train_ce:.4f} (this step's batch)"
    if "r1_bar" in m:
        s += f" | R̄1 {m['r1_bar']:.3f} R2 {m['r2']:.3f} residual {m['residual_share']:.3f} dead {m['dead_prototypes']}"
    return s
