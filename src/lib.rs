//! syncular: the storage core of the Syncular sync engine, native inside PostgreSQL.
//!
//! `lib.rs` only wires the modules together; each module owns one concern of the spec:
//! - [`error`]: the error catalogue and the one place that raises it;
//! - [`args`], [`db`]: argument decoding and SPI with kept plans;
//! - [`fence`]: the writer-fence trigger and functions (core-api §1);
//! - [`commit`], [`log`]: commit documents, allocation and append (core-api §2);
//! - [`gate`]: the serve gate (core-api §3);
//! - [`checkpoint`]: backfill checkpoints (core-api §4);
//! - [`barrier`]: the schema barrier (core-api §5);
//! - [`registry`], [`push`], [`prune`]: partition registry, push path and retention (storage-api).

use pgrx::prelude::*;

mod args;
mod barrier;
mod checkpoint;
mod commit;
mod db;
mod error;
mod fence;
mod gate;
mod log;
mod prune;
mod push;
mod registry;

::pgrx::pg_module_magic!(name, version);

// Tables first: the functions' composite return types need them.
extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
// The trigger and its guard need the trigger function.
extension_sql_file!("../sql/fence_guard.sql", name = "fence_guard", requires = [fence::writer_fence_trigger]);
// Privileges and comments: after everything else.
extension_sql_file!("../sql/finalize.sql", name = "finalize", finalize);

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {}

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![]
    }
}
