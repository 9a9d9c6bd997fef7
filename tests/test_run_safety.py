"""Runs that cannot be lost: re-runs refused, one writer per run folder, torn logs survived, resumes that
do what they say, divergence stopped with the last good checkpoint kept, tiny validation splits refused."""

from __future__ import annotations

import json

import pytest
import torch

from prismlm import RunConfig
from prismlm.artifacts import FileLock
from prismlm.errors import CheckpointError, DataError, RunError
from prismlm.train import load_checkpoint, train


def tiny_cfg(**over) -> RunConfig:
    base = {
        "train.max_steps": 4,
        "train.eval_interval": 1000,
        "train.batch_size": 2,
        "train.warmup_steps": 1,
        "train.log_interval": 1,
    }
    return RunConfig.from_name("tiny").override({**base, **over})


def _snapshot(run):
    return {
        p.relative_to(run).as_posix(): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def test_a_rerun_is_refused_and_leaves_the_run_untouched(tiny_shards, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(), run, shards=tiny_shards, progress=False)
    before = _snapshot(run)
    with pytest.raises(RunError, match="already holds a run") as e:
        train(tiny_cfg(**{"train.seed": 7}), run, shards=tiny_shards, progress=False)
    # the library names its own options; the CLI maps them to flags (test_cli_refuses_a_rerun_in_one_line)
    assert "`resume`" in str(e.value) and "`overwrite`" in str(e.value) and "--" not in str(e.value)
    assert e.value.params == ("resume", "overwrite")  # what a front end spells its own way
    assert _snapshot(run) == before
    res = train(
        tiny_cfg(**{"train.seed": 7, "train.max_steps": 2}), run, shards=tiny_shards, progress=False, overwrite=True
    )
    assert res.step == 2 and sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000002"]
    assert [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 2]


def test_a_second_writer_is_refused_at_once(tiny_shards, tmp_path):
    run = tmp_path / "run"
    with FileLock(run / ".lock", f"run folder {run}"):  # another trainer holds the folder
        with pytest.raises(RunError, match=r"being written by pid \d+"):
            train(tiny_cfg(), run, shards=tiny_shards, progress=False)
    train(tiny_cfg(), run, shards=tiny_shards, progress=False)  # released: now it can start


def test_resume_survives_a_torn_metrics_line(tiny_shards, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(**{"train.ckpt_interval": 2}), run, shards=tiny_shards, progress=False, stop_after=2)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "train_lo')  # a kill or a full disk in the middle of a write
    res = train(tiny_cfg(), run, shards=tiny_shards, progress=False, resume=True)
    assert res.step == 4
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 4]


@pytest.mark.slow
def test_resume_extends_or_refuses_never_does_nothing(tiny_shards, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(), run, shards=tiny_shards, progress=False)
    with pytest.raises(RunError, match=r"already finished its 4 steps.*`extend_to` N \(> 4\)"):
        train(tiny_cfg(), run, shards=tiny_shards, progress=False, resume=True)
    with pytest.raises(RunError, match="already at step 4; `extend_to` 3 would not train further"):
        train(tiny_cfg(), run, shards=tiny_shards, progress=False, resume=True, extend_to=3)
    res = train(tiny_cfg(), run, shards=tiny_shards, progress=False, resume=True, extend_to=6)
    assert res.step == 6 and load_checkpoint(run).config.train.max_steps == 6
    with pytest.raises(CheckpointError, match="no such run"):
        train(tiny_cfg(), tmp_path / "nothing", shards=tiny_shards, progress=False, resume=True)
    assert not (tmp_path / "nothing").exists()


def test_a_nan_loss_stops_training_and_keeps_the_last_good_checkpoint(tiny_shards, tmp_path, monkeypatch):
    from prismlm.model import losses

    real, calls = losses.cross_entropy, {"n": 0}

    def diverging(logits, targets, *a, **k):
        calls["n"] += 1
        out = real(logits, targets, *a, **k)
        return out * float("nan") if calls["n"] > 3 else out  # finite for steps 1–3, NaN from step 4

    monkeypatch.setattr(losses, "cross_entropy", diverging)
    run = tmp_path / "run"
    with pytest.raises(RunError, match="became nan at step 4") as e:
        train(tiny_cfg(**{"train.max_steps": 6, "train.ckpt_interval": 2}), run, shards=tiny_shards, progress=False)
    assert "step-000002" in str(e.value)
    ckpt = load_checkpoint(run)
    assert ckpt.manifest["step"] == 2
    assert all(torch.isfinite(p).all() for p in ckpt.model.parameters())


