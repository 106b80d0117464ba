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
use crate::materialized;
use crate::scope::{self, Filter};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use pgrx::PgMemoryContexts;

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
    /// Where a row's columns are detoasted while it is read, reset after each row: a window
    /// may pass over many changes it does not keep (other scopes), each with scopes as large
    /// as their writer made them (red team 35, F2: 1 GB held for a call that returned
    /// nothing). What a kept row holds is Rust's own memory.
    scratch: PgMemoryContexts,
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

    /// Takes one row of a page — candidate `seq`, and the change `read` reads when the fold
    /// wants it (`None`: the candidate has no commit row, no change of the table, or this change
    /// does not match the filter); false once the window is complete (the row was not needed).
    fn take(
        &mut self,
        seq: i64,
        read: impl FnOnce(&Filter) -> Result<Option<WindowRow>>,
    ) -> Result<bool> {
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
        let filter = self.filter;
        // SAFETY: `scratch` is this fold's own context; nothing allocated in it outlives the
        // read (a `WindowRow` holds only Rust-owned values), so resetting it after is sound.
        let row = unsafe {
            let row = self.scratch.switch_to(|_| read(filter));
            self.scratch.reset();
            row?
        };
        if let Some(row) = row {
            alloc::try_reserve(&mut self.pending, 1)?;
            self.pending.push(row);
        }
        Ok(true)
    }

    /// Whether this page's rows were fetched up to the limit, so only the rest of the last
    /// commit is still needed.
    fn want(&self) -> i64 {
        let held = self.total + self.pending.len() as i64;
        if held < self.limit {
            self.limit - held
        } else {
            TAIL_FETCH
        }
    }
}

/// [`WINDOW_PAGE_SQL`]'s row as the fold reads it.
fn sql_change(row: &pgrx::spi::SpiHeapTupleData<'_>, filter: &Filter) -> Result<Option<WindowRow>> {
    // A candidate whose commit row is gone, or without changes of the table: nothing kept.
    let (Some(created_at_ms), Some(idx)) = (row.get::<i64>(2)?, row.get::<i32>(4)?) else {
        return Ok(None);
    };
    let scopes = OwnedJsonb::column(row, 8)?
        .ok_or_else(|| error::Error::Internal("a change without scopes".into()))?;
    if !filter.matches_binary(&scopes) {
        return Ok(None);
    }
    Ok(Some(WindowRow {
        commit_seq: row.get::<i64>(1)?.unwrap_or_default(),
        created_at_ms,
        actor_id: db::text_column(row, 3)?.unwrap_or_default(),
        idx,
        row_id: db::text_column(row, 5)?.unwrap_or_default(),
        op: row.get::<i16>(6)?.unwrap_or_default(),
        row_version: row.get::<i64>(7)?,
        scopes,
        payload: db::bytes_column(row, 9)?,
    }))
}

/// What one page reads: the page of [`WINDOW_PAGE_SQL`], as its arguments name it (the whole
/// window, for [`native_window`], from `after`).
#[derive(Clone, Copy)]
struct Page<'p> {
    partition: &'p str,
    tbl: &'p str,
    var: &'p str,
    values: &'p [String],
    after: i64,
    batch: i64,
    through: i64,
}

/// One page through [`WINDOW_PAGE_SQL`] and a cursor.
fn sql_page(client: &SpiClient<'_>, page: &Page<'_>, fold: &mut Fold<'_>) -> Result<()> {
    let mut cursor = db::read_cursor(
        client,
        WINDOW_PAGE_SQL,
        &[
            DatumWithOid::from(page.partition),
            DatumWithOid::from(page.tbl),
            DatumWithOid::from(page.var),
            DatumWithOid::from(page.values.to_vec()),
            DatumWithOid::from(page.after),
            DatumWithOid::from(page.batch),
            DatumWithOid::from(page.through),
        ],
    )?;
    loop {
        // Below the limit every row fetched is needed; past it, only the rest of the last
        // commit is, so the cursor advances in small steps.
        let rows = cursor.fetch(fold.want())?;
        if rows.is_empty() {
            return Ok(());
        }
        alloc::check()?;
        for row in rows {
            crate::interrupts::check();
            let seq = row.get::<i64>(1)?.unwrap_or_default();
            if !fold.take(seq, |filter| sql_change(&row, filter))? {
                return Ok(());
            }
        }
    }
}

