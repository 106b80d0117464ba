// What differs between drivers, met through the suite's executor (SYNCULAR_TS_EXECUTOR): lists
// reach the server as one text parameter every driver sends unchanged, and the SQLSTATE is read
// wherever the driver put it (node-postgres `code`, Bun.SQL `errno`).
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { sqlstate } from '../src/errors.js';
import { StorageConstraintError, StorageQueryError } from '../src/index.js';
import { textArray } from '../src/rows.js';
import type { PgQueryable } from '../src/types.js';
import { encode, EXECUTOR, freshDatabase, sourceFor, storageOn, TITLED_TASKS, type Fixture } from './helpers.js';

let fx: Fixture;
before(async () => {
  fx = await freshDatabase('drivers');
});
after(async () => {
  await fx.close();
});

/** Elements an array literal must quote: separators, braces, quotes, backslashes, NULL, blanks. */
const AWKWARD = ['a,b', '{c}', 'd"e', 'f\\g', 'NULL', '', ' h ', 'ü✓', "i'j"];

test('a list is one text parameter: every element arrives as it was', async () => {
  const source = sourceFor(fx.server) as PgQueryable;
  const { rows } = await source.query<{ a: string[]; n: number }>(
    'SELECT $1::text::text[] AS a, cardinality($1::text::text[]) AS n',
    [textArray(AWKWARD)],
  );
  assert.deepEqual(rows[0]?.a, AWKWARD);
  assert.equal(Number(rows[0]?.n), AWKWARD.length);
  const empty = await source.query<{ a: string[] }>('SELECT $1::text::text[] AS a', [textArray([])]);
  assert.deepEqual(empty.rows[0]?.a, []);
});

test('list-taking methods over the executor: prefetchRows, setBlobRefs, sourceCoverageSeq', async () => {
  await storageOn(fx.migrator).ensureSchema(TITLED_TASKS);
  const storage = storageOn(fx.server);
  await storage.ensureSchema(TITLED_TASKS);
  const id = 'a,b"c\\d';
  const payload = await encode(fx.server, 'tasks', { id, project_id: 'p', title: 't' });
  const tx = await storage.begin('lists');
  await tx.upsertRow('tasks', { rowId: id, serverVersion: 1, scopes: { project_id: 'p' }, payload });
  await tx.setBlobRefs!('tasks', id, AWKWARD.filter((b) => b !== ''));
  await tx.commit();
  const read = await storage.begin('lists');
  await read.prefetchRows!('tasks', [id, ...AWKWARD]);
  assert.equal((await read.getRow('tasks', id))?.rowId, id);
  for (const other of AWKWARD) assert.equal(await read.getRow('tasks', other), undefined);
  await read.rollback();
  assert.deepEqual((await storage.listReferencedBlobIds('lists')).sort(), AWKWARD.filter((b) => b !== '').sort());
  assert.equal(await storageOn(fx.migrator).sourceCoverageSeq('lists', ['tasks', 'a,b']), 0);
});

test("the driver's own error carries the SQLSTATE where sqlstate() reads it", async () => {
  const source = sourceFor(fx.admin) as PgQueryable;
  await source.query('CREATE TABLE IF NOT EXISTS public.uniq (x int UNIQUE)');
  await source.query('INSERT INTO public.uniq VALUES (1)');
  const raw = await source.query('INSERT INTO public.uniq VALUES (1)').then(
    () => assert.fail('the duplicate was inserted'),
    (error: unknown) => error as { code?: unknown; errno?: unknown },
  );
  assert.equal(sqlstate(raw), '23505');
  // Bun.SQL puts its own code in `code` and the SQLSTATE in `errno`; node-postgres `code`.
  if (EXECUTOR === 'bun-sql') assert.deepEqual([raw.code, raw.errno], ['ERR_POSTGRES_SERVER_ERROR', '23505']);
  else assert.equal(raw.code, '23505');
});

test('sqlstate(): code, else errno; nothing for errors that carry none', () => {
  assert.equal(sqlstate({ code: 'SY041' }), 'SY041');
  assert.equal(sqlstate({ code: 'ERR_POSTGRES_SERVER_ERROR', errno: '23502' }), '23502');
  assert.equal(sqlstate({ code: 'ECONNREFUSED', errno: -111 }), undefined);
  assert.equal(sqlstate(new Error('x')), undefined);
  assert.equal(sqlstate(undefined), undefined);
});

test('refusals and class-23 errors map to the error classes through the executor', async () => {
  const storage = storageOn(fx.server);
  await storage.ensureSchema(TITLED_TASKS);
  await assert.rejects(storage.getPartitionLogEpoch(''), (error: unknown) => {
    assert.ok(error instanceof StorageQueryError);
    assert.equal(error.code, 'sync.storage.invalid_argument');
    assert.deepEqual((error as { details?: unknown }).details, { argument: 'partition', reason: 'empty' });
    assert.equal(sqlstate(error.cause), 'SY000');
    return true;
  });
  await fx.admin.query('CREATE UNIQUE INDEX tasks_title_unique ON public.tasks (title)');
  const tx = await storage.begin('violations');
  const first = await encode(fx.server, 'tasks', { id: 'v1', project_id: 'p', title: 'same' });
  const second = await encode(fx.server, 'tasks', { id: 'v2', project_id: 'p', title: 'same' });
  await tx.upsertRow('tasks', { rowId: 'v1', serverVersion: 1, scopes: { project_id: 'p' }, payload: first }, { opIndex: 0 });
  await assert.rejects(
    tx.upsertRow('tasks', { rowId: 'v2', serverVersion: 1, scopes: { project_id: 'p' }, payload: second }, { opIndex: 1 }),
    (error: unknown) => {
      assert.ok(error instanceof StorageConstraintError);
      assert.equal(error.opIndex, 1);
      assert.equal(sqlstate(error.cause), '23505');
      return true;
    },
  );
  await tx.rollback();
});
