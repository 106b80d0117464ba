//! The earliest snapshot any executor of this transaction read with: what
//! [`super::marker::seen_by_every_snapshot`] asks about a migration (docs/SECURITY.md rule 19,
//! red team 18).
//!
//! A read of a table through SQL — a query, a cursor's fetch, a function's statement, a
//! trigger's, a statement run while another is planned — runs an executor, started with the
//! snapshot it reads through (`QueryDesc.snapshot`); a utility statement that reads one
//! (`COPY table TO`) or runs statements (`DO`, `CALL`) runs under the active snapshot. An
//! `ExecutorStart` hook and a `ProcessUtility` hook keep a copy of the earliest such snapshot of
//! the current transaction, so the check needs no snapshot still to be held when it runs: a cursor closed inside the decoding statement (red team 18, F2) or a
//! snapshot on PostgreSQL 18's private active stack (F1) was recorded when it was read through.
//!
//! What is kept is the earliest snapshot, found without a clock: a snapshot's `xmax` is the
//! latest completed transaction id plus one when it was taken, which only grows, so a smaller
//! `xmax` was taken earlier, and a later snapshot adds nothing to what an earlier one says of any
//! id below the earlier `xmax` (an id still running later was running then, and listed). Of two
//! with one `xmax` neither is known to be the earlier (the later one's running set is a subset,
//! but a standby's lists can be incomplete: red team 21), so both are kept merged: the smaller
//! `xmin`, every id either saw running, and either's overflow — what the merge says is seen,
//! each of them sees. And whatever the earliest sees committed, every later snapshot does: if
//! the earliest sees a migration, all of them do.
//!
//! Only a transaction that began after the hook was installed is covered: the library loads at
//! the first call of one of its functions (or at connection start where it is preloaded:
//! docs/API.md §decode_row), and the executors that ran before it in that transaction were not
//! seen ([`covered`]).

use crate::port;
use pgrx::{pg_guard, pg_sys};
use std::cell::{Cell, RefCell};
use std::ffi::c_int;

/// A copy of a snapshot's visibility data: enough to ask whether it sees a transaction.
#[derive(Default)]
struct Copy {
    /// The local transaction the snapshot was read through in.
    transaction: pg_sys::LocalTransactionId,
    xmin: pg_sys::TransactionId,
    xmax: pg_sys::TransactionId,
    /// The ids seen running below `xmax`, sorted: top-level ones (a primary's `xip`; a standby
    /// keeps every running id in `subxip`) and subtransactions'.
    running: Vec<u32>,
    /// A list of running subtransactions was incomplete (a transaction with more of them than
    /// PostgreSQL keeps per backend, 64): a subtransaction's id missing from `running` may still
    /// have been running. Top-level ids are always complete.
    suboverflowed: bool,
}

impl Copy {
    fn take(&mut self, transaction: pg_sys::LocalTransactionId, s: &pg_sys::SnapshotData) {
        self.transaction = transaction;
        self.xmin = s.xmin;
        self.xmax = s.xmax;
        self.running.clear();
        self.suboverflowed = s.suboverflowed;
        self.add_running(s);
    }

    /// Merges `s`, taken at the same `xmax`: the smaller `xmin`, either's overflow, every
    /// running id of both.
    fn merge(&mut self, s: &pg_sys::SnapshotData) {
        if port::transaction_id_precedes(s.xmin, self.xmin) {
            self.xmin = s.xmin;
        }
        self.suboverflowed |= s.suboverflowed;
        self.add_running(s);
    }

    /// Adds `s`'s running ids below `xmax` not already listed.
    fn add_running(&mut self, s: &pg_sys::SnapshotData) {
        // SAFETY: a valid snapshot's `xip` has `xcnt` ids and its `subxip` `subxcnt`.
        let (xip, subxip) = unsafe { (ids(s.xip, s.xcnt), ids(s.subxip, s.subxcnt)) };
        for id in xip.iter().chain(subxip) {
            if !port::transaction_id_precedes(*id, self.xmax) {
                continue;
            }
            let id = id.into_inner();
            if let Err(at) = self.running.binary_search(&id) {
                self.running.insert(at, id);
            }
        }
    }
}

