//! The one-call push (docs/API.md `push_commit`, docs/DESIGN.md §Push path): the scenarios
//! NP-xx of the native-push contract, with real sessions for the [MS] ones, and the differential
//! test NP-35 against a test-side host that drives the classic multi-call path.

use postgres::Client;
use serde_json::{json, Value};
use std::slice::from_ref;
use syncular_multisession::native_push::*;
use syncular_multisession::rng::Rng;
use syncular_multisession::*;

/// A fresh fixture database with row `t1` of project `p1` inserted by commit `k1`.
fn with_t1(name: &str) -> (TestDb, Client) {
    let (db, mut c) = fixture(name);
    let insert = up(&mut c, "tasks", "t1", None, task("t1", "p1"));
    push(&mut c, "k1", &[insert]);
    (db, c)
}

/// Upstream's E3 edit of `t1`: done and priority at baseVersion 2.
fn e3(c: &mut Client) -> Op {
    up(
        c,
        "tasks",
        "t1",
        Some(2),
        json!({"id": "t1", "done": true, "priority": 300}),
    )
}

/// `(title, done, priority)` of the one `tasks` row, read from its projected columns.
fn projection(c: &mut Client) -> (String, bool, Option<i64>) {
    let r = c
        .query_one("SELECT title, done, priority FROM public.np_tasks", &[])
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

#[test]
fn np01_insert_is_applied_with_upstreams_bytes() {
    let (_db, mut c) = fixture("np01");
    let op = up(&mut c, "tasks", "t1", None, task("t1", "p1"));
    assert_eq!(
        op.payload.as_deref().unwrap(),
        hex("3F 30 02000000 7431 02000000 7031 04000000 7461736B 00")
    );
    let out = push(&mut c, "k1", &[op]);
    assert_eq!(
        out,
        json!({"outcome": "applied", "replayed": false, "commitSeq": 1,
               "result": {"status": "applied", "commitSeq": 1, "results": [{"opIndex": 0, "status": "applied"}],
                          "recordedAtMs": NOW, "cacheIdentity": "k1"}})
    );
    assert_eq!(
        stored(&mut c, "tasks", "t1"),
        Some((
            1,
            "30020000007431020000007031040000007461736b00".into(),
            None
        ))
    );
    let scopes: Value = one(&mut c, "SELECT \"_sync_scopes\" FROM public.np_tasks", &[]);
    assert_eq!(scopes, json!({"project_id": "p1"}));
    assert_eq!(projection(&mut c), ("task".into(), false, None));
    assert_eq!(
        count(
            &mut c,
            "syncular.sync_row_scopes WHERE var = 'project_id' AND value = 'p1' AND row_id = 't1'"
        ),
        1
    );
    let change: (i64, i16, Option<i64>, Value) = {
        let r = c
            .query_one(
                "SELECT commit_seq, op, row_version, scopes FROM syncular.sync_changes",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1), r.get(2), r.get(3))
    };
    assert_eq!(change, (1, 1, Some(1), json!({"project_id": "p1"})));
    let writer: Option<i64> = one(
        &mut c,
        "SELECT writer_version FROM syncular.sync_commits",
        &[],
    );
    assert_eq!(writer, Some(V));
}

#[test]
fn np02_np03_np04_updates_write_column_versions() {
    let (_db, mut c) = with_t1("np02");
    // NP-03: E2 (title only), then E3 (done, priority at baseVersion 2).
    let e2 = e2(&mut c);
    assert_eq!(
        e2.payload.as_deref().unwrap(),
        hex("05 00 02000000 7431 02000000 7632")
    );
    push(&mut c, "k2", &[e2]);
    assert_eq!(
        stored(&mut c, "tasks", "t1"),
        Some((
            2,
            "30020000007431020000007031020000007632".to_string() + "00",
            Some("0202".into())
        ))
    );
    let e3 = e3(&mut c);
    push(&mut c, "k3", &[e3]);
    assert_eq!(
        stored(&mut c, "tasks", "t1"),
        Some((
            3,
            "2002000000743102000000703102000000763201".to_string() + "2c01000000000000",
            Some("020203030403".into())
        ))
    );
    assert_eq!(projection(&mut c), ("v2".into(), true, Some(300)));
    // NP-02: a LWW full update of a fresh v1 row.
    let t2 = up(&mut c, "tasks", "t2", None, task("t2", "p1"));
    push(&mut c, "k4", &[t2]);
    let lww = up(&mut c, "tasks", "t2", None, task("t2", "p1"));
    push(&mut c, "k5", from_ref(&lww));
    assert_eq!(
        stored(&mut c, "tasks", "t2").unwrap().2.as_deref(),
        Some("01020202030204020502")
    );
    // NP-04: the identical payload under a new commit id is a new commit.
    let out = push(&mut c, "k6", &[lww]);
    assert_eq!(out["commitSeq"], json!(6));
    assert_eq!(stored(&mut c, "tasks", "t2").unwrap().0, 3);
    assert_eq!(count(&mut c, "syncular.sync_row_scopes"), 2);
}

#[test]
fn np05_np07_np08_np09_np10_conflicts_and_versions() {
    let (_db, mut c) = with_t1("np05");
    let e2 = e2(&mut c);
    push(&mut c, "k2", &[e2]);
    let e3 = e3(&mut c);
    push(&mut c, "k3", &[e3]);
    let before = snapshot(&mut c);
    // NP-05: bv 1 on {id, title} of the v3 row.
    let title = |c: &mut Client, bv| up(c, "tasks", "t1", bv, json!({"id": "t1", "title": "x"}));
    let op = title(&mut c, Some(1));
    let out = push(&mut c, "k4", &[op]);
    assert_eq!(
        record(&out),
        &json!({"opIndex": 0, "status": "conflict", "code": "sync.version_conflict",
                "message": "present columns moved past baseVersion (§6.2)", "serverVersion": 3,
                "serverRow": "IAIAAAB0MQIAAABwMQIAAAB2MgEsAQAAAAAAAA==", "conflictColumns": "BA=="})
    );
    let max: i64 = one(&mut c, "SELECT syncular.max_commit_seq($1)", &[&P]);
    assert_eq!(max, 3);
    assert_eq!(
        but_result(&snapshot(&mut c), "k4"),
        but_result(&before, "k4")
    );
    // NP-07: bv 0 on an existing row marks every present column but the key.
    let full = up(&mut c, "tasks", "t1", Some(0), task("t1", "p1"));
    assert_eq!(
        record(&push(&mut c, "k5", &[full]))["conflictColumns"],
        "Pg=="
    );
    // NP-08: bv above the stored version.
    let op = title(&mut c, Some(4));
    assert_error(
        &push(&mut c, "k6", &[op]),
        0,
        "sync.invalid_request",
        "baseVersion exceeds the stored server version (§6.2)",
    );
    // NP-09: a negative bv marks the key too; on an absent row it is row_missing.
    let op = title(&mut c, Some(-1));
    assert_eq!(
        record(&push(&mut c, "k7", &[op]))["conflictColumns"],
        "BQ=="
    );
    let op = up(&mut c, "tasks", "t9", Some(-1), task("t9", "p1"));
    assert_error(
        &push(&mut c, "k8", &[op]),
        0,
        "sync.row_missing",
        "upsert with baseVersion targets an absent row (§6.2)",
    );
    // bv 2 on {id, title}: applied at v4 (2.5 of the contract).
    let op = title(&mut c, Some(2));
    assert_eq!(push(&mut c, "k9", &[op])["outcome"], "applied");
    assert_eq!(stored(&mut c, "tasks", "t1").unwrap().0, 4);
    assert_eq!(
        stored(&mut c, "tasks", "t1").unwrap().2.as_deref(),
        Some("020403030403")
    );
    // NP-10: a legacy row (no blob, v5).
    exec(
        &mut c,
        "UPDATE public.np_tasks SET \"_sync_column_versions\" = NULL, \"_sync_server_version\" = 5",
    );
    let op = title(&mut c, Some(4));
    assert_eq!(
        record(&push(&mut c, "k10", &[op]))["conflictColumns"],
        "BQ=="
    );
    let op = title(&mut c, Some(5));
    push(&mut c, "k11", &[op]);
    let (version, _, versions) = stored(&mut c, "tasks", "t1").unwrap();
    assert_eq!(
        (version, versions.as_deref()),
        (6, Some("000501050206030504050505"))
    );
}

