"""Retrofit stage 2 on stored boundary activations: train the last N blocks, the final norm and the bank on
the residual stream stored at block L = n_layer − N, so a step runs N blocks instead of all of them.

The backbone pass of stage 1 (``build_stored_z(..., boundary_layer=L)``) stores, per training token, the
source model's z and the residual stream h entering block L. A step reads h and z_src for the trainer's batch
(same sampler, schedule, optimizer groups and clipping as ``train``), computes z = blocks_L…(h) with the
current weights, and minimises

    KL(p_src ‖ softmax(W z)) + λ_proto_kl · KL(p_src ‖ softmax(W ẑ)) + λ_rec REC + λ₁ R1 + λ₂ R2,

p_src = softmax(W z_src) the source model's distribution (distillation keeps the model's predictions; the
prototype term asks the blocks and the bank to write the prediction through ẑ). With ``train.stage2_target=data``
the stage is a fine-tune instead: CE(W z, next token) + λ_proto_kl · KL(sg(softmax(W z)) ‖ softmax(W ẑ)) + the
same REC, R1, R2 (the trainer's objective on N blocks a step). W stays frozen. Checkpoints
are ordinary run checkpoints (every consumer reads them as any run); a killed stage continues from the
latest one with the same command, bit for bit on CPU. Invariant: the blocks read stored activations, so the
stage's own numbers are those of the stored path; the saved model is evaluated with its full forward.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from prismlm.config import RunConfig
from prismlm.errors import ArtifactMismatch, ConfigError, RunError
from prismlm.eval.faithfulness import FaithfulnessAccumulator, Yardstick
from prismlm.model import PrismLM, PrismOutput, eval_mode
from prismlm.model import losses as L
from prismlm.model.prototypes import PrototypeOutput
from prismlm.model.stored_activations import StoredZ, backbone_identity
from prismlm.progress import Progress, Reporter
from prismlm.train.bank_stage import save_stored_stage_checkpoint, validate_run
from prismlm.train.checkpoint import find_checkpoint, load_checkpoint
from prismlm.train.records import format_eval_line
from prismlm.train.sampler import SequenceSampler
from prismlm.train.state import TrainResult, build_optimizer, set_trainable, trainable_names

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet


def boundary_layer_for(cfg: RunConfig) -> int | None:
    """The block whose input stage 2 trains from: n_layer − N for ``train.trainable=last-N`` with stage 2 on
    stored activations (``train.stage2_from_stored`` and ``frozen_from_stored_z``); None otherwise."""
    tc = cfg.train
    if not (tc.stage2_from_stored and tc.frozen_from_stored_z and tc.trainable.startswith("last-")):
        return None
    n_last = int(tc.trainable.removeprefix("last-"))
    if n_last > cfg.model.n_layer:
        raise ConfigError(
            f"train.trainable={tc.trainable}: the model has only {cfg.model.n_layer} blocks",
            fix=f"use last-1 … last-{cfg.model.n_layer}",
        )
    return cfg.model.n_layer - n_last


def stage2_losses(
    model: PrismLM,
    h: torch.Tensor,
    z_source: torch.Tensor,
    layer: int,
    *,
    proto_kl: bool,
    candidates: int = 0,
    candidate_ids: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The loss terms of one stored batch. h, z_source: (B, T, d) the stored boundary activations and the
    source model's z of the same tokens. Returns unweighted scalars ``source_kl``, ``rec``, ``r1``, ``r2``,
    and with ``proto_kl`` also ``proto_kl`` and ``proto_top1`` (no gradient: how often argmax W ẑ is the
    source's argmax on the batch, over the vocabulary the KL terms see).

    ``targets`` (B, T) the stored next tokens (``train.stage2_target=data``): the full-model term is ``ce``
    (over the whole vocabulary) instead of ``source_kl``, and the prototype term's reference is the model's
    own detached prediction, on the union of every row's c most likely tokens under it (``proto_top1`` then
    counts agreement with the model's own argmax); z_source is not read.

    ``candidates`` = c > 0: both KL terms see only the union U, over the batch, of every token's c most likely
    source tokens, each distribution renormalised on U (``loss.kl_candidates``): the products with W
    are (N, |U|) instead of (N, V); c = 0 is the exact full-vocabulary KL. ``candidate_ids`` (B·T, ≥ c): each
    token's source candidates ranked once (``StoredZ.candidate_ids``), so the source's (N, V) product is
    never formed; None ranks them here."""
    B, T, d = h.shape
    z = model.hidden_from_layer(h, layer).reshape(B * T, d)  # (N, d) with the current top blocks
    po = model.require_prototypes()(z)
    if targets is not None:
        return _data_losses(model, z, po, targets.reshape(B * T), proto_kl=proto_kl, candidates=candidates)
    with torch.no_grad():
        z_src = z_source.reshape(B * T, d)
        if candidates and candidate_ids is not None:
            head = L.restricted_unembedding(model.lm_head, candidate_ids, candidates)
            source_logits = head(z_src)  # (N, |U|)
        else:
            source_logits = model.lm_head(z_src)  # (N, V): W is frozen
            head = L.candidate_unembedding(model.lm_head, source_logits, candidates)
            if candidates:
                source_logits = head(z_src)  # (N, |U|)
        log_p_source = F.log_softmax(source_logits.float(), dim=-1)
    terms = {
        "source_kl": L.kl_to_reference(log_p_source, head(z)),
        "rec": L.reconstruction_loss(po.residual, z),
        "r1": L.r1_loss(po.proto_max_cos),
        "r2": L.r2_loss(po.token_max_cos),
    }
    if proto_kl:  # a (N, V) product as costly as the model's own logits: only when the term is on
        proto_logits = head(po.reconstruction.to(z.dtype))  # (N, V) or (N, |U|): the prototypes alone
        terms["proto_kl"] = L.kl_to_reference(log_p_source, proto_logits)
        terms["proto_top1"] = (proto_logits.detach().argmax(-1) == source_logits.argmax(-1)).float().mean()
    return terms


