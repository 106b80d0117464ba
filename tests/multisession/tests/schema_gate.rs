//! docs/SCENARIOS.md: the schema barrier and the serve gate (SCH-01 … SCH-12, GATE-01 … GATE-07).

use serde_json::{json, Value};
use std::thread;
use syncular_multisession::*;

const TP: &str = "tasks-projection";

fn check(
    c: &mut postgres::Client,
    v: i64,
    layouts: &Value,
    declared: Option<&Value>,
) -> Result<String, postgres::Error> {
    match declared {
        Some(d) => try_one(
            c,
            "SELECT syncular.check_schema($1, $2, $3)",
            &[&v, layouts, d],
        ),
        None => try_one(c, "SELECT syncular.check_schema($1, $2)", &[&v, layouts]),
    }
}

fn incomplete(projection: &str) -> Option<Value> {
    Some(json!({"partition":"part-1","projection":projection}))
}

fn marker(c: &mut postgres::Client) -> (i64, Value, i64) {
    let r = c
        .query_one("SELECT schema_version, layouts, required_writer_version FROM syncular.sync_schema_meta", &[])
        .unwrap();
    let layouts: String = r.get(1);
    (r.get(0), serde_json::from_str(&layouts).unwrap(), r.get(2))
}

fn previous_schema(tx: &mut impl postgres::GenericClient) -> Option<Value> {
    tx.query_one("SELECT syncular.previous_schema()", &[])
        .unwrap()
        .get(0)
}

#[test]
fn sch_01_a_fresh_database_migrates_then_is_current() {
    let db = TestDb::new("sch01");
    let mut c = db.connect();
    assert_eq!(check(&mut c, 1, &l1(), None).unwrap(), "migrate");
    let mut tx = c.transaction().unwrap();
    assert_eq!(
        tx.query_one("SELECT syncular.migrate_schema(1, $1)", &[&l1()])
            .unwrap()
            .get::<_, i64>(0),
        0
    );
    assert_eq!(
        previous_schema(&mut tx),
        Some(json!({"schemaVersion":0,"layouts":{}}))
    );
    tx.commit().unwrap();
    assert_eq!(check(&mut c, 1, &l1(), None).unwrap(), "current");
    assert_eq!(marker(&mut c), (1, l1(), 1));
    // previous_schema is transaction-local.
    assert_eq!(previous_schema(&mut c), None);
}

#[test]
fn sch_02_an_omitted_declaration_is_refused_until_activation() {
    let db = TestDb::new("sch02");
    let mut c = db.connect();
    migrate(&mut c, 1, &l1(), &json!([]));
    declare(&mut c, P, TP, 1, NOW);
    let code = ("SY013", "sync.storage.checkpoint_incomplete");
    expect_error(
        check(&mut c, 1, &l1(), None),
        code.0,
        code.1,
        incomplete(TP),
    );
    expect_error(
        check(&mut c, 1, &l1(), Some(&json!([]))),
        code.0,
        code.1,
        incomplete(TP),
    );
    assert_eq!(
        check(&mut c, 1, &l1(), Some(&json!([decl(P, TP, 1)]))).unwrap(),
        "current"
    );
    assert_eq!(
        try_activate(&mut c, P, TP, 0, 0, &["tasks"], NOW).unwrap(),
        "activated"
    );
    assert_eq!(check(&mut c, 1, &l1(), None).unwrap(), "current");
}

#[test]
fn sch_03_a_restart_with_matching_declarations_is_a_noop() {
    let db = TestDb::new("sch03");
    let mut c = db.connect();
    migrate(&mut c, 1, &l1(), &json!([]));
    declare(&mut c, P, TP, 1, NOW);
    let owner = claim(&mut c, P, TP, 1, NOW);
    let fence = fence_of(&mut c, P);
    assert_eq!(
        check(&mut c, 1, &l1(), Some(&json!([decl(P, TP, 1)]))).unwrap(),
        "current"
    );
    assert_eq!(read_checkpoint(&mut c, P, TP), Some(owner));
    assert_eq!(fence_of(&mut c, P), fence);
}

