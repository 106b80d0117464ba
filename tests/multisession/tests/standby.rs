//! Pulls served by a hot standby (docs/DESIGN.md §Read replicas; docs/API.md `pull`,
//! `apply_pull`): a pull in a read-only transaction reads what it always reads, writes nothing
//! and hands its writes to the host; `apply_pull` applies them on the primary, monotonic and
//! idempotent. Against a real streaming standby of the test cluster (`SYNCULAR_TEST_PG_STANDBY`,
//! started from a base backup by scripts/test.sh).

use postgres::{Client, NoTls};
use serde_json::{json, Value};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use syncular_multisession::*;

const ACTOR: &str = "actor-1";
const EPOCH: &str = "epoch-1";

/// One standby serves every test of this file, and one of them pauses its replay: they take
/// turns.
static STANDBY: Mutex<()> = Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    STANDBY
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn standby_of(db: &TestDb) -> Client {
    let params = std::env::var("SYNCULAR_TEST_PG_STANDBY").expect(
        "SYNCULAR_TEST_PG_STANDBY: connection parameters of a hot standby of the test cluster \
         (scripts/test.sh starts one with scripts/cluster.sh standby)",
    );
    Client::connect(&format!("{params} dbname={}", db.name), NoTls)
        .unwrap_or_else(|e| panic!("cannot connect to the standby: {e}"))
}