#[test]
fn np12_np13_np14_np15_np16_rules_in_upstreams_order() {
    let (_db, mut c) = with_t1("np12");
    // NP-12: scope columns are immutable; an equal value is fine.
    let op = up(
        &mut c,
        "tasks",
        "t1",
        None,
        json!({"id": "t1", "project_id": "p2"}),
    );
    assert_error(
        &push(&mut c, "k2", &[op]),
        0,
        "sync.invalid_request",
        "scope column is immutable on update (§3.4)",
    );
    let op = up(
        &mut c,
        "tasks",
        "t1",
        None,
        json!({"id": "t1", "project_id": "p1"}),
    );
    assert_eq!(push(&mut c, "k3", &[op])["outcome"], "applied");
    // A float scope column: stored 2.0 is authorized by "2"; NaN always differs.
    let op = up(&mut c, "buckets", "b1", None, json!({"id": "b1", "b": 2.0}));
    assert_eq!(push(&mut c, "k4", &[op])["outcome"], "applied");
    let s: Value = one(
        &mut c,
        "SELECT \"_sync_scopes\" FROM public.np_buckets",
        &[],
    );
    assert_eq!(s, json!({"bucket": "2"}));
    let op = up(&mut c, "buckets", "b1", None, json!({"id": "b1", "b": 2}));
    assert_eq!(push(&mut c, "k5", &[op])["outcome"], "applied");
    // NP-13: authorization.
    let rejections = [
        (
            "k6",
            up(&mut c, "tasks", "t2", None, task("t2", "p9")),
            "sync.forbidden",
            "insert denied by scope authorization (§3.4)",
        ),
        (
            "k7",
            up(&mut c, "tasks", "t2", None, task("t2", "")),
            "sync.forbidden",
            "insert missing scope column value for \"project_id\" (§3.4)",
        ),
    ];
    assert_rejections(&mut c, rejections);
    let op = up(&mut c, "tasks", "t2", None, task("t2", "p9"));
    let out = try_push_as(
        &mut c,
        P,
        "c1",
        "k8",
        from_ref(&op),
        Some(&json!({"project_id": ["*"]})),
        &json!({}),
    )
    .unwrap();
    assert_eq!(out["outcome"], "applied");
    let op2 = up(
        &mut c,
        "tasks",
        "t2",
        None,
        json!({"id": "t2", "title": "y"}),
    );
    assert_error(
        &push(&mut c, "k9", from_ref(&op2)),
        0,
        "sync.forbidden",
        "write denied by scope authorization (§3.4)",
    );
    let out = try_push_as(&mut c, P, "c1", "k10", &[op2], None, &json!({})).unwrap();
    assert_error(
        &out,
        0,
        "sync.forbidden",
        "scope resolution failed (§3.4 step 4)",
    );
    // NP-14: an unknown table (A1 before A2).
    let nope = raw("nope", "x", None, &[1]);
    let out = try_push_as(&mut c, P, "c1", "k11", &[nope], None, &json!({})).unwrap();
    assert_error(
        &out,
        0,
        "sync.unknown_table",
        "table \"nope\" is not handled by this server",
    );
    // NP-15: decode failures (E5) and key mismatches.
    let prefix = "row payload failed row-codec decode (§1.7): ";
    for (bytes, message) in [
        (
            "FF 01",
            "sparse row presence bitmap has a set padding bit (non-canonical encoding)",
        ),
        (
            "01 00 03 00 00 00 74 31",
            "truncated input: needed 3 bytes, have 2",
        ),
        ("02 00", "sparse row is missing the primary-key column id"),
        (
            "01 02",
            "sparse row null bitmap sets a null bit for an absent column",
        ),
        ("01 01", "null bit set for non-nullable column id"),
    ] {
        let out = push(
            &mut c,
            &format!("bad-{bytes}"),
            &[raw("tasks", "t1", None, &hex(bytes))],
        );
        assert_error(
            &out,
            0,
            "sync.invalid_request",
            &format!("{prefix}{message}"),
        );
    }
    let rejections = [
        (
            "k12",
            up(&mut c, "tasks", "t3", None, task("t1", "p1")),
            "sync.invalid_request",
            "payload primary key does not match rowId",
        ),
        (
            "k13",
            up(&mut c, "tasks", "", None, task("", "p1")),
            "sync.invalid_request",
            "payload primary key does not match rowId",
        ),
        (
            "k14",
            Op {
                payload: None,
                ..raw("tasks", "t1", None, &[])
            },
            "sync.invalid_request",
            "upsert without payload",
        ),
        // NP-16: inserts need a full payload; a versioned upsert of an absent row.
        (
            "k15",
            up(
                &mut c,
                "tasks",
                "t4",
                None,
                json!({"id": "t4", "title": "x"}),
            ),
            "sync.row_missing",
            "a partial payload targets an absent row (§6.3)",
        ),
        (
            "k16",
            up(&mut c, "tasks", "t4", Some(3), task("t4", "p1")),
            "sync.row_missing",
            "upsert with baseVersion targets an absent row (§6.2)",
        ),
        (
            "k17",
            up(&mut c, "tasks", "t4", Some(3), task("t4", "p9")),
            "sync.forbidden",
            "write denied by scope authorization (§3.4)",
        ),
    ];
    assert_rejections(&mut c, rejections);
    // NP-33: docs' variable is projectId, read from column project_id.
    let op = up(
        &mut c,
        "docs",
        "d1",
        None,
        json!({"id": "d1", "project_id": "p1", "body": null}),
    );
    assert_eq!(push(&mut c, "k18", &[op])["outcome"], "applied");
    let s: Value = one(&mut c, "SELECT \"_sync_scopes\" FROM public.np_docs", &[]);
    assert_eq!(s, json!({"projectId": "p1"}));
}

#[test]
fn np17_np18_np19_np20_np21_deletes_tombstones_and_rollback() {
    let (_db, mut c) = fixture("np17");
    // NP-18: deleting an absent row consumes a seq with no change.
    let out = push(&mut c, "k1", &[del("tasks", "t1")]);
    assert_eq!(out["commitSeq"], json!(1));
    assert_eq!(count(&mut c, "syncular.sync_changes"), 0);
    let insert = up(&mut c, "tasks", "t1", None, task("t1", "p1"));
    push(&mut c, "k2", from_ref(&insert));
    push(&mut c, "k3", &[del("tasks", "t1")]);
    assert_eq!(stored(&mut c, "tasks", "t1"), None);
    assert_eq!(count(&mut c, "syncular.sync_row_scopes"), 0);
    let tomb: i64 = one(
        &mut c,
        "SELECT commit_seq FROM syncular.sync_tombstones",
        &[],
    );
    assert_eq!(tomb, 3);
    let scopes: Value = one(
        &mut c,
        "SELECT scopes FROM syncular.sync_changes WHERE commit_seq = 3",
        &[],
    );
    assert_eq!(scopes, json!({"project_id": "p1"}));
    // NP-17: an unversioned upsert of a deleted row; bv 0 recreates it.
    assert_error(
        &push(&mut c, "k4", from_ref(&insert)),
        0,
        "sync.row_deleted",
        "a deleted row rejects an unversioned upsert within the retention horizon (§5.2)",
    );
    let recreate = up(&mut c, "tasks", "t1", Some(0), task("t1", "p1"));
    assert_eq!(push(&mut c, "k5", &[recreate])["outcome"], "applied");
    assert_eq!(count(&mut c, "syncular.sync_tombstones"), 0);
    // Delete + unversioned re-insert in one commit: row and tombstone both present.
    push(&mut c, "k6", &[del("tasks", "t1"), insert.clone()]);
    assert_eq!(stored(&mut c, "tasks", "t1").unwrap().0, 1);
    assert_eq!(count(&mut c, "syncular.sync_tombstones"), 1);
    // NP-19: insert, patch, delete of one row in one commit.
    let i2 = up(&mut c, "tasks", "t2", None, task("t2", "p1"));
    let p2 = up(
        &mut c,
        "tasks",
        "t2",
        Some(1),
        json!({"id": "t2", "title": "z"}),
    );
    push(&mut c, "k7", &[i2.clone(), p2, del("tasks", "t2")]);
    let versions: Vec<Option<i64>> = column(
        &mut c,
        "SELECT row_version FROM syncular.sync_changes WHERE commit_seq = 6 ORDER BY idx",
        &[],
    );
    assert_eq!(versions, vec![Some(1), Some(2), None]);
    assert_eq!(stored(&mut c, "tasks", "t2"), None);
    assert_eq!(
        count(&mut c, "syncular.sync_tombstones WHERE row_id = 't2'"),
        1
    );
    // NP-20: a rejection at op 2 rolls back ops 0 and 1 (row, scopes, tombstone clear).
    let before = snapshot(&mut c);
    let i3 = up(&mut c, "tasks", "t3", None, task("t3", "p1"));
    let again = up(&mut c, "tasks", "t2", Some(0), task("t2", "p1"));
    let bad = up(&mut c, "tasks", "t4", None, task("t4", "p9"));
    let out = push(&mut c, "k8", &[i3, again, bad]);
    assert_error(
        &out,
        2,
        "sync.forbidden",
        "insert denied by scope authorization (§3.4)",
    );
    assert_eq!(
        but_result(&snapshot(&mut c), "k8"),
        but_result(&before, "k8")
    );
    let next = up(&mut c, "tasks", "t5", None, task("t5", "p1"));
    assert_eq!(push(&mut c, "k9", &[next])["commitSeq"], json!(7));
    // NP-21: a first push to a new partition that is rejected leaves a partition row at 0.
    let op = up(&mut c, "tasks", "t1", None, task("t1", "p9"));
    let out = try_push_as(
        &mut c,
        "fresh",
        "c1",
        "k1",
        &[op],
        Some(&allowed()),
        &json!({}),
    )
    .unwrap();
    assert_eq!(out["outcome"], "rejected");
    let max: i64 = one(
        &mut c,
        "SELECT max_commit_seq FROM syncular.sync_partitions WHERE partition = 'fresh'",
        &[],
    );
    assert_eq!(max, 0);
    // Unauthorized delete (D2).
    let op = up(&mut c, "tasks", "t9", None, task("t9", "p9"));
    try_push_as(
        &mut c,
        P,
        "c1",
        "k10",
        &[op],
        Some(&json!({"project_id": ["*"]})),
        &json!({}),
    )
    .unwrap();
    assert_error(
        &push(&mut c, "k11", &[del("tasks", "t9")]),
        0,
        "sync.forbidden",
        "delete denied by scope authorization (§3.4)",
    );
}

