#!/usr/bin/env python3
"""The statements one `push_commit` runs inside it (issue 28): pg_stat_statements with
`track = all` over 20 one-row pushes updating an existing row (bench/run.py's push_commit
script), then over 20 one-row pushes each creating a new row, each nested statement with its
calls and mean time. Each push runs in a new connection
(one psql each), so the call's own time includes a backend's first-call costs: the count, and
the nested statements' times, are what this is for. Needs a running cluster with the extension
installed and `shared_preload_libraries` including pg_stat_statements; BENCH_PORT and
BENCH_PG_BIN as for bench/run.py. Creates (and leaves) the database `statements28`.

    BENCH_PORT=26611 python3 bench/statements.py
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402  (bench/run.py: psql, the push_commit script)

DB = "statements28"
PUSHES = 20


def main():
    run.psql("postgres", f"DROP DATABASE IF EXISTS {DB}")
    run.psql("postgres", f"CREATE DATABASE {DB}")
    run.psql(DB, "CREATE EXTENSION syncular; CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    run.psql(DB, run.PC_TABLE_DDL)
    run.psql(DB, "SELECT syncular.register_table('tasks_pc', 'public.tasks_pc')")
    layouts = json.dumps({name: t["columns"] for name, t in run.PC_SCHEMA.items()})
    run.psql(DB, f"BEGIN; SELECT syncular.migrate_schema(1, '{layouts}'); COMMIT;")
    run.psql(DB, f"SELECT syncular.set_push_schema(1, '{json.dumps(run.PC_SCHEMA)}')")
    row = json.dumps({"id": "r0", "project_id": "proj", "title": "task 0"})
    run.PC_PAYLOADS[0] = run.psql(DB, f"SELECT encode(syncular.encode_row('tasks_pc', '{row}', true), 'hex')")
    run.psql(DB, run.push_commit_call(1, "'p-1'", "'0'"))
    print(f"-- {PUSHES} pushes, each updating row r0")
    counted([run.push_commit_call(1, "'p-1'", f"'{k}'") for k in range(1, PUSHES + 1)])
    # A new row each: its payload encoded in the call (encode_row's own statement is top level).
    print(f"-- {PUSHES} pushes, each creating a new row")
    counted([
        "SELECT syncular.push_commit('p-1', 'c', 'new-" + str(k) + "', 'actor', 1750000000000, 1, "
        "'{\"project_id\":[\"proj\"]}', ARRAY['tasks_pc'], ARRAY['n" + str(k) + "'], ARRAY[1]::smallint[], "
        "ARRAY[NULL]::bigint[], ARRAY[syncular.encode_row('tasks_pc', jsonb_build_object('id', 'n" + str(k) + "', "
        "'project_id', 'proj', 'title', 'new'), true)]);"
        for k in range(1, PUSHES + 1)
    ])


def counted(calls):
    """Runs each call in a connection of its own and prints the statements they ran."""
    run.psql(DB, "SET pg_stat_statements.track = 'all'; SELECT pg_stat_statements_reset()")
    for call in calls:
        run.psql(DB, "SET pg_stat_statements.track = 'all'; " + call)
    print(run.psql(DB, """SELECT calls, round(total_exec_time::numeric / calls, 3) AS ms,
                                 left(regexp_replace(query, '\\s+', ' ', 'g'), 100)
                            FROM pg_stat_statements
                           WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                             AND query NOT LIKE 'SET %' AND query NOT LIKE '%pg_stat_statements_reset%'
                           ORDER BY calls DESC, total_exec_time DESC""", quiet=False))


if __name__ == "__main__":
    main()