/// Waits until the standby replayed everything the primary wrote so far.
fn caught_up(primary: &mut Client, standby: &mut Client) {
    let lsn: String = one(primary, "SELECT pg_current_wal_insert_lsn()::text", &[]);
    // Generous: on a busy machine a standby replays the whole suite's databases behind.
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let done: bool = one(
            standby,
            "SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn",
            &[&lsn],
        );
        if done {
            return;
        }
        assert!(Instant::now() < deadline, "the standby did not catch up");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Connects to the standby's copy of a database created on the primary, once it is there.
fn standby_copy(primary: &mut Client, db: &TestDb) -> Client {
    let params = std::env::var("SYNCULAR_TEST_PG_STANDBY").unwrap_or_default();
    let mut postgres =
        Client::connect(&format!("{params} dbname=postgres"), NoTls).unwrap_or_else(|e| {
            panic!("cannot connect to the standby (SYNCULAR_TEST_PG_STANDBY): {e}")
        });
    caught_up(primary, &mut postgres);
    standby_of(db)
}

fn sub(id: &str, cursor: i64) -> Value {
    json!({"id": id, "table": "tasks", "scopes": {"project_id": ["p1"]},
           "effective": {"project_id": ["p1"]}, "cursor": cursor})
}

/// A pull of `client-1` at `now`: the document and the rows `(sub, commit_seq, row_id, op,
/// payload)`.
type Rows = Vec<(
    Option<i32>,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<Vec<u8>>,
)>;

fn pull(c: &mut Client, now: i64, req: &Value) -> Result<(Value, Rows), SqlError> {
    let rows = c
        .query(
            "SELECT document, sub, commit_seq, row_id, op, payload
               FROM syncular.pull('part-1', 'client-1', $1, $2, $3, 1, $4)",
            &[&ACTOR, &now, &EPOCH, req],
        )
        .map_err(|e| sql_error(&e))?;
    let document: Value = rows[0].get(0);
    let rest = rows[1..]
        .iter()
        .map(|r| (r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
        .collect();
    Ok((document, rest))
}

fn apply(c: &mut Client, writes: &Value) -> Value {
    one(c, "SELECT syncular.apply_pull($1)", &[writes])
}

fn commits(c: &mut Client, from: usize, to: usize) {
    for n in from..to {
        put_row(c, P, "tasks", &format!("t{n}"), &p1(), 1, b"x");
        append(c, P, "tasks", &format!("t{n}"), None);
    }
}

fn stored_record(c: &mut Client) -> Option<Value> {
    one(c, "SELECT syncular.get_client('part-1', 'client-1')", &[])
}

/// The same pull on the standby and on the primary gives the same rows and document; the
/// standby writes nothing and returns the writes, which `apply_pull` makes on the primary.
#[test]
fn a_standby_serves_the_same_pull_and_hands_over_its_writes() {
    let _turn = turn();
    let db = TestDb::new("standby_same");
    let mut primary = db.connect();
    commits(&mut primary, 0, 5);
    let mut standby = standby_copy(&mut primary, &db);
    let req = json!({"subscriptions": [sub("s1", 0), sub("s2", -1)], "limitCommits": 3});
    let (on_standby, standby_rows) = pull(&mut standby, 1_750_000_000_000, &req).unwrap();
    // The primary in a read-only transaction takes the same path: the same answer.
    let mut tx = primary.build_transaction().read_only(true).start().unwrap();
    let read_only = tx
        .query_one(
            "SELECT document FROM syncular.pull('part-1', 'client-1', $1, $2, $3, 1, $4) LIMIT 1",
            &[&ACTOR, &1_750_000_000_000i64, &EPOCH, &req],
        )
        .unwrap()
        .get::<_, Value>(0);
    tx.commit().unwrap();
    assert_eq!(read_only, on_standby);
    assert_eq!(stored_record(&mut primary), None, "a read-only pull wrote");
    let (on_primary, primary_rows) = pull(&mut primary, 1_750_000_000_000, &req).unwrap();
    assert_eq!(standby_rows, primary_rows);
    assert_eq!(
        standby_rows.len(),
        3 + 5,
        "3 window changes, 5 snapshot rows"
    );
    let mut expected = on_primary.clone();
    expected["client"] = json!("deferred");
    expected["writes"] = json!({
        "partition": "part-1", "logEpoch": EPOCH, "atMs": 1_750_000_000_000i64,
        "client": stored_record(&mut primary).unwrap(),
    });
    assert_eq!(on_standby, expected);
    assert_eq!(on_primary["client"], json!("recorded"));
    // Applying the standby's writes over the primary's own record of the same pull: the same
    // record, idempotent.
    let before = stored_record(&mut primary);
    let applied = apply(&mut primary, &on_standby["writes"]);
    assert_eq!(
        (&applied["client"], &applied["cursor"]),
        (&json!("recorded"), &on_primary["cursor"])
    );
    assert_eq!(applied["registry"], on_primary["registry"]);
    assert_eq!(stored_record(&mut primary), before);
    // A write on the standby is PostgreSQL's own refusal, with a HINT that says where to send
    // it; in a read-only transaction on the primary, a HINT that says what to change.
    let refused = standby
        .query_one("SELECT syncular.touch_partition('part-1', 1, 'e')", &[])
        .map_err(|e| sql_error(&e))
        .unwrap_err();
    assert_eq!(refused.state, "25006", "{refused:?}");
    assert!(
        refused
            .hint
            .unwrap_or_default()
            .contains("send this call to the primary"),
        "the HINT names the way out"
    );
    let mut tx = primary.transaction().unwrap();
    tx.batch_execute("SET TRANSACTION READ ONLY").unwrap();
    let refused = tx
        .query_one("SELECT syncular.touch_partition('part-1', 1, 'e')", &[])
        .map_err(|e| sql_error(&e))
        .unwrap_err();
    tx.rollback().unwrap();
    assert_eq!(refused.state, "25006", "{refused:?}");
    assert!(
        refused
            .hint
            .unwrap_or_default()
            .contains("read-write transaction"),
        "the HINT names the way out"
    );
}

/// A standby that lags serves what it has: never a commit past its own head, never a cursor
/// past what it delivered; once it catches up, the next pull continues exactly there, and the
/// client receives every commit once.
/// Red team 21, F1: one transaction on the primary with more than 64 subtransactions (its list
/// of them overflows, on the standby too) made every default-version `decode_row` on a standby
/// "cannot be told", in every transaction of every session, until the standby next replayed a
/// list of running transactions — with no migration involved: two snapshots of one transaction
/// with one `xmax` could not be ordered. They are merged now, and a top-level id is asked where
/// the list is complete for it; a migration run in a savepoint meanwhile is seen too.
#[test]
fn a_transaction_with_many_subtransactions_on_the_primary_leaves_the_standbys_codec_working() {
    let _turn = turn();
    let db = TestDb::new("standby_overflow");
    let mut primary = db.connect();
    migrate(&mut primary, 1, &l1(), &json!([]));
    exec(
        &mut primary,
        r#"INSERT INTO public.tasks (_sync_partition, _sync_row_id, _sync_server_version,
                                     _sync_scopes, _sync_payload)
           VALUES ('part-1', 't1', 1, '{"project_id":"p1"}',
                   syncular.encode_row('tasks', '{"id":"t1","project_id":"p1","data":null}'))"#,
    );
    let mut long = db.connect();
    overflow_subtransactions(&mut long);
    for migration in [false, true] {
        if migration {
            migrate_in_savepoint(&mut primary, 2, &l2());
        }
        // A later commit: the standby's snapshots move past the overflowing transaction's start.
        exec(
            &mut primary,
            "CREATE TABLE public.later (i int); DROP TABLE public.later",
        );
        let mut standby = standby_copy(&mut primary, &db);
        // The first transaction loads the library; the later ones are the hooks'.
        for statement in 0..3 {
            let id = standby
                .query_one(
                    "SELECT syncular.decode_row('tasks', _sync_payload)->>'id' FROM public.tasks",
                    &[],
                )
                .map(|r| r.get::<_, String>(0))
                .map_err(|e| sql_error(&e));
            assert_eq!(
                id,
                Ok("t1".to_string()),
                "migration {migration}, transaction {statement}"
            );
        }
    }
    exec(&mut long, "ROLLBACK");
}

#[test]
fn a_lagging_standby_never_skips_a_commit() {
    let _turn = turn();
    let db = TestDb::new("standby_lag");
    let mut primary = db.connect();
    commits(&mut primary, 0, 4);
    let mut standby = standby_copy(&mut primary, &db);
    // Replay is paused on the whole standby: the next commits stay on the primary.
    let mut admin = Client::connect(
        &format!(
            "{} dbname=postgres",
            std::env::var("SYNCULAR_TEST_PG_STANDBY").unwrap()
        ),
        NoTls,
    )
    .unwrap();
    exec(&mut admin, "SELECT pg_wal_replay_pause()");
    let resumed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        commits(&mut primary, 4, 9);
        let head: i64 = one(
            &mut primary,
            "SELECT syncular.max_commit_seq('part-1')",
            &[],
        );
        assert_eq!(head, 9);
        let mut seen = Vec::new();
        let (d, rows) = pull(
            &mut standby,
            1_750_000_000_000,
            &json!({"subscriptions": [sub("s1", 0)]}),
        )
        .unwrap();
        assert_eq!(d["maxCommitSeq"], json!(4), "the standby's own head");
        let cursor = d["subscriptions"][0]["nextCursor"].as_i64().unwrap();
        assert_eq!(cursor, 4);
        seen.extend(rows.iter().map(|r| r.1.unwrap()));
        apply(&mut primary, &d["writes"]);
        exec(&mut admin, "SELECT pg_wal_replay_resume()");
        caught_up(&mut primary, &mut admin);
        let (d, rows) = pull(
            &mut standby,
            1_750_000_001_000,
            &json!({"subscriptions": [sub("s1", cursor)]}),
        )
        .unwrap();
        assert_eq!(d["maxCommitSeq"], json!(9));
        seen.extend(rows.iter().map(|r| r.1.unwrap()));
        assert_eq!(
            seen,
            (1..=9).collect::<Vec<i64>>(),
            "every commit once, in order"
        );
        let applied = apply(&mut primary, &d["writes"]);
        assert_eq!(applied["cursor"], json!(9));
    }));
    exec(&mut admin, "SELECT pg_wal_replay_resume()");
    if let Err(panic) = resumed {
        std::panic::resume_unwind(panic);
    }
}

