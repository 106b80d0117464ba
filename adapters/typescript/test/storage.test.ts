// SyncularServerStorage against a real PostgreSQL with the extension: every method of upstream's
// 0.24 ServerStorage / StorageTransaction, as the syncular_host role serves and the
// syncular_admin role migrates. SYNCULAR_TS_PG names the cluster (a database per file is created).
import assert from 'node:assert/strict';
import { after, afterEach, before, describe, test } from 'node:test';
import { SyncularServerStorage, StorageConstraintError, StorageQueryError, SyncError } from '../src/index.js';
import type { ServerStorage, StorageTransaction } from '../src/types.js';
import { countingStorage, encode, EXECUTOR, freshDatabase, NOW, schemaV, storageOn, task, uuid, type Fixture, type StatementCounter } from './helpers.js';
import { pushCommit } from './push-driver.js';

// The structural check of the issue: the class is assignable to upstream's interfaces.
const _assignable: (s: SyncularServerStorage) => ServerStorage = (s) => s;
void _assignable;

let fx: Fixture;
let migrator: SyncularServerStorage;
let server: SyncularServerStorage;
let counter: StatementCounter;
const P = 'acme';
const V1 = schemaV(1);
const scopes = (project: string) => ({ project_id: project });

async function expectCode(promise: Promise<unknown>, cls: new (...args: never[]) => Error, code: string) {
  await assert.rejects(promise, (error: unknown) => {
    assert.ok(error instanceof cls, `expected ${cls.name}, got ${String(error)}`);
    assert.equal((error as { code?: string }).code, code);
    return true;
  });
}

/** Where upstream's compiler would say the relation `table` sits in `sql` (after FROM). */
function relation(sql: string, table: string): { table: string; start: number; end: number } {
  const start = sql.indexOf(`FROM ${table}`) + 5;
  return { table, start, end: start + table.length };
}

/** Statements `fn` sent through the counting storage. */
async function sent<T>(fn: () => Promise<T>): Promise<{ value: T; n: number; statements: string[] }> {
  const { value, statements } = await counter.count(fn);
  return { value, n: statements.length, statements };
}

before(async () => {
  fx = await freshDatabase('storage');
  migrator = storageOn(fx.migrator);
  ({ storage: server, counter } = countingStorage(fx.server));
});

after(async () => {
  await fx.close();
});

/** Transactions a failed assertion left open are rolled back, so they hold no lock. */
const openTxs: StorageTransaction[] = [];
async function begin(storage: ServerStorage, partition: string): Promise<StorageTransaction> {
  const tx = await storage.begin(partition);
  openTxs.push(tx);
  return tx;
}
afterEach(async () => {
  for (const tx of openTxs.splice(0)) await tx.rollback();
});

describe('schema', () => {
  test('migrate() checks that the extension is installed', async () => {
    await migrator.migrate();
    const bare = storageOn(fx.admin);
    await fx.admin.query('CREATE SCHEMA IF NOT EXISTS other');
    await bare.migrate(); // the extension is database-wide
  });

  test('ensureSchema migrates once: tables, indexes, registration, push schema', async () => {
    await migrator.ensureSchema(V1);
    const tables = await fx.admin.query("SELECT syncular.list_tables() AS t");
    const names = (tables.rows[0].t as { table: string }[]).map((t) => t.table).sort();
    assert.deepEqual(names, ['notes', 'tasks']);
    const cols = await fx.admin.query(
      "SELECT attname FROM pg_attribute WHERE attrelid = 'public.notes'::regclass AND attnum > 0 ORDER BY attnum",
    );
    assert.deepEqual(
      cols.rows.map((r) => r.attname),
      ['_sync_partition', '_sync_row_id', '_sync_server_version', '_sync_scopes', '_sync_payload', '_sync_column_versions'],
      'a non-materialized table keeps only the meta columns',
    );
    const idx = await fx.admin.query("SELECT indexdef FROM pg_indexes WHERE indexname = 'sync_ix_tasks_by_title'");
    assert.match(idx.rows[0].indexdef, /\(_sync_partition, title\)/);
    const state = await fx.admin.query('SELECT syncular.schema_state() AS s');
    assert.equal(state.rows[0].s.schemaVersion, 1);
  });

  test('the serving role: ensureSchema at the stored version is check_schema + one layout read', async () => {
    const { n, statements } = await sent(() => server.ensureSchema(V1));
    assert.equal(n, 2, statements.join('\n'));
    assert.match(statements[0]!, /check_schema/);
    const again = await sent(() => server.ensureSchema(V1));
    assert.equal(again.n, 0, 'memoized per instance');
  });

  test('different layouts at the stored version are refused (sync.storage.stored_layout_mismatch)', async () => {
    const other = storageOn(fx.server);
    await expectCode(
      other.ensureSchema(schemaV(1, [{ name: 'extra', type: 'string', nullable: true }])),
      StorageQueryError,
      'sync.storage.stored_layout_mismatch',
    );
  });

  test('the physical layout check: a relation missing a materialized column is refused', async () => {
    await fx.admin.query('ALTER TABLE public.tasks RENAME COLUMN score TO score_old');
    try {
      const other = storageOn(fx.server);
      await assert.rejects(other.ensureSchema(V1), (e: unknown) => {
        assert.ok(e instanceof StorageQueryError);
        assert.equal(e.code, 'sync.storage.stored_layout_mismatch');
        assert.deepEqual((e as unknown as { details: unknown }).details, { table: 'tasks', column: 'score' });
        return true;
      });
    } finally {
      await fx.admin.query('ALTER TABLE public.tasks RENAME COLUMN score_old TO score');
    }
  });

  test('a serving role that would have to migrate is told which role it needs', async () => {
    await assert.rejects(storageOn(fx.server).ensureSchema(schemaV(7)), /needs a role in syncular_admin/);
    const state = await fx.admin.query('SELECT syncular.schema_state() AS s');
    assert.equal(state.rows[0].s.schemaVersion, 1, 'nothing migrated');
  });

  test('row operations before ensureSchema throw', async () => {
    const fresh = storageOn(fx.server);
    await assert.rejects(fresh.getRow(P, 'tasks', 'x'), /ensureSchema/);
  });
});

