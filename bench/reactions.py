"""The reaction outbox side by side with pgmq (docs/BENCHMARKS.md, Reactions): one database holds
both queues. Enqueue 1 and 10 (`enqueue_reactions` vs `pgmq.send` / `pgmq.send_batch`), consume
1 and 10 (a transaction: claim + complete, vs `pgmq.read` + `pgmq.delete`), 1 and 4 clients, every
consume round starting from a backlog of 10^5 messages on each side; then syncular's own claim
latency at a backlog of 10^3, 10^5 and 10^6 (a claim of one, rolled back, so the backlog stays).
Payloads of 100 bytes.

pgmq is not vendored: its install script is the one the `pgmq` crate embeds
(`src/install/embedded/sql/pgmq.sql`, pgmq 1.11.1, PostgreSQL License), fetched with `cargo fetch`
of a throwaway project depending on `pgmq = "=0.33.7"` (or taken from `PGMQ_SQL`), and installed
with `psql -f`.

Used by bench/run.py: `run(psql, psql_file, pgbench, write_script, rounds, work)` returns the
rows; `section(rows)` the lines of the section."""
import glob
import os
import subprocess

NOW = 1_750_000_000_000
BACKLOG = 100_000
LATENCY_BACKLOGS = (("10^3", 1_000), ("10^5", 100_000), ("10^6", 1_000_000))
PGMQ_CRATE = "0.33.7"
PAYLOAD = '{"messageId":"m-0000000001","to":"someone@example.com","template":"welcome","locale":"en-US"}'
DB = "reactions_db"
# Enqueued reactions are created now: the claim index grows at its due end, as in use.
CLOCK_MS = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"


def pgmq_sql(work):
    """The path of pgmq's install script: PGMQ_SQL, the cargo registry, or a `cargo fetch`."""
    if os.environ.get("PGMQ_SQL"):
        return os.environ["PGMQ_SQL"]
    pattern = os.path.expanduser(f"~/.cargo/registry/src/*/pgmq-{PGMQ_CRATE}/src/install/embedded/sql/pgmq.sql")
    found = glob.glob(pattern)
    if not found:
        project = os.path.join(work, "pgmq-fetch")
        os.makedirs(os.path.join(project, "src"), exist_ok=True)
        with open(os.path.join(project, "Cargo.toml"), "w") as f:
            f.write(f'[package]\nname = "pgmq-fetch"\nversion = "0.0.0"\nedition = "2021"\n\n'
                    f'[dependencies]\npgmq = "={PGMQ_CRATE}"\n')
        with open(os.path.join(project, "src", "lib.rs"), "w") as f:
            f.write("")
        subprocess.run(["cargo", "fetch", "--manifest-path", os.path.join(project, "Cargo.toml")], check=True)
        found = glob.glob(pattern)
    return found[0]


def rows_sql(partition, n, start=0):
    """`n` pending reactions of `partition`, due at NOW (keys `b<i>`)."""
    return (
        "INSERT INTO syncular.sync_reactions (partition, idempotency_key, type, version, payload, source_client_id, "
        "source_client_commit_id, source_commit_seq, created_at_ms, available_at_ms, status, attempts, max_attempts) "
        f"SELECT '{partition}', 'b' || i, 'email.send', 1, '{PAYLOAD}', 'c1', 'commit-' || i, i, {NOW - BACKLOG * 10} + i, "
        f"{NOW - BACKLOG * 10} + i, 'pending', 0, 10 FROM generate_series({start + 1}, {start + n}) i")


def setup(psql, psql_file, work):
    psql("postgres", f"CREATE DATABASE {DB}")
    psql(DB, "CREATE EXTENSION syncular")
    psql_file(DB, pgmq_sql(work))
    for q in ("enq", "con"):
        psql(DB, f"SELECT pgmq.create('{q}')")
    for label, n in LATENCY_BACKLOGS:
        psql(DB, rows_sql(f"lat-{label}", n))
    psql(DB, "VACUUM ANALYZE")
    psql("postgres", "CHECKPOINT")