def test_a_validation_split_too_small_is_refused_before_training(tmp_path):
    from prismlm.data.shards import prepare_shards

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):  # short documents: the one held out for validation is shorter than a block
        (corpus / f"doc{i}.txt").write_text(f"Call me Ishmael, number {i}. Some years ago, never mind how long.")
    shards = prepare_shards(str(corpus), "bpe-300", tmp_path / "shards", val_fraction=0.01, show_progress=False)
    assert len(shards.val) < 65
    with pytest.raises(DataError, match="validation split"):
        train(tiny_cfg(), tmp_path / "run", shards=shards, progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_cli_refuses_a_rerun_in_one_line(tiny_shards, tmp_path):
    from typer.testing import CliRunner

    from prismlm.cli import app

    run = tmp_path / "run"
    train(tiny_cfg(), run, shards=tiny_shards, progress=False)
    res = CliRunner().invoke(app, ["train", "--preset", "tiny", "--out", str(run), "--steps", "2"])
    assert res.exit_code == 2 and "already holds a run" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1
    # the library's message names its options (resume=True, overwrite=True); the CLI shows the flags
    assert "--resume" in res.output and "--overwrite" in res.output and "=True" not in res.output
    res = CliRunner().invoke(app, ["train", "--resume", "--out", str(run)])  # finished: says how to go on
    assert res.exit_code == 2 and "already finished its 4 steps" in res.output, res.output
    assert "--resume with --steps N (> 4)" in " ".join(res.output.split()) and "extend_to" not in res.output


def _trained(tiny_shards, root):
    run = root / "run"
    train(tiny_cfg(), run, shards=tiny_shards, progress=False)
    return run, load_checkpoint(run).path


def test_flipped_weight_bytes_are_refused(tiny_shards, tmp_path):
    from typer.testing import CliRunner

    from prismlm.cli import app
    from prismlm.errors import ArtifactCorrupt

    run, ck = _trained(tiny_shards, tmp_path)
    w = ck / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-100] ^= 0x40  # one bit of one weight
    w.write_bytes(bytes(data))
    with pytest.raises(ArtifactCorrupt, match="model.safetensors"):
        load_checkpoint(run)
    res = CliRunner().invoke(app, ["generate", str(run), "-n", "2"])
    assert res.exit_code == 2 and "model.safetensors" in res.output and "Traceback" not in res.output


def test_an_edited_config_or_a_cut_trainer_state_is_refused(tiny_shards, tmp_path):
    from prismlm.errors import ArtifactCorrupt, ArtifactMismatch

    run, ck = _trained(tiny_shards, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["model"]["prototypes"]["top_k"] = 8  # loads silently on old main (residual share 0.27 → 0.74)
    (ck / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    with pytest.raises(ArtifactMismatch, match="config.json"):
        load_checkpoint(run)
    run2, ck2 = _trained(tiny_shards, tmp_path / "b")
    st = ck2 / "trainer_state.pt"
    st.write_bytes(st.read_bytes()[:-50])
    with pytest.raises(ArtifactCorrupt, match="trainer_state.pt"):
        train(tiny_cfg(), run2, shards=tiny_shards, progress=False, resume=True, extend_to=6)


def test_prism_verify_checks_every_artifact(tiny_shards, tmp_path):
    from typer.testing import CliRunner

    from prismlm.cli import app

    run, ck = _trained(tiny_shards, tmp_path)
    res = CliRunner().invoke(app, ["verify", str(run), "--shards", str(tiny_shards.root)])
    assert res.exit_code == 0, res.output
    for f in ("model.safetensors", "trainer_state.pt", "config.json", "tokenizer/", "train.bin"):
        assert f in res.output, f
    (ck / "tokenizer" / "tokenizer.json").write_text("{}")
    res = CliRunner().invoke(app, ["verify", str(run), "--shards", str(tiny_shards.root)])
    assert res.exit_code == 2 and "tokenizer" in res.output and "Traceback" not in res.output


@pytest.mark.slow  # a subprocess or several processes: .ci/run's `-m slow` pass
def test_concurrent_preparation_yields_identical_verified_shards(tmp_path):
    """Two processes preparing the same corpus into one folder: one builds, the other waits and reuses;
    both end with the same shards, verified by checksum, and no temp files are left."""
    import os
    import subprocess
    import sys

    code = (
        "import json, sys; from prismlm.data.shards import prepare_shards, load_shards; "
        "s = prepare_shards('builtin', 'bpe-300', sys.argv[1], max_docs=25, max_chars_per_doc=3000, "
        "show_progress=False); load_shards(s.root, verify=True); "
        "print(json.dumps({'key': s.manifest['key'], 'sha': s.manifest['splits']['train']['sha256'], "
        "'reused': s.reused}))"
    )
    out = tmp_path / "shards"
    env = {**os.environ, "PRISM_DATA": str(tmp_path / "data")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(2)
    ]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-2000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    assert results[0]["key"] == results[1]["key"] and results[0]["sha"] == results[1]["sha"]
    assert sorted(r["reused"] for r in results) == [False, True]  # one built, the other reused
    assert not list(out.glob("*.tmp"))


def test_a_kill_while_resaving_a_step_loses_nothing(tiny_shards, tmp_path):
    """Re-saving a step moves the live checkpoint aside only once its replacement is complete; a kill
    between the two renames leaves `step-N.old`, which loading and the next save recover."""
    import os

    from prismlm.artifacts import atomic_dir

    run, ck = _trained(tiny_shards, tmp_path)
    os.replace(ck, ck.with_name(ck.name + ".old"))  # the state a kill between the renames leaves
    assert load_checkpoint(run).path.name == ck.name + ".old"
    with atomic_dir(ck) as stage:  # the next save of that step puts the live copy back first
        assert ck.exists() and stage.exists()
        (stage / "x").write_text("new")
    assert (ck / "x").exists() and not ck.with_name(ck.name + ".old").exists()


def test_a_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    import os

    from prismlm.artifacts import atomic_write_text

    target = tmp_path / "m.json"
    atomic_write_text(target, "old")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old" and not list(tmp_path.glob("*.tmp"))


def test_a_full_disk_while_checkpointing_is_one_line(tiny_shards, tmp_path, monkeypatch):
    import errno

    import prismlm.train.loop as loop_mod

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "checkpoints"))

    monkeypatch.setattr(loop_mod, "save_checkpoint", full)
    with pytest.raises(RunError, match="No space left on device"):
        train(tiny_cfg(), tmp_path / "run", shards=tiny_shards, progress=False)


