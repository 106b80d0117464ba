//! The one-call push (docs/DESIGN.md §Push path, docs/API.md `push_commit`): a whole commit of
//! upstream's default push path in one call — partition lock, gate, idempotency, the
//! per-operation decisions in upstream's order (row codec, scope authorization, column versions,
//! conflicts, tombstones, blob references), the app-row writes, the row scope index, the commit
//! append and the push result — with results and stored bytes identical to what the classic
//! multi-call path stores for a correct host.
//!
//! Who acts (docs/SECURITY.md, rules 1 and 10): the function is SECURITY INVOKER so that it
//! knows its caller. Statements over `sync_*` tables run as the extension owner; app rows are
//! read and written as the **caller** in a restricted security context, through
//! [`tables::AppRelation`] after `tables::open` re-checked the registration, so host
//! privileges, row-level security and triggers behave as if the host had written the rows.
//!
//! Where upstream would call host code (validators, CRDT mergers, blob stores, references,
//! commit validators, reaction planners), the call stops and returns `outcome: "fallback"`
//! without a durable trace: the candidate writes live in an internal subtransaction that is
//! rolled back, as it is for every rejection.

use super::append::{self, Header};
use super::context::Context;
use super::open::{changed_registration, open_tables};
use super::outcome::{error_record, fallback_doc, Stop};
use super::request::{allowed_arg, operations, Operation, Options, Request};
use super::result;
use super::stage;
use super::subtransaction::{in_subtransaction, integrity_violation, worth_repeating};
use crate::access;
use crate::args::{self, JsonArg};
use crate::db;
use crate::error::{self, Error, Result};
use crate::gate;
use crate::jsonb::OwnedJsonb;
use crate::log;
use crate::push_guard;
use pgrx::datum::Array;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use serde_json::{json, Value};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::panic::resume_unwind;

/// The replay of a stored result (steps C1/C4).
fn replay(stored: Value, at: &str) -> Value {
    let applied = stored["status"] == "applied";
    let mut out = json!({"outcome": if applied { "cached" } else { "rejected" },
                         "replayed": true, "at": at});
    if applied {
        out["commitSeq"] = stored["commitSeq"].clone();
    }
    out["result"] = stored;
    out
}

/// What ended a failed run, for the DEBUG1 line of a repeated push.
fn failure<R>(outcome: &std::thread::Result<Result<R>>) -> String {
    match outcome {
        Ok(Err(e)) => format!("{e:?}"),
        Err(panic) => error::postgres_report(panic.as_ref())
            .map_or_else(|| "a panic".into(), |report| report.message().to_string()),
        Ok(Ok(_)) => String::new(),
    }
}

/// `(table, row_id)` of the rows more than one operation touches.
fn repeated_rows<'a>(ops: &[Operation<'a>]) -> HashSet<(&'a str, &'a str)> {
    let mut seen = HashSet::new();
    let mut repeated = HashSet::new();
    for op in ops {
        crate::interrupts::check();
        let key = (op.table, op.row_id);
        if !seen.insert(key) {
            repeated.insert(key);
        }
    }
    repeated
}

/// A version-4 UUID from PostgreSQL's strong random source, as `gen_random_uuid()` makes it
/// (the default `cacheIdentity`), without a statement. The source is asked for 32 UUIDs' bytes
/// at a time, kept in this backend only: each call of it costs as much as the rest of a UUID
/// (OpenSSL checks its state first; docs/BENCHMARKS.md, issue 28), and its bytes are as random
/// taken 16 at a time as 512.
fn random_uuid() -> Result<String> {
    const BATCH: usize = 512;
    thread_local! {
        static BYTES: std::cell::RefCell<([u8; BATCH], usize)> =
            const { std::cell::RefCell::new(([0; BATCH], BATCH)) };
    }
    let mut bytes = [0u8; 16];
    BYTES.with_borrow_mut(|(batch, used)| {
        if *used == BATCH {
            // SAFETY: fills exactly the bytes of the buffer; returns false when no source works.
            if !unsafe { pg_sys::pg_strong_random(batch.as_mut_ptr().cast(), BATCH) } {
                return Err(Error::Internal(
                    "syncular: could not generate random values".into(),
                ));
            }
            *used = 0;
        }
        let taken = &mut batch[*used..*used + 16];
        bytes.copy_from_slice(taken);
        // Handed out once: a UUID's bytes do not stay behind in the batch.
        taken.fill(0);
        *used += 16;
        Ok(())
    })?;
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(36);
    for (i, b) in bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            out.push('-');
        }
        out.push(HEX[usize::from(b >> 4)] as char);
        out.push(HEX[usize::from(b & 0x0f)] as char);
    }
    Ok(out)
}