#[test]
fn np22_np25_np26_np28_np34_replays_gate_fence_and_arguments() {
    let (_db, mut c) = fixture("np22");
    let insert = up(&mut c, "tasks", "t1", None, task("t1", "p1"));
    let first = push(&mut c, "k1", from_ref(&insert));
    // NP-22: an applied key replays without writes; a rejected one replays its record.
    let before = snapshot(&mut c);
    let other = up(&mut c, "tasks", "t7", None, task("t7", "p1"));
    let replay = try_push(&mut c, "k1", &[other], json!({})).unwrap();
    assert_eq!(
        replay,
        json!({"outcome": "cached", "replayed": true, "at": "optimistic", "commitSeq": 1, "result": first["result"]})
    );
    assert_eq!(snapshot(&mut c), before);
    let bad = up(&mut c, "tasks", "t2", None, task("t2", "p9"));
    let rejected = push(&mut c, "k2", &[bad]);
    let again = try_push(&mut c, "k2", from_ref(&insert), json!({})).unwrap();
    assert_eq!(again["result"], rejected["result"]);
    assert_eq!(
        (&again["outcome"], &again["replayed"]),
        (&json!("rejected"), &json!(true))
    );
    // The same commit id under another client is a new commit.
    let out = try_push_as(
        &mut c,
        P,
        "c2",
        "k1",
        &[del("tasks", "t5")],
        Some(&allowed()),
        &json!({}),
    )
    .unwrap();
    assert_eq!(out["commitSeq"], json!(2));
    // NP-26: an unreadable stored result is SY003.
    exec(
        &mut c,
        "INSERT INTO syncular.sync_push_results VALUES ('part-1', 'c1', 'k3', '\"x\"')",
    );
    expect_error(
        try_push(&mut c, "k3", from_ref(&insert), json!({})),
        "SY003",
        "sync.idempotency_cache_miss",
        None,
    );
    // NP-25: a pending undeclared checkpoint refuses (SY002), nothing written.
    raw_checkpoint(&mut c, "elsewhere", "bf", V, "declared");
    let before = snapshot(&mut c);
    let op = up(&mut c, "tasks", "t3", None, task("t3", "p1"));
    expect_error(
        try_push(&mut c, "k4", &[op], json!({})),
        "SY002",
        "sync.schema_not_ready",
        None,
    );
    assert_eq!(snapshot(&mut c), before);
    // A stored result still replays (C1 bypasses the gate).
    assert_eq!(
        try_push(&mut c, "k1", from_ref(&insert), json!({})).unwrap()["outcome"],
        "cached"
    );
    exec(&mut c, "DELETE FROM syncular.sync_backfill_checkpoints");
    // NP-28: a fence above the running version: SY001, nothing written; a rejection is stored.
    set_fence(&mut c, P, V + 1);
    let before = snapshot(&mut c);
    let op = up(&mut c, "tasks", "t3", None, task("t3", "p1"));
    expect_error(
        try_push(&mut c, "k5", &[op], json!({})),
        "SY001",
        "sync.storage.writer_fence_rejected",
        None,
    );
    assert_eq!(snapshot(&mut c), before);
    let op = up(&mut c, "tasks", "t3", None, task("t3", "p9"));
    assert_eq!(
        try_push(&mut c, "k6", &[op], json!({})).unwrap()["outcome"],
        "rejected"
    );
    exec(&mut c, "DELETE FROM syncular.sync_writer_fence");
    // NP-34: REPEATABLE READ is refused; inside BEGIN … push_begin … it works.
    let op = up(&mut c, "tasks", "t3", None, task("t3", "p1"));
    {
        let mut tx = c
            .build_transaction()
            .isolation_level(postgres::IsolationLevel::RepeatableRead)
            .start()
            .unwrap();
        expect_error(
            try_push(&mut tx, "k7", from_ref(&op), json!({})),
            "SY004",
            "sync.storage.invalid_transaction_state",
            Some(json!({"reason": "isolation"})),
        );
    }
    {
        let mut tx = c.transaction().unwrap();
        let begun: Option<Value> = one_in(
            &mut tx,
            "SELECT syncular.push_begin($1, 'c1', 'k7', $2)",
            &[&P, &V],
        );
        assert_eq!(begun, None);
        let out = try_push(&mut tx, "k7", from_ref(&op), json!({})).unwrap();
        assert_eq!(out["outcome"], "applied");
        tx.commit().unwrap();
    }
    assert!(stored(&mut c, "tasks", "t3").is_some());
    // Arrays of unequal length, no operation, bad kinds.
    let unequal = c.query_one(
        "SELECT syncular.push_commit('p', 'c1', 'k', 'a1', 1, 1, '{}', ARRAY['tasks'], ARRAY['a', 'b'],
                                     ARRAY[1]::int2[], ARRAY[NULL]::int8[], ARRAY[NULL]::bytea[])", &[]);
    expect_error(
        unequal,
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument": "op_row_ids", "reason": "shape"})),
    );
    let empty = c.query_one(
        "SELECT syncular.push_commit('p', 'c1', 'k', 'a1', 1, 1, '{}', '{}', '{}', '{}', '{}', '{}')", &[]);
    expect_error(
        empty,
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument": "op_tables", "reason": "empty"})),
    );
    let kind = c.query_one(
        "SELECT syncular.push_commit('p', 'c1', 'k', 'a1', 1, 1, '{}', ARRAY['tasks'], ARRAY['a'],
                                     ARRAY[3]::int2[], ARRAY[NULL]::int8[], ARRAY[NULL]::bytea[])",
        &[],
    );
    expect_error(
        kind,
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument": "op_kinds", "reason": "range"})),
    );
    let null_table = c.query_one(
        "SELECT syncular.push_commit('p', 'c1', 'k', 'a1', 1, 1, '{}', ARRAY[NULL]::text[], ARRAY['a'],
                                     ARRAY[1]::int2[], ARRAY[NULL]::int8[], ARRAY[NULL]::bytea[])", &[]);
    expect_error(
        null_table,
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument": "op_tables", "reason": "missing"})),
    );
}

#[test]
fn np11_np29_np30_np31_crdt_projection_blobs_and_fallbacks() {
    let (_db, mut c) = fixture("np11");
    // NP-11: a present NULL crdt value applies; a non-NULL one falls back (or, without
    // mergers, is upstream's crdt_merge_failed).
    let op = up(
        &mut c,
        "notes",
        "n1",
        None,
        json!({"id": "n1", "project_id": "p1", "doc": null}),
    );
    assert_eq!(push(&mut c, "k1", &[op])["outcome"], "applied");
    let before = snapshot(&mut c);
    let op = up(
        &mut c,
        "notes",
        "n1",
        None,
        json!({"id": "n1", "doc": "AQI="}),
    );
    let out = try_push(&mut c, "k2", from_ref(&op), json!({})).unwrap();
    assert_eq!(
        out,
        json!({"outcome": "fallback", "reason": "crdt_merge", "opIndex": 0, "table": "notes"})
    );
    unchanged(&mut c, &before);
    let out = try_push(&mut c, "k2", &[op], json!({"crdtMergers": false})).unwrap();
    assert_error(
        &out,
        0,
        "sync.crdt_merge_failed",
        "no CRDT merger registered",
    );
    // NP-29: every type projected; NUL in a materialized string column is a request error.
    let op = up(
        &mut c,
        "items",
        "7",
        None,
        json!({"id": 7, "project_id": "p1", "score": "NaN", "data": "AAH+/w=="}),
    );
    assert_eq!(push(&mut c, "k3", &[op])["outcome"], "applied");
    let r = c
        .query_one("SELECT id, score::text, data FROM public.np_items", &[])
        .unwrap();
    assert_eq!(
        (
            r.get::<_, i64>(0),
            r.get::<_, String>(1),
            r.get::<_, Vec<u8>>(2)
        ),
        (7, "NaN".into(), vec![0, 1, 0xfe, 0xff])
    );
    let op = up(
        &mut c,
        "tasks",
        "t1",
        None,
        json!({"id": "t1", "project_id": "p1", "title": "\u{feff}bom", "done": true, "priority": -5, "meta": "{\"k\": [1, 2]}"}),
    );
    push(&mut c, "k4", &[op]);
    let r = c
        .query_one("SELECT title, meta FROM public.np_tasks", &[])
        .unwrap();
    assert_eq!(
        (r.get::<_, String>(0), r.get::<_, Value>(1)),
        ("bom".into(), json!({"k": [1, 2]}))
    );
    let before = snapshot(&mut c);
    // U+0000 cannot pass through a jsonb argument: the payloads are written by hand.
    let nul = raw(
        "tasks",
        "t2",
        None,
        &hex("3F30 02000000 7432 02000000 7031 03000000 610062 01"),
    );
    let err = try_push(&mut c, "k5", &[nul], json!({}));
    assert_eq!(sql_error(&err.unwrap_err()).state, "22021");
    let json_nul = up(
        &mut c,
        "tasks",
        "t2",
        None,
        json!({"id": "t2", "project_id": "p1", "title": "x", "done": true, "priority": null, "meta": "\"\\u0000\""}),
    );
    let err = try_push(&mut c, "k5", &[json_nul], json!({}));
    assert_eq!(sql_error(&err.unwrap_err()).state, "22P05");
    assert_eq!(snapshot(&mut c), before);
    let secret = raw(
        "secrets",
        "s1",
        None,
        &hex("07 00 02000000 7331 02000000 7031 03000000 610062"),
    );
    assert_eq!(push(&mut c, "k6", &[secret])["outcome"], "applied");
    // NP-30: blob references.
    let id = format!("sha256:{}", "ab".repeat(32));
    let file = |c: &mut Client, v: Value| {
        up(
            c,
            "files",
            "f1",
            None,
            json!({"id": "f1", "project_id": "p1", "file": v}),
        )
    };
    let blob = json!(format!("{{\"blobId\":\"{id}\",\"byteLength\":3}}"));
    let op = file(&mut c, blob.clone());
    let before = snapshot(&mut c);
    let out = try_push(&mut c, "k7", from_ref(&op), json!({})).unwrap();
    assert_eq!(
        out,
        json!({"outcome": "fallback", "reason": "blob_check", "opIndex": 0, "table": "files", "blobIds": [id]})
    );
    unchanged(&mut c, &before);
    let out = try_push(&mut c, "k7", from_ref(&op), json!({"blobStore": "none"})).unwrap();
    assert_error(
        &out,
        0,
        "blob.not_found",
        "row references a blob but the server has no blob store (§5.9.6)",
    );
    let out = try_push(&mut c, "k8", &[op], json!({"verifiedBlobIds": [id]})).unwrap();
    assert_eq!(out["outcome"], "applied");
    assert_eq!(
        count(&mut c, "syncular.sync_blob_refs WHERE row_id = 'f1'"),
        1
    );
    // An update that does not touch the blob column re-checks the stored id.
    let op = up(&mut c, "files", "f1", None, json!({"id": "f1"}));
    assert_eq!(
        try_push(&mut c, "k9", &[op], json!({})).unwrap()["reason"],
        "blob_check"
    );
    let op = file(&mut c, Value::Null);
    assert_eq!(
        try_push(&mut c, "k9", &[op], json!({})).unwrap()["outcome"],
        "applied"
    );
    assert_eq!(count(&mut c, "syncular.sync_blob_refs"), 0);
    // NP-31: a fallback leaves no trace; ordering against rejections.
    let ok = up(&mut c, "tasks", "t5", None, task("t5", "p1"));
    let bad = up(
        &mut c,
        "docs",
        "d5",
        None,
        json!({"id": "d5", "project_id": "p9", "body": null}),
    );
    let before = snapshot(&mut c);
    let validated = json!({"rowValidatorTables": ["tasks"]});
    let out = try_push(&mut c, "k10", &[ok.clone(), bad.clone()], validated.clone()).unwrap();
    assert_eq!(
        out,
        json!({"outcome": "fallback", "reason": "row_validator", "opIndex": 0, "table": "tasks"})
    );
    unchanged(&mut c, &before);
    let out = try_push(&mut c, "k10", &[bad.clone(), ok.clone()], validated).unwrap();
    assert_error(
        &out,
        0,
        "sync.forbidden",
        "insert denied by scope authorization (§3.4)",
    );
    // Commit-level hooks only when nothing terminated.
    let out = try_push(
        &mut c,
        "k11",
        from_ref(&ok),
        json!({"commitValidator": true}),
    )
    .unwrap();
    assert_eq!(
        out,
        json!({"outcome": "fallback", "reason": "commit_validator"})
    );
    let out = try_push(
        &mut c,
        "k11",
        from_ref(&ok),
        json!({"reactionPlanner": true}),
    )
    .unwrap();
    assert_eq!(out["reason"], "reaction_planner");
    let out = try_push(
        &mut c,
        "k12",
        from_ref(&bad),
        json!({"commitValidator": true}),
    )
    .unwrap();
    assert_eq!(out["outcome"], "rejected");
    // Static fallbacks: another client schema version; no push schema at the running version;
    // an unregistered table.
    let out = try_push(
        &mut c,
        "k13",
        from_ref(&ok),
        json!({"clientSchemaVersion": V + 1}),
    )
    .unwrap();
    assert_eq!(
        out,
        json!({"outcome": "fallback", "reason": "client_schema_version"})
    );
    let tables: Vec<&str> = vec!["tasks"];
    let out: Value = one(&mut c,
        "SELECT syncular.push_commit('part-1', 'c1', 'k13', 'a1', 1, 2, '{}', $1, ARRAY['t5'], ARRAY[1]::int2[],
                                     ARRAY[NULL]::int8[], ARRAY[NULL]::bytea[])", &[&tables]);
    assert_eq!(out["reason"], "schema_not_registered");
    exec(&mut c, "SELECT syncular.retire_table('docs')");
    let out = try_push(&mut c, "k13", &[ok.clone(), bad], json!({})).unwrap();
    assert_eq!(
        out,
        json!({"outcome": "fallback", "reason": "schema_not_registered", "opIndex": 1, "table": "docs"})
    );
    // The classic path then produces the result (NP-31's second half is the differential test).
    assert_eq!(
        try_push(&mut c, "k13", &[ok], json!({})).unwrap()["outcome"],
        "applied"
    );
}

