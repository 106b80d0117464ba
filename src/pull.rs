//! The pull path (docs/DESIGN.md §Pull path): the commit window through the inverted scope
//! index of the log, the bootstrap scan through the scope index of current rows, and the
//! newest scoped seq.
//!
//! Candidates come only from primary-key ranges of `sync_change_scopes` / `sync_row_scopes`,
//! one bounded index range per value of the first variable; rows are then fetched by key and
//! matched against the whole filter in SQL, so non-matching payloads never leave the executor.

use crate::access;
use crate::alloc;
use crate::args;
use crate::db;
use crate::error::{self, Error, Result};
use crate::jsonb::OwnedJsonb;
use crate::limits;
use crate::scope::{self, Filter};
use crate::tables;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

/// What one call collects before it returns its first row, in total over everything it reads
/// (docs/API.md "Limits", docs/DESIGN.md §Memory): the bytes of the rows' payloads, scopes,
/// column versions and ids. Another commit or row starts only while the total is below
/// [`limits::OUTPUT_BYTES`]; the first one always goes (a commit is never split), so a call
/// exceeds the budget by at most one commit or row and always makes progress.
pub struct Budget {
    used: usize,
}

impl Budget {
    pub fn new() -> Budget {
        Budget { used: 0 }
    }

    /// Whether another commit or row may start.
    pub fn open(&self) -> bool {
        self.used < limits::OUTPUT_BYTES
    }

    fn spend(&mut self, bytes: usize) {
        self.used = self.used.saturating_add(bytes);
    }
}

/// What a row costs in the budget besides its values: the columns' fixed part, roughly.
const ROW_OVERHEAD: usize = 64;

/// One page of the window in one statement, read through a cursor: the page's candidate commits
/// (the distinct `commit_seq` above `$5`, ascending, at most `$6`: one bounded range of the
/// `sync_change_scopes` key per value, merged), each followed by its changes of `tbl` fetched by
/// key. A candidate without a commit row or without changes of `tbl` still yields one row
/// (NULL change columns), so the fold sees every candidate. The outer order is the candidates'
/// (no sort above the joins): the executor reads a commit's changes only when the fold asks for
/// the next row, so the reads stop at the commits the window returns (docs/DESIGN.md §Pull path).
const WINDOW_PAGE_SQL: &str = "\
SELECT k.commit_seq, c.created_at_ms, c.actor_id, ch.idx, ch.row_id, ch.op, ch.row_version,
       ch.scopes, ch.payload
  FROM (SELECT DISTINCT s.commit_seq
          FROM unnest($4::text[]) AS v(value)
          CROSS JOIN LATERAL (
            SELECT x.commit_seq FROM syncular.sync_change_scopes x
             WHERE x.partition = $1 AND x.tbl = $2 AND x.var = $3
               AND x.value = v.value COLLATE \"C\"
               AND x.commit_seq > $5 AND x.commit_seq <= $7
             ORDER BY x.commit_seq LIMIT $6) AS s
         ORDER BY s.commit_seq LIMIT $6) AS k
  LEFT JOIN syncular.sync_commits c ON c.partition = $1 AND c.commit_seq = k.commit_seq
  LEFT JOIN LATERAL (
    SELECT d.idx, d.row_id, d.op, d.row_version, d.scopes, d.payload
      FROM syncular.sync_changes d
     WHERE d.partition = $1 AND d.commit_seq = c.commit_seq AND d.tbl = $2) AS ch ON true
 ORDER BY k.commit_seq";

/// Rows fetched at a time once the change limit is reached, to find where the last commit ends.
const TAIL_FETCH: i64 = 16;

/// One change of a commit window, as `read_commit_window` returns it.
pub struct WindowRow {
    pub commit_seq: i64,
    pub created_at_ms: i64,
    pub actor_id: String,
    pub idx: i32,
    pub row_id: String,
    /// 2 is a delete (`row_version` and `payload` are NULL then), anything else an upsert.
    pub op: i16,
    pub row_version: Option<i64>,
    pub scopes: OwnedJsonb,
    pub payload: Option<Vec<u8>>,
}

