//! The reaction outbox (docs/DESIGN.md §Reactions, §sync_reactions): enqueued in the push
//! transaction with their source commit, claimed under a lease with `FOR UPDATE SKIP LOCKED`,
//! completed / extended / failed only while the caller still owns the lease. Nothing here takes
//! the partition lock.

use crate::args::{self, MAX_SAFE};
use crate::db;
use crate::error::{self, Code, Error, Result};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiTupleTable;
use pgrx::JsonB;
use serde_json::{json, Map, Value};
use std::collections::HashSet;

const MAX_PAYLOAD_BYTES: usize = 65_536;
const MAX_DETAILS_BYTES: usize = 8_192;
const MAX_DEPTH: usize = 16;
const MAX_TYPE_BYTES: usize = 128;

macro_rules! reaction_columns {
    () => {
        "idempotency_key, type, version, payload, source_client_id, source_client_commit_id,
         source_commit_seq, created_at_ms, available_at_ms, status, attempts, max_attempts,
         lease_owner, lease_expires_at_ms, completed_at_ms, last_failure"
    };
}

/// Reaction objects from rows of `reaction_columns!()`; NULL columns are absent keys.
fn reactions(table: SpiTupleTable<'_>) -> Result<Vec<Value>> {
    table
        .map(|row| {
            let mut r = Map::new();
            r.insert("idempotencyKey".into(), json!(row.get::<String>(1)?));
            r.insert("type".into(), json!(row.get::<String>(2)?));
            r.insert("version".into(), json!(row.get::<i32>(3)?));
            let payload = row.get::<JsonB>(4)?.map(|j| args::unwrap_json_text(j.0));
            r.insert("payload".into(), payload.unwrap_or(Value::Null));
            r.insert("sourceClientId".into(), json!(row.get::<String>(5)?));
            r.insert("sourceClientCommitId".into(), json!(row.get::<String>(6)?));
            r.insert("sourceCommitSeq".into(), json!(row.get::<i64>(7)?));
            r.insert("createdAtMs".into(), json!(row.get::<i64>(8)?));
            r.insert("availableAtMs".into(), json!(row.get::<i64>(9)?));
            r.insert("status".into(), json!(row.get::<String>(10)?));
            r.insert("attempts".into(), json!(row.get::<i32>(11)?));
            r.insert("maxAttempts".into(), json!(row.get::<i32>(12)?));
            if let Some(owner) = row.get::<String>(13)? {
                r.insert("leaseOwner".into(), json!(owner));
            }
            if let Some(at) = row.get::<i64>(14)? {
                r.insert("leaseExpiresAtMs".into(), json!(at));
            }
            if let Some(at) = row.get::<i64>(15)? {
                r.insert("completedAtMs".into(), json!(at));
            }
            if let Some(failure) = row.get::<JsonB>(16)? {
                r.insert("lastFailure".into(), args::unwrap_json_text(failure.0));
            }
            Ok(Value::Object(r))
        })
        .collect()
}

/// Nesting depth as upstream counts it: the value itself is at depth 0.
fn too_deep(value: &Value, depth: usize) -> bool {
    if depth > MAX_DEPTH {
        return true;
    }
    match value {
        Value::Array(items) => items.iter().any(|v| too_deep(v, depth + 1)),
        Value::Object(map) => map.values().any(|v| too_deep(v, depth + 1)),
        _ => false,
    }
}

/// Size and depth bounds of a stored JSON document (payloads, failure details).
fn bounded(value: &Value, at: &str, max_bytes: usize) -> Result<()> {
    if serde_json::to_string(value)
        .map(|s| s.len())
        .unwrap_or(usize::MAX)
        > max_bytes
    {
        return Err(Error::invalid_argument(at, "too_large"));
    }
    if too_deep(value, 0) {
        return Err(Error::invalid_argument(at, "too_deep"));
    }
    Ok(())
}

fn valid_type(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || "._:-".contains(c))
}

