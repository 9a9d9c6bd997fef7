"""`prism` commands for control (suppression, concepts, controllers, tasks).

    prism concept RUN --concept BAD.jsonl --neutral OK.jsonl [--index DIR --concept-docs REGEX]
                      [--budget N] [--threshold X] [--out set.json] [--save]
    prism tasks build --out tasks/ [--task NAME ...]
    prism tasks eval RUN --tasks tasks/ [--split test] [--suppress FILE|auto|none] [--controller FILE] [--lm-eval]
    prism controller fit RUN --task tasks/sotu_era [--l1 0.003 --l1 0.01] [--steps 100] --out ctl.json
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from prismlm.app.operations import load_run, open_index, user_errors
from prismlm.cli.console import console
from prismlm.cli.console import fail as _fail


def _load(run: Path, suppress: str | None = "auto"):
    """The run's checkpoint with its suppression set applied (exit 2 on a bad run or set)."""
    try:
        ckpt = load_run(run, suppress, "cpu")
    except user_errors() as e:
        _fail(str(e))
    if ckpt.tokenizer is None:
        _fail(f"{ckpt.path} has no tokenizer")
    return ckpt


def _open_index(ckpt, index: Path):
    """A prototype index checked against the checkpoint, with its training shards attached (exit 2 otherwise)."""
    try:
        return open_index(index, ckpt, index, None, required=True)
    except user_errors() as e:
        _fail(f"cannot use index {index}: {e}")


def concept_cmd(
    run: Path = typer.Argument(..., help="Run folder or checkpoint folder (a PRISM model)."),
    concept: Path = typer.Option(..., help="Concept examples: .jsonl (field 'text'), .txt (blank-line or %-separated) or a folder of .txt."),
    neutral: Path = typer.Option(..., help="Neutral examples, same formats."),
    index: Path | None = typer.Option(None, help="A prototype index (`prism index`) for neighbourhood purity."),
    concept_docs: str | None = typer.Option(None, help="Regex on training document ids marking concept documents (purity)."),
    budget: int | None = typer.Option(32, help="At most this many prototypes (0 = none; use --no-budget for no cap)."),
    no_budget: bool = typer.Option(False, help="No cap: keep every prototype passing the thresholds."),
    rank_by: str = typer.Option("contribution", help="Ranking: 'contribution' (nats/token the prototype adds to concept "
                                                     "vs neutral text, first order) or 'enrichment' (log2 activation ratio)."),
    threshold: float = typer.Option(1.0, help="Minimum log2 activation enrichment (concept vs neutral)."),
    min_count: int = typer.Option(3, help="Minimum concept tokens where the prototype is active."),
    min_purity: float = typer.Option(0.5, help="Minimum neighbourhood purity (with --index and --concept-docs)."),
    name: str | None = typer.Option(None, help="Name of the concept (stored in the set)."),
    out: Path | None = typer.Option(None, help="Write the suppression set here (default: print only)."),
    save: bool = typer.Option(False, help="Also save it as the checkpoint's suppression.json (applied by default)."),
    top: int = typer.Option(15, help="Rows of the ranking to print."),
) -> None:
    """Find the prototypes of a concept (log-likelihood contribution, activation enrichment, neighbourhood
    purity) → a suppression set."""
    from prismlm.control.concept import doc_regex, find_concept, read_texts

    ckpt = _load(run, "none")
    if not ckpt.model.is_prism:
        _fail("`prism concept` needs a PRISM model; this is the dense baseline")
    try:
        ctexts, ntexts = read_texts(concept), read_texts(neutral)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    idx = _open_index(ckpt, index) if index is not None else None
    if (index is None) != (concept_docs is None):
        _fail("neighbourhood purity needs both --index and --concept-docs")
    try:
        sset, ranking = find_concept(ckpt.model, ckpt.tokenizer, ctexts, ntexts, budget=None if no_budget else budget,
                                     rank_by=rank_by, threshold=threshold, min_count=min_count, index=idx,
                                     is_concept_doc=doc_regex(concept_docs) if concept_docs else None,
                                     min_purity=min_purity, concept=name,
                                     model_sha256=ckpt.manifest.get("model_sha256"))
    except ValueError as e:
        _fail(str(e))
    from rich.table import Table

    t = Table(title=f"concept {name or ''}: {len(sset.ids)} of {len(ranking)} candidates selected "
                    f"({100 * sset.share:.2f}% of K={sset.num_prototypes})")
    for col in ("id", "contribution", "log2 enr.", "concept/neutral rate", "purity", "selected", "top tokens"):
        t.add_column(col)
    for r in ranking[:top]:
        ev = sset.evidence.get(r["id"], {})
        t.add_row(str(r["id"]), f"{r['contribution_nats_per_token']:.4f}", f"{r['log2_enrichment']:.2f}", f"{r['concept_rate']:.4f}/{r['neutral_rate']:.4f}",
                  "-" if r.get("purity") is None else f"{r['purity']:.2f}", "yes" if r["selected"] else "",
                  " ".join(repr(x) for x in ev.get("signature_top_tokens", [])[:5]))
    console.print(t)
    if out:
        console.print(f"suppression set: {sset.save(out)}")
    if save:
        console.print(f"saved with the checkpoint: {sset.save(ckpt.path)}")


