//! The stored schema version, the marker `migrate_schema` sets (docs/DESIGN.md §Schema
//! barrier): as this transaction's snapshot sees it, and as it settles once a migration in
//! flight has ended. Read by the barrier and by the push schema's codec reads, below both.

use crate::db;
use crate::error::Result;
use crate::heap;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

/// A migration holds the barrier (L0) right now: its new version is not settled yet.
pub struct InFlight;

/// The stored schema version as it settles, read with the latest snapshot whatever the caller's
/// snapshot is; `None` before the first migration. What `encode_row` and `decode_row` default
/// to (`hold`): a payload encoded in a transaction that began before a migration is encoded at
/// the version the migration committed (red team 7, R7-1); the `ROW SHARE` on `sync_partitions`
/// taken then is kept to the end of the transaction, as a push keeps its partition lock, so the
/// next migration waits for the row written with it. It is taken without waiting: a migration
/// holding the barrier is [`InFlight`] (the caller answers "again once it committed"), never
/// waited for — the caller may hold a lock on an app table that the migration's own DDL then
/// waits for, a deadlock PostgreSQL would break by aborting one of the two (red team 13, D1–D3).
/// Without `hold` (a given version: only "is it ahead?" is asked) nothing is locked.
pub fn settled_version(hold: bool) -> Result<std::result::Result<Option<i64>, InFlight>> {
    // SAFETY: `sync_partitions` is opened with `AccessShareLock` (which no barrier excludes; kept:
    // closed with NoLock) only to learn its OID and whether this transaction holds the barrier;
    // the lock is on that OID, taken for
    // the top-level transaction's resource owner, restored right after (on an error, the
    // (sub)transaction's abort resets the current owner itself); the latest snapshot is valid
    // for the lookup.
    unsafe {
        let partitions = heap::open(
            heap::SyncTable::Partitions,
            pg_sys::AccessShareLock as pg_sys::LOCKMODE,
        )?;
        let oid = (*partitions).rd_id;
        // This transaction holds the barrier itself: it is the migration (its own backfill
        // decoding with the version it set). PostgreSQL 15 refuses a conditional lock that
        // conflicts with a waiter's request even when the waiter waits for us (a second
        // migrator queued on the barrier: the adapter's migration race), so the lock is taken
        // unconditionally then — granted at once, ahead of every waiter our barrier blocks,
        // since no other transaction can hold a mode that conflicts with ROW SHARE while we
        // hold EXCLUSIVE (lock.c's ProcSleep / JoinWaitQueue: "I must go before this waiter").
        let ours = pg_sys::CheckRelationLockedByMe(
            partitions,
            pg_sys::ExclusiveLock as pg_sys::LOCKMODE,
            true,
        );
        pg_sys::table_close(partitions, pg_sys::NoLock as pg_sys::LOCKMODE);
        if hold {
            // Owned by the top-level transaction, not a subtransaction: a `ROLLBACK TO
            // SAVEPOINT` must not release it while the payload encoded under it may still be
            // written (red team 15, S2).
            let owner = pg_sys::CurrentResourceOwner;
            pg_sys::CurrentResourceOwner = pg_sys::TopTransactionResourceOwner;
            let row_share = pg_sys::RowShareLock as pg_sys::LOCKMODE;
            let locked = if ours {
                pg_sys::LockRelationOid(oid, row_share);
                true
            } else {
                pg_sys::ConditionalLockRelationOid(oid, row_share)
            };
            pg_sys::CurrentResourceOwner = owner;
            if !locked {
                return Ok(Err(InFlight));
            }
        }
        marker_in(pg_sys::GetLatestSnapshot()).map(Ok)
    }
}

/// The marker as `snapshot` sees it, read below SQL by its key (through SQL where Citus keeps
/// the table elsewhere: docs/SCALING.md).
///
/// # Safety
/// `snapshot` is valid for the duration of the call (it is registered around the lookup).
unsafe fn marker_in(snapshot: pg_sys::Snapshot) -> Result<Option<i64>> {
    // SAFETY: the caller's snapshot is registered around the lookup, whose key is the marker's
    // int4 primary key.
    unsafe {
        let snapshot = pg_sys::RegisterSnapshot(snapshot);
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

/// The stored schema version the calling statement's own snapshot sees (its active snapshot:
/// under READ COMMITTED the statement's, not a fresh one): the rows that statement hands the
/// row codec were read with it (red team 14: a statement begun before a migration committed
/// decoded the old version's payloads with the new layout). `None` without a marker, or with no
/// active snapshot.
pub fn marker_of_statement() -> Result<Option<i64>> {
    // SAFETY: the active snapshot stays valid for the duration of this call (the caller's
    // statement holds it).
    unsafe {
        if !pg_sys::ActiveSnapshotSet() {
            return Ok(None);
        }
        marker_in(pg_sys::GetActiveSnapshot())
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
