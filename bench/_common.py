"""Helpers shared by the benchmark scripts: results paths, ``--set`` parsing, environment info, JSON output.

Not a public API; the scripts import it as a sibling module (``python bench/x.py`` puts ``bench/`` on
``sys.path``).
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from prismlm.train.distributed import DistInfo
from prismlm.train.records import environment_info

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
RUNS_DIR = BENCH_DIR / "runs"


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """``["train.lr=1e-3", "model.prototypes.top_k=4"]`` → ``{"train.lr": 0.001, ...}``.

    Values are parsed as JSON (numbers, ``true``/``false``, ``null``, lists); anything that is not valid
    JSON is kept as a string, so ``--set data.tokenizer=gpt2`` works without quotes.
    """
    out: dict[str, Any] = {}
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


def environment(device: torch.device | str, seed: int) -> dict[str, Any]:
    """The trainer's environment record (git revision, package versions incl. torch, platform, device,
    threads, command, start date) plus the exact shell command line and the CPU count."""
    device = torch.device(device)
    env = environment_info(DistInfo(), device, seed)
    env["command_line"] = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    env["cpu_count"] = os.cpu_count()
    env["torch_version"] = torch.__version__
    env["load_average_start"] = load_average()
    return env


def profile_from_args(profiles: dict[str, dict[str, Any]], args: Any) -> dict[str, Any]:
    """The ``quick`` or ``default`` profile (by ``args.quick``), each key overridden by the command-line
    option of the same name when it was given (not None)."""
    prof = dict(profiles["quick" if getattr(args, "quick", False) else "default"])
    for key in prof:
        value = getattr(args, key, None)
        if value is not None:
            prof[key] = value
    return prof


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


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process, so the next reading covers only what
    runs after it. Returns False where not supported (then readings are peaks since process start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_peak_rss_mib() -> float:
    """VmHWM (peak RSS since the last ``reset_peak_rss``) in MiB; falls back to ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return peak_rss_mib()


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (with a ``finished`` timestamp added) atomically: to ``path.tmp``, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**payload, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


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
