//! Rust ports of PostgreSQL header code: macros and `static inline` functions that bindgen cannot
//! bind, constants of on-disk formats, and calls whose signature differs between majors. Each
//! item quotes what it ports, so "how PostgreSQL works" stays apart from "what we do"; the rest
//! of the crate calls these instead of repeating them.
//!
//! The supported majors are the ones built and tested: PostgreSQL 15 and 18 (Cargo features
//! `pg15`, `pg18`; docs/DESIGN.md §Supported PostgreSQL). Where a signature differs, each item
//! has exactly those two branches.

#[cfg(not(any(feature = "pg15", feature = "pg18")))]
compile_error!("syncular builds for PostgreSQL 15 or 18: enable the feature pg15 or pg18");

use pgrx::pg_sys;
use std::ffi::c_int;

/// `MAKE_SQLSTATE(ch1, …, ch5)` (`src/include/utils/elog.h`):
/// `PGSIXBIT(ch1) + (PGSIXBIT(ch2) << 6) + …` with `PGSIXBIT(ch) = ((ch) - '0') & 0x3F`.
pub fn make_sqlstate(code: &str) -> c_int {
    code.bytes().enumerate().fold(0, |acc, (i, ch)| {
        acc | ((((ch.wrapping_sub(b'0')) & 0x3F) as c_int) << (6 * i))
    })
}

/// The binary `jsonb` layout (`src/include/utils/jsonb.h`, unchanged from 9.4 to 18).
pub mod jsonb {
    /// `JsonbContainer.header`: `JB_CMASK` (count), `JB_FSCALAR`, `JB_FOBJECT`, `JB_FARRAY`.
    pub const JB_CMASK: u32 = 0x0FFF_FFFF;
    pub const JB_FSCALAR: u32 = 0x1000_0000;
    pub const JB_FOBJECT: u32 = 0x2000_0000;
    pub const JB_FARRAY: u32 = 0x4000_0000;

    /// `JEntry`: `JENTRY_OFFLENMASK`, `JENTRY_TYPEMASK`, `JENTRY_HAS_OFF` and the type codes.
    pub const JENTRY_OFFLENMASK: u32 = 0x0FFF_FFFF;
    pub const JENTRY_TYPEMASK: u32 = 0x7000_0000;
    pub const JENTRY_HAS_OFF: u32 = 0x8000_0000;
    pub const JENTRY_ISSTRING: u32 = 0x0000_0000;
    pub const JENTRY_ISNUMERIC: u32 = 0x1000_0000;
    pub const JENTRY_ISBOOL_FALSE: u32 = 0x2000_0000;
    pub const JENTRY_ISBOOL_TRUE: u32 = 0x3000_0000;
    pub const JENTRY_ISNULL: u32 = 0x4000_0000;
    pub const JENTRY_ISCONTAINER: u32 = 0x5000_0000;

    /// `INTALIGN(LEN)` (`src/include/c.h`): numerics and containers start 4-byte aligned.
    pub fn int_align(n: usize) -> usize {
        (n + 3) & !3
    }
}

/// `ExecClearTuple(slot)` (`src/include/executor/tuptable.h`, `static inline`): the slot's own
/// `clear` callback.
///
/// # Safety
/// `slot` is a valid tuple table slot.
pub unsafe fn exec_clear_tuple(slot: *mut pg_sys::TupleTableSlot) {
    // SAFETY: the caller passes a valid slot, whose `tts_ops` PostgreSQL always sets.
    unsafe {
        if let Some(clear) = (*(*slot).tts_ops).clear {
            // A function pointer of PostgreSQL's: behind the guard, so that an ERROR in it
            // unwinds the Rust frames above it.
            pg_sys::ffi::pg_guard_ffi_boundary(|| clear(slot));
        }
    }
}