#[test]
fn np27_constraints_and_the_callers_rights() {
    let (db, mut c) = with_unique_titles("np27");
    // Op 0 collides on the title, op 1 would free it: opIndex 0.
    let clash = up(&mut c, "tasks", "t2", None, task("t2", "p1"));
    let rename = up(
        &mut c,
        "tasks",
        "t1",
        None,
        json!({"id": "t1", "title": "other"}),
    );
    let before = snapshot(&mut c);
    let out = push(&mut c, "k2", &[clash, rename]);
    assert_constraint_violation(&out, 0);
    assert_eq!(
        but_result(&snapshot(&mut c), "k2"),
        but_result(&before, "k2")
    );
    // A host foreign key blocking a delete is an error, nothing stored.
    exec(&mut c, "CREATE TABLE public.np_child (p text, r text, FOREIGN KEY (p, r) REFERENCES public.np_tasks)
                  ; INSERT INTO public.np_child VALUES ('part-1', 't1')");
    let err = try_push(&mut c, "k3", &[del("tasks", "t1")], json!({})).unwrap_err();
    assert_eq!(sql_error(&err).state, "23503");
    assert_eq!(
        count(
            &mut c,
            "syncular.sync_push_results WHERE client_commit_id = 'k3'"
        ),
        0
    );
    // The app rows are written as the caller: a host role with the API grant but no INSERT on
    // the relation is refused by PostgreSQL; with it, host triggers see the caller.
    exec(&mut c, "DROP ROLE IF EXISTS np_host; CREATE ROLE np_host LOGIN; GRANT syncular_host TO np_host;
                  GRANT USAGE ON SCHEMA public TO np_host; GRANT SELECT ON public.np_tasks TO np_host");
    let mut h = db.connect_as("np_host");
    let op = up(&mut c, "tasks", "t9", None, titled("t9", "h"));
    let err = try_push(&mut h, "k4", from_ref(&op), json!({})).unwrap_err();
    assert_eq!(sql_error(&err).state, "42501");
    exec(&mut c, "GRANT INSERT, UPDATE, DELETE ON public.np_tasks TO np_host;
                  CREATE TABLE public.np_audit (who text, ctx text); GRANT INSERT ON public.np_audit TO np_host;
                  CREATE FUNCTION public.np_audit() RETURNS trigger LANGUAGE plpgsql AS
                    $$BEGIN INSERT INTO public.np_audit VALUES (current_user, session_user); RETURN NEW; END$$;
                  CREATE TRIGGER np_audit AFTER INSERT ON public.np_tasks FOR EACH ROW EXECUTE FUNCTION public.np_audit()");
    assert_eq!(
        try_push(&mut h, "k4", &[op], json!({})).unwrap()["outcome"],
        "applied"
    );
    let who: String = one(&mut c, "SELECT who FROM public.np_audit", &[]);
    assert_eq!(who, "np_host");
    drop(h);
    exec(&mut c, "DROP OWNED BY np_host");
}

#[test]
fn np23_np24_overlapping_deliveries_and_concurrent_pushes() {
    let (db, mut c) = fixture("np23");
    let mut s1 = db.connect();
    let mut s2 = db.connect();
    let op = up(&mut c, "tasks", "t1", None, task("t1", "p1"));
    // NP-23: S1 holds the lock inside a transaction; S2's autocommit delivery waits, then
    // replays S1's result.
    s1.batch_execute("BEGIN").unwrap();
    let first = try_push(&mut s1, "k1", from_ref(&op), json!({"cacheIdentity": "s1"})).unwrap();
    let pid = backend_pid(&mut s2);
    let second = std::thread::scope(|scope| {
        let op = op.clone();
        let waiter = scope
            .spawn(move || try_push(&mut s2, "k1", &[op], json!({"cacheIdentity": "s2"})).unwrap());
        wait_until_blocked(&mut c, pid);
        s1.batch_execute("COMMIT").unwrap();
        waiter.join().unwrap()
    });
    assert_eq!(
        second,
        json!({"outcome": "cached", "replayed": true, "at": "locked", "commitSeq": 1, "result": first["result"]})
    );
    assert_eq!(count(&mut c, "syncular.sync_commits"), 1);
    assert_eq!(stored(&mut c, "tasks", "t1").unwrap().0, 1);
    // The same with a conflicting commit: both sessions answer the same bytes.
    let mut s2 = db.connect();
    let conflicting = up(&mut c, "tasks", "t1", Some(0), task("t1", "p1"));
    s1.batch_execute("BEGIN").unwrap();
    let first = try_push(
        &mut s1,
        "k2",
        from_ref(&conflicting),
        json!({"cacheIdentity": "s1"}),
    )
    .unwrap();
    let pid = backend_pid(&mut s2);
    let second = std::thread::scope(|scope| {
        let waiter = scope.spawn(move || {
            try_push(
                &mut s2,
                "k2",
                &[conflicting],
                json!({"cacheIdentity": "s2"}),
            )
            .unwrap()
        });
        wait_until_blocked(&mut c, pid);
        s1.batch_execute("COMMIT").unwrap();
        waiter.join().unwrap()
    });
    assert_eq!(second["result"], first["result"]);
    assert_eq!(second["at"], "locked");
    // NP-24: concurrent pushes of different keys to one partition get dense seqs.
    let ops: Vec<Op> = (0..8)
        .map(|i| {
            up(
                &mut c,
                "tasks",
                &format!("r{i}"),
                None,
                task(&format!("r{i}"), "p1"),
            )
        })
        .collect();
    std::thread::scope(|scope| {
        for (i, op) in ops.into_iter().enumerate() {
            let mut s = db.connect();
            scope.spawn(move || {
                let out = try_push(&mut s, &format!("c{i}"), &[op], json!({})).unwrap();
                assert_eq!(out["outcome"], "applied");
            });
        }
    });
    let seqs: Vec<i64> = column(
        &mut c,
        "SELECT commit_seq FROM syncular.sync_commits ORDER BY 1",
        &[],
    );
    assert_eq!(seqs, (1..=9).collect::<Vec<i64>>());
}

// ---- NP-35: the differential test -------------------------------------------------------------

fn base64(bytes: &[u8]) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A random sparse row of `tasks` or `items` for row `id` (the key always present).
fn random_values(rng: &mut Rng, table: &str, id: &str) -> Value {
    let mut v = serde_json::Map::new();
    let strings = [
        "",
        "a",
        "\u{feff}bom",
        "\u{feff}\u{feff}x",
        "é∂",
        "long text with spaces",
    ];
    let project = *rng.pick(&["p1", "p1", "p1", "p1", "p1", "p1", "p2", "p9", ""]);
    if table == "tasks" {
        v.insert("id".into(), json!(id));
        if rng.chance(60) {
            v.insert("project_id".into(), json!(project));
        }
        if rng.chance(70) {
            v.insert("title".into(), json!(rng.pick(&strings)));
        }
        if rng.chance(50) {
            v.insert("done".into(), json!(rng.chance(50)));
        }
        if rng.chance(50) {
            v.insert(
                "priority".into(),
                rng.pick(&[
                    json!(null),
                    json!(0),
                    json!(-7),
                    json!(9007199254740991i64),
                    json!(300),
                ])
                .clone(),
            );
        }
        if rng.chance(40) {
            v.insert(
                "meta".into(),
                rng.pick(&[
                    json!(null),
                    json!("{\"k\": [1, 2]}"),
                    json!("[]"),
                    json!("\"s\""),
                    json!("\u{feff}{}"),
                    json!("1e400"),
                    json!("{\"a\":1,\"a\":2}"),
                ])
                .clone(),
            );
        }
    } else {
        v.insert("id".into(), json!(id.parse::<i64>().unwrap_or(0)));
        if rng.chance(60) {
            v.insert("project_id".into(), json!(project));
        }
        if rng.chance(50) {
            v.insert(
                "score".into(),
                rng.pick(&[
                    json!(null),
                    json!(1.5),
                    json!(-2.25),
                    json!(1e21),
                    json!("NaN"),
                    json!("Infinity"),
                    json!(0.1),
                ])
                .clone(),
            );
        }
        if rng.chance(50) {
            v.insert(
                "data".into(),
                rng.pick(&[json!(null), json!(""), json!("AAH+/w=="), json!("AQID")])
                    .clone(),
            );
        }
    }
    Value::Object(v)
}

/// A random commit: 1–4 operations over a few rows of two tables, repeated rows, every kind
/// of baseVersion around the stored one, hostile payloads now and then.
fn random_ops(rng: &mut Rng, c: &mut Client) -> Vec<Op> {
    let n = *rng.pick(&[1, 1, 1, 2, 2, 3, 4]);
    (0..n)
        .map(|_| {
            let table = *rng.pick(&[
                "tasks", "tasks", "tasks", "items", "items", "tasks", "items", "tasks", "items",
                "nope",
            ]);
            let id = format!("{}", rng.below(6));
            let id = if table == "tasks" {
                format!("t{id}")
            } else {
                id
            };
            if rng.chance(20) {
                return del(if table == "nope" { "tasks" } else { table }, &id);
            }
            if table == "nope" {
                return raw("nope", &id, None, &[0]);
            }
            let bv = if rng.chance(40) {
                None
            } else {
                Some(rng.below(6) as i64 - 1)
            };
            if rng.chance(3) {
                let junk: Vec<u8> = (0..rng.below(12)).map(|_| rng.next_u64() as u8).collect();
                return raw(table, &id, bv, &junk);
            }
            let mut values = random_values(rng, table, &id);
            if rng.chance(60) {
                // A full row for inserts.
                let full = random_values(rng, table, &id);
                let full = if table == "tasks" {
                    let mut t = task(&id, "p1");
                    for (k, v) in full.as_object().unwrap() {
                        t[k] = v.clone();
                    }
                    t
                } else {
                    let mut t = json!({"id": 0, "project_id": "p1", "score": null, "data": null});
                    for (k, v) in full.as_object().unwrap() {
                        t[k] = v.clone();
                    }
                    t
                };
                values = full;
            }
            if rng.chance(3) {
                values["id"] = if table == "tasks" {
                    json!("other")
                } else {
                    json!(99)
                };
            }
            let payload = enc(c, table, &values);
            Op {
                table: table.into(),
                row_id: id,
                kind: 1,
                bv,
                payload: Some(payload),
            }
        })
        .collect()
}

/// The test-side host of the classic path: the decision table of the native-push contract
/// (§3), over get_push_result, push_begin, its own app-row statements with decode_row and
/// encode_row, the row functions, append_commit and put_push_result. `Err` = a request error
/// (its SQLSTATE).
struct Classic<'a> {
    c: &'a mut Client,
}

/// The test's model of the column versions (docs/CODEC.md §Column versions).
fn leb(bytes: &[u8]) -> Vec<(usize, u64)> {
    let mut out = Vec::new();
    let mut it = bytes.iter();
    let mut read = || {
        let (mut v, mut shift) = (0u64, 0);
        for &b in it.by_ref() {
            v |= u64::from(b & 0x7f) << shift;
            shift += 7;
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    };
    while let Some(o) = read() {
        out.push((o as usize, read().unwrap()));
    }
    out
}

fn unleb(pairs: &[(usize, u64)]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    for &(o, v) in pairs {
        for mut x in [o as u64, v] {
            loop {
                let b = (x & 0x7f) as u8;
                x >>= 7;
                if x == 0 {
                    out.push(b);
                    break;
                }
                out.push(b | 0x80);
            }
        }
    }
    (!out.is_empty()).then_some(out)
}

const TASK_COLUMNS: [&str; 6] = ["id", "project_id", "title", "done", "priority", "meta"];
const ITEM_COLUMNS: [&str; 4] = ["id", "project_id", "score", "data"];

fn columns(table: &str) -> &'static [&'static str] {
    if table == "tasks" {
        &TASK_COLUMNS
    } else {
        &ITEM_COLUMNS
    }
}

/// `renderScopeValue` for the model's types: strings, integers.
fn render(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) if s.is_empty() => None,
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn err(code: &str, message: &str) -> Value {
    json!({"status": "error", "code": code, "message": message, "retryable": false})
}

impl Classic<'_> {
    fn push(
        &mut self,
        p: &str,
        key: &str,
        ops: &[Op],
        allowed: Option<&Value>,
        identity: &str,
    ) -> Result<Value, String> {
        let stored: Option<Value> = one(
            self.c,
            "SELECT syncular.get_push_result($1, 'c1', $2)",
            &[&p, &key],
        );
        if let Some(stored) = stored {
            return Ok(stored);
        }
        // Payloads decode the same whatever the state: decoded before the transaction, so a
        // decoder refusal does not abort it.
        let decoded: Vec<Option<Result<Value, String>>> = ops
            .iter()
            .map(|op| {
                let payload = op.payload.as_ref()?;
                if op.table == "nope" {
                    return None;
                }
                Some(
                    try_one::<Value>(
                        self.c,
                        "SELECT syncular.decode_row($1, $2, true)",
                        &[&op.table, payload],
                    )
                    .map_err(|e| {
                        sql_error(&e).detail.unwrap()["reason"]
                            .as_str()
                            .unwrap()
                            .to_string()
                    }),
                )
            })
            .collect();
        let mut tx = self.c.transaction().unwrap();
        let begun: Option<Value> = one_in(
            &mut tx,
            "SELECT syncular.push_begin($1, 'c1', $2, $3)",
            &[&p, &key, &V],
        );
        if let Some(stored) = begun {
            return Ok(stored);
        }
        tx.batch_execute("SAVEPOINT syncular_push_candidate")
            .unwrap();
        let mut changes = Vec::new();
        let mut stop = None;
        for (k, (op, patch)) in ops.iter().zip(decoded).enumerate() {
            match Self::op(&mut tx, p, op, patch, allowed, &mut changes) {
                Ok(None) => {}
                Ok(Some(mut record)) => {
                    record["opIndex"] = json!(k);
                    stop = Some(record);
                    break;
                }
                Err(state) => return Err(state),
            }
        }
        let result = match stop {
            Some(record) => {
                tx.batch_execute("ROLLBACK TO SAVEPOINT syncular_push_candidate")
                    .unwrap();
                json!({"status": "rejected", "results": [record], "recordedAtMs": NOW, "cacheIdentity": identity})
            }
            None => {
                let doc = json!({"clientId": "c1", "clientCommitId": key, "actorId": "a1", "createdAtMs": NOW,
                                 "writerVersion": V, "changes": changes});
                let seq: i64 =
                    match tx.query_one("SELECT syncular.append_commit($1, $2)", &[&p, &doc]) {
                        Ok(r) => r.get(0),
                        Err(e) => return Err(sql_error(&e).state),
                    };
                let results: Vec<Value> = (0..ops.len())
                    .map(|k| json!({"opIndex": k, "status": "applied"}))
                    .collect();
                json!({"status": "applied", "commitSeq": seq, "results": results, "recordedAtMs": NOW, "cacheIdentity": identity})
            }
        };
        let stored: Value = one_in(
            &mut tx,
            "SELECT syncular.put_push_result($1, 'c1', $2, $3)",
            &[&p, &key, &result],
        );
        tx.commit().unwrap();
        Ok(stored)
    }

    fn authorized(allowed: &Value, scopes: &Value) -> bool {
        let var = "project_id";
        match scopes.get(var).and_then(Value::as_str) {
            None | Some("") => false,
            Some(v) => allowed[var]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x == v || x == "*")),
        }
    }

    fn relation(table: &str) -> &'static str {
        if table == "tasks" {
            "public.np_tasks"
        } else {
            "public.np_items"
        }
    }

    /// One operation; `Ok(Some(record))` terminates (without its opIndex).
    fn op(
        tx: &mut postgres::Transaction<'_>,
        p: &str,
        op: &Op,
        patch: Option<Result<Value, String>>,
        allowed: Option<&Value>,
        changes: &mut Vec<Value>,
    ) -> Result<Option<Value>, String> {
        if op.table == "nope" {
            return Ok(Some(err(
                "sync.unknown_table",
                "table \"nope\" is not handled by this server",
            )));
        }
        let Some(allowed) = allowed else {
            return Ok(Some(err(
                "sync.forbidden",
                "scope resolution failed (§3.4 step 4)",
            )));
        };
        let rel = Self::relation(&op.table);
        let row = tx
            .query_opt(
                &format!("SELECT \"_sync_server_version\", \"_sync_scopes\", \"_sync_payload\", \"_sync_column_versions\"
                            FROM {rel} WHERE \"_sync_partition\" = $1 AND \"_sync_row_id\" = $2"),
                &[&p, &op.row_id],
            )
            .unwrap()
            .map(|r| (r.get::<_, i64>(0), r.get::<_, Value>(1), r.get::<_, Vec<u8>>(2), r.get::<_, Option<Vec<u8>>>(3)));
        if op.kind == 2 {
            let Some((_, scopes, _, _)) = row else {
                return Ok(None);
            };
            if !Self::authorized(allowed, &scopes) {
                return Ok(Some(err(
                    "sync.forbidden",
                    "delete denied by scope authorization (§3.4)",
                )));
            }
            tx.execute(
                &format!(
                    "DELETE FROM {rel} WHERE \"_sync_partition\" = $1 AND \"_sync_row_id\" = $2"
                ),
                &[&p, &op.row_id],
            )
            .unwrap();
            tx.execute(
                "SELECT syncular.delete_row_meta($1, $2, $3)",
                &[&p, &op.table, &op.row_id],
            )
            .unwrap();
            changes.push(
                json!({"table": op.table, "rowId": op.row_id, "op": "delete", "scopes": scopes}),
            );
            return Ok(None);
        }
        let patch = match patch {
            None => return Ok(Some(err("sync.invalid_request", "upsert without payload"))),
            Some(Err(reason)) => {
                return Ok(Some(err(
                    "sync.invalid_request",
                    &format!("row payload failed row-codec decode (§1.7): {reason}"),
                )))
            }
            Some(Ok(patch)) => patch,
        };
        if render(patch.get("id")).as_deref() != Some(op.row_id.as_str()) {
            return Ok(Some(err(
                "sync.invalid_request",
                "payload primary key does not match rowId",
            )));
        }
        let cols = columns(&op.table);
        let present: Vec<usize> = (0..cols.len())
            .filter(|&i| patch.get(cols[i]).is_some())
            .collect();
        let (version, scopes, payload, blob, versions) = match row {
            Some((version, scopes, payload, blob)) => {
                if !Self::authorized(allowed, &scopes) {
                    return Ok(Some(err(
                        "sync.forbidden",
                        "write denied by scope authorization (§3.4)",
                    )));
                }
                let mut values: Value = one_in(
                    tx,
                    "SELECT syncular.decode_row($1, $2, false)",
                    &[&op.table, &payload],
                );
                if patch
                    .get("project_id")
                    .is_some_and(|v| *v != values["project_id"])
                {
                    return Ok(Some(err(
                        "sync.invalid_request",
                        "scope column is immutable on update (§3.4)",
                    )));
                }
                if op.bv.is_some_and(|bv| bv > version) {
                    return Ok(Some(err(
                        "sync.invalid_request",
                        "baseVersion exceeds the stored server version (§6.2)",
                    )));
                }
                let pairs = blob.as_deref().map(leb);
                let effective = |i: usize| match &pairs {
                    None => version as u64,
                    Some(pairs) => pairs
                        .iter()
                        .rev()
                        .find(|(o, _)| *o == i)
                        .map_or(1, |(_, v)| *v),
                };
                let marked: Vec<usize> = match op.bv {
                    None => vec![],
                    Some(0) => present.iter().copied().filter(|&i| i != 0).collect(),
                    Some(bv) => present
                        .iter()
                        .copied()
                        .filter(|&i| bv < 0 || effective(i) > bv as u64)
                        .collect(),
                };
                if op.bv == Some(0) || !marked.is_empty() {
                    let mut bitmap = vec![0u8; cols.len().div_ceil(8)];
                    for i in marked {
                        bitmap[i / 8] |= 1 << (i % 8);
                    }
                    return Ok(Some(
                        json!({"status": "conflict", "code": "sync.version_conflict",
                        "message": "present columns moved past baseVersion (§6.2)", "serverVersion": version,
                        "serverRow": base64(&payload), "conflictColumns": base64(&bitmap)}),
                    ));
                }
                for (k, v) in patch.as_object().unwrap() {
                    values[k] = v.clone();
                }
                let next = version + 1;
                let versions: Vec<(usize, u64)> = (0..cols.len())
                    .map(|i| {
                        (
                            i,
                            if i != 0 && present.contains(&i) {
                                next as u64
                            } else {
                                effective(i)
                            },
                        )
                    })
                    .filter(|&(_, v)| v > 1)
                    .collect();
                (next, scopes, values, unleb(&versions), true)
            }
            None => {
                let payload_scopes = json!({"project_id": render(patch.get("project_id"))});
                match op.bv {
                    Some(bv) if bv != 0 => {
                        return Ok(Some(if Self::authorized(allowed, &payload_scopes) {
                            err(
                                "sync.row_missing",
                                "upsert with baseVersion targets an absent row (§6.2)",
                            )
                        } else {
                            err(
                                "sync.forbidden",
                                "write denied by scope authorization (§3.4)",
                            )
                        }));
                    }
                    Some(_) => {}
                    None => {
                        let tomb: Option<i64> = one_in(
                            tx,
                            "SELECT syncular.get_tombstone_seq($1, $2, $3)",
                            &[&p, &op.table, &op.row_id],
                        );
                        if tomb.is_some() {
                            return Ok(Some(err("sync.row_deleted",
                                "a deleted row rejects an unversioned upsert within the retention horizon (§5.2)")));
                        }
                    }
                }
                if present.len() != cols.len() {
                    return Ok(Some(err(
                        "sync.row_missing",
                        "a partial payload targets an absent row (§6.3)",
                    )));
                }
                let Some(project) = render(patch.get("project_id")) else {
                    return Ok(Some(err(
                        "sync.forbidden",
                        "insert missing scope column value for \"project_id\" (§3.4)",
                    )));
                };
                let scopes = json!({"project_id": project});
                if !Self::authorized(allowed, &scopes) {
                    return Ok(Some(err(
                        "sync.forbidden",
                        "insert denied by scope authorization (§3.4)",
                    )));
                }
                tx.execute(
                    "SELECT syncular.clear_tombstone($1, $2, $3)",
                    &[&p, &op.table, &op.row_id],
                )
                .unwrap();
                (1, scopes, patch, None, false)
            }
        };
        let full: Vec<u8> = one_in(
            tx,
            "SELECT syncular.encode_row($1, $2, false)",
            &[&op.table, &payload],
        );
        let sql = if op.table == "tasks" {
            "INSERT INTO public.np_tasks AS t VALUES ($1, $2, $3::jsonb->>'id', $3::jsonb->>'project_id', $3::jsonb->>'title', ($3::jsonb->>'done')::boolean,
                     ($3::jsonb->>'priority')::bigint, ($3::jsonb->>'meta')::jsonb, $4, $5, $6, $7)
             ON CONFLICT (\"_sync_partition\", \"_sync_row_id\") DO UPDATE SET
               id = EXCLUDED.id, project_id = EXCLUDED.project_id, title = EXCLUDED.title, done = EXCLUDED.done,
               priority = EXCLUDED.priority, meta = EXCLUDED.meta, \"_sync_server_version\" = EXCLUDED.\"_sync_server_version\",
               \"_sync_scopes\" = EXCLUDED.\"_sync_scopes\", \"_sync_payload\" = EXCLUDED.\"_sync_payload\",
               \"_sync_column_versions\" = EXCLUDED.\"_sync_column_versions\""
        } else {
            "INSERT INTO public.np_items AS t VALUES ($1, $2, ($3::jsonb->>'id')::bigint, $3::jsonb->>'project_id', ($3::jsonb->>'score')::float8,
                     decode($3::jsonb->>'data', 'base64'), $4, $5, $6, $7)
             ON CONFLICT (\"_sync_partition\", \"_sync_row_id\") DO UPDATE SET
               id = EXCLUDED.id, project_id = EXCLUDED.project_id, score = EXCLUDED.score, data = EXCLUDED.data,
               \"_sync_server_version\" = EXCLUDED.\"_sync_server_version\", \"_sync_scopes\" = EXCLUDED.\"_sync_scopes\",
               \"_sync_payload\" = EXCLUDED.\"_sync_payload\", \"_sync_column_versions\" = EXCLUDED.\"_sync_column_versions\""
        };
        if let Err(e) = tx.execute(
            sql,
            &[&p, &op.row_id, &payload, &version, &scopes, &full, &blob],
        ) {
            return Err(sql_error(&e).state);
        }
        if !versions {
            tx.execute(
                "SELECT syncular.set_row_scopes($1, $2, $3, $4)",
                &[&p, &op.table, &op.row_id, &scopes],
            )
            .unwrap();
        }
        changes.push(
            json!({"table": op.table, "rowId": op.row_id, "op": "upsert", "rowVersion": version,
                            "scopes": scopes, "payload": base64(&full)}),
        );
        Ok(None)
    }
}

