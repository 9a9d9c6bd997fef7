"""The explorer's JSON API (``prism serve``), in process through FastAPI's TestClient.

Every number is checked against an independent reference: a plain forward of the model (its logits) and
slices recomputed here from the weights (a_i · p_i · W_y), never against the decomposition the API itself
returns.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from prismlm.app.explorer import Explorer, Limits  # noqa: E402
from prismlm.control.suppress import SuppressionSet  # noqa: E402
from prismlm.web.server import create_app  # noqa: E402

TEXT = "It is a truth universally acknowledged, that a single man in possession"
BASE = "http://127.0.0.1"
LIMITS = Limits(max_text_chars=500, max_generate=24, max_top=12, max_body_bytes=20_000)

_BUILT: dict[str, Any] = {}


def build_explorer_run(tiny_shards, root: Path) -> tuple[Path, Path]:
    """A tiny PRISM trained for 20 steps, with a prototype index and a concept set; built once per session
    (the browser tests reuse it). Returns (run folder, concept file)."""
    if "run" not in _BUILT:
        from conftest import train_tiny_run

        from prismlm.app import Run, build_run_index

        ckpt, run = train_tiny_run(tiny_shards, root, steps=20, batch_size=4, warmup_steps=2)
        from prismlm.explain import rule_labels, save_labels

        res = build_run_index(Run.open(run), max_sequences=48, batch_size=8, progress=False, shards=tiny_shards.root)
        save_labels(rule_labels(res.index), res.path)  # a partial index gets no labels by itself
        K = ckpt.model.prototypes.num_prototypes
        concept = SuppressionSet(
            ids=list(range(0, K, 2)), num_prototypes=K, model_sha256=ckpt.manifest.get("model_sha256"), concept="evens"
        )
        _BUILT["run"] = (run, concept.save(root / "evens.json"))
    return _BUILT["run"]


@pytest.fixture(scope="module")
def explorer(tiny_shards, tmp_path_factory) -> Explorer:
    run, concept = build_explorer_run(tiny_shards, tmp_path_factory.mktemp("explorer"))
    return Explorer.open(run, device="cpu", concepts=[concept], limits=LIMITS)


@pytest.fixture(scope="module")
def client(explorer) -> TestClient:
    return TestClient(create_app(explorer), base_url=BASE)


def post_training(client: TestClient, body: dict[str, Any]) -> Any:
    """``POST /api/training``, following the job it answers with while no gradients are built (202: polled
    until it ends, within a deadline); the answer's JSON."""
    import time

    res = client.post("/api/training", json=body)
    if res.status_code != 202:
        return res.json()
    job, t0 = res.json()["job"], time.monotonic()
    while job["state"] in ("queued", "running"):
        assert time.monotonic() - t0 < 300, f"the training job never ended: {job}"
        time.sleep(0.05)
        job = client.get(f"/api/jobs/{job['id']}").json()
    assert job["state"] == "done", job
    return job["result"]


def _plain_logits(explorer: Explorer, ids: list[int], suppress: list[int] | None = None) -> torch.Tensor:
    """(n, V) logits of a plain forward (optionally with ``model.suppress``) — the independent reference."""
    m = explorer.run.model
    x = torch.tensor([ids])
    with torch.no_grad():
        if suppress:
            with m.suppress(suppress):
                return m(x).logits[0].double()
        return m(x).logits[0].double()


def _reference_slices(
    explorer: Explorer, ids: list[int], targets: list[int]
) -> tuple[list[dict[int, float]], list[float]]:
    """Per position {prototype id: a_i (p_i · W_y)} and the residual (r · W_y), from the weights directly."""
    m = explorer.run.model
    with torch.no_grad():
        out = m(torch.tensor([ids]))
        P = m.prototypes.weight.double()
        W = m.lm_head.weight.double()
        slices, resid = [], []
        for t, y in enumerate(targets):
            row = {}
            for i, a in zip(out.indices[0, t].tolist(), out.activations[0, t].double().tolist()):
                if a > 0:
                    row[i] = a * float(P[i] @ W[y])
            slices.append(row)
            resid.append(float(out.residual[0, t].double() @ W[y]))
    return slices, resid


