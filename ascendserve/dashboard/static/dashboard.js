// ascendserve dashboard: one EventSource on /dashboard/events, drawn with plain DOM, SVG and canvas.
// Frames: history (chart columns), events (the recent feed), snapshot (a second's figures), event (one, at once).
"use strict";

(function () {
  const KEEP_POINTS = 600;
  const ROLE_COLUMNS = [["encoder", "E"], ["prefill", "P"], ["decode", "D"], ["pd", "PD"], ["elastic-server", "seeds"]];
  const FLOWS = [["encoder", "prefill"], ["prefill", "decode"], ["encoder", "pd"]];
  let snap = null;
  let history = {};
  const events = [];

  const $ = (id) => document.getElementById(id);
  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function svg(tag, attrs, text) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function num(v, digits) {
    if (v === null || v === undefined) return "—";
    if (typeof v !== "number") return String(v);
    if (digits === undefined) return Number.isInteger(v) ? v.toLocaleString("en-US") : v.toFixed(2);
    return v.toFixed(digits);
  }
  function secs(v) {
    if (v === null || v === undefined) return "—";
    return v < 1 ? (v * 1000).toFixed(v < 0.01 ? 1 : 0) + " ms" : v.toFixed(2) + " s";
  }
  function pct(v) { return v === null || v === undefined ? "—" : (v * 100).toFixed(1) + "%"; }
  function sum(obj) { return Object.values(obj || {}).reduce((a, b) => a + b, 0); }
  function short(url) { return url.replace(/^https?:\/\//, ""); }
  function clock(t) { return new Date(t * 1000).toLocaleTimeString("en-GB", { hour12: false }); }
  function gbps(kv) {
    if (!kv) return null;
    return kv.gbps;
  }

  // ---- tiles ---------------------------------------------------------------------------------
  function tiles(s) {
    const t = s.totals || {};
    const p = s.point || {};
    if (s.kind === "metaserver") {
      return [
        ["instances", "instances", s.instances.length, num],
        ["running", "running", t.running, num],
        ["waiting", "waiting", t.waiting, num],
        ["push_asks", "push dispatches", t.push_asks, num],
        ["kv_gbps", "KV transfer GB/s", s.kv_gbps, (v) => num(v, 3)],
      ];
    }
    const errors = sum(t.errors);
    return [
      ["rps", "requests/s", p.requests_rate, (v) => num(v, 1)],
      ["in_flight", "in flight (all hops)", t.in_flight, num],
      ["ttft", "TTFT p50 / p99", p.ttft_p50 === undefined ? null : [p.ttft_p50, p.ttft_p99], (v) => secs(v[0]) + " / " + secs(v[1])],
      ["e2e", "end-to-end p50 / p99", p.e2e_p50 === undefined ? null : [p.e2e_p50, p.e2e_p99], (v) => secs(v[0]) + " / " + secs(v[1])],
      ["itl", "inter-token p50 / p99", p.itl_p50 === undefined ? null : [p.itl_p50, p.itl_p99], (v) => secs(v[0]) + " / " + secs(v[1])],
      ["requests", "requests", t.requests, num],
      ["errors", "errors", errors, num],
      ["retries", "retries", sum(t.retries), num],
      ["fallbacks", "encoder fallbacks", t.encoder_fallbacks, num],
      ["migrations", "migrations", sum(t.migrations), num],
      ["ec_hit_rate", "EC hit rate", t.ec_hit_rate, pct],
      ["kv_gbps", "KV transfer GB/s", s.kv_gbps, (v) => num(v, 3)],
    ];
  }

  function renderTiles(s) {
    const box = $("tiles");
    const specs = tiles(s);
    if (box.childElementCount !== specs.length) {
      box.textContent = "";
      for (const [key, label] of specs) {
        const tile = el("div", { class: "tile" });
        tile.append(el("span", { class: "label" }, label), el("span", { class: "value", id: "tile-" + key }, "—"));
        box.append(tile);
      }
    }
    for (const [key, , value, fmt] of specs) {
      const node = $("tile-" + key);
      const missing = value === null || value === undefined;
      node.textContent = missing ? (key === "kv_gbps" ? "not reported" : "—") : fmt(value);
      node.className = missing ? "value na" : "value";
      node.dataset.value = missing ? "" : JSON.stringify(value);
    }
  }

  // ---- topology ------------------------------------------------------------------------------
  function renderGraph(s) {
    const g = $("graph");
    g.textContent = "";
    const defs = svg("defs");
    const marker = svg("marker", { id: "arrowhead", markerWidth: 8, markerHeight: 8, refX: 7, refY: 4, orient: "auto" });
    marker.append(svg("path", { d: "M0,0 L8,4 L0,8 z", fill: "#6b7480" }));
    defs.append(marker);
    g.append(defs);
    const cols = ROLE_COLUMNS.filter(([role]) => s.instances.some((i) => i.role === role));
    const W = 190, H = 74, GAP = 70, TOP = 22;
    const x = {};
    const rows = {};
    cols.forEach(([role], n) => { x[role] = 10 + n * (W + GAP); rows[role] = s.instances.filter((i) => i.role === role); });
    const height = TOP + Math.max(1, ...Object.values(rows).map((r) => r.length)) * (H + 10) + 10;
    g.setAttribute("width", Math.max(300, 20 + cols.length * (W + GAP) - GAP));
    g.setAttribute("height", height);
    if (!cols.length) {
      g.append(svg("text", { x: 10, y: 30 }, "no instances yet"));
      return;
    }
    for (const [from, to] of FLOWS) {
      // only between neighbouring columns (E feeds PD directly only when there is no P/D between)
      if (!(from in x) || !(to in x) || x[to] - x[from] !== W + GAP) continue;
      const y = TOP + H / 2;
      g.append(svg("path", { class: "arrow", d: `M${x[from] + W + 4},${y} L${x[to] - 6},${y}` }));
    }
    for (const [role, label] of cols) {
      g.append(svg("text", { class: "col-title", x: x[role], y: 14 }, `${label} · ${role} (${rows[role].length})`));
      rows[role].forEach((inst, n) => {
        const y0 = TOP + n * (H + 10);
        const group = svg("g", { "data-url": inst.url, "data-state": inst.state, class: "node" });
        group.append(svg("rect", { class: "box state-" + inst.state, x: x[role], y: y0, width: W, height: H, rx: 6 }));
        group.append(svg("text", { x: x[role] + 8, y: y0 + 16 }, short(inst.url)));
        group.append(svg("text", { x: x[role] + 8, y: y0 + 31, class: "state-text" }, inst.state));
        const load = inst.in_flight !== null
          ? `in flight ${inst.in_flight}` + (inst.others ? ` + ${inst.others} others` : "")
          : `running ${inst.running} · waiting ${inst.waiting}`;
        group.append(svg("text", { x: x[role] + 8, y: y0 + 46 }, load + (inst.active_kv ? ` · KV held ${inst.active_kv}` : "")));
        const usage = inst.kv_usage;
        g.append(group);
        if (usage !== null && usage !== undefined) {  // the KV cache usage the engine reports
          group.append(svg("rect", { class: "bar-bg", x: x[role] + 8, y: y0 + 56, width: W - 16, height: 8, rx: 2 }));
          group.append(svg("rect", { class: "bar", x: x[role] + 8, y: y0 + 56, width: Math.max(0, Math.min(1, usage)) * (W - 16), height: 8, rx: 2 }));
        }
        const title = svg("title", {}, `${inst.role} ${inst.url}: ${inst.state}; KV usage ${pct(usage)}` +
          (inst.last_error ? `; last error: ${inst.last_error}` : ""));
        group.append(title);
      });
    }
  }

  // ---- instance table -------------------------------------------------------------------------
  function columns(s) {
    const common = [["role", "role", (i) => i.role], ["url", "instance", (i) => short(i.url)],
      ["state", "state", (i) => i.state]];
    const kv = [["kv_usage", "KV usage", (i) => pct(i.kv_usage)], ["kv_gbps", "KV GB/s", (i) => num(gbps(i.kv), 3)]];
    if (s.kind === "metaserver") {
      return common.concat([["running", "running", (i) => num(i.running)], ["waiting", "waiting", (i) => num(i.waiting)]],
        kv, [["kv_connector", "KV connector", (i) => i.kv_connector || "—"],
          ["silent_s", "since heartbeat", (i) => i.silent_s === null ? "—" : i.silent_s.toFixed(1) + " s"],
          ["id", "instance id", (i) => i.id]]);
    }
    return common.concat([["in_flight", "in flight", (i) => num(i.in_flight)], ["others", "others", (i) => num(i.others)]],
      kv, [["active_kv", "KV held for D", (i) => num(i.active_kv)], ["served", "served", (i) => num(i.served)],
        ["failures", "failures", (i) => num(i.failures)], ["source", "source", (i) => i.source],
        ["last_error", "last error", (i) => i.last_error || ""]]);
  }

  function renderTable(s) {
    const cols = columns(s);
    const head = $("instances-head");
    if (head.childElementCount !== cols.length) {
      head.textContent = "";
      for (const [, label] of cols) head.append(el("th", {}, label));
    }
    const body = $("instances-body");
    body.textContent = "";
    for (const inst of s.instances) {
      const tr = el("tr", { "data-url": inst.url, "data-role": inst.role, "data-state": inst.state });
      for (const [key, , fmt] of cols) {
        const td = el("td", { "data-field": key, class: key === "state" ? "state" : key === "last_error" ? "error" : "" });
        const raw = key === "kv_gbps" ? gbps(inst.kv) : inst[key];
        td.dataset.value = raw === null || raw === undefined ? "" : String(raw);
        if (key === "state") td.append(el("span", { class: "state-" + inst.state }, inst.state));
        else td.textContent = fmt(inst);
        tr.append(td);
      }
      body.append(tr);
    }
  }

  // ---- charts ----------------------------------------------------------------------------------
  function chartSpecs(kind) {
    if (kind === "metaserver") {
      return [["load", "running / waiting (all instances)", [["running", "running"], ["waiting", "waiting"]], num],
        ["instances", "instances registered", [["instances", "instances"]], num],
        ["push", "push dispatches/s", [["push_asks_rate", "dispatches/s"]], num]];
    }
    return [["rate", "requests/s and errors/s", [["requests_rate", "requests/s"], ["errors_rate", "errors/s"]], (v) => num(v, 1)],
      ["ttft", "TTFT", [["ttft_p50", "p50"], ["ttft_p99", "p99"]], secs],
      ["e2e", "end-to-end", [["e2e_p50", "p50"], ["e2e_p99", "p99"]], secs],
      ["inflight", "in flight (all hops)", [["in_flight", "hops"]], num],
      ["itl", "inter-token latency (streams)", [["itl_p50", "p50"], ["itl_p99", "p99"]], secs]];
  }

  const COLORS = ["#3f7fcf", "#cf7a3f", "#8a5fc9"];

  function ensureCharts(kind) {
    const box = $("charts");
    const specs = chartSpecs(kind);
    if (box.dataset.kind === kind) return specs;
    box.dataset.kind = kind;
    box.textContent = "";
    for (const [id, title, lines] of specs) {
      const fig = el("figure", { class: "chart" });
      const cap = el("figcaption", {}, title);
      lines.forEach(([, label], n) => {
        const key = el("span", { class: "key" });
        key.style.background = COLORS[n];
        cap.append(key, document.createTextNode(label));
      });
      fig.append(cap, el("canvas", { id: "chart-" + id }));
      box.append(fig);
    }
    return specs;
  }

  function drawChart(canvas, times, lines, fmt, empty) {
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 300, h = canvas.clientHeight || 110;
    canvas.width = Math.round(w * ratio);
    canvas.height = Math.round(h * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillStyle = "#6b7480";
    if (empty) {
      ctx.fillText(empty, 8, h / 2);
      return;
    }
    const values = lines.flatMap(([key]) => (history[key] || []).filter((v) => v !== null));
    const top = Math.max(...values, 0) * 1.15 || 1;
    const left = 4, right = w - 4, bottom = h - 14, upper = 12;
    ctx.fillText(fmt(top), left, 10);
    if (times.length) {
      ctx.fillText(clock(times[0]), left, h - 2);
      const end = clock(times[times.length - 1]);
      ctx.fillText(end, right - ctx.measureText(end).width, h - 2);
    }
    ctx.strokeStyle = "#dde1e6";
    ctx.beginPath(); ctx.moveTo(left, bottom); ctx.lineTo(right, bottom); ctx.stroke();
    if (times.length < 2) return;
    const t0 = times[0], span = Math.max(1, times[times.length - 1] - t0);
    lines.forEach(([key], n) => {
      const ys = history[key] || [];
      ctx.strokeStyle = COLORS[n];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let pen = false;
      for (let i = 0; i < times.length; i++) {
        const v = ys[i];
        if (v === null || v === undefined) { pen = false; continue; }
        const px = left + (times[i] - t0) / span * (right - left);
        const py = bottom - v / top * (bottom - upper);
        if (pen) ctx.lineTo(px, py); else ctx.moveTo(px, py);
        pen = true;
      }
      ctx.stroke();
    });
  }

  function renderCharts(kind) {
    const specs = ensureCharts(kind);
    const times = history.t || [];
    const minutes = times.length > 1 ? Math.round((times[times.length - 1] - times[0]) / 60) : 0;
    $("window").textContent = times.length > 1 ? `(${minutes < 1 ? "under a minute" : minutes + " min"}; percentiles over 10 s)` : "";
    for (const [id, , lines, fmt] of specs) {
      const empty = !lines.length ? "not measured yet (see the footer)" : !times.length ? "waiting for data" : "";
      drawChart($("chart-" + id), times, lines, fmt, empty);
    }
  }

  function addPoint(point) {
    if (!point || point.t === undefined) return;
    const times = history.t || [];
    if (times.length && times[times.length - 1] >= point.t) return;
    const n = times.length;
    for (const key of new Set([...Object.keys(history), ...Object.keys(point)])) {
      if (!history[key]) history[key] = new Array(n).fill(null);
      history[key].push(point[key] === undefined ? null : point[key]);
      if (history[key].length > KEEP_POINTS) history[key].shift();
    }
  }

  // ---- events ----------------------------------------------------------------------------------
  function eventItem(ev) {
    const li = el("li", { class: "ev ev-" + ev.kind, "data-seq": ev.seq, "data-kind": ev.kind, "data-url": ev.url });
    li.append(el("time", {}, clock(ev.t)), el("span", { class: "kind" }, ev.kind));
    li.append(document.createTextNode(`${ev.role} ${short(ev.url)}` + (ev.detail ? ` — ${ev.detail}` : "")));
    return li;
  }

  function renderEvents() {
    const list = $("events");
    list.textContent = "";
    if (!events.length) list.append(el("li", { class: "muted" }, "nothing yet"));
    for (const ev of events.slice().reverse().slice(0, 100)) list.append(eventItem(ev));
  }

  function onEvent(ev) {
    if (events.length && events[events.length - 1].seq >= ev.seq) return;
    events.push(ev);
    if (events.length > 200) events.shift();
    renderEvents();
    // the instance's state changes on the page now, not at the next snapshot
    if (snap && ev.url && ev.state) {
      const inst = snap.instances.find((i) => i.url === ev.url && i.role === ev.role);
      if (inst && inst.state !== ev.state) {
        inst.state = ev.state;
        renderGraph(snap);
        renderTable(snap);
      }
    }
  }

  // ---- snapshots -------------------------------------------------------------------------------
  function onSnapshot(s) {
    snap = s;
    document.body.dataset.kind = s.kind;
    document.body.dataset.snapshotT = String(s.t);
    $("name").textContent = s.name;
    $("topology").textContent = s.topology;
    $("updated").textContent = "updated " + clock(s.t);
    const ready = $("readiness");
    ready.hidden = !s.missing.length;
    ready.textContent = s.missing.join("; ");
    const cost = s.dashboard ? ` This dashboard: ${s.dashboard.pages} page(s) open, ${s.dashboard.cpu_ms} ms of CPU in ` +
      `${s.dashboard.snapshots} snapshots since the process started.` : "";
    $("not-measured").textContent = (s.not_measured.length ? "Not measured: " + s.not_measured.join("; ") + "." : "") + cost;
    addPoint(s.point);
    renderTiles(s);
    renderGraph(s);
    renderTable(s);
    renderCharts(s.kind);
  }

  function connect() {
    const live = $("live");
    const source = new EventSource("/dashboard/events");
    source.addEventListener("open", () => { live.textContent = "live"; live.className = "live"; });
    source.addEventListener("error", () => {
      live.textContent = source.readyState === EventSource.CLOSED ? "disconnected" : "reconnecting";
      live.className = "live off";
      if (source.readyState === EventSource.CLOSED) setTimeout(() => window.location.reload(), 5000);
    });
    source.addEventListener("history", (m) => { history = JSON.parse(m.data); });
    source.addEventListener("events", (m) => {
      events.length = 0;
      for (const ev of JSON.parse(m.data)) events.push(ev);
      renderEvents();
    });
    source.addEventListener("snapshot", (m) => onSnapshot(JSON.parse(m.data)));
    source.addEventListener("event", (m) => onEvent(JSON.parse(m.data)));
    window.addEventListener("resize", () => { if (snap) renderCharts(snap.kind); });
  }

  document.addEventListener("DOMContentLoaded", connect);
})();