/// The whole window below SQL (docs/DESIGN.md §Pull path, "Window"): the candidates that the
/// pages of [`WINDOW_PAGE_SQL`] would return, in the same order, as a merge of one ordered
/// range scan of the scope index's primary key per value (at most [`MERGED_VALUES`]), read only
/// as far as the fold asks; each candidate's commit row by primary key and its changes of the
/// table through `sync_changes_by_source` — with the snapshot the statement would have
/// (`heap::with_snapshot`). So no statement start-up, no plan, no
/// candidate page read ahead of the fold (a page is `limit` candidates per value, where a
/// catch-up pull of ten-change commits needs a tenth of that), no copy of each row into SPI's
/// table first. `false`, having read nothing, when Citus keeps the partition's log on another
/// node: the pages are read through SQL then.
fn native_window(page: &Page<'_>, fold: &mut Fold<'_>) -> Result<bool> {
    use crate::heap::{self, SyncTable};
    if page.values.len() > MERGED_VALUES {
        return Ok(false);
    }
    let partition = Some(page.partition);
    heap::with_snapshot(false, |snapshot| {
        // SAFETY: inside the call's transaction, with a registered snapshot; the three tables
        // stay open for the merge, which ends its scans itself.
        let read = unsafe {
            heap::with_reader(SyncTable::ChangeScopes, partition, |scopes| {
                heap::with_reader(SyncTable::Commits, partition, |commits| {
                    let by_source = (
                        c"sync_changes_by_source",
                        &[c"partition", c"tbl", c"commit_seq"][..],
                    );
                    heap::with_reader_on(
                        SyncTable::Changes,
                        partition,
                        Some(by_source),
                        |changes, by_source| {
                            merge(page, (scopes, commits, changes, by_source), snapshot, fold)
                        },
                    )
                })
            })?
        };
        Ok(matches!(read, Some(Some(Some(())))))
    })
}

/// The most filter values [`native_window`] merges. The merge keeps one scan open per value,
/// and each open scan costs PostgreSQL's resource owner a lookup over the others (a filter of
/// 100,000 values took 42 s and 1 GB: red team 35, F1); the statement's page reads one value's
/// range at a time, so a wider filter is read through it.
const MERGED_VALUES: usize = 8;

