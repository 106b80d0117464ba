// A small but complete Syncular host in TypeScript (node-postgres) over the syncular SQL API:
// the same steps as examples/python/host.py — schema check/migration, a push of several rows
// (with the rejection path), a replay, a pull of one scope, a reaction, and a refusal while a
// backfill it did not declare is pending. Every step asserts its result.
//
//   SYNCULAR_EXAMPLE_URL=postgres://postgres@127.0.0.1:5432/app node dist/host.js
import { randomUUID } from "node:crypto";
import pg from "pg";
import { listenForCommits, type CommitNotice } from "./listen.js";

const URL = process.env.SYNCULAR_EXAMPLE_URL ?? "postgres://postgres@127.0.0.1:55439/example_node";
const PARTITION = "acme";
const VERSION = 1;
const NOW = 1_750_000_000_000;
const LAYOUTS = {
  tasks: [
    { name: "id", type: "string", nullable: false },
    { name: "project_id", type: "string", nullable: false },
    { name: "title", type: "string", nullable: true },
  ],
};

type Json = any; // results are documented JSON objects (docs/API.md)

/** A syncular refusal: SQLSTATE class SY, the code as message, DETAIL as a JSON object. */
class SyncRefusal extends Error {
  constructor(readonly sqlstate: string, readonly code: string, readonly details: Json) {
    super(code);
  }
}

function check(condition: boolean, message: string): asserts condition {
  if (!condition) throw new Error(`node example: FAILED: ${message}`);
}

/** Runs one statement and returns the first column of its first row; maps SY errors by code. */
async function one(db: pg.ClientBase, sql: string, params: unknown[] = []): Promise<Json> {
  const result = await query(db, sql, params);
  return result.rows.length ? Object.values(result.rows[0])[0] : undefined;
}

/** Runs one statement and returns its result; maps SY errors by code. */
async function query(db: pg.ClientBase, sql: string, params: unknown[] = []) {
  try {
    return await db.query(sql, params);
  } catch (e) {
    const err = e as pg.DatabaseError;
    if (typeof err.code === "string" && err.code.startsWith("SY")) {
      throw new SyncRefusal(err.code, err.message, err.detail ? JSON.parse(err.detail) : null);
    }
    throw e;
  }
}

// JSON parameters are sent as text and cast in SQL, so arrays are not mistaken for PG arrays.
const j = (value: unknown) => JSON.stringify(value);

async function setup(db: pg.Client) {
  await db.query(`CREATE TABLE IF NOT EXISTS public.tasks (
    "_sync_partition" text NOT NULL, "_sync_row_id" text NOT NULL,
    id text NOT NULL, project_id text NOT NULL, title text,
    "_sync_server_version" bigint NOT NULL, "_sync_scopes" jsonb NOT NULL,
    "_sync_payload" bytea NOT NULL, "_sync_column_versions" bytea,
    PRIMARY KEY ("_sync_partition", "_sync_row_id"))`);
  await one(db, "SELECT syncular.register_table('tasks', 'public.tasks')");
  const state = await one(db, "SELECT syncular.check_schema($1, $2::jsonb)", [VERSION, j(LAYOUTS)]);
  if (state === "migrate") {
    await db.query("BEGIN");
    const previous = await one(db, "SELECT syncular.migrate_schema($1, $2::jsonb)", [VERSION, j(LAYOUTS)]);
    await db.query("COMMIT");
    console.log(`migrated schema ${previous} -> ${VERSION}`);
  }
  check((await one(db, "SELECT syncular.check_schema($1, $2::jsonb)", [VERSION, j(LAYOUTS)])) === "current", "schema current");
}

type Op = [rowId: string, project: string, title: string];

