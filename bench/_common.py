"""Helpers shared by the benchmark scripts: results paths, the ``--set`` option, profiles, environment info,
timing and memory readings, JSON output; the claims stages' context and options (``real_claims.py``).

Not a public API; the scripts import it as a sibling module (``python bench/x.py`` puts ``bench/`` on
``sys.path``). The one module a script imports besides ``prismlm`` (tests/test_architecture.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar, cast

import torch

from prismlm.app.demos import DEMO_OVERRIDES, DEMO_PROTOTYPES, DEMO_TOP_K
from prismlm.app.run import Run
from prismlm.control.judges import FortuneSplits, fortune_splits
from prismlm.errors import CheckpointError
from prismlm.tda.planted import PlantedCorpus, build_planted_corpus
from prismlm.train.checkpoint import find_checkpoint
from prismlm.train.distributed import DistInfo
from prismlm.train.records import environment_info

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
RUNS_DIR = BENCH_DIR / "runs"
ATTRIBUTION_MODEL_SETS: dict[str, object] = {
    "model.n_embd": 64,
    "model.prototypes.num_prototypes": 128,
    "model.prototypes.top_k": 4,
    "train.eval_interval": 100000,
    "train.eval_batches": 1,
    "train.log_interval": 100000,
}
"""The overrides of the attribution benches' model (attribution.py and attribution_costs.py): d=64, K=128."""
Json = dict[str, object]
"""A JSON object as the scripts build it (values: numbers, strings, lists and nested objects)."""
P = TypeVar("P", bound=Mapping[str, object])
R = TypeVar("R")


def add_set_option(ap: argparse.ArgumentParser, help: str = "config override, e.g. model.n_embd=128") -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.sets``: config overrides (parsed by ``parse_sets``)."""
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help=help)


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the one summary line)."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); a no-op on CPU. Around every timed region on a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_on(device: torch.device, f: Callable[[], R]) -> tuple[float, R]:
    """(seconds, result) of ``f()`` on ``device``, synchronised before and after."""
    sync(device)
    t = time.perf_counter()
    r = f()
    sync(device)
    return time.perf_counter() - t, r


def parse_sets(items: list[str] | None) -> dict[str, object]:
    """``["train.lr=1e-3", "model.prototypes.top_k=4"]`` → ``{"train.lr": 0.001, ...}``.

    Values are parsed as JSON (numbers, ``true``/``false``, ``null``, lists); anything that is not valid
    JSON is kept as a string, so ``--set data.tokenizer=gpt2`` works without quotes.
    """
    out: dict[str, object] = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key.strip()] = value
    return out


def environment(device: torch.device | str, seed: int) -> Json:
    """The trainer's environment record (git revision, package versions incl. torch, platform, device,
    threads, command, start date) plus the exact shell command line and the CPU count."""
    device = torch.device(device)
    env: Json = dict(environment_info(DistInfo(), device, seed))
    env["command_line"] = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    env["cpu_count"] = os.cpu_count()
    env["torch_version"] = torch.__version__
    env["load_average_start"] = load_average()
    return env


def profile_from_args(profiles: Mapping[str, P], args: argparse.Namespace) -> P:
    """The ``quick`` or ``default`` profile (by ``args.quick``), each key overridden by the command-line
    option of the same name when it was given (not None)."""
    prof = dict(profiles["quick" if getattr(args, "quick", False) else "default"])
    for key in prof:
        value = getattr(args, key, None)
        if value is not None:
            prof[key] = value
    return cast(P, prof)  # the same keys, each value of its option's type


def load_average() -> list[float] | None:
    """1/5/15-minute load averages (None where unsupported): how busy the machine was around a timing."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def warn_if_busy(threads: int) -> None:
    """Warn when other processes already keep the CPUs busy: with more torch threads than free cores,
    OpenMP threads wait on each other at every parallel region and a step can be 10–100× slower (on the
    2-core dev machine, a d=64 model ran at ~0.6k tok/s with 2 threads vs ~40k with 1 while a neighbour
    trained). Timings are then not comparable across runs; ratios are still taken in the same conditions."""
    la, ncpu = load_average(), os.cpu_count() or 1
    if la is not None and la[0] + threads > ncpu + 0.5:
        print(
            f"[bench] warning: load average {la[0]:.2f} on {ncpu} CPUs before starting, with {threads} torch "
            f"thread(s) requested: the CPUs are shared, timings will be noisy and may be far slower than on an "
            f"idle machine; consider --threads {max(1, ncpu - round(la[0]))}",
            file=sys.stderr,
        )


