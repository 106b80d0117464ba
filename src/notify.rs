//! The opt-in change notification after each appended commit (docs/API.md, "Change
//! notifications"): with `syncular.notify_commits = on`, every append sends
//! `NOTIFY <channel>, '{"partition":…,"commitSeq":…}'`. PostgreSQL delivers it when the appending
//! transaction commits (never for a rolled-back one), in commit order per session, so host
//! processes can wake their realtime clients without polling the log.
//! Off by default: a notification costs the appender a queue entry and every listener a wakeup.
//!
//! PostgreSQL has no privilege on `LISTEN` or `NOTIFY`: any role that can connect may listen on,
//! or send to, any channel whose name it knows. So the channel is not a fixed name but a random
//! one made by the install (`sync_notify_channel`, sql/schema.sql), which only the extension owner
//! reads, and `syncular_host` through [`notify_channel`] (docs/SECURITY.md, "Notifications").
//! A notification is a wake-up, never a fact: a host reads the partition's head from the database
//! (`max_commit_seq`) before acting on one, so even a notification forged by a role that knows the
//! channel cannot make it skip or invent a commit.

use crate::error::{self, Error, Result};
use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::prelude::*;
use pgrx::IntoDatum;
use std::cell::RefCell;

static NOTIFY_COMMITS: GucSetting<bool> = GucSetting::<bool>::new(false);

thread_local! {
    /// (OID of `sync_notify_channel`, its channel) as this backend last read them. The channel of
    /// an install never changes; a dropped and re-created extension has a new table OID, and its
    /// channel is read again.
    static CHANNEL: RefCell<Option<(pg_sys::Oid, String)>> = const { RefCell::new(None) };
}

/// Defines the setting; called once per backend when the library loads.
pub fn init() {
    GucRegistry::define_bool_guc(
        c"syncular.notify_commits",
        c"Send a notification after each appended commit, on the channel syncular.notify_channel() names.",
        c"Payload {\"partition\", \"commitSeq\"}, delivered when the appending transaction commits.",
        &NOTIFY_COMMITS,
        GucContext::Userset,
        GucFlags::default(),
    );
}

/// The OID of `syncular.sync_notify_channel`, or `None` on an install older than the table (a
/// 0.1.0 install running this library before `ALTER EXTENSION syncular UPDATE`).
fn channel_table() -> Option<pg_sys::Oid> {
    // SAFETY: two catalog-cache lookups by name inside the calling transaction; `missing_ok`
    // makes the first return InvalidOid instead of raising, and the second returns InvalidOid
    // for a missing relation.
    let oid = unsafe {
        let namespace = pg_sys::get_namespace_oid(c"syncular".as_ptr(), true);
        if namespace == pg_sys::InvalidOid {
            return None;
        }
        pg_sys::get_relname_relid(c"sync_notify_channel".as_ptr(), namespace)
    };
    (oid != pg_sys::InvalidOid).then_some(oid)
}

/// This install's channel, or `None` before the update that creates it. Must run with the
/// extension owner's rights (the table is the owner's alone): `append_commit` and the appending
/// step of `push_commit`/`push_finish` are, and so is [`notify_channel`].
pub(crate) fn channel() -> Result<Option<String>> {
    let Some(table) = channel_table() else {
        return Ok(None);
    };
    if let Some(channel) = CHANNEL.with(|c| {
        c.borrow()
            .as_ref()
            .filter(|(oid, _)| *oid == table)
            .map(|(_, channel)| channel.clone())
    }) {
        return Ok(Some(channel));
    }
    let channel = Spi::get_one::<String>(
        "SELECT channel FROM syncular.sync_notify_channel WHERE id OPERATOR(pg_catalog.=) 1",
    )?
    .ok_or_else(|| Error::Internal("syncular: sync_notify_channel holds no channel".into()))?;
    CHANNEL.with(|c| *c.borrow_mut() = Some((table, channel.clone())));
    Ok(Some(channel))
}

/// After an append of `commit_seq` to `partition`: the notification, if enabled.
pub fn appended(partition: &str, commit_seq: i64) {
    if !NOTIFY_COMMITS.get() {
        return;
    }
    // Before the update that made the channel there is none to send on; the old fixed channel
    // is never used again (any role could listen on it).
    let channel = match channel() {
        Ok(Some(channel)) => channel,
        Ok(None) => return,
        // The appenders call this inside `error::run`, which reports the panic as XX000.
        Err(Error::Internal(message)) => pgrx::error!("{message}"),
        Err(other) => pgrx::error!("syncular: notification channel: {other:?}"),
    };
    let payload = serde_json::json!({"partition": partition, "commitSeq": commit_seq}).to_string();
    // SAFETY: pg_notify(text, text) called with two non-NULL text datums of this call's memory
    // context; it queues the notification and returns void (an error, e.g. a payload over
    // 8,000 bytes, is raised as a PostgreSQL error and caught by pgrx).
    unsafe {
        pgrx::direct_function_call_as_datum(
            pg_sys::pg_notify,
            &[channel.into_datum(), payload.into_datum()],
        );
    }
}

/// The channel this database's commits are notified on; `LISTEN` on it (quoted as an
/// identifier). Granted to `syncular_host` only: no other role can learn it.
#[pg_extern(
    stable,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.notify_channel() RETURNS text
STABLE PARALLEL UNSAFE SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'notify_channel_wrapper';
"#
)]
fn notify_channel() -> String {
    error::run(|| {
        channel()?.ok_or_else(|| {
            Error::Internal(
                "syncular: sync_notify_channel is missing (run ALTER EXTENSION syncular UPDATE)"
                    .into(),
            )
        })
    })
}
