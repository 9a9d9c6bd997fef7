/* PRISM explorer front end: hash routes over the JSON API of prism serve. Plain JS, no build step. */
"use strict";
const P = window.PRISM, esc = P.esc, vis = P.vis;
const $ = (sel, root = document) => root.querySelector(sel);
const view = $("#view");
const CAT_COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f"];
const state = {info: null, explainText: "", explainData: null};
const lim = (name, want) => Math.min(want, state.info ? state.info.limits[name] : want);

/* ----- API and routing ----------------------------------------------------------------------------------- */
async function api(path, body, method) {
  const r = await fetch(path, body === undefined ? (method ? {method} : {}) :
    {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
  const d = await r.json().catch(() => ({message: r.statusText}));
  if (!r.ok) {
    const msg = d.message || (Array.isArray(d.detail) ? d.detail.map(x => `${x.loc.slice(-1)[0]}: ${x.msg}`).join("; ") : d.detail) || r.statusText;
    throw new Error(msg + (d.fix ? ` (fix: ${d.fix})` : ""));
  }
  return d;
}
function parseHash() {
  const h = location.hash.replace(/^#\/?/, "");
  const [path, query] = h.split("?");
  const parts = (path || "explain").split("/").map(decodeURIComponent);
  return {name: parts[0] || "explain", arg: parts[1], q: new URLSearchParams(query || "")};
}
function go(name, arg, params, keepEmpty = []) {  // keepEmpty: keys kept in the URL even when "" (an empty text is a request too)
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== undefined && v !== null && (v !== "" || keepEmpty.includes(k))) q.set(k, v);
  const h = `#/${name}${arg !== undefined && arg !== null ? "/" + encodeURIComponent(arg) : ""}${q.toString() ? "?" + q : ""}`;
  if (location.hash === h) route(); else location.hash = h;
}
function setHashQuiet(name, arg, params) {  // update the shareable URL without re-running the view
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== undefined && v !== null && v !== "") q.set(k, v);
  history.replaceState(null, "", `#/${name}${arg != null ? "/" + encodeURIComponent(arg) : ""}${q.toString() ? "?" + q : ""}`);
}
/* Slow work answers 202 with a job: show its message and progress, poll it until it ends, offer Cancel. */
async function apiJob(path, body, out) {
  const d = await api(path, body);
  if (!d.job) return d;
  let job = d.job;
  const draw = () => {
    const pct = job.total ? Math.round(100 * job.done / job.total) : null;
    out.innerHTML = `<div class="job" id="job-status" data-state="${esc(job.state)}"><p class="busy">${esc(job.message)}</p>
      <p class="muted">${esc(job.state)}${job.stage ? ` · ${esc(job.stage)} ${job.done}${job.total ? "/" + job.total : ""} ${esc(job.unit)}` : ""} · ${job.seconds.toFixed(0)} s</p>
      ${pct !== null ? `<progress max="100" value="${pct}"></progress>` : ""} <button id="job-cancel">Cancel</button></div>`;
    $("#job-cancel").onclick = async () => { job = await api(`/api/jobs/${job.id}`, undefined, "DELETE"); };
  };
  while (!["done", "failed", "cancelled"].includes(job.state)) {
    draw();
    await new Promise(res => setTimeout(res, 500));
    if (!document.body.contains(out)) throw new Error("left the view");  // the page moved on: stop polling
    job = await api(`/api/jobs/${job.id}`);
  }
  if (job.state === "failed") throw new Error(job.error.message + (job.error.fix ? ` (fix: ${job.error.fix})` : ""));
  if (job.state === "cancelled") throw new Error("cancelled");
  return job.result;
}
const showError = (el, e) => { el.innerHTML = `<div class="error">${esc(e.message || e)}</div>`; };
const busy = el => { el.innerHTML = `<p class="busy">working…</p>`; };
const protoLink = (id, text) => `<a href="#/prototype/${id}${text ? "?text=" + encodeURIComponent(text) : ""}" class="plink" data-id="${id}">#${id}</a>`;
const catColor = c => { const i = state.info ? state.info.categories.indexOf(c) : -1; return i >= 0 ? CAT_COLORS[i % CAT_COLORS.length] : "#9aa3b2"; };
const hexA = (hex, a) => { const n = parseInt(hex.slice(1), 16); return `rgba(${n >> 16},${(n >> 8) & 255},${n & 255},${a})`; };

const VIEWS = {explain: viewExplain, prototype: viewPrototype, map: viewMap, steer: viewSteer, training: viewTraining,
               document: viewDocument};
async function route() {
  const r = parseHash();
  const fn = VIEWS[r.name] || viewExplain;
  document.querySelectorAll("#nav a").forEach(a => a.classList.toggle("on", a.dataset.view === (r.name === "document" ? "training" : r.name)));
  window.scrollTo(0, 0);
  try { await fn(r); } catch (e) { showError(view, e); console.warn(e); }
}

/* ----- Explain ------------------------------------------------------------------------------------------- */
async function viewExplain(r) {
  const text = r.q.get("text") ?? state.explainText ?? "";
  const gen = r.q.get("generate") || "0", alts = r.q.get("alternatives") || "5", mode = r.q.get("color") || "prototype";
  const chat = state.info.chat && r.q.get("chat") === "1", system = r.q.get("system") || "";
  view.innerHTML = `<h1>Explain</h1>
  <p class="muted">Every next-token logit is an exact sum of prototype slices a<sub>i</sub>·(W p<sub>i</sub>)<sub>y</sub>,
  one residual slice (W r)<sub>y</sub> (and the bias, if the model has one). Type or generate text, then click a token.</p>
  <p class="convention">${esc(P.CONVENTION)}</p>
  <textarea id="explain-text" placeholder="${chat ? "Message to the model" : "Text to explain"}">${esc(text)}</textarea>
  ${state.info.chat ? `<div class="controls"><label title="the text is a message to the model: its answer is generated (greedy, up to the end-of-turn token) with the run's chat template and explained"><input id="explain-chat" type="checkbox" ${chat ? "checked" : ""}> chat</label>
    <label id="explain-system-label" style="${chat ? "" : "display:none"}">system prompt <input id="explain-system" size="50" placeholder="(the template's default)" value="${esc(system)}"></label></div>` : ""}
  <div class="controls">
    <label>generate <input id="explain-gen" type="number" min="0" value="${esc(gen)}"></label>
    <label>alternatives <input id="explain-alts" type="number" min="0" value="${esc(alts)}"></label>
    <label>seed <input id="explain-seed" type="number" value="${esc(r.q.get("seed") || "0")}"></label>
    <label>colour by <select id="explain-color"><option value="prototype">top prototype</option><option value="residual">residual share</option></select></label>
    <button class="primary" id="explain-go">Explain</button>
  </div>
  <div id="explain-out"></div>`;
  $("#explain-color").value = mode;
  const chatOn = () => !!($("#explain-chat") && $("#explain-chat").checked);
  if ($("#explain-chat")) $("#explain-chat").onchange = () => { $("#explain-system-label").style.display = chatOn() ? "" : "none"; };
  const run = () => go("explain", null, {text: $("#explain-text").value, generate: $("#explain-gen").value | 0 || "",
    alternatives: $("#explain-alts").value, seed: $("#explain-seed").value | 0 || "", color: $("#explain-color").value,
    chat: chatOn() ? "1" : "", system: chatOn() ? $("#explain-system").value : ""}, ["text"]);
  $("#explain-go").onclick = run;
  $("#explain-text").onkeydown = e => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) run(); };
  $("#explain-color").onchange = () => { if (state.explainData) renderTokens(state.explainData, $("#explain-color").value); };
  if (!r.q.has("text")) return;
  const out = $("#explain-out");
  busy(out);
  let d;
  try {
    const body = {text, generate: +gen, alternatives: +alts, seed: +(r.q.get("seed") || 0), chat, system: chat && system ? system : null};
    d = chat || +gen ? await apiJob("/api/explain?job=true", body, out) : await api("/api/explain", body);
  } catch (e) { showError(out, e); return; }
  state.explainText = chat ? text : d.text; state.explainData = d;
  out.innerHTML = `${d.notes.length ? `<ul class="notes">${d.notes.map(n => `<li>${esc(n)}</li>`).join("")}</ul>` : ""}
    <div class="legend" id="explain-legend"></div>
    <div class="panel"><div class="tokens" id="explain-tokens"></div></div>
    <div class="muted">max |Σ slices + residual − logit| over every waterfall: ${d.max_abs_error.toExponential(1)}</div>
    <div class="row"><div class="grow panel" id="explain-detail">Click a token to see why the model predicted it.</div>
    <div class="grow" id="explain-cards"></div></div>`;
  renderTokens(d, mode);
  const sel = r.q.get("pos");  // the index of the token shown (as in the tooltips): position pos − 1 predicts it
  const start = sel !== null && +sel >= 1 ? +sel - 1 : d.positions.length - 1;
  if (d.positions[start]) showPosition(d, start);
}

