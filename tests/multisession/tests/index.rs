//! docs/SCENARIOS.md: index usage (IDX-01 … IDX-07). The plans checked are those of the exact
//! statements the functions execute, captured with auto_explain (nested statements, logged to
//! the client as NOTICEs).

use postgres::Client;
use serde_json::json;
use std::sync::{Arc, Mutex};
use syncular_multisession::*;

/// A connection whose NOTICEs are collected, with auto_explain logging every nested plan.
fn explaining(db: &TestDb) -> (Client, Arc<Mutex<Vec<String>>>) {
    let (mut c, notices) = db.connect_with_notices();
    exec(
        &mut c,
        "LOAD 'auto_explain';
         SET auto_explain.log_min_duration = 0;
         SET auto_explain.log_nested_statements = on;
         SET auto_explain.log_level = notice;
         SET enable_seqscan = off;",
    );
    (c, notices)
}

/// Runs `sql` and returns the plans auto_explain reported for it.
fn plans_of(c: &mut Client, notices: &Arc<Mutex<Vec<String>>>, sql: &str) -> String {
    notices.lock().unwrap().clear();
    c.batch_execute(sql)
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
    notices.lock().unwrap().join("\n----\n")
}

/// The plans of `sql` with hash and merge joins off, so that an app-table probe shows as the
/// nested loop's inner index scan.
fn nested_loop_plans_of(c: &mut Client, notices: &Arc<Mutex<Vec<String>>>, sql: &str) -> String {
    exec(c, "SET enable_hashjoin = off; SET enable_mergejoin = off");
    let plans = plans_of(c, notices, sql);
    exec(c, "RESET enable_hashjoin; RESET enable_mergejoin");
    plans
}

fn assert_no_seq_scan(plans: &str, tables: &[&str]) {
    for t in tables {
        assert!(
            !plans.contains(&format!("Seq Scan on {t}")),
            "Seq Scan on {t}:\n{plans}"
        );
    }
}

/// The plans of `sql` mention `index`.
fn assert_uses(c: &mut Client, notices: &Arc<Mutex<Vec<String>>>, sql: &str, index: &str) {
    let plans = plans_of(c, notices, sql);
    assert!(
        plans.contains(index),
        "{sql} does not use {index}:\n{plans}"
    );
}

/// An app-table probe whose index condition includes `_sync_row_id`, not only the partition
/// (a collation mismatch would leave only the partition prefix usable).
fn assert_probes_row_id(plans: &str) {
    assert!(
        plans
            .lines()
            .any(|l| l.contains("Index Cond") && l.contains("_sync_row_id")),
        "{plans}"
    );
}

fn setup(c: &mut Client) {
    exec(
        c,
        "INSERT INTO public.tasks (\"_sync_partition\", \"_sync_row_id\", id, project_id, \"_sync_server_version\", \"_sync_scopes\", \"_sync_payload\")
         SELECT 'part-1', 'r' || i, 'r' || i, 'p' || (i % 20), 1, jsonb_build_object('project_id', 'p' || (i % 20)), '\\x01'
           FROM generate_series(1, 2000) i;
         INSERT INTO syncular.sync_row_scopes
         SELECT 'part-1', 'tasks', 'project_id', 'p' || (i % 20), 'r' || i FROM generate_series(1, 2000) i;
         INSERT INTO syncular.sync_blob_refs
         SELECT 'part-1', 'tasks', 'r' || i, 'sha256:' || (i % 20) FROM generate_series(1, 2000) i;",
    );
    exec(
        c,
        "SELECT syncular.append_commit('part-1', jsonb_build_object(
            'clientId', 'c1', 'clientCommitId', 'k' || i, 'actorId', 'a1', 'createdAtMs', 1750000000000,
            'writerVersion', 1,
            'changes', jsonb_build_array(jsonb_build_object('table', 'tasks', 'rowId', 'r' || i, 'op', 'upsert',
                        'rowVersion', 1, 'scopes', jsonb_build_object('project_id', 'p' || (i % 20)), 'payload', 'AQ=='))))
           FROM generate_series(1, 2000) i;
         SELECT syncular.declare_checkpoint('part-1', 'x', 1, 1);
         ANALYZE;",
    );
}

