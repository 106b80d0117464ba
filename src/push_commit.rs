//! The one-call push (docs/DESIGN.md §Push path, docs/API.md `push_commit`): a whole commit of
//! upstream's default push path in one call — partition lock, gate, idempotency, the
//! per-operation decisions in upstream's order (row codec, scope authorization, column versions,
//! conflicts, tombstones, blob references), the app-row writes, the row scope index, the commit
//! append and the push result — with results and stored bytes identical to what the classic
//! multi-call path stores for a correct host.
//!
//! Who acts (docs/SECURITY.md, rules 1 and 10): the function is SECURITY INVOKER so that it
//! knows its caller. Statements over `sync_*` tables run as the extension owner; app rows are
//! read and written as the **caller** in a restricted security context, through
//! [`tables::AppRelation`] after `tables::open` re-checked the registration, so host
//! privileges, row-level security and triggers behave as if the host had written the rows.
//!
//! Where upstream would call host code (validators, CRDT mergers, blob stores, references,
//! commit validators, reaction planners), the call stops and returns `outcome: "fallback"`
//! without a durable trace: the candidate writes live in an internal subtransaction that is
//! rolled back, as it is for every rejection.

use crate::access;
use crate::args::{self, JsonArg};
use crate::codec::{json as codec_json, number, row, versions, ColumnType, Value as Val};
use crate::commit::BASE64;
use crate::db;
use crate::error::{self, Error, Result};
use crate::gate;
use crate::limits;
use crate::log;
use crate::push;
use crate::push_append::{self, ChangeOut, Header};
use crate::push_batch::{self, Batch};
use crate::push_guard;
use crate::push_schema::{self, TableSchema};
use crate::push_stage::{self, Evidence};
use crate::rows;
use crate::tables::{self, AppRelation, StoredRow};
use base64::Engine;
use pgrx::datum::{Array, DatumWithOid};
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use pgrx::JsonB;
use serde_json::{json, Map, Value};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

/// One operation of the commit, from the parallel arrays: borrowed from the arguments, never
/// copied (docs/DESIGN.md §Memory).
struct Operation<'a> {
    table: &'a str,
    row_id: &'a str,
    delete: bool,
    base_version: Option<i64>,
    payload: Option<&'a [u8]>,
}

/// `options` (docs/API.md `push_commit`): what host code exists, and what the call returns.
#[derive(Default)]
struct Options {
    cache_identity: Option<String>,
    client_schema_version: Option<i64>,
    row_validator_tables: HashSet<String>,
    crdt_mergers: bool,
    blob_store_none: bool,
    verified_blob_ids: HashSet<String>,
    commit_validator: bool,
    reaction_planner: bool,
    /// `onCommitHooks: "stage"`: at a commit validator or planner, stage instead of falling back.
    stage: bool,
    return_changes: bool,
}

/// The resolver's outcome: `{variable: [allowed values]}`, or `None` when it threw.
type Allowed = Option<HashMap<String, Vec<String>>>;

fn bad(argument: &str, reason: &str) -> Error {
    Error::invalid_argument(argument, reason)
}

fn bool_option(obj: &Map<String, Value>, key: &str, default: bool) -> Result<bool> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(&format!("options.{key}"), "type")),
    }
}

fn string_set(obj: &Map<String, Value>, key: &str) -> Result<HashSet<String>> {
    let at = format!("options.{key}");
    match obj.get(key) {
        None | Some(Value::Null) => Ok(HashSet::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| {
                crate::interrupts::check();
                match item {
                    Value::String(s) if s.len() <= limits::KEY_BYTES => Ok(s.clone()),
                    Value::String(_) => Err(bad(&at, "too_large")),
                    _ => Err(bad(&at, "type")),
                }
            })
            .collect(),
        Some(_) => Err(bad(&at, "type")),
    }
}

impl Options {
    fn parse(value: Option<Value>) -> Result<Options> {
        let obj = match value {
            None => return Ok(Options::default().with_defaults()),
            Some(Value::Object(obj)) => obj,
            Some(_) => return Err(bad("options", "type")),
        };
        let cache_identity = match obj.get("cacheIdentity") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.is_empty() => {
                return Err(bad("options.cacheIdentity", "empty"))
            }
            Some(Value::String(s)) if s.len() > limits::KEY_BYTES => {
                return Err(bad("options.cacheIdentity", "too_large"))
            }
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(bad("options.cacheIdentity", "type")),
        };
        let client_schema_version = match obj.get("clientSchemaVersion") {
            None | Some(Value::Null) => None,
            Some(_) => Some(args::json_int_field(
                &obj,
                "clientSchemaVersion",
                "options.clientSchemaVersion",
                (0, limits::MAX_SAFE),
                None,
            )?),
        };
        let blob_store_none = match obj.get("blobStore") {
            None | Some(Value::Null) => false,
            Some(Value::String(s)) if s == "external" => false,
            Some(Value::String(s)) if s == "none" => true,
            Some(Value::String(_)) => return Err(bad("options.blobStore", "range")),
            Some(_) => return Err(bad("options.blobStore", "type")),
        };
        let stage = match obj.get("onCommitHooks") {
            None | Some(Value::Null) => false,
            Some(Value::String(s)) if s == "fallback" => false,
            Some(Value::String(s)) if s == "stage" => true,
            Some(Value::String(_)) => return Err(bad("options.onCommitHooks", "range")),
            Some(_) => return Err(bad("options.onCommitHooks", "type")),
        };
        Ok(Options {
            cache_identity,
            client_schema_version,
            row_validator_tables: string_set(&obj, "rowValidatorTables")?,
            // A host that does not say whether it has CRDT mergers may have some: fall back.
            crdt_mergers: bool_option(&obj, "crdtMergers", true)?,
            blob_store_none,
            verified_blob_ids: string_set(&obj, "verifiedBlobIds")?,
            commit_validator: bool_option(&obj, "commitValidator", false)?,
            reaction_planner: bool_option(&obj, "reactionPlanner", false)?,
            stage,
            return_changes: bool_option(&obj, "returnChanges", false)?,
        })
    }

    fn with_defaults(mut self) -> Options {
        self.crdt_mergers = true;
        self
    }
}

