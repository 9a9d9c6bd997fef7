"""The ``controllers`` stage of ``bench/real_claims.py``: sparse controllers over the active prototypes of the
retrofitted SmolLM2-135M-Instruct vs a TopK SAE (same K and k, ``prismlm.control.sae.fit_sae`` on the bank's
stored z) and a dense-residual controller of the same size (``prismlm.control.dense``) on the same frozen hidden
states, on tasks screened on validation (above chance, the choice prior not better: ``prismlm.control.compare``),
all fitted by one path on train with λ chosen on validation, reported on the held-out test split with the
choice prior, McNemar p and bootstrap intervals (``prismlm.eval.stats``; summary: ``prismlm.eval.claims``).

Run: ``python bench/claims_controllers.py [--quick] [--dense-basis pca|random] [--dense-directions N]
[--max-prior-gain G] [--max-acc A] [--min-tasks N]`` after ``claims_bank.py`` (or ``real_claims.py --stage
controllers``). The protocol: docs/results.md ("How bench/real_claims.py measures"). Features, the SAE and
finished tasks are cached under ``WORK/controllers``, so the stage resumes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import ClaimsContext, run_claims_stage

from prismlm.control.compare import (
    FitProtocol,
    ScreenConfig,
    ScreenRow,
    SideFit,
    base_scores,
    baselines,
    fit_dense_side,
    fit_side,
    screen_task,
    side_row,
)
from prismlm.control.controller import ControlFeatures, prism_encoder, trace_prism_controller
from prismlm.control.dense import BASES, DenseControlConfig
from prismlm.control.sae import SAERecipe, TopKSAE, fit_sae, row_sampler
from prismlm.control.surrogate import (
    BASE_FIELDS,
    FEATURE_FIELDS,
    TaskFeatures,
    base_pass,
    chance,
    extract_shared_prefix,
    forward_scores,
)
from prismlm.eval.claims import controller_summary
from prismlm.eval.stats import paired_stats, wilson
from prismlm.eval.tasks import ABILITY_TASKS, EXTRA_TASKS, SPLITS, TASKS, MCExample, build_task
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


CANDIDATES = (*TASKS, *EXTRA_TASKS, *ABILITY_TASKS)


@dataclass(frozen=True)
class ControlOptions:
    """The stage's own options (``--dense-*``, ``--max-*``); ``real_claims.py`` runs it with the defaults."""

    dense: DenseControlConfig
    """The dense-residual baseline (K' matched to the prototype controller's support unless given)."""
    max_prior_gain: float
    """The screen's limit on the choice prior's validation gain over the base model (``ScreenConfig``)."""
    max_acc: float
    """The screen's ceiling on the base validation accuracy."""
    min_tasks: int = MIN_TASKS
    """The tasks built here are screened while fewer than this many are kept (a large value: all of them)."""

    def screen(self, quick: bool) -> ScreenConfig:
        """--quick: above chance only (the smoke size's 8 validation examples decide nothing more)."""
        if quick:
            return ScreenConfig(min_margin=0.0, max_p=1.0, max_prior_gain=1.0, max_acc=1.0)
        return ScreenConfig(KEEP_MARGIN, KEEP_P, self.max_prior_gain, self.max_acc)

    def key(self, quick: bool) -> str:
        """What the finished task rows depend on besides the SAE and the size (their cache folder)."""
        sc = self.screen(quick)
        return f"dense-{self.dense.describe()}-screen-{sc.min_margin}-{sc.max_p}-{sc.max_prior_gain}-{sc.max_acc}"


MAX_ACC = 0.95  # chat_ending's base validation accuracy is 100% (34 examples): no room for any controller
DEFAULT_OPTIONS = ControlOptions(DenseControlConfig(), max_prior_gain=0.0, max_acc=MAX_ACC)


