//! docs/SCENARIOS.md: backfill checkpoints (CKP-01 … CKP-16).

use serde_json::{json, Value};
use std::thread;
use syncular_multisession::*;

const TP: &str = "tasks-projection";

fn advance(
    c: &mut postgres::Client,
    p: &str,
    name: &str,
    epoch: i64,
    wm: i64,
    rows: i64,
    now: i64,
) -> bool {
    one(
        c,
        "SELECT syncular.advance_checkpoint($1, $2, $3, $4, $5, $6)",
        &[&p, &name, &epoch, &wm, &rows, &now],
    )
}

fn above(c: &mut postgres::Client, p: &str, tables: &[&str], seq: i64) -> String {
    let tables: Vec<String> = tables.iter().map(|t| t.to_string()).collect();
    one(
        c,
        "SELECT syncular.has_source_changes_above($1, $2, $3)",
        &[&p, &tables, &seq],
    )
}

fn coverage(c: &mut postgres::Client, p: &str, tables: &[&str]) -> i64 {
    let tables: Vec<String> = tables.iter().map(|t| t.to_string()).collect();
    one(
        c,
        "SELECT syncular.source_coverage_seq($1, $2)",
        &[&p, &tables],
    )
}

fn touch(c: &mut postgres::Client, p: &str, epoch: &str) {
    one::<serde_json::Value>(
        c,
        "SELECT syncular.touch_partition($1, $2, $3)",
        &[&p, &NOW, &epoch],
    );
}

fn prune_through(c: &mut postgres::Client, p: &str, epoch: &str, seq: i64) -> serde_json::Value {
    one(
        c,
        "SELECT syncular.prune_commits_through($1, $2, $3)",
        &[&p, &epoch, &seq],
    )
}

#[test]
fn ckp_01_concurrent_claims_get_distinct_epochs() {
    let db = TestDb::new("ckp01");
    let mut c = db.connect();
    raw_checkpoint(&mut c, P, TP, 7, "declared");
    // S1 holds its claim open while S2's claim waits on the row lock.
    let mut s1 = db.connect();
    exec(&mut s1, "BEGIN");
    let first = claim(&mut s1, P, TP, 7, NOW + 1);
    let mut s2 = db.connect();
    let pid = backend_pid(&mut s2);
    let waiter = thread::spawn(move || claim(&mut s2, P, TP, 7, NOW + 2));
    wait_until_blocked(&mut c, pid);
    exec(&mut s1, "COMMIT");
    let second = waiter.join().unwrap();
    let mut epochs = vec![first.5, second.5];
    epochs.sort();
    assert_eq!(epochs, vec![1, 2]);
    assert_eq!(
        (first.3.as_str(), second.3.as_str()),
        ("backfilling", "backfilling")
    );
    let rows: Vec<CheckpointRow> = c
        .query("SELECT * FROM syncular.read_checkpoints($1)", &[&P])
        .unwrap()
        .iter()
        .map(checkpoint_row)
        .collect();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].5, rows[0].3.as_str()), (2, "backfilling"));
    expect_error(
        try_checkpoint_call(
            &mut c,
            "syncular.claim_checkpoint($1, 'absent', 7, $2)",
            &[&P, &NOW],
        ),
        "SY010",
        "sync.storage.checkpoint_not_declared",
        Some(json!({"partition":"part-1","projection":"absent"})),
    );
}

#[test]
fn ckp_02_a_superseded_epoch_cannot_advance() {
    let db = TestDb::new("ckp02");
    let mut c = db.connect();
    raw_checkpoint(&mut c, P, "p", 1, "declared");
    let stale = claim(&mut c, P, "p", 1, NOW + 1);
    let winner = claim(&mut c, P, "p", 1, NOW + 2);
    assert_eq!(winner.5, stale.5 + 1);
    let before = read_checkpoint(&mut c, P, "p");
    assert!(!advance(&mut c, P, "p", stale.5, 9, 3, NOW + 3));
    assert_eq!(read_checkpoint(&mut c, P, "p"), before);
    assert!(advance(&mut c, P, "p", winner.5, 9, 3, NOW + 4));
    let row = read_checkpoint(&mut c, P, "p").unwrap();
    assert_eq!(
        (row.4, row.6, row.7, row.3.as_str()),
        (9, 3, NOW + 4, "backfilling")
    );
}

