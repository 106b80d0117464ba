//! docs/SCENARIOS.md: the commit log (LOG-01 … LOG-09).

use serde_json::{json, Value};
use std::thread;
use syncular_multisession::rng::Rng;
use syncular_multisession::*;

fn max_seq(c: &mut postgres::Client, p: &str) -> i64 {
    one(c, "SELECT syncular.max_commit_seq($1)", &[&p])
}

#[test]
fn log_01_dense_numbers_across_and_within_transactions() {
    let db = TestDb::new("log01");
    let mut c = db.connect();
    let seqs: Vec<i64> = (0..3)
        .map(|i| append(&mut c, P, "tasks", &format!("t{i}"), Some(V)))
        .collect();
    assert_eq!(seqs, vec![1, 2, 3]);
    assert_eq!(max_seq(&mut c, P), 3);
    let mut tx = c.transaction().unwrap();
    let seqs: Vec<i64> = (0..3)
        .map(|i| {
            let d = doc(
                &fresh_id(),
                json!([chg("tasks", &format!("u{i}"))]),
                Some(V),
            );
            tx.query_one("SELECT syncular.append_commit('one-tx', $1)", &[&d])
                .unwrap()
                .get(0)
        })
        .collect();
    tx.commit().unwrap();
    assert_eq!(seqs, vec![1, 2, 3]);
    assert_eq!(max_seq(&mut c, "one-tx"), 3);
}

#[test]
fn log_02_counters_are_per_partition() {
    let db = TestDb::new("log02");
    let mut c = db.connect();
    assert_eq!(append(&mut c, "part-a", "tasks", "t1", Some(V)), 1);
    assert_eq!(append(&mut c, "part-b", "tasks", "t1", Some(V)), 1);
}

#[test]
fn log_03_a_rollback_consumes_no_number() {
    let db = TestDb::new("log03");
    let mut c = db.connect();
    // In a subtransaction that is rolled back.
    let mut tx = c.transaction().unwrap();
    {
        let mut sp = tx.transaction().unwrap();
        let d = doc(&fresh_id(), json!([chg("tasks", "t1")]), Some(V));
        let s: i64 = sp
            .query_one("SELECT syncular.append_commit($1, $2)", &[&P, &d])
            .unwrap()
            .get(0);
        assert_eq!(s, 1);
        sp.rollback().unwrap();
    }
    assert_eq!(
        tx.query_one("SELECT syncular.max_commit_seq($1)", &[&P])
            .unwrap()
            .get::<_, i64>(0),
        0
    );
    tx.commit().unwrap();
    // [TX] In a rolled-back transaction.
    exec(&mut c, "BEGIN");
    assert_eq!(append(&mut c, P, "tasks", "t1", Some(V)), 1);
    exec(&mut c, "ROLLBACK");
    assert_eq!(max_seq(&mut c, P), 0);
    assert_eq!(append(&mut c, P, "tasks", "t1", Some(V)), 1);
}

