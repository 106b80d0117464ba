// Every method sends no more statements than the spec's map (docs/TYPESCRIPT.md, "Method map"):
// one extension call each, with the exceptions the map names (lock + savepoint; the rejection's
// four statements; queryAuthoritative's snapshot; ensureSchema's check + layout read).
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import type { SyncularServerStorage } from '../src/index.js';
import type { StorageTransaction } from '../src/types.js';
import { countingStorage, encode, EXECUTOR, freshDatabase, NOW, schemaV, task, type Fixture, type StatementCounter } from './helpers.js';

let fx: Fixture;
let storage: SyncularServerStorage;
let counter: StatementCounter;
const P = 'count';
const V1 = schemaV(1);
const plan = (sql: string) => {
  const start = sql.indexOf('FROM tasks') + 5;
  return { sql, relations: [{ table: 'tasks', start, end: start + 5 }] };
};

before(async () => {
  fx = await freshDatabase('statements');
  ({ storage, counter } = countingStorage(fx.migrator));
  await storage.ensureSchema(V1);
});

after(async () => {
  await fx.close();
});

async function expectAtMost(name: string, max: number, fn: () => Promise<unknown>): Promise<void> {
  const { statements } = await counter.count(fn);
  assert.ok(statements.length <= max, `${name}: ${statements.length} statements > ${max}:\n${statements.join('\n')}`);
}

test('ServerStorage: one statement per method (queryAuthoritative: BEGIN, gate + cursor, query, COMMIT)', async () => {
  const s = storage;
  const cases: [string, number, () => Promise<unknown>][] = [
    ['touchPartition', 1, () => s.touchPartition(P, NOW, 'e1')],
    ['rotatePartitionLogEpoch', 1, () => s.rotatePartitionLogEpoch('other', 'e2', NOW)],
    ['listPartitionRegistry', 1, () => s.listPartitionRegistry()],
    ['listPartitions', 1, () => s.listPartitions()],
    ['getPartitionLogEpoch', 1, () => s.getPartitionLogEpoch(P)],
    ['getMaxCommitSeq', 1, () => s.getMaxCommitSeq(P)],
    ['getHorizonSeq', 1, () => s.getHorizonSeq(P)],
    ['setHorizonSeq', 1, () => s.setHorizonSeq(P, 0)],
    ['pruneCommitsThrough', 1, () => s.pruneCommitsThrough(P, { logEpoch: 'e1', throughSeq: 0 })],
    ['getCommitSeqBefore', 1, () => s.getCommitSeqBefore(P, NOW)],
    ['declareCheckpoint', 1, () => s.declareCheckpoint(P, 'c', 1, NOW)],
    ['readCheckpoints', 1, () => s.readCheckpoints(P)],
    ['readServeGate', 1, () => s.readServeGate(P, 1)],
    ['claimCheckpoint', 1, () => s.claimCheckpoint(P, 'c', 1, NOW)],
    ['advanceCheckpoint', 1, () => s.advanceCheckpoint(P, 'c', 1, 0, 0, NOW)],
    ['sourceCoverageSeq', 1, () => s.sourceCoverageSeq(P, ['tasks'])],
    ['hasSourceChangesAbove', 1, () => s.hasSourceChangesAbove(P, ['tasks'], 0)],
    ['activateCheckpoint', 1, () => s.activateCheckpoint(P, 'c', 1, 0, ['tasks'], NOW)],
    ['getRow', 1, () => s.getRow(P, 'tasks', 'x')],
    ['getPushResult', 1, () => s.getPushResult(P, 'c', 'k')],
    ['claimReactions', 1, () => s.claimReactions(P, { leaseOwner: 'w', types: ['t'], nowMs: NOW, leaseDurationMs: 1, limit: 1 })],
    ['claimReactions (no types)', 0, () => s.claimReactions(P, { leaseOwner: 'w', types: [], nowMs: NOW, leaseDurationMs: 1, limit: 1 })],
    ['completeReaction', 1, () => s.completeReaction(P, 'k', 'w', NOW)],
    ['extendReactionLease', 1, () => s.extendReactionLease(P, 'k', 'w', NOW)],
    ['failReaction', 1, () => s.failReaction(P, 'k', { leaseOwner: 'w', failure: { code: 'x', atMs: NOW } })],
    ['retryReaction', 1, () => s.retryReaction(P, 'k', NOW)],
    ['getReaction', 1, () => s.getReaction(P, 'k')],
    ['listReactions', 1, () => s.listReactions(P, { limit: 5 })],
    ['pruneReactions', 1, () => s.pruneReactions(P, { completedBeforeMs: NOW, deadLetterBeforeMs: NOW, limit: 5 })],
    ['readCommitWindow', 1, () => s.readCommitWindow(P, { table: 'tasks', scopeFilter: { project_id: ['p'] }, afterSeq: 0, throughSeq: 9, limitChanges: 9 })],
    ['latestScopedChangeSeq', 1, () => s.latestScopedChangeSeq(P, { table: 'tasks', scopeFilter: { project_id: ['p'] } })],
    ['scanRows', 1, () => s.scanRows(P, { table: 'tasks', scopeFilter: { project_id: ['p'] }, afterRowId: null, limit: 9 })],
    ['scanRowsByIndex', 1, () => s.scanRowsByIndex(P, { table: 'tasks', index: 'tasks_by_title', values: ['x'], limit: 9 })],
    // An executor sends its own BEGIN: the snapshot is then set by SET TRANSACTION, one more.
    ['queryAuthoritative', EXECUTOR === 'pg-pool' ? 4 : 5, () => s.queryAuthoritative(P, { plan: plan('SELECT id FROM tasks'), params: [], tables: ['tasks'] }, [{ partition: P, name: 'c', schemaVersion: 1 }])],
    ['getClientRecord', 1, () => s.getClientRecord(P, 'd')],
    ['putClientRecord', 1, () => s.putClientRecord(P, { clientId: 'd', actorId: 'a', wireVersion: 1, cursor: 0, updatedAtMs: NOW, subscriptions: [] })],
    ['advanceClientCursor', 1, () => s.advanceClientCursor(P, 'd', 'a', 'e1', 1, NOW)],
    ['updateClientCursor', 1, () => s.updateClientCursor(P, 'd', 1, NOW)],
    ['getActiveClientCursorFloor', 1, () => s.getActiveClientCursorFloor(P, 0)],
    ['listClientCursors', 1, () => s.listClientCursors(P)],
    ['listRowsReferencingBlob', 1, () => s.listRowsReferencingBlob(P, 'b')],
    ['listReferencedBlobIds', 1, () => s.listReferencedBlobIds(P)],
    ['listClientRecords', 1, () => s.listClientRecords(P)],
    ['listCommitMetadata', 1, () => s.listCommitMetadata(P, { afterSeq: 0, limit: 5 })],
    ['scopeActivity', 1, () => s.scopeActivity(P, { variable: 'project_id', value: 'p', limit: 5 })],
    ['getRowScopes', 1, () => s.getRowScopes(P, 'tasks', 'x')],
    ['migrate', 1, () => s.migrate()],
  ];
  for (const [name, max, fn] of cases) await expectAtMost(name, max, fn);
});

