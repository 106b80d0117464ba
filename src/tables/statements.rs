//! Every statement over a host relation's rows: the only code of the extension that can make host
//! code run (docs/SECURITY.md, rules 1, 2, 8, 10 and 12). Each runs through [`AppRelation::run_as`]:
//! the relation is checked again (host code of an earlier statement of the same call may have
//! renamed it, changed its owner, added a rule or changed a meta column: the lock this
//! transaction holds does not stop its own DDL), then the statement runs in
//! [`sandbox::host_code`] as [`AppRelation::acting_role`] — the less privileged of the caller and
//! the relation's owner — in a restricted security context and a GUC nest level with the pinned
//! `search_path` that is discarded afterwards. Adoption's read of a 0.24 table
//! ([`stage_legacy_rows`]) runs there as the table's owner (an operator holds every role's
//! privileges). Only identifiers quoted from the relation cache of the locked relation
//! ([`super::open`]; for adoption, `adopt.rs`'s checks) are spliced into their text.

// The one module allowed to call `sandbox::host_code` (clippy.toml forbids it everywhere else).
#![allow(clippy::disallowed_methods)]

use super::sandbox;
use super::AppRelation;
use crate::args;
use crate::db;
use crate::error;
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::spi::{quote_identifier, quote_literal, SpiClient};
use serde_json::{json, Value};
use std::collections::HashMap;

/// What a kept text was built as ([`kept_text`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum TextKind {
    /// A schema-qualified relation name (`Inspected::qualified`).
    Qualified,
    /// [`AppRelation::upsert_sql`].
    Upsert,
    /// [`AppRelation::upsert_rows_sql`].
    UpsertRows,
}

struct KeptText {
    kind: TextKind,
    quote_all: bool,
    parts: Vec<Option<String>>,
    text: String,
}

/// How many texts [`kept_text`] keeps: a push opens each of its tables once, and a backend
/// serves a bounded set of tables.
const KEPT_TEXTS: usize = 64;