thread_local! {
    /// The earliest snapshot an executor of [`Copy::transaction`] started with (several merged,
    /// when they could not be ordered).
    static EARLIEST: RefCell<Copy> = RefCell::new(Copy::default());
    /// A transaction whose snapshots span more than 2^30 ids, which compare only modulo 2^32:
    /// its answer is "not proven".
    static UNORDERED: Cell<pg_sys::LocalTransactionId> = const { Cell::new(0) };
    /// The local transaction in which the hook was installed (invalid: before any transaction,
    /// at preload); set once, by [`install`].
    static INSTALLED_IN: Cell<Option<pg_sys::LocalTransactionId>> = const { Cell::new(None) };
}

/// The `ExecutorStart_hook` installed before ours, called by ours.
static mut PREVIOUS: pg_sys::ExecutorStart_hook_type = None;
/// The `ProcessUtility_hook` installed before ours, called by ours.
static mut PREVIOUS_UTILITY: pg_sys::ProcessUtility_hook_type = None;

/// Installs the hook (from `_PG_init`, once per process that loads the library).
pub fn install() {
    INSTALLED_IN.with(|c| c.set(Some(port::local_transaction_id_if_any())));
    // SAFETY: `_PG_init` runs once per process, single-threaded, before any executor of ours
    // starts; the hook installed before ours is kept and called by ours.
    unsafe {
        PREVIOUS = pg_sys::ExecutorStart_hook;
        pg_sys::ExecutorStart_hook = Some(record_then_start);
        PREVIOUS_UTILITY = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(record_then_utility);
    }
}

/// Whether every executor of the current transaction ran with the hook installed.
pub fn covered() -> bool {
    INSTALLED_IN
        .with(Cell::get)
        .is_some_and(|at| at != port::local_transaction_id())
}

// PostgreSQL's own executor start and utility run, called as C calls them: an ERROR raised in
// them (or in the hooks installed before ours) jumps straight over the hooks below, which hold
// nothing that needs dropping — as over any C hook. Not through pgrx's guarded bindings: those
// turn the ERROR into a Rust panic, and raised again by pgrx it would lose its SQLSTATE (a
// custom one becomes XX000) and gain a backtrace in its DETAIL (src/error.rs).
unsafe extern "C-unwind" {
    #[link_name = "standard_ExecutorStart"]
    fn standard_executor_start(query: *mut pg_sys::QueryDesc, eflags: c_int);
    #[link_name = "standard_ProcessUtility"]
    #[allow(clippy::too_many_arguments)]
    fn standard_process_utility(
        statement: *mut pg_sys::PlannedStmt,
        text: *const std::ffi::c_char,
        read_only_tree: bool,
        context: pg_sys::ProcessUtilityContext::Type,
        params: pg_sys::ParamListInfo,
        environment: *mut pg_sys::QueryEnvironment,
        destination: *mut pg_sys::DestReceiver,
        completion: *mut pg_sys::QueryCompletion,
    );
}

/// The executor hook (`void (*)(QueryDesc *, int)` on PostgreSQL 15 and 18,
/// `src/include/executor/executor.h`): records the descriptor's snapshot, then starts the
/// executor as the hook before ours, or PostgreSQL, would. No `pg_guard`: nothing of ours is
/// live when the executor starts (see above); the recording is guarded on its own.
unsafe extern "C-unwind" fn record_then_start(query: *mut pg_sys::QueryDesc, eflags: c_int) {
    // SAFETY: PostgreSQL passes a valid descriptor, whose snapshot (when set) is valid while the
    // executor runs; the hook before ours takes the same arguments.
    unsafe {
        record_guarded((*query).snapshot);
        // On Citus, the push's partition sent again where a released savepoint made Citus
        // forget it, before this statement opens a connection (src/citus/one_partition.rs).
        crate::citus::one_partition::resend_guarded();
        match PREVIOUS {
            Some(previous) => previous(query, eflags),
            None => standard_executor_start(query, eflags),
        }
    }
}

