//! SPI access with plans prepared once per backend.
//!
//! Two kinds of statement, because pgrx picks SPI's `read_only` flag from the plan:
//! - [`read`]: a non-mutating plan. In a transaction that has written nothing it runs in the
//!   caller's snapshot (one snapshot per call of a `STABLE` function when the call is one
//!   statement) and never assigns a transaction id, so readers work in `READ ONLY` transactions.
//! - [`write`]: a mutating plan. Every execution takes a fresh snapshot under READ COMMITTED, so
//!   a statement run after a lock wait sees what committed meanwhile.
//!
//! SQL convention: every `sync_*` text column is `COLLATE "C"`, while values unnested from a
//! `text[]` parameter carry the database's default collation. Such comparisons are written
//! `col = v.x COLLATE "C"`, so the collation is never ambiguous and the key stays usable as an
//! index condition.

use crate::alloc;
use crate::error::Result;
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{self, PgOid};
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiCursor, SpiTupleTable};
use pgrx::Spi;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

thread_local! {
    /// Kept plans, keyed by their SQL text (always a `'static` literal of this crate), one per
    /// list of argument types it was called with (see [`Types`]).
    static PLANS: RefCell<HashMap<(&'static str, bool), Vec<KeptPlan>>> =
        RefCell::new(HashMap::new());
    /// Kept plans of statements built per app table (quoted identifiers), keyed by their text.
    static DYNAMIC_PLANS: RefCell<DynamicPlans> = RefCell::new(DynamicPlans::default());
}

/// How many plans of statements built per app table a backend keeps. Their texts hold a
/// relation's current name, so every rename (or a dropped table) leaves a text no call will use
/// again: without a bound each one kept a plan for the backend's life (issue 25's finding: +57 MB
/// after 5,000 renames). A handful of statements per registered table fit many times over.
const DYNAMIC_PLANS_KEPT: usize = 512;

/// The argument types a plan was prepared for. A kept plan runs with the types it was
/// prepared with, whatever the datums passed (pgrx checks only their number), so a plan is
/// kept per text *and* types: the row statement of a table dropped and made again under its
/// name with other column types has the same text, and its old plan read the new datums as the
/// old types — a `double precision` stored as the bits of a `bigint` (red team 34, F1).
type Types = Vec<pg_sys::Oid>;

/// A kept plan of a static text, with the argument types it was prepared for.
type KeptPlan = (Types, &'static OwnedPreparedStatement);

fn types_of(args: &[DatumWithOid<'_>]) -> Types {
    args.iter().map(DatumWithOid::oid).collect()
}

fn same_types(types: &[pg_sys::Oid], args: &[DatumWithOid<'_>]) -> bool {
    types.len() == args.len() && types.iter().zip(args).all(|(t, a)| *t == a.oid())
}

/// The kept plans of statements built per app table, the least recently used freed first when
/// [`DYNAMIC_PLANS_KEPT`] is reached.
#[derive(Default)]
struct DynamicPlans {
    plans: HashMap<(String, bool, Types), (Rc<OwnedPreparedStatement>, u64)>,
    /// A counter of uses: the entry with the smallest stamp is the least recently used.
    clock: u64,
}

impl DynamicPlans {
    fn get(&mut self, key: &(String, bool, Types)) -> Option<Rc<OwnedPreparedStatement>> {
        self.clock += 1;
        let clock = self.clock;
        self.plans.get_mut(key).map(|(plan, used)| {
            *used = clock;
            Rc::clone(plan)
        })
    }

    fn insert(&mut self, key: (String, bool, Types), plan: Rc<OwnedPreparedStatement>) {
        if self.plans.len() >= DYNAMIC_PLANS_KEPT {
            // Dropping the last reference frees the plan (SPI_freeplan); a statement running
            // with it holds its own reference until it ends.
            if let Some(oldest) = self
                .plans
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone())
            {
                self.plans.remove(&oldest);
            }
        }
        self.clock += 1;
        self.plans.insert(key, (plan, self.clock));
    }
}

fn plan(
    client: &SpiClient<'_>,
    sql: &'static str,
    args: &[DatumWithOid<'_>],
    mutating: bool,
) -> Result<&'static OwnedPreparedStatement> {
    let kept = PLANS.with(|plans| {
        plans.borrow().get(&(sql, mutating)).and_then(|kept| {
            kept.iter()
                .find(|(types, _)| same_types(types, args))
                .map(|(_, plan)| *plan)
        })
    });
    if let Some(kept) = kept {
        return Ok(kept);
    }
    let types = types_of(args);
    let pg_types: Vec<PgOid> = types.iter().map(|t| PgOid::from(*t)).collect();
    let prepared = if mutating {
        client.prepare_mut(sql, &pg_types)?
    } else {
        client.prepare(sql, &pg_types)?
    };
    // Leaked on purpose: a kept plan lives as long as the backend, like the plan cache entry.
    // A static text is called with one list of types (its arguments are typed in this crate).
    let kept: &'static OwnedPreparedStatement = Box::leak(Box::new(prepared.keep()));
    PLANS.with(|plans| {
        plans
            .borrow_mut()
            .entry((sql, mutating))
            .or_default()
            .push((types, kept))
    });
    Ok(kept)
}

/// Runs a read-only statement in the caller's snapshot (see the module comment).
pub fn read<'conn>(
    client: &SpiClient<'conn>,
    sql: &'static str,
    args: &[DatumWithOid<'_>],
) -> Result<SpiTupleTable<'conn>> {
    let stmt = plan(client, sql, args, false)?;
    Ok(client.select(stmt, None, args)?)
}

/// [`read`] in the caller's snapshot, or with a fresh one as [`write`] takes (`fresh`).
pub fn read_fresh_if<'conn>(
    client: &SpiClient<'conn>,
    sql: &'static str,
    args: &[DatumWithOid<'_>],
    fresh: bool,
) -> Result<SpiTupleTable<'conn>> {
    let stmt = plan(client, sql, args, fresh)?;
    Ok(client.select(stmt, None, args)?)
}

/// Runs a statement that writes or locks, with a fresh snapshot under READ COMMITTED.
pub fn write<'conn>(
    client: &SpiClient<'conn>,
    sql: &'static str,
    args: &[DatumWithOid<'_>],
) -> Result<SpiTupleTable<'conn>> {
    let stmt = plan(client, sql, args, true)?;
    Ok(client.select(stmt, None, args)?)
}

