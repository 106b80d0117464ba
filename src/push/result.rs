//! Push results and idempotency (docs/DESIGN.md §Push path, "Idempotency"): one stored result per
//! `(partition, clientId, clientCommitId)`, the first writer wins ([`store_result`]); a replay
//! reads it back normalized ([`stored_result`]); `get_push_result` / `put_push_result` are the
//! classic calls, with the push guard's checks (src/push_guard.rs).

use crate::args::{self, json_int, IntProblem};
use crate::commit::BASE64;
use crate::db;
use crate::error::{self, Code, Error, Result};
use crate::heap;
use crate::push_guard;
use base64::Engine;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use pgrx::JsonB;
use serde_json::{json, Map, Value};

fn cache_miss() -> Error {
    Error::bare(Code::IdempotencyCacheMiss)
}

/// `idempotency_cache_miss` naming the push whose stored result is unreadable.
fn cache_miss_of([partition, client_id, client_commit_id]: &[&str; 3]) -> Error {
    Error::new(
        Code::IdempotencyCacheMiss,
        json!({"partition": partition, "clientId": client_id, "clientCommitId": client_commit_id}),
    )
}

/// Re-encodes stored base64 (padded); `None` when it is not base64.
fn canonical_base64(value: Option<&Value>) -> Option<Value> {
    match value {
        None | Some(Value::Null) => Some(json!("")),
        Some(Value::String(s)) => BASE64.decode(s).ok().map(|b| json!(BASE64.encode(b))),
        Some(_) => None,
    }
}

fn text_or_empty(record: &Map<String, Value>, key: &str) -> Value {
    match record.get(key) {
        Some(Value::String(s)) => json!(s),
        _ => json!(""),
    }
}

/// The normalized reading of a stored push result (docs/DESIGN.md §Stored JSON); `Err` =
/// unreadable.
pub fn normalize(stored: Value) -> Result<Value> {
    let Value::Object(doc) = args::unwrap_json_text(stored) else {
        return Err(cache_miss());
    };
    let status = match doc.get("status") {
        Some(Value::String(s)) if s == "applied" || s == "rejected" => s.clone(),
        _ => return Err(cache_miss()),
    };
    let Some(Value::Array(records)) = doc.get("results") else {
        return Err(cache_miss());
    };
    let mut out = Map::new();
    out.insert("status".into(), json!(status));
    for key in ["commitSeq", "recordedAtMs", "cacheIdentity"] {
        if let Some(v) = doc.get(key) {
            out.insert(key.into(), v.clone());
        }
    }
    let results = records
        .iter()
        .map(|record| {
            crate::interrupts::check();
            let Value::Object(record) = record else {
                return Err(cache_miss());
            };
            let mut r = Map::new();
            r.insert(
                "opIndex".into(),
                record.get("opIndex").cloned().unwrap_or(Value::Null),
            );
            match record.get("status").and_then(Value::as_str) {
                Some("conflict") => {
                    r.insert("status".into(), json!("conflict"));
                    r.insert("code".into(), text_or_empty(record, "code"));
                    r.insert("message".into(), text_or_empty(record, "message"));
                    let version = record.get("serverVersion").and_then(|v| json_int(v).ok());
                    r.insert("serverVersion".into(), json!(version.unwrap_or(0)));
                    for key in ["serverRow", "conflictColumns"] {
                        r.insert(
                            key.into(),
                            canonical_base64(record.get(key)).ok_or_else(cache_miss)?,
                        );
                    }
                }
                Some("error") => {
                    r.insert("status".into(), json!("error"));
                    r.insert("code".into(), text_or_empty(record, "code"));
                    r.insert("message".into(), text_or_empty(record, "message"));
                    let retryable = record.get("retryable").and_then(Value::as_bool);
                    r.insert("retryable".into(), json!(retryable.unwrap_or(false)));
                    if let Some(details) = record.get("details") {
                        r.insert("details".into(), details.clone());
                    }
                }
                _ => {
                    r.insert("status".into(), json!("applied"));
                }
            }
            Ok(Value::Object(r))
        })
        .collect::<Result<Vec<_>>>()?;
    out.insert("results".into(), Value::Array(results));
    Ok(Value::Object(out))
}