/// `ExecInsertIndexTuples` (`src/backend/executor/execIndexing.c`), whose signature changed:
/// PostgreSQL 16 added `onlySummarizing`. Inserts `slot`'s index entries; returns the list of
/// indexes to recheck (always empty without deferred constraints). The three uses below.
///
/// # Safety
/// `info` was set up by `InitResultRelInfo` + `ExecOpenIndices` for the relation `slot` was
/// stored into (with `speculative` for `conflicted`), and `estate` is a live executor state.
unsafe fn index_tuples(
    info: *mut pg_sys::ResultRelInfo,
    slot: *mut pg_sys::TupleTableSlot,
    estate: *mut pg_sys::EState,
    update: bool,
    conflicted: Option<&mut bool>,
    only_summarizing: bool,
) -> *mut pg_sys::List {
    let no_dup_err = conflicted.is_some();
    let conflicted = conflicted.map_or(std::ptr::null_mut(), |c| c as *mut bool);
    // Every unique index an arbiter (`ON CONFLICT` without a target), when conflicts are asked.
    let every_unique_index = std::ptr::null_mut();
    // SAFETY: the caller's contract.
    unsafe {
        #[cfg(feature = "pg15")]
        {
            let _ = only_summarizing;
            pg_sys::ExecInsertIndexTuples(
                info,
                slot,
                estate,
                update,
                no_dup_err,
                conflicted,
                every_unique_index,
            )
        }
        #[cfg(feature = "pg18")]
        {
            pg_sys::ExecInsertIndexTuples(
                info,
                slot,
                estate,
                update,
                no_dup_err,
                conflicted,
                every_unique_index,
                only_summarizing,
            )
        }
    }
}

/// The index entries of a newly inserted row, uniqueness checked.
///
/// # Safety
/// As for [`index_tuples`].
pub unsafe fn exec_insert_index_tuples(
    info: *mut pg_sys::ResultRelInfo,
    slot: *mut pg_sys::TupleTableSlot,
    estate: *mut pg_sys::EState,
) -> *mut pg_sys::List {
    // SAFETY: the caller's contract.
    unsafe { index_tuples(info, slot, estate, false, None, false) }
}

/// The index entries of the new version of an updated row (`update` set, as `ExecUpdate` calls
/// it); `only_summarizing`: PostgreSQL 16+'s answer that only summarizing indexes need the new
/// version (never on 15, which then makes no heap-only tuple).
///
/// # Safety
/// As for [`index_tuples`]; `slot` holds the new version with its `tts_tid`.
pub unsafe fn exec_update_index_tuples(
    info: *mut pg_sys::ResultRelInfo,
    slot: *mut pg_sys::TupleTableSlot,
    estate: *mut pg_sys::EState,
    only_summarizing: bool,
) -> *mut pg_sys::List {
    // SAFETY: the caller's contract.
    unsafe { index_tuples(info, slot, estate, true, None, only_summarizing) }
}

/// The index entries of a speculative insertion (`ExecInsert`'s `ON CONFLICT` path): a
/// duplicate on a unique index reported in `conflicted` instead of raised.
///
/// # Safety
/// As for [`index_tuples`]; the indexes were opened for speculative insertion.
pub unsafe fn exec_insert_index_tuples_speculative(
    info: *mut pg_sys::ResultRelInfo,
    slot: *mut pg_sys::TupleTableSlot,
    estate: *mut pg_sys::EState,
    conflicted: &mut bool,
) -> *mut pg_sys::List {
    // SAFETY: the caller's contract.
    unsafe { index_tuples(info, slot, estate, false, Some(conflicted), false) }
}

/// `ExecCheckIndexConstraints` (`src/backend/executor/execIndexing.c`), the `ON CONFLICT`
/// pre-check of every unique index for the row in `slot` (waiting for a conflicting row still
/// being inserted); PostgreSQL 18 added the updated row's id (none: an insert). `false` with
/// `conflict` set when a conflicting row stands.
///
/// # Safety
/// `info` was opened for speculative insertion; `slot` holds a row of its relation; `estate`
/// is live.
pub unsafe fn exec_check_index_constraints(
    info: *mut pg_sys::ResultRelInfo,
    slot: *mut pg_sys::TupleTableSlot,
    estate: *mut pg_sys::EState,
    conflict: &mut pg_sys::ItemPointerData,
) -> bool {
    let every_unique_index = std::ptr::null_mut();
    // SAFETY: the caller's contract.
    unsafe {
        #[cfg(feature = "pg15")]
        {
            pg_sys::ExecCheckIndexConstraints(info, slot, estate, conflict, every_unique_index)
        }
        #[cfg(feature = "pg18")]
        {
            pg_sys::ExecCheckIndexConstraints(
                info,
                slot,
                estate,
                conflict,
                std::ptr::null_mut(),
                every_unique_index,
            )
        }
    }
}

