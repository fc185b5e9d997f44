// fleetrl's dashboard: log in, then draw each snapshot the daemon pushes (server-sent
// events). No library, no build step: canvas line charts and plain tables.
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const $ = (id) => document.getElementById(id);

function fmt(v, digits = 3) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number") return String(v);
  if (v !== 0 && (Math.abs(v) < 1e-3 || Math.abs(v) >= 1e5)) return v.toExponential(2);
  return Number.isInteger(v) ? String(v) : v.toFixed(digits);
}

function clock(s) {
  s = Math.floor(s || 0);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  return h ? `${h}h${String(m).padStart(2, "0")}m` : `${m}m${String(r).padStart(2, "0")}s`;
}

// lines: [{label, color, xs, ys, lo?, hi?}]; a band is drawn where lo/hi are given
function drawChart(canvas, lines) {
  const ctx = canvas.getContext("2d"), W = canvas.width, H = canvas.height, pad = 34;
  ctx.clearRect(0, 0, W, H);
  const pts = [];
  for (const l of lines) l.xs.forEach((x, i) => {
    for (const y of [l.ys[i], l.lo && l.lo[i], l.hi && l.hi[i]]) if (typeof y === "number") pts.push([x, y]);
  });
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#777";
  if (!pts.length) { ctx.fillText("no data yet", W / 2 - 30, H / 2); return; }
  let [x0, x1] = [Math.min(...pts.map(p => p[0])), Math.max(...pts.map(p => p[0]))];
  let [y0, y1] = [Math.min(...pts.map(p => p[1])), Math.max(...pts.map(p => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 + 1e-9; y1 += Math.abs(y1) * 0.1 + 1e-9; }
  const X = (x) => pad + (x - x0) / (x1 - x0) * (W - pad - 8), Y = (y) => H - 18 - (y - y0) / (y1 - y0) * (H - 30);
  ctx.strokeStyle = "#ccc"; ctx.beginPath(); ctx.moveTo(pad, 6); ctx.lineTo(pad, H - 18); ctx.lineTo(W - 8, H - 18); ctx.stroke();
  ctx.fillText(fmt(y1), 2, 14); ctx.fillText(fmt(y0), 2, H - 20); ctx.fillText(fmt(x0, 0), pad, H - 4);
  ctx.fillText(fmt(x1, 0), W - 40, H - 4);
  lines.forEach((l, k) => {
    const color = l.color || COLORS[k % COLORS.length];
    if (l.lo && l.hi) {
      ctx.fillStyle = color + "33"; ctx.beginPath();
      l.xs.forEach((x, i) => (i ? ctx.lineTo : ctx.moveTo).call(ctx, X(x), Y(l.hi[i])));
      for (let i = l.xs.length - 1; i >= 0; i--) ctx.lineTo(X(l.xs[i]), Y(l.lo[i]));
      ctx.closePath(); ctx.fill();
    }
    ctx.strokeStyle = color; ctx.lineWidth = 1.5; ctx.beginPath();
    let on = false;
    l.xs.forEach((x, i) => {
      const y = l.ys[i];
      if (typeof y !== "number") { on = false; return; }
      if (on) ctx.lineTo(X(x), Y(y)); else ctx.moveTo(X(x), Y(y));
      on = true;
    });
    ctx.stroke();
    ctx.fillStyle = color; ctx.fillText(l.label, pad + 48 + 130 * k, 12);
  });
}

function row(cells, classes = []) {
  const tr = document.createElement("tr");
  cells.forEach((c, i) => {
    const td = document.createElement("td");
    td.textContent = c;
    if (classes[i]) td.className = classes[i];
    tr.appendChild(td);
  });
  return tr;
}

function render(s) {
  const run = s.run || {}, trainer = (s.actors.trainer || {}).statistics || {};
  const state = run.draining ? "draining" : run.paused ? "paused" : run.phase;
  $("run").textContent = `${run.run_id || ""} · ${state} · up ${clock(run.uptime_s)}`;
  const last = s.series.last || {}, evals = s.evals || {};
  const fresh = (evals.fresh || evals[Object.keys(evals)[0]] || []).slice(-1)[0];
  const cards = [
    ["step", last.step], ["version", last.version],
    ["reward (last step)", s.series.reward_mean.slice(-1)[0]],
    ["held-out pass@1", fresh ? `${(100 * fresh.pass_at_1).toFixed(1)}% at v${fresh.version}` : null],
    ["tokens/s", last.tokens_per_s], ["$ per rollout", s.series.usd_per_rollout.slice(-1)[0]],
    ["samplers up", `${s.fleet.filter(f => f.health === "up").length}/${s.fleet.length}`],
    ["checkpoint", run.checkpoint ? `#${run.checkpoint.seq}` : null],
  ];
  $("cards").replaceChildren(...cards.map(([k, v]) => {
    const d = document.createElement("div"); d.className = "card";
    d.innerHTML = `<span></span><b></b>`; d.firstChild.textContent = k; d.lastChild.textContent = fmt(v);
    return d;
  }));
  const xs = s.series.steps;
  const passLines = Object.entries(evals).map(([split, pts], k) => ({
    label: split, color: COLORS[k], xs: pts.map(p => p.version), ys: pts.map(p => p.pass_at_1),
    lo: pts.map(p => p.ci_low), hi: pts.map(p => p.ci_high)}));
  drawChart($("chart-pass"), passLines);
  for (const key of ["reward_mean", "grad_norm", "staleness_mean", "delta_ratio", "usd_per_rollout"]) {
    drawChart($("chart-" + key), [{label: key, xs, ys: s.series[key]}]);
  }
  drawChart($("chart-kl"), Object.entries(s.series.kl_by_sampler).map(([kind, ys]) => ({label: kind, xs, ys})));
  $("fleet").tBodies[0].replaceChildren(...s.fleet.map(f => row(
    [f.sampler, f.backend, f.device, f.dtype, f.version, f.lag, `${f.queue}/${f.capacity}`, fmt(f.tokens_per_s, 1),
     fmt(f.usd_per_1k_tokens, 5), fmt(f.mismatch_kl), f.health], [,,,,,,,,,, f.health])));
  const counts = (d) => Object.entries(d || {}).map(([k, v]) => `${k}=${v}`).join(" ");
  $("workers").tBodies[0].replaceChildren(...(s.workers || []).map(w => row(
    [w.worker, w.actor, w.address ? `${w.host} (${w.address})` : w.host, fmt(w.attempts_running),
     fmt(w.groups_running), counts(w.groups), counts(w.failures),
     `${fmt(w.sandboxes_warm)} / ${fmt(w.sandboxes_leased)} / ${fmt(w.sandboxes_limit)}`,
     typeof w.last_seen_s === "number" ? `${w.last_seen_s.toFixed(1)} s ago` : "-",
     w.ended ? `${w.health} (${w.ended})` : w.health], [,,,,,,,,, w.health])));
  $("actors").tBodies[0].replaceChildren(...Object.entries(s.actors).map(([name, a]) => row(
    [name, a.state, a.restarts, Object.entries(a.versions || {}).map(([k, v]) => `${k}=${v}`).join(" "),
     a.last_error || ""], [, a.state])));
  $("events").replaceChildren(...s.events.map(e => {
    const li = document.createElement("li"); li.className = e.level || "info";
    const detail = Object.entries(e.detail || {}).map(([k, v]) => `${k}=${v}`).join(" ");
    li.textContent = `${(e.time || "").slice(11, 19)} ${e.actor ? e.actor + ": " : ""}${e.event} ${detail}`;
    return li;
  }));
  document.body.dataset.seq = s.seq;
  document.body.dataset.updates = String(Number(document.body.dataset.updates) + 1);
}

// the held series with a tick's new steps appended, each array cut to the last `points`
function appendSeries(held, tick) {
  const n = held.steps.length, keep = tick.points || 2000;
  const grow = (old, add) => (old || new Array(n).fill(null)).concat(add).slice(-keep);
  const out = {};  // the keys in the server's order, so that it reads as the whole snapshot's series
  for (const [k, v] of Object.entries(tick)) {
    if (Array.isArray(v)) out[k] = grow(held[k], v);
    else if (k !== "kl_by_sampler") out[k] = v;
    else {
      out[k] = {};
      const kinds = [...new Set([...Object.keys(held.kl_by_sampler || {}), ...Object.keys(v)])].sort();
      for (const kind of kinds) out[k][kind] = grow((held.kl_by_sampler || {})[kind], v[kind] || new Array(tick.steps.length).fill(null));
    }
  }
  return out;
}

function showLogin(failed) {
  document.body.dataset.state = "login";
  $("login").hidden = false; $("dashboard").hidden = true; $("logout").hidden = true;
  $("login-error").hidden = !failed;
}

function start() {
  document.body.dataset.state = "live";
  $("login").hidden = true; $("dashboard").hidden = false; $("logout").hidden = false;
  const events = new EventSource("events");
  let held = null;  // the series so far: a tick carries only the new steps
  events.addEventListener("snapshot", (e) => {
    const s = JSON.parse(e.data); held = window.fleetrlSeries = s.series; render(s);
  });
  events.addEventListener("tick", (e) => {
    const s = JSON.parse(e.data);
    if (held) { s.series = appendSeries(held, s.series); held = window.fleetrlSeries = s.series; render(s); }
  });
  events.onerror = () => { document.body.dataset.state = "reconnecting"; };
  events.onopen = () => { document.body.dataset.state = "live"; };
}

// served at PREFIX/: relative URLs resolve under the prefix even when opened without the slash
if (!location.pathname.endsWith("/")) location.replace(location.pathname + "/" + location.search);
$("login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const body = new URLSearchParams({token: $("token").value});
  $("token").value = "";
  const r = await fetch("login", {method: "POST", body, redirect: "manual", credentials: "same-origin"});
  if (r.status === 401) return showLogin(true);
  start();
});
fetch("snapshot", {credentials: "same-origin"}).then(r => r.status === 200 ? start() : showLogin(false));