def _data_losses(
    model: PrismLM, z: torch.Tensor, po: PrototypeOutput, targets: torch.Tensor, *, proto_kl: bool, candidates: int
) -> dict[str, torch.Tensor]:
    """``stage2_losses`` of a fine-tune (``train.stage2_target=data``): z (N, d) the top blocks' output, po the
    bank's output on it, targets (N,) the next tokens."""
    logits = model.lm_head(z)  # (N, V)
    terms = {
        "ce": F.cross_entropy(logits.float(), targets),
        "rec": L.reconstruction_loss(po.residual, z),
        "r1": L.r1_loss(po.proto_max_cos),
        "r2": L.r2_loss(po.token_max_cos),
    }
    if proto_kl:
        head = L.candidate_unembedding(model.lm_head, logits, candidates)  # the model's own top-c, detached
        own = head(z).detach() if candidates else logits
        proto_logits = head(po.reconstruction.to(z.dtype))  # (N, V) or (N, |U|): the prototypes alone
        terms["proto_kl"] = L.prototype_kl(own, proto_logits)
        terms["proto_top1"] = (proto_logits.detach().argmax(-1) == own.detach().argmax(-1)).float().mean()
    return terms


def stage2_plan(out_dir: Path, cfg: RunConfig) -> Stage2Plan | None:
    """The plan to continue stage 2 on stored activations in ``out_dir`` when its config asks for it, its
    latest checkpoint is at or past the end of stage 1 and before ``max_steps``, and its stored
    activations hold the boundary layer; None otherwise (the trainer's per-step path applies)."""
    from prismlm.model.stored_activations import open_stored_z
    from prismlm.train.run_folder import STORED_Z_DIR

    layer = boundary_layer_for(cfg)
    if layer is None:
        return None
    step = int(find_checkpoint(out_dir).name.removeprefix("step-"))
    if not cfg.train.frozen_steps <= step < cfg.train.max_steps:
        return None
    store = open_stored_z(out_dir / STORED_Z_DIR).check()
    if store.boundary_layer != layer:
        raise ConfigError(
            f"the stored activations at {store.path} hold block {store.boundary_layer}'s input, not block {layer}'s "
            f"(train.trainable={cfg.train.trainable})",
            fix="resume with the run's own recipe, or set train.stage2_from_stored=false",
        )
    return Stage2Plan(out_dir=out_dir, store=store, layer=layer, start_step=step)


@dataclass
class Stage2Plan:
    """Where stage 2 on stored activations starts: the run's latest checkpoint (stage 1's last, or a stage-2
    one after a kill) and the stored activations it trains on."""

    out_dir: Path
    store: StoredZ
    layer: int
    start_step: int


