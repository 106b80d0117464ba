//! Commit-seq allocation and the commit append (docs/DESIGN.md §Commit log).
//!
//! The partition row of `sync_partitions` is both the allocator (`max_commit_seq`) and the
//! partition write lock. Allocation is an increment inside the appending transaction, so a
//! rollback returns the number and committed numbers stay dense; the row lock is held until
//! commit, so commits become visible in `commit_seq` order.

use crate::args;
use crate::commit::{self, Change, Commit};
use crate::db;
use crate::error::{self, Error, Result};
use crate::heap::{DirectInsert, SyncTable};
use crate::jsonb::{self, JsonbArg, Node};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use std::ffi::CStr;

/// The partition lock as held by this transaction.
pub struct Locked {
    /// `max_commit_seq` when the lock was granted (or as this transaction left it).
    pub max_commit_seq: i64,
    /// This call inserted the partition row (activation deletes it again: docs/DESIGN.md,
    /// gap B7 — activation left a partition row behind).
    pub created: bool,
}

/// Takes the partition write lock (L1), creating the row with `max_commit_seq = 0` if needed.
pub fn lock(client: &SpiClient<'_>, partition: &str) -> Result<Locked> {
    let key = || [DatumWithOid::from(partition)];
    // Common case: the row exists. FOR UPDATE waits for the holder and returns the newest version.
    let existing = db::write(
        client,
        "SELECT max_commit_seq FROM syncular.sync_partitions WHERE partition = $1 FOR UPDATE",
        &key(),
    )?;
    if let Some(max) = db::first::<i64>(existing)? {
        return Ok(Locked {
            max_commit_seq: max,
            created: false,
        });
    }
    // New partition. Our uncommitted insert is the lock: concurrent creators wait on it.
    let inserted = db::write(
        client,
        "INSERT INTO syncular.sync_partitions (partition, max_commit_seq, horizon_seq)
         VALUES ($1, 0, 0) ON CONFLICT (partition) DO NOTHING RETURNING max_commit_seq",
        &key(),
    )?;
    if let Some(max) = db::first::<i64>(inserted)? {
        return Ok(Locked {
            max_commit_seq: max,
            created: true,
        });
    }
    // Lost the creation race: the winner has committed by now. A no-op update locks its row
    // (and raises 40001 under REPEATABLE READ when the row is newer than our snapshot).
    let raced = db::write(
        client,
        "INSERT INTO syncular.sync_partitions AS p (partition, max_commit_seq, horizon_seq)
         VALUES ($1, 0, 0)
         ON CONFLICT (partition) DO UPDATE SET max_commit_seq = p.max_commit_seq
         RETURNING p.max_commit_seq",
        &key(),
    )?;
    let max = db::first::<i64>(raced)?
        .ok_or_else(|| Error::Internal("partition upsert returned nothing".into()))?;
    Ok(Locked {
        max_commit_seq: max,
        created: false,
    })
}

/// The append as SQL, assembled from fragments: allocation and commit row (`$1`…`$6`), the
/// change rows and scope index (`$9`…`$18`, when they are not inserted directly), the tombstones
/// (`$7`, `$8`, when the commit deletes rows). The fence trigger fires on the `sync_commits`
/// insert; its error aborts the whole statement, increment included.
///
/// Why this shape (measured, docs/BENCHMARKS.md): arrays are unnested by set-returning functions
/// in the select list (a ProjectSet streams them; `FROM unnest(…)` would first copy each array
/// into a tuplestore). The scope index is a plain INSERT: its rows are distinct (deduplicated in
/// Rust) and carry a `commit_seq` this statement allocated, so none can conflict.
macro_rules! append_sql {
    ($($fragment:expr),*) => {
        concat!(
            "WITH alloc AS (
  INSERT INTO syncular.sync_partitions AS p (partition, max_commit_seq, horizon_seq)
  VALUES ($1, 1, 0)
  ON CONFLICT (partition) DO UPDATE SET max_commit_seq = p.max_commit_seq + 1
  RETURNING p.max_commit_seq AS seq
), commit_row AS (
  INSERT INTO syncular.sync_commits
    (partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms, writer_version)
  SELECT $1, alloc.seq, $2, $3, $4, $5, $6 FROM alloc
  RETURNING commit_seq
)",
            $($fragment,)*
            "
SELECT commit_seq FROM commit_row"
        )
    };
}

