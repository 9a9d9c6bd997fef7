#!/usr/bin/env python
"""The explorer (``prism serve``) over HTTP: explain round trip, map drawing, 100 concurrent requests.

What is measured
    ``round_trip``   POST /api/explain of a 128-token text (the first tokens of a validation document) with
                     prototype cards and 3 neighbour snippets per card and 5 alternative tokens per position,
                     from an httpx client to uvicorn on 127.0.0.1 in this process: wall time from request to
                     parsed JSON, after ``--warmup`` untimed calls; median and p90 over ``--repeats``. Next to
                     it, the library call alone (``Explorer.explain``, same arguments) and the bare
                     ``explain_text`` of the application layer, so the HTTP + JSON share is visible.
    ``map``          headless Chromium (Debian's ``/usr/bin/chromium`` via playwright) opens ``/#/map`` of a run
                     with ``--map-prototypes`` (16,384) prototypes: milliseconds from navigation start to the
                     canvas drawn (``performance.now()`` when the last point is painted; the app sets
                     ``data-drawn``), including fetching the map JSON and, on the first call, computing the
                     PCA on the server. Median of ``--map-repeats`` page loads (the first is cold).
    ``concurrent``   ``--concurrent`` (100) explain requests sent at once (asyncio + httpx): how many answered
                     200, the wall time for all, and the process's peak RSS before and after (the server runs
                     in this process; model calls are serialised, at most ``Limits.max_waiting`` wait).

    The run: ``--run RUN`` (with its index, if any), or a ``--preset`` (cpu-small) run trained for ``--steps``
    steps on the built-in corpus (speed does not depend on training) into ``bench/runs/explorer-*`` and
    indexed over ``--index-sequences`` training sequences. The map run is the same preset with
    ``model.prototypes.num_prototypes`` = ``--map-prototypes``, trained one step.

How to read it
    The issue's targets: round trip <= 150 ms at cpu-small, map drawn within 2 s, 100 concurrent requests
    without error or unbounded memory. On the shared 2-core dev machine timings are noisy (the load average
    is recorded); ``--threads 1`` (default) is the stable setting. Output: JSON at ``--out`` (default
    ``bench/results/explorer.json``) and one summary line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS_DIR, RUNS_DIR, environment, load_average, parse_sets, warn_if_busy, write_json

from prismlm.app import ExplanationRequest, Run, build_run_index, explain_text
from prismlm.app.explorer import Explorer, Limits
from prismlm.config import RunConfig
from prismlm.data.shards import prepare_shards
from prismlm.eval.resources import current_peak_rss_mib
from prismlm.train import train
from prismlm.train.trainer import round_vocab
from prismlm.web.server import create_app

CHROMIUM = "/usr/bin/chromium"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """uvicorn serving an app on a free 127.0.0.1 port in a thread of this process."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise SystemExit("uvicorn did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def make_run(folder: Path, cfg: RunConfig, shards: Any, steps: int, batch_size: int) -> Path:
    """Train ``cfg`` for ``steps`` steps into ``folder`` (reused when its checkpoint is there)."""
    if not (folder / "checkpoints").exists():
        cfg = cfg.override(
            {
                "train.max_steps": steps,
                "train.eval_interval": max(steps, 1000),
                "train.batch_size": batch_size,
                "train.warmup_steps": 1,
                "model.vocab_size": round_vocab(shards.tokenizer.vocab_size),
            }
        )
        train(cfg, folder, shards=shards, progress=False, overwrite=True)
    return folder


