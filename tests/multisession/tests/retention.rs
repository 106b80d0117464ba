//! docs/SCENARIOS.md: horizon and pruning (HZN-01 … HZN-10).

use serde_json::{json, Value};
use syncular_multisession::*;

fn commit_at(c: &mut postgres::Client, at: i64) -> i64 {
    let mut d = doc(&fresh_id(), json!([chg("tasks", "t")]), Some(V));
    d["createdAtMs"] = json!(at);
    one(c, "SELECT syncular.append_commit($1, $2)", &[&P, &d])
}

fn touch(c: &mut postgres::Client, epoch: &str) {
    one::<Value>(
        c,
        "SELECT syncular.touch_partition($1, $2, $3)",
        &[&P, &NOW, &epoch],
    );
}

fn put_client(c: &mut postgres::Client, cursor: i64, updated: i64) {
    let record = json!({"clientId":"c1","actorId":"a1","cursor":cursor,"updatedAtMs":updated,"subscriptions":[]});
    c.execute("SELECT syncular.put_client($1, $2)", &[&P, &record])
        .unwrap();
}

fn policy(c: &mut postgres::Client, min_retained: i64) -> Value {
    one(
        c,
        "SELECT syncular.prune_commit_log($1, $2, min_retained_commits => $3)",
        &[&P, &NOW, &min_retained],
    )
}

#[test]
fn hzn_01_horizon_and_prune() {
    let db = TestDb::new("hzn01");
    let mut c = db.connect();
    for i in 0..5 {
        commit_at(&mut c, NOW + i * 1000);
    }
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.horizon_seq($1)", &[&P]),
        0
    );
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.set_horizon_seq($1, 2)", &[&P]),
        2
    );
    touch(&mut c, "e");
    assert_eq!(
        one::<Value>(
            &mut c,
            "SELECT syncular.prune_commits_through($1, 'e', 2)",
            &[&P]
        ),
        json!({"previousHorizonSeq":2,"horizonSeq":2,"removedCommits":2})
    );
    assert_eq!(
        window_seqs(&mut c, P, "tasks", &json!({"project_id":["p1"]}), 0, 5, 10),
        vec![3, 4, 5]
    );
    assert_eq!(
        count(&mut c, "syncular.sync_changes WHERE commit_seq <= 2"),
        0
    );
    assert_eq!(
        count(&mut c, "syncular.sync_change_scopes WHERE commit_seq <= 2"),
        0
    );
    // Repeatable: a retried prune removes nothing.
    assert_eq!(
        one::<Value>(
            &mut c,
            "SELECT syncular.prune_commits_through($1, 'e', 2)",
            &[&P]
        )["removedCommits"],
        json!(0)
    );
}

#[test]
fn hzn_02_commit_seq_before() {
    let db = TestDb::new("hzn02");
    let mut c = db.connect();
    for at in [NOW, NOW + 100, NOW + 200] {
        commit_at(&mut c, at);
    }
    assert_eq!(
        one::<i64>(
            &mut c,
            "SELECT syncular.commit_seq_before($1, $2)",
            &[&P, &(NOW + 150)]
        ),
        2
    );
    assert_eq!(
        one::<i64>(
            &mut c,
            "SELECT syncular.commit_seq_before($1, $2)",
            &[&P, &(NOW - 1)]
        ),
        0
    );
}

#[test]
fn hzn_03_pruning_the_log_never_deletes_pending_reactions() {
    let db = TestDb::new("hzn03");
    let mut c = db.connect();
    let s: i64 = one(
        &mut c,
        "SELECT syncular.append_commit($1, $2)",
        &[&P, &doc("empty", json!([]), Some(V))],
    );
    one::<i32>(
        &mut c,
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&P, &json!([reaction(s, RKEY)])],
    );
    touch(&mut c, "prune-epoch");
    let pruned: Value = one(
        &mut c,
        "SELECT syncular.prune_commits_through($1, 'prune-epoch', $2)",
        &[&P, &s],
    );
    assert_eq!(pruned["removedCommits"], json!(1));
    let r: Value = one(&mut c, "SELECT syncular.get_reaction($1, $2)", &[&P, &RKEY]);
    assert_eq!(
        (r["status"].clone(), r["sourceCommitSeq"].clone()),
        (json!("pending"), json!(1))
    );
}

