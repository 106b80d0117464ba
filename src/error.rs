//! The one error type of the extension and the one place that turns it into a PostgreSQL ERROR.
//!
//! Every refusal has a stable code string (the message, exactly), a SQLSTATE in class `SY`
//! (docs/API.md §Errors) and optionally a DETAIL holding one compact JSON object. pgrx's `ereport!`
//! only knows PostgreSQL's built-in SQLSTATEs, so [`raise`] drives `errstart`/`errfinish` itself.
//!
//! A second concern lives here too: an `SY` error raised *inside* a statement we run through SPI
//! (the fence trigger firing under `append_commit`'s insert) is caught by pgrx at the FFI
//! boundary and would be re-thrown as `XX000`, because pgrx maps unknown SQLSTATEs to
//! `ERRCODE_INTERNAL_ERROR`. [`run`] recognises those by their message (which is exactly a code
//! of the catalogue) and re-raises them with their own SQLSTATE and DETAIL.

use pgrx::pg_sys;
use pgrx::pg_sys::panic::CaughtError;
use serde_json::{json, Value};
use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

/// The error catalogue (docs/API.md §Errors).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    InvalidArgument,
    WriterFenceRejected,
    SchemaNotReady,
    IdempotencyCacheMiss,
    InvalidTransactionState,
    InvalidCommit,
    CheckpointNotDeclared,
    CheckpointFenceMissing,
    CheckpointVersionMismatch,
    CheckpointIncomplete,
    SchemaNewer,
    StoredLayoutMismatch,
    PruneEpochMismatch,
    PartitionUnregistered,
    InvalidPruneCursor,
    ScanRequiresScope,
    UnknownTable,
    ReactionDuplicate,
}

const CATALOGUE: &[(Code, &str, &str)] = &[
    (
        Code::InvalidArgument,
        "sync.storage.invalid_argument",
        "SY000",
    ),
    (
        Code::WriterFenceRejected,
        "sync.storage.writer_fence_rejected",
        "SY001",
    ),
    (Code::SchemaNotReady, "sync.schema_not_ready", "SY002"),
    (
        Code::IdempotencyCacheMiss,
        "sync.idempotency_cache_miss",
        "SY003",
    ),
    (
        Code::InvalidTransactionState,
        "sync.storage.invalid_transaction_state",
        "SY004",
    ),
    (Code::InvalidCommit, "sync.storage.invalid_commit", "SY005"),
    (
        Code::CheckpointNotDeclared,
        "sync.storage.checkpoint_not_declared",
        "SY010",
    ),
    (
        Code::CheckpointFenceMissing,
        "sync.storage.checkpoint_fence_missing",
        "SY011",
    ),
    (
        Code::CheckpointVersionMismatch,
        "sync.storage.checkpoint_version_mismatch",
        "SY012",
    ),
    (
        Code::CheckpointIncomplete,
        "sync.storage.checkpoint_incomplete",
        "SY013",
    ),
    (Code::SchemaNewer, "sync.storage.schema_newer", "SY020"),
    (
        Code::StoredLayoutMismatch,
        "sync.storage.stored_layout_mismatch",
        "SY021",
    ),
    (
        Code::PruneEpochMismatch,
        "sync.storage.prune_epoch_mismatch",
        "SY030",
    ),
    (
        Code::PartitionUnregistered,
        "sync.storage.partition_unregistered",
        "SY031",
    ),
    (
        Code::InvalidPruneCursor,
        "sync.storage.invalid_prune_cursor",
        "SY032",
    ),
    (
        Code::ScanRequiresScope,
        "sync.storage.scan_requires_scope",
        "SY040",
    ),
    (Code::UnknownTable, "sync.storage.unknown_table", "SY041"),
    (
        Code::ReactionDuplicate,
        "sync.storage.reaction_duplicate",
        "SY050",
    ),
];