def test_info_and_front_end(client, explorer):
    info = client.get("/api/info").json()
    assert info["model"]["num_prototypes"] == explorer.num_prototypes and info["has_index"]
    assert "evens" in info["concepts"] and info["limits"]["max_generate"] == LIMITS.max_generate
    page = client.get("/")
    assert page.status_code == 200 and "PRISM explorer" in page.text
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    for name in ("app.js", "waterfall.js", "prism.css"):
        assert client.get(f"/static/{name}").status_code == 200


def test_explain_waterfalls_sum_to_the_plain_forward_logits(client, explorer):
    d = client.post("/api/explain", json={"text": TEXT, "alternatives": 4}).json()
    ids = d["token_ids"]
    ref = _plain_logits(explorer, ids)
    n = len(ids)
    assert len(d["positions"]) == n and n > 10
    chosen = [p["chosen"]["id"] for p in d["positions"]]
    assert chosen[:-1] == ids[1:]  # the text's own next tokens; the last is the model's argmax
    assert chosen[-1] == int(ref[-1, : explorer.run.tokenizer.vocab_size].argmax())
    ref_slices, ref_resid = _reference_slices(explorer, ids, chosen)
    for t, p in enumerate(d["positions"]):
        for c in [p["chosen"], *p["alternatives"]]:
            total = sum(c["slices"]) + c["residual"] + c["bias"]
            assert total == pytest.approx(float(ref[t, c["id"]]), abs=2e-5), (t, c["token"])
            assert c["logit"] == pytest.approx(float(ref[t, c["id"]]), abs=2e-5)
        # the chosen token's slices, prototype by prototype, against the weights
        got = {a["id"]: s for a, s in zip(p["active"], p["chosen"]["slices"])}
        assert got.keys() == ref_slices[t].keys()
        for i, v in ref_slices[t].items():
            assert got[i] == pytest.approx(v, abs=1e-5)
        assert p["chosen"]["residual"] == pytest.approx(ref_resid[t], abs=1e-5)
        # alternatives: the most probable tokens other than the chosen one, in order
        alt_ids = [a["id"] for a in p["alternatives"]]
        order = [i for i in ref[t].argsort(descending=True).tolist() if i != chosen[t]][:4]
        assert alt_ids == order
    assert d["max_abs_error"] < 1e-4


def test_explain_shows_what_the_prototypes_alone_would_predict(client, explorer):
    """Per position: argmax W ẑ (the prototype-only prediction, ẑ rebuilt from the bank here) beside the model's
    argmax; under suppression ẑ loses the suppressed prototypes, as the logits do."""
    m, valid = explorer.run.model, explorer.run.tokenizer.vocab_size
    P, W = m.prototypes.weight.detach().double(), m.lm_head.weight.detach().double()
    for S in ([], [1, 2, 3, 5, 8]):
        d = client.post("/api/explain", json={"text": TEXT, "alternatives": 1, "steering": {"suppress": S}}).json()
        ids = d["token_ids"]
        with torch.no_grad():
            out = m(torch.tensor([ids]))
        ref = _plain_logits(explorer, ids, suppress=S)
        for t, p in enumerate(d["positions"]):
            zhat = sum(
                float(a) * P[int(i)] for i, a in zip(out.indices[0, t], out.activations[0, t]) if int(i) not in S
            )
            top = int((W @ zhat)[:valid].argmax())
            assert p["prototype_top_id"] == top and p["prototype_top_token"] == explorer.run.tokenizer.id_to_token(top)
            assert p["model_top_id"] == int(ref[t, :valid].argmax())
            assert 0 <= p["prototype_prob"] <= 1


