"""Tools that say when they did nothing (issue 35, item 3): a suppression set, a steering or a controller
reports which of its prototypes are active on the text, and warns when none is — on the text, or where the
concept's target token is predicted. Checked against an independent forward of the model."""

from __future__ import annotations

import pytest
import torch
from test_explorer_api import LIMITS, build_explorer_run

from prismlm.app import Run
from prismlm.app.control import intervention_activity
from prismlm.app.explorer import Explorer, Steering
from prismlm.app.operations import explain_text, generate
from prismlm.control.activity import prototype_activity
from prismlm.control.suppress import SuppressionSet
from prismlm.model.generation import GREEDY

TEXT = "It is a truth universally acknowledged, that a single man"


@pytest.fixture(scope="module")
def folder(tiny_shards, tmp_path_factory):
    return build_explorer_run(tiny_shards, tmp_path_factory.mktemp("activity"))[0]


def _set(run: Run, ids: list[int], targets: list[int], path):
    """A suppression set of ``ids`` recording ``targets`` as its concept's target tokens, saved at ``path``."""
    K = run.model.require_prototypes().num_prototypes
    sset = SuppressionSet(ids=ids, num_prototypes=K, model_sha256=run.identity, concept="test")
    sset.meta["target_tokens"] = targets
    return sset.save(path)


def _forward(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n,) next tokens, (n,) most probable tokens and (n, K) which prototypes are active at each position,
    from a plain forward."""
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    on = torch.zeros(len(ids), model.require_prototypes().num_prototypes, dtype=torch.bool)
    for t in range(len(ids)):
        on[t, out.indices[0, t][out.activations[0, t] > 0]] = True
    return torch.tensor(ids[1:] + [-1]), out.logits[0].argmax(-1), on


def test_prototypes_inactive_where_the_target_is_predicted_are_reported(tiny_shards):
    from test_control import _concept_model

    tok, model = tiny_shards.tokenizer, _concept_model(top_k=2)
    ids = tok.encode(TEXT)
    nxt, top, on = _forward(model, ids)

    def where(target: int) -> torch.Tensor:  # the positions predicting it: the text's next token or the model's
        return (nxt == target) | (top == target)

    def elsewhere_of(target: int) -> list[int]:  # active on the text, but not where the target is predicted
        return (on.any(0) & ~on[where(target)].any(0)).nonzero().squeeze(1).tolist()

    target = next(int(y) for y in nxt[:-1] if elsewhere_of(int(y)))
    at, elsewhere = where(target), elsewhere_of(target)
    act = prototype_activity(model, elsewhere[:3], ids, targets=[target], tokenizer=tok)
    assert act.ids == act.active == sorted(elsewhere[:3]) and act.active_at_targets == []
    assert act.target_positions == int(at.sum()) and act.targets == [tok.id_to_token(target)]
    assert "is predicted" in (act.warning() or "")
    hit = on[at].any(0).nonzero().squeeze(1).tolist()[:1]  # one that fires where it is predicted: no warning
    good = prototype_activity(model, hit, ids, targets=[target], tokenizer=tok)
    assert good.active_at_targets == hit and good.warning() is None
    never = (~on.any(0)).nonzero().squeeze(1).tolist()[:2]
    assert "active on this text" in (prototype_activity(model, never, ids).warning() or "")


def test_a_suppression_that_never_fires_is_reported_by_explain_and_generate(folder, tmp_path):
    plain = Run.open(folder, device="cpu", suppress="none")
    ids = plain.tokenizer.encode(TEXT)
    _, _, on = _forward(plain.model, ids)
    never = (~on.any(0)).nonzero().squeeze(1).tolist()[:2]
    run = Run.open(folder, device="cpu", suppress=_set(plain, never, [ids[3]], tmp_path / "never.json"))
    act = intervention_activity(run, ids)
    assert act.ids == never and act.active == [] and act.targets == [plain.tokenizer.id_to_token(ids[3])]
    expl = explain_text(run, TEXT)
    assert any(n.startswith("warning: none of the 2 suppressed prototypes is active on this text") for n in expl.notes)
    out = generate(run, TEXT, tokens=4, sampling=GREEDY)
    assert any("none of the 2 suppressed prototypes is active on this text" in n for n in out.notes)


def test_the_cli_warns_when_the_suppression_did_nothing(folder, tmp_path):
    from typer.testing import CliRunner

    from prismlm.cli import app

    plain = Run.open(folder, device="cpu", suppress="none")
    _, _, on = _forward(plain.model, plain.tokenizer.encode(TEXT))
    never = (~on.any(0)).nonzero().squeeze(1).tolist()[:2]
    path = tmp_path / "never.json"
    _set(plain, never, [], path)
    res = CliRunner().invoke(
        app,
        [
            "generate",
            str(folder),
            "--prompt",
            TEXT,
            "--tokens",
            "3",
            "--temperature",
            "0",
            "--suppress",
            str(path),
            "--device",
            "cpu",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "none of the 2 suppressed prototypes is active on this text" in res.output


def test_steer_and_explain_report_the_activity_of_their_prototypes(folder, tmp_path):
    plain = Run.open(folder, device="cpu", suppress="none")
    ids = plain.tokenizer.encode(TEXT)
    _, _, on = _forward(plain.model, ids)
    never = (~on.any(0)).nonzero().squeeze(1).tolist()[:2]
    ex = Explorer(plain, limits=LIMITS)
    d = ex.explain(TEXT, steering=Steering(suppress=tuple(never)), alternatives=1)
    assert d.activity is not None and d.activity.ids == never and d.activity.active == []
    assert d.to_dict()["activity"]["ids"] == never
    assert any(n.startswith("warning: none of the 2 steered prototypes is active on this text") for n in d.notes)
    view = ex.steer(TEXT, steering=Steering(suppress=(0, 1)), tokens=4, sampling=GREEDY)
    assert view.activity is not None and view.activity.ids == [0, 1]
    assert set(view.activity.active) <= {0, 1}


def test_a_controller_reports_its_prototypes_on_the_test_examples(folder):
    from prismlm.app.control import controller_activity

    run = Run.open(folder, device="cpu", suppress="none")
    docs = [
        {"id": str(j), "query": q, "choices": [" universally", " never"], "gold": 0, "label": "x"}
        for j, q in enumerate(["It is a truth", "We the people"])
    ]
    fires = set()
    for d in docs:  # independently: which prototypes are active where the right answer's first token comes next
        ids = run.tokenizer.encode(d["query"]) + run.tokenizer.encode(d["choices"][0])
        n = len(run.tokenizer.encode(d["query"]))
        _, _, on = _forward(run.model, ids)
        fires |= set(on[n - 1].nonzero().squeeze(1).tolist())
    some, never = sorted(fires)[:1], [i for i in range(64) if i not in fires][:1]
    _, _, on_all = _forward(run.model, run.tokenizer.encode("It is a truth universally"))
    assert not on_all[:, never[0]].any()
    act = controller_activity(run, some + never, docs)
    assert act.ids == sorted(some + never) and some[0] in act.active_at_targets and never[0] not in act.active
    assert act.target_positions >= len(docs) and act.warning("controlled") is None
    assert "active on this text" in (controller_activity(run, never, docs).warning("controlled") or "")
