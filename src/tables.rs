//! The app-table registry (storage-api §2): which host relation holds each logical app table,
//! so definer functions with a pinned search_path can read it, plus the optional row-meta
//! trigger that keeps `sync_row_scopes` / `sync_blob_refs` in step with the host's writes.
//!
//! `register_table` and `retire_table` are SECURITY INVOKER: they check the *calling* role
//! (ownership of the relation), then switch to the extension owner only around their writes
//! to `sync_*` tables and the trigger DDL, as a definer function would.

use crate::access;
use crate::args;
use crate::db;
use crate::error::{self, Code, Error};
use crate::rows;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{quote_identifier, quote_literal, SpiClient};
use pgrx::JsonB;
use serde_json::json;

/// A registered app table's relation.
pub struct Relation {
    pub schema: String,
    pub name: String,
}

impl Relation {
    /// The quoted, schema-qualified name, safe to splice into SQL.
    pub fn qualified(&self) -> String {
        format!(
            "{}.{}",
            quote_identifier(&self.schema),
            quote_identifier(&self.name)
        )
    }
}

pub fn unknown_table(tbl: &str) -> Error {
    Error::new(Code::UnknownTable, json!({ "table": tbl }))
}

/// The registered relation of `tbl` if it exists; `None` for a reserved or unregistered name or
/// a relation that is gone.
pub fn lookup(client: &SpiClient<'_>, tbl: &str) -> error::Result<Option<Relation>> {
    if tbl.starts_with("sync_") {
        return Ok(None);
    }
    let table = db::read(
        client,
        "SELECT a.relation_schema::text, a.relation_name::text
           FROM syncular.sync_app_tables a
          WHERE a.tbl = $1
            AND pg_catalog.to_regclass(pg_catalog.quote_ident(a.relation_schema) || '.'
                                       || pg_catalog.quote_ident(a.relation_name)) IS NOT NULL",
        &[DatumWithOid::from(tbl)],
    )?;
    if table.is_empty() {
        return Ok(None);
    }
    let row = table.first();
    Ok(Some(Relation {
        schema: row.get::<String>(1)?.unwrap_or_default(),
        name: row.get::<String>(2)?.unwrap_or_default(),
    }))
}

/// The registered, existing relation of `tbl`; otherwise `unknown_table`.
pub fn resolve(client: &SpiClient<'_>, tbl: &str) -> error::Result<Relation> {
    lookup(client, tbl)?.ok_or_else(|| unknown_table(tbl))
}

/// The calling role must own the relation (directly or through membership), as
/// `pg_class_ownercheck`; superusers pass.
pub fn require_owner(
    client: &SpiClient<'_>,
    relation: pg_sys::Oid,
    argument: &str,
) -> error::Result<()> {
    let owns = db::first::<bool>(db::read(
        client,
        "SELECT pg_catalog.pg_has_role(current_user, c.relowner, 'USAGE')
           FROM pg_catalog.pg_class c WHERE c.oid = $1",
        &[DatumWithOid::from(relation)],
    )?)?;
    if owns != Some(true) {
        return Err(Error::invalid_argument(argument, "privilege"));
    }
    Ok(())
}

/// The meta columns of data-model §4 (name, type, NOT NULL) and the primary key
/// `(_sync_partition, _sync_row_id)`, on an ordinary or partitioned table.
const SHAPE_SQL: &str = "\
SELECT c.relkind IN ('r', 'p')
   AND (SELECT count(*) FROM pg_catalog.pg_attribute a
          JOIN (VALUES ('_sync_partition', 'text'::regtype, true),
                       ('_sync_row_id', 'text'::regtype, true),
                       ('_sync_server_version', 'bigint'::regtype, true),
                       ('_sync_scopes', 'jsonb'::regtype, true),
                       ('_sync_payload', 'bytea'::regtype, true),
                       ('_sync_column_versions', 'bytea'::regtype, false)) AS m(name, typ, required)
            ON a.attname = m.name AND a.atttypid = m.typ AND (a.attnotnull OR NOT m.required)
         WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped) = 6
   AND EXISTS (SELECT 1 FROM pg_catalog.pg_index i
                WHERE i.indrelid = c.oid AND i.indisprimary
                  AND (SELECT array_agg(a.attname::text ORDER BY k.ord)
                         FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
                         JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum)
                      = ARRAY['_sync_partition', '_sync_row_id']),
       n.nspname::text, c.relname::text
  FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
 WHERE c.oid = $1";

