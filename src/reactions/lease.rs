//! The worker's calls: `claim_reactions` (the claim index, docs/DESIGN.md §8) and the
//! acknowledgements that act only while the caller holds the lease, single and batch, and the
//! operator's `retry_reaction`.

use super::document::{documents, reaction_columns};
use super::{MAX_DEPTH, MAX_DETAILS_BYTES};
use crate::args;
use crate::args::MAX_SAFE;
use crate::db;
use crate::error::{self, Error, Result};
use crate::jsonb::{self, Bounds, JsonbArg, Node, OwnedJsonb, Reason};
use crate::limits;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::JsonB;
use serde_json::json;
use std::collections::HashSet;

/// The lease rule (docs/DESIGN.md §8 sync_reactions, "Leases"): an acknowledgement — complete,
/// extend, fail, single or batch — acts only on a reaction the caller holds: `leased`, with the
/// caller (`$3`) as its lease owner. The expiry is not checked: an owner may still finish a
/// lapsed lease nobody claimed again, and once another worker claimed it, the first owner's
/// acknowledgement changes nothing (upstream's rule).
macro_rules! lease_held {
    () => {
        "status = 'leased' AND lease_owner = $3"
    };
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn claim_reactions(
    partition: Option<&str>,
    lease_owner: Option<&str>,
    types: Option<args::TextArray>,
    now_ms: Option<i64>,
    lease_duration_ms: Option<i64>,
    lim: Option<i32>,
) -> OwnedJsonb {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let owner = args::text("lease_owner", lease_owner)?;
        let listed = args::text_array("types", types.as_ref())?.len();
        let now = args::count("now_ms", now_ms)?;
        let duration = args::count("lease_duration_ms", lease_duration_ms)?;
        let lim = args::row_limit("lim", lim)?;
        if listed == 0 || lim <= 0 {
            return Ok(OwnedJsonb::empty_array());
        }
        db::with_spi(|client| {
            // Always the kept generic plan (db::write_generic): a custom plan would be planned
            // again on every call (the generic one's cost is estimated for an unknown `lim`),
            // and the plan is the same index range either way.
            let claimed = documents(db::write_generic(
                client,
                concat!(
                    // The due condition and the order are exactly sync_reactions_claim's
                    // predicate and key (sql/schema.sql): a range read in claim order that
                    // stops after `lim` locked rows; the type filter is checked on the rows
                    // read (docs/DESIGN.md §8, the claim index). The chosen keys feed the
                    // UPDATE as an array, so it probes the primary key whatever the planner
                    // guesses for `lim`.
                    "WITH claimed AS (
                       UPDATE syncular.sync_reactions r
                          SET status = 'leased', attempts = r.attempts + 1, lease_owner = $2,
                              lease_expires_at_ms = LEAST(9007199254740991, $4 + $5),
                              completed_at_ms = NULL
                        WHERE r.partition = $1 AND r.idempotency_key = ANY (ARRAY(
                          SELECT d.idempotency_key FROM syncular.sync_reactions d
                           WHERE d.partition = $1 AND d.status IN ('pending', 'leased')
                             AND CASE WHEN d.status = 'leased' THEN d.lease_expires_at_ms
                                      ELSE d.available_at_ms END <= $4
                             AND d.type = ANY($3)
                           ORDER BY CASE WHEN d.status = 'leased' THEN d.lease_expires_at_ms
                                         ELSE d.available_at_ms END,
                                    d.created_at_ms, d.idempotency_key
                           LIMIT $6
                           FOR UPDATE SKIP LOCKED))
                       RETURNING r.*
                     )
                     SELECT ",
                    reaction_columns!(),
                    " FROM claimed r ORDER BY r.created_at_ms, r.idempotency_key"
                ),
                &[
                    DatumWithOid::from(partition.as_str()),
                    DatumWithOid::from(owner.as_str()),
                    args::required("types", types.as_ref())?.datum(),
                    DatumWithOid::from(now),
                    DatumWithOid::from(duration),
                    DatumWithOid::from(lim as i64),
                ],
            )?)?;
            Ok(claimed)
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

/// Runs a single acknowledgement `sql` (its `WHERE` holds [`lease_held!`]) for
/// `[partition, key, owner]` with its one value `$4`; whether it changed the reaction.
fn acknowledge(sql: &'static str, [partition, key, owner]: [&str; 3], value: i64) -> Result<bool> {
    db::changed(
        sql,
        &[partition.into(), key.into(), owner.into(), value.into()],
    )
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
        acknowledge(
            concat!(
                "UPDATE syncular.sync_reactions
                    SET status = 'completed', completed_at_ms = $4, lease_owner = NULL,
                        lease_expires_at_ms = NULL
                  WHERE partition = $1 AND idempotency_key = $2 AND ",
                lease_held!(),
                " RETURNING 1"
            ),
            [&partition, &key, &owner],
            at,
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
        acknowledge(
            concat!(
                "UPDATE syncular.sync_reactions SET lease_expires_at_ms = $4
                  WHERE partition = $1 AND idempotency_key = $2 AND ",
                lease_held!(),
                " RETURNING 1"
            ),
            [&partition, &key, &owner],
            expires,
        )
    })
}

/// A failure object (docs/API.md §Reactions, `fail_reaction`) from its binary form: `code` (a
/// non-empty string), `atMs` (integer 0 … 2^53−1) and optional `details` (an object within the
/// payload's caps: `MAX_DETAILS_BYTES` of compact text, depth 16, measured as for payloads);
/// other keys are dropped. Returns the kept object's JSON text and `atMs`.
fn decode_failure(node: Option<Node<'_>>, at: &str) -> Result<(String, i64)> {
    let fail = |key: &str, reason: Reason| Error::invalid_argument(&format!("{at}.{key}"), reason);
    let obj = match node {
        None => return Err(Error::invalid_argument(at, "missing")),
        Some(Node::Object(obj)) => obj,
        Some(_) => return Err(Error::invalid_argument(at, "type")),
    };
    let unreadable = |_| Error::invalid_argument(at, "type");
    let [code, at_ms, details] = obj
        .fields(["code", "atMs", "details"])
        .map_err(unreadable)?;
    let code = jsonb::string_field(code, true).map_err(|reason| fail("code", reason))?;
    let at_ms = jsonb::integer_field(at_ms, (0, MAX_SAFE))
        .map_err(|reason| fail("atMs", reason))?
        .ok_or_else(|| fail("atMs", "missing"))?;
    let mut kept = String::from("{\"code\":");
    jsonb::push_escaped(&mut kept, code);
    kept.push_str(&format!(",\"atMs\":{at_ms}"));
    match jsonb::given(details) {
        None => {}
        Some(details @ Node::Object(container)) => {
            match jsonb::bounds(details, MAX_DETAILS_BYTES, MAX_DEPTH).map_err(unreadable)? {
                Bounds::Within => {}
                Bounds::TooLarge => return Err(fail("details", "too_large")),
                Bounds::TooDeep => return Err(fail("details", "too_deep")),
            }
            kept.push_str(",\"details\":");
            kept.push_str(&container.to_jsonb().printed());
        }
        Some(_) => return Err(fail("details", "type")),
    }
    kept.push('}');
    Ok((kept, at_ms))
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn fail_reaction(
    partition: Option<&str>,
    idempotency_key: Option<&str>,
    lease_owner: Option<&str>,
    failure: Option<JsonbArg>,
    retry_at_ms: default!(Option<i64>, "NULL"),
) -> bool {
    error::run(|| {
        let (partition, key, owner) = lease_args(partition, idempotency_key, lease_owner)?;
        let (failure, at) = args::with_jsonb("failure", failure, |root| {
            decode_failure(Some(root), "failure")
        })?;
        let retry = retry_at_ms
            .map(|r| args::count("retry_at_ms", Some(r)))
            .transpose()?;
        db::changed(
            concat!(
                "UPDATE syncular.sync_reactions
                SET status = CASE WHEN $5::bigint IS NULL THEN 'dead-letter' ELSE 'pending' END,
                    available_at_ms = coalesce($5::bigint, $6),
                    last_failure = $4::jsonb, lease_owner = NULL, lease_expires_at_ms = NULL
              WHERE partition = $1 AND idempotency_key = $2 AND ",
                lease_held!(),
                " RETURNING 1"
            ),
            &[
                partition.as_str().into(),
                key.as_str().into(),
                owner.as_str().into(),
                failure.as_str().into(),
                retry.into(),
                at.into(),
            ],
        )
    })
}

/// The keys of `changed` in the order of `asked` (first occurrences): what a batch call reports.
fn in_order(asked: &[impl AsRef<str>], changed: &HashSet<String>) -> Vec<String> {
    let mut seen = HashSet::new();
    asked
        .iter()
        .map(AsRef::as_ref)
        .filter(|k| changed.contains(*k) && seen.insert(*k))
        .map(str::to_string)
        .collect()
}

/// Batch `complete_reaction`: one statement, a primary-key probe per key (docs/API.md
/// §Reactions). Returns the keys it completed, in the order given; a key not leased by
/// `lease_owner` (or absent) is left alone, as in the single form.
#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn complete_reactions(
    partition: Option<&str>,
    idempotency_keys: Option<args::TextArray>,
    lease_owner: Option<&str>,
    at_ms: Option<i64>,
) -> Vec<String> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let keys = args::text_array("idempotency_keys", idempotency_keys.as_ref())?;
        let owner = args::text("lease_owner", lease_owner)?;
        let at = args::count("at_ms", at_ms)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let changed: HashSet<String> = db::with_spi(|client| {
            // The kept generic plan: a primary-key probe per key whatever the array holds; left
            // to choose, the plan cache can settle on planning every call again.
            db::texts(db::write_generic(
                client,
                concat!(
                    "UPDATE syncular.sync_reactions
                        SET status = 'completed', completed_at_ms = $4, lease_owner = NULL,
                            lease_expires_at_ms = NULL
                      WHERE partition = $1 AND idempotency_key = ANY($2) AND ",
                    lease_held!(),
                    " RETURNING idempotency_key"
                ),
                &[
                    DatumWithOid::from(partition.as_str()),
                    args::required("idempotency_keys", idempotency_keys.as_ref())?.datum(),
                    DatumWithOid::from(owner.as_str()),
                    DatumWithOid::from(at),
                ],
            )?)
        })?;
        Ok(in_order(&keys, &changed))
    })
}

