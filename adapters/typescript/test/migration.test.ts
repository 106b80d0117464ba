// ensureSchema across versions: appended columns (payloads re-encoded by migrate_schema), the declared
// index set rebuilt, materialization switched on (projection backfilled with decode_row), a table
// retired; and a second migrator that lost the race skipping its DDL.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';

import type { CompiledSchema, CompiledTable, RowColumn } from '../src/types.js';
import { encode, freshDatabase, NOW, storageOn, type Fixture } from './helpers.js';
import { pushCommit } from './push-driver.js';

let fx: Fixture;
before(async () => {
  fx = await freshDatabase('migration');
});
after(async () => {
  await fx.close();
});

const base: RowColumn[] = [
  { name: 'id', type: 'string', nullable: false },
  { name: 'project_id', type: 'string', nullable: false },
  { name: 'title', type: 'string', nullable: true },
];

function t(name: string, columns: RowColumn[], materialize: boolean, indexes: CompiledTable['indexes'] = []): CompiledTable {
  return { name, columns, primaryKeyIndex: 0, scopePatterns: [{ variable: 'project_id', column: 'project_id' }], indexes, materialize };
}

function schema(version: number, tables: CompiledTable[]): CompiledSchema {
  return { version, tables: new Map(tables.map((x) => [x.name, x])) };
}

const V1 = schema(1, [
  t('items', base, true, [{ name: 'by_title', columns: ['title'] }]),
  t('docs', base, false),
  t('old', base, true),
]);
const moreColumns: RowColumn[] = [...base, ...Array.from({ length: 7 }, (_, i): RowColumn => ({ name: `c${i}`, type: 'integer', nullable: true }))];
const V2 = schema(2, [
  t('items', moreColumns, true, [{ name: 'by_c0', columns: ['c0'], unique: false }]),
  t('docs', base, true),
]);

async function indexes(table: string): Promise<string[]> {
  const { rows } = await fx.admin.query(
    "SELECT indexname FROM pg_indexes WHERE schemaname = 'public' AND tablename = $1 AND indexname LIKE 'sync_ix_%' ORDER BY 1",
    [table],
  );
  return rows.map((r) => r.indexname as string);
}

test('a version bump: payloads re-encoded, indexes rebuilt, materialization backfilled, a table retired', async () => {
  const v1 = storageOn(fx.migrator);
  await v1.ensureSchema(V1);
  assert.deepEqual(await indexes('items'), ['sync_ix_by_title']);
  const server1 = storageOn(fx.server);
  await server1.ensureSchema(V1);
  const item = await encode(fx.server, 'items', { id: 'i1', project_id: 'p', title: 'first' });
  const doc = await encode(fx.server, 'docs', { id: 'd1', project_id: 'p', title: 'a doc' });
  const out = await pushCommit(
    server1,
    'm',
    'c',
    'k1',
    [
      { table: 'items', rowId: 'i1', op: 'upsert', scopes: { project_id: 'p' }, payload: item },
      { table: 'docs', rowId: 'd1', op: 'upsert', scopes: { project_id: 'p' }, payload: doc },
    ],
    { runningSchemaVersion: 1, createdAtMs: NOW },
  );
  assert.equal(out.outcome, 'applied');

  // Two migrators race; the loser's migrate_schema answers the new version and it skips its DDL.
  const [a, b] = [storageOn(fx.migrator), storageOn(fx.migrator)];
  await Promise.all([a.ensureSchema(V2), b.ensureSchema(V2)]);

  assert.deepEqual(await indexes('items'), ['sync_ix_by_c0'], 'the declared set replaces the old one');
  const decoded = await fx.admin.query("SELECT syncular.decode_row('items', _sync_payload) AS v FROM public.items");
  assert.deepEqual(decoded.rows[0].v, { id: 'i1', project_id: 'p', title: 'first', c0: null, c1: null, c2: null, c3: null, c4: null, c5: null, c6: null });
  const projected = await fx.admin.query('SELECT title FROM public.docs');
  assert.deepEqual(projected.rows, [{ title: 'a doc' }], 'materialization switched on: backfilled from the payload');
  const old = await fx.admin.query("SELECT to_regclass('public.old') AS r, syncular.list_tables() AS t");
  assert.equal(old.rows[0].r, null);
  assert.deepEqual((old.rows[0].t as { table: string }[]).map((x) => x.table).sort(), ['docs', 'items']);

  const server2 = storageOn(fx.server);
  await server2.ensureSchema(V2);
  const stored = await server2.getRow('m', 'items', 'i1');
  assert.equal(stored?.serverVersion, 1);
  const scan = await server2.scanRowsByIndex('m', { table: 'items', index: 'by_c0', values: [null], limit: 10 });
  assert.deepEqual(scan.map((r) => r.rowId), ['i1']);
  const i2 = await encode(fx.server, 'items', { id: 'i2', project_id: 'p', title: 'second', c0: 5, c1: null, c2: null, c3: null, c4: null, c5: null, c6: null });
  const pushed = await pushCommit(server2, 'm', 'c', 'k2', [{ table: 'items', rowId: 'i2', op: 'upsert', scopes: { project_id: 'p' }, payload: i2 }], {
    runningSchemaVersion: 2,
    createdAtMs: NOW,
  });
  assert.equal(pushed.outcome, 'applied');
  const byC0 = await server2.scanRowsByIndex('m', { table: 'items', index: 'by_c0', values: [5], limit: 10 });
  assert.deepEqual(byC0.map((r) => r.rowId), ['i2']);
});

test('a layout change that is not an append of nullable columns is refused', async () => {
  const V3 = schema(3, [
    t('items', [...moreColumns.slice(0, 3), { name: 'c0', type: 'string', nullable: true }, ...moreColumns.slice(4)], true),
    t('docs', base, true),
  ]);
  // migrate_schema refuses it (upstream's append-only rule): the retyped column named.
  await assert.rejects(storageOn(fx.migrator).ensureSchema(V3), (error: { code?: string; details?: unknown }) => {
    assert.equal(error.code, 'sync.storage.invalid_argument');
    assert.deepEqual(error.details, { argument: 'layouts.items[3]', reason: 'changed' });
    return true;
  });
  const state = await fx.admin.query('SELECT syncular.schema_state() AS s');
  assert.equal(state.rows[0].s.schemaVersion, 2, 'the migration rolled back whole');
});

test("an appended NOT NULL column is refused by the migration, in upstream's words", async () => {
  const V3 = schema(3, [t('items', [...moreColumns, { name: 'required_new', type: 'string', nullable: false }], true), t('docs', base, true)]);
  // Upstream's readiness check (storage_migration phase) and its hosts match this sentence.
  await assert.rejects(storageOn(fx.migrator).ensureSchema(V3), (error: Error & { code?: string; details?: unknown }) => {
    assert.equal(
      error.message,
      'table "items": added column "required_new" must be nullable — existing rows have no value to backfill',
    );
    assert.equal(error.code, 'sync.storage.invalid_argument');
    assert.deepEqual(error.details, { argument: 'layouts.items[10].nullable', reason: 'not_nullable' });
    return true;
  });
  const removed = schema(3, [t('items', base, true), t('docs', base, true)]);
  await assert.rejects(storageOn(fx.migrator).ensureSchema(removed), {
    message: 'table "items": the schema removed columns — only appending nullable columns is supported; indexes may be created, replaced, or dropped independently',
  });
  const state = await fx.admin.query('SELECT syncular.schema_state() AS s');
  assert.equal(state.rows[0].s.schemaVersion, 2, 'nothing was migrated');
});
