#!/usr/bin/env python3
"""A small but complete Syncular host in Python (psycopg 3) over the syncular SQL API.

It runs as two roles, as a deployment would (docs/SECURITY.md): the migrator (a member of
`syncular_admin`) creates the app tables `tasks` and `comments` (scope project:{project_id}) in
its own schema, registers them, migrates the schema and stores the push schema; the server (a
member of `syncular_host`, with only SELECT/INSERT/UPDATE/DELETE on the app tables) serves.

The server pushes client commits with the one call `push_commit` (applied, a replay, a version
conflict), pushes `comments` — which have a host row validator — through the classic path after
`push_commit` falls back for them, pulls two subscriptions with the one call `pull`, claims and
completes the reaction the classic push enqueued, and is refused while a backfill it did not
declare is pending. Every step asserts its result; the process exits non-zero on the first
surprise.

    SYNCULAR_EXAMPLE_ADMIN_URL="host=127.0.0.1 port=5432 user=app_migrator dbname=app" \\
    SYNCULAR_EXAMPLE_URL="host=127.0.0.1 port=5432 user=app_server dbname=app" python3 host.py
"""
import base64
import json
import os
import uuid

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

ADMIN_URL = os.environ.get("SYNCULAR_EXAMPLE_ADMIN_URL",
                           "host=127.0.0.1 port=25439 user=app_migrator dbname=example_python")
HOST_URL = os.environ.get("SYNCULAR_EXAMPLE_URL", "host=127.0.0.1 port=25439 user=app_server dbname=example_python")
PARTITION = "acme"
VERSION = 1
NOW = 1_750_000_000_000
UPSERT, DELETE = 1, 2
# The layouts migrate_schema stores; the push schema below is compiled from the same columns,
# because set_push_schema refuses one that disagrees with them.
LAYOUTS = {
    "tasks": [{"name": "id", "type": "string", "nullable": False},
              {"name": "project_id", "type": "string", "nullable": False},
              {"name": "title", "type": "string", "nullable": True}],
    "comments": [{"name": "id", "type": "string", "nullable": False},
                 {"name": "project_id", "type": "string", "nullable": False},
                 {"name": "body", "type": "string", "nullable": False}],
}
PUSH_SCHEMA = {table: {"columns": columns, "primaryKey": "id",
                       "scopes": [{"variable": "project_id", "column": "project_id"}]}
               for table, columns in LAYOUTS.items()}
# The resolver's answer for this actor: the scopes it may write.
ALLOWED = {"project_id": ["p1", "p2"]}


class SyncRefusal(Exception):
    """A syncular refusal: SQLSTATE class SY, the code as message, DETAIL as a JSON object."""

    def __init__(self, sqlstate, code, details):
        super().__init__(code)
        self.sqlstate, self.code, self.details = sqlstate, code, details


def query(conn, sql, params=()):
    """Runs one statement; maps syncular errors (SQLSTATE class SY) to SyncRefusal by code."""
    try:
        return conn.execute(sql, params)
    except psycopg.Error as e:
        if e.sqlstate and e.sqlstate.startswith("SY"):
            detail = e.diag.message_detail
            raise SyncRefusal(e.sqlstate, e.diag.message_primary, json.loads(detail) if detail else None) from e
        raise


def call(conn, sql, params=()):
    """`query`, returning the first column of the first row."""
    return query(conn, sql, params).fetchone()[0]


def check(condition, message):
    if not condition:
        raise SystemExit(f"python example: FAILED: {message}")


def setup(admin, host_role):
    """The migrator's part: schema, app tables, grants, registration, migration, push schema."""
    # PostgreSQL 15 gives a plain role no CREATE on `public`: the app tables live in a schema
    # the migrator owns (the DBA granted it CREATE on the database, scripts/examples.sh).
    admin.execute("CREATE SCHEMA IF NOT EXISTS app")
    for table, extra in (("tasks", "title text"), ("comments", "body text NOT NULL")):
        admin.execute(f"""CREATE TABLE IF NOT EXISTS app.{table} (
            "_sync_partition" text NOT NULL, "_sync_row_id" text NOT NULL,
            id text NOT NULL, project_id text NOT NULL, {extra},
            "_sync_server_version" bigint NOT NULL, "_sync_scopes" jsonb NOT NULL,
            "_sync_payload" bytea NOT NULL, "_sync_column_versions" bytea,
            PRIMARY KEY ("_sync_partition", "_sync_row_id"))""")
        call(admin, f"SELECT syncular.register_table('{table}', 'app.{table}')")
    # The server writes app rows as itself (push_commit is SECURITY INVOKER): it needs these
    # privileges and no others.
    role = sql.Identifier(host_role)
    admin.execute(sql.SQL("GRANT USAGE ON SCHEMA app TO {}").format(role))
    admin.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON app.tasks, app.comments TO {}").format(role))
    state = call(admin, "SELECT syncular.check_schema(%s, %s)", (VERSION, Jsonb(LAYOUTS)))
    if state == "migrate":
        with admin.transaction():
            previous = call(admin, "SELECT syncular.migrate_schema(%s, %s)", (VERSION, Jsonb(LAYOUTS)))
            print(f"migrated schema {previous} -> {VERSION}")
    check(call(admin, "SELECT syncular.set_push_schema(%s, %s)", (VERSION, Jsonb(PUSH_SCHEMA))) == 2, "push schema")


