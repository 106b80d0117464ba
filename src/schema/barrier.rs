//! The schema barrier (docs/DESIGN.md §Schema barrier): the startup check and the migration
//! that publishes a new schema version together with its declarations, fences and the global
//! writer floor.
//!
//! `migrate_schema` takes the barrier lock first and re-validates everything under it with
//! fresh snapshots, so two concurrent migrators cannot both migrate (upstream checked before
//! locking: docs/DESIGN.md, gap B4 — concurrent migrators both migrate).

use crate::access;
use crate::args::{self, Declaration};
use crate::checkpoint;
use crate::codec::ColumnType;
use crate::db;
use crate::error::{self, Code, Error, Result};
use crate::gate::{self, SchemaState};
use crate::schema::{evolution, marker, push_schema};
use crate::tables;
use crate::txn_local;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use pgrx::JsonB;
use serde_json::{json, Map, Value};

/// Validates `layouts`: `{table: [{"name": string, "type": string, "nullable": boolean}, …]}`,
/// each `type` one of the row codec's names (docs/CODEC.md §Column types): the push schema of
/// the same version must use them, so another name could never be matched afterwards.
pub fn layouts(value: Option<args::JsonArg>) -> Result<Map<String, Value>> {
    layouts_value(args::json("layouts", value)?)
}

/// [`layouts`] of a parsed argument.
fn layouts_value(value: Value) -> Result<Map<String, Value>> {
    let Value::Object(tables) = value else {
        return Err(Error::invalid_argument("layouts", "type"));
    };
    for (table, columns) in &tables {
        crate::interrupts::check();
        let Value::Array(columns) = columns else {
            return Err(Error::invalid_argument(&format!("layouts.{table}"), "type"));
        };
        for (i, column) in columns.iter().enumerate() {
            crate::interrupts::check();
            let at = format!("layouts.{table}[{i}]");
            let Value::Object(column) = column else {
                return Err(Error::invalid_argument(&at, "type"));
            };
            args::json_text_field(column, "name", &format!("{at}.name"))?;
            let type_name = args::json_text_field(column, "type", &format!("{at}.type"))?;
            if ColumnType::from_name(&type_name).is_none() {
                return Err(evolution::unknown_type(&format!("{at}.type"), &type_name));
            }
            match column.get("nullable") {
                Some(Value::Bool(_)) => {}
                None | Some(Value::Null) => {
                    return Err(Error::invalid_argument(
                        &format!("{at}.nullable"),
                        "missing",
                    ))
                }
                Some(_) => return Err(Error::invalid_argument(&format!("{at}.nullable"), "type")),
            }
        }
    }
    Ok(tables)
}

/// Parses the stored layouts text; anything that is not an object counts as `{}`.
fn stored_layouts(text: Option<&str>) -> Map<String, Value> {
    match text.map(serde_json::from_str::<Value>) {
        Some(Ok(Value::Object(map))) => map,
        _ => Map::new(),
    }
}

/// Layout comparison (docs/DESIGN.md §Schema barrier); `Err` is `stored_layout_mismatch`.
pub fn compare_layouts(configured: &Map<String, Value>, stored: &Map<String, Value>) -> Result<()> {
    use evolution::{columns, same};
    // serde_json's Map is ordered by key bytes: byte order of table names.
    for (table, wanted) in configured {
        crate::interrupts::check();
        let wanted = columns(Some(wanted));
        let have = columns(stored.get(table));
        for i in 0..wanted.len().max(have.len()) {
            crate::interrupts::check();
            let (running, stored_column) = (wanted.get(i), have.get(i));
            let ok = matches!((running, stored_column), (Some(a), Some(b)) if same(a, b));
            if !ok {
                let column = running
                    .or(stored_column)
                    .and_then(|c| c.get("name"))
                    .cloned();
                // Which side has what, column by column, so the fix is plain: migrate to a new
                // version, or run the build whose layouts are stored (docs/API.md check_schema).
                let shown = |c: Option<&Value>| c.map_or("no column".to_string(), Value::to_string);
                let hint = format!(
                    "table {table}, column {i}: this process has {}, the stored version has {}; \
                     layouts never change within a schema version: migrate to a new version, or \
                     run the build whose layouts are stored",
                    shown(running),
                    shown(stored_column)
                );
                return Err(Error::new(
                    Code::StoredLayoutMismatch,
                    json!({"table": table, "column": column.unwrap_or(Value::Null)}),
                )
                .with_hint(hint));
            }
        }
    }
    if let Some(extra) = stored.keys().find(|t| !configured.contains_key(*t)) {
        return Err(
            Error::new(Code::StoredLayoutMismatch, json!({ "table": extra })).with_hint(format!(
                "the stored version has table {extra}, this process's layouts do not: a table is \
             retired by migrating to a new version without it"
            )),
        );
    }
    Ok(())
}