/// `heap_update` (`src/backend/access/heap/heapam.c`) of the row version at `old` by `new`
/// under this transaction's command id, waiting for nobody but as the executor's update does;
/// PostgreSQL 16 made it answer which indexes need the new version. `None`: not updated (the
/// version is no longer the newest, or was changed by this command); `Some(None)`: a heap-only
/// tuple, no index entry needed; `Some(Some(only_summarizing))`: the indexes need entries.
///
/// # Safety
/// `relation` is an open heap relation locked for writing; `old` names a row version of it,
/// `new` is a tuple of its descriptor.
pub unsafe fn heap_update(
    relation: pg_sys::Relation,
    old: pg_sys::ItemPointer,
    new: pg_sys::HeapTuple,
) -> Option<Option<bool>> {
    let mut failure = pg_sys::TM_FailureData::default();
    let mut lock_mode: pg_sys::LockTupleMode::Type = 0;
    // SAFETY: the caller's contract; no crosscheck snapshot, as outside RI checks.
    unsafe {
        let command = pg_sys::GetCurrentCommandId(true);
        #[cfg(feature = "pg15")]
        {
            let result = pg_sys::heap_update(
                relation,
                old,
                new,
                command,
                std::ptr::null_mut(),
                true,
                &mut failure,
                &mut lock_mode,
            );
            let heap_only = u32::from((*(*new).t_data).t_infomask2) & pg_sys::HEAP_ONLY_TUPLE != 0;
            (result == pg_sys::TM_Result::TM_Ok).then_some((!heap_only).then_some(false))
        }
        #[cfg(feature = "pg18")]
        {
            let mut indexes: pg_sys::TU_UpdateIndexes::Type = pg_sys::TU_UpdateIndexes::TU_None;
            let result = pg_sys::heap_update(
                relation,
                old,
                new,
                command,
                std::ptr::null_mut(),
                true,
                &mut failure,
                &mut lock_mode,
                &mut indexes,
            );
            (result == pg_sys::TM_Result::TM_Ok).then_some(match indexes {
                pg_sys::TU_UpdateIndexes::TU_None => None,
                pg_sys::TU_UpdateIndexes::TU_Summarizing => Some(true),
                _ => Some(false),
            })
        }
    }
}

/// The `numeric` varlena's header word (`src/backend/utils/adt/numeric.c`): sign and format bits,
/// the short format's sign, weight sign and weight; digits are base `NBASE`. Read by
/// [`crate::jsonb`], written by [`crate::jsonb_write`].
pub mod numeric {
    pub const NBASE: u64 = 10_000;
    pub const NUMERIC_SIGN_MASK: u16 = 0xC000;
    pub const NUMERIC_NEG: u16 = 0x4000;
    pub const NUMERIC_SHORT: u16 = 0x8000;
    pub const NUMERIC_SPECIAL: u16 = 0xC000;
    pub const SHORT_SIGN: u16 = 0x2000;
    pub const SHORT_WEIGHT_SIGN: u16 = 0x0040;
    pub const SHORT_WEIGHT_MASK: u16 = 0x003F;
}

/// `RelationGetPrimaryKeyIndex(relation)` (`src/backend/utils/cache/relcache.c`); PostgreSQL 18
/// added `deferrable_ok` (we want only immediate primary keys, the old behaviour).
///
/// # Safety
/// `relation` is an open relation.
pub unsafe fn relation_primary_key_index(relation: pg_sys::Relation) -> pg_sys::Oid {
    // SAFETY: the caller passes an open relation.
    unsafe {
        #[cfg(feature = "pg15")]
        {
            pg_sys::RelationGetPrimaryKeyIndex(relation)
        }
        #[cfg(feature = "pg18")]
        {
            pg_sys::RelationGetPrimaryKeyIndex(relation, false)
        }
    }
}

/// Whether `role` holds `USAGE` on schema `namespace`: `pg_namespace_aclcheck` on PostgreSQL 15,
/// `object_aclcheck(NamespaceRelationId, …)` from 16 on (`src/include/utils/acl.h`).
pub fn namespace_usage(namespace: pg_sys::Oid, role: pg_sys::Oid) -> bool {
    let usage = pg_sys::ACL_USAGE as pg_sys::AclMode;
    // SAFETY: an ACL lookup through the syscache; an error (a vanished schema) is raised as a
    // PostgreSQL error, caught by pgrx.
    let result = unsafe {
        #[cfg(feature = "pg15")]
        {
            pg_sys::pg_namespace_aclcheck(namespace, role, usage)
        }
        #[cfg(feature = "pg18")]
        {
            pg_sys::object_aclcheck(pg_sys::NamespaceRelationId, namespace, role, usage)
        }
    };
    result == pg_sys::AclResult::ACLCHECK_OK
}

