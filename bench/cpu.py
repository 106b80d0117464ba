#!/usr/bin/env python3
"""Server CPU per push (issue 28): the four-client baseline under two cluster settings, and the
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

Prints the section for docs/BENCHMARKS.md (BENCH_CPU_OUT: the file it is written to).
"""
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402  (bench/run.py: psql, pgbench, the scripts)

CLIENTS = int(os.environ.get("BENCH_CLIENTS", "4"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
SETTING = os.environ["BENCH_CPU_SETTING"]


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
    run.psql("postgres", "CHECKPOINT")


def pgbench_counted(db, script):
    """One pgbench run: (tps, pushes made)."""
    cmd = [f"{run.BIN}/pgbench", "-n", "-M", "prepared", "-h", "127.0.0.1", "-p", run.PORT, "-U",
           "postgres", "-c", str(CLIENTS), "-j", str(CLIENTS), "-T", str(run.SECONDS), "-f", script, db]
    out = subprocess.run(cmd, capture_output=True, text=True)
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


def server_time(db, script):
    """Server time and WAL bytes per push of `script` run alone: pg_stat_statements' top-level
    statements of `db`, over the pushes pgbench made."""
    run.psql(db, "SELECT pg_stat_statements_reset()")
    cpu = server_cpu_ms()
    _, pushes = pgbench_counted(db, script)
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
        sides += [(f"upstream N={n}", "upstream", run.upstream_push(n, False)),
                  (f"push_commit N={n}", "ext", run.ext_push_commit(n, False)),
                  (f"floor N={n}", "ext", run.floor_push(n))]
    scripts = [(label, db, run.write_script(f"cpu-{i}.sql", text)) for i, (label, db, text) in enumerate(sides)]
    rounds = {label: [] for label, _, _ in scripts}
    for _ in range(ROUNDS):
        for label, db, script in scripts:
            rounds[label].append(pgbench_counted(db, script)[0])
    rows = []
    for label, db, script in scripts:
        tps = sorted(rounds[label])[len(rounds[label]) // 2]
        ms, wal, cpu, nested = server_time(db, script)
        rows.append((label, tps, ms, wal, cpu))
        print(f"{SETTING:<6} {label:<16} {tps:>8.0f} tps  server {ms:.3f} ms/push  CPU {cpu:.3f} ms/push  WAL {wal:.0f} B/push"
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
