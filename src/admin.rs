//! Blob-reference reads and admin reads (docs/DESIGN.md §Blob references and admin reads).

use crate::access;
use crate::args;
use crate::db;
use crate::error::{self, Result};
use crate::tables;
use pgrx::prelude::*;
use pgrx::JsonB;
use serde_json::{json, Value};

/// SECURITY INVOKER: the references are read with the extension's rights, each referencing
/// table as its owner in a restricted security context, and only for a caller that holds `SELECT`
/// on it (docs/SECURITY.md). A planted reference therefore runs nobody's code with more rights
/// than its author's.
#[pg_extern(stable, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn rows_referencing_blob(partition: Option<&str>, blob_id: Option<&str>) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let blob_id = args::text("blob_id", blob_id)?;
        let caller = access::current_role();
        db::with_spi(|client| {
            let refs: Vec<(String, String)> = access::as_extension_owner(|| {
                db::read(
                    client,
                    "SELECT tbl::text, row_id::text FROM syncular.sync_blob_refs
                      WHERE partition = $1 AND blob_id = $2 ORDER BY tbl, row_id",
                    &[partition.as_str().into(), blob_id.as_str().into()],
                )?
                .map(|row| {
                    crate::interrupts::check();
                    Ok((
                        row.get::<String>(1)?.unwrap_or_default(),
                        row.get::<String>(2)?.unwrap_or_default(),
                    ))
                })
                .collect::<Result<_>>()
            })?;
            let mut out = Vec::new();
            for group in refs.chunk_by(|a, b| a.0 == b.0) {
                crate::interrupts::check();
                let tbl = &group[0].0;
                // Unregistered tables and vanished or changed relations are skipped, not errors.
                let Ok(relation) = tables::open(client, tbl)? else {
                    continue;
                };
                if !relation.readable_by(caller) {
                    return Err(crate::error::Error::invalid_argument("tbl", "privilege")
                        .with_hint(format!(
                            "the calling role needs SELECT on the relation registered for {tbl}"
                        )));
                }
                let row_ids: Vec<&str> = group.iter().map(|r| r.1.as_str()).collect();
                let relation = relation.read_by(caller);
                let mut scopes = relation.scopes_of_rows(client, &partition, &row_ids)?;
                for (_, row_id) in group {
                    crate::interrupts::check();
                    if let Some(scopes) = scopes.remove(row_id) {
                        out.push(json!({"table": tbl, "rowId": row_id, "scopes": scopes}));
                    }
                }
            }
            Ok(JsonB(Value::Array(out)))
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn referenced_blob_ids(partition: Option<&str>) -> Vec<String> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        db::with_spi(|client| {
            db::texts(db::read(
                client,
                "SELECT DISTINCT blob_id FROM syncular.sync_blob_refs WHERE partition = $1 ORDER BY 1",
                &[partition.as_str().into()],
            )?)
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn list_commit_metadata(
    partition: Option<&str>,
    after_seq: Option<i64>,
    lim: Option<i32>,
    tbl: default!(Option<&str>, "NULL"),
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let after = args::count("after_seq", after_seq)?;
        let lim = args::row_limit("lim", lim)?;
        let tbl = tbl
            .map(|t| crate::scope::log_table("tbl", Some(t)))
            .transpose()?;
        if lim <= 0 {
            return Ok(JsonB(json!([])));
        }
        db::with_spi(|client| {
            let list = db::read(
                client,
                "SELECT c.commit_seq, c.client_id, c.client_commit_id, c.actor_id, c.created_at_ms,
                        (SELECT count(*) FROM syncular.sync_changes ch
                          WHERE ch.partition = $1 AND ch.commit_seq = c.commit_seq),
                        (SELECT coalesce(pg_catalog.jsonb_agg(DISTINCT ch.tbl ORDER BY ch.tbl), '[]')
                           FROM syncular.sync_changes ch
                          WHERE ch.partition = $1 AND ch.commit_seq = c.commit_seq)
                   FROM syncular.sync_commits c
                  WHERE c.partition = $1 AND c.commit_seq > $2
                    AND ($4::text IS NULL OR EXISTS (
                          SELECT 1 FROM syncular.sync_changes ch
                           WHERE ch.partition = $1 AND ch.commit_seq = c.commit_seq AND ch.tbl = $4))
                  ORDER BY c.commit_seq DESC
                  LIMIT $3",
                &[partition.as_str().into(), after.into(), (lim as i64).into(), tbl.into()],
            )?
            .map(|row| {
                crate::interrupts::check();
                Ok(json!({
                    "commitSeq": row.get::<i64>(1)?,
                    "clientId": row.get::<String>(2)?,
                    "clientCommitId": row.get::<String>(3)?,
                    "actorId": row.get::<String>(4)?,
                    "createdAtMs": row.get::<i64>(5)?,
                    "changeCount": row.get::<i64>(6)?,
                    "tables": row.get::<crate::jsonb::JsonValue>(7)?.map(|j| j.0),
                }))
            })
            .collect::<Result<Vec<_>>>()?;
            Ok(JsonB(Value::Array(list)))
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn scope_activity(
    partition: Option<&str>,
    variable: Option<&str>,
    value: Option<&str>,
    lim: Option<i32>,
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let variable = args::text("variable", variable)?;
        let value = args::key("value", value)?;
        let lim = args::row_limit("lim", lim)?;
        if lim <= 0 {
            return Ok(JsonB(json!([])));
        }
        db::with_spi(|client| {
            // A skip scan over the partition's distinct tables, then one bounded backward range
            // of the primary key per table: never the partition's whole scope index.
            let list = db::read(
                client,
                "WITH RECURSIVE tables AS (
                   (SELECT s.tbl FROM syncular.sync_change_scopes s
                     WHERE s.partition = $1 ORDER BY s.tbl LIMIT 1)
                   UNION ALL
                   SELECT (SELECT s.tbl FROM syncular.sync_change_scopes s
                            WHERE s.partition = $1 AND s.tbl > t.tbl ORDER BY s.tbl LIMIT 1)
                     FROM tables t WHERE t.tbl IS NOT NULL
                 ), pairs AS (
                   SELECT x.commit_seq, t.tbl
                     FROM tables t
                     CROSS JOIN LATERAL (
                       SELECT s.commit_seq FROM syncular.sync_change_scopes s
                        WHERE s.partition = $1 AND s.tbl = t.tbl AND s.var = $2 AND s.value = $3
                        ORDER BY s.commit_seq DESC LIMIT $4) AS x
                    WHERE t.tbl IS NOT NULL
                    ORDER BY x.commit_seq DESC, t.tbl LIMIT $4
                 )
                 SELECT p.commit_seq, p.tbl, c.actor_id, c.created_at_ms,
                        (SELECT count(*) FROM syncular.sync_changes ch
                          WHERE ch.partition = $1 AND ch.commit_seq = p.commit_seq AND ch.tbl = p.tbl)
                   FROM pairs p
                   JOIN syncular.sync_commits c ON c.partition = $1 AND c.commit_seq = p.commit_seq
                  ORDER BY p.commit_seq DESC, p.tbl",
                &[partition.as_str().into(), variable.as_str().into(), value.as_str().into(), (lim as i64).into()],
            )?
            .map(|row| {
                crate::interrupts::check();
                Ok(json!({
                    "commitSeq": row.get::<i64>(1)?,
                    "table": row.get::<String>(2)?,
                    "actorId": row.get::<String>(3)?,
                    "createdAtMs": row.get::<i64>(4)?,
                    "changeCount": row.get::<i64>(5)?,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
            Ok(JsonB(Value::Array(list)))
        })
    })
}

/// One health view over every partition (docs/API.md, `stats`): the log (allocated, horizon,
/// commits and changes still held), clients (all, active since `active_since_ms`, the largest
/// lag of an active one), pending checkpoints and the reaction backlog by state. Counts walk the
/// partition's primary-key ranges: a monitoring call, not a request path.
#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn stats(active_since_ms: default!(Option<i64>, "0")) -> JsonB {
    error::run(|| {
        let since = args::count("active_since_ms", active_since_ms)?;
        db::with_spi(|client| {
            let stats = db::read(
                client,
                "SELECT coalesce(pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
                   'partition', p.partition,
                   'maxCommitSeq', p.max_commit_seq,
                   'horizonSeq', p.horizon_seq,
                   'commits', (SELECT count(*) FROM syncular.sync_commits c WHERE c.partition = p.partition),
                   'changes', (SELECT count(*) FROM syncular.sync_changes c WHERE c.partition = p.partition),
                   'clients', (SELECT count(*) FROM syncular.sync_clients c WHERE c.partition = p.partition),
                   'activeClients', (SELECT count(*) FROM syncular.sync_clients c
                                      WHERE c.partition = p.partition AND c.updated_at_ms >= $1),
                   'maxActiveLag', (SELECT coalesce(max(p.max_commit_seq - c.cursor), 0)
                                      FROM syncular.sync_clients c
                                     WHERE c.partition = p.partition AND c.updated_at_ms >= $1),
                   'pendingCheckpoints', (SELECT count(*) FROM syncular.sync_backfill_checkpoints k
                                           WHERE k.partition = p.partition AND k.state <> 'activated'),
                   'reactions', (SELECT pg_catalog.jsonb_build_object(
                                          'pending', count(*) FILTER (WHERE r.status = 'pending'),
                                          'leased', count(*) FILTER (WHERE r.status = 'leased'),
                                          'completed', count(*) FILTER (WHERE r.status = 'completed'),
                                          'deadLetter', count(*) FILTER (WHERE r.status = 'dead-letter'))
                                   FROM syncular.sync_reactions r WHERE r.partition = p.partition)
                 ) ORDER BY p.partition), '[]')
                 FROM syncular.sync_partitions p",
                &[since.into()],
            )?;
            Ok(JsonB(
                db::first::<crate::jsonb::JsonValue>(stats)?.map_or_else(|| json!([]), |v| v.0),
            ))
        })
    })
}
