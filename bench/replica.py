#!/usr/bin/env python3
"""Pulls served by a hot standby (issue 32; docs/DESIGN.md §Read replicas), measured.

Run through bench/replica.sh: a primary and a hot standby of it (scripts/cluster.sh standby),
pg_stat_statements on both. One database of 10 partitions × 10^4 commits (bench/pull.py's
history: 10 changes per commit, 20 projects), a registered `tasks` table with its push schema.

Two layouts, the same load:
- **primary**: every pull on the primary (`syncular.pull`, which writes the registry touch and the
  client record);
- **primary + standby**: every pull on the standby (`syncular.pull` in its read-only transaction
  writes nothing and returns `document.writes`), then `syncular.apply_pull(writes)` on the
  primary — what a host does (docs/API.md `apply_pull`).
Beside the pullers, one pusher on the primary (`push_commit` of one upsert, paced at
BENCH_PUSH_RATE a second) keeps the log growing, so the standby replays while it serves.

Two workloads: **following** (each simulated client pulls from the cursor its last pull
returned: mostly idle, a few new changes — the typical traffic) and **catch-up** (a cursor in the
last 10^4 commits, a full window of up to 100 changes).

Reported per layout: pulls and pushes a second (wall clock: on this 2-core machine both servers
and the client processes share the same two cores, so the sum cannot grow — what moves is where
the work is done), the **primary's server time per pull** (pg_stat_statements: `pull`, or
`apply_pull`, plus nothing else of the pullers), the standby's, and the standby's replay lag at
the end. The primary's server time per pull is what tells how many pulls a primary carries.
"""
import json
import multiprocessing as mp
import os
import random
import sys
import time

import psycopg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pull  # noqa: E402  (bench/pull.py: the history)

PRIMARY = os.environ.get("BENCH_PRIMARY", "host=127.0.0.1 port=25447 user=postgres")
STANDBY = os.environ.get("BENCH_STANDBY", "host=127.0.0.1 port=25448 user=postgres")
DB = "replica_db"
SECONDS = float(os.environ.get("BENCH_SECONDS", "15"))
WORKERS = int(os.environ.get("BENCH_WORKERS", "4"))
PUSH_RATE = float(os.environ.get("BENCH_PUSH_RATE", "50"))
PARTITIONS, COMMITS = 10, 10_000
NOW, EPOCH = 1_750_000_000_000, "0b9c5c1e-7a43-4c4e-9d6e-5f0a2a9b3c11"
LAYOUTS = {"tasks": [{"name": "id", "type": "string", "nullable": False},
                     {"name": "project_id", "type": "string", "nullable": False}]}
PUSH_SCHEMA = {"tasks": {"columns": LAYOUTS["tasks"], "primaryKey": "id",
                         "scopes": [{"variable": "project_id", "column": "project_id"}]}}
PULL = "SELECT * FROM syncular.pull(%s, %s, 'actor', %s, %s, 1, %s)"
APPLY = "SELECT syncular.apply_pull(%s)"
PUSH = ("SELECT syncular.push_commit(%s, 'pusher', %s, 'actor', %s, 1, %s, ARRAY['tasks'], ARRAY[%s],"
        " ARRAY[1]::int2[], ARRAY[NULL::int8], ARRAY[syncular.encode_row('tasks', %s, true)])")


def conninfo(base, db=DB):
    return f"{base} dbname={db}"


