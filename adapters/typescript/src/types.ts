// The structural types of @syncular/server 0.24's storage seam (packages/server/src/storage.ts,
// schema.ts, pg-executor.ts of syncular/syncular), declared here because that package is not on
// the npm registry. Names, parameters and result shapes follow upstream's declarations so that
// upstream's objects are assignable to these types and this package's class is assignable to
// upstream's `ServerStorage`. Only the fields this package reads are declared for inputs
// (`CompiledSchema`, `CompiledTable`): a structural subset accepts upstream's richer objects.

// ---- @syncular/core ------------------------------------------------------------------------

/** Effective or requested scopes: variable → allowed values. */
export type ScopeMap = Readonly<Record<string, readonly string[]>>;

/** A decoded row value (the codec's JavaScript forms). */
export type RowValue = string | number | boolean | Uint8Array | null;

export type ColumnType =
  | 'string'
  | 'integer'
  | 'float'
  | 'boolean'
  | 'json'
  | 'bytes'
  | 'blob_ref'
  | 'crdt';

export interface RowColumn {
  readonly name: string;
  readonly type: ColumnType;
  readonly nullable: boolean;
  readonly crdtType?: string;
  readonly encrypted?: boolean;
  readonly declaredType?: ColumnType;
}

export type JsonValue =
  | null
  | boolean
  | number
  | string
  | readonly JsonValue[]
  | { readonly [key: string]: JsonValue };

export type PushOperationResult =
  | { readonly opIndex: number; readonly status: 'applied' }
  | {
      readonly opIndex: number;
      readonly status: 'error';
      readonly code: string;
      readonly message: string;
      readonly retryable: boolean;
      readonly details?: unknown;
    }
  | {
      readonly opIndex: number;
      readonly status: 'conflict';
      readonly code: string;
      readonly message: string;
      readonly serverVersion: number;
      readonly serverRow: Uint8Array;
      readonly conflictColumns: Uint8Array;
    };

// ---- schema.ts -----------------------------------------------------------------------------

export interface IndexSchema {
  readonly name: string;
  readonly columns: readonly string[];
  readonly unique?: boolean;
}

export interface CompiledScopePattern {
  readonly variable: string;
  readonly column: string;
}

export interface CompiledTable {
  readonly name: string;
  readonly columns: readonly RowColumn[];
  readonly primaryKeyIndex: number;
  readonly scopePatterns: readonly CompiledScopePattern[];
  readonly indexes: readonly IndexSchema[];
  readonly materialize: boolean;
}

export interface CompiledSchema {
  readonly version: number;
  readonly tables: ReadonlyMap<string, CompiledTable>;
}

// ---- pg-executor.ts ------------------------------------------------------------------------

export type PgRow = Record<string, unknown>;

export interface PgQueryable {
  query<Row = PgRow>(
    text: string,
    params?: readonly unknown[],
  ): Promise<{ rows: Row[]; rowCount: number | null }>;
}

/** Upstream's executor: `transaction(fn)` sends BEGIN, runs `fn`, then COMMIT or ROLLBACK. */
export interface PgExecutor extends PgQueryable {
  transaction<T>(fn: (client: PgQueryable) => Promise<T>): Promise<T>;
  close?(): Promise<void>;
}

// ---- storage.ts ----------------------------------------------------------------------------

export interface CommitPruneQuery {
  readonly logEpoch: string;
  readonly throughSeq: number;
}

export interface CommitPruneResult {
  readonly previousHorizonSeq: number;
  readonly horizonSeq: number;
  readonly removedCommits: number;
}

export type CheckpointState = 'declared' | 'backfilling' | 'activated';

export interface CheckpointDeclaration {
  readonly partition: string;
  readonly name: string;
  readonly schemaVersion: number;
}

export interface StoredCheckpoint {
  readonly partition: string;
  readonly name: string;
  readonly schemaVersion: number;
  readonly state: CheckpointState;
  readonly watermark: number;
  readonly ownerEpoch: number;
  readonly observedRows: number;
  readonly updatedAtMs: number;
}

export interface ServeGate {
  readonly storedSchemaVersion: number;
  readonly logEpoch: string | undefined;
  readonly pending: readonly { readonly partition: string; readonly name: string }[];
}

export interface StoredRow {
  readonly rowId: string;
  readonly serverVersion: number;
  readonly scopes: Record<string, string>;
  readonly payload: Uint8Array;
  readonly columnVersions?: Uint8Array;
}