fn allowed_arg(value: Option<Value>) -> Result<Allowed> {
    let Some(value) = value else {
        return Ok(None);
    };
    let Value::Object(map) = value else {
        return Err(bad("allowed", "type"));
    };
    map.into_iter()
        .map(|(var, values)| {
            crate::interrupts::check();
            let Value::Array(values) = values else {
                return Err(bad("allowed", "type").with_hint(format!("allowed.{var}")));
            };
            let mut values = values
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    _ => Err(bad("allowed", "type").with_hint(format!("allowed.{var}"))),
                })
                .collect::<Result<Vec<_>>>()?;
            // Sorted for [`authorized`]'s binary search: every row is checked against the list.
            values.sort_unstable();
            Ok((var, values))
        })
        .collect::<Result<HashMap<_, _>>>()
        .map(Some)
}

/// The parallel operation arrays: equal lengths (`shape`), at least one operation (`empty`),
/// every element capped before it is read; borrowed from the arguments.
fn operations<'a>(
    op_tables: Option<&'a args::TextArray>,
    op_row_ids: Option<&'a args::TextArray>,
    op_kinds: Option<&'a Array<'_, i16>>,
    op_base_versions: Option<&'a Array<'_, i64>>,
    op_payloads: Option<&'a Array<'_, &[u8]>>,
) -> Result<Vec<Operation<'a>>> {
    // Every cap before any shape rule, so an oversized array is refused as `too_large`
    // whatever else is wrong (docs/SECURITY.md, rule 9).
    let tables = args::text_array("op_tables", op_tables)?;
    let row_ids = args::key_array("op_row_ids", op_row_ids)?;
    let capped = |name: &str, len: usize| {
        if len > limits::ARRAY_ELEMENTS {
            Err(bad(name, "too_large"))
        } else {
            Ok(())
        }
    };
    let kinds = args::required("op_kinds", op_kinds)?;
    capped("op_kinds", kinds.len())?;
    let base_versions = args::required("op_base_versions", op_base_versions)?;
    capped("op_base_versions", base_versions.len())?;
    let payloads = args::required("op_payloads", op_payloads)?;
    capped("op_payloads", payloads.len())?;
    let total: usize = payloads.iter().flatten().map(<[u8]>::len).sum();
    if total > limits::PAYLOAD_BYTES {
        return Err(bad("op_payloads", "too_large"));
    }
    if tables.is_empty() {
        return Err(bad("op_tables", "empty"));
    }
    let n = tables.len();
    let same_length = |name: &str, len: usize| {
        if len == n {
            Ok(())
        } else {
            Err(bad(name, "shape").with_hint(format!(
                "the operation arrays must have equal lengths: op_tables has {n}, {name} has {len}"
            )))
        }
    };
    same_length("op_row_ids", row_ids.len())?;
    same_length("op_kinds", kinds.len())?;
    same_length("op_base_versions", base_versions.len())?;
    same_length("op_payloads", payloads.len())?;
    let kinds = kinds
        .iter()
        .map(|k| match k {
            None => Err(bad("op_kinds", "missing")),
            Some(1) => Ok(false),
            Some(2) => Ok(true),
            Some(_) => Err(bad("op_kinds", "range")),
        })
        .collect::<Result<Vec<bool>>>()?;
    let base_versions = base_versions
        .iter()
        .map(|v| match v {
            Some(v) if !(-limits::MAX_SAFE..=limits::MAX_SAFE).contains(&v) => {
                Err(bad("op_base_versions", "range"))
            }
            v => Ok(v),
        })
        .collect::<Result<Vec<_>>>()?;
    let mut ops = crate::alloc::try_with_capacity(n)?;
    ops.extend(
        tables
            .into_iter()
            .zip(row_ids)
            .zip(kinds)
            .zip(base_versions)
            .zip(payloads.iter())
            .map(|((((table, row_id), delete), base_version), payload)| {
                crate::interrupts::check();
                Operation {
                    table,
                    row_id,
                    delete,
                    base_version,
                    payload,
                }
            }),
    );
    Ok(ops)
}