thread_local! {
    /// The statement texts this backend built, newest first, by everything they are built from:
    /// building one quotes and formats every column name again (3 % of a one-row push's
    /// backend: docs/BENCHMARKS.md, "Server CPU", step 6). A text depends only on its parts and
    /// on `quote_all_identifiers`, both in the key, so a kept one is the one `build` would make.
    static KEPT: std::cell::RefCell<Vec<KeptText>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The text `build` makes of `parts`, built once per backend and kept ([`KEPT`]).
pub(super) fn kept_text(
    kind: TextKind,
    parts: &[Option<&str>],
    build: impl FnOnce() -> String,
) -> String {
    // SAFETY: reads a GUC's backend global; no allocation, never errors.
    let quote_all = unsafe { pg_sys::quote_all_identifiers };
    let found = KEPT.with_borrow_mut(|kept| {
        let at = kept.iter().position(|k| {
            k.kind == kind
                && k.quote_all == quote_all
                && k.parts.len() == parts.len()
                && k.parts.iter().zip(parts).all(|(a, b)| a.as_deref() == *b)
        })?;
        let entry = kept.remove(at);
        let text = entry.text.clone();
        kept.insert(0, entry);
        Some(text)
    });
    if let Some(text) = found {
        return text;
    }
    let text = build();
    KEPT.with_borrow_mut(|kept| {
        kept.insert(
            0,
            KeptText {
                kind,
                quote_all,
                parts: parts.iter().map(|p| p.map(str::to_string)).collect(),
                text: text.clone(),
            },
        );
        kept.truncate(KEPT_TEXTS);
    });
    text
}

/// A stored app row's meta columns, as the one-call push reads them (step A3 of docs/DESIGN.md
/// §Push path).
pub struct StoredRow {
    pub server_version: i64,
    /// `_sync_scopes`, a legacy string-wrapped value unwrapped (docs/DESIGN.md, D15).
    pub scopes: serde_json::Value,
    pub payload: Vec<u8>,
    pub column_versions: Option<Vec<u8>>,
}

/// A stored `_sync_scopes`, parsed (a legacy string-wrapped value unwrapped, docs/DESIGN.md
/// D15), or — nested deeper than serde's parser goes (`jsonb::MAX_DEPTH`), which the host's
/// writer decides — its top level only: each key with its value where that is a string and
/// `null` where it is anything else, or `null` for a top level that is not an object. Scopes are
/// an object of strings, so a value that deep is refused by what reads it (red team 40, F3).
enum Parsed {
    Value(Value),
    TooDeep(Value),
}

/// [`Parsed`] for column `ordinal` of `row`, whose binary value is `binary`.
fn stored_scopes(
    row: &pgrx::spi::SpiHeapTupleData<'_>,
    ordinal: usize,
    binary: &crate::jsonb::OwnedJsonb,
) -> error::Result<Parsed> {
    let malformed = |_| error::Error::Internal("syncular: a malformed jsonb value".into());
    let container = binary.container().map_err(malformed)?;
    // serde's parser stops at its 128th level (`jsonb::MAX_DEPTH`).
    if !container
        .nests_deeper_than(crate::jsonb::MAX_DEPTH - 1)
        .map_err(malformed)?
    {
        let parsed = row.get::<crate::jsonb::JsonValue>(ordinal)?;
        return Ok(Parsed::Value(
            parsed.map_or(json!({}), |j| args::unwrap_json_text(j.0)),
        ));
    }
    let crate::jsonb::Node::Object(top) = container.root().map_err(malformed)? else {
        return Ok(Parsed::TooDeep(Value::Null));
    };
    let mut shallow = serde_json::Map::new();
    for (key, value) in top.pairs().map_err(malformed)? {
        crate::interrupts::check();
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        let value = match value {
            crate::jsonb::Node::String(s) => Value::String(text(s)),
            _ => Value::Null,
        };
        shallow.insert(text(key), value);
    }
    Ok(Parsed::TooDeep(Value::Object(shallow)))
}

/// The `_sync_scopes` a reader returns as stored (`get_row_scopes`, `rows_referencing_blob`):
/// one nested deeper than a document can be parsed is refused, `SY005` (`_sync_scopes`,
/// `too_deep`), naming the row.
fn scopes_column(
    row: &pgrx::spi::SpiHeapTupleData<'_>,
    ordinal: usize,
    row_id: &str,
) -> error::Result<Option<Value>> {
    let Some(binary) = crate::jsonb::OwnedJsonb::column(row, ordinal)? else {
        return Ok(None);
    };
    match stored_scopes(row, ordinal, &binary)? {
        Parsed::Value(scopes) => Ok(Some(scopes)),
        Parsed::TooDeep(_) => Err(error::Error::invalid_commit("_sync_scopes", "too_deep")
            .with_hint(format!(
                "stored row {row_id:?} has _sync_scopes nested deeper than {} levels; scopes \
                 are an object of strings: rewrite the row's _sync_scopes",
                crate::jsonb::MAX_DEPTH
            ))),
    }
}

impl StoredRow {
    /// The four meta columns (`_sync_server_version`, `_sync_scopes`, `_sync_payload`,
    /// `_sync_column_versions`) of a result row, starting at column `first` (1-based).
    ///
    /// Whoever can write the app row decides how large these are, so the copies are fallible
    /// and the scopes are measured before they are parsed (docs/DESIGN.md §Memory).
    fn read(row: &pgrx::spi::SpiHeapTupleData<'_>, first: usize) -> error::Result<StoredRow> {
        let scopes = match crate::jsonb::OwnedJsonb::column(row, first + 1)? {
            Some(binary) if crate::jsonb::over_limits(binary.as_bytes()) => {
                return Err(error::Error::Internal(
                    "syncular: a stored _sync_scopes is larger than a jsonb argument may be \
                     (docs/API.md, Limits)"
                        .into(),
                ))
            }
            Some(binary) => match stored_scopes(row, first + 1, &binary)? {
                Parsed::Value(scopes) => scopes,
                Parsed::TooDeep(shallow) => shallow,
            },
            None => json!({}),
        };
        Ok(StoredRow {
            server_version: row.get::<i64>(first)?.unwrap_or(0),
            scopes,
            payload: crate::db::bytes_column(row, first + 2)?.unwrap_or_default(),
            column_versions: crate::db::bytes_column(row, first + 3)?,
        })
    }
}

/// The one-call push's statements over a registered relation. They run **as the calling role**
/// in a restricted security context (docs/SECURITY.md, rules 1 and 10): the caller's privileges,
/// row-level security and the host's triggers apply as if the host had written the row itself,
/// and no host code runs with the extension owner's rights. Only identifiers quoted from the
/// relation cache of the locked relation are spliced in.
impl AppRelation {
    /// Checks the relation again, then runs `body` on behalf of `caller` (module comment).
    fn run_as<R>(
        &self,
        caller: pg_sys::Oid,
        body: impl FnOnce() -> error::Result<R>,
    ) -> error::Result<R> {
        if let Some(why) = super::changed_since_open(self) {
            return Err(super::unknown_table_changed(self, why));
        }
        sandbox::host_code(self.acting_role(caller), body)
    }

    /// A column name quoted for SQL.
    fn column(name: &str) -> String {
        quote_identifier(name)
    }

    /// The row `(partition, row_id)` as of this call's latest writes (a fresh snapshot, so an
    /// earlier operation of the same commit is seen).
    pub fn fetch_row_as(
        &self,
        client: &SpiClient<'_>,
        caller: pg_sys::Oid,
        partition: &str,
        row_id: &str,
    ) -> error::Result<Option<StoredRow>> {
        let sql = format!(
            "SELECT a.\"_sync_server_version\", a.\"_sync_scopes\", a.\"_sync_payload\",
                    a.\"_sync_column_versions\"
               FROM {} a WHERE a.\"_sync_partition\" = $1 AND a.\"_sync_row_id\" = $2",
            self.rows
        );
        self.run_as(caller, || {
            let table = db::write_dynamic(
                client,
                &sql,
                &[DatumWithOid::from(partition), DatumWithOid::from(row_id)],
            )?;
            match table.into_iter().next() {
                Some(row) => Ok(Some(StoredRow::read(&row, 1)?)),
                None => Ok(None),
            }
        })
    }

    /// Deletes the row `(partition, row_id)` as the caller.
    pub fn delete_row_as(
        &self,
        client: &SpiClient<'_>,
        caller: pg_sys::Oid,
        partition: &str,
        row_id: &str,
    ) -> error::Result<()> {
        let sql = format!(
            "DELETE FROM {} a WHERE a.\"_sync_partition\" = $1 AND a.\"_sync_row_id\" = $2",
            self.rows
        );
        self.run_as(caller, || {
            db::write_dynamic(
                client,
                &sql,
                &[DatumWithOid::from(partition), DatumWithOid::from(row_id)],
            )
            .map(drop)
        })
    }

    /// The upsert of one app row (upstream's `upsertSql`, one statement per operation):
    /// parameters `$1`…`$6` are the meta columns in docs/DESIGN.md §App tables order, then one
    /// per app column of `columns` (`(name, cast)`: `cast` is `jsonb` for json columns, bound as
    /// text); every non-key column is overwritten on conflict, so host triggers fire as under
    /// upstream.
    pub fn upsert_sql(&self, columns: &[(&str, Option<&str>)]) -> String {
        let mut parts = vec![Some(self.qualified.as_str())];
        parts.extend(columns.iter().flat_map(|&(c, cast)| [Some(c), cast]));
        kept_text(TextKind::Upsert, &parts, || self.build_upsert_sql(columns))
    }

    fn build_upsert_sql(&self, columns: &[(&str, Option<&str>)]) -> String {
        let mut names: Vec<String> = [
            "_sync_partition",
            "_sync_row_id",
            "_sync_server_version",
            "_sync_scopes",
            "_sync_payload",
            "_sync_column_versions",
        ]
        .iter()
        .map(|c| Self::column(c))
        .collect();
        names.extend(columns.iter().map(|(c, _)| Self::column(c)));
        let values: Vec<String> = (1..=names.len())
            .map(|i| match columns.get(i.wrapping_sub(7)).and_then(|c| c.1) {
                Some(cast) if i > 6 => format!("${i}::pg_catalog.{cast}"),
                _ => format!("${i}"),
            })
            .collect();
        let updates: Vec<String> = names[2..]
            .iter()
            .map(|c| format!("{c} = EXCLUDED.{c}"))
            .collect();
        format!(
            "INSERT INTO {} ({}) VALUES ({})
             ON CONFLICT (\"_sync_partition\", \"_sync_row_id\") DO UPDATE SET {}",
            self.qualified,
            names.join(", "),
            values.join(", "),
            updates.join(", ")
        )
    }

    /// The rows of `row_ids` in one statement, as the caller (as [`AppRelation::fetch_row_as`]
    /// reads one); rows that do not exist are absent from the map.
    pub fn fetch_rows_as(
        &self,
        client: &SpiClient<'_>,
        caller: pg_sys::Oid,
        partition: &str,
        row_ids: Vec<&str>,
    ) -> error::Result<std::collections::HashMap<String, StoredRow>> {
        let sql = format!(
            "SELECT a.\"_sync_row_id\", a.\"_sync_server_version\", a.\"_sync_scopes\",
                    a.\"_sync_payload\", a.\"_sync_column_versions\"
               FROM {} a WHERE a.\"_sync_partition\" = $1 AND a.\"_sync_row_id\" = ANY ($2)",
            self.rows
        );
        self.run_as(caller, || {
            let table = db::write_dynamic(
                client,
                &sql,
                &[DatumWithOid::from(partition), DatumWithOid::from(row_ids)],
            )?;
            let mut rows = std::collections::HashMap::new();
            for row in table {
                crate::interrupts::check();
                let id = row.get::<String>(1)?.unwrap_or_default();
                rows.insert(id, StoredRow::read(&row, 2)?);
            }
            Ok(rows)
        })
    }

    /// The upsert of many app rows in one statement: [`AppRelation::upsert_sql`]'s columns,
    /// each bound as one array (`(name, element type, cast)`; the partition as `$1`), unnested
    /// side by side in order (`ROWS FROM`: the multi-argument `unnest` cannot be
    /// schema-qualified). Same writes as one upsert per row, for a triggerless table and distinct rows.
    pub fn upsert_rows_sql(&self, columns: &[(&str, &str, Option<&str>)]) -> String {
        let mut parts = vec![Some(self.qualified.as_str())];
        parts.extend(
            columns
                .iter()
                .flat_map(|&(c, ty, cast)| [Some(c), Some(ty), cast]),
        );
        kept_text(TextKind::UpsertRows, &parts, || {
            self.build_upsert_rows_sql(columns)
        })
    }

    fn build_upsert_rows_sql(&self, columns: &[(&str, &str, Option<&str>)]) -> String {
        let meta = [
            ("_sync_row_id", "text", None),
            ("_sync_server_version", "int8", None),
            ("_sync_scopes", "text", Some("jsonb")),
            ("_sync_payload", "bytea", None),
            ("_sync_column_versions", "bytea", None),
        ];
        let all: Vec<(&str, &str, Option<&str>)> = meta
            .iter()
            .copied()
            .chain(columns.iter().copied())
            .collect();
        let mut names = vec![Self::column("_sync_partition")];
        names.extend(all.iter().map(|(c, _, _)| Self::column(c)));
        let arrays: Vec<String> = all
            .iter()
            .enumerate()
            .map(|(i, (_, ty, _))| format!("pg_catalog.unnest(${}::pg_catalog.{ty}[])", i + 2))
            .collect();
        let selected: Vec<String> = all
            .iter()
            .enumerate()
            .map(|(i, (_, _, cast))| match cast {
                Some(cast) => format!("u.c{i}::pg_catalog.{cast}"),
                None => format!("u.c{i}"),
            })
            .collect();
        let aliases: Vec<String> = (0..all.len()).map(|i| format!("c{i}")).collect();
        let updates: Vec<String> = names[2..]
            .iter()
            .map(|c| format!("{c} = EXCLUDED.{c}"))
            .collect();
        format!(
            "INSERT INTO {} ({}) SELECT $1, {} FROM ROWS FROM ({}) AS u({})
             ON CONFLICT (\"_sync_partition\", \"_sync_row_id\") DO UPDATE SET {}",
            self.qualified,
            names.join(", "),
            selected.join(", "),
            arrays.join(", "),
            aliases.join(", "),
            updates.join(", ")
        )
    }

    /// Runs an [`AppRelation::upsert_sql`] statement as the caller.
    pub fn upsert_row_as(
        &self,
        client: &SpiClient<'_>,
        caller: pg_sys::Oid,
        sql: &str,
        args: &[DatumWithOid<'_>],
    ) -> error::Result<()> {
        self.run_as(caller, || db::write_dynamic(client, sql, args).map(drop))
    }
}

/// Rows a page of [`AppRelation::rewrite_payloads`] lists by key: as many as upstream's rewrite
/// pages (500), read in chunks of at most [`REWRITE_CHUNK_BYTES`] of payload.
const REWRITE_PAGE_ROWS: i64 = 500;
/// Payload bytes one chunk of the rewrite reads and writes at once (a larger row is a chunk of
/// its own): the rewrite's memory is bounded by this and the largest row, never by the table.
const REWRITE_CHUNK_BYTES: i64 = 8 << 20;

/// What [`AppRelation::rewrite_payloads`] does to one row: `(partition, row_id, payload)` to the
/// new payload.
pub type Reencode<'a> = dyn FnMut(&str, &str, &[u8]) -> error::Result<Vec<u8>> + 'a;

/// A stored row as [`AppRelation::walk_chunks`] lists it: its key and its payload's length.
struct RowKey {
    partition: String,
    row_id: String,
    bytes: i64,
}

/// What [`AppRelation::walk_chunks`] does with one chunk of keys, in an SPI connection of its own.
type EachChunk<'a> = dyn FnMut(&SpiClient<'_>, &[RowKey]) -> error::Result<()> + 'a;

/// `migrate_schema`'s re-encoding of stored payloads (src/schema/evolution.rs). It runs in the
/// sandbox as [`AppRelation::acting_role`] of the migrating role — the less privileged of it and
/// the relation's owner, as every host statement (docs/SECURITY.md rules 1, 8 and 19): what the
/// owner attached to the table (UPDATE triggers, policies, functions in them) runs with no more
/// than its author's rights, and nothing the migrating role planted in its session runs with
/// the owner's. `row_security` is off inside: a policy that would hide rows (FORCE ROW LEVEL
/// SECURITY, or any policy for a migrating role that is not the owner) fails the migration
/// instead of leaving rows unconverted.
impl AppRelation {
    /// [`AppRelation::run_as`] for the migrating `caller`, with `row_security` off (module
    /// comment).
    fn run_rewrite<R>(
        &self,
        caller: pg_sys::Oid,
        body: impl FnOnce() -> error::Result<R>,
    ) -> error::Result<R> {
        self.run_as(caller, || {
            // SAFETY: inside the sandbox's GUC nest level, discarded when it ends (as
            // `db::generic` sets plan_cache_mode); a valid setting name and value.
            unsafe {
                pg_sys::set_config_option(
                    c"row_security".as_ptr(),
                    c"off".as_ptr(),
                    pg_sys::GucContext::PGC_USERSET,
                    pg_sys::GucSource::PGC_S_SESSION,
                    pg_sys::GucAction::GUC_ACTION_SAVE,
                    true,
                    0,
                    false,
                );
            }
            one_connection_per_node(body)
        })
    }

    /// One call of a migration's function for one shard of a distributed relation
    /// (src/schema/shards.rs: `syncular._payload_rewrite`, `syncular._payload_check`), for a
    /// `partition` that shard holds, which Citus delegates to the shard's node — as the
    /// migration's role (so over one connection per node and user for the whole migration:
    /// Citus refuses another user on placements the transaction modified, and the node keeps
    /// what the shard's rewrite wrote in that session), with the partition as a literal
    /// (`force_delegation` requires a constant) and in the `FROM` form (Citus does not delegate
    /// a bare call made inside a function). Run as the rewrite's role in a restricted context,
    /// not as host code (`sandbox::own_call_as`): where the shard is on this node (a coordinator
    /// that holds shards) the function runs in this backend, as a call of the API; where Citus
    /// does not delegate it and the shard is elsewhere, it is refused here (`SY004`), never
    /// answered from a shell. `function` is the extension's own name, never
    /// input.
    pub fn call_shard(
        &self,
        caller: pg_sys::Oid,
        partition: &str,
        function: &'static str,
        layouts: Option<DatumWithOid<'_>>,
    ) -> error::Result<i64> {
        let sql = format!(
            "SELECT n FROM syncular.{function}({}, $1{}) n",
            quote_literal(partition),
            if layouts.is_some() {
                ", $2::pg_catalog.jsonb"
            } else {
                ""
            }
        );
        if let Some(why) = super::changed_since_open(self) {
            return Err(super::unknown_table_changed(self, why));
        }
        let answer = db::with_spi(|c| {
            sandbox::own_call_as(self.acting_role(caller), || {
                one_connection_per_node(|| {
                    let mut args = vec![DatumWithOid::from(self.tbl.as_str())];
                    args.extend(layouts);
                    db::first::<i64>(db::write_dynamic(c, &sql, &args)?)
                })
            })
        })?;
        answer.ok_or_else(|| {
            error::Error::Internal(format!(
                "syncular: {function} answered nothing for a shard of table {}",
                self.tbl
            ))
        })
    }

    /// Whether the relation holds a row, by one statement: for a table Citus distributes, whose
    /// rows no scan below SQL reaches ([`AppRelation::has_rows`]). As the less privileged of
    /// `caller` and the owner, `row_security` off (a policy hiding rows fails the statement
    /// instead of answering "empty"), after [`AppRelation::lock_against_writers`].
    pub fn any_row(&self, caller: pg_sys::Oid) -> error::Result<bool> {
        let sql = format!("SELECT EXISTS (SELECT 1 FROM {} a)", self.rows);
        db::with_spi(|c| {
            self.run_rewrite(caller, || {
                db::first::<bool>(db::read_dynamic(c, &sql, &[])?).map(|b| b == Some(true))
            })
        })
    }

    /// Locks the relation against every writer until the migration's transaction ends, after
    /// waiting for the writers in flight (`SHARE`: a host's own insert outside the protocol, not
    /// yet committed, would otherwise keep a row an emptiness check cannot see; red team 6,
    /// R6-2). Partitions included; `ONLY` an ordinary table. Runs no host code.
    pub fn lock_against_writers(&self, caller: pg_sys::Oid) -> error::Result<()> {
        self.lock(caller, "SHARE")
    }

    /// Locks the relation against everyone until the migration's transaction ends, after
    /// waiting for every transaction that read or wrote it (`ACCESS EXCLUSIVE`, what the host's
    /// own `ALTER TABLE` of the migration takes anyway): a payload such a transaction read before
    /// the rewrite would otherwise reach `decode_row` after the migration committed — through a
    /// function, a trigger, a cursor or a procedure's loop — and be decoded with the new layout
    /// (red team 15, S1; docs/SECURITY.md rule 19). Also everything [`Self::lock_against_writers`]
    /// guards against. Partitions included; `ONLY` an ordinary table. Runs no host code.
    pub fn lock_for_rewrite(&self, caller: pg_sys::Oid) -> error::Result<()> {
        self.lock(caller, "ACCESS EXCLUSIVE")
    }

    /// The relations a `LOCK TABLE` of [`Self::lock_for_rewrite`] locks: the relation, and every
    /// partition of a partitioned one (listed without a lock; one attached meanwhile is locked
    /// by that `LOCK TABLE` itself).
    fn lock_targets(&self) -> error::Result<Vec<pg_sys::Oid>> {
        if !self.partitioned {
            return Ok(vec![self.oid]);
        }
        // pg_partition_tree and its catalog reads: no host object in the plan.
        db::with_spi(|c| {
            let rows = db::read(
                c,
                "SELECT t.relid::pg_catalog.oid FROM pg_catalog.pg_partition_tree($1::pg_catalog.regclass) t",
                &[DatumWithOid::from(self.oid)],
            )?;
            let mut oids = Vec::new();
            for row in rows {
                crate::interrupts::check();
                if let Some(oid) = row.get::<pg_sys::Oid>(1)? {
                    oids.push(oid);
                }
            }
            Ok(oids)
        })
    }

    fn lock(&self, caller: pg_sys::Oid, mode: &'static str) -> error::Result<()> {
        let sql = format!("LOCK TABLE {} IN {mode} MODE", self.rows);
        db::with_spi(|c| {
            self.run_rewrite(caller, || {
                crate::citus::propagating_locks(|| db::write_dynamic(c, &sql, &[]).map(drop))
            })
        })
    }

    /// Walks every stored row of the relation page by page in key order (each page and chunk in
    /// an SPI connection of its own, so what it read is freed before the next), handing `each`
    /// the keys and payload lengths of one chunk at a time: at most [`REWRITE_PAGE_ROWS`] rows
    /// and [`REWRITE_CHUNK_BYTES`] of payload (or one larger row).
    fn walk_chunks(&self, caller: pg_sys::Oid, each: &mut EachChunk<'_>) -> error::Result<()> {
        let q = &self.rows;
        let first = format!(
            "SELECT a.\"_sync_partition\", a.\"_sync_row_id\",
                    pg_catalog.octet_length(a.\"_sync_payload\")::pg_catalog.int8
               FROM {q} a
              ORDER BY a.\"_sync_partition\", a.\"_sync_row_id\" LIMIT {REWRITE_PAGE_ROWS}"
        );
        let next = format!(
            "SELECT a.\"_sync_partition\", a.\"_sync_row_id\",
                    pg_catalog.octet_length(a.\"_sync_payload\")::pg_catalog.int8
               FROM {q} a
              WHERE (a.\"_sync_partition\", a.\"_sync_row_id\") > ($1, $2)
              ORDER BY a.\"_sync_partition\", a.\"_sync_row_id\" LIMIT {REWRITE_PAGE_ROWS}"
        );
        let mut after: Option<(String, String)> = None;
        loop {
            crate::interrupts::check();
            let page: Vec<RowKey> = db::with_spi(|c| {
                self.run_rewrite(caller, || {
                    let rows = match &after {
                        None => db::write_dynamic(c, &first, &[])?,
                        Some((p, id)) => db::write_dynamic(
                            c,
                            &next,
                            &[
                                DatumWithOid::from(p.as_str()),
                                DatumWithOid::from(id.as_str()),
                            ],
                        )?,
                    };
                    let mut page = Vec::new();
                    for row in rows {
                        crate::interrupts::check();
                        page.push(RowKey {
                            partition: db::text_column(&row, 1)?.unwrap_or_default(),
                            row_id: db::text_column(&row, 2)?.unwrap_or_default(),
                            bytes: row.get::<i64>(3)?.unwrap_or(0),
                        });
                    }
                    Ok(page)
                })
            })?;
            let Some(last) = page.last() else {
                break;
            };
            after = Some((last.partition.clone(), last.row_id.clone()));
            let full = page.len() as i64 == REWRITE_PAGE_ROWS;
            let mut start = 0;
            while start < page.len() {
                crate::interrupts::check();
                let mut end = start;
                let mut bytes = 0i64;
                while end < page.len()
                    && (end == start || bytes + page[end].bytes <= REWRITE_CHUNK_BYTES)
                {
                    crate::interrupts::check();
                    bytes += page[end].bytes;
                    end += 1;
                }
                let chunk = &page[start..end];
                start = end;
                db::with_spi(|c| each(c, chunk))?;
            }
            if !full {
                break;
            }
        }
        Ok(())
    }

    /// The rows of `chunk` ([`AppRelation::walk_chunks`]) that still exist, locked, each handed
    /// to `each(partition, row_id, payload)` as read.
    fn read_chunk(
        &self,
        client: &SpiClient<'_>,
        caller: pg_sys::Oid,
        chunk: &[RowKey],
        each: &mut dyn FnMut(String, String, Vec<u8>) -> error::Result<()>,
    ) -> error::Result<()> {
        // Row locks on one node; Citus refuses them in a query over many shards, and needs
        // none: the migration holds every node's `ACCESS EXCLUSIVE` lock on the table
        // ([`lock_all_for_rewrite`]; Citus runs the `LOCK TABLE` on every node).
        let read = format!(
            "SELECT a.\"_sync_partition\", a.\"_sync_row_id\", a.\"_sync_payload\"
               FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.text[]),
                               pg_catalog.unnest($2::pg_catalog.text[])) AS k(p, id)
               JOIN {} a ON a.\"_sync_partition\" = k.p AND a.\"_sync_row_id\" = k.id
                {}",
            self.rows,
            if self.distributed() {
                ""
            } else {
                "FOR UPDATE OF a"
            }
        );
        let partitions: Vec<&str> = chunk.iter().map(|k| k.partition.as_str()).collect();
        let ids: Vec<&str> = chunk.iter().map(|k| k.row_id.as_str()).collect();
        self.run_rewrite(caller, || {
            let rows = db::write_dynamic(
                client,
                &read,
                &[DatumWithOid::from(partitions), DatumWithOid::from(ids)],
            )?;
            for row in rows {
                crate::interrupts::check();
                each(
                    db::text_column(&row, 1)?.unwrap_or_default(),
                    db::text_column(&row, 2)?.unwrap_or_default(),
                    db::bytes_column(&row, 3)?.unwrap_or_default(),
                )?;
            }
            Ok(())
        })
    }

    /// Replaces every stored row's `_sync_payload` by `reencode(partition, row_id, payload)`,
    /// chunk by chunk ([`AppRelation::walk_chunks`]), locking each chunk's rows before it reads
    /// them; the number of rows rewritten. A row a host trigger or policy keeps from being
    /// updated, or whose stored payload is not the re-encoded one after the statement (a trigger
    /// that kept or changed it), fails the call. A trigger of a later chunk, or of another
    /// table, can still change a row already rewritten: `AppRelation::scan_payloads`
    /// (src/tables/payloads.rs) after every rewrite of the migration closes that (red team 4,
    /// C2).
    pub fn rewrite_payloads(
        &self,
        caller: pg_sys::Oid,
        reencode: &mut Reencode<'_>,
    ) -> error::Result<i64> {
        let q = &self.rows;
        let write = format!(
            "UPDATE {q} a SET \"_sync_payload\" = u.payload
               FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.text[]),
                               pg_catalog.unnest($2::pg_catalog.text[]),
                               pg_catalog.unnest($3::pg_catalog.bytea[])) AS u(p, id, payload)
              WHERE a.\"_sync_partition\" = u.p AND a.\"_sync_row_id\" = u.id
             RETURNING 1"
        );
        // The first row whose stored payload is not the one written (or that is gone).
        let reread = format!(
            "SELECT u.id
               FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.text[]),
                               pg_catalog.unnest($2::pg_catalog.text[]),
                               pg_catalog.unnest($3::pg_catalog.bytea[])) AS u(p, id, payload)
               LEFT JOIN {q} a ON a.\"_sync_partition\" = u.p AND a.\"_sync_row_id\" = u.id
              WHERE a.\"_sync_payload\" IS DISTINCT FROM u.payload
              LIMIT 1"
        );
        let mut rewritten = 0i64;
        self.walk_chunks(caller, &mut |c, chunk| {
            let (mut keys_p, mut keys_id, mut payloads) = (Vec::new(), Vec::new(), Vec::new());
            self.read_chunk(c, caller, chunk, &mut |partition, row_id, payload| {
                payloads.push(reencode(&partition, &row_id, &payload)?);
                keys_p.push(partition);
                keys_id.push(row_id);
                Ok(())
            })?;
            if keys_p.is_empty() {
                return Ok(());
            }
            let expected = keys_p.len();
            let updated = self.run_rewrite(caller, || {
                Ok(db::write_dynamic(
                    c,
                    &write,
                    &[
                        DatumWithOid::from(keys_p.clone()),
                        DatumWithOid::from(keys_id.clone()),
                        DatumWithOid::from(payloads.clone()),
                    ],
                )?
                .len())
            })?;
            if updated != expected {
                return Err(error::Error::TriggeredChange(format!(
                    "syncular: migrate_schema re-encoded {expected} stored rows of table {} but \
                     {updated} were updated: a trigger or policy of the relation kept rows from \
                     being rewritten, which would leave them unreadable at the new schema version",
                    self.tbl
                )));
            }
            // What the statement left, triggers included: the re-encoded bytes, or the call
            // fails (a BEFORE trigger returning OLD counts as updated).
            let stored = self.run_rewrite(caller, || {
                let rows = db::write_dynamic(
                    c,
                    &reread,
                    &[
                        DatumWithOid::from(keys_p),
                        DatumWithOid::from(keys_id),
                        DatumWithOid::from(payloads),
                    ],
                )?;
                db::first::<String>(rows)
            })?;
            if let Some(row_id) = stored {
                return Err(error::Error::TriggeredChange(format!(
                    "syncular: migrate_schema re-encoded stored row {row_id} of table {} but the \
                     relation holds another _sync_payload after the update: a trigger of the \
                     relation kept or changed it, which would leave it unreadable at the new \
                     schema version",
                    self.tbl
                )));
            }
            rewritten += expected as i64;
            Ok(())
        })?;
        Ok(rewritten)
    }
}

