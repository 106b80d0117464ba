//! The reaction outbox (docs/DESIGN.md §Reactions, §sync_reactions): enqueued in the push
//! transaction with their source commit, claimed under a lease with `FOR UPDATE SKIP LOCKED`,
//! completed / extended / failed only while the caller still owns the lease. Nothing here takes
//! the partition lock.

use crate::args::{self, MAX_SAFE};
use crate::db;
use crate::error::{self, Code, Error, Result};
use crate::heap::{DirectInsert, SyncTable, Value as Cell};
use crate::jsonb::{self, Bounds, JsonbArg, Node, OwnedJsonb, RawJsonb, Reason};
use crate::jsonb_write::{Value, Writer};
use crate::limits;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiHeapTupleData, SpiTupleTable};
use pgrx::JsonB;
use pgrx::PgSqlErrorCode;
use serde_json::json;
use std::collections::HashSet;
use std::ffi::CStr;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

const MAX_PAYLOAD_BYTES: usize = 65_536;
const MAX_DETAILS_BYTES: usize = 8_192;
const MAX_DEPTH: usize = 16;
const MAX_TYPE_BYTES: usize = 128;

/// The columns [`Reaction::read`] reads, in its order.
macro_rules! reaction_columns {
    () => {
        "r.idempotency_key, r.type, r.version, r.payload, r.source_client_id,
         r.source_client_commit_id, r.source_commit_seq, r.created_at_ms, r.available_at_ms,
         r.status, r.attempts, r.max_attempts, r.lease_owner, r.lease_expires_at_ms,
         r.completed_at_ms, r.last_failure"
    };
}

/// The documents (docs/API.md §Reactions) of rows of [`reaction_columns!`], as one jsonb array
/// written in jsonb's binary form ([`jsonb_write`]): no JSON text, no `jsonb_in`; the payload
/// and failure go in as the stored containers' bytes. Building the documents in SQL instead
/// (`jsonb_build_object`, `jsonb_agg`) measured about 25 µs a document more on PostgreSQL 15,
/// and writing their text for `jsonb_in` was the largest cost of a claim of ten outside its
/// statement (docs/DESIGN.md §8, "Reading reactions").
fn documents(table: SpiTupleTable<'_>) -> Result<OwnedJsonb> {
    let rows = table
        .map(|row| Reaction::read(&row))
        .collect::<Result<Vec<_>>>()?;
    let mut w = Writer::with_capacity(512 * rows.len() + 8);
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
    fn read(row: &SpiHeapTupleData<'_>) -> Result<Reaction> {
        let string =
            |at: usize| -> Result<String> { Ok(row.get::<String>(at)?.unwrap_or_default()) };
        let int = |at: usize| -> Result<i64> { Ok(row.get::<i64>(at)?.unwrap_or_default()) };
        let int4 = |at: usize| -> Result<i32> { Ok(row.get::<i32>(at)?.unwrap_or_default()) };
        let json = |at: usize| -> Result<Option<OwnedJsonb>> {
            row.get::<OwnedJsonb>(at)?.map(unwrapped).transpose()
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
    if let Ok(Node::String(text)) = stored.container().and_then(|c| c.root()) {
        if let Some(inner) = std::str::from_utf8(text).ok().and_then(args::json_text) {
            return OwnedJsonb::from_text(inner)
                .ok_or_else(|| Error::Internal("syncular: a stored JSON text holds NUL".into()));
        }
    }
    Ok(stored)
}

fn valid_type(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || "._:-".contains(c))
}

/// One validated reaction, as its columns, borrowed from the argument.
struct NewReaction<'a> {
    key: &'a str,
    kind: &'a str,
    version: i32,
    /// The payload's binary form: stored as it came, never printed and parsed again.
    payload: RawJsonb<'a>,
    source_client: &'a str,
    source_commit: &'a str,
    source_seq: i64,
    created: i64,
    max_attempts: i32,
}

/// The members of a reaction, in the order they are checked (docs/API.md, `enqueue_reactions`).
const REACTION_KEYS: [&str; 9] = [
    "idempotencyKey",
    "type",
    "version",
    "payload",
    "sourceClientId",
    "sourceClientCommitId",
    "sourceCommitSeq",
    "createdAtMs",
    "maxAttempts",
];

