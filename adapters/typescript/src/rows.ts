// The app-row layer: the host tables of docs/API.md §App-table template (one relation per synced table, meta
// columns `_sync_*` plus the typed projection of the payload). Every statement text here is
// built from the compiled schema only (table and column names, always through `quoteIdent` /
// `quoteLiteral`); request values are always bind parameters. Payloads are decoded by the
// extension (`syncular.decode_row`), never by a second codec in TypeScript.
import type { ColumnType, CompiledSchema, CompiledTable, RowColumn, RowValue } from './types.js';

export const META = {
  partition: '_sync_partition',
  rowId: '_sync_row_id',
  version: '_sync_server_version',
  scopes: '_sync_scopes',
  payload: '_sync_payload',
  columnVersions: '_sync_column_versions',
} as const;

/** SQL identifier quoting. */
export function quoteIdent(name: string): string {
  return `"${name.replaceAll('"', '""')}"`;
}

/** SQL string-literal quoting (standard_conforming_strings, the default since 9.1). */
export function quoteLiteral(text: string): string {
  return `'${text.replaceAll("'", "''")}'`;
}

/**
 * A list of strings as one text parameter: a PostgreSQL array literal, cast in SQL with
 * `$n::text::text[]`. Every driver sends a string as it is, while a JavaScript array parameter
 * reaches the server as whatever the driver makes of it (node-postgres an array literal; Bun.SQL
 * up to 1.3 `String(array)`, "a,b", which PostgreSQL refuses with 22P02). Each element is
 * double-quoted, backslashes and quotes escaped, so commas, braces, quotes, spaces and the word
 * NULL stay elements of the list.
 */
export function textArray(values: readonly string[]): string {
  return `{${values.map((v) => `"${v.replaceAll('\\', '\\\\').replaceAll('"', '\\"')}"`).join(',')}}`;
}

/** The PostgreSQL type of an app column (docs/API.md §App-table template). */
export function columnSqlType(type: ColumnType): string {
  switch (type) {
    case 'string':
    case 'blob_ref':
      return 'text';
    case 'json':
      return 'jsonb';
    case 'integer':
      return 'bigint';
    case 'float':
      return 'double precision';
    case 'boolean':
      return 'boolean';
    case 'bytes':
    case 'crdt':
      return 'bytea';
    default:
      throw new Error(`unsupported column type: ${String(type)}`);
  }
}

/** One app table as this adapter writes it: its compiled schema and its qualified relation. */
export class AppTable {
  readonly relation: string;
  readonly #selectRow: string;
  readonly #prefetch: string;
  readonly #upsert: string;
  readonly #delete: string;
  readonly #rowScopes: string;

