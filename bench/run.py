#!/usr/bin/env python3
"""Side-by-side benchmark of upstream 0.24's client-side statements and the syncular extension.

Run through bench/run.sh (installs the release build, starts a throwaway cluster). Every workload
is a pgbench script run with -M prepared over loopback TCP, upstream and extension in the same
run, so the ratios compare like with like. Prints a table and writes docs/BENCHMARKS.md.
"""
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pull  # noqa: E402  (bench/pull.py)
import reactions  # noqa: E402  (bench/reactions.py)

# The PostgreSQL major under test (bench/run.sh sets both from scripts/pg.sh).
BIN = os.environ.get("BENCH_PG_BIN", "/usr/lib/postgresql/15/bin")
MAJOR = os.environ.get("BENCH_PG_MAJOR", "15")
PORT = os.environ.get("BENCH_PORT", "25437")
SECONDS = int(os.environ.get("BENCH_SECONDS", "3"))
# Each workload runs ROUNDS times per side, the sides interleaved (baseline, syncular, baseline,
# …); the table shows the median round of each side. A single run on a shared 2-core VM moves by
# ±10–30 %, more than several of the effects measured here.
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
# The one-client push, the append and the reaction rotations carry the issues' targets: more rounds.
TARGET_ROUNDS = int(os.environ.get("BENCH_TARGET_ROUNDS", "5"))
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
UPSTREAM_DDL = os.path.join(ROOT, "tests", "fixtures", "upstream-0.24-ddl.sql")
UPSTREAM_PUSH = os.environ.get("UPSTREAM_PUSH", os.path.join(HERE, "upstream-0.24-push.py"))
WORK = tempfile.mkdtemp(prefix="syncular-bench-")
os.chmod(WORK, 0o755)


def psql(db, sql, quiet=True):
    cmd = [f"{BIN}/psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p", PORT, "-U", "postgres", "-d", db]
    out = subprocess.run(cmd + ["-At", "-c", sql], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"psql failed on {db}: {out.stderr}\n{sql[:500]}")
    return out.stdout.strip()


def psql_file(db, path):
    cmd = [f"{BIN}/psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p", PORT, "-U", "postgres", "-d", db, "-f", path]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"psql -f {path} failed: {out.stderr}")


def write_script(name, text):
    path = os.path.join(WORK, name)
    with open(path, "w") as f:
        f.write(text + "\n")
    return path


def pgbench(db, script, clients, env_extra=None):
    env = dict(os.environ)
    if env_extra:
        env.update(env_extra)
    cmd = [f"{BIN}/pgbench", "-n", "-M", "prepared", "-h", "127.0.0.1", "-p", PORT, "-U", "postgres",
           "-c", str(clients), "-j", str(clients), "-T", str(SECONDS), "-f", script, db]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0 or "tps =" not in out.stdout:
        sys.exit(f"pgbench failed ({db}, {script}): {out.stdout}\n{out.stderr}")
    tps = float(re.search(r"tps = ([0-9.]+)", out.stdout).group(1))
    lat = float(re.search(r"latency average = ([0-9.]+) ms", out.stdout).group(1))
    failed = re.search(r"number of failed transactions: (\d+)", out.stdout)
    if failed and int(failed.group(1)) > 0:
        sys.exit(f"pgbench reported failed transactions: {out.stdout}")
    return tps, lat


def median(runs):
    """The median (tps, latency) of an odd number of rounds, by tps."""
    return sorted(runs)[len(runs) // 2]


# ---- scripts --------------------------------------------------------------------------------

def upstream_push(n, shared):
    text = subprocess.run([sys.executable, UPSTREAM_PUSH, str(n)], capture_output=True, text=True, check=True).stdout
    if shared:
        text = text.replace("'p-' || :client_id", "'p-shared'")
    return text


def ext_push(n, shared):
    """The extension's push path with the same app-row writes (docs/HOST-WALKTHROUGH.md): optimistic read,
    BEGIN, push_begin, SAVEPOINT, one read of the touched rows, per row one statement (upsert +
    set_row_scopes), append_commit, put_push_result, COMMIT: 7 + 1 + N round trips."""
    p = "'p-shared'" if shared else "'p-' || :client_id"
    rows = ",".join(f"'r{i}'" for i in range(n))
    changes = ",".join(
        '{"table":"tasks","rowId":"r%d","op":"upsert","rowVersion":2,"scopes":{"project_id":"proj"},"payload":"AQIDBAUGBwg="}' % i
        for i in range(n))
    w = []
    w.append(r"\set cc random(1, 2000000000)")
    w.append(f"SELECT syncular.get_push_result(({p}), 'c', :cc::text);")
    w.append("BEGIN;")
    w.append(f"SELECT syncular.push_begin(({p}), 'c', :cc::text, 1);")
    w.append("SAVEPOINT syncular_push_candidate;")
    w.append(f"SELECT \"_sync_row_id\", \"_sync_server_version\", \"_sync_scopes\", \"_sync_payload\", \"_sync_column_versions\" FROM tasks WHERE \"_sync_partition\"=({p}) AND \"_sync_row_id\" = ANY(ARRAY[{rows}]);")
    for i in range(n):
        rid = f"'r{i}'"
        w.append(
            f"WITH w AS (INSERT INTO tasks(\"_sync_partition\",\"_sync_row_id\",id,project_id,title,\"_sync_server_version\",\"_sync_scopes\",\"_sync_payload\",\"_sync_column_versions\") "
            f"VALUES (({p}),{rid},{rid},'proj','t '||:cc,1,'{{\"project_id\":\"proj\"}}','\\x0102030405060708',NULL) "
            f"ON CONFLICT (\"_sync_partition\",\"_sync_row_id\") DO UPDATE SET id=excluded.id, project_id=excluded.project_id, title=excluded.title, "
            f"\"_sync_server_version\"=tasks.\"_sync_server_version\"+1, \"_sync_scopes\"=excluded.\"_sync_scopes\", \"_sync_payload\"=excluded.\"_sync_payload\", "
            f"\"_sync_column_versions\"=excluded.\"_sync_column_versions\" RETURNING 1) "
            f"SELECT syncular.set_row_scopes(({p}), 'tasks', {rid}, '{{\"project_id\":\"proj\"}}') FROM w;")
    w.append(
        f"SELECT syncular.append_commit(({p}), ('{{\"clientId\":\"c\",\"clientCommitId\":\"' || :cc || '\",\"actorId\":\"actor\","
        f"\"createdAtMs\":1750000000000,\"writerVersion\":1,\"changes\":[{changes}]}}')::jsonb) AS commit_seq \\gset")
    w.append(
        f"SELECT syncular.put_push_result(({p}), 'c', :cc::text, ('{{\"status\":\"applied\",\"commitSeq\":' || :commit_seq || ',\"results\":[]}}')::jsonb);")
    w.append("COMMIT;")
    return "\n".join(w)


def ext_push_batched_call(n, shared):
    """The same push with the app rows written in ONE multi-row upsert and their scope index in
    ONE set_rows_scopes call: 10 round trips for any N, no trigger."""
    p = "'p-shared'" if shared else "'p-' || :client_id"
    script = ext_push_batched(n, shared).replace("tasks_meta", "tasks")
    rows_doc = ",".join('{"rowId":"r%d","scopes":{"project_id":"proj"}}' % i for i in range(n))
    lines = script.split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith("SELECT syncular.append_commit"))
    lines.insert(at, f"SELECT syncular.set_rows_scopes(({p}), 'tasks', '[{rows_doc}]');")
    return "\n".join(lines)