def test_flipped_index_and_cache_bytes_are_refused_by_name(tiny_shards, tmp_path):
    """A flipped similarity in the index (old main showed 4.9e25) or a flipped sketch in the cache (old main
    changed results silently) is refused on load, naming the file and the rebuild command."""
    from prismlm.config import AttributionConfig
    from prismlm.errors import ArtifactCorrupt
    from prismlm.explain import IndexSettings, PrototypeIndex, build_index
    from prismlm.tda import AttributionCache, build_cache

    run, _ = _trained(tiny_shards, tmp_path)
    model = load_checkpoint(run).model
    build_index(
        model, tiny_shards, IndexSettings(top_n=4, max_sequences=8, batch_size=4), out=run / "index", progress=False
    )
    build_cache(model, tiny_shards, AttributionConfig(r=4, max_sequences=8, batch_size=4), out=run / "cache")
    PrototypeIndex.load(run / "index")
    AttributionCache.load(run / "cache")
    for path in (run / "index" / "index.safetensors", run / "cache" / "sketch.npy"):
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x10
        path.write_bytes(bytes(data))
    with pytest.raises(ArtifactCorrupt, match=r"index\.safetensors.*prism index"):
        PrototypeIndex.load(run / "index")
    with pytest.raises(ArtifactCorrupt, match=r"sketch\.npy.*prism attribute-cache"):
        AttributionCache.load(run / "cache")


def test_large_files_get_a_sampled_check_on_load_and_a_full_one_on_verify(tmp_path, monkeypatch):
    import prismlm.artifacts as artifacts
    from prismlm.errors import ArtifactCorrupt

    f = tmp_path / "big.bin"
    f.write_bytes(bytes(range(256)) * 40_000)  # 10 MB
    rec = artifacts.file_records(tmp_path, ["big.bin"])
    monkeypatch.setattr(artifacts, "VERIFY_ON_LOAD_BYTES", 1 << 20)  # treat it as large
    data = bytearray(f.read_bytes())
    data[5_000_000] ^= 1  # between the sampled blocks: the cheap check cannot see it …
    f.write_bytes(bytes(data))
    assert artifacts.verify_files(tmp_path, rec, what="test", fix="-") == ["big.bin"]
    with pytest.raises(ArtifactCorrupt):  # … the full one can
        artifacts.verify_files(tmp_path, rec, what="test", fix="-", full=True)
    f.write_bytes(bytes(data[:-1]))  # a truncation is caught by the size
    with pytest.raises(ArtifactCorrupt, match="big.bin"):
        artifacts.verify_files(tmp_path, rec, what="test", fix="-")


