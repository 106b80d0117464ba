//! The feed worker (docs/DESIGN.md §Change feed): a background worker connected to the database
//! `syncular.feed_database` names. Woken when the mailbox stops being empty, it waits out the
//! interval (`syncular.feed_interval_ms`) so the commits of that window coalesce, empties the
//! mailbox, and sends one notification per ~7,900 bytes of heads — the highest `commitSeq` of
//! each partition that moved — on the install's channel. So a commit costs the push path a few
//! bytes copied under one LWLock, and a listener one wake-up per interval at most, however many
//! pushes and listeners there are. It starts by telling listeners to read every head again
//! (`{"resync": true}`): commits made while no worker ran (a restart, a crash) were never
//! announced; so does a full mailbox.

use super::mailbox;
use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::pg_sys;
use pgrx::IntoDatum;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Payload bytes per notification: PostgreSQL's limit is 8,000.
const PAYLOAD_BYTES: usize = 7_900;

#[pgrx::pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn syncular_feed_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let Some(database) = super::database_setting() else {
        return;
    };
    // As the bootstrap superuser: it reads the channel (the extension owner's table) and sends;
    // it runs no SQL a host could have planted anything in (the channel is read by its
    // schema-qualified name, the notification sent below SQL).
    BackgroundWorker::connect_worker_to_spi(Some(&database), None);
    // SAFETY: set once connected; `MyProc` is this process's slot of the shared proc array.
    unsafe {
        mailbox::WORKER_PID
            .get()
            .store(pg_sys::MyProcPid, Ordering::Release);
        mailbox::WORKER
            .get()
            .store(pg_sys::MyProc as usize, Ordering::Release);
        mailbox::DATABASE
            .get()
            .store(pg_sys::MyDatabaseId.to_u32(), Ordering::Release);
    }
    let mut resync = true;
    let mut bytes = Vec::with_capacity(mailbox::CAPACITY);
    loop {
        if !resync && !BackgroundWorker::wait_latch(Some(Duration::from_secs(1))) {
            break;
        }
        if BackgroundWorker::sighup_received() {
            // SAFETY: the documented way for a worker to reload its settings.
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        }
        // The coalescing window: commits of the next interval join this notification.
        // SAFETY: a plain sleep; a signal ends it early.
        unsafe { pg_sys::pg_usleep(i64::from(super::interval_ms()) * 1000) };
        if BackgroundWorker::sigterm_received() {
            break;
        }
        let overflowed = mailbox::drain(&mut bytes);
        // SAFETY: connected: `MyDatabaseId` is set.
        let db = unsafe { pg_sys::MyDatabaseId }.to_u32();
        let mut heads = BTreeMap::new();
        for (partition, seq) in mailbox::records(&bytes, db) {
            let head = heads.entry(partition).or_insert(seq);
            *head = (*head).max(seq);
        }
        let payloads = payloads(resync || overflowed, &heads);
        if payloads.is_empty() {
            continue;
        }
        BackgroundWorker::transaction(|| send(&payloads));
        resync = false;
    }
    mailbox::WORKER.get().store(0, Ordering::Release);
    mailbox::DATABASE.get().store(0, Ordering::Release);
    mailbox::WORKER_PID.get().store(0, Ordering::Release);
    // Exit code 1: the postmaster starts the worker again (after `bgw_restart_time`) unless it
    // is shutting down — a worker stopped by pg_terminate_backend comes back, and starts with a
    // resync (code 0 would unregister it for good).
    // SAFETY: ends this process as PostgreSQL's own workers do.
    unsafe { pg_sys::proc_exit(1) };
}

/// The notifications for one interval: `{"resync": true}` first when listeners must read every
/// head again, then `{"heads": {"<partition>": <commitSeq>, …}}` in pieces under the limit.
fn payloads(resync: bool, heads: &BTreeMap<&str, i64>) -> Vec<String> {
    let mut out = Vec::new();
    if resync {
        out.push(r#"{"resync":true}"#.to_string());
    }
    let mut piece = serde_json::Map::new();
    let mut size = 0;
    for (partition, seq) in heads {
        let entry = serde_json::to_string(partition).map_or(0, |s| s.len()) + 24;
        if size + entry > PAYLOAD_BYTES && !piece.is_empty() {
            out.push(serde_json::json!({ "heads": std::mem::take(&mut piece) }).to_string());
            size = 0;
        }
        piece.insert((*partition).to_string(), serde_json::json!(seq));
        size += entry;
    }
    if !piece.is_empty() {
        out.push(serde_json::json!({ "heads": piece }).to_string());
    }
    out
}

/// Queues the notifications on this install's channel; delivered when the worker's transaction
/// commits. Without the extension in the database (not created yet, or dropped), nothing.
fn send(payloads: &[String]) {
    let channel = match crate::notify::channel() {
        Ok(Some(channel)) => channel,
        _ => return,
    };
    for payload in payloads {
        // SAFETY: pg_notify(text, text) with two non-NULL text datums; it queues the
        // notification (an oversized payload would raise, which `payloads` never builds).
        unsafe {
            pgrx::direct_function_call_as_datum(
                pg_sys::pg_notify,
                &[channel.as_str().into_datum(), payload.as_str().into_datum()],
            );
        }
    }
}
