"""Suppression that reaches the residual: ``Suppress(ids, residual="project")`` (tiny configs, CPU, float64).

The references here do not use the library's basis: the projection onto span{p_i : i ∈ S} is computed by
least squares (r − Pᵀ c, c = argmin ‖Pᵀ c − r‖), so a wrong basis (not orthonormal, not the span) or a
missing projection fails; the exact identity ℓ' = Σ remaining slices + W r' + b is checked term by term."""

from __future__ import annotations

import json

import pytest
import torch

from prismlm import ModelConfig, PrismLM, PrototypeConfig, decompose
from prismlm.control.suppress import SuppressionRecord, SuppressionSet
from prismlm.errors import ModelError, SuppressionError
from prismlm.model import Suppress
from prismlm.model.interventions import ResidualProjection, contrast_direction, mean_direction, orthonormal_basis

K, V, D = 64, 97, 32


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float64, bias: bool = True) -> PrismLM:
    """A 2-layer PRISM with prototypes placed on real hidden states (activations non-trivial) and an
    unembedding bias (the identity's constant term)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=V,
        block_size=32,
        n_layer=2,
        n_head=2,
        n_embd=D,
        lm_head_bias=bias,
        tie_weights=not bias,
        prototypes=PrototypeConfig(num_prototypes=K, top_k=4),
    )
    model = PrismLM(cfg).to(dtype).eval()
    x = torch.randint(0, V, (3, 32))
    with torch.no_grad():
        z = model.backbone(x).reshape(-1, D)
        model.prototypes.weight.copy_(z[torch.randperm(z.shape[0])[:K]] + 0.3 * torch.randn(K, D, dtype=dtype))
        if bias:
            model.lm_head.bias.normal_(0.0, 0.5)
    return model


def span_residual(r: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """r (N, d) minus its least-squares fit by the rows of p (n, d): the reference r' (float64)."""
    c = torch.linalg.lstsq(p.T.double(), r.double().T).solution  # (n, N)
    return r.double() - (p.T.double() @ c).T


def _setup(seed: int = 0):
    model = tiny_model(seed)
    x = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        base = model(x)
    ids = base.indices[base.activations > 0].unique()[:6].tolist()  # prototypes that are active here
    return model, x, base, ids