/// Steps 2–4 of `check_schema` on one state: barrier, then version, then layouts.
/// `Ok(true)`: the stored schema equals the running one (current); `Ok(false)`: migrate.
fn check(
    state: &SchemaState,
    running: i64,
    configured: &Map<String, Value>,
    declared: &[Declaration],
) -> Result<bool> {
    if let Some((partition, name)) = state.first_undeclared(declared) {
        return Err(Error::new(
            Code::CheckpointIncomplete,
            json!({"partition": partition, "projection": name}),
        ));
    }
    let stored = state.stored_schema_version;
    if stored > running {
        return Err(Error::new(
            Code::SchemaNewer,
            json!({"storedSchemaVersion": stored, "runningSchemaVersion": running}),
        ));
    }
    if stored == running {
        compare_layouts(configured, &stored_layouts(state.stored_layouts.as_deref()))?;
        return Ok(true);
    }
    Ok(false)
}

struct SchemaArgs {
    version: i64,
    layouts: Map<String, Value>,
    declared: Vec<Declaration>,
}

fn schema_args(
    schema_version: Option<i64>,
    layouts_arg: Option<args::JsonArg>,
    declared: Option<args::JsonArg>,
) -> Result<SchemaArgs> {
    Ok(SchemaArgs {
        version: args::at_least("schema_version", schema_version, 1)?,
        layouts: layouts(layouts_arg)?,
        declared: args::declarations(declared)?,
    })
}

/// Preconditions of `migrate_schema` and `push_begin` (docs/DESIGN.md §Schema barrier): an
/// explicit (or implicit multi-statement) transaction block, READ COMMITTED, and, where asked,
/// no prior writes.
pub fn require_transaction(no_prior_writes: bool) -> Result<()> {
    // SAFETY: reads of this backend's transaction state; no allocation, never errors.
    unsafe {
        if !pg_sys::IsTransactionBlock() {
            return Err(Error::invalid_transaction_state("no_transaction_block"));
        }
        if no_prior_writes && pg_sys::GetTopTransactionIdIfAny() != pg_sys::InvalidTransactionId {
            return Err(Error::invalid_transaction_state("prior_writes"));
        }
        // On Citus a write the transaction sent to another node leaves no transaction id here,
        // and its deferred trigger events wait in that node's session — the one a migration then
        // rewrites and checks a shard in — to fire at `PREPARE`, after every check (red team 52,
        // R52-1): so before any statement that reached another node.
        if no_prior_writes && crate::citus::reached_other_nodes() {
            return Err(Error::invalid_transaction_state("prior_writes").with_hint(
                "on Citus call it first in its transaction, before any statement that \
                     reached another node (BEGIN; then this call): a write sent there earlier \
                     can run host code at commit, after the migration's checks",
            ));
        }
        if !crate::heap::read_committed() {
            return Err(Error::invalid_transaction_state("isolation"));
        }
    }
    Ok(())
}

/// A migration refuses (`SY004` `holdable_cursor`) while the session holds a `WITH HOLD` cursor:
/// PostgreSQL runs such a cursor's query to its end at commit, after the migration checked the
/// rows it re-encoded, and a function in it could write old payloads back (red team 52, R52-2;
/// docs/SECURITY.md rule 19). One declared after the migration is the host's own statement, as
/// any write after it. `pg_cursor()` lists the session's cursors; no host object in the query.
fn refuse_holdable_cursors(client: &SpiClient<'_>) -> Result<()> {
    let held = db::first::<bool>(db::read(
        client,
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_cursor() c WHERE c.is_holdable)",
        &[],
    )?)?;
    if held == Some(true) {
        return Err(Error::invalid_transaction_state("holdable_cursor"));
    }
    Ok(())
}

