"""FSDP (``train.parallel = "fsdp"``): two gloo processes under torchrun train exactly as one process with
the same global batch, and their sharded checkpoints save and resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prismlm import RunConfig
from prismlm.artifacts import file_records
from prismlm.errors import CheckpointError
from prismlm.train import load_checkpoint, train
from prismlm.train.fsdp import SHARDED_DIR

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


def _torchrun(args: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "ddp_worker.py"),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # a subprocess or several processes: .ci/run's `-m slow` pass
def test_fsdp_two_processes_equal_single_process_and_resume_from_shards(tiny_shards, tmp_path):
    """Step 2 of a sharded 2-process run equals step 2 of one process (global batch 8 either way); the run's
    checkpoint holds one optimizer shard per rank; resumed from it under torchrun, step 3 equals the
    uninterrupted single-process step 3 (a resume that dropped the AdamW moments would not)."""
    cfg = tiny_cfg(
        **{
            "train.max_steps": 3,
            "train.eval_interval": 2,
            "train.batch_size": 4,
            "train.grad_accum": 2,
            "train.ckpt_interval": 2,
            "train.keep_checkpoints": 3,
        }
    )
    single = tmp_path / "single"
    train(cfg, single, shards=tiny_shards, progress=False)
    fsdp_cfg = cfg.override({"train.grad_accum": 1, "train.parallel": "fsdp"})
    (tmp_path / "cfg.json").write_text(fsdp_cfg.to_json())
    run = tmp_path / "fsdp"
    _torchrun([str(tmp_path / "cfg.json"), str(tiny_shards.root), str(run), "--stop-after", "2"])

    ckpt = load_checkpoint(run)  # verified against its manifest, shards included
    assert ckpt.manifest["step"] == 2
    shard_files = sorted(p.name for p in (ckpt.path / SHARDED_DIR).iterdir())
    assert shard_files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert all(f"{SHARDED_DIR}/{name}" in ckpt.manifest["files"] for name in shard_files)
    assert ckpt.trainer_state()["optimizer"] == SHARDED_DIR  # no full optimizer copy on rank 0
    _assert_same_weights(ckpt.model, load_checkpoint(single / "checkpoints" / "step-000002").model)
    # the tied unembedding is still one tensor after consolidation
    assert ckpt.model.lm_head.weight.data_ptr() == ckpt.model.transformer.wte.weight.data_ptr()

    _torchrun([str(tmp_path / "cfg.json"), str(tiny_shards.root), str(run), "--resume"])
    resumed = load_checkpoint(run)
    assert resumed.manifest["step"] == 3
    _assert_same_weights(resumed.model, load_checkpoint(single).model)


def test_a_sharded_checkpoint_is_not_resumed_in_one_process(tiny_shards, tmp_path):
    """A checkpoint whose optimizer state is in FSDP shards names the way to resume it."""
    cfg = tiny_cfg(**{"train.max_steps": 2, "train.parallel": "fsdp"})
    train(cfg, tmp_path / "run", shards=tiny_shards, progress=False, stop_after=1)  # one process: not sharded
    ckpt = load_checkpoint(tmp_path / "run")
    state = ckpt.trainer_state()
    state["optimizer"] = SHARDED_DIR  # as an FSDP job writes it
    torch.save(state, ckpt.path / "trainer_state.pt")
    manifest = json.loads((ckpt.path / "manifest.json").read_text())
    manifest["files"].update(file_records(ckpt.path, ["trainer_state.pt"]))  # still a verified checkpoint
    (ckpt.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="torchrun"):
        train(cfg, tmp_path / "run", shards=tiny_shards, progress=False, resume=True)
