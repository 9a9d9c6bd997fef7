"""Retrofit: put a prototype head on a pretrained causal LM (spec §6), then train it.

Stage 1 trains only the bank with the backbone and W frozen, so the logits are exactly the pretrained
model's (on stored z: ``prismlm.model.stored_activations`` then ``prismlm.train.bank_stage``); stage 2 (optional)
fine-tunes jointly. The prototypes start as real hidden states of the corpus (``seed_prototypes``), so they
are data-anchored from step 0. The pretrained model comes from ``prismlm.model.pretrained`` (a transformers
model or a GGUF file) or ``prismlm.train.checkpoint.pretrained_from_run`` (a prismlm run). See docs/modules.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from prismlm.artifacts import RUN_FILES, FileLock
from prismlm.config import RunConfig
from prismlm.data.shards import ShardSet, default_data_dir, prepare_from_config
from prismlm.data.tokenizer import Tokenizer
from prismlm.errors import CheckpointError, ConfigError, ModelError, PrismError
from prismlm.model import PrismLM
from prismlm.model.bank_file import install_bank, load_bank
from prismlm.model.pretrained import Pretrained, build_model
from prismlm.model.prototypes import seed_prototypes
from prismlm.model.stored_activations import (
    backbone_identity,
    build_stored_candidates,
    build_stored_z,
    open_stored_z,
)
from prismlm.progress import Progress
from prismlm.train.bank_stage import BankStart, bank_stage, frozen_stage_steps
from prismlm.train.checkpoint import find_checkpoint, load_checkpoint
from prismlm.train.distributed import DistInfo, resolve_device
from prismlm.train.run_folder import STORED_Z_DIR, check_run_folder, clear_run_folder, has_checkpoint
from prismlm.train.stage2 import boundary_layer_for, stage2_plan, train_stage2_stored
from prismlm.train.state import TrainResult, trainable_names
from prismlm.train.trainer import check_data, train


def save_tokenizer(tok: Tokenizer, data_dir: str | None) -> Path:
    """Store the model's tokenizer where shards are cached, by content (so the run config can name it); a copy
    saved before without the model's chat template is rewritten with it."""
    root = (Path(data_dir).expanduser() if data_dir else default_data_dir()) / "tokenizers" / tok.fingerprint[:16]
    if not (root / "tokenizer.json").exists() or Tokenizer.load(root).chat_template != tok.chat_template:
        tok.save(root)
    return root


def seed_sequences(n_seq: int, T: int, num_tokens: int, seed: int) -> np.ndarray:
    """Sorted ids of the randomly drawn training sequences whose tokens seed the bank (enough for
    ``num_tokens``)."""
    want = min(n_seq, math.ceil(num_tokens / T))
    return np.sort(np.random.default_rng(seed).choice(n_seq, size=want, replace=False))


@torch.no_grad()
def sample_hidden(
    model: PrismLM, shards: ShardSet, num_tokens: int, *, batch_size: int = 16, seed: int = 0
) -> torch.Tensor:
    """Final hidden states z of ``num_tokens`` tokens from randomly drawn training sequences → (N, d) float32.
    Every position of a drawn sequence is kept (neighbouring tokens are as real as any)."""
    T = model.config.block_size
    ids = seed_sequences(shards.train.num_sequences(T), T, num_tokens, seed)
    want = len(ids)
    device = next(model.parameters()).device
    out = []
    for start in range(0, want, batch_size):  # batches of sequences
        x = torch.from_numpy(shards.train.sequences(ids[start : start + batch_size], T)[:, :-1].astype(np.int64))
        out.append(model.backbone(x.to(device)).reshape(-1, model.config.n_embd).float().cpu())  # (b·T, d)
    return torch.cat(out)[:num_tokens]