def test_explain_a_generation_and_no_alternatives(client, explorer):
    d = client.post("/api/explain", json={"text": "It is a truth", "generate": 6, "alternatives": 0, "seed": 1}).json()
    p = d["prompt_tokens"]
    assert p is not None and len(d["token_ids"]) == p + 6 - 1  # the last sampled token is only predicted
    assert [q["chosen_by"] for q in d["positions"][p - 1 :]] == ["sampled"] * 6
    assert all(q["alternatives"] == [] for q in d["positions"])
    ref = _plain_logits(explorer, d["token_ids"])
    for t, q in enumerate(d["positions"]):
        c = q["chosen"]
        assert sum(c["slices"]) + c["residual"] + c["bias"] == pytest.approx(float(ref[t, c["id"]]), abs=2e-5)
        assert c["rank"] == int((ref[t, : explorer.run.tokenizer.vocab_size] > ref[t, c["id"]]).sum())


def test_suppression_through_the_api_changes_exactly_those_slices(client, explorer):
    base = client.post("/api/explain", json={"text": TEXT, "alternatives": 2}).json()
    # suppress the top prototype of a few positions, and one that is never active
    S = sorted({p["top_prototype"] for p in base["positions"][:6] if p["top_prototype"] is not None})
    sup = client.post("/api/explain", json={"text": TEXT, "alternatives": 2, "steering": {"suppress": S}}).json()
    assert sup["steering"]["suppress"] == S
    ids = base["token_ids"]
    ref_sup = _plain_logits(explorer, ids, suppress=S)
    ref_slices, _ = _reference_slices(explorer, ids, [p["chosen"]["id"] for p in base["positions"]])
    touched = 0
    for t, (pb, ps) in enumerate(zip(base["positions"], sup["positions"])):
        assert ps["chosen"]["id"] == pb["chosen"]["id"] or t == len(ids) - 1
        if ps["chosen"]["id"] != pb["chosen"]["id"]:
            continue  # the model's own last-token argmax may move under suppression
        b = {a["id"]: s for a, s in zip(pb["active"], pb["chosen"]["slices"])}
        s = {a["id"]: v for a, v in zip(ps["active"], ps["chosen"]["slices"])}
        mult = {a["id"]: a["multiplier"] for a in ps["active"]}
        assert s.keys() == b.keys()  # same active prototypes: suppression does not change activations
        for i in b:
            if i in S:
                assert s[i] == 0.0 and mult[i] == 0.0
            else:
                assert s[i] == pytest.approx(b[i], abs=1e-6) and mult[i] == 1.0
        assert ps["chosen"]["residual"] == pytest.approx(pb["chosen"]["residual"], abs=1e-6)
        removed = sum(v for i, v in ref_slices[t].items() if i in S)
        touched += removed != 0
        y = pb["chosen"]["id"]
        assert ps["chosen"]["logit"] - pb["chosen"]["logit"] == pytest.approx(-removed, abs=2e-5)
        assert ps["chosen"]["logit"] == pytest.approx(float(ref_sup[t, y]), abs=2e-5)  # the plain suppressed forward
    assert touched >= 3


def test_steer_reports_the_exact_logit_change(client, explorer):
    body = {
        "prompt": "It is a truth",
        "tokens": 8,
        "seed": 3,
        "temperature": 0.8,
        "steering": {"suppress": list(range(explorer.num_prototypes))},
    }
    d = client.post("/api/steer", json=body).json()
    assert len(d["base"]) == len(d["steered"]) == 8 and len(d["steps"]) == 8
    for s in d["steps"]:
        assert s["delta"] == pytest.approx(s["delta_from_slices"], abs=2e-5)
    # same seed and no steering: identical
    same = client.post("/api/steer", json={**body, "steering": {}}).json()
    assert same["steered"] == same["base"] and same["first_difference"] is None
    assert all(s["delta"] == 0 for s in same["steps"])
    # a concept set, by name
    c = client.post("/api/steer", json={**body, "steering": {"concept": "evens"}})
    assert c.status_code == 200, c.text
    assert client.post("/api/steer", json={**body, "steering": {"concept": "nope"}}).status_code == 422


