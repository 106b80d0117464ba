//! The guard against Citus's crashes on a delegated call of the extension's functions (red teams
//! 39 and 41–45; docs/SCALING.md, "a Citus bug, and the guard against it"). Citus 13 delegates a distributed function's call to the node of its partition
//! when a query is `SELECT f(…)` or `SELECT … FROM f(…)` — and it decides so on the query as
//! PostgreSQL's planner left it, then deparses that query to send it. A query the planner
//! brought to that form — a subquery pulled up (`SELECT * FROM (SELECT * FROM f(…)) t`), a
//! second `FROM` item it dropped (`…, (SELECT) z`), a CTE or a SQL function it inlined, a view —
//! still holds the entries of what it rewrote in its range table, and Citus's deparse of it
//! crashes the backend (SIGSEGV in `AcquireRewriteLocks`), which makes PostgreSQL restart every
//! session of the node. Any role that may name the function triggers it, `EXECUTE` or not.
//!
//! Guessing the planner's rewrites from the tree before planning missed half of them (red team
//! 41). So the guard looks at the tree Citus looks at: from `create_upper_paths_hook` at the end
//! of the top query's planning (`UPPERREL_FINAL`), which Citus's planner reaches through
//! `standard_planner` before it decides. Where one of the extension's functions is called where
//! Citus could delegate it — the one target-list call, or in the one `FROM` function — and the
//! query is not one of the two documented forms (`SELECT syncular.f(…)`: an empty `FROM`, only its
//! `RTE_RESULT` in the range table; `SELECT <columns> FROM syncular.f(…)`: the one function entry,
//! real columns) with no other clause and a partition that is not a NULL constant, the guard
//! gives the query a `WHERE true` — planning is over, so the plan is unchanged — and Citus, which
//! delegates no query with a `WHERE`, runs the call on this node as any call it does not
//! delegate. Matching only the documented forms, not Citus's own choice of which call it takes,
//! leaves nothing to guess: red team 42 found a target-list call over a `FROM` function Citus
//! does not count, 43 a documented form with a `GROUP BY ()` (Citus's deparse of rewritten
//! grouping sets crashes too), 44 a NULL partition (Citus hashes the NULL's pointer to pick the
//! node). The documented forms are delegated as before.
//!
//! It protects a node only where the library is loaded before a session plans anything, so
//! `distribute()` requires `syncular` in every node's `shared_preload_libraries`, and a call on a
//! node that does not preload it is refused (`super::require_preloaded`).

use crate::port;
use pgrx::pg_sys;

/// The `create_upper_paths_hook` installed before ours.
static mut PREVIOUS: pg_sys::create_upper_paths_hook_type = None;

/// The `planner_hook` installed before ours (Citus's, which `distribute()` requires to be
/// preloaded first).
static mut PREVIOUS_PLANNER: pg_sys::planner_hook_type = None;

/// Installs the hooks (from `_PG_init`, once per process that loads the library).
pub fn install() {
    // SAFETY: `_PG_init` runs once per process, single-threaded, before any planning of ours;
    // the hooks installed before ours are kept and called by ours.
    unsafe {
        PREVIOUS = pg_sys::create_upper_paths_hook;
        pg_sys::create_upper_paths_hook = Some(fence_after_planning);
        PREVIOUS_PLANNER = pg_sys::planner_hook;
        pg_sys::planner_hook = Some(plan_then_check);
    }
}

/// The planner hook: the planners before ours (Citus's), then whether the plan delegates a host's
/// function in a transaction that pinned a partition ([`delegated_host_call`]).
unsafe extern "C-unwind" fn plan_then_check(
    parse: *mut pg_sys::Query,
    query_string: *const std::ffi::c_char,
    cursor_options: std::ffi::c_int,
    bound: pg_sys::ParamListInfo,
) -> *mut pg_sys::PlannedStmt {
    // A replayed setting's window never reaches planning (src/citus/one_partition.rs).
    super::one_partition::replay_done();
    // SAFETY: PostgreSQL's arguments, passed on unchanged; the check reads the trees only.
    unsafe {
        propagated_guarded(parse);
        let planned =
            super::plan_with(PREVIOUS_PLANNER, parse, query_string, cursor_options, bound);
        // Only Citus makes a custom scan of a query: elsewhere nothing more is looked at.
        let tree = if planned.is_null() {
            std::ptr::null_mut()
        } else {
            (*planned).planTree
        };
        if !tree.is_null() && (*tree).type_ == pg_sys::NodeTag::T_CustomScan {
            check_guarded(parse, planned);
        }
        planned
    }
}

