//! The one place host code runs: the extension acts as a host role only here, and discards what
//! host code may leave behind.
//!
//! docs/SECURITY.md, rules 1 and 12. A call of the API runs with two identities:
//! - the **extension owner's**, for statements over the extension's own `sync_*` tables
//!   (`access::as_extension_owner`);
//! - a **host role's** for a statement over a host relation ([`host_code`], private to
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
//! (the depth [`host_code`] counts, checked by `error::run`: [`crate::error::HostCode`]): a trigger of an app table calling
//! `put_push_result` or `migrate_schema` in the middle of a `push_commit` would change what that
//! call checked before it wrote. The row-meta trigger (the extension's own, firing on the host
//! writes of a one-call push) and the pure codec functions are exempt (`error::run_in_host_code`).

use crate::access;
use crate::error::{HostCode, Result};
use pgrx::pg_sys;

/// Runs `body` — statements over one host relation — as `role` in a restricted security
/// context, in a GUC nest level discarded afterwards. Only `src/tables/statements.rs` calls it
/// (docs/SECURITY.md rule 10; clippy.toml).
#[allow(clippy::disallowed_methods)] // the host's side of the switch (clippy.toml)
pub(super) fn host_code<R>(role: pg_sys::Oid, body: impl FnOnce() -> Result<R>) -> Result<R> {
    let _depth = HostCode::enter();
    access::switched(
        role,
        pg_sys::SECURITY_LOCAL_USERID_CHANGE | pg_sys::SECURITY_RESTRICTED_OPERATION,
        true,
        body,
    )
}

/// Runs `body` — one statement of the extension's own that calls one of its functions and names
/// no host object (a migration's call of a Citus shard's function, `AppRelation::call_shard`) —
/// as `role`, so that Citus opens its connections to the other nodes as that role, in a
/// restricted security context and a GUC nest level discarded afterwards, as [`host_code`] runs
/// host statements, but without counting as host code: where Citus runs the called function in
/// this backend (its shard is on this node — a coordinator that holds shards), the function is
/// a call of the API and opens host-code scopes of its own for the host statements it runs.
#[allow(clippy::disallowed_methods)] // the host's side of the switch (clippy.toml)
pub(super) fn own_call_as<R>(role: pg_sys::Oid, body: impl FnOnce() -> Result<R>) -> Result<R> {
    access::switched(
        role,
        pg_sys::SECURITY_LOCAL_USERID_CHANGE | pg_sys::SECURITY_RESTRICTED_OPERATION,
        true,
        body,
    )
}
