//! The per-operation rules of the one-call push, steps A1…I10 of docs/DESIGN.md §Push path in
//! upstream's order: the row codec, scope authorization, immutable scopes, the version conflict
//! (src/push/conflict.rs), CRDT columns, blob references, tombstones, then the upsert.

use super::append::ChangeOut;
use super::conflict::{conflict, Update};
use super::context::{Context, RowMeta, Table, Upserted};
use super::outcome::{
    corrupt, error_record, fallback, fallback_doc, quoted, rejected, Stop, FORBIDDEN,
    INVALID_REQUEST, ROW_MISSING,
};
use super::request::Operation;
use super::stage::{self, Evidence};
use crate::codec::{json as codec_json, number, row, versions, ColumnType, Value as Val};
use crate::error::{Error, Result};
use crate::limits;
use crate::rows;
use crate::schema::push_schema::TableSchema;
use crate::tables::StoredRow;
use pgrx::datum::DatumWithOid;
use serde_json::{json, Map, Value};
use std::collections::{HashMap, HashSet};

/// Stored scopes authorize when every declared variable has a non-empty value that `allowed`
/// lists (or `allowed` lists `*` for it). The lists are sorted ([`allowed_arg`]): a row costs a
/// lookup per variable, not the length of the list (docs/SECURITY.md, "Time").
fn authorized<'s>(
    allowed: &HashMap<String, Vec<String>>,
    schema: &TableSchema,
    value_of: impl Fn(&str) -> Option<&'s str>,
) -> bool {
    let listed =
        |list: &[String], value: &str| list.binary_search_by(|a| a.as_str().cmp(value)).is_ok();
    schema.scopes.iter().all(|(var, _)| match value_of(var) {
        None | Some("") => false,
        Some(value) => allowed
            .get(var)
            .is_some_and(|list| listed(list, value) || listed(list, "*")),
    })
}

fn stored_scope<'s>(row: &'s StoredRow) -> impl Fn(&str) -> Option<&'s str> {
    move |var| row.scopes.get(var).and_then(Value::as_str)
}

/// JavaScript's `===` between an incoming and a stored value of one column (step U3): NaN
/// differs from itself, −0 equals 0, bytes never compare equal.
fn same_value(a: &Val<'_>, b: &Val<'_>) -> bool {
    match (a, b) {
        (Val::Null, Val::Null) => true,
        (Val::Text(x), Val::Text(y)) => x == y,
        (Val::Int(x), Val::Int(y)) => x == y,
        (Val::Float(x), Val::Float(y)) => x == y,
        (Val::Bool(x), Val::Bool(y)) => x == y,
        _ => false,
    }
}

/// What a change copies from a stored row into the log obeys the rules `append_commit` holds
/// the same document to (src/commit.rs; docs/API.md §Commit log): the row's scopes an object
/// of strings and, for an update, the next row version within 1 … 2^53−1. A row the host wrote
/// outside them (`_sync_server_version` at 2^63−1 would wrap to −2^63, nested scopes would
/// land in `sync_changes`) is refused with `SY005` at the path its change would have (`at`),
/// before anything of the operation is decided, never copied.
fn loggable(stored: &StoredRow, at: usize, op: &Operation) -> Result<()> {
    let refusal = |path: String, reason: &str, what: String| {
        Err(Error::invalid_commit(&path, reason).with_hint(format!(
            "stored row {} of table {} has {what}",
            quoted(op.row_id),
            quoted(op.table)
        )))
    };
    let Value::Object(scopes) = &stored.scopes else {
        let what = "_sync_scopes that are not an object".to_string();
        return refusal(format!("changes[{at}].scopes"), "type", what);
    };
    // The first variable in byte order, the order append_commit reports them in.
    let mut first_bad: Option<&str> = None;
    for (var, value) in scopes {
        pgrx::check_for_interrupts!();
        if !value.is_string() && first_bad.is_none_or(|bad| var.as_str() < bad) {
            first_bad = Some(var);
        }
    }
    if let Some(var) = first_bad {
        let what = format!(
            "a _sync_scopes value of {} that is not a string",
            quoted(var)
        );
        return refusal(format!("changes[{at}].scopes.{var}"), "type", what);
    }
    // An update's change carries the stored version + 1 (versions::after_update).
    if !op.delete && stored.server_version >= limits::MAX_SAFE {
        let what = format!(
            "_sync_server_version {}: the next version would pass 2^53-1",
            stored.server_version
        );
        return refusal(format!("changes[{at}].rowVersion"), "range", what);
    }
    Ok(())
}

