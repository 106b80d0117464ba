// The minimal host of docs/TYPESCRIPT.md, run against a fresh database as the two roles.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { freshDatabase } from './helpers.js';
import { minimalHost } from './minimal-host.js';

test('the documented minimal host migrates, pushes and pulls', async () => {
  const fx = await freshDatabase('minimal_host');
  const url = (user: string) => {
    const u = new URL(process.env.SYNCULAR_TS_PG ?? 'postgres://postgres@127.0.0.1:55490/postgres');
    u.pathname = `/${fx.database}`;
    u.username = user;
    return u.toString();
  };
  try {
    assert.deepEqual(await minimalHost(url('ts_adapter_migrator'), url('ts_adapter_server')), [1]);
    // A second run replays: nothing new is appended.
    assert.deepEqual(await minimalHost(url('ts_adapter_migrator'), url('ts_adapter_server')), [1]);
  } finally {
    await fx.close();
  }
});
