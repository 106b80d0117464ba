//! Stage/finish of the one-call push (NP-32; docs/API.md `push_finish`, docs/DESIGN.md §Push
//! path): a host with a commit validator or a reaction planner stages the push, runs its hooks
//! in the same transaction, and finishes it — or rolls back to its savepoint and stores a
//! rejection. The staged-and-finished push must store exactly what the one-call push stores for
//! the same commit; a host rejection stores only the rejection.

use postgres::{Client, GenericClient, Transaction};
use serde_json::{json, Value};
use syncular_multisession::native_push::*;
use syncular_multisession::*;

const STAGE: &str = "stage";

fn staged_options(identity: &str, hooks: Value) -> Value {
    let mut options = json!({"cacheIdentity": identity, "onCommitHooks": STAGE});
    for (k, v) in hooks.as_object().unwrap() {
        options[k] = v.clone();
    }
    options
}

/// The commit every case pushes, over rows `t1` (stored), `t3` (stored) and `t9` (absent):
/// an update, an insert, a delete of a stored row, a delete of an absent row.
fn ops(c: &mut Client) -> Vec<Op> {
    vec![
        up(
            c,
            "tasks",
            "t1",
            None,
            json!({"id": "t1", "title": "renamed"}),
        ),
        up(c, "tasks", "t2", None, task("t2", "p1")),
        del("tasks", "t3"),
        del("tasks", "t9"),
    ]
}

/// A database with the fixture and rows t1, t3 pushed (commits 1 and 2).
fn prepared(name: &str) -> (TestDb, Client) {
    let (db, mut c) = fixture(name);
    for (key, id) in [("k1", "t1"), ("k3", "t3")] {
        let op = up(&mut c, "tasks", id, None, task(id, "p1"));
        assert_eq!(push(&mut c, key, &[op])["outcome"], "applied");
    }
    (db, c)
}

/// `BEGIN; push_begin; SAVEPOINT syncular_push_candidate` as the host protocol has it.
fn begin<'a>(c: &'a mut Client, key: &str) -> Transaction<'a> {
    let mut tx = c.transaction().unwrap();
    let begun: Option<Value> = one_in(
        &mut tx,
        "SELECT syncular.push_begin($1, 'c1', $2, $3)",
        &[&P, &key, &V],
    );
    assert_eq!(begun, None);
    tx.batch_execute("SAVEPOINT syncular_push_candidate")
        .unwrap();
    tx
}

/// A push of `ops` under `key` in stage mode with `hooks` (the host protocol's `push_commit`).
fn try_stage(
    c: &mut impl GenericClient,
    key: &str,
    ops: &[Op],
    hooks: Value,
) -> Result<Value, postgres::Error> {
    try_push(c, key, ops, staged_options(key, hooks))
}

/// `begin`, then `ops` staged under `key` for a commit validator: the transaction holding the
/// staged push.
#[track_caller]
fn staged<'a>(c: &'a mut Client, key: &str, ops: &[Op]) -> Transaction<'a> {
    let mut tx = begin(c, key);
    let staged = try_stage(&mut tx, key, ops, json!({"commitValidator": true}));
    assert_eq!(staged.unwrap()["outcome"], "staged");
    tx
}

/// A finish of a key with nothing staged is refused.
#[track_caller]
fn assert_nothing_staged(outcome: Result<Value, postgres::Error>) {
    expect_error(
        outcome,
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument": "client_commit_id", "reason": "range"})),
    );
}

fn finish(
    tx: &mut Transaction<'_>,
    key: &str,
    reactions: &Value,
) -> Result<Value, postgres::Error> {
    tx.query_one(
        "SELECT syncular.push_finish($1, 'c1', $2, $3)",
        &[&P, &key, reactions],
    )
    .map(|r| r.get(0))
}

