"""Labels from what a prototype does (issue 35, item 4): a rule label leads with the tokens W p_i pushes up
most, carries a quality score (how often one of those is the next token where the prototype fires) shown on
cards, in `prism prototypes` and on the map; a token search ranks by push and matches only prototypes that
push the token. Checked against the weights and the index's neighbours directly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_explorer_api import LIMITS, build_explorer_run

from prismlm.app import Run
from prismlm.app.explorer import Explorer
from prismlm.app.operations import find_prototypes
from prismlm.explain import pushed_tokens, rule_labels, save_labels


@pytest.fixture(scope="module")
def labelled(tiny_shards, tmp_path_factory):
    folder, _ = build_explorer_run(tiny_shards, tmp_path_factory.mktemp("labels"))
    run = Run.open(folder, device="cpu")
    idx = run.index()
    pushes = pushed_tokens(run.model, vocab_size=run.tokenizer.vocab_size)
    labs = rule_labels(idx, pushes=pushes)
    return run, idx, pushes, labs


def test_pushed_tokens_are_the_top_of_the_signature(labelled):
    run, _, pushes, _ = labelled
    m = run.model
    with torch.no_grad():
        sig = (m.prototypes.weight @ m.lm_head.weight.T)[:, : run.tokenizer.vocab_size]  # (K, V)
    assert pushes == sig.topk(3, dim=-1).indices.tolist()


def test_a_rule_label_leads_with_what_it_pushes_and_scores_itself(labelled):
    run, idx, pushes, labs = labelled
    tok = run.tokenizer
    for i in (0, 5, 17):
        shown = "↑ " + "|".join(json.dumps(tok.decode([t]), ensure_ascii=False) for t in pushes[i])
        assert labs[i]["label"].removeprefix("(dead) ").startswith(shown)
        nbs = idx.neighbours(i, None, before=0, after=0)
        want = sum(int(nb.target_id) in pushes[i] for nb in nbs) / len(nbs)
        assert labs[i]["quality"] == pytest.approx(want) and labs[i]["evidence"]["quality"] == labs[i]["quality"]
    assert any(0 < lab["quality"] for lab in labs.values())  # not vacuous


def test_quality_is_on_cards_listings_and_the_map(labelled, tmp_path):
    run, _, _, labs = labelled
    copy = tmp_path / "run"  # the run is shared with other tests: its labels are written on a copy
    shutil.copytree(run.path, copy)
    save_labels(labs, copy / "index")
    listing = find_prototypes(Run.open(copy, device="cpu"), limit=5)
    assert all(r.quality == labs[r.id]["quality"] for r in listing.rows)
    ex = Explorer.open(copy, device="cpu", limits=LIMITS)
    assert ex.prototype(3).card["evidence"]["quality"] == labs[3]["quality"]
    assert ex.map().quality == [labs[i].get("quality") for i in range(ex.num_prototypes)]


def test_a_token_search_matches_the_prototypes_that_push_it_strongest_first(labelled):
    run, _, _, _ = labelled
    m, tok = run.model, run.tokenizer
    token = " the"
    t = tok.encode(token)[0]
    with torch.no_grad():
        sig = (m.prototypes.weight @ m.lm_head.weight.T)[:, : tok.vocab_size].float()
    rank = (sig > sig[:, t : t + 1]).sum(-1)
    pushing = [i for i in range(sig.shape[0]) if int(rank[i]) < 20]
    res = find_prototypes(run, token=token, limit=4)
    assert res.matched == len(pushing) < sig.shape[0]  # not "512 of 512 match"
    want = sorted(pushing, key=lambda i: -float(sig[i, t]))[:4]
    assert [r.id for r in res.rows] == want
