// Obtaining upstream's `StorageConstraintError` from a packaged `@syncular/server`.
//
// Upstream's push turns a relational-constraint violation into a durable `sync.constraint_violation`
// rejection only when the storage throws upstream's own `StorageConstraintError` (`instanceof`).
// The published package does not export that class, and its `exports` map forbids importing the
// module that defines it. It does export a producer of it: `PostgresServerStorage`, whose
// `upsertRow` wraps a class-23 driver error in `StorageConstraintError` — and which runs over any
// `PgExecutor`. So the class is taken from one such error, produced once at startup over an
// in-memory executor that answers every statement with no rows and fails the row write with
// SQLSTATE 23505: no database, no connection, nothing leaves the process.
import type { StorageConstraintErrorClass } from './errors.js';

const PROBE_TABLE = 'syncular_constraint_probe';
/** An opIndex no real push uses first; the produced error must carry it back. */
const PROBE_OP_INDEX = 7;

interface ProbeStorage {
  ensureSchema(schema: unknown): Promise<void>;
  begin(partition: string): Promise<{
    upsertRow(table: string, row: unknown, context?: { opIndex: number }): Promise<void>;
    rollback(): Promise<void>;
  }>;
}

/** The probe's schema, compiled by upstream's own `compileSchema` when it is exported. */
function probeSchema(compileSchema: unknown): unknown {
  const columns = [
    { name: 'id', type: 'string', nullable: false },
    { name: 'scope', type: 'string', nullable: false },
  ];
  if (typeof compileSchema === 'function') {
    return (compileSchema as (schema: unknown) => unknown)({
      version: 1,
      tables: [{ name: PROBE_TABLE, columns, primaryKey: 'id', scopes: ['probe:{scope}'], materialize: false }],
    });
  }
  // Upstream's compiled shape, for a build that does not export the compiler.
  return {
    version: 1,
    tables: new Map([
      [
        PROBE_TABLE,
        {
          name: PROBE_TABLE,
          columns,
          primaryKeyIndex: 0,
          scopePatterns: [{ variable: 'scope', prefix: 'probe', column: 'scope', columnIndex: 1 }],
          indexes: [],
          materialize: false,
          columnIndex: new Map([['id', 0], ['scope', 1]]),
          declaredVariables: new Set(['scope']),
          blobRefColumnIndices: [],
        },
      ],
    ]),
  };
}

/**
 * Upstream's `StorageConstraintError` class as its `PostgresServerStorage` throws it, or undefined
 * when `producer` is not such a class or the error it produced does not look like upstream's
 * (name `StorageConstraintError`, the probe's opIndex, the driver error as `cause`).
 */
export async function constraintErrorFromProducer(
  producer: unknown,
  compileSchema?: unknown,
): Promise<StorageConstraintErrorClass | undefined> {
  if (typeof producer !== 'function') return undefined;
  const violation = Object.assign(new Error('syncular constraint probe'), { code: '23505' });
  let armed = false;
  const client = {
    async query(): Promise<{ rows: never[]; rowCount: number }> {
      if (armed) throw violation;
      return { rows: [], rowCount: 0 };
    },
  };
  const executor = {
    query: client.query,
    transaction: <T>(fn: (c: typeof client) => Promise<T>): Promise<T> => fn(client),
  };
  try {
    const storage = new (producer as new (executor: unknown) => ProbeStorage)(executor);
    await storage.ensureSchema(probeSchema(compileSchema));
    const tx = await storage.begin('syncular-probe');
    let produced: unknown;
    armed = true;
    try {
      await tx.upsertRow(
        PROBE_TABLE,
        { rowId: 'r', serverVersion: 1, scopes: { scope: 's' }, payload: new Uint8Array(0) },
        { opIndex: PROBE_OP_INDEX },
      );
    } catch (error) {
      produced = error;
    } finally {
      armed = false;
      await tx.rollback();
    }
    if (
      produced instanceof Error &&
      produced.name === 'StorageConstraintError' &&
      (produced as { opIndex?: unknown }).opIndex === PROBE_OP_INDEX &&
      produced.cause === violation &&
      produced.constructor !== Error
    ) {
      return produced.constructor as StorageConstraintErrorClass;
    }
  } catch {
    // An upstream whose producer works differently: the caller keeps its fallback.
  }
  return undefined;
}