def train_stage2_stored(
    plan: Stage2Plan,
    cfg: RunConfig,
    *,
    shards: ShardSet,
    device: torch.device,
    progress: Progress = True,
    stop_after: int | None = None,
) -> TrainResult:
    """Steps ``plan.start_step`` … ``train.max_steps`` of stage 2 on stored activations into ``plan.out_dir``
    (the caller holds its lock), from the run's latest checkpoint: validation every ``eval_interval`` steps
    (the full model on the validation split, as ``train``), checkpoints every ``ckpt_interval`` (default:
    at each validation) and at the end, metrics lines appended to ``metrics.jsonl``. ``stop_after``: stop
    (with a checkpoint) after this many steps of this call — simulates a kill in tests."""
    tc = cfg.train
    ckpt = load_checkpoint(find_checkpoint(plan.out_dir), device="cpu")
    state = ckpt.trainer_state()
    if int(state["step"]) != plan.start_step:
        raise RunError(f"{ckpt.path} is at step {state['step']}, not {plan.start_step}")
    model = ckpt.model.to(device)
    if plan.store.manifest.get("boundary_backbone") != backbone_identity(model, plan.layer):
        raise ArtifactMismatch(
            f"the stored boundary activations at {plan.store.path} were made by another model than the blocks "
            f"below {plan.layer} of {ckpt.path}",
            fix=f"remove {plan.store.path} and run the retrofit again (its z pass rebuilds them)",
        )
    plan.store.check(shard_key=shards.manifest["key"], block_size=cfg.model.block_size, split="train")
    optimizer = build_optimizer(model, cfg, device)
    saved = state["optimizer"]
    if isinstance(saved, str):  # a sharded (FSDP) optimizer: stage 2 on stored activations runs in one process
        raise RunError(f"{ckpt.path} holds a sharded optimizer state; stage 2 on stored activations cannot load it")
    optimizer.load_state_dict(saved)
    set_trainable(model, trainable_names(model, tc.trainable))
    torch.set_rng_state(state["rng"]["torch"])
    sampler = SequenceSampler(plan.store.num_sequences, tc.batch_size, tc.grad_accum, 1, tc.seed)
    end = tc.max_steps if stop_after is None else min(tc.max_steps, plan.start_step + stop_after)
    ckpt_every = tc.ckpt_interval if tc.ckpt_interval is not None else tc.eval_interval
    metrics: dict[str, float] = {}
    model.train()
    t_last, tokens_since = time.perf_counter(), 0
    with Reporter(progress, "stage2", end - plan.start_step, unit="step") as bar:
        for step in range(plan.start_step, end):
            sums = stage2_step(model, optimizer, plan.store, plan.layer, cfg, sampler, step, device)
            tokens_since += tc.batch_size * tc.grad_accum * plan.store.block_size
            done = step + 1
            if done % tc.log_interval == 0 or done == end:
                now = time.perf_counter()
                _append_metrics(
                    plan.out_dir,
                    {
                        "step": done,
                        "lr": tc.lr_at(step),
                        **{f"train_{k}": v for k, v in sums.items()},
                        "tokens_per_s": tokens_since / max(now - t_last, 1e-9),
                        "epoch": sampler.epoch_at(done),
                        "stage2_stored": 1,
                    },
                )
                t_last, tokens_since = now, 0
            if done % tc.eval_interval == 0 or done == tc.max_steps:
                metrics = validate_run(model, cfg, shards, device, done)
                _append_metrics(plan.out_dir, {"step": done, **metrics})
                bar.message(format_eval_line(done, metrics))
                model.train()
            if (ckpt_every and done % ckpt_every == 0) or done == end:
                save_stored_stage_checkpoint(
                    model, plan.store, cfg, plan.out_dir, done, optimizer, shards, device, torch.get_rng_state(),
                    {"stage2_stored": True},
                )  # fmt: skip
            bar.update(1, loss=sums["loss"])
    model.eval()
    return TrainResult(
        run_dir=plan.out_dir, checkpoint=find_checkpoint(plan.out_dir), step=end, metrics=metrics, model=model
    )