/// Before a query that calls one of the extension's functions where Citus may delegate it — the
/// one target-list call, or a `FROM` function — is planned: the transaction's settings Citus
/// propagates are refused, and the call is noted against a later one (`super::propagated`; red
/// team 64). A delegated call's body runs on another node, whose own check cannot see a command
/// made here, and Citus decides to delegate in the planning this precedes.
/// Behind pgrx's guard: the refusal is raised from here, before anything is planned.
///
/// # Safety
/// `parse` is null or a valid query tree.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn propagated_guarded(parse: *mut pg_sys::Query) {
    // SAFETY: the caller's tree, read as `fence` reads it.
    let calls_ours = unsafe {
        !parse.is_null()
            && (*parse).commandType == pg_sys::CmdType::CMD_SELECT
            && super::installed()
            && (only_target_call(parse).is_some_and(|f| is_ours(f))
                || port::list_pointers((*parse).rtable).iter().any(|e| {
                    let entry = e.ptr_value.cast::<pg_sys::RangeTblEntry>();
                    (*entry).rtekind == pg_sys::RTEKind::RTE_FUNCTION
                        && our_function(entry).is_some()
                }))
    };
    if calls_ours {
        if let Err(refused) = super::propagated::refuse() {
            crate::error::raise_error(refused)
        }
    }
}

/// [`delegated_host_call`] behind pgrx's guard: its refusal is raised from here.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn check_guarded(
    parse: *mut pg_sys::Query,
    planned: *mut pg_sys::PlannedStmt,
) {
    // SAFETY: the caller's valid trees.
    if let Some(refused) = unsafe { delegated_host_call(parse, planned) } {
        crate::error::raise_error(refused)
    }
}

/// Refuses (`SY004` `citus_one_partition`) a plan in which Citus delegates a call of a host's
/// function to another node in a transaction whose push pinned a partition
/// (`super::one_partition`; red team 56, F1): the calls of the extension inside the host's
/// function run there unpinned, and one appending to another partition escaped the rule. The
/// host's function is not read (its distribution argument could name the pinned partition or
/// another): on Citus the push's own functions are called directly. A query that reads no
/// relation and is planned as Citus's custom scan is a delegated call.
///
/// # Safety
/// `parse` is the query `planned` was planned from; both valid trees, `planned` a custom scan
/// (`plan_then_check` looks at nothing else).
unsafe fn delegated_host_call(
    parse: *mut pg_sys::Query,
    planned: *mut pg_sys::PlannedStmt,
) -> Option<crate::error::Error> {
    // SAFETY: the trees' nodes read as PostgreSQL's headers lay them out (see `fence`).
    unsafe {
        // A subquery or a CTE may read a relation the range table does not show, and Citus
        // delegates no call with one (red team 57, F2: `SELECT abs((SELECT count(*) FROM …))`
        // was taken for a delegated call).
        if parse.is_null()
            || planned.is_null()
            || (*parse).commandType != pg_sys::CmdType::CMD_SELECT
            || (*parse).hasSubLinks
            || !(*parse).cteList.is_null()
            || !super::installed()
        {
            return None;
        }
        let pinned = super::one_partition::pinned()?;
        let entries = port::list_pointers((*parse).rtable);
        let mut calls = Vec::new();
        for entry in entries {
            let entry = entry.ptr_value.cast::<pg_sys::RangeTblEntry>();
            match (*entry).rtekind {
                pg_sys::RTEKind::RTE_RESULT => {}
                pg_sys::RTEKind::RTE_FUNCTION => calls.extend(entry_calls(entry)),
                // A relation, a subquery, …: not a delegated call.
                _ => return None,
            }
        }
        calls.extend(only_target_call(parse));
        if calls.is_empty() || calls.iter().any(|call| is_ours(*call)) {
            return None;
        }
        Some(super::one_partition::refusal_with(format!(
            "this transaction pushes to partition {pinned:?}, and Citus sends this function to \
             another node, where the extension's calls inside it would not be held to that \
             partition: call the push's functions directly (docs/SCALING.md, \"One partition \
             per push transaction\")"
        )))
    }
}

/// The hook (`src/include/optimizer/planner.h`, the same on PostgreSQL 15 and 18): calls the one
/// before ours, then fences the top query (see the module's comment). No `pg_guard` on it: an
/// ERROR in the hook before ours passes through, and nothing of ours is live.
unsafe extern "C-unwind" fn fence_after_planning(
    root: *mut pg_sys::PlannerInfo,
    stage: pg_sys::UpperRelationKind::Type,
    input: *mut pg_sys::RelOptInfo,
    output: *mut pg_sys::RelOptInfo,
    extra: *mut std::ffi::c_void,
) {
    // SAFETY: PostgreSQL passes a valid planner state; the hook before ours takes the same
    // arguments.
    unsafe {
        if let Some(previous) = PREVIOUS {
            previous(root, stage, input, output, extra);
        }
        if stage == pg_sys::UpperRelationKind::UPPERREL_FINAL
            && !root.is_null()
            && (*root).parent_root.is_null()
        {
            fence_guarded((*root).parse);
        }
    }
}

