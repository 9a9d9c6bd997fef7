"""Control operations: find a concept's prototypes, build and evaluate tasks, fit controllers."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from prismlm.app.chat import chat_texts
from prismlm.app.run import Run, require
from prismlm.artifacts import check_out_file, check_out_folder
from prismlm.control.activity import Activity, changed_prototypes, merged, prototype_activity
from prismlm.control.concept import ConceptSelection, doc_regex, find_concept, read_texts
from prismlm.control.controller import (
    Controller,
    TracedUnit,
    extract_features,
    fit_and_test,
    prism_encoder,
    trace_prism_controller,
)
from prismlm.control.suppress import CHECKPOINT_FILE, PrototypeEvidence, SuppressionSet
from prismlm.data.tokenizer import Tokenizer
from prismlm.errors import ConfigError, DataError, TaskError
from prismlm.eval.scoring import MCScores, encode_pair, mc_accuracy
from prismlm.eval.tasks import TASKS, MCExample, build_tasks, load_split
from prismlm.model import Control, Intervention, PrismLM
from prismlm.model.interventions import MODES_HELP, RESIDUAL_MODES

# lm-eval's scorer on task folders (``prismlm.integrations.lm_eval_adapter.evaluate_with_lm_eval``): task → metrics
TaskScorer = Callable[[PrismLM, Tokenizer, dict[str, str | Path]], dict[str, dict[str, float]]]


@dataclass
class ConceptResult:
    """A concept's suppression set and the ranking of every candidate prototype."""

    suppression: SuppressionSet
    ranking: list[PrototypeEvidence]
    saved: list[Path]
    """Where the set was written (``out``, and the checkpoint with ``save``)."""


def _check_residual_mode(residual: str) -> None:
    if residual not in RESIDUAL_MODES:
        raise ConfigError(
            f"`residual` {residual!r} is not a residual mode",
            fix=f"use 'keep' (remove the slices only), {MODES_HELP}",
            param="residual",
        )


def find_run_concept(
    run: Run,
    concept: Path,
    neutral: Path,
    *,
    index: Path | None = None,
    concept_docs: str | None = None,
    selection: ConceptSelection = ConceptSelection(),
    no_budget: bool = False,
    name: str | None = None,
    out: Path | None = None,
    save: bool = False,
    chat: bool = False,
    residual: str = "keep",
) -> ConceptResult:
    """Find the prototypes of a concept (log-likelihood contribution, activation enrichment, neighbourhood
    purity) → a suppression set.

    Args:
        concept: Concept examples: .jsonl (field 'text'), .txt (blank-line or %-separated) or a folder of .txt.
        neutral: Neutral examples, same formats.
        index: A prototype index (`prism index`) for neighbourhood purity.
        concept_docs: Regex on training document ids marking concept documents (purity).
        selection: Budget, ranking and thresholds of the selection (``ConceptSelection``).
        no_budget: No cap: keep every prototype passing the thresholds (overrides the budget).
        name: Name of the concept (stored in the set).
        out: Write the suppression set here (default: print only).
        save: Also save it as the checkpoint's suppression.json (applied by default).
        chat: Every concept and neutral text is a chat message: written with the run's chat template, the
            model's answer (greedy, up to the end-of-turn token) appended — the prototypes are found on what
            the model reads and says in a chat.
        residual: What the set does to the residual, recorded in it: keep (remove the prototypes' slices only)
            project (also project the residual off the span of their vectors), mean (off their unit mean
            direction only, one dimension) or contrast (off the unit difference between their mean and the
            bank's mean, one dimension).
    """
    _check_residual_mode(residual)
    require(selection.min_count >= 1, "min_count", ">= 1", selection.min_count)
    if out is not None:  # a folder gets suppression.json (a checkpoint's own set: also what `save` writes)
        target = out / CHECKPOINT_FILE if out.is_dir() else out
        if target.name != CHECKPOINT_FILE:
            check_out_file(target, "out")
    model = run.prism_model("`prism concept`")
    if (index is None) != (concept_docs is None):
        raise ConfigError("neighbourhood purity needs both `index` and `concept_docs`", param=("index", "concept_docs"))
    try:
        ctexts, ntexts = read_texts(concept), read_texts(neutral)
    except FileNotFoundError as e:
        raise DataError(str(e), fix="check the concept / neutral texts' path") from e
    if chat:
        ctexts, ntexts = chat_texts(run, ctexts), chat_texts(run, ntexts)
    idx = run.index(index, required=True) if index is not None else None
    try:
        rx = doc_regex(concept_docs) if concept_docs else None
    except Exception as e:  # re.error
        raise ConfigError(
            f"`concept_docs` {concept_docs!r} is not a valid regular expression: {e}", param="concept_docs"
        ) from e
    sset, ranking = find_concept(
        model,
        run.tokenizer,
        ctexts,
        ntexts,
        replace(selection, budget=None) if no_budget else selection,
        index=idx,
        is_concept_doc=rx,
        concept=name,
        model_sha256=run.identity,
    )
    sset = replace(sset, residual=residual)
    saved = []
    if out:
        saved.append(sset.save(out))
    if save:
        saved.append(sset.save(run.checkpoint.path))
    return ConceptResult(suppression=sset, ranking=ranking, saved=saved)


