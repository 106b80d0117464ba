//! docs/SCENARIOS.md: the push path (PUSH-01 … PUSH-14).

use postgres::GenericClient;
use serde_json::{json, Value};
use std::thread;
use syncular_multisession::*;

fn get_result(c: &mut impl GenericClient, ccid: &str) -> Result<Option<Value>, postgres::Error> {
    c.query_one(
        "SELECT syncular.get_push_result($1, 'c1', $2)",
        &[&P, &ccid],
    )
    .map(|r| r.get(0))
}

fn begin(tx: &mut impl GenericClient, ccid: &str) -> Result<Option<Value>, postgres::Error> {
    tx.query_one("SELECT syncular.push_begin($1, 'c1', $2, 1)", &[&P, &ccid])
        .map(|r| r.get(0))
}

fn put_result(
    tx: &mut impl GenericClient,
    ccid: &str,
    result: &Value,
) -> Result<Value, postgres::Error> {
    tx.query_one(
        "SELECT syncular.put_push_result($1, 'c1', $2, $3)",
        &[&P, &ccid, result],
    )
    .map(|r| r.get(0))
}

fn rejected(op: i64, code: &str) -> Value {
    json!({"status":"rejected","results":[{"opIndex":op,"status":"error","code":code,
            "message":"diagnostic only","retryable":false}]})
}

fn max_seq(c: &mut postgres::Client) -> i64 {
    one(c, "SELECT syncular.max_commit_seq($1)", &[&P])
}

#[test]
fn push_01_an_insert_is_applied() {
    let db = TestDb::new("push01");
    let mut c = db.connect();
    let stored = push_upserts(&mut c, P, "c1", "k1", &[("tasks", "t1", p1())], &json!([]));
    assert_eq!(stored, applied(1, 1, "k1"));
    assert_eq!(get_result(&mut c, "k1").unwrap(), Some(applied(1, 1, "k1")));
    assert_eq!(count(&mut c, "syncular.sync_row_scopes WHERE tbl = 'tasks' AND var = 'project_id' AND value = 'p1' AND row_id = 't1'"), 1);
    let version: Option<i64> = one(
        &mut c,
        "SELECT row_version FROM syncular.read_commit_window($1, 'tasks', '{\"project_id\":[\"p1\"]}', 0, 1, 10)",
        &[&P],
    );
    assert_eq!(version, Some(1));
}

#[test]
fn push_02_a_rejection_discards_candidates_and_persists_under_one_lock() {
    let db = TestDb::new("push02");
    let mut c = db.connect();
    let mut tx = c.transaction().unwrap();
    assert_eq!(begin(&mut tx, "rejected-aggregate").unwrap(), None);
    tx.batch_execute("SAVEPOINT syncular_push_candidate")
        .unwrap();
    put_row(&mut tx, P, "tasks", "candidate", &p1(), 1, &[1, 2]);
    tx.batch_execute("ROLLBACK TO SAVEPOINT syncular_push_candidate")
        .unwrap();
    let doc = rejected(0, "app.aggregate_rejected");
    assert_eq!(
        put_result(&mut tx, "rejected-aggregate", &doc).unwrap(),
        doc
    );
    tx.commit().unwrap();
    assert_eq!(
        count(&mut c, "public.tasks WHERE \"_sync_row_id\" = 'candidate'"),
        0
    );
    assert_eq!(
        count(
            &mut c,
            "syncular.sync_row_scopes WHERE row_id = 'candidate'"
        ),
        0
    );
    assert_eq!(max_seq(&mut c), 0);
    assert_eq!(get_result(&mut c, "rejected-aggregate").unwrap(), Some(doc));
}

