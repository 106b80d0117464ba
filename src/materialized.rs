//! A set-returning function's whole result handed to PostgreSQL in one call (`SFRM_Materialize`,
//! `src/include/nodes/execnodes.h`), for the functions whose rows are all computed before the
//! first one is returned (`pull`, `read_commit_window`, `scan_rows`, …).
//!
//! Why: pgrx's `TableIterator` returns one row per call (`SFRM_ValuePerCall`), and every call of
//! a function with a pinned `search_path` (docs/SECURITY.md rule 11) goes through
//! `fmgr_security_definer`, which sets the setting and resets it at the end — on PostgreSQL 15
//! `AtEOXact_GUC` walks every setting each time: about 10 % of a catch-up `pull` of 110 rows
//! (docs/BENCHMARKS.md, "Step 7"). Materialized, the setting is set once per call, as
//! PostgreSQL's own `json_each` or `pg_stat_get_activity` do (their `InitMaterializedSRF`).
//!
//! The type is named `TableIterator` on purpose: `#[pg_extern]` recognises a `RETURNS TABLE`
//! function by the last identifier of its return type, so the SQL it generates (the columns, their
//! names and types) is the one pgrx's own `TableIterator` gets; only the call convention differs.

use pgrx::callconv::{CallCx, RetAbi};
use pgrx::{pg_sys, IntoHeapTuple, PgMemoryContexts};

/// The rows of one call, already computed: the function body builds them, the call convention
/// below writes them into a tuplestore after the body returns.
pub struct TableIterator<'a, Row> {
    rows: Box<dyn Iterator<Item = Row> + 'a>,
}

impl<'a, Row: 'a> TableIterator<'a, Row> {
    pub fn new(rows: impl IntoIterator<Item = Row> + 'a) -> Self {
        Self {
            rows: Box::new(rows.into_iter()),
        }
    }
}

/// The `ReturnSetInfo` a set-returning call gets, if its caller sent one that takes a
/// materialized set (`InitMaterializedSRF`'s check, `src/backend/utils/fmgr/funcapi.c`).
///
/// # Safety
/// `fcinfo` is the call's valid `FunctionCallInfo`.
unsafe fn materialize_allowed(
    fcinfo: pg_sys::FunctionCallInfo,
) -> Option<*mut pg_sys::ReturnSetInfo> {
    // SAFETY: the caller passes the call's fcinfo; `resultinfo` is a node or null.
    unsafe {
        let info = (*fcinfo).resultinfo;
        if info.is_null() || (*info).type_ != pg_sys::NodeTag::T_ReturnSetInfo {
            return None;
        }
        let rsinfo = info.cast::<pg_sys::ReturnSetInfo>();
        let modes = (*rsinfo).allowedModes;
        (modes & pg_sys::SetFunctionReturnMode::SFRM_Materialize as i32 != 0).then_some(rsinfo)
    }
}

