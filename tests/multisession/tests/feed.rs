//! The change feed (docs/API.md "Change feed", docs/DESIGN.md §Change feed; issue 31), on a
//! cluster that preloads the library with `syncular.feed_database = 'syncular_feed'`
//! (`SYNCULAR_TEST_PG_FEED`, started by scripts/test.sh): every partition that moved is
//! announced with its last head by the worker's process alone; a commit that rolled back —
//! whole or in a subtransaction — never; a transaction that appended cannot be prepared; and a
//! restarted worker first tells listeners to read every head again.

use postgres::fallible_iterator::FallibleIterator;
use postgres::{Client, NoTls};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use syncular_multisession::{app_tables_sql, append, sql_error};

/// The feed's database, as the cluster's `syncular.feed_database` names it.
const DATABASE: &str = "syncular_feed";

/// The tests share the feed's one database: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn connect() -> Client {
    let cluster = std::env::var("SYNCULAR_TEST_PG_FEED").expect(
        "SYNCULAR_TEST_PG_FEED: connection parameters of the cluster with the change feed that \
         scripts/test.sh starts",
    );
    Client::connect(&format!("{cluster} dbname={DATABASE}"), NoTls)
        .unwrap_or_else(|e| panic!("cannot connect to the feed cluster: {e}"))
}

/// A fresh install in the feed's database, with the fixture's app tables.
fn fresh() -> Client {
    let mut c = connect();
    c.batch_execute(
        "DROP EXTENSION IF EXISTS syncular CASCADE;
         DROP TABLE IF EXISTS public.tasks, public.docs;
         CREATE EXTENSION syncular;",
    )
    .unwrap();
    c.batch_execute(&app_tables_sql()).unwrap();
    c.batch_execute(
        "SELECT syncular.register_table('tasks', 'public.tasks');
         SELECT syncular.register_table('docs', 'public.docs');",
    )
    .unwrap();
    c
}

/// The worker's process id once it serves the database (`feed_status`).
fn worker_pid(c: &mut Client) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status: Value = c
            .query_one("SELECT syncular.feed_status()", &[])
            .unwrap()
            .get(0);
        if status["running"] == json!(true) {
            return status["pid"].as_i64().unwrap() as i32;
        }
        assert!(
            Instant::now() < deadline,
            "the feed worker never started: {status}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A connection listening on the install's channel.
fn listener(c: &mut Client) -> Client {
    let channel: String = c
        .query_one("SELECT syncular.notify_channel()", &[])
        .unwrap()
        .get(0);
    let mut l = connect();
    l.batch_execute(&format!("LISTEN \"{channel}\"")).unwrap();
    l
}

/// What the listener heard until `done` says so (each notification's sender checked against
/// `pid`): the highest head per partition, every head heard per partition, and whether a
/// resync was asked.
struct Heard {
    heads: BTreeMap<String, Vec<i64>>,
    resync: bool,
}

fn listen_until(l: &mut Client, pid: i32, done: impl Fn(&Heard) -> bool) -> Heard {
    let mut heard = Heard {
        heads: BTreeMap::new(),
        resync: false,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done(&heard) {
        assert!(
            Instant::now() < deadline,
            "not announced: {:?}",
            heard.heads
        );
        let mut notifications = l.notifications();
        let mut it = notifications.timeout_iter(Duration::from_millis(200));
        while let Some(n) = it.next().unwrap() {
            assert_eq!(
                n.process_id(),
                pid,
                "a feed notification from another process"
            );
            let payload: Value = serde_json::from_str(n.payload()).unwrap();
            if payload["resync"] == json!(true) {
                heard.resync = true;
            }
            for (partition, seq) in payload["heads"].as_object().into_iter().flatten() {
                heard
                    .heads
                    .entry(partition.clone())
                    .or_default()
                    .push(seq.as_i64().unwrap());
            }
        }
    }
    heard
}

fn last(heard: &Heard, partition: &str) -> Option<i64> {
    heard
        .heads
        .get(partition)
        .and_then(|s| s.iter().max().copied())
}

#[test]
fn every_partition_that_moved_is_announced_with_its_last_head() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = fresh();
    let pid = worker_pid(&mut c);
    let mut l = listener(&mut c);
    let mut expected = BTreeMap::new();
    for i in 0..60 {
        let partition = format!("fp{}", i % 5);
        let seq = append(&mut c, &partition, "tasks", &format!("r{i}"), None);
        expected.insert(partition, seq);
    }
    // Ten commits of one partition in one transaction: one head, the last.
    let mut tx = c.transaction().unwrap();
    let mut seqs = Vec::new();
    for i in 0..10 {
        let d = syncular_multisession::doc(
            &syncular_multisession::fresh_id(),
            json!([syncular_multisession::chg("tasks", &format!("t{i}"))]),
            None,
        );
        seqs.push(
            tx.query_one("SELECT syncular.append_commit('fq', $1)", &[&d])
                .unwrap()
                .get::<_, i64>(0),
        );
    }
    tx.commit().unwrap();
    expected.insert("fq".to_string(), *seqs.last().unwrap());
    let heard = listen_until(&mut l, pid, |h| {
        expected.iter().all(|(p, seq)| last(h, p) == Some(*seq))
    });
    assert_eq!(
        heard.heads["fq"],
        vec![*seqs.last().unwrap()],
        "one head per transaction"
    );
    for (partition, heads) in &heard.heads {
        let mut sorted = heads.clone();
        sorted.sort_unstable();
        assert_eq!(&sorted, heads, "{partition}: heads announced in order");
    }
}

#[test]
fn a_commit_that_rolled_back_is_never_announced() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = fresh();
    let pid = worker_pid(&mut c);
    let mut l = listener(&mut c);
    c.batch_execute("BEGIN").unwrap();
    append(&mut c, "rolled_back", "tasks", "r1", None);
    c.batch_execute("ROLLBACK; BEGIN; SAVEPOINT s").unwrap();
    append(&mut c, "in_savepoint", "tasks", "r1", None);
    c.batch_execute("ROLLBACK TO SAVEPOINT s; SAVEPOINT t")
        .unwrap();
    let kept = append(&mut c, "released", "tasks", "r1", None);
    c.batch_execute("RELEASE SAVEPOINT t; COMMIT").unwrap();
    let sentinel = append(&mut c, "sentinel", "tasks", "r1", None);
    let heard = listen_until(&mut l, pid, |h| last(h, "sentinel") == Some(sentinel));
    assert_eq!(last(&heard, "released"), Some(kept));
    assert!(
        !heard.heads.contains_key("rolled_back"),
        "{:?}",
        heard.heads
    );
    assert!(
        !heard.heads.contains_key("in_savepoint"),
        "{:?}",
        heard.heads
    );
}