/// `list_length(l)` and `list_nth(l, n)` (`src/include/nodes/pg_list.h`, `static inline`): a
/// NIL list is the null pointer; a list's cells are an array since PostgreSQL 13.
///
/// # Safety
/// `list` is NIL or a valid pointer list.
pub unsafe fn list_pointers<'a>(list: *const pg_sys::List) -> &'a [pg_sys::ListCell] {
    // SAFETY: a valid list's `elements` holds `length` cells; NIL has none.
    unsafe {
        if list.is_null() || (*list).length <= 0 {
            return &[];
        }
        std::slice::from_raw_parts((*list).elements, (*list).length as usize)
    }
}

/// This backend's local transaction id, `MyProc->lxid` on PostgreSQL 15, `MyProc->vxid.lxid`
/// from 17 on (`src/include/storage/proc.h`): a new one for every transaction the backend runs.
pub fn local_transaction_id() -> pg_sys::LocalTransactionId {
    // SAFETY: `MyProc` is this backend's own slot of the proc array, set before any SQL runs;
    // only this backend writes its local transaction id.
    unsafe {
        #[cfg(feature = "pg15")]
        {
            (*pg_sys::MyProc).lxid
        }
        #[cfg(feature = "pg18")]
        {
            (*pg_sys::MyProc).vxid.lxid
        }
    }
}

/// [`local_transaction_id`], or invalid (0) in a process without a proc slot (the postmaster,
/// loading a preloaded library).
pub fn local_transaction_id_if_any() -> pg_sys::LocalTransactionId {
    // SAFETY: a read of the global `MyProc` pointer itself.
    if unsafe { pg_sys::MyProc.is_null() } {
        0
    } else {
        local_transaction_id()
    }
}

/// `TransactionIdPrecedes(id1, id2)` (`src/backend/access/transam/transam.c`): modulo-2^32
/// order for normal ids, plain order when either is permanent. Ported so that the executor
/// hook (src/schema/executor_snapshots.rs), run at every executor start, makes no FFI call.
pub fn transaction_id_precedes(id1: pg_sys::TransactionId, id2: pg_sys::TransactionId) -> bool {
    let (a, b) = (id1.into_inner(), id2.into_inner());
    let normal = pg_sys::TransactionId::FIRST_NORMAL.into_inner();
    if a < normal || b < normal {
        return a < b;
    }
    (a.wrapping_sub(b) as i32) < 0
}

/// `FullTransactionIdFromAllowableAt(nextFullXid, xid)` (`src/include/access/transam.h` of
/// PostgreSQL 18; 15 does the same in `procarray.c`'s `FullXidRelativeTo`): the full id of
/// `xid`, a normal id that precedes `next` by less than 2^31.
pub fn widen_transaction_id(next: u64, xid: pg_sys::TransactionId) -> u64 {
    let low = u64::from(xid.into_inner());
    let epoch = next >> 32;
    if low <= next & 0xFFFF_FFFF {
        (epoch << 32) | low
    } else {
        (epoch.saturating_sub(1) << 32) | low
    }
}

/// `HeapTupleHeaderGetXmin(tup)` (`src/include/access/htup_details.h`): the inserting
/// transaction, `FrozenTransactionId` once frozen.
///
/// # Safety
/// `header` points to a valid heap tuple header.
pub unsafe fn heap_tuple_header_get_xmin(header: pg_sys::HeapTupleHeader) -> pg_sys::TransactionId {
    // SAFETY: the caller passes a valid tuple header.
    unsafe {
        let frozen = pg_sys::HEAP_XMIN_FROZEN as u16;
        if (*header).t_infomask & frozen == frozen {
            pg_sys::FrozenTransactionId
        } else {
            (*header).t_choice.t_heap.t_xmin
        }
    }
}

