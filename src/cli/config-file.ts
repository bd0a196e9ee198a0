/**
 * The CLI's own settings: server URL, token and project, stored by `ferry login` in
 * `$XDG_CONFIG_HOME/ferry/config.json` (default `~/.config/ferry/config.json`) with mode 0600.
 * `FERRY_URL`, `FERRY_TOKEN` and `FERRY_PROJECT` override what the file says.
 */
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

export interface CliSettings {
  url?: string;
  token?: string;
  project?: string;
}

export function configFilePath(env: NodeJS.ProcessEnv = process.env): string {
  const base = env.XDG_CONFIG_HOME || path.join(os.homedir(), '.config');
  return path.join(base, 'ferry', 'config.json');
}

export function readConfigFile(env: NodeJS.ProcessEnv = process.env): CliSettings {
  try {
    const data = JSON.parse(fs.readFileSync(configFilePath(env), 'utf8')) as unknown;
    if (!data || typeof data !== 'object') return {};
    const { url, token, project } = data as Record<string, unknown>;
    return {
      ...(typeof url === 'string' ? { url } : {}),
      ...(typeof token === 'string' ? { token } : {}),
      ...(typeof project === 'string' ? { project } : {}),
    };
  } catch {
    return {};
  }
}

export function writeConfigFile(settings: CliSettings, env: NodeJS.ProcessEnv = process.env): string {
  const file = configFilePath(env);
  fs.mkdirSync(path.dirname(file), { recursive: true, mode: 0o700 });
  const tmp = `${file}.${process.pid}.tmp`;
  fs.writeFileSync(tmp, `${JSON.stringify(settings, null, 2)}\n`, { mode: 0o600 });
  fs.renameSync(tmp, file);
  fs.chmodSync(file, 0o600);
  return file;
}

/** The project id inside a Ferry token (its `prj` claim), read without verifying: the server verifies. */
export function projectOfToken(token: string): string | undefined {
  const payload = token.split('.')[1];
  if (!payload) return undefined;
  try {
    const claims = JSON.parse(Buffer.from(payload, 'base64url').toString('utf8')) as { prj?: unknown };
    return typeof claims.prj === 'string' ? claims.prj : undefined;
  } catch {
    return undefined;
  }
}

/** Settings in force: environment over the config file; the project defaults to the token's. */
export function resolveCliSettings(env: NodeJS.ProcessEnv = process.env): CliSettings {
  const file = readConfigFile(env);
  const url = env.FERRY_URL || file.url || 'http://127.0.0.1:8000';
  const token = env.FERRY_TOKEN || file.token;
  const project = env.FERRY_PROJECT || file.project || (token ? projectOfToken(token) : undefined);
  return { url: url.replace(/\/+$/, ''), ...(token ? { token } : {}), ...(project ? { project } : {}) };
}
