/**
 * The `ferry` command line. One function per command lives beside this file; this file only declares
 * the commands and turns a `CliError` into one readable line and an exit code.
 */
import { Command, Option } from 'commander';
import { bootstrapCommand } from './admin.js';
import { CliError } from './client.js';
import { deployCommand } from './deploy.js';
import { doctorCommand } from './doctor.js';
import {
  appsListCommand,
  buildsCancelCommand,
  buildsFilesCommand,
  buildsListCommand,
  buildsLogsCommand,
  loginCommand,
  tokensCreateCommand,
  tokensListCommand,
  tokensRevokeCommand,
} from './resources.js';
import { appLogsCommand, runCommand, runsGetCommand, runsListCommand, runsLogsCommand } from './runs.js';
import { secretsDeleteCommand, secretsListCommand, secretsSetCommand } from './secrets.js';
import { serveCommand } from './serve.js';

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
  .addOption(new Option('--data-dir <dir>', 'data directory (env FERRY_DATA_DIR, default ./.ferry)'))
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
  .action(serveCommand);

program
  .command('doctor')
  .description('check what this machine gives replicas: sandbox (bubblewrap), memory limits, runtimes')
  .option('--json', 'print the capabilities as JSON')
  .action(doctorCommand);

const admin = program.command('admin').description('offline administration on a data directory');
admin
  .command('bootstrap')
  .description('create the project (if missing) and a new owner token; works without a running server')
  .option('--data-dir <dir>', 'data directory (env FERRY_DATA_DIR, default ./.ferry)')
  .option('--project-name <name>', 'project name', 'default')
  .option('--expires-in-days <days>', 'token lifetime in days (default 365)')
  .option('--json', 'print {"project_id", "token"} only')
  .action(bootstrapCommand);

program
  .command('login')
  .description('store the server URL and a token in your config file (mode 0600)')
  .option('--url <url>', 'server URL (default http://127.0.0.1:8000)')
  .option('--token <token>', 'service account token')
  .option('--project <project_id>', 'project id (default: the token’s project)')
  .action(loginCommand);

program
  .command('deploy [dir]')
  .description('pack, upload and build the app in DIR (default: the current folder)')
  .option('--json', 'print only {"project_id","app_id","app_name","build_id","status","run_url"} on stdout')
  .action(deployCommand);

const apps = program.command('apps').description('apps of the project');
apps.command('list').option('--json', 'print JSON').action(appsListCommand);

const builds = program.command('builds').description('builds of an app');
builds
  .command('list <app>')
  .option('--limit <n>', 'how many (default 50)')
  .option('--json', 'print JSON')
  .action(buildsListCommand);
builds
  .command('logs <build_id>')
  .option('--app <app>', "the build's app (found automatically when omitted)")
  .option('-f, --follow', 'follow the log live until the build ends')
  .action(buildsLogsCommand);
builds
  .command('files <build_id>')
  .description('list the files of the build’s uploaded archive')
  .option('--app <app>', "the build's app (found automatically when omitted)")
  .option('--json', 'print the zip-contents response as JSON')
  .action(buildsFilesCommand);
builds.command('cancel <build_id>').option('--app <app>', "the build's app").action(buildsCancelCommand);

program
  .command('run <app> [function]')
  .description('call a function synchronously (default function: run) and print its result')
  .option('-d, --data <json>', 'the arguments, as a JSON object', '{}')
  .option('--json', 'print the whole response')
  .action(runCommand);

const runs = program.command('runs').description('runs of an app');
runs
  .command('list <app>')
  .option('--state <state>', 'only runs in this state (queued, running, success, failure, timeout, cancelled)')
  .option('--mode <mode>', 'only runs of this mode (sync, async, stream)')
  .option('--limit <n>', 'how many (default 50)')
  .option('--json', 'print JSON')
  .action(runsListCommand);
runs.command('get <app> <run_id>').description('a run with its input and result, as JSON').action(runsGetCommand);
runs.command('logs <app> <run_id>').description('what the function printed during the run').action(runsLogsCommand);

program
  .command('logs <app>')
  .description('the app log: what its replicas print outside runs, and their starts and crashes')
  .option('-f, --follow', 'keep printing new lines until interrupted')
  .option('--json', 'print one JSON object per line')
  .action(appLogsCommand);

const secrets = program
  .command('secrets')
  .description('secrets of the project, given to new replicas as environment variables');
secrets
  .command('set <name> [value]')
  .description('create or replace a secret; without VALUE, or with -, the value is read from stdin')
  .option('--json', 'print the secret’s metadata as JSON')
  .action(secretsSetCommand);
secrets.command('list').option('--json', 'print JSON').action(secretsListCommand);
secrets.command('delete <name>').action(secretsDeleteCommand);

const tokens = program.command('tokens').description('service accounts and their tokens');
tokens
  .command('create <name>')
  .option('--expires <date>', 'expiry date, e.g. 2027-01-31 (default: 30 days)')
  .addOption(new Option('--scope <scope...>', 'scopes (default: manage run)').choices(['manage', 'run']))
  .option('--json', 'print JSON')
  .action(tokensCreateCommand);
tokens.command('list').option('--json', 'print JSON').action(tokensListCommand);
tokens.command('revoke <service_account_id>').action(tokensRevokeCommand);

try {
  await program.parseAsync(process.argv);
} catch (err) {
  if (err instanceof CliError) {
    process.stderr.write(`ferry: ${err.message}\n`);
    process.exit(err.exitCode);
  }
  const message = err instanceof Error ? err.message : String(err);
  process.stderr.write(`ferry: unexpected error: ${message}\n`);
  if (process.env.FERRY_DEBUG) console.error(err);
  process.exit(1);
}