def ext_push_batched(n, shared):
    """The same push with the app rows written in ONE multi-row upsert per table; the row-meta
    trigger (register_table(..., true)) keeps the scope index natively: 9 round trips for any N."""
    p = "'p-shared'" if shared else "'p-' || :client_id"
    rows = ",".join(f"'r{i}'" for i in range(n))
    changes = ",".join(
        '{"table":"tasks_meta","rowId":"r%d","op":"upsert","rowVersion":2,"scopes":{"project_id":"proj"},"payload":"AQIDBAUGBwg="}' % i
        for i in range(n))
    values = ",".join(f"(({p}),'r{i}','r{i}','proj','t '||:cc,1,'{{\"project_id\":\"proj\"}}','\\x0102030405060708',NULL)" for i in range(n))
    return "\n".join([
        r"\set cc random(1, 2000000000)",
        f"SELECT syncular.get_push_result(({p}), 'c', :cc::text);",
        "BEGIN;",
        f"SELECT syncular.push_begin(({p}), 'c', :cc::text, 1);",
        "SAVEPOINT syncular_push_candidate;",
        f"SELECT \"_sync_row_id\", \"_sync_server_version\", \"_sync_scopes\", \"_sync_payload\", \"_sync_column_versions\" FROM tasks_meta WHERE \"_sync_partition\"=({p}) AND \"_sync_row_id\" = ANY(ARRAY[{rows}]);",
        f"INSERT INTO tasks_meta(\"_sync_partition\",\"_sync_row_id\",id,project_id,title,\"_sync_server_version\",\"_sync_scopes\",\"_sync_payload\",\"_sync_column_versions\") VALUES {values} "
        f"ON CONFLICT (\"_sync_partition\",\"_sync_row_id\") DO UPDATE SET id=excluded.id, project_id=excluded.project_id, title=excluded.title, "
        f"\"_sync_server_version\"=tasks_meta.\"_sync_server_version\"+1, \"_sync_scopes\"=excluded.\"_sync_scopes\", \"_sync_payload\"=excluded.\"_sync_payload\", "
        f"\"_sync_column_versions\"=excluded.\"_sync_column_versions\";",
        f"SELECT syncular.append_commit(({p}), ('{{\"clientId\":\"c\",\"clientCommitId\":\"' || :cc || '\",\"actorId\":\"actor\","
        f"\"createdAtMs\":1750000000000,\"writerVersion\":1,\"changes\":[{changes}]}}')::jsonb) AS commit_seq \\gset",
        f"SELECT syncular.put_push_result(({p}), 'c', :cc::text, ('{{\"status\":\"applied\",\"commitSeq\":' || :commit_seq || ',\"results\":[]}}')::jsonb);",
        "COMMIT;",
    ])


# Codec payloads of the push_commit rows (hex, one per row id), encoded by the extension at setup:
# sparse (what a client sends) and full (what the floor stores).
PC_PAYLOADS = {}
PC_FULL = {}
PC_TABLE_DDL = """CREATE TABLE IF NOT EXISTS tasks_pc(
  "_sync_partition" TEXT NOT NULL, "_sync_row_id" TEXT NOT NULL,
  id TEXT, project_id TEXT, title TEXT,
  "_sync_server_version" BIGINT NOT NULL, "_sync_scopes" JSONB NOT NULL,
  "_sync_payload" BYTEA NOT NULL, "_sync_column_versions" BYTEA,
  PRIMARY KEY ("_sync_partition", "_sync_row_id"))"""
PC_TABLE = {"columns": [{"name": "id", "type": "string", "nullable": False},
                        {"name": "project_id", "type": "string", "nullable": False},
                        {"name": "title", "type": "string", "nullable": True}],
            "primaryKey": "id", "scopes": [{"variable": "project_id", "column": "project_id"}]}
# The whole compiled schema (set_push_schema takes every stored table): the classic sides'
# `tasks` has the same shape; only `tasks_pc` is pushed through push_commit.
PC_SCHEMA = {"tasks": PC_TABLE, "tasks_pc": PC_TABLE}


def setup_push_commit():
    """The push_commit side's own table (its stored rows carry real codec payloads, which the
    classic sides' constant bytes are not), its push schema, and the payloads of rows r0…r99."""
    psql("ext", PC_TABLE_DDL)
    psql("ext", "SELECT syncular.register_table('tasks_pc', 'public.tasks_pc')")
    psql("ext", f"SELECT syncular.set_push_schema(1, '{json.dumps(PC_SCHEMA)}')")
    for i in range(100):
        row = json.dumps({"id": f"r{i}", "project_id": "proj", "title": f"task {i}"})
        PC_PAYLOADS[i] = psql("ext", f"SELECT encode(syncular.encode_row('tasks_pc', '{row}', true), 'hex')")
        PC_FULL[i] = psql("ext", f"SELECT encode(syncular.encode_row('tasks_pc', '{row}', false), 'hex')")
    # The rows must take the native path: a fallback would be measured as a fast no-op.
    out = psql("ext", push_commit_call(2, "'p-check'", "'1'"))
    if '"outcome": "applied"' not in out:
        sys.exit(f"push_commit did not apply in the benchmark's setup: {out}")


def push_commit_call(n, p, cc):
    """One `push_commit` of N last-writer-wins updates of rows r0…r(N-1) (no baseVersion: the
    same row decisions as upstream's replay), scope project_id = proj."""
    ids = ",".join(f"'r{i}'" for i in range(n))
    payloads = ",".join(f"'\\x{PC_PAYLOADS[i]}'" for i in range(n))
    return (f"SELECT syncular.push_commit(({p}), 'c', {cc}, 'actor', 1750000000000, 1, '{{\"project_id\":[\"proj\"]}}', "
            f"ARRAY[{','.join(['$$tasks_pc$$'] * n)}]::text[], ARRAY[{ids}]::text[], ARRAY[{','.join(['1'] * n)}]::smallint[], "
            f"ARRAY[{','.join(['NULL'] * n)}]::bigint[], ARRAY[{payloads}]::bytea[]);")


