// The Reports page's charts, drawn from the JSON the server embedded (gpus/reports.py usage_report):
// GPU-hours per user (stacked), booked against used, utilization by hour of the week, jobs by
// outcome, the most idle bookings. Chart.js has no heatmap: it is a scatter of square points.
// Every axis's title (its unit) and each person's colour come from the server (data.axes, a
// series' colour), so that a person keeps one colour on every load and the tests can read both.
(function () {
  const source = document.getElementById("report-data");
  if (!source || !window.Chart) return;
  const data = JSON.parse(source.textContent);
  const days = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];
  const base = { animation: false, responsive: true, maintainAspectRatio: false };
  const title = (text) => ({ display: true, text });
  // A tooltip's figure with its unit: "alice: 0.033 GPU-hours".
  const withUnit = (unit) => ({
    callbacks: { label: (context) => `${context.dataset.label || context.label}: ${context.formattedValue} ${unit}` },
  });

  function draw(id, config) {
    const canvas = document.getElementById(id);
    if (canvas) new Chart(canvas, config);
  }

  draw("chart-users", {
    type: "bar",
    data: {
      labels: data.labels,
      datasets: data.users.map((series) => ({
        label: series.label, data: series.data, backgroundColor: series.colour,
      })),
    },
    options: {
      ...base,
      plugins: { tooltip: withUnit("GPU-hours") },
      scales: {
        x: { stacked: true, title: title(data.axes.users.x) },
        y: { stacked: true, title: title(data.axes.users.y) },
      },
    },
  });

  draw("chart-booked-used", {
    type: "bar",
    data: {
      labels: data.labels,
      datasets: [
        { label: "Booked", data: data.booked_used.booked, backgroundColor: "#cbd5e1" },
        { label: "Used", data: data.booked_used.used, backgroundColor: "#2563eb" },
        { label: "Idle", data: data.booked_used.idle, type: "line", borderColor: "#dc2626", pointRadius: 2 },
      ],
    },
    options: {
      ...base,
      plugins: { tooltip: withUnit("GPU-hours") },
      scales: { x: { title: title(data.axes.booked_used.x) }, y: { title: title(data.axes.booked_used.y) } },
    },
  });

  // One square per hour of the week, its blue as deep as the cards were busy; grey: no card time.
  const cell = (context) => {
    const area = context.chart.chartArea;
    return area ? Math.max(2, Math.min(area.width / 24, area.height / 7) / Math.SQRT2) : 4;
  };
  draw("chart-heatmap", {
    type: "scatter",
    data: {
      datasets: [{
        label: data.axes.heatmap.v,
        data: data.heatmap,
        pointStyle: "rect",
        radius: cell,
        hoverRadius: cell,
        backgroundColor: (context) => {
          const v = context.raw && context.raw.v;
          return v === null || v === undefined ? "#f1f5f9" : `rgba(37, 99, 235, ${0.08 + 0.92 * Math.min(v, 100) / 100})`;
        },
        borderWidth: 0,
      }],
    },
    options: {
      ...base,
      plugins: {
        legend: { display: false },
        tooltip: {
          callbacks: {
            label: (context) => {
              const p = context.raw;
              const hour = String(p.x).padStart(2, "0");
              return `${days[p.y]} ${hour}:00: ${p.v === null ? "no card time" : p.v + " %"}`;
            },
          },
        },
      },
      // The axes run half a cell past the first and last hour and day; the ticks sit on the cells.
      scales: {
        x: {
          min: -0.5, max: 23.5, grid: { display: false }, title: title(data.axes.heatmap.x),
          afterBuildTicks: (scale) => { scale.ticks = [0, 3, 6, 9, 12, 15, 18, 21].map((value) => ({ value })); },
          ticks: { callback: (value) => `${value}:00` },
        },
        y: {
          min: -0.5, max: 6.5, reverse: true, grid: { display: false }, title: title(data.axes.heatmap.y),
          afterBuildTicks: (scale) => { scale.ticks = days.map((_, value) => ({ value })); },
          ticks: { callback: (value) => days[value] },
        },
      },
    },
  });

  draw("chart-jobs", {
    type: "doughnut",
    data: {
      labels: ["Succeeded", "Failed", "Cancelled, timed out or lost"],
      datasets: [{ data: [data.jobs.succeeded, data.jobs.failed, data.jobs.other], backgroundColor: ["#16a34a", "#dc2626", "#94a3b8"] }],
    },
    // A doughnut has no axes: its tooltips name the unit.
    options: { ...base, plugins: { tooltip: withUnit("jobs") } },
  });

  draw("chart-idle", {
    type: "bar",
    data: {
      labels: data.idle.map((booking) => booking.label),
      datasets: [{ label: "Idle hours", data: data.idle.map((booking) => booking.hours), backgroundColor: "#d97706" }],
    },
    options: {
      ...base,
      indexAxis: "y",
      plugins: { legend: { display: false }, tooltip: withUnit("h") },
      scales: { x: { title: title(data.axes.idle.x) }, y: { title: title(data.axes.idle.y) } },
    },
  });
})();
