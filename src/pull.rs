//! The pull path (docs/DESIGN.md §Pull path): the commit window through the inverted scope
//! index of the log, the bootstrap scan through the scope index of current rows, and the
//! newest scoped seq.
//!
//! Candidates come only from primary-key ranges of `sync_change_scopes` / `sync_row_scopes`,
//! one bounded index range per value of the first variable; rows are then fetched by key and
//! matched against the whole filter in SQL, so non-matching payloads never leave the executor.

use crate::access;
use crate::args;
use crate::db;
use crate::error::{self, Error, Result};
use crate::scope::{self, Filter};
use crate::scope_matches;
use crate::tables;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use pgrx::JsonB;
use std::collections::HashMap;

/// One page of candidate commits: the distinct `commit_seq` above `after`, ascending. One
/// bounded index range per value, merged.
const WINDOW_CANDIDATES_SQL: &str = "\
SELECT DISTINCT s.commit_seq
  FROM unnest($4::text[]) AS v(value)
  CROSS JOIN LATERAL (
    SELECT c.commit_seq FROM syncular.sync_change_scopes c
     WHERE c.partition = $1 AND c.tbl = $2 AND c.var = $3 AND c.value = v.value COLLATE \"C\"
       AND c.commit_seq > $5 AND c.commit_seq <= $6
     ORDER BY c.commit_seq LIMIT $7) AS s
 ORDER BY s.commit_seq LIMIT $7";

/// The matching changes of `tbl` in the candidate commits that still exist, by key.
const WINDOW_CHANGES_SQL: &str = concat!(
    "SELECT c.commit_seq, c.created_at_ms, c.actor_id, ch.idx, ch.row_id,
            CASE ch.op WHEN 2 THEN 'delete' ELSE 'upsert' END,
            CASE ch.op WHEN 2 THEN NULL ELSE ch.row_version END,
            ch.scopes,
            CASE ch.op WHEN 2 THEN NULL ELSE ch.payload END
       FROM unnest($3::int8[]) AS k(seq)
       JOIN syncular.sync_commits c ON c.partition = $1 AND c.commit_seq = k.seq
       JOIN syncular.sync_changes ch
         ON ch.partition = $1 AND ch.commit_seq = k.seq AND ch.tbl = $2
      WHERE ",
    scope_matches!("ch.scopes", "$4::jsonb"),
    " ORDER BY c.commit_seq, ch.idx"
);

/// One change of a commit window, as `read_commit_window` returns it.
pub struct WindowRow {
    commit_seq: i64,
    created_at_ms: i64,
    actor_id: String,
    idx: i32,
    row_id: String,
    op: String,
    row_version: Option<i64>,
    scopes: JsonB,
    payload: Option<Vec<u8>>,
}

/// The columns of `read_commit_window`'s result, in order.
type WindowColumns = (
    i64,
    i64,
    String,
    i32,
    String,
    String,
    Option<i64>,
    JsonB,
    Option<Vec<u8>>,
);

impl WindowRow {
    fn into_columns(self) -> WindowColumns {
        (
            self.commit_seq,
            self.created_at_ms,
            self.actor_id,
            self.idx,
            self.row_id,
            self.op,
            self.row_version,
            self.scopes,
            self.payload,
        )
    }
}

