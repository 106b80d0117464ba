//! `enqueue_reactions`: the reactions of a commit validated in the argument's binary form and
//! written below SQL, or by one statement where the table needs one (docs/DESIGN.md §8,
//! "Enqueue").

use super::{MAX_DEPTH, MAX_PAYLOAD_BYTES, MAX_TYPE_BYTES};
use crate::args;
use crate::args::MAX_SAFE;
use crate::db;
use crate::error::Code;
use crate::error::{self, Error, Result};
use crate::heap::{DirectInsert, SyncTable, Value as Cell};
use crate::jsonb::{self, Bounds, JsonbArg, Node, RawJsonb, Reason};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::PgSqlErrorCode;
use serde_json::json;
use std::collections::HashSet;
use std::ffi::CStr;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

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

/// The key a unique violation of `sync_reactions`' primary key reports, among `rows`' keys. Its
/// DETAIL renders the key as `(partition, idempotency_key)=(<partition>, <key>)` (PostgreSQL's
/// index value description, built without translation). Another key's rendering can occur in
/// it only inside the reported one (a key that contains `=(<partition>, <other>)`), so the
/// longest key whose rendering it contains is the reported one. Anything else (another error,
/// no DETAIL) is not ours to rename.
fn existing_key<'k>(
    panic: &(dyn std::any::Any + Send),
    partition: &str,
    rows: &[NewReaction<'k>],
) -> Option<&'k str> {
    let report = error::postgres_report(panic)?;
    if report.sql_error_code() != PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION {
        return None;
    }
    let detail = report.detail()?;
    rows.iter()
        .map(|r| r.key)
        .filter(|key| {
            crate::interrupts::check();
            detail.contains(&format!("=({partition}, {key})"))
        })
        .max_by_key(|key| key.len())
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
            crate::interrupts::check();
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
    // Rows in array order either way: the unique check waits for an uncommitted insert of the
    // same key by another transaction and then fails at the first element whose key exists,
    // which is the one to name (docs/DESIGN.md §8, "Enqueue").
    let inserted = catch_unwind(AssertUnwindSafe(|| {
        match DirectInsert::open(SyncTable::Reactions, partition, REACTION_COLUMNS)? {
            Some(mut table) => insert_direct(&mut table, partition, &rows),
            None => insert_statement(partition, &rows),
        }
    }));
    match inserted {
        Ok(done) => done.map(|()| count as i32),
        Err(panic) => match existing_key(panic.as_ref(), partition, &rows) {
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
        crate::interrupts::check();
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
/// Every column is given, as [`insert_direct`] gives it, so a column default set later changes
/// neither path.
fn insert_statement<'a>(partition: &str, rows: &[NewReaction<'a>]) -> Result<()> {
    let column = |f: fn(&NewReaction<'a>) -> &'a str| rows.iter().map(f).collect::<Vec<_>>();
    db::with_spi(|client| {
        db::write_generic(
            client,
            "INSERT INTO syncular.sync_reactions
               (partition, idempotency_key, type, version, payload, source_client_id,
                source_client_commit_id, source_commit_seq, created_at_ms,
                available_at_ms, status, attempts, max_attempts, lease_owner,
                lease_expires_at_ms, completed_at_ms, last_failure)
             SELECT $1, pg_catalog.unnest($2::text[]), pg_catalog.unnest($3::text[]),
                    pg_catalog.unnest($4::integer[]),
                    pg_catalog.unnest($5::jsonb[]),
                    pg_catalog.unnest($6::text[]), pg_catalog.unnest($7::text[]),
                    pg_catalog.unnest($8::bigint[]), pg_catalog.unnest($9::bigint[]),
                    pg_catalog.unnest($9::bigint[]), 'pending', 0,
                    pg_catalog.unnest($10::integer[]), NULL, NULL, NULL, NULL",
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

    /// `public.syncular_test_try_enqueue(partition, reactions)`: [`outcome`]'s subtransaction;
    /// `public.syncular_test_rows()`: a trigger function that sends rows through the statement.
    fn test_functions() {
        // Every test calling this adds a trigger or a constraint to `sync_reactions`.
        crate::testing::lock_for_ddl("syncular.sync_reactions");
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
    }

    fn direct_open() -> bool {
        DirectInsert::open(SyncTable::Reactions, "p", REACTION_COLUMNS)
            .unwrap()
            .is_some()
    }

    /// From here on, rows go through the statement.
    fn add_trigger() {
        Spi::run(
            "CREATE TRIGGER syncular_test_rows BEFORE INSERT ON syncular.sync_reactions
             FOR EACH ROW EXECUTE FUNCTION public.syncular_test_rows()",
        )
        .unwrap();
        assert!(
            !direct_open(),
            "a trigger sends the rows through the statement"
        );
    }

    fn one(key: &str, kind: &str) -> String {
        json!([{ "idempotencyKey": key, "type": kind, "version": 1, "payload": {},
            "sourceClientId": "c1", "sourceClientCommitId": "k", "sourceCommitSeq": 1,
            "createdAtMs": 1 }])
        .to_string()
    }

    /// Fifteen hundred generated arrays enqueued twice: below SQL, then by the statement (a
    /// trigger on the table makes `DirectInsert::open` refuse it). Every call ends alike (count,
    /// or the same error: a duplicate names the same first stored key) and the stored rows are
    /// equal column by column.
    #[pg_test]
    fn direct_and_statement_enqueues_agree() {
        test_functions();
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
        assert!(
            direct_open(),
            "the data model's table is inserted below SQL"
        );
        let direct: Vec<String> = docs.iter().map(|d| outcome("direct", d)).collect();
        add_trigger();
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

    /// A CHECK constraint a DBA adds is enforced below SQL as by the statement: the same
    /// SQLSTATE (23514), message and DETAIL (the failing row), nothing of the array kept.
    #[pg_test]
    fn check_constraints_hold_below_sql() {
        test_functions();
        Spi::run(
            "ALTER TABLE syncular.sync_reactions
               ADD CONSTRAINT syncular_test_short_types CHECK (length(type) < 6)",
        )
        .unwrap();
        assert!(direct_open(), "CHECK constraints are evaluated below SQL");
        assert_eq!(outcome("d", &one("a", "short")), "1");
        let direct = outcome("d", &one("b", "longer"));
        add_trigger();
        assert_eq!(outcome("s", &one("a", "short")), "1");
        let statement = outcome("d", &one("b", "longer"));
        assert!(
            direct.starts_with("23514 ") && direct.contains("syncular_test_short_types"),
            "{direct}"
        );
        // The DETAIL's first line: with RUST_BACKTRACE set, pgrx appends the Rust stack to a
        // PostgreSQL error it carried, which differs between the two paths.
        let first = |outcome: &str| outcome.lines().next().unwrap_or_default().to_string();
        assert!(
            first(&direct).contains("Failing row contains (d, b, longer"),
            "{direct}"
        );
        assert_eq!(first(&direct), first(&statement));
    }

    /// In a read-only transaction the rows are not written below SQL: the statement refuses
    /// them (25006), as it always did.
    #[pg_test]
    fn read_only_transactions_refuse_the_enqueue() {
        test_functions();
        Spi::run("SET LOCAL transaction_read_only = on").unwrap();
        assert!(
            !direct_open(),
            "no direct insert in a read-only transaction"
        );
        let refused = outcome("r", &one("a", "email"));
        assert!(refused.starts_with("25006 "), "{refused}");
    }
}
