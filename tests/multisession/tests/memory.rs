//! Raising errors does not leak (docs/DESIGN.md, "Errors"): PostgreSQL's error longjmp skips the
//! destructors of the Rust frames it jumps over, so `error::raise` must leave nothing owned in
//! them. One backend raises 50,000 refusals; its resident memory may not grow by more than a
//! bound far below what one leaked message and DETAIL per error would take (about 5 MB).

use serde_json::json;
use syncular_multisession::native_push::*;
use syncular_multisession::*;

/// Resident set size of a server process, in kB (the test runs on the server's machine).
fn rss_kb(pid: i32) -> i64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("cannot read the backend's /proc status: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/<pid>/status")
}

/// Peak resident set size of a server process so far, in kB.
fn peak_kb(pid: i32) -> i64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("cannot read the backend's /proc status: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/<pid>/status")
}

/// `n` calls that each raise `sync.storage.invalid_argument` (an empty partition), each caught
/// in its own subtransaction, in one statement.
fn raise_many(c: &mut postgres::Client, n: i64) {
    exec(
        c,
        &format!(
            "DO $$ BEGIN
               FOR i IN 1..{n} LOOP
                 BEGIN
                   PERFORM syncular.get_push_result('', 'client', 'commit');
                 EXCEPTION WHEN sqlstate 'SY000' THEN NULL;
                 END;
               END LOOP;
             END $$"
        ),
    );
}

#[test]
fn raising_errors_in_one_backend_does_not_grow_its_memory() {
    let db = TestDb::new("memory");
    let mut c = db.connect();
    let pid = backend_pid(&mut c);
    // Warm up: plans, caches and the allocator's arenas reach their working size.
    raise_many(&mut c, 5_000);
    let before = rss_kb(pid);
    raise_many(&mut c, 50_000);
    let grown = rss_kb(pid) - before;
    assert!(
        grown < 2_048,
        "the backend grew by {grown} kB over 50,000 errors"
    );
}

/// `renames` renames of the registered table `rn`, each followed by a read through the API that
/// plans a statement naming the table (issue 25: kept plans were keyed by a text holding the
/// current name, so every rename left one plan behind for the backend's life).
fn rename_and_read(c: &mut postgres::Client, from: usize, renames: usize) {
    for i in from..from + renames {
        let (old, new) = (format!("rn_{i}"), format!("rn_{}", i + 1));
        exec(c, &format!("ALTER TABLE public.{old} RENAME TO {new}"));
        let _: Option<serde_json::Value> =
            one(c, "SELECT syncular.get_row_scopes($1, 'rn', 'r1')", &[&P]);
    }
}

#[test]
fn renaming_an_app_table_does_not_grow_a_backend_by_a_plan_each_time() {
    let db = TestDb::new("memory_renames");
    let mut c = db.connect();
    exec(&mut c, &app_table_sql("public.rn_0", ""));
    exec(
        &mut c,
        r#"SELECT syncular.register_table('rn', 'public.rn_0');
           INSERT INTO public.rn_0 VALUES ('part-1', 'r1', 1, '{}', '\x01', NULL);"#,
    );
    let pid = backend_pid(&mut c);
    // Warm up past the number of plans a backend keeps (512, src/db.rs).
    rename_and_read(&mut c, 0, 700);
    let before = rss_kb(pid);
    rename_and_read(&mut c, 700, 3_000);
    let grown = rss_kb(pid) - before;
    // One kept plan per rename took about 11 kB: 3,000 would be over 30 MB.
    assert!(
        grown < 8_192,
        "the backend grew by {grown} kB over 3,000 renames"
    );
}

