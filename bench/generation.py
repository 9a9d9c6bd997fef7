#!/usr/bin/env python
"""Generation speed with and without the KV cache (``PrismLM.generate(use_cache=True/False)``), and the
cost of explaining a generation.

The ``--preset`` shapes with random init (speed does not depend on training), batch 1, greedy decoding of
``--new-tokens`` tokens after a fixed prompt, cached and uncached in alternating rounds, at two windows:
``in_window`` (block_size raised to prompt + new tokens: the cache's own speed-up) and ``preset`` (the
preset's block_size: past the window both paths recompute the last block_size tokens — what a user of the
preset gets). Every pair must produce the same tokens. ``--explain N`` also times ``explain_generation`` of N
tokens (no index) against plain cached ``generate``: ``explain_overhead_pct``.

Run: ``PYTHONPATH=src python bench/generation.py [--preset cpu-small] [--threads 1]``. Writes
``bench/results/generation.json`` and one summary line; how to read it and the measurements: docs/results.md
("Generation with a KV cache").
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial

import torch
from _common import (
    RESULTS_DIR,
    Json,
    add_set_option,
    environment,
    fmt_rate,
    load_average,
    num,
    parse_sets,
    timed_on,
    warn_if_busy,
    write_json,
)

from prismlm.config import RunConfig
from prismlm.data.shards import prepare_shards
from prismlm.data.tokenizer import Tokenizer
from prismlm.explain import explain_generation
from prismlm.model import PrismLM
from prismlm.model.generation import TEXT_SAMPLING
from prismlm.train.state import round_vocab

PROMPT = "It is a truth universally acknowledged"


def parse_args() -> argparse.Namespace:
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
    add_set_option(ap, "config override, e.g. --set model.n_layer=8")
    ap.add_argument("--out", default=str(RESULTS_DIR / "generation.json"))
    return ap.parse_args()


def window(
    args: argparse.Namespace, model: PrismLM, prompt: torch.Tensor, bs: int, device: torch.device, name: str
) -> Json:
    """Cached vs uncached greedy generation of ``--new-tokens`` tokens at block size ``bs``."""
    p, n = prompt.shape[1], args.new_tokens

    def gen(use_cache: bool) -> torch.Tensor:
        return model.generate(prompt, n, temperature=0.0, use_cache=use_cache)

    gen(True), gen(False)  # warm-up
    rates: dict[bool, list[float]] = {True: [], False: []}
    identical = True
    for r in range(args.rounds):
        outs = {}
        for use_cache in (True, False) if r % 2 == 0 else (False, True):
            s, outs[use_cache] = timed_on(device, partial(gen, use_cache))
            rates[use_cache].append(n / s)
        identical &= bool(torch.equal(outs[True], outs[False]))
    ratios = [c / u for c, u in zip(rates[True], rates[False])]
    rec: Json = {
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
        f"[generation] {name} (block_size {bs}): cached {fmt_rate(num(rec, 'cached_median'))} tok/s, "
        f"uncached {fmt_rate(num(rec, 'uncached_median'))} tok/s",
        file=sys.stderr,
    )
    return rec


def explain_cost(
    model: PrismLM, tok: Tokenizer, prompt: torch.Tensor, m: int, rounds: int, device: torch.device
) -> Json:
    """``explain_generation`` of m tokens (no index) vs plain cached ``generate`` (same sampling and seed)."""

    def plain() -> torch.Tensor:
        g = torch.Generator(device=device).manual_seed(0)
        return model.generate(prompt, m, TEXT_SAMPLING, generator=g)

    def explained() -> object:
        return explain_generation(model, tok, PROMPT, m, sampling=TEXT_SAMPLING)

    plain(), explained()  # warm-up
    times: dict[str, list[float]] = {"plain": [], "explain": []}
    for r in range(rounds):
        for f in (plain, explained) if r % 2 == 0 else (explained, plain):
            times["plain" if f is plain else "explain"].append(timed_on(device, f)[0] / m)
    g_med, e_med = statistics.median(times["plain"]), statistics.median(times["explain"])
    return {
        "tokens": m,
        "index": None,
        "generate_s_per_token": times["plain"],
        "explain_s_per_token": times["explain"],
        "explain_overhead_pct": (e_med - g_med) / g_med * 100,
    }


def summary_line(args: argparse.Namespace, settings: dict[str, Json], explain: Json | None, path: object) -> str:
    iw, pr = settings["in_window"], settings["preset"]
    ex = (
        f"; explain {num(explain, 'explain_overhead_pct'):+.0f}% vs generate ({explain['tokens']} tokens, no index)"
        if explain is not None
        else ""
    )
    return (
        f"[generation] {args.preset} {args.new_tokens} new tokens, batch 1, greedy: cached "
        f"{fmt_rate(num(iw, 'cached_median'))} vs uncached {fmt_rate(num(iw, 'uncached_median'))} tok/s "
        f"({num(iw, 'speedup'):.1f}×, block_size {iw['block_size']}); preset block_size {pr['block_size']}: "
        f"{fmt_rate(num(pr, 'cached_median'))} vs {fmt_rate(num(pr, 'uncached_median'))} tok/s "
        f"({num(pr, 'speedup'):.1f}×)"
        f"{'' if iw['tokens_identical'] and pr['tokens_identical'] else '; TOKENS DIFFER'}{ex} → {path}"
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    device = torch.device(args.device)
    cfg = RunConfig.from_name(args.preset).override(parse_sets(args.sets))
    tok = prepare_shards("builtin", cfg.data.tokenizer, max_docs=args.max_docs, show_progress=False).tokenizer
    cfg = cfg.override({"model.vocab_size": round_vocab(tok.vocab_size)})
    prompt = torch.tensor([tok.encode(PROMPT)], device=device)  # (1, p)
    p, n = prompt.shape[1], args.new_tokens
    env = environment(device, args.seed)
    windows = {"in_window": max(cfg.model.block_size, p + n), "preset": cfg.model.block_size}
    settings: dict[str, Json] = {}
    models: dict[str, PrismLM] = {}
    for name, bs in windows.items():
        torch.manual_seed(args.seed)  # same seed for both windows (the larger wpe shifts the later draws)
        model = models[name] = PrismLM(cfg.override({"model.block_size": bs}).model).to(device).eval()
        settings[name] = window(args, model, prompt, bs, device, name)
    explain_result: Json | None = None
    if args.explain > 0:
        m = min(args.explain, windows["in_window"] - p + 1)
        explain_result = explain_cost(models["in_window"], tok, prompt, m, args.rounds, device)
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
    print(summary_line(args, settings, explain_result, path))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
