// A small but complete Syncular host in TypeScript (node-postgres) over the syncular SQL API:
// the same steps as examples/python/host.py — as two roles (the migrator sets up, the server
// serves), pushes through the one call `push_commit` (applied, a replay, a version conflict),
// the classic path for a table with a row validator after `push_commit` falls back, a pull in
// one call, a reaction, a commit notification, and a refusal while a backfill it did not
// declare is pending. Every step asserts its result.
//
//   SYNCULAR_EXAMPLE_ADMIN_URL=postgres://app_migrator@127.0.0.1:5432/app \
//   SYNCULAR_EXAMPLE_URL=postgres://app_server@127.0.0.1:5432/app node dist/host.js
import { randomUUID } from "node:crypto";
import { isDeepStrictEqual as same } from "node:util";
import pg from "pg";
import { listenForCommits, type CommitNotice } from "./listen.js";

const ADMIN_URL = process.env.SYNCULAR_EXAMPLE_ADMIN_URL ?? "postgres://app_migrator@127.0.0.1:25439/example_node";
const HOST_URL = process.env.SYNCULAR_EXAMPLE_URL ?? "postgres://app_server@127.0.0.1:25439/example_node";
const PARTITION = "acme";
const VERSION = 1;
const NOW = 1_750_000_000_000;
const UPSERT = 1;
const column = (name: string, nullable: boolean) => ({ name, type: "string", nullable });
// The layouts migrate_schema stores; the push schema is compiled from the same columns, because
// set_push_schema refuses one that disagrees with them.
const LAYOUTS = {
  tasks: [column("id", false), column("project_id", false), column("title", true)],
  comments: [column("id", false), column("project_id", false), column("body", false)],
};
const PUSH_SCHEMA = Object.fromEntries(
  Object.entries(LAYOUTS).map(([table, columns]) => [
    table,
    { columns, primaryKey: "id", scopes: [{ variable: "project_id", column: "project_id" }] },
  ]),
);

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

// Results are compared by value (`same`): jsonb prints keys in its own order, not ours.
// JSON parameters are sent as text and cast in SQL, so arrays are not mistaken for PG arrays.
const j = (value: unknown) => JSON.stringify(value);

/** The migrator's part: schema, app tables, grants, registration, migration, push schema. */
async function setup(admin: pg.Client, hostRole: string) {
  // PostgreSQL 15 gives a plain role no CREATE on `public`: the app tables live in a schema the
  // migrator owns (the DBA granted it CREATE on the database, scripts/examples.sh).
  await admin.query("CREATE SCHEMA IF NOT EXISTS app");
  for (const [table, extra] of [["tasks", "title text"], ["comments", "body text NOT NULL"]]) {
    await admin.query(`CREATE TABLE IF NOT EXISTS app.${table} (
      "_sync_partition" text NOT NULL, "_sync_row_id" text NOT NULL,
      id text NOT NULL, project_id text NOT NULL, ${extra},
      "_sync_server_version" bigint NOT NULL, "_sync_scopes" jsonb NOT NULL,
      "_sync_payload" bytea NOT NULL, "_sync_column_versions" bytea,
      PRIMARY KEY ("_sync_partition", "_sync_row_id"))`);
    await one(admin, "SELECT syncular.register_table($1, $2::text::regclass)", [table, `app.${table}`]);
  }
  // The server writes app rows as itself (push_commit is SECURITY INVOKER): it needs these
  // privileges and no others.
  const role = admin.escapeIdentifier(hostRole);
  await admin.query(`GRANT USAGE ON SCHEMA app TO ${role}`);
  await admin.query(`GRANT SELECT, INSERT, UPDATE, DELETE ON app.tasks, app.comments TO ${role}`);
  const state = await one(admin, "SELECT syncular.check_schema($1, $2::jsonb)", [VERSION, j(LAYOUTS)]);
  if (state === "migrate") {
    await admin.query("BEGIN");
    const previous = await one(admin, "SELECT syncular.migrate_schema($1, $2::jsonb)", [VERSION, j(LAYOUTS)]);
    await admin.query("COMMIT");
    console.log(`migrated schema ${previous} -> ${VERSION}`);
  }
  check((await one(admin, "SELECT syncular.set_push_schema($1, $2::jsonb)", [VERSION, j(PUSH_SCHEMA)])) === 2, "push schema");
}