#[test]
fn ckp_03_source_coverage_ignores_non_source_tables() {
    let db = TestDb::new("ckp03");
    let mut c = db.connect();
    let s1 = append(&mut c, P, "tasks", "t1", Some(V));
    let s2 = append(&mut c, P, "docs", "d1", Some(V));
    assert_eq!(s2, s1 + 1);
    assert_eq!(coverage(&mut c, P, &["tasks"]), s1);
    assert_eq!(coverage(&mut c, P, &["docs"]), s2);
    assert_eq!(coverage(&mut c, P, &["tasks", "docs"]), s2);
    assert_eq!(coverage(&mut c, P, &[]), 0);
    append(&mut c, P, "docs", "d2", Some(V));
    assert_eq!(above(&mut c, P, &["tasks"], s1), "clean");
    assert_eq!(above(&mut c, P, &["docs"], s1), "changed");
    assert_eq!(above(&mut c, P, &["tasks"], s2), "clean");
    assert_eq!(above(&mut c, P, &["tasks"], 0), "changed");
}

#[test]
fn ckp_04_a_pruned_window_is_unverifiable_never_clean() {
    let db = TestDb::new("ckp04");
    let mut c = db.connect();
    touch(&mut c, P, "epoch");
    let s1 = append(&mut c, P, "tasks", "t1", Some(V));
    assert_eq!(above(&mut c, P, &["tasks"], 0), "changed");
    prune_through(&mut c, P, "epoch", s1);
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.horizon_seq($1)", &[&P]),
        s1
    );
    assert_eq!(above(&mut c, P, &["tasks"], 0), "unverifiable");
    assert_eq!(above(&mut c, P, &["tasks"], s1), "clean");
    assert_eq!(above(&mut c, P, &[], 0), "clean");
    assert_eq!(coverage(&mut c, P, &["tasks"]), 0);
}

#[test]
fn ckp_05_a_pruned_window_never_activates() {
    let db = TestDb::new("ckp05");
    let mut c = db.connect();
    touch(&mut c, P, "epoch");
    let s = append(&mut c, P, "tasks", "t1", Some(V));
    prune_through(&mut c, P, "epoch", s);
    declare(&mut c, P, TP, V, NOW);
    let owner = claim(&mut c, P, TP, V, NOW);
    assert_eq!(
        try_activate(&mut c, P, TP, owner.5, 0, &["tasks"], NOW).unwrap(),
        "unverifiable"
    );
    let row = read_checkpoint(&mut c, P, TP).unwrap();
    assert_eq!((row.3.as_str(), row.4), ("backfilling", 0));
}

#[test]
fn ckp_06_a_superseded_owner_cannot_activate() {
    let db = TestDb::new("ckp06");
    let mut c = db.connect();
    let s = append(&mut c, P, "tasks", "t1", Some(V));
    declare(&mut c, P, TP, V, NOW);
    let stale = claim(&mut c, P, TP, V, NOW);
    let owner = claim(&mut c, P, TP, V, NOW);
    assert_eq!(
        try_activate(&mut c, P, TP, stale.5, s, &["tasks"], NOW + 1).unwrap(),
        "stale"
    );
    assert!(!advance(&mut c, P, TP, stale.5, 999, 1, NOW + 1));
    let row = read_checkpoint(&mut c, P, TP).unwrap();
    assert_eq!((row.3.as_str(), row.4), ("backfilling", 0));
    assert_eq!(
        try_activate(&mut c, P, TP, owner.5, s, &["tasks"], NOW + 2).unwrap(),
        "activated"
    );
    let row = read_checkpoint(&mut c, P, TP).unwrap();
    assert_eq!((row.3.as_str(), row.4, row.7), ("activated", s, NOW + 2));
}

