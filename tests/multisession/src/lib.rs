//! Test harness for the scenarios of docs/SCENARIOS.md that need real connections.
//!
//! Every test gets its own database, created from a fixture template (extension installed, app
//! tables `tasks` and `docs` created and registered), so tests are independent even though the
//! gate and the barrier look at every partition. The cluster is started by `scripts/test.sh`;
//! `SYNCULAR_TEST_PG` holds its connection parameters (without a database name).

pub mod native_push;
pub mod rng;

use postgres::types::ToSql;
use postgres::{Client, NoTls};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

pub const P: &str = "part-1";
pub const NOW: i64 = 1_750_000_000_000;
pub const DAY: i64 = 86_400_000;
pub const V: i64 = 1;
const TEMPLATE: &str = "syncular_fixture";

/// The connection parameters of the test cluster, without a database name (`SYNCULAR_TEST_PG`).
pub fn cluster() -> String {
    std::env::var("SYNCULAR_TEST_PG")
        .unwrap_or_else(|_| "host=127.0.0.1 port=25439 user=postgres".to_string())
}

/// A connection to database `db` of the test cluster as its superuser.
pub fn connect_to(db: &str) -> Client {
    Client::connect(&format!("{} dbname={db}", cluster()), NoTls)
        .unwrap_or_else(|e| panic!("cannot connect to {db}: {e} (is the test cluster running?)"))
}

/// The DDL of an app table: `columns` (app columns, each ending in `,`), then the meta columns
/// and primary key of docs/API.md §App-table template.
pub fn app_table_sql(relation: &str, columns: &str) -> String {
    format!(
        r#"CREATE TABLE {relation} (
  "_sync_partition" text NOT NULL, "_sync_row_id" text NOT NULL,
  {columns}
  "_sync_server_version" bigint NOT NULL, "_sync_scopes" jsonb NOT NULL,
  "_sync_payload" bytea NOT NULL, "_sync_column_versions" bytea,
  PRIMARY KEY ("_sync_partition", "_sync_row_id"));
"#
    )
}

/// The host-owned app tables of the fixtures (docs/SCENARIOS.md §Fixtures).
pub fn app_tables_sql() -> String {
    [
        app_table_sql("public.tasks", "id text, project_id text, data bytea,"),
        "CREATE INDEX sync_ix_tasks_by_project ON public.tasks (\"_sync_partition\", project_id);\n".into(),
        app_table_sql("public.docs", "id text, org_id text, project_id text,"),
    ]
    .concat()
}

fn ensure_template() {
    static READY: OnceLock<()> = OnceLock::new();
    READY.get_or_init(|| {
        let mut admin = connect_to("postgres");
        // Several test binaries may start at once: serialize the template creation.
        admin.execute("SELECT pg_advisory_lock(4242)", &[]).unwrap();
        let exists: bool = admin
            .query_one("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", &[&TEMPLATE])
            .unwrap()
            .get(0);
        if !exists {
            admin.batch_execute(&format!("CREATE DATABASE {TEMPLATE}")).unwrap();
            let mut t = connect_to(TEMPLATE);
            // SYNCULAR_TEST_UPGRADE_FROM=<version>: run the whole suite against an install that
            // was created at an older released version and updated (ALTER EXTENSION … UPDATE).
            match std::env::var("SYNCULAR_TEST_UPGRADE_FROM") {
                Ok(from) if !from.is_empty() => {
                    t.batch_execute(&format!("CREATE EXTENSION syncular VERSION '{from}'")).unwrap();
                    t.batch_execute("ALTER EXTENSION syncular UPDATE").unwrap();
                }
                _ => t.batch_execute("CREATE EXTENSION syncular").unwrap(),
            }
            t.batch_execute(&app_tables_sql()).unwrap();
            t.batch_execute(
                "DO $$ BEGIN
                   IF to_regprocedure('syncular.register_table(text,regclass,boolean)') IS NOT NULL THEN
                     PERFORM syncular.register_table('tasks', 'public.tasks');
                     PERFORM syncular.register_table('docs', 'public.docs');
                   END IF;
                 END $$",
            )
            .unwrap();
        }
        admin.execute("SELECT pg_advisory_unlock(4242)", &[]).unwrap();
    });
}

