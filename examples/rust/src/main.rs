//! A small but complete Syncular host in Rust (tokio-postgres) over the syncular SQL API: the
//! same steps as examples/python/host.py — as two roles (the migrator sets up, the server
//! serves), pushes through the one call `push_commit` (applied, a replay, a version conflict),
//! the classic path for a table with a row validator after `push_commit` falls back, a pull in
//! one call, a reaction, and a refusal while a backfill it did not declare is pending. Every
//! step asserts its result.
//!
//!     SYNCULAR_EXAMPLE_ADMIN_URL="host=127.0.0.1 port=5432 user=app_migrator dbname=app" \
//!     SYNCULAR_EXAMPLE_URL="host=127.0.0.1 port=5432 user=app_server dbname=app" cargo run

use base64::Engine;
use serde_json::{json, Value};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls};

const PARTITION: &str = "acme";
const VERSION: i64 = 1;
const NOW: i64 = 1_750_000_000_000;
const UPSERT: i16 = 1;

/// Errors of this host: a syncular refusal (SQLSTATE class SY), or anything else.
#[derive(Debug)]
enum HostError {
    Refused {
        sqlstate: String,
        code: String,
        details: Value,
    },
    Other(String),
}

impl From<tokio_postgres::Error> for HostError {
    fn from(e: tokio_postgres::Error) -> Self {
        match e.as_db_error() {
            Some(db) if db.code().code().starts_with("SY") => HostError::Refused {
                sqlstate: db.code().code().to_string(),
                code: db.message().to_string(),
                details: db
                    .detail()
                    .and_then(|d| serde_json::from_str(d).ok())
                    .unwrap_or(Value::Null),
            },
            _ => HostError::Other(e.to_string()),
        }
    }
}

type Result<T> = std::result::Result<T, HostError>;

fn check(condition: bool, message: &str) -> Result<()> {
    if condition {
        Ok(())
    } else {
        Err(HostError::Other(format!("rust example: FAILED: {message}")))
    }
}

fn identity() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{}-{nanos}", std::process::id())
}

async fn one<T: for<'a> tokio_postgres::types::FromSql<'a>>(
    db: &Client,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<T> {
    Ok(db.query_one(sql, params).await?.get(0))
}

/// The layouts migrate_schema stores.
fn layouts() -> Value {
    let col =
        |name: &str, nullable: bool| json!({"name": name, "type": "string", "nullable": nullable});
    json!({"tasks": [col("id", false), col("project_id", false), col("title", true)],
           "comments": [col("id", false), col("project_id", false), col("body", false)]})
}

/// The push schema, compiled from the same columns: set_push_schema refuses one that disagrees
/// with the stored layouts.
fn push_schema() -> Value {
    let layouts = layouts();
    let tables = layouts
        .as_object()
        .into_iter()
        .flatten()
        .map(|(table, columns)| {
            let scopes = json!([{"variable": "project_id", "column": "project_id"}]);
            (
                table.clone(),
                json!({"columns": columns, "primaryKey": "id", "scopes": scopes}),
            )
        });
    Value::Object(tables.collect())
}

/// The migrator's part: schema, app tables, grants, registration, migration, push schema.
async fn setup(admin: &Client, host_role: &str) -> Result<()> {
    // PostgreSQL 15 gives a plain role no CREATE on `public`: the app tables live in a schema
    // the migrator owns (the DBA granted it CREATE on the database, scripts/examples.sh).
    admin
        .batch_execute("CREATE SCHEMA IF NOT EXISTS app")
        .await?;
    for (table, extra) in [("tasks", "title text"), ("comments", "body text NOT NULL")] {
        admin
            .batch_execute(&format!(
                r#"CREATE TABLE IF NOT EXISTS app.{table} (
                     "_sync_partition" text NOT NULL, "_sync_row_id" text NOT NULL,
                     id text NOT NULL, project_id text NOT NULL, {extra},
                     "_sync_server_version" bigint NOT NULL, "_sync_scopes" jsonb NOT NULL,
                     "_sync_payload" bytea NOT NULL, "_sync_column_versions" bytea,
                     PRIMARY KEY ("_sync_partition", "_sync_row_id"))"#
            ))
            .await?;
        let relation = format!("app.{table}");
        admin
            .execute(
                "SELECT syncular.register_table($1, $2::text::regclass)",
                &[&table, &relation],
            )
            .await?;
    }
    // The server writes app rows as itself (push_commit is SECURITY INVOKER): it needs these
    // privileges and no others.
    let role = format!("\"{}\"", host_role.replace('"', "\"\""));
    admin
        .batch_execute(&format!(
            "GRANT USAGE ON SCHEMA app TO {role};
             GRANT SELECT, INSERT, UPDATE, DELETE ON app.tasks, app.comments TO {role}"
        ))
        .await?;
    let state: String = one(
        admin,
        "SELECT syncular.check_schema($1, $2)",
        &[&VERSION, &layouts()],
    )
    .await?;
    if state == "migrate" {
        admin.batch_execute("BEGIN").await?;
        let previous: i64 = one(
            admin,
            "SELECT syncular.migrate_schema($1, $2)",
            &[&VERSION, &layouts()],
        )
        .await?;
        admin.batch_execute("COMMIT").await?;
        println!("migrated schema {previous} -> {VERSION}");
    }
    let tables: i32 = one(
        admin,
        "SELECT syncular.set_push_schema($1, $2)",
        &[&VERSION, &push_schema()],
    )
    .await?;
    check(tables == 2, "push schema stored")
}