/// The whole push after the arguments were read; runs as the extension owner.
fn push(client: &SpiClient<'_>, caller: pg_sys::Oid, request: &Request<'_>) -> Result<Value> {
    let [partition, ..] = request.key;
    // C1: the optimistic replay check, without lock or gate.
    let (stored, seen) = result::stored_result_seen(client, &request.key, false, None)?;
    if let Some(stored) = stored {
        return Ok(replay(stored, "optimistic"));
    }
    // What C1 saw lets C4 skip its lookup only where this transaction had written nothing: a
    // result it stored itself, earlier, is in no fingerprint (`heap::nothing_written_yet`).
    let seen = seen.filter(|_| crate::heap::nothing_written_yet());
    // C2: the partition lock, before any app table is opened (and locked to the end of the
    // transaction): a push that held an app table's lock while it waited for a migration's
    // barrier would deadlock with the migration's DDL on that table (red team 13;
    // docs/DESIGN.md §Lock order).
    log::lock(client, partition)?;
    // What the registrations are read with from here sees at least this (src/push/open.rs).
    // SAFETY: the snapshot is registered around the closure.
    let before_open =
        crate::heap::with_snapshot(false, |s| Ok(unsafe { crate::heap::seen_by(s) }))?;
    let tables = match open_tables(client, request)? {
        Ok(tables) => tables,
        Err(Stop::Fallback(doc)) => return Ok(doc),
        Err(Stop::Rejected(_) | Stop::Staged) => unreachable!("static checks only fall back"),
    };
    // A registration read before this call's snapshot was taken may have changed while it
    // waited for the lock (red team 11, C1): read again with a fresh one.
    if let Some(tbl) = changed_registration(client, &tables, before_open.as_ref())? {
        let at = request.ops.iter().position(|op| op.table == tbl);
        return Ok(fallback_doc(
            "schema_not_registered",
            at.map(|k| (k, tbl.as_str())),
        ));
    }
    // C3, C4: the gate under the lock, the locked re-check.
    gate::read_state(client, Some(partition), request.running, true)?
        .assert_ready(request.running, &request.declared)?;
    // Not looked up again where no other transaction ended since C1 read nothing.
    let (stored, _) = result::stored_result_seen(client, &request.key, true, seen.as_ref())?;
    if let Some(stored) = stored {
        return Ok(replay(stored, "locked"));
    }
    let repeated = repeated_rows(&request.ops);
    // A batched run that fails is run again statement by statement (src/push/batch.rs), so
    // which error, rejection or fallback comes first is always upstream's.
    let mut batching = true;
    let (stop, changes, evidence) = loop {
        let context = Context {
            client,
            caller,
            partition,
            allowed: &request.allowed,
            options: &request.options,
            tables: &tables,
            upserting: Cell::new(None),
            evidence: (request.options.stage
                && (request.options.commit_validator || request.options.reaction_planner))
                .then(|| RefCell::new(Vec::with_capacity(request.ops.len()))),
            batching,
            repeated: &repeated,
            batch_tables: RefCell::new(HashSet::new()),
            prefetched: RefCell::new(HashMap::new()),
            pending: RefCell::new(BTreeMap::new()),
            batched: Cell::new(false),
        };
        let mut changes = Vec::new();
        let outcome = in_subtransaction(
            || context.run(&request.ops, &mut changes),
            // Staged: the candidate rows stay in the host's transaction for its hooks.
            |r| matches!(r, Ok(None | Some(Stop::Staged))),
        );
        if context.batched.get() && worth_repeating(&outcome) {
            pgrx::debug1!(
                "syncular: push_commit runs its operations again without batches after: {}",
                failure(&outcome)
            );
            batching = false;
            continue;
        }
        let stop = match outcome {
            Ok(Ok(None)) => None,
            Ok(Ok(Some(stop))) => Some(stop),
            Ok(Err(e)) => return Err(e),
            Err(panic) => match context.upserting.get() {
                Some(k) if integrity_violation(panic.as_ref()) => {
                    Some(Stop::Rejected(error_record(
                        k,
                        "sync.constraint_violation",
                        "write violates a relational constraint",
                    )))
                }
                _ => resume_unwind(panic),
            },
        };
        break (stop, changes, context.evidence.map(RefCell::into_inner));
    };
    let identity = match &request.options.cache_identity {
        Some(identity) => identity.clone(),
        None => random_uuid()?,
    };
    let header = Header {
        key: request.key,
        actor_id: request.actor_id,
        created_at_ms: request.created_at_ms,
        running: request.running,
        identity: &identity,
        return_changes: request.options.return_changes,
    };
    match stop {
        None => {
            let appended = append::append(client, &header, changes)?;
            append::store_applied(client, &header, request.ops.len(), appended)
        }
        Some(Stop::Staged) => {
            stage::save(&header, request.ops.len(), &changes);
            Ok(json!({"outcome": "staged", "operations": evidence.unwrap_or_default()}))
        }
        Some(Stop::Fallback(doc)) => Ok(doc),
        Some(Stop::Rejected(record)) => {
            // C9: only the rejection is stored; no commit_seq is consumed.
            let document = json!({"status": "rejected", "results": [record],
                                  "recordedAtMs": request.created_at_ms, "cacheIdentity": identity});
            let canonical = result::store_result(client, &request.key, document)?.document;
            Ok(append::finished(canonical, &identity, None))
        }
    }
}