# ----- the basis -------------------------------------------------------------------------------------------
def test_orthonormal_basis_spans_the_vectors_also_when_they_are_dependent():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 12, generator=g, dtype=torch.float64)
    vecs = torch.cat([a, a[:2] * 3.0, a[:1] + a[1:2]])  # 8 vectors of rank 5
    q = orthonormal_basis(vecs)
    assert q.shape == (12, 5) and q.dtype == torch.float64
    torch.testing.assert_close(q.T @ q, torch.eye(5, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(vecs @ q @ q.T, vecs, rtol=0, atol=1e-12)  # every vector lies in span(Q)
    full = orthonormal_basis(torch.randn(20, 12, generator=g))  # more vectors than dimensions: the whole space
    torch.testing.assert_close(full @ full.T, torch.eye(12, dtype=torch.float64), rtol=0, atol=1e-6)
    assert orthonormal_basis(torch.empty(0, 12)).shape == (12, 0)


# ----- the forward -----------------------------------------------------------------------------------------
def test_projected_suppression_is_the_exact_sum_of_remaining_slices_and_edited_residual():
    """ℓ' = Σ_i m_i a_i W p_i + W r' + b, r' = r − proj_span(P_S) r, every term from the unmodified forward."""
    model, x, base, ids = _setup()
    with torch.no_grad(), model.intervene(Suppress.of(ids, residual="project")):
        out = model(x)
    W, b = model.lm_head.weight, model.lm_head.bias
    m = torch.ones(K, dtype=torch.float64)
    m[ids] = 0.0
    p = model.prototypes.weight
    kept = (m[base.indices] * base.activations).unsqueeze(-1).mul(p[base.indices]).sum(-2)  # (B, T, d)
    r_ref = span_residual(base.residual.reshape(-1, D), p[ids]).view_as(base.residual)
    want = (kept + r_ref) @ W.T + b
    torch.testing.assert_close(out.logits, want, rtol=0, atol=1e-10)
    # the output shows the edit: r' as its residual, what was removed, and the prototypes it came from
    torch.testing.assert_close(out.residual, r_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.residual + out.residual_removed, base.residual, rtol=0, atol=1e-12)
    assert out.residual_projected_ids == tuple(sorted(ids))
    assert torch.equal(out.indices, base.indices) and torch.equal(out.activations, base.activations)
    # decompose stays exact: slices + residual slice + bias = logit
    dec = decompose(model, out, x)
    torch.testing.assert_close(
        dec.prototype_slices.sum(-1) + dec.residual_slice + dec.bias_slice, dec.logit, rtol=0, atol=1e-10
    )
    assert (dec.residual_slice - decompose(model, base, x).residual_slice).abs().max() > 1e-3  # not vacuous
    assert model.residual_projection is None and model.proto_multipliers is None  # restored


def test_projected_residual_is_orthogonal_to_every_suppressed_prototype():
    model, x, base, ids = _setup(1)
    with torch.no_grad(), model.intervene(Suppress.of(ids, residual="project")):
        out = model(x)
    p = model.prototypes.weight[ids]  # (n, d)
    dots = out.residual.reshape(-1, D) @ p.T  # (N, n)
    scale = base.residual.reshape(-1, D).norm(dim=-1, keepdim=True) * p.norm(dim=-1)  # (N, n)
    assert (dots.abs() / scale).max() < 1e-12
    assert ((base.residual.reshape(-1, D) @ p.T).abs() / scale).max() > 1e-2  # before the edit they were not
    # what was removed lies in the span: its least-squares residual against P_S is zero
    removed = out.residual_removed.reshape(-1, D)
    assert span_residual(removed, p).abs().max() < 1e-12


def test_keep_is_todays_suppression_and_project_differs_by_exactly_the_residual_projection():
    """``residual="keep"`` (the default) gives today's logits bit for bit; ``project`` differs from it by
    −W Q Qᵀ r, the concept's directions taken out of the residual (nothing else changes)."""
    model, x, base, ids = _setup(2)
    with torch.no_grad(), model.suppress(ids):
        today = model(x)
    with torch.no_grad(), model.intervene(Suppress.of(ids, residual="keep")):
        keep = model(x)
    with torch.no_grad(), model.intervene(Suppress.of(ids, residual="project")):
        proj = model(x)
    assert torch.equal(keep.logits, today.logits) and torch.equal(keep.residual, base.residual)
    assert keep.residual_removed is None and keep.residual_projected_ids is None
    r = base.residual.reshape(-1, D)
    in_span = (r.double() - span_residual(r, model.prototypes.weight[ids])).view_as(base.residual)
    torch.testing.assert_close(proj.logits, keep.logits - in_span @ model.lm_head.weight.T, rtol=0, atol=1e-10)
    # the concept direction (the mean of the suppressed prototypes): gone from the residual only with project
    u = model.prototypes.weight[ids].mean(0)
    u = u / u.norm()
    assert (keep.residual @ u).abs().max() > 1e-2
    assert (proj.residual @ u).abs().max() < 1e-12


def test_projection_composes_with_other_interventions_and_nests_as_a_union():
    from prismlm.model import Scale

    model, x, base, ids = _setup(3)
    a, b = ids[:3], ids[3:]
    f = torch.ones(K, dtype=torch.float64)
    f[ids[0]] = 2.0  # scaled, and also in a projected set: its slice is 0 (suppressed), its span is projected
    with torch.no_grad(), model.intervene(Suppress.of(ids, residual="project"), Scale(f)):
        both = model(x)
    with torch.no_grad(), model.intervene(Suppress.of(a, residual="project"), Suppress.of(b, residual="project")):
        split = model(x)
    with torch.no_grad(), model.intervene(Suppress.of(a, residual="project")):
        with model.intervene(Suppress.of(b, residual="project")):
            nested = model(x)
            assert model.residual_projection.ids == tuple(sorted(ids))
        assert model.residual_projection.ids == tuple(sorted(a))
    assert model.residual_projection is None
    torch.testing.assert_close(split.logits, both.logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(nested.logits, both.logits, rtol=0, atol=1e-10)
    # a keep suppression of other ids adds no projection of its own
    with torch.no_grad(), model.intervene(Suppress.of(a, residual="project"), Suppress.of(b)):
        mixed = model(x)
    assert mixed.residual_projected_ids == tuple(sorted(a))


def test_the_residual_mode_is_checked():
    with pytest.raises(ModelError, match="residual must be one of keep, project.*'drop'") as e:
        Suppress.of([1], residual="drop")
    assert "'project'" in str(e.value) and "'contrast'" in str(e.value)
    model = tiny_model()
    with pytest.raises(ModelError, match="unknown prototype"):
        with model.intervene(Suppress.of([K], residual="project")):
            pass
    assert model.residual_projection is None and model.proto_multipliers is None


def test_kv_cache_steps_equal_the_full_forward_under_the_projection():
    """Every cached decode step's logits are those of one forward over the whole sequence; also with the
    projection alone (``project_residual``, no multipliers), where the lean decode path would be wrong."""
    model, x, _, ids = _setup(4)
    prompt = x[:1, :5]
    for ctx in (lambda: model.intervene(Suppress.of(ids, residual="project")), lambda: model.project_residual(ids)):
        with torch.no_grad(), ctx():
            steps = list(model.generate_steps(prompt, 8, temperature=0))
            seq = torch.cat([prompt] + [t for _, t in steps], dim=1)  # (1, 13)
            for n, (out, _) in enumerate(steps):
                full = model(seq[:, : 5 + n]).logits[:, -1]
                torch.testing.assert_close(out.logits[:, -1], full, rtol=0, atol=1e-10)
            uncached = model.generate(prompt, 8, temperature=0, use_cache=False)
        assert torch.equal(uncached, seq)
    with torch.no_grad(), model.project_residual(ids):
        projected = model(seq).logits
    with torch.no_grad():
        assert (projected - model(seq).logits).abs().max() > 1e-3  # the projection alone changes the logits


def test_residual_projection_value_is_traceable():
    model = tiny_model()
    proj = ResidualProjection.of([9, 3, 3], model.prototypes.weight)
    assert proj.ids == (3, 9) and proj.basis.shape == (D, 2)
    torch.testing.assert_close(proj.basis.T @ proj.basis, torch.eye(2, dtype=torch.float64), rtol=0, atol=1e-12)


# ----- the suppression set artifact ------------------------------------------------------------------------
def test_suppression_set_records_the_mode_and_old_files_load(tmp_path):
    model, x, _, ids = _setup(5)
    s = SuppressionSet(ids=ids, num_prototypes=K, concept="c", residual="project")
    p = s.save(tmp_path / "p.json")
    d = json.loads(p.read_text())
    assert d["format_version"] == 2 and d["residual"] == "project"
    assert list(d) == list(SuppressionRecord.__annotations__)
    loaded = SuppressionSet.load(p)
    assert loaded.residual == "project" and loaded.ids == sorted(ids)
    assert loaded.subset(ids[:2]).residual == "project"
    iv = loaded.intervention()
    assert iv.residual == "project" and iv.ids == tuple(sorted(ids))
    with torch.no_grad(), model.intervene(iv):
        got = model(x).logits
    with torch.no_grad(), model.intervene(Suppress.of(ids, residual="project")):
        want = model(x).logits
    assert torch.equal(got, want)
    # a keep set is written in the old format (version 1, no residual key), readable by older prismlm
    k = json.loads(SuppressionSet(ids=ids, num_prototypes=K).save(tmp_path / "k.json").read_text())
    assert k["format_version"] == 1 and "residual" not in k
    # an old file (format 1, written before the mode existed) loads as keep
    old = {"kind": "prismlm-suppression", "format_version": 1, "ids": [3, 5], "num_prototypes": K, "evidence": {}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert SuppressionSet.load(tmp_path / "old.json").intervention().residual == "keep"
    bad = {**old, "format_version": 2, "residual": "drop"}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(SuppressionError, match="residual mode must be one of keep, project"):
        SuppressionSet.load(tmp_path / "bad.json")
    (tmp_path / "new.json").write_text(json.dumps({**old, "format_version": 3}))
    with pytest.raises(SuppressionError, match="format_version 3.*upgrade prismlm"):
        SuppressionSet.load(tmp_path / "new.json")


# ----- export to transformers ------------------------------------------------------------------------------


def _exported(seed: int, mode: str, out):
    """A float32 model (``_setup(seed)``) exported to ``out`` with ``Suppress(ids, residual=mode)``: the model,
    its input, the ids, the intervention and the export's config.json."""
    from prismlm.integrations.hf_model import PrismForCausalLM

    model, x, _, ids = _setup(seed)
    model = model.float()
    iv = Suppress.of(ids, residual=mode)
    PrismForCausalLM.from_prism(model, interventions=(iv,), eos_token_id=0, pad_token_id=0).save_pretrained(out)
    return model, x, ids, iv, json.loads((out / "config.json").read_text())


def test_export_bakes_the_projection_in(tmp_path):
    """A float32 model exported with ``Suppress(ids, residual="project")``: config.json lists the ids, and
    the transformers model's logits and greedy tokens are prismlm's under the same suppression."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from prismlm.integrations.hf_model import PrismConfig

    model, x, ids, iv, cfg = _exported(6, "project", tmp_path / "out")
    assert cfg["residual_projected_prototypes"] == sorted(ids) and cfg["suppressed_prototypes"] == sorted(ids)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad(), model.intervene(iv):
        want = model(x)
        want_tokens = model.generate(x[:1, :6], 10, temperature=0)
    with torch.no_grad(), model.intervene(Suppress.of(ids)):
        keep = model(x).logits
    with torch.no_grad():
        got = loaded(x)
        tokens = loaded.generate(x[:1, :6], max_new_tokens=10, do_sample=False)
    assert torch.equal(got.logits, want.logits)
    assert torch.equal(got.residual, want.residual)  # the edited residual, as prismlm shows it
    assert (got.logits - keep).abs().max() > 1e-3  # the projection is baked in, not only the slices
    assert torch.equal(tokens, want_tokens)
    # an export written before the field existed loads without a projection
    assert PrismConfig(cfg["prism_model"]).residual_projected_prototypes is None


# ----- the run and the CLI ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_folder(tiny_shards, tmp_path_factory):
    from conftest import train_tiny_run

    return train_tiny_run(tiny_shards, tmp_path_factory.mktemp("resid_run"), steps=2, batch_size=2, warmup_steps=1)[1]


def _run_and_set(run_folder, tmp_path):
    """The tiny run, a prompt (1, T), and a suppression file of 4 prototypes active on it."""
    from prismlm.app import Run

    run = Run.open(run_folder, device="cpu")
    x = torch.tensor([run.tokenizer.encode("It is a truth universally acknowledged, that a single man")])
    with torch.no_grad():
        ids = sorted(set(run.model(x).indices[..., 0].flatten().tolist()))[:4]
    sfile = SuppressionSet(ids=ids, num_prototypes=run.model.prototypes.num_prototypes).save(tmp_path / "s.json")
    return run, x, ids, sfile


def test_cli_suppress_residual_chooses_the_mode_and_export_bakes_it_in(run_folder, tmp_path):
    """``prism export RUN OUT --suppress FILE --suppress-residual project``: the export projects the residual
    (its logits and greedy tokens are the run's under the set with ``project``); bad values fail naming the fix."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from prismlm.app import Run
    from prismlm.cli.main import app

    run, x, ids, sfile = _run_and_set(run_folder, tmp_path)
    out = tmp_path / "exported"
    cli = CliRunner()
    args = ["export", str(run_folder), str(out), "--suppress", str(sfile), "--device", "cpu"]
    res = cli.invoke(app, [*args, "--suppress-residual", "project"])
    assert res.exit_code == 0, res.output
    assert "residual projected" in res.output
    assert json.loads((out / "config.json").read_text())["residual_projected_prototypes"] == ids
    projected = Run.open(run_folder, device="cpu", suppress=sfile, suppress_residual="project")
    assert projected.suppression.residual == "project" and projected.interventions[0].residual == "project"
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad(), projected.intervened() as m:
        want, want_tokens = m(x).logits, m.generate(x[:, :6], 10, temperature=0)
    with torch.no_grad(), Run.open(run_folder, device="cpu", suppress=sfile).intervened() as m:
        keep = m(x).logits
    with torch.no_grad():
        assert (loaded(x).logits - want).abs().max().item() <= 1e-5
        assert torch.equal(loaded.generate(x[:, :6], max_new_tokens=10, do_sample=False), want_tokens)
    assert (want - keep).abs().max().item() > 1e-3
    bad = cli.invoke(app, [*args[:2], str(tmp_path / "o2"), *args[3:], "--suppress-residual", "drop"])
    assert bad.exit_code != 0 and "--suppress-residual 'drop' is not a residual mode" in bad.output
    assert "use 'auto'" in bad.output and "'keep'" in bad.output and "'contrast'" in bad.output
    none = cli.invoke(app, [*args[:2], str(tmp_path / "o3"), "--suppress", "none", "--suppress-residual", "project"])
    assert none.exit_code != 0 and "--suppress-residual project needs a suppression set" in none.output
    assert "--suppress FILE" in none.output


def test_concept_records_the_residual_mode(run_folder, tmp_path):
    """``prism concept … --residual project`` writes a set that applies with the projection; a bad mode is
    refused naming the flag and the fix."""
    from typer.testing import CliRunner

    from prismlm.cli.main import app

    (tmp_path / "c.txt").write_text("Thou shalt not kill.\n\nAnd the LORD said unto Moses, thou art blessed.\n")
    (tmp_path / "n.txt").write_text("The report was filed on Monday.\n\nPrices rose by two percent last year.\n")
    args = ["concept", str(run_folder), "--concept", str(tmp_path / "c.txt"), "--neutral", str(tmp_path / "n.txt")]
    args += ["--device", "cpu", "--threshold", "0", "--min-count", "1"]
    res = CliRunner().invoke(app, [*args, "--residual", "project", "--out", str(tmp_path / "s.json")])
    assert res.exit_code == 0, res.output
    sset = SuppressionSet.load(tmp_path / "s.json")
    assert sset.residual == "project" and sset.intervention().residual == "project"
    res = CliRunner().invoke(app, [*args, "--residual", "contrast", "--out", str(tmp_path / "c.json")])
    assert res.exit_code == 0, res.output
    assert SuppressionSet.load(tmp_path / "c.json").intervention().residual == "contrast"
    bad = CliRunner().invoke(app, [*args, "--residual", "drop"])
    assert (
        bad.exit_code != 0 and "--residual 'drop' is not a residual mode" in bad.output and "use 'keep'" in bad.output
    )


def test_explanations_show_the_edited_residual(run_folder):
    """``explain`` and ``explain_generation`` (cached steps joined) under a projecting suppression: every
    position sums exactly, its residual slice is the edited residual's, and a note names the prototypes."""
    from prismlm.app import Run
    from prismlm.explain.explanation import explain, explain_generation

    run = Run.open(run_folder, device="cpu", suppress="none")
    model, tok = run.model, run.tokenizer
    prompt = "It is a truth universally acknowledged"
    ids = tok.encode(prompt)
    with torch.no_grad():
        sup = sorted(set(model(torch.tensor([ids])).indices[..., 0].flatten().tolist()))[:4]
    iv = Suppress.of(sup, residual="project")
    with torch.no_grad(), model.intervene(iv):
        gen = explain_generation(model, tok, prompt, 5)
        one = explain(model, tok, prompt)
        full = model(torch.tensor([gen.token_ids]))
        dec = decompose(model, full, torch.tensor([gen.token_ids[1:] + [0]]))
    with torch.no_grad():
        plain = decompose(model, model(torch.tensor([gen.token_ids])), torch.tensor([gen.token_ids[1:] + [0]]))
    for e in (gen, one):
        assert e.max_abs_error < 1e-4
        assert any(f"{len(sup)} suppressed prototypes" in n for n in e.notes)
    # every position but the last (its target, the last generated token, is not in token_ids)
    got = torch.tensor([p.residual_slice for p in gen.positions[:-1]], dtype=torch.float64)
    n = len(got)
    torch.testing.assert_close(got, dec.residual_slice[0, :n].double(), rtol=0, atol=1e-4)
    assert (got - plain.residual_slice[0, :n].double()).abs().max() > 1e-3  # not the unedited residual's


# ----- residual="mean": one direction, u = Σ_{i∈S} p_i / ‖Σ_{i∈S} p_i‖ -------------------------------------------
def mean_unit(p: torch.Tensor) -> torch.Tensor:
    """(n, d) prototype rows → (d,) float64 u = Σ p_i / ‖Σ p_i‖, by hand (no library code)."""
    s = p.double().sum(0)
    return s / s.norm()


def mean_residual(r: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """r (N, d) minus its component along the unit mean of the rows of p: the reference r' (float64)."""
    u = mean_unit(p)
    return r.double() - (r.double() @ u)[:, None] * u[None, :]


def test_mean_suppression_is_the_exact_sum_of_remaining_slices_and_edited_residual():
    """ℓ' = Σ_i m_i a_i W p_i + W r' + b with r' = r − u uᵀ r, u the unit mean of the suppressed prototypes
    (computed by hand here); the output records r', u uᵀ r, the ids and the mode; ``decompose`` stays exact."""
    model, x, base, ids = _setup(7)
    with torch.no_grad(), model.intervene(Suppress.of(ids, residual="mean")):
        out = model(x)
    W, b = model.lm_head.weight, model.lm_head.bias
    m = torch.ones(K, dtype=torch.float64)
    m[ids] = 0.0
    p = model.prototypes.weight
    kept = (m[base.indices] * base.activations).unsqueeze(-1).mul(p[base.indices]).sum(-2)  # (B, T, d)
    r = base.residual.reshape(-1, D)
    r_ref = mean_residual(r, p[ids]).view_as(base.residual)
    torch.testing.assert_close(out.logits, (kept + r_ref) @ W.T + b, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.residual, r_ref, rtol=0, atol=1e-12)
    u = mean_unit(p[ids])
    removed_ref = ((r.double() @ u)[:, None] * u[None, :]).view_as(base.residual)
    torch.testing.assert_close(out.residual_removed, removed_ref, rtol=0, atol=1e-12)
    assert out.residual_projected_ids == tuple(sorted(ids)) and out.residual_projection_mode == "mean"
    dec = decompose(model, out, x)
    torch.testing.assert_close(
        dec.prototype_slices.sum(-1) + dec.residual_slice + dec.bias_slice, dec.logit, rtol=0, atol=1e-10
    )
    assert model.residual_projection is None and model.proto_multipliers is None  # restored


def test_mean_removes_one_direction_not_the_span():
    """r' ⟂ u, but not ⟂ each suppressed prototype (that is ``project``); what was removed is parallel to u,
    and ``mean`` differs from ``project`` and from ``keep`` by exactly −W u uᵀ r and −W Q Qᵀ r."""
    model, x, base, ids = _setup(8)
    with torch.no_grad(), model.intervene(Suppress.of(ids, residual="mean")):
        mean = model(x)
    with torch.no_grad(), model.intervene(Suppress.of(ids, residual="project")):
        proj = model(x)
    with torch.no_grad(), model.intervene(Suppress.of(ids)):
        keep = model(x)
    p = model.prototypes.weight[ids]
    u = mean_unit(p)
    r = base.residual.reshape(-1, D)
    rp = mean.residual.reshape(-1, D)
    assert ((rp @ u).abs() / r.norm(dim=-1)).max() < 1e-12
    assert ((r @ u).abs() / r.norm(dim=-1)).max() > 1e-2  # before the edit it was not orthogonal
    assert ((rp @ p.T).abs() / (r.norm(dim=-1, keepdim=True) * p.norm(dim=-1))).max() > 1e-2  # only u went
    removed = mean.residual_removed.reshape(-1, D)
    torch.testing.assert_close(removed - (removed @ u)[:, None] * u, torch.zeros_like(removed), rtol=0, atol=1e-12)
    # one direction takes out less of the residual than the span of the same prototypes
    assert (removed.norm(dim=-1) <= proj.residual_removed.reshape(-1, D).norm(dim=-1) + 1e-12).all()
    assert (mean.logits - proj.logits).abs().max() > 1e-3
    along_u = ((r.double() @ u)[:, None] * u).view_as(base.residual)
    torch.testing.assert_close(mean.logits, keep.logits - along_u @ model.lm_head.weight.T, rtol=0, atol=1e-10)


def test_mean_basis_is_the_unit_sum_of_the_prototype_rows():
    model = tiny_model()
    P = model.prototypes.weight
    proj = ResidualProjection.of([9, 3, 3, 20], P, "mean")
    assert proj.ids == (3, 9, 20) and proj.mode == "mean" and proj.basis.shape == (D, 1)
    torch.testing.assert_close(proj.basis[:, 0], mean_unit(P[[3, 9, 20]]), rtol=0, atol=1e-12)
    # not the span's basis, not the unnormalised sum; the default stays the span
    assert ResidualProjection.of([3, 9, 20], P).basis.shape == (D, 3)
    assert ResidualProjection.of([3, 9, 20], P).mode == "project"
    one = ResidualProjection.of([5], P, "mean")  # a single prototype: its own direction, as project gives
    torch.testing.assert_close(one.basis[:, 0], P[5] / P[5].norm(), rtol=0, atol=1e-12)
    # prototypes that cancel have no mean direction: nothing is taken out (not a division by ~0)
    v = torch.randn(2, D, dtype=torch.float64)
    assert mean_direction(torch.cat([v, -v])).shape == (D, 0)
    with pytest.raises(ModelError, match="mode must be one of project, mean.*'span'"):
        ResidualProjection.of([3], P, "span")


def test_mean_suppressions_combine_over_the_union_and_mixing_modes_is_refused():
    """Two ``mean`` suppressions (together or nested) are ``Suppress(A ∪ B, residual="mean")`` — the mean of
    the union's prototypes, not of the two means; with ``project`` in the same intervention they are refused
    naming the fix, and the model is restored."""
    model, x, base, ids = _setup(9)
    a, b = ids[:2], ids[1:]  # overlapping: a shared prototype counts once
    union = sorted(set(a) | set(b))
    with torch.no_grad(), model.intervene(Suppress.of(union, residual="mean")):
        want = model(x)
    with torch.no_grad(), model.intervene(Suppress.of(a, residual="mean"), Suppress.of(b, residual="mean")):
        split = model(x)
    with torch.no_grad(), model.intervene(Suppress.of(a, residual="mean")):
        with model.intervene(Suppress.of(b, residual="mean")):
            nested = model(x)
            assert model.residual_projection.ids == tuple(union) and model.residual_projection.mode == "mean"
        assert model.residual_projection.ids == tuple(sorted(a))
    torch.testing.assert_close(split.logits, want.logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(nested.logits, want.logits, rtol=0, atol=1e-10)
    p = model.prototypes.weight
    r_ref = mean_residual(base.residual.reshape(-1, D), p[union]).view_as(base.residual)
    torch.testing.assert_close(split.residual, r_ref, rtol=0, atol=1e-12)
    # keep alongside mean adds no direction of its own
    with torch.no_grad(), model.intervene(Suppress.of(a, residual="mean"), Suppress.of(b)):
        mixed = model(x)
    assert mixed.residual_projected_ids == tuple(sorted(a)) and mixed.residual_projection_mode == "mean"
    with pytest.raises(ModelError, match="cannot combine residual modes 'mean' and 'project'") as e:
        with model.intervene(Suppress.of(a, residual="mean"), Suppress.of(b, residual="project")):
            pass
    assert "same residual mode" in str(e.value)
    with pytest.raises(ModelError, match="cannot combine residual modes"):
        with model.intervene(Suppress.of(a, residual="project")):
            with model.intervene(Suppress.of(b, residual="mean")):
                pass
    assert model.residual_projection is None and model.proto_multipliers is None


@pytest.mark.parametrize("mode", ["mean", "contrast"])
def test_kv_cache_steps_equal_the_full_forward_under_the_mean_projection(mode):
    model, x, _, ids = _setup(10)
    prompt = x[:1, :5]
    for ctx in (
        lambda: model.intervene(Suppress.of(ids, residual=mode)),
        lambda: model.project_residual(ids, mode),
    ):
        with torch.no_grad(), ctx():
            assert model.residual_projection.mode == mode
            steps = list(model.generate_steps(prompt, 8, temperature=0))
            seq = torch.cat([prompt] + [t for _, t in steps], dim=1)
            for n, (out, _) in enumerate(steps):
                full = model(seq[:, : 5 + n]).logits[:, -1]
                torch.testing.assert_close(out.logits[:, -1], full, rtol=0, atol=1e-10)
            assert torch.equal(model.generate(prompt, 8, temperature=0, use_cache=False), seq)


def test_suppression_set_round_trips_the_mean_mode(tmp_path):
    model, x, _, ids = _setup(11)
    s = SuppressionSet(ids=ids, num_prototypes=K, concept="c", residual="mean")
    d = json.loads(s.save(tmp_path / "m.json").read_text())
    assert d["format_version"] == 2 and d["residual"] == "mean"
    assert list(d) == list(SuppressionRecord.__annotations__)
    loaded = SuppressionSet.load(tmp_path / "m.json")
    assert loaded.residual == "mean" and loaded.subset(ids[:2]).residual == "mean"
    iv = loaded.intervention()
    assert iv.residual == "mean" and iv.ids == tuple(sorted(ids))
    with torch.no_grad(), model.intervene(iv):
        got = model(x).logits
    with torch.no_grad(), model.intervene(Suppress.of(ids, residual="mean")):
        want = model(x).logits
    with torch.no_grad(), model.intervene(Suppress.of(ids, residual="project")):
        other = model(x).logits
    assert torch.equal(got, want) and (got - other).abs().max() > 1e-3


def _export_matches_prismlm(seed: int, mode: str, other: str, out):
    """Export ``_setup(seed)``'s model with ``Suppress(ids, residual=mode)`` and check it under transformers:
    config.json records the ids and the mode; logits, residual and greedy tokens equal prismlm's under the
    suppression, and the logits differ from those under the ``other`` mode. → (config, input, other's logits)."""
    from transformers import AutoModelForCausalLM

    model, x, ids, iv, cfg = _exported(seed, mode, out)
    assert cfg["residual_projected_prototypes"] == sorted(ids) and cfg["residual_projection_mode"] == mode
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad(), model.intervene(iv):
        want = model(x)
        want_tokens = model.generate(x[:1, :6], 10, temperature=0)
    with torch.no_grad(), model.intervene(Suppress.of(ids, residual=other)):
        other_logits = model(x).logits
    with torch.no_grad():
        got = loaded(x)
        tokens = loaded.generate(x[:1, :6], max_new_tokens=10, do_sample=False)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.residual, want.residual)
    assert torch.equal(tokens, want_tokens)
    assert (got.logits - other_logits).abs().max() > 1e-3
    return cfg, x, other_logits


def test_export_bakes_the_mean_projection_in(tmp_path):
    """A float32 model exported with ``Suppress(ids, residual="mean")``: config.json records the ids and the
    mode, and the transformers model's logits, residual and greedy tokens are prismlm's under it; an export
    that records ids without a mode (written before the mode existed) projects off the span, as it did."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from prismlm.integrations.hf_model import PrismConfig

    cfg, x, span = _export_matches_prismlm(12, "mean", "project", tmp_path / "out")  # the mean, not the span
    old = {k: v for k, v in cfg.items() if k != "residual_projection_mode"}
    assert PrismConfig(**old).residual_projection_mode == "project"
    assert PrismConfig(cfg["prism_model"]).residual_projection_mode is None
    (tmp_path / "out" / "config.json").write_text(json.dumps(old))
    with torch.no_grad():
        legacy = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(x).logits
    assert torch.equal(legacy, span)


@pytest.mark.parametrize(("mode", "said"), [("mean", "unit mean direction"), ("contrast", "contrast with the bank")])
def test_cli_export_with_suppress_residual_mean(run_folder, tmp_path, mode, said):
    """``prism export RUN OUT --suppress FILE --suppress-residual mean|contrast``: the export records the mode,
    says so, and its logits are the run's under the set with that mode."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from prismlm.app import Run
    from prismlm.cli.main import app

    run, x, ids, sfile = _run_and_set(run_folder, tmp_path)
    out = tmp_path / "exported"
    args = ["export", str(run_folder), str(out), "--suppress", str(sfile), "--device", "cpu"]
    res = CliRunner().invoke(app, [*args, "--suppress-residual", mode])
    assert res.exit_code == 0, res.output
    assert said in res.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["residual_projected_prototypes"] == ids and cfg["residual_projection_mode"] == mode
    meaned = Run.open(run_folder, device="cpu", suppress=sfile, suppress_residual=mode)
    assert meaned.interventions[0].residual == mode
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad(), meaned.intervened() as m:
        want = m(x).logits
    with torch.no_grad():
        assert (loaded(x).logits - want).abs().max().item() <= 1e-5


def test_explanations_under_the_mean_projection_sum_exactly_and_say_so(run_folder):
    from prismlm.app import Run
    from prismlm.explain.explanation import explain

    run = Run.open(run_folder, device="cpu", suppress="none")
    model, tok = run.model, run.tokenizer
    prompt = "It is a truth universally acknowledged"
    with torch.no_grad():
        sup = sorted(set(model(torch.tensor([tok.encode(prompt)])).indices[..., 0].flatten().tolist()))[:4]
    with torch.no_grad(), model.intervene(Suppress.of(sup, residual="mean")):
        e = explain(model, tok, prompt)
    assert e.max_abs_error < 1e-4
    assert any("unit mean direction" in n and f"{len(sup)} suppressed prototypes" in n for n in e.notes)


# ----- residual="contrast": one direction, v = (p̄_S − p̄_bank) / ‖p̄_S − p̄_bank‖ -----------------------------------
def contrast_unit(p_set: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
    """(n, d) set rows, (K, d) bank → (d,) float64 v = (mean of the set − mean of the bank), made unit, by hand."""
    diff = p_set.double().sum(0) / len(p_set) - bank.double().sum(0) / len(bank)
    return diff / diff.norm()


def test_contrast_suppression_is_the_exact_sum_of_remaining_slices_and_edited_residual():
    """ℓ' = Σ_i m_i a_i W p_i + W r' + b with r' = r − v vᵀ r, v the unit difference between the suppressed
    prototypes' mean and the bank's (by hand here); the output records r', v vᵀ r, the ids and the mode;
    ``decompose`` stays exact."""
    model, x, base, ids = _setup(13)
    with torch.no_grad(), model.intervene(Suppress.of(ids, residual="contrast")):
        out = model(x)
    W, b, p = model.lm_head.weight, model.lm_head.bias, model.prototypes.weight
    m = torch.ones(K, dtype=torch.float64)
    m[ids] = 0.0
    kept = (m[base.indices] * base.activations).unsqueeze(-1).mul(p[base.indices]).sum(-2)  # (B, T, d)
    r = base.residual.reshape(-1, D)
    v = contrast_unit(p[ids], p)
    along_v = (r.double() @ v)[:, None] * v[None, :]  # (N, d)
    r_ref = (r.double() - along_v).view_as(base.residual)
    torch.testing.assert_close(out.logits, (kept + r_ref) @ W.T + b, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.residual, r_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.residual_removed, along_v.view_as(base.residual), rtol=0, atol=1e-12)
    assert out.residual_projected_ids == tuple(sorted(ids)) and out.residual_projection_mode == "contrast"
    dec = decompose(model, out, x)
    torch.testing.assert_close(
        dec.prototype_slices.sum(-1) + dec.residual_slice + dec.bias_slice, dec.logit, rtol=0, atol=1e-10
    )
    # not the mean mode: a different single direction
    with torch.no_grad(), model.intervene(Suppress.of(ids, residual="mean")):
        mean = model(x)
    assert (out.logits - mean.logits).abs().max() > 1e-3
    assert model.residual_projection is None and model.proto_multipliers is None  # restored


def test_contrast_ignores_what_every_prototype_shares():
    """Adding one vector c to every prototype (a common direction, as a retrofitted bank's prototypes share
    the backbone's mean) leaves the contrast direction as it was and turns the mean direction towards c."""
    model = tiny_model(14)
    P = model.prototypes.weight.detach().double()
    ids = [2, 5, 11, 40]
    c = 50.0 * torch.randn(D, dtype=torch.float64)
    shifted = P + c
    v0 = ResidualProjection.of(ids, P, "contrast").basis[:, 0]
    v1 = ResidualProjection.of(ids, shifted, "contrast").basis[:, 0]
    torch.testing.assert_close(v1, v0, rtol=0, atol=1e-10)
    torch.testing.assert_close(v0, contrast_unit(P[ids], P), rtol=0, atol=1e-12)
    u1 = ResidualProjection.of(ids, shifted, "mean").basis[:, 0]
    assert abs(float(u1 @ (c / c.norm()))) > 0.9 > abs(float(v1 @ (c / c.norm())))


def test_contrast_basis_edge_cases():
    model = tiny_model()
    P = model.prototypes.weight
    proj = ResidualProjection.of([9, 3, 3, 20], P, "contrast")
    assert proj.ids == (3, 9, 20) and proj.mode == "contrast" and proj.basis.shape == (D, 1)
    torch.testing.assert_close(proj.basis[:, 0], contrast_unit(P[[3, 9, 20]], P), rtol=0, atol=1e-12)
    # the whole bank has no contrast with itself: nothing is taken out (not a division by ~0)
    assert ResidualProjection.of(list(range(K)), P, "contrast").basis.shape == (D, 0)
    assert contrast_direction(P[:0], P).shape == (D, 0)
    with pytest.raises(ModelError, match="'contrast'"):
        ResidualProjection.of([3], P, "span")
    with pytest.raises(ModelError, match="cannot combine residual modes 'contrast' and 'mean'"):
        with model.intervene(Suppress.of([3], residual="contrast"), Suppress.of([4], residual="mean")):
            pass


def test_export_bakes_the_contrast_projection_in(tmp_path):
    """A float32 model exported with ``Suppress(ids, residual="contrast")``: config.json records the mode, and
    the transformers model's logits, residual and greedy tokens are prismlm's under it (not the mean's)."""
    pytest.importorskip("transformers")
    _export_matches_prismlm(15, "contrast", "mean", tmp_path / "out")
