"""Speed of a retrofitted model against its source transformers model: forward, ``explain`` and explained
generation, each a ratio of two callables timed on the same tokens.

The callables run in alternating order (round r runs A then B, round r + 1 B then A, so a drift in machine
speed hits both) after untimed warm-up calls; each side's time is the median of ``repeats`` rounds, and
``paired_median`` is the median of the per-round ratios (less sensitive to a busy neighbour). One-off costs
(the prototype-signature cache an explanation fills on its first call, the index build) are timed apart. A
ratio that misses its goal (forward ≥ 0.97, explain ≤ 1.2, explained generation ≤ +5%) gets a cProfile of a
few calls of its slow side, so a report can say where the time goes. Used by ``bench/real_retrofit.py --stage
speed``; docs/results.md has the measurements.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import time
from collections.abc import Callable
from typing import TypedDict, cast

import numpy as np
import torch

from prismlm.artifacts import model_identity
from prismlm.data.shards import ShardSet
from prismlm.data.tokenizer import Tokenizer
from prismlm.explain import explain, explain_generation
from prismlm.explain.explanation import clear_card_cache
from prismlm.explain.index import IndexSettings, PrototypeIndex, build_index
from prismlm.model import PrismLM, Sampling


class Timings(TypedDict):
    """``alternate``'s record: every round's seconds and each callable's median."""

    seconds: dict[str, list[float]]
    median: dict[str, float]


class SpeedHeadline(TypedDict):
    """``speed_stage``'s headline numbers."""

    forward_ratio: float
    """tokens/s of the retrofitted forward ÷ tokens/s of the source model's forward (goal ≥ 0.97)."""
    explain_ratio: float
    """Seconds of ``explain`` (warm, with an index) ÷ seconds of one source forward (goal ≤ 1.2)."""
    explained_generation_overhead_pct: float
    """Extra time of ``explain_generation`` over ``PrismLM.generate`` of the same tokens, % (goal ≤ 5)."""
    explain_cold_ratio: float
    """``explain_ratio`` of the first call of a process (signature cache empty)."""
    logits_only_forward_ratio: float
    """``forward_ratio`` of the logits-only path that generation runs."""
    generation_tokens_identical: bool
    """Explained, plain and source generation produced the same tokens."""


def load_average() -> list[float] | None:
    """1/5/15-minute load averages (None where unsupported): how busy the machine was around a timing."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


GREEDY = Sampling(temperature=0.0)

PROMPT = "The history of the printing press begins"


def alternate(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> Timings:
    """Time each callable ``repeats`` times in alternating order after ``warmup`` untimed calls of each."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    times: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    for r in range(repeats):
        for name, f in items if r % 2 == 0 else items[::-1]:
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {"seconds": times, "median": {n: statistics.median(t) for n, t in times.items()}}


def ratio(t: Timings, num: str, den: str) -> dict[str, float]:
    """Time ratio num ÷ den: of the medians, the median of the per-round ratios, and their extremes."""
    per_round = [a / b for a, b in zip(t["seconds"][num], t["seconds"][den])]
    return {
        "of_medians": t["median"][num] / t["median"][den],
        "paired_median": statistics.median(per_round),
        "min": min(per_round),
        "max": max(per_round),
    }


