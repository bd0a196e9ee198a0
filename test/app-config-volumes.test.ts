/** `[[volumes]]` in ferry.toml (issue 27): defaults, normalized mounts, and each refusal naming its key. */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { AppConfigError, parseAppConfig, volumesOf } from '../src/apps/app-config.js';

const app = (volumes: string) => `[app]\nname = "a"\n\n${volumes}`;

describe('[[volumes]] in ferry.toml', () => {
  it('defaults to none, read_only to false, and normalizes the mount', () => {
    assert.deepEqual(parseAppConfig(app('')).volumes, []);
    assert.deepEqual(volumesOf(undefined), []);
    assert.deepEqual(volumesOf({} as never), [], 'a config stored before volumes existed has none');
    const config = parseAppConfig(
      app(
        '[[volumes]]\nname = "models"\nmount = "/models//llm/"\n\n[[volumes]]\nname = "cache"\nmount = "/cache"\nread_only = true\n',
      ),
    );
    assert.deepEqual(config.volumes, [
      { name: 'models', mount: '/models/llm', read_only: false },
      { name: 'cache', mount: '/cache', read_only: true },
    ]);
  });

  for (const [mount, why] of [
    ['/', /must not be \//],
    ['/tmp', /\/tmp/],
    ['/tmp/x', /\/tmp/],
    ['/proc/self', /\/proc/],
    ['/dev', /\/dev/],
    ['/run/ferry', /\/run/],
    ['/app', /\/app/],
    ['/app/data', /\/app/],
    ['/a/../etc', /"\." or "\.\."/],
    ['relative', /volumes\.0\.mount/],
  ] as const) {
    it(`refuses mount = "${mount}"`, () => {
      assert.throws(
        () => parseAppConfig(app(`[[volumes]]\nname = "v"\nmount = "${mount}"\n`)),
        (err: unknown) => err instanceof AppConfigError && why.test(err.message) && err.key === 'volumes.0.mount',
      );
    });
  }

  it('refuses overlapping mounts, a volume mounted twice, bad names and unknown keys', () => {
    assert.throws(
      () => parseAppConfig(app('[[volumes]]\nname = "a"\nmount = "/d"\n\n[[volumes]]\nname = "b"\nmount = "/d/x"\n')),
      /volumes\.1\.mount: \/d\/x overlaps the mount of volume "a"/,
    );
    assert.throws(
      () => parseAppConfig(app('[[volumes]]\nname = "a"\nmount = "/d"\n\n[[volumes]]\nname = "a"\nmount = "/e"\n')),
      /volumes\.1\.name: volume "a" is mounted twice/,
    );
    assert.throws(() => parseAppConfig(app('[[volumes]]\nname = "Bad"\nmount = "/d"\n')), /volumes\.0\.name/);
    assert.throws(
      () => parseAppConfig(app('[[volumes]]\nname = "a"\nmount = "/d"\nsize = 3\n')),
      /volumes\.0\.size: is not a known key/,
    );
  });
});