def fit_protocol(size: ControlSize) -> FitProtocol:
    return FitProtocol(size.l1_grid, size.ctl_steps, CTL_LR, size.surrogate_vocab)


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
def screen(
    ctx: ClaimsContext, run, folder: Path, caps: dict[str, int], cfg: ScreenConfig, min_tasks: int
) -> tuple[list[ScreenRow], dict]:
    """``screen_task`` on every shipped task, then on the tasks built here while fewer than ``min_tasks``
    are kept (train fits the choice prior the screen compares with; the verdict is read on validation)."""
    rows: list[ScreenRow] = []
    splits_of = {}
    W = run.model.lm_head.weight.detach().float()
    for task in CANDIDATES:
        if task not in TASKS and sum(bool(r["kept"]) for r in rows) >= min_tasks:
            break
        splits = build_task(task, caps)
        f = {s: cached_features(ctx, run.model, run.tokenizer, folder, task, s, splits[s]) for s in SPLITS[:2]}
        tr, va = f["train"], f["validation"]
        row = screen_task(task, tr, base_scores(tr, W), va, base_scores(va, W), cfg)
        rows.append(row)
        ctx.log(
            f"controllers: screen {task}: val acc {row['validation_acc']:.3f} vs chance {row['chance']:.3f} "
            f"(p {row['binomial_p']:.2g}), choice prior {row['prior_validation_acc']:.3f} → {row['reason']}"
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


def forward_check(
    model: PrismLM, tok, docs: list[MCExample], test: TaskFeatures, s0: torch.Tensor, prism: SideFit, m: int
) -> dict[str, float]:
    """The cached-feature scores of the first ``m`` test documents (``s0`` at c = 0, PRISM's) against the
    model's own forward, with c = 0 and under PRISM's controller (``model.control``)."""
    r = sum(test.n_choices[:m])
    fwd0 = forward_scores(model, tok, docs[:m])
    with model.control(prism.controller.coefficients.float()):
        fwd1 = forward_scores(model, tok, docs[:m])
    return {
        "docs": m,
        "max_abs_diff_base": float((fwd0 - s0[:r]).abs().max()),
        "max_abs_diff_controlled": float((fwd1 - prism.test_scores[:r]).abs().max()),
        "max_abs_shift": float((fwd1 - fwd0).abs().max()),  # what the controller moved: the check is not vacuous
    }


def task_row(
    ctx: ClaimsContext, run, task: str, splits: dict, folder: Path, sae: TopKSAE, index, opts: ControlOptions
) -> dict:
    """The three controllers (PRISM, the SAE, the dense residual of PRISM's size), fitted and tested by one path
    (``prismlm.control.compare``), the choice prior and the paired statistics on one kept task."""
    model, tok = run.model, run.tokenizer
    W = model.lm_head.weight.detach().float()
    raw = {s: cached_features(ctx, model, tok, folder, task, s, splits[s]) for s in SPLITS}
    test = raw["test"]
    base = baselines(raw, W)
    row: dict[str, object] = {
        "task": task,
        "n": {s: len(v) for s, v in splits.items()},
        "chance": chance(test),
        "base": {**base.base, "ci95": wilson(base.base["acc"], int(base.base["n"]))},
        "choice_prior": {**base.prior, "ci95": wilson(base.prior["acc"], int(base.prior["n"]))},
    }
    protocol = fit_protocol(ctx_size(ctx))
    sides = {
        "prism": (prism_encoder(model), model.prototypes.weight.detach().float()),
        "sae": (sae.encode, sae.directions.detach().float()),
    }
    fits: dict[str, SideFit] = {}
    for side in (*sides, "dense"):
        t = time.perf_counter()
        if side == "dense":  # K' = PRISM's support: the same number of non-zero parameters to spend
            fits[side], basis = fit_dense_side(raw, W, fits["prism"].support, opts.dense, protocol)
        else:
            fits[side] = fit_side(raw, *sides[side], W, protocol)
        d = fits[side]
        ctx.log(
            f"controllers: {task} {side}: {base.base['acc']:.3f} → {d.after['acc']:.3f} ({d.support} non-zero of "
            f"{d.num_parameters}, λ {d.controller.l1}; prior {base.prior['acc']:.3f}) [{time.perf_counter() - t:.0f} s]"
        )
    # the key order of the JSON: prism, sae, dense, then their comparisons
    side_rows = {side: side_row(f, base, ctx.seed) for side, f in fits.items()}
    side_rows["dense"].update(basis=basis.basis, config=opts.dense.describe())
    row.update(side_rows)
    row["prism_vs_sae"] = paired_stats(fits["sae"].test_correct, fits["prism"].test_correct, seed=ctx.seed)
    row["prism_vs_dense"] = paired_stats(fits["dense"].test_correct, fits["prism"].test_correct, seed=ctx.seed)
    m = ctx_size(ctx).forward_check_docs
    row["forward_check"] = forward_check(model, tok, splits["test"], test, base.base_scores, fits["prism"], m)
    row["trace"] = trace_prism_controller(
        model, tok, fits["prism"].controller, fits["prism"].features["train"], splits["train"], index=index, top=10
    )
    return row


def controller_stage(
    ctx: ClaimsContext, only: Sequence[str] | None = None, opts: ControlOptions = DEFAULT_OPTIONS
) -> dict[str, object]:
    """Screen the tasks, train the SAE, fit and test the three controllers on each kept task (resumable; each
    finished task is saved; ``only``: just these of the kept tasks, e.g. from parallel processes)."""
    torch.set_num_threads(ctx.threads)
    t0 = time.perf_counter()
    stage = ctx.stage_dir("controllers")
    run = ctx.open_run()
    model = run.model.eval()
    size = ctx_size(ctx)
    folder = stage / "features" / backbone_identity(model).removeprefix("backbone:")[:16]
    folder.mkdir(parents=True, exist_ok=True)
    screened, splits_of = screen(ctx, run, folder, size.caps, opts.screen(ctx.quick), opts.min_tasks)
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
    done = stage / f"tasks-{(run.identity or 'run')[:16]}-{tag}-sae-{sae_info['cache_key']}-{opts.key(ctx.quick)}"
    done.mkdir(exist_ok=True)
    rows = []
    kept = [str(r["task"]) for r in screened if r["kept"]][: size.max_tasks]
    for task in [t for t in kept if only is None or t in only]:
        path = done / f"{task}.json"
        if not path.exists():
            row = task_row(ctx, run, task, splits_of[task], folder, sae, index, opts)
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
            "screen": vars(opts.screen(ctx.quick)),
            "dense": vars(opts.dense),
            "min_tasks": opts.min_tasks,
        },
        "stage_seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(add_help=False)  # the stage's own options; the rest go to claims_args
    ap.add_argument("--dense-basis", choices=BASES, default="pca", help="the dense controller's directions")
    ap.add_argument("--dense-directions", type=int, default=None, help="K' (default: PRISM's non-zero count)")
    ap.add_argument("--max-prior-gain", type=float, default=0.0, help="screen: the prior's gain allowed (1: off)")
    ap.add_argument("--max-acc", type=float, default=MAX_ACC, help="screen: drop tasks above this accuracy")
    ap.add_argument("--min-tasks", type=int, default=MIN_TASKS, help="screen built tasks while fewer are kept")
    args, rest = ap.parse_known_args(argv)
    opts = ControlOptions(
        DenseControlConfig(args.dense_basis, args.dense_directions), args.max_prior_gain, args.max_acc, args.min_tasks
    )
    run_claims_stage("controllers", lambda ctx: controller_stage(ctx, opts=opts), __doc__, rest)


if __name__ == "__main__":
    main()