fn window(
    client: &SpiClient<'_>,
    partition: &str,
    tbl: &str,
    filter: &Filter,
    after_seq: i64,
    through_seq: i64,
    limit: i64,
) -> Result<Vec<WindowRow>> {
    let Some((var, values)) = filter.first() else {
        return Ok(Vec::new());
    };
    let batch = limit.max(64);
    let mut after = after_seq;
    let mut total = 0i64;
    let mut out = Vec::new();
    loop {
        let page: Vec<i64> = db::read(
            client,
            WINDOW_CANDIDATES_SQL,
            &[
                DatumWithOid::from(partition),
                DatumWithOid::from(tbl),
                DatumWithOid::from(var),
                DatumWithOid::from(values.to_vec()),
                DatumWithOid::from(after),
                DatumWithOid::from(through_seq),
                DatumWithOid::from(batch),
            ],
        )?
        .map(|row| row.get::<i64>(1).map(Option::unwrap_or_default))
        .collect::<std::result::Result<_, _>>()?;
        let Some(&last) = page.last() else { break };
        let rows = db::read(
            client,
            WINDOW_CHANGES_SQL,
            &[
                DatumWithOid::from(partition),
                DatumWithOid::from(tbl),
                DatumWithOid::from(page.clone()),
                DatumWithOid::from(JsonB(filter.json.clone())),
            ],
        )?;
        // The fold: whole commits, oldest first, until the change limit is reached.
        let mut stopped = false;
        let mut current: Option<i64> = None;
        for row in rows {
            let seq = row.get::<i64>(1)?.unwrap_or_default();
            if current != Some(seq) {
                if total >= limit {
                    stopped = true;
                    break;
                }
                current = Some(seq);
            }
            total += 1;
            out.push(WindowRow {
                commit_seq: seq,
                created_at_ms: row.get::<i64>(2)?.unwrap_or_default(),
                actor_id: row.get::<String>(3)?.unwrap_or_default(),
                idx: row.get::<i32>(4)?.unwrap_or_default(),
                row_id: row.get::<String>(5)?.unwrap_or_default(),
                op: row.get::<String>(6)?.unwrap_or_default(),
                row_version: row.get::<i64>(7)?,
                scopes: row.get::<JsonB>(8)?.unwrap_or(JsonB(serde_json::json!({}))),
                payload: row.get::<Vec<u8>>(9)?,
            });
        }
        if stopped || total >= limit || (page.len() as i64) < batch {
            break;
        }
        after = last;
    }
    Ok(out)
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
#[allow(clippy::type_complexity)]
fn read_commit_window(
    partition: Option<&str>,
    tbl: Option<&str>,
    scope_filter: Option<args::JsonArg>,
    after_seq: Option<i64>,
    through_seq: Option<i64>,
    limit_changes: Option<i32>,
) -> TableIterator<
    'static,
    (
        name!(commit_seq, i64),
        name!(created_at_ms, i64),
        name!(actor_id, String),
        name!(idx, i32),
        name!(row_id, String),
        name!(op, String),
        name!(row_version, Option<i64>),
        name!(scopes, JsonB),
        name!(payload, Option<Vec<u8>>),
    ),
> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let tbl = scope::log_table("tbl", tbl)?;
        let filter = scope::filter("scope_filter", scope_filter)?;
        let after = args::count("after_seq", after_seq)?;
        let through = args::count("through_seq", through_seq)?;
        let limit = args::row_limit("limit_changes", limit_changes)?;
        let limit = args::at_least("limit_changes", Some(limit.into()), 1)?;
        let rows = db::with_spi(|client| {
            window(client, &partition, &tbl, &filter, after, through, limit)
        })?;
        Ok(TableIterator::new(
            rows.into_iter().map(WindowRow::into_columns),
        ))
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn latest_scoped_change_seq(
    partition: Option<&str>,
    tbl: Option<&str>,
    scope_filter: Option<args::JsonArg>,
) -> i64 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let tbl = scope::log_table("tbl", tbl)?;
        let filter = scope::filter("scope_filter", scope_filter)?;
        let Some((var, values)) = filter.first() else {
            return Ok(0);
        };
        db::with_spi(|client| {
            let table = db::read(
                client,
                "SELECT coalesce(max(m.seq), 0)
                   FROM unnest($4::text[]) AS v(value),
                        LATERAL (SELECT max(c.commit_seq) AS seq FROM syncular.sync_change_scopes c
                                  WHERE c.partition = $1 AND c.tbl = $2 AND c.var = $3
                                    AND c.value = v.value COLLATE \"C\") AS m",
                &[
                    DatumWithOid::from(partition.as_str()),
                    DatumWithOid::from(tbl.as_str()),
                    DatumWithOid::from(var),
                    DatumWithOid::from(values.to_vec()),
                ],
            )?;
            Ok(db::first::<i64>(table)?.unwrap_or(0))
        })
    })
}

