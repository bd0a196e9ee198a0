/** `[resources]` in ferry.toml: defaults and validation of cpu, memory and max_processes. */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { AppConfigError, DEFAULT_MAX_PROCESSES, parseAppConfig } from '../src/apps/app-config.js';

const app = '[app]\nname = "a"\n';

describe('ferry.toml [resources]', () => {
  it('defaults to 1 core, 1024 MiB and 256 processes', () => {
    assert.equal(DEFAULT_MAX_PROCESSES, 256);
    assert.deepEqual(parseAppConfig(app).resources, { cpu: 1, memory: 1024, max_processes: 256 });
  });

  it('takes max_processes and a fractional cpu', () => {
    const config = parseAppConfig(`${app}[resources]\ncpu = 0.25\nmemory = 64\nmax_processes = 64\n`);
    assert.deepEqual(config.resources, { cpu: 0.25, memory: 64, max_processes: 64 });
  });

  it('refuses a max_processes that is not an integer from 8 to 32768, naming the key', () => {
    for (const value of ['0', '7', '32769', '2.5', '"many"', '-1']) {
      assert.throws(
        () => parseAppConfig(`${app}[resources]\nmax_processes = ${value}\n`),
        (err: unknown) => err instanceof AppConfigError && err.key === 'resources.max_processes',
        `max_processes = ${value}`,
      );
    }
  });
});