describe('partitions and registry', () => {
  test('touchPartition keeps the first epoch; rotate sets a new one and requires it', async () => {
    const { value: entry, n } = await sent(() => server.touchPartition(P, NOW, 'epoch-1'));
    assert.equal(n, 1);
    assert.deepEqual(entry, { partition: P, logEpoch: 'epoch-1', epochRequired: false, lastAuthenticatedAtMs: NOW });
    const again = await server.touchPartition(P, NOW + 1, 'epoch-other');
    assert.equal(again.logEpoch, 'epoch-1');
    assert.equal(again.lastAuthenticatedAtMs, NOW + 1);
    assert.equal(await server.getPartitionLogEpoch(P), 'epoch-1');
    assert.equal(await server.getPartitionLogEpoch('nobody'), undefined);
    await server.touchPartition('b-part', NOW, 'e');
    const rotated = await migrator.rotatePartitionLogEpoch('b-part', 'e2', NOW + 5);
    assert.deepEqual(rotated, { partition: 'b-part', logEpoch: 'e2', epochRequired: true, lastAuthenticatedAtMs: NOW + 5 });
    const registry = await migrator.listPartitionRegistry();
    assert.deepEqual(registry.map((r) => r.partition), ['acme', 'b-part']);
    assert.deepEqual(await server.listPartitions(), ['acme', 'b-part']);
  });

  test('empty epoch is refused with a storage error', async () => {
    await assert.rejects(server.touchPartition(P, NOW, ''), StorageQueryError);
  });
});

