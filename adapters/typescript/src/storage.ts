// `SyncularServerStorage`: upstream's 0.24 `ServerStorage` on the syncular extension's SQL API.
// Each method is one call of the extension (docs/TYPESCRIPT.md has the map); the app rows are
// written by `rows.ts`. Results are converted to upstream's shapes: int8 → number, base64 →
// Uint8Array, optional keys absent (never null).
import { Connection, type Isolation, type Runner, type Session, type StorageSource } from './connection.js';
import { ErrorMapper, isConstraintViolation, sqlstate, type ErrorClasses } from './errors.js';
import {
  AppTable,
  layoutsOf,
  META,
  physicalIndexName,
  pushSchemaOf,
  quoteIdent,
  textArray,
} from './rows.js';
import type {
  AuthoritativeQueryRequest,
  AuthoritativeQueryResult,
  BlobReferencingRow,
  CheckpointDeclaration,
  ClientCursorInfo,
  ClientRecord,
  CommitMetadata,
  CommitMetadataQuery,
  CommitPruneQuery,
  CommitPruneResult,
  CommitWindowQuery,
  CompiledSchema,
  IndexRowScanQuery,
  NewCommit,
  NewReaction,
  PartitionRegistryEntry,
  PgRow,
  PrunedReactionCounts,
  PushOperationResult,
  ReactionClaimQuery,
  ReactionFailureUpdate,
  ReactionListQuery,
  ReactionPruneQuery,
  RowScanQuery,
  ScopeActivityQuery,
  ScopeCommitActivity,
  ScopeMap,
  ServerStorage,
  ServeGate,
  StorageTransaction,
  StoredChange,
  StoredCheckpoint,
  StoredCommit,
  StoredPushResult,
  StoredReaction,
  StoredRow,
} from './types.js';

export interface SyncularServerStorageOptions {
  /** Schema of the app tables (docs/API.md §App-table template). Default `public`. */
  readonly appSchema?: string;
  /** Upstream's error classes (`instanceof` checks in @syncular/server); local ones by default. */
  readonly errors?: ErrorClasses;
  /** Called with the text of every statement sent (tests and the benchmark count them). */
  readonly onStatement?: (text: string) => void;
  /**
   * With a `pg.Pool`: send parameterized statements as named prepared statements (parsed once per
   * connection). Default true; the statement texts are fixed per table, never built from values.
   */
  readonly preparedStatements?: boolean;
}

// ---- conversions -----------------------------------------------------------------------------

function num(value: unknown): number {
  if (typeof value === 'number') return value;
  if (typeof value === 'bigint') return Number(value);
  if (typeof value === 'string') return Number(value);
  if (value === null || value === undefined) return 0;
  throw new Error(`expected a number, got ${typeof value}`);
}

function bytes(value: unknown): Uint8Array {
  // A plain Uint8Array view (no copy) of node-postgres' Buffer.
  if (value instanceof Uint8Array) return new Uint8Array(value.buffer, value.byteOffset, value.byteLength);
  if (typeof value === 'string') return fromBase64(value);
  throw new Error(`expected bytes, got ${typeof value}`);
}

function fromBase64(text: string): Uint8Array {
  return new Uint8Array(Buffer.from(text, 'base64'));
}

function toBase64(data: Uint8Array): string {
  return Buffer.from(data.buffer, data.byteOffset, data.byteLength).toString('base64');
}

function asBuffer(data: Uint8Array | undefined): Buffer | null {
  return data === undefined ? null : Buffer.from(data.buffer, data.byteOffset, data.byteLength);
}

function json<T>(value: unknown): T {
  return (typeof value === 'string' ? JSON.parse(value) : value) as T;
}

/** The first column of the first row. */
function first(result: { rows: PgRow[] }): unknown {
  const row = result.rows[0];
  return row === undefined ? undefined : Object.values(row)[0];
}

const j = (value: unknown): string => JSON.stringify(value);

interface RowRecord {
  row_id: string;
  server_version: unknown;
  scopes: unknown;
  payload: unknown;
  column_versions: unknown;
}

function toStoredRow(record: RowRecord): StoredRow {
  return {
    rowId: record.row_id,
    serverVersion: num(record.server_version),
    scopes: json<Record<string, string>>(record.scopes),
    payload: bytes(record.payload),
    ...(record.column_versions === null || record.column_versions === undefined
      ? {}
      : { columnVersions: bytes(record.column_versions) }),
  };
}

function toCheckpoint(record: PgRow): StoredCheckpoint {
  return {
    partition: record.partition as string,
    name: record.name as string,
    schemaVersion: num(record.schema_version),
    state: record.state as StoredCheckpoint['state'],
    watermark: num(record.watermark),
    ownerEpoch: num(record.owner_epoch),
    observedRows: num(record.observed_rows),
    updatedAtMs: num(record.updated_at_ms),
  };
}

function toEntry(value: unknown): PartitionRegistryEntry {
  const e = json<Record<string, unknown>>(value);
  return {
    partition: e.partition as string,
    logEpoch: e.logEpoch as string,
    epochRequired: e.epochRequired as boolean,
    lastAuthenticatedAtMs: num(e.lastAuthenticatedAtMs),
  };
}

function toGate(value: unknown): ServeGate {
  const g = json<{ storedSchemaVersion: unknown; logEpoch?: string | null; pending?: { partition: string; name: string }[] }>(value);
  return {
    storedSchemaVersion: num(g.storedSchemaVersion),
    logEpoch: g.logEpoch ?? undefined,
    pending: (g.pending ?? []).map((p) => ({ partition: p.partition, name: p.name })),
  };
}

function toReaction(value: unknown): StoredReaction {
  // The extension returns upstream's object: camelCase, optional keys only when set.
  return json<StoredReaction>(value);
}

function toClient(value: unknown): ClientRecord {
  const c = json<Record<string, unknown>>(value);
  return {
    clientId: c.clientId as string,
    actorId: c.actorId as string,
    wireVersion: num(c.wireVersion),
    cursor: num(c.cursor),
    updatedAtMs: num(c.updatedAtMs),
    subscriptions: (c.subscriptions ?? []) as ClientRecord['subscriptions'],
  };
}

/** The push-result document as stored (bytes in base64, optional keys absent). */
function serializePushResult(result: StoredPushResult): unknown {
  return {
    status: result.status,
    ...(result.commitSeq !== undefined ? { commitSeq: result.commitSeq } : {}),
    ...(result.recordedAtMs !== undefined ? { recordedAtMs: result.recordedAtMs } : {}),
    ...(result.cacheIdentity !== undefined ? { cacheIdentity: result.cacheIdentity } : {}),
    results: result.results.map((r) => {
      if (r.status === 'conflict') {
        return {
          opIndex: r.opIndex,
          status: r.status,
          code: r.code,
          message: r.message,
          serverVersion: r.serverVersion,
          // Absent bytes stay absent; the stored document then reads them as empty bytes.
          ...(r.serverRow !== undefined ? { serverRow: toBase64(r.serverRow) } : {}),
          ...(r.conflictColumns !== undefined ? { conflictColumns: toBase64(r.conflictColumns) } : {}),
        };
      }
      if (r.status === 'error') {
        return {
          opIndex: r.opIndex,
          status: r.status,
          code: r.code,
          message: r.message,
          retryable: r.retryable,
          ...(r.details !== undefined ? { details: r.details } : {}),
        };
      }
      return { opIndex: r.opIndex, status: r.status };
    }),
  };
}

