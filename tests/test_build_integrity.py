"""Nothing lost in a cache build (issue 23): a resumed build checks its build files (damaged posting rows are
built again, a changed curvature or projection is refused by name, never read as zeros or carried into the
cache); one writer per output folder (a second cache, index or export build is refused with one line and
never deletes the first's files); `prism verify` checks the cache's files against its manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import train_tiny_run
from typer.testing import CliRunner

from prismlm.artifacts import FileLock
from prismlm.cli.main import app
from prismlm.config import AttributionConfig
from prismlm.errors import ArtifactCorrupt, ArtifactError
from prismlm.progress import ProgressEvent
from prismlm.tda.cache import AttributionCache, PostingSketcher, build_cache

_CFG = AttributionConfig(
    max_sequences=22,
    batch_size=4,
    curvature_sample=5,
    projection="pca-local",
    r=8,
    pca_sequences=9,
    dtype="int4",
    prune=0.1,
    id_encoding="delta",
)
"""A build with every fitted file (curvature, pca-local bases) and every storage step: 6 batches of 4."""
_PLAIN = AttributionConfig(max_sequences=22, batch_size=4, curvature_sample=5)
"""The default storage (float32 sketches, int32 ids): the raw rows become the cache's arrays as they are."""


@pytest.fixture(scope="module")
def trained(tiny_shards, tmp_path_factory):
    return train_tiny_run(tiny_shards, tmp_path_factory.mktemp("integrity"), steps=12, batch_size=4, warmup_steps=2)


@pytest.fixture(scope="module")
def whole(trained, tiny_shards, tmp_path_factory):
    """The caches of one uninterrupted build (``_CFG``, ``_PLAIN``): what every resumed build must equal."""
    return {
        id(cfg): build_cache(trained[0].model, tiny_shards, cfg, out=tmp_path_factory.mktemp("whole") / "cache")
        for cfg in (_CFG, _PLAIN)
    }


def _interrupted(net, shards, out, monkeypatch, after: int = 4, cfg: AttributionConfig = _CFG) -> None:
    """A build killed (KeyboardInterrupt) in its postings pass after ``after`` batches were written."""

    real, calls = PostingSketcher.__call__, []

    def dying(self, proto, G):
        calls.append(1)
        if len(calls) > after:
            raise KeyboardInterrupt
        return real(self, proto, G)

    with monkeypatch.context() as mp:
        mp.setattr(PostingSketcher, "__call__", dying)
        with pytest.raises(KeyboardInterrupt):
            build_cache(net, shards, cfg, out=out)