interface Op {
  table: string;
  rowId: string;
  baseVersion: number | null;
  payload: Buffer;
}

/**
 * An upsert as a client sends it: a sparse row payload. A real client encodes it with its own
 * row codec; `encode_row(…, sparse => true)` produces the same bytes, so it stands in here.
 */
async function upsert(host: pg.Client, table: string, rowId: string, baseVersion: number | null, values: Json): Promise<Op> {
  const payload = await one(host, "SELECT syncular.encode_row($1, $2::jsonb, true)", [table, j(values)]);
  return { table, rowId, baseVersion, payload };
}

/** One PUSH_COMMIT frame in one call. */
async function push(host: pg.Client, clientId: string, commitId: string, ops: Op[], declared: Json[] = [],
                    options: Json = { cacheIdentity: randomUUID() }): Promise<Json> {
  const allowed = { project_id: ["p1", "p2"] }; // the resolver's answer for this actor
  return one(
    host,
    `SELECT syncular.push_commit($1, $2, $3, 'alice', $4, $5, $6::jsonb, $7::text[], $8::text[], $9::int2[],
                                 $10::int8[], $11::bytea[], $12::jsonb, $13::jsonb)`,
    [PARTITION, clientId, commitId, NOW, VERSION, j(allowed), ops.map((op) => op.table), ops.map((op) => op.rowId),
     ops.map(() => UPSERT), ops.map((op) => op.baseVersion), ops.map((op) => op.payload), j(declared), j(options)],
  );
}

/** This host's row validator for `comments`: host code, so push_commit cannot run it. */
function validateComment(values: Json, exists: boolean): string | null {
  if (exists) return "comments are append-only";
  if (!String(values.body ?? "").trim()) return "a comment needs a body";
  return null;
}

/**
 * The fallback contract: ask push_commit first, naming the tables with a row validator; on
 * `fallback` nothing was stored, and the classic path gives the answer.
 */
async function pushComments(host: pg.Client, clientId: string, commitId: string, ops: Op[]): Promise<[string, Json]> {
  const first = await push(host, clientId, commitId, ops, [], { rowValidatorTables: ["comments"] });
  check(same(first, { outcome: "fallback", reason: "row_validator", opIndex: 0, table: "comments" }), `fallback: ${j(first)}`);
  check((await one(host, "SELECT syncular.get_push_result($1, $2, $3)", [PARTITION, clientId, commitId])) === null,
    "a fallback stores nothing");
  return pushClassic(host, clientId, commitId, ops);
}

/**
 * The classic path (docs/HOST-WALKTHROUGH.md) for a commit of `comments` upserts: the host decodes
 * each payload, runs its validator, writes the rows and appends the commit in one transaction.
 */