/// [`fence`] behind pgrx's guard: an ERROR from a catalog lookup in it is raised from here, and
/// so is a call refused for its partition (`super::one_partition`), once nothing of `fence`'s is
/// live.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn fence_guarded(parse: *mut pg_sys::Query) {
    // SAFETY: the caller's valid query tree.
    if let Some(refused) = unsafe { fence(parse) } {
        crate::error::raise_error(refused)
    }
}

/// Gives `parse` a `WHERE true` where it calls one of the extension's functions where Citus
/// could delegate it and is not one of the documented forms, on a node where Citus is installed.
/// A call that begins, stages, appends or stores the result of a push, with a constant
/// partition, is held to the partition its transaction pinned first: the error refusing it
/// is returned, to be raised by the caller.
///
/// # Safety
/// `parse` is null or a valid query tree whose planning is over.
unsafe fn fence(parse: *mut pg_sys::Query) -> Option<crate::error::Error> {
    // SAFETY: the tree's nodes are read as PostgreSQL's headers lay them out (a `FROM` item is a
    // `RangeTblRef` into the 1-based range table, a function entry holds `RangeTblFunction`s, a
    // target entry its expression); the constant is made in the planner's memory.
    unsafe {
        // Citus first: where it is not installed (one cached answer per backend) nothing else
        // is looked at, so the hook costs a non-Citus query nothing but this.
        if parse.is_null()
            || (*parse).commandType != pg_sys::CmdType::CMD_SELECT
            || (*parse).jointree.is_null()
            || !(*(*parse).jointree).quals.is_null()
            || !super::installed()
        {
            return None;
        }
        let entries = port::list_pointers((*parse).rtable);
        let kind = |entry: *mut pg_sys::RangeTblEntry| (*entry).rtekind;
        let item = match port::list_pointers((*(*parse).jointree).fromlist) {
            [] => None,
            [item] => match from_entry(item, entries) {
                Some(entry) => Some(entry),
                None => return None,
            },
            // More than one FROM item: Citus delegates none of those.
            _ => return None,
        };
        // Citus delegates the call in the target list or the one in FROM (function_call_
        // delegation.c); which one it takes depends on how it reads the FROM function (a
        // `current_date`, `ROWS FROM` of two, a multi-argument `unnest` are not counted: red
        // team 42). Both are looked at.
        let in_target = only_target_call(parse).filter(|f| is_ours(*f));
        let in_from = item
            .filter(|e| kind(*e) == pg_sys::RTEKind::RTE_FUNCTION)
            .and_then(|e| our_function(e));
        let call = in_target.or(in_from)?;
        if let Err(refused) = pin_partition(call) {
            return Some(refused);
        }
        let entry_of = |cell: &pg_sys::ListCell| cell.ptr_value.cast::<pg_sys::RangeTblEntry>();
        // The documented forms, nothing else: `SELECT syncular.f(…)` (an empty FROM, only its
        // results in the range table) and `SELECT <columns> FROM syncular.f(…)` (the one function
        // entry, the target list its columns).
        let documented = match (in_target, in_from, item) {
            (Some(_), None, _) => {
                item.is_none_or(|e| kind(e) == pg_sys::RTEKind::RTE_RESULT)
                    && entries
                        .iter()
                        .all(|e| kind(entry_of(e)) == pg_sys::RTEKind::RTE_RESULT)
            }
            (None, Some(_), Some(function)) => {
                matches!(entries, [only] if entry_of(only) == function) && only_columns(parse)
            }
            _ => false,
        };
        if documented && nothing_else(parse) && !null_partition(call) {
            return None;
        }
        (*(*parse).jointree).quals = pg_sys::makeBoolConst(true, false);
        None
    }
}

