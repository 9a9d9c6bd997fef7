#!/usr/bin/env python
"""Cost of the prototype index and of explanations (spec §3.1: "one forward pass plus index look-ups").

1. ``build_index`` vs a plain forward over the same training sequences (random init of ``--preset``; speed
   does not depend on training), rounds alternating: ``index_ratio`` = median index tokens/s ÷ forward tokens/s.
2. ``explain_generation`` vs ``model.generate`` of ``--gen-tokens`` tokens per generated token, with and
   without the index, timed cold (every card cache cleared), warm (the same text again) and varied (another
   text after the caches were filled): ``explain_overhead_pct`` and its cold/varied/paired/fastest forms,
   ``explain_one_off_ms`` (cold − warm per call: building the caches once).

Run: ``PYTHONPATH=src python bench/index.py [--preset cpu-small] [--threads 1]``. Writes
``bench/results/index.json`` and one summary line; compare ratios, not absolute rates, on a shared CPU.
What each timing covers and the measurements: docs/results.md ("Prototype index and explanations").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from _common import (
    RESULTS_DIR,
    Json,
    add_set_option,
    environment,
    fmt_rate,
    load_average,
    parse_sets,
    sync,
    warn_if_busy,
    write_json,
)

from prismlm.config import RunConfig
from prismlm.data.shards import ShardSet, prepare_shards
from prismlm.explain import IndexSettings, build_index, explain_generation
from prismlm.explain.explanation import clear_card_cache
from prismlm.explain.index import PrototypeIndex
from prismlm.model import PrismLM
from prismlm.model.generation import TEXT_SAMPLING
from prismlm.train.state import round_vocab

PROMPT = "It is a truth universally acknowledged"


def parse_args() -> argparse.Namespace:
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
    add_set_option(ap, "config override, e.g. --set model.prototypes.num_prototypes=2048")
    ap.add_argument("--out", default=str(RESULTS_DIR / "index.json"))
    return ap.parse_args()


@dataclass
class Bench:
    """The model (random init), its shards, the indexed batches and the device."""

    args: argparse.Namespace
    cfg: RunConfig
    shards: ShardSet
    model: PrismLM
    batches: list[torch.Tensor]
    n_seq: int
    device: torch.device

    def settings(self) -> IndexSettings:
        return IndexSettings(top_n=self.args.top_n, batch_size=self.args.batch_size, max_sequences=self.n_seq)

    def time_forward(self) -> float:
        sync(self.device)
        t = time.perf_counter()
        with torch.no_grad():
            for x in self.batches:
                self.model(x)
        sync(self.device)
        return time.perf_counter() - t

    def build(self) -> PrototypeIndex:
        return build_index(
            self.model, self.shards, self.settings(), progress=False, model_sha256="bench", device=self.device
        )

    def time_index(self) -> float:
        sync(self.device)
        t = time.perf_counter()
        self.build()
        sync(self.device)
        return time.perf_counter() - t


def setup(args: argparse.Namespace) -> Bench:
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
    return Bench(args, cfg, shards, model, batches, n_seq, device)


def index_vs_forward(b: Bench, rounds: int) -> tuple[list[float], list[float]]:
    """Tokens/s of the forward and of the index build per round, the order alternating (after a warm-up)."""
    tokens = b.n_seq * b.cfg.model.block_size
    b.time_forward(), b.time_index()  # warm-up
    fwd: list[float] = []
    idx: list[float] = []
    for r in range(rounds):
        order = (b.time_forward, b.time_index) if r % 2 == 0 else (b.time_index, b.time_forward)
        for f in order:
            (fwd if f == b.time_forward else idx).append(tokens / f())
    return fwd, idx


def explain_runs(b: Bench, index: PrototypeIndex, n_gen: int) -> dict[str, list[float]]:
    """Seconds per generated token of generate and of explain (with / without the index; cold, varied, warm)."""
    args, model, device, tok = b.args, b.model, b.device, b.shards.tokenizer
    p_ids = torch.tensor([tok.encode(PROMPT)], device=device)

    def time_generate() -> float:
        g = torch.Generator(device=device).manual_seed(0)
        sync(device)
        t = time.perf_counter()
        model.generate(p_ids, n_gen, TEXT_SAMPLING, generator=g)
        sync(device)
        return time.perf_counter() - t

    def time_explain(with_index: bool = True, *, cold: bool = False, seed: int = 0) -> float:
        if cold:
            clear_card_cache()
            index.clear_cache()
        sync(device)
        t = time.perf_counter()
        sampling = replace(TEXT_SAMPLING, seed=seed)
        explain_generation(model, tok, PROMPT, n_gen, sampling=sampling, index=index if with_index else None)
        sync(device)
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
    return runs


@dataclass
class Overheads:
    """Explain's overhead over generate, from the per-token runs, several ways."""

    runs: dict[str, list[float]]
    rounds: int
    n_gen: int

    def med(self, key: str) -> float:
        return statistics.median(self.runs[key])

    def pct(self, key: str) -> float:
        return (self.med(key) - self.med("gen")) / self.med("gen") * 100

    def pct_min(self, key: str) -> float:  # from the fastest round of each: less sensitive to a busy neighbour
        gen = self.runs["gen"]
        return (min(self.runs[key]) - min(gen)) / min(gen) * 100

    def per_round(self, key: str) -> list[float]:  # one value per round (the median of a round's repeats)
        k = len(self.runs[key]) // self.rounds
        return [statistics.median(self.runs[key][r * k : (r + 1) * k]) for r in range(self.rounds)]

    def pct_paired(self, key: str) -> float:  # median of explain / generate timed next to each other
        gen = self.runs["gen"]
        g = gen if len(self.runs[key]) == len(gen) else self.per_round("gen")
        return statistics.median(e / g - 1 for e, g in zip(self.runs[key], g)) * 100

    def one_off_ms(self, cold: str, warm: str) -> float:  # per call: cold − warm of the same round
        return statistics.median(c - w for c, w in zip(self.runs[cold], self.per_round(warm))) * self.n_gen * 1e3


