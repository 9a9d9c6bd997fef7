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
       ``explain_overhead_pct`` = (explain − generate) / generate × 100; ``explain_noindex_overhead_pct``
       the same without the index (cards with signature tokens only), which separates the index look-ups
       from the rest.

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

import numpy as np
import torch
from _common import RESULTS_DIR, environment, fmt_rate, load_average, parse_sets, warn_if_busy, write_json

from prismlm.config import RunConfig
from prismlm.data.shards import prepare_shards
from prismlm.explain import build_index, explain_generation
from prismlm.model import PrismLM
from prismlm.train.trainer import round_vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", default="cpu-small", help="model shape (random init)")
    ap.add_argument("--sequences", type=int, default=64, help="training sequences indexed per round")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per forward")
    ap.add_argument("--top-n", type=int, default=32, help="neighbours kept per prototype")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (index and forward alternate)")
    ap.add_argument("--gen-tokens", type=int, default=32, help="tokens generated per explain measurement")
    ap.add_argument("--max-docs", type=int, default=60, help="documents of the built-in corpus to tokenize")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, e.g. --set model.prototypes.num_prototypes=2048")
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
    batches = [torch.from_numpy(shards.train.sequences(ids[s:s + B], T)[:, :-1]).to(device) for s in range(0, n_seq, B)]
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
        build_index(model, shards, top_n=args.top_n, batch_size=B, max_sequences=n_seq, progress=False,
                    model_sha256="bench", device=device)
        sync()
        return time.perf_counter() - t

    time_forward(), time_index()  # warm-up
    fwd, idx = [], []
    for r in range(args.rounds):
        order = (time_forward, time_index) if r % 2 == 0 else (time_index, time_forward)
        for f in order:
            (fwd if f is time_forward else idx).append(tokens / f())
    index = build_index(model, shards, top_n=args.top_n, batch_size=B, max_sequences=n_seq, progress=False,
                        model_sha256="bench", device=device)

    tok = shards.tokenizer
    prompt = "It is a truth universally acknowledged"
    p_ids = torch.tensor([tok.encode(prompt)], device=device)
    n_gen = min(args.gen_tokens, T - p_ids.shape[1])

    def time_generate() -> float:
        g = torch.Generator(device=device).manual_seed(0)
        sync()
        t = time.perf_counter()
        model.generate(p_ids, n_gen, temperature=0.8, top_k=50, generator=g)
        sync()
        return time.perf_counter() - t

    def time_explain() -> float:
        sync()
        t = time.perf_counter()
        explain_generation(model, tok, prompt, n_gen, temperature=0.8, top_k=50, seed=0, index=index)
        sync()
        return time.perf_counter() - t

    def time_explain_noindex() -> float:
        sync()
        t = time.perf_counter()
        explain_generation(model, tok, prompt, n_gen, temperature=0.8, top_k=50, seed=0)
        sync()
        return time.perf_counter() - t

    time_generate(), time_explain(), time_explain_noindex()
    gen, exp, exp0 = [], [], []
    for r in range(args.rounds):
        order = (time_generate, time_explain, time_explain_noindex)
        for f in (order if r % 2 == 0 else order[::-1]):
            {time_generate: gen, time_explain: exp, time_explain_noindex: exp0}[f].append(f() / n_gen)
    ratio = statistics.median(idx) / statistics.median(fwd)
    overhead = (statistics.median(exp) - statistics.median(gen)) / statistics.median(gen) * 100
    overhead0 = (statistics.median(exp0) - statistics.median(gen)) / statistics.median(gen) * 100
    result = {
        "benchmark": "index", "preset": args.preset, "config": cfg.to_dict(), "device": str(device),
        "threads": args.threads, "sequences": n_seq, "tokens_per_round": tokens, "batch_size": B,
        "top_n": args.top_n, "rounds": args.rounds,
        "forward_tokens_per_s": fwd, "index_tokens_per_s": idx,
        "index_ratio": ratio, "index_ratio_min": min(i / f for i, f in zip(idx, fwd)),
        "index_ratio_max": max(i / f for i, f in zip(idx, fwd)),
        "gen_tokens": n_gen, "generate_s_per_token": gen, "explain_s_per_token": exp,
        "explain_overhead_pct": overhead, "explain_noindex_s_per_token": exp0,
        "explain_noindex_overhead_pct": overhead0,
        "coverage_random_init": index.coverage(),
        "environment": env, "load_average_end": load_average(),
    }
    path = write_json(args.out, result)
    print(f"[index] {args.preset} K={cfg.model.prototypes.num_prototypes} N={args.top_n}: index "
          f"{fmt_rate(statistics.median(idx))} tok/s vs forward {fmt_rate(statistics.median(fwd))} tok/s "
          f"(ratio {ratio:.2f}); explain {statistics.median(exp) * 1e3:.1f} ms/token vs generate "
          f"{statistics.median(gen) * 1e3:.1f} ms/token (overhead {overhead:+.0f}%; without the index "
          f"{overhead0:+.0f}%) → {path}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
