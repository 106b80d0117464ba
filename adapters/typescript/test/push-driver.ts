// The storage calls of upstream's 0.24 push driver (packages/server/src/push.ts, processPushCommit)
// for a commit of upserts and deletes, in upstream's order: the optimistic idempotency read, begin,
// the partition lock and savepoint, the serve gate on the transaction, the locked re-check, per
// operation the row read (plus the tombstone read over an absent row), the conflict rule on the
// base version, the write, then append, reactions, the push result and COMMIT; a conflict or a
// class-23 error finalizes the rejection under the lock. Written here (upstream's package is not
// installable from the registry) so the tests and the benchmark drive the adapter the way
// @syncular/server does; it is not a second implementation of the server.
import { randomUUID } from 'node:crypto';
import type { NewChange, NewReaction, PushOperationResult, ServerStorage, StoredPushResult } from '../src/types.js';

export interface Operation {
  readonly table: string;
  readonly rowId: string;
  readonly op: 'upsert' | 'delete';
  readonly scopes: Record<string, string>;
  readonly payload?: Uint8Array;
  /** Absent: last writer wins. */
  readonly baseVersion?: number;
}

export interface PushOutcome {
  readonly outcome: 'applied' | 'cached' | 'rejected' | 'cache_miss';
  readonly result?: StoredPushResult;
}

export interface PushOptions {
  readonly runningSchemaVersion: number;
  readonly createdAtMs: number;
  readonly actorId?: string;
  /** Later upstream versions read a commit's rows with one `prefetchRows` per table. */
  readonly prefetch?: boolean;
  readonly reactions?: (commitSeq: number) => NewReaction[];
  /** Checkpoints this process declares (the serve gate lets it through). */
  readonly declared?: readonly { partition: string; name: string }[];
  /** Called between the lock and the first operation (tests use it to interleave). */
  readonly afterLock?: () => Promise<void>;
}

function isCode(error: unknown, code: string): boolean {
  return typeof error === 'object' && error !== null && (error as { code?: unknown }).code === code;
}

export async function pushCommit(
  storage: ServerStorage,
  partition: string,
  clientId: string,
  clientCommitId: string,
  operations: readonly Operation[],
  options: PushOptions,
): Promise<PushOutcome> {
  try {
    const persisted = await storage.getPushResult(partition, clientId, clientCommitId);
    if (persisted !== undefined) return { outcome: 'cached', result: persisted };
  } catch (error) {
    if (isCode(error, 'sync.idempotency_cache_miss')) return { outcome: 'cache_miss' };
    throw error;
  }
  const tx = await storage.begin(partition);
  try {
    const lock = tx.lockPartitionForPush?.bind(tx) ?? tx.lockPartitionForCommitValidation?.bind(tx);
    if (lock === undefined || tx.commitRejectedPushResult === undefined) throw new Error('storage cannot serialize pushes');
    await lock();
    const gate = await tx.readServeGate(options.runningSchemaVersion);
    const undeclared = gate.pending.find(
      (p) => !(options.declared ?? []).some((d) => d.partition === p.partition && d.name === p.name),
    );
    if (gate.storedSchemaVersion > options.runningSchemaVersion || undeclared !== undefined) {
      await tx.rollback();
      throw Object.assign(new Error('sync.schema_not_ready'), { code: 'sync.schema_not_ready' });
    }
    const again = tx.getPushResult !== undefined
      ? await tx.getPushResult(clientId, clientCommitId)
      : await storage.getPushResult(partition, clientId, clientCommitId);
    if (again !== undefined) {
      await tx.rollback();
      return { outcome: 'cached', result: again };
    }
    await options.afterLock?.();
    if (options.prefetch === true && tx.prefetchRows !== undefined) {
      const byTable = new Map<string, string[]>();
      for (const op of operations) byTable.set(op.table, [...(byTable.get(op.table) ?? []), op.rowId]);
      for (const [table, ids] of byTable) await tx.prefetchRows(table, ids);
    }
    const results: PushOperationResult[] = [];
    const changes: NewChange[] = [];
    const reject = async (record: PushOperationResult): Promise<PushOutcome> => {
      const rejected: StoredPushResult = {
        status: 'rejected',
        recordedAtMs: options.createdAtMs,
        cacheIdentity: randomUUID(),
        results: [record],
      };
      await tx.commitRejectedPushResult!(clientId, clientCommitId, rejected);
      return { outcome: 'rejected', result: rejected };
    };
    for (const [opIndex, op] of operations.entries()) {
      const stored = await tx.getRow(op.table, op.rowId);
      if (op.baseVersion !== undefined && (stored?.serverVersion ?? 0) !== op.baseVersion) {
        return await reject({
          opIndex,
          status: 'conflict',
          code: 'sync.conflict',
          message: 'row changed since base version',
          serverVersion: stored?.serverVersion ?? 0,
          serverRow: stored?.payload ?? new Uint8Array(),
          conflictColumns: new Uint8Array([0xff]),
        });
      }
      if (op.op === 'delete') {
        if (stored !== undefined) {
          await tx.deleteRow(op.table, op.rowId);
          changes.push({ table: op.table, rowId: op.rowId, op: 'delete', scopes: op.scopes });
        }
        results.push({ opIndex, status: 'applied' });
        continue;
      }
      if (stored === undefined) {
        await tx.getTombstoneSeq(op.table, op.rowId);
        await tx.clearTombstone(op.table, op.rowId);
      }
      const serverVersion = (stored?.serverVersion ?? 0) + 1;
      try {
        await tx.upsertRow(
          op.table,
          { rowId: op.rowId, serverVersion, scopes: op.scopes, payload: op.payload ?? new Uint8Array() },
          { opIndex },
        );
      } catch (error) {
        if (error instanceof Error && error.name === 'StorageConstraintError') {
          return await reject({
            opIndex: (error as { opIndex?: number }).opIndex ?? opIndex,
            status: 'error',
            code: 'sync.constraint_violation',
            message: 'application row violates a relational constraint',
            retryable: false,
          });
        }
        throw error;
      }
      changes.push({
        table: op.table,
        rowId: op.rowId,
        op: 'upsert',
        rowVersion: serverVersion,
        scopes: op.scopes,
        ...(op.payload !== undefined ? { payload: op.payload } : {}),
      });
      results.push({ opIndex, status: 'applied' });
    }
    const commitSeq = await tx.appendCommit({
      clientId,
      clientCommitId,
      actorId: options.actorId ?? 'actor',
      createdAtMs: options.createdAtMs,
      changes,
    });
    const reactions = options.reactions?.(commitSeq) ?? [];
    if (reactions.length > 0) await tx.enqueueReactions!(reactions);
    const applied: StoredPushResult = {
      status: 'applied',
      commitSeq,
      recordedAtMs: options.createdAtMs,
      cacheIdentity: randomUUID(),
      results,
    };
    await tx.putPushResult(clientId, clientCommitId, applied);
    await tx.commit();
    return { outcome: 'applied', result: applied };
  } catch (error) {
    await tx.rollback();
    throw error;
  }
}
