//! The push schema (docs/CODEC.md §Push schema): the host's compiled schema per schema version,
//! stored by `set_push_schema` after checking it against the registered relations and the
//! layouts `migrate_schema` stored, and read back as codec layouts by `encode_row`/`decode_row`
//! (and, later, the one-call push).

use crate::args::{self, JsonArg};
use crate::codec::{Column, ColumnType, Layout};
use crate::db;
use crate::error::{self, Error, Result};
use crate::limits;
use crate::tables;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use serde_json::{json, Map, Value};
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

/// One table of a push schema, validated.
#[derive(Clone)]
pub struct TableSchema {
    pub layout: Layout,
    /// `(variable, column index)` per scope pattern, in declared order (read by the one-call
    /// push; the codec functions need only the layout).
    pub scopes: Vec<(String, usize)>,
    pub materialize: bool,
    /// The normalized descriptor, as stored.
    pub stored: Value,
}

fn invalid(argument: &str, reason: &str) -> Error {
    Error::invalid_argument(argument, reason)
}

/// A required non-empty string member.
fn text_member<'a>(obj: &'a Map<String, Value>, key: &str, at: &str) -> Result<&'a str> {
    match obj.get(key) {
        None | Some(Value::Null) => Err(invalid(&format!("{at}.{key}"), "missing")),
        Some(Value::String(s)) if s.is_empty() => Err(invalid(&format!("{at}.{key}"), "empty")),
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(invalid(&format!("{at}.{key}"), "type")),
    }
}

/// An optional boolean member (`default` when absent).
fn bool_member(obj: &Map<String, Value>, key: &str, at: &str, default: bool) -> Result<bool> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(invalid(&format!("{at}.{key}"), "type")),
    }
}

/// An optional array member, kept as given (`[]` when absent).
fn array_member(obj: &Map<String, Value>, key: &str, at: &str) -> Result<Vec<Value>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => Ok(items.clone()),
        Some(_) => Err(invalid(&format!("{at}.{key}"), "type")),
    }
}

/// Validates one table descriptor (docs/CODEC.md §Push schema) and normalizes it.
pub fn table_schema(tbl: &str, descriptor: &Value) -> Result<TableSchema> {
    let at = format!("tables.{tbl}");
    if tbl.starts_with("sync_") {
        return Err(invalid(&at, "reserved"));
    }
    let Value::Object(obj) = descriptor else {
        return Err(invalid(&at, "type"));
    };
    let Some(Value::Array(items)) = obj.get("columns") else {
        return Err(invalid(
            &format!("{at}.columns"),
            if obj.contains_key("columns") {
                "type"
            } else {
                "missing"
            },
        ));
    };
    if items.is_empty() {
        return Err(invalid(&format!("{at}.columns"), "empty"));
    }
    if items.len() > limits::TABLE_COLUMNS {
        return Err(
            invalid(&format!("{at}.columns"), "too_large").with_hint(format!(
                "table {tbl} declares {} columns, at most {} are allowed",
                items.len(),
                limits::TABLE_COLUMNS
            )),
        );
    }
    let mut columns: Vec<Column> = Vec::with_capacity(items.len());
    let mut stored_columns = Vec::with_capacity(items.len());
    // Column index by name: every name is looked up once, so validating a table is linear in
    // its columns (it runs for every push, docs/SECURITY.md "Time").
    let mut by_name: HashMap<&str, usize> = HashMap::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        crate::interrupts::check();
        let at = format!("{at}.columns[{i}]");
        let Value::Object(column) = item else {
            return Err(invalid(&at, "type"));
        };
        let name = text_member(column, "name", &at)?;
        if name.starts_with("_sync_") {
            return Err(invalid(&format!("{at}.name"), "reserved"));
        }
        if by_name.insert(name, i).is_some() {
            return Err(invalid(&format!("{at}.name"), "shape")
                .with_hint(format!("table {tbl} declares column {name} twice")));
        }
        let type_name = text_member(column, "type", &at)?;
        let ty = ColumnType::from_name(type_name).ok_or_else(|| {
            invalid(&format!("{at}.type"), "shape").with_hint(format!(
                "column {name} of table {tbl}: unknown type {type_name:?} (string, integer, float, boolean, json, bytes, blob_ref, crdt)"
            ))
        })?;
        let nullable = match column.get("nullable") {
            Some(Value::Bool(b)) => *b,
            None | Some(Value::Null) => return Err(invalid(&format!("{at}.nullable"), "missing")),
            Some(_) => return Err(invalid(&format!("{at}.nullable"), "type")),
        };
        let mut stored = json!({"name": name, "type": type_name, "nullable": nullable});
        match column.get("crdtType") {
            None | Some(Value::Null) => {}
            Some(Value::String(crdt)) => stored["crdtType"] = json!(crdt),
            Some(_) => return Err(invalid(&format!("{at}.crdtType"), "type")),
        }
        stored_columns.push(stored);
        columns.push(Column {
            name: name.to_string(),
            ty,
            nullable,
        });
    }
    let index_of = |name: &str| by_name.get(name).copied();
    let primary_key_name = text_member(obj, "primaryKey", &at)?;
    let primary_key = index_of(primary_key_name).ok_or_else(|| {
        invalid(&format!("{at}.primaryKey"), "shape")
            .with_hint(format!("table {tbl} has no column {primary_key_name}"))
    })?;
    let mut scopes = Vec::new();
    let declared_scopes = array_member(obj, "scopes", &at)?;
    if declared_scopes.len() > limits::SCOPE_VARIABLES {
        return Err(
            invalid(&format!("{at}.scopes"), "too_large").with_hint(format!(
                "table {tbl} declares {} scopes, at most {} are allowed",
                declared_scopes.len(),
                limits::SCOPE_VARIABLES
            )),
        );
    }
    for (i, scope) in declared_scopes.iter().enumerate() {
        let at = format!("{at}.scopes[{i}]");
        let Value::Object(scope) = scope else {
            return Err(invalid(&at, "type"));
        };
        let variable = text_member(scope, "variable", &at)?;
        let column = text_member(scope, "column", &at)?;
        let index = index_of(column).ok_or_else(|| {
            invalid(&format!("{at}.column"), "shape")
                .with_hint(format!("table {tbl} has no column {column}"))
        })?;
        if scopes.iter().any(|(v, _)| v == variable) {
            return Err(
                invalid(&format!("{at}.variable"), "shape").with_hint(format!(
                    "table {tbl} declares scope variable {variable} twice"
                )),
            );
        }
        scopes.push((variable.to_string(), index));
    }
    let materialize = bool_member(obj, "materialize", &at, true)?;
    let stored = json!({
        "columns": stored_columns,
        "primaryKey": primary_key_name,
        "scopes": scopes.iter().map(|(v, i)| json!({"variable": v, "column": columns[*i].name})).collect::<Vec<_>>(),
        "materialize": materialize,
        "references": array_member(obj, "references", &at)?,
        "referencedBy": array_member(obj, "referencedBy", &at)?,
    });
    Ok(TableSchema {
        layout: Layout {
            columns,
            primary_key,
        },
        scopes,
        materialize,
        stored,
    })
}

