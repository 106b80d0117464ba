//! The one place where the extension changes whom it acts as, and what host code may leave behind.
//!
//! docs/SECURITY.md, rules 1 and 12. A call of the API runs with two identities:
//! - the **extension owner's**, for statements over the extension's own `sync_*` tables
//!   ([`as_owner`], reached through `access::as_extension_owner`);
//! - a **host role's** for a statement over a host relation ([`host_code`], reached only through
//!   `src/tables/`, the one module that touches host relations): the relation's owner (reads) or
//!   the caller (the one-call push's writes), in a *restricted security context*, so whatever
//!   the host attached to the relation — a trigger, a column default, an index expression, a
//!   CHECK or policy calling a function, a domain's check — runs with its author's rights and
//!   cannot `SET ROLE` or create temporary objects.
//!
//! Both scopes run with `search_path = pg_catalog, pg_temp`; a host-code scope runs in a **GUC
//! nest level of its own** and discards it afterwards (`AtEOXact_GUC(false, level)`): every
//! setting made inside — a `set_config('search_path', 'app, pg_catalog', false)` in a host
//! trigger included, which
//! `SECURITY_RESTRICTED_OPERATION` does not forbid — ends with the scope. Without the discard such
//! a setting outlived the host statement and the extension's next statement of the same call,
//! run with the owner's rights, resolved an unqualified operator to one the host had planted
//! (issue 25's finding: a migrator reached superuser through the server's `push_commit`).
//! PostgreSQL brackets its own restricted operations the same way (`REFRESH MATERIALIZED VIEW`,
//! index builds, `ANALYZE`). On an error the scope is left by unwinding, and the abort of the
//! (sub)transaction that must follow any error discards the nest level, as it does for a
//! function's `SET` clause.
//!
//! While host code runs inside a call, the API refuses to be called from it
//! ([`refuse_in_host_code`], checked by `error::run`): a trigger of an app table calling
//! `put_push_result` or `migrate_schema` in the middle of a `push_commit` would change what that
//! call checked before it wrote. The row-meta trigger (the extension's own, firing on the host
//! writes of a one-call push) and the pure codec functions are exempt (`error::run_in_host_code`).

use crate::error::Result;
use pgrx::pg_sys;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

/// The only `search_path` any statement of the extension runs under, owner's or host's.
const PINNED_SEARCH_PATH: &std::ffi::CStr = c"pg_catalog, pg_temp";

thread_local! {
    /// How many [`host_code`] scopes are open in this backend.
    static HOST_CODE_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Runs `body` (statements over `sync_*` tables) as `owner`, the extension owner.
pub fn as_owner<R>(owner: pg_sys::Oid, body: impl FnOnce() -> Result<R>) -> Result<R> {
    switched(owner, pg_sys::SECURITY_LOCAL_USERID_CHANGE, false, body)
}

/// Runs `body` — statements over one host relation — as `role` in a restricted security
/// context. Only `src/tables/` calls it (docs/SECURITY.md rule 10).
pub fn host_code<R>(role: pg_sys::Oid, body: impl FnOnce() -> Result<R>) -> Result<R> {
    let _depth = HostCodeDepth::enter();
    switched(
        role,
        pg_sys::SECURITY_LOCAL_USERID_CHANGE | pg_sys::SECURITY_RESTRICTED_OPERATION,
        true,
        body,
    )
}

/// `Err` when host code running inside a call of the API calls the API again.
pub fn refuse_in_host_code() -> std::result::Result<(), &'static str> {
    if HOST_CODE_DEPTH.with(Cell::get) == 0 {
        Ok(())
    } else {
        Err("syncular functions cannot be called by host code that runs inside a syncular call")
    }
}

/// Counts an open [`host_code`] scope; the count drops when the scope ends, unwinding included.
struct HostCodeDepth;

impl HostCodeDepth {
    fn enter() -> HostCodeDepth {
        HOST_CODE_DEPTH.with(|d| d.set(d.get() + 1));
        HostCodeDepth
    }
}

impl Drop for HostCodeDepth {
    fn drop(&mut self) {
        HOST_CODE_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// Runs `body` as `role` with the extra security-context `flags` and the pinned `search_path`,
/// and restores identity and settings afterwards. `discard`: in a GUC nest level of its own,
/// discarded afterwards whatever was set inside (host code). Without it (the owner's scopes) a
/// nest level is opened only when the path must be pinned: inside the API's functions (each
/// `SET search_path TO pg_catalog, pg_temp`) it already is — host changes never outlive their
/// own scope — and closing a nest level walks every setting on PostgreSQL 15
/// (docs/BENCHMARKS.md, notes), which an owner's scope, where no host code runs, does not need.
fn switched<R>(
    role: pg_sys::Oid,
    flags: u32,
    discard: bool,
    body: impl FnOnce() -> Result<R>,
) -> Result<R> {
    let (mut user, mut context) = (pg_sys::InvalidOid, 0);
    // SAFETY: the pairs of miscinit.c and guc.c PostgreSQL's own restricted operations use
    // (ExecRefreshMatView): the identity saved here is restored below on every Rust return path
    // and by the (sub)transaction's abort after an ERROR; a nest level opened here is closed
    // below on success and by that abort otherwise. `namespace_search_path` is the setting's
    // current NUL-terminated value (guc.c keeps it valid while it is the value). set_config_option
    // is given a valid setting name and value and raises no error for them (changeVal = true,
    // elevel 0 = ERROR on a bad value, which a constant cannot be).
    let level = unsafe {
        pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
        let current = pg_sys::namespace_search_path;
        let pinned = !current.is_null() && std::ffi::CStr::from_ptr(current) == PINNED_SEARCH_PATH;
        let level = (discard || !pinned).then(|| pg_sys::NewGUCNestLevel());
        if !pinned {
            pg_sys::set_config_option(
                c"search_path".as_ptr(),
                PINNED_SEARCH_PATH.as_ptr(),
                pg_sys::GucContext::PGC_USERSET,
                pg_sys::GucSource::PGC_S_SESSION,
                pg_sys::GucAction::GUC_ACTION_SAVE,
                true,
                0,
                false,
            );
        }
        pg_sys::SetUserIdAndSecContext(role, context | flags as i32);
        level
    };
    let outcome = catch_unwind(AssertUnwindSafe(body));
    // SAFETY: as above.
    unsafe { pg_sys::SetUserIdAndSecContext(user, context) };
    match outcome {
        Ok(result) => {
            if let Some(level) = level {
                // SAFETY: `level` is this scope's nest level and still open: every nested scope
                // closed its own before returning (an inner error unwinds to here as a panic
                // instead). `false` discards what was set inside, non-local `SET`s included.
                unsafe { pg_sys::AtEOXact_GUC(false, level) };
            }
            result
        }
        Err(panic) => resume_unwind(panic),
    }
}