test('StorageTransaction: one statement per method (lock: 2; rejection: 4)', async () => {
  let tx!: StorageTransaction;
  await expectAtMost('begin', 1, async () => (tx = await storage.begin(P)));
  const payload = await encode(fx.migrator, 'tasks', task('r1', 'p', 'x'));
  const row = { rowId: 'r1', serverVersion: 1, scopes: { project_id: 'p' }, payload };
  const cases: [string, number, () => Promise<unknown>][] = [
    ['lockPartitionForPush', 2, () => tx.lockPartitionForPush!()],
    ['getPushResult', 1, () => tx.getPushResult!('c', 'k')],
    ['readServeGate', 1, () => tx.readServeGate(1)],
    ['prefetchRows', 1, () => tx.prefetchRows!('tasks', ['r1', 'r2'])],
    ['getRow (prefetched)', 0, () => tx.getRow('tasks', 'r1')],
    ['getTombstoneSeq (prefetched)', 0, () => tx.getTombstoneSeq('tasks', 'r1')],
    ['clearTombstone', 1, () => tx.clearTombstone('tasks', 'r1')],
    ['getTombstoneSeq', 1, () => tx.getTombstoneSeq('tasks', 'r1')],
    ['upsertRow', 1, () => tx.upsertRow('tasks', row, { opIndex: 0 })],
    ['getRow', 1, () => tx.getRow('tasks', 'r1')],
    ['setBlobRefs', 1, () => tx.setBlobRefs!('tasks', 'r1', ['b'])],
    ['scanRows', 1, () => tx.scanRows!({ table: 'tasks', scopeFilter: { project_id: ['p'] }, afterRowId: null, limit: 5 })],
    ['scanRowsByIndex', 1, () => tx.scanRowsByIndex!({ table: 'tasks', index: 'tasks_by_title', values: ['x'], limit: 5 })],
    ['queryAuthoritative', 2, () => tx.queryAuthoritative!({ plan: plan('SELECT id FROM tasks'), params: [], tables: ['tasks'] })],
    ['deleteRow', 1, () => tx.deleteRow('tasks', 'r1')],
    ['appendCommit', 1, () => tx.appendCommit({ clientId: 'c', clientCommitId: 'k', actorId: 'a', createdAtMs: NOW, changes: [{ table: 'tasks', rowId: 'r1', op: 'delete', scopes: { project_id: 'p' } }] })],
    ['enqueueReactions', 1, () => tx.enqueueReactions!([{ idempotencyKey: 'x', type: 't', version: 1, payload: {}, sourceClientId: 'c', sourceClientCommitId: 'k', sourceCommitSeq: 1, createdAtMs: NOW, maxAttempts: 1 }])],
    ['advanceCheckpoint', 1, () => tx.advanceCheckpoint('c', 1, 0, 0, NOW)],
    ['putPushResult', 1, () => tx.putPushResult('c', 'k', { status: 'applied', commitSeq: 1, results: [] })],
    ['commit', 1, () => tx.commit()],
  ];
  for (const [name, max, fn] of cases) await expectAtMost(name, max, fn);
  const rejecting = await storage.begin(P);
  await rejecting.lockPartitionForPush!();
  await expectAtMost('commitRejectedPushResult', 4, () =>
    rejecting.commitRejectedPushResult!('c', 'k2', { status: 'rejected', results: [{ opIndex: 0, status: 'error', code: 'x', message: 'm', retryable: false }] }),
  );
  const rolling = await storage.begin(P);
  await expectAtMost('rollback', 1, () => rolling.rollback());
});

test('ensureSchema at the stored version: check_schema and one layout read', async () => {
  const fresh = countingStorage(fx.server);
  const { statements } = await fresh.counter.count(() => fresh.storage.ensureSchema(V1, [{ partition: P, name: 'c', schemaVersion: 1 }]));
  assert.equal(statements.length, 2);
});