describe('push transaction', () => {
  test('a push through the driver: one statement per storage call, rows projected by the extension codec', async () => {
    const payload = await encode(fx.server, 'tasks', task('t1', 'p1', 'write', { n: 7, score: 1.5, done: true, meta: '{"k": 1}', data: 'AAEC' }));
    const { value, statements } = await sent(() =>
      pushCommit(server, P, 'c1', 'k1', [{ table: 'tasks', rowId: 't1', op: 'upsert', scopes: scopes('p1'), payload }], {
        runningSchemaVersion: 1,
        createdAtMs: NOW,
      }),
    );
    assert.equal(value.outcome, 'applied');
    assert.equal(value.result?.commitSeq, 1);
    // getPushResult, BEGIN, lock + SAVEPOINT, gate, re-check, getRow, tombstone, clear, upsert, append, result, COMMIT
    assert.equal(statements.length, 13, statements.join('\n'));
    const row = await fx.admin.query('SELECT id, project_id, title, n, score, done, meta, data FROM public.tasks WHERE _sync_row_id = $1', ['t1']);
    assert.deepEqual(row.rows[0], { id: 't1', project_id: 'p1', title: 'write', n: '7', score: 1.5, done: true, meta: { k: 1 }, data: Buffer.from([0, 1, 2]) });
    const scopeRows = await fx.admin.query("SELECT syncular.get_row_scopes('acme', 'tasks', 't1') AS s");
    assert.deepEqual(scopeRows.rows[0].s, { serverVersion: 1, scopes: { project_id: 'p1' } });
  });

  test('typed projection of every column type, including NaN, NULLs and large integers', async () => {
    const tx = await begin(server, P);
    const rows: [string, Record<string, unknown>, Record<string, unknown>][] = [
      ['ty1', { n: 9007199254740991, score: 'NaN', done: false, meta: '[1, {"a": null}]', data: '' }, { n: '9007199254740991', score: NaN, done: false, meta: [1, { a: null }], data: Buffer.alloc(0) }],
      ['ty2', { n: -1, score: '-Infinity', done: null, meta: null, data: null }, { n: '-1', score: -Infinity, done: null, meta: null, data: null }],
      ['ty3', { title: null, score: 0.1 }, { title: null, score: 0.1 }],
    ];
    for (const [id, values] of rows) {
      const payload = await encode(fx.server, 'tasks', task(id, 'p3', 'typed', values));
      await tx.upsertRow('tasks', { rowId: id, serverVersion: 1, scopes: scopes('p3'), payload });
    }
    // The rows are not committed: read the projection inside the transaction.
    const sql = "SELECT id, n, score, done, meta, data, title FROM tasks WHERE project_id = 'p3' ORDER BY id";
    const check = await tx.queryAuthoritative!({
      plan: { sql, relations: [relation(sql, 'tasks')] },
      params: [],
      tables: ['tasks'],
    });
    for (const [i, [id, , expected]] of rows.entries()) {
      const row = check.rows[i]!;
      assert.equal(row.id, id);
      for (const [column, value] of Object.entries(expected)) assert.deepEqual(row[column], value, `${id}.${column}`);
    }
    await tx.rollback();
  });

  test('getRow / getTombstoneSeq / clearTombstone / deleteRow / prefetchRows', async () => {
    const tx = await begin(server, P);
    try {
      await tx.lockPartitionForPush!();
      const stored = await tx.getRow('tasks', 't1');
      assert.equal(stored?.serverVersion, 1);
      assert.deepEqual(stored?.scopes, { project_id: 'p1' });
      assert.ok(stored?.payload instanceof Uint8Array);
      assert.equal('columnVersions' in (stored ?? {}), false, 'optional key absent');
      assert.equal(await tx.getRow('tasks', 'missing'), undefined);
      assert.equal(await tx.getTombstoneSeq('tasks', 't1'), undefined);
      await tx.deleteRow('tasks', 't1');
      assert.equal(await tx.getRow('tasks', 't1'), undefined, 'reads its own writes');
      const seq = await tx.appendCommit({
        clientId: 'c1', clientCommitId: 'k-del', actorId: 'a', createdAtMs: NOW,
        changes: [{ table: 'tasks', rowId: 't1', op: 'delete', scopes: scopes('p1') }],
      });
      assert.equal(seq, 2);
      assert.equal(await tx.getTombstoneSeq('tasks', 't1'), 2);
      const { n } = await sent(() => tx.prefetchRows!('tasks', ['t1', 'zz', 't1']));
      assert.equal(n, 1, 'one statement for rows and tombstones');
      const { value: cached, n: n2 } = await sent(async () => [await tx.getRow('tasks', 'zz'), await tx.getTombstoneSeq('tasks', 't1')]);
      assert.deepEqual(cached, [undefined, 2]);
      assert.equal(n2, 0, 'answered from the prefetch');
      await tx.clearTombstone('tasks', 't1');
      assert.equal(await tx.getTombstoneSeq('tasks', 't1'), undefined);
      await tx.rollback();
    } finally {
      await tx.rollback();
    }
    assert.equal(await server.getMaxCommitSeq(P), 1, 'rollback discards the append');
  });

  test('rejection finalization: candidate writes discarded, result stored, no commit_seq consumed', async () => {
    const ok = await encode(fx.server, 'tasks', task('t5', 'p1', 'fine'));
    const { value, statements } = await sent(() =>
      pushCommit(
        server,
        P,
        'c1',
        'k-rej',
        [
          { table: 'tasks', rowId: 't5', op: 'upsert', scopes: scopes('p1'), payload: ok },
          { table: 'tasks', rowId: 't6', op: 'upsert', scopes: scopes('p1'), payload: ok, baseVersion: 3 },
        ],
        { runningSchemaVersion: 1, createdAtMs: NOW },
      ),
    );
    assert.equal(value.outcome, 'rejected');
    assert.ok(statements.some((s) => s.startsWith('ROLLBACK TO SAVEPOINT syncular_push_candidate')));
    assert.equal(await server.getMaxCommitSeq(P), 1);
    assert.equal(await server.getRow(P, 'tasks', 't5'), undefined);
    const stored = await server.getPushResult(P, 'c1', 'k-rej');
    assert.equal(stored?.status, 'rejected');
    assert.equal('commitSeq' in stored!, false);
    const conflict = stored!.results[0]!;
    assert.equal(conflict.status, 'conflict');
    if (conflict.status === 'conflict') {
      assert.equal(conflict.opIndex, 1);
      assert.ok(conflict.serverRow instanceof Uint8Array);
      assert.deepEqual([...conflict.conflictColumns], [0xff]);
    }
    const replay = await pushCommit(server, P, 'c1', 'k-rej', [], { runningSchemaVersion: 1, createdAtMs: NOW });
    assert.equal(replay.outcome, 'cached');
  });

  test('commitRejectedPushResult needs the savepoint', async () => {
    const tx = await begin(server, P);
    await assert.rejects(tx.commitRejectedPushResult!('c', 'k', { status: 'rejected', results: [] }), /savepoint/);
    await tx.rollback();
  });

  test('a class-23 error of an app-row write is StorageConstraintError with the opIndex', async () => {
    await fx.admin.query("ALTER TABLE public.tasks ADD CONSTRAINT title_not_bad CHECK (title IS DISTINCT FROM 'bad')");
    try {
      const bad = await encode(fx.server, 'tasks', task('t7', 'p1', 'bad'));
      const tx = await begin(server, P);
      await tx.lockPartitionForPush!();
      await assert.rejects(
        tx.upsertRow('tasks', { rowId: 't7', serverVersion: 1, scopes: scopes('p1'), payload: bad }, { opIndex: 4 }),
        (e: unknown) => e instanceof StorageConstraintError && e.opIndex === 4,
      );
      await tx.rollback();
      const outcome = await pushCommit(server, P, 'c1', 'k-bad', [{ table: 'tasks', rowId: 't7', op: 'upsert', scopes: scopes('p1'), payload: bad }], {
        runningSchemaVersion: 1,
        createdAtMs: NOW,
      });
      assert.equal(outcome.outcome, 'rejected');
      assert.equal(outcome.result?.results[0]?.status, 'error');
    } finally {
      await fx.admin.query('ALTER TABLE public.tasks DROP CONSTRAINT title_not_bad');
    }
  });

  test('putPushResult: first writer wins; getPushResult maps bytes back; SY003 → SyncError', async () => {
    const tx = await begin(server, P);
    await tx.putPushResult('c2', 'k1', {
      status: 'rejected', recordedAtMs: NOW, cacheIdentity: 'one',
      results: [{ opIndex: 0, status: 'error', code: 'app.x', message: 'no', retryable: true, details: { a: 1 } }],
    });
    await tx.putPushResult('c2', 'k1', { status: 'rejected', cacheIdentity: 'two', results: [] });
    assert.equal((await tx.getPushResult!('c2', 'k1'))?.cacheIdentity, 'one');
    await tx.commit();
    assert.deepEqual(await server.getPushResult(P, 'c2', 'k1'), {
      status: 'rejected', recordedAtMs: NOW, cacheIdentity: 'one',
      results: [{ opIndex: 0, status: 'error', code: 'app.x', message: 'no', retryable: true, details: { a: 1 } }],
    });
    assert.equal(await server.getPushResult(P, 'c2', 'nope'), undefined);
    // An unreadable stored result (written around the API by the owner) is a cache miss.
    await fx.admin.query(
      "INSERT INTO syncular.sync_push_results(partition, client_id, client_commit_id, result) VALUES ('acme', 'c2', 'broken', '42')",
    );
    await expectCode(server.getPushResult(P, 'c2', 'broken'), SyncError, 'sync.idempotency_cache_miss');
    const out = await pushCommit(server, P, 'c2', 'broken', [], { runningSchemaVersion: 1, createdAtMs: NOW });
    assert.equal(out.outcome, 'cache_miss');
  });

  test('enqueueReactions, setBlobRefs, advanceCheckpoint and readServeGate on the transaction', async () => {
    const tx = await begin(server, P);
    await tx.lockPartitionForPush!();
    await tx.enqueueReactions!([]);
    await tx.enqueueReactions!([
      { idempotencyKey: 'r1', type: 'email.send', version: 1, payload: { to: 'a' }, sourceClientId: 'c1', sourceClientCommitId: 'k1', sourceCommitSeq: 1, createdAtMs: NOW, maxAttempts: 3 },
    ]);
    const payload = await encode(fx.server, 'tasks', task('t9', 'p1', 'blob'));
    await tx.upsertRow('tasks', { rowId: 't9', serverVersion: 1, scopes: scopes('p1'), payload });
    await tx.setBlobRefs!('tasks', 't9', ['b1', 'b2', 'b1']);
    const adminTx = await begin(migrator, P);
    assert.equal(await adminTx.advanceCheckpoint('none', 1, 1, 1, NOW), false, 'a backfill batch runs as syncular_admin');
    await adminTx.rollback();
    const gate = await tx.readServeGate(1);
    assert.deepEqual(gate, { storedSchemaVersion: 1, logEpoch: 'epoch-1', pending: [] });
    await tx.commit();
    await assert.rejects(tx.getRow('tasks', 't9'), /finished/);
    assert.deepEqual(await server.listReferencedBlobIds(P), ['b1', 'b2']);
    assert.deepEqual(await server.listRowsReferencingBlob(P, 'b1'), [{ table: 'tasks', rowId: 't9', scopes: { project_id: 'p1' } }]);
    assert.deepEqual(await server.listRowsReferencingBlob(P, 'zz'), []);
    assert.equal((await server.getReaction(P, 'r1'))?.status, 'pending');
  });

  test('scans inside the transaction see its own writes; scanRowsByIndex checks as upstream', async () => {
    const tx = await begin(server, P);
    const payload = await encode(fx.server, 'tasks', task('t10', 'p2', 'idx'));
    await tx.upsertRow('tasks', { rowId: 't10', serverVersion: 1, scopes: scopes('p2'), payload });
    assert.deepEqual((await tx.scanRows!({ table: 'tasks', scopeFilter: { project_id: ['p2'] }, afterRowId: null, limit: 10 })).map((r) => r.rowId), ['t10']);
    assert.deepEqual((await tx.scanRowsByIndex!({ table: 'tasks', index: 'tasks_by_title', values: ['idx'], limit: 10 })).map((r) => r.rowId), ['t10']);
    await tx.rollback();
    assert.deepEqual(await server.scanRowsByIndex(P, { table: 'tasks', index: 'tasks_by_title', values: ['idx'], limit: 10 }), []);
    await expectCode(server.scanRowsByIndex(P, { table: 'tasks', index: 'tasks_by_title', values: ['x'], limit: 0 }), StorageQueryError, 'sync.storage.invalid_limit');
    await expectCode(server.scanRowsByIndex(P, { table: 'tasks', index: 'nope', values: ['x'], limit: 1 }), StorageQueryError, 'sync.storage.index_not_found');
    await expectCode(server.scanRowsByIndex(P, { table: 'notes', index: 'x', values: [], limit: 1 }), StorageQueryError, 'sync.storage.index_not_materialized');
    await expectCode(server.scanRowsByIndex(P, { table: 'tasks', index: 'tasks_by_title', values: [], limit: 1 }), StorageQueryError, 'sync.storage.index_value_count_mismatch');
    const nulls = await server.scanRowsByIndex(P, { table: 'tasks', index: 'tasks_by_title', values: [null], limit: 5 });
    assert.deepEqual(nulls, []);
  });

  test('non-materialized table: meta columns only, no decode', async () => {
    const payload = await encode(fx.server, 'notes', { id: 'n1', project_id: 'p1', body: 'hello' });
    const out = await pushCommit(server, P, 'c3', 'k1', [{ table: 'notes', rowId: 'n1', op: 'upsert', scopes: scopes('p1'), payload }], {
      runningSchemaVersion: 1,
      createdAtMs: NOW,
    });
    assert.equal(out.outcome, 'applied');
    const row = await server.getRow(P, 'notes', 'n1');
    assert.deepEqual(row?.payload, payload);
  });
});