def ext_push_commit(n, shared):
    """The one-call push: one round trip per commit."""
    p = "'p-shared'" if shared else "'p-' || :client_id"
    return "\n".join([r"\set cc random(1, 2000000000)", push_commit_call(n, p, ":cc::text")])


def floor_push(n, p="'pf-' || :client_id"):
    """The push floor: the writes of an applied one-call push of N row updates as ONE hand-written
    statement — app-row upserts (constant payloads, no decode, merge or conflict check), their
    scope index, the allocation, commit, changes, change scopes and the push result — with no lock,
    gate, idempotency read or validation. Its own partitions: its rows hold no column versions."""
    values = ",".join(f"(({p}),'r{i}','r{i}','proj','task {i}',1,'{{\"project_id\":\"proj\"}}','\\x{PC_FULL[i]}',NULL)" for i in range(n))
    ids = ",".join(f"({i}, 'r{i}', '\\x{PC_FULL[i]}'::bytea)" for i in range(n))
    results = ",".join('{"opIndex":%d,"status":"applied"}' % i for i in range(n))
    return "\n".join([
        r"\set cc random(1, 2000000000)",
        f"WITH r AS (INSERT INTO tasks_pc(\"_sync_partition\",\"_sync_row_id\",id,project_id,title,\"_sync_server_version\",\"_sync_scopes\",\"_sync_payload\",\"_sync_column_versions\") "
        f"VALUES {values} ON CONFLICT (\"_sync_partition\",\"_sync_row_id\") DO UPDATE SET id=excluded.id, project_id=excluded.project_id, "
        f"title=excluded.title, \"_sync_server_version\"=tasks_pc.\"_sync_server_version\"+1, \"_sync_scopes\"=excluded.\"_sync_scopes\", "
        f"\"_sync_payload\"=excluded.\"_sync_payload\", \"_sync_column_versions\"=excluded.\"_sync_column_versions\" RETURNING \"_sync_row_id\", \"_sync_server_version\"), "
        f"rs AS (INSERT INTO syncular.sync_row_scopes (partition, tbl, var, value, row_id) SELECT ({p}), 'tasks_pc', 'project_id', 'proj', r.\"_sync_row_id\" FROM r ON CONFLICT DO NOTHING), "
        f"{floor_alloc(p)}, "
        f"c AS (INSERT INTO syncular.sync_commits (partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms, writer_version) "
        f"SELECT ({p}), seq, 'c', :cc::text, 'actor', 1750000000000, 1 FROM alloc RETURNING commit_seq), "
        f"ch AS (INSERT INTO syncular.sync_changes (partition, commit_seq, idx, tbl, row_id, op, row_version, scopes, payload) "
        f"SELECT ({p}), c.commit_seq, v.idx, 'tasks_pc', v.row_id, 1, r.\"_sync_server_version\", '{{\"project_id\":\"proj\"}}'::jsonb, v.payload "
        f"FROM c, (VALUES {ids}) AS v(idx, row_id, payload) JOIN r ON r.\"_sync_row_id\" = v.row_id), "
        f"sc AS (INSERT INTO syncular.sync_change_scopes (partition, tbl, var, value, commit_seq) SELECT ({p}), 'tasks_pc', 'project_id', 'proj', c.commit_seq FROM c), "
        f"pr AS (INSERT INTO syncular.sync_push_results (partition, client_id, client_commit_id, result) "
        f"SELECT ({p}), 'c', :cc::text, jsonb_build_object('status', 'applied', 'commitSeq', c.commit_seq, 'results', '[{results}]'::jsonb, "
        f"'recordedAtMs', 1750000000000, 'cacheIdentity', 'x') FROM c ON CONFLICT DO NOTHING) "
        f"SELECT commit_seq FROM c;",
    ])


def upstream_append(n, p="'a-' || :client_id"):
    """Upstream's append: allocation feeding the commit insert, then one statement per change."""
    w = [r"\set cc random(1, 2000000000)", "BEGIN;"]
    w.append(f"WITH allocated AS (INSERT INTO sync_partitions(partition, max_commit_seq) VALUES (({p}), 1) ON CONFLICT (partition) DO UPDATE SET max_commit_seq = sync_partitions.max_commit_seq + 1 RETURNING max_commit_seq) INSERT INTO sync_commits(partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms, writer_version) SELECT ({p}), max_commit_seq, 'c', :cc::text, 'actor', 1750000000000, 1 FROM allocated RETURNING commit_seq \\gset")
    for i in range(n):
        w.append(f"WITH inserted AS (INSERT INTO sync_changes(partition, commit_seq, idx, tbl, row_id, op, row_version, scopes, payload) VALUES (({p}), :commit_seq, {i}, 'tasks', 'r{i}', 1, 2, '{{\"project_id\":\"proj\"}}'::text::jsonb, '\\x0102030405060708') RETURNING partition, commit_seq, tbl, row_id, op, scopes), scoped AS (INSERT INTO sync_change_scopes(partition, tbl, var, value, commit_seq) SELECT partition, tbl, key, value, commit_seq FROM inserted CROSS JOIN LATERAL jsonb_each_text(scopes) ON CONFLICT DO NOTHING) INSERT INTO sync_tombstones(partition, tbl, row_id, commit_seq) SELECT partition, tbl, row_id, commit_seq FROM inserted WHERE op=2 ON CONFLICT (partition, tbl, row_id) DO UPDATE SET commit_seq = excluded.commit_seq;")
    w.append("COMMIT;")
    return "\n".join(w)


def commit_doc(n):
    changes = ",".join(
        '{"table":"tasks","rowId":"r%d","op":"upsert","rowVersion":2,"scopes":{"project_id":"proj"},"payload":"AQIDBAUGBwg="}' % i
        for i in range(n))
    return ('{"clientId":"c","clientCommitId":"\' || :cc || \'","actorId":"actor","createdAtMs":1750000000000,'
            '"writerVersion":1,"changes":[%s]}' % changes)


def ext_append(n, partition="'a-' || :client_id"):
    return "\n".join([
        r"\set cc random(1, 2000000000)",
        f"SELECT syncular.append_commit(({partition}), ('{commit_doc(n)}')::jsonb);",
    ])


def floor_insert():
    return "\n".join([r"\set cc random(1, 2000000000)",
                      "INSERT INTO floor_rows(client_id, k) VALUES (:client_id, :cc);"])


def floor_alloc(p):
    """The floors' commit-seq allocation: the upsert `append_commit` runs, as a CTE `alloc(seq)`."""
    return (f"alloc AS (INSERT INTO syncular.sync_partitions AS p (partition, max_commit_seq, horizon_seq) VALUES (({p}), 1, 0) "
            f"ON CONFLICT (partition) DO UPDATE SET max_commit_seq = p.max_commit_seq + 1 RETURNING p.max_commit_seq AS seq)")


