"""Run bergson (EleutherAI, ``bergson==2.5.1``) on a ``prism export``ed model, from bergson's own venv.

Run by ``prismlm.integrations.bergson`` (by its path, outside the package): ``PYTHON bergson_driver.py build ARGS...`` runs
``bergson build ARGS...``; ``PYTHON bergson_driver.py scores TRAIN_IDX QUERY_IDX OUT.npy`` writes the
(queries × training sequences) dot products of the two indexes' projected gradients.

``build ... --keep_modules A,B,...`` (this driver's option, not bergson's) collects the gradients of the named
modules only. bergson hooks the modules of ``model.base_model``, here the ``PrismLM`` itself, so the names are
``PrismLM.named_modules()``'s (``transformer.h.1.attn.c_proj``; no ``prism.`` prefix). bergson 2.5.1 cannot name
the modules to keep (its ``target_modules`` is set only from a PEFT adapter); it can name those to leave out:
``--filter_modules``, comma-separated glob patterns. So the driver lists every module bergson would track
(bergson's own ``discover_targets``, on the model built on the meta device: no weights read) and passes all but
the kept ones, each name a pattern that matches only itself.

Two workarounds, both needed with bergson 2.5.1 and this package's export: ``prismlm`` must be importable
(the export's ``modeling_prism.py`` imports it — the caller puts ``src`` on PYTHONPATH), and bergson reads
``model.base_model.device``, where the export's ``base_model`` is the raw ``PrismLM`` module (no ``.device``),
so the property is added here. And run as a script, this file's folder comes first on ``sys.path``, where
``bergson.py`` (prismlm's runner) would shadow the bergson package: the folder is taken off before the import.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

KEEP = "--keep_modules"


def split_keep(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``argv`` without ``--keep_modules A,B,...``, and the named modules (None when the option is absent)."""
    if KEEP not in argv:
        return argv, None
    i = argv.index(KEEP)
    if i + 1 >= len(argv):
        raise SystemExit(f"bergson_driver: {KEEP} needs a comma-separated list of module names")
    names = [n for n in argv[i + 1].split(",") if n]
    if not names:
        raise SystemExit(f"bergson_driver: {KEEP} names no module")
    return argv[:i] + argv[i + 2 :], names


def exclude_patterns(tracked: list[str], keep: list[str]) -> str:
    """bergson's ``--filter_modules`` value that leaves exactly ``keep`` of ``tracked`` (every module bergson
    would hook): the other names, comma-separated ("" when every tracked module is kept)."""
    unknown = sorted(set(keep) - set(tracked))
    if unknown:
        raise SystemExit(f"bergson_driver: bergson tracks no module named {unknown} (it tracks {tracked})")
    if any(c in n for n in tracked for c in "*?[,"):  # each name must be a glob that matches only itself
        raise SystemExit(f"bergson_driver: a module name is not a literal glob pattern: {tracked}")
    kept = set(keep)
    return ",".join(n for n in tracked if n not in kept)


def tracked_modules(model: str, trust_remote_code: bool = True) -> list[str]:
    """The modules ``bergson build --model model`` hooks by default, in order: bergson's own discovery on the
    model's ``base_model``, built from its config on the meta device."""
    import torch
    from bergson.collector.collector import HookCollectorBase
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
    return list(HookCollectorBase.discover_targets(net.base_model))


def build(argv: list[str]) -> None:
    """``bergson build argv...``, ``--keep_modules`` turned into ``--filter_modules``."""
    from prismlm.model import PrismLM

    PrismLM.device = property(lambda self: next(self.parameters()).device)  # type: ignore[attr-defined]
    args, keep = split_keep(argv)
    if keep is not None:
        if "--filter_modules" in args:
            raise SystemExit(f"bergson_driver: give {KEEP} or --filter_modules, not both")
        if "--model" not in args:
            raise SystemExit(f"bergson_driver: {KEEP} needs --model (the modules are the model's)")
        pattern = exclude_patterns(tracked_modules(args[args.index("--model") + 1]), keep)
        if pattern:
            args += ["--filter_modules", pattern]
    sys.argv = ["bergson", "build", *args]
    runpy.run_module("bergson", run_name="__main__")


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != here]
    if sys.argv[1] == "scores":
        import numpy as np
        from bergson import load_gradients

        g = np.asarray(load_gradients(sys.argv[2]), dtype=np.float64)  # (N, projected dims)
        q = np.asarray(load_gradients(sys.argv[3]), dtype=np.float64)  # (Q, projected dims)
        np.save(sys.argv[4], q @ g.T)
    elif sys.argv[1] == "build":
        build(sys.argv[2:])
    else:
        raise SystemExit(f"bergson_driver: unknown command {sys.argv[1]!r} (build or scores)")
