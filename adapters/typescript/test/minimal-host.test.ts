// The minimal host of docs/TYPESCRIPT.md, run against a fresh database as the two roles.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { freshDatabase, urlFor } from './helpers.js';
import { minimalHost } from './minimal-host.js';

test('the documented minimal host migrates, pushes and pulls', async () => {
  const fx = await freshDatabase('minimal_host');
  const url = (user: string) => urlFor(fx.database, user);
  try {
    assert.deepEqual(await minimalHost(url('ts_adapter_migrator'), url('ts_adapter_server')), [1]);
    // A second run replays: nothing new is appended.
    assert.deepEqual(await minimalHost(url('ts_adapter_migrator'), url('ts_adapter_server')), [1]);
  } finally {
    await fx.close();
  }
});
