//! The fixture of the one-call push scenarios (docs/SCENARIOS.md, NP-xx): upstream's test
//! table shapes registered under their logical names, the push schema, and helpers to encode,
//! push and compare whole databases. Shared by tests/push_commit.rs and tests/push_stage.rs.

use crate::*;
use postgres::{Client, GenericClient};
use serde_json::{json, Value};

/// The scenario fixture: upstream's test shapes under their logical names, registered to fresh
/// relations (`tasks` and `docs` re-pointed), and the push schema at version `V`.
pub fn tables_sql() -> String {
    let tables = [
        (
            "public.np_tasks",
            "id text, project_id text, title text, done boolean, priority bigint, meta jsonb,",
        ),
        (
            "public.np_items",
            "id bigint, project_id text, score double precision, data bytea,",
        ),
        ("public.np_docs", "id text, project_id text, body text,"),
        ("public.np_files", "id text, project_id text, file text,"),
        ("public.np_notes", "id text, project_id text, doc bytea,"),
        ("public.np_buckets", "id text, b double precision,"),
        ("public.np_secrets", ""),
    ];
    let mut sql: String = tables.iter().map(|(r, c)| app_table_sql(r, c)).collect();
    for (name, relation) in APP {
        sql.push_str(&format!(
            "SELECT syncular.register_table('{name}', 'public.{relation}');\n"
        ));
    }
    sql
}

pub const APP: [(&str, &str); 7] = [
    ("tasks", "np_tasks"),
    ("items", "np_items"),
    ("docs", "np_docs"),
    ("files", "np_files"),
    ("notes", "np_notes"),
    ("buckets", "np_buckets"),
    ("secrets", "np_secrets"),
];

pub fn col(name: &str, ty: &str, nullable: bool) -> Value {
    json!({"name": name, "type": ty, "nullable": nullable})
}

pub fn scoped(columns: Value, scopes: Value) -> Value {
    json!({"columns": columns, "primaryKey": "id", "scopes": scopes})
}

pub fn project(var: &str) -> Value {
    json!([{"variable": var, "column": "project_id"}])
}

pub fn schema() -> Value {
    let base = || {
        vec![
            col("id", "string", false),
            col("project_id", "string", false),
        ]
    };
    let with = |extra: Vec<Value>| {
        let mut c = base();
        c.extend(extra);
        Value::Array(c)
    };
    json!({
        "tasks": scoped(with(vec![col("title", "string", false), col("done", "boolean", false),
                                  col("priority", "integer", true), col("meta", "json", true)]),
                        project("project_id")),
        "items": scoped(json!([col("id", "integer", false), col("project_id", "string", false),
                               col("score", "float", true), col("data", "bytes", true)]),
                        project("project_id")),
        "docs": scoped(with(vec![col("body", "string", true)]), project("projectId")),
        "files": scoped(with(vec![col("file", "blob_ref", true)]), project("project_id")),
        "notes": scoped(with(vec![json!({"name":"doc","type":"crdt","nullable":true,"crdtType":"yjs-doc"})]),
                        project("project_id")),
        "buckets": scoped(json!([col("id", "string", false), col("b", "float", false)]),
                          json!([{"variable": "bucket", "column": "b"}])),
        "secrets": {"columns": with(vec![col("s", "string", true)]), "primaryKey": "id",
                    "scopes": project("project_id"), "materialize": false},
    })
}

pub fn setup(c: &mut Client) {
    exec(c, &tables_sql());
    let n: i32 = one(
        c,
        "SELECT syncular.set_push_schema($1, $2)",
        &[&V, &schema()],
    );
    assert_eq!(n, 7);
}

/// A fresh database with the scenario fixture (`setup`), and a connection to it.
pub fn fixture(name: &str) -> (TestDb, Client) {
    let db = TestDb::new(name);
    let mut c = db.connect();
    setup(&mut c);
    (db, c)
}

/// A fresh database with the fixture, titles of `tasks` unique within a partition, and row `t1`
/// (title "task") stored by commit `k1`: the opening of the constraint scenarios (NP-27,
/// tests/push_batch.rs).
pub fn with_unique_titles(name: &str) -> (TestDb, Client) {
    let (db, mut c) = fixture(name);
    unique_titles(&mut c);
    let a = up(&mut c, "tasks", "t1", None, task("t1", "p1"));
    assert_eq!(push(&mut c, "k1", &[a])["outcome"], "applied");
    (db, c)
}

