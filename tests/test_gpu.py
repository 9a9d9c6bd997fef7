"""GPU checks (opt-in: ``pytest -m gpu``): bf16 autocast, torch.compile, and the logit identity on CUDA."""

from __future__ import annotations

import pytest
import torch

from prismlm import PrismLM, RunConfig, decompose
from prismlm.train import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_compiled_training_runs_and_lowers_loss(tiny_shards, tmp_path):
    cfg = RunConfig.from_name("tiny").override(
        {
            "train.device": "cuda",
            "train.dtype": "bfloat16",
            "train.compile": True,
            "train.max_steps": 30,
            "train.eval_interval": 30,
        }
    )
    result = train(cfg, tmp_path / "run", shards=tiny_shards, progress=False)
    assert result.metrics["val_loss"] < 6.0 and torch.isfinite(torch.tensor(result.metrics["val_loss"]))


def test_logit_identity_on_cuda_float32():
    torch.manual_seed(0)
    model = PrismLM(RunConfig.from_name("tiny").model).cuda().eval()
    x = torch.randint(0, 512, (2, 64), device="cuda")
    with torch.no_grad():
        out = model(x)
        dec = decompose(model, out, x)
    torch.testing.assert_close(dec.prototype_slices.sum(-1) + dec.residual_slice, dec.logit, rtol=1e-4, atol=1e-4)