export interface NewChange {
  readonly table: string;
  readonly rowId: string;
  readonly op: 'upsert' | 'delete';
  readonly rowVersion?: number;
  readonly scopes: Record<string, string>;
  readonly payload?: Uint8Array;
}

export interface NewCommit {
  readonly clientId: string;
  readonly clientCommitId: string;
  readonly actorId: string;
  readonly createdAtMs: number;
  readonly changes: readonly NewChange[];
}

export interface StoredChange {
  readonly table: string;
  readonly rowId: string;
  readonly op: 'upsert' | 'delete';
  readonly rowVersion?: number;
  readonly scopes: Record<string, string>;
  readonly payload?: Uint8Array;
}

export interface StoredCommit {
  readonly commitSeq: number;
  readonly createdAtMs: number;
  readonly actorId: string;
  readonly changes: readonly StoredChange[];
}

export type DurableJsonValue =
  | null
  | boolean
  | number
  | string
  | readonly DurableJsonValue[]
  | { readonly [key: string]: DurableJsonValue };

export type ReactionStatus = 'pending' | 'leased' | 'completed' | 'dead-letter';

export interface ReactionFailure {
  readonly code: string;
  readonly atMs: number;
  readonly details?: { readonly [key: string]: DurableJsonValue };
}

export interface NewReaction {
  readonly idempotencyKey: string;
  readonly type: string;
  readonly version: number;
  readonly payload: DurableJsonValue;
  readonly sourceClientId: string;
  readonly sourceClientCommitId: string;
  readonly sourceCommitSeq: number;
  readonly createdAtMs: number;
  readonly maxAttempts: number;
}

export interface StoredReaction extends NewReaction {
  readonly status: ReactionStatus;
  readonly attempts: number;
  readonly availableAtMs: number;
  readonly leaseOwner?: string;
  readonly leaseExpiresAtMs?: number;
  readonly completedAtMs?: number;
  readonly lastFailure?: ReactionFailure;
}

export interface ReactionClaimQuery {
  readonly leaseOwner: string;
  readonly types: readonly string[];
  readonly nowMs: number;
  readonly leaseDurationMs: number;
  readonly limit: number;
}

export interface ReactionListQuery {
  readonly statuses?: readonly ReactionStatus[];
  readonly types?: readonly string[];
  readonly limit: number;
}

export interface ReactionFailureUpdate {
  readonly leaseOwner: string;
  readonly failure: ReactionFailure;
  readonly retryAtMs?: number;
}

export interface ReactionPruneQuery {
  readonly completedBeforeMs: number;
  readonly deadLetterBeforeMs: number;
  readonly limit: number;
}

export interface PrunedReactionCounts {
  readonly completed: number;
  readonly deadLetter: number;
}

export interface StoredPushResult {
  readonly status: 'applied' | 'rejected';
  readonly commitSeq?: number;
  readonly recordedAtMs?: number;
  readonly cacheIdentity?: string;
  readonly results: readonly PushOperationResult[];
}

export interface ClientSubscription {
  readonly id: string;
  readonly table: string;
  readonly scopes: ScopeMap;
}

export interface ClientRecord {
  readonly clientId: string;
  readonly actorId: string;
  readonly wireVersion: number;
  readonly cursor: number;
  readonly updatedAtMs: number;
  readonly subscriptions: readonly ClientSubscription[];
}

export interface CommitWindowQuery {
  readonly table: string;
  readonly scopeFilter: ScopeMap;
  readonly afterSeq: number;
  readonly throughSeq: number;
  readonly limitChanges: number;
}

export interface RowScanQuery {
  readonly table: string;
  readonly scopeFilter: ScopeMap;
  readonly afterRowId: string | null;
  readonly limit: number;
}

export interface IndexRowScanQuery {
  readonly table: string;
  readonly index: string;
  readonly values: readonly RowValue[];
  readonly afterRowId?: string | null;
  readonly limit: number;
}

export interface ClientCursorInfo {
  readonly clientId: string;
  readonly cursor: number;
  readonly updatedAtMs: number;
}

export interface PartitionRegistryEntry {
  readonly partition: string;
  readonly logEpoch: string;
  readonly epochRequired: boolean;
  readonly lastAuthenticatedAtMs: number;
}

export interface CommitMetadata {
  readonly commitSeq: number;
  readonly clientId: string;
  readonly clientCommitId: string;
  readonly actorId: string;
  readonly createdAtMs: number;
  readonly changeCount: number;
  readonly tables: readonly string[];
}