#[test]
fn np35_differential_against_the_classic_path() {
    let native_db = TestDb::new("np35_native");
    let classic_db = TestDb::new("np35_classic");
    let mut n = native_db.connect();
    let mut c = classic_db.connect();
    setup(&mut n);
    setup(&mut c);
    let commits: usize = std::env::var("SYNCULAR_NP35_COMMITS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let (mut applied, mut rejected, mut replays, mut errors) = (0, 0, 0, 0);
    for i in 0..commits {
        let p = *rng.pick(&["part-1", "part-2"]);
        // Now and then an earlier key again (a replay, possibly with another body).
        let key = if i > 0 && rng.chance(5) {
            format!("k{}", rng.below(i as u64))
        } else {
            format!("k{i}")
        };
        let ops = random_ops(&mut rng, &mut n);
        let allowed = match rng.below(20) {
            0 => None,
            1 => Some(json!({"project_id": ["*"]})),
            2..=5 => Some(json!({"project_id": ["p1"]})),
            _ => Some(json!({"project_id": ["p1", "p2"]})),
        };
        let identity = format!("id-{i}");
        let native = try_push_as(
            &mut n,
            p,
            "c1",
            &key,
            &ops,
            allowed.as_ref(),
            &json!({"cacheIdentity": identity}),
        )
        .map(|out| out["result"].clone())
        .map_err(|e| sql_error(&e).state);
        let classic = Classic { c: &mut c }.push(p, &key, &ops, allowed.as_ref(), &identity);
        assert_eq!(native, classic, "commit {i} ({key} in {p}): {ops:?}");
        match &native {
            Ok(r) if r["cacheIdentity"] != json!(identity) => replays += 1,
            Ok(r) if r["status"] == "applied" => applied += 1,
            Ok(_) => rejected += 1,
            Err(_) => errors += 1,
        }
        if i % 250 == 249 || i + 1 == commits {
            assert_eq!(snapshot(&mut n), snapshot(&mut c), "after commit {i}");
        }
    }
    eprintln!("np35: {commits} commits: {applied} applied, {rejected} rejected, {replays} replays, {errors} request errors");
    assert!(
        applied > commits / 10 && rejected > commits / 10 && replays > 0,
        "{applied} {rejected} {replays}"
    );
}

/// Issue 25 (low): what a push copies from a stored app row into the log obeys the rules
/// `append_commit` holds the same document to (docs/API.md §Commit log): a row version in
/// 1 … 2^53−1, scopes an object of strings. A row the host wrote outside them (a version at
/// 2^63−1 wrapped to −2^63, nested scopes) is `SY005` with the path the change would have, and
/// nothing is written.
#[test]
fn stored_versions_and_scopes_the_log_cannot_hold_are_refused() {
    let (_db, mut c) = fixture("np_stored_meta");
    for (key, id) in [("k1", "t1"), ("k2", "t2")] {
        let op = up(&mut c, "tasks", id, None, task(id, "p1"));
        assert_eq!(push(&mut c, key, &[op])["outcome"], "applied");
    }
    let set = |c: &mut Client, assignment: &str| {
        exec(
            c,
            &format!(
                "UPDATE public.np_tasks SET {assignment}, \"_sync_column_versions\" = NULL
                  WHERE \"_sync_row_id\" = 't1'"
            ),
        )
    };
    let max_safe: i64 = (1 << 53) - 1;
    let cases = [
        (
            format!("\"_sync_server_version\" = {}", i64::MAX),
            false,
            "changes[1].rowVersion",
            "range",
        ),
        (
            format!("\"_sync_server_version\" = {max_safe}"),
            false,
            "changes[1].rowVersion",
            "range",
        ),
        (
            r#""_sync_server_version" = 1, "_sync_scopes" = '{"project_id": "p1", "x": {"n": 1}}'"#
                .into(),
            false,
            "changes[1].scopes.x",
            "type",
        ),
        (
            r#""_sync_scopes" = '{"project_id": "p1", "b": 5, "a": [1]}'"#.into(),
            true,
            "changes[1].scopes.a",
            "type",
        ),
        (
            r#""_sync_scopes" = '["p1"]'"#.into(),
            true,
            "changes[1].scopes",
            "type",
        ),
    ];
    for (i, (assignment, delete, path, reason)) in cases.iter().enumerate() {
        set(&mut c, assignment);
        let before = snapshot(&mut c);
        // The second operation meets the row: the path names the change it would have been.
        let first = up(
            &mut c,
            "tasks",
            "t2",
            None,
            titled("t2", &format!("case {i}")),
        );
        let second = if *delete {
            del("tasks", "t1")
        } else {
            up(&mut c, "tasks", "t1", None, titled("t1", "renamed"))
        };
        expect_error(
            try_push(&mut c, &format!("bad{i}"), &[first, second], json!({})),
            "SY005",
            "sync.storage.invalid_commit",
            Some(json!({"path": path, "reason": reason})),
        );
        unchanged(&mut c, &before);
    }
    // One below the bound: the change carries 2^53−1, as append_commit would accept it.
    set(
        &mut c,
        &format!(
            r#""_sync_server_version" = {}, "_sync_scopes" = '{{"project_id": "p1"}}'"#,
            max_safe - 1
        ),
    );
    let op = up(&mut c, "tasks", "t1", None, titled("t1", "renamed"));
    let out = push(&mut c, "ok", &[op]);
    assert_eq!(out["outcome"], "applied", "{out}");
    let version: i64 = one(
        &mut c,
        "SELECT row_version FROM syncular.sync_changes WHERE partition = $1 AND commit_seq = $2",
        &[&P, &out["commitSeq"].as_i64().unwrap()],
    );
    assert_eq!(version, max_safe);
}

/// Configuration errors get an answer that says what fixes them (issue 27, item 3): a running
/// schema version below 1 is an argument error; a process behind the stored schema version is
/// refused as the gate refuses it (`SY002`), not sent to the classic path; a version with no
/// push schema falls back with what is registered and the call that mends it.
#[test]
fn configuration_errors_name_their_fix() {
    let (_db, mut c) = fixture("np_config");
    let insert = up(&mut c, "tasks", "t1", None, task("t1", "p1"));
    let (tables, ids, kinds) = (vec!["tasks"], vec!["t1"], vec![insert.kind]);
    let payloads = vec![insert.payload.clone()];
    let at = |c: &mut Client, running: i64| {
        c.query_one(
            "SELECT syncular.push_commit('part-1', 'c1', 'kc', 'a1', 1750000000000, $1, $2, $3, $4,
                                         $5, ARRAY[NULL]::int8[], $6)",
            &[&running, &allowed(), &tables, &ids, &kinds, &payloads],
        )
        .map(|r| r.get::<_, Value>(0))
    };
    let before = snapshot(&mut c);
    // 0 (never migrated) and the created-at timestamp's place are not versions.
    for running in [0, -1] {
        expect_error(
            at(&mut c, running),
            "SY000",
            "sync.storage.invalid_argument",
            Some(json!({"argument": "running_schema_version", "reason": "range"})),
        );
    }
    // No push schema at the running version: the fallback names the versions that have one.
    let out = at(&mut c, 1_750_000_000_000).unwrap();
    assert_eq!(
        (
            &out["outcome"],
            &out["reason"],
            &out["runningSchemaVersion"],
            &out["storedSchemaVersion"],
            &out["registeredVersions"]
        ),
        (
            &json!("fallback"),
            &json!("schema_not_registered"),
            &json!(1_750_000_000_000i64),
            &json!(0),
            &json!([V])
        ),
        "{out}"
    );
    assert!(
        out["hint"]
            .as_str()
            .unwrap()
            .contains("set_push_schema(1750000000000, …)"),
        "{out}"
    );
    unchanged(&mut c, &before);
    // Mechanical fixes are said (issue 27, item 7): a writer behind the partition's fence is
    // told to stop serving writes; a call that needs a transaction block says how.
    let fence: i64 = one(
        &mut c,
        "SELECT syncular.raise_writer_fence('part-1', 5)",
        &[],
    );
    assert_eq!(fence, 5);
    let err = expect_error(
        at(&mut c, 1),
        "SY001",
        "sync.storage.writer_fence_rejected",
        None,
    );
    assert!(
        err.hint
            .as_deref()
            .is_some_and(|h| h.contains("stop serving writes")),
        "{err:?}"
    );
    let err = expect_error(
        c.query_one("SELECT syncular.migrate_schema(2, '{}')", &[])
            .map(|r| r.get::<_, i64>(0)),
        "SY004",
        "sync.storage.invalid_transaction_state",
        Some(json!({"reason": "no_transaction_block"})),
    );
    assert!(
        err.hint
            .as_deref()
            .is_some_and(|h| h.contains("BEGIN … COMMIT")),
        "{err:?}"
    );
    // A process behind the stored schema version: the gate's refusal, before any fallback.
    exec(
        &mut c,
        "INSERT INTO syncular.sync_schema_meta (id, schema_version) VALUES (1, 3)",
    );
    let before = snapshot(&mut c);
    expect_error(at(&mut c, 2), "SY002", "sync.schema_not_ready", None);
    // The same process with a push schema at its version is refused under the lock as before.
    expect_error(at(&mut c, 1), "SY002", "sync.schema_not_ready", None);
    unchanged(&mut c, &before);
}

