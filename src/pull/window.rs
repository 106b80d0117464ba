//! The commit window (docs/DESIGN.md §Pull path, "Window"): the commits after a cursor that
//! carry changes of one table in scope, read through the inverted scope index of the log
//! (`sync_change_scopes`, one bounded primary-key range per value of the first variable; the
//! changes then fetched by key and matched against the whole filter in SQL, so non-matching
//! payloads never leave the executor), cut by the delivery rule ([`deliver`]); and the newest
//! scoped seq (`latest_scoped_change_seq`).

use super::budget::{Budget, ROW_OVERHEAD};
use crate::alloc;
use crate::args;
use crate::db;
use crate::error::{self, Result};
use crate::jsonb::OwnedJsonb;
use crate::limits;
use crate::scope::{self, Filter};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

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
            actor_id: db::text_column(&row, 3)?.unwrap_or_default(),
            idx,
            row_id: db::text_column(&row, 5)?.unwrap_or_default(),
            op: row.get::<i16>(6)?.unwrap_or_default(),
            row_version: row.get::<i64>(7)?,
            scopes,
            payload: db::bytes_column(&row, 9)?,
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

/// The delivery rule of upstream's pull driver (docs/DESIGN.md §Pull path, "Where the rules live"): commits oldest first; the first
/// always goes; another only if it keeps the changes within `limit`; stop once `limit` is
/// reached. Returns the delivered changes and the next cursor. A window the call's budget cut
/// short (`truncated`) is never exhausted: the cursor stops at the last delivered commit, and
/// the next pull reads on from there.
pub fn deliver(
    rows: Vec<WindowRow>,
    truncated: bool,
    limit: i64,
    cursor: i64,
    max_seq: i64,
) -> (Vec<WindowRow>, i64) {
    let returned = rows.len() as i64;
    let mut commits: Vec<Vec<WindowRow>> = Vec::new();
    for row in rows {
        crate::interrupts::check();
        match commits.last_mut() {
            Some(commit) if commit[0].commit_seq == row.commit_seq => commit.push(row),
            _ => commits.push(vec![row]),
        }
    }
    let total_commits = commits.len();
    let (mut delivered, mut delivered_commits, mut last) = (0i64, 0usize, cursor);
    let mut out = Vec::new();
    for commit in commits {
        crate::interrupts::check();
        let size = commit.len() as i64;
        if delivered > 0 && delivered + size > limit {
            break;
        }
        delivered += size;
        delivered_commits += 1;
        last = commit[0].commit_seq;
        out.extend(commit);
        if delivered >= limit {
            break;
        }
    }
    let exhausted = !truncated && returned <= limit && delivered_commits == total_commits;
    let next = if exhausted {
        cursor.max(max_seq)
    } else {
        cursor.max(last)
    };
    (out, next)
}
