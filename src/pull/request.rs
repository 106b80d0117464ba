//! The one-call pull (docs/API.md §Pull, `pull`; docs/DESIGN.md §Pull path): a whole pull
//! request of one partition — the gate, the client record, every subscription's window or
//! bootstrap page, the registry touch and the client record's new cursor — in one call and one
//! snapshot, with the decisions of the classic path (upstream's pull driver; docs/DESIGN.md §Pull path):
//!
//! - revoked (the host resolved no effective scopes): nothing read, the cursor echoed;
//! - reset (no usable bootstrap token and `0 <= cursor < horizon`): nothing read, echoed;
//! - incremental (no token, `horizon <= cursor <= maxCommitSeq`): the commit window after the
//!   cursor through `maxCommitSeq` with `limitCommits + 1` changes, cut by the delivery rule;
//! - bootstrap (a token, or a cursor below 0 or past `maxCommitSeq`): up to `maxSnapshotPages`
//!   pages of `limitSnapshotRows` current rows, pinned at the token's `asOfCommitSeq` when it is
//!   not behind the horizon, else at `maxCommitSeq`.
//!
//! Every read runs before any write, in the caller's snapshot (plans that write nothing), so the
//! gate, the bounds, the client record and every window share one snapshot; then one statement
//! touches the registry and writes the client record. SECURITY INVOKER: a bootstrap reads app
//! tables, which needs the caller's identity ([`tables::open_for_read`], docs/SECURITY.md); the
//! `sync_*` statements run with the extension owner's rights.

use super::bootstrap::{self, ScanRow};
use super::budget::Budget;
use super::record;
use super::window::{self, deliver, Path, WindowRow};
use crate::access;
use crate::args::{self, json_int, IntProblem, MAX_SAFE};
use crate::clients;
use crate::db;
use crate::error::{self, Error, Result};
use crate::gate::{self, SchemaState};
use crate::jsonb::OwnedJsonb;
use crate::limits;
use crate::materialized;
use crate::scope::{self, Filter};
use crate::tables;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use serde_json::{json, Map, Value};

/// Everything the request reads besides the windows, in one statement: the gate's state, the
/// partition's bounds, the client record, and which of the subscriptions' tables (`$4`) have no
/// registration.
const HEAD_SQL: &str = "\
SELECT coalesce(m.schema_version, 0),
       r.log_epoch,
       coalesce((SELECT jsonb_agg(jsonb_build_array(c.partition, c.name)
                                  ORDER BY c.partition, c.name)
                   FROM syncular.sync_backfill_checkpoints c
                  WHERE c.schema_version = $2 AND c.state <> 'activated'), '[]'::jsonb),
       coalesce(p.max_commit_seq, 0), coalesce(p.horizon_seq, 0),
       cl.actor_id, cl.cursor,
       (SELECT pg_catalog.array_agg(t.tbl ORDER BY t.n) FROM unnest($4::text[]) WITH ORDINALITY AS t(tbl, n)
         WHERE NOT EXISTS (SELECT 1 FROM syncular.sync_app_tables a WHERE a.tbl = t.tbl)),
       r.epoch_required
  FROM (SELECT 1) AS one
  LEFT JOIN syncular.sync_partition_registry r ON r.partition = $1
  LEFT JOIN syncular.sync_schema_meta m ON m.id = 1
  LEFT JOIN syncular.sync_partitions p ON p.partition = $1
  LEFT JOIN syncular.sync_clients cl ON cl.partition = $1 AND cl.client_id = $3";

/// A bootstrap token as upstream writes it (`{"asOfCommitSeq", "tables", "tableIndex",
/// "rowCursor"}`), when it is usable for the subscription's table.
struct Token {
    as_of: i64,
    row_cursor: Option<String>,
}