/// [`native_window`]'s merge: one scan of the scope index per value, the smallest current
/// `commit_seq` of them the next candidate (each value's range ascends, so the merge ascends
/// and a commit in scope for several values comes once), until the fold has what it needs or
/// every range ends.
fn merge(
    page: &Page<'_>,
    (scopes, commits, changes, by_source): (
        &crate::heap::Reader,
        &crate::heap::Reader,
        &crate::heap::Reader,
        bool,
    ),
    snapshot: pg_sys::Snapshot,
    fold: &mut Fold<'_>,
) -> Result<()> {
    use crate::heap;
    let commit_seq = scopes.column(c"commit_seq")?;
    let seq_of = |row: &heap::Row| row.bigint(commit_seq);
    let log = Log {
        commits,
        changes,
        columns: LogColumns {
            created_at_ms: commits.column(c"created_at_ms")?,
            actor_id: commits.column(c"actor_id")?,
            tbl: changes.column(c"tbl")?,
            idx: changes.column(c"idx")?,
            row_id: changes.column(c"row_id")?,
            op: changes.column(c"op")?,
            row_version: changes.column(c"row_version")?,
            scopes: changes.column(c"scopes")?,
            payload: changes.column(c"payload")?,
        },
        by_source: by_source.then(|| heap::text_key(page.tbl)),
        snapshot,
        partition: heap::text_key(page.partition),
        tbl: page.tbl,
    };
    let mut ranges: Vec<(Option<i64>, heap::Scan<'_>)> = Vec::new();
    let merged = (|| -> Result<()> {
        alloc::try_reserve(&mut ranges, page.values.len())?;
        for value in page.values {
            let keys = [
                heap::text_key(page.partition),
                heap::text_key(page.tbl),
                heap::text_key(page.var),
                heap::text_key(value),
            ];
            // SAFETY: text keys of the scope index's text columns (all `COLLATE "C"`), in the
            // call's memory context, alive to the end of the call; the snapshot is registered
            // by `native_window` for as long as the scans run.
            let mut scan =
                unsafe { scopes.scan(&keys, Some((page.after, page.through)), snapshot)? };
            let first = scan.next(seq_of)?.flatten();
            ranges.push((first, scan));
        }
        while let Some(seq) = ranges.iter().filter_map(|(current, _)| *current).min() {
            for (current, scan) in ranges.iter_mut() {
                if *current == Some(seq) {
                    *current = scan.next(seq_of)?.flatten();
                }
            }
            if !candidate(&log, seq, fold)? {
                break;
            }
        }
        Ok(())
    })();
    for (_, scan) in ranges {
        scan.end();
    }
    merged
}

/// What [`candidate`] reads with: the commit and change tables held open, the snapshot, the
/// partition's key datum and the table asked.
struct Log<'r> {
    commits: &'r crate::heap::Reader,
    changes: &'r crate::heap::Reader,
    columns: LogColumns<'r>,
    /// The table's key when `changes` is read through `sync_changes_by_source` (`partition,
    /// tbl, commit_seq`: the changes of the table only, a commit's in heap order — the fold
    /// orders them by `idx`); `None` through the primary key (every change of the commit, the
    /// other tables' skipped here: red team 35, F3 — 2,000 changes of another table per commit
    /// read to find one). Not `sync_changes_by_table`, whose key also holds `idx`: its entries
    /// are unique, so PostgreSQL cannot deduplicate them, and it is four times the size of
    /// `sync_changes_by_source` — a catch-up pull read it from disk where the statement's plan,
    /// which picks `sync_changes_by_source`, found its pages in shared buffers (issue 28,
    /// docs/BENCHMARKS.md step 15).
    by_source: Option<(pg_sys::Datum, (u32, pg_sys::Oid))>,
    snapshot: pg_sys::Snapshot,
    partition: (pg_sys::Datum, (u32, pg_sys::Oid)),
    tbl: &'r str,
}

/// The columns [`candidate`] reads of a commit row and of a change row, found once per call.
struct LogColumns<'r> {
    created_at_ms: crate::heap::Column<'r>,
    actor_id: crate::heap::Column<'r>,
    tbl: crate::heap::Column<'r>,
    idx: crate::heap::Column<'r>,
    row_id: crate::heap::Column<'r>,
    op: crate::heap::Column<'r>,
    row_version: crate::heap::Column<'r>,
    scopes: crate::heap::Column<'r>,
    payload: crate::heap::Column<'r>,
}

