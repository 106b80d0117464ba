//! On Citus, the calls that begin, stage, append or store the result of a push name one
//! partition per transaction (red teams 54–57; docs/SCALING.md "One partition per push
//! transaction").
//!
//! The push protects itself from host bugs with state kept in the backend that runs the calls
//! (src/push_guard.rs: the push `push_begin` began, a staged push, the commit appended). On one
//! node that is the transaction's own backend. On Citus the push transaction's calls are
//! delegated inside a transaction (`force_delegation`, src/distribute.rs) — a transaction block,
//! or for Citus also a `DO` block or a function's statements in autocommit: each runs in the
//! caller's session on its partition's node, so a call for a partition on another node ran in a
//! backend that knew of no push — after `push_begin` of p0, `append_commit` of p1 applied where
//! one node refuses it (`SY000` `partition`/`shape`), and with a push staged on p0 an append on
//! p1 went through (`SY004` `prior_writes` on one node). So on a database whose sync tables
//! Citus distributes, the first of these calls in a transaction pins its partition and a call of
//! them for another partition in that transaction is refused (`SY004` `citus_one_partition`) —
//! checked where Citus decides to delegate the call (the planner hook of `super::subquery`, on
//! the node the client sent it to) and where a call runs (its body, src/push_guard.rs). Keyed by
//! the transaction, not by PostgreSQL's transaction block: a `DO` block in autocommit is one
//! transaction that Citus delegates call by call (red team 55, F1). Stricter than one node, where
//! a transaction may push to several partitions in turn: on Citus those are transactions of their
//! own. Host code inside a call is left to its own refusal (`42501`, `crate::error::run`).
//!
//! Calls the node the client reached never sees run elsewhere too: inside a host's function that
//! Citus delegates (refused by `super::subquery` in a transaction that pinned a partition: red
//! team 56) or inside a query Citus routes whole to a worker (red team 57). So a client's
//! transaction block also sends the partition it pinned to every node it reaches ([`send`]:
//! `syncular.push_partition`, replayed by Citus on the transaction's connections), and every
//! call checks it. Citus forgets a subtransaction's `SET LOCAL` when it ends, released too, so
//! the pin is sent again where it was sent inside one ([`resend_where_forgotten`], red team 59,
//! F1); and a node that runs a call in a distributed transaction another node began refuses a
//! call that arrives with no pin sent ([`unsent_on_a_participant`], red team 59, F2: a host's
//! function routed to a worker pinned it there alone, and the node the client reached let a push
//! to another partition through).

use crate::error::{Error, Result};
use crate::port;
use crate::txn_local::{self, Key};
use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::pg_sys;
use pgrx::spi::{quote_literal, Spi};
use std::cell::Cell;
use std::ffi::CString;

/// The partition the node the client reached pinned, as Citus hands it to every node of the
/// transaction ([`send`]).
static SENT: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

thread_local! {
    /// Where this session last had the pin sent ([`send`]): its local transaction and the
    /// subtransaction whose propagated settings Citus keeps it with.
    static SENT_IN: Cell<Option<(pg_sys::LocalTransactionId, pg_sys::SubTransactionId)>> =
        const { Cell::new(None) };
}

/// Defines `syncular.push_partition` (from `_PG_init`).
pub fn init() {
    // SAFETY: the check hook is guarded (`pg_guard`) and has the signature PostgreSQL calls.
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"syncular.push_partition",
            c"On Citus, the partition this transaction's push calls are held to.",
            c"Set by the extension (SET LOCAL, which Citus sends to every node of the transaction) when a transaction's first push call names its partition; not a setting for hosts, who may only empty it (docs/SCALING.md, \"One partition per push transaction\").",
            &SENT,
            GucContext::Userset,
            GucFlags::NO_SHOW_ALL | GucFlags::NO_RESET_ALL,
            Some(only_as_sent),
            None,
            None,
        );
    }
}

thread_local! {
    /// True while [`send`] makes the setting.
    static SENDING: Cell<bool> = const { Cell::new(false) };
    /// True while a session Citus opened runs a top-level `SET LOCAL` of the setting: Citus
    /// replaying what the node the client reached sent ([`note_replay`]), from just before the
    /// statement runs to just after ([`replay_done`]).
    static REPLAYING: Cell<bool> = const { Cell::new(false) };
}

