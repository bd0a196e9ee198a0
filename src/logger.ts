/**
 * Structured JSON logs (pino); human-readable (pino-pretty) when stdout is a terminal.
 */
import { type DestinationStream, type Logger, pino } from 'pino';

export function createLogger(
  options: { level?: string; pretty?: boolean; destination?: DestinationStream } = {},
): Logger {
  const pretty = options.pretty ?? (process.stdout.isTTY === true && process.env.FERRY_LOG_FORMAT !== 'json');
  const settings = {
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
  };
  // A destination (tests capture the log with one) writes plain JSON lines, never through pino-pretty.
  return options.destination ? pino({ ...settings, transport: undefined }, options.destination) : pino(settings);
}
