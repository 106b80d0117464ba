#!/usr/bin/env python3
"""Server CPU per push and pull (issue 28): the four-client baseline under two cluster settings, and the
server time per call from pg_stat_statements.

Run through bench/cpu.sh, which starts one throwaway cluster per setting:
- `bench`: what bench/run.sh measures on — `fsync = off`, autovacuum off, no timed checkpoint;
- `async`: a durable cluster that does not wait for its WAL flush — `fsync = on`,
  `synchronous_commit = off`, autovacuum on, PostgreSQL's default checkpoints (5 min,
  `max_wal_size` 1 GB) and full-page writes, as an independent run of the same scripts had it.

On each: upstream 0.24's push statements (bench/upstream-0.24-push.py, own partitions), the
one-call `push_commit` and the one-statement floor (the same writes as one hand-written
statement: bench/run.py `floor_push`), N = 1 and 10 rows, four clients, interleaved rounds
(medians). Then each side again alone with pg_stat_statements reset (`track = all`): the server
time per push — the sum of every top-level statement's execution time over the pushes made
(upstream: all its statements, BEGIN and COMMIT included; syncular: the `push_commit` call,
whose own statements run inside it) — wall-clock time inside the server, which at four clients
on two cores includes waiting for a core —, the server's CPU time per push (every process of the
cluster, /proc: what the clients' backends, the WAL writer and the rest used), and the WAL bytes
per push (pg_stat_statements `wal_bytes`).

Then the pull the same way (BENCH_CPU_PULL=0 leaves it out): bench/pull.py's sync request of one
incremental subscription over 10 partitions of 10^4 commits, catch-up (a full window) and idle
(cursor at the head) — upstream 0.24's statements, the one-call `pull` and its one-statement
floor (the same reads and writes), with their server time per call.

Prints the section for docs/BENCHMARKS.md (BENCH_CPU_OUT: the file it is written to).
"""
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402  (bench/run.py: psql, pgbench, the scripts)
import pull  # noqa: E402  (bench/pull.py: the pull's history and scripts)