impl Code {
    fn entry(self) -> &'static (Code, &'static str, &'static str) {
        CATALOGUE
            .iter()
            .find(|e| e.0 == self)
            .expect("every code is in the catalogue")
    }
    pub fn message(self) -> &'static str {
        self.entry().1
    }
    pub fn sqlstate(self) -> &'static str {
        self.entry().2
    }
    pub fn from_message(message: &str) -> Option<Code> {
        CATALOGUE.iter().find(|e| e.1 == message).map(|e| e.0)
    }
}

/// What a function of the extension can fail with.
#[derive(Debug)]
pub enum Error {
    /// A refusal of the catalogue, with its DETAIL object (if the catalogue lists keys) and an
    /// optional HINT: free text naming what exactly is wrong (a column, a table), where the
    /// DETAIL's keys are fixed by the catalogue.
    Sync {
        code: Code,
        detail: Option<Value>,
        hint: Option<String>,
    },
    /// A bug or an unexpected SPI failure: raised as `XX000`, never as a catalogue code.
    Internal(String),
    /// Host code (a trigger, policy or function of a host relation) changed rows the extension
    /// was rewriting: raised as PostgreSQL's `27000` (triggered_data_change_violation) with a
    /// HINT saying what to change (`migrate_schema`, docs/SECURITY.md rule 19).
    TriggeredChange(String),
    /// An allocation of this many bytes failed: raised as PostgreSQL's own `53200`
    /// (`src/alloc.rs`, docs/DESIGN.md §Memory).
    OutOfMemory(usize),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(code: Code, detail: Value) -> Error {
        Error::Sync {
            code,
            detail: Some(detail),
            hint: None,
        }
    }
    pub fn bare(code: Code) -> Error {
        Error::Sync {
            code,
            detail: None,
            hint: None,
        }
    }
    /// The same refusal with a HINT.
    pub fn with_hint(self, text: impl Into<String>) -> Error {
        match self {
            Error::Sync { code, detail, .. } => Error::Sync {
                code,
                detail,
                hint: Some(text.into()),
            },
            other => other,
        }
    }
    /// `sync.storage.invalid_argument` with `{"argument", "reason"}`.
    pub fn invalid_argument(argument: &str, reason: &str) -> Error {
        Error::new(
            Code::InvalidArgument,
            json!({"argument": argument, "reason": reason}),
        )
    }
    /// `sync.storage.invalid_commit` with `{"path", "reason"}`.
    pub fn invalid_commit(path: &str, reason: &str) -> Error {
        Error::new(Code::InvalidCommit, json!({"path": path, "reason": reason}))
    }
    /// `sync.storage.invalid_transaction_state` with `{"reason"}` and the mechanical fix as its
    /// HINT (a caller may replace it with a more specific one).
    pub fn invalid_transaction_state(reason: &str) -> Error {
        let hint = match reason {
            "no_transaction_block" => {
                "run it inside BEGIN … COMMIT, in the transaction of the writes it belongs to: \
                 in autocommit it would commit alone"
            }
            "prior_writes" => {
                "call it first in its transaction, before any write (BEGIN; then this call)"
            }
            "isolation" => {
                "run it under READ COMMITTED (PostgreSQL's default): BEGIN ISOLATION LEVEL READ \
                 COMMITTED, or reset default_transaction_isolation"
            }
            "holdable_cursor" => {
                "close the session's WITH HOLD cursors first (CLOSE ALL, or before BEGIN): one \
                 declared before the migration runs its query to the end at commit, after the \
                 migration checked the rows it re-encoded (docs/SECURITY.md rule 19)"
            }
            _ => return Error::new(Code::InvalidTransactionState, json!({ "reason": reason })),
        };
        Error::new(Code::InvalidTransactionState, json!({ "reason": reason })).with_hint(hint)
    }
}

impl From<crate::alloc::OutOfMemory> for Error {
    fn from(e: crate::alloc::OutOfMemory) -> Error {
        Error::OutOfMemory(e.0)
    }
}