tasks_app = typer.Typer(help="Multiple-choice tasks: build them, evaluate a model on them.", no_args_is_help=True)
controller_app = typer.Typer(help="Sparse linear controllers over prototypes.", no_args_is_help=True)


@tasks_app.command("build")
def tasks_build(
    out: Path = typer.Option(Path("tasks"), help="Folder to write <task>/{train,validation,test}.jsonl + <task>.yaml."),
    task: list[str] = typer.Option([], help="Task name (repeatable; default all)."),
    train_cap: int = typer.Option(400), val_cap: int = typer.Option(100), test_cap: int = typer.Option(200),
) -> None:
    """Build the multiple-choice tasks deterministically (lm-eval-readable)."""
    from prismlm.errors import TaskError
    from prismlm.eval.tasks import TASKS, build_tasks

    try:
        folders = build_tasks(out, task or list(TASKS), {"train": train_cap, "validation": val_cap, "test": test_cap})
    except TaskError as e:
        _fail(str(e))
    for n, f in folders.items():
        console.print(f"{n}: {f} (lm-eval: --include_path {f} --tasks prism_{n})")


def _task_folders(tasks: Path, names: list[str]) -> dict[str, Path]:
    if (tasks / "test.jsonl").exists():
        return {tasks.name: tasks}
    found = {p.parent.name: p.parent for p in sorted(tasks.glob("*/test.jsonl"))}
    if names:
        missing = [n for n in names if n not in found]
        if missing:
            _fail(f"task(s) {missing} not found under {tasks}; have {sorted(found)}")
        found = {n: found[n] for n in names}
    if not found:
        _fail(f"no tasks under {tasks}; build them with `prism tasks build --out {tasks}`")
    return found


