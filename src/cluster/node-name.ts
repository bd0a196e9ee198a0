/**
 * This process's name among the processes sharing a store: `hostname:pid`. Answers that show only what
 * this process saw (the app log, live replica counts) carry it, so a reader behind a load balancer can
 * tell which process answered.
 */
import os from 'node:os';

export const NODE_NAME = `${os.hostname()}:${process.pid}`;