#[test]
fn log_04_one_call_writes_commit_changes_scope_index_and_tombstones() {
    let db = TestDb::new("log04");
    let mut c = db.connect();
    let p2 = json!({"project_id":"p2"});
    let delete = |row: &str| json!({"table":"tasks","rowId":row,"op":"delete","rowVersion":null,"payload":null,"scopes":p2});
    let mut docs_change = chg("docs", "d1");
    docs_change["scopes"] = json!({"org_id":"o1","project_id":"p1"});
    let d = doc(
        "k1",
        json!([
            chg("tasks", "t1"),
            chg("tasks", "t2"),
            delete("t3"),
            delete("t3"),
            docs_change
        ]),
        Some(V),
    );
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.append_commit($1, $2)", &[&P, &d]),
        1
    );
    assert_eq!(
        one::<Option<i64>>(
            &mut c,
            "SELECT writer_version FROM syncular.sync_commits WHERE partition = $1",
            &[&P]
        ),
        Some(1)
    );
    // (idx, op, row_version, payload, scopes)
    type Change = (i32, i16, Option<i64>, Option<Vec<u8>>, Value);
    let changes: Vec<Change> = c
        .query(
            "SELECT idx, op, row_version, payload, scopes FROM syncular.sync_changes
              WHERE partition = $1 AND commit_seq = 1 ORDER BY idx",
            &[&P],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    let upsert_payload = Some(vec![1u8, 2, 3]);
    assert_eq!(
        changes,
        vec![
            (
                0,
                1,
                Some(1),
                upsert_payload.clone(),
                json!({"project_id":"p1"})
            ),
            (
                1,
                1,
                Some(1),
                upsert_payload.clone(),
                json!({"project_id":"p1"})
            ),
            (2, 2, None, None, p2.clone()),
            (3, 2, None, None, p2.clone()),
            (
                4,
                1,
                Some(1),
                upsert_payload,
                json!({"org_id":"o1","project_id":"p1"})
            ),
        ]
    );
    let scopes: Vec<(String, String, String, i64)> = c
        .query(
            "SELECT tbl, var, value, commit_seq FROM syncular.sync_change_scopes ORDER BY 1, 2, 3",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let s = |t: &str, v: &str, x: &str| (t.to_string(), v.to_string(), x.to_string(), 1i64);
    assert_eq!(
        scopes,
        vec![
            s("docs", "org_id", "o1"),
            s("docs", "project_id", "p1"),
            s("tasks", "project_id", "p1"),
            s("tasks", "project_id", "p2")
        ]
    );
    let tombstones =
        || "SELECT tbl || '/' || row_id || '@' || commit_seq FROM syncular.sync_tombstones";
    let rows: Vec<String> = column(&mut c, tombstones(), &[]);
    assert_eq!(rows, vec!["tasks/t3@1"]);
    let d2 = doc("k2", json!([delete("t3")]), Some(V));
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.append_commit($1, $2)", &[&P, &d2]),
        2
    );
    let rows: Vec<String> = column(&mut c, tombstones(), &[]);
    assert_eq!(rows, vec!["tasks/t3@2"]);
}

#[test]
fn log_05_empty_commits() {
    let db = TestDb::new("log05");
    let mut c = db.connect();
    append(&mut c, P, "tasks", "t1", Some(V));
    let mut d = doc("k2", json!(null), Some(V));
    d.as_object_mut().unwrap().remove("changes");
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.append_commit($1, $2)", &[&P, &d]),
        2
    );
    assert_eq!(
        count(&mut c, "syncular.sync_changes WHERE commit_seq = 2"),
        0
    );
}

#[test]
fn log_06_malformed_documents_write_nothing() {
    let db = TestDb::new("log06");
    let mut c = db.connect();
    append(&mut c, P, "tasks", "t1", Some(V));
    let valid = doc("k", json!([chg("tasks", "t1")]), Some(V));
    let with_change = |key: &str, value: Value| {
        let mut d = valid.clone();
        d["changes"][0][key] = value;
        d
    };
    let mut no_client = valid.clone();
    no_client.as_object_mut().unwrap().remove("clientId");
    let mut created_x = valid.clone();
    created_x["createdAtMs"] = json!("x");
    let mut created_frac = valid.clone();
    created_frac["createdAtMs"] = json!(1.5);
    let mut changes_object = valid.clone();
    changes_object["changes"] = json!({});
    let cases = [
        (no_client, "clientId", "missing"),
        (created_x, "createdAtMs", "type"),
        (created_frac, "createdAtMs", "type"),
        (with_change("op", json!("merge")), "changes[0].op", "range"),
        (with_change("table", json!("")), "changes[0].table", "empty"),
        (
            with_change("table", json!("sync_commits")),
            "changes[0].table",
            "reserved",
        ),
        (
            with_change("scopes", json!({"project_id": 5})),
            "changes[0].scopes.project_id",
            "type",
        ),
        (
            with_change("payload", json!("%%%")),
            "changes[0].payload",
            "base64",
        ),
        (changes_object, "changes", "type"),
        (json!(5), "", "type"),
    ];
    for (document, path, reason) in cases {
        for partition in [P, "fresh-partition"] {
            expect_error(
                try_one::<i64>(
                    &mut c,
                    "SELECT syncular.append_commit($1, $2)",
                    &[&partition, &document],
                ),
                "SY005",
                "sync.storage.invalid_commit",
                Some(json!({"path": path, "reason": reason})),
            );
        }
    }
    assert_eq!(max_seq(&mut c, P), 1);
    assert_eq!(
        count(
            &mut c,
            "syncular.sync_partitions WHERE partition = 'fresh-partition'"
        ),
        0
    );
    assert_eq!(count(&mut c, "syncular.sync_commits"), 1);
    // The same valid document passed as a jsonb string is accepted.
    let s: i64 = one(
        &mut c,
        "SELECT syncular.append_commit($1, to_jsonb($2::text))",
        &[&P, &valid.to_string()],
    );
    assert_eq!(s, 2);
}

