//! What every operation of one run of a one-call push reads (docs/DESIGN.md §Push path): the
//! opened tables, the caller, the allowed scopes, and the batches (src/push/batch.rs) — the
//! rows read up front and the upserts written per table — with the loop over the operations
//! and the app-row writes. The per-operation decisions are src/push/rules.rs.

use super::append::ChangeOut;
use super::batch::Batch;
use super::outcome::{fallback, Stop};
use super::request::{Allowed, Operation, Options};
use super::stage::{self, Evidence};
use crate::codec::{ColumnType, Value as Val};
use crate::db;
use crate::error::{Error, Result};
use crate::schema::push_schema::TableSchema;
use crate::tables::{AppRelation, StoredRow};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use serde_json::{Map, Value};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, HashSet};

/// The meta columns an upsert writes: `_sync_server_version`, `_sync_scopes`, `_sync_payload`,
/// `_sync_column_versions`.
pub(super) struct RowMeta<'a> {
    pub(super) version: i64,
    pub(super) scopes: &'a Map<String, Value>,
    pub(super) payload: &'a [u8],
    pub(super) column_versions: Option<&'a [u8]>,
}

/// What an applied upsert wrote: the row's new version, scopes and full payload, and the
/// stored row before it (as a validator sees it) with its version, for an update.
pub(super) struct Upserted {
    pub(super) version: i64,
    pub(super) scopes: Map<String, Value>,
    pub(super) payload: Vec<u8>,
    pub(super) before: Option<(Value, i64)>,
}

/// A table of the running push schema whose relation is registered and usable.
pub(super) struct Table {
    pub(super) schema: std::rc::Rc<TableSchema>,
    pub(super) relation: AppRelation,
    pub(super) upsert_sql: String,
    /// The batched upsert ([`AppRelation::upsert_rows_sql`]), for a triggerless relation.
    pub(super) batch_sql: Option<String>,
    /// The app columns' types a batch binds (none when the table is not materialized).
    pub(super) column_types: Vec<ColumnType>,
    pub(super) has_blob_refs: bool,
    pub(super) has_references: bool,
    pub(super) is_crdt: Vec<bool>,
}

/// Rows one prefetch statement reads at most.
const PREFETCH_ROWS: usize = 1_000;

/// What every operation reads; the mutable part of a run is the change list.
pub(super) struct Context<'a, 'conn> {
    pub(super) client: &'a SpiClient<'conn>,
    pub(super) caller: pg_sys::Oid,
    pub(super) partition: &'a str,
    pub(super) allowed: &'a Allowed,
    pub(super) options: &'a Options,
    pub(super) tables: &'a HashMap<String, Table>,
    /// The operation whose app-row upsert is running: a class-23 error it raises becomes that
    /// operation's `sync.constraint_violation` (upstream's storage-errors mapping).
    pub(super) upserting: Cell<Option<usize>>,
    /// The operations as a commit validator sees them, collected only when the push may be
    /// staged (src/push/stage.rs).
    pub(super) evidence: Option<RefCell<Vec<Value>>>,
    /// Batches allowed in this run (src/push/batch.rs): rows read up front and upserts
    /// written per table; off when the run is repeated after an error.
    pub(super) batching: bool,
    /// `(table, row_id)` of rows the commit touches more than once: always one statement each.
    pub(super) repeated: &'a HashSet<(&'a str, &'a str)>,
    /// Tables with at least two batchable rows in the commit (one row gains nothing from a
    /// batch: its single statement is cheaper).
    pub(super) batch_tables: RefCell<HashSet<String>>,
    /// Rows read up front (`None`: absent), taken by the operation that needs them.
    pub(super) prefetched: RefCell<HashMap<(&'a str, &'a str), Option<StoredRow>>>,
    /// Upserts waiting for their table's batch, by table.
    pub(super) pending: RefCell<BTreeMap<String, Batch>>,
    /// Something of this run was read or written in a batch.
    pub(super) batched: Cell<bool>,
}