/// The PostgreSQL type of a materialized column of each type (docs/CODEC.md §Column types).
fn sql_type(ty: ColumnType) -> pg_sys::Oid {
    match ty {
        ColumnType::String | ColumnType::BlobRef => pg_sys::TEXTOID,
        ColumnType::Integer => pg_sys::INT8OID,
        ColumnType::Float => pg_sys::FLOAT8OID,
        ColumnType::Boolean => pg_sys::BOOLOID,
        ColumnType::Json => pg_sys::JSONBOID,
        ColumnType::Bytes | ColumnType::Crdt => pg_sys::BYTEAOID,
    }
}

fn type_name(oid: pg_sys::Oid) -> String {
    // SAFETY: `format_type_be` returns a palloc'd NUL-terminated string (freed with the call's
    // memory context) or raises for an unknown OID, which a live attribute's type is not.
    unsafe {
        std::ffi::CStr::from_ptr(pg_sys::format_type_be(oid))
            .to_string_lossy()
            .into_owned()
    }
}

fn mismatch(argument: &str, hint: String) -> Error {
    invalid(argument, "mismatch").with_hint(hint)
}

/// A registered table's relation must hold every app column of a materialized table at its
/// type, nullable where the schema says nullable. Unregistered tables are accepted: the native
/// push falls back for them (docs/CODEC.md §Push schema).
fn check_relation(client: &SpiClient<'_>, tbl: &str, schema: &TableSchema) -> Result<()> {
    if !tables::is_registered(client, tbl)? {
        return Ok(());
    }
    let relation = tables::open(client, tbl)?
        .map_err(|why| mismatch(&format!("tables.{tbl}"), format!("table {tbl}: {why}")))?;
    if !schema.materialize {
        return Ok(());
    }
    let have = relation.columns();
    let have: HashMap<&str, &tables::RelationColumn> =
        have.iter().map(|c| (c.name.as_str(), c)).collect();
    for (i, column) in schema.layout.columns.iter().enumerate() {
        crate::interrupts::check();
        let at = format!("tables.{tbl}.columns[{i}]");
        let name = &column.name;
        let Some(found) = have.get(name.as_str()) else {
            return Err(mismatch(
                &at,
                format!(
                    "table {tbl}: relation {} has no column {name}",
                    relation.qualified()
                ),
            ));
        };
        let wanted = sql_type(column.ty);
        if found.type_oid != wanted {
            return Err(mismatch(
                &at,
                format!(
                    "table {tbl}, column {name}: {} needs {} in the relation, found {}",
                    column.ty.name(),
                    type_name(wanted),
                    type_name(found.type_oid)
                ),
            ));
        }
        if column.nullable && found.not_null {
            return Err(mismatch(
                &at,
                format!("table {tbl}, column {name}: nullable in the push schema, NOT NULL in the relation"),
            ));
        }
    }
    Ok(())
}

/// The layouts recorded for `version`: the history's (`sync_schema_layouts`, every version a
/// migration published), else the marker's (a 0.1.0 install updated has no history before it).
const LAYOUTS_AT: &str = "SELECT l.layouts FROM syncular.sync_schema_layouts l
                           WHERE l.schema_version = $1
                          UNION ALL
                          SELECT m.layouts FROM syncular.sync_schema_meta m
                           WHERE m.id = 1 AND m.schema_version = $1
                          LIMIT 1";

/// How many documents a backend keeps parsed ([`KEPT_SCHEMAS`], [`KEPT_LAYOUTS`]), and up to what
/// size each: a bound on what a backend holds, whatever the stored documents (a larger one is
/// parsed on every read, as before it was kept).
const KEPT_DOCUMENTS: usize = 4;
const KEPT_DOCUMENT_BYTES: usize = 1 << 20;