def write_json(path: str | Path, payload: Mapping[str, object]) -> Path:
    """Write ``payload`` (with a ``finished`` timestamp added) atomically: to ``path.tmp``, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**payload, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def find_key(obj: object, key: str) -> object:
    """The first value of ``key`` in nested dicts (depth first), or None."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            found = find_key(v, key)
            if found is not None:
                return found
    return None


def obj(x: object, *keys: str) -> Json:
    """The JSON object at ``x[k0][k1]…`` (asserted to be one): typed access into nested results."""
    for k in keys:
        assert isinstance(x, dict), x
        x = x[k]
    assert isinstance(x, dict), x
    return x


def num(x: object, *keys: str) -> float:
    """The number at ``x[k0][k1]…`` (asserted to be one)."""
    for k in keys:
        assert isinstance(x, dict), x
        x = x[k]
    assert isinstance(x, int | float), x
    return float(x)


def results_number(name: str, key: str) -> Json:
    """A headline number from another bench's JSON, with the file and its git revision (and whether the
    working tree differs from it), or null and why."""
    path = RESULTS_DIR / name
    rec: Json = {"source": f"bench/results/{name}", "value": None}
    if not path.exists():
        rec["note"] = f"{rec['source']} absent when this bench ran"
        return rec
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        rec["note"] = f"unreadable: {e}"
        return rec
    rec["value"], rec["field"] = find_key(data, key), key
    fit = data.get("fit") if isinstance(data, dict) else None
    if rec["value"] is None and key == "query_time_exponent" and isinstance(fit, dict) and "approx" in fit:
        # bench/attribution_scaling.py: time ≈ a · tokens^b fitted for the approximate search and the exact scan
        approx, exact = fit["approx"], fit.get("exact", {})
        rec["value"], rec["field"] = approx.get("b") if isinstance(approx, dict) else None, "fit.approx.b"
        rec["exact_scan_exponent"] = exact.get("b") if isinstance(exact, dict) else None
    if rec["value"] is None:
        rec["note"] = f"no {key!r} in {rec['source']}"
    rec["profile"] = data.get("profile") if isinstance(data, dict) else None
    env = data.get("environment") if isinstance(data, dict) else None
    rec["measured_at_revision"] = env.get("git_revision") if isinstance(env, dict) else None  # the code it timed
    root = RESULTS_DIR.parent.parent
    try:
        rev = subprocess.run(
            ["git", "log", "-1", "--format=%H", "--", str(path)], cwd=root, capture_output=True, text=True, timeout=20
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", str(path)], cwd=root, capture_output=True, text=True, timeout=20
        ).stdout.strip()
        rec["git_revision"] = rev or None
        rec["uncommitted"] = bool(dirty)
    except (OSError, subprocess.SubprocessError) as e:
        rec["git_revision"] = None
        rec["note"] = (str(rec.get("note", "")) + f" git: {e}").strip()
    return rec


def fmt_rate(x: float) -> str:
    """41234.5 → '41.2k'; 1.5e6 → '1.50M'."""
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


CPU_SMALL_RUN = RUNS_DIR / "cpu-small"
"""The trained cpu-small PRISM run (d=128, 4 layers, K=512, k=8, 600 steps on the built-in corpus: 4.85 M
training tokens) that the attribution-at-scale benches build caches on."""


def planted_corpus(work: Path, prof: Mapping[str, object], seed: int) -> PlantedCorpus:
    """The attribution benches' planted-fact corpus (``prismlm.tda.planted``), built once under ``work`` in a
    folder named by ``prof``'s background documents, facts and copies and the seed."""
    bg, facts, copies, chars = (int(num(prof, k)) for k in ("background", "facts", "copies", "doc_chars"))
    return build_planted_corpus(
        work / f"corpus-b{bg}-f{facts}x{copies}-s{seed}",
        n_facts=facts,
        copies=copies,
        n_background=bg,
        doc_chars=chars,
        seed=seed,
    )