CLIENTS = int(os.environ.get("BENCH_CLIENTS", "4"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
SETTING = os.environ["BENCH_CPU_SETTING"]
# The pull's sides too (BENCH_CPU_PULL=0 leaves them out): one sync request with one incremental
# subscription over 10 partitions of 10^4 commits (bench/pull.py), catch-up and idle.
PULL = os.environ.get("BENCH_CPU_PULL", "1") == "1"


def setup():
    run.psql("postgres", "CREATE DATABASE upstream")
    run.psql("postgres", "CREATE DATABASE ext")
    for db in ("upstream", "ext"):
        run.psql(db, "CREATE EXTENSION pg_stat_statements")
    run.psql_file("upstream", run.UPSTREAM_DDL)
    run.psql("ext", "CREATE EXTENSION syncular")
    layouts = json.dumps({name: table["columns"] for name, table in run.PC_SCHEMA.items()})
    run.psql("ext", f"BEGIN; SELECT syncular.migrate_schema(1, '{layouts}'); COMMIT;")
    run.psql("ext", """CREATE TABLE tasks(
      "_sync_partition" TEXT NOT NULL, "_sync_row_id" TEXT NOT NULL,
      id TEXT NOT NULL, project_id TEXT NOT NULL, title TEXT,
      "_sync_server_version" BIGINT NOT NULL, "_sync_scopes" JSONB NOT NULL,
      "_sync_payload" BYTEA NOT NULL, "_sync_column_versions" BYTEA,
      PRIMARY KEY ("_sync_partition", "_sync_row_id"))""")
    run.psql("ext", "SELECT syncular.register_table('tasks', 'public.tasks')")
    run.setup_push_commit()
    partitions = [f"{k}-{c}" for k in ("p", "pf") for c in range(CLIENTS + 1)]
    values = ",".join(f"('{p}', 0, 0)" for p in partitions)
    run.psql("ext", f"INSERT INTO syncular.sync_partitions VALUES {values} ON CONFLICT DO NOTHING")
    run.psql("upstream", f"INSERT INTO sync_partitions VALUES {values} ON CONFLICT DO NOTHING")
    for db in ("upstream", "ext"):
        run.psql(db, "VACUUM ANALYZE")
    if PULL:
        setup_pull()
    run.psql("postgres", "CHECKPOINT")


def setup_pull():
    """bench/pull.py's database at its 10^4 scale only (10 partitions, both schemas)."""
    run.psql("postgres", "CREATE DATABASE pull_db")
    run.psql("pull_db", "CREATE EXTENSION pg_stat_statements")
    run.psql_file("pull_db", run.UPSTREAM_DDL)
    run.psql("pull_db", "CREATE EXTENSION syncular")
    run.psql("pull_db", pull.APP_TABLE + "SELECT syncular.register_table('tasks', 'public.tasks_app');")
    for schema in ("", "syncular."):
        for k in range(pull.PARTITIONS):
            run.psql("pull_db", pull.history_sql(schema, f"part-{k}", pull.SMALL, 0))
    run.psql("pull_db", "VACUUM ANALYZE")


def pull_sides():
    """(label, db, script, environment) of the pull's upstream, one-call and floor sides."""
    where = ["--partitions", str(pull.PARTITIONS)]
    sides = []
    for workload, (lo, hi) in (("catch-up", (0, pull.SMALL - 1000)), ("idle", (pull.SMALL, pull.SMALL))):
        scripts = pull.scripts(lo, hi, where)
        for side, key in (("upstream", "upstream"), ("pull", "one call"), ("floor", "floor")):
            sides.append((f"{side} {workload}", "pull_db", scripts[key], pull.ENV.get(key)))
    return sides


def pgbench_counted(db, script, env_extra=None, seconds=None):
    """One pgbench run (`seconds`, default BENCH_SECONDS): (tps, calls made)."""
    env = dict(os.environ, **(env_extra or {}))
    cmd = [f"{run.BIN}/pgbench", "-n", "-M", "prepared", "-h", "127.0.0.1", "-p", run.PORT, "-U",
           "postgres", "-c", str(CLIENTS), "-j", str(CLIENTS), "-T", str(seconds or run.SECONDS), "-f", script, db]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    done = re.search(r"number of transactions actually processed: (\d+)", out.stdout)
    if out.returncode != 0 or not done:
        sys.exit(f"pgbench failed ({db}): {out.stdout}\n{out.stderr}")
    return float(re.search(r"tps = ([0-9.]+)", out.stdout).group(1)), int(done.group(1))


def server_cpu_ms():
    """CPU time the server has used so far, in ms: every live process of the cluster (the
    postmaster's children and itself, user + system) and what the postmaster reaped of the
    children that ended (`cutime` + `cstime`, /proc/PID/stat fields 16 and 17)."""
    with open(os.path.join(os.environ["BENCH_DIR"], "postmaster.pid")) as f:
        postmaster = int(f.readline())
    ticks = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields[0] is the state (field 3): field N is fields[N - 3].
        if int(pid) == postmaster:
            ticks += sum(int(fields[i]) for i in (11, 12, 13, 14))
        elif int(fields[1]) == postmaster:
            ticks += int(fields[11]) + int(fields[12])
    return ticks * 1000.0 / os.sysconf("SC_CLK_TCK")


def server_time(db, script, env_extra=None):
    """Server time and WAL bytes per call of `script` run alone: pg_stat_statements' top-level
    statements of `db`, over the calls pgbench made — after a second of the same calls, so the
    side finds its own pages in shared buffers, not the previous side's (as in the rounds)."""
    pgbench_counted(db, script, env_extra, seconds=1)
    run.psql(db, "SELECT pg_stat_statements_reset()")
    cpu = server_cpu_ms()
    _, pushes = pgbench_counted(db, script, env_extra)
    cpu = (server_cpu_ms() - cpu) / pushes
    row = run.psql(db, "SELECT coalesce(sum(total_exec_time), 0), coalesce(sum(wal_bytes), 0) "
                       "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
                       "WHERE s.toplevel AND d.datname = current_database() "
                       "AND s.query NOT LIKE '%pg_stat_statements%'")
    ms, wal = (float(x) for x in row.split("|"))
    nested = run.psql(db, "SELECT round((s.total_exec_time / %d)::numeric, 4), round((s.calls::float8 / %d)::numeric, 2), "
                          "left(regexp_replace(s.query, '\\s+', ' ', 'g'), 90) "
                          "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
                          "WHERE NOT s.toplevel AND d.datname = current_database() "
                          "ORDER BY s.total_exec_time DESC LIMIT 12" % (pushes, pushes))
    return ms / pushes, wal / pushes, cpu, nested


def main():
    setup()
    sides = []
    for n in (1, 10):
        sides += [(f"upstream N={n}", "upstream", run.upstream_push(n, False), None),
                  (f"push_commit N={n}", "ext", run.ext_push_commit(n, False), None),
                  (f"floor N={n}", "ext", run.floor_push(n), None)]
    if PULL:
        sides += pull_sides()
    scripts = [(label, db, run.write_script(f"cpu-{i}.sql", text), env)
               for i, (label, db, text, env) in enumerate(sides)]
    rounds = {label: [] for label, _, _, _ in scripts}
    # Each timed run follows a second of the same calls, not measured: a side run right after
    # upstream's finds its pages evicted from shared buffers by upstream's own log (both schemas'
    # logs do not fit in the default 128 MB), and in the fixed order of the rounds that cost fell
    # on the one-call side every time — the pull ran 5-10 % slower after upstream's than after its
    # floor (docs/BENCHMARKS.md, step 15).
    for _ in range(ROUNDS):
        for label, db, script, env in scripts:
            pgbench_counted(db, script, env, seconds=1)
            rounds[label].append(pgbench_counted(db, script, env)[0])
    rows = []
    for label, db, script, env in scripts:
        tps = sorted(rounds[label])[len(rounds[label]) // 2]
        ms, wal, cpu, nested = server_time(db, script, env)
        rows.append((label, tps, ms, wal, cpu))
        print(f"{SETTING:<6} {label:<16} {tps:>8.0f} tps  server {ms:.3f} ms/call  CPU {cpu:.3f} ms/call  WAL {wal:.0f} B/call"
              f"   (rounds: {'/'.join(f'{r:.0f}' for r in rounds[label])})", flush=True)
        if nested and label.startswith("push_commit"):
            # The statements push_commit runs itself (their time is inside its own): ms per push,
            # calls per push, the statement.
            print("\n".join(f"    {line}" for line in nested.splitlines()), flush=True)
    out = os.environ.get("BENCH_CPU_OUT")
    if out:
        with open(out, "a") as f:
            for label, tps, ms, wal, cpu in rows:
                f.write(json.dumps({"setting": SETTING, "label": label, "tps": tps, "ms": ms, "wal": wal,
                                    "cpu": cpu}) + "\n")


if __name__ == "__main__":
    main()
