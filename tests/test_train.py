"""Trainer behaviour: save/load, exact resume, torchrun DDP equivalence, the demo end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from prismlm import RunConfig
from prismlm.errors import CheckpointError
from prismlm.train import load_checkpoint, train
from prismlm.train.sampler import SequenceSampler

HERE = Path(__file__).parent


def tiny_cfg(**overrides) -> RunConfig:
    base = {
        "train.max_steps": 12,
        "train.eval_interval": 6,
        "train.log_interval": 3,
        "train.batch_size": 4,
        "train.warmup_steps": 2,
        "loss.warmup_steps": 4,
    }
    return RunConfig.from_name("tiny").override({**base, **overrides})


def test_save_load_gives_identical_outputs(tiny_shards, tmp_path):
    result = train(tiny_cfg(**{"train.max_steps": 4}), tmp_path / "run", shards=tiny_shards, progress=False)
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.manifest["step"] == 4 and ckpt.tokenizer is not None
    x = torch.from_numpy(tiny_shards.val.sequences(np.arange(2), 64))[:, :-1]
    result.model.eval()
    a, b = result.model(x), ckpt.model(x)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.indices, b.indices)
    assert ckpt.tokenizer.encode("hello world") == tiny_shards.tokenizer.encode("hello world")
    # tied weights survive the round trip as one tensor
    assert ckpt.model.lm_head.weight.data_ptr() == ckpt.model.transformer.wte.weight.data_ptr()


def test_resume_is_exact(tiny_shards, tmp_path):
    cfg = tiny_cfg(**{"model.dropout": 0.1})  # dropout makes the RNG state matter
    full = train(cfg, tmp_path / "full", shards=tiny_shards, progress=False)
    part = train(cfg, tmp_path / "split", shards=tiny_shards, progress=False, stop_after=5)
    assert part.step == 5
    resumed = train(cfg, tmp_path / "split", shards=tiny_shards, progress=False, resume=True)
    assert resumed.step == 12
    for (name, p), (_, q) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(p, q), name

    def lines(run):
        return [json.loads(s) for s in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    def drop(recs):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in recs]

    assert drop(lines("full")) == drop(lines("split"))


def _metrics(run: Path) -> list[dict]:
    """The run's metrics log without its timings."""
    return [
        {k: v for k, v in json.loads(s).items() if k != "tokens_per_s"}
        for s in (run / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.slow
def test_an_interrupted_run_saves_a_checkpoint_and_resumes_exactly(tiny_shards, tmp_path, monkeypatch):
    """Ctrl-C (a real SIGINT to this process) and an interrupt raised in the middle of a step both leave a
    checkpoint at the last completed step, although periodic checkpoints are off; --resume from it reaches
    the uninterrupted run's weights and metrics bit for bit."""
    import signal

    from prismlm.model import losses

    cfg = tiny_cfg(**{"model.dropout": 0.1, "train.ckpt_interval": 0})  # dropout: the RNG state matters
    full = train(cfg, tmp_path / "full", shards=tiny_shards, progress=False)

    def sigint_after_step_5(event):
        if event.done == 5 and not event.message and not event.finished:
            os.kill(os.getpid(), signal.SIGINT)  # the handler only asks; step 5 is complete when it acts

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the shell started pytest in the background
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "sig", shards=tiny_shards, progress=sigint_after_step_5)
    assert signal.getsignal(signal.SIGINT) is before  # restored
    assert load_checkpoint(tmp_path / "sig").manifest["step"] == 5

    real, calls = losses.cross_entropy, {"n": 0}

    def interrupt_in_step_8(logits, targets, *a, **k):
        if torch.is_grad_enabled():  # training forwards only (validation runs without grad)
            calls["n"] += 1
            if calls["n"] == 8:  # step 8's forward, after dropout drew from the RNG: the save must not use it
                raise KeyboardInterrupt
        return real(logits, targets, *a, **k)

    monkeypatch.setattr(losses, "cross_entropy", interrupt_in_step_8)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "mid", shards=tiny_shards, progress=False)
    monkeypatch.setattr(losses, "cross_entropy", real)
    assert load_checkpoint(tmp_path / "mid").manifest["step"] == 7
    for run in ("sig", "mid"):
        resumed = train(cfg, tmp_path / run, shards=tiny_shards, progress=False, resume=True)
        assert resumed.step == 12
        for (name, p), (_, q) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
            assert torch.equal(p, q), (run, name)
        assert _metrics(tmp_path / run) == _metrics(tmp_path / "full"), run


def test_long_runs_checkpoint_at_each_validation_by_default(tiny_shards, tmp_path):
    cfg = tiny_cfg(**{"train.keep_checkpoints": 5})
    assert cfg.train.ckpt_interval is None and RunConfig.from_name("gpt2-124m").train.ckpt_interval is None
    train(cfg, tmp_path / "run", shards=tiny_shards, progress=False)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")) == ["step-000006", "step-000012"]


def test_resume_without_checkpoint_fails_clearly(tmp_path):
    with pytest.raises(CheckpointError, match="no such run"):
        train(tiny_cfg(), tmp_path / "nothing", resume=True, progress=False)


def test_checkpoint_and_run_folder_contents(tiny_shards, tmp_path):
    train(
        tiny_cfg(**{"train.max_steps": 6, "train.ckpt_interval": 2, "train.keep_checkpoints": 2}),
        tmp_path / "run",
        shards=tiny_shards,
        progress=False,
    )
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert ckpts == ["step-000004", "step-000006"]  # older pruned, no .tmp left behind
    env = json.loads((tmp_path / "run" / "env.json").read_text())
    assert env["seed"] == 1337 and env["versions"]["torch"] and "data_manifest" in env
    assert RunConfig.from_json(tmp_path / "run" / "config.json").preset == "tiny"
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step-000006" / "manifest.json").read_text())
    assert len(manifest["model_sha256"]) == 64 and manifest["data"]["key"] == tiny_shards.manifest["key"]


