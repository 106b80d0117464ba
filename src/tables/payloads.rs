//! Every stored `_sync_payload` of a registered relation, read below SQL: a heap scan of the
//! relation (of its leaf partitions when it is partitioned), with no planner and no executor, so
//! no host code can run while it reads. `migrate_schema`'s last pass (src/schema/evolution.rs,
//! docs/SECURITY.md rule 19) needs exactly that: planning even a read-only `SELECT` evaluates a
//! host's extended-statistics expressions, and its CHECK constraints under
//! `constraint_exclusion = on` — code that could write a row back after it was checked (red
//! team 5, R5-2).

use super::AppRelation;
use crate::db;
use crate::error::{self, Error};
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::spi::SpiClient;
use pgrx::{FromDatum, PgMemoryContexts};

/// What [`AppRelation::scan_payloads`] hands each stored row: `(partition, row_id, payload)`;
/// `Ok(false)` ends the scan.
pub type EachPayload<'a> = dyn FnMut(&str, &str, &[u8]) -> error::Result<bool> + 'a;

impl AppRelation {
    /// Hands every stored row of the relation to `each`, as of a snapshot taken now (this
    /// transaction's writes included): `ONLY` the relation when it is an ordinary table, every
    /// leaf partition when it is partitioned. A leaf that is not an ordinary table (a foreign
    /// table) cannot be read below SQL: refused. Memory: one row at a time.
    pub fn scan_payloads(
        &self,
        client: &SpiClient<'_>,
        each: &mut EachPayload<'_>,
    ) -> error::Result<()> {
        let leaves = if self.partitioned {
            // pg_partition_tree and pg_class: catalog reads, no host object in the plan.
            let rows = db::read(
                client,
                "SELECT t.relid::pg_catalog.oid, c.relkind::pg_catalog.text
                   FROM pg_catalog.pg_partition_tree($1::pg_catalog.regclass) t
                   JOIN pg_catalog.pg_class c ON c.oid = t.relid
                  WHERE t.isleaf",
                &[DatumWithOid::from(self.oid)],
            )?;
            let mut leaves = Vec::new();
            for row in rows {
                crate::interrupts::check();
                let oid = row.get::<pg_sys::Oid>(1)?.unwrap_or(pg_sys::InvalidOid);
                match db::text_column(&row, 2)?.as_deref() {
                    Some("r") => leaves.push(oid),
                    // A partitioned table without partitions is a leaf without storage.
                    Some("p") => {}
                    _ => {
                        return Err(Error::Internal(format!(
                            "syncular: a partition of the relation registered as {} is not an \
                             ordinary table (a foreign table?): its stored rows cannot be read \
                             to check them",
                            self.tbl
                        )))
                    }
                }
            }
            leaves
        } else {
            vec![self.oid]
        };
        // A table Citus distributes keeps its rows in shards, on other nodes; the relation
        // under its name is an empty shell. Read below SQL it would look empty — a check that
        // it is empty would pass, a digest would miss every row (docs/SCALING.md, "What is never
        // silent"): refused instead.
        for oid in std::iter::once(self.oid).chain(leaves.iter().copied()) {
            // SAFETY: catalog reads inside the caller's transaction.
            if unsafe { crate::citus::manages(oid) } {
                return Err(self.not_below_sql());
            }
        }
        for leaf in leaves {
            crate::interrupts::check();
            if !scan_leaf(leaf, each)? {
                break;
            }
        }
        Ok(())
    }

    /// The relation's Citus shard on this node that holds `partition`: found as every read below
    /// SQL on Citus finds it (`citus::local_shard`: its metadata locked, its placement active
    /// here); refused (`SY004`, `citus_local_execution`) where it is not on this node, and for a
    /// relation Citus does not distribute or a partitioned one — so always on one node.
    pub fn local_shard_of(&self, partition: &str) -> error::Result<pg_sys::Oid> {
        let shard = if self.distributed() && !self.partitioned {
            crate::citus::local_shard(self.oid, Some(partition))?
        } else {
            None
        };
        shard.ok_or_else(|| Error::Sync {
            code: crate::error::Code::InvalidTransactionState,
            detail: Some(serde_json::json!({"reason": "citus_local_execution"})),
            hint: Some(format!(
                "no shard of the relation registered as {} holding partition {partition} is on \
                 this node (or the relation is not a table Citus hash-distributes): \
                 migrate_schema delegates its rewrite and check of a shard to the shard's node on Citus \
                 (docs/SCALING.md)",
                self.tbl
            )),
        })
    }

    /// The relation's shard on this node that holds `partition` ([`AppRelation::local_shard_of`]),
    /// locked `ACCESS EXCLUSIVE` for the rest of the transaction (what the migration's `LOCK
    /// TABLE` takes on one node: Citus takes it on every node's shell, not on the shards), as a
    /// relation of its own: the statements of a migration's rewrite run over it on this node, in
    /// the sandbox here (src/schema/shards.rs). The same owner as the relation, or refused (Citus
    /// keeps them equal; a shard whose owner was changed alone would run its host code as
    /// someone else).
    pub fn shard_here(&self, partition: &str) -> error::Result<AppRelation> {
        let shard = self.local_shard_of(partition)?;
        // SAFETY: a lock on the shard's OID, found above, for the rest of the transaction.
        unsafe {
            pg_sys::LockRelationOid(shard, pg_sys::AccessExclusiveLock as pg_sys::LOCKMODE);
        }
        let unusable = |why: String| {
            super::unknown_table(&self.tbl).with_hint(format!(
                "the shard on this node of the relation registered as {} cannot be rewritten: \
                 {why} (docs/SCALING.md, \"Migrations on Citus\")",
                self.tbl
            ))
        };
        let Some(found) = super::inspect(shard) else {
            return Err(unusable("it no longer exists".into()));
        };
        if let Some(unfit) = found.unfit.clone() {
            return Err(unusable(unfit));
        }
        if found.owner != self.owner || !found.ordinary {
            return Err(unusable(
                "its owner is not the relation's, or it is not an ordinary table".into(),
            ));
        }
        let qualified = found.qualified();
        Ok(AppRelation {
            oid: shard,
            tbl: self.tbl.clone(),
            namespace: found.namespace,
            owner: found.owner,
            rows: format!("ONLY {qualified}"),
            qualified,
            partitioned: false,
            row_security: found.row_security,
            triggerless: found.triggerless,
            reader: None,
        })
    }

