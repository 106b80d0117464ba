//! Citus (docs/SCALING.md): the one place that knows whether Citus runs in this database and
//! which of the extension's tables it manages. A table Citus distributes or replicates keeps its
//! rows in shards; the relation under its own name is an empty shell on every node. So nothing
//! of the extension may read or write such a table below SQL (src/heap.rs), and its statements
//! must let Citus plan them (no forced generic plans, src/db.rs) — issue 30, item 1.

pub mod one_partition;
pub mod owner_connections;
pub mod owner_sessions;
pub mod propagated;
mod subquery;

use crate::error::Result;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;

thread_local! {
    /// [`catalog`]'s last answer in this backend, `None` once a relation was created, dropped or
    /// renamed anywhere (the callback [`init`] registers): every lookup below SQL asks it
    /// (docs/BENCHMARKS.md, "Server CPU", step 6).
    static CATALOG: std::cell::Cell<Option<pg_sys::Oid>> = const { std::cell::Cell::new(None) };
}

/// Registers the callback that forgets [`catalog`]'s answer: PostgreSQL calls it where the
/// catalog cache drops a `pg_class` entry by name (a relation created, dropped or renamed, in
/// this session or another, seen when this backend reads invalidations — as the cache lookup
/// itself would see it), and on a reset of every cache; and installs the planning hook that
/// leaves Citus only the documented call forms to delegate (`subquery`: any other it may have
/// rewritten, and its deparse of that crashes).
pub fn init() {
    // SAFETY: a backend global, read in `_PG_init`: true only while the postmaster loads the
    // preloaded libraries, whose state every backend it forks inherits.
    PRELOADED.store(
        unsafe { pg_sys::process_shared_preload_libraries_in_progress },
        std::sync::atomic::Ordering::Relaxed,
    );
    subquery::install();
    owner_sessions::install();
    one_partition::init();
    // SAFETY: called once per backend from `_PG_init`; the callback only clears a cell.
    unsafe {
        pg_sys::CacheRegisterSyscacheCallback(
            pg_sys::SysCacheIdentifier::RELNAMENSP as std::ffi::c_int,
            Some(forget_catalog),
            pg_sys::Datum::from(0),
        );
    }
}

/// Whether this process got the library from `shared_preload_libraries` ([`init`]).
static PRELOADED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A node that serves the extension's distributed tables must load the library when it starts:
/// its planning hook is what leaves Citus only the documented call forms to delegate
/// (`subquery`), and a node that loads it at a session's first call plans that session's first
/// queries unguarded. `distribute()` checks every node it knows; a node added afterwards is
/// refused here, at its first call that touches a distributed table — and, since it could not have
/// seen the settings Citus replays (`propagated`), at its first call of any kind (red team 41, F2):
/// `SY000` (`database`, `missing`), the HINT saying what to set.
pub fn require_preloaded() -> Result<()> {
    if PRELOADED.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(());
    }
    Err(
        crate::error::Error::invalid_argument("database", "missing").with_hint(format!(
            "this Citus node does not load syncular when it starts: {PRELOAD_FIX}"
        )),
    )
}

/// What to do where a node does not preload the library: the end of the HINT of this refusal
/// and of `distribute()`'s (src/distribute.rs).
pub const PRELOAD_FIX: &str = "set shared_preload_libraries = 'citus,syncular' on every node \
    and restart it (its planning hook keeps Citus from delegating calls it would crash on), \
    docs/SCALING.md";

/// The syscache callback of [`init`]: cannot fail, allocates nothing.
unsafe extern "C-unwind" fn forget_catalog(_: pg_sys::Datum, _: std::ffi::c_int, _: u32) {
    // `try_with`: no panic even while the thread's locals are torn down.
    let _ = CATALOG.try_with(|c| c.set(None));
}

