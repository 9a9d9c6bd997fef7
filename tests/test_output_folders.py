"""Output folders and files: every `--out` is created fresh, or refused unless it holds the same kind of
artifact and `--overwrite` is given; a run folder, its checkpoints and a user's folder are never written
over, whatever the flags. `prism verify` checks every artifact it finds (labels, caches without manifests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prismlm import RunConfig
from prismlm.cli import app
from prismlm.train import load_checkpoint, train

SMALL_CACHE = ["--max-sequences", "8", "--r", "4", "--batch-size", "4", "--no-progress"]
SMALL_INDEX = ["--max-sequences", "8", "--batch-size", "4", "--no-progress", "--top-n", "4"]


def cli(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def refused(res, *words: str) -> str:
    """A refusal: exit 2, one `error:` line naming each of ``words``, no traceback."""
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1, res.output
    for w in words:
        assert w in res.output, (w, res.output)
    return res.output


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture(scope="module")
def run(tiny_shards, tmp_path_factory) -> Path:
    """A trained tiny run whose config names the tiny shards (so commands find them without --shards)."""
    folder = tmp_path_factory.mktemp("out_run") / "run"
    cfg = RunConfig.from_name("tiny").override(
        {"train.max_steps": 4, "train.eval_interval": 1000, "train.batch_size": 2, "train.warmup_steps": 1}
    )
    train(cfg, folder, shards=tiny_shards, progress=False)
    return folder


def test_cache_and_index_never_replace_a_run_or_its_checkpoints(run, tiny_shards):
    """Old main: `--out RUN/checkpoints` replaced the checkpoints (verify: "holds no checkpoint"), `--out RUN`
    the run folder — exit 0."""
    shards = ["--shards", tiny_shards.root]
    before = snapshot(run)
    step = load_checkpoint(run).path
    for cmd in (["attribute-cache", run, *SMALL_CACHE, *shards], ["index", run, *SMALL_INDEX, *shards]):
        for target, flags in (
            (run / "checkpoints", []),
            (run / "checkpoints", ["--overwrite"]),
            (run, ["--overwrite"]),
            (step, ["--overwrite"]),
            (step / "sub", []),
        ):
            refused(cli(*cmd, "--out", target, *flags), str(target))
    assert snapshot(run) == before
    assert load_checkpoint(run).path == step


def test_a_users_folder_is_never_emptied_or_written_into(run, tiny_shards, tmp_path):
    """Old main emptied SOMEDIR (cache, index) or wrote into it (prepare, train, tasks build) — exit 0."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's work")
    shards = ["--shards", tiny_shards.root]
    cmds = [
        ["attribute-cache", run, *SMALL_CACHE, *shards],
        ["index", run, *SMALL_INDEX, *shards],
        ["prepare", "--tokenizer", "bpe-300", "--max-docs", "5", "--no-progress"],
        ["train", "--preset", "tiny", "--steps", "1", "--no-progress"],
        ["tasks", "build"],
    ]
    for cmd in cmds:
        for flags in ([], ["--overwrite"]):
            out = refused(cli(*cmd, "--out", mine, *flags), str(mine), "not empty")
            assert "even with --overwrite" in out
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert (mine / "notes.txt").read_text() == "a user's work"


def test_an_artifact_is_replaced_only_with_overwrite(run, tiny_shards, tmp_path):
    """A second `prism index` / `prism attribute-cache` into the same folder is refused without --overwrite
    (old main replaced it silently); with it, it is rebuilt. `--out` naming a file is one line."""
    shards = ["--shards", tiny_shards.root]
    for cmd, what in (
        (["index", run, *SMALL_INDEX, *shards], "prototype index"),
        (["attribute-cache", run, *SMALL_CACHE, *shards], "attribution cache"),
    ):
        out = tmp_path / what.replace(" ", "-")
        res = cli(*cmd, "--out", out)
        assert res.exit_code == 0, res.output
        before = snapshot(out)
        refused(cli(*cmd, "--out", out), "already holds", what, "--overwrite", "--resume")
        assert snapshot(out) == before
        res = cli(*cmd, "--out", out, "--overwrite")
        assert res.exit_code == 0, res.output
        assert (out / "manifest.json").exists()
        a_file = tmp_path / f"{what}.txt"
        a_file.write_text("mine")
        refused(cli(*cmd, "--out", a_file), "is an existing file")
        assert a_file.read_text() == "mine"
    # one kind never replaces another (old main: `attribute-cache --out RUN/index` replaced the index)
    index, cache = tmp_path / "prototype-index", tmp_path / "attribution-cache"
    before = snapshot(tmp_path)
    refused(cli("attribute-cache", run, *SMALL_CACHE, *shards, "--out", index, "--overwrite"), "a prototype index")
    refused(cli("index", run, *SMALL_INDEX, *shards, "--out", cache, "--overwrite"), "an attribution cache")
    assert snapshot(tmp_path) == before