/// Issue 28: the push reads its push schema and its tables' registrations below SQL and keeps
/// what it parsed per backend (docs/BENCHMARKS.md, "Server CPU"). What another session changes
/// is seen by the very next push of a backend that kept the earlier state: a push schema replaced
/// at the same version (its scopes), and a table registered to another relation.
#[test]
fn what_another_session_changes_the_next_push_of_every_backend_sees() {
    let (db, mut c) = fixture("np_kept");
    let mut pusher = db.connect();
    let op = up(&mut pusher, "tasks", "t1", None, task("t1", "p1"));
    assert_eq!(push(&mut pusher, "k1", &[op])["outcome"], "applied");
    // The same version's push schema, replaced: `tasks` is scoped by a variable the pushes'
    // `allowed` does not grant.
    let mut changed = schema();
    changed["tasks"]["scopes"] = json!([{"variable": "team", "column": "project_id"}]);
    let n: i32 = one(
        &mut c,
        "SELECT syncular.set_push_schema($1, $2)",
        &[&V, &changed],
    );
    assert_eq!(n, 7);
    let op = up(&mut pusher, "tasks", "t2", None, task("t2", "p1"));
    let kept = push(&mut pusher, "k2", from_ref(&op));
    let mut fresh = db.connect();
    let cold = push(&mut fresh, "k2-fresh", from_ref(&op));
    assert_eq!(record(&kept), record(&cold), "{kept} / {cold}");
    assert_eq!(record(&kept)["code"], "sync.forbidden", "{kept}");
    // Back to the fixture's schema, and `tasks` registered to another relation.
    let n: i32 = one(
        &mut c,
        "SELECT syncular.set_push_schema($1, $2)",
        &[&V, &schema()],
    );
    assert_eq!(n, 7);
    exec(
        &mut c,
        "CREATE TABLE public.np_tasks2 (LIKE public.np_tasks INCLUDING ALL);
         SELECT syncular.retire_table('tasks');
         SELECT syncular.register_table('tasks', 'public.np_tasks2');",
    );
    let op = up(&mut pusher, "tasks", "t3", None, task("t3", "p1"));
    assert_eq!(push(&mut pusher, "k3", &[op])["outcome"], "applied");
    assert_eq!(count(&mut c, "public.np_tasks2 WHERE id = 't3'"), 1);
    assert_eq!(
        count(&mut c, "public.np_tasks"),
        1,
        "only t1, pushed before"
    );
    // Retired: the next push of the backend that kept the registration falls back.
    exec(&mut c, "SELECT syncular.retire_table('tasks')");
    let op = up(&mut pusher, "tasks", "t4", None, task("t4", "p1"));
    let out = push(&mut pusher, "k4", &[op]);
    assert_eq!(out["outcome"], "fallback", "{out}");
    assert_eq!(out["reason"], "schema_not_registered", "{out}");
}

