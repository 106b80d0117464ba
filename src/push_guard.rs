//! The push protects itself (docs/DESIGN.md §Push path): inside the transaction that
//! `push_begin` opened for `(partition, clientId, clientCommitId)`, `append_commit` appends only
//! to that partition, and an `applied` `put_push_result` for that push must name the
//! `commitSeq` the transaction appended — a `rejected` one only when nothing of the push stands
//! (the candidate savepoint was rolled back). A host bug that stores an applied result pointing
//! at someone else's commit, or a rejection over an append that stands, is refused instead of
//! becoming a wrong idempotency answer forever.
//!
//! A staged push (src/push/stage.rs) stands too, whether or not `push_begin` began it: its
//! candidate rows are written and only `push_finish` appends their commit. Until it is finished
//! or rolled back, no other commit may be appended in the transaction (`append_commit`,
//! `push_commit`: `SY004` `prior_writes`), and no result may be stored for its key
//! (`put_push_result`: `SY000` `result.status` / `result.commitSeq`, as for an append that
//! stands). And wherever the transaction appended a push's own commit, the result stored for
//! that key must be the applied one naming it: a result another transaction stored first (it
//! needs no lock to call `put_push_result`) makes the call fail, which undoes the append
//! (`SY000` `client_commit_id` `range`). Together: one result per push, and an applied result
//! names the one commit of its push (D8, docs/DESIGN.md §Invariants).
//!
//! The state is transaction-local ([`crate::txn_local`]): a rollback to the candidate savepoint
//! forgets the append and the staged push, the end of the transaction forgets the push. Calls
//! outside a transaction that `push_begin` opened or `push_commit` staged in (tools, tests,
//! adoption) are not affected.

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

fn parts(key: String) -> Vec<String> {
    key.split('\0').map(str::to_string).collect()
}

fn begun() -> Option<Vec<String>> {
    txn_local::get(Key::PushBegun).map(parts)
}

/// `push_commit` staged this push (src/push/stage.rs): it stands from now on.
pub fn stage(partition: &str, client_id: &str, client_commit_id: &str) {
    txn_local::set(
        Key::PushStagedId,
        &key(partition, client_id, client_commit_id),
    );
}

/// `push_finish` took the staged push: nothing is staged any more.
pub fn unstage() {
    txn_local::set(Key::PushStagedId, "");
}

fn staged() -> Option<Vec<String>> {
    txn_local::get(Key::PushStagedId)
        .filter(|k| !k.is_empty())
        .map(parts)
}

fn staged_hint(staged: &[String]) -> String {
    format!(
        "push_commit staged the push of client {:?}, commit {:?} in partition {:?} in this \
         transaction: push_finish appends it, ROLLBACK TO SAVEPOINT syncular_push_candidate \
         discards it",
        staged[1], staged[2], staged[0]
    )
}

/// Before `push_commit` and before every append: no staged push may stand. Its candidate rows
/// are written but not yet in the log; a commit appended now would come before them in
/// `commit_seq` order although it was computed after them, and a second push of the same key
/// would run over them and append a second commit for the key.
pub fn check_nothing_staged() -> Result<()> {
    match staged() {
        None => Ok(()),
        Some(staged) => {
            Err(Error::invalid_transaction_state("prior_writes").with_hint(staged_hint(&staged)))
        }
    }
}

/// Before an append: nothing staged stands, and the commit must go to the partition of the
/// push the transaction began.
pub fn check_append(partition: &str, client_id: &str, client_commit_id: &str) -> Result<()> {
    crate::citus::one_partition::require(partition)?;
    check_nothing_staged()?;
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

/// After an `append_commit` in the push transaction: its `commit_seq` (the commit's own ids are
/// not compared, [`check_append`]).
pub fn appended(commit_seq: i64) {
    if begun().is_some() {
        txn_local::set(Key::PushAppended, &commit_seq.to_string());
    }
}

/// After `push_commit` or `push_finish` appended the commit of push `[partition, client_id,
/// client_commit_id]`: it is the begun push's append only when it is that push. (Those calls
/// store their own key's result at once; a commit of another key is never the begun push's.)
pub fn appended_push([partition, client_id, client_commit_id]: [&str; 3], commit_seq: i64) {
    if txn_local::get(Key::PushBegun) == Some(key(partition, client_id, client_commit_id)) {
        txn_local::set(Key::PushAppended, &commit_seq.to_string());
    }
}

/// Before storing a result for `(partition, client_id, client_commit_id)`: a staged push of
/// that key stands, so no result goes in before `push_finish` (which stores the applied one)
/// or a rollback to the candidate savepoint (then a rejection may follow). Within the push this
/// transaction began, `applied` must name the appended `commit_seq`, `rejected` needs that no
/// append of the push stands. `Ok(true)`: the result names this transaction's append of the
/// push, so the stored result must then be that one ([`check_stored`]).
pub fn check_result(
    partition: &str,
    client_id: &str,
    client_commit_id: &str,
    applied_seq: Option<i64>,
) -> Result<bool> {
    crate::citus::one_partition::require(partition)?;
    let this = key(partition, client_id, client_commit_id);
    if let Some(staged) = staged().filter(|s| s.join("\0") == this) {
        let refusal = match applied_seq {
            Some(_) => Error::invalid_argument("result.commitSeq", "range"),
            None => Error::invalid_argument("result.status", "range"),
        };
        return Err(refusal.with_hint(staged_hint(&staged)));
    }
    if txn_local::get(Key::PushBegun) != Some(this) {
        return Ok(false);
    }
    let appended = txn_local::get(Key::PushAppended).and_then(|s| s.parse::<i64>().ok());
    match (applied_seq, appended) {
        (Some(named), Some(seq)) if named == seq => Ok(true),
        (Some(_), Some(seq)) => Err(Error::invalid_argument("result.commitSeq", "range")
            .with_hint(format!("this transaction appended the push as commit_seq {seq}"))),
        (Some(_), None) => Err(Error::invalid_argument("result.commitSeq", "range").with_hint(
            "no commit of this push stands in this transaction: append it first, or store a rejection",
        )),
        (None, Some(seq)) => Err(Error::invalid_argument("result.status", "range").with_hint(
            format!("this transaction appended the push as commit_seq {seq}: roll back to the candidate savepoint before storing a rejection"),
        )),
        (None, None) => Ok(false),
    }
}

/// After storing the applied result of a push this transaction appended as `commit_seq`: the
/// result stored for the key (first writer wins) must be the one this call inserted — which
/// names that commit (the caller built or checked it so). Another transaction may have stored a
/// result first (`put_push_result` takes no lock), whatever it says, even the same
/// `commitSeq` (red team 32, F1): the commit must not stand next to it, so the call fails and
/// its append goes with it.
pub fn check_stored(commit_seq: i64, stored: &crate::push::result::Stored) -> Result<()> {
    if stored.inserted {
        return Ok(());
    }
    let canonical = &stored.document;
    Err(
        Error::invalid_argument("client_commit_id", "range").with_hint(format!(
            "another transaction stored a result for this push (status {}) while this one \
             appended it as commit_seq {commit_seq}: roll back; the stored result \
             (get_push_result) answers the push",
            canonical["status"]
        )),
    )
}