/// The schema barrier, L0 (docs/DESIGN.md §Lock order): `EXCLUSIVE` on `sync_partitions`, which
/// waits for every transaction holding a partition lock and keeps new ones out until this one
/// ends — taken by `migrate_schema`, `register_table`, `retire_table` and
/// `repair_schema_marker`. On Citus the lock is sent to every node and waited for there, where
/// this session's `lock_timeout` is sent first ([`crate::citus::send_lock_timeout`]).
pub fn lock_barrier(client: &SpiClient<'_>) -> Result<()> {
    crate::citus::send_lock_timeout()?;
    crate::citus::propagating_locks(|| {
        write(
            client,
            "LOCK TABLE syncular.sync_partitions IN EXCLUSIVE MODE",
            &[],
        )
    })?;
    Ok(())
}

/// Runs `body` with `plan_cache_mode = force_generic_plan`: statements planned or opened in it
/// run their kept generic plan, never a custom one. For statements whose parameters are all keys
/// with an index made for them (`= ANY ($n)`, ranges of a primary key): the plan cache plans such
/// a statement again on every call when the column statistics are skewed (one partition holding
/// most rows, as in a single-tenant database): a custom plan always looks cheaper there than the
/// generic one, though both use the same index, and re-planning is most of an idle pull's cost
/// (docs/BENCHMARKS.md, Pull).
fn generic<R>(body: impl FnOnce() -> Result<R>) -> Result<R> {
    // Citus plans a statement over its tables itself and cannot route a generic plan of it
    // ("could not create distributed plan"): the plan cache's own choice there (src/citus/mod.rs).
    if crate::citus::installed() {
        return body();
    }
    with_settings(&[(c"plan_cache_mode", c"force_generic_plan")], body)
}

/// Runs `body` with the user-settable `settings` made in a GUC nest level of its own, undone
/// right after it; an error in between unwinds them with the (sub)transaction, as for a
/// function's own SET clause.
pub fn with_settings<R>(
    settings: &[(&std::ffi::CStr, &std::ffi::CStr)],
    body: impl FnOnce() -> Result<R>,
) -> Result<R> {
    // SAFETY: valid, NUL-terminated setting names and values, set with GUC_ACTION_SAVE inside
    // the nest level that AtEOXact_GUC(true, level) then pops.
    unsafe {
        let level = pg_sys::NewGUCNestLevel();
        for (name, value) in settings {
            pg_sys::set_config_option(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_USERSET,
                pg_sys::GucSource::PGC_S_SESSION,
                pg_sys::GucAction::GUC_ACTION_SAVE,
                true,
                0,
                false,
            );
        }
        let result = body();
        pg_sys::AtEOXact_GUC(true, level);
        result
    }
}

/// Like [`write`], on the statement's generic plan (see [`generic`]).
pub fn write_generic<'conn>(
    client: &SpiClient<'conn>,
    sql: &'static str,
    args: &[DatumWithOid<'_>],
) -> Result<SpiTupleTable<'conn>> {
    generic(|| write(client, sql, args))
}