/// A row statement's kept plan is kept per argument types as well as per text: `public.np_kx`
/// dropped and made again under its name with `score` a `bigint` instead of a `double
/// precision`, registered under another name whose push schema says so, has the same statement
/// text, and the plan kept for the old table read the new push's `bigint` datum as a `double
/// precision` (the value stored was the bits of the other type). The same backend pushes before
/// and after; the stored columns are what the payloads say, every way (red team 34, F1: the
/// single-row statement a host row trigger puts the table on).
#[test]
fn a_table_made_again_with_other_column_types_gets_a_plan_of_its_own() {
    let (db, mut c) = fixture("np_retyped");
    let mut pusher = db.connect();
    let mut both = schema();
    for (name, ty) in [("kx_float", "float"), ("kx_int", "integer")] {
        both[name] = scoped(
            json!([
                col("id", "integer", false),
                col("project_id", "string", false),
                col("score", ty, true)
            ]),
            project("project_id"),
        );
    }
    let n: i32 = one(
        &mut c,
        "SELECT syncular.set_push_schema($1, $2)",
        &[&V, &both],
    );
    assert_eq!(n, 9);
    exec(
        &mut c,
        "CREATE FUNCTION public.np_noop() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NEW; END$$;",
    );
    let remake = |c: &mut Client, retire: Option<&str>, name: &str, score_type: &str| {
        let retire = retire.map_or(String::new(), |old| {
            format!("SELECT syncular.retire_table('{old}'); DROP TABLE public.np_kx;")
        });
        exec(
            c,
            &format!(
                "{retire}
                 CREATE TABLE public.np_kx (\"_sync_partition\" text NOT NULL, \"_sync_row_id\" text NOT NULL,
                   id bigint, project_id text, score {score_type},
                   \"_sync_server_version\" bigint NOT NULL, \"_sync_scopes\" jsonb NOT NULL,
                   \"_sync_payload\" bytea NOT NULL, \"_sync_column_versions\" bytea,
                   PRIMARY KEY (\"_sync_partition\", \"_sync_row_id\"));
                 CREATE TRIGGER noop BEFORE INSERT OR UPDATE ON public.np_kx
                   FOR EACH ROW EXECUTE FUNCTION public.np_noop();
                 SELECT syncular.register_table('{name}', 'public.np_kx');"
            ),
        );
    };
    let scores = |c: &mut Client| -> Vec<(String, Option<String>)> {
        c.query(
            "SELECT _sync_row_id, score::text FROM public.np_kx ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
    };
    let mut push_one = |tbl: &str, id: i64, score: Value| {
        let op = up(
            &mut pusher,
            tbl,
            &id.to_string(),
            None,
            json!({"id": id, "project_id": "p1", "score": score}),
        );
        let out = push(&mut pusher, &format!("k{id}"), &[op]);
        assert_eq!(out["outcome"], "applied", "{out}");
    };
    remake(&mut c, None, "kx_float", "double precision");
    push_one("kx_float", 1, json!(1.5));
    assert_eq!(scores(&mut c), [("1".into(), Some("1.5".into()))]);
    remake(&mut c, Some("kx_float"), "kx_int", "bigint");
    push_one("kx_int", 2, json!(42));
    assert_eq!(scores(&mut c), [("2".into(), Some("42".into()))]);
    // And back: the backend keeps both plans, each used with its own types.
    remake(&mut c, Some("kx_int"), "kx_float", "double precision");
    push_one("kx_float", 3, json!(2.25));
    assert_eq!(scores(&mut c), [("3".into(), Some("2.25".into()))]);
}

/// The locked re-check (C4) looks the push result up again only where another transaction ended
/// since the optimistic read (C1) found none (`heap::Seen`; docs/BENCHMARKS.md, issue 28 step
/// 9): a push then scans the result's index twice — C1 and its own insert's uniqueness check —
/// not three times. Where one ended in between, C4 reads and replays (NP-23 above). Other tests
/// commit on this cluster meanwhile, so of 50 pushes some may read again: at least one must not.
#[test]
fn the_locked_recheck_reads_again_only_where_another_transaction_ended() {
    let (_db, mut c) = fixture("c4_seen");
    let op = up(&mut c, "tasks", "t1", None, task("t1", "p1"));
    // This backend's count not yet reported (it may hold earlier transactions' too).
    let counted = |c: &mut Client| -> i64 {
        one(
            c,
            "SELECT pg_stat_get_xact_numscans('syncular.sync_push_results_pkey'::regclass)",
            &[],
        )
    };
    let mut scans = Vec::new();
    for i in 0..50 {
        exec(&mut c, "BEGIN");
        let before = counted(&mut c);
        let out = try_push(&mut c, &format!("k{i}"), from_ref(&op), json!({})).unwrap();
        assert_eq!(out["outcome"], "applied", "{out}");
        scans.push(counted(&mut c) - before);
        exec(&mut c, "COMMIT");
    }
    assert!(
        scans.iter().all(|n| *n == 2 || *n == 3),
        "index scans per push: {scans:?}"
    );
    assert!(scans.contains(&2), "C4 read again every time: {scans:?}");
}

/// Red team 40, F1: a push of a key its own transaction already pushed, read in a cursor whose
/// snapshot predates the first push and fetched in a savepoint that has no transaction id of
/// its own — C1 reads with the cursor's snapshot and finds nothing, and C4 was skipped because
/// no other transaction had ended (the fingerprint does not cover the reader's own writes): the
/// second push appended a commit and failed on the one-result guard. It replays now, with one
/// commit for the key.
#[test]
fn a_key_pushed_again_by_its_own_transaction_replays_whatever_snapshot_the_call_reads_with() {
    let (_db, mut c) = fixture("c4_own");
    let op = up(&mut c, "tasks", "t1", None, task("t1", "p1"));
    let tables = vec!["tasks"];
    let ids = vec!["t1"];
    let kinds: Vec<i16> = vec![op.kind];
    let bvs: Vec<Option<i64>> = vec![op.bv];
    let payloads: Vec<Option<&[u8]>> = vec![op.payload.as_deref()];
    let options = json!({});
    let allowed = allowed();
    let params: [&(dyn postgres::types::ToSql + Sync); 12] = [
        &P,
        &"c1",
        &"k-own",
        &NOW,
        &V,
        &Some(&allowed),
        &tables,
        &ids,
        &kinds,
        &bvs,
        &payloads,
        &options,
    ];
    let mut t = c.transaction().unwrap();
    t.execute(
        &format!("DECLARE c NO SCROLL CURSOR FOR {PUSH_SQL}"),
        &params,
    )
    .unwrap();
    let first: Value = t.query_one(PUSH_SQL, &params).unwrap().get(0);
    assert_eq!(first["outcome"], "applied", "{first}");
    t.batch_execute("SAVEPOINT s").unwrap();
    let again: Value = t
        .query_one("FETCH c", &[])
        .map_err(|e| sql_error(&e))
        .unwrap_or_else(|e| panic!("the second push: {e:?}"))
        .get(0);
    assert_eq!(again["replayed"], true, "{again}");
    assert_eq!(again["commitSeq"], first["commitSeq"], "{again}");
    t.commit().unwrap();
    let commits: i64 = one(
        &mut c,
        "SELECT count(*) FROM syncular.sync_commits WHERE partition = $1 AND client_commit_id = 'k-own'",
        &[&P],
    );
    assert_eq!(commits, 1);
}

/// Red team 40, F3: a stored row whose `_sync_scopes` the host nested deeper than a document can
/// be parsed (here 200 levels, and 5,000) ended a push touching the row, and `get_row_scopes`,
/// in an uncoded panic message (XX000). The push refuses it as it refuses any scope value that
/// is not a string (`SY005`, at the change's path), and the readers that return stored scopes
/// answer `SY005` (`_sync_scopes`, `too_deep`) naming the row; 100 levels still read as stored.
#[test]
fn scopes_stored_nested_too_deep_end_in_a_coded_error() {
    let (_db, mut c) = fixture("deep_scopes");
    let op = up(&mut c, "tasks", "t1", None, task("t1", "p1"));
    let first = push(&mut c, "k0", &[op]);
    assert_eq!(first["outcome"], "applied", "{first}");
    exec(
        &mut c,
        "SELECT syncular.set_blob_refs('part-1', 'tasks', 't1', ARRAY['sha256:deep'])",
    );
    let nested = |levels: usize| {
        format!(
            "{{\"project_id\": {}\"p1\"{}}}",
            "[".repeat(levels),
            "]".repeat(levels)
        )
    };
    for levels in [200, 5000] {
        c.execute(
            "UPDATE public.np_tasks SET \"_sync_scopes\" = $1::text::jsonb WHERE \"_sync_row_id\" = 't1'",
            &[&nested(levels)],
        )
        .unwrap();
        let op = up(&mut c, "tasks", "t1", Some(1), task("t1", "p1"));
        let out = try_push(&mut c, &format!("k-deep-{levels}"), &[op], json!({}));
        expect_error(
            out,
            "SY005",
            "sync.storage.invalid_commit",
            Some(json!({"path": "changes[0].scopes.project_id", "reason": "type"})),
        );
        for read in [
            "SELECT syncular.get_row_scopes('part-1', 'tasks', 't1')",
            "SELECT syncular.rows_referencing_blob('part-1', 'sha256:deep')",
        ] {
            let err = expect_error(
                try_one::<Value>(&mut c, read, &[]),
                "SY005",
                "sync.storage.invalid_commit",
                Some(json!({"path": "_sync_scopes", "reason": "too_deep"})),
            );
            assert!(err.hint.unwrap_or_default().contains("\"t1\""), "{read}");
        }
    }
    c.execute(
        "UPDATE public.np_tasks SET \"_sync_scopes\" = $1::text::jsonb WHERE \"_sync_row_id\" = 't1'",
        &[&nested(100)],
    )
    .unwrap();
    let read: Value = one(
        &mut c,
        "SELECT syncular.get_row_scopes('part-1', 'tasks', 't1')",
        &[],
    );
    assert_eq!(
        read["scopes"],
        serde_json::from_str::<Value>(&nested(100)).unwrap()
    );
}
