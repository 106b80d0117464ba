// How statements reach the database: a `pg.Pool` (or anything with `query` and `connect`) or
// upstream's `PgExecutor` (`query` and `transaction(fn)`). A session is one pinned connection
// inside one transaction, ended by `end(commit)`.
import type { ErrorMapper } from './errors.js';
import type { PgExecutor, PgQueryable, PgRow } from './types.js';

export interface QueryResultLike<Row> {
  rows: Row[];
  rowCount: number | null;
}

/** The part of `pg.PoolClient` this package uses. */
export interface PoolClientLike {
  query(text: string, params?: unknown[]): Promise<QueryResultLike<PgRow>>;
  release(error?: Error | boolean): void;
}

/** The part of `pg.Pool` this package uses. */
export interface PoolLike {
  query(text: string, params?: unknown[]): Promise<QueryResultLike<PgRow>>;
  connect(): Promise<PoolClientLike>;
}

export type StorageSource = PoolLike | PgExecutor;

export type Isolation = 'read committed' | 'repeatable read read only';

/** A statement runner that maps the extension's refusals and reports each statement sent. */
export interface Runner {
  query<Row = PgRow>(text: string, params?: readonly unknown[]): Promise<QueryResultLike<Row>>;
}

export interface Session extends Runner {
  end(commit: boolean): Promise<void>;
}

function isExecutor(source: StorageSource): source is PgExecutor {
  return typeof (source as PgExecutor).transaction === 'function';
}

class RollbackSignal extends Error {}

/** node-postgres' query-config form (`{ name, text, values }`). */
interface NamedQueryable {
  query(config: { name: string; text: string; values: unknown[] }): Promise<QueryResultLike<PgRow>>;
}

const names = new Map<string, string>();

/** A stable statement name per text: `sy_` + FNV-1a 64 of the text. */
function statementName(text: string): string {
  let name = names.get(text);
  if (name === undefined) {
    let hash = 0xcbf29ce484222325n;
    for (const byte of new TextEncoder().encode(text)) {
      hash ^= BigInt(byte);
      hash = (hash * 0x100000001b3n) & 0xffffffffffffffffn;
    }
    name = `sy_${hash.toString(16)}`;
    names.set(text, name);
  }
  return name;
}

export class Connection implements Runner {
  readonly #named: boolean;

  constructor(
    readonly source: StorageSource,
    readonly errors: ErrorMapper,
    readonly observe: ((text: string) => void) | undefined,
    preparedStatements = true,
  ) {
    // Named statements only through node-postgres' own pool; an executor takes (text, params).
    this.#named = preparedStatements && !isExecutor(source);
  }

  /** One statement on the pool (autocommit). */
  query<Row = PgRow>(text: string, params: readonly unknown[] = []): Promise<QueryResultLike<Row>> {
    return this.#run<Row>(this.source, text, params);
  }

  async #run<Row>(
    on: PgQueryable | PoolLike | PoolClientLike,
    text: string,
    params: readonly unknown[],
  ): Promise<QueryResultLike<Row>> {
    this.observe?.(text);
    try {
      if (this.#named && params.length > 0) {
        // node-postgres prepares a named statement once per connection and then only binds it.
        const named = { name: statementName(text), text, values: params as unknown[] };
        return (await (on as unknown as NamedQueryable).query(named)) as QueryResultLike<Row>;
      }
      return (await (on as PgQueryable).query<Row>(text, params as unknown[])) as QueryResultLike<Row>;
    } catch (error) {
      await this.errors.ready;
      throw this.errors.map(error);
    }
  }

  /** BEGIN on one pinned connection; every statement of the session is sent one at a time. */
  async session(isolation: Isolation = 'read committed'): Promise<Session> {
    const source = this.source;
    let tail: Promise<unknown> = Promise.resolve();
    const serial = <Row>(on: PgQueryable | PoolClientLike, text: string, params: readonly unknown[]) => {
      const run = tail.then(() => this.#run<Row>(on, text, params));
      tail = run.catch(() => undefined);
      return run;
    };
    /** The session on `client`; `finish` runs on the first `end` only. */
    const sessionOn = (client: PgQueryable | PoolClientLike, finish: (commit: boolean) => Promise<void>): Session => {
      let ended = false;
      return {
        query: <Row = PgRow>(text: string, params: readonly unknown[] = []) => serial<Row>(client, text, params),
        end: async (commit: boolean) => {
          if (ended) return;
          ended = true;
          await finish(commit);
        },
      };
    };
    if (!isExecutor(source)) {
      const client = await source.connect();
      try {
        await this.#run(
          client,
          isolation === 'read committed' ? 'BEGIN' : 'BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY',
          [],
        );
      } catch (error) {
        client.release(error instanceof Error ? error : true);
        throw error;
      }
      return sessionOn(client, async (commit) => {
        try {
          await serial(client, commit ? 'COMMIT' : 'ROLLBACK', []);
          client.release();
        } catch (error) {
          client.release(true);
          throw error;
        }
      });
    }
    // Upstream's executor owns BEGIN/COMMIT: hold its callback open until `end`. Its BEGIN and
    // COMMIT/ROLLBACK are reported like the adapter's own (they are round trips this causes).
    this.observe?.('BEGIN');
    let finish!: (commit: boolean) => void;
    const decided = new Promise<boolean>((resolve) => {
      finish = resolve;
    });
    let pinned!: (client: PgQueryable) => void;
    const ready = new Promise<PgQueryable>((resolve) => {
      pinned = resolve;
    });
    const done = source
      .transaction(async (client) => {
        pinned(client);
        if (!(await decided)) throw new RollbackSignal();
      })
      .catch((error: unknown) => {
        if (error instanceof RollbackSignal) return;
        throw this.errors.map(error);
      });
    const client = await Promise.race([
      ready,
      done.then(() => {
        throw new Error('transaction ended before it began');
      }),
    ]);
    if (isolation !== 'read committed') {
      await serial(client, 'SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY', []);
    }
    return sessionOn(client, async (commit) => {
      await tail;
      this.observe?.(commit ? 'COMMIT' : 'ROLLBACK');
      finish(commit);
      await done;
    });
  }

  /** Run `fn` in one transaction: COMMIT when it resolves, ROLLBACK when it throws. */
  async transaction<T>(fn: (session: Session) => Promise<T>, isolation?: Isolation): Promise<T> {
    const session = await this.session(isolation);
    let result: T;
    try {
      result = await fn(session);
    } catch (error) {
      await session.end(false).catch(() => undefined);
      throw error;
    }
    await session.end(true);
    return result;
  }
}