/// One candidate of [`merge`] handed to the fold: its changes of the table (or, without a
/// commit row or such a change, the candidate alone, as the statement's outer joins return it).
/// False once the fold needs no more.
fn candidate(log: &Log<'_>, seq: i64, fold: &mut Fold<'_>) -> Result<bool> {
    use crate::heap;
    let key = [log.partition, heap::bigint_key(seq)];
    let (commits, changes, snapshot, tbl) = (log.commits, log.changes, log.snapshot, log.tbl);
    let columns = &log.columns;
    // SAFETY: the primary keys' leading columns — text under "C", then the bigint
    // commit_seq — keyed with datums of those types (the partition's made once for the call,
    // in its memory context: a window may pass over many candidates), alive to the end of the
    // call; the snapshot is registered by `native_window`.
    let commit = unsafe {
        commits.first(&key, snapshot, |row| {
            Ok((
                row.bigint(columns.created_at_ms)?.unwrap_or_default(),
                row.text(columns.actor_id)?.unwrap_or_default(),
            ))
        })?
    };
    let Some((created_at_ms, actor_id)) = commit else {
        return fold.take(seq, |_| Ok(None));
    };
    let by_source;
    let keys: &[_] = match log.by_source {
        Some(tbl_key) => {
            by_source = [key[0], tbl_key, key[1]];
            &by_source
        }
        None => &key,
    };
    // SAFETY: as above (the table's key a text datum under "C" made once for the call).
    let mut scan = unsafe { changes.scan(keys, None, snapshot)? };
    let (mut any, mut more) = (false, true);
    let read = (|| -> Result<()> {
        while more {
            let next = scan.next(|row| {
                if !row.text_is(columns.tbl, tbl)? {
                    return Ok(());
                }
                any = true;
                more = fold.take(seq, |filter| {
                    native_change(row, columns, filter, seq, created_at_ms, &actor_id)
                })?;
                Ok(())
            })?;
            if next.is_none() {
                break;
            }
        }
        Ok(())
    })();
    scan.end();
    read?;
    if !any {
        more = fold.take(seq, |_| Ok(None))?;
    }
    Ok(more)
}

/// A `sync_changes` row read below SQL, as the fold reads it.
fn native_change(
    row: &crate::heap::Row,
    columns: &LogColumns<'_>,
    filter: &Filter,
    commit_seq: i64,
    created_at_ms: i64,
    actor_id: &str,
) -> Result<Option<WindowRow>> {
    let scopes = row
        .jsonb_bytes(columns.scopes)?
        .ok_or_else(|| error::Error::Internal("a change without scopes".into()))?;
    if !filter.matches_binary(&scopes) {
        return Ok(None);
    }
    Ok(Some(WindowRow {
        commit_seq,
        created_at_ms,
        actor_id: actor_id.to_owned(),
        idx: row.int4(columns.idx)?.unwrap_or_default(),
        row_id: row.text(columns.row_id)?.unwrap_or_default(),
        op: row.int2(columns.op)?.unwrap_or_default(),
        row_version: row.bigint(columns.row_version)?,
        scopes,
        payload: row.bytes(columns.payload)?,
    }))
}

/// What [`window`] read: the delivered changes, and whether the [`Budget`] cut the window
/// short (it then ends at a commit boundary, not necessarily where the window ends).
pub struct Window {
    pub rows: Vec<WindowRow>,
    pub truncated: bool,
}

/// How [`window`] reads: below SQL where the partition's log is on this node (the calls of the
/// API), or through [`WINDOW_PAGE_SQL`] (the other side of the differential tests; the pull's
/// head has the same two, `request::head_by`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Path {
    Native,
    #[cfg_attr(not(any(test, feature = "pg_test")), allow(dead_code))]
    Sql,
}

