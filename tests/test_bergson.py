"""bergson's runner (``prismlm.integrations.bergson``) and driver: the modules it is given reach bergson, and an
index built on them holds those modules only. The end-to-end test needs bergson's own venv (``BERGSON_PYTHON``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import numpy as np
import pytest
from conftest import QUERY_TEXTS, train_tiny_run

from prismlm.errors import ConfigError
from prismlm.integrations.bergson import DRIVER, bergson_scores, build_command, build_index, index_modules

ROOT = Path(__file__).resolve().parents[1]
TRACKED = [f"transformer.h.{i}.{m}" for i in range(3) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
TRACKED.append("lm_head")


def _driver():
    """The driver module, imported by its path (its bergson imports are inside its functions)."""
    spec = importlib.util.spec_from_file_location("bergson_driver", DRIVER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_build_command_names_the_modules_to_keep_and_only_when_asked():
    keep = ("transformer.h.2.attn.c_proj", "transformer.h.2.mlp.c_fc")
    cmd = build_command("py", Path("m"), Path("d.jsonl"), Path("idx"), 16, 4, keep)
    assert cmd[:3] == ["py", str(DRIVER), "build"]
    i = cmd.index("--keep_modules")
    assert cmd[i + 1] == "transformer.h.2.attn.c_proj,transformer.h.2.mlp.c_fc"
    assert cmd[cmd.index("--model") + 1] == "m" and cmd[cmd.index("--projection_dim") + 1] == "4"
    every = build_command("py", Path("m"), Path("d.jsonl"), Path("idx"), 16, 4)
    assert "--keep_modules" not in every and "--filter_modules" not in every
    assert cmd[:i] + cmd[i + 2 :] == every  # the option is the only difference
    for bad in ((), ("a,b",), ("",)):
        with pytest.raises(ConfigError):
            build_command("py", Path("m"), Path("d.jsonl"), Path("idx"), 16, 4, bad)


def test_the_driver_leaves_out_every_tracked_module_but_the_kept_ones():
    """The ``--filter_modules`` value, applied as bergson 2.5.1 applies it (a module is left out when any of the
    comma-separated globs matches its name), leaves exactly the kept modules."""
    drv = _driver()
    keep = ["transformer.h.1.mlp.c_proj", "transformer.h.2.attn.c_attn"]
    argv = ["idx", "--model", "m", "--keep_modules", ",".join(keep), "--overwrite", "true"]
    args, names = drv.split_keep(argv)
    assert args == ["idx", "--model", "m", "--overwrite", "true"] and names == keep
    assert drv.split_keep(args) == (args, None)
    pattern = drv.exclude_patterns(TRACKED, keep)
    left = [n for n in TRACKED if not any(fnmatchcase(n, p.strip()) for p in pattern.split(","))]
    assert left == keep
    assert drv.exclude_patterns(TRACKED, TRACKED) == ""  # keeping all leaves nothing out
    with pytest.raises(SystemExit, match="no module named"):
        drv.exclude_patterns(TRACKED, ["transformer.h.9.attn.c_attn"])
    with pytest.raises(SystemExit, match="names no module"):
        drv.split_keep(["idx", "--keep_modules", ","])


FAKE_BERGSON = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
sys.path[:0] = ["bench", "tests"]
import numpy as np
import prismlm.integrations.bergson as B
from claims_attribution import SIZES, Methods
from prismlm.config import ModelConfig, PrototypeConfig
from prismlm.model import PrismLM

calls = {}
def scores(python, run_dir, shards, queries, N, T, work, *, proj_dim=16, threads=None, modules=None):
    calls["scores"] = list(modules) if modules is not None else None
    work.mkdir(parents=True, exist_ok=True)
    (work / "query.jsonl").write_text('{"input_ids": [1]}\\n')
    secs = {"export_s": 1.0, "train_index_s": 1.0, "query_index_s": 1.0, "scores_s": 1.0}
    return np.zeros((len(queries), N)), secs
def build(python, model_dir, dataset, index, T, proj_dim, threads=None, modules=None):
    calls["build"] = list(modules) if modules is not None else None
    return 1.0
B.bergson_scores, B.build_index = scores, build
cfg = ModelConfig(vocab_size=97, block_size=16, n_layer=3, n_head=2, n_embd=16,
                  prototypes=PrototypeConfig(num_prototypes=8, top_k=2))
ctx = SimpleNamespace(log=lambda *a: None, threads=1, seed=0, device="cpu")
shards = SimpleNamespace(train=SimpleNamespace(num_sequences=lambda T: 3))
m = Methods(ctx, SIZES["full"], Path(sys.argv[1]), PrismLM(cfg), shards, [([1, 2], 1)] * 2, Path("run"))
m.bergson("py")
print(json.dumps({"calls": calls, "modules": m.costs["bergson"]["modules"], "ekfac": list(m.finetuned_modules())}))
"""


@pytest.mark.slow  # a subprocess
def test_claims_attribution_gives_bergson_ekfacs_modules(tmp_path):
    """``Methods.bergson`` (bench/claims_attribution.py) passes the fine-tuned blocks' Linear modules — the last
    2 of 3 blocks, not the unembedding — to both bergson calls and records them (bergson's runner faked)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run(
        [sys.executable, "-c", FAKE_BERGSON, str(tmp_path)], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    want = [n for n in TRACKED if n.startswith(("transformer.h.1.", "transformer.h.2."))]
    assert out["calls"] == {"scores": want, "build": want}
    assert out["modules"] == want and out["ekfac"] == want


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("BERGSON_PYTHON"), reason="BERGSON_PYTHON names no venv with bergson==2.5.1")
def test_an_index_of_one_module_holds_that_module_only(tiny_shards, tmp_path):
    """bergson end to end on a tiny run: scores from indexes of one module, whose index holds that module
    alone and fewer gradient dimensions than the index of every module bergson tracks."""
    python = os.environ["BERGSON_PYTHON"]
    ckpt, run = train_tiny_run(tiny_shards, tmp_path, steps=2, batch_size=8, warmup_steps=1)
    tok, T, N = ckpt.tokenizer, ckpt.model.config.block_size, 4
    queries = [([tok.eot_id] + tok.encode(t), s) for t, s in QUERY_TEXTS[:2]]
    one = ("transformer.h.1.attn.c_proj",)
    work = tmp_path / "bergson"
    S, secs = bergson_scores(python, run, tiny_shards, queries, N, T, work, proj_dim=4, threads=1, modules=one)
    assert S.shape == (2, N) and np.isfinite(S).all() and np.abs(S).max() > 0
    assert set(secs) == {"export_s", "train_index_s", "query_index_s", "scores_s"}
    kept = index_modules(work / "train-idx")
    assert list(kept) == list(one) and index_modules(work / "query-idx") == kept
    build_index(python, work / "model", work / "train.jsonl", work / "all-idx", T, 4, threads=1)
    every = index_modules(work / "all-idx")
    assert set(every) == {n for n in TRACKED if not n.startswith("transformer.h.2.")}  # the tiny run has 2 blocks
    assert every[one[0]] == kept[one[0]] and sum(kept.values()) < sum(every.values())