/// Holds a call of [`super::one_partition::PINNED_BY`] whose partition is a constant (as Citus
/// needs it to delegate the call in a transaction block) to the partition its transaction
/// pinned (`super::one_partition::require`). Any other call: nothing.
///
/// # Safety
/// `call` is a valid function call node whose planning is over.
unsafe fn pin_partition(call: *mut pg_sys::FuncExpr) -> crate::error::Result<()> {
    // SAFETY: a catalog-cache lookup by OID (NULL when absent), the first argument's node read as
    // `null_partition` reads it, and a text constant's bytes copied out by PostgreSQL's own
    // `text_to_cstring` (detoasting it), both results palloc'd and freed here.
    let partition = unsafe {
        let name = pg_sys::get_func_name((*call).funcid);
        if name.is_null() {
            return Ok(());
        }
        let pinned_by = super::one_partition::PINNED_BY
            .iter()
            .any(|f| std::ffi::CStr::from_ptr(name).to_bytes() == f.as_bytes());
        pg_sys::pfree(name.cast());
        if !pinned_by {
            return Ok(());
        }
        let node = partition_node(call);
        if node.is_null() || (*node).type_ != pg_sys::NodeTag::T_Const {
            return Ok(());
        }
        let constant = node.cast::<pg_sys::Const>();
        // A partition longer than any the API takes is refused by the call itself
        // (`crate::limits::KEY_BYTES`); it is not copied here.
        if (*constant).constisnull
            || ![pg_sys::TEXTOID, pg_sys::VARCHAROID].contains(&(*constant).consttype)
            || pg_sys::toast_raw_datum_size((*constant).constvalue)
                > crate::limits::KEY_BYTES + pg_sys::VARHDRSZ
        {
            return Ok(());
        }
        let text = pg_sys::text_to_cstring((*constant).constvalue.cast_mut_ptr());
        let partition = std::ffi::CStr::from_ptr(text)
            .to_string_lossy()
            .into_owned();
        pg_sys::pfree(text.cast());
        partition
    };
    super::one_partition::require(&partition)
}

/// Whether the query has no clause beyond its range table, `FROM` and target list: no CTE,
/// grouping (`GROUP BY ()`, `ROLLUP`, `CUBE`: Citus's deparse of the planner's rewritten
/// grouping sets crashes too), `HAVING`, window, `DISTINCT`, `ORDER BY`, `LIMIT`/`OFFSET`, row
/// locks, set operation, aggregate, set-returning function in the target list or subquery (red
/// team 43: the documented forms with one such clause added were delegated, and crashed or went
/// whole to another node). These are all the fields of `Query` a `SELECT` sets on PostgreSQL 15
/// and 18; a later major's new clause must be added here.
///
/// # Safety
/// `parse` is a valid query tree.
unsafe fn nothing_else(parse: *mut pg_sys::Query) -> bool {
    // SAFETY: see `fence`.
    let q = unsafe { &*parse };
    q.utilityStmt.is_null()
        && q.cteList.is_null()
        && !q.hasAggs
        && !q.hasWindowFuncs
        && !q.hasTargetSRFs
        && !q.hasSubLinks
        && !q.hasDistinctOn
        && !q.hasRecursive
        && !q.hasModifyingCTE
        && !q.hasForUpdate
        && q.groupClause.is_null()
        && q.groupingSets.is_null()
        && q.havingQual.is_null()
        && q.windowClause.is_null()
        && q.distinctClause.is_null()
        && q.sortClause.is_null()
        && q.limitOffset.is_null()
        && q.limitCount.is_null()
        && q.rowMarks.is_null()
        && q.setOperations.is_null()
}

/// Whether every entry of the target list is a plain column (`SELECT *`, `SELECT a, b`).
///
/// # Safety
/// `parse` is a valid query tree.
unsafe fn only_columns(parse: *mut pg_sys::Query) -> bool {
    // SAFETY: see `fence`.
    unsafe {
        port::list_pointers((*parse).targetList).iter().all(|t| {
            let expr = (*t.ptr_value.cast::<pg_sys::TargetEntry>()).expr;
            // A column, not the whole row (`SELECT g FROM syncular.pull(…) g`: Citus cannot
            // read back an anonymous record, red team 44, N2).
            !expr.is_null()
                && (*expr).type_ == pg_sys::NodeTag::T_Var
                && (*expr.cast::<pg_sys::Var>()).varattno > 0
        })
    }
}

/// The range-table entry a `FROM` item refers to, when it is a plain reference.
///
/// # Safety
/// `item` is a cell of a valid `FROM` list, `entries` the query's range table.
unsafe fn from_entry(
    item: &pg_sys::ListCell,
    entries: &[pg_sys::ListCell],
) -> Option<*mut pg_sys::RangeTblEntry> {
    // SAFETY: see `fence`.
    unsafe {
        let node = item.ptr_value.cast::<pg_sys::Node>();
        if node.is_null() || (*node).type_ != pg_sys::NodeTag::T_RangeTblRef {
            return None;
        }
        let index = (*node.cast::<pg_sys::RangeTblRef>()).rtindex;
        let entry = entries.get(usize::try_from(index).ok()?.checked_sub(1)?)?;
        Some(entry.ptr_value.cast())
    }
}

