"""The TopK SAE recipe of prismlm.control.sae (the controllers' baseline): training lowers the held-out error,
AuxK revives a latent that cannot win the TopK, resampling moves dead latents to the worst-reconstructed rows,
the data initialisation starts at data rows with the least-squares scale; each against a hand computation."""

from __future__ import annotations

import pytest
import torch

from prismlm.control.sae import SAERecipe, TopKSAE, data_init, fit_sae, resample_dead, row_sampler, sae_quality

D = 8
EYE = torch.eye(D)


def _one_hot_rows(n: int, seed: int = 0) -> torch.Tensor:
    """(n, D) rows c·e_j: one atom of the standard basis each, c ∈ [1, 2)."""
    g = torch.Generator().manual_seed(seed)
    return EYE[torch.randint(0, D, (n,), generator=g)] * (1 + torch.rand(n, 1, generator=g))


def _fvu(sae: TopKSAE, z: torch.Tensor) -> float:
    with torch.no_grad():
        return float(((sae(z) - z) ** 2).sum() / ((z - z.mean(0)) ** 2).sum())


def _with_a_dead_latent() -> TopKSAE:
    """The perfect SAE of the basis (latent i = e_i), except that latent 0 also reads e_7 twice as strongly as
    latent 7 does, so latent 7 never wins the top-1 (dead) and its decoder row points elsewhere."""
    sae = TopKSAE(D, D, 1)
    with torch.no_grad():
        sae.W_dec.copy_(EYE)
        sae.W_enc.copy_(EYE)
        sae.b_enc.zero_()
        sae.b_dec.zero_()
        sae.W_enc[0, 7] = 2.0
        sae.W_enc[7, 7] = 0.05
        sae.W_dec[7] = (EYE[5] + EYE[6]) / 2**0.5
    return sae


@pytest.mark.parametrize("aux_weight", [0.0, 1.0])
def test_auxk_revives_a_dead_latent(aux_weight):
    z, held = _one_hot_rows(2000), _one_hot_rows(500, seed=1)
    sae = _with_a_dead_latent()
    w_dec7 = sae.W_dec[7].detach().clone()
    assert sae_quality(sae, held)[1] == pytest.approx(1 / D)  # latent 7 is dead
    recipe = SAERecipe(steps=60, batch=64, lr=1e-2, aux_weight=aux_weight, dead_steps=5)
    fit = fit_sae(D, D, 1, row_sampler(z, 0), recipe, held=held, start=sae)
    idx, act = fit.sae.encode(held)
    fires = int((idx[act > 0] == 7).sum())
    if aux_weight:
        assert fires > 20 and fit.curve[-1]["dead_fraction"] == 0.0
        assert fit.curve[-1]["fvu"] < 0.12
    else:  # no gradient reaches a latent outside the TopK: it stays as it was, and dead
        assert fires == 0
        torch.testing.assert_close(fit.sae.W_dec[7].detach(), w_dec7)  # renormalised only


@pytest.mark.slow
def test_training_lowers_the_held_out_error_and_the_curve_reports_it():
    g = torch.Generator().manual_seed(0)
    atoms = torch.randn(32, 16, generator=g)
    atoms = atoms / atoms.norm(dim=-1, keepdim=True)
    codes = torch.zeros(3000, 32)
    for r in range(3000):
        codes[r, torch.randperm(32, generator=g)[:2]] = 1 + torch.rand(2, generator=g)
    z = codes @ atoms
    train, held = z[:2500], z[2500:]
    recipe = SAERecipe(steps=300, batch=64, lr=1e-2, data_init=True, resample_every=50, dead_steps=10)
    fit = fit_sae(16, 48, 2, row_sampler(train, 0), recipe, seed=0, held=held, checkpoints=(1, 100))
    assert [c["steps"] for c in fit.curve] == [1, 100, 300]
    assert fit.curve[-1]["fvu"] == pytest.approx(_fvu(fit.sae, held), rel=1e-5)  # the curve's FVU is the FVU
    assert fit.curve[-1]["fvu"] < 0.5 * fit.curve[0]["fvu"] and fit.curve[-1]["fvu"] < 0.25
    torch.testing.assert_close(fit.sae.directions.norm(dim=-1), torch.ones(48))
    again = fit_sae(16, 48, 2, row_sampler(train, 0), recipe, seed=0, held=held, checkpoints=(1, 100))
    assert again.curve == fit.curve and again.resampled == fit.resampled  # seeded: reproducible