#[test]
fn sch_04_two_processes_with_different_declaration_sets() {
    let db = TestDb::new("sch04");
    let mut c = db.connect();
    migrate(&mut c, 1, &l1(), &json!([]));
    assert_eq!(declare(&mut c, P, "set-a", 1, NOW).3, "declared");
    assert_eq!(declare(&mut c, P, "set-b", 1, NOW).3, "declared");
    assert_eq!(fence_of(&mut c, P), Some(1));
    expect_error(
        check(&mut c, 1, &l1(), Some(&json!([decl(P, "set-b", 1)]))),
        "SY013",
        "sync.storage.checkpoint_incomplete",
        incomplete("set-a"),
    );
    let both = json!([decl(P, "set-a", 1), decl(P, "set-b", 1)]);
    assert_eq!(check(&mut c, 1, &l1(), Some(&both)).unwrap(), "current");
    declare(&mut c, P, "later", 2, NOW);
    assert_eq!(check(&mut c, 1, &l1(), Some(&both)).unwrap(), "current");
}

#[test]
fn sch_05_a_newer_stored_schema_is_refused_at_startup() {
    let db = TestDb::new("sch05");
    let mut c = db.connect();
    migrate(&mut c, 2, &l2(), &json!([]));
    let newer = Some(json!({"storedSchemaVersion":2,"runningSchemaVersion":1}));
    expect_error(
        check(&mut c, 1, &l1(), None),
        "SY020",
        "sync.storage.schema_newer",
        newer.clone(),
    );
    let mut tx = c.transaction().unwrap();
    expect_error(
        tx.query_one("SELECT syncular.migrate_schema(1, $1)", &[&l1()]),
        "SY020",
        "sync.storage.schema_newer",
        newer,
    );
}

#[test]
fn sch_06_stored_layouts_must_match_at_the_same_version() {
    let db = TestDb::new("sch06");
    let mut c = db.connect();
    migrate(&mut c, 1, &l1(), &json!([]));
    let mut not_null = l1();
    not_null["tasks"][2]["nullable"] = json!(false);
    let mut without_docs = l1();
    without_docs.as_object_mut().unwrap().remove("docs");
    let code = ("SY021", "sync.storage.stored_layout_mismatch");
    let err = expect_error(
        check(&mut c, 1, &not_null, None),
        code.0,
        code.1,
        Some(json!({"table":"tasks","column":"data"})),
    );
    // The hint says what differs and what fixes it (issue 27, item 7).
    let hint = err.hint.unwrap_or_default();
    assert!(
        hint.contains("column 2: this process has")
            && hint.contains("\"nullable\":false")
            && hint.contains("\"nullable\":true")
            && hint.contains("migrate to a new version"),
        "{hint}"
    );
    let err = expect_error(
        check(&mut c, 1, &without_docs, None),
        code.0,
        code.1,
        Some(json!({"table":"docs"})),
    );
    assert!(err
        .hint
        .unwrap_or_default()
        .contains("retired by migrating"));
    expect_error(
        check(&mut c, 1, &l2(), None),
        code.0,
        code.1,
        Some(json!({"table":"tasks","column":"note"})),
    );
}

#[test]
fn sch_07_migrate_schema_must_open_its_transaction() {
    let db = TestDb::new("sch07");
    let mut c = db.connect();
    let state = |reason: &str| Some(json!({ "reason": reason }));
    let code = ("SY004", "sync.storage.invalid_transaction_state");
    expect_error(
        try_one::<i64>(&mut c, "SELECT syncular.migrate_schema(1, $1)", &[&l1()]),
        code.0,
        code.1,
        state("no_transaction_block"),
    );
    exec(&mut c, "BEGIN");
    one::<Value>(
        &mut c,
        "SELECT syncular.touch_partition($1, $2, 'e')",
        &[&P, &NOW],
    );
    expect_error(
        try_one::<i64>(&mut c, "SELECT syncular.migrate_schema(1, $1)", &[&l1()]),
        code.0,
        code.1,
        state("prior_writes"),
    );
    exec(&mut c, "ROLLBACK; BEGIN ISOLATION LEVEL REPEATABLE READ");
    expect_error(
        try_one::<i64>(&mut c, "SELECT syncular.migrate_schema(1, $1)", &[&l1()]),
        code.0,
        code.1,
        state("isolation"),
    );
    exec(&mut c, "ROLLBACK");
    // A WITH HOLD cursor runs its query to the end at commit, after the migration's checks: a
    // function in it wrote old payloads back (red team 52, R52-2). Refused while one is open.
    exec(
        &mut c,
        "BEGIN; DECLARE held CURSOR WITH HOLD FOR SELECT g FROM generate_series(1, 3) g",
    );
    expect_error(
        try_one::<i64>(&mut c, "SELECT syncular.migrate_schema(1, $1)", &[&l1()]),
        code.0,
        code.1,
        state("holdable_cursor"),
    );
    exec(&mut c, "ROLLBACK");
    // The implicit block of a multi-statement query string counts as a transaction block.
    exec(
        &mut c,
        &format!(
            "SELECT syncular.migrate_schema(1, '{}'::jsonb); SELECT 1",
            l1()
        ),
    );
    assert_eq!(marker(&mut c).0, 1);
}