/// Runs `call` (one value) in a transaction of its own, and returns it with what that
/// transaction's statistics counted: the scans of index `index` and the sequential scans of
/// `tables` (all of schema syncular). A read below SQL has no statement, so no plan to explain.
fn counted<T: for<'a> postgres::types::FromSql<'a>>(
    c: &mut Client,
    call: &str,
    index: &str,
    tables: &[&str],
) -> (T, i64, i64) {
    exec(c, "BEGIN");
    let value: T = one(c, call, &[]);
    let scans: i64 = one(
        c,
        &format!("SELECT pg_stat_get_xact_numscans('syncular.{index}'::regclass)"),
        &[],
    );
    let tables: Vec<String> = tables.iter().map(|t| format!("syncular.{t}")).collect();
    let seq: i64 = one(
        c,
        "SELECT coalesce(sum(seq_scan), 0)::bigint FROM pg_stat_xact_user_tables
          WHERE relid = ANY ($1::text[]::regclass[])",
        &[&tables],
    );
    exec(c, "COMMIT");
    (value, scans, seq)
}

#[test]
fn idx_01_to_07_index_usage() {
    let db = TestDb::new("idx");
    let mut plain = db.connect();
    setup(&mut plain);
    let (mut c, notices) = explaining(&db);
    let log = ["sync_change_scopes", "sync_commits", "sync_changes"];

    // IDX-01: a window page. On one node it reads below SQL (issue 28).
    let (rows, scans, seq): (i64, i64, i64) = counted(
        &mut plain,
        r#"SELECT count(*) FROM syncular.read_commit_window('part-1', 'tasks', '{"project_id":["p3"]}', 0, 2000, 64)"#,
        "sync_change_scopes_pkey",
        &log,
    );
    assert_eq!(rows, 64);
    assert!(scans >= 1, "sync_change_scopes_pkey scanned {scans} times");
    assert_eq!(seq, 0, "sequential scans of the log");

    // IDX-02: a scan_rows page, and the app-table probe uses both primary-key columns.
    let plans = nested_loop_plans_of(
        &mut c,
        &notices,
        r#"SELECT * FROM syncular.scan_rows('part-1', 'tasks', '{"project_id":["p3"]}', NULL, 50)"#,
    );
    assert_no_seq_scan(&plans, &["sync_row_scopes", "tasks"]);
    assert!(plans.contains("tasks_pkey"), "{plans}");
    assert_probes_row_id(&plans);

    // IDX-03: the lateral multi-subscription window.
    let specs = json!([{"i":1,"scopes":{"project_id":["p3"]},"after":0},{"i":2,"scopes":{"project_id":["p4","p5"]},"after":10}]);
    let plans = plans_of(
        &mut c,
        &notices,
        &format!(
            "SELECT s.i, w.* FROM jsonb_to_recordset('{specs}') AS s(i int, scopes jsonb, after bigint)
               CROSS JOIN LATERAL syncular.read_commit_window('part-1', 'tasks', s.scopes, s.after, 2000, 64) AS w"
        ),
    );
    assert_no_seq_scan(&plans, &log);

    // IDX-04: a row's scope entries are read through sync_row_scopes_by_row (also in the batch
    // form), below SQL on one node in READ COMMITTED (its statement's plans: the test below).
    let by_row = "sync_row_scopes_by_row";
    for call in [
        r#"SELECT syncular.set_row_scopes('part-1', 'tasks', 'r7', '{"project_id":"p9"}')"#,
        r#"SELECT syncular.set_rows_scopes('part-1', 'tasks', '[{"rowId":"r9","scopes":{}}]')"#,
        // Unchanged scopes: only the comparing read runs, through the same index.
        r#"SELECT syncular.set_rows_scopes('part-1', 'tasks', '[{"rowId":"r10","scopes":{"project_id":"p10"}}]')"#,
    ] {
        let (_, scans, seq): (i32, i64, i64) =
            counted(&mut plain, call, by_row, &["sync_row_scopes"]);
        assert!(scans >= 1, "{call}: {by_row} scanned {scans} times");
        assert_eq!(seq, 0, "{call}: sequential scans of sync_row_scopes");
    }
    assert_uses(
        &mut c,
        &notices,
        "SELECT syncular.delete_row_meta('part-1', 'tasks', 'r8')",
        by_row,
    );

    // IDX-05: the blob lookup and the app-row probes.
    let plans = nested_loop_plans_of(
        &mut c,
        &notices,
        "SELECT syncular.rows_referencing_blob('part-1', 'sha256:3')",
    );
    assert!(plans.contains("sync_blob_refs_by_blob"), "{plans}");
    assert_probes_row_id(&plans);

    // IDX-06: source coverage and the source-change probe.
    let by_source = "sync_changes_by_source";
    assert_uses(
        &mut c,
        &notices,
        "SELECT syncular.source_coverage_seq('part-1', ARRAY['tasks'])",
        by_source,
    );
    assert_uses(
        &mut c,
        &notices,
        "SELECT syncular.has_source_changes_above('part-1', ARRAY['tasks'], 1990)",
        by_source,
    );

    // IDX-07: the pending read of the gate. It runs below SQL (issue 28).
    let (gate, scans, seq): (serde_json::Value, i64, i64) = counted(
        &mut plain,
        "SELECT syncular.read_serve_gate('part-1', 1)",
        "sync_backfill_checkpoints_pending",
        &["sync_backfill_checkpoints"],
    );
    assert_eq!(
        gate["pending"],
        json!([{"partition": "part-1", "name": "x"}]),
        "{gate}"
    );
    assert!(
        scans >= 1,
        "sync_backfill_checkpoints_pending scanned {scans} times"
    );
    assert_eq!(seq, 0, "sequential scans of sync_backfill_checkpoints");
}

