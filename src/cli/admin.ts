/**
 * `ferry admin bootstrap`: works offline, straight on the data directory (even while `ferry serve` runs
 * on it). Creates the project when it does not exist and a new owner service account with both scopes,
 * and prints its token once.
 */
import path from 'node:path';
import { bootstrapProject } from '../auth/service-accounts.js';
import { resolveServerConfig } from '../config.js';
import { loadOrCreateKey, prepareDataDir } from '../data-dir.js';
import { openSqliteStore } from '../store/index.js';
import { CliError } from './client.js';

export interface BootstrapOptions {
  dataDir?: string;
  projectName: string;
  expiresInDays?: string;
  json?: boolean;
  url?: string;
}

export async function bootstrapCommand(options: BootstrapOptions): Promise<void> {
  const config = resolveServerConfig({ dataDir: options.dataDir });
  const days = options.expiresInDays === undefined ? 365 : Number(options.expiresInDays);
  if (!Number.isInteger(days) || days < 1 || days > 3650)
    throw new CliError('--expires-in-days must be a whole number from 1 to 3650', 2);
  if (!/^[a-z0-9][a-z0-9-]{0,62}$/.test(options.projectName)) {
    throw new CliError('--project-name must use a-z, 0-9 and "-" (at most 63 characters)', 2);
  }
  const dataDir = prepareDataDir(config.dataDir);
  const store = await openSqliteStore({ dataDir: dataDir.root });
  try {
    const key = loadOrCreateKey(path.join(dataDir.keys, 'jwt.key'));
    const { project, created, account, token } = await bootstrapProject(store, key, {
      projectName: options.projectName,
      expiresInDays: days,
    });
    if (options.json) {
      process.stdout.write(`${JSON.stringify({ project_id: project.id, token })}\n`);
      return;
    }
    const url = options.url ?? process.env.FERRY_URL ?? `http://${config.host}:${config.port}`;
    process.stdout.write(
      [
        `${created ? 'Created' : 'Found'} project ${project.name} (${project.id}) in ${dataDir.root}`,
        `New service account ${account.name} (${account.id}), scopes manage and run, expires ${account.expires_at.slice(0, 10)}.`,
        '',
        'Token (shown once, store it as a secret):',
        token,
        '',
        'Use it with:',
        `  export FERRY_URL=${url} FERRY_PROJECT=${project.id} FERRY_TOKEN=${token}`,
        '',
        // The token rides in the URL fragment: browsers never send the fragment to the server (so it is in
        // no request line or access log), and the dashboard moves it to session storage and drops it from
        // the address bar at once.
        'Sign in to the dashboard (this link holds the token; keep it private):',
        `  ${url.replace(/\/+$/, '')}/#token=${token}`,
        '',
      ].join('\n'),
    );
  } finally {
    await store.destroy();
  }
}