impl WindowRow {
    /// What the row counts against the [`Budget`].
    fn size(&self) -> usize {
        ROW_OVERHEAD
            + self.actor_id.len()
            + self.row_id.len()
            + self.scopes.len()
            + self.payload.as_ref().map_or(0, Vec::len)
    }

    pub fn is_delete(&self) -> bool {
        self.op == 2
    }

    pub fn op_name(&self) -> &'static str {
        if self.is_delete() {
            "delete"
        } else {
            "upsert"
        }
    }
}

/// The columns of `read_commit_window`'s result, in order.
type WindowColumns = (
    i64,
    i64,
    String,
    i32,
    String,
    &'static str,
    Option<i64>,
    OwnedJsonb,
    Option<Vec<u8>>,
);

impl WindowRow {
    fn into_columns(self) -> WindowColumns {
        let delete = self.is_delete();
        let op = self.op_name();
        (
            self.commit_seq,
            self.created_at_ms,
            self.actor_id,
            self.idx,
            self.row_id,
            op,
            self.row_version.filter(|_| !delete),
            self.scopes,
            self.payload.filter(|_| !delete),
        )
    }
}

/// The fold of docs/DESIGN.md §Pull path over one page's rows: whole commits, oldest first,
/// each with its changes matching the whole filter in `idx` order, until `limit` changes or the
/// call's [`Budget`] is spent.
struct Fold<'f> {
    filter: &'f Filter,
    limit: i64,
    budget: &'f mut Budget,
    /// Stopped because the budget was spent (not because the window ended or the limit).
    truncated: bool,
    total: i64,
    out: Vec<WindowRow>,
    /// The commit being read and its kept changes (delivered when it ends).
    current: Option<i64>,
    pending: Vec<WindowRow>,
    /// Candidates seen in this page, and the last one.
    candidates: i64,
    last: Option<i64>,
    stopped: bool,
}

impl Fold<'_> {
    /// Ends the current commit: delivers its kept changes, if any.
    fn close(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        self.pending.sort_by_key(|row| row.idx);
        self.total += self.pending.len() as i64;
        for row in &self.pending {
            self.budget.spend(row.size());
        }
        self.out.append(&mut self.pending);
    }

    /// Takes one row; false once the window is complete (the row was not needed).
    fn take(&mut self, row: pgrx::spi::SpiHeapTupleData<'_>) -> Result<bool> {
        let seq = row.get::<i64>(1)?.unwrap_or_default();
        if self.current != Some(seq) {
            self.close();
            if self.total >= self.limit {
                self.stopped = true;
                return Ok(false);
            }
            if !self.budget.open() {
                self.stopped = true;
                self.truncated = true;
                return Ok(false);
            }
            self.current = Some(seq);
            self.candidates += 1;
            self.last = Some(seq);
        }
        // A candidate whose commit row is gone, or without changes of the table: nothing kept.
        let (Some(created_at_ms), Some(idx)) = (row.get::<i64>(2)?, row.get::<i32>(4)?) else {
            return Ok(true);
        };
        let scopes = OwnedJsonb::column(&row, 8)?
            .ok_or_else(|| error::Error::Internal("a change without scopes".into()))?;
        if !self.filter.matches_binary(&scopes) {
            return Ok(true);
        }
        alloc::try_reserve(&mut self.pending, 1)?;
        self.pending.push(WindowRow {
            commit_seq: seq,
            created_at_ms,
            actor_id: alloc::text_column(&row, 3)?.unwrap_or_default(),
            idx,
            row_id: alloc::text_column(&row, 5)?.unwrap_or_default(),
            op: row.get::<i16>(6)?.unwrap_or_default(),
            row_version: row.get::<i64>(7)?,
            scopes,
            payload: alloc::bytes_column(&row, 9)?,
        });
        Ok(true)
    }
}