@tasks_app.command("eval")
def tasks_eval(
    run: Path = typer.Argument(..., help="Run folder or checkpoint folder."),
    tasks: Path = typer.Option(Path("tasks"), help="A task folder or a folder of task folders."),
    task: list[str] = typer.Option([], help="Only these tasks (repeatable)."),
    split: str = typer.Option("test", help="train, validation or test."),
    suppress: str = typer.Option("auto", help="Suppression set file, 'auto' or 'none'."),
    controller: Path | None = typer.Option(None, help="A controller JSON (`prism controller fit`) to apply."),
    lm_eval: bool = typer.Option(False, "--lm-eval", help="Also score with lm-eval's evaluator (same numbers)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the accuracies here."),
) -> None:
    """Multiple-choice accuracy (acc, acc_norm) with our log-likelihood scorer."""
    from contextlib import nullcontext

    import torch

    from prismlm.errors import TaskError
    from prismlm.eval.scoring import mc_accuracy
    from prismlm.eval.tasks import load_split

    ckpt = _load(run, suppress)
    folders = _task_folders(tasks, task)
    ctx = nullcontext()
    if controller is not None:
        from prismlm.control.controller import Controller

        try:
            ctl = Controller.load(controller)
            ctx = ckpt.model.control(ctl.coefficients.to(torch.float32))
        except (ValueError, OSError) as e:
            _fail(str(e))
    results = {}
    with ctx:
        for n, f in folders.items():
            try:
                docs = load_split(f, split)
            except TaskError as e:
                _fail(str(e))
            results[n] = mc_accuracy(ckpt.model, ckpt.tokenizer, docs).to_dict()
            if lm_eval and split == "test":
                from prismlm.app.lm_eval_adapter import evaluate_with_lm_eval

                results[n]["lm_eval"] = evaluate_with_lm_eval(ckpt.model, ckpt.tokenizer, {n: f})[n]
            console.print(f"{n} [{split}]: {results[n]}")
    if json_out:
        json_out.write_text(json.dumps(results, indent=2) + "\n")


@controller_app.command("fit")
def controller_fit(
    run: Path = typer.Argument(..., help="Run folder or checkpoint folder (PRISM)."),
    task: Path = typer.Option(..., help="A task folder (with train/validation/test.jsonl)."),
    l1: list[float] = typer.Option([3e-3, 1e-2, 3e-2], help="L1 strengths to try (chosen on validation; repeatable)."),
    steps: int = typer.Option(100, help="Full-batch optimisation steps."),
    lr: float = typer.Option(0.05, help="Step size."),
    out: Path = typer.Option(Path("controller.json"), help="Where to write the controller."),
    index: Path | None = typer.Option(None, help="A prototype index: trace each coefficient to its label and "
                                                    "training neighbourhood."),
) -> None:
    """Fit a sparse linear controller c (LM frozen) on a task; report test accuracy before → after."""
    from prismlm.control.controller import extract_features, fit_and_test, prism_encoder, trace_prism_controller
    from prismlm.errors import TaskError
    from prismlm.eval.tasks import load_split

    ckpt = _load(run, "none")
    model = ckpt.model
    if not model.is_prism:
        _fail("controllers over prototypes need a PRISM model (see bench/control.py for the SAE baseline)")
    try:
        splits = {s: load_split(task, s) for s in ("train", "validation", "test")}
    except TaskError as e:
        _fail(str(e))
    feats = {s: extract_features(model, ckpt.tokenizer, d, prism_encoder(model)) for s, d in splits.items()}
    res = fit_and_test(feats, model.lm_head.weight, model.prototypes.weight, l1_grid=l1, steps=steps, lr=lr)
    ctl, before, after = res.controller, res.before, res.after
    idx = _open_index(ckpt, index) if index is not None else None
    trace = trace_prism_controller(model, ckpt.tokenizer, ctl, feats["train"], splits["train"], index=idx)
    for e in trace[:10]:
        console.print(f"  prototype {e['id']}: c={e['c']:+.3f} {e.get('label') or ''} tokens {e['signature_top_tokens'][:5]}"
                      + (f" | {e['neighbours'][0]['snippet'][-70:]!r}" if e.get("neighbours") else ""))
    ctl.save(out, task=str(task), model_sha256=ckpt.manifest.get("model_sha256"), test_before=before, test_after=after,
             trace=trace)
    console.print(f"test acc {before['acc']:.4f} → {after['acc']:.4f} with {len(ctl.nonzero)} non-zero coefficients "
                  f"(λ={ctl.l1}); controller: {out}")


def register(app: typer.Typer) -> None:
    """Add this package's commands to the ``prism`` app."""
    app.command("concept")(concept_cmd)
    app.add_typer(tasks_app, name="tasks")
    app.add_typer(controller_app, name="controller")