/// Remembers the schema a migration started from, for `previous_schema()`: transaction-local
/// state a session cannot set ([`crate::txn_local`]), undone by a rollback to a savepoint.
/// `rewritten`: the rows whose payloads this migration re-encoded, by table (only tables with
/// rows; the key only when there are any, so a migration that rewrote nothing reads as before).
fn record_previous(version: i64, stored_layouts_text: Option<&str>, rewritten: Map<String, Value>) {
    let mut previous =
        json!({"schemaVersion": version, "layouts": stored_layouts(stored_layouts_text)});
    if !rewritten.is_empty() {
        previous["rewritten"] = Value::Object(rewritten);
    }
    txn_local::set(txn_local::Key::PreviousSchema, &previous.to_string());
}

/// Keeps the layouts of every schema version (`sync_schema_layouts`), so that a payload can be
/// decoded by the version it belongs to (`decode_row(…, schema_version => v)`): the new ones, and
/// the stored ones when the history lacks them (a marker written before the history existed, or
/// by a 0.24 host).
fn record_layouts(
    client: &SpiClient<'_>,
    stored: Option<(i64, &str)>,
    version: i64,
    layouts: &Map<String, Value>,
) -> Result<()> {
    if let Some((stored, text)) = stored {
        db::write(
            client,
            "INSERT INTO syncular.sync_schema_layouts (schema_version, layouts) VALUES ($1, $2)
             ON CONFLICT (schema_version) DO NOTHING",
            &[DatumWithOid::from(stored), DatumWithOid::from(text)],
        )?;
    }
    db::write(
        client,
        "INSERT INTO syncular.sync_schema_layouts (schema_version, layouts) VALUES ($1, $2)
         ON CONFLICT (schema_version) DO UPDATE SET layouts = EXCLUDED.layouts",
        &[
            DatumWithOid::from(version),
            DatumWithOid::from(Value::Object(layouts.clone()).to_string()),
        ],
    )?;
    Ok(())
}

/// A table of the new layouts that the stored ones lack: retired earlier and added again, it
/// keeps the rows of its last layout, which the history holds, and grows from there or is
/// refused (red team 7, R7-3); no layouts ever named it, its registered relation must be empty,
/// or its rows are of a layout nothing records — written through a push schema alone, or
/// registered before under another name (red team 8, R8-2 and R8-4). The relation is locked
/// `SHARE` first, so a host insert in flight is waited for and seen (red team 9, R9-4).
fn add_retired_or_empty(
    client: &SpiClient<'_>,
    a: &SchemaArgs,
    old_layouts: &mut Map<String, Value>,
    caller: pg_sys::Oid,
) -> Result<()> {
    for table in a.layouts.keys() {
        crate::interrupts::check();
        if old_layouts.contains_key(table) {
            continue;
        }
        if let Some(columns) = evolution::last_layout(client, table)? {
            old_layouts.insert(table.clone(), columns);
            continue;
        }
        if holds_rows(client, table, caller)? {
            return Err(not_empty(
                table,
                "is new in these layouts (no earlier layouts name it) but its registered \
                 relation holds rows, whose layout nothing records (written through a push \
                 schema alone, or registered before under another name): add the table under \
                 the name of its last layouts, or retire_table it and empty its relation first",
            ));
        }
    }
    Ok(())
}

