//! A committing backend's side of the change feed (docs/DESIGN.md §Change feed): the heads its
//! transaction appended are kept here, dropped with a rolled-back subtransaction or transaction,
//! and copied into the mailbox only once the transaction has committed — so no listener ever
//! hears of a commit that rolled back, and the push path takes no lock but the mailbox's own
//! (no `NOTIFY`: its commit-time lock serializes every notifying commit, and every listener is
//! woken by each).

use super::mailbox;
use pgrx::pg_sys;
use std::cell::{Cell, RefCell};
use std::ffi::c_void;

/// One appended commit: the subtransaction level it was appended at, its partition and seq.
struct Pending {
    level: i32,
    partition: String,
    seq: i64,
}

thread_local! {
    static PENDING: RefCell<Vec<Pending>> = const { RefCell::new(Vec::new()) };
    static REGISTERED: Cell<bool> = const { Cell::new(false) };
}

/// After an append of `seq` to `partition`: kept for the commit, when a feed worker serves this
/// database.
pub fn appended(partition: &str, seq: i64) {
    if !super::serves_this_database() {
        return;
    }
    if !REGISTERED.get() {
        // SAFETY: registered once per backend, for its lifetime; the callbacks are `pg_guard`ed.
        unsafe {
            pg_sys::RegisterXactCallback(Some(on_xact), std::ptr::null_mut());
            pg_sys::RegisterSubXactCallback(Some(on_subxact), std::ptr::null_mut());
        }
        REGISTERED.set(true);
    }
    // SAFETY: called inside a transaction.
    let level = unsafe { pg_sys::GetCurrentTransactionNestLevel() };
    PENDING.with(|p| {
        p.borrow_mut().push(Pending {
            level,
            partition: partition.to_owned(),
            seq,
        })
    });
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_xact(event: pg_sys::XactEvent::Type, _arg: *mut c_void) {
    use pg_sys::XactEvent::*;
    match event {
        // Errors may still be raised here: coalesce to one record per partition, its highest
        // seq (a sort in place: nothing to allocate after the commit).
        XACT_EVENT_PRE_COMMIT => PENDING.with(|p| {
            let mut p = p.borrow_mut();
            p.sort_unstable_by(|a, b| a.partition.cmp(&b.partition).then(b.seq.cmp(&a.seq)));
            p.dedup_by(|later, first| later.partition == first.partition);
        }),
        // After the commit: copy into the mailbox and wake the worker, nothing that can fail.
        XACT_EVENT_COMMIT => {
            let pending = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
            if pending.is_empty() {
                return;
            }
            // SAFETY: `MyDatabaseId` is set for the life of a connected backend.
            let db = unsafe { pg_sys::MyDatabaseId }.to_u32();
            let worker = mailbox::post(db, pending.iter().map(|p| (p.partition.as_str(), p.seq)));
            if worker != 0 {
                // SAFETY: `worker` is a `PGPROC` of the shared proc array (never freed); if
                // that worker has since exited, the latch set is a spurious wake-up of
                // whichever process has the slot, which every latch user tolerates.
                unsafe {
                    let proc = worker as *mut pg_sys::PGPROC;
                    pg_sys::SetLatch(&raw mut (*proc).procLatch);
                }
            }
        }
        XACT_EVENT_ABORT | XACT_EVENT_PREPARE => {
            PENDING.with(|p| drop(std::mem::take(&mut *p.borrow_mut())));
        }
        // A prepared transaction commits later, perhaps in another session, where nothing
        // would announce it: refused, as PostgreSQL refuses PREPARE after NOTIFY.
        XACT_EVENT_PRE_PREPARE if PENDING.with(|p| !p.borrow().is_empty()) => {
            let report = pgrx::pg_sys::panic::ErrorReport::new(
                pgrx::PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
                "cannot PREPARE a transaction that appended a commit while the change feed runs",
                "syncular::feed",
            )
            .set_hint(
                "syncular.feed_database names this database: commit the transaction instead \
                     (docs/API.md, \"Change feed\")",
            );
            report.report(pgrx::PgLogLevel::ERROR);
        }
        _ => {}
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_subxact(
    event: pg_sys::SubXactEvent::Type,
    _sub: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _arg: *mut c_void,
) {
    use pg_sys::SubXactEvent::*;
    // SAFETY: called while the ending subtransaction is still the current one.
    let level = unsafe { pg_sys::GetCurrentTransactionNestLevel() };
    match event {
        // Its appends rolled back: never announced.
        SUBXACT_EVENT_ABORT_SUB => {
            PENDING.with(|p| p.borrow_mut().retain(|p| p.level < level));
        }
        // Its appends now belong to the parent.
        SUBXACT_EVENT_COMMIT_SUB => PENDING.with(|p| {
            for p in p.borrow_mut().iter_mut().filter(|p| p.level >= level) {
                p.level = level - 1;
            }
        }),
        _ => {}
    }
}
