#!/usr/bin/env python3
"""syncular on Citus (issue 30; docs/SCALING.md), measured next to one node.

Run through bench/citus.sh: one PostgreSQL 15 node, and a Citus cluster (a coordinator and two
workers, scripts/citus.sh) distributed by `syncular.distribute()`, pg_stat_statements on the
single node and on the coordinator. The same schema on both: a `tasks` table
(`_sync_partition text COLLATE "C"`, colocated with the sync tables on Citus), migrated to
version 1 with its push schema.

Workloads, each for BENCH_SECONDS:
- **push, 1 client**: `push_commit` of one upsert, one call at a time (delegated to the
  partition's worker on Citus: called alone);
- **pull, 1 client**: `pull` of one subscription following the head (each pull from the
  cursor the last returned, after one push of that partition);
- **push, BENCH_WORKERS clients over 8 partitions**: with the partitions' shards on both workers,
  then all on one (`citus_move_shard_placement`).

Reported: calls a second (wall clock) and, from pg_stat_statements, the server time per call on
the node the client talks to (on Citus the coordinator: a delegated call's time there includes
the worker's). On this 2-core machine the three nodes and the clients share the same two cores:
the numbers show what routing costs, not what a second machine adds.
"""
import json
import multiprocessing as mp
import os
import sys
import time

import psycopg

SINGLE = os.environ.get("BENCH_SINGLE", "host=127.0.0.1 port=25460 user=postgres dbname=bench")
COORD = os.environ.get("BENCH_COORD", "host=127.0.0.1 port=25470 user=postgres dbname=bench")
SECONDS = float(os.environ.get("BENCH_SECONDS", "10"))
WORKERS = int(os.environ.get("BENCH_WORKERS", "4"))
NOW = 1_750_000_000_000
LAYOUTS = {"tasks": [{"name": "id", "type": "string", "nullable": False},
                     {"name": "project_id", "type": "string", "nullable": False}]}
PUSH_SCHEMA = {"tasks": {"columns": LAYOUTS["tasks"], "primaryKey": "id",
                         "scopes": [{"variable": "project_id", "column": "project_id"}]}}
PUSH = ("SELECT syncular.push_commit(%s, 'c1', %s, 'actor', 1750000000000, 1,"
        " '{\"project_id\":[\"p1\"]}', ARRAY['tasks'], ARRAY[%s], ARRAY[1]::int2[],"
        " ARRAY[NULL::int8], ARRAY[%s::bytea])")
PULL = ("SELECT commit_seq FROM syncular.pull(%s, 'reader', 'actor', 1750000000000, 'e1', 1,"
        " jsonb_build_object('subscriptions', jsonb_build_array(jsonb_build_object('id', 's',"
        " 'table', 'tasks', 'scopes', '{\"project_id\":[\"p1\"]}'::jsonb,"
        " 'effective', '{\"project_id\":[\"p1\"]}'::jsonb, 'cursor', %s::bigint))))")


def setup(conninfo, citus):
    with psycopg.connect(conninfo, autocommit=True) as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        c.execute("CREATE EXTENSION syncular")
        if citus:
            c.execute("SELECT syncular.distribute()")
        c.execute("""CREATE TABLE public.tasks (
            _sync_partition text COLLATE "C" NOT NULL, _sync_row_id text NOT NULL,
            id text, project_id text, _sync_server_version bigint NOT NULL,
            _sync_scopes jsonb NOT NULL, _sync_payload bytea NOT NULL,
            _sync_column_versions bytea, PRIMARY KEY (_sync_partition, _sync_row_id))""")
        if citus:
            c.execute("SELECT create_distributed_table('public.tasks', '_sync_partition',"
                      " colocate_with => 'syncular.sync_partitions')")
        c.execute("SELECT syncular.register_table('tasks', 'public.tasks')")
        with c.transaction():
            c.execute("SELECT syncular.migrate_schema(1, %s)", [json.dumps(LAYOUTS)])
        c.execute("SELECT syncular.set_push_schema(1, %s)", [json.dumps(PUSH_SCHEMA)])


def payload(conninfo, row):
    with psycopg.connect(conninfo, autocommit=True) as c:
        return c.execute("SELECT syncular.encode_row('tasks', %s, true)",
                         [json.dumps({"id": row, "project_id": "p1"})]).fetchone()[0]


def reset_stats(conninfo):
    with psycopg.connect(conninfo, autocommit=True) as c:
        # Qualified: distribute() pins the extension owner's search_path to pg_catalog in this
        # database (docs/SECURITY.md rule 20), and the benchmark connects as the owner.
        c.execute("SELECT public.pg_stat_statements_reset()")


