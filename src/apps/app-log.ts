/**
 * The app log: what an app's replicas print outside any run (a custom server's whole output, a Python
 * module's import-time prints) and what happened to them (ready, crashed, restarted), per app.
 *
 * Kept in memory, the newest lines per app (FERRY_APP_LOG_LINES), and lost on restart: the server's own
 * log (pino, component `replica-output`) has the same lines for operators who keep logs. Run output is not
 * here: each run has its own logs.
 */

export interface AppLogLine {
  /** Increases by one per line of this app; `after` pages with it. */
  seq: number;
  at: string;
  replica: string;
  stream: 'stdout' | 'stderr' | 'system';
  line: string;
}

export interface AppLog {
  append(projectId: string, appId: string, replica: string, stream: AppLogLine['stream'], line: string): void;
  /** Lines with `seq > after`, oldest first, at most `limit`. */
  read(projectId: string, appId: string, after: number, limit: number): AppLogLine[];
}

/** Longest line kept; longer ones are cut with a note. */
const MAX_LINE_CHARS = 8192;

export function createAppLog(options: { linesPerApp: number }): AppLog {
  const logs = new Map<string, { next: number; lines: AppLogLine[] }>();
  return {
    append(projectId, appId, replica, stream, line) {
      const key = `${projectId}/${appId}`;
      let log = logs.get(key);
      if (!log) {
        log = { next: 1, lines: [] };
        logs.set(key, log);
      }
      const text = line.length > MAX_LINE_CHARS ? `${line.slice(0, MAX_LINE_CHARS)} [line cut]` : line;
      log.lines.push({ seq: log.next++, at: new Date().toISOString(), replica, stream, line: text });
      // Trim in batches, so a busy app does not shift the array on every line.
      if (log.lines.length > options.linesPerApp * 1.25) log.lines.splice(0, log.lines.length - options.linesPerApp);
    },
    read(projectId, appId, after, limit) {
      const lines = logs.get(`${projectId}/${appId}`)?.lines ?? [];
      // seq is dense, so the first line wanted is found by arithmetic rather than a scan.
      const first = lines[0]?.seq ?? 1;
      const start = Math.max(0, after + 1 - first);
      return lines.slice(start, start + limit);
    },
  };
}
