/* prismlm waterfall: one token's logit as prototype slices + residual (+ bias), drawn as SVG.
   Shared by the explorer (prism serve) and the static report (prism explain --html). No dependencies. */
"use strict";
const PRISM = (typeof window !== "undefined" && window.PRISM) || {};
if (typeof window !== "undefined") window.PRISM = PRISM;

PRISM.esc = s => String(s == null ? "" : s).replace(/[&<>"']/g,
  c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", "\"": "&quot;", "'": "&#39;"}[c]));
PRISM.vis = s => String(s).replace(/\n/g, "↵").replace(/\t/g, "⇥");
PRISM.fmt = (v, d = 3) => (v >= 0 ? "+" : "") + v.toFixed(d);
/* The one token convention of the app, the report and the terminal: a token stands for the model's
   prediction OF it, made from the tokens before it (its logit is logits[j - 1, token j]). */
PRISM.CONVENTION = "Each token stands for the model's prediction of that token, from the tokens before it; the first token is context only.";

/* steps: [{name, value, kind: "p"|"r"|"b", suppressed?}] in order; total: the logit.
   Returns an SVG string: one row per step, each bar from the running sum to the running sum + value,
   then the total from 0. The running sum ends exactly at the total (the decomposition is exact). */
PRISM.waterfall = function (steps, total, opts = {}) {
  const W = opts.width || 560, rowH = 20, left = opts.labelWidth || 210, right = 70, top = 18;
  const rows = steps.concat([{name: opts.totalName || "logit", value: total, kind: "total"}]);
  let cum = 0, lo = 0, hi = 0;
  const spans = rows.map(s => {
    if (s.kind === "total") { lo = Math.min(lo, 0, s.value); hi = Math.max(hi, 0, s.value); return [0, s.value]; }
    const a = cum; cum += s.value; lo = Math.min(lo, a, cum); hi = Math.max(hi, a, cum); return [a, cum];
  });
  if (hi - lo < 1e-9) { hi += 1; }
  const plotW = W - left - right, H = top + rows.length * rowH + 8;
  const x = v => left + (v - lo) / (hi - lo) * plotW;
  let h = `<svg class="wf" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" role="img">`;
  h += `<line class="axis" x1="${x(0)}" x2="${x(0)}" y1="${top - 4}" y2="${H - 4}"/>`;
  h += `<text x="${x(0)}" y="11" text-anchor="middle">0</text>`;
  rows.forEach((s, i) => {
    const y = top + i * rowH, [a, b] = spans[i];
    const cls = s.kind === "total" ? "total" : s.kind === "r" ? "r" : s.kind === "b" ? "b" : (s.value >= 0 ? "p" : "n");
    const x0 = Math.min(x(a), x(b)), w = Math.max(1, Math.abs(x(b) - x(a)));
    const maxc = Math.floor((left - 8) / 6.4), name = s.name.length > maxc ? s.name.slice(0, maxc - 1) + "…" : s.name;
    h += `<text class="lab" x="${left - 6}" y="${y + 13}" text-anchor="end"><title>${PRISM.esc(s.name)}</title>${PRISM.esc(name)}</text>`;
    if (s.suppressed) h += `<rect class="sup" x="${x0}" y="${y + 3}" width="${Math.max(w, 6)}" height="${rowH - 7}"><title>suppressed</title></rect>`;
    else h += `<rect class="${cls}" x="${x0}" y="${y + 3}" width="${w}" height="${rowH - 7}"><title>${PRISM.esc(s.name)}: ${s.value.toFixed(4)}</title></rect>`;
    if (i + 1 < rows.length - 1) h += `<line class="link" x1="${x(b)}" x2="${x(b)}" y1="${y + rowH - 4}" y2="${y + rowH + 3}"/>`;
    h += `<text x="${W - right + 6}" y="${y + 13}">${s.kind === "total" ? s.value.toFixed(3) : PRISM.fmt(s.value)}</text>`;
  });
  return h + "</svg>";
};

/* A candidate of the explorer API (or a position of an Explanation) → waterfall steps. */
PRISM.stepsOf = function (active, slices, residual, bias, maxRows = 12) {
  const steps = [];
  const order = active.map((a, j) => j);
  let rest = 0, nrest = 0;
  order.forEach((j, r) => {
    const a = active[j];
    if (r < maxRows) steps.push({name: `#${a.id} ${a.label || ""}`, value: slices[j], kind: "p",
                                 suppressed: a.multiplier === 0});
    else { rest += slices[j]; nrest++; }
  });
  if (nrest) steps.push({name: `${nrest} more prototypes`, value: rest, kind: "p"});
  steps.push({name: "residual W r", value: residual, kind: "r"});
  if (bias) steps.push({name: "bias b", value: bias, kind: "b"});
  return steps;
};

PRISM.hist = function (h) {
  if (!h || !h.length) return "";
  const m = Math.max(...h, 1), w = 6, H = 34;
  const bars = h.map((c, i) => `<rect x="${i * w}" y="${H - H * c / m}" width="${w - 1}" height="${H * c / m}"><title>[${(i / h.length).toFixed(2)}, ${((i + 1) / h.length).toFixed(2)}): ${c}</title></rect>`).join("");
  return `<svg class="hist" width="${h.length * w + 64}" height="${H + 12}">${bars}<text x="0" y="${H + 10}">0</text><text x="${h.length * w - 6}" y="${H + 10}">1</text><text x="${h.length * w + 4}" y="12">activation</text></svg>`;
};

/* A histogram of signed values {lo, hi, counts, mean, std} (a prototype's W p_i over the vocabulary):
   bars left of 0 red, right of 0 blue, a line at 0. */
PRISM.signedHist = function (h) {
  const n = h.counts.length, w = 7, H = 40, W = n * w, m = Math.max(...h.counts, 1);
  const at = v => (v - h.lo) / (h.hi - h.lo) * W;
  const bars = h.counts.map((c, i) => {
    const a = h.lo + (h.hi - h.lo) * i / n, b = h.lo + (h.hi - h.lo) * (i + 1) / n, ht = c ? Math.max(1, H * Math.sqrt(c / m)) : 0;
    return `<rect class="${b <= 0 ? "n" : "p"}" x="${i * w}" y="${H - ht}" width="${w - 1}" height="${ht}"><title>[${a.toFixed(3)}, ${b.toFixed(3)}): ${c} tokens</title></rect>`;
  }).join("");
  const zero = h.lo < 0 && h.hi > 0 ? `<line class="zero" x1="${at(0)}" x2="${at(0)}" y1="0" y2="${H}"/>` : "";
  return `<svg class="hist signed" width="${W + 110}" height="${H + 12}">${bars}${zero}<text x="0" y="${H + 10}">${h.lo.toFixed(2)}</text><text x="${W - 24}" y="${H + 10}">${h.hi.toFixed(2)}</text><text x="${W + 4}" y="12">(W p_i)_v over</text><text x="${W + 4}" y="24">${h.tokens.toLocaleString()} tokens</text><text x="${W + 4}" y="36">(height: √count)</text></svg>`;
};
