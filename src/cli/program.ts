/**
 * The `ferry` command tree, declared without running anything: `index.ts` parses the command line with
 * it, and a test walks it (every command has a description, every command that prints a result takes
 * `--json`).
 *
 * Output convention for `--json`: an array for a list, an object for one thing, and NDJSON (one object per
 * line) only while following (`--follow`); messages about progress go to stderr.
 */
import { Command, Option } from 'commander';

/**
 * A command's action, its module loaded only when the command runs: `ferry runs list` does not load the
 * server (`serve` alone loads Fastify, Kysely, both store drivers, NATS and the sandbox code: about a
 * second of CPU at every start of the CLI when every command was imported up front).
 */
function lazy<M, K extends keyof M>(load: () => Promise<M>, name: K): (...args: unknown[]) => Promise<void> {
  return async function lazyAction(...args: unknown[]) {
    const action = (await load())[name] as (...args: unknown[]) => unknown;
    await action(...args);
  };
}

export function createProgram(): Command {
  const program = new Command('ferry')
    .description('Ferry: self-hosted function hosting')
    .version('0.1.0')
    .showHelpAfterError()
    .configureOutput({ outputError: (text, write) => write(text) });

  program
    .command('serve')
    .description('run the Ferry server (embedded default: SQLite and local disk, no other server needed)')
    .addOption(new Option('--host <host>', 'address to listen on (env FERRY_HOST, default 127.0.0.1)'))
    .addOption(new Option('--port <port>', 'port to listen on (env FERRY_PORT, default 8000)'))
    .addOption(
      new Option(
        '--run-port <port>',
        "a second port serving only the run endpoint, so apps answer on an origin apart from the dashboard's (env FERRY_RUN_PORT)",
      ),
    )
    .addOption(
      new Option(
        '--run-url <url>',
        'the run endpoint as callers reach it, e.g. https://run.example.com, shown by the CLI and dashboard (env FERRY_RUN_URL)',
      ),
    )
    .addOption(new Option('--data-dir <dir>', 'data directory (env FERRY_DATA_DIR, default ./.ferry)'))
    .addOption(databaseUrlOption())
    .addOption(keysDirOption())
    .addOption(
      new Option(
        '--artifacts-dir <dir>',
        'uploaded archives and build outputs, shareable by several servers (env FERRY_ARTIFACTS_DIR, default <data-dir>/artifacts)',
      ),
    )
    .addOption(
      new Option(
        '--nats-url <urls>',
        'NATS with JetStream for a cluster, e.g. nats://127.0.0.1:4222: archives and build outputs in its object store (env FERRY_NATS_URL)',
      ),
    )
    .addOption(
      new Option(
        '--cluster-name <name>',
        'prefix of every NATS stream, bucket and subject, so clusters can share a NATS server (env FERRY_CLUSTER_NAME, default ferry)',
      ),
    )
    .addOption(
      new Option(
        '--role <role>',
        'gateway (public interface, runs no user code), worker (builds and replicas behind an internal listener on --port) or all (env FERRY_ROLE, default all)',
      ),
    )
    .addOption(
      new Option(
        '--advertise-url <url>',
        'where the other nodes of the cluster reach this one (env FERRY_ADVERTISE_URL, default http://<host>:<port>)',
      ),
    )
    .addOption(
      new Option(
        '--webhook-allow <cidrs>',
        'comma-separated CIDRs webhooks may reach although internal, e.g. 127.0.0.0/8,::1/128 (env FERRY_WEBHOOK_ALLOW)',
      ),
    )
    .addOption(
      new Option(
        '--egress-allow <cidrs>',
        'comma-separated CIDRs sandboxes may reach although denied by default, e.g. 10.20.0.0/16 (env FERRY_EGRESS_ALLOW)',
      ),
    )
    .addOption(
      new Option(
        '--egress-deny <cidrs>',
        'comma-separated CIDRs sandboxes may never reach; wins over --egress-allow (env FERRY_EGRESS_DENY)',
      ),
    )
    .action(lazy(() => import('./serve.js'), 'serveCommand'));

  program
    .command('doctor')
    .description(
      'check what this machine gives replicas: sandbox (bubblewrap), memory limits, runtimes; and the cluster as the configured server sees it',
    )
    .option('--json', 'print the capabilities (and "cluster", "cluster_problem") as JSON')
    .action(lazy(() => import('./doctor.js'), 'doctorCommand'));

  program
    .command('cluster')
    .description('the Ferry processes (nodes) sharing the server’s store: role, version, address, load, replicas')
    .option('--json', 'print the GET /v2/cluster answer: {"node","nodes","expired"}')
    .action(lazy(() => import('./cluster.js'), 'clusterCommand'));

  const admin = program.command('admin').description('offline administration on a data directory');
  const dataDirOption = () => new Option('--data-dir <dir>', 'data directory (env FERRY_DATA_DIR, default ./.ferry)');
  const addressOptions = (command: Command) =>
    command
      .option(
        '--url <url>',
        'the server address to print (default: the server running on the data directory, else FERRY_URL, else FERRY_HOST:FERRY_PORT)',
      )
      .option('--host <host>', 'the configured host, when no server runs on the data directory (env FERRY_HOST)')
      .option('--port <port>', 'the configured port, when no server runs on the data directory (env FERRY_PORT)');
  addressOptions(
    admin
      .command('bootstrap')
      .description('create the project (if missing) and a new owner token; works without a running server')
      .addOption(dataDirOption())
      .addOption(databaseUrlOption())
      .addOption(keysDirOption())
      .option('--project-name <name>', 'project name', 'default')
      .option('--expires-in-days <days>', 'token lifetime in days (default 365)')
      .option('--json', 'print {"project_id", "token"} only'),
  ).action(lazy(() => import('./admin.js'), 'bootstrapCommand'));
  addressOptions(
    admin
      .command('login-link')
      .description(
        'print a dashboard sign-in link for an existing project, without making another owner or account (a short-lived manage session of its owner)',
      )
      .addOption(dataDirOption())
      .addOption(databaseUrlOption())
      .addOption(keysDirOption())
      .option('--project-name <name>', 'project name', 'default')
      .option('--expires-in-minutes <minutes>', 'how long the link works, 5 to 1440 (default 60)')
      .option('--json', 'print {"project_id","service_account_id","url","link","expires_at"}'),
  ).action(lazy(() => import('./admin.js'), 'loginLinkCommand'));

  program
    .command('login')
    .description('store the server URL and a token in your config file (mode 0600)')
    .option('--url <url>', 'server URL (default http://127.0.0.1:8000)')
    .option('--token <token>', 'service account token')
    .option('--project <project_id>', 'project id (default: the token’s project)')
    .option('--json', 'print {"url","project_id","project_name","config_file"}')
    .action(lazy(() => import('./resources.js'), 'loginCommand'));

  program
    .command('deploy [dir]')
    .description('pack, upload and build the app in DIR (default: the current folder)')
    .option(
      '--json',
      'print only {"project_id","app_id","app_name","build_id","status","run_url","function_urls"} on stdout',
    )
    .action(lazy(() => import('./deploy.js'), 'deployCommand'));

  const apps = program.command('apps').description('apps of the project');
  apps
    .command('list')
    .description('apps with their state and run URL')
    .option('--json', 'print an array')
    .action(lazy(() => import('./resources.js'), 'appsListCommand'));
  apps
    .command('delete <app>')
    .description('delete an app with its builds and run history (asks first unless --yes)')
    .option('-y, --yes', 'do not ask')
    .option('--json', 'print what was deleted')
    .action(lazy(() => import('./resources.js'), 'appsDeleteCommand'));
  apps
    .command('scale <app>')
    .description("change an app's scaling now, without a build (overrides ferry.toml until --reset)")
    .option('--min <n>', 'min_replicas')
    .option('--max <n>', 'max_replicas')
    .option('--concurrency <n>', 'replica_concurrency (replaces the replicas, as a deploy does)')
    .option('--cooldown <seconds>', 'cooldown')
    .option('--grace <seconds>', 'response_grace_period')
    .option('--reset', "clear what was set here: the active build's ferry.toml applies again")
    .option('--json', 'print the app')
    .action(lazy(() => import('./resources.js'), 'appsScaleCommand'));

  const builds = program.command('builds').description('builds of an app');
  builds
    .command('list <app>')
    .description('builds of an app, newest first, with their state and error')
    .option('--limit <n>', 'how many (default 50)')
    .option('--json', 'print an array')
    .action(lazy(() => import('./resources.js'), 'buildsListCommand'));
  builds
    .command('logs <build_id>')
    .description('the log of a build (live with --follow)')
    .option('--app <app>', "the build's app (found automatically when omitted)")
    .option('-f, --follow', 'follow the log live until the build ends')
    .option('--json', 'print an array of lines (with --follow: one JSON object per line)')
    .action(lazy(() => import('./resources.js'), 'buildsLogsCommand'));
  builds
    .command('files <build_id>')
    .description('list the files of the build’s uploaded archive')
    .option('--app <app>', "the build's app (found automatically when omitted)")
    .option('--json', 'print the zip-contents response as JSON')
    .action(lazy(() => import('./resources.js'), 'buildsFilesCommand'));
  builds
    .command('cancel <build_id>')
    .description('cancel a build that is pending or building')
    .option('--app <app>', "the build's app (found automatically when omitted)")
    .option('--json', 'print the build')
    .action(lazy(() => import('./resources.js'), 'buildsCancelCommand'));
  builds
    .command('delete <build_id>')
    .description('delete a build and its files (not the active build)')
    .option('--app <app>', "the build's app (found automatically when omitted)")
    .option('--json', 'print {"build_id","deleted"}')
    .action(lazy(() => import('./resources.js'), 'buildsDeleteCommand'));
  builds
    .command('activate <build_id>')
    .description('make an earlier ready build the active one (roll back to it)')
    .option('--app <app>', "the build's app (found automatically when omitted)")
    .option('--json', 'print the build')
    .action(lazy(() => import('./resources.js'), 'buildsActivateCommand'));

  program
    .command('rollback <app>')
    .description('activate the ready build before the active one')
    .option('--json', 'print {"app","from","to"}')
    .action(lazy(() => import('./resources.js'), 'rollbackCommand'));

  program
    .command('run <app> [function]')
    .description('call a function (default: run) and print its result; --stream, --async, --webhook')
    .option(
      '-d, --data <json|@file|->',
      'the arguments: a JSON object, @file to read it from a file, - from stdin',
      '{}',
    )
    .option('--stream', "print each item's text as the function yields it, one line per item")
    .option('--sse', 'with --stream: print the raw server-sent event lines')
    .option('--async', 'start the run and print its id at once (with --json: the 202 body)')
    .option('--wait', 'with --async: wait for the run to end and print its result')
    .option('--webhook <url>', 'POST the result there; signed with FERRY_WEBHOOK_SECRET or --webhook-secret-stdin')
    .option(
      '--webhook-secret-stdin',
      'read the webhook signing secret from standard input (never from the command line)',
    )
    .option('--idempotency-key <key>', 'with --async: a repeat with the same key answers the first run')
    .option('--json', 'print the whole response')
    .addHelpText(
      'after',
      `
Examples:
  $ ferry run hello -d '{"name":"Ada"}'
  $ echo '{"name":"Ada"}' | ferry run hello -d -
  $ ferry run counter count --stream
  $ ferry run hello --async --wait
  $ FERRY_WEBHOOK_SECRET=s3cret ferry run hello --async --webhook https://example.com/hook

The exit code is 0 when the run succeeded, 1 when it failed, 2 for bad flags.`,
    )
    .action(lazy(() => import('./run-call.js'), 'runCommand'));

  const runs = program.command('runs').description('runs of an app');
  runs
    .command('list <app>')
    .description('runs of an app, newest first')
    .option('--state <state>', 'only runs in this state (queued, running, success, failure, timeout, cancelled)')
    .option('--mode <mode>', 'only runs of this mode (sync, async, stream)')
    .option('--dead', 'only runs that ended after exhausting their [retries] attempts')
    .option('--limit <n>', 'how many (default 50)')
    .option('--json', 'print an array')
    .action(lazy(() => import('./runs.js'), 'runsListCommand'));
  runs
    .command('get <app> <run_id>')
    .description('a run with its input and result')
    .option('--json', 'print the run as JSON (what it prints anyway; accepted for scripts)')
    .option('--wait [seconds]', 'wait until the run has ended, at most this long (default 60; up to 3600)')
    .action(lazy(() => import('./runs.js'), 'runsGetCommand'));
  runs
    .command('cancel <app> <run_id>')
    .description('cancel a queued or running run')
    .option('--json', 'print the run')
    .action(lazy(() => import('./runs.js'), 'runsCancelCommand'));
  runs
    .command('retry <app> <run_id>')
    .description('run a finished run again, with its stored input, as a new async run')
    .option('--json', 'print {"run_id"}')
    .action(lazy(() => import('./runs.js'), 'runsRetryCommand'));
  runs
    .command('logs <app> <run_id>')
    .description('what the function printed during the run')
    .option('--json', 'print an array of lines')
    .action(lazy(() => import('./runs.js'), 'runsLogsCommand'));

  program
    .command('logs <app>')
    .description('the app log: what its replicas print outside runs, and their starts and crashes')
    .option('-f, --follow', 'keep printing new lines until interrupted')
    .option('--json', 'print an array of lines (with --follow: one JSON object per line)')
    .action(lazy(() => import('./runs.js'), 'appLogsCommand'));

  const schedules = program
    .command('schedules')
    .description('runs started on a timetable: the [[schedules]] of apps’ active builds');
  schedules
    .command('list [app]')
    .description('schedules of an app (or of every app), with the next tick and the last run')
    .option('--json', 'print an array')
    .action(lazy(() => import('./schedules.js'), 'schedulesListCommand'));
  schedules
    .command('pause <app> <name>')
    .description('stop a schedule’s ticks until it is resumed (a new deploy keeps it paused)')
    .option('--json', 'print the schedule')
    .action(lazy(() => import('./schedules.js'), 'schedulesPauseCommand'));
  schedules
    .command('resume <app> <name>')
    .description('start a paused schedule again from its next tick (the ticks it missed do not run)')
    .option('--json', 'print the schedule')
    .action(lazy(() => import('./schedules.js'), 'schedulesResumeCommand'));
  schedules
    .command('trigger <app> <name>')
    .description('start one run of the schedule now, as its tick would')
    .option('--json', 'print {"run_id"}')
    .action(lazy(() => import('./schedules.js'), 'schedulesTriggerCommand'));

  const secrets = program
    .command('secrets')
    .description('secrets of the project, given to new replicas as environment variables');
  secrets
    .command('set <name> [value]')
    .description('create or replace a secret; without VALUE, or with -, the value is read from stdin')
    .option('--json', 'print the secret’s metadata as JSON')
    .action(lazy(() => import('./secrets.js'), 'secretsSetCommand'));
  secrets
    .command('list')
    .description('names of the secrets, with when they were set (never their values)')
    .option('--json', 'print an array')
    .action(lazy(() => import('./secrets.js'), 'secretsListCommand'));
  secrets
    .command('delete <name>')
    .description('delete a secret')
    .option('--json', 'print {"name","deleted"}')
    .action(lazy(() => import('./secrets.js'), 'secretsDeleteCommand'));

  const registries = program
    .command('registries')
    .description('the project’s logins to private registries, sent by its builds’ pulls (and no other project’s)');
  registries
    .command('login <registry>')
    .description(
      'log the project in to a registry (host[:port] as image references name it); the password is read from stdin',
    )
    .option('--username <username>', 'the account')
    .option('--password-stdin', 'read the password (or token) from stdin')
    .option('--json', 'print the login (never its password) as JSON')
    .action(lazy(() => import('./registries.js'), 'registriesLoginCommand'));
  registries
    .command('list')
    .description('the registries the project is logged in to, with the username (never the password)')
    .option('--json', 'print an array')
    .action(lazy(() => import('./registries.js'), 'registriesListCommand'));
  registries
    .command('logout <registry>')
    .description('delete the project’s login for a registry')
    .option('--json', 'print {"registry","deleted"}')
    .action(lazy(() => import('./registries.js'), 'registriesLogoutCommand'));

  const volumes = program
    .command('volumes')
    .description('volumes of the project: persistent folders mounted in apps ([[volumes]] in ferry.toml)');
  volumes
    .command('create <name>')
    .description('create a volume of the given size')
    .requiredOption('--size <size>', 'its size, e.g. 512MiB, 20GiB, 1TiB (writes past it fail with ENOSPC)')
    .option('--json', 'print the volume as JSON')
    .action(lazy(() => import('./volumes.js'), 'volumesCreateCommand'));
  volumes
    .command('list')
    .description('the volumes, with their size, use and the apps mounting them')
    .option('--json', 'print an array')
    .action(lazy(() => import('./volumes.js'), 'volumesListCommand'));
  volumes
    .command('ls <ref>')
    .description('list a folder of a volume: NAME or NAME:PATH')
    .option('--json', 'print the listing')
    .action(lazy(() => import('./volumes.js'), 'volumesLsCommand'));
  volumes
    .command('cp <from> <to>')
    .description(
      'copy a file or folder (recursively) to a volume (cp LOCAL NAME:PATH) or from one (cp NAME:PATH LOCAL), streamed, with a progress bar; an interrupted copy leaves whole files only',
    )
    .option('--skip-existing', 'skip files already at the destination with the same size (resume a copy)')
    .option('--json', 'print what was copied')
    .action(lazy(() => import('./volumes.js'), 'volumesCpCommand'));
  volumes
    .command('rm <ref>')
    .description('remove a file or empty folder of a volume, NAME:PATH')
    .option('-r, --recursive', 'remove a folder and all in it')
    .option('--json', 'print {"volume","path","deleted"}')
    .action(lazy(() => import('./volumes.js'), 'volumesRmCommand'));
  volumes
    .command('delete <name>')
    .description('delete a volume and its files, freeing its space (refused while a deployed app mounts it)')
    .option('--force', 'delete even while a deployed app mounts it')
    .option('--json', 'print {"name","deleted"}')
    .action(lazy(() => import('./volumes.js'), 'volumesDeleteCommand'));

  const tokens = program.command('tokens').description('service accounts and their tokens');
  tokens
    .command('create <name>')
    .description('create a service account; its token is shown once')
    .option('--expires <date>', 'expiry date, e.g. 2027-01-31 (default: 30 days)')
    .addOption(new Option('--scope <scope...>', 'scopes (default: manage run)').choices(['manage', 'run']))
    .option('--json', 'print the account with its token')
    .action(lazy(() => import('./resources.js'), 'tokensCreateCommand'));
  tokens
    .command('list')
    .description('service accounts with their name, scopes, status and creation time (never their tokens)')
    .option('--json', 'print an array')
    .action(lazy(() => import('./resources.js'), 'tokensListCommand'));
  tokens
    .command('revoke <service_account_id>')
    .description('revoke a service account and its token, at once')
    .option('--json', 'print the revoked account')
    .action(lazy(() => import('./resources.js'), 'tokensRevokeCommand'));
  return program;
}

/** `--database-url`: the store on PostgreSQL (serve and the offline admin commands take the same). */
function databaseUrlOption(): Option {
  return new Option(
    '--database-url <url>',
    'PostgreSQL store, e.g. postgres://ferry@db:5432/ferry (env FERRY_DATABASE_URL; default: SQLite in the data directory)',
  );
}

/** `--keys-dir`: the signing and secrets keys, one folder shared by every server of a fleet. */
function keysDirOption(): Option {
  return new Option('--keys-dir <dir>', 'JWT and secrets keys (env FERRY_KEYS_DIR, default <data-dir>/keys)');
}