/// One of the extension's functions a function entry calls (`ROWS FROM` may hold several).
///
/// # Safety
/// `entry` is a valid `RTE_FUNCTION` entry.
unsafe fn our_function(entry: *mut pg_sys::RangeTblEntry) -> Option<*mut pg_sys::FuncExpr> {
    // SAFETY: see `fence`.
    unsafe { entry_calls(entry).find(|f| is_ours(*f)) }
}

/// The function calls a function entry holds (`ROWS FROM` may hold several).
///
/// # Safety
/// `entry` is a valid `RTE_FUNCTION` entry of a tree that outlives the iterator.
unsafe fn entry_calls(
    entry: *mut pg_sys::RangeTblEntry,
) -> impl Iterator<Item = *mut pg_sys::FuncExpr> {
    // SAFETY: see `fence`; each item of the list is a `RangeTblFunction`.
    unsafe {
        port::list_pointers((*entry).functions)
            .iter()
            .filter_map(|f| function_of((*f.ptr_value.cast::<pg_sys::RangeTblFunction>()).funcexpr))
    }
}

/// The function of a query whose target list is one function call (`SELECT f(…)`).
///
/// # Safety
/// `parse` is a valid query tree.
unsafe fn only_target_call(parse: *mut pg_sys::Query) -> Option<*mut pg_sys::FuncExpr> {
    // SAFETY: see `fence`.
    unsafe {
        let [target] = port::list_pointers((*parse).targetList) else {
            return None;
        };
        function_of(
            (*target.ptr_value.cast::<pg_sys::TargetEntry>())
                .expr
                .cast(),
        )
    }
}

/// The call `node` is, when it is a function call.
///
/// # Safety
/// `node` is null or a valid expression node.
unsafe fn function_of(node: *mut pg_sys::Node) -> Option<*mut pg_sys::FuncExpr> {
    // SAFETY: see `fence`.
    unsafe {
        (!node.is_null() && (*node).type_ == pg_sys::NodeTag::T_FuncExpr)
            .then(|| node.cast::<pg_sys::FuncExpr>())
    }
}

/// Whether `call` calls a function of the extension's schema.
///
/// # Safety
/// `call` is a valid function call node.
unsafe fn is_ours(call: *mut pg_sys::FuncExpr) -> bool {
    // SAFETY: the caller's node; catalog-cache lookups in the planning transaction,
    // `InvalidOid` when absent.
    unsafe {
        let ours = pg_sys::get_namespace_oid(c"syncular".as_ptr(), true);
        ours != pg_sys::InvalidOid && pg_sys::get_func_namespace((*call).funcid) == ours
    }
}

/// Whether the call's first argument — the partition, every delegated function's distribution
/// argument (src/distribute.rs) — is a NULL constant, seen through binary-compatible casts.
/// Citus checks that it is a constant, not that it is not NULL, and hashes the NULL's pointer
/// picking the node (`FindShardInterval`: SIGSEGV; red team 44, N1: `SELECT
/// syncular.get_reaction(NULL, …)`, or a host's NULL bound to `$1`). Any other argument is left
/// to Citus: it declines what it cannot route without deparsing it, and keeps a prepared
/// statement on custom plans, where it can route the bound value, only if it sees the parameter.
///
/// # Safety
/// `call` is a valid function call node whose planning is over.
unsafe fn null_partition(call: *mut pg_sys::FuncExpr) -> bool {
    // SAFETY: see `fence`.
    unsafe {
        let node = partition_node(call);
        !node.is_null()
            && (*node).type_ == pg_sys::NodeTag::T_Const
            && (*node.cast::<pg_sys::Const>()).constisnull
    }
}

/// The call's first argument — the partition, every delegated function's distribution argument
/// (src/distribute.rs) — seen through binary-compatible casts; null where the call has none.
///
/// # Safety
/// `call` is a valid function call node.
unsafe fn partition_node(call: *mut pg_sys::FuncExpr) -> *mut pg_sys::Node {
    // SAFETY: see `fence`.
    unsafe {
        let [first, ..] = port::list_pointers((*call).args) else {
            return std::ptr::null_mut();
        };
        let mut node = first.ptr_value.cast::<pg_sys::Node>();
        while !node.is_null() && (*node).type_ == pg_sys::NodeTag::T_RelabelType {
            node = (*node.cast::<pg_sys::RelabelType>()).arg.cast();
        }
        node
    }
}
