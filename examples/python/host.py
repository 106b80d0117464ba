#!/usr/bin/env python3
"""A small but complete Syncular host in Python (psycopg 3) over the syncular SQL API.

It creates its app table `tasks` (scope project:{project_id}), registers it, checks / migrates
the schema, and then: pushes a commit of several rows (the whole protocol of docs/HOST-WALKTHROUGH.md,
including the rejection path), replays it, pulls the commit window of a scope, claims and
completes a reaction, and is refused while a backfill it did not declare is pending.
Every step asserts its result; the process exits non-zero on the first surprise.

    SYNCULAR_EXAMPLE_URL="host=127.0.0.1 port=5432 user=postgres dbname=app" python3 host.py
"""
import base64
import json
import os
import uuid

import psycopg
from psycopg.types.json import Jsonb

URL = os.environ.get("SYNCULAR_EXAMPLE_URL", "host=127.0.0.1 port=55439 user=postgres dbname=example_python")
PARTITION = "acme"
VERSION = 1
NOW = 1_750_000_000_000
LAYOUTS = {"tasks": [
    {"name": "id", "type": "string", "nullable": False},
    {"name": "project_id", "type": "string", "nullable": False},
    {"name": "title", "type": "string", "nullable": True},
]}


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
    """`query`, returning the first row."""
    return query(conn, sql, params).fetchone()


def check(condition, message):
    if not condition:
        raise SystemExit(f"python example: FAILED: {message}")


def setup(conn):
    conn.execute("""CREATE TABLE IF NOT EXISTS public.tasks (
        "_sync_partition" text NOT NULL, "_sync_row_id" text NOT NULL,
        id text NOT NULL, project_id text NOT NULL, title text,
        "_sync_server_version" bigint NOT NULL, "_sync_scopes" jsonb NOT NULL,
        "_sync_payload" bytea NOT NULL, "_sync_column_versions" bytea,
        PRIMARY KEY ("_sync_partition", "_sync_row_id"))""")
    call(conn, "SELECT syncular.register_table('tasks', 'public.tasks')")
    state = call(conn, "SELECT syncular.check_schema(%s, %s)", (VERSION, Jsonb(LAYOUTS)))[0]
    if state == "migrate":
        with conn.transaction():
            previous = call(conn, "SELECT syncular.migrate_schema(%s, %s)", (VERSION, Jsonb(LAYOUTS)))[0]
            print(f"migrated schema {previous} -> {VERSION}")
    check(call(conn, "SELECT syncular.check_schema(%s, %s)", (VERSION, Jsonb(LAYOUTS)))[0] == "current", "schema current")


