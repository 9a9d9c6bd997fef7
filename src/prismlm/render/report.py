"""Views of an ``Explanation``: a readable terminal view (``rich``) and a self-contained HTML report.

The HTML file needs no network: CSS and JS are inline, the data is embedded as JSON. Tokens are coloured
by their residual share (how much of the logit the prototypes leave unexplained); clicking a token shows
the waterfall of that token's logit — the prediction OF the clicked token from the tokens before it, the
convention of the explorer app and the terminal view too — residual slice and every active prototype's
slice; prototype cards show the
label, nearest training contexts with the target token marked (``<mark>``), the activation histogram
(inline SVG) and the tokens the signature W p_i pushes up and down most.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from prismlm.artifacts import write_output

if TYPE_CHECKING:
    from prismlm.app.run import Run
    from prismlm.explain.explanation import Explanation, TokenExplanation
    from prismlm.explain.records import CardDict, ExplanationDict, TokenDict
    from prismlm.tda.attribute import Attribution, AttributionRecord

__all__ = ["SHARED_ASSETS", "RunHeader", "render_html", "render_terminal", "write_html"]


@dataclass(frozen=True)
class RunHeader:
    """What the report's header names, like the explorer app's: the run folder, its step, K and k; the
    model hash only in small print (a tooltip)."""

    run: str
    step: int | None = None
    num_prototypes: int | None = None
    top_k: int | None = None
    model_sha256: str | None = None

    @classmethod
    def of(cls, run: Run) -> RunHeader:
        protos = run.config.model.prototypes
        return cls(
            run=run.folder.name,
            step=run.step,
            num_prototypes=protos.num_prototypes if protos else None,
            top_k=protos.top_k if protos else None,
            model_sha256=run.identity,
        )

    def text(self) -> str:
        parts = [f"run {self.run}", f"step {self.step if self.step is not None else '?'}"]
        if self.num_prototypes is not None:
            parts.append(f"K={self.num_prototypes:,}" + (f", k={self.top_k}" if self.top_k is not None else ""))
        return " · ".join(parts)


def _vis(tok: str) -> str:
    return tok.replace("\n", "↵").replace("\t", "⇥")


def render_terminal(expl: Explanation, console: Console | None = None, *, top: int = 3, max_rows: int = 64) -> None:
    """Token by token: the explained token, its logit, top prototypes (label and share), residual share.

    One convention with the app and the HTML report: row ``pos j`` is the prediction OF token j from the
    tokens before it (``← t``: token j − 1, the last one the model saw); the last row of a text is the
    model's own next token. For a generation only the generated tokens are listed."""
    console = console or Console()
    for note in expl.notes:
        console.print(f"[dim]note: {note}[/]")
    rows = [p for p in expl.positions if p.chosen_by == "sampled"] or expl.positions
    table = Table(
        title="per-token explanation: logit = Σ prototype slices + residual slice",
        show_lines=False,
        caption="each row: the prediction of its token from the tokens before it (← the token before)",
    )
    # Why min widths and ratio=1: on a narrow terminal (80 columns) rich shrinks every column, and "pos"
    # collapsed to nothing; the prototypes column alone now gives up width (its labels end in "…").
    pos_width = max([3, *(len(str(p.position + 1)) for p in rows[-max_rows:])])
    table.add_column("pos", justify="right", no_wrap=True, min_width=pos_width)
    table.add_column("token ← before", no_wrap=True, overflow="ellipsis", max_width=22, min_width=10)
    table.add_column("logit", justify="right", no_wrap=True, min_width=6)
    table.add_column("resid", justify="right", no_wrap=True, min_width=5)
    table.add_column("top prototypes: id, share, label", overflow="ellipsis", ratio=1, min_width=16)
    table.add_column("protos alone", no_wrap=True, overflow="ellipsis", max_width=16, min_width=8)
    for p in rows[-max_rows:]:
        protos = Text()
        for j, s in enumerate(p.prototypes[:top]):
            protos.append(("\n" if j else "") + f"#{s.id} ", style="bold cyan")
            protos.append(f"{s.share:+.0%} ", style="green" if s.slice >= 0 else "red")
            protos.append(f"{(s.label or '')[:40]}", style="dim")
        if len(p.prototypes) > top:
            protos.append(f" (+{len(p.prototypes) - top})", style="dim")
        how = "" if p.chosen_by in ("text", "sampled") else f" ({p.chosen_by})"
        table.add_row(
            str(p.position + 1),
            f"{_vis(p.next_token)!r}{how} ← {_vis(p.token)!r}",
            f"{p.logit:.2f}",
            f"{p.residual_share:+.0%}",
            protos,
            _alone(p),
        )
    console.print(table)
    console.print(
        f"[dim]max |Σ slices + residual − logit| = {expl.max_abs_error:.2e} over {len(expl.positions)} "
        f"positions; {len(expl.prototypes)} prototypes used{_agreement(expl)}[/]"
    )