def retrofit(
    pre: Pretrained,
    cfg: RunConfig,
    out_dir: str | Path,
    *,
    shards: ShardSet,
    progress: Progress = True,
    overwrite: bool = False,
    seed_tokens: int | None = None,
) -> TrainResult:
    """Seed a prototype bank on ``pre``'s hidden states of ``shards`` and train ``cfg`` (whose model is
    ``pre.model`` with prototypes, ``train.trainable``/``frozen_steps`` the stages) into ``out_dir``."""
    protos = cfg.model.prototypes
    if protos is None:
        raise ModelError("retrofit needs a prototype head (model.prototypes is null)")
    torch.manual_seed(cfg.train.seed)
    model = build_model(pre, cfg.model)
    # refused now, before the backbone pass and before anything is written: last-N past the model's blocks,
    # splits shorter than one block (each would otherwise fail minutes later, leaving a run that is refused)
    trainable_names(model, cfg.train.trainable)
    check_data(cfg, shards, DistInfo(), new_vocab=False)
    rng_state = torch.get_rng_state()  # what the trainer holds after initialising the model (check_same_logits
    # draws from its own generator)
    pre.reference = None  # checked; the original model's weights are not needed during training (a second copy)
    n_tokens = seed_tokens if seed_tokens is not None else max(16 * protos.num_prototypes, 8192)
    if shards.tokenizer.fingerprint == pre.tokenizer.fingerprint:
        # the run saves the shards' tokenizer; shards cached before may hold a copy without the chat template
        shards = dataclasses.replace(shards, tokenizer=pre.tokenizer)
    start = _initial_bank(model, cfg)  # checked before the backbone pass; None: seeded from the stored z
    if cfg.train.frozen_from_stored_z and frozen_stage_steps(cfg) > 0 and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return _retrofit_on_stored_z(
            model,
            cfg,
            Path(out_dir),
            shards=shards,
            progress=progress,
            overwrite=overwrite,
            seed_tokens=n_tokens,
            rng_state=rng_state,
            start=start,
        )
    if start is not None:
        raise ConfigError(
            "train.init_bank starts the bank stage on stored z, which this retrofit does not run (no frozen steps, "
            "train.frozen_from_stored_z=false, or several processes)",
            fix="retrofit in one process with frozen steps on stored z, or leave train.init_bank unset",
            param="train.init_bank",
        )
    _seed_bank(model, sample_hidden(model, shards, n_tokens, seed=cfg.train.seed), cfg)
    return train(cfg, out_dir, shards=shards, progress=progress, overwrite=overwrite, initial_state=model.state_dict())


def _initial_bank(model: PrismLM, cfg: RunConfig) -> BankStart | None:
    """``train.init_bank``: the file's bank installed in ``model`` (checked against it) and where stage 1
    continues from; None when the bank is to be seeded here."""
    if cfg.train.init_bank is None:
        return None
    bank = load_bank(cfg.train.init_bank)
    install_bank(model, bank)
    if bank.step > frozen_stage_steps(cfg):
        raise ConfigError(
            f"the bank {bank.path} was saved at step {bank.step} of its stage; this retrofit's stage 1 ends at "
            f"step {frozen_stage_steps(cfg)}",
            fix=f"set steps >= {bank.step}, or leave train.init_bank unset to train a bank here",
            param="train.init_bank",
        )
    return BankStart(step=bank.step)


def _seed_bank(model: PrismLM, hidden: torch.Tensor, cfg: RunConfig) -> None:
    """Seed the bank from real hidden states (N, d) (``seed_prototypes``)."""
    bank_layer = model.require_prototypes()
    K, k = bank_layer.num_prototypes, bank_layer.cfg.top_k
    if hidden.shape[0] < K:
        raise ModelError(
            f"the training split holds {hidden.shape[0]} tokens, fewer than the {K} prototypes to seed",
            fix="use more data or fewer prototypes",
        )
    bank = seed_prototypes(hidden, K, k, generator=torch.Generator().manual_seed(cfg.train.seed))
    with torch.no_grad():  # an in-place copy on the parameter (not .data): bumps its version for any cache
        bank_layer.weight.copy_(bank)


def _retrofit_on_stored_z(
    model: PrismLM,
    cfg: RunConfig,
    out_dir: Path,
    *,
    shards: ShardSet,
    progress: Progress,
    overwrite: bool,
    seed_tokens: int,
    rng_state: torch.Tensor,
    start: BankStart | None = None,
) -> TrainResult:
    """Stage 1 on stored z (one backbone pass over the training split, resumable after a kill: run the same
    command again; then checkpoints at ``train.ckpt_interval``, continued by ``resume_on_stored_z``), seeded
    from the same rows the per-step path would sample; then stage 2, if any, as a ``train(..., resume=True)``
    of the checkpoint stage 1 wrote. The run folder's lock is held from the first write to the end of stage 2.
    A failure (an error, not a kill) before stage 1's first checkpoint removes what this call created."""
    tc = cfg.train
    device = resolve_device(tc.device)
    lock = FileLock(out_dir / ".lock", f"run folder {out_dir}", stages=True)  # stage 2 nests in it
    check_run_folder(out_dir, resume=False, overwrite=overwrite)
    created = _absent(out_dir)
    lock.acquire()
    try:
        if overwrite:
            clear_run_folder(out_dir)
        if tc.num_threads:
            torch.set_num_threads(tc.num_threads)
        model.to(device)
        try:
            store = build_stored_z(
                model,
                shards,
                out_dir / STORED_Z_DIR,
                dtype=tc.stored_z_dtype,
                batch_size=tc.batch_size,
                device=device,
                progress=progress,
                boundary_layer=boundary_layer_for(cfg),
            )
            store.check()  # complete
            if start is None:
                T = cfg.model.block_size
                seeds = store.hidden(seed_sequences(store.num_sequences, T, seed_tokens, tc.seed))
                _seed_bank(model, seeds.reshape(-1, cfg.model.n_embd)[:seed_tokens], cfg)
                start = BankStart()
            steps_left = start.step < frozen_stage_steps(cfg) or cfg.train.max_steps > frozen_stage_steps(cfg)
            if cfg.loss.kl_candidates and steps_left:  # ranked once here, read by every step of both stages
                store = build_stored_candidates(store, model.lm_head, cfg.loss.kl_candidates, progress=progress)
            result = bank_stage(
                model, store, cfg, out_dir, shards=shards, device=device, rng_state=rng_state, progress=progress,
                start=start,
            )  # fmt: skip
        except PrismError:
            if not has_checkpoint(out_dir):
                _remove_created(out_dir, created)
            raise
        return _after_bank_stage(result, cfg, out_dir, shards=shards, device=device, progress=progress)
    finally:
        lock.release()