function renderTokens(d, mode) {
  const legend = $("#explain-legend");
  if (mode === "residual") legend.innerHTML = `<span>residual share of the logit: <span class="resid-scale"></span> 0 → 100%</span><span>dotted underline: generated</span><span>orange underline: the prototypes alone predict another token</span>`;
  else legend.innerHTML = state.info.categories.map(c => `<span><i style="background:${catColor(c)}"></i>${esc(c)}</span>`).join("") +
    `<span><i style="background:#9aa3b2"></i>unlabelled</span><span>(shade: the top prototype's share; white: residual dominates)</span>`;
  const gen0 = d.prompt_tokens;
  let h = `<span class="tok ctx" title="token 0 (context)">${esc(vis(d.tokens[0]))}</span>`;
  d.positions.forEach((p, t) => {
    let bg;
    if (mode === "residual") bg = `rgba(230,80,60,${(0.06 + 0.62 * Math.min(1, Math.abs(p.residual_share))).toFixed(2)})`;
    else {
      const a = p.active[0];
      bg = a ? hexA(catColor(a.category), (0.12 + 0.7 * Math.min(1, Math.abs(p.top_share))).toFixed(2)) : "transparent";
    }
    const last = t === d.positions.length - 1 && p.chosen_by !== "text" && p.chosen_by !== "sampled";
    const differ = p.prototype_top_id >= 0 && p.prototype_top_id !== p.model_top_id;
    const cls = ["tok", gen0 !== null && t + 1 >= gen0 ? "gen" : "", last ? "ghost" : "", differ ? "pdiff" : ""].join(" ");
    const alone = p.prototype_top_id >= 0 ? `; prototypes alone: ${p.prototype_top_token}${differ ? " (≠ the model's token)" : ""}` : "";
    const tip = `token ${t + 1}: ${p.chosen.token} (p=${p.chosen.prob.toFixed(3)}); top: ${p.top_prototype !== null ? "#" + p.top_prototype : "-"} ${(100 * p.top_share).toFixed(0)}%, residual ${(100 * p.residual_share).toFixed(0)}%${alone}${last ? " — the model's next token (" + p.chosen_by + ")" : ""}`;
    h += `<span class="${cls}" data-pos="${t}" data-token="${t + 1}" style="background:${bg}" title="${esc(tip)}">${esc(vis(p.chosen.token))}</span>`;
  });
  const el = $("#explain-tokens");
  el.innerHTML = h;
  el.querySelectorAll("span.tok[data-pos]").forEach(s => s.onclick = () => showPosition(d, +s.dataset.pos));
}