def refill(psql, side):
    """One side's consume queue back to exactly BACKLOG visible messages, vacuumed (outside the
    timing; both sides start every round alike). syncular's table also holds the latency
    partitions, so it is emptied with DELETE and vacuumed before the new rows go in: rows
    inserted over the previous round's dead entries (the same keys) would split the claim
    index's pages half full around them, a state no live queue reaches."""
    if side == "syncular":
        psql(DB, "DELETE FROM syncular.sync_reactions WHERE partition = 'con'")
        psql(DB, "VACUUM syncular.sync_reactions")
        psql(DB, rows_sql("con", BACKLOG))
        psql(DB, "VACUUM ANALYZE syncular.sync_reactions")
    else:
        psql(DB, "TRUNCATE pgmq.q_con, pgmq.a_con")
        psql(DB, f"SELECT pgmq.send_batch('con', array_agg('{PAYLOAD}'::jsonb)) FROM generate_series(1, {BACKLOG})")
        psql(DB, "VACUUM ANALYZE pgmq.q_con")


def enqueue_scripts(n):
    key = "'\"k' || :client_id || '-' || :k || '-{i}\"'"
    reactions = " || ',' || ".join(
        "'{\"idempotencyKey\":' || " + key.format(i=i) + " || ',\"type\":\"email.send\",\"version\":1,"
        f"\"payload\":{PAYLOAD},\"sourceClientId\":\"c1\",\"sourceClientCommitId\":\"commit-1\","
        "\"sourceCommitSeq\":1,\"createdAtMs\":' || " + CLOCK_MS + " || '}'" for i in range(n))
    ours = ("\\set k random(1, 4000000000000000000)\n"
            f"SELECT syncular.enqueue_reactions('enq', ('[' || {reactions} || ']')::jsonb);")
    # pgmq's messages are built per call too (a key in each), as a producer passes them: with
    # `-M prepared`, a constant message would be parsed once at PREPARE, not per send.
    messages = ", ".join("('{\"key\":' || " + key.format(i=i) + " || '," + PAYLOAD[1:] + "')::jsonb"
                         for i in range(n))
    head = "\\set k random(1, 4000000000000000000)\n"
    if n == 1:
        theirs = head + f"SELECT pgmq.send('enq', {messages});"
    else:
        theirs = head + f"SELECT pgmq.send_batch('enq', ARRAY[{messages}]);"
    return theirs, ours


def consume_scripts(n, pgmq_ack="delete"):
    claim = f"syncular.claim_reactions('con', 'w' || :client_id, ARRAY['email.send'], {NOW}, 30000, {n})"
    if n == 1:
        ours = ("BEGIN;\n"
                f"SELECT r->>'idempotencyKey' AS key FROM jsonb_array_elements({claim}) r \\gset\n"
                f"SELECT syncular.complete_reaction('con', :key, 'w' || :client_id, {NOW});\n"
                "COMMIT;")
        theirs = ("BEGIN;\n"
                  "SELECT msg_id AS id FROM pgmq.read('con', 30, 1) \\gset\n"
                  "SELECT pgmq.delete('con', :id::bigint);\n"
                  "COMMIT;")
    else:
        ours = ("BEGIN;\n"
                f"SELECT array_agg(r->>'idempotencyKey') AS keys FROM jsonb_array_elements({claim}) r \\gset\n"
                f"SELECT syncular.complete_reactions('con', :keys::text[], 'w' || :client_id, {NOW});\n"
                "COMMIT;")
        theirs = ("BEGIN;\n"
                  f"SELECT array_agg(msg_id) AS ids FROM pgmq.read('con', 30, {n}) \\gset\n"
                  f"SELECT pgmq.{pgmq_ack}('con', :ids::bigint[]);\n"
                  "COMMIT;")
    return theirs, ours


def latency_script(label):
    return ("BEGIN;\n"
            f"SELECT syncular.claim_reactions('lat-{label}', 'w', ARRAY['email.send'], {NOW}, 30000, 1);\n"
            "ROLLBACK;")


