"""The pull side by side (docs/BENCHMARKS.md, Pull): one sync request carrying one incremental
subscription, four ways over the same log in one database — upstream 0.24's 10 statements, the
classic path of docs/HOST-WALKTHROUGH.md (8 round trips), the one call `syncular.pull`, and a
floor: one hand-written statement making the same reads (gate, bounds, client record, the
candidate commits the window returns and their changes) and the same writes (registry touch,
client record). Catch-up (a full 100-change window) and idle (cursor at the head), 1 and 4
clients, at 10^4 commits per partition (10 partitions, the issue's setup) and 10^6 (one
partition). Commits hold 10 changes of one project (20 projects); at 10^6 the history older than
the last 10^4 commits holds one change per commit, so the load stays near a minute while the
commit, scope-index and change indexes hold 10^6 commits (cursors stay in the last 10^4).

Used by bench/run.py: `run(rotate, psql, psql_file)` returns the section's lines."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATOR = os.path.join(HERE, "upstream-0.24-pull.py")
NOW, EPOCH = "1750000000000", "'0b9c5c1e-7a43-4c4e-9d6e-5f0a2a9b3c11'"
SMALL, BIG = 10_000, 1_000_000
PARTITIONS = 10


def history_sql(schema, partition, n, full_from):
    """`n` commits of `partition`; those above `full_from` with 10 changes, the others with one."""
    g = f"FROM generate_series(1, {n}) i"
    project = "'p' || (i % 20)"
    return "\n".join([
        "SET session_replication_role = replica;",
        f"INSERT INTO {schema}sync_commits(partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms, writer_version) "
        f"SELECT '{partition}', i, 'c', 'k' || i, 'actor', 1750000000000, 1 {g};",
        f"INSERT INTO {schema}sync_changes(partition, commit_seq, idx, tbl, row_id, op, row_version, scopes, payload) "
        f"SELECT '{partition}', i, j, 'tasks', 'r' || i || '-' || j, 1, 1, jsonb_build_object('project_id', {project}), "
        f"'\\x0102030405060708' {g}, generate_series(0, CASE WHEN i > {full_from} THEN 9 ELSE 0 END) j;",
        f"INSERT INTO {schema}sync_change_scopes(partition, tbl, var, value, commit_seq) "
        f"SELECT '{partition}', 'tasks', 'project_id', {project}, i {g};",
        f"INSERT INTO {schema}sync_partitions(partition, max_commit_seq, horizon_seq) VALUES ('{partition}', {n}, 0);",
        f"INSERT INTO {schema}sync_partition_registry(partition, log_epoch, epoch_required, last_authenticated_at_ms) "
        f"VALUES ('{partition}', {EPOCH}, false, {NOW});",
        f"INSERT INTO {schema}sync_clients(partition, client_id, actor_id, wire_version, cursor, subscriptions, updated_at_ms) "
        f"SELECT '{partition}', 'c-' || c, 'actor', 2, 0, '[]', {NOW} FROM generate_series(0, 3) c;"])


APP_TABLE = """CREATE TABLE public.tasks_app (
  _sync_partition text NOT NULL, _sync_row_id text NOT NULL, id text, project_id text,
  _sync_server_version bigint NOT NULL, _sync_scopes jsonb NOT NULL, _sync_payload bytea NOT NULL,
  _sync_column_versions bytea, PRIMARY KEY (_sync_partition, _sync_row_id));
