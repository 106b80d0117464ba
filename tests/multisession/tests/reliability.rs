//! Reliability (issue 5): a 10k-commit race on one partition, concurrent replays, hostile input
//! through every JSON-taking function, and a crash of the server under load.

use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};
use syncular_multisession::rng::Rng;
use syncular_multisession::*;

/// The top-level keys of a commit document, in the order `append_commit` reads them.
const COMMIT_KEYS: [&str; 6] = [
    "clientId",
    "clientCommitId",
    "actorId",
    "createdAtMs",
    "writerVersion",
    "changes",
];

/// A random JSON value nested up to `depth`, its strings and keys drawn from the API's own words.
fn random_json(rng: &mut Rng, depth: u32) -> Value {
    let pick = if depth == 0 {
        rng.below(6)
    } else {
        rng.below(8)
    };
    match pick {
        0 => Value::Null,
        1 => json!(rng.below(2) == 0),
        2 => json!((rng.next_u64() as i64) >> rng.below(64)),
        3 => json!((rng.next_u64() as f64) / 7.0 - 1e18),
        4 => {
            json!(rng
                .pick(&["", "sync_x", "a\"b.c", "upsert", "delete", "AQID", "%%%", "p1", "é☃"]))
        }
        5 => json!(format!("s{}", rng.below(1000))),
        6 => Value::Array(
            (0..rng.below(4))
                .map(|_| random_json(rng, depth - 1))
                .collect(),
        ),
        _ => {
            let keys: Vec<&str> = COMMIT_KEYS
                .into_iter()
                .chain([
                    "table",
                    "rowId",
                    "op",
                    "scopes",
                    "payload",
                    "status",
                    "results",
                    "opIndex",
                    "commitSeq",
                    "type",
                    "version",
                    "idempotencyKey",
                    "cursor",
                    "subscriptions",
                    "code",
                    "atMs",
                    "details",
                    "x",
                ])
                .collect();
            Value::Object(
                (0..rng.below(5))
                    .map(|_| (rng.pick(&keys).to_string(), random_json(rng, depth - 1)))
                    .collect(),
            )
        }
    }
}

