//! `syncular.distribute()` (docs/SCALING.md, issue 30): the operator's one call that lays the
//! extension out on a Citus cluster — its tables distributed by `partition` and colocated, or
//! made reference tables, its one-call functions delegated to their partition's node. What
//! Citus is and which tables it manages is src/citus/mod.rs.

use crate::access;
use crate::db;
use crate::error::{self, Error, Result};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{quote_identifier, quote_literal, SpiClient};
use pgrx::JsonB;
use serde_json::json;

/// The tables keyed by `partition`, distributed by it and colocated with `sync_partitions`
/// (first in the list), so one partition's rows of every table live on one node.
const DISTRIBUTED: [&str; 12] = [
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
    "sync_writer_fence",
];

/// The global tables, replicated to every node as reference tables. The checkpoints are keyed
/// by partition but read whole: the serve gate's pending set has upstream's whole-server
/// semantics (a pending checkpoint of any partition refuses every partition, src/gate.rs), read
/// inside every push and pull — distributed, that was a query over every shard in each call
/// (docs/BENCHMARKS.md "Citus"); replicated, a local read on the call's node. Written rarely
/// (declare, claim, advance, activate), by the operator through the coordinator.
const REFERENCE: [&str; 7] = [
    "sync_backfill_checkpoints",
    "sync_schema_meta",
    "sync_app_tables",
    "sync_repairs",
    "sync_push_schemas",
    "sync_schema_layouts",
    "sync_notify_channel",
];

/// The entry points Citus delegates to the node of their partition (their first argument),
/// where every write of the call is local — the serving role's push included, which Citus
/// refuses through the coordinator — and the call one round trip instead of one per statement.
/// These are delegated inside a transaction block too (Citus's `force_delegation`): every call a
/// host makes in a push transaction (docs/SCALING.md "The push transaction"), so the serving
/// role's classic push runs on the partition's node over one connection as that role — Citus
/// refuses the owner's statements from the coordinator on placements the caller modified — and
/// a migration's rewrite and check of each shard of a distributed app table, on the shard's node
/// (src/schema/shards.rs). Each keeps Citus's rule for such a call: its statements over
/// distributed tables on its own partition only. Not the checkpoint functions: the checkpoints
/// are a reference table, whose every write goes to every node.
const DELEGATED_IN_BLOCKS: [&str; 21] = [
    "push_commit",
    "append_commit",
    "writer_fence_allows",
    "push_begin",
    "push_finish",
    "get_push_result",
    "put_push_result",
    "lock_partition",
    "set_row_scopes",
    "set_rows_scopes",
    "delete_row_meta",
    "set_blob_refs",
    "get_row_scopes",
    "clear_tombstone",
    "get_tombstone_seq",
    "tombstone_seqs",
    "max_commit_seq",
    "scan_rows",
    "enqueue_reactions",
    "_payload_rewrite",
    "_payload_check",
];

/// The entry points Citus delegates when they are called alone (as they are meant to be): the
/// one-call pull and the reaction queue of a partition (its rows are in the partition's shard of
/// `sync_reactions`; the enqueue, part of a push transaction, is in [`DELEGATED_IN_BLOCKS`]).
const DELEGATED_ALONE: [&str; 11] = [
    "pull",
    "claim_reactions",
    "extend_reaction_lease",
    "complete_reaction",
    "complete_reactions",
    "fail_reaction",
    "fail_reactions",
    "retry_reaction",
    "get_reaction",
    "list_reactions",
    "prune_reactions",
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
    // The call that pins the owner's settings does not require them first.
    crate::citus::owner_connections::pinning(distribute_call)
}

