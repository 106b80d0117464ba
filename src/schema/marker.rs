//! The stored schema version, the marker `migrate_schema` sets (docs/DESIGN.md §Schema
//! barrier): as this transaction's snapshot sees it, and as it settles once a migration in
//! flight has ended. Read by the barrier and by the push schema's codec reads, below both.

use crate::db;
use crate::error::Result;
use crate::heap;
use crate::port;
use crate::schema::executor_snapshots;
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
    /// The full id of the top-level transaction that wrote this row version, as its stamp
    /// recorded it (`written_by`, [`super::stamp::schema_marker_stamp`]): unlike the row
    /// version's `xmin`, never frozen. `None` when the install is not updated yet, or the record is not this row
    /// version's (written with the stamp bypassed).
    written_by: Option<u64>,
    /// The full id of the (sub)transaction that wrote this row version (`written_in`): the row
    /// version's writer, which it ties to `written_by` when the write ran in a subtransaction
    /// (red team 22). `None` as `written_by`.
    written_in: Option<u64>,
}

thread_local! {
    /// A marker writer this backend saw committed, and the local transaction that saw it: every
    /// snapshot of a later transaction of this backend was taken after that commit.
    static SEEN_COMMITTED: Cell<(pg_sys::TransactionId, pg_sys::LocalTransactionId)> =
        const { Cell::new((pg_sys::InvalidTransactionId, 0)) };
    /// The marker row version's writer (full id) and its top-level transaction, as `pg_subtrans`
    /// told this backend once it could (red team 22): a parent never changes, and the entry is
    /// gone once the id falls behind every running transaction's `xmin`.
    static TOP_LEVEL_OF: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// The top-level transaction (full id) of `writer`, the marker row version's committed writer:
/// the recorded one (`written_by`) when the marker says this row version was written by it or
/// in one of its subtransactions (`written_in`), else looked up in `pg_subtrans` — only while
/// this transaction is known to keep the entry (`writer` not older than `TransactionXmin`), as
/// PostgreSQL's own `XidInMVCCSnapshot` asks — and kept for this backend; `None` when it cannot
/// be told. An id without a parent entry is its own top level (a primary records every
/// subtransaction's parent; a standby those of the transactions whose list overflowed, the
/// only ones missing from its snapshots).
fn top_level_of(
    next: u64,
    writer: u64,
    recorded: Option<u64>,
    written_in: Option<u64>,
) -> Option<u64> {
    // The marker's own record: this row version was written in `written_in`, a
    // (sub)transaction of `written_by` (`recorded`, [`super::stamp::schema_marker_stamp`]).
    if recorded.is_some() && (recorded == Some(writer) || written_in == Some(writer)) {
        return recorded;
    }
    let (known, top) = TOP_LEVEL_OF.with(Cell::get);
    if known == writer && writer != 0 {
        return Some(top);
    }
    let low = pg_sys::TransactionId::from(writer as u32);
    // SAFETY: reads of this transaction's `TransactionXmin` and, for an id not older, of
    // `pg_subtrans`, which keeps every id from there on.
    let top = unsafe {
        let kept_from = pg_sys::TransactionXmin;
        if kept_from.into_inner() < pg_sys::TransactionId::FIRST_NORMAL.into_inner()
            || port::transaction_id_precedes(low, kept_from)
        {
            return None;
        }
        let top = pg_sys::SubTransGetTopmostTransaction(low);
        let full = port::widen_transaction_id(next, top);
        // The walk stops at the first parent older than `TransactionXmin`: a top level only
        // when it is the recorded one (else an intermediate subtransaction, perhaps).
        if port::transaction_id_precedes(top, kept_from) && recorded != Some(full) {
            return None;
        }
        full
    };
    TOP_LEVEL_OF.with(|c| c.set((writer, top)));
    Some(top)
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
        let latest = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        // 0.2.0's columns: a 0.1.0 install not updated yet has none.
        let read = if crate::schema::evolution::installed() {
            marker_with_writers(latest)
        } else {
            marker_in(latest).map(|(version, writer)| Settled {
                version,
                writer,
                written_by: None,
                written_in: None,
            })
        };
        pg_sys::UnregisterSnapshot(latest);
        Ok(Ok(read?))
    }
}

/// What [`seen_by_every_snapshot`] found.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Seen {
    /// Every snapshot this backend holds sees the migration.
    Yes,
    /// One does not.
    No,
    /// Not proven, for the reason given.
    Unproven(Unproven),
}

