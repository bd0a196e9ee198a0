/**
 * The worker protocol's shared part (version 1): what a gateway tells a worker about a call, and how it is
 * carried. The worker's listener (http/worker-api.ts) and its client (runs/remote-invoker.ts) both import
 * it from here, so neither depends on the other.
 */
import type { RunMode } from '../store/schema.js';

/** What a gateway tells a worker about a call (the first line of the body, or `x-ferry-call`). */
export interface CallMeta {
  v: 1;
  runId: string;
  projectId: string;
  appId: string;
  buildId: string;
  fn: string;
  mode: RunMode;
  webhookUrl?: string | undefined;
  webhookSecret?: string | undefined;
  /** Custom runtime: the request to forward. */
  http?: { method: string; path: string; headers: Record<string, string | string[]>; hasBody: boolean };
  /** Custom runtime: the run's stored input. */
  input?: string | null;
}

export const INTERNAL_PREFIX = '/internal/v1';
/** The call line is small (ids, a function name, forwarded headers): past this it is refused. */
export const MAX_META_BYTES = 256 * 1024;
const ID = /^[A-Za-z0-9_.:-]{1,200}$/;
const MODES: readonly RunMode[] = ['sync', 'async', 'stream'];

/** The call in `value` when it is well formed; undefined otherwise (a worker trusts the cluster, not bytes). */
export function parseCallMeta(value: unknown): CallMeta | undefined {
  if (typeof value !== 'object' || value === null) return undefined;
  const v = value as Record<string, unknown>;
  const ok = (key: string) => typeof v[key] === 'string' && ID.test(v[key] as string);
  if (v.v !== 1 || !ok('runId') || !ok('projectId') || !ok('appId') || !ok('buildId')) return undefined;
  if (typeof v.fn !== 'string' || v.fn.length === 0 || v.fn.length > 512) return undefined;
  if (!MODES.includes(v.mode as RunMode)) return undefined;
  for (const key of ['webhookUrl', 'webhookSecret']) {
    if (v[key] !== undefined && typeof v[key] !== 'string') return undefined;
  }
  if (v.input !== undefined && v.input !== null && typeof v.input !== 'string') return undefined;
  if (v.http !== undefined) {
    const h = v.http as Record<string, unknown> | null;
    if (!h || typeof h.method !== 'string' || typeof h.path !== 'string' || !h.path.startsWith('/')) return undefined;
    if (typeof h.headers !== 'object' || h.headers === null || typeof h.hasBody !== 'boolean') return undefined;
  }
  return v as unknown as CallMeta;
}

export function encodeHeaderMeta(meta: CallMeta): string {
  return Buffer.from(JSON.stringify(meta)).toString('base64url');
}

export function decodeHeaderMeta(value: string | string[] | undefined): CallMeta | undefined {
  if (typeof value !== 'string' || value.length > MAX_META_BYTES) return undefined;
  return parseCallMeta(JSON.parse(Buffer.from(value, 'base64url').toString('utf8')));
}