impl From<pgrx::spi::SpiError> for Error {
    fn from(e: pgrx::spi::SpiError) -> Error {
        Error::Internal(format!("syncular: SPI failure: {e}"))
    }
}

impl From<pgrx::datum::TryFromDatumError> for Error {
    fn from(e: pgrx::datum::TryFromDatumError) -> Error {
        Error::Internal(format!("syncular: unexpected column type: {e}"))
    }
}

impl From<pgrx::heap_tuple::PgHeapTupleError> for Error {
    fn from(e: pgrx::heap_tuple::PgHeapTupleError) -> Error {
        Error::Internal(format!("syncular: tuple failure: {e}"))
    }
}

/// Runs the body of an SQL-callable function and turns its failure into a PostgreSQL ERROR.
///
/// Catalogue errors raised by nested statements of this crate (see the module comment) keep
/// their SQLSTATE. Every other panic, including PostgreSQL errors caught by pgrx (40001, 40P01, 23505, …),
/// continues to unwind to pgrx's own guard, which reports it unchanged.
///
/// A call made by host code that runs inside another call of the API (a trigger of an app table
/// firing under `push_commit`, a policy read by `pull`) is refused with `42501` before anything
/// is read ([`HostCode`], src/tables/sandbox.rs, docs/SECURITY.md rule 12).
///
/// This is also the last check point of out of memory (`src/alloc.rs`): if an allocation failed
/// while the body ran — even one the allocator's reserve served, or one the body turned into
/// another error — the call ends in `53200`, after everything the body owned was dropped.
pub fn run<T>(body: impl FnOnce() -> Result<T>) -> T {
    if HostCode::depth() > 0 {
        drop(body);
        raise(
            "42501",
            "syncular functions cannot be called by host code that runs inside a syncular call"
                .to_string(),
            None,
            Some("a trigger, default, index expression, CHECK or policy of an app table runs inside the syncular call that reads or writes that table; call syncular from the host itself (for reactions of a one-call push, its reactionPlanner), docs/SECURITY.md".to_string()),
        )
    }
    run_in_host_code(body)
}

thread_local! {
    /// How many host-code scopes (src/tables/sandbox.rs) are open in this backend.
    static HOST_CODE_DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// An open host-code scope (src/tables/sandbox.rs), counted while it lives so that [`run`] can
/// refuse calls of the API made by host code; the count drops when the scope ends, unwinding
/// included.
pub struct HostCode;

impl HostCode {
    pub fn enter() -> HostCode {
        HOST_CODE_DEPTH.with(|d| d.set(d.get() + 1));
        HostCode
    }

    fn depth() -> u32 {
        HOST_CODE_DEPTH.with(std::cell::Cell::get)
    }

    /// Whether host code of a call of the API is running in this backend (a call of the API
    /// from it is refused by [`run`]).
    pub fn running() -> bool {
        Self::depth() > 0
    }
}

impl Drop for HostCode {
    fn drop(&mut self) {
        HOST_CODE_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// [`run`] for the few functions host code may call inside a call of the API: the extension's
/// own triggers (the row-meta trigger fires on the host writes of a one-call push) and the fence
/// guard's internals, which only check or refuse, and the row codec, which only reads.
pub fn run_in_host_code<T>(body: impl FnOnce() -> Result<T>) -> T {
    let call = crate::alloc::Call::begin();
    // On Citus, before anything of the call: no statement of it, the owner's above all, may go
    // over a connection carrying settings the caller had Citus replay (docs/SECURITY.md rule 20;
    // red team 47, F2: a definer function's first statement did).
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        crate::citus::propagated::refuse()?;
        crate::citus::owner_connections::check()?;
        body()
    }));
    let failed = call.end();
    type Raised = (c_int, String, Option<String>, Option<String>, Origin);
    let ours = |state: &str| crate::port::make_sqlstate(state);
    if let Some(size) = failed.or(match &outcome {
        Ok(Err(Error::OutOfMemory(size))) => Some(*size),
        _ => None,
    }) {
        drop(outcome);
        raise(
            "53200",
            out_of_memory_message(),
            Some(out_of_memory_detail(size)),
            None,
        )
    }
    let (code, message, detail, hint, origin): Raised = match outcome {
        Ok(Ok(value)) => return value,
        Ok(Err(error)) => raised(error),
        Err(payload) => match payload.downcast::<CaughtError>() {
            // A PostgreSQL error caught under SPI is raised again as itself: its SQLSTATE (the
            // catalogue's for one of ours), message, DETAIL and HINT. Not by pgrx's rethrow,
            // which appends the Rust backtrace to the DETAIL when RUST_BACKTRACE is set in the
            // server's environment (issue 30, item 6).
            Ok(caught) => match *caught {
                CaughtError::PostgresError(ref report) => {
                    let by_us = raised_by_us(report);
                    match Code::from_message(report.message()).filter(|_| by_us || relayed(report))
                    {
                        Some(code) => (
                            ours(code.sqlstate()),
                            code.message().to_string(),
                            report.detail().map(str::to_string),
                            report.hint().map(str::to_string),
                            Origin::Ours,
                        ),
                        None => (
                            report.sql_error_code() as c_int,
                            report.message().to_string(),
                            report.detail().map(str::to_string),
                            report
                                .hint()
                                .map(str::to_string)
                                .or_else(|| read_only_hint(report)),
                            if by_us { Origin::Ours } else { Origin::Caught },
                        ),
                    }
                }
                other => other.rethrow(),
            },
            Err(other) => resume_unwind(other),
        },
    };
    raise_code(code, message, detail, hint, origin)
}