/// Why [`Seen::Unproven`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Unproven {
    /// The snapshots recorded cannot tell: a subtransaction of the migration, while a
    /// transaction with more than 64 subtransactions ran, asked too long after
    /// (src/schema/executor_snapshots.rs).
    Recorded,
    /// The transaction's snapshots span more than 2^30 transaction ids.
    Span,
    /// Nothing was recorded (the transaction that loaded the library), and PostgreSQL 18 does
    /// not show the active stack below its top.
    Loading,
    /// The row version is frozen and carries no record of its writer: written with its stamp
    /// bypassed (its triggers and their guard disabled, or before the install was updated), at
    /// a time nothing tells.
    Unstamped,
}

/// Whether every snapshot this transaction read through sees `settled`'s migration (red teams
/// 16 to 18, docs/SECURITY.md rule 19). The checks of [`marker_of_statement`] and
/// [`marker_seen`] ask the statement's snapshot and a fresh one; a payload may also have been
/// read through an older snapshot — an outer statement (a `DO` block, a loop, an `INSERT …
/// SELECT`, the caller of a STABLE function), a cursor, a deferred trigger's query, a function
/// run while a statement is planned — after the read's lock was given back (a rolled-back
/// subtransaction) or before the table was locked at all (a first read after the migration).
/// First what is cheap and conclusive: the migration is this transaction's own, or an earlier
/// transaction of this backend saw it committed (every snapshot of this one came after). Then,
/// where every executor of this transaction ran with the library loaded, the earliest snapshot
/// any of them started with ([`executor_snapshots`]) — exact, whether or not that snapshot is
/// still held. Only in the transaction that loaded the library, what is still held is asked:
/// the backend's `xmin`, the active snapshot, the running and the client's portal's, every
/// registered one, and on PostgreSQL 15 the bottom of the active stack; on 18, past those, the
/// answer is "not proven" unless the client's statement holds the bottom of the stack (a
/// migration first waits a little for older transactions, [`wait_for_older_transactions`], so
/// that this is rare). Not asked: bytes a client (or a `WITH HOLD` cursor) carried out of the
/// transaction that read them, and the migrating transaction's own reads.
pub fn seen_by_every_snapshot(settled: &Settled) -> Seen {
    // SAFETY: a read of the shared next transaction id.
    let next = unsafe { pg_sys::ReadNextFullTransactionId() }.value;
    // What the marker recorded of its writer, where it can be (a restore from another cluster
    // carries a foreign id, past this one's next); it stays true when the row version is frozen.
    let recorded = settled.written_by.filter(|full| *full < next);
    let frozen = settled.writer == pg_sys::FrozenTransactionId;
    if frozen && recorded.is_none() {
        // Neither the row version nor a record names the writer (red team 24, F1).
        return Seen::Unproven(Unproven::Unstamped);
    }
    let normal = pg_sys::TransactionId::FIRST_NORMAL.into_inner();
    // Where every executor and utility statement of this transaction ran with the hooks: the
    // earliest snapshot it read through must see both the row version's writer (perhaps a
    // subtransaction of the migration, red team 20) and the recorded one — exact, frozen or
    // not (red team 19), held or not (red team 18).
    // The recorded id is a top-level one; the row version's writer is asked by its top-level
    // transaction where that can be told (a subtransaction, the migration having run in a
    // savepoint, is seen exactly when its top-level transaction is).
    let mut writers = Vec::with_capacity(2);
    if settled.writer.into_inner() >= normal {
        let writer = port::widen_transaction_id(next, settled.writer);
        writers.push(
            match top_level_of(next, writer, recorded, settled.written_in) {
                Some(top) => (top, true),
                None => (writer, false),
            },
        );
    }
    writers.extend(recorded.map(|full| (full, true)));
    // SAFETY: reads of this transaction's own state.
    let ours = unsafe {
        (settled.writer.into_inner() >= normal
            && pg_sys::TransactionIdIsCurrentTransactionId(settled.writer))
            || recorded == Some(pg_sys::GetTopFullTransactionIdIfAny().value)
    };
    if ours {
        return Seen::Yes;
    }
    if executor_snapshots::covered() && !writers.is_empty() {
        match executor_snapshots::earliest_sees(&writers) {
            executor_snapshots::Earliest::Sees => return Seen::Yes,
            executor_snapshots::Earliest::Misses => return Seen::No,
            executor_snapshots::Earliest::Unknown => return Seen::Unproven(Unproven::Recorded),
            executor_snapshots::Earliest::Unordered => return Seen::Unproven(Unproven::Span),
            // Nothing recorded (a read no hook saw?): the older checks.
            executor_snapshots::Earliest::Unrecorded => {}
        }
    }
    // A frozen row version no longer names its writer; `written_by` still does (red team 19).
    let writer = match recorded {
        Some(full) if frozen => {
            if next - full >= 1 << 31 {
                // Older than any snapshot that can still be asked.
                return Seen::Yes;
            }
            pg_sys::TransactionId::from(full as u32)
        }
        _ => settled.writer,
    };
    if writer.into_inner() < pg_sys::TransactionId::FIRST_NORMAL.into_inner() {
        return Seen::Yes;
    }
    // SAFETY: reads of this transaction's state and of this backend's own proc slot; each
    // portal is looked up by name in this backend's portal table and read at once, its
    // snapshots (registered by the portal) asked only when of the MVCC kind; the writer is
    // asked only when not below `TransactionXmin`, as `XidInMVCCSnapshot` requires.
    unsafe {
        if pg_sys::TransactionIdIsCurrentTransactionId(writer) {
            return Seen::Yes;
        }
        let now = port::local_transaction_id();
        let (seen, when) = SEEN_COMMITTED.with(Cell::get);
        if seen == writer && when != now {
            return Seen::Yes;
        }
        if seen != writer {
            // The latest snapshot read the marker row this writer wrote, and it is not ours:
            // it has committed by now.
            SEEN_COMMITTED.with(|c| c.set((writer, now)));
        }
        // This transaction loaded the library (what ran before it was not seen), or the marker
        // does not name its writer (set by an older version): only the snapshots still held can
        // be asked (red team 18's F1 and F2 are possible here, and only here: docs/SECURITY.md
        // rule 19).
        let oldest = (*pg_sys::MyProc).xmin;
        if oldest == pg_sys::InvalidTransactionId
            || pg_sys::TransactionIdPrecedes(writer, oldest)
            || pg_sys::TransactionIdPrecedes(writer, pg_sys::TransactionXmin)
        {
            return Seen::Yes;
        }
        // The catalog's own snapshot reads no payload, and may be older than the rest.
        pg_sys::InvalidateCatalogSnapshot();
        let misses = |snapshot: pg_sys::Snapshot| {
            if snapshot.is_null()
                || (*snapshot).snapshot_type != pg_sys::SnapshotType::SNAPSHOT_MVCC
            {
                return false;
            }
            pg_sys::XidInMVCCSnapshot(writer, snapshot)
        };
        // The active snapshot, the running portal's and the client statement's (a utility
        // statement's — a `DO` block, a `CALL` — is on the active stack only), then every
        // registered one: each running executor's, each cursor's, a REPEATABLE READ
        // transaction's.
        let client = pg_sys::GetPortalByName(c"".as_ptr());
        let portals = [pg_sys::ActivePortal, client];
        let active = pg_sys::ActiveSnapshotSet().then(|| pg_sys::GetActiveSnapshot());
        if active.is_some_and(misses)
            || portals.into_iter().any(|portal| {
                !portal.is_null()
                    && (misses((*portal).portalSnapshot)
                        || misses((*portal).holdSnapshot)
                        || (!(*portal).queryDesc.is_null()
                            && misses((*(*portal).queryDesc).snapshot)))
            })
            || !port::each_registered_snapshot(|snapshot| !misses(snapshot))
        {
            return Seen::No;
        }
        // Below the top, the active stack is PostgreSQL's own: on 15 its oldest is asked. On 18
        // it cannot be, and snapshots live there that nothing else holds (one pushed to plan a
        // statement, to fire deferred triggers, by a plain DML statement): no test of `xmin`s
        // tells them apart (red team 17: the transaction's own id holds every snapshot's `xmin`
        // at one value). What is known there: while the client's statement (the unnamed
        // portal) runs holding a snapshot of its own — a query's, a DO block's or CALL's, a
        // data-modifying one's — that snapshot is the bottom of the stack, and whatever is
        // pushed above it is newer or registered (asked above) — unless the unnamed portal is
        // itself run nested, fetched through a refcursor from inside a named protocol portal
        // (red team 18, F1: a known gap, docs/SECURITY.md rule 19). Else: "not proven".
        match port::oldest_active_snapshot() {
            Some(oldest_active) if misses(oldest_active) => Seen::No,
            Some(_) => Seen::Yes,
            None if !client.is_null()
                && (*client).status == pg_sys::PortalStatus::PORTAL_ACTIVE
                && !((*client).portalSnapshot.is_null()
                    && (*client).holdSnapshot.is_null()
                    && (*client).queryDesc.is_null()) =>
            {
                Seen::Yes
            }
            None => Seen::Unproven(Unproven::Loading),
        }
    }
}