/// A fresh database for one test.
pub struct TestDb {
    pub name: String,
}

impl TestDb {
    pub fn new(test: &str) -> TestDb {
        ensure_template();
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "t_{}_{}_{}",
            test.to_lowercase()
                .replace(|c: char| !c.is_ascii_alphanumeric(), "_"),
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = connect_to("postgres");
        admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name}"))
            .unwrap();
        admin
            .batch_execute(&format!("CREATE DATABASE {name} TEMPLATE {TEMPLATE}"))
            .unwrap();
        TestDb { name }
    }

    pub fn connect(&self) -> Client {
        connect_to(&self.name)
    }

    /// A connection as `user`, a login role the test created.
    pub fn connect_as(&self, user: &str) -> Client {
        Client::connect(
            &format!("{} dbname={} user={user}", cluster(), self.name),
            NoTls,
        )
        .unwrap_or_else(|e| panic!("cannot connect to {} as {user}: {e}", self.name))
    }

    /// A connection whose notices (NOTICE, and DEBUG under `client_min_messages`) are kept in
    /// the returned list, oldest first.
    pub fn connect_with_notices(&self) -> (Client, Arc<Mutex<Vec<String>>>) {
        let notices = Arc::new(Mutex::new(Vec::new()));
        let sink = notices.clone();
        let mut config: postgres::Config = format!("{} dbname={}", cluster(), self.name)
            .parse()
            .unwrap();
        config.notice_callback(move |n| sink.lock().unwrap().push(n.message().to_string()));
        let client = config
            .connect(NoTls)
            .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", self.name));
        (client, notices)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return; // keep the database for a post-mortem
        }
        if let Ok(mut admin) = Client::connect(&format!("{} dbname=postgres", cluster()), NoTls) {
            let _ = admin.batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ));
        }
    }
}

/// An error as a client sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct SqlError {
    pub state: String,
    pub message: String,
    pub detail: Option<Value>,
    pub hint: Option<String>,
}

pub fn sql_error(e: &postgres::Error) -> SqlError {
    let db = e
        .as_db_error()
        .unwrap_or_else(|| panic!("not a server error: {e}"));
    SqlError {
        state: db.code().code().to_string(),
        message: db.message().to_string(),
        detail: db
            .detail()
            .map(|d| serde_json::from_str(d).unwrap_or_else(|_| json!(d))),
        hint: db.hint().map(str::to_string),
    }
}

/// Asserts that `result` failed with `state`/`message` and, if given, exactly `detail`.
#[track_caller]
pub fn expect_error<T: std::fmt::Debug>(
    result: Result<T, postgres::Error>,
    state: &str,
    message: &str,
    detail: Option<Value>,
) -> SqlError {
    let err = match result {
        Ok(v) => panic!("expected {state} {message}, got Ok({v:?})"),
        Err(e) => sql_error(&e),
    };
    assert_eq!(
        (err.state.as_str(), err.message.as_str()),
        (state, message),
        "{err:?}"
    );
    if let Some(detail) = detail {
        assert_eq!(err.detail.as_ref(), Some(&detail), "DETAIL of {message}");
    }
    err
}