// what the prototypes alone would have predicted (argmax W ẑ + b), flagged when it is not the model's own token
function aloneHtml(p) {
  if (p.prototype_top_id === undefined || p.prototype_top_id < 0) return "";
  const same = p.prototype_top_id === p.model_top_id;
  return `<div class="alone ${same ? "agree" : "differ"}">prototypes alone would predict <code>${esc(vis(p.prototype_top_token))}</code>${same ? " — the model's own token" : " — <b>not</b> the model's token"};
    they give <code>${esc(vis(p.chosen.token))}</code> p̂ = ${p.prototype_prob.toFixed(3)}</div>`;
}

function showPosition(d, t, altIndex) {
  document.querySelectorAll("#explain-tokens span.tok").forEach(s => s.classList.toggle("sel", s.dataset.pos === String(t)));
  const p = d.positions[t], c = p.chosen;
  const q = parseHash().q; q.set("pos", t + 1);  // the URL names the token (its index), not the position before it
  history.replaceState(null, "", "#/explain?" + q.toString());
  const ctx = d.tokens.slice(Math.max(0, t - 8), t + 1).join("");
  let h = `<h2 style="margin-top:0" id="explain-head">…${esc(vis(ctx))} → <code>${esc(vis(c.token))}</code> <span class="muted">token ${t + 1}</span></h2>
    <div class="muted">${esc(p.chosen_by)}, logit ${c.logit.toFixed(3)}, p = ${c.prob.toFixed(3)}, rank ${c.rank + 1};
    Σ slices + residual${c.bias ? " + bias" : ""} = ${c.total.toFixed(4)}</div>${aloneHtml(p)}
    <div class="wfpair"><div id="wf-chosen">${P.waterfall(P.stepsOf(p.active, c.slices, c.residual, c.bias), c.logit, {totalName: "logit " + JSON.stringify(c.token).slice(0, 14)})}</div></div>`;
  if (p.alternatives.length) {
    h += `<h3>Why this token and not another? <span class="muted">(click a row)</span></h3><table class="alts"><tr><th>token</th><th>p</th><th>logit</th><th>gap</th><th>biggest difference</th></tr>`;
    p.alternatives.forEach((a, j) => {
      const diffs = p.active.map((x, k) => [x.id, c.slices[k] - a.slices[k]]).sort((u, v) => Math.abs(v[1]) - Math.abs(u[1]));
      const dr = c.residual - a.residual, big = diffs.length && Math.abs(diffs[0][1]) > Math.abs(dr) ? `#${diffs[0][0]} ${P.fmt(diffs[0][1])}` : `residual ${P.fmt(dr)}`;
      h += `<tr data-alt="${j}" class="${altIndex === j ? "on" : ""}"><td><code>${esc(vis(a.token))}</code></td><td class="num">${a.prob.toFixed(3)}</td><td class="num">${a.logit.toFixed(3)}</td><td class="num">${P.fmt(c.logit - a.logit)}</td><td>${esc(big)}</td></tr>`;
    });
    h += `</table>`;
  }
  h += `<div class="controls"><label>why not <input id="alt-token" size="14" placeholder='a token, e.g. " Rome"'></label><button id="alt-go">compare</button>
    ${t + 1 < d.token_ids.length ? `<button id="resid-go" title="what the residual vector pushes, the prototypes nearest to it, its share over the answer">what is in the residual?</button>` : ""}</div>
    <div id="wf-alt"></div><div id="residual-panel"></div>`;
  const det = $("#explain-detail");
  det.innerHTML = h;
  det.querySelectorAll("tr[data-alt]").forEach(tr => tr.onclick = () => showPosition(d, t, +tr.dataset.alt));
  if (altIndex !== undefined) drawAlt(p, c, p.alternatives[altIndex]);
  const typed = async () => {
    try {
      const r = await api("/api/contrast", {token_ids: d.token_ids, token_index: t + 1, token: $("#alt-token").value});
      const by = Object.fromEntries(r.view.active.map((x, k) => [x.id, r.view.chosen.slices[k]]));
      drawAlt(p, c, {...r.view.chosen, slices: p.active.map(x => by[x.id] ?? 0)});
    } catch (e) { showError($("#wf-alt"), e); }
  };
  $("#alt-go").onclick = typed;
  $("#alt-token").onkeydown = e => { if (e.key === "Enter") typed(); };
  if ($("#resid-go")) $("#resid-go").onclick = () => showResidual(d, t);
  // cards of the active prototypes, by contribution to the chosen token
  const cards = p.active.map((a, k) => [a, c.slices[k]]).map(([a, s]) => cardHtml(d.cards[a.id], s, d.text)).join("");
  $("#explain-cards").innerHTML = `<h2 style="margin-top:.3em">Active prototypes</h2>${cards || "<p class='muted'>none</p>"}`;
}

function drawAlt(p, c, a) {  // the alternative's waterfall and the difference chosen − alternative
  const steps = p.active.map((x, k) => ({name: `#${x.id} ${x.label || ""}`, value: c.slices[k] - a.slices[k], kind: "p"}));
  steps.push({name: "residual W r", value: c.residual - a.residual, kind: "r"});
  if (c.bias || a.bias) steps.push({name: "bias b", value: c.bias - a.bias, kind: "b"});
  $("#wf-alt").innerHTML = `<div class="wfpair"><div><h3>${esc(JSON.stringify(a.token))}: logit ${a.logit.toFixed(3)}${a.rank !== undefined ? ` <span class="muted">rank ${a.rank + 1}, p = ${a.prob.toFixed(4)}</span>` : ""}</h3>${P.waterfall(P.stepsOf(p.active, a.slices, a.residual, a.bias), a.logit, {width: 460, labelWidth: 170})}</div>
    <div><h3>difference chosen − alternative</h3>${P.waterfall(steps, c.logit - a.logit, {width: 460, labelWidth: 170, totalName: "logit gap"})}</div></div>`;
}