def test_resampling_moves_dead_latents_to_the_worst_rows():
    torch.manual_seed(0)
    sae = TopKSAE(D, 6, 2)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-3)
    z = torch.randn(5, D)
    sae(z).sum().backward()
    opt.step()  # Adam moments exist for every row
    err = torch.zeros(5, D)
    err[3] = 3 * EYE[2]  # the worst row
    err[1] = 2 * EYE[4]  # the second worst
    err[0] = 0.5 * EYE[0]
    dead = torch.tensor([False, True, False, False, True, False])
    live_enc = sae.W_enc[~dead].detach().norm(dim=-1).mean()
    before = {n: p.detach().clone() for n, p in sae.named_parameters()}
    assert resample_dead(sae, opt, dead, z, err) == 2
    moved = {tuple(sae.W_dec[i].detach().tolist()) for i in (1, 4)}
    assert moved == {tuple(EYE[2].tolist()), tuple(EYE[4].tolist())}  # the unit errors of rows 3 and 1
    for i in (1, 4):
        torch.testing.assert_close(sae.W_enc[i].detach(), sae.W_dec[i].detach() * live_enc)
        assert sae.b_enc[i] == 0 and (opt.state[sae.W_enc]["exp_avg"][i] == 0).all()
    for name in ("W_enc", "W_dec", "b_enc"):  # the live latents are untouched
        assert torch.equal(getattr(sae, name).detach()[~dead], before[name][~dead])
    assert resample_dead(sae, opt, torch.zeros(6, dtype=torch.bool), z, err) == 0


def test_data_init_starts_at_data_rows_with_the_least_squares_scale():
    torch.manual_seed(0)
    sae = TopKSAE(D, 5, 2)
    with torch.no_grad():
        sae.b_dec.fill_(0.1)
    rows, probe = torch.randn(5, D), torch.randn(40, D)
    data_init(sae, rows, probe)
    unit = (rows - 0.1) / (rows - 0.1).norm(dim=-1, keepdim=True)
    torch.testing.assert_close(sae.W_dec.detach(), unit)
    s = sae.W_enc.detach().norm(dim=-1)
    assert torch.allclose(s, s[0].expand(5)) and float(sae.b_enc.detach().abs().max()) == 0.0
    torch.testing.assert_close(sae.W_enc.detach(), s[0] * unit)

    def err(scale: float) -> float:  # the probe's reconstruction error with the encoder scaled by `scale`
        with torch.no_grad():
            idx, act = sae.encode(probe)
            return float(((scale * sae.decode(idx, act) - (probe - 0.1)) ** 2).sum())

    assert err(1.0) < err(0.9) and err(1.0) < err(1.1)  # the chosen scale is the least-squares one


def test_sae_quality_is_fvu_and_dead_share():
    sae = TopKSAE(D, D, 1)
    with torch.no_grad():
        sae.W_dec.copy_(EYE)
        sae.W_enc.copy_(EYE)
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    z = torch.tensor([[2.0, 1.0, 0, 0, 0, 0, 0, 0], [0, 3.0, 0, 0, 0, 0, 0, 0]])  # row 0 loses its e_1 part
    fvu, dead = sae_quality(sae, z, chunk=1)
    centred = ((z - z.mean(0)) ** 2).sum()
    assert fvu == pytest.approx(1.0 / float(centred)) and dead == pytest.approx(6 / 8)