thread_local! {
    /// The push schemas this backend read last: each version's stored `tables` bytes with the
    /// table schemas parsed from them so far (`None`: not in the schema). A read below SQL
    /// compares the bytes it finds with the kept ones and parses only what changed: the bytes
    /// read in the snapshot of the statement the read replaces decide, so nothing kept can
    /// outlive a change (docs/BENCHMARKS.md, "Server CPU").
    static KEPT_SCHEMAS: std::cell::RefCell<Vec<KeptSchema>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The stored layouts this backend parsed last, by their text (as [`KEPT_SCHEMAS`]).
    static KEPT_LAYOUTS: std::cell::RefCell<Vec<(String, Layouts)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Stored layouts, parsed: each table's columns by its name.
type Layouts = Rc<Map<String, Value>>;

struct KeptSchema {
    version: i64,
    bytes: crate::jsonb::OwnedJsonb,
    tables: HashMap<String, Option<Rc<TableSchema>>>,
}

/// Keeps `entry` first in `kept`, bounded by [`KEPT_DOCUMENTS`].
fn keep<T>(kept: &mut Vec<T>, entry: T) {
    kept.insert(0, entry);
    kept.truncate(KEPT_DOCUMENTS);
}

/// The layouts `migrate_schema` recorded for `version` (`sync_schema_layouts`, or the marker's
/// when the marker is at `version`), parsed; read with a fresh snapshot, below SQL by their
/// primary keys (through SQL where Citus keeps the tables on another node).
fn layouts_at(client: &SpiClient<'_>, version: i64) -> Result<Option<Layouts>> {
    use crate::heap::{self, Lookup, SyncTable};
    let here = heap::with_snapshot(true, |snapshot| {
        // SAFETY: the keys are datums passed by value; the snapshot is registered around the
        // lookups.
        unsafe {
            let text = |row: Option<&heap::Row>| row.map_or(Ok(None), |row| row.text(c"layouts"));
            let key = [heap::bigint_key(version)];
            match heap::by_primary_key(SyncTable::SchemaLayouts, None, &key, snapshot, text)? {
                Lookup::Here(Some(text), _) => return Ok(Some(Some(text))),
                Lookup::Here(None, _) => {}
                Lookup::Elsewhere => return Ok(None),
            }
            let key = [heap::singleton_key()];
            let marker =
                heap::by_primary_key(SyncTable::SchemaMeta, None, &key, snapshot, |row| {
                    let Some(row) = row else { return Ok(None) };
                    if row.bigint(c"schema_version")? != Some(version) {
                        return Ok(None);
                    }
                    row.text(c"layouts")
                })?;
            Ok(match marker {
                Lookup::Here(text, _) => Some(text),
                Lookup::Elsewhere => None,
            })
        }
    })?;
    let text = match here {
        Some(text) => text,
        None => db::first::<String>(db::write(
            client,
            LAYOUTS_AT,
            &[DatumWithOid::from(version)],
        )?)?,
    };
    let Some(text) = text else {
        return Ok(None);
    };
    let kept = KEPT_LAYOUTS.with(|kept| {
        let kept = kept.borrow();
        kept.iter()
            .find(|(t, _)| *t == text)
            .map(|(_, map)| map.clone())
    });
    if let Some(map) = kept {
        return Ok(Some(map));
    }
    let map = std::rc::Rc::new(match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(map)) => map,
        _ => Map::new(),
    });
    if text.len() <= KEPT_DOCUMENT_BYTES {
        KEPT_LAYOUTS.with(|kept| keep(&mut kept.borrow_mut(), (text, map.clone())));
    }
    Ok(Some(map))
}

/// When layouts are recorded for `version` (the marker's, or a migration's before it), the push
/// schema must have exactly their tables (`whole`: and no table fewer), columns, types,
/// nullability and order.
fn check_layouts<S: std::borrow::Borrow<TableSchema>>(
    client: &SpiClient<'_>,
    version: i64,
    schemas: &[(String, S)],
    whole: bool,
) -> Result<()> {
    // A fresh snapshot: after the lock `set_push_schema` waited on, a migration committed in the
    // meantime is seen (red team 6, R6-1).
    let Some(layouts) = layouts_at(client, version)? else {
        return Ok(());
    };
    let differs = |at: &str, what: String| {
        mismatch(
            at,
            format!("{what} (the layouts stored by migrate_schema at schema version {version})"),
        )
    };
    for (tbl, schema) in schemas {
        crate::interrupts::check();
        let schema: &TableSchema = schema.borrow();
        let Some(Value::Array(columns)) = layouts.get(tbl) else {
            return Err(differs(
                &format!("tables.{tbl}"),
                format!("table {tbl} is not in the stored layouts"),
            ));
        };
        let count = columns.len().max(schema.layout.columns.len());
        for i in 0..count {
            crate::interrupts::check();
            // Named only for a mismatch: a push checks every column of its tables.
            let at = || format!("tables.{tbl}.columns[{i}]");
            match (schema.layout.columns.get(i), columns.get(i)) {
                (Some(ours), Some(theirs)) => {
                    let same = theirs.get("name").and_then(Value::as_str) == Some(&ours.name)
                        && theirs.get("type").and_then(Value::as_str) == Some(ours.ty.name())
                        && theirs.get("nullable").and_then(Value::as_bool) == Some(ours.nullable);
                    if !same {
                        return Err(differs(
                            &at(),
                            format!(
                                "table {tbl}, column {i}: {} {}{} here, {} stored",
                                ours.name,
                                ours.ty.name(),
                                if ours.nullable { "?" } else { "!" },
                                theirs
                            ),
                        ));
                    }
                }
                (Some(ours), None) => {
                    return Err(differs(
                        &at(),
                        format!("table {tbl}: column {} is not stored", ours.name),
                    ))
                }
                (None, Some(theirs)) => {
                    return Err(differs(
                        &at(),
                        format!("table {tbl}: stored column {theirs} is missing"),
                    ))
                }
                (None, None) => {}
            }
        }
    }
    let ours: HashSet<&str> = schemas.iter().map(|(s, _)| s.as_str()).collect();
    if let Some(extra) = layouts.keys().find(|t| whole && !ours.contains(t.as_str())) {
        return Err(differs(
            "tables",
            format!("stored table {extra} is missing"),
        ));
    }
    Ok(())
}