export interface CommitMetadataQuery {
  readonly afterSeq: number;
  readonly limit: number;
  readonly table?: string;
}

export interface ScopeCommitActivity {
  readonly commitSeq: number;
  readonly table: string;
  readonly createdAtMs: number;
  readonly actorId: string;
  readonly changeCount: number;
}

export interface ScopeActivityQuery {
  readonly variable: string;
  readonly value: string;
  readonly limit: number;
}

export type AuthoritativeQueryValue = string | number | bigint | boolean | Uint8Array | null;

/** Compiler-proven table occurrences in one generated positional statement. */
export interface AuthoritativeRelationPlan {
  readonly sql: string;
  readonly relations: readonly {
    readonly table: string;
    readonly start: number;
    readonly end: number;
    readonly alias?: string;
  }[];
}

export interface AuthoritativeQueryRequest {
  readonly plan: AuthoritativeRelationPlan;
  readonly params: readonly AuthoritativeQueryValue[];
  readonly tables: readonly string[];
}

export interface AuthoritativeQueryResult {
  readonly rows: readonly Readonly<Record<string, unknown>>[];
  readonly maxCommitSeq: number;
}

export interface BlobReferencingRow {
  readonly table: string;
  readonly rowId: string;
  readonly scopes: Record<string, string>;
}

export interface StorageTransaction {
  getRow(table: string, rowId: string): Promise<StoredRow | undefined>;
  prefetchRows?(table: string, rowIds: readonly string[]): Promise<void>;
  getTombstoneSeq(table: string, rowId: string): Promise<number | undefined>;
  clearTombstone(table: string, rowId: string): Promise<void>;
  getPushResult?(clientId: string, clientCommitId: string): Promise<StoredPushResult | undefined>;
  scanRows?(query: RowScanQuery): Promise<StoredRow[]>;
  scanRowsByIndex?(query: IndexRowScanQuery): Promise<StoredRow[]>;
  queryAuthoritative?(query: AuthoritativeQueryRequest): Promise<AuthoritativeQueryResult>;
  lockPartitionForPush?(): Promise<void>;
  /** @deprecated upstream's compatibility alias of `lockPartitionForPush`. */
  lockPartitionForCommitValidation?(): Promise<void>;
  commitRejectedPushResult?(
    clientId: string,
    clientCommitId: string,
    result: StoredPushResult,
  ): Promise<void>;
  upsertRow(table: string, row: StoredRow, context?: { readonly opIndex: number }): Promise<void>;
  deleteRow(table: string, rowId: string): Promise<void>;
  appendCommit(commit: NewCommit): Promise<number>;
  enqueueReactions?(reactions: readonly NewReaction[]): Promise<void>;
  putPushResult(clientId: string, clientCommitId: string, result: StoredPushResult): Promise<void>;
  advanceCheckpoint(
    name: string,
    ownerEpoch: number,
    watermark: number,
    observedRows: number,
    nowMs: number,
  ): Promise<boolean>;
  readServeGate(runningSchemaVersion: number): Promise<ServeGate>;
  setBlobRefs?(table: string, rowId: string, blobIds: readonly string[]): Promise<void>;
  commit(): Promise<void>;
  rollback(): Promise<void>;
}