#[test]
fn ckp_07_activation_requires_a_sufficient_fence() {
    let db = TestDb::new("ckp07");
    let mut c = db.connect();
    raw_checkpoint(&mut c, P, TP, V, "declared");
    let owner = claim(&mut c, P, TP, V, NOW);
    let missing = |required: serde_json::Value| json!({"partition":"part-1","projection":TP,"schemaVersion":1,"requiredWriterVersion":required});
    expect_error(
        try_activate(&mut c, P, TP, owner.5, 0, &["tasks"], NOW),
        "SY011",
        "sync.storage.checkpoint_fence_missing",
        Some(missing(json!(null))),
    );
    set_fence(&mut c, P, 0);
    expect_error(
        try_activate(&mut c, P, TP, owner.5, 0, &["tasks"], NOW),
        "SY011",
        "sync.storage.checkpoint_fence_missing",
        Some(missing(json!(0))),
    );
    set_fence(&mut c, P, 1);
    assert_eq!(
        try_activate(&mut c, P, TP, owner.5, 0, &["tasks"], NOW).unwrap(),
        "activated"
    );
}

#[test]
fn ckp_08_a_superseded_batch_lands_nothing() {
    let db = TestDb::new("ckp08");
    let mut c = db.connect();
    declare(&mut c, P, TP, V, NOW);
    let stale = claim(&mut c, P, TP, V, NOW);
    let owner = claim(&mut c, P, TP, V, NOW);
    let declared = json!([decl(P, TP, 1)]);
    let mut tx = c.transaction().unwrap();
    let replay: Option<serde_json::Value> = tx
        .query_one(
            "SELECT syncular.push_begin($1, 'backfill-client', 'batch-stale', $2, $3)",
            &[&P, &V, &declared],
        )
        .unwrap()
        .get(0);
    assert_eq!(replay, None);
    tx.batch_execute("SAVEPOINT syncular_push_candidate")
        .unwrap();
    let advanced: bool = tx
        .query_one(
            "SELECT syncular.advance_checkpoint($1, $2, $3, 0, 1, $4)",
            &[&P, &TP, &stale.5, &(NOW + 1)],
        )
        .unwrap()
        .get(0);
    assert!(!advanced);
    tx.rollback().unwrap();
    assert_eq!(
        count(&mut c, "public.tasks WHERE \"_sync_row_id\" = 'proj-stale'"),
        0
    );
    assert_eq!(count(&mut c, "syncular.sync_commits"), 0);
    assert_eq!(count(&mut c, "syncular.sync_push_results"), 0);
    let row = read_checkpoint(&mut c, P, TP).unwrap();
    assert_eq!((row.3.as_str(), row.4, row.5), ("backfilling", 0, owner.5));
}

#[test]
fn ckp_09_redeclaring_at_the_same_version_changes_nothing() {
    let db = TestDb::new("ckp09");
    let mut c = db.connect();
    declare(&mut c, P, "x", V, NOW);
    let claimed = claim(&mut c, P, "x", V, NOW + 1);
    let again = declare(&mut c, P, "x", V, NOW + 5);
    assert_eq!(again, claimed);
    assert_eq!((again.3.as_str(), again.7), ("backfilling", NOW + 1));
    assert_eq!(fence_of(&mut c, P), Some(V));
}

#[test]
fn ckp_10_claim_at_another_version_is_refused() {
    let db = TestDb::new("ckp10");
    let mut c = db.connect();
    declare(&mut c, P, "x", 2, NOW);
    expect_error(
        try_checkpoint_call(
            &mut c,
            "syncular.claim_checkpoint($1, 'x', 3, $2)",
            &[&P, &(NOW + 1)],
        ),
        "SY012",
        "sync.storage.checkpoint_version_mismatch",
        Some(
            json!({"partition":"part-1","projection":"x","storedSchemaVersion":2,"requestedSchemaVersion":3}),
        ),
    );
    let row = read_checkpoint(&mut c, P, "x").unwrap();
    assert_eq!((row.3.as_str(), row.5, row.2), ("declared", 0, 2));
    let pending = |c: &mut postgres::Client, v: i64| -> serde_json::Value {
        one::<serde_json::Value>(c, "SELECT syncular.read_serve_gate($1, $2)", &[&P, &v])["pending"]
            .clone()
    };
    assert_eq!(
        pending(&mut c, 2),
        json!([{"partition":"part-1","name":"x"}])
    );
    assert_eq!(pending(&mut c, 3), json!([]));
}