/// A push whose wait for the partition lock ends in an ERROR (`lock_timeout`) leaves nothing of
/// its Rust values behind. The lock is taken below SQL through the table AM's function pointer
/// (docs/DESIGN.md §Commit log), which pgrx does not guard by itself: unguarded, the ERROR's
/// longjmp skipped the destructors of the call's frames — each timed-out push with an `allowed`
/// of 20,000 values leaked about 1.25 MB for the backend's life (red team 33, F1).
#[test]
fn a_push_whose_lock_wait_times_out_does_not_grow_its_backend() {
    let (db, mut holder) = fixture("memory_lock_wait");
    let op = up(&mut holder, "tasks", "t1", None, task("t1", "p1"));
    one::<i64>(&mut holder, "SELECT syncular.lock_partition($1)", &[&P]);
    exec(&mut holder, "BEGIN");
    one::<i64>(&mut holder, "SELECT syncular.lock_partition($1)", &[&P]);
    let mut c = db.connect();
    let pid = backend_pid(&mut c);
    exec(&mut c, "SET lock_timeout = '1ms'");
    let values: Vec<String> = (0..20_000).map(|i| format!("value-{i}")).collect();
    let allowed = json!({ "project_id": values });
    let mut time_out = |i: usize| {
        let refused = try_push_as(
            &mut c,
            P,
            "c1",
            &format!("k{i}"),
            std::slice::from_ref(&op),
            Some(&allowed),
            &json!({}),
        );
        assert_eq!(
            sql_error(&refused.expect_err("the lock is held")).state,
            "55P03"
        );
    };
    // Warm up: plans, caches and the allocator's arenas reach their working size.
    for i in 0..5 {
        time_out(i);
    }
    let before = rss_kb(pid);
    for i in 5..45 {
        time_out(i);
    }
    let grown = rss_kb(pid) - before;
    assert!(
        grown < 12_288,
        "the backend grew by {grown} kB over 40 timed-out lock waits"
    );
    exec(&mut holder, "ROLLBACK");
}

/// The commit window holds what it reads only as long as it needs it (red team 35): a filter of
/// 20,000 values (read through the statement's pages, one value's range at a time, not 20,000
/// scans open at once: F1 took about 12 KB per value and quadratic time), and changes whose
/// large scopes do not match the filter (detoasted for one row at a time: F2 held every one to
/// the end of the call, 1 GB for 50 such changes). A backend's peak grows by far less than
/// either took.
#[test]
fn the_commit_window_does_not_hold_what_it_passes_over() {
    let db = TestDb::new("mem_window");
    let mut c = db.connect();
    exec(
        &mut c,
        "SELECT syncular.append_commit('dup', '{\"clientId\":\"d1\",\"clientCommitId\":\"c1\",\"actorId\":\"a\",
           \"createdAtMs\":1,\"changes\":[{\"table\":\"tasks\",\"rowId\":\"r1\",\"op\":\"upsert\",
           \"rowVersion\":1,\"scopes\":{\"p\":\"v7\"},\"payload\":\"AQI=\"}]}');
         SELECT syncular.append_commit('bomb', jsonb_build_object('clientId', 'd', 'clientCommitId', 'c' || g,
           'actorId', 'a', 'createdAtMs', 1, 'changes', jsonb_build_array(jsonb_build_object('table', 'tasks',
           'rowId', 't' || g, 'op', 'delete', 'scopes',
           (SELECT jsonb_object_agg('b' || lpad(v::text, 3, '0'), lpad(v::text, 3, '0') || repeat('a', 200000))
              FROM generate_series(0, 19) v) || '{\"a\":\"x\"}'::jsonb))))
           FROM generate_series(1, 50) g;",
    );
    // Each read in a backend of its own, measured against that backend's own peak.
    let peak_growth = |sql: &str, expected: i64| {
        let mut reader = db.connect();
        let pid = backend_pid(&mut reader);
        let before = peak_kb(pid);
        let rows: i64 = one(&mut reader, sql, &[]);
        assert_eq!(rows, expected, "{sql}");
        peak_kb(pid) - before
    };
    let many_values = peak_growth(
        "SELECT count(*) FROM syncular.read_commit_window('dup', 'tasks',
           (SELECT jsonb_build_object('p', jsonb_agg('v' || i)) FROM generate_series(1, 20000) i), 0, 10, 10)",
        1,
    );
    let passed_over = peak_growth(
        r#"SELECT count(*) FROM syncular.read_commit_window('bomb', 'tasks', '{"a":["x"],"zz":["m"]}', 0, 1000, 10)"#,
        0,
    );
    assert!(
        many_values < 80_000 && passed_over < 80_000,
        "the backend's peak grew by {many_values} kB with a 20,000-value filter, \
         {passed_over} kB passing over 50 changes of 4 MB scopes"
    );
}