/// What [`window`] read: the delivered changes, and whether the [`Budget`] cut the window
/// short (it then ends at a commit boundary, not necessarily where the window ends).
pub struct Window {
    pub rows: Vec<WindowRow>,
    pub truncated: bool,
}

/// The commit window (docs/API.md, `read_commit_window`). An empty range reads nothing.
#[allow(clippy::too_many_arguments)]
pub fn window(
    client: &SpiClient<'_>,
    partition: &str,
    tbl: &str,
    filter: &Filter,
    after_seq: i64,
    through_seq: i64,
    limit: i64,
    budget: &mut Budget,
) -> Result<Window> {
    let empty = || {
        Ok(Window {
            rows: Vec::new(),
            truncated: false,
        })
    };
    let Some((var, values)) = filter.first() else {
        return empty();
    };
    if after_seq >= through_seq {
        return empty();
    }
    let batch = limit.max(64);
    let mut fold = Fold {
        filter,
        limit,
        budget,
        truncated: false,
        total: 0,
        out: Vec::new(),
        current: None,
        pending: Vec::new(),
        candidates: 0,
        last: None,
        stopped: false,
    };
    let mut after = after_seq;
    loop {
        let mut cursor = db::read_cursor(
            client,
            WINDOW_PAGE_SQL,
            &[
                DatumWithOid::from(partition),
                DatumWithOid::from(tbl),
                DatumWithOid::from(var),
                DatumWithOid::from(values.to_vec()),
                DatumWithOid::from(after),
                DatumWithOid::from(batch),
                DatumWithOid::from(through_seq),
            ],
        )?;
        fold.candidates = 0;
        'page: loop {
            // Below the limit every row fetched is needed; past it, only the rest of the last
            // commit is, so the cursor advances in small steps.
            let want = if fold.total + (fold.pending.len() as i64) < limit {
                limit - fold.total - fold.pending.len() as i64
            } else {
                TAIL_FETCH
            };
            let rows = cursor.fetch(want)?;
            if rows.is_empty() {
                break;
            }
            alloc::check()?;
            for row in rows {
                crate::interrupts::check();
                if !fold.take(row)? {
                    break 'page;
                }
            }
        }
        drop(cursor);
        fold.close();
        if fold.stopped || fold.total >= limit || fold.candidates < batch {
            break;
        }
        match fold.last {
            Some(last) => after = last,
            None => break,
        }
        fold.current = None;
    }
    Ok(Window {
        rows: fold.out,
        truncated: fold.truncated,
    })
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
        name!(op, &'static str),
        name!(row_version, Option<i64>),
        name!(scopes, OwnedJsonb),
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
        let window = db::with_spi(|client| {
            let mut budget = Budget::new();
            window(
                client,
                &partition,
                &tbl,
                &filter,
                after,
                through,
                limit,
                &mut budget,
            )
        })?;
        if window.truncated {
            return Err(limits::over_output("limit_changes"));
        }
        Ok(TableIterator::new(
            window.rows.into_iter().map(WindowRow::into_columns),
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
            .map(|row| {
                crate::interrupts::check();
                Ok(row.get::<String>(1)?.unwrap_or_default())
            })
            .collect()
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
                row_id: alloc::text_column(row, 1)?.unwrap_or_default(),
                server_version: row.get::<i64>(2)?.unwrap_or_default(),
                scopes,
                payload: alloc::bytes_column(row, 4)?.unwrap_or_default(),
                column_versions: alloc::bytes_column(row, 5)?,
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
) -> TableIterator<
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
            return Err(Error::bare(crate::error::Code::ScanRequiresScope));
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
        Ok(TableIterator::new(
            scan.rows.into_iter().map(ScanRow::into_columns),
        ))
    })
}