def test_prototype_map_search_training_document(client, explorer):
    d = client.get("/api/prototype/1", params={"text": TEXT}).json()
    assert d["card"]["id"] == 1 and d["has_index"] and len(d["similar"]) == 8
    assert d["card"]["neighbours"] and "target" in d["card"]["neighbours"][0]
    assert d["fires"] is not None and len(d["text_tokens"]) > 5
    m = client.get("/api/map").json()
    K = explorer.num_prototypes
    assert len(m["x"]) == len(m["y"]) == len(m["category"]) == len(m["count"]) == K
    assert any(c >= 0 for c in m["category"]) and any(m["label"])
    s = client.get("/api/search", params={"token": " the", "limit": 5}).json()
    assert len(s["hits"]) == 5
    tr = post_training(client, {"prompt": "It is a truth", "completion": " universally", "top": 3})
    assert len(tr["items"]) == 3 and max(abs(it["relative"]) for it in tr["items"]) == pytest.approx(1.0)
    one = client.post(
        "/api/training", json={"prompt": "It is a truth", "completion": " universally", "top": 3, "token": 0}
    ).json()
    assert one["token"] == 0 and one["measured"] == tr["measured"]
    doc = client.get(f"/api/document/{tr['items'][0]['doc_index']}", params={"position": 3}).json()
    assert doc["target"] and doc["doc_id"] == tr["items"][0]["doc_id"]


@pytest.mark.parametrize(
    "method, url, body",
    [
        ("post", "/api/explain", {"text": "x" * 501}),
        ("post", "/api/explain", {"text": "a", "generate": 25}),
        ("post", "/api/explain", {"text": "a", "alternatives": 13}),
        ("post", "/api/explain", {"text": "a", "generate": -1}),
        ("post", "/api/explain", {"text": "a", "temperature": -1}),
        ("post", "/api/explain", {"text": "a", "unknown_field": 1}),
        ("post", "/api/explain", {"text": "a", "steering": {"scale": {"1": 1e9}}}),
        ("post", "/api/steer", {"prompt": "a", "tokens": 1000}),
        ("post", "/api/training", {"prompt": "a", "top": 13}),
        ("get", "/api/prototype/1?neighbours=500", None),
        ("get", "/api/search?limit=100000", None),
        ("get", "/api/prototype/abc", None),
    ],
)
def test_limits_are_4xx(client, method, url, body):
    r = client.post(url, json=body) if method == "post" else client.get(url)
    assert 400 <= r.status_code < 500, r.text
    assert r.headers["content-type"].startswith("application/json")


def test_body_size_and_unknown_ids(client, explorer):
    r = client.post(
        "/api/explain", content=b'{"text": "' + b"a" * 30_000 + b'"}', headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    K = explorer.num_prototypes
    for url in (f"/api/prototype/{K}", "/api/prototype/-1", f"/api/prototype/{10**12}"):
        r = client.get(url)
        assert r.status_code == 404, (url, r.text)
        assert r.json()["error"] == "UnknownPrototypeError"
    r = client.post("/api/steer", json={"prompt": "a", "tokens": 4, "steering": {"suppress": [K + 5]}})
    assert r.status_code == 404
    assert client.get("/api/document/999999").status_code == 404


@pytest.mark.parametrize(
    "url",
    [
        "/static/../../etc/passwd",
        "/static/%2e%2e/%2e%2e/etc/passwd",
        "/static/..%2f..%2fetc%2fpasswd",
        "/static/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "/static/%252e%252e%252fetc%252fpasswd",
        "/static/....//....//etc/passwd",
        "/static/..\\..\\etc\\passwd",
        "/static/%00app.js",
        "/static/",
        "/../../etc/passwd",
        "/etc/passwd",
        "/api/info?path=/etc/passwd",
        "/api/document/0?path=../../etc/passwd",
        "/static/app.js?file=/etc/passwd",
        "/api/map?index=/tmp",
        "/api/prototype/1?run=/etc",
    ],
)
def test_path_traversal_is_404(client, url):
    r = client.get(url)
    assert r.status_code == 404, (url, r.status_code)
    assert "root:" not in r.text


def test_foreign_host_is_refused(client):
    assert client.get("/api/info", headers={"host": "evil.example:80"}).status_code == 421
    assert client.get("/api/info", headers={"host": "localhost:8000"}).status_code == 200


def test_concurrent_requests_are_serialised_and_consistent(client):
    body = {"text": TEXT[:40], "alternatives": 2}
    with ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(lambda _: client.post("/api/explain", json=body), range(16)))
    assert all(r.status_code == 200 for r in rs)
    first = rs[0].json()["positions"]
    assert all(r.json()["positions"] == first for r in rs)


