// Test fixtures: a fresh database with the extension per test file, the two roles a deployment
// uses (a migrator in syncular_admin that owns the app tables, a server in syncular_host that
// serves), a compiled schema written as upstream's compiler emits it, and statement counting.
// The storages under test reach the database through the executor SYNCULAR_TS_EXECUTOR names
// (`sourceFor`); the fixtures' own setup and inspection always use node-postgres.
import pg from 'pg';
import { randomUUID } from 'node:crypto';
import { SyncularServerStorage, type StorageSource, type SyncularServerStorageOptions } from '../src/index.js';
import type { CompiledSchema, CompiledTable, PgExecutor, PgQueryable, RowColumn } from '../src/types.js';

/** libpq-style base URL of the cluster; the tests create their own databases in it. */
export const BASE_URL = process.env.SYNCULAR_TS_PG ?? 'postgres://postgres@127.0.0.1:25439/postgres';

/** The URL of `database` as `user` on the cluster of `base` (the tests' cluster by default). */
export function urlFor(database: string, user = 'postgres', base = BASE_URL): string {
  const url = new URL(base);
  url.pathname = `/${database}`;
  url.username = user;
  return url.toString();
}

/**
 * How the storages under test reach the database (scripts/adapter-ts.sh runs the suite once each):
 * - `pg-pool`: a node-postgres `Pool` (named prepared statements), the recommended source;
 * - `pg-executor`: upstream's `PgExecutor` over node-postgres, as its README's `pgPoolExecutor`;
 * - `bun-sql`: upstream's `PgExecutor` over Bun.SQL, as its README's `bunSqlExecutor` and its
 *   real-PostgreSQL tests (`unsafe(text, params)`; the suite then runs under `bun test`).
 */
export const EXECUTOR = (process.env.SYNCULAR_TS_EXECUTOR ?? 'pg-pool') as 'pg-pool' | 'pg-executor' | 'bun-sql';
if (!['pg-pool', 'pg-executor', 'bun-sql'].includes(EXECUTOR)) throw new Error(`unknown SYNCULAR_TS_EXECUTOR ${EXECUTOR}`);

/** Upstream README's node-postgres executor. */
export function pgPoolExecutor(pool: pg.Pool): PgExecutor {
  const over = (c: pg.Pool | pg.PoolClient): PgQueryable => ({
    query: (async (text: string, params?: readonly unknown[]) => c.query(text, params ? [...params] : [])) as PgQueryable['query'],
  });
  return {
    query: over(pool).query,
    async transaction<T>(fn: (client: PgQueryable) => Promise<T>): Promise<T> {
      const client = await pool.connect();
      try {
        await client.query('BEGIN');
        const result = await fn(over(client));
        await client.query('COMMIT');
        return result;
      } catch (error) {
        await client.query('ROLLBACK');
        throw error;
      } finally {
        client.release();
      }
    },
    close: () => pool.end(),
  };
}

/** The part of Bun.SQL the executor uses (typed here: the package does not depend on bun-types). */
interface BunSql {
  unsafe(text: string, params?: unknown[]): Promise<Record<string, unknown>[]>;
  begin<T>(fn: (tx: BunSql) => Promise<T>): Promise<T>;
  end(): Promise<void>;
}

/** Upstream's `bunSqlExecutor` (its README and its real-PostgreSQL tests), verbatim in shape. */
export function bunSqlExecutor(sql: BunSql): PgExecutor {
  const over = (h: BunSql): PgQueryable => ({
    query: (async (text: string, params?: readonly unknown[]) => {
      const rows = await h.unsafe(text, params ? [...params] : []);
      return { rows, rowCount: rows.length };
    }) as PgQueryable['query'],
  });
  return {
    query: over(sql).query,
    transaction: (fn) => sql.begin((tx) => fn(over(tx))),
    close: () => sql.end(),
  };
}

const bunHandles: BunSql[] = [];

/** The source of a storage under test: the pool itself or an executor over the same role. */
export function sourceFor(pool: pg.Pool): StorageSource {
  switch (EXECUTOR) {
    case 'pg-pool':
      return pool;
    case 'pg-executor':
      return pgPoolExecutor(pool);
    case 'bun-sql': {
      const Bun = (globalThis as { Bun?: { SQL: new (url: string, options: { max: number }) => BunSql } }).Bun;
      if (Bun === undefined) throw new Error('SYNCULAR_TS_EXECUTOR=bun-sql needs the Bun runtime (bun test)');
      const options = (pool as unknown as { options: { connectionString: string; max?: number } }).options;
      const sql = new Bun.SQL(options.connectionString, { max: options.max ?? 10 });
      bunHandles.push(sql);
      return bunSqlExecutor(sql);
    }
  }
}

/** A storage under test on `pool`'s role and database, through the suite's executor. */
export function storageOn(pool: pg.Pool, options: SyncularServerStorageOptions = {}): SyncularServerStorage {
  return new SyncularServerStorage(sourceFor(pool), options);
}

export interface Fixture {
  readonly database: string;
  readonly admin: pg.Pool; // superuser, for setup and inspection only
  readonly migrator: pg.Pool; // ts_adapter_migrator: syncular_admin, owns the app tables
  readonly server: pg.Pool; // ts_adapter_server: syncular_host only
  close(): Promise<void>;
}