/// Upstream's reading of a token (`parseBootstrapToken`): anything malformed, or a token of
/// another table, counts as no token. Also unusable here: an `asOfCommitSeq` that is not an
/// integer within ±(2^53 − 1), a `rowCursor` longer than a key (docs/API.md, `pull`).
fn token(raw: Option<&str>, table: &str) -> Option<Token> {
    let Value::Object(t) = serde_json::from_str::<Value>(raw?).ok()? else {
        return None;
    };
    let as_of = json_int(t.get("asOfCommitSeq")?).ok()?;
    let first = t.get("tables")?.as_array()?.first()?.as_str()?;
    if first != table || !t.get("tableIndex")?.is_number() {
        return None;
    }
    let row_cursor = match t.get("rowCursor")? {
        Value::Null => None,
        Value::String(s) if s.len() <= limits::KEY_BYTES => Some(s.clone()),
        _ => return None,
    };
    Some(Token { as_of, row_cursor })
}

/// One subscription of the request.
struct Subscription {
    id: String,
    table: String,
    /// The effective scopes the host resolved; `None`: revoked.
    effective: Option<Filter>,
    cursor: i64,
    token: Option<Token>,
}

/// The request's limits, defaulted and clamped as upstream does (`clampPullLimits`).
struct Limits {
    commits: i64,
    snapshot_rows: i64,
    snapshot_pages: i64,
}

fn limit(obj: &Map<String, Value>, key: &str, range: (i64, i64), default: i64) -> Result<i64> {
    let at = format!("request.{key}");
    let value = match obj.get(key) {
        None | Some(Value::Null) => 0,
        Some(v) => match json_int(v) {
            Ok(n) => n,
            Err(IntProblem::Range) => return Err(Error::invalid_argument(&at, "range")),
            Err(IntProblem::Type) => return Err(Error::invalid_argument(&at, "type")),
        },
    };
    Ok(if value == 0 {
        default
    } else {
        value.clamp(range.0, range.1)
    })
}

struct Request {
    subscriptions: Vec<Subscription>,
    /// `[{id, table, scopes}]`: what the client record keeps.
    recorded: Value,
    limits: Limits,
    wire_version: i32,
}

fn parse_request(value: Option<args::JsonArg>) -> Result<Request> {
    let Value::Object(obj) = args::json("request", value)? else {
        return Err(Error::invalid_argument("request", "type"));
    };
    let items = match obj.get("subscriptions") {
        None | Some(Value::Null) => {
            return Err(Error::invalid_argument("request.subscriptions", "missing"))
        }
        Some(Value::Array(items)) => items,
        Some(_) => return Err(Error::invalid_argument("request.subscriptions", "type")),
    };
    if items.len() > limits::PULL_SUBSCRIPTIONS {
        return Err(
            Error::invalid_argument("request.subscriptions", "too_large").with_hint(format!(
                "at most {} subscriptions",
                limits::PULL_SUBSCRIPTIONS
            )),
        );
    }
    // The recorded list is what put_client would store, checked as put_client checks it.
    let recorded: Vec<Value> = items
        .iter()
        .map(|item| match item {
            Value::Object(sub) => {
                crate::interrupts::check();
                let mut kept = Map::new();
                for key in ["id", "table", "scopes"] {
                    if let Some(v) = sub.get(key) {
                        kept.insert(key.into(), v.clone());
                    }
                }
                Value::Object(kept)
            }
            other => other.clone(),
        })
        .collect();
    let recorded = clients::subscriptions(Some(&Value::Array(recorded)), "request.subscriptions")?;
    let mut subscriptions = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        crate::interrupts::check();
        let at = |key: &str| format!("request.subscriptions[{i}].{key}");
        let Value::Object(sub) = item else {
            unreachable!("checked by clients::subscriptions");
        };
        let text = |key: &str| -> Result<String> {
            let value = sub.get(key).and_then(Value::as_str).unwrap_or_default();
            if value.is_empty() {
                return Err(Error::invalid_argument(&at(key), "empty"));
            }
            if value.len() > limits::KEY_BYTES {
                return Err(Error::invalid_argument(&at(key), "too_large"));
            }
            Ok(value.to_string())
        };
        let (id, table) = (text("id")?, text("table")?);
        let effective = match sub.get("effective") {
            None | Some(Value::Null) => None,
            Some(v) => Some(scope::filter_value(&at("effective"), Some(v.clone()))?),
        };
        let cursor =
            args::json_int_field(sub, "cursor", &at("cursor"), (-MAX_SAFE, MAX_SAFE), None)?;
        let raw_token = match sub.get("bootstrapState") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.as_str()),
            Some(_) => return Err(Error::invalid_argument(&at("bootstrapState"), "type")),
        };
        subscriptions.push(Subscription {
            token: token(raw_token, &table),
            id,
            table,
            effective,
            cursor,
        });
    }
    let wire_version = args::json_int_field(
        &obj,
        "wireVersion",
        "request.wireVersion",
        (1, i64::from(i32::MAX)),
        Some(1),
    )? as i32;
    Ok(Request {
        subscriptions,
        recorded,
        limits: Limits {
            commits: limit(&obj, "limitCommits", (1, 1000), 1000)?,
            snapshot_rows: limit(&obj, "limitSnapshotRows", (1, 50_000), 1000)?,
            snapshot_pages: limit(&obj, "maxSnapshotPages", (1, 50), 4)?,
        },
        wire_version,
    })
}

