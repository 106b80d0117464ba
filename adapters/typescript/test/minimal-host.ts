// The complete minimal host of docs/TYPESCRIPT.md, verbatim except for the import path
// (test/minimal-host.test.ts runs it; keep the two in step).
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import { SyncularServerStorage, type CompiledSchema } from '../src/index.js';

export async function minimalHost(migratorUrl: string, serverUrl: string): Promise<number[]> {
  const schema: CompiledSchema = {
    version: 1,
    tables: new Map([['tasks', {
      name: 'tasks',
      columns: [
        { name: 'id', type: 'string', nullable: false },
        { name: 'project_id', type: 'string', nullable: false },
        { name: 'title', type: 'string', nullable: true },
      ],
      primaryKeyIndex: 0,
      scopePatterns: [{ variable: 'project_id', column: 'project_id' }],
      indexes: [],
      materialize: true,
    }]]),
  };
  const migratorPool = new pg.Pool({ connectionString: migratorUrl });
  const migrator = new SyncularServerStorage(migratorPool);
  await migrator.migrate();                       // CREATE EXTENSION syncular was run?
  await migrator.ensureSchema(schema);            // tables, indexes, register_table, push schema
  await migratorPool.end();

  const pool = new pg.Pool({ connectionString: serverUrl });
  const storage = new SyncularServerStorage(pool);  // the one line a 0.24 host changes
  await storage.ensureSchema(schema);             // check_schema: 'current'
  await storage.touchPartition('acme', Date.now(), randomUUID());

  // A client's payload (here encoded by the extension's codec).
  const { rows } = await pool.query("SELECT syncular.encode_row('tasks', $1::text::jsonb) AS p",
    [JSON.stringify({ id: 't1', project_id: 'p1', title: 'hello' })]);
  const payload = new Uint8Array(rows[0].p);

  // One push, as upstream's push driver calls the storage.
  if ((await storage.getPushResult('acme', 'device-1', 'commit-1')) === undefined) {
    const tx = await storage.begin('acme');
    try {
      await tx.lockPartitionForPush!();
      const gate = await tx.readServeGate(schema.version);
      if (gate.storedSchemaVersion > schema.version || gate.pending.length > 0) throw new Error('not ready');
      if ((await tx.getPushResult!('device-1', 'commit-1')) === undefined) {
        const stored = await tx.getRow('tasks', 't1');
        const serverVersion = (stored?.serverVersion ?? 0) + 1;
        const scopes = { project_id: 'p1' };
        await tx.upsertRow('tasks', { rowId: 't1', serverVersion, scopes, payload }, { opIndex: 0 });
        const commitSeq = await tx.appendCommit({
          clientId: 'device-1', clientCommitId: 'commit-1', actorId: 'alice', createdAtMs: Date.now(),
          changes: [{ table: 'tasks', rowId: 't1', op: 'upsert', rowVersion: serverVersion, scopes, payload }],
        });
        await tx.putPushResult('device-1', 'commit-1', {
          status: 'applied', commitSeq, results: [{ opIndex: 0, status: 'applied' }],
        });
        await tx.commit();
      }
    } finally {
      await tx.rollback();                         // no-op after commit
    }
  }

  // One pull window.
  const commits = await storage.readCommitWindow('acme', {
    table: 'tasks', scopeFilter: { project_id: ['p1'] }, afterSeq: 0,
    throughSeq: await storage.getMaxCommitSeq('acme'), limitChanges: 100,
  });
  await pool.end();
  return commits.map((c) => c.commitSeq);          // [1]
}
