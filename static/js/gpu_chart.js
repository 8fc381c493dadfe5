// Utilization and memory of one GPU over the last hour, refreshed every 15 s.
(function () {
  const canvas = document.getElementById("gpu-chart");
  if (!canvas || !window.Chart) return;
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
    chart.data.labels = body.points.map((p) => new Date(p.at).toLocaleTimeString());
    chart.data.datasets[0].data = body.points.map((p) => p.util);
    chart.data.datasets[1].data = body.points.map((p) => p.mem);
    chart.options.scales.mb.max = body.memory_total_mb;
    chart.update();
  }
  refresh();
  setInterval(refresh, 15000);
})();