/// What the head statement read.
struct Head {
    state: SchemaState,
    max_seq: i64,
    horizon: i64,
    /// The stored record's actor and cursor.
    client: Option<(String, i64)>,
    /// The subscriptions' tables that have no registration, in request order.
    unregistered: Vec<String>,
    /// The registry entry's `epoch_required`, when the partition has one.
    epoch_required: Option<bool>,
}

fn head(
    client: &SpiClient<'_>,
    partition: &str,
    running: i64,
    client_id: &str,
    request: &Request,
) -> Result<Head> {
    let tables: Vec<&str> = request
        .subscriptions
        .iter()
        .map(|sub| sub.table.as_str())
        .collect();
    head_by(Path::Native, client, partition, running, client_id, &tables)
}

/// [`head`] for the subscriptions' `tables`: below SQL where every table read is on this node
/// (`Path::Native`, [`head_here`]), else — or with `Path::Sql` — [`HEAD_SQL`].
fn head_by(
    path: Path,
    client: &SpiClient<'_>,
    partition: &str,
    running: i64,
    client_id: &str,
    tables: &[&str],
) -> Result<Head> {
    if path == Path::Native {
        if let Some(head) = head_here(partition, running, client_id, tables)? {
            return Ok(head);
        }
    }
    let table = db::read_generic(
        client,
        HEAD_SQL,
        &[
            DatumWithOid::from(partition),
            DatumWithOid::from(running),
            DatumWithOid::from(client_id),
            DatumWithOid::from(tables.to_vec()),
        ],
    )?;
    let row = table.first();
    let actor = row.get::<String>(6)?;
    let cursor = row.get::<i64>(7)?;
    Ok(Head {
        state: SchemaState {
            stored_schema_version: row.get::<i64>(1)?.unwrap_or(0),
            stored_layouts: None,
            log_epoch: row.get::<String>(2)?,
            pending: gate::pending(row.get::<crate::jsonb::JsonValue>(3)?.map(|v| v.0)),
        },
        max_seq: row.get::<i64>(4)?.unwrap_or(0),
        horizon: row.get::<i64>(5)?.unwrap_or(0),
        client: actor.zip(cursor),
        unregistered: row.get::<Vec<String>>(8)?.unwrap_or_default(),
        epoch_required: row.get::<bool>(9)?,
    })
}

