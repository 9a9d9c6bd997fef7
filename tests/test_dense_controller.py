"""prismlm.control.dense and prismlm.control.compare (issue 37, controllers on what the model can do) against
independent references: the dense controller's scores written out as z + Σ c_j (u_j·z) u_j through a plain
full softmax, its basis against an eigendecomposition of the covariance, its size against what it claims; a
task the base model gets wrong on a principal direction that the dense controller learns to flip; the screen's
verdicts on tasks built to be at chance, above it, prior-dominated and at a ceiling; the test split never
shaping a fit; ``side_row``'s paired counts by hand; the new tasks' splits disjoint by source document."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prismlm.control.compare import (
    FitProtocol,
    ScreenConfig,
    SideFit,
    baselines,
    fit_dense_side,
    fit_side,
    screen_task,
    side_row,
)
from prismlm.control.controller import ControlFeatures, Controller, accuracy
from prismlm.control.dense import (
    DenseControlConfig,
    matched_directions,
    pca_directions,
    random_directions,
)
from prismlm.control.surrogate import TaskFeatures, base_pass, encoded, exact_scores
from prismlm.errors import ConfigError
from prismlm.eval.tasks import SPLITS, TaskSpec, build_from_spec, build_task

V, D = 80, 6  # V ≥ TOP_TOKENS (the base pass keeps that many)


def _W() -> torch.Tensor:
    """The head: token 0 reads +e0, token 1 reads −e0, the rest small random rows."""
    W = 0.1 * torch.randn(V, D, generator=torch.Generator().manual_seed(7))
    W[0], W[1] = 0.0, 0.0
    W[0, 0], W[1, 0] = 4.0, -4.0
    return W


def _features(z: torch.Tensor, gold: torch.Tensor, texts: tuple[str, str] = ("a", "b")) -> TaskFeatures:
    """Two one-token choices per example (targets 0 and 1), both scored from the example's hidden state z (D,)."""
    n = len(z)
    f = ControlFeatures(
        z=z.repeat_interleave(2, 0).float(),
        indices=torch.empty(0, dtype=torch.long),
        activations=torch.empty(0),
        targets=torch.tensor([0, 1]).repeat(n),
        request=torch.arange(2 * n),
        doc_of_request=torch.arange(n).repeat_interleave(2),
        gold=gold,
        choice_len=torch.ones(2 * n, dtype=torch.float64),
        n_choices=[2] * n,
        choice_text=list(texts) * n,
    )
    return TaskFeatures(**vars(f) | base_pass(f, _W()))