#[test]
fn a_transaction_that_appended_cannot_be_prepared() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = fresh();
    worker_pid(&mut c);
    c.batch_execute("BEGIN").unwrap();
    append(&mut c, "prepared", "tasks", "r1", None);
    let err = sql_error(
        &c.batch_execute("PREPARE TRANSACTION 'feed_2pc'")
            .unwrap_err(),
    );
    assert_eq!(err.state, "0A000", "{err:?}");
    assert!(err.message.contains("cannot PREPARE"), "{err:?}");
    c.batch_execute("ROLLBACK").ok();
    let pending: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid = 'feed_2pc'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(pending, 0);
}

#[test]
fn a_restarted_worker_first_asks_every_listener_to_read_every_head() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = fresh();
    let old = worker_pid(&mut c);
    let mut l = listener(&mut c);
    c.query_one("SELECT pg_terminate_backend($1)", &[&old])
        .unwrap();
    // A commit while no worker runs is never announced by itself: the resync covers it.
    let deadline = Instant::now() + Duration::from_secs(60);
    let new = loop {
        let pid = worker_pid(&mut c);
        if pid != old {
            break pid;
        }
        assert!(Instant::now() < deadline, "the worker was not restarted");
        std::thread::sleep(Duration::from_millis(100));
    };
    let heard = listen_until(&mut l, new, |h| h.resync);
    assert!(heard.resync);
    let seq = append(&mut c, "after_restart", "tasks", "r1", None);
    let heard = listen_until(&mut l, new, |h| last(h, "after_restart") == Some(seq));
    assert_eq!(last(&heard, "after_restart"), Some(seq));
}

/// The preloaded library's executor and utility hooks call the hooks loaded before them (this
/// cluster preloads pg_stat_statements first) behind a guard: an ERROR raised inside them — a
/// permission check while the executor starts, a utility statement refused — is an ordinary
/// error, the session goes on, and every transaction is covered (the row codec's snapshot
/// check, docs/SECURITY.md rule 19): a transaction that read before a migration is refused the
/// default version after it, in the connection's first transaction too.
#[test]
fn the_hooks_chain_to_the_ones_loaded_before_and_cover_every_transaction() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = fresh();
    c.batch_execute(
        "DROP ROLE IF EXISTS feed_stranger; CREATE ROLE feed_stranger;
         CREATE TABLE IF NOT EXISTS public.feed_private (x int)",
    )
    .unwrap();
    let pid: i32 = c.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    for refused in [
        "SET ROLE feed_stranger; SELECT * FROM public.feed_private",
        "SET ROLE feed_stranger; COPY public.feed_private TO STDOUT",
    ] {
        let e = c.batch_execute(refused).unwrap_err();
        assert_eq!(
            e.code().map(|s| s.code()),
            Some("42501"),
            "{refused}: {e:?}"
        );
        c.batch_execute("RESET ROLE").unwrap();
    }
    let same: i32 = c.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    assert_eq!(same, pid, "the same backend");
    // Covered from the connection's first transaction: the library was loaded at its start.
    let column = |name: &str, ty: &str, nullable: bool| json!({"name": name, "type": ty, "nullable": nullable});
    let tasks = json!([
        column("id", "string", false),
        column("project_id", "string", true),
        column("data", "bytes", true)
    ]);
    let docs = json!([
        column("id", "string", false),
        column("org_id", "string", true),
        column("project_id", "string", true)
    ]);
    let scoped = |columns: &Value| {
        json!({"columns": columns, "primaryKey": "id",
                                          "scopes": [{"variable": "project_id", "column": "project_id"}]})
    };
    c.query_one(
        "SELECT syncular.set_push_schema(1, $1)",
        &[&json!({"tasks": scoped(&tasks), "docs": scoped(&docs)})],
    )
    .unwrap();
    let encode = "SELECT syncular.encode_row('tasks',
                  '{\"id\": \"a\", \"project_id\": null, \"data\": null}'::jsonb)";
    let mut reader = connect();
    reader
        .batch_execute("BEGIN; SELECT count(*) FROM pg_catalog.pg_class")
        .unwrap();
    c.batch_execute("BEGIN").unwrap();
    c.query_one(
        "SELECT syncular.migrate_schema(1, $1)",
        &[&json!({"tasks": tasks, "docs": docs})],
    )
    .unwrap();
    c.batch_execute("COMMIT").unwrap();
    let e = sql_error(&reader.query_one(encode, &[]).unwrap_err());
    assert!(
        e.state == "SY041"
            && e.hint
                .as_deref()
                .is_some_and(|h| h.contains("taken before that migration")),
        "a preloaded backend's first transaction, read before the migration: {e:?}"
    );
    reader.batch_execute("ROLLBACK").unwrap();
    reader.query_one(encode, &[]).unwrap();
}