/// What [`HEAD_SQL`] reads, read below SQL by primary key (the pending checkpoints through
/// their partial index, `gate::pending_here`) in the snapshot the statement would have
/// (`heap::with_snapshot`): the head statement was a fifth of an idle pull's time in the call
/// (docs/BENCHMARKS.md "Server CPU"). `None` when Citus keeps one of the tables on another
/// node (the statement reads it then).
fn head_here(
    partition: &str,
    running: i64,
    client_id: &str,
    tables: &[&str],
) -> Result<Option<Head>> {
    use crate::heap::{self, Lookup, SyncTable};
    heap::with_snapshot(false, |snapshot| {
        // SAFETY: every key is a datum built here (text in the current memory context, the
        // marker's by value), of its key column's type, alive for its lookup; the snapshot is
        // registered around them.
        unsafe {
            let (marker, one) = heap::singleton_key();
            let schema_version = c"schema_version";
            let Lookup::Here(version, _) = heap::bigint_by_key(
                SyncTable::SchemaMeta,
                marker,
                None,
                one,
                schema_version,
                snapshot,
            )?
            else {
                return Ok(None);
            };
            let key = [heap::text_key(partition)];
            let Lookup::Here(registry, _) = heap::by_primary_key(
                SyncTable::PartitionRegistry,
                Some(partition),
                &key,
                snapshot,
                |row| {
                    row.map(|r| Ok((r.text(c"log_epoch")?, r.boolean(c"epoch_required")?)))
                        .transpose()
                },
            )?
            else {
                return Ok(None);
            };
            let Some(pending) = gate::pending_here(running, snapshot)? else {
                return Ok(None);
            };
            let bounds = [c"max_commit_seq", c"horizon_seq"];
            let Lookup::Here([max_seq, horizon], _) = heap::bigints_by_key(
                SyncTable::Partitions,
                key[0].0,
                Some(partition),
                key[0].1,
                bounds,
                snapshot,
            )?
            else {
                return Ok(None);
            };
            let record_key = [heap::text_key(partition), heap::text_key(client_id)];
            let Lookup::Here(record, _) = heap::by_primary_key(
                SyncTable::Clients,
                Some(partition),
                &record_key,
                snapshot,
                |row| {
                    row.map(|r| Ok(r.text(c"actor_id")?.zip(r.bigint(c"cursor")?)))
                        .transpose()
                },
            )?
            else {
                return Ok(None);
            };
            let mut unregistered = Vec::new();
            for tbl in tables {
                crate::interrupts::check();
                let key = [heap::text_key(tbl)];
                let registered =
                    heap::by_primary_key(SyncTable::AppTables, None, &key, snapshot, |row| {
                        Ok(row.is_some())
                    })?;
                match registered {
                    Lookup::Here(true, _) => {}
                    Lookup::Here(false, _) => {
                        crate::alloc::try_reserve(&mut unregistered, 1)?;
                        unregistered.push((*tbl).to_owned());
                    }
                    Lookup::Elsewhere => return Ok(None),
                }
            }
            let (log_epoch, epoch_required) = registry.map_or((None, None), |(e, r)| (e, r));
            Ok(Some(Head {
                state: SchemaState {
                    stored_schema_version: version.unwrap_or(0),
                    stored_layouts: None,
                    log_epoch,
                    pending,
                },
                max_seq: max_seq.unwrap_or(0),
                horizon: horizon.unwrap_or(0),
                client: record.flatten(),
                unregistered,
                epoch_required,
            }))
        }
    })
}

/// One result row of `pull`: a window change, a snapshot row, or the document (first).
#[derive(Default)]
struct Out {
    sub: Option<i32>,
    commit_seq: Option<i64>,
    created_at_ms: Option<i64>,
    actor_id: Option<String>,
    idx: Option<i32>,
    row_id: Option<String>,
    op: Option<&'static str>,
    row_version: Option<i64>,
    scopes: Option<OwnedJsonb>,
    payload: Option<Vec<u8>>,
    column_versions: Option<Vec<u8>>,
    document: Option<OwnedJsonb>,
}

type OutColumns = (
    Option<i32>,
    Option<i64>,
    Option<i64>,
    Option<String>,
    Option<i32>,
    Option<String>,
    Option<&'static str>,
    Option<i64>,
    Option<OwnedJsonb>,
    Option<Vec<u8>>,
    Option<Vec<u8>>,
    Option<OwnedJsonb>,
);

