//! The extension's own tables below SQL: opened by an OID cached per backend, and written by
//! direct inserts the way `COPY FROM` writes (heap insert + index insertion, no executor plan).
//!
//! Why: `append_commit` writes one row per change and one per scope-index entry. Through a
//! statement, each row also pays the executor (plan cache, node start-up, projections, the CTE
//! plumbing); those were the measured gap to a hand-written one-statement floor
//! (docs/BENCHMARKS.md). The rows here are the extension's own, validated in Rust, into tables
//! it created; [`DirectInsert::open`] refuses (and the caller falls back to SQL) whenever the
//! table is not exactly as created: other columns, triggers, rules, CHECK constraints, forced row
//! security, generated columns. So a DBA's audit trigger on `sync_changes` still fires.

use crate::error::{Error, Result};
use pgrx::pg_sys;
use std::cell::Cell;
use std::ffi::CStr;

/// Tables opened below SQL.
#[derive(Clone, Copy)]
pub enum SyncTable {
    WriterFence = 0,
    SchemaMeta = 1,
    Changes = 2,
    ChangeScopes = 3,
}

const TABLES: usize = 4;

impl SyncTable {
    pub fn name(self) -> &'static CStr {
        match self {
            SyncTable::WriterFence => c"sync_writer_fence",
            SyncTable::SchemaMeta => c"sync_schema_meta",
            SyncTable::Changes => c"sync_changes",
            SyncTable::ChangeScopes => c"sync_change_scopes",
        }
    }
}

thread_local! {
    /// (schema OID, table OIDs) as last resolved by this backend: resolving a name costs several
    /// catalog-cache lookups, and these tables are opened for every commit.
    static RESOLVED: Cell<(pg_sys::Oid, [pg_sys::Oid; TABLES])> =
        const { Cell::new((pg_sys::InvalidOid, [pg_sys::InvalidOid; TABLES])) };
}

/// Opens one of the extension's tables with `lock`. The cached OID is used only while it still
/// names that table in the cached schema (a dropped and re-created extension gets new OIDs and is
/// re-resolved).
///
/// # Safety
/// Must run inside a transaction; the caller closes the relation (`table_close`).
pub unsafe fn open(table: SyncTable, lock: pg_sys::LOCKMODE) -> Result<pg_sys::Relation> {
    unsafe {
        let (namespace, oids) = RESOLVED.with(Cell::get);
        let cached = oids[table as usize];
        if cached != pg_sys::InvalidOid {
            let relation = pg_sys::try_table_open(cached, lock);
            if !relation.is_null() {
                let form = &*(*relation).rd_rel;
                let name = CStr::from_ptr(form.relname.data.as_ptr());
                if form.relnamespace == namespace && name == table.name() {
                    return Ok(relation);
                }
                pg_sys::table_close(relation, lock);
            }
        }
        let namespace = pg_sys::get_namespace_oid(c"syncular".as_ptr(), false);
        let oid = pg_sys::get_relname_relid(table.name().as_ptr(), namespace);
        if oid == pg_sys::InvalidOid {
            return Err(Error::Internal(format!(
                "syncular: {:?} is missing",
                table.name()
            )));
        }
        let mut fresh = if RESOLVED.with(Cell::get).0 == namespace {
            oids
        } else {
            [pg_sys::InvalidOid; TABLES]
        };
        fresh[table as usize] = oid;
        RESOLVED.with(|c| c.set((namespace, fresh)));
        Ok(pg_sys::table_open(oid, lock))
    }
}

const ROW_EXCLUSIVE: pg_sys::LOCKMODE = pg_sys::RowExclusiveLock as pg_sys::LOCKMODE;

/// Rows inserted into one table without a statement: heap insert, then every index (unique ones
/// checked), as `COPY FROM` and logical replication's apply do. WAL, statistics and visibility
/// are the heap's own; nothing else runs, which is why [`DirectInsert::open`] checks that
/// nothing else is defined on the table.
pub struct DirectInsert {
    relation: pg_sys::Relation,
    info: *mut pg_sys::ResultRelInfo,
    estate: *mut pg_sys::EState,
    slot: *mut pg_sys::TupleTableSlot,
}

impl DirectInsert {
    /// Opens `table` for direct inserts of rows with exactly `columns` (name, type), or `None`
    /// when the table has anything a statement would have to run (see the module comment).
    pub fn open(table: SyncTable, columns: &[(&CStr, pg_sys::Oid)]) -> Result<Option<Self>> {
        unsafe {
            let relation = open(table, ROW_EXCLUSIVE)?;
            if !is_plain(relation, columns) {
                // Keep the lock: the statement that writes instead takes it anyway.
                pg_sys::table_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
                return Ok(None);
            }
            let estate = pg_sys::CreateExecutorState();
            let info = pg_sys::palloc0(std::mem::size_of::<pg_sys::ResultRelInfo>())
                as *mut pg_sys::ResultRelInfo;
            (*info).type_ = pg_sys::NodeTag::T_ResultRelInfo;
            pg_sys::InitResultRelInfo(info, relation, 1, std::ptr::null_mut(), 0);
            pg_sys::ExecOpenIndices(info, false);
            #[cfg(feature = "pg13")]
            {
                (*estate).es_result_relation_info = info;
            }
            let slot = pg_sys::MakeSingleTupleTableSlot((*relation).rd_att, &pg_sys::TTSOpsVirtual);
            Ok(Some(DirectInsert {
                relation,
                info,
                estate,
                slot,
            }))
        }
    }

