//! The classic push protects itself (docs/DESIGN.md §Push path): inside the transaction that
//! `push_begin` opened for `(partition, clientId, clientCommitId)`, `append_commit` appends only
//! to that partition, and an `applied` `put_push_result` for that push must name the
//! `commitSeq` the transaction appended — a `rejected` one only when nothing of the push stands
//! (the candidate savepoint was rolled back). A host bug that stores an applied result pointing
//! at someone else's commit, or a rejection over an append that stands, is refused instead of
//! becoming a wrong idempotency answer forever.
//!
//! The state is transaction-local ([`crate::txn_local`]): a rollback to the candidate savepoint
//! forgets the append, the end of the transaction forgets the push. Calls outside a transaction
//! that `push_begin` opened (tools, tests, adoption) are not affected.

use crate::error::{Error, Result};
use crate::txn_local::{self, Key};

/// `push_begin` of this transaction began this push.
pub fn begin(partition: &str, client_id: &str, client_commit_id: &str) {
    txn_local::set(Key::PushBegun, &key(partition, client_id, client_commit_id));
    // A new push: nothing of it is appended yet (an earlier push of the transaction was).
    txn_local::set(Key::PushAppended, "");
}

fn key(partition: &str, client_id: &str, client_commit_id: &str) -> String {
    // NUL cannot occur in PostgreSQL text, so the parts cannot run into each other.
    format!("{partition}\0{client_id}\0{client_commit_id}")
}

fn begun() -> Option<Vec<String>> {
    txn_local::get(Key::PushBegun).map(|k| k.split('\0').map(str::to_string).collect())
}

/// Before an append: the commit must be the one the transaction's push began.
pub fn check_append(partition: &str, client_id: &str, client_commit_id: &str) -> Result<()> {
    let Some(begun) = begun() else {
        return Ok(());
    };
    let hint = || {
        format!(
            "push_begin of this transaction began the push of client {:?}, commit {:?} in partition {:?}",
            begun[1], begun[2], begun[0]
        )
    };
    if partition != begun[0] {
        return Err(Error::invalid_argument("partition", "shape").with_hint(hint()));
    }
    // The commit's own ids are not held to the push's: the product's scenario of an advance
    // before push_begin (docs/SCENARIOS.md, CKP-15) appends a commit of another client inside a
    // push transaction, and upstream never compared them (docs/DESIGN.md §Decisions).
    let _ = (client_id, client_commit_id);
    Ok(())
}

/// After an append of the push: its `commit_seq`.
pub fn appended(commit_seq: i64) {
    if begun().is_some() {
        txn_local::set(Key::PushAppended, &commit_seq.to_string());
    }
}

/// Before storing a result for `(partition, client_id, client_commit_id)`: within the push this
/// transaction began, `applied` must name the appended `commit_seq`, `rejected` needs that no
/// append of the push stands.
pub fn check_result(
    partition: &str,
    client_id: &str,
    client_commit_id: &str,
    applied_seq: Option<i64>,
) -> Result<()> {
    if txn_local::get(Key::PushBegun) != Some(key(partition, client_id, client_commit_id)) {
        return Ok(());
    }
    let appended = txn_local::get(Key::PushAppended).and_then(|s| s.parse::<i64>().ok());
    match (applied_seq, appended) {
        (Some(named), Some(seq)) if named == seq => Ok(()),
        (Some(_), Some(seq)) => Err(Error::invalid_argument("result.commitSeq", "range")
            .with_hint(format!("this transaction appended the push as commit_seq {seq}"))),
        (Some(_), None) => Err(Error::invalid_argument("result.commitSeq", "range").with_hint(
            "no commit of this push stands in this transaction: append it first, or store a rejection",
        )),
        (None, Some(seq)) => Err(Error::invalid_argument("result.status", "range").with_hint(
            format!("this transaction appended the push as commit_seq {seq}: roll back to the candidate savepoint before storing a rejection"),
        )),
        (None, None) => Ok(()),
    }
}