impl Out {
    fn change(sub: i32, row: WindowRow) -> Out {
        let delete = row.is_delete();
        Out {
            sub: Some(sub),
            commit_seq: Some(row.commit_seq),
            created_at_ms: Some(row.created_at_ms),
            op: Some(row.op_name()),
            actor_id: Some(row.actor_id),
            idx: Some(row.idx),
            row_id: Some(row.row_id),
            row_version: row.row_version.filter(|_| !delete),
            scopes: Some(row.scopes),
            payload: row.payload.filter(|_| !delete),
            ..Out::default()
        }
    }

    fn snapshot(sub: i32, row: ScanRow) -> Out {
        Out {
            sub: Some(sub),
            row_id: Some(row.row_id),
            row_version: Some(row.server_version),
            scopes: Some(row.scopes),
            payload: Some(row.payload),
            column_versions: row.column_versions,
            ..Out::default()
        }
    }

    fn into_columns(self) -> OutColumns {
        (
            self.sub,
            self.commit_seq,
            self.created_at_ms,
            self.actor_id,
            self.idx,
            self.row_id,
            self.op,
            self.row_version,
            self.scopes,
            self.payload,
            self.column_versions,
            self.document,
        )
    }
}

/// Serves one subscription: its outcome object, its rows, and its next cursor if active.
///
/// All subscriptions share the call's [`Budget`] (docs/API.md "Limits"): once it is spent, a
/// subscription delivers what fit — whole commits, or snapshot rows — and reports the rest as
/// not yet delivered in the protocol's own terms (`nextCursor` at its last delivered commit,
/// or a `bootstrapState` at its last delivered row), after every check that could refuse it.
#[allow(clippy::too_many_arguments)]
fn serve(
    client: &SpiClient<'_>,
    caller: pg_sys::Oid,
    partition: &str,
    i: i32,
    sub: &Subscription,
    limits: &Limits,
    head: &Head,
    budget: &mut Budget,
    out: &mut Vec<Out>,
) -> Result<(Value, Option<i64>)> {
    let outcome = |status: &str, reason: &str| {
        json!({"id": sub.id, "status": status, "reasonCode": reason, "bootstrap": false,
               "nextCursor": sub.cursor})
    };
    // No effective scopes, or scopes that admit no row (no variable, or a variable with no
    // value): revoked, as upstream's host revokes an empty effective map (docs/API.md `pull`).
    let Some(effective) = sub.effective.as_ref().filter(|e| !e.admits_nothing()) else {
        return Ok((outcome("revoked", "sync.scope_revoked"), None));
    };
    if sub.token.is_none() && sub.cursor >= 0 && sub.cursor < head.horizon {
        return Ok((outcome("reset", "sync.cursor_expired"), None));
    }
    if sub.token.is_none() && sub.cursor <= head.max_seq && sub.cursor >= 0 {
        // The table is registered (checked for the whole request by the head statement), so
        // it is no reserved `sync_` name.
        let window = window::window(
            Path::Native,
            client,
            partition,
            &sub.table,
            effective,
            sub.cursor,
            head.max_seq,
            limits.commits + 1,
            budget,
        )?;
        let (rows, next) = deliver(
            window.rows,
            window.truncated,
            limits.commits,
            sub.cursor,
            head.max_seq,
        );
        let commits = {
            let mut seqs: Vec<i64> = rows.iter().map(|r| r.commit_seq).collect();
            seqs.dedup();
            seqs.len()
        };
        let changes = rows.len();
        crate::alloc::try_reserve(out, rows.len())?;
        out.extend(rows.into_iter().map(|row| Out::change(i, row)));
        return Ok((
            json!({"id": sub.id, "status": "active", "bootstrap": false, "nextCursor": next,
                   "commits": commits, "changes": changes}),
            Some(next),
        ));
    }
    // Bootstrap: resume at the token's pin unless it fell behind the horizon.
    let resume = sub.token.as_ref().filter(|t| t.as_of >= head.horizon);
    let as_of = resume.map_or(head.max_seq, |t| t.as_of);
    let start = resume.and_then(|t| t.row_cursor.clone());
    let relation = tables::open_for_read(client, &sub.table, caller)?;
    // The pages of upstream's driver read as one scan: `pages` pages of `rows`, plus one row
    // that tells whether more remain. One call returns at most RESULT_ROWS rows per subscription
    // (fewer pages then; the token resumes the rest).
    let rows_per_page = limits.snapshot_rows;
    let pages = limits
        .snapshot_pages
        .min((limits::RESULT_ROWS - 1) / rows_per_page)
        .max(1);
    let wanted = pages * rows_per_page;
    let scan = bootstrap::scan(
        client,
        &relation,
        partition,
        &sub.table,
        effective,
        start.clone(),
        wanted + 1,
        budget,
    )?;
    let mut rows = scan.rows;
    let complete = !scan.truncated && rows.len() as i64 <= wanted;
    rows.truncate(wanted as usize);
    let mut outcome = json!({"id": sub.id, "status": "active", "bootstrap": true,
                             "nextCursor": as_of, "rows": rows.len()});
    if !complete {
        // After the last delivered row; with none delivered (the budget was spent before this
        // subscription), where this page began.
        let row_cursor = rows.last().map(|r| r.row_id.clone()).or(start);
        // Upstream's JSON.stringify order: asOfCommitSeq, tables, tableIndex, rowCursor.
        let state = format!(
            "{{\"asOfCommitSeq\":{as_of},\"tables\":[{}],\"tableIndex\":0,\"rowCursor\":{}}}",
            Value::String(sub.table.clone()),
            row_cursor.map_or(Value::Null, Value::String)
        );
        outcome["bootstrapState"] = Value::String(state);
    }
    crate::alloc::try_reserve(out, rows.len())?;
    out.extend(rows.into_iter().map(|row| {
        crate::interrupts::check();
        Out::snapshot(i, row)
    }));
    Ok((outcome, Some(as_of)))
}