describe('concurrency, fence and gate', () => {
  test('concurrent pushes of one commit from two connections apply once', async () => {
    const other = storageOn(fx.server);
    await other.ensureSchema(V1);
    const payload = await encode(fx.server, 'tasks', task('race', 'p1', 'once'));
    const before = await server.getMaxCommitSeq(P);
    let release!: () => void;
    const held = new Promise<void>((r) => (release = r));
    const ops = [{ table: 'tasks', rowId: 'race', op: 'upsert' as const, scopes: scopes('p1'), payload }];
    // The first holds the partition lock until the second has been sent (and must wait).
    const first = pushCommit(server, P, 'dup', 'k', ops, { runningSchemaVersion: 1, createdAtMs: NOW, afterLock: () => held });
    await new Promise((r) => setTimeout(r, 100));
    const second = pushCommit(other, P, 'dup', 'k', ops, { runningSchemaVersion: 1, createdAtMs: NOW });
    await new Promise((r) => setTimeout(r, 200));
    release();
    const [a, b] = await Promise.all([first, second]);
    assert.deepEqual([a.outcome, b.outcome].sort(), ['applied', 'cached']);
    assert.equal(b.result?.cacheIdentity, a.result?.cacheIdentity, 'the second answers the first one\'s stored result');
    assert.equal(await server.getMaxCommitSeq(P), before + 1);
    assert.equal((await server.getRow(P, 'tasks', 'race'))?.serverVersion, 1);
  });

  test('a pending checkpoint makes the gate refuse; the declaring process is served', async () => {
    const declared = await migrator.declareCheckpoint(P, 'titles', 1, NOW);
    assert.deepEqual(declared, { partition: P, name: 'titles', schemaVersion: 1, state: 'declared', watermark: 0, ownerEpoch: 0, observedRows: 0, updatedAtMs: NOW });
    const gate = await server.readServeGate(P, 1);
    assert.deepEqual(gate.pending, [{ partition: P, name: 'titles' }]);
    const q = { plan: { sql: 'SELECT id FROM tasks ORDER BY id', relations: [relation('SELECT id FROM tasks ORDER BY id', 'tasks')] }, params: [], tables: ['tasks'] };
    await expectCode(server.queryAuthoritative(P, q), SyncError, 'sync.schema_not_ready');
    const ok = await server.queryAuthoritative(P, q, [{ partition: P, name: 'titles', schemaVersion: 1 }]);
    assert.ok(ok.rows.length > 0);
    // A fresh process that does not declare it cannot start (upstream: checkpoint_incomplete).
    await expectCode(storageOn(fx.server).ensureSchema(V1), StorageQueryError, 'sync.storage.checkpoint_incomplete');
    await storageOn(fx.server).ensureSchema(V1, [{ partition: P, name: 'titles', schemaVersion: 1 }]);
    // Backfill lifecycle.
    const claimed = await migrator.claimCheckpoint(P, 'titles', 1, NOW + 1);
    assert.equal(claimed.state, 'backfilling');
    assert.equal(claimed.ownerEpoch, 1);
    assert.equal(await migrator.advanceCheckpoint(P, 'titles', 1, 3, 10, NOW + 2), true);
    assert.equal(await migrator.advanceCheckpoint(P, 'titles', 9, 3, 10, NOW + 2), false);
    const cover = await migrator.sourceCoverageSeq(P, ['tasks']);
    assert.equal(await migrator.sourceCoverageSeq(P, []), 0);
    assert.equal(await migrator.hasSourceChangesAbove(P, ['tasks'], cover), 'clean');
    assert.equal(await migrator.hasSourceChangesAbove(P, ['tasks'], 0), 'changed');
    assert.equal(await migrator.activateCheckpoint(P, 'titles', 1, 0, ['tasks'], NOW + 3), 'stale');
    assert.equal(await migrator.activateCheckpoint(P, 'titles', 1, cover, ['tasks'], NOW + 3), 'activated');
    const list = await server.readCheckpoints(P);
    assert.deepEqual(list.map((c) => [c.name, c.state, c.watermark]), [['titles', 'activated', cover]]);
    assert.deepEqual((await server.readServeGate(P, 1)).pending, []);
    await expectCode(migrator.claimCheckpoint(P, 'titles', 1, NOW), StorageQueryError, 'sync.storage.checkpoint_not_declared');
    await expectCode(migrator.activateCheckpoint(P, 'nope', 1, 1, [], NOW), StorageQueryError, 'sync.storage.checkpoint_not_declared');
  });

  test('an old writer is fenced after a migration, on every partition (global writer floor)', async () => {
    const V2 = schemaV(2, [{ name: 'extra', type: 'string', nullable: true }]);
    const newMigrator = storageOn(fx.migrator);
    await newMigrator.ensureSchema(V2);
    // Payloads stored at v1 were re-encoded for the appended column.
    const decoded = await fx.admin.query("SELECT syncular.decode_row('tasks', _sync_payload) AS v FROM public.tasks WHERE _sync_row_id = 'race'");
    assert.equal(decoded.rows[0].v.extra, null);
    assert.equal(decoded.rows[0].v.title, 'once');
    const payload = await encode(fx.server, 'tasks', { ...task('t20', 'p1', 'old'), extra: null });
    for (const partition of [P, 'never-seen-partition']) {
      // The driver's gate refuses first (stored 2 > running 1) ...
      await expectCode(
        pushCommit(server, partition, 'old', `k-${partition}`, [], { runningSchemaVersion: 1, createdAtMs: NOW }),
        Error,
        'sync.schema_not_ready',
      );
      // ... and the fence refuses an old writer that appends anyway.
      const tx = await begin(server, partition);
      await tx.lockPartitionForPush!();
      await assert.rejects(
        tx.appendCommit({ clientId: 'old', clientCommitId: 'k', actorId: 'a', createdAtMs: NOW, changes: [] }),
        (e: unknown) => {
          assert.ok(e instanceof StorageQueryError);
          assert.equal(e.code, 'sync.storage.writer_fence_rejected');
          assert.deepEqual((e as unknown as { details: unknown }).details, { partition, writerVersion: 1, requiredWriterVersion: 2 });
          return true;
        },
      );
      await tx.rollback();
    }
    void payload;
    await expectCode(storageOn(fx.server).ensureSchema(V1), StorageQueryError, 'sync.storage.schema_newer');
    const v2server = storageOn(fx.server);
    await v2server.ensureSchema(V2);
    const p2 = await encode(fx.server, 'tasks', { ...task('t21', 'p1', 'new'), extra: 'x' });
    const out = await pushCommit(v2server, 'never-seen-partition', 'new', 'k', [{ table: 'tasks', rowId: 't21', op: 'upsert', scopes: scopes('p1'), payload: p2 }], {
      runningSchemaVersion: 2,
      createdAtMs: NOW,
    });
    assert.equal(out.outcome, 'applied');
    server = v2server;
    ({ storage: server, counter } = countingStorage(fx.server));
    await server.ensureSchema(V2);
  });
});

