"""The shared artifact helpers (atomic writes, hashes, provenance, ranges), ``eval_mode`` and
``AttributionConfig`` validation."""

from __future__ import annotations

import hashlib

import pytest
import torch

from prismlm.artifacts import (
    atomic_dir,
    atomic_write_text,
    check_provenance,
    merge_ranges,
    model_identity,
    overlap,
    part_range,
    sha256_file,
)
from prismlm.config import AttributionConfig
from prismlm.errors import ArtifactMismatch, ConfigError
from prismlm.model import eval_mode


def test_atomic_dir_replaces_only_on_success(tmp_path):
    out = tmp_path / "artifact"
    with atomic_dir(out) as stage:
        assert stage.name == "artifact.tmp" and not out.exists()
        (stage / "a.txt").write_text("one")
    assert (out / "a.txt").read_text() == "one" and not stage.exists()
    with pytest.raises(RuntimeError), atomic_dir(out) as stage:
        (stage / "a.txt").write_text("torn")
        raise RuntimeError("crash while writing")
    assert (out / "a.txt").read_text() == "one"  # the previous artifact is untouched
    assert not (tmp_path / "artifact.tmp").exists() and not (tmp_path / "artifact.old").exists()
    with atomic_dir(out) as stage:
        (stage / "b.txt").write_text("two")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact"]


def test_atomic_write_and_sha256(tmp_path):
    p = atomic_write_text(tmp_path / "f.json", "héllo\n")
    assert p.read_text(encoding="utf-8") == "héllo\n" and not (tmp_path / "f.json.tmp").exists()
    assert sha256_file(p, chunk=3) == hashlib.sha256("héllo\n".encode()).hexdigest()


def test_provenance_and_ranges():
    m = {"model_sha256": "a" * 64, "shard_key": "k"}
    check_provenance(m, what="thing", rebuild="prism x", model_sha256="a" * 64, shard_key="k")
    with pytest.raises(ArtifactMismatch, match="built for model a+.*prism x"):
        check_provenance(m, what="thing", rebuild="prism x", model_sha256="b" * 64)
    with pytest.raises(ArtifactMismatch, match="token shards"):
        check_provenance(m, what="thing", rebuild="prism x", shard_key="other")
    assert merge_ranges([[4, 6], [0, 2], [2, 3], [5, 5]]) == [[0, 3], [4, 6]]
    assert overlap([[0, 3]], [[2, 5]]) == [2, 3] and overlap([[0, 3]], [[3, 5]]) is None
    assert [part_range(10, 4, (i, 2)) for i in range(2)] == [(0, 4), (4, 10)]
    with pytest.raises(ConfigError, match="part"):
        part_range(10, 4, (2, 2))
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    b.load_state_dict(a.state_dict())
    assert model_identity(a) == model_identity(b) and model_identity(a).startswith("weights:")


def test_eval_mode_restores_the_flag():
    net = torch.nn.Dropout(0.5)
    net.train()
    with eval_mode(net):
        assert not net.training
    assert net.training
    with pytest.raises(ValueError), eval_mode(net):
        raise ValueError
    assert net.training
    net.eval()
    with eval_mode(net):
        pass
    assert not net.training


@pytest.mark.parametrize(
    "bad",
    [
        dict(r=0),
        dict(projection="random"),
        dict(curvature_mode="full"),
        dict(damping=-1.0),
        dict(damping=float("nan")),
        dict(max_sequences=0),
        dict(batch_size=0),
        dict(dtype="int2"),
        dict(pca_sequences=0),
    ],
)
def test_attribution_config_rejects_bad_values(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        AttributionConfig(**bad)


def test_attribution_config_from_dict():
    cfg = AttributionConfig.from_dict({"r": 8, "projection": "pca", "dtype": "float16"})
    assert (cfg.r, cfg.projection, cfg.dtype, cfg.curvature_mode) == (8, "pca", "float16", "shared")
    assert AttributionConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown key"):
        AttributionConfig.from_dict({"mode": "exact"})