/** The normalized document `get_push_result` returns, as upstream's `StoredPushResult`. */
function deserializePushResult(value: unknown): StoredPushResult {
  const doc = json<{
    status: 'applied' | 'rejected';
    commitSeq?: number;
    recordedAtMs?: number;
    cacheIdentity?: string;
    results: Record<string, unknown>[];
  }>(value);
  const results: PushOperationResult[] = doc.results.map((r) => {
    const opIndex = num(r.opIndex);
    if (r.status === 'conflict') {
      return {
        opIndex,
        status: 'conflict',
        code: (r.code as string | undefined) ?? '',
        message: (r.message as string | undefined) ?? '',
        serverVersion: num(r.serverVersion),
        serverRow: fromBase64((r.serverRow as string | undefined) ?? ''),
        conflictColumns: fromBase64((r.conflictColumns as string | undefined) ?? ''),
      };
    }
    if (r.status === 'error') {
      return {
        opIndex,
        status: 'error',
        code: (r.code as string | undefined) ?? '',
        message: (r.message as string | undefined) ?? '',
        retryable: (r.retryable as boolean | undefined) ?? false,
        ...(r.details !== undefined ? { details: r.details } : {}),
      };
    }
    return { opIndex, status: 'applied' };
  });
  return {
    status: doc.status,
    ...(doc.commitSeq !== undefined ? { commitSeq: num(doc.commitSeq) } : {}),
    ...(doc.recordedAtMs !== undefined ? { recordedAtMs: num(doc.recordedAtMs) } : {}),
    ...(doc.cacheIdentity !== undefined ? { cacheIdentity: doc.cacheIdentity } : {}),
    results,
  };
}

function commitDocument(commit: NewCommit, writerVersion: number): string {
  return j({
    clientId: commit.clientId,
    clientCommitId: commit.clientCommitId,
    actorId: commit.actorId,
    createdAtMs: commit.createdAtMs,
    writerVersion,
    changes: commit.changes.map((c) => ({
      table: c.table,
      rowId: c.rowId,
      op: c.op,
      ...(c.rowVersion !== undefined ? { rowVersion: c.rowVersion } : {}),
      scopes: c.scopes,
      ...(c.payload !== undefined ? { payload: toBase64(c.payload) } : {}),
    })),
  });
}

/** The first scope variable (UTF-16 order) and its values, as the window and scans use them. */
function firstScope(filter: ScopeMap | null | undefined): { variable: string | undefined; values: readonly string[] } {
  const variable = filter === null || filter === undefined ? undefined : Object.keys(filter).sort()[0];
  return { variable, values: variable === undefined ? [] : (filter?.[variable] ?? []) };
}

/**
 * `migrate_schema`'s refusal of a layout change that is not an append of nullable columns
 * (`SY000`, `details.argument` = `layouts.<table>[i]…`) gets upstream's sentence as its message,
 * which hosts and upstream's readiness check match (`… must be nullable`); code and details stay.
 */
function appendOnlyWording(error: unknown, schema: CompiledSchema): void {
  const e = error as { code?: unknown; details?: { argument?: unknown; reason?: unknown }; message?: unknown };
  if (!(error instanceof Error) || e.code !== 'sync.storage.invalid_argument') return;
  const argument = e.details?.argument;
  const reason = e.details?.reason;
  if (typeof argument !== 'string' || !argument.startsWith('layouts.')) return;
  for (const table of schema.tables.values()) {
    const path = `layouts.${table.name}`;
    if (!argument.startsWith(path)) continue;
    const position = /^\[(\d+)\]/.exec(argument.slice(path.length));
    const column = position === null ? undefined : table.columns[Number(position[1])];
    const name = JSON.stringify(table.name);
    if (reason === 'removed' && argument === path) {
      error.message = `table ${name}: the schema removed columns — only appending nullable columns is supported; indexes may be created, replaced, or dropped independently`;
      return;
    }
    if (column === undefined) continue;
    if (reason === 'not_nullable' && argument === `${path}[${position?.[1]}].nullable`) {
      error.message = `table ${name}: added column ${JSON.stringify(column.name)} must be nullable — existing rows have no value to backfill`;
      return;
    }
    if (reason === 'changed' && argument === `${path}[${position?.[1]}]`) {
      const now = { name: column.name, type: column.type, nullable: column.nullable };
      error.message = `table ${name}: column ${position?.[1]} changed (now ${JSON.stringify(now)}) — only appending nullable columns is supported`;
      return;
    }
  }
}

// ---- shared calls (pool or transaction) ------------------------------------------------------

async function getRowOn(
  db: Runner,
  storage: SyncularServerStorage,
  partition: string,
  table: string,
  rowId: string,
): Promise<StoredRow | undefined> {
  const { rows } = await db.query<RowRecord>(storage.appTable(table).selectRowSql(), [partition, rowId]);
  return rows[0] === undefined ? undefined : toStoredRow(rows[0]);
}

async function readServeGateOn(db: Runner, partition: string, runningSchemaVersion: number): Promise<ServeGate> {
  return toGate(first(await db.query('SELECT syncular.read_serve_gate($1, $2)', [partition, runningSchemaVersion])));
}

async function advanceCheckpointOn(
  db: Runner,
  ...args: Parameters<ServerStorage['advanceCheckpoint']>
): Promise<boolean> {
  return first(await db.query('SELECT syncular.advance_checkpoint($1, $2, $3, $4, $5, $6)', args)) === true;
}

async function getPushResultOn(
  db: Runner,
  partition: string,
  clientId: string,
  clientCommitId: string,
): Promise<StoredPushResult | undefined> {
  const result = await db.query('SELECT syncular.get_push_result($1, $2, $3)', [partition, clientId, clientCommitId]);
  const doc = first(result);
  return doc === null || doc === undefined ? undefined : deserializePushResult(doc);
}

async function scanRowsOn(
  db: Runner,
  storage: SyncularServerStorage,
  partition: string,
  query: RowScanQuery,
): Promise<StoredRow[]> {
  const { variable, values } = firstScope(query.scopeFilter);
  if (variable === undefined) throw storage.errors.storageQueryError('sync.storage.scan_requires_scope');
  if (values.length === 0 || query.limit <= 0) return [];
  const { rows } = await db.query<RowRecord>(
    'SELECT row_id, server_version, scopes, payload, column_versions FROM syncular.scan_rows($1, $2, $3::text::jsonb, $4, $5)',
    [partition, query.table, j(query.scopeFilter), query.afterRowId, query.limit],
  );
  return rows.map(toStoredRow);
}

