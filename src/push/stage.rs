//! Stage/finish (docs/DESIGN.md §Push path, "Stage/finish"; docs/API.md `push_finish`): for a
//! host with a whole-commit validator or a reaction planner, `push_commit` with
//! `options.onCommitHooks = "stage"` runs every operation natively, leaves the candidate rows in
//! the host's transaction and returns the operations as upstream's validator sees them
//! (`ValidateCommitOperation`); the host runs its hooks through the same transaction and calls
//! `push_finish`, which appends the commit, enqueues the planned reactions and stores the
//! applied result — or rolls back to its savepoint and stores a rejection.
//!
//! The staged state (the commit's header, its changes, the operation count) lives in
//! transaction-local backend memory (src/txn_local.rs): it belongs to the subtransaction that
//! staged it, so a `ROLLBACK TO SAVEPOINT` that discards the candidate rows discards it too,
//! and `push_finish` can never append a commit whose rows are gone. Nothing of it is durable.
//!
//! While it is staged the push stands (src/push_guard.rs): no other commit is appended and no
//! result is stored for its key in the transaction, and `push_finish` re-reads the stored
//! result of its key before it appends, refusing when there is one — one result and one commit
//! per push (D8, docs/DESIGN.md §Invariants; docs/API.md `push_finish` says why refuse rather
//! than replay).

use super::append::{self, ChangeOut, Header};
use super::result;
use crate::access;
use crate::args::{self, JsonArg};
use crate::codec::{Column, Value as Val};
use crate::db;
use crate::error::{self, Error, Result};
use crate::push_guard;
use crate::schema::encode_row;
use crate::txn_local::{self, Key};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::JsonB;
use serde_json::{json, Map, Value};

/// A row as upstream's validators see it: column name → value (docs/API.md §JSON forms of
/// `decode_row`: bytes in base64, a json column as its raw text).
pub fn row_map(columns: &[Column], values: &[Val<'_>]) -> Value {
    Value::Object(
        columns
            .iter()
            .zip(values)
            .map(|(column, value)| (column.name.clone(), encode_row::to_json(value)))
            .collect::<Map<_, _>>(),
    )
}

/// One operation's evidence (upstream's `ValidateCommitOperation`): keys that upstream leaves
/// `undefined` are absent, as `JSON.stringify` would leave them.
pub struct Evidence<'a> {
    pub op_index: usize,
    pub delete: bool,
    pub table: &'a str,
    pub row_id: &'a str,
    pub row: Option<Value>,
    pub stored: Option<Value>,
    pub stored_server_version: Option<i64>,
    pub next_server_version: Option<i64>,
}

impl Evidence<'_> {
    pub fn to_json(&self) -> Value {
        let mut out = json!({"opIndex": self.op_index,
                             "op": if self.delete { "delete" } else { "upsert" },
                             "table": self.table, "rowId": self.row_id});
        let optional = [
            ("row", self.row.clone()),
            ("stored", self.stored.clone()),
            (
                "storedServerVersion",
                self.stored_server_version.map(Value::from),
            ),
            (
                "nextServerVersion",
                self.next_server_version.map(Value::from),
            ),
        ];
        for (key, value) in optional {
            if let Some(value) = value {
                out[key] = value;
            }
        }
        out
    }
}

/// Keeps a staged push for `push_finish` (module comment: its lifetime).
pub fn save(header: &Header<'_>, operations: usize, changes: &[ChangeOut]) {
    let state = json!({
        "key": header.key, "actorId": header.actor_id, "createdAtMs": header.created_at_ms,
        "running": header.running, "identity": header.identity,
        "returnChanges": header.return_changes, "operations": operations,
        "changes": changes.iter().map(ChangeOut::to_json).collect::<Vec<_>>(),
    });
    txn_local::set(Key::PushStaged, &state.to_string());
    let [partition, client_id, client_commit_id] = header.key;
    push_guard::stage(partition, client_id, client_commit_id);
}

/// The staged push of `key` in this transaction, taken (a second `push_finish` finds none).
fn take(key: [&str; 3]) -> Result<Option<Value>> {
    let Some(text) = txn_local::get(Key::PushStaged).filter(|s| !s.is_empty()) else {
        return Ok(None);
    };
    let state: Value = serde_json::from_str(&text)
        .map_err(|_| Error::Internal("syncular: staged push state does not read back".into()))?;
    if state["key"] != json!(key) {
        return Ok(None);
    }
    txn_local::set(Key::PushStaged, "");
    push_guard::unstage();
    Ok(Some(state))
}