#[test]
fn hzn_04_cursor_classification_inputs() {
    let db = TestDb::new("hzn04");
    let mut c = db.connect();
    for _ in 0..3 {
        commit_at(&mut c, NOW);
    }
    one::<i64>(&mut c, "SELECT syncular.set_horizon_seq($1, 2)", &[&P]);
    let state: Value = one(&mut c, "SELECT syncular.partition_state($1)", &[&P]);
    assert_eq!(
        (state["maxCommitSeq"].clone(), state["horizonSeq"].clone()),
        (json!(3), json!(2))
    );
    assert_eq!(
        window_seqs(&mut c, P, "tasks", &json!({"project_id":["p1"]}), 2, 3, 10),
        vec![3]
    );
}

#[test]
fn hzn_05_rebootstrap_after_a_prune() {
    let db = TestDb::new("hzn05");
    let mut c = db.connect();
    for (i, id) in ["t1", "t2", "t3"].iter().enumerate() {
        push_upserts(
            &mut c,
            P,
            "c1",
            &format!("k{i}"),
            &[("tasks", id, p1())],
            &json!([]),
        );
    }
    touch(&mut c, "e");
    one::<Value>(
        &mut c,
        "SELECT syncular.prune_commits_through($1, 'e', 3)",
        &[&P],
    );
    assert_eq!(
        scan_ids(&mut c, P, "tasks", &json!({"project_id":["p1"]}), None, 10),
        vec!["t1", "t2", "t3"]
    );
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.max_commit_seq($1)", &[&P]),
        3
    );
}

fn five_commits_touched(c: &mut postgres::Client) {
    for _ in 0..5 {
        commit_at(c, NOW);
    }
    touch(c, "e");
}

#[test]
fn hzn_06_retention_never_passes_an_active_cursor() {
    let db = TestDb::new("hzn06");
    let mut c = db.connect();
    five_commits_touched(&mut c);
    put_client(&mut c, 2, NOW);
    let r = policy(&mut c, 1);
    assert_eq!(
        (r["horizonSeq"].clone(), r["throughSeq"].clone()),
        (json!(2), json!(2))
    );
}

#[test]
fn hzn_07_retention_always_keeps_the_newest_commits() {
    let db = TestDb::new("hzn07");
    let mut c = db.connect();
    five_commits_touched(&mut c);
    put_client(&mut c, 5, NOW);
    assert_eq!(policy(&mut c, 3)["horizonSeq"], json!(2));
}

#[test]
fn hzn_08_inactive_cursors_do_not_hold_retention() {
    let db = TestDb::new("hzn08");
    let mut c = db.connect();
    five_commits_touched(&mut c);
    put_client(&mut c, 1, NOW - 100 * DAY);
    assert_eq!(policy(&mut c, 2)["horizonSeq"], json!(3));
}

#[test]
fn hzn_09_age_forces_pruning_past_an_old_active_cursor() {
    let db = TestDb::new("hzn09");
    let mut c = db.connect();
    touch(&mut c, "e");
    for _ in 0..3 {
        commit_at(&mut c, NOW - 40 * DAY);
    }
    for _ in 0..2 {
        commit_at(&mut c, NOW);
    }
    put_client(&mut c, 1, NOW);
    assert_eq!(policy(&mut c, 1)["horizonSeq"], json!(3));
}

#[test]
fn hzn_10_prune_input_errors() {
    let db = TestDb::new("hzn10");
    let mut c = db.connect();
    expect_error(
        try_one::<Value>(
            &mut c,
            "SELECT syncular.prune_commit_log('never-touched', $1)",
            &[&NOW],
        ),
        "SY031",
        "sync.storage.partition_unregistered",
        None,
    );
    assert_eq!(
        count(
            &mut c,
            "syncular.sync_partitions WHERE partition = 'never-touched'"
        ),
        0
    );
    for (epoch, through) in [("", 1i64), ("e", -1)] {
        expect_error(
            try_one::<Value>(
                &mut c,
                "SELECT syncular.prune_commits_through($1, $2, $3)",
                &[&P, &epoch, &through],
            ),
            "SY032",
            "sync.storage.invalid_prune_cursor",
            None,
        );
    }
    // A wrong epoch changes nothing.
    touch(&mut c, "e");
    commit_at(&mut c, NOW);
    expect_error(
        try_one::<Value>(
            &mut c,
            "SELECT syncular.prune_commits_through($1, 'other', 1)",
            &[&P],
        ),
        "SY030",
        "sync.storage.prune_epoch_mismatch",
        None,
    );
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.horizon_seq($1)", &[&P]),
        0
    );
}

