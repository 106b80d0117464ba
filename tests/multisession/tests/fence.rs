//! docs/SCENARIOS.md: the writer fence (FEN-01 … FEN-12).

use serde_json::json;
use syncular_multisession::*;

const REJECTED: &str = "sync.storage.writer_fence_rejected";

#[test]
fn fen_01_absent_fence_allows_raised_fence_denies() {
    let db = TestDb::new("fen01");
    let mut c = db.connect();
    raw_commit(&mut c, P, 1, None).unwrap();
    set_fence(&mut c, P, 1);
    raw_commit(&mut c, P, 2, Some(1)).unwrap();
    expect_error(raw_commit(&mut c, P, 3, None), "SY001", REJECTED, None);
    set_fence(&mut c, P, 99);
    expect_error(
        raw_commit(&mut c, P, 4, Some(1)),
        "SY001",
        REJECTED,
        Some(json!({"partition":"part-1","writerVersion":1,"requiredWriterVersion":99})),
    );
}

#[test]
fn fen_02_fence_predicate_function() {
    let db = TestDb::new("fen02");
    let mut c = db.connect();
    let allows = |c: &mut postgres::Client, p: &str, w: Option<i64>| -> bool {
        one(c, "SELECT syncular.writer_fence_allows($1, $2)", &[&p, &w])
    };
    assert!(allows(&mut c, P, Some(1)));
    assert!(allows(&mut c, P, None));
    assert!(allows(&mut c, "untouched", Some(1)));
    set_fence(&mut c, P, 2);
    assert!(!allows(&mut c, P, Some(1)));
    assert!(allows(&mut c, P, Some(2)));
    assert!(allows(&mut c, P, Some(3)));
    assert!(!allows(&mut c, P, None));
    assert!(allows(&mut c, "other", Some(1)));
}

#[test]
fn fen_03_append_stamps_writer_version() {
    let db = TestDb::new("fen03");
    let mut c = db.connect();
    set_fence(&mut c, P, V);
    let s = append(&mut c, P, "tasks", "t1", Some(V));
    let wv: Option<i64> = one(
        &mut c,
        "SELECT writer_version FROM syncular.sync_commits WHERE partition = $1 AND commit_seq = $2",
        &[&P, &s],
    );
    assert_eq!(wv, Some(V));
    expect_error(raw_commit(&mut c, P, s + 1, None), "SY001", REJECTED, None);
}

#[test]
fn fen_04_declaration_raises_the_fence_at_once() {
    let db = TestDb::new("fen04");
    let mut c = db.connect();
    let row = declare(&mut c, P, "tasks-projection", V, NOW);
    assert_eq!(
        row,
        (
            P.into(),
            "tasks-projection".into(),
            1,
            "declared".into(),
            0,
            0,
            0,
            NOW
        )
    );
    assert_eq!(fence_of(&mut c, P), Some(V));
    assert_eq!(
        claim(&mut c, P, "tasks-projection", V, NOW).3,
        "backfilling"
    );
    expect_error(raw_commit(&mut c, P, 1, None), "SY001", REJECTED, None);
}

#[test]
fn fen_05_committed_declaration_fences_other_sessions() {
    let db = TestDb::new("fen05");
    let mut s1 = db.connect();
    let mut s2 = db.connect();
    declare(&mut s1, P, "tasks-projection", 1, NOW);
    append(&mut s2, P, "tasks", "r1", Some(1));
    expect_error(raw_commit(&mut s2, P, 99, Some(0)), "SY001", REJECTED, None);
    expect_error(raw_commit(&mut s2, P, 97, None), "SY001", REJECTED, None);
}

#[test]
fn fen_06_old_writers_stay_fenced_after_activation() {
    let db = TestDb::new("fen06");
    let mut s1 = db.connect();
    let mut s2 = db.connect();
    declare(&mut s1, P, "tasks-projection", 1, NOW);
    assert_eq!(claim(&mut s1, P, "tasks-projection", 1, NOW).5, 1);
    assert_eq!(
        try_activate(&mut s1, P, "tasks-projection", 1, 0, &["tasks"], NOW).unwrap(),
        "activated"
    );
    expect_error(raw_commit(&mut s2, P, 98, Some(0)), "SY001", REJECTED, None);
    append(&mut s2, P, "tasks", "r2", Some(1));
}