/// Validates a push-result document for `put_push_result` (docs/DESIGN.md §Stored JSON).
pub fn validate(doc: &Value) -> Result<()> {
    let bad =
        |path: &str, reason: &str| Err(Error::invalid_argument(&format!("result{path}"), reason));
    let int_at_least = |v: &Value, path: &str, min: i64| -> Result<()> {
        match json_int(v) {
            Ok(n) if n >= min => Ok(()),
            Ok(_) | Err(IntProblem::Range) => bad(path, "range"),
            Err(IntProblem::Type) => bad(path, "type"),
        }
    };
    let Value::Object(obj) = doc else {
        return bad("", "type");
    };
    let applied = match obj.get("status") {
        None | Some(Value::Null) => return bad(".status", "missing"),
        Some(Value::String(s)) if s == "applied" => true,
        Some(Value::String(s)) if s == "rejected" => false,
        Some(Value::String(_)) => return bad(".status", "range"),
        Some(_) => return bad(".status", "type"),
    };
    match (applied, obj.get("commitSeq")) {
        (true, None | Some(Value::Null)) => return bad(".commitSeq", "shape"),
        (true, Some(v)) => int_at_least(v, ".commitSeq", 1)?,
        (false, None) => {}
        (false, Some(_)) => return bad(".commitSeq", "shape"),
    }
    if let Some(v) = obj.get("recordedAtMs") {
        int_at_least(v, ".recordedAtMs", 0)?;
    }
    if let Some(v) = obj.get("cacheIdentity") {
        if !v.is_string() {
            return bad(".cacheIdentity", "type");
        }
    }
    let records = match obj.get("results") {
        None | Some(Value::Null) => return bad(".results", "missing"),
        Some(Value::Array(a)) => a,
        Some(_) => return bad(".results", "type"),
    };
    for (i, record) in records.iter().enumerate() {
        crate::interrupts::check();
        let at = |key: &str| format!(".results[{i}]{key}");
        let Value::Object(record) = record else {
            return bad(&at(""), "type");
        };
        match record.get("opIndex") {
            None | Some(Value::Null) => return bad(&at(".opIndex"), "missing"),
            Some(v) => int_at_least(v, &at(".opIndex"), 0)?,
        }
        match record.get("status") {
            None | Some(Value::Null) => return bad(&at(".status"), "missing"),
            Some(Value::String(s)) if ["applied", "error", "conflict"].contains(&s.as_str()) => {}
            Some(Value::String(_)) => return bad(&at(".status"), "range"),
            Some(_) => return bad(&at(".status"), "type"),
        }
        for key in ["code", "message"] {
            if record.get(key).is_some_and(|v| !v.is_string()) {
                return bad(&at(&format!(".{key}")), "type");
            }
        }
        if record.get("retryable").is_some_and(|v| !v.is_boolean()) {
            return bad(&at(".retryable"), "type");
        }
        if let Some(v) = record.get("serverVersion") {
            int_at_least(v, &at(".serverVersion"), 0)?;
        }
        if record.get("details").is_some_and(|v| !v.is_object()) {
            return bad(&at(".details"), "type");
        }
        for key in ["serverRow", "conflictColumns"] {
            match record.get(key) {
                None => {}
                Some(Value::String(s)) if BASE64.decode(s).is_ok() => {}
                Some(Value::String(_)) => return bad(&at(&format!(".{key}")), "base64"),
                Some(_) => return bad(&at(&format!(".{key}")), "type"),
            }
        }
    }
    Ok(())
}

const RESULT_SQL: &str = "SELECT result FROM syncular.sync_push_results
  WHERE partition = $1 AND client_id = $2 AND client_commit_id = $3";