def encode(host, table, values):
    """The client's sparse row payload. A real client encodes it with its own row codec;
    `encode_row(…, sparse => true)` produces the same bytes, so it stands in for it here."""
    return call(host, "SELECT syncular.encode_row(%s, %s, true)", (table, Jsonb(values)))


def push(host, client_id, commit_id, ops, declared=(), options=None):
    """One PUSH_COMMIT frame in one call. ops: [(table, row_id, kind, base_version, payload)]."""
    return call(host, """SELECT syncular.push_commit(%s, %s, %s, 'alice', %s, %s, %s, %s, %s, %s::int2[],
                                                    %s::int8[], %s::bytea[], %s, %s)""",
                (PARTITION, client_id, commit_id, NOW, VERSION, Jsonb(ALLOWED),
                 [op[0] for op in ops], [op[1] for op in ops], [op[2] for op in ops],
                 [op[3] for op in ops], [op[4] for op in ops], Jsonb(list(declared)),
                 Jsonb(options or {"cacheIdentity": str(uuid.uuid4())})))


def validate_comment(values, exists):
    """This host's row validator for `comments`: host code, so push_commit cannot run it."""
    if exists:
        return "comments are append-only"
    if not values.get("body", "").strip():
        return "a comment needs a body"
    return None


def push_classic(host, client_id, commit_id, ops):
    """The classic path (docs/HOST-WALKTHROUGH.md) for a commit of `comments` upserts, which
    push_commit hands back: the host decodes each payload, runs its validator, writes the rows
    and appends the commit in one transaction. Returns (outcome, stored result)."""
    replay = call(host, "SELECT syncular.get_push_result(%s, %s, %s)", (PARTITION, client_id, commit_id))
    if replay is not None:
        return "replay", replay
    with host.transaction() as tx:
        stored = call(host, "SELECT syncular.push_begin(%s, %s, %s, %s)", (PARTITION, client_id, commit_id, VERSION))
        if stored is not None:
            raise psycopg.Rollback(tx)  # a concurrent delivery won; answer its result
        host.execute("SAVEPOINT syncular_push_candidate")
        ids = [op[1] for op in ops]
        existing = {row_id for (row_id,) in host.execute(
            """SELECT k.id FROM unnest(%s::text[]) AS k(id)
                 LEFT JOIN app.comments r ON r."_sync_partition" = %s AND r."_sync_row_id" = k.id
                 LEFT JOIN syncular.tombstone_seqs(%s, 'comments', %s) t ON t.row_id = k.id
                WHERE r."_sync_row_id" IS NOT NULL OR t.commit_seq IS NOT NULL""",
            (ids, PARTITION, PARTITION, ids))}
        changes = []
        for index, (_, row_id, _, _, payload) in enumerate(ops):
            # The host's codec decodes the client's sparse row; decode_row stands in for it.
            values = call(host, "SELECT syncular.decode_row('comments', %s, true)", (payload,))
            problem = validate_comment(values, row_id in existing)
            if problem:
                host.execute("ROLLBACK TO SAVEPOINT syncular_push_candidate")
                host.execute("RELEASE SAVEPOINT syncular_push_candidate")
                rejected = {"status": "rejected", "recordedAtMs": NOW, "cacheIdentity": str(uuid.uuid4()),
                            "results": [{"opIndex": index, "status": "error", "code": "app.invalid_comment",
                                         "message": problem, "retryable": False}]}
                return "rejected", call(host, "SELECT syncular.put_push_result(%s, %s, %s, %s)",
                                        (PARTITION, client_id, commit_id, Jsonb(rejected)))
            scopes = {"project_id": values["project_id"]}
            row = call(host, "SELECT syncular.encode_row('comments', %s)", (Jsonb(values),))  # the stored full row
            host.execute(
                """WITH w AS (INSERT INTO app.comments VALUES (%s, %s, %s, %s, %s, 1, %s, %s, NULL) RETURNING 1)
                   SELECT syncular.set_row_scopes(%s, 'comments', %s, %s) FROM w""",
                (PARTITION, row_id, values["id"], values["project_id"], values["body"], Jsonb(scopes), row,
                 PARTITION, row_id, Jsonb(scopes)))
            changes.append({"table": "comments", "rowId": row_id, "op": "upsert", "rowVersion": 1,
                            "scopes": scopes, "payload": base64.b64encode(row).decode()})
        commit = {"clientId": client_id, "clientCommitId": commit_id, "actorId": "alice",
                  "createdAtMs": NOW, "writerVersion": VERSION, "changes": changes}
        seq = call(host, "SELECT syncular.append_commit(%s, %s)", (PARTITION, Jsonb(commit)))
        reaction = {"idempotencyKey": json.dumps([PARTITION, client_id, commit_id, "notify"], separators=(",", ":")),
                    "type": "email.send", "version": 1, "payload": {"rows": ids}, "sourceClientId": client_id,
                    "sourceClientCommitId": commit_id, "sourceCommitSeq": seq, "createdAtMs": NOW}
        call(host, "SELECT syncular.enqueue_reactions(%s, %s)", (PARTITION, Jsonb([reaction])))
        applied = {"status": "applied", "commitSeq": seq, "recordedAtMs": NOW, "cacheIdentity": str(uuid.uuid4()),
                   "results": [{"opIndex": i, "status": "applied"} for i in range(len(ops))]}
        return "applied", call(host, "SELECT syncular.put_push_result(%s, %s, %s, %s)",
                               (PARTITION, client_id, commit_id, Jsonb(applied)))
    return "replay", stored