def ensure_cpu_small_run(path: str | Path = CPU_SMALL_RUN) -> Path:
    """``path`` if it holds a run, else trains it there first: ``prism train --preset cpu-small --out PATH``
    (~10 min on one core; the same command reproduces it)."""
    path = Path(path)
    if not (path / "checkpoints").exists():
        from prismlm.app.training import ConfigChoice, train_from_options

        print(
            f"[bench] training the cpu-small run → {path} (prism train --preset cpu-small --out {path})",
            file=sys.stderr,
        )
        train_from_options(ConfigChoice(preset="cpu-small"), out=path, progress=False)
    return path


# ----- the claims benches (bench/real_claims.py and its stage scripts bench/claims_<stage>.py) --------------
CLAIMS_STAGES = ("bank", "suppression", "controllers", "attribution", "explanations")
"""The stages of ``real_claims.py``, in dependency order; stage S is the script ``bench/claims_S.py``."""
CLAIMS_HEADS: dict[str, tuple[str, ...]] = {"paper": (), "faithful": DEMO_OVERRIDES}
"""The bank's objective per ``--head``: ``paper`` the paper's relu(cos) head trained on REC, R1 and R2 alone (the
first run's), ``faithful`` the same plus the prototype-only KL (the retrofit recipe ``prism demo`` uses,
``prismlm.app.demos.DEMO_OVERRIDES``); config overrides of every retrofit the stages make (the bank and the
attribution fine-tune), on the same anchor set."""


def head_tag(head: str) -> str:
    """The suffix of a head's files and folders: ``""`` for ``paper`` (the first run's names), else ``-<head>``."""
    return "" if head == "paper" else f"-{head}"


@dataclass(frozen=True)
class BankSize:
    """How big the anchor corpus and the bank are (``--quick``: a smoke size)."""

    gutenberg_docs: int
    sotu_docs: int
    clean_fortunes: int
    offensive_fortunes: int
    kjv_docs: int
    """King James Bible documents of ``kjv.jsonl`` (the style concept the model clearly shows)."""
    chars_per_doc: int
    prototypes: int
    top_k: int
    steps: int
    block_size: int


BANK_SIZES = {
    # Why these counts: the concept must be a sizeable share of the anchor tokens or no prototype
    # specialises on it (bench/suppression.py), and the one z pass over them costs ~250 tokens/s here.
    # kjv_docs: the KJV documents the every-7th Gutenberg draw happens to hold are ~2.5% of the anchor
    # tokens, too few for a strong cut of the judged style; 24 documents make it ~12% (docs/results.md,
    # "Suppression").
    "quick": BankSize(8, 8, 120, 60, 3, 1500, 256, 8, 40, 128),
    "full": BankSize(40, 40, 1200, 600, 24, 3000, 2048, 8, 400, 128),
    # the faithful head at full size is the kept recipe of the faithful-head issue (prism demo's K=8,192 and
    # k=32, DEMO_PROTOTYPES / DEMO_TOP_K) on the same anchor set; the paper head keeps the first run's K=2,048,
    # k=8, so its rows are the "before" the earlier files measured
    "full-faithful": BankSize(40, 40, 1200, 600, 24, 3000, DEMO_PROTOTYPES, DEMO_TOP_K, 400, 128),
}


@dataclass
class ClaimsContext:
    """What every stage of ``real_claims.py`` gets."""

    quick: bool
    threads: int
    work: Path
    """``bench/runs/real-claims[-quick]``: each stage writes under ``work / <stage>``; ``work / bank / run``
    is the retrofitted model (built by the ``bank`` stage)."""
    seed: int = 0
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)
    options: argparse.Namespace = field(default_factory=argparse.Namespace)
    """The parsed command line (a stage's own options, added by ``run_claims_stage``'s ``add_options``)."""
    head: str = "paper"
    """Which head the bank trains (``CLAIMS_HEADS``); ``work`` is already that head's folder."""

    @property
    def head_overrides(self) -> list[str]:
        """The config overrides of this head's retrofits (``CLAIMS_HEADS``)."""
        return list(CLAIMS_HEADS[self.head])

    @property
    def size(self) -> BankSize:
        if self.quick:
            return BANK_SIZES["quick"]
        return BANK_SIZES["full-faithful" if self.head == "faithful" else "full"]

    def stage_dir(self, name: str) -> Path:
        d = self.work / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    @property
    def corpus_dir(self) -> Path:
        """The anchor corpus (one jsonl per source, written by the ``bank`` stage)."""
        return self.work / "bank" / "corpus"

    @property
    def bank_run(self) -> Path:
        """The retrofitted model's run folder."""
        return self.work / "bank" / "run"

    def open_run(self, suppress: str | Path | None = None) -> Run:
        """The retrofitted model (``bank`` stage first), on ``device``."""
        if not has_checkpoint(self.bank_run):
            sys.exit(f"[real-claims] {self.bank_run} holds no model yet: run the bank stage first (claims_bank.py)")
        return Run.open(self.bank_run, device=self.device, suppress=suppress)

    def fortunes(self) -> FortuneSplits:
        """The FreeBSD fortunes, split: the LM split feeds the anchor corpus, the judge split never does."""
        return fortune_splits()

    def log(self, message: str) -> None:
        print(f"[real-claims] {message}", file=sys.stderr, flush=True)