/// With statistics where one partition holds every row (a single-tenant database), the plan
/// cache would plan a key lookup again on every call: a custom plan for a rare partition always
/// looks cheaper than the generic one. The row-scope statements run their generic plan, and it
/// probes sync_row_scopes_by_row with the whole key — parameters in the index condition, no
/// sequential scan — from the first call on. The statements run outside READ COMMITTED (here
/// REPEATABLE READ) and on Citus; in READ COMMITTED on one node the same probes run below SQL.
#[test]
fn row_scope_statements_keep_one_generic_index_plan_under_skewed_statistics() {
    let db = TestDb::new("idxskew");
    let mut plain = db.connect();
    exec(
        &mut plain,
        "INSERT INTO syncular.sync_row_scopes
         SELECT 'big', 'tasks', 'project_id', 'p' || (i % 20), 'r' || i FROM generate_series(1, 5000) i;
         ANALYZE syncular.sync_row_scopes;",
    );
    let (mut c, notices) = explaining(&db);
    exec(&mut c, "RESET enable_seqscan");
    for i in 0..8 {
        // Unchanged scopes run the comparing read only; changed ones also the write.
        for scopes in [format!("p{i}"), format!("p{i}")] {
            let rows = json!([{"rowId": "r1", "scopes": {"project_id": scopes}},
                              {"rowId": "r2", "scopes": {"project_id": scopes}}]);
            let plans = plans_of(
                &mut c,
                &notices,
                &format!(
                    "BEGIN ISOLATION LEVEL REPEATABLE READ;
                     SELECT syncular.set_rows_scopes('small', 'tasks', '{rows}'); COMMIT;"
                ),
            );
            assert_no_seq_scan(&plans, &["sync_row_scopes"]);
            let probes: Vec<&str> = plans
                .lines()
                .filter(|l| l.contains("Index Cond") && l.contains("row_id = "))
                .collect();
            assert!(!probes.is_empty(), "call {i}: no row_id probe:\n{plans}");
            assert!(
                probes.iter().all(|l| l.contains("partition = $1")),
                "call {i}: a custom plan:\n{plans}"
            );
        }
    }
}

