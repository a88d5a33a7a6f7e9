// The dashboard's script: a served file, not inline, so the page's CSP allows only script-src 'self'.
"use strict";
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#be185d", "#4d7c0f"];
let state = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "text") node.textContent = value; else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

// series: [{name, values, dashed}] aligned with times; each becomes a polyline that names its series and last value.
function drawChart(id, legendId, times, series) {
  const svg = document.getElementById(id), legend = document.getElementById(legendId);
  const width = svg.clientWidth || 400, height = svg.clientHeight || 170, pad = 28;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.replaceChildren(); legend.replaceChildren();
  const ns = "http://www.w3.org/2000/svg";
  const all = series.flatMap(s => s.values.filter(v => v !== null));
  const max = Math.max(1, ...all);
  const t0 = times.length ? times[0] : 0, t1 = times.length ? times[times.length - 1] : 1;
  const x = t => pad + (t1 > t0 ? (t - t0) / (t1 - t0) : 1) * (width - pad - 6);
  const y = v => height - 18 - (v / max) * (height - 30);
  for (const tick of [0, max / 2, max]) {
    const line = document.createElementNS(ns, "line");
    Object.entries({x1: pad, x2: width - 6, y1: y(tick), y2: y(tick), stroke: "#e5e7eb"}).forEach(([k, v]) => line.setAttribute(k, v));
    const label = document.createElementNS(ns, "text");
    Object.entries({x: 2, y: y(tick) + 4, "font-size": 10, fill: "#6b7280"}).forEach(([k, v]) => label.setAttribute(k, v));
    label.textContent = Number.isInteger(tick) ? tick : tick.toFixed(1);
    svg.append(line, label);
  }
  const span = document.createElementNS(ns, "text");
  Object.entries({x: width - 6, y: height - 4, "font-size": 10, fill: "#6b7280", "text-anchor": "end"}).forEach(([k, v]) => span.setAttribute(k, v));
  span.textContent = times.length ? `last ${Math.round(t1 - t0)} s` : "no samples yet";
  svg.append(span);
  series.forEach((s, index) => {
    const color = COLORS[Math.floor(index / (s.dashed === undefined ? 1 : 2)) % COLORS.length];
    const points = s.values.map((v, i) => v === null ? null : `${x(times[i]).toFixed(1)},${y(v).toFixed(1)}`).filter(p => p);
    const last = [...s.values].reverse().find(v => v !== null);
    const line = document.createElementNS(ns, "polyline");
    Object.entries({points: points.join(" "), fill: "none", stroke: color, "stroke-width": 2,
                    "data-series": s.name, "data-last": last === undefined ? "" : last}).forEach(([k, v]) => line.setAttribute(k, v));
    if (s.dashed) line.setAttribute("stroke-dasharray", "5 4");
    svg.append(line);
    const shown = last === undefined ? "" : ` (${Number.isInteger(last) ? last : last.toFixed(1)})`;
    // The swatch's colour goes through the CSSOM: a style attribute would need 'unsafe-inline' in the CSP.
    const swatch = el("i", {});
    swatch.style.background = color;
    const key = el("span", {}, swatch, s.name + shown);
    legend.append(key);
  });
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 120) return seconds.toFixed(1) + " s";
  if (seconds < 7200) return (seconds / 60).toFixed(1) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

