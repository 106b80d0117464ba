//! Commit-seq allocation and the commit append (core-api §2).
//!
//! The partition row of `sync_partitions` is both the allocator (`max_commit_seq`) and the
//! partition write lock. Allocation is an increment inside the appending transaction, so a
//! rollback returns the number and committed numbers stay dense; the row lock is held until
//! commit, so commits become visible in `commit_seq` order.

use crate::args;
use crate::commit::{self, Change, Commit};
use crate::db;
use crate::error::{self, Error, Result};
use crate::jsonb::{self, JsonbArg, Node};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

/// The partition lock as held by this transaction.
pub struct Locked {
    /// `max_commit_seq` when the lock was granted (or as this transaction left it).
    pub max_commit_seq: i64,
    /// This call inserted the partition row (activation deletes it again, core-api §4.8).
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

/// Allocation, commit row, changes and scope index in one set-based statement, plus the
/// tombstones when the commit deletes rows (`$tombstones`). The fence trigger fires on the
/// `sync_commits` insert; its error aborts the whole statement, increment included.
///
/// Why this shape (measured, docs/BENCHMARKS.md): the arrays are unnested by set-returning
/// functions in the select list (a ProjectSet streams them), not in `FROM` (a function scan
/// first copies each array into a tuplestore). The scope index is a plain INSERT: its rows are
/// distinct (deduplicated in Rust) and carry a `commit_seq` allocated by this very statement, so
/// no row can conflict with them. A commit without deletes leaves the tombstone upsert out.
macro_rules! append_sql {
    ($tombstones:literal) => {
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
), change_rows AS (
  INSERT INTO syncular.sync_changes
    (partition, commit_seq, idx, tbl, row_id, op, row_version, scopes, payload)
  SELECT $1, commit_row.commit_seq, unnest($7::int4[]), unnest($8::text[]), unnest($9::text[]),
         unnest($10::int2[]), unnest($11::int8[]), unnest($12::jsonb[]), unnest($13::bytea[])
  FROM commit_row
), scope_rows AS (
  INSERT INTO syncular.sync_change_scopes (partition, tbl, var, value, commit_seq)
  SELECT $1, unnest($14::text[]), unnest($15::text[]), unnest($16::text[]), commit_row.commit_seq
  FROM commit_row
)",
            $tombstones,
            "
SELECT commit_seq FROM commit_row"
        )
    };
}

const APPEND_SQL: &str = append_sql!("");

const APPEND_WITH_TOMBSTONES_SQL: &str = append_sql!(
    ", tombstone_rows AS (
  INSERT INTO syncular.sync_tombstones (partition, tbl, row_id, commit_seq)
  SELECT $1, unnest($17::text[]), unnest($18::text[]), commit_row.commit_seq FROM commit_row
  ON CONFLICT (partition, tbl, row_id) DO UPDATE SET commit_seq = EXCLUDED.commit_seq
)"
);

/// Appends a validated commit; returns its `commit_seq`.
pub fn append<'a>(client: &SpiClient<'_>, partition: &str, commit: &Commit<'a>) -> Result<i64> {
    let changes = &commit.changes;
    let column = |f: fn(&Change<'a>) -> &'a str| changes.iter().map(f).collect::<Vec<_>>();
    let scopes = commit.scope_index();
    let mut args = vec![
        DatumWithOid::from(partition),
        DatumWithOid::from(commit.client_id),
        DatumWithOid::from(commit.client_commit_id),
        DatumWithOid::from(commit.actor_id),
        DatumWithOid::from(commit.created_at_ms),
        DatumWithOid::from(commit.writer_version),
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
    ];
    let tombstones = commit.tombstones();
    let sql = if tombstones.is_empty() {
        APPEND_SQL
    } else {
        args.push(DatumWithOid::from(
            tombstones.iter().map(|t| t.0).collect::<Vec<_>>(),
        ));
        args.push(DatumWithOid::from(
            tombstones.iter().map(|t| t.1).collect::<Vec<_>>(),
        ));
        APPEND_WITH_TOMBSTONES_SQL
    };
    db::first::<i64>(db::write(client, sql, &args)?)?
        .ok_or_else(|| Error::Internal("append returned no commit_seq".into()))
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
fn lock_partition(partition: Option<String>) -> i64 {
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
fn max_commit_seq(partition: Option<String>) -> i64 {
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