/// One operation of a client commit.
struct Op {
    table: &'static str,
    row_id: &'static str,
    base_version: Option<i64>,
    payload: Vec<u8>,
}

/// An upsert as a client sends it: a sparse row payload. A real client encodes it with its own
/// row codec; `encode_row(…, sparse => true)` produces the same bytes, so it stands in here.
async fn upsert(
    host: &Client,
    table: &'static str,
    row_id: &'static str,
    base_version: Option<i64>,
    values: Value,
) -> Result<Op> {
    let payload = one(
        host,
        "SELECT syncular.encode_row($1, $2, true)",
        &[&table, &values],
    )
    .await?;
    Ok(Op {
        table,
        row_id,
        base_version,
        payload,
    })
}

/// One PUSH_COMMIT frame in one call.
async fn push(
    host: &Client,
    client_id: &str,
    commit_id: &str,
    ops: &[Op],
    declared: Value,
    options: Value,
) -> Result<Value> {
    let tables: Vec<&str> = ops.iter().map(|op| op.table).collect();
    let ids: Vec<&str> = ops.iter().map(|op| op.row_id).collect();
    let kinds: Vec<i16> = ops.iter().map(|_| UPSERT).collect();
    let base_versions: Vec<Option<i64>> = ops.iter().map(|op| op.base_version).collect();
    let payloads: Vec<&[u8]> = ops.iter().map(|op| op.payload.as_slice()).collect();
    let allowed = json!({"project_id": ["p1", "p2"]}); // the resolver's answer for this actor
    one(
        host,
        "SELECT syncular.push_commit($1, $2, $3, 'alice', $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
        &[
            &PARTITION, &client_id, &commit_id, &NOW, &VERSION, &allowed, &tables, &ids, &kinds,
            &base_versions, &payloads, &declared, &options,
        ],
    )
    .await
}

/// A push with a fresh cache identity and nothing declared.
async fn push_new(host: &Client, client_id: &str, commit_id: &str, ops: &[Op]) -> Result<Value> {
    let options = json!({"cacheIdentity": identity()});
    push(host, client_id, commit_id, ops, json!([]), options).await
}

/// This host's row validator for `comments`: host code, so push_commit cannot run it.
fn validate_comment(values: &Value, exists: bool) -> Option<&'static str> {
    if exists {
        Some("comments are append-only")
    } else if values["body"].as_str().unwrap_or("").trim().is_empty() {
        Some("a comment needs a body")
    } else {
        None
    }
}

/// The fallback contract: ask push_commit first, naming the tables with a row validator; on
/// `fallback` nothing was stored, and the classic path gives the answer.
async fn push_comments(
    host: &Client,
    client_id: &str,
    commit_id: &str,
    ops: &[Op],
) -> Result<(&'static str, Value)> {
    let options = json!({"rowValidatorTables": ["comments"]});
    let first = push(host, client_id, commit_id, ops, json!([]), options).await?;
    check(
        first
            == json!({"outcome": "fallback", "reason": "row_validator", "opIndex": 0, "table": "comments"}),
        &format!("fallback: {first}"),
    )?;
    let stored: Option<Value> = one(
        host,
        "SELECT syncular.get_push_result($1, $2, $3)",
        &[&PARTITION, &client_id, &commit_id],
    )
    .await?;
    check(stored.is_none(), "a fallback stores nothing")?;
    push_classic(host, client_id, commit_id, ops).await
}