// SAFETY: `check_fcinfo_and_prepare` refuses any call without a `ReturnSetInfo` that allows
// `SFRM_Materialize` before the function body runs, and always answers `WrappedFn`, so pgrx
// never asks for a multi-call context (`ret_from_fcinfo_fcx`); `box_ret_in_fcinfo` follows
// PostgreSQL's materialize protocol exactly once per call.
unsafe impl<Row: IntoHeapTuple> RetAbi for TableIterator<'_, Row> {
    type Item = Row;
    type Ret = Self;

    unsafe fn check_fcinfo_and_prepare(fcinfo: pg_sys::FunctionCallInfo) -> CallCx {
        // SAFETY: pgrx's wrapper passes the call's fcinfo.
        if unsafe { materialize_allowed(fcinfo) }.is_none() {
            // PostgreSQL's words and code for the same refusal (funcapi.c).
            pgrx::ereport!(
                ERROR,
                pgrx::PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
                "materialize mode required, but it is not allowed in this context"
            );
        }
        // SAFETY: reading the backend's current context.
        CallCx::WrappedFn(unsafe { pg_sys::CurrentMemoryContext })
    }

    fn to_ret(self) -> Self::Ret {
        self
    }

    unsafe fn box_ret_in_fcinfo(fcinfo: pg_sys::FunctionCallInfo, ret: Self::Ret) -> pg_sys::Datum {
        // SAFETY: checked in `check_fcinfo_and_prepare`, which ran first in this call.
        let Some(rsinfo) = (unsafe { materialize_allowed(fcinfo) }) else {
            unreachable!("the call was checked before its body ran")
        };
        // SAFETY: `InitMaterializedSRF`'s steps: the result type read from the call, the
        // tuplestore and its descriptor made in the query's memory so they outlive this call.
        let (store, desc) = unsafe {
            let mut desc: pg_sys::TupleDesc = std::ptr::null_mut();
            let kind = pg_sys::get_call_result_type(fcinfo, std::ptr::null_mut(), &mut desc);
            if kind != pg_sys::TypeFuncClass::TYPEFUNC_COMPOSITE || desc.is_null() {
                pgrx::ereport!(
                    ERROR,
                    pgrx::PgSqlErrorCode::ERRCODE_DATATYPE_MISMATCH,
                    "return type must be a row type"
                );
            }
            let mut query = PgMemoryContexts::For((*(*rsinfo).econtext).ecxt_per_query_memory);
            let random = (*rsinfo).allowedModes
                & pg_sys::SetFunctionReturnMode::SFRM_Materialize_Random as i32
                != 0;
            query.switch_to(|_| {
                let desc = pg_sys::CreateTupleDescCopy(desc);
                let store = pg_sys::tuplestore_begin_heap(random, false, pg_sys::work_mem);
                (store, desc)
            })
        };
        // Each row formed in a scratch context reset after the tuplestore copied it, so the
        // call holds one formed row at a time besides the store (docs/SECURITY.md rule 14).
        let mut scratch = PgMemoryContexts::new("syncular result row");
        for row in ret.rows {
            crate::interrupts::check();
            // SAFETY: `desc` describes the function's declared columns, which pgrx generated
            // from the same `Row` types; the store copies the tuple into its own context.
            unsafe {
                scratch.switch_to(|_| {
                    let tuple = row.into_heap_tuple(desc);
                    pg_sys::tuplestore_puttuple(store, tuple);
                });
                scratch.reset();
            }
        }
        // SAFETY: the materialize protocol's answer (execSRF.c reads these after the call).
        unsafe {
            (*rsinfo).returnMode = pg_sys::SetFunctionReturnMode::SFRM_Materialize;
            (*rsinfo).setResult = store;
            (*rsinfo).setDesc = desc;
        }
        pg_sys::Datum::from(0)
    }

    unsafe fn fill_fcinfo_fcx(&self, _fcinfo: pg_sys::FunctionCallInfo) {}

    unsafe fn move_into_fcinfo_fcx(self, _fcinfo: pg_sys::FunctionCallInfo) {}
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    /// One materialized function (`tombstone_seqs`) read every way SQL calls a set-returning
    /// function: in `FROM` (`ExecMakeTableFunctionResult`), in the select list (`ProjectSet`,
    /// `ExecMakeFunctionResultSet`), once per outer row (`LATERAL`: each call gets a store of its
    /// own), through a scroll cursor read backwards (`SFRM_Materialize_Random`), empty, and with
    /// a result larger than `work_mem` (the store spills to a file) — every way the same rows.
    #[pg_test]
    fn every_caller_of_a_materialized_function_reads_its_rows() {
        Spi::run(
            "SET LOCAL work_mem = '64kB';
             INSERT INTO syncular.sync_tombstones (partition, tbl, row_id, commit_seq)
               SELECT p, 't', 'r' || lpad(i::text, 5, '0'), i * 10 + length(p)
                 FROM generate_series(1, 3000) i, unnest(ARRAY['a', 'bb']) p;
             CREATE TEMP TABLE ids AS
               SELECT array_agg('r' || lpad(i::text, 5, '0')) AS ids FROM generate_series(0, 3001) i;",
        )
        .expect("setup");
        let expected = |p: &str| {
            (1..=3000i64)
                .map(|i| format!("r{i:05}:{}", i * 10 + p.len() as i64))
                .collect::<Vec<_>>()
                .join(",")
        };
        let one = |sql: &str| Spi::get_one::<String>(sql).expect(sql).unwrap_or_default();
        let from = "SELECT string_agg(row_id || ':' || commit_seq, ',' ORDER BY row_id)
                      FROM ids, syncular.tombstone_seqs('a', 't', ids.ids)";
        assert_eq!(one(from), expected("a"));
        let select_list = "SELECT string_agg(s.row_id || ':' || s.commit_seq, ',' ORDER BY s.row_id)
                             FROM (SELECT (syncular.tombstone_seqs('bb', 't', ids.ids)).* FROM ids) s";
        assert_eq!(one(select_list), expected("bb"));
        let lateral = "SELECT string_agg(p || '/' || s.row_id || ':' || s.commit_seq, ','
                                         ORDER BY p, s.row_id)
                         FROM ids, unnest(ARRAY['bb', 'a', 'none']) p,
                              LATERAL syncular.tombstone_seqs(p, 't', ids.ids) s";
        let both = ["a", "bb"]
            .iter()
            .flat_map(|p| {
                expected(p)
                    .split(',')
                    .map(|r| format!("{p}/{r}"))
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(one(lateral), both);
        let empty =
            "SELECT count(*)::text FROM syncular.tombstone_seqs('none', 't', ARRAY['r00001'])";
        assert_eq!(one(empty), "0");
        Spi::run(
            "DECLARE c SCROLL CURSOR FOR
               SELECT row_id, commit_seq
                 FROM syncular.tombstone_seqs('a', 't', (SELECT ids FROM ids));
             MOVE LAST IN c;",
        )
        .expect("cursor");
        let backwards = Spi::connect_mut(|client| {
            client
                .update("FETCH BACKWARD 3 FROM c", None, &[])
                .expect("fetch")
                .map(|row| row.get::<String>(1).expect("row_id").unwrap_or_default())
                .collect::<Vec<_>>()
        });
        assert_eq!(backwards, ["r02999", "r02998", "r02997"]);
    }
}