/// SECURITY INVOKER: a bootstrap reads app tables as their owner for a caller that may
/// `SELECT` them (docs/SECURITY.md); everything else runs with the extension owner's rights.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
fn pull(
    partition: Option<&str>,
    client_id: Option<&str>,
    actor_id: Option<&str>,
    now_ms: Option<i64>,
    initial_log_epoch: Option<&str>,
    running_schema_version: Option<i64>,
    request: Option<args::JsonArg>,
    declared: default!(Option<args::JsonArg>, "'[]'"),
) -> materialized::TableIterator<
    'static,
    (
        name!(sub, Option<i32>),
        name!(commit_seq, Option<i64>),
        name!(created_at_ms, Option<i64>),
        name!(actor_id, Option<String>),
        name!(idx, Option<i32>),
        name!(row_id, Option<String>),
        name!(op, Option<&'static str>),
        name!(row_version, Option<i64>),
        name!(scopes, Option<OwnedJsonb>),
        name!(payload, Option<Vec<u8>>),
        name!(column_versions, Option<Vec<u8>>),
        name!(document, Option<OwnedJsonb>),
    ),
> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let client_id = args::text("client_id", client_id)?;
        let actor_id = args::text("actor_id", actor_id)?;
        let now_ms = args::count("now_ms", now_ms)?;
        let epoch = args::text("initial_log_epoch", initial_log_epoch)?;
        let running = args::count("running_schema_version", running_schema_version)?;
        let request = parse_request(request)?;
        let declared = args::declarations(declared)?;
        let caller = access::current_role();
        let rows = db::with_spi(|client| {
            access::as_extension_owner(|| {
                serve_request(
                    client, caller, &partition, &client_id, &actor_id, now_ms, &epoch, running,
                    &request, &declared,
                )
            })
        })?;
        Ok(materialized::TableIterator::new(
            rows.into_iter().map(Out::into_columns),
        ))
    })
}