#[test]
fn np32_staged_then_finished_equals_the_one_call_push() {
    // Reference: the same commit through push_commit with no hooks.
    let (_ref_db, mut reference) = prepared("np32_ref");
    let reference_ops = ops(&mut reference);
    let applied = try_push(
        &mut reference,
        "s1",
        &reference_ops,
        json!({"cacheIdentity": "s1"}),
    )
    .unwrap();
    assert_eq!(applied["outcome"], "applied", "{applied}");

    let (_db, mut c) = prepared("np32_stage");
    let staged_ops = ops(&mut c);
    let mut tx = begin(&mut c, "s1");
    let staged = try_stage(
        &mut tx,
        "s1",
        &staged_ops,
        json!({"commitValidator": true, "reactionPlanner": true}),
    )
    .unwrap();
    // The evidence is upstream's ValidateCommitOperation, in operation order.
    let t1 = json!({"id": "t1", "project_id": "p1", "title": "task", "done": false,
                    "priority": null, "meta": null});
    let mut t1_after = t1.clone();
    t1_after["title"] = json!("renamed");
    assert_eq!(
        staged,
        json!({"outcome": "staged", "operations": [
            {"opIndex": 0, "op": "upsert", "table": "tasks", "rowId": "t1", "row": t1_after,
             "stored": t1, "storedServerVersion": 1, "nextServerVersion": 2},
            {"opIndex": 1, "op": "upsert", "table": "tasks", "rowId": "t2",
             "row": task("t2", "p1"), "nextServerVersion": 1},
            {"opIndex": 2, "op": "delete", "table": "tasks", "rowId": "t3",
             "stored": task("t3", "p1"), "storedServerVersion": 1},
            {"opIndex": 3, "op": "delete", "table": "tasks", "rowId": "t9"},
        ]})
    );
    // The host's validator reads the candidate state through its transaction.
    let candidate: i64 = one_in(
        &mut tx,
        "SELECT count(*) FROM public.np_tasks WHERE \"_sync_row_id\" IN ('t1', 't2')",
        &[],
    );
    assert_eq!(candidate, 2);
    let reactions = json!([{"idempotencyKey": "r1", "type": "mail.send", "version": 1,
                            "payload": {"to": "x"}, "sourceCommitSeq": 999}]);
    let finished = finish(&mut tx, "s1", &reactions).unwrap();
    // A second finish finds nothing staged.
    assert_nothing_staged(probe(&mut tx, |tx| finish(tx, "s1", &json!([]))));
    tx.commit().unwrap();
    assert_eq!(finished, applied);
    // Every table byte for byte as the one-call push left it; the reaction carries the
    // commit's sequence number, not the host's.
    assert_eq!(snapshot(&mut c), snapshot(&mut reference));
    let seq = applied["commitSeq"].as_i64().unwrap();
    let reaction: (String, String, i64, i64) = {
        let r = c
            .query_one(
                "SELECT source_client_id, source_client_commit_id, source_commit_seq, created_at_ms
                   FROM syncular.sync_reactions WHERE partition = $1 AND idempotency_key = 'r1'",
                &[&P],
            )
            .unwrap();
        (r.get(0), r.get(1), r.get(2), r.get(3))
    };
    assert_eq!(reaction, ("c1".into(), "s1".into(), seq, NOW));
    // A replay answers from the stored result, without staging.
    let replay = try_push(&mut c, "s1", &staged_ops, json!({})).unwrap();
    assert_eq!(replay["outcome"], "cached");
}

#[test]
fn np32_host_rejection_after_staging_stores_only_the_rejection() {
    let (_db, mut c) = prepared("np32_reject");
    let staged_ops = ops(&mut c);
    let before = snapshot(&mut c);
    let mut tx = staged(&mut c, "s2", &staged_ops);
    // The validator refuses: the candidate rows and the staged state go with the savepoint.
    tx.batch_execute("ROLLBACK TO SAVEPOINT syncular_push_candidate")
        .unwrap();
    assert_nothing_staged(probe(&mut tx, |tx| finish(tx, "s2", &json!([]))));
    put_result(&mut tx, "s2", &rejection("s2")).unwrap();
    tx.commit().unwrap();
    assert_eq!(but_result(&snapshot(&mut c), "s2"), before);
    assert_eq!(
        count(
            &mut c,
            "syncular.sync_push_results WHERE client_commit_id = 's2'"
        ),
        1
    );
}