/// The first migration: rows written before it through a push schema (the one-call push,
/// `encode_row`) have its columns, which never change once stored
/// (`push_schema::keep_stored_columns`). A registered table of the new layouts holding rows that
/// push schemas name has the layout every one of them gives it, when they agree; it must grow
/// from there by appended nullable columns, and is re-encoded like any migration's (red team 9,
/// R9-6). A table no push schema names has rows of the host's own codec (the classic path), at
/// the layouts it declares. The relation is locked `SHARE` first, as for a table new to the
/// layouts. No push schema may be stored above the version migrated to.
fn written_before_first(
    client: &SpiClient<'_>,
    a: &SchemaArgs,
    old_layouts: &mut Map<String, Value>,
    caller: pg_sys::Oid,
) -> Result<Vec<evolution::Grown>> {
    // A version above this one with a push schema may have rows, log payloads and push results
    // encoded with it already; after this migration it would be ahead, where a push schema may
    // be replaced (red team 10, A1 and A3). The first migration reaches every such version.
    let above = db::first::<i64>(db::write(
        client,
        "SELECT max(p.schema_version) FROM syncular.sync_push_schemas p
          WHERE p.schema_version > $1",
        &[DatumWithOid::from(a.version)],
    )?)?;
    if let Some(above) = above {
        return Err(
            Error::invalid_argument("schema_version", "range").with_hint(format!(
                "this is the first migration, and a push schema is stored for schema version \
                 {above}: rows, log payloads and push results may already be encoded with it, \
                 whose columns must stay as they are — migrate to schema version {above} or \
                 above"
            )),
        );
    }
    let mut grown = Vec::new();
    for table in a.layouts.keys() {
        crate::interrupts::check();
        if !holds_rows(client, table, caller)? {
            continue;
        }
        let (version, columns) = match push_schema::written_columns(client, table)? {
            // No push schema names it: nothing of ours encoded its rows — a host's own codec did
            // (the classic path, scenario SCH-13), at the layouts it declares now.
            push_schema::Written::Unnamed => continue,
            push_schema::Written::One(version, columns) => (version, columns),
            push_schema::Written::Disagree(other, version) => {
                return Err(not_empty(
                    table,
                    &format!(
                        "holds rows written before the first migration, and the push schemas of \
                         schema versions {other} and {version} give it different columns, so \
                         their layout is unknown: empty the relation first, or migrate with the \
                         layouts its rows were written with"
                    ),
                ))
            }
        };
        let one = Map::from_iter([(table.clone(), columns)]);
        grown.extend(evolution::append_only(&one, &a.layouts, version)?);
        old_layouts.extend(one);
    }
    Ok(grown)
}

/// Whether the registered relation of `table` holds rows, read below SQL once writers in flight
/// ended (`SHARE`, kept to the end of the migration).
fn holds_rows(client: &SpiClient<'_>, table: &str, caller: pg_sys::Oid) -> Result<bool> {
    let Some(relation) = tables::open_for_migration(client, table)? else {
        return Ok(false);
    };
    relation.lock_against_writers(caller)?;
    relation.has_rows(client, caller)
}

fn not_empty(table: &str, why: &str) -> Error {
    Error::invalid_argument(&format!("layouts.{table}"), "not_empty")
        .with_hint(format!("table {table} {why}"))
}