/// Visits every snapshot registered in this backend — snapmgr.c's `RegisteredSnapshots`, a
/// pairing heap ordered by `xmin` that PostgreSQL does not export (`src/include/lib/pairingheap.h`):
/// one snapshot is registered here, its node followed up `prev_or_parent` (the previous sibling,
/// or the parent of a first child) to the root, then every node below it. Stops, returning
/// false, when `visit` does.
///
/// # Safety
/// Inside a transaction; `visit` neither registers nor unregisters a snapshot.
pub unsafe fn each_registered_snapshot(mut visit: impl FnMut(pg_sys::Snapshot) -> bool) -> bool {
    // SAFETY: the snapshot registered here is a node of the heap until it is unregistered below
    // (an error in between leaves it to the resource owner's cleanup); every node of the heap is
    // the `ph_node` field of a registered `SnapshotData`, so the container is found by that
    // field's offset; the heap is not changed while it is walked.
    unsafe {
        let mine = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        let offset = std::mem::offset_of!(pg_sys::SnapshotData, ph_node);
        let mut root: *mut pg_sys::pairingheap_node = &raw mut (*mine).ph_node;
        while !(*root).prev_or_parent.is_null() {
            root = (*root).prev_or_parent;
        }
        let mut pending = vec![root];
        let mut all = true;
        let mut seen = 0usize;
        while let Some(node) = pending.pop() {
            seen += 1;
            if seen.is_multiple_of(1024) {
                crate::interrupts::check();
            }
            if !visit(node.cast::<u8>().sub(offset).cast::<pg_sys::SnapshotData>()) {
                all = false;
                break;
            }
            for next in [(*node).first_child, (*node).next_sibling] {
                if !next.is_null() {
                    pending.push(next);
                }
            }
        }
        pg_sys::UnregisterSnapshot(mine);
        all
    }
}

/// Whether PostgreSQL tells the oldest snapshot of the active stack ([`oldest_active_snapshot`]).
pub const OLDEST_ACTIVE_SNAPSHOT_KNOWN: bool = cfg!(feature = "pg15");

/// The oldest snapshot on this backend's active stack, where PostgreSQL tells it:
/// `GetOldestSnapshot()` on PostgreSQL 15 returns the bottom of the active stack while one is set
/// and `old_snapshot_threshold` is off (with it on, it compares by LSN and may answer a registered
/// one instead); PostgreSQL 18 removed it and keeps the stack private: `None`.
pub fn oldest_active_snapshot() -> Option<pg_sys::Snapshot> {
    #[cfg(feature = "pg15")]
    {
        // SAFETY: reads of this backend's snapshot manager state.
        unsafe {
            (pg_sys::old_snapshot_threshold < 0 && pg_sys::ActiveSnapshotSet())
                .then(|| pg_sys::GetOldestSnapshot())
                .filter(|s| !s.is_null())
        }
    }
    #[cfg(feature = "pg18")]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transaction_ids_precede_modulo_2_32() {
        let xid = |x: u32| pg_sys::TransactionId::from(x);
        assert!(transaction_id_precedes(xid(100), xid(200)));
        assert!(!transaction_id_precedes(xid(200), xid(100)));
        assert!(!transaction_id_precedes(xid(100), xid(100)));
        assert!(transaction_id_precedes(xid(4_000_000_000), xid(100)));
        assert!(transaction_id_precedes(xid(2), xid(100)));
        assert!(!transaction_id_precedes(xid(100), xid(2)));
    }

    #[test]
    fn a_transaction_id_widens_into_the_epoch_of_next_or_the_one_before() {
        let next = (7u64 << 32) | 1000;
        let xid = |x: u32| pg_sys::TransactionId::from(x);
        assert_eq!(widen_transaction_id(next, xid(999)), (7 << 32) | 999);
        assert_eq!(widen_transaction_id(next, xid(1000)), (7 << 32) | 1000);
        assert_eq!(
            widen_transaction_id(next, xid(4_000_000_000)),
            (6 << 32) | 4_000_000_000
        );
        assert_eq!(widen_transaction_id(1000, xid(999)), 999);
    }

    #[test]
    fn make_sqlstate_matches_postgres() {
        // ERRCODE_UNIQUE_VIOLATION = MAKE_SQLSTATE('2','3','5','0','5').
        let expected = 2 | (3 << 6) | (5 << 12) | (0 << 18) | (5 << 24);
        assert_eq!(make_sqlstate("23505"), expected);
    }

    #[test]
    fn int_align_rounds_up_to_four() {
        assert_eq!([0, 1, 3, 4, 5, 8].map(jsonb::int_align), [0, 4, 4, 4, 8, 8]);
    }
}