def _alone(p: TokenExplanation) -> Text:
    """The prototype-only prediction argmax W ẑ (+ b): plain where it is the model's own token, flagged ≠."""
    if p.prototype_top_id < 0:
        return Text("")
    same = p.prototype_top_id == p.model_top_id
    return Text(("" if same else "≠ ") + repr(_vis(p.prototype_top_token)), style="green" if same else "yellow")


def _agreement(expl: Explanation) -> str:
    """The summary clause: the prototypes alone predict the model's own token at a of n positions ("": none known)."""
    known = [p for p in expl.positions if p.prototype_top_id >= 0]
    agree = sum(p.prototype_top_id == p.model_top_id for p in known)
    return f"; the prototypes alone predict the model's own token at {agree} of {len(known)}" if known else ""


def _hist_svg(hist: list[int], w: int = 200, h: int = 48) -> str:
    if not hist:
        return ""
    m = max(hist) or 1
    bw = w / len(hist)
    bars = "".join(
        f'<rect x="{i * bw:.1f}" y="{h - 14 - (h - 16) * c / m:.1f}" width="{bw - 1:.1f}" '
        f'height="{(h - 16) * c / m:.1f}"><title>[{i / len(hist):.2f}, {(i + 1) / len(hist):.2f}): {c}</title></rect>'
        for i, c in enumerate(hist)
    )
    return (
        f'<svg class="hist" width="{w}" height="{h}" viewBox="0 0 {w} {h}">{bars}'
        f'<text x="0" y="{h - 2}">0</text><text x="{w - 8}" y="{h - 2}">1</text></svg>'
    )


def _card_html(c: CardDict) -> str:
    e = html.escape
    snips = "".join(
        f'<li><span class="sim">{n["similarity"]:.3f}</span> {e(n["before"])}<mark>{e(n["target"] or "")}</mark>'
        f'{e(n["after"])} <span class="doc">{e(str(n["doc_id"]))}:{n["position"]}</span></li>'
        for n in c["neighbours"]
    )
    toks = " ".join(f"<code>{e(repr(t)[1:-1])}</code><sub>{v:.2f}</sub>" for t, v in c["top_tokens"])
    down = " ".join(f"<code>{e(repr(t)[1:-1])}</code><sub>{v:.2f}</sub>" for t, v in c.get("bottom_tokens", []))
    st = c["stats"]
    stats = (
        f"active on {st['count']:,} tokens ({st['frequency']:.2%}), mean activation {st['mean_activation']:.3f}"
        if st
        else "no index: neighbourhood not available"
    )
    return (
        f'<div class="card" id="p{c["id"]}"><h3>#{c["id"]} <span class="lab">{e(c["label"] or "")}</span> '
        f'<span class="cat">{e(c["category"] or "")}</span></h3><div class="stats">{stats}</div>'
        f'{_hist_svg(st["histogram"] if st else [])}<div class="toks">W p<sub>i</sub> pushes up: {toks}</div>'
        f'<div class="toks down">pushes down: {down}</div>'
        f'<ol class="snips">{snips}</ol></div>'
    )


# The stylesheet and the waterfall drawing, shared with the explorer app (``prism serve`` serves them too), so
# the HTML report and the app look and read the same.
SHARED_ASSETS = Path(__file__).resolve().parent / "assets"


def _shared(name: str) -> str:
    return (SHARED_ASSETS / name).read_text(encoding="utf-8")


_CSS = """
body{max-width:1100px;margin:1.5em auto;padding:0 1.5em}
#detail{margin:1em 0;padding:.6em;border:1px solid #ddd;border-radius:6px;min-height:3em}
"""