/// The row-meta trigger's scope statements keep the plan the backend made for them first,
/// here while `sync_row_scopes` was empty; each row is still found by its id (an index
/// condition), not by filtering every entry of the partition's table. On PostgreSQL 15 the
/// plan made from an empty table once filtered `row_id = ANY ($3)`: a bulk insert through the
/// trigger read every entry written before it, quadratic in the rows inserted.
#[test]
fn the_row_meta_trigger_probes_each_row_by_its_id_whatever_the_table_held_when_planned() {
    let db = TestDb::new("idxrowmeta");
    let mut c = db.connect();
    exec(
        &mut c,
        "SELECT syncular.register_table('tasks', 'public.tasks', true)",
    );
    let (mut e, notices) = explaining(&db);
    exec(
        &mut e,
        "RESET enable_seqscan;
         SET auto_explain.log_analyze = on;
         SET auto_explain.log_timing = off;",
    );
    let insert = |from: i32, to: i32| {
        format!(
            "INSERT INTO public.tasks (\"_sync_partition\", \"_sync_row_id\", id, \"_sync_server_version\",
                                       \"_sync_scopes\", \"_sync_payload\")
             SELECT 'part-1', 'r' || i, 'r' || i, 1, jsonb_build_object('project_id', 'p' || (i % 7)), '\\x01'
               FROM generate_series({from}, {to}) i"
        )
    };
    // The statements (REPEATABLE READ; in READ COMMITTED the same probes run below SQL, the
    // rows after these): the first row's are planned here, on the empty table.
    let repeatable = |sql: String| format!("BEGIN ISOLATION LEVEL REPEATABLE READ; {sql}; COMMIT;");
    plans_of(&mut e, &notices, &repeatable(insert(1, 1)));
    let plans = plans_of(&mut e, &notices, &repeatable(insert(2, 2001)));
    assert_eq!(
        one::<i64>(&mut c, "SELECT count(*) FROM syncular.sync_row_scopes", &[]),
        2001
    );
    // Every read of the table's entries probes one row id: 2,000 probes, none of which read
    // another row's entry (a filter over the partition would read ~10^6 in all).
    let read = rows_read(&plans, "sync_row_scopes_by_row");
    assert!(
        read <= 2001,
        "entries read: {read}\n{}",
        &plans[..plans.len().min(4000)]
    );
    assert_no_row_id_filter(&plans);
    assert!(
        plans.matches("using sync_row_scopes_by_row").count() >= 2000,
        "one probe per row"
    );
    // A scope change of each row removes its stale entry by key and inserts the new one.
    let plans = plans_of(
        &mut e,
        &notices,
        &repeatable(
            "UPDATE public.tasks SET \"_sync_scopes\" = jsonb_build_object('project_id', 'moved')
              WHERE \"_sync_row_id\" IN ('r5', 'r6')"
                .into(),
        ),
    );
    assert_no_row_id_filter(&plans);
    assert_eq!(
        one::<i64>(
            &mut c,
            "SELECT count(*) FROM syncular.sync_row_scopes WHERE value = 'moved'",
            &[]
        ),
        2
    );
    assert_eq!(
        one::<i64>(&mut c, "SELECT count(*) FROM syncular.sync_row_scopes", &[]),
        2001
    );
    // READ COMMITTED: below SQL, the same entries.
    exec(&mut c, &insert(2002, 4001));
    assert_eq!(
        one::<i64>(&mut c, "SELECT count(*) FROM syncular.sync_row_scopes", &[]),
        4001
    );
}

/// No plan filters `sync_row_scopes` entries by their row id (each is an index condition).
fn assert_no_row_id_filter(plans: &str) {
    let filtered: Vec<&str> = plans
        .lines()
        .filter(|l| l.contains("Filter") && l.replace("_sync_row_id", "").contains("row_id"))
        .collect();
    assert!(filtered.is_empty(), "row ids filtered: {filtered:?}");
}

/// The `actual rows` of the plan nodes reading `index`, summed (auto_explain with ANALYZE).
fn rows_read(plans: &str, index: &str) -> i64 {
    plans
        .lines()
        .filter(|l| l.contains(&format!("using {index} on")))
        .filter_map(|l| {
            let at = l.find("actual time=")?;
            let tail = &l[at..];
            // Rows per loop: an integer up to PostgreSQL 17, with two decimals from 18 on.
            let rows: f64 = tail
                .split("rows=")
                .nth(1)?
                .split(' ')
                .next()?
                .parse()
                .ok()?;
            let loops: f64 = tail
                .split("loops=")
                .nth(1)?
                .trim_end_matches(')')
                .parse()
                .ok()?;
            Some((rows * loops).round() as i64)
        })
        .sum()
}

