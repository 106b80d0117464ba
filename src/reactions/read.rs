//! Reading reactions: `get_reaction`, `list_reactions`, and the retention call
//! `prune_reactions` (docs/DESIGN.md §8, "Reading reactions"); the documents they return are
//! src/reactions/document.rs's.

use super::document::{document, documents, reaction_columns};
use crate::args;
use crate::db;
use crate::error::{self, Result};
use crate::jsonb::OwnedJsonb;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::JsonB;
use serde_json::json;

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn get_reaction(partition: Option<&str>, idempotency_key: Option<&str>) -> Option<OwnedJsonb> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let key = args::text("idempotency_key", idempotency_key)?;
        db::with_spi(|client| {
            document(db::read(
                client,
                concat!(
                    "SELECT ",
                    reaction_columns!(),
                    " FROM syncular.sync_reactions r
                         WHERE r.partition = $1 AND r.idempotency_key = $2"
                ),
                &[partition.as_str().into(), key.as_str().into()],
            )?)
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn list_reactions(
    partition: Option<&str>,
    lim: Option<i32>,
    statuses: default!(Option<args::TextArray>, "NULL"),
    types: default!(Option<args::TextArray>, "NULL"),
) -> OwnedJsonb {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let lim = args::row_limit("lim", lim)?;
        // Checked, then passed on as they came (NULL for an empty list).
        fn filter<'a>(
            name: &str,
            v: Option<&'a args::TextArray>,
        ) -> Result<Option<&'a args::TextArray>> {
            Ok(match v {
                Some(array) if !args::text_array(name, Some(array))?.is_empty() => Some(array),
                _ => None,
            })
        }
        let statuses = filter("statuses", statuses.as_ref())?;
        let types = filter("types", types.as_ref())?;
        if lim <= 0 {
            return Ok(OwnedJsonb::empty_array());
        }
        db::with_spi(|client| {
            let list = documents(db::read(
                client,
                concat!(
                    "SELECT ",
                    reaction_columns!(),
                    " FROM syncular.sync_reactions r
                         WHERE partition = $1
                           AND ($2::text[] IS NULL OR status = ANY($2))
                           AND ($3::text[] IS NULL OR type = ANY($3))
                         ORDER BY created_at_ms DESC, idempotency_key DESC
                         LIMIT $4"
                ),
                &[
                    partition.as_str().into(),
                    statuses.map_or(
                        DatumWithOid::null_oid(pg_sys::TEXTARRAYOID),
                        args::TextArray::datum,
                    ),
                    types.map_or(
                        DatumWithOid::null_oid(pg_sys::TEXTARRAYOID),
                        args::TextArray::datum,
                    ),
                    (lim as i64).into(),
                ],
            )?)?;
            Ok(list)
        })
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn prune_reactions(
    partition: Option<&str>,
    completed_before_ms: Option<i64>,
    dead_letter_before_ms: Option<i64>,
    lim: Option<i32>,
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let completed_before = args::count("completed_before_ms", completed_before_ms)?;
        let dead_before = args::count("dead_letter_before_ms", dead_letter_before_ms)?;
        let lim = args::required("lim", lim)?;
        if lim <= 0 {
            return Ok(JsonB(json!({"completed": 0, "deadLetter": 0})));
        }
        db::with_spi(|client| {
            // Aged terminal rows only, oldest first; strict bounds; rows locked by others skipped.
            let table = db::write(
                client,
                "WITH completed AS (
                   SELECT r.idempotency_key, r.completed_at_ms AS at FROM syncular.sync_reactions r
                    WHERE r.partition = $1 AND r.status = 'completed' AND r.completed_at_ms < $2
                    ORDER BY r.completed_at_ms, r.idempotency_key LIMIT $4 FOR UPDATE SKIP LOCKED
                 ), dead AS (
                   SELECT r.idempotency_key, r.available_at_ms AS at FROM syncular.sync_reactions r
                    WHERE r.partition = $1 AND r.status = 'dead-letter' AND r.available_at_ms < $3
                    ORDER BY r.available_at_ms, r.idempotency_key LIMIT $4 FOR UPDATE SKIP LOCKED
                 ), candidates AS (
                   SELECT * FROM completed UNION ALL SELECT * FROM dead
                 ), victims AS (
                   SELECT idempotency_key FROM candidates ORDER BY at, idempotency_key LIMIT $4
                 ), gone AS (
                   DELETE FROM syncular.sync_reactions r USING victims v
                    WHERE r.partition = $1 AND r.idempotency_key = v.idempotency_key
                   RETURNING r.status
                 )
                 SELECT count(*) FILTER (WHERE status = 'completed'),
                        count(*) FILTER (WHERE status = 'dead-letter')
                   FROM gone",
                &[
                    partition.as_str().into(),
                    completed_before.into(),
                    dead_before.into(),
                    (lim as i64).into(),
                ],
            )?;
            let row = table.first();
            Ok(JsonB(json!({
                "completed": row.get::<i64>(1)?.unwrap_or(0),
                "deadLetter": row.get::<i64>(2)?.unwrap_or(0),
            })))
        })
    })
}
