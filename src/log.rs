//! Commit-seq allocation and the commit append (core-api §2).
//!
//! The partition row of `sync_partitions` is both the allocator (`max_commit_seq`) and the
//! partition write lock. Allocation is an increment inside the appending transaction, so a
//! rollback returns the number and committed numbers stay dense; the row lock is held until
//! commit, so commits become visible in `commit_seq` order.

use crate::args;
use crate::commit::{self, Commit};
use crate::db;
use crate::error::{self, Error, Result};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use pgrx::JsonB;

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

/// Allocation, commit row, changes, scope index and tombstones in one set-based statement.
/// The fence trigger fires on the `sync_commits` insert; its error aborts the whole statement,
/// increment included.
const APPEND_SQL: &str = "\
WITH alloc AS (
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
  SELECT $1, commit_row.commit_seq, (c.ord - 1)::integer, c.tbl, c.row_id, c.op, c.row_version,
         c.scopes, c.payload
  FROM commit_row,
       unnest($7::text[], $8::text[], $9::int2[], $10::int8[], $11::jsonb[], $12::bytea[])
         WITH ORDINALITY AS c(tbl, row_id, op, row_version, scopes, payload, ord)
), scope_rows AS (
  INSERT INTO syncular.sync_change_scopes (partition, tbl, var, value, commit_seq)
  SELECT $1, s.tbl, s.var, s.value, commit_row.commit_seq
  FROM commit_row, unnest($13::text[], $14::text[], $15::text[]) AS s(tbl, var, value)
  ON CONFLICT DO NOTHING
), tombstone_rows AS (
  INSERT INTO syncular.sync_tombstones (partition, tbl, row_id, commit_seq)
  SELECT $1, t.tbl, t.row_id, commit_row.commit_seq
  FROM commit_row, unnest($16::text[], $17::text[]) AS t(tbl, row_id)
  ON CONFLICT (partition, tbl, row_id) DO UPDATE SET commit_seq = EXCLUDED.commit_seq
)
SELECT commit_seq FROM commit_row";

/// Appends a validated commit; returns its `commit_seq`.
pub fn append(client: &SpiClient<'_>, partition: &str, commit: &Commit) -> Result<i64> {
    let changes = &commit.changes;
    let scopes = commit.scope_index();
    let tombstones = commit.tombstones();
    let texts = |f: &dyn Fn(&commit::Change) -> String| changes.iter().map(f).collect::<Vec<_>>();
    let args = [
        DatumWithOid::from(partition),
        DatumWithOid::from(commit.client_id.as_str()),
        DatumWithOid::from(commit.client_commit_id.as_str()),
        DatumWithOid::from(commit.actor_id.as_str()),
        DatumWithOid::from(commit.created_at_ms),
        DatumWithOid::from(commit.writer_version),
        DatumWithOid::from(texts(&|c| c.table.clone())),
        DatumWithOid::from(texts(&|c| c.row_id.clone())),
        DatumWithOid::from(changes.iter().map(|c| c.op as i16).collect::<Vec<_>>()),
        DatumWithOid::from(changes.iter().map(|c| c.row_version).collect::<Vec<_>>()),
        DatumWithOid::from(
            changes
                .iter()
                .map(|c| JsonB(serde_json::Value::Object(c.scopes.clone())))
                .collect::<Vec<_>>(),
        ),
        DatumWithOid::from(
            changes
                .iter()
                .map(|c| c.payload.clone())
                .collect::<Vec<_>>(),
        ),
        DatumWithOid::from(scopes.iter().map(|s| s.0).collect::<Vec<_>>()),
        DatumWithOid::from(scopes.iter().map(|s| s.1).collect::<Vec<_>>()),
        DatumWithOid::from(scopes.iter().map(|s| s.2).collect::<Vec<_>>()),
        DatumWithOid::from(tombstones.iter().map(|t| t.0).collect::<Vec<_>>()),
        DatumWithOid::from(tombstones.iter().map(|t| t.1).collect::<Vec<_>>()),
    ];
    db::first::<i64>(db::write(client, APPEND_SQL, &args)?)?
        .ok_or_else(|| Error::Internal("append returned no commit_seq".into()))
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
fn append_commit(partition: Option<String>, commit: Option<args::JsonArg>) -> i64 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let document = args::json("commit", commit)?;
        // Validate everything before anything is locked or written.
        let commit = commit::decode(&document)?;
        db::with_spi(|client| append(client, &partition, &commit))
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
