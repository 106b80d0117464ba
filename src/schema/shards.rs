//! A migration's re-encoding of a table Citus distributes (docs/SCALING.md, "Migrations on
//! Citus"; src/schema/evolution.rs does it on one node). Its rows are in shards on the workers,
//! which no statement of the coordinator's sandbox reaches: a rewrite through Citus would run the
//! table's host code (triggers on the shards) on the workers in an ordinary session — the
//! migrator's `search_path`, `SET ROLE`, temporary tables, deferred events (red team 49, F3). So
//! each shard is rewritten on its own node, by a call Citus delegates there (with
//! `force_delegation`, inside the migration's transaction) for a partition value that shard
//! holds, and checked there, as one node rewrites and checks a table:
//! 1. [`_payload_rewrite`], for every shard of every table: the shard locked, its rows
//!    re-encoded by the statements of one node (`AppRelation::rewrite_payloads`) in the sandbox
//!    of that node, and a digest of the rows written kept in that backend under keys drawn
//!    there;
//! 2. [`_payload_check`], for every shard, once every shard of every table is rewritten: the
//!    shard read below SQL (no host code) and its digest compared with the rows written there.
//!
//! Every call runs as the migration's rewrite role over the one connection per node Citus keeps
//! for it (`AppRelation::call_shard`), so a shard's two calls meet in one backend; a check that
//! finds no rewrite of its shard there refuses. The keys never leave that backend. Host code of
//! the rewrite cannot queue a deferred trigger event in the sandbox (PostgreSQL refuses it,
//! `42501`), so nothing of the migration runs after the checks: what the host's own statements
//! of the transaction do afterwards is the host's, as on one node.

use super::digest::{self, Digest};
use super::evolution::{self, Reencoding};
use crate::args::{self, JsonArg};
use crate::db;
use crate::error::{self, Error, Result};
use crate::tables::{self, AppRelation};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use std::cell::{Cell, RefCell};

/// Step 1 of the module comment for every shard of the partitions' group (`partitions`: one
/// partition value per shard, [`partition_per_shard`]): the rows rewritten.
pub fn rewrite(
    relation: &AppRelation,
    caller: pg_sys::Oid,
    partitions: &[String],
    reencoding: &Reencoding,
) -> Result<i64> {
    let layouts = pgrx::JsonB(reencoding.to_json());
    let mut count = 0i64;
    for partition in partitions {
        crate::interrupts::check();
        let arg = DatumWithOid::from(pgrx::JsonB(layouts.0.clone()));
        count += relation.call_shard(caller, partition, "_payload_rewrite", Some(arg))?;
    }
    Ok(count)
}

/// Step 2 of the module comment for every shard, once every table's shards are rewritten: each
/// checked on its node (`27000` where it does not hold exactly the rows its rewrite wrote).
pub fn check(relation: &AppRelation, caller: pg_sys::Oid, partitions: &[String]) -> Result<()> {
    for partition in partitions {
        crate::interrupts::check();
        relation.call_shard(caller, partition, "_payload_check", None)?;
    }
    Ok(())
}

