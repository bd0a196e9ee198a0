/**
 * Counters and histograms for the run path, rendered by prom-client's registry like its own.
 *
 * prom-client turns a labels object into a hash on every `inc` and `observe` (sorting, joining, checking
 * each label): four times per run on the hottest path, a few microseconds of a call that costs a hundred
 * (issue 15). These keep one entry per label set, found once by its values (`child`), and count with plain
 * numbers; the text is made only when /metrics is scraped (`get`, the interface the registry reads).
 */
import type { Registry } from 'prom-client';

interface MetricValue {
  value: number;
  labels: Record<string, string | number>;
  /** Rendered after the registry's default labels (prom-client's histograms put their labels here). */
  sharedLabels?: Record<string, string | number>;
  metricName?: string;
}

/** What the registry reads from a metric (prom-client's MetricObjectWithValues). */
interface Rendered {
  name: string;
  help: string;
  type: 'counter' | 'histogram';
  values: MetricValue[];
  aggregator: 'sum';
}

interface HotMetricOptions<L extends string> {
  name: string;
  help: string;
  labelNames: readonly L[];
  registers: Registry[];
}

abstract class HotMetric<L extends string, E> {
  readonly name: string;
  readonly help: string;
  protected readonly labelNames: readonly L[];
  protected readonly entries = new Map<string, { labels: Record<L, string>; entry: E }>();

  constructor(options: HotMetricOptions<L>) {
    this.name = options.name;
    this.help = options.help;
    this.labelNames = options.labelNames;
    // The registry only needs the name and `get`.
    for (const registry of options.registers) registry.registerMetric(this as never);
  }

  protected abstract fresh(): E;

  /** The entry of these label values (in `labelNames` order), made on first use. */
  protected entryOf(values: readonly string[]): E {
    const key = values.join('\u0000');
    let found = this.entries.get(key);
    if (!found) {
      const labels = {} as Record<L, string>;
      this.labelNames.forEach((name, i) => {
        labels[name] = values[i] ?? '';
      });
      found = { labels, entry: this.fresh() };
      this.entries.set(key, found);
    }
    return found.entry;
  }

  protected valuesOf(labels: Record<L, string>): string[] {
    return this.labelNames.map((name) => labels[name]);
  }

  reset(): void {
    this.entries.clear();
  }

  abstract get(): Promise<Rendered>;
}

/** A counter: `child(...values)` once per label set, then `inc()` on it costs an addition. */
export class HotCounter<L extends string> extends HotMetric<L, { n: number }> {
  protected fresh() {
    return { n: 0 };
  }

  child(...values: string[]): { inc(by?: number): void } {
    const entry = this.entryOf(values);
    return {
      inc(by = 1) {
        entry.n += by;
      },
    };
  }

  inc(labels: Record<L, string>, by = 1): void {
    this.entryOf(this.valuesOf(labels)).n += by;
  }

  async get(): Promise<Rendered> {
    const values: MetricValue[] = [];
    for (const { labels, entry } of this.entries.values()) values.push({ value: entry.n, labels: { ...labels } });
    return { name: this.name, help: this.help, type: 'counter', values, aggregator: 'sum' };
  }
}

interface HistogramEntry {
  /** Observations per bucket (not cumulative); the last one is +Inf. */
  counts: number[];
  sum: number;
  count: number;
}

/** A histogram: `child(...values)` once per label set, then `observe(v)` costs a bucket search. */
export class HotHistogram<L extends string> extends HotMetric<L, HistogramEntry> {
  private readonly buckets: readonly number[];

  constructor(options: HotMetricOptions<L> & { buckets: readonly number[] }) {
    super(options);
    this.buckets = [...options.buckets].sort((a, b) => a - b);
  }

  protected fresh(): HistogramEntry {
    return { counts: new Array<number>(this.buckets.length + 1).fill(0), sum: 0, count: 0 };
  }

  child(...values: string[]): { observe(value: number): void } {
    const entry = this.entryOf(values);
    const { buckets } = this;
    return {
      observe(value) {
        let i = 0;
        while (i < buckets.length && value > buckets[i]!) i++;
        entry.counts[i]! += 1;
        entry.sum += value;
        entry.count += 1;
      },
    };
  }

  observe(labels: Record<L, string>, value: number): void {
    this.child(...this.valuesOf(labels)).observe(value);
  }

  async get(): Promise<Rendered> {
    const values: MetricValue[] = [];
    for (const { labels, entry } of this.entries.values()) {
      // As prom-client lays a histogram out: `le` first, the label set after the registry's defaults.
      const shared = { ...labels };
      const bucket = `${this.name}_bucket`;
      let cumulative = 0;
      this.buckets.forEach((le, i) => {
        cumulative += entry.counts[i]!;
        values.push({ value: cumulative, labels: { le }, sharedLabels: shared, metricName: bucket });
      });
      values.push({ value: entry.count, labels: { le: '+Inf' }, sharedLabels: shared, metricName: bucket });
      values.push({ value: entry.sum, labels: {}, sharedLabels: shared, metricName: `${this.name}_sum` });
      values.push({ value: entry.count, labels: {}, sharedLabels: shared, metricName: `${this.name}_count` });
    }
    return { name: this.name, help: this.help, type: 'histogram', values, aggregator: 'sum' };
  }
}