def _flipped_task(n: int, seed: int) -> TaskFeatures:
    """e0 is the hidden state's top-variance direction and carries the label with the wrong sign: the base
    model (which reads +e0 for choice 0) is wrong on every example; scaling z's e0 component by (1 + c) with
    c < −1 makes it right on every one."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    z = 0.05 * torch.randn(n, D, generator=g)
    z[:, 0] = torch.where(y == 0, -0.5, 0.5) + 0.05 * torch.randn(n, generator=g)  # gold 0 ↔ negative e0
    return _features(z, y)


def _splits() -> dict[str, TaskFeatures]:
    return {"train": _flipped_task(40, 0), "validation": _flipped_task(24, 1), "test": _flipped_task(30, 2)}


PROTOCOL = FitProtocol(l1_grid=(1e-4, 1e2), steps=120, lr=0.1, surrogate_vocab=4)


# ----- the basis and the controller's size ----------------------------------------------------------------------
def test_pca_directions_are_the_covariance_eigenvectors_and_random_ones_are_orthonormal():
    z = torch.randn(200, D, generator=torch.Generator().manual_seed(0)) * torch.tensor([3.0, 2.0, 1.5, 1, 0.5, 0.2])
    U = pca_directions(z, 3).double()
    evals, evecs = torch.linalg.eigh(torch.cov(z.double().T))  # ascending
    ref = evecs[:, -3:].flip(1).T  # (3, D) by decreasing variance
    torch.testing.assert_close(U.abs(), ref.abs(), rtol=0, atol=1e-5)
    torch.testing.assert_close(U @ U.T, torch.eye(3, dtype=torch.float64), rtol=0, atol=1e-5)
    assert (U.gather(1, U.abs().argmax(1, keepdim=True)) > 0).all()  # the fixed sign
    R = random_directions(D, 4, seed=3).double()
    torch.testing.assert_close(R @ R.T, torch.eye(4, dtype=torch.float64), rtol=0, atol=1e-5)
    assert torch.equal(random_directions(D, 4, seed=3), random_directions(D, 4, seed=3))
    assert not torch.equal(random_directions(D, 4, seed=3), random_directions(D, 4, seed=4))


def test_matched_size_and_config_checks():
    cfg = DenseControlConfig()
    assert matched_directions(5, D, cfg) == 5 and matched_directions(0, D, cfg) == 1
    assert matched_directions(50, D, cfg) == D  # the full basis is the largest dense controller there is
    assert matched_directions(50, D, DenseControlConfig(num_directions=2)) == 2
    with pytest.raises(ConfigError, match="num_directions"):
        matched_directions(1, D, DenseControlConfig(num_directions=D + 1))
    for bad in ({"basis": "ica"}, {"num_directions": 0}, {"min_directions": 0}):
        with pytest.raises(ConfigError):
            DenseControlConfig(**bad)
    assert DenseControlConfig(basis="random", num_directions=8, seed=2).describe() == "random-8-s2"
    for bad_p in ({"l1_grid": ()}, {"steps": 0}, {"lr": 0.0}):
        with pytest.raises(ConfigError):
            FitProtocol(**{"l1_grid": (1e-3,), "steps": 1, "lr": 0.1, "surrogate_vocab": 4, **bad_p})


@pytest.mark.parametrize("basis", ["pca", "random"])
def test_the_dense_controller_has_the_parameters_it_claims_and_scores_as_written(basis):
    splits = _splits()
    cfg = DenseControlConfig(basis=basis, seed=1)
    fit, b = fit_dense_side(splits, _W(), support=3, cfg=cfg, p=PROTOCOL)
    assert b.num_parameters == fit.num_parameters == 3 and b.directions.shape == (3, D)
    assert fit.controller.coefficients.shape == (3,) and fit.support <= 3
    assert fit.features["train"].indices.shape == (len(splits["train"].z), 3)  # every direction active everywhere
    # the exact scores under c, against z' = z + Σ c_j (u_j·z) u_j through the plain full softmax
    c = torch.tensor([0.7, -1.3, 0.4], dtype=torch.float64)
    test = splits["test"]
    U, z = b.directions.double(), test.z.double()
    z2 = z + ((z @ U.T) * c) @ U
    tok = F.log_softmax(z2 @ _W().double().T, -1).gather(-1, test.targets[:, None]).squeeze(-1)
    ref = torch.zeros(len(test.doc_of_request), dtype=torch.float64).index_add(0, test.request, tok)
    got = exact_scores(encoded(test, b.encode), _W(), b.directions, c.float())
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    # and c = 0 is the base model exactly
    torch.testing.assert_close(exact_scores(encoded(test, b.encode), _W(), b.directions, torch.zeros(3)),
                               exact_scores(test, _W(), _W()[:1], None), rtol=0, atol=0)  # fmt: skip


# ----- behaviour --------------------------------------------------------------------------------------------
def test_the_dense_controller_fits_a_task_on_a_principal_direction():
    splits = _splits()
    base = baselines(splits, _W())
    assert base.base["acc"] == 0.0  # the base model reads e0 with the wrong sign everywhere
    fit, b = fit_dense_side(splits, _W(), support=1, cfg=DenseControlConfig(), p=PROTOCOL)
    assert abs(float(b.directions[0, 0])) > 0.99  # the top principal direction is e0
    assert fit.after["acc"] == 1.0 and fit.controller.l1 == 1e-4  # λ by validation: the huge one fits nothing
    assert float(fit.controller.coefficients[0]) < -1  # it flips the e0 component
    row = side_row(fit, base, seed=0)
    n, paired = len(splits["test"].gold), row["paired_vs_base"]
    assert isinstance(paired, dict) and row["delta_acc"] == 1.0 and paired["gained"] == n and paired["lost"] == 0
    assert paired["mcnemar_p"] == pytest.approx(2 / 2**n)
    # the same fit path with a random basis of one direction cannot reach e0: it does worse
    weak, _ = fit_dense_side(splits, _W(), 1, DenseControlConfig(basis="random", seed=5), PROTOCOL)
    assert weak.after["acc"] < fit.after["acc"]


def test_the_test_split_never_shapes_a_fit():
    splits = _splits()
    other = {**splits, "test": _flipped_task(30, 9)}  # other test data: same basis, same controller
    a, ba = fit_dense_side(splits, _W(), 2, DenseControlConfig(), PROTOCOL)
    b, bb = fit_dense_side(other, _W(), 2, DenseControlConfig(), PROTOCOL)
    assert torch.equal(ba.directions, bb.directions)
    assert torch.equal(a.controller.coefficients, b.controller.coefficients)
    # while the training split does shape it
    c, bc = fit_dense_side({**splits, "train": _flipped_task(40, 11)}, _W(), 2, DenseControlConfig(), PROTOCOL)
    assert not torch.equal(ba.directions, bc.directions)


def test_fit_side_takes_any_code():
    """The prototype/SAE path: a fixed sparse code (one unit per token, direction e0) fitted like the dense one."""
    splits = _splits()

    def enc(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(len(z), 1, dtype=torch.long), z[:, :1].abs()

    e0 = torch.zeros(2, D)
    e0[0, 0] = 1.0
    fit = fit_side(splits, enc, e0, _W(), PROTOCOL)
    assert fit.num_parameters == 2 and fit.support <= 1
    assert fit.after == accuracy(splits["test"], fit.test_scores)


# ----- screening --------------------------------------------------------------------------------------------
def _scored(n: int, p_right: float, seed: int, texts: tuple[str, str] = ("a", "b"), gold_first: bool = False):
    """Features of n two-choice examples and base scores right on a share ``p_right`` of them."""
    g = torch.Generator().manual_seed(seed)
    gold = torch.zeros(n, dtype=torch.long) if gold_first else torch.randint(0, 2, (n,), generator=g)
    right = torch.rand(n, generator=g) < p_right
    f = _features(torch.zeros(n, D), gold, texts)
    s = torch.zeros(2 * n, dtype=torch.float64)
    win = torch.where(right, gold, 1 - gold)
    s[2 * torch.arange(n) + win] = 1.0
    return f, s


def test_screen_keeps_a_task_above_chance_and_drops_one_at_chance():
    cfg = ScreenConfig(min_margin=0.05, max_p=0.01)
    train, ts = _scored(60, 0.8, 0)
    val, vs = _scored(80, 0.8, 1)
    row = screen_task("good", train, ts, val, vs, cfg)
    acc = accuracy(val, vs)["acc"]
    assert row["kept"] and row["reason"] == "kept" and row["validation_acc"] == acc > 0.7
    assert row["chance"] == 0.5 and row["n"] == 80
    flat_t, fts = _scored(60, 0.5, 2)
    flat_v, fvs = _scored(80, 0.5, 3)
    at = screen_task("flat", flat_t, fts, flat_v, fvs, cfg)
    assert not at["kept"] and at["reason"] in ("not above chance", "p")
    assert not screen_task("good", train, ts, val, vs, ScreenConfig(max_acc=0.7))["kept"]  # a ceiling
    assert screen_task("good", train, ts, val, vs, ScreenConfig(max_acc=0.7))["reason"] == "ceiling"


def test_screen_drops_a_task_the_choice_prior_does_better():
    """Gold is always the answer "yes" (a fixed label set) and the model is right on 60%: a bias toward "yes"
    fitted on train is right everywhere on validation — the prior is the whole story."""
    train, ts = _scored(60, 0.6, 4, texts=("yes", "no"), gold_first=True)
    val, vs = _scored(200, 0.6, 5, texts=("yes", "no"), gold_first=True)
    row = screen_task("prior", train, ts, val, vs, ScreenConfig(min_margin=0.05, max_p=0.05))
    assert row["prior_validation_acc"] == 1.0 and not row["kept"] and row["reason"] == "prior"
    assert screen_task("prior", train, ts, val, vs, ScreenConfig(min_margin=0.05, max_p=0.05, max_prior_gain=1))["kept"]


def test_screen_config_checks():
    for bad in ({"min_margin": -0.1}, {"max_p": 0.0}, {"max_prior_gain": 2.0}, {"max_acc": 0.0}):
        with pytest.raises(ConfigError):
            ScreenConfig(**bad)


# ----- side rows and splits ---------------------------------------------------------------------------------
def test_side_row_counts_by_hand():
    f, s = _scored(4, 1.0, 6)
    base = baselines({"train": f, "test": f}, _W())
    right = torch.tensor([True, False, True, True])
    fit = SideFit(Controller(torch.tensor([0.0, 2.0]), 0.1), [], {}, s, right,
                  {"acc": 0.75, "acc_norm": 0.75, "n": 4}, 2, {})  # fmt: skip
    base_right = base.base_correct
    row = side_row(fit, base, seed=0)
    gained = int((right & ~base_right).sum())
    lost = int((~right & base_right).sum())
    paired = row["paired_vs_base"]
    assert isinstance(paired, dict) and paired["gained"] == gained and paired["lost"] == lost
    assert row["delta_acc"] == pytest.approx(0.75 - float(base_right.double().mean()))
    assert row["nonzero"] == 1 and row["parameters"] == 2 and row["l1"] == 0.1


def test_splits_are_disjoint_by_group_and_answers_stay_in_their_split():
    raw = [(f"g{i % 23}", f"g{i % 23}/e{i}", f"passage {i}", f"answer {i}") for i in range(120)]
    spec = TaskSpec(lambda: iter(raw), "{passage}", 3, answers_per_example=True)
    splits = build_from_spec(spec, {s: 1000 for s in SPLITS})
    groups = {s: {d["id"].split("/")[0] for d in docs} for s, docs in splits.items()}
    assert sum(len(v) for v in splits.values()) == 120
    assert not (groups["test"] & (groups["train"] | groups["validation"])) and not (
        groups["train"] & groups["validation"]
    )
    answers = {s: {d["label"] for d in docs} for s, docs in splits.items()}
    for s, docs in splits.items():
        assert all(c.strip() in answers[s] for d in docs for c in d["choices"])  # distractors from its own split


def test_the_chat_ending_task_splits_by_question():
    splits = build_task("chat_ending")
    ids = {s: {d["id"] for d in docs} for s, docs in splits.items()}
    assert all(ids[s] for s in SPLITS)
    assert not (ids["test"] & (ids["train"] | ids["validation"])) and not (ids["train"] & ids["validation"])
    d = splits["test"][0]
    assert d["query"].endswith(d["query"].split("assistant\n")[-1]) and "<|im_start|>assistant" in d["query"]
    assert d["choices"][d["gold"]] == " " + d["label"] and len(d["label"].split()) == 6