/// The setting's check hook. A partition is accepted only as the extension sends it — by
/// [`send`] on the node the client reached, and as Citus replays it on the other nodes (a
/// top-level statement of a session Citus opened that has not sent its transaction to another
/// node itself, [`note_replay`]) — and an empty value from anyone. Red team 60: a host's code that
/// Citus routed to a worker set it there (`set_config(…)` in its function or its query) to the
/// partition it then appended to, and a host that made Citus propagate its own `SET LOCAL`
/// after the push's first call did the same on every node; both pushes were kept. A role's or
/// database's default is refused the same way (PostgreSQL then ignores it with a WARNING when a
/// session starts). A parallel worker takes its leader's value as it starts.
///
/// Both signs of a replay are the client's to forge — Citus derives the first from
/// `application_name` and lets anyone call the `assign_distributed_transaction_id` behind the
/// second (red teams 61 and 62) — so what holds is that a session takes **one** partition per
/// transaction: a value naming another partition than the one it took first, or than the one
/// its own calls pinned, is refused whoever makes it ([`refusal_of`]). The node the client
/// reached is one such session, and every other node of its transaction gets its value from it
/// (Citus replays what it sent and nothing else reaches them at the top level), so every node
/// holds the same partition or none — and a call on a node that holds none is refused there
/// ([`unsent_on_a_participant`]). A rollback to a savepoint taken before the value releases it,
/// as it undoes the value on every node. Refused with the extension's `SY004`
/// (`citus_one_partition`).
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn only_as_sent(
    value: *mut *mut std::ffi::c_char,
    _extra: *mut *mut std::ffi::c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    // SAFETY: PostgreSQL passes the proposed value (a pointer to a NUL-terminated string or to
    // NULL), read here; the messages are copied into `ErrorContext`, where guc.c's own
    // check-hook messages live (`format_elog_string`), for it to raise.
    unsafe {
        // A parallel worker starts with its leader's settings, whatever made them.
        if value.is_null() || (*value).is_null() || pg_sys::InitializingParallelWorker {
            return true;
        }
        let value = std::ffi::CStr::from_ptr(*value).to_string_lossy();
        let Some(refused) = refusal_of(&value, true) else {
            return true;
        };
        let (code, message, detail, hint) = crate::error::parts(refused);
        let copy = |text: &str| {
            let text = CString::new(text.replace('\0', "")).unwrap_or_default();
            pg_sys::MemoryContextStrdup(pg_sys::ErrorContext, text.as_ptr())
        };
        pg_sys::GUC_check_errcode(code);
        pg_sys::GUC_check_errmsg_string = copy(&message);
        if let Some(detail) = detail {
            pg_sys::GUC_check_errdetail_string = copy(&detail);
        }
        if let Some(hint) = hint {
            pg_sys::GUC_check_errhint_string = copy(&hint);
        }
        false
    }
}

/// [`only_as_sent`]'s refusal of `value` for the setting, or nothing where it takes it: an empty value always; a partition only as the extension sends it, and only the one this
/// session holds for the transaction — the first value it took (transaction state, so a
/// rollback to a savepoint taken before it releases it) or the one its own calls pinned.
/// `take`: record the value as this session's first where it has none.
fn refusal_of(value: &str, take: bool) -> Option<Error> {
    if value.is_empty() {
        return None;
    }
    if !SENDING.get() && !REPLAYING.get() {
        return Some(refusal_with(
            "syncular.push_partition is the extension's: it sets it when a push transaction's \
             first call names its partition, and a host may only empty it (docs/SCALING.md, \
             \"One partition per push transaction\")"
                .to_string(),
        ));
    }
    match txn_local::get(Key::CitusPushPartitionTaken).or_else(pinned) {
        Some(first) if first != value => Some(refusal_with(format!(
            "this transaction's push is held to partition {first:?}, and \
             syncular.push_partition names one partition per transaction: a push to partition \
             {value:?} goes in a transaction of its own (docs/SCALING.md, \"One partition per \
             push transaction\")"
        ))),
        Some(_) => None,
        None => {
            if take {
                txn_local::set(Key::CitusPushPartitionTaken, value);
            }
            None
        }
    }
}