/// Like [`read`], on the statement's generic plan (see [`generic`]).
pub fn read_generic<'conn>(
    client: &SpiClient<'conn>,
    sql: &'static str,
    args: &[DatumWithOid<'_>],
) -> Result<SpiTupleTable<'conn>> {
    generic(|| read(client, sql, args))
}

/// Opens a read-only statement as a cursor on its generic plan, in the caller's snapshot: rows
/// are produced only as far as they are fetched, so a reader that stops early never makes the
/// executor read the rest.
pub fn read_cursor<'conn>(
    client: &SpiClient<'conn>,
    sql: &'static str,
    args: &[DatumWithOid<'_>],
) -> Result<SpiCursor<'conn>> {
    let stmt = plan(client, sql, args, false)?;
    generic(|| Ok(client.try_open_cursor(stmt, args)?))
}

/// Like [`read`], for a statement text built at run time around an app table's quoted name.
/// One kept plan per distinct text (a handful per registered table), at most
/// [`DYNAMIC_PLANS_KEPT`] in all.
pub fn read_dynamic<'conn>(
    client: &SpiClient<'conn>,
    sql: &str,
    args: &[DatumWithOid<'_>],
) -> Result<SpiTupleTable<'conn>> {
    dynamic(client, sql, args, false)
}

/// Like [`write`], for a statement text built at run time around an app table's quoted name
/// (the one-call push's app-row statements: each sees the earlier ones of the same call).
pub fn write_dynamic<'conn>(
    client: &SpiClient<'conn>,
    sql: &str,
    args: &[DatumWithOid<'_>],
) -> Result<SpiTupleTable<'conn>> {
    dynamic(client, sql, args, true)
}

fn dynamic<'conn>(
    client: &SpiClient<'conn>,
    sql: &str,
    args: &[DatumWithOid<'_>],
    mutating: bool,
) -> Result<SpiTupleTable<'conn>> {
    let key = (sql.to_string(), mutating, types_of(args));
    let cached = DYNAMIC_PLANS.with(|plans| plans.borrow_mut().get(&key));
    let stmt = match cached {
        Some(kept) => kept,
        None => {
            let types: Vec<PgOid> = key.2.iter().map(|t| PgOid::from(*t)).collect();
            let prepared = if mutating {
                client.prepare_mut(sql, &types)?
            } else {
                client.prepare(sql, &types)?
            };
            let kept = Rc::new(prepared.keep());
            DYNAMIC_PLANS.with(|plans| plans.borrow_mut().insert(key, Rc::clone(&kept)));
            kept
        }
    };
    // The map is not borrowed while the statement runs: host code it fires may reach here again.
    Ok(client.select(&*stmt, None, args)?)
}

/// Runs one guarded `UPDATE … RETURNING 1` in its own SPI connection; `true` iff a row changed.
/// The explicit boolean the API returns instead of a driver's row count.
pub fn changed(sql: &'static str, args: &[DatumWithOid<'_>]) -> Result<bool> {
    with_spi(|client| Ok(!write(client, sql, args)?.is_empty()))
}

/// Opens an SPI connection for the duration of `body`.
pub fn with_spi<R>(body: impl FnOnce(&SpiClient<'_>) -> Result<R>) -> Result<R> {
    Spi::connect(body)
}

/// The first column of every row as text (NULL as empty), checking for interrupts per row.
pub fn texts<C: FromIterator<String>>(table: SpiTupleTable<'_>) -> Result<C> {
    table
        .map(|row| {
            crate::interrupts::check();
            Ok(row.get::<String>(1)?.unwrap_or_default())
        })
        .collect()
}

/// First column of the first row, or `None` when there is no row or the value is NULL.
pub fn first<T: pgrx::FromDatum + pgrx::IntoDatum>(table: SpiTupleTable<'_>) -> Result<Option<T>> {
    if table.is_empty() {
        return Ok(None);
    }
    Ok(table.first().get::<T>(1)?)
}

/// A `bytea` column of a result row, copied out fallibly ([`alloc::Bytes`]).
pub fn bytes_column(
    row: &pgrx::spi::SpiHeapTupleData<'_>,
    ordinal: usize,
) -> Result<Option<Vec<u8>>> {
    let value = row.get::<alloc::Bytes>(ordinal)?;
    alloc::check()?;
    Ok(value.map(|b| b.0))
}

/// A `text` column of a result row, copied out fallibly ([`alloc::Text`]).
pub fn text_column(
    row: &pgrx::spi::SpiHeapTupleData<'_>,
    ordinal: usize,
) -> Result<Option<String>> {
    let value = row.get::<alloc::Text>(ordinal)?;
    alloc::check()?;
    Ok(value.map(|t| t.0))
}