_JS = """
const D = JSON.parse(document.getElementById('data').textContent);
const esc = PRISM.esc;
// the prototype-only prediction argmax W ẑ (+ b) (prismlm.eval.faithfulness), flagged when not the model's token
function alone(p){
  if (p.prototype_top_id < 0) return '';
  const same = p.prototype_top_id === p.model_top_id;
  return `<div class="alone ${same ? 'agree' : 'differ'}">prototypes alone would predict
    <b>${esc(JSON.stringify(p.prototype_top_token))}</b>${same ? " — the model's own token" : " — <b>not</b> the model's token"};
    they give ${esc(JSON.stringify(p.next_token))} p̂ ${p.prototype_prob.toFixed(3)}</div>`;
}
document.getElementById('convention').textContent = PRISM.CONVENTION;
function show(i){
  document.querySelectorAll('#text span.t').forEach(s => s.classList.toggle('sel', +s.dataset.i === i));
  const p = D.positions[i];
  const steps = p.prototypes.map(s => ({name: `#${s.id} ${s.label || ''}`.slice(0, 34), value: s.slice, kind: 'p'}));
  steps.push({name: 'residual W r', value: p.residual_slice, kind: 'r'});
  if (p.bias_slice) steps.push({name: 'bias b', value: p.bias_slice, kind: 'b'});
  let h = `${esc(JSON.stringify(p.token))} → <b>${esc(JSON.stringify(p.next_token))}</b> (${p.chosen_by}),
    logit ${p.logit.toFixed(3)}, p ${p.prob.toFixed(3)}; Σ slices + residual = ${p.total.toFixed(4)}
    ${alone(p)}
    <div>${PRISM.waterfall(steps, p.logit)}</div>
    <table><tr><th>prototype</th><th>label</th><th>activation</th><th>slice</th><th>share</th></tr>`;
  for (const s of p.prototypes) h += `<tr><td><a href="#p${s.id}">#${s.id}</a></td><td>${esc(s.label||'')}</td>
    <td class="num">${s.activation.toFixed(3)}</td><td class="num ${s.slice>=0?'pos':'neg'}">${s.slice.toFixed(3)}</td>
    <td class="num">${(100*s.share).toFixed(1)}%</td></tr>`;
  h += `<tr><td>residual</td><td></td><td></td><td class="num">${p.residual_slice.toFixed(3)}</td>
    <td class="num">${(100*p.residual_share).toFixed(1)}%</td></tr></table>`;
  document.getElementById('detail').innerHTML = h;
  // the cards of this token's prototypes, by contribution (largest |slice| first)
  const box = document.getElementById('cards');
  const rank = new Map(p.prototypes.map((s, r) => [s.id, r]));
  const cards = [...box.querySelectorAll('.card')];
  cards.sort((a, b) => (rank.get(+a.id.slice(1)) ?? 1e9) - (rank.get(+b.id.slice(1)) ?? 1e9)).forEach(c => box.appendChild(c));
  cards.forEach(c => c.style.display = rank.has(+c.id.slice(1)) ? '' : 'none');
}
document.querySelectorAll('#text span.t[data-i]').forEach(s => s.onclick = () => show(+s.dataset.i));
document.getElementById('all').onclick = () => document.querySelectorAll('.card').forEach(c => c.style.display = '');
"""


def _attribution_html(att: Attribution | AttributionRecord) -> str:
    """The "Training data" section: top training sequences of an ``Attribution`` (prismlm.tda.attribute),
    or its ``to_dict()``."""
    a = att if isinstance(att, dict) else att.to_dict()
    rows = []
    for it in a["top"]:
        protos = ", ".join(
            f'<a href="#p{p["id"]}">#{p["id"]}</a> ({p["contribution"]:+.3g})' for p in it["prototypes"][:3]
        )
        snip = html.escape(it.get("snippet") or "").replace("⟦", "<mark>").replace("⟧", "</mark>")
        rows.append(
            f'<tr><td class="num">{it["rank"]}</td><td class="num">{it["sequence"]}</td>'
            f"<td>{html.escape(str(it.get('doc_id') or ''))}</td>"
            f'<td class="num {"pos" if it["score"] >= 0 else "neg"}">{it["score"]:+.4g}</td>'
            f"<td>{protos}</td><td>{snip}</td></tr>"
        )
    what = f"completion {html.escape(repr(a['completion']))}" if a.get("completion") else "every token"
    return (
        f"<h2>Training data</h2><p>Training sequences with the largest prototype-space influence on {what} "
        f"({a['measured_tokens']} measured token(s); {html.escape(a['method'])} over {a['num_train']:,} "
        f"sequences; positive = helpful, i.e. training on it lowers this loss).</p>"
        f"<table><tr><th>#</th><th>sequence</th><th>document</th><th>score</th><th>connecting prototypes "
        f"(contribution)</th><th>snippet</th></tr>{''.join(rows)}</table>"
    )


