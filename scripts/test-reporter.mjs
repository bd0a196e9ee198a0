// Node's spec reporter, plus the suite's timing: just before the runner's closing summary it prints the
// wall time of the whole run and the ten test files that took longest (each file's top-level tests
// summed), so every CI log records what the suite cost and where. Used by scripts/test.mjs.
import { writeFileSync } from 'node:fs';
import { spec } from 'node:test/reporters';

const started = Date.now();

export default async function* specWithTimes(source) {
  const reporter = new spec();
  const perFile = new Map();
  // When each file's first and last event arrived (its span in the run, start-up and imports included).
  const span = new Map();
  let timesPrinted = false;
  const passThrough = async function* (event) {
    reporter.write(event);
    let chunk = reporter.read();
    while (chunk !== null) {
      yield chunk;
      chunk = reporter.read();
    }
  };
  for await (const event of source) {
    const { type, data } = event;
    if (data?.file) {
      const now = Date.now();
      const seen = span.get(data.file);
      if (seen) seen[1] = now;
      else span.set(data.file, [now, now]);
    }
    if ((type === 'test:pass' || type === 'test:fail') && data.nesting === 0 && data.file) {
      perFile.set(data.file, (perFile.get(data.file) ?? 0) + (data.details?.duration_ms ?? 0));
    }
    // The runner's summary is a run of diagnostics at the end, starting with "tests N".
    if (!timesPrinted && type === 'test:diagnostic' && data.nesting === 0 && /^tests \d+/.test(data.message)) {
      timesPrinted = true;
      const sum = [...perFile.values()].reduce((a, b) => a + b, 0);
      yield `\nsuite wall time: ${((Date.now() - started) / 1000).toFixed(1)} s (the files' own times add up to ${(sum / 1000).toFixed(0)} s over ${perFile.size} files)\nslowest files:\n`;
      const slowest = [...perFile].sort((a, b) => b[1] - a[1]).slice(0, 10);
      for (const [file, ms] of slowest)
        yield `  ${(ms / 1000).toFixed(1).padStart(7)} s  ${file.replace(`${process.cwd()}/`, '')}\n`;
      yield '\n';
      // Every file's figure, slowest first, for comparing two runs (FERRY_TEST_TIMES=<path>).
      if (process.env.FERRY_TEST_TIMES)
        writeFileSync(
          process.env.FERRY_TEST_TIMES,
          [...perFile]
            .sort((a, b) => b[1] - a[1])
            .map(([file, ms]) => {
              const [first, last] = span.get(file) ?? [0, 0];
              return `${(ms / 1000).toFixed(1)}\t${((last - first) / 1000).toFixed(1)}\t${file.replace(`${process.cwd()}/`, '')}\n`;
            })
            .join(''),
        );
    }
    yield* passThrough(event);
  }
  reporter.end();
  let chunk = reporter.read();
  while (chunk !== null) {
    yield chunk;
    chunk = reporter.read();
  }
}