def suppression_targets(*sets: SuppressionSet | None) -> list[int]:
    """The target tokens recorded by ``prism concept`` in suppression sets (``meta["target_tokens"]``)."""
    out: list[int] = []
    for sset in sets:
        raw = sset.meta.get("target_tokens") if sset is not None else None
        if isinstance(raw, list):
            out += [int(t) for t in raw if isinstance(t, int) and int(t) not in out]
    return out


def intervention_activity(
    run: Run, text: str | Sequence[int], *extra: Intervention, targets: Sequence[int] | None = None
) -> Activity:
    """Which of the prototypes the run's interventions (and ``extra``) change are active on ``text`` (a text
    or token ids), and which where a target token is predicted (``targets``; default: those the run's
    suppression set records). ``Activity.warning`` says when the interventions can change nothing there."""
    model = run.prism_model("an intervention report")
    ids = changed_prototypes((*run.interventions, *extra), model.require_prototypes().num_prototypes)
    tok = run.tokenizer
    token_ids = (tok.encode(text) or [tok.eot_id]) if isinstance(text, str) else list(text)
    return prototype_activity(
        model,
        ids,
        token_ids,
        targets=suppression_targets(run.suppression) if targets is None else targets,
        tokenizer=tok,
    )


def is_task_folder(folder: Path) -> bool:
    """A folder `prism tasks build` wrote: only task folders (each with its test.jsonl and lm-eval yaml)."""
    entries = [p for p in folder.iterdir() if p.name != ".lock"]
    return bool(entries) and all(
        p.is_dir() and (p / "test.jsonl").is_file() and (p / f"{p.name}.yaml").is_file() for p in entries
    )


def build_task_folders(
    out: Path = Path("tasks"),
    *,
    task: list[str] | None = None,
    train_cap: int = 400,
    val_cap: int = 100,
    test_cap: int = 200,
    overwrite: bool = False,
) -> dict[str, Path]:
    """Build the multiple-choice tasks deterministically (lm-eval-readable).

    Args:
        out: Folder to write <task>/{train,validation,test}.jsonl + <task>.yaml.
        task: Task name (repeatable; default all).
        train_cap: Examples in the train split at most.
        val_cap: Examples in the validation split at most.
        test_cap: Examples in the test split at most.
        overwrite: Replace tasks already in ``out`` (never any other folder).
    """
    if min(train_cap, val_cap, test_cap) < 1:
        raise ConfigError(
            f"`train_cap`, `val_cap` and `test_cap` must be >= 1, got {(train_cap, val_cap, test_cap)!r}",
            param=("train_cap", "val_cap", "test_cap"),
        )
    check_out_folder(out, "task folder", holds=is_task_folder, overwrite=overwrite)
    return build_tasks(out, task or list(TASKS), {"train": train_cap, "validation": val_cap, "test": test_cap})


def task_folders(tasks: Path, names: list[str]) -> dict[str, Path]:
    """Task name → folder under ``tasks`` (a task folder itself, or a folder of task folders)."""
    if (tasks / "test.jsonl").exists():
        return {tasks.name: tasks}
    found = {p.parent.name: p.parent for p in sorted(tasks.glob("*/test.jsonl"))}
    if names:
        missing = [n for n in names if n not in found]
        if missing:
            raise TaskError(f"task(s) {missing} not found under {tasks}; have {sorted(found)}")
        found = {n: found[n] for n in names}
    if not found:
        raise TaskError(f"no tasks under {tasks}", fix=f"prism tasks build --out {tasks}")
    return found


def load_controller(path: Path) -> Controller:
    """A controller file from `prism controller fit` (``DataError`` naming the file otherwise)."""
    try:
        return Controller.load(path)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read controller {path}: {e}", fix="fit one with `prism controller fit`") from e


class TaskScores(MCScores, total=False):
    """A task's scores from ``evaluate_tasks``: ours, and lm-eval's metrics with ``lm_eval``."""

    lm_eval: dict[str, float]