def floor_cte(n, p="'f-' || :client_id"):
    """Hand-written set-based statement: the same allocation, commit, change and scope-index rows
    as append_commit writes, in one writable CTE (the fence trigger fires on the commit insert)."""
    values = ",".join(f"({i}, 'r{i}')" for i in range(n))
    return "\n".join([
        r"\set cc random(1, 2000000000)",
        f"WITH {floor_alloc(p)}, "
        f"c AS (INSERT INTO syncular.sync_commits (partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms, writer_version) "
        f"SELECT ({p}), seq, 'c', :cc::text, 'actor', 1750000000000, 1 FROM alloc RETURNING commit_seq), "
        f"ch AS (INSERT INTO syncular.sync_changes (partition, commit_seq, idx, tbl, row_id, op, row_version, scopes, payload) "
        f"SELECT ({p}), c.commit_seq, v.idx, 'tasks', v.row_id, 1, 2, '{{\"project_id\":\"proj\"}}'::jsonb, '\\x0102030405060708' "
        f"FROM c, (VALUES {values}) AS v(idx, row_id)), "
        f"sc AS (INSERT INTO syncular.sync_change_scopes (partition, tbl, var, value, commit_seq) SELECT ({p}), 'tasks', 'project_id', 'proj', c.commit_seq FROM c) "
        f"SELECT commit_seq FROM c;",
    ])


def floor_document(n, p="'d-' || :client_id"):
    """The floor fed the same input as append_commit: one writable CTE that reads the commit
    document (the same text, cast to jsonb per call) and inserts the same rows, validating nothing.
    The constant floor above reads no input at all: its rows are constants of the prepared plan."""
    return "\n".join([
        r"\set cc random(1, 2000000000)",
        f"WITH d AS (SELECT ('{commit_doc(n)}')::jsonb AS doc), "
        f"{floor_alloc(p)}, "
        f"c AS (INSERT INTO syncular.sync_commits (partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms, writer_version) "
        f"SELECT ({p}), seq, doc->>'clientId', doc->>'clientCommitId', doc->>'actorId', (doc->>'createdAtMs')::bigint, "
        f"(doc->>'writerVersion')::bigint FROM alloc, d RETURNING commit_seq), "
        f"e AS (SELECT x.* FROM d, ROWS FROM (jsonb_to_recordset(d.doc->'changes') "
        f"AS (\"table\" text, \"rowId\" text, op text, \"rowVersion\" bigint, scopes jsonb, payload text)) WITH ORDINALITY "
        f"AS x(\"table\", \"rowId\", op, \"rowVersion\", scopes, payload, ord)), "
        f"ch AS (INSERT INTO syncular.sync_changes (partition, commit_seq, idx, tbl, row_id, op, row_version, scopes, payload) "
        f"SELECT ({p}), c.commit_seq, e.ord - 1, e.\"table\", e.\"rowId\", CASE e.op WHEN 'delete' THEN 2 ELSE 1 END, "
        f"e.\"rowVersion\", e.scopes, decode(e.payload, 'base64') FROM c, e), "
        f"sc AS (INSERT INTO syncular.sync_change_scopes (partition, tbl, var, value, commit_seq) "
        f"SELECT DISTINCT ON (e.\"table\", s.key, s.value) ({p}), e.\"table\", s.key, s.value, c.commit_seq "
        f"FROM c, e, jsonb_each_text(e.scopes) AS s) "
        f"SELECT commit_seq FROM c;",
    ])


def window_script(partition, after, through):
    return f"SELECT count(*) FROM syncular.read_commit_window('{partition}', 'tasks', '{{\"project_id\":[\"p7\"]}}', {after}, {through}, 100);"


# ---- setup ----------------------------------------------------------------------------------

def setup_ext():
    tasks_ddl = """CREATE TABLE IF NOT EXISTS tasks(
      "_sync_partition" TEXT NOT NULL, "_sync_row_id" TEXT NOT NULL,
      id TEXT NOT NULL, project_id TEXT NOT NULL, title TEXT,
      "_sync_server_version" BIGINT NOT NULL, "_sync_scopes" JSONB NOT NULL,
      "_sync_payload" BYTEA NOT NULL, "_sync_column_versions" BYTEA,
      PRIMARY KEY ("_sync_partition", "_sync_row_id"))"""
    psql("ext", "CREATE EXTENSION syncular")
    psql("ext", tasks_ddl)
    psql("ext", "CREATE TABLE floor_rows (client_id int, k bigint)")
    psql("ext", "SELECT syncular.register_table('tasks', 'public.tasks')")
    psql("ext", "CREATE TABLE tasks_meta (LIKE tasks INCLUDING ALL)")
    psql("ext", "SELECT syncular.register_table('tasks_meta', 'public.tasks_meta', true)")
    layouts = json.dumps({name: table["columns"] for name, table in PC_SCHEMA.items()})
    psql("ext", f"BEGIN; SELECT syncular.migrate_schema(1, '{layouts}'); COMMIT;")
    setup_push_commit()
    setup_window()
    psql("ext", "INSERT INTO syncular.sync_writer_fence VALUES ('fenced', 1)")
    # Steady state: every partition row exists before the clock starts. (Upstream's
    # `SELECT … FOR UPDATE` on a missing partition row locks nothing, so concurrent first pushes
    # to one new partition race and fail; the extension's lock_partition creates the row.)
    partitions = ["p-shared", "fenced", "unfenced"] + [f"{k}-{c}" for k in ("p", "pf", "a", "f", "d", "n", "zzz-tail", "fenced-off") for c in range(8)]
    values = ",".join(f"('{p}', 0, 0)" for p in partitions)
    for db in ("ext", "upstream"):
        psql(db, f"INSERT INTO {'syncular.' if db == 'ext' else ''}sync_partitions VALUES {values} ON CONFLICT DO NOTHING")
    for db in ("ext", "upstream"):
        seed_right_edge(db)
    psql("ext", "VACUUM ANALYZE")
    psql("upstream", "VACUUM ANALYZE")
    # Write the bulk load out now, not during the first workloads.
    psql("postgres", "CHECKPOINT")


RIGHT_EDGE = "zz-right-edge"


def log_history_sql(schema, partition, n, project):
    """`n` one-change commits under `partition` (commit, change and scope-index rows, and the
    partition's counter), written below the fence; `project` is the change's scope value as an
    SQL expression of `i`."""
    g = f"FROM generate_series(1, {n}) i"
    return "\n".join([
        "SET session_replication_role = replica;",
        f"INSERT INTO {schema}sync_commits(partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms, writer_version) "
        f"SELECT '{partition}', i, 'c', 'k' || i, 'actor', 1750000000000, 1 {g};",
        f"INSERT INTO {schema}sync_changes(partition, commit_seq, idx, tbl, row_id, op, row_version, scopes, payload) "
        f"SELECT '{partition}', i, 0, 'tasks', 'r' || i, 1, 1, jsonb_build_object('project_id', {project}), '\\x0102' {g};",
        f"INSERT INTO {schema}sync_change_scopes(partition, tbl, var, value, commit_seq) SELECT '{partition}', 'tasks', 'project_id', {project}, i {g};",
        f"INSERT INTO {schema}sync_partitions(partition, max_commit_seq, horizon_seq) VALUES ('{partition}', {n}, 0);"])


