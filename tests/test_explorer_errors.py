"""Issue 23, item 5: requests that made the explorer answer 500 without a message get a 4xx naming what is
wrong; a corrupt labels.json and a cache rebuilt while serving are handled (in process, FastAPI TestClient)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from test_explorer_api import BASE, LIMITS, build_explorer_run, post_training  # noqa: E402

from prismlm.app.explorer import Explorer  # noqa: E402
from prismlm.web.server import create_app  # noqa: E402


@pytest.fixture(scope="module")
def built(tiny_shards, tmp_path_factory) -> tuple[Path, Path]:
    return build_explorer_run(tiny_shards, tmp_path_factory.mktemp("explorer_errors"))


@pytest.fixture(scope="module")
def client(built) -> TestClient:
    run, concept = built
    ex = Explorer.open(run, device="cpu", concepts=[concept], limits=LIMITS)
    return TestClient(create_app(ex), base_url=BASE, raise_server_exceptions=False)


def _post_raw(client: TestClient, url: str, body: str):
    """POST a JSON text as written (``\\udcff`` stays an escape: valid JSON, a lone surrogate once parsed)."""
    return client.post(url, content=body.encode("ascii"), headers={"content-type": "application/json"})


def _refused(res, *expected: str) -> dict:
    assert 400 <= res.status_code < 500, (res.status_code, res.text)
    body = res.json()
    message = body.get("message") or json.dumps(body.get("detail"))
    for e in expected:
        assert e in message, (e, body)
    return body


@pytest.mark.parametrize(
    "url, body",
    [
        ("/api/explain", '{"text": "lone \\udcff surrogate"}'),
        ("/api/explain", '{"text": "ok", "generate": 2, "steering": {"concept": "\\ud800"}}'),
        ("/api/steer", '{"prompt": "lone \\udcff surrogate", "tokens": 2}'),
        ("/api/training", '{"prompt": "The \\udcff sea", "top": 2}'),
        ("/api/training", '{"prompt": "The sea", "completion": "\\udfff", "top": 2}'),
    ],
)
def test_a_lone_surrogate_is_a_4xx_with_a_message(client, url, body):
    _refused(_post_raw(client, url, body), "surrogate")


def test_explorer_methods_refuse_a_lone_surrogate_themselves(client):
    """Query strings cannot carry one (Starlette decodes them with errors="replace"); the Explorer refuses
    it anyway for in-process callers."""
    from prismlm.errors import ConfigError

    ex = client.app.state.explorer
    for call in (
        lambda: ex.prototype(0, text="a\udcffb"),
        lambda: ex.search("\udcff", limit=5),
        lambda: ex.steer("\ud800", steering=ex_steering(), tokens=1),
    ):
        with pytest.raises(ConfigError, match="lone surrogate"):
            call()


def ex_steering():
    from prismlm.app.explorer import Steering

    return Steering()


@pytest.mark.parametrize(
    "url, body",
    [
        ("/api/explain", {"text": "The sea", "generate": 2, "seed": 2**64}),
        ("/api/explain", {"text": "The sea", "generate": 2, "seed": -(2**64)}),
        ("/api/steer", {"prompt": "The sea", "tokens": 2, "seed": 2**70}),
    ],
)
def test_a_seed_out_of_range_is_a_4xx(client, url, body):
    _refused(client.post(url, json=body), "seed")


def test_a_seed_in_range_still_samples(client):
    a = client.post("/api/steer", json={"prompt": "The sea", "tokens": 3, "seed": 2**64 - 1})
    b = client.post("/api/steer", json={"prompt": "The sea", "tokens": 3, "seed": 2**64 - 1})
    assert a.status_code == 200 and a.json()["base_text"] == b.json()["base_text"]


def test_a_document_position_out_of_range_names_the_range(client):
    doc = client.get("/api/document/0").json()
    length = doc["length"]
    assert client.get("/api/document/0", params={"position": length - 1}).json()["position"] == length - 1
    for bad in (length, -1, 10**9):
        _refused(client.get("/api/document/0", params={"position": bad}), "position", f"[0, {length})")


def test_a_corrupt_labels_file_is_served_without_labels_and_reported(built, tmp_path):
    """Before: every explain/prototype/training request failed with 500 (JSONDecodeError)."""
    run, _ = built
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "index" / "labels.json").write_text('{"0": {"label": "trunc')
    client = TestClient(
        create_app(Explorer.open(copy, device="cpu", limits=LIMITS)), base_url=BASE, raise_server_exceptions=False
    )
    info = client.get("/api/info").json()
    assert any("labels.json" in n and "prism label" in n for n in info["notes"]), info
    res = client.post("/api/explain", json={"text": "The sea was calm"})
    assert res.status_code == 200, res.text
    res = client.get("/api/prototype/0")
    assert res.status_code == 200 and res.json()["card"]["label"] in (None, ""), res.text
    assert post_training(client, {"prompt": "The sea", "top": 2})["items"]


def test_a_cache_rebuilt_while_serving_is_reloaded(built, tiny_shards, tmp_path):
    from prismlm.app import Run
    from prismlm.app.attribution import build_run_cache
    from prismlm.config import AttributionConfig

    run, _ = built
    copy = tmp_path / "run"
    shutil.copytree(run, copy)

    def build(n: int) -> None:  # built aside, then put in place: what a rebuild with --out RUN/... leaves
        aside = tmp_path / f"cache-{n}"
        build_run_cache(
            Run.open(copy, device="cpu", suppress="none"),
            AttributionConfig(r=4, max_sequences=n, batch_size=4),
            out=aside,
            shards=tiny_shards.root,
            progress=False,
        )
        shutil.rmtree(copy / "attribution-cache", ignore_errors=True)
        shutil.copytree(aside, copy / "attribution-cache")

    build(8)
    client = TestClient(create_app(Explorer.open(copy, device="cpu", limits=LIMITS)), base_url=BASE)
    first = client.post("/api/training", json={"prompt": "The sea", "top": 3}).json()
    assert first["num_train"] == 8
    build(16)
    second = client.post("/api/training", json={"prompt": "The sea", "top": 3}).json()
    assert second["num_train"] == 16
    assert max(it["sequence"] for it in second["items"]) < 16


def test_a_corrupt_labels_file_is_one_line_on_the_command_line(built, tmp_path):
    """Outside the explorer a corrupt labels.json is refused by name with the command that rewrites it."""
    from typer.testing import CliRunner

    from prismlm.cli import app

    run, _ = built
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "index" / "labels.json").write_text("[1, 2")
    res = CliRunner().invoke(app, ["prototypes", str(copy), "--limit", "3", "--device", "cpu"])
    assert res.exit_code == 2, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("error:") and "labels.json" in last and "prism label" in last, res.output


def test_a_torn_labels_file_is_a_visible_warning_at_start_and_beside_each_explanation(
    built, tmp_path, monkeypatch, capsys
):
    """Issue 34: a torn index/labels.json was served without labels and without a visible warning."""
    import uvicorn

    from prismlm.web.server import serve

    run, _ = built
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "index" / "labels.json").write_text('{"0": {"label": "trunc')
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)  # start, print, do not block
    serve(copy, device="cpu", limits=LIMITS)
    err = capsys.readouterr().err
    assert "warning: served without labels: labels file" in err and "labels.json" in err, err
    client = TestClient(
        create_app(Explorer.open(copy, device="cpu", limits=LIMITS)), base_url=BASE, raise_server_exceptions=False
    )
    res = client.post("/api/explain", json={"text": "The sea was calm"})
    assert res.status_code == 200 and any("without labels" in n for n in res.json()["notes"]), res.text
