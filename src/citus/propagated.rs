//! The `SET LOCAL` commands Citus replays on its connections (red team 46, F1;
//! docs/SECURITY.md rule 20; docs/SCALING.md, "Settings Citus sends to other nodes").
//!
//! With `citus.propagate_set_commands = local` — a setting any role may make — Citus records
//! every `SET LOCAL` (and `RESET`, `SET TRANSACTION`) of a transaction block and sends it to
//! every connection of the transaction, the ones it has and the ones it opens later, whatever
//! user the connection is for. The extension's own statements that Citus sends to another node
//! (a call through the coordinator, a write of a reference table) go over connections opened as
//! the extension owner, and Citus's deparsed SQL names built-in functions unqualified
//! (`read_intermediate_result`, `lock_shard_resources`): a caller's `SET LOCAL search_path =
//! app, pg_catalog` ran the migrator's function of that name as the owner — a superuser — on the
//! worker. The pinned `search_path` of the extension's functions is a function setting, which
//! Citus does not send. So a transaction in which such a command was made — before a call, or by
//! host code during one — has the call refused, `SY004` reason `citus_propagated_settings`,
//! before any statement of the owner's runs ([`refuse`], checked by `error::run` before every
//! call's body — a definer function's first statement included, red team 47, F2 — and by
//! `access::switched` on entry to and exit from every scope, after host code): the library's
//! utility hook sees each such command as it is made
//! ([`observe`]), whatever `citus.propagate_set_commands` is set back to afterwards (Citus keeps
//! replaying what it recorded). The one command of the extension's own, the barrier's
//! `lock_timeout` ([`super::send_lock_timeout`]), is made as [`ours`].

use crate::error::{Error, Result};
use pgrx::pg_sys;
use std::cell::Cell;

thread_local! {
    /// The local transaction in which a command Citus propagates was made (conservatively kept
    /// to its end: a command of a subtransaction stays applied on the connections that had it).
    static PROPAGATED_IN: Cell<Option<pg_sys::LocalTransactionId>> = const { Cell::new(None) };
    /// True while the extension makes its own command ([`ours`]).
    static OURS: Cell<bool> = const { Cell::new(false) };
}

/// Called by the library's utility hook for every utility statement, before it runs: answers a
/// setting command made while `citus.propagate_set_commands = local`, for [`refuse_propagation`]
/// to decide as Citus does whether Citus sends it. Citus sends such a
/// command to every connection the transaction has or opens — the extension owner's, and the
/// superuser connections Citus opens for its own metadata inside the transaction — as the whole
/// text of the message that carried it, which each node parses again by its own rules. Red team
/// 64: after a call whose statements reached a worker over the owner's connection, the message
/// `SET LOCAL work_mem = '5MB'; COMMIT; CREATE TABLE …` ran the `CREATE TABLE` there as the
/// owner, a superuser, and with `standard_conforming_strings` off in the client's session alone
/// one `SET` was a `COMMIT` and a `BEGIN` on the workers; red team 65: with no call of the
/// extension at all, a migrator's `create_distributed_table` made Citus open its own superuser
/// connections, which started by replaying such a message. No error, no allocation: a node tag
/// and one setting's current value.
///
/// # Safety
/// `statement` is the `PlannedStmt` PostgreSQL hands the utility hook.
pub unsafe fn observe(statement: *mut pg_sys::PlannedStmt) -> Option<*mut pg_sys::VariableSetStmt> {
    if OURS.get() {
        return None;
    }
    // SAFETY: the caller's guarantee.
    let set = unsafe { super::setting_command(statement) }?;
    // SAFETY: a NUL-terminated name; `missing_ok`, so NULL where Citus is not loaded; the value
    // is guc.c's own string, read before anything else runs.
    let local = unsafe {
        let value = pg_sys::GetConfigOption(c"citus.propagate_set_commands".as_ptr(), true, false);
        !value.is_null() && std::ffi::CStr::from_ptr(value) == c"local"
    };
    local.then_some(set)
}

