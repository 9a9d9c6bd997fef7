"""The explorer over a retrofitted Hugging Face model (a tiny random Phi, whose ``lm_head`` has a bias).

The references are independent of the explorer: the logits of a plain ``model(x)`` forward and slices
recomputed from the weights (a_i · m_i · p_i · W_y, r · W_y, b_y).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fastapi")
transformers = pytest.importorskip("transformers")

from fastapi.testclient import TestClient  # noqa: E402
from test_explorer_api import post_training  # noqa: E402

from prismlm.app.explorer import Explorer, Limits  # noqa: E402
from prismlm.web.server import create_app  # noqa: E402

TEXT = "The people of the United States, in order to form a more perfect union"
LIMITS = Limits(max_text_chars=500, max_generate=16, max_top=12, max_body_bytes=20_000)


@pytest.fixture(scope="module")
def hf_run(tiny_shards, tmp_path_factory):
    """A tiny random Phi (visible lm_head bias) with the tiny BPE, retrofitted with a frozen backbone."""
    from test_retrofit import hf_tokenizer_from, retrofit_cli, tiny_hf_model

    root = tmp_path_factory.mktemp("explorer_hf")
    src = root / "phi"
    tiny_hf_model("phi").save_pretrained(src)
    hf_tokenizer_from(tiny_shards.tokenizer).save_pretrained(src)
    run = retrofit_cli(src, root / "run", "--steps", "4")
    from prismlm.app import Run, build_run_index

    build_run_index(Run.open(run, device="cpu"), max_sequences=16, batch_size=4, progress=False)
    return run


@pytest.fixture(scope="module")
def explorer(hf_run) -> Explorer:
    return Explorer.open(hf_run, device="cpu", limits=LIMITS)


@pytest.fixture(scope="module")
def client(explorer) -> TestClient:
    return TestClient(create_app(explorer), base_url="http://127.0.0.1")


def _forward(explorer: Explorer, ids: list[int], suppress: list[int] | None = None):
    m = explorer.run.model
    x = torch.tensor([ids])
    with torch.no_grad():
        if suppress:
            with m.suppress(suppress):
                return m(x)
        return m(x)


@pytest.mark.slow
def test_info_names_the_hf_backbone(client, explorer):
    info = client.get("/api/info").json()
    assert info["model"]["backbone"] == "hf" and info["model"]["bias"] is True
    assert info["model"]["num_prototypes"] == 64 and info["model"]["top_k"] == 4
    assert info["run"] == explorer.run.folder.name and info["has_index"]


def test_explain_waterfall_equals_a_plain_forward_with_the_lm_head_bias(client, explorer):
    r = client.post("/api/explain", json={"text": TEXT, "alternatives": 3})
    assert r.status_code == 200, r.text
    d = r.json()
    ids = d["token_ids"]
    assert len(ids) > 8 and len(d["positions"]) == len(ids)
    m = explorer.run.model
    out = _forward(explorer, ids)
    ref = out.logits[0].double()
    P, W = m.prototypes.weight.detach().double(), m.lm_head.weight.detach().double()
    b = m.lm_head.bias.detach().double()
    assert b.abs().max() > 0.1  # the fixture's bias is visible
    saw_bias = 0
    for t, p in enumerate(d["positions"]):
        for c in [p["chosen"], *p["alternatives"]]:
            y = c["id"]
            assert c["logit"] == pytest.approx(float(ref[t, y]), abs=2e-5)
            assert sum(c["slices"]) + c["residual"] + c["bias"] == pytest.approx(float(ref[t, y]), abs=2e-5)
            assert c["bias"] == pytest.approx(float(b[y]), abs=1e-6)
            saw_bias += abs(c["bias"]) > 1e-3
            assert c["residual"] == pytest.approx(float(out.residual[0, t].double() @ W[y]), abs=1e-5)
        y = p["chosen"]["id"]
        want = {
            i: a * float(P[i] @ W[y])
            for i, a in zip(out.indices[0, t].tolist(), out.activations[0, t].double().tolist())
            if a > 0
        }
        got = {a["id"]: s for a, s in zip(p["active"], p["chosen"]["slices"])}
        assert got.keys() == want.keys()
        for i, v in want.items():
            assert got[i] == pytest.approx(v, abs=1e-5)
    assert saw_bias > 0 and d["max_abs_error"] < 1e-4


def test_prototype_view_and_map_load(client, explorer):
    r = client.get("/api/prototype/3", params={"text": TEXT})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["card"]["id"] == 3 and d["has_index"] and len(d["similar"]) == 8
    assert len(d["card"]["top_tokens"]) == 12
    assert d["text_tokens"] and d["fires"] is not None
    # where it fires in the text: the activations of a plain forward
    ids = explorer.run.tokenizer.encode(TEXT)
    out = _forward(explorer, ids)
    hit = ((out.indices[0] == 3) & (out.activations[0] > 0)).any(-1).nonzero().squeeze(1).tolist()
    assert [f["position"] for f in d["fires"]] == hit
    busiest = int(torch.as_tensor(explorer.index.counts).argmax())
    card = client.get(f"/api/prototype/{busiest}").json()["card"]
    assert card["neighbours"] and "target" in card["neighbours"][0]
    m = client.get("/api/map")
    assert m.status_code == 200, m.text
    mv = m.json()
    assert len(mv["x"]) == len(mv["y"]) == len(mv["category"]) == explorer.num_prototypes
    assert len(mv["count"]) == explorer.num_prototypes and sum(mv["count"]) > 0
    s = client.get("/api/search", params={"token": " the", "limit": 5})
    assert s.status_code == 200 and len(s.json()["hits"]) == 5


def test_suppression_changes_exactly_the_suppressed_slices(client, explorer):
    base = client.post("/api/explain", json={"text": TEXT, "alternatives": 2}).json()
    S = sorted({p["top_prototype"] for p in base["positions"][:6] if p["top_prototype"] is not None})
    assert S
    sup = client.post("/api/explain", json={"text": TEXT, "alternatives": 2, "steering": {"suppress": S}}).json()
    ids = base["token_ids"]
    ref_sup = _forward(explorer, ids, suppress=S).logits[0].double()
    touched = 0
    for t, (pb, ps) in enumerate(zip(base["positions"], sup["positions"])):
        if ps["chosen"]["id"] != pb["chosen"]["id"]:
            assert t == len(ids) - 1  # only the model's own last argmax may move
            continue
        b = {a["id"]: s for a, s in zip(pb["active"], pb["chosen"]["slices"])}
        s = {a["id"]: v for a, v in zip(ps["active"], ps["chosen"]["slices"])}
        assert s.keys() == b.keys()
        removed = 0.0
        for i in b:
            if i in S:
                assert s[i] == 0.0
                removed += b[i]
            else:
                assert s[i] == pytest.approx(b[i], abs=1e-6)
        touched += removed != 0
        assert ps["chosen"]["residual"] == pytest.approx(pb["chosen"]["residual"], abs=1e-6)
        assert ps["chosen"]["bias"] == pytest.approx(pb["chosen"]["bias"], abs=1e-9)
        assert ps["chosen"]["logit"] - pb["chosen"]["logit"] == pytest.approx(-removed, abs=2e-5)
        assert ps["chosen"]["logit"] == pytest.approx(float(ref_sup[t, pb["chosen"]["id"]]), abs=2e-5)
    assert touched >= 1


def test_steer_and_training_data_on_the_hf_run(client, explorer):
    body = {
        "prompt": "The people of",
        "tokens": 6,
        "seed": 2,
        "temperature": 0.8,
        "steering": {"suppress": list(range(explorer.num_prototypes))},
    }
    r = client.post("/api/steer", json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    assert len(d["steps"]) == 6
    for s in d["steps"]:
        assert s["delta"] == pytest.approx(s["delta_from_slices"], abs=2e-5)
    items = post_training(client, {"prompt": "The people of", "completion": " the", "top": 3})["items"]
    assert len(items) == 3 and max(abs(it["relative"]) for it in items) == pytest.approx(1.0)


def test_static_report_names_the_run_and_step_not_the_hash(hf_run, tmp_path):
    """``prism explain --html``: the header names the run folder, step, K and k like the app's header; the
    model hash is only small print with the full hash in a tooltip."""
    import json

    from typer.testing import CliRunner

    from prismlm.cli import app as cli_app

    page = tmp_path / "report.html"
    res = CliRunner().invoke(cli_app, ["explain", str(hf_run), "The people of", "--html", str(page), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    text = page.read_text()
    manifest = json.loads(next((hf_run / "checkpoints").glob("step-*/manifest.json")).read_text())
    step, sha = manifest["step"], manifest["model_sha256"]
    assert isinstance(step, int) and step > 0
    assert f"run {hf_run.name} · step {step} · K=64, k=4" in text
    assert f'title="model_sha256 {sha}"' in text  # the whole hash: a tooltip
    body = text.split("<body>", 1)[1]
    assert body.count(sha) == body.count(f'title="model_sha256 {sha}"') + body.count(f'"model_sha256": "{sha}"')


def test_report_operations_compute_what_the_cli_renders(hf_run, tmp_path):
    """``prism explain --attribute`` and ``prism attribute --html`` are one application operation each
    (``app.reports``): the explanation and the attribution come back together; the CLI only renders."""
    import json

    from typer.testing import CliRunner

    from prismlm.app import ExplanationRequest, Run, attribute_text, build_run_cache
    from prismlm.app.reports import attribute_report, explain_report
    from prismlm.cli import app as cli_app
    from prismlm.config import AttributionConfig
    from prismlm.tda.attribute import QuerySpec, SearchSpec

    run = Run.open(hf_run, device="cpu")
    rep = attribute_report(
        run,
        "The people of the United States",
        QuerySpec(completion=2),
        SearchSpec(top=3, method="full", max_sequences=16),
        explain=True,
    )
    ref = attribute_text(
        run,
        "The people of the United States",
        QuerySpec(completion=2),
        SearchSpec(top=3, method="full", max_sequences=16),
    )
    assert [t.sequence for t in rep.attribution.top] == [t.sequence for t in ref.top]
    assert rep.explanation is not None and rep.explanation.text == ref.prompt + ref.completion
    assert (
        attribute_report(run, "The people", search=SearchSpec(top=2, method="full", max_sequences=8)).explanation
        is None
    )
    assert explain_report(run, "The people of").attribution is None
    build_run_cache(run, AttributionConfig(max_sequences=16), progress=False)
    run = Run.open(hf_run, device="cpu")
    rep2 = explain_report(run, "The people of", ExplanationRequest(generate=3), attribute=True)
    assert rep2.attribution is not None and rep2.attribution.measured_tokens == 3
    assert rep2.to_dict()["attribution"]["measured_tokens"] == 3
    # through the CLI: the same report, written as JSON and HTML
    out = CliRunner().invoke(
        cli_app,
        [
            "explain",
            str(hf_run),
            "The people of",
            "--generate",
            "3",
            "--attribute",
            "--device",
            "cpu",
            "--json",
            str(tmp_path / "e.json"),
            "--html",
            str(tmp_path / "e.html"),
        ],
    )
    assert out.exit_code == 0, out.output
    assert json.loads((tmp_path / "e.json").read_text())["attribution"]["measured_tokens"] == 3
    assert "Training data" in (tmp_path / "e.html").read_text()
    out = CliRunner().invoke(
        cli_app,
        [
            "attribute",
            str(hf_run),
            "The people of the",
            "--completion",
            "1",
            "--device",
            "cpu",
            "--html",
            str(tmp_path / "a.html"),
        ],
    )
    assert out.exit_code == 0, out.output
    page = (tmp_path / "a.html").read_text()
    assert "Training data" in page and f"run {hf_run.name} · step" in page