#[test]
fn np32_stage_rules() {
    let (_db, mut c) = prepared("np32_rules");
    let staged_ops = ops(&mut c);
    // Staging needs a transaction block: in autocommit the candidate rows would commit alone.
    expect_error(
        try_stage(&mut c, "s3", &staged_ops, json!({"commitValidator": true})),
        "SY004",
        "sync.storage.invalid_transaction_state",
        Some(json!({"reason": "no_transaction_block"})),
    );
    expect_error(
        c.query_one("SELECT syncular.push_finish($1, 'c1', 's3')", &[&P]),
        "SY004",
        "sync.storage.invalid_transaction_state",
        Some(json!({"reason": "no_transaction_block"})),
    );
    // A terminating operation is rejected natively, in stage mode too (the host commits).
    let before = snapshot(&mut c);
    {
        let mut tx = begin(&mut c, "s4");
        let foreign = up(&mut tx, "tasks", "t7", None, task("t7", "p2"));
        let out = try_stage(&mut tx, "s4", &[foreign], json!({"commitValidator": true})).unwrap();
        assert_error(
            &out,
            0,
            "sync.forbidden",
            "insert denied by scope authorization (§3.4)",
        );
        tx.commit().unwrap();
    }
    assert_eq!(but_result(&snapshot(&mut c), "s4"), before);
    // No hook to run: stage mode applies at once.
    {
        let mut tx = begin(&mut c, "s5");
        let out = try_stage(&mut tx, "s5", &staged_ops, json!({})).unwrap();
        assert_eq!(out["outcome"], "applied", "{out}");
        tx.commit().unwrap();
    }
    // The planner alone stages too; the staged state belongs to one key, and a rollback of the
    // whole transaction leaves nothing.
    let before = snapshot(&mut c);
    {
        let mut tx = begin(&mut c, "s6");
        let op = up(&mut tx, "tasks", "t6", None, task("t6", "p1"));
        let out = try_stage(&mut tx, "s6", &[op], json!({"reactionPlanner": true})).unwrap();
        assert_eq!(out["outcome"], "staged");
        tx.batch_execute("SAVEPOINT other").unwrap();
        let other = tx.query_one("SELECT syncular.push_finish($1, 'c1', 's7')", &[&P]);
        expect_error(
            other,
            "SY000",
            "sync.storage.invalid_argument",
            Some(json!({"argument": "client_commit_id", "reason": "range"})),
        );
        tx.batch_execute("ROLLBACK TO SAVEPOINT other").unwrap();
        // Reactions are checked by the queue's own rules, and a bad one undoes the finish.
        let bad = finish(&mut tx, "s6", &json!([{"type": "x"}]));
        let err = expect_error(bad, "SY000", "sync.storage.invalid_argument", None);
        assert_eq!(
            err.detail.unwrap()["argument"],
            "reactions[0].idempotencyKey"
        );
        tx.rollback().unwrap();
    }
    assert_eq!(snapshot(&mut c), before);
    // After a ROLLBACK nothing is staged either.
    let mut tx = c.transaction().unwrap();
    assert_nothing_staged(finish(&mut tx, "s6", &json!([])));
}