/// A unique index on `tasks`' title within a partition: a host constraint a push can violate.
pub fn unique_titles(c: &mut Client) {
    exec(
        c,
        "CREATE UNIQUE INDEX np_tasks_title ON public.np_tasks (\"_sync_partition\", title)",
    );
}

pub fn allowed() -> Value {
    json!({"project_id": ["p1"], "projectId": ["p1"], "org_id": ["o1"], "bucket": ["2"]})
}

/// One operation of a push.
#[derive(Clone, Debug)]
pub struct Op {
    pub table: String,
    pub row_id: String,
    pub kind: i16,
    pub bv: Option<i64>,
    pub payload: Option<Vec<u8>>,
}

pub fn enc(c: &mut impl GenericClient, tbl: &str, values: &Value) -> Vec<u8> {
    c.query_one("SELECT syncular.encode_row($1, $2, true)", &[&tbl, values])
        .unwrap_or_else(|e| panic!("encode {values}: {e:?}"))
        .get(0)
}

pub fn up(c: &mut impl GenericClient, tbl: &str, id: &str, bv: Option<i64>, values: Value) -> Op {
    Op {
        table: tbl.into(),
        row_id: id.into(),
        kind: 1,
        bv,
        payload: Some(enc(c, tbl, &values)),
    }
}

pub fn raw(tbl: &str, id: &str, bv: Option<i64>, payload: &[u8]) -> Op {
    Op {
        table: tbl.into(),
        row_id: id.into(),
        kind: 1,
        bv,
        payload: Some(payload.to_vec()),
    }
}

pub fn del(tbl: &str, id: &str) -> Op {
    Op {
        table: tbl.into(),
        row_id: id.into(),
        kind: 2,
        bv: None,
        payload: None,
    }
}

/// Upstream's E2 edit of `tasks` row `t1`: the title "v2" only, unversioned.
pub fn e2(c: &mut impl GenericClient) -> Op {
    up(c, "tasks", "t1", None, json!({"id": "t1", "title": "v2"}))
}

/// The full `tasks` row of upstream's `taskRow(id, project)`.
pub fn task(id: &str, project: &str) -> Value {
    json!({"id": id, "project_id": project, "title": "task", "done": false,
           "priority": null, "meta": null})
}

/// A full `tasks` row of project `p1` with its own title.
pub fn titled(id: &str, title: &str) -> Value {
    json!({"id": id, "project_id": "p1", "title": title, "done": false, "priority": null,
           "meta": null})
}

pub const PUSH_SQL: &str =
    "SELECT syncular.push_commit($1, $2, $3, 'a1', $4, $5, $6, $7, $8, $9, $10, $11, '[]', $12)";

pub fn try_push_as(
    c: &mut impl GenericClient,
    p: &str,
    client_id: &str,
    key: &str,
    ops: &[Op],
    allowed: Option<&Value>,
    options: &Value,
) -> Result<Value, postgres::Error> {
    let tables: Vec<&str> = ops.iter().map(|o| o.table.as_str()).collect();
    let ids: Vec<&str> = ops.iter().map(|o| o.row_id.as_str()).collect();
    let kinds: Vec<i16> = ops.iter().map(|o| o.kind).collect();
    let bvs: Vec<Option<i64>> = ops.iter().map(|o| o.bv).collect();
    let payloads: Vec<Option<&[u8]>> = ops.iter().map(|o| o.payload.as_deref()).collect();
    c.query_one(
        PUSH_SQL,
        &[
            &p, &client_id, &key, &NOW, &V, &allowed, &tables, &ids, &kinds, &bvs, &payloads,
            options,
        ],
    )
    .map(|r| r.get(0))
}

/// A push of client `c1` in partition `P` with the fixture's `allowed` and `options`.
pub fn try_push(
    c: &mut impl GenericClient,
    key: &str,
    ops: &[Op],
    options: Value,
) -> Result<Value, postgres::Error> {
    try_push_as(c, P, "c1", key, ops, Some(&allowed()), &options)
}

#[track_caller]
pub fn push(c: &mut impl GenericClient, key: &str, ops: &[Op]) -> Value {
    try_push(c, key, ops, json!({"cacheIdentity": key})).unwrap_or_else(|e| panic!("{key}: {e:?}"))
}

