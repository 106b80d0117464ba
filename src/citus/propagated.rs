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

use crate::error::{Code, Error, Result};
use pgrx::pg_sys;
use std::cell::Cell;

thread_local! {
    /// The local transaction in which a command Citus propagates was made (conservatively kept
    /// to its end: a command of a subtransaction stays applied on the connections that had it).
    static PROPAGATED_IN: Cell<Option<pg_sys::LocalTransactionId>> = const { Cell::new(None) };
    /// True while the extension makes its own command ([`ours`]).
    static OURS: Cell<bool> = const { Cell::new(false) };
    /// The local transaction in which this session called the extension, or planned a call
    /// Citus delegates ([`refuse`], which every call, every owner scope and the planner hook
    /// ask first).
    static CALLED_IN: Cell<Option<pg_sys::LocalTransactionId>> = const { Cell::new(None) };
}

/// Called by the library's utility hook for every utility statement, before it runs: notes a
/// `SET LOCAL`, `RESET` or `SET TRANSACTION` made while Citus propagates them, and answers
/// whether the statement must be refused ([`refuse_propagation`]): one made in a transaction
/// that called the extension. Citus sends such a command to every connection the transaction
/// has — the extension owner's among them once a call sent the owner's statements to another
/// node — as the whole text of the message that carried it, which the other node parses again
/// by its own rules (red team 64: a message `SET LOCAL work_mem = '5MB'; COMMIT; CREATE TABLE
/// …` ran the `CREATE TABLE` on a worker as the extension owner, a superuser; and with
/// `standard_conforming_strings` off in the client's session alone, one `SET` there was a
/// `COMMIT` and a `BEGIN` on every worker). So a transaction either makes such commands or calls
/// the extension: a call after one is refused by [`refuse`], one after a call here. No error, no
/// allocation: a node tag, the statement's fields and one setting's current value.
///
/// # Safety
/// `statement` is the `PlannedStmt` PostgreSQL hands the utility hook.
pub unsafe fn observe(statement: *mut pg_sys::PlannedStmt) -> bool {
    if OURS.get() || statement.is_null() {
        return false;
    }
    // SAFETY: the caller's guarantee; a node's tag is its first field.
    let set = unsafe {
        let utility = (*statement).utilityStmt;
        if utility.is_null() || (*utility).type_ != pg_sys::NodeTag::T_VariableSetStmt {
            return false;
        }
        utility.cast::<pg_sys::VariableSetStmt>()
    };
    // SAFETY: a NUL-terminated name; `missing_ok`, so NULL where Citus is not loaded; the value
    // is guc.c's own string, read before anything else runs.
    let local = unsafe {
        let value = pg_sys::GetConfigOption(c"citus.propagate_set_commands".as_ptr(), true, false);
        !value.is_null() && std::ffi::CStr::from_ptr(value) == c"local"
    };
    if !local {
        return false;
    }
    // What Citus's `ShouldPropagateSetCommand` may send (a superset: a setting it deems unsafe
    // to send is counted too).
    // SAFETY: a `VariableSetStmt` (its tag was checked).
    let sent = unsafe {
        use pg_sys::VariableSetKind::*;
        match (*set).kind {
            VAR_SET_VALUE | VAR_SET_CURRENT | VAR_SET_DEFAULT => (*set).is_local,
            _ => true,
        }
    };
    if !sent {
        return false;
    }
    let here = crate::port::local_transaction_id();
    PROPAGATED_IN.set(Some(here));
    CALLED_IN.get() == Some(here)
}

/// Raises the refusal of a command [`observe`] answered for, behind pgrx's guard (called from
/// the utility hook, before the statement — and Citus's sending of it — runs).
#[pgrx::pg_guard]
pub extern "C-unwind" fn refuse_propagation() {
    crate::error::raise_error(Error::Sync {
        code: Code::InvalidTransactionState,
        detail: Some(serde_json::json!({"reason": "citus_propagated_settings"})),
        hint: Some(
            "this transaction called the extension, and Citus sends a SET LOCAL, RESET or SET \
             TRANSACTION made while citus.propagate_set_commands = 'local' — the whole text of \
             its message — to every connection of the transaction, the extension owner's \
             included: make it in a transaction without the extension's calls (docs/SCALING.md, \
             \"Settings Citus sends to other nodes\")"
                .to_string(),
        ),
    })
}

/// Refuses the call where this transaction made a command Citus replays on the extension
/// owner's connections ([`observe`]) — or might have, unseen — and notes that the transaction
/// called the extension (a command after it is refused, [`observe`]): a node of a Citus database that
/// did not load the library when it started ran the session's first statements without the
/// hook (`super::require_preloaded`).
pub fn refuse() -> Result<()> {
    let here = crate::port::local_transaction_id_if_any();
    CALLED_IN.set(Some(here));
    if PROPAGATED_IN.get() != Some(here) {
        if super::installed() {
            super::require_preloaded()?;
        }
        return Ok(());
    }
    Err(Error::Sync {
        code: Code::InvalidTransactionState,
        detail: Some(serde_json::json!({"reason": "citus_propagated_settings"})),
        hint: Some(
            "this transaction made a SET LOCAL, RESET or SET TRANSACTION while \
             citus.propagate_set_commands = 'local': Citus replays those on every connection of \
             the transaction, the extension owner's included, so the extension's statements \
             cannot run in it — call it in a transaction without them (docs/SCALING.md, \
             \"Settings Citus sends to other nodes\")"
                .to_string(),
        ),
    })
}

/// Runs `body`, in which the extension makes a command of its own that Citus propagates.
pub fn ours<R>(body: impl FnOnce() -> R) -> R {
    let before = OURS.replace(true);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    OURS.set(before);
    result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}
