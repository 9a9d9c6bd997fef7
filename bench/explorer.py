#!/usr/bin/env python
"""The explorer (``prism serve``) over HTTP: explain round trip, map drawing, 100 concurrent requests.

``round_trip``: POST /api/explain of a 128-token text (cards, 3 neighbour snippets, 5 alternatives) from an
httpx client to uvicorn in this process, median and p90, beside the library call alone (``Explorer.explain``)
and ``explain_text``. ``map``: headless Chromium opens ``/#/map`` of a run with ``--map-prototypes`` prototypes;
milliseconds from navigation to the canvas drawn. ``concurrent``: ``--concurrent`` explain requests at once;
how many answered 200, the wall time, peak RSS before and after. The run: ``--run RUN`` or a ``--preset`` run
trained ``--steps`` steps (speed does not depend on training) and indexed.

Run: ``PYTHONPATH=src python bench/explorer.py [--run RUN] [--threads 1]``. Writes ``bench/results/explorer.json``
and one summary line. The issue's targets (round trip ≤ 150 ms at cpu-small, map within 2 s, 100 concurrent
requests without error or unbounded memory) and the measurements: docs/explorer.md.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import torch
from _common import (
    RESULTS_DIR,
    RUNS_DIR,
    Json,
    add_set_option,
    environment,
    load_average,
    num,
    obj,
    parse_sets,
    warn_if_busy,
    write_json,
)

from prismlm.app import ExplanationRequest, Run, build_run_index, explain_text
from prismlm.app.explorer import Explorer, Limits
from prismlm.config import RunConfig
from prismlm.data.shards import ShardSet, prepare_shards
from prismlm.eval.resources import current_peak_rss_mib
from prismlm.train import train
from prismlm.train.state import round_vocab
from prismlm.web.server import create_app

CHROMIUM = "/usr/bin/chromium"
ASGIApp = Callable[..., Awaitable[None]]  # what uvicorn serves


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """uvicorn serving an app on a free 127.0.0.1 port in a thread of this process."""

    def __init__(self, app: ASGIApp) -> None:
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


def make_run(folder: Path, cfg: RunConfig, shards: ShardSet, steps: int, batch_size: int) -> Path:
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


def parse_args() -> argparse.Namespace:
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
    add_set_option(ap, "config override of the bench's own run")
    ap.add_argument("--out", default=str(RESULTS_DIR / "explorer.json"))
    return ap.parse_args()


def round_trip(client: httpx.Client, ex: Explorer, text: str, body: Json, args: argparse.Namespace) -> Json:
    """HTTP round trip vs the library call vs ``explain_text``, interleaved (a drift in machine speed hits all
    three), after ``--warmup`` untimed calls."""
    for _ in range(args.warmup):
        assert client.post("/api/explain", json=body).status_code == 200
    http, lib, bare = [], [], []
    size = 0
    d: Json = {}
    for _ in range(args.repeats):
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
    cards = d["cards"]
    assert isinstance(cards, list)
    return {
        **stats_ms(http),
        "response_bytes": size,
        "cards": len(cards),
        "explorer_call": stats_ms(lib),
        "explain_text_call": stats_ms(bare),
    }


def concurrent(base: str, body: Json, n: int) -> Json:
    """``n`` explain requests sent at once: status codes, wall time, peak RSS before and after."""
    rss0 = current_peak_rss_mib()

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=n)) as ac:
            rs = await asyncio.gather(*[ac.post("/api/explain", json=body) for _ in range(n)], return_exceptions=True)
        return [r.status_code if isinstance(r, httpx.Response) else -1 for r in rs]

    t = time.perf_counter()
    codes = asyncio.run(burst())
    wall = time.perf_counter() - t
    return {
        "requests": n,
        "ok": codes.count(200),
        "errors": len(codes) - codes.count(200),
        "status_codes": {str(c): codes.count(c) for c in sorted(set(codes))},
        "wall_s": wall,
        "peak_rss_before_mib": rss0,
        "peak_rss_after_mib": current_peak_rss_mib(),
    }


def map_drawing(args: argparse.Namespace, cfg: RunConfig, shards: ShardSet, limits: Limits) -> Json:
    """Page loads of ``/#/map`` of a ``--map-prototypes`` run (trained one step) in headless Chromium."""
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
    return {"prototypes": K, "cold_ms": 1000 * loads[0], **stats_ms(loads), "method": mex.map().method}


def summary_line(args: argparse.Namespace, result: Json, n_tokens: int, out: Path) -> str:
    rt = obj(result, "round_trip")
    line = (
        f"explorer {args.preset}: explain {n_tokens} tokens round trip {num(rt, 'median_ms'):.0f} ms median "
        f"(library {num(rt, 'explorer_call', 'median_ms'):.0f} ms, explain_text "
        f"{num(rt, 'explain_text_call', 'median_ms'):.0f} ms)"
    )
    if "map" in result:
        line += f"; map of {num(result, 'map', 'prototypes'):,.0f} drawn in {num(result, 'map', 'median_ms'):.0f} ms"
    if "concurrent" in result:
        c = obj(result, "concurrent")
        line += (
            f"; {c['ok']}/{c['requests']} concurrent OK in {num(c, 'wall_s'):.1f} s, peak RSS "
            f"{num(c, 'peak_rss_after_mib'):.0f} MiB"
        )
    return line + f" → {out}"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    env = environment("cpu", 0)
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
    body: Json = {"text": text, "alternatives": 5, "neighbours": 3}
    result: Json = {
        "run": str(run_dir),
        "preset": args.preset,
        "threads": args.threads,
        "text_tokens": n_tokens,
        "has_index": ex.index is not None,
    }
    with Served(create_app(ex)) as base, httpx.Client(base_url=base, timeout=120) as client:
        result["round_trip"] = round_trip(client, ex, text, body, args)
        if args.concurrent:
            result["concurrent"] = concurrent(base, body, args.concurrent)
    if args.map_prototypes:
        result["map"] = map_drawing(args, cfg, shards, limits)
    result["load_average_end"] = load_average()
    result["environment"] = env
    out = write_json(args.out, result)
    print(summary_line(args, result, n_tokens, out))


if __name__ == "__main__":
    main()
