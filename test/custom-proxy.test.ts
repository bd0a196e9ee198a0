/** How a run URL of a custom app is split into what the app's server sees and Ferry's own parameters. */
import assert from 'node:assert/strict';
import { it } from 'node:test';
import { splitRunUrl } from '../src/http/custom-proxy.js';

it('keeps the raw path after the app name and the query less Ferry parameters', () => {
  const split = splitRunUrl('/v4/p-1/app/a%2Fb/c?x=1&async=true&y=two%20words&webhookEndpoint=http%3A%2F%2Fh%2Fw');
  assert.ok(split);
  assert.equal(split.path, '/a%2Fb/c?x=1&y=two%20words');
  assert.equal(split.prefix, '/v4/p-1/app');
  assert.equal(split.params.get('async'), 'true');
  assert.equal(split.params.get('webhookEndpoint'), 'http://h/w');
});

it('maps the bare app path (with or without a slash) to /', () => {
  assert.equal(splitRunUrl('/v4/p/app')?.path, '/');
  assert.equal(splitRunUrl('/v4/p/app/')?.path, '/');
  assert.equal(splitRunUrl('/v4/p/app?q=1')?.path, '/?q=1');
});

it('drops access_token only where asked (WebSocket upgrades)', () => {
  assert.equal(splitRunUrl('/v4/p/app/ws?access_token=t&a=1')?.path, '/ws?access_token=t&a=1');
  const ws = splitRunUrl('/v4/p/app/ws?access_token=t&a=1', new Set(['async', 'webhookEndpoint', 'access_token']));
  assert.equal(ws?.path, '/ws?a=1');
  assert.equal(ws?.params.get('access_token'), 't');
});

it('refuses URLs outside /v4/{project_id}/{app_name}', () => {
  assert.equal(splitRunUrl('/v2/projects'), undefined);
  assert.equal(splitRunUrl('/v4/p'), undefined);
  assert.equal(splitRunUrl('/v4//app'), undefined);
});
