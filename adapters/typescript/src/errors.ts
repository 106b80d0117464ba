// Error classes and the mapping from the extension's refusals (SQLSTATE class SY, message = the
// code, DETAIL = a JSON object) to the classes upstream's server code checks with `instanceof`.
// Upstream's own classes are used when they can be had (`errors` option, else the installed
// `@syncular/server`; its `StorageConstraintError` through an exported producer, upstream.ts);
// these local classes have the same constructor shapes and are the fallback.
import { constraintErrorFromProducer } from './upstream.js';

/** Upstream's `StorageQueryError` shape: `new StorageQueryError(code)`, `.code`. */
export type StorageQueryErrorClass = new (code: never) => Error;
/** Upstream's `SyncError` shape: `new SyncError(code, message?, details?)`. */
export type SyncErrorClass = new (code: string, message?: string, details?: string) => Error;
/** Upstream's `StorageConstraintError` shape: `new StorageConstraintError(cause, opIndex?)`. */
export type StorageConstraintErrorClass = new (cause: unknown, opIndex?: number) => Error;

/**
 * The classes upstream's code checks with `instanceof`. `@syncular/server` exports the first two;
 * its `StorageConstraintError` is obtained from `PostgresServerStorage` (compiled with
 * `compileSchema`) when not given, so passing the module itself (`import * as upstream from
 * '@syncular/server'`, `errors: upstream`) supplies all three.
 */
export interface ErrorClasses {
  readonly StorageQueryError?: StorageQueryErrorClass;
  readonly SyncError?: SyncErrorClass;
  readonly StorageConstraintError?: StorageConstraintErrorClass;
  /** Upstream's exported `PostgresServerStorage`, the producer of its `StorageConstraintError`. */
  readonly PostgresServerStorage?: unknown;
  /** Upstream's exported `compileSchema` (the producer's schema is compiled with it). */
  readonly compileSchema?: unknown;
}

/**
 * Where the `StorageConstraintError` in use came from: given in `errors`, exported by the installed
 * `@syncular/server`, produced by upstream's `PostgresServerStorage` (`probed`), or this package's
 * own class (`local`: upstream's push then fails the request on a constraint violation instead of
 * rejecting the commit).
 */
export type ConstraintErrorSource = 'injected' | 'exported' | 'probed' | 'local';

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
  constraintSource: ConstraintErrorSource;
  /** Settles once upstream's classes were looked up (those not injected). */
  readonly ready: Promise<void>;

  constructor(classes: ErrorClasses | undefined) {
    this.storageQuery = classes?.StorageQueryError ?? (StorageQueryError as StorageQueryErrorClass);
    this.sync = classes?.SyncError ?? SyncError;
    this.constraint = classes?.StorageConstraintError ?? StorageConstraintError;
    this.constraintSource = classes?.StorageConstraintError !== undefined ? 'injected' : 'local';
    this.ready = this.#resolve(classes ?? {});
  }

  /** Each class not injected: from `errors`' producer, else from the installed @syncular/server. */
  async #resolve(classes: ErrorClasses): Promise<void> {
    if (this.constraintSource === 'local' && classes.PostgresServerStorage !== undefined) {
      const probed = await constraintErrorFromProducer(classes.PostgresServerStorage, classes.compileSchema);
      if (probed !== undefined) [this.constraint, this.constraintSource] = [probed, 'probed'];
    }
    const complete =
      classes.StorageQueryError !== undefined && classes.SyncError !== undefined && this.constraintSource !== 'local';
    if (complete) return;
    let upstream: Record<string, unknown>;
    try {
      // The optional peer, resolved from this package's own location as the host installed it.
      const name = '@syncular/server';
      upstream = (await import(name)) as Record<string, unknown>;
    } catch {
      return; // Not installed: the local classes stay.
    }
    const pick = <T>(key: string): T | undefined =>
      typeof upstream[key] === 'function' ? (upstream[key] as T) : undefined;
    if (classes.StorageQueryError === undefined) {
      this.storageQuery = pick<StorageQueryErrorClass>('StorageQueryError') ?? this.storageQuery;
    }
    if (classes.SyncError === undefined) this.sync = pick<SyncErrorClass>('SyncError') ?? this.sync;
    if (this.constraintSource !== 'local') return;
    const exported = pick<StorageConstraintErrorClass>('StorageConstraintError');
    if (exported !== undefined) {
      [this.constraint, this.constraintSource] = [exported, 'exported'];
      return;
    }
    const probed = await constraintErrorFromProducer(upstream.PostgresServerStorage, upstream.compileSchema);
    if (probed !== undefined) [this.constraint, this.constraintSource] = [probed, 'probed'];
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