def test_shard_bytes_overwritten_with_valid_tokens_are_refused(tmp_path):
    """Old main trained silently on a train.bin whose bytes were overwritten with in-range tokens."""
    import numpy as np

    from prismlm.data.shards import load_shards, prepare_shards
    from prismlm.errors import ShardError

    s = prepare_shards(
        "builtin", "bpe-300", tmp_path / "shards", max_docs=20, max_chars_per_doc=3000, show_progress=False
    )
    f = s.root / "train.bin"
    arr = np.fromfile(f, dtype=s.train.dtype)
    arr[: 1 << 16] = 7  # valid token ids, same size
    arr.tofile(f)
    with pytest.raises(ShardError, match="train.bin.*overwritten"):
        load_shards(s.root)


@pytest.mark.slow
def test_index_resume_refuses_another_models_index(tiny_shards, tmp_path):
    from prismlm.app import Run, build_run_index
    from prismlm.errors import ArtifactMismatch

    run_a, _ = _trained(tiny_shards, tmp_path / "a")
    train(tiny_cfg(**{"train.seed": 3}), tmp_path / "b" / "run", shards=tiny_shards, progress=False)
    a = Run.open(run_a, device="cpu")
    build_run_index(a, max_sequences=8, shards=tiny_shards.root, progress=False)
    b = Run.open(tmp_path / "b" / "run", device="cpu")
    with pytest.raises(ArtifactMismatch, match="built for model"):
        build_run_index(b, out=run_a / "index", resume=True, max_sequences=8, shards=tiny_shards.root, progress=False)


def test_truncated_cache_files_are_refused_by_name(tiny_shards, tmp_path):
    from prismlm.config import AttributionConfig
    from prismlm.errors import ArtifactCorrupt
    from prismlm.tda import AttributionCache, build_cache

    run, _ = _trained(tiny_shards, tmp_path)
    build_cache(
        load_checkpoint(run).model,
        tiny_shards,
        AttributionConfig(r=4, max_sequences=8, batch_size=4),
        out=run / "cache",
    )
    for name in ("offsets.npy", "curvature.safetensors", "seq.npy"):
        f = run / "cache" / name
        good = f.read_bytes()
        f.write_bytes(good[: len(good) // 2])
        with pytest.raises(ArtifactCorrupt, match=name.replace(".", r"\.")):
            AttributionCache.load(run / "cache")
        f.write_bytes(good)
    AttributionCache.load(run / "cache")


def test_example_files_that_are_not_utf8_are_one_line(tiny_shards, tmp_path):
    from typer.testing import CliRunner

    from prismlm.cli import app

    run, _ = _trained(tiny_shards, tmp_path)
    (tmp_path / "c.txt").write_bytes(b"good text\n\nbad \xff\xfe bytes\n")
    (tmp_path / "n.txt").write_text("neutral words\n\nmore neutral\n")
    res = CliRunner().invoke(
        app, ["concept", str(run), "--concept", str(tmp_path / "c.txt"), "--neutral", str(tmp_path / "n.txt")]
    )
    assert res.exit_code == 2 and "not valid UTF-8 at byte 15 (line 3)" in res.output, res.output


def test_train_on_a_missing_empty_or_one_document_corpus_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from prismlm.cli import app

    (tmp_path / "empty").mkdir()
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "doc.txt").write_text("Call me Ishmael. " * 400)
    cases = [
        (str(tmp_path / "missing"), "does not exist"),
        (str(tmp_path / "empty"), "empty"),
        (str(tmp_path / "one"), "validation split"),
    ]
    for corpus, expected in cases:
        res = CliRunner().invoke(
            app,
            ["train", "--preset", "tiny", "--corpus", corpus, "--tokenizer", "bpe-300", "--out", str(tmp_path / "run")],
            env={"PRISM_DATA": str(tmp_path / "data")},
        )
        assert res.exit_code == 2 and expected in res.output.lower() and "Traceback" not in res.output, (
            corpus,
            res.output,
        )
        assert not (tmp_path / "run" / "checkpoints").exists()


# ----- issue 23: retrofit --resume, runs stopped before their first checkpoint, killed prepares ------------
def _retrofit_cli(*args, per_step: bool = False):
    from typer.testing import CliRunner

    from prismlm.cli import app

    return CliRunner().invoke(
        app,
        [
            "retrofit",
            *map(str, args),
            "--prototypes",
            "16",
            "--top-k",
            "2",
            "--batch-size",
            "2",
            "--no-progress",
            "--device",
            "cpu",
            "--set",
            "data.max_docs=60",
            "--set",
            "data.max_chars_per_doc=4000",
            "--set",
            "train.ckpt_interval=2",
            *(["--set", "train.frozen_from_stored_z=false"] if per_step else []),
        ],
    )


@pytest.mark.slow
def test_retrofit_resume_continues_an_interrupted_retrofit_bit_for_bit(tiny_shards, tmp_path, monkeypatch):
    """Old main refused a second `prism retrofit` into the run with "continue it with --resume", but retrofit
    had no --resume. Now an interrupted retrofit resumed ends with the weights of an uninterrupted one."""
    import functools

    import prismlm.train.retrofit as retrofit_mod

    dense = tmp_path / "dense"
    train(tiny_cfg().dense(), dense, shards=tiny_shards, progress=False)
    # the per-step frozen stage, which checkpoints as it goes (stage 1 on stored z writes one checkpoint at its
    # end; its interruption is tests/test_stored_z.py's)
    res = _retrofit_cli("--from", dense, "--out", tmp_path / "straight", "--steps", 4, per_step=True)
    assert res.exit_code == 0, res.output
    monkeypatch.setattr(retrofit_mod, "train", functools.partial(train, stop_after=2))  # interrupted at step 2
    res = _retrofit_cli("--from", dense, "--out", tmp_path / "resumed", "--steps", 4, per_step=True)
    assert res.exit_code == 0, res.output
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "resumed").manifest["step"] == 2
    res = _retrofit_cli("--from", dense, "--out", tmp_path / "resumed", "--steps", 4)
    assert res.exit_code == 2 and "--resume" in res.output, res.output
    res = _retrofit_cli("--out", tmp_path / "resumed", "--resume")  # no --from: the source is not needed
    assert res.exit_code == 0, res.output
    a, b = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "resumed")
    assert b.manifest["step"] == 4
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    res = _retrofit_cli("--out", tmp_path / "resumed", "--resume", "--steps", 6)  # and on, as `train --resume`
    assert res.exit_code == 0 and load_checkpoint(tmp_path / "resumed").manifest["step"] == 6, res.output


