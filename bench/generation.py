#!/usr/bin/env python
"""Generation speed with and without the KV cache (``PrismLM.generate(use_cache=True/False)``), and the
cost of explaining a generation.

What is measured
    The ``--preset`` shapes (default ``cpu-small``: d=128, 4 layers, 4 heads, K=512, k=8, V=8192) with
    **random init** (``torch.manual_seed(--seed)``; speed does not depend on training, and the JSON says
    so), batch 1, greedy decoding of ``--new-tokens`` tokens (256) after a fixed text prompt (tokenized
    with the preset's tokenizer on the built-in corpus). Two windows:

    ``in_window``   block_size raised to prompt + new tokens, so every step after the prefill decodes
                    one token against the cache: the cache's own speed-up. Uncached, every step
                    recomputes the whole sequence so far.
    ``preset``      the preset's own block_size (128 for cpu-small): the generation crosses the window
                    after block_size − prompt tokens. From there both paths recompute the last
                    block_size tokens every step — the positions are learned and absolute, so a sliding
                    window shifts every key and value and nothing cached is reusable — and the cache only
                    helps the steps before. This is what a user of the preset gets.

    Round r times ``generate`` cached and uncached on the same prompt, in alternating order (a drift in
    machine speed hits both), after one untimed warm-up of each; tokens/s = new tokens / wall time.
    Every pair must produce the same tokens (``tokens_identical``). ``--explain N`` (default 32; 0 skips)
    also times ``explain_generation`` of N tokens (no prototype index: cards with signature tokens,
    no neighbourhoods — ``bench/index.py`` times it with an index) against plain cached ``generate`` of
    the same N tokens (temperature 0.8, top-k 50, same seed) on the in-window model:
    ``explain_overhead_pct`` = (explain − generate) / generate × 100.

How to read it
    ``speedup`` = median cached tokens/s ÷ median uncached tokens/s; ``speedup_min``/``_max`` are the
    extremes of the per-round ratios. A decode step at cpu-small is a few hundred small kernels, so on
    CPU it is bound by per-op overhead, not arithmetic: the speed-up grows with the window. On a shared
    CPU timings are noisy (the load average is recorded before and after); ``--threads 1`` (default)
    is the stable setting on the 2-core dev machine. Output: JSON at ``--out`` (default
    ``bench/results/generation.json``) and one summary line on stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import RESULTS_DIR, environment, fmt_rate, load_average, parse_sets, warn_if_busy, write_json

from prismlm.config import RunConfig
from prismlm.data.shards import prepare_shards
from prismlm.explain import explain_generation
from prismlm.model import PrismLM
from prismlm.model.generation import TEXT_SAMPLING
from prismlm.train.state import round_vocab

PROMPT = "It is a truth universally acknowledged"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--preset", default="cpu-small", help="model shape (random init)")
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens generated per measurement")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (cached and uncached alternate)")
    ap.add_argument("--explain", type=int, default=32, help="tokens for explained vs plain generation (0: skip)")
    ap.add_argument("--max-docs", type=int, default=60, help="documents of the built-in corpus (tokenizer)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=0, help="random init of the weights")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. --set model.n_layer=8",
    )
    ap.add_argument("--out", default=str(RESULTS_DIR / "generation.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    device = torch.device(args.device)
    cfg = RunConfig.from_name(args.preset).override(parse_sets(args.sets))
    tok = prepare_shards("builtin", cfg.data.tokenizer, max_docs=args.max_docs, show_progress=False).tokenizer
    cfg = cfg.override({"model.vocab_size": round_vocab(tok.vocab_size)})
    prompt = torch.tensor([tok.encode(PROMPT)], device=device)  # (1, p)
    p, n = prompt.shape[1], args.new_tokens
    env = environment(device, args.seed)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(f: Callable[[], Any]) -> tuple[float, Any]:
        sync()
        t = time.perf_counter()
        r = f()
        sync()
        return time.perf_counter() - t, r

    def build(block_size: int) -> PrismLM:
        torch.manual_seed(args.seed)  # same seed for both windows (the larger wpe shifts the later draws)
        return PrismLM(cfg.override({"model.block_size": block_size}).model).to(device).eval()

    windows = {"in_window": max(cfg.model.block_size, p + n), "preset": cfg.model.block_size}
    settings: dict[str, Any] = {}
    models: dict[str, PrismLM] = {}
    for name, bs in windows.items():
        model = models[name] = build(bs)

        def gen(use_cache: bool, model: PrismLM = model) -> torch.Tensor:
            return model.generate(prompt, n, temperature=0.0, use_cache=use_cache)

        gen(True), gen(False)  # warm-up
        rates: dict[bool, list[float]] = {True: [], False: []}
        identical = True
        for r in range(args.rounds):
            outs = {}
            for use_cache in (True, False) if r % 2 == 0 else (False, True):
                s, outs[use_cache] = timed(lambda use_cache=use_cache: gen(use_cache))
                rates[use_cache].append(n / s)
            identical &= bool(torch.equal(outs[True], outs[False]))
        ratios = [c / u for c, u in zip(rates[True], rates[False])]
        settings[name] = {
            "block_size": bs,
            "cached_steps": min(n, bs - p + 1),
            "cached_tokens_per_s": rates[True],
            "uncached_tokens_per_s": rates[False],
            "cached_median": statistics.median(rates[True]),
            "uncached_median": statistics.median(rates[False]),
            "speedup": statistics.median(rates[True]) / statistics.median(rates[False]),
            "speedup_min": min(ratios),
            "speedup_max": max(ratios),
            "tokens_identical": identical,
        }
        print(
            f"[generation] {name} (block_size {bs}): cached {fmt_rate(settings[name]['cached_median'])} tok/s, "
            f"uncached {fmt_rate(settings[name]['uncached_median'])} tok/s",
            file=sys.stderr,
        )

    explain_result: dict[str, Any] | None = None
    if args.explain > 0:
        model, m = models["in_window"], min(args.explain, windows["in_window"] - p + 1)

        def plain() -> torch.Tensor:
            g = torch.Generator(device=device).manual_seed(0)
            return model.generate(prompt, m, TEXT_SAMPLING, generator=g)

        def explained() -> Any:
            return explain_generation(model, tok, PROMPT, m, sampling=TEXT_SAMPLING)

        plain(), explained()  # warm-up
        times: dict[str, list[float]] = {"plain": [], "explain": []}
        for r in range(args.rounds):
            for f in (plain, explained) if r % 2 == 0 else (explained, plain):
                times["plain" if f is plain else "explain"].append(timed(f)[0] / m)
        g_med, e_med = statistics.median(times["plain"]), statistics.median(times["explain"])
        explain_result = {
            "tokens": m,
            "index": None,
            "generate_s_per_token": times["plain"],
            "explain_s_per_token": times["explain"],
            "explain_overhead_pct": (e_med - g_med) / g_med * 100,
        }

    iw, pr = settings["in_window"], settings["preset"]
    result = {
        "benchmark": "generation",
        "preset": args.preset,
        "weights": f"random init (torch.manual_seed({args.seed})); generation speed does not depend on training",
        "config": cfg.to_dict(),
        "device": str(device),
        "threads": args.threads,
        "batch_size": 1,
        "decoding": "greedy",
        "prompt": PROMPT,
        "prompt_tokens": p,
        "new_tokens": n,
        "rounds": args.rounds,
        "settings": settings,
        "explain": explain_result,
        "environment": env,
        "load_average_end": load_average(),
    }
    path = write_json(args.out, result)
    ex = (
        (
            f"; explain {explain_result['explain_overhead_pct']:+.0f}% vs generate ({explain_result['tokens']} tokens, "
            f"no index)"
        )
        if explain_result is not None
        else ""
    )
    print(
        f"[generation] {args.preset} {n} new tokens, batch 1, greedy: cached {fmt_rate(iw['cached_median'])} "
        f"vs uncached {fmt_rate(iw['uncached_median'])} tok/s ({iw['speedup']:.1f}×, block_size {iw['block_size']}); "
        f"preset block_size {pr['block_size']}: {fmt_rate(pr['cached_median'])} vs "
        f"{fmt_rate(pr['uncached_median'])} tok/s ({pr['speedup']:.1f}×)"
        f"{'' if iw['tokens_identical'] and pr['tokens_identical'] else '; TOKENS DIFFER'}{ex} → {path}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