#[test]
fn log_07_concurrent_appenders_serialize_densely() {
    for commit_first in [true, false] {
        let db = TestDb::new("log07");
        let mut s1 = db.connect();
        let mut observer = db.connect();
        exec(&mut s1, "BEGIN");
        assert_eq!(append(&mut s1, P, "tasks", "a", Some(V)), 1);
        let mut s2 = db.connect();
        let pid = backend_pid(&mut s2);
        let waiter = thread::spawn(move || append(&mut s2, P, "tasks", "b", Some(V)));
        wait_until_blocked(&mut observer, pid);
        exec(&mut s1, if commit_first { "COMMIT" } else { "ROLLBACK" });
        assert_eq!(waiter.join().unwrap(), if commit_first { 2 } else { 1 });
    }
}

#[test]
fn log_07_stress_eight_sessions_one_partition() {
    let db = TestDb::new("log07stress");
    let workers: Vec<_> = (0..8u64)
        .map(|w| {
            let mut c = db.connect();
            thread::spawn(move || {
                let mut rng = Rng(w + 1);
                let mut committed = Vec::new();
                for i in 0..200 {
                    let mut tx = c.transaction().unwrap();
                    let d = doc(
                        &format!("w{w}-{i}"),
                        json!([chg("tasks", &format!("w{w}-{i}"))]),
                        Some(V),
                    );
                    let s: i64 = tx
                        .query_one("SELECT syncular.append_commit($1, $2)", &[&P, &d])
                        .unwrap()
                        .get(0);
                    if rng.below(3) == 0 {
                        tx.rollback().unwrap();
                    } else {
                        tx.commit().unwrap();
                        committed.push(s);
                    }
                }
                committed
            })
        })
        .collect();
    let mut acknowledged: Vec<i64> = workers
        .into_iter()
        .flat_map(|w| w.join().unwrap())
        .collect();
    acknowledged.sort();
    let n = acknowledged.len() as i64;
    assert!(n > 0);
    assert_eq!(
        acknowledged,
        (1..=n).collect::<Vec<_>>(),
        "acknowledged numbers are dense"
    );
    let mut c = db.connect();
    let stored: Vec<i64> = column(
        &mut c,
        "SELECT commit_seq FROM syncular.sync_commits WHERE partition = $1 ORDER BY 1",
        &[&P],
    );
    assert_eq!(stored, (1..=n).collect::<Vec<_>>());
    assert_eq!(max_seq(&mut c, P), n);
    assert_eq!(count(&mut c, "syncular.sync_changes"), n);
}

#[test]
fn log_08_lock_partition_and_max_commit_seq() {
    let db = TestDb::new("log08");
    let mut c = db.connect();
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.lock_partition('fresh')", &[]),
        0
    );
    let row: (i64, i64) = {
        let r = c.query_one("SELECT max_commit_seq, horizon_seq FROM syncular.sync_partitions WHERE partition = 'fresh'", &[]).unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(row, (0, 0));
    append(&mut c, P, "tasks", "t1", Some(V));
    append(&mut c, P, "tasks", "t2", Some(V));
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.lock_partition($1)", &[&P]),
        2
    );
    assert_eq!(max_seq(&mut c, "unknown"), 0);
    assert_eq!(
        count(
            &mut c,
            "syncular.sync_partitions WHERE partition = 'unknown'"
        ),
        0
    );
}

#[test]
fn log_09_the_partition_lock_serializes_writers() {
    let db = TestDb::new("log09");
    let mut s1 = db.connect();
    let mut observer = db.connect();
    exec(&mut s1, "BEGIN");
    one::<i64>(&mut s1, "SELECT syncular.lock_partition($1)", &[&P]);
    let mut s2 = db.connect();
    let pid = backend_pid(&mut s2);
    let waiter = thread::spawn(move || append(&mut s2, P, "tasks", "t1", Some(V)));
    wait_until_blocked(&mut observer, pid);
    exec(&mut s1, "COMMIT");
    assert_eq!(waiter.join().unwrap(), 1);
}