/// IDX-08 … IDX-10: the commit window reads only the commits it returns (not the whole
/// candidate page), runs no statement on one node (it reads below SQL, issue 28: the page's
/// statement with its kept generic plan is what a Citus coordinator runs), and an empty range (an
/// idle pull) reads nothing of the log; the one-call pull's reads likewise.
#[test]
fn idx_08_to_10_the_window_reads_what_it_returns() {
    let db = TestDb::new("idx_window");
    let mut plain = db.connect();
    // 300 commits of 10 changes each, one project per commit (20 projects).
    exec(
        &mut plain,
        "SELECT syncular.append_commit('part-1', jsonb_build_object(
            'clientId', 'c1', 'clientCommitId', 'k' || i, 'actorId', 'a1', 'createdAtMs', 1750000000000,
            'changes', (SELECT jsonb_agg(jsonb_build_object('table', 'tasks', 'rowId', 'r' || i || '-' || j,
                        'op', 'upsert', 'rowVersion', 1, 'scopes', jsonb_build_object('project_id', 'p' || (i % 2)),
                        'payload', 'AQ==')) FROM generate_series(1, 10) j)))
           FROM generate_series(1, 300) i;
         ANALYZE;",
    );
    let (mut c, notices) = explaining(&db);
    exec(
        &mut c,
        "SET auto_explain.log_analyze = on; RESET enable_seqscan",
    );

    // IDX-08: 101 changes asked, 11 commits (110 changes) returned: the scope entries, commit
    // rows and changes read stay within the returned commits plus the few rows that show where
    // the last one ends — counted by this transaction's statistics of each index.
    let sql = r#"SELECT * FROM syncular.read_commit_window('part-1', 'tasks', '{"project_id":["p1"]}', 0, 300, 101)"#;
    exec(&mut plain, "BEGIN");
    let returned: i64 = one(&mut plain, &format!("SELECT count(*) FROM ({sql}) w"), &[]);
    let read_of = |c: &mut Client, indexes: &str| -> i64 {
        one(
            c,
            &format!(
                "SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(i::regclass)), 0)::bigint
                   FROM unnest(ARRAY[{indexes}]) i"
            ),
            &[],
        )
    };
    let changes = read_of(
        &mut plain,
        "'syncular.sync_changes_pkey', 'syncular.sync_changes_by_table', 'syncular.sync_changes_by_source'",
    );
    let commits = read_of(&mut plain, "'syncular.sync_commits_pkey'");
    let scopes = read_of(&mut plain, "'syncular.sync_change_scopes_pkey'");
    let seq: i64 = one(
        &mut plain,
        "SELECT coalesce(sum(seq_scan), 0)::bigint FROM pg_stat_xact_user_tables
          WHERE relid IN ('syncular.sync_changes'::regclass, 'syncular.sync_commits'::regclass,
                          'syncular.sync_change_scopes'::regclass)",
        &[],
    );
    exec(&mut plain, "COMMIT");
    assert_eq!(returned, 110);
    assert!(
        changes > 0 && changes <= returned + 16,
        "{changes} change rows read"
    );
    assert!(commits <= 12, "{commits} commit rows read");
    assert!(scopes <= 13, "{scopes} scope entries read");
    assert_eq!(seq, 0, "sequential scans of the log");

    // IDX-09: on one node the window runs no statement at all, on any call (it ran its kept
    // generic plan before, which a Citus coordinator still does).
    for _ in 0..8 {
        let plans = plans_of(&mut c, &notices, sql);
        for t in ["sync_change_scopes", "sync_changes", "sync_commits"] {
            assert!(!plans.contains(&format!(" on {t}")), "{plans}");
        }
    }

    // IDX-10: an empty window (cursor at the head) and an idle one-call pull read no log table.
    let plans = plans_of(
        &mut c,
        &notices,
        r#"SELECT * FROM syncular.read_commit_window('part-1', 'tasks', '{"project_id":["p1"]}', 300, 300, 101)"#,
    );
    for t in ["sync_change_scopes", "sync_changes", "sync_commits"] {
        assert!(!plans.contains(&format!(" on {t}")), "{plans}");
    }
    let idle = json!({"subscriptions": [{"id": "s", "table": "tasks", "scopes": {"project_id": ["p1"]},
                                         "effective": {"project_id": ["p1"]}, "cursor": 300}]});
    let plans = plans_of(
        &mut c,
        &notices,
        &format!(
            "SELECT * FROM syncular.pull('part-1', 'c1', 'a1', 1750000000000, 'e1', 1, '{idle}')"
        ),
    );
    for t in ["sync_change_scopes", "sync_changes", "sync_commits"] {
        assert!(!plans.contains(&format!(" on {t}")), "{plans}");
    }
    // The head (bounds, client record, registry entry) is read below SQL too (issue 28), and
    // the registry touch and the client record are written below SQL (docs/BENCHMARKS.md
    // "Server CPU", step 13): the call runs no statement — and wrote both.
    assert!(!plans.contains(" on sync_partitions "), "{plans}");
    assert_eq!(plans.matches("Query Text:").count(), 1, "{plans}");
    let written: i64 = one(
        &mut c,
        "SELECT count(*) FROM syncular.sync_clients c JOIN syncular.sync_partition_registry r
           USING (partition)
          WHERE partition = 'part-1' AND c.client_id = 'c1' AND c.cursor = 300",
        &[],
    );
    assert_eq!(written, 1);
}