    /// Hands every stored row of a shard ([`AppRelation::shard_here`]: the relation is the shard
    /// itself) to `each`, read below SQL as [`AppRelation::scan_payloads`] reads a table on one
    /// node: the rows of every partition that shard holds (src/schema/shards.rs). Never a Citus
    /// shell: refused.
    pub fn scan_shard(&self, each: &mut EachPayload<'_>) -> error::Result<()> {
        if self.distributed() || self.partitioned {
            return Err(self.not_below_sql());
        }
        scan_leaf(self.oid, each)?;
        Ok(())
    }

    /// Whether the relation is partitioned (its leaf partitions hold its rows).
    pub fn partitioned(&self) -> bool {
        self.partitioned
    }

    /// Whether Citus distributes the relation: its rows are in shards, and the relation under its
    /// name is an empty shell that no read below SQL may take for the table.
    pub fn distributed(&self) -> bool {
        // SAFETY: catalog reads inside the caller's transaction.
        unsafe { crate::citus::manages(self.oid) }
    }

    /// The refusal of a read of a distributed relation's stored rows below SQL on this node: its
    /// rows are in shards, read on their own nodes instead ([`AppRelation::scan_shard`]).
    fn not_below_sql(&self) -> Error {
        super::unknown_table(&self.tbl).with_hint(format!(
            "the relation registered as {} is distributed by Citus: its stored rows are in \
             shards, which are read on their own nodes (docs/SCALING.md)",
            self.tbl
        ))
    }

    /// Whether the relation holds any row, read as [`AppRelation::scan_payloads`] reads (below
    /// SQL: no host code runs) — or, for a table Citus distributes, whose rows are in shards on
    /// other nodes, by one statement through Citus as `caller` (src/tables/statements.rs).
    pub fn has_rows(&self, client: &SpiClient<'_>, caller: pg_sys::Oid) -> error::Result<bool> {
        if self.distributed() {
            return self.any_row(caller);
        }
        let mut found = false;
        self.scan_payloads(client, &mut |_, _, _| {
            found = true;
            Ok(false)
        })?;
        Ok(found)
    }
}

/// One leaf relation's rows, by a sequential heap scan (`systable_beginscan` without an index,
/// as genam.c offers any relation); `false` when `each` ended the scan.
fn scan_leaf(oid: pg_sys::Oid, each: &mut EachPayload<'_>) -> error::Result<bool> {
    let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
    let mut scratch = PgMemoryContexts::new("syncular payload scan");
    // SAFETY: the relation is opened (and locked to the end of the transaction, as every read
    // of a host relation), scanned under a registered snapshot and closed here; tuples are read
    // with the relation's own descriptor at attribute numbers found in it by name; detoasted
    // values live in `scratch`, reset after each row, and what `each` receives does not outlive
    // the row. A PostgreSQL error on the way aborts the transaction, whose resource owner ends
    // the scan and releases the relation and the snapshot.
    unsafe {
        pg_sys::CommandCounterIncrement();
        let relation = pg_sys::table_open(oid, lock);
        let descriptor = (*relation).rd_att;
        let attribute = |name| crate::catalog::live_attribute(descriptor, name, |_| true);
        let columns = (
            attribute(c"_sync_partition"),
            attribute(c"_sync_row_id"),
            attribute(c"_sync_payload"),
        );
        let (Some(at_partition), Some(at_row), Some(at_payload)) = columns else {
            pg_sys::table_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
            return Err(Error::Internal(format!(
                "syncular: relation {oid:?} lacks a meta column"
            )));
        };
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        let scan = pg_sys::systable_beginscan(
            relation,
            pg_sys::InvalidOid,
            false,
            snapshot,
            0,
            std::ptr::null_mut(),
        );
        let mut outcome = Ok(true);
        loop {
            crate::interrupts::check();
            let tuple = pg_sys::systable_getnext(scan);
            if tuple.is_null() {
                break;
            }
            let row = scratch.switch_to(|_| {
                let get = |at: i16| {
                    let mut is_null = false;
                    let datum = pg_sys::heap_getattr(tuple, at.into(), descriptor, &mut is_null);
                    (datum, is_null)
                };
                let (p, p_null) = get(at_partition);
                let (r, r_null) = get(at_row);
                let (b, b_null) = get(at_payload);
                (
                    String::from_datum(p, p_null).unwrap_or_default(),
                    String::from_datum(r, r_null).unwrap_or_default(),
                    <&[u8]>::from_datum(b, b_null).unwrap_or_default(),
                )
            });
            outcome = each(&row.0, &row.1, row.2);
            drop(row);
            scratch.reset();
            if !matches!(outcome, Ok(true)) {
                break;
            }
        }
        pg_sys::systable_endscan(scan);
        pg_sys::UnregisterSnapshot(snapshot);
        pg_sys::table_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
        outcome
    }
}
