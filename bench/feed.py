#!/usr/bin/env python3
"""The change feed (issue 31; docs/DESIGN.md §Change feed), measured.

Run through bench/feed.sh: one cluster preloading the library, `syncular.feed_database =
'feed_db'`. Four pushers (`push_commit` of one new row, each to its own partition, autocommit,
`synchronous_commit = off`) run for BENCH_SECONDS with 0, 1, 10 and 50 listening host processes
(one connection each, LISTENing on `notify_channel()` and draining every notification), in three
modes:
- **off**: nothing announced (database `plain_db`, which the feed does not serve);
- **notify**: `syncular.notify_commits = on` in the pushers: one NOTIFY per commit (`plain_db`);
- **feed**: the change feed (`feed_db`), nothing set in the pushers; once per coalescing
  interval of BENCH_FEED_INTERVALS (ms, default "10"; a comma-separated list), set with ALTER SYSTEM and a reload.
Each listener count runs BENCH_ROUNDS rounds (default 3) of every mode, interleaved; medians.
Reported: push_commit commits a second, relative to *off* with the same listeners; the CPU the
pushers' backends use per commit (the push path's own cost); the delay
from a probe's commit (one more session pushing to partition `probe` every 20 ms) to the moment a
listener hears that head — median and p99 — in the two modes that announce; and where the CPU
went, in cores (CPU seconds per second, from /proc: the bench runs on the cluster's machine):
the pushers' backends, the listeners' backends, the listener client processes, and the feed's
worker. BENCH_LISTENER_NICE (default 0) runs the listener client processes at that nice value:
19 stands in for host processes on other machines (they then take only CPU nobody else wants),
while their backends — the server's real share of listening — stay at the server's priority.
"""
import json
import multiprocessing as mp
import os
import select
import statistics
import time

import psycopg

CLUSTER = os.environ.get("BENCH_CLUSTER", "host=127.0.0.1 port=25449 user=postgres")
SECONDS = float(os.environ.get("BENCH_SECONDS", "10"))
PUSHERS = int(os.environ.get("BENCH_PUSHERS", "4"))
LISTENERS = [int(x) for x in os.environ.get("BENCH_LISTENERS", "0,1,10,50").split(",")]
# The feed's coalescing intervals to measure (`syncular.feed_interval_ms`, reloaded between rows).
INTERVALS = [int(x) for x in os.environ.get("BENCH_FEED_INTERVALS", "10").split(",")]
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
LISTENER_NICE = int(os.environ.get("BENCH_LISTENER_NICE", "0"))
TICKS = os.sysconf("SC_CLK_TCK")
NOW = 1_750_000_000_000
LAYOUT = [{"name": "id", "type": "string", "nullable": False},
          {"name": "project_id", "type": "string", "nullable": False}]
PUSH_SCHEMA = {"tasks": {"columns": LAYOUT, "primaryKey": "id",
                         "scopes": [{"variable": "project_id", "column": "project_id"}]}}
PUSH = """SELECT (syncular.push_commit(%s, 'c1', %s, 'a1', %s, 1, '{"project_id":["p1"]}',
                  ARRAY['tasks'], ARRAY[%s], ARRAY[1]::int2[], ARRAY[NULL::int8],
                  ARRAY[syncular.encode_row('tasks', %s::jsonb, true)]))->>'commitSeq'"""


def conn(db, **kw):
    return psycopg.connect(f"{CLUSTER} dbname={db}", autocommit=True, **kw)


def setup(db):
    with conn("postgres") as c:
        c.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        c.execute(f"CREATE DATABASE {db}")
    with conn(db) as c:
        c.execute("CREATE EXTENSION syncular")
        c.execute("""CREATE TABLE public.tasks (
            _sync_partition text COLLATE "C" NOT NULL, _sync_row_id text NOT NULL,
            id text, project_id text, _sync_server_version bigint NOT NULL,
            _sync_scopes jsonb NOT NULL, _sync_payload bytea NOT NULL, _sync_column_versions bytea,
            PRIMARY KEY (_sync_partition, _sync_row_id))""")
        c.execute("SELECT syncular.register_table('tasks', 'public.tasks')")
        c.execute("BEGIN")
        c.execute("SELECT syncular.migrate_schema(1, %s)", (json.dumps({"tasks": LAYOUT}),))
        c.execute("COMMIT")
        c.execute("SELECT syncular.set_push_schema(1, %s)", (json.dumps(PUSH_SCHEMA),))