async function showResidual(d, t) {
  const el = $("#residual-panel");
  busy(el);
  let r;
  try { r = await api("/api/residual", {token_ids: d.token_ids, token_index: t + 1, answer_from: d.prompt_tokens ?? 1}); }
  catch (e) { showError(el, e); return; }
  const chips = list => list.map(([tk, v]) => `<span title="${v.toFixed(3)}">${esc(vis(tk))}</span>`).join("");
  el.innerHTML = `<h3>The residual of <code>${esc(vis(r.token))}</code> <span class="muted">token ${r.token_index}</span></h3>
    <div class="muted" id="resid-share">slice (W r)<sub>y</sub> = ${P.fmt(r.residual_slice)}, ${(100 * r.residual_share).toFixed(0)}% of this logit's |slices|; ‖r‖/‖z‖ = ${r.norm_share.toFixed(2)};
    over ${r.answer_tokens} tokens from token ${r.answer_from} on, the residual is ${(100 * r.answer_share).toFixed(0)}% on average</div>
    <div class="chips" id="resid-up">W r pushes up: ${chips(r.pushes_up)}</div><div class="chips down">down: ${chips(r.pushes_down)}</div>
    <div class="muted">prototypes nearest to r (cosine), with their nearest training context:</div>
    <ol class="snips" id="resid-anchors">${r.anchors.map(a => `<li>${protoLink(a.id)} ${a.cosine.toFixed(3)} <span class="muted">${esc(a.label || "")}</span> ${a.target || a.before ? snippet(a) : ""}</li>`).join("")}</ol>`;
}

function cardHtml(c, slice, text) {
  if (!c) return "";
  const st = c.stats;
  const nb = (c.neighbours || []).map(n => `<li>${snippet(n)} ${docLink(n)}</li>`).join("");
  const q = c.evidence && c.evidence.quality != null ? c.evidence.quality : null;
  return `<div class="card" data-proto="${c.id}"><h3>${protoLink(c.id, text)} <span class="lab">${esc(c.label || "")}</span>
    ${q !== null ? `<span class="muted quality" title="how often a token the label names is the next token where the prototype fires">quality ${q.toFixed(2)}</span>` : ""}
    ${c.category ? `<span class="cat" style="background:${hexA(catColor(c.category), .2)}">${esc(c.category)}</span>` : ""}
    ${slice !== undefined ? `<span class="${slice >= 0 ? "pos" : "neg"}" style="float:right">${P.fmt(slice)}</span>` : ""}</h3>
    <div class="stats">${st ? `active on ${st.count.toLocaleString()} indexed tokens (${(100 * st.frequency).toFixed(2)}%), mean activation ${st.mean_activation.toFixed(3)}` : "no index: neighbourhood not available"}</div>
    <div class="chips">W p<sub>i</sub> pushes up: ${c.top_tokens.slice(0, 8).map(([t, v]) => `<span title="${v.toFixed(3)}">${esc(vis(t))}</span>`).join("")}</div>
    <div class="chips down">down: ${(c.bottom_tokens || []).slice(0, 6).map(([t, v]) => `<span title="${v.toFixed(3)}">${esc(vis(t))}</span>`).join("")}</div>
    ${nb ? `<ol class="snips">${nb}</ol>` : ""}</div>`;
}
const snippet = n => `${esc(vis(n.before || ""))}<mark>${esc(vis(n.target || ""))}</mark>${esc(vis(n.after || ""))}`;
const docLink = n => n.doc_index !== null && n.doc_index !== undefined ?
  `<a class="doc" href="#/document/${n.doc_index}?position=${n.position ?? ""}">${esc(n.doc_id || "doc " + n.doc_index)}${n.position != null ? ":" + n.position : ""}</a>` : "";