/// Called by the library's utility hook before every utility statement runs, with whether it
/// is a top-level statement. Notes a `SET LOCAL syncular.push_partition` that Citus replays
/// here for the node the client reached ([`only_as_sent`]) — a top-level statement of a session
/// Citus opened from another node (its statements come from that node; a host's code reaches
/// it only inside a query or function, never at the top level). The note lasts while the
/// statement runs ([`replay_done`]). And a setting of it that [`only_as_sent`] would refuse is refused
/// here, before the statement runs: Citus sends a `SET LOCAL` to the other nodes before it
/// makes it here, and their refusal reaches the client only as Citus's "failure on connection
/// marked as essential".
///
/// # Safety
/// `statement` is the `PlannedStmt` PostgreSQL hands the utility hook.
pub unsafe fn note_replay(statement: *mut pg_sys::PlannedStmt, top_level: bool) {
    // SAFETY: the caller's guarantee; a setting command's name is NUL-terminated or NULL.
    let set = unsafe {
        super::setting_command(statement).filter(|set| {
            !(**set).name.is_null()
                && std::ffi::CStr::from_ptr((**set).name) == c"syncular.push_partition"
        })
    };
    let Some(set) = set else {
        REPLAYING.set(false);
        return;
    };
    // SAFETY: `set` is the statement's valid node.
    let local = unsafe { (*set).is_local };
    REPLAYING.set(top_level && local && replay_here());
    // SAFETY: as above.
    unsafe { refuse_before_sending(set) };
}

/// Ends the window [`note_replay`] opened, as the utility hook's statement returns. A statement
/// that raised an error skips this; the planner hook, every executor start and the next utility
/// statement close the window too (red team 63, F1: it stayed open into the planning of the
/// next statement, where a host's function that the planner folds set the value as if Citus had
/// sent it).
pub fn replay_done() {
    REPLAYING.set(false);
}

/// Raises [`only_as_sent`]'s refusal of the value `set` names, if it would refuse it, behind
/// pgrx's guard (called from the utility hook).
///
/// # Safety
/// `set` is a valid `VariableSetStmt` of this setting.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn refuse_before_sending(set: *mut pg_sys::VariableSetStmt) {
    // SAFETY: the caller's statement; `ExtractSetVariableArgs` returns its value as guc.c will
    // read it (palloc'd, or NULL for `DEFAULT`), copied out here.
    let value = unsafe {
        if (*set).kind != pg_sys::VariableSetKind::VAR_SET_VALUE {
            return;
        }
        let value = pg_sys::ExtractSetVariableArgs(set);
        if value.is_null() {
            return;
        }
        std::ffi::CStr::from_ptr(value)
            .to_string_lossy()
            .into_owned()
    };
    if let Some(refused) = refusal_of(&value, false) {
        crate::error::raise_error(refused)
    }
}

/// Whether a top-level statement here may be Citus replaying what another node sent, behind
/// pgrx's guard: called from the utility hook, which has none (an ERROR of a catalog lookup is
/// raised from here). A session Citus opened from another node (its `application_name`) that
/// has not begun a distributed transaction of its own. Citus replays the settings before the
/// statement that makes the session a participant (`assign_distributed_transaction_id`, after
/// them in the `BEGIN` it sends), so being one cannot be asked; not having begun one can. Both
/// are the client's to forge (red teams 61 and 62): this keeps a host's code and an ordinary
/// client out, and what holds against a forger is that a session takes one partition per
/// transaction ([`refusal_of`]).
#[pgrx::pg_guard]
extern "C-unwind" fn replay_here() -> bool {
    // SAFETY: Citus is installed (checked first), so its library is loaded;
    // `bool IsExternalClientBackend(void)` reads a backend global.
    super::installed()
        && !unsafe { super::library_flag(c"IsExternalClientBackend") }.unwrap_or(true)
        && distributed_transaction() != Some(true)
}

/// The functions whose partition is pinned: they begin, stage, append or store a push's result.
pub const PINNED_BY: [&str; 5] = [
    "push_begin",
    "push_commit",
    "append_commit",
    "put_push_result",
    "push_finish",
];

