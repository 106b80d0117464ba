//! The bootstrap scan (docs/DESIGN.md §Pull path, "Bootstrap"): the current rows of one table
//! whose scopes match a filter, a page at a time — candidates from a bounded range of the
//! `sync_row_scopes` primary key per value of the first variable, read with the extension's
//! rights; the rows themselves from the host's table by primary key on the caller's behalf
//! (src/tables/statements.rs), matched against the whole filter and cut by the call's budget.

use super::budget::{Budget, ROW_OVERHEAD};
use crate::access;
use crate::alloc;
use crate::args;
use crate::db;
use crate::error::{self, Error, Result};
use crate::jsonb::OwnedJsonb;
use crate::limits;
use crate::materialized;
use crate::scope::{self, Filter};
use crate::tables;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

/// One current row of a bootstrap page, as `scan_rows` returns it.
pub struct ScanRow {
    pub row_id: String,
    pub server_version: i64,
    /// `_sync_scopes` in jsonb's binary form (a string-wrapped value unwrapped by the
    /// statement), read in place and returned as it is.
    pub scopes: OwnedJsonb,
    pub payload: Vec<u8>,
    pub column_versions: Option<Vec<u8>>,
}

impl ScanRow {
    /// What the row counts against the [`Budget`].
    fn size(&self) -> usize {
        ROW_OVERHEAD
            + self.row_id.len()
            + self.scopes.len()
            + self.payload.len()
            + self.column_versions.as_ref().map_or(0, Vec::len)
    }

    fn into_columns(self) -> (String, i64, OwnedJsonb, Vec<u8>, Option<Vec<u8>>) {
        (
            self.row_id,
            self.server_version,
            self.scopes,
            self.payload,
            self.column_versions,
        )
    }
}

/// One page of bootstrap candidates: one bounded range of the `sync_row_scopes` primary key per
/// value, merged, ascending.
const SCAN_CANDIDATES_SQL: &str = "\
SELECT DISTINCT s.row_id
  FROM unnest($4::text[]) AS v(value)
  CROSS JOIN LATERAL (
    SELECT r.row_id FROM syncular.sync_row_scopes r
     WHERE r.partition = $1 AND r.tbl = $2 AND r.var = $3 AND r.value = v.value COLLATE \"C\"
       AND ($5::text IS NULL OR r.row_id > $5::text)
     ORDER BY r.row_id LIMIT $6) AS s
 ORDER BY s.row_id LIMIT $6";

/// What [`scan`] read: the kept rows, and whether the [`Budget`] cut the page short.
pub struct Scan {
    pub rows: Vec<ScanRow>,
    pub truncated: bool,
}

#[allow(clippy::too_many_arguments)]
pub fn scan(
    client: &SpiClient<'_>,
    relation: &tables::AppRelation,
    partition: &str,
    tbl: &str,
    filter: &Filter,
    after_row_id: Option<String>,
    lim: i64,
    budget: &mut Budget,
) -> Result<Scan> {
    let mut out = Scan {
        rows: Vec::new(),
        truncated: false,
    };
    let Some((var, values)) = filter.first() else {
        return Ok(out);
    };
    let batch = lim.max(64);
    let mut after = after_row_id;
    // The candidates come from the extension's index (read with the extension's rights), the
    // rows from the host's table by its primary key (read on the caller's behalf,
    // docs/SECURITY.md), in candidate order: a row's values are copied out only when the fold
    // takes it, so the budget bounds what is copied, not just what is returned.
    loop {
        let candidates: Vec<String> = access::as_extension_owner(|| {
            db::texts(db::read(
                client,
                SCAN_CANDIDATES_SQL,
                &[
                    DatumWithOid::from(partition),
                    DatumWithOid::from(tbl),
                    DatumWithOid::from(var),
                    DatumWithOid::from(values.to_vec()),
                    DatumWithOid::from(after.clone()),
                    DatumWithOid::from(batch),
                ],
            )?)
        })?;
        let Some(page_last) = candidates.last().cloned() else {
            break;
        };
        // Candidate order; a row deleted since its entry was read is simply absent.
        let done = relation.scan_rows(client, partition, &candidates, |row| {
            crate::interrupts::check();
            alloc::check()?;
            let Some(scopes) = OwnedJsonb::column(row, 3)? else {
                return Ok(false);
            };
            if !filter.matches_binary(&scopes) {
                return Ok(false);
            }
            if !budget.open() {
                out.truncated = true;
                return Ok(true);
            }
            let scanned = ScanRow {
                row_id: db::text_column(row, 1)?.unwrap_or_default(),
                server_version: row.get::<i64>(2)?.unwrap_or_default(),
                scopes,
                payload: db::bytes_column(row, 4)?.unwrap_or_default(),
                column_versions: db::bytes_column(row, 5)?,
            };
            budget.spend(scanned.size());
            alloc::try_reserve(&mut out.rows, 1)?;
            out.rows.push(scanned);
            Ok(out.rows.len() as i64 >= lim)
        })?;
        if done || (candidates.len() as i64) < batch {
            break;
        }
        // Every candidate of the page was consumed: continue after the last one.
        after = Some(page_last);
    }
    Ok(out)
}

/// SECURITY INVOKER: the caller must hold `SELECT` on the registered relation, which is read
/// as its owner in a restricted security context (docs/SECURITY.md).
#[pg_extern(stable, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
#[allow(clippy::type_complexity)]
fn scan_rows(
    partition: Option<&str>,
    tbl: Option<&str>,
    scope_filter: Option<args::JsonArg>,
    after_row_id: Option<&str>,
    lim: Option<i32>,
) -> materialized::TableIterator<
    'static,
    (
        name!(row_id, String),
        name!(server_version, i64),
        name!(scopes, OwnedJsonb),
        name!(payload, Vec<u8>),
        name!(column_versions, Option<Vec<u8>>),
    ),
> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let tbl = args::text("tbl", tbl)?;
        let filter = scope::filter("scope_filter", scope_filter)?;
        let lim = args::row_limit("lim", lim)?;
        let lim = args::at_least("lim", Some(lim.into()), 1)?;
        if filter.keys.is_empty() {
            // Before the table check, so the refusal never names the table (upstream order).
            return Err(
                Error::bare(crate::error::Code::ScanRequiresScope).with_hint(
                    "scope_filter must name at least one scope variable with its values, e.g. \
                 {\"project_id\": [\"p1\"]}; a subscription whose effective scopes are empty \
                 is revoked, not scanned",
                ),
            );
        }
        let caller = access::current_role();
        let scan = db::with_spi(|client| {
            let relation = tables::open_for_read(client, &tbl, caller)?;
            let mut budget = Budget::new();
            scan(
                client,
                &relation,
                &partition,
                &tbl,
                &filter,
                args::optional_key("after_row_id", after_row_id)?,
                lim,
                &mut budget,
            )
        })?;
        if scan.truncated {
            return Err(limits::over_output("lim"));
        }
        Ok(materialized::TableIterator::new(
            scan.rows.into_iter().map(ScanRow::into_columns),
        ))
    })
}
