// inferd's live console: polls /console/data (documented in docs/console.md) and renders tables and
// uPlot charts of the last 15 minutes. No framework, no build step: text goes in with textContent only.
"use strict";
(function () {
  const HISTORY_S = 900;
  const state = { data: null, series: {}, charts: {}, lastT: 0, timer: null, interval: 2 };

  const el = (tag, attrs, text) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  };
  const fmt = (v) => (v === null || v === undefined ? "–" : Number.isInteger(v) ? String(v) : Number(v).toPrecision(4));
  const labelText = (labels) => Object.keys(labels).sort().map((k) => `${k}=${labels[k]}`).join(" ");
  const last = (xs) => (xs && xs.length ? xs[xs.length - 1] : null);

  function fillTable(id, rows) {
    const body = document.querySelector(`#${id} tbody`);
    body.replaceChildren();
    if (!rows.length) {
      const tr = el("tr");
      tr.appendChild(el("td", { class: "empty", colspan: "20" }, "none"));
      body.appendChild(tr);
      return;
    }
    for (const cells of rows) {
      const tr = el("tr");
      for (const cell of cells) tr.appendChild(cell);
      body.appendChild(tr);
    }
  }

  function renderModels(data) {
    fillTable("models", data.models.map((m) => {
      const s = state.series[m.name] || {};
      return [
        el("td", {}, m.name), el("td", { class: "num" }, m.version), el("td", {}, m.kind),
        el("td", { class: m.ready ? "yes" : "no" }, m.ready ? "yes" : "no"),
        el("td", { class: "num" }, `${m.ready_workers}/${m.workers}`),
        el("td", { class: "num", "data-model-queued": m.name }, m.queued),
        el("td", { class: "num" }, m.in_flight),
        el("td", { class: "num" }, fmt(last(s.rps))), el("td", { class: "num" }, fmt(last(s.p50_ms))),
        el("td", { class: "num" }, fmt(last(s.p99_ms))), el("td", { class: "num" }, fmt(last(s.fill))),
      ];
    }));
  }

  function renderWorkers(data) {
    fillTable("workers", data.workers.map((w) => [
      el("td", {}, w.worker_id), el("td", {}, w.model), el("td", { class: "num" }, w.version),
      el("td", {}, w.state), el("td", { class: "num" }, w.pid), el("td", {}, w.host),
      el("td", { class: "num" }, w.load), el("td", { class: "num" }, w.completed),
      el("td", { class: "num" }, fmt(w.batch_latency_ms)), el("td", { class: "num" }, fmt(w.busy_s)),
    ]));
  }

  const compact = (obj) => Object.entries(obj || {}).map(([k, v]) => `${k}=${typeof v === "number" ? fmt(v) : v}`).join(" ");

  function renderTenants(data) {
    const tenants = (data.tenants && data.tenants.tenants) || {};
    fillTable("tenants", Object.entries(tenants).map(([name, t]) => [
      el("td", {}, name), el("td", { class: "num" }, fmt(t.limits.weight)),
      el("td", { class: "num" }, fmt(t.limits.requests_per_s)), el("td", { class: "num" }, fmt(t.limits.burst)),
      el("td", { class: "num" }, fmt(t.limits.tokens_per_min)), el("td", { class: "num" }, fmt(t.limits.max_concurrency)),
      el("td", {}, t.quota ? compact(t.quota) : "unlimited"), el("td", {}, compact(t.requests)),
    ]));
  }

  function renderTraffic(data) {
    const traffic = data.traffic || { splits: [], history: [] };
    fillTable("traffic", traffic.splits.map((s) => [
      el("td", {}, s.model), el("td", {}, s.mode), el("td", {}, compact(s.weights)),
      el("td", { class: "num" }, s.canary_version === null ? "–" : s.canary_version),
      el("td", { class: "num" }, s.step), el("td", {}, s.state),
    ]));
    fillTable("traffic-history", traffic.history.slice(-20).reverse().map((e) => [
      el("td", {}, new Date(e.at * 1000).toISOString().replace("T", " ").slice(0, 19)),
      el("td", {}, e.model), el("td", { class: "num" }, e.version), el("td", {}, e.event), el("td", {}, e.reason),
    ]));
  }

  function renderPools(data) {
    const rows = [];
    for (const pool of data.pools || []) {
      for (const w of pool.workers) {
        const held = w.models.map((m) => `${m.model} v${m.version} ${m.state} ${fmt(m.memory_mb)} MiB` +
          ` idle ${fmt(m.idle_s)}s${m.evictable ? " evictable" : ""}`).join("; ");
        rows.push([
          el("td", {}, pool.name), el("td", {}, w.worker_id + (w.draining ? " (draining)" : "")),
          el("td", { class: "num" }, fmt(w.used_mb)), el("td", { class: "num" }, fmt(w.budget_mb)),
          el("td", { class: "num" }, w.waiting_loads), el("td", {}, held || "–"),
        ]);
      }
    }
    fillTable("pools", rows);
  }

  // Counters that never moved are left out (a family's full label set is in /metrics); gauges all show.
  const worthShowing = (name, s) => !(name.endsWith("_total") && s.value === 0);

  function sampleTable(name, samples) {
    const table = el("table");
    for (const s of samples.filter((x) => worthShowing(name, x))) {
      const tr = el("tr");
      tr.appendChild(el("td", {}, labelText(s.labels)));
      tr.appendChild(el("td", { class: "num", "data-sample": name, "data-labels": JSON.stringify(s.labels) }, fmt(s.value)));
      table.appendChild(tr);
    }
    return table;
  }

  function renderFamilies(data) {
    for (const box of document.querySelectorAll("[data-family]")) {
      const name = box.getAttribute("data-family");
      const samples = (data.metrics[name] || []).filter((x) => worthShowing(name, x));
      box.replaceChildren();
      if (box.parentElement.querySelectorAll("[data-family]").length > 1) box.appendChild(el("h3", {}, name));
      box.appendChild(samples.length ? sampleTable(name, samples) : el("div", { class: "empty" }, `no ${name} yet`));
    }
    for (const box of document.querySelectorAll("[data-prefix]")) {
      const prefix = box.getAttribute("data-prefix");
      const names = Object.keys(data.metrics).filter((n) => n.startsWith(prefix)).sort();
      box.replaceChildren();
      if (!names.length) box.appendChild(el("div", { class: "empty" }, "not configured"));
      for (const name of names) {
        box.appendChild(el("h3", {}, name));
        box.appendChild(sampleTable(name, data.metrics[name]));
      }
    }
  }

  function mergeSeries(incoming) {
    const cutoff = Date.now() / 1000 - HISTORY_S;
    for (const [model, cols] of Object.entries(incoming)) {
      const mine = state.series[model] || (state.series[model] = Object.fromEntries(Object.keys(cols).map((k) => [k, []])));
      for (const [k, xs] of Object.entries(cols)) (mine[k] || (mine[k] = [])).push(...xs);
      let drop = 0;
      while (drop < mine.t.length && mine.t[drop] < cutoff) drop++;
      if (drop) for (const k of Object.keys(mine)) mine[k].splice(0, drop);
      state.lastT = Math.max(state.lastT, last(mine.t) || 0);
    }
  }

  const CHARTS = [
    ["throughput", [["rps", "req/s", "#58a6ff"], ["errors_ps", "errors/s", "#f85149"]]],
    ["latency", [["p50_ms", "p50 ms", "#3fb950"], ["p99_ms", "p99 ms", "#d29922"]]],
    ["batches and queue", [["fill", "batch fill", "#a371f7"], ["queued", "queued", "#8b949e"]]],
    ["tokens", [["ttft_p99_ms", "TTFT p99 ms", "#39c5cf"], ["itl_p99_ms", "ITL p99 ms", "#db61a2"]]],
  ];

  function renderCharts(data) {
    const box = document.getElementById("charts");
    for (const m of data.models) {
      const cols = state.series[m.name];
      if (!cols || typeof uPlot === "undefined") continue;
      for (const [title, lines] of CHARTS) {
        if (title === "tokens" && m.kind !== "llm") continue;
        const key = `${m.name}/${title}`;
        const series = [cols.t, ...lines.map(([k]) => cols[k])];
        let chart = state.charts[key];
        if (!chart) {
          const holder = el("div", { class: "chart", "data-chart": key });
          holder.appendChild(el("h3", {}, `${m.name}: ${title}`));
          box.appendChild(holder);
          chart = state.charts[key] = new uPlot({
            width: 360, height: 160,
            series: [{}, ...lines.map(([, label, stroke]) => ({ label, stroke, width: 1.5, spanGaps: true }))],
            axes: [{ stroke: "#8b949e" }, { stroke: "#8b949e" }],
            scales: { x: { time: true, range: (u, min, max) => [Math.max(min, max - HISTORY_S), max + state.interval] } },
          }, series, holder);
        } else {
          chart.setData(series);
        }
      }
    }
  }

  async function refresh() {
    const status = document.getElementById("status");
    try {
      const response = await fetch(`/console/data?since=${state.lastT}`, { credentials: "same-origin", cache: "no-store" });
      if (!response.ok) {
        const body = await response.json().catch(() => ({}));
        throw new Error(body.error || `HTTP ${response.status}`);
      }
      const data = await response.json();
      state.data = data;
      state.interval = data.interval_s || 2;
      mergeSeries(data.series);
      renderModels(data);
      renderWorkers(data);
      renderFamilies(data);
      renderTenants(data);
      renderTraffic(data);
      renderPools(data);
      renderCharts(data);
      status.textContent = "live";
      status.className = "status live";
      document.getElementById("clock").textContent = new Date(data.now * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC";
      return data;
    } catch (err) {
      status.textContent = `no data: ${err.message}`;
      status.className = "status down";
      return null;
    }
  }

  async function loop() {
    await refresh();
    state.timer = setTimeout(loop, state.interval * 1000);
  }

  window.inferdConsole = { refresh, state };
  loop();
})();
