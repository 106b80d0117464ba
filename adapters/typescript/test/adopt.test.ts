// Moving an existing upstream 0.24 database: its tables (written by PostgresServerStorage) are
// adopted into the extension with adopt_legacy_tables, the push schema is stored once, and the
// adapter then serves the same rows, log and idempotency results.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { after, before, test } from 'node:test';

import { encode, freshDatabase, NOW, storageOn, TITLED_TASKS, type Fixture } from './helpers.js';
import { pushCommit } from './push-driver.js';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..', '..', '..', '..');
let fx: Fixture;
before(async () => {
  fx = await freshDatabase('adopt');
});
after(async () => {
  await fx.close();
});

/** The row codec's bytes for three non-NULL strings (bitmap 0x00, then u32 length + UTF-8 each). */
function payloadOf(...values: string[]): Buffer {
  const parts = [Buffer.from([0])];
  for (const v of values) {
    const bytes = Buffer.from(v, 'utf8');
    const len = Buffer.alloc(4);
    len.writeUInt32LE(bytes.length);
    parts.push(len, bytes);
  }
  return Buffer.concat(parts);
}

test('a 0.24 database adopted, then served by the adapter', async () => {
  const db = await fx.admin.connect();
  try {
    // What an upstream 0.24 deployment left behind, in schema legacy: its DDL and one push.
    await db.query('CREATE SCHEMA legacy; SET search_path = legacy');
    await db.query(readFileSync(join(ROOT, 'tests', 'fixtures', 'upstream-0.24-ddl.sql'), 'utf8'));
    const layouts = JSON.stringify({ tasks: [...TITLED_TASKS.tables.get('tasks')!.columns] });
    const payload = payloadOf('t1', 'p1', 'from 0.24');
    await db.query('UPDATE sync_schema_meta SET layouts = $1', [layouts]);
    await db.query("INSERT INTO sync_partitions VALUES ('acme', 1, 0)");
    await db.query("INSERT INTO sync_partition_registry VALUES ('acme', 'epoch-1', false, $1)", [NOW]);
    await db.query("INSERT INTO sync_commits VALUES ('acme', 1, 'dev', 'k1', 'alice', $1, 1)", [NOW]);
    await db.query(
      `INSERT INTO sync_changes VALUES ('acme', 1, 0, 'tasks', 't1', 1, 1, '{"project_id":"p1"}', $1)`,
      [payload],
    );
    await db.query("INSERT INTO sync_change_scopes VALUES ('acme', 'tasks', 'project_id', 'p1', 1)");
    await db.query("INSERT INTO sync_row_scopes VALUES ('acme', 'tasks', 'project_id', 'p1', 't1')");
    await db.query(
      `INSERT INTO tasks("_sync_partition", "_sync_row_id", id, project_id, title, "_sync_server_version", "_sync_scopes", "_sync_payload")
       VALUES ('acme', 't1', 't1', 'p1', 'from 0.24', 1, '{"project_id":"p1"}', $1)`,
      [payload],
    );
    await db.query(
      `INSERT INTO sync_push_results VALUES ('acme', 'dev', 'k1', '{"status":"applied","commitSeq":1,"results":[{"opIndex":0,"status":"applied"}]}')`,
    );
    // The operator's adoption (docs/API.md §14), the sources dropped in the same transaction.
    await db.query('RESET search_path');
    await db.query('BEGIN');
    await db.query("SELECT syncular.adopt_legacy_tables('legacy', 'legacy')");
    const { rows } = await db.query(
      "SELECT tablename FROM pg_tables WHERE schemaname = 'legacy' AND tablename LIKE 'sync\\_%'",
    );
    for (const r of rows) await db.query(`DROP TABLE legacy.${r.tablename as string} CASCADE`);
    await db.query('COMMIT');
    await db.query('GRANT USAGE ON SCHEMA legacy TO ts_adapter_server');
    await db.query('GRANT SELECT, INSERT, UPDATE, DELETE ON legacy.tasks TO ts_adapter_server');
  } finally {
    db.release();
  }

  // Once, as syncular_admin: the codec's push schema at the adopted version.
  await storageOn(fx.migrator, { appSchema: 'legacy' }).setPushSchema(TITLED_TASKS);

  const storage = storageOn(fx.server, { appSchema: 'legacy' });
  await storage.ensureSchema(TITLED_TASKS);
  assert.equal(await storage.getMaxCommitSeq('acme'), 1);
  assert.equal((await storage.getRow('acme', 'tasks', 't1'))?.serverVersion, 1);
  assert.equal((await storage.getPushResult('acme', 'dev', 'k1'))?.commitSeq, 1);
  const replay = await pushCommit(storage, 'acme', 'dev', 'k1', [], { runningSchemaVersion: 1, createdAtMs: NOW });
  assert.equal(replay.outcome, 'cached');
  const next = await encode(fx.server, 'tasks', { id: 't1', project_id: 'p1', title: 'on the extension' });
  const out = await pushCommit(storage, 'acme', 'dev', 'k2', [{ table: 'tasks', rowId: 't1', op: 'upsert', scopes: { project_id: 'p1' }, payload: next }], {
    runningSchemaVersion: 1,
    createdAtMs: NOW + 1,
  });
  assert.equal(out.outcome, 'applied');
  assert.equal(out.result?.commitSeq, 2);
  const window = await storage.readCommitWindow('acme', { table: 'tasks', scopeFilter: { project_id: ['p1'] }, afterSeq: 0, throughSeq: 2, limitChanges: 10 });
  assert.deepEqual(window.map((c) => [c.commitSeq, c.changes[0]?.rowVersion]), [[1, 1], [2, 2]]);
  const title = await fx.admin.query("SELECT title FROM legacy.tasks WHERE _sync_row_id = 't1'");
  assert.equal(title.rows[0].title, 'on the extension');
});
