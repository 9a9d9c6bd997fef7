"""``Run``'s artifact cache (``prismlm.app.run.OpenedArtifacts``): an index, attribution cache or search
sidecar is opened once per folder and kept; ``forget(folder)`` drops every kind opened there; an attribution
cache whose manifest was rewritten since (a rebuild) is opened again, and its old search sidecar dropped."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import torch

from prismlm.app.run import OpenedArtifacts, Run
from prismlm.train.checkpoint import Checkpoint


def _bare_run(tmp_path: Path) -> Run:
    """A ``Run`` whose checkpoint is never read: the cache methods under test only need its folder."""
    ckpt = cast(Checkpoint, SimpleNamespace(path=tmp_path, manifest={}))
    return Run(path=tmp_path, checkpoint=ckpt, device=torch.device("cpu"))


def test_opened_artifacts_keep_get_drop(tmp_path):
    opened: OpenedArtifacts[str] = OpenedArtifacts()
    a, b = tmp_path / "a", tmp_path / "b"
    assert opened.keep(a, "index-a", (1, 2)) == "index-a"
    opened.keep(b, "index-b")
    assert opened.get(a) == ("index-a", (1, 2)) and opened.get(b) == ("index-b", None)
    opened.drop(a)
    opened.drop(tmp_path / "never")  # dropping what was never opened is no error
    assert opened.get(a) is None and opened.get(b) is not None


def test_forget_drops_every_kind_at_that_folder_only(tmp_path):
    run = _bare_run(tmp_path)
    here, there = tmp_path / "here", tmp_path / "there"
    for opened in (run._indexes, run._caches, run._searches):
        opened.keep(here, object())
        opened.keep(there, object())
    run.forget(here)
    for opened in (run._indexes, run._caches, run._searches):
        assert opened.get(here) is None and opened.get(there) is not None


def test_a_rebuilt_cache_is_opened_again_and_its_search_dropped(tmp_path, monkeypatch):
    from prismlm.tda.cache import AttributionCache

    folder = tmp_path / "attribution-cache"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    loads: list[object] = []

    def load(path: Path, model_sha256: str | None = None) -> object:
        cache = SimpleNamespace(path=path, manifest={}, check=lambda shards: None)
        loads.append(cache)
        return cache

    monkeypatch.setattr(AttributionCache, "load", staticmethod(load))
    run = _bare_run(tmp_path)
    monkeypatch.setattr(run, "shards", lambda *a, **k: None)
    first = run.cache(folder)
    assert run.cache(folder) is first and len(loads) == 1  # kept while its manifest is the same file
    run._searches.keep(folder / "search", object())
    new = folder / "manifest.json.tmp"
    new.write_text("{}")
    os.replace(new, folder / "manifest.json")  # how every build writes its manifest: a new inode
    second = run.cache(folder)
    assert second is not first and len(loads) == 2
    assert run._searches.get(folder / "search") is None
    assert run.cache(folder) is second
