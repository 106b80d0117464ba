//! Batches of the one-call push keep upstream's statement order (src/push/batch.rs,
//! docs/DESIGN.md §Push path "Batches"): rows of a triggerless table are read up front and
//! upserted one statement per table; whatever a batch cannot attribute (a constraint error, a
//! value PostgreSQL refuses) makes the push run again statement by statement, so the outcome is
//! the one upstream's order gives — the same opIndex, the same error, and a rejection or error
//! before a later operation's fallback.

use postgres::Client;
use serde_json::{json, Value};
use std::sync::Mutex;
use syncular_multisession::native_push::*;
use syncular_multisession::*;

/// One upsert of `tasks` row `t{i}` for each `i` in `1..=n`, at base version `bv`, with the values
/// `values(id, i)`.
fn task_ops(
    c: &mut Client,
    n: usize,
    bv: Option<i64>,
    values: impl Fn(&str, usize) -> Value,
) -> Vec<Op> {
    (1..=n)
        .map(|i| {
            let id = format!("t{i}");
            up(c, "tasks", &id, bv, values(&id, i))
        })
        .collect()
}

/// The DEBUG1 line a push writes when it runs its operations again without batches.
const AGAIN: &str = "runs its operations again without batches";

/// How many times a push ran its operations again, by the notices of the connection.
fn runs_again(notices: &Mutex<Vec<String>>) -> usize {
    notices
        .lock()
        .unwrap()
        .iter()
        .filter(|m| m.contains(AGAIN))
        .count()
}

#[test]
fn a_later_operations_constraint_error_keeps_its_op_index() {
    let (_db, mut c) = with_unique_titles("npb_index");
    let free = up(&mut c, "tasks", "t2", None, titled("t2", "free"));
    let clash = up(&mut c, "tasks", "t3", None, titled("t3", "task"));
    let before = snapshot(&mut c);
    let out = push(&mut c, "k2", &[free, clash]);
    assert_constraint_violation(&out, 1);
    assert_eq!(
        but_result(&snapshot(&mut c), "k2"),
        but_result(&before, "k2")
    );
}

#[test]
fn a_pending_write_fails_before_a_later_delete_frees_its_value() {
    // Statement by statement, op 0 collides with t1's title before op 1 deletes t1.
    let (_db, mut c) = with_unique_titles("npb_delete");
    let clash = up(&mut c, "tasks", "t2", None, titled("t2", "task"));
    let out = push(&mut c, "k2", &[clash, del("tasks", "t1")]);
    assert_constraint_violation(&out, 0);
    assert!(stored(&mut c, "tasks", "t1").is_some());
}

#[test]
fn a_pending_write_fails_before_a_later_fallback() {
    // Op 1 is on a table with a row validator (a fallback), but op 0's write fails first.
    let (_db, mut c) = with_unique_titles("npb_fallback");
    let clash = up(&mut c, "tasks", "t2", None, titled("t2", "task"));
    let doc = up(
        &mut c,
        "docs",
        "d1",
        None,
        json!({"id": "d1", "project_id": "p1", "body": "x"}),
    );
    let out = try_push(
        &mut c,
        "k2",
        &[clash.clone(), doc.clone()],
        json!({"cacheIdentity": "k2", "rowValidatorTables": ["docs"]}),
    )
    .unwrap();
    assert_constraint_violation(&out, 0);
    // Without the collision the fallback stands, and nothing is stored.
    let fine = up(&mut c, "tasks", "t3", None, titled("t3", "fine"));
    let before = snapshot(&mut c);
    let out = try_push(
        &mut c,
        "k3",
        &[fine, doc],
        json!({"rowValidatorTables": ["docs"]}),
    )
    .unwrap();
    assert_eq!(
        out,
        json!({"outcome": "fallback", "reason": "row_validator", "opIndex": 1, "table": "docs"})
    );
    unchanged(&mut c, &before);
}

#[test]
fn values_postgresql_refuses_raise_its_error_with_nothing_written() {
    let (_db, mut c) = with_unique_titles("npb_values");
    let before = snapshot(&mut c);
    // U+0000 in a text column: PostgreSQL's 22021, whichever operation carries it.
    let fine = up(&mut c, "tasks", "t2", None, titled("t2", "fine"));
    // (U+0000 cannot pass through encode_row's jsonb argument: the payload is written by hand,
    // id t3, project p1, title "a\0b", done true.)
    let nul = raw(
        "tasks",
        "t3",
        None,
        &hex("3F30 02000000 7433 02000000 7031 03000000 610062 01"),
    );
    let err = try_push(&mut c, "k2", &[fine.clone(), nul], json!({})).unwrap_err();
    assert_eq!(sql_error(&err).state, "22021");
    // U+0000 escaped in a json column: jsonb's 22P05, raised by the batch, then again by the
    // statement-by-statement run.
    let mut meta = titled("t4", "m");
    meta["meta"] = json!("{\"k\":\"\\u0000\"}");
    let bad_json = up(&mut c, "tasks", "t4", None, meta);
    let err = try_push(&mut c, "k3", &[fine, bad_json], json!({})).unwrap_err();
    assert_eq!(sql_error(&err).state, "22P05");
    unchanged(&mut c, &before);
}