macro_rules! rows_fragment {
    () => {
        ", change_rows AS (
  INSERT INTO syncular.sync_changes
    (partition, commit_seq, idx, tbl, row_id, op, row_version, scopes, payload)
  SELECT $1, commit_row.commit_seq, unnest($9::int4[]), unnest($10::text[]), unnest($11::text[]),
         unnest($12::int2[]), unnest($13::int8[]), unnest($14::jsonb[]), unnest($15::bytea[])
  FROM commit_row
), scope_rows AS (
  INSERT INTO syncular.sync_change_scopes (partition, tbl, var, value, commit_seq)
  SELECT $1, unnest($16::text[]), unnest($17::text[]), unnest($18::text[]), commit_row.commit_seq
  FROM commit_row
)"
    };
}

macro_rules! tombstones_fragment {
    () => {
        ", tombstone_rows AS (
  INSERT INTO syncular.sync_tombstones (partition, tbl, row_id, commit_seq)
  SELECT $1, unnest($7::text[]), unnest($8::text[]), commit_row.commit_seq FROM commit_row
  ON CONFLICT (partition, tbl, row_id) DO UPDATE SET commit_seq = EXCLUDED.commit_seq
)"
    };
}

/// `[without tombstones, with tombstones]`, for each way of writing the change rows.
const COMMIT_ONLY_SQL: [&str; 2] = [append_sql!(), append_sql!(tombstones_fragment!())];
const WHOLE_COMMIT_SQL: [&str; 2] = [
    append_sql!(rows_fragment!()),
    append_sql!(rows_fragment!(), tombstones_fragment!()),
];

const CHANGE_COLUMNS: &[(&CStr, pg_sys::Oid)] = &[
    (c"partition", pg_sys::TEXTOID),
    (c"commit_seq", pg_sys::INT8OID),
    (c"idx", pg_sys::INT4OID),
    (c"tbl", pg_sys::TEXTOID),
    (c"row_id", pg_sys::TEXTOID),
    (c"op", pg_sys::INT2OID),
    (c"row_version", pg_sys::INT8OID),
    (c"scopes", pg_sys::JSONBOID),
    (c"payload", pg_sys::BYTEAOID),
];

const SCOPE_COLUMNS: &[(&CStr, pg_sys::Oid)] = &[
    (c"partition", pg_sys::TEXTOID),
    (c"tbl", pg_sys::TEXTOID),
    (c"var", pg_sys::TEXTOID),
    (c"value", pg_sys::TEXTOID),
    (c"commit_seq", pg_sys::INT8OID),
];

/// Appends a validated commit; returns its `commit_seq`.
///
/// The commit row goes through SQL (the allocation is an upsert with its row lock, and the fence
/// trigger must fire), the change rows and scope index are inserted directly ([`heap`]) unless
/// those tables carry anything a statement would have to run, then everything is one statement.
pub fn append<'a>(client: &SpiClient<'_>, partition: &str, commit: &Commit<'a>) -> Result<i64> {
    let direct = (
        DirectInsert::open(SyncTable::Changes, CHANGE_COLUMNS)?,
        DirectInsert::open(SyncTable::ChangeScopes, SCOPE_COLUMNS)?,
    );
    let tombstones = commit.tombstones();
    let mut args = vec![
        DatumWithOid::from(partition),
        DatumWithOid::from(commit.client_id),
        DatumWithOid::from(commit.client_commit_id),
        DatumWithOid::from(commit.actor_id),
        DatumWithOid::from(commit.created_at_ms),
        DatumWithOid::from(commit.writer_version),
        DatumWithOid::from(tombstones.iter().map(|t| t.0).collect::<Vec<_>>()),
        DatumWithOid::from(tombstones.iter().map(|t| t.1).collect::<Vec<_>>()),
    ];
    let with_tombstones = !tombstones.is_empty() as usize;
    let (Some(mut changes), Some(mut scopes)) = direct else {
        args.extend(change_arrays(commit));
        let sql = WHOLE_COMMIT_SQL[with_tombstones];
        return commit_seq(db::write(client, sql, &args)?);
    };
    if with_tombstones == 0 {
        args.truncate(6);
    }
    let seq = commit_seq(db::write(client, COMMIT_ONLY_SQL[with_tombstones], &args)?)?;
    let partition = partition.into_datum();
    let seq_datum = seq.into_datum();
    for (idx, change) in commit.changes.iter().enumerate() {
        let values = [
            partition,
            seq_datum,
            (idx as i32).into_datum(),
            change.table.into_datum(),
            change.row_id.into_datum(),
            (change.op as i16).into_datum(),
            change.row_version.into_datum(),
            change.scopes_jsonb.into_datum(),
            change.payload.as_deref().into_datum(),
        ];
        insert(&mut changes, values)?;
    }
    for (table, var, value) in commit.scope_index() {
        let values = [
            partition,
            table.into_datum(),
            var.into_datum(),
            value.into_datum(),
            seq_datum,
        ];
        insert(&mut scopes, values)?;
    }
    Ok(seq)
}