def profile_calls(f: Callable[[], object], calls: int = 3, top: int = 15) -> list[str]:
    """cProfile of ``calls`` calls of ``f``: the ``top`` entries by cumulative time, as printed lines."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        f()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    return [line.rstrip() for line in buf.getvalue().splitlines() if line.strip()][-(top + 1) :]


def forward_speed(model: PrismLM, source: torch.nn.Module, ids: torch.Tensor, repeats: int) -> dict[str, object]:
    """Source forward vs retrofitted forward (full, and the logits-only path) on ids (B, T)."""
    with torch.inference_mode():
        want = source(input_ids=ids).logits
        got = model(ids).logits[..., : want.shape[-1]]
        diff = float((got - want).abs().max())
        fns = {
            "source": lambda: source(input_ids=ids).logits,
            "prism_forward": lambda: model(ids),
            "prism_logits_only": lambda: model.lm_head(model.backbone(ids)),
        }
        t = alternate(fns, repeats)
        prism = ratio(t, "prism_forward", "source")
        out: dict[str, object] = {
            "batch": list(ids.shape),
            "tokens": ids.numel(),
            "logit_max_abs_diff": diff,
            "tokens_per_s": {n: ids.numel() / s for n, s in t["median"].items()},
            # tokens/s ratio retrofitted ÷ source = source time ÷ retrofitted time
            "forward_ratio": 1.0 / prism["of_medians"],
            "forward_ratio_paired": 1.0 / prism["paired_median"],
            "logits_only_ratio": 1.0 / ratio(t, "prism_logits_only", "source")["of_medians"],
            "timings": t,
        }
        if 1.0 / prism["of_medians"] < 0.97:
            out["profile"] = profile_calls(fns["prism_forward"])
    return out


def explain_speed(
    model: PrismLM,
    source: torch.nn.Module,
    tok: Tokenizer,
    ids: torch.Tensor,
    index: PrototypeIndex,
    sha: str,
    repeats: int,
) -> dict[str, object]:
    """``explain`` of ids (1, n) with and without the index vs one source forward of the same ids; cold calls
    (signature cache cleared) apart."""

    def plain() -> torch.Tensor:
        with torch.inference_mode():
            return source(input_ids=ids).logits

    def explained(idx: PrototypeIndex | None = index) -> object:
        return explain(model, tok, ids[0], index=idx, model_sha256=sha)

    cold = []
    for _ in range(2):  # the first call of a process: the signature cache empty
        clear_card_cache(model)
        t0 = time.perf_counter()
        explained()
        cold.append(time.perf_counter() - t0)
    t = alternate({"source_forward": plain, "explain": explained, "explain_no_index": lambda: explained(None)}, repeats)
    r = ratio(t, "explain", "source_forward")
    out: dict[str, object] = {
        "tokens": ids.shape[1],
        "explain_ratio": r["of_medians"],
        "explain_ratio_paired": r["paired_median"],
        "explain_no_index_ratio": ratio(t, "explain_no_index", "source_forward")["of_medians"],
        "explain_cold_ratio": min(cold) / t["median"]["source_forward"],
        "explain_cold_seconds": cold,
        "timings": t,
    }
    if r["of_medians"] > 1.2:
        out["profile"] = profile_calls(explained)
    return out


def generation_speed(
    model: PrismLM,
    source: torch.nn.Module,
    tok: Tokenizer,
    n: int,
    index: PrototypeIndex,
    sha: str,
    repeats: int,
) -> dict[str, object]:
    """Explained generation of n greedy tokens (KV cache) vs plain cached generation of the same tokens."""
    prompt_ids = tok.encode(PROMPT)
    x = torch.tensor([prompt_ids], dtype=torch.long)  # (1, p)
    p = x.shape[1]

    def plain() -> list[int]:
        return model.generate(x, n, temperature=0.0, use_cache=True)[0, p:].tolist()

    def hf() -> list[int]:
        with torch.inference_mode():
            y = cast(Callable[..., torch.Tensor], source.generate)(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                use_cache=True,
                pad_token_id=tok.eot_id,
            )
        return y[0, p:].tolist()

    def explained() -> list[int]:
        e = explain_generation(model, tok, PROMPT, n, sampling=GREEDY, index=index, model_sha256=sha)
        return e.token_ids[p:] + [e.positions[-1].next_id]

    same = {"prism_generate": plain(), "source_generate": hf(), "explain_generation": explained()}
    t = alternate({"prism_generate": plain, "source_generate": hf, "explain_generation": explained}, repeats)
    vs_prism = ratio(t, "explain_generation", "prism_generate")
    out: dict[str, object] = {
        "prompt_tokens": p,
        "new_tokens": n,
        "tokens_identical": same["prism_generate"] == same["explain_generation"] == same["source_generate"],
        "text": tok.decode(same["explain_generation"]),
        "tokens_per_s": {name: n / s for name, s in t["median"].items()},
        "explained_generation_overhead_pct": (vs_prism["of_medians"] - 1) * 100,
        "overhead_pct_paired": (vs_prism["paired_median"] - 1) * 100,
        "overhead_vs_source_generate_pct": (ratio(t, "explain_generation", "source_generate")["of_medians"] - 1) * 100,
        "prism_generate_vs_source_generate_pct": (ratio(t, "prism_generate", "source_generate")["of_medians"] - 1)
        * 100,
        "timings": t,
    }
    if (vs_prism["of_medians"] - 1) * 100 > 5:
        out["profile"] = profile_calls(explained)
        out["profile_plain"] = profile_calls(plain)
    return out


def speed_stage(
    model: PrismLM,
    source: torch.nn.Module,
    tok: Tokenizer,
    shards: ShardSet,
    *,
    T: int,
    batch: int,
    repeats: int,
    new_tokens: int,
    index_sequences: int,
) -> tuple[dict[str, object], SpeedHeadline]:
    """All three ratios on held-out tokens, the index (for explanations) over the first ``index_sequences``
    training sequences: the full record, and its headline numbers."""
    loads = [load_average()]
    ids = torch.from_numpy(shards.val.sequences(np.arange(batch), T)[:, :-1].astype(np.int64))  # (B, T)
    t0 = time.perf_counter()
    # the model's identity, computed once (``prism explain`` passes the run's; without it every explain call
    # with an index would hash the 0.5 GB of weights to check the index against the model)
    sha = model_identity(model)
    t1 = time.perf_counter()
    index = build_index(
        model, shards, IndexSettings(max_sequences=index_sequences, batch_size=8), progress=False, model_sha256=sha
    )
    one_off = {
        "model_identity_seconds": t1 - t0,
        "index_build_seconds": time.perf_counter() - t1,
        "index_tokens": index_sequences * T,
    }
    fwd = forward_speed(model, source, ids, repeats)
    loads.append(load_average())
    exp = explain_speed(model, source, tok, ids[:1, :128], index, sha, repeats)
    loads.append(load_average())
    gen = generation_speed(model, source, tok, new_tokens, index, sha, repeats)
    loads.append(load_average())
    headline: SpeedHeadline = {
        "forward_ratio": _num(fwd["forward_ratio"]),
        "explain_ratio": _num(exp["explain_ratio"]),
        "explained_generation_overhead_pct": _num(gen["explained_generation_overhead_pct"]),
        "explain_cold_ratio": _num(exp["explain_cold_ratio"]),
        "logits_only_forward_ratio": _num(fwd["logits_only_ratio"]),
        "generation_tokens_identical": bool(gen["tokens_identical"]),
    }
    record: dict[str, object] = {
        "forward": fwd,
        "explain": exp,
        "generation": gen,
        "one_off": {**one_off, "explain_cold_seconds": exp["explain_cold_seconds"]},
        "load_average_during": loads,
        "repeats": repeats,
    }
    return record, headline


def _num(x: object) -> float:
    assert isinstance(x, float | int), x
    return float(x)
