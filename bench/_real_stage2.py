"""``bench/real_retrofit.py --stage stage2``: issue 26 item 3's stage 2 on the real model.

The run is the project's own: ``prismlm.app.retrofit.retrofit_model`` (what ``prism retrofit --unfreeze``
runs) with stage 1 on stored z (the bank alone, ``--frozen-steps``) and then stage 2 (``--unfreeze``: the
bank plus the last N blocks and the final norm, or LoRA adapters) with CE + REC + R1 + R2, on the same anchor
set as the frozen stage (the built-in corpus, ``--max-docs`` documents of ≤ ``--max-chars-per-doc`` characters,
15% held out; the frozen stage's 40 × 9,000 by default). The run
folder is kept under ``bench/runs/real-retrofit/`` and is resumable: a killed run continues from its latest
checkpoint when the same command runs again.

Then both checkpoints — the end of stage 1 (the frozen retrofit: its logits are the source model's, so its
held-out CE is the source model's) and the end of stage 2 — are measured on every held-out token:
CE, residual share, centred residual share (μ: the mean z of the first ``mu_sequences`` training sequences,
each model its own), R̄1, R2, dead (never active on held-out tokens).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from prismlm.app.retrofit import RetrofitRecipe, resume_retrofit, retrofit_model
from prismlm.data.shards import ShardSet
from prismlm.errors import CheckpointError
from prismlm.model import PrismLM
from prismlm.train.checkpoint import find_checkpoint, load_checkpoint


def steps_done(out: Path) -> int:
    """The step of the run's latest checkpoint (0: none)."""
    try:
        return int(find_checkpoint(out).name.removeprefix("step-"))
    except CheckpointError:
        return 0


def train_stage2(
    folder: Path,
    out: Path,
    *,
    unfreeze: str,
    frozen_steps: int,
    stage2_steps: int,
    K: int,
    k: int,
    batch_size: int,
    threads: int,
    data_dir: Path,
    lr: float,
    backbone_lr_ratio: float,
    max_docs: int,
    max_chars_per_doc: int,
) -> dict[str, Any]:
    """Run (or resume, or skip when done) the retrofit into ``out``; seconds of this call."""
    total = frozen_steps + stage2_steps
    done = steps_done(out)
    t0 = time.perf_counter()
    if done == 0:
        retrofit_model(
            str(folder),
            out=out,
            recipe=RetrofitRecipe(
                corpus="builtin",
                steps=total,
                frozen_steps=frozen_steps,
                unfreeze=unfreeze,
                prototypes=K,
                top_k=k,
                lr=lr,
                backbone_lr_ratio=backbone_lr_ratio,
                batch_size=batch_size,
                block_size=256,
                max_docs=max_docs,
            ),
            overrides=[
                f"data.max_chars_per_doc={max_chars_per_doc}",
                "data.val_fraction=0.15",
                f"data.data_dir={data_dir}",
                f"train.num_threads={threads}",
                f"train.eval_interval={max(stage2_steps // 2, 1)}",
                "train.eval_batches=2",
                f"train.ckpt_interval={max(stage2_steps // 4, 1)}",
                "train.keep_checkpoints=100",
                "train.log_interval=5",
            ],
            device="cpu",
            overwrite=True,
            progress=False,
        )
    elif done < total:
        resume_retrofit(out, steps=total, device="cpu", progress=False)
    return {"seconds_this_run": round(time.perf_counter() - t0, 1), "resumed_from_step": done}


@torch.inference_mode()
def heldout(model: PrismLM, shards: ShardSet, T: int, mu_sequences: int, batch: int = 4) -> dict[str, Any]:
    """Held-out CE and coverage of ``model`` (every validation sequence of T + 1 tokens); μ from the model's
    own z over the first ``mu_sequences`` training sequences."""
    model.eval()
    zs = [
        model.backbone(_ids(shards.train.sequences(np.arange(s, min(s + batch, mu_sequences)), T)[:, :-1]))
        for s in range(0, mu_sequences, batch)
    ]
    mu = torch.cat(zs).reshape(-1, model.config.n_embd).mean(0)  # (d,)
    n_val = shards.val.num_sequences(T)
    ce_sum, z_val = 0.0, []
    V = model.config.vocab_size
    for s in range(0, n_val, batch):
        seq = _ids(shards.val.sequences(np.arange(s, min(s + batch, n_val)), T))  # (b, T + 1)
        z = model.backbone(seq[:, :-1])  # (b, T, d)
        logits = model.lm_head(z)[..., :V]  # (b, T, V)
        ce_sum += float(F.cross_entropy(logits.reshape(-1, V), seq[:, 1:].reshape(-1), reduction="sum"))
        z_val.append(z.reshape(-1, z.shape[-1]))
    zv = torch.cat(z_val)
    from real_retrofit import coverage  # here: real_retrofit imports this module

    cov = coverage(model.require_prototypes(), zv, mu, centred=False)
    return {"ce": ce_sum / zv.shape[0], "tokens": zv.shape[0], "mu_sequences": mu_sequences, **cov}


def measure(out: Path, frozen_steps: int, shards: ShardSet, T: int, mu_sequences: int) -> dict[str, Any]:
    """Held-out numbers of the stage-1 checkpoint (the frozen retrofit) and of the latest one (stage 2)."""
    res: dict[str, Any] = {}
    for name, ckpt in (
        ("frozen", out / "checkpoints" / f"step-{frozen_steps:06d}"),
        ("stage2", find_checkpoint(out)),
    ):
        t0 = time.perf_counter()
        c = load_checkpoint(ckpt)
        res[name] = {"checkpoint": ckpt.name, **heldout(c.model, shards, T, mu_sequences)}
        res[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[bench] stage2 {name}: {res[name]}", flush=True)
    f, s = res["frozen"], res["stage2"]
    res["ce_rel_change"] = (s["ce"] - f["ce"]) / f["ce"]
    return res


def _ids(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.int64))


def train_log(out: Path) -> list[str]:
    """The run's metrics lines (the trainer's ``metrics.jsonl``), for the record."""
    f = out / "metrics.jsonl"
    return f.read_text().splitlines() if f.exists() else []