export async function freshDatabase(name: string): Promise<Fixture> {
  const database = `ts_${name}`;
  const root = new pg.Client({ connectionString: urlFor('postgres') });
  await root.connect();
  try {
    await root.query(`DROP DATABASE IF EXISTS ${database} WITH (FORCE)`);
    await root.query(`CREATE DATABASE ${database}`);
    for (const role of ['ts_adapter_migrator', 'ts_adapter_server']) {
      const exists = await root.query('SELECT 1 FROM pg_roles WHERE rolname = $1', [role]);
      // Test files may run in parallel: a role another file created meanwhile is fine.
      if (exists.rows.length === 0) {
        await root.query(`CREATE ROLE ${role} LOGIN`).catch((error: { code?: string }) => {
          if (error.code !== '42710' && error.code !== '23505') throw error;
        });
      }
    }
  } finally {
    await root.end();
  }
  const admin = new pg.Pool({ connectionString: urlFor(database), max: 2 });
  await admin.query('CREATE EXTENSION syncular');
  await admin.query('GRANT syncular_admin TO ts_adapter_migrator');
  await admin.query('GRANT syncular_host TO ts_adapter_server');
  await admin.query('GRANT CREATE, USAGE ON SCHEMA public TO ts_adapter_migrator');
  await admin.query(
    'ALTER DEFAULT PRIVILEGES FOR ROLE ts_adapter_migrator IN SCHEMA public GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO ts_adapter_server',
  );
  const migrator = new pg.Pool({ connectionString: urlFor(database, 'ts_adapter_migrator'), max: 4 });
  const server = new pg.Pool({ connectionString: urlFor(database, 'ts_adapter_server'), max: 8 });
  return {
    database,
    admin,
    migrator,
    server,
    async close() {
      await Promise.all([admin.end(), migrator.end(), server.end(), ...bunHandles.splice(0).map((sql) => sql.end())]);
    },
  };
}

function table(
  name: string,
  columns: RowColumn[],
  options: { materialize?: boolean; indexes?: CompiledTable['indexes'] } = {},
): CompiledTable {
  return {
    name,
    columns,
    primaryKeyIndex: 0,
    scopePatterns: [{ variable: 'project_id', column: 'project_id' }],
    indexes: options.indexes ?? [],
    materialize: options.materialize ?? true,
  };
}

/** The columns of the smallest `tasks` table: key, scope column, a title. */
const TITLED_COLUMNS: RowColumn[] = [
  { name: 'id', type: 'string', nullable: false },
  { name: 'project_id', type: 'string', nullable: false },
  { name: 'title', type: 'string', nullable: true },
];

/** Version 1 with one `tasks` table of `TITLED_COLUMNS` (the table of docs/TYPESCRIPT.md's minimal host). */
export const TITLED_TASKS: CompiledSchema = { version: 1, tables: new Map([['tasks', table('tasks', TITLED_COLUMNS)]]) };

export const TASK_COLUMNS: RowColumn[] = [
  ...TITLED_COLUMNS,
  { name: 'n', type: 'integer', nullable: true },
  { name: 'score', type: 'float', nullable: true },
  { name: 'done', type: 'boolean', nullable: true },
  { name: 'meta', type: 'json', nullable: true },
  { name: 'data', type: 'bytes', nullable: true },
];

export function schemaV(version: number, extraTaskColumns: RowColumn[] = []): CompiledSchema {
  const tasks = table('tasks', [...TASK_COLUMNS, ...extraTaskColumns], {
    indexes: [{ name: 'tasks_by_title', columns: ['title'] }],
  });
  const notes = table(
    'notes',
    [
      { name: 'id', type: 'string', nullable: false },
      { name: 'project_id', type: 'string', nullable: false },
      { name: 'body', type: 'string', nullable: true },
    ],
    { materialize: false },
  );
  return { version, tables: new Map([['tasks', tasks], ['notes', notes]]) };
}

/** A storage that counts the statements it sends, per label set by `counter.label`. */
export function countingStorage(
  source: pg.Pool,
  options: SyncularServerStorageOptions = {},
): { storage: SyncularServerStorage; counter: StatementCounter } {
  const counter = new StatementCounter();
  const storage = storageOn(source, { ...options, onStatement: (text) => counter.record(text) });
  return { storage, counter };
}

export class StatementCounter {
  readonly statements: string[] = [];
  record(text: string): void {
    this.statements.push(text);
  }
  /** Statements sent while `fn` ran. */
  async count<T>(fn: () => Promise<T>): Promise<{ value: T; statements: string[] }> {
    const start = this.statements.length;
    const value = await fn();
    return { value, statements: this.statements.slice(start) };
  }
}

/** A full-row payload through the extension's codec (the bytes a client sends). */
export async function encode(db: pg.Pool, tableName: string, values: Record<string, unknown>): Promise<Uint8Array> {
  const { rows } = await db.query('SELECT syncular.encode_row($1, $2::text::jsonb) AS p', [tableName, JSON.stringify(values)]);
  return new Uint8Array(rows[0].p as Buffer);
}

export function task(id: string, project: string, title: string | null, extra: Record<string, unknown> = {}) {
  return { id, project_id: project, title, n: null, score: null, done: null, meta: null, data: null, ...extra };
}

export const uuid = () => randomUUID();
export const NOW = 1_750_000_000_000;