# ----- one token convention (issue 24, item 4) ---------------------------------------------------------------
def _report_spans(page: str) -> list[tuple[str | None, str]]:
    """(data-i or None, shown text) of every token span of a report's ``#text``, in document order."""
    import html
    import re

    body = page.split('<div id="text">', 1)[1].split("</div>", 1)[0]
    return [
        (m.group(2), html.unescape(m.group(3)))
        for m in re.finditer(r'<span class="t[^"]*"( data-i="(\d+)")?[^>]*>(.*?)</span>', body, re.S)
    ]


def test_token_j_means_the_prediction_of_token_j_everywhere(client, explorer):
    """API, HTML report and terminal agree: token j stands for the prediction OF token j, whose logit is
    ``logits[j − 1, ids[j]]`` of a plain forward (the reference; never the views' own numbers)."""
    import io
    import json

    from rich.console import Console

    from prismlm.explain import explain
    from prismlm.render import render_html, render_terminal

    d = client.post("/api/explain", json={"text": TEXT, "alternatives": 0}).json()
    ids, tokens = d["token_ids"], d["tokens"]
    ref = _plain_logits(explorer, ids)
    n = len(ids)
    assert [p["token_index"] for p in d["positions"]] == list(range(1, n + 1))
    for p in d["positions"][:-1]:
        j = p["token_index"]
        assert p["chosen"]["id"] == ids[j] and p["chosen"]["token"] == tokens[j]
        assert p["chosen"]["logit"] == pytest.approx(float(ref[j - 1, ids[j]]), abs=2e-5)
    # the report: span j shows token j; the position it opens has token j's logit
    expl = explain(explorer.run.model, explorer.run.tokenizer, TEXT)
    assert expl.token_ids == ids
    page = render_html(expl)
    data = json.loads(page.split('id="data">', 1)[1].split("</script>", 1)[0].replace("<\\/", "</"))
    spans = _report_spans(page)
    assert spans[0] == (None, tokens[0])  # context only, not clickable
    assert [s for _, s in spans[1:n]] == tokens[1:]
    for j in range(1, n):
        pos = data["positions"][int(spans[j][0])]
        assert (
            pos["token_index"] == j
            and pos["next_id"] == ids[j]
            and pos["logit"] == pytest.approx(float(ref[j - 1, ids[j]]), abs=2e-5)
        )
    assert "ghost" in page.split('<div id="text">', 1)[1].split("</div>", 1)[0]  # the model's own next token
    # the terminal: row "pos j" names token j first and shows its logit
    buf = io.StringIO()
    render_terminal(expl, Console(file=buf, width=200, color_system=None), max_rows=n)
    rows = {}
    for line in buf.getvalue().splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 3 and cells[1].isdigit():
            rows[int(cells[1])] = cells
    for j in range(1, n):
        tok_cell, logit_cell = rows[j][2], rows[j][3]
        assert tok_cell.startswith(repr(tokens[j].replace("\n", "↵").replace("\t", "⇥"))[:10]), (j, tok_cell)
        assert float(logit_cell) == pytest.approx(float(ref[j - 1, ids[j]]), abs=0.006)