def stage2_step(
    model: PrismLM,
    optimizer: torch.optim.AdamW,
    store: StoredZ,
    layer: int,
    cfg: RunConfig,
    sampler: SequenceSampler,
    step: int,
    device: torch.device,
) -> dict[str, float]:
    """Optimizer step ``step`` of stage 2 on ``store``'s rows from block ``layer`` (gradient accumulation,
    clipping, the scheduled learning rate); returns the micro-batch-averaged terms and loss. With
    ``loss.kl_candidates`` = c and the store's candidates ranked (``build_stored_candidates``), they are read. Only the
    parameters that require grad move: a boundary below n_layer − N with ``last-N`` trainable runs the blocks
    in between frozen (the stage-2 sweep of ``bench/real_faithfulness.py`` compares N on one store so)."""
    tc = cfg.train
    lr = tc.lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    data = tc.stage2_target == "data"  # a fine-tune on the stored next tokens, else distillation to the source
    weights = {**cfg.loss.weights_at(step), "ce" if data else "source_kl": 1.0}
    c = cfg.loss.kl_candidates
    # ranked once: no (N, V) product of the source per step (a fine-tune ranks the model's own, which moves)
    stored = not data and store.candidates_for(c, model.lm_head)
    sums: dict[str, float] = {}
    for micro in range(tc.grad_accum):
        ids = sampler.micro_indices(step, micro, 0)
        h = store.boundary_hidden(ids).to(device)  # (B, T, d)
        z_source = store.hidden(ids).to(device)  # (B, T, d)
        terms = stage2_losses(
            model, h, z_source, layer, proto_kl=weights.get("proto_kl", 0.0) > 0, candidates=c,
            candidate_ids=store.candidate_ids(ids, c).to(device) if stored else None,
            targets=store.next_tokens(ids).to(device) if data else None,
        )  # fmt: skip
        loss = sum(
            (weights[k] * v for k, v in terms.items() if weights.get(k, 0.0) != 0.0), torch.zeros((), device=device)
        )
        (loss / tc.grad_accum).backward()
        for k, v in {**terms, "loss": loss}.items():
            sums[k] = sums.get(k, 0.0) + float(v.detach()) / tc.grad_accum
    if not math.isfinite(sums["loss"]):
        raise RunError(
            f"stage 2's loss became {sums['loss']} at step {step + 1}",
            fix="lower train.lr or train.backbone_lr_ratio; resume from the last checkpoint",
        )
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    sums["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip or float("inf")))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return sums


def _append_metrics(out_dir: Path, line: dict[str, float]) -> None:
    with open(out_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


@torch.no_grad()
def heldout_stage2_metrics(
    model: PrismLM,
    store: StoredZ,
    layer: int | None,
    *,
    max_sequences: int = 64,
    batch_size: int = 4,
    yardstick: Yardstick | None = None,
) -> dict[str, float]:
    """The stored path's numbers on held-out stored activations (a store of the validation split made by the
    source model, with the same boundary layer), over its first ``max_sequences`` sequences: the faithfulness
    metrics of ``prismlm.eval.faithfulness`` (``top1_agreement``, ``kl``, ``margin_share``, … with their
    yardsticks; ``yardstick`` None: fitted on the first batch), and against the source: ``source_kl``
    KL(p_src ‖ p), ``top1_vs_source``, ``ce`` and ``ce_source`` on the stored next tokens, ``residual_share``
    mean ‖r‖/‖z‖. Cheap (N blocks a batch): what the stage-2 curve reports between validations. ``layer``
    None: a frozen model, whose z is the stored source z (no block runs)."""
    n = min(max_sequences, store.num_sequences)
    T, device = store.block_size, next(model.parameters()).device
    sums = dict.fromkeys(("source_kl", "top1_vs_source", "ce", "ce_source", "residual_share"), 0.0)
    acc, tokens = FaithfulnessAccumulator(yardstick=yardstick), 0
    with eval_mode(model):
        for start in range(0, n, batch_size):  # batches of sequences
            ids = np.arange(start, min(start + batch_size, n))
            z_src = store.hidden(ids).to(device)  # (b, T, d)
            targets = torch.from_numpy(np.asarray(store.targets[ids[0] * T : (ids[-1] + 1) * T], dtype=np.int64))
            z = z_src if layer is None else model.hidden_from_layer(store.boundary_hidden(ids).to(device), layer)
            b, d = z.shape[0], z.shape[-1]
            po = model.require_prototypes()(z.reshape(-1, d))
            logits, src = model.lm_head(z).float(), model.lm_head(z_src).float()  # (b, T, V)
            out = PrismOutput(
                logits=logits,
                hidden=z,
                indices=po.indices.view(b, T, -1),
                activations=po.activations.view(b, T, -1),
                residual=po.residual.view(b, T, d),
            )
            acc.update(model, out)
            flat, flat_src, y = logits.reshape(b * T, -1), src.reshape(b * T, -1), targets.to(device)
            batch = {
                "source_kl": L.kl_to_reference(F.log_softmax(flat_src, -1), flat),
                "top1_vs_source": (flat.argmax(-1) == flat_src.argmax(-1)).float().mean(),
                "ce": F.cross_entropy(flat, y),
                "ce_source": F.cross_entropy(flat_src, y),
                "residual_share": (po.residual.norm(dim=-1) / z.reshape(-1, d).norm(dim=-1).clamp_min(1e-8)).mean(),
            }
            for key, value in batch.items():
                sums[key] += float(value) * b * T
            tokens += b * T
    return acc.result() | {k: v / tokens for k, v in sums.items()} | {"tokens": float(tokens)}


__all__ = [
    "Stage2Plan",
    "boundary_layer_for",
    "heldout_stage2_metrics",
    "stage2_losses",
    "stage2_step",
    "train_stage2_stored",
]
