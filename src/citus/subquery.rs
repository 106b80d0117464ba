//! The guard against Citus's crash on a delegated function called in a subquery (red team 39,
//! F1; docs/SCALING.md, "A Citus bug, and the guard"). Citus 13 delegates a distributed
//! function's call to the node of its partition when a query is `SELECT … FROM f(…)` — and it
//! decides so on the query as PostgreSQL's planner left it. `SELECT … FROM (SELECT * FROM
//! f(…)) t` has its subquery pulled up by then, looks like the delegable form, and Citus's
//! deparse of that rewritten query crashes the backend (SIGSEGV in `AcquireRewriteLocks`),
//! which makes PostgreSQL restart every session of the node. Any role that may name the
//! function triggers it — no `EXECUTE` needed, as planning comes first.
//!
//! The guard is a planner hook that runs before Citus's (the library loads after Citus, which
//! must be first in `shared_preload_libraries`): where a query's only `FROM` item is a chain of
//! subqueries ending in a call of one of the extension's functions, the outermost subquery gets
//! `OFFSET 0` — the fence PostgreSQL documents against pulling a subquery up, which returns the
//! same rows. Citus then sees a subquery, not a function, and runs the call on this node as it
//! does any call it does not delegate (the forms Citus delegates, `SELECT f(…)` and `SELECT …
//! FROM f(…)`, are untouched). It protects a node only where the library is loaded before the
//! query is planned, so `distribute()` requires `syncular` in every node's
//! `shared_preload_libraries` (src/distribute.rs).

use crate::port;
use pgrx::pg_sys;
use std::ffi::{c_char, c_int};

/// The planner hook installed before ours (Citus's `distributed_planner` on a Citus node).
static mut PREVIOUS: pg_sys::planner_hook_type = None;

/// The subqueries of one `FROM` item followed at most this deep (PostgreSQL's own limit is the
/// stack; a deeper chain is left as it is, and Citus's planner sees it unchanged).
const MAX_DEPTH: usize = 64;

/// Installs the hook (from `_PG_init`, once per process that loads the library).
pub fn install() {
    // SAFETY: `_PG_init` runs once per process, single-threaded, before any planning of ours;
    // the hook installed before ours is kept and called by ours.
    unsafe {
        PREVIOUS = pg_sys::planner_hook;
        pg_sys::planner_hook = Some(fence_then_plan);
    }
}

// PostgreSQL's own planner, called as C calls it (src/schema/executor_snapshots.rs says why not
// through pgrx's guarded bindings).
unsafe extern "C-unwind" {
    #[link_name = "standard_planner"]
    fn standard_planner(
        parse: *mut pg_sys::Query,
        query_string: *const c_char,
        cursor_options: c_int,
        bound_params: pg_sys::ParamListInfo,
    ) -> *mut pg_sys::PlannedStmt;
}

/// The planner hook (`src/include/optimizer/planner.h`, the same on PostgreSQL 15 and 18): fences
/// the subquery (see the module's comment), then plans as the hook before ours, or PostgreSQL,
/// would. No `pg_guard`: an ERROR in planning passes through here, and nothing of ours is live.
unsafe extern "C-unwind" fn fence_then_plan(
    parse: *mut pg_sys::Query,
    query_string: *const c_char,
    cursor_options: c_int,
    bound_params: pg_sys::ParamListInfo,
) -> *mut pg_sys::PlannedStmt {
    // SAFETY: PostgreSQL passes a valid query tree, which the planner may modify; the hook
    // before ours takes the same arguments.
    unsafe {
        fence_guarded(parse);
        match PREVIOUS {
            Some(previous) => previous(parse, query_string, cursor_options, bound_params),
            None => standard_planner(parse, query_string, cursor_options, bound_params),
        }
    }
}

/// [`fence`] behind pgrx's guard: an ERROR from a catalog lookup in it is raised from here.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn fence_guarded(parse: *mut pg_sys::Query) {
    // SAFETY: the caller's valid query tree.
    unsafe { fence(parse) }
}

/// Sets `OFFSET 0` on the outermost subquery of `parse`'s only `FROM` item when that item is a
/// chain of subqueries around a call of one of the extension's functions, on a node where Citus
/// is installed.
///
/// # Safety
/// `parse` is null or a valid query tree.
unsafe fn fence(parse: *mut pg_sys::Query) {
    // SAFETY: the tree's nodes are read as PostgreSQL's headers lay them out: a `FROM` item is
    // a `RangeTblRef` into the query's range table (1-based), a subquery entry holds its query,
    // a function entry its `RangeTblFunction`s; the constant is made in the planner's memory.
    unsafe {
        if parse.is_null() || (*parse).commandType != pg_sys::CmdType::CMD_SELECT {
            return;
        }
        let mut query = parse;
        let mut outermost: *mut pg_sys::Query = std::ptr::null_mut();
        for _ in 0..MAX_DEPTH {
            let Some(entry) = only_from_item(query) else {
                return;
            };
            match (*entry).rtekind {
                pg_sys::RTEKind::RTE_SUBQUERY if !(*entry).subquery.is_null() => {
                    query = (*entry).subquery;
                    if outermost.is_null() {
                        outermost = query;
                    }
                }
                pg_sys::RTEKind::RTE_FUNCTION => {
                    if outermost.is_null()
                        || !(*outermost).limitOffset.is_null()
                        || !calls_ours(entry)
                        || !super::installed()
                    {
                        return;
                    }
                    (*outermost).limitOffset = pg_sys::makeConst(
                        pg_sys::INT8OID,
                        -1,
                        pg_sys::InvalidOid,
                        8,
                        pg_sys::Datum::from(0i64),
                        false,
                        true,
                    )
                    .cast();
                    return;
                }
                _ => return,
            }
        }
    }
}

/// The range-table entry of `query`'s `FROM` list when it has exactly one item, a plain
/// reference (not a join).
///
/// # Safety
/// `query` is a valid query tree.
unsafe fn only_from_item(query: *mut pg_sys::Query) -> Option<*mut pg_sys::RangeTblEntry> {
    // SAFETY: see `fence`.
    unsafe {
        let tree = (*query).jointree;
        if tree.is_null() {
            return None;
        }
        let [item] = port::list_pointers((*tree).fromlist) else {
            return None;
        };
        let item = item.ptr_value.cast::<pg_sys::Node>();
        if item.is_null() || (*item).type_ != pg_sys::NodeTag::T_RangeTblRef {
            return None;
        }
        let index = (*item.cast::<pg_sys::RangeTblRef>()).rtindex;
        let entries = port::list_pointers((*query).rtable);
        let entry = entries.get(usize::try_from(index).ok()?.checked_sub(1)?)?;
        Some(entry.ptr_value.cast())
    }
}

/// Whether a function entry calls a function of the extension's schema.
///
/// # Safety
/// `entry` is a valid `RTE_FUNCTION` entry.
unsafe fn calls_ours(entry: *mut pg_sys::RangeTblEntry) -> bool {
    // SAFETY: see `fence`; the lookups are catalog-cache reads in the planning transaction.
    unsafe {
        let ours = pg_sys::get_namespace_oid(c"syncular".as_ptr(), true);
        if ours == pg_sys::InvalidOid {
            return false;
        }
        port::list_pointers((*entry).functions).iter().any(|f| {
            let call = (*f.ptr_value.cast::<pg_sys::RangeTblFunction>()).funcexpr;
            !call.is_null()
                && (*call).type_ == pg_sys::NodeTag::T_FuncExpr
                && pg_sys::get_func_namespace((*call.cast::<pg_sys::FuncExpr>()).funcid) == ours
        })
    }
}
