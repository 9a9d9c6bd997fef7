"""Shared fixtures: a tiny prepared shard set built once per test session from the built-in corpus."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)  # tests are small; one thread avoids oversubscribing the 2-core CI machine


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory):
    from prismlm.data.shards import prepare_shards

    root = tmp_path_factory.mktemp("tiny_shards")
    return prepare_shards("builtin", "bpe-512", root / "shards", max_docs=60, max_chars_per_doc=4000,
                          show_progress=False)


def train_tiny_run(tiny_shards, root, *, steps: int, batch_size: int, warmup_steps: int):
    """Train the tiny preset on the tiny shards into ``root / "run"``; returns (Checkpoint, run folder)."""
    from prismlm import RunConfig
    from prismlm.train import load_checkpoint, train

    run = root / "run"
    cfg = RunConfig.from_name("tiny").override({"train.max_steps": steps, "train.eval_interval": max(steps, 1000),
                                                "train.batch_size": batch_size, "train.warmup_steps": warmup_steps})
    train(cfg, run, shards=tiny_shards, progress=False)
    return load_checkpoint(run), run