#[test]
fn concurrent_prunes_serialize_and_remove_each_commit_once() {
    let db = TestDb::new("hznconcurrent");
    let mut c = db.connect();
    touch(&mut c, "e");
    for _ in 0..20 {
        commit_at(&mut c, NOW);
    }
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
    let prunes: Vec<_> = [5i64, 10, 15, 10]
        .into_iter()
        .map(|through| {
            let mut s = db.connect();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                one::<Value>(
                    &mut s,
                    "SELECT syncular.prune_commits_through($1, 'e', $2)",
                    &[&P, &through],
                )
            })
        })
        .collect();
    let results: Vec<Value> = prunes.into_iter().map(|p| p.join().unwrap()).collect();
    let removed: i64 = results
        .iter()
        .map(|r| r["removedCommits"].as_i64().unwrap())
        .sum();
    assert_eq!(removed, 15, "{results:?}");
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.horizon_seq($1)", &[&P]),
        15
    );
    assert_eq!(count(&mut c, "syncular.sync_commits"), 5);
    // Each prune reports the horizon it found and the one it left: a chain without overlap.
    let mut steps: Vec<(i64, i64)> = results
        .iter()
        .map(|r| {
            (
                r["previousHorizonSeq"].as_i64().unwrap(),
                r["horizonSeq"].as_i64().unwrap(),
            )
        })
        .collect();
    steps.sort();
    assert_eq!(steps.last().unwrap().1, 15);
}

#[test]
fn a_horizon_past_the_head_is_refused_under_the_lock() {
    // Issue 27, item 5: `prune_commits_through('m5', 'E', 10)` with three commits set the
    // horizon to 10 and the next commit landed at 4, below it (D6).
    let db = TestDb::new("hznpasthead");
    let mut c = db.connect();
    touch(&mut c, "e");
    for _ in 0..3 {
        commit_at(&mut c, NOW);
    }
    let prune = "SELECT syncular.prune_commits_through($1, 'e', $2)";
    let err = try_one::<Value>(&mut c, prune, &[&P, &10i64]).unwrap_err();
    let err = sql_error(&err);
    assert_eq!(
        (err.state.as_str(), err.message.as_str()),
        ("SY032", "sync.storage.invalid_prune_cursor")
    );
    assert!(
        err.hint
            .as_deref()
            .unwrap_or("")
            .contains("newest commit 3"),
        "{err:?}"
    );
    let err = try_one::<i64>(&mut c, "SELECT syncular.set_horizon_seq($1, 4)", &[&P]).unwrap_err();
    assert_eq!(sql_error(&err).state, "SY000");
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.horizon_seq($1)", &[&P]),
        0
    );
    // [MS] The head is the one the lock froze: a prune through 4 waits for a push holding the
    // partition lock with commit 4 appended, and is served once it commits; refused when it
    // rolled back.
    for (end, served) in [("ROLLBACK", false), ("COMMIT", true)] {
        let mut pusher = db.connect();
        exec(&mut pusher, "BEGIN");
        commit_at(&mut pusher, NOW);
        let mut pruner = db.connect();
        let pid = backend_pid(&mut pruner);
        let waiting = std::thread::spawn(move || {
            try_one::<Value>(
                &mut pruner,
                "SELECT syncular.prune_commits_through($1, 'e', 4)",
                &[&P],
            )
            .map_err(|e| sql_error(&e).state)
        });
        wait_until_blocked(&mut c, pid);
        exec(&mut pusher, end);
        let outcome = waiting.join().unwrap();
        if served {
            assert_eq!(outcome.unwrap()["horizonSeq"], json!(4));
        } else {
            assert_eq!(outcome.unwrap_err(), "SY032");
        }
    }
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.horizon_seq($1)", &[&P]),
        4
    );
    assert_eq!(commit_at(&mut c, NOW), 5);
}