/// What an error of ours is raised as: its SQLSTATE, message, DETAIL, HINT (an out-of-memory
/// error: `53200` with its size).
/// What an error of ours is raised as — its SQLSTATE, message, DETAIL and HINT — for code that
/// hands them to PostgreSQL to raise (a setting's check hook, src/citus/one_partition.rs).
pub fn parts(error: Error) -> (c_int, String, Option<String>, Option<String>) {
    let (code, message, detail, hint, _) = raised(error);
    (code, message, detail, hint)
}

fn raised(error: Error) -> (c_int, String, Option<String>, Option<String>, Origin) {
    let ours = |state: &str| crate::port::make_sqlstate(state);
    match error {
        Error::Sync { code, detail, hint } => (
            ours(code.sqlstate()),
            code.message().to_string(),
            detail.map(|d| d.to_string()),
            hint,
            Origin::Ours,
        ),
        Error::Internal(message) => (ours("XX000"), message, None, None, Origin::Ours),
        Error::TriggeredChange(message) => (
            ours("27000"),
            message,
            None,
            Some(
                "disable the relation's UPDATE triggers for the migration (ALTER TABLE … DISABLE \
                 TRIGGER, then ENABLE after it) or make them leave _sync_payload and the other \
                 registered tables' rows alone"
                    .into(),
            ),
            Origin::Ours,
        ),
        Error::OutOfMemory(size) => (
            ours("53200"),
            out_of_memory_message(),
            Some(out_of_memory_detail(size)),
            None,
            Origin::Ours,
        ),
    }
}

/// Raises `error` as [`run`] raises a call's error, from code of ours that runs outside a call
/// of the API (the planner hook of src/citus/subquery.rs). The caller holds nothing with a
/// destructor ([`raise`]).
pub fn raise_error(error: Error) -> ! {
    let (code, message, detail, hint, origin) = raised(error);
    raise_code(code, message, detail, hint, origin)
}