fn scopes_map(row: &StoredRow) -> Map<String, Value> {
    match &row.scopes {
        Value::Object(map) => map.clone(),
        _ => Map::new(),
    }
}

impl<'a> Context<'a, '_> {
    /// Steps U9/I6: a present, non-NULL crdt value needs the host's merger.
    pub(super) fn crdt_stop(
        &self,
        k: usize,
        op: &Operation<'a>,
        t: &Table,
        patch: &[Option<Val>],
    ) -> Option<Stop> {
        let merges = patch
            .iter()
            .enumerate()
            .any(|(i, v)| t.is_crdt[i] && matches!(v, Some(v) if !v.is_null()));
        if !merges {
            None
        } else if self.options.crdt_mergers {
            Some(fallback("crdt_merge", Some((k, op.table))))
        } else {
            Some(Stop::Rejected(error_record(
                k,
                "sync.crdt_merge_failed",
                "no CRDT merger registered",
            )))
        }
    }

    /// Steps U11/I7: the row's blob ids (stored values of absent columns included) must exist;
    /// then the row's blob references become exactly those ids.
    pub(super) fn blob_refs(
        &self,
        k: usize,
        op: &Operation<'a>,
        t: &Table,
        values: &[Val],
    ) -> Result<Option<Stop>> {
        if !t.has_blob_refs {
            return Ok(None);
        }
        let mut ids = Vec::new();
        for (column, value) in t.schema.layout.columns.iter().zip(values) {
            if let (ColumnType::BlobRef, Val::Text(raw)) = (column.ty, value) {
                ids.push(
                    codec_json::blob_ref_id(raw)
                        .map_err(|e| corrupt(op.table, op.row_id, "blob_ref", e.message()))?,
                );
            }
        }
        if !ids.is_empty() {
            if self.options.blob_store_none {
                return rejected(
                    k,
                    "blob.not_found",
                    "row references a blob but the server has no blob store (§5.9.6)",
                );
            }
            let mut unverified: Vec<&String> = Vec::new();
            let mut listed = HashSet::new();
            for id in &ids {
                if !self.options.verified_blob_ids.contains(id) && listed.insert(id) {
                    unverified.push(id);
                }
            }
            if !unverified.is_empty() {
                let mut doc = fallback_doc("blob_check", Some((k, op.table)));
                doc["blobIds"] = json!(unverified);
                return Ok(Some(Stop::Fallback(doc)));
            }
        }
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        rows::set_blobs(
            self.client,
            self.partition,
            op.table,
            op.row_id,
            &ids,
            DatumWithOid::from(ids.clone()),
        )?;
        Ok(None)
    }

    /// One operation, steps A1…I10 of docs/DESIGN.md §Push path in upstream's order. `Ok(None)`:
    /// applied (its change, if any, appended to `changes`).
    pub(super) fn apply(
        &self,
        k: usize,
        op: &Operation<'a>,
        changes: &mut Vec<ChangeOut>,
    ) -> Result<Option<Stop>> {
        let Some(t) = self.tables.get(op.table) else {
            return rejected(
                k,
                "sync.unknown_table",
                format!("table {} is not handled by this server", quoted(op.table)),
            );
        };
        let Some(allowed) = self.allowed else {
            return rejected(k, FORBIDDEN, "scope resolution failed (§3.4 step 4)");
        };
        let prefetched = self.prefetched.borrow_mut().remove(&(op.table, op.row_id));
        let stored = match prefetched {
            Some(stored) => stored,
            None => t
                .relation
                .fetch_row_as(self.client, self.caller, self.partition, op.row_id)?,
        };
        if op.delete {
            return self.delete(k, op, t, allowed, stored, changes);
        }
        let layout = &t.schema.layout;
        let Some(payload) = &op.payload else {
            return rejected(k, INVALID_REQUEST, "upsert without payload");
        };
        let patch = match row::decode_sparse(layout, payload) {
            Ok(patch) => patch,
            Err(e) => {
                return rejected(
                    k,
                    INVALID_REQUEST,
                    format!(
                        "row payload failed row-codec decode (§1.7): {}",
                        e.message()
                    ),
                )
            }
        };
        let pk = layout.primary_key;
        if number::render(layout.columns[pk].ty, patch[pk].as_ref()).as_deref() != Some(op.row_id) {
            return rejected(
                k,
                INVALID_REQUEST,
                "payload primary key does not match rowId",
            );
        }
        match stored {
            Some(stored) => self.update(k, op, t, allowed, stored, patch, changes),
            None => self.insert(k, op, t, allowed, patch, changes),
        }
    }

    pub(super) fn delete(
        &self,
        k: usize,
        op: &Operation<'a>,
        t: &Table,
        allowed: &HashMap<String, Vec<String>>,
        stored: Option<StoredRow>,
        changes: &mut Vec<ChangeOut>,
    ) -> Result<Option<Stop>> {
        let evidence = |stored: Option<Value>, version: Option<i64>| Evidence {
            op_index: k,
            delete: true,
            table: op.table,
            row_id: op.row_id,
            row: None,
            stored,
            stored_server_version: version,
            next_server_version: None,
        };
        let Some(stored) = stored else {
            // An absent row: a no-op that still reaches the commit validator.
            self.witness(|| evidence(None, None));
            return Ok(None);
        };
        loggable(&stored, changes.len(), op)?;
        if !authorized(allowed, &t.schema, stored_scope(&stored)) {
            return rejected(k, FORBIDDEN, "delete denied by scope authorization (§3.4)");
        }
        let stored_values = row::decode_full(&t.schema.layout, &stored.payload)
            .map_err(|e| corrupt(op.table, op.row_id, "payload", e.message()))?;
        if self.validated(op.table) {
            return Ok(Some(fallback("row_validator", Some((k, op.table)))));
        }
        // A class-23 error here (a host foreign key) is a request error, not a rejection.
        self.flush()?;
        t.relation
            .delete_row_as(self.client, self.caller, self.partition, op.row_id)?;
        rows::delete_meta(self.client, self.partition, op.table, op.row_id)?;
        changes.push(ChangeOut {
            table: op.table.to_string(),
            row_id: op.row_id.to_string(),
            delete: true,
            row_version: None,
            scopes: scopes_map(&stored),
            payload: None,
        });
        self.witness(|| {
            let columns = &t.schema.layout.columns;
            let stored_row = stage::row_map(columns, &stored_values);
            evidence(Some(stored_row), Some(stored.server_version))
        });
        Ok(None)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn update(
        &self,
        k: usize,
        op: &Operation<'a>,
        t: &Table,
        allowed: &HashMap<String, Vec<String>>,
        stored: StoredRow,
        patch: Vec<Option<Val>>,
        changes: &mut Vec<ChangeOut>,
    ) -> Result<Option<Stop>> {
        let layout = &t.schema.layout;
        loggable(&stored, changes.len(), op)?;
        if !authorized(allowed, &t.schema, stored_scope(&stored)) {
            return rejected(k, FORBIDDEN, "write denied by scope authorization (§3.4)");
        }
        let mut values = row::decode_full(layout, &stored.payload)
            .map_err(|e| corrupt(op.table, op.row_id, "payload", e.message()))?;
        let moved = t.schema.scopes.iter().any(|(_, column)| {
            matches!(&patch[*column], Some(incoming) if !same_value(incoming, &values[*column]))
        });
        if moved {
            return rejected(
                k,
                INVALID_REQUEST,
                "scope column is immutable on update (§3.4)",
            );
        }
        if op.base_version.is_some_and(|bv| bv > stored.server_version) {
            return rejected(
                k,
                INVALID_REQUEST,
                "baseVersion exceeds the stored server version (§6.2)",
            );
        }
        let blob = versions::decode(stored.column_versions.as_deref(), layout.columns.len())
            .map_err(|e| corrupt(op.table, op.row_id, "_sync_column_versions", e.message()))?;
        let present = row::present_columns(&patch);
        let update = Update {
            op: k,
            base_version: op.base_version,
            present: &present,
            is_crdt: &t.is_crdt,
            primary_key: layout.primary_key,
            columns: layout.columns.len(),
        };
        if let Some(stop) = conflict(&update, &stored, blob.as_ref())? {
            return Ok(Some(stop));
        }
        let server_version = stored.server_version.max(0) as u64;
        if let Some(stop) = self.crdt_stop(k, op, t, &patch) {
            return Ok(Some(stop));
        }
        let before = self
            .evidence
            .as_ref()
            .map(|_| stage::row_map(&layout.columns, &values));
        row::merge(&mut values, patch);
        let (next, column_versions) = versions::after_update(
            layout.columns.len(),
            &present,
            layout.primary_key,
            blob.as_deref(),
            server_version,
        );
        let full = row::encode_full(layout, &values)
            .map_err(|e| corrupt(op.table, op.row_id, "merged row", e.message()))?;
        if let Some(stop) = self.blob_refs(k, op, t, &values)? {
            return Ok(Some(stop));
        }
        if self.validated(op.table) {
            return Ok(Some(fallback("row_validator", Some((k, op.table)))));
        }
        let scopes = scopes_map(&stored);
        let next = next as i64;
        self.upsert(
            k,
            op,
            t,
            RowMeta {
                version: next,
                scopes: &scopes,
                payload: &full,
                column_versions: column_versions.as_deref(),
            },
            &values,
        )?;
        let upserted = Upserted {
            version: next,
            scopes,
            payload: full,
            before: before.map(|row| (row, stored.server_version)),
        };
        self.applied_upsert(k, op, t, &values, upserted, changes);
        Ok(None)
    }

    pub(super) fn insert(
        &self,
        k: usize,
        op: &Operation<'a>,
        t: &Table,
        allowed: &HashMap<String, Vec<String>>,
        patch: Vec<Option<Val>>,
        changes: &mut Vec<ChangeOut>,
    ) -> Result<Option<Stop>> {
        let layout = &t.schema.layout;
        let rendered: Vec<(&str, Option<String>)> = t
            .schema
            .scopes
            .iter()
            .map(|(var, column)| {
                let ty = layout.columns[*column].ty;
                (var.as_str(), number::render(ty, patch[*column].as_ref()))
            })
            .collect();
        let payload_scope = |var: &str| {
            rendered
                .iter()
                .find(|(v, _)| *v == var)
                .and_then(|(_, value)| value.as_deref())
        };
        // Whether the row's tombstone was looked up and found absent: then there is none to
        // clear below, as tombstones are written only under the partition lock this push holds
        // (`log::append`), after which the lookup's fresh snapshot was taken.
        let mut no_tombstone = false;
        match op.base_version {
            Some(bv) if bv != 0 => {
                return if authorized(allowed, &t.schema, payload_scope) {
                    rejected(
                        k,
                        ROW_MISSING,
                        "upsert with baseVersion targets an absent row (§6.2)",
                    )
                } else {
                    rejected(k, FORBIDDEN, "write denied by scope authorization (§3.4)")
                };
            }
            Some(_) => {}
            None => {
                if rows::tombstone_seq(self.client, self.partition, op.table, op.row_id, true)?
                    .is_some()
                {
                    return rejected(
                        k,
                        "sync.row_deleted",
                        "a deleted row rejects an unversioned upsert within the retention horizon (§5.2)",
                    );
                }
                no_tombstone = true;
            }
        }
        if patch.iter().any(Option::is_none) {
            return rejected(
                k,
                ROW_MISSING,
                "a partial payload targets an absent row (§6.3)",
            );
        }
        let mut scopes = Map::new();
        for (var, value) in &rendered {
            match value {
                Some(value) => scopes.insert(var.to_string(), json!(value)),
                None => {
                    return rejected(
                        k,
                        FORBIDDEN,
                        format!(
                            "insert missing scope column value for {} (§3.4)",
                            quoted(var)
                        ),
                    )
                }
            };
        }
        if !authorized(allowed, &t.schema, payload_scope) {
            return rejected(k, FORBIDDEN, "insert denied by scope authorization (§3.4)");
        }
        if let Some(stop) = self.crdt_stop(k, op, t, &patch) {
            return Ok(Some(stop));
        }
        let values: Vec<Val> = patch.into_iter().flatten().collect();
        let full = row::encode_full(layout, &values)
            .map_err(|e| corrupt(op.table, op.row_id, "payload", e.message()))?;
        if let Some(stop) = self.blob_refs(k, op, t, &values)? {
            return Ok(Some(stop));
        }
        if self.validated(op.table) {
            return Ok(Some(fallback("row_validator", Some((k, op.table)))));
        }
        if !no_tombstone {
            rows::delete_tombstone(self.client, self.partition, op.table, op.row_id)?;
        }
        let meta = RowMeta {
            version: 1,
            scopes: &scopes,
            payload: &full,
            column_versions: None,
        };
        self.upsert(k, op, t, meta, &values)?;
        rows::set_scopes(self.client, self.partition, op.table, op.row_id, &scopes)?;
        let upserted = Upserted {
            version: 1,
            scopes,
            payload: full,
            before: None,
        };
        self.applied_upsert(k, op, t, &values, upserted, changes);
        Ok(None)
    }
}