/// `migrate_schema`'s check of a push schema stored at `version` before the migration to it:
/// `set_push_schema` compares with the layouts only once they are recorded, so one stored ahead
/// must match the new layouts **whole** here — every table, column, type, nullability and order,
/// no table more or fewer. A table it had that the layouts lack would have rows of a layout
/// nothing records, readable silently wrong once a later push schema gives it other columns
/// (red team 9, R9-1; a table the layouts retire: R7-2, R8-1), and one whose columns differ
/// would be read with another column list by the row codec's functions and the one-call push
/// (R5-3). Runs after the marker and the layouts are written, in the migration's transaction.
pub fn check_stored_at(client: &SpiClient<'_>, version: i64) -> Result<()> {
    let Some(schemas) = stored_at(client, version)? else {
        return Ok(());
    };
    check_layouts(client, version, &schemas, true).map_err(|e| match e {
        Error::Sync { hint, .. } => {
            Error::invalid_argument("layouts", "mismatch").with_hint(format!(
                "the push schema stored at schema version {version} (by set_push_schema before \
                 this migration) does not match these layouts: {}; a version's push schema \
                 and its layouts describe the same tables — store one that does with \
                 syncular.set_push_schema({version}, …) first",
                hint.unwrap_or_default()
            ))
        }
        other => other,
    })
}

