//! The extension owner's sessions Citus opens on this node run only where the owner's pins are
//! in place here (red team 49, F4; docs/SECURITY.md rule 20).
//!
//! [`super::owner_connections::check`] verifies the pins and the database's owner on the node
//! that runs a call. The owner's statements Citus sends to the other nodes run in sessions those
//! nodes started with their own copy of the settings: a superuser who reset the owner's settings
//! on one worker alone (with DDL propagation off) left its `search_path` to a schema named after
//! the owner there, and a function a migrator put in it ran as the superuser — the coordinator's
//! check had passed. So a session Citus opened on this node (not a client's), running as the
//! extension owner in a database whose sync tables Citus distributes, verifies the pins here,
//! once per transaction, before anything of its first statement is planned: from the planner
//! hook, before the planners installed before it, so no function of the statement — not even
//! one the planner would fold — runs first. Read below SQL (`pg_db_role_setting`), so the check
//! plans nothing itself.

use pgrx::pg_sys;
use std::cell::Cell;

thread_local! {
    /// The local transaction in which this session passed (or needed no check).
    static CHECKED_IN: Cell<Option<pg_sys::LocalTransactionId>> = const { Cell::new(None) };
}

/// The `planner_hook` installed before ours.
static mut PREVIOUS: pg_sys::planner_hook_type = None;

/// Installs the hook (from `_PG_init`, once per process that loads the library).
pub fn install() {
    // SAFETY: `_PG_init` runs once per process, single-threaded, before any planning; the hook
    // installed before ours is kept and called by ours.
    unsafe {
        PREVIOUS = pg_sys::planner_hook;
        pg_sys::planner_hook = Some(plan);
    }
}

/// The hook (`optimizer/planner.h`, the same on PostgreSQL 15 and 18): the check (guarded on its
/// own), then the planner before ours or PostgreSQL's own, called raw (`super::plan_with`).
unsafe extern "C-unwind" fn plan(
    parse: *mut pg_sys::Query,
    query_string: *const std::ffi::c_char,
    cursor_options: std::ffi::c_int,
    bound: pg_sys::ParamListInfo,
) -> *mut pg_sys::PlannedStmt {
    // SAFETY: PostgreSQL's arguments, passed on unchanged; the check reads catalogs only.
    unsafe {
        check_guarded();
        super::plan_with(PREVIOUS, parse, query_string, cursor_options, bound)
    }
}

/// [`check`] behind pgrx's guard: its refusal, or an ERROR of a catalog read, is raised from here.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn check_guarded() {
    check();
}

/// Refuses (`SY000`, `database`, `privilege`) a session Citus opened on this node for its own
/// statements (not a client's, not `run_command_on_*`'s), running as the extension owner, on a
/// node where the owner's pins are missing. The pins as stored, not the session's own settings:
/// Citus keeps the connections it opened before `distribute()` set them — `CREATE EXTENSION`'s
/// — for the rest of the client's session. Not the database's owner, which the call's node
/// checks (`owner_connections`): its repair, `ALTER DATABASE … OWNER TO`, reaches the other
/// nodes through these very sessions. Once per local transaction; nothing for another role, or
/// in a database where Citus does not distribute the sync tables.
fn check() {
    let now = crate::port::local_transaction_id_if_any();
    if CHECKED_IN.get() == Some(now) || !super::installed() {
        return;
    }
    // Marked first: the reads below plan nothing, and a refusal ends the transaction anyway.
    CHECKED_IN.set(Some(now));
    // SAFETY: catalog reads in the planning transaction; the Citus functions are looked up by
    // their exported names and have this signature in Citus 13
    // (`bool IsExternalClientBackend(void)`, `bool IsCitusRunCommandBackend(void)`).
    let refused = unsafe {
        // The cheap questions first, Citus's library last: only a database whose sync tables
        // Citus distributes has it (a stand-in `pg_dist_partition` has no library behind it).
        let Some(owner) = crate::catalog::extension_owner(c"syncular") else {
            return;
        };
        if pg_sys::GetUserId() != owner {
            return;
        }
        if !super::sync_tables_distributed() {
            return;
        }
        // A client's session, or one of `run_command_on_*` (an operator's own commands, by which
        // `distribute()` puts the pins back): not Citus's deparsed statements. Where this Citus
        // lacks either question, nothing to check.
        let (Some(external), Some(run_command)) = (
            super::library_flag(c"IsExternalClientBackend"),
            super::library_flag(c"IsCitusRunCommandBackend"),
        ) else {
            return;
        };
        if external || run_command {
            return;
        }
        !super::owner_connections::pinned_here(owner)
    };
    if refused {
        crate::error::raise(
            "SY000",
            "sync.storage.invalid_argument".into(),
            Some(r#"{"argument":"database","reason":"privilege"}"#.into()),
            Some(
                "a session Citus opened on this node as the extension owner finds the owner's \
                 settings in this database not pinned here (search_path, \
                 standard_conforming_strings): run SELECT syncular.distribute() on the \
                 coordinator again, docs/SECURITY.md rule 20"
                    .into(),
            ),
        );
    }
}