def push_once(c, partition, n):
    # A new row each time: a create needs no base version.
    row_id = f"r{time.time_ns()}-{n}"
    row = json.dumps({"id": row_id, "project_id": "p1"})
    return int(c.execute(PUSH, (partition, f"k{row_id}", NOW, row_id, row)).fetchone()[0])


def cpu_of(pid):
    """CPU seconds (user + system) a process has used so far; 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS
    except (OSError, IndexError, ValueError):
        return 0.0


def pusher(db, partition, notify, start, stop, out):
    with conn(db) as c:
        c.execute("SET synchronous_commit = off")
        if notify:
            c.execute("SET syncular.notify_commits = on")
        backend = c.execute("SELECT pg_backend_pid()").fetchone()[0]
        n = 0
        while time.time() < start:
            time.sleep(0.001)
        used = cpu_of(backend)
        while time.time() < stop:
            push_once(c, partition, n)
            n += 1
        out.put((n, cpu_of(backend) - used))


def listener(db, start, stop, ready, heard):
    """Drains every notification; records when it first hears each probe head, and the CPU it
    and its backend used between `start` and `stop`."""
    if LISTENER_NICE:
        os.nice(LISTENER_NICE)
    with conn(db) as c:
        channel = c.execute("SELECT syncular.notify_channel()").fetchone()[0]
        backend = c.execute("SELECT pg_backend_pid()").fetchone()[0]
        c.execute(f'LISTEN "{channel}"')
        ready.put(1)
        pg = c.pgconn
        seen = {}
        used = None
        while time.time() < stop + 1.0:
            now = time.time()
            if used is None and now >= start:
                used = (time.process_time(), cpu_of(backend))
            elif used is not None and len(used) == 2 and now >= stop:
                used = (time.process_time() - used[0], cpu_of(backend) - used[1], None)
            r, _, _ = select.select([pg.socket], [], [], 0.05)
            if not r:
                continue
            pg.consume_input()
            while (n := pg.notifies()) is not None:
                t = time.time()
                payload = json.loads(n.extra.decode())
                heads = payload.get("heads") or (
                    {payload["partition"]: payload["commitSeq"]} if "partition" in payload else {})
                seq = heads.get("probe")
                if seq is not None and seq not in seen:
                    seen[seq] = t
        heard.put((seen, used[:2] if used and len(used) == 3 else (0.0, 0.0)))


def probe(db, notify, start, stop, out):
    with conn(db) as c:
        c.execute("SET synchronous_commit = off")
        if notify:
            c.execute("SET syncular.notify_commits = on")
        committed = {}
        n = 0
        while time.time() < start:
            time.sleep(0.001)
        while time.time() < stop - 0.5:
            seq = push_once(c, "probe", n)
            committed[seq] = time.time()
            n += 1
            time.sleep(0.02)
        out.put(committed)


def run(mode, listeners):
    db = "feed_db" if mode.startswith("feed") else "plain_db"
    notify = mode == "notify"
    start = time.time() + 2.0 + listeners * 0.05
    stop = start + SECONDS
    counts, heard, ready, probes = mp.Queue(), mp.Queue(), mp.Queue(), mp.Queue()
    procs = [mp.Process(target=listener, args=(db, start, stop, ready, heard)) for _ in range(listeners)]
    for p in procs:
        p.start()
    for _ in range(listeners):
        ready.get()
    procs += [mp.Process(target=pusher, args=(db, f"part{i}", notify, start, stop, counts)) for i in range(PUSHERS)]
    procs.append(mp.Process(target=probe, args=(db, notify, start, stop, probes)))
    for p in procs[listeners:]:
        p.start()
    worker = feed_worker_pid()
    while time.time() < start:
        time.sleep(0.001)
    worker_used = cpu_of(worker) if worker else 0.0
    while time.time() < stop:
        time.sleep(0.01)
    worker_used = (cpu_of(worker) - worker_used) if worker else 0.0
    pushed = [counts.get() for _ in range(PUSHERS)]
    commits = sum(n for n, _ in pushed)
    committed = probes.get()
    delays = []
    clients_cpu = backends_cpu = 0.0
    for _ in range(listeners):
        seen, (client, backend) = heard.get()
        clients_cpu += client
        backends_cpu += backend
        delays += [(seen[s] - t) * 1000 for s, t in committed.items() if s in seen]
    for p in procs:
        p.join()
    cpu = {"pushers": sum(u for _, u in pushed) / SECONDS, "listener backends": backends_cpu / SECONDS,
           "listener clients": clients_cpu / SECONDS, "feed worker": worker_used / SECONDS}
    tps = commits / SECONDS
    delay = None
    if delays and mode != "off":
        delays.sort()
        delay = (statistics.median(delays), delays[min(len(delays) - 1, int(len(delays) * 0.99))])
    return tps, delay, cpu


def feed_worker_pid():
    """The feed's background worker (None when it is not running)."""
    with conn("postgres") as c:
        row = c.execute("SELECT pid FROM pg_stat_activity WHERE backend_type LIKE 'syncular%'"
                        " ORDER BY pid LIMIT 1").fetchone()
    return row[0] if row else None