/// PUSH-03 and PUSH-04: a rejected operation leaves only its record and consumes no number.
#[test]
fn push_03_04_a_rejected_operation_leaves_only_its_record_and_no_number() {
    let db = TestDb::new("push03");
    let mut c = db.connect();
    push_upserts(&mut c, P, "c1", "k0", &[("tasks", "t0", p1())], &json!([]));
    let before = max_seq(&mut c);
    let mut tx = c.transaction().unwrap();
    assert_eq!(begin(&mut tx, "k-rej").unwrap(), None);
    tx.batch_execute("SAVEPOINT syncular_push_candidate")
        .unwrap();
    put_row(&mut tx, P, "tasks", "t1", &p1(), 1, &[1]);
    tx.batch_execute(
        "ROLLBACK TO SAVEPOINT syncular_push_candidate; RELEASE SAVEPOINT syncular_push_candidate",
    )
    .unwrap();
    let doc = rejected(1, "app.rule");
    assert_eq!(
        put_result(&mut tx, "k-rej", &doc).unwrap()["results"],
        doc["results"]
    );
    tx.commit().unwrap();
    assert_eq!(
        count(&mut c, "public.tasks WHERE \"_sync_row_id\" = 't1'"),
        0
    );
    assert_eq!(max_seq(&mut c), before);
    assert_eq!(
        get_result(&mut c, "k-rej").unwrap().unwrap()["results"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    // PUSH-04
    let next = push_upserts(&mut c, P, "c1", "k2", &[("tasks", "t2", p1())], &json!([]));
    assert_eq!(next["commitSeq"], json!(before + 1));
}

#[test]
fn push_05_replays() {
    let db = TestDb::new("push05");
    let mut c = db.connect();
    push_upserts(&mut c, P, "c1", "k1", &[("tasks", "t1", p1())], &json!([]));
    assert_eq!(
        get_result(&mut c, "k1").unwrap().unwrap()["commitSeq"],
        json!(1)
    );
    let replay = push_upserts(&mut c, P, "c1", "k1", &[("tasks", "t1", p1())], &json!([]));
    assert_eq!(replay["commitSeq"], json!(1));
    assert_eq!(max_seq(&mut c), 1);
    assert_eq!(
        one::<i64>(
            &mut c,
            "SELECT \"_sync_server_version\" FROM public.tasks WHERE \"_sync_row_id\" = 't1'",
            &[]
        ),
        1
    );
    // A rejected key replays as rejected.
    let mut tx = c.transaction().unwrap();
    begin(&mut tx, "k-rej").unwrap();
    put_result(&mut tx, "k-rej", &rejected(0, "app.rule")).unwrap();
    tx.commit().unwrap();
    let mut tx = c.transaction().unwrap();
    assert_eq!(
        begin(&mut tx, "k-rej").unwrap().unwrap()["status"],
        json!("rejected")
    );
    tx.rollback().unwrap();
    // Same commit id under another client: a different commit.
    let other: Option<Value> = one(
        &mut c,
        "SELECT syncular.get_push_result($1, 'c2', 'k1')",
        &[&P],
    );
    assert_eq!(other, None);
    // Two pushes of k3 in one request: the second push_begin returns the first's result.
    let first = push_upserts(&mut c, P, "c1", "k3", &[("tasks", "t3", p1())], &json!([]));
    let mut tx = c.transaction().unwrap();
    assert_eq!(begin(&mut tx, "k3").unwrap(), Some(first));
}

#[test]
fn push_06_overlapping_deliveries_apply_once() {
    let db = TestDb::new("push06");
    let mut s1 = db.connect();
    let mut s2 = db.connect();
    let mut observer = db.connect();
    assert_eq!(get_result(&mut s1, "k1").unwrap(), None);
    assert_eq!(get_result(&mut s2, "k1").unwrap(), None);
    exec(&mut s1, "BEGIN");
    assert_eq!(begin(&mut s1, "k1").unwrap(), None);
    put_row(&mut s1, P, "tasks", "t1", &p1(), 1, &[1]);
    let d = doc("k1", json!([chg("tasks", "t1")]), Some(V));
    let s: i64 = one(&mut s1, "SELECT syncular.append_commit($1, $2)", &[&P, &d]);
    one::<i32>(
        &mut s1,
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&P, &json!([reaction(s, RKEY)])],
    );
    put_result(&mut s1, "k1", &applied(s, 1, "s1")).unwrap();
    let pid = backend_pid(&mut s2);
    let second = thread::spawn(move || {
        exec(&mut s2, "BEGIN");
        let r = begin(&mut s2, "k1").unwrap();
        exec(&mut s2, "ROLLBACK");
        r
    });
    wait_until_blocked(&mut observer, pid);
    exec(&mut s1, "COMMIT");
    assert_eq!(second.join().unwrap(), Some(applied(1, 1, "s1")));
    assert_eq!(count(&mut observer, "syncular.sync_commits"), 1);
    assert_eq!(max_seq(&mut observer), 1);
    assert_eq!(count(&mut observer, "syncular.sync_reactions"), 1);
    assert_eq!(
        one::<i64>(
            &mut observer,
            "SELECT \"_sync_server_version\" FROM public.tasks",
            &[]
        ),
        1
    );
}

/// PUSH-07 and PUSH-08: the delete path and the tombstone lifecycle.
#[test]
fn push_07_08_delete_path_and_tombstones() {
    let db = TestDb::new("push07");
    let mut c = db.connect();
    put_row(&mut c, P, "tasks", "t1", &p1(), 1, &[1]);
    one::<i32>(
        &mut c,
        "SELECT syncular.set_blob_refs($1, 'tasks', 't1', ARRAY['sha256:aa'])",
        &[&P],
    );
    let mut tx = c.transaction().unwrap();
    begin(&mut tx, "del").unwrap();
    assert_eq!(
        del_row(&mut tx, P, "tasks", "t1"),
        json!({"rowScopes":1,"blobRefs":1})
    );
    let d = doc(
        "del",
        json!([{"table":"tasks","rowId":"t1","op":"delete","scopes":{"project_id":"p1"}}]),
        Some(V),
    );
    let s: i64 = tx
        .query_one("SELECT syncular.append_commit($1, $2)", &[&P, &d])
        .unwrap()
        .get(0);
    put_result(&mut tx, "del", &applied(s, 1, "d")).unwrap();
    tx.commit().unwrap();
    let row = c
        .query_one("SELECT op, row_version, payload, scopes FROM syncular.read_commit_window($1, 'tasks', $2, 0, $3, 10)", &[&P, &json!({"project_id":["p1"]}), &s])
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "delete");
    assert_eq!(row.get::<_, Option<i64>>(1), None);
    assert_eq!(row.get::<_, Option<Vec<u8>>>(2), None);
    assert_eq!(row.get::<_, Value>(3), p1());
    assert_eq!(
        one::<Option<i64>>(
            &mut c,
            "SELECT syncular.get_tombstone_seq($1, 'tasks', 't1')",
            &[&P]
        ),
        Some(s)
    );
    assert!(scan_ids(&mut c, P, "tasks", &json!({"project_id":["p1"]}), None, 10).is_empty());
    assert_eq!(
        one::<Value>(
            &mut c,
            "SELECT syncular.rows_referencing_blob($1, 'sha256:aa')",
            &[&P]
        ),
        json!([])
    );
    // PUSH-08
    let seqs: Vec<(String, i64)> = c
        .query("SELECT row_id, commit_seq FROM syncular.tombstone_seqs($1, 'tasks', ARRAY['t1', 't2', 't1'])", &[&P])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(seqs, vec![("t1".to_string(), s)]);
    assert!(one::<bool>(
        &mut c,
        "SELECT syncular.clear_tombstone($1, 'tasks', 't1')",
        &[&P]
    ));
    assert_eq!(
        one::<Option<i64>>(
            &mut c,
            "SELECT syncular.get_tombstone_seq($1, 'tasks', 't1')",
            &[&P]
        ),
        None
    );
    assert!(!one::<bool>(
        &mut c,
        "SELECT syncular.clear_tombstone($1, 'tasks', 't1')",
        &[&P]
    ));
    let d2 = doc(
        "del2",
        json!([{"table":"tasks","rowId":"t9","op":"delete","scopes":{"project_id":"p1"}}]),
        Some(V),
    );
    let s2: i64 = one(&mut c, "SELECT syncular.append_commit($1, $2)", &[&P, &d2]);
    one::<Value>(
        &mut c,
        "SELECT syncular.touch_partition($1, $2, 'e')",
        &[&P, &NOW],
    );
    one::<Value>(
        &mut c,
        "SELECT syncular.prune_commits_through($1, 'e', $2)",
        &[&P, &s2],
    );
    assert_eq!(
        one::<Option<i64>>(
            &mut c,
            "SELECT syncular.get_tombstone_seq($1, 'tasks', 't9')",
            &[&P]
        ),
        None
    );
}

