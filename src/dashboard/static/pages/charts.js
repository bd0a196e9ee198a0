// Charts of one app from GET .../apps/{app}/stats: runs per minute by state, p50/p95 run time, and
// replicas over time, drawn with uPlot (served from Ferry itself, loaded only on this page).
import { api } from '../api.js';
import { appHeader } from '../shared.js';
import { errorBox, formatDuration, h } from '../ui.js';

const WINDOWS = [
  ['15', 'Last 15 minutes'],
  ['60', 'Last hour'],
  ['180', 'Last 3 hours'],
  ['1440', 'Last 24 hours'],
];
const STATES = ['success', 'failure', 'timeout', 'cancelled'];

function cssColor(name, fallback) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || fallback;
}

/**
 * Stacked bars: each state is drawn as the running total up to it, tallest first, so every state's own
 * band shows on top of the one below. uPlot's legend would list them in that drawing order with the
 * totals, so this chart has its own legend: the states in their usual order, with their own counts for
 * the minute under the cursor (or the whole window).
 */
function runsChart(uPlot, el, stats, width) {
  const x = stats.series.map((p) => Date.parse(p.minute) / 1000);
  const raw = STATES.map((state) => stats.series.map((p) => p[state]));
  const stacked = [];
  let acc = x.map(() => 0);
  for (const values of raw) {
    acc = acc.map((a, i) => a + values[i]);
    stacked.push(acc);
  }
  const totals = raw.map((values) => values.reduce((a, b) => a + b, 0));
  const cells = STATES.map(() => h('span', { class: 'legend-value' }));
  const when = h('span', { class: 'legend-when' });
  const legend = h(
    'div',
    { class: 'legend' },
    when,
    STATES.map((state, i) =>
      h('span', { class: 'legend-item' }, h('span', { class: `swatch state-${state}` }), `${state} `, cells[i]),
    ),
  );
  const showLegend = (idx) => {
    when.textContent =
      idx === null || idx === undefined
        ? 'Whole window:'
        : `${new Date(x[idx] * 1000).toLocaleTimeString([], { hour: '2-digit', minute: '2-digit' })}:`;
    cells.forEach((cell, i) => {
      cell.textContent = String(idx === null || idx === undefined ? totals[i] : raw[i][idx]);
    });
  };
  showLegend(null);
  const bars = uPlot.paths.bars({ size: [0.8, 24], gap: 1 });
  const order = [3, 2, 1, 0];
  const plot = new uPlot(
    {
      width,
      height: 220,
      scales: { x: { time: true, range: padX(x) }, y: { range: (_u, _min, max) => [0, Math.max(1, max)] } },
      axes: axes('runs'),
      legend: { show: false },
      hooks: { setCursor: [(u) => showLegend(u.cursor.idx)] },
      series: [
        {},
        ...order.map((i) => ({
          label: STATES[i],
          fill: cssColor(`--${STATES[i]}`, '#888'),
          stroke: cssColor(`--${STATES[i]}`, '#888'),
          width: 0,
          paths: bars,
          points: { show: false },
        })),
      ],
    },
    [x, ...order.map((i) => stacked[i])],
    el,
  );
  el.append(legend);
  return plot;
}

/** Half a minute of room on each side, so the first and last bars are not cut in half. */
function padX(x) {
  return () => [(x[0] ?? 0) - 30, (x.at(-1) ?? 0) + 30];
}

const minuteText = (seconds) => new Date(seconds * 1000).toLocaleTimeString([], { hour: '2-digit', minute: '2-digit' });

/**
 * The legend of uPlot is the chart's hover box. Its own fillers ("--" off the plot, "" or a dash for a
 * minute without data) tell nothing, so every value says what is there: the whole window while the
 * pointer is off the plot, the minute under it otherwise, and in words when there is no data.
 */
const timeSeries = {
  label: 'Time',
  value: (_u, v, _si, idx) =>
    idx === null || idx === undefined || v === null || v === undefined ? 'whole window' : minuteText(v),
};