/** One push (docs/HOST-WALKTHROUGH.md). An empty title is refused by this host's rule (rejection path). */
async function push(db: pg.Client, clientId: string, commitId: string, ops: Op[], declared: Json[] = []): Promise<[string, Json]> {
  const replay = await one(db, "SELECT syncular.get_push_result($1, $2, $3)", [PARTITION, clientId, commitId]);
  if (replay) return ["replay", replay];
  await db.query("BEGIN");
  try {
    const stored = await one(db, "SELECT syncular.push_begin($1, $2, $3, $4, $5::jsonb)", [PARTITION, clientId, commitId, VERSION, j(declared)]);
    if (stored) {
      await db.query("ROLLBACK");
      return ["replay", stored];
    }
    await db.query("SAVEPOINT syncular_push_candidate");
    const ids = ops.map((op) => op[0]);
    const current = await db.query(
      `SELECT k.id, r."_sync_server_version" AS version, t.commit_seq AS tombstone
         FROM unnest($1::text[]) AS k(id)
         LEFT JOIN public.tasks r ON r."_sync_partition" = $2 AND r."_sync_row_id" = k.id
         LEFT JOIN syncular.tombstone_seqs($2, 'tasks', $1::text[]) t ON t.row_id = k.id`,
      [ids, PARTITION],
    );
    const versions = new Map(current.rows.map((r) => [r.id as string, Number(r.version ?? 0)]));
    const changes: Json[] = [];
    for (const [index, [rowId, project, title]] of ops.entries()) {
      if (!title) {
        await db.query("ROLLBACK TO SAVEPOINT syncular_push_candidate");
        await db.query("RELEASE SAVEPOINT syncular_push_candidate");
        const rejected = {
          status: "rejected", recordedAtMs: NOW, cacheIdentity: randomUUID(),
          results: [{ opIndex: index, status: "error", code: "app.title_required", message: "a task needs a title", retryable: false }],
        };
        const canonical = await one(db, "SELECT syncular.put_push_result($1, $2, $3, $4::jsonb)", [PARTITION, clientId, commitId, j(rejected)]);
        await db.query("COMMIT");
        return ["rejected", canonical];
      }
      const scopes = { project_id: project };
      const payload = Buffer.from(JSON.stringify({ id: rowId, project_id: project, title }));
      const version = (versions.get(rowId) ?? 0) + 1;
      await db.query(
        `WITH w AS (
           INSERT INTO public.tasks VALUES ($1, $2, $2, $3, $4, $5, $6::jsonb, $7, NULL)
           ON CONFLICT ("_sync_partition", "_sync_row_id") DO UPDATE
             SET title = EXCLUDED.title, "_sync_server_version" = EXCLUDED."_sync_server_version",
                 "_sync_scopes" = EXCLUDED."_sync_scopes", "_sync_payload" = EXCLUDED."_sync_payload"
           RETURNING 1)
         SELECT syncular.set_row_scopes($1, 'tasks', $2, $6::jsonb) FROM w`,
        [PARTITION, rowId, project, title, version, j(scopes), payload],
      );
      changes.push({ table: "tasks", rowId, op: "upsert", rowVersion: version, scopes, payload: payload.toString("base64") });
    }
    const commit = { clientId, clientCommitId: commitId, actorId: "alice", createdAtMs: NOW, writerVersion: VERSION, changes };
    const seq = Number(await one(db, "SELECT syncular.append_commit($1, $2::jsonb)", [PARTITION, j(commit)]));
    const reaction = {
      idempotencyKey: JSON.stringify([PARTITION, clientId, commitId, "notify"]), type: "email.send", version: 1,
      payload: { rows: ids }, sourceClientId: clientId, sourceClientCommitId: commitId, sourceCommitSeq: seq, createdAtMs: NOW,
    };
    await one(db, "SELECT syncular.enqueue_reactions($1, $2::jsonb)", [PARTITION, j([reaction])]);
    const applied = {
      status: "applied", commitSeq: seq, recordedAtMs: NOW, cacheIdentity: randomUUID(),
      results: ops.map((_, i) => ({ opIndex: i, status: "applied" })),
    };
    const canonical = await one(db, "SELECT syncular.put_push_result($1, $2, $3, $4::jsonb)", [PARTITION, clientId, commitId, j(applied)]);
    await db.query("COMMIT");
    return ["applied", canonical];
  } catch (e) {
    await db.query("ROLLBACK");
    throw e; // includes sync.storage.writer_fence_rejected: this process must stop serving writes
  }
}

/**
 * One incremental pull of `tasks` for one project, in one call (docs/HOST-WALKTHROUGH.md, pull):
 * gate, client record, window and the record's new cursor in one statement.
 */
async function pull(db: pg.Client, clientId: string, project: string, cursor: number) {
  const scopes = { project_id: [project] };
  const request = {
    limitCommits: 1000,
    subscriptions: [{ id: "s1", table: "tasks", scopes, effective: scopes, cursor }],
  };
  const result = await query(
    db,
    "SELECT document, commit_seq, row_id FROM syncular.pull($1, $2, 'alice', $3, $4, $5, $6::jsonb)",
    [PARTITION, clientId, NOW, randomUUID(), VERSION, j(request)],
  );
  const document = result.rows[0].document;
  check(document.client === "recorded", `pull served: ${JSON.stringify(document)}`);
  return result.rows.slice(1).map((r) => [Number(r.commit_seq), r.row_id as string]);
}

