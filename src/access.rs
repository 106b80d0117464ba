//! Who acts: the calling role, the extension owner, and the switches between them.
//!
//! The rule of docs/SECURITY.md in code: the extension owner's rights are only ever used for
//! statements over the extension's own `sync_*` tables; a host relation is touched only as its
//! owner (or the caller) in a *restricted security context* (as PostgreSQL's own `ANALYZE` and
//! `REFRESH MATERIALIZED VIEW` do), so whatever code the host attached to it (policies,
//! triggers, functions in defaults) runs with its author's rights and cannot change role.
//!
//! The switch itself ([`switched`]) pins `search_path` for both identities; the host's side of
//! it — a restricted security context and a GUC nest level discarded afterwards — is reached
//! only through src/tables/sandbox.rs, the one place host code runs (docs/SECURITY.md, rules 1
//! and 12).
//!
//! Functions that need the caller's identity (to check its privileges) are declared
//! `SECURITY INVOKER` and switch to the owner themselves with [`as_extension_owner`]: inside a
//! `SECURITY DEFINER` function the caller's role is no longer known.

use crate::error::{Error, Result};
use crate::txn_local::{self, Key};
use pgrx::pg_sys;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

/// The role the current statement runs as (the caller, in a `SECURITY INVOKER` function).
pub fn current_role() -> pg_sys::Oid {
    // SAFETY: reads a backend global; no allocation, never errors.
    unsafe { pg_sys::GetUserId() }
}

/// The role that owns the extension (the superuser that created it, or whom it was given to).
pub fn extension_owner() -> Result<pg_sys::Oid> {
    // Read once per transaction (a push asks twice): the owner changes only by ALTER EXTENSION
    // … OWNER TO, which a running push does not do.
    if let Some(oid) = txn_local::get(Key::ExtensionOwner).and_then(|s| s.parse::<u32>().ok()) {
        return Ok(pg_sys::Oid::from(oid));
    }
    // SAFETY: inside the caller's transaction.
    let owner = unsafe { crate::catalog::extension_owner(c"syncular") }
        .ok_or_else(|| Error::Internal("syncular is not installed".into()))?;
    txn_local::set(Key::ExtensionOwner, &owner.to_u32().to_string());
    Ok(owner)
}

/// Whether `member` holds the privileges of `role` (itself, an inheriting member, or a
/// superuser): PostgreSQL's own ownership rule (`pg_class_ownercheck`).
pub fn has_privileges_of(member: pg_sys::Oid, role: pg_sys::Oid) -> bool {
    // SAFETY: catalog lookups through the syscache; errors surface as a caught PostgreSQL error.
    unsafe { pg_sys::superuser_arg(member) || pg_sys::has_privs_of_role(member, role) }
}

/// An operator is a superuser or holds the extension owner's privileges.
pub fn is_operator(role: pg_sys::Oid) -> Result<bool> {
    Ok(has_privileges_of(role, extension_owner()?))
}

/// Refuses (`invalid_argument`, reason `privilege`) a caller that is not an operator.
pub fn require_operator(argument: &str) -> Result<()> {
    if is_operator(current_role())? {
        Ok(())
    } else {
        Err(Error::invalid_argument(argument, "privilege"))
    }
}

/// Runs `body` with the extension owner's rights, for statements over `sync_*` tables only, under
/// the pinned `search_path`.
#[allow(clippy::disallowed_methods)] // the owner's side of the switch (clippy.toml)
pub fn as_extension_owner<R>(body: impl FnOnce() -> Result<R>) -> Result<R> {
    switched(
        extension_owner()?,
        pg_sys::SECURITY_LOCAL_USERID_CHANGE,
        false,
        body,
    )
}

/// The only `search_path` any statement of the extension runs under, owner's or host's.
const PINNED_SEARCH_PATH: &std::ffi::CStr = c"pg_catalog, pg_temp";

/// Runs `body` as `role` with the extra security-context `flags` and the pinned `search_path`,
/// and restores identity and settings afterwards. `discard`: in a GUC nest level of its own,
/// discarded afterwards whatever was set inside (host code). Without it (the owner's scopes) a
/// nest level is opened only when the path must be pinned: inside the API's functions (each
/// `SET search_path TO pg_catalog, pg_temp`) it already is — host changes never outlive their
/// own scope — and closing a nest level walks every setting on PostgreSQL 15
/// (docs/BENCHMARKS.md, notes), which an owner's scope, where no host code runs, does not need.
pub fn switched<R>(
    role: pg_sys::Oid,
    flags: u32,
    discard: bool,
    body: impl FnOnce() -> Result<R>,
) -> Result<R> {
    // On Citus, no scope runs in a transaction whose SET LOCALs Citus replays on the owner's
    // connections — made before the call, or by host code in an earlier scope of it.
    crate::citus::propagated::refuse()?;
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
            // Host code of this scope made one: refused before the caller's next statement.
            result.and_then(|r| crate::citus::propagated::refuse().map(|()| r))
        }
        Err(panic) => resume_unwind(panic),
    }
}