/// The utility hook (`src/include/tcop/utility.h`, the same on PostgreSQL 15 and 18): records the
/// active snapshot a utility statement runs under — `COPY table TO` reads the table through it
/// with no executor (red team 19's review), a `DO` or `CALL` runs its body under it — then runs
/// the statement as the hook before ours, or PostgreSQL, would. No `pg_guard`, as above: an
/// ERROR anywhere in a `DO` block passes through here.
#[allow(clippy::too_many_arguments)]
unsafe extern "C-unwind" fn record_then_utility(
    statement: *mut pg_sys::PlannedStmt,
    text: *const std::ffi::c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    environment: *mut pg_sys::QueryEnvironment,
    destination: *mut pg_sys::DestReceiver,
    completion: *mut pg_sys::QueryCompletion,
) {
    // SAFETY: the active snapshot, when one is set, is valid while the statement runs (asked
    // through pgrx's guarded bindings, which raise nothing here); `statement` is PostgreSQL's,
    // as `observe` requires; the arguments go on as PostgreSQL passed them, to a hook that takes
    // the same ones.
    unsafe {
        if pg_sys::ActiveSnapshotSet() {
            record_guarded(pg_sys::GetActiveSnapshot());
        }
        // The settings Citus would replay on the extension owner's connections (red team 46),
        // and the push's partition as Citus replays it here (src/citus/one_partition.rs).
        if let Some(set) = crate::citus::propagated::observe(statement) {
            crate::citus::propagated::refuse_propagation(set);
        }
        crate::citus::one_partition::note_replay(
            statement,
            context == pg_sys::ProcessUtilityContext::PROCESS_UTILITY_TOPLEVEL,
        );
        let run = match PREVIOUS_UTILITY {
            Some(previous) => previous,
            None => standard_process_utility,
        };
        run(
            statement,
            text,
            read_only_tree,
            context,
            params,
            environment,
            destination,
            completion,
        );
        crate::citus::one_partition::replay_done();
    }
}

/// [`record`] behind pgrx's guard: a panic in it (none is expected: the allocator ends the
/// session rather than fail) is raised as an ERROR from here.
#[pg_guard]
unsafe extern "C-unwind" fn record_guarded(snapshot: pg_sys::Snapshot) {
    // SAFETY: the caller's snapshot is null or valid.
    unsafe { record(snapshot) }
}

/// Keeps a copy of `snapshot` when it is the earliest an executor of this transaction started
/// with, or merges it into the one kept when they have one `xmax`.
///
/// # Safety
/// `snapshot` is null or a valid snapshot.
unsafe fn record(snapshot: pg_sys::Snapshot) {
    // SAFETY: the caller's null or valid snapshot.
    unsafe {
        if snapshot.is_null() || (*snapshot).snapshot_type != pg_sys::SnapshotType::SNAPSHOT_MVCC {
            return;
        }
    }
    let now = port::local_transaction_id();
    // SAFETY: as above.
    let s = unsafe { &*snapshot };
    EARLIEST.with(|earliest| {
        let mut earliest = earliest.borrow_mut();
        if earliest.transaction != now {
            earliest.take(now, s);
            return;
        }
        match earlier(s, &earliest) {
            None => UNORDERED.with(|c| c.set(now)),
            Some(Order::Later) => {}
            Some(Order::Earlier) => earliest.take(now, s),
            Some(Order::Same) => earliest.merge(s),
        }
    });
}

/// Where a snapshot stands against the one kept.
#[derive(Debug, PartialEq)]
enum Order {
    Earlier,
    /// One `xmax`: merged.
    Same,
    Later,
}

/// Where `s` stands against `kept` (`None`: they cannot be compared).
fn earlier(s: &pg_sys::SnapshotData, kept: &Copy) -> Option<Order> {
    // Ids compare modulo 2^32: a transaction spanning 2^30 of them (days at high rates) is not
    // ordered, rather than ordered wrong.
    if s.xmax
        .into_inner()
        .wrapping_sub(kept.xmax.into_inner())
        .wrapping_add(1 << 30)
        >= 1 << 31
    {
        return None;
    }
    Some(if s.xmax == kept.xmax {
        Order::Same
    } else if port::transaction_id_precedes(s.xmax, kept.xmax) {
        Order::Earlier
    } else {
        Order::Later
    })
}

fn count(n: impl TryInto<usize>) -> usize {
    n.try_into().unwrap_or(0)
}

/// # Safety
/// `ids` points to `n` transaction ids (or `n` is zero).
unsafe fn ids<'a>(
    ids: *mut pg_sys::TransactionId,
    n: impl TryInto<usize>,
) -> &'a [pg_sys::TransactionId] {
    let n = count(n);
    if ids.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: the caller's `n` ids.
    unsafe { std::slice::from_raw_parts(ids, n) }
}

/// What the earliest snapshot an executor of this transaction started with says of `writer`.
pub enum Earliest {
    /// It sees `writer` committed.
    Sees,
    /// No executor or utility statement of this transaction has run with a snapshot.
    Unrecorded,
    /// It was taken before `writer` committed.
    Misses,
    /// It cannot be told: a subtransaction's id missing from an incomplete list, whose
    /// top-level transaction is not known.
    Unknown,
    /// The transaction's snapshots span more than 2^30 ids, which compare only modulo 2^32.
    Unordered,
}

