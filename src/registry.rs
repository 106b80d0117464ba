//! The partition registry and the request entry (docs/DESIGN.md §Registry and request entry):
//! the log epoch (generation of a partition's log) and the one-call entry step `serve_entry` =
//! touch + gate.

use crate::args;
use crate::db;
use crate::error::{self, Result};
use crate::gate;
use crate::log;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiHeapTupleData, SpiTupleTable};
use pgrx::JsonB;
use serde_json::{json, Value};

macro_rules! entry_columns {
    () => {
        "partition, log_epoch, epoch_required, last_authenticated_at_ms"
    };
}

/// The registry entry object `{"partition", "logEpoch", "epochRequired",
/// "lastAuthenticatedAtMs"}` of a row whose first columns are [`entry_columns!`].
pub fn entry(row: &SpiHeapTupleData<'_>) -> Result<Value> {
    Ok(json!({
        "partition": row.get::<String>(1)?,
        "logEpoch": row.get::<String>(2)?,
        "epochRequired": row.get::<bool>(3)?,
        "lastAuthenticatedAtMs": row.get::<i64>(4)?,
    }))
}

/// Registry entry objects ([`entry`]) of every row.
fn entries(table: SpiTupleTable<'_>) -> Result<Vec<Value>> {
    table
        .map(|row| {
            crate::interrupts::check();
            entry(&row)
        })
        .collect()
}

/// The registry entry of a one-row result of [`entry_columns!`], or JSON null.
pub fn single(table: SpiTupleTable<'_>) -> Result<Value> {
    Ok(entries(table)?.into_iter().next().unwrap_or(Value::Null))
}

/// Inserts the registry row (keeping an existing epoch) and stamps the authentication time.
fn touch(
    client: &SpiClient<'_>,
    partition: &str,
    now_ms: i64,
    initial_epoch: &str,
) -> Result<Value> {
    single(db::write(
        client,
        concat!(
            "INSERT INTO syncular.sync_partition_registry AS r
               (partition, log_epoch, epoch_required, last_authenticated_at_ms)
             VALUES ($1, $3, false, $2)
             ON CONFLICT (partition) DO UPDATE
               SET last_authenticated_at_ms = EXCLUDED.last_authenticated_at_ms
             RETURNING ",
            entry_columns!()
        ),
        &[
            DatumWithOid::from(partition),
            DatumWithOid::from(now_ms),
            DatumWithOid::from(initial_epoch),
        ],
    )?)
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn touch_partition(
    partition: Option<&str>,
    now_ms: Option<i64>,
    initial_log_epoch: Option<&str>,
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let now_ms = args::count("now_ms", now_ms)?;
        let epoch = args::text("initial_log_epoch", initial_log_epoch)?;
        db::with_spi(|client| touch(client, &partition, now_ms, &epoch)).map(JsonB)
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn serve_entry(
    partition: Option<&str>,
    now_ms: Option<i64>,
    initial_log_epoch: Option<&str>,
    running_schema_version: Option<i64>,
    declared: default!(Option<args::JsonArg>, "'[]'"),
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let now_ms = args::count("now_ms", now_ms)?;
        let epoch = args::text("initial_log_epoch", initial_log_epoch)?;
        let running = args::count("running_schema_version", running_schema_version)?;
        let declared = args::declarations(declared)?;
        db::with_spi(|client| {
            let registry = touch(client, &partition, now_ms, &epoch)?;
            // A refusal aborts the call, and the touch with it.
            let gate = gate::read_state(client, Some(&partition), running, true)?
                .assert_ready(running, &declared)?;
            Ok(JsonB(json!({"registry": registry, "gate": gate})))
        })
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn rotate_log_epoch(
    partition: Option<&str>,
    log_epoch: Option<&str>,
    now_ms: Option<i64>,
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let epoch = args::text("log_epoch", log_epoch)?;
        let now_ms = args::count("now_ms", now_ms)?;
        db::with_spi(|client| {
            log::lock(client, &partition)?;
            let entry = single(db::write(
                client,
                concat!(
                    "INSERT INTO syncular.sync_partition_registry
                       (partition, log_epoch, epoch_required, last_authenticated_at_ms)
                     VALUES ($1, $2, true, $3)
                     ON CONFLICT (partition) DO UPDATE
                       SET log_epoch = EXCLUDED.log_epoch, epoch_required = true,
                           last_authenticated_at_ms = EXCLUDED.last_authenticated_at_ms
                     RETURNING ",
                    entry_columns!()
                ),
                &[
                    DatumWithOid::from(partition.as_str()),
                    DatumWithOid::from(epoch.as_str()),
                    DatumWithOid::from(now_ms),
                ],
            )?)?;
            // Cursors of the old generation mean nothing in the new one.
            db::write(
                client,
                "DELETE FROM syncular.sync_clients WHERE partition = $1",
                &[DatumWithOid::from(partition.as_str())],
            )?;
            Ok(JsonB(entry))
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn get_log_epoch(partition: Option<&str>) -> Option<String> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        db::with_spi(|client| {
            db::first::<String>(db::read(
                client,
                "SELECT log_epoch FROM syncular.sync_partition_registry WHERE partition = $1",
                &[DatumWithOid::from(partition.as_str())],
            )?)
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn list_partition_registry() -> JsonB {
    error::run(|| {
        db::with_spi(|client| {
            entries(db::read(
                client,
                concat!(
                    "SELECT ",
                    entry_columns!(),
                    " FROM syncular.sync_partition_registry ORDER BY partition"
                ),
                &[],
            )?)
        })
        .map(|list| JsonB(Value::Array(list)))
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn list_partitions() -> Vec<String> {
    error::run(|| {
        db::with_spi(|client| {
            db::texts(db::read(
                client,
                "SELECT partition FROM syncular.sync_partition_registry ORDER BY partition",
                &[],
            )?)
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn partition_state(partition: Option<&str>) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        db::with_spi(|client| {
            let table = db::read(
                client,
                "SELECT coalesce(p.max_commit_seq, 0), coalesce(p.horizon_seq, 0),
                        r.log_epoch, coalesce(r.epoch_required, false)
                   FROM (SELECT 1) AS one
                   LEFT JOIN syncular.sync_partitions p ON p.partition = $1
                   LEFT JOIN syncular.sync_partition_registry r ON r.partition = $1",
                &[DatumWithOid::from(partition.as_str())],
            )?;
            let row = table.first();
            Ok(JsonB(json!({
                "maxCommitSeq": row.get::<i64>(1)?,
                "horizonSeq": row.get::<i64>(2)?,
                "logEpoch": row.get::<String>(3)?,
                "epochRequired": row.get::<bool>(4)?,
            })))
        })
    })
}
