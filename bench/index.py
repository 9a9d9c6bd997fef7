#!/usr/bin/env python
"""Cost of the prototype index and of explanations (spec §3.1: "one forward pass plus index look-ups").

What is measured
    1. **Index building** vs a **plain forward pass** over the same tokens: the same model (random init
       of ``--preset``; speed does not depend on training) and the same training sequences of the
       built-in corpus. Round r times ``build_index`` over ``--sequences`` sequences and, separately,
       ``model(x)`` under ``torch.no_grad`` over exactly those batches; the order alternates per round.
       ``index_ratio`` = median index tokens/s ÷ median forward tokens/s (1.0: the index is free; the
       extra work is one (tokens × K) cosine matrix in chunks, the column-wise top-N merge and the
       statistics).
    2. **Explain latency** vs **plain generation**, per generated token: ``model.generate`` of
       ``--gen-tokens`` tokens (KV-cached), vs ``explain_generation`` (the same cached generation, whose
       own step outputs are decomposed — no second forward; one prototype-layer call for all positions,
       the exact decomposition, and the prototype cards with neighbourhood snippets from the index).
       The cards' parts are cached (signature top tokens per model state, token strings, the index's
       decoded snippets), so each explain variant is timed three ways per round:

       - **cold**: every cache cleared first (``clear_card_cache()``, ``index.clear_cache()``) — the first
         explanation after loading a model/index, cache building included;
       - **warm**: the same prompt and seed again — every card part cached (repeated explanations);
       - **varied**: another text (a new seed each round) right after the caches were filled by the
         seed-0 text only — explaining different texts, where only prototypes not seen before are
         computed (a pessimistic steady state: a longer-lived process has seen more prototypes).

       ``explain_overhead_pct`` = (explain − generate) / generate × 100 for the warm calls (and
       ``…_cold_…``, ``…_varied_…`` for the others); ``explain_one_off_ms`` = median over rounds of cold −
       warm per call: what building the caches costs once. ``…noindex…``: the same without the index
       (cards with signature tokens only), which separates the index look-ups from the rest.
       ``--explain-repeats`` warm triples (generate, explain, explain without the index; the order
       alternates) are timed per round, the cold and other-text calls once per round.
       ``overhead_pct_paired``: the median of explain ÷ generate timed next to each other, and
       ``overhead_pct_from_min``: from the fastest round of each — both less sensitive to a busy neighbour
       than the ratio of medians on a shared CPU.

How to read it
    On a shared CPU timings are noisy: compare the ratios, not absolute rates; the load average is
    recorded before and after. Output: JSON at ``--out`` (default ``bench/results/index.json``) and one
    summary line on stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import numpy as np
import torch
from _common import RESULTS_DIR, environment, fmt_rate, load_average, parse_sets, warn_if_busy, write_json

from prismlm.config import RunConfig
from prismlm.data.shards import prepare_shards
from prismlm.explain import IndexSettings, build_index, explain_generation
from prismlm.explain.explanation import clear_card_cache
from prismlm.model import PrismLM
from prismlm.model.generation import TEXT_SAMPLING
from prismlm.train.state import round_vocab


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--preset", default="cpu-small", help="model shape (random init)")
    ap.add_argument("--sequences", type=int, default=64, help="training sequences indexed per round")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per forward")
    ap.add_argument("--top-n", type=int, default=32, help="neighbours kept per prototype")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (index and forward alternate)")
    ap.add_argument("--gen-tokens", type=int, default=32, help="tokens generated per explain measurement")
    ap.add_argument(
        "--explain-repeats",
        type=int,
        default=5,
        help="warm explain/generate triples timed per round (the cold and other-text calls: one each)",
    )
    ap.add_argument("--max-docs", type=int, default=60, help="documents of the built-in corpus to tokenize")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. --set model.prototypes.num_prototypes=2048",
    )
    ap.add_argument("--out", default=str(RESULTS_DIR / "index.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    device = torch.device(args.device)
    cfg = RunConfig.from_name(args.preset).override(parse_sets(args.sets))
    shards = prepare_shards("builtin", cfg.data.tokenizer, max_docs=args.max_docs, show_progress=False)
    cfg = cfg.override({"model.vocab_size": round_vocab(shards.tokenizer.vocab_size)})
    torch.manual_seed(0)
    model = PrismLM(cfg.model).to(device).eval()
    T, B = cfg.model.block_size, args.batch_size
    n_seq = min(args.sequences, shards.train.num_sequences(T))
    ids = np.arange(n_seq)
    batches = [
        torch.from_numpy(shards.train.sequences(ids[s : s + B], T)[:, :-1]).to(device) for s in range(0, n_seq, B)
    ]
    tokens = n_seq * T
    env = environment(device, 0)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def time_forward() -> float:
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            for x in batches:
                model(x)
        sync()
        return time.perf_counter() - t

    def time_index() -> float:
        sync()
        t = time.perf_counter()
        build_index(
            model,
            shards,
            IndexSettings(top_n=args.top_n, batch_size=B, max_sequences=n_seq),
            progress=False,
            model_sha256="bench",
            device=device,
        )
        sync()
        return time.perf_counter() - t

    time_forward(), time_index()  # warm-up
    fwd, idx = [], []
    for r in range(args.rounds):
        order = (time_forward, time_index) if r % 2 == 0 else (time_index, time_forward)
        for f in order:
            (fwd if f is time_forward else idx).append(tokens / f())
    index = build_index(
        model,
        shards,
        IndexSettings(top_n=args.top_n, batch_size=B, max_sequences=n_seq),
        progress=False,
        model_sha256="bench",
        device=device,
    )

    tok = shards.tokenizer
    prompt = "It is a truth universally acknowledged"
    p_ids = torch.tensor([tok.encode(prompt)], device=device)
    n_gen = min(args.gen_tokens, T - p_ids.shape[1])

    def time_generate() -> float:
        g = torch.Generator(device=device).manual_seed(0)
        sync()
        t = time.perf_counter()
        model.generate(p_ids, n_gen, TEXT_SAMPLING, generator=g)
        sync()
        return time.perf_counter() - t

    def time_explain(with_index: bool = True, *, cold: bool = False, seed: int = 0) -> float:
        if cold:
            clear_card_cache()
            index.clear_cache()
        sync()
        t = time.perf_counter()
        explain_generation(
            model,
            tok,
            prompt,
            n_gen,
            sampling=replace(TEXT_SAMPLING, seed=seed),
            index=index if with_index else None,
        )
        sync()
        return time.perf_counter() - t

    time_generate(), time_explain(), time_explain(False)  # warm-up
    runs: dict[str, list[float]] = {
        k: [] for k in ("gen", "exp", "exp0", "exp_cold", "exp0_cold", "exp_varied", "exp0_varied")
    }
    for r in range(args.rounds):
        # cold (each clears every cache; the index one last, so the caches hold the seed-0 cards after it) …
        runs["exp0_cold"].append(time_explain(False, cold=True) / n_gen)
        runs["exp_cold"].append(time_explain(True, cold=True) / n_gen)
        # … other texts, with the caches holding what the seed-0 explanation computed …
        runs["exp_varied"].append(time_explain(True, seed=1000 + r) / n_gen)
        runs["exp0_varied"].append(time_explain(False, seed=2000 + r) / n_gen)
        time_explain()  # untimed: the warm calls below do not follow a cache-building one directly
        # … then warm explanations and plain generation, alternating the order per round
        order = [("gen", time_generate), ("exp", time_explain), ("exp0", lambda: time_explain(False))]
        for j in range(args.explain_repeats):  # more samples of the small warm difference
            for key, f in order if (r * args.explain_repeats + j) % 2 == 0 else order[::-1]:
                runs[key].append(f() / n_gen)
    med = {k: statistics.median(v) for k, v in runs.items()}
    gen, exp, exp0 = runs["gen"], runs["exp"], runs["exp0"]
    ratio = statistics.median(idx) / statistics.median(fwd)

    def pct(key: str) -> float:
        return (med[key] - med["gen"]) / med["gen"] * 100

    def pct_min(key: str) -> float:  # from the fastest round of each: less sensitive to a busy neighbour
        return (min(runs[key]) - min(gen)) / min(gen) * 100

    def per_round(key: str) -> list[float]:  # one value per round (the median of a round's repeats)
        k = len(runs[key]) // args.rounds
        return [statistics.median(runs[key][r * k : (r + 1) * k]) for r in range(args.rounds)]

    def pct_paired(key: str) -> float:  # median of explain / generate timed next to each other
        g = gen if len(runs[key]) == len(gen) else per_round("gen")
        return statistics.median(e / g - 1 for e, g in zip(runs[key], g)) * 100

    def one_off_ms(cold: str, warm: str) -> float:  # per call: cold − warm of the same round
        return statistics.median(c - w for c, w in zip(runs[cold], per_round(warm))) * n_gen * 1e3

    overhead, overhead0 = pct("exp"), pct("exp0")
    result = {
        "benchmark": "index",
        "preset": args.preset,
        "config": cfg.to_dict(),
        "device": str(device),
        "threads": args.threads,
        "sequences": n_seq,
        "tokens_per_round": tokens,
        "batch_size": B,
        "top_n": args.top_n,
        "rounds": args.rounds,
        "explain_repeats": args.explain_repeats,
        "forward_tokens_per_s": fwd,
        "index_tokens_per_s": idx,
        "index_ratio": ratio,
        "index_ratio_min": min(i / f for i, f in zip(idx, fwd)),
        "index_ratio_max": max(i / f for i, f in zip(idx, fwd)),
        "gen_tokens": n_gen,
        "generate_s_per_token": gen,
        "explain_s_per_token": exp,
        "explain_overhead_pct": overhead,
        "explain_noindex_s_per_token": exp0,
        "explain_noindex_overhead_pct": overhead0,
        "explain_cold_s_per_token": runs["exp_cold"],
        "explain_cold_overhead_pct": pct("exp_cold"),
        "explain_noindex_cold_s_per_token": runs["exp0_cold"],
        "explain_noindex_cold_overhead_pct": pct("exp0_cold"),
        "explain_varied_s_per_token": runs["exp_varied"],
        "explain_varied_overhead_pct": pct("exp_varied"),
        "explain_noindex_varied_s_per_token": runs["exp0_varied"],
        "explain_noindex_varied_overhead_pct": pct("exp0_varied"),
        "overhead_pct_from_min": {k: pct_min(k) for k in runs if k != "gen"},
        "overhead_pct_paired": {k: pct_paired(k) for k in runs if k != "gen"},
        "explain_one_off_ms": one_off_ms("exp_cold", "exp"),
        "explain_noindex_one_off_ms": one_off_ms("exp0_cold", "exp0"),
        "coverage_random_init": index.coverage(),
        "environment": env,
        "load_average_end": load_average(),
    }
    path = write_json(args.out, result)
    print(
        f"[index] {args.preset} K={cfg.model.prototypes.num_prototypes} N={args.top_n}: index "
        f"{fmt_rate(statistics.median(idx))} tok/s vs forward {fmt_rate(statistics.median(fwd))} tok/s "
        f"(ratio {ratio:.2f}); generate {med['gen'] * 1e3:.2f} ms/token; explain overhead with the index "
        f"(without) as median / paired / fastest: warm {pct('exp'):+.1f}% / {pct_paired('exp'):+.1f}% / "
        f"{pct_min('exp'):+.1f}% ({pct('exp0'):+.1f}% / {pct_paired('exp0'):+.1f}% / {pct_min('exp0'):+.1f}%), "
        f"other texts {pct('exp_varied'):+.1f}% ({pct('exp0_varied'):+.1f}%), cold {pct('exp_cold'):+.1f}% "
        f"({pct('exp0_cold'):+.1f}%); one-off cache build {one_off_ms('exp_cold', 'exp'):.1f} ms "
        f"({one_off_ms('exp0_cold', 'exp0'):.1f} ms) → {path}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
