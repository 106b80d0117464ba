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

use crate::error::{Error, Result};
use pgrx::pg_sys;
use pgrx::spi::Spi;
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
/// (`pins` false), whether or not its snapshot shows the tables it is distributing, having
/// checked every node's pins itself (its statement's snapshot here predates the pins it just
/// committed on each node).
pub fn verify(pins: bool) -> Result<()> {
    let pinned_settings = PINNED
        .iter()
        .map(|(name, value)| format!("'{name}={value}'"))
        .collect::<Vec<_>>()
        .join(", ");
    // Catalog reads only (a read-only statement: pgrx's `Spi::get_two` would take a transaction
    // id, and `migrate_schema` must be the first write of its transaction); the constants are
    // this module's own.
    let sql = format!(
        "SELECT t.distributed, t.owned, t.pinned
           FROM (SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition p
                                 WHERE p.logicalrelid =
                                       'syncular.sync_partitions'::pg_catalog.regclass) AS distributed,
                        r.rolsuper OR d.datdba = e.extowner AS owned,
                        COALESCE((SELECT s.setconfig @> ARRAY[{pinned_settings}]::pg_catalog.text[]
                                    FROM pg_catalog.pg_db_role_setting s
                                   WHERE s.setrole = e.extowner AND s.setdatabase = d.oid),
                                 false) AS pinned
                   FROM pg_catalog.pg_extension e, pg_catalog.pg_database d
                   JOIN pg_catalog.pg_roles r ON r.oid = d.datdba
                  WHERE e.extname = 'syncular'
                    AND d.datname = pg_catalog.current_database()) t"
    );
    let (distributed, owned, pinned) = Spi::connect(|client| {
        client
            .select(&sql, Some(1), &[])?
            .first()
            .get_three::<bool, bool, bool>()
    })?;
    if pins && distributed != Some(true) {
        return Ok(());
    }
    if owned == Some(false) {
        return Err(Error::invalid_argument("database", "privilege").with_hint(
            "on Citus the database must belong to the extension owner or a superuser: its \
                 owner sets the defaults every session in it starts with, the extension owner's \
                 connections on the other nodes included (ALTER DATABASE … OWNER TO the \
                 extension owner), docs/SECURITY.md rule 20",
        ));
    }
    if pins && pinned == Some(false) {
        return Err(Error::invalid_argument("database", "privilege").with_hint(
            "the extension owner's settings in this database are not pinned on this node \
                 (search_path, standard_conforming_strings): run SELECT syncular.distribute() \
                 on the coordinator again, docs/SCALING.md",
        ));
    }
    Ok(())
}
