"""Issue 34, the smaller items: reproducible curvature files, and `--out RUN/checkpoints/..` refused for
what it is (the run), not as a folder inside the checkpoints."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors import safe_open

from prismlm.artifacts import check_out_folder
from prismlm.config import RunConfig
from prismlm.errors import RunError
from prismlm.tda.influence import Curvature
from prismlm.train import train


def test_identical_curvatures_are_saved_to_identical_bytes(tmp_path):
    """safetensors writes metadata in hash order: the same curvature saved twice had different bytes (and
    manifest sha256s)."""
    torch.manual_seed(0)
    F = torch.randn(4, 4, dtype=torch.float64)
    c = Curvature(F=F @ F.T, m=torch.rand(6, dtype=torch.float64), tokens=100, rec=torch.rand(6, dtype=torch.float64))
    digests = set()
    for i in range(8):
        c.save(tmp_path / f"c{i}.safetensors", extra={"model": "m", "shards": "s", "sequences": "0-8"})
        digests.add(hashlib.sha256((tmp_path / f"c{i}.safetensors").read_bytes()).hexdigest())
    assert len(digests) == 1
    back = Curvature.load(tmp_path / "c0.safetensors")
    assert torch.equal(back.F, c.F) and torch.equal(back.m, c.m) and back.tokens == 100
    with safe_open(str(tmp_path / "c0.safetensors"), framework="pt") as f:
        assert f.metadata()["sequences"] == "0-8"


def test_out_through_checkpoints_dotdot_is_refused_as_the_run_it_names(tiny_shards, tmp_path):
    run = tmp_path / "run"
    train(RunConfig.from_name("tiny").override({"train.max_steps": 1}), run, shards=tiny_shards, progress=False)
    with pytest.raises(RunError) as e:
        check_out_folder(run / "checkpoints" / "..", "prototype index", holds="prismlm-prototype-index")
    assert "is a run" in str(e.value) and "inside a run's checkpoints" not in str(e.value), str(e.value)
    with pytest.raises(RunError, match="inside a run's checkpoints"):  # a real one still is
        check_out_folder(run / "checkpoints" / "x", "prototype index", holds="prismlm-prototype-index")


def test_labelling_holds_the_index_folder_against_a_second_writer(tiny_shards, tmp_path):
    """`prism label` read the neighbourhoods and wrote labels.json unlocked: an index rebuilt meanwhile got
    the old index's labels. Now a writer holding the index folder refuses it by name."""
    from prismlm.app import Run, build_run_index, label_prototypes
    from prismlm.artifacts import output_lock
    from prismlm.errors import ArtifactError

    run = tmp_path / "run"
    train(RunConfig.from_name("tiny").override({"train.max_steps": 1}), run, shards=tiny_shards, progress=False)
    opened = Run.open(run, device="cpu")
    build_run_index(opened, max_sequences=4, progress=False, labels=False, shards=tiny_shards.root)
    import threading

    seen: list[object] = []

    def other():
        try:
            label_prototypes(Run.open(run, device="cpu"), shards=tiny_shards.root)
            seen.append("wrote")
        except ArtifactError as e:
            seen.append(e)

    with output_lock(run / "index"):  # a `prism index --overwrite` at work
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert isinstance(seen[0], ArtifactError) and "being written" in str(seen[0]), seen
    assert not (run / "index" / "labels.json").exists()
    assert label_prototypes(opened, shards=tiny_shards.root).path == run / "index" / "labels.json"
