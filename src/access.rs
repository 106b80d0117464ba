//! Who acts: the calling role, the extension owner, and the switches between them.
//!
//! The rule of docs/SECURITY.md in code: the extension owner's rights are only ever used for
//! statements over the extension's own `sync_*` tables; a host relation is touched only as its
//! owner (or the caller) in a *restricted security context* (as PostgreSQL's own `ANALYZE` and
//! `REFRESH MATERIALIZED VIEW` do), so whatever code the host attached to it (policies,
//! triggers, functions in defaults) runs with its author's rights and cannot change role.
//!
//! The switches themselves, and the settings they pin and discard, are [`crate::sandbox`]'s.
//!
//! Functions that need the caller's identity (to check its privileges) are declared
//! `SECURITY INVOKER` and switch to the owner themselves with [`as_extension_owner`]: inside a
//! `SECURITY DEFINER` function the caller's role is no longer known.

use crate::db;
use crate::error::{Error, Result};
use crate::sandbox;
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

/// Runs `body` with the extension owner's rights, for statements over `sync_*` tables only, under
/// the pinned `search_path` ([`sandbox::as_owner`]).
pub fn as_extension_owner<R>(
    client: &SpiClient<'_>,
    body: impl FnOnce() -> Result<R>,
) -> Result<R> {
    sandbox::as_owner(extension_owner(client)?, body)
}
