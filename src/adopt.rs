//! The one-time adoption of a 0.24 database into the extension's tables (storage-api §10).

use crate::access;
use crate::args;
use crate::db;
use crate::error::{self, Error, Result};
use crate::tables;
use pgrx::prelude::*;
use pgrx::spi::{quote_identifier, SpiClient};
use pgrx::JsonB;
use serde_json::{json, Map, Value};

/// The tables of data-model §1, numbers 1–14, in copy order (commits before fences and the
/// marker, so history is not fenced), with the columns adoption copies. JSON columns are
/// unwrapped; the marker's floor is not copied (it stays 0).
const ADOPTED: &[(&str, &[(&str, &str)])] = &[
    (
        "sync_partitions",
        &[
            ("partition", "text"),
            ("max_commit_seq", "bigint"),
            ("horizon_seq", "bigint"),
        ],
    ),
    (
        "sync_partition_registry",
        &[
            ("partition", "text"),
            ("log_epoch", "text"),
            ("epoch_required", "boolean"),
            ("last_authenticated_at_ms", "bigint"),
        ],
    ),
    (
        "sync_row_scopes",
        &[
            ("partition", "text"),
            ("tbl", "text"),
            ("var", "text"),
            ("value", "text"),
            ("row_id", "text"),
        ],
    ),
    (
        "sync_commits",
        &[
            ("partition", "text"),
            ("commit_seq", "bigint"),
            ("client_id", "text"),
            ("client_commit_id", "text"),
            ("actor_id", "text"),
            ("created_at_ms", "bigint"),
            ("writer_version", "bigint"),
        ],
    ),
    (
        "sync_changes",
        &[
            ("partition", "text"),
            ("commit_seq", "bigint"),
            ("idx", "integer"),
            ("tbl", "text"),
            ("row_id", "text"),
            ("op", "smallint"),
            ("row_version", "bigint"),
            ("scopes", "jsonb"),
            ("payload", "bytea"),
        ],
    ),
    (
        "sync_change_scopes",
        &[
            ("partition", "text"),
            ("tbl", "text"),
            ("var", "text"),
            ("value", "text"),
            ("commit_seq", "bigint"),
        ],
    ),
    (
        "sync_push_results",
        &[
            ("partition", "text"),
            ("client_id", "text"),
            ("client_commit_id", "text"),
            ("result", "jsonb"),
        ],
    ),
    (
        "sync_reactions",
        &[
            ("partition", "text"),
            ("idempotency_key", "text"),
            ("type", "text"),
            ("version", "integer"),
            ("payload", "jsonb"),
            ("source_client_id", "text"),
            ("source_client_commit_id", "text"),
            ("source_commit_seq", "bigint"),
            ("created_at_ms", "bigint"),
            ("available_at_ms", "bigint"),
            ("status", "text"),
            ("attempts", "integer"),
            ("max_attempts", "integer"),
            ("lease_owner", "text"),
            ("lease_expires_at_ms", "bigint"),
            ("completed_at_ms", "bigint"),
            ("last_failure", "jsonb"),
        ],
    ),
    (
        "sync_clients",
        &[
            ("partition", "text"),
            ("client_id", "text"),
            ("actor_id", "text"),
            ("wire_version", "integer"),
            ("cursor", "bigint"),
            ("subscriptions", "jsonb"),
            ("updated_at_ms", "bigint"),
        ],
    ),
    (
        "sync_blob_refs",
        &[
            ("partition", "text"),
            ("tbl", "text"),
            ("row_id", "text"),
            ("blob_id", "text"),
        ],
    ),
    (
        "sync_tombstones",
        &[
            ("partition", "text"),
            ("tbl", "text"),
            ("row_id", "text"),
            ("commit_seq", "bigint"),
        ],
    ),
    (
        "sync_backfill_checkpoints",
        &[
            ("partition", "text"),
            ("name", "text"),
            ("schema_version", "bigint"),
            ("state", "text"),
            ("watermark", "bigint"),
            ("owner_epoch", "bigint"),
            ("observed_rows", "bigint"),
            ("updated_at_ms", "bigint"),
        ],
    ),
    (
        "sync_writer_fence",
        &[("partition", "text"), ("required_writer_version", "bigint")],
    ),
    (
        "sync_schema_meta",
        &[
            ("id", "integer"),
            ("schema_version", "bigint"),
            ("layouts", "text"),
        ],
    ),
];

/// The columns a source table has, or `None` if the table is missing.
fn source_columns(
    client: &SpiClient<'_>,
    schema: &str,
    table: &str,
) -> Result<Option<Vec<String>>> {
    let oid = db::first::<pg_sys::Oid>(db::read(
        client,
        "SELECT c.oid FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
          WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')",
        &[schema.into(), table.into()],
    )?)?;
    let Some(oid) = oid else { return Ok(None) };
    let columns = db::read(
        client,
        "SELECT attname::text FROM pg_catalog.pg_attribute WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped",
        &[oid.into()],
    )?
    .map(|row| Ok(row.get::<String>(1)?.unwrap_or_default()))
    .collect::<Result<Vec<_>>>()?;
    Ok(Some(columns))
}