/// The planner's reactions with their source filled in, as upstream's `toNewReactions` does
/// (the source keys override whatever the host passed).
fn sourced(reactions: Value, header: &Header<'_>, seq: i64) -> Result<Value> {
    let Value::Array(items) = reactions else {
        return Err(Error::invalid_argument("reactions", "type"));
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            crate::interrupts::check();
            let Value::Object(mut obj) = item else {
                return Err(Error::invalid_argument(&format!("reactions[{i}]"), "type"));
            };
            obj.insert("sourceClientId".into(), json!(header.key[1]));
            obj.insert("sourceClientCommitId".into(), json!(header.key[2]));
            obj.insert("sourceCommitSeq".into(), json!(seq));
            obj.insert("createdAtMs".into(), json!(header.created_at_ms));
            Ok(Value::Object(obj))
        })
        .collect::<Result<Vec<_>>>()
        .map(Value::Array)
}

/// `push_finish` of a key that has a stored result: refused (docs/API.md `push_finish`).
fn already_stored(stored: &Value) -> Error {
    Error::invalid_argument("client_commit_id", "range").with_hint(format!(
        "a result of this push is already stored (status {}): nothing is appended; roll back \
         to the candidate savepoint and answer the stored result (get_push_result) as a replay",
        stored["status"]
    ))
}

/// SECURITY INVOKER like `push_commit`: only `sync_*` statements run, as the extension owner.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.push_finish(
  partition text, client_id text, client_commit_id text, reactions jsonb DEFAULT '[]')
RETURNS jsonb
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'push_finish_wrapper';
"#
)]
fn push_finish(
    partition: Option<&str>,
    client_id: Option<&str>,
    client_commit_id: Option<&str>,
    reactions: Option<JsonArg>,
) -> JsonB {
    error::run(|| {
        let key = [
            args::text_ref("partition", partition)?,
            args::text_ref("client_id", client_id)?,
            args::text_ref("client_commit_id", client_commit_id)?,
        ];
        let reactions = args::optional_json("reactions", reactions)?.unwrap_or(json!([]));
        if !reactions.is_array() {
            return Err(Error::invalid_argument("reactions", "type"));
        }
        // SAFETY: reads backend state of the current transaction; never errors.
        if !unsafe { pg_sys::IsTransactionBlock() } {
            return Err(Error::invalid_transaction_state("no_transaction_block"));
        }
        let Some(state) = take(key)? else {
            return Err(
                Error::invalid_argument("client_commit_id", "range").with_hint(
                    "no push of this partition, client and commit is staged in this transaction \
                 (push_commit with onCommitHooks \"stage\" returned \"staged\" for it, and no \
                 rollback to a savepoint before it discarded it)",
                ),
            );
        };
        let changes = state["changes"]
            .as_array()
            .map(|list| list.iter().map(ChangeOut::from_json).collect())
            .unwrap_or_else(|| Ok(Vec::new()))?;
        let identity = state["identity"].as_str().unwrap_or_default();
        let header = Header {
            key,
            actor_id: state["actorId"].as_str().unwrap_or_default(),
            created_at_ms: state["createdAtMs"].as_i64().unwrap_or_default(),
            running: state["running"].as_i64().unwrap_or_default(),
            identity,
            return_changes: state["returnChanges"] == true,
        };
        let operations = state["operations"].as_u64().unwrap_or_default() as usize;
        db::with_spi(|client| {
            access::as_extension_owner(|| {
                // The idempotency re-check, as push_commit's C4: under the partition lock the
                // stage took, with a fresh snapshot. Nothing of this transaction can have
                // stored a result for the key while it was staged (src/push_guard.rs), but
                // another transaction can (put_push_result takes no lock). A replay is not
                // possible here: the candidate rows stand and only the host can roll them back.
                if let Some(stored) = result::stored_result(client, &key, true)? {
                    return Err(already_stored(&stored));
                }
                let appended = append::append(client, &header, changes)?;
                let reactions = sourced(reactions, &header, appended.seq)?;
                if reactions.as_array().is_some_and(|r| !r.is_empty()) {
                    // The queue's own validation, caps and duplicate rule (src/reactions/enqueue.rs).
                    db::write(
                        client,
                        "SELECT syncular.enqueue_reactions($1, $2)",
                        &[
                            DatumWithOid::from(key[0]),
                            DatumWithOid::from(JsonB(reactions)),
                        ],
                    )?;
                }
                append::store_applied(client, &header, operations, appended)
            })
        })
        .map(JsonB)
    })
}