/// `body` with Citus on one connection per node, whatever the session set: a migration's
/// statements (its locks, its rewrite, its calls of each shard's functions) must meet in the
/// backend of each node that holds what they wrote — a shard's check finds its rewrite's digest
/// there — and with `citus.force_max_query_parallelization` on, Citus spread them over several
/// connections per node and cancelled the migration as a distributed deadlock (red team 49's
/// note; docs/SCALING.md "Migrations on Citus"). Without Citus, `body` as it is.
fn one_connection_per_node<R>(body: impl FnOnce() -> error::Result<R>) -> error::Result<R> {
    let citus: &[(&std::ffi::CStr, &std::ffi::CStr)] = &[
        (c"citus.multi_shard_modify_mode", c"sequential"),
        (c"citus.force_max_query_parallelization", c"off"),
        (c"citus.max_adaptive_executor_pool_size", c"1"),
    ];
    if crate::citus::installed() {
        db::with_settings(citus, body)
    } else {
        body()
    }
}

/// The readers of host rows for the API's reads, on behalf of the caller recorded by
/// [`AppRelation::read_by`] after [`AppRelation::readable_by`] checked its `SELECT`.
impl AppRelation {
    /// Runs `body` — statements over this relation — on behalf of the reader
    /// [`AppRelation::read_by`] recorded.
    fn as_reader<R>(&self, body: impl FnOnce() -> error::Result<R>) -> error::Result<R> {
        let reader = self.reader.ok_or_else(|| {
            error::Error::Internal("syncular: a host relation read without a reader".into())
        })?;
        self.run_as(reader, body)
    }

