//! The extension's own tables below SQL: opened by an OID cached per backend, and written by
//! direct inserts the way `COPY FROM` writes (heap insert + index insertion, no executor plan).
//!
//! Why: `append_commit` writes one row per change and one per scope-index entry. Through a
//! statement, each row also pays the executor (plan cache, node start-up, projections, the CTE
//! plumbing); those were the measured gap to a hand-written one-statement floor
//! (docs/BENCHMARKS.md). The rows here are the extension's own, validated in Rust, into tables
//! it created; [`DirectInsert::open`] refuses (and the caller falls back to SQL) whenever the
//! table is not exactly as created: other columns, triggers, rules, forced row security,
//! generated columns. So a DBA's audit trigger on `sync_changes` still fires. CHECK constraints
//! (the data model's own on `sync_reactions.status`, or one a DBA adds) are evaluated on every
//! row, as `COPY FROM` evaluates them (`ExecConstraints`). On Citus the rows go into the
//! partition's shard on this node (`citus::local_shard`), never into the empty shell under the
//! table's name, and only where Citus's own local execution would read them (docs/SCALING.md,
//! "How a call is routed"); where the shard is elsewhere, the caller's statement is routed to it.

use crate::error::{Error, Result};
use crate::jsonb::RawJsonb;
use crate::port;
use pgrx::pg_sys;
use pgrx::{FromDatum, IntoDatum};
use std::cell::{Cell, OnceCell};
use std::ffi::CStr;

/// Tables opened below SQL.
#[derive(Clone, Copy)]
pub enum SyncTable {
    WriterFence = 0,
    SchemaMeta = 1,
    Changes = 2,
    ChangeScopes = 3,
    Reactions = 4,
    Partitions = 5,
    PushResults = 6,
    SchemaStamp = 7,
    AppTables = 8,
    PushSchemas = 9,
    SchemaLayouts = 10,
    PartitionRegistry = 11,
    BackfillCheckpoints = 12,
    Commits = 13,
    Clients = 14,
    RowScopes = 15,
    Tombstones = 16,
}

const TABLES: usize = 17;

impl SyncTable {
    pub fn name(self) -> &'static CStr {
        match self {
            SyncTable::WriterFence => c"sync_writer_fence",
            SyncTable::SchemaMeta => c"sync_schema_meta",
            SyncTable::Changes => c"sync_changes",
            SyncTable::ChangeScopes => c"sync_change_scopes",
            SyncTable::Reactions => c"sync_reactions",
            SyncTable::Partitions => c"sync_partitions",
            SyncTable::PushResults => c"sync_push_results",
            SyncTable::SchemaStamp => c"sync_schema_stamp",
            SyncTable::AppTables => c"sync_app_tables",
            SyncTable::PushSchemas => c"sync_push_schemas",
            SyncTable::SchemaLayouts => c"sync_schema_layouts",
            SyncTable::PartitionRegistry => c"sync_partition_registry",
            SyncTable::BackfillCheckpoints => c"sync_backfill_checkpoints",
            SyncTable::Commits => c"sync_commits",
            SyncTable::Clients => c"sync_clients",
            SyncTable::RowScopes => c"sync_row_scopes",
            SyncTable::Tombstones => c"sync_tombstones",
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
    // SAFETY: the caller runs inside a transaction; a cached OID is opened with `try_table_open`
    // (NULL if it no longer exists) and checked to still name the table before it is used.
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

/// Where [`bigint_by_key`] found the row's relation.
pub enum Lookup<T = Option<i64>> {
    /// Read on this node: the column's value (the columns' values, for [`bigints_by_key`]),
    /// `None` when there is no such row; with the transaction that wrote the row version read
    /// (`FrozenTransactionId` once frozen; invalid without a row).
    Here(T, pg_sys::TransactionId),
    /// A Citus table whose shard for the key is on another node (docs/SCALING.md): read it
    /// through SQL.
    Elsewhere,
}

/// Reads the `bigint` column named `column` of the row whose primary key equals `key`, by a
/// direct scan of the primary-key index with `snapshot`. No SPI, no executor, no privilege
/// check: the fence lookup must not depend on the inserting role (docs/DESIGN.md §Writer fence)
/// and runs once per inserted commit row. The column is found by name in the open relation's
/// descriptor, so a column added or dropped by an update never shifts what is read. When Citus
/// manages the table (src/citus/mod.rs), the relation read is the shard on this node that holds
/// `distribution` (the key's value of a distributed table; `None` for a reference table), never
/// the empty shell under the table's name; [`Lookup::Elsewhere`] when that shard is on another
/// node.
///
/// # Safety
/// Must run inside a transaction; `key` is a datum of the primary key's type, compared with
/// the `equality` function under `collation`; `snapshot` is registered.
pub unsafe fn bigint_by_key(
    table: SyncTable,
    key: pg_sys::Datum,
    distribution: Option<&str>,
    equality: (u32, pg_sys::Oid),
    column: &CStr,
    snapshot: pg_sys::Snapshot,
) -> Result<Lookup> {
    // SAFETY: the caller's guarantees, passed on.
    let read = unsafe { bigints_by_key(table, key, distribution, equality, [column], snapshot) };
    Ok(match read? {
        Lookup::Here([value], writer) => Lookup::Here(value, writer),
        Lookup::Elsewhere => Lookup::Elsewhere,
    })
}

/// [`bigint_by_key`] for `N` columns of the row at once, in one index scan: each `None` when
/// the row is missing or the value null.
///
/// # Safety
/// As for [`bigint_by_key`].
pub unsafe fn bigints_by_key<const N: usize>(
    table: SyncTable,
    key: pg_sys::Datum,
    distribution: Option<&str>,
    equality: (u32, pg_sys::Oid),
    columns: [&CStr; N],
    snapshot: pg_sys::Snapshot,
) -> Result<Lookup<[Option<i64>; N]>> {
    // SAFETY: the caller's guarantees, passed on.
    unsafe {
        by_primary_key(table, distribution, &[(key, equality)], snapshot, |row| {
            let mut values = [None; N];
            if let Some(row) = row {
                for (value, column) in values.iter_mut().zip(columns) {
                    *value = row.bigint(column)?;
                }
            }
            Ok(values)
        })
    }
}

/// The key of a text primary-key column (every one `COLLATE "C"`), for [`by_primary_key`]: the
/// datum lives in the current memory context.
pub fn text_key(key: &str) -> (pg_sys::Datum, (u32, pg_sys::Oid)) {
    (
        key.into_datum().unwrap_or(pg_sys::Datum::null()),
        (pg_sys::F_TEXTEQ, pg_sys::C_COLLATION_OID),
    )
}

/// The key of the one row of the singleton tables (`sync_schema_meta`, `sync_schema_stamp`:
/// an `integer` primary key that is always 1), for [`by_primary_key`].
pub fn singleton_key() -> (pg_sys::Datum, (u32, pg_sys::Oid)) {
    (
        pg_sys::Datum::from(1i32),
        (pg_sys::F_INT4EQ, pg_sys::InvalidOid),
    )
}

/// The key of a `bigint` primary-key column, for [`by_primary_key`].
pub fn bigint_key(key: i64) -> (pg_sys::Datum, (u32, pg_sys::Oid)) {
    (
        pg_sys::Datum::from(key),
        (pg_sys::F_INT8EQ, pg_sys::InvalidOid),
    )
}

/// The `jsonb` column `column` of the row of `table` whose text primary key (every column
/// `COLLATE "C"`) equals `keys`, read as [`bigint_by_key`] reads (one index scan with
/// `snapshot`, the shard holding `distribution` on Citus): `None` when there is no such row or
/// the value is null. The value is copied out before the scan ends.
///
/// # Safety
/// Must run inside a transaction; `snapshot` is registered or active for the call.
pub unsafe fn jsonb_by_text_key<const N: usize>(
    table: SyncTable,
    keys: [&str; N],
    distribution: Option<&str>,
    column: &CStr,
    snapshot: pg_sys::Snapshot,
) -> Result<Lookup<Option<pgrx::JsonB>>> {
    let keys = keys.map(text_key);
    // SAFETY: the keys are text datums built above, alive to the end of the call.
    unsafe {
        by_primary_key(table, distribution, &keys, snapshot, |row| {
            row.map_or(Ok(None), |row| row.jsonb(column))
        })
    }
}

/// A column a [`Row`] is asked for: by name (`c"actor_id"` converts), looked up in the row's
/// relation for each read, or as [`Reader::column`] found it once for all the rows of a reader —
/// a window of a hundred changes reads seven columns of each, and finding each by name again was
/// a walk of the relation's descriptor per value (issue 28, docs/BENCHMARKS.md step 15).
#[derive(Clone, Copy)]
pub struct Column<'c> {
    name: &'c CStr,
    /// The relation it was found in, its number and its type: used for a row of that relation
    /// only (any other looks the name up).
    found: Option<(pg_sys::Relation, i16, pg_sys::Oid)>,
}

impl<'c> From<&'c CStr> for Column<'c> {
    fn from(name: &'c CStr) -> Self {
        Column { name, found: None }
    }
}

/// One row version a lookup found, lent to its reader for the length of the scan: its columns
/// are found by name in the relation's own descriptor and checked for their type before they
/// are read, so a column an update added or dropped never shifts what is read.
pub struct Row {
    table: SyncTable,
    relation: pg_sys::Relation,
    tuple: pg_sys::HeapTuple,
    /// The row's columns split out by its first read (`heap_deform_tuple`), for a table of at
    /// most [`DEFORMED`] columns: read one by one, every column after a variable-length one
    /// walks the tuple from its start again (`nocachegetattr`; the pull's commit window reads
    /// seven of each change row, docs/BENCHMARKS.md "Step 8").
    deformed: OnceCell<([pg_sys::Datum; DEFORMED], [bool; DEFORMED])>,
}

/// The widest of the extension's tables a [`Row`] splits out at once (`sync_changes` has 9
/// columns; dropped ones count too); a wider relation is read column by column.
const DEFORMED: usize = 16;

impl Row {
    fn new(table: SyncTable, relation: pg_sys::Relation, tuple: pg_sys::HeapTuple) -> Self {
        Self {
            table,
            relation,
            tuple,
            deformed: OnceCell::new(),
        }
    }