/// The partition lock taken below SQL (docs/DESIGN.md §Commit log) waits, follows and gives up
/// exactly as its statement (`SELECT … FOR UPDATE`) does: a waiter is granted the newest
/// version once the holder commits its allocation; a row deleted while it waited is created
/// again (as the statement's path creates it); `lock_timeout`, a cancel and a deadlock end the
/// wait with PostgreSQL's own errors; under REPEATABLE READ a row changed after the snapshot is
/// refused (40001) by the statement the lock falls back to there.
#[test]
fn log_10_the_partition_lock_below_sql_waits_follows_and_gives_up_as_the_statement() {
    let db = TestDb::new("log10");
    let mut s1 = db.connect();
    let pid1 = backend_pid(&mut s1);
    let mut observer = db.connect();
    let lock = "SELECT syncular.lock_partition($1)";
    // Follows: s2 waits on s1's allocation, then locks the version s1 committed.
    append(&mut s1, P, "tasks", "t0", Some(V));
    exec(&mut s1, "BEGIN");
    one::<i64>(&mut s1, lock, &[&P]);
    append(&mut s1, P, "tasks", "t1", Some(V));
    let mut s2 = db.connect();
    let pid = backend_pid(&mut s2);
    let waiter = thread::spawn(move || {
        let max = one::<i64>(&mut s2, lock, &[&P]);
        (s2, max)
    });
    wait_until_blocked(&mut observer, pid);
    exec(&mut s1, "COMMIT");
    let (mut s2, max) = waiter.join().unwrap();
    assert_eq!(max, 2);
    // Deleted while waiting: the row is created again, at 0.
    one::<i64>(&mut s1, lock, &[&"gone"]);
    exec(&mut s1, "BEGIN");
    exec(
        &mut s1,
        "DELETE FROM syncular.sync_partitions WHERE partition = 'gone'",
    );
    let waiter = thread::spawn(move || {
        let max = one::<i64>(&mut s2, lock, &[&"gone"]);
        (s2, max)
    });
    wait_until_blocked(&mut observer, pid);
    exec(&mut s1, "COMMIT");
    let (mut s2, max) = waiter.join().unwrap();
    assert_eq!(max, 0);
    assert_eq!(
        count(&mut s1, "syncular.sync_partitions WHERE partition = 'gone'"),
        1
    );
    // lock_timeout and a cancel end the wait.
    exec(&mut s1, "BEGIN");
    one::<i64>(&mut s1, lock, &[&P]);
    exec(&mut s2, "SET lock_timeout = '200ms'");
    expect_error(
        s2.query_one(lock, &[&P]),
        "55P03",
        "canceling statement due to lock timeout",
        None,
    );
    exec(&mut s2, "RESET lock_timeout");
    let waiter = thread::spawn(move || {
        let result = s2.query_one(lock, &[&P]).map(|r| r.get::<_, i64>(0));
        (s2, result)
    });
    wait_until_blocked(&mut observer, pid);
    assert!(one::<bool>(
        &mut observer,
        "SELECT pg_cancel_backend($1)",
        &[&pid]
    ));
    let (mut s2, result) = waiter.join().unwrap();
    expect_error(
        result,
        "57014",
        "canceling statement due to user request",
        None,
    );
    exec(&mut s1, "ROLLBACK");
    // A deadlock between two partitions locked in opposite orders: one of them is refused.
    one::<i64>(&mut s1, lock, &[&"a"]);
    one::<i64>(&mut s1, lock, &[&"b"]);
    exec(&mut s1, "BEGIN");
    one::<i64>(&mut s1, lock, &[&"a"]);
    exec(&mut s2, "BEGIN");
    one::<i64>(&mut s2, lock, &[&"b"]);
    let first = thread::spawn(move || {
        let result = s1.query_one(lock, &[&"b"]).map(|r| r.get::<_, i64>(0));
        (s1, result)
    });
    wait_until_blocked(&mut observer, pid1);
    let second = s2.query_one(lock, &[&"a"]).map(|r| r.get::<_, i64>(0));
    let (mut s1, first) = first.join().unwrap();
    let refused: Vec<String> = [&first, &second]
        .into_iter()
        .filter_map(|r| r.as_ref().err().map(|e| sql_error(e).state))
        .collect();
    assert_eq!(refused, ["40P01"], "{first:?} {second:?}");
    exec(&mut s1, "ROLLBACK");
    exec(&mut s2, "ROLLBACK");
    // REPEATABLE READ: the statement, which refuses a row changed after the snapshot.
    exec(&mut s2, "BEGIN ISOLATION LEVEL REPEATABLE READ");
    one::<i64>(&mut s2, "SELECT 1::int8", &[]);
    append(&mut s1, P, "tasks", "t2", Some(V));
    expect_error(
        s2.query_one(lock, &[&P]),
        "40001",
        "could not serialize access due to concurrent update",
        None,
    );
    exec(&mut s2, "ROLLBACK");
}