def push_comments(host, client_id, commit_id, ops):
    """The fallback contract: ask push_commit first, naming the tables with a row validator; on
    `fallback` nothing was stored, and the classic path gives the answer."""
    first = push(host, client_id, commit_id, ops, options={"rowValidatorTables": ["comments"]})
    check(first == {"outcome": "fallback", "reason": "row_validator", "opIndex": 0, "table": "comments"},
          f"fallback: {first}")
    check(call(host, "SELECT syncular.get_push_result(%s, %s, %s)", (PARTITION, client_id, commit_id)) is None,
          "a fallback stores nothing")
    return push_classic(host, client_id, commit_id, ops)


def pull(host, client_id, cursor, declared=()):
    """One pull request in one call: a document row, then the rows of every subscription."""
    subscriptions = [{"id": table, "table": table, "scopes": {"project_id": ["p1"]},
                      "effective": {"project_id": ["p1"]}, "cursor": cursor} for table in ("tasks", "comments")]
    rows = query(host, """SELECT document, sub, commit_seq, row_id, payload
                            FROM syncular.pull(%s, %s, 'alice', %s, %s, %s, %s, %s)""",
                 (PARTITION, client_id, NOW, str(uuid.uuid4()), VERSION,
                  Jsonb({"limitCommits": 1000, "subscriptions": subscriptions}), Jsonb(list(declared)))).fetchall()
    document = rows[0][0]
    check(document["client"] == "recorded", f"pull served: {document}")
    return document, [row[1:] for row in rows[1:]]