#[test]
fn fen_07_raise_never_lowers_and_returns_the_requirement() {
    let db = TestDb::new("fen07");
    let mut c = db.connect();
    let raise = |c: &mut postgres::Client, p: &str, v: i64| {
        try_one::<i64>(c, "SELECT syncular.raise_writer_fence($1, $2)", &[&p, &v])
    };
    assert_eq!(raise(&mut c, P, 3).unwrap(), 3);
    assert_eq!(raise(&mut c, P, 2).unwrap(), 3);
    assert_eq!(fence_of(&mut c, P), Some(3));
    assert_eq!(raise(&mut c, P, 5).unwrap(), 5);
    expect_error(
        raise(&mut c, P, -1),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument":"required_writer_version","reason":"range"})),
    );
    // (b) the global floor of a migration counts.
    migrate(&mut c, 7, &l1(), &json!([]));
    assert_eq!(raise(&mut c, "q", 5).unwrap(), 7);
    assert_eq!(fence_of(&mut c, "q"), Some(5));
}

#[test]
fn fen_08_fenced_append_aborts_and_consumes_no_number() {
    let db = TestDb::new("fen08");
    let mut c = db.connect();
    set_fence(&mut c, P, 2);
    assert_eq!(append(&mut c, P, "tasks", "t1", Some(2)), 1);
    let mut tx = c.transaction().unwrap();
    for wv in [Some(1), None] {
        let mut sp = tx.transaction().unwrap(); // a savepoint
        let d = doc(&fresh_id(), json!([chg("tasks", "t1")]), wv);
        expect_error(
            sp.query_one("SELECT syncular.append_commit($1, $2)", &[&P, &d]),
            "SY001",
            REJECTED,
            None,
        );
        sp.rollback().unwrap();
    }
    tx.commit().unwrap();
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.max_commit_seq($1)", &[&P]),
        1
    );
    assert_eq!(count(&mut c, "syncular.sync_commits"), 1);
    assert_eq!(count(&mut c, "syncular.sync_changes"), 1);
    assert_eq!(append(&mut c, P, "tasks", "t1", Some(2)), 2);
}

