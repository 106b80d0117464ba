//! The internal subtransaction a one-call push runs its candidate writes in (docs/DESIGN.md
//! §Push path): rolled back for every rejection and fallback, and the classes of PostgreSQL
//! errors after which a batched run is repeated statement by statement.

use crate::error::{self, Result};
use pgrx::prelude::*;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs `body` in an internal subtransaction (as PL/pgSQL's exception blocks do): kept when
/// `keep` says so, rolled back otherwise and on any error, which is returned as the caught
/// panic for the caller to map or re-raise.
pub(crate) fn in_subtransaction<R>(
    body: impl FnOnce() -> R,
    keep: impl FnOnce(&R) -> bool,
) -> std::thread::Result<R> {
    // SAFETY: the xact.c protocol PL/pgSQL follows: begin, switch back to the caller's memory
    // context (results must outlive the subtransaction), then release or roll back exactly once
    // and restore the caller's memory context and resource owner. pgrx turned any ERROR inside
    // `body` into a panic after flushing the error state, so the rollback runs in a clean state.
    let (context, owner) = unsafe {
        let context = pg_sys::CurrentMemoryContext;
        let owner = pg_sys::CurrentResourceOwner;
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(context);
        (context, owner)
    };
    let outcome = catch_unwind(AssertUnwindSafe(body));
    let release = matches!(&outcome, Ok(r) if keep(r));
    // SAFETY: as above; the subtransaction begun here is the current one (every nested one of
    // `body` ended with its statement or was aborted with it).
    unsafe {
        if release {
            pg_sys::ReleaseCurrentSubTransaction();
        } else {
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
        }
        pg_sys::MemoryContextSwitchTo(context);
        pg_sys::CurrentResourceOwner = owner;
    }
    outcome
}

/// Whether a caught PostgreSQL error is of SQLSTATE class 23 (integrity constraint violation).
pub(super) fn integrity_violation(panic: &(dyn std::any::Any + Send)) -> bool {
    in_class(panic, "23000")
}

/// Whether a caught PostgreSQL error is of the SQLSTATE class of `class` (`"23000"`: 23).
fn in_class(panic: &(dyn std::any::Any + Send), class: &str) -> bool {
    let Some(report) = error::postgres_report(panic) else {
        return false;
    };
    let class = crate::port::make_sqlstate(class);
    (report.sql_error_code() as i32) & 0xFFF == class & 0xFFF
}

/// Whether a batched run that failed this way is run again statement by statement: any error
/// whose operation or order a batch may have changed (a constraint, a value, a privilege the
/// rows read up front needed before an earlier operation's rejection, this extension's own) —
/// but not what would end the call anyway: a cancel or shutdown (class 57), a deadlock or
/// serialization failure (40), a lock timeout (55), exhausted resources (53) or a system error
/// (58).
pub(super) fn worth_repeating<R>(outcome: &std::thread::Result<Result<R>>) -> bool {
    match outcome {
        Ok(Ok(_)) => false,
        Ok(Err(_)) => true,
        Err(panic) => !["57000", "40000", "55000", "53000", "58000"]
            .iter()
            .any(|class| in_class(panic.as_ref(), class)),
    }
}
