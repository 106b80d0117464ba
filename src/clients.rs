//! Client records and cursors (docs/DESIGN.md §Clients). A record is overwritten, never merged;
//! cursor advances are monotonic and guarded by actor and log epoch; the active cursor floor
//! feeds the retention policy.

use crate::args::{self, MAX_SAFE};
use crate::db;
use crate::error::{self, Error, Result};
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiTupleTable};
use pgrx::JsonB;
use serde_json::{json, Value};

macro_rules! client_columns {
    () => {
        "client_id, actor_id, wire_version, cursor, subscriptions, updated_at_ms"
    };
}

fn records(table: SpiTupleTable<'_>) -> Result<Vec<Value>> {
    table
        .map(|row| {
            crate::interrupts::check();
            Ok(json!({
                "clientId": row.get::<String>(1)?,
                "actorId": row.get::<String>(2)?,
                "wireVersion": row.get::<i32>(3)?,
                "cursor": row.get::<i64>(4)?,
                "subscriptions": row.get::<crate::jsonb::JsonValue>(5)?.map(|j| args::unwrap_json_text(j.0)),
                "updatedAtMs": row.get::<i64>(6)?,
            }))
        })
        .collect()
}

/// A signed cursor within ±(2^53 − 1).
fn cursor_arg(name: &str, value: Option<i64>) -> Result<i64> {
    let cursor = args::required(name, value)?;
    if !(-MAX_SAFE..=MAX_SAFE).contains(&cursor) {
        return Err(Error::invalid_argument(name, "range"));
    }
    Ok(cursor)
}

