//! Reading reactions: their documents, written in jsonb's binary layout
//! ([`crate::jsonb_write`]), `get_reaction`, `list_reactions`, and the retention call
//! `prune_reactions` (docs/DESIGN.md §8, "Reading reactions").

use crate::args;
use crate::db;
use crate::error::{self, Error, Result};
use crate::jsonb::{self, Node, OwnedJsonb};
use crate::jsonb_write::{Value, Writer};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiHeapTupleData, SpiTupleTable};
use pgrx::JsonB;
use serde_json::json;

/// The columns [`Reaction::read`] reads, in its order.
macro_rules! reaction_columns {
    () => {
        "r.idempotency_key, r.type, r.version, r.payload, r.source_client_id,
         r.source_client_commit_id, r.source_commit_seq, r.created_at_ms, r.available_at_ms,
         r.status, r.attempts, r.max_attempts, r.lease_owner, r.lease_expires_at_ms,
         r.completed_at_ms, r.last_failure"
    };
}
pub(super) use reaction_columns;

/// The documents (docs/API.md §Reactions) of rows of [`reaction_columns!`], as one jsonb array
/// written in jsonb's binary form ([`jsonb_write`]): no JSON text, no `jsonb_in`; the payload
/// and failure go in as the stored containers' bytes. Building the documents in SQL instead
/// (`jsonb_build_object`, `jsonb_agg`) measured about 25 µs a document more on PostgreSQL 15,
/// and writing their text for `jsonb_in` was the largest cost of a claim of ten outside its
/// statement (docs/DESIGN.md §8, "Reading reactions").
///
/// The documents are bounded in total ([`crate::limits::OUTPUT_BYTES`], docs/API.md "Limits"):
/// `lim` reactions of 64 KiB payloads would be gigabytes, so past the budget the call is refused
/// (`lim`, `too_large`; a claim rolls back with it) rather than answered in part.
pub(super) fn documents(table: SpiTupleTable<'_>) -> Result<OwnedJsonb> {
    let mut rows: Vec<Reaction> = crate::alloc::try_with_capacity(table.len())?;
    let mut bytes = 0usize;
    for row in table {
        crate::interrupts::check();
        crate::alloc::check()?;
        if bytes >= crate::limits::OUTPUT_BYTES {
            return Err(crate::limits::over_output("lim"));
        }
        let reaction = Reaction::read(&row)?;
        bytes += reaction.size();
        rows.push(reaction);
    }
    let mut w = Writer::with_capacity(bytes + 8);
    w.array(rows.len(), |w, i| rows[i].write(w))
        .map_err(unreadable)?;
    Ok(w.finish())
}

/// The document of the first row, if any (see [`documents`]).
fn document(table: SpiTupleTable<'_>) -> Result<Option<OwnedJsonb>> {
    let Some(row) = table.into_iter().next() else {
        return Ok(None);
    };
    let reaction = Reaction::read(&row)?;
    let mut w = Writer::with_capacity(512);
    reaction.write(&mut w).map_err(unreadable)?;
    Ok(Some(w.finish()))
}

fn unreadable(_: jsonb::Malformed) -> Error {
    Error::Internal("syncular: a stored reaction's JSON is not readable jsonb".into())
}

/// One row of [`reaction_columns!`].
struct Reaction {
    key: String,
    kind: String,
    version: i32,
    payload: OwnedJsonb,
    source_client_id: String,
    source_client_commit_id: String,
    source_commit_seq: i64,
    created_at_ms: i64,
    available_at_ms: i64,
    status: String,
    attempts: i32,
    max_attempts: i32,
    lease_owner: Option<String>,
    lease_expires_at_ms: Option<i64>,
    completed_at_ms: Option<i64>,
    last_failure: Option<OwnedJsonb>,
}