/// The push schema stored at `version`, read with a fresh snapshot (one committed after a lock
/// the caller waited on is seen: red team 6, R6-1), its tables validated again (`Internal` when
/// one no longer is); `None` when none is stored.
fn stored_at(client: &SpiClient<'_>, version: i64) -> Result<Option<Vec<(String, TableSchema)>>> {
    let found = db::write(
        client,
        "SELECT p.tables::text FROM syncular.sync_push_schemas p WHERE p.schema_version = $1",
        &[DatumWithOid::from(version)],
    )?;
    let Some(text) = db::first::<String>(found)? else {
        return Ok(None);
    };
    let unreadable = || {
        Error::Internal(format!(
            "syncular: the stored push schema at version {version} no longer validates"
        ))
    };
    let Ok(Value::Object(tables)) = serde_json::from_str::<Value>(&text) else {
        return Err(unreadable());
    };
    tables
        .iter()
        .map(|(tbl, d)| {
            crate::interrupts::check();
            Ok((tbl.clone(), table_schema(tbl, d).map_err(|_| unreadable())?))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// The push schema stored at a version rows may already be encoded with keeps every table and
/// its columns (name, type, nullability, order): a stored row, a log payload or a push result
/// may hold bytes of that column list, and a push schema replaced under them would read them
/// silently wrong (red team 9, R9-1, R9-5, R9-6). Such a version is any version before the first
/// migration and every version up to the stored one after it; only a version ahead of the
/// stored one is refused for encoding and pushing ([`codec_table`], the one-call push) and can be
/// replaced freely until its migration, which compares it with its layouts
/// ([`check_stored_at`]). The other keys of a table (scopes, primary key, materialize,
/// references) may change.
fn keep_stored_columns(
    client: &SpiClient<'_>,
    version: i64,
    schemas: &[(String, TableSchema)],
) -> Result<()> {
    let Some(stored) = stored_at(client, version)? else {
        return Ok(());
    };
    let why = "rows, log payloads and push results may already be encoded with them, so a \
               version's columns never change: a different column list is a new schema version";
    for (tbl, stored) in stored {
        crate::interrupts::check();
        let Some((_, given)) = schemas.iter().find(|(t, _)| *t == tbl) else {
            return Err(mismatch(
                &format!("tables.{tbl}"),
                format!(
                    "the push schema stored at schema version {version} has table {tbl}, \
                     which this one leaves out — {why}"
                ),
            ));
        };
        if given.layout.columns != stored.layout.columns {
            let i = given
                .layout
                .columns
                .iter()
                .zip(&stored.layout.columns)
                .take_while(|(a, b)| a == b)
                .count();
            return Err(mismatch(
                &format!("tables.{tbl}.columns[{i}]"),
                format!(
                    "table {tbl}: the push schema stored at schema version {version} gives it \
                     the columns {} — {why}",
                    column_list(&stored.layout)
                ),
            ));
        }
    }
    Ok(())
}

/// `id string!, title string?`: a layout's columns for a HINT.
fn column_list(layout: &Layout) -> String {
    layout
        .columns
        .iter()
        .map(|c| {
            format!(
                "{} {}{}",
                c.name,
                c.ty.name(),
                if c.nullable { "?" } else { "!" }
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The stored schema version when `version` is ahead of it: nothing may be encoded with such a
/// push schema, which its migration may still replace ([`keep_stored_columns`]).
pub fn ahead_of_marker(version: i64, marker: Option<i64>) -> Option<i64> {
    marker.filter(|m| version > *m)
}

/// What the stored push schemas say of a table's columns — the layout of the rows written
/// through them before the first migration, which no layouts record yet.
pub enum Written {
    /// No push schema names the table.
    Unnamed,
    /// Every one that names it gives it these columns; the highest such version.
    One(i64, Value),
    /// Two versions give it different columns: which one a stored row has is unknown.
    Disagree(i64, i64),
}

/// [`Written`] for `tbl`, over every stored push schema (column names, types, nullability and
/// order compared). Read by the first migration (red team 9, R9-6), and before it by the one-call
/// push and the row codec's defaults, which may not read a row of one version with the columns of
/// another (red team 11, A1).
pub fn written_columns(client: &SpiClient<'_>, tbl: &str) -> Result<Written> {
    let found = db::write(
        client,
        "SELECT p.schema_version, (p.tables -> $1 -> 'columns')::text
           FROM syncular.sync_push_schemas p
          WHERE p.tables ? $1
          ORDER BY p.schema_version DESC",
        &[DatumWithOid::from(tbl)],
    )?;
    let mut highest: Option<(i64, Value)> = None;
    for row in found {
        crate::interrupts::check();
        let version = row.get::<i64>(1)?.unwrap_or(0);
        let columns = row
            .get::<String>(2)?
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .unwrap_or(Value::Null);
        match &highest {
            None => highest = Some((version, columns)),
            Some((top, first)) => {
                use crate::schema::evolution::{columns as cols, same};
                let (x, y) = (cols(Some(first)), cols(Some(&columns)));
                if x.len() != y.len() || !x.iter().zip(y).all(|(p, q)| same(p, q)) {
                    return Ok(Written::Disagree(version, *top));
                }
            }
        }
    }
    Ok(highest.map_or(Written::Unnamed, |(v, c)| Written::One(v, c)))
}

#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.set_push_schema(schema_version bigint, tables jsonb) RETURNS integer
VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'set_push_schema_wrapper';
"#
)]
fn set_push_schema(schema_version: Option<i64>, tables: Option<JsonArg>) -> i32 {
    error::run(|| {
        let version = args::at_least("schema_version", schema_version, 1)?;
        let Value::Object(descriptors) = args::json("tables", tables)? else {
            return Err(invalid("tables", "type"));
        };
        let schemas = descriptors
            .iter()
            .map(|(tbl, d)| {
                crate::interrupts::check();
                let schema = table_schema(tbl, d)?;
                require_scopes(tbl, d, &schema)?;
                Ok((tbl.clone(), schema))
            })
            .collect::<Result<Vec<_>>>()?;
        let stored: Map<String, Value> = schemas
            .iter()
            .map(|(tbl, s)| (tbl.clone(), s.stored.clone()))
            .collect();
        db::with_spi(|client| {
            // Before the comparison with the marker: waits for a migration in progress (it holds
            // SHARE until it commits), so the marker read next is the migration's (red team 6,
            // R6-1); and for another set_push_schema (the mode conflicts with itself), so the
            // stored columns compared next are the ones kept (red team 9, R9-5).
            crate::citus::propagating_locks(|| {
                db::write(
                    client,
                    "LOCK TABLE syncular.sync_push_schemas IN SHARE ROW EXCLUSIVE MODE",
                    &[],
                )
            })?;
            for (tbl, schema) in &schemas {
                crate::interrupts::check();
                check_relation(client, tbl, schema)?;
            }
            let marker = crate::schema::marker::marker_seen(client)?;
            if ahead_of_marker(version, marker).is_none() {
                keep_stored_columns(client, version, &schemas)?;
            }
            check_layouts(client, version, &schemas, true)?;
            db::write(
                client,
                "INSERT INTO syncular.sync_push_schemas AS s (schema_version, tables, updated_at_ms)
                 VALUES ($1, $2::jsonb,
                         (extract(epoch FROM pg_catalog.transaction_timestamp()) * 1000)::bigint)
                 ON CONFLICT (schema_version) DO UPDATE
                   SET tables = EXCLUDED.tables, updated_at_ms = EXCLUDED.updated_at_ms
                 WHERE s.tables IS DISTINCT FROM EXCLUDED.tables",
                &[
                    DatumWithOid::from(version),
                    DatumWithOid::from(Value::Object(stored).to_string()),
                ],
            )?;
            Ok(schemas.len() as i32)
        })
    })
}

/// Every synced table declares at least one scope pattern (upstream's schema rule, docs/API.md
/// §15): a table without one is pushed but can never be pulled (an empty effective scope map
/// revokes every subscription to it). Checked where a push schema is declared only: a schema
/// stored before the rule still reads back.
fn require_scopes(tbl: &str, descriptor: &Value, schema: &TableSchema) -> Result<()> {
    if !schema.scopes.is_empty() {
        return Ok(());
    }
    let reason = match descriptor.get("scopes") {
        None | Some(Value::Null) => "missing",
        Some(_) => "empty",
    };
    Err(
        invalid(&format!("tables.{tbl}.scopes"), reason).with_hint(format!(
        "table {tbl}: every synced table declares at least one scope pattern, or no client can \
         ever pull it; a table every client reads uses a scope column all rows share, e.g. a \
         column app_id holding 'app' with \"scopes\": [{{\"variable\": \"app_id\", \"column\": \
         \"app_id\"}}], and the host allows {{\"app_id\": [\"*\"]}}"
    )),
    )
}

/// The one-call push's view of the push schema at exactly `version`: `None` when none is stored
/// at that version, else the descriptor of `tbl` if the schema has that table.
pub fn table_at(
    client: &SpiClient<'_>,
    version: i64,
    tbl: &str,
) -> Result<Option<Option<Rc<TableSchema>>>> {
    table_as_of(client, version, tbl, false)
}

/// [`table_at`], read with a fresh snapshot (`fresh`, under READ COMMITTED) or the caller's:
/// below SQL by the primary key, parsed only when the stored bytes differ from the ones this
/// backend kept ([`KEPT_SCHEMAS`]); through SQL where Citus keeps the table on another node.
fn table_as_of(
    client: &SpiClient<'_>,
    version: i64,
    tbl: &str,
    fresh: bool,
) -> Result<Option<Option<Rc<TableSchema>>>> {
    use crate::heap::{self, Lookup, SyncTable};
    let read = heap::with_snapshot(fresh, |snapshot| {
        // SAFETY: the key is a datum passed by value; the snapshot is registered around the
        // lookup.
        unsafe {
            heap::by_primary_key(
                SyncTable::PushSchemas,
                None,
                &[heap::bigint_key(version)],
                snapshot,
                |row| row.map(|row| row.jsonb_bytes(c"tables")).transpose(),
            )
        }
    })?;
    match read {
        Lookup::Here(None, _) => Ok(None),
        Lookup::Here(Some(None), _) => Ok(Some(None)),
        Lookup::Here(Some(Some(bytes)), _) => kept_table(version, tbl, bytes).map(Some),
        Lookup::Elsewhere => table_through_sql(client, version, tbl, fresh),
    }
}

/// The schema of `tbl` in the push schema `bytes` stored at `version`: the one this backend
/// parsed from the same bytes, else parsed now and kept.
fn kept_table(
    version: i64,
    tbl: &str,
    bytes: crate::jsonb::OwnedJsonb,
) -> Result<Option<Rc<TableSchema>>> {
    let kept = KEPT_SCHEMAS.with(|kept| {
        let kept = kept.borrow();
        let entry = kept
            .iter()
            .find(|k| k.version == version && k.bytes.as_bytes() == bytes.as_bytes())?;
        entry.tables.get(tbl).cloned()
    });
    if let Some(schema) = kept {
        return Ok(schema);
    }
    let unreadable = || unreadable_schema(version, tbl);
    let container = bytes.container().map_err(|_| unreadable())?;
    let [descriptor] = container.fields([tbl]).map_err(|_| unreadable())?;
    let schema = match descriptor {
        None => None,
        Some(crate::jsonb::Node::Object(descriptor)) => {
            let text = descriptor.to_jsonb().printed();
            let descriptor: Value = serde_json::from_str(&text).map_err(|_| unreadable())?;
            Some(Rc::new(
                table_schema(tbl, &descriptor).map_err(|_| unreadable())?,
            ))
        }
        Some(_) => return Err(unreadable()),
    };
    if bytes.len() <= KEPT_DOCUMENT_BYTES {
        KEPT_SCHEMAS.with(|kept| {
            let mut kept = kept.borrow_mut();
            let at = kept
                .iter()
                .position(|k| k.version == version && k.bytes.as_bytes() == bytes.as_bytes());
            let mut entry = match at {
                Some(at) => kept.remove(at),
                None => {
                    kept.retain(|k| k.version != version);
                    KeptSchema {
                        version,
                        bytes,
                        tables: HashMap::new(),
                    }
                }
            };
            entry.tables.insert(tbl.to_string(), schema.clone());
            keep(&mut kept, entry);
        });
    }
    Ok(schema)
}

fn unreadable_schema(version: i64, tbl: &str) -> Error {
    Error::Internal(format!(
        "syncular: the stored push schema of {tbl} at version {version} no longer validates"
    ))
}

/// [`table_as_of`] through SQL.
fn table_through_sql(
    client: &SpiClient<'_>,
    version: i64,
    tbl: &str,
    fresh: bool,
) -> Result<Option<Option<Rc<TableSchema>>>> {
    const SQL: &str = "SELECT (p.tables -> $2)::text FROM syncular.sync_push_schemas p
                        WHERE p.schema_version = $1";
    let args = [DatumWithOid::from(version), DatumWithOid::from(tbl)];
    let found = db::read_fresh_if(client, SQL, &args, fresh)?;
    if found.is_empty() {
        return Ok(None);
    }
    let Some(text) = found.first().get::<String>(1)? else {
        return Ok(Some(None));
    };
    let unreadable = || unreadable_schema(version, tbl);
    let descriptor: Value = serde_json::from_str(&text).map_err(|_| unreadable())?;
    Ok(Some(Some(Rc::new(
        table_schema(tbl, &descriptor).map_err(|_| unreadable())?,
    ))))
}

/// Whether `schema` still agrees with the layouts `migrate_schema` stored, when the marker is at
/// `version` (a migration after `set_push_schema` may have changed them).
pub fn agrees_with_layouts(
    client: &SpiClient<'_>,
    version: i64,
    tbl: &str,
    schema: &TableSchema,
) -> Result<bool> {
    match check_layouts(client, version, &[(tbl.to_string(), schema)], false) {
        Ok(()) => Ok(true),
        Err(Error::Sync { .. }) => Ok(false),
        Err(other) => Err(other),
    }
}

/// The layout `encode_row`/`decode_row` use for a table: `keyed` when it comes from a push
/// schema (which names the primary key a sparse row needs), not from stored layouts alone.
pub struct CodecTable {
    pub layout: Layout,
    pub keyed: bool,
    /// The schema version the layout is of.
    pub version: i64,
}

/// The layout of `tbl` for the row codec's SQL functions, at `version` — by default the stored
/// schema version (the marker `migrate_schema` sets), the version the stored rows are encoded
/// at; without a marker, the highest stored push schema's ([`stored_table`]). At a version, the
/// push schema stored at it, else the layouts `migrate_schema` stored for it (the history
/// `sync_schema_layouts`, or the marker's), which decode and encode full rows only. Between
/// `migrate_schema` and `set_push_schema` of a new version the default is therefore the new
/// layouts, never the previous version's push schema (red team 4, C3: a row encoded with it
/// would not decode at the stored version).
pub fn codec_table(client: &SpiClient<'_>, tbl: &str, version: Option<i64>) -> Result<CodecTable> {
    let given = version.is_some();
    let Ok(settled) = crate::schema::marker::settled_version(!given)? else {
        return Err(tables::unknown_table(tbl).with_hint(
            "the schema barrier is held or awaited (a migrate_schema, register_table or \
             retire_table in flight): the stored schema version is not settled — call again once \
             it has committed (this call does not wait for it: a lock on an app table held here \
             could deadlock with the migration's own DDL)",
        ));
    };
    let version = match version {
        // A version ahead of the stored one has no layouts yet, and its push schema may still
        // be replaced: a row encoded with it would be of a layout no migration records (red
        // team 9, R9-4). The marker read is the settled one, whatever the caller's snapshot.
        Some(v) => match ahead_of_marker(v, settled.version) {
            Some(marker) => {
                return Err(tables::unknown_table(tbl).with_hint(format!(
                    "schema version {v} is ahead of the stored schema version {marker}: its push \
                     schema may still change until migrate_schema({v}, …) records its layouts, \
                     so nothing is encoded or decoded with it before — migrate first, or use \
                     schema version {marker}"
                )))
            }
            None => v,
        },
        None => match settled.version {
            Some(marker) => marker,
            None => {
                if let Written::Disagree(other, top) = written_columns(client, tbl)? {
                    return Err(tables::unknown_table(tbl).with_hint(format!(
                        "no migration has run, and the push schemas of schema versions {other} \
                         and {top} give table {tbl} different columns: which ones a row has is \
                         unknown — pass schema_version, or migrate first"
                    )));
                }
                let (version, schema) = stored_table(client, tbl)?;
                return Ok(CodecTable {
                    layout: schema.layout,
                    keyed: true,
                    version,
                });
            }
        },
    };
    // What follows reads with a fresh snapshot — under READ COMMITTED a new one, so a statement
    // begun before a migration reads what the migration committed (red team 10, C3) — which
    // must see the migration that recorded `version`: an older REPEATABLE READ or SERIALIZABLE
    // snapshot would read its push schema as it was while it was still ahead, perhaps before
    // it was replaced (red teams 8 and 10, R8-3 and C1). At the default, the settled version
    // itself; at a given one, any marker at or above it.
    let seen = crate::schema::marker::marker_seen(client)?;
    // At the default, the statement's own snapshot must see it too: under READ COMMITTED a
    // statement begun before the migration committed hands in payloads of the old version,
    // which the new layout can read silently wrong (red team 14).
    if !given
        && (seen != Some(version) || crate::schema::marker::marker_of_statement()? != Some(version))
    {
        return Err(tables::unknown_table(tbl).with_hint(format!(
            "the stored schema version is {version}, which this statement's or transaction's \
             snapshot does not see yet (it began before the migration): run it again, or encode \
             in a new transaction"
        )));
    }
    // And so must every older snapshot this transaction read through — an outer statement, a
    // cursor, a STABLE function's caller, a plan — through which a payload may have been read
    // after the read's own lock was given back, or before the table was ever locked (red teams
    // 16 to 18; src/schema/executor_snapshots.rs).
    let every = if given {
        crate::schema::marker::Seen::Yes
    } else {
        crate::schema::marker::seen_by_every_snapshot(&settled)
    };
    if every == crate::schema::marker::Seen::No {
        return Err(tables::unknown_table(tbl).with_hint(format!(
            "the stored schema version is {version}, and this transaction read through a \
             snapshot taken before that migration committed (an outer statement or DO block, a \
             cursor, the caller of a function, a deferred trigger's query, a plan, an earlier \
             statement): a payload read through it is of the earlier version — run it again in \
             a new transaction, or pass the schema_version the payload was read at"
        )));
    }
    if let crate::schema::marker::Seen::Unproven(why) = every {
        use crate::schema::marker::Unproven;
        let because = match why {
            Unproven::Loading => {
                "in the transaction that loaded the library, on PostgreSQL 18, which keeps a \
                 backend's stack of snapshots private: preload it, session_preload_libraries"
            }
            Unproven::Span => "this transaction's snapshots span more than 2^30 transaction ids",
            Unproven::Recorded => {
                "the migration ran in a subtransaction, a transaction with more than 64 \
                 subtransactions was running when this one read, and this transaction no \
                 longer keeps the record of which transaction that subtransaction belonged to"
            }
            Unproven::Unstamped => {
                return Err(tables::unknown_table(tbl).with_hint(format!(
                    "the stored schema version is {version}, and the schema marker was written \
                     without its stamp (with its triggers and their guard disabled, or before \
                     ALTER EXTENSION syncular UPDATE) and frozen since, so when that migration \
                     committed cannot be told: update the extension, or have its owner put \
                     the stamp back and stamp the marker again (ALTER TABLE \
                     syncular.sync_schema_meta ENABLE ALWAYS TRIGGER sync_schema_meta_stamp, \
                     ENABLE ALWAYS TRIGGER sync_schema_meta_stamp_kept; UPDATE \
                     syncular.sync_schema_meta SET id = id; docs/API.md), or pass schema_version"
                )))
            }
        };
        return Err(tables::unknown_table(tbl).with_hint(format!(
            "the stored schema version is {version}, and whether a snapshot this transaction \
             read through predates that migration cannot be told ({because}) — run the call \
             again in a new transaction, or pass schema_version"
        )));
    }
    if let Some(seen) = seen.filter(|m| given && *m < version) {
        return Err(tables::unknown_table(tbl).with_hint(format!(
            "schema version {version} was migrated after this transaction's snapshot was taken \
             (it sees schema version {seen}), and its push schema may have been replaced before \
             that migration: encode in a new transaction"
        )));
    }
    // How a hint names the version: given, or the default a caller may not know it chose.
    let at = if given {
        format!("schema version {version}")
    } else {
        format!(
            "schema version {version} (the stored schema version, which encode_row and \
             decode_row use when schema_version is not given)"
        )
    };
    match table_as_of(client, version, tbl, true)? {
        Some(Some(schema)) => {
            return Ok(CodecTable {
                layout: schema.layout.clone(),
                keyed: true,
                version,
            })
        }
        Some(None) => {
            return Err(tables::unknown_table(tbl)
                .with_hint(format!("the push schema at {at} has no table {tbl}")))
        }
        None => {}
    }
    let Some(layouts) = layouts_at(client, version)? else {
        return Err(tables::unknown_table(tbl).with_hint(format!(
            "neither a push schema nor layouts are stored at {at}"
        )));
    };
    let columns = match layouts.get(tbl) {
        Some(Value::Array(columns)) => columns.clone(),
        _ => Vec::new(),
    };
    if columns.is_empty() {
        return Err(tables::unknown_table(tbl)
            .with_hint(format!("the layouts stored at {at} have no table {tbl}")));
    }
    let layout = crate::schema::evolution::codec_layout(&columns).map_err(|why| {
        tables::unknown_table(tbl).with_hint(format!(
            "the layouts stored at {at} are not row-codec layouts ({why})"
        ))
    })?;
    Ok(CodecTable {
        layout,
        keyed: false,
        version,
    })
}

/// The push schema of `tbl` at the highest stored version, and that version: what the row
/// codec's functions use on an install without a marker (docs/CODEC.md §Push schema).
fn stored_table(client: &SpiClient<'_>, tbl: &str) -> Result<(i64, TableSchema)> {
    let found = db::read(
        client,
        "SELECT p.schema_version, (p.tables -> $1)::text FROM syncular.sync_push_schemas p
          ORDER BY p.schema_version DESC
          LIMIT 1",
        &[DatumWithOid::from(tbl)],
    )?;
    if found.is_empty() {
        return Err(tables::unknown_table(tbl)
            .with_hint("no push schema is stored: call syncular.set_push_schema first"));
    }
    let row = found.first();
    let version = row.get::<i64>(1)?.unwrap_or(0);
    let Some(text) = row.get::<String>(2)? else {
        return Err(tables::unknown_table(tbl).with_hint(format!(
            "the push schema at schema version {version} has no table {tbl}"
        )));
    };
    let descriptor: Value = serde_json::from_str(&text)
        .map_err(|e| Error::Internal(format!("syncular: stored push schema unreadable: {e}")))?;
    let schema = table_schema(tbl, &descriptor).map_err(|_| {
        Error::Internal(format!(
            "syncular: the stored push schema of {tbl} at version {version} no longer validates"
        ))
    })?;
    Ok((version, schema))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(result: Result<TableSchema>) -> (String, String) {
        match result {
            Err(Error::Sync {
                detail: Some(d), ..
            }) => (
                d["argument"].as_str().unwrap().to_string(),
                d["reason"].as_str().unwrap().to_string(),
            ),
            Err(other) => panic!("{other:?}"),
            Ok(_) => panic!("accepted"),
        }
    }

    fn tasks() -> Value {
        json!({"columns":[{"name":"id","type":"string","nullable":false},
                          {"name":"project_id","type":"string","nullable":false},
                          {"name":"doc","type":"crdt","nullable":true,"crdtType":"yjs-doc"}],
               "primaryKey":"id","scopes":[{"variable":"project_id","column":"project_id"}],
               "extra":"ignored"})
    }

    #[test]
    fn descriptors_are_validated_and_normalized() {
        let schema = table_schema("tasks", &tasks()).unwrap();
        assert_eq!(schema.layout.primary_key, 0);
        assert_eq!(schema.scopes, vec![("project_id".to_string(), 1)]);
        assert!(schema.materialize);
        assert_eq!(schema.stored["columns"][2]["crdtType"], json!("yjs-doc"));
        assert_eq!(schema.stored["references"], json!([]));
        assert!(schema.stored.get("extra").is_none());

        let with = |path: &str, value: Value| {
            let mut d = tasks();
            let target = d.pointer_mut(path).unwrap();
            *target = value;
            table_schema("tasks", &d)
        };
        assert_eq!(
            reason(table_schema("sync_x", &tasks())),
            ("tables.sync_x".into(), "reserved".into())
        );
        assert_eq!(
            reason(with("/columns", json!([]))),
            ("tables.tasks.columns".into(), "empty".into())
        );
        assert_eq!(
            reason(with("/columns/1/name", json!("id"))),
            ("tables.tasks.columns[1].name".into(), "shape".into())
        );
        assert_eq!(
            reason(with("/columns/1/name", json!("_sync_x"))),
            ("tables.tasks.columns[1].name".into(), "reserved".into())
        );
        assert_eq!(
            reason(with("/columns/1/type", json!("text"))),
            ("tables.tasks.columns[1].type".into(), "shape".into())
        );
        assert_eq!(
            reason(with("/columns/1/nullable", json!("no"))),
            ("tables.tasks.columns[1].nullable".into(), "type".into())
        );
        assert_eq!(
            reason(with("/primaryKey", json!("nope"))),
            ("tables.tasks.primaryKey".into(), "shape".into())
        );
        assert_eq!(
            reason(with("/scopes/0/column", json!("nope"))),
            ("tables.tasks.scopes[0].column".into(), "shape".into())
        );
        assert_eq!(
            reason(with("/scopes", json!({}))),
            ("tables.tasks.scopes".into(), "type".into())
        );
    }

    /// A table without a scope pattern is refused where the schema is declared (issue 27,
    /// item 2), but a stored descriptor without one still reads back.
    #[test]
    fn a_synced_table_declares_a_scope() {
        let mut d = tasks();
        let schema = table_schema("tasks", &d).unwrap();
        assert!(require_scopes("tasks", &d, &schema).is_ok());
        d["scopes"] = json!([]);
        let schema = table_schema("tasks", &d).unwrap();
        assert_eq!(
            reason(require_scopes("tasks", &d, &schema).map(|_| schema.clone())),
            ("tables.tasks.scopes".into(), "empty".into())
        );
        d.as_object_mut().unwrap().remove("scopes");
        let schema = table_schema("tasks", &d).unwrap();
        match require_scopes("tasks", &d, &schema) {
            Err(Error::Sync {
                detail: Some(detail),
                hint: Some(hint),
                ..
            }) => {
                assert_eq!(
                    detail,
                    json!({"argument":"tables.tasks.scopes","reason":"missing"})
                );
                assert!(hint.contains("at least one scope pattern"), "{hint}");
                assert!(hint.contains("[\"*\"]"), "{hint}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// At most 1,600 columns and 64 scopes per table (docs/API.md "Limits"); a duplicate column
    /// is found wherever it is, among the most columns allowed.
    #[test]
    fn tables_are_capped() {
        let columns = |n: usize| {
            (0..n)
                .map(|i| json!({"name": format!("c{i}"), "type": "string", "nullable": false}))
                .collect::<Vec<_>>()
        };
        let table = |columns: Vec<Value>, scopes: usize| {
            let scopes: Vec<Value> = (0..scopes)
                .map(|i| json!({"variable": format!("v{i}"), "column": "c0"}))
                .collect();
            json!({"columns": columns, "primaryKey": "c0", "scopes": scopes})
        };
        let widest = table_schema("t", &table(columns(1600), 64)).unwrap();
        assert_eq!(widest.layout.columns.len(), 1600);
        assert_eq!(widest.scopes.len(), 64);
        assert_eq!(
            reason(table_schema("t", &table(columns(1601), 1))),
            ("tables.t.columns".into(), "too_large".into())
        );
        assert_eq!(
            reason(table_schema("t", &table(columns(1), 65))),
            ("tables.t.scopes".into(), "too_large".into())
        );
        let mut twice = columns(1600);
        twice[1599]["name"] = json!("c3");
        assert_eq!(
            reason(table_schema("t", &table(twice, 0))),
            ("tables.t.columns[1599].name".into(), "shape".into())
        );
    }
}