def seed_right_edge(db):
    """Rows under a partition that sorts after every benchmarked one, enough to fill several leaf
    pages of every index the workloads write. An insert into the rightmost leaf of a B-tree skips
    the descent (PostgreSQL's rightmost-leaf fast path); without these rows whichever workload's
    partition sorts last would get it — twice as fast at N=100 — as no partition of a production
    log with many partitions does. With them, every workload descends the tree."""
    s = "syncular." if db == "ext" else ""
    p = RIGHT_EDGE
    g = "FROM generate_series(1, 2000) i"
    tables = ["tasks", "tasks_meta"] if db == "ext" else ["tasks"]
    psql(db, "\n".join(
        [log_history_sql(s, p, 2000, "'proj'"),
         f"INSERT INTO {s}sync_row_scopes(partition, tbl, var, value, row_id) SELECT '{p}', 'tasks', 'project_id', 'proj', 'r' || i {g};",
         f"INSERT INTO {s}sync_push_results(partition, client_id, client_commit_id, result) SELECT '{p}', 'c', 'k' || i, '{{}}' {g};"]
        + [f"INSERT INTO {t}(\"_sync_partition\", \"_sync_row_id\", id, project_id, title, \"_sync_server_version\", \"_sync_scopes\", "
           f"\"_sync_payload\") SELECT '{p}', 'r' || i, 'r' || i, 'proj', 't', 1, '{{\"project_id\":\"proj\"}}', '\\x01' {g};" for t in tables]))


def setup_window():
    """The window workload's history: 10^4 and 10^6 one-change commits, bulk-loaded (history
    predates the fence) into a database of its own, so that the append and push workloads write
    into log indexes as small as upstream's fresh ones."""
    psql("window_db", "CREATE EXTENSION syncular")
    for part, n in (("w4", 10_000), ("w6", 1_000_000)):
        psql("window_db", log_history_sql("syncular.", part, n, "'p' || (i % 100)"))
    psql("window_db", "VACUUM ANALYZE")

def machine():
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            cpu = m.group(1) if m else cpu
    except OSError:
        pass
    pg = psql("postgres", "SHOW server_version")
    return f"{platform.node()}: {os.cpu_count()} cores, {cpu}; PostgreSQL {pg}; Linux {platform.release()}"


# ---- run ------------------------------------------------------------------------------------