  constructor(
    readonly schemaName: string,
    readonly compiled: CompiledTable,
  ) {
    this.relation = `${quoteIdent(schemaName)}.${quoteIdent(compiled.name)}`;
    const meta = `${quoteIdent(META.rowId)} AS row_id, ${quoteIdent(META.version)} AS server_version, ${quoteIdent(META.scopes)} AS scopes, ${quoteIdent(META.payload)} AS payload, ${quoteIdent(META.columnVersions)} AS column_versions`;
    const key = `${quoteIdent(META.partition)}=$1 AND ${quoteIdent(META.rowId)}=$2`;
    this.#selectRow = `SELECT ${meta} FROM ${this.relation} WHERE ${key}`;
    this.#rowScopes = `SELECT ${quoteIdent(META.version)} AS server_version, ${quoteIdent(META.scopes)} AS scopes FROM ${this.relation} WHERE ${key}`;
    // $1 partition, $2 row ids, $3 table name: the rows and their tombstones in one read.
    this.#prefetch = `SELECT k.id AS lookup_id, r.${quoteIdent(META.rowId)} AS row_id, r.${quoteIdent(META.version)} AS server_version, r.${quoteIdent(META.scopes)} AS scopes, r.${quoteIdent(META.payload)} AS payload, r.${quoteIdent(META.columnVersions)} AS column_versions, t.commit_seq AS tombstone_seq
  FROM unnest($2::text::text[]) AS k(id)
  LEFT JOIN ${this.relation} r ON r.${quoteIdent(META.partition)}=$1 AND r.${quoteIdent(META.rowId)}=k.id
  LEFT JOIN syncular.tombstone_seqs($1, $3, $2::text::text[]) t ON t.row_id=k.id`;
    this.#upsert = this.#buildUpsert();
    // $1 partition, $2 row id, $3 table name. The DELETE runs whether or not it is referenced.
    this.#delete = `WITH deleted AS (DELETE FROM ${this.relation} WHERE ${key})
SELECT syncular.delete_row_meta($1, $3, $2)`;
  }

  get name(): string {
    return this.compiled.name;
  }

  get appColumns(): readonly RowColumn[] {
    return this.compiled.materialize ? this.compiled.columns : [];
  }

  /** Params: [partition, rowId]. */
  selectRowSql(): string {
    return this.#selectRow;
  }

  /** Params: [partition, rowId]. */
  rowScopesSql(): string {
    return this.#rowScopes;
  }

  /** Params: [partition, rowIds (`textArray`), table]. */
  prefetchSql(): string {
    return this.#prefetch;
  }

  /**
   * One statement: decode the payload (extension codec), upsert the row with its typed
   * projection, and make the row's scope entries equal to its scopes.
   * Params: [partition, rowId, serverVersion, scopes (JSON text), payload, columnVersions, table].
   */
  upsertSql(): string {
    return this.#upsert;
  }

  /** Params: [partition, rowId, table]. */
  deleteSql(): string {
    return this.#delete;
  }

  #buildUpsert(): string {
    const columns = this.appColumns;
    const names = [
      META.partition,
      META.rowId,
      ...columns.map((c) => c.name),
      META.version,
      META.scopes,
      META.payload,
      META.columnVersions,
    ];
    const values = [
      '$1',
      '$2',
      ...columns.map((c) => projection(c)),
      '$3',
      '$4::text::jsonb',
      '$5::bytea',
      '$6::bytea',
    ];
    const updates = names
      .slice(2)
      .map((n) => `${quoteIdent(n)}=EXCLUDED.${quoteIdent(n)}`)
      .join(', ');
    const decoded = columns.length > 0 ? 'decoded AS (SELECT syncular.decode_row($7, $5::bytea) AS v),\n' : '';
    const from = columns.length > 0 ? ' FROM decoded' : '';
    return `WITH ${decoded}written AS (
  INSERT INTO ${this.relation} (${names.map(quoteIdent).join(', ')})
  SELECT ${values.join(', ')}${from}
  ON CONFLICT (${quoteIdent(META.partition)}, ${quoteIdent(META.rowId)}) DO UPDATE SET ${updates}
  RETURNING 1)
SELECT syncular.set_row_scopes($1, $7, $2, $4::text::jsonb) FROM written`;
  }

  /** `CREATE TABLE IF NOT EXISTS` with the meta columns and the materialized app columns. */
  createTableDdl(): string {
    const defs = [
      `${quoteIdent(META.partition)} text NOT NULL`,
      `${quoteIdent(META.rowId)} text NOT NULL`,
      ...this.appColumns.map(
        (c) => `${quoteIdent(c.name)} ${columnSqlType(c.type)}${c.nullable ? '' : ' NOT NULL'}`,
      ),
      `${quoteIdent(META.version)} bigint NOT NULL`,
      `${quoteIdent(META.scopes)} jsonb NOT NULL`,
      `${quoteIdent(META.payload)} bytea NOT NULL`,
      `${quoteIdent(META.columnVersions)} bytea`,
      `PRIMARY KEY (${quoteIdent(META.partition)}, ${quoteIdent(META.rowId)})`,
    ];
    return `CREATE TABLE IF NOT EXISTS ${this.relation} (${defs.join(', ')})`;
  }

  /** `ALTER TABLE … ADD COLUMN` for app columns the relation lacks (added columns are nullable). */
  addColumnDdl(existing: ReadonlySet<string>): { sql: string; column: string }[] {
    const out: { sql: string; column: string }[] = [];
    for (const c of this.appColumns) {
      if (existing.has(c.name)) continue;
      out.push({
        sql: `ALTER TABLE ${this.relation} ADD COLUMN ${quoteIdent(c.name)} ${columnSqlType(c.type)}`,
        column: c.name,
      });
    }
    if (!existing.has(META.columnVersions)) {
      out.push({
        sql: `ALTER TABLE ${this.relation} ADD COLUMN ${quoteIdent(META.columnVersions)} bytea`,
        column: META.columnVersions,
      });
    }
    return out;
  }

  /** Declared indexes: `sync_ix_<name>`, leading with `_sync_partition` (docs/API.md §App-table template). */
  createIndexDdl(): string[] {
    if (!this.compiled.materialize) return [];
    return this.compiled.indexes.map((index) => {
      const cols = [META.partition, ...index.columns].map(quoteIdent).join(', ');
      return `CREATE ${index.unique === true ? 'UNIQUE ' : ''}INDEX IF NOT EXISTS ${quoteIdent(physicalIndexName(index.name))} ON ${this.relation} (${cols})`;
    });
  }

  /** Backfill the named projection columns from the stored payloads (one statement). */
  backfillSql(columns: readonly string[]): string | undefined {
    const targets = this.appColumns.filter((c) => columns.includes(c.name));
    if (targets.length === 0) return undefined;
    const sets = targets.map((c) => `${quoteIdent(c.name)}=${projection(c, 'syncular.decode_row($1, ' + quoteIdent(META.payload) + ')')}`);
    return `UPDATE ${this.relation} SET ${sets.join(', ')}`;
  }

  /**
   * One exact lookup through a declared index (upstream's trusted `scanRowsByIndex`).
   * Params: [partition, values…, afterRowId, limit].
   */
  indexScanStatement(
    indexColumns: readonly string[],
    values: readonly RowValue[],
    partition: string,
    afterRowId: string,
    limit: number,
  ): { sql: string; params: unknown[] } {
    const params: unknown[] = [partition];
    const predicates = indexColumns.map((name, i) => {
      const column = this.compiled.columns.find((c) => c.name === name);
      if (column === undefined) throw new Error('compiled relational index references unknown column');
      const value = values[i] ?? null;
      if (value === null) return `${quoteIdent(name)} IS NULL`;
      params.push(bindValue(column, value));
      return `${quoteIdent(name)}=$${params.length}::${columnSqlType(column.type)}`;
    });
    params.push(afterRowId);
    const after = params.length;
    params.push(limit);
    return {
      sql: `SELECT ${quoteIdent(META.rowId)} AS row_id, ${quoteIdent(META.version)} AS server_version, ${quoteIdent(META.scopes)} AS scopes, ${quoteIdent(META.payload)} AS payload, ${quoteIdent(META.columnVersions)} AS column_versions FROM ${this.relation} WHERE ${quoteIdent(META.partition)}=$1 AND ${predicates.join(' AND ')} AND ${quoteIdent(META.rowId)}>$${after} ORDER BY ${quoteIdent(META.rowId)} LIMIT $${params.length}`,
      params,
    };
  }
}

/** SQL that turns the decoded JSON value of a column into its typed projection. */
function projection(column: RowColumn, source = 'decoded.v'): string {
  const text = `(${source}->>${quoteLiteral(column.name)})`;
  switch (column.type) {
    case 'string':
    case 'blob_ref':
      return text;
    case 'integer':
      return `${text}::bigint`;
    case 'float':
      return `${text}::double precision`;
    case 'boolean':
      return `${text}::boolean`;
    case 'json':
      return `${text}::jsonb`;
    case 'bytes':
    case 'crdt':
      return `decode(${text}, 'base64')`;
    default:
      throw new Error(`unsupported column type: ${String(column.type)}`);
  }
}

/** A JavaScript row value as a bind parameter for its column type. */
function bindValue(column: RowColumn, value: RowValue): unknown {
  if (value instanceof Uint8Array) return Buffer.from(value.buffer, value.byteOffset, value.byteLength);
  if (column.type === 'json' && typeof value === 'string') return value;
  return value;
}

/** Deterministic FNV-1a 64-bit hash, hex. */
function fnv1a64Hex(value: string): string {
  let hash = 0xcbf29ce484222325n;
  for (const byte of new TextEncoder().encode(value)) {
    hash ^= BigInt(byte);
    hash = (hash * 0x100000001b3n) & 0xffffffffffffffffn;
  }
  return hash.toString(16).padStart(16, '0');
}

/** `sync_ix_<name>`, or `sync_ix_<fnv1a64 hex>` when that exceeds 63 bytes. */
export function physicalIndexName(declared: string): string {
  const name = `sync_ix_${declared}`;
  return new TextEncoder().encode(name).length <= 63 ? name : `sync_ix_${fnv1a64Hex(declared)}`;
}

/** The layouts document of `check_schema` / `migrate_schema`. */
export function layoutsOf(schema: CompiledSchema): Record<string, { name: string; type: string; nullable: boolean }[]> {
  const out: Record<string, { name: string; type: string; nullable: boolean }[]> = {};
  for (const table of schema.tables.values()) {
    out[table.name] = table.columns.map((c) => ({ name: c.name, type: c.type, nullable: c.nullable }));
  }
  return out;
}

/** The push-schema descriptor of `set_push_schema` (docs/API.md §15). */
export function pushSchemaOf(schema: CompiledSchema): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const table of schema.tables.values()) {
    const pk = table.columns[table.primaryKeyIndex];
    if (pk === undefined) throw new Error(`table ${table.name}: primary key index out of range`);
    out[table.name] = {
      columns: table.columns.map((c) => ({
        name: c.name,
        type: c.type,
        nullable: c.nullable,
        ...(c.crdtType !== undefined ? { crdtType: c.crdtType } : {}),
      })),
      primaryKey: pk.name,
      scopes: table.scopePatterns.map((s) => ({ variable: s.variable, column: s.column })),
      materialize: table.materialize,
    };
  }
  return out;
}