def setup():
    with psycopg.connect(conninfo(PRIMARY, "postgres"), autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {DB}")
        c.execute(f"CREATE DATABASE {DB}")
    with psycopg.connect(conninfo(PRIMARY), autocommit=True) as c:
        c.execute("CREATE EXTENSION syncular")
        c.execute("CREATE EXTENSION pg_stat_statements")
        c.execute(pull.APP_TABLE)
        c.execute("SELECT syncular.register_table('tasks', 'public.tasks_app')")
        with c.transaction():
            c.execute("SELECT syncular.migrate_schema(1, %s)", [json.dumps(LAYOUTS)])
        c.execute("SELECT syncular.set_push_schema(1, %s)", [json.dumps(PUSH_SCHEMA)])
        for k in range(PARTITIONS):
            c.execute(pull.history_sql("syncular.", f"part-{k}", COMMITS, 0))
        c.execute("RESET session_replication_role")
        c.execute("VACUUM ANALYZE")
        c.execute("CHECKPOINT")
    caught_up()


def caught_up():
    """Waits until the standby has replayed everything the primary wrote; the lag in bytes."""
    with psycopg.connect(conninfo(PRIMARY), autocommit=True) as p, \
            psycopg.connect(conninfo(STANDBY), autocommit=True) as s:
        lsn = p.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
        for _ in range(600):
            lag = s.execute("SELECT pg_wal_lsn_diff(%s, pg_last_wal_replay_lsn())", [lsn]).fetchone()[0]
            if lag <= 0:
                return
            time.sleep(0.1)
        sys.exit("the standby did not catch up within a minute")


def request(cursor, project):
    scopes = {"project_id": [f"p{project}"]}
    return json.dumps({"limitCommits": 100, "wireVersion": 2, "subscriptions": [
        {"id": "s1", "table": "tasks", "scopes": scopes, "effective": scopes, "cursor": cursor}]})


def puller(worker, layout, workload, deadline, out):
    """One host worker: pulls as clients `c-<worker>-<n>`, on the primary or the standby (then
    the apply on the primary); the number of pulls made."""
    rnd = random.Random(worker)
    primary = psycopg.connect(conninfo(PRIMARY), autocommit=True)
    reader = psycopg.connect(conninfo(STANDBY), autocommit=True) if layout == "standby" else primary
    cursors = {}
    pulls = 0
    while time.time() < deadline:
        k, project = rnd.randrange(PARTITIONS), rnd.randrange(20)
        client = f"c-{worker}-{k}-{project}"
        if workload == "following":
            cursor = cursors.get(client, COMMITS - 200)
        else:
            cursor = rnd.randrange(COMMITS - 9_000, COMMITS - 1_000)
        rows = reader.execute(PULL, [f"part-{k}", client, NOW, EPOCH, request(cursor, project)],
                              prepare=True).fetchall()
        document = rows[0][-1]
        cursors[client] = document["subscriptions"][0]["nextCursor"]
        if layout == "standby":
            primary.execute(APPLY, [json.dumps(document["writes"])], prepare=True)
        pulls += 1
    out.put(("pulls", pulls))


def pusher(deadline, out):
    rnd = random.Random(0)
    c = psycopg.connect(conninfo(PRIMARY), autocommit=True)
    pushes, start = 0, time.time()
    while time.time() < deadline:
        k, project = rnd.randrange(PARTITIONS), rnd.randrange(20)
        row = f"n-{pushes}"
        c.execute(PUSH, [f"part-{k}", f"push-{start}-{pushes}", NOW,
                         json.dumps({"project_id": [f"p{project}"]}), row,
                         json.dumps({"id": row, "project_id": f"p{project}"})], prepare=True)
        pushes += 1
        pause = start + pushes / PUSH_RATE - time.time()
        if pause > 0:
            time.sleep(pause)
    out.put(("pushes", pushes))


def server_ms(base):
    """pg_stat_statements of one server: calls and total ms of `pull` and `apply_pull`."""
    with psycopg.connect(conninfo(base), autocommit=True) as c:
        rows = c.execute(
            "SELECT query, calls, total_exec_time FROM pg_stat_statements"
            " WHERE query LIKE '%syncular.pull(%' OR query LIKE '%syncular.apply_pull(%'").fetchall()
    out = {"pull": [0, 0.0], "apply": [0, 0.0]}
    for query, calls, ms in rows:
        key = "apply" if "apply_pull" in query else "pull"
        out[key][0] += calls
        out[key][1] += ms
    return out


def reset(base):
    with psycopg.connect(conninfo(base), autocommit=True) as c:
        c.execute("SELECT pg_stat_statements_reset()")


def measure(layout, workload):
    caught_up()
    reset(PRIMARY)
    reset(STANDBY)
    out = mp.Queue()
    deadline = time.time() + SECONDS
    procs = [mp.Process(target=puller, args=(w, layout, workload, deadline, out)) for w in range(WORKERS)]
    procs.append(mp.Process(target=pusher, args=(deadline, out)))
    started = time.time()
    for p in procs:
        p.start()
    totals = {"pulls": 0, "pushes": 0}
    for _ in procs:
        key, n = out.get()
        totals[key] += n
    for p in procs:
        p.join()
    elapsed = time.time() - started
    with psycopg.connect(conninfo(PRIMARY), autocommit=True) as p, \
            psycopg.connect(conninfo(STANDBY), autocommit=True) as s:
        lsn = p.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
        lag = s.execute("SELECT pg_wal_lsn_diff(%s, pg_last_wal_replay_lsn())", [lsn]).fetchone()[0]
    on_primary, on_standby = server_ms(PRIMARY), server_ms(STANDBY)
    pulls = totals["pulls"]
    primary_ms = (on_primary["pull"][1] + on_primary["apply"][1]) / pulls
    standby_ms = on_standby["pull"][1] / pulls
    apply_ms = on_primary["apply"][1] / on_primary["apply"][0] if on_primary["apply"][0] else None
    return {"layout": layout, "workload": workload, "pulls/s": pulls / elapsed,
            "pushes/s": totals["pushes"] / elapsed, "primary ms/pull": primary_ms,
            "standby ms/pull": standby_ms, "apply ms": apply_ms, "lag bytes": int(lag)}


def section(results):
    lines = ["## Read replicas", "",
             "Generated by `bench/replica.sh` (issue 32; docs/DESIGN.md §Read replicas): a primary and a hot standby "
             "streaming from it, one database of 10 partitions × 10^4 commits, "
             f"{WORKERS} host workers pulling for {SECONDS:.0f} s per row (psycopg, prepared statements), one pusher on the primary "
             f"paced at {PUSH_RATE:.0f} pushes/s. **primary**: every pull on the primary. **primary + standby**: every pull "
             "on the standby, then `apply_pull(document.writes)` on the primary. Server time from pg_stat_statements "
             "(`pull` and `apply_pull` only), per pull served.", "",
             "| workload | layout | pulls/s | pushes/s | primary ms per pull | standby ms per pull | apply_pull ms | standby lag at the end |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        apply = f"{r['apply ms']:.3f}" if r["apply ms"] is not None else "—"
        layout = "primary + standby" if r["layout"] == "standby" else "primary"
        lines.append(f"| {r['workload']} | {layout} | {r['pulls/s']:.0f} | {r['pushes/s']:.0f} | "
                     f"{r['primary ms/pull']:.3f} | {r['standby ms/pull']:.3f} | {apply} | {r['lag bytes']:,} B |")
    by = {(r["workload"], r["layout"]): r for r in results}
    lines += ["", "The primary's share of a pull, standby layout against primary only:", ""]
    for workload in ("following", "catch-up"):
        a, b = by.get((workload, "primary")), by.get((workload, "standby"))
        if a and b:
            lines.append(f"- {workload}: {b['primary ms/pull'] / a['primary ms/pull']:.2f}× "
                         f"({b['primary ms/pull']:.3f} ms against {a['primary ms/pull']:.3f} ms): the primary carries "
                         f"{a['primary ms/pull'] / b['primary ms/pull']:.1f}× the pulls for the same server time.")
    lines += ["", "On this machine both servers and the clients share two cores, so pulls/s measures the machine, "
              "not the layout: with the standby on a machine of its own, the pulls a deployment serves grow with "
              "the standbys until the primary's share (the apply, and the pushes) fills it. The apply is one "
              "statement (`src/pull/apply.rs`), a registry touch and a client-record upsert."]
    return lines


def main():
    print("setting up replica_db (10 × 10^4 commits) on the primary...", flush=True)
    setup()
    results = []
    for workload in ("following", "catch-up"):
        for layout in ("primary", "standby"):
            r = measure(layout, workload)
            print(r, flush=True)
            results.append(r)
    lines = section(results)
    print("\n".join(lines))
    if os.environ.get("BENCH_WRITE", "1") == "1":
        import run  # noqa: E402  (bench/run.py: splice_section)
        run.splice_section("Read replicas", lines)


if __name__ == "__main__":
    main()
