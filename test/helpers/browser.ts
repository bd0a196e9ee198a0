/**
 * Debian's Chromium for the dashboard's browser tests, in a network namespace of the test's own, reaching
 * the server under test through a forwarder on its link. In the host's namespace every sandbox start and
 * stop (of any test file running alongside) adds or removes a veth, and Chromium aborts the requests it
 * has in flight with ERR_NETWORK_CHANGED when it sees interfaces change: seen in test/dashboard.test.ts,
 * and in test/dashboard-problems.test.ts, whose every test then waited in vain for its first heading
 * because the page's modules never loaded. Needs root, ip and Chromium (scripts/setup-system.sh).
 */
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { type Browser, chromium } from 'playwright-core';
import { createOutsideNetwork, forwardTcp } from './netns.js';

export const CHROMIUM = '/usr/bin/chromium';

export interface ApartBrowser {
  browser: Browser;
  /** The server's address as Chromium reaches it (`http://<link address>:<port>`). */
  site: string;
  close(): Promise<void>;
}

/**
 * Launches Chromium in a namespace of its own, with `serverUrl`'s server reachable at `site`. The site's
 * address is not loopback there: Chromium is told to trust it as it trusts loopback (a secure context, as
 * the dashboard is on localhost or behind HTTPS), so the page behaves as it does for a user.
 */
export async function launchChromiumApart(serverUrl: string): Promise<ApartBrowser> {
  if (!fs.existsSync(CHROMIUM)) {
    throw new Error(
      `${CHROMIUM} is missing: the dashboard tests need Debian's Chromium. Install it with ` +
        '`sudo apt-get install -y chromium` (scripts/setup-system.sh does this on CI).',
    );
  }
  const outside = await createOutsideNetwork();
  const folder = fs.mkdtempSync(path.join(os.tmpdir(), 'ferry-chromium-'));
  let forward: Awaited<ReturnType<typeof forwardTcp>> | undefined;
  let browser: Browser | undefined;
  const close = async () => {
    await browser?.close();
    await forward?.close();
    await outside.close();
    fs.rmSync(folder, { recursive: true, force: true });
  };
  try {
    forward = await forwardTcp(outside.hostAddress, Number(new URL(serverUrl).port));
    const site = `http://${outside.hostAddress}:${forward.port}`;
    const launcher = path.join(folder, 'chromium');
    fs.writeFileSync(launcher, `#!/bin/sh\nexec ip netns exec ${outside.name} ${CHROMIUM} "$@"\n`, { mode: 0o755 });
    browser = await chromium.launch({
      executablePath: launcher,
      args: [
        '--headless',
        '--no-sandbox',
        '--disable-gpu',
        '--disable-background-networking',
        '--disable-component-update',
        '--disable-sync',
        '--no-first-run',
        `--unsafely-treat-insecure-origin-as-secure=${site}`,
      ],
    });
    return { browser, site, close };
  } catch (err) {
    await close();
    throw err;
  }
}
