/**
 * NATS for tests: the machine's JetStream server (FERRY_TEST_NATS_URL, default 127.0.0.1:4222), a
 * nats-server of a test's own that it may stop and start again (random loopback port, its own store
 * folder), removal of everything a test's cluster name made, and an object-store object corrupted as a
 * NATS disk could corrupt it.
 */
import assert from 'node:assert/strict';
import { type ChildProcess, spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import net from 'node:net';
import { jetstreamManager } from '@nats-io/jetstream';
import type { ObjectStore } from '@nats-io/obj';
import { connect, type NatsConnection } from '@nats-io/transport-node';
import { tempDir, waitFor } from './ferry.js';

export const NATS_URL = process.env.FERRY_TEST_NATS_URL ?? 'nats://127.0.0.1:4222';
const NATS_BIN = process.env.FERRY_TEST_NATS_SERVER ?? '/usr/sbin/nats-server';

export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.once('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address() as net.AddressInfo;
      srv.close(() => resolve(port));
    });
  });
}

export interface OwnNats {
  url: string;
  start(): Promise<void>;
  /** SIGKILLs the server (its store folder stays, so a start brings back its streams). */
  stop(): Promise<void>;
  /** SIGSTOPs the server: its connections stay open and silent, as a frozen or partitioned NATS's would. */
  freeze(): void;
  /** SIGCONTs it. */
  thaw(): void;
  /** Stops it and removes its store folder. */
  destroy(): Promise<void>;
}

/** Whether a NATS server answers at 127.0.0.1:port: it greets every client with an `INFO` line at once. */
function natsAnswers(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const s = net.connect(port, '127.0.0.1');
    const done = (ok: boolean) => {
      clearTimeout(timer);
      s.destroy();
      resolve(ok);
    };
    const timer = setTimeout(() => done(false), 2_000);
    s.once('data', (d: Buffer) => done(d.subarray(0, 4).toString('latin1') === 'INFO'));
    s.once('error', () => done(false));
  });
}

/**
 * A nats-server of this test's own, which it may stop and start again (same port, same store folder).
 * Its port is chosen free, but another process may take it before the server binds it: a start checks
 * that the server it spawned is the one answering, and fails saying so otherwise (never talks to a stranger).
 */
export async function ownNats(): Promise<OwnNats> {
  const port = await freePort();
  const storeDir = await tempDir('ferry-nats-');
  let child: ChildProcess | undefined;
  const stop = async () => {
    const c = child;
    child = undefined;
    if (!c || c.exitCode !== null || c.signalCode !== null) return;
    const exited = new Promise((r) => c.once('exit', r));
    c.kill('SIGKILL');
    await exited;
  };
  return {
    url: `nats://127.0.0.1:${port}`,
    async start() {
      const spawned = spawn(NATS_BIN, ['-js', '-a', '127.0.0.1', '-p', String(port), '-sd', storeDir], {
        stdio: 'ignore',
      });
      child = spawned;
      let exited = false;
      spawned.once('exit', () => {
        exited = true;
      });
      await waitFor(
        async () => {
          if (exited) throw new Error(`the test nats-server exited at start (port ${port} taken?)`);
          return (await natsAnswers(port)) || undefined;
        },
        15_000,
        'the test nats-server to listen',
      );
      if (exited) throw new Error(`the test nats-server exited at start (port ${port} taken?)`);
    },
    stop,
    freeze() {
      if (!child || child.exitCode !== null) throw new Error('the test nats-server is not running');
      child.kill('SIGSTOP');
    },
    thaw() {
      child?.kill('SIGCONT');
    },
    async destroy() {
      await stop();
      await fs.rm(storeDir, { recursive: true, force: true });
    },
  };
}

/** Deletes every stream (KV and object-store buckets are streams too) whose name starts with the cluster's. */
export async function deleteClusterStreams(cluster: string, url = NATS_URL): Promise<void> {
  const nc = await connect({ servers: url, timeout: 5_000 });
  try {
    const jsm = await jetstreamManager(nc);
    for await (const name of jsm.streams.names()) {
      if (name.startsWith(cluster) || name.startsWith(`KV_${cluster}`) || name.startsWith(`OBJ_${cluster}`)) {
        await jsm.streams.delete(name);
      }
    }
  } finally {
    await nc.close();
  }
}

/** Replaces the stored bytes of object `name` (same length, one byte flipped), as bit rot on a NATS disk would. */
export async function corruptObject(nc: NatsConnection, os: ObjectStore, bucket: string, name: string): Promise<void> {
  const info = await os.info(name);
  assert.ok(info, `${name} is stored`);
  assert.equal(info.chunks, 1, 'a small object is one chunk');
  const jsm = await jetstreamManager(nc);
  const subject = `$O.${bucket}.C.${info.nuid}`;
  const stored = await jsm.streams.getMessage(`OBJ_${bucket}`, { last_by_subj: subject });
  assert.ok(stored);
  const bytes = Buffer.from(stored.data);
  const middle = Math.floor(bytes.length / 2);
  bytes.writeUInt8((bytes.readUInt8(middle) ^ 0xff) & 0xff, middle);
  await jsm.streams.purge(`OBJ_${bucket}`, { filter: subject });
  const js = jsm.jetstream();
  await js.publish(subject, bytes);
}