#[test]
fn push_09_a_constraint_violation_is_stored_as_a_rejection() {
    let db = TestDb::new("push09");
    let mut c = db.connect();
    exec(
        &mut c,
        "CREATE UNIQUE INDEX tasks_unique_data ON public.tasks (\"_sync_partition\", data)",
    );
    exec(&mut c, "INSERT INTO public.tasks (\"_sync_partition\", \"_sync_row_id\", id, data, \"_sync_server_version\", \"_sync_scopes\", \"_sync_payload\")
                  VALUES ('part-1', 't1', 't1', '\\x01', 1, '{\"project_id\":\"p1\"}', '\\x01')");
    let before = max_seq(&mut c);
    let mut tx = c.transaction().unwrap();
    begin(&mut tx, "k-unique").unwrap();
    tx.batch_execute("SAVEPOINT syncular_push_candidate")
        .unwrap();
    let err = tx
        .execute("INSERT INTO public.tasks (\"_sync_partition\", \"_sync_row_id\", id, data, \"_sync_server_version\", \"_sync_scopes\", \"_sync_payload\")
                  VALUES ('part-1', 't2', 't2', '\\x01', 1, '{\"project_id\":\"p1\"}', '\\x01')", &[])
        .unwrap_err();
    assert_eq!(sql_error(&err).state, "23505");
    tx.batch_execute("ROLLBACK TO SAVEPOINT syncular_push_candidate")
        .unwrap();
    let doc = json!({"status":"rejected","results":[{"opIndex":0,"status":"error","code":"sync.constraint_violation",
                     "message":"write violates a relational constraint","retryable":false}]});
    put_result(&mut tx, "k-unique", &doc).unwrap();
    tx.commit().unwrap();
    assert_eq!(get_result(&mut c, "k-unique").unwrap(), Some(doc));
    assert_eq!(max_seq(&mut c), before);
    assert_eq!(
        count(&mut c, "public.tasks WHERE \"_sync_row_id\" = 't2'"),
        0
    );
}

#[test]
fn push_10_an_authoritative_backfill_runs_under_an_idempotency_key() {
    let db = TestDb::new("push10");
    let mut c = db.connect();
    migrate(&mut c, 1, &l1(), &json!([]));
    declare(&mut c, P, "tasks-projection", 1, NOW);
    let owner = claim(&mut c, P, "tasks-projection", 1, NOW);
    let declared = json!([decl(P, "tasks-projection", 1)]);
    exec(&mut c, "BEGIN");
    expect_error(
        try_one::<Option<Value>>(
            &mut c,
            "SELECT syncular.push_begin($1, 'backfill-client', 'backfill-batch-1', 1)",
            &[&P],
        ),
        "SY002",
        "sync.schema_not_ready",
        None,
    );
    exec(&mut c, "ROLLBACK");
    let run_batch = |c: &mut postgres::Client| -> Value {
        let mut tx = c.transaction().unwrap();
        let replay: Option<Value> = tx
            .query_one(
                "SELECT syncular.push_begin($1, 'backfill-client', 'backfill-batch-1', 1, $2)",
                &[&P, &declared],
            )
            .unwrap()
            .get(0);
        if let Some(replay) = replay {
            return replay;
        }
        tx.batch_execute("SAVEPOINT syncular_push_candidate")
            .unwrap();
        let advanced: bool = tx
            .query_one(
                "SELECT syncular.advance_checkpoint($1, 'tasks-projection', $2, 0, 1, $3)",
                &[&P, &owner.5, &NOW],
            )
            .unwrap()
            .get(0);
        assert!(advanced);
        put_row(&mut tx, P, "tasks", "proj-1", &p1(), 1, &[1]);
        let mut d = doc("backfill-batch-1", json!([chg("tasks", "proj-1")]), Some(1));
        d["clientId"] = json!("backfill-client");
        let s: i64 = tx
            .query_one("SELECT syncular.append_commit($1, $2)", &[&P, &d])
            .unwrap()
            .get(0);
        let stored: Value = tx
            .query_one(
                "SELECT syncular.put_push_result($1, 'backfill-client', 'backfill-batch-1', $2)",
                &[&P, &applied(s, 1, "b1")],
            )
            .unwrap()
            .get(0);
        tx.commit().unwrap();
        stored
    };
    assert_eq!(run_batch(&mut c)["commitSeq"], json!(1));
    assert_eq!(
        one::<Option<i64>>(
            &mut c,
            "SELECT writer_version FROM syncular.sync_commits WHERE commit_seq = 1",
            &[]
        ),
        Some(1)
    );
    assert_eq!(
        count(&mut c, "syncular.sync_changes WHERE row_id = 'proj-1'"),
        1
    );
    assert_eq!(
        try_activate(&mut c, P, "tasks-projection", owner.5, 1, &["tasks"], NOW).unwrap(),
        "activated"
    );
    assert_eq!(run_batch(&mut c)["commitSeq"], json!(1));
    assert_eq!(
        count(&mut c, "syncular.sync_changes WHERE row_id = 'proj-1'"),
        1
    );
    assert_eq!(
        read_checkpoint(&mut c, P, "tasks-projection").unwrap().3,
        "activated"
    );
}

#[test]
fn push_11_reactions_follow_their_commit() {
    let db = TestDb::new("push11");
    let mut c = db.connect();
    let planned = |seq: i64| {
        let mut r = reaction(seq, "task:t1");
        r["payload"] = json!({"taskId":"t1"});
        r
    };
    // Accepted.
    let mut tx = c.transaction().unwrap();
    begin(&mut tx, "k1").unwrap();
    let d = doc("k1", json!([chg("tasks", "t1")]), Some(V));
    let s: i64 = tx
        .query_one("SELECT syncular.append_commit($1, $2)", &[&P, &d])
        .unwrap()
        .get(0);
    tx.query_one(
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&P, &json!([planned(s)])],
    )
    .unwrap();
    put_result(&mut tx, "k1", &applied(s, 1, "k1")).unwrap();
    tx.commit().unwrap();
    let r: Value = one(&mut c, "SELECT syncular.get_reaction($1, 'task:t1')", &[&P]);
    assert_eq!(
        (
            r["status"].clone(),
            r["sourceCommitSeq"].clone(),
            r["payload"].clone()
        ),
        (json!("pending"), json!(1), json!({"taskId":"t1"}))
    );
    // A failing enqueue rolls everything back.
    let mut tx = c.transaction().unwrap();
    begin(&mut tx, "k2").unwrap();
    let d = doc("k2", json!([chg("tasks", "t2")]), Some(V));
    let s2: i64 = tx
        .query_one("SELECT syncular.append_commit($1, $2)", &[&P, &d])
        .unwrap()
        .get(0);
    let mut big = reaction(s2, "task:t2");
    big["payload"] = json!({"blob": "x".repeat(70_000)});
    expect_error(
        tx.query_one(
            "SELECT syncular.enqueue_reactions($1, $2)",
            &[&P, &json!([big])],
        ),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument":"reactions[0].payload","reason":"too_large"})),
    );
    tx.rollback().unwrap();
    assert_eq!(max_seq(&mut c), 1);
    assert_eq!(count(&mut c, "syncular.sync_reactions"), 1);
    // The rejection path leaves no reaction.
    let mut tx = c.transaction().unwrap();
    begin(&mut tx, "k3").unwrap();
    tx.batch_execute("SAVEPOINT syncular_push_candidate")
        .unwrap();
    tx.query_one(
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&P, &json!([reaction(1, "task:t3")])],
    )
    .unwrap();
    tx.batch_execute("ROLLBACK TO SAVEPOINT syncular_push_candidate")
        .unwrap();
    put_result(&mut tx, "k3", &rejected(0, "app.rule")).unwrap();
    tx.commit().unwrap();
    assert_eq!(count(&mut c, "syncular.sync_reactions"), 1);
    // A replay enqueues nothing.
    let mut tx = c.transaction().unwrap();
    assert!(begin(&mut tx, "k1").unwrap().is_some());
    tx.rollback().unwrap();
    assert_eq!(count(&mut c, "syncular.sync_reactions"), 1);
}