/// `apply_pull` is monotonic and idempotent: a late apply never moves the cursor back or
/// overwrites a newer record; a rotation of the log epoch in between, or another actor's record,
/// keeps the stored record; bad writes are refused whole.
#[test]
fn applying_writes_is_monotonic_and_idempotent() {
    let db = TestDb::new("standby_apply");
    let mut c = db.connect();
    commits(&mut c, 0, 6);
    let read_only_pull = |c: &mut Client, now: i64, cursor: i64| -> Value {
        let mut tx = c.build_transaction().read_only(true).start().unwrap();
        let d: Value = tx
            .query_one(
                "SELECT document FROM syncular.pull('part-1', 'client-1', $1, $2, $3, 1, $4) LIMIT 1",
                &[&ACTOR, &now, &EPOCH, &json!({"subscriptions": [sub("s1", cursor)], "limitCommits": 2})],
            )
            .unwrap()
            .get(0);
        tx.commit().unwrap();
        d["writes"].clone()
    };
    let early = read_only_pull(&mut c, 1_000, 0);
    let late = read_only_pull(&mut c, 2_000, 2);
    assert_eq!(
        (&early["client"]["cursor"], &late["client"]["cursor"]),
        (&json!(2), &json!(4))
    );
    let applied = apply(&mut c, &late);
    assert_eq!(
        (&applied["client"], &applied["cursor"]),
        (&json!("recorded"), &json!(4))
    );
    // The earlier pull's writes arrive late: the newer record stays.
    let applied = apply(&mut c, &early);
    assert_eq!(
        (&applied["client"], &applied["cursor"]),
        (&json!("newer_record"), &json!(4))
    );
    assert_eq!(applied["registry"]["lastAuthenticatedAtMs"], json!(2_000));
    assert_eq!(stored_record(&mut c).unwrap()["updatedAtMs"], json!(2_000));
    // Repeated: the same record.
    let applied = apply(&mut c, &late);
    assert_eq!(
        (&applied["client"], &applied["cursor"]),
        (&json!("recorded"), &json!(4))
    );
    // A newer record whose cursor is lower (its subscriptions changed) never moves the cursor
    // back: retention keeps what the client may still need.
    let mut lower = late.clone();
    lower["atMs"] = json!(3_000);
    lower["client"]["updatedAtMs"] = json!(3_000);
    lower["client"]["cursor"] = json!(1);
    let applied = apply(&mut c, &lower);
    assert_eq!(
        (&applied["client"], &applied["cursor"]),
        (&json!("recorded"), &json!(4))
    );
    // Another actor's record is not overwritten.
    let mut other = late.clone();
    other["client"]["actorId"] = json!("actor-2");
    other["client"]["updatedAtMs"] = json!(4_000);
    let applied = apply(&mut c, &other);
    assert_eq!(
        (&applied["client"], &applied["cursor"]),
        (&json!("actor_mismatch"), &Value::Null)
    );
    // After a rotation of the log epoch the records of the old generation are gone and a late
    // apply of that generation does not bring one back.
    exec(
        &mut c,
        "SELECT syncular.rotate_log_epoch('part-1', 'epoch-2', 5000)",
    );
    let applied = apply(&mut c, &late);
    assert_eq!(applied["client"], json!("epoch_changed"));
    assert_eq!(applied["registry"]["logEpoch"], json!("epoch-2"));
    assert_eq!(stored_record(&mut c), None);
    // Bad writes: refused whole with the path of the first bad member, nothing written.
    let before: i64 = count(&mut c, "syncular.sync_partition_registry");
    for (writes, argument, reason) in [
        (json!([]), "writes", "type"),
        (json!({}), "writes.partition", "missing"),
        (json!({"partition": "q"}), "writes.logEpoch", "missing"),
        (
            json!({"partition": "q", "logEpoch": "e"}),
            "writes.atMs",
            "missing",
        ),
        (
            json!({"partition": "q", "logEpoch": "e", "atMs": -1}),
            "writes.atMs",
            "range",
        ),
        (
            json!({"partition": "q", "logEpoch": "e", "atMs": 1, "client": 5}),
            "writes.client",
            "type",
        ),
        (
            json!({"partition": "q", "logEpoch": "e", "atMs": 1,
                   "client": {"clientId": "c", "actorId": "a", "cursor": 0, "updatedAtMs": 1}}),
            "writes.client.subscriptions",
            "missing",
        ),
        (
            json!({"partition": "x".repeat(4097), "logEpoch": "e", "atMs": 1}),
            "writes.partition",
            "too_large",
        ),
    ] {
        expect_error(
            c.query_one("SELECT syncular.apply_pull($1)", &[&writes])
                .map(|r| r.get::<_, Value>(0)),
            "SY000",
            "sync.storage.invalid_argument",
            Some(json!({"argument": argument, "reason": reason})),
        );
    }
    assert_eq!(count(&mut c, "syncular.sync_partition_registry"), before);
}