def test_output_files_never_replace_a_file_of_an_artifact(run, tiny_shards):
    """Old main wrote `eval --json` over the checkpoint's config.json (the run then failed to load) and
    `explain --json` over the run's config.json; `--html FOLDER` raised IsADirectoryError."""
    ck = load_checkpoint(run).path
    before = snapshot(run)
    refused(
        cli("eval", run, "--batches", "1", "--shards", tiny_shards.root, "--json", ck / "config.json"),
        "--json",
        "config.json",
    )
    refused(cli("explain", run, "The", "--no-index", "--json", run / "metrics.jsonl"), "--json", "metrics.jsonl")
    refused(cli("explain", run, "The", "--no-index", "--html", run), "--html", "is a folder")
    (run.parent / "c.txt").write_text("zebra zebra quartz\n\nquartz zebra zebra zebra\n")
    (run.parent / "n.txt").write_text("the king said to the people\n\nit was a fine day in the land\n")
    concept = ["concept", run, "--concept", run.parent / "c.txt", "--neutral", run.parent / "n.txt", "--min-count", "1"]
    refused(cli(*concept, "--out", ck / "config.json"), "--out", "config.json")  # old main: the checkpoint broke
    assert snapshot(run) == before
    res = cli("explain", run, "The", "--no-index", "--json", run / "report.json")  # a new file: fine
    assert res.exit_code == 0, res.output
    assert json.loads((run / "report.json").read_text())
    (run / "report.json").unlink()


def test_prepare_reuses_its_shards_and_replaces_others_only_with_overwrite(tmp_path, monkeypatch):
    """Old main rebuilt `--out` with another corpus's shards silently (a run trained on them then failed)."""
    monkeypatch.setenv("PRISM_DATA", str(tmp_path / "data"))
    out = tmp_path / "shards"
    base = ["prepare", "--tokenizer", "bpe-300", "--out", out, "--no-progress"]
    assert cli(*base, "--max-docs", "6").exit_code == 0
    key = json.loads((out / "manifest.json").read_text())["key"]
    assert cli(*base, "--max-docs", "6").exit_code == 0  # the same shards: reused
    refused(cli(*base, "--max-docs", "7"), "another corpus or tokenizer", "--overwrite")
    assert json.loads((out / "manifest.json").read_text())["key"] == key
    assert cli(*base, "--max-docs", "7", "--overwrite").exit_code == 0
    assert json.loads((out / "manifest.json").read_text())["key"] != key


def _index_and_cache(run: Path, tiny_shards) -> tuple[Path, Path]:
    shards = ["--shards", tiny_shards.root]
    idx, cache = run.parent / "v_index", run.parent / "v_cache"
    for cmd in (
        ["index", run, *SMALL_INDEX, *shards, "--out", idx],
        ["label", run, "--index", idx, *shards],
        ["attribute-cache", run, *SMALL_CACHE, *shards, "--out", cache],
    ):
        res = cli(*cmd)
        assert res.exit_code == 0, res.output
    return idx, cache


def test_verify_refuses_corrupt_labels_and_a_cache_without_its_manifest(run, tiny_shards):
    """Old main: a corrupt labels.json (which broke every explanation) and a cache whose manifest.json was
    deleted both passed `prism verify` (exit 0)."""
    idx, cache = _index_and_cache(run, tiny_shards)
    args = ["verify", run, "--shards", tiny_shards.root, "--index", idx, "--cache", cache]
    labels = idx / "labels.json"
    good = labels.read_text()
    for bad in (
        '{"0": {"label": "x", "category": "y"',
        '{"0": 3}',
        '{"999999": {"label": "x", "category": "y"}}',
        "[1, 2]",
    ):
        labels.write_text(bad)
        refused(cli(*args), "labels.json", "prism label")
    labels.write_text(good)
    res = cli(*args)
    assert res.exit_code == 0 and "labels.json" in res.output, res.output
    manifest = cache / "manifest.json"
    saved = manifest.read_text()
    manifest.unlink()
    refused(cli(*args), "manifest.json", str(cache), "prism attribute-cache")
    manifest.write_text(saved)
    assert cli(*args).exit_code == 0


def test_verify_finds_the_artifacts_in_the_run_folder(run, tiny_shards):
    """Without --index/--cache, verify checks every index and cache in the run folder, also one that lost
    its manifest (old main: "no attribution cache", exit 0)."""
    shards = ["--shards", tiny_shards.root]
    cache = run / "attribution-cache"
    assert cli("attribute-cache", run, *SMALL_CACHE, *shards).exit_code == 0
    extra = run / "cache-r4"
    assert cli("attribute-cache", run, *SMALL_CACHE, *shards, "--out", extra).exit_code == 0
    res = cli("verify", run, *shards)
    assert res.exit_code == 0 and str(cache) in res.output and str(extra) in res.output, res.output
    (extra / "sketch.npy").write_bytes((extra / "sketch.npy").read_bytes()[:-8])
    refused(cli("verify", run, *shards), "sketch.npy")
    (cache / "manifest.json").unlink()
    import shutil

    shutil.rmtree(extra)
    refused(cli("verify", run, *shards), "manifest.json", str(cache))
    shutil.rmtree(cache)
    assert cli("verify", run, *shards).exit_code == 0


def test_search_index_is_replaced_only_with_overwrite_and_verified(run, tiny_shards, tmp_path):
    """Old main rebuilt CACHE/search silently and `prism verify` never looked at it (a flipped byte passed)."""
    pytest.importorskip("faiss")
    shards = ["--shards", tiny_shards.root]
    cache = tmp_path / "cache"
    assert cli("attribute-cache", run, *SMALL_CACHE, *shards, "--out", cache).exit_code == 0
    search = ["attribute-search", run, "--cache", cache, "--min-list", "2", "--no-progress", *shards]
    res = cli(*search)
    assert res.exit_code == 0, res.output
    before = snapshot(cache / "search")
    refused(cli(*search), "already holds a search index", "--overwrite")
    assert snapshot(cache / "search") == before
    assert cli(*search, "--overwrite").exit_code == 0
    verify = ["verify", run, *shards, "--cache", cache]
    res = cli(*verify)
    assert res.exit_code == 0 and str(cache / "search") in res.output, res.output
    f = max((p for p in (cache / "search").iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    refused(cli(*verify), f.name, "attribute-search")