#[test]
fn ten_thousand_commits_from_eight_sessions_with_rollbacks_stay_dense_and_complete() {
    let db = TestDb::new("rel10k");
    const TARGET: usize = 10_000;
    let committed = Arc::new(AtomicUsize::new(0));
    let acknowledged = Arc::new(Mutex::new(BTreeMap::<i64, String>::new()));
    let workers: Vec<_> = (0..8u64)
        .map(|w| {
            let mut c = db.connect();
            let (committed, acknowledged) = (committed.clone(), acknowledged.clone());
            thread::spawn(move || {
                let mut rng = Rng(0x9E3779B97F4A7C15 ^ (w + 1));
                let mut rolled_back = 0;
                let mut i = 0;
                while committed.load(Ordering::SeqCst) < TARGET {
                    i += 1;
                    let ccid = format!("w{w}-{i}");
                    let project = format!("p{}", rng.below(5));
                    let d = doc(&ccid, json!([
                        {"table":"tasks","rowId":format!("{ccid}-a"),"op":"upsert","rowVersion":1,"scopes":{"project_id":project},"payload":"AQID"},
                        {"table":"docs","rowId":format!("{ccid}-b"),"op":"delete","scopes":{"org_id":"o1"}}
                    ]), Some(V));
                    let mut tx = c.transaction().unwrap();
                    let s: i64 = tx.query_one("SELECT syncular.append_commit($1, $2)", &[&P, &d]).unwrap().get(0);
                    if rng.below(10) == 0 {
                        tx.rollback().unwrap();
                        rolled_back += 1;
                    } else {
                        tx.commit().unwrap();
                        committed.fetch_add(1, Ordering::SeqCst);
                        acknowledged.lock().unwrap().insert(s, ccid);
                    }
                }
                rolled_back
            })
        })
        .collect();
    let rolled_back: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    let acknowledged = acknowledged.lock().unwrap().clone();
    let n = acknowledged.len() as i64;
    assert!(n >= TARGET as i64);
    assert!(rolled_back > 0, "some transactions must have rolled back");
    let mut c = db.connect();
    // Dense 1..N, no duplicate, and each number is the commit its session was told it got.
    let stored: BTreeMap<i64, String> = c
        .query(
            "SELECT commit_seq, client_commit_id FROM syncular.sync_commits WHERE partition = $1",
            &[&P],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(stored, acknowledged);
    assert_eq!(
        stored.keys().copied().collect::<Vec<_>>(),
        (1..=n).collect::<Vec<_>>()
    );
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.max_commit_seq($1)", &[&P]),
        n
    );
    // Every change and scope-index row, for exactly the committed commits.
    let per_commit: Vec<(i64, i64, i64)> = c
        .query(
            "SELECT c.commit_seq,
                    (SELECT count(*) FROM syncular.sync_changes ch WHERE ch.partition = c.partition AND ch.commit_seq = c.commit_seq),
                    (SELECT count(*) FROM syncular.sync_change_scopes s WHERE s.partition = c.partition AND s.commit_seq = c.commit_seq)
               FROM syncular.sync_commits c WHERE c.partition = $1",
            &[&P],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert!(
        per_commit
            .iter()
            .all(|&(_, changes, scopes)| changes == 2 && scopes == 2),
        "incomplete commit"
    );
    assert_eq!(count(&mut c, "syncular.sync_changes"), 2 * n);
    assert_eq!(count(&mut c, "syncular.sync_change_scopes"), 2 * n);
    assert_eq!(count(&mut c, "syncular.sync_tombstones"), n);
    println!(
        "reliability: {n} commits from 8 sessions, {rolled_back} rolled back, dense and complete"
    );
}

#[test]
fn concurrent_replays_of_one_commit_apply_once() {
    let db = TestDb::new("relreplay");
    const SESSIONS: usize = 6;
    let barrier = Arc::new(Barrier::new(SESSIONS));
    let deliveries: Vec<_> = (0..SESSIONS)
        .map(|k| {
            let mut c = db.connect();
            let barrier = barrier.clone();
            thread::spawn(move || {
                barrier.wait();
                let mut tx = c.transaction().unwrap();
                let replay: Option<Value> = tx
                    .query_one("SELECT syncular.push_begin($1, 'c1', 'dup', 1)", &[&P])
                    .unwrap()
                    .get(0);
                if let Some(replay) = replay {
                    return (false, replay);
                }
                tx.batch_execute("SAVEPOINT syncular_push_candidate")
                    .unwrap();
                put_row(&mut tx, P, "tasks", "t1", &p1(), 1, &[1]);
                let d = doc("dup", json!([chg("tasks", "t1")]), Some(V));
                let s: i64 = tx
                    .query_one("SELECT syncular.append_commit($1, $2)", &[&P, &d])
                    .unwrap()
                    .get(0);
                let mine = applied(s, 1, &format!("delivery-{k}"));
                let stored: Value = tx
                    .query_one(
                        "SELECT syncular.put_push_result($1, 'c1', 'dup', $2)",
                        &[&P, &mine],
                    )
                    .unwrap()
                    .get(0);
                tx.commit().unwrap();
                (true, stored)
            })
        })
        .collect();
    let outcomes: Vec<(bool, Value)> = deliveries.into_iter().map(|d| d.join().unwrap()).collect();
    assert_eq!(
        outcomes
            .iter()
            .filter(|(applied_here, _)| *applied_here)
            .count(),
        1
    );
    let identities: BTreeSet<String> = outcomes
        .iter()
        .map(|(_, r)| r["cacheIdentity"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        identities.len(),
        1,
        "every delivery sees the winner's result"
    );
    let mut c = db.connect();
    assert_eq!(count(&mut c, "syncular.sync_commits"), 1);
    assert_eq!(count(&mut c, "syncular.sync_push_results"), 1);
    assert_eq!(
        one::<i64>(
            &mut c,
            "SELECT \"_sync_server_version\" FROM public.tasks",
            &[]
        ),
        1
    );
}

/// Counts of every sync_* table: equal before and after a refused call means nothing was written.
fn fingerprint(c: &mut postgres::Client) -> String {
    one(
        c,
        "SELECT string_agg(t || '=' || n, ',' ORDER BY t) FROM (
           SELECT 'commits' t, count(*) n FROM syncular.sync_commits UNION ALL
           SELECT 'changes', count(*) FROM syncular.sync_changes UNION ALL
           SELECT 'scopes', count(*) FROM syncular.sync_change_scopes UNION ALL
           SELECT 'partitions', count(*) + coalesce(sum(max_commit_seq), 0) FROM syncular.sync_partitions UNION ALL
           SELECT 'results', count(*) FROM syncular.sync_push_results UNION ALL
           SELECT 'reactions', count(*) FROM syncular.sync_reactions UNION ALL
           SELECT 'clients', count(*) FROM syncular.sync_clients UNION ALL
           SELECT 'rowscopes', count(*) FROM syncular.sync_row_scopes UNION ALL
           SELECT 'tombstones', count(*) FROM syncular.sync_tombstones UNION ALL
           SELECT 'checkpoints', count(*) FROM syncular.sync_backfill_checkpoints UNION ALL
           SELECT 'fences', count(*) FROM syncular.sync_writer_fence UNION ALL
           SELECT 'meta', count(*) FROM syncular.sync_schema_meta) x",
        &[],
    )
}

/// Calls `sql` with the JSON argument; any failure must be a coded `SY` refusal that wrote
/// nothing. Returns whether the call succeeded.
fn hostile_call(c: &mut postgres::Client, sql: &str, arg: &Value) -> bool {
    let before = fingerprint(c);
    match c.query(sql, &[arg]) {
        Ok(_) => true,
        Err(e) => {
            let err = e
                .as_db_error()
                .unwrap_or_else(|| panic!("connection lost on {sql} with {arg}: {e}"));
            let state = err.code().code();
            assert!(
                state.starts_with("SY"),
                "{sql} with {arg}: {state} {}",
                err.message()
            );
            assert_eq!(err.message(), err.message().trim(), "message is the code");
            assert_eq!(
                fingerprint(c),
                before,
                "a refused call wrote something: {sql} with {arg}"
            );
            false
        }
    }
}

const JSON_FUNCTIONS: &[&str] = &[
    "SELECT syncular.append_commit('part-1', $1)",
    "SELECT syncular.put_push_result('part-1', 'c1', 'fuzz', $1)",
    "SELECT syncular.enqueue_reactions('part-1', $1)",
    "SELECT syncular.put_client('part-1', $1)",
    "SELECT syncular.check_schema(1, $1)",
    "SELECT syncular.check_schema(1, '{}', $1)",
    "SELECT syncular.serve_gate_refusal('part-1', 1, $1)",
    "SELECT * FROM syncular.read_commit_window('part-1', 'tasks', $1, 0, 10, 10)",
    "SELECT * FROM syncular.scan_rows('part-1', 'tasks', $1, NULL, 10)",
    "SELECT syncular.set_row_scopes('part-1', 'tasks', 'r', $1)",
    "SELECT syncular.latest_scoped_change_seq('part-1', 'tasks', $1)",
    "SELECT syncular.fail_reaction('part-1', 'k', 'owner', $1)",
    "SELECT syncular.fail_reactions('part-1', 'owner', $1)",
];

#[test]
fn hostile_json_to_every_json_function_is_refused_with_a_code_and_writes_nothing() {
    let db = TestDb::new("relfuzz");
    let mut c = db.connect();
    let mut rng = Rng(42);
    let (mut cases, mut accepted) = (0, 0);
    for sql in JSON_FUNCTIONS {
        for _ in 0..120 {
            let value = random_json(&mut rng, 4);
            accepted += hostile_call(&mut c, sql, &value) as usize;
            cases += 1;
        }
    }
    // Near-valid commit documents with one field replaced by a random value.
    let valid = doc("near", json!([chg("tasks", "t1")]), Some(V));
    for i in 0..400 {
        let mut d = valid.clone();
        let value = random_json(&mut rng, 3);
        if i % 2 == 0 {
            let key = *rng.pick(&COMMIT_KEYS);
            d[key] = value;
        } else {
            let key = *rng.pick(&["table", "rowId", "op", "rowVersion", "scopes", "payload"]);
            d["changes"][0][key] = value;
        }
        d["clientCommitId"] = json!(format!("near-{i}"));
        accepted += hostile_call(&mut c, JSON_FUNCTIONS[0], &d) as usize;
        cases += 1;
    }
    println!("reliability: {cases} hostile JSON cases, {accepted} accepted, every other one refused with an SY code");
    assert!(cases >= 1800);
}

#[test]
fn crafted_hostile_inputs() {
    let db = TestDb::new("relcrafted");
    let mut c = db.connect();
    let append = "SELECT syncular.append_commit('part-1', $1)";
    // Huge: 2,000 changes with 2 KiB payloads, and one 8 MiB payload.
    let big_payload = "QUJD".repeat(512);
    let changes: Vec<Value> = (0..2000)
        .map(|i| json!({"table":"tasks","rowId":format!("r{i}"),"op":"upsert","scopes":{"project_id":"p1"},"payload":big_payload}))
        .collect();
    assert!(hostile_call(
        &mut c,
        append,
        &doc("huge", Value::Array(changes), Some(V))
    ));
    assert_eq!(count(&mut c, "syncular.sync_changes"), 2000);
    let giant = json!([{"table":"tasks","rowId":"g","op":"upsert","scopes":{},"payload":"AAAA".repeat(2 * 1024 * 1024)}]);
    assert!(hostile_call(&mut c, append, &doc("giant", giant, Some(V))));
    assert_eq!(
        one::<i32>(
            &mut c,
            "SELECT length(payload) FROM syncular.sync_changes WHERE row_id = 'g'",
            &[]
        ),
        6 * 1024 * 1024
    );
    // Deep nesting: refused as too_deep beyond what a document may hold; ignored keys may nest.
    let deep = |n: usize| -> Value { (0..n).fold(json!(1), |v, _| json!([v])) };
    let mut d = doc("deep", json!([]), Some(V));
    d["x"] = deep(100);
    assert!(hostile_call(&mut c, append, &d));
    let nested = format!("{{\"x\":{}1{}}}", "[".repeat(300), "]".repeat(300));
    expect_error(
        try_one::<i64>(
            &mut c,
            "SELECT syncular.append_commit('part-1', $1::text::jsonb)",
            &[&nested],
        ),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument":"commit","reason":"too_deep"})),
    );
    // NUL cannot even reach the function: PostgreSQL refuses it in jsonb and text.
    let nul = sql_error(
        &c.query(
            "SELECT syncular.append_commit('part-1', '{\"clientId\":\"a\\u0000b\"}')",
            &[],
        )
        .unwrap_err(),
    );
    assert_eq!(nul.state, "22P05");
    // Arbitrary bytes (not UTF-8) in a payload are stored exactly.
    assert!(hostile_call(
        &mut c,
        append,
        &doc(
            "bytes",
            json!([{"table":"tasks","rowId":"b","op":"upsert","scopes":{},"payload":"/wDA/w"}]),
            Some(V)
        )
    ));
    assert_eq!(
        one::<Vec<u8>>(
            &mut c,
            "SELECT payload FROM syncular.sync_changes WHERE row_id = 'b'",
            &[]
        ),
        vec![0xFF, 0x00, 0xC0, 0xFF]
    );
    // Negative and overflowing numbers.
    for (key, value, reason) in [
        ("createdAtMs", json!(-1), "range"),
        ("createdAtMs", json!(9007199254740992i64), "range"),
        ("writerVersion", json!(-5), "range"),
        ("createdAtMs", json!(u64::MAX), "range"),
    ] {
        let mut d = doc("num", json!([]), Some(V));
        d[key] = value;
        expect_error(
            try_one::<i64>(&mut c, append, &[&d]),
            "SY005",
            "sync.storage.invalid_commit",
            Some(json!({"path": key, "reason": reason})),
        );
    }
    // Beyond what a double holds: still a number to jsonb, and out of range for the field.
    let mut huge = serde_json::to_string(&doc("num", json!([]), Some(V))).unwrap();
    huge = huge.replacen("\"createdAtMs\":", "\"createdAtMs\":1e400,\"was\":", 1);
    expect_error(
        try_one::<i64>(
            &mut c,
            "SELECT syncular.append_commit('part-1', $1::text::jsonb)",
            &[&huge],
        ),
        "SY005",
        "sync.storage.invalid_commit",
        Some(json!({"path":"createdAtMs","reason":"range"})),
    );
    // Table names with quotes, dots and SQL: data in the log, quoted identifiers in DDL.
    let evil = "a\"b.c'; DROP TABLE public.tasks; --";
    assert!(hostile_call(
        &mut c,
        append,
        &doc(
            "evil",
            json!([{"table":evil,"rowId":"r","op":"upsert","scopes":{"k":"v"}}]),
            Some(V)
        )
    ));
    assert_eq!(
        count(
            &mut c,
            &format!(
                "syncular.read_commit_window('part-1', '{}', '{{\"k\":[\"v\"]}}', 0, 100, 10)",
                evil.replace('\'', "''")
            )
        ),
        1
    );
    exec(
        &mut c,
        r#"CREATE SCHEMA "we.ird"""; CREATE TABLE "we.ird"""."ta""ble; x" (LIKE public.tasks INCLUDING ALL)"#,
    );
    c.execute(
        r#"SELECT syncular.register_table($1, '"we.ird"""."ta""ble; x"'::regclass, true)"#,
        &[&evil],
    )
    .unwrap();
    c.execute(
        r#"INSERT INTO "we.ird"""."ta""ble; x" ("_sync_partition", "_sync_row_id", id, "_sync_server_version", "_sync_scopes", "_sync_payload")
           VALUES ('part-1', 'w1', 'w1', 1, '{"k":"v"}', '\x01')"#,
        &[],
    )
    .unwrap();
    let rows: Vec<String> = column(
        &mut c,
        "SELECT row_id FROM syncular.scan_rows('part-1', $1, '{\"k\":[\"v\"]}', NULL, 10)",
        &[&evil],
    );
    assert_eq!(rows, vec!["w1"]);
    assert_eq!(
        count(&mut c, "public.tasks"),
        0,
        "public.tasks still exists and was not touched"
    );
}

fn cluster_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/cluster.sh")
}

