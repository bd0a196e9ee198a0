/**
 * Where the run endpoint is (`{run_url}` of the interface), as the management API tells its callers: the
 * CLI prints it after a deploy and the dashboard shows it, so both follow an operator who serves tenants'
 * apps on an origin apart from the dashboard's (FERRY_RUN_PORT, FERRY_RUN_URL; docs/operations.md, "Two
 * origins").
 *
 * - `FERRY_RUN_URL` set: that, as written (the address behind the operator's proxy).
 * - `FERRY_RUN_PORT` alone: the caller's own host name (its `Host`) with the run listener's port, on the
 *   caller's scheme: right when callers reach Ferry directly; behind a proxy, set FERRY_RUN_URL.
 * - Neither: null, "at the management API's own address". Clients keep the address they already use (the
 *   CLI's FERRY_URL with any path, the dashboard's own origin), as before the setting existed: a proxy
 *   that rewrites `Host` would make a derived one wrong.
 */
import type { ServerConfig } from '../config.js';

/** A `Host` name Ferry may echo into an address: a DNS name, IPv4, or a bracketed IPv6 address. */
const HOST_NAME = /^(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.?|\[[0-9A-Fa-f:.]+\])$/;

export interface RunAddress {
  /** Tells the run listener's port once it listens (FERRY_RUN_PORT may be 0, a free port). */
  listening(port: number): void;
  /** `{run_url}` for a caller of the management API; null when it is that API's own address. */
  forRequest(request: { protocol: string; hostname: string }): string | null;
}

export function createRunAddress(config: Pick<ServerConfig, 'host' | 'runPort' | 'runUrl'>): RunAddress {
  let port = config.runPort;
  /** The listen address, for a caller whose `Host` cannot be used (absent, or not a host name). */
  const fallbackHost = (() => {
    if (config.host === '0.0.0.0' || config.host === '') return '127.0.0.1';
    if (config.host === '::') return '[::1]';
    return config.host.includes(':') ? `[${config.host}]` : config.host;
  })();
  return {
    listening(bound) {
      port = bound;
    },
    forRequest(request) {
      if (config.runUrl) return config.runUrl;
      if (port === undefined) return null;
      const host = HOST_NAME.test(request.hostname) ? request.hostname : fallbackHost;
      return `${request.protocol === 'https' ? 'https' : 'http'}://${host}:${port}`;
    },
  };
}