async function main() {
  const db = new pg.Client({ connectionString: URL });
  await db.connect();
  const notices: CommitNotice[] = [];
  const listener = await listenForCommits(URL, (notice) => notices.push(notice));
  try {
    await setup(db);
    await db.query("SET syncular.notify_commits = on");
    const ops: Op[] = [["t1", "p1", "write the spec"], ["t2", "p1", "ship it"], ["t3", "p2", "celebrate"]];
    const [outcome, result] = await push(db, "device-js", "commit-1", ops);
    check(outcome === "applied" && result.commitSeq === 1, `push applied: ${j(result)}`);
    console.log(`push applied as commit ${result.commitSeq}`);
    for (let waited = 0; notices.length === 0 && waited < 5000; waited += 50) {
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
    check(
      notices.length === 1 && notices[0].partition === PARTITION && notices[0].commitSeq === 1,
      `notified: ${j(notices)}`,
    );
    console.log(`listener notified of commit ${notices[0].commitSeq} in ${notices[0].partition}`);

    const [again, replay] = await push(db, "device-js", "commit-1", ops);
    check(again === "replay" && j(replay) === j(result), "replay returns the stored result");
    console.log("replay answered from the stored result");

    const [rejectedOutcome, rejected] = await push(db, "device-js", "commit-2", [["t4", "p1", "fine"], ["t5", "p1", ""]]);
    check(rejectedOutcome === "rejected" && rejected.results[0].opIndex === 1, `rejected: ${j(rejected)}`);
    check(Number(await one(db, "SELECT syncular.max_commit_seq($1)", [PARTITION])) === 1, "a rejection consumes no number");
    console.log("rejected push stored, no commit consumed");

    const rows = await pull(db, "device-js-2", "p1", 0);
    check(j(rows) === j([[1, "t1"], [1, "t2"]]), `window for p1: ${j(rows)}`);
    console.log(`pulled ${rows.length} changes of project p1`);

    const claimed = await one(db, "SELECT syncular.claim_reactions($1, 'worker-js', ARRAY['email.send'], $2, 30000, 10)", [PARTITION, NOW]);
    check(claimed.length === 1 && claimed[0].attempts === 1, `claimed: ${j(claimed)}`);
    check((await one(db, "SELECT syncular.complete_reaction($1, $2, 'worker-js', $3)", [PARTITION, claimed[0].idempotencyKey, NOW + 1])) === true, "completed");
    console.log("reaction claimed and completed");

    await one(db, "SELECT syncular.declare_checkpoint($1, 'titles', $2, $3)", [PARTITION, VERSION, NOW]);
    try {
      await pull(db, "device-js-2", "p1", 1);
      check(false, "a request while an undeclared backfill is pending must be refused");
    } catch (e) {
      if (!(e instanceof SyncRefusal)) throw e;
      check(e.sqlstate === "SY002" && e.code === "sync.schema_not_ready", `refusal: ${e.code}`);
      check(j(e.details) === j({ partition: PARTITION, projection: "titles" }), `details: ${j(e.details)}`);
      console.log(`refused while backfilling: ${e.code} ${j(e.details)}`);
    }
    const declared = [{ partition: PARTITION, name: "titles", schemaVersion: VERSION }];
    const [batch] = await push(db, "backfill-client", "titles-batch-1", [["t1", "p1", "write the spec v2"]], declared);
    check(batch === "applied", "the declaring worker is served");
    const claim = await db.query("SELECT owner_epoch FROM syncular.claim_checkpoint($1, 'titles', $2, $3)", [PARTITION, VERSION, NOW]);
    const seq = await one(db, "SELECT syncular.source_coverage_seq($1, ARRAY['tasks'])", [PARTITION]);
    const activated = await one(db, "SELECT syncular.activate_checkpoint($1, 'titles', $2, $3, ARRAY['tasks'], $4)", [PARTITION, claim.rows[0].owner_epoch, seq, NOW]);
    check(activated === "activated", `activation: ${activated}`);
    check((await pull(db, "device-js-2", "p1", 1)).length === 1, "served again after activation");
    console.log("node example: ok");
  } finally {
    await listener.end();
    await db.end();
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