/// SECURITY INVOKER: the app rows are written as the caller (module comment).
#[allow(clippy::too_many_arguments)]
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.push_commit(
  partition text, client_id text, client_commit_id text, actor_id text, created_at_ms bigint,
  running_schema_version bigint, allowed jsonb,
  op_tables text[], op_row_ids text[], op_kinds smallint[], op_base_versions bigint[],
  op_payloads bytea[], declared jsonb DEFAULT '[]', options jsonb DEFAULT '{}') RETURNS jsonb
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'push_commit_wrapper';
"#
)]
fn push_commit(
    partition: Option<&str>,
    client_id: Option<&str>,
    client_commit_id: Option<&str>,
    actor_id: Option<&str>,
    created_at_ms: Option<i64>,
    running_schema_version: Option<i64>,
    allowed: Option<JsonArg>,
    op_tables: Option<args::TextArray>,
    op_row_ids: Option<args::TextArray>,
    op_kinds: Option<Array<i16>>,
    op_base_versions: Option<Array<i64>>,
    op_payloads: Option<Array<&[u8]>>,
    declared: Option<JsonArg>,
    options: Option<JsonArg>,
) -> OwnedJsonb {
    error::run(|| {
        let partition = args::text_ref("partition", partition)?;
        let client_id = args::text_ref("client_id", client_id)?;
        let client_commit_id = args::text_ref("client_commit_id", client_commit_id)?;
        let actor_id = args::text_ref("actor_id", actor_id)?;
        let created_at_ms = args::count("created_at_ms", created_at_ms)?;
        // A schema version is 1 or more (upstream's wire rule); 0 would mean "never migrated".
        let running = args::at_least("running_schema_version", running_schema_version, 1)?;
        let allowed = allowed_arg(args::optional_json("allowed", allowed)?)?;
        let declared = args::declarations(declared)?;
        let options = Options::parse(args::optional_json("options", options)?)?;
        let ops = operations(
            op_tables.as_ref(),
            op_row_ids.as_ref(),
            op_kinds.as_ref(),
            op_base_versions.as_ref(),
            op_payloads.as_ref(),
        )?;
        if !crate::heap::read_committed() {
            return Err(Error::invalid_transaction_state("isolation"));
        }
        // A staged push stands until push_finish or a rollback: no push may run over its
        // candidate rows (src/push_guard.rs); on Citus, the transaction block pushes to one
        // partition (src/citus/one_partition.rs).
        crate::citus::one_partition::require(partition)?;
        push_guard::check_nothing_staged()?;
        // A staged push leaves candidate rows for push_finish: in autocommit they would be
        // committed with no commit appended.
        // SAFETY: reads backend state of the current transaction; never errors.
        if options.stage && !unsafe { pg_sys::IsTransactionBlock() } {
            return Err(Error::invalid_transaction_state("no_transaction_block"));
        }
        let request = Request {
            key: [partition, client_id, client_commit_id],
            actor_id,
            created_at_ms,
            running,
            allowed,
            ops,
            declared,
            options,
        };
        let caller = access::current_role();
        let answer =
            db::with_spi(|client| access::as_extension_owner(|| push(client, caller, &request)))?;
        crate::jsonb::owned(&answer)
    })
}

/// In-backend tests (`cargo pgrx test`).
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    /// The default `cacheIdentity`: version-4 UUIDs in `gen_random_uuid()`'s text form, none
    /// repeated across several of the source's batches, read back by PostgreSQL's own parser.
    #[pg_test]
    fn default_cache_identities_are_distinct_version_4_uuids() {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let uuid = super::random_uuid().unwrap();
            let bytes = uuid.as_bytes();
            assert_eq!(bytes.len(), 36, "{uuid}");
            assert!([8, 13, 18, 23].iter().all(|&i| bytes[i] == b'-'), "{uuid}");
            assert_eq!(bytes[14], b'4', "{uuid}");
            assert!(b"89ab".contains(&bytes[19]), "{uuid}");
            let parsed =
                Spi::get_one_with_args::<String>("SELECT $1::uuid::text", &[uuid.as_str().into()]);
            assert_eq!(parsed.unwrap().as_deref(), Some(uuid.as_str()));
            assert!(seen.insert(uuid));
        }
    }
}