/// A distributed app table's rows are rewritten and checked by the shards of the partitions'
/// group, each on its node, as the rewrite's role: refused, `SY041` with a HINT, unless the
/// table is hash-distributed, colocated with `sync_partitions` (what `distribute()` reports and
/// says how to do) and not partitioned (its shards would be partitioned tables, not read below
/// SQL yet), and that role may call [`_payload_rewrite`] and [`_payload_check`] (a member of
/// `syncular_admin`); and `SY000` `database`/`missing` where `distribute()` has not delegated
/// them yet.
pub fn require_checkable(
    client: &SpiClient<'_>,
    relation: &AppRelation,
    caller: pg_sys::Oid,
) -> Result<()> {
    let acting = relation.acting_role(caller);
    let (colocated, delegated, callable) = crate::access::as_extension_owner(|| {
        let rows = db::read(
            client,
            "SELECT p.partmethod = 'h' AND p.colocationid = s.colocationid,
                    (SELECT pg_catalog.count(*) = 2 FROM pg_catalog.pg_dist_object o
                      WHERE o.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass
                        AND o.objid IN ('syncular._payload_rewrite(text, text, jsonb)'
                                          ::pg_catalog.regprocedure,
                                        'syncular._payload_check(text, text)'
                                          ::pg_catalog.regprocedure)
                        AND o.force_delegation),
                    pg_catalog.has_schema_privilege($2::pg_catalog.oid, 'syncular', 'USAGE')
                    AND pg_catalog.has_function_privilege($2::pg_catalog.oid,
                          'syncular._payload_rewrite(text, text, jsonb)', 'EXECUTE')
                    AND pg_catalog.has_function_privilege($2::pg_catalog.oid,
                          'syncular._payload_check(text, text)', 'EXECUTE')
               FROM pg_catalog.pg_dist_partition p, pg_catalog.pg_dist_partition s
              WHERE p.logicalrelid = $1::pg_catalog.oid::pg_catalog.regclass
                AND s.logicalrelid = 'syncular.sync_partitions'::pg_catalog.regclass",
            &[DatumWithOid::from(relation.oid), DatumWithOid::from(acting)],
        )?;
        match rows.into_iter().next() {
            Some(row) => Ok((
                row.get::<bool>(1)?.unwrap_or(false),
                row.get::<bool>(2)?.unwrap_or(false),
                row.get::<bool>(3)?.unwrap_or(false),
            )),
            None => Ok((false, false, false)),
        }
    })?;
    if !colocated || relation.partitioned() {
        return Err(tables::unknown_table(relation.tbl()).with_hint(format!(
            "the relation registered as {} is distributed by Citus but is partitioned, or not \
             colocated with syncular.sync_partitions, so a migration cannot check its \
             re-encoded rows shard by shard: an unpartitioned table, colocated (SELECT \
             update_distributed_table_colocation('{}', colocate_with => \
             'syncular.sync_partitions'), as syncular.distribute() reports), docs/SCALING.md",
            relation.tbl(),
            relation.qualified().replace('\'', "''")
        )));
    }
    if !callable {
        // The shards' calls run as the rewrite does: as the table's owner when the migrator holds
        // its privileges, and an owner that is not a member of syncular_admin cannot call them.
        return Err(tables::unknown_table(relation.tbl()).with_hint(format!(
            "on Citus a migration re-encodes and checks the rows of the relation registered as \
             {} on each shard's node (syncular._payload_rewrite, syncular._payload_check), run \
             as the role the rewrite runs as (its owner when the migrator holds the owner's \
             privileges): grant that role syncular_admin, docs/SCALING.md",
            relation.tbl()
        )));
    }
    if !delegated {
        // Distributed before this version: the shards' calls would run here, where no shard is.
        return Err(Error::invalid_argument("database", "missing").with_hint(
            "syncular._payload_rewrite and syncular._payload_check are not delegated by Citus \
             yet (an install distributed by an earlier version): run SELECT \
             syncular.distribute() again on the coordinator, docs/SCALING.md",
        ));
    }
    Ok(())
}

/// One partition value for every shard of `sync_partitions` (so of every table colocated with
/// it): candidate values `s0`, `s1`, … hashed by Citus until each shard has one. Each shard
/// takes a share of the hash space, so a few times the shard count of candidates covers them;
/// the loop is bounded and interruptible.
pub fn partition_per_shard(client: &SpiClient<'_>) -> Result<Vec<String>> {
    const BATCH: i64 = 4096;
    const MAX_CANDIDATES: i64 = 64 * 1024 * 1024;
    crate::access::as_extension_owner(|| {
        let shards = db::first::<i64>(db::read(
            client,
            "SELECT pg_catalog.count(*) FROM pg_catalog.pg_dist_shard
              WHERE logicalrelid = 'syncular.sync_partitions'::pg_catalog.regclass",
            &[],
        )?)?
        .unwrap_or(0);
        let mut found: std::collections::BTreeMap<i64, String> = Default::default();
        let mut from = 0i64;
        while (found.len() as i64) < shards {
            crate::interrupts::check();
            if from >= MAX_CANDIDATES {
                return Err(Error::Internal(format!(
                    "syncular: no partition value found for {} of the {shards} shards of \
                     syncular.sync_partitions among {MAX_CANDIDATES} candidates",
                    shards - found.len() as i64
                )));
            }
            let rows = db::read(
                client,
                "SELECT DISTINCT ON (shard) shard, v
                   FROM (SELECT pg_catalog.get_shard_id_for_distribution_column(
                                  'syncular.sync_partitions'::pg_catalog.regclass, 's' || i) AS shard,
                                's' || i AS v, i
                           FROM pg_catalog.generate_series($1::pg_catalog.int8,
                                                           $2::pg_catalog.int8) i) c
                  ORDER BY shard, i",
                &[
                    DatumWithOid::from(from),
                    DatumWithOid::from(from + BATCH - 1),
                ],
            )?;
            for row in rows {
                crate::interrupts::check();
                let shard = row.get::<i64>(1)?.unwrap_or(0);
                let value = db::text_column(&row, 2)?.unwrap_or_default();
                found.entry(shard).or_insert(value);
            }
            from += BATCH;
        }
        Ok(found.into_values().collect())
    })
}