def test_prototype_fires_mark_the_token_it_helps_predict(client, explorer):
    """``fires[].token_index`` is the token whose logit gets the slice: the prototype is active at the
    position before it in a plain forward."""
    ids = explorer.run.tokenizer.encode(TEXT)
    with torch.no_grad():
        out = explorer.run.model(torch.tensor([ids]))
    active = out.activations[0] > 0
    pid = int(out.indices[0, 3][active[3]][0])
    d = client.get(f"/api/prototype/{pid}", params={"text": TEXT}).json()
    want = {t + 1 for t in range(len(ids)) if bool(((out.indices[0, t] == pid) & active[t]).any())}
    assert {f["token_index"] for f in d["fires"]} == want and 4 in want


def _token_reference(explorer: Explorer, token_id: int, m: int = 20, signature: bool = True) -> set[int]:
    """Prototypes with ``token_id`` in the top ``m`` of W p_i or as the target / last token of one of their
    nearest contexts — prototype by prototype, from the weights and the shard directly."""
    model, idx = explorer.run.model, explorer.index
    toks = idx.shards.train.tokens
    valid = explorer.run.tokenizer.vocab_size
    want = set()
    with torch.no_grad():
        for i in range(explorer.num_prototypes):
            sig = (model.prototypes.weight[i] @ model.lm_head.weight.T)[:valid]
            ctx = [t for nb in idx.neighbours(i) for t in (int(toks[nb.offset]), nb.target_id)]
            if (signature and token_id in sig.topk(m).indices.tolist()) or token_id in ctx:
                want.add(i)
    return want


def test_token_search_finds_the_prototypes_of_a_token_not_every_one(client, explorer):
    K = explorer.num_prototypes
    tok = explorer.run.tokenizer
    # a token that is a nearest-context target of some prototype but is pushed by few (not all) of them
    idx = explorer.index
    targets = [nb.target_id for i in range(K) for nb in idx.neighbours(i)]
    counts: dict[int, int] = {}
    for t in targets:
        counts[t] = counts.get(t, 0) + 1
    token_id = min(counts, key=lambda t: (counts[t], t))
    text = tok.id_to_token(token_id)
    want = _token_reference(explorer, token_id)
    s = client.get("/api/search", params={"token": text, "limit": 12}).json()
    assert set(s["ids"]) == want and s["matched"] == len(want)
    assert 0 < len(want) < K  # found, and not everything matches
    assert all(text in h["why"] or repr(text) in h["why"] for h in s["hits"])
    # the hits come first by the number of contexts holding the token
    ctx_hits = [h for h in s["hits"] if "contexts" in h["why"]]
    assert ctx_hits and s["hits"][: len(ctx_hits)] == ctx_hits
    # typed without its leading space, a word finds its " word" token too
    word = next(
        t
        for t in sorted(counts, key=lambda t: -counts[t])
        if tok.id_to_token(t).startswith(" ") and len(tok.encode(tok.id_to_token(t)[1:])) > 1
    )
    bare = client.get("/api/search", params={"token": tok.id_to_token(word)[1:], "limit": 12}).json()
    assert set(bare["ids"]) == _token_reference(explorer, word)


def test_steer_names_the_steered_prototypes_that_never_fire(client, explorer):
    """Greedy generation under ``model.suppress(S)`` is the reference text; a plain forward over it says which
    prototypes are active; the others of S are the ones steering cannot touch."""
    m, tok = explorer.run.model, explorer.run.tokenizer
    prompt, n = "It is a truth", 8
    K = explorer.num_prototypes
    S = list(range(K))
    x = torch.tensor([tok.encode(prompt)])
    with torch.no_grad(), m.suppress(S):
        seq = m.generate(x, n, temperature=0)[0].tolist()
    with torch.no_grad():
        out = m(torch.tensor([seq[:-1]]))
    active = set(out.indices[0][out.activations[0] > 0].tolist())
    want = sorted(set(S) - active)
    assert 0 < len(want) < K
    d = client.post(
        "/api/steer", json={"prompt": prompt, "tokens": n, "temperature": 0, "steering": {"suppress": S}}
    ).json()
    assert d["steered_ids"] == K and d["inactive"] == want
    assert any(f"{len(want)} of the {K} steered prototypes never fire" in note for note in d["notes"])
    # only prototypes that never fire on the base text: nothing can change, and the answer says which
    with torch.no_grad():
        base = m.generate(x, n, temperature=0)[0].tolist()
        out = m(torch.tensor([base[:-1]]))
    idle_ids = sorted(set(range(K)) - set(out.indices[0][out.activations[0] > 0].tolist()))[:5]
    idle = client.post(
        "/api/steer", json={"prompt": prompt, "tokens": n, "temperature": 0, "steering": {"suppress": idle_ids}}
    ).json()
    assert idle["first_difference"] is None and idle["inactive"] == idle_ids and idle["steered_ids"] == 5