/// The copy statement of one table: the target columns the source has, JSON unwrapped.
fn copy_sql(schema: &str, table: &str, columns: &[(&str, &str)], present: &[String]) -> String {
    let copied: Vec<&(&str, &str)> = columns
        .iter()
        .filter(|(c, _)| present.iter().any(|p| p == c))
        .collect();
    let targets: Vec<String> = copied.iter().map(|(c, _)| quote_identifier(c)).collect();
    let sources: Vec<String> = copied
        .iter()
        .map(|(c, ty)| {
            let col = format!("s.{}", quote_identifier(c));
            if *ty == "jsonb" {
                format!(
                    "CASE WHEN pg_catalog.jsonb_typeof({col}::jsonb) = 'string'
                               AND ({col}::jsonb #>> '{{}}') ~ '^\\s*[\\[{{]'
                          THEN ({col}::jsonb #>> '{{}}')::jsonb ELSE {col}::jsonb END"
                )
            } else {
                format!("{col}::{ty}")
            }
        })
        .collect();
    format!(
        "WITH copied AS (INSERT INTO syncular.{table} ({}) SELECT {} FROM {}.{} s RETURNING 1)
         SELECT count(*) FROM copied",
        targets.join(", "),
        sources.join(", "),
        quote_identifier(schema),
        quote_identifier(table)
    )
}

fn adopt(client: &SpiClient<'_>, source: &str, app_schema: Option<&str>) -> Result<Value> {
    if source == "syncular" {
        return Err(Error::invalid_argument("source_schema", "reserved"));
    }
    let exists = db::first::<bool>(db::read(
        client,
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)",
        &[source.into()],
    )?)?;
    if exists != Some(true) {
        return Err(Error::invalid_argument("source_schema", "missing"));
    }
    let empty = access::as_extension_owner(client, || {
        let any = ADOPTED
            .iter()
            .map(|(t, _)| format!("SELECT 1 FROM syncular.{t}"))
            .collect::<Vec<_>>()
            .join(" UNION ALL ");
        Ok(!Spi::get_one::<bool>(&format!("SELECT EXISTS ({any})"))?.unwrap_or(false))
    })?;
    if !empty {
        return Err(Error::invalid_argument("source_schema", "not_empty"));
    }
    let mut counts = Map::new();
    for (table, columns) in ADOPTED {
        let Some(present) = source_columns(client, source, table)? else {
            counts.insert(table.to_string(), json!(0));
            continue;
        };
        // As the caller: its privileges decide whether it may lock and read the source.
        let qualified = format!("{}.{}", quote_identifier(source), quote_identifier(table));
        Spi::run(&format!("LOCK TABLE {qualified} IN EXCLUSIVE MODE"))?;
        let readable = Spi::get_one::<bool>(&format!(
            "SELECT pg_catalog.has_table_privilege({}, 'SELECT')",
            pgrx::spi::quote_literal(&qualified)
        ))?;
        if readable != Some(true) {
            return Err(Error::invalid_argument("source_schema", "privilege"));
        }
        let sql = copy_sql(source, table, columns, &present);
        let copied =
            access::as_extension_owner(client, || Ok(Spi::get_one::<i64>(&sql)?.unwrap_or(0)))?;
        counts.insert(table.to_string(), json!(copied));
    }
    let mut registered = 0;
    if let Some(app_schema) = app_schema {
        let layouts = access::as_extension_owner(client, || {
            db::first::<String>(db::write(
                client,
                "SELECT layouts FROM syncular.sync_schema_meta WHERE id = 1",
                &[],
            )?)
        })?;
        let names: Vec<String> = layouts
            .and_then(|text| serde_json::from_str::<Value>(&text).ok())
            .and_then(|v| v.as_object().map(|m| m.keys().cloned().collect()))
            .unwrap_or_default();
        for name in names {
            let oid = db::first::<pg_sys::Oid>(db::read(
                client,
                "SELECT c.oid FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 AND c.relname = $2",
                &[app_schema.into(), name.as_str().into()],
            )?)?;
            if let Some(oid) = oid {
                tables::register(client, &name, oid, false, tables::Registrant::RelationOwner)?;
                registered += 1;
            }
        }
    }
    counts.insert("sync_app_tables".into(), json!(registered));
    Ok(Value::Object(counts))
}

#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.adopt_legacy_tables(source_schema name, app_schema name DEFAULT NULL)
RETURNS jsonb VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'adopt_legacy_tables_wrapper';
"#
)]
// `name` arguments arrive as pointers to NUL-terminated NameData, readable as C strings.
fn adopt_legacy_tables(
    source_schema: Option<&core::ffi::CStr>,
    app_schema: Option<&core::ffi::CStr>,
) -> JsonB {
    error::run(|| {
        if !unsafe { pg_sys::IsTransactionBlock() } {
            return Err(Error::invalid_transaction_state("no_transaction_block"));
        }
        let text = |v: Option<&core::ffi::CStr>| v.map(|c| c.to_string_lossy().into_owned());
        let source = args::text("source_schema", text(source_schema).as_deref())?;
        let app_schema = text(app_schema).filter(|s| !s.is_empty());
        db::with_spi(|client| adopt(client, &source, app_schema.as_deref())).map(JsonB)
    })
}
