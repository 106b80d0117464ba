//! The change feed for realtime hosts (docs/API.md "Change feed", docs/DESIGN.md §Change feed):
//! with `shared_preload_libraries = 'syncular'` and `syncular.feed_database` set, a background
//! worker announces, at most once per `syncular.feed_interval_ms`, the new head of every
//! partition that moved, on the channel `notify_channel()` names — one notification for all of
//! an interval's commits, whatever the number of pushes and of listening host processes.
//! `publish` is the committing backend's side, `mailbox` the shared memory between the two,
//! `worker` the announcer.

mod mailbox;
mod publish;
mod worker;

pub use publish::appended;

use crate::error;
use pgrx::bgworkers::{BackgroundWorkerBuilder, BgWorkerStartTime};
use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::prelude::*;
use pgrx::JsonB;
use std::ffi::CString;
use std::sync::atomic::Ordering;
use std::time::Duration;

static FEED_DATABASE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static FEED_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(50);

/// Whether the library was preloaded, so the mailbox exists (set in the postmaster, inherited
/// by every process it forks).
static mut PRELOADED: bool = false;

/// Defines the settings; when preloaded, the shared memory and (with a database named) the
/// worker. Called once per process when the library loads.
pub fn init() {
    GucRegistry::define_int_guc(
        c"syncular.feed_interval_ms",
        c"The change feed's coalescing interval: at most one announcement per interval.",
        c"The commits of one interval are announced together, each partition with its highest commitSeq.",
        &FEED_INTERVAL_MS,
        1,
        1000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    // SAFETY: read in `_PG_init`, single-threaded; PostgreSQL sets it while it loads
    // shared_preload_libraries in the postmaster.
    if !unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        // A library loaded after startup may not define a postmaster setting (PostgreSQL ends
        // the backend: FATAL), and has no shared memory: no feed, `feed_status` says so.
        return;
    }
    GucRegistry::define_string_guc(
        c"syncular.feed_database",
        c"The database whose commits the change feed announces (needs shared_preload_libraries = 'syncular').",
        c"Empty: no feed. A background worker connects to it and notifies each interval's new partition heads on the channel syncular.notify_channel() names.",
        &FEED_DATABASE,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    mailbox::init();
    // SAFETY: the postmaster, single-threaded, before it forks anything.
    unsafe { PRELOADED = true };
    if database_setting().is_some() {
        BackgroundWorkerBuilder::new("syncular change feed")
            .set_type("syncular change feed")
            .set_library("syncular")
            .set_function("syncular_feed_main")
            .enable_spi_access()
            .set_start_time(BgWorkerStartTime::RecoveryFinished)
            .set_restart_time(Some(Duration::from_secs(1)))
            .load();
    }
}

fn preloaded() -> bool {
    // SAFETY: written only in the postmaster before any fork.
    unsafe { PRELOADED }
}

/// `syncular.feed_database`, when set.
fn database_setting() -> Option<String> {
    FEED_DATABASE
        .get()
        .and_then(|s| s.into_string().ok())
        .filter(|s| !s.is_empty())
}

fn interval_ms() -> i32 {
    FEED_INTERVAL_MS.get()
}

/// Whether a running feed worker serves this backend's database.
fn serves_this_database() -> bool {
    // SAFETY: `MyDatabaseId` is set in a connected backend.
    preloaded()
        && mailbox::DATABASE.get().load(Ordering::Acquire)
            == unsafe { pg_sys::MyDatabaseId }.to_u32()
}

/// The change feed's state for a host: whether it runs for this database, the worker's process
/// id (the sender every feed notification carries: a host drops any other), and the interval.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.feed_status() RETURNS jsonb
VOLATILE PARALLEL UNSAFE
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'feed_status_wrapper';
"#
)]
fn feed_status() -> JsonB {
    error::run(|| {
        let serving = serves_this_database();
        let pid = if serving {
            Some(mailbox::WORKER_PID.get().load(Ordering::Acquire))
        } else {
            None
        };
        Ok(JsonB(serde_json::json!({
            "running": serving,
            "pid": pid,
            "database": database_setting(),
            "intervalMs": interval_ms(),
            "preloaded": preloaded(),
        })))
    })
}