/// The window reads a commit's changes of the table asked through `sync_changes_by_source`,
/// not every change of the commit: 20 commits of 500 changes of another table and one of
/// `tasks` each read 20 change rows, none through the primary key (red team 35, F3: 2,000
/// changes of another table per commit were read to find one).
#[test]
fn the_window_reads_only_the_changes_of_its_table() {
    let db = TestDb::new("idx_wide");
    let mut c = db.connect();
    exec(
        &mut c,
        "SELECT syncular.append_commit('wide', jsonb_build_object('clientId', 'd', 'clientCommitId', 'c' || g,
           'actorId', 'a', 'createdAtMs', 1, 'changes',
           (SELECT jsonb_agg(jsonb_build_object('table', 'other', 'rowId', 'o' || j, 'op', 'delete',
                                                'scopes', '{\"p\":\"x\"}'::jsonb)) FROM generate_series(1, 500) j)
           || jsonb_build_array(jsonb_build_object('table', 'tasks', 'rowId', 't' || g, 'op', 'upsert',
                                                   'rowVersion', 1, 'scopes', '{\"p\":\"x\"}'::jsonb))))
           FROM generate_series(1, 20) g",
    );
    exec(&mut c, "BEGIN");
    let rows: i64 = one(
        &mut c,
        r#"SELECT count(*) FROM syncular.read_commit_window('wide', 'tasks', '{"p":["x"]}', 0, 1000, 1000)"#,
        &[],
    );
    let read = |c: &mut Client, index: &str| -> i64 {
        one(
            c,
            &format!("SELECT pg_stat_get_xact_tuples_returned('syncular.{index}'::regclass)"),
            &[],
        )
    };
    let by_source = read(&mut c, "sync_changes_by_source");
    let by_key = read(&mut c, "sync_changes_pkey") + read(&mut c, "sync_changes_by_table");
    exec(&mut c, "COMMIT");
    assert_eq!(rows, 20);
    assert!(
        (1..=20).contains(&by_source),
        "{by_source} change rows read through sync_changes_by_source"
    );
    assert_eq!(by_key, 0, "change rows read through another index");
}

