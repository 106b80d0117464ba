//! The stored schema version, the marker `migrate_schema` sets (docs/DESIGN.md §Schema
//! barrier): as this transaction's snapshot sees it, and as it settles once a migration in
//! flight has ended. Read by the barrier and by the push schema's codec reads, below both.

use crate::db;
use crate::error::Result;
use crate::heap;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

/// The stored schema version as it settles: after a migration in flight has ended (it holds L0,
/// `EXCLUSIVE` on `sync_partitions`, which the `ROW SHARE` taken here waits for and then keeps
/// to the end of the transaction, as a push keeps its partition lock), read with the latest
/// snapshot, whatever the caller's snapshot is. What `encode_row` and `decode_row` default to:
/// a payload encoded in a transaction that began before a migration, or while it ran, is
/// encoded at the version the migration committed (red team 7, R7-1); `None` before the first
/// migration.
pub fn settled_version() -> Result<Option<i64>> {
    // SAFETY: the relation is opened with its lock (kept: closed with NoLock) and closed here;
    // the snapshot is registered around the lookup, whose key is the marker's int4 primary key.
    unsafe {
        let lock = pg_sys::RowShareLock as pg_sys::LOCKMODE;
        let partitions = heap::open(heap::SyncTable::Partitions, lock)?;
        pg_sys::table_close(partitions, pg_sys::NoLock as pg_sys::LOCKMODE);
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        let marker = heap::bigint_by_key(
            heap::SyncTable::SchemaMeta,
            pg_sys::Datum::from(1i32),
            None,
            (pg_sys::F_INT4EQ, pg_sys::InvalidOid),
            c"schema_version",
            snapshot,
        );
        pg_sys::UnregisterSnapshot(snapshot);
        match marker? {
            heap::Lookup::Here(version) => Ok(version),
            heap::Lookup::Elsewhere => db::with_spi(marker_seen),
        }
    }
}

/// The stored schema version this transaction's snapshot sees (a fresh one under READ
/// COMMITTED).
pub fn marker_seen(client: &SpiClient<'_>) -> Result<Option<i64>> {
    db::first::<i64>(db::write(
        client,
        "SELECT m.schema_version FROM syncular.sync_schema_meta m WHERE m.id = 1",
        &[],
    )?)
}
