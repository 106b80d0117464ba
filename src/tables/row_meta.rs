//! The row-meta trigger (`register_table(…, maintain_row_meta => true)`): keeps a registered
//! table's row scopes and blob references in step with the host's own writes. It fires on the
//! host's statements, runs with the extension owner's rights (a definer function, lib.rs) and
//! writes only `sync_*` tables; it reads nothing of the row but its meta columns.

use crate::db;
use crate::error::{self, Error};
use crate::rows;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use pgrx::JsonB;

/// Whether the row-meta trigger firing on `relation` for `tbl` was installed by
/// `register_table`: the registration names that relation, or a partitioned table it is a
/// partition of (PostgreSQL clones the trigger onto every partition, where it fires), and asked
/// for the trigger. A trigger
/// a host attached itself (with the function under another table's name) must not write that
/// table's row metadata.
fn trigger_is_registered(
    client: &SpiClient<'_>,
    tbl: &str,
    relation: pg_sys::Oid,
) -> error::Result<bool> {
    crate::heap::registry_read_here()?;
    Ok(db::first::<bool>(db::read(
        client,
        "SELECT a.maintain_row_meta
                AND (a.relation::oid = $2
                     OR EXISTS (SELECT 1 FROM pg_catalog.pg_partition_ancestors($2::pg_catalog.regclass) p
                                 WHERE p.relid = a.relation))
           FROM syncular.sync_app_tables a WHERE a.tbl = $1",
        &[DatumWithOid::from(tbl), DatumWithOid::from(relation)],
    )?)? == Some(true))
}

/// Keeps the row's scope entries (and, on delete, blob refs) in step with the host's writes.
/// Installed per table by `register_table(…, maintain_row_meta => true)`; argument: `tbl`.
#[pg_trigger]
fn row_meta_trigger<'a>(
    trigger: &'a PgTrigger<'a>,
) -> std::result::Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgTriggerError> {
    error::run_in_host_code(|| {
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
        let relation = trigger
            .relation()
            .map_err(|e| Error::Internal(format!("syncular_row_meta: {e}")))?
            .oid();
        db::with_spi(|client| {
            if !trigger_is_registered(client, &tbl, relation)? {
                return Err(Error::invalid_argument("tbl", "privilege").with_hint(
                    "syncular_row_meta fired on a relation that is not registered for this table with maintain_row_meta",
                ));
            }
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