def stats_ms(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "median_ms": 1000 * statistics.median(s),
        "p90_ms": 1000 * s[min(len(s) - 1, int(0.9 * len(s)))],
        "min_ms": 1000 * s[0],
        "n": len(s),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--run", type=Path, default=None, help="an existing run (default: train a --preset run)")
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--steps", type=int, default=10, help="training steps of the bench's own run")
    ap.add_argument("--batch-size", type=int, default=4, help="training batch size of the bench's own run")
    ap.add_argument("--index-sequences", type=int, default=256, help="sequences indexed for the bench's own run")
    ap.add_argument("--max-docs", type=int, default=60, help="documents of the built-in corpus to tokenize")
    ap.add_argument("--tokens", type=int, default=128, help="tokens of the explained text")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--map-prototypes", type=int, default=16384, help="prototypes of the map run (0: skip the map)")
    ap.add_argument("--map-repeats", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=100, help="requests sent at once (0: skip)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override of the bench's own run",
    )
    ap.add_argument("--out", default=str(RESULTS_DIR / "explorer.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    env = environment("cpu", 0)
    import httpx

    cfg = RunConfig.from_name(args.preset).override(parse_sets(args.sets))
    shards = prepare_shards("builtin", cfg.data.tokenizer, max_docs=args.max_docs, show_progress=False)
    if args.run is None:
        run_dir = make_run(RUNS_DIR / f"explorer-{args.preset}", cfg, shards, args.steps, args.batch_size)
        if not (run_dir / "index" / "manifest.json").exists():
            build_run_index(
                Run.open(run_dir, device="cpu"), max_sequences=args.index_sequences, progress=False, shards=shards.root
            )
    else:
        run_dir = args.run
    limits = Limits(max_generate=256, max_waiting=max(256, 2 * args.concurrent))
    ex = Explorer.open(run_dir, device="cpu", limits=limits)
    tok = ex.run.tokenizer
    ids = [int(t) for t in ex.shards().val.tokens[: args.tokens * 4]][: args.tokens]
    text = tok.decode(ids)
    n_tokens = len(tok.encode(text))
    body = {"text": text, "alternatives": 5, "neighbours": 3}
    result: dict[str, Any] = {
        "run": str(run_dir),
        "preset": args.preset,
        "threads": args.threads,
        "text_tokens": n_tokens,
        "has_index": ex.index is not None,
    }

    # ----- round trip ------------------------------------------------------------------------------------
    with Served(create_app(ex)) as base, httpx.Client(base_url=base, timeout=120) as client:
        for _ in range(args.warmup):
            assert client.post("/api/explain", json=body).status_code == 200
        http, lib, bare = [], [], []
        size = 0
        for _ in range(args.repeats):  # interleaved: a drift in machine speed hits all three
            t = time.perf_counter()
            r = client.post("/api/explain", json=body)
            d = r.json()
            http.append(time.perf_counter() - t)
            size = len(r.content)
            assert r.status_code == 200 and d["cards"], d
            t = time.perf_counter()
            ex.explain(text, alternatives=5, neighbours=3)
            lib.append(time.perf_counter() - t)
            t = time.perf_counter()
            explain_text(ex.run, text, ExplanationRequest(neighbours=3))
            bare.append(time.perf_counter() - t)
        result["round_trip"] = {
            **stats_ms(http),
            "response_bytes": size,
            "cards": len(d["cards"]),
            "explorer_call": stats_ms(lib),
            "explain_text_call": stats_ms(bare),
        }

        # ----- concurrent requests -----------------------------------------------------------------------
        if args.concurrent:
            rss0 = current_peak_rss_mib()

            async def burst() -> list[int]:
                async with httpx.AsyncClient(
                    base_url=base, timeout=600, limits=httpx.Limits(max_connections=args.concurrent)
                ) as ac:
                    rs = await asyncio.gather(
                        *[ac.post("/api/explain", json=body) for _ in range(args.concurrent)], return_exceptions=True
                    )
                return [r.status_code if isinstance(r, httpx.Response) else -1 for r in rs]

            t = time.perf_counter()
            codes = asyncio.run(burst())
            wall = time.perf_counter() - t
            result["concurrent"] = {
                "requests": args.concurrent,
                "ok": codes.count(200),
                "errors": len(codes) - codes.count(200),
                "status_codes": {str(c): codes.count(c) for c in sorted(set(codes))},
                "wall_s": wall,
                "peak_rss_before_mib": rss0,
                "peak_rss_after_mib": current_peak_rss_mib(),
            }

    # ----- the map, in headless Chromium ---------------------------------------------------------------------
    if args.map_prototypes:
        from playwright.sync_api import sync_playwright

        K = args.map_prototypes
        map_cfg = cfg.override({"model.prototypes.num_prototypes": K})
        map_dir = make_run(RUNS_DIR / f"explorer-{args.preset}-map-{K}", map_cfg, shards, 1, 2)
        mex = Explorer.open(map_dir, device="cpu", limits=limits)
        loads = []
        with Served(create_app(mex)) as base, sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1320, "height": 900})
            for _ in range(args.map_repeats):
                page.goto("about:blank")
                page.goto(base + "/#/map")
                page.wait_for_selector("#map-canvas[data-drawn]", timeout=120_000)
                loads.append(page.evaluate("window.__prismMapDrawnAt") / 1000.0)
                assert page.get_attribute("#map-canvas", "data-drawn") == str(K)
            browser.close()
        result["map"] = {"prototypes": K, "cold_ms": 1000 * loads[0], **stats_ms(loads), "method": mex.map().method}

    result["load_average_end"] = load_average()
    result["environment"] = env
    out = write_json(args.out, result)
    rt = result["round_trip"]
    line = (
        f"explorer {args.preset}: explain {n_tokens} tokens round trip {rt['median_ms']:.0f} ms median "
        f"(library {rt['explorer_call']['median_ms']:.0f} ms, explain_text {rt['explain_text_call']['median_ms']:.0f} ms)"
    )
    if "map" in result:
        line += f"; map of {result['map']['prototypes']:,} drawn in {result['map']['median_ms']:.0f} ms"
    if "concurrent" in result:
        c = result["concurrent"]
        line += (
            f"; {c['ok']}/{c['requests']} concurrent OK in {c['wall_s']:.1f} s, peak RSS "
            f"{c['peak_rss_after_mib']:.0f} MiB"
        )
    print(line + f" → {out}")


if __name__ == "__main__":
    main()