    /// The datum of the live column `column` whose type `accepts`: `None` when null; an internal
    /// error when the table has no such column (an install that is not as created).
    fn datum<'c>(
        &self,
        column: impl Into<Column<'c>>,
        accepts: impl Fn(pg_sys::Oid) -> bool,
    ) -> Result<Option<pg_sys::Datum>> {
        let column = column.into();
        // SAFETY: a `Row` is made only by [`scan`], with the relation it opened and the tuple its
        // scan returned, both alive while the reader holds the borrowed `Row`.
        unsafe {
            let descriptor = (*self.relation).rd_att;
            let attnum = match column.found {
                // Found by `Reader::column` in this row's relation, held open (and locked) since.
                Some((relation, attnum, type_id)) if relation == self.relation => {
                    accepts(type_id).then_some(attnum)
                }
                _ => crate::catalog::live_attribute(descriptor, column.name, accepts),
            };
            let Some(attnum) = attnum else {
                return Err(Error::Internal(format!(
                    "syncular: {:?} has no column {:?} of the type read",
                    self.table.name(),
                    column.name
                )));
            };
            if (*descriptor).natts as usize <= DEFORMED {
                let (values, nulls) = self.deformed.get_or_init(|| {
                    let mut values = [pg_sys::Datum::from(0); DEFORMED];
                    let mut nulls = [true; DEFORMED];
                    pg_sys::heap_deform_tuple(
                        self.tuple,
                        descriptor,
                        values.as_mut_ptr(),
                        nulls.as_mut_ptr(),
                    );
                    (values, nulls)
                });
                let i = attnum as usize - 1;
                return Ok((!nulls[i]).then_some(values[i]));
            }
            let mut is_null = false;
            let datum = pg_sys::heap_getattr(self.tuple, attnum.into(), descriptor, &mut is_null);
            Ok((!is_null).then_some(datum))
        }
    }

    /// A `bigint` column.
    pub fn bigint<'c>(&self, column: impl Into<Column<'c>>) -> Result<Option<i64>> {
        let datum = self.datum(column, |t| t == pg_sys::INT8OID)?;
        // SAFETY: a non-null int8 datum of the row (a pass-by-value type on 64-bit builds).
        Ok(datum.and_then(|d| unsafe { i64::from_datum(d, false) }))
    }

    /// An `oid`, `regclass` or `regrole` column.
    pub fn oid<'c>(&self, column: impl Into<Column<'c>>) -> Result<Option<pg_sys::Oid>> {
        let datum = self.datum(column, |t| {
            [pg_sys::OIDOID, pg_sys::REGCLASSOID, pg_sys::REGROLEOID].contains(&t)
        })?;
        // SAFETY: a non-null datum of an OID type, passed by value.
        Ok(datum.and_then(|d| unsafe { pg_sys::Oid::from_datum(d, false) }))
    }

    /// A `text` column, copied out (detoasted).
    pub fn text<'c>(&self, column: impl Into<Column<'c>>) -> Result<Option<String>> {
        let datum = self.datum(column, |t| t == pg_sys::TEXTOID)?;
        // SAFETY: a non-null text datum of the row, read while the row is.
        let text = datum.and_then(|d| unsafe { String::from_datum(d, false) });
        crate::alloc::check()?;
        Ok(text)
    }

    /// Whether a `text` column holds `expected`: its bytes compared where they lie, nothing
    /// copied out (the pull's window checks each change's table this way).
    pub fn text_is<'c>(&self, column: impl Into<Column<'c>>, expected: &str) -> Result<bool> {
        let Some(datum) = self.datum(column, |t| t == pg_sys::TEXTOID)? else {
            return Ok(false);
        };
        // SAFETY: a non-null text datum of the row, read while the row is; a text's varlena
        // data are its bytes. A copy detoasting made is freed here.
        unsafe {
            Ok(crate::alloc::detoasted(
                datum,
                pg_sys::pg_detoast_datum_packed,
                |plain| pgrx::varlena::varlena_to_byte_slice(plain) == expected.as_bytes(),
            ))
        }
    }

    /// A `boolean` column.
    pub fn boolean<'c>(&self, column: impl Into<Column<'c>>) -> Result<Option<bool>> {
        let datum = self.datum(column, |t| t == pg_sys::BOOLOID)?;
        // SAFETY: a non-null bool datum of the row, passed by value.
        Ok(datum.and_then(|d| unsafe { bool::from_datum(d, false) }))
    }

    /// An `integer` column.
    pub fn int4<'c>(&self, column: impl Into<Column<'c>>) -> Result<Option<i32>> {
        let datum = self.datum(column, |t| t == pg_sys::INT4OID)?;
        // SAFETY: a non-null int4 datum of the row, passed by value.
        Ok(datum.and_then(|d| unsafe { i32::from_datum(d, false) }))
    }

    /// A `smallint` column.
    pub fn int2<'c>(&self, column: impl Into<Column<'c>>) -> Result<Option<i16>> {
        let datum = self.datum(column, |t| t == pg_sys::INT2OID)?;
        // SAFETY: a non-null int2 datum of the row, passed by value.
        Ok(datum.and_then(|d| unsafe { i16::from_datum(d, false) }))
    }

    /// A `bytea` column, copied out (detoasted).
    pub fn bytes<'c>(&self, column: impl Into<Column<'c>>) -> Result<Option<Vec<u8>>> {
        let datum = self.datum(column, |t| t == pg_sys::BYTEAOID)?;
        // SAFETY: a non-null bytea datum of the row, copied while the row is read.
        let bytes = datum.and_then(|d| unsafe { Vec::<u8>::from_datum(d, false) });
        crate::alloc::check()?;
        Ok(bytes)
    }

    /// A `jsonb` column, as its value.
    pub fn jsonb<'c>(&self, column: impl Into<Column<'c>>) -> Result<Option<pgrx::JsonB>> {
        let datum = self.datum(column, |t| t == pg_sys::JSONBOID)?;
        // SAFETY: a non-null jsonb datum of the row, converted while the row is read.
        Ok(datum.and_then(|d| unsafe { pgrx::JsonB::from_datum(d, false) }))
    }

    /// A `jsonb` column, as its container's bytes (copied out; no text round trip).
    pub fn jsonb_bytes<'c>(
        &self,
        column: impl Into<Column<'c>>,
    ) -> Result<Option<crate::jsonb::OwnedJsonb>> {
        let datum = self.datum(column, |t| t == pg_sys::JSONBOID)?;
        // SAFETY: a non-null jsonb datum of the row; its bytes are copied before the row goes.
        let bytes = datum.and_then(|d| unsafe {
            crate::jsonb::OwnedJsonb::from_polymorphic_datum(d, false, pg_sys::JSONBOID)
        });
        crate::alloc::check()?;
        Ok(bytes)
    }
}

/// The lookups' one index scan: the row of `table` whose leading primary-key columns equal
/// `keys` (each a datum compared with its equality function under its collation), read with
/// `snapshot` by [`scan`] and handed to `read` (`None`: no such row), with the row version's
/// writer (`xmin`; invalid without a row).
///
/// # Safety
/// Must run inside a transaction; each key is a datum of its key column's type; `snapshot` is
/// registered or active.
pub unsafe fn by_primary_key<T>(
    table: SyncTable,
    distribution: Option<&str>,
    keys: &[(pg_sys::Datum, (u32, pg_sys::Oid))],
    snapshot: pg_sys::Snapshot,
    read: impl FnOnce(Option<&Row>) -> Result<T>,
) -> Result<Lookup<T>> {
    let mut read = Some(read);
    let mut result = None;
    let mut writer = pg_sys::InvalidTransactionId;
    // SAFETY: the caller's guarantees, passed on.
    let scanned = unsafe {
        scan(
            table,
            distribution,
            Keys::PrimaryKey(keys),
            snapshot,
            |row, xmin| {
                writer = xmin;
                if let Some(read) = read.take() {
                    result = Some(read(Some(row))?);
                }
                Ok(false)
            },
        )?
    };
    if !scanned {
        return Ok(Lookup::Elsewhere);
    }
    let read = match (result, read) {
        (Some(result), _) => result,
        (None, Some(read)) => read(None)?,
        (None, None) => unreachable!("the reader runs once, with the row or without"),
    };
    Ok(Lookup::Here(read, writer))
}

/// Every row of `table` whose columns equal the values `keys` name (each compared with its
/// equality function under its collation), handed to `each` in turn until it answers `false`:
/// through the index named `index` — which must be the table's and hold every key column —, or
/// without one through the whole table (for small tables with no index on the columns).
/// `false` when Citus keeps the table on another node (as [`Lookup::Elsewhere`]), and when an
/// index is named and the table has none of that name (on a Citus shard, none of that name with
/// the shard's suffix: [`index_of`]): read through SQL then.
///
/// # Safety
/// As for [`by_primary_key`]; each value is a datum of its column's type.
pub unsafe fn rows_where(
    table: SyncTable,
    index: Option<&CStr>,
    keys: &[(&CStr, pg_sys::Datum, (u32, pg_sys::Oid))],
    snapshot: pg_sys::Snapshot,
    mut each: impl FnMut(&Row) -> Result<bool>,
) -> Result<bool> {
    // SAFETY: the caller's guarantees, passed on.
    unsafe {
        scan(
            table,
            None,
            Keys::Columns(index, keys),
            snapshot,
            |row, _| each(row),
        )
    }
}

/// Opens `table` with `lock` — where Citus manages it, its shard on this node that holds
/// `distribution` (the key's value of a distributed table; `None` for a reference table), never
/// the empty shell under the table's name; `None` when that shard is on another node.
///
/// # Safety
/// Must run inside a transaction; the caller closes the relation (`table_close`).
unsafe fn open_here(
    table: SyncTable,
    distribution: Option<&str>,
    lock: pg_sys::LOCKMODE,
) -> Result<Option<pg_sys::Relation>> {
    // SAFETY: the caller's guarantees; a shard is a table of the same columns and primary key,
    // opened by the OID Citus's metadata names.
    unsafe {
        let relation = open(table, lock)?;
        if !crate::citus::manages((*relation).rd_id) {
            return Ok(Some(relation));
        }
        let shell = (*relation).rd_id;
        // The shell's lock is kept to the end of the transaction, as the statement through
        // Citus this read replaces would keep it: a `LOCK TABLE` of a distributed table — the
        // schema barrier's, `LOCK TABLE syncular.sync_partitions IN EXCLUSIVE MODE` (L0,
        // docs/DESIGN.md §Locks) — is propagated to every node's shell, never to the shards,
        // so a push holding only its shard's locks did not hold a migration off
        // (docs/SCALING.md, "The schema barrier across nodes").
        pg_sys::table_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
        crate::citus::require_preloaded()?;
        Ok(crate::citus::local_shard(shell, distribution)?
            .map(|shard| pg_sys::table_open(shard, lock)))
    }
}

/// Before a statement reads the OIDs `sync_app_tables` holds (`relation`, `registered_by`). On
/// Citus each node's copy of that reference table holds its own OIDs (Citus sends a `regclass`
/// or `regrole` value to the other nodes as its name), and a statement Citus sends over a
/// connection reads another node's copy: a relation or role of that number here is another one,
/// or none (red team 38, F1). So such a statement runs only where Citus's local execution reads
/// this node's copy, claimed here as for a read below SQL ([`open_here`]); refused (`SY004`,
/// reason `citus_local_execution`) where this node holds no copy or the transaction already
/// reached it over a connection. Nothing to do without Citus.
pub fn registry_read_here() -> Result<()> {
    let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
    // SAFETY: every caller runs inside a transaction (a function call); the relation is closed
    // at once.
    unsafe {
        match open_here(SyncTable::AppTables, None, lock)? {
            Some(relation) => {
                pg_sys::table_close(relation, lock);
                Ok(())
            }
            None => Err(crate::citus::not_this_nodes_copy("sync_app_tables")),
        }
    }
}

/// What [`scan`] looks for.
enum Keys<'a> {
    /// The leading columns of the primary key, through its index.
    PrimaryKey(&'a [(pg_sys::Datum, (u32, pg_sys::Oid))]),
    /// Columns by name, through the index of that name or the whole table ([`rows_where`]).
    Columns(
        Option<&'a CStr>,
        &'a [(&'a CStr, pg_sys::Datum, (u32, pg_sys::Oid))],
    ),
}