/// One current row of a bootstrap page, as `scan_rows` returns it.
pub struct ScanRow {
    row_id: String,
    server_version: i64,
    scopes: JsonB,
    payload: Vec<u8>,
    column_versions: Option<Vec<u8>>,
}

impl ScanRow {
    fn into_columns(self) -> (String, i64, JsonB, Vec<u8>, Option<Vec<u8>>) {
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

fn scan(
    client: &SpiClient<'_>,
    relation: &tables::AppRelation,
    partition: &str,
    tbl: &str,
    filter: &Filter,
    after_row_id: Option<String>,
    lim: i64,
) -> Result<Vec<ScanRow>> {
    let Some((var, values)) = filter.first() else {
        return Ok(Vec::new());
    };
    let batch = lim.max(64);
    let mut after = after_row_id;
    let mut out: Vec<ScanRow> = Vec::new();
    // The candidates come from the extension's index (read with the extension's rights), the
    // rows from the host's table by its primary key (read as its owner, docs/SECURITY.md).
    let rows_sql = format!(
        "SELECT a.\"_sync_row_id\", a.\"_sync_server_version\",
                CASE WHEN pg_catalog.jsonb_typeof(a.\"_sync_scopes\") = 'string'
                     THEN (a.\"_sync_scopes\" #>> '{{}}')::jsonb ELSE a.\"_sync_scopes\" END,
                a.\"_sync_payload\", a.\"_sync_column_versions\"
           FROM unnest($2::text[]) AS k(row_id)
           JOIN {rel} a ON a.\"_sync_partition\" = $1 AND a.\"_sync_row_id\" = k.row_id",
        rel = relation.qualified()
    );
    loop {
        let candidates: Vec<String> = access::as_extension_owner(client, || {
            db::read(
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
            )?
            .map(|row| Ok(row.get::<String>(1)?.unwrap_or_default()))
            .collect()
        })?;
        let Some(page_last) = candidates.last().cloned() else {
            break;
        };
        let mut found: HashMap<String, ScanRow> = relation.as_owner(|| {
            db::read_dynamic(
                client,
                &rows_sql,
                &[
                    DatumWithOid::from(partition),
                    DatumWithOid::from(candidates.clone()),
                ],
            )?
            .map(|row| {
                let row_id = row.get::<String>(1)?.unwrap_or_default();
                let scanned = ScanRow {
                    row_id: row_id.clone(),
                    server_version: row.get::<i64>(2)?.unwrap_or_default(),
                    scopes: row.get::<JsonB>(3)?.unwrap_or(JsonB(serde_json::json!({}))),
                    payload: row.get::<Vec<u8>>(4)?.unwrap_or_default(),
                    column_versions: row.get::<Vec<u8>>(5)?,
                };
                Ok((row_id, scanned))
            })
            .collect()
        })?;
        // Candidate order; a row deleted since its entry was read is simply absent.
        for row_id in &candidates {
            let Some(row) = found.remove(row_id) else {
                continue;
            };
            if !filter.matches(&row.scopes.0) {
                continue;
            }
            out.push(row);
            if out.len() as i64 >= lim {
                return Ok(out);
            }
        }
        if (candidates.len() as i64) < batch {
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
) -> TableIterator<
    'static,
    (
        name!(row_id, String),
        name!(server_version, i64),
        name!(scopes, JsonB),
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
            return Err(Error::bare(crate::error::Code::ScanRequiresScope));
        }
        let caller = access::current_role();
        let rows = db::with_spi(|client| {
            let relation = tables::open_for_read(client, &tbl, caller)?;
            scan(
                client,
                &relation,
                &partition,
                &tbl,
                &filter,
                args::optional_key("after_row_id", after_row_id)?,
                lim,
            )
        })?;
        Ok(TableIterator::new(
            rows.into_iter().map(ScanRow::into_columns),
        ))
    })
}
