//! A small but complete Syncular host in Rust (tokio-postgres) over the syncular SQL API: the
//! same steps as examples/python/host.py — schema check/migration, a push of several rows (with
//! the rejection path), a replay, a pull of one scope, a reaction, and a refusal while a
//! backfill it did not declare is pending. Every step asserts its result.
//!
//!     SYNCULAR_EXAMPLE_URL="host=127.0.0.1 port=5432 user=postgres dbname=app" cargo run

use base64::Engine;
use serde_json::{json, Value};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls};

const PARTITION: &str = "acme";
const VERSION: i64 = 1;
const NOW: i64 = 1_750_000_000_000;

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

fn layouts() -> Value {
    json!({"tasks": [{"name":"id","type":"string","nullable":false},
                     {"name":"project_id","type":"string","nullable":false},
                     {"name":"title","type":"string","nullable":true}]})
}

async fn setup(db: &Client) -> Result<()> {
    db.batch_execute(
        r#"CREATE TABLE IF NOT EXISTS public.tasks (
             "_sync_partition" text NOT NULL, "_sync_row_id" text NOT NULL,
             id text NOT NULL, project_id text NOT NULL, title text,
             "_sync_server_version" bigint NOT NULL, "_sync_scopes" jsonb NOT NULL,
             "_sync_payload" bytea NOT NULL, "_sync_column_versions" bytea,
             PRIMARY KEY ("_sync_partition", "_sync_row_id"))"#,
    )
    .await?;
    db.execute(
        "SELECT syncular.register_table('tasks', 'public.tasks')",
        &[],
    )
    .await?;
    let state: String = one(
        db,
        "SELECT syncular.check_schema($1, $2)",
        &[&VERSION, &layouts()],
    )
    .await?;
    if state == "migrate" {
        db.batch_execute("BEGIN").await?;
        let previous: i64 = one(
            db,
            "SELECT syncular.migrate_schema($1, $2)",
            &[&VERSION, &layouts()],
        )
        .await?;
        db.batch_execute("COMMIT").await?;
        println!("migrated schema {previous} -> {VERSION}");
    }
    let state: String = one(
        db,
        "SELECT syncular.check_schema($1, $2)",
        &[&VERSION, &layouts()],
    )
    .await?;
    check(state == "current", "schema current")
}

/// One push (docs/HOST-WALKTHROUGH.md). An empty title is refused by this host's rule (rejection
/// path).
async fn push(
    db: &Client,
    client_id: &str,
    commit_id: &str,
    ops: &[(&str, &str, &str)],
    declared: Value,
) -> Result<(&'static str, Value)> {
    let replay: Option<Value> = one(
        db,
        "SELECT syncular.get_push_result($1, $2, $3)",
        &[&PARTITION, &client_id, &commit_id],
    )
    .await?;
    if let Some(replay) = replay {
        return Ok(("replay", replay));
    }
    db.batch_execute("BEGIN").await?;
    let outcome = push_in_transaction(db, client_id, commit_id, ops, declared).await;
    // On any error (including sync.storage.writer_fence_rejected) nothing may persist.
    let end = if matches!(outcome, Ok(("applied", _)) | Ok(("rejected", _))) {
        "COMMIT"
    } else {
        "ROLLBACK"
    };
    db.batch_execute(end).await?;
    outcome
}