#[test]
fn sch_08_migrate_schema_installs_declarations_fences_and_the_floor() {
    let db = TestDb::new("sch08");
    let mut c = db.connect();
    migrate(&mut c, 1, &l1(), &json!([]));
    let keep = declare(&mut c, P, "keep", 1, NOW);
    let declared = json!([
        decl(P, TP, 2),
        decl("part-2", "docs-projection", 2),
        decl(P, "keep", 1)
    ]);
    let mut tx = c.transaction().unwrap();
    let prev: i64 = tx
        .query_one(
            "SELECT syncular.migrate_schema(2, $1, $2)",
            &[&l2(), &declared],
        )
        .unwrap()
        .get(0);
    assert_eq!(prev, 1);
    assert_eq!(
        previous_schema(&mut tx),
        Some(json!({"schemaVersion":1,"layouts":l1()}))
    );
    let started: i64 = tx
        .query_one(
            "SELECT (extract(epoch FROM transaction_timestamp()) * 1000)::bigint",
            &[],
        )
        .unwrap()
        .get(0);
    let row = |tx: &mut postgres::Transaction, p: &str, n: &str| -> CheckpointRow {
        checkpoint_row(&tx.query_one(
            "SELECT * FROM syncular.sync_backfill_checkpoints WHERE partition = $1 AND name = $2", &[&p, &n]).unwrap())
    };
    assert_eq!(
        row(&mut tx, P, TP),
        (P.into(), TP.into(), 2, "declared".into(), 0, 0, 0, started)
    );
    assert_eq!(
        row(&mut tx, "part-2", "docs-projection"),
        (
            "part-2".into(),
            "docs-projection".into(),
            2,
            "declared".into(),
            0,
            0,
            0,
            started
        )
    );
    assert_eq!(row(&mut tx, P, "keep"), keep);
    tx.commit().unwrap();
    assert_eq!(fence_of(&mut c, P), Some(2));
    assert_eq!(fence_of(&mut c, "part-2"), Some(2));
    assert_eq!(marker(&mut c), (2, l2(), 2));
    let new_ones = json!([decl(P, TP, 2), decl("part-2", "docs-projection", 2)]);
    assert_eq!(check(&mut c, 2, &l2(), Some(&new_ones)).unwrap(), "current");
    expect_error(
        check(&mut c, 2, &l2(), None),
        "SY013",
        "sync.storage.checkpoint_incomplete",
        None,
    );
}

#[test]
fn sch_09_a_migration_that_finds_its_target_already_stored_writes_nothing() {
    let db = TestDb::new("sch09");
    let mut c = db.connect();
    migrate(&mut c, 2, &l2(), &json!([]));
    let mut tx = c.transaction().unwrap();
    let prev: i64 = tx
        .query_one(
            "SELECT syncular.migrate_schema(2, $1, $2)",
            &[&l2(), &json!([decl(P, "late", 2)])],
        )
        .unwrap()
        .get(0);
    assert_eq!(prev, 2);
    assert_eq!(
        previous_schema(&mut tx),
        Some(json!({"schemaVersion":2,"layouts":l2()}))
    );
    tx.commit().unwrap();
    assert_eq!(read_checkpoint(&mut c, P, "late"), None);
    assert_eq!(fence_of(&mut c, P), None);
    assert_eq!(marker(&mut c), (2, l2(), 2));
    let mut tx = c.transaction().unwrap();
    expect_error(
        tx.query_one("SELECT syncular.migrate_schema(2, $1)", &[&l1()]),
        "SY021",
        "sync.storage.stored_layout_mismatch",
        None,
    );
}

