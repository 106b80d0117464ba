//! docs/SCENARIOS.md: clients and cursors, blob references, registry and admin reads.

use serde_json::{json, Value};
use syncular_multisession::*;

fn record(cursor: i64, updated: i64) -> Value {
    json!({"clientId":"c1","actorId":"a1","wireVersion":2,"cursor":cursor,"updatedAtMs":updated,
           "subscriptions":[{"id":"s1","table":"tasks","scopes":{"project_id":["p1"]}}]})
}

fn put_client(c: &mut postgres::Client, p: &str, r: &Value) -> Result<u64, postgres::Error> {
    c.execute("SELECT syncular.put_client($1, $2)", &[&p, r])
}

fn cursor_of(c: &mut postgres::Client) -> i64 {
    one::<Value>(c, "SELECT syncular.get_client($1, 'c1')", &[&P])["cursor"]
        .as_i64()
        .unwrap()
}

#[test]
fn cli_01_round_trip_put_overwrites() {
    let db = TestDb::new("cli01");
    let mut c = db.connect();
    put_client(&mut c, P, &record(42, NOW)).unwrap();
    assert_eq!(
        one::<Value>(&mut c, "SELECT syncular.get_client($1, 'c1')", &[&P]),
        record(42, NOW)
    );
    assert_eq!(
        one::<Value>(&mut c, "SELECT syncular.list_client_cursors($1)", &[&P]),
        json!([{"clientId":"c1","cursor":42,"updatedAtMs":NOW}])
    );
    for cursor in [99, 5, -1] {
        put_client(&mut c, P, &record(cursor, NOW)).unwrap();
        assert_eq!(cursor_of(&mut c), cursor);
    }
    let mut bad = record(1, NOW);
    bad["subscriptions"][0]["scopes"] = json!({"project_id": "p1"});
    expect_error(
        put_client(&mut c, P, &bad),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument":"record.subscriptions[0].scopes","reason":"type"})),
    );
    let mut bad = record(1, NOW);
    bad["cursor"] = json!(1.5);
    expect_error(
        put_client(&mut c, P, &bad),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument":"record.cursor","reason":"type"})),
    );
}

#[test]
fn cli_02_guarded_cursor_advance() {
    let db = TestDb::new("cli02");
    let mut c = db.connect();
    one::<Value>(
        &mut c,
        "SELECT syncular.touch_partition($1, $2, 'e1')",
        &[&P, &NOW],
    );
    put_client(&mut c, P, &record(10, NOW)).unwrap();
    let advance =
        |c: &mut postgres::Client, actor: &str, epoch: &str, cursor: i64, at: i64| -> bool {
            one(
                c,
                "SELECT syncular.advance_client_cursor($1, 'c1', $2, $3, $4, $5)",
                &[&P, &actor, &epoch, &cursor, &at],
            )
        };
    assert!(advance(&mut c, "a1", "e1", 12, NOW + 1));
    assert_eq!(cursor_of(&mut c), 12);
    assert!(!advance(&mut c, "a2", "e1", 20, NOW + 1));
    assert!(!advance(&mut c, "a1", "e0", 20, NOW + 1));
    assert!(advance(&mut c, "a1", "e1", 5, NOW));
    let r: Value = one(&mut c, "SELECT syncular.get_client($1, 'c1')", &[&P]);
    assert_eq!(
        (r["cursor"].clone(), r["updatedAtMs"].clone()),
        (json!(12), json!(NOW + 1))
    );
    assert!(one::<bool>(
        &mut c,
        "SELECT syncular.update_client_cursor($1, 'c1', 20, $2)",
        &[&P, &(NOW + 2)]
    ));
    assert_eq!(cursor_of(&mut c), 20);
    assert!(!one::<bool>(
        &mut c,
        "SELECT syncular.update_client_cursor($1, 'nobody', 20, $2)",
        &[&P, &(NOW + 2)]
    ));
}