/// Validates one reaction (keys in the order of docs/API.md, `enqueue_reactions`) and returns
/// it normalized for insertion.
fn reaction(value: &Value, i: usize) -> Result<Value> {
    let at = |key: &str| format!("reactions[{i}].{key}");
    let Value::Object(obj) = value else {
        return Err(Error::invalid_argument(&format!("reactions[{i}]"), "type"));
    };
    let key = args::json_string_field(obj, "idempotencyKey", &at("idempotencyKey"))?;
    if key.is_empty() {
        return Err(Error::invalid_argument(&at("idempotencyKey"), "empty"));
    }
    let kind = args::json_string_field(obj, "type", &at("type"))?;
    if !valid_type(&kind) {
        return Err(Error::invalid_argument(&at("type"), "shape"));
    }
    if kind.len() > MAX_TYPE_BYTES {
        return Err(Error::invalid_argument(&at("type"), "too_large"));
    }
    let version = args::json_int_field(obj, "version", &at("version"), (1, i32::MAX as i64), None)?;
    let payload = match obj.get("payload") {
        None | Some(Value::Null) => return Err(Error::invalid_argument(&at("payload"), "missing")),
        Some(p @ (Value::Object(_) | Value::Array(_))) => p.clone(),
        Some(_) => return Err(Error::invalid_argument(&at("payload"), "type")),
    };
    bounded(&payload, &at("payload"), MAX_PAYLOAD_BYTES)?;
    let source_client = args::json_string_field(obj, "sourceClientId", &at("sourceClientId"))?;
    let source_commit =
        args::json_string_field(obj, "sourceClientCommitId", &at("sourceClientCommitId"))?;
    let source_seq = args::json_int_field(
        obj,
        "sourceCommitSeq",
        &at("sourceCommitSeq"),
        (0, MAX_SAFE),
        None,
    )?;
    let created =
        args::json_int_field(obj, "createdAtMs", &at("createdAtMs"), (0, MAX_SAFE), None)?;
    let max_attempts =
        args::json_int_field(obj, "maxAttempts", &at("maxAttempts"), (1, 100), Some(10))?;
    Ok(json!({
        "idempotencyKey": key, "type": kind, "version": version, "payload": payload,
        "sourceClientId": source_client, "sourceClientCommitId": source_commit,
        "sourceCommitSeq": source_seq, "createdAtMs": created, "maxAttempts": max_attempts,
    }))
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn enqueue_reactions(partition: Option<&str>, reactions: Option<args::JsonArg>) -> i32 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let Value::Array(items) = args::json("reactions", reactions)? else {
            return Err(Error::invalid_argument("reactions", "type"));
        };
        let normalized = items
            .iter()
            .enumerate()
            .map(|(i, r)| reaction(r, i))
            .collect::<Result<Vec<_>>>()?;
        let key_of = |r: &Value| r["idempotencyKey"].as_str().unwrap_or_default().to_string();
        let duplicate =
            |key: String| Error::new(Code::ReactionDuplicate, json!({ "idempotencyKey": key }));
        let mut seen = HashSet::new();
        for r in &normalized {
            if !seen.insert(key_of(r)) {
                return Err(duplicate(key_of(r)));
            }
        }
        let count = normalized.len();
        db::with_spi(|client| {
            let inserted: HashSet<String> = db::write(
                client,
                "INSERT INTO syncular.sync_reactions
                   (partition, idempotency_key, type, version, payload, source_client_id,
                    source_client_commit_id, source_commit_seq, created_at_ms, available_at_ms,
                    status, attempts, max_attempts)
                 SELECT $1, r.\"idempotencyKey\", r.type, r.version, r.payload, r.\"sourceClientId\",
                        r.\"sourceClientCommitId\", r.\"sourceCommitSeq\", r.\"createdAtMs\",
                        r.\"createdAtMs\", 'pending', 0, r.\"maxAttempts\"
                   FROM pg_catalog.jsonb_to_recordset($2) AS r(\"idempotencyKey\" text, type text,
                        version integer, payload jsonb, \"sourceClientId\" text,
                        \"sourceClientCommitId\" text, \"sourceCommitSeq\" bigint,
                        \"createdAtMs\" bigint, \"maxAttempts\" integer)
                 ON CONFLICT DO NOTHING
                 RETURNING idempotency_key",
                &[DatumWithOid::from(partition.as_str()), DatumWithOid::from(JsonB(Value::Array(normalized.clone())))],
            )?
            .map(|row| Ok(row.get::<String>(1)?.unwrap_or_default()))
            .collect::<Result<_>>()?;
            // The first element (array order) whose key already existed: the call fails whole.
            if let Some(existing) = normalized
                .iter()
                .map(key_of)
                .find(|k| !inserted.contains(k))
            {
                return Err(duplicate(existing));
            }
            Ok(count as i32)
        })
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn claim_reactions(
    partition: Option<&str>,
    lease_owner: Option<&str>,
    types: Option<Array<&str>>,
    now_ms: Option<i64>,
    lease_duration_ms: Option<i64>,
    lim: Option<i32>,
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let owner = args::text("lease_owner", lease_owner)?;
        let types = args::text_array("types", types)?;
        let now = args::count("now_ms", now_ms)?;
        let duration = args::count("lease_duration_ms", lease_duration_ms)?;
        let lim = args::row_limit("lim", lim)?;
        if types.is_empty() || lim <= 0 {
            return Ok(JsonB(json!([])));
        }
        db::with_spi(|client| {
            let claimed = reactions(db::write(
                client,
                concat!(
                    "WITH due AS (
                       SELECT r.idempotency_key FROM syncular.sync_reactions r
                        WHERE r.partition = $1 AND r.type = ANY($3)
                          AND ((r.status = 'pending' AND r.available_at_ms <= $4)
                            OR (r.status = 'leased' AND r.lease_expires_at_ms <= $4))
                        ORDER BY CASE WHEN r.status = 'leased' THEN r.lease_expires_at_ms
                                      ELSE r.available_at_ms END,
                                 r.created_at_ms, r.idempotency_key
                        LIMIT $6
                        FOR UPDATE SKIP LOCKED
                     ), claimed AS (
                       UPDATE syncular.sync_reactions r
                          SET status = 'leased', attempts = r.attempts + 1, lease_owner = $2,
                              lease_expires_at_ms = LEAST(9007199254740991, $4 + $5),
                              completed_at_ms = NULL
                         FROM due WHERE r.partition = $1 AND r.idempotency_key = due.idempotency_key
                       RETURNING r.*
                     )
                     SELECT ",
                    reaction_columns!(),
                    " FROM claimed ORDER BY created_at_ms, idempotency_key"
                ),
                &[
                    DatumWithOid::from(partition.as_str()),
                    DatumWithOid::from(owner.as_str()),
                    DatumWithOid::from(types),
                    DatumWithOid::from(now),
                    DatumWithOid::from(duration),
                    DatumWithOid::from(lim as i64),
                ],
            )?)?;
            Ok(JsonB(Value::Array(claimed)))
        })
    })
}