def evaluate_tasks(
    run: Run,
    *,
    tasks: Path = Path("tasks"),
    task: list[str] | None = None,
    split: str = "test",
    controller: Path | None = None,
    lm_eval: bool = False,
    lm_eval_scorer: TaskScorer | None = None,
) -> dict[str, TaskScores]:
    """Multiple-choice accuracy (acc, acc_norm) with our log-likelihood scorer.

    Args:
        tasks: A task folder or a folder of task folders.
        task: Only these tasks (repeatable).
        split: train, validation or test.
        controller: A controller JSON (`prism controller fit`) to apply.
        lm_eval: Also score with lm-eval's evaluator (same numbers).
        lm_eval_scorer: The function that does it: ``prismlm.integrations.lm_eval_adapter.evaluate_with_lm_eval``
            (passed in because integrations sit above this layer; the CLI passes it).
    """
    require(split in ("train", "validation", "test"), "split", "train, validation or test", split)
    folders = task_folders(tasks, task or [])
    extra: tuple[Control, ...] = ()
    if controller is not None:
        ctl = load_controller(controller)
        extra = (Control(ctl.coefficients.to(torch.float32), label=str(controller)),)
    results: dict[str, TaskScores] = {}
    with run.intervened(*extra) as model:
        for n, f in folders.items():
            docs = load_split(f, split)
            results[n] = {**mc_accuracy(model, run.tokenizer, docs).to_dict()}
            if lm_eval and split == "test":
                if lm_eval_scorer is None:
                    raise ConfigError(
                        "lm_eval=True needs lm_eval_scorer",
                        fix="pass prismlm.integrations.lm_eval_adapter.evaluate_with_lm_eval",
                    )
                results[n]["lm_eval"] = lm_eval_scorer(model, run.tokenizer, {n: f})[n]
    return results


@dataclass
class ControllerResult:
    controller: Controller
    before: dict[str, float]
    after: dict[str, float]
    trace: list[TracedUnit]
    path: Path
    activity: Activity | None = None
    """Which of its non-zero prototypes are active on the test examples, and where their right answer's first
    token is predicted (``Activity.warning``: none is)."""


def controller_activity(run: Run, ids: list[int], docs: Sequence[MCExample], limit: int = 64) -> Activity:
    """``Activity`` of the prototypes ``ids`` over the first ``limit`` examples of ``docs``: each query with its
    right answer, the answer's first token the target."""
    model, tok = run.prism_model("a controller report"), run.tokenizer
    parts = []
    for d in docs[:limit]:
        full, n = encode_pair(tok, d["query"], d["choices"][d["gold"]], model.config.block_size)
        parts.append(prototype_activity(model, ids, full, targets=[full[len(full) - n]], tokenizer=tok))
    return merged(parts)


def fit_controller(
    run: Run,
    task: Path,
    *,
    l1: tuple[float, ...] = (3e-3, 1e-2, 3e-2),
    steps: int = 100,
    lr: float = 0.05,
    out: Path = Path("controller.json"),
    index: Path | None = None,
) -> ControllerResult:
    """Fit a sparse linear controller c (LM frozen) on a task; report test accuracy before → after.

    Args:
        task: A task folder (with train/validation/test.jsonl).
        l1: L1 strengths to try (chosen on validation; repeatable).
        steps: Full-batch optimisation steps.
        lr: Step size.
        out: Where to write the controller.
        index: A prototype index: trace each coefficient to its label and training neighbourhood.
    """
    require(steps >= 1, "steps", ">= 1", steps)
    require(math.isfinite(lr) and lr > 0, "lr", "a finite number > 0", lr)
    require(len(l1) >= 1 and all(math.isfinite(x) and x >= 0 for x in l1), "l1", "finite numbers >= 0", list(l1))
    check_out_file(out, "out")
    model = run.prism_model("a controller over prototypes (see bench/control.py for the SAE baseline)")
    assert model.prototypes is not None
    idx = run.index(index, required=True) if index is not None else None  # before the fit: fail fast on a bad path
    splits = {s: load_split(task, s) for s in ("train", "validation", "test")}
    feats = {s: extract_features(model, run.tokenizer, d, prism_encoder(model)) for s, d in splits.items()}
    res = fit_and_test(feats, model.lm_head.weight, model.prototypes.weight, l1_grid=list(l1), steps=steps, lr=lr)
    trace = trace_prism_controller(model, run.tokenizer, res.controller, feats["train"], splits["train"], index=idx)
    res.controller.save(
        out, task=str(task), model_sha256=run.identity, test_before=res.before, test_after=res.after, trace=trace
    )
    act = controller_activity(run, res.controller.nonzero, splits["test"])
    return ControllerResult(res.controller, res.before, res.after, trace, out, act)


__all__ = [
    "ConceptResult",
    "ControllerResult",
    "TaskScores",
    "build_task_folders",
    "evaluate_tasks",
    "find_run_concept",
    "fit_controller",
    "load_controller",
    "task_folders",
]