async fn push_in_transaction(
    db: &Client,
    client_id: &str,
    commit_id: &str,
    ops: &[(&str, &str, &str)],
    declared: Value,
) -> Result<(&'static str, Value)> {
    let stored: Option<Value> = one(
        db,
        "SELECT syncular.push_begin($1, $2, $3, $4, $5)",
        &[&PARTITION, &client_id, &commit_id, &VERSION, &declared],
    )
    .await?;
    if let Some(stored) = stored {
        return Ok(("replay", stored));
    }
    db.batch_execute("SAVEPOINT syncular_push_candidate")
        .await?;
    let ids: Vec<&str> = ops.iter().map(|op| op.0).collect();
    let current = db
        .query(
            r#"SELECT k.id, r."_sync_server_version", t.commit_seq
                 FROM unnest($1::text[]) AS k(id)
                 LEFT JOIN public.tasks r ON r."_sync_partition" = $2 AND r."_sync_row_id" = k.id
                 LEFT JOIN syncular.tombstone_seqs($2, 'tasks', $1::text[]) t ON t.row_id = k.id"#,
            &[&ids, &PARTITION],
        )
        .await?;
    let version_of = |id: &str| -> i64 {
        current
            .iter()
            .find(|r| r.get::<_, String>(0) == id)
            .and_then(|r| r.get::<_, Option<i64>>(1))
            .unwrap_or(0)
    };
    let mut changes = Vec::new();
    for (index, (row_id, project, title)) in ops.iter().enumerate() {
        if title.is_empty() {
            db.batch_execute("ROLLBACK TO SAVEPOINT syncular_push_candidate; RELEASE SAVEPOINT syncular_push_candidate").await?;
            let rejected = json!({"status":"rejected","recordedAtMs":NOW,"cacheIdentity":identity(),
                                  "results":[{"opIndex":index,"status":"error","code":"app.title_required",
                                              "message":"a task needs a title","retryable":false}]});
            let canonical: Value = one(
                db,
                "SELECT syncular.put_push_result($1, $2, $3, $4)",
                &[&PARTITION, &client_id, &commit_id, &rejected],
            )
            .await?;
            return Ok(("rejected", canonical));
        }
        let scopes = json!({"project_id": project});
        let payload =
            serde_json::to_vec(&json!({"id": row_id, "project_id": project, "title": title}))
                .unwrap();
        let version = version_of(row_id) + 1;
        db.execute(
            r#"WITH w AS (
                 INSERT INTO public.tasks VALUES ($1, $2, $2, $3, $4, $5, $6, $7, NULL)
                 ON CONFLICT ("_sync_partition", "_sync_row_id") DO UPDATE
                   SET title = EXCLUDED.title, "_sync_server_version" = EXCLUDED."_sync_server_version",
                       "_sync_scopes" = EXCLUDED."_sync_scopes", "_sync_payload" = EXCLUDED."_sync_payload"
                 RETURNING 1)
               SELECT syncular.set_row_scopes($1, 'tasks', $2, $6) FROM w"#,
            &[&PARTITION, row_id, project, title, &version, &scopes, &payload],
        )
        .await?;
        changes.push(json!({"table":"tasks","rowId":row_id,"op":"upsert","rowVersion":version,"scopes":scopes,
                            "payload": base64::engine::general_purpose::STANDARD.encode(&payload)}));
    }
    let commit = json!({"clientId":client_id,"clientCommitId":commit_id,"actorId":"alice","createdAtMs":NOW,
                        "writerVersion":VERSION,"changes":changes});
    let seq: i64 = one(
        db,
        "SELECT syncular.append_commit($1, $2)",
        &[&PARTITION, &commit],
    )
    .await?;
    let key = serde_json::to_string(&json!([PARTITION, client_id, commit_id, "notify"])).unwrap();
    let reaction = json!([{"idempotencyKey":key,"type":"email.send","version":1,"payload":{"rows":ids},
                           "sourceClientId":client_id,"sourceClientCommitId":commit_id,"sourceCommitSeq":seq,"createdAtMs":NOW}]);
    db.execute(
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&PARTITION, &reaction],
    )
    .await?;
    let results: Vec<Value> = (0..ops.len())
        .map(|i| json!({"opIndex": i, "status": "applied"}))
        .collect();
    let applied = json!({"status":"applied","commitSeq":seq,"recordedAtMs":NOW,"cacheIdentity":identity(),"results":results});
    let canonical: Value = one(
        db,
        "SELECT syncular.put_push_result($1, $2, $3, $4)",
        &[&PARTITION, &client_id, &commit_id, &applied],
    )
    .await?;
    Ok(("applied", canonical))
}