describe('pull, scans and the log', () => {
  test('readCommitWindow groups rows into commits, oldest first; empty filters read nothing', async () => {
    const commits = await server.readCommitWindow(P, { table: 'tasks', scopeFilter: { project_id: ['p1'] }, afterSeq: 0, throughSeq: 1000, limitChanges: 100 });
    assert.ok(commits.length >= 2);
    assert.deepEqual(commits.map((c) => c.commitSeq), [...commits.map((c) => c.commitSeq)].sort((a, b) => a - b));
    const firstCommit = commits[0]!;
    assert.equal(firstCommit.commitSeq, 1);
    assert.equal(firstCommit.actorId, 'actor');
    assert.equal(firstCommit.changes[0]?.op, 'upsert');
    assert.equal(firstCommit.changes[0]?.rowVersion, 1);
    assert.ok(firstCommit.changes[0]?.payload instanceof Uint8Array);
    const limited = await server.readCommitWindow(P, { table: 'tasks', scopeFilter: { project_id: ['p1'] }, afterSeq: 0, throughSeq: 1000, limitChanges: 1 });
    assert.equal(limited.length, 1);
    const { value: none, n } = await sent(async () => [
      await server.readCommitWindow(P, { table: 'tasks', scopeFilter: {}, afterSeq: 0, throughSeq: 10, limitChanges: 10 }),
      await server.readCommitWindow(P, { table: 'tasks', scopeFilter: { project_id: [] }, afterSeq: 0, throughSeq: 10, limitChanges: 10 }),
    ]);
    assert.deepEqual(none, [[], []]);
    assert.equal(n, 0, 'no query for an empty filter');
    assert.ok((await server.latestScopedChangeSeq(P, { table: 'tasks', scopeFilter: { project_id: ['p1'] } })) >= 1);
    assert.equal(await server.latestScopedChangeSeq(P, { table: 'tasks', scopeFilter: { project_id: ['zzz'] } }), 0);
    assert.equal(await server.latestScopedChangeSeq(P, { table: 'tasks', scopeFilter: {} }), 0);
  });

  test('scanRows pages by row id; no scope keys → scan_requires_scope', async () => {
    const all = await server.scanRows(P, { table: 'tasks', scopeFilter: { project_id: ['p1'] }, afterRowId: null, limit: 100 });
    const ids = all.map((r) => r.rowId);
    assert.deepEqual(ids, [...ids].sort());
    const page = await server.scanRows(P, { table: 'tasks', scopeFilter: { project_id: ['p1'] }, afterRowId: ids[0]!, limit: 1 });
    assert.deepEqual(page.map((r) => r.rowId), [ids[1]]);
    assert.deepEqual(await server.scanRows(P, { table: 'tasks', scopeFilter: { project_id: [] }, afterRowId: null, limit: 5 }), []);
    await expectCode(server.scanRows(P, { table: 'tasks', scopeFilter: {}, afterRowId: null, limit: 5 }), StorageQueryError, 'sync.storage.scan_requires_scope');
    assert.deepEqual(await server.getRowScopes(P, 'tasks', ids[0]!), { serverVersion: all[0]!.serverVersion, scopes: { project_id: 'p1' } });
    assert.equal(await server.getRowScopes(P, 'tasks', 'missing'), undefined);
  });

  test('queryAuthoritative: the registered query on the partition\'s rows, in one snapshot', async () => {
    const q = {
      plan: { sql: 'SELECT t.id, t.title FROM tasks t WHERE t.project_id = ?1 ORDER BY t.id LIMIT ?', relations: [{ ...relation('SELECT t.id, t.title FROM tasks t WHERE t.project_id = ?1 ORDER BY t.id LIMIT ?', 'tasks'), alias: 't' }] },
      params: ['p1', 2],
      tables: ['tasks'],
    };
    const { value, n } = await sent(() => server.queryAuthoritative(P, q));
    // Through an executor, which sends BEGIN itself, the snapshot is set by one more statement.
    if (EXECUTOR === 'pg-pool') assert.equal(n, 4, 'BEGIN, gate + cursor, query, COMMIT');
    else assert.equal(n, 5, 'BEGIN, SET TRANSACTION, gate + cursor, query, COMMIT');
    assert.equal(value.rows.length, 2);
    assert.equal(value.maxCommitSeq, await server.getMaxCommitSeq(P));
    const otherPartition = await server.queryAuthoritative('b-part', q);
    assert.deepEqual(otherPartition.rows, [], 'partition-filtered');
    await assert.rejects(server.queryAuthoritative(P, { ...q, tables: ['tasks', 'notes'] }), /metadata/);
    const tx = await begin(server, P);
    const inTx = await tx.queryAuthoritative!(q);
    assert.equal(inTx.rows.length, 2);
    await tx.rollback();
  });

  test('horizon, pruning and commit_seq_before', async () => {
    const max = await server.getMaxCommitSeq(P);
    assert.equal(await server.getMaxCommitSeq('nobody'), 0);
    assert.equal(await server.getHorizonSeq(P), 0);
    assert.equal(await migrator.getCommitSeqBefore(P, NOW), 0);
    assert.equal(await migrator.getCommitSeqBefore(P, NOW + 1), max);
    await expectCode(migrator.pruneCommitsThrough(P, { logEpoch: 'wrong', throughSeq: 1 }), StorageQueryError, 'sync.storage.prune_epoch_mismatch');
    const pruned = await migrator.pruneCommitsThrough(P, { logEpoch: 'epoch-1', throughSeq: 1 });
    assert.deepEqual(pruned, { previousHorizonSeq: 0, horizonSeq: 1, removedCommits: 1 });
    await migrator.setHorizonSeq(P, 0);
    assert.equal(await server.getHorizonSeq(P), 1, 'never lowers');
    assert.equal(await migrator.hasSourceChangesAbove(P, ['tasks'], 0), 'changed');
  });
});