/// The stored result, normalized. `fresh`: after a lock wait, with a new snapshot — else in the
/// snapshot the statement it replaces read with (`heap::with_snapshot`). Read by its primary key
/// below SQL, one index scan instead of a statement (docs/BENCHMARKS.md, issue 28); through SQL
/// where Citus keeps the partition's shard on another node.
pub fn stored_result(
    client: &SpiClient<'_>,
    key: &[&str; 3],
    fresh: bool,
) -> Result<Option<Value>> {
    Ok(stored_result_seen(client, key, fresh, None)?.0)
}

/// [`stored_result`], and what the snapshot it was read with sees (`None` where it was read
/// through SQL). Given `unless_seen` — what an earlier read of the same key saw, which found
/// nothing — the lookup is skipped when this snapshot sees the same ([`heap::Seen`]): no other
/// transaction ended in between, so it would find nothing too (the one-call push's locked
/// re-check, C4, after its optimistic read, C1: docs/BENCHMARKS.md, issue 28 step 9).
pub fn stored_result_seen(
    client: &SpiClient<'_>,
    key: &[&str; 3],
    fresh: bool,
    unless_seen: Option<&heap::Seen>,
) -> Result<(Option<Value>, Option<heap::Seen>)> {
    let (read, seen) = heap::with_snapshot(fresh, |snapshot| {
        // SAFETY: the snapshot is registered around this closure.
        let seen = unsafe { heap::seen_by(snapshot) };
        if unless_seen.is_some() && unless_seen == seen.as_ref() {
            return Ok((heap::Lookup::Here(None, pg_sys::InvalidTransactionId), seen));
        }
        // SAFETY: the keys are text datums built inside, alive for the lookup; the snapshot is
        // registered around it.
        let read = unsafe {
            heap::jsonb_by_text_key(
                heap::SyncTable::PushResults,
                *key,
                Some(key[0]),
                c"result",
                snapshot,
            )
        }?;
        Ok((read, seen))
    })?;
    let (stored, seen) = match read {
        heap::Lookup::Here(stored, _) => (stored, seen),
        heap::Lookup::Elsewhere => {
            let params = key.map(DatumWithOid::from);
            let table = if fresh {
                db::write(client, RESULT_SQL, &params)?
            } else {
                db::read(client, RESULT_SQL, &params)?
            };
            (
                db::first::<crate::jsonb::JsonValue>(table)?.map(|v| JsonB(v.0)),
                None,
            )
        }
    };
    let stored = stored
        .map(|stored| normalize(stored.0).map_err(|_| cache_miss_of(key)))
        .transpose()?;
    Ok((stored, seen))
}

pub(super) struct PushKey {
    pub(super) partition: String,
    pub(super) client_id: String,
    pub(super) client_commit_id: String,
}