function render() {
  const latest = state.latest || {workers: [], queues: [], runs_by_state: {}, problems: []};
  const history = state.history;
  document.getElementById("mode").textContent = state.read_only ? "read-only" : "actions need the token";
  document.getElementById("token").hidden = state.read_only;
  document.getElementById("sampled").textContent = state.sampled_at ? "sampled " + new Date(state.sampled_at * 1000).toLocaleTimeString() : "";

  const workerSeries = [];
  for (const [name, s] of Object.entries(history.workers)) {
    workerSeries.push({name: `in_flight:${name}`, values: s.in_flight, dashed: false});
    workerSeries.push({name: `capacity:${name}`, values: s.capacity, dashed: true});
  }
  drawChart("chart-workers", "legend-workers", history.t, workerSeries);
  drawChart("chart-depth", "legend-depth", history.t,
            Object.entries(history.queues).map(([name, s]) => ({name: `depth:${name}`, values: s.depth})));
  drawChart("chart-oldest", "legend-oldest", history.t,
            Object.entries(history.queues).map(([name, s]) => ({name: `oldest:${name}`, values: s.oldest})));

  const workers = document.getElementById("workers");
  workers.replaceChildren(el("tr", {}, el("th", {text: "worker"}), el("th", {text: "in flight / capacity"}), el("th", {text: "held by queue"})));
  for (const w of latest.workers) {
    const held = Object.entries(w.queue_slots).map(([q, slots]) => `${q} ${w.held_by_queue[q] || 0}/${slots}`).join(", ");
    workers.append(el("tr", {"data-worker": w.name}, el("td", {text: w.name}), el("td", {class: "num", text: `${w.in_flight} / ${w.capacity}`}), el("td", {text: held})));
  }
  const queues = document.getElementById("queues");
  queues.replaceChildren(el("tr", {}, el("th", {text: "queue"}), el("th", {text: "depth"}), el("th", {text: "oldest ready"}), el("th", {text: "dead runs"})));
  for (const q of latest.queues) {
    queues.append(el("tr", {"data-queue": q.name}, el("td", {text: q.name}), el("td", {class: "num", text: q.depth === null ? "–" : q.depth}),
                     el("td", {class: "num", text: age(q.oldest_ready_seconds)}), el("td", {class: "num", text: q.dead_runs})));
  }
  const runs = Object.entries(latest.runs_by_state).sort().map(([s, n]) => `${s} ${n}`).join(" · ");
  document.getElementById("runs").textContent = "Runs: " + (runs || "none");
  document.getElementById("outbox").textContent = latest.outbox_backlog === null ? "" :
    `Outbox: ${latest.outbox_backlog} unpublished, oldest ${age(latest.outbox_oldest_seconds)}`;
  const panels = state.panels || {problems: []};
  const outboxLine = document.getElementById("outbox");
  if (panels.outbox && panels.outbox.problem) {
    outboxLine.textContent += ` · ${panels.outbox.problem}`;
    outboxLine.className = "problem";
  } else {
    outboxLine.className = "";
  }
  document.getElementById("problems").replaceChildren(
    ...[...latest.problems, ...panels.problems].map(p => el("p", {class: "problem", text: p})));
  renderBeat(panels.beat);
  renderLimits(panels.limits || []);
  renderSleeping(panels.sleeping || []);
  renderOutbox(panels.outbox);

  const dead = document.getElementById("dead");
  dead.replaceChildren(el("tr", {}, el("th", {text: "run"}), el("th", {text: "task"}), el("th", {text: "queue"}),
                              el("th", {text: "attempts"}), el("th", {text: "last error"}), el("th", {text: ""})));
  for (const run of state.dead_runs) {
    const actions = el("td", {});
    if (!state.read_only) {
      for (const verb of ["requeue", "cancel"]) {
        const button = el("button", {"data-action": verb, "data-run-id": run.id, text: verb});
        button.addEventListener("click", () => act(verb, run.id));
        actions.append(button);
      }
    }
    dead.append(el("tr", {"data-run-id": run.id}, el("td", {text: run.id}), el("td", {text: run.task}), el("td", {text: run.queue || ""}),
                   el("td", {class: "num", text: run.attempts}), el("td", {class: "error", text: run.last_error || ""}), actions));
  }
  if (!state.dead_runs.length) dead.append(el("tr", {}, el("td", {colspan: 6, text: "no dead run"})));
}

function when(iso) {
  return iso ? new Date(iso).toLocaleTimeString() : "–";
}

// A table's rows; a row whose data has a problem is highlighted and ends in a cell saying why.
function fillTable(id, headers, rows, empty) {
  const table = document.getElementById(id);
  table.replaceChildren(el("tr", {}, ...headers.map(h => el("th", {text: h})), el("th", {text: "problem"})));
  for (const {attrs, cells, problem} of rows) {
    const row = el("tr", {...attrs, ...(problem ? {class: "problem", "data-problem": problem} : {})},
                   ...cells.map(c => el("td", typeof c === "object" ? c : {text: c === null || c === undefined ? "–" : c})),
                   el("td", {class: "cause", text: problem || ""}));
    table.append(row);
  }
  if (!rows.length) table.append(el("tr", {}, el("td", {colspan: headers.length + 1, class: "muted", text: empty})));
}