/// Opens `table` — where Citus manages it, its shard on this node that holds `distribution`
/// (the key's value of a distributed table; `None` for a reference table), never the empty
/// shell under the table's name; `false` when that shard is on another node —, scans it for the
/// rows `keys` name with `snapshot`, and hands each to `each` with its writer (`xmin`) until
/// `each` answers `false`. Everything is closed here, on error too.
///
/// # Safety
/// Must run inside a transaction; each key is a datum of its column's type; `snapshot` is
/// registered or active.
unsafe fn scan(
    table: SyncTable,
    distribution: Option<&str>,
    keys: Keys<'_>,
    snapshot: pg_sys::Snapshot,
    mut each: impl FnMut(&Row, pg_sys::TransactionId) -> Result<bool>,
) -> Result<bool> {
    let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
    // SAFETY: the relation is opened and closed here; the scan keys, scan and tuples follow
    // genam.h's systable protocol under the caller's snapshot. A shard is a table of the same
    // columns and primary key, opened by the OID Citus's metadata names.
    unsafe {
        let Some(relation) = open_here(table, distribution, lock)? else {
            return Ok(false);
        };
        let fail = |relation, message: String| {
            pg_sys::table_close(relation, lock);
            Err(Error::Internal(format!(
                "syncular: {:?} {message}",
                table.name()
            )))
        };
        let (index_id, mut scan_keys) = match keys {
            Keys::PrimaryKey(keys) => {
                let Some((index_id, columns)) = crate::catalog::primary_key_columns(relation)
                else {
                    return fail(relation, "has no primary key".into());
                };
                if columns.len() < keys.len() {
                    return fail(
                        relation,
                        "has a primary key of fewer columns than the lookup".into(),
                    );
                }
                (index_id, primary_key_scan(&columns, keys, None))
            }
            Keys::Columns(index, keys) => {
                let mut scan_keys = Vec::with_capacity(keys.len());
                let mut attnums = Vec::with_capacity(keys.len());
                for &(column, value, equality) in keys {
                    let Some(attnum) =
                        crate::catalog::live_attribute((*relation).rd_att, column, |_| true)
                    else {
                        return fail(relation, format!("has no column {column:?}"));
                    };
                    attnums.push(attnum);
                    scan_keys.push(crate::catalog::equality_key(attnum, equality, value));
                }
                let index_id = match index {
                    None => pg_sys::InvalidOid,
                    Some(name) => match index_of(relation, name, &attnums, lock) {
                        Some(index_id) => index_id,
                        None => {
                            pg_sys::table_close(relation, lock);
                            return Ok(false);
                        }
                    },
                };
                (index_id, scan_keys)
            }
        };
        let scan = pg_sys::systable_beginscan(
            relation,
            index_id,
            index_id != pg_sys::InvalidOid,
            snapshot,
            scan_keys.len() as i32,
            scan_keys.as_mut_ptr(),
        );
        let mut outcome = Ok(true);
        loop {
            crate::interrupts::check();
            let tuple = pg_sys::systable_getnext(scan);
            if tuple.is_null() {
                break;
            }
            let writer = port::heap_tuple_header_get_xmin((*tuple).t_data);
            let row = Row::new(table, relation, tuple);
            match each(&row, writer) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    outcome = Err(e);
                    break;
                }
            }
        }
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(relation, lock);
        outcome
    }
}

/// The scan keys of `keys` on the leading columns `columns` of a primary key — and, with
/// `range`, of the `bigint` column after them in `(after, through]`.
///
/// # Safety
/// Each key is a datum of its column's type, alive while the keys are used; with `range`,
/// `columns` has a column after the keyed ones.
unsafe fn primary_key_scan(
    columns: &[i16],
    keys: &[(pg_sys::Datum, (u32, pg_sys::Oid))],
    range: Option<(i64, i64)>,
) -> Vec<pg_sys::ScanKeyData> {
    // SAFETY: the caller's guarantees, passed on.
    unsafe {
        let mut scan_keys: Vec<pg_sys::ScanKeyData> = keys
            .iter()
            .zip(columns)
            .map(|(&(key, equality), &column)| crate::catalog::equality_key(column, equality, key))
            .collect();
        if let Some((after, through)) = range {
            let column = columns[keys.len()];
            for (strategy, procedure, bound) in [
                (pg_sys::BTGreaterStrategyNumber, pg_sys::F_INT8GT, after),
                (pg_sys::BTLessEqualStrategyNumber, pg_sys::F_INT8LE, through),
            ] {
                scan_keys.push(crate::catalog::comparison_key(
                    column,
                    strategy,
                    (procedure, pg_sys::InvalidOid),
                    pg_sys::Datum::from(bound),
                ));
            }
        }
        scan_keys
    }
}

/// One of the extension's tables held open with one index — its primary key, or one named —
/// for the scans of one read below SQL (the pull's commit window: a scan per scope value, and a
/// lookup of a commit and its changes per candidate; opening the table and index for each would
/// cost as much as the lookups). Made by [`with_reader`] or [`with_reader_on`], which close it.
pub struct Reader {
    table: SyncTable,
    relation: pg_sys::Relation,
    index: pg_sys::Relation,
    columns: Vec<i16>,
}

/// Opens `table` as [`scan`] does — on Citus, its shard on this node that holds `distribution`
/// — with its primary-key index, and hands it to `read`; `None` (without calling `read`) when
/// Citus keeps that shard on another node. Both are closed here, after `read`, whatever it
/// returned; `read` ends every [`Scan`] it began ([`Scan::end`]).
///
/// # Safety
/// Must run inside a transaction.
pub unsafe fn with_reader<T>(
    table: SyncTable,
    distribution: Option<&str>,
    read: impl FnOnce(&Reader) -> Result<T>,
) -> Result<Option<T>> {
    // SAFETY: the caller's guarantees, passed on.
    unsafe { with_reader_on(table, distribution, None, |reader, _| read(reader)) }
}

/// [`with_reader`] through the index named `index.0` when the table has it as created — valid,
/// whole (no predicate), its key led by the columns `index.1` (a Citus shard's indexes carry
/// the shard's suffix: not found there) —, else through the primary key; `read` is told which
/// (`true`: the named index).
///
/// # Safety
/// Must run inside a transaction.
pub unsafe fn with_reader_on<T>(
    table: SyncTable,
    distribution: Option<&str>,
    index: Option<(&CStr, &[&CStr])>,
    read: impl FnOnce(&Reader, bool) -> Result<T>,
) -> Result<Option<T>> {
    let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
    // SAFETY: the relation and its index are opened and closed here, under one lock mode; a
    // shard is a table of the same columns and primary key, opened by the OID Citus names.
    unsafe {
        let Some(relation) = open_here(table, distribution, lock)? else {
            return Ok(None);
        };
        let named = index.and_then(|(name, leading)| index_led_by(relation, name, leading, lock));
        let by_name = named.is_some();
        let Some((index_id, columns)) =
            named.or_else(|| crate::catalog::primary_key_columns(relation))
        else {
            pg_sys::table_close(relation, lock);
            return Err(Error::Internal(format!(
                "syncular: {:?} has no primary key",
                table.name()
            )));
        };
        let index = pg_sys::index_open(index_id, lock);
        let reader = Reader {
            table,
            relation,
            index,
            columns,
        };
        let out = read(&reader, by_name);
        pg_sys::index_close(index, lock);
        pg_sys::table_close(relation, lock);
        out.map(Some)
    }
}

/// The index named `name` in `relation`'s schema with its key columns, when it is a valid,
/// whole (no predicate) index of `relation` whose key begins with the columns `leading`.
///
/// # Safety
/// `relation` is open; `lock` is held on it.
unsafe fn index_led_by(
    relation: pg_sys::Relation,
    name: &CStr,
    leading: &[&CStr],
    lock: pg_sys::LOCKMODE,
) -> Option<(pg_sys::Oid, Vec<i16>)> {
    // SAFETY: a catalog lookup by name; the index is opened and closed here, under the lock its
    // table is held with; its key columns are read from its `pg_index` form.
    unsafe {
        let descriptor = (*relation).rd_att;
        let mut attnums = Vec::with_capacity(leading.len());
        for column in leading {
            attnums.push(crate::catalog::live_attribute(descriptor, column, |_| {
                true
            })?);
        }
        let index_id = pg_sys::get_relname_relid(name.as_ptr(), (*(*relation).rd_rel).relnamespace);
        if index_id == pg_sys::InvalidOid
            || pg_sys::get_rel_relkind(index_id) != pg_sys::RELKIND_INDEX as std::ffi::c_char
        {
            return None;
        }
        let index = pg_sys::index_open(index_id, lock);
        let form = &*(*index).rd_index;
        let keys = form
            .indkey
            .values
            .as_slice(form.indkey.dim1.max(0) as usize)
            .iter()
            .take(form.indnkeyatts.max(0) as usize)
            .copied()
            .collect::<Vec<i16>>();
        let fits = form.indrelid == (*relation).rd_id
            && form.indisvalid
            && pg_sys::RelationGetIndexPredicate(index).is_null()
            && keys.starts_with(&attnums);
        pg_sys::index_close(index, lock);
        fits.then_some((index_id, keys))
    }
}

impl Reader {
    /// Begins a scan of the rows whose leading key columns of the reader's index (the primary
    /// key, or the index [`with_reader_on`] named) equal `keys` (and, with
    /// `range`, whose next one — a `bigint` — is in `(after, through]`), in the index's order,
    /// with `snapshot`. The caller ends it ([`Scan::end`]).
    ///
    /// # Safety
    /// Each key is a datum of its column's type, alive until the scan ends; `snapshot` is
    /// registered or active until then.
    pub unsafe fn scan(
        &self,
        keys: &[(pg_sys::Datum, (u32, pg_sys::Oid))],
        range: Option<(i64, i64)>,
        snapshot: pg_sys::Snapshot,
    ) -> Result<Scan<'_>> {
        if self.columns.len() < keys.len() + usize::from(range.is_some()) {
            return Err(Error::Internal(format!(
                "syncular: {:?} has a primary key of fewer columns than the lookup",
                self.table.name()
            )));
        }
        // SAFETY: the caller's guarantees; the relation and index are open while `self` is.
        // An ordered scan copies its keys (index_rescan) and hands rows over in index order.
        unsafe {
            let mut scan_keys = primary_key_scan(&self.columns, keys, range);
            let scan = pg_sys::systable_beginscan_ordered(
                self.relation,
                self.index,
                snapshot,
                scan_keys.len() as i32,
                scan_keys.as_mut_ptr(),
            );
            Ok(Scan { reader: self, scan })
        }
    }

    /// The live column `name` of the reader's relation, found once for the rows its scans
    /// return (a [`Row`] checks the type it reads it as, as for a name); an internal error when
    /// the relation has no such column (an install that is not as created). It lives no longer
    /// than the reader, which holds the relation open and locked: its descriptor stays as found.
    pub fn column<'c>(&'c self, name: &'c CStr) -> Result<Column<'c>> {
        // SAFETY: the relation is open while `self` is; its descriptor is the one the rows its
        // scans return are read with, and the attribute numbered is one of its own.
        let found = unsafe {
            let descriptor = (*self.relation).rd_att;
            crate::catalog::live_attribute(descriptor, name, |_| true).map(|attnum| {
                let attributes = pgrx::PgTupleDesc::from_pg_unchecked(descriptor);
                let type_id = attributes
                    .get(attnum as usize - 1)
                    .map_or(pg_sys::InvalidOid, |a| a.atttypid);
                (self.relation, attnum, type_id)
            })
        };
        match found {
            Some(found) => Ok(Column {
                name,
                found: Some(found),
            }),
            None => Err(Error::Internal(format!(
                "syncular: {:?} has no column {name:?}",
                self.table.name()
            ))),
        }
    }

    /// What `read` makes of the first row [`Reader::scan`] finds for `keys` (`None` without
    /// one).
    ///
    /// # Safety
    /// As for [`Reader::scan`].
    pub unsafe fn first<T>(
        &self,
        keys: &[(pg_sys::Datum, (u32, pg_sys::Oid))],
        snapshot: pg_sys::Snapshot,
        read: impl FnOnce(&Row) -> Result<T>,
    ) -> Result<Option<T>> {
        // SAFETY: the caller's guarantees, passed on; the scan ends here.
        unsafe {
            let mut scan = self.scan(keys, None, snapshot)?;
            let found = scan.next(read);
            scan.end();
            found
        }
    }
}

