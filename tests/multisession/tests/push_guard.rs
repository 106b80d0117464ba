//! The classic push protects itself (docs/DESIGN.md §Push path): within the transaction that
//! `push_begin` opened, `append_commit` appends only to that push's partition, and `put_push_result`
//! stores `applied` only with the `commitSeq` the transaction appended, `rejected` only when no
//! append of the push stands. Outside such a transaction nothing changes.

use postgres::Transaction;
use serde_json::{json, Value};
use syncular_multisession::*;

/// Opens a push of `ccid` by client `c1` in `P` and sets the candidate savepoint.
fn begin<'a>(c: &'a mut postgres::Client, ccid: &str) -> Transaction<'a> {
    let mut tx = c.transaction().unwrap();
    let replay: Option<Value> = tx
        .query_one(
            "SELECT syncular.push_begin($1, 'c1', $2, $3)",
            &[&P, &ccid, &V],
        )
        .unwrap()
        .get(0);
    assert_eq!(replay, None);
    tx.batch_execute("SAVEPOINT syncular_push_candidate")
        .unwrap();
    tx
}

fn commit_of(client: &str, ccid: &str) -> Value {
    let mut d = doc(ccid, json!([chg("tasks", "t1")]), Some(V));
    d["clientId"] = json!(client);
    d
}

fn rejected() -> Value {
    json!({"status": "rejected", "results": [{"opIndex": 0, "status": "error", "code": "x", "message": "no"}]})
}

#[test]
fn append_commit_stays_in_the_partition_of_the_push_begun() {
    let db = TestDb::new("guard_append");
    let mut c = db.connect();
    let mut tx = begin(&mut c, "k1");
    let err = expect_error(
        tx.query_one(
            "SELECT syncular.append_commit('part-2', $1)",
            &[&commit_of("c1", "k1")],
        ),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument": "partition", "reason": "shape"})),
    );
    assert!(err.hint.unwrap_or_default().contains("\"k1\""));
    tx.rollback().unwrap();
    assert_eq!(count(&mut c, "syncular.sync_commits"), 0);
    // The push begun appends normally (its commit's own ids are not compared: docs/API.md).
    let mut tx = begin(&mut c, "k1");
    let seq: i64 = tx
        .query_one(
            "SELECT syncular.append_commit($1, $2)",
            &[&P, &commit_of("c1", "k1")],
        )
        .unwrap()
        .get(0);
    tx.query_one(
        "SELECT syncular.put_push_result($1, 'c1', 'k1', $2)",
        &[&P, &applied(seq, 1, "k1")],
    )
    .unwrap();
    tx.commit().unwrap();
    assert_eq!(seq, 1);
}

#[test]
fn an_applied_result_names_the_commit_the_transaction_appended() {
    let db = TestDb::new("guard_applied");
    let mut c = db.connect();
    // Another client's commit 1 exists already.
    append(&mut c, P, "tasks", "t0", Some(V));
    let store = |tx: &mut Transaction<'_>, result: &Value| {
        tx.query_one(
            "SELECT syncular.put_push_result($1, 'c1', 'k1', $2)",
            &[&P, result],
        )
        .map(|r| r.get::<_, Value>(0))
    };
    let append_in = |tx: &mut Transaction<'_>| {
        tx.query_one(
            "SELECT syncular.append_commit($1, $2)",
            &[&P, &commit_of("c1", "k1")],
        )
        .unwrap();
    };
    let refused = |tx: &mut Transaction<'_>, result: &Value, argument: &str| {
        expect_error(
            store(tx, result),
            "SY000",
            "sync.storage.invalid_argument",
            Some(json!({"argument": argument, "reason": "range"})),
        );
    };
    // No append in this transaction: an applied result would point at someone else's commit.
    let mut tx = begin(&mut c, "k1");
    refused(&mut tx, &applied(1, 1, "k1"), "result.commitSeq");
    tx.rollback().unwrap();
    // Appended as 2, named 1.
    let mut tx = begin(&mut c, "k1");
    append_in(&mut tx);
    refused(&mut tx, &applied(1, 1, "k1"), "result.commitSeq");
    tx.rollback().unwrap();
    // A rejection while the append stands is refused; after the rollback to the savepoint it
    // is stored, and consumed no number.
    let mut tx = begin(&mut c, "k1");
    append_in(&mut tx);
    refused(&mut tx, &rejected(), "result.status");
    tx.batch_execute("ROLLBACK TO SAVEPOINT syncular_push_candidate")
        .unwrap();
    assert_eq!(
        store(&mut tx, &rejected()).unwrap()["status"],
        json!("rejected")
    );
    tx.commit().unwrap();
    assert_eq!(count(&mut c, "syncular.sync_commits"), 1);
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.max_commit_seq($1)", &[&P]),
        1
    );
}

#[test]
fn outside_a_push_transaction_nothing_changes() {
    let db = TestDb::new("guard_outside");
    let mut c = db.connect();
    // Stored directly (a tool, a test, an adoption): any commitSeq, any client.
    let stored: Value = one(
        &mut c,
        "SELECT syncular.put_push_result($1, 'c9', 'k9', $2)",
        &[&P, &applied(42, 1, "k9")],
    );
    assert_eq!(stored["commitSeq"], json!(42));
    assert_eq!(append(&mut c, P, "tasks", "t1", Some(V)), 1);
    // A replayed push_begin (a stored result exists) guards nothing either.
    let mut tx = c.transaction().unwrap();
    let replay: Option<Value> = tx
        .query_one("SELECT syncular.push_begin($1, 'c9', 'k9', $2)", &[&P, &V])
        .unwrap()
        .get(0);
    assert!(replay.is_some());
    tx.query_one(
        "SELECT syncular.append_commit($1, $2)",
        &[&P, &commit_of("c3", "k3")],
    )
    .unwrap();
    tx.commit().unwrap();
}
