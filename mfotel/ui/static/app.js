/* mfotel live page: polls api/history once a second and draws the seed metrics with uPlot.
 * No inline script, no network access beyond this rank's own endpoint (the page's CSP). */
(function () {
  "use strict";
  const POLL_MS = 1000;
  const OVERVIEW_MS = 2000;
  const RETRY_MS = 5000;
  const METRICS = [
    { key: "loss", title: "Loss", unit: "", color: "#2563eb" },
    { key: "learning_rate", title: "Learning rate", unit: "", color: "#7c3aed" },
    { key: "grad_norm", title: "Gradient norm", unit: "", color: "#059669" },
    { key: "throughput", title: "Throughput", unit: "samples/s", color: "#d97706" },
    { key: "step_time", title: "Step time", unit: "s", color: "#0891b2" },
  ];
  // loss: a band over the whole height; grad norm: a strip along the bottom of the plot
  const MARK_FILL = { loss: "rgba(220, 38, 38, 0.16)", grad_norm: "rgba(234, 88, 12, 0.85)" };
  const STRIP_PX = 6;
  const FIRST_NONFINITE = "#dc2626";
  const LOOPBACK = ["127.0.0.1", "localhost", "[::1]"];

  // Everything the page knows; window.mfotel lets tests (and the curious) read it.
  const state = {
    steps: [], series: {}, marks: [], marksDropped: 0, current: null,
    since: null, generation: null, marksVersion: null,
    charts: {}, zoomed: {}, logLoss: false, built: false, lastError: null, polls: 0,
  };
  window.mfotel = state;

  const $ = (id) => document.getElementById(id);
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (name === "class") node.className = value;
      else if (name === "text") node.textContent = value;
      else node.setAttribute(name, value);
    }
    for (const child of children) node.append(child);
    return node;
  }

  function fmt(value) {
    if (value === null || value === undefined) return "–";
    if (typeof value !== "number") return String(value);
    const abs = Math.abs(value);
    if (abs !== 0 && (abs >= 1e5 || abs < 1e-3)) return value.toExponential(3);
    return String(Number(value.toPrecision(5)));
  }

  function ago(seconds) {
    if (seconds === null || seconds === undefined) return "";
    if (seconds < 90) return `${seconds.toFixed(1)} s ago`;
    if (seconds < 5400) return `${(seconds / 60).toFixed(1)} min ago`;
    return `${(seconds / 3600).toFixed(1)} h ago`;
  }

  // One clock for every age on the page: this rank's (the `now` of its last answer), advanced
  // by the browser's monotonic clock since that answer arrived. The header and the ranks
  // table then agree, whatever the browser's own clock says, and keep counting after the
  // run's endpoint is gone.
  const clock = { server: null, at: 0 };
  function serverNow() {
    if (clock.server === null) return Date.now() / 1000;
    return clock.server + (performance.now() - clock.at) / 1000;
  }

  // Elements showing an age carry the unix time it counts from (data-since) and a prefix;
  // all are rewritten together, from the same instant.
  function showAge(node, since, prefix, none) {
    if (since === null || since === undefined) {
      delete node.dataset.since;
      node.textContent = none;
      return;
    }
    node.dataset.since = String(since);
    node.dataset.prefix = prefix;
    renderAges();
  }

  function renderAges() {
    const now = serverNow();
    for (const node of document.querySelectorAll("[data-since]")) {
      node.textContent = node.dataset.prefix + ago(Math.max(now - Number(node.dataset.since), 0));
    }
  }

  // ------------------------------------------------------------------ data
  // A series arrives as base64 of little-endian float64 (NaN where not recorded or not
  // finite); uPlot draws a gap at null.
  function decode(encoded) {
    const bin = atob(encoded);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i += 1) bytes[i] = bin.charCodeAt(i);
    return Array.from(new Float64Array(bytes.buffer), (v) => (Number.isFinite(v) ? v : null));
  }

  function apply(data) {
    const names = METRICS.map((m) => m.key);
    for (const name of names) {
      const column = data.series[name] || [];
      data.series[name] = data.encoding === "numbers" ? column : decode(column);
    }
    if (data.reset) {
      state.steps = data.steps.slice();
      for (const name of names) state.series[name] = data.series[name];
    } else {
      // keep the points up to `since` (the newest record may have been replaced), append
      let keep = state.steps.length;
      while (keep > 0 && state.steps[keep - 1] > state.since) keep -= 1;
      state.steps.length = keep;
      for (const s of data.steps) state.steps.push(s);
      for (const name of names) {
        const column = state.series[name] || (state.series[name] = []);
        column.length = keep;
        for (const v of data.series[name]) column.push(v);
      }
    }
    state.generation = data.generation;
    state.since = data.committed === null ? -1 : data.committed;
    if (data.marks) {
      state.marks = data.marks;
      state.marksVersion = data.marks_version;
    }
    state.marksDropped = data.marks_dropped;
    state.current = data.current;
    if (data.current && typeof data.current.now === "number") {
      clock.server = data.current.now;
      clock.at = performance.now();
    }
  }

  async function poll() {
    let wait = POLL_MS;
    try {
      const query = state.generation === null ? "" :
        `?since=${state.since}&generation=${state.generation}&marks=${state.marksVersion}`;
      const response = await fetch("api/history" + query, { cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status} ${response.statusText}`);
      apply(await response.json());
      state.polls += 1;
      render();
      connection(null);
    } catch (error) {
      connection(error);
      wait = RETRY_MS;
    }
    setTimeout(poll, document.hidden ? Math.max(wait, RETRY_MS) : wait);
  }

  function connection(error) {
    const box = $("connection");
    state.lastError = error ? String(error.message || error) : null;
    box.hidden = !error;
    if (error) {
      const last = state.current ? ` (last seen: ${state.current.status_name}, step ${state.current.step})` : "";
      box.textContent = `Cannot reach this rank's endpoint: ${state.lastError}${last}. Retrying every ${RETRY_MS / 1000} s.`;
    }
  }

  // ------------------------------------------------------------------ charts
  function chartData(key) {
    let ys = state.series[key] || [];
    if (key === "loss" && state.logLoss) ys = ys.map((v) => (v !== null && v > 0 ? v : null));
    return [state.steps, ys];
  }

  // Non-finite steps as red (loss) / orange (grad norm) bands; the first NaN loss as a line.
  function drawMarks(u) {
    const current = state.current || {};
    const first = current.first_nonfinite_step;
    if (!state.marks.length && (first === null || first === undefined)) return;
    const ctx = u.ctx;
    const { left, top, width, height } = u.bbox;
    const px = window.devicePixelRatio || 1;
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, top, width, height);
    ctx.clip();
    for (const mark of state.marks) {
      const x0 = u.valToPos(mark.first, "x", true);
      const x1 = u.valToPos(mark.last, "x", true);
      ctx.fillStyle = MARK_FILL[mark.metric] || MARK_FILL.loss;
      if (mark.metric === "loss") ctx.fillRect(x0 - 2 * px, top, x1 - x0 + 4 * px, height);
      else ctx.fillRect(x0 - 2 * px, top + height - STRIP_PX * px, x1 - x0 + 4 * px, STRIP_PX * px);
    }
    if (first !== null && first !== undefined) {
      const x = Math.round(u.valToPos(first, "x", true));
      ctx.fillStyle = FIRST_NONFINITE;
      ctx.fillRect(x - px, top, 2 * px, height);
      ctx.font = `${12 * px}px system-ui, sans-serif`;
      ctx.textAlign = "left";   // uPlot leaves its axes' alignment on the context
      ctx.textBaseline = "alphabetic";
      const label = `first NaN/Inf loss: step ${first}`;
      const textWidth = ctx.measureText(label).width;
      const tx = x + 4 * px + textWidth > left + width ? x - 4 * px - textWidth : x + 4 * px;
      ctx.fillText(label, tx, top + 14 * px);
    }
    ctx.restore();
  }

  // The first step includes graph compilation (seconds to minutes): when it dwarfs the
  // others, the step-time axis leaves it off the scale and the chart's title gives it.
  function firstStepOffScale() {
    const ys = state.series.step_time || [];
    let rest = 0;
    for (let i = 1; i < ys.length; i += 1) if (ys[i] !== null && ys[i] > rest) rest = ys[i];
    return ys.length > 1 && ys[0] !== null && rest > 0 && ys[0] > 3 * rest ? rest : null;
  }

  function stepTimeRange(u, min, max) {
    const rest = firstStepOffScale();
    if (rest !== null) return [0, rest * 1.15];
    return min === null || max === null ? [0, 1] : uPlot.rangeNum(min, max, 0.1, true);
  }

  function plotWidth(node) {
    return Math.max(node.clientWidth - 4, 200);
  }

  function makeChart(metric) {
    const box = $(`plot-${metric.key}`);
    const log = metric.key === "loss" && state.logLoss;
    const opts = {
      width: plotWidth(box),
      height: 220,
      scales: { x: { time: false },
        y: log ? { distr: 3, log: 10 } : (metric.key === "step_time" ? { range: stepTimeRange } : {}) },
      series: [
        { label: "step", value: (u, v) => (v === null || v === undefined ? "–" : String(v)) },
        { label: metric.title, stroke: metric.color, width: 1.5, points: { show: false },
          value: (u, v) => fmt(v) },
      ],
      axes: [{}, { size: 70, values: (u, values) => values.map(fmt) }],
      cursor: { sync: { key: "mfotel" } },
      hooks: {
        draw: [drawMarks],
        setSelect: [(u) => { if (u.select.width > 0) state.zoomed[metric.key] = true; }],
      },
    };
    const chart = new uPlot(opts, chartData(metric.key), box);
    chart.over.addEventListener("dblclick", () => { state.zoomed[metric.key] = false; });
    state.charts[metric.key] = chart;
  }

  function buildCharts() {
    const recorded = (state.current && state.current.metrics) || [];
    const section = $("charts");
    for (const metric of METRICS) {
      const head = el("h2", {}, el("span", { text: metric.title }),
        el("span", { class: "unit", text: metric.unit }),
        el("span", { class: "unit", id: `note-${metric.key}` }));
      const card = el("div", { class: "chart", id: `chart-${metric.key}` }, head);
      if (!recorded.includes(metric.key)) {
        card.append(el("div", { class: "off", text:
          `${metric.key} is not recorded: add it to monitor_config.metrics` }));
        section.append(card);
        continue;
      }
      if (metric.key === "loss") {
        const toggle = el("input", { type: "checkbox", id: "loss-log" });
        toggle.addEventListener("change", () => {
          state.logLoss = toggle.checked;
          state.charts.loss.destroy();
          makeChart(metric);
        });
        head.append(el("label", {}, toggle, " log scale"));
      }
      card.append(el("div", { class: "plot", id: `plot-${metric.key}` }));
      section.append(card);
      makeChart(metric);
    }
    const resize = new ResizeObserver(() => {
      for (const [key, chart] of Object.entries(state.charts)) {
        chart.setSize({ width: plotWidth($(`plot-${key}`)), height: 220 });
      }
    });
    resize.observe(section);
    state.built = true;
  }

  // ------------------------------------------------------------------ values
  function card(label, value, bad) {
    return el("div", { class: bad ? "card bad" : "card" },
      el("div", { class: "label", text: label }), el("div", { class: "value", text: value }));
  }

  function render() {
    const c = state.current;
    if (!state.built) buildCharts();
    for (const [key, chart] of Object.entries(state.charts)) {
      chart.setData(chartData(key), !state.zoomed[key]);
    }
    document.title = `${c.job_name} rank ${c.rank}: step ${c.step ?? "–"} (${c.status_name})`;
    $("job").textContent = c.job_name;
    $("rank").textContent = `rank ${c.rank} of ${c.world_size}` + (c.node ? ` on ${c.node}` : "");
    const status = $("status");
    status.textContent = c.status_name;
    status.className = `status status-${c.status_name.split(" ")[0]}`;
    $("step").textContent = c.step === null ? "–" : String(c.step);
    $("epoch").textContent = c.epoch ? `epoch ${c.epoch}` : "";
    const progress = $("progress");
    progress.hidden = c.progress === null;
    progress.value = c.progress || 0;
    $("progress-text").textContent = c.progress === null ? "" : `${(100 * c.progress).toFixed(1)}%`;
    // this rank's row of the ranks table counts from the same, freshest, last step
    for (const cell of document.querySelectorAll(".self-age")) {
      if (c.last_step_timestamp !== null) cell.dataset.since = String(c.last_step_timestamp);
    }
    showAge($("updated"), c.last_step_timestamp, "last step ", "no step yet");
    const note = $("note-step_time");
    if (note) {
      const offScale = firstStepOffScale() !== null;
      note.textContent = offScale ? `first step ${fmt(state.series.step_time[0])} s ` +
        "(includes graph compilation), off the scale" : "";
    }
    renderStacks(c.stacks);
    renderCurrent(c);
    renderAlert(c);
    renderMarks();
    const h = c.history;
    $("footer").textContent = `History: ${h.points} points of ${h.capacity} kept in memory ` +
      `(${(h.bytes / 1024).toFixed(0)} KiB)` + (h.stride > 1 ? `, every ${h.stride}th record ` +
      `of the run` : ", every record") + `; step interval ${c.step_interval}; ` +
      `updated every ${POLL_MS / 1000} s. Served by mfotel on this rank's /metrics port.`;
  }

  // Under mfotel-instrument: a link to this rank's last stack capture on the node endpoint
  // (another port of this page's host; its own scheme), which the node agent takes when the
  // rank stops stepping or answering.
  function renderStacks(stacks) {
    let link = $("stacks-link");
    if (!stacks) {
      if (link) link.remove();
      return;
    }
    if (!link) {
      link = el("a", { id: "stacks-link", text: "stacks", title: "this rank's Python stacks, " +
        "as the node agent last captured them (when it stopped stepping or answering)" });
      document.querySelector("header nav").append(" · ", link);
    }
    const target = new URL(location.href);
    target.protocol = `${stacks.scheme}:`;
    target.username = "";
    target.password = "";
    target.port = String(stacks.port);
    target.pathname = stacks.path;
    target.search = stacks.query;
    target.hash = "";
    if (link.href !== target.href) link.href = target.href;
  }

  // A loss / grad norm that is NaN/Inf at this step, or still is (as /metrics shows it):
  // "NaN", "Inf" or "-Inf"; undefined when finite.
  function nonfinite(c, key) {
    return (c.nonfinite_now && c.nonfinite_now[key]) ||
      (c.nonfinite_values && c.nonfinite_values[key]);
  }

  function renderCurrent(c) {
    const loss = nonfinite(c, "loss");
    const norm = nonfinite(c, "grad_norm");
    const cards = [
      card("loss", loss || fmt(c.loss), Boolean(loss) || c.loss_finite === 0),
      card("learning rate", fmt(c.learning_rate)),
      card("grad norm", norm || fmt(c.grad_norm), Boolean(norm)),
      card("throughput (samples/s)", fmt(c.throughput)),
      card("step time (s)", fmt(c.step_time)),
      card("non-finite loss steps", String(c.nonfinite_total.loss || 0), c.nonfinite_total.loss > 0),
      card("non-finite grad-norm steps", String(c.nonfinite_total.grad_norm || 0),
        c.nonfinite_total.grad_norm > 0),
    ];
    if (c.loss_scale !== null) cards.push(card("loss scale", fmt(c.loss_scale)));
    if (c.overflow !== null) cards.push(card("overflow steps", String(c.overflow)));
    if (c.export_errors) cards.push(card("export errors", String(c.export_errors), true));
    $("current").replaceChildren(...cards);
  }

  function renderAlert(c) {
    const box = $("alert");
    const first = c.first_nonfinite_step;
    box.hidden = first === null;
    if (first !== null) {
      const mark = state.marks.find((m) => m.metric === "loss" && m.first === first);
      const what = mark ? mark.value : "NaN/Inf";
      box.textContent = `The loss went ${what} at step ${first} (first non-finite step); ` +
        `${c.nonfinite_total.loss} non-finite loss steps so far.`;
    }
  }

  function renderMarks() {
    const section = $("marks");
    section.hidden = state.marks.length === 0;
    const items = state.marks.map((m) => el("li", { class: m.metric, text:
      `${m.metric}: ${m.first === m.last ? `step ${m.first}` : `steps ${m.first}–${m.last}`} (${m.value})` }));
    if (state.marksDropped) {
      items.push(el("li", { text: `and ${state.marksDropped} later ranges (not listed)` }));
    }
    $("marks-list").replaceChildren(...items);
  }

  // ------------------------------------------------------------------ overview of all ranks
  function rankLink(url) {
    if (!url) return null;
    const target = new URL(url);
    // a rank found on loopback is reachable as this page's host from a remote browser
    if (LOOPBACK.includes(target.hostname) && !LOOPBACK.includes(location.hostname)) {
      target.hostname = location.hostname;
    }
    return target.href;
  }

  async function pollOverview() {
    try {
      const response = await fetch("api/overview", { cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const data = await response.json();
      renderOverview(data);
      if (!data.enabled) return; // a note that will not change
    } catch (error) {
      $("overview-note").textContent = `overview unavailable: ${error.message || error}`;
    }
    setTimeout(pollOverview, OVERVIEW_MS);
  }

  // The age of a rank's last step; this rank's own row takes it from this page's freshest
  // answer (the overview's copy may be a fan-out older), so it reads as the header does.
  function ageCell(r) {
    const self = state.current && r.rank === state.current.rank;
    const since = self && state.current.last_step_timestamp !== null
      ? state.current.last_step_timestamp : r.last_step_timestamp;
    if (!since) return el("td", { text: "–" });
    return el("td", { class: self ? "self-age" : "", "data-since": String(since), "data-prefix": "" });
  }

  function renderOverview(data) {
    const note = $("overview-note");
    if (!data.enabled) {
      note.replaceChildren(data.note || "no overview");
      const link = rankLink(data.url);
      if (link) note.append(": ", el("a", { href: link, text: link }));
      return;
    }
    const refreshed = data.refreshed ? `refreshed ${ago(Math.max(serverNow() - data.refreshed, 0))}` :
      "fetching the other ranks…";
    note.textContent = (data.note ? data.note + ". " : "") + refreshed +
      `; at most every ${Math.max(data.next_refresh_seconds, 2).toFixed(0)} s (2% CPU budget on this rank).`;
    const counts = {};
    const rows = data.ranks.map((r) => {
      const name = r.error ? "unreachable" : r.status_name || "unknown";
      counts[name] = (counts[name] || 0) + 1;
      const loss = nonfinite(r, "loss");
      const nan = Boolean(loss) || r.loss_finite === 0;
      const link = rankLink(r.url);
      const row = el("tr", { class: (nan ? "bad " : "") + (state.current && r.rank === state.current.rank ? "self" : "") },
        el("td", {}, link ? el("a", { href: link, text: String(r.rank) }) : String(r.rank)),
        el("td", {}, el("span", { class: `status status-${name.split(" ")[0]}`, text: name })),
        el("td", { text: fmt(r.step) }),
        el("td", { text: nan ? loss || "NaN/Inf" : fmt(r.loss) }),
        el("td", { text: nonfinite(r, "grad_norm") || fmt(r.grad_norm) }),
        el("td", { text: fmt(r.step_time) }),
        el("td", { text: fmt(r.throughput) }),
        ageCell(r),
        el("td", { text: r.error || (r.first_nonfinite_step !== null && r.first_nonfinite_step !== undefined
          ? `first NaN/Inf at step ${r.first_nonfinite_step}` : "") }));
      return row;
    });
    $("overview-rows").replaceChildren(...rows);
    renderAges();
    $("overview-table").hidden = rows.length === 0;
    const world = state.current ? state.current.world_size : "?";
    $("overview-counts").textContent = `${data.ranks.length} of ${world} ranks: ` +
      Object.entries(counts).map(([k, v]) => `${v} ${k}`).join(", ");
  }

  async function start() {
    await poll();
    pollOverview();
    setInterval(renderAges, 1000); // ages keep counting between answers and after the last
  }
  start();
})();