describe('reactions', () => {
  test('claim, extend, fail, retry, complete, list, prune — with leases', async () => {
    const { value: none, n } = await sent(async () => [
      await server.claimReactions(P, { leaseOwner: 'w', types: [], nowMs: NOW, leaseDurationMs: 1000, limit: 5 }),
      await server.claimReactions(P, { leaseOwner: 'w', types: ['email.send'], nowMs: NOW, leaseDurationMs: 1000, limit: 0 }),
    ]);
    assert.deepEqual(none, [[], []]);
    assert.equal(n, 0);
    const claimed = await server.claimReactions(P, { leaseOwner: 'w1', types: ['email.send'], nowMs: NOW, leaseDurationMs: 1000, limit: 5 });
    assert.equal(claimed.length, 1);
    assert.equal(claimed[0]!.status, 'leased');
    assert.equal(claimed[0]!.attempts, 1);
    assert.equal(claimed[0]!.leaseOwner, 'w1');
    assert.equal('completedAtMs' in claimed[0]!, false);
    assert.deepEqual(await server.claimReactions(P, { leaseOwner: 'w2', types: ['email.send'], nowMs: NOW + 10, leaseDurationMs: 1000, limit: 5 }), [], 'leased');
    assert.equal(await server.extendReactionLease(P, 'r1', 'w2', NOW + 5000), false);
    assert.equal(await server.extendReactionLease(P, 'r1', 'w1', NOW + 5000), true);
    assert.equal(await server.failReaction(P, 'r1', { leaseOwner: 'w1', failure: { code: 'app.down', atMs: NOW + 20 }, retryAtMs: NOW + 30 }), true);
    assert.equal((await server.getReaction(P, 'r1'))?.status, 'pending');
    const again = await server.claimReactions(P, { leaseOwner: 'w3', types: ['email.send'], nowMs: NOW + 40, leaseDurationMs: 1000, limit: 5 });
    assert.equal(again[0]!.attempts, 2);
    assert.equal(await server.failReaction(P, 'r1', { leaseOwner: 'w3', failure: { code: 'app.dead', atMs: NOW + 50 } }), true);
    const dead = await server.getReaction(P, 'r1');
    assert.equal(dead?.status, 'dead-letter');
    assert.deepEqual(dead?.lastFailure, { code: 'app.dead', atMs: NOW + 50 });
    assert.equal(await migrator.retryReaction(P, 'r1', NOW + 60), true);
    const third = await server.claimReactions(P, { leaseOwner: 'w4', types: ['email.send'], nowMs: NOW + 70, leaseDurationMs: 1000, limit: 5 });
    assert.equal(await server.completeReaction(P, 'r1', 'wrong', NOW + 80), false);
    assert.equal(await server.completeReaction(P, 'r1', third[0]!.leaseOwner!, NOW + 80), true);
    assert.deepEqual((await migrator.listReactions(P, { limit: 10, statuses: ['completed'] })).map((r) => r.idempotencyKey), ['r1']);
    assert.deepEqual(await migrator.listReactions(P, { limit: 10, statuses: ['pending'] }), []);
    assert.deepEqual(await migrator.listReactions(P, { limit: 0 }), []);
    assert.equal(await server.getReaction(P, 'nope'), undefined);
    assert.deepEqual(await migrator.pruneReactions(P, { completedBeforeMs: NOW + 80, deadLetterBeforeMs: NOW, limit: 10 }), { completed: 0, deadLetter: 0 }, 'strict bound');
    assert.deepEqual(await migrator.pruneReactions(P, { completedBeforeMs: NOW + 81, deadLetterBeforeMs: NOW, limit: 10 }), { completed: 1, deadLetter: 0 });
    assert.deepEqual(await migrator.pruneReactions(P, { completedBeforeMs: NOW, deadLetterBeforeMs: NOW, limit: 0 }), { completed: 0, deadLetter: 0 });
  });

  test('a duplicate reaction key is refused with sync.storage.reaction_duplicate', async () => {
    const tx = await begin(server, P);
    const reaction = { idempotencyKey: 'dup', type: 't', version: 1, payload: {}, sourceClientId: 'c', sourceClientCommitId: 'k', sourceCommitSeq: 1, createdAtMs: NOW, maxAttempts: 1 };
    await tx.enqueueReactions!([reaction]);
    await expectCode(tx.enqueueReactions!([reaction]), StorageQueryError, 'sync.storage.reaction_duplicate');
    await tx.rollback();
  });
});