impl PushKey {
    pub(super) fn new(p: Option<&str>, c: Option<&str>, k: Option<&str>) -> Result<PushKey> {
        Ok(PushKey {
            partition: args::text("partition", p)?,
            client_id: args::text("client_id", c)?,
            client_commit_id: args::text("client_commit_id", k)?,
        })
    }
    pub(super) fn parts(&self) -> [&str; 3] {
        [&self.partition, &self.client_id, &self.client_commit_id]
    }
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn get_push_result(
    partition: Option<&str>,
    client_id: Option<&str>,
    client_commit_id: Option<&str>,
) -> Option<JsonB> {
    error::run(|| {
        let key = PushKey::new(partition, client_id, client_commit_id)?;
        Ok(db::with_spi(|client| stored_result(client, &key.parts(), false))?.map(JsonB))
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn put_push_result(
    partition: Option<&str>,
    client_id: Option<&str>,
    client_commit_id: Option<&str>,
    result: Option<args::JsonArg>,
) -> JsonB {
    error::run(|| {
        let key = PushKey::new(partition, client_id, client_commit_id)?;
        let document = args::json("result", result)?;
        validate(&document)?;
        let [p, c, k] = key.parts();
        let applied_seq = (document["status"] == "applied")
            .then(|| json_int(&document["commitSeq"]).ok())
            .flatten();
        let names_append = push_guard::check_result(p, c, k, applied_seq)?;
        db::with_spi(|client| {
            let stored = store_result(client, &key.parts(), document)?;
            // The push's commit stands in this transaction: only its own result may be stored.
            if let (true, Some(seq)) = (names_append, applied_seq) {
                push_guard::check_stored(seq, &stored)?;
            }
            Ok(stored.document)
        })
        .map(JsonB)
    })
}

/// The result stored for a push key by [`store_result`].
pub struct Stored {
    /// The stored (winning) document, normalized.
    pub document: Value,
    /// The document stored is the one this call inserted (not another transaction's).
    pub inserted: bool,
}

/// Stores a validated push result, first writer wins (a concurrent insert of the same key is
/// waited for); returns the stored (winning) document, normalized, and whether it is the one
/// this call inserted. A document of integers and
/// strings (every one a push builds) goes in as binary jsonb, written directly
/// ([`crate::jsonb_write::from_json`]), and when it is the one stored its reading is its own
/// normalized form (the jsonb round trip gives the same document back); any other is converted
/// from its text and read back as stored.
pub fn store_result(client: &SpiClient<'_>, key: &[&str; 3], document: Value) -> Result<Stored> {
    let [p, c, k] = *key;
    let binary = crate::jsonb_write::from_json(&document)?;
    if let Some(binary) = &binary {
        if let Some(inserted) = insert_below_sql(key, binary)? {
            return stored(client, key, inserted.then_some(document));
        }
    }
    let written = binary.is_some();
    let value = match binary {
        Some(binary) => DatumWithOid::from(binary),
        None => DatumWithOid::from(JsonB(document.clone())),
    };
    let inserted = db::write(
        client,
        "INSERT INTO syncular.sync_push_results (partition, client_id, client_commit_id, result)
         VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING RETURNING result",
        &[
            DatumWithOid::from(p),
            DatumWithOid::from(c),
            DatumWithOid::from(k),
            value,
        ],
    )?;
    let inserted = if written {
        (!inserted.is_empty()).then_some(document)
    } else {
        db::first::<crate::jsonb::JsonValue>(inserted)?.map(|stored| stored.0)
    };
    stored(client, key, inserted)
}

/// The [`Stored`] answer: `inserted`, the document this call inserted (its reading is its own
/// normalized form), else the one stored, read again after the wait.
fn stored(client: &SpiClient<'_>, key: &[&str; 3], inserted: Option<Value>) -> Result<Stored> {
    Ok(match inserted {
        Some(stored) => Stored {
            document: normalize(stored).map_err(|_| cache_miss_of(key))?,
            inserted: true,
        },
        None => Stored {
            document: stored_result(client, key, true)?
                .ok_or_else(|| Error::Internal("push result vanished".into()))?,
            inserted: false,
        },
    })
}

const RESULT_COLUMNS: &[(&std::ffi::CStr, pg_sys::Oid)] = &[
    (c"partition", pg_sys::TEXTOID),
    (c"client_id", pg_sys::TEXTOID),
    (c"client_commit_id", pg_sys::TEXTOID),
    (c"result", pg_sys::JSONBOID),
];

/// The result's insert below SQL (`INSERT … ON CONFLICT DO NOTHING` as the executor does it:
/// [`heap::DirectInsert::insert_unless_conflict`]): `Some(true)` inserted, `Some(false)` a
/// result for the key stands (waited for if another transaction was inserting it); `None` where
/// the statement must run — outside READ COMMITTED (where it refuses a conflicting row its
/// snapshot cannot see, 40001), in a read-only transaction, or where the table is not as created
/// (Citus included).
fn insert_below_sql(key: &[&str; 3], binary: &crate::jsonb::OwnedJsonb) -> Result<Option<bool>> {
    let Some(mut results) = heap::DirectInsert::open_for_conflicts(
        heap::SyncTable::PushResults,
        key[0],
        RESULT_COLUMNS,
    )?
    else {
        return Ok(None);
    };
    let [p, c, k] = *key;
    let row = [
        Some(heap::Value::Text(p)),
        Some(heap::Value::Text(c)),
        Some(heap::Value::Text(k)),
        Some(heap::Value::Jsonb(binary.raw())),
    ];
    results.insert_unless_conflict(&row).map(Some)
}