def main():
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin, psycopg.connect(HOST_URL, autocommit=True) as host:
        host_role = call(host, "SELECT current_user")
        check(not call(host, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"), "the server is no superuser")
        setup(admin, host_role)

        ops = [("tasks", row_id, UPSERT, None, encode(host, "tasks", {"id": row_id, "project_id": project, "title": title}))
               for row_id, project, title in (("t1", "p1", "write the spec"), ("t2", "p1", "ship it"), ("t3", "p2", "celebrate"))]
        applied = push(host, "device-py", "commit-1", ops)
        check(applied["outcome"] == "applied" and applied["commitSeq"] == 1
              and applied["result"]["results"] == [{"opIndex": i, "status": "applied"} for i in range(3)],
              f"push applied: {applied}")
        print(f"push_commit applied commit {applied['commitSeq']}")

        replay = push(host, "device-py", "commit-1", ops)
        check(replay["outcome"] == "cached" and replay["replayed"] and replay["result"] == applied["result"],
              f"replay: {replay}")
        print("the redelivery is answered from the stored result (cached)")

        edit = encode(host, "tasks", {"id": "t1", "title": "write the spec, v2"})
        updated = push(host, "device-py", "commit-2", [("tasks", "t1", UPSERT, 1, edit)])
        check(updated["outcome"] == "applied" and updated["commitSeq"] == 2, f"update: {updated}")

        # Another device edits t1 from version 1: its baseVersion is behind the stored version 2.
        stale = encode(host, "tasks", {"id": "t1", "title": "stale edit"})
        conflict = push(host, "device-py-b", "commit-1", [("tasks", "t1", UPSERT, 1, stale)])
        record = conflict["result"]["results"][0]
        check(conflict["outcome"] == "rejected" and record["status"] == "conflict"
              and record["code"] == "sync.version_conflict" and record["serverVersion"] == 2
              and record["conflictColumns"] == "BA==", f"conflict: {conflict}")  # bit 2: title
        server_row = call(host, "SELECT syncular.decode_row('tasks', %s)", (base64.b64decode(record["serverRow"]),))
        check(server_row == {"id": "t1", "project_id": "p1", "title": "write the spec, v2"}, f"serverRow: {server_row}")
        check(call(host, "SELECT syncular.max_commit_seq(%s)", (PARTITION,)) == 2, "a conflict consumes no number")
        print(f"stale edit rejected: {record['code']}, server row {server_row}")

        comment = encode(host, "comments", {"id": "c1", "project_id": "p1", "body": "looks good"})
        outcome, result = push_comments(host, "device-py", "commit-3", [("comments", "c1", UPSERT, None, comment)])
        check(outcome == "applied" and result["commitSeq"] == 3, f"classic push: {result}")
        empty = encode(host, "comments", {"id": "c2", "project_id": "p1", "body": " "})
        outcome, rejected = push_comments(host, "device-py", "commit-4", [("comments", "c2", UPSERT, None, empty)])
        check(outcome == "rejected" and rejected["results"][0]["code"] == "app.invalid_comment", f"rejected: {rejected}")
        check(call(host, "SELECT syncular.max_commit_seq(%s)", (PARTITION,)) == 3, "a rejection consumes no number")
        check(call(host, "SELECT count(*) FROM app.comments WHERE \"_sync_row_id\" = 'c2'") == 0, "candidates discarded")
        print("comments: push_commit fell back (row_validator); the classic path applied one, rejected one")

        document, rows = pull(host, "device-py-2", 0)
        check([(sub, seq, row_id) for sub, seq, row_id, _ in rows] == [(0, 1, "t1"), (0, 1, "t2"), (0, 2, "t1"), (1, 3, "c1")],
              f"rows: {rows}")
        check(call(host, "SELECT syncular.decode_row('tasks', %s)", (rows[2][3],))["title"] == "write the spec, v2",
              "the window carries the stored rows")
        check([s["nextCursor"] for s in document["subscriptions"]] == [3, 3] and document["cursor"] == 3,
              f"cursors: {document}")
        print(f"pulled {len(rows)} changes of project p1, new cursor {document['cursor']}")

        claimed = call(host, "SELECT syncular.claim_reactions(%s, 'worker-py', ARRAY['email.send'], %s, 30000, 10)",
                       (PARTITION, NOW))
        check(len(claimed) == 1 and claimed[0]["attempts"] == 1, f"claimed: {claimed}")
        done = call(host, "SELECT syncular.complete_reaction(%s, %s, 'worker-py', %s)",
                    (PARTITION, claimed[0]["idempotencyKey"], NOW + 1))
        check(done is True, "reaction completed")
        print("reaction claimed and completed")

        # A backfill worker declares a checkpoint at our version (an admin action); the server
        # did not declare it, so it is refused until the checkpoint is activated.
        call(admin, "SELECT syncular.declare_checkpoint(%s, 'titles', %s, %s)", (PARTITION, VERSION, NOW))
        try:
            pull(host, "device-py-2", 3)
            check(False, "a request while an undeclared backfill is pending must be refused")
        except SyncRefusal as refusal:
            check(refusal.sqlstate == "SY002" and refusal.code == "sync.schema_not_ready", f"refusal: {refusal.code}")
            check(refusal.details == {"partition": PARTITION, "projection": "titles"}, f"details: {refusal.details}")
            print(f"refused while backfilling: {refusal.code} {refusal.details}")
        declared = [{"partition": PARTITION, "name": "titles", "schemaVersion": VERSION}]
        backfill = encode(host, "tasks", {"id": "t1", "title": "write the spec, v3"})
        batch = push(host, "backfill-client", "titles-batch-1", [("tasks", "t1", UPSERT, None, backfill)], declared)
        check(batch["outcome"] == "applied", f"the declaring worker is served: {batch}")
        epoch = admin.execute("SELECT owner_epoch FROM syncular.claim_checkpoint(%s, 'titles', %s, %s)",
                              (PARTITION, VERSION, NOW)).fetchone()[0]
        seq = call(admin, "SELECT syncular.source_coverage_seq(%s, ARRAY['tasks'])", (PARTITION,))
        activated = call(admin, "SELECT syncular.activate_checkpoint(%s, 'titles', %s, %s, ARRAY['tasks'], %s)",
                         (PARTITION, epoch, seq, NOW))
        check(activated == "activated", f"activation: {activated}")
        document, rows = pull(host, "device-py-2", 3)
        check([(sub, seq, row_id) for sub, seq, row_id, _ in rows] == [(0, 4, "t1")] and document["cursor"] == 4,
              f"served again after activation: {rows} {document}")
        print("python example: ok")


if __name__ == "__main__":
    main()