fn distribute_call() -> JsonB {
    error::run(|| {
        if !crate::citus::installed() {
            return Err(Error::invalid_argument("database", "missing").with_hint(
                "Citus is not installed in this database: CREATE EXTENSION citus on the \
                 coordinator (and add the workers) first, docs/SCALING.md",
            ));
        }
        db::with_spi(|client| {
            access::require_operator("database")?;
            coordinator_in_metadata(client)?;
            preloaded_on_every_node(client)?;
            let done = access::as_extension_owner(|| {
                pin_owner_settings(client)?;
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

/// The coordinator must be in Citus's metadata (`citus_set_coordinator_host`), so that it holds
/// a copy of every reference table: the registry of app tables holds each node's own OIDs and is
/// read only from this node's copy (src/heap.rs `registry_read_here`; red team 38, F1). Without
/// one, `distribute` itself and every registration on the coordinator would be refused after
/// the fact (`SY004`); refused here first, with what to run (red team 39, F2).
fn coordinator_in_metadata(client: &SpiClient<'_>) -> Result<()> {
    let present = db::first::<bool>(db::read(
        client,
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_node n WHERE n.groupid = 0)",
        &[],
    )?)?;
    if present == Some(true) {
        return Ok(());
    }
    Err(Error::invalid_argument("database", "missing").with_hint(
        "the coordinator is not in Citus's metadata, so it keeps no copy of the reference \
         tables syncular reads locally: run SELECT citus_set_coordinator_host('<its host>', \
         <its port>) on it first, docs/SCALING.md",
    ))
}

/// Every node must load the library when it starts (`shared_preload_libraries = 'citus,syncular'`):
/// its planning hook is what leaves Citus only the documented call forms to delegate — Citus
/// crashes the node on others (src/citus/subquery.rs; red teams 39, 41–44) — and a node that
/// loads it only at a session's first call of one of its functions plans that session's first
/// queries unguarded. Refused here, naming the nodes, before anything is delegated.
fn preloaded_on_every_node(client: &SpiClient<'_>) -> Result<()> {
    let missing = nodes_where(
        client,
        "SELECT pg_catalog.current_setting('shared_preload_libraries')",
        "whether it preloads syncular",
        |answer| !preloads_syncular(answer),
    )?;
    if missing.is_empty() {
        return Ok(());
    }
    Err(
        Error::invalid_argument("database", "missing").with_hint(format!(
            "syncular is not in shared_preload_libraries on {}: {}",
            missing.join(", "),
            crate::citus::PRELOAD_FIX
        )),
    )
}

/// The nodes (`host:port`, in Citus's order) where `sql`, run on every node
/// (`run_command_on_all_nodes`), answers what `wrong` says is wrong; a node that cannot be asked
/// is refused at once, named with Citus's answer (`what`: what it was asked).
fn nodes_where(
    client: &SpiClient<'_>,
    sql: &str,
    what: &str,
    wrong: impl Fn(&str) -> bool,
) -> Result<Vec<String>> {
    let nodes = db::read(
        client,
        "SELECT n.nodename || ':' || n.nodeport, r.success, r.result
           FROM pg_catalog.run_command_on_all_nodes($1) r
           JOIN pg_catalog.pg_dist_node n ON n.nodeid = r.nodeid
          ORDER BY n.nodeid",
        &[DatumWithOid::from(sql)],
    )?;
    let mut found = Vec::new();
    for node in nodes {
        crate::interrupts::check();
        let name = node.get::<String>(1)?.unwrap_or_default();
        let answer = node.get::<String>(3)?.unwrap_or_default();
        if !node.get::<bool>(2)?.unwrap_or(false) {
            return Err(Error::invalid_argument("database", "missing")
                .with_hint(format!("could not ask node {name} {what}: {answer}")));
        }
        if wrong(&answer) {
            found.push(name);
        }
    }
    Ok(found)
}

/// Pins the extension owner's settings in this database on every node
/// ([`crate::citus::owner_connections::PINNED`]: Citus runs the extension's statements there as
/// the owner, naming built-in functions unqualified and quoting values by this node's rules —
/// red teams 47 and 48, docs/SECURITY.md rule 20), each node by itself (Citus propagates `ALTER
/// ROLE … SET` only for a role it counts as distributed) and committed there at once — a setting
/// that only hardens, kept even if this call fails later —, then checks every node, naming the
/// ones without them, and that the database belongs to the extension owner or a superuser.
fn pin_owner_settings(client: &SpiClient<'_>) -> Result<()> {
    let names = db::read(
        client,
        "SELECT pg_catalog.pg_get_userbyid(e.extowner)::pg_catalog.text,
                pg_catalog.current_database()::pg_catalog.text
           FROM pg_catalog.pg_extension e WHERE e.extname = 'syncular'",
        &[],
    )?
    .first();
    let owner = names.get::<String>(1)?.unwrap_or_default();
    let database = names.get::<String>(2)?.unwrap_or_default();
    let pins: Vec<String> = crate::citus::owner_connections::PINNED
        .iter()
        .map(|(name, value)| {
            format!(
                "ALTER ROLE {} IN DATABASE {} SET {name} = {value}",
                quote_identifier(&owner),
                quote_identifier(&database)
            )
        })
        .collect();
    nodes_where(
        client,
        &format!(
            "SET citus.enable_ddl_propagation TO off; {}",
            pins.join("; ")
        ),
        "to pin the extension owner's settings",
        |_| false,
    )?;
    // By the owner's name: the extension may not be committed yet where this call created it.
    let unpinned = nodes_where(
        client,
        &format!(
            "SELECT COALESCE((SELECT pg_catalog.array_to_string(s.setconfig, ';')
                                FROM pg_catalog.pg_db_role_setting s
                               WHERE s.setrole = (SELECT r.oid FROM pg_catalog.pg_roles r
                                                   WHERE r.rolname = {})
                                 AND s.setdatabase = (SELECT d.oid FROM pg_catalog.pg_database d
                                                       WHERE d.datname = pg_catalog.current_database())),
                             '')",
            quote_literal(&owner)
        ),
        "for the extension owner's settings",
        |answer| {
            crate::citus::owner_connections::PINNED.iter().any(|(name, value)| {
                !answer
                    .split(';')
                    .any(|setting| setting == format!("{name}={value}"))
            })
        },
    )?;
    if !unpinned.is_empty() {
        return Err(
            Error::invalid_argument("database", "missing").with_hint(format!(
                "the extension owner's settings in this database are not pinned on {}: run {} \
                 there (Citus's statements run there as the owner), docs/SCALING.md",
                unpinned.join(", "),
                pins.join("; ")
            )),
        );
    }
    crate::citus::owner_connections::verify(false)
}

/// Whether a `shared_preload_libraries` value names the library (`syncular`,
/// `$libdir/syncular`, `syncular.so`, quoted or not).
fn preloads_syncular(setting: &str) -> bool {
    setting.split(',').any(|entry| {
        let entry = entry.trim().trim_matches('"');
        let file = entry.rsplit('/').next().unwrap_or(entry);
        file.strip_suffix(".so").unwrap_or(file) == "syncular"
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
    // Citus 13.2's non-blocking shard transfer (logical replication, its default `auto` mode)
    // lost the app rows of acknowledged pushes while it moved a group whose tables have two
    // owners — ours the extension owner's, the app tables their migrator's, as always here (red
    // team 46, F2: 570–840 rows a run; a control without syncular lost rows with two owners and
    // none with one). `auto` refuses a group with a table without a replica identity: one of
    // ours has none, so a move, a drain or a rebalance of the partitions' group is refused unless
    // it blocks writes (docs/SCALING.md, "Rebalancing").
    let identity = db::first::<String>(db::write(
        client,
        "SELECT c.relreplident::pg_catalog.text FROM pg_catalog.pg_class c
          WHERE c.oid = 'syncular.sync_change_scopes'::pg_catalog.regclass",
        &[],
    )?)?;
    if identity.as_deref() != Some("n") {
        db::write(
            client,
            "ALTER TABLE syncular.sync_change_scopes REPLICA IDENTITY NOTHING",
            &[],
        )?;
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
    let functions = DELEGATED_IN_BLOCKS
        .iter()
        .map(|function| (function, true))
        .chain(DELEGATED_ALONE.iter().map(|function| (function, false)));
    for (function, in_blocks) in functions {
        crate::interrupts::check();
        let delegated = db::first::<i64>(db::write(
            client,
            "SELECT pg_catalog.count(pg_catalog.create_distributed_function(p.oid::pg_catalog.regprocedure,
                      '$1', colocate_with => 'syncular.sync_partitions', force_delegation => $2))
               FROM pg_catalog.pg_proc p
              WHERE p.pronamespace = 'syncular'::pg_catalog.regnamespace AND p.proname = $1
                AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_object o
                                 WHERE o.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass
                                   AND o.objid = p.oid
                                   AND o.distribution_argument_index IS NOT NULL
                                   AND coalesce(o.force_delegation, false) = $2)",
            &[
                DatumWithOid::from(*function),
                DatumWithOid::from(in_blocks),
            ],
        )?)?;
        if delegated.unwrap_or(0) > 0 {
            done.2.push(*function);
        }
    }
    Ok(done)
}

/// Every registration: `{table, relation, colocated}`, and for one that is not colocated with
/// `sync_partitions` the statement its owner runs.
fn app_tables(client: &SpiClient<'_>) -> Result<serde_json::Value> {
    crate::heap::registry_read_here()?;
    let rows = access::as_extension_owner(|| {
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

#[cfg(test)]
mod tests {
    use super::preloads_syncular;

    #[test]
    fn the_preload_setting_is_read_as_postgresql_lists_libraries() {
        for yes in [
            "citus,syncular",
            "citus, syncular",
            "citus,\"syncular\"",
            "citus,$libdir/syncular",
            "citus,syncular.so,pg_stat_statements",
        ] {
            assert!(preloads_syncular(yes), "{yes}");
        }
        for no in [
            "",
            "citus",
            "citus,syncular_old",
            "citus,pg_syncular",
            "syncularx",
        ] {
            assert!(!preloads_syncular(no), "{no}");
        }
    }
}
