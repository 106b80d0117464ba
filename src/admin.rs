//! Blob-reference reads, admin reads and the one-time adoption of a 0.24 database
//! (storage-api §8–§10).

use crate::args;
use crate::db;
use crate::error::{self, Error, Result};
use crate::tables;
use pgrx::prelude::*;
use pgrx::spi::{quote_identifier, SpiClient};
use pgrx::JsonB;
use serde_json::{json, Map, Value};

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn rows_referencing_blob(partition: Option<String>, blob_id: Option<String>) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let blob_id = args::text("blob_id", blob_id)?;
        db::with_spi(|client| {
            let tables: Vec<String> = db::read(
                client,
                "SELECT DISTINCT tbl FROM syncular.sync_blob_refs
                  WHERE partition = $1 AND blob_id = $2 ORDER BY tbl",
                &[partition.as_str().into(), blob_id.as_str().into()],
            )?
            .map(|row| Ok(row.get::<String>(1)?.unwrap_or_default()))
            .collect::<Result<_>>()?;
            let mut out = Vec::new();
            for tbl in tables {
                // Unregistered tables and vanished relations are skipped, not errors.
                let Some(relation) = tables::lookup(client, &tbl)? else {
                    continue;
                };
                let sql = format!(
                    "SELECT b.row_id, a.\"_sync_scopes\"
                       FROM syncular.sync_blob_refs b
                       JOIN {} a ON a.\"_sync_partition\" = $1::text COLLATE \"default\"
                                AND a.\"_sync_row_id\" = b.row_id COLLATE \"default\"
                      WHERE b.partition = $1 AND b.blob_id = $2 AND b.tbl = $3
                      ORDER BY b.row_id",
                    relation.qualified()
                );
                let rows = db::read_dynamic(
                    client,
                    &sql,
                    &[
                        partition.as_str().into(),
                        blob_id.as_str().into(),
                        tbl.as_str().into(),
                    ],
                )?;
                for row in rows {
                    let scopes = row.get::<JsonB>(2)?.map(|j| args::unwrap_json_text(j.0));
                    out.push(
                        json!({"table": tbl, "rowId": row.get::<String>(1)?, "scopes": scopes}),
                    );
                }
            }
            Ok(JsonB(Value::Array(out)))
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn referenced_blob_ids(partition: Option<String>) -> Vec<String> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        db::with_spi(|client| {
            db::read(
                client,
                "SELECT DISTINCT blob_id FROM syncular.sync_blob_refs WHERE partition = $1 ORDER BY 1",
                &[partition.as_str().into()],
            )?
            .map(|row| Ok(row.get::<String>(1)?.unwrap_or_default()))
            .collect()
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn list_commit_metadata(
    partition: Option<String>,
    after_seq: Option<i64>,
    lim: Option<i32>,
    tbl: default!(Option<String>, "NULL"),
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let after = args::count("after_seq", after_seq)?;
        let lim = args::required("lim", lim)?;
        let tbl = tbl
            .map(|t| crate::scope::log_table("tbl", Some(t)))
            .transpose()?;
        if lim <= 0 {
            return Ok(JsonB(json!([])));
        }
        db::with_spi(|client| {
            let list = db::read(
                client,
                "SELECT c.commit_seq, c.client_id, c.client_commit_id, c.actor_id, c.created_at_ms,
                        (SELECT count(*) FROM syncular.sync_changes ch
                          WHERE ch.partition = $1 AND ch.commit_seq = c.commit_seq),
                        (SELECT coalesce(pg_catalog.jsonb_agg(DISTINCT ch.tbl ORDER BY ch.tbl), '[]')
                           FROM syncular.sync_changes ch
                          WHERE ch.partition = $1 AND ch.commit_seq = c.commit_seq)
                   FROM syncular.sync_commits c
                  WHERE c.partition = $1 AND c.commit_seq > $2
                    AND ($4::text IS NULL OR EXISTS (
                          SELECT 1 FROM syncular.sync_changes ch
                           WHERE ch.partition = $1 AND ch.commit_seq = c.commit_seq AND ch.tbl = $4))
                  ORDER BY c.commit_seq DESC
                  LIMIT $3",
                &[partition.as_str().into(), after.into(), (lim as i64).into(), tbl.into()],
            )?
            .map(|row| {
                Ok(json!({
                    "commitSeq": row.get::<i64>(1)?,
                    "clientId": row.get::<String>(2)?,
                    "clientCommitId": row.get::<String>(3)?,
                    "actorId": row.get::<String>(4)?,
                    "createdAtMs": row.get::<i64>(5)?,
                    "changeCount": row.get::<i64>(6)?,
                    "tables": row.get::<JsonB>(7)?.map(|j| j.0),
                }))
            })
            .collect::<Result<Vec<_>>>()?;
            Ok(JsonB(Value::Array(list)))
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn scope_activity(
    partition: Option<String>,
    variable: Option<String>,
    value: Option<String>,
    lim: Option<i32>,
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let variable = args::text("variable", variable)?;
        let value = args::required("value", value)?;
        let lim = args::required("lim", lim)?;
        if lim <= 0 {
            return Ok(JsonB(json!([])));
        }
        db::with_spi(|client| {
            // A skip scan over the partition's distinct tables, then one bounded backward range
            // of the primary key per table: never the partition's whole scope index.
            let list = db::read(
                client,
                "WITH RECURSIVE tables AS (
                   (SELECT s.tbl FROM syncular.sync_change_scopes s
                     WHERE s.partition = $1 ORDER BY s.tbl LIMIT 1)
                   UNION ALL
                   SELECT (SELECT s.tbl FROM syncular.sync_change_scopes s
                            WHERE s.partition = $1 AND s.tbl > t.tbl ORDER BY s.tbl LIMIT 1)
                     FROM tables t WHERE t.tbl IS NOT NULL
                 ), pairs AS (
                   SELECT x.commit_seq, t.tbl
                     FROM tables t
                     CROSS JOIN LATERAL (
                       SELECT s.commit_seq FROM syncular.sync_change_scopes s
                        WHERE s.partition = $1 AND s.tbl = t.tbl AND s.var = $2 AND s.value = $3
                        ORDER BY s.commit_seq DESC LIMIT $4) AS x
                    WHERE t.tbl IS NOT NULL
                    ORDER BY x.commit_seq DESC, t.tbl LIMIT $4
                 )
                 SELECT p.commit_seq, p.tbl, c.actor_id, c.created_at_ms,
                        (SELECT count(*) FROM syncular.sync_changes ch
                          WHERE ch.partition = $1 AND ch.commit_seq = p.commit_seq AND ch.tbl = p.tbl)
                   FROM pairs p
                   JOIN syncular.sync_commits c ON c.partition = $1 AND c.commit_seq = p.commit_seq
                  ORDER BY p.commit_seq DESC, p.tbl",
                &[partition.as_str().into(), variable.as_str().into(), value.as_str().into(), (lim as i64).into()],
            )?
            .map(|row| {
                Ok(json!({
                    "commitSeq": row.get::<i64>(1)?,
                    "table": row.get::<String>(2)?,
                    "actorId": row.get::<String>(3)?,
                    "createdAtMs": row.get::<i64>(4)?,
                    "changeCount": row.get::<i64>(5)?,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
            Ok(JsonB(Value::Array(list)))
        })
    })
}

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
    let empty = tables::as_extension_owner(client, || {
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
            tables::as_extension_owner(client, || Ok(Spi::get_one::<i64>(&sql)?.unwrap_or(0)))?;
        counts.insert(table.to_string(), json!(copied));
    }
    let mut registered = 0;
    if let Some(app_schema) = app_schema {
        let layouts = tables::as_extension_owner(client, || {
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
                tables::register(client, &name, oid, false)?;
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
        let source = args::text("source_schema", text(source_schema))?;
        let app_schema = text(app_schema).filter(|s| !s.is_empty());
        db::with_spi(|client| adopt(client, &source, app_schema.as_deref())).map(JsonB)
    })
}