/// `{"id": string, "table": string, "scopes": {var: [string]}}` (extra keys kept); `name` is
/// the argument path errors name (`record.subscriptions`).
pub fn subscriptions(value: Option<&Value>, name: &str) -> Result<Value> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Err(Error::invalid_argument(name, "missing"));
    };
    let Value::Array(items) = value else {
        return Err(Error::invalid_argument(name, "type"));
    };
    for (i, item) in items.iter().enumerate() {
        crate::interrupts::check();
        let at = |key: &str| format!("{name}[{i}]{key}");
        let Value::Object(sub) = item else {
            return Err(Error::invalid_argument(&at(""), "type"));
        };
        for key in ["id", "table"] {
            match sub.get(key) {
                Some(Value::String(_)) => {}
                None | Some(Value::Null) => {
                    return Err(Error::invalid_argument(&at(&format!(".{key}")), "missing"))
                }
                Some(_) => return Err(Error::invalid_argument(&at(&format!(".{key}")), "type")),
            }
        }
        let scopes_ok = match sub.get("scopes") {
            Some(Value::Object(scopes)) => scopes.values().all(|v| {
                v.as_array()
                    .is_some_and(|vals| vals.iter().all(Value::is_string))
            }),
            _ => false,
        };
        if !scopes_ok {
            let reason = if sub.get("scopes").is_none_or(Value::is_null) {
                "missing"
            } else {
                "type"
            };
            return Err(Error::invalid_argument(&at(".scopes"), reason));
        }
    }
    Ok(value.clone())
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn get_client(partition: Option<&str>, client_id: Option<&str>) -> Option<JsonB> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let client_id = args::text("client_id", client_id)?;
        db::with_spi(|client| {
            let found = records(db::read(
                client,
                concat!(
                    "SELECT ",
                    client_columns!(),
                    " FROM syncular.sync_clients
                         WHERE partition = $1 AND client_id = $2"
                ),
                &[partition.as_str().into(), client_id.as_str().into()],
            )?)?;
            Ok(found.into_iter().next().map(JsonB))
        })
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn put_client(partition: Option<&str>, record: Option<args::JsonArg>) {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let Value::Object(obj) = args::json("record", record)? else {
            return Err(Error::invalid_argument("record", "type"));
        };
        let client_id = args::json_text_field(&obj, "clientId", "record.clientId")?;
        let actor_id = args::json_text_field(&obj, "actorId", "record.actorId")?;
        let wire = args::json_int_field(
            &obj,
            "wireVersion",
            "record.wireVersion",
            (1, i32::MAX as i64),
            Some(1),
        )?;
        let cursor =
            args::json_int_field(&obj, "cursor", "record.cursor", (-MAX_SAFE, MAX_SAFE), None)?;
        let subs = subscriptions(obj.get("subscriptions"), "record.subscriptions")?;
        let updated = args::json_int_field(
            &obj,
            "updatedAtMs",
            "record.updatedAtMs",
            (0, MAX_SAFE),
            None,
        )?;
        db::with_spi(|client| {
            db::write(
                client,
                "INSERT INTO syncular.sync_clients
                   (partition, client_id, actor_id, wire_version, cursor, subscriptions, updated_at_ms)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)
                 ON CONFLICT (partition, client_id) DO UPDATE
                   SET actor_id = EXCLUDED.actor_id, wire_version = EXCLUDED.wire_version,
                       cursor = EXCLUDED.cursor, subscriptions = EXCLUDED.subscriptions,
                       updated_at_ms = EXCLUDED.updated_at_ms",
                &[
                    partition.as_str().into(),
                    client_id.as_str().into(),
                    actor_id.as_str().into(),
                    (wire as i32).into(),
                    cursor.into(),
                    JsonB(subs).into(),
                    updated.into(),
                ],
            )?;
            Ok(())
        })
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn advance_client_cursor(
    partition: Option<&str>,
    client_id: Option<&str>,
    actor_id: Option<&str>,
    log_epoch: Option<&str>,
    cursor: Option<i64>,
    at_ms: Option<i64>,
) -> bool {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let client_id = args::text("client_id", client_id)?;
        let actor_id = args::text("actor_id", actor_id)?;
        let epoch = args::text("log_epoch", log_epoch)?;
        let cursor = cursor_arg("cursor", cursor)?;
        let at = args::count("at_ms", at_ms)?;
        db::changed(
            "UPDATE syncular.sync_clients c
                SET cursor = GREATEST(c.cursor, $5), updated_at_ms = GREATEST(c.updated_at_ms, $6)
              WHERE c.partition = $1 AND c.client_id = $2 AND c.actor_id = $3
                AND EXISTS (SELECT 1 FROM syncular.sync_partition_registry r
                             WHERE r.partition = $1 AND r.log_epoch = $4)
             RETURNING 1",
            &[
                partition.as_str().into(),
                client_id.as_str().into(),
                actor_id.as_str().into(),
                epoch.as_str().into(),
                cursor.into(),
                at.into(),
            ],
        )
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn update_client_cursor(
    partition: Option<&str>,
    client_id: Option<&str>,
    cursor: Option<i64>,
    at_ms: Option<i64>,
) -> bool {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let client_id = args::text("client_id", client_id)?;
        let cursor = cursor_arg("cursor", cursor)?;
        let at = args::count("at_ms", at_ms)?;
        db::changed(
            "UPDATE syncular.sync_clients c
                SET cursor = GREATEST(c.cursor, $3), updated_at_ms = GREATEST(c.updated_at_ms, $4)
              WHERE c.partition = $1 AND c.client_id = $2
             RETURNING 1",
            &[
                partition.as_str().into(),
                client_id.as_str().into(),
                cursor.into(),
                at.into(),
            ],
        )
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn list_client_cursors(partition: Option<&str>) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        db::with_spi(|client| {
            let list = db::read(
                client,
                "SELECT client_id, cursor, updated_at_ms FROM syncular.sync_clients
                  WHERE partition = $1 ORDER BY client_id",
                &[partition.as_str().into()],
            )?
            .map(|row| {
                crate::interrupts::check();
                Ok(
                    json!({"clientId": row.get::<String>(1)?, "cursor": row.get::<i64>(2)?,
                          "updatedAtMs": row.get::<i64>(3)?}),
                )
            })
            .collect::<Result<Vec<_>>>()?;
            Ok(JsonB(Value::Array(list)))
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn list_clients(partition: Option<&str>) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        db::with_spi(|client| {
            let list = records(db::read(
                client,
                concat!(
                    "SELECT ",
                    client_columns!(),
                    " FROM syncular.sync_clients
                         WHERE partition = $1 ORDER BY updated_at_ms DESC, client_id"
                ),
                &[partition.as_str().into()],
            )?)?;
            Ok(JsonB(Value::Array(list)))
        })
    })
}

/// `min(cursor)` of the partition's clients active since `cutoff_ms` (inclusive), or NULL.
pub fn cursor_floor(
    client: &SpiClient<'_>,
    partition: &str,
    cutoff_ms: i64,
) -> Result<Option<i64>> {
    db::first::<i64>(db::read(
        client,
        "SELECT min(cursor) FROM syncular.sync_clients WHERE partition = $1 AND updated_at_ms >= $2",
        &[partition.into(), cutoff_ms.into()],
    )?)
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn active_cursor_floor(partition: Option<&str>, cutoff_ms: Option<i64>) -> Option<i64> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let cutoff = args::count("cutoff_ms", cutoff_ms)?;
        db::with_spi(|client| cursor_floor(client, &partition, cutoff))
    })
}