def push(conn, client_id, commit_id, ops, declared=()):
    """One push (docs/HOST-WALKTHROUGH.md). ops: [(row_id, project_id, title)]; an empty title is
    refused by this host's rule, which takes the rejection path."""
    replay = call(conn, "SELECT syncular.get_push_result(%s, %s, %s)", (PARTITION, client_id, commit_id))[0]
    if replay is not None:
        return "replay", replay
    with conn.transaction() as tx:
        stored = call(conn, "SELECT syncular.push_begin(%s, %s, %s, %s, %s)",
                      (PARTITION, client_id, commit_id, VERSION, Jsonb(list(declared))))[0]
        if stored is not None:
            raise psycopg.Rollback(tx)  # a concurrent delivery won; answer its result
        conn.execute("SAVEPOINT syncular_push_candidate")
        ids = [op[0] for op in ops]
        current = conn.execute(
            """SELECT k.id, r."_sync_server_version", t.commit_seq
                 FROM unnest(%s::text[]) AS k(id)
                 LEFT JOIN public.tasks r ON r."_sync_partition" = %s AND r."_sync_row_id" = k.id
                 LEFT JOIN syncular.tombstone_seqs(%s, 'tasks', %s) t ON t.row_id = k.id""",
            (ids, PARTITION, PARTITION, ids)).fetchall()
        versions = {row_id: (version or 0) for row_id, version, _ in current}
        changes = []
        for index, (row_id, project, title) in enumerate(ops):
            if not title:
                conn.execute("ROLLBACK TO SAVEPOINT syncular_push_candidate")
                conn.execute("RELEASE SAVEPOINT syncular_push_candidate")
                rejected = {"status": "rejected", "recordedAtMs": NOW, "cacheIdentity": str(uuid.uuid4()),
                            "results": [{"opIndex": index, "status": "error", "code": "app.title_required",
                                         "message": "a task needs a title", "retryable": False}]}
                return "rejected", call(conn, "SELECT syncular.put_push_result(%s, %s, %s, %s)",
                                        (PARTITION, client_id, commit_id, Jsonb(rejected)))[0]
            scopes = {"project_id": project}
            payload = json.dumps({"id": row_id, "project_id": project, "title": title}).encode()
            version = versions[row_id] + 1
            conn.execute(
                """WITH w AS (
                     INSERT INTO public.tasks VALUES (%s, %s, %s, %s, %s, %s, %s, %s, NULL)
                     ON CONFLICT ("_sync_partition", "_sync_row_id") DO UPDATE
                       SET title = EXCLUDED.title, "_sync_server_version" = EXCLUDED."_sync_server_version",
                           "_sync_scopes" = EXCLUDED."_sync_scopes", "_sync_payload" = EXCLUDED."_sync_payload"
                     RETURNING 1)
                   SELECT syncular.set_row_scopes(%s, 'tasks', %s, %s) FROM w""",
                (PARTITION, row_id, row_id, project, title, version, Jsonb(scopes), payload,
                 PARTITION, row_id, Jsonb(scopes)))
            changes.append({"table": "tasks", "rowId": row_id, "op": "upsert", "rowVersion": version,
                            "scopes": scopes, "payload": base64.b64encode(payload).decode()})
        commit = {"clientId": client_id, "clientCommitId": commit_id, "actorId": "alice",
                  "createdAtMs": NOW, "writerVersion": VERSION, "changes": changes}
        seq = call(conn, "SELECT syncular.append_commit(%s, %s)", (PARTITION, Jsonb(commit)))[0]
        reaction = {"idempotencyKey": json.dumps([PARTITION, client_id, commit_id, "notify"], separators=(",", ":")),
                    "type": "email.send", "version": 1, "payload": {"rows": ids}, "sourceClientId": client_id,
                    "sourceClientCommitId": commit_id, "sourceCommitSeq": seq, "createdAtMs": NOW}
        call(conn, "SELECT syncular.enqueue_reactions(%s, %s)", (PARTITION, Jsonb([reaction])))
        applied = {"status": "applied", "commitSeq": seq, "recordedAtMs": NOW, "cacheIdentity": str(uuid.uuid4()),
                   "results": [{"opIndex": i, "status": "applied"} for i in range(len(ops))]}
        stored = call(conn, "SELECT syncular.put_push_result(%s, %s, %s, %s)",
                      (PARTITION, client_id, commit_id, Jsonb(applied)))[0]
        return "applied", stored
    return "replay", stored


def pull(conn, client_id, project, cursor):
    """One incremental pull of `tasks` for one project, in one call (docs/HOST-WALKTHROUGH.md,
    pull): gate, client record, window and the record's new cursor in one statement."""
    scopes = {"project_id": [project]}
    request = {"limitCommits": 1000, "subscriptions": [
        {"id": "s1", "table": "tasks", "scopes": scopes, "effective": scopes, "cursor": cursor}]}
    rows = query(
        conn, "SELECT document, commit_seq, row_id, op, row_version FROM syncular.pull(%s, %s, 'alice', %s, %s, %s, %s)",
        (PARTITION, client_id, NOW, str(uuid.uuid4()), VERSION, Jsonb(request))).fetchall()
    document = rows[0][0]
    check(document["client"] == "recorded", f"pull served: {document}")
    return [row[1:] for row in rows[1:]]


