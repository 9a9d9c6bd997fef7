"""`prism` commands for training-data attribution (prototype-space influence, baselines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from prismlm.cli.console import fail as _fail


def build_run_cache(run: Path, *, r: int | None = None, projection: str = "orthogonal", mode: str = "shared",
                    damping: float = 0.1, max_sequences: int | None = None, batch_size: int = 16,
                    dtype: str = "float32", out: Path | None = None, shards_dir: Path | None = None,
                    device: str = "auto"):
    """``prism attribute-cache`` as a function: build RUN/attribution-cache (or ``out``)."""
    from prismlm.app.operations import resolve_shards, run_dir
    from prismlm.tda.cache import build_cache
    from prismlm.train.checkpoint import load_checkpoint
    from prismlm.train.distributed import resolve_device

    ckpt = load_checkpoint(run, device=resolve_device(device))
    if not ckpt.model.is_prism:
        raise ValueError(f"{ckpt.path} is a dense baseline: prototype-space attribution needs a PRISM model")
    if projection not in ("identity", "orthogonal", "gaussian", "pca"):
        raise ValueError(f"--projection must be identity, orthogonal, gaussian or pca, got {projection!r}")
    if mode not in ("shared", "exact"):
        raise ValueError(f"--curvature must be shared or exact, got {mode!r}")
    if dtype not in ("float16", "float32", "float64"):
        raise ValueError(f"--dtype must be float16, float32 or float64, got {dtype!r}")
    shards = resolve_shards(ckpt, shards_dir)
    out = out or run_dir(run, ckpt) / "attribution-cache"
    return build_cache(ckpt, shards, r=r, projection=projection, mode=mode, damping=damping,  # type: ignore[arg-type]
                       max_sequences=max_sequences, batch_size=batch_size, dtype=dtype, out=out)  # type: ignore[arg-type]


def attribute_run(run: Path, text: str, *, answer: str | None = None, completion: int | None = None,
                  generate: int = 0, top: int = 10, method: str = "cached", cache_dir: Path | None = None,
                  shards_dir: Path | None = None, max_sequences: int | None = None, temperature: float = 0.0,
                  seed: int = 0, device: str = "auto", token_ids: list[int] | None = None):
    """``prism attribute`` as a function: returns an ``Attribution`` (of ``token_ids`` exactly, if given)."""
    from prismlm.app.operations import resolve_shards, run_dir
    from prismlm.errors import ArtifactError
    from prismlm.tda.attribute import attribute
    from prismlm.tda.cache import AttributionCache
    from prismlm.tda.influence import FullGradients
    from prismlm.train.checkpoint import load_checkpoint
    from prismlm.train.distributed import resolve_device

    ckpt = load_checkpoint(run, device=resolve_device(device))
    if not ckpt.model.is_prism:
        raise ValueError(f"{ckpt.path} is a dense baseline: prototype-space attribution needs a PRISM model")
    if sum(x is not None and x != 0 for x in (answer, completion, generate)) > 1:
        raise ValueError("use at most one of --answer, --completion and --generate")
    if method not in ("cached", "full"):
        raise ValueError(f"--method must be cached or full, got {method!r}")
    kw: dict[str, Any] = {}
    if method == "cached":
        path = cache_dir or run_dir(run, ckpt) / "attribution-cache"
        if not (path / "manifest.json").exists():
            raise ArtifactError(f"no attribution cache at {path}; build it with `prism attribute-cache {run}` "
                              f"(or use --method full)")
        cache = AttributionCache.load(path, checkpoint=ckpt)
        shards = resolve_shards(ckpt, shards_dir, cache.manifest)
        cache.check(shards=shards)
        kw["cache"] = cache
    else:
        shards = resolve_shards(ckpt, shards_dir)
        kw["full"] = FullGradients.build(ckpt, shards, max_sequences=max_sequences)
    return attribute(ckpt, text, answer, shards=shards, completion_tokens=completion, generate=generate, top=top,
                     temperature=temperature, seed=seed, token_ids=token_ids, **kw)


def register(app: typer.Typer) -> None:
    """Add this package's commands to the ``prism`` app."""
    from rich.console import Console
    from rich.table import Table

    console = Console()

    def _errors():
        from prismlm.app.operations import user_errors

        return user_errors()

    @app.command("attribute-cache")
    def attribute_cache_cmd(
        run: Path = typer.Argument(..., help="Run folder or checkpoint folder of a PRISM model."),
        r: int | None = typer.Option(None, "--r", help="Sketch size per posting (default d: exact scores)."),
        projection: str = typer.Option("orthogonal", help="Sketch matrix: orthogonal, gaussian, pca or identity."),
        curvature: str = typer.Option("shared", help="Block curvature: shared (m_i F + λ_i I) or exact."),
        damping: float = typer.Option(0.1, help="Relative damping ρ: λ_i = ρ·tr(H_i)/d."),
        max_sequences: int | None = typer.Option(None, help="Cache only the first N training sequences."),
        batch_size: int = typer.Option(16, help="Sequences per forward pass."),
        dtype: str = typer.Option("float32", help="Sketch storage: float16, float32 or float64."),
        out: Path | None = typer.Option(None, help="Output folder (default RUN/attribution-cache)."),
        shards: Path | None = typer.Option(None, help="Token shard folder (default: the run's)."),
        device: str = typer.Option("auto", help="auto, cpu, cuda…"),
    ) -> None:
        """Build the postings cache for fast prototype-space attribution (one pass over the training data)."""
        try:
            c = build_run_cache(run, r=r, projection=projection, mode=curvature, damping=damping,
                                max_sequences=max_sequences, batch_size=batch_size, dtype=dtype, out=out,
                                shards_dir=shards, device=device)
        except _errors() as e:
            _fail(str(e))
        m = c.manifest
        console.print(f"attribution cache → {c.path}: {m['postings']:,} postings over {m['universe']:,} sequences "
                      f"({m['postings_per_sequence']:.1f}/sequence), r={m['r']} {m['projection']}, "
                      f"{m['bytes_per_token']:.1f} bytes/training token, curvature {m['curvature_seconds']:.1f}s + "
                      f"postings {m['postings_seconds']:.1f}s")

    @app.command("attribute")
    def attribute_cmd(
        run: Path = typer.Argument(..., help="Run folder or checkpoint folder of a PRISM model."),
        text: str = typer.Argument(..., help="Prompt (or prompt + completion with --completion N)."),
        answer: str | None = typer.Option(None, help="A completion to attribute: only its tokens are measured."),
        completion: int | None = typer.Option(None, help="Measure only the last N tokens of TEXT."),
        generate_n: int = typer.Option(0, "--generate", "-g", help="Generate N tokens after TEXT and attribute them."),
        top: int = typer.Option(10, help="Training sequences to show."),
        method: str = typer.Option("cached", help="cached (postings cache) or full (exact block gradients)."),
        cache: Path | None = typer.Option(None, help="Cache folder (default RUN/attribution-cache)."),
        shards: Path | None = typer.Option(None, help="Token shard folder (default: the cache's / the run's)."),
        max_sequences: int | None = typer.Option(None, help="--method full: first N training sequences only."),
        temperature: float = typer.Option(0.0, help="Sampling temperature for --generate (0 = greedy)."),
        seed: int = typer.Option(0, help="Sampling seed."),
        json_out: Path | None = typer.Option(None, "--json", help="Write the result as JSON."),
        html_out: Path | None = typer.Option(None, "--html", help="Write the `prism explain` HTML report of the "
                                                                    "text with a Training data section."),
        device: str = typer.Option("auto", help="auto, cpu, cuda…"),
    ) -> None:
        """The training sequences that most influenced TEXT (or its completion), with the prototypes that
        connect them and snippets."""
        try:
            res = attribute_run(run, text, answer=answer, completion=completion, generate=generate_n, top=top,
                                method=method, cache_dir=cache, shards_dir=shards, max_sequences=max_sequences,
                                temperature=temperature, seed=seed, device=device)
        except _errors() as e:
            _fail(str(e))
        console.print(f"[bold]{res.prompt!r}[/] → measured {res.measured_tokens} token(s)"
                      + (f" of completion {res.completion!r}" if res.completion else "")
                      + f"; loss {res.query_loss:.3f}; {res.method} over {res.num_train:,} sequences in "
                        f"{res.seconds * 1000:.0f} ms")
        table = Table(show_lines=False)
        for col in ("#", "seq", "score", "prototypes (contribution)", "snippet"):
            table.add_column(col)
        for it in res.top:
            protos = ", ".join(f"{p['id']} ({p['contribution']:+.3g})" for p in it.prototypes[:3])
            table.add_row(str(it.rank), str(it.sequence), f"{it.score:+.4g}", protos,
                          it.snippet.replace("\n", " ")[-90:])
        console.print(table)
        for n in res.notes:
            console.print(f"[dim]{n}[/]")
        if json_out:
            res.to_json(json_out)
            console.print(f"JSON → {json_out}")
        if html_out:
            from prismlm.app.operations import explain_run
            from prismlm.explore import write_html

            try:  # the explanation of the attributed text (prompt + completion), with the index if there is one
                expl = explain_run(run, res.prompt + res.completion, shards_dir=shards, device=device)
            except _errors() as e:
                _fail(str(e))
            write_html(expl, html_out, attribution=res)
            console.print(f"HTML → {html_out}")
