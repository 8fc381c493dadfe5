// Utilization and memory of one GPU over the last hour: read again after each telemetry round of
// its server that the page's stream brings (static/js/live.js), at most every MIN_GAP_MS; every
// 15 s while the page has no stream up. Its times are HH:MM:SS (24-hour) in the person's zone, the
// one every page shows (data-time-zone), never the browser's locale or zone.
(function () {
  const canvas = document.getElementById("gpu-chart");
  if (!canvas || !window.Chart) return;
  const clock = clockIn(canvas.dataset.timeZone);
  const chart = new Chart(canvas, {
    type: "line",
    data: { labels: [], datasets: [
      { label: "Utilization %", data: [], yAxisID: "pct", borderColor: "#2563eb", pointRadius: 0, tension: 0.2 },
      { label: "Memory used MB", data: [], yAxisID: "mb", borderColor: "#16a34a", pointRadius: 0, tension: 0.2 },
    ] },
    options: {
      animation: false,
      scales: {
        pct: { type: "linear", position: "left", min: 0, max: 100 },
        mb: { type: "linear", position: "right", min: 0, grid: { drawOnChartArea: false } },
      },
    },
  });
  async function refresh() {
    const response = await fetch(canvas.dataset.url, { credentials: "same-origin" });
    if (!response.ok) return;
    const body = await response.json();
    chart.data.labels = body.points.map((p) => clock(new Date(p.at)));
    chart.data.datasets[0].data = body.points.map((p) => p.util);
    chart.data.datasets[1].data = body.points.map((p) => p.mem);
    chart.options.scales.mb.max = body.memory_total_mb;
    chart.update();
  }
  const MIN_GAP_MS = 5000;
  const live = window.portalLive;
  let last = 0;
  let queued = false;
  function soon() {
    if (queued) return;
    queued = true;
    setTimeout(() => {
      queued = false;
      last = Date.now();
      refresh().catch(() => {}); // the next round tries again
    }, Math.max(0, last + MIN_GAP_MS - Date.now()));
  }
  if (live) {
    live.on("telemetry", (event) => {
      let server = null;
      try {
        server = JSON.parse(event.data).server;
      } catch (err) {
        /* any server */
      }
      if (server == null || String(server) === canvas.dataset.server) soon();
    });
    live.on("ready", soon);
  }
  soon();
  setInterval(() => {
    if (!live || live.polls) soon();
  }, 15000);

  // "15:04:05" in `zone` (an IANA name), whatever the browser's locale: built from the parts, so no
  // locale's separators or day periods slip in; a zone the browser does not know falls back to its own.
  function clockIn(zone) {
    const options = { hour: "2-digit", minute: "2-digit", second: "2-digit", hourCycle: "h23" };
    let format;
    try {
      format = new Intl.DateTimeFormat("en-GB", { ...options, timeZone: zone || undefined });
    } catch (err) {
      format = new Intl.DateTimeFormat("en-GB", options);
    }
    return (at) => {
      const part = Object.fromEntries(format.formatToParts(at).map((p) => [p.type, p.value]));
      return `${part.hour}:${part.minute}:${part.second}`;
    };
  }
})();
