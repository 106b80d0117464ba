//! Steps C9/C10 of the one-call push (docs/DESIGN.md §Push path): the append of an applied
//! commit and its stored result, shared by `push_commit` (one call) and `push_finish` (the end
//! of a staged push, src/push/stage.rs). The append reuses `log::append`, the code behind
//! `append_commit`, so both paths store the same bytes; the result goes through
//! `result::store_result`, where the first writer of an idempotency key wins — and a result
//! another transaction stored first fails the call, so its commit never stands next to it
//! (`push_guard::check_stored`).

use super::result;
use crate::commit::{Change, Commit, Op, BASE64};
use crate::error::{Error, Result};
use crate::jsonb::{Node, OwnedJsonb};
use crate::log;
use crate::notify;
use crate::push_guard;
use base64::Engine;
use pgrx::spi::SpiClient;
use serde_json::{json, Map, Value};

/// A change of the commit, owned until the append.
pub struct ChangeOut {
    pub table: String,
    pub row_id: String,
    pub delete: bool,
    pub row_version: Option<i64>,
    pub scopes: Map<String, Value>,
    pub payload: Option<Vec<u8>>,
}

impl ChangeOut {
    /// The change as `returnChanges` shows it (payload in base64); also the form a staged push
    /// keeps until `push_finish` (src/push/stage.rs).
    pub fn to_json(&self) -> Value {
        let mut change = json!({"table": self.table, "rowId": self.row_id,
            "op": if self.delete { "delete" } else { "upsert" }, "scopes": self.scopes});
        if let Some(v) = self.row_version {
            change["rowVersion"] = json!(v);
        }
        if let Some(p) = &self.payload {
            change["payload"] = json!(BASE64.encode(p));
        }
        change
    }

    /// The inverse of [`ChangeOut::to_json`], for state this extension wrote itself.
    pub fn from_json(value: &Value) -> Result<ChangeOut> {
        crate::interrupts::check();
        let broken = || Error::Internal("syncular: a staged change does not read back".into());
        let text = |key: &str| value[key].as_str().map(str::to_string).ok_or_else(broken);
        let payload = match value.get("payload") {
            None => None,
            Some(Value::String(p)) => Some(BASE64.decode(p).map_err(|_| broken())?),
            Some(_) => return Err(broken()),
        };
        Ok(ChangeOut {
            table: text("table")?,
            row_id: text("rowId")?,
            delete: value["op"] == "delete",
            row_version: value.get("rowVersion").and_then(Value::as_i64),
            scopes: value["scopes"].as_object().cloned().ok_or_else(broken)?,
            payload,
        })
    }
}

/// What the append and the result need besides the changes.
pub struct Header<'a> {
    /// `[partition, client_id, client_commit_id]`, the idempotency key.
    pub key: [&'a str; 3],
    pub actor_id: &'a str,
    pub created_at_ms: i64,
    /// The running schema version, stored as the commit's `writer_version`.
    pub running: i64,
    /// The result's `cacheIdentity`: tells this call's result from a concurrent writer's.
    pub identity: &'a str,
    pub return_changes: bool,
}

/// The answer for a result this call stored (or found stored by a concurrent writer).
pub fn finished(canonical: Value, identity: &str, changes: Option<Value>) -> Value {
    let replayed = canonical["cacheIdentity"] != json!(identity);
    let applied = canonical["status"] == "applied";
    let mut out = json!({"outcome": if applied { "applied" } else { "rejected" },
                         "replayed": replayed});
    if applied {
        out["commitSeq"] = canonical["commitSeq"].clone();
        if let Some(changes) = changes {
            out["changes"] = changes;
        }
    }
    out["result"] = canonical;
    out
}

/// A change's stored scopes as a jsonb value for the append (the same bytes `append_commit`
/// stores for the same object), written as binary jsonb without a text round trip.
pub(super) fn scopes_jsonb(scopes: &Map<String, Value>) -> Result<OwnedJsonb> {
    crate::jsonb::owned(&Value::Object(scopes.clone()))
}

/// The appended commit: its `commit_seq` and, with `returnChanges`, the changes to return.
pub struct Appended {
    pub seq: i64,
    pub returned: Option<Value>,
}

/// Step C9: appends the commit (through the fence, as `append_commit` does).
pub fn append(
    client: &SpiClient<'_>,
    header: &Header<'_>,
    changes: Vec<ChangeOut>,
) -> Result<Appended> {
    let [partition, client_id, client_commit_id] = header.key;
    let documents = changes
        .iter()
        .map(|c| {
            crate::interrupts::check();
            scopes_jsonb(&c.scopes)
        })
        .collect::<Result<Vec<_>>>()?;
    let returned = header
        .return_changes
        .then(|| Value::Array(changes.iter().map(ChangeOut::to_json).collect()));
    let mut log_changes = Vec::with_capacity(changes.len());
    for (c, document) in changes.into_iter().zip(&documents) {
        crate::interrupts::check();
        let raw = match document.container().and_then(|c| c.root()) {
            Ok(Node::Object(object)) => object.to_jsonb(),
            _ => return Err(Error::Internal("syncular: scopes are not an object".into())),
        };
        log_changes.push((c, raw));
    }
    let commit = Commit {
        client_id,
        client_commit_id,
        actor_id: header.actor_id,
        created_at_ms: header.created_at_ms,
        writer_version: Some(header.running),
        changes: log_changes
            .iter()
            .map(|(c, raw)| Change {
                table: &c.table,
                row_id: &c.row_id,
                op: if c.delete { Op::Delete } else { Op::Upsert },
                row_version: c.row_version,
                scopes: c
                    .scopes
                    .iter()
                    .filter_map(|(var, value)| value.as_str().map(|v| (var.as_str(), v)))
                    .collect(),
                scopes_jsonb: *raw,
                payload: c.payload.clone(),
            })
            .collect(),
    };
    push_guard::check_append(partition, client_id, client_commit_id)?;
    let seq = log::append(client, partition, &commit)?;
    push_guard::appended_push(header.key, seq);
    notify::appended(partition, seq);
    crate::feed::appended(partition, seq);
    Ok(Appended { seq, returned })
}

/// Step C10: the applied result of `results` operations for the appended commit.
pub fn store_applied(
    client: &SpiClient<'_>,
    header: &Header<'_>,
    results: usize,
    appended: Appended,
) -> Result<Value> {
    let document = json!({
        "status": "applied", "commitSeq": appended.seq,
        "results": (0..results).map(|k| json!({"opIndex": k, "status": "applied"})).collect::<Vec<_>>(),
        "recordedAtMs": header.created_at_ms, "cacheIdentity": header.identity,
    });
    let stored = result::store_result(client, &header.key, document)?;
    // First writer wins, but the commit just appended must not stand next to another
    // transaction's result for the key (D8): then the call fails and the append goes with it.
    push_guard::check_stored(appended.seq, &stored)?;
    Ok(finished(
        stored.document,
        header.identity,
        appended.returned,
    ))
}
