//! `apply_pull`: the writes of a pull served by a hot standby, applied on the primary
//! (docs/DESIGN.md §Read replicas, docs/API.md `apply_pull`).
//!
//! A `pull` in a read-only transaction — every transaction of a standby — reads what it always
//! reads and writes nothing; its document carries `"writes"`: the registry touch and the client
//! record it would have written. The host sends that object here, on the primary, at any time
//! later. Applying is monotonic and idempotent, so a late, repeated or reordered apply never
//! undoes a newer one: the touch keeps the later authentication time; the client record is
//! written only over an older record of the same actor in the same log generation, and its
//! cursor never moves backwards (retention keeps what a client's cursor still needs).

use crate::args::{self, MAX_SAFE};
use crate::clients;
use crate::db;
use crate::error::{self, Error, Result};
use crate::limits;
use crate::registry;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::JsonB;
use serde_json::{json, Map, Value};

/// The touch and the client record in one statement. The record is written only when the
/// registry's epoch (after the touch) is the one the pull served (`$3`): a rotation in between
/// deleted the partition's records, and a record of the older generation must not come back.
/// Over an existing record: only the same actor's, only when it is not newer (`updated_at_ms`),
/// and the cursor never decreases. The first four columns are the registry entry
/// (`registry::entry`).
const APPLY_SQL: &str = "\
WITH touched AS (
  INSERT INTO syncular.sync_partition_registry AS r
    (partition, log_epoch, epoch_required, last_authenticated_at_ms)
  VALUES ($1, $3, false, $2)
  ON CONFLICT (partition) DO UPDATE
    SET last_authenticated_at_ms =
          GREATEST(r.last_authenticated_at_ms, EXCLUDED.last_authenticated_at_ms)
  RETURNING partition, log_epoch, epoch_required, last_authenticated_at_ms),
recorded AS (
  INSERT INTO syncular.sync_clients AS c
    (partition, client_id, actor_id, wire_version, cursor, subscriptions, updated_at_ms)
  SELECT $1, $4, $5, $6, $7, $8, $9 FROM touched t WHERE $10 AND t.log_epoch = $3
  ON CONFLICT (partition, client_id) DO UPDATE
    SET wire_version = EXCLUDED.wire_version, cursor = GREATEST(c.cursor, EXCLUDED.cursor),
        subscriptions = EXCLUDED.subscriptions, updated_at_ms = EXCLUDED.updated_at_ms
    WHERE c.actor_id = EXCLUDED.actor_id AND c.updated_at_ms <= EXCLUDED.updated_at_ms
  RETURNING c.cursor)
SELECT t.partition, t.log_epoch, t.epoch_required, t.last_authenticated_at_ms,
       (SELECT r.cursor FROM recorded r)
  FROM touched t";

/// A required text member within the key cap.
fn key_field(obj: &Map<String, Value>, key: &str, at: &str) -> Result<String> {
    let value = args::json_text_field(obj, key, at)?;
    if value.len() > limits::KEY_BYTES {
        return Err(Error::invalid_argument(at, "too_large"));
    }
    Ok(value)
}

/// The client record of `writes.client`, checked as `put_client` checks a record.
struct Record {
    client_id: String,
    actor_id: String,
    wire_version: i32,
    cursor: i64,
    subscriptions: Value,
    updated_at_ms: i64,
}

fn record(value: &Value) -> Result<Option<Record>> {
    let obj = match value {
        Value::Null => return Ok(None),
        Value::Object(obj) => obj,
        _ => return Err(Error::invalid_argument("writes.client", "type")),
    };
    Ok(Some(Record {
        client_id: key_field(obj, "clientId", "writes.client.clientId")?,
        actor_id: key_field(obj, "actorId", "writes.client.actorId")?,
        wire_version: args::json_int_field(
            obj,
            "wireVersion",
            "writes.client.wireVersion",
            (1, i64::from(i32::MAX)),
            Some(1),
        )? as i32,
        cursor: args::json_int_field(
            obj,
            "cursor",
            "writes.client.cursor",
            (-MAX_SAFE, MAX_SAFE),
            None,
        )?,
        subscriptions: clients::subscriptions(
            obj.get("subscriptions"),
            "writes.client.subscriptions",
        )?,
        updated_at_ms: args::json_int_field(
            obj,
            "updatedAtMs",
            "writes.client.updatedAtMs",
            (0, MAX_SAFE),
            None,
        )?,
    }))
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn apply_pull(writes: Option<args::JsonArg>) -> JsonB {
    error::run(|| {
        let Value::Object(obj) = args::json("writes", writes)? else {
            return Err(Error::invalid_argument("writes", "type"));
        };
        let partition = key_field(&obj, "partition", "writes.partition")?;
        let epoch = key_field(&obj, "logEpoch", "writes.logEpoch")?;
        let at = args::json_int_field(&obj, "atMs", "writes.atMs", (0, MAX_SAFE), None)?;
        let record = record(obj.get("client").unwrap_or(&Value::Null))?;
        db::with_spi(|client| {
            let table = db::write(
                client,
                APPLY_SQL,
                &[
                    DatumWithOid::from(partition.as_str()),
                    DatumWithOid::from(at),
                    DatumWithOid::from(epoch.as_str()),
                    DatumWithOid::from(record.as_ref().map(|r| r.client_id.as_str())),
                    DatumWithOid::from(record.as_ref().map(|r| r.actor_id.as_str())),
                    DatumWithOid::from(record.as_ref().map(|r| r.wire_version)),
                    DatumWithOid::from(record.as_ref().map(|r| r.cursor)),
                    DatumWithOid::from(record.as_ref().map(|r| JsonB(r.subscriptions.clone()))),
                    DatumWithOid::from(record.as_ref().map(|r| r.updated_at_ms)),
                    DatumWithOid::from(record.is_some()),
                ],
            )?;
            let row = table.into_iter().next().ok_or_else(|| {
                Error::Internal("syncular: the registry touch returned no row".into())
            })?;
            let written = row.get::<i64>(5)?;
            let registry = registry::entry(&row)?;
            let served_epoch = registry["logEpoch"] == json!(epoch);
            let (status, cursor) = match (&record, written) {
                (None, _) => ("none", Value::Null),
                (Some(_), Some(cursor)) => ("recorded", json!(cursor)),
                (Some(_), None) if !served_epoch => ("epoch_changed", Value::Null),
                (Some(r), None) => {
                    // Not written over the stored record: another actor's, or a newer one.
                    let stored = db::read(
                        client,
                        "SELECT c.actor_id, c.cursor FROM syncular.sync_clients c
                          WHERE c.partition = $1 AND c.client_id = $2",
                        &[
                            DatumWithOid::from(partition.as_str()),
                            DatumWithOid::from(r.client_id.as_str()),
                        ],
                    )?;
                    if stored.is_empty() {
                        // Deleted in between (a rotation committed after the touch read it).
                        ("epoch_changed", Value::Null)
                    } else {
                        let stored = stored.first();
                        let actor = stored.get::<String>(1)?;
                        let cursor = json!(stored.get::<i64>(2)?);
                        if actor.as_deref() == Some(r.actor_id.as_str()) {
                            ("newer_record", cursor)
                        } else {
                            ("actor_mismatch", Value::Null)
                        }
                    }
                }
            };
            Ok(JsonB(
                json!({"registry": registry, "client": status, "cursor": cursor}),
            ))
        })
    })
}