/// Asks the earliest snapshot of this transaction whether it sees every one of `writers`: full
/// ids of committed transactions, each with whether it is known to be a top-level one (the
/// caller asks a subtransaction by its top-level transaction where it can: src/schema/marker.rs).
/// Below the snapshot's `xmin` an id is seen, at or above its `xmax` it is not, in between
/// unless it was running then. A top-level id is looked up in the running set, which is
/// complete for them; another id too, unless the set of subtransactions overflowed: then it
/// cannot be told. Compared as full ids, so a transaction long past (its row version frozen,
/// its id wrapped around) is still told apart.
pub fn earliest_sees(writers: &[(u64, bool)]) -> Earliest {
    let now = port::local_transaction_id();
    if UNORDERED.with(Cell::get) == now {
        return Earliest::Unordered;
    }
    EARLIEST.with(|earliest| {
        let earliest = earliest.borrow();
        if earliest.transaction != now {
            return Earliest::Unrecorded;
        }
        // SAFETY: a read of the shared next transaction id (under its lock).
        let next = unsafe { pg_sys::ReadNextFullTransactionId() }.value;
        let (xmin, xmax) = (
            port::widen_transaction_id(next, earliest.xmin),
            port::widen_transaction_id(next, earliest.xmax),
        );
        let mut unknown = false;
        for &(writer, top_level) in writers {
            if writer < xmin {
                continue;
            }
            if writer >= xmax {
                return Earliest::Misses;
            }
            if !top_level && earliest.suboverflowed {
                unknown = true;
                continue;
            }
            if earliest.running.binary_search(&(writer as u32)).is_ok() {
                return Earliest::Misses;
            }
        }
        if unknown {
            Earliest::Unknown
        } else {
            Earliest::Sees
        }
    })
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::*;
    use pgrx::prelude::*;

    fn snapshot(xmax: u32, xip: &mut [pg_sys::TransactionId]) -> pg_sys::SnapshotData {
        // SAFETY: a plain C struct; the fields the ordering reads are set below.
        let mut s: pg_sys::SnapshotData = unsafe { std::mem::zeroed() };
        s.snapshot_type = pg_sys::SnapshotType::SNAPSHOT_MVCC;
        s.xmin = pg_sys::TransactionId::from(100);
        s.xmax = pg_sys::TransactionId::from(xmax);
        s.xip = xip.as_mut_ptr();
        s.xcnt = xip.len() as u32;
        s
    }

    fn kept(xmax: u32) -> Copy {
        Copy {
            xmax: pg_sys::TransactionId::from(xmax),
            ..Copy::default()
        }
    }

    /// A smaller `xmax` was taken earlier, a larger one later; one `xmax` is merged; a span of
    /// 2^30 ids or more is not compared.
    #[pg_test]
    fn snapshots_are_ordered_by_xmax_and_merged_at_one() {
        let mut one = [100u32].map(pg_sys::TransactionId::from);
        let at = |xmax| earlier(&snapshot(xmax, &mut one.clone()), &kept(200));
        assert_eq!(at(150), Some(Order::Earlier));
        assert_eq!(at(250), Some(Order::Later));
        assert_eq!(at(200), Some(Order::Same));
        assert_eq!(at(200 + (1 << 30)), None);
        assert_eq!(
            earlier(
                &snapshot(200, &mut one),
                &kept(200u32.wrapping_sub(1 << 30))
            ),
            None
        );
    }

    /// Merged at one `xmax`: the smaller `xmin`, every running id below `xmax` once, sorted,
    /// and either's overflow.
    #[pg_test]
    fn snapshots_at_one_xmax_keep_every_running_id_and_the_overflow() {
        let mut a = [150u32, 120].map(pg_sys::TransactionId::from);
        let mut b = [130u32, 150, 260].map(pg_sys::TransactionId::from);
        let mut kept = Copy::default();
        kept.take(1, &snapshot(200, &mut a));
        let mut second = snapshot(200, &mut b);
        second.xmin = pg_sys::TransactionId::from(90);
        second.suboverflowed = true;
        kept.merge(&second);
        assert_eq!(kept.running, vec![120, 130, 150]);
        assert_eq!(kept.xmin, pg_sys::TransactionId::from(90));
        assert!(kept.suboverflowed);
    }
}