fn drop_row_meta_trigger(client: &SpiClient<'_>, relation: &Relation) -> error::Result<()> {
    let exists = db::first::<bool>(db::read(
        client,
        "SELECT pg_catalog.to_regclass(pg_catalog.quote_ident($1) || '.' || pg_catalog.quote_ident($2)) IS NOT NULL",
        &[DatumWithOid::from(relation.schema.as_str()), DatumWithOid::from(relation.name.as_str())],
    )?)?;
    if exists == Some(true) {
        Spi::run(&format!(
            "DROP TRIGGER IF EXISTS syncular_row_meta ON {}",
            relation.qualified()
        ))?;
    }
    Ok(())
}

/// The previous registration of `tbl`, if any: (relation, maintain_row_meta).
fn registration(client: &SpiClient<'_>, tbl: &str) -> error::Result<Option<(Relation, bool)>> {
    let table = db::write(
        client,
        "SELECT relation_schema::text, relation_name::text, maintain_row_meta
           FROM syncular.sync_app_tables WHERE tbl = $1 FOR UPDATE",
        &[DatumWithOid::from(tbl)],
    )?;
    if table.is_empty() {
        return Ok(None);
    }
    let row = table.first();
    let relation = Relation {
        schema: row.get::<String>(1)?.unwrap_or_default(),
        name: row.get::<String>(2)?.unwrap_or_default(),
    };
    Ok(Some((relation, row.get::<bool>(3)?.unwrap_or(false))))
}

/// `register_table` for an already validated name; shared with `adopt_legacy_tables`.
pub fn register(
    client: &SpiClient<'_>,
    tbl: &str,
    relation: pg_sys::Oid,
    maintain_row_meta: bool,
) -> error::Result<()> {
    if tbl.starts_with("sync_") {
        return Err(Error::invalid_argument("tbl", "reserved"));
    }
    let shape = db::read(client, SHAPE_SQL, &[DatumWithOid::from(relation)])?;
    if shape.is_empty() {
        return Err(Error::invalid_argument("relation", "missing"));
    }
    let row = shape.first();
    let target = Relation {
        schema: row.get::<String>(2)?.unwrap_or_default(),
        name: row.get::<String>(3)?.unwrap_or_default(),
    };
    let well_formed = row.get::<bool>(1)?.unwrap_or(false);
    require_owner(client, relation, "relation")?;
    if !well_formed {
        return Err(Error::invalid_argument("relation", "shape"));
    }
    access::as_extension_owner(client, || {
        if let Some((previous, _)) = registration(client, tbl)? {
            drop_row_meta_trigger(client, &previous)?;
        }
        drop_row_meta_trigger(client, &target)?;
        db::write(
            client,
            "INSERT INTO syncular.sync_app_tables
               (tbl, relation_schema, relation_name, maintain_row_meta, registered_at_ms)
             VALUES ($1, $2, $3, $4,
                     (extract(epoch FROM pg_catalog.transaction_timestamp()) * 1000)::bigint)
             ON CONFLICT (tbl) DO UPDATE
               SET relation_schema = EXCLUDED.relation_schema,
                   relation_name = EXCLUDED.relation_name,
                   maintain_row_meta = EXCLUDED.maintain_row_meta,
                   registered_at_ms = EXCLUDED.registered_at_ms",
            &[
                DatumWithOid::from(tbl),
                DatumWithOid::from(target.schema.as_str()),
                DatumWithOid::from(target.name.as_str()),
                DatumWithOid::from(maintain_row_meta),
            ],
        )?;
        if maintain_row_meta {
            Spi::run(&format!(
                "CREATE TRIGGER syncular_row_meta
                   AFTER INSERT OR UPDATE OF \"_sync_scopes\" OR DELETE ON {}
                   FOR EACH ROW EXECUTE FUNCTION syncular.row_meta_trigger({})",
                target.qualified(),
                quote_literal(tbl)
            ))?;
        }
        Ok(())
    })
}