/// Decides, as Citus does (its `IsMultiStatementTransaction` and `ShouldPropagateSetCommand`:
/// a `SET LOCAL` or `RESET` of a setting it deems safe to send, a `RESET ALL`, inside a
/// transaction block, a `DO` block or a function), whether Citus sends the command [`observe`]
/// answered, and refuses one it sends in a database where the extension is installed on Citus —
/// whatever else the transaction does: Citus's own superuser connections take its text too, no
/// call of the extension needed (red team 65, F1). Elsewhere the command is noted for the calls
/// of the transaction ([`refuse`]). Behind pgrx's guard, called from the utility hook before the
/// statement — and Citus's sending of it — runs. The extension's own commands ([`ours`]) never
/// reach here. A database without the extension is Citus's alone.
///
/// # Safety
/// `set` is the statement [`observe`] answered.
#[pgrx::pg_guard]
pub unsafe extern "C-unwind" fn refuse_propagation(set: *mut pg_sys::VariableSetStmt) {
    // SAFETY: Citus's library is loaded (its setting is defined); `bool
    // IsMultiStatementTransaction(void)` reads backend state and `bool
    // ShouldPropagateSetCommand(VariableSetStmt *)` the statement and Citus's settings
    // (src/backend/distributed/commands/variableset.c in Citus 13); a Citus without the second
    // has every command counted; the extension is looked up by name in the statement's
    // transaction (`missing_ok`).
    let (sent, here) = unsafe {
        let sent = super::library_flag(c"IsMultiStatementTransaction").unwrap_or(true) && {
            let found = super::library_function(c"ShouldPropagateSetCommand");
            found.is_null() || {
                let should: unsafe extern "C-unwind" fn(*mut pg_sys::VariableSetStmt) -> bool =
                    std::mem::transmute(found);
                pg_sys::ffi::pg_guard_ffi_boundary(|| should(set))
            }
        };
        let here = sent
            && pg_sys::get_extension_oid(c"syncular".as_ptr(), true) != pg_sys::InvalidOid
            && super::installed();
        (sent, here)
    };
    if !sent {
        return;
    }
    if !here {
        PROPAGATED_IN.set(Some(crate::port::local_transaction_id()));
        return;
    }
    crate::error::raise_error(
        Error::invalid_transaction_state("citus_propagated_settings").with_hint(
            "Citus sends a SET LOCAL or RESET made while citus.propagate_set_commands = \
             'local' inside a transaction — the whole text of its message — to every \
             connection of the transaction, the extension owner's and Citus's own superuser \
             connections included, so in a database with syncular it is refused: set such \
             settings per role (ALTER ROLE … SET) or in the session, not propagated \
             (docs/SCALING.md, \"Settings Citus sends to other nodes\")",
        ),
    )
}

/// Refuses the call where this transaction made a command Citus replays on the extension
/// owner's connections ([`observe`]; refused as it is made where the extension is installed, so
/// here one made before, or Citus's replay of one on a node whose session propagates too) — or
/// might have, unseen: a node of a Citus database that did not load the library when it started
/// ran the session's first statements without the hook (`super::require_preloaded`).
pub fn refuse() -> Result<()> {
    if PROPAGATED_IN.get() != Some(crate::port::local_transaction_id_if_any()) {
        if super::installed() {
            super::require_preloaded()?;
        }
        return Ok(());
    }
    Err(
        Error::invalid_transaction_state("citus_propagated_settings").with_hint(
            "this transaction made a SET LOCAL, RESET or SET TRANSACTION while \
             citus.propagate_set_commands = 'local': Citus replays those on every connection of \
             the transaction, the extension owner's included, so the extension's statements \
             cannot run in it — call it in a transaction without them (docs/SCALING.md, \
             \"Settings Citus sends to other nodes\")",
        ),
    )
}

/// Runs `body`, in which the extension makes a command of its own that Citus propagates.
pub fn ours<R>(body: impl FnOnce() -> R) -> R {
    let before = OURS.replace(true);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    OURS.set(before);
    result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}