#[test]
fn sch_10_concurrent_migrators_migrate_once() {
    let db = TestDb::new("sch10");
    let mut c = db.connect();
    migrate(&mut c, 1, &l1(), &json!([]));
    let mut s1 = db.connect();
    exec(&mut s1, "BEGIN");
    assert_eq!(
        one::<i64>(&mut s1, "SELECT syncular.migrate_schema(2, $1)", &[&l2()]),
        1
    );
    let mut s2 = db.connect();
    let pid = backend_pid(&mut s2);
    let second = thread::spawn(move || {
        exec(&mut s2, "BEGIN");
        let prev: i64 = one(&mut s2, "SELECT syncular.migrate_schema(2, $1)", &[&l2()]);
        let previous = previous_schema(&mut s2).unwrap();
        if prev < 2 {
            exec(&mut s2, "ALTER TABLE public.tasks ADD COLUMN note text"); // would fail: twice
        }
        exec(&mut s2, "COMMIT");
        (prev, previous)
    });
    wait_until_blocked(&mut c, pid);
    exec(
        &mut s1,
        "ALTER TABLE public.tasks ADD COLUMN note text; COMMIT",
    );
    let (prev, previous) = second.join().unwrap();
    assert_eq!(prev, 2);
    assert_eq!(previous["schemaVersion"], json!(2));
    assert_eq!(marker(&mut c).0, 2);
    assert_eq!(
        count(
            &mut c,
            "information_schema.columns WHERE table_name = 'tasks' AND column_name = 'note'"
        ),
        1
    );
}

#[test]
fn sch_11_the_barrier_is_rechecked_under_the_lock() {
    let db = TestDb::new("sch11");
    let mut c = db.connect();
    migrate(&mut c, 1, &l1(), &json!([]));
    let mut s1 = db.connect();
    exec(&mut s1, "BEGIN");
    one::<i64>(
        &mut s1,
        "SELECT syncular.migrate_schema(2, $1, $2)",
        &[&l2(), &json!([decl(P, "x", 2)])],
    );
    let mut s2 = db.connect();
    let pid = backend_pid(&mut s2);
    let second = thread::spawn(move || {
        exec(&mut s2, "BEGIN");
        let r = try_one::<i64>(&mut s2, "SELECT syncular.migrate_schema(2, $1)", &[&l2()])
            .map_err(|e| sql_error(&e));
        exec(&mut s2, "ROLLBACK");
        r
    });
    wait_until_blocked(&mut c, pid);
    exec(&mut s1, "COMMIT");
    let err = second.join().unwrap().unwrap_err();
    assert_eq!(
        (err.state.as_str(), err.message.as_str()),
        ("SY013", "sync.storage.checkpoint_incomplete")
    );
    assert_eq!(
        err.detail,
        Some(json!({"partition":"part-1","projection":"x"}))
    );
}

#[test]
fn sch_12_a_later_migrator_learns_the_real_starting_point() {
    let db = TestDb::new("sch12");
    let mut c = db.connect();
    migrate(&mut c, 1, &l1(), &json!([]));
    let mut s2 = db.connect();
    assert_eq!(check(&mut s2, 3, &l3(), None).unwrap(), "migrate");
    let mut s1 = db.connect();
    migrate(&mut s1, 2, &l2(), &json!([]));
    let mut tx = s2.transaction().unwrap();
    assert_eq!(
        tx.query_one("SELECT syncular.migrate_schema(3, $1)", &[&l3()])
            .unwrap()
            .get::<_, i64>(0),
        2
    );
    assert_eq!(previous_schema(&mut tx).unwrap()["layouts"], l2());
    tx.commit().unwrap();
    assert_eq!(marker(&mut c).0, 3);
}

