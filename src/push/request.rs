//! Step A0 of the one-call push (docs/DESIGN.md §Push path): the request read from
//! `push_commit`'s arguments — the operations from the parallel arrays (borrowed, never
//! copied), `options` (what host code exists) and `allowed` (the scope resolver's outcome).

use crate::args::{self};
use crate::error::{Error, Result};
use crate::limits;
use pgrx::datum::Array;
use serde_json::{Map, Value};
use std::collections::{HashMap, HashSet};

/// One operation of the commit, from the parallel arrays: borrowed from the arguments, never
/// copied (docs/DESIGN.md §Memory).
pub(super) struct Operation<'a> {
    pub(super) table: &'a str,
    pub(super) row_id: &'a str,
    pub(super) delete: bool,
    pub(super) base_version: Option<i64>,
    pub(super) payload: Option<&'a [u8]>,
}

/// `options` (docs/API.md `push_commit`): what host code exists, and what the call returns.
#[derive(Default)]
pub(super) struct Options {
    pub(super) cache_identity: Option<String>,
    pub(super) client_schema_version: Option<i64>,
    pub(super) row_validator_tables: HashSet<String>,
    pub(super) crdt_mergers: bool,
    pub(super) blob_store_none: bool,
    pub(super) verified_blob_ids: HashSet<String>,
    pub(super) commit_validator: bool,
    pub(super) reaction_planner: bool,
    /// `onCommitHooks: "stage"`: at a commit validator or planner, stage instead of falling back.
    pub(super) stage: bool,
    pub(super) return_changes: bool,
}

/// The resolver's outcome: `{variable: [allowed values]}`, or `None` when it threw.
pub(super) type Allowed = Option<HashMap<String, Vec<String>>>;

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
    pub(super) fn parse(value: Option<Value>) -> Result<Options> {
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

    pub(super) fn with_defaults(mut self) -> Options {
        self.crdt_mergers = true;
        self
    }
}

pub(super) fn allowed_arg(value: Option<Value>) -> Result<Allowed> {
    let Some(value) = value else {
        return Ok(None);
    };
    let Value::Object(map) = value else {
        return Err(bad("allowed", "type").with_hint(
            "allowed is the scope resolver's outcome: an object of arrays of strings, e.g. \
             {\"project_id\": [\"p1\", \"p2\"]} ([\"*\"] for every value), or NULL when \
             the resolver failed",
        ));
    };
    map.into_iter()
        .map(|(var, values)| {
            crate::interrupts::check();
            let Value::Array(values) = values else {
                return Err(bad("allowed", "type").with_hint(format!(
                    "allowed.{var} must be an array of the variable's allowed values (strings)"
                )));
            };
            let mut values = values
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    _ => Err(bad("allowed", "type").with_hint(format!(
                        "allowed.{var} holds a value that is not a string: scope values are strings"
                    ))),
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
pub(super) fn operations<'a>(
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

/// The request of one `push_commit` call, its arguments read.
pub(super) struct Request<'a> {
    pub(super) key: [&'a str; 3],
    pub(super) actor_id: &'a str,
    pub(super) created_at_ms: i64,
    pub(super) running: i64,
    pub(super) allowed: Allowed,
    pub(super) ops: Vec<Operation<'a>>,
    pub(super) declared: Vec<args::Declaration>,
    pub(super) options: Options,
}