def _after_bank_stage(
    result: TrainResult, cfg: RunConfig, out_dir: Path, *, shards: ShardSet, device: torch.device, progress: Progress
) -> TrainResult:
    """What follows a finished bank stage (the caller holds the run folder's lock): nothing when the run is
    done, else stage 2 — on stored boundary activations when the recipe asks for it, else the trainer's."""
    if result.step >= cfg.train.max_steps:
        return result
    plan = stage2_plan(out_dir, cfg)
    if plan is not None:
        return train_stage2_stored(plan, cfg, shards=shards, device=device, progress=progress)
    return train(cfg, out_dir, resume=True, shards=shards, progress=progress)


def _absent(out_dir: Path) -> list[str]:
    """What of a retrofit's files ``out_dir`` does not hold yet (``""``: the folder itself)."""
    if not out_dir.exists():
        return [""]
    return [name for name in (*RUN_FILES, STORED_Z_DIR) if not (out_dir / name).exists()]


def _remove_created(out_dir: Path, created: list[str]) -> None:
    """Remove the files (and the folder) a failed retrofit created, so that the same command is not refused."""
    for name in [""] if "" in created else created:
        p = out_dir / name
        if name == "":
            for q in p.iterdir():  # only what this run wrote; the lock file goes with the lock
                if q.name != ".lock":
                    shutil.rmtree(q) if q.is_dir() else q.unlink()
        elif p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def resume_on_stored_z(
    out_dir: Path, *, device: str, extend_to: int | None = None, progress: Progress = True
) -> TrainResult | None:
    """Continue a retrofit stopped (killed) in its bank stage on stored z, from the stage's latest checkpoint:
    the rest of the stage on the same stored z (checked batch by batch) ends with the bank an uninterrupted
    stage ends with, bit for bit; then stage 2 as a resume. None when the latest checkpoint is not one of the
    bank stage's, or ``extend_to`` changes the schedule (the trainer resumes it per step)."""
    try:
        ckpt = load_checkpoint(find_checkpoint(out_dir))
        state = ckpt.trainer_state()
    except CheckpointError:
        return None
    cfg = ckpt.config.override({"train.device": device})
    step = int(state["step"])
    optimizer = state["optimizer"]
    if "bank_stage" not in state or isinstance(optimizer, str) or extend_to is not None:
        return None
    if step >= frozen_stage_steps(cfg):
        return None
    with FileLock(out_dir / ".lock", f"run folder {out_dir}", stages=True):
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        shards = prepare_from_config(cfg.data, show_progress=progress)
        store = open_stored_z(out_dir / STORED_Z_DIR).check(
            backbone=backbone_identity(ckpt.model),
            shard_key=shards.manifest["key"],
            block_size=cfg.model.block_size,
            split="train",
        )
        lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        start = BankStart(step=step, optimizer=dict(optimizer), lines=[x for x in lines if x["step"] <= step])
        rng_state = state["rng"]["torch"]
        device_t = resolve_device(cfg.train.device)
        result = bank_stage(
            ckpt.model,
            store,
            cfg,
            out_dir,
            shards=shards,
            device=device_t,
            rng_state=rng_state,
            progress=progress,
            start=start,
        )
        return _after_bank_stage(result, cfg, out_dir, shards=shards, device=device_t, progress=progress)


def resume_stage2_stored(
    out_dir: Path, cfg: RunConfig, *, extend_to: int | None = None, progress: Progress = True
) -> TrainResult | None:
    """Continue a retrofit whose next steps are stage 2 on stored activations (``prismlm.train.stage2``) from
    its latest checkpoint, under the run folder's lock; None when they are not (the trainer's resume applies:
    stage 1 unfinished, another ``train.trainable``, or ``train.stage2_from_stored`` off)."""
    if boundary_layer_for(cfg) is None:
        return None
    if extend_to is not None:
        cfg = cfg.override({"train.max_steps": extend_to})
    lock = FileLock(out_dir / ".lock", f"run folder {out_dir}", stages=True)
    lock.acquire()
    try:
        plan = stage2_plan(out_dir, cfg)
        if plan is None:
            return None
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        shards = prepare_from_config(cfg.data, show_progress=progress)
        device = resolve_device(cfg.train.device)
        return train_stage2_stored(plan, cfg, shards=shards, device=device, progress=progress)
    finally:
        lock.release()