/// Validates one reaction of the binary argument: the first offending key in the table's order
/// (docs/API.md, `enqueue_reactions`).
fn reaction(node: Node<'_>, i: usize) -> Result<NewReaction<'_>> {
    let at = |key: &str, reason: Reason| {
        Error::invalid_argument(&format!("reactions[{i}].{key}"), reason)
    };
    let element = || Error::invalid_argument(&format!("reactions[{i}]"), "type");
    let Node::Object(obj) = node else {
        return Err(element());
    };
    let [key, kind, version, payload, client, commit, seq, created, attempts] =
        obj.fields(REACTION_KEYS).map_err(|_| element())?;
    let string = |node, name, non_empty| {
        jsonb::string_field(node, non_empty).map_err(|reason| at(name, reason))
    };
    let integer = |node, name, bounds, default: Option<i64>| {
        jsonb::integer_field(node, bounds)
            .map_err(|reason| at(name, reason))?
            .or(default)
            .ok_or_else(|| at(name, "missing"))
    };
    let key = string(key, "idempotencyKey", true)?;
    let kind = string(kind, "type", false)?;
    if !valid_type(kind) {
        return Err(at("type", "shape"));
    }
    if kind.len() > MAX_TYPE_BYTES {
        return Err(at("type", "too_large"));
    }
    let version = integer(version, "version", (1, i32::MAX as i64), None)?;
    let (payload, container) = match jsonb::given(payload) {
        None => return Err(at("payload", "missing")),
        Some(p @ (Node::Object(c) | Node::Array(c))) => (p, c),
        Some(_) => return Err(at("payload", "type")),
    };
    match jsonb::bounds(payload, MAX_PAYLOAD_BYTES, MAX_DEPTH).map_err(|_| element())? {
        Bounds::Within => {}
        Bounds::TooLarge => return Err(at("payload", "too_large")),
        Bounds::TooDeep => return Err(at("payload", "too_deep")),
    }
    Ok(NewReaction {
        key,
        kind,
        version: version as i32,
        payload: container.to_jsonb(),
        source_client: string(client, "sourceClientId", false)?,
        source_commit: string(commit, "sourceClientCommitId", false)?,
        source_seq: integer(seq, "sourceCommitSeq", (0, MAX_SAFE), None)?,
        created: integer(created, "createdAtMs", (0, MAX_SAFE), None)?,
        max_attempts: integer(attempts, "maxAttempts", (1, 100), Some(10))? as i32,
    })
}

/// The key a unique violation of `sync_reactions`' primary key reports, among `keys`. Its
/// DETAIL renders the key as `(partition, idempotency_key)=(<partition>, <key>)` (PostgreSQL's
/// index value description, built without translation). Another key's rendering can occur in
/// it only inside the reported one (a key that contains `=(<partition>, <other>)`), so the
/// longest key whose rendering it contains is the reported one. Anything else (another error,
/// no DETAIL) is not ours to rename.
fn existing_key<'k>(
    panic: &(dyn std::any::Any + Send),
    partition: &str,
    keys: &[&'k str],
) -> Option<&'k str> {
    let report = error::postgres_report(panic)?;
    if report.sql_error_code() != PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION {
        return None;
    }
    let detail = report.detail()?;
    keys.iter()
        .filter(|key| detail.contains(&format!("=({partition}, {key})")))
        .max_by_key(|key| key.len())
        .copied()
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn enqueue_reactions(partition: Option<&str>, reactions: Option<JsonbArg>) -> i32 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        args::with_jsonb("reactions", reactions, |root| enqueue(&partition, root))
    })
}

