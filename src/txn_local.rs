//! Transaction-local state that only this extension's code can set.
//!
//! Two pieces of control state live for one transaction: the schema a migration started from
//! (`previous_schema()`) and the fence guard's "busy" flag (sql/fence_guard.sql). They used to be
//! custom settings (`set_config(…, true)`), which any session can set too: `SET
//! syncular.fence_guard_busy = on` silenced the fence guard, and a forged
//! `syncular.previous_schema` misled a migrating host. Here they are backend memory with the
//! same lifetime rules as a transaction-local setting, and no SQL path writes them except the
//! functions that own them (see docs/SECURITY.md).
//!
//! Lifetime: a value belongs to the subtransaction that set it. Committing a subtransaction
//! hands its values to the parent; aborting one drops the values it and its children set (the
//! value before it shows again); the end of the top-level transaction drops everything.
//! Subtransaction ids grow as subtransactions start, so "set in S or below" is `subid >= S`.

use pgrx::pg_sys;
use std::cell::{Cell, RefCell};

/// The keys, one per piece of state.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Key {
    PreviousSchema,
    FenceGuardBusy,
    /// The push `push_begin` began in this transaction ([`crate::push_guard`]).
    PushBegun,
    /// The `commit_seq` that push was appended as.
    PushAppended,
    /// A push staged for `push_finish` ([`crate::push_stage`]).
    PushStaged,
    /// The idempotency key of that push while it stands ([`crate::push_guard`]).
    PushStagedId,
    /// The extension owner's OID, read once per transaction ([`crate::access::extension_owner`]).
    ExtensionOwner,
    /// A Citus shard found for a lookup below SQL, with the shard-metadata lock that keeps the
    /// answer true while the (sub)transaction that took it lasts ([`crate::citus::local_shard`]):
    /// one value per table and distribution key.
    CitusShard,
    /// On Citus, the partition this transaction's push calls are held to
    /// ([`crate::citus::one_partition`]).
    CitusPushPartition,
    /// On Citus, the first partition this session's `syncular.push_partition` named in the
    /// transaction ([`crate::citus::one_partition`]).
    CitusPushPartitionTaken,
}

struct Entry {
    key: Key,
    value: String,
    subid: pg_sys::SubTransactionId,
}

thread_local! {
    static ENTRIES: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
    static REGISTERED: Cell<bool> = const { Cell::new(false) };
}

/// Sets `key` for the rest of the current (sub)transaction.
pub fn set(key: Key, value: &str) {
    register_callbacks();
    // SAFETY: reads a backend global; never errors.
    let subid = unsafe { pg_sys::GetCurrentSubTransactionId() };
    ENTRIES.with(|entries| {
        entries.borrow_mut().push(Entry {
            key,
            value: value.to_string(),
            subid,
        })
    });
}

/// The value last set for `key` in this transaction, if any.
pub fn get(key: Key) -> Option<String> {
    find(key, |value| Some(value.to_string()))
}

/// The first answer of `matches`, over the values set for `key` in this transaction, newest
/// first (for keys set once per thing they name).
pub fn find<T>(key: Key, matches: impl Fn(&str) -> Option<T>) -> Option<T> {
    ENTRIES.with(|entries| {
        entries
            .borrow()
            .iter()
            .rev()
            .filter(|e| e.key == key)
            .find_map(|e| matches(&e.value))
    })
}

fn register_callbacks() {
    if REGISTERED.with(Cell::get) {
        return;
    }
    // SAFETY: both callbacks are plain functions that never raise and live as long as the
    // library; PostgreSQL keeps them for the backend's lifetime.
    unsafe {
        pg_sys::RegisterXactCallback(Some(on_xact), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(on_subxact), std::ptr::null_mut());
    }
    REGISTERED.with(|r| r.set(true));
}

/// Top-level end (commit, abort, prepare): nothing survives the transaction.
///
/// # Safety
/// Called by PostgreSQL only, as the transaction callback registered above.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_xact(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    use pg_sys::XactEvent::*;
    if matches!(event, XACT_EVENT_PRE_COMMIT | XACT_EVENT_PRE_PREPARE) && staged_push_stands() {
        refuse_commit_of_a_staged_push();
    }
    if matches!(
        event,
        XACT_EVENT_COMMIT
            | XACT_EVENT_ABORT
            | XACT_EVENT_PREPARE
            | XACT_EVENT_PARALLEL_COMMIT
            | XACT_EVENT_PARALLEL_ABORT
    ) {
        ENTRIES.with(|entries| entries.borrow_mut().clear());
    }
}

/// Subtransaction end: a commit hands the values to the parent, an abort drops them.
///
/// # Safety
/// Called by PostgreSQL only, as the subtransaction callback registered above.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_subxact(
    event: pg_sys::SubXactEvent::Type,
    my_subid: pg_sys::SubTransactionId,
    parent_subid: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::SubXactEvent::*;
    ENTRIES.with(|entries| {
        let mut entries = entries.borrow_mut();
        match event {
            SUBXACT_EVENT_COMMIT_SUB => {
                for e in entries.iter_mut().filter(|e| e.subid == my_subid) {
                    e.subid = parent_subid;
                }
            }
            SUBXACT_EVENT_ABORT_SUB => entries.retain(|e| e.subid < my_subid),
            _ => {}
        }
    });
}

/// Whether `push_commit` staged a push in this transaction that neither `push_finish` took nor a
/// rollback to its savepoint undid.
fn staged_push_stands() -> bool {
    get(Key::PushStagedId).is_some_and(|id| !id.is_empty())
}

/// A transaction that still holds a staged push does not commit: its candidate rows would land
/// without a commit in the log and without a result (docs/API.md `push_finish`). Raised from the
/// pre-commit callback, where an ERROR aborts the transaction; nothing owned is held here.
fn refuse_commit_of_a_staged_push() -> ! {
    use crate::error::{raise, Code};
    let code = Code::InvalidTransactionState;
    raise(
        code.sqlstate(),
        code.message().to_string(),
        Some(r#"{"reason":"staged_push"}"#.to_string()),
        Some("push_commit staged a push in this transaction: call push_finish, or ROLLBACK TO SAVEPOINT syncular_push_candidate (and store the host's rejection), before COMMIT".to_string()),
    )
}
