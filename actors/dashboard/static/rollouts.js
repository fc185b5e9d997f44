// fleetrl's rollout browser: the trainer's rollout log, listed (filters: task, mean
// reward, failure kind) and one group's attempts side by side, each model call with the
// text it added to the conversation, its generated tokens shaded by the sampler's
// probability (masked ones struck through), its tool calls, sampler and versions.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const num = (v, d = 3) => (v === null || v === undefined) ? "-" : (Number.isInteger(v) ? String(v) : v.toFixed(d));
  let chosen = null, busy = false;

  function query() {
    const q = new URLSearchParams();
    for (const [key, id] of [["task", "f-task"], ["reward_min", "f-min"], ["reward_max", "f-max"], ["failure", "f-failure"]]) {
      const v = $(id).value.trim();
      if (v) q.set(key, v);
    }
    return q.toString();
  }

  async function refresh() {
    if (busy || document.body.dataset.state === "login" || $("dashboard").hidden) return;
    busy = true;
    try {
      const r = await fetch("rollouts?" + query(), {credentials: "same-origin"});
      if (r.status !== 200) { $("rollout-count").textContent = (await r.json()).error || r.statusText; return; }
      const data = await r.json();
      const select = $("f-failure"), had = new Set([...select.options].map(o => o.value));
      for (const kind of data.failure_kinds) if (!had.has(kind)) select.appendChild(new Option(kind, kind));
      $("rollout-count").textContent = `${data.matched} group(s)`;
      $("groups").tBodies[0].replaceChildren(...data.groups.map(g => {
        const tr = el("tr");
        const fails = g.failures.map(f => f.reason).join(" ");
        for (const c of [g.step ?? "-", g.group_id, g.task_id, g.rewards.map(r => num(r, 2)).join(" "),
                         num(g.mean_reward), g.tokens, g.masked, fails, g.samplers.join(" ")]) tr.appendChild(el("td", "", String(c)));
        if (g.n !== null) {
          tr.dataset.n = g.n;
          tr.addEventListener("click", () => show(g.n));
        }
        if (g.n === chosen) tr.classList.add("chosen");
        return tr;
      }));
      document.body.dataset.rollouts = String(data.matched);
    } finally {
      busy = false;
    }
  }

  function tokens(call) {
    const out = el("div", "answer");
    for (const [text, q, p, masked, version] of call.tokens) {
      const span = el("span", masked ? "tok masked" : "tok", text);
      const prob = q === null ? 1 : Math.exp(q);
      span.style.background = `rgba(31, 119, 180, ${(0.65 * (1 - prob)).toFixed(3)})`;
      span.title = `log q ${num(q)} · log p ${num(p)} · v${version}${masked ? " · masked" : ""}`;
      out.appendChild(span);
    }
    return out;
  }

  function render(g) {
    $("group").hidden = false;
    $("group").dataset.n = g.n;
    $("group-title").textContent = `group ${g.group_id} · task ${g.task_id} · step ${g.step} · version ${g.version}` +
      (g.skipped ? ` · step skipped (${g.skipped})` : "");
    $("group-failures").replaceChildren(...g.failures.map(f =>
      el("p", "error", `failed attempt ${f.attempt_id}: ${f.reason}: ${f.detail}`)));
    $("attempts").replaceChildren(...g.attempts.map(a => {
      const box = el("div", a.reward > 0 ? "attempt pass" : "attempt");
      box.dataset.reward = a.reward;
      box.appendChild(el("h4", "", `${a.attempt_id} · reward ${num(a.reward, 3)} · advantage ${num(a.advantage, 3)}`));
      a.calls.forEach((c, k) => {
        const call = el("div", "call");
        call.appendChild(el("div", "meta", `call ${k + 1} · ${c.sampler} · versions ${c.versions.join("-")} · ` +
          `${c.tokens.length} tokens, ${c.masked} masked · ${c.finish_reason}` + (c.trained ? "" : " · not trained")));
        const ctx = el("details");
        ctx.appendChild(el("summary", "meta", c.context_kind === "prompt" ? "prompt" :
          `added before this call (tool output, user turn; ${c.shared} tokens carried over)`));
        ctx.appendChild(el("div", "context", c.context));
        if (c.context_kind === "added" || c.context.length < 400) ctx.open = true;
        call.appendChild(ctx);
        call.appendChild(tokens(c));
        for (const t of c.tool_calls) call.appendChild(el("div", "toolcall", `tool call ${t.name}(${t.arguments})`));
        if (c.tool_call_error) call.appendChild(el("div", "meta", `no tool call parsed: ${c.tool_call_error}`));
        box.appendChild(call);
      });
      return box;
    }));
  }

  async function show(n) {
    chosen = n;
    for (const tr of $("groups").tBodies[0].rows) tr.classList.toggle("chosen", tr.dataset.n === String(n));
    const r = await fetch(`rollouts/${n}`, {credentials: "same-origin"});
    const body = await r.json();
    if (r.status !== 200) {
      $("group").hidden = false; $("attempts").replaceChildren(); $("group-failures").replaceChildren();
      $("group-title").textContent = body.error || r.statusText;
      return;
    }
    render(body);
  }

  $("rollout-filter").addEventListener("submit", (ev) => { ev.preventDefault(); refresh(); });
  setInterval(refresh, 5000);
  // the first listing as soon as the dashboard is live
  const first = setInterval(() => {
    if (document.body.dataset.state === "live") { clearInterval(first); refresh(); }
  }, 200);
})();