    /// Reads `columns` (a select list over the relation as `a`) of the rows of `row_ids`, in
    /// that order, handing each to `each` while the statement's result is alive; a row that
    /// does not exist (or was deleted since its id was read) is absent. `each` returns `true` to
    /// stop; so does this. The one statement shape of every API read of host rows by id.
    fn read_by_ids(
        &self,
        client: &SpiClient<'_>,
        partition: &str,
        row_ids: &[&str],
        columns: &str,
        mut each: impl FnMut(&pgrx::spi::SpiHeapTupleData<'_>) -> error::Result<bool>,
    ) -> error::Result<bool> {
        let sql = format!(
            "SELECT {columns}
               FROM unnest($2::text[]) WITH ORDINALITY AS k(row_id, n)
               JOIN {} a ON a.\"_sync_partition\" = $1 AND a.\"_sync_row_id\" = k.row_id
              ORDER BY k.n",
            self.rows
        );
        self.as_reader(|| {
            let rows = db::read_dynamic(
                client,
                &sql,
                &[DatumWithOid::from(partition), DatumWithOid::from(row_ids)],
            )?;
            for row in rows {
                crate::interrupts::check();
                if each(&row)? {
                    return Ok(true);
                }
            }
            Ok(false)
        })
    }

    /// `{serverVersion, scopes}` of the row `(partition, row_id)`, if it exists
    /// (`get_row_scopes`).
    pub fn row_scopes(
        &self,
        client: &SpiClient<'_>,
        partition: &str,
        row_id: &str,
    ) -> error::Result<Option<Value>> {
        let mut found = None;
        self.read_by_ids(
            client,
            partition,
            &[row_id],
            "a.\"_sync_server_version\", a.\"_sync_scopes\"",
            |row| {
                let scopes = scopes_column(row, 2, row_id)?.unwrap_or(json!({}));
                found = Some(json!({"serverVersion": row.get::<i64>(1)?, "scopes": scopes}));
                Ok(true)
            },
        )?;
        Ok(found)
    }

    /// The rows of `row_ids` (a bootstrap scan's page of candidates) in that order, each handed
    /// to `each` while the statement's result is alive (columns: row id, server version, scopes
    /// with a string-wrapped value unwrapped, payload, column versions); a row deleted since its
    /// index entry was read is absent. `each` returns `true` to stop; so does this.
    pub fn scan_rows(
        &self,
        client: &SpiClient<'_>,
        partition: &str,
        row_ids: &[String],
        each: impl FnMut(&pgrx::spi::SpiHeapTupleData<'_>) -> error::Result<bool>,
    ) -> error::Result<bool> {
        let ids: Vec<&str> = row_ids.iter().map(String::as_str).collect();
        self.read_by_ids(
            client,
            partition,
            &ids,
            "a.\"_sync_row_id\", a.\"_sync_server_version\",
             CASE WHEN pg_catalog.jsonb_typeof(a.\"_sync_scopes\") = 'string'
                  THEN (a.\"_sync_scopes\" #>> '{}')::jsonb ELSE a.\"_sync_scopes\" END,
             a.\"_sync_payload\", a.\"_sync_column_versions\"",
            each,
        )
    }

    /// The scopes of the rows of `row_ids` (`rows_referencing_blob`), by row id; a row that
    /// does not exist is absent, one with NULL scopes maps to `None`.
    pub fn scopes_of_rows(
        &self,
        client: &SpiClient<'_>,
        partition: &str,
        row_ids: &[&str],
    ) -> error::Result<HashMap<String, Option<Value>>> {
        let mut scopes = HashMap::new();
        self.read_by_ids(
            client,
            partition,
            row_ids,
            "a.\"_sync_row_id\", a.\"_sync_scopes\"",
            |row| {
                let row_id = row.get::<String>(1)?.unwrap_or_default();
                let value = scopes_column(row, 2, &row_id)?;
                scopes.insert(row_id, value);
                Ok(false)
            },
        )?;
        Ok(scopes)
    }
}

/// A column of a 0.24 table as `adopt_legacy_tables` reads it (docs/DESIGN.md §Adoption).
pub struct LegacyColumn {
    /// The column's name in the source and in the target.
    pub name: &'static str,
    /// The built-in target type it is cast to, schema-qualified (`pg_catalog.int8`).
    pub cast: &'static str,
    /// Stored JSON (`jsonb`, `json` or `text`), unwrapped when string-wrapped (docs/DESIGN.md,
    /// D15).
    pub json: bool,
}

/// Copies the rows of the 0.24 table `source` (quoted and schema-qualified, locked and checked by
/// `adopt_legacy_tables`) into `stage`, a temporary table the extension owner made for this
/// copy and granted `INSERT` on to `owner`, the source's owner — as that owner, in the sandbox
/// (docs/SECURITY.md, rules 1 and 8). Planning and reading the source runs whatever its owner
/// attached to it (an index predicate or expression, a statistics object's expression, a CHECK
/// under `constraint_exclusion`, a generated column), so it must run with the owner's rights,
/// never the operator's or the extension owner's. The statement reads `ONLY` the source (not an
/// inheritance child), casts every column to its target's built-in type and unwraps
/// string-wrapped JSON, so what the extension owner then copies out of `stage` holds values of
/// built-in types only.
pub fn stage_legacy_rows(
    owner: pg_sys::Oid,
    source: &str,
    stage: &str,
    columns: &[LegacyColumn],
) -> error::Result<()> {
    let targets: Vec<String> = columns.iter().map(|c| quote_identifier(c.name)).collect();
    let values: Vec<String> = columns
        .iter()
        .map(|c| {
            let col = format!("s.{}", quote_identifier(c.name));
            if c.json {
                // The pattern as an escape string: its meaning does not depend on the session's
                // standard_conforming_strings.
                format!(
                    "CASE WHEN pg_catalog.jsonb_typeof({col}::pg_catalog.jsonb) = 'string'
                               AND ({col}::pg_catalog.jsonb #>> '{{}}') ~ E'^\\\\s*[\\\\[{{]'
                          THEN ({col}::pg_catalog.jsonb #>> '{{}}')::pg_catalog.jsonb
                          ELSE {col}::pg_catalog.jsonb END"
                )
            } else {
                format!("{col}::{}", c.cast)
            }
        })
        .collect();
    let sql = format!(
        "INSERT INTO {stage} ({}) SELECT {} FROM ONLY {source} s",
        targets.join(", "),
        values.join(", ")
    );
    // One statement, run once: not kept as a plan (the stage is dropped right after).
    sandbox::host_code(owner, || Ok(pgrx::spi::Spi::run(&sql)?))
}

/// Locks every relation a migration re-encodes `ACCESS EXCLUSIVE` at once, never waiting while
/// it holds one of them: taken one after the other, a reader holding the second while it waits
/// for the first (one `pull` over both, in the other order) deadlocked with the migration (red
/// team 16, B4). Each round tries every lock without waiting; on a busy one it gives back what
/// it took, waits for that one alone, gives it back too, and tries again. Then each relation's
/// `LOCK TABLE` as the migrating caller, which checks the caller's privilege and no longer waits.
pub fn lock_all_for_rewrite(relations: &[&AppRelation], caller: pg_sys::Oid) -> error::Result<()> {
    let mode = pg_sys::AccessExclusiveLock as pg_sys::LOCKMODE;
    let mut targets = Vec::new();
    for relation in relations {
        targets.extend(relation.lock_targets()?);
    }
    loop {
        crate::interrupts::check();
        let mut taken = Vec::new();
        let mut busy = None;
        for &oid in &targets {
            // SAFETY: a lock on a relation OID for this transaction; released below only if
            // this round took it and nothing read the relation since.
            if unsafe { pg_sys::ConditionalLockRelationOid(oid, mode) } {
                taken.push(oid);
            } else {
                busy = Some(oid);
                break;
            }
        }
        let Some(busy) = busy else { break };
        // SAFETY: each lock released was taken by this round (one count of it; a lock the
        // transaction held before keeps its own count), and the wait holds none of them.
        unsafe {
            for oid in taken {
                pg_sys::UnlockRelationOid(oid, mode);
            }
            pg_sys::LockRelationOid(busy, mode);
            pg_sys::UnlockRelationOid(busy, mode);
        }
    }
    for relation in relations {
        relation.lock_for_rewrite(caller)?;
    }
    Ok(())
}
