//! The static refusals of the one-call push, under the partition lock (docs/DESIGN.md §Push
//! path): the push schema at the running version, and each touched table registered, usable,
//! of an eligible primary-key type and in agreement with the stored layouts.

use super::batch;
use super::context::Table;
use super::outcome::{fallback, fallback_doc, Stop};
use super::request::Request;
use crate::codec::ColumnType;
use crate::db;
use crate::error::Result;
use crate::gate;
use crate::schema::push_schema;
use crate::tables;
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::spi::SpiClient;
use std::collections::{HashMap, HashSet};

/// The static refusals of docs/DESIGN.md §Push path (under the lock, before the gate): the push schema at the
/// running version, each touched table registered, usable, of an eligible primary-key type and
/// in agreement with the stored layouts. Tables the schema does not have are left out (step
/// A1 rejects them at their operation).
pub(super) fn open_tables(
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
    // In the caller's snapshot, as a read-only statement would see it, read below SQL by its
    // key (one statement fewer per push: docs/BENCHMARKS.md, "Server CPU").
    let marker = crate::schema::marker::marker_of_statement()?;
    // A running version ahead of the stored one has no recorded layouts and its push schema may
    // still be replaced: the native path writes no row with it (docs/API.md §8, red team 9).
    let ahead = push_schema::ahead_of_marker(running, marker).is_some();
    let marker_at_running = marker == Some(running);
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
            None => return no_push_schema(client, request).map(Err),
            Some(None) => {
                unknown.insert(tbl);
                continue;
            }
            Some(Some(_)) if ahead => return Ok(Err(fallback("descriptor_mismatch", at))),
            Some(Some(schema)) => schema,
        };
        // Before the first migration no layouts say which version's columns a stored row has:
        // the push reads and writes rows only while every push schema agrees on them (red team
        // 11, A1: a row written at version 1 merged with version 2's columns).
        if marker.is_none()
            && matches!(
                push_schema::written_columns(client, tbl)?,
                push_schema::Written::Disagree(..)
            )
        {
            return Ok(Err(fallback("descriptor_mismatch", at)));
        }
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
                    let (element, cast) = batch::sql_type(*ty);
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

/// No push schema at the running version (docs/API.md `push_commit`, "fallback"). A process
/// behind the stored schema version is refused as the gate refuses it under the lock (`SY002`,
/// upstream's answer to a stale server); otherwise the fallback says what is registered and how
/// to mend it — the classic path serves the push meanwhile, but the fix is `set_push_schema`.
fn no_push_schema(client: &SpiClient<'_>, request: &Request<'_>) -> Result<Stop> {
    let state = gate::read_state(client, Some(request.key[0]), request.running, false)?;
    if state.stored_schema_version > request.running {
        state.assert_ready(request.running, &request.declared)?;
    }
    let registered: Vec<i64> = db::read(
        client,
        "SELECT p.schema_version FROM syncular.sync_push_schemas p ORDER BY 1 DESC LIMIT 16",
        &[],
    )?
    .map(|row| {
        crate::interrupts::check();
        Ok(row.get::<i64>(1)?.unwrap_or_default())
    })
    .collect::<Result<_>>()?;
    let mut doc = fallback_doc("schema_not_registered", None);
    doc["runningSchemaVersion"] = request.running.into();
    doc["storedSchemaVersion"] = state.stored_schema_version.into();
    doc["registeredVersions"] = registered.into();
    doc["hint"] = format!(
        "no push schema at running schema version {}: call set_push_schema({}, …) once per \
         version (docs/API.md §15); registeredVersions lists the newest versions that have one",
        request.running, request.running
    )
    .into();
    Ok(Stop::Fallback(doc))
}

/// The first table whose registration changed since [`open_tables`] read it, before the
/// partition lock: retired, or pointed at another relation, by a `retire_table` or
/// `register_table` that committed while this push waited (red team 11, C1). Those take the
/// barrier's `EXCLUSIVE` lock on `sync_partitions`, so none can commit while this push holds its
/// partition lock: read once, after the lock, with a fresh snapshot, the answer stays true to the
/// end of the push. Not read again when that fresh snapshot sees what `seen` — taken before
/// [`open_tables`] read them — saw: no other transaction ended in between, so it would read
/// the same (`heap::Seen`; docs/BENCHMARKS.md, issue 28 step 9).
pub(super) fn changed_registration(
    client: &SpiClient<'_>,
    tables: &HashMap<String, Table>,
    seen: Option<&crate::heap::Seen>,
) -> Result<Option<String>> {
    if seen.is_some() {
        // SAFETY: the snapshot is registered around the closure.
        let now = crate::heap::with_snapshot(true, |s| Ok(unsafe { crate::heap::seen_by(s) }))?;
        if now.as_ref() == seen {
            return Ok(None);
        }
    }
    // Below SQL, one lookup by the primary key per table (docs/BENCHMARKS.md, "Server CPU");
    // through SQL where Citus keeps the registrations on another node.
    let mut here = true;
    for (tbl, table) in tables {
        crate::interrupts::check();
        match tables::registered_relation_now(tbl)? {
            Some(relation) if relation != Some(table.relation.oid) => return Ok(Some(tbl.clone())),
            Some(_) => {}
            None => here = false,
        }
    }
    if here {
        return Ok(None);
    }
    crate::heap::registry_read_here()?;
    let names: Vec<&str> = tables.keys().map(String::as_str).collect();
    let rows = db::write(
        client,
        "SELECT t.tbl, a.relation::pg_catalog.oid
           FROM pg_catalog.unnest($1::text[]) AS t(tbl)
           LEFT JOIN syncular.sync_app_tables a ON a.tbl = t.tbl",
        &[DatumWithOid::from(names)],
    )?;
    for row in rows {
        crate::interrupts::check();
        let tbl = db::text_column(&row, 1)?.unwrap_or_default();
        let relation = row.get::<pg_sys::Oid>(2)?;
        if tables.get(&tbl).map(|t| Some(t.relation.oid)) != Some(relation) {
            return Ok(Some(tbl));
        }
    }
    Ok(None)
}
