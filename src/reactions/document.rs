//! The reaction document (docs/API.md §Reactions), written in jsonb's binary layout
//! ([`crate::jsonb_write`]) from a row of `sync_reactions`: what `claim_reactions`,
//! `get_reaction` and `list_reactions` return (docs/DESIGN.md §8, "Reading reactions").

use crate::args;
use crate::error::{Error, Result};
use crate::jsonb::{self, Node, OwnedJsonb};
use crate::jsonb_write::{Value, Writer};
use pgrx::spi::{SpiHeapTupleData, SpiTupleTable};

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
pub(super) fn document(table: SpiTupleTable<'_>) -> Result<Option<OwnedJsonb>> {
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
