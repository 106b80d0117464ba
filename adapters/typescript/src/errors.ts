// Error classes and the mapping from the extension's refusals (SQLSTATE class SY, message = the
// code, DETAIL = a JSON object) to the classes upstream's server code checks with `instanceof`.
// A host passes upstream's own classes (`errors` option); these local classes have the same
// constructor shapes and are the defaults.

/** Upstream's `StorageQueryError` shape: `new StorageQueryError(code)`, `.code`. */
export type StorageQueryErrorClass = new (code: never) => Error;
/** Upstream's `SyncError` shape: `new SyncError(code, message?, details?)`. */
export type SyncErrorClass = new (code: string, message?: string, details?: string) => Error;
/** Upstream's `StorageConstraintError` shape: `new StorageConstraintError(cause, opIndex?)`. */
export type StorageConstraintErrorClass = new (cause: unknown, opIndex?: number) => Error;

export interface ErrorClasses {
  readonly StorageQueryError?: StorageQueryErrorClass;
  readonly SyncError?: SyncErrorClass;
  readonly StorageConstraintError?: StorageConstraintErrorClass;
}

/** A `sync.storage.*` refusal. `details` is the extension's DETAIL object, when it sent one. */
export class StorageQueryError extends Error {
  override readonly name = 'StorageQueryError';
  readonly code: string;
  constructor(code: string) {
    super(code);
    this.code = code;
  }
}

/** A protocol-level error (`sync.schema_not_ready`, `sync.idempotency_cache_miss`). */
export class SyncError extends Error {
  override readonly name = 'SyncError';
  readonly code: string;
  readonly details?: string;
  constructor(code: string, message?: string, details?: string) {
    super(message ?? code);
    this.code = code;
    if (details !== undefined) this.details = details;
  }
}

/** A class-23 error of an app-row write, carrying the operation's index. */
export class StorageConstraintError extends Error {
  override readonly name = 'StorageConstraintError';
  readonly opIndex: number | undefined;
  constructor(cause: unknown, opIndex?: number) {
    super('application row violates a relational constraint', { cause });
    this.opIndex = opIndex;
  }
}

interface DriverError {
  readonly code?: unknown;
  readonly errno?: unknown;
  readonly message?: unknown;
  readonly detail?: unknown;
}

function asDriverError(error: unknown): DriverError | undefined {
  return typeof error === 'object' && error !== null ? (error as DriverError) : undefined;
}

const SQLSTATE = /^[0-9A-Z]{5}$/;

/**
 * The SQLSTATE of a database error, wherever the driver put it: node-postgres (and pglite,
 * postgres.js) in `code`; Bun.SQL's `PostgresError` in `errno`, its `code` being
 * "ERR_POSTGRES_SERVER_ERROR". Undefined for anything else.
 */
export function sqlstate(error: unknown): string | undefined {
  const e = asDriverError(error);
  if (e === undefined) return undefined;
  for (const candidate of [e.code, e.errno]) {
    if (typeof candidate === 'string' && SQLSTATE.test(candidate)) return candidate;
  }
  return undefined;
}

/** SQLSTATE class 23 (integrity constraint violation). */
export function isConstraintViolation(error: unknown): boolean {
  return sqlstate(error)?.startsWith('23') === true;
}

/** The extension's refusal, or undefined for any other error. */
export function syncularRefusal(
  error: unknown,
): { sqlstate: string; code: string; detail: string | undefined } | undefined {
  const state = sqlstate(error);
  if (state === undefined || !state.startsWith('SY')) return undefined;
  const e = asDriverError(error) as DriverError;
  return {
    sqlstate: state,
    code: typeof e.message === 'string' ? e.message : state,
    detail: typeof e.detail === 'string' ? e.detail : undefined,
  };
}

/** Resolved classes plus the mapping used on every statement the adapter sends. */
export class ErrorMapper {
  storageQuery: StorageQueryErrorClass;
  sync: SyncErrorClass;
  constraint: StorageConstraintErrorClass;
  /** Settles once upstream's classes were looked up (when none were injected). */
  readonly ready: Promise<void>;

  constructor(classes: ErrorClasses | undefined) {
    this.storageQuery = classes?.StorageQueryError ?? (StorageQueryError as StorageQueryErrorClass);
    this.sync = classes?.SyncError ?? SyncError;
    this.constraint = classes?.StorageConstraintError ?? StorageConstraintError;
    // Nothing injected: use the classes @syncular/server exports, when it is installed (the
    // optional peer), so its `instanceof` checks hold without configuration.
    this.ready = classes === undefined ? this.#fromUpstream() : Promise.resolve();
  }

  async #fromUpstream(): Promise<void> {
    const name = '@syncular/server';
    try {
      const upstream = (await import(name)) as Record<string, unknown>;
      const pick = <T>(key: string): T | undefined =>
        typeof upstream[key] === 'function' ? (upstream[key] as T) : undefined;
      this.storageQuery = pick<StorageQueryErrorClass>('StorageQueryError') ?? this.storageQuery;
      this.sync = pick<SyncErrorClass>('SyncError') ?? this.sync;
      this.constraint = pick<StorageConstraintErrorClass>('StorageConstraintError') ?? this.constraint;
    } catch {
      // Not installed: the local classes stay.
    }
  }

  /** `new StorageQueryError(code)` with the extension's DETAIL attached as `details`. */
  storageQueryError(code: string, detail?: string, cause?: unknown): Error {
    const error = new this.storageQuery(code as never);
    const extra = error as Error & { details?: unknown; sqlstate?: string; cause?: unknown };
    if (detail !== undefined && extra.details === undefined) {
      try {
        extra.details = JSON.parse(detail) as unknown;
      } catch {
        extra.details = detail;
      }
    }
    if (cause !== undefined && extra.cause === undefined) extra.cause = cause;
    // Upstream's class takes its message from a table of its own codes; keep the code readable.
    if (error.message === '' || error.message === 'undefined') error.message = code;
    return error;
  }

  /** Translate an error raised by the database; anything that is not a refusal passes unchanged. */
  map(error: unknown): unknown {
    const refusal = syncularRefusal(error);
    if (refusal === undefined) return error;
    switch (refusal.sqlstate) {
      case 'SY002':
        return new this.sync(
          'sync.schema_not_ready',
          refusal.detail === undefined
            ? 'server schema not ready'
            : `server schema not ready: ${refusal.detail}`,
          refusal.detail,
        );
      case 'SY003':
        return new this.sync(
          'sync.idempotency_cache_miss',
          'persisted push result unreadable (§6.3)',
          refusal.detail,
        );
      default:
        return this.storageQueryError(refusal.code, refusal.detail, error);
    }
  }
}
