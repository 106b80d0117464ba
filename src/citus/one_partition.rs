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
//! call checks it.

use crate::error::{Error, Result};
use crate::txn_local::{self, Key};
use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::pg_sys;
use pgrx::spi::{quote_literal, Spi};
use std::ffi::CString;

/// The partition the node the client reached pinned, as Citus hands it to every node of the
/// transaction ([`send`]).
static SENT: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

/// Defines `syncular.push_partition` (from `_PG_init`).
pub fn init() {
    GucRegistry::define_string_guc(
        c"syncular.push_partition",
        c"On Citus, the partition this transaction's push calls are held to.",
        c"Set by the extension (SET LOCAL, which Citus sends to every node of the transaction) when a transaction's first push call names its partition; not a setting for hosts (docs/SCALING.md, \"One partition per push transaction\").",
        &SENT,
        GucContext::Userset,
        GucFlags::NO_SHOW_ALL | GucFlags::NO_RESET_ALL,
    );
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
    if let Some(sent) = SENT.get() {
        let sent = sent.to_string_lossy();
        if !sent.is_empty() && sent != partition {
            return Err(refusal(&sent, partition));
        }
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

fn refusal(first: &str, partition: &str) -> Error {
    Error::invalid_transaction_state("citus_one_partition").with_hint(format!(
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
/// team 58, F1: a host that set it first kept it from being sent), in a client's session inside
/// a transaction block (a statement alone reaches one node; a worker's sessions are reached
/// through the client's).
fn send(partition: &str) -> Result<()> {
    // SAFETY: reads backend state of the current transaction.
    if !unsafe { pg_sys::IsTransactionBlock() } {
        return Ok(());
    }
    // SAFETY: Citus is installed (the caller checked), so its library is loaded;
    // `bool IsExternalClientBackend(void)` reads a backend global.
    if !unsafe { super::library_flag(c"IsExternalClientBackend") }.unwrap_or(false) {
        return Ok(());
    }
    crate::db::with_settings(&[(c"citus.propagate_set_commands", c"local")], || {
        super::propagated::ours(|| {
            Spi::run(&format!(
                "SET LOCAL syncular.push_partition = {}",
                quote_literal(partition)
            ))
        })?;
        Ok(())
    })
}

/// The partition this transaction pinned, if it pinned one.
pub fn pinned() -> Option<String> {
    txn_local::get(Key::CitusPushPartition)
}