describe('clients and admin reads', () => {
  test('client records and cursors', async () => {
    assert.equal(await server.getClientRecord(P, 'dev'), undefined);
    const record = { clientId: 'dev', actorId: 'alice', wireVersion: 2, cursor: 3, updatedAtMs: NOW, subscriptions: [{ id: 's', table: 'tasks', scopes: { project_id: ['p1'] } }] };
    await server.putClientRecord(P, record);
    assert.deepEqual(await server.getClientRecord(P, 'dev'), record);
    await server.advanceClientCursor(P, 'dev', 'mallory', 'epoch-1', 9, NOW + 1);
    assert.equal((await server.getClientRecord(P, 'dev'))?.cursor, 3, 'other actor: unchanged');
    await server.advanceClientCursor(P, 'dev', 'alice', 'epoch-1', 9, NOW + 1);
    assert.equal((await server.getClientRecord(P, 'dev'))?.cursor, 9);
    await server.updateClientCursor(P, 'dev', 5, NOW + 2);
    assert.equal((await server.getClientRecord(P, 'dev'))?.cursor, 9, 'GREATEST');
    await server.updateClientCursor(P, 'ghost', 5, NOW + 2);
    assert.equal(await server.getClientRecord(P, 'ghost'), undefined, 'missing records stay absent');
    assert.equal(await migrator.getActiveClientCursorFloor(P, NOW), 9);
    assert.equal(await migrator.getActiveClientCursorFloor(P, NOW + 100), null);
    assert.deepEqual(await migrator.listClientCursors(P), [{ clientId: 'dev', cursor: 9, updatedAtMs: NOW + 2 }]);
    assert.deepEqual((await migrator.listClientRecords(P)).map((r) => r.clientId), ['dev']);
  });

  test('commit metadata and scope activity, newest first', async () => {
    const meta = await migrator.listCommitMetadata(P, { afterSeq: 0, limit: 2 });
    assert.equal(meta.length, 2);
    assert.ok(meta[0]!.commitSeq > meta[1]!.commitSeq);
    assert.deepEqual(meta[0]!.tables.length >= 1, true);
    assert.deepEqual(await migrator.listCommitMetadata(P, { afterSeq: 0, limit: 5, table: 'nothing' }), []);
    const activity = await migrator.scopeActivity(P, { variable: 'project_id', value: 'p1', limit: 3 });
    assert.ok(activity.length >= 1);
    assert.equal(activity[0]!.table, 'tasks');
  });
});

