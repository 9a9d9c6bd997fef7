#!/usr/bin/env python
"""Cost of building the attribution cache vs the prototype index over the same tokens (issue 13: "cache
building no slower than 1.5× the index pass").

On a trained run (default: the cpu-small run, trained first if missing) over the first ``--max-sequences``
training sequences, each build in a fresh child process (its own peak RSS; 1 torch thread): the **index**
(``build_run_index``, no labels), the **default cache** (``build_run_cache`` with ``AttributionConfig()``) and
the **compact cache** (pca-local r = 48, int4, prune 0.1, delta ids). Each row: wall seconds (model loading
excluded), tokens/s, peak RSS, and for caches the curvature and postings seconds, postings and bytes per
token; ``ratio`` = cache seconds ÷ index seconds (goal ≤ 1.5). Rounds alternate the order; medians reported.

Run: ``PYTHONPATH=src python bench/cache_build.py [--run RUN] [--rounds 3]``. Writes
``bench/results/cache_build.json`` and one summary line. A cache's peak RSS counts the pages of its
memory-mapped posting files it touched (page cache, not allocations); the measurements: docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from _common import (
    CPU_SMALL_RUN,
    RESULTS_DIR,
    Json,
    ensure_cpu_small_run,
    environment,
    fmt_rate,
    load_average,
    num,
    warn_if_busy,
    write_json,
)

from prismlm.eval.resources import current_peak_rss_mib

COMPACT = {"projection": "pca-local", "r": 48, "dtype": "int4", "prune": 0.1, "id_encoding": "delta"}
KINDS = ("index", "cache-default", "cache-compact")


def child(args: argparse.Namespace) -> None:
    """Build one artifact (``--child KIND``) and print its measurements as one JSON line."""
    import torch

    from prismlm.app.attribution import build_run_cache
    from prismlm.app.indexing import build_run_index
    from prismlm.app.run import Run
    from prismlm.config import AttributionConfig

    torch.set_num_threads(args.threads)
    run = Run.open(args.run, device=args.device)
    shards = Path(args.shards) if args.shards else None
    out = Path(args.work) / args.child
    t = time.perf_counter()
    row: Json = {"kind": args.child}
    if args.child == "index":
        res = build_run_index(
            run,
            max_sequences=args.max_sequences,
            batch_size=args.batch_size,
            out=out,
            shards=shards,
            labels=False,
            progress=False,
            checkpoint_every=0,
        )
        row["tokens"] = int(res.index.manifest.get("tokens", 0)) or None
    else:
        cfg = AttributionConfig(
            max_sequences=args.max_sequences, batch_size=args.batch_size, curvature_sample=args.curvature_sample
        )
        if args.child == "cache-compact":
            cfg = replace(cfg, projection="pca-local", r=48, dtype="int4", prune=0.1, id_encoding="delta")  # COMPACT
        c = build_run_cache(run, cfg, out=out, shards=shards, progress=False)
        m = c.manifest
        row.update(
            {
                "tokens": int(m["tokens"]),
                "curvature_seconds": m["curvature_seconds"],
                "postings_seconds": m["postings_seconds"],
                "postings": m["postings"],
                "bytes_per_token": m["bytes_per_token"],
                "curvature_tokens": m["curvature_tokens"],
            }
        )
    row["seconds"] = time.perf_counter() - t
    row["peak_rss_mib"] = current_peak_rss_mib()
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(row))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--run", default=str(CPU_SMALL_RUN), help="trained PRISM run folder (default: trained if missing)")
    ap.add_argument("--shards", default="", help="its token shards ('' = the run's)")
    ap.add_argument("--max-sequences", type=int, default=4096, help="training sequences built over")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument(
        "--curvature-sample",
        type=int,
        default=None,
        help="AttributionConfig.curvature_sample (default: the config's default)",
    )
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ", ".join(KINDS))
    ap.add_argument("--rounds", type=int, default=1, help="timed rounds (the order alternates)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each child")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(RESULTS_DIR / "cache_build.json"))
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.curvature_sample is None:
        from prismlm.config import AttributionConfig

        args.curvature_sample = AttributionConfig().curvature_sample
    return args


def run_child(args: argparse.Namespace, kind: str, work: str) -> Json:
    """One build in a fresh process (``--child KIND``): its JSON line."""
    cmd = [sys.executable, __file__, "--child", kind, "--work", work, "--run", args.run, "--shards", args.shards]
    cmd += ["--max-sequences", str(args.max_sequences), "--batch-size", str(args.batch_size)]
    cmd += ["--curvature-sample", str(args.curvature_sample), "--threads", str(args.threads), "--device", args.device]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    row: Json = json.loads(proc.stdout.strip().splitlines()[-1])
    return row


def summarise(rows: list[Json], kinds: list[str]) -> dict[str, Json]:
    """Per kind: median seconds, tokens/s, the largest peak RSS, the manifest's numbers; caches' ratio to the
    index."""
    summary: dict[str, Json] = {}
    for kind in kinds:
        mine = [x for x in rows if x["kind"] == kind]
        sec = statistics.median(num(x, "seconds") for x in mine)
        tokens = next(num(x, "tokens") for x in rows if x.get("tokens"))  # the index and caches cover the same tokens
        summary[kind] = {
            "seconds": sec,
            "tokens_per_s": tokens / sec,
            "peak_rss_mib": max(num(x, "peak_rss_mib") for x in mine),
            **{
                k: statistics.median(num(x, k) for x in mine)
                for k in ("curvature_seconds", "postings_seconds")
                if k in mine[0]
            },
            **{k: mine[0][k] for k in ("tokens", "postings", "bytes_per_token", "curvature_tokens") if k in mine[0]},
        }
    if "index" in summary:
        for kind in kinds:
            if kind != "index":
                summary[kind]["ratio"] = num(summary[kind], "seconds") / num(summary["index"], "seconds")
    return summary


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args)
    if args.run == str(CPU_SMALL_RUN):
        ensure_cpu_small_run(args.run)
    warn_if_busy(args.threads)
    env = environment(args.device, 0)
    kinds = [k for k in args.kinds.split(",") if k]
    rows: list[Json] = []
    with tempfile.TemporaryDirectory(prefix="cache_build_") as work:
        for r in range(args.rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                row = {**run_child(args, kind, work), "round": r}
                rows.append(row)
                print(
                    f"[bench] {kind}: {num(row, 'seconds'):.1f}s, peak RSS {num(row, 'peak_rss_mib'):.0f} MiB",
                    file=sys.stderr,
                )
    summary = summarise(rows, kinds)
    payload = {
        "benchmark": "cache_build",
        "environment": env,
        "load_average_end": load_average(),
        "options": {k: v for k, v in vars(args).items() if k not in ("child", "work")},
        "compact": COMPACT,
        "summary": summary,
        "rows": rows,
    }
    path = write_json(args.out, payload)
    parts = [
        f"{k} {num(v, 'seconds'):.1f}s ({fmt_rate(num(v, 'tokens_per_s'))} tok/s"
        + (f", {num(v, 'ratio'):.2f}× index" if "ratio" in v else "")
        + f", {num(v, 'peak_rss_mib'):.0f} MiB)"
        for k, v in summary.items()
    ]
    tokens = next((num(x, "tokens") for x in rows if x.get("tokens")), 0)
    print(f"cache_build over {tokens:,.0f} training tokens: " + "; ".join(parts) + f" → {path}")


if __name__ == "__main__":
    main()