async function scanRowsByIndexOn(
  db: Runner,
  storage: SyncularServerStorage,
  partition: string,
  query: IndexRowScanQuery,
): Promise<StoredRow[]> {
  const table = storage.appTable(query.table);
  const e = storage.errors;
  if (!Number.isInteger(query.limit) || query.limit < 1 || query.limit > 1_000) {
    throw e.storageQueryError('sync.storage.invalid_limit');
  }
  if (!table.compiled.materialize) throw e.storageQueryError('sync.storage.index_not_materialized');
  const index = table.compiled.indexes.find((candidate) => candidate.name === query.index);
  if (index === undefined) throw e.storageQueryError('sync.storage.index_not_found');
  if (!Array.isArray(query.values) || query.values.length !== index.columns.length) {
    throw e.storageQueryError('sync.storage.index_value_count_mismatch');
  }
  const statement = table.indexScanStatement(index.columns, query.values, partition, query.afterRowId ?? '', query.limit);
  const { rows } = await db.query<RowRecord>(statement.sql, statement.params);
  return rows.map(toStoredRow);
}

/** The registered query with every planned relation replaced by the partition's rows. */
function rewriteAuthoritative(
  storage: SyncularServerStorage,
  partition: string,
  query: AuthoritativeQueryRequest,
): { sql: string; params: unknown[] } {
  const plan = query.plan;
  if (plan === undefined || typeof plan.sql !== 'string' || !Array.isArray(plan.relations)) {
    throw new Error('registered query requires generated relation plans; regenerate queries');
  }
  const declared = new Set(query.tables);
  const found = new Set<string>();
  const sql = plan.sql;
  let previousEnd = 0;
  for (const relation of plan.relations) {
    if (
      !Number.isSafeInteger(relation.start) ||
      !Number.isSafeInteger(relation.end) ||
      relation.start < previousEnd ||
      relation.end <= relation.start ||
      relation.end > sql.length
    ) {
      throw new Error('registered query relation boundaries do not match its SQL; regenerate queries');
    }
    previousEnd = relation.end;
    if (!declared.has(relation.table)) throw new Error('registered query table metadata does not match its SQL');
    const spelling = sql.slice(relation.start, relation.end);
    const quote = spelling[0];
    const name =
      quote === '"' || quote === '`' ? spelling.slice(1, -1).split(quote + quote).join(quote) : quote === '[' ? spelling.slice(1, -1) : spelling;
    if (name.toLowerCase() !== relation.table.toLowerCase()) {
      throw new Error('registered query relation name does not match its SQL; regenerate queries');
    }
    found.add(relation.table);
  }
  if (found.size !== declared.size) throw new Error('registered query table metadata does not match its SQL');
  const params: unknown[] = [];
  const bind = (value: unknown): string => {
    params.push(value instanceof Uint8Array ? asBuffer(value) : typeof value === 'bigint' ? value.toString() : value);
    return `$${params.length}`;
  };
  let out = '';
  let anonymous = 0;
  let next = 0;
  for (let i = 0; i < sql.length; i++) {
    const relation = plan.relations[next];
    if (relation !== undefined && relation.start === i) {
      const table = storage.appTable(relation.table);
      if (!table.compiled.materialize) throw new Error('registered query targets a non-materialized table');
      const columns = table.compiled.columns.map((c) => quoteIdent(c.name)).join(', ');
      out += `(SELECT ${columns} FROM ${table.relation} WHERE ${quoteIdent(META.partition)}=${bind(partition)})${relation.alias === undefined ? ` AS ${quoteIdent(relation.table)}` : ''}`;
      i = relation.end - 1;
      next++;
      continue;
    }
    const ch = sql[i] as string;
    const protectedEnd = protectedSqlEnd(sql, i);
    if (protectedEnd !== undefined) {
      out += sql.slice(i, protectedEnd);
      i = protectedEnd - 1;
      continue;
    }
    if (ch !== '?') {
      out += ch;
      continue;
    }
    let end = i + 1;
    while (end < sql.length && /[0-9]/.test(sql[end] as string)) end++;
    const digits = sql.slice(i + 1, end);
    const index = digits.length > 0 ? Number.parseInt(digits, 10) - 1 : anonymous++;
    if (digits.length > 0) anonymous = Math.max(anonymous, index + 1);
    if (index < 0 || index >= query.params.length || query.params[index] === undefined) {
      throw new Error('registered query bind metadata does not match its SQL');
    }
    out += bind(query.params[index]);
    i = end - 1;
  }
  return { sql: out, params };
}

/** End of a quoted string, quoted identifier or comment starting at `i`, else undefined. */
function protectedSqlEnd(sql: string, i: number): number | undefined {
  const ch = sql[i];
  const next = sql[i + 1];
  if (ch === "'" || ch === '"' || ch === '`') {
    let end = i + 1;
    while (end < sql.length) {
      if (sql[end] === ch && sql[end + 1] === ch) end += 2;
      else if (sql[end] === ch) return end + 1;
      else end++;
    }
    return sql.length;
  }
  if (ch === '-' && next === '-') {
    const end = sql.indexOf('\n', i);
    return end < 0 ? sql.length : end;
  }
  if (ch === '/' && next === '*') {
    const end = sql.indexOf('*/', i + 2);
    return end < 0 ? sql.length : end + 2;
  }
  return undefined;
}

async function queryAuthoritativeOn(
  db: Runner,
  statement: { sql: string; params: unknown[] },
): Promise<Readonly<Record<string, unknown>>[]> {
  const { rows } = await db.query<Readonly<Record<string, unknown>>>(statement.sql, statement.params);
  return rows;
}

// ---- the transaction -------------------------------------------------------------------------

const SAVEPOINT = 'syncular_push_candidate';

class SyncularTransaction implements StorageTransaction {
  readonly #session: Session;
  readonly #storage: SyncularServerStorage;
  readonly #partition: string;
  readonly #writerVersion: number;
  #open = true;
  #savepoint = false;
  /** `prefetchRows` answers keyed `table\0rowId`; null = read as absent. Writes drop the key. */
  readonly #rows = new Map<string, StoredRow | null>();
  readonly #tombstones = new Map<string, number | null>();

  constructor(session: Session, storage: SyncularServerStorage, partition: string, writerVersion: number) {
    this.#session = session;
    this.#storage = storage;
    this.#partition = partition;
    this.#writerVersion = writerVersion;
  }

  #assertOpen(): void {
    if (!this.#open) throw new Error('transaction already finished');
  }