def main():
    with psycopg.connect(URL, autocommit=True) as conn:
        setup(conn)
        ops = [("t1", "p1", "write the spec"), ("t2", "p1", "ship it"), ("t3", "p2", "celebrate")]
        outcome, result = push(conn, "device-py", "commit-1", ops)
        check(outcome == "applied" and result["commitSeq"] == 1, f"push applied: {result}")
        print(f"push applied as commit {result['commitSeq']}")

        outcome, replay = push(conn, "device-py", "commit-1", ops)
        check(outcome == "replay" and replay == result, "replay returns the stored result")
        print("replay answered from the stored result")

        outcome, rejected = push(conn, "device-py", "commit-2", [("t4", "p1", "fine"), ("t5", "p1", "")])
        check(outcome == "rejected" and rejected["results"][0]["opIndex"] == 1, f"rejected: {rejected}")
        check(call(conn, "SELECT syncular.max_commit_seq(%s)", (PARTITION,))[0] == 1, "a rejection consumes no number")
        check(call(conn, "SELECT count(*) FROM public.tasks WHERE \"_sync_row_id\" = 't4'")[0] == 0, "candidates discarded")
        print("rejected push stored, no commit consumed")

        rows = pull(conn, "device-py-2", "p1", 0)
        check([(r[0], r[1]) for r in rows] == [(1, "t1"), (1, "t2")], f"window for p1: {rows}")
        print(f"pulled {len(rows)} changes of project p1")

        claimed = call(conn, "SELECT syncular.claim_reactions(%s, 'worker-py', ARRAY['email.send'], %s, 30000, 10)",
                       (PARTITION, NOW))[0]
        check(len(claimed) == 1 and claimed[0]["attempts"] == 1, f"claimed: {claimed}")
        done = call(conn, "SELECT syncular.complete_reaction(%s, %s, 'worker-py', %s)",
                    (PARTITION, claimed[0]["idempotencyKey"], NOW + 1))[0]
        check(done is True, "reaction completed")
        print("reaction claimed and completed")

        # A backfill worker declares a checkpoint at our version; we did not declare it.
        call(conn, "SELECT syncular.declare_checkpoint(%s, 'titles', %s, %s)", (PARTITION, VERSION, NOW))
        try:
            pull(conn, "device-py-2", "p1", 1)
            check(False, "a request while an undeclared backfill is pending must be refused")
        except SyncRefusal as refusal:
            check(refusal.sqlstate == "SY002" and refusal.code == "sync.schema_not_ready", f"refusal: {refusal.code}")
            check(refusal.details == {"partition": PARTITION, "projection": "titles"}, f"details: {refusal.details}")
            print(f"refused while backfilling: {refusal.code} {refusal.details}")
        declared = [{"partition": PARTITION, "name": "titles", "schemaVersion": VERSION}]
        outcome, _ = push(conn, "backfill-client", "titles-batch-1", [("t1", "p1", "write the spec v2")], declared)
        check(outcome == "applied", "the declaring worker is served")
        epoch = conn.execute("SELECT owner_epoch FROM syncular.claim_checkpoint(%s, 'titles', %s, %s)",
                             (PARTITION, VERSION, NOW)).fetchone()[0]
        seq = call(conn, "SELECT syncular.source_coverage_seq(%s, ARRAY['tasks'])", (PARTITION,))[0]
        activated = call(conn, "SELECT syncular.activate_checkpoint(%s, 'titles', %s, %s, ARRAY['tasks'], %s)",
                         (PARTITION, epoch, seq, NOW))[0]
        check(activated == "activated", f"activation: {activated}")
        check(len(pull(conn, "device-py-2", "p1", 1)) == 1, "served again after activation")
        print("python example: ok")


if __name__ == "__main__":
    main()