/// One element of `fail_reactions`' array, validated.
struct Failure {
    key: String,
    /// The kept failure object's compact text.
    failure: String,
    at: i64,
    retry: Option<i64>,
}

fn failure_item(node: Node<'_>, i: usize) -> Result<Failure> {
    let at = |key: &str| format!("failures[{i}].{key}");
    let element = || Error::invalid_argument(&format!("failures[{i}]"), "type");
    let Node::Object(obj) = node else {
        return Err(element());
    };
    let [key, failure, retry] = obj
        .fields(["idempotencyKey", "failure", "retryAtMs"])
        .map_err(|_| element())?;
    let key = jsonb::string_field(key, true)
        .map_err(|reason| Error::invalid_argument(&at("idempotencyKey"), reason))?;
    let (failure, at_ms) = decode_failure(failure, &at("failure"))?;
    let retry = jsonb::integer_field(retry, (0, MAX_SAFE))
        .map_err(|reason| Error::invalid_argument(&at("retryAtMs"), reason))?;
    Ok(Failure {
        key: key.to_string(),
        failure,
        at: at_ms,
        retry,
    })
}

/// Batch `fail_reaction` with the runner's retry cap applied in the same statement
/// (docs/API.md §Reactions): each element fails one reaction still leased by `lease_owner`;
/// with `retryAtMs` it becomes `pending` at that time unless its attempts reached
/// `maxAttempts`, in which case (or without `retryAtMs`) it becomes `dead-letter`. Returns
/// `{"pending": [keys], "deadLetter": [keys]}` in the order given; bad input changes nothing.
#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn fail_reactions(
    partition: Option<&str>,
    lease_owner: Option<&str>,
    failures: Option<JsonbArg>,
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let owner = args::text("lease_owner", lease_owner)?;
        let items = args::with_jsonb("failures", failures, |root| {
            let Node::Array(items) = root else {
                return Err(Error::invalid_argument("failures", "type"));
            };
            if items.len() > limits::ARRAY_ELEMENTS {
                return Err(Error::invalid_argument("failures", "too_large"));
            }
            items
                .children()
                .enumerate()
                .map(|(i, f)| {
                    crate::interrupts::check();
                    failure_item(
                        f.map_err(|_| Error::invalid_argument("failures", "type"))?,
                        i,
                    )
                })
                .collect::<Result<Vec<_>>>()
        })?;
        let mut seen = HashSet::new();
        if let Some(i) = items.iter().position(|f| !seen.insert(f.key.as_str())) {
            return Err(Error::invalid_argument(
                &format!("failures[{i}].idempotencyKey"),
                "duplicate",
            )
            .with_hint(format!("the key {:?} is listed twice", items[i].key)));
        }
        let keys: Vec<String> = items.iter().map(|f| f.key.clone()).collect();
        let (mut texts, mut ats, mut retries) = (Vec::new(), Vec::new(), Vec::new());
        for f in items {
            crate::interrupts::check();
            texts.push(f.failure);
            ats.push(f.at);
            retries.push(f.retry);
        }
        let (mut pending, mut dead) = (HashSet::new(), HashSet::new());
        db::with_spi(|client| {
            // The kept generic plan, as in `complete_reactions`.
            let table = db::write_generic(
                client,
                "WITH f AS (
                   SELECT * FROM ROWS FROM (pg_catalog.unnest($3::text[]),
                          pg_catalog.unnest($4::text[]), pg_catalog.unnest($5::bigint[]),
                          pg_catalog.unnest($6::bigint[])) AS f(key, failure, at, retry)
                 )
                 UPDATE syncular.sync_reactions r
                    SET status = CASE WHEN f.retry IS NULL OR r.attempts >= r.max_attempts
                                      THEN 'dead-letter' ELSE 'pending' END,
                        available_at_ms = CASE WHEN f.retry IS NULL OR r.attempts >= r.max_attempts
                                               THEN f.at ELSE f.retry END,
                        last_failure = f.failure::jsonb, lease_owner = NULL,
                        lease_expires_at_ms = NULL
                   FROM f
                  WHERE r.partition = $1 AND r.idempotency_key = ANY($3)
                    AND r.idempotency_key = f.key COLLATE \"C\"
                    AND r.status = 'leased' AND r.lease_owner = $2
                 RETURNING r.idempotency_key, r.status",
                &[
                    DatumWithOid::from(partition.as_str()),
                    DatumWithOid::from(owner.as_str()),
                    DatumWithOid::from(keys.clone()),
                    DatumWithOid::from(texts),
                    DatumWithOid::from(ats),
                    DatumWithOid::from(retries),
                ],
            )?;
            for row in table {
                crate::interrupts::check();
                let key = row.get::<String>(1)?.unwrap_or_default();
                match row.get::<String>(2)?.as_deref() {
                    Some("pending") => pending.insert(key),
                    _ => dead.insert(key),
                };
            }
            Ok(())
        })?;
        Ok(JsonB(json!({
            "pending": in_order(&keys, &pending),
            "deadLetter": in_order(&keys, &dead),
        })))
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