/// The classic path (docs/HOST-WALKTHROUGH.md) for a commit of `comments` upserts: the host
/// decodes each payload, runs its validator, writes the rows and appends the commit in one
/// transaction.
async fn push_classic(
    host: &Client,
    client_id: &str,
    commit_id: &str,
    ops: &[Op],
) -> Result<(&'static str, Value)> {
    let replay: Option<Value> = one(
        host,
        "SELECT syncular.get_push_result($1, $2, $3)",
        &[&PARTITION, &client_id, &commit_id],
    )
    .await?;
    if let Some(replay) = replay {
        return Ok(("replay", replay));
    }
    host.batch_execute("BEGIN").await?;
    let outcome = push_in_transaction(host, client_id, commit_id, ops).await;
    // On any error (including sync.storage.writer_fence_rejected) nothing may persist.
    let end = if matches!(outcome, Ok(("applied", _)) | Ok(("rejected", _))) {
        "COMMIT"
    } else {
        "ROLLBACK"
    };
    host.batch_execute(end).await?;
    outcome
}

async fn push_in_transaction(
    host: &Client,
    client_id: &str,
    commit_id: &str,
    ops: &[Op],
) -> Result<(&'static str, Value)> {
    let stored: Option<Value> = one(
        host,
        "SELECT syncular.push_begin($1, $2, $3, $4)",
        &[&PARTITION, &client_id, &commit_id, &VERSION],
    )
    .await?;
    if let Some(stored) = stored {
        return Ok(("replay", stored));
    }
    host.batch_execute("SAVEPOINT syncular_push_candidate")
        .await?;
    let ids: Vec<&str> = ops.iter().map(|op| op.row_id).collect();
    let existing: Vec<String> = host
        .query(
            r#"SELECT k.id FROM unnest($1::text[]) AS k(id)
                 LEFT JOIN app.comments r ON r."_sync_partition" = $2 AND r."_sync_row_id" = k.id
                 LEFT JOIN syncular.tombstone_seqs($2, 'comments', $1::text[]) t ON t.row_id = k.id
                WHERE r."_sync_row_id" IS NOT NULL OR t.commit_seq IS NOT NULL"#,
            &[&ids, &PARTITION],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut changes = Vec::new();
    for (index, op) in ops.iter().enumerate() {
        // The host's codec decodes the client's sparse row; decode_row stands in for it.
        let values: Value = one(
            host,
            "SELECT syncular.decode_row('comments', $1, true)",
            &[&op.payload],
        )
        .await?;
        let exists = existing.iter().any(|id| id == op.row_id);
        if let Some(problem) = validate_comment(&values, exists) {
            host.batch_execute("ROLLBACK TO SAVEPOINT syncular_push_candidate; RELEASE SAVEPOINT syncular_push_candidate").await?;
            let rejected = json!({"status":"rejected","recordedAtMs":NOW,"cacheIdentity":identity(),
                                  "results":[{"opIndex":index,"status":"error","code":"app.invalid_comment",
                                              "message":problem,"retryable":false}]});
            let canonical: Value = one(
                host,
                "SELECT syncular.put_push_result($1, $2, $3, $4)",
                &[&PARTITION, &client_id, &commit_id, &rejected],
            )
            .await?;
            return Ok(("rejected", canonical));
        }
        let scopes = json!({"project_id": values["project_id"]});
        // The stored full row, as the host's codec would encode it.
        let row: Vec<u8> = one(
            host,
            "SELECT syncular.encode_row('comments', $1)",
            &[&values],
        )
        .await?;
        host.execute(
            r#"WITH w AS (
                 INSERT INTO app.comments VALUES ($1, $2, $3, $4, $5, 1, $6, $7, NULL) RETURNING 1)
               SELECT syncular.set_row_scopes($1, 'comments', $2, $6) FROM w"#,
            &[
                &PARTITION,
                &op.row_id,
                &values["id"].as_str(),
                &values["project_id"].as_str(),
                &values["body"].as_str(),
                &scopes,
                &row,
            ],
        )
        .await?;
        changes.push(json!({"table":"comments","rowId":op.row_id,"op":"upsert","rowVersion":1,"scopes":scopes,
                            "payload": base64::engine::general_purpose::STANDARD.encode(&row)}));
    }
    let commit = json!({"clientId":client_id,"clientCommitId":commit_id,"actorId":"alice","createdAtMs":NOW,
                        "writerVersion":VERSION,"changes":changes});
    let seq: i64 = one(
        host,
        "SELECT syncular.append_commit($1, $2)",
        &[&PARTITION, &commit],
    )
    .await?;
    let key = serde_json::to_string(&json!([PARTITION, client_id, commit_id, "notify"])).unwrap();
    let reaction = json!([{"idempotencyKey":key,"type":"email.send","version":1,"payload":{"rows":ids},
                           "sourceClientId":client_id,"sourceClientCommitId":commit_id,"sourceCommitSeq":seq,"createdAtMs":NOW}]);
    host.execute(
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&PARTITION, &reaction],
    )
    .await?;
    let results: Vec<Value> = (0..ops.len())
        .map(|i| json!({"opIndex": i, "status": "applied"}))
        .collect();
    let applied = json!({"status":"applied","commitSeq":seq,"recordedAtMs":NOW,"cacheIdentity":identity(),"results":results});
    let canonical: Value = one(
        host,
        "SELECT syncular.put_push_result($1, $2, $3, $4)",
        &[&PARTITION, &client_id, &commit_id, &applied],
    )
    .await?;
    Ok(("applied", canonical))
}

