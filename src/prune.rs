//! Horizon and pruning (docs/DESIGN.md §Retention). A prune raises the horizon and deletes the
//! log below it in one statement under the partition lock, so a single snapshot never sees the
//! deletions without the raised horizon.

use crate::args::{self, MAX_SAFE};
use crate::db;
use crate::error::{self, Code, Error, Result};
use crate::log;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use pgrx::JsonB;
use serde_json::json;

/// Prunes through `max(horizon, through)` if `log_epoch` is the partition's registry epoch.
/// Caller holds nothing; takes L1 then L2.
pub fn prune_through(
    client: &SpiClient<'_>,
    partition: &str,
    log_epoch: &str,
    through: i64,
) -> Result<serde_json::Value> {
    let head = log::lock(client, partition)?.max_commit_seq;
    // A horizon past the head would put the next commit below it (D6): every client of the
    // partition would loop bootstrap → reset until the head passed it. Checked under the lock,
    // against the head it froze.
    if through > head {
        return Err(
            Error::new(Code::InvalidPruneCursor, json!({ "partition": partition })).with_hint(
                format!(
                    "through_seq {through} is past the partition's newest commit {head}; prune through at most max_commit_seq"
                ),
            ),
        );
    }
    let epoch = db::first::<String>(db::write(
        client,
        "SELECT log_epoch FROM syncular.sync_partition_registry WHERE partition = $1 FOR UPDATE",
        &[DatumWithOid::from(partition)],
    )?)?;
    if epoch.as_deref() != Some(log_epoch) {
        return Err(Error::new(
            Code::PruneEpochMismatch,
            json!({"partition": partition}),
        ));
    }
    let table = db::write(
        client,
        "WITH previous AS (
           SELECT horizon_seq FROM syncular.sync_partitions WHERE partition = $1
         ), raised AS (
           UPDATE syncular.sync_partitions SET horizon_seq = GREATEST(horizon_seq, $2)
            WHERE partition = $1 RETURNING horizon_seq
         ), commits AS (
           DELETE FROM syncular.sync_commits
            WHERE partition = $1 AND commit_seq <= (SELECT horizon_seq FROM raised) RETURNING 1
         ), changes AS (
           DELETE FROM syncular.sync_changes
            WHERE partition = $1 AND commit_seq <= (SELECT horizon_seq FROM raised)
         ), scopes AS (
           DELETE FROM syncular.sync_change_scopes
            WHERE partition = $1 AND commit_seq <= (SELECT horizon_seq FROM raised)
         ), tombstones AS (
           DELETE FROM syncular.sync_tombstones
            WHERE partition = $1 AND commit_seq <= (SELECT horizon_seq FROM raised)
         )
         SELECT (SELECT horizon_seq FROM previous), (SELECT horizon_seq FROM raised),
                (SELECT count(*) FROM commits)",
        &[DatumWithOid::from(partition), DatumWithOid::from(through)],
    )?;
    let row = table.first();
    Ok(json!({
        "previousHorizonSeq": row.get::<i64>(1)?,
        "horizonSeq": row.get::<i64>(2)?,
        "removedCommits": row.get::<i64>(3)?,
    }))
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn horizon_seq(partition: Option<&str>) -> i64 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        db::with_spi(|client| {
            Ok(db::first::<i64>(db::read(
                client,
                "SELECT horizon_seq FROM syncular.sync_partitions WHERE partition = $1",
                &[DatumWithOid::from(partition.as_str())],
            )?)?
            .unwrap_or(0))
        })
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn set_horizon_seq(partition: Option<&str>, seq: Option<i64>) -> i64 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let seq = args::count("seq", seq)?;
        db::with_spi(|client| {
            let head = log::lock(client, &partition)?.max_commit_seq;
            // As for a prune: the horizon never passes the head (D6).
            if seq > head {
                return Err(Error::invalid_argument("seq", "range").with_hint(format!(
                    "seq {seq} is past the partition's newest commit {head}; the horizon may be raised to at most max_commit_seq"
                )));
            }
            db::first::<i64>(db::write(
                client,
                "UPDATE syncular.sync_partitions SET horizon_seq = GREATEST(horizon_seq, $2)
                  WHERE partition = $1 RETURNING horizon_seq",
                &[
                    DatumWithOid::from(partition.as_str()),
                    DatumWithOid::from(seq),
                ],
            )?)?
            .ok_or_else(|| Error::Internal("locked partition row missing".into()))
        })
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn prune_commits_through(
    partition: Option<&str>,
    log_epoch: Option<&str>,
    through_seq: Option<i64>,
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        // Upstream validated the cursor as a whole: every defect of it is one code.
        let cursor = || Error::new(Code::InvalidPruneCursor, json!({ "partition": partition }));
        let log_epoch = log_epoch.filter(|e| !e.is_empty()).ok_or_else(cursor)?;
        let through = through_seq
            .filter(|t| (0..=MAX_SAFE).contains(t))
            .ok_or_else(cursor)?;
        db::with_spi(|client| prune_through(client, &partition, log_epoch, through)).map(JsonB)
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn commit_seq_before(partition: Option<&str>, before_ms: Option<i64>) -> i64 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let before_ms = args::count("before_ms", before_ms)?;
        db::with_spi(|client| {
            Ok(db::first::<i64>(db::read(
                client,
                "SELECT max(commit_seq) FROM syncular.sync_commits
                  WHERE partition = $1 AND created_at_ms < $2",
                &[
                    DatumWithOid::from(partition.as_str()),
                    DatumWithOid::from(before_ms),
                ],
            )?)?
            .unwrap_or(0))
        })
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn prune_commit_log(
    partition: Option<&str>,
    now_ms: Option<i64>,
    active_window_ms: default!(Option<i64>, "1209600000"),
    age_force_ms: default!(Option<i64>, "2592000000"),
    min_retained_commits: default!(Option<i64>, "1000"),
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let now = args::count("now_ms", now_ms)?;
        let active_window = args::count("active_window_ms", active_window_ms)?;
        let age_force = args::count("age_force_ms", age_force_ms)?;
        let min_retained = args::count("min_retained_commits", min_retained_commits)?;
        db::with_spi(|client| {
            // The policy is read under the same locks as the prune: one log generation.
            let locked = log::lock(client, &partition)?;
            let epoch = db::first::<String>(db::write(
                client,
                "SELECT log_epoch FROM syncular.sync_partition_registry WHERE partition = $1 FOR UPDATE",
                &[DatumWithOid::from(partition.as_str())],
            )?)?
            .ok_or_else(|| {
                Error::new(Code::PartitionUnregistered, json!({ "partition": partition }))
            })?;
            let policy = db::write(
                client,
                "SELECT (SELECT min(cursor) FROM syncular.sync_clients
                          WHERE partition = $1 AND updated_at_ms >= $2),
                        coalesce((SELECT max(commit_seq) FROM syncular.sync_commits
                                   WHERE partition = $1 AND created_at_ms < $3), 0)",
                &[
                    DatumWithOid::from(partition.as_str()),
                    DatumWithOid::from(now - active_window),
                    DatumWithOid::from(now - age_force),
                ],
            )?;
            let row = policy.first();
            let floor = row.get::<i64>(1)?; // NULL: no active client, no floor
            let forced = row.get::<i64>(2)?.unwrap_or(0);
            let keep_newest = locked.max_commit_seq - min_retained;
            let target = floor.map_or(keep_newest, |f| f.max(forced).min(keep_newest));
            let through = target.max(0);
            let mut result = prune_through(client, &partition, &epoch, through)?;
            result["throughSeq"] = serde_json::json!(through);
            Ok(JsonB(result))
        })
    })
}