/* ----- Prototype ----------------------------------------------------------------------------------------- */
async function viewPrototype(r) {
  const id = r.arg, text = r.q.get("text") ?? state.explainText ?? "";
  view.innerHTML = `<h1>Prototype</h1><div class="controls"><label>id <input id="proto-id" type="number" min="0" value="${esc(id ?? "")}"></label>
    <button class="primary" id="proto-go">Open</button> <span class="muted">or search the <a href="#/map">map</a></span></div><div id="proto-out"></div>`;
  const open = () => go("prototype", $("#proto-id").value, {text});
  $("#proto-go").onclick = open;
  $("#proto-id").onkeydown = e => { if (e.key === "Enter") open(); };
  if (id === undefined || id === "") return;
  const out = $("#proto-out");
  busy(out);
  let d;
  try { d = await api(`/api/prototype/${encodeURIComponent(id)}?neighbours=${lim("max_top", 12)}&similar=${lim("max_top", 8)}${text ? "&text=" + encodeURIComponent(text) : ""}`); }
  catch (e) { showError(out, e); return; }
  const c = d.card, st = c.stats;
  let fires = "";
  if (d.fires) {
    // marked: the tokens whose prediction it took part in (active at the position before: token_index)
    const act = new Map(d.fires.map(f => [f.token_index, f]));
    const mx = Math.max(1e-9, ...d.fires.map(f => f.activation));
    const n = d.text_tokens.length, last = act.get(n);
    const toks = last ? d.text_tokens.concat([last.next_token]) : d.text_tokens;
    fires = `<div class="panel"><h2 style="margin-top:0">Where it fires in the current text</h2>
      <p class="convention">${esc(P.CONVENTION)} Shaded: the tokens whose prediction it took part in.</p>
      <div class="tokens" id="proto-fires">${toks.map((t, i) => { const f = act.get(i);
        return `<span class="tok ctx${i === n ? " ghost" : ""}" data-i="${i}" style="${f ? `background:rgba(91,141,239,${(0.15 + 0.75 * f.activation / mx).toFixed(2)});color:inherit` : ""}" title="${f ? `a=${f.activation.toFixed(3)} at the token before; its slice of this token's logit: ${f.slice.toFixed(3)}${i === n ? " (the model's own next token)" : ""}` : ""}">${esc(vis(t))}</span>`; }).join("")}</div>
      <div class="muted">${d.fires.length} of ${n} predictions</div></div>`;
  }
  out.innerHTML = `<div class="row"><div class="grow">
    <div class="card" data-proto="${c.id}"><h3>#${c.id} <span class="lab">${esc(c.label || "(no label)")}</span>
      ${c.category ? `<span class="cat" style="background:${hexA(catColor(c.category), .2)}">${esc(c.category)}</span>` : ""}</h3>
      <div class="stats">${st ? `active on ${st.count.toLocaleString()} indexed tokens (${(100 * st.frequency).toFixed(2)}%), mean activation ${st.mean_activation.toFixed(3)}, nearest context cos ${st.max_similarity.toFixed(3)}` : "no index: build one with <code>prism index</code> for neighbourhoods and statistics"}</div>
      ${st ? P.hist(st.histogram) : ""}
      <h3>Signature W p<sub>i</sub>: the tokens it pushes up</h3><div class="chips" id="proto-up">${c.top_tokens.map(([t, v]) => `<span title="${v.toFixed(4)}">${esc(vis(t))} <small>${v.toFixed(2)}</small></span>`).join("")}</div>
      <h3>… and down</h3><div class="chips down" id="proto-down">${(c.bottom_tokens || []).map(([t, v]) => `<span title="${v.toFixed(4)}">${esc(vis(t))} <small>${v.toFixed(2)}</small></span>`).join("")}</div>
      ${d.logit_histogram ? `<h3>Its logit effect on every token</h3><div id="proto-logit-hist">${P.signedHist(d.logit_histogram)}</div>` : ""}
      <p><a href="#/steer?suppress=${c.id}&prompt=${encodeURIComponent(text.slice(0, 200))}" id="proto-steer">Steer: suppress this prototype →</a></p>
    </div>${fires}</div>
    <div class="grow"><div class="panel"><h2 style="margin-top:0">Nearest training contexts</h2>
      <p class="convention">Marked: the token predicted from the context nearest to the prototype (as in Explain).</p>
      ${c.neighbours.length ? `<ol class="snips" id="proto-contexts">${c.neighbours.map(n => `<li><span class="muted">${n.similarity.toFixed(3)}</span> ${snippet(n)} ${docLink(n)}</li>`).join("")}</ol>` : "<p class='muted'>no index</p>"}</div>
    ${d.bands && d.bands.length ? (d.bands[0].kind === "activation" ? `<div class="panel" id="proto-bands"><h2 style="margin-top:0">Examples across its activation range</h2>
      <p class="muted">A uniform random sample of ${d.bands[0].sampled.toLocaleString()} of its ${d.bands[0].fired.toLocaleString()} firings in the indexed tokens, in activation intervals of equal width up to the largest sampled a; a few random examples of each. Marked: the token predicted from the context where it fired.</p>
      ${d.bands.map(b => `<h3>${esc(b.band)} <span class="muted">activation interval (${b.interval[0].toFixed(3)}, ${b.interval[1].toFixed(3)}]: ${b.count} of the ${b.sampled} sampled firings</span></h3>
        <ol class="snips" data-band="${esc(b.band)}">${b.examples.map(n => `<li><span class="muted">a=${n.activation.toFixed(3)}</span> ${snippet(n)} ${docLink(n)}</li>`).join("")}</ol>`).join("")}</div>`
    : `<div class="panel" id="proto-bands"><h2 style="margin-top:0">Examples across its stored contexts</h2>
      <p class="muted">The index keeps its ${d.bands[0].stored} nearest training contexts (by cos(z, p<sub>i</sub>), its activation where it is active); top, middle and bottom third of them — not of every activation (the histogram covers those).</p>
      ${d.bands[0].note ? `<ul class="notes"><li>${esc(d.bands[0].note)}</li></ul>` : ""}
      ${d.bands.map(b => `<h3>${b.band} <span class="muted">ranks ${b.ranks[0]}–${b.ranks[1]}, cos ${b.similarity[0].toFixed(3)}–${b.similarity[1].toFixed(3)}</span></h3>
        <ol class="snips" data-band="${b.band}">${b.examples.map(n => `<li><span class="muted">${n.similarity.toFixed(3)}</span> ${snippet(n)} ${docLink(n)}</li>`).join("")}</ol>`).join("")}</div>`) : ""}
    <div class="panel"><h2 style="margin-top:0">Similar prototypes</h2><table>${d.similar.map(s => `<tr><td>${protoLink(s.id, text)}</td><td>${esc(s.label || "")}</td><td class="num">${s.cosine.toFixed(3)}</td></tr>`).join("")}</table></div></div></div>`;
}

/* ----- Map ----------------------------------------------------------------------------------------------- */
async function viewMap(r) {
  const t0 = performance.now();
  view.innerHTML = `<h1>Map of the prototype bank</h1>
    <div class="controls"><input id="map-q" placeholder="search label, category or neighbour text" size="36" value="${esc(r.q.get("q") || "")}">
    <label title="prototypes with the token among the top of their signature W p_i, or in their nearest training contexts"><input type="checkbox" id="map-tok" ${r.q.get("token") ? "checked" : ""}> as a token (in its top pushed tokens or nearest contexts)</label>
    <button id="map-go">Search</button> <span class="muted" id="map-status"></span></div>
    <div class="legend" id="map-legend"></div>
    <div id="map-wrap"><canvas id="map-canvas" width="1160" height="640"></canvas><div id="map-tip"></div></div>
    <div id="map-hits"></div>`;
  const m = await api("/api/map");
  const cv = $("#map-canvas"), ctx = cv.getContext("2d"), K = m.x.length;
  const pad = 16, W = cv.width, H = cv.height;
  const xmin = Math.min(...m.x), xmax = Math.max(...m.x), ymin = Math.min(...m.y), ymax = Math.max(...m.y);
  const sx = v => pad + (v - xmin) / ((xmax - xmin) || 1) * (W - 2 * pad), sy = v => H - pad - (v - ymin) / ((ymax - ymin) || 1) * (H - 2 * pad);
  const px = new Float32Array(K), py = new Float32Array(K), rad = new Float32Array(K);
  const cmax = m.count ? Math.max(1, ...m.count) : 1;
  for (let i = 0; i < K; i++) {
    px[i] = sx(m.x[i]); py[i] = sy(m.y[i]);
    rad[i] = m.count ? 2.2 + 5 * Math.sqrt(Math.log1p(m.count[i]) / Math.log1p(cmax)) : 2.5;
  }
  const color = i => m.category[i] >= 0 ? CAT_COLORS[m.category[i] % CAT_COLORS.length] : "#9aa3b2";
  let hl = null;
  function draw() {
    ctx.clearRect(0, 0, W, H);
    for (let i = 0; i < K; i++) {
      ctx.globalAlpha = hl && !hl.has(i) ? 0.12 : 0.8;
      ctx.fillStyle = color(i);
      ctx.beginPath(); ctx.arc(px[i], py[i], rad[i], 0, 6.2832); ctx.fill();
    }
    ctx.globalAlpha = 1;
    if (hl) { ctx.strokeStyle = "#111"; for (const i of hl) { ctx.beginPath(); ctx.arc(px[i], py[i], rad[i] + 2, 0, 6.2832); ctx.stroke(); } }
  }
  draw();
  const ms = performance.now() - t0;
  window.__prismMapMs = ms; window.__prismMapDrawnAt = performance.now(); cv.dataset.drawn = String(K);
  $("#map-legend").innerHTML = m.categories.map(c => `<span><i style="background:${catColor(c)}"></i>${esc(c)}</span>`).join("") +
    `<span><i style="background:#9aa3b2"></i>unlabelled</span><span>${K.toLocaleString()} prototypes, ${m.method.toUpperCase()}${m.explained_variance ? ` (${(100 * (m.explained_variance[0] + m.explained_variance[1])).toFixed(0)}% of variance)` : ""}; size: use; drawn in ${ms.toFixed(0)} ms</span>`;
  const nearest = e => {
    const b = cv.getBoundingClientRect(), x = (e.clientX - b.left) * W / b.width, y = (e.clientY - b.top) * H / b.height;
    let best = -1, bd = 1e9;
    for (let i = 0; i < K; i++) { const d = (px[i] - x) ** 2 + (py[i] - y) ** 2; if (d < bd) { bd = d; best = i; } }
    return bd < 100 ? best : -1;
  };
  const tip = $("#map-tip");
  cv.onmousemove = e => { const i = nearest(e); if (i < 0) { tip.style.display = "none"; return; }
    tip.style.display = "block"; tip.style.left = (e.offsetX + 12) + "px"; tip.style.top = (e.offsetY + 8) + "px";
    tip.textContent = `#${i} ${m.label[i] || ""}${m.quality && m.quality[i] != null ? " · label quality " + m.quality[i].toFixed(2) : ""}${m.count ? " · " + m.count[i] + " tokens" : ""}`; };
  cv.onmouseleave = () => { tip.style.display = "none"; };
  cv.onclick = e => { const i = nearest(e); if (i >= 0) go("prototype", i, {text: state.explainText}); };
  async function search() {
    const q = $("#map-q").value, tok = $("#map-tok").checked;
    setHashQuiet("map", null, {q, token: tok ? "1" : ""});
    if (!q) { hl = null; draw(); $("#map-hits").innerHTML = ""; $("#map-status").textContent = ""; return; }
    try {
      const s = await api(`/api/search?limit=${lim("max_top", 50)}&${tok ? "token=" : "q="}${encodeURIComponent(q)}`);
      hl = new Set(s.ids); draw();
      $("#map-status").textContent = `${s.matched} match${s.matched === 1 ? "" : "es"}${s.matched > s.hits.length ? `, ${s.hits.length} shown` : ""}`;
      $("#map-hits").innerHTML = `<table><tr><th>prototype</th><th>label</th><th>category</th><th>why it matches</th><th>active on (indexed tokens)</th></tr>${s.hits.map(h => `<tr><td>${protoLink(h.id, state.explainText)}</td><td>${esc(h.label)}</td><td><span class="cat">${esc(h.category)}</span></td><td class="muted">${esc(h.why)}</td><td class="num">${h.count ?? ""}</td></tr>`).join("")}</table>`;
    } catch (e) { showError($("#map-hits"), e); }
  }
  $("#map-go").onclick = search;
  $("#map-q").onkeydown = e => { if (e.key === "Enter") search(); };
  if (r.q.get("q")) search();
}

/* ----- Steer --------------------------------------------------------------------------------------------- */
function parseIds(s) { return String(s || "").split(/[\s,]+/).filter(Boolean).map(Number).filter(n => Number.isInteger(n) && n >= 0); }
async function viewSteer(r) {
  const concepts = Object.keys(state.info.concepts || {});
  const ids = parseIds(r.q.get("suppress"));
  const off = new Set(parseIds(r.q.get("off")));
  view.innerHTML = `<h1>Steer</h1>
    <p class="muted">Suppress prototypes (their slices a<sub>i</sub> W p<sub>i</sub> are removed from every logit) or scale them, and compare with the base model: same prompt, same seed.</p>
    <textarea id="steer-prompt" placeholder="Prompt">${esc(r.q.get("prompt") ?? state.explainText ?? "")}</textarea>
    ${state.info.chat ? `<div class="controls"><label title="the prompt is a message to the model, written with the run's chat template"><input id="steer-chat" type="checkbox" ${r.q.get("chat") === "1" ? "checked" : ""}> chat</label>
      <label>system prompt <input id="steer-system" size="40" placeholder="(the template's default)" value="${esc(r.q.get("system") || "")}"></label></div>` : ""}
    <div class="controls"><label>add prototypes <input id="steer-add" placeholder="ids, e.g. 12, 40" size="14"></label><button id="steer-add-go">Add</button>
      <label>mode <select id="steer-mode"><option value="suppress">suppress (×0)</option><option value="scale">scale</option></select></label>
      <label>factor <input id="steer-factor" type="number" step="0.1" value="${esc(r.q.get("factor") || "2")}"></label>
      <label>concept <select id="steer-concept"><option value="">none</option>${concepts.map(c => `<option>${esc(c)}</option>`).join("")}</select></label></div>
    <div id="steer-chips" class="chips"></div>
    <div class="controls"><label>tokens <input id="steer-tokens" type="number" min="1" value="${esc(r.q.get("tokens") || String(lim("max_generate", 30)))}"></label>
      <label>temperature <input id="steer-temp" type="number" step="0.1" min="0" value="${esc(r.q.get("temperature") || "0.8")}"></label>
      <label>seed <input id="steer-seed" type="number" value="${esc(r.q.get("seed") || "0")}"></label>
      <button class="primary" id="steer-go">Generate</button></div>
    <div id="steer-out"></div>`;
  $("#steer-mode").value = r.q.get("mode") || "suppress";
  $("#steer-concept").value = r.q.get("concept") || "";
  const chips = new Map(ids.map(i => [i, !off.has(i)]));
  function drawChips() {
    $("#steer-chips").innerHTML = [...chips].map(([i, on]) => `<label class="chip ${on ? "on" : ""}"><input type="checkbox" class="steer-toggle" data-id="${i}" ${on ? "checked" : ""}> #${i}</label>`).join("") +
      (chips.size ? ` <a href="#" id="steer-clear">clear</a>` : `<span class="muted">no prototypes chosen: open one from Explain, Prototype or Map, or add ids</span>`);
    document.querySelectorAll(".steer-toggle").forEach(cb => cb.onchange = () => { chips.set(+cb.dataset.id, cb.checked); drawChips(); });
    const cl = $("#steer-clear"); if (cl) cl.onclick = e => { e.preventDefault(); chips.clear(); drawChips(); };
  }
  drawChips();
  $("#steer-add-go").onclick = () => { parseIds($("#steer-add").value).forEach(i => chips.set(i, true)); $("#steer-add").value = ""; drawChips(); };
  $("#steer-go").onclick = () => generate(true);
  async function generate(updateUrl) {
    const on = [...chips].filter(([, v]) => v).map(([i]) => i);
    const mode = $("#steer-mode").value, factor = +$("#steer-factor").value;
    const params = {prompt: $("#steer-prompt").value, suppress: [...chips.keys()].join(","), off: [...chips].filter(([, v]) => !v).map(([i]) => i).join(","),
      mode: mode === "suppress" ? "" : mode, factor: mode === "scale" ? factor : "", concept: $("#steer-concept").value,
      tokens: $("#steer-tokens").value, temperature: $("#steer-temp").value, seed: $("#steer-seed").value,
      chat: $("#steer-chat") && $("#steer-chat").checked ? "1" : "", system: $("#steer-system") ? $("#steer-system").value : ""};
    if (updateUrl) setHashQuiet("steer", null, params);
    const steering = {suppress: mode === "suppress" ? on : [], scale: mode === "scale" ? Object.fromEntries(on.map(i => [i, factor])) : {},
      concept: params.concept || null};
    const out = $("#steer-out");
    busy(out);
    let d;
    try { d = await apiJob("/api/steer?job=true", {prompt: params.prompt, tokens: +params.tokens, temperature: +params.temperature, seed: +params.seed, steering,
      chat: params.chat === "1", system: params.chat === "1" && params.system ? params.system : null}, out); }
    catch (e) { showError(out, e); return; }
    const toks = (list, other) => list.map((t, j) => `<span class="tok ${other[j] !== t ? "diff" : ""}">${esc(vis(t))}</span>`).join("");
    out.innerHTML = `${d.notes.map(n => `<p class="muted">${esc(n)}</p>`).join("")}
      <div class="side"><div class="panel"><h3>base model</h3><div class="tokens" id="steer-base">${esc(vis(d.prompt))}${toks(d.base, d.steered)}</div></div>
      <div class="panel"><h3>steered <span class="muted">${on.length} prototype(s) ${mode === "suppress" ? "suppressed" : "scaled ×" + factor}${params.concept ? ", concept " + esc(params.concept) : ""}</span></h3>
      <div class="tokens" id="steer-steered">${esc(vis(d.prompt))}${toks(d.steered, d.base)}</div></div></div>
      <p class="muted" id="steer-summary">${d.first_difference === null ? "identical generations" + (d.steered_ids && d.inactive.length === d.steered_ids ? ": none of the steered prototypes fires on this text" : d.inactive.length ? ` (${d.inactive.length} of the ${d.steered_ids} steered prototypes never fire on this text: ${d.inactive.slice(0, 20).map(i => "#" + i).join(", ")})` : "") : `the texts part at generated token ${d.first_difference + 1}`}. Below: for each token of the steered text, its exact logit change ℓ′ − ℓ (two forwards) and the changed slices Σ(m<sub>i</sub> − 1)·a<sub>i</sub>(W p<sub>i</sub>)<sub>y</sub> that explain it.</p>
      <table id="steer-steps"><tr><th>step</th><th>steered token</th><th>base would have</th><th>logit base</th><th>steered</th><th>Δ logit</th><th>Σ changed slices</th><th>largest changes</th></tr>
      ${d.steps.map(s => `<tr><td class="num">${s.step + 1}</td><td><code>${esc(vis(s.token))}</code></td><td>${s.base_token !== null && s.base_token !== s.token ? `<code>${esc(vis(s.base_token))}</code>` : ""}</td>
        <td class="num">${s.logit_base.toFixed(3)}</td><td class="num">${s.logit_steered.toFixed(3)}</td><td class="num ${s.delta >= 0 ? "pos" : "neg"}">${P.fmt(s.delta)}</td><td class="num">${P.fmt(s.delta_from_slices)}</td>
        <td>${s.changed.map(c => `${protoLink(c.id)} ${P.fmt(c.delta, 2)}`).join(", ")}</td></tr>`).join("")}</table>`;
  }
  if (r.q.has("prompt") && (ids.length || r.q.get("concept"))) generate(false);
}

/* ----- Training data ------------------------------------------------------------------------------------- */
async function viewTraining(r) {
  const prompt = r.q.get("prompt") ?? state.explainText ?? "", completion = r.q.get("completion") || "";
  const token = r.q.get("token");
  view.innerHTML = `<h1>Training data</h1>
    <p class="muted">The training sequences whose prototype-space influence on the measured tokens is largest (positive: training on it lowers their loss). Scores are shown relative to the largest |score| in the list; each sequence lists the prototypes that connect it to the query and their share of the |contributions| to its score (signed: − hurts; with the other prototypes' net, the |shares| add up to 100%).</p>
    <label>prompt</label><textarea id="train-prompt">${esc(prompt)}</textarea>
    <label>completion (measured; empty: every token of the prompt)</label><textarea id="train-completion" style="min-height:2.5em">${esc(completion)}</textarea>
    <div class="controls"><label>top <input id="train-top" type="number" min="1" value="${esc(r.q.get("top") || "10")}"></label><button class="primary" id="train-go">Attribute</button></div>
    <div id="train-out"></div>`;
  const runIt = tok => go("training", null, {prompt: $("#train-prompt").value, completion: $("#train-completion").value, top: $("#train-top").value, token: tok});
  $("#train-go").onclick = () => runIt("");
  if (!r.q.has("prompt")) return;
  const out = $("#train-out");
  busy(out);
  let d;
  try { d = await apiJob("/api/training", {prompt, completion, top: +(r.q.get("top") || 10), token: token === null || token === "" ? null : +token}, out); }
  catch (e) { showError(out, e); return; }
  out.innerHTML = `${d.notes.map(n => `<p class="muted">${esc(n)}</p>`).join("")}
    <div class="panel"><span class="muted">measured tokens (click one to attribute it alone):</span>
    <div class="chips" id="train-tokens"><a href="#" class="chip ${d.token === null ? "on" : ""}" data-tok="">all ${d.measured.length}</a>${d.measured.map(m => `<a href="#" class="chip ${d.token === m.index ? "on" : ""}" data-tok="${m.index}">${esc(vis(m.token))}</a>`).join("")}</div></div>
    <p class="muted">${esc(d.method)} influence over ${d.num_train.toLocaleString()} training sequences, loss ${d.query_loss.toFixed(3)}, ${(1000 * d.seconds).toFixed(0)} ms wall</p>
    <table id="train-items"><tr><th>#</th><th>relative score</th><th>document</th><th>snippet (most influential token marked)</th><th title="share = contribution / (Σ |contributions| shown + |other prototypes' net|); the |shares| add up to 100%">connecting prototypes (share of |contributions|; − hurts)</th></tr>
    ${d.items.map(it => `<tr><td class="num">${it.rank}</td>
      <td class="num"><span class="bar ${it.relative >= 0 ? "p" : "n"}" style="width:${(50 * Math.abs(it.relative)).toFixed(0)}px"></span> ${P.fmt(it.relative, 2)}</td>
      <td>${docLink({doc_index: it.doc_index, doc_id: it.doc_id, position: null})}<div class="muted">sequence ${it.sequence}</div></td>
      <td class="mono" style="white-space:pre-wrap">${snippet(it)}</td>
      <td>${it.prototypes.slice(0, 4).map(p => `${protoLink(p.id, prompt + completion)} <span class="muted">${esc(p.label || "")}</span> <span class="${p.share >= 0 ? "pos" : "neg"}">${P.fmt(100 * p.share, 0)}%</span>`).join("<br>")}${
        it.prototypes.length > 4 || it.rest ? `<br><span class="muted">others: ${P.fmt(100 * (it.rest_share + it.prototypes.slice(4).reduce((s, p) => s + Math.abs(p.share) * Math.sign(p.share), 0)), 0)}% net</span>` : ""}</td></tr>`).join("")}</table>`;
  out.querySelectorAll("#train-tokens a").forEach(a => a.onclick = e => { e.preventDefault(); runIt(a.dataset.tok); });
}

/* ----- Document ------------------------------------------------------------------------------------------ */
async function viewDocument(r) {
  const pos = r.q.get("position");
  view.innerHTML = `<h1>Training document</h1><div id="doc-out"></div>`;
  const out = $("#doc-out");
  busy(out);
  let d;
  try { d = await api(`/api/document/${encodeURIComponent(r.arg)}${pos ? "?position=" + encodeURIComponent(pos) : ""}`); }
  catch (e) { showError(out, e); return; }
  out.innerHTML = `<p><b>${esc(d.doc_id)}</b> <span class="muted">document ${d.doc_index} of the training shard, ${d.length.toLocaleString()} tokens; showing from token ${d.start}${d.position !== null ? `, target at ${d.position}` : ""}</span> · <a href="#" id="doc-back">back</a></p>
    <div class="docview" id="doc-text">${esc(d.before)}${d.target ? `<mark id="doc-target">${esc(d.target)}</mark>` : ""}${esc(d.after)}</div>`;
  $("#doc-back").onclick = e => { e.preventDefault(); history.back(); };
  const m = $("#doc-target"); if (m) m.scrollIntoView({block: "center"});
}

/* ----- start --------------------------------------------------------------------------------------------- */
(async () => {
  try {
    state.info = await api("/api/info");
    const i = state.info;
    $("#run-info").textContent = `run ${i.run} · step ${i.step ?? "?"} · K=${i.model.num_prototypes.toLocaleString()}, k=${i.model.top_k} · ${i.has_index ? "index ✓" : "no index"} · ${i.has_cache ? "attribution cache ✓" : "no attribution cache"}`;
    // what the server works around (a torn labels.json: served without labels) is shown, not only logged
    if (i.notes && i.notes.length) $("#run-info").insertAdjacentHTML("afterend", `<ul class="notes warning">${i.notes.map(n => `<li>⚠ ${esc(n)}</li>`).join("")}</ul>`);
  } catch (e) { showError(view, e); return; }
  window.addEventListener("hashchange", route);
  route();
})();