/// A scan [`Reader::scan`] began.
pub struct Scan<'r> {
    reader: &'r Reader,
    scan: pg_sys::SysScanDesc,
}

impl Scan<'_> {
    /// What `read` makes of the next row (`None` at the end), read while the scan holds it.
    pub fn next<T>(&mut self, read: impl FnOnce(&Row) -> Result<T>) -> Result<Option<T>> {
        crate::interrupts::check();
        // SAFETY: a scan begun by `Reader::scan` and not yet ended (`end` consumes it); the
        // tuple returned stays valid until the next call on the scan, after `read`.
        unsafe {
            let tuple = pg_sys::systable_getnext_ordered(
                self.scan,
                pg_sys::ScanDirection::ForwardScanDirection,
            );
            if tuple.is_null() {
                return Ok(None);
            }
            let row = Row::new(self.reader.table, self.reader.relation, tuple);
            read(&row).map(Some)
        }
    }

    /// Ends the scan.
    pub fn end(self) {
        // SAFETY: the scan was begun by `Reader::scan`, and is ended once (`self` is consumed).
        unsafe { pg_sys::systable_endscan_ordered(self.scan) }
    }
}

/// The index named `name` in `relation`'s schema — or, on a Citus shard, Citus's copy of it,
/// named `name` and the shard's suffix (`_` and its shard id, as the shard is named after its
/// table) — when it is an index of `relation` holding every column of `attnums` (what
/// `systable_beginscan` needs to map the keys onto it).
///
/// # Safety
/// `relation` is open; `lock` is held on it.
unsafe fn index_of(
    relation: pg_sys::Relation,
    name: &CStr,
    attnums: &[i16],
    lock: pg_sys::LOCKMODE,
) -> Option<pg_sys::Oid> {
    // SAFETY: catalog lookups by name and OID; an index of `relation` is opened and closed here,
    // under the lock its table is held with.
    unsafe {
        let fits = |index_id: pg_sys::Oid| {
            if index_id == pg_sys::InvalidOid
                || pg_sys::get_rel_relkind(index_id) != pg_sys::RELKIND_INDEX as std::ffi::c_char
                // Another table's (a Citus shell's, whose index has the unsuffixed name) is
                // never opened.
                || pg_sys::IndexGetRelation(index_id, true) != (*relation).rd_id
            {
                return false;
            }
            let index = pg_sys::index_open(index_id, lock);
            let form = &*(*index).rd_index;
            let columns = form
                .indkey
                .values
                .as_slice(form.indkey.dim1.max(0) as usize);
            let fits = form.indisvalid && attnums.iter().all(|a| columns.contains(a));
            pg_sys::index_close(index, lock);
            fits
        };
        let namespace = (*(*relation).rd_rel).relnamespace;
        let named = pg_sys::get_relname_relid(name.as_ptr(), namespace);
        if fits(named) {
            return Some(named);
        }
        let suffixed = shard_suffixed(relation, name)?;
        let named = pg_sys::get_relname_relid(suffixed.as_ptr(), namespace);
        fits(named).then_some(named)
    }
}

/// `name` with the suffix of the Citus shard `relation` is — `_` and digits ending its name
/// (`sync_backfill_checkpoints_102040`: the shard id Citus appends to every name of a shard's
/// objects) — or `None` where `relation` is no such shard or the name would not fit. Only the
/// name: [`index_of`] still requires an index of `relation` itself, on the key's columns.
///
/// # Safety
/// `relation` is open.
unsafe fn shard_suffixed(relation: pg_sys::Relation, name: &CStr) -> Option<std::ffi::CString> {
    // SAFETY: the open relation's name, copied before use.
    let relname = unsafe { CStr::from_ptr((*(*relation).rd_rel).relname.data.as_ptr()) };
    let relname = relname.to_str().ok()?;
    let (_, digits) = relname.rsplit_once('_')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !crate::citus::installed() {
        return None;
    }
    let suffixed = format!("{}_{digits}", name.to_str().ok()?);
    if suffixed.len() >= pg_sys::NAMEDATALEN as usize {
        return None;
    }
    std::ffi::CString::new(suffixed).ok()
}

/// The snapshot a lookup below SQL reads with, registered for the length of `read`: the one the
/// statement it replaces read with (`src/db.rs`). `fresh` — [`crate::db::write`]'s, after a lock
/// wait — is a new one, as a statement's under READ COMMITTED (the transaction's otherwise),
/// taken after the command counter moved past this transaction's own earlier writes, as a
/// statement's would be. Otherwise [`crate::db::read`]'s: pgrx runs a read through SPI
/// read-only, in the calling statement's active snapshot, only while the current transaction has
/// no id (`Spi::is_xact_still_immutable`); once it has written, a read takes a fresh snapshot
/// too, and sees those writes.
pub fn with_snapshot<T>(
    fresh: bool,
    read: impl FnOnce(pg_sys::Snapshot) -> Result<T>,
) -> Result<T> {
    // SAFETY: inside a transaction (every caller is a function call); the snapshot is
    // registered around `read` and unregistered after it, on error too.
    unsafe {
        let written = pg_sys::GetCurrentTransactionIdIfAny() != pg_sys::InvalidTransactionId;
        let snapshot = if fresh || written || !pg_sys::ActiveSnapshotSet() {
            pg_sys::CommandCounterIncrement();
            pg_sys::GetTransactionSnapshot()
        } else {
            pg_sys::GetActiveSnapshot()
        };
        let snapshot = pg_sys::RegisterSnapshot(snapshot);
        let read = read(snapshot);
        pg_sys::UnregisterSnapshot(snapshot);
        read
    }
}

/// Whether the transaction runs in READ COMMITTED (`XactIsoLevel`), where a statement takes a
/// fresh snapshot and `ON CONFLICT` waits for a conflicting row and then skips or locks it — what
/// the writes below SQL do; elsewhere the statement's own behaviour (40001 on a row its snapshot
/// cannot see) is needed, and callers run the statement or refuse.
pub fn read_committed() -> bool {
    // SAFETY: reads a backend global of the current transaction.
    unsafe { pg_sys::XactIsoLevel == pg_sys::XACT_READ_COMMITTED as i32 }
}

/// Which other transactions' rows a snapshot sees: its `xmax` and the transactions it takes for
/// running (`xip`, `subxip`, sorted; never of a snapshot taken beside an overflowed
/// subtransaction cache, whose `subxip` is not kept: [`seen_by`]). Two MVCC snapshots with the
/// same see the same rows of every transaction but the reader's own, whatever their age: a
/// transaction below `xmax` and not listed had ended before either was taken. Lets a re-read
/// "with a fresh snapshot" after a lock be skipped when no other transaction ended since the
/// first read (docs/BENCHMARKS.md, issue 28 step 9; `src/push/one_call.rs`).
#[derive(PartialEq, Eq, Debug)]
pub struct Seen {
    xmax: u32,
    xip: Vec<u32>,
    subxip: Vec<u32>,
}

/// Whether this transaction has written nothing yet, in any of its subtransactions (no
/// transaction id at its top). A fingerprint ([`Seen`]) says nothing of the reader's own writes:
/// an earlier read's is worth keeping only while there are none, as one made before that read
/// may be invisible to the snapshot it read with — an older cursor's, read in a savepoint that
/// has no id of its own (red team 40, F1).
pub fn nothing_written_yet() -> bool {
    // SAFETY: reads the current transaction's state.
    unsafe { pg_sys::GetTopTransactionIdIfAny() == pg_sys::InvalidTransactionId }
}

/// Beyond this many running transactions a snapshot is not fingerprinted: the copy and the
/// comparison would cost what the lookup they save does.
const SEEN_MOST: usize = 64;

/// What `snapshot` sees ([`Seen`]), or `None` for a snapshot that is not an MVCC one, lists
/// more than [`SEEN_MOST`] running transactions, or was taken beside an overflowed
/// subtransaction cache (its copy keeps no subtransaction ids).
///
/// # Safety
/// `snapshot` is a valid, registered or active snapshot.
pub unsafe fn seen_by(snapshot: pg_sys::Snapshot) -> Option<Seen> {
    // SAFETY: the caller's promise; `xip` and `subxip` hold `xcnt` and `subxcnt` entries.
    unsafe {
        let snap = &*snapshot;
        let (xcnt, subxcnt) = (
            usize::try_from(snap.xcnt).ok()?,
            usize::try_from(snap.subxcnt).ok()?,
        );
        // An overflowed subtransaction cache: a registered copy keeps `subxcnt` but no `subxip`
        // array (snapmgr.c `CopySnapshot` leaves it NULL), and reading NULL as `subxcnt` ids
        // aborted the backend ("unsafe precondition(s) violated: slice::from_raw_parts", a
        // panic that cannot unwind: the abort seen in sessions 25 and 27, under sessions with
        // over 64 subtransactions). No fingerprint then: the caller reads again.
        if snap.snapshot_type != pg_sys::SnapshotType::SNAPSHOT_MVCC
            || snap.takenDuringRecovery
            || snap.suboverflowed
            || xcnt + subxcnt > SEEN_MOST
            || (xcnt > 0 && snap.xip.is_null())
            || (subxcnt > 0 && snap.subxip.is_null())
        {
            return None;
        }
        let sorted = |ids: *const pg_sys::TransactionId, n: usize| {
            let mut ids: Vec<u32> = if n == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(ids, n)
                    .iter()
                    .map(|id| id.into_inner())
                    .collect()
            };
            ids.sort_unstable();
            ids
        };
        Some(Seen {
            xmax: snap.xmax.into_inner(),
            xip: sorted(snap.xip, xcnt),
            subxip: sorted(snap.subxip, subxcnt),
        })
    }
}

/// The widest table inserted directly (`sync_reactions` has 17 columns).
const MAX_COLUMNS: usize = 20;

const ROW_EXCLUSIVE: pg_sys::LOCKMODE = pg_sys::RowExclusiveLock as pg_sys::LOCKMODE;