#[test]
fn cli_03_record_listing_and_floor() {
    let db = TestDb::new("cli03");
    let mut c = db.connect();
    put_client(&mut c, P, &record(3, NOW)).unwrap();
    let mut second = record(-1, NOW + 5);
    second["clientId"] = json!("c2");
    put_client(&mut c, P, &second).unwrap();
    let listed: Value = one(&mut c, "SELECT syncular.list_clients($1)", &[&P]);
    let ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["clientId"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["c2", "c1"]);
    assert_eq!(
        one::<Option<i64>>(
            &mut c,
            "SELECT syncular.active_cursor_floor($1, $2)",
            &[&P, &NOW]
        ),
        Some(-1)
    );
    assert_eq!(
        one::<Option<i64>>(
            &mut c,
            "SELECT syncular.active_cursor_floor($1, $2)",
            &[&P, &(NOW + 6)]
        ),
        None
    );
    assert_eq!(
        one::<Option<i64>>(
            &mut c,
            "SELECT syncular.active_cursor_floor('other', 0)",
            &[]
        ),
        None
    );
}

fn blob_rows(c: &mut postgres::Client, blob: &str) -> Vec<String> {
    one::<Value>(
        c,
        "SELECT syncular.rows_referencing_blob($1, $2)",
        &[&P, &blob],
    )
    .as_array()
    .unwrap()
    .iter()
    .map(|r| r["rowId"].as_str().unwrap().to_string())
    .collect()
}

fn set_refs(c: &mut postgres::Client, row: &str, ids: &[&str]) -> i32 {
    let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
    one(
        c,
        "SELECT syncular.set_blob_refs($1, 'docs', $2, $3)",
        &[&P, &row, &ids],
    )
}

fn blob_ids(c: &mut postgres::Client) -> Vec<String> {
    one(c, "SELECT syncular.referenced_blob_ids($1)", &[&P])
}

#[test]
fn blb_01_round_trip() {
    let db = TestDb::new("blb01");
    let mut c = db.connect();
    for (id, p) in [("d1", "p1"), ("d2", "p2"), ("d3", "p1")] {
        put_row(
            &mut c,
            P,
            "docs",
            id,
            &json!({"org_id":"o1","project_id":p}),
            1,
            &[1],
        );
    }
    set_refs(&mut c, "d1", &["aa", "bb"]);
    set_refs(&mut c, "d2", &["aa"]);
    set_refs(&mut c, "d3", &["cc"]);
    assert_eq!(
        one::<Value>(
            &mut c,
            "SELECT syncular.rows_referencing_blob($1, 'aa')",
            &[&P]
        ),
        json!([{"table":"docs","rowId":"d1","scopes":{"org_id":"o1","project_id":"p1"}},
               {"table":"docs","rowId":"d2","scopes":{"org_id":"o1","project_id":"p2"}}])
    );
    assert_eq!(blob_ids(&mut c), vec!["aa", "bb", "cc"]);
}

#[test]
fn blb_02_replacement() {
    let db = TestDb::new("blb02");
    let mut c = db.connect();
    put_row(&mut c, P, "docs", "d1", &p1(), 1, &[1]);
    set_refs(&mut c, "d1", &["aa", "bb"]);
    set_refs(&mut c, "d1", &["cc"]);
    assert!(blob_rows(&mut c, "aa").is_empty());
    assert_eq!(blob_rows(&mut c, "cc"), vec!["d1"]);
    assert_eq!(blob_ids(&mut c), vec!["cc"]);
    assert_eq!(set_refs(&mut c, "d1", &["cc", "cc"]), 1);
}