def _flip(path, at: float) -> None:
    """Invert one byte of ``path`` at the fraction ``at`` of its length."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def _same(a: AttributionCache, b: AttributionCache) -> None:
    from test_cache_build import assert_same_cache

    assert_same_cache(a, b)


@pytest.mark.parametrize("cfg", [_PLAIN, _CFG], ids=["plain", "compact"])
@pytest.mark.parametrize(
    "damage", ["truncate-sketch", "flip-sketch", "flip-seq", "flip-proto", "garble-log", "tear-log"]
)
def test_resume_builds_damaged_rows_again(trained, whole, tiny_shards, tmp_path, monkeypatch, damage, cfg):
    """sketch.raw truncated to 30% (a resume used to zero-fill it), or one byte flipped in sketch.raw, seq.raw
    or proto.raw (used to be carried into the cache, or to crash the encoding), or a garbled line of the
    batch record: the resume finds the first damaged batch by its crc32, runs it and every later batch
    again, and the cache equals an uninterrupted build bit for bit. A record line torn by the kill only ends
    the record (nothing is rolled back)."""
    from prismlm.tda.cache import passes as passes_mod

    out = tmp_path / "cache"
    _interrupted(trained[0].model, tiny_shards, out, monkeypatch, cfg=cfg)
    build = tmp_path / "cache.build"
    assert json.loads((build / "batches.jsonl").read_text().splitlines()[-1])["j1"] == 16
    kind, name = damage.split("-")
    raw, log = build / f"{name}.raw", build / "batches.jsonl"
    if kind == "truncate":
        os.truncate(raw, int(raw.stat().st_size * 0.3))
    elif kind == "garble":  # the second of four lines
        lines = log.read_bytes().split(b"\n")
        log.write_bytes(b"\n".join([lines[0], lines[1][:-9] + b"#" * 9, *lines[2:]]))
    elif kind == "tear":
        log.write_bytes(log.read_bytes() + b'{"j1": 20, "rows": ')
    else:
        _flip(raw, 0.6)
    forwards: list[int] = []
    real_forward = passes_mod.forward_batch

    def counting(net_, shards_, j0, j1, T, dev):
        forwards.append(j0)
        return real_forward(net_, shards_, j0, j1, T, dev)

    monkeypatch.setattr(passes_mod, "forward_batch", counting)
    events: list[ProgressEvent] = []
    resumed = build_cache(trained[0].model, tiny_shards, cfg, out=out, resume=True, progress=events.append)
    _same(resumed, whole[id(cfg)])
    notes = [e.message for e in events if e.message]
    if kind == "tear":
        assert forwards == [16, 20] and not notes
        return
    assert forwards and forwards[0] < 16 and forwards[-1] == 20  # from the damaged batch on, not from 16
    assert forwards == list(range(forwards[0], 24, 4))
    assert kind != "garble" or forwards[0] == 4  # the batches after the first record
    assert any("damaged" in n and "building them again" in n for n in notes), notes


@pytest.mark.parametrize("name", ["curvature.safetensors", "projection.npy"])
def test_resume_refuses_a_changed_fitted_file(trained, tiny_shards, tmp_path, monkeypatch, name):
    """A damaged build curvature or projection (one flipped byte of its data) is refused by name with the fix,
    instead of whitening the remaining postings with it; the fix (no --resume) then builds the cache."""
    out = tmp_path / "cache"
    _interrupted(trained[0].model, tiny_shards, out, monkeypatch, after=2)
    _flip(tmp_path / "cache.build" / name, 0.9)
    with pytest.raises(ArtifactCorrupt, match=name.replace(".", r"\.")) as e:
        build_cache(trained[0].model, tiny_shards, _CFG, out=out, resume=True)
    assert "without resuming" in str(e.value)
    assert not out.exists()


def test_a_changed_fitted_batch_is_run_again(trained, whole, tiny_shards, tmp_path, monkeypatch):
    """A fitted batch's kept block gradients (fitted/J0.npz) changed before the postings pass reads them: the
    batch is run through the model again instead (the same cache bit for bit), not loaded."""
    from prismlm.tda.cache import passes as passes_mod

    real_pop, damaged = passes_mod.BatchStore.pop, []

    def pop(self, j0):
        f = self.folder / f"{j0}.npz"
        if f.is_file():
            _flip(f, 0.5)
            damaged.append(j0)
        return real_pop(self, j0)

    monkeypatch.setattr(passes_mod.BatchStore, "pop", pop)
    _same(build_cache(trained[0].model, tiny_shards, _CFG, out=tmp_path / "cache"), whole[id(_CFG)])
    assert damaged


def test_a_second_writer_is_refused_and_deletes_nothing(trained, tiny_shards, tmp_path, monkeypatch):
    """While another writer holds OUT (its lock: a second flock on OUT.lock), a build to OUT — resumed or
    not — is refused with ArtifactError naming the holder's pid and the fix, and the first writer's build
    folder is left as it was; once released, the build runs and the lock file is gone."""
    out = tmp_path / "cache"
    _interrupted(trained[0].model, tiny_shards, out, monkeypatch, after=2)
    build = tmp_path / "cache.build"
    before = {p.name: p.read_bytes() for p in build.rglob("*") if p.is_file()}
    with FileLock(tmp_path / "cache.lock", "another writer"):
        for resume in (False, True):
            with pytest.raises(ArtifactError, match=rf"{out} is being written by pid {os.getpid()}") as e:
                build_cache(trained[0].model, tiny_shards, _CFG, out=out, resume=resume)
            assert "choose another `out`" in str(e.value)
        assert {p.name: p.read_bytes() for p in build.rglob("*") if p.is_file()} == before
    build_cache(trained[0].model, tiny_shards, _CFG, out=out, resume=True)
    assert (out / "manifest.json").exists() and not (tmp_path / "cache.lock").exists()


def test_output_lock_is_reentrant_in_a_thread_only(tmp_path):
    """A writer calling another on the same folder holds the one lock; another thread is refused."""
    import threading

    from prismlm.artifacts import output_lock

    errors: list[BaseException] = []
    with output_lock(tmp_path / "x"), output_lock(tmp_path / "x"):
        t = threading.Thread(target=lambda: _try_lock(tmp_path / "x", errors))
        t.start()
        t.join()
    assert len(errors) == 1 and isinstance(errors[0], ArtifactError)
    with output_lock(tmp_path / "x"):  # released: free again
        pass


def _try_lock(path, errors: list[BaseException]) -> None:
    from prismlm.artifacts import output_lock

    try:
        with output_lock(path):
            pass
    except ArtifactError as e:
        errors.append(e)


def test_cli_writers_refuse_a_held_folder_in_one_line(trained, tiny_shards, tmp_path):
    """`prism attribute-cache`, `prism index` and `prism export` into a folder another process is writing:
    exit 2 with one line naming the folder, the holder and the fix in the command's own terms (`--out`, or the
    OUT argument of `prism export`, which has no --out: old main told it to choose another --out); no traceback,
    nothing written."""
    _, run = trained
    common = ["--shards", str(tiny_shards.root), "--device", "cpu", "--no-progress"]
    cases = {
        "cache": ["attribute-cache", str(run), "--max-sequences", "8", "--out", str(tmp_path / "cache"), *common],
        "index": ["index", str(run), "--max-sequences", "8", "--out", str(tmp_path / "index"), *common],
        "hf": ["export", str(run), str(tmp_path / "hf")],
    }
    for name, args in cases.items():
        with FileLock(tmp_path / f"{name}.lock", "another writer"):
            res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, (name, res.output)
        fix = "choose another OUT" if name == "hf" else "choose another --out"
        assert "being written by pid" in res.output and fix in res.output, res.output
        assert "Traceback" not in res.output and not (tmp_path / name).exists(), name


def test_verify_checks_every_cache_file(trained, tiny_shards, tmp_path):
    """`prism verify RUN --cache C` checks every file the cache reads, and its search sidecar's, against their
    manifests in full: one flipped byte in a data file or in CACHE/search, or a manifest that records no
    checksum for a file the cache reads, fails by name (exit 2, one line); the intact cache passes."""
    import shutil

    _, run = trained
    src = tmp_path / "src"
    common = ["--shards", str(tiny_shards.root)]
    res = CliRunner().invoke(
        app,
        [
            "attribute-cache",
            str(run),
            "--max-sequences",
            "16",
            "--batch-size",
            "4",
            "--out",
            str(src),
            "--device",
            "cpu",
            "--no-progress",
            *common,
        ],
    )
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["attribute-search", str(run), "--cache", str(src), "--min-list", "1", *common])
    assert res.exit_code == 0 and (src / "search" / "manifest.json").exists(), res.output
    res = CliRunner().invoke(app, ["verify", str(run), "--cache", str(src), *common])
    assert res.exit_code == 0 and str(src) in res.output, res.output
    search_files = sorted(json.loads((src / "search" / "manifest.json").read_text())["files"])

    def damaged(name: str, how) -> str:
        c = tmp_path / name
        shutil.copytree(src, c)
        how(c)
        res = CliRunner().invoke(app, ["verify", str(run), "--cache", str(c), *common])
        assert res.exit_code == 2 and "Traceback" not in res.output, (name, res.output)
        return " ".join(res.output.split())

    assert "sketch.npy" in damaged("flipped", lambda c: _flip(c / "sketch.npy", 0.7))
    assert f"search/{search_files[-1]}" in damaged("search", lambda c: _flip(c / "search" / search_files[-1], 0.5))

    def unrecorded(c) -> None:
        m = json.loads((c / "manifest.json").read_text())
        del m["files"]["sketch.npy"]
        (c / "manifest.json").write_text(json.dumps(m))

    out = damaged("unrecorded", unrecorded)
    assert "sketch.npy has no size and sha256" in out and "prism attribute-cache" in out, out


_HOLDER = textwrap.dedent("""
    import sys
    from prismlm.artifacts import FileLock
    with FileLock(sys.argv[1] + ".lock", "a writer"):
        print("held", flush=True)
        sys.stdin.read()
""")


@pytest.mark.slow
def test_lock_of_a_killed_writer_is_released(trained, tiny_shards, tmp_path):
    """Another process holds OUT: a build is refused naming that process's pid; once it is killed (kill -9:
    no clean-up), the OS has dropped its lock and the build runs."""
    out = tmp_path / "cache"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ArtifactError, match=rf"being written by pid {holder.pid}\b"):
            build_cache(trained[0].model, tiny_shards, AttributionConfig(max_sequences=8, batch_size=4), out=out)
    finally:
        holder.kill()
        holder.wait()
    c = build_cache(trained[0].model, tiny_shards, AttributionConfig(max_sequences=8, batch_size=4), out=out)
    assert c.manifest["covered"] == [[0, 8]]