/// The commit window (docs/API.md, `read_commit_window`), its pages read the way `path` says
/// (`Path::Native` but in the differential test). An empty range reads nothing.
#[allow(clippy::too_many_arguments)]
pub fn window(
    path: Path,
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
        scratch: PgMemoryContexts::new("syncular window row"),
    };
    let whole = Page {
        partition,
        tbl,
        var,
        values,
        after: after_seq,
        batch,
        through: through_seq,
    };
    if path == Path::Native && native_window(&whole, &mut fold)? {
        fold.close();
        return Ok(Window {
            rows: fold.out,
            truncated: fold.truncated,
        });
    }
    let mut after = after_seq;
    loop {
        fold.candidates = 0;
        let page = Page { after, ..whole };
        sql_page(client, &page, &mut fold)?;
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
) -> materialized::TableIterator<
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
                Path::Native,
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
        Ok(materialized::TableIterator::new(
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

/// In-backend tests: each runs inside one transaction that is rolled back.
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::{window, Path, Window};
    use crate::db;
    use crate::pull::budget::Budget;
    use crate::scope;
    use pgrx::prelude::*;
    use proptest::prelude::*;

    /// A log of two partitions and 180 commits each, with what the window must cope with:
    /// commits of several tables and of none of the table asked, deletes (no version, no
    /// payload), payloads kept out of line (over 2 kB, incompressible), scopes with a second
    /// variable, a number or a missing variable, commit rows missing under scope entries, and
    /// scope entries of commits that do not exist.
    fn make_log() {
        Spi::run(
            "SET LOCAL session_replication_role = replica;
             INSERT INTO syncular.sync_commits
               (partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms, writer_version)
             SELECT p, i, 'c', 'k' || i, 'actor-' || (i % 3), 1750000000000 + i, 1
               FROM unnest(ARRAY['a', 'b']) p, generate_series(1, 180) i
              WHERE abs(hashint4(i + length(p))) % 17 <> 0;
             INSERT INTO syncular.sync_changes
               (partition, commit_seq, idx, tbl, row_id, op, row_version, scopes, payload)
             SELECT p, i, j,
                    CASE WHEN abs(hashint4(i * 7 + j)) % 3 = 0 THEN 'notes' ELSE 'tasks' END,
                    'r' || i || '-' || j, d.op,
                    CASE WHEN d.op = 2 THEN NULL ELSE i * 10 + j END,
                    CASE abs(hashint4(i * 13 + j)) % 7
                      WHEN 0 THEN jsonb_build_object('project_id', abs(hashint4(i)) % 4)
                      WHEN 1 THEN jsonb_build_object('org', 'o' || (j % 2))
                      ELSE jsonb_build_object('project_id', 'p' || (abs(hashint4(i * j + 1)) % 2),
                                              'org', 'o' || (abs(hashint4(i + j)) % 2)) END,
                    CASE WHEN d.op = 2 THEN NULL
                         WHEN abs(hashint4(i + j * 5)) % 23 = 0
                         THEN (SELECT decode(string_agg(md5(i || '-' || j || '-' || k), ''), 'hex')
                                 FROM generate_series(1, 150) k)
                         ELSE decode(md5(i || '/' || j), 'hex') END
               FROM unnest(ARRAY['a', 'b']) p, generate_series(1, 180) i,
                    generate_series(0, abs(hashint4(i * 3 + length(p))) % 7) j,
                    LATERAL (SELECT CASE WHEN abs(hashint4(i + j * 31)) % 5 = 0 THEN 2 ELSE 1 END::smallint AS op) d
              WHERE abs(hashint4(i * 11 + length(p))) % 9 <> 0;
             INSERT INTO syncular.sync_change_scopes (partition, tbl, var, value, commit_seq)
             SELECT DISTINCT c.partition, c.tbl, e.key, e.value, c.commit_seq
               FROM syncular.sync_changes c, jsonb_each_text(c.scopes) e;
             INSERT INTO syncular.sync_change_scopes (partition, tbl, var, value, commit_seq)
             SELECT p, 'tasks', 'project_id', 'p' || (i % 4), i
               FROM unnest(ARRAY['a', 'b']) p, generate_series(175, 200) i
             ON CONFLICT DO NOTHING;",
        )
        .expect("the log");
    }

    /// One window, read one way; the rows as comparable values.
    #[allow(clippy::type_complexity)]
    fn read(
        path: Path,
        partition: &str,
        tbl: &str,
        filter: &serde_json::Value,
        (after, through, limit): (i64, i64, i64),
    ) -> (
        Vec<(
            i64,
            i64,
            String,
            i32,
            String,
            i16,
            Option<i64>,
            Vec<u8>,
            Option<Vec<u8>>,
        )>,
        bool,
    ) {
        let filter = scope::filter_value("filter", Some(filter.clone())).expect("filter");
        let Window { rows, truncated } = db::with_spi(|client| {
            let mut budget = Budget::new();
            window(
                path,
                client,
                partition,
                tbl,
                &filter,
                after,
                through,
                limit,
                &mut budget,
            )
        })
        .expect("window");
        let rows = rows
            .into_iter()
            .map(|r| {
                (
                    r.commit_seq,
                    r.created_at_ms,
                    r.actor_id,
                    r.idx,
                    r.row_id,
                    r.op,
                    r.row_version,
                    r.scopes.as_bytes().to_vec(),
                    r.payload,
                )
            })
            .collect();
        (rows, truncated)
    }

    /// The window read below SQL and through its statement are the same — rows, order, every
    /// column's bytes — over 3,000 generated windows: one or two variables, values that exist
    /// or not, repeated values, ranges empty, reversed, past the head or before the first
    /// commit, limits from one change to several pages of candidates.
    #[pg_test]
    fn native_and_statement_windows_are_the_same() {
        // It drops an index of the log at the end.
        crate::testing::lock_for_ddl("syncular.sync_changes");
        make_log();
        let project = prop_oneof![
            6 => (0..2u8).prop_map(|v| format!("p{v}")),
            1 => Just("p2".to_string()),
            1 => Just("1".to_string()),
        ];
        let org = prop_oneof![
            6 => (0..2u8).prop_map(|v| format!("o{v}")),
            1 => Just("o2".to_string()),
        ];
        // Either variable may come first (the one whose scope index is read); a variable with
        // no value admits nothing.
        let filter = (
            proptest::option::weighted(0.8, proptest::collection::vec(project, 0..4)),
            proptest::option::weighted(0.5, proptest::collection::vec(org, 0..3)),
        )
            .prop_map(|(projects, orgs)| {
                let mut map = serde_json::Map::new();
                if let Some(projects) = projects {
                    map.insert("project_id".into(), projects.into());
                }
                if let Some(orgs) = orgs {
                    map.insert("org".into(), orgs.into());
                }
                serde_json::Value::Object(map)
            });
        let case = (
            prop_oneof![4 => Just("a"), 4 => Just("b"), 1 => Just("c")],
            prop_oneof![3 => Just("tasks"), 1 => Just("notes")],
            filter,
            -2..205i64,
            prop_oneof![1 => -3..1i64, 6 => 1..200i64],
            prop_oneof![1..12i64, 12..120i64],
        );
        let (seen, filled) = (std::cell::Cell::new(0usize), std::cell::Cell::new(0usize));
        let check = |(partition, tbl, filter, after, span, limit): (
            &str,
            &str,
            serde_json::Value,
            i64,
            i64,
            i64,
        )| {
            let bounds = (after, after + span, limit);
            let native = read(Path::Native, partition, tbl, &filter, bounds);
            let sql = read(Path::Sql, partition, tbl, &filter, bounds);
            seen.set(seen.get() + native.0.len());
            filled.set(filled.get() + usize::from(!native.0.is_empty()));
            prop_assert_eq!(native, sql, "{} {} {} {:?}", partition, tbl, filter, bounds);
            Ok(())
        };
        crate::testing::run_cases(3000, case.clone(), &check);
        // The cases reach the log: thousands of rows compared, not empty windows only.
        assert!(
            seen.get() > 15_000 && filled.get() > 800,
            "{} rows compared in {} windows",
            seen.get(),
            filled.get()
        );
        // Without `sync_changes_by_source` (a DBA dropped it) the changes are read through the
        // primary key, the other tables' skipped: the same windows.
        Spi::run("DROP INDEX syncular.sync_changes_by_source").expect("drop");
        crate::testing::run_cases(400, case, &check);
    }
}
