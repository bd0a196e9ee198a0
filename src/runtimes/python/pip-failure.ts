/**
 * What a failed `pip install` of `requirements.txt` tells the user (issue 43): before, a build said
 * `pip install failed (exit code 1)`, after pip had spent 12 s retrying an index the build sandbox could
 * never reach, and the reason was somewhere in the build log. Now the build fails with a code
 * (FERRY_BUILD_DEPENDENCIES_FAILED), pip's own last error lines, what they most likely mean here, and the
 * docs on shipping wheels (docs/functions.md, "Dependencies").
 *
 * And pip is not left to retry what cannot work: in a build sandbox with loopback only (FERRY_EGRESS=off,
 * or no egress on this machine) no package index over the network can answer, so pip is run with
 * `--retries 0` there (`pipRetryOptions`). What pip retries is a connection; a requirement no index has,
 * a wheel that does not fit or conflicting versions are the app's to fix, and nothing retries them.
 */
import { CodedBuildError } from '../../builds/build-failed.js';
import type { SandboxNetworkMode } from '../../sandbox/network.js';

/** Lines of pip's output kept for the error, from its end. */
export const PIP_TAIL_LINES = 40;
/** pip's `ERROR:` lines the message quotes at most (its conclusion is the last of them). */
const QUOTED_LINES = 6;
/** The longest quoted line; pip's resolver can print very long ones. */
const MAX_QUOTED = 400;
/** Where the docs say how to ship dependencies as wheels. */
export const WHEELS_DOCS = 'docs/functions.md#python ("Dependencies": ship wheels in the app)';

/** What pip prints when it could not connect to an index (urllib3's connection errors, DNS). */
const UNREACHABLE =
  /NewConnectionError|Failed to establish a new connection|Name or service not known|Temporary failure in name resolution|Network is unreachable|ConnectTimeoutError|ProxyError|Connection refused/;
/** pip's words for "no index has a wheel of that requirement for this Python and platform". */
const NOT_FOUND = /No matching distribution found|Could not find a version that satisfies/;

/** pip's options for its connection retries in a sandbox of this network (see the module comment). */
export function pipRetryOptions(network: SandboxNetworkMode): string[] {
  return network === 'none' ? ['--retries', '0'] : [];
}

/**
 * The build's error for a pip that failed: `how` says how it exited (`failed (exit code 1)`), `tail` is
 * the end of its output, `network` the build sandbox's.
 *
 * @example
 *   throw pipFailure('failed (exit code 1)', ['ERROR: No matching distribution found for x==9'], 'veth');
 */
export function pipFailure(how: string, tail: readonly string[], network: SandboxNetworkMode): CodedBuildError {
  const errors = tail.filter((line) => line.startsWith('ERROR:'));
  const quoted = (errors.length > 0 ? errors : tail.filter((line) => line.trim() !== '').slice(-3))
    .slice(-QUOTED_LINES)
    .map((line) => (line.length > MAX_QUOTED ? `${line.slice(0, MAX_QUOTED)}…` : line));
  const text = tail.join('\n');
  const hint =
    network === 'none'
      ? 'The build sandbox has no network (loopback only: FERRY_EGRESS=off, or no egress on this server), so pip reaches no package index: ship the dependencies as wheels in the app.'
      : UNREACHABLE.test(text)
        ? "pip could not reach the package index from the build sandbox: check the server's egress (FERRY_EGRESS_ALLOW, FERRY_EGRESS_DNS) or its PIP_INDEX_URL, or ship the dependencies as wheels in the app."
        : NOT_FOUND.test(text)
          ? "No index pip reaches has a wheel of that requirement for the server's Python and platform (Ferry installs wheels only): check the name and version, or build the wheel yourself and ship it in the app."
          : "pip's whole output is in the build log.";
  const lines = quoted.length > 0 ? `; pip's last lines:\n${quoted.join('\n')}\n` : '. ';
  return new CodedBuildError(
    'FERRY_BUILD_DEPENDENCIES_FAILED',
    `pip install ${how}${lines}${hint} See ${WHEELS_DOCS}.`,
  );
}