/// How long a migration waits at most, before its first lock, for the transactions older than
/// it to end ([`wait_for_older_transactions`]).
const OLDER_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Called by a migration before its first lock on PostgreSQL 18: takes this transaction's id and waits until no
/// transaction with a lower one still runs — in any database: transaction ids and snapshots are
/// the cluster's —, [`OLDER_WAIT`] at most. Once none does, every snapshot taken after the
/// migration commits has its `xmin` above the migration, so the cheap test of
/// [`seen_by_every_snapshot`] settles every call that does not hold an older snapshot; one
/// still running after the wait (an idle session in a transaction, a long batch) only makes a
/// backend's first default-version codec call answer "not proven" on PostgreSQL 18 until it
/// ends or that backend runs the call again. Before any lock of ours: nothing of the app's
/// waits for us meanwhile (but what this transaction's own earlier statements locked).
pub fn wait_for_older_transactions() {
    let started = std::time::Instant::now();
    // SAFETY: this transaction's id (assigned here if it has none yet); a fresh snapshot's
    // `xmin` read while it is valid, before the next is taken; the wait is on this backend's own
    // latch.
    unsafe {
        let ours = pg_sys::GetTopTransactionId();
        loop {
            crate::interrupts::check();
            // The snapshot's `xmin` is the oldest transaction id still running (`xip` lists
            // only those below `xmax`: one that took its id after the last commit is not in it,
            // red team 22).
            let snapshot = pg_sys::GetLatestSnapshot();
            let older = pg_sys::TransactionIdPrecedes((*snapshot).xmin, ours);
            if !older || started.elapsed() >= OLDER_WAIT {
                return;
            }
            pg_sys::WaitLatch(
                pg_sys::MyLatch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                1,
                pg_sys::PG_WAIT_EXTENSION,
            );
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
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
        let marker = singleton(heap::SyncTable::SchemaMeta, [c"schema_version"], snapshot);
        pg_sys::UnregisterSnapshot(snapshot);
        match marker? {
            heap::Lookup::Here([version], writer) => Ok((version, writer)),
            heap::Lookup::Elsewhere => {
                Ok((db::with_spi(marker_seen)?, pg_sys::InvalidTransactionId))
            }
        }
    }
}

/// The bigint `columns` of the one row of `table` — the marker, or the stamp it keeps
/// (`sync_schema_stamp`): both singletons whose int4 primary key is 1 — read below SQL by that
/// key.
///
/// # Safety
/// `snapshot` is registered.
pub(super) unsafe fn singleton<const N: usize>(
    table: heap::SyncTable,
    columns: [&std::ffi::CStr; N],
    snapshot: pg_sys::Snapshot,
) -> Result<heap::Lookup<[Option<i64>; N]>> {
    // SAFETY: the caller's registered snapshot; the key is a datum of the primary key's type.
    unsafe {
        let (key, equality) = heap::singleton_key();
        heap::bigints_by_key(table, key, None, equality, columns, snapshot)
    }
}

/// The marker as `snapshot` sees it with what it recorded of its writer (`written_by`,
/// `written_in`), in one lookup below SQL; through SQL where Citus keeps the table elsewhere
/// (nothing recorded is known then).
///
/// # Safety
/// `snapshot` is registered.
unsafe fn marker_with_writers(snapshot: pg_sys::Snapshot) -> Result<Settled> {
    // SAFETY: the caller's registered snapshot; the key is the marker's int4 primary key.
    let read = unsafe {
        singleton(
            heap::SyncTable::SchemaMeta,
            [c"schema_version", c"written_by", c"written_in", c"stamp"],
            snapshot,
        )
    };
    Ok(match read? {
        heap::Lookup::Here([version, written_by, written_in, stamp], writer) => {
            // The record is this row version's when its stamp is this database's last (no dump
            // carries `sync_schema_stamp`) and it names the row version's writer, or the row is
            // frozen ([`super::stamp::schema_marker_stamp`]). A row written with the stamp
            // bypassed — a restore with triggers disabled carrying another database's record,
            // whose ids name other transactions here (red teams 23 to 25) — is asked by its
            // own writer.
            // SAFETY: a read of the shared next transaction id; the stamp is read as the marker
            // was, under the caller's registered snapshot, by its int4 primary key.
            let (next, last) = unsafe {
                (
                    pg_sys::ReadNextFullTransactionId().value,
                    singleton(heap::SyncTable::SchemaStamp, [c"stamp"], snapshot)?,
                )
            };
            let last = match last {
                heap::Lookup::Here([last], _) => last,
                heap::Lookup::Elsewhere => None,
            };
            let ours = stamp.is_some()
                && stamp == last
                && (writer == pg_sys::FrozenTransactionId
                    || (writer.into_inner() >= pg_sys::TransactionId::FIRST_NORMAL.into_inner()
                        && written_in.and_then(|id| u64::try_from(id).ok())
                            == Some(port::widen_transaction_id(next, writer))));
            let full = |id: Option<i64>| id.filter(|_| ours).and_then(|id| u64::try_from(id).ok());
            Settled {
                version,
                writer,
                written_by: full(written_by),
                written_in: full(written_in),
            }
        }
        heap::Lookup::Elsewhere => Settled {
            version: db::with_spi(marker_seen)?,
            writer: pg_sys::InvalidTransactionId,
            written_by: None,
            written_in: None,
        },
    })
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
