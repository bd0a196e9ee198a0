/**
 * The settings of a fleet (issues 12 and 13) are checked at start, so a typo is an error that says what
 * is wrong, not a failure at the first query or message.
 */
import assert from 'node:assert/strict';
import path from 'node:path';
import { describe, it } from 'node:test';
import { resolveServerConfig } from '../src/config.js';

describe('fleet settings', () => {
  it('defaults: SQLite, keys and artifacts in the data dir, no NATS, cluster "ferry", a 10 s lease', () => {
    const config = resolveServerConfig({ dataDir: '/srv/ferry' }, {});
    assert.equal(config.databaseUrl, undefined);
    assert.equal(config.keysDir, path.resolve('/srv/ferry/keys'));
    assert.equal(config.artifactsDir, path.resolve('/srv/ferry/artifacts'));
    assert.equal(config.natsUrl, undefined);
    assert.equal(config.clusterName, 'ferry');
    assert.equal(config.leaseMs, 10_000);
  });

  it('flags win over the environment', () => {
    const config = resolveServerConfig(
      { dataDir: '/d', databaseUrl: 'postgres://a@db/x', keysDir: '/k', natsUrl: 'nats://n:4222', clusterName: 'blue' },
      {
        FERRY_DATABASE_URL: 'postgres://b@db/y',
        FERRY_KEYS_DIR: '/other',
        FERRY_NATS_URL: 'nats://m:4222',
        FERRY_CLUSTER_NAME: 'green',
      },
    );
    assert.deepEqual(
      [config.databaseUrl, config.keysDir, config.natsUrl, config.clusterName],
      ['postgres://a@db/x', '/k', 'nats://n:4222', 'blue'],
    );
  });

  it('refuses what cannot work, naming the setting', () => {
    const bad: Array<[NodeJS.ProcessEnv, RegExp]> = [
      [{ FERRY_DATABASE_URL: 'mysql://db/x' }, /--database-url \/ FERRY_DATABASE_URL must start with postgres:\/\//],
      [{ FERRY_DATABASE_URL: 'not a url' }, /--database-url \/ FERRY_DATABASE_URL must be a URL/],
      [{ FERRY_NATS_URL: 'http://n:4222' }, /--nats-url \/ FERRY_NATS_URL must start with nats:\/\//],
      [{ FERRY_NATS_URL: 'nats://a:4222, ::' }, /--nats-url \/ FERRY_NATS_URL must be URLs/],
      [{ FERRY_CLUSTER_NAME: 'a.b' }, /--cluster-name \/ FERRY_CLUSTER_NAME must be 1 to 32/],
      [{ FERRY_CLUSTER_NAME: 'x'.repeat(33) }, /--cluster-name/],
      [{ FERRY_LEASE_SECONDS: '1' }, /FERRY_LEASE_SECONDS must be a whole number from 2 to 3600/],
    ];
    for (const [env, message] of bad) assert.throws(() => resolveServerConfig({ dataDir: '/d' }, env), message);
    // Several NATS servers are fine.
    assert.equal(
      resolveServerConfig({ dataDir: '/d' }, { FERRY_NATS_URL: 'nats://a:4222,tls://b:4222' }).natsUrl,
      'nats://a:4222,tls://b:4222',
    );
  });
});