#[test]
fn blb_03_empty_set_and_delete() {
    let db = TestDb::new("blb03");
    let mut c = db.connect();
    put_row(&mut c, P, "docs", "d1", &p1(), 1, &[1]);
    put_row(&mut c, P, "docs", "d2", &p1(), 1, &[1]);
    set_refs(&mut c, "d1", &["aa"]);
    set_refs(&mut c, "d2", &["bb"]);
    set_refs(&mut c, "d1", &[]);
    assert!(blob_rows(&mut c, "aa").is_empty());
    del_row(&mut c, P, "docs", "d2");
    assert!(blob_rows(&mut c, "bb").is_empty());
    assert!(blob_ids(&mut c).is_empty());
    // A reference whose app row vanished without a metadata call is skipped.
    put_row(&mut c, P, "docs", "d3", &p1(), 1, &[1]);
    set_refs(&mut c, "d3", &["dd"]);
    exec(
        &mut c,
        "DELETE FROM public.docs WHERE \"_sync_row_id\" = 'd3'",
    );
    assert!(blob_rows(&mut c, "dd").is_empty());
    expect_error(
        c.query_one(
            "SELECT syncular.set_blob_refs($1, 'docs', 'd1', ARRAY['a', NULL])",
            &[&P],
        ),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument":"blob_ids","reason":"missing"})),
    );
}

#[test]
fn reg_01_refresh_list_rotate() {
    let db = TestDb::new("reg01");
    let mut c = db.connect();
    assert!(one::<Vec<String>>(&mut c, "SELECT syncular.list_partitions()", &[]).is_empty());
    assert_eq!(
        one::<Value>(&mut c, "SELECT syncular.list_partition_registry()", &[]),
        json!([])
    );
    let touch = |c: &mut postgres::Client, p: &str, at: i64, e: &str| -> Value {
        one(
            c,
            "SELECT syncular.touch_partition($1, $2, $3)",
            &[&p, &at, &e],
        )
    };
    touch(&mut c, "part-b", NOW, "epoch-b");
    touch(&mut c, "part-a", NOW + 1, "epoch-a");
    let entry = touch(&mut c, "part-a", NOW + 2, "ignored-racing-epoch");
    assert_eq!(
        entry,
        json!({"partition":"part-a","logEpoch":"epoch-a","epochRequired":false,"lastAuthenticatedAtMs":NOW + 2})
    );
    assert_eq!(
        one::<Vec<String>>(&mut c, "SELECT syncular.list_partitions()", &[]),
        vec!["part-a", "part-b"]
    );
    assert_eq!(
        one::<Value>(&mut c, "SELECT syncular.list_partition_registry()", &[]),
        json!([entry, {"partition":"part-b","logEpoch":"epoch-b","epochRequired":false,"lastAuthenticatedAtMs":NOW}])
    );
    put_client(&mut c, "part-a", &record(1, NOW)).unwrap();
    assert_eq!(
        one::<Value>(
            &mut c,
            "SELECT syncular.rotate_log_epoch('part-a', 'epoch-after-restore', $1)",
            &[&(NOW + 3)]
        ),
        json!({"partition":"part-a","logEpoch":"epoch-after-restore","epochRequired":true,"lastAuthenticatedAtMs":NOW + 3})
    );
    assert_eq!(count(&mut c, "syncular.sync_clients"), 0);
    assert_eq!(
        one::<Option<String>>(&mut c, "SELECT syncular.get_log_epoch('part-a')", &[]),
        Some("epoch-after-restore".into())
    );
    expect_error(
        try_one::<Value>(
            &mut c,
            "SELECT syncular.touch_partition($1, $2, '')",
            &[&P, &NOW],
        ),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument":"initial_log_epoch","reason":"empty"})),
    );
}

#[test]
fn reg_02_partition_state() {
    let db = TestDb::new("reg02");
    let mut c = db.connect();
    assert_eq!(
        one::<Value>(&mut c, "SELECT syncular.partition_state('unknown')", &[]),
        json!({"maxCommitSeq":0,"horizonSeq":0,"logEpoch":null,"epochRequired":false})
    );
    append(&mut c, P, "tasks", "t1", Some(V));
    append(&mut c, P, "tasks", "t2", Some(V));
    one::<Value>(
        &mut c,
        "SELECT syncular.touch_partition($1, $2, 'e')",
        &[&P, &NOW],
    );
    one::<i64>(&mut c, "SELECT syncular.set_horizon_seq($1, 1)", &[&P]);
    assert_eq!(
        one::<Value>(&mut c, "SELECT syncular.partition_state($1)", &[&P]),
        json!({"maxCommitSeq":2,"horizonSeq":1,"logEpoch":"e","epochRequired":false})
    );
}

