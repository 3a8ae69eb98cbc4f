// The Cleave dashboard: one EventSource on /api/stream (a snapshot, then live updates), drawn as inline SVG.
// No dependencies and no network beyond the monitor itself. Text from the wire only ever goes in textContent.
"use strict";

const NS = "http://www.w3.org/2000/svg";
const MAX_DRAWN_POINTS = 300;   // above this, a chart draws its line and only the last point as a dot
const MAX_EVENT_ROWS = 200;
const KNOWN_KINDS = ["worker_joined", "worker_lost", "recovered", "plan_changed"];
const MARKER_ORDER = ["plan_changed", "other", "worker_joined", "recovered", "worker_lost"];
const S = { job: null, follow: true, jobs: [], series: [], events: [], status: null, timer: null };
const $ = (id) => document.getElementById(id);

// ---- formatting ---------------------------------------------------------------------------------------
function si(x, unit = "", digits = 3) {
  if (x === null || x === undefined || !isFinite(x)) return "–";
  const prefixes = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
  for (const [v, p] of prefixes) if (Math.abs(x) >= v) return (x / v).toPrecision(digits) + " " + p + unit;
  return (Math.abs(x) >= 1 || x === 0 ? x.toPrecision(digits) : x.toPrecision(2)) + (unit ? " " + unit : "");
}
const bytes = (n) => si(n, "B");
const secs = (x) => (x === null || x === undefined ? "–" : x < 1 ? (x * 1000).toFixed(0) + " ms" : x.toFixed(2) + " s");
const clock = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "–");
const median = (xs) => { const s = xs.filter((x) => x !== null).sort((a, b) => a - b); return s.length ? s[Math.floor((s.length - 1) / 2)] : null; };
const kindClass = (k) => (KNOWN_KINDS.includes(k) ? k : "other");

function node(tag, attrs = {}, parent = null, text = null) {
  const e = tag.startsWith("svg:") ? document.createElementNS(NS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== null) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}

// ---- charts -------------------------------------------------------------------------------------------
function ticks(a, b, n) {
  const raw = (b - a) / n, base = Math.pow(10, Math.floor(Math.log10(raw))), err = raw / base;
  const step = base * (err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1);
  const out = [];
  for (let v = Math.ceil(a / step) * step; v <= b + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}

function extent(values, zero) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
  if (zero) lo = Math.min(0, lo);
  if (lo === hi) { const d = Math.abs(lo) * 0.1 || 1; lo -= d; hi += d; }
  const pad = (hi - lo) * 0.05;
  return [zero && lo === 0 ? 0 : lo - pad, hi + pad];
}