function renderBeat(beat) {
  const leader = document.getElementById("beat-leader"), last = document.getElementById("beat-last");
  if (!beat) {
    leader.textContent = "the beat could not be read (see the problems above)";
    leader.className = "problem";
    last.textContent = "";
    fillTable("beat-entries", [], [], "");
    return;
  }
  const lead = beat.leader;
  leader.className = beat.problem ? "problem" : "";
  leader.setAttribute("data-host", lead && lead.host ? lead.host : "");
  leader.setAttribute("data-pid", lead && lead.pid !== null ? lead.pid : "");
  leader.textContent = lead ? `beat ${beat.beat}: led by ${lead.host ? `${lead.host} pid ${lead.pid}` :
    `holder ${lead.holder} (an older replica: host and pid not recorded)`}, term ${lead.term}`
    : `beat ${beat.beat}: ${beat.problem || "no replica leads (no entry to send)"}`;
  const fired = beat.last_fire;
  last.textContent = fired ? `last fire: ${fired.entry} at ${when(fired.at)} (${age(Math.max(0, fired.ago_seconds))} ago), ` +
    `lag ${age(fired.lag_seconds)}` : "last fire: none yet";
  fillTable("beat-entries", ["entry", "task", "schedule", "next fire", "last fire", "lag", "paused"],
            beat.entries.map(e => ({attrs: {"data-entry": e.name}, problem: e.problem,
                                    cells: [e.source === "stored" ? `${e.name} (stored)` : e.name, e.task, e.schedule, when(e.next_due), when(e.last_fire_at),
                                            {class: "num", text: age(e.lag_seconds)}, e.paused ? "paused" : "no"]})),
            "no beat_schedule entry in this app");
}

function renderLimits(scopes) {
  fillTable("limits", ["task", "scope", "held / limit", "waiting", "oldest waiting"],
            scopes.map(s => ({attrs: {"data-scope": `${s.task}/${s.kind}/${s.key}`, ...(s.full ? {"data-full": "1"} : {})},
                              problem: s.problem,
                              cells: [s.task, s.kind === "task" ? "task" : `${s.kind} ${s.key}`,
                                      {class: "num", text: `${s.held} / ${s.limit === null ? "?" : s.limit}`},
                                      {class: "num", text: s.ready ? `${s.waiting} (+${s.ready} sent on)` : s.waiting},
                                      {class: "num", text: age(s.oldest_waiting_seconds)}]})),
            "no limit is held or waited on");
}

function renderSleeping(runs) {
  fillTable("sleeping", ["run", "task", "queue", "wakes at", "in"],
            runs.map(r => ({attrs: {"data-run-id": r.id}, problem: r.problem,
                            cells: [r.id, r.task, r.queue, when(r.wake_at),
                                    {class: "num", text: r.wakes_in_seconds === null ? "–" :
                                      r.wakes_in_seconds >= 0 ? age(r.wakes_in_seconds) : `due ${age(-r.wakes_in_seconds)} ago`}]})),
            "no run is sleeping");
}

function renderOutbox(outbox) {
  fillTable("outbox-failing", ["task id", "task", "attempts", "last error", "next try in"],
            (outbox ? outbox.failing : []).map(r => ({attrs: {"data-task-id": r.task_id, ...(r.flagged ? {"data-flagged": "1"} : {})},
                                                      problem: r.problem,
                                                      cells: [r.task_id, r.task, {class: "num", text: r.attempts},
                                                              {class: "error", text: r.error},
                                                              {class: "num", text: r.next_try_in_seconds > 0 ? age(r.next_try_in_seconds) : "now"}]})),
            "no row failed to publish");
}

async function act(verb, runId) {
  const notice = document.getElementById("notice");
  const response = await fetch(`/api/runs/${encodeURIComponent(runId)}/${verb}`,
                               {method: "POST", headers: {"X-Durable-Token": document.getElementById("token").value}});
  const body = await response.json();
  notice.textContent = response.ok ? body.done : body.error;
  notice.className = response.ok ? "" : "problem";
  notice.setAttribute("data-status", response.status);
  await refresh();
}

async function refresh() {
  try {
    const response = await fetch("/api/state", {cache: "no-store"});
    state = await response.json();
    render();
  } catch (err) {
    document.getElementById("sampled").textContent = "the dashboard did not answer: " + err;
  }
}

refresh();
setInterval(refresh, 2000);