def test_training_lowers_validation_loss(tiny_shards, tmp_path):
    cfg = tiny_cfg(**{"train.max_steps": 40, "train.eval_interval": 40})
    torch.manual_seed(0)
    from prismlm.eval.metrics import evaluate
    from prismlm.model import PrismLM

    untrained = evaluate(PrismLM(cfg.model), tiny_shards.val, seq_len=64, batch_size=4, max_batches=2)
    trained = train(cfg, tmp_path / "run", shards=tiny_shards, progress=False).metrics
    assert trained["val_loss"] < untrained["val_loss"] - 0.5
    for key in ("r1_bar", "r2", "dead_prototypes", "residual_share"):
        assert key in trained
    assert 0 <= trained["r2"] <= 1 and 0 <= trained["residual_share"]


def test_sampler_layout_matches_across_world_sizes():
    single = SequenceSampler(100, batch_size=3, grad_accum=2, world_size=1, seed=1)
    ddp = SequenceSampler(100, batch_size=3, grad_accum=1, world_size=2, seed=1)
    for step in (0, 5, 40):  # 40 crosses epoch boundaries
        for r in range(2):
            assert np.array_equal(single.micro_indices(step, r, 0), ddp.micro_indices(step, 0, r))
    # an epoch visits every sequence exactly once
    seen = np.concatenate([single.global_indices(s) for s in range(100 // 6)])
    assert len(set(seen.tolist())) == len(seen)


@pytest.mark.slow  # a subprocess or several processes: .ci/run's `-m slow` pass
def test_torchrun_two_processes_equal_single_process(tiny_shards, tmp_path):
    """A 2-process gloo DDP step equals the 1-process step with the same global batch."""
    cfg = tiny_cfg(**{"train.max_steps": 2, "train.eval_interval": 2, "train.batch_size": 4, "train.grad_accum": 2})
    single = train(cfg, tmp_path / "single", shards=tiny_shards, progress=False)
    ddp_cfg = cfg.override({"train.grad_accum": 1})
    (tmp_path / "cfg.json").write_text(ddp_cfg.to_json())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "ddp_worker.py"),
        str(tmp_path / "cfg.json"),
        str(tiny_shards.root),
        str(tmp_path / "ddp"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = load_checkpoint(tmp_path / "ddp").model
    for (name, p), (_, q) in zip(single.model.state_dict().items(), ddp.state_dict().items()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


PRISM_SCRIPT = str(Path(sys.executable).parent / "prism")


@pytest.mark.slow  # a subprocess or several processes: .ci/run's `-m slow` pass
def test_cli_demo_end_to_end(tmp_path):
    """The toy demo (`prism demo --scratch`) at its smallest size, through the installed console script."""
    assert Path(PRISM_SCRIPT).exists(), "the `prism` console script is not installed next to this Python"
    env = {**os.environ, "PRISM_DATA": str(tmp_path / "data")}
    cmd = [
        PRISM_SCRIPT,
        "demo",
        "--scratch",
        "--preset",
        "tiny",
        "--steps",
        "6",
        "--max-docs",
        "40",
        "--max-chars-per-doc",
        "3000",
        "--out",
        str(tmp_path / "demo"),
        "--no-progress",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val_ppl" in proc.stdout and "r1_bar" in proc.stdout
    assert (tmp_path / "demo" / "checkpoints" / "latest").exists()
    # the same run folder works with eval and generate
    proc = subprocess.run(
        [PRISM_SCRIPT, "eval", str(tmp_path / "demo"), "--batches", "2", "--json", str(tmp_path / "m.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "m.json").read_text())["step"] == 6
    proc = subprocess.run(
        [PRISM_SCRIPT, "generate", str(tmp_path / "demo"), "--prompt", "The", "-n", "5"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("The"), proc.stderr[-3000:]


def test_cli_rejects_bad_config(tmp_path):
    from typer.testing import CliRunner

    from prismlm.cli import app

    res = CliRunner().invoke(app, ["train", "--preset", "tiny", "--set", "train.lrr=1", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "unknown key" in res.output
    res = CliRunner().invoke(app, ["train", "--help"])
    assert res.exit_code == 0 and "--resume" in res.output


@pytest.mark.slow
def test_cli_ctrl_c_saves_the_run_and_resume_continues_it(tmp_path):
    """The issue's report: `prism train --steps 5000` then Ctrl-C. Exit 130, a checkpoint at the last completed
    step (the preset has no periodic one that early), and --resume continues from that step."""
    import signal

    env = {**os.environ, "PRISM_DATA": str(tmp_path / "data")}
    run = tmp_path / "R"
    cmd = [
        PRISM_SCRIPT,
        "train",
        "--preset",
        "tiny",
        "--steps",
        "5000",
        "--out",
        str(run),
        "--no-progress",
        "--set",
        "data.max_docs=40",
        "--set",
        "data.max_chars_per_doc=3000",
        "--set",
        "train.eval_interval=4000",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:  # plain progress lines: "[train] 10/5,000 step | …"
        lines.append(line)
        if line.startswith("[train] ") and int(line.split()[1].split("/")[0].replace(",", "")) >= 10:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.communicate(timeout=300)[1]
    assert proc.returncode == 130, "".join(lines) + rest
    assert "interrupted after step" in rest and "--resume" in rest, rest
    step = load_checkpoint(run).manifest["step"]
    assert 10 <= step < 5000
    res = subprocess.run(
        [PRISM_SCRIPT, "train", "--out", str(run), "--resume", "--steps", str(step + 3), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert load_checkpoint(run).manifest["step"] == step + 3
