"""Shared fixtures: a tiny prepared shard set built once per test session from the built-in corpus."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)  # tests are small; one thread avoids oversubscribing the 2-core CI machine


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory):
    from prismlm.data.shards import prepare_shards

    root = tmp_path_factory.mktemp("tiny_shards")
    return prepare_shards(
        "builtin", "bpe-512", root / "shards", max_docs=60, max_chars_per_doc=4000, show_progress=False
    )


def train_tiny_run(tiny_shards, root, *, steps: int, batch_size: int, warmup_steps: int):
    """Train the tiny preset on the tiny shards into ``root / "run"``; returns (Checkpoint, run folder)."""
    from prismlm import RunConfig
    from prismlm.train import load_checkpoint, train

    run = root / "run"
    cfg = RunConfig.from_name("tiny").override(
        {
            "train.max_steps": steps,
            "train.eval_interval": max(steps, 1000),
            "train.batch_size": batch_size,
            "train.warmup_steps": warmup_steps,
        }
    )
    train(cfg, run, shards=tiny_shards, progress=False)
    return load_checkpoint(run), run


QUERY_TEXTS = [
    ("The President said that the", 3),
    ("We the people of the United States", 1),
    ("It was the best of times", 2),
    ("In the beginning", 1),
    ("and the of to a", 1),
    ("Congress shall make no law respecting", 2),
]
"""(prompt, measure_from) attribution queries shared by the cache and search tests."""


def attribution_setup(tiny_shards, root, *, steps: int, num_queries: int, curvature_sequences: int):
    """A trained tiny model in float64 with the block gradients of the first ``num_queries`` of
    ``QUERY_TEXTS`` and the curvature over the first ``curvature_sequences`` training sequences:
    a namespace (net, tok, q, Q, curv, ckpt)."""
    import copy
    from types import SimpleNamespace

    from prismlm.tda.influence import curvature_pass, query_gradients

    ckpt, _ = train_tiny_run(tiny_shards, root, steps=steps, batch_size=8, warmup_steps=5)
    net = copy.deepcopy(ckpt.model).double()
    tok = ckpt.tokenizer
    texts = QUERY_TEXTS[:num_queries]
    q = query_gradients(net, [([tok.eot_id] + tok.encode(t), s) for t, s in texts])
    curv = curvature_pass(net, tiny_shards, sequences=(0, curvature_sequences), batch_size=8)
    return SimpleNamespace(net=net, tok=tok, q=q, Q=len(texts), curv=curv, ckpt=ckpt)


TINY_CORPUS = ["data.max_docs=16", "data.max_chars_per_doc=4000"]
"""A tiny retrofit's anchor corpus: ~300 sequences of 64 tokens."""


def tiny_retrofit(source, out, overrides=(), *, steps=4, frozen=None, unfreeze="none", resume=False, **kw):
    """A retrofit of ``source`` into ``out`` at the tests' size (K=32, k=4, 4 sequences a step, CPU, no
    progress), on ``TINY_CORPUS`` plus ``overrides``; with ``resume`` the run in ``out`` continued instead."""
    from prismlm.app.retrofit import RetrofitRecipe, retrofit_model

    recipe = RetrofitRecipe(steps=steps, frozen_steps=frozen, unfreeze=unfreeze, prototypes=32, top_k=4, batch_size=4)
    return retrofit_model(
        None if resume else str(source),
        out=out,
        recipe=recipe,
        device="cpu",
        progress=False,
        resume=resume,
        overrides=[] if resume else [*TINY_CORPUS, *overrides],
        **kw,
    )
