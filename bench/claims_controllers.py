"""The ``controllers`` stage of ``bench/real_claims.py``: sparse controllers over the active prototypes of the
retrofitted SmolLM2-135M-Instruct vs a TopK SAE (same K and k, ``prismlm.control.sae.fit_sae`` on the bank's
stored z) on the same frozen hidden states, on multiple-choice tasks screened on validation (one-sided binomial
vs chance), fitted on train with λ chosen on validation (``prismlm.control.surrogate``), reported on test with
the choice prior, McNemar p and bootstrap intervals (``prismlm.eval.stats``; summary: ``prismlm.eval.claims``).

Run: ``python bench/claims_controllers.py [--quick]`` after ``claims_bank.py`` (or ``real_claims.py --stage
controllers``). The protocol in full: docs/results.md ("How bench/real_claims.py measures"). Features, the
SAE and finished tasks are cached under ``WORK/controllers``, so the stage resumes.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import ClaimsContext, Json, run_claims_stage

from prismlm.control.controller import (
    ControlFeatures,
    Controller,
    accuracy,
    correct,
    fit_choice_prior,
    prism_encoder,
    trace_prism_controller,
)
from prismlm.control.sae import SAERecipe, TopKSAE, fit_sae, row_sampler
from prismlm.control.surrogate import (
    BASE_FIELDS,
    FEATURE_FIELDS,
    TaskFeatures,
    base_pass,
    chance,
    encoded,
    exact_scores,
    extract_shared_prefix,
    fit_surrogate_controller,
    forward_scores,
)
from prismlm.eval.claims import controller_summary
from prismlm.eval.stats import binomial_p_above, paired_stats, wilson
from prismlm.eval.tasks import EXTRA_TASKS, SPLITS, TASKS, MCExample, build_task
from prismlm.model import PrismLM
from prismlm.model.stored_activations import backbone_identity, open_stored_z


@dataclass(frozen=True)
class ControlSize:
    """How much of the protocol runs (``--quick``: a smoke size that runs every step of it on less)."""

    caps: dict[str, int]
    """Examples per split of each task."""
    l1_grid: tuple[float, ...]
    """λ values tried (chosen on validation)."""
    ctl_steps: int
    """Proximal Adam steps per controller fit."""
    surrogate_vocab: int
    """|S| of the fitting surrogate (besides the targets)."""
    sae_steps: int
    """× ``SAE_BATCH`` hidden states (full: about 3 passes over the bank's training rows)."""
    forward_check_docs: int
    """Test documents scored again through the model's own forward (per task, c = 0 and controlled)."""
    max_tasks: int | None
    """The first this many kept tasks get controllers (None: all)."""


SIZES = {
    # full: bench/control.py's λ grid, steps and learning rate. quick (CI): extracting the task texts is most of
    # the time, then the reference forwards of the check and the fits, so fewer examples, docs, λ values and
    # steps, and two tasks (the screen still sees every candidate)
    "quick": ControlSize({"train": 8, "validation": 8, "test": 12}, (3e-3, 3e-2), 30, 512, 80, 2, 2),
    "full": ControlSize({"train": 100, "validation": 60, "test": 160}, (3e-3, 1e-2, 3e-2), 60, 2048, 800, 3, None),
}
CTL_LR = 0.1


def ctx_size(ctx: ClaimsContext) -> ControlSize:
    return SIZES["quick" if ctx.quick else "full"]


SAE_BATCH = 512  # hidden states per SAE step
SAE_RECIPE = "data"  # see train_sae_on_stored_z; chosen by held-out FVU (docs/results.md, Controllers)
SAE_DEAD_STEPS, SAE_RESAMPLE = 50, 250
SAE_CHECKPOINTS = (200, 400, 600, 800)
FIRST_BANK = "the first bank (bf3ef15: 139k anchor tokens, no kjv.jsonl; its data-init 800-step SAE: FVU 0.340)"
SAE_TRIED = (  # other settings measured on the first bank's held-out rows (docs/results.md), kept in the JSON
    {"recipe": "random", "steps": 300, "fvu": 0.403, "dead_fraction": 0.699, "note": "a short check run", "bank": FIRST_BANK},
    {"recipe": "random", "steps": 800, "fvu": 0.362, "dead_fraction": 0.708, "note": "the first run (d7bb952)", "bank": FIRST_BANK},
    {"recipe": "data", "steps": 1500, "fvu": 0.338, "dead_fraction": 0.15, "note": "a 3000-step run stopped for time", "bank": FIRST_BANK},
)  # fmt: skip
MIN_TASKS = 3  # the tasks built here are screened only when fewer shipped ones pass
KEEP_P, KEEP_MARGIN = 0.01, 0.05


CANDIDATES = (*TASKS, *EXTRA_TASKS)


def _first_docs(saved: dict, m: int) -> dict:
    """A saved split cut to its first m documents (requests and tokens are stored in document order)."""
    R = sum(saved["n_choices"][:m])
    N = int((saved["request"] < R).sum())
    out = {"ids": saved["ids"][:m], "gold": saved["gold"][:m], "n_choices": saved["n_choices"][:m]}
    for k in ("doc_of_request", "choice_len", "choice_text"):
        out[k] = saved[k][:R]
    for k in ("z", "targets", "request", *BASE_FIELDS):
        if k in saved:
            out[k] = saved[k][:N]
    return out


def cached_features(
    ctx: ClaimsContext, model: PrismLM, tokenizer, folder: Path, task: str, split: str, docs: list[MCExample]
) -> TaskFeatures:
    """``extract_shared_prefix`` and ``base_pass`` of one split, from ``folder`` when extracted earlier (the
    same documents, or a file of more whose first documents are these)."""
    path = folder / f"{task}-{split}-{len(docs)}.pt"
    ids = [d["id"] for d in docs]
    saved = None
    for p in [path, *sorted(folder.glob(f"{task}-{split}-*.pt"))]:
        if p.exists():
            s = torch.load(p, weights_only=False)
            if s["ids"][: len(ids)] == ids:
                saved = _first_docs(s, len(ids)) if len(s["ids"]) > len(ids) else s
                break
    if saved is None:
        t = time.perf_counter()
        f = extract_shared_prefix(model, tokenizer, docs)
        saved = {"ids": ids, **{k: getattr(f, k) for k in FEATURE_FIELDS}}
        ctx.log(
            f"controllers: {task}/{split}: {len(docs)} examples, {len(f.targets)} scored tokens "
            f"({time.perf_counter() - t:.0f} s)"
        )
    if any(k not in saved for k in BASE_FIELDS):
        f = ControlFeatures(indices=torch.empty(0), activations=torch.empty(0), **{k: saved[k] for k in FEATURE_FIELDS})
        saved.update(base_pass(f, model.lm_head.weight.detach().float()))
    if not path.exists() or "base_logp" not in torch.load(path, weights_only=False):
        tmp = path.with_suffix(".tmp")
        torch.save(saved, tmp)
        tmp.replace(path)
    return TaskFeatures(
        indices=torch.empty(0), activations=torch.empty(0), **{k: saved[k] for k in (*FEATURE_FIELDS, *BASE_FIELDS)}
    )


# ----- the SAE on the stored z ---------------------------------------------------------------------------------
def train_sae_on_stored_z(
    run_folder: Path, K: int, k: int, steps: int, seed: int, log: Callable[[str], None], *, recipe: str = SAE_RECIPE
) -> tuple[TopKSAE, dict[str, object]]:
    """``prismlm.control.sae.fit_sae`` on the bank's stored hidden states (``SAE_BATCH`` rows a step, b_dec at
    the mean of 8 batches); ``recipe`` "data": the data initialisation and resampling every ``SAE_RESAMPLE``
    steps, "random": AuxK alone. The last 10% of the stored sequences are held out (FVU, dead fraction)."""
    store = open_stored_z(run_folder / "stored-z").check()
    T, n_seq = store.block_size, store.num_sequences
    n_train = max(1, int(0.9 * n_seq)) if n_seq > 1 else n_seq
    train_rows = n_train * T
    Z = store.rows(0, train_rows)  # (rows, d) float32 in memory: random rows of a memory map cost more
    held = store.rows(train_rows, n_seq * T) if n_seq > n_train else Z[: min(4096, train_rows)]
    data = recipe == "data"
    plan = SAERecipe(
        steps=steps, batch=SAE_BATCH, dead_steps=SAE_DEAD_STEPS, data_init=data,
        resample_every=SAE_RESAMPLE if data else 0, mean_draws=8 * SAE_BATCH,
    )  # fmt: skip
    fit = fit_sae(
        Z.shape[1], K, k, row_sampler(Z, seed), plan, seed=seed, held=held, checkpoints=SAE_CHECKPOINTS,
        log=lambda m: log(f"controllers: {m} ({recipe})"),
    )  # fmt: skip
    return fit.sae, {
        **fit.curve[-1],
        "recipe": recipe,
        "steps": steps,
        "batch": SAE_BATCH,
        "curve": fit.curve,
        "resampled_latents": fit.resampled,
        "train_hidden_states": train_rows,
        "heldout_hidden_states": len(held),
    }


# ----- the stage -----------------------------------------------------------------------------------------------
def screen(ctx: ClaimsContext, run, folder: Path, caps: dict[str, int]) -> tuple[list[dict[str, object]], dict]:
    """Base validation accuracy of every shipped task vs chance, and of the tasks built here when fewer
    than ``MIN_TASKS`` shipped ones are clearly above it; which are kept."""
    rows: list[dict[str, object]] = []
    splits_of = {}
    for task in CANDIDATES:
        if task in EXTRA_TASKS and sum(bool(r["kept"]) for r in rows) >= MIN_TASKS:
            break
        splits = build_task(task, caps)
        f = cached_features(ctx, run.model, run.tokenizer, folder, task, "validation", splits["validation"])
        acc = accuracy(f, f.base_logp.new_zeros(len(f.doc_of_request)).index_add(0, f.request, f.base_logp))["acc"]
        n, ch = len(f.gold), chance(f)
        p = binomial_p_above(round(acc * n), n, ch)
        keep = acc > ch if ctx.quick else (p < KEEP_P and acc - ch >= KEEP_MARGIN)
        rows.append({"task": task, "validation_acc": acc, "chance": ch, "n": n, "binomial_p": p, "kept": keep})
        ctx.log(
            f"controllers: screen {task}: val acc {acc:.3f} vs chance {ch:.3f} (p {p:.2g}) → "
            f"{'kept' if keep else 'dropped'}"
        )
        splits_of[task] = splits
    return rows, splits_of


def stage_sae(ctx: ClaimsContext, run_folder: Path, K: int, k: int) -> tuple[TopKSAE, dict[str, object]]:
    """The SAE of ``train_sae_on_stored_z``, cached under the stage folder by what it depends on (the stored
    z, K, k, steps): it can be trained as soon as the bank's z pass is done."""
    store = open_stored_z(run_folder / "stored-z").check()
    steps = ctx_size(ctx).sae_steps
    key = f"{store.manifest['backbone'][9:21]}-{store.manifest['shard_key'][:12]}-{K}-{k}-{steps}x{SAE_BATCH}-{SAE_RECIPE}"
    path = ctx.stage_dir("controllers") / f"sae-{key}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=False)
        sae = TopKSAE(store.z.shape[1], K, k)
        sae.load_state_dict(saved["state"])
        return sae.eval(), {**saved["info"], "cache_key": key}
    t = time.perf_counter()
    sae, info = train_sae_on_stored_z(run_folder, K, k, steps, ctx.seed, ctx.log)
    info["seconds"] = round(time.perf_counter() - t, 1)
    torch.save({"state": sae.state_dict(), "info": info}, path)
    return sae, {**info, "cache_key": key}


@dataclass
class Side:
    """One side's fitted controller, its JSON row, and what the comparison of the two sides needs."""

    controller: Controller
    row: Json
    after: dict[str, float]
    correct: torch.Tensor
    scores: torch.Tensor


def side_result(
    feats: dict[str, TaskFeatures],
    W: torch.Tensor,
    directions: torch.Tensor,
    base: BaseInfo,
    seed: int,
    size: ControlSize,
) -> Side:
    """One side's controller: fitted on the train surrogate per λ, λ by surrogate validation accuracy (same
    vocabulary S), exact test; the exact validation accuracy of the chosen one checks the surrogate."""
    train, val, test = feats["train"], feats["validation"], feats["test"]
    fit = fit_surrogate_controller(
        train, val, W, directions, l1_grid=size.l1_grid, steps=size.ctl_steps, lr=CTL_LR, vocab=size.surrogate_vocab
    )
    best, trials, fidelity = fit.controller, fit.trials, fit.fidelity
    s1 = exact_scores(test, W, directions, best.coefficients)
    after = accuracy(test, s1)
    row: Json = {
        "test_after": after,
        "test_after_ci95": wilson(after["acc"], int(after["n"])),
        "delta_acc": after["acc"] - base.acc,
        "paired_vs_base": paired_stats(base.correct, correct(test, s1), seed=seed),
        "paired_vs_prior": paired_stats(correct(test, base.prior_scores), correct(test, s1), seed=seed),
        "nonzero": len(best.nonzero),
        "l1": best.l1,
        "selection": trials,
        "surrogate_fidelity": fidelity,
    }
    return Side(best, row, after, correct(test, s1), s1)


@dataclass(frozen=True)
class BaseInfo:
    """The base model on a task's test split: accuracy, per-example correctness, the choice prior's scores."""

    acc: float
    correct: torch.Tensor
    prior_scores: torch.Tensor


def task_row(ctx: ClaimsContext, run, task: str, splits: dict, folder: Path, sae: TopKSAE, index) -> dict:
    """Both controllers, the choice prior and the paired statistics on one kept task."""
    model, tok = run.model, run.tokenizer
    W = model.lm_head.weight.detach().float()
    raw = {s: cached_features(ctx, model, tok, folder, task, s, splits[s]) for s in SPLITS}
    test = raw["test"]
    s0 = exact_scores(test, W, W[:1], None)
    base = accuracy(test, s0)
    train_base = exact_scores(raw["train"], W, W[:1], None)
    prior_scores = fit_choice_prior(raw["train"], train_base).scores(test, s0)
    prior = accuracy(test, prior_scores)
    info = BaseInfo(base["acc"], correct(test, s0), prior_scores)
    row: dict[str, object] = {
        "task": task,
        "n": {s: len(v) for s, v in splits.items()},
        "chance": chance(test),
        "base": {**base, "ci95": wilson(base["acc"], int(base["n"]))},
        "choice_prior": {**prior, "ci95": wilson(prior["acc"], int(prior["n"]))},
    }
    sides = {
        "prism": (prism_encoder(model), model.prototypes.weight.detach().float()),
        "sae": (sae.encode, sae.directions.detach().float()),
    }
    feats_of: dict[str, dict[str, TaskFeatures]] = {}
    done: dict[str, Side] = {}
    for side, (enc, directions) in sides.items():
        t = time.perf_counter()
        feats_of[side] = {s: encoded(f, enc) for s, f in raw.items()}
        d = done[side] = side_result(feats_of[side], W, directions, info, ctx.seed, ctx_size(ctx))
        ctx.log(
            f"controllers: {task} {side}: {base['acc']:.3f} → {d.after['acc']:.3f} "
            f"({d.row['nonzero']} non-zero, λ {d.row['l1']}; prior {prior['acc']:.3f}) "
            f"[{time.perf_counter() - t:.0f} s]"
        )
    # the key order of the JSON: prism, sae, then their comparison
    row.update({side: d.row for side, d in done.items()})
    row["prism_vs_sae"] = paired_stats(done["sae"].correct, done["prism"].correct, seed=ctx.seed)
    s1, prism_ctl = done["prism"].scores, done["prism"].controller
    # the cached-feature scores against the model's own forward, with c = 0 and with PRISM's controller
    m = ctx_size(ctx).forward_check_docs
    r = sum(test.n_choices[:m])
    fwd0 = forward_scores(model, tok, splits["test"][:m])
    with model.control(prism_ctl.coefficients.float()):
        fwd1 = forward_scores(model, tok, splits["test"][:m])
    row["forward_check"] = {
        "docs": m,
        "max_abs_diff_base": float((fwd0 - s0[:r]).abs().max()),
        "max_abs_diff_controlled": float((fwd1 - s1[:r]).abs().max()),
        "max_abs_shift": float((fwd1 - fwd0).abs().max()),  # what the controller moved: the check is not vacuous
    }
    row["trace"] = trace_prism_controller(
        model, tok, prism_ctl, feats_of["prism"]["train"], splits["train"], index=index, top=10
    )
    return row


def controller_stage(ctx: ClaimsContext, only: Sequence[str] | None = None) -> dict[str, object]:
    """Screen the tasks, train the SAE, fit and test both controllers on each kept task (resumable; each
    finished task is saved; ``only``: just these of the kept tasks, e.g. from parallel processes)."""
    torch.set_num_threads(ctx.threads)
    t0 = time.perf_counter()
    stage = ctx.stage_dir("controllers")
    run = ctx.open_run()
    model = run.model.eval()
    size = ctx_size(ctx)
    folder = stage / "features" / backbone_identity(model).removeprefix("backbone:")[:16]
    folder.mkdir(parents=True, exist_ok=True)
    screened, splits_of = screen(ctx, run, folder, size.caps)
    assert model.prototypes is not None, "the bank's model is retrofitted"
    K, k = model.prototypes.num_prototypes, model.prototypes.cfg.top_k
    sae, sae_info = stage_sae(ctx, run.folder, K, k)
    ctx.log(f"controllers: SAE K={K} k={k}: FVU {sae_info['fvu']:.3f}, dead {sae_info['dead_fraction']:.2f}")
    try:
        index = run.index()
    except Exception as e:  # the trace works without one (no labels or neighbours)
        ctx.log(f"controllers: no prototype index for the trace ({e})")
        index = None
    # the rows depend on the SAE too: a new SAE gets its own folder of finished tasks; the quick size is tuned
    # for CI time and may change, so its rows are keyed by it (the full rows keep the folder they were made in)
    tag = f"quick-{hashlib.sha256(repr(size).encode()).hexdigest()[:8]}" if ctx.quick else "full"
    done = stage / f"tasks-{(run.identity or 'run')[:16]}-{tag}-sae-{sae_info['cache_key']}"
    done.mkdir(exist_ok=True)
    rows = []
    kept = [str(r["task"]) for r in screened if r["kept"]][: size.max_tasks]
    for task in [t for t in kept if only is None or t in only]:
        path = done / f"{task}.json"
        if not path.exists():
            row = task_row(ctx, run, task, splits_of[task], folder, sae, index)
            path.write_text(json.dumps(row, indent=1, default=float))
        rows.append(json.loads(path.read_text()))
    return {
        "summary": controller_summary(rows),
        "screening": screened,
        "tasks": rows,
        "sae": {"num_latents": K, "k": k, **sae_info, "other_settings_tried": list(SAE_TRIED)},
        "protocol": {
            "caps": size.caps,
            "l1_grid": list(size.l1_grid),
            "ctl_steps": size.ctl_steps,
            "ctl_lr": CTL_LR,
            "surrogate_vocab": size.surrogate_vocab,
            "forward_check_docs": size.forward_check_docs,
            "max_tasks": size.max_tasks,
            "keep_p": KEEP_P,
            "keep_margin": KEEP_MARGIN,
        },
        "stage_seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> None:
    run_claims_stage("controllers", controller_stage, __doc__, argv)


if __name__ == "__main__":
    main()