def main():
    started = time.time()
    # The statements are measured, not background maintenance: no autovacuum worker or timed
    # checkpoint competes for the two cores in the middle of a round (both sides alike; the
    # setup's VACUUM ANALYZE and CHECKPOINT run before the first workload).
    psql("postgres", "ALTER SYSTEM SET autovacuum = off")
    psql("postgres", "ALTER SYSTEM SET checkpoint_timeout = '1h'")
    psql("postgres", "ALTER SYSTEM SET max_wal_size = '32GB'")
    psql("postgres", "SELECT pg_reload_conf()")
    psql("postgres", "CREATE DATABASE upstream")
    psql("postgres", "CREATE DATABASE ext")
    psql("postgres", "CREATE DATABASE window_db")
    psql_file("upstream", UPSTREAM_DDL)
    psql("upstream", "CREATE TABLE floor_rows (client_id int, k bigint)")
    pull_only = os.environ.get("BENCH_PULL_ONLY") == "1"
    if os.environ.get("BENCH_REACTIONS_ONLY") == "1":
        # Only the reactions next to pgmq (bench/reactions.py): its section alone is replaced.
        splice_section("Reactions", reactions.section(reactions.run(psql, psql_file, pgbench, write_script, TARGET_ROUNDS, WORK)))
        return
    if not pull_only:
        print("setting up (bulk-loading 10^4 and 10^6 commits for the window workload into window_db)...", flush=True)
        setup_ext()
    results = []

    only = os.environ.get("BENCH_ONLY")

    def rotate(clients, sides, rows, rounds=ROUNDS):
        """Run the sides in turn, `rounds` times over (a, b, c, a, b, c, …), and report each row
        (label, baseline side, syncular side) from the two sides' median rounds. Rows that share
        a side share its measurement, so their ratios are taken against the same rounds."""
        if only and not any(only in label for label, _, _ in rows):
            return {}
        # A side may carry a fourth element: environment for its connections (PGOPTIONS).
        scripts = {side[0]: (side[1], write_script(f"{side[0]}.sql", side[2]), side[3] if len(side) > 3 else None)
                   for side in sides}
        runs = {key: [] for key in scripts}
        for _ in range(rounds):
            for key, (db, script, env) in scripts.items():
                runs[key].append(pgbench(db, script, clients, env))
        for label, base, ours in rows:
            up, ex = median(runs[base]), median(runs[ours])
            results.append((label, clients, up, ex))
            spread = lambda key: "/".join(f"{r[0]:.0f}" for r in runs[key])
            print(f"{label:<44} c={clients}  baseline {up[0]:>8.0f} tps {up[1]:>7.2f} ms | syncular {ex[0]:>8.0f} tps {ex[1]:>7.2f} ms | x{ex[0] / up[0]:.2f}"
                  f"   (rounds: {spread(base)} | {spread(ours)})", flush=True)
        if not rows:
            for key in runs:
                print(f"{key:<44} c={clients}  {median(runs[key])[0]:>8.0f} tps   (rounds: "
                      + "/".join(f"{r[0]:.0f}" for r in runs[key]) + ")", flush=True)
        return {key: median(runs[key]) for key in runs}

    def pair(label, clients, up_script, ext_script, up_db="upstream", ext_db="ext"):
        name = label.replace(" ", "_").replace(",", "").replace("^", "")
        rotate(clients, [(f"{name}-up", up_db, up_script), (f"{name}-ext", ext_db, ext_script)],
               [(label, f"{name}-up", f"{name}-ext")])

    if pull_only:
        # Only the pull (bench/pull.py): its section of docs/BENCHMARKS.md is replaced, nothing else.
        splice_pull_section(pull.section(pull.run(rotate, psql, psql_file, UPSTREAM_DDL)))
        return
    # a) push: one client, upstream and the extension's three ways in one rotation per N (the
    #    rows share upstream's rounds); then four clients.
    for n in (1, 10, 100):
        up = f"push-{n}-upstream"
        ways = [("", ext_push(n, False)),
                (", batched rows + row-meta trigger", ext_push_batched(n, False)),
                (", batched rows + set_rows_scopes", ext_push_batched_call(n, False)),
                (", push_commit", ext_push_commit(n, False))]
        one_call, classic, floor = f"push-{n}-syncular-3", f"push-{n}-syncular-2", f"push-{n}-floor"
        rotate(1, [(up, "upstream", upstream_push(n, False))]
               + [(f"push-{n}-syncular-{i}", "ext", script) for i, (_, script) in enumerate(ways)]
               + [(floor, "ext", floor_push(n))],
               [(f"push N={n}, own partitions{how}", up, f"push-{n}-syncular-{i}") for i, (how, _) in enumerate(ways)]
               + [(f"push N={n}, push_commit vs classic batched", classic, one_call),
                  (f"push N={n}, push_commit vs one-statement floor", floor, one_call)],
               TARGET_ROUNDS)
        for shared, where in ((False, "own partitions"), (True, "one shared partition")):
            rotate(4, [(f"push-{n}-{shared}-4-up", "upstream", upstream_push(n, shared)),
                       (f"push-{n}-{shared}-4-classic", "ext", ext_push(n, shared)),
                       (f"push-{n}-{shared}-4-one-call", "ext", ext_push_commit(n, shared))],
                   [(f"push N={n}, {where}", f"push-{n}-{shared}-4-up", f"push-{n}-{shared}-4-classic"),
                    (f"push N={n}, {where}, push_commit", f"push-{n}-{shared}-4-up", f"push-{n}-{shared}-4-one-call")])
    def append_rotation(n, key, where="", partition=None, floors=()):
        """Upstream's append statements, the constant CTE floor, `append_commit` and any further
        `floors` ((label, side key, script)) for N changes, in one rotation: every ratio is taken
        against the same `append_commit` rounds. Row labels end in `where`; `partition`, when
        given, is the one partition every side writes (else each side has its own)."""
        at = () if partition is None else (partition,)
        up, floor, ours = f"{key}-upstream", f"{key}-cte-floor", f"{key}-syncular"
        sides = [(up, "upstream", upstream_append(n, *at)), (floor, "ext", floor_cte(n, *at)),
                 (ours, "ext", ext_append(n, *at))] + [(side, "ext", script) for _, side, script in floors]
        rows = [(f"append N={n}{where}", up, ours), (f"append N={n} vs one-statement CTE floor{where}", floor, ours)]
        rows += [(f"append N={n} vs {label}{where}", side, ours) for label, side, _ in floors]
        rotate(1, sides, rows, TARGET_ROUNDS)

    # b) + c) append against upstream and the floors, all sides in one rotation per N.
    for n in (1, 10, 100):
        floors = [("CTE floor fed the same document", "append-10-document-floor", floor_document(n)),
                  ("one-row INSERT floor", "append-10-insert-floor", floor_insert())] if n == 10 else []
        append_rotation(n, f"append-{n}", floors=floors)
    # The opt-in commit notification (syncular.notify_commits): append_commit of one change with
    # it off (baseline) and on, on partitions of their own, no listener (pg_notify's queue write
    # at commit is the cost a host pays whether or not a process listens).
    notify_off, notify_on = "notify-off", "notify-on"
    rotate(1, [(notify_off, "ext", ext_append(1, "'n-' || :client_id")),
               (notify_on, "ext", ext_append(1, "'n-' || :client_id"), {"PGOPTIONS": "-c syncular.notify_commits=on"})],
           [("append N=1: notify_commits off vs on", notify_off, notify_on)], TARGET_ROUNDS)
    if os.environ.get("BENCH_RIGHT_EDGE") == "1":
        # Opt-in (about 45 s more): the N=10 append sides on one partition that sorts after every
        # other, so that every insert of every side takes the rightmost-leaf fast path, as in a
        # log with a single partition.
        append_rotation(10, "tail-10", ", one partition at the right edge", "'zzz-tail-' || :client_id")
    # d) window (baseline column = 10^4 commits, syncular column = 10^6)
    pair("window 100 changes: 10^4 vs 10^6 commits", 1,
         window_script("w4", 10_000 - 100 * 100, 10_000), window_script("w6", 1_000_000 - 100 * 100, 1_000_000), up_db="window_db", ext_db="window_db")
    # f) the pull, four ways (bench/pull.py); BENCH_SKIP_PULL=1 leaves it out (about 7 minutes).
    if os.environ.get("BENCH_SKIP_PULL") != "1" and not only:
        PULL_SECTION.extend(pull.section(pull.run(rotate, psql, psql_file, UPSTREAM_DDL)))
    # g) the reaction outbox next to pgmq (bench/reactions.py); BENCH_SKIP_REACTIONS=1 leaves it
    #    out (about 5 minutes).
    if os.environ.get("BENCH_SKIP_REACTIONS") != "1" and not only:
        REACTIONS_SECTION.extend(reactions.section(reactions.run(psql, psql_file, pgbench, write_script, TARGET_ROUNDS, WORK)))
    # e) fence overhead: interleaved rounds, best of three per variant (the effect is smaller
    #    than the noise of a shared 2-core machine; the best round is the least disturbed).
    variants = {
        "off": (ext_append(1, "'fenced-off-' || :client_id"), {"PGOPTIONS": "-c session_replication_role=replica"}),
        "row": (ext_append(1, "'fenced'"), None),
        "norow": (ext_append(1, "'unfenced'"), None),
    }
    best = {}
    if not only or "fence" in only:
        for _ in range(3):
            for name, (script, env) in variants.items():
                r = pgbench("ext", write_script(f"fence-{name}.sql", script), 1, env)
                best[name] = max(best.get(name, (0, 0)), r)
        results.append(("append N=1: trigger off vs fence row", 1, best["off"], best["row"]))
        results.append(("append N=1: trigger off vs no fence row", 1, best["off"], best["norow"]))
        for r in results[-2:]:
            print(f"{r[0]:<44} c=1  {r[2][0]:>8.0f} tps vs {r[3][0]:>8.0f} tps | x{r[3][0] / r[2][0]:.3f}", flush=True)
        trigger_cost(best["row"][1])

    elapsed = time.time() - started
    report(results, elapsed)


FENCE_COST = {}


BULK_RUNS = iter(range(1, 1000))


