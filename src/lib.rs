//! syncular: the storage core of the Syncular sync engine, native inside PostgreSQL.
//!
//! `lib.rs` only wires the modules together. One folder per request path, named after what the
//! user calls (docs/DESIGN.md, "Where the rules live"):
//! - [`push`]: the push path, a file a step (the classic calls and the one-call `push_commit`);
//! - [`pull`]: the pull path (the commit window, the bootstrap scan, the one-call `pull`);
//! - [`reactions`]: the reaction outbox (enqueue, lease, read, the document);
//! - [`schema`]: schema versions (`migrate_schema` and the barrier, the push schema, the row
//!   codec's SQL face);
//! - [`tables`]: the app-table registry and the one module that touches host relations, with
//!   the sandbox, the one place host code runs.
//!
//! Below them, one concern a module:
//! - [`fence`]: the writer-fence trigger and functions (docs/DESIGN.md §Writer fence);
//! - [`jsonb`], [`commit`], [`log`]: the binary commit document, allocation and append
//!   (docs/DESIGN.md §Commit log); [`push_guard`]: one result and one commit per push in a
//!   transaction (below the push path, because `append_commit` consults it too);
//! - [`gate`]: the serve gate (docs/DESIGN.md §Serve gate); [`checkpoint`]: backfill
//!   checkpoints (docs/DESIGN.md §Checkpoints); [`notify`]: the opt-in NOTIFY after each commit;
//! - [`registry`], [`prune`]: partition registry and retention; [`scope`]: scope filters;
//!   [`rows`]: row metadata (scopes, blobs, tombstones); [`clients`]: client records and cursors;
//! - [`admin`]: blob-reference and admin reads; [`adopt`]: adoption of a 0.24 database;
//!   [`repair`]: the owner-only way back from a marker or fence set too high;
//! - [`codec`] (pure, no SQL): upstream's row codec and column versions (docs/CODEC.md);
//! - [`grants`]: what the roles `syncular_host` and `syncular_admin` may call;
//! - [`access`]: the calling role, the extension owner and the switch between identities;
//!   [`txn_local`]: transaction-local control state no session can set;
//! - [`args`], [`limits`], [`db`]: argument decoding and the size caps, SPI with kept plans;
//!   [`interrupts`]: the interrupt check of every loop over input; [`heap`]: the extension's
//!   tables below SQL (cached OIDs, direct inserts into the commit log); [`citus`]: whether
//!   Citus manages one of them (then nothing of it is read or written below SQL);
//! - [`error`]: the error catalogue and the one place that raises it; [`alloc`]: the global
//!   allocator and fallible allocation, so that out of memory is an ERROR, never an abort;
//! - [`port`]: Rust ports of PostgreSQL header code, each quoting what it ports.
//!
//! Privileges, decided per function (docs/SECURITY.md): the API functions are
//! `SECURITY DEFINER` (pinned `search_path = pg_catalog, pg_temp`) so that a host role needs only
//! membership in `syncular_host` / `syncular_admin` and can never write `sync_*` tables itself —
//! in particular it cannot insert an unfenced commit or lower a fence. Functions that must know
//! their caller (registration, adoption, the readers of app tables, the repairs) are
//! `SECURITY INVOKER` and switch rights themselves ([`access`]); no host code ever runs with the
//! extension owner's rights. The fence trigger is a definer function and reads the fence without
//! privilege checks, so every inserting role is fenced.

use pgrx::prelude::*;

mod access;
mod admin;
mod adopt;
mod alloc;
mod args;
mod catalog;
mod checkpoint;
mod citus;
mod clients;
mod codec;
mod commit;
mod db;
mod distribute;
mod error;
mod feed;
mod fence;
mod gate;
mod grants;
mod heap;
mod interrupts;
mod jsonb;
mod jsonb_write;
mod limits;
mod log;
mod materialized;
mod notify;
mod port;
mod prune;
mod pull;
mod push;
mod push_guard;
mod reactions;
mod registry;
mod repair;
mod rows;
mod schema;
mod scope;
mod tables;
#[cfg(any(test, feature = "pg_test"))]
mod testing;
mod txn_local;

::pgrx::pg_module_magic!(name, version);

/// Out of memory is an ERROR, never an abort ([`alloc`], docs/DESIGN.md §Memory).
#[global_allocator]
static ALLOCATOR: alloc::SoftFail = alloc::SoftFail;

/// Runs once per backend when the library loads: turns off Rust backtraces in errors, takes the
/// allocator's reserve, defines the extension's settings, installs the executor hook the row
/// codec's snapshot check reads (docs/SECURITY.md rule 19).
#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    no_backtraces();
    alloc::init();
    citus::init();
    notify::init();
    feed::init();
    schema::executor_snapshots::install();
}

/// pgrx's panic hook captures a Rust backtrace for every error that unwinds through Rust frames
/// and appends it to the error's DETAIL — what the client sees — whenever the server's
/// environment asks the Rust runtime for backtraces (`RUST_BACKTRACE`). The extension's own
/// error path raises errors again without it, but an error raised while pgrx unboxes an
/// argument (a cancel while a large argument is detoasted) never reaches that path (red team
/// 34, F2). So the runtime is told, before anything can be captured, not to capture: it reads
/// `RUST_LIB_BACKTRACE` first and keeps the answer for the process (docs/SECURITY.md rule 6).
/// The environment is the process's: another Rust extension loaded in the same backend loses
/// its backtraces in errors too.
fn no_backtraces() {
    if std::env::var_os("RUST_LIB_BACKTRACE").as_deref() != Some(std::ffi::OsStr::new("0")) {
        // A backend (and the postmaster loading preloaded libraries) runs one thread here, so
        // nothing reads the environment while it changes.
        std::env::set_var("RUST_LIB_BACKTRACE", "0");
    }
}

// Tables first: the functions' composite return types need them.
extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
// The trigger and its guard need the trigger function.
extension_sql_file!(
    "../sql/fence_guard.sql",
    name = "fence_guard",
    requires = [
        fence::writer_fence_trigger,
        fence::_fence_guard_busy,
        fence::_fence_guard_hold
    ]
);
// The row-meta trigger function runs with the owner's rights (it writes sync_* tables).
extension_sql!(
    "ALTER FUNCTION syncular.row_meta_trigger() SECURITY DEFINER SET search_path = pg_catalog, pg_temp;",
    name = "row_meta_trigger_definer",
    requires = [tables::row_meta::row_meta_trigger]
);
// The marker's stamp and its guard need the trigger function.
extension_sql_file!(
    "../sql/stamp_guard.sql",
    name = "stamp_guard",
    requires = [
        schema::stamp::schema_marker_stamp,
        schema::stamp::schema_stamp_own
    ]
);
// Privileges and comments: after everything else.
extension_sql_file!("../sql/finalize.sql", name = "finalize", finalize);

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![]
    }
}