#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.register_table(tbl text, relation regclass, maintain_row_meta boolean DEFAULT false)
RETURNS void VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'register_table_wrapper';
"#
)]
fn register_table(
    tbl: Option<String>,
    relation: Option<pg_sys::Oid>,
    maintain_row_meta: Option<bool>,
) {
    error::run(|| {
        let tbl = args::text("tbl", tbl)?;
        let relation = args::required("relation", relation)?;
        let maintain = maintain_row_meta.unwrap_or(false);
        db::with_spi(|client| register(client, &tbl, relation, maintain))
    })
}

#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn retire_table(tbl: Option<String>) -> JsonB {
    error::run(|| {
        let tbl = args::text("tbl", tbl)?;
        if tbl.starts_with("sync_") {
            return Err(unknown_table(&tbl));
        }
        db::with_spi(|client| {
            let previous = access::as_extension_owner(client, || registration(client, &tbl))?;
            if let Some((relation, _)) = &previous {
                let oid = db::first::<pg_sys::Oid>(db::read(
                    client,
                    "SELECT pg_catalog.to_regclass(pg_catalog.quote_ident($1) || '.' || pg_catalog.quote_ident($2))::oid",
                    &[DatumWithOid::from(relation.schema.as_str()), DatumWithOid::from(relation.name.as_str())],
                )?)?;
                if let Some(oid) = oid {
                    require_owner(client, oid, "tbl")?;
                }
            }
            access::as_extension_owner(client, || {
                let (row_scopes, blob_refs) = rows::delete_table_meta(client, &tbl)?;
                if let Some((relation, _)) = &previous {
                    drop_row_meta_trigger(client, relation)?;
                    db::write(
                        client,
                        "DELETE FROM syncular.sync_app_tables WHERE tbl = $1",
                        &[DatumWithOid::from(tbl.as_str())],
                    )?;
                }
                Ok(JsonB(
                    json!({"rowScopes": row_scopes, "blobRefs": blob_refs, "registered": previous.is_some()}),
                ))
            })
        })
    })
}

/// Keeps the row's scope entries (and, on delete, blob refs) in step with the host's writes.
/// Installed per table by `register_table(…, maintain_row_meta => true)`; argument: `tbl`.
#[pg_trigger]
fn row_meta_trigger<'a>(
    trigger: &'a PgTrigger<'a>,
) -> std::result::Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgTriggerError> {
    error::run(|| {
        let tbl = trigger
            .extra_args()
            .ok()
            .and_then(|a| a.into_iter().next())
            .ok_or_else(|| Error::Internal("syncular_row_meta needs the table name".into()))?;
        let key = |row: &PgHeapTuple<'_, AllocatedByPostgres>| -> error::Result<(String, String)> {
            Ok((
                row.get_by_name::<String>("_sync_partition")?
                    .unwrap_or_default(),
                row.get_by_name::<String>("_sync_row_id")?
                    .unwrap_or_default(),
            ))
        };
        db::with_spi(|client| {
            if let Some(old) = trigger.old() {
                let old_key = key(&old)?;
                let moved = match trigger.new() {
                    Some(new) => key(&new)? != old_key,
                    None => true,
                };
                if moved {
                    rows::delete_meta(client, &old_key.0, &tbl, &old_key.1)?;
                }
            }
            if let Some(new) = trigger.new() {
                let (partition, row_id) = key(&new)?;
                let scopes = new
                    .get_by_name::<JsonB>("_sync_scopes")?
                    .map(|j| j.0)
                    .unwrap_or_default();
                let scopes = crate::scope::stored("_sync_scopes", scopes)?;
                rows::set_scopes(client, &partition, &tbl, &row_id, &scopes)?;
            }
            Ok(())
        })
    });
    Ok(None)
}