def interval(ms):
    """Sets the feed's coalescing interval for the whole cluster (a reload setting)."""
    with conn("postgres") as c:
        c.execute(f"ALTER SYSTEM SET syncular.feed_interval_ms = {int(ms)}")
        c.execute("SELECT pg_reload_conf()")
    time.sleep(0.5)


def main():
    setup("feed_db")
    setup("plain_db")
    with conn("feed_db") as c:
        status = c.execute("SELECT syncular.feed_status()").fetchone()[0]
    modes = ["off", "notify"] + [f"feed {i} ms" for i in INTERVALS]
    rows = []
    for listeners in LISTENERS:
        # Rounds interleave the modes, and each round's ratios are to that round's *off*: the
        # machine's drift between rounds cancels; the table reports the medians.
        rounds = {mode: [] for mode in modes}
        for r in range(ROUNDS):
            base = None
            for mode in modes:
                if mode.startswith("feed"):
                    interval(int(mode.split()[1]))
                tps, delay, cpu = run(mode, listeners)
                base = base or tps
                rounds[mode].append((tps, tps / base, delay, cpu))
                d = f"{delay[0]:.1f} / {delay[1]:.1f}" if delay else "—"
                used = "  ".join(f"{k} {v:.2f}" for k, v in cpu.items())
                print(f"round {r + 1} listeners {listeners:>2} {mode:>11}: {tps:7.0f} commits/s  ({tps / base:.2f}× off)"
                      f"  delay ms median/p99 {d}  cores: {used}", flush=True)
        for mode in modes:
            runs = rounds[mode]
            med = lambda xs: statistics.median(xs)  # noqa: E731
            delays = [d for _, _, d, _ in runs if d]
            cpu = {k: med([c[k] for *_, c in runs]) for k in runs[0][3]}
            tps = med([t for t, *_ in runs])
            # The pushers' backends' CPU per commit: what the push path itself pays.
            per_commit = med([c["pushers"] / t * 1000 for t, _, _, c in runs])
            rows.append((listeners, mode, tps, med([x for _, x, _, _ in runs]),
                         (med([d[0] for d in delays]), med([d[1] for d in delays])) if delays else None,
                         per_commit, cpu))
    print(f"\n| listening host processes | mode | push_commit commits/s | vs off | pushers' CPU ms/commit "
          "| delay median / p99 (ms) | cores: listeners' backends / listener clients / feed worker |")
    print("|---|---|---|---|---|---|---|")
    for listeners, mode, tps, rel, delay, per_commit, cpu in rows:
        d = f"{delay[0]:.1f} / {delay[1]:.1f}" if delay else "—"
        used = " / ".join(f"{cpu[k]:.2f}" for k in ("listener backends", "listener clients", "feed worker"))
        print(f"| {listeners} | {mode} | {tps:.0f} | {rel:.2f}× | {per_commit:.2f} | {d} | {used} |")
    print(f"\nfeed: {json.dumps(status)}; {PUSHERS} pushers, {SECONDS:.0f} s per row, {ROUNDS} rounds (medians),"
          f" synchronous_commit = off, listener clients at nice {LISTENER_NICE}")


if __name__ == "__main__":
    main()