/// The memory of this connection's contexts, in bytes.
fn context_bytes(c: &mut postgres::Client) -> i64 {
    one(
        c,
        "SELECT sum(total_bytes)::int8 FROM pg_catalog.pg_backend_memory_contexts",
        &[],
    )
}

/// Reading host rows through the API keeps no copy of a value it read until the transaction
/// ends. A value stored compressed or with a short header is copied when it is read; the copy
/// was made in a memory context the reader's row loop does not reset, so a `scan_rows` of 5,000
/// rows with 9.6 kB payloads grew its transaction by 48 MB, and one of 100,000 rows by 4 MB for
/// their `_sync_scopes` alone (red team 37, F3; docs/SECURITY.md rule 14).
#[test]
fn reading_host_rows_does_not_grow_the_transaction_by_the_values_read() {
    let db = TestDb::new("memory_reads");
    let mut c = db.connect();
    exec(&mut c, &app_table_sql("public.reads", ""));
    exec(
        &mut c,
        // The rows' scope entries written in one statement (the row-meta trigger would write
        // them a row at a time: minutes on PostgreSQL 15 for 52,000 rows).
        r#"SELECT syncular.register_table('reads', 'public.reads');
           INSERT INTO public.reads
           SELECT 'toasted', 't' || lpad(i::text, 5, '0'), 1, '{"project_id":"p1"}',
                  convert_to(repeat(md5(i::text), 300), 'UTF8'), NULL
             FROM generate_series(1, 2000) i;
           INSERT INTO public.reads
           SELECT 'short', 's' || lpad(i::text, 6, '0'), 1, '{"project_id":"p1"}', '\x01', NULL
             FROM generate_series(1, 50000) i;
           INSERT INTO syncular.sync_row_scopes (partition, tbl, var, value, row_id)
           SELECT _sync_partition, 'reads', 'project_id', 'p1', _sync_row_id FROM public.reads;"#,
    );
    let scan = "SELECT count(*) FROM syncular.scan_rows($1, 'reads', '{\"project_id\":[\"p1\"]}', \
                NULL, $2)";
    // Warm up: the statements' plans are kept for the backend's life.
    let _: i64 = one(&mut c, scan, &[&"short", &10i32]);
    for (partition, rows, before_fix) in [("toasted", 2_000i32, "19 MB"), ("short", 50_000, "2 MB")]
    {
        exec(&mut c, "BEGIN");
        let before = context_bytes(&mut c);
        let read: i64 = one(&mut c, scan, &[&partition, &rows]);
        let grown = context_bytes(&mut c) - before;
        exec(&mut c, "ROLLBACK");
        assert_eq!(read, i64::from(rows), "{partition}: every row read");
        assert!(
            grown < 1 << 20,
            "reading {rows} {partition} rows grew the transaction by {grown} bytes (before the \
             fix: about {before_fix})"
        );
    }
    // One row at a time, its scopes printed and parsed (`get_row_scopes`): `jsonb_out`'s buffers
    // stayed in the transaction, about 100 bytes a row on PostgreSQL 18 and a copy of every
    // string on 15 (red team 39, F3).
    exec(&mut c, "BEGIN");
    let before = context_bytes(&mut c);
    let read: i64 = one(
        &mut c,
        "SELECT count(syncular.get_row_scopes('short', 'reads', 's' || lpad(g::text, 6, '0')))
           FROM generate_series(1, 40000) g",
        &[],
    );
    let grown = context_bytes(&mut c) - before;
    exec(&mut c, "ROLLBACK");
    assert_eq!(read, 40_000);
    assert!(
        grown < 1 << 20,
        "40,000 get_row_scopes grew the transaction by {grown} bytes (before the fix: 4.2 MB on \
         PostgreSQL 18, 8.4 MB on 15)"
    );
}
