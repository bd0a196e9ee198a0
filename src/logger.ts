/**
 * Structured JSON logs (pino); human-readable (pino-pretty) when stdout is a terminal.
 */
import { type Logger, pino } from 'pino';

export function createLogger(options: { level?: string; pretty?: boolean } = {}): Logger {
  const pretty = options.pretty ?? (process.stdout.isTTY === true && process.env.FERRY_LOG_FORMAT !== 'json');
  return pino({
    name: 'ferry',
    level: options.level ?? 'info',
    ...(pretty
      ? {
          transport: {
            target: 'pino-pretty',
            options: { colorize: true, translateTime: 'SYS:HH:MM:ss', ignore: 'pid,hostname,name' },
          },
        }
      : {}),
  });
}