fn migrate(client: &SpiClient<'_>, a: &SchemaArgs, caller: pg_sys::Oid) -> Result<i64> {
    // Before any lock, where PostgreSQL keeps the active stack private (18): so that which
    // snapshots see this migration can be told from their `xmin` (src/schema/marker.rs, red
    // teams 16 and 17).
    if !crate::port::OLDEST_ACTIVE_SNAPSHOT_KNOWN {
        marker::wait_for_older_transactions();
    }
    // L0: waits for every partition lock holder and allocator; blocks them until we end.
    db::lock_barrier(client)?;
    // Push schemas stay as they are until we end, and one being stored now is committed first:
    // `set_push_schema` takes ROW EXCLUSIVE before it compares with the marker, so each of the
    // two sees the other's result (red team 6, R6-1; docs/DESIGN.md §Lock order). A 0.1.0
    // install this library runs before its update has neither push schemas nor the history
    // (both 0.2.0) and keeps 0.1.0's contract.
    let updated = evolution::installed();
    if updated {
        crate::citus::propagating_locks(|| {
            db::write(
                client,
                "LOCK TABLE syncular.sync_push_schemas IN SHARE MODE",
                &[],
            )
        })?;
    }
    // Re-validate under the lock, with a snapshot taken after it was granted.
    let state = gate::read_state(client, None, a.version, true)?;
    let stored = state.stored_schema_version;
    let current = check(&state, a.version, &a.layouts, &a.declared)?;
    let mut rewritten = Map::new();
    if !current {
        // Upstream's append-only rule against the layouts stored under the lock (docs/API.md
        // §5, "Schema evolution"): refused before anything is written.
        let mut old_layouts = stored_layouts(state.stored_layouts.as_deref());
        let grown = if stored > 0 {
            if updated {
                add_retired_or_empty(client, a, &mut old_layouts, caller)?;
            }
            evolution::append_only(&old_layouts, &a.layouts, stored)?
        } else if updated {
            written_before_first(client, a, &mut old_layouts, caller)?
        } else {
            Vec::new()
        };
        // Declarations are installed at their own version; scenario SCH-08 installs one at an
        // older version alongside new ones, so only a version above the target is refused
        // (docs/DESIGN.md §Decisions).
        for (i, d) in a.declared.iter().enumerate() {
            crate::interrupts::check();
            let Some(version) = d.schema_version else {
                return Err(Error::invalid_argument(
                    &format!("declared[{i}].schemaVersion"),
                    "missing",
                ));
            };
            if version > a.version {
                return Err(Error::invalid_argument(
                    &format!("declared[{i}].schemaVersion"),
                    "range",
                ));
            }
        }
        let started_ms = db::first::<i64>(db::write(
            client,
            "SELECT (extract(epoch FROM pg_catalog.transaction_timestamp()) * 1000)::bigint",
            &[],
        )?)?
        .unwrap_or(0);
        for d in &a.declared {
            crate::interrupts::check();
            let version = d.schema_version.expect("checked above");
            // declare() also raises the partition fence to the declaration's version.
            checkpoint::declare(client, &d.partition, &d.name, version, started_ms)?;
        }
        // The marker's trigger records the writer (0.2.0's `sync_schema_meta_stamp`, the row
        // codec's snapshot check: src/schema/marker.rs).
        db::write(
            client,
            MARKER_SQL,
            &[
                DatumWithOid::from(a.version),
                DatumWithOid::from(Value::Object(a.layouts.clone()).to_string()),
            ],
        )?;
        if updated {
            super::stamp::require_stamped()?;
            push_schema::check_stored_at(client, a.version)?;
            let stored_text = state.stored_layouts.as_deref().filter(|_| stored > 0);
            record_layouts(
                client,
                stored_text.map(|t| (stored, t)),
                a.version,
                &a.layouts,
            )?;
            // Every stored row of a registered table whose layout grew, re-encoded for the new
            // layout in this transaction (src/schema/evolution.rs).
            rewritten =
                evolution::rewrite(client, &grown, &old_layouts, &a.layouts, a.version, caller)?;
        }
        marker::written_here();
    }
    record_previous(stored, state.stored_layouts.as_deref(), rewritten);
    Ok(stored)
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn check_schema(
    schema_version: Option<i64>,
    layouts: Option<args::JsonArg>,
    declared: default!(Option<args::JsonArg>, "'[]'"),
) -> &'static str {
    error::run(|| {
        let a = schema_args(schema_version, layouts, declared)?;
        let state = db::with_spi(|client| gate::read_state(client, None, a.version, false))?;
        Ok(if check(&state, a.version, &a.layouts, &a.declared)? {
            "current"
        } else {
            "migrate"
        })
    })
}

/// The marker's upsert; its trigger stamps the row version with its writer
/// ([`super::stamp::schema_marker_stamp`]).
const MARKER_SQL: &str = "INSERT INTO syncular.sync_schema_meta AS m (id, schema_version, layouts, required_writer_version)
     VALUES (1, $1, $2, $1)
     ON CONFLICT (id) DO UPDATE
       SET schema_version = EXCLUDED.schema_version, layouts = EXCLUDED.layouts,
           required_writer_version =
             GREATEST(m.required_writer_version, EXCLUDED.required_writer_version)";