#[test]
fn gate_01_an_undeclared_pending_checkpoint_refuses_every_partition() {
    let db = TestDb::new("gate01");
    let mut c = db.connect();
    migrate(&mut c, 1, &l1(), &json!([]));
    declare(&mut c, P, TP, 1, NOW);
    assert_eq!(
        one::<Value>(&mut c, "SELECT syncular.read_serve_gate('part-2', 1)", &[]),
        json!({"storedSchemaVersion":1,"logEpoch":null,"pending":[{"partition":"part-1","name":TP}]})
    );
    assert_eq!(
        one::<Option<Value>>(
            &mut c,
            "SELECT syncular.serve_gate_refusal('part-2', 1)",
            &[]
        ),
        Some(json!({"kind":"checkpoint","partition":"part-1","projection":TP}))
    );
    expect_error(
        try_one::<Value>(&mut c, "SELECT syncular.assert_serve_ready($1, 1)", &[&P]),
        "SY002",
        "sync.schema_not_ready",
        incomplete(TP),
    );
    exec(&mut c, "BEGIN");
    expect_error(
        try_one::<Option<Value>>(
            &mut c,
            "SELECT syncular.push_begin($1, 'c1', 'k1', 1)",
            &[&P],
        ),
        "SY002",
        "sync.schema_not_ready",
        incomplete(TP),
    );
    exec(&mut c, "ROLLBACK");
    // After the rollback this session holds no lock on the allocator (nor does anyone else).
    assert_eq!(
        count(&mut c, "pg_locks l WHERE l.relation = 'syncular.sync_partitions'::regclass
                         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"),
        0
    );
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.max_commit_seq($1)", &[&P]),
        0
    );
}

#[test]
fn gate_02_the_declaring_process_is_served_and_passes_the_fence() {
    let db = TestDb::new("gate02");
    let mut c = db.connect();
    migrate(&mut c, 1, &l1(), &json!([]));
    declare(&mut c, P, TP, 1, NOW);
    let declared = json!([decl(P, TP, 1)]);
    assert_eq!(
        one::<Option<Value>>(
            &mut c,
            "SELECT syncular.serve_gate_refusal($1, 1, $2)",
            &[&P, &declared]
        ),
        None
    );
    let token: Value = one(
        &mut c,
        "SELECT syncular.assert_serve_ready($1, 1, $2)",
        &[&P, &declared],
    );
    assert_eq!(token["storedSchemaVersion"], json!(1));
    let mut tx = c.transaction().unwrap();
    let replay: Option<Value> = tx
        .query_one(
            "SELECT syncular.push_begin($1, 'c1', 'k1', 1, $2)",
            &[&P, &declared],
        )
        .unwrap()
        .get(0);
    assert_eq!(replay, None);
    tx.batch_execute("SAVEPOINT syncular_push_candidate")
        .unwrap();
    let d = doc("k1", json!([chg("tasks", "t1")]), Some(1));
    let s: i64 = tx
        .query_one("SELECT syncular.append_commit($1, $2)", &[&P, &d])
        .unwrap()
        .get(0);
    let result = json!({"status":"applied","commitSeq":s,"recordedAtMs":NOW,"cacheIdentity":"u1",
                        "results":[{"opIndex":0,"status":"applied"}]});
    let stored: Value = tx
        .query_one(
            "SELECT syncular.put_push_result($1, 'c1', 'k1', $2)",
            &[&P, &result],
        )
        .unwrap()
        .get(0);
    assert_eq!(stored, result);
    tx.commit().unwrap();
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.max_commit_seq($1)", &[&P]),
        1
    );
}

#[test]
fn gate_03_a_newer_stored_schema_is_refused_inside_the_pinned_snapshot() {
    let db = TestDb::new("gate03");
    let mut c = db.connect();
    migrate(&mut c, 2, &l2(), &json!([]));
    exec(&mut c, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY");
    expect_error(
        try_one::<Value>(&mut c, "SELECT syncular.assert_serve_ready($1, 1)", &[&P]),
        "SY002",
        "sync.schema_not_ready",
        Some(json!({"storedSchemaVersion":2,"runningSchemaVersion":1})),
    );
    exec(
        &mut c,
        "ROLLBACK; BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
    );
    let token: Value = one(&mut c, "SELECT syncular.assert_serve_ready($1, 2)", &[&P]);
    assert_eq!(token["storedSchemaVersion"], json!(2));
    assert_eq!(count(&mut c, "public.tasks"), 0);
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.max_commit_seq($1)", &[&P]),
        0
    );
    exec(&mut c, "COMMIT");
}