/// Why the native call stops before the append.
enum Stop {
    /// A terminating record (an error or a conflict) at its operation.
    Rejected(Value),
    /// Host code would run here (docs/DESIGN.md §Push path, fallback).
    Fallback(Value),
    /// Every operation applied and a commit validator or planner is next: the candidate rows
    /// stay for the host's hooks and `push_finish` (src/push_stage.rs).
    Staged,
}

fn fallback_doc(reason: &str, at: Option<(usize, &str)>) -> Value {
    let mut doc = json!({"outcome": "fallback", "reason": reason});
    if let Some((op, table)) = at {
        doc["opIndex"] = json!(op);
        doc["table"] = json!(table);
    }
    doc
}

fn fallback(reason: &str, at: Option<(usize, &str)>) -> Stop {
    Stop::Fallback(fallback_doc(reason, at))
}

/// An error record of the default path: upstream's code and message, never retryable.
fn error_record(op: usize, code: &str, message: impl Into<String>) -> Value {
    json!({"opIndex": op, "status": "error", "code": code, "message": message.into(),
           "retryable": false})
}

fn rejected(op: usize, code: &str, message: impl Into<String>) -> Result<Option<Stop>> {
    Ok(Some(Stop::Rejected(error_record(op, code, message))))
}

const INVALID_REQUEST: &str = "sync.invalid_request";
const FORBIDDEN: &str = "sync.forbidden";
const ROW_MISSING: &str = "sync.row_missing";

/// `JSON.stringify` of a string (serde_json escapes exactly as ECMAScript for valid Unicode).
fn quoted(text: &str) -> String {
    Value::from(text).to_string()
}

/// A stored row or payload that cannot be read is a request error, never a rejection.
fn corrupt(table: &str, row_id: &str, what: &str, message: &str) -> Error {
    Error::Internal(format!(
        "syncular: stored row {table}/{row_id} has a corrupt {what}: {message}"
    ))
}

/// The meta columns an upsert writes: `_sync_server_version`, `_sync_scopes`, `_sync_payload`,
/// `_sync_column_versions`.
struct RowMeta<'a> {
    version: i64,
    scopes: &'a Map<String, Value>,
    payload: &'a [u8],
    column_versions: Option<&'a [u8]>,
}

/// What an applied upsert wrote: the row's new version, scopes and full payload, and the
/// stored row before it (as a validator sees it) with its version, for an update.
struct Upserted {
    version: i64,
    scopes: Map<String, Value>,
    payload: Vec<u8>,
    before: Option<(Value, i64)>,
}

/// A table of the running push schema whose relation is registered and usable.
struct Table {
    schema: TableSchema,
    relation: AppRelation,
    upsert_sql: String,
    /// The batched upsert ([`AppRelation::upsert_rows_sql`]), for a triggerless relation.
    batch_sql: Option<String>,
    /// The app columns' types a batch binds (none when the table is not materialized).
    column_types: Vec<ColumnType>,
    has_blob_refs: bool,
    has_references: bool,
    is_crdt: Vec<bool>,
}

/// Rows one prefetch statement reads at most.
const PREFETCH_ROWS: usize = 1_000;