/// One row of `N` columns, NULL where `None`.
fn insert<const N: usize>(table: &mut DirectInsert, row: [Option<pg_sys::Datum>; N]) -> Result<()> {
    let nulls = row.map(|value| value.is_none());
    let values = row.map(|value| value.unwrap_or(pg_sys::Datum::from(0usize)));
    table.insert(&values, &nulls)
}

/// `$9`…`$18` of the whole-commit statement: the change rows and the scope index as arrays.
fn change_arrays<'a>(commit: &Commit<'a>) -> Vec<DatumWithOid<'a>> {
    let changes = &commit.changes;
    let column = |f: fn(&Change<'a>) -> &'a str| changes.iter().map(f).collect::<Vec<_>>();
    let scopes = commit.scope_index();
    vec![
        DatumWithOid::from((0..changes.len() as i32).collect::<Vec<_>>()),
        DatumWithOid::from(column(|c| c.table)),
        DatumWithOid::from(column(|c| c.row_id)),
        DatumWithOid::from(changes.iter().map(|c| c.op as i16).collect::<Vec<_>>()),
        DatumWithOid::from(changes.iter().map(|c| c.row_version).collect::<Vec<_>>()),
        DatumWithOid::from(changes.iter().map(|c| c.scopes_jsonb).collect::<Vec<_>>()),
        DatumWithOid::from(
            changes
                .iter()
                .map(|c| c.payload.as_deref())
                .collect::<Vec<_>>(),
        ),
        DatumWithOid::from(scopes.iter().map(|s| s.0).collect::<Vec<_>>()),
        DatumWithOid::from(scopes.iter().map(|s| s.1).collect::<Vec<_>>()),
        DatumWithOid::from(scopes.iter().map(|s| s.2).collect::<Vec<_>>()),
    ]
}

fn commit_seq(table: pgrx::spi::SpiTupleTable<'_>) -> Result<i64> {
    db::first::<i64>(table)?.ok_or_else(|| Error::Internal("append returned no commit_seq".into()))
}

/// Reads the commit document of `append_commit` in its binary form and validates all of it.
/// A document bound as a jsonb *string* holding JSON text is read as that text (drivers that
/// bind text as jsonb), like every other JSON argument ([`args::unwrap_json_text`]).
pub fn with_commit<R>(
    document: Option<JsonbArg>,
    body: impl FnOnce(&Commit<'_>) -> Result<R>,
) -> Result<R> {
    let document = args::required("commit", document)?;
    let root = read_root(&document)?;
    let reparsed;
    let root = match root {
        Node::String(text) => match std::str::from_utf8(text).ok().and_then(args::json_text) {
            Some(text) => {
                reparsed = JsonbArg::parse(text)
                    .ok_or_else(|| Error::invalid_argument("commit", "type"))?;
                read_root(&reparsed)?
            }
            None => root,
        },
        _ => root,
    };
    body(&commit::decode(root)?)
}

fn read_root(document: &JsonbArg) -> Result<Node<'_>> {
    if document.over_limits() {
        return Err(Error::invalid_argument("commit", "too_large"));
    }
    let unreadable = |_| Error::invalid_argument("commit", "type");
    let container = document.container().map_err(unreadable)?;
    if container
        .nests_deeper_than(jsonb::MAX_DEPTH)
        .map_err(unreadable)?
    {
        return Err(Error::invalid_argument("commit", "too_deep"));
    }
    container.root().map_err(unreadable)
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn lock_partition(partition: Option<&str>) -> i64 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        db::with_spi(|client| Ok(lock(client, &partition)?.max_commit_seq))
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn append_commit(partition: Option<&str>, commit: Option<JsonbArg>) -> i64 {
    error::run(|| {
        let partition = args::text_ref("partition", partition)?;
        // Validate everything before anything is locked or written.
        with_commit(commit, |commit| {
            db::with_spi(|client| append(client, partition, commit))
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn max_commit_seq(partition: Option<&str>) -> i64 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        db::with_spi(|client| {
            let table = db::read(
                client,
                "SELECT max_commit_seq FROM syncular.sync_partitions WHERE partition = $1",
                &[DatumWithOid::from(partition.as_str())],
            )?;
            Ok(db::first::<i64>(table)?.unwrap_or(0))
        })
    })
}
