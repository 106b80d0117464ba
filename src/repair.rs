//! Owner-only repairs: the way back from a schema marker or writer fence set too high.
//!
//! The API only ever raises the schema marker (`migrate_schema`), the global writer floor and a
//! partition's fence (`raise_writer_fence`, `declare_checkpoint`), because lowering any of them
//! would let an old writer append again. A mistaken or hostile `migrate_schema(2^53 - 1)` or
//! `raise_writer_fence(p, 2^53 - 1)` would then lock every host out for good. These two
//! functions lower them again, for the extension owner or a superuser only (no grant, and
//! checked inside), each leaving a row in `sync_repairs`: who, when, before, after, and why.
//! docs/SECURITY.md, "Repairs", says when to use them.

use crate::access;
use crate::args;
use crate::db;
use crate::error::{self, Error, Result};
use crate::log;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use pgrx::JsonB;
use serde_json::{json, Value};

/// A repair's reason: required, at most this many bytes.
const REASON_MAX: usize = 1024;

fn reason(value: Option<&str>) -> Result<String> {
    let reason = args::text("reason", value)?;
    if reason.len() > REASON_MAX {
        return Err(Error::invalid_argument("reason", "too_large"));
    }
    Ok(reason)
}

/// A target below or at `current`: a repair only lowers.
fn lowered(argument: &str, target: i64, current: i64) -> Result<i64> {
    if target > current {
        return Err(
            Error::invalid_argument(argument, "range").with_hint(format!(
                "a repair only lowers: the current value is {current}"
            )),
        );
    }
    Ok(target)
}

/// One row of `sync_repairs`, for a repair made by `caller`.
fn audit(
    client: &SpiClient<'_>,
    caller: pg_sys::Oid,
    action: &str,
    partition: Option<&str>,
    before: &Value,
    after: &Value,
    reason: &str,
) -> Result<()> {
    db::write(
        client,
        "INSERT INTO syncular.sync_repairs
           (repaired_at, session_role, acting_role, action, partition, before, after, reason)
         SELECT pg_catalog.clock_timestamp(), pg_catalog.session_user(), r.rolname,
                $1, $2, $3, $4, $5
           FROM pg_catalog.pg_roles r WHERE r.oid = $6",
        &[
            DatumWithOid::from(action),
            DatumWithOid::from(partition),
            DatumWithOid::from(JsonB(before.clone())),
            DatumWithOid::from(JsonB(after.clone())),
            DatumWithOid::from(reason),
            DatumWithOid::from(caller),
        ],
    )?;
    Ok(())
}

#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.repair_schema_marker(schema_version bigint, writer_floor bigint, reason text)
RETURNS jsonb VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'repair_schema_marker_wrapper';
"#
)]
fn repair_schema_marker(
    schema_version: Option<i64>,
    writer_floor: Option<i64>,
    reason: Option<&str>,
) -> JsonB {
    error::run(|| {
        let version = args::at_least("schema_version", schema_version, 1)?;
        let floor = args::count("writer_floor", writer_floor)?;
        let reason = self::reason(reason)?;
        let caller = access::current_role();
        db::with_spi(|client| {
            access::require_operator("schema_version")?;
            access::as_extension_owner(|| {
                // The barrier lock of migrate_schema: no migration or append runs meanwhile.
                db::lock_barrier(client)?;
                let stored = db::write(
                    client,
                    "SELECT schema_version, required_writer_version FROM syncular.sync_schema_meta
                      WHERE id = 1 FOR UPDATE",
                    &[],
                )?;
                if stored.is_empty() {
                    return Err(Error::invalid_argument("schema_version", "missing")
                        .with_hint("no schema marker is stored"));
                }
                let row = stored.first();
                let (old_version, old_floor) = (
                    row.get::<i64>(1)?.unwrap_or_default(),
                    row.get::<i64>(2)?.unwrap_or_default(),
                );
                let version = lowered("schema_version", version, old_version)?;
                let floor = lowered("writer_floor", floor, old_floor)?;
                // The marker's trigger records this transaction as its writer
                // (src/schema/stamp.rs).
                db::write(
                    client,
                    "UPDATE syncular.sync_schema_meta
                        SET schema_version = $1, required_writer_version = $2 WHERE id = 1",
                    &[DatumWithOid::from(version), DatumWithOid::from(floor)],
                )?;
                if crate::schema::evolution::installed() {
                    crate::schema::stamp::require_stamped()?;
                }
                crate::schema::marker::written_here();
                let before = json!({"schemaVersion": old_version, "writerFloor": old_floor});
                let after = json!({"schemaVersion": version, "writerFloor": floor});
                audit(
                    client,
                    caller,
                    "schema_marker",
                    None,
                    &before,
                    &after,
                    &reason,
                )?;
                Ok(JsonB(json!({"before": before, "after": after})))
            })
        })
    })
}

#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.repair_writer_fence("partition" text, required_writer_version bigint, reason text)
RETURNS jsonb VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'repair_writer_fence_wrapper';
"#
)]
fn repair_writer_fence(
    partition: Option<&str>,
    required_writer_version: Option<i64>,
    reason: Option<&str>,
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let version = args::count("required_writer_version", required_writer_version)?;
        let reason = self::reason(reason)?;
        let caller = access::current_role();
        db::with_spi(|client| {
            access::require_operator("partition")?;
            access::as_extension_owner(|| {
                // The partition lock: appenders of this partition wait for the repair.
                log::lock(client, &partition)?;
                let current = db::first::<i64>(db::write(
                    client,
                    "SELECT required_writer_version FROM syncular.sync_writer_fence
                      WHERE partition = $1 FOR UPDATE",
                    &[DatumWithOid::from(partition.as_str())],
                )?)?
                .ok_or_else(|| {
                    Error::invalid_argument("partition", "missing")
                        .with_hint("the partition has no writer fence")
                })?;
                let version = lowered("required_writer_version", version, current)?;
                db::write(
                    client,
                    "UPDATE syncular.sync_writer_fence SET required_writer_version = $2
                      WHERE partition = $1",
                    &[
                        DatumWithOid::from(partition.as_str()),
                        DatumWithOid::from(version),
                    ],
                )?;
                let before = json!({"requiredWriterVersion": current});
                let after = json!({"requiredWriterVersion": version});
                audit(
                    client,
                    caller,
                    "writer_fence",
                    Some(&partition),
                    &before,
                    &after,
                    &reason,
                )?;
                Ok(JsonB(json!({"before": before, "after": after})))
            })
        })
    })
}