/// Pins `partition` for this transaction, or refuses it where another one is pinned — here or,
/// sent with the transaction's settings, on the node the client reached. Where Citus does not
/// distribute the sync tables, or inside host code (refused as such by the call it makes):
/// nothing.
pub fn require(partition: &str) -> Result<()> {
    if crate::error::HostCode::running() || !super::installed() {
        return Ok(());
    }
    // SAFETY: inside a transaction (the caller's).
    if !unsafe { super::sync_tables_distributed() } {
        return Ok(());
    }
    // Pinned on the node the client reached and sent here: a call that runs here inside
    // something Citus routed whole to this node — a host's function in a query over a
    // distributed table — is held to it too (red team 57, F1).
    match SENT.get().filter(|sent| !sent.is_empty()) {
        Some(sent) if sent.to_bytes() != partition.as_bytes() => {
            return Err(refusal(&sent.to_string_lossy(), partition));
        }
        Some(_) => {}
        None if unsent_on_a_participant() => return Err(unsent(partition)),
        None => {}
    }
    // Kept as the transaction's own state: a rollback to a savepoint taken before the pin
    // releases it, as it undoes the calls and, on every node, the setting sent (red team 58,
    // F2: the setting was undone and the pin kept).
    match txn_local::get(Key::CitusPushPartition) {
        Some(first) if first != partition => Err(refusal(&first, partition)),
        Some(_) => Ok(()),
        None => {
            txn_local::set(Key::CitusPushPartition, partition);
            send(partition)
        }
    }
}

/// Whether this session runs its statements for a distributed transaction another session
/// began (Citus's `assign_distributed_transaction_id`, sent with the `BEGIN` of every
/// connection of a transaction that may reach several nodes: a transaction block, a `DO` block,
/// a function's statements). There the session that began it pinned the partition and sent it
/// before any call of these reaches this node ([`send`]), so a call that finds none arrives
/// inside something else the client sent — a host's function in a query Citus routed here —
/// before the transaction's push began (red team 59, F2: it pinned this node alone, and the node
/// the client reached let a push to another partition through), or after a resend that could
/// not be made. A statement Citus sends alone (a call outside a transaction) reaches one node
/// and is not one of these. Decided by Citus's record of the transaction, not by the session's
/// `application_name`, which the host's function may change.
fn unsent_on_a_participant() -> bool {
    distributed_transaction().is_some_and(|originator| !originator)
}

/// Whether this session takes part in a distributed transaction, and if so whether it began it
/// (Citus's distributed transaction id: assigned by the session itself when it first sends a
/// statement of a transaction to another node, or by the node that did, with the `BEGIN` Citus
/// sends; cleared when the transaction ends).
fn distributed_transaction() -> Option<bool> {
    // SAFETY: Citus is installed (the callers checked), so its library is loaded;
    // `DistributedTransactionId *GetCurrentDistributedTransactionId(void)` returns a palloc'd
    // copy of this backend's entry (src/include/distributed/transaction_identifier.h in Citus
    // 13), read here and freed.
    unsafe {
        let found = super::library_function(c"GetCurrentDistributedTransactionId");
        if found.is_null() {
            return None;
        }
        let get: unsafe extern "C-unwind" fn() -> *mut DistributedTransactionId =
            std::mem::transmute(found);
        let id = pg_sys::ffi::pg_guard_ffi_boundary(|| get());
        if id.is_null() {
            return None;
        }
        let state = ((*id).transaction_number != 0).then_some((*id).transaction_originator);
        pg_sys::pfree(id.cast());
        state
    }
}

/// Citus 13's `DistributedTransactionId` (src/include/distributed/transaction_identifier.h).
#[repr(C)]
struct DistributedTransactionId {
    initiator_node_identifier: std::ffi::c_int,
    transaction_originator: bool,
    transaction_number: u64,
    timestamp: pg_sys::TimestampTz,
}

/// `SY004` `citus_one_partition` with `hint`: every refusal of the one-partition rule, here and
/// in `super::subquery`.
pub(super) fn refusal_with(hint: String) -> Error {
    Error::invalid_transaction_state("citus_one_partition").with_hint(hint)
}

fn unsent(partition: &str) -> Error {
    refusal_with(format!(
        "this call for partition {partition:?} runs on a node Citus sent it to inside a \
         distributed transaction whose push did not begin on the node the client reached: on \
         Citus begin the push with a direct call of the push's functions before a host's \
         function calls them (docs/SCALING.md, \"One partition per push transaction\")"
    ))
}