/// `enqueue_reactions` on the argument's binary form: each payload goes to the table as the
/// jsonb bytes it came in (docs/DESIGN.md §8, "Enqueue").
fn enqueue(partition: &str, root: Node<'_>) -> Result<i32> {
    let Node::Array(items) = root else {
        return Err(Error::invalid_argument("reactions", "type"));
    };
    let rows = items
        .children()
        .enumerate()
        .map(|(i, item)| {
            reaction(
                item.map_err(|_| Error::invalid_argument("reactions", "type"))?,
                i,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let duplicate =
        |key: &str| Error::new(Code::ReactionDuplicate, json!({ "idempotencyKey": key }));
    let mut seen = HashSet::new();
    if let Some(r) = rows.iter().find(|r| !seen.insert(r.key)) {
        return Err(duplicate(r.key));
    }
    let count = rows.len();
    let keys: Vec<&str> = rows.iter().map(|r| r.key).collect();
    // Rows in array order either way: the unique check waits for an uncommitted insert of the
    // same key by another transaction and then fails at the first element whose key exists,
    // which is the one to name (docs/DESIGN.md §8, "Enqueue").
    let inserted = catch_unwind(AssertUnwindSafe(|| {
        match DirectInsert::open(SyncTable::Reactions, REACTION_COLUMNS)? {
            Some(mut table) => insert_direct(&mut table, partition, &rows),
            None => insert_statement(partition, &rows),
        }
    }));
    match inserted {
        Ok(done) => done.map(|()| count as i32),
        Err(panic) => match existing_key(panic.as_ref(), partition, &keys) {
            // The transaction is aborting: nothing more is read, the error is replaced.
            Some(key) => Err(duplicate(key)),
            None => resume_unwind(panic),
        },
    }
}

/// `sync_reactions`' columns, in table order, for [`DirectInsert`].
const REACTION_COLUMNS: &[(&CStr, pg_sys::Oid)] = &[
    (c"partition", pg_sys::TEXTOID),
    (c"idempotency_key", pg_sys::TEXTOID),
    (c"type", pg_sys::TEXTOID),
    (c"version", pg_sys::INT4OID),
    (c"payload", pg_sys::JSONBOID),
    (c"source_client_id", pg_sys::TEXTOID),
    (c"source_client_commit_id", pg_sys::TEXTOID),
    (c"source_commit_seq", pg_sys::INT8OID),
    (c"created_at_ms", pg_sys::INT8OID),
    (c"available_at_ms", pg_sys::INT8OID),
    (c"status", pg_sys::TEXTOID),
    (c"attempts", pg_sys::INT4OID),
    (c"max_attempts", pg_sys::INT4OID),
    (c"lease_owner", pg_sys::TEXTOID),
    (c"lease_expires_at_ms", pg_sys::INT8OID),
    (c"completed_at_ms", pg_sys::INT8OID),
    (c"last_failure", pg_sys::JSONBOID),
];

/// The rows inserted below SQL ([`crate::heap`]): a heap insert and the index entries per row,
/// the CHECK constraint evaluated, no statement and its executor start-up (the largest cost of
/// the call beside the rows' own writes, docs/DESIGN.md §8, "Enqueue").
fn insert_direct(
    table: &mut DirectInsert,
    partition: &str,
    rows: &[NewReaction<'_>],
) -> Result<()> {
    for r in rows {
        table.insert(&[
            Some(Cell::Text(partition)),
            Some(Cell::Text(r.key)),
            Some(Cell::Text(r.kind)),
            Some(Cell::Int4(r.version)),
            Some(Cell::Jsonb(r.payload)),
            Some(Cell::Text(r.source_client)),
            Some(Cell::Text(r.source_commit)),
            Some(Cell::Int8(r.source_seq)),
            Some(Cell::Int8(r.created)),
            Some(Cell::Int8(r.created)),
            Some(Cell::Text("pending")),
            Some(Cell::Int4(0)),
            Some(Cell::Int4(r.max_attempts)),
            None,
            None,
            None,
            None,
        ])?;
    }
    Ok(())
}

/// The rows inserted by one statement, when the table carries something only a statement runs
/// (a trigger, a rule: [`DirectInsert::open`]): one array per column, a plain `INSERT … SELECT
/// unnest(…)` whose set-returning functions run in lockstep, one row per element in array order.
fn insert_statement<'a>(partition: &str, rows: &[NewReaction<'a>]) -> Result<()> {
    let column = |f: fn(&NewReaction<'a>) -> &'a str| rows.iter().map(f).collect::<Vec<_>>();
    db::with_spi(|client| {
        db::write_generic(
            client,
            "INSERT INTO syncular.sync_reactions
               (partition, idempotency_key, type, version, payload, source_client_id,
                source_client_commit_id, source_commit_seq, created_at_ms,
                available_at_ms, status, attempts, max_attempts)
             SELECT $1, pg_catalog.unnest($2::text[]), pg_catalog.unnest($3::text[]),
                    pg_catalog.unnest($4::integer[]),
                    pg_catalog.unnest($5::jsonb[]),
                    pg_catalog.unnest($6::text[]), pg_catalog.unnest($7::text[]),
                    pg_catalog.unnest($8::bigint[]), pg_catalog.unnest($9::bigint[]),
                    pg_catalog.unnest($9::bigint[]), 'pending', 0,
                    pg_catalog.unnest($10::integer[])",
            &[
                DatumWithOid::from(partition),
                DatumWithOid::from(column(|r| r.key)),
                DatumWithOid::from(column(|r| r.kind)),
                DatumWithOid::from(rows.iter().map(|r| r.version).collect::<Vec<_>>()),
                DatumWithOid::from(rows.iter().map(|r| r.payload).collect::<Vec<_>>()),
                DatumWithOid::from(column(|r| r.source_client)),
                DatumWithOid::from(column(|r| r.source_commit)),
                DatumWithOid::from(rows.iter().map(|r| r.source_seq).collect::<Vec<_>>()),
                DatumWithOid::from(rows.iter().map(|r| r.created).collect::<Vec<_>>()),
                DatumWithOid::from(rows.iter().map(|r| r.max_attempts).collect::<Vec<_>>()),
            ],
        )
        .map(|_| ())
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn claim_reactions(
    partition: Option<&str>,
    lease_owner: Option<&str>,
    types: Option<Array<&str>>,
    now_ms: Option<i64>,
    lease_duration_ms: Option<i64>,
    lim: Option<i32>,
) -> OwnedJsonb {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let owner = args::text("lease_owner", lease_owner)?;
        let types = args::text_array("types", types)?;
        let now = args::count("now_ms", now_ms)?;
        let duration = args::count("lease_duration_ms", lease_duration_ms)?;
        let lim = args::row_limit("lim", lim)?;
        if types.is_empty() || lim <= 0 {
            return Ok(OwnedJsonb::empty_array());
        }
        db::with_spi(|client| {
            // Always the kept generic plan (db::write_generic): a custom plan would be planned
            // again on every call (the generic one's cost is estimated for an unknown `lim`),
            // and the plan is the same index range either way.
            let claimed = documents(db::write_generic(
                client,
                concat!(
                    // The due condition and the order are exactly sync_reactions_claim's
                    // predicate and key (sql/schema.sql): a range read in claim order that
                    // stops after `lim` locked rows; the type filter is checked on the rows
                    // read (docs/DESIGN.md §8, the claim index). The chosen keys feed the
                    // UPDATE as an array, so it probes the primary key whatever the planner
                    // guesses for `lim`.
                    "WITH claimed AS (
                       UPDATE syncular.sync_reactions r
                          SET status = 'leased', attempts = r.attempts + 1, lease_owner = $2,
                              lease_expires_at_ms = LEAST(9007199254740991, $4 + $5),
                              completed_at_ms = NULL
                        WHERE r.partition = $1 AND r.idempotency_key = ANY (ARRAY(
                          SELECT d.idempotency_key FROM syncular.sync_reactions d
                           WHERE d.partition = $1 AND d.status IN ('pending', 'leased')
                             AND CASE WHEN d.status = 'leased' THEN d.lease_expires_at_ms
                                      ELSE d.available_at_ms END <= $4
                             AND d.type = ANY($3)
                           ORDER BY CASE WHEN d.status = 'leased' THEN d.lease_expires_at_ms
                                         ELSE d.available_at_ms END,
                                    d.created_at_ms, d.idempotency_key
                           LIMIT $6
                           FOR UPDATE SKIP LOCKED))
                       RETURNING r.*
                     )
                     SELECT ",
                    reaction_columns!(),
                    " FROM claimed r ORDER BY r.created_at_ms, r.idempotency_key"
                ),
                &[
                    DatumWithOid::from(partition.as_str()),
                    DatumWithOid::from(owner.as_str()),
                    DatumWithOid::from(types),
                    DatumWithOid::from(now),
                    DatumWithOid::from(duration),
                    DatumWithOid::from(lim as i64),
                ],
            )?)?;
            Ok(claimed)
        })
    })
}

/// The `(partition, idempotency_key, lease_owner)` arguments of the lease-guarded calls.
fn lease_args(
    partition: Option<&str>,
    idempotency_key: Option<&str>,
    lease_owner: Option<&str>,
) -> Result<(String, String, String)> {
    Ok((
        args::text("partition", partition)?,
        args::text("idempotency_key", idempotency_key)?,
        args::text("lease_owner", lease_owner)?,
    ))
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn complete_reaction(
    partition: Option<&str>,
    idempotency_key: Option<&str>,
    lease_owner: Option<&str>,
    at_ms: Option<i64>,
) -> bool {
    error::run(|| {
        let (partition, key, owner) = lease_args(partition, idempotency_key, lease_owner)?;
        let at = args::count("at_ms", at_ms)?;
        db::changed(
            "UPDATE syncular.sync_reactions
                SET status = 'completed', completed_at_ms = $4, lease_owner = NULL,
                    lease_expires_at_ms = NULL
              WHERE partition = $1 AND idempotency_key = $2 AND status = 'leased'
                AND lease_owner = $3
             RETURNING 1",
            &[
                partition.as_str().into(),
                key.as_str().into(),
                owner.as_str().into(),
                at.into(),
            ],
        )
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn extend_reaction_lease(
    partition: Option<&str>,
    idempotency_key: Option<&str>,
    lease_owner: Option<&str>,
    expires_at_ms: Option<i64>,
) -> bool {
    error::run(|| {
        let (partition, key, owner) = lease_args(partition, idempotency_key, lease_owner)?;
        let expires = args::count("expires_at_ms", expires_at_ms)?;
        db::changed(
            "UPDATE syncular.sync_reactions SET lease_expires_at_ms = $4
              WHERE partition = $1 AND idempotency_key = $2 AND status = 'leased'
                AND lease_owner = $3
             RETURNING 1",
            &[
                partition.as_str().into(),
                key.as_str().into(),
                owner.as_str().into(),
                expires.into(),
            ],
        )
    })
}

/// A failure object (docs/API.md §Reactions, `fail_reaction`) from its binary form: `code` (a
/// non-empty string), `atMs` (integer 0 … 2^53−1) and optional `details` (an object within the
/// payload's caps: `MAX_DETAILS_BYTES` of compact text, depth 16, measured as for payloads);
/// other keys are dropped. Returns the kept object's JSON text and `atMs`.
fn decode_failure(node: Option<Node<'_>>, at: &str) -> Result<(String, i64)> {
    let fail = |key: &str, reason: Reason| Error::invalid_argument(&format!("{at}.{key}"), reason);
    let obj = match node {
        None => return Err(Error::invalid_argument(at, "missing")),
        Some(Node::Object(obj)) => obj,
        Some(_) => return Err(Error::invalid_argument(at, "type")),
    };
    let unreadable = |_| Error::invalid_argument(at, "type");
    let [code, at_ms, details] = obj
        .fields(["code", "atMs", "details"])
        .map_err(unreadable)?;
    let code = jsonb::string_field(code, true).map_err(|reason| fail("code", reason))?;
    let at_ms = jsonb::integer_field(at_ms, (0, MAX_SAFE))
        .map_err(|reason| fail("atMs", reason))?
        .ok_or_else(|| fail("atMs", "missing"))?;
    let mut kept = String::from("{\"code\":");
    jsonb::push_escaped(&mut kept, code);
    kept.push_str(&format!(",\"atMs\":{at_ms}"));
    match jsonb::given(details) {
        None => {}
        Some(details @ Node::Object(container)) => {
            match jsonb::bounds(details, MAX_DETAILS_BYTES, MAX_DEPTH).map_err(unreadable)? {
                Bounds::Within => {}
                Bounds::TooLarge => return Err(fail("details", "too_large")),
                Bounds::TooDeep => return Err(fail("details", "too_deep")),
            }
            kept.push_str(",\"details\":");
            kept.push_str(&container.to_jsonb().printed());
        }
        Some(_) => return Err(fail("details", "type")),
    }
    kept.push('}');
    Ok((kept, at_ms))
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn fail_reaction(
    partition: Option<&str>,
    idempotency_key: Option<&str>,
    lease_owner: Option<&str>,
    failure: Option<JsonbArg>,
    retry_at_ms: default!(Option<i64>, "NULL"),
) -> bool {
    error::run(|| {
        let (partition, key, owner) = lease_args(partition, idempotency_key, lease_owner)?;
        let (failure, at) = args::with_jsonb("failure", failure, |root| {
            decode_failure(Some(root), "failure")
        })?;
        let retry = retry_at_ms
            .map(|r| args::count("retry_at_ms", Some(r)))
            .transpose()?;
        db::changed(
            "UPDATE syncular.sync_reactions
                SET status = CASE WHEN $5::bigint IS NULL THEN 'dead-letter' ELSE 'pending' END,
                    available_at_ms = coalesce($5::bigint, $6),
                    last_failure = $4::jsonb, lease_owner = NULL, lease_expires_at_ms = NULL
              WHERE partition = $1 AND idempotency_key = $2 AND status = 'leased'
                AND lease_owner = $3
             RETURNING 1",
            &[
                partition.as_str().into(),
                key.as_str().into(),
                owner.as_str().into(),
                failure.as_str().into(),
                retry.into(),
                at.into(),
            ],
        )
    })
}

/// The keys of `changed` in the order of `asked` (first occurrences): what a batch call reports.
fn in_order(asked: &[String], changed: &HashSet<String>) -> Vec<String> {
    let mut seen = HashSet::new();
    asked
        .iter()
        .filter(|k| changed.contains(*k) && seen.insert(k.as_str()))
        .cloned()
        .collect()
}

/// Batch `complete_reaction`: one statement, a primary-key probe per key (docs/API.md
/// §Reactions). Returns the keys it completed, in the order given; a key not leased by
/// `lease_owner` (or absent) is left alone, as in the single form.
#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn complete_reactions(
    partition: Option<&str>,
    idempotency_keys: Option<Array<&str>>,
    lease_owner: Option<&str>,
    at_ms: Option<i64>,
) -> Vec<String> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let keys = args::text_array("idempotency_keys", idempotency_keys)?;
        let owner = args::text("lease_owner", lease_owner)?;
        let at = args::count("at_ms", at_ms)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let changed: HashSet<String> = db::with_spi(|client| {
            // The kept generic plan: a primary-key probe per key whatever the array holds; left
            // to choose, the plan cache can settle on planning every call again.
            db::write_generic(
                client,
                "UPDATE syncular.sync_reactions
                    SET status = 'completed', completed_at_ms = $4, lease_owner = NULL,
                        lease_expires_at_ms = NULL
                  WHERE partition = $1 AND idempotency_key = ANY($2) AND status = 'leased'
                    AND lease_owner = $3
                 RETURNING idempotency_key",
                &[
                    DatumWithOid::from(partition.as_str()),
                    DatumWithOid::from(keys.clone()),
                    DatumWithOid::from(owner.as_str()),
                    DatumWithOid::from(at),
                ],
            )?
            .map(|row| Ok(row.get::<String>(1)?.unwrap_or_default()))
            .collect()
        })?;
        Ok(in_order(&keys, &changed))
    })
}

/// One element of `fail_reactions`' array, validated.
struct Failure {
    key: String,
    /// The kept failure object's compact text.
    failure: String,
    at: i64,
    retry: Option<i64>,
}

fn failure_item(node: Node<'_>, i: usize) -> Result<Failure> {
    let at = |key: &str| format!("failures[{i}].{key}");
    let element = || Error::invalid_argument(&format!("failures[{i}]"), "type");
    let Node::Object(obj) = node else {
        return Err(element());
    };
    let [key, failure, retry] = obj
        .fields(["idempotencyKey", "failure", "retryAtMs"])
        .map_err(|_| element())?;
    let key = jsonb::string_field(key, true)
        .map_err(|reason| Error::invalid_argument(&at("idempotencyKey"), reason))?;
    let (failure, at_ms) = decode_failure(failure, &at("failure"))?;
    let retry = jsonb::integer_field(retry, (0, MAX_SAFE))
        .map_err(|reason| Error::invalid_argument(&at("retryAtMs"), reason))?;
    Ok(Failure {
        key: key.to_string(),
        failure,
        at: at_ms,
        retry,
    })
}

/// Batch `fail_reaction` with the runner's retry cap applied in the same statement
/// (docs/API.md §Reactions): each element fails one reaction still leased by `lease_owner`;
/// with `retryAtMs` it becomes `pending` at that time unless its attempts reached
/// `maxAttempts`, in which case (or without `retryAtMs`) it becomes `dead-letter`. Returns
/// `{"pending": [keys], "deadLetter": [keys]}` in the order given; bad input changes nothing.
#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn fail_reactions(
    partition: Option<&str>,
    lease_owner: Option<&str>,
    failures: Option<JsonbArg>,
) -> JsonB {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let owner = args::text("lease_owner", lease_owner)?;
        let items = args::with_jsonb("failures", failures, |root| {
            let Node::Array(items) = root else {
                return Err(Error::invalid_argument("failures", "type"));
            };
            if items.len() > limits::ARRAY_ELEMENTS {
                return Err(Error::invalid_argument("failures", "too_large"));
            }
            items
                .children()
                .enumerate()
                .map(|(i, f)| {
                    failure_item(
                        f.map_err(|_| Error::invalid_argument("failures", "type"))?,
                        i,
                    )
                })
                .collect::<Result<Vec<_>>>()
        })?;
        let mut seen = HashSet::new();
        if let Some(i) = items.iter().position(|f| !seen.insert(f.key.as_str())) {
            return Err(Error::invalid_argument(
                &format!("failures[{i}].idempotencyKey"),
                "duplicate",
            )
            .with_hint(format!("the key {:?} is listed twice", items[i].key)));
        }
        let keys: Vec<String> = items.iter().map(|f| f.key.clone()).collect();
        let (mut texts, mut ats, mut retries) = (Vec::new(), Vec::new(), Vec::new());
        for f in items {
            texts.push(f.failure);
            ats.push(f.at);
            retries.push(f.retry);
        }
        let (mut pending, mut dead) = (HashSet::new(), HashSet::new());
        db::with_spi(|client| {
            // The kept generic plan, as in `complete_reactions`.
            let table = db::write_generic(
                client,
                "WITH f AS (
                   SELECT * FROM ROWS FROM (pg_catalog.unnest($3::text[]),
                          pg_catalog.unnest($4::text[]), pg_catalog.unnest($5::bigint[]),
                          pg_catalog.unnest($6::bigint[])) AS f(key, failure, at, retry)
                 )
                 UPDATE syncular.sync_reactions r
                    SET status = CASE WHEN f.retry IS NULL OR r.attempts >= r.max_attempts
                                      THEN 'dead-letter' ELSE 'pending' END,
                        available_at_ms = CASE WHEN f.retry IS NULL OR r.attempts >= r.max_attempts
                                               THEN f.at ELSE f.retry END,
                        last_failure = f.failure::jsonb, lease_owner = NULL,
                        lease_expires_at_ms = NULL
                   FROM f
                  WHERE r.partition = $1 AND r.idempotency_key = ANY($3)
                    AND r.idempotency_key = f.key COLLATE \"C\"
                    AND r.status = 'leased' AND r.lease_owner = $2
                 RETURNING r.idempotency_key, r.status",
                &[
                    DatumWithOid::from(partition.as_str()),
                    DatumWithOid::from(owner.as_str()),
                    DatumWithOid::from(keys.clone()),
                    DatumWithOid::from(texts),
                    DatumWithOid::from(ats),
                    DatumWithOid::from(retries),
                ],
            )?;
            for row in table {
                let key = row.get::<String>(1)?.unwrap_or_default();
                match row.get::<String>(2)?.as_deref() {
                    Some("pending") => pending.insert(key),
                    _ => dead.insert(key),
                };
            }
            Ok(())
        })?;
        Ok(JsonB(json!({
            "pending": in_order(&keys, &pending),
            "deadLetter": in_order(&keys, &dead),
        })))
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn retry_reaction(
    partition: Option<&str>,
    idempotency_key: Option<&str>,
    now_ms: Option<i64>,
) -> bool {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let key = args::text("idempotency_key", idempotency_key)?;
        let now = args::count("now_ms", now_ms)?;
        db::changed(
            "UPDATE syncular.sync_reactions
                SET status = 'pending', attempts = 0, available_at_ms = $3, last_failure = NULL,
                    lease_owner = NULL, lease_expires_at_ms = NULL, completed_at_ms = NULL
              WHERE partition = $1 AND idempotency_key = $2 AND status = 'dead-letter'
             RETURNING 1",
            &[partition.as_str().into(), key.as_str().into(), now.into()],
        )
    })
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
    statuses: default!(Option<Array<&str>>, "NULL"),
    types: default!(Option<Array<&str>>, "NULL"),
) -> OwnedJsonb {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let lim = args::row_limit("lim", lim)?;
        let filter = |name: &str, v: Option<Array<&str>>| -> Result<Option<Vec<String>>> {
            Ok(v.map(|v| args::text_array(name, Some(v)))
                .transpose()?
                .filter(|v| !v.is_empty()))
        };
        let statuses = filter("statuses", statuses)?;
        let types = filter("types", types)?;
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
                    statuses.into(),
                    types.into(),
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

/// In-backend tests (`cargo pgrx test`): the two ways rows enter the outbox.
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::*;
    use crate::testing::any_json;
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    use serde_json::Value as Json;

    /// A reaction array: keys from a small pool (so later arrays meet stored keys and repeat
    /// their own), any JSON inside the payloads, optional `maxAttempts`.
    fn reactions() -> impl Strategy<Value = Json> {
        let reaction = (
            prop_oneof![1 => "k[0-9]{1,2}", 6 => "[^\u{0}]{1,16}"],
            "[A-Za-z][A-Za-z0-9._:-]{0,12}",
            1i64..5,
            prop_oneof![
                any_json().prop_map(|v| json!({ "v": v, "n": [1, 2.5, "x"] })),
                prop::collection::vec(any_json(), 0..4).prop_map(Json::Array),
            ],
            ("[a-z0-9]{1,8}", "[a-z0-9-]{1,12}", 0i64..1_000_000_000_000),
            (0i64..MAX_SAFE, prop::option::of(1i64..=100)),
        )
            .prop_map(
                |(key, kind, version, payload, (client, commit, seq), (at, max))| {
                    let mut r = json!({ "idempotencyKey": key, "type": kind, "version": version,
                    "payload": payload, "sourceClientId": client, "sourceClientCommitId": commit,
                    "sourceCommitSeq": seq, "createdAtMs": at });
                    if let Some(max) = max {
                        r["maxAttempts"] = json!(max);
                    }
                    r
                },
            );
        prop::collection::vec(reaction, 1..6).prop_map(Json::Array)
    }

    /// The outcome of enqueuing `doc` into `partition`, caught in a subtransaction: the count,
    /// or the error's SQLSTATE, message and DETAIL.
    fn outcome(partition: &str, doc: &str) -> String {
        Spi::get_one_with_args::<String>(
            "SELECT public.syncular_test_try_enqueue($1, $2::jsonb)",
            &[partition.into(), doc.into()],
        )
        .unwrap()
        .unwrap()
    }

    fn stored(partition: &str) -> Vec<String> {
        Spi::connect(|client| {
            client
                .select(
                    "SELECT pg_catalog.concat_ws(' | ', idempotency_key, type, version, payload::text,
                            source_client_id, source_client_commit_id, source_commit_seq,
                            created_at_ms, available_at_ms, status, attempts, max_attempts,
                            lease_owner, lease_expires_at_ms, completed_at_ms, last_failure::text)
                       FROM syncular.sync_reactions WHERE partition = $1 ORDER BY idempotency_key",
                    None,
                    &[partition.into()],
                )
                .unwrap()
                .map(|row| row.get::<String>(1).unwrap().unwrap())
                .collect()
        })
    }

    /// Fifteen hundred generated arrays enqueued twice: below SQL, then by the statement (a
    /// trigger on the table makes `DirectInsert::open` refuse it). Every call ends alike (count,
    /// or the same error: a duplicate names the same first stored key) and the stored rows are
    /// equal column by column.
    #[pg_test]
    fn direct_and_statement_enqueues_agree() {
        Spi::run(
            "CREATE FUNCTION public.syncular_test_try_enqueue(p text, r jsonb) RETURNS text
             LANGUAGE plpgsql AS $$
             DECLARE state text; message text; detail text;
             BEGIN
               RETURN syncular.enqueue_reactions(p, r)::text;
             EXCEPTION WHEN others THEN
               GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, message = MESSAGE_TEXT,
                                       detail = PG_EXCEPTION_DETAIL;
               RETURN state || ' ' || message || ' ' || detail;
             END $$;
             CREATE FUNCTION public.syncular_test_rows() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN RETURN NEW; END $$",
        )
        .unwrap();
        let mut runner = TestRunner::deterministic();
        let strategy = reactions();
        let docs: Vec<String> = (0..1500)
            .map(|_| {
                strategy
                    .new_tree(&mut runner)
                    .unwrap()
                    .current()
                    .to_string()
            })
            .collect();
        let direct_open = || {
            DirectInsert::open(SyncTable::Reactions, REACTION_COLUMNS)
                .unwrap()
                .is_some()
        };
        assert!(
            direct_open(),
            "the data model's table is inserted below SQL"
        );
        let direct: Vec<String> = docs.iter().map(|d| outcome("direct", d)).collect();
        Spi::run(
            "CREATE TRIGGER syncular_test_rows BEFORE INSERT ON syncular.sync_reactions
             FOR EACH ROW EXECUTE FUNCTION public.syncular_test_rows()",
        )
        .unwrap();
        assert!(
            !direct_open(),
            "a trigger sends the rows through the statement"
        );
        let statement: Vec<String> = docs.iter().map(|d| outcome("statement", d)).collect();
        for (i, (d, s)) in direct.iter().zip(&statement).enumerate() {
            assert_eq!(d, s, "array {i}: {}", docs[i]);
        }
        assert!(
            direct.iter().any(|o| o.starts_with("SY050")),
            "duplicates were met"
        );
        assert!(direct.iter().filter(|o| o.parse::<i32>().is_ok()).count() > 500);
        let rows = stored("direct");
        assert!(rows.len() > 1000, "{} rows", rows.len());
        assert_eq!(rows, stored("statement"));
    }

    /// A CHECK constraint a DBA adds is enforced below SQL as by the statement (23514, nothing
    /// of the array kept).
    #[pg_test]
    fn check_constraints_hold_below_sql() {
        Spi::run(
            "ALTER TABLE syncular.sync_reactions
               ADD CONSTRAINT syncular_test_short_types CHECK (length(type) < 6)",
        )
        .unwrap();
        let doc = |kind: &str| {
            json!([{ "idempotencyKey": format!("c-{kind}"), "type": kind, "version": 1,
                "payload": {}, "sourceClientId": "c1", "sourceClientCommitId": "k",
                "sourceCommitSeq": 1, "createdAtMs": 1 }])
            .to_string()
        };
        assert!(DirectInsert::open(SyncTable::Reactions, REACTION_COLUMNS)
            .unwrap()
            .is_some());
        let ok = Spi::get_one_with_args::<i32>(
            "SELECT syncular.enqueue_reactions('c', $1::jsonb)",
            &[doc("short").into()],
        );
        assert_eq!(ok, Ok(Some(1)));
        let refused = PgTryBuilder::new(|| {
            Spi::get_one_with_args::<i32>(
                "SELECT syncular.enqueue_reactions('c', $1::jsonb)",
                &[doc("longer").into()],
            )
            .map(|_| "inserted".to_string())
            .unwrap_or_else(|e| e.to_string())
        })
        .catch_others(|e| match e {
            pg_sys::panic::CaughtError::PostgresError(report) => {
                format!("{:?} {}", report.sql_error_code(), report.message())
            }
            _ => "other".into(),
        })
        .execute();
        assert!(
            refused.contains("ERRCODE_CHECK_VIOLATION")
                && refused.contains("syncular_test_short_types"),
            "{refused}"
        );
    }
}