#[test]
fn push_12_push_begin_preconditions() {
    let db = TestDb::new("push12");
    let mut c = db.connect();
    let code = ("SY004", "sync.storage.invalid_transaction_state");
    expect_error(
        begin(&mut c, "k1"),
        code.0,
        code.1,
        Some(json!({"reason":"no_transaction_block"})),
    );
    exec(&mut c, "BEGIN ISOLATION LEVEL REPEATABLE READ");
    expect_error(
        begin(&mut c, "k1"),
        code.0,
        code.1,
        Some(json!({"reason":"isolation"})),
    );
    exec(&mut c, "ROLLBACK");
}

#[test]
fn push_13_an_unreadable_stored_result() {
    let db = TestDb::new("push13");
    let mut c = db.connect();
    exec(&mut c, "INSERT INTO syncular.sync_push_results VALUES ('part-1', 'c1', 'bad', '\"not json\"'::jsonb)");
    let code = ("SY003", "sync.idempotency_cache_miss");
    expect_error(get_result(&mut c, "bad"), code.0, code.1, None);
    exec(&mut c, "BEGIN");
    expect_error(begin(&mut c, "bad"), code.0, code.1, None);
    exec(&mut c, "ROLLBACK");
    expect_error(
        put_result(&mut c, "bad", &applied(1, 1, "x")),
        code.0,
        code.1,
        None,
    );
    assert_eq!(
        one::<Value>(
            &mut c,
            "SELECT result FROM syncular.sync_push_results WHERE client_commit_id = 'bad'",
            &[]
        ),
        json!("not json")
    );
}