  async getRow(table: string, rowId: string): Promise<StoredRow | undefined> {
    this.#assertOpen();
    const cached = this.#rows.get(`${table}\u0000${rowId}`);
    if (cached !== undefined) return cached ?? undefined;
    return getRowOn(this.#session, this.#storage, this.#partition, table, rowId);
  }

  async prefetchRows(table: string, rowIds: readonly string[]): Promise<void> {
    this.#assertOpen();
    const ids = [...new Set(rowIds)].filter((id) => !this.#rows.has(`${table}\u0000${id}`));
    if (ids.length === 0) return;
    const { rows } = await this.#session.query<RowRecord & { lookup_id: string; tombstone_seq: unknown }>(
      this.#storage.appTable(table).prefetchSql(),
      [this.#partition, textArray(ids), table],
    );
    for (const record of rows) {
      const key = `${table}\u0000${record.lookup_id}`;
      this.#rows.set(key, record.row_id === null ? null : toStoredRow(record));
      this.#tombstones.set(
        key,
        record.tombstone_seq === null || record.tombstone_seq === undefined ? null : num(record.tombstone_seq),
      );
    }
  }

  async getTombstoneSeq(table: string, rowId: string): Promise<number | undefined> {
    this.#assertOpen();
    const cached = this.#tombstones.get(`${table}\u0000${rowId}`);
    if (cached !== undefined) return cached ?? undefined;
    const seq = first(
      await this.#session.query('SELECT syncular.get_tombstone_seq($1, $2, $3)', [this.#partition, table, rowId]),
    );
    return seq === null || seq === undefined ? undefined : num(seq);
  }

  async clearTombstone(table: string, rowId: string): Promise<void> {
    this.#assertOpen();
    this.#tombstones.delete(`${table}\u0000${rowId}`);
    await this.#session.query('SELECT syncular.clear_tombstone($1, $2, $3)', [this.#partition, table, rowId]);
  }

  getPushResult(clientId: string, clientCommitId: string): Promise<StoredPushResult | undefined> {
    this.#assertOpen();
    return getPushResultOn(this.#session, this.#partition, clientId, clientCommitId);
  }

  scanRows(query: RowScanQuery): Promise<StoredRow[]> {
    this.#assertOpen();
    return scanRowsOn(this.#session, this.#storage, this.#partition, query);
  }

  scanRowsByIndex(query: IndexRowScanQuery): Promise<StoredRow[]> {
    this.#assertOpen();
    return scanRowsByIndexOn(this.#session, this.#storage, this.#partition, query);
  }

  async queryAuthoritative(query: AuthoritativeQueryRequest): Promise<AuthoritativeQueryResult> {
    this.#assertOpen();
    const statement = rewriteAuthoritative(this.#storage, this.#partition, query);
    const rows = await queryAuthoritativeOn(this.#session, statement);
    const seq = first(await this.#session.query('SELECT syncular.max_commit_seq($1)', [this.#partition]));
    return { rows, maxCommitSeq: num(seq) };
  }

  async lockPartitionForPush(): Promise<void> {
    this.#assertOpen();
    await this.#session.query('SELECT syncular.lock_partition($1)', [this.#partition]);
    await this.#session.query(`SAVEPOINT ${SAVEPOINT}`);
    this.#savepoint = true;
  }

  /** @deprecated upstream's alias of `lockPartitionForPush`. */
  lockPartitionForCommitValidation(): Promise<void> {
    return this.lockPartitionForPush();
  }

  async commitRejectedPushResult(
    clientId: string,
    clientCommitId: string,
    result: StoredPushResult,
  ): Promise<void> {
    this.#assertOpen();
    if (!this.#savepoint) throw new Error('push rejection requires its apply savepoint');
    await this.#session.query(`ROLLBACK TO SAVEPOINT ${SAVEPOINT}`);
    await this.#session.query(`RELEASE SAVEPOINT ${SAVEPOINT}`);
    this.#savepoint = false;
    this.#rows.clear();
    this.#tombstones.clear();
    await this.putPushResult(clientId, clientCommitId, result);
    await this.commit();
  }

  async upsertRow(table: string, row: StoredRow, context?: { readonly opIndex: number }): Promise<void> {
    this.#assertOpen();
    this.#rows.delete(`${table}\u0000${row.rowId}`);
    try {
      await this.#session.query(this.#storage.appTable(table).upsertSql(), [
        this.#partition,
        row.rowId,
        row.serverVersion,
        j(row.scopes),
        asBuffer(row.payload),
        asBuffer(row.columnVersions),
        table,
      ]);
    } catch (error) {
      await this.#storage.errors.ready;
      if (isConstraintViolation(error)) throw new this.#storage.errors.constraint(error, context?.opIndex);
      throw error;
    }
  }

  async deleteRow(table: string, rowId: string): Promise<void> {
    this.#assertOpen();
    this.#rows.delete(`${table}\u0000${rowId}`);
    await this.#session.query(this.#storage.appTable(table).deleteSql(), [this.#partition, rowId, table]);
  }

  async setBlobRefs(table: string, rowId: string, blobIds: readonly string[]): Promise<void> {
    this.#assertOpen();
    await this.#session.query('SELECT syncular.set_blob_refs($1, $2, $3, $4::text::text[])', [
      this.#partition,
      table,
      rowId,
      textArray(blobIds),
    ]);
  }

  async appendCommit(commit: NewCommit): Promise<number> {
    this.#assertOpen();
    // The commit writes its delete tombstones.
    this.#tombstones.clear();
    const seq = first(
      await this.#session.query('SELECT syncular.append_commit($1, $2::text::jsonb)', [
        this.#partition,
        commitDocument(commit, this.#writerVersion),
      ]),
    );
    return num(seq);
  }

  async putPushResult(clientId: string, clientCommitId: string, result: StoredPushResult): Promise<void> {
    this.#assertOpen();
    await this.#session.query('SELECT syncular.put_push_result($1, $2, $3, $4::text::jsonb)', [
      this.#partition,
      clientId,
      clientCommitId,
      j(serializePushResult(result)),
    ]);
  }

  async enqueueReactions(reactions: readonly NewReaction[]): Promise<void> {
    this.#assertOpen();
    if (reactions.length === 0) return;
    await this.#session.query('SELECT syncular.enqueue_reactions($1, $2::text::jsonb)', [
      this.#partition,
      j(reactions),
    ]);
  }

  async advanceCheckpoint(
    name: string,
    ownerEpoch: number,
    watermark: number,
    observedRows: number,
    nowMs: number,
  ): Promise<boolean> {
    this.#assertOpen();
    return advanceCheckpointOn(this.#session, this.#partition, name, ownerEpoch, watermark, observedRows, nowMs);
  }

  async readServeGate(runningSchemaVersion: number): Promise<ServeGate> {
    this.#assertOpen();
    return readServeGateOn(this.#session, this.#partition, runningSchemaVersion);
  }

  async commit(): Promise<void> {
    this.#assertOpen();
    this.#open = false;
    await this.#session.end(true);
  }

  async rollback(): Promise<void> {
    if (!this.#open) return;
    this.#open = false;
    await this.#session.end(false).catch(() => undefined);
  }
}

// ---- the storage -----------------------------------------------------------------------------

export class SyncularServerStorage implements ServerStorage {
  readonly errors: ErrorMapper;
  readonly #db: Connection;
  readonly #appSchema: string;
  #tables: Map<string, AppTable> | undefined;
  #schemaVersion: number | undefined;

  /** `source`: a `pg.Pool` (recommended) or upstream's `PgExecutor`. */
  constructor(source: StorageSource, options: SyncularServerStorageOptions = {}) {
    this.errors = new ErrorMapper(options.errors);
    this.#db = new Connection(source, this.errors, options.onStatement, options.preparedStatements ?? true);
    this.#appSchema = options.appSchema ?? 'public';
  }

  /** The first column of the first row of one statement. */
  async #value(text: string, params?: readonly unknown[]): Promise<unknown> {
    return first(await this.#db.query(text, params));
  }

  /** The JSON array one statement returns (NULL: none). */
  async #list<T>(text: string, params?: readonly unknown[]): Promise<T[]> {
    return json<T[] | null>(await this.#value(text, params)) ?? [];
  }

  /** The schema version `ensureSchema` established (the writer version of appended commits). */
  get schemaVersion(): number | undefined {
    return this.#schemaVersion;
  }

  /** The app table of `name`; row operations require `ensureSchema`. */
  appTable(name: string): AppTable {
    const table = this.#tables?.get(name);
    if (table === undefined) {
      throw new Error(`unknown table ${JSON.stringify(name)} — ensureSchema(schema) must run before row operations`);
    }
    return table;
  }

  /**
   * Upstream's `migrate()` created the `sync_*` tables; the extension owns them now. This only
   * checks that `CREATE EXTENSION syncular` was run in this database.
   */
  async migrate(): Promise<void> {
    const version = await this.#value("SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'syncular'");
    if (typeof version !== 'string') {
      throw new Error(
        'the syncular extension is not installed in this database: run `CREATE EXTENSION syncular;` as its owner (docs/TYPESCRIPT.md)',
      );
    }
  }

  async ensureSchema(schema: CompiledSchema, checkpoints?: readonly CheckpointDeclaration[]): Promise<void> {
    if (this.#schemaVersion === schema.version && this.#tables !== undefined) return;
    await this.errors.ready;
    const tables = new Map<string, AppTable>();
    for (const compiled of schema.tables.values()) tables.set(compiled.name, new AppTable(this.#appSchema, compiled));
    const layouts = j(layoutsOf(schema));
    const declared = j(
      (checkpoints ?? []).map((c) => ({ partition: c.partition, name: c.name, schemaVersion: c.schemaVersion })),
    );
    const state = await this.#value('SELECT syncular.check_schema($1, $2::text::jsonb, $3::text::jsonb)', [
      schema.version,
      layouts,
      declared,
    ]);
    if (state === 'migrate') {
      try {
        await this.#db.transaction((session) => this.#migrateOn(session, schema, tables, layouts, declared));
      } catch (error) {
        appendOnlyWording(error, schema);
        if (sqlstate(error) === '42501') {
          throw new Error(
            `ensureSchema: the database is not at schema version ${schema.version} and migrating it needs a role in syncular_admin that may create the app tables (docs/TYPESCRIPT.md, Roles): ${(error as Error).message}`,
            { cause: error },
          );
        }
        throw error;
      }
    } else {
      await this.#assertPhysicalLayout(this.#db, tables);
    }
    this.#tables = tables;
    this.#schemaVersion = schema.version;
  }

  /** The columns of every app relation that exists: table → column → {type, notNull}. */
  async #introspect(
    db: Runner,
    names: readonly string[],
  ): Promise<Map<string, Map<string, { type: string; notNull: boolean }>>> {
    const { rows } = await db.query<{ tbl: string; name: string; type: string; not_null: boolean }>(
      `SELECT c.relname AS tbl, a.attname AS name, pg_catalog.format_type(a.atttypid, a.atttypmod) AS type,
              a.attnotnull AS not_null
         FROM pg_catalog.pg_class c
         JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
         JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
        WHERE n.nspname = $1 AND c.relname = ANY($2::text::text[]) AND c.relkind IN ('r', 'p')`,
      [this.#appSchema, textArray(names)],
    );
    const out = new Map<string, Map<string, { type: string; notNull: boolean }>>();
    for (const row of rows) {
      let columns = out.get(row.tbl);
      if (columns === undefined) out.set(row.tbl, (columns = new Map()));
      columns.set(row.name, { type: row.type, notNull: row.not_null });
    }
    return out;
  }

  /** Upstream's startup check of existing tables: every materialized column at its type. */
  async #assertPhysicalLayout(db: Runner, tables: ReadonlyMap<string, AppTable>): Promise<void> {
    const found = await this.#introspect(db, [...tables.keys()]);
    for (const table of tables.values()) {
      const columns = found.get(table.name);
      const mismatch = (column?: string) =>
        this.errors.storageQueryError(
          'sync.storage.stored_layout_mismatch',
          j({ table: table.name, ...(column !== undefined ? { column } : {}) }),
        );
      if (columns === undefined) throw mismatch();
      for (const c of table.appColumns) {
        const stored = columns.get(c.name);
        const expected = { string: 'text', blob_ref: 'text', json: 'jsonb', integer: 'bigint', float: 'double precision', boolean: 'boolean', bytes: 'bytea', crdt: 'bytea' }[c.type];
        if (stored === undefined || stored.type !== expected || (c.nullable && stored.notNull)) throw mismatch(c.name);
      }
      for (const meta of [META.partition, META.rowId, META.version, META.scopes, META.payload]) {
        if (!columns.has(meta)) throw mismatch(meta);
      }
    }
  }

  /** `check_schema` said migrate: the barrier first, then the app tables' DDL, in one transaction. */
  async #migrateOn(
    db: Session,
    schema: CompiledSchema,
    tables: ReadonlyMap<string, AppTable>,
    layouts: string,
    declared: string,
  ): Promise<void> {
    const previous = num(
      first(
        await db.query('SELECT syncular.migrate_schema($1, $2::text::jsonb, $3::text::jsonb)', [
          schema.version,
          layouts,
          declared,
        ]),
      ),
    );
    // Another migrator finished first: its DDL is in place.
    if (previous === schema.version) return;
    const before = json<{ layouts?: Record<string, { name: string; type: string; nullable: boolean }[]> } | null>(
      first(await db.query('SELECT syncular.previous_schema()')),
    );
    const oldLayouts = before?.layouts ?? {};
    const retired = Object.keys(oldLayouts).filter((name) => !tables.has(name));
    const existing = await this.#introspect(db, [...tables.keys(), ...retired]);
    for (const name of retired) {
      await db.query(
        `SELECT syncular.retire_table(t.name)
           FROM jsonb_array_elements(syncular.list_tables()) AS e(x), LATERAL (SELECT e.x->>'table' AS name) t
          WHERE t.name = $1`,
        [name],
      );
      if (existing.has(name)) await db.query(`DROP TABLE IF EXISTS ${quoteIdent(this.#appSchema)}.${quoteIdent(name)}`);
    }
    const { rows: ownedIndexes } = await db.query<{ tbl: string; name: string }>(
      `SELECT t.relname AS tbl, i.relname AS name
         FROM pg_catalog.pg_index x
         JOIN pg_catalog.pg_class t ON t.oid = x.indrelid
         JOIN pg_catalog.pg_class i ON i.oid = x.indexrelid
         JOIN pg_catalog.pg_namespace n ON n.oid = t.relnamespace
        WHERE n.nspname = $1 AND t.relname = ANY($2::text::text[]) AND i.relname LIKE 'sync\\_ix\\_%'
          AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_constraint k WHERE k.conindid = x.indexrelid)`,
      [this.#appSchema, textArray([...tables.keys()])],
    );
    const backfills: { table: AppTable; columns: string[] }[] = [];
    for (const table of tables.values()) {
      const columns = existing.get(table.name);
      const oldLayout = oldLayouts[table.name];
      if (columns === undefined) {
        await db.query(table.createTableDdl());
      } else {
        const added = table.addColumnDdl(new Set(columns.keys()));
        for (const statement of added) await db.query(statement.sql);
        // Columns the old layout already had but the relation lacked: materialization turned on.
        const known = new Set((oldLayout ?? []).map((c) => c.name));
        const refill = added.map((a) => a.column).filter((name) => known.has(name));
        if (refill.length > 0) backfills.push({ table, columns: refill });
        // Stored payloads: migrate_schema refused any change but appended nullable columns and
        // re-encoded the rows of every registered table whose layout grew (docs/API.md §5).
      }
      const declaredNames = new Set(table.compiled.materialize ? table.compiled.indexes.map((i) => physicalIndexName(i.name)) : []);
      for (const index of ownedIndexes.filter((i) => i.tbl === table.name)) {
        if (!declaredNames.has(index.name)) {
          await db.query(`DROP INDEX IF EXISTS ${quoteIdent(this.#appSchema)}.${quoteIdent(index.name)}`);
        }
      }
      for (const statement of table.createIndexDdl()) await db.query(statement);
      await db.query('SELECT syncular.register_table($1, $2::regclass)', [table.name, table.relation]);
    }
    await db.query('SELECT syncular.set_push_schema($1, $2::text::jsonb)', [schema.version, j(pushSchemaOf(schema))]);
    for (const { table, columns } of backfills) {
      const sql = table.backfillSql(columns);
      if (sql !== undefined) await db.query(sql, [table.name]);
    }
  }

  /**
   * Store the compiled schema as the extension's push schema (`set_push_schema`, syncular_admin).
   * `ensureSchema` does it in every migration; call it once after adopting a 0.24 database
   * (`adopt_legacy_tables`), whose marker is already current (docs/TYPESCRIPT.md).
   */
  async setPushSchema(schema: CompiledSchema): Promise<void> {
    await this.#db.query('SELECT syncular.set_push_schema($1, $2::text::jsonb)', [schema.version, j(pushSchemaOf(schema))]);
  }

  async touchPartition(partition: string, authenticatedAtMs: number, initialLogEpoch: string): Promise<PartitionRegistryEntry> {
    return toEntry(
      await this.#value('SELECT syncular.touch_partition($1, $2, $3)', [partition, authenticatedAtMs, initialLogEpoch]),
    );
  }

  async rotatePartitionLogEpoch(partition: string, logEpoch: string, authenticatedAtMs: number): Promise<PartitionRegistryEntry> {
    return toEntry(
      await this.#value('SELECT syncular.rotate_log_epoch($1, $2, $3)', [partition, logEpoch, authenticatedAtMs]),
    );
  }

  async listPartitionRegistry(): Promise<PartitionRegistryEntry[]> {
    const list = await this.#list<unknown>('SELECT syncular.list_partition_registry()');
    return list.map(toEntry);
  }

  async listPartitions(): Promise<string[]> {
    return ((await this.#value('SELECT syncular.list_partitions()')) as string[] | null) ?? [];
  }

  async getPartitionLogEpoch(partition: string): Promise<string | undefined> {
    const epoch = await this.#value('SELECT syncular.get_log_epoch($1)', [partition]);
    return typeof epoch === 'string' ? epoch : undefined;
  }

  /** BEGIN on one pooled connection; no lock is taken (upstream's contract). */
  async begin(partition: string): Promise<StorageTransaction> {
    const session = await this.#db.session();
    return new SyncularTransaction(session, this, partition, this.#schemaVersion ?? 0);
  }

  async getMaxCommitSeq(partition: string): Promise<number> {
    return num(await this.#value('SELECT syncular.max_commit_seq($1)', [partition]));
  }

  async getHorizonSeq(partition: string): Promise<number> {
    return num(await this.#value('SELECT syncular.horizon_seq($1)', [partition]));
  }

  async setHorizonSeq(partition: string, seq: number): Promise<void> {
    await this.#db.query('SELECT syncular.set_horizon_seq($1, $2)', [partition, seq]);
  }

  async pruneCommitsThrough(partition: string, query: CommitPruneQuery): Promise<CommitPruneResult> {
    const r = json<Record<string, unknown>>(
      await this.#value('SELECT syncular.prune_commits_through($1, $2, $3)', [partition, query.logEpoch, query.throughSeq]),
    );
    return {
      previousHorizonSeq: num(r.previousHorizonSeq),
      horizonSeq: num(r.horizonSeq),
      removedCommits: num(r.removedCommits),
    };
  }

  async getCommitSeqBefore(partition: string, createdBeforeMs: number): Promise<number> {
    return num(await this.#value('SELECT syncular.commit_seq_before($1, $2)', [partition, createdBeforeMs]));
  }

  async readCheckpoints(partition: string): Promise<StoredCheckpoint[]> {
    const { rows } = await this.#db.query('SELECT * FROM syncular.read_checkpoints($1)', [partition]);
    return rows.map(toCheckpoint);
  }

  readServeGate(partition: string, runningSchemaVersion: number): Promise<ServeGate> {
    return readServeGateOn(this.#db, partition, runningSchemaVersion);
  }

  declareCheckpoint(partition: string, name: string, schemaVersion: number, nowMs: number): Promise<StoredCheckpoint> {
    return this.#checkpointRow('SELECT * FROM syncular.declare_checkpoint($1, $2, $3, $4)', [partition, name, schemaVersion, nowMs]);
  }

  claimCheckpoint(partition: string, name: string, schemaVersion: number, nowMs: number): Promise<StoredCheckpoint> {
    return this.#checkpointRow('SELECT * FROM syncular.claim_checkpoint($1, $2, $3, $4)', [partition, name, schemaVersion, nowMs]);
  }

  /** The one checkpoint row `text` returns. */
  async #checkpointRow(text: string, params: readonly unknown[]): Promise<StoredCheckpoint> {
    const { rows } = await this.#db.query(text, params);
    return toCheckpoint(rows[0] as PgRow);
  }

  advanceCheckpoint(
    partition: string,
    name: string,
    ownerEpoch: number,
    watermark: number,
    observedRows: number,
    nowMs: number,
  ): Promise<boolean> {
    return advanceCheckpointOn(this.#db, partition, name, ownerEpoch, watermark, observedRows, nowMs);
  }

  async activateCheckpoint(
    partition: string,
    name: string,
    ownerEpoch: number,
    watermark: number,
    sources: readonly string[],
    nowMs: number,
  ): Promise<'activated' | 'stale' | 'unverifiable'> {
    const state = await this.#value('SELECT syncular.activate_checkpoint($1, $2, $3, $4, $5::text::text[], $6)', [
      partition,
      name,
      ownerEpoch,
      watermark,
      textArray(sources),
      nowMs,
    ]);
    return state as 'activated' | 'stale' | 'unverifiable';
  }

  async sourceCoverageSeq(partition: string, tables: readonly string[]): Promise<number> {
    if (tables.length === 0) return 0;
    return num(await this.#value('SELECT syncular.source_coverage_seq($1, $2::text::text[])', [partition, textArray(tables)]));
  }

  async hasSourceChangesAbove(
    partition: string,
    tables: readonly string[],
    seq: number,
  ): Promise<'clean' | 'changed' | 'unverifiable'> {
    const state = await this.#value('SELECT syncular.has_source_changes_above($1, $2::text::text[], $3)', [partition, textArray(tables), seq]);
    return state as 'clean' | 'changed' | 'unverifiable';
  }

  getRow(partition: string, table: string, rowId: string): Promise<StoredRow | undefined> {
    return getRowOn(this.#db, this, partition, table, rowId);
  }

  getPushResult(partition: string, clientId: string, clientCommitId: string): Promise<StoredPushResult | undefined> {
    return getPushResultOn(this.#db, partition, clientId, clientCommitId);
  }

  // -- reactions

  async claimReactions(partition: string, query: ReactionClaimQuery): Promise<StoredReaction[]> {
    if (query.types.length === 0 || query.limit <= 0) return [];
    const list = await this.#list<unknown>('SELECT syncular.claim_reactions($1, $2, $3::text::text[], $4, $5, $6)', [
      partition,
      query.leaseOwner,
      textArray(query.types),
      query.nowMs,
      query.leaseDurationMs,
      query.limit,
    ]);
    return list.map(toReaction);
  }

  async completeReaction(partition: string, idempotencyKey: string, leaseOwner: string, completedAtMs: number): Promise<boolean> {
    return (
      await this.#value('SELECT syncular.complete_reaction($1, $2, $3, $4)', [
        partition,
        idempotencyKey,
        leaseOwner,
        completedAtMs,
      ]) === true
    );
  }

  async extendReactionLease(
    partition: string,
    idempotencyKey: string,
    leaseOwner: string,
    leaseExpiresAtMs: number,
  ): Promise<boolean> {
    return (
      await this.#value('SELECT syncular.extend_reaction_lease($1, $2, $3, $4)', [
        partition,
        idempotencyKey,
        leaseOwner,
        leaseExpiresAtMs,
      ]) === true
    );
  }

  async failReaction(partition: string, idempotencyKey: string, update: ReactionFailureUpdate): Promise<boolean> {
    return (
      await this.#value('SELECT syncular.fail_reaction($1, $2, $3, $4::text::jsonb, $5)', [
        partition,
        idempotencyKey,
        update.leaseOwner,
        j(update.failure),
        update.retryAtMs ?? null,
      ]) === true
    );
  }

  async retryReaction(partition: string, idempotencyKey: string, nowMs: number): Promise<boolean> {
    return (await this.#value('SELECT syncular.retry_reaction($1, $2, $3)', [partition, idempotencyKey, nowMs])) === true;
  }

  async getReaction(partition: string, idempotencyKey: string): Promise<StoredReaction | undefined> {
    const value = await this.#value('SELECT syncular.get_reaction($1, $2)', [partition, idempotencyKey]);
    return value === null || value === undefined ? undefined : toReaction(value);
  }

  async listReactions(partition: string, query: ReactionListQuery): Promise<StoredReaction[]> {
    if (query.limit <= 0) return [];
    const list = await this.#list<unknown>('SELECT syncular.list_reactions($1, $2, $3::text::text[], $4::text::text[])', [
      partition,
      query.limit,
      query.statuses !== undefined && query.statuses.length > 0 ? textArray(query.statuses) : null,
      query.types !== undefined && query.types.length > 0 ? textArray(query.types) : null,
    ]);
    return list.map(toReaction);
  }

  async pruneReactions(partition: string, query: ReactionPruneQuery): Promise<PrunedReactionCounts> {
    if (query.limit <= 0) return { completed: 0, deadLetter: 0 };
    const r = json<Record<string, unknown>>(
      await this.#value('SELECT syncular.prune_reactions($1, $2, $3, $4)', [
        partition,
        query.completedBeforeMs,
        query.deadLetterBeforeMs,
        query.limit,
      ]),
    );
    return { completed: num(r.completed), deadLetter: num(r.deadLetter) };
  }

  // -- pull

  async readCommitWindow(partition: string, query: CommitWindowQuery): Promise<StoredCommit[]> {
    const { variable, values } = firstScope(query.scopeFilter);
    if (variable === undefined || values.length === 0 || query.limitChanges <= 0) return [];
    const { rows } = await this.#db.query<{
      commit_seq: unknown;
      created_at_ms: unknown;
      actor_id: string;
      row_id: string;
      op: string;
      row_version: unknown;
      scopes: unknown;
      payload: unknown;
    }>(
      `SELECT commit_seq, created_at_ms, actor_id, row_id, op, row_version, scopes, payload
         FROM syncular.read_commit_window($1, $2, $3::text::jsonb, $4, $5, $6)`,
      [partition, query.table, j(query.scopeFilter), query.afterSeq, query.throughSeq, query.limitChanges],
    );
    const commits: StoredCommit[] = [];
    let current: { commitSeq: number; createdAtMs: number; actorId: string; changes: StoredChange[] } | undefined;
    for (const row of rows) {
      const commitSeq = num(row.commit_seq);
      if (current === undefined || current.commitSeq !== commitSeq) {
        current = { commitSeq, createdAtMs: num(row.created_at_ms), actorId: row.actor_id, changes: [] };
        commits.push(current);
      }
      current.changes.push({
        table: query.table,
        rowId: row.row_id,
        op: row.op === 'delete' ? 'delete' : 'upsert',
        ...(row.row_version !== null && row.row_version !== undefined ? { rowVersion: num(row.row_version) } : {}),
        scopes: json<Record<string, string>>(row.scopes),
        ...(row.payload !== null && row.payload !== undefined ? { payload: bytes(row.payload) } : {}),
      });
    }
    return commits;
  }

  async latestScopedChangeSeq(
    partition: string,
    query: { readonly table: string; readonly scopeFilter: ScopeMap },
  ): Promise<number> {
    const { variable, values } = firstScope(query.scopeFilter);
    if (variable === undefined || values.length === 0) return 0;
    return num(
      await this.#value('SELECT syncular.latest_scoped_change_seq($1, $2, $3::text::jsonb)', [
        partition,
        query.table,
        j(query.scopeFilter),
      ]),
    );
  }

  scanRows(partition: string, query: RowScanQuery): Promise<StoredRow[]> {
    return scanRowsOn(this.#db, this, partition, query);
  }

  scanRowsByIndex(partition: string, query: IndexRowScanQuery): Promise<StoredRow[]> {
    return scanRowsByIndexOn(this.#db, this, partition, query);
  }

  async queryAuthoritative(
    partition: string,
    query: AuthoritativeQueryRequest,
    checkpoints?: readonly CheckpointDeclaration[],
  ): Promise<AuthoritativeQueryResult> {
    if (this.#tables === undefined) throw new Error('ensureSchema(schema) must run before registered queries');
    const statement = rewriteAuthoritative(this, partition, query);
    const declared = j(
      (checkpoints ?? []).map((c) => ({ partition: c.partition, name: c.name, schemaVersion: c.schemaVersion })),
    );
    const isolation: Isolation = 'repeatable read read only';
    return this.#db.transaction(async (session) => {
      // The gate and the cursor in the snapshot the query then reads.
      const { rows } = await session.query<{ seq: unknown }>(
        'SELECT syncular.assert_serve_ready($1, $2, $3::text::jsonb) AS gate, syncular.max_commit_seq($1) AS seq',
        [partition, this.#schemaVersion ?? 0, declared],
      );
      const result = await queryAuthoritativeOn(session, statement);
      return { rows: result, maxCommitSeq: num(rows[0]?.seq) };
    }, isolation);
  }

  // -- clients

  async getClientRecord(partition: string, clientId: string): Promise<ClientRecord | undefined> {
    const value = await this.#value('SELECT syncular.get_client($1, $2)', [partition, clientId]);
    return value === null || value === undefined ? undefined : toClient(value);
  }

  async putClientRecord(partition: string, record: ClientRecord): Promise<void> {
    await this.#db.query('SELECT syncular.put_client($1, $2::text::jsonb)', [
      partition,
      j({
        clientId: record.clientId,
        actorId: record.actorId,
        wireVersion: record.wireVersion,
        cursor: record.cursor,
        subscriptions: record.subscriptions,
        updatedAtMs: record.updatedAtMs,
      }),
    ]);
  }

  async advanceClientCursor(
    partition: string,
    clientId: string,
    actorId: string,
    logEpoch: string,
    cursor: number,
    updatedAtMs: number,
  ): Promise<void> {
    await this.#db.query('SELECT syncular.advance_client_cursor($1, $2, $3, $4, $5, $6)', [
      partition,
      clientId,
      actorId,
      logEpoch,
      cursor,
      updatedAtMs,
    ]);
  }

  async updateClientCursor(partition: string, clientId: string, cursor: number, updatedAtMs: number): Promise<void> {
    await this.#db.query('SELECT syncular.update_client_cursor($1, $2, $3, $4)', [partition, clientId, cursor, updatedAtMs]);
  }

  async getActiveClientCursorFloor(partition: string, cutoffMs: number): Promise<number | null> {
    const value = await this.#value('SELECT syncular.active_cursor_floor($1, $2)', [partition, cutoffMs]);
    return value === null || value === undefined ? null : num(value);
  }

  async listClientCursors(partition: string): Promise<ClientCursorInfo[]> {
    const list = await this.#list<Record<string, unknown>>('SELECT syncular.list_client_cursors($1)', [partition]);
    return list.map((c) => ({ clientId: c.clientId as string, cursor: num(c.cursor), updatedAtMs: num(c.updatedAtMs) }));
  }

  // -- blobs and admin reads

  async listRowsReferencingBlob(partition: string, blobId: string): Promise<BlobReferencingRow[]> {
    const list = await this.#list<BlobReferencingRow>('SELECT syncular.rows_referencing_blob($1, $2)', [partition, blobId]);
    return list.map((r) => ({ table: r.table, rowId: r.rowId, scopes: r.scopes }));
  }

  async listReferencedBlobIds(partition: string): Promise<string[]> {
    return ((await this.#value('SELECT syncular.referenced_blob_ids($1)', [partition])) as string[] | null) ?? [];
  }

  async listClientRecords(partition: string): Promise<ClientRecord[]> {
    const list = await this.#list<unknown>('SELECT syncular.list_clients($1)', [partition]);
    return list.map(toClient);
  }

  async listCommitMetadata(partition: string, query: CommitMetadataQuery): Promise<CommitMetadata[]> {
    const list = await this.#list<Record<string, unknown>>('SELECT syncular.list_commit_metadata($1, $2, $3, $4)', [
      partition,
      query.afterSeq,
      query.limit,
      query.table ?? null,
    ]);
    return list.map((c) => ({
      commitSeq: num(c.commitSeq),
      clientId: c.clientId as string,
      clientCommitId: c.clientCommitId as string,
      actorId: c.actorId as string,
      createdAtMs: num(c.createdAtMs),
      changeCount: num(c.changeCount),
      tables: c.tables as string[],
    }));
  }

  async scopeActivity(partition: string, query: ScopeActivityQuery): Promise<ScopeCommitActivity[]> {
    const list = await this.#list<Record<string, unknown>>('SELECT syncular.scope_activity($1, $2, $3, $4)', [
      partition,
      query.variable,
      query.value,
      query.limit,
    ]);
    return list.map((a) => ({
      commitSeq: num(a.commitSeq),
      table: a.table as string,
      createdAtMs: num(a.createdAtMs),
      actorId: a.actorId as string,
      changeCount: num(a.changeCount),
    }));
  }

  async getRowScopes(
    partition: string,
    table: string,
    rowId: string,
  ): Promise<{ serverVersion: number; scopes: Record<string, string> } | undefined> {
    const value = json<{ serverVersion: unknown; scopes: Record<string, string> } | null>(
      await this.#value('SELECT syncular.get_row_scopes($1, $2, $3)', [partition, table, rowId]),
    );
    return value === null || value === undefined ? undefined : { serverVersion: num(value.serverVersion), scopes: value.scopes };
  }
}

