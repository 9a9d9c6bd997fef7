"""Retrofit stage 1 on stored hidden states: train the prototype bank on z read from a ``StoredZ``.

With the backbone and W frozen a step needs only z: the trainer's frozen stage (same sampler order,
optimizer groups, schedules, clipping) with the backbone forward replaced by a read of stored rows, and the
loss REC + R1 + R2 (CE has no gradient into the bank). Invariant: with z stored in float32 the bank is the
per-step path's bit for bit on CPU. The stage ends with an ordinary checkpoint that ``train(...,
resume=True)`` continues with stage 2. See docs/modules.md.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from prismlm.config import RunConfig
from prismlm.errors import RunError
from prismlm.eval.metrics import evaluate
from prismlm.model import PrismLM
from prismlm.model import losses as L
from prismlm.progress import Progress, Reporter
from prismlm.train.checkpoint import save_checkpoint
from prismlm.train.distributed import DistInfo
from prismlm.train.sampler import SequenceSampler
from prismlm.train.stored_z import StoredZ
from prismlm.train.trainer import (
    TrainResult,
    autocast_for,
    build_optimizer,
    environment_info,
    format_eval_line,
    set_trainable,
    trainable_names,
)

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet


def frozen_stage_steps(cfg: RunConfig) -> int:
    """Optimizer steps during which only the bank trains: all of them with ``train.trainable=prototypes``,
    else ``train.frozen_steps`` (at most ``max_steps``)."""
    tc = cfg.train
    return tc.max_steps if tc.trainable == "prototypes" else min(tc.frozen_steps, tc.max_steps)


def bank_losses(model: PrismLM, z: torch.Tensor) -> dict[str, torch.Tensor]:
    """REC, R1, R2 of the bank on stored hidden states z (N, d) — the prototype terms of ``PrismLM.forward``."""
    po = model.require_prototypes()(z)
    return {
        "rec": L.reconstruction_loss(po.residual, z),
        "r1": L.r1_loss(po.proto_max_cos),
        "r2": L.r2_loss(po.token_max_cos),
    }


def train_bank(
    model: PrismLM,
    store: StoredZ,
    cfg: RunConfig,
    *,
    steps: int,
    device: torch.device,
    progress: Progress = True,
    log: list[dict[str, float]] | None = None,
) -> torch.optim.AdamW:
    """``steps`` optimizer steps of the bank alone on ``store``'s rows, in the trainer's batch order.
    Returns the optimizer (its state is what a stage-2 resume continues). ``log`` receives the metrics lines
    the trainer would write at ``train.log_interval``."""
    tc = cfg.train
    sampler = SequenceSampler(store.num_sequences, tc.batch_size, tc.grad_accum, 1, tc.seed)
    optimizer = build_optimizer(model, cfg, device)
    set_trainable(model, trainable_names(model, "prototypes"))
    bank = model.require_prototypes()
    t_last, tokens_since = time.perf_counter(), 0
    with Reporter(progress, "bank", steps, unit="step") as bar:
        for step in range(steps):
            lr = tc.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            weights = cfg.loss.weights_at(step)
            sums: dict[str, float] = {}
            for micro in range(tc.grad_accum):
                z = store.hidden(sampler.micro_indices(step, micro, 0)).to(device).reshape(-1, model.config.n_embd)
                terms = bank_losses(model, z)  # (B·T, d) → scalars
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
    return optimizer


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
) -> TrainResult:
    """Stage 1 on stored z into ``out_dir`` (whose lock the caller holds): config, env, metrics, one validation
    of the model and a checkpoint at the stage's last step, as ``train`` writes them. ``rng_state``: the torch
    RNG state the trainer would hold at that step (after the model's initialisation; stage 1 draws nothing),
    so a stage-2 resume draws its dropout masks as the per-step path would."""
    tc = cfg.train
    steps = frozen_stage_steps(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg.to_json(out_dir / "config.json")
    env = environment_info(DistInfo(), device, tc.seed)
    env["data_manifest"] = shards.manifest
    env["stored_z"] = {"path": str(store.path), "dtype": store.manifest["dtype"], "rows": store.manifest["rows"]}
    (out_dir / "env.json").write_text(json.dumps(env, indent=2, default=str) + "\n")
    lines: list[dict[str, float]] = []
    model.to(device)
    optimizer = train_bank(model, store, cfg, steps=steps, device=device, progress=progress, log=lines)
    # one validation of the whole model (the stage's only backbone forward besides the z pass), as the trainer
    # ends a run with one
    metrics = evaluate(
        model,
        shards.val,
        seq_len=cfg.model.block_size,
        batch_size=tc.batch_size,
        max_batches=tc.eval_batches,
        device=device,
        autocast=autocast_for(cfg, device),
        loss_weights=cfg.loss.weights_at(steps - 1),
    )
    with Reporter(progress, "validate", 1, unit="eval") as bar:
        bar.update(1)
        protos = cfg.model.prototypes
        bar.message(format_eval_line(steps, metrics, top_k=protos.top_k if protos else None))
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [*lines, {"step": steps, **metrics}]))
    sampler = SequenceSampler(store.num_sequences, tc.batch_size, tc.grad_accum, 1, tc.seed)
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    trainer_state = {
        "step": steps,
        "optimizer": optimizer.state_dict(),
        "rng": {"torch": rng_state, "cuda": cuda_rng},
        "data": {"sequences_consumed": steps * sampler.global_batch, "epoch": sampler.epoch_at(steps)},
    }
    path = save_checkpoint(
        out_dir,
        steps,
        model,
        cfg,
        trainer_state=trainer_state,
        tokenizer=shards.tokenizer,
        data_manifest=shards.manifest,
        keep=tc.keep_checkpoints,
    )
    return TrainResult(run_dir=out_dir, checkpoint=path, step=steps, metrics=metrics, model=model)


__all__ = ["bank_losses", "bank_stage", "frozen_stage_steps", "train_bank"]
