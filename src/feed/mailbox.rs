//! The shared-memory mailbox between the backends that commit appends and the feed worker
//! (docs/DESIGN.md §Change feed): each committing backend copies its transaction's new heads in
//! (`(database, commitSeq, partition)` records) under one LWLock; the worker copies them all out
//! and empties it, once per interval. Full, it drops records and says so (`overflowed`): the
//! worker then tells listeners to read every head again rather than skip one.

use pgrx::prelude::*;
use pgrx::shmem::PGRXSharedMemory;
use pgrx::{PgAtomic, PgLwLock};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicUsize, Ordering};

/// Bytes of records the mailbox holds between two drains: at ~30 bytes a record, thousands of
/// commits per interval (docs/DESIGN.md §Change feed).
pub const CAPACITY: usize = 256 * 1024;
/// A record: the database OID (4 bytes), the commit seq (8), the partition's length (2), then
/// the partition's bytes (at most `limits::KEY_BYTES`).
const HEADER: usize = 4 + 8 + 2;

#[derive(Copy, Clone)]
pub struct Mailbox {
    used: usize,
    overflowed: bool,
    data: [u8; CAPACITY],
}

// SAFETY: plain bytes and integers, no pointer: valid in every process that maps it.
unsafe impl PGRXSharedMemory for Mailbox {}

impl Default for Mailbox {
    fn default() -> Self {
        Mailbox {
            used: 0,
            overflowed: false,
            data: [0; CAPACITY],
        }
    }
}

/// What the committing backends post and the worker drains.
pub static MAILBOX: PgLwLock<Mailbox> =
    // SAFETY: used only after `init` ran in the postmaster (`feed::preloaded`), which allocates
    // it (and the three below) in shared memory before any backend or the worker is forked.
    unsafe { PgLwLock::new(c"syncular_feed_mailbox") };
/// The OID of the database the running worker serves; 0 while no worker runs.
// SAFETY: as MAILBOX.
pub static DATABASE: PgAtomic<AtomicU32> = unsafe { PgAtomic::new(c"syncular_feed_database") };
/// The running worker's `PGPROC` (its latch is set when the mailbox stops being empty); 0 while
/// no worker runs.
// SAFETY: as MAILBOX.
pub static WORKER: PgAtomic<AtomicUsize> = unsafe { PgAtomic::new(c"syncular_feed_worker") };
/// The running worker's process id, which every feed notification carries as its sender.
// SAFETY: as MAILBOX.
pub static WORKER_PID: PgAtomic<AtomicI32> = unsafe { PgAtomic::new(c"syncular_feed_pid") };

/// Reserves and initializes the shared memory: in `_PG_init` of a preloaded library.
// pgrx's macro tests the `pg13`..`pg17` features, which this crate does not declare.
#[allow(unexpected_cfgs)]
pub fn init() {
    pgrx::pg_shmem_init!(MAILBOX);
    pgrx::pg_shmem_init!(DATABASE);
    pgrx::pg_shmem_init!(WORKER);
    pgrx::pg_shmem_init!(WORKER_PID);
}

/// Copies `heads` of database `db` in; what does not fit is dropped and marks the mailbox
/// overflowed. Allocation-free and error-free: it runs after the commit
/// (`XACT_EVENT_COMMIT`), where an error would abort the server. Returns the worker's `PGPROC`
/// to wake when the mailbox was empty before (0: nothing to wake).
pub fn post<'a>(db: u32, heads: impl Iterator<Item = (&'a str, i64)>) -> usize {
    let mut mailbox = MAILBOX.exclusive();
    let was_empty = mailbox.used == 0 && !mailbox.overflowed;
    for (partition, seq) in heads {
        let name = partition.as_bytes();
        let at = mailbox.used;
        let end = at + HEADER + name.len();
        if name.len() > u16::MAX as usize || end > CAPACITY {
            mailbox.overflowed = true;
            continue;
        }
        mailbox.data[at..at + 4].copy_from_slice(&db.to_le_bytes());
        mailbox.data[at + 4..at + 12].copy_from_slice(&seq.to_le_bytes());
        mailbox.data[at + 12..at + 14].copy_from_slice(&(name.len() as u16).to_le_bytes());
        mailbox.data[at + HEADER..end].copy_from_slice(name);
        mailbox.used = end;
    }
    drop(mailbox);
    if was_empty {
        WORKER.get().load(Ordering::Acquire)
    } else {
        0
    }
}

/// Moves every record out into `into` (cleared first) and empties the mailbox; whether records
/// were dropped since the last drain.
pub fn drain(into: &mut Vec<u8>) -> bool {
    into.clear();
    let mut mailbox = MAILBOX.exclusive();
    into.extend_from_slice(&mailbox.data[..mailbox.used]);
    let overflowed = mailbox.overflowed;
    mailbox.used = 0;
    mailbox.overflowed = false;
    overflowed
}

/// The records of `bytes` (as [`drain`] returned them) of database `db`: `(partition, seq)`.
pub fn records(bytes: &[u8], db: u32) -> impl Iterator<Item = (&str, i64)> {
    let mut at = 0;
    std::iter::from_fn(move || loop {
        if at + HEADER > bytes.len() {
            return None;
        }
        let of = u32::from_le_bytes(bytes[at..at + 4].try_into().ok()?);
        let seq = i64::from_le_bytes(bytes[at + 4..at + 12].try_into().ok()?);
        let len = u16::from_le_bytes(bytes[at + 12..at + 14].try_into().ok()?) as usize;
        let name = bytes.get(at + HEADER..at + HEADER + len)?;
        at += HEADER + len;
        if of == db {
            // Written from a `&str`: valid UTF-8.
            if let Ok(name) = std::str::from_utf8(name) {
                return Some((name, seq));
            }
        }
    })
}