/// `cluster.sh args…`; a start is retried twice (a machine shared with other test clusters can
/// refuse one transiently), and a final failure shows the server log.
fn cluster(args: &[&str]) {
    for attempt in 1..=3 {
        let status = Command::new("bash")
            .arg(cluster_script())
            .args(args)
            .status()
            .unwrap();
        if status.success() {
            return;
        }
        let log = std::fs::read_to_string(std::path::Path::new(args[1]).join("server.log"))
            .unwrap_or_default();
        eprintln!("cluster.sh {args:?} failed (attempt {attempt}); server log:\n{log}");
        assert!(
            attempt < 3 && args[0] == "start",
            "cluster.sh {args:?} failed"
        );
        thread::sleep(Duration::from_secs(2));
    }
}

/// Stops the crash test's own cluster however the test ends.
struct OwnCluster(String);
impl Drop for OwnCluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(cluster_script())
            .args(["stop", &self.0])
            .status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// SIGKILL the postmaster (and its orphaned children) under a running load, restart, and check
/// that every acknowledged commit survived whole and the sequence continues.
#[test]
fn a_crash_under_load_loses_no_acknowledged_commit() {
    let dir = std::env::temp_dir().join(format!("syncular-crash-{}", std::process::id()));
    let dir_s = dir.to_str().unwrap().to_string();
    // A port of its own per run (a previous run's cluster may still be shutting down), below
    // Linux's ephemeral range 32768-60999, where any client connection can hold a port.
    let port = std::env::var("SYNCULAR_CRASH_PORT")
        .unwrap_or_else(|_| (27000 + std::process::id() % 1000).to_string());
    let _ = std::fs::remove_dir_all(&dir);
    let _own = OwnCluster(dir_s.clone());
    cluster(&["start", &dir_s, &port]);
    let url = format!("host=127.0.0.1 port={port} user=postgres dbname=postgres");
    let mut admin = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    // Durable commits for this test: the throwaway cluster runs with fsync off otherwise.
    exec(&mut admin, "ALTER SYSTEM SET fsync = on");
    exec(&mut admin, "SELECT pg_reload_conf()");
    exec(&mut admin, "CREATE EXTENSION syncular");
    let acknowledged = Arc::new(Mutex::new(BTreeMap::<i64, String>::new()));
    // Writers append until the server dies under them; only commits whose COMMIT returned are
    // recorded as acknowledged.
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (acknowledged, url) = (acknowledged.clone(), url.clone());
            thread::spawn(move || {
                let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
                for i in 0.. {
                    let ccid = format!("w{w}-{i}");
                    let d = doc(
                        &ccid,
                        json!([chg("tasks", &ccid), chg("docs", &ccid)]),
                        Some(V),
                    );
                    match c.query_one("SELECT syncular.append_commit('part-1', $1)", &[&d]) {
                        Ok(row) => {
                            acknowledged.lock().unwrap().insert(row.get(0), ccid);
                        }
                        Err(_) => return,
                    }
                }
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(1500));
    let pid = std::fs::read_to_string(dir.join("postmaster.pid"))
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .trim()
        .to_string();
    Command::new("kill").args(["-9", &pid]).status().unwrap();
    let _ = Command::new("pkill").args(["-9", "-P", &pid]).status();
    for w in writers {
        w.join().unwrap();
    }
    // The dead postmaster must be gone (reaped) before a new one may take the data directory.
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        assert!(
            Instant::now() < deadline,
            "the killed postmaster was never reaped"
        );
        thread::sleep(Duration::from_millis(50));
    }
    let acknowledged = acknowledged.lock().unwrap().clone();
    assert!(acknowledged.len() > 10, "the load ran before the crash");
    cluster(&["start", &dir_s, &port]);
    let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let stored: BTreeMap<i64, String> = c
        .query(
            "SELECT commit_seq, client_commit_id FROM syncular.sync_commits",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    for (seq, ccid) in &acknowledged {
        assert_eq!(
            stored.get(seq),
            Some(ccid),
            "acknowledged commit {seq} lost"
        );
    }
    let n = stored.len() as i64;
    assert_eq!(
        stored.keys().copied().collect::<Vec<_>>(),
        (1..=n).collect::<Vec<_>>(),
        "dense after recovery"
    );
    let incomplete: i64 = one(
        &mut c,
        "SELECT count(*) FROM syncular.sync_commits c
          WHERE (SELECT count(*) FROM syncular.sync_changes ch WHERE ch.commit_seq = c.commit_seq) <> 2
             OR (SELECT count(*) FROM syncular.sync_change_scopes s WHERE s.commit_seq = c.commit_seq) <> 2",
        &[],
    );
    assert_eq!(incomplete, 0, "no half-written commit");
    assert_eq!(count(&mut c, "syncular.sync_changes"), 2 * n);
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.max_commit_seq('part-1')", &[]),
        n
    );
    assert_eq!(append(&mut c, "part-1", "tasks", "after", Some(V)), n + 1);
    println!(
        "reliability: crash after {} acknowledged commits ({n} durable), all present and complete",
        acknowledged.len()
    );
}