async function pushClassic(host: pg.Client, clientId: string, commitId: string, ops: Op[]): Promise<[string, Json]> {
  const replay = await one(host, "SELECT syncular.get_push_result($1, $2, $3)", [PARTITION, clientId, commitId]);
  if (replay) return ["replay", replay];
  await host.query("BEGIN");
  try {
    const stored = await one(host, "SELECT syncular.push_begin($1, $2, $3, $4)", [PARTITION, clientId, commitId, VERSION]);
    if (stored) {
      await host.query("ROLLBACK");
      return ["replay", stored];
    }
    await host.query("SAVEPOINT syncular_push_candidate");
    const ids = ops.map((op) => op.rowId);
    const existing = new Set((await host.query(
      `SELECT k.id FROM unnest($1::text[]) AS k(id)
         LEFT JOIN app.comments r ON r."_sync_partition" = $2 AND r."_sync_row_id" = k.id
         LEFT JOIN syncular.tombstone_seqs($2, 'comments', $1::text[]) t ON t.row_id = k.id
        WHERE r."_sync_row_id" IS NOT NULL OR t.commit_seq IS NOT NULL`,
      [ids, PARTITION],
    )).rows.map((r) => r.id as string));
    const changes: Json[] = [];
    for (const [index, op] of ops.entries()) {
      // The host's codec decodes the client's sparse row; decode_row stands in for it.
      const values = await one(host, "SELECT syncular.decode_row('comments', $1, true)", [op.payload]);
      const problem = validateComment(values, existing.has(op.rowId));
      if (problem) {
        await host.query("ROLLBACK TO SAVEPOINT syncular_push_candidate");
        await host.query("RELEASE SAVEPOINT syncular_push_candidate");
        const rejected = {
          status: "rejected", recordedAtMs: NOW, cacheIdentity: randomUUID(),
          results: [{ opIndex: index, status: "error", code: "app.invalid_comment", message: problem, retryable: false }],
        };
        const canonical = await one(host, "SELECT syncular.put_push_result($1, $2, $3, $4::jsonb)", [PARTITION, clientId, commitId, j(rejected)]);
        await host.query("COMMIT");
        return ["rejected", canonical];
      }
      const scopes = { project_id: values.project_id };
      const row: Buffer = await one(host, "SELECT syncular.encode_row('comments', $1::jsonb)", [j(values)]); // the stored full row
      await host.query(
        `WITH w AS (INSERT INTO app.comments VALUES ($1, $2, $3, $4, $5, 1, $6::jsonb, $7, NULL) RETURNING 1)
         SELECT syncular.set_row_scopes($1, 'comments', $2, $6::jsonb) FROM w`,
        [PARTITION, op.rowId, values.id, values.project_id, values.body, j(scopes), row],
      );
      changes.push({ table: "comments", rowId: op.rowId, op: "upsert", rowVersion: 1, scopes, payload: row.toString("base64") });
    }
    const commit = { clientId, clientCommitId: commitId, actorId: "alice", createdAtMs: NOW, writerVersion: VERSION, changes };
    const seq = Number(await one(host, "SELECT syncular.append_commit($1, $2::jsonb)", [PARTITION, j(commit)]));
    const reaction = {
      idempotencyKey: JSON.stringify([PARTITION, clientId, commitId, "notify"]), type: "email.send", version: 1,
      payload: { rows: ids }, sourceClientId: clientId, sourceClientCommitId: commitId, sourceCommitSeq: seq, createdAtMs: NOW,
    };
    await one(host, "SELECT syncular.enqueue_reactions($1, $2::jsonb)", [PARTITION, j([reaction])]);
    const applied = {
      status: "applied", commitSeq: seq, recordedAtMs: NOW, cacheIdentity: randomUUID(),
      results: ops.map((_, i) => ({ opIndex: i, status: "applied" })),
    };
    const canonical = await one(host, "SELECT syncular.put_push_result($1, $2, $3, $4::jsonb)", [PARTITION, clientId, commitId, j(applied)]);
    await host.query("COMMIT");
    return ["applied", canonical];
  } catch (e) {
    await host.query("ROLLBACK");
    throw e; // includes sync.storage.writer_fence_rejected: this process must stop serving writes
  }
}

/** One pull request in one call: a document row, then the rows of every subscription. */
async function pull(host: pg.Client, clientId: string, cursor: number) {
  const subscriptions = ["tasks", "comments"].map((table) => ({
    id: table, table, scopes: { project_id: ["p1"] }, effective: { project_id: ["p1"] }, cursor,
  }));
  const result = await query(
    host,
    "SELECT document, sub, commit_seq, row_id, payload FROM syncular.pull($1, $2, 'alice', $3, $4, $5, $6::jsonb)",
    [PARTITION, clientId, NOW, randomUUID(), VERSION, j({ limitCommits: 1000, subscriptions })],
  );
  const document = result.rows[0].document;
  check(document.client === "recorded", `pull served: ${j(document)}`);
  const rows = result.rows.slice(1);
  const keys = rows.map((r) => [r.sub, Number(r.commit_seq), r.row_id as string]);
  return { document, keys, payloads: rows.map((r) => r.payload as Buffer) };
}