/// A shard's call: `partition` and `tbl` checked, then `more` (the call's own argument, for
/// `tbl`), then `body` with the calling role and the shard on this node of the registered table
/// `tbl` that holds `partition` ([`AppRelation::shard_here`]), for a role that can read the whole
/// table ([`AppRelation::readable_by`]: `SELECT` and no row-level security filtering it) — what a
/// migration's rewrite role can.
fn on_shard<A>(
    partition: Option<&str>,
    tbl: Option<&str>,
    more: impl FnOnce(&str) -> Result<A>,
    body: impl FnOnce(A, pg_sys::Oid, AppRelation) -> Result<i64>,
) -> i64 {
    error::run(|| {
        let partition = args::text_ref("partition", partition)?;
        let tbl = args::text_ref("tbl", tbl)?;
        let arg = more(tbl)?;
        db::with_spi(|client| {
            let Some(relation) = tables::open_for_migration(client, tbl)? else {
                return Err(tables::unknown_table(tbl));
            };
            // SAFETY: a syscache lookup of the session's user inside the call.
            let role = unsafe { pg_sys::GetUserId() };
            if !relation.readable_by(role) {
                return Err(
                    Error::invalid_argument("tbl", "not_readable").with_hint(format!(
                        "a migration's calls on the shards of table {tbl} are for a role that \
                         reads the whole table: SELECT on it and no row-level security \
                         filtering its rows"
                    )),
                );
            }
            body(arg, role, relation.shard_here(partition)?)
        })
    })
}

/// `syncular._payload_rewrite(partition, tbl, layouts)`, step 1 of the module comment, delegated
/// to the node of the shard of `tbl` that holds `partition`: that shard locked `ACCESS
/// EXCLUSIVE`, every stored row of it re-encoded as `layouts` says (what
/// [`Reencoding::to_json`] wrote) by statements over the shard run in the sandbox of this node
/// as the calling role's less privileged of it and the owner (`AppRelation::rewrite_payloads`),
/// and a digest of the rows written kept for [`_payload_check`]; the rows rewritten.
/// `syncular_admin`, SECURITY INVOKER (the migration runs it as its rewrite role, who may update
/// the table anyway). Refused where the shard is not placed on this node (`SY004`,
/// `citus_local_execution`) — always on one node.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular._payload_rewrite(partition text, tbl text, layouts jsonb) RETURNS bigint
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', '_payload_rewrite_wrapper';
"#
)]
fn _payload_rewrite(partition: Option<&str>, tbl: Option<&str>, layouts: Option<JsonArg>) -> i64 {
    let reencoding = |tbl: &str| Reencoding::from_json(tbl, &args::json("layouts", layouts)?);
    on_shard(partition, tbl, reencoding, |reencoding, role, shard| {
        let mut written = Digest::new(&digest::fresh_keys()?);
        let count = shard.rewrite_payloads(role, &mut |partition, row_id, payload| {
            let out = reencoding.row(partition, row_id, payload)?;
            written.add(partition, row_id, &out);
            Ok(out)
        })?;
        keep(shard.oid, written);
        Ok(count)
    })
}

