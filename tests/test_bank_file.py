"""Bank files (``prismlm.model.bank_file``, ``train.init_bank``): a bank saved apart from its model round-trips,
a retrofit started from it holds it bit for bit (or trains on from its step), and a bank that does not serve
the model — another backbone, K or k, a later step, not a bank — is refused before the backbone pass."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_retrofit
from safetensors.torch import save_file
from test_stage2 import dense_run  # noqa: F401 (a fixture: the dense tiny run to retrofit)

from prismlm.app import Run
from prismlm.errors import ArtifactCorrupt, ArtifactError, ArtifactMismatch, ConfigError
from prismlm.model.bank_file import load_bank, save_bank


@pytest.fixture(scope="module")
def seeded(dense_run, tmp_path_factory):  # noqa: F811
    """A retrofit of the dense tiny run with a bank trained 3 steps on stored z here, and its bank saved in float32."""
    out = tmp_path_factory.mktemp("bank") / "seeded"
    tiny_retrofit(dense_run, out, ["train.stored_z_dtype=float32"], steps=3)
    model = Run.open(out, device="cpu").model
    path = save_bank(out.parent / "bank.safetensors", model, step=3, made_by={"how": "test"}, dtype=torch.float32)
    return out, path


def _bank(run) -> torch.Tensor:
    return Run.open(run, device="cpu").model.require_prototypes().weight.detach()


def test_a_bank_file_round_trips_and_a_retrofit_from_it_holds_it_bit_for_bit(seeded, dense_run, tmp_path):  # noqa: F811
    tiny_run = dense_run
    out, path = seeded
    bank = load_bank(path)
    assert bank.step == 3 and bank.top_k == 4 and bank.made_by == {"how": "test"}
    assert torch.equal(bank.prototypes, _bank(out))
    half = load_bank(save_bank(tmp_path / "half.safetensors", Run.open(out, device="cpu").model, step=3, made_by={}))
    assert half.prototypes.dtype == torch.float16 and torch.allclose(half.prototypes.float(), _bank(out), atol=1e-2)
    # no steps left: the run's bank is the file's, and the run is a whole one (config, checkpoint at its step)
    again = tiny_retrofit(
        tiny_run, tmp_path / "again", ["train.stored_z_dtype=float32", f"train.init_bank={path}"], steps=3
    )
    assert again.step == 3 and torch.equal(_bank(again.run_dir), bank.prototypes)
    assert json.loads((again.run_dir / "config.json").read_text())["train"]["init_bank"] == str(path)
    lines = [json.loads(x) for x in (again.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [3] and "val_loss" in lines[0]  # validated, no bank step here
    assert not (again.run_dir / "stored-z" / "candidates.bin").exists()
    # steps past the file's: the stage trains on from its step (two more steps, the bank moves)
    more = tiny_retrofit(
        tiny_run, tmp_path / "more", ["train.stored_z_dtype=float32", f"train.init_bank={path}"], steps=5
    )
    assert more.step == 5 and not torch.equal(_bank(more.run_dir), bank.prototypes)
    steps = [json.loads(x)["step"] for x in (more.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert min(steps) > 3


def test_a_bank_that_does_not_serve_the_model_is_refused_before_the_backbone_pass(seeded, dense_run, tmp_path):  # noqa: F811
    tiny_run = dense_run
    out, path = seeded
    cases = {
        "later": (["train.init_bank=" + str(path)], 2, ConfigError, "saved at step 3 of its stage"),
        "missing": (["train.init_bank=" + str(tmp_path / "none.safetensors")], 3, ArtifactError, "no prototype bank"),
    }
    other_k = save_bank(tmp_path / "k.safetensors", Run.open(out, device="cpu").model, step=3, made_by={})
    raw = load_bank(other_k)
    save_file({"prototypes": raw.prototypes[:16].contiguous()}, str(tmp_path / "k16.safetensors"),
              metadata={"kind": "prismlm-bank", "backbone": raw.backbone, "top_k": "4", "step": "3"})  # fmt: skip
    cases["K"] = (["train.init_bank=" + str(tmp_path / "k16.safetensors")], 3, ArtifactMismatch, "with 16 prototypes")
    save_file({"prototypes": raw.prototypes}, str(tmp_path / "foreign.safetensors"),
              metadata={"kind": "prismlm-bank", "backbone": "backbone:" + "0" * 64, "top_k": "4", "step": "3"})  # fmt: skip
    cases["backbone"] = (["train.init_bank=" + str(tmp_path / "foreign.safetensors")], 3, ArtifactMismatch,
                         "another model's hidden states")  # fmt: skip
    save_file({"w": raw.prototypes}, str(tmp_path / "other.safetensors"))
    cases["kind"] = (
        ["train.init_bank=" + str(tmp_path / "other.safetensors")],
        3,
        ArtifactCorrupt,
        "not a prismlm bank",
    )
    for name, (overrides, steps, error, text) in cases.items():
        with pytest.raises(error, match=text):
            tiny_retrofit(tiny_run, tmp_path / name, overrides, steps=steps)
        assert not (tmp_path / name / "stored-z").exists(), name  # refused before the z pass
    with pytest.raises(ConfigError, match="does not run"):  # the per-step path has no bank stage to start
        tiny_retrofit(tiny_run, tmp_path / "perstep", ["train.frozen_from_stored_z=false", f"train.init_bank={path}"])


def test_an_int8_bank_file_dequantizes_to_torchs_per_row_quantizer(seeded, dense_run, tmp_path):  # noqa: F811
    """``dtype=torch.int8``: each column divided by its absmax, then one scale per row (absmax / 127); the bank
    read back is what torch's own per-channel fake quantizer gives with those scales (an independent rounding)
    times the column scales, each divided entry within half a row scale; an all-zero row stays zero; the file
    is about a quarter of float32's; a retrofit from it holds the dequantized bank bit for bit."""
    from prismlm.model.bank_file import write_bank

    out, path = seeded
    full = load_bank(path)
    weight = full.prototypes.clone()
    weight[1] = 0.0  # an all-zero row: no division by zero, read back as zeros
    small = write_bank(tmp_path / "int8.safetensors", weight, backbone=full.backbone, top_k=full.top_k, step=3,
                       made_by={"how": "int8"}, dtype=torch.int8)  # fmt: skip
    read = load_bank(small)
    assert read.prototypes.dtype == torch.float32 and read.made_by == {"how": "int8"} and read.step == 3
    columns = weight.abs().amax(dim=0)
    divided = weight / columns
    scales = divided.abs().amax(dim=1) / 127
    scales[1] = 1.0
    zero = torch.zeros(len(scales), dtype=torch.int32)
    reference = torch.fake_quantize_per_channel_affine(divided, scales, zero, 0, -127, 127) * columns
    assert torch.allclose(read.prototypes, reference, rtol=1e-6, atol=1e-7)
    assert bool(((read.prototypes / columns - divided).abs() <= scales[:, None] / 2 + 1e-6).all())
    assert torch.equal(read.prototypes[1], torch.zeros_like(weight[1]))
    assert small.stat().st_size < 0.3 * path.stat().st_size + 4096  # int8 + a scale per row vs float32
    again = tiny_retrofit(dense_run, tmp_path / "again", ["train.stored_z_dtype=float32", f"train.init_bank={small}"],
                          steps=3)  # fmt: skip
    assert torch.equal(_bank(again.run_dir), read.prototypes)
    # int8 rows without their scales, and a dtype a bank file does not store, are refused
    save_file({"prototypes": torch.zeros(4, 8, dtype=torch.int8)}, str(tmp_path / "noscale.safetensors"),
              metadata={"kind": "prismlm-bank", "backbone": full.backbone, "top_k": "4", "step": "3"})  # fmt: skip
    with pytest.raises(ArtifactCorrupt, match="prototype_column_scales"):
        load_bank(tmp_path / "noscale.safetensors")
    with pytest.raises(ArtifactError, match="not torch.bfloat16"):
        write_bank(tmp_path / "bf.safetensors", weight, backbone="", top_k=4, step=3, made_by={}, dtype=torch.bfloat16)