/// One incremental pull of `tasks` for one project, in one call (docs/HOST-WALKTHROUGH.md,
/// pull): gate, client record, window and the record's new cursor in one statement.
async fn pull(
    db: &Client,
    client_id: &str,
    project: &str,
    cursor: i64,
) -> Result<Vec<(i64, String)>> {
    let scopes = json!({"project_id": [project]});
    let request = json!({"limitCommits": 1000, "subscriptions": [{"id": "s1", "table": "tasks",
                         "scopes": scopes, "effective": scopes, "cursor": cursor}]});
    let rows = db
        .query(
            "SELECT document, commit_seq, row_id
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
    Ok(rows[1..].iter().map(|r| (r.get(1), r.get(2))).collect())
}

async fn run(db: &Client) -> Result<()> {
    setup(db).await?;
    let ops = [
        ("t1", "p1", "write the spec"),
        ("t2", "p1", "ship it"),
        ("t3", "p2", "celebrate"),
    ];
    let (outcome, result) = push(db, "device-rs", "commit-1", &ops, json!([])).await?;
    check(
        outcome == "applied" && result["commitSeq"] == json!(1),
        &format!("push applied: {result}"),
    )?;
    println!("push applied as commit {}", result["commitSeq"]);

    let (outcome, replay) = push(db, "device-rs", "commit-1", &ops, json!([])).await?;
    check(
        outcome == "replay" && replay == result,
        "replay returns the stored result",
    )?;
    println!("replay answered from the stored result");

    let (outcome, rejected) = push(
        db,
        "device-rs",
        "commit-2",
        &[("t4", "p1", "fine"), ("t5", "p1", "")],
        json!([]),
    )
    .await?;
    check(
        outcome == "rejected" && rejected["results"][0]["opIndex"] == json!(1),
        &format!("rejected: {rejected}"),
    )?;
    check(
        one::<i64>(db, "SELECT syncular.max_commit_seq($1)", &[&PARTITION]).await? == 1,
        "a rejection consumes no number",
    )?;
    println!("rejected push stored, no commit consumed");

    let rows = pull(db, "device-rs-2", "p1", 0).await?;
    check(
        rows == vec![(1, "t1".to_string()), (1, "t2".to_string())],
        &format!("window for p1: {rows:?}"),
    )?;
    println!("pulled {} changes of project p1", rows.len());

    let claimed: Value = one(
        db,
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
        db,
        "SELECT syncular.complete_reaction($1, $2, 'worker-rs', $3)",
        &[&PARTITION, &key, &(NOW + 1)],
    )
    .await?;
    check(done, "reaction completed")?;
    println!("reaction claimed and completed");

    db.execute(
        "SELECT syncular.declare_checkpoint($1, 'titles', $2, $3)",
        &[&PARTITION, &VERSION, &NOW],
    )
    .await?;
    match pull(db, "device-rs-2", "p1", 1).await {
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
    let (batch, _) = push(
        db,
        "backfill-client",
        "titles-batch-1",
        &[("t1", "p1", "write the spec v2")],
        declared,
    )
    .await?;
    check(batch == "applied", "the declaring worker is served")?;
    let epoch: i64 = one(
        db,
        "SELECT owner_epoch FROM syncular.claim_checkpoint($1, 'titles', $2, $3)",
        &[&PARTITION, &VERSION, &NOW],
    )
    .await?;
    let seq: i64 = one(
        db,
        "SELECT syncular.source_coverage_seq($1, ARRAY['tasks'])",
        &[&PARTITION],
    )
    .await?;
    let activated: String = one(
        db,
        "SELECT syncular.activate_checkpoint($1, 'titles', $2, $3, ARRAY['tasks'], $4)",
        &[&PARTITION, &epoch, &seq, &NOW],
    )
    .await?;
    check(
        activated == "activated",
        &format!("activation: {activated}"),
    )?;
    check(
        pull(db, "device-rs-2", "p1", 1).await?.len() == 1,
        "served again after activation",
    )?;
    println!("rust example: ok");
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let url = std::env::var("SYNCULAR_EXAMPLE_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=55439 user=postgres dbname=example_rust".into());
    let (db, connection) = tokio_postgres::connect(&url, NoTls).await.expect("connect");
    tokio::spawn(connection);
    match run(&db).await {
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