def test_training_shares_add_up_to_one(client):
    """Each listed prototype's share is its contribution over Σ|listed| + |rest|, rest = score − Σ listed (the
    unlisted prototypes' net): signed, |shares| + |rest share| = 1, none beyond ±100%."""
    tr = post_training(client, {"prompt": "It is a truth universally", "completion": " acknowledged, that", "top": 8})
    assert tr["items"] and "+" not in tr["method"]
    for it in tr["items"]:
        cs = [p["contribution"] for p in it["prototypes"]]
        assert sum(cs) + it["rest"] == pytest.approx(it["score"], rel=1e-6, abs=1e-12)
        shares = [p["share"] for p in it["prototypes"]]
        assert sum(abs(s) for s in shares) + abs(it["rest_share"]) == pytest.approx(1.0)
        for c, s in zip(cs, shares):
            assert -1 <= s <= 1 and (s >= 0) == (c >= 0)


def test_prototype_card_pushes_down_logit_histogram_and_bands(client, explorer):
    """The tokens a prototype pushes down most, the histogram of W p_i over the vocabulary and examples in
    activation intervals of its sampled firings — each against the weights / the index directly."""
    import numpy as np

    i = int(explorer.index.counts.argmax())
    d = client.get(f"/api/prototype/{i}").json()
    valid = explorer.run.tokenizer.vocab_size
    m = explorer.run.model
    with torch.no_grad():
        sig = (m.prototypes.weight[i].double() @ m.lm_head.weight.double().T)[:valid]  # (V,)
    low = sig.argsort()[:12].tolist()
    got = d["card"]["bottom_tokens"]
    assert [t for t, _ in got] == [explorer.run.tokenizer.id_to_token(t) for t in low]
    assert [v for _, v in got] == pytest.approx(sig[low].tolist(), abs=1e-4)
    assert all(v < 0 for _, v in got) and got[0][1] < got[-1][1]  # most negative first
    h = d["logit_histogram"]
    assert sum(h["counts"]) == valid and h["lo"] == pytest.approx(float(sig.min()), abs=1e-5)
    assert h["hi"] == pytest.approx(float(sig.max()), abs=1e-5)
    ref, _ = np.histogram(sig.numpy(), bins=len(h["counts"]), range=(h["lo"], h["hi"]))
    assert np.abs(np.array(h["counts"]) - ref).sum() <= 2  # bin-edge rounding at most
    offs, acts = explorer.index.sample.row(i)  # the index's uniform sample of its firings
    sample = dict(zip(offs, acts))
    bands = d["bands"]
    assert len(bands) == 4 and all(b["kind"] == "activation" and b["sampled"] == len(offs) for b in bands)
    assert bands[0]["interval"][1] == max(acts) and bands[0]["fired"] == int(explorer.index.counts[i])
    assert sum(b["count"] for b in bands) == len(offs) > 0
    for b in bands:
        lo, hi = b["interval"]
        assert b["count"] == sum(lo < a <= hi for a in acts) and len(b["examples"]) == min(3, b["count"])
        assert all(lo < e["activation"] <= hi and sample[e["offset"]] == e["activation"] for e in b["examples"])