#[allow(clippy::too_many_arguments)]
fn serve_request(
    client: &SpiClient<'_>,
    caller: pg_sys::Oid,
    partition: &str,
    client_id: &str,
    actor_id: &str,
    now_ms: i64,
    epoch: &str,
    running: i64,
    request: &Request,
    declared: &[args::Declaration],
) -> Result<Vec<Out>> {
    // Reads first, all in the caller's snapshot.
    let head = head(client, partition, running, client_id, request)?;
    // A subscription of a table nobody registered fails the whole request, before the gate and
    // for every kind of subscription (upstream's request validation, docs/API.md `pull`): a
    // mistyped table name must not read as "active, nothing changed" and move the cursor on.
    if let Some(tbl) = head.unregistered.first() {
        return Err(tables::unknown_table(tbl).with_hint(format!(
            "subscription table {} has no registration: register_table it, or fix the name",
            Value::from(tbl.as_str())
        )));
    }
    let mut token = head.state.assert_ready(running, declared)?;
    let mismatch = head
        .client
        .as_ref()
        .is_some_and(|(stored, _)| stored != actor_id);
    let mut out = vec![Out::default()];
    let mut outcomes = Vec::new();
    let mut cursors = Vec::new();
    let mut budget = Budget::new();
    if !mismatch {
        for (i, sub) in request.subscriptions.iter().enumerate() {
            crate::interrupts::check();
            crate::alloc::check()?;
            let (outcome, next) = serve(
                client,
                caller,
                partition,
                i as i32,
                sub,
                &request.limits,
                &head,
                &mut budget,
                &mut out,
            )?;
            outcomes.push(outcome);
            cursors.extend(next);
        }
    }
    // Upstream's record: the lowest next cursor of the active subscriptions, else the stored
    // cursor, else -1.
    let cursor = cursors
        .iter()
        .copied()
        .min()
        .or(head.client.as_ref().map(|(_, c)| *c))
        .unwrap_or(-1)
        .clamp(-MAX_SAFE, MAX_SAFE);
    // A read-only transaction — every transaction of a hot standby — writes nothing: the
    // document hands the writes to the host, for `apply_pull` on the primary (src/pull/apply.rs,
    // docs/DESIGN.md §Read replicas). The registry entry is the one the touch would leave.
    // SAFETY: reads a backend global of the current transaction; never errors.
    let read_only = unsafe { pg_sys::XactReadOnly };
    let (registry, writes) = if read_only {
        let served = head.state.log_epoch.clone().unwrap_or_else(|| epoch.into());
        let registry = json!({"partition": partition, "logEpoch": served,
                              "epochRequired": head.epoch_required.unwrap_or(false),
                              "lastAuthenticatedAtMs": now_ms});
        // The client record as `put_client` takes it (only built here: the primary's
        // statement binds its fields).
        let record = (!mismatch).then(|| {
            json!({"clientId": client_id, "actorId": actor_id,
                   "wireVersion": request.wire_version, "cursor": cursor,
                   "subscriptions": request.recorded, "updatedAtMs": now_ms})
        });
        let writes = json!({"partition": partition, "logEpoch": served, "atMs": now_ms,
                            "client": record});
        (registry, Some(writes))
    } else {
        let record = (!mismatch).then_some(record::Record {
            client_id,
            actor_id,
            wire_version: request.wire_version,
            cursor,
            subscriptions: &request.recorded,
        });
        let registry = record::write(
            Path::Native,
            client,
            partition,
            now_ms,
            epoch,
            record.as_ref(),
        )?;
        (registry, None)
    };
    // The token as a gate read after the touch sees it (serve_entry): the registry's epoch.
    token["logEpoch"] = registry["logEpoch"].clone();
    let mut document = json!({
        "gate": token,
        "registry": registry,
        "maxCommitSeq": head.max_seq,
        "horizonSeq": head.horizon,
        "client": match (mismatch, read_only) {
            (true, _) => "actor_mismatch",
            (false, true) => "deferred",
            (false, false) => "recorded",
        },
        "cursor": if mismatch { Value::Null } else { json!(cursor) },
        "subscriptions": outcomes,
    });
    if let Some(writes) = writes {
        document["writes"] = writes;
    }
    // Written as binary jsonb, as jsonb_in writes it (no text round trip).
    out[0].document = Some(crate::jsonb::owned(&document)?);
    Ok(out)
}

