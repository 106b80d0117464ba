//! The writer fence (core-api §1): the native `BEFORE INSERT` trigger on `sync_commits`, the
//! predicate as a function, and the only API that moves a partition fence (upwards).
//!
//! The predicate reads the newest *committed* fence and floor (plus this transaction's own
//! earlier writes) through a fresh `GetLatestSnapshot()`, never the writer's transaction
//! snapshot: an old writer in REPEATABLE READ or SERIALIZABLE whose snapshot predates a fence
//! must not append (upstream's PL/pgSQL trigger let it through, gap B3).

use crate::args;
use crate::db;
use crate::error::{self, Code, Error};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use serde_json::json;
use std::cell::Cell;

/// `F(p)` and the global floor `G` (defined iff the marker exists and holds a value > 0), in one
/// statement: two primary-key lookups.
const REQUIREMENT_SQL: &str = "\
SELECT (SELECT f.required_writer_version FROM syncular.sync_writer_fence f WHERE f.partition = $1),
       (SELECT m.required_writer_version FROM syncular.sync_schema_meta m
         WHERE m.id = 1 AND m.required_writer_version > 0)";

thread_local! {
    static REQUIREMENT_PLAN: Cell<pg_sys::SPIPlanPtr> = const { Cell::new(std::ptr::null_mut()) };
}

/// The effective requirement `R(p)` = max of the defined values of `F(p)` and `G`, read with the
/// latest snapshot. `None`: no barrier for this partition.
pub fn requirement(partition: &str) -> error::Result<Option<i64>> {
    db::with_spi(|_client| unsafe {
        let mut plan = REQUIREMENT_PLAN.with(Cell::get);
        if plan.is_null() {
            let sql = std::ffi::CString::new(REQUIREMENT_SQL).expect("no NUL in SQL");
            let mut types = [pg_sys::TEXTOID];
            plan = pg_sys::SPI_prepare(sql.as_ptr(), 1, types.as_mut_ptr());
            if plan.is_null() || pg_sys::SPI_keepplan(plan) != 0 {
                return Err(Error::Internal("syncular: cannot prepare the fence lookup".into()));
            }
            REQUIREMENT_PLAN.with(|c| c.set(plan));
        }
        let key = partition.into_datum().expect("text is never NULL here");
        let mut values = [key];
        let nulls = [b' ' as std::ffi::c_char];
        let status = pg_sys::SPI_execute_snapshot(
            plan,
            values.as_mut_ptr(),
            nulls.as_ptr(),
            pg_sys::GetLatestSnapshot(),
            std::ptr::null_mut(),
            true,
            false,
            1,
        );
        if status != pg_sys::SPI_OK_SELECT as i32 || pg_sys::SPI_processed != 1 {
            return Err(Error::Internal(format!("syncular: fence lookup failed ({status})")));
        }
        let table = &*pg_sys::SPI_tuptable;
        let tuple = *table.vals;
        let column = |n: i32| -> Option<i64> {
            let mut is_null = false;
            let datum = pg_sys::SPI_getbinval(tuple, table.tupdesc, n, &mut is_null);
            (!is_null).then(|| i64::from_datum(datum, false).expect("int8 column"))
        };
        Ok(match (column(1), column(2)) {
            (Some(f), Some(g)) => Some(f.max(g)),
            (f, g) => f.or(g),
        })
    })
}

/// The fence predicate: allowed iff there is no requirement, or `w` is not NULL and `w >= R(p)`.
pub fn allows(requirement: Option<i64>, writer_version: Option<i64>) -> bool {
    match (requirement, writer_version) {
        (None, _) => true,
        (Some(required), Some(w)) => w >= required,
        (Some(_), None) => false,
    }
}

/// Refuses an append of `writer_version` to `partition` if the fence forbids it.
pub fn check(partition: &str, writer_version: Option<i64>) -> error::Result<()> {
    let required = requirement(partition)?;
    if allows(required, writer_version) {
        return Ok(());
    }
    Err(Error::new(
        Code::WriterFenceRejected,
        json!({"partition": partition, "writerVersion": writer_version, "requiredWriterVersion": required}),
    ))
}

/// `F(p) := GREATEST(F(p), v)`, creating the row; returns the new `F(p)`.
pub fn raise(client: &pgrx::spi::SpiClient<'_>, partition: &str, version: i64) -> error::Result<i64> {
    let table = db::write(
        client,
        "INSERT INTO syncular.sync_writer_fence AS f (partition, required_writer_version)
         VALUES ($1, $2)
         ON CONFLICT (partition) DO UPDATE
           SET required_writer_version =
                 GREATEST(f.required_writer_version, EXCLUDED.required_writer_version)
         RETURNING f.required_writer_version",
        &[DatumWithOid::from(partition), DatumWithOid::from(version)],
    )?;
    db::first::<i64>(table)?.ok_or_else(|| Error::Internal("fence upsert returned nothing".into()))
}

/// Fires for every row inserted into `syncular.sync_commits`, by any means.
#[pg_trigger]
fn writer_fence_trigger<'a>(
    trigger: &'a PgTrigger<'a>,
) -> std::result::Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgTriggerError> {
    Ok(error::run(|| {
        let new = trigger
            .new()
            .ok_or_else(|| Error::Internal("writer fence fired without a new row".into()))?;
        let partition: String = new.get_by_name("partition")?.unwrap_or_default();
        let writer_version: Option<i64> = new.get_by_name("writer_version")?;
        check(&partition, writer_version)?;
        Ok(Some(new))
    }))
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn writer_fence_allows(partition: Option<String>, writer_version: Option<i64>) -> bool {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        Ok(allows(requirement(&partition)?, writer_version))
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn raise_writer_fence(partition: Option<String>, required_writer_version: Option<i64>) -> i64 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let version = args::count("required_writer_version", required_writer_version)?;
        let fenced = db::with_spi(|client| raise(client, &partition, version))?;
        // The upsert's own row version is not visible to a snapshot taken in the same command,
        // so combine: R(p) = max(F_new, max(F_old, G)) = max(F_new, G).
        Ok(requirement(&partition)?.map_or(fenced, |r| r.max(fenced)))
    })
}