impl Reaction {
    /// Bytes the reaction's document takes, about: its JSON values, its keys, and the rest.
    fn size(&self) -> usize {
        256 + self.key.len()
            + self.kind.len()
            + self.payload.len()
            + self.source_client_id.len()
            + self.source_client_commit_id.len()
            + self.last_failure.as_ref().map_or(0, OwnedJsonb::len)
    }

    fn read(row: &SpiHeapTupleData<'_>) -> Result<Reaction> {
        let string =
            |at: usize| -> Result<String> { Ok(row.get::<String>(at)?.unwrap_or_default()) };
        let int = |at: usize| -> Result<i64> { Ok(row.get::<i64>(at)?.unwrap_or_default()) };
        let int4 = |at: usize| -> Result<i32> { Ok(row.get::<i32>(at)?.unwrap_or_default()) };
        let json = |at: usize| -> Result<Option<OwnedJsonb>> {
            OwnedJsonb::column(row, at)?.map(unwrapped).transpose()
        };
        Ok(Reaction {
            key: string(1)?,
            kind: string(2)?,
            version: int4(3)?,
            payload: json(4)?.unwrap_or_else(OwnedJsonb::empty_array),
            source_client_id: string(5)?,
            source_client_commit_id: string(6)?,
            source_commit_seq: int(7)?,
            created_at_ms: int(8)?,
            available_at_ms: int(9)?,
            status: string(10)?,
            attempts: int4(11)?,
            max_attempts: int4(12)?,
            lease_owner: row.get::<String>(13)?,
            lease_expires_at_ms: row.get::<i64>(14)?,
            completed_at_ms: row.get::<i64>(15)?,
            last_failure: json(16)?,
        })
    }

    /// Writes the document; absent columns (NULL) are absent keys.
    fn write(&self, w: &mut Writer) -> std::result::Result<u32, jsonb::Malformed> {
        fn root(doc: &OwnedJsonb) -> std::result::Result<Node<'_>, jsonb::Malformed> {
            doc.container().and_then(|c| c.root())
        }
        fn text(s: &str) -> Value<'_> {
            Value::String(s.as_bytes())
        }
        let mut pairs = Vec::with_capacity(16);
        pairs.extend([
            ("idempotencyKey", text(&self.key)),
            ("type", text(&self.kind)),
            ("version", Value::Int(self.version.into())),
            ("payload", Value::Node(root(&self.payload)?)),
            ("sourceClientId", text(&self.source_client_id)),
            ("sourceClientCommitId", text(&self.source_client_commit_id)),
            ("sourceCommitSeq", Value::Int(self.source_commit_seq)),
            ("createdAtMs", Value::Int(self.created_at_ms)),
            ("availableAtMs", Value::Int(self.available_at_ms)),
            ("status", text(&self.status)),
            ("attempts", Value::Int(self.attempts.into())),
            ("maxAttempts", Value::Int(self.max_attempts.into())),
        ]);
        if let Some(owner) = &self.lease_owner {
            pairs.push(("leaseOwner", text(owner)));
        }
        if let Some(at) = self.lease_expires_at_ms {
            pairs.push(("leaseExpiresAtMs", Value::Int(at)));
        }
        if let Some(at) = self.completed_at_ms {
            pairs.push(("completedAtMs", Value::Int(at)));
        }
        if let Some(failure) = &self.last_failure {
            pairs.push(("lastFailure", Value::Node(root(failure)?)));
        }
        w.object(&mut pairs)
    }
}

/// A stored JSON value as readers see it: a jsonb string holding the text of an object or
/// array (written by a 0.24 host whose driver bound JSON as text) is that object or array, as
/// every reader unwraps it (data model invariant 15, [`args::unwrap_json_text`]).
fn unwrapped(stored: OwnedJsonb) -> Result<OwnedJsonb> {
    let root = stored.container().and_then(|c| c.root());
    match root.ok().and_then(args::wrapped_json) {
        Some(inner) => OwnedJsonb::from_text(inner)
            .ok_or_else(|| Error::Internal("syncular: a stored JSON text holds NUL".into())),
        None => Ok(stored),
    }
}

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