/// What every operation reads; the mutable part of a run is the change list.
struct Context<'a, 'conn> {
    client: &'a SpiClient<'conn>,
    caller: pg_sys::Oid,
    partition: &'a str,
    allowed: &'a Allowed,
    options: &'a Options,
    tables: &'a HashMap<String, Table>,
    /// The operation whose app-row upsert is running: a class-23 error it raises becomes that
    /// operation's `sync.constraint_violation` (upstream's storage-errors mapping).
    upserting: Cell<Option<usize>>,
    /// The operations as a commit validator sees them, collected only when the push may be
    /// staged (src/push_stage.rs).
    evidence: Option<RefCell<Vec<Value>>>,
    /// Batches allowed in this run (src/push_batch.rs): rows read up front and upserts
    /// written per table; off when the run is repeated after an error.
    batching: bool,
    /// `(table, row_id)` of rows the commit touches more than once: always one statement each.
    repeated: &'a HashSet<(&'a str, &'a str)>,
    /// Tables with at least two batchable rows in the commit (one row gains nothing from a
    /// batch: its single statement is cheaper).
    batch_tables: RefCell<HashSet<String>>,
    /// Rows read up front (`None`: absent), taken by the operation that needs them.
    prefetched: RefCell<HashMap<(&'a str, &'a str), Option<StoredRow>>>,
    /// Upserts waiting for their table's batch, by table.
    pending: RefCell<BTreeMap<String, Batch>>,
    /// Something of this run was read or written in a batch.
    batched: Cell<bool>,
}

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
    /// Records an applied operation's evidence when the push may be staged.
    fn witness<'e>(&self, make: impl FnOnce() -> Evidence<'e>) {
        if let Some(evidence) = &self.evidence {
            evidence.borrow_mut().push(make().to_json());
        }
    }

    /// Whether an operation's row is read and written in batches.
    fn batchable(&self, op: &Operation<'a>, t: &Table) -> bool {
        self.batching
            && t.batch_sql.is_some()
            && self.batch_tables.borrow().contains(op.table)
            && !self.repeated.contains(&(op.table, op.row_id))
    }

    /// Reads every batchable row of the commit, one statement per table.
    fn prefetch(&self, ops: &[Operation<'a>]) -> Result<()> {
        if !self.batching || self.allowed.is_none() {
            return Ok(());
        }
        // A trigger on any table of the commit could change rows read up front: no batches.
        if ops.iter().any(|op| {
            self.tables
                .get(op.table)
                .is_some_and(|t| t.batch_sql.is_none())
        }) {
            return Ok(());
        }
        let mut wanted: BTreeMap<&'a str, Vec<&'a str>> = BTreeMap::new();
        for op in ops {
            crate::interrupts::check();
            crate::alloc::check()?;
            if let Some(t) = self.tables.get(op.table) {
                if t.batch_sql.is_some() && !self.repeated.contains(&(op.table, op.row_id)) {
                    wanted.entry(op.table).or_default().push(op.row_id);
                }
            }
        }
        wanted.retain(|_, ids| ids.len() > 1);
        self.batch_tables
            .borrow_mut()
            .extend(wanted.keys().map(|t| t.to_string()));
        for (table, ids) in wanted {
            self.batched.set(true);
            let t = &self.tables[table];
            // In slices, so no statement carries an array of every row id of a huge commit
            // (docs/DESIGN.md §Memory).
            for ids in ids.chunks(PREFETCH_ROWS) {
                crate::alloc::check()?;
                let mut found = t.relation.fetch_rows_as(
                    self.client,
                    self.caller,
                    self.partition,
                    ids.to_vec(),
                )?;
                let mut prefetched = self.prefetched.borrow_mut();
                for &id in ids {
                    crate::interrupts::check();
                    prefetched.insert((table, id), found.remove(id));
                }
            }
        }
        Ok(())
    }

    /// Writes the pending batches (before any statement whose order against them matters, and
    /// at the end of the run).
    fn flush(&self) -> Result<()> {
        let pending = std::mem::take(&mut *self.pending.borrow_mut());
        for (table, batch) in pending {
            crate::interrupts::check();
            let t = &self.tables[&table];
            if let Some(sql) = &t.batch_sql {
                t.relation.upsert_row_as(
                    self.client,
                    self.caller,
                    sql,
                    &batch.args(self.partition),
                )?;
            }
        }
        Ok(())
    }

    fn validated(&self, table: &str) -> bool {
        self.options.row_validator_tables.contains(table)
    }

    /// Steps U9/I6: a present, non-NULL crdt value needs the host's merger.
    fn crdt_stop(
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
    fn blob_refs(
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

    /// One app-row upsert (U13/I10), the projection bound from the merged values.
    fn upsert(
        &self,
        k: usize,
        op: &Operation<'a>,
        t: &Table,
        meta: RowMeta<'_>,
        values: &[Val],
    ) -> Result<()> {
        let RowMeta {
            version,
            scopes,
            payload,
            column_versions,
        } = meta;
        let mut args = vec![
            DatumWithOid::from(self.partition),
            DatumWithOid::from(op.row_id),
            DatumWithOid::from(version),
            DatumWithOid::from(JsonB(Value::Object(scopes.clone()))),
            DatumWithOid::from(payload),
            DatumWithOid::from(column_versions),
        ];
        if self.batchable(op, t) && Batch::accepts(values) {
            self.batched.set(true);
            let values = if t.schema.materialize { values } else { &[] };
            let full = {
                let mut pending = self.pending.borrow_mut();
                let batch = pending
                    .entry(op.table.to_string())
                    .or_insert_with(|| Batch::new(&t.column_types));
                batch.push(op.row_id, version, scopes, payload, column_versions, values);
                batch.is_full()
            };
            // Written early once large (src/push_batch.rs): the rows are written in the order
            // they were applied either way.
            if full {
                self.flush()?;
            }
            return Ok(());
        }
        // A single statement keeps its place after every pending one.
        self.flush()?;
        if t.schema.materialize {
            for (column, value) in t.schema.layout.columns.iter().zip(values) {
                args.push(self.projection(column.ty, value)?);
            }
        }
        self.upserting.set(Some(k));
        t.relation
            .upsert_row_as(self.client, self.caller, &t.upsert_sql, &args)?;
        self.upserting.set(None);
        Ok(())
    }

    /// One projected value (docs/CODEC.md §Column types); json is bound as text and cast by
    /// the statement, so jsonb's own errors (`\u0000`) surface as PostgreSQL raises them.
    fn projection<'v>(&self, ty: ColumnType, value: &'v Val<'_>) -> Result<DatumWithOid<'v>> {
        Ok(match value {
            Val::Null => DatumWithOid::null_oid(match ty {
                ColumnType::Integer => pg_sys::INT8OID,
                ColumnType::Float => pg_sys::FLOAT8OID,
                ColumnType::Boolean => pg_sys::BOOLOID,
                ColumnType::Bytes | ColumnType::Crdt => pg_sys::BYTEAOID,
                ColumnType::String | ColumnType::Json | ColumnType::BlobRef => pg_sys::TEXTOID,
            }),
            Val::Text(text) => {
                if text.contains('\0') {
                    // text cannot hold U+0000: PostgreSQL raises its own error (22021), as it
                    // does for a host binding the value (a request error, docs/DESIGN.md).
                    db::read(
                        self.client,
                        "SELECT pg_catalog.convert_from($1, 'UTF8')",
                        &[DatumWithOid::from(text.as_bytes())],
                    )?;
                    return Err(Error::Internal("syncular: U+0000 accepted as text".into()));
                }
                DatumWithOid::from(text.as_ref())
            }
            Val::Int(i) => DatumWithOid::from(*i),
            // upstream's driver sends String(n), so −0 arrives as 0 (docs/CODEC.md).
            Val::Float(f) => DatumWithOid::from(if *f == 0.0 { 0.0 } else { *f }),
            Val::Bool(b) => DatumWithOid::from(*b),
            Val::Bytes(bytes) => DatumWithOid::from(bytes.as_ref()),
        })
    }

    /// One operation, steps A1…I10 of docs/DESIGN.md §Push path in upstream's order. `Ok(None)`:
    /// applied (its change, if any, appended to `changes`).
    fn apply(
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

    fn delete(
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
            let stored_row = push_stage::row_map(columns, &stored_values);
            evidence(Some(stored_row), Some(stored.server_version))
        });
        Ok(None)
    }

    #[allow(clippy::too_many_arguments)]
    fn update(
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
        let server_version = stored.server_version.max(0) as u64;
        if let versions::Check::Conflict(marked) = versions::check(
            op.base_version,
            &present,
            |i| t.is_crdt[i],
            layout.primary_key,
            blob.as_deref(),
            server_version,
        ) {
            let bitmap = versions::conflict_bitmap(layout.columns.len(), &marked);
            return Ok(Some(Stop::Rejected(json!({
                "opIndex": k, "status": "conflict", "code": "sync.version_conflict",
                "message": "present columns moved past baseVersion (§6.2)",
                "serverVersion": stored.server_version,
                "serverRow": crate::alloc::try_base64(&BASE64, &stored.payload)?,
                "conflictColumns": BASE64.encode(bitmap),
            }))));
        }
        if let Some(stop) = self.crdt_stop(k, op, t, &patch) {
            return Ok(Some(stop));
        }
        let before = self
            .evidence
            .as_ref()
            .map(|_| push_stage::row_map(&layout.columns, &values));
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

    fn insert(
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
        rows::delete_tombstone(self.client, self.partition, op.table, op.row_id)?;
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

    /// An applied upsert: its change, and its evidence when the push may be staged.
    fn applied_upsert(
        &self,
        k: usize,
        op: &Operation<'a>,
        t: &Table,
        values: &[Val<'_>],
        upserted: Upserted,
        changes: &mut Vec<ChangeOut>,
    ) {
        let Upserted {
            version,
            scopes,
            payload,
            before,
        } = upserted;
        changes.push(ChangeOut {
            table: op.table.to_string(),
            row_id: op.row_id.to_string(),
            delete: false,
            row_version: Some(version),
            scopes,
            payload: Some(payload),
        });
        self.witness(|| {
            let (stored, stored_server_version) = match before {
                Some((row, version)) => (Some(row), Some(version)),
                None => (None, None),
            };
            Evidence {
                op_index: k,
                delete: false,
                table: op.table,
                row_id: op.row_id,
                row: Some(push_stage::row_map(&t.schema.layout.columns, values)),
                stored,
                stored_server_version,
                next_server_version: Some(version),
            }
        });
    }

    /// Step C5 and the commit-level hooks C6…C8: every operation in order, then what host code
    /// would run once nothing terminated.
    fn run(&self, ops: &[Operation<'a>], changes: &mut Vec<ChangeOut>) -> Result<Option<Stop>> {
        self.prefetch(ops)?;
        let stop = self.operations(ops, changes)?;
        // Pending writes go first even before a stop: an error they raise comes before it in
        // upstream's order (then the run is repeated without batches, `push`).
        self.flush()?;
        Ok(stop)
    }

    fn operations(
        &self,
        ops: &[Operation<'a>],
        changes: &mut Vec<ChangeOut>,
    ) -> Result<Option<Stop>> {
        for (k, op) in ops.iter().enumerate() {
            crate::interrupts::check();
            if let Some(stop) = self.apply(k, op, changes)? {
                return Ok(Some(stop));
            }
        }
        if let Some((k, op)) = ops
            .iter()
            .enumerate()
            .find(|(_, op)| self.tables.get(op.table).is_some_and(|t| t.has_references))
        {
            return Ok(Some(fallback("references", Some((k, op.table)))));
        }
        let hooks = self.options.commit_validator || self.options.reaction_planner;
        if hooks && self.options.stage {
            return Ok(Some(Stop::Staged));
        }
        if self.options.commit_validator {
            return Ok(Some(fallback("commit_validator", None)));
        }
        if self.options.reaction_planner {
            return Ok(Some(fallback("reaction_planner", None)));
        }
        Ok(None)
    }
}

/// Runs `body` in an internal subtransaction (as PL/pgSQL's exception blocks do): kept when
/// `keep` says so, rolled back otherwise and on any error, which is returned as the caught
/// panic for the caller to map or re-raise.
fn in_subtransaction<R>(
    body: impl FnOnce() -> R,
    keep: impl FnOnce(&R) -> bool,
) -> std::thread::Result<R> {
    // SAFETY: the xact.c protocol PL/pgSQL follows: begin, switch back to the caller's memory
    // context (results must outlive the subtransaction), then release or roll back exactly once
    // and restore the caller's memory context and resource owner. pgrx turned any ERROR inside
    // `body` into a panic after flushing the error state, so the rollback runs in a clean state.
    let (context, owner) = unsafe {
        let context = pg_sys::CurrentMemoryContext;
        let owner = pg_sys::CurrentResourceOwner;
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(context);
        (context, owner)
    };
    let outcome = catch_unwind(AssertUnwindSafe(body));
    let release = matches!(&outcome, Ok(r) if keep(r));
    // SAFETY: as above; the subtransaction begun here is the current one (every nested one of
    // `body` ended with its statement or was aborted with it).
    unsafe {
        if release {
            pg_sys::ReleaseCurrentSubTransaction();
        } else {
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
        }
        pg_sys::MemoryContextSwitchTo(context);
        pg_sys::CurrentResourceOwner = owner;
    }
    outcome
}

/// Whether a caught PostgreSQL error is of SQLSTATE class 23 (integrity constraint violation).
fn integrity_violation(panic: &(dyn std::any::Any + Send)) -> bool {
    in_class(panic, "23000")
}

/// Whether a caught PostgreSQL error is of the SQLSTATE class of `class` (`"23000"`: 23).
fn in_class(panic: &(dyn std::any::Any + Send), class: &str) -> bool {
    let Some(report) = error::postgres_report(panic) else {
        return false;
    };
    let class = crate::port::make_sqlstate(class);
    (report.sql_error_code() as i32) & 0xFFF == class & 0xFFF
}

/// Whether a batched run that failed this way is run again statement by statement: any error
/// whose operation or order a batch may have changed (a constraint, a value, a privilege the
/// rows read up front needed before an earlier operation's rejection, this extension's own) —
/// but not what would end the call anyway: a cancel or shutdown (class 57), a deadlock or
/// serialization failure (40), a lock timeout (55), exhausted resources (53) or a system error
/// (58).
fn worth_repeating<R>(outcome: &std::thread::Result<Result<R>>) -> bool {
    match outcome {
        Ok(Ok(_)) => false,
        Ok(Err(_)) => true,
        Err(panic) => !["57000", "40000", "55000", "53000", "58000"]
            .iter()
            .any(|class| in_class(panic.as_ref(), class)),
    }
}

/// The replay of a stored result (steps C1/C4).
fn replay(stored: Value, at: &str) -> Value {
    let applied = stored["status"] == "applied";
    let mut out = json!({"outcome": if applied { "cached" } else { "rejected" },
                         "replayed": true, "at": at});
    if applied {
        out["commitSeq"] = stored["commitSeq"].clone();
    }
    out["result"] = stored;
    out
}

struct Request<'a> {
    key: [&'a str; 3],
    actor_id: &'a str,
    created_at_ms: i64,
    running: i64,
    allowed: Allowed,
    ops: Vec<Operation<'a>>,
    declared: Vec<args::Declaration>,
    options: Options,
}

/// The static refusals of docs/DESIGN.md §Push path (before the lock): the push schema at the
/// running version, each touched table registered, usable, of an eligible primary-key type and
/// in agreement with the stored layouts. Tables the schema does not have are left out (step
/// A1 rejects them at their operation).
fn open_tables(
    client: &SpiClient<'_>,
    request: &Request<'_>,
) -> Result<std::result::Result<HashMap<String, Table>, Stop>> {
    let running = request.running;
    if request
        .options
        .client_schema_version
        .is_some_and(|v| v != running)
    {
        return Ok(Err(fallback("client_schema_version", None)));
    }
    let marker_at_running = db::first::<bool>(db::read(
        client,
        "SELECT EXISTS (SELECT 1 FROM syncular.sync_schema_meta m
                         WHERE m.id = 1 AND m.schema_version = $1)",
        &[DatumWithOid::from(running)],
    )?)? == Some(true);
    let mut tables = HashMap::new();
    let mut unknown = HashSet::new();
    for (k, op) in request.ops.iter().enumerate() {
        crate::interrupts::check();
        let tbl = op.table;
        if tables.contains_key(tbl) || unknown.contains(tbl) {
            continue;
        }
        let at = Some((k, tbl));
        let schema = match push_schema::table_at(client, running, tbl)? {
            None => return Ok(Err(fallback("schema_not_registered", None))),
            Some(None) => {
                unknown.insert(tbl);
                continue;
            }
            Some(Some(schema)) => schema,
        };
        let pk = &schema.layout.columns[schema.layout.primary_key];
        if !matches!(
            pk.ty,
            ColumnType::String | ColumnType::Integer | ColumnType::Boolean | ColumnType::Json
        ) {
            return Ok(Err(fallback("pk_type", at)));
        }
        let Ok(relation) = tables::open(client, tbl)? else {
            return Ok(Err(fallback("schema_not_registered", at)));
        };
        if marker_at_running && !push_schema::agrees_with_layouts(client, running, tbl, &schema)? {
            return Ok(Err(fallback("descriptor_mismatch", at)));
        }
        let columns: Vec<(&str, Option<&str>)> = if schema.materialize {
            schema
                .layout
                .columns
                .iter()
                .map(|c| {
                    (
                        c.name.as_str(),
                        (c.ty == ColumnType::Json).then_some("jsonb"),
                    )
                })
                .collect()
        } else {
            Vec::new()
        };
        let upsert_sql = relation.upsert_sql(&columns);
        let column_types: Vec<ColumnType> = if schema.materialize {
            schema.layout.columns.iter().map(|c| c.ty).collect()
        } else {
            Vec::new()
        };
        let batch_sql = relation.triggerless.then(|| {
            let names = schema.layout.columns.iter().map(|c| c.name.as_str());
            let batched: Vec<(&str, &str, Option<&str>)> = names
                .zip(&column_types)
                .map(|(name, ty)| {
                    let (element, cast) = push_batch::sql_type(*ty);
                    (name, element, cast)
                })
                .collect();
            relation.upsert_rows_sql(&batched)
        });
        let has_references = ["references", "referencedBy"].iter().any(|key| {
            schema.stored[*key]
                .as_array()
                .is_some_and(|list| !list.is_empty())
        });
        tables.insert(
            tbl.to_string(),
            Table {
                has_blob_refs: schema
                    .layout
                    .columns
                    .iter()
                    .any(|c| c.ty == ColumnType::BlobRef),
                is_crdt: schema
                    .layout
                    .columns
                    .iter()
                    .map(|c| c.ty == ColumnType::Crdt)
                    .collect(),
                has_references,
                upsert_sql,
                batch_sql,
                column_types,
                relation,
                schema,
            },
        );
    }
    Ok(Ok(tables))
}

/// What ended a failed run, for the DEBUG1 line of a repeated push.
fn failure<R>(outcome: &std::thread::Result<Result<R>>) -> String {
    match outcome {
        Ok(Err(e)) => format!("{e:?}"),
        Err(panic) => error::postgres_report(panic.as_ref())
            .map_or_else(|| "a panic".into(), |report| report.message().to_string()),
        Ok(Ok(_)) => String::new(),
    }
}

/// `(table, row_id)` of the rows more than one operation touches.
fn repeated_rows<'a>(ops: &[Operation<'a>]) -> HashSet<(&'a str, &'a str)> {
    let mut seen = HashSet::new();
    let mut repeated = HashSet::new();
    for op in ops {
        crate::interrupts::check();
        let key = (op.table, op.row_id);
        if !seen.insert(key) {
            repeated.insert(key);
        }
    }
    repeated
}

/// A version-4 UUID from PostgreSQL's strong random source, as `gen_random_uuid()` makes it
/// (the default `cacheIdentity`), without a statement.
fn random_uuid() -> Result<String> {
    let mut bytes = [0u8; 16];
    // SAFETY: fills exactly the 16 bytes of the buffer; returns false when no source works.
    if !unsafe { pg_sys::pg_strong_random(bytes.as_mut_ptr().cast(), bytes.len()) } {
        return Err(Error::Internal(
            "syncular: could not generate random values".into(),
        ));
    }
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    ))
}

/// The whole push after the arguments were read; runs as the extension owner.
fn push(client: &SpiClient<'_>, caller: pg_sys::Oid, request: &Request<'_>) -> Result<Value> {
    let [partition, ..] = request.key;
    // C1: the optimistic replay check, without lock or gate.
    if let Some(stored) = push::stored_result(client, &request.key, false)? {
        return Ok(replay(stored, "optimistic"));
    }
    let tables = match open_tables(client, request)? {
        Ok(tables) => tables,
        Err(Stop::Fallback(doc)) => return Ok(doc),
        Err(Stop::Rejected(_) | Stop::Staged) => unreachable!("static checks only fall back"),
    };
    // C2…C4: lock, the gate under the lock, the locked re-check.
    log::lock(client, partition)?;
    gate::read_state(client, Some(partition), request.running, true)?
        .assert_ready(request.running, &request.declared)?;
    if let Some(stored) = push::stored_result(client, &request.key, true)? {
        return Ok(replay(stored, "locked"));
    }
    let repeated = repeated_rows(&request.ops);
    // A batched run that fails is run again statement by statement (src/push_batch.rs), so
    // which error, rejection or fallback comes first is always upstream's.
    let mut batching = true;
    let (stop, changes, evidence) = loop {
        let context = Context {
            client,
            caller,
            partition,
            allowed: &request.allowed,
            options: &request.options,
            tables: &tables,
            upserting: Cell::new(None),
            evidence: (request.options.stage
                && (request.options.commit_validator || request.options.reaction_planner))
                .then(|| RefCell::new(Vec::with_capacity(request.ops.len()))),
            batching,
            repeated: &repeated,
            batch_tables: RefCell::new(HashSet::new()),
            prefetched: RefCell::new(HashMap::new()),
            pending: RefCell::new(BTreeMap::new()),
            batched: Cell::new(false),
        };
        let mut changes = Vec::new();
        let outcome = in_subtransaction(
            || context.run(&request.ops, &mut changes),
            // Staged: the candidate rows stay in the host's transaction for its hooks.
            |r| matches!(r, Ok(None | Some(Stop::Staged))),
        );
        if context.batched.get() && worth_repeating(&outcome) {
            pgrx::debug1!(
                "syncular: push_commit runs its operations again without batches after: {}",
                failure(&outcome)
            );
            batching = false;
            continue;
        }
        let stop = match outcome {
            Ok(Ok(None)) => None,
            Ok(Ok(Some(stop))) => Some(stop),
            Ok(Err(e)) => return Err(e),
            Err(panic) => match context.upserting.get() {
                Some(k) if integrity_violation(panic.as_ref()) => {
                    Some(Stop::Rejected(error_record(
                        k,
                        "sync.constraint_violation",
                        "write violates a relational constraint",
                    )))
                }
                _ => resume_unwind(panic),
            },
        };
        break (stop, changes, context.evidence.map(RefCell::into_inner));
    };
    let identity = match &request.options.cache_identity {
        Some(identity) => identity.clone(),
        None => random_uuid()?,
    };
    let header = Header {
        key: request.key,
        actor_id: request.actor_id,
        created_at_ms: request.created_at_ms,
        running: request.running,
        identity: &identity,
        return_changes: request.options.return_changes,
    };
    match stop {
        None => {
            let appended = push_append::append(client, &header, changes)?;
            push_append::store_applied(client, &header, request.ops.len(), appended)
        }
        Some(Stop::Staged) => {
            push_stage::save(&header, request.ops.len(), &changes);
            Ok(json!({"outcome": "staged", "operations": evidence.unwrap_or_default()}))
        }
        Some(Stop::Fallback(doc)) => Ok(doc),
        Some(Stop::Rejected(record)) => {
            // C9: only the rejection is stored; no commit_seq is consumed.
            let document = json!({"status": "rejected", "results": [record],
                                  "recordedAtMs": request.created_at_ms, "cacheIdentity": identity});
            let canonical = push::store_result(client, &request.key, document)?;
            Ok(push_append::finished(canonical, &identity, None))
        }
    }
}

/// SECURITY INVOKER: the app rows are written as the caller (module comment).
#[allow(clippy::too_many_arguments)]
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.push_commit(
  partition text, client_id text, client_commit_id text, actor_id text, created_at_ms bigint,
  running_schema_version bigint, allowed jsonb,
  op_tables text[], op_row_ids text[], op_kinds smallint[], op_base_versions bigint[],
  op_payloads bytea[], declared jsonb DEFAULT '[]', options jsonb DEFAULT '{}') RETURNS jsonb
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'push_commit_wrapper';
"#
)]
fn push_commit(
    partition: Option<&str>,
    client_id: Option<&str>,
    client_commit_id: Option<&str>,
    actor_id: Option<&str>,
    created_at_ms: Option<i64>,
    running_schema_version: Option<i64>,
    allowed: Option<JsonArg>,
    op_tables: Option<args::TextArray>,
    op_row_ids: Option<args::TextArray>,
    op_kinds: Option<Array<i16>>,
    op_base_versions: Option<Array<i64>>,
    op_payloads: Option<Array<&[u8]>>,
    declared: Option<JsonArg>,
    options: Option<JsonArg>,
) -> JsonB {
    error::run(|| {
        let partition = args::text_ref("partition", partition)?;
        let client_id = args::text_ref("client_id", client_id)?;
        let client_commit_id = args::text_ref("client_commit_id", client_commit_id)?;
        let actor_id = args::text_ref("actor_id", actor_id)?;
        let created_at_ms = args::count("created_at_ms", created_at_ms)?;
        let running = args::count("running_schema_version", running_schema_version)?;
        let allowed = allowed_arg(args::optional_json("allowed", allowed)?)?;
        let declared = args::declarations(declared)?;
        let options = Options::parse(args::optional_json("options", options)?)?;
        let ops = operations(
            op_tables.as_ref(),
            op_row_ids.as_ref(),
            op_kinds.as_ref(),
            op_base_versions.as_ref(),
            op_payloads.as_ref(),
        )?;
        // SAFETY: reads a backend global of the current transaction; never errors.
        if unsafe { pg_sys::XactIsoLevel } != pg_sys::XACT_READ_COMMITTED as i32 {
            return Err(Error::invalid_transaction_state("isolation"));
        }
        // A staged push stands until push_finish or a rollback: no push may run over its
        // candidate rows (src/push_guard.rs).
        push_guard::check_nothing_staged()?;
        // A staged push leaves candidate rows for push_finish: in autocommit they would be
        // committed with no commit appended.
        // SAFETY: reads backend state of the current transaction; never errors.
        if options.stage && !unsafe { pg_sys::IsTransactionBlock() } {
            return Err(Error::invalid_transaction_state("no_transaction_block"));
        }
        let request = Request {
            key: [partition, client_id, client_commit_id],
            actor_id,
            created_at_ms,
            running,
            allowed,
            ops,
            declared,
            options,
        };
        let caller = access::current_role();
        db::with_spi(|client| access::as_extension_owner(client, || push(client, caller, &request)))
            .map(JsonB)
    })
}