def explain_record(o: Overheads) -> Json:
    runs = o.runs
    return {
        "generate_s_per_token": runs["gen"],
        "explain_s_per_token": runs["exp"],
        "explain_overhead_pct": o.pct("exp"),
        "explain_noindex_s_per_token": runs["exp0"],
        "explain_noindex_overhead_pct": o.pct("exp0"),
        "explain_cold_s_per_token": runs["exp_cold"],
        "explain_cold_overhead_pct": o.pct("exp_cold"),
        "explain_noindex_cold_s_per_token": runs["exp0_cold"],
        "explain_noindex_cold_overhead_pct": o.pct("exp0_cold"),
        "explain_varied_s_per_token": runs["exp_varied"],
        "explain_varied_overhead_pct": o.pct("exp_varied"),
        "explain_noindex_varied_s_per_token": runs["exp0_varied"],
        "explain_noindex_varied_overhead_pct": o.pct("exp0_varied"),
        "overhead_pct_from_min": {k: o.pct_min(k) for k in runs if k != "gen"},
        "overhead_pct_paired": {k: o.pct_paired(k) for k in runs if k != "gen"},
        "explain_one_off_ms": o.one_off_ms("exp_cold", "exp"),
        "explain_noindex_one_off_ms": o.one_off_ms("exp0_cold", "exp0"),
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    b = setup(args)
    env = environment(b.device, 0)
    fwd, idx = index_vs_forward(b, args.rounds)
    index = b.build()
    T = b.cfg.model.block_size
    n_gen = min(args.gen_tokens, T - len(b.shards.tokenizer.encode(PROMPT)))
    o = Overheads(explain_runs(b, index, n_gen), args.rounds, n_gen)
    ratio = statistics.median(idx) / statistics.median(fwd)
    result = {
        "benchmark": "index",
        "preset": args.preset,
        "config": b.cfg.to_dict(),
        "device": str(b.device),
        "threads": args.threads,
        "sequences": b.n_seq,
        "tokens_per_round": b.n_seq * T,
        "batch_size": args.batch_size,
        "top_n": args.top_n,
        "rounds": args.rounds,
        "explain_repeats": args.explain_repeats,
        "forward_tokens_per_s": fwd,
        "index_tokens_per_s": idx,
        "index_ratio": ratio,
        "index_ratio_min": min(i / f for i, f in zip(idx, fwd)),
        "index_ratio_max": max(i / f for i, f in zip(idx, fwd)),
        "gen_tokens": n_gen,
        **explain_record(o),
        "coverage_random_init": index.coverage(),
        "environment": env,
        "load_average_end": load_average(),
    }
    path = write_json(args.out, result)
    protos = b.cfg.model.prototypes
    print(
        f"[index] {args.preset} K={protos.num_prototypes if protos else None} N={args.top_n}: index "
        f"{fmt_rate(statistics.median(idx))} tok/s vs forward {fmt_rate(statistics.median(fwd))} tok/s "
        f"(ratio {ratio:.2f}); generate {o.med('gen') * 1e3:.2f} ms/token; explain overhead with the index "
        f"(without) as median / paired / fastest: warm {o.pct('exp'):+.1f}% / {o.pct_paired('exp'):+.1f}% / "
        f"{o.pct_min('exp'):+.1f}% ({o.pct('exp0'):+.1f}% / {o.pct_paired('exp0'):+.1f}% / "
        f"{o.pct_min('exp0'):+.1f}%), other texts {o.pct('exp_varied'):+.1f}% ({o.pct('exp0_varied'):+.1f}%), "
        f"cold {o.pct('exp_cold'):+.1f}% ({o.pct('exp0_cold'):+.1f}%); one-off cache build "
        f"{o.one_off_ms('exp_cold', 'exp'):.1f} ms ({o.one_off_ms('exp0_cold', 'exp0'):.1f} ms) → {path}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