async function main() {
  const admin = new pg.Client({ connectionString: ADMIN_URL });
  const host = new pg.Client({ connectionString: HOST_URL });
  await admin.connect();
  await host.connect();
  const notices: CommitNotice[] = [];
  const listener = await listenForCommits(HOST_URL, (notice) => notices.push(notice));
  try {
    check((await one(host, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user")) === false, "the server is no superuser");
    await setup(admin, await one(host, "SELECT current_user::text"));
    await host.query("SET syncular.notify_commits = on");

    const ops: Op[] = [];
    for (const [rowId, project, title] of [["t1", "p1", "write the spec"], ["t2", "p1", "ship it"], ["t3", "p2", "celebrate"]]) {
      ops.push(await upsert(host, "tasks", rowId, null, { id: rowId, project_id: project, title }));
    }
    const applied = await push(host, "device-js", "commit-1", ops);
    check(
      applied.outcome === "applied" && applied.commitSeq === 1 &&
        same(applied.result.results, [0, 1, 2].map((i) => ({ opIndex: i, status: "applied" }))),
      `push applied: ${j(applied)}`,
    );
    console.log(`push_commit applied commit ${applied.commitSeq}`);
    for (let waited = 0; notices.length === 0 && waited < 5000; waited += 50) {
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
    check(
      notices.length === 1 && notices[0].partition === PARTITION && notices[0].commitSeq === 1,
      `notified: ${j(notices)}`,
    );
    console.log(`listener notified of commit ${notices[0].commitSeq} in ${notices[0].partition}`);
    // A notification is only a wake-up: one that names a commit the log does not hold (sent here
    // by the server itself, the only kind of role that can name the channel) changes nothing.
    await one(host, "SELECT pg_notify(syncular.notify_channel(), $1)", [j({ partition: PARTITION, commitSeq: 999 })]);
    await new Promise((resolve) => setTimeout(resolve, 300));
    check(notices.length === 1, `a forged notification was reported: ${j(notices)}`);
    console.log("a notification naming a commit the log does not hold wakes the listener, which reports nothing");

    const replay = await push(host, "device-js", "commit-1", ops);
    check(replay.outcome === "cached" && replay.replayed === true && same(replay.result, applied.result), `replay: ${j(replay)}`);
    console.log("the redelivery is answered from the stored result (cached)");

    const edit = await upsert(host, "tasks", "t1", 1, { id: "t1", title: "write the spec, v2" });
    const updated = await push(host, "device-js", "commit-2", [edit]);
    check(updated.outcome === "applied" && updated.commitSeq === 2, `update: ${j(updated)}`);

    // Another device edits t1 from version 1: its baseVersion is behind the stored version 2.
    const stale = await upsert(host, "tasks", "t1", 1, { id: "t1", title: "stale edit" });
    const conflict = await push(host, "device-js-b", "commit-1", [stale]);
    const record = conflict.result.results[0];
    check(
      conflict.outcome === "rejected" && record.status === "conflict" && record.code === "sync.version_conflict" &&
        record.serverVersion === 2 && record.conflictColumns === "BA==", // bit 2: title
      `conflict: ${j(conflict)}`,
    );
    const serverRow = await one(host, "SELECT syncular.decode_row('tasks', $1)", [Buffer.from(record.serverRow, "base64")]);
    check(same(serverRow, { id: "t1", project_id: "p1", title: "write the spec, v2" }), `serverRow: ${j(serverRow)}`);
    check(Number(await one(host, "SELECT syncular.max_commit_seq($1)", [PARTITION])) === 2, "a conflict consumes no number");
    console.log(`stale edit rejected: ${record.code}, server row ${j(serverRow)}`);

    const comment = await upsert(host, "comments", "c1", null, { id: "c1", project_id: "p1", body: "looks good" });
    const [outcome, result] = await pushComments(host, "device-js", "commit-3", [comment]);
    check(outcome === "applied" && result.commitSeq === 3, `classic push: ${j(result)}`);
    const empty = await upsert(host, "comments", "c2", null, { id: "c2", project_id: "p1", body: " " });
    const [rejectedOutcome, rejected] = await pushComments(host, "device-js", "commit-4", [empty]);
    check(rejectedOutcome === "rejected" && rejected.results[0].code === "app.invalid_comment", `rejected: ${j(rejected)}`);
    check(Number(await one(host, "SELECT syncular.max_commit_seq($1)", [PARTITION])) === 3, "a rejection consumes no number");
    console.log("comments: push_commit fell back (row_validator); the classic path applied one, rejected one");

    const first = await pull(host, "device-js-2", 0);
    check(same(first.keys, [[0, 1, "t1"], [0, 1, "t2"], [0, 2, "t1"], [1, 3, "c1"]]), `rows: ${j(first.keys)}`);
    const row = await one(host, "SELECT syncular.decode_row('tasks', $1)", [first.payloads[2]]);
    check(row.title === "write the spec, v2", "the window carries the stored rows");
    check(
      same(first.document.subscriptions.map((s: Json) => s.nextCursor), [3, 3]) && first.document.cursor === 3,
      `cursors: ${j(first.document)}`,
    );
    console.log(`pulled ${first.keys.length} changes of project p1, new cursor ${first.document.cursor}`);

    const claimed = await one(host, "SELECT syncular.claim_reactions($1, 'worker-js', ARRAY['email.send'], $2, 30000, 10)", [PARTITION, NOW]);
    check(claimed.length === 1 && claimed[0].attempts === 1, `claimed: ${j(claimed)}`);
    check((await one(host, "SELECT syncular.complete_reaction($1, $2, 'worker-js', $3)", [PARTITION, claimed[0].idempotencyKey, NOW + 1])) === true, "completed");
    console.log("reaction claimed and completed");

    // A backfill worker declares a checkpoint at our version (an admin action); the server did
    // not declare it, so it is refused until the checkpoint is activated.
    await one(admin, "SELECT syncular.declare_checkpoint($1, 'titles', $2, $3)", [PARTITION, VERSION, NOW]);
    try {
      await pull(host, "device-js-2", 3);
      check(false, "a request while an undeclared backfill is pending must be refused");
    } catch (e) {
      if (!(e instanceof SyncRefusal)) throw e;
      check(e.sqlstate === "SY002" && e.code === "sync.schema_not_ready", `refusal: ${e.code}`);
      check(same(e.details, { partition: PARTITION, projection: "titles" }), `details: ${j(e.details)}`);
      console.log(`refused while backfilling: ${e.code} ${j(e.details)}`);
    }
    const declared = [{ partition: PARTITION, name: "titles", schemaVersion: VERSION }];
    const backfill = await upsert(host, "tasks", "t1", null, { id: "t1", title: "write the spec, v3" });
    const batch = await push(host, "backfill-client", "titles-batch-1", [backfill], declared);
    check(batch.outcome === "applied", `the declaring worker is served: ${j(batch)}`);
    const claim = await admin.query("SELECT owner_epoch FROM syncular.claim_checkpoint($1, 'titles', $2, $3)", [PARTITION, VERSION, NOW]);
    const seq = await one(admin, "SELECT syncular.source_coverage_seq($1, ARRAY['tasks'])", [PARTITION]);
    const activated = await one(admin, "SELECT syncular.activate_checkpoint($1, 'titles', $2, $3, ARRAY['tasks'], $4)", [PARTITION, claim.rows[0].owner_epoch, seq, NOW]);
    check(activated === "activated", `activation: ${activated}`);
    const again = await pull(host, "device-js-2", 3);
    check(same(again.keys, [[0, 4, "t1"]]) && again.document.cursor === 4, `served again after activation: ${j(again.keys)}`);
    console.log("node example: ok");
  } finally {
    await listener.end();
    await host.end();
    await admin.end();
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