#[test]
fn push_14_results_round_trip_exactly_and_are_stored_as_objects() {
    let db = TestDb::new("push14");
    let mut c = db.connect();
    let doc = json!({"status":"applied","commitSeq":5,"recordedAtMs":NOW,"cacheIdentity":"push-cache-1",
                     "results":[{"opIndex":0,"status":"applied"}]});
    put_result(&mut c, "commit-1", &doc).unwrap();
    assert_eq!(get_result(&mut c, "commit-1").unwrap(), Some(doc));
    assert_eq!(get_result(&mut c, "unknown").unwrap(), None);
    let conflict = json!({"status":"rejected","results":[{"opIndex":0,"status":"conflict","code":"sync.version_conflict",
                          "message":"m","serverVersion":7,"serverRow":"yMnK"}]});
    let stored = put_result(&mut c, "commit-2", &conflict).unwrap();
    assert_eq!(
        stored["results"][0],
        json!({"opIndex":0,"status":"conflict","code":"sync.version_conflict","message":"m","serverVersion":7,"serverRow":"yMnK","conflictColumns":""})
    );
    let mut with_seq = rejected(0, "x");
    with_seq["commitSeq"] = json!(3);
    expect_error(
        put_result(&mut c, "commit-3", &with_seq),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument":"result.commitSeq","reason":"shape"})),
    );
    // Passed as a jsonb string: stored as an object.
    let text = applied(9, 1, "t").to_string();
    one::<Value>(
        &mut c,
        "SELECT syncular.put_push_result($1, 'c1', 'commit-4', to_jsonb($2::text))",
        &[&P, &text],
    );
    assert_eq!(one::<String>(&mut c, "SELECT jsonb_typeof(result) FROM syncular.sync_push_results WHERE client_commit_id = 'commit-4'", &[]), "object");
    // A legacy row stored as a jsonb string holding the JSON text reads back as the object.
    c.execute("INSERT INTO syncular.sync_push_results VALUES ('part-1', 'c1', 'legacy', to_jsonb($1::text))", &[&text]).unwrap();
    assert_eq!(
        get_result(&mut c, "legacy").unwrap(),
        Some(applied(9, 1, "t"))
    );
}
