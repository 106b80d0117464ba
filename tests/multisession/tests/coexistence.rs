//! docs/SCENARIOS.md: coexistence, adoption, backup (CMP, OPS) and SCH-13 (retiring a table).

use serde_json::{json, Value};
use std::process::Command;
use std::thread;
use syncular_multisession::*;

/// Upstream 0.24's allocation statement feeding the commit insert (from its adapter).
const UPSTREAM_ALLOCATE: &str = "WITH allocated AS (
    INSERT INTO sync_partitions(partition, max_commit_seq) VALUES ($1, 1)
    ON CONFLICT (partition) DO UPDATE SET max_commit_seq = sync_partitions.max_commit_seq + 1
    RETURNING max_commit_seq)
  INSERT INTO sync_commits(partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms, writer_version)
  SELECT $1, max_commit_seq, 'c', $2, 'actor', 1750000000000, $3 FROM allocated RETURNING commit_seq";

const UPSTREAM_ALLOCATE_OLD: &str = "WITH allocated AS (
    INSERT INTO sync_partitions(partition, max_commit_seq) VALUES ($1, 1)
    ON CONFLICT (partition) DO UPDATE SET max_commit_seq = sync_partitions.max_commit_seq + 1
    RETURNING max_commit_seq)
  INSERT INTO sync_commits(partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms)
  SELECT $1, max_commit_seq, 'c', $2, 'actor', 1750000000000 FROM allocated RETURNING commit_seq";

#[test]
fn cmp_01_a_024_hosts_raw_statements_work_on_the_extensions_tables() {
    let db = TestDb::new("cmp01");
    let mut c = db.connect();
    append(&mut c, P, "tasks", "t0", Some(1));
    exec(&mut c, "SET search_path = syncular, public");
    let s: i64 = one(&mut c, UPSTREAM_ALLOCATE, &[&P, &"raw-1", &1i64]);
    assert_eq!(s, 2);
    c.execute(
        "WITH inserted AS (
           INSERT INTO sync_changes(partition, commit_seq, idx, tbl, row_id, op, row_version, scopes, payload)
           VALUES ($1, $2, 0, 'tasks', 'r1', 1, 2, '{\"project_id\":\"p1\"}'::text::jsonb, '\\x0102')
           RETURNING partition, commit_seq, tbl, row_id, op, scopes)
         INSERT INTO sync_change_scopes(partition, tbl, var, value, commit_seq)
         SELECT partition, tbl, key, value, commit_seq FROM inserted CROSS JOIN LATERAL jsonb_each_text(scopes)
         ON CONFLICT DO NOTHING",
        &[&P, &s],
    )
    .unwrap();
    assert_eq!(
        window_seqs(&mut c, P, "tasks", &json!({"project_id":["p1"]}), 1, 2, 10),
        vec![2]
    );
    assert_eq!(append(&mut c, P, "tasks", "t3", Some(1)), 3);
    set_fence(&mut c, P, 2);
    expect_error(
        try_one::<i64>(&mut c, UPSTREAM_ALLOCATE, &[&P, &"raw-2", &1i64]),
        "SY001",
        "sync.storage.writer_fence_rejected",
        None,
    );
    expect_error(
        try_one::<i64>(&mut c, UPSTREAM_ALLOCATE_OLD, &[&P, &"raw-3"]),
        "SY001",
        "sync.storage.writer_fence_rejected",
        None,
    );
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.max_commit_seq($1)", &[&P]),
        3
    );
}

#[test]
fn cmp_02_upstreams_partition_lock_and_the_api_serialize() {
    let db = TestDb::new("cmp02");
    let mut c = db.connect();
    one::<i64>(&mut c, "SELECT syncular.lock_partition($1)", &[&P]);
    let mut s1 = db.connect();
    exec(&mut s1, "SET search_path = syncular, public; BEGIN");
    one::<i64>(
        &mut s1,
        "SELECT max_commit_seq FROM sync_partitions WHERE partition = 'part-1' FOR UPDATE",
        &[],
    );
    let mut s2 = db.connect();
    let pid = backend_pid(&mut s2);
    let waiter = thread::spawn(move || append(&mut s2, P, "tasks", "t1", Some(V)));
    wait_until_blocked(&mut c, pid);
    exec(&mut s1, "COMMIT");
    assert_eq!(waiter.join().unwrap(), 1);
}

