// The charts of a job page: its training curves and its cards' use, live while it runs.
//
// Training curves: <section id="job-curves" data-metrics-url=… hidden>. Reads
// `metricsUrl?since=N` (GET /api/v1/jobs/{id}/metrics/) when the page's stream says records were
// stored (`metrics`; every 2 s while the page has no stream up) while X-Job-Status is active,
// adds the new records and shows the section once the first one came: a script without Keras
// reports none, and its page shows no curves. After the job ends, one last fetch, then it stops.
// Epoch records are points: losses on the left axis, other metrics (accuracy, …) on the right, the
// learning rate on a log axis of its own; validation dashed; the batch loss a faint line. Across:
// the training step (batches over every fit() of the job), so the epoch and batch records line up.
//
// GPU use: <section id="job-usage" data-usage-url=…>, the job's cards' utilization and memory
// since it started, read again after a telemetry round of its server (at most every 15 s, the
// history's step; every 15 s while the page has no stream up) while it runs.
(function () {
  "use strict";

  var ACTIVE = { pending: true, queued: true, starting: true, running: true };
  var CURVES_MS = 2000;
  var USAGE_MS = 15000;
  var RETRY_MS = 5000;
  var PAGE = 10000; // the API's records per answer: a full page means more are waiting
  var COLORS = ["#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

  // The page's stream (static/js/live.js), where it has one: charts read again when it says so.
  var pushed = window.portalLive && window.portalLive.streams ? window.portalLive : null;

  // later(fn, ms): run fn at the next wake() while the page's stream pushes, or after ms while
  // it does not (no stream, given up, reconnecting); once either way.
  function waiter() {
    var pending = null;
    function wake() {
      var fn = pending;
      pending = null;
      if (fn) fn();
    }
    function later(fn, ms) {
      pending = fn;
      if (!pushed || pushed.polls) window.setTimeout(wake, ms);
    }
    return { later: later, wake: wake };
  }

  function say(id, text) {
    var element = document.getElementById(id);
    if (element) element.textContent = text;
  }

  // --- training curves ----------------------------------------------------------------------

  function axisOf(name) {
    if (name === "learning_rate") return "lr";
    return /loss/.test(name) ? "loss" : "metric";
  }

  function curves(section) {
    var next = waiter();
    var later = next.later;
    var wake = next.wake;
    var url = section.getAttribute("data-metrics-url");
    var colorOf = {};
    var datasets = {}; // "epoch:loss", "batch:loss", … → its Chart.js dataset
    var since = 0;
    var records = 0;
    var finalSeen = false;
    var chart = new Chart(document.getElementById("job-curves-chart"), {
      type: "line",
      data: { datasets: [] },
      options: {
        animation: false,
        parsing: false,
        spanGaps: true,
        interaction: { mode: "nearest", intersect: false },
        scales: {
          x: { type: "linear", title: { display: true, text: "training step" } },
          loss: { type: "linear", position: "left", title: { display: true, text: "loss" } },
          metric: { type: "linear", position: "right", display: "auto", grid: { drawOnChartArea: false } },
          lr: {
            type: "logarithmic", position: "right", display: "auto", grid: { drawOnChartArea: false },
            title: { display: true, text: "learning rate" },
          },
        },
        plugins: {
          tooltip: {
            callbacks: {
              title: function (items) {
                var point = items[0].raw;
                return "step " + point.x + (point.epoch ? " · epoch " + point.epoch : "");
              },
            },
          },
        },
      },
    });

    function color(name) {
      var base = name.replace(/^val_/, "");
      if (!(base in colorOf)) colorOf[base] = COLORS[Object.keys(colorOf).length % COLORS.length];
      return colorOf[base];
    }

    function dataset(kind, name) {
      var key = kind + ":" + name;
      if (!datasets[key]) {
        var batch = kind === "batch";
        datasets[key] = {
          label: batch ? name + " (batches)" : name,
          data: [],
          yAxisID: axisOf(name),
          borderColor: color(name),
          backgroundColor: color(name),
          borderDash: /^val_/.test(name) ? [6, 3] : [],
          borderWidth: batch ? 1 : 2,
          pointRadius: batch ? 0 : 2,
          order: batch ? 1 : 0, // drawn under the epoch lines
        };
        if (batch) datasets[key].borderColor = datasets[key].backgroundColor = color(name) + "55";
        chart.data.datasets.push(datasets[key]);
      }
      return datasets[key];
    }

    function add(record) {
      if (record.step === null) return; // no place on the axis
      Object.keys(record).forEach(function (name) {
        if (["seq", "kind", "epoch", "step", "at"].indexOf(name) >= 0) return;
        // Batch records: the loss only, a faint line under the epochs' points.
        if (record.kind === "batch" && name !== "loss") return;
        dataset(record.kind, name).data.push({ x: record.step, y: record[name], epoch: record.epoch });
      });
    }

    function tick() {
      fetch(url + "?since=" + since, {
        credentials: "same-origin", cache: "no-store", headers: { Accept: "application/json" },
      })
        .then(function (response) {
          var status = response.headers.get("X-Job-Status") || "";
          if (response.status === 403 || response.status === 404) return { status: "gone", records: [] };
          if (!response.ok || !status) throw new Error(response.ok ? "reload the page" : "HTTP " + response.status);
          return response.json().then(function (body) { return { status: status, records: body }; });
        })
        .then(function (answer) {
          answer.records.forEach(add);
          if (answer.records.length) {
            since = answer.records[answer.records.length - 1].seq;
            records += answer.records.length;
            section.hidden = false;
            chart.update();
          }
          var live = ACTIVE[answer.status];
          say("job-curves-status", (live ? "live · " : "") + records.toLocaleString() + " records");
          if (answer.status === "gone") {
            say("job-curves-status", "stopped: this job is not visible to you any more");
          } else if (answer.records.length === PAGE) {
            window.setTimeout(tick, 0);
          } else if (live) {
            later(tick, CURVES_MS);
          } else if (!finalSeen) {
            finalSeen = true; // one last fetch for records stored just before the end
            window.setTimeout(tick, CURVES_MS);
          } else {
            section.setAttribute("data-done", "1");
          }
        })
        .catch(function (error) {
          say("job-curves-status", "reconnecting (" + error.message + ")…");
          window.setTimeout(tick, RETRY_MS);
        });
    }

    if (pushed) {
      // Records stored (`metrics`), the job's end, a reconnect (what came meanwhile): read now.
      ["metrics", "end", "ready"].forEach(function (type) { pushed.on(type, wake); });
      pushed.onFallback(wake);
    }
    tick();
  }

  // --- the cards' use -----------------------------------------------------------------------

  function usage(section) {
    var url = section.getAttribute("data-usage-url");
    var next = waiter();
    var later = next.later;
    var wake = next.wake;
    var last = 0;
    var chart = new Chart(document.getElementById("job-usage-chart"), {
      type: "line",
      data: { datasets: [] },
      options: {
        animation: false,
        parsing: false,
        interaction: { mode: "nearest", intersect: false },
        scales: {
          x: { type: "linear", min: 0, title: { display: true, text: "since the job started" } },
          pct: { type: "linear", position: "left", min: 0, max: 100, title: { display: true, text: "utilization %" } },
          mb: {
            type: "linear", position: "right", min: 0, grid: { drawOnChartArea: false },
            title: { display: true, text: "memory used MiB" },
          },
        },
      },
    });

    function show(body) {
      var start = body.started_at ? Date.parse(body.started_at) : null;
      var last = 0;
      var samples = 0;
      var memoryMax = 0;
      body.cards.forEach(function (card) {
        card.points.forEach(function (p) { last = Math.max(last, Date.parse(p.at) - start); });
      });
      // Seconds for a short job, minutes for the rest.
      var unit = last > 180000 ? { ms: 60000, text: "minutes" } : { ms: 1000, text: "seconds" };
      chart.options.scales.x.title.text = unit.text + " since the job started";
      chart.data.datasets = [];
      body.cards.forEach(function (card, i) {
        function points(field) {
          return card.points.map(function (p) {
            return { x: (Date.parse(p.at) - start) / unit.ms, y: p[field] };
          });
        }
        var hue = COLORS[i % COLORS.length];
        samples += card.points.length;
        memoryMax = Math.max(memoryMax, card.memory_total_mb || 0);
        chart.data.datasets.push(
          { label: card.label + " utilization %", data: points("util"), yAxisID: "pct", borderColor: hue, backgroundColor: hue, pointRadius: 0, borderWidth: 2 },
          { label: card.label + " memory MiB", data: points("mem"), yAxisID: "mb", borderColor: hue, backgroundColor: hue, borderDash: [6, 3], pointRadius: 0, borderWidth: 1 },
        );
      });
      if (memoryMax) chart.options.scales.mb.max = memoryMax;
      chart.update();
      // No empty axes: the chart shows once it has a sample (issue 23); the line says why not yet.
      var box = section.querySelector(".chart-box");
      if (box) box.hidden = !samples;
      if (!start) say("job-usage-status", "the job has not started yet");
      else say("job-usage-status", (ACTIVE[body.status] ? "live · " : "") + (samples ? samples + " samples" : "no telemetry samples yet: the chart appears with the first"));
    }

    function refresh() {
      fetch(url, { credentials: "same-origin", cache: "no-store" })
        .then(function (response) {
          if (!response.ok) throw new Error("HTTP " + response.status);
          return response.json();
        })
        .then(function (body) {
          show(body);
          last = Date.now();
          if (ACTIVE[body.status]) later(refresh, USAGE_MS);
          else section.setAttribute("data-done", "1");
        })
        .catch(function (error) {
          say("job-usage-status", "reconnecting (" + error.message + ")…");
          window.setTimeout(refresh, USAGE_MS);
        });
    }

    if (pushed) {
      // A telemetry round of the job's server; not more than once per USAGE_MS (the history's step).
      var server = section.getAttribute("data-server");
      var soon = function () { window.setTimeout(wake, Math.max(0, last + USAGE_MS - Date.now())); };
      pushed.on("telemetry", function (event) {
        var said = null;
        try { said = JSON.parse(event.data).server; } catch (err) { /* any server */ }
        if (said == null || !server || String(said) === server) soon();
      });
      pushed.on("ready", soon);
      pushed.onFallback(wake);
    }
    refresh();
  }

  function init() {
    if (!window.Chart) return;
    var curvesSection = document.getElementById("job-curves");
    var usageSection = document.getElementById("job-usage");
    if (curvesSection) curves(curvesSection);
    if (usageSection) usage(usageSection);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
