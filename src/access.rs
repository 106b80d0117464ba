//! Who acts: the calling role, the extension owner, and the switches between them.
//!
//! The rule of docs/SECURITY.md in code: the extension owner's rights are only ever used for
//! statements over the extension's own `sync_*` tables; a host relation is touched only as its
//! owner in a *restricted security context* (as PostgreSQL's own `ANALYZE` and
//! `REFRESH MATERIALIZED VIEW` do), so whatever code the host attached to it (policies,
//! triggers, functions in defaults) runs with its author's rights and cannot change role.
//!
//! Functions that need the caller's identity (to check its privileges) are declared
//! `SECURITY INVOKER` and switch to the owner themselves with [`as_extension_owner`]: inside a
//! `SECURITY DEFINER` function the caller's role is no longer known.

use crate::db;
use crate::error::{Error, Result};
use crate::txn_local::{self, Key};
use pgrx::pg_sys;
use pgrx::spi::SpiClient;

/// The role the current statement runs as (the caller, in a `SECURITY INVOKER` function).
pub fn current_role() -> pg_sys::Oid {
    // SAFETY: reads a backend global; no allocation, never errors.
    unsafe { pg_sys::GetUserId() }
}

/// The role that owns the extension (the superuser that created it, or whom it was given to).
pub fn extension_owner(client: &SpiClient<'_>) -> Result<pg_sys::Oid> {
    // Read once per transaction (a push asks twice): the owner changes only by ALTER EXTENSION
    // … OWNER TO, which a running push does not do.
    if let Some(oid) = txn_local::get(Key::ExtensionOwner).and_then(|s| s.parse::<u32>().ok()) {
        return Ok(pg_sys::Oid::from(oid));
    }
    let owner = db::first::<pg_sys::Oid>(db::read(
        client,
        "SELECT e.extowner FROM pg_catalog.pg_extension e WHERE e.extname = 'syncular'",
        &[],
    )?)?
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
pub fn is_operator(client: &SpiClient<'_>, role: pg_sys::Oid) -> Result<bool> {
    Ok(has_privileges_of(role, extension_owner(client)?))
}

/// Refuses (`invalid_argument`, reason `privilege`) a caller that is not an operator.
pub fn require_operator(client: &SpiClient<'_>, argument: &str) -> Result<()> {
    if is_operator(client, current_role())? {
        Ok(())
    } else {
        Err(Error::invalid_argument(argument, "privilege"))
    }
}

/// Runs `body` as `role` with the given extra security-context flags, and switches back. An
/// error aborts the (sub)transaction, which restores user and context as well.
fn as_role<R>(role: pg_sys::Oid, flags: u32, body: impl FnOnce() -> Result<R>) -> Result<R> {
    let (mut user, mut context) = (pg_sys::InvalidOid, 0);
    // SAFETY: the documented pair of miscinit.c; the saved values are restored below on every
    // Rust return path, and PostgreSQL's abort processing restores them on an ERROR.
    unsafe {
        pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
        pg_sys::SetUserIdAndSecContext(role, context | flags as i32);
    }
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    // SAFETY: as above.
    unsafe { pg_sys::SetUserIdAndSecContext(user, context) };
    match outcome {
        Ok(result) => result,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// Runs `body` with the extension owner's rights, for statements over `sync_*` tables only.
pub fn as_extension_owner<R>(
    client: &SpiClient<'_>,
    body: impl FnOnce() -> Result<R>,
) -> Result<R> {
    let owner = extension_owner(client)?;
    as_role(owner, pg_sys::SECURITY_LOCAL_USERID_CHANGE, body)
}

/// Runs `body` as `owner` (a host relation's owner) in a restricted security context: code the
/// host attached to its relation runs with the host's own rights and cannot `SET ROLE`, create
/// temporary objects or otherwise leave that context.
pub fn as_relation_owner<R>(owner: pg_sys::Oid, body: impl FnOnce() -> Result<R>) -> Result<R> {
    as_restricted(owner, body)
}

/// Runs `body` as `role` in a restricted security context: the one-call push reads and writes
/// app rows as its caller this way (docs/SECURITY.md, rule 10), from inside the extension
/// owner's rights.
pub fn as_restricted<R>(role: pg_sys::Oid, body: impl FnOnce() -> Result<R>) -> Result<R> {
    as_role(
        role,
        pg_sys::SECURITY_LOCAL_USERID_CHANGE | pg_sys::SECURITY_RESTRICTED_OPERATION,
        body,
    )
}
