//! Citus (docs/SCALING.md): the one place that knows whether Citus runs in this database and
//! which of the extension's tables it manages. A table Citus distributes or replicates keeps its
//! rows in shards; the relation under its own name is an empty shell on every node. So nothing
//! of the extension may read or write such a table below SQL (src/heap.rs), and its statements
//! must let Citus plan them (no forced generic plans, src/db.rs) — issue 30, item 1.

use crate::access;
use crate::db;
use crate::error::{self, Error, Result};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{Spi, SpiClient};
use pgrx::JsonB;
use serde_json::json;

/// Citus's catalog of the tables it manages, `pg_catalog.pg_dist_partition`, if Citus is
/// installed in this database (one catalog-cache lookup).
fn catalog() -> pg_sys::Oid {
    // SAFETY: a catalog-cache lookup by name in a transaction; InvalidOid when absent.
    unsafe {
        pg_sys::get_relname_relid(
            c"pg_dist_partition".as_ptr(),
            pg_sys::Oid::from(pg_sys::PG_CATALOG_NAMESPACE),
        )
    }
}

/// Whether Citus is installed in this database.
pub fn installed() -> bool {
    catalog() != pg_sys::InvalidOid
}

/// Whether Citus keeps the rows of `relation` elsewhere: a table it distributes or replicates
/// (listed in `pg_dist_partition`). A direct insert into it would go into the shell, where no
/// query reads it, and a direct read would find nothing — the writer fence let every writer
/// through that way (issue 30). Where Citus is not installed, one catalog-cache lookup.
///
/// # Safety
/// Must run inside a transaction.
pub unsafe fn manages(relation: pg_sys::Oid) -> bool {
    // SAFETY: catalog lookups by name, then a scan of Citus's catalog table under the catalog
    // snapshot (`systable_beginscan` registers it), with one key on its `logicalrelid` column,
    // found by name and checked to be an oid/regclass column; everything is closed here.
    unsafe {
        let catalog = catalog();
        if catalog == pg_sys::InvalidOid {
            return false;
        }
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let table = pg_sys::table_open(catalog, lock);
        let column = crate::heap::live_attribute((*table).rd_att, c"logicalrelid", |t| {
            t == pg_sys::REGCLASSOID || t == pg_sys::OIDOID
        });
        let Some(column) = column else {
            pg_sys::table_close(table, lock);
            // A catalog of another shape is not Citus's: nothing to avoid.
            return false;
        };
        let mut key: pg_sys::ScanKeyData = std::mem::zeroed();
        pg_sys::ScanKeyEntryInitialize(
            &mut key,
            0,
            column,
            pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
            pg_sys::InvalidOid,
            pg_sys::InvalidOid,
            pg_sys::RegProcedure::from(pg_sys::F_OIDEQ),
            pg_sys::Datum::from(relation),
        );
        let scan = pg_sys::systable_beginscan(
            table,
            pg_sys::InvalidOid,
            false,
            std::ptr::null_mut(),
            1,
            &mut key,
        );
        let found = !pg_sys::systable_getnext(scan).is_null();
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(table, lock);
        found
    }
}

/// The relation on this node that holds the row of Citus table `table` whose distribution
/// column is `key` (`None` for a reference table, which has one shard, placed on every node
/// that has reference tables): its shard, found by name from Citus's own metadata functions
/// (`get_shard_id_for_distribution_column`, `shard_name`); `None` when that shard is not on this
/// node (a call through the coordinator: the row is read through Citus, by SQL, instead).
pub fn local_shard(table: pg_sys::Oid, key: Option<&str>) -> Result<Option<pg_sys::Oid>> {
    let found = Spi::connect(|client| {
        let rows = client.select(
            "SELECT pg_catalog.to_regclass(pg_catalog.shard_name(p.logicalrelid, CASE
                      WHEN p.partmethod = 'n'
                        THEN (SELECT s.shardid FROM pg_catalog.pg_dist_shard s
                               WHERE s.logicalrelid = p.logicalrelid
                               ORDER BY s.shardid LIMIT 1)
                      ELSE pg_catalog.get_shard_id_for_distribution_column(p.logicalrelid, $2)
                    END))::pg_catalog.oid
               FROM pg_catalog.pg_dist_partition p
              WHERE p.logicalrelid = $1::pg_catalog.oid::pg_catalog.regclass",
            None,
            &[DatumWithOid::from(table), DatumWithOid::from(key)],
        )?;
        rows.first().get::<pg_sys::Oid>(1)
    })?;
    Ok(found.filter(|oid| *oid != pg_sys::InvalidOid))
}

/// The tables keyed by `partition`, distributed by it and colocated with `sync_partitions`
/// (first in the list), so one partition's rows of every table live on one node.
const DISTRIBUTED: [&str; 13] = [
    "sync_partitions",
    "sync_commits",
    "sync_partition_registry",
    "sync_row_scopes",
    "sync_changes",
    "sync_change_scopes",
    "sync_push_results",
    "sync_reactions",
    "sync_clients",
    "sync_blob_refs",
    "sync_tombstones",
    "sync_backfill_checkpoints",
    "sync_writer_fence",
];

/// The global tables, replicated to every node as reference tables.
const REFERENCE: [&str; 6] = [
    "sync_schema_meta",
    "sync_app_tables",
    "sync_repairs",
    "sync_push_schemas",
    "sync_schema_layouts",
    "sync_notify_channel",
];

