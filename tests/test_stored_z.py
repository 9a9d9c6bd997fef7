"""Stored hidden states (``prismlm.model.stored_activations``) and retrofit stage 1 on them (``prismlm.train.bank_stage``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny_retrofit

from prismlm.app import Run
from prismlm.config import RunConfig
from prismlm.errors import ArtifactError, ArtifactMismatch
from prismlm.explain.index import IndexSettings, build_index
from prismlm.model import PrismLM
from prismlm.model.stored_activations import backbone_identity, build_stored_z, open_stored_z
from prismlm.train import train


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return PrismLM(RunConfig.from_name("tiny").model).eval()


@pytest.fixture(scope="module")
def dense_run(tiny_shards, tmp_path_factory):
    """A dense tiny prismlm run (3 steps) to retrofit, with dropout (stage 2 then draws from the RNG)."""
    out = tmp_path_factory.mktemp("dense") / "run"
    cfg = (
        RunConfig.from_name("tiny")
        .dense()
        .override({"train.max_steps": 3, "train.batch_size": 4, "model.dropout": 0.1})
    )
    train(cfg, out, shards=tiny_shards, progress=False)
    return out


def _retrofit(source, out, *extra, steps=4, unfreeze="none", frozen=None):
    return tiny_retrofit(source, out, extra, steps=steps, frozen=frozen, unfreeze=unfreeze)


@pytest.fixture(scope="module")
def stored_run(dense_run, tmp_path_factory):
    """The dense run retrofitted (4 frozen steps) on float32 stored z."""
    return _retrofit(dense_run, tmp_path_factory.mktemp("stored") / "run", "train.stored_z_dtype=float32")


def _files(path):
    return {name: (path / name).read_bytes() for name in ("z.bin", "targets.bin")}


def test_stored_rows_are_the_backbones_hidden_states_and_next_tokens(tiny_model, tiny_shards, tmp_path):
    T, d = tiny_model.config.block_size, tiny_model.config.n_embd
    events = []
    store = build_stored_z(
        tiny_model,
        tiny_shards,
        tmp_path / "z32",
        dtype="float32",
        batch_size=4,
        max_sequences=10,
        progress=events.append,
    )
    ids = np.array([0, 3, 9])
    seqs = tiny_shards.train.sequences(ids, T)
    with torch.no_grad():
        want = tiny_model.backbone(torch.from_numpy(seqs[:, :-1]))  # (3, T, d)
    assert torch.allclose(store.hidden(ids), want, rtol=0, atol=1e-6)
    # row r is sequence r // T, position r % T: its target is the token after the context's last one
    rows = (ids[:, None] * T + np.arange(T)).reshape(-1)
    assert np.array_equal(np.asarray(store.targets[rows]), seqs[:, 1:].reshape(-1))
    assert np.array_equal(np.asarray(store.targets[rows]), tiny_shards.train.tokens[rows + 1])
    assert store.z.shape == (10 * T, d) and store.complete
    assert events[-1].finished and events[-1].done == 10 * T and sum(1 for e in events if not e.finished) == 3
    # float16 keeps each value rounded to float16, in half the bytes
    half = build_stored_z(
        tiny_model, tiny_shards, tmp_path / "z16", dtype="float16", batch_size=4, max_sequences=10, progress=False
    )
    assert torch.equal(half.hidden(ids), store.hidden(ids).half().float())
    assert (tmp_path / "z16" / "z.bin").stat().st_size * 2 == (tmp_path / "z32" / "z.bin").stat().st_size
    bf = build_stored_z(
        tiny_model, tiny_shards, tmp_path / "zbf", dtype="bfloat16", batch_size=4, max_sequences=10, progress=False
    )
    assert torch.equal(bf.hidden(ids), store.hidden(ids).bfloat16().float())


def test_an_interrupted_z_pass_resumes_to_identical_files(tiny_model, tiny_shards, tmp_path):
    kw = dict(dtype="float16", batch_size=3, max_sequences=11, progress=False)
    whole = build_stored_z(tiny_model, tiny_shards, tmp_path / "whole", **kw)
    part = tmp_path / "part"
    cut = build_stored_z(tiny_model, tiny_shards, part, stop_after_batches=2, **kw)
    assert not cut.complete and cut.manifest["batches_done"] == 2
    with pytest.raises(ArtifactError, match="unfinished"):
        cut.check()
    # a write torn by the kill: the second recorded batch no longer matches its checksum and is redone
    with open(part / "z.bin", "r+b") as f:
        f.seek(3 * tiny_model.config.block_size * tiny_model.config.n_embd * 2 + 10)
        f.write(b"\xff\xff\xff\xff")
    calls = []
    done = build_stored_z(tiny_model, tiny_shards, part, **{**kw, "progress": calls.append})
    assert done.complete and _files(part) == _files(tmp_path / "whole")
    # resumed after the one good batch: the first update counts it and the redone second one
    assert calls[0].done == 2 * 3 * tiny_model.config.block_size
    assert (
        json.loads((part / "state.json").read_text())["digests"]
        == json.loads((tmp_path / "whole" / "state.json").read_text())["digests"]
    )
    # another backbone: the store is made again, not resumed
    other = PrismLM(tiny_model.config)
    again = build_stored_z(other, tiny_shards, part, **kw)
    assert again.manifest["backbone"] == backbone_identity(other) != whole.manifest["backbone"]
    assert _files(part) != _files(tmp_path / "whole")


@pytest.mark.slow
def test_stage_1_on_stored_z_follows_the_per_step_path_and_keeps_the_logits(dense_run, stored_run, tmp_path):
    stored = stored_run
    per_step = _retrofit(dense_run, tmp_path / "per-step", "train.frozen_from_stored_z=false")
    assert (stored.run_dir / "stored-z" / "z.bin").exists()
    assert not (tmp_path / "per-step" / "stored-z").exists()
    a, b = Run.open(stored.run_dir, device="cpu"), Run.open(per_step.run_dir, device="cpu")
    assert a.step == b.step == 4
    # the same rows in the same batch order: the same bank bit for bit (the backbone's rows do not depend on
    # which sequences share their batch, on CPU)
    assert torch.equal(a.model.prototypes.weight, b.model.prototypes.weight)
    assert open_stored_z(stored.run_dir / "stored-z").complete
    for key in ("r1_bar", "r2", "residual_share", "val_loss"):
        assert stored.metrics[key] == pytest.approx(per_step.metrics[key], abs=1e-5), key
    # the logits are the source model's, bit for bit
    source = Run.open(dense_run, device="cpu").model
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(source(ids).logits, a.model(ids).logits)
    # the train_rec line the trainer writes is written from the stored rows too
    lines = [json.loads(x) for x in (stored.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "train_rec" in x] and lines[-1]["step"] == 4 and "val_loss" in lines[-1]


@pytest.mark.slow
def test_stage_2_continues_from_the_stored_z_stage_as_from_the_per_step_one(dense_run, tmp_path):
    kw = dict(steps=4, frozen=2, unfreeze="last-1")
    # the trainer's stage 2 after a stored stage 1 (stage 2 on stored boundary activations: tests/test_stage2.py)
    stored = _retrofit(
        dense_run, tmp_path / "stored", "train.stored_z_dtype=float32", "train.stage2_from_stored=false", **kw
    )
    per_step = _retrofit(dense_run, tmp_path / "per-step", "train.frozen_from_stored_z=false", **kw)
    a, b = Run.open(stored.run_dir, device="cpu").model, Run.open(per_step.run_dir, device="cpu").model
    source = Run.open(dense_run, device="cpu").model.state_dict()
    sa, sb = a.state_dict(), b.state_dict()
    moved = [k for k in sa if not k.startswith("prototypes.") and not torch.equal(sa[k], source[k])]
    assert moved and all(".h.1." in k or "ln_f" in k for k in moved)  # stage 2 trained the last block
    for k in sa:  # the checkpoint stage 1 wrote resumes exactly as the per-step path's stage 1 ends
        assert torch.equal(sa[k], sb[k]), k


def test_index_from_stored_z_equals_the_index_from_the_model(stored_run, tiny_shards, tmp_path):
    run = Run.open(stored_run.run_dir, device="cpu")
    shards = run.shards()
    store = build_stored_z(run.model, shards, tmp_path / "z-grid", dtype="float32", batch_size=8, progress=False)
    from_model = build_index(run.model, shards, IndexSettings(batch_size=8, top_n=8), progress=False)
    from_store = build_index(run.model, shards, IndexSettings(batch_size=8, top_n=8), progress=False, stored_z=store)
    for name in ("top_sim", "top_offset", "counts", "act_sum", "hist"):
        assert torch.equal(getattr(from_model, name), getattr(from_store, name)), name
    for name, t in from_model.sample.tensors().items():  # the uniform sample of firings too
        assert torch.equal(t, from_store.sample.tensors()[name]), name
    # the model's pass also scores the prototype-only prediction on its logits; stored z has none to score
    faith = {k: v for k, v in from_model.coverage().items() if k not in from_store.coverage()}
    assert faith.keys() == {"top1_agreement", "kl", "margin_share", "slice_logit_share", "faithfulness_tokens"}
    assert {k: v for k, v in from_model.coverage().items() if k not in faith} == pytest.approx(
        from_store.coverage(), rel=1e-12
    )
    assert from_store.manifest["hidden_from"] == "stored-z float32"
    # another backbone's store, or another corpus's, is refused by name
    other = PrismLM(run.model.config)
    other.load_state_dict(run.model.state_dict())
    with torch.no_grad():
        other.transformer.ln_f.weight.mul_(2.0)
    with pytest.raises(ArtifactMismatch, match="another backbone"):
        build_index(other, shards, IndexSettings(batch_size=8, top_n=8), progress=False, stored_z=store)
    with pytest.raises(ArtifactMismatch, match="another shards"):
        build_index(run.model, tiny_shards, IndexSettings(batch_size=8, top_n=8), progress=False, stored_z=store)


def test_prism_index_reads_the_retrofits_stored_z(stored_run, tmp_path):
    from prismlm.app import build_run_index

    run = Run.open(stored_run.run_dir, device="cpu")
    res = build_run_index(run, out=tmp_path / "idx", progress=False, labels=False)
    assert res.index.manifest["hidden_from"] == "stored-z float32" and any("did not run" in n for n in res.notes)
    plain = build_run_index(run, out=tmp_path / "idx-model", stored_z=False, progress=False, labels=False)
    assert plain.index.manifest["hidden_from"] == "model"
    assert torch.equal(plain.index.counts, res.index.counts)
    for key, value in res.index.coverage().items():  # (the model's pass adds the faithfulness metrics)
        assert plain.index.coverage()[key] == pytest.approx(value, abs=1e-6), key
    # a stage 2 moved the backbone: its z no longer fits, and the index runs the model (saying why)
    with torch.no_grad():
        run.model.transformer.ln_f.weight.mul_(1.5)
    moved = build_run_index(run, out=tmp_path / "idx-moved", progress=False, labels=False)
    assert moved.index.manifest["hidden_from"] == "model" and any("not used" in n for n in moved.notes)


def test_a_retrofit_killed_in_its_z_pass_continues_when_run_again(dense_run, stored_run, tmp_path, monkeypatch):
    """A kill during the z pass leaves RUN/stored-z and no checkpoint: the same command run again continues
    the pass (the run-folder guard must not call the folder foreign) and ends at the uninterrupted run's bank;
    ``--resume`` says to run it again instead of sending the user to --overwrite."""
    import prismlm.train.retrofit as retrofit_module
    from prismlm.app.retrofit import resume_retrofit
    from prismlm.errors import PrismError
    from prismlm.train import load_checkpoint

    real = retrofit_module.build_stored_z

    def killed(*args, **kwargs):
        real(*args, **{**kwargs, "stop_after_batches": 2})
        raise KeyboardInterrupt

    out = tmp_path / "run"
    monkeypatch.setattr(retrofit_module, "build_stored_z", killed)
    with pytest.raises(KeyboardInterrupt):
        _retrofit(dense_run, out, "train.stored_z_dtype=float32")
    monkeypatch.setattr(retrofit_module, "build_stored_z", real)
    assert (out / "stored-z" / "state.json").exists() and not (out / "checkpoints").exists()
    with pytest.raises(
        PrismError, match=r"z pass was interrupted: run the same retrofit again as a new run \(not resumed\)"
    ):
        resume_retrofit(out, device="cpu", progress=False)
    _retrofit(dense_run, out, "train.stored_z_dtype=float32")
    got, want = load_checkpoint(out).model.state_dict(), load_checkpoint(stored_run.run_dir).model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def _flip(path, offset, n=64):
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def test_a_damaged_batch_of_stored_z_is_refused_by_name_on_read(tiny_model, tiny_shards, tmp_path):
    """Issue 34: the per-batch digests are checked where z is read, not only on resume."""
    from prismlm.errors import ArtifactCorrupt

    T, d = tiny_model.config.block_size, tiny_model.config.n_embd
    build_stored_z(
        tiny_model, tiny_shards, tmp_path / "z", dtype="float16", batch_size=3, max_sequences=9, progress=False
    )
    _flip(tmp_path / "z" / "z.bin", 4 * T * d * 2 + 100)  # inside sequence 4: batch 1
    store = open_stored_z(tmp_path / "z")
    assert store.hidden(np.array([0, 2])).shape == (2, T, d)  # batch 0 is intact and read
    with pytest.raises(ArtifactCorrupt, match=r"batch 1 .*does not match its checksum"):
        store.hidden(np.array([4]))
    with pytest.raises(ArtifactCorrupt, match="batch 1"):
        store.rows(3 * T, 4 * T)
    with pytest.raises(ArtifactCorrupt, match="batch 1"):
        open_stored_z(tmp_path / "z").verify()
    # cut short, or a file missing: refused by name when opened
    build_stored_z(
        tiny_model, tiny_shards, tmp_path / "c", dtype="float16", batch_size=3, max_sequences=9, progress=False
    )
    with open(tmp_path / "c" / "z.bin", "r+b") as f:
        f.truncate(9 * T * d)
    with pytest.raises(ArtifactCorrupt, match=r"z\.bin is .* bytes, not the"):
        open_stored_z(tmp_path / "c")
    (tmp_path / "c" / "z.bin").unlink()
    with pytest.raises(ArtifactCorrupt, match=r"z\.bin is missing"):
        open_stored_z(tmp_path / "c")
    build_stored_z(
        tiny_model, tiny_shards, tmp_path / "s", dtype="float16", batch_size=3, max_sequences=9, progress=False
    )
    (tmp_path / "s" / "state.json").write_text('{"batches_done": 3, "dig')
    with pytest.raises(ArtifactCorrupt, match="state.json"):
        open_stored_z(tmp_path / "s")


def test_prism_index_never_uses_a_damaged_stored_z_and_verify_refuses_it(stored_run, tmp_path):
    """Issue 34: 64 flipped bytes of RUN/stored-z/z.bin gave an index that differed from a clean build, and
    `prism verify` passed; now the index runs the model (saying why) and verify names the store."""
    import shutil

    from prismlm.app import build_run_index, verify_run
    from prismlm.errors import ArtifactCorrupt

    run_dir = tmp_path / "run"
    shutil.copytree(stored_run.run_dir, run_dir)
    clean = build_run_index(Run.open(run_dir, device="cpu"), out=tmp_path / "clean", progress=False, labels=False)
    assert verify_run(Run.open(run_dir, device="cpu")).checked[-1].endswith("stored-z")
    _flip(run_dir / "stored-z" / "z.bin", 1000)
    res = build_run_index(Run.open(run_dir, device="cpu"), out=tmp_path / "idx", progress=False, labels=False)
    assert res.index.manifest["hidden_from"] == "model"
    assert any("not used" in n and "batch 0" in n for n in res.notes)
    for name in ("top_offset", "counts"):
        assert torch.equal(getattr(res.index, name), getattr(clean.index, name)), name
    with pytest.raises(ArtifactCorrupt, match=r"batch 0 .*stored z"):
        verify_run(Run.open(run_dir, device="cpu"))
    (run_dir / "stored-z" / "z.bin").unlink()
    with pytest.raises(ArtifactCorrupt, match=r"z\.bin is missing"):
        verify_run(Run.open(run_dir, device="cpu"))