// series: [{cls, points: [[x, y], ...]}]; o: {yfmt, zero, hline, markers: [{x, cls, title}]}
function drawChart(svg, series, o = {}) {
  const W = Math.max(300, Math.round(svg.clientWidth || 480)), H = Math.round(svg.clientHeight || 200);
  const L = 58, R = 10, T = 8, B = 22;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  series = series.map((s) => ({ ...s, points: s.points.filter((p) => p[1] !== null && isFinite(p[1])) }));
  svg.dataset.points = String(series.length ? series[0].points.length : 0);
  const all = series.flatMap((s) => s.points);
  if (!all.length) {
    node("svg:text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, svg, "waiting for the first step");
    return;
  }
  const [x0, x1] = extent(all.map((p) => p[0]), false);
  const [y0, y1] = extent(all.map((p) => p[1]).concat(o.hline ? [o.hline] : []), o.zero);
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  const fmt = o.yfmt || ((v) => si(v));
  for (const v of ticks(y0, y1, 4)) {
    node("svg:line", { x1: L, x2: W - R, y1: sy(v), y2: sy(v), class: "grid" }, svg);
    node("svg:text", { x: L - 4, y: sy(v) + 3, "text-anchor": "end", class: "axis" }, svg, fmt(v));
  }
  for (const v of ticks(x0, x1, 6).filter(Number.isInteger)) {
    node("svg:text", { x: sx(v), y: H - 6, "text-anchor": "middle", class: "axis" }, svg, String(v));
  }
  for (const m of o.markers || []) {
    if (m.x < x0 || m.x > x1) continue;
    const line = node("svg:line", { x1: sx(m.x), x2: sx(m.x), y1: T, y2: H - B, class: "marker " + m.cls }, svg);
    node("svg:title", {}, line, m.title);
  }
  if (o.hline) node("svg:line", { x1: L, x2: W - R, y1: sy(o.hline), y2: sy(o.hline), class: "hline" }, svg);
  for (const s of series) {
    if (!s.points.length) continue;
    const d = s.points.map((p, i) => (i ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1)).join("");
    if (!s.dotsOnly) node("svg:path", { d, class: s.cls }, svg);
    const dots = s.points.length <= MAX_DRAWN_POINTS ? s.points : s.points.slice(-1);
    for (const p of dots) node("svg:circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.2, class: "pt " + s.cls }, svg);
  }
}

function markers() {
  return S.events
    .filter((e) => !e.job || e.job === S.job)
    .map((e) => ({ x: e.step ?? (e.after_step === null ? null : e.after_step + 0.5), cls: kindClass(e.kind),
                   title: `${e.kind} ${e.worker_id || ""} ${e.cause || ""}`.trim() }))
    .filter((m) => m.x !== null)
    .sort((a, b) => MARKER_ORDER.indexOf(a.cls) - MARKER_ORDER.indexOf(b.cls));  // churn drawn on top
}

function renderCharts() {
  const pts = S.series, mk = markers(), plan = S.status && S.status.plan;
  const xy = (f) => pts.map((p) => [p.step, f(p)]);
  drawChart($("chart-loss"), [{ cls: "loss", points: xy((p) => p.loss) },
    { cls: "val", points: xy((p) => p.val_loss), dotsOnly: true }], { markers: mk });
  drawChart($("chart-step"), [{ cls: "steptime", points: xy((p) => p.step_time_s) }],
    { markers: mk, zero: true, yfmt: secs, hline: plan ? plan.predicted_step_s : null });
  drawChart($("chart-tps"), [{ cls: "tps", points: xy((p) => p.tokens_per_s) }], { markers: mk, zero: true });
  drawChart($("chart-bytes"), [{ cls: "down", points: xy((p) => p.bytes_down) },
    { cls: "up", points: xy((p) => p.bytes_up) }], { markers: mk, zero: true, yfmt: bytes });
}

// ---- panels -------------------------------------------------------------------------------------------
function renderCards() {
  const pts = S.series, last = pts[pts.length - 1], t = S.status ? S.status.totals : null;
  // the metrics' own number (the progress line's, the logs' and the exports'); a round method's steps are rounds
  const unit = last && ["diloco", "fedavg"].includes(last.method) ? "round" : "step";
  $("c-step-k").textContent = unit;
  $("c-step").textContent = last ? `${last.step} (${pts.length} seen)` : "–";
  $("c-loss").textContent = last && last.loss !== null ? last.loss.toFixed(4) : "–";
  $("c-steptime").textContent = secs(median(pts.slice(-10).map((p) => p.step_time_s)));
  $("c-tps").textContent = last ? si(last.tokens_per_s) : "–";
  $("c-workers").textContent = last ? String(last.workers) : "–";
  $("c-resent").textContent = t ? String(t.tiles_resent) : "–";
  $("c-recoveries").textContent = t ? String(t.recoveries) : "–";
  $("c-bytes").textContent = t ? `${bytes(t.bytes_down)} / ${bytes(t.bytes_up)}` : "–";
}

function renderPlan() {
  const dl = $("plan"), p = S.status && S.status.plan;
  dl.replaceChildren();
  const row = (k, v) => { node("dt", {}, dl, k); node("dd", {}, dl, v); };
  if (!p) { row("plan", "none yet"); return; }
  row("version", `${p.version} (${p.reason || "–"})`);
  row("made at", clock(p.created_at));
  row("devices used", `${p.devices.length}: ${p.devices.slice(0, 8).join(", ")}${p.devices.length > 8 ? ", …" : ""}`);
  row("tile", `${p.tile_rows} × ${p.tile_cols}`);
  row("predicted GEMMs", p.predicted_step_s === null ? "not given by the planner" : secs(p.predicted_step_s));
  const pred = p.predicted_with_ps_s;
  if (pred) row("predicted step", `${secs(pred)} (GEMMs + the PS's own work)`);
  row("measured step", secs(p.measured_step_s));
  if (pred && p.measured_step_s) row("measured / predicted", (p.measured_step_s / pred).toFixed(2));
}

function renderFleet() {
  const body = $("fleet").tBodies[0], f = S.status ? S.status.fleet : null, now = S.status ? S.status.now : 0;
  body.replaceChildren();
  if (!f) return;
  const counts = Object.entries(f.counts).map(([k, v]) => `${v} ${k}`).join(", ");
  $("fleet-counts").textContent = `${f.total} devices${counts ? ": " + counts : ""}`;
  for (const d of f.devices) {
    const tr = node("tr", { class: "device", "data-worker": d.worker_id }, body);
    const pr = d.profile || {};
    node("td", {}, tr, d.worker_id);
    node("span", { class: "state " + d.state }, node("td", {}, tr), d.state);
    node("td", {}, tr, d.in_plan ? "yes" : "no");
    node("td", {}, tr, si(pr.flops));
    node("td", {}, tr, bytes(pr.memory_bytes));
    node("td", {}, tr, si(pr.downlink_bytes_per_s, "B/s"));
    node("td", {}, tr, si(pr.uplink_bytes_per_s, "B/s"));
    node("td", {}, tr, secs(pr.latency_s));
    node("td", {}, tr, String(d.tiles_done));
    const share = node("td", {}, tr);
    node("span", { class: "bar", style: `width:${Math.round(d.share * 80)}px` }, share);
    share.appendChild(document.createTextNode((d.share * 100).toFixed(1) + " %"));
    node("td", {}, tr, d.tiles_per_s === null ? "–" : d.tiles_per_s.toFixed(1));
    node("td", {}, tr, d.last_seen ? `${Math.max(0, now - d.last_seen).toFixed(0)} s ago` : "–");
  }
}

function renderEvents() {
  const body = $("events").tBodies[0];
  body.replaceChildren();
  $("event-count").textContent = `${S.events.length}`;
  for (const e of S.events.slice(-MAX_EVENT_ROWS).reverse()) {
    const tr = node("tr", { class: "event" }, body);
    node("td", {}, tr, clock(e.at));
    node("td", {}, tr, e.step ?? (e.after_step === null ? "–" : `after ${e.after_step}`));
    node("span", { class: "kind " + kindClass(e.kind) }, node("td", {}, tr), e.kind);
    node("td", {}, tr, e.worker_id || "");
    node("td", {}, tr, e.cause || "");
    for (const k of ["detect_s", "redispatch_s", "complete_s"]) node("td", {}, tr, secs(e[k]));
    node("td", {}, tr, Object.entries(e.detail || {}).map(([k, v]) => `${k}=${v}`).join(" "));
  }
}

function renderQueue() {
  const q = S.status && S.status.queue ? S.status.queue : [], body = $("queue").tBodies[0];
  $("queue-panel").hidden = q.length === 0;
  $("queue-count").textContent = `${q.length}`;
  body.replaceChildren();
  for (const j of q.slice().reverse()) {
    const tr = node("tr", { class: "job", "data-job": j.job_id }, body);
    node("td", {}, tr, j.job_id);
    node("span", { class: "state " + j.state }, node("td", {}, tr), j.state);
    for (const k of ["submitted_at", "started_at", "ended_at"]) node("td", {}, tr, j[k] ? clock(j[k]) : "–");
    node("td", {}, tr, String(j.runs));
    const gone = j.runner_silent_s ? `no word from the hub's runner for ${Math.round(j.runner_silent_s / 60)} min: is cleave up still running there?` : "";
    const w = j.waiting_for_workers, idle = w ? `waiting for workers: its PS has had none to deal to since ${clock(w.since)}` +
      (w.faulty ? ` (${w.faulty} expelled for wrong results)` : "") : "";
    node("td", {}, tr, [j.reason, idle, gone].filter(Boolean).join("; "));
  }
}

function renderJobs() {
  const sel = $("job");
  sel.replaceChildren();
  for (const j of S.jobs) node("option", { value: j.job }, sel, `${j.job} (${j.steps} steps)`);
  if (S.job !== null) sel.value = S.job;
}

function render() {
  S.timer = null;
  renderJobs(); renderCards(); renderCharts(); renderPlan(); renderFleet(); renderQueue(); renderEvents();
}

function schedule() {
  if (S.timer === null) S.timer = setTimeout(render, 50);
}

// ---- live updates -------------------------------------------------------------------------------------
function onSnapshot(snap) {
  S.jobs = snap.jobs; S.events = snap.events;
  S.status = { now: snap.now, fleet: snap.fleet, plan: snap.plan, totals: snap.totals, queue: snap.queue };
  if (S.follow || S.job === null || !S.jobs.some((j) => j.job === S.job)) { S.job = snap.job; S.series = snap.series; }
  else refetchSeries();
  schedule();
}

function onMetrics({ job, point }) {
  let j = S.jobs.find((x) => x.job === job);
  if (!j) { j = { job, steps: 0 }; S.jobs.push(j); }
  j.steps += 1;
  if (S.follow && job !== S.job) { S.job = job; S.series = []; }
  if (job === S.job) S.series.push(point);
  schedule();
}

async function refetchSeries() {
  const r = await fetch(`/api/series?job=${encodeURIComponent(S.job)}`);
  if (r.ok) { S.series = (await r.json()).points; schedule(); }
}

function connect() {
  const es = new EventSource("/api/stream");
  const conn = $("conn");
  const on = (kind, f) => es.addEventListener(kind, (m) => f(JSON.parse(m.data)));
  es.onopen = () => { conn.dataset.state = "live"; conn.textContent = "live"; };
  es.onerror = () => { conn.dataset.state = "reconnecting"; conn.textContent = "reconnecting"; };
  on("snapshot", onSnapshot);
  on("metrics", onMetrics);
  on("event", (e) => { S.events.push(e); schedule(); });
  on("status", (s) => { S.status = s; schedule(); });
}

$("job").addEventListener("change", (ev) => {
  S.job = ev.target.value;
  S.follow = S.jobs.length > 0 && S.job === S.jobs[S.jobs.length - 1].job;
  refetchSeries();
});
window.addEventListener("resize", schedule);
render();
connect();
