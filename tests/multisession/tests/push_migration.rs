//! [MS] A one-call push racing a migration (docs/SCENARIOS.md NP-23/24's neighbour; docs/DESIGN.md
//! §Lock order): `migrate_schema` takes the barrier (L0) before anything else and
//! `push_commit` the partition lock (L1), which the barrier excludes. Whichever comes first, the
//! other waits; a push of the old version that waited for a migration is refused with nothing
//! written, a push that held its lock first is appended under the old version before the
//! migration proceeds, and the new version's push goes through afterwards.

use postgres::Client;
use serde_json::{json, Value};
use std::thread;
use syncular_multisession::native_push::*;
use syncular_multisession::*;

/// The stored layouts of the fixture's tables (the push schema's columns, as `migrate_schema`
/// takes them): a version's push schema and its layouts describe the same tables.
fn layouts() -> Value {
    let tables = schema().as_object().unwrap().clone();
    Value::Object(
        tables
            .into_iter()
            .map(|(tbl, d)| (tbl, d["columns"].clone()))
            .collect(),
    )
}

fn prepared(name: &str) -> (TestDb, Client) {
    let (db, mut c) = fixture(name);
    migrate(&mut c, V, &layouts(), &json!([]));
    one::<i32>(
        &mut c,
        "SELECT syncular.set_push_schema(2, $1)",
        &[&schema()],
    );
    (db, c)
}

/// A push of one new task at `running`, as client `c1` with key `key`.
fn push_at(
    c: &mut impl postgres::GenericClient,
    key: &str,
    id: &str,
    running: i64,
) -> Result<Value, postgres::Error> {
    let op = up(c, "tasks", id, None, task(id, "p1"));
    push_op(c, key, &op, running)
}

/// The push of `op` at `running`: its payload encoded beforehand (`encode_row` answers a
/// migration in flight with `SY041` instead of waiting for it).
fn push_op(
    c: &mut impl postgres::GenericClient,
    key: &str,
    op: &Op,
    running: i64,
) -> Result<Value, postgres::Error> {
    c.query_one(
        "SELECT syncular.push_commit($1, 'c1', $2, 'a1', $3, $4, $5, ARRAY[$6], ARRAY[$7], ARRAY[1]::int2[],
                                     ARRAY[NULL]::int8[], ARRAY[$8::bytea])",
        &[&P, &key, &NOW, &running, &allowed(), &op.table, &op.row_id, &op.payload],
    )
    .map(|r| r.get(0))
}

#[test]
fn np_ms_a_push_that_waited_for_a_migration_is_refused() {
    let (db, mut c) = prepared("npmig1");
    let before = snapshot(&mut c);
    let op = up(&mut c, "tasks", "t1", None, task("t1", "p1"));
    let mut migrator = db.connect();
    exec(&mut migrator, "BEGIN");
    one::<i64>(
        &mut migrator,
        "SELECT syncular.migrate_schema(2, $1)",
        &[&layouts()],
    );
    let mut pusher = db.connect();
    let pid = backend_pid(&mut pusher);
    let old = thread::spawn(move || push_op(&mut pusher, "k1", &op, V).map_err(|e| sql_error(&e)));
    wait_until_blocked(&mut c, pid);
    exec(&mut migrator, "COMMIT");
    let err = old.join().unwrap().unwrap_err();
    // The gate (SY002) or, as its backstop, the fence (SY001): never an append at version 1.
    assert!(matches!(err.state.as_str(), "SY002" | "SY001"), "{err:?}");
    let now = snapshot(&mut c);
    let strip = |s: &str| {
        s.lines()
            .filter(|l| !l.starts_with("partitions|"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(strip(&now), strip(&before));
    // The new version's push goes through, appended under writer_version 2.
    let out = push_at(&mut c, "k2", "t2", 2).unwrap();
    assert_eq!(out["outcome"], "applied", "{out}");
    let wv: Option<i64> = one(
        &mut c,
        "SELECT writer_version FROM syncular.sync_commits WHERE client_commit_id = 'k2'",
        &[],
    );
    assert_eq!(wv, Some(2));
}

#[test]
fn np_ms_a_migration_waits_for_a_push_that_holds_its_lock() {
    let (db, mut c) = prepared("npmig2");
    let mut pusher = db.connect();
    exec(&mut pusher, "BEGIN");
    let out = push_at(&mut pusher, "k1", "t1", V).unwrap();
    assert_eq!(out["outcome"], "applied", "{out}");
    let mut migrator = db.connect();
    let pid = backend_pid(&mut migrator);
    let migration = thread::spawn(move || {
        exec(&mut migrator, "BEGIN");
        let previous: i64 = one(
            &mut migrator,
            "SELECT syncular.migrate_schema(2, $1)",
            &[&layouts()],
        );
        exec(&mut migrator, "COMMIT");
        previous
    });
    wait_until_blocked(&mut c, pid);
    exec(&mut pusher, "COMMIT");
    assert_eq!(migration.join().unwrap(), V);
    // The push that held its lock stands under the old version …
    let wv: Option<i64> = one(
        &mut c,
        "SELECT writer_version FROM syncular.sync_commits WHERE client_commit_id = 'k1'",
        &[],
    );
    assert_eq!(wv, Some(V));
    assert!(stored(&mut c, "tasks", "t1").is_some());
    // … and after the migration the old version is refused, the new one served.
    let err = sql_error(&push_at(&mut c, "k3", "t3", V).unwrap_err());
    assert!(matches!(err.state.as_str(), "SY002" | "SY001"), "{err:?}");
    assert!(stored(&mut c, "tasks", "t3").is_none());
    assert_eq!(
        push_at(&mut c, "k4", "t4", 2).unwrap()["outcome"],
        "applied"
    );
}