    /// Inserts one row; `values[i]` is NULL where `nulls[i]`. A NULL in a NOT NULL column is
    /// refused like the executor refuses it (23502), though callers never pass one.
    pub fn insert(&mut self, values: &[pg_sys::Datum], nulls: &[bool]) -> Result<()> {
        unsafe {
            let slot = self.slot;
            let natts = (*(*slot).tts_tupleDescriptor).natts as usize;
            if values.len() != natts || nulls.len() != natts {
                return Err(Error::Internal(
                    "direct insert: wrong number of columns".into(),
                ));
            }
            let attributes = pgrx::PgTupleDesc::from_pg_unchecked((*self.relation).rd_att);
            for (i, attribute) in attributes.iter().enumerate() {
                if nulls[i] && attribute.attnotnull {
                    pgrx::ereport!(
                        ERROR,
                        pgrx::PgSqlErrorCode::ERRCODE_NOT_NULL_VIOLATION,
                        format!(
                            "null value in column \"{}\" violates not-null constraint",
                            CStr::from_ptr(attribute.attname.data.as_ptr()).to_string_lossy()
                        )
                    );
                }
            }
            // ExecClearTuple is an inline function of the headers: the slot's own clear callback.
            if let Some(clear) = (*(*slot).tts_ops).clear {
                clear(slot);
            }
            std::ptr::copy_nonoverlapping(values.as_ptr(), (*slot).tts_values, natts);
            std::ptr::copy_nonoverlapping(nulls.as_ptr(), (*slot).tts_isnull, natts);
            pg_sys::ExecStoreVirtualTuple(slot);
            pg_sys::simple_table_tuple_insert(self.relation, slot);
            let recheck = insert_index_entries(self.info, slot, self.estate);
            pg_sys::list_free(recheck);
            // Index tuples are formed in the per-tuple context: free them row by row.
            let econtext = (*self.estate).es_per_tuple_exprcontext;
            if !econtext.is_null() {
                pg_sys::MemoryContextReset((*econtext).ecxt_per_tuple_memory);
            }
            Ok(())
        }
    }
}

impl Drop for DirectInsert {
    fn drop(&mut self) {
        // After an ERROR the (sub)transaction's abort releases all of this; calling into
        // PostgreSQL while unwinding from one is not allowed.
        if std::thread::panicking() {
            return;
        }
        unsafe {
            pg_sys::ExecDropSingleTupleTableSlot(self.slot);
            pg_sys::ExecCloseIndices(self.info);
            pg_sys::FreeExecutorState(self.estate);
            pg_sys::table_close(self.relation, pg_sys::NoLock as pg_sys::LOCKMODE);
        }
    }
}

/// `ExecInsertIndexTuples`, whose signature differs by major version.
unsafe fn insert_index_entries(
    info: *mut pg_sys::ResultRelInfo,
    slot: *mut pg_sys::TupleTableSlot,
    estate: *mut pg_sys::EState,
) -> *mut pg_sys::List {
    let (no_conflict, no_arbiters) = (std::ptr::null_mut(), std::ptr::null_mut());
    unsafe {
        #[cfg(feature = "pg13")]
        {
            let _ = info;
            pg_sys::ExecInsertIndexTuples(slot, estate, false, no_conflict, no_arbiters)
        }
        #[cfg(any(feature = "pg14", feature = "pg15"))]
        {
            pg_sys::ExecInsertIndexTuples(
                info,
                slot,
                estate,
                false,
                false,
                no_conflict,
                no_arbiters,
            )
        }
        #[cfg(any(feature = "pg16", feature = "pg17", feature = "pg18"))]
        {
            pg_sys::ExecInsertIndexTuples(
                info,
                slot,
                estate,
                false,
                false,
                no_conflict,
                no_arbiters,
                false,
            )
        }
    }
}

/// Whether `relation` is a plain table with exactly `columns` and nothing a statement would run
/// on insert: no triggers, rules, CHECK constraints, generated columns or forced row security
/// (the extension's functions run as the owner, who is exempt from row security unless forced).
unsafe fn is_plain(relation: pg_sys::Relation, columns: &[(&CStr, pg_sys::Oid)]) -> bool {
    unsafe {
        let form = &*(*relation).rd_rel;
        if form.relkind != pg_sys::RELKIND_RELATION as std::ffi::c_char
            || !(*relation).trigdesc.is_null()
            || !(*relation).rd_rules.is_null()
            || (form.relrowsecurity && form.relforcerowsecurity)
        {
            return false;
        }
        let descriptor = (*relation).rd_att;
        let constraints = (*descriptor).constr;
        if !constraints.is_null()
            && ((*constraints).num_check > 0 || (*constraints).has_generated_stored)
        {
            return false;
        }
        let attributes = pgrx::PgTupleDesc::from_pg_unchecked(descriptor);
        attributes.len() == columns.len()
            && attributes
                .iter()
                .zip(columns)
                .all(|(attribute, (name, type_oid))| {
                    !attribute.attisdropped
                        && attribute.atttypid == *type_oid
                        && CStr::from_ptr(attribute.attname.data.as_ptr()) == *name
                })
    }
}