#[test]
fn adm_01_admin_reads() {
    let db = TestDb::new("adm01");
    let mut c = db.connect();
    push_upserts(&mut c, P, "c1", "k0", &[("tasks", "r0", p1())], &json!([]));
    push_upserts(
        &mut c,
        P,
        "c1",
        "k1",
        &[("tasks", "r1", json!({"project_id":"p2"}))],
        &json!([]),
    );
    put_client(&mut c, P, &record(2, NOW)).unwrap();
    let clients: Value = one(&mut c, "SELECT syncular.list_clients($1)", &[&P]);
    assert_eq!(clients.as_array().unwrap().len(), 1);
    assert_eq!(clients[0]["cursor"], json!(2));
    let meta: Value = one(
        &mut c,
        "SELECT syncular.list_commit_metadata($1, 0, 10)",
        &[&P],
    );
    assert_eq!(meta.as_array().unwrap().len(), 2);
    assert_eq!(
        meta[0],
        json!({"commitSeq":2,"clientId":"c1","clientCommitId":"k1","actorId":"a1","createdAtMs":NOW,"changeCount":1,"tables":["tasks"]})
    );
    assert_eq!(meta[1]["commitSeq"], json!(1));
    assert_eq!(
        one::<Value>(
            &mut c,
            "SELECT syncular.list_commit_metadata($1, 0, 10, 'docs')",
            &[&P]
        ),
        json!([])
    );
    assert_eq!(
        one::<Value>(
            &mut c,
            "SELECT syncular.scope_activity($1, 'project_id', 'p1', 10)",
            &[&P]
        ),
        json!([{"commitSeq":1,"table":"tasks","actorId":"a1","createdAtMs":NOW,"changeCount":1}])
    );
    assert_eq!(
        one::<Option<Value>>(
            &mut c,
            "SELECT syncular.get_row_scopes($1, 'tasks', 'r0')",
            &[&P]
        ),
        Some(json!({"serverVersion":1,"scopes":{"project_id":"p1"}}))
    );
    assert_eq!(
        one::<Option<Value>>(
            &mut c,
            "SELECT syncular.get_row_scopes($1, 'tasks', 'missing')",
            &[&P]
        ),
        None
    );
}

#[test]
fn adm_02_multi_table_commits() {
    let db = TestDb::new("adm02");
    let mut c = db.connect();
    let d = doc(
        "k",
        json!([chg("tasks", "t1"), chg("tasks", "t2"), chg("docs", "d1")]),
        Some(V),
    );
    one::<i64>(&mut c, "SELECT syncular.append_commit($1, $2)", &[&P, &d]);
    let meta: Value = one(
        &mut c,
        "SELECT syncular.list_commit_metadata($1, 0, 10)",
        &[&P],
    );
    assert_eq!(
        (meta[0]["changeCount"].clone(), meta[0]["tables"].clone()),
        (json!(3), json!(["docs", "tasks"]))
    );
    let docs: Value = one(
        &mut c,
        "SELECT syncular.list_commit_metadata($1, 0, 10, 'docs')",
        &[&P],
    );
    assert_eq!(docs.as_array().unwrap().len(), 1);
    let activity: Value = one(
        &mut c,
        "SELECT syncular.scope_activity($1, 'project_id', 'p1', 10)",
        &[&P],
    );
    assert_eq!(
        activity,
        json!([{"commitSeq":1,"table":"docs","actorId":"a1","createdAtMs":NOW,"changeCount":1},
                                {"commitSeq":1,"table":"tasks","actorId":"a1","createdAtMs":NOW,"changeCount":2}])
    );
}