/// The enabled BEFORE INSERT fence triggers on sync_commits: (name, calls the native function).
fn fence_triggers(c: &mut postgres::Client) -> Vec<(String, bool)> {
    c.query(
        "SELECT t.tgname::text, t.tgfoid = 'syncular.writer_fence_trigger()'::regprocedure
           FROM pg_trigger t
          WHERE t.tgrelid = 'syncular.sync_commits'::regclass AND NOT t.tgisinternal
            AND t.tgenabled <> 'D' ORDER BY 1",
        &[],
    )
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

#[test]
fn fen_09_native_fence_survives_a_024_hosts_startup_ddl() {
    let db = TestDb::new("fen09");
    let mut c = db.connect();
    assert_eq!(
        fence_triggers(&mut c),
        vec![("sync_commits_writer_fence".into(), true)]
    );
    migrate(&mut c, 2, &l1(), &json!([]));
    exec(&mut c, "SET search_path = syncular, public");
    let host_statements = [
        "ALTER TABLE sync_commits ADD COLUMN IF NOT EXISTS writer_version BIGINT",
        "CREATE OR REPLACE FUNCTION syncular_writer_fence() RETURNS trigger LANGUAGE plpgsql AS $$
         DECLARE required integer;
         BEGIN
           SELECT required_writer_version INTO required FROM sync_writer_fence
            WHERE partition = NEW.partition;
           IF required IS NOT NULL AND (NEW.writer_version IS NULL OR NEW.writer_version < required) THEN
             RAISE EXCEPTION 'sync.storage.writer_fence_rejected';
           END IF;
           RETURN NEW;
         END $$",
        "DROP TRIGGER IF EXISTS sync_commits_writer_fence ON sync_commits",
        "CREATE TRIGGER sync_commits_writer_fence BEFORE INSERT ON sync_commits
           FOR EACH ROW EXECUTE FUNCTION syncular_writer_fence()",
    ];
    let mut seq = 0;
    for round in 0..2 {
        for (i, statement) in host_statements.iter().enumerate() {
            exec(&mut c, statement);
            let triggers = fence_triggers(&mut c);
            assert_eq!(
                triggers.len(),
                1,
                "round {round}, statement {}: {triggers:?}",
                i + 1
            );
            assert!(triggers[0].1, "round {round}, statement {}", i + 1);
            if i == 3 {
                assert_eq!(triggers[0].0, "sync_commits_writer_fence");
            }
            if i >= 2 {
                // `fresh` has no fence row: only the global floor (native) refuses this.
                seq += 1;
                expect_error(
                    raw_commit(&mut c, "fresh", seq, Some(1)),
                    "SY001",
                    REJECTED,
                    None,
                );
            }
        }
    }
}

#[test]
fn fen_10_after_a_migration_every_partition_is_fenced() {
    let db = TestDb::new("fen10");
    let mut c = db.connect();
    migrate(&mut c, 2, &l1(), &json!([]));
    let allows = |c: &mut postgres::Client, w: Option<i64>| -> bool {
        one(
            c,
            "SELECT syncular.writer_fence_allows('never-written', $1)",
            &[&w],
        )
    };
    assert!(!allows(&mut c, Some(1)));
    assert!(!allows(&mut c, None));
    assert!(allows(&mut c, Some(2)));
    expect_error(
        raw_commit(&mut c, "never-written", 1, None),
        "SY001",
        REJECTED,
        None,
    );
    expect_error(
        raw_commit(&mut c, "never-written", 1, Some(1)),
        "SY001",
        REJECTED,
        None,
    );
    assert_eq!(append(&mut c, "never-written", "tasks", "t1", Some(2)), 1);
    assert_eq!(
        one::<i64>(
            &mut c,
            "SELECT required_writer_version FROM syncular.sync_schema_meta",
            &[]
        ),
        2
    );
    assert_eq!(fence_of(&mut c, "never-written"), None);
}

#[test]
fn fen_11_an_old_snapshot_does_not_let_an_old_writer_append() {
    for level in ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"] {
        for via_migration in [false, true] {
            let db = TestDb::new("fen11");
            let mut s1 = db.connect();
            let mut s2 = db.connect();
            let target = if via_migration { "unfenced" } else { P };
            exec(&mut s2, &format!("BEGIN ISOLATION LEVEL {level}"));
            one::<i64>(&mut s2, "SELECT count(*) FROM syncular.sync_commits", &[]);
            if via_migration {
                migrate(&mut s1, 2, &l1(), &json!([]));
            } else {
                declare(&mut s1, P, "proj", 2, NOW);
            }
            let err = sql_error(&raw_commit(&mut s2, target, 1, Some(1)).unwrap_err());
            let acceptable =
                err.state == "SY001" || (level != "READ COMMITTED" && err.state == "40001");
            assert!(acceptable, "{level}, migration={via_migration}: {err:?}");
            exec(&mut s2, "ROLLBACK");
            let n: i64 = one(
                &mut s1,
                "SELECT count(*) FROM syncular.sync_commits WHERE partition = $1",
                &[&target],
            );
            assert_eq!(n, 0, "{level}, migration={via_migration}");
        }
    }
}

#[test]
fn fen_12_fence_does_not_depend_on_the_inserting_roles_privileges() {
    let db = TestDb::new("fen12");
    let mut c = db.connect();
    let role = format!("{}_writer", db.name);
    exec(
        &mut c,
        &format!(
            "CREATE ROLE {role};
             GRANT USAGE ON SCHEMA syncular TO {role};
             GRANT INSERT ON syncular.sync_commits TO {role};"
        ),
    );
    set_fence(&mut c, P, 2);
    exec(&mut c, &format!("SET ROLE {role}"));
    expect_error(raw_commit(&mut c, P, 1, Some(1)), "SY001", REJECTED, None);
    raw_commit(&mut c, P, 1, Some(2)).unwrap();
    exec(&mut c, "RESET ROLE");
    exec(&mut c, &format!("DROP OWNED BY {role}; DROP ROLE {role}"));
}
