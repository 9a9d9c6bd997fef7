"""Beyond the dashboards (issue 35, item 6): the competing token picked by typing it, and the residual slice as
an object of its own — each number checked against the weights and a plain forward, never against the API."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from test_explorer_api import BASE, LIMITS, TEXT, _plain_logits, _reference_slices, build_explorer_run  # noqa: E402

from prismlm.app.explorer import Explorer  # noqa: E402
from prismlm.web.server import create_app  # noqa: E402


@pytest.fixture(scope="module")
def explorer(tiny_shards, tmp_path_factory) -> Explorer:
    run, _ = build_explorer_run(tiny_shards, tmp_path_factory.mktemp("explorer"))
    return Explorer.open(run, device="cpu", limits=LIMITS)


def test_any_typed_token_is_split_like_an_alternative(explorer):
    tok = explorer.run.tokenizer
    ids = tok.encode(TEXT)
    k = 6  # the token at index 6, predicted at position 5
    logits = _plain_logits(explorer, ids)
    typed = int(logits[k - 1, : tok.vocab_size].argmin())  # the least probable token: never among the top 5
    view = explorer.contrast(ids, k, tok.decode([typed])).view
    c = view.chosen
    assert c.id == typed and c.rank > 5
    assert c.logit == pytest.approx(float(logits[k - 1, typed]), abs=1e-4)
    slices, resid = _reference_slices(explorer, ids[:k], ids[1:k] + [typed])
    assert {a["id"]: s for a, s in zip(view.active, c.slices)} == pytest.approx(slices[-1], abs=1e-4)
    assert c.residual == pytest.approx(resid[-1], abs=1e-4)
    assert sum(c.slices) + c.residual + c.bias == pytest.approx(c.logit, abs=1e-4)


def test_a_typed_string_of_two_tokens_is_refused(explorer):
    client = TestClient(create_app(explorer), base_url=BASE)
    ids = explorer.run.tokenizer.encode(TEXT)
    res = client.post("/api/contrast", json={"token_ids": ids, "token_index": 3, "token": " universally acknowledged"})
    assert res.status_code == 422 and "one token" in res.json()["message"]
    ok = client.post("/api/contrast", json={"token_ids": ids, "token_index": 3, "token": " the"})
    assert ok.status_code == 200 and ok.json()["view"]["chosen"]["token"] == " the"


def test_the_residual_as_an_object(explorer):
    m, tok = explorer.run.model, explorer.run.tokenizer
    ids = tok.encode(TEXT)
    k = 6
    r = explorer.residual(ids, k, answer_from=4, top=5)
    with torch.no_grad():
        out = m(torch.tensor([ids[:-1]]))
        res = out.residual[0, k - 1].double()
        W, P = m.lm_head.weight.double(), m.prototypes.weight.double()
    push = (W @ res)[: tok.vocab_size]
    assert r.residual_slice == pytest.approx(float(push[ids[k]]), abs=1e-4)
    assert [t for t, _ in r.pushes_up] == [tok.id_to_token(int(i)) for i in push.topk(5).indices]
    cos = (P @ res) / (P.norm(dim=-1) * res.norm())
    assert [a["id"] for a in r.anchors] == cos.topk(5).indices.tolist()
    assert all(a["target"] or a["before"] for a in r.anchors)  # each with its nearest training context
    slices, resid = _reference_slices(explorer, ids[:-1], ids[1:])
    shares = [abs(q) / (sum(abs(v) for v in s.values()) + abs(q)) for s, q in zip(slices, resid)]
    assert r.residual_share == pytest.approx(shares[k - 1], abs=1e-5)
    assert r.answer_share == pytest.approx(sum(shares[3:]) / len(shares[3:]), abs=1e-5)
    assert r.answer_tokens == len(shares[3:])