/// In-backend tests: each runs inside one transaction that is rolled back.
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::{head_by, Head, Path};
    use crate::db;
    use pgrx::prelude::*;

    /// [`Head`] as comparable values.
    #[allow(clippy::type_complexity)]
    fn seen(
        head: Head,
    ) -> (
        (i64, Option<String>, Vec<(String, String)>),
        (i64, i64, Option<(String, i64)>, Vec<String>, Option<bool>),
    ) {
        (
            (
                head.state.stored_schema_version,
                head.state.log_epoch,
                head.state.pending,
            ),
            (
                head.max_seq,
                head.horizon,
                head.client,
                head.unregistered,
                head.epoch_required,
            ),
        )
    }

    /// The head read below SQL and through its statement are the same, over every combination
    /// of a partition with every row, with a registry entry only, or with nothing; a client
    /// with a record or without; a running version with pending checkpoints, activated ones or
    /// none; subscriptions of registered tables, unknown ones and repeats — with the marker at
    /// version 1, and without a marker.
    #[pg_test]
    fn native_and_statement_heads_are_the_same() {
        Spi::run(
            "CREATE TABLE public.h_tasks (\"_sync_partition\" text NOT NULL, \"_sync_row_id\" text NOT NULL,
               id text, \"_sync_server_version\" bigint NOT NULL, \"_sync_scopes\" jsonb NOT NULL,
               \"_sync_payload\" bytea NOT NULL, \"_sync_column_versions\" bytea,
               PRIMARY KEY (\"_sync_partition\", \"_sync_row_id\"));
             SELECT syncular.register_table('tasks', 'public.h_tasks');
             INSERT INTO syncular.sync_partition_registry (partition, log_epoch, epoch_required, last_authenticated_at_ms)
               VALUES ('p1', 'e1', true, 1), ('p2', 'e2', false, 2);
             INSERT INTO syncular.sync_partitions (partition, max_commit_seq, horizon_seq) VALUES ('p1', 40, 7);
             INSERT INTO syncular.sync_clients (partition, client_id, actor_id, cursor, subscriptions, updated_at_ms)
               VALUES ('p1', 'c1', 'a1', 12, '[]', 1);
             INSERT INTO syncular.sync_backfill_checkpoints (partition, name, schema_version, state, updated_at_ms)
               VALUES ('p2', 'b', 1, 'declared', 1), ('p1', 'a', 1, 'backfilling', 1),
                      ('p1', 'z', 1, 'activated', 1), ('p1', 'y', 2, 'activated', 1);",
        )
        .expect("setup");
        let mut compared = 0;
        for marker in [false, true] {
            if marker {
                Spi::run(
                    "INSERT INTO syncular.sync_schema_meta (id, schema_version) VALUES (1, 1)
                     ON CONFLICT (id) DO UPDATE SET schema_version = 1",
                )
                .expect("marker");
            } else {
                Spi::run("DELETE FROM syncular.sync_schema_meta").expect("no marker");
            }
            for partition in ["p1", "p2", "p3"] {
                for client_id in ["c1", "c9"] {
                    for running in [0, 1, 2] {
                        for tables in [
                            vec![],
                            vec!["tasks"],
                            vec!["nope"],
                            vec!["tasks", "nope", "nope", "other"],
                        ] {
                            let read = |path| {
                                db::with_spi(|client| {
                                    head_by(path, client, partition, running, client_id, &tables)
                                })
                                .map(seen)
                                .expect("head")
                            };
                            assert_eq!(
                                read(Path::Native),
                                read(Path::Sql),
                                "{partition} {client_id} {running} {tables:?} (marker: {marker})"
                            );
                            compared += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(compared, 144);
    }
}