/// What to do about PostgreSQL's `25006` (a write in a read-only transaction), which names
/// neither: on a hot standby, where every transaction is read-only, the way to the primary
/// (issue 32, docs/DESIGN.md §Read replicas); elsewhere, the read-only transaction.
fn read_only_hint(report: &pgrx::pg_sys::panic::ErrorReportWithLevel) -> Option<String> {
    use pgrx::pg_sys::errcodes::PgSqlErrorCode;
    if report.sql_error_code() != PgSqlErrorCode::ERRCODE_READ_ONLY_SQL_TRANSACTION {
        return None;
    }
    // SAFETY: reads the shared recovery state; callable in any backend.
    let standby = unsafe { pgrx::pg_sys::RecoveryInProgress() };
    Some(
        if standby {
            "this server is a hot standby: send this call to the primary; pull is served here \
             (its writes come back as document.writes, for apply_pull on the primary), \
             docs/DESIGN.md §Read replicas"
        } else {
            "the transaction is read-only (BEGIN READ ONLY, or default_transaction_read_only): \
             run this call in a read-write transaction; only pull serves read-only transactions"
        }
        .to_string(),
    )
}

/// Where an error [`raise_code`] raises comes from, as its file and function say.
#[derive(Clone, Copy)]
enum Origin {
    /// Raised by this crate: [`run`] re-codes a catalogue message of such an error.
    Ours,
    /// Caught from PostgreSQL or host code under SPI and raised again: never re-coded.
    Caught,
}

/// PostgreSQL's message and DETAIL for an allocation that failed (`mcxt.c`), so a host sees one
/// out-of-memory error whichever side ran out.
fn out_of_memory_message() -> String {
    "out of memory".to_string()
}

fn out_of_memory_detail(size: usize) -> String {
    format!("Failed on request of size {size} in syncular.")
}

/// The PostgreSQL error a caught panic carries (pgrx turns an ERROR raised under SPI into a
/// [`CaughtError`] panic), if it is one.
pub fn postgres_report(
    panic: &(dyn std::any::Any + Send),
) -> Option<&pgrx::pg_sys::panic::ErrorReportWithLevel> {
    match panic.downcast_ref::<CaughtError>() {
        Some(CaughtError::PostgresError(report)) => Some(report),
        _ => None,
    }
}

/// Where [`raise`] says an error comes from. PostgreSQL keeps the file and function name of
/// every error it reports; SQL (`RAISE`) cannot set them, so only errors of this crate carry
/// these, and only those are re-coded by [`run`] (a host trigger raising a message that equals a
/// catalogue code keeps its own SQLSTATE). `errfinish` keeps only the file's base name, so the
/// name has no directory.
const RAISED_FILE: &std::ffi::CStr = c"syncular_error.rs";
const RAISED_FUNCTION: &std::ffi::CStr = c"syncular::error::raise";
/// Where an error caught under SPI and raised again says it comes from: static strings, as
/// `errfinish` keeps the pointers (an error copied by a PL/pgSQL handler outlives the error
/// context), so the original file and function are not kept.
const CAUGHT_FILE: &std::ffi::CStr = c"syncular_caught.rs";
const CAUGHT_FUNCTION: &std::ffi::CStr = c"syncular::error::run";

/// An error Citus relays from a worker (docs/SCALING.md) whose SQLSTATE the binding layer could
/// not name (pgrx reports a code outside PostgreSQL's list, as ours are, as `XX000`): when its
/// message is a catalogue code, it keeps that code's SQLSTATE. The worker raised it with a
/// SQLSTATE outside PostgreSQL's list — ours, or one host code chose itself — so nothing is
/// re-coded that its raiser did not choose (docs/SECURITY.md, rule 6).
fn relayed(report: &pgrx::pg_sys::panic::ErrorReportWithLevel) -> bool {
    report.file() == "remote_commands.c"
        && report.function_name() == Some("ReportResultError")
        && report.sql_error_code() == pgrx::pg_sys::errcodes::PgSqlErrorCode::ERRCODE_INTERNAL_ERROR
}