#[test]
fn a_row_touched_twice_sees_its_own_earlier_write() {
    let (_db, mut c) = fixture("npb_twice");
    let insert = up(&mut c, "tasks", "t1", None, task("t1", "p1"));
    let rename = up(
        &mut c,
        "tasks",
        "t1",
        Some(1),
        json!({"id": "t1", "title": "second"}),
    );
    let other = up(&mut c, "tasks", "t2", None, task("t2", "p1"));
    let out = push(&mut c, "k1", &[insert, other, rename]);
    assert_eq!(out["outcome"], "applied", "{out}");
    assert_eq!(stored(&mut c, "tasks", "t1").unwrap().0, 2);
    assert_eq!(stored(&mut c, "tasks", "t2").unwrap().0, 1);
}

#[test]
fn batches_are_used_and_a_failed_batch_is_run_again() {
    let db = TestDb::new("npb_used");
    let (mut c, notices) = db.connect_with_notices();
    setup(&mut c);
    unique_titles(&mut c);
    exec(&mut c, "SET client_min_messages = debug1");
    let rows = task_ops(&mut c, 5, None, |id, i| titled(id, &format!("n{i}")));
    assert_eq!(push(&mut c, "k1", &rows)["outcome"], "applied");
    let updates = task_ops(&mut c, 5, Some(1), |id, _| json!({"id": id, "done": true}));
    assert_eq!(push(&mut c, "k2", &updates)["outcome"], "applied");
    assert_eq!(runs_again(&notices), 0, "{:?}", notices.lock().unwrap());
    let single = up(&mut c, "tasks", "t7", None, titled("t7", "n1"));
    assert_constraint_violation(&push(&mut c, "k5", &[single]), 0);
    assert_eq!(runs_again(&notices), 0);
    // A batch of one row is written by the single statement: the batch needs two.
    let fine = up(&mut c, "tasks", "t10", None, titled("t10", "n10"));
    let clash = up(&mut c, "tasks", "t9", None, titled("t9", "n3"));
    assert_constraint_violation(&push(&mut c, "k3", &[fine.clone(), clash]), 1);
    assert_eq!(runs_again(&notices), 1);
    // A table a trigger can fire on is written one statement at a time from the start.
    exec(&mut c, "CREATE FUNCTION public.np_noop() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NEW; END$$;
                  CREATE TRIGGER np_noop BEFORE INSERT ON public.np_tasks FOR EACH ROW EXECUTE FUNCTION public.np_noop()");
    let clash = up(&mut c, "tasks", "t8", None, titled("t8", "n3"));
    assert_constraint_violation(&push(&mut c, "k4", &[fine, clash]), 1);
    assert_eq!(runs_again(&notices), 1);
}

#[test]
fn a_lock_timeout_in_a_batch_ends_the_call_without_a_second_run() {
    let db = TestDb::new("npb_timeout");
    let (mut c, notices) = db.connect_with_notices();
    setup(&mut c);
    let rows = task_ops(&mut c, 2, None, |id, _| task(id, "p1"));
    assert_eq!(push(&mut c, "k1", &rows)["outcome"], "applied");
    // Another session holds t2's row lock; the batch's upsert waits for it until lock_timeout.
    let mut holder = db.connect();
    exec(
        &mut holder,
        "BEGIN; SELECT 1 FROM public.np_tasks WHERE \"_sync_row_id\" = 't2' FOR UPDATE",
    );
    exec(
        &mut c,
        "SET client_min_messages = debug1; SET lock_timeout = '300ms'",
    );
    let updates = task_ops(&mut c, 2, None, |id, _| json!({"id": id, "done": true}));
    let err = try_push(&mut c, "k2", &updates, json!({})).unwrap_err();
    assert_eq!(sql_error(&err).state, "55P03");
    assert_eq!(runs_again(&notices), 0, "{:?}", notices.lock().unwrap());
    exec(&mut holder, "ROLLBACK");
    assert_eq!(
        count(
            &mut c,
            "syncular.sync_push_results WHERE client_commit_id = 'k2'"
        ),
        0
    );
}