/// Citus's catalog of the tables it manages, `pg_catalog.pg_dist_partition`, if Citus is
/// installed in this database (one catalog-cache lookup, kept until [`init`]'s callback).
fn catalog() -> pg_sys::Oid {
    if let Some(oid) = CATALOG.with(std::cell::Cell::get) {
        return oid;
    }
    // SAFETY: a catalog-cache lookup by name in a transaction; InvalidOid when absent.
    let oid = unsafe {
        pg_sys::get_relname_relid(
            c"pg_dist_partition".as_ptr(),
            pg_sys::Oid::from(pg_sys::PG_CATALOG_NAMESPACE),
        )
    };
    CATALOG.with(|c| c.set(Some(oid)));
    oid
}

/// Whether Citus is installed in this database.
pub fn installed() -> bool {
    catalog() != pg_sys::InvalidOid
}

// PostgreSQL's own planner, called as C calls it: an ERROR raised in it (or in a planner hook
// installed before ours) jumps straight over the hooks that call it, which hold nothing that needs
// dropping — as src/schema/executor_snapshots.rs calls the executor. Not through pgrx's guarded
// binding: that turns the ERROR into a Rust panic, which unwound into PostgreSQL's C frames from
// this hook and aborted the backend on any planning error (`SELECT 1/0`; an out-of-memory one in
// the memory-limited suite first), and raised again by pgrx an ERROR loses its SQLSTATE.
unsafe extern "C-unwind" {
    #[link_name = "standard_planner"]
    fn standard_planner(
        parse: *mut pg_sys::Query,
        query_string: *const std::ffi::c_char,
        cursor_options: std::ffi::c_int,
        bound: pg_sys::ParamListInfo,
    ) -> *mut pg_sys::PlannedStmt;
}

/// The planner a hook of ours was installed over — `previous`, or PostgreSQL's own — called raw
/// (above): the planner hooks of `owner_sessions` and `subquery`.
///
/// # Safety
/// PostgreSQL's planner arguments, passed on unchanged.
unsafe fn plan_with(
    previous: pg_sys::planner_hook_type,
    parse: *mut pg_sys::Query,
    query_string: *const std::ffi::c_char,
    cursor_options: std::ffi::c_int,
    bound: pg_sys::ParamListInfo,
) -> *mut pg_sys::PlannedStmt {
    // SAFETY: the caller's arguments; the hook before ours takes the same ones.
    unsafe {
        match previous {
            Some(previous) => previous(parse, query_string, cursor_options, bound),
            None => standard_planner(parse, query_string, cursor_options, bound),
        }
    }
}

/// The setting command a utility statement is (`SET`, `RESET`, …), for the utility hook's checks
/// of `propagated` and `one_partition`.
///
/// # Safety
/// `statement` is null or the `PlannedStmt` PostgreSQL hands the utility hook.
unsafe fn setting_command(
    statement: *mut pg_sys::PlannedStmt,
) -> Option<*mut pg_sys::VariableSetStmt> {
    // SAFETY: the caller's guarantee; a node's tag is its first field.
    unsafe {
        let utility = if statement.is_null() {
            std::ptr::null_mut()
        } else {
            (*statement).utilityStmt
        };
        (!utility.is_null() && (*utility).type_ == pg_sys::NodeTag::T_VariableSetStmt)
            .then(|| utility.cast::<pg_sys::VariableSetStmt>())
    }
}