fn raised_by_us(report: &pgrx::pg_sys::panic::ErrorReportWithLevel) -> bool {
    Some(report.file()) == RAISED_FILE.to_str().ok()
        && report.function_name() == RAISED_FUNCTION.to_str().ok()
}

unsafe extern "C-unwind" {
    fn errstart(elevel: c_int, domain: *const c_char) -> bool;
    fn errcode(sqlerrcode: c_int) -> c_int;
    fn errmsg(fmt: *const c_char, ...) -> c_int;
    fn errdetail(fmt: *const c_char, ...) -> c_int;
    fn errhint(fmt: *const c_char, ...) -> c_int;
    fn errfinish(filename: *const c_char, lineno: c_int, funcname: *const c_char);
}

/// Copies a Rust string into memory PostgreSQL frees at the end of the (sub)transaction.
fn palloc_cstr(text: &str) -> *mut c_char {
    let owned = CString::new(text.replace('\0', "\\u0000")).expect("NULs were escaped");
    // SAFETY: `owned` is a valid NUL-terminated string; `pstrdup` copies it into the current
    // memory context (and raises a PostgreSQL error on out-of-memory, caught by pgrx).
    unsafe { pg_sys::pstrdup(owned.as_ptr()) }
}

/// Raises an ERROR with an arbitrary SQLSTATE. Never returns: `errfinish` longjmps to the
/// innermost PostgreSQL error handler, over every Rust frame in between without running a
/// destructor.
///
/// The rule (docs/DESIGN.md, "Errors"): when `errfinish` jumps, no frame between it and
/// PostgreSQL may own anything with a destructor, or that memory leaks for the backend's life.
/// So this function takes the texts by value, copies them into PostgreSQL's memory (freed with
/// the transaction) and drops the Rust copies before `errstart`; [`run`] calls it only after its
/// closure has returned or unwound, holding nothing else. `tests/multisession/tests/memory.rs`
/// raises 50,000 errors in one backend and bounds its growth.
pub fn raise(
    sqlstate: &'static str,
    message: String,
    detail: Option<String>,
    hint: Option<String>,
) -> ! {
    raise_code(
        crate::port::make_sqlstate(sqlstate),
        message,
        detail,
        hint,
        Origin::Ours,
    )
}

/// [`raise`] with an encoded SQLSTATE and the [`Origin`] its file and function name.
fn raise_code(
    code: c_int,
    message: String,
    detail: Option<String>,
    hint: Option<String>,
    origin: Origin,
) -> ! {
    let message_c = palloc_cstr(&message);
    let detail_c = detail.as_deref().map(palloc_cstr);
    let hint_c = hint.as_deref().map(palloc_cstr);
    drop((message, detail, hint));
    let (file, function) = match origin {
        Origin::Ours => (RAISED_FILE, RAISED_FUNCTION),
        Origin::Caught => (CAUGHT_FILE, CAUGHT_FUNCTION),
    };
    // SAFETY: the elog.c protocol (errstart, then the field setters, then errfinish) with
    // NUL-terminated strings in PostgreSQL's memory; the "%s" formats take exactly one string.
    unsafe {
        if errstart(pg_sys::elog::PgLogLevel::ERROR as c_int, std::ptr::null()) {
            errcode(code);
            errmsg(c"%s".as_ptr(), message_c);
            if let Some(detail) = detail_c {
                errdetail(c"%s".as_ptr(), detail);
            }
            if let Some(hint) = hint_c {
                errhint(c"%s".as_ptr(), hint);
            }
            errfinish(file.as_ptr(), 0, function.as_ptr());
        }
    }
    unreachable!("errfinish(ERROR) does not return")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_in_class_sy_and_unique() {
        let mut seen = std::collections::HashSet::new();
        for (code, message, state) in CATALOGUE {
            assert!(state.starts_with("SY"), "{message}");
            assert!(seen.insert(*state), "duplicate {state}");
            assert_eq!(Code::from_message(message), Some(*code));
        }
    }
}