function durationValue(values) {
  const known = values.filter((v) => v !== null && v !== undefined);
  const windowText = known.length > 0 ? `up to ${formatDuration(Math.max(...known))}` : 'no finished runs';
  return (_u, v, _si, idx) => {
    if (idx === null || idx === undefined) return windowText;
    return v === null || v === undefined ? 'no finished runs' : formatDuration(v);
  };
}

function axes(unit) {
  const grid = { stroke: cssColor('--grid', '#e5e7eb'), width: 1 };
  const stroke = cssColor('--muted', '#6b7280');
  return [
    { stroke, grid, ticks: grid },
    {
      stroke,
      grid,
      ticks: grid,
      size: unit === 'ms' ? 76 : 56,
      label: unit === 'ms' ? 'run time' : unit,
      labelSize: 18,
      values: unit === 'ms' ? (_u, vals) => vals.map((v) => formatDuration(v)) : undefined,
    },
  ];
}

function durationChart(uPlot, el, stats, width) {
  const x = stats.series.map((p) => Date.parse(p.minute) / 1000);
  const p50 = stats.series.map((p) => p.p50_ms);
  const p95 = stats.series.map((p) => p.p95_ms);
  return new uPlot(
    {
      width,
      height: 220,
      scales: { x: { time: true, range: padX(x) }, y: { range: (_u, _min, max) => [0, Math.max(10, max ?? 10)] } },
      axes: axes('ms'),
      series: [
        timeSeries,
        {
          label: 'p50',
          stroke: cssColor('--accent', '#2563eb'),
          width: 2,
          points: { show: true, size: 5 },
          value: durationValue(p50),
        },
        {
          label: 'p95',
          stroke: cssColor('--timeout', '#d97706'),
          width: 2,
          dash: [6, 4],
          points: { show: true, size: 5 },
          value: durationValue(p95),
        },
      ],
    },
    [x, p50, p95],
    el,
  );
}

function replicasChart(uPlot, el, stats, width) {
  const x = stats.series.map((p) => Date.parse(p.minute) / 1000);
  const max = stats.replicas.max ?? 1;
  return new uPlot(
    {
      width,
      height: 180,
      scales: { x: { time: true, range: padX(x) }, y: { range: (_u, _min, top) => [0, Math.max(max, top ?? 0, 1)] } },
      axes: axes('replicas'),
      series: [
        timeSeries,
        {
          label: 'replicas',
          stroke: cssColor('--accent', '#2563eb'),
          fill: cssColor('--accent-soft', 'rgba(37,99,235,0.15)'),
          width: 2,
          paths: uPlot.paths.stepped({ align: 1 }),
          value: (_u, v, _si, idx) => {
            if (idx === null || idx === undefined) return `${stats.replicas.starting + stats.replicas.ready} now`;
            return v === null || v === undefined ? 'not sampled' : String(v);
          },
        },
      ],
    },
    [x, stats.series.map((p) => p.replicas)],
    el,
  );
}

function summaries(stats) {
  const totals = Object.fromEntries(STATES.map((s) => [s, stats.series.reduce((n, p) => n + p[s], 0)]));
  const p95s = stats.series.map((p) => p.p95_ms).filter((v) => v !== null);
  const p50s = stats.series.map((p) => p.p50_ms).filter((v) => v !== null);
  const reps = stats.series.map((p) => p.replicas).filter((v) => v !== null);
  const r = stats.replicas;
  return {
    runs: `${STATES.map((s) => `${totals[s]} ${s}`).join(', ')} in the window.`,
    duration: p95s.length
      ? `Per minute, p50 up to ${formatDuration(Math.max(...p50s))} and p95 up to ${formatDuration(Math.max(...p95s))}.`
      : 'No finished runs in the window.',
    replicas: `Now ${r.starting + r.ready} running (${r.ready} ready, ${r.starting} starting), ${r.inflight} in flight, ${r.queued} queued; limits ${r.min ?? '—'}–${r.max ?? '—'}. Highest in the window: ${reps.length ? Math.max(...reps) : '—'}.`,
  };
}