"""


def setup(psql, psql_file, ddl):
    psql("postgres", "CREATE DATABASE pull_db")
    psql_file("pull_db", ddl)
    psql("pull_db", "CREATE EXTENSION syncular")
    # A subscription's table must be registered (an unregistered one fails the request, SY041);
    # the pulls read the log only, so the relation stays empty (public.tasks is upstream's).
    psql("pull_db", APP_TABLE + "SELECT syncular.register_table('tasks', 'public.tasks_app');")
    parts = [(f"part-{k}", SMALL, 0) for k in range(PARTITIONS)] + [("big", BIG, BIG - SMALL)]
    for schema in ("", "syncular."):
        for name, n, full_from in parts:
            psql("pull_db", history_sql(schema, name, n, full_from))
    psql("pull_db", "VACUUM ANALYZE")
    psql("postgres", "CHECKPOINT")


def generated(side, lo, hi, where):
    out = subprocess.run([sys.executable, GENERATOR, side, str(lo), str(hi)] + where,
                         capture_output=True, text=True, check=True)
    return out.stdout


def one_call(lo, hi, where):
    p = f"'{where[1]}'" if where[0] == "--partition" else "('part-' || :part)"
    head = generated("syncular", lo, hi, where).splitlines()
    sets = [line for line in head if line.startswith("\\set")]
    scopes = "{\"project_id\":[\"p' || :proj || '\"]}"
    request = ("('{\"limitCommits\":100,\"wireVersion\":2,\"subscriptions\":[{\"id\":\"s1\",\"table\":\"tasks\","
               f"\"scopes\":{scopes},\"effective\":{scopes},\"cursor\":' || :cursor || '}}]}}')::jsonb")
    return "\n".join(sets + [
        f"SELECT * FROM syncular.pull({p}, ('c-' || :client_id), 'actor', {NOW}, {EPOCH}, 1, {request});"])


def floor(lo, hi, where):
    """One statement: upstream's gate reads, the bounds, the client record, the candidate commits
    the window returns (11: 10 changes each, 101 asked) with their changes, the registry touch and
    the client record's upsert."""
    p = f"'{where[1]}'" if where[0] == "--partition" else "('part-' || :part)"
    head = generated("syncular", lo, hi, where).splitlines()
    sets = [line for line in head if line.startswith("\\set")]
    c = "('c-' || :client_id)"
    subs = "('[{\"id\":\"s1\",\"table\":\"tasks\",\"scopes\":{\"project_id\":[\"p' || :proj || '\"]}}]')::jsonb"
    return "\n".join(sets + [
        "WITH touch AS (INSERT INTO syncular.sync_partition_registry AS r (partition, log_epoch, epoch_required, last_authenticated_at_ms) "
        f"VALUES ({p}, {EPOCH}, false, {NOW}) ON CONFLICT (partition) DO UPDATE SET last_authenticated_at_ms = EXCLUDED.last_authenticated_at_ms RETURNING log_epoch), "
        "meta AS (SELECT schema_version FROM syncular.sync_schema_meta WHERE id = 1), "
        "pending AS (SELECT count(*) AS n FROM syncular.sync_backfill_checkpoints WHERE schema_version = 1 AND state <> 'activated'), "
        f"cl AS (SELECT actor_id, cursor FROM syncular.sync_clients WHERE partition = {p} AND client_id = {c}), "
        f"st AS (SELECT max_commit_seq, horizon_seq FROM syncular.sync_partitions WHERE partition = {p}), "
        f"k AS (SELECT x.commit_seq FROM syncular.sync_change_scopes x, st WHERE x.partition = {p} AND x.tbl = 'tasks' AND x.var = 'project_id' "
        "AND x.value = ('p' || :proj) AND x.commit_seq > :cursor AND x.commit_seq <= st.max_commit_seq ORDER BY x.commit_seq LIMIT 11), "
        f"w AS (SELECT k.commit_seq, m.created_at_ms, m.actor_id, ch.idx, ch.row_id, ch.op, ch.row_version, ch.scopes, ch.payload FROM k "
        f"JOIN syncular.sync_commits m ON m.partition = {p} AND m.commit_seq = k.commit_seq "
        f"JOIN syncular.sync_changes ch ON ch.partition = {p} AND ch.commit_seq = k.commit_seq AND ch.tbl = 'tasks'), "
        "up AS (INSERT INTO syncular.sync_clients (partition, client_id, actor_id, wire_version, cursor, subscriptions, updated_at_ms) "
        f"VALUES ({p}, {c}, 'actor', 2, :cursor, {subs}, {NOW}) ON CONFLICT (partition, client_id) DO UPDATE "
        "SET actor_id = EXCLUDED.actor_id, wire_version = EXCLUDED.wire_version, cursor = EXCLUDED.cursor, "
        "subscriptions = EXCLUDED.subscriptions, updated_at_ms = EXCLUDED.updated_at_ms) "
        "SELECT touch.log_epoch, meta.schema_version, pending.n, cl.actor_id, st.max_commit_seq, st.horizon_seq, w.* "
        "FROM touch CROSS JOIN st LEFT JOIN meta ON true LEFT JOIN pending ON true LEFT JOIN cl ON true LEFT JOIN w ON true;"])


SIDES = ("upstream", "classic", "one call", "floor")
# The floor runs its generic plan: a custom plan of its range condition on the 10^6-commit
# partition costs milliseconds of planning (the histogram's end is probed on every plan), which
# is the re-planning the extension's kept generic plans avoid (docs/DESIGN.md §Pull path).
ENV = {"floor": {"PGOPTIONS": "-c plan_cache_mode=force_generic_plan"}}