/// `syncular._payload_check(partition, tbl)`, step 2 of the module comment, delegated as
/// [`_payload_rewrite`] was, to the same backend: every stored row of the shard read below SQL
/// ([`AppRelation::scan_shard`], no host code) and its digest, under the keys of the shard's
/// rewrite, compared with the rows it wrote: `27000` where they differ — host code of the
/// migration wrote, inserted or deleted rows of the shard after they were re-encoded; the rows
/// checked. Refused (`XX000`) where this backend holds no rewrite of the shard in this
/// transaction, and where the shard is not placed on this node (`SY004`,
/// `citus_local_execution`).
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular._payload_check(partition text, tbl text) RETURNS bigint
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', '_payload_check_wrapper';
"#
)]
fn _payload_check(partition: Option<&str>, tbl: Option<&str>) -> i64 {
    on_shard(
        partition,
        tbl,
        |_| Ok(()),
        |(), _, shard| {
            let what = format!("shard {} of table {}", shard.qualified(), shard.tbl());
            let Some(keys) = latest(shard.oid, |written| *written.keys()) else {
                return Err(Error::Internal(format!(
                    "syncular: {what} was not rewritten by this migration in this session (Citus \
                 sent its check over another connection than its rewrite): nothing is kept"
                )));
            };
            let mut stored = Digest::new(&keys);
            shard.scan_shard(&mut |p, id, payload| {
                stored.add(p, id, payload);
                Ok(true)
            })?;
            let (same, written) =
                latest(shard.oid, |w| (*w == stored, w.rows())).unwrap_or_default();
            if !same {
                return Err(evolution::rewritten_rows_changed(
                    &what,
                    written,
                    stored.rows(),
                ));
            }
            Ok(stored.rows() as i64)
        },
    )
}

/// A shard's rewrite in this transaction on this node: the digest of the rows it wrote, under
/// keys drawn here, and the subtransaction that made it.
struct Rewritten {
    shard: pg_sys::Oid,
    subid: pg_sys::SubTransactionId,
    written: Digest,
}

thread_local! {
    /// The shards rewritten in this transaction on this node, oldest first, for
    /// [`_payload_check`].
    static REWRITTEN: RefCell<Vec<Rewritten>> = const { RefCell::new(Vec::new()) };
    /// Whether the callbacks are registered in this backend.
    static REGISTERED: Cell<bool> = const { Cell::new(false) };
}

/// Keeps what the rewrite of `shard` wrote, for [`_payload_check`].
fn keep(shard: pg_sys::Oid, written: Digest) {
    if !REGISTERED.get() {
        // SAFETY: plain functions living as long as the library; PostgreSQL keeps them for the
        // backend's lifetime.
        unsafe {
            pg_sys::RegisterXactCallback(Some(at_transaction_end), std::ptr::null_mut());
            pg_sys::RegisterSubXactCallback(Some(at_subtransaction_end), std::ptr::null_mut());
        }
        REGISTERED.set(true);
    }
    // SAFETY: reads the transaction state of this backend.
    let subid = unsafe { pg_sys::GetCurrentSubTransactionId() };
    REWRITTEN.with(|kept| {
        kept.borrow_mut().push(Rewritten {
            shard,
            subid,
            written,
        })
    });
}

/// `f` of the latest rewrite of `shard` kept in this transaction (an earlier one of the same
/// transaction — two migrations — is superseded by it).
fn latest<R>(shard: pg_sys::Oid, f: impl FnOnce(&Digest) -> R) -> Option<R> {
    REWRITTEN.with(|kept| {
        kept.borrow()
            .iter()
            .rev()
            .find(|r| r.shard == shard)
            .map(|r| f(&r.written))
    })
}

/// A transaction's end: nothing is kept past it.
///
/// # Safety
/// Called by PostgreSQL only, as the transaction callback registered by [`keep`].
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn at_transaction_end(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::XactEvent::*;
    if matches!(
        event,
        XACT_EVENT_COMMIT | XACT_EVENT_ABORT | XACT_EVENT_PREPARE | XACT_EVENT_PARALLEL_ABORT
    ) {
        REWRITTEN.with(|kept| kept.borrow_mut().clear());
    }
}

/// A subtransaction's end: a commit hands its rewrites to the parent; an abort — `ROLLBACK TO
/// SAVEPOINT`, which Citus sends to the node too — drops them with the rows it rolled back, so
/// no check compares a shard with a rewrite that was undone.
///
/// # Safety
/// Called by PostgreSQL only, as the subtransaction callback registered by [`keep`].
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn at_subtransaction_end(
    event: pg_sys::SubXactEvent::Type,
    my_subid: pg_sys::SubTransactionId,
    parent_subid: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::SubXactEvent::*;
    REWRITTEN.with(|kept| {
        let mut kept = kept.borrow_mut();
        match event {
            SUBXACT_EVENT_COMMIT_SUB => {
                for r in kept.iter_mut().filter(|r| r.subid == my_subid) {
                    r.subid = parent_subid;
                }
            }
            SUBXACT_EVENT_ABORT_SUB => kept.retain(|r| r.subid < my_subid),
            _ => {}
        }
    });
}