/// Runs `call` inside a savepoint that is rolled back afterwards, so a refusal leaves the
/// transaction usable; returns the call's outcome.
fn probe<T>(
    tx: &mut Transaction<'_>,
    call: impl FnOnce(&mut Transaction<'_>) -> Result<T, postgres::Error>,
) -> Result<T, postgres::Error> {
    tx.batch_execute("SAVEPOINT probe").unwrap();
    let outcome = call(tx);
    tx.batch_execute("ROLLBACK TO SAVEPOINT probe").unwrap();
    outcome
}

fn rejection(identity: &str) -> Value {
    json!({"status": "rejected", "results": [{"opIndex": 0, "status": "error",
        "code": "app.denied", "message": "no", "retryable": false}],
        "recordedAtMs": NOW, "cacheIdentity": identity})
}

fn put_result(
    tx: &mut Transaction<'_>,
    key: &str,
    result: &Value,
) -> Result<Value, postgres::Error> {
    tx.query_one(
        "SELECT syncular.put_push_result($1, 'c1', $2, $3)",
        &[&P, &key, result],
    )
    .map(|r| r.get(0))
}

/// `(commit_seq of every commit of key, the stored result)`.
fn commits_and_result(c: &mut Client, key: &str) -> (Vec<i64>, Option<Value>) {
    let seqs = column(
        c,
        "SELECT commit_seq FROM syncular.sync_commits
          WHERE partition = $1 AND client_id = 'c1' AND client_commit_id = $2 ORDER BY 1",
        &[&P, &key],
    );
    let result = one(
        c,
        "SELECT syncular.get_push_result($1, 'c1', $2)",
        &[&P, &key],
    );
    (seqs, result)
}

const PRIOR_WRITES: &str = "prior_writes";

/// Issue 25 (D8 under stage/finish): while a push is staged its candidate rows stand, so
/// nothing else may append a commit or store a result in that transaction — not a direct push
/// of the same key (it would run over the candidate rows and append a second commit for the
/// key), not a push of another key (its commit would be ordered before rows written after
/// it), not the classic calls (an applied result without the commit, a rejection the finish
/// would contradict). Only `push_finish` or a rollback to the candidate savepoint go on.
#[test]
fn d8_a_staged_push_stands_until_it_is_finished_or_rolled_back() {
    let (_db, mut c) = prepared("d8_stands");
    let staged_ops = ops(&mut c);
    let other = up(&mut c, "tasks", "t8", None, task("t8", "p1"));
    let max: i64 = one(&mut c, "SELECT syncular.max_commit_seq($1)", &[&P]);
    let mut tx = staged(&mut c, "s1", &staged_ops);
    let hooks = json!({"commitValidator": true});
    let refused = |outcome: Result<Value, postgres::Error>, state: &str, detail: Value| {
        let message = match state {
            "SY004" => "sync.storage.invalid_transaction_state",
            _ => "sync.storage.invalid_argument",
        };
        let err = expect_error(outcome, state, message, Some(detail));
        assert!(
            err.hint.is_some_and(|h| h.contains("staged")),
            "a HINT names the staged push"
        );
    };
    let prior = json!({"reason": PRIOR_WRITES});
    // A direct push of the same key, of another key, or a second stage.
    for (key, options) in [
        ("s1", json!({"cacheIdentity": "direct"})),
        ("s8", json!({"cacheIdentity": "s8"})),
        ("s8", staged_options("s8", hooks.clone())),
    ] {
        let ops = if key == "s1" {
            staged_ops.clone()
        } else {
            vec![other.clone()]
        };
        refused(
            probe(&mut tx, |tx| try_push(tx, key, &ops, options)),
            "SY004",
            prior.clone(),
        );
    }
    // The classic calls: an append (of this key or another), an applied or a rejected result.
    for ccid in ["s1", "s8"] {
        let d = doc(ccid, json!([chg("tasks", "t8")]), Some(V));
        let appended = probe(&mut tx, |tx| {
            tx.query_one("SELECT syncular.append_commit($1, $2)", &[&P, &d])
                .map(|r| r.get::<_, i64>(0))
        });
        let err = expect_error(
            appended,
            "SY004",
            "sync.storage.invalid_transaction_state",
            Some(prior.clone()),
        );
        assert!(err.hint.is_some_and(|h| h.contains("staged")));
    }
    refused(
        probe(&mut tx, |tx| put_result(tx, "s1", &rejection("s1"))),
        "SY000",
        json!({"argument": "result.status", "reason": "range"}),
    );
    refused(
        probe(&mut tx, |tx| {
            put_result(tx, "s1", &applied(max + 1, 4, "s1"))
        }),
        "SY000",
        json!({"argument": "result.commitSeq", "reason": "range"}),
    );
    // The finish appends the one commit of the key, and its result names it.
    let finished = finish(&mut tx, "s1", &json!([])).unwrap();
    assert_eq!(finished["commitSeq"], max + 1, "{finished}");
    tx.commit().unwrap();
    let (seqs, result) = commits_and_result(&mut c, "s1");
    assert_eq!(seqs, vec![max + 1]);
    assert_eq!(result.unwrap()["commitSeq"], max + 1);
    assert_eq!(commits_and_result(&mut c, "s8"), (vec![], None));

    // Without push_begin the staged push stands just the same: the rejection is refused until
    // the candidate rows are rolled back, and then stored alone.
    let before_s2 = snapshot(&mut c);
    let mut tx = c.transaction().unwrap();
    tx.batch_execute("SAVEPOINT syncular_push_candidate")
        .unwrap();
    let t2 = up(&mut tx, "tasks", "t2", None, titled("t2", "again"));
    let staged = try_stage(&mut tx, "s2", &[t2], hooks);
    assert_eq!(staged.unwrap()["outcome"], "staged");
    refused(
        probe(&mut tx, |tx| put_result(tx, "s2", &rejection("s2"))),
        "SY000",
        json!({"argument": "result.status", "reason": "range"}),
    );
    tx.batch_execute("ROLLBACK TO SAVEPOINT syncular_push_candidate")
        .unwrap();
    let stored = put_result(&mut tx, "s2", &rejection("s2")).unwrap();
    assert_eq!(stored["status"], "rejected");
    tx.commit().unwrap();
    assert_eq!(but_result(&snapshot(&mut c), "s2"), before_s2);
    assert_eq!(commits_and_result(&mut c, "s2").0, Vec::<i64>::new());
}

#[test]
fn a_transaction_holding_a_staged_push_does_not_commit() {
    // Without a finish or a rollback to its savepoint, COMMIT would land the candidate rows with
    // no commit in the log and no result for the key.
    let (_db, mut c) = prepared("stage_commit");
    let staged_ops = ops(&mut c);
    let before = snapshot(&mut c);
    let tx = staged(&mut c, "s1", &staged_ops);
    let err = sql_error(&tx.commit().expect_err("the commit is refused"));
    assert_eq!(
        (err.state.as_str(), err.message.as_str()),
        ("SY004", "sync.storage.invalid_transaction_state")
    );
    assert_eq!(err.detail, Some(json!({"reason": "staged_push"})));
    assert!(err.hint.is_some_and(|h| h.contains("push_finish")));
    assert_eq!(
        snapshot(&mut c),
        before,
        "nothing of the staged push landed"
    );
    // Rolled back to its savepoint, the same transaction commits (the host's rejection path).
    let mut tx = staged(&mut c, "s1", &staged_ops);
    tx.batch_execute("ROLLBACK TO SAVEPOINT syncular_push_candidate")
        .unwrap();
    tx.commit().unwrap();
}