/// The `(partition, idempotency_key, lease_owner)` arguments of the lease-guarded calls.
fn lease_args(
    partition: Option<&str>,
    idempotency_key: Option<&str>,
    lease_owner: Option<&str>,
) -> Result<(String, String, String)> {
    Ok((
        args::text("partition", partition)?,
        args::text("idempotency_key", idempotency_key)?,
        args::text("lease_owner", lease_owner)?,
    ))
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn complete_reaction(
    partition: Option<&str>,
    idempotency_key: Option<&str>,
    lease_owner: Option<&str>,
    at_ms: Option<i64>,
) -> bool {
    error::run(|| {
        let (partition, key, owner) = lease_args(partition, idempotency_key, lease_owner)?;
        let at = args::count("at_ms", at_ms)?;
        db::changed(
            "UPDATE syncular.sync_reactions
                SET status = 'completed', completed_at_ms = $4, lease_owner = NULL,
                    lease_expires_at_ms = NULL
              WHERE partition = $1 AND idempotency_key = $2 AND status = 'leased'
                AND lease_owner = $3
             RETURNING 1",
            &[
                partition.as_str().into(),
                key.as_str().into(),
                owner.as_str().into(),
                at.into(),
            ],
        )
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn extend_reaction_lease(
    partition: Option<&str>,
    idempotency_key: Option<&str>,
    lease_owner: Option<&str>,
    expires_at_ms: Option<i64>,
) -> bool {
    error::run(|| {
        let (partition, key, owner) = lease_args(partition, idempotency_key, lease_owner)?;
        let expires = args::count("expires_at_ms", expires_at_ms)?;
        db::changed(
            "UPDATE syncular.sync_reactions SET lease_expires_at_ms = $4
              WHERE partition = $1 AND idempotency_key = $2 AND status = 'leased'
                AND lease_owner = $3
             RETURNING 1",
            &[
                partition.as_str().into(),
                key.as_str().into(),
                owner.as_str().into(),
                expires.into(),
            ],
        )
    })
}

/// Validates a failure object and keeps exactly `code`, `atMs` and (when given) `details`.
fn decode_failure(value: Value) -> Result<(Value, i64)> {
    let Value::Object(obj) = value else {
        return Err(Error::invalid_argument("failure", "type"));
    };
    let code = args::json_string_field(&obj, "code", "failure.code")?;
    if code.is_empty() {
        return Err(Error::invalid_argument("failure.code", "empty"));
    }
    let at = args::json_int_field(&obj, "atMs", "failure.atMs", (0, MAX_SAFE), None)?;
    let mut kept = json!({"code": code, "atMs": at});
    match obj.get("details") {
        None | Some(Value::Null) => {}
        Some(details @ Value::Object(_)) => {
            bounded(details, "failure.details", MAX_DETAILS_BYTES)?;
            kept["details"] = details.clone();
        }
        Some(_) => return Err(Error::invalid_argument("failure.details", "type")),
    }
    Ok((kept, at))
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn fail_reaction(
    partition: Option<&str>,
    idempotency_key: Option<&str>,
    lease_owner: Option<&str>,
    failure: Option<args::JsonArg>,
    retry_at_ms: default!(Option<i64>, "NULL"),
) -> bool {
    error::run(|| {
        let (partition, key, owner) = lease_args(partition, idempotency_key, lease_owner)?;
        let (failure, at) = decode_failure(args::json("failure", failure)?)?;
        let retry = retry_at_ms
            .map(|r| args::count("retry_at_ms", Some(r)))
            .transpose()?;
        db::changed(
            "UPDATE syncular.sync_reactions
                SET status = CASE WHEN $5::bigint IS NULL THEN 'dead-letter' ELSE 'pending' END,
                    available_at_ms = coalesce($5::bigint, $6),
                    last_failure = $4, lease_owner = NULL, lease_expires_at_ms = NULL
              WHERE partition = $1 AND idempotency_key = $2 AND status = 'leased'
                AND lease_owner = $3
             RETURNING 1",
            &[
                partition.as_str().into(),
                key.as_str().into(),
                owner.as_str().into(),
                JsonB(failure).into(),
                retry.into(),
                at.into(),
            ],
        )
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn retry_reaction(
    partition: Option<&str>,
    idempotency_key: Option<&str>,
    now_ms: Option<i64>,
) -> bool {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let key = args::text("idempotency_key", idempotency_key)?;
        let now = args::count("now_ms", now_ms)?;
        db::changed(
            "UPDATE syncular.sync_reactions
                SET status = 'pending', attempts = 0, available_at_ms = $3, last_failure = NULL,
                    lease_owner = NULL, lease_expires_at_ms = NULL, completed_at_ms = NULL
              WHERE partition = $1 AND idempotency_key = $2 AND status = 'dead-letter'
             RETURNING 1",
            &[partition.as_str().into(), key.as_str().into(), now.into()],
        )
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn get_reaction(partition: Option<&str>, idempotency_key: Option<&str>) -> Option<JsonB> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let key = args::text("idempotency_key", idempotency_key)?;
        db::with_spi(|client| {
            let found = reactions(db::read(
                client,
                concat!(
                    "SELECT ",
                    reaction_columns!(),
                    " FROM syncular.sync_reactions
                         WHERE partition = $1 AND idempotency_key = $2"
                ),
                &[partition.as_str().into(), key.as_str().into()],
            )?)?;
            Ok(found.into_iter().next().map(JsonB))
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn list_reactions(
    partition: Option<&str>,
    lim: Option<i32>,
    statuses: default!(Option<Array<&str>>, "NULL"),
    types: default!(Option<Array<&str>>, "NULL"),
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let lim = args::row_limit("lim", lim)?;
        let filter = |name: &str, v: Option<Array<&str>>| -> Result<Option<Vec<String>>> {
            Ok(v.map(|v| args::text_array(name, Some(v)))
                .transpose()?
                .filter(|v| !v.is_empty()))
        };
        let statuses = filter("statuses", statuses)?;
        let types = filter("types", types)?;
        if lim <= 0 {
            return Ok(JsonB(json!([])));
        }
        db::with_spi(|client| {
            let list = reactions(db::read(
                client,
                concat!(
                    "SELECT ",
                    reaction_columns!(),
                    " FROM syncular.sync_reactions
                         WHERE partition = $1
                           AND ($2::text[] IS NULL OR status = ANY($2))
                           AND ($3::text[] IS NULL OR type = ANY($3))
                         ORDER BY created_at_ms DESC, idempotency_key DESC
                         LIMIT $4"
                ),
                &[
                    partition.as_str().into(),
                    statuses.into(),
                    types.into(),
                    (lim as i64).into(),
                ],
            )?)?;
            Ok(JsonB(Value::Array(list)))
        })
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn prune_reactions(
    partition: Option<&str>,
    completed_before_ms: Option<i64>,
    dead_letter_before_ms: Option<i64>,
    lim: Option<i32>,
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let completed_before = args::count("completed_before_ms", completed_before_ms)?;
        let dead_before = args::count("dead_letter_before_ms", dead_letter_before_ms)?;
        let lim = args::required("lim", lim)?;
        if lim <= 0 {
            return Ok(JsonB(json!({"completed": 0, "deadLetter": 0})));
        }
        db::with_spi(|client| {
            // Aged terminal rows only, oldest first; strict bounds; rows locked by others skipped.
            let table = db::write(
                client,
                "WITH completed AS (
                   SELECT r.idempotency_key, r.completed_at_ms AS at FROM syncular.sync_reactions r
                    WHERE r.partition = $1 AND r.status = 'completed' AND r.completed_at_ms < $2
                    ORDER BY r.completed_at_ms, r.idempotency_key LIMIT $4 FOR UPDATE SKIP LOCKED
                 ), dead AS (
                   SELECT r.idempotency_key, r.available_at_ms AS at FROM syncular.sync_reactions r
                    WHERE r.partition = $1 AND r.status = 'dead-letter' AND r.available_at_ms < $3
                    ORDER BY r.available_at_ms, r.idempotency_key LIMIT $4 FOR UPDATE SKIP LOCKED
                 ), candidates AS (
                   SELECT * FROM completed UNION ALL SELECT * FROM dead
                 ), victims AS (
                   SELECT idempotency_key FROM candidates ORDER BY at, idempotency_key LIMIT $4
                 ), gone AS (
                   DELETE FROM syncular.sync_reactions r USING victims v
                    WHERE r.partition = $1 AND r.idempotency_key = v.idempotency_key
                   RETURNING r.status
                 )
                 SELECT count(*) FILTER (WHERE status = 'completed'),
                        count(*) FILTER (WHERE status = 'dead-letter')
                   FROM gone",
                &[
                    partition.as_str().into(),
                    completed_before.into(),
                    dead_before.into(),
                    (lim as i64).into(),
                ],
            )?;
            let row = table.first();
            Ok(JsonB(json!({
                "completed": row.get::<i64>(1)?.unwrap_or(0),
                "deadLetter": row.get::<i64>(2)?.unwrap_or(0),
            })))
        })
    })
}