#[test]
fn ckp_11_declare_at_another_version_is_refused() {
    let db = TestDb::new("ckp11");
    let mut c = db.connect();
    let original = declare(&mut c, P, "x", 2, NOW);
    expect_error(
        try_checkpoint_call(
            &mut c,
            "syncular.declare_checkpoint($1, 'x', 3, $2)",
            &[&P, &(NOW + 1)],
        ),
        "SY012",
        "sync.storage.checkpoint_version_mismatch",
        Some(
            json!({"partition":"part-1","projection":"x","storedSchemaVersion":2,"requestedSchemaVersion":3}),
        ),
    );
    assert_eq!(read_checkpoint(&mut c, P, "x"), Some(original));
    assert_eq!(fence_of(&mut c, P), Some(2));
}

#[test]
fn ckp_12_advance_after_activation_changes_nothing() {
    let db = TestDb::new("ckp12");
    let mut c = db.connect();
    declare(&mut c, P, "x", V, NOW);
    let owner = claim(&mut c, P, "x", V, NOW);
    assert_eq!(
        try_activate(&mut c, P, "x", owner.5, 0, &[], NOW + 1).unwrap(),
        "activated"
    );
    assert!(!advance(&mut c, P, "x", owner.5, 5, 5, NOW + 2));
    let row = read_checkpoint(&mut c, P, "x").unwrap();
    assert_eq!(
        (row.3.as_str(), row.4, row.6, row.7),
        ("activated", 0, 0, NOW + 1)
    );
}

#[test]
fn ckp_13_activation_of_a_missing_checkpoint_leaves_no_partition_row() {
    let db = TestDb::new("ckp13");
    let mut c = db.connect();
    let partition_rows = |c: &mut postgres::Client, p: &str| {
        count(
            c,
            &format!("syncular.sync_partitions WHERE partition = '{p}'"),
        )
    };
    expect_error(
        try_activate(&mut c, "fresh", "nope", 0, 0, &["tasks"], NOW),
        "SY010",
        "sync.storage.checkpoint_not_declared",
        Some(json!({"partition":"fresh","projection":"nope"})),
    );
    assert_eq!(partition_rows(&mut c, "fresh"), 0);
    declare(&mut c, "fresh2", "x", V, NOW);
    assert_eq!(
        try_activate(&mut c, "fresh2", "x", 99, 0, &["tasks"], NOW).unwrap(),
        "stale"
    );
    assert_eq!(partition_rows(&mut c, "fresh2"), 0);
    raw_checkpoint(&mut c, "fresh3", "y", V, "declared");
    expect_error(
        try_activate(&mut c, "fresh3", "y", 0, 0, &["tasks"], NOW),
        "SY011",
        "sync.storage.checkpoint_fence_missing",
        None,
    );
    assert_eq!(partition_rows(&mut c, "fresh3"), 0);
    assert_eq!(
        try_activate(&mut c, "fresh2", "x", 0, 0, &["tasks"], NOW).unwrap(),
        "activated"
    );
    assert_eq!(partition_rows(&mut c, "fresh2"), 0);
}

#[test]
fn ckp_14_a_concurrent_prune_never_yields_clean() {
    let db = TestDb::new("ckp14");
    let mut s1 = db.connect();
    let mut s2 = db.connect();
    touch(&mut s1, P, "epoch");
    let s = append(&mut s1, P, "tasks", "t1", Some(V));
    exec(&mut s2, "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1");
    prune_through(&mut s1, P, "epoch", s);
    assert_eq!(above(&mut s2, P, &["tasks"], 0), "changed");
    exec(&mut s2, "COMMIT");
    assert_eq!(above(&mut s2, P, &["tasks"], 0), "unverifiable");
}