export interface ServerStorage {
  ensureSchema(schema: CompiledSchema, checkpoints?: readonly CheckpointDeclaration[]): Promise<void>;
  touchPartition(
    partition: string,
    authenticatedAtMs: number,
    initialLogEpoch: string,
  ): Promise<PartitionRegistryEntry>;
  rotatePartitionLogEpoch(
    partition: string,
    logEpoch: string,
    authenticatedAtMs: number,
  ): Promise<PartitionRegistryEntry>;
  listPartitionRegistry(): Promise<PartitionRegistryEntry[]>;
  getPartitionLogEpoch(partition: string): Promise<string | undefined>;
  begin(partition: string): Promise<StorageTransaction>;
  getMaxCommitSeq(partition: string): Promise<number>;
  getHorizonSeq(partition: string): Promise<number>;
  setHorizonSeq(partition: string, seq: number): Promise<void>;
  pruneCommitsThrough(partition: string, query: CommitPruneQuery): Promise<CommitPruneResult>;
  getCommitSeqBefore(partition: string, createdBeforeMs: number): Promise<number>;
  readCheckpoints(partition: string): Promise<StoredCheckpoint[]>;
  readServeGate(partition: string, runningSchemaVersion: number): Promise<ServeGate>;
  claimCheckpoint(
    partition: string,
    name: string,
    schemaVersion: number,
    nowMs: number,
  ): Promise<StoredCheckpoint>;
  advanceCheckpoint(
    partition: string,
    name: string,
    ownerEpoch: number,
    watermark: number,
    observedRows: number,
    nowMs: number,
  ): Promise<boolean>;
  sourceCoverageSeq(partition: string, tables: readonly string[]): Promise<number>;
  hasSourceChangesAbove(
    partition: string,
    tables: readonly string[],
    seq: number,
  ): Promise<'clean' | 'changed' | 'unverifiable'>;
  declareCheckpoint(
    partition: string,
    name: string,
    schemaVersion: number,
    nowMs: number,
  ): Promise<StoredCheckpoint>;
  activateCheckpoint(
    partition: string,
    name: string,
    ownerEpoch: number,
    watermark: number,
    sources: readonly string[],
    nowMs: number,
  ): Promise<'activated' | 'stale' | 'unverifiable'>;
  getRow(partition: string, table: string, rowId: string): Promise<StoredRow | undefined>;
  getPushResult(
    partition: string,
    clientId: string,
    clientCommitId: string,
  ): Promise<StoredPushResult | undefined>;
  claimReactions?(partition: string, query: ReactionClaimQuery): Promise<StoredReaction[]>;
  completeReaction?(
    partition: string,
    idempotencyKey: string,
    leaseOwner: string,
    completedAtMs: number,
  ): Promise<boolean>;
  extendReactionLease?(
    partition: string,
    idempotencyKey: string,
    leaseOwner: string,
    leaseExpiresAtMs: number,
  ): Promise<boolean>;
  failReaction?(
    partition: string,
    idempotencyKey: string,
    update: ReactionFailureUpdate,
  ): Promise<boolean>;
  retryReaction?(partition: string, idempotencyKey: string, nowMs: number): Promise<boolean>;
  getReaction?(partition: string, idempotencyKey: string): Promise<StoredReaction | undefined>;
  listReactions?(partition: string, query: ReactionListQuery): Promise<StoredReaction[]>;
  pruneReactions?(partition: string, query: ReactionPruneQuery): Promise<PrunedReactionCounts>;
  readCommitWindow(partition: string, query: CommitWindowQuery): Promise<StoredCommit[]>;
  latestScopedChangeSeq(
    partition: string,
    query: { readonly table: string; readonly scopeFilter: ScopeMap },
  ): Promise<number>;
  scanRows(partition: string, query: RowScanQuery): Promise<StoredRow[]>;
  queryAuthoritative?(
    partition: string,
    query: AuthoritativeQueryRequest,
    checkpoints?: readonly CheckpointDeclaration[],
  ): Promise<AuthoritativeQueryResult>;
  scanRowsByIndex?(partition: string, query: IndexRowScanQuery): Promise<StoredRow[]>;
  getClientRecord(partition: string, clientId: string): Promise<ClientRecord | undefined>;
  putClientRecord(partition: string, record: ClientRecord): Promise<void>;
  advanceClientCursor(
    partition: string,
    clientId: string,
    actorId: string,
    logEpoch: string,
    cursor: number,
    updatedAtMs: number,
  ): Promise<void>;
  updateClientCursor(
    partition: string,
    clientId: string,
    cursor: number,
    updatedAtMs: number,
  ): Promise<void>;
  getActiveClientCursorFloor(partition: string, cutoffMs: number): Promise<number | null>;
  listClientCursors(partition: string): Promise<ClientCursorInfo[]>;
  listRowsReferencingBlob?(partition: string, blobId: string): Promise<BlobReferencingRow[]>;
  listReferencedBlobIds?(partition: string): Promise<string[]>;
  listClientRecords?(partition: string): Promise<ClientRecord[]>;
  listCommitMetadata?(partition: string, query: CommitMetadataQuery): Promise<CommitMetadata[]>;
  scopeActivity?(partition: string, query: ScopeActivityQuery): Promise<ScopeCommitActivity[]>;
  getRowScopes?(
    partition: string,
    table: string,
    rowId: string,
  ): Promise<{ serverVersion: number; scopes: Record<string, string> } | undefined>;
  listPartitions(): Promise<string[]>;
}
