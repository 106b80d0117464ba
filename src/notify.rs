//! The opt-in change notification after each appended commit (docs/API.md, "Change
//! notifications"): with `syncular.notify_commits = on`, every `append_commit` sends
//! `NOTIFY syncular_commits, '{"partition":…,"commitSeq":…}'`. PostgreSQL delivers it when the
//! appending transaction commits (never for a rolled-back one), in commit order per session, so
//! host processes can fan a commit out to their realtime clients without polling the log.
//! Off by default: a notification costs the appender a queue entry and every listener a wakeup.

use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::prelude::*;
use pgrx::IntoDatum;

/// The channel every notification is sent on.
pub const CHANNEL: &str = "syncular_commits";

static NOTIFY_COMMITS: GucSetting<bool> = GucSetting::<bool>::new(false);

/// Defines the setting; called once per backend when the library loads.
pub fn init() {
    GucRegistry::define_bool_guc(
        c"syncular.notify_commits",
        c"Send NOTIFY syncular_commits after each appended commit.",
        c"Payload {\"partition\", \"commitSeq\"}, delivered when the appending transaction commits.",
        &NOTIFY_COMMITS,
        GucContext::Userset,
        GucFlags::default(),
    );
}

/// After `append_commit` appended `commit_seq` to `partition`: the notification, if enabled.
pub fn appended(partition: &str, commit_seq: i64) {
    if !NOTIFY_COMMITS.get() {
        return;
    }
    let payload = serde_json::json!({"partition": partition, "commitSeq": commit_seq}).to_string();
    // SAFETY: pg_notify(text, text) called with two non-NULL text datums of this call's memory
    // context; it queues the notification and returns void (an error, e.g. a payload over
    // 8,000 bytes, is raised as a PostgreSQL error and caught by pgrx).
    unsafe {
        pgrx::direct_function_call_as_datum(
            pg_sys::pg_notify,
            &[CHANNEL.into_datum(), payload.into_datum()],
        );
    }
}