/// The one terminating record of a rejected push.
#[track_caller]
pub fn record(outcome: &Value) -> &Value {
    assert_eq!(outcome["outcome"], "rejected", "{outcome}");
    &outcome["result"]["results"][0]
}

#[track_caller]
pub fn assert_error(outcome: &Value, op: usize, code: &str, message: &str) {
    assert_eq!(
        record(outcome),
        &json!({"opIndex": op, "status": "error", "code": code, "message": message, "retryable": false}),
        "{outcome}"
    );
}

/// Each `(key, op, code, message)` in turn: `op` pushed alone under `key` is rejected at
/// operation 0 with this `code` and `message`.
#[track_caller]
pub fn assert_rejections<const N: usize>(
    c: &mut impl GenericClient,
    rejections: [(&str, Op, &str, &str); N],
) {
    for (key, op, code, message) in rejections {
        assert_error(&push(c, key, &[op]), 0, code, message);
    }
}

/// The rejection a class-23 error of an app-row upsert becomes, at operation `op`.
#[track_caller]
pub fn assert_constraint_violation(outcome: &Value, op: usize) {
    assert_error(
        outcome,
        op,
        "sync.constraint_violation",
        "write violates a relational constraint",
    );
}

pub fn hex(text: &str) -> Vec<u8> {
    let digits: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
    digits
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
        .collect()
}

/// `(server_version, payload hex, column versions hex)` of an app row.
pub fn stored(c: &mut Client, table: &str, id: &str) -> Option<(i64, String, Option<String>)> {
    let relation = APP.iter().find(|(t, _)| *t == table).unwrap().1;
    c.query_opt(
        &format!(
            "SELECT \"_sync_server_version\", encode(\"_sync_payload\", 'hex'),
                    encode(\"_sync_column_versions\", 'hex')
               FROM public.{relation} WHERE \"_sync_partition\" = $1 AND \"_sync_row_id\" = $2"
        ),
        &[&P, &id],
    )
    .unwrap()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
}

/// Every table the push touches, as text, in a fixed order: equal snapshots are equal bytes
/// (bytea as hex, jsonb in its canonical text).
pub fn snapshot(c: &mut Client) -> String {
    let mut parts = vec![
        "SELECT 'partitions|' || t::text FROM syncular.sync_partitions t".to_string(),
        "SELECT 'commits|' || t::text FROM syncular.sync_commits t".into(),
        "SELECT 'changes|' || t::text FROM syncular.sync_changes t".into(),
        "SELECT 'change_scopes|' || t::text FROM syncular.sync_change_scopes t".into(),
        "SELECT 'row_scopes|' || t::text FROM syncular.sync_row_scopes t".into(),
        "SELECT 'tombstones|' || t::text FROM syncular.sync_tombstones t".into(),
        "SELECT 'results|' || t::text FROM syncular.sync_push_results t".into(),
        "SELECT 'blob_refs|' || t::text FROM syncular.sync_blob_refs t".into(),
    ];
    for (table, relation) in APP {
        parts.push(format!(
            "SELECT '{table}|' || t::text FROM public.{relation} t"
        ));
    }
    one(
        c,
        &format!(
            "SELECT coalesce(string_agg(x, E'\\n' ORDER BY x COLLATE \"C\"), '') FROM ({}) s(x)",
            parts.join(" UNION ALL ")
        ),
        &[],
    )
}

/// A snapshot without the stored result of `key`.
pub fn but_result(snapshot: &str, key: &str) -> String {
    snapshot
        .lines()
        .filter(|l| !(l.starts_with("results|") && l.contains(&format!(",{key},"))))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Nothing of a push is persisted beyond `before` (the partition row the lock created aside).
#[track_caller]
pub fn unchanged(c: &mut Client, before: &str) {
    let now = snapshot(c);
    let strip = |s: &str| {
        s.lines()
            .filter(|l| !l.starts_with("partitions|"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(strip(&now), strip(before));
}

pub fn one_in<T: for<'a> postgres::types::FromSql<'a>>(
    c: &mut impl GenericClient,
    sql: &str,
    params: &[&(dyn postgres::types::ToSql + Sync)],
) -> T {
    c.query_one(sql, params)
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"))
        .get(0)
}