#[test]
fn gate_04_registered_query_path_refuses_a_pending_checkpoint_unless_declared() {
    let db = TestDb::new("gate04");
    let mut c = db.connect();
    migrate(&mut c, 1, &l1(), &json!([]));
    declare(&mut c, P, TP, 1, NOW);
    exec(&mut c, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY");
    expect_error(
        try_one::<Value>(&mut c, "SELECT syncular.assert_serve_ready($1, 1)", &[&P]),
        "SY002",
        "sync.schema_not_ready",
        incomplete(TP),
    );
    exec(
        &mut c,
        "ROLLBACK; BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
    );
    let token: Value = one(
        &mut c,
        "SELECT syncular.assert_serve_ready($1, 1, $2)",
        &[&P, &json!([decl(P, TP, 1)])],
    );
    assert_eq!(token["pending"], json!([{"partition":"part-1","name":TP}]));
    exec(&mut c, "COMMIT");
}

#[test]
fn gate_05_the_token_is_ordered_and_deterministic() {
    let db = TestDb::new("gate05");
    let mut c = db.connect();
    migrate(&mut c, 1, &l1(), &json!([]));
    declare(&mut c, "b", "z", 1, NOW);
    declare(&mut c, "a", "y", 1, NOW);
    declare(&mut c, "a", "x", 1, NOW);
    declare(&mut c, "a", "w", 2, NOW);
    declare(&mut c, "a", "v", 1, NOW);
    let owner = claim(&mut c, "a", "v", 1, NOW);
    assert_eq!(
        try_activate(&mut c, "a", "v", owner.5, 0, &[], NOW).unwrap(),
        "activated"
    );
    let pending: Value =
        one::<Value>(&mut c, "SELECT syncular.read_serve_gate('a', 1)", &[])["pending"].clone();
    assert_eq!(
        pending,
        json!([{"partition":"a","name":"x"},{"partition":"a","name":"y"},{"partition":"b","name":"z"}])
    );
    let refusal = |c: &mut postgres::Client, d: Value| -> Option<Value> {
        one(c, "SELECT syncular.serve_gate_refusal('a', 1, $1)", &[&d])
    };
    assert_eq!(
        refusal(&mut c, json!([decl("a", "x", 1)])),
        Some(json!({"kind":"checkpoint","partition":"a","projection":"y"}))
    );
    assert_eq!(
        refusal(&mut c, json!([decl("a", "x", 1), decl("a", "y", 1)])),
        Some(json!({"kind":"checkpoint","partition":"b","projection":"z"}))
    );
    assert_eq!(
        refusal(
            &mut c,
            json!([decl("a", "x", 1), decl("a", "y", 1), decl("b", "z", 1)])
        ),
        None
    );
}

#[test]
fn gate_06_what_the_gate_does_not_refuse() {
    let db = TestDb::new("gate06");
    let mut c = db.connect();
    assert_eq!(
        one::<Value>(&mut c, "SELECT syncular.read_serve_gate($1, 1)", &[&P])
            ["storedSchemaVersion"],
        json!(0)
    );
    assert_eq!(
        one::<Option<Value>>(&mut c, "SELECT syncular.serve_gate_refusal($1, 1)", &[&P]),
        None
    );
    migrate(&mut c, 1, &l1(), &json!([]));
    assert_eq!(
        one::<Option<Value>>(&mut c, "SELECT syncular.serve_gate_refusal($1, 2)", &[&P]),
        None
    );
    assert_eq!(
        one::<Value>(&mut c, "SELECT syncular.read_serve_gate($1, 1)", &[&P])["logEpoch"],
        json!(null)
    );
    one::<Value>(
        &mut c,
        "SELECT syncular.touch_partition($1, $2, 'e1')",
        &[&P, &NOW],
    );
    assert_eq!(
        one::<Value>(&mut c, "SELECT syncular.read_serve_gate($1, 1)", &[&P])["logEpoch"],
        json!("e1")
    );
}

#[test]
fn gate_07_request_entry_in_one_call() {
    let db = TestDb::new("gate07");
    let mut c = db.connect();
    let entry: Value = one(
        &mut c,
        "SELECT syncular.serve_entry($1, $2, 'e1', 1)",
        &[&P, &NOW],
    );
    assert_eq!(
        entry,
        json!({"registry":{"partition":"part-1","logEpoch":"e1","epochRequired":false,"lastAuthenticatedAtMs":NOW},
               "gate":{"storedSchemaVersion":0,"logEpoch":"e1","pending":[]}})
    );
    declare(&mut c, P, TP, 1, NOW);
    expect_error(
        try_one::<Value>(
            &mut c,
            "SELECT syncular.serve_entry('fresh', $1, 'e2', 1)",
            &[&NOW],
        ),
        "SY002",
        "sync.schema_not_ready",
        incomplete(TP),
    );
    assert_eq!(
        count(
            &mut c,
            "syncular.sync_partition_registry WHERE partition = 'fresh'"
        ),
        0
    );
}
