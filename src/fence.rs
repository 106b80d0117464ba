//! The writer fence (docs/DESIGN.md §Writer fence): the native `BEFORE INSERT` trigger on
//! `sync_commits`, the predicate as a function, and the only API that moves a partition fence
//! (upwards).
//!
//! The predicate reads the newest *committed* fence and floor (plus this transaction's own
//! earlier writes) through a fresh `GetLatestSnapshot()`, never the writer's transaction
//! snapshot: an old writer in REPEATABLE READ or SERIALIZABLE whose snapshot predates a fence
//! must not append (upstream's PL/pgSQL trigger let it through: docs/DESIGN.md, gap B3 — old
//! writer under an old snapshot appends past a fence).

use crate::args;
use crate::db;
use crate::error::{self, Code, Error};
use crate::heap::{self, Lookup, SyncTable};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use serde_json::json;

/// The effective requirement `R(p)` = max of the defined values of `F(p)` and `G` (the marker's
/// `required_writer_version` when > 0), read with a fresh `GetLatestSnapshot()`: the newest
/// committed rows plus this transaction's own earlier commands. `None`: no barrier.
pub fn requirement(partition: &str) -> error::Result<Option<i64>> {
    // SAFETY: called inside a transaction (a trigger or SQL function); the snapshot is
    // registered before the two lookups and unregistered after them, and the keys are of the
    // primary keys' types (text under "C", int4) with their equality functions.
    let (fence, floor) = unsafe {
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        let partition_key = partition.into_datum().expect("text is never NULL here");
        let fence = heap::bigint_by_key(
            SyncTable::WriterFence,
            partition_key,
            Some(partition),
            (pg_sys::F_TEXTEQ, pg_sys::C_COLLATION_OID),
            c"required_writer_version",
            snapshot,
        );
        let (marker, equality) = heap::singleton_key();
        let floor = heap::bigint_by_key(
            SyncTable::SchemaMeta,
            marker,
            None,
            equality,
            c"required_writer_version",
            snapshot,
        );
        pg_sys::UnregisterSnapshot(snapshot);
        (fence?, floor?)
    };
    let fence = match fence {
        Lookup::Here(value, _) => value,
        // On Citus, a call on a node without the partition's shard (the coordinator): through
        // Citus, which routes the read to the shard's node (docs/SCALING.md). The fence trigger
        // itself always fires where the shard is, and reads it there.
        Lookup::Elsewhere => db::with_spi(|client| {
            db::first::<i64>(db::read(
                client,
                "SELECT f.required_writer_version FROM syncular.sync_writer_fence f
                  WHERE f.partition = $1",
                &[DatumWithOid::from(partition)],
            )?)
        })?,
    };
    let floor = match floor {
        Lookup::Here(value, _) => value,
        Lookup::Elsewhere => db::with_spi(|client| {
            db::first::<i64>(db::read(
                client,
                "SELECT m.required_writer_version FROM syncular.sync_schema_meta m WHERE m.id = 1",
                &[],
            )?)
        })?,
    };
    let floor = floor.filter(|g| *g > 0);
    Ok(match (fence, floor) {
        (Some(f), Some(g)) => Some(f.max(g)),
        (f, g) => f.or(g),
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
    )
    .with_hint(
        "this process runs an older schema version than the partition requires: stop serving \
         writes from it and run a build at the required version (docs/CLIENTS.md); the fence \
         is never lowered by a write",
    ))
}

/// `F(p) := GREATEST(F(p), v)`, creating the row; returns the new `F(p)`.
pub fn raise(
    client: &pgrx::spi::SpiClient<'_>,
    partition: &str,
    version: i64,
) -> error::Result<i64> {
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
    Ok(error::run_in_host_code(|| {
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
fn writer_fence_allows(partition: Option<&str>, writer_version: Option<i64>) -> bool {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        Ok(allows(requirement(&partition)?, writer_version))
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn raise_writer_fence(partition: Option<&str>, required_writer_version: Option<i64>) -> i64 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let version = args::count("required_writer_version", required_writer_version)?;
        let fenced = db::with_spi(|client| raise(client, &partition, version))?;
        // The upsert's own row version is not visible to a snapshot taken in the same command,
        // so combine: R(p) = max(F_new, max(F_old, G)) = max(F_new, G).
        Ok(requirement(&partition)?.map_or(fenced, |r| r.max(fenced)))
    })
}

/// Whether the fence guard is reacting to its own DDL (or an update script manages the trigger)
/// in this transaction. Read by the guard's event-trigger functions (sql/fence_guard.sql).
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular._fence_guard_busy() RETURNS boolean
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', '_fence_guard_busy_wrapper';
"#
)]
fn _fence_guard_busy() -> bool {
    crate::txn_local::get(crate::txn_local::Key::FenceGuardBusy).as_deref() == Some("on")
}

/// Sets the guard's flag for the rest of the (sub)transaction. Only the extension owner can
/// call it (no grant): a session cannot silence the guard (docs/SECURITY.md).
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular._fence_guard_hold(busy boolean) RETURNS void
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', '_fence_guard_hold_wrapper';
"#
)]
fn _fence_guard_hold(busy: Option<bool>) {
    let value = if busy == Some(true) { "on" } else { "off" };
    crate::txn_local::set(crate::txn_local::Key::FenceGuardBusy, value);
}

/// In-backend tests: each runs inside one transaction that is rolled back; scenarios that need
/// commits, several sessions or locks live in `tests/multisession`.
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use crate::testing::{bigint, COMMIT};
    use pgrx::prelude::*;

    /// The fence reads the latest committed state plus this transaction's own earlier writes.
    #[pg_test]
    fn fence_sees_the_transactions_own_raise() {
        assert_eq!(bigint("SELECT syncular.raise_writer_fence('p', 2)"), 2);
        assert_eq!(crate::fence::requirement("p").expect("lookup"), Some(2));
        assert!(!crate::fence::allows(Some(2), Some(1)));
        assert_eq!(
            bigint(&format!("SELECT syncular.append_commit('p', {COMMIT})")),
            1
        );
    }

    #[pg_test(error = "sync.storage.writer_fence_rejected")]
    fn fence_rejects_an_old_writer_in_the_same_transaction() {
        Spi::run("SELECT syncular.raise_writer_fence('p', 3)").expect("raise");
        Spi::run(&format!("SELECT syncular.append_commit('p', {COMMIT})")).expect("refused");
    }
}