describe('upstream executor shape', () => {
  test('a PgExecutor (query + transaction) works as the source', async () => {
    const pool = fx.server;
    type Q = (text: string, params?: readonly unknown[]) => Promise<{ rows: Record<string, unknown>[]; rowCount: number | null }>;
    const exec = {
      query: ((text, params) => pool.query(text, params as unknown[])) as Q,
      async transaction<T>(fn: (c: { query: Q }) => Promise<T>): Promise<T> {
        const client = await pool.connect();
        try {
          await client.query('BEGIN');
          const out = await fn({ query: ((t, p) => client.query(t, p as unknown[])) as Q });
          await client.query('COMMIT');
          return out;
        } catch (e) {
          await client.query('ROLLBACK');
          throw e;
        } finally {
          client.release();
        }
      },
    };
    const storage = new SyncularServerStorage(exec as never);
    await storage.ensureSchema(schemaV(2, [{ name: 'extra', type: 'string', nullable: true }]));
    const payload = await encode(fx.server, 'tasks', { ...task('ex1', 'p9', 'exec'), extra: null });
    const out = await pushCommit(storage, 'exec-part', 'c', 'k', [{ table: 'tasks', rowId: 'ex1', op: 'upsert', scopes: scopes('p9'), payload }], {
      runningSchemaVersion: 2,
      createdAtMs: NOW,
    });
    assert.equal(out.outcome, 'applied');
    const rejected = await pushCommit(storage, 'exec-part', 'c', 'k2', [{ table: 'tasks', rowId: 'ex1', op: 'upsert', scopes: scopes('p9'), payload, baseVersion: 7 }], {
      runningSchemaVersion: 2,
      createdAtMs: NOW,
    });
    assert.equal(rejected.outcome, 'rejected');
    assert.equal(await storage.getMaxCommitSeq('exec-part'), 1);
    const q = { plan: { sql: 'SELECT count(*) AS n FROM tasks', relations: [relation('SELECT count(*) AS n FROM tasks', 'tasks')] }, params: [], tables: ['tasks'] };
    const counted = await storage.queryAuthoritative('exec-part', q);
    assert.equal(Number(counted.rows[0]!.n), 1);
  });

  test('injected error classes are the ones thrown', async () => {
    class HostQueryError extends Error {
      readonly code: string;
      constructor(code: string) {
        super(code);
        this.code = code;
      }
    }
    class HostSyncError extends Error {
      constructor(readonly code: string, message?: string, readonly details?: string) {
        super(message ?? code);
      }
    }
    const storage = storageOn(fx.server, { errors: { StorageQueryError: HostQueryError as never, SyncError: HostSyncError } });
    await assert.rejects(storage.getPartitionLogEpoch(''), HostQueryError);
    await assert.rejects(storage.getPushResult(P, 'c2', 'broken'), HostSyncError);
  });
});