#[test]
fn ckp_15_an_advance_before_push_begin_does_not_deadlock_with_an_activation() {
    let db = TestDb::new("ckp15");
    let mut c = db.connect();
    declare(&mut c, P, "x", V, NOW);
    let owner = claim(&mut c, P, "x", V, NOW);
    let mut s1 = db.connect();
    exec(&mut s1, "BEGIN");
    assert!(advance(&mut s1, P, "x", owner.5, 0, 1, NOW));
    let mut s2 = db.connect();
    let pid = backend_pid(&mut s2);
    let epoch = owner.5;
    let activation = thread::spawn(move || {
        try_activate(&mut s2, P, "x", epoch, 0, &["tasks"], NOW).map_err(|e| sql_error(&e))
    });
    wait_until_blocked(&mut c, pid);
    let declared = json!([decl(P, "x", 1)]);
    let replay: Option<serde_json::Value> = one(
        &mut s1,
        "SELECT syncular.push_begin($1, 'bf', 'b1', $2, $3)",
        &[&P, &V, &declared],
    );
    assert_eq!(replay, None);
    let mut docs_change = chg("docs", "d1");
    docs_change["scopes"] = json!({"org_id":"o1","project_id":"p1"});
    let d = doc("b1", json!([docs_change]), Some(V));
    let s: i64 = one(&mut s1, "SELECT syncular.append_commit($1, $2)", &[&P, &d]);
    let result =
        json!({"status":"applied","commitSeq":s,"results":[{"opIndex":0,"status":"applied"}]});
    one::<serde_json::Value>(
        &mut s1,
        "SELECT syncular.put_push_result($1, 'bf', 'b1', $2)",
        &[&P, &result],
    );
    exec(&mut s1, "COMMIT");
    assert_eq!(activation.join().unwrap(), Ok("activated".to_string()));
    let row = read_checkpoint(&mut c, P, "x").unwrap();
    assert_eq!((row.3.as_str(), row.4, row.6), ("activated", 0, 1));
}

#[test]
fn ckp_16_read_checkpoints_order_and_shape() {
    let db = TestDb::new("ckp16");
    let mut c = db.connect();
    declare(&mut c, P, "b", V, NOW);
    declare(&mut c, P, "a", V, NOW);
    declare(&mut c, "other", "c", V, NOW);
    let rows = c
        .query("SELECT * FROM syncular.read_checkpoints($1)", &[&P])
        .unwrap();
    let columns: Vec<&str> = rows[0].columns().iter().map(|c| c.name()).collect();
    assert_eq!(
        columns,
        vec![
            "partition",
            "name",
            "schema_version",
            "state",
            "watermark",
            "owner_epoch",
            "observed_rows",
            "updated_at_ms"
        ]
    );
    let names: Vec<String> = rows.iter().map(|r| r.get(1)).collect();
    assert_eq!(names, vec!["a", "b"]);
}

/// The gate's pending checkpoints are read below SQL (issue 28; docs/DESIGN.md §Serve gate):
/// every checkpoint at the running version not activated, ordered by partition, then name, in
/// byte order (gap B9) — the same list the statement it replaced returns, for every version.
#[test]
fn the_gate_lists_what_its_statement_listed_in_the_same_order() {
    let db = TestDb::new("ckp_order");
    let mut c = db.connect();
    let partitions = ["b", "a", "B", "a-1", "é", "A"];
    let names = ["y", "x", "Y", "x2"];
    for (i, p) in partitions.iter().enumerate() {
        for (j, name) in names.iter().enumerate() {
            declare(&mut c, p, name, 1 + ((i + j) % 2) as i64, NOW);
        }
    }
    exec(
        &mut c,
        "UPDATE syncular.sync_backfill_checkpoints SET state = 'activated'
          WHERE (partition, name) IN (('a', 'x'), ('B', 'Y'), ('é', 'x2'))",
    );
    for v in 1..=3i64 {
        let listed: Value = one(
            &mut c,
            "SELECT coalesce(jsonb_agg(jsonb_build_object('partition', c.partition, 'name', c.name)
                                       ORDER BY c.partition, c.name), '[]')
               FROM syncular.sync_backfill_checkpoints c
              WHERE c.schema_version = $1 AND c.state <> 'activated'",
            &[&v],
        );
        for p in ["a", "zz"] {
            let gate: Value = one(&mut c, "SELECT syncular.read_serve_gate($1, $2)", &[&p, &v]);
            assert_eq!(gate["pending"], listed, "version {v}, partition {p}");
        }
    }
    let gate: Value = one(&mut c, "SELECT syncular.read_serve_gate('a', 2)", &[]);
    assert_eq!(gate["pending"].as_array().map(Vec::len), Some(11), "{gate}");
}