def bulk_insert_ms(replica):
    """Server-side: 100,000 commit rows in one INSERT into a fenced partition, with the fence
    trigger firing per row (origin) or not at all (replica). No client round trips, so the
    difference is the trigger's own cost, free of pgbench noise. Every run inserts keys of its
    own: a rolled-back run leaves its index entries behind, and keys seen before would make the
    next run's unique checks visit those dead rows."""
    role = "replica" if replica else "origin"
    base = next(BULK_RUNS) * 1_000_000_000
    out = subprocess.run(
        [f"{BIN}/psql", "-X", "-q", "-h", "127.0.0.1", "-p", PORT, "-U", "postgres", "-d", "ext", "-v", "ON_ERROR_STOP=1"],
        input=f"SET session_replication_role = {role};\nBEGIN;\n\\timing on\n"
              f"INSERT INTO syncular.sync_commits SELECT 'fenced', {base} + g, 'c', 'k', 'a', 1, 1 FROM generate_series(1, 100000) g;\n"
              "\\timing off\nROLLBACK;\n",
        capture_output=True, text=True)
    m = re.search(r"Time: ([0-9.]+) ms", out.stdout)
    if out.returncode != 0 or not m:
        sys.exit(f"bulk insert failed: {out.stdout}{out.stderr}")
    return float(m.group(1))


def trigger_cost(append_latency_ms):
    # Interleaved on/off pairs, the fastest of each: the least disturbed runs of both.
    pairs = [(bulk_insert_ms(False), bulk_insert_ms(True)) for _ in range(5)]
    on = min(p[0] for p in pairs)
    off = min(p[1] for p in pairs)
    per_row_us = (on - off) * 1000 / 100_000
    FENCE_COST.update(per_row_us=per_row_us, share=per_row_us / (append_latency_ms * 1000), latency=append_latency_ms)
    print(f"fence trigger: {per_row_us:.1f} us per row = {100 * FENCE_COST['share']:.1f} % of append_commit N=1 ({append_latency_ms:.3f} ms)", flush=True)


def target_lines(results):
    """The issue's targets, judged on this run's rows (those that ran)."""
    by_label = {(label, clients): (up, ex) for label, clients, up, ex in results}
    rows = []

    def ratio(label):
        up, ex = by_label[(label, 1)]
        return ex[0] / up[0]

    if ("append N=10", 1) in by_label:
        r = ratio("append N=10")
        rows.append(("`append_commit` N=10 ≥ 4× upstream's append statements", f"{r:.2f}×", r >= 4))
    if ("append N=10 vs one-statement CTE floor", 1) in by_label:
        r = ratio("append N=10 vs one-statement CTE floor")
        rows.append(("`append_commit` N=10 ≥ 0.9× the one-statement CTE floor", f"{r:.2f}×", r >= 0.9))
    push = [(ratio(label), label) for label, clients in by_label if clients == 1 and label.startswith("push N=10, own")]
    if push:
        r, label = max(push)
        how = label.split("own partitions")[1].lstrip(", ") or "per-row statements"
        rows.append(("push N=10, 1 client ≥ 3× upstream", f"{r:.2f}× ({how})", r >= 3))
    if FENCE_COST:
        rows.append(("fence overhead ≤ 3 %", f"{100 * FENCE_COST['share']:.1f} %", FENCE_COST["share"] <= 0.03))
    window = by_label.get(("window 100 changes: 10^4 vs 10^6 commits", 1))
    if window:
        r = window[1][1] / window[0][1]
        rows.append(("window latency at 10^6 ≤ 1.2× at 10^4", f"{r:.2f}×", r <= 1.2))
    if not rows:
        return []
    lines = ["", "Targets of issue 4, judged on this run:", "",
             "| target | this run | |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {'met' if met else 'missed'} |" for name, value, met in rows]
    if ("append N=10", 1) in by_label and ("append N=10 vs one-statement CTE floor", 1) in by_label:
        upstream = by_label[("append N=10", 1)][0][0]
        floor = by_label[("append N=10 vs one-statement CTE floor", 1)][0][0]
        lines += ["", f"In this run the one-statement CTE floor itself ran at {floor / upstream:.2f}× upstream's append "
                      f"statements, so 4× upstream asks `append_commit` for {400 * upstream / floor:.0f} % of the floor."]
    return lines + push_commit_target_lines(by_label)


def push_commit_target_lines(by_label):
    """Issue 13's targets for the one-call push (one client, own partitions)."""
    wanted = [("push N=1, own partitions, push_commit", "`push_commit` N=1 ≥ 3× upstream", 3),
              ("push N=10, own partitions, push_commit", "`push_commit` N=10 ≥ 8× upstream (goal 10×)", 8),
              ("push N=100, own partitions, push_commit", "`push_commit` N=100 ≥ 20× upstream", 20),
              ("push N=10, push_commit vs classic batched", "`push_commit` N=10 ≥ 2× the classic batched push", 2)]
    rows = []
    for label, name, target in wanted:
        if (label, 1) in by_label:
            up, ex = by_label[(label, 1)]
            rows.append(f"| {name} | {ex[0] / up[0]:.2f}× | {'met' if ex[0] / up[0] >= target else 'missed'} |")
    floors = [f"N={n}: {by_label[(f'push N={n}, push_commit vs one-statement floor', 1)][1][0] / by_label[(f'push N={n}, push_commit vs one-statement floor', 1)][0][0]:.2f}×"
              for n in (1, 10, 100) if (f"push N={n}, push_commit vs one-statement floor", 1) in by_label]
    if not rows:
        return []
    lines = ["", "Targets of issue 13 (one client, own partitions), judged on this run:", "",
             "| target | this run | |", "|---|---|---|"] + rows
    if floors:
        lines += ["", "`push_commit` against the one-statement push floor (the same writes, no checks): " + ", ".join(floors) + "."]
    return lines


# The opening a host reads first: what the table measures and how to read a ratio. Its figures
# summarise the ranges this benchmark has shown across runs (docs/BENCHMARKS-notes.md).
HOST_INTRO = """**What this means for a host.** Each row times one whole operation as a host sends it, upstream
0.24's statements (the baseline) next to this extension, on the same machine in the same run;
*ratio* is how many times more operations per second the extension serves (above 1: faster).
A push in one call (`push_commit`) is 4× (one row) to 10× (ten rows) and 20× (100 rows)
upstream's, about 2× the classic multi-call path; a pull in one call 4× at one client, 2.3–3.8×
at four; writes of a commit (`append`) 1.7× to 8×; the pull window stays as fast with 10^6
commits in the log as with 10^4. What bounds the rest is in the notes at the end. Absolute
numbers are this 2-core VM's: compare ratios, not tps.
"""