def test_a_plain_search_for_a_word_finds_the_prototypes_of_its_token(client, explorer):
    """ "President" on presidential speeches: a one-token query finds the prototypes of that token even when
    no label and no first nearest context contains it (the label/context search alone found 0)."""
    tok = explorer.run.tokenizer
    idx = explorer.index
    labs = explorer.labels()
    texts = explorer.neighbour_texts()
    counts: dict[int, int] = {}
    for i in range(explorer.num_prototypes):
        for nb in idx.neighbours(i):
            counts[nb.target_id] = counts.get(nb.target_id, 0) + 1
    # a word token that no label and no searched neighbour text contains
    word = next(
        t
        for t in sorted(counts, key=lambda t: (-counts[t], t))
        if tok.id_to_token(t).strip().isalpha()
        and len(tok.id_to_token(t).strip()) > 2
        and not any(
            tok.id_to_token(t).strip().lower() in (f"{lab.get('label', '')} {lab.get('category', '')} {txt}").lower()
            for lab, txt in ((labs.get(i, {}), texts[i]) for i in range(explorer.num_prototypes))
        )
    )
    q = tok.id_to_token(word).strip()
    s = client.get("/api/search", params={"q": q, "limit": 12}).json()
    assert s["matched"] > 0 and set(s["ids"]) >= _token_reference(explorer, word, signature=False)
    assert all("nearest contexts" in h["why"] for h in s["hits"])  # by context only: no K × V table for it


def test_the_result_types_describe_the_json(client, explorer):
    """Issue 25: every view's JSON has exactly the fields its dataclass and typed rows declare, in that order
    (the front end and scripts read these names; the types are their documentation)."""
    import dataclasses
    from typing import get_type_hints

    from prismlm.app.explorer import bank, explain, info, prototype, steer, training
    from prismlm.app.explorer.steer import SteeringDict
    from prismlm.app.prototype_view import ActivationBand, LogitHistogram

    def keys(t: type) -> list[str]:
        return [f.name for f in dataclasses.fields(t)] if dataclasses.is_dataclass(t) else list(get_type_hints(t))

    def same(d: dict, t: type) -> None:
        assert list(d) == keys(t), (t.__name__, list(d))

    body = {"text": TEXT, "alternatives": 2, "steering": {"suppress": [1], "scale": {"2": 0.5}}}
    e = client.post("/api/explain", json=body).json()
    same(e, explain.ExplainView)
    same(e["steering"], SteeringDict)
    pos = e["positions"][3]
    same(pos, explain.PositionView)
    same(pos["chosen"], explain.Candidate)
    same(pos["active"][0], explain.ActivePrototype)
    same(client.get("/api/info").json(), info.RunInfo)
    same(client.get("/api/info").json()["model"], info.ModelShape)
    same(client.get("/api/info").json()["concepts"]["evens"], info.ConceptInfo)
    p = client.get(f"/api/prototype/{pos['active'][0]['id']}", params={"text": TEXT}).json()  # fires in TEXT
    same(p, prototype.PrototypeDetail)
    same(p["similar"][0], prototype.SimilarPrototype)
    same(p["fires"][0], prototype.Fire)
    same(p["logit_histogram"], LogitHistogram)
    same(p["bands"][0], ActivationBand)  # a new index holds the activation sample
    same(client.get("/api/map").json(), bank.MapView)
    s = client.get("/api/search", params={"q": "", "limit": 3}).json()
    same(s, bank.SearchView)
    same(s["hits"][0], bank.SearchHit)
    st = client.post("/api/steer", json={"prompt": TEXT, "tokens": 4, "steering": {"concept": "evens"}}).json()
    same(st, steer.SteerView)
    same(st["steps"][0], steer.SteerStep)
    changed = [c for step in st["steps"] for c in step["changed"]]
    assert changed, "suppressing half the bank changes some slice"
    same(changed[0], steer.ChangedSlice)
    tr = post_training(client, {"prompt": "It is a truth", "completion": " universally", "top": 2})
    same(tr, training.TrainingView)
    same(tr["measured"][0], training.MeasuredToken)
    same(tr["items"][0], training.TrainingItem)
    same(tr["items"][0]["prototypes"][0], training.ItemPrototype)
    same(client.get(f"/api/document/{tr['items'][0]['doc_index']}").json(), training.DocumentView)