#[test]
fn cmp_03_adoption_of_a_024_database() {
    let db = TestDb::new("cmp03");
    let mut c = db.connect();
    legacy_database(&mut c);
    one::<Value>(&mut c, "SELECT syncular.retire_table('tasks')", &[]);
    expect_error(
        try_one::<Value>(
            &mut c,
            "SELECT syncular.adopt_legacy_tables('legacy', 'public')",
            &[],
        ),
        "SY004",
        "sync.storage.invalid_transaction_state",
        Some(json!({"reason":"no_transaction_block"})),
    );
    exec(&mut c, "BEGIN");
    let counts: Value = one(
        &mut c,
        "SELECT syncular.adopt_legacy_tables('legacy', 'public')",
        &[],
    );
    exec(&mut c, "COMMIT");
    assert_eq!(counts["sync_commits"], json!(3));
    assert_eq!(counts["sync_partitions"], json!(1));
    assert_eq!(counts["sync_writer_fence"], json!(1));
    assert_eq!(counts["sync_schema_meta"], json!(1));
    assert_eq!(counts["sync_push_results"], json!(1));
    assert_eq!(counts["sync_clients"], json!(1));
    assert_eq!(counts["sync_tombstones"], json!(0));
    assert_eq!(counts["sync_app_tables"], json!(2));
    assert_eq!(counts.as_object().unwrap().len(), 15);
    let historic: Vec<(i64, Option<i64>)> = c
        .query(
            "SELECT commit_seq, writer_version FROM syncular.sync_commits ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(historic, vec![(1, None), (2, None), (3, None)]);
    let result: Value = one(
        &mut c,
        "SELECT syncular.get_push_result($1, 'c1', 'k3')",
        &[&P],
    );
    assert_eq!(result["commitSeq"], json!(3));
    assert_eq!(
        one::<String>(
            &mut c,
            "SELECT jsonb_typeof(result) FROM syncular.sync_push_results",
            &[]
        ),
        "object"
    );
    let client: Value = one(&mut c, "SELECT syncular.get_client($1, 'c1')", &[&P]);
    assert!(client["subscriptions"].is_array());
    assert_eq!(
        one::<String>(
            &mut c,
            "SELECT jsonb_typeof(subscriptions) FROM syncular.sync_clients",
            &[]
        ),
        "array"
    );
    assert_eq!(
        one::<i64>(
            &mut c,
            "SELECT required_writer_version FROM syncular.sync_schema_meta",
            &[]
        ),
        0
    );
    assert_eq!(append(&mut c, P, "tasks", "t1", Some(1)), 4);
    expect_error(
        raw_commit(&mut c, P, 5, None),
        "SY001",
        "sync.storage.writer_fence_rejected",
        None,
    );
    let registered: (String, String, bool) = {
        let r = c.query_one("SELECT relation_schema::text, relation_name::text, maintain_row_meta FROM syncular.sync_app_tables WHERE tbl = 'tasks'", &[]).unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!(registered, ("public".into(), "tasks".into(), false));
    exec(&mut c, "BEGIN");
    expect_error(
        try_one::<Value>(&mut c, "SELECT syncular.adopt_legacy_tables('legacy')", &[]),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument":"source_schema","reason":"not_empty"})),
    );
    exec(&mut c, "ROLLBACK");
}

#[test]
fn sch_13_retiring_a_table() {
    let db = TestDb::new("sch13");
    let mut c = db.connect();
    put_row(
        &mut c,
        P,
        "docs",
        "d1",
        &json!({"org_id":"o1","project_id":"p1"}),
        1,
        &[1, 2],
    );
    one::<i32>(
        &mut c,
        "SELECT syncular.set_blob_refs($1, 'docs', 'd1', ARRAY['sha256:aa'])",
        &[&P],
    );
    append(&mut c, P, "docs", "d1", Some(V));
    migrate(&mut c, 1, &l1(), &json!([]));
    let mut without_docs = l2();
    without_docs.as_object_mut().unwrap().remove("docs");
    exec(&mut c, "BEGIN");
    one::<i64>(
        &mut c,
        "SELECT syncular.migrate_schema(2, $1)",
        &[&without_docs],
    );
    assert_eq!(
        one::<Value>(&mut c, "SELECT syncular.retire_table('docs')", &[]),
        json!({"rowScopes":2,"blobRefs":1,"registered":true})
    );
    exec(&mut c, "DROP TABLE public.docs; COMMIT");
    assert_eq!(
        count(&mut c, "syncular.sync_row_scopes WHERE tbl = 'docs'"),
        0
    );
    assert_eq!(
        count(&mut c, "syncular.sync_blob_refs WHERE tbl = 'docs'"),
        0
    );
    assert_eq!(count(&mut c, "syncular.sync_changes WHERE tbl = 'docs'"), 1);
    expect_error(
        c.query(
            "SELECT * FROM syncular.scan_rows($1, 'docs', '{\"org_id\":[\"o1\"]}', NULL, 10)",
            &[&P],
        ),
        "SY041",
        "sync.storage.unknown_table",
        None,
    );
}

fn sync_row_counts(c: &mut postgres::Client) -> Vec<(String, i64)> {
    let tables: Vec<String> = column(
        c,
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = 'syncular' AND c.relkind = 'r' ORDER BY 1",
        &[],
    );
    tables
        .into_iter()
        .map(|t| {
            let n = count(c, &format!("syncular.{t}"));
            (t, n)
        })
        .collect()
}

fn pg_tool(tool: &str, args: &[&str]) {
    let base = cluster();
    let param = |k: &str| {
        base.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
            .unwrap_or("")
            .to_string()
    };
    // The client tools of the server's major (scripts/test.sh sets the directory per major).
    let bin = std::env::var("SYNCULAR_TEST_PG_BIN")
        .unwrap_or_else(|_| "/usr/lib/postgresql/15/bin".into());
    let status = Command::new(format!("{bin}/{tool}"))
        .args([
            "-h",
            &param("host"),
            "-p",
            &param("port"),
            "-U",
            &param("user"),
        ])
        .args(args)
        .env("PGOPTIONS", "-c session_replication_role=replica")
        .status()
        .unwrap_or_else(|e| panic!("{tool}: {e}"));
    assert!(status.success(), "{tool} {args:?} failed");
}

#[test]
fn ops_01_dump_and_restore_keep_the_data() {
    let db = TestDb::new("ops01");
    let mut c = db.connect();
    migrate(&mut c, 1, &l1(), &json!([]));
    push_upserts(&mut c, P, "c1", "k1", &[("tasks", "t1", p1())], &json!([]));
    push_upserts(&mut c, P, "c1", "k2", &[("tasks", "t2", p1())], &json!([]));
    one::<i32>(
        &mut c,
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&P, &json!([reaction(2, RKEY)])],
    );
    declare(&mut c, P, "proj", 1, NOW);
    one::<Value>(
        &mut c,
        "SELECT syncular.touch_partition($1, $2, 'e')",
        &[&P, &NOW],
    );
    let before = sync_row_counts(&mut c);
    let dump = std::env::temp_dir().join(format!("{}.sql", db.name));
    let dump = dump.to_str().unwrap();
    pg_tool("pg_dump", &["-d", &db.name, "-f", dump]);
    let restored = format!("{}_restored", db.name);
    let mut admin = connect_to("postgres");
    exec(&mut admin, &format!("DROP DATABASE IF EXISTS {restored}"));
    exec(
        &mut admin,
        &format!("CREATE DATABASE {restored} TEMPLATE template0"),
    );
    pg_tool(
        "psql",
        &["-q", "-v", "ON_ERROR_STOP=1", "-d", &restored, "-f", dump],
    );
    let restored_db = TestDb { name: restored };
    let mut r = restored_db.connect();
    assert_eq!(sync_row_counts(&mut r), before);
    let native: i64 = one(
        &mut r,
        "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'syncular.sync_commits'::regclass
            AND tgname = 'sync_commits_writer_fence'
            AND tgfoid = 'syncular.writer_fence_trigger()'::regprocedure",
        &[],
    );
    assert_eq!(native, 1);
    assert_eq!(append(&mut r, P, "tasks", "t3", Some(1)), 3);
    expect_error(
        raw_commit(&mut r, P, 4, None),
        "SY001",
        "sync.storage.writer_fence_rejected",
        None,
    );
    let _ = std::fs::remove_file(dump);
}
