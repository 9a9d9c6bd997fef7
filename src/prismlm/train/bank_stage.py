"""Retrofit stage 1 on stored hidden states: train the prototype bank on z read from a ``StoredZ``.

With the backbone and W frozen a step needs only z: the trainer's frozen stage (same sampler order,
optimizer groups, schedules, clipping) with the backbone forward replaced by a read of stored rows, and the
loss REC + R1 + R2 (CE has no gradient into the bank). Invariant: with z stored in float32 the bank is the
per-step path's bit for bit on CPU. The stage ends with an ordinary checkpoint that ``train(...,
resume=True)`` continues with stage 2. Checkpoints are also written at ``train.ckpt_interval`` during the
stage; ``resume_bank_stage`` continues one on the same stored z to the same bank, bit for bit, as if never
stopped. See docs/modules.md.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prismlm.artifacts import atomic_write_text
from prismlm.config import RunConfig
from prismlm.errors import RunError
from prismlm.eval.metrics import evaluate
from prismlm.model import PrismLM
from prismlm.model import losses as L
from prismlm.model.stored_activations import StoredZ
from prismlm.progress import Progress, Reporter
from prismlm.train.checkpoint import save_checkpoint
from prismlm.train.distributed import DistInfo
from prismlm.train.records import environment_info, format_eval_line
from prismlm.train.sampler import SequenceSampler
from prismlm.train.state import TrainResult, autocast_for, build_optimizer, set_trainable, trainable_names

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet


def frozen_stage_steps(cfg: RunConfig) -> int:
    """Optimizer steps during which only the bank trains: all of them with ``train.trainable=prototypes``,
    else ``train.frozen_steps`` (at most ``max_steps``)."""
    tc = cfg.train
    return tc.max_steps if tc.trainable == "prototypes" else min(tc.frozen_steps, tc.max_steps)


def bank_losses(
    model: PrismLM,
    z: torch.Tensor,
    *,
    proto_kl_rows: int = 0,
    candidates: int = 0,
    candidate_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """REC, R1, R2 of the bank on stored hidden states z (N, d) — the prototype terms of ``PrismLM.forward`` —
    and with ``proto_kl_rows`` > 0 KL(softmax(W z) ‖ softmax(W ẑ)) on at most that many evenly spaced rows
    (over the rows' ``candidates`` top tokens' union when > 0: ``loss.kl_candidates``; ``candidate_ids``
    (N, ≥ c) those tokens ranked once, ``StoredZ.candidate_ids``, else ranked here from the (n, V) logits)."""
    po = model.require_prototypes()(z)
    terms = {
        "rec": L.reconstruction_loss(po.residual, z),
        "r1": L.r1_loss(po.proto_max_cos),
        "r2": L.r2_loss(po.token_max_cos),
    }
    if proto_kl_rows > 0:
        rows = slice(None, None, max(1, -(-z.shape[0] // proto_kl_rows)))
        with torch.no_grad():
            if candidates and candidate_ids is not None:
                head = L.restricted_unembedding(model.lm_head, candidate_ids[rows], candidates)
                logits = head(z[rows])  # (n, |U|)
            else:
                logits = model.lm_head(z[rows])  # (n, V) the frozen model's own logits
                head = L.candidate_unembedding(model.lm_head, logits, candidates)
                if candidates:
                    logits = head(z[rows])  # (n, |U|)
        terms["proto_kl"] = L.prototype_kl(logits, head(po.reconstruction[rows].to(z.dtype)))
    return terms


@dataclass
class BankStart:
    """Where a bank stage starts: step 0, or a checkpoint it wrote (``resume_bank_stage``)."""

    step: int = 0
    optimizer: dict[str, Any] | None = None
    """The optimizer's state dict at ``step`` (None: a fresh optimizer)."""
    lines: list[dict[str, float]] = field(default_factory=list)
    """The metrics lines written up to ``step``."""