@pytest.mark.slow
def test_a_run_stopped_before_its_first_checkpoint_is_restarted_with_overwrite(tiny_shards, tmp_path, monkeypatch):
    """Old main sent users in circles: a plain start said "continue it with --resume", --resume said "start
    it without --resume". Both now name --overwrite, which starts it again."""
    import errno

    import prismlm.train.loop as loop_mod

    run = tmp_path / "run"

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(run / "checkpoints"))

    monkeypatch.setattr(loop_mod, "save_checkpoint", full)
    with pytest.raises(RunError):
        train(tiny_cfg(), run, shards=tiny_shards, progress=False)
    monkeypatch.undo()
    assert (run / "config.json").exists() and not (run / "checkpoints").exists()
    with pytest.raises(RunError, match="before its first checkpoint") as plain:
        train(tiny_cfg(), run, shards=tiny_shards, progress=False)
    with pytest.raises(CheckpointError, match="cannot resume") as resumed:
        train(tiny_cfg(), run, shards=tiny_shards, progress=False, resume=True)
    for e in (plain.value, resumed.value):
        assert "`overwrite`" in (e.fix or "") and "`resume`" not in (e.fix or ""), e
        assert e.params == ("overwrite",)
    assert train(tiny_cfg(), run, shards=tiny_shards, progress=False, overwrite=True).step == 4


@pytest.mark.slow
def test_a_killed_prepare_leaves_no_temp_files_after_the_next_one(tmp_path):
    """A prepare killed mid-write leaves `<split>.bin.<pid>.tmp`; old main kept them for good (a GB each on a
    real corpus). The next prepare into the folder removes the ones of dead processes."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from prismlm.data.shards import prepare_shards

    out = tmp_path / "shards"
    env = {**os.environ, "PRISM_DATA": str(tmp_path / "data")}
    code = (
        "import sys; from prismlm.data.shards import prepare_shards; "
        "prepare_shards('builtin', 'bpe-300', sys.argv[1], max_chars_per_doc=20000, show_progress=False)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], env=env)
    deadline = time.time() + 120
    while not list(out.glob("*.bin.*.tmp")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = sorted(p.name for p in out.glob("*.tmp"))
    assert left and all(f".{proc.pid}." in n for n in left), left  # what a kill leaves
    other = subprocess.Popen(["sleep", "60"])  # a live process: its file is not touched
    live = out / f"val.bin.{other.pid}.tmp"
    live.write_bytes(b"x")
    try:
        prepare_shards("builtin", "bpe-300", out, max_docs=8, max_chars_per_doc=2000, show_progress=False)
    finally:
        other.kill()
        other.wait()
    assert sorted(p.name for p in out.glob("*.tmp*")) == [live.name]
