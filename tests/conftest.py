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