def server_ms(conninfo, like):
    with psycopg.connect(conninfo, autocommit=True) as c:
        row = c.execute("SELECT sum(total_exec_time), sum(calls) FROM public.pg_stat_statements"
                        " WHERE query LIKE %s", [like]).fetchone()
        return float(row[0] or 0) / float(row[1] or 1)


def pusher(args):
    conninfo, partitions, tag, seconds, body = args
    n, i = 0, 0
    with psycopg.connect(conninfo, autocommit=True) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            i += 1
            p = partitions[i % len(partitions)]
            c.execute(PUSH, [p, f"{tag}-{i}", f"{tag}-{i}", body])
            n += 1
    return n


def pushes(conninfo, partitions, clients, tag):
    body = payload(conninfo, "x")
    reset_stats(conninfo)
    with mp.Pool(clients) as pool:
        counts = pool.map(pusher, [(conninfo, partitions[w::clients] or partitions,
                                    f"{tag}{w}", SECONDS, body) for w in range(clients)])
    return sum(counts) / SECONDS, server_ms(conninfo, "SELECT syncular.push_commit(%")


def pulls(conninfo, partition):
    body = payload(conninfo, "x")
    reset_stats(conninfo)
    n, cursor, i = 0, 0, 0
    with psycopg.connect(conninfo, autocommit=True) as c:
        end = time.monotonic() + SECONDS
        while time.monotonic() < end:
            i += 1
            c.execute(PUSH, [partition, f"pl-{i}", f"pl-{i}", body])
            seqs = [r[0] for r in c.execute(PULL, [partition, cursor]).fetchall() if r[0]]
            cursor = max(seqs + [cursor])
            n += 1
    return n / SECONDS, server_ms(conninfo, "SELECT commit_seq FROM syncular.pull(%")


def spread(conninfo):
    """The nodes holding the 8 bench partitions' shards."""
    with psycopg.connect(conninfo, autocommit=True) as c:
        return sorted({r[0] for r in c.execute(
            "SELECT p.nodeport FROM pg_dist_shard_placement p WHERE p.shardid IN ("
            " SELECT get_shard_id_for_distribution_column('syncular.sync_commits', 'w-' || g)"
            " FROM generate_series(1, 8) g)").fetchall()})


def all_on_one(conninfo):
    """Moves every bench partition's colocated shards to the lowest worker."""
    with psycopg.connect(conninfo, autocommit=True) as c:
        c.execute("SET citus.enable_unsafe_triggers = on")
        target = c.execute("SELECT min(nodeport) FROM pg_dist_node WHERE shouldhaveshards"
                           ).fetchone()[0]
        for g in range(1, 9):
            shard, port = c.execute(
                "SELECT s, p.nodeport FROM get_shard_id_for_distribution_column("
                " 'syncular.sync_commits', %s::text) s JOIN pg_dist_shard_placement p ON p.shardid = s",
                [f"w-{g}"]).fetchone()
            if port != target:
                c.execute("SELECT citus_move_shard_placement(%s, '127.0.0.1', %s, '127.0.0.1', %s,"
                          " shard_transfer_mode => 'block_writes')", [shard, port, target])


def main():
    setup(SINGLE, False)
    setup(COORD, True)
    partitions = [f"w-{g}" for g in range(1, 9)]
    out = {}
    for name, conninfo in [("one node", SINGLE), ("Citus coordinator", COORD)]:
        out[name] = {
            "push1": pushes(conninfo, ["solo"], 1, "s"),
            "pull1": pulls(conninfo, "reader-p"),
            "pushN": pushes(conninfo, partitions, WORKERS, "m"),
        }
    out["spread"] = spread(COORD)
    all_on_one(COORD)
    out["one worker"] = {"pushN": pushes(COORD, partitions, WORKERS, "o")}
    out["after"] = spread(COORD)
    json.dump(out, sys.stdout, indent=1)
    print()
    one, co = out["one node"], out["Citus coordinator"]
    print("| workload | one node: calls/s | server ms/call | Citus: calls/s | coordinator ms/call |"
          " Citus / one node |")
    print("|---|---|---|---|---|---|")
    for key, label in [("push1", "push_commit, 1 client"), ("pull1", "pull following the head,"
                       " 1 client (with one push each)"), ("pushN", f"push_commit, {WORKERS} clients,"
                       " 8 partitions on both workers")]:
        print(f"| {label} | {one[key][0]:.0f} | {one[key][1]:.3f} | {co[key][0]:.0f} |"
              f" {co[key][1]:.3f} | {co[key][0] / one[key][0]:.2f}× |")
    ow = out["one worker"]["pushN"]
    print(f"| push_commit, {WORKERS} clients, 8 partitions on one worker | | | {ow[0]:.0f} |"
          f" {ow[1]:.3f} | two workers / one: {co['pushN'][0] / ow[0]:.2f}× |")


if __name__ == "__main__":
    main()