def train_bank(
    model: PrismLM,
    store: StoredZ,
    cfg: RunConfig,
    *,
    steps: int,
    device: torch.device,
    progress: Progress = True,
    log: list[dict[str, float]] | None = None,
    start: BankStart | None = None,
    on_checkpoint: Callable[[int, torch.optim.AdamW], object] | None = None,
) -> torch.optim.AdamW:
    """``steps`` optimizer steps of the bank alone on ``store``'s rows, in the trainer's batch order.
    Returns the optimizer (its state is what a stage-2 resume continues). ``log`` receives the metrics lines
    the trainer would write at ``train.log_interval``. ``start``: continue from a checkpoint's step and
    optimizer state. ``on_checkpoint(done, optimizer)``: called after each step at ``train.ckpt_interval``
    (not the last)."""
    tc = cfg.train
    start = start or BankStart()
    sampler = SequenceSampler(store.num_sequences, tc.batch_size, tc.grad_accum, 1, tc.seed)
    optimizer = build_optimizer(model, cfg, device)
    if start.optimizer is not None:
        optimizer.load_state_dict(start.optimizer)
    set_trainable(model, trainable_names(model, "prototypes"))
    bank = model.require_prototypes()
    c = cfg.loss.kl_candidates
    t_last, tokens_since = time.perf_counter(), 0
    with Reporter(progress, "bank", steps, unit="step", initial=start.step) as bar:
        for step in range(start.step, steps):
            lr = tc.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            weights = cfg.loss.weights_at(step)
            sums: dict[str, float] = {}
            for micro in range(tc.grad_accum):
                kl_rows = cfg.loss.proto_kl_rows if weights.get("proto_kl", 0.0) > 0 else 0
                z, terms = _micro_batch_terms(model, store, sampler.micro_indices(step, micro, 0), kl_rows, c, device)
                loss = sum(
                    (weights[k] * v for k, v in terms.items() if weights.get(k, 0.0) != 0.0),
                    torch.zeros((), device=device),
                )
                (loss / tc.grad_accum).backward()
                for k, v in {**terms, "loss": loss}.items():
                    sums[k] = sums.get(k, 0.0) + float(v.detach()) / tc.grad_accum
                tokens_since += z.shape[0]
            if not math.isfinite(sums["loss"]):
                raise RunError(
                    f"the bank's loss became {sums['loss']} at step {step + 1} of stage 1",
                    fix="lower train.lr or raise train.warmup_steps",
                )
            grad_norm = torch.nn.utils.clip_grad_norm_(bank.parameters(), tc.grad_clip or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done = step + 1
            shown: dict[str, float] = {}
            if log is not None and (done % tc.log_interval == 0 or done == steps):
                now = time.perf_counter()
                log.append(
                    {
                        "step": done,
                        "lr": lr,
                        "grad_norm": float(grad_norm),
                        **{f"train_{k}": v for k, v in sums.items() if k != "loss"},
                        "train_loss": sums["loss"],
                        "tokens_per_s": tokens_since / max(now - t_last, 1e-9),
                        "epoch": sampler.epoch_at(done),
                        "stored_z": 1,
                    }
                )
                t_last, tokens_since = now, 0
                shown = {"loss": sums["loss"]}
            bar.update(1, **shown)
            if on_checkpoint is not None and done < steps and tc.checkpoint_due(done):
                on_checkpoint(done, optimizer)
    return optimizer


def _micro_batch_terms(
    model: PrismLM, store: StoredZ, seq_ids: np.ndarray, kl_rows: int, candidates: int, device: torch.device
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """z (B·T, d) of ``seq_ids`` read from the store, and the bank's loss terms on it (``bank_losses``), with the
    store's ranked candidates when the prototype KL runs over candidates and the store has them."""
    z = store.hidden(seq_ids).to(device).reshape(-1, model.config.n_embd)
    ranked = kl_rows > 0 and store.candidates_for(candidates, model.lm_head)
    ids = store.candidate_ids(seq_ids, candidates).to(device) if ranked else None
    return z, bank_losses(model, z, proto_kl_rows=kl_rows, candidates=candidates, candidate_ids=ids)


def bank_stage(
    model: PrismLM,
    store: StoredZ,
    cfg: RunConfig,
    out_dir: Path,
    *,
    shards: ShardSet,
    device: torch.device,
    rng_state: torch.Tensor,
    progress: Progress = True,
    start: BankStart | None = None,
) -> TrainResult:
    """Stage 1 on stored z into ``out_dir`` (whose lock the caller holds): config, env, metrics, checkpoints at
    ``train.ckpt_interval``, one validation of the model and a checkpoint at the stage's last step, as
    ``train`` writes them. ``rng_state``: the torch RNG state the trainer would hold at that step (after the
    model's initialisation; stage 1 draws nothing), so a stage-2 resume draws its dropout masks as the
    per-step path would. ``start``: continue from one of this stage's checkpoints (``resume_bank_stage``)."""
    tc = cfg.train
    steps = frozen_stage_steps(cfg)
    start = start or BankStart()
    if start.optimizer is None:  # a new run folder (seeded, or a bank file's): not a resume
        out_dir.mkdir(parents=True, exist_ok=True)
        cfg.to_json(out_dir / "config.json")
        env = environment_info(DistInfo(), device, tc.seed)
        env["data_manifest"] = shards.manifest
        env["stored_z"] = {"path": str(store.path), "dtype": store.manifest["dtype"], "rows": store.manifest["rows"]}
        (out_dir / "env.json").write_text(json.dumps(env, indent=2, default=str) + "\n")
    lines: list[dict[str, float]] = [dict(x) for x in start.lines]
    model.to(device)

    def save(step: int, optimizer: torch.optim.AdamW, final: list[dict[str, float]] | None = None) -> Path:
        # metrics first: a checkpoint never lacks the lines up to its step (a resume keeps those, drops later)
        text = "".join(json.dumps(x) + "\n" for x in [*lines, *(final or [])])
        atomic_write_text(out_dir / "metrics.jsonl", text)
        stage: dict[str, object] = {"bank_stage": {"stored_z": str(store.path)}}  # what resume_bank_stage reads
        return save_stored_stage_checkpoint(
            model, store, cfg, out_dir, step, optimizer, shards, device, rng_state, stage
        )

    optimizer = train_bank(
        model, store, cfg, steps=steps, device=device, progress=progress, log=lines, start=start, on_checkpoint=save
    )
    # one validation of the whole model (the stage's only backbone forward besides the z pass), as the trainer
    # ends a run with one
    metrics = validate_run(model, cfg, shards, device, steps)
    with Reporter(progress, "validate", 1, unit="eval") as bar:
        bar.update(1)
        protos = cfg.model.prototypes
        bar.message(format_eval_line(steps, metrics, top_k=protos.top_k if protos else None))
    path = save(steps, optimizer, [{"step": steps, **metrics}])
    return TrainResult(run_dir=out_dir, checkpoint=path, step=steps, metrics=metrics, model=model)


def validate_run(model: PrismLM, cfg: RunConfig, shards: ShardSet, device: torch.device, step: int) -> dict[str, float]:
    """The whole model on the validation split at the end of optimizer step ``step`` (1-based), as the trainer
    validates: ``train.eval_batches`` batches, the run's autocast and that step's loss weights."""
    return evaluate(
        model,
        shards.val,
        seq_len=cfg.model.block_size,
        batch_size=cfg.train.batch_size,
        max_batches=cfg.train.eval_batches,
        device=device,
        autocast=autocast_for(cfg, device),
        loss_weights=cfg.loss.weights_at(step - 1),
    )


def save_stored_stage_checkpoint(
    model: PrismLM,
    store: StoredZ,
    cfg: RunConfig,
    out_dir: Path,
    step: int,
    optimizer: torch.optim.AdamW,
    shards: ShardSet,
    device: torch.device,
    rng_state: torch.Tensor,
    stage: dict[str, object],
) -> Path:
    """An ordinary run checkpoint at ``step`` of a stage trained on ``store`` (the bank stage, stage 2 on stored
    activations): the trainer's state (optimizer, RNG, the data position of its sampler) plus ``stage``, the
    entry saying which stage wrote it."""
    tc = cfg.train
    sampler = SequenceSampler(store.num_sequences, tc.batch_size, tc.grad_accum, 1, tc.seed)
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    trainer_state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "rng": {"torch": rng_state, "cuda": cuda_rng},
        "data": {"sequences_consumed": step * sampler.global_batch, "epoch": sampler.epoch_at(step)},
        **stage,
    }
    return save_checkpoint(
        out_dir,
        step,
        model,
        cfg,
        trainer_state=trainer_state,
        tokenizer=shards.tokenizer,
        data_manifest=shards.manifest,
        keep=tc.keep_checkpoints,
    )


__all__ = ["BankStart", "bank_losses", "bank_stage", "frozen_stage_steps", "train_bank"]
