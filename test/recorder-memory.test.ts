/**
 * What the recorder keeps in memory: runs inserted with insertNow (async runs; on a gateway of a cluster,
 * runs another node performs) are not held after their commit, and a run's record goes once its end is
 * written. A real SQLite store.
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { uuidv7 } from '../src/ids.js';
import { createLogger } from '../src/logger.js';
import { endRun } from '../src/runs/lifecycle.js';
import { createRunRecorder, newRunRow } from '../src/runs/recorder.js';
import { openSqliteStore } from '../src/store/index.js';
import { tempDir } from './helpers/ferry.js';

describe('the recorder’s memory', () => {
  it('keeps nothing of runs inserted at once and never changed here, nor of runs that ended', async () => {
    const store = await openSqliteStore({ dataDir: await tempDir() });
    const logger = createLogger({ level: 'warn', pretty: false, destination: { write: () => {} } });
    const recorder = createRunRecorder({ store, logger });
    try {
      const build = { projectId: 'p', appId: 'a', buildId: 'b' };
      const accepted = await Promise.all(
        Array.from({ length: 100 }, () =>
          recorder.insertNow(newRunRow({ id: uuidv7(), build, fn: 'run', mode: 'async', input: '{}' })),
        ),
      );
      assert.equal(new Set(accepted).size, 100);
      await recorder.flush();
      assert.equal(recorder.pendingRuns(), 0, 'accepted runs another node performs are not held');

      // A run this node performs is held while it runs, and forgotten once its end is written.
      const [first] = accepted as [string];
      recorder.update(first, { state: 'running', started_at: new Date().toISOString() });
      await recorder.flush();
      assert.equal(recorder.pendingRuns(), 1);
      recorder.finish(
        endRun(
          { id: first, webhookUrl: null },
          { kind: 'answered', statusCode: 200, runTimeMs: 1, result: { stored: null } },
        ),
      );
      await recorder.flush();
      assert.equal(recorder.pendingRuns(), 0);
      const row = await store.selectFrom('runs').select(['state']).where('id', '=', first).executeTakeFirstOrThrow();
      assert.equal(row.state, 'success');
    } finally {
      await recorder.close();
      await store.destroy();
    }
  });
});