/// IDX-11: the reaction claim reads an index range in claim order, whatever the backlog. With
/// the statistics of a 100k-row outbox (pending rows, lapsed and live leases, finished rows), the
/// claim's plan (always its generic plan: parameters, whatever the call) — type filter and lease
/// expiry included — is a scan of sync_reactions_claim under the LIMIT with no sort, reading about
/// as many rows as it claims;
/// the acknowledgements (single and batch) are primary-key probes.
#[test]
fn idx_11_the_reaction_claim_reads_an_index_range_in_claim_order() {
    let db = TestDb::new("idx_claim");
    let mut plain = db.connect();
    exec(
        &mut plain,
        "INSERT INTO syncular.sync_reactions
           (partition, idempotency_key, type, version, payload, source_client_id,
            source_client_commit_id, source_commit_seq, created_at_ms, available_at_ms, status,
            attempts, max_attempts, lease_owner, lease_expires_at_ms, completed_at_ms)
         SELECT 'part-1', 'k' || lpad(i::text, 7, '0'), CASE WHEN i % 10 = 0 THEN 'push.notify' ELSE 'email.send' END,
                1, '{\"m\":1}', 'c1', 'commit-' || i, i, 1750000000000 + i, 1750000000000 + i,
                s.status, CASE WHEN s.status = 'pending' THEN 0 ELSE 1 END, 10,
                CASE WHEN s.status = 'leased' THEN 'w0' END,
                CASE WHEN s.status = 'leased' THEN 1750000000000 + i + (i % 2) * 1000000 END,
                CASE WHEN s.status = 'completed' THEN 1750000000000 + i END
           FROM generate_series(1, 100000) i,
                LATERAL (SELECT CASE WHEN i % 7 = 0 THEN 'leased' WHEN i % 5 = 0 THEN 'completed'
                                     WHEN i % 53 = 0 THEN 'dead-letter' ELSE 'pending' END AS status) s;
         ANALYZE syncular.sync_reactions;",
    );
    let (mut c, notices) = explaining(&db);
    exec(
        &mut c,
        "SET auto_explain.log_analyze = on; RESET enable_seqscan",
    );
    let claim_plan = |c: &mut Client, sql: &str| -> String {
        let plans = plans_of(c, &notices, sql);
        plans
            .split("\n----\n")
            .find(|p| p.contains("FOR UPDATE SKIP LOCKED") || p.contains("LockRows"))
            .unwrap_or_else(|| panic!("{plans}"))
            .to_string()
    };
    for (i, types) in [
        "ARRAY['email.send']",
        "ARRAY['email.send','push.notify']",
        "ARRAY['push.notify']",
    ]
    .iter()
    .cycle()
    .take(9)
    .enumerate()
    {
        let now = 1_750_000_060_000_i64 + i as i64;
        let plan = claim_plan(
            &mut c,
            &format!(
                "SELECT syncular.claim_reactions('part-1', 'w{i}', {types}, {now}, 30000, 10)"
            ),
        );
        // The choice of the rows (the init plan feeding the UPDATE's keys): the index range
        // under LockRows and the LIMIT, no sort; the UPDATE probes the primary key. The only
        // sort is the top node's, of the ≤ `lim` claimed rows into the result's order.
        let nodes: Vec<&str> = plan.lines().filter(|l| l.contains("(cost=")).collect();
        let chosen = plan
            .split("InitPlan")
            .nth(1)
            .unwrap_or_else(|| panic!("call {i}:\n{plan}"));
        assert!(
            chosen.contains("Limit")
                && chosen.contains("LockRows")
                && chosen.contains("Index Scan using sync_reactions_claim"),
            "call {i}:\n{plan}"
        );
        assert!(
            nodes.iter().skip(1).all(|l| !l.contains("Sort")),
            "call {i}: a sort:\n{plan}"
        );
        assert!(plan.contains("sync_reactions_pkey"), "call {i}:\n{plan}");
        assert!(
            !plan.contains("Seq Scan on sync_reactions"),
            "call {i}:\n{plan}"
        );
        assert!(!plan.contains("Bitmap"), "call {i}:\n{plan}");
        // The range read stops after the rows claimed (plus those the type filter skips).
        let read = rows_read(&plan, "sync_reactions_claim");
        assert!(
            (10..=150).contains(&read),
            "call {i}: {read} rows read:\n{plan}"
        );
    }
    // Acknowledgements: key lookups.
    let lookups = [
        "SELECT syncular.complete_reaction('part-1', 'k0000001', 'w0', 1)",
        "SELECT syncular.extend_reaction_lease('part-1', 'k0000007', 'w0', 1)",
        r#"SELECT syncular.fail_reaction('part-1', 'k0000014', 'w0', '{"code":"x","atMs":1}', 5)"#,
        "SELECT syncular.complete_reactions('part-1', ARRAY['k0000021','k0000028'], 'w0', 1)",
        r#"SELECT syncular.fail_reactions('part-1', 'w0', '[{"idempotencyKey":"k0000035","failure":{"code":"x","atMs":1},"retryAtMs":9}]')"#,
    ];
    for sql in lookups {
        let plans = plans_of(&mut c, &notices, sql);
        assert!(plans.contains("sync_reactions_pkey"), "{sql}:\n{plans}");
        assert_no_seq_scan(&plans, &["sync_reactions"]);
    }
}