/// SECURITY INVOKER: re-encoding a registered table's rows runs its host code for the migrating
/// role (src/tables/statements.rs, docs/SECURITY.md rule 19), so the call must know it; every
/// statement over `sync_*` tables runs with the extension owner's rights.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn migrate_schema(
    schema_version: Option<i64>,
    layouts: Option<args::JsonArg>,
    declared: default!(Option<args::JsonArg>, "'[]'"),
) -> i64 {
    error::run(|| {
        require_transaction(true)?;
        let a = schema_args(schema_version, layouts, declared)?;
        let caller = access::current_role();
        db::with_spi(|client| {
            refuse_holdable_cursors(client)?;
            access::as_extension_owner(|| migrate(client, &a, caller))
        })
    })
}

/// The stored schema state a host's startup compares against: `{schemaVersion, layouts,
/// writerFloor}`, or NULL before the first migration.
#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn schema_state() -> Option<JsonB> {
    error::run(|| {
        db::with_spi(|client| {
            let table = db::read(
                client,
                "SELECT schema_version, layouts, required_writer_version
                   FROM syncular.sync_schema_meta WHERE id = 1",
                &[],
            )?;
            if table.is_empty() {
                return Ok(None);
            }
            let row = table.first();
            let layouts = row.get::<String>(2)?;
            Ok(Some(JsonB(json!({
                "schemaVersion": row.get::<i64>(1)?,
                "layouts": stored_layouts(layouts.as_deref()),
                "writerFloor": row.get::<i64>(3)?,
            }))))
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn previous_schema() -> Option<JsonB> {
    error::run(|| {
        Ok(txn_local::get(txn_local::Key::PreviousSchema)
            .and_then(|t| serde_json::from_str(&t).ok())
            .map(JsonB))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l1() -> Map<String, Value> {
        serde_json::from_value(json!({
            "tasks":[{"name":"id","type":"string","nullable":false},
                     {"name":"project_id","type":"string","nullable":false},
                     {"name":"data","type":"bytes","nullable":true}],
            "docs":[{"name":"id","type":"string","nullable":false},
                    {"name":"org_id","type":"string","nullable":false},
                    {"name":"project_id","type":"string","nullable":false}]}))
        .unwrap()
    }

    fn mismatch(configured: &Map<String, Value>, stored: &Map<String, Value>) -> Value {
        match compare_layouts(configured, stored) {
            Err(Error::Sync {
                code: Code::StoredLayoutMismatch,
                detail: Some(d),
                ..
            }) => d,
            other => panic!("{other:?}"),
        }
    }

    /// A layout column's `type` is one of the row codec's names (issue 27, item 6).
    #[test]
    fn layout_types_are_row_codec_types() {
        assert_eq!(layouts_value(Value::Object(l1())).unwrap(), l1());
        let mut text = l1();
        text["tasks"][1]["type"] = json!("text");
        match layouts_value(Value::Object(text)) {
            Err(Error::Sync {
                detail: Some(d),
                hint: Some(hint),
                ..
            }) => {
                assert_eq!(
                    d,
                    json!({"argument":"layouts.tasks[1].type","reason":"shape"})
                );
                assert!(hint.contains("\"text\" is not a row-codec type (string, integer, float, boolean, json, bytes, blob_ref, crdt)"), "{hint}");
                assert!(hint.contains("string and blob_ref → text"), "{hint}");
            }
            other => panic!("{other:?}"),
        }
        let mut empty = l1();
        empty["docs"][0]["type"] = json!("");
        assert!(layouts_value(Value::Object(empty)).is_err());
    }

    #[test]
    fn scenario_sch_06_layout_mismatches() {
        let stored = l1();
        assert!(compare_layouts(&l1(), &stored).is_ok());
        let mut not_null = l1();
        not_null["tasks"][2]["nullable"] = json!(false);
        assert_eq!(
            mismatch(&not_null, &stored),
            json!({"table":"tasks","column":"data"})
        );
        let mut without_docs = l1();
        without_docs.remove("docs");
        assert_eq!(mismatch(&without_docs, &stored), json!({"table":"docs"}));
        let mut l2 = l1();
        l2["tasks"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name":"note","type":"string","nullable":true}));
        assert_eq!(
            mismatch(&l2, &stored),
            json!({"table":"tasks","column":"note"})
        );
        // A shorter configured array names the stored column.
        assert_eq!(
            mismatch(&stored, &l2),
            json!({"table":"tasks","column":"note"})
        );
    }
}