def scripts(lo, hi, where):
    return {"upstream": generated("upstream", lo, hi, where),
            "classic": generated("syncular", lo, hi, where),
            "one call": one_call(lo, hi, where),
            "floor": floor(lo, hi, where)}


def run(rotate, psql, psql_file, ddl):
    """Runs the workloads through `rotate(clients, sides, rows)` (run.py) and returns the rows
    (label, clients, {side: (tps, ms)}).

    Both scales of a workload share one rotation (the eight scripts take turns, round by round),
    so the 10^6 / 10^4 latency target compares rounds taken under the same load: on this shared
    machine the load moves by more than the difference measured (docs/BENCHMARKS-notes.md, "The
    pull at 10^6")."""
    print("setting up the pull workload (pull_db: 10 × 10^4 and 1 × 10^6 commits, both schemas)...", flush=True)
    setup(psql, psql_file, ddl)
    scales = [("10^4", ["--partitions", str(PARTITIONS)], SMALL), ("10^6", ["--partition", "big"], BIG)]
    measured = {}
    for workload in ("catch-up", "idle"):
        for clients in (1, 4):
            sides = []
            for scale, where, head in scales:
                lo, hi = (head - SMALL, head - 1000) if workload == "catch-up" else (head, head)
                key = f"pull-{workload}-{scale.replace('^', '')}-{clients}"
                sides += [(f"{key}-{side.replace(' ', '-')}", "pull_db", text, ENV.get(side))
                          for side, text in scripts(lo, hi, where).items()]
            runs = rotate(clients, sides, [])
            for scale, _, _ in scales:
                key = f"pull-{workload}-{scale.replace('^', '')}-{clients}"
                measured[(scale, workload, clients)] = {side: runs[f"{key}-{side.replace(' ', '-')}"] for side in SIDES}
    return [(f"pull {workload}, {scale} commits", clients, measured[(scale, workload, clients)])
            for scale, _, _ in scales for workload in ("catch-up", "idle") for clients in (1, 4)]


def section(rows):
    """The "## Pull" section of docs/BENCHMARKS.md for these rows, with the issue's targets."""
    lines = ["## Pull", "",
             "Generated by `bench/run.sh` (`BENCH_PULL_ONLY=1` runs only this part and replaces only this section). "
             "One sync request with one incremental subscription (`bench/pull.py`, scripts from `bench/upstream-0.24-pull.py`); "
             "tps of each side's median round (both scales of a workload in one rotation, their rounds interleaved); ratios against upstream.", "",
             "| workload | clients | upstream tps | classic tps | one call tps | floor tps | one call ms | one call / upstream | classic / upstream | one call / floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    by = {}
    for label, clients, sides in rows:
        by[(label, clients)] = sides
        up, cl, one, fl = (sides[s] for s in SIDES)
        lines.append(f"| {label} | {clients} | {up[0]:.0f} | {cl[0]:.0f} | {one[0]:.0f} | {fl[0]:.0f} | {one[1]:.3f} | "
                     f"{one[0] / up[0]:.2f} | {cl[0] / up[0]:.2f} | {one[0] / fl[0]:.2f} |")
    targets = []
    for workload, need1, need4 in (("catch-up", 2.5, 2.0), ("idle", 4.0, 2.0)):
        for scale in ("10^4", "10^6"):
            for clients, need in ((1, need1), (4, need4)):
                sides = by.get((f"pull {workload}, {scale} commits", clients))
                if sides:
                    r = sides["one call"][0] / sides["upstream"][0]
                    targets.append((f"{workload} at {scale}, {clients} client{'s' if clients > 1 else ''} ≥ {need}× upstream", f"{r:.2f}×", r >= need))
    small, big = by.get(("pull catch-up, 10^4 commits", 1)), by.get(("pull catch-up, 10^6 commits", 1))
    if small and big:
        r = big["one call"][1] / small["one call"][1]
        targets.append(("one-call catch-up latency at 10^6 ≤ 1.2× at 10^4", f"{r:.2f}×", r <= 1.2))
    if targets:
        lines += ["", "Targets of issue 20, judged on this run:", "", "| target | this run | |", "|---|---|---|"]
        lines += [f"| {name} | {value} | {'met' if met else 'missed'} |" for name, value, met in targets]
    return lines