/// `SELECT <expr>` with parameters, first column of the one row.
#[track_caller]
pub fn one<T: for<'a> postgres::types::FromSql<'a>>(
    c: &mut Client,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> T {
    c.query_one(sql, params)
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"))
        .get(0)
}

/// Whether `e` is the row codec's "cannot be told" answer (`SY041`, docs/API.md `decode_row`):
/// on PostgreSQL 18, a default-version call in the transaction that loaded the library, after a
/// migration that another backend committed, while a transaction older than the migration ran
/// — in this suite, any other test's.
pub fn codec_unproven(e: &postgres::Error) -> bool {
    let e = sql_error(e);
    e.state == "SY041"
        && e.hint
            .as_deref()
            .is_some_and(|h| h.contains("cannot be told"))
}

/// [`one`] for a row-codec call at its default version by a backend other than the one that
/// migrated: run again once if it answers [`codec_unproven`], as a host does.
#[track_caller]
pub fn one_after_migration<T: for<'a> postgres::types::FromSql<'a>>(
    c: &mut Client,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> T {
    match c.query_one(sql, params) {
        Err(e) if codec_unproven(&e) => one(c, sql, params),
        other => other.unwrap_or_else(|e| panic!("{sql}: {e:?}")).get(0),
    }
}

/// The server's major version.
pub fn server_major(c: &mut Client) -> i32 {
    one::<i32>(
        c,
        "SELECT current_setting('server_version_num')::int / 10000",
        &[],
    )
}

/// The first column of every row of `sql`, in the order it returns them.
#[track_caller]
pub fn column<T: for<'a> postgres::types::FromSql<'a>>(
    c: &mut impl postgres::GenericClient,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Vec<T> {
    c.query(sql, params)
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"))
        .iter()
        .map(|r| r.get(0))
        .collect()
}

pub fn try_one<T: for<'a> postgres::types::FromSql<'a>>(
    c: &mut Client,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<T, postgres::Error> {
    c.query_one(sql, params).map(|r| r.get(0))
}

#[track_caller]
pub fn exec(c: &mut Client, sql: &str) {
    c.batch_execute(sql)
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
}

pub fn count(c: &mut Client, from_where: &str) -> i64 {
    one(c, &format!("SELECT count(*) FROM {from_where}"), &[])
}

// ---- fixture shorthands (docs/SCENARIOS.md §Fixtures) ---------------------------------------

pub fn l1() -> Value {
    json!({"tasks":[{"name":"id","type":"string","nullable":false},
                    {"name":"project_id","type":"string","nullable":false},
                    {"name":"data","type":"bytes","nullable":true}],
           "docs":[{"name":"id","type":"string","nullable":false},
                   {"name":"org_id","type":"string","nullable":false},
                   {"name":"project_id","type":"string","nullable":false}]})
}

pub fn l2() -> Value {
    let mut l = l1();
    l["tasks"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name":"note","type":"string","nullable":true}));
    l
}

pub fn l3() -> Value {
    let mut l = l2();
    l["tasks"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name":"due","type":"string","nullable":true}));
    l
}

pub fn decl(partition: &str, name: &str, version: i64) -> Value {
    json!({"partition": partition, "name": name, "schemaVersion": version})
}

/// `chg(tbl, row, scopes = {"project_id":"p1"}, op = "upsert", ver = 1, payload = "AQID")`.
pub fn chg(tbl: &str, row: &str) -> Value {
    json!({"table": tbl, "rowId": row, "op": "upsert", "rowVersion": 1,
           "scopes": {"project_id": "p1"}, "payload": "AQID"})
}

/// `doc(ccid, changes, wv)`; `wv = None` omits `writerVersion`.
pub fn doc(ccid: &str, changes: Value, wv: Option<i64>) -> Value {
    let mut d = json!({"clientId":"c1","clientCommitId":ccid,"actorId":"a1","createdAtMs":NOW,
                       "changes":changes});
    if let Some(wv) = wv {
        d["writerVersion"] = json!(wv);
    }
    d
}

pub fn fresh_id() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("commit-{}", N.fetch_add(1, Ordering::Relaxed))
}

/// `append(p, tbl, row, wv)`: one change, a fresh client commit id; returns the commit_seq.
pub fn try_append(
    c: &mut Client,
    p: &str,
    tbl: &str,
    row: &str,
    wv: Option<i64>,
) -> Result<i64, postgres::Error> {
    let d = doc(&fresh_id(), json!([chg(tbl, row)]), wv);
    try_one(c, "SELECT syncular.append_commit($1, $2)", &[&p, &d])
}

#[track_caller]
pub fn append(c: &mut Client, p: &str, tbl: &str, row: &str, wv: Option<i64>) -> i64 {
    try_append(c, p, tbl, row, wv).unwrap_or_else(|e| panic!("append: {e:?}"))
}

/// `raw_commit(p, seq, wv)`: a direct INSERT; for `wv = None` the column is left out, like an
/// old binary.
pub fn raw_commit(
    c: &mut Client,
    p: &str,
    seq: i64,
    wv: Option<i64>,
) -> Result<u64, postgres::Error> {
    let ccid = format!("raw-{seq}");
    match wv {
        Some(wv) => c.execute(
            "INSERT INTO syncular.sync_commits
               (partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms, writer_version)
             VALUES ($1, $2, 'c1', $3, 'a1', $4, $5)",
            &[&p, &seq, &ccid, &NOW, &wv],
        ),
        None => c.execute(
            "INSERT INTO syncular.sync_commits
               (partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms)
             VALUES ($1, $2, 'c1', $3, 'a1', $4)",
            &[&p, &seq, &ccid, &NOW],
        ),
    }
}

/// `raw_checkpoint(p, n, v, state)`: a direct insert, no fence.
pub fn raw_checkpoint(c: &mut Client, p: &str, name: &str, v: i64, state: &str) {
    c.execute(
        "INSERT INTO syncular.sync_backfill_checkpoints
           (partition, name, schema_version, state, watermark, owner_epoch, observed_rows, updated_at_ms)
         VALUES ($1, $2, $3, $4, 0, 0, 0, $5)",
        &[&p, &name, &v, &state, &NOW],
    )
    .unwrap();
}

/// `set_fence(p, v)`: a direct upsert that may lower the fence.
pub fn set_fence(c: &mut Client, p: &str, v: i64) {
    c.execute(
        "INSERT INTO syncular.sync_writer_fence (partition, required_writer_version) VALUES ($1, $2)
         ON CONFLICT (partition) DO UPDATE SET required_writer_version = EXCLUDED.required_writer_version",
        &[&p, &v],
    )
    .unwrap();
}

/// Opens a transaction on `c` with 70 nested subtransactions, each with an id of its own (an
/// insert into a temporary table): more than PostgreSQL lists per backend (64), so every
/// snapshot taken while it runs — on the primary and on its standbys — has an incomplete list
/// of running subtransactions (`suboverflowed`). Left open; the caller ends it.
pub fn overflow_subtransactions(c: &mut Client) {
    let mut sql = String::from("BEGIN; CREATE TEMPORARY TABLE overflowing (i int);");
    for i in 0..70 {
        sql.push_str(&format!(
            "SAVEPOINT s{i}; INSERT INTO overflowing VALUES ({i});"
        ));
    }
    exec(c, &sql);
}

/// `migrate(v, layouts, declared)` = BEGIN; migrate_schema; COMMIT. Returns the previous version.
pub fn migrate(c: &mut Client, v: i64, layouts: &Value, declared: &Value) -> i64 {
    let mut tx = c.transaction().unwrap();
    let prev: i64 = tx
        .query_one(
            "SELECT syncular.migrate_schema($1, $2, $3)",
            &[&v, layouts, declared],
        )
        .unwrap()
        .get(0);
    tx.commit().unwrap();
    prev
}

/// [`migrate`] to `v` with `layouts`, run inside a savepoint (released, then committed): the
/// marker row is then written by a subtransaction of the migration (docs/SECURITY.md rule 19,
/// red teams 20 to 22).
pub fn migrate_in_savepoint(c: &mut Client, v: i64, layouts: &Value) {
    exec(c, "BEGIN; SAVEPOINT m");
    c.query_one("SELECT syncular.migrate_schema($1, $2)", &[&v, layouts])
        .unwrap();
    exec(c, "RELEASE SAVEPOINT m; COMMIT");
}

/// A checkpoint row as `(partition, name, schema_version, state, watermark, owner_epoch,
/// observed_rows, updated_at_ms)`.
pub type CheckpointRow = (String, String, i64, String, i64, i64, i64, i64);

pub fn checkpoint_row(row: &postgres::Row) -> CheckpointRow {
    (
        row.get(0),
        row.get(1),
        row.get(2),
        row.get(3),
        row.get(4),
        row.get(5),
        row.get(6),
        row.get(7),
    )
}

/// Calls a function returning `sync_backfill_checkpoints` and reads the row.
pub fn try_checkpoint_call(
    c: &mut Client,
    call: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<CheckpointRow, postgres::Error> {
    c.query_one(&format!("SELECT * FROM {call}"), params)
        .map(|r| checkpoint_row(&r))
}

#[track_caller]
pub fn declare(c: &mut Client, p: &str, name: &str, v: i64, now: i64) -> CheckpointRow {
    try_checkpoint_call(
        c,
        "syncular.declare_checkpoint($1, $2, $3, $4)",
        &[&p, &name, &v, &now],
    )
    .unwrap()
}

#[track_caller]
pub fn claim(c: &mut Client, p: &str, name: &str, v: i64, now: i64) -> CheckpointRow {
    try_checkpoint_call(
        c,
        "syncular.claim_checkpoint($1, $2, $3, $4)",
        &[&p, &name, &v, &now],
    )
    .unwrap()
}

pub fn read_checkpoint(c: &mut Client, p: &str, name: &str) -> Option<CheckpointRow> {
    c.query_opt(
        "SELECT partition, name, schema_version, state, watermark, owner_epoch, observed_rows, updated_at_ms
           FROM syncular.sync_backfill_checkpoints WHERE partition = $1 AND name = $2",
        &[&p, &name],
    )
    .unwrap()
    .map(|r| checkpoint_row(&r))
}

pub fn try_activate(
    c: &mut Client,
    p: &str,
    name: &str,
    epoch: i64,
    watermark: i64,
    sources: &[&str],
    now: i64,
) -> Result<String, postgres::Error> {
    let sources: Vec<String> = sources.iter().map(|s| s.to_string()).collect();
    try_one(
        c,
        "SELECT syncular.activate_checkpoint($1, $2, $3, $4, $5, $6)",
        &[&p, &name, &epoch, &watermark, &sources, &now],
    )
}

pub fn fence_of(c: &mut Client, p: &str) -> Option<i64> {
    c.query_opt(
        "SELECT required_writer_version FROM syncular.sync_writer_fence WHERE partition = $1",
        &[&p],
    )
    .unwrap()
    .map(|r| r.get(0))
}

/// Waits until session `pid` is blocked on a lock (pg_stat_activity), so a test can assert
/// that a statement waits instead of sleeping for a guessed time.
pub fn wait_until_blocked(observer: &mut Client, pid: i32) {
    for _ in 0..600 {
        let waiting: bool = one(
            observer,
            "SELECT coalesce((SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1), false)",
            &[&pid],
        );
        if waiting {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("session {pid} never blocked on a lock");
}

pub fn backend_pid(c: &mut Client) -> i32 {
    one(c, "SELECT pg_backend_pid()", &[])
}

/// True while `pid` is still waiting on a lock.
pub fn is_blocked(observer: &mut Client, pid: i32) -> bool {
    one(
        observer,
        "SELECT coalesce((SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1), false)",
        &[&pid],
    )
}

// ---- host-side helpers (the test acting as a host) --------------------------------------------

/// `put_row(p, tbl, id, scopes, version, payload)`: the host's upsert of the app row (meta
/// columns and `id`) plus `set_row_scopes`.
#[track_caller]
pub fn put_row(
    c: &mut impl postgres::GenericClient,
    p: &str,
    tbl: &str,
    id: &str,
    scopes: &Value,
    version: i64,
    payload: &[u8],
) {
    let sql = format!(
        "INSERT INTO public.{tbl} (\"_sync_partition\", \"_sync_row_id\", id, \"_sync_server_version\",
                                   \"_sync_scopes\", \"_sync_payload\")
         VALUES ($1, $2, $2, $3, $4, $5)
         ON CONFLICT (\"_sync_partition\", \"_sync_row_id\") DO UPDATE
           SET \"_sync_server_version\" = EXCLUDED.\"_sync_server_version\",
               \"_sync_scopes\" = EXCLUDED.\"_sync_scopes\", \"_sync_payload\" = EXCLUDED.\"_sync_payload\""
    );
    c.execute(&sql, &[&p, &id, &version, scopes, &payload])
        .unwrap();
    c.query_one(
        "SELECT syncular.set_row_scopes($1, $2, $3, $4)",
        &[&p, &tbl, &id, scopes],
    )
    .unwrap();
}

/// `del_row(p, tbl, id)`: the host's delete plus `delete_row_meta`.
pub fn del_row(c: &mut impl postgres::GenericClient, p: &str, tbl: &str, id: &str) -> Value {
    c.execute(
        &format!(
            "DELETE FROM public.{tbl} WHERE \"_sync_partition\" = $1 AND \"_sync_row_id\" = $2"
        ),
        &[&p, &id],
    )
    .unwrap();
    c.query_one(
        "SELECT syncular.delete_row_meta($1, $2, $3)",
        &[&p, &tbl, &id],
    )
    .unwrap()
    .get(0)
}

pub fn p1() -> Value {
    json!({"project_id": "p1"})
}

/// Row ids of `scan_rows(p, tbl, filter, after, lim)`.
pub fn scan_ids(
    c: &mut impl postgres::GenericClient,
    p: &str,
    tbl: &str,
    filter: &Value,
    after: Option<&str>,
    lim: i32,
) -> Vec<String> {
    column(
        c,
        "SELECT row_id FROM syncular.scan_rows($1, $2, $3, $4, $5)",
        &[&p, &tbl, filter, &after, &lim],
    )
}

/// Distinct commit_seqs of `read_commit_window`, in order.
pub fn window_seqs(
    c: &mut impl postgres::GenericClient,
    p: &str,
    tbl: &str,
    filter: &Value,
    after: i64,
    through: i64,
    lim: i32,
) -> Vec<i64> {
    let mut seqs: Vec<i64> = column(
        c,
        "SELECT commit_seq FROM syncular.read_commit_window($1, $2, $3, $4, $5, $6)",
        &[&p, &tbl, filter, &after, &through, &lim],
    );
    seqs.dedup();
    seqs
}

/// An applied push result for `commit_seq` with one record per operation.
pub fn applied(commit_seq: i64, ops: usize, identity: &str) -> Value {
    json!({"status":"applied","commitSeq":commit_seq,"recordedAtMs":NOW,"cacheIdentity":identity,
           "results": (0..ops).map(|i| json!({"opIndex": i, "status": "applied"})).collect::<Vec<_>>()})
}

/// A whole accepted push of upserts (docs/DESIGN.md §Push path): returns the stored result, or the
/// replayed one when `push_begin` found it.
pub fn push_upserts(
    c: &mut Client,
    p: &str,
    client_id: &str,
    ccid: &str,
    rows: &[(&str, &str, Value)],
    declared: &Value,
) -> Value {
    let mut tx = c.transaction().unwrap();
    let replay: Option<Value> = tx
        .query_one(
            "SELECT syncular.push_begin($1, $2, $3, $4, $5)",
            &[&p, &client_id, &ccid, &V, declared],
        )
        .unwrap()
        .get(0);
    if let Some(replay) = replay {
        tx.rollback().unwrap();
        return replay;
    }
    tx.batch_execute("SAVEPOINT syncular_push_candidate")
        .unwrap();
    let mut changes = Vec::new();
    for (tbl, id, scopes) in rows {
        put_row(&mut tx, p, tbl, id, scopes, 1, &[1, 2, 3]);
        changes.push(json!({"table": tbl, "rowId": id, "op": "upsert", "rowVersion": 1, "scopes": scopes, "payload": "AQID"}));
    }
    let mut d = doc(ccid, Value::Array(changes), Some(V));
    d["clientId"] = json!(client_id);
    let s: i64 = tx
        .query_one("SELECT syncular.append_commit($1, $2)", &[&p, &d])
        .unwrap()
        .get(0);
    let stored: Value = tx
        .query_one(
            "SELECT syncular.put_push_result($1, $2, $3, $4)",
            &[&p, &client_id, &ccid, &applied(s, rows.len(), ccid)],
        )
        .unwrap()
        .get(0);
    tx.commit().unwrap();
    stored
}

/// `reaction(seq, key)` of the fixtures.
pub fn reaction(seq: i64, key: &str) -> Value {
    json!({"idempotencyKey":key,"type":"email.send","version":1,"payload":{"messageId":"message-1"},
           "sourceClientId":"c1","sourceClientCommitId":"commit-1","sourceCommitSeq":seq,
           "createdAtMs":NOW,"maxAttempts":3})
}

pub const RKEY: &str = r#"["c1","commit-1","email"]"#;

// ---- a 0.24 database (adoption) --------------------------------------------------------------

/// The storage tables of upstream 0.24, as its adapter creates them (unqualified names).
pub const UPSTREAM_DDL: &str = include_str!("../../fixtures/upstream-0.24-ddl.sql");

/// A schema `legacy` written by a 0.24 host (scenario CMP-03): three commits of `part-1` and
/// their allocator row, a push result and a client record stored as jsonb strings (as drivers
/// that bind JSON text write them), a fence and the marker with the L1 layouts. Created by the
/// session's current role.
pub fn legacy_database(c: &mut Client) {
    exec(c, "CREATE SCHEMA legacy; SET search_path = legacy");
    exec(c, UPSTREAM_DDL);
    exec(c, "DELETE FROM sync_schema_meta");
    for seq in 1..=3i64 {
        c.execute(
            "INSERT INTO sync_commits (partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms)
             VALUES ('part-1', $1, 'c1', $2, 'a1', 1750000000000)",
            &[&seq, &format!("k{seq}")],
        )
        .unwrap();
    }
    let result =
        json!({"status":"applied","commitSeq":3,"results":[{"opIndex":0,"status":"applied"}]})
            .to_string();
    let subs = json!([{"id":"s1","table":"tasks","scopes":{"project_id":["p1"]}}]).to_string();
    exec(c, "INSERT INTO sync_partitions VALUES ('part-1', 3, 0)");
    c.execute(
        "INSERT INTO sync_push_results VALUES ('part-1', 'c1', 'k3', to_jsonb($1::text))",
        &[&result],
    )
    .unwrap();
    c.execute("INSERT INTO sync_clients VALUES ('part-1', 'c1', 'a1', 1, 3, to_jsonb($1::text), 1750000000000)", &[&subs]).unwrap();
    c.execute("INSERT INTO sync_writer_fence VALUES ('part-1', 1)", &[])
        .unwrap();
    c.execute(
        "INSERT INTO sync_schema_meta VALUES (1, 1, $1)",
        &[&l1().to_string()],
    )
    .unwrap();
    exec(c, "RESET search_path");
}