/// Whether Citus distributes the extension's tables in this database (`sync_partitions` is
/// Citus's): where it does not, the extension's statements stay on this node.
///
/// # Safety
/// Must run inside a transaction.
pub unsafe fn sync_tables_distributed() -> bool {
    // SAFETY: catalog-cache lookups by name, then [`manages`].
    unsafe {
        let namespace = pg_sys::get_namespace_oid(c"syncular".as_ptr(), true);
        let partitions = pg_sys::get_relname_relid(c"sync_partitions".as_ptr(), namespace);
        partitions != pg_sys::InvalidOid && manages(partitions)
    }
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
        let column = crate::catalog::live_attribute((*table).rd_att, c"logicalrelid", |t| {
            t == pg_sys::REGCLASSOID || t == pg_sys::OIDOID
        });
        let Some(column) = column else {
            pg_sys::table_close(table, lock);
            // A catalog of another shape is not Citus's: nothing to avoid.
            return false;
        };
        let mut key = crate::catalog::equality_key(
            column,
            (pg_sys::F_OIDEQ, pg_sys::InvalidOid),
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
/// that has reference tables): its shard, found from Citus's own metadata functions
/// (`get_shard_id_for_distribution_column`, `shard_name`); `None` when that shard is not placed
/// on this node (a call through the coordinator, or one routed here before a move: the row is
/// read through Citus, by SQL, instead).
///
/// A shard table of that name on this node is not enough: after a move Citus keeps the old copy
/// until its maintenance daemon drops it, and a delegated call takes no lock that keeps it off
/// the old node (docs/SCALING.md, "a moved shard's old copy"). So the shard's metadata is locked
/// first in share mode — the lock Citus's own writes take and a move's last phase holds
/// exclusively, `lock_shard_metadata`, as the extension owner, who owns the shards — and the
/// placement is then read in a snapshot taken after the lock: the shard is used only while an
/// active placement of it is in this node's group (`pg_dist_placement`, `pg_dist_local_group`),
/// and no move can switch it before this transaction ends.
///
/// The answer is kept for the rest of the (sub)transaction that took the lock (`txn_local`,
/// which drops it with a rolled-back subtransaction, as PostgreSQL releases its locks): a push
/// looks its partition's shards up a dozen times.
pub fn local_shard(table: pg_sys::Oid, key: Option<&str>) -> Result<Option<pg_sys::Oid>> {
    use crate::txn_local::{self, Key};
    // The table, and the key (a reference table has none): the value is "<shard oid>|<this>".
    let of = match key {
        None => format!("{}|r", table.to_u32()),
        Some(key) => format!("{}|d|{key}", table.to_u32()),
    };
    let kept = txn_local::find(Key::CitusShard, |value| {
        let (shard, named) = value.split_once('|')?;
        (named == of).then(|| shard.parse::<u32>().ok().map(pg_sys::Oid::from))
    });
    if let Some(shard) = kept {
        return Ok(shard.filter(|oid| *oid != pg_sys::InvalidOid));
    }
    let found = placed_shard(table, key)?.filter(|_| local_execution_claimed());
    let shard = found.map_or(0, |oid| oid.to_u32());
    txn_local::set(Key::CitusShard, &format!("{shard}|{of}"));
    Ok(found)
}

/// The refusal of a statement that would read another node's copy of the reference table
/// `table` (`SY004`, reason `citus_local_execution`; [`crate::heap::registry_read_here`]).
pub fn not_this_nodes_copy(table: &str) -> crate::error::Error {
    crate::error::Error::Sync {
        code: crate::error::Code::InvalidTransactionState,
        detail: Some(serde_json::json!({"reason": "citus_local_execution"})),
        hint: Some(format!(
            "on Citus, syncular.{table} is read from this node's own copy, through Citus's \
             local execution: make the call on a node that holds one (a worker, or the \
             coordinator added with citus_set_coordinator_host), with \
             citus.enable_local_execution on, before this transaction sends a statement to \
             this node over a connection (or in a transaction of its own)"
        )),
    }
}

/// Whether this transaction may read and write a shard on this node below SQL, as Citus's own
/// local execution does — and if so, Citus is told it did (`SetLocalExecutionStatus(
/// LOCAL_EXECUTION_REQUIRED)`, what its local executor records for every shard it touches), so
/// its later statements in the transaction run on this node's shards in this transaction too
/// and read what was written here below SQL. Not when `citus.enable_local_execution` is off,
/// nor once the transaction sent a statement to this node over a connection
/// (`LOCAL_EXECUTION_DISABLED`: that other session could neither see what is written here nor
/// wait for it without deadlocking this one), nor where this Citus lacks the two functions
/// (another version): the statement path then goes where Citus sends it (docs/SCALING.md, "How
/// a call is routed"). And never where Citus's own local executor would refuse the statement:
/// inside a query Citus sent to a shard (a host's `SELECT syncular.append_commit(…) FROM` a
/// distributed table, pushed down whole), each of whose per-shard queries commits on its own —
/// Citus's own check raises its own error there (`EnsureTaskExecutionAllowed`, red team 38, F2).
fn local_execution_claimed() -> bool {
    // `LocalExecutionStatus` (Citus's distributed/local_executor.h): REQUIRED, OPTIONAL, DISABLED.
    const REQUIRED: std::ffi::c_int = 0;
    const DISABLED: std::ffi::c_int = 2;
    // SAFETY: a setting read by name (NULL when Citus defines none); the three functions are
    // looked up in the loaded Citus library by their exported names and have these C signatures
    // in Citus 13 (`LocalExecutionStatus` is a C enum: an int); setting the status it already has
    // or REQUIRED from OPTIONAL cannot raise; `EnsureTaskExecutionAllowed` raises Citus's ERROR
    // by design, which unwinds through the guard like every other.
    unsafe {
        let enabled =
            pg_sys::GetConfigOption(c"citus.enable_local_execution".as_ptr(), true, false);
        if enabled.is_null() || std::ffi::CStr::from_ptr(enabled) != c"on" {
            return false;
        }
        let (get, set, allowed) = (
            library_function(c"GetCurrentLocalExecutionStatus"),
            library_function(c"SetLocalExecutionStatus"),
            library_function(c"EnsureTaskExecutionAllowed"),
        );
        if get.is_null() || set.is_null() || allowed.is_null() {
            return false;
        }
        let get: unsafe extern "C-unwind" fn() -> std::ffi::c_int = std::mem::transmute(get);
        let set: unsafe extern "C-unwind" fn(std::ffi::c_int) = std::mem::transmute(set);
        let allowed: unsafe extern "C-unwind" fn(bool) = std::mem::transmute(allowed);
        if pg_sys::ffi::pg_guard_ffi_boundary(|| get()) == DISABLED {
            return false;
        }
        // A local task, as Citus's local executor checks one (`isRemote` false) — with
        // `citus.allow_nested_distributed_execution` off for the check: a role may turn it on
        // for itself, and Citus would then let its statements run inside a per-shard query,
        // where writes below SQL commit with that query alone (red team 39's note).
        let checked = crate::db::with_settings(
            &[(c"citus.allow_nested_distributed_execution", c"off")],
            || {
                pg_sys::ffi::pg_guard_ffi_boundary(|| allowed(false));
                Ok(())
            },
        );
        if checked.is_err() {
            return false;
        }
        pg_sys::ffi::pg_guard_ffi_boundary(|| set(REQUIRED));
        true
    }
}

/// Runs `body` — a `LOCK TABLE` of the extension's, which Citus runs on every node — with the
/// two settings without which Citus takes the lock on this node only
/// (`AcquireDistributedLockOnRelations` returns early when `citus.enable_ddl_propagation` or
/// `citus.enable_metadata_sync` is off). Any role may turn either off for itself (`SET`,
/// `ALTER ROLE … SET`): the schema barrier and a migration's lock on the tables it re-encodes
/// then held on no worker, and a push at the old version applied under the migration (red team
/// 49, F2). Set in a nest level of their own, undone after `body`; nothing to do without Citus.
pub fn propagating_locks<R>(body: impl FnOnce() -> Result<R>) -> Result<R> {
    if !installed() {
        return body();
    }
    crate::db::with_settings(
        &[
            (c"citus.enable_ddl_propagation", c"on"),
            (c"citus.enable_metadata_sync", c"on"),
        ],
        body,
    )
}

/// A function Citus's library exports, looked up by name: null where this Citus lacks it (another
/// version); the caller gives it the C signature it has in Citus 13.
///
/// # Safety
/// Inside a backend of a database where Citus is installed (its library can be loaded: a
/// missing library is an ERROR).
unsafe fn library_function(name: &std::ffi::CStr) -> *mut std::ffi::c_void {
    // SAFETY: the caller's guarantee; NUL-terminated names, no file handle asked for.
    unsafe {
        pg_sys::load_external_function(
            c"$libdir/citus".as_ptr(),
            name.as_ptr(),
            false,
            std::ptr::null_mut(),
        )
    }
}

/// Whether this transaction has reached another node through Citus (Citus's
/// `InCoordinatedTransaction()`: a statement it sent over a connection of the transaction, a
/// read included). False without Citus, or where this Citus lacks the function.
pub fn reached_other_nodes() -> bool {
    if !installed() {
        return false;
    }
    // SAFETY: Citus is installed in this database, so its library loads;
    // `bool InCoordinatedTransaction(void)` (transaction_management.h) reads a backend global.
    unsafe { library_flag(c"InCoordinatedTransaction") }.unwrap_or(false)
}

/// The answer of Citus's `bool name(void)` — a question about this backend's state — behind
/// pgrx's guard (an ERROR it raised passes as PostgreSQL's own); `None` where this Citus lacks
/// the function.
///
/// # Safety
/// As [`library_function`]; `name` has that C signature in Citus 13.
unsafe fn library_flag(name: &std::ffi::CStr) -> Option<bool> {
    // SAFETY: the caller's guarantees; a non-null symbol has the signature the caller names.
    unsafe {
        let found = library_function(name);
        if found.is_null() {
            return None;
        }
        let flag: unsafe extern "C-unwind" fn() -> bool = std::mem::transmute(found);
        Some(pg_sys::ffi::pg_guard_ffi_boundary(|| flag()))
    }
}

/// Makes Citus send this session's `lock_timeout` along with the transaction's next statements
/// to every node they reach. Citus runs a `LOCK TABLE` of a distributed table — the schema
/// barrier's ([`crate::db::lock_barrier`]) — on every node over its connections, and the wait
/// there is the node's own: the session's `lock_timeout` did not bound it (a migration on the
/// coordinator with `lock_timeout = 1s` waited 7 s for a push on a worker). Citus sends a
/// `SET LOCAL` made while `citus.propagate_set_commands = local` to the transaction's
/// connections, in a transaction block (which `migrate_schema` requires); the setting itself is
/// set only around that statement. Nothing to do without Citus or without a `lock_timeout`.
pub fn send_lock_timeout() -> Result<()> {
    // SAFETY: backend globals, read inside a transaction.
    let (ms, block) = unsafe { (pg_sys::LockTimeout, pg_sys::IsTransactionBlock()) };
    if ms <= 0 || !block || !installed() {
        return Ok(());
    }
    crate::db::with_settings(&[(c"citus.propagate_set_commands", c"local")], || {
        // An integer of milliseconds: the session's own value, set again so Citus sends it.
        // Harmless on the owner's connections, so not a reason to refuse the call
        // (`propagated`).
        propagated::ours(|| Spi::run(&format!("SET LOCAL lock_timeout = {ms}")))?;
        Ok(())
    })
}

/// [`placed_shard`]'s first statement: the shard of the table's row for the key (a reference
/// table's one shard), its metadata locked in share mode as the statement returns it.
const SHARD_SQL: &str = "SELECT s.shard, pg_catalog.lock_shard_metadata(5, ARRAY[s.shard])
       FROM (SELECT CASE WHEN p.partmethod = 'n'
                         THEN (SELECT d.shardid FROM pg_catalog.pg_dist_shard d
                                WHERE d.logicalrelid = p.logicalrelid
                                ORDER BY d.shardid LIMIT 1)
                         ELSE pg_catalog.get_shard_id_for_distribution_column(p.logicalrelid, $2)
                       END AS shard
               FROM pg_catalog.pg_dist_partition p
              WHERE p.logicalrelid = $1::pg_catalog.oid::pg_catalog.regclass) s
      WHERE s.shard IS NOT NULL";

/// [`placed_shard`]'s second statement: the shard's relation here (a catalog lookup, in the
/// catalog's own snapshot: `to_regclass`, as Citus hides its shards from queries of `pg_class`),
/// in the table's own schema. `shard_name` leaves the name of a shard of a table in `public`
/// unqualified, which the pinned `search_path` does not resolve (a host's app table there was
/// never found), so its last part is qualified with the table's schema.
const SHARD_RELATION_SQL: &str = "SELECT pg_catalog.to_regclass(pg_catalog.quote_ident(n.nspname) || '.'
                                    || pg_catalog.quote_ident(p[pg_catalog.array_upper(p, 1)]))::pg_catalog.oid
       FROM pg_catalog.pg_class t
       JOIN pg_catalog.pg_namespace n ON n.oid = t.relnamespace,
            pg_catalog.parse_ident(pg_catalog.shard_name($1::pg_catalog.oid::pg_catalog.regclass, $2)) p
      WHERE t.oid = $1";

/// Whether an active placement of `shard` is in this node's group (`pg_dist_placement`,
/// `pg_dist_local_group`), read below SQL in a snapshot taken now — whatever the transaction's
/// isolation: a REPEATABLE READ transaction's own snapshot can be older than a move, showed the
/// old placement active, and the old copy was read (a fence raised after the move unseen: red
/// team 36, F1), while Citus routes by its metadata cache, which follows the move. The caller
/// holds the shard's metadata lock, so no move switches the placement after this read.
///
/// # Safety
/// Must run inside a transaction.
unsafe fn placement_here(shard: i64) -> Result<bool> {
    use crate::catalog::{equality_key, live_attribute};
    use crate::error::Error;
    let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
    let missing = |what: &str| Error::Internal(format!("syncular: Citus's {what} is missing"));
    // SAFETY: catalog lookups by name in pg_catalog; each table is opened, scanned with a
    // registered snapshot (a systable scan, through the shard-id index when it is there) and
    // closed here; columns are found by name and type in each table's own descriptor.
    unsafe {
        let relid = |name: &std::ffi::CStr| {
            pg_sys::get_relname_relid(
                name.as_ptr(),
                pg_sys::Oid::from(pg_sys::PG_CATALOG_NAMESPACE),
            )
        };
        let (groups, placements) = (relid(c"pg_dist_local_group"), relid(c"pg_dist_placement"));
        if groups == pg_sys::InvalidOid || placements == pg_sys::InvalidOid {
            return Err(missing("placement catalog"));
        }
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        let int4 = |t| t == pg_sys::INT4OID;
        // This node's group: the one row of pg_dist_local_group.
        let table = pg_sys::table_open(groups, lock);
        let column = live_attribute((*table).rd_att, c"groupid", int4);
        let scan = pg_sys::systable_beginscan(
            table,
            pg_sys::InvalidOid,
            false,
            snapshot,
            0,
            std::ptr::null_mut(),
        );
        let tuple = pg_sys::systable_getnext(scan);
        let group = match (column, tuple.is_null()) {
            (Some(column), false) => {
                let mut null = false;
                let datum = pg_sys::heap_getattr(tuple, column.into(), (*table).rd_att, &mut null);
                (!null).then(|| i32::from_datum(datum, false)).flatten()
            }
            _ => None,
        };
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(table, lock);
        let Some(group) = group else {
            pg_sys::UnregisterSnapshot(snapshot);
            return Err(missing("local group"));
        };
        let table = pg_sys::table_open(placements, lock);
        let descriptor = (*table).rd_att;
        let columns = (
            live_attribute(descriptor, c"shardid", |t| t == pg_sys::INT8OID),
            live_attribute(descriptor, c"shardstate", int4),
            live_attribute(descriptor, c"groupid", int4),
        );
        let (Some(shard_column), Some(state_column), Some(group_column)) = columns else {
            pg_sys::table_close(table, lock);
            pg_sys::UnregisterSnapshot(snapshot);
            return Err(missing("placement catalog's shape"));
        };
        let index = relid(c"pg_dist_placement_shardid_index");
        let mut key = equality_key(
            shard_column,
            (pg_sys::F_INT8EQ, pg_sys::InvalidOid),
            pg_sys::Datum::from(shard),
        );
        let scan = pg_sys::systable_beginscan(
            table,
            index,
            index != pg_sys::InvalidOid,
            snapshot,
            1,
            &mut key,
        );
        let mut here = false;
        loop {
            crate::interrupts::check();
            let tuple = pg_sys::systable_getnext(scan);
            if tuple.is_null() {
                break;
            }
            let read = |column: i16| {
                let mut null = false;
                let datum = pg_sys::heap_getattr(tuple, column.into(), descriptor, &mut null);
                (!null).then(|| i32::from_datum(datum, false)).flatten()
            };
            if read(state_column) == Some(1) && read(group_column) == Some(group) {
                here = true;
                break;
            }
        }
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(table, lock);
        pg_sys::UnregisterSnapshot(snapshot);
        Ok(here)
    }
}

/// [`local_shard`], asked of Citus: the shard's metadata locked, its placement read below SQL
/// in a fresh snapshot ([`placement_here`]), then its relation — two statements with plans kept
/// per backend (`db::write`: a push asks this for each of the
/// tables it reads or writes below SQL, and planning them again was most of a delegated push's
/// time, docs/BENCHMARKS.md "Citus").
fn placed_shard(table: pg_sys::Oid, key: Option<&str>) -> Result<Option<pg_sys::Oid>> {
    crate::access::as_extension_owner(|| {
        crate::db::with_spi(|client| {
            let found = crate::db::write(
                client,
                SHARD_SQL,
                &[DatumWithOid::from(table), DatumWithOid::from(key)],
            )?;
            if found.is_empty() {
                return Ok(None);
            }
            let Some(shard) = found.first().get::<i64>(1)? else {
                return Ok(None);
            };
            // SAFETY: inside the call's transaction, after the metadata lock above.
            if !unsafe { placement_here(shard)? } {
                return Ok(None);
            }
            let placed = crate::db::write(
                client,
                SHARD_RELATION_SQL,
                &[DatumWithOid::from(table), DatumWithOid::from(shard)],
            )?;
            if placed.is_empty() {
                return Ok(None);
            }
            Ok(placed.first().get::<pg_sys::Oid>(1)?)
        })
    })
    .map(|found| found.filter(|oid| *oid != pg_sys::InvalidOid))
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    /// The kept answer to "is Citus installed" is dropped when a relation of that name appears:
    /// a table `manages` said no to before is managed once `pg_dist_partition` lists it (here a
    /// stand-in made with `allow_system_table_mods`; the invalidation is the catalog cache's own,
    /// which other sessions receive as this one does).
    #[pg_test]
    fn the_kept_citus_answer_follows_its_catalog_appearing() {
        Spi::run("CREATE TABLE public.plain (id int PRIMARY KEY)").expect("table");
        let oid = Spi::get_one::<pg_sys::Oid>("SELECT 'public.plain'::regclass::oid")
            .expect("query")
            .expect("oid");
        // SAFETY: inside the test's transaction.
        assert!(!unsafe { super::manages(oid) });
        assert!(!super::installed());
        Spi::run(
            "SET LOCAL allow_system_table_mods = on;
             CREATE TABLE pg_catalog.pg_dist_partition (logicalrelid pg_catalog.regclass);
             INSERT INTO pg_catalog.pg_dist_partition VALUES ('public.plain');",
        )
        .expect("stand-in catalog");
        assert!(super::installed());
        // SAFETY: as above.
        assert!(unsafe { super::manages(oid) });
        Spi::run("DROP TABLE pg_catalog.pg_dist_partition").expect("drop");
        // SAFETY: as above.
        assert!(!unsafe { super::manages(oid) });
    }
}