fn refusal(first: &str, partition: &str) -> Error {
    refusal_with(format!(
        "this transaction pushes to partition {first:?}: on Citus a push transaction's calls \
         are delegated to its partition's node, so a push to partition {partition:?} goes in a \
         transaction of its own (docs/SCALING.md, \"One partition per push transaction\")"
    ))
}

/// Has Citus send the pinned `partition` to every node of the transaction, the ones it reached
/// and the ones it reaches later: a `SET LOCAL syncular.push_partition` made while
/// `citus.propagate_set_commands = local` (as `super::send_lock_timeout` sends the barrier's
/// timeout; harmless on the owner's connections, so not a reason to refuse a call,
/// `super::propagated`). For every new pin, whatever the session's own value of the setting (red
/// team 58, F1: a host that set it first kept it from being sent), in a client's session where
/// Citus propagates a `SET LOCAL` — a transaction that may reach several nodes
/// (`IsMultiStatementTransaction`: a transaction block, a `DO` block, a function's statements);
/// a statement alone reaches one node, and a worker's sessions are reached through the
/// client's. Where it is made is kept for [`resend_where_forgotten`].
fn send(partition: &str) -> Result<()> {
    // SAFETY: Citus is installed (the callers checked), so its library is loaded;
    // `bool IsMultiStatementTransaction(void)` and `bool IsExternalClientBackend(void)` read
    // backend state.
    let sends = unsafe {
        super::library_flag(c"IsMultiStatementTransaction").unwrap_or(false)
            && super::library_flag(c"IsExternalClientBackend").unwrap_or(false)
    };
    if !sends {
        return Ok(());
    }
    crate::db::with_settings(&[(c"citus.propagate_set_commands", c"local")], || {
        let before = SENDING.replace(true);
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            super::propagated::ours(|| {
                Spi::run(&format!(
                    "SET LOCAL syncular.push_partition = {}",
                    quote_literal(partition)
                ))
            })
        }));
        SENDING.set(before);
        made.unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        Ok(())
    })?;
    // SAFETY: reads a backend global; never errors.
    let subtransaction = unsafe { pg_sys::GetCurrentSubTransactionId() };
    SENT_IN.set(Some((port::local_transaction_id(), subtransaction)));
    Ok(())
}

/// Sends the pin again where Citus forgot it: Citus keeps a `SET LOCAL` with the subtransaction
/// it was made in and drops it when that subtransaction ends — released as well as rolled back —
/// so a pin taken inside a savepoint that was then released (psql's `ON_ERROR_ROLLBACK`, a
/// driver's autosave, a PL/pgSQL exception block that ended normally) reached none of the
/// connections Citus opened afterwards, and a host's function routed there ran unpinned (red
/// team 59, F1). Called as every statement's executor starts ([`resend_guarded`]), before Citus
/// opens a connection for it; where the subtransaction the pin was sent in is still open (every
/// statement of a transaction that took no savepoint since), it costs two comparisons. A pin a
/// rollback released is not sent again; inside host code of a call, or in parallel mode, it
/// waits for a later statement.
fn resend_where_forgotten() -> Result<()> {
    let Some((transaction, subtransaction)) = SENT_IN.get() else {
        return Ok(());
    };
    if transaction != port::local_transaction_id() {
        SENT_IN.set(None);
        return Ok(());
    }
    // SAFETY: walk the current transaction's subtransaction states and read a backend flag;
    // neither errors. No setting can be made in parallel mode: the re-send waits for a statement
    // outside it (the next top-level one starts before it enters it).
    if unsafe { pg_sys::SubTransactionIsActive(subtransaction) || pg_sys::IsInParallelMode() }
        || crate::error::HostCode::running()
    {
        return Ok(());
    }
    SENT_IN.set(None);
    match pinned() {
        Some(partition) => send(&partition),
        None => Ok(()),
    }
}

/// [`resend_where_forgotten`] behind pgrx's guard, for the library's executor hook
/// (src/schema/executor_snapshots.rs): its error is raised from here.
#[pgrx::pg_guard]
pub extern "C-unwind" fn resend_guarded() {
    replay_done();
    if let Err(error) = resend_where_forgotten() {
        crate::error::raise_error(error)
    }
}

/// The partition this transaction pinned, if it pinned one.
pub fn pinned() -> Option<String> {
    txn_local::get(Key::CitusPushPartition)
}