/// Rows inserted into one table without a statement: heap insert, then every index (unique ones
/// checked), as `COPY FROM` and logical replication's apply do. WAL, statistics and visibility
/// are the heap's own; nothing else runs, which is why [`DirectInsert::open`] checks that
/// nothing else is defined on the table.
pub struct DirectInsert {
    table: SyncTable,
    relation: pg_sys::Relation,
    /// The columns the table was checked to have, in order: every row is checked against them.
    columns: &'static [(&'static CStr, pg_sys::Oid)],
    info: *mut pg_sys::ResultRelInfo,
    estate: *mut pg_sys::EState,
    slot: *mut pg_sys::TupleTableSlot,
    /// The table has CHECK constraints: every row is checked before it is written.
    checks: bool,
    /// The one trigger the table has, run natively before each row ([`NativeTrigger`]).
    before: Option<NativeTrigger>,
}

/// A `BEFORE INSERT FOR EACH ROW` trigger of the extension's own that
/// [`DirectInsert::open_with_trigger`] accepts as a table's only trigger and runs natively for
/// each row instead: the writer fence on `sync_commits` (src/log.rs). Accepted only when the
/// trigger would fire now, has no `WHEN` condition, and its function is this library's C
/// function `symbol` ([`crate::catalog::is_native_function`]): then running `run` is what the
/// trigger would do.
#[derive(Clone, Copy)]
pub struct NativeTrigger {
    /// The link symbol of the trigger function in this library.
    pub symbol: &'static CStr,
    /// What the trigger checks for the row (`row` in the columns' order); an error refuses it.
    pub run: fn(&[Option<Value<'_>>]) -> Result<()>,
}

/// One value of a directly inserted row, typed, so that [`DirectInsert::insert`] can check it
/// against the column it goes into: a datum of the wrong type would be written as is.
#[derive(Clone, Copy)]
pub enum Value<'a> {
    Text(&'a str),
    Int2(i16),
    Int4(i32),
    Int8(i64),
    Jsonb(RawJsonb<'a>),
    Bytea(&'a [u8]),
    Bool(bool),
}

impl Value<'_> {
    fn type_oid(self) -> pg_sys::Oid {
        match self {
            Value::Text(_) => pg_sys::TEXTOID,
            Value::Int2(_) => pg_sys::INT2OID,
            Value::Int4(_) => pg_sys::INT4OID,
            Value::Int8(_) => pg_sys::INT8OID,
            Value::Jsonb(_) => pg_sys::JSONBOID,
            Value::Bytea(_) => pg_sys::BYTEAOID,
            Value::Bool(_) => pg_sys::BOOLOID,
        }
    }

    /// The datum (by value, or copied into the current memory context).
    fn datum(self) -> Option<pg_sys::Datum> {
        match self {
            Value::Text(v) => v.into_datum(),
            Value::Int2(v) => v.into_datum(),
            Value::Int4(v) => v.into_datum(),
            Value::Int8(v) => v.into_datum(),
            Value::Jsonb(v) => v.into_datum(),
            Value::Bytea(v) => v.into_datum(),
            Value::Bool(v) => v.into_datum(),
        }
    }
}

impl DirectInsert {
    /// Opens `table` for direct inserts of rows with exactly `columns` (name, type), or `None`
    /// when the table has anything a statement would have to run or check (see the module
    /// comment), or the transaction is read-only: a heap insert does not check that, the
    /// statement refuses it (25006), so the caller's statement does the refusing.
    ///
    /// The rows all belong to `partition`: where Citus distributes `table` by it, the shard that
    /// holds it on this node is written (a call delegated to the partition's worker writes
    /// there, in its own transaction, as one node does: docs/SCALING.md), and `None` where that
    /// shard is elsewhere (the statement is routed to it).
    pub fn open(
        table: SyncTable,
        partition: &str,
        columns: &'static [(&'static CStr, pg_sys::Oid)],
    ) -> Result<Option<Self>> {
        Self::open_with_trigger(table, partition, columns, None)
    }

    /// [`DirectInsert::open`] for a table whose only trigger is `trigger` (and which must have
    /// it, firing: otherwise `None`, and the caller's statement writes, firing what is there).
    pub fn open_with_trigger(
        table: SyncTable,
        partition: &str,
        columns: &'static [(&'static CStr, pg_sys::Oid)],
        trigger: Option<NativeTrigger>,
    ) -> Result<Option<Self>> {
        Self::open_with(table, partition, columns, trigger, false)
    }

    /// [`DirectInsert::open`] for [`DirectInsert::insert_unless_conflict`]: the unique indexes'
    /// conflict checks are prepared too. `None` outside READ COMMITTED ([`read_committed`]):
    /// there the statement raises 40001 on a conflicting row its snapshot cannot see, which the
    /// direct insert would not.
    pub fn open_for_conflicts(
        table: SyncTable,
        partition: &str,
        columns: &'static [(&'static CStr, pg_sys::Oid)],
    ) -> Result<Option<Self>> {
        if !read_committed() {
            return Ok(None);
        }
        Self::open_with(table, partition, columns, None, true)
    }

    /// [`DirectInsert::open_for_conflicts`] for [`DirectInsert::upsert`], whose conflict target
    /// is the primary key: `None` where the table is not a heap, has another unique index or an
    /// exclusion constraint (a conflict on it would be taken for the key's; the statement raises
    /// 23505 on it), or its primary key is deferrable. Raises what the statement raises where the
    /// table may not be updated for want of a replica identity (55000: a publication of its
    /// updates).
    pub fn open_for_upsert(
        table: SyncTable,
        partition: &str,
        columns: &'static [(&'static CStr, pg_sys::Oid)],
    ) -> Result<Option<Self>> {
        let Some(direct) = Self::open_for_conflicts(table, partition, columns)? else {
            return Ok(None);
        };
        // SAFETY: the relation and the result relation info `open_with` made, its indexes opened
        // (`ExecOpenIndices`): `ri_NumIndices` open index relations with their `pg_index` forms.
        unsafe {
            // A heap: its row lock and update are what `upsert` calls.
            if (*(*direct.relation).rd_rel).relam != pg_sys::HEAP_TABLE_AM_OID {
                return Ok(None);
            }
            let info = &*direct.info;
            let indexes = (0..info.ri_NumIndices.max(0) as usize)
                .map(|i| &*(**info.ri_IndexRelationDescs.add(i)).rd_index);
            let mut arbiters = indexes.filter(|form| form.indisunique || form.indisexclusion);
            let only_the_key = matches!(
                (arbiters.next(), arbiters.next()),
                (Some(form), None) if form.indisprimary && form.indimmediate
            );
            if !only_the_key {
                return Ok(None);
            }
            // The statement's check for `ON CONFLICT DO UPDATE` (PostgreSQL 15.14 and later).
            pg_sys::CheckCmdReplicaIdentity(direct.relation, pg_sys::CmdType::CMD_UPDATE);
        }
        Ok(Some(direct))
    }

    fn open_with(
        table: SyncTable,
        partition: &str,
        columns: &'static [(&'static CStr, pg_sys::Oid)],
        trigger: Option<NativeTrigger>,
        speculative: bool,
    ) -> Result<Option<Self>> {
        // SAFETY: `open` returns a locked relation; the result relation info, executor state and
        // slot are made for it as `CopyFrom` makes them, and are released in `drop` (or by the
        // transaction's abort after an error).
        unsafe {
            if pg_sys::XactReadOnly {
                return Ok(None);
            }
            let Some(relation) = open_here(table, Some(partition), ROW_EXCLUSIVE)? else {
                return Ok(None);
            };
            if !is_plain(relation, columns, trigger) {
                // Keep the lock: the statement that writes instead takes it anyway.
                pg_sys::table_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
                return Ok(None);
            }
            let estate = pg_sys::CreateExecutorState();
            let info = pg_sys::palloc0(std::mem::size_of::<pg_sys::ResultRelInfo>())
                as *mut pg_sys::ResultRelInfo;
            (*info).type_ = pg_sys::NodeTag::T_ResultRelInfo;
            // Range table index 0: the relation is in no range table (there is no statement),
            // which is what the executor's error path checks before looking one up — a CHECK
            // violation describes the failing row with the inserted columns, and
            // `ExecGetInsertedCols` answers "none" for index 0 (the row is then shown as the
            // owner may read it, as the statement shows it).
            pg_sys::InitResultRelInfo(info, relation, 0, std::ptr::null_mut(), 0);
            pg_sys::ExecOpenIndices(info, speculative);
            let slot = pg_sys::MakeSingleTupleTableSlot((*relation).rd_att, &pg_sys::TTSOpsVirtual);
            let constraints = (*(*relation).rd_att).constr;
            let checks = !constraints.is_null() && (*constraints).num_check > 0;
            Ok(Some(DirectInsert {
                table,
                relation,
                columns,
                info,
                estate,
                slot,
                checks,
                before: trigger,
            }))
        }
    }

    /// Inserts one row: `row[i]` (NULL where `None`) into the `i`-th column given to
    /// [`DirectInsert::open`]. A row of another length or a value of another type than its column
    /// is refused (an internal error); a NULL in a NOT NULL column is refused as the executor
    /// refuses it (23502), though callers never pass one.
    pub fn insert(&mut self, row: &[Option<Value<'_>>]) -> Result<()> {
        self.prepare(row)?;
        // SAFETY: `prepare` stored a well-formed row of the relation in the slot; the slot,
        // estate and index info were made for this relation by `open` and live until `drop`.
        unsafe {
            pg_sys::simple_table_tuple_insert(self.relation, self.slot);
            let recheck = port::exec_insert_index_tuples(self.info, self.slot, self.estate);
            pg_sys::list_free(recheck);
            self.reset_per_tuple();
        }
        Ok(())
    }

    /// Inserts one row as [`DirectInsert::insert`] does, unless it conflicts with a row on one of
    /// the table's unique indexes — `INSERT … ON CONFLICT DO NOTHING` in READ COMMITTED, done as
    /// the executor does it (`ExecInsert`): a pre-check of every unique index that waits for a
    /// conflicting row still being inserted by another transaction, then a speculative heap
    /// insert whose index entries are inserted without raising on a duplicate, confirmed when
    /// none turned up or killed (and checked again) when one did. `false`, nothing written, when
    /// a conflicting row stands. Opened by [`DirectInsert::open_for_conflicts`]; the caller runs
    /// it only in READ COMMITTED (elsewhere the statement raises 40001 on a conflicting row its
    /// snapshot cannot see).
    pub fn insert_unless_conflict(&mut self, row: &[Option<Value<'_>>]) -> Result<bool> {
        self.prepare(row)?;
        Ok(self.insert_or_conflict()?.is_none())
    }

    /// [`DirectInsert::insert_unless_conflict`] of the row [`DirectInsert::prepare`] stored in
    /// the slot: `None` when it was inserted, else the location of the conflicting row version.
    fn insert_or_conflict(&mut self) -> Result<Option<pg_sys::ItemPointerData>> {
        // SAFETY: as in `insert`; the index info was opened for speculative insertion
        // (`open_for_conflicts`), and the table AM's speculative insert and completion are called
        // in `ExecInsert`'s order under the speculative-insertion lock of this transaction.
        unsafe {
            let am = (*self.relation).rd_tableam;
            let (Some(insert), Some(complete)) = (
                (*am).tuple_insert_speculative,
                (*am).tuple_complete_speculative,
            ) else {
                return Err(Error::Internal(
                    "direct insert: the table has no speculative insertion".into(),
                ));
            };
            loop {
                crate::interrupts::check();
                let mut conflict = pg_sys::ItemPointerData::default();
                if !port::exec_check_index_constraints(
                    self.info,
                    self.slot,
                    self.estate,
                    &mut conflict,
                ) {
                    self.reset_per_tuple();
                    return Ok(Some(conflict));
                }
                let xid = pg_sys::GetCurrentTransactionId();
                let token = pg_sys::SpeculativeInsertionLockAcquire(xid);
                let command = pg_sys::GetCurrentCommandId(true);
                let (relation, slot) = (self.relation, self.slot);
                // A function pointer of PostgreSQL's is not behind pgrx's guard: an ERROR in it
                // (a failed TOAST write, out of memory) must unwind the Rust frames above it,
                // not jump over them (red team 33, F1).
                pg_sys::ffi::pg_guard_ffi_boundary(|| {
                    insert(relation, slot, command, 0, std::ptr::null_mut(), token)
                });
                let mut conflicted = false;
                let recheck = port::exec_insert_index_tuples_speculative(
                    self.info,
                    self.slot,
                    self.estate,
                    &mut conflicted,
                );
                pg_sys::ffi::pg_guard_ffi_boundary(|| complete(relation, slot, token, !conflicted));
                pg_sys::SpeculativeInsertionLockRelease(xid);
                pg_sys::list_free(recheck);
                self.reset_per_tuple();
                if !conflicted {
                    return Ok(None);
                }
            }
        }
    }

    /// Frees what the last row's index entries took (formed in the per-tuple context).
    fn reset_per_tuple(&mut self) {
        // SAFETY: the executor state made by `open`; its per-tuple context, if made, holds
        // nothing that outlives one row.
        unsafe {
            let econtext = (*self.estate).es_per_tuple_exprcontext;
            if !econtext.is_null() {
                pg_sys::MemoryContextReset((*econtext).ecxt_per_tuple_memory);
            }
        }
    }

    /// Checks `row` and stores it in the slot, ready for the heap: its length and types, the
    /// native trigger, NOT NULL and the table's CHECK constraints.
    fn prepare(&mut self, row: &[Option<Value<'_>>]) -> Result<()> {
        if row.len() != self.columns.len() || row.len() > MAX_COLUMNS {
            return Err(Error::Internal(
                "direct insert: wrong number of columns".into(),
            ));
        }
        // On the stack: this runs once per change row of every commit.
        let mut values = [pg_sys::Datum::from(0usize); MAX_COLUMNS];
        let mut nulls = [true; MAX_COLUMNS];
        for (i, (cell, (name, type_oid))) in row.iter().zip(self.columns).enumerate() {
            if let Some(cell) = cell {
                if cell.type_oid() != *type_oid {
                    return Err(Error::Internal(format!(
                        "direct insert: a value of type {:?} for column {name:?} of type {type_oid:?}",
                        cell.type_oid()
                    )));
                }
                values[i] = cell.datum().unwrap_or(pg_sys::Datum::from(0usize));
                nulls[i] = false;
            }
        }
        let (values, nulls) = (&values[..row.len()], &nulls[..row.len()]);
        if let Some(trigger) = self.before {
            (trigger.run)(row)?;
        }
        // SAFETY: `open` checked that the relation has exactly `self.columns` (names, types,
        // order); every value was just checked to be of its column's type.
        unsafe { self.store(values, nulls) }
    }

    /// Stores a row of the relation's values in the slot, checked for NOT NULL and the table's
    /// CHECK constraints.
    ///
    /// # Safety
    /// `values` and `nulls` are a well-formed row of the relation (its width, its columns' types).
    unsafe fn store(&mut self, values: &[pg_sys::Datum], nulls: &[bool]) -> Result<()> {
        // SAFETY: the caller's row is well-formed for the relation, so the slot receives a
        // well-formed virtual tuple. The slot, estate and index info were
        // made for this relation by `open` and live until `drop`; `ExecConstraints` evaluates the
        // relation's own CHECK constraints on that slot in that executor state, its error path
        // safe for a relation outside any range table (`ExecGetInsertedCols` answers "none" for
        // range table index 0 on every supported major).
        unsafe {
            let slot = self.slot;
            let attributes = pgrx::PgTupleDesc::from_pg_unchecked((*self.relation).rd_att);
            for (i, attribute) in attributes.iter().enumerate() {
                if nulls[i] && attribute.attnotnull {
                    pgrx::ereport!(
                        ERROR,
                        pgrx::PgSqlErrorCode::ERRCODE_NOT_NULL_VIOLATION,
                        format!(
                            "null value in column \"{}\" of relation \"{}\" violates not-null constraint",
                            CStr::from_ptr(attribute.attname.data.as_ptr()).to_string_lossy(),
                            CStr::from_ptr((*(*self.relation).rd_rel).relname.data.as_ptr())
                                .to_string_lossy()
                        )
                    );
                }
            }
            port::exec_clear_tuple(slot);
            std::ptr::copy_nonoverlapping(values.as_ptr(), (*slot).tts_values, values.len());
            std::ptr::copy_nonoverlapping(nulls.as_ptr(), (*slot).tts_isnull, nulls.len());
            pg_sys::ExecStoreVirtualTuple(slot);
            if self.checks {
                // Raises a check violation (23514) naming the constraint, as an INSERT does;
                // the expressions are prepared once, on the first row, in the executor state.
                pg_sys::ExecConstraints(self.info, slot, self.estate);
            }
            Ok(())
        }
    }
}

impl DirectInsert {
    /// `INSERT … ON CONFLICT (primary key) DO UPDATE SET` the columns marked in `update` to
    /// `row`'s values, in READ COMMITTED, done as the executor does it (`ExecInsert`,
    /// `ExecOnConflictUpdate`): where a row with the key stands, its newest version is locked
    /// (waiting for its holder as the statement waits) and updated — a heap update, and the
    /// row's index entries where the new version is not heap-only; where none stands, the row
    /// is inserted as [`DirectInsert::insert_unless_conflict`] inserts it; a row that turns up or
    /// changes meanwhile sends it round again, as the executor goes round. Returns the row as it
    /// now stands (the inserted one, or the stored one with the updated columns replaced) to
    /// `read`, in the columns' order. Opened by [`DirectInsert::open_for_upsert`] (READ
    /// COMMITTED only: elsewhere the statement raises 40001 on a row its snapshot cannot see;
    /// the primary key the one unique index: it is the conflict target). The updated columns
    /// are never key columns.
    pub fn upsert<T>(
        &mut self,
        row: &[Option<Value<'_>>],
        update: &[bool],
        read: impl FnOnce(&[pg_sys::Datum], &[bool]) -> Result<T>,
    ) -> Result<T> {
        if update.len() != row.len() {
            return Err(Error::Internal(
                "direct upsert: wrong number of columns to update".into(),
            ));
        }
        // The newest version of a row this transaction wrote in an earlier command is then
        // visible to the conflict check and lockable, as between two statements.
        // SAFETY: inside the caller's transaction.
        unsafe { pg_sys::CommandCounterIncrement() };
        loop {
            crate::interrupts::check();
            self.prepare(row)?;
            let Some(conflict) = self.insert_or_conflict()? else {
                return self.read_slot(read);
            };
            // Stored again: a speculative insert that met a conflict may have made the slot's
            // values its own (materialized), which storing the update's row would free.
            self.prepare(row)?;
            if self.update_conflicting(conflict, update)? {
                return self.read_slot(read);
            }
        }
    }

    /// Locks the row version at `tid` (`FOR NO KEY UPDATE`, waiting) and replaces its `update`
    /// columns by the slot's (the row [`DirectInsert::prepare`] stored); the new version is left
    /// in the slot. `false` when the version was updated or deleted meanwhile (the caller goes
    /// round again, as `ExecOnConflictUpdate`'s caller does).
    fn update_conflicting(
        &mut self,
        mut tid: pg_sys::ItemPointerData,
        update: &[bool],
    ) -> Result<bool> {
        // SAFETY: the relation, executor state and slot are `open`'s; the lock slot is the table
        // AM's own, made and dropped here; the row is locked as `ExecOnConflictUpdate` locks it
        // (no flags: a version updated meanwhile is answered, not followed). The locked
        // version's datums are put in the virtual slot and copied into the new tuple by
        // `heap_form_tuple` while the lock slot still pins its buffer; `heap_update` replaces
        // the version this transaction now holds, so it finds it.
        unsafe {
            let relation = self.relation;
            let lock_slot = pg_sys::table_slot_create(relation, std::ptr::null_mut());
            // No key column is updated: `FOR NO KEY UPDATE`, as `ExecUpdateLockMode` chooses.
            // Without flags the table AM reads no snapshot; the statement's is passed.
            let mode = pg_sys::LockTupleMode::LockTupleNoKeyExclusive;
            let snapshot = pg_sys::GetActiveSnapshot();
            let result = lock_tuple(relation, &mut tid, snapshot, lock_slot, mode, 0);
            match result {
                Some(pg_sys::TM_Result::TM_Ok) => {}
                Some(pg_sys::TM_Result::TM_Updated | pg_sys::TM_Result::TM_Deleted) => {
                    pg_sys::ExecDropSingleTupleTableSlot(lock_slot);
                    return Ok(false);
                }
                _ => {
                    // The executor's answer to a row this command already wrote (it cannot be:
                    // the command counter moved on before the check).
                    pg_sys::ExecDropSingleTupleTableSlot(lock_slot);
                    return Err(Error::Internal(
                        "direct upsert: the conflicting row is this command's own".into(),
                    ));
                }
            }
            // The stored row with the updated columns replaced by the prepared row's, checked as
            // the insert's row is.
            pg_sys::slot_getallattrs(lock_slot);
            let width = update.len();
            let mut values = [pg_sys::Datum::from(0usize); MAX_COLUMNS];
            let mut nulls = [true; MAX_COLUMNS];
            for (i, replaced) in update.iter().enumerate() {
                let from = if *replaced { self.slot } else { lock_slot };
                values[i] = *(*from).tts_values.add(i);
                nulls[i] = *(*from).tts_isnull.add(i);
            }
            self.store(&values[..width], &nulls[..width])?;
            let slot = self.slot;
            let new =
                pg_sys::heap_form_tuple((*relation).rd_att, (*slot).tts_values, (*slot).tts_isnull);
            let mut old = (*lock_slot).tts_tid;
            let updated = port::heap_update(relation, &mut old, new);
            // The slot's kept by-reference values point into the lock slot's tuple (its buffer,
            // pinned until the lock slot is dropped): the slot is emptied first, then holds the
            // new tuple's own values (read back by the caller).
            port::exec_clear_tuple(slot);
            pg_sys::ExecDropSingleTupleTableSlot(lock_slot);
            let Some(indexes) = updated else {
                pg_sys::heap_freetuple(new);
                return Err(Error::Internal(
                    "direct upsert: the locked row could not be updated".into(),
                ));
            };
            pg_sys::heap_deform_tuple(
                new,
                (*relation).rd_att,
                (*slot).tts_values,
                (*slot).tts_isnull,
            );
            pg_sys::ExecStoreVirtualTuple(slot);
            (*slot).tts_tid = (*new).t_self;
            if let Some(only_summarizing) = indexes {
                let recheck =
                    port::exec_update_index_tuples(self.info, slot, self.estate, only_summarizing);
                pg_sys::list_free(recheck);
                self.reset_per_tuple();
            }
            // `new` stays allocated until the caller read the slot (the values point into it):
            // it lives in the call's memory context, freed with it.
            Ok(true)
        }
    }

    /// The values of the row last prepared or written, in the columns' order.
    fn read_slot<T>(&self, read: impl FnOnce(&[pg_sys::Datum], &[bool]) -> Result<T>) -> Result<T> {
        // SAFETY: the virtual slot of `open`, holding a row of `self.columns.len()` values.
        unsafe {
            let width = self.columns.len();
            let values = std::slice::from_raw_parts((*self.slot).tts_values, width);
            let nulls = std::slice::from_raw_parts((*self.slot).tts_isnull, width);
            read(values, nulls)
        }
    }
}

impl DirectInsert {
    /// Adds one to the `bigint` column `column` of the row whose text primary key is `key`, a row
    /// this transaction holds — it wrote the row version, or holds the exclusive row lock on it
    /// (`SELECT … FOR UPDATE`: the partition lock, src/log.rs) — and returns the new value: a
    /// heap update, plus the row's index entries where it is not a heap-only tuple, as an
    /// `UPDATE` makes it (the table was checked by [`DirectInsert::open`] to have nothing else
    /// to run). `None`, with nothing written, when the row is missing, not held so, or its value
    /// null or at the type's end, or the table is not a heap: the caller's statement then writes
    /// (and waits, checks and raises as statements do).
    pub fn increment_held(&mut self, key: &str, column: &CStr) -> Result<Option<i64>> {
        // SAFETY: the relation, executor state and slot are `open`'s, alive until `drop`. The row
        // is found with a fresh snapshot taken after the command counter moved past this
        // transaction's earlier writes (the newest version: the one held), copied out of the
        // scan, and replaced by `heap_update` under this transaction's command id; nobody else
        // can change a row this transaction holds, so the update finds the version read (any
        // other outcome writes nothing and is answered `None`). The new tuple's index entries
        // are inserted through the slot with the tuple's values and new location.
        unsafe {
            let descriptor = (*self.relation).rd_att;
            if (*(*self.relation).rd_rel).relam != pg_sys::HEAP_TABLE_AM_OID {
                return Ok(None);
            }
            // What the `UPDATE` raises where the table's updates are published without a
            // replica identity (55000).
            pg_sys::CheckCmdReplicaIdentity(self.relation, pg_sys::CmdType::CMD_UPDATE);
            let Some(attnum) =
                crate::catalog::live_attribute(descriptor, column, |t| t == pg_sys::INT8OID)
            else {
                return Err(Error::Internal(format!(
                    "syncular: {:?} has no column {column:?} of the type read",
                    self.table.name()
                )));
            };
            pg_sys::CommandCounterIncrement();
            let old = match last_held(self.relation, key) {
                Some(old) => old,
                None => {
                    let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
                    // The key is the distribution value of the one table this serves
                    // (`sync_partitions`, keyed and distributed by `partition`).
                    let found =
                        by_primary_key(self.table, Some(key), &[text_key(key)], snapshot, |row| {
                            Ok(row.map(|row| pg_sys::heap_copytuple(row.tuple)))
                        });
                    pg_sys::UnregisterSnapshot(snapshot);
                    let Lookup::Here(Some(old), _) = found? else {
                        return Ok(None);
                    };
                    old
                }
            };
            let mut is_null = false;
            let value = pg_sys::heap_getattr(old, attnum.into(), descriptor, &mut is_null);
            let next = i64::from_datum(value, is_null).and_then(|v| v.checked_add(1));
            let (Some(next), true) = (next, held((*old).t_data)) else {
                return Ok(None);
            };
            let width = (*descriptor).natts as usize;
            let mut values = vec![pg_sys::Datum::from(0usize); width];
            let nulls = vec![false; width];
            let mut replace = vec![false; width];
            let at = attnum as usize - 1;
            values[at] = pg_sys::Datum::from(next);
            replace[at] = true;
            let new = pg_sys::heap_modify_tuple(
                old,
                descriptor,
                values.as_mut_ptr(),
                nulls.as_ptr().cast_mut(),
                replace.as_mut_ptr(),
            );
            let Some(indexes) = port::heap_update(self.relation, &mut (*old).t_self, new) else {
                return Ok(None);
            };
            remember_held(self.relation, (*new).t_self);
            if let Some(only_summarizing) = indexes {
                let slot = self.slot;
                port::exec_clear_tuple(slot);
                pg_sys::heap_deform_tuple(new, descriptor, (*slot).tts_values, (*slot).tts_isnull);
                pg_sys::ExecStoreVirtualTuple(slot);
                (*slot).tts_tid = (*new).t_self;
                let recheck =
                    port::exec_update_index_tuples(self.info, slot, self.estate, only_summarizing);
                pg_sys::list_free(recheck);
                self.reset_per_tuple();
            }
            pg_sys::heap_freetuple(new);
            pg_sys::heap_freetuple(old);
            Ok(Some(next))
        }
    }
}

/// Takes this transaction's exclusive row lock (`SELECT … FOR UPDATE`'s) on the newest version
/// of the row of `table` whose text primary key is `key`, waiting for other holders as that
/// statement waits (`lock_timeout`, deadlock detection and cancels included: the heap's own
/// wait), and returns the `bigint` column `column` of the version locked. The row is found by
/// its key with a new snapshot, as a READ COMMITTED statement's, and the newest version of its
/// update chain is locked (`TUPLE_LOCK_FLAG_FIND_LAST_VERSION`, what the executor does for a
/// row lock in READ COMMITTED). `None`, with no row locked (and the caller's statement then
/// locks, creates or raises): outside READ COMMITTED or in a read-only transaction, where the
/// table has anything a statement would check ([`DirectInsert::open`]'s rule) or is not a heap,
/// and where the row is missing, was deleted before it could be locked, or its newest version
/// no longer has the key (then the statement's own lock on it is what the statement would have
/// left too).
pub fn lock_by_key(
    table: SyncTable,
    columns: &[(&CStr, pg_sys::Oid)],
    key: &str,
    column: &CStr,
) -> Result<Option<i64>> {
    let lock = pg_sys::RowShareLock as pg_sys::LOCKMODE;
    // SAFETY: inside the caller's transaction. The relation is opened here with the lock a
    // `SELECT … FOR UPDATE` takes and closed keeping it, as the statement keeps it; the snapshot
    // is registered around the lookup and the row lock; the slot is the table AM's own, made and
    // dropped here; the table AM's `tuple_lock` is called as `ExecLockRows` calls it.
    unsafe {
        if pg_sys::XactReadOnly || !read_committed() {
            return Ok(None);
        }
        // Where Citus distributes the table, its shard on this node (the key is the table's
        // distribution value: `sync_partitions`); the statement where that shard is elsewhere.
        let Some(relation) = open_here(table, Some(key), lock)? else {
            return Ok(None);
        };
        let descriptor = (*relation).rd_att;
        let attributes = (
            crate::catalog::live_attribute(descriptor, column, |t| t == pg_sys::INT8OID),
            crate::catalog::primary_key_text_attribute(relation),
        );
        let (Some(attnum), Some(key_attnum), true, true) = (
            attributes.0,
            attributes.1,
            is_plain(relation, columns, None),
            (*(*relation).rd_rel).relam == pg_sys::HEAP_TABLE_AM_OID,
        ) else {
            pg_sys::table_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
            return Ok(None);
        };
        pg_sys::CommandCounterIncrement();
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetTransactionSnapshot());
        let found = by_primary_key(table, Some(key), &[text_key(key)], snapshot, |row| {
            Ok(row.map(|row| (*row.tuple).t_self))
        });
        let locked = match found {
            Ok(Lookup::Here(Some(mut tid), _)) => {
                let slot = pg_sys::table_slot_create(relation, std::ptr::null_mut());
                let flags = pg_sys::TUPLE_LOCK_FLAG_FIND_LAST_VERSION as u8;
                let mode = pg_sys::LockTupleMode::LockTupleExclusive;
                let result = lock_tuple(relation, &mut tid, snapshot, slot, mode, flags);
                let value = (result == Some(pg_sys::TM_Result::TM_Ok)).then(|| {
                    let mut is_null = false;
                    let found = pg_sys::slot_getattr(slot, key_attnum.into(), &mut is_null);
                    let same_key = String::from_datum(found, is_null).as_deref() == Some(key);
                    let value = pg_sys::slot_getattr(slot, attnum.into(), &mut is_null);
                    same_key.then(|| i64::from_datum(value, is_null)).flatten()
                });
                if value.flatten().is_some() {
                    remember_held(relation, (*slot).tts_tid);
                }
                pg_sys::ExecDropSingleTupleTableSlot(slot);
                Ok(value.flatten())
            }
            Ok(_) => Ok(None),
            Err(e) => Err(e),
        };
        pg_sys::UnregisterSnapshot(snapshot);
        pg_sys::table_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
        locked
    }
}

/// Where this backend last locked ([`lock_by_key`]) or updated
/// ([`DirectInsert::increment_held`]) a row it holds: the relation, the (sub)transaction that
/// did, and the version's location — so the allocation that follows the partition lock updates
/// the row without looking it up by its key again (docs/BENCHMARKS.md, "Server CPU", step 6).
#[derive(Clone, Copy)]
struct LastHeld {
    relation: pg_sys::Oid,
    transaction: pg_sys::TransactionId,
    subtransaction: pg_sys::SubTransactionId,
    tid: pg_sys::ItemPointerData,
}

thread_local! {
    static LAST_HELD: Cell<Option<LastHeld>> = const { Cell::new(None) };
}

/// Records that this (sub)transaction holds the row version at `tid` of `relation`.
///
/// # Safety
/// Inside a transaction that has an id (a row lock or an update gave it one).
unsafe fn remember_held(relation: pg_sys::Relation, tid: pg_sys::ItemPointerData) {
    // SAFETY: reads of the caller's open relation and of the transaction state.
    let held = unsafe {
        LastHeld {
            relation: (*relation).rd_id,
            transaction: pg_sys::GetTopTransactionIdIfAny(),
            subtransaction: pg_sys::GetCurrentSubTransactionId(),
            tid,
        }
    };
    LAST_HELD.with(|c| c.set(Some(held)));
}

/// A copy of the row version of `relation` whose text primary key is `key` at the location
/// [`remember_held`] recorded in this very (sub)transaction — which keeps the relation locked,
/// so its pages stay — when that version still has the key, is held ([`held`]) and was not
/// updated since (its `xmax` empty or a lock only): the version a fresh lookup by the key finds.
/// `None` otherwise (the caller looks it up).
///
/// # Safety
/// `relation` is open, a heap, with a text primary key.
unsafe fn last_held(relation: pg_sys::Relation, key: &str) -> Option<pg_sys::HeapTuple> {
    let last = LAST_HELD.with(Cell::get)?;
    // SAFETY: the location is read only inside the (sub)transaction that recorded it, which
    // holds a lock on the relation (no truncation can remove its page); `heap_fetch` checks the
    // line pointer and pins the page, and the tuple is copied before the pin is released.
    unsafe {
        if last.relation != (*relation).rd_id
            || last.transaction == pg_sys::InvalidTransactionId
            || last.transaction != pg_sys::GetTopTransactionIdIfAny()
            || last.subtransaction != pg_sys::GetCurrentSubTransactionId()
        {
            return None;
        }
        let key_attnum = crate::catalog::primary_key_text_attribute(relation)?;
        let mut tuple = pg_sys::HeapTupleData {
            t_self: last.tid,
            ..Default::default()
        };
        let mut buffer: pg_sys::Buffer = 0;
        let any = &raw mut pg_sys::SnapshotAnyData;
        if !pg_sys::heap_fetch(relation, any, &mut tuple, &mut buffer, false) {
            return None;
        }
        let header = tuple.t_data;
        let mask = u32::from((*header).t_infomask);
        // Not updated: no `xmax`, or one that only locks.
        let current = mask & pg_sys::HEAP_XMAX_INVALID != 0 || xmax_locks_only(mask);
        let copy = (current && held(header)).then(|| pg_sys::heap_copytuple(&mut tuple));
        pg_sys::ReleaseBuffer(buffer);
        let copy = copy?;
        let mut is_null = false;
        let found = pg_sys::heap_getattr(copy, key_attnum.into(), (*relation).rd_att, &mut is_null);
        if String::from_datum(found, is_null).as_deref() == Some(key) {
            Some(copy)
        } else {
            pg_sys::heap_freetuple(copy);
            None
        }
    }
}

/// Whether this transaction holds the row version `header` heads: it wrote it (no other
/// transaction can see it yet), or its `xmax` is this transaction's exclusive lock only (`FOR
/// UPDATE` / `FOR NO KEY UPDATE`, not shared through a multixact): no other transaction can
/// update or lock it until this one ends.
///
/// # Safety
/// `header` is a valid heap tuple header.
unsafe fn held(header: pg_sys::HeapTupleHeader) -> bool {
    // SAFETY: the caller's valid header, read; htup_details.h's `HEAP_XMAX_IS_EXCL_LOCKED`
    // written out ([`xmax_locks_only`] the locked-only half).
    unsafe {
        let xmin = port::heap_tuple_header_get_xmin(header);
        if xmin != pg_sys::FrozenTransactionId && pg_sys::TransactionIdIsCurrentTransactionId(xmin)
        {
            return true;
        }
        let mask = u32::from((*header).t_infomask);
        let lock_mask = pg_sys::HEAP_XMAX_KEYSHR_LOCK | pg_sys::HEAP_XMAX_EXCL_LOCK;
        mask & (pg_sys::HEAP_XMAX_INVALID | pg_sys::HEAP_XMAX_IS_MULTI) == 0
            && xmax_locks_only(mask)
            && mask & lock_mask == pg_sys::HEAP_XMAX_EXCL_LOCK
            && pg_sys::TransactionIdIsCurrentTransactionId((*header).t_choice.t_heap.t_xmax)
    }
}

/// Whether a tuple's `xmax` (per its `t_infomask`, `mask`) only locks it and did not update or
/// delete it: htup_details.h's `HEAP_XMAX_IS_LOCKED_ONLY`, written out.
fn xmax_locks_only(mask: u32) -> bool {
    let lock_mask = pg_sys::HEAP_XMAX_KEYSHR_LOCK | pg_sys::HEAP_XMAX_EXCL_LOCK;
    mask & pg_sys::HEAP_XMAX_LOCK_ONLY != 0
        || mask & (pg_sys::HEAP_XMAX_IS_MULTI | lock_mask) == pg_sys::HEAP_XMAX_EXCL_LOCK
}

impl Drop for DirectInsert {
    fn drop(&mut self) {
        // After an ERROR the (sub)transaction's abort releases all of this; calling into
        // PostgreSQL while unwinding from one is not allowed.
        if std::thread::panicking() {
            return;
        }
        // SAFETY: the four objects were made by `open` and are released once, in reverse order.
        unsafe {
            pg_sys::ExecDropSingleTupleTableSlot(self.slot);
            pg_sys::ExecCloseIndices(self.info);
            pg_sys::FreeExecutorState(self.estate);
            pg_sys::table_close(self.relation, pg_sys::NoLock as pg_sys::LOCKMODE);
        }
    }
}

/// The table AM's row lock of `mode` (`LockTupleExclusive`: `SELECT … FOR UPDATE`'s) on the row
/// version at `tid`, waiting for other holders, under this transaction's current command; `None`
/// where the table AM has no `tuple_lock`. The version locked is left in `slot`.
///
/// # Safety
/// `relation` is open and locked, `slot` one of its table AM's slots, `snapshot` registered or
/// current.
unsafe fn lock_tuple(
    relation: pg_sys::Relation,
    tid: &mut pg_sys::ItemPointerData,
    snapshot: pg_sys::Snapshot,
    slot: *mut pg_sys::TupleTableSlot,
    mode: pg_sys::LockTupleMode::Type,
    flags: u8,
) -> Option<pg_sys::TM_Result::Type> {
    // SAFETY: the caller's contract; `tuple_lock` is called as `ExecLockRows` calls it.
    unsafe {
        let mut failure = pg_sys::TM_FailureData::default();
        let command = pg_sys::GetCurrentCommandId(true);
        let (tid, failure) = (tid as *mut _, &raw mut failure);
        // A function pointer of PostgreSQL's is not behind pgrx's guard: the wait's ERROR
        // (lock_timeout, a cancel, a deadlock) must unwind the Rust frames above it, dropping
        // what they hold, not jump over them (red team 33, F1: 1.25 MB leaked per timed-out
        // push).
        (*(*relation).rd_tableam).tuple_lock.map(|tuple_lock| {
            pg_sys::ffi::pg_guard_ffi_boundary(|| {
                tuple_lock(
                    relation,
                    tid,
                    snapshot,
                    slot,
                    command,
                    mode,
                    pg_sys::LockWaitPolicy::LockWaitBlock,
                    flags,
                    failure,
                )
            })
        })
    }
}

/// Whether `relation` is a plain table with exactly `columns` and nothing a statement would run
/// or check on insert that [`DirectInsert::insert`] does not: owned by the current user (the
/// extension's functions run as the owner, who needs no privilege check and is exempt from row
/// security unless it is forced), not a partition (whose partition constraint a statement
/// checks), no rules, generated columns or forced row security, and no trigger but `trigger`
/// (which it must have). CHECK constraints are evaluated by the insert itself. Never a Citus
/// shell: both callers open `relation` with [`open_here`], which answers a shard or nothing.
///
/// # Safety
/// `relation` is an open relation.
unsafe fn is_plain(
    relation: pg_sys::Relation,
    columns: &[(&CStr, pg_sys::Oid)],
    trigger: Option<NativeTrigger>,
) -> bool {
    // SAFETY: the caller's open relation; its `rd_rel`, `rd_att`, `constr` and `trigdesc` are
    // read only.
    unsafe {
        let form = &*(*relation).rd_rel;
        let triggers = match (trigger, (*relation).trigdesc.is_null()) {
            (None, true) => true,
            (Some(trigger), false) => only_trigger(&*(*relation).trigdesc, trigger),
            _ => false,
        };
        if form.relkind != pg_sys::RELKIND_RELATION as std::ffi::c_char
            || form.relowner != pg_sys::GetUserId()
            || form.relispartition
            || !triggers
            || !(*relation).rd_rules.is_null()
            || (form.relrowsecurity && form.relforcerowsecurity)
        {
            return false;
        }
        let descriptor = (*relation).rd_att;
        let constraints = (*descriptor).constr;
        if !constraints.is_null() && (*constraints).has_generated_stored {
            return false;
        }
        let attributes = pgrx::PgTupleDesc::from_pg_unchecked(descriptor);
        attributes.len() == columns.len()
            && attributes
                .iter()
                .zip(columns)
                .all(|(attribute, (name, type_oid))| {
                    // No generated column, stored or virtual (PostgreSQL 18): a heap insert
                    // would store the value given, not the expression's (red team 37, F2).
                    !attribute.attisdropped
                        && attribute.attgenerated == 0
                        && attribute.atttypid == *type_oid
                        && crate::catalog::is_named(attribute, name)
                })
    }
}

/// Whether `triggers` is exactly `trigger`: one `BEFORE INSERT FOR EACH ROW` trigger without a
/// `WHEN` condition, firing in this session (`session_replication_role` against its enabled
/// state, as `trigger.c` decides), whose function is the native one.
///
/// # Safety
/// `triggers` is an open relation's trigger descriptor.
unsafe fn only_trigger(triggers: &pg_sys::TriggerDesc, trigger: NativeTrigger) -> bool {
    if triggers.numtriggers != 1 {
        return false;
    }
    // SAFETY: the descriptor holds `numtriggers` (one) triggers.
    let found = unsafe { &*triggers.triggers };
    let kind = (pg_sys::TRIGGER_TYPE_ROW
        | pg_sys::TRIGGER_TYPE_BEFORE
        | pg_sys::TRIGGER_TYPE_INSTEAD
        | pg_sys::TRIGGER_TYPE_INSERT) as i16;
    let row_before_insert = (pg_sys::TRIGGER_TYPE_ROW
        | pg_sys::TRIGGER_TYPE_BEFORE
        | pg_sys::TRIGGER_TYPE_INSERT) as i16;
    // SAFETY: a backend global, read.
    let replica = unsafe { pg_sys::SessionReplicationRole }
        == pg_sys::SESSION_REPLICATION_ROLE_REPLICA as std::ffi::c_int;
    let enabled = found.tgenabled as u8;
    let fires = enabled == pg_sys::TRIGGER_FIRES_ALWAYS
        || enabled
            == if replica {
                pg_sys::TRIGGER_FIRES_ON_REPLICA
            } else {
                pg_sys::TRIGGER_FIRES_ON_ORIGIN
            };
    if found.tgtype & kind != row_before_insert || !found.tgqual.is_null() || !fires {
        return false;
    }
    // SAFETY: inside the caller's transaction.
    unsafe { crate::catalog::is_native_function(found.tgfoid, trigger.symbol) }
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::*;
    use pgrx::prelude::*;

    /// A snapshot registered beside an overflowed subtransaction cache keeps `subxcnt` but no
    /// `subxip` (snapmgr.c `CopySnapshot`): no fingerprint, and nothing read through the NULL
    /// array — which aborted the backend in sessions 25 and 27 (the check of
    /// `slice::from_raw_parts` in a debug build, a panic that cannot unwind).
    #[pg_test]
    fn a_snapshot_without_its_subtransaction_ids_is_not_fingerprinted() {
        let mut xip = [100u32, 101].map(pg_sys::TransactionId::from);
        // SAFETY: an all-zero SnapshotData is a valid value of the C struct.
        let mut s: pg_sys::SnapshotData = unsafe { std::mem::zeroed() };
        s.snapshot_type = pg_sys::SnapshotType::SNAPSHOT_MVCC;
        s.xmin = pg_sys::TransactionId::from(100);
        s.xmax = pg_sys::TransactionId::from(200);
        s.xip = xip.as_mut_ptr();
        s.xcnt = 2;
        s.subxcnt = 3;
        s.subxip = std::ptr::null_mut();
        s.suboverflowed = true;
        // SAFETY: a snapshot whose arrays are valid for their counts, or NULL as PostgreSQL
        // leaves them.
        assert_eq!(unsafe { seen_by(&mut s) }, None);
        s.suboverflowed = false;
        // SAFETY: as above.
        assert_eq!(
            unsafe { seen_by(&mut s) },
            None,
            "a NULL array with a count"
        );
        s.subxcnt = 0;
        // SAFETY: as above.
        let seen = unsafe { seen_by(&mut s) }.expect("a fingerprint");
        assert_eq!(seen.xip, vec![100, 101]);
    }
}