/// The one-call entry points Citus delegates to the node of their partition (their first
/// argument), where every write of the call is local — the serving role's push included, which
/// Citus refuses through the coordinator (docs/SCALING.md).
const DELEGATED: [&str; 4] = [
    "push_commit",
    "pull",
    "append_commit",
    "writer_fence_allows",
];

/// `syncular.distribute()`: the extension's tables distributed by `partition` (colocated) or
/// made reference tables, its one-call functions delegated by their partition, in one
/// transaction; what was already done is left as it is. Registered app tables are not touched
/// (distributing one copies its rows, which runs its host code: the table's owner does that,
/// docs/SCALING.md); the result says for each whether it is colocated and, if not, the statement
/// that makes it so. Operator only (the extension owner's privileges), SECURITY INVOKER.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.distribute() RETURNS jsonb
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'distribute_wrapper';
"#
)]
fn distribute() -> JsonB {
    error::run(|| {
        if !installed() {
            return Err(Error::invalid_argument("database", "missing").with_hint(
                "Citus is not installed in this database: CREATE EXTENSION citus on the \
                 coordinator (and add the workers) first, docs/SCALING.md",
            ));
        }
        db::with_spi(|client| {
            access::require_operator(client, "database")?;
            let done = access::as_extension_owner(client, || {
                db::with_settings(
                    &[
                        // Citus refuses DDL after a parallel operation in one transaction.
                        (c"citus.multi_shard_modify_mode", c"sequential"),
                        // The fence trigger on sync_commits.
                        (c"citus.enable_unsafe_triggers", c"on"),
                    ],
                    || distribute_ours(client),
                )
            })?;
            Ok(JsonB(json!({
                "distributed": done.0,
                "reference": done.1,
                "delegated": done.2,
                "appTables": app_tables(client)?,
            })))
        })
    })
}

/// The tables and functions [`distribute`] made Citus's now (each list in its constant's order).
type Done = (Vec<&'static str>, Vec<&'static str>, Vec<&'static str>);

fn distribute_ours(client: &SpiClient<'_>) -> Result<Done> {
    let managed = |table: &str| -> Result<bool> {
        Ok(db::first::<bool>(db::write(
            client,
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition p
                             WHERE p.logicalrelid = pg_catalog.to_regclass('syncular.' || $1))",
            &[DatumWithOid::from(table)],
        )?)?
        .unwrap_or(false))
    };
    let mut done: Done = (Vec::new(), Vec::new(), Vec::new());
    for (i, table) in DISTRIBUTED.into_iter().enumerate() {
        crate::interrupts::check();
        if managed(table)? {
            continue;
        }
        db::write(
            client,
            if i == 0 {
                "SELECT pg_catalog.create_distributed_table(('syncular.' || $1)::pg_catalog.regclass,
                                                            'partition')"
            } else {
                "SELECT pg_catalog.create_distributed_table(('syncular.' || $1)::pg_catalog.regclass,
                          'partition', colocate_with => 'syncular.sync_partitions')"
            },
            &[DatumWithOid::from(table)],
        )?;
        done.0.push(table);
    }
    for table in REFERENCE {
        crate::interrupts::check();
        if managed(table)? {
            continue;
        }
        db::write(
            client,
            "SELECT pg_catalog.create_reference_table(('syncular.' || $1)::pg_catalog.regclass)",
            &[DatumWithOid::from(table)],
        )?;
        done.1.push(table);
    }
    for function in DELEGATED {
        crate::interrupts::check();
        let delegated = db::first::<i64>(db::write(
            client,
            "SELECT pg_catalog.count(pg_catalog.create_distributed_function(p.oid::pg_catalog.regprocedure,
                      '$1', colocate_with => 'syncular.sync_partitions'))
               FROM pg_catalog.pg_proc p
              WHERE p.pronamespace = 'syncular'::pg_catalog.regnamespace AND p.proname = $1
                AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_object o
                                 WHERE o.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass
                                   AND o.objid = p.oid
                                   AND o.distribution_argument_index IS NOT NULL)",
            &[DatumWithOid::from(function)],
        )?)?;
        if delegated.unwrap_or(0) > 0 {
            done.2.push(function);
        }
    }
    Ok(done)
}

/// Every registration: `{table, relation, colocated}`, and for one that is not colocated with
/// `sync_partitions` the statement its owner runs.
fn app_tables(client: &SpiClient<'_>) -> Result<serde_json::Value> {
    let rows = access::as_extension_owner(client, || {
        db::write(
            client,
            "SELECT a.tbl, a.relation::pg_catalog.regclass::pg_catalog.text,
                    coalesce(p.colocationid = s.colocationid, false)
               FROM syncular.sync_app_tables a
               LEFT JOIN pg_catalog.pg_dist_partition p ON p.logicalrelid = a.relation
               LEFT JOIN pg_catalog.pg_dist_partition s
                      ON s.logicalrelid = 'syncular.sync_partitions'::pg_catalog.regclass
              ORDER BY a.tbl",
            &[],
        )
    })?;
    let mut out = Vec::new();
    for row in rows {
        crate::interrupts::check();
        let relation = row.get::<String>(2)?.unwrap_or_default();
        let colocated = row.get::<bool>(3)?.unwrap_or(false);
        let mut entry = json!({
            "table": row.get::<String>(1)?,
            "relation": relation,
            "colocated": colocated,
        });
        if !colocated {
            entry["fix"] = json!(format!(
                "as the table's owner: SELECT create_distributed_table('{relation}', \
                 '_sync_partition', colocate_with => 'syncular.sync_partitions') — its \
                 _sync_partition text COLLATE \"C\""
            ));
        }
        out.push(entry);
    }
    Ok(serde_json::Value::Array(out))
}