export async function renderCharts(ctx) {
  const appId = ctx.params[0];
  ctx.setTitle(`Charts of ${appId}`);
  let minutes = ctx.query.get('minutes') ?? '60';
  if (!WINDOWS.some(([v]) => v === minutes)) minutes = '60';
  const windowSelect = h(
    'select',
    { id: 'chart-window' },
    WINDOWS.map(([v, label]) => h('option', { value: v, selected: v === minutes }, label)),
  );
  const panel = (id, title) => {
    const plot = h('div', { class: 'plot', role: 'img', 'aria-labelledby': `${id}-title ${id}-summary` });
    const summary = h('figcaption', { id: `${id}-summary`, class: 'hint' });
    const figure = h('figure', { class: 'card chart' }, h('h2', { id: `${id}-title` }, title), plot, summary);
    return { figure, plot, summary };
  };
  const panels = {
    runs: panel('chart-runs', 'Runs per minute, by state'),
    duration: panel('chart-duration', 'Run time per minute (p50, p95)'),
    replicas: panel('chart-replicas', 'Replicas over time'),
  };
  const problem = h('div', {});
  ctx.main.append(
    appHeader(ctx, appId, 'charts', `Charts of ${appId}`),
    h(
      'form',
      { class: 'toolbar', 'aria-label': 'Chart window', onsubmit: (e) => e.preventDefault() },
      h('p', { class: 'inline-field' }, h('label', { for: 'chart-window' }, 'Window'), windowSelect),
      h('span', { class: 'hint' }, 'Runs are counted in the minute they were created. Updates every 10 seconds.'),
    ),
    problem,
    h('div', { class: 'charts' }, panels.runs.figure, panels.duration.figure, panels.replicas.figure),
  );

  const { default: uPlot } = await import('../vendor/uPlot.esm.js');
  let plots = [];
  const destroy = () => {
    for (const p of plots) p.destroy();
    plots = [];
  };
  ctx.signal.addEventListener('abort', destroy);

  const widthOf = (el) => Math.max(240, Math.floor(el.clientWidth));
  async function refresh() {
    const stats = await api(`/apps/${encodeURIComponent(appId)}/stats`, { query: { minutes }, signal: ctx.signal });
    problem.replaceChildren();
    destroy();
    for (const p of Object.values(panels)) p.plot.replaceChildren();
    plots = [
      runsChart(uPlot, panels.runs.plot, stats, widthOf(panels.runs.plot)),
      durationChart(uPlot, panels.duration.plot, stats, widthOf(panels.duration.plot)),
      replicasChart(uPlot, panels.replicas.plot, stats, widthOf(panels.replicas.plot)),
    ];
    const text = summaries(stats);
    panels.runs.summary.textContent = text.runs;
    panels.duration.summary.textContent = text.duration;
    panels.replicas.summary.textContent = text.replicas;
  }

  const resize = new ResizeObserver(() => {
    for (const [i, key] of ['runs', 'duration', 'replicas'].entries()) {
      const plot = plots[i];
      if (plot) plot.setSize({ width: widthOf(panels[key].plot), height: plot.height });
    }
  });
  resize.observe(ctx.main);
  ctx.signal.addEventListener('abort', () => resize.disconnect());

  windowSelect.addEventListener('change', () => {
    minutes = windowSelect.value;
    ctx.setQuery({ minutes });
    refresh().catch((err) => problem.replaceChildren(errorBox(err)));
  });
  try {
    await refresh();
  } catch (err) {
    problem.replaceChildren(errorBox(err));
  }
  ctx.every(10_000, () => refresh().catch((err) => problem.replaceChildren(errorBox(err))));
}