def _header_html(run: RunHeader | None, sha: str | None) -> str:
    """The run line under the title: run, step, K, k; the model hash as a tooltip and in small print."""
    sha = sha or (run.model_sha256 if run is not None else None)
    tip = f' title="model_sha256 {html.escape(sha)}"' if sha else ""
    small = f'<span class="muted"{tip}>model {html.escape(sha[:12])}…</span>' if sha else ""
    if run is None:
        return f'<p class="run-line">{small}</p>' if small else ""
    return f'<p class="run-line"><b{tip}>{html.escape(run.text())}</b> {small}</p>'


def _token_spans(d: ExplanationDict) -> list[str]:
    """The text as spans, one convention with the app: the first token is context only; span j (token j)
    stands for the prediction OF token j from the tokens before it (``data-i`` = its position j − 1).
    The model's own next token (argmax/given, not in the text) ends the text, drawn dashed."""
    first = d["tokens"][0] if d["tokens"] else ""
    spans = [f'<span class="t ctx" title="context only: no prediction">{html.escape(first)}</span>']
    start_gen = d["prompt_tokens"]
    for p in d["positions"]:
        r = min(1.0, abs(p["residual_share"]))
        color = f"rgba(230,80,60,{0.08 + 0.6 * r:.2f})"  # redder = more left to the residual
        own = p["chosen_by"] not in ("text", "sampled")
        cls = (
            "t"
            + (" gen" if start_gen is not None and p["position"] + 1 >= start_gen else "")
            + (" ghost" if own else "")
            + (" pdiff" if p["prototype_top_id"] >= 0 and p["prototype_top_id"] != p["model_top_id"] else "")
        )
        spans.append(
            f'<span class="{cls}" data-i="{p["position"]}" style="background:{color}" '
            f'title="{html.escape(repr(p["next_token"]))} ({p["chosen_by"]}) after '
            f'{html.escape(repr(p["token"]))}: residual {p["residual_share"]:+.0%}{_alone_tip(p)}">'
            f"{html.escape(p['next_token'])}</span>"
        )
    return spans


def _alone_tip(p: TokenDict) -> str:
    """The token's tooltip on the prototype-only prediction (empty when not computed)."""
    if p["prototype_top_id"] < 0:
        return ""
    same = p["prototype_top_id"] == p["model_top_id"]
    return html.escape(f"; prototypes alone: {p['prototype_top_token']!r}" + ("" if same else " (≠ the model's token)"))


def render_html(
    expl: Explanation,
    *,
    title: str = "PRISM explanation",
    attribution: Attribution | AttributionRecord | None = None,
    run: Run | RunHeader | None = None,
) -> str:
    """A self-contained HTML page (inline CSS/JS/SVG, embedded JSON; no network). ``attribution``: an
    optional ``Attribution`` shown as a "Training data" section; ``run``: the run explained (a ``Run`` or
    a ``RunHeader``), named in the header with its step, K and k."""
    header = run if run is None or isinstance(run, RunHeader) else RunHeader.of(run)
    d = expl.to_dict()
    spans = _token_spans(d)
    cards = "".join(_card_html(c) for c in d["prototypes"].values())
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in d["notes"])
    data = json.dumps(d, ensure_ascii=False).replace("</", "<\\/")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_shared("prism.css")}{_CSS}</style></head><body>
<h1>{html.escape(title)}</h1>
{_header_html(header, d["model_sha256"])}
<p>Each next-token logit is an exact sum of prototype slices and one residual slice
(max error {d["max_abs_error"]:.1e}){html.escape(_agreement(expl))}. Click a token for the waterfall of its logit.</p>
<p class="convention" id="convention"></p>
<div class="legend">shading: the residual's share of the next token's logit <span class="resid-scale"></span> 0 → 100%
(redder: less explained by prototypes); orange underline: the prototypes alone would have predicted another
token than the model's</div><p class="muted">
Index {html.escape(str(d["index"] or "none"))}.</p>
<ul>{notes}</ul>
<div id="text">{"".join(spans)}</div>
<div id="detail">Click a token to see its prototypes.</div>
{_attribution_html(attribution) if attribution is not None else ""}
<h2>Prototypes <button id="all">show all</button></h2><div id="cards">{cards}</div>
<script type="application/json" id="data">{data}</script>
<script>{_shared("waterfall.js")}</script>
<script>{_JS}</script></body></html>
"""


def write_html(
    expl: Explanation,
    path: str | Path,
    *,
    title: str = "PRISM explanation",
    attribution: Attribution | AttributionRecord | None = None,
    run: Run | RunHeader | None = None,
    option: str = "html_out",
) -> Path:
    """Write the report to ``path`` (parents created, atomically; a path that cannot be written is a
    ``ConfigError`` naming ``option``)."""
    return write_output(path, render_html(expl, title=title, attribution=attribution, run=run), option=option)