def median(runs):
    return sorted(runs)[len(runs) // 2]


def run(psql, psql_file, pgbench, write_script, rounds, work):
    """Rows (workload, clients, pgmq (tps, ms), syncular (tps, ms)) and the latency rows
    (backlog, (tps, ms))."""
    print("setting up the reactions workload (reactions_db: pgmq and 1.1 × 10^6 reactions)...", flush=True)
    setup(psql, psql_file, work)
    rows = []
    # "consume 10 / archive": pgmq acknowledging with `archive` (the message moved to its archive
    # table) instead of `delete`: the like-for-like comparison with a completion that keeps the
    # row. Context only; the targets are judged against `delete`.
    for kind, n, scripts in [("enqueue", 1, enqueue_scripts(1)), ("enqueue", 10, enqueue_scripts(10)),
                             ("consume", 1, consume_scripts(1)), ("consume", 10, consume_scripts(10)),
                             ("consume 10 / archive", 10, consume_scripts(10, "archive"))]:
        paths = [write_script(f"rx-{kind.replace(' / ', '-')}-{n}-{side}.sql", text)
                 for side, text in zip(("pgmq", "syncular"), scripts)]
        for clients in (1, 4):
            runs = ([], [])
            for _ in range(rounds):
                for side, path in enumerate(paths):
                    if kind.startswith("consume"):
                        refill(psql, ("pgmq", "syncular")[side])
                    runs[side].append(pgbench(DB, path, clients))
            theirs, ours = median(runs[0]), median(runs[1])
            label = kind if "/" in kind else f"{kind} {n}"
            rows.append((label, clients, theirs, ours))
            print(f"{label:<12} c={clients}  pgmq {theirs[0]:>8.0f} tps {theirs[1]:>7.3f} ms | syncular {ours[0]:>8.0f} tps "
                  f"{ours[1]:>7.3f} ms | x{ours[0] / theirs[0]:.2f}   (rounds: "
                  + "/".join(f"{r[0]:.0f}" for r in runs[0]) + " | " + "/".join(f"{r[0]:.0f}" for r in runs[1]) + ")",
                  flush=True)
    latency = []
    paths = {label: write_script(f"rx-latency-{label.replace('^', '')}.sql", latency_script(label))
             for label, _ in LATENCY_BACKLOGS}
    runs = {label: [] for label in paths}
    for _ in range(rounds):
        for label, path in paths.items():
            runs[label].append(pgbench(DB, path, 1))
    for label, _ in LATENCY_BACKLOGS:
        m = median(runs[label])
        latency.append((label, m))
        print(f"claim 1 (rolled back), backlog {label:<5}  {m[0]:>8.0f} tps {m[1]:>7.3f} ms", flush=True)
    return rows, latency


def section(result):
    """The "## Reactions" section of docs/BENCHMARKS.md, with the targets of issue 18."""
    rows, latency = result
    lines = ["## Reactions", "",
             "Generated by `bench/run.sh` (`BENCH_REACTIONS_ONLY=1` runs only this part and replaces only this section). "
             "The reaction outbox next to pgmq 1.11.1 in the same database and run (`bench/reactions.py`): enqueue "
             "`enqueue_reactions` of 1 and 10 reactions vs `pgmq.send` / `pgmq.send_batch`; consume = one transaction "
             "claiming 1 or 10 and completing them (`claim_reactions` + `complete_reaction` / `complete_reactions` vs "
             "`pgmq.read` + `pgmq.delete`), each round from a backlog of 10^5 due messages per side (refilled and "
             "vacuumed between rounds); payloads of 100 bytes; pgbench `-M prepared` over loopback TCP, "
             f"{os.environ.get('BENCH_TARGET_ROUNDS', '5')} interleaved rounds of {os.environ.get('BENCH_SECONDS', '3')} s per side, "
             "fsync and autovacuum off (docs/BENCHMARKS.md, settings); tps of each side's median round. The row "
             "\"consume 10 / archive\" is context, not a target: the same syncular consume next to pgmq acknowledging "
             "with `pgmq.archive` (the message moved to its archive table) instead of `pgmq.delete` — the like-for-like "
             "comparison with a completion that keeps the row, as `complete_reactions` does (the data model keeps "
             "completed reactions until `prune_reactions`).", "",
             "| workload | clients | pgmq tps | pgmq ms | syncular tps | syncular ms | syncular / pgmq |",
             "|---|---|---|---|---|---|---|"]
    by = {}
    for label, clients, theirs, ours in rows:
        by[(label, clients)] = (theirs, ours)
        lines.append(f"| {label} | {clients} | {theirs[0]:.0f} | {theirs[1]:.3f} | {ours[0]:.0f} | {ours[1]:.3f} | "
                     f"{ours[0] / theirs[0]:.2f} |")
    lines += ["", "Claim latency (one client; a claim of one in a transaction rolled back, so the backlog stays):", "",
              "| backlog | tps | ms |", "|---|---|---|"]
    lines += [f"| {label} | {m[0]:.0f} | {m[1]:.3f} |" for label, m in latency]
    targets = []
    for (label, clients), (theirs, ours) in by.items():
        if "/" in label:
            continue  # context rows (pgmq's archive), not targets
        need = 1.0 if label.startswith("consume") else 0.9
        r = ours[0] / theirs[0]
        targets.append((f"{label}, {clients} client{'s' if clients > 1 else ''} ≥ {need}× pgmq", f"{r:.2f}×", r >= need))
    lat = dict(latency)
    if "10^3" in lat and "10^6" in lat:
        r = lat["10^6"][1] / lat["10^3"][1]
        targets.append(("claim latency at 10^6 ≤ 1.5× at 10^3", f"{r:.2f}×", r <= 1.5))
    lines += ["", "Targets of issue 18, judged on this run:", "", "| target | this run | |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {'met' if met else 'missed'} |" for name, value, met in targets]
    lines += ["",
              "Where the time goes (`perf -a` with call graphs and `pg_stat_statements` with `track = all`, 4 clients, "
              "consume 10, both queues in one cluster, measured while writing this; docs/DESIGN.md §8 has the claim "
              "index, the enqueue and the reading of reactions):", "",
              "- The claim does not grow with the backlog: it is one range read of `sync_reactions_claim` in claim order, "
              "stopped after `lim` locked rows, on its kept generic plan (the latency rows above).",
              "- Both queues spend the largest share of their server time stepping over index entries of messages "
              "consumed since the last VACUUM at the head of the range they read (`_bt_first`: 28 % of syncular's "
              "samples, 33 % of pgmq's). Autovacuum is off here for both; in use it bounds that walk.",
              "- Server time per consume of 10 (pg_stat_statements, per call): syncular's claim 1.11 ms (its statement "
              "0.96) against pgmq's read 1.18 ms (its statement 0.84, planned again on every call) — the claim is at "
              "par; syncular's complete 0.57 ms (its statement 0.49) against pgmq's delete 0.27 ms (its statement 0.09). "
              "The difference is the completion's writes: a completed reaction is kept until `prune_reactions` "
              "(docs/DESIGN.md §8 sync_reactions, invariant 9), so completing updates the row — a new row version with new entries in "
              "the primary key and the `completed` index, never HOT since the state is in the indexes' predicates — "
              "where pgmq's delete only marks the row. Index insertions are 17 % of syncular's samples, 5 % of "
              "pgmq's. Per consumed reaction syncular writes two row versions and four index entries, pgmq one and "
              "two. The archive row compares the same consume with `pgmq.archive`, which also keeps the message.",
              "- Enqueue reads its argument in jsonb's binary form, stores each payload as the bytes it came in and "
              "writes the rows below SQL (heap insert and index entries per row, the CHECK constraint evaluated; no "
              "statement, so no executor start-up; no `ON CONFLICT`: the primary key's unique check finds a duplicate "
              "and the error is renamed). Server time per call of 10 at four clients, measured while writing this: "
              "0.29 ms against 0.39 ms for `pgmq.send_batch` (each including the calling statement's `jsonb_in` of "
              "its argument; a reaction carries its key, type, version and source next to the payload). What remains "
              "heavier is the index work: syncular's two indexes take a random-position key (the idempotency key, "
              "unique) and a key shared by every partition, each insert a descent from the root; pgmq's two "
              "indexes (a sequence and a timestamp, in a table per queue) grow at their right edge, where PostgreSQL "
              "skips the descent.",
              "- Claims, gets and lists write their documents directly in jsonb's binary layout (src/jsonb_write.rs), "
              "with no JSON text and no `jsonb_in`.",
              "",
              "Not the same contract: pgmq's `delete` and `read` check no lease owner (any session may delete a message "
              "another one holds), it has no retry cap and no dead-letter state, and its messages carry no idempotency key "
              "(a duplicate send is a second message). syncular filters claims by type, checks the lease owner on every acknowledgement, "
              "counts attempts against `maxAttempts`, refuses a duplicate key, and keeps completed rows "
              "until `prune_reactions` (pgmq's `delete` removes the row)."]
    return lines
