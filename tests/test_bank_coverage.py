"""``prismlm.eval.bank_coverage`` and ``prismlm.train.bank_fit``: the coverage numbers against a direct cosine
computation, the frontier's comparison of banks on hand-made points, and the fitting recipe's seedings,
schedule, resampling and determinism."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from prismlm.config import PrototypeConfig
from prismlm.eval.bank_coverage import Coverage, MeasuredBank, bank_coverage, best_point, dominates, pareto
from prismlm.model.prototypes import PrototypeLayer
from prismlm.train.bank_fit import BankPoint, Resampler, _lr_at, fit_bank, fit_point, seed_kmeans, seed_rows


def _bank(d: int = 6, K: int = 5, k: int = 2, seed: int = 0) -> PrototypeLayer:
    torch.manual_seed(seed)
    bank = PrototypeLayer(d, PrototypeConfig(num_prototypes=K, top_k=k))
    with torch.no_grad():
        bank.weight.copy_(torch.randn(K, d))
    return bank


@torch.no_grad()
def _reference(bank: PrototypeLayer, z: torch.Tensor, mu: torch.Tensor, centred: bool) -> dict[str, float]:
    """The coverage numbers from one forward over all rows, the cosines computed directly."""
    x = (z - mu if centred else z).double()
    po = bank(x.float())
    r = po.residual.double()
    cos = F.normalize(x, dim=-1) @ F.normalize(bank.weight.double(), dim=-1).T  # (N, K)
    used = torch.zeros(bank.num_prototypes, dtype=torch.bool)
    used[po.indices[po.activations > 0]] = True
    return {
        "residual_share": float((r.norm(dim=-1) / z.double().norm(dim=-1)).mean()),
        "centred_residual_share": float((r.norm(dim=-1) / (z - mu).double().norm(dim=-1)).mean()),
        "r1_bar": float(cos.max(0).values.mean()),
        "r2": float(cos.max(1).values.mean()),
        "dead": int((~used).sum()),
    }


@pytest.mark.parametrize("centred", [False, True])
def test_coverage_matches_the_direct_cosines_and_does_not_depend_on_the_chunk(centred):
    bank = _bank()
    g = torch.Generator().manual_seed(1)
    z = torch.randn(37, 6, generator=g) + 0.5
    mu = z[:20].mean(0)
    want = _reference(bank, z, mu, centred)
    for chunk in (4096, 7, 1):
        got = bank_coverage(bank, z, mu, centred, chunk=chunk)
        assert got["dead"] == want["dead"]
        for key in ("residual_share", "centred_residual_share", "r1_bar", "r2"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (key, chunk)


def test_a_prototype_pointing_away_from_every_row_is_dead():
    bank = _bank(K=4, k=1)
    e1 = torch.zeros(6)
    e1[0] = 1.0
    z = 0.3 * torch.randn(50, 6, generator=torch.Generator().manual_seed(2)) + 3 * e1  # every row along +e1
    with torch.no_grad():
        bank.weight[:3] = z[:3]
        bank.weight[3] = -e1  # negative cosine with every row: never a row's top-1
    assert bank_coverage(bank, z, torch.zeros(6), False)["dead"] == 1
    with torch.no_grad():
        bank.weight[3] = e1  # now the nearest prototype of some rows
    assert bank_coverage(bank, z, torch.zeros(6), False)["dead"] == 0


def _pt(name: str, c: float, dead: int, r1: float, r2: float, buildable: bool = True) -> MeasuredBank:
    return {"point": name, "buildable": buildable, "residual_share": c, "centred_residual_share": c, "dead": dead,
            "r1_bar": r1, "r2": r2}  # fmt: skip


def test_dominance_needs_every_number_no_worse_and_one_better():
    a, b = _pt("a", 0.4, 0, 0.95, 0.95), _pt("b", 0.5, 0, 0.95, 0.95)
    assert dominates(a, b) and not dominates(b, a)
    assert not dominates(a, a)  # equal on everything: not better
    worse_dead = _pt("c", 0.3, 2, 0.99, 0.99)  # lower residual but more dead prototypes
    assert not dominates(worse_dead, a) and not dominates(a, worse_dead)
    lower_r2 = _pt("d", 0.4, 0, 0.95, 0.90)
    assert dominates(a, lower_r2) and not dominates(lower_r2, a)


def test_pareto_front_and_best_point():
    pts = [
        _pt("a", 0.40, 0, 0.95, 0.95),
        _pt("b", 0.50, 0, 0.95, 0.95),  # dominated by a
        _pt("c", 0.30, 2, 0.99, 0.99, buildable=False),  # lowest residual, not buildable
        _pt("d", 0.45, 0, 0.97, 0.96),  # better R̄1/R2 than a, worse residual: on the front
    ]
    assert pareto(pts) == ["a", "c", "d"]
    assert best_point(pts)["point"] == "c"
    assert best_point(pts, True)["point"] == "a"
    assert best_point(pts, False)["point"] == "c"
    assert best_point([], True) is None
    now: Coverage = {"residual_share": 0.42, "centred_residual_share": 0.42, "r1_bar": 0.95, "r2": 0.95, "dead": 0}
    assert [p["point"] for p in pts if dominates(p, now)] == ["a"]


def test_bank_point_parses_names_and_knows_what_a_retrofit_builds():
    p = BankPoint.parse("K=64,k=4,init=kmeans,r=0,steps=10")
    assert (p.K, p.k, p.init, p.r, p.rs, p.steps, p.docs) == (64, 4, "kmeans", 0.0, 0, 10, 40)
    assert p.name == "K=64,k=4,init=kmeans,r=0.0,rs=0,steps=10,docs=40"
    assert BankPoint.parse(p.name) == p
    assert not p.buildable and BankPoint.parse("K=8").buildable and not BankPoint.parse("rs=1").buildable
    with pytest.raises(ValueError, match="unknown init"):
        BankPoint.parse("init=pca")


def test_seed_rows_are_distinct_input_rows_under_one_scale():
    rows = torch.randn(40, 5, generator=torch.Generator().manual_seed(3))
    out = seed_rows(rows, 6, 2, generator=torch.Generator().manual_seed(0))
    scale = out.norm(dim=-1) / rows.norm(dim=-1).max()  # any positive common scale
    assert out.shape == (6, 5)
    cos = F.normalize(out, dim=-1) @ F.normalize(rows, dim=-1).T
    hits = cos.isclose(torch.ones(()), atol=1e-5).nonzero()[:, 1]
    assert len(set(hits.tolist())) == 6  # each prototype is a distinct row's direction
    ratios = out.norm(dim=-1) / rows[hits].norm(dim=-1)
    assert torch.allclose(ratios, ratios[0].expand(6), rtol=1e-5) and bool((scale > 0).all())


def test_seed_kmeans_finds_well_separated_clusters():
    g = torch.Generator().manual_seed(4)
    centres = F.normalize(torch.eye(4) + 0.05, dim=-1) * torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    rows = torch.cat([c + 0.01 * torch.randn(50, 4, generator=g) for c in centres])
    out = seed_kmeans(rows, 4, 1, generator=torch.Generator().manual_seed(0), iters=5)
    cos = F.normalize(out, dim=-1) @ F.normalize(centres, dim=-1).T
    assert sorted(cos.argmax(1).tolist()) == [0, 1, 2, 3]  # one prototype per cluster
    assert bool((cos.max(1).values > 0.999).all())
    # each prototype keeps its cluster's mean norm up to the one shared scale
    norms = out.norm(dim=-1)[cos.argmax(0)] / centres.norm(dim=-1)
    assert torch.allclose(norms, norms[0].expand(4), rtol=2e-2)


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    lr, steps, warm = 1.0, 100, 10
    assert _lr_at(0, steps, warm, lr) == (0.1, pytest.approx(0.1))
    assert _lr_at(9, steps, warm, lr)[1] == pytest.approx(1.0)
    assert _lr_at(10, steps, warm, lr)[1] == pytest.approx(1.0)
    assert _lr_at(55, steps, warm, lr)[1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert _lr_at(100, steps, warm, lr)[1] == pytest.approx(0.1)


def test_fit_bank_is_seeded_and_its_loss_weights_matter():
    g = torch.Generator().manual_seed(5)
    zt, zv = torch.randn(24 * 4, 8, generator=g) + 0.2, torch.randn(40, 8, generator=g) + 0.2
    kw = dict(K=16, k=2, centred=False, steps=8, batch_seqs=3, lr=1e-2)
    a, b = fit_bank(zt, 4, zv, seed=0, **kw), fit_bank(zt, 4, zv, seed=0, **kw)
    for r in (a, b):
        r.pop("seconds")
    assert a == b and a["epochs"] == pytest.approx(8 * 3 / 24) and a["tokens_per_step"] == 12
    c = fit_bank(zt, 4, zv, seed=1, **kw)
    d = fit_bank(zt, 4, zv, seed=0, r_weight=0.0, **kw)
    assert c["residual_share"] != a["residual_share"] and d["r1_bar"] != a["r1_bar"]


def test_the_resampler_reseeds_dead_prototypes_at_its_steps():
    bank = _bank(d=4, K=3, k=1)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(6)) + 1.0
    with torch.no_grad():
        bank.weight[2] = -10 * x.mean(0)  # never the top-1 of a row
    opt = torch.optim.AdamW(bank.parameters())
    rs = Resampler(steps=10, sample=64)
    assert rs.at == {2, 4, 6}
    before = bank.weight.detach().clone()
    rs(0, bank, x, opt)  # not a resampling step
    assert torch.equal(bank.weight, before) and rs.log == []
    rs(1, bank, x, opt)
    assert rs.log == [{"step": 2, "resampled": 1}]
    assert not torch.equal(bank.weight[2], before[2]) and torch.equal(bank.weight[:2], before[:2])
    assert float(bank.weight[2].norm()) == pytest.approx(float(before.norm(dim=-1).median()), rel=1e-5)


def test_fit_point_records_the_point():
    g = torch.Generator().manual_seed(7)
    zt, zv = torch.randn(20 * 4, 6, generator=g), torch.randn(16, 6, generator=g)
    rec = fit_point(BankPoint.parse("K=8,k=2,rs=1,steps=5"), zt, 4, zv, batch_seqs=2, lr=1e-2, kmeans_iters=2)
    assert rec["point"] == "K=8,k=2,init=kpp,r=0.5,rs=1,steps=5,docs=40" and rec["buildable"] is False
    assert rec["anchor_train_tokens"] == 80 and [e["step"] for e in rec["resampled"]] == [1, 2, 3]
