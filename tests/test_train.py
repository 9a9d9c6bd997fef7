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
    base = {"train.max_steps": 12, "train.eval_interval": 6, "train.log_interval": 3, "train.batch_size": 4,
            "train.warmup_steps": 2, "loss.warmup_steps": 4}
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


def test_resume_without_checkpoint_fails_clearly(tmp_path):
    with pytest.raises(CheckpointError, match="no such run"):
        train(tiny_cfg(), tmp_path / "nothing", resume=True, progress=False)


def test_checkpoint_and_run_folder_contents(tiny_shards, tmp_path):
    train(tiny_cfg(**{"train.max_steps": 6, "train.ckpt_interval": 2, "train.keep_checkpoints": 2}),
          tmp_path / "run", shards=tiny_shards, progress=False)
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


def test_torchrun_two_processes_equal_single_process(tiny_shards, tmp_path):
    """A 2-process gloo DDP step equals the 1-process step with the same global batch."""
    cfg = tiny_cfg(**{"train.max_steps": 2, "train.eval_interval": 2, "train.batch_size": 4,
                      "train.grad_accum": 2})
    single = train(cfg, tmp_path / "single", shards=tiny_shards, progress=False)
    ddp_cfg = cfg.override({"train.grad_accum": 1})
    (tmp_path / "cfg.json").write_text(ddp_cfg.to_json())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "ddp_worker.py"), str(tmp_path / "cfg.json"), str(tiny_shards.root), str(tmp_path / "ddp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = load_checkpoint(tmp_path / "ddp").model
    for (name, p), (_, q) in zip(single.model.state_dict().items(), ddp.state_dict().items()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


PRISM_SCRIPT = str(Path(sys.executable).parent / "prism")


def test_cli_demo_end_to_end(tmp_path):
    """The README's main job at its smallest size, through the installed console script."""
    assert Path(PRISM_SCRIPT).exists(), "the `prism` console script is not installed next to this Python"
    env = {**os.environ, "PRISM_DATA": str(tmp_path / "data")}
    cmd = [PRISM_SCRIPT, "demo", "--preset", "tiny", "--steps", "6", "--max-docs", "40", "--max-chars-per-doc", "3000",
           "--out", str(tmp_path / "demo"), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val_ppl" in proc.stdout and "r1_bar" in proc.stdout
    assert (tmp_path / "demo" / "checkpoints" / "latest").exists()
    # the same run folder works with eval and generate
    proc = subprocess.run([PRISM_SCRIPT, "eval", str(tmp_path / "demo"), "--batches", "2", "--json",
                           str(tmp_path / "m.json")], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "m.json").read_text())["step"] == 6
    proc = subprocess.run([PRISM_SCRIPT, "generate", str(tmp_path / "demo"), "--prompt", "The", "-n", "5"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("The"), proc.stderr[-3000:]


def test_cli_rejects_bad_config(tmp_path):
    from typer.testing import CliRunner

    from prismlm.cli import app

    res = CliRunner().invoke(app, ["train", "--preset", "tiny", "--set", "train.lrr=1", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "unknown key" in res.output
    res = CliRunner().invoke(app, ["train", "--help"])
    assert res.exit_code == 0 and "--resume" in res.output
