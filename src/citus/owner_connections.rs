//! The settings the extension owner's connections start with on the other nodes (red teams 47
//! and 48; docs/SECURITY.md rule 20; docs/SCALING.md "Setup from an empty Citus cluster").
//!
//! Citus sends the extension's statements to the other nodes over connections opened as the
//! extension owner, which start with the owner's settings in the database there — the
//! database's defaults (`ALTER DATABASE … SET`, which its owner may make) unless the owner's own
//! outrank them — and its deparsed SQL names built-in functions unqualified and quotes string
//! values by the coordinator's rules. A schema named after the owner on the default
//! `search_path`, or a database default `search_path`, put a role's functions ahead of
//! `pg_catalog` there; a database default `standard_conforming_strings = off` turned a caller's
//! `\'` into the end of a quoted value, and the rest into SQL run as the superuser. So
//! `distribute()` pins [`PINNED`] for the owner in the database on every node, and every call on
//! a database whose sync tables Citus distributes first checks ([`check`], once per transaction)
//! that the pins are there on this node and that the database belongs to the extension owner or
//! a superuser (whoever owns it sets every session's defaults there): refused otherwise, `SY000`
//! (`database`, `privilege`), the HINT saying what to run.

use crate::catalog::{equality_key, live_attribute};
use crate::error::{Error, Result};
use pgrx::pg_sys;
use pgrx::FromDatum;
use std::cell::Cell;

/// What the owner's sessions in the database start with on every node, as `pg_db_role_setting`
/// stores each (`name=value`).
pub const PINNED: [(&str, &str); 2] = [
    ("search_path", "pg_catalog, pg_temp"),
    ("standard_conforming_strings", "on"),
];

thread_local! {
    /// The local transaction in which [`check`] passed.
    static CHECKED_IN: Cell<Option<pg_sys::LocalTransactionId>> = const { Cell::new(None) };
    /// True while `distribute()` runs: the call that sets the pins cannot require them.
    static PINNING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `body` — `distribute()` — without [`check`].
pub fn pinning<R>(body: impl FnOnce() -> R) -> R {
    let before = PINNING.replace(true);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    PINNING.set(before);
    result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// Where Citus distributes the extension's tables (before `distribute()`, the owner's statements
/// stay on this node): the database belongs to the extension owner or a superuser, and the
/// owner's settings in it hold [`PINNED`] on this node.
pub fn check() -> Result<()> {
    let now = crate::port::local_transaction_id_if_any();
    if PINNING.get() || CHECKED_IN.get() == Some(now) || !super::installed() {
        return Ok(());
    }
    verify(true)?;
    CHECKED_IN.set(Some(now));
    Ok(())
}

/// [`check`]'s test itself, whenever asked: `distribute()` asks for the database's owner only
/// (`pins` false), whether or not the tables it is distributing are Citus's yet, having checked
/// every node's pins itself. Read below SQL under the catalog snapshot, as Citus's sessions on
/// the other nodes check the pins (`owner_sessions`): no statement (a call on Citus asks once
/// per transaction), and one reading of the pins on every node.
pub fn verify(pins: bool) -> Result<()> {
    // SAFETY: catalog reads inside the calling transaction.
    let (owned, pinned) = unsafe {
        let Some(owner) = crate::catalog::extension_owner(c"syncular") else {
            return Ok(());
        };
        if pins && !super::sync_tables_distributed() {
            return Ok(());
        }
        (database_owned_by(owner), !pins || pinned_here(owner))
    };
    if !owned {
        return Err(Error::invalid_argument("database", "privilege").with_hint(
            "on Citus the database must belong to the extension owner or a superuser: its \
                 owner sets the defaults every session in it starts with, the extension owner's \
                 connections on the other nodes included (ALTER DATABASE … OWNER TO the \
                 extension owner), docs/SECURITY.md rule 20",
        ));
    }
    if !pinned {
        return Err(Error::invalid_argument("database", "privilege").with_hint(
            "the extension owner's settings in this database are not pinned on this node \
                 (search_path, standard_conforming_strings): run SELECT syncular.distribute() \
                 on the coordinator again, docs/SCALING.md",
        ));
    }
    Ok(())
}

/// Whether this database belongs to `owner` or to a superuser (`pg_database.datdba`, from the
/// catalog cache).
///
/// # Safety
/// Inside a transaction.
unsafe fn database_owned_by(owner: pg_sys::Oid) -> bool {
    // SAFETY: a catalog-cache tuple of this database, released below; its fixed part read as
    // `pg_database`'s form, whose `datdba` lies in it.
    unsafe {
        let cache = pg_sys::SysCacheIdentifier::DATABASEOID as std::ffi::c_int;
        let tuple = pg_sys::SearchSysCache1(cache, pg_sys::Datum::from(pg_sys::MyDatabaseId));
        if tuple.is_null() {
            return false;
        }
        let datdba = (*(pg_sys::GETSTRUCT(tuple) as *const pg_sys::FormData_pg_database)).datdba;
        pg_sys::ReleaseSysCache(tuple);
        datdba == owner || pg_sys::superuser_arg(datdba)
    }
}

/// Whether `owner`'s settings in this database (`pg_db_role_setting`) hold every pin of
/// [`PINNED`], read below SQL under the catalog snapshot.
///
/// # Safety
/// Inside a transaction.
pub(super) unsafe fn pinned_here(owner: pg_sys::Oid) -> bool {
    let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
    // SAFETY: the catalog table is found by name in pg_catalog, opened, scanned with two keys on
    // columns found by name and type in its own descriptor, and closed here; the array is copied
    // out before the scan ends.
    unsafe {
        let catalog = pg_sys::get_relname_relid(
            c"pg_db_role_setting".as_ptr(),
            pg_sys::Oid::from(pg_sys::PG_CATALOG_NAMESPACE),
        );
        if catalog == pg_sys::InvalidOid {
            return false;
        }
        let table = pg_sys::table_open(catalog, lock);
        let descriptor = (*table).rd_att;
        let oid = |t| t == pg_sys::OIDOID;
        let columns = (
            live_attribute(descriptor, c"setdatabase", oid),
            live_attribute(descriptor, c"setrole", oid),
            live_attribute(descriptor, c"setconfig", |t| t == pg_sys::TEXTARRAYOID),
        );
        let (Some(database), Some(role), Some(config)) = columns else {
            pg_sys::table_close(table, lock);
            return false;
        };
        let mut keys = [
            equality_key(
                database,
                (pg_sys::F_OIDEQ, pg_sys::InvalidOid),
                pg_sys::Datum::from(pg_sys::MyDatabaseId),
            ),
            equality_key(
                role,
                (pg_sys::F_OIDEQ, pg_sys::InvalidOid),
                pg_sys::Datum::from(owner),
            ),
        ];
        let scan = pg_sys::systable_beginscan(
            table,
            pg_sys::InvalidOid,
            false,
            std::ptr::null_mut(),
            keys.len() as std::ffi::c_int,
            keys.as_mut_ptr(),
        );
        let tuple = pg_sys::systable_getnext(scan);
        let settings: Vec<String> = if tuple.is_null() {
            Vec::new()
        } else {
            let mut null = false;
            let datum = pg_sys::heap_getattr(tuple, config.into(), descriptor, &mut null);
            Vec::<Option<String>>::from_datum(datum, null)
                .unwrap_or_default()
                .into_iter()
                .flatten()
                .collect()
        };
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(table, lock);
        PINNED
            .iter()
            .all(|(name, value)| settings.iter().any(|s| *s == format!("{name}={value}")))
    }
}
