//! The stored schema version, the marker `migrate_schema` sets (docs/DESIGN.md §Schema
//! barrier): as this transaction's snapshot sees it, and as it settles once a migration in
//! flight has ended. Read by the barrier and by the push schema's codec reads, below both.

use crate::db;
use crate::error::Result;
use crate::heap;
use crate::port;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use std::cell::Cell;

/// A migration holds the barrier (L0) right now: its new version is not settled yet.
pub struct InFlight;

/// The marker as the latest snapshot saw it: the stored version and the transaction that wrote
/// it (its last migration).
pub struct Settled {
    /// `None` before the first migration.
    pub version: Option<i64>,
    /// Invalid when unknown: no marker, or read through Citus from another node.
    writer: pg_sys::TransactionId,
}

thread_local! {
    /// A marker writer this backend saw committed, and the local transaction that saw it: every
    /// snapshot of a later transaction of this backend was taken after that commit.
    static SEEN_COMMITTED: Cell<(pg_sys::TransactionId, pg_sys::LocalTransactionId)> =
        const { Cell::new((pg_sys::InvalidTransactionId, 0)) };
}

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
pub fn settled_version(hold: bool) -> Result<std::result::Result<Settled, InFlight>> {
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
        let (version, writer) = marker_in(pg_sys::GetLatestSnapshot())?;
        Ok(Ok(Settled { version, writer }))
    }
}

/// Whether every snapshot this backend holds sees `settled`'s migration (red team 16, B1 and
/// B2). The checks of [`marker_of_statement`] and [`marker_seen`] ask the statement's snapshot
/// and a fresh one; a payload may also have been read through an older snapshot still held —
/// an outer statement (a `DO` block, a loop, the caller of a STABLE function), a cursor — after
/// the read's lock was given back (a rolled-back subtransaction) or before the table was locked
/// at all (a function's first read). First what is cheap and usually conclusive: a migration
/// below this backend's `xmin` (every transaction below it had ended when each snapshot it
/// holds was taken), or seen committed by an earlier transaction of this backend (whose
/// snapshots all came after). Else each snapshot a portal holds is asked — the running one,
/// the unnamed one of the client's statement, every cursor: a statement's outermost snapshot
/// is its portal's, older than any pushed inside it. Not asked: bytes a client (or a `WITH
/// HOLD` cursor) carried out of the statement that read them, and the migrating transaction's
/// own reads (docs/SECURITY.md rule 19).
pub fn seen_by_every_snapshot(client: &SpiClient<'_>, settled: &Settled) -> Result<bool> {
    let writer = settled.writer;
    if writer.into_inner() < pg_sys::TransactionId::FIRST_NORMAL.into_inner() {
        return Ok(true);
    }
    // SAFETY: reads of this transaction's state and of this backend's own proc slot; each
    // portal is looked up by name in this backend's portal table and read at once, its
    // snapshots (registered by the portal) asked only when of the MVCC kind; the writer is
    // asked only when not below `TransactionXmin`, as `XidInMVCCSnapshot` requires.
    unsafe {
        if pg_sys::TransactionIdIsCurrentTransactionId(writer) {
            return Ok(true);
        }
        let now = port::local_transaction_id();
        let (seen, when) = SEEN_COMMITTED.with(Cell::get);
        if seen == writer && when != now {
            return Ok(true);
        }
        if seen != writer {
            // The latest snapshot read the marker row this writer wrote, and it is not ours:
            // it has committed by now.
            SEEN_COMMITTED.with(|c| c.set((writer, now)));
        }
        let oldest = (*pg_sys::MyProc).xmin;
        if oldest == pg_sys::InvalidTransactionId
            || pg_sys::TransactionIdPrecedes(writer, oldest)
            || pg_sys::TransactionIdPrecedes(writer, pg_sys::TransactionXmin)
        {
            return Ok(true);
        }
        let misses = |snapshot: pg_sys::Snapshot| {
            !snapshot.is_null()
                && (*snapshot).snapshot_type == pg_sys::SnapshotType::SNAPSHOT_MVCC
                && pg_sys::XidInMVCCSnapshot(writer, snapshot)
        };
        let portal_misses = |portal: pg_sys::Portal| {
            !portal.is_null()
                && (misses((*portal).portalSnapshot)
                    || misses((*portal).holdSnapshot)
                    || (!(*portal).queryDesc.is_null() && misses((*(*portal).queryDesc).snapshot)))
        };
        if (pg_sys::ActiveSnapshotSet() && misses(pg_sys::GetActiveSnapshot()))
            || portal_misses(pg_sys::ActivePortal)
            || portal_misses(pg_sys::GetPortalByName(c"".as_ptr()))
        {
            return Ok(false);
        }
        let cursors = db::write(client, "SELECT c.name FROM pg_catalog.pg_cursors c", &[])?;
        for row in cursors {
            crate::interrupts::check();
            let Some(name) = row.get::<String>(1)? else {
                continue;
            };
            let Ok(name) = std::ffi::CString::new(name) else {
                continue;
            };
            if portal_misses(pg_sys::GetPortalByName(name.as_ptr())) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// Called by a migration once it wrote the marker: this backend's next transactions see it
/// committed (or never see it at all), whatever else still runs.
pub fn written_here() {
    // SAFETY: this (sub)transaction's id, which wrote the marker row.
    let writer = unsafe { pg_sys::GetCurrentTransactionIdIfAny() };
    SEEN_COMMITTED.with(|c| c.set((writer, port::local_transaction_id())));
}

/// The marker as `snapshot` sees it, read below SQL by its key (through SQL where Citus keeps
/// the table elsewhere: docs/SCALING.md), with the transaction that wrote the row version read
/// (invalid when read through SQL).
///
/// # Safety
/// `snapshot` is valid for the duration of the call (it is registered around the lookup).
unsafe fn marker_in(snapshot: pg_sys::Snapshot) -> Result<(Option<i64>, pg_sys::TransactionId)> {
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
            heap::Lookup::Here(version, writer) => Ok((version, writer)),
            heap::Lookup::Elsewhere => {
                Ok((db::with_spi(marker_seen)?, pg_sys::InvalidTransactionId))
            }
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
        Ok(marker_in(pg_sys::GetActiveSnapshot())?.0)
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