impl<'a> Context<'a, '_> {
    /// Records an applied operation's evidence when the push may be staged.
    pub(super) fn witness<'e>(&self, make: impl FnOnce() -> Evidence<'e>) {
        if let Some(evidence) = &self.evidence {
            evidence.borrow_mut().push(make().to_json());
        }
    }

    /// Whether an operation's row is read and written in batches.
    pub(super) fn batchable(&self, op: &Operation<'a>, t: &Table) -> bool {
        self.batching
            && t.batch_sql.is_some()
            && self.batch_tables.borrow().contains(op.table)
            && !self.repeated.contains(&(op.table, op.row_id))
    }

    /// Reads every batchable row of the commit, one statement per table.
    pub(super) fn prefetch(&self, ops: &[Operation<'a>]) -> Result<()> {
        if !self.batching || self.allowed.is_none() {
            return Ok(());
        }
        // A trigger on any table of the commit could change rows read up front: no batches.
        if ops.iter().any(|op| {
            self.tables
                .get(op.table)
                .is_some_and(|t| t.batch_sql.is_none())
        }) {
            return Ok(());
        }
        let mut wanted: BTreeMap<&'a str, Vec<&'a str>> = BTreeMap::new();
        for op in ops {
            crate::interrupts::check();
            crate::alloc::check()?;
            if let Some(t) = self.tables.get(op.table) {
                if t.batch_sql.is_some() && !self.repeated.contains(&(op.table, op.row_id)) {
                    wanted.entry(op.table).or_default().push(op.row_id);
                }
            }
        }
        wanted.retain(|_, ids| ids.len() > 1);
        self.batch_tables
            .borrow_mut()
            .extend(wanted.keys().map(|t| t.to_string()));
        for (table, ids) in wanted {
            self.batched.set(true);
            let t = &self.tables[table];
            // In slices, so no statement carries an array of every row id of a huge commit
            // (docs/DESIGN.md §Memory).
            for ids in ids.chunks(PREFETCH_ROWS) {
                crate::alloc::check()?;
                let mut found = t.relation.fetch_rows_as(
                    self.client,
                    self.caller,
                    self.partition,
                    ids.to_vec(),
                )?;
                let mut prefetched = self.prefetched.borrow_mut();
                for &id in ids {
                    crate::interrupts::check();
                    prefetched.insert((table, id), found.remove(id));
                }
            }
        }
        Ok(())
    }

    /// Writes the pending batches (before any statement whose order against them matters, and
    /// at the end of the run).
    pub(super) fn flush(&self) -> Result<()> {
        let pending = std::mem::take(&mut *self.pending.borrow_mut());
        for (table, batch) in pending {
            crate::interrupts::check();
            let t = &self.tables[&table];
            if let Some(sql) = &t.batch_sql {
                t.relation.upsert_row_as(
                    self.client,
                    self.caller,
                    sql,
                    &batch.args(self.partition),
                )?;
            }
        }
        Ok(())
    }

    pub(super) fn validated(&self, table: &str) -> bool {
        self.options.row_validator_tables.contains(table)
    }

    /// One projected value (docs/CODEC.md §Column types); json is bound as text and cast by
    /// the statement, so jsonb's own errors (`\u0000`) surface as PostgreSQL raises them.
    pub(super) fn projection<'v>(
        &self,
        ty: ColumnType,
        value: &'v Val<'_>,
    ) -> Result<DatumWithOid<'v>> {
        Ok(match value {
            Val::Null => DatumWithOid::null_oid(match ty {
                ColumnType::Integer => pg_sys::INT8OID,
                ColumnType::Float => pg_sys::FLOAT8OID,
                ColumnType::Boolean => pg_sys::BOOLOID,
                ColumnType::Bytes | ColumnType::Crdt => pg_sys::BYTEAOID,
                ColumnType::String | ColumnType::Json | ColumnType::BlobRef => pg_sys::TEXTOID,
            }),
            Val::Text(text) => {
                if text.contains('\0') {
                    // text cannot hold U+0000: PostgreSQL raises its own error (22021), as it
                    // does for a host binding the value (a request error, docs/DESIGN.md).
                    db::read(
                        self.client,
                        "SELECT pg_catalog.convert_from($1, 'UTF8')",
                        &[DatumWithOid::from(text.as_bytes())],
                    )?;
                    return Err(Error::Internal("syncular: U+0000 accepted as text".into()));
                }
                DatumWithOid::from(text.as_ref())
            }
            Val::Int(i) => DatumWithOid::from(*i),
            // upstream's driver sends String(n), so −0 arrives as 0 (docs/CODEC.md).
            Val::Float(f) => DatumWithOid::from(if *f == 0.0 { 0.0 } else { *f }),
            Val::Bool(b) => DatumWithOid::from(*b),
            Val::Bytes(bytes) => DatumWithOid::from(bytes.as_ref()),
        })
    }

    /// One app-row upsert (U13/I10), the projection bound from the merged values.
    pub(super) fn upsert(
        &self,
        k: usize,
        op: &Operation<'a>,
        t: &Table,
        meta: RowMeta<'_>,
        values: &[Val],
    ) -> Result<()> {
        let RowMeta {
            version,
            scopes,
            payload,
            column_versions,
        } = meta;
        if self.batchable(op, t) && Batch::accepts(values) {
            self.batched.set(true);
            let values = if t.schema.materialize { values } else { &[] };
            let full = {
                let mut pending = self.pending.borrow_mut();
                let batch = pending
                    .entry(op.table.to_string())
                    .or_insert_with(|| Batch::new(&t.column_types));
                batch.push(op.row_id, version, scopes, payload, column_versions, values);
                batch.is_full()
            };
            // Written early once large (src/push/batch.rs): the rows are written in the order
            // they were applied either way.
            if full {
                self.flush()?;
            }
            return Ok(());
        }
        // A single statement keeps its place after every pending one.
        self.flush()?;
        let mut args = vec![
            DatumWithOid::from(self.partition),
            DatumWithOid::from(op.row_id),
            DatumWithOid::from(version),
            DatumWithOid::from(super::append::scopes_jsonb(scopes)?),
            DatumWithOid::from(payload),
            DatumWithOid::from(column_versions),
        ];
        if t.schema.materialize {
            for (column, value) in t.schema.layout.columns.iter().zip(values) {
                args.push(self.projection(column.ty, value)?);
            }
        }
        self.upserting.set(Some(k));
        t.relation
            .upsert_row_as(self.client, self.caller, &t.upsert_sql, &args)?;
        self.upserting.set(None);
        Ok(())
    }

    /// An applied upsert: its change, and its evidence when the push may be staged.
    pub(super) fn applied_upsert(
        &self,
        k: usize,
        op: &Operation<'a>,
        t: &Table,
        values: &[Val<'_>],
        upserted: Upserted,
        changes: &mut Vec<ChangeOut>,
    ) {
        let Upserted {
            version,
            scopes,
            payload,
            before,
        } = upserted;
        changes.push(ChangeOut {
            table: op.table.to_string(),
            row_id: op.row_id.to_string(),
            delete: false,
            row_version: Some(version),
            scopes,
            payload: Some(payload),
        });
        self.witness(|| {
            let (stored, stored_server_version) = match before {
                Some((row, version)) => (Some(row), Some(version)),
                None => (None, None),
            };
            Evidence {
                op_index: k,
                delete: false,
                table: op.table,
                row_id: op.row_id,
                row: Some(stage::row_map(&t.schema.layout.columns, values)),
                stored,
                stored_server_version,
                next_server_version: Some(version),
            }
        });
    }

    /// Step C5 and the commit-level hooks C6…C8: every operation in order, then what host code
    /// would run once nothing terminated.
    pub(super) fn run(
        &self,
        ops: &[Operation<'a>],
        changes: &mut Vec<ChangeOut>,
    ) -> Result<Option<Stop>> {
        self.prefetch(ops)?;
        let stop = self.operations(ops, changes)?;
        // Pending writes go first even before a stop: an error they raise comes before it in
        // upstream's order (then the run is repeated without batches, `push`).
        self.flush()?;
        Ok(stop)
    }

    pub(super) fn operations(
        &self,
        ops: &[Operation<'a>],
        changes: &mut Vec<ChangeOut>,
    ) -> Result<Option<Stop>> {
        for (k, op) in ops.iter().enumerate() {
            crate::interrupts::check();
            if let Some(stop) = self.apply(k, op, changes)? {
                return Ok(Some(stop));
            }
        }
        if let Some((k, op)) = ops
            .iter()
            .enumerate()
            .find(|(_, op)| self.tables.get(op.table).is_some_and(|t| t.has_references))
        {
            return Ok(Some(fallback("references", Some((k, op.table)))));
        }
        let hooks = self.options.commit_validator || self.options.reaction_planner;
        if hooks && self.options.stage {
            return Ok(Some(Stop::Staged));
        }
        if self.options.commit_validator {
            return Ok(Some(fallback("commit_validator", None)));
        }
        if self.options.reaction_planner {
            return Ok(Some(fallback("reaction_planner", None)));
        }
        Ok(None)
    }
}
