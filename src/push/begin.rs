//! `push_begin`, the classic push's first call (docs/DESIGN.md §Push path): the partition lock,
//! the gate under the lock (a snapshot taken after the lock was granted) and the locked
//! idempotency re-check; a push that has no stored result begins in the push guard
//! (src/push_guard.rs) until the transaction ends.

use super::result::{stored_result, PushKey};
use crate::args;
use crate::db;
use crate::error;
use crate::gate;
use crate::log;
use crate::push_guard;
use crate::schema::barrier;
use pgrx::prelude::*;
use pgrx::JsonB;

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn push_begin(
    partition: Option<&str>,
    client_id: Option<&str>,
    client_commit_id: Option<&str>,
    running_schema_version: Option<i64>,
    declared: default!(Option<args::JsonArg>, "'[]'"),
) -> Option<JsonB> {
    error::run(|| {
        barrier::require_transaction(false)?;
        let key = PushKey::new(partition, client_id, client_commit_id)?;
        crate::citus::one_partition::require(&key.partition)?;
        let running = args::count("running_schema_version", running_schema_version)?;
        let declared = args::declarations(declared)?;
        db::with_spi(|client| {
            log::lock(client, &key.partition)?;
            // Under the lock, with a snapshot taken after it was granted.
            gate::read_state(client, Some(&key.partition), running, true)?
                .assert_ready(running, &declared)?;
            let stored = stored_result(client, &key.parts(), true)?;
            if stored.is_none() {
                push_guard::begin(&key.partition, &key.client_id, &key.client_commit_id);
            }
            Ok(stored)
        })
        .map(|r| r.map(JsonB))
    })
}