/// A standby promoted in the middle of pulls loses nothing a client saw: every commit a client
/// received from it is on the promoted node, byte for byte, the client's cursor is within the
/// promoted node's log, and the promoted node's next commit follows its own head. Uses a standby
/// of its own (`SYNCULAR_TEST_PG_PROMOTE`), which it promotes: scripts/test.sh makes a fresh one
/// before every run of the suite.
#[test]
fn a_standby_promoted_mid_pull_loses_nothing_a_client_saw() {
    let params = std::env::var("SYNCULAR_TEST_PG_PROMOTE").expect(
        "SYNCULAR_TEST_PG_PROMOTE: connection parameters of a second hot standby of the test \
         cluster, which this test promotes (scripts/test.sh starts one)",
    );
    let db = TestDb::new("standby_promote");
    let mut primary = db.connect();
    let mut admin = Client::connect(&format!("{params} dbname=postgres"), NoTls).unwrap();
    let in_recovery: bool = one(&mut admin, "SELECT pg_is_in_recovery()", &[]);
    assert!(
        in_recovery,
        "SYNCULAR_TEST_PG_PROMOTE must be a standby that was never promoted"
    );
    commits(&mut primary, 0, 3);
    caught_up(&mut primary, &mut admin);
    let mut standby = Client::connect(&format!("{params} dbname={}", db.name), NoTls).unwrap();
    // The client pulls from the standby while the primary goes on appending; the standby is
    // promoted between two of its pulls, whatever it had replayed by then.
    let mut seen: Vec<(i64, String, Vec<u8>)> = Vec::new();
    let mut cursor = 0i64;
    let mut now = 1_750_000_000_000i64;
    for round in 0..6 {
        commits(&mut primary, 3 + round * 2, 5 + round * 2);
        if round == 3 {
            let promoted: bool = one(&mut admin, "SELECT pg_promote(true, 60)", &[]);
            assert!(promoted);
        }
        now += 1_000;
        let (d, rows) = pull(
            &mut standby,
            now,
            &json!({"subscriptions": [sub("s1", cursor)]}),
        )
        .unwrap();
        let head = d["maxCommitSeq"].as_i64().unwrap();
        let next = d["subscriptions"][0]["nextCursor"].as_i64().unwrap();
        assert!(
            cursor <= next && next <= head,
            "cursor {cursor} → {next}, head {head}"
        );
        for r in rows {
            seen.push((r.1.unwrap(), r.2.unwrap(), r.4.unwrap_or_default()));
        }
        cursor = next;
    }
    // After the promotion the node writes: its pulls recorded the client themselves.
    let promoted_record: Option<Value> = one(
        &mut standby,
        "SELECT syncular.get_client('part-1', 'client-1')",
        &[],
    );
    assert_eq!(promoted_record.unwrap()["cursor"], json!(cursor));
    // Every commit the client saw, in order and once, is on the promoted node as it saw it.
    let seqs: Vec<i64> = seen.iter().map(|s| s.0).collect();
    assert_eq!(seqs, (1..=cursor).collect::<Vec<i64>>());
    for (seq, row_id, payload) in &seen {
        let stored: Vec<u8> = one(
            &mut standby,
            "SELECT payload FROM syncular.sync_changes
              WHERE partition = 'part-1' AND commit_seq = $1 AND row_id = $2",
            &[seq, row_id],
        );
        assert_eq!(&stored, payload, "commit {seq}");
    }
    // The promoted node's log goes on from its own head.
    let head: i64 = one(
        &mut standby,
        "SELECT syncular.max_commit_seq('part-1')",
        &[],
    );
    assert!(head >= cursor);
    put_row(&mut standby, P, "tasks", "after", &p1(), 1, b"y");
    assert_eq!(append(&mut standby, P, "tasks", "after", None), head + 1);
}
