/**
 * The run path's counters and histograms (src/hot-metrics.ts) render exactly as prom-client's own would
 * for the same observations: /metrics must not change when the hot path stops using prom-client's.
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { Counter, Histogram, Registry } from 'prom-client';
import { HotCounter, HotHistogram } from '../src/hot-metrics.js';

function registries() {
  const theirs = new Registry();
  const ours = new Registry();
  for (const r of [theirs, ours]) r.setDefaultLabels({ node: 'n-1', role: 'all' });
  return { theirs, ours };
}

describe('hot metrics', () => {
  it('a counter renders as prom-client renders it, by child and by labels', async () => {
    const { theirs, ours } = registries();
    const options = { name: 'x_total', help: 'things', labelNames: ['app', 'state'] as const };
    const counter = new Counter({ ...options, labelNames: [...options.labelNames], registers: [theirs] });
    const hot = new HotCounter({ ...options, registers: [ours] });
    const child = hot.child('a', 'success');
    for (let i = 0; i < 3; i++) {
      counter.inc({ app: 'a', state: 'success' });
      child.inc();
    }
    counter.inc({ app: 'b', state: 'failure' }, 5);
    hot.inc({ app: 'b', state: 'failure' }, 5);
    assert.equal(await ours.metrics(), await theirs.metrics());
  });

  it('a histogram renders as prom-client renders it, values on bucket bounds included', async () => {
    const { theirs, ours } = registries();
    const options = { name: 'x_seconds', help: 'time', labelNames: ['app'] as const, buckets: [0.01, 0.1, 1] };
    const histogram = new Histogram({ ...options, labelNames: [...options.labelNames], registers: [theirs] });
    const hot = new HotHistogram({ ...options, registers: [ours] });
    const child = hot.child('a');
    for (const v of [0.001, 0.01, 0.05, 0.1, 0.5, 1, 7]) {
      histogram.observe({ app: 'a' }, v);
      child.observe(v);
    }
    histogram.observe({ app: 'b' }, 0.2);
    hot.observe({ app: 'b' }, 0.2);
    assert.equal(await ours.metrics(), await theirs.metrics());
  });

  it('reset forgets every label set', async () => {
    const { ours } = registries();
    const hot = new HotCounter({ name: 'y_total', help: 'h', labelNames: ['app'], registers: [ours] });
    hot.child('a').inc();
    hot.reset();
    assert.doesNotMatch(await ours.metrics(), /^y_total\{/m);
  });
});