def report(results, elapsed):
    lines = []
    lines.append("# Benchmarks\n")
    lines.append("Generated by `bench/run.sh` (one run, all workloads side by side). Do not edit by hand.\n")
    lines.append(HOST_INTRO)
    lines.append(f"- Machine: {machine()}")
    lines.append(f"- Settings: pgbench `-M prepared`, loopback TCP, {ROUNDS} interleaved rounds of {SECONDS} s per side and workload "
                 f"({TARGET_ROUNDS} for the one-client push rows, where upstream and the extension's three ways take turns, and for the "
                 "append rows, where upstream, the floors and `append_commit` take turns: rows sharing a side share its rounds; the "
                 "table shows each side's median round), one `-j` thread per client; the window's 10^6-commit history in a database "
                 "of its own, so upstream and the extension write into equally fresh log tables, with the same rows at the right "
                 "edge of every index; throwaway cluster with `fsync = off`, autovacuum off and no timed checkpoint during the run "
                 "(both sides alike: the comparison is round trips and CPU, not disk or background work).")
    lines.append(f"- Extension: release build. Baseline: `tests/fixtures/upstream-0.24-ddl.sql` + `bench/upstream-0.24-push.py` (the shared replay of upstream 0.24's statements).")
    lines.append(f"- Whole run: {elapsed:.0f} s.\n")
    lines.append("| workload | clients | baseline tps | baseline ms | syncular tps | syncular ms | ratio |")
    lines.append("|---|---|---|---|---|---|---|")
    for label, clients, up, ex in results:
        lines.append(f"| {label} | {clients} | {up[0]:.0f} | {up[1]:.3f} | {ex[0]:.0f} | {ex[1]:.3f} | {ex[0] / up[0]:.2f} |")
    if FENCE_COST:
        lines.append("")
        lines.append(f"Fence trigger, measured server-side (100,000-row INSERT into a fenced partition, trigger on vs "
                     f"`session_replication_role = replica`, fastest of 5 interleaved pairs): **{FENCE_COST['per_row_us']:.1f} µs per row = "
                     f"{100 * FENCE_COST['share']:.1f} %** of an `append_commit` of one change ({FENCE_COST['latency']:.3f} ms above). "
                     "The pgbench pair above has more noise than the effect it measures.")
    lines.extend(target_lines(results))
    lines.append("")
    lines.append("Columns: *baseline* is upstream 0.24's statements for `push` and `append` rows; for the floor rows it is the "
                 "floor (for `push_commit`: one hand-written statement with the same writes and no lock, gate, idempotency "
                 "read, decode, merge or check); for `push_commit vs classic batched` it is the classic path with one "
                 "multi-row upsert and `set_rows_scopes` (10 round trips); for the window row it is the same window at 10^4 "
                 "commits (syncular column: 10^6); for the fence rows it is `append_commit` with the trigger disabled "
                 "(`session_replication_role = replica`); for the notify row it is `append_commit` with "
                 "`syncular.notify_commits` off (syncular column: on). `push_commit` rows write `tasks_pc`, a table of the "
                 "same shape whose stored rows carry real codec payloads (the classic sides store constant bytes); its "
                 "sparse payloads update every column of an existing row, last writer wins, like upstream's replay.")
    if PULL_SECTION:
        lines += [""] + PULL_SECTION
    if REACTIONS_SECTION:
        lines += [""] + REACTIONS_SECTION
    # Sections other benchmarks generate into the same file stay as their last run left them.
    regenerated = [h for h, section in (("## Pull", PULL_SECTION), ("## Reactions", REACTIONS_SECTION)) if section]
    if MAJOR == "15":
        lines += kept_sections(os.path.join(ROOT, "docs", "BENCHMARKS.md"), regenerated)
    # PostgreSQL 15 writes docs/BENCHMARKS.md (with the latest 18 run's ratios next to its own);
    # any other major writes docs/BENCHMARKS-pg<major>.md.
    name = "BENCHMARKS.md" if MAJOR == "15" else f"BENCHMARKS-pg{MAJOR}.md"
    path = os.path.join(ROOT, "docs", name)
    if MAJOR == "15":
        lines.extend(other_major_lines(results, "18"))
    body = "\n".join(lines) + "\n"
    extra = os.path.join(ROOT, "docs", "BENCHMARKS-notes.md")
    if MAJOR == "15" and os.path.exists(extra):
        with open(extra) as f:
            body += "\n" + f.read()
    with open(path, "w") as f:
        f.write(body)
    print(f"\nwrote {path}")


PULL_SECTION = []
REACTIONS_SECTION = []

# Sections of docs/BENCHMARKS.md written by their own runs (bench/pull.py with BENCH_PULL_ONLY=1,
# bench/adapter-ts.sh, the reactions run, bench/cpu.sh, bench/replica.sh): a full run keeps them, unless it
# regenerated them.
KEPT = ("## Pull", "## TypeScript adapter", "## Reactions", "## Server CPU (issue 28): the baseline, and where a push's time goes", "## Read replicas")


def kept_sections(path, regenerated):
    """The KEPT sections of the current file (each up to the next `## ` heading), minus those
    this run regenerated."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        text = f.read()
    out = []
    for heading in KEPT:
        if heading in regenerated:
            continue
        start = text.find(heading + "\n")
        if start < 0:
            continue
        end = text.find("\n## ", start + 1)
        out += [""] + text[start:end if end >= 0 else len(text)].rstrip("\n").split("\n")
    return out


def splice_pull_section(section):
    """Replaces the "## Pull" section of docs/BENCHMARKS.md (or inserts it before the notes)."""
    splice_section("Pull", section)


def splice_section(heading, section):
    """Replaces the "## <heading>" section of docs/BENCHMARKS.md (or inserts it before the notes)."""
    path = os.path.join(ROOT, "docs", "BENCHMARKS.md")
    with open(path) as f:
        text = f.read()
    block = "\n".join(section) + "\n\n"
    start = text.find(f"## {heading}\n")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + block + (text[end + 1:] if end >= 0 else "")
    else:
        at = text.find("## Reading the numbers")
        text = text[:at] + block + text[at:] if at >= 0 else text + "\n" + block
    with open(path, "w") as f:
        f.write(text)
    print(f"\nwrote the {heading} section of {path}")


def other_major_lines(results, major):
    """The ratios of the latest run on another major (docs/BENCHMARKS-pg<major>.md), next to
    this run's, row by row; nothing if that major has not been run."""
    path = os.path.join(ROOT, "docs", f"BENCHMARKS-pg{major}.md")
    if not os.path.exists(path):
        return []
    theirs = {}
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 7 and cells[0] not in ("workload", "---"):
                theirs[(cells[0], cells[1])] = cells[6]
    rows = [("| workload | clients | ratio on 15 (this run) | ratio on " + major + " |"), "|---|---|---|---|"]
    for label, clients, up, ex in results:
        if (label, str(clients)) in theirs:
            rows.append(f"| {label} | {clients} | {ex[0] / up[0]:.2f} | {theirs[(label, str(clients))]} |")
    if len(rows) == 2:
        return []
    return ["", f"## PostgreSQL {major} next to 15", "",
            f"The same benchmark on PostgreSQL {major} (`BENCH_PG_MAJOR={major} bash bench/run.sh`, "
            f"docs/BENCHMARKS-pg{major}.md, its own run); ratios are each major's own upstream-vs-syncular "
            "comparison, so they compare across majors even where absolute speeds differ.", ""] + rows


if __name__ == "__main__":
    main()