def has_checkpoint(folder: Path) -> bool:
    try:
        find_checkpoint(folder)
    except CheckpointError:
        return False
    return True


def claims_args(
    stage: str,
    description: str | None,
    argv: list[str] | None = None,
    add_options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The options every claims stage script takes (``real_claims.py`` passes its own to each), plus the stage's
    own (``add_options``)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if add_options is not None:
        add_options(ap)
    ap.add_argument("--quick", action="store_true", help="the CI smoke size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--work", type=Path, default=None, help="scratch folder (default bench/runs/real-claims[-quick]; + -HEAD)"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help=f"default bench/results/real-claims[-quick][-HEAD]-{stage}.json"
    )
    ap.add_argument(
        "--head",
        choices=CLAIMS_HEADS,
        default="paper",
        help="the bank's head: paper (relu(cos), REC+R1+R2) or faithful (+ prototype-only KL, prism demo's recipe); "
        "each head has its own work folder (WORK-faithful) and files; the paper's keep the first run's names",
    )
    ap.add_argument(
        "--environment",
        default=None,
        metavar="JSON",
        help="the run's environment record (real_claims.py reads it once, before any stage writes into the "
        "tracked bench/results, so that later stages do not record a '-dirty' revision); default: read now",
    )
    return ap.parse_args(argv)


def claims_work(quick: bool, work: Path | None, head: str = "paper") -> Path:
    """The claims' scratch folder of ``head``: ``work``, or ``bench/runs/real-claims[-quick]``, with
    ``head_tag(head)`` appended (each head retrofits its own bank on the same anchor set)."""
    base = work or RUNS_DIR / f"real-claims{'-quick' if quick else ''}"
    return base.with_name(base.name + head_tag(head))


def run_claims_stage(
    stage: str,
    fn: Callable[[ClaimsContext], Json],
    description: str | None,
    argv: list[str] | None = None,
    add_options: Callable[[argparse.ArgumentParser], None] | None = None,
    variant: Callable[[argparse.Namespace], str] = lambda _: "",
) -> Path:
    """A stage script's ``main``: parse the options (``add_options``: the stage's own), run ``fn`` and write its
    JSON (``stage``, the result, ``seconds`` and the environment with this stage's start load) to ``--out``,
    by default ``real-claims[-quick][-<head>]-<stage><variant(args)>.json`` (a variant does not replace the stage's
    file; the paper's head has no tag), with ``head`` after the result."""
    args = claims_args(stage, description, argv, add_options)
    torch.set_num_threads(args.threads)
    stem = f"real-claims{'-quick' if args.quick else ''}{head_tag(args.head)}"
    out = args.out or RESULTS_DIR / f"{stem}-{stage}{variant(args)}.json"
    work = claims_work(args.quick, args.work, args.head)
    ctx = ClaimsContext(args.quick, args.threads, work, device=args.device, head=args.head)
    ctx.options = args
    env: Json = json.loads(args.environment) if args.environment else environment(args.device, 0)
    env["load_average_start"] = load_average()
    ctx.log(f"{stage}: starting")
    t0 = time.perf_counter()
    result = fn(ctx)
    record = {"stage": stage, **result, "head": args.head, "head_overrides": ctx.head_overrides}
    write_json(out, {**record, "seconds": round(time.perf_counter() - t0, 1), "environment": env})
    ctx.log(f"{stage}: done in {time.perf_counter() - t0:.0f} s → {out}")
    return out