/// One pull row: (subscription index, commit_seq, row id, payload).
type Change = (i32, i64, String, Vec<u8>);

/// One pull request in one call: a document row, then the rows of every subscription.
async fn pull(host: &Client, client_id: &str, cursor: i64) -> Result<(Value, Vec<Change>)> {
    let subscriptions: Vec<Value> = ["tasks", "comments"]
        .iter()
        .map(|table| {
            json!({"id": table, "table": table, "scopes": {"project_id": ["p1"]},
                   "effective": {"project_id": ["p1"]}, "cursor": cursor})
        })
        .collect();
    let request = json!({"limitCommits": 1000, "subscriptions": subscriptions});
    let rows = host
        .query(
            "SELECT document, sub, commit_seq, row_id, payload
               FROM syncular.pull($1, $2, 'alice', $3, $4, $5, $6)",
            &[
                &PARTITION,
                &client_id,
                &NOW,
                &identity(),
                &VERSION,
                &request,
            ],
        )
        .await?;
    let document: Value = rows[0].get(0);
    check(
        document["client"] == json!("recorded"),
        &format!("pull served: {document}"),
    )?;
    let changes = rows[1..]
        .iter()
        .map(|r| (r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    Ok((document, changes))
}

/// The (subscription, commit, row) triples of a pull, for comparison.
fn keys(changes: &[Change]) -> Vec<(i32, i64, &str)> {
    changes
        .iter()
        .map(|(sub, seq, id, _)| (*sub, *seq, id.as_str()))
        .collect()
}

async fn max_commit_seq(host: &Client) -> Result<i64> {
    one(host, "SELECT syncular.max_commit_seq($1)", &[&PARTITION]).await
}

async fn run(admin: &Client, host: &Client) -> Result<()> {
    let host_role: String = one(host, "SELECT current_user::text", &[]).await?;
    let superuser: bool = one(
        host,
        "SELECT rolsuper FROM pg_roles WHERE rolname = current_user",
        &[],
    )
    .await?;
    check(!superuser, "the server is no superuser")?;
    setup(admin, &host_role).await?;

    let mut ops = Vec::new();
    for (id, project, title) in [
        ("t1", "p1", "write the spec"),
        ("t2", "p1", "ship it"),
        ("t3", "p2", "celebrate"),
    ] {
        let values = json!({"id": id, "project_id": project, "title": title});
        ops.push(upsert(host, "tasks", id, None, values).await?);
    }
    let applied = push_new(host, "device-rs", "commit-1", &ops).await?;
    let all_applied: Vec<Value> = (0..3)
        .map(|i| json!({"opIndex": i, "status": "applied"}))
        .collect();
    check(
        applied["outcome"] == "applied"
            && applied["commitSeq"] == 1
            && applied["result"]["results"] == json!(all_applied),
        &format!("push applied: {applied}"),
    )?;
    println!("push_commit applied commit {}", applied["commitSeq"]);

    let replay = push_new(host, "device-rs", "commit-1", &ops).await?;
    check(
        replay["outcome"] == "cached"
            && replay["replayed"] == true
            && replay["result"] == applied["result"],
        &format!("replay: {replay}"),
    )?;
    println!("the redelivery is answered from the stored result (cached)");

    let edit = upsert(
        host,
        "tasks",
        "t1",
        Some(1),
        json!({"id": "t1", "title": "write the spec, v2"}),
    )
    .await?;
    let updated = push_new(host, "device-rs", "commit-2", &[edit]).await?;
    check(
        updated["outcome"] == "applied" && updated["commitSeq"] == 2,
        &format!("update: {updated}"),
    )?;

    // Another device edits t1 from version 1: its baseVersion is behind the stored version 2.
    let stale = upsert(
        host,
        "tasks",
        "t1",
        Some(1),
        json!({"id": "t1", "title": "stale edit"}),
    )
    .await?;
    let conflict = push_new(host, "device-rs-b", "commit-1", &[stale]).await?;
    let record = &conflict["result"]["results"][0];
    check(
        conflict["outcome"] == "rejected"
            && record["status"] == "conflict"
            && record["code"] == "sync.version_conflict"
            && record["serverVersion"] == 2
            && record["conflictColumns"] == "BA==", // bit 2: title
        &format!("conflict: {conflict}"),
    )?;
    let server_row = base64::engine::general_purpose::STANDARD
        .decode(record["serverRow"].as_str().unwrap_or_default())
        .map_err(|e| HostError::Other(e.to_string()))?;
    let server_row: Value = one(
        host,
        "SELECT syncular.decode_row('tasks', $1)",
        &[&server_row],
    )
    .await?;
    check(
        server_row == json!({"id": "t1", "project_id": "p1", "title": "write the spec, v2"}),
        &format!("serverRow: {server_row}"),
    )?;
    check(
        max_commit_seq(host).await? == 2,
        "a conflict consumes no number",
    )?;
    println!(
        "stale edit rejected: {}, server row {server_row}",
        record["code"]
    );

    let comment = upsert(
        host,
        "comments",
        "c1",
        None,
        json!({"id": "c1", "project_id": "p1", "body": "looks good"}),
    )
    .await?;
    let (outcome, result) = push_comments(host, "device-rs", "commit-3", &[comment]).await?;
    check(
        outcome == "applied" && result["commitSeq"] == 3,
        &format!("classic push: {result}"),
    )?;
    let empty = upsert(
        host,
        "comments",
        "c2",
        None,
        json!({"id": "c2", "project_id": "p1", "body": " "}),
    )
    .await?;
    let (outcome, rejected) = push_comments(host, "device-rs", "commit-4", &[empty]).await?;
    check(
        outcome == "rejected" && rejected["results"][0]["code"] == "app.invalid_comment",
        &format!("rejected: {rejected}"),
    )?;
    check(
        max_commit_seq(host).await? == 3,
        "a rejection consumes no number",
    )?;
    println!("comments: push_commit fell back (row_validator); the classic path applied one, rejected one");

    let (document, changes) = pull(host, "device-rs-2", 0).await?;
    check(
        keys(&changes) == [(0, 1, "t1"), (0, 1, "t2"), (0, 2, "t1"), (1, 3, "c1")],
        &format!("rows: {:?}", keys(&changes)),
    )?;
    let row: Value = one(
        host,
        "SELECT syncular.decode_row('tasks', $1)",
        &[&changes[2].3],
    )
    .await?;
    check(
        row["title"] == "write the spec, v2",
        "the window carries the stored rows",
    )?;
    let next: Vec<&Value> = document["subscriptions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| &s["nextCursor"])
        .collect();
    check(
        next == [&json!(3), &json!(3)] && document["cursor"] == 3,
        &format!("cursors: {document}"),
    )?;
    println!(
        "pulled {} changes of project p1, new cursor {}",
        changes.len(),
        document["cursor"]
    );

    let claimed: Value = one(
        host,
        "SELECT syncular.claim_reactions($1, 'worker-rs', ARRAY['email.send'], $2, 30000, 10)",
        &[&PARTITION, &NOW],
    )
    .await?;
    check(
        claimed.as_array().map(Vec::len) == Some(1) && claimed[0]["attempts"] == json!(1),
        &format!("claimed: {claimed}"),
    )?;
    let key = claimed[0]["idempotencyKey"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let done: bool = one(
        host,
        "SELECT syncular.complete_reaction($1, $2, 'worker-rs', $3)",
        &[&PARTITION, &key, &(NOW + 1)],
    )
    .await?;
    check(done, "reaction completed")?;
    println!("reaction claimed and completed");

    // A backfill worker declares a checkpoint at our version (an admin action); the server did
    // not declare it, so it is refused until the checkpoint is activated.
    admin
        .execute(
            "SELECT syncular.declare_checkpoint($1, 'titles', $2, $3)",
            &[&PARTITION, &VERSION, &NOW],
        )
        .await?;
    match pull(host, "device-rs-2", 3).await {
        Err(HostError::Refused {
            sqlstate,
            code,
            details,
        }) => {
            check(
                sqlstate == "SY002" && code == "sync.schema_not_ready",
                &format!("refusal: {code}"),
            )?;
            check(
                details == json!({"partition": PARTITION, "projection": "titles"}),
                &format!("details: {details}"),
            )?;
            println!("refused while backfilling: {code} {details}");
        }
        other => {
            return Err(HostError::Other(format!(
                "expected a refusal, got {other:?}"
            )))
        }
    }
    let declared = json!([{"partition": PARTITION, "name": "titles", "schemaVersion": VERSION}]);
    let backfill = upsert(
        host,
        "tasks",
        "t1",
        None,
        json!({"id": "t1", "title": "write the spec, v3"}),
    )
    .await?;
    let batch = push(
        host,
        "backfill-client",
        "titles-batch-1",
        &[backfill],
        declared,
        json!({}),
    )
    .await?;
    check(
        batch["outcome"] == "applied",
        &format!("the declaring worker is served: {batch}"),
    )?;
    let epoch: i64 = one(
        admin,
        "SELECT owner_epoch FROM syncular.claim_checkpoint($1, 'titles', $2, $3)",
        &[&PARTITION, &VERSION, &NOW],
    )
    .await?;
    let seq: i64 = one(
        admin,
        "SELECT syncular.source_coverage_seq($1, ARRAY['tasks'])",
        &[&PARTITION],
    )
    .await?;
    let activated: String = one(
        admin,
        "SELECT syncular.activate_checkpoint($1, 'titles', $2, $3, ARRAY['tasks'], $4)",
        &[&PARTITION, &epoch, &seq, &NOW],
    )
    .await?;
    check(
        activated == "activated",
        &format!("activation: {activated}"),
    )?;
    let (document, changes) = pull(host, "device-rs-2", 3).await?;
    check(
        keys(&changes) == [(0, 4, "t1")] && document["cursor"] == 4,
        &format!(
            "served again after activation: {:?} {document}",
            keys(&changes)
        ),
    )?;
    println!("rust example: ok");
    Ok(())
}

async fn connect(variable: &str, default: &str) -> Client {
    let url = std::env::var(variable).unwrap_or_else(|_| default.into());
    let (db, connection) = tokio_postgres::connect(&url, NoTls).await.expect("connect");
    tokio::spawn(connection);
    db
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let admin = connect(
        "SYNCULAR_EXAMPLE_ADMIN_URL",
        "host=127.0.0.1 port=25439 user=app_migrator dbname=example_rust",
    )
    .await;
    let host = connect(
        "SYNCULAR_EXAMPLE_URL",
        "host=127.0.0.1 port=25439 user=app_server dbname=example_rust",
    )
    .await;
    match run(&admin, &host).await {
        Ok(()) => {}
        Err(HostError::Other(message)) => {
            eprintln!("{message}");
            std::process::exit(1);
        }
        Err(refused @ HostError::Refused { .. }) => {
            eprintln!("rust example: unexpected refusal {refused:?}");
            std::process::exit(1);
        }
    }
}
