//! The one-time adoption of a 0.24 database into the extension's tables (docs/DESIGN.md §Adoption).
//!
//! An operator action (a superuser, or a role holding the extension owner's privileges), done in
//! one call inside the caller's transaction, so a refusal at any point leaves nothing written:
//! 1. **Before anything is copied**, every source table is locked and checked: an ordinary,
//!    permanent table without row-level security, readable by the caller and by its owner, whose
//!    copied columns all have one of the built-in types their target column accepts.
//! 2. The copy, table by table, each source checked again right before its own copy: read as
//!    the source's owner in the sandbox into a temporary stage, then copied from the stage as the
//!    extension owner ([`copy`]).
//! 3. The copied log is checked, set-based over the extension's own tables, for what the
//!    extension's writers and readers rely on (a consistent allocator, known ops, object scopes
//!    of strings, readable push results, no orphaned change rows).
//!
//! Why the source is never read with the extension owner's (or the operator's) rights: reading a
//! relation runs code its owner attached to it even when the statement names no function of
//! the host — the planner evaluates IMMUTABLE functions in index predicates and expressions and
//! in statistics objects' expressions (and in CHECK constraints under `constraint_exclusion`),
//! the executor computes virtual generated columns. Refusing each such attachment would be a
//! list that the next PostgreSQL release can outgrow; reading as the owner in a restricted
//! context makes every one of them run with its author's own rights (docs/SECURITY.md, rules 1
//! and 8). Step 1 keeps the copy exact: it reads `ONLY` the checked relation — not its
//! inheritance children, which could be foreign tables or carry their own policies — and casts
//! only between built-in types, so what reaches the extension's tables is what the source holds.
//! The types are read from the relation cache after the lock, i.e. from the very descriptor the
//! copy statement is parsed against; a catalog query could see an older snapshot in a
//! REPEATABLE READ transaction.

use crate::access;
use crate::args;
use crate::db;
use crate::error::{self, Error, Result};
use crate::push::result;
use crate::tables;
use pgrx::prelude::*;
use pgrx::spi::{quote_identifier, SpiClient};
use pgrx::{JsonB, PgRelation};
use serde_json::{json, Map, Value};

/// The type of a target column, and the source types it is copied from.
#[derive(Clone, Copy)]
enum Ty {
    Text,
    BigInt,
    Integer,
    SmallInt,
    Boolean,
    Jsonb,
    Bytea,
}

impl Ty {
    /// The type's schema-qualified name.
    fn sql(self) -> &'static str {
        match self {
            Ty::Text => "pg_catalog.text",
            Ty::BigInt => "pg_catalog.int8",
            Ty::Integer => "pg_catalog.int4",
            Ty::SmallInt => "pg_catalog.int2",
            Ty::Boolean => "pg_catalog.bool",
            Ty::Jsonb => "pg_catalog.jsonb",
            Ty::Bytea => "pg_catalog.bytea",
        }
    }

    /// The built-in source types accepted for a target of this type: upstream's own, the
    /// narrower integers of older upstream versions (widened), and JSON stored as `json` or
    /// `text` (then unwrapped). Compared by OID, so a domain over one of them, or a host type
    /// of the same name in another schema, is refused. Every cast between these is PostgreSQL's
    /// own (a widening, a binary coercion, or jsonb's input function).
    fn accepts(self) -> &'static [pg_sys::Oid] {
        match self {
            Ty::Text => &[pg_sys::TEXTOID, pg_sys::VARCHAROID],
            Ty::BigInt => &[pg_sys::INT8OID, pg_sys::INT4OID, pg_sys::INT2OID],
            Ty::Integer => &[pg_sys::INT4OID, pg_sys::INT2OID],
            Ty::SmallInt => &[pg_sys::INT2OID],
            Ty::Boolean => &[pg_sys::BOOLOID],
            Ty::Jsonb => &[pg_sys::JSONBOID, pg_sys::JSONOID, pg_sys::TEXTOID],
            Ty::Bytea => &[pg_sys::BYTEAOID],
        }
    }
}

/// Tables 1–14 of docs/DESIGN.md §Data model, in copy order (commits before fences and the
/// marker, so history is not fenced), with the columns adoption copies. JSON columns are
/// unwrapped; the marker's floor is not copied (it stays 0).
const ADOPTED: &[(&str, &[(&str, Ty)])] = &[
    (
        "sync_partitions",
        &[
            ("partition", Ty::Text),
            ("max_commit_seq", Ty::BigInt),
            ("horizon_seq", Ty::BigInt),
        ],
    ),
    (
        "sync_partition_registry",
        &[
            ("partition", Ty::Text),
            ("log_epoch", Ty::Text),
            ("epoch_required", Ty::Boolean),
            ("last_authenticated_at_ms", Ty::BigInt),
        ],
    ),
    (
        "sync_row_scopes",
        &[
            ("partition", Ty::Text),
            ("tbl", Ty::Text),
            ("var", Ty::Text),
            ("value", Ty::Text),
            ("row_id", Ty::Text),
        ],
    ),
    (
        "sync_commits",
        &[
            ("partition", Ty::Text),
            ("commit_seq", Ty::BigInt),
            ("client_id", Ty::Text),
            ("client_commit_id", Ty::Text),
            ("actor_id", Ty::Text),
            ("created_at_ms", Ty::BigInt),
            ("writer_version", Ty::BigInt),
        ],
    ),
    (
        "sync_changes",
        &[
            ("partition", Ty::Text),
            ("commit_seq", Ty::BigInt),
            ("idx", Ty::Integer),
            ("tbl", Ty::Text),
            ("row_id", Ty::Text),
            ("op", Ty::SmallInt),
            ("row_version", Ty::BigInt),
            ("scopes", Ty::Jsonb),
            ("payload", Ty::Bytea),
        ],
    ),
    (
        "sync_change_scopes",
        &[
            ("partition", Ty::Text),
            ("tbl", Ty::Text),
            ("var", Ty::Text),
            ("value", Ty::Text),
            ("commit_seq", Ty::BigInt),
        ],
    ),
    (
        "sync_push_results",
        &[
            ("partition", Ty::Text),
            ("client_id", Ty::Text),
            ("client_commit_id", Ty::Text),
            ("result", Ty::Jsonb),
        ],
    ),
    (
        "sync_reactions",
        &[
            ("partition", Ty::Text),
            ("idempotency_key", Ty::Text),
            ("type", Ty::Text),
            ("version", Ty::Integer),
            ("payload", Ty::Jsonb),
            ("source_client_id", Ty::Text),
            ("source_client_commit_id", Ty::Text),
            ("source_commit_seq", Ty::BigInt),
            ("created_at_ms", Ty::BigInt),
            ("available_at_ms", Ty::BigInt),
            ("status", Ty::Text),
            ("attempts", Ty::Integer),
            ("max_attempts", Ty::Integer),
            ("lease_owner", Ty::Text),
            ("lease_expires_at_ms", Ty::BigInt),
            ("completed_at_ms", Ty::BigInt),
            ("last_failure", Ty::Jsonb),
        ],
    ),
    (
        "sync_clients",
        &[
            ("partition", Ty::Text),
            ("client_id", Ty::Text),
            ("actor_id", Ty::Text),
            ("wire_version", Ty::Integer),
            ("cursor", Ty::BigInt),
            ("subscriptions", Ty::Jsonb),
            ("updated_at_ms", Ty::BigInt),
        ],
    ),
    (
        "sync_blob_refs",
        &[
            ("partition", Ty::Text),
            ("tbl", Ty::Text),
            ("row_id", Ty::Text),
            ("blob_id", Ty::Text),
        ],
    ),
    (
        "sync_tombstones",
        &[
            ("partition", Ty::Text),
            ("tbl", Ty::Text),
            ("row_id", Ty::Text),
            ("commit_seq", Ty::BigInt),
        ],
    ),
    (
        "sync_backfill_checkpoints",
        &[
            ("partition", Ty::Text),
            ("name", Ty::Text),
            ("schema_version", Ty::BigInt),
            ("state", Ty::Text),
            ("watermark", Ty::BigInt),
            ("owner_epoch", Ty::BigInt),
            ("observed_rows", Ty::BigInt),
            ("updated_at_ms", Ty::BigInt),
        ],
    ),
    (
        "sync_writer_fence",
        &[
            ("partition", Ty::Text),
            ("required_writer_version", Ty::BigInt),
        ],
    ),
    (
        "sync_schema_meta",
        &[
            ("id", Ty::Integer),
            ("schema_version", Ty::BigInt),
            ("layouts", Ty::Text),
        ],
    ),
];
/// A refusal of the source: `invalid_argument` on `source_schema` (DETAIL keys are exactly
/// `argument` and `reason`, docs/API.md §Errors), the table and what is wrong with it in the HINT.
fn refused(reason: &str, table: &str, what: &str) -> Error {
    Error::invalid_argument("source_schema", reason).with_hint(format!("{table}: {what}"))
}

/// What the relation cache holds for a source relation.
struct Described {
    ordinary: bool,
    temporary: bool,
    row_security: bool,
    owner: pg_sys::Oid,
    /// Name and type of each live column.
    columns: Vec<(String, pg_sys::Oid)>,
}

/// Reads the relation cache entry of `oid`, which the caller has locked.
fn describe(oid: pg_sys::Oid) -> Result<Described> {
    // SAFETY: the caller holds a lock on `oid` (its LOCK TABLE), so the relation can be neither
    // dropped nor altered while the reference is held; RelationIdGetRelation returns NULL for a
    // relation that does not exist (checked) and raises any other failure as a PostgreSQL error,
    // which pgrx turns into a Rust panic that `error::run` lets unwind to pgrx's guard. The
    // reference is released (RelationClose) when `rel` is dropped.
    let rel = unsafe {
        let ptr = pg_sys::RelationIdGetRelation(oid);
        if ptr.is_null() {
            return Err(Error::Internal(format!(
                "syncular: source relation {oid:?} vanished under its lock"
            )));
        }
        PgRelation::from_pg_owned(ptr)
    };
    // SAFETY: `rd_rel` of an open relation points to its pg_class row, valid while it is open.
    let form = unsafe { &*rel.rd_rel };
    let columns = rel
        .tuple_desc()
        .iter()
        .filter(|a| !a.attisdropped)
        .map(|a| {
            // Bytes up to the NUL, without assuming UTF-8 (no panic on another encoding).
            let name: Vec<u8> = a
                .attname
                .data
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            (String::from_utf8_lossy(&name).into_owned(), a.atttypid)
        })
        .collect();
    Ok(Described {
        ordinary: form.relkind == pg_sys::RELKIND_RELATION as core::ffi::c_char,
        temporary: form.relpersistence == pg_sys::RELPERSISTENCE_TEMP as core::ffi::c_char,
        row_security: form.relrowsecurity,
        owner: form.relowner,
        columns,
    })
}

/// A checked source table and the target columns copied from it.
struct Source {
    table: &'static str,
    /// Quoted, schema-qualified name.
    qualified: String,
    /// The relation's owner, whose rights it is read with.
    owner: pg_sys::Oid,
    columns: Vec<(&'static str, Ty)>,
}

/// Locks and checks the source of `table`; `None` when the source schema has no such relation.
///
/// Refused (`shape`): anything but an ordinary table — a view, materialized view or foreign
/// table runs host code when read, a partitioned table may have foreign partitions — as well as
/// a temporary table and a table with row-level security enabled (its policies are host code,
/// and the owner's rights might not bypass them). Refused (`type`): a copied column whose type
/// is not one its target accepts.
fn prepare(
    client: &SpiClient<'_>,
    schema: &str,
    table: &'static str,
    columns: &[(&'static str, Ty)],
) -> Result<Option<Source>> {
    // A first look, so LOCK TABLE is never asked to lock what it cannot (sequences, indexes)
    // or what it locks recursively (a view's base tables); the check that counts is below.
    let ordinary = db::first::<bool>(db::read(
        client,
        "SELECT c.relkind = 'r' FROM pg_catalog.pg_class c
           JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
          WHERE n.nspname = $1 AND c.relname = $2",
        &[schema.into(), table.into()],
    )?)?;
    match ordinary {
        None => return Ok(None),
        Some(false) => {
            return Err(refused(
                "shape",
                table,
                "not an ordinary, permanent table without row-level security",
            ))
        }
        Some(true) => {}
    }
    let qualified = format!("{}.{}", quote_identifier(schema), quote_identifier(table));
    // As the caller: its privileges decide whether it may lock and read the source.
    Spi::run(&format!("LOCK TABLE ONLY {qualified} IN EXCLUSIVE MODE"))?;
    // The name again, under the lock and through the catalog cache: the relation the copy
    // statement will read, whatever was renamed or replaced before the lock was granted.
    let oid = db::first::<pg_sys::Oid>(db::write(
        client,
        "SELECT pg_catalog.to_regclass($1)::oid",
        &[qualified.as_str().into()],
    )?)?
    .ok_or_else(|| Error::Internal(format!("syncular: {qualified} vanished under its lock")))?;
    let readable = db::first::<bool>(db::read(
        client,
        "SELECT pg_catalog.has_table_privilege($1, 'SELECT')",
        &[oid.into()],
    )?)?;
    if readable != Some(true) {
        return Err(Error::invalid_argument("source_schema", "privilege"));
    }
    let described = describe(oid)?;
    if !described.ordinary || described.temporary || described.row_security {
        return Err(refused(
            "shape",
            table,
            "not an ordinary, permanent table without row-level security",
        ));
    }
    // The source is read as its owner (see [`copy`]): an owner that revoked its own rights to it
    // is refused here rather than in the middle of the copy.
    let owner_reads = db::first::<bool>(db::read(
        client,
        "SELECT pg_catalog.has_table_privilege($1, c.oid, 'SELECT')
            AND pg_catalog.has_schema_privilege($1, c.relnamespace, 'USAGE')
           FROM pg_catalog.pg_class c WHERE c.oid = $2",
        &[described.owner.into(), oid.into()],
    )?)?;
    if owner_reads != Some(true) {
        return Err(refused("privilege", table, "its owner cannot read it"));
    }
    let mut copied = Vec::with_capacity(columns.len());
    for &(column, ty) in columns {
        let Some((_, source_type)) = described
            .columns
            .iter()
            .find(|(name, _)| name.as_str() == column)
        else {
            continue;
        };
        if !ty.accepts().contains(source_type) {
            return Err(refused(
                "type",
                table,
                &format!("column {column} is not of a built-in type its target accepts"),
            ));
        }
        copied.push((column, ty));
    }
    Ok(Some(Source {
        table,
        qualified,
        owner: described.owner,
        columns: copied,
    }))
}

/// The temporary table a source's rows are staged in on their way into the extension's table
/// (see [`copy`]); made and dropped for each source in turn.
const STAGE: &str = "pg_temp.syncular_adoption_stage";

/// Copies one checked source into its `syncular` table and returns the number of rows copied.
///
/// No statement that reads the source runs with the extension owner's or the operator's rights:
/// PostgreSQL runs host code while *planning* a read (it simplifies the constant parts of index
/// predicates and expressions, of statistics objects' expressions and, under
/// `constraint_exclusion`, of CHECK constraints, calling the IMMUTABLE functions in them) and
/// while executing it (a virtual generated column), whatever the statement's shape. So the read
/// runs as the source's owner in the sandbox (`tables::statements::stage_legacy_rows`, rule 1 of
/// docs/SECURITY.md), into a temporary table of the extension owner's, made before the sandbox is
/// entered (a restricted context cannot make temporary objects), whose columns have the target's
/// built-in types and on which the owner is granted only `INSERT`; the extension owner then
/// copies the staged rows, which no host code is attached to, and drops the stage.
fn copy(client: &SpiClient<'_>, source: &Source) -> Result<i64> {
    let grantee = db::first::<String>(db::read(
        client,
        "SELECT $1::pg_catalog.regrole::pg_catalog.text",
        &[source.owner.into()],
    )?)?
    .ok_or_else(|| Error::Internal("syncular: a source's owner has no name".into()))?;
    let targets: Vec<String> = source
        .columns
        .iter()
        .map(|(c, _)| quote_identifier(c))
        .collect();
    let definitions: Vec<String> = source
        .columns
        .iter()
        .map(|(c, ty)| format!("{} {}", quote_identifier(c), ty.sql()))
        .collect();
    access::as_extension_owner(|| {
        Spi::run(&format!(
            "CREATE TEMPORARY TABLE {STAGE} ({})",
            definitions.join(", ")
        ))?;
        // `grantee` is the owner's name as regrole prints it: quoted where it must be.
        Ok(Spi::run(&format!("GRANT INSERT ON {STAGE} TO {grantee}"))?)
    })?;
    let columns: Vec<tables::statements::LegacyColumn> = source
        .columns
        .iter()
        .map(|&(name, ty)| tables::statements::LegacyColumn {
            name,
            cast: ty.sql(),
            json: matches!(ty, Ty::Jsonb),
        })
        .collect();
    tables::statements::stage_legacy_rows(source.owner, &source.qualified, STAGE, &columns)?;
    access::as_extension_owner(|| {
        // The copied marker row is stamped with this transaction by its trigger (the row codec's
        // snapshot check, src/schema/stamp.rs).
        let copied = Spi::get_one::<i64>(&format!(
            "WITH copied AS (INSERT INTO syncular.{} ({}) SELECT {} FROM {STAGE} RETURNING 1)
             SELECT count(*) FROM copied",
            source.table,
            targets.join(", "),
            targets.join(", "),
        ))?
        .unwrap_or(0);
        if source.table == "sync_schema_meta" && copied > 0 && crate::schema::evolution::installed()
        {
            crate::schema::stamp::require_stamped()?;
        }
        Spi::run(&format!("DROP TABLE {STAGE}"))?;
        Ok(copied)
    })
}

/// The checks of the copied log, in the order they are reported: the table named in the
/// refusal, and a statement returning the problem (no row = consistent). Each is one pass over
/// its table (or an anti-join on a primary key), however many rows were copied.
const LOG_CHECKS: &[(&str, &str)] = &[
    // append_commit allocates max_commit_seq + 1 (a missing row counts as 0): below the
    // highest commit, every append of the partition would collide with an existing commit.
    (
        "sync_partitions",
        "SELECT 'allocator_below_commits'
           FROM (SELECT partition, max(commit_seq) AS top FROM syncular.sync_commits
                  GROUP BY partition) c
           LEFT JOIN syncular.sync_partitions p ON p.partition = c.partition
          WHERE coalesce(p.max_commit_seq, 0) < c.top
          LIMIT 1",
    ),
    // docs/DESIGN.md, invariant D3: every change belongs to a commit (they are pruned together).
    (
        "sync_changes",
        "SELECT 'commit_missing' FROM syncular.sync_changes ch
          WHERE NOT EXISTS (SELECT 1 FROM syncular.sync_commits c
                             WHERE c.partition = ch.partition AND c.commit_seq = ch.commit_seq)
          LIMIT 1",
    ),
    // docs/DESIGN.md §sync_changes, §Stored JSON: op 1 = upsert, 2 = delete (commit.rs `Op`);
    // scopes are an object of strings (what append_commit and set_row_scopes accept, and what
    // the pull window returns).
    // The CASE keeps the path query away from non-objects.
    (
        "sync_changes",
        "SELECT CASE WHEN ch.op NOT IN (1, 2) THEN 'unknown_op'
                     WHEN pg_catalog.jsonb_typeof(ch.scopes) <> 'object' THEN 'scopes_not_object'
                     ELSE 'scope_not_string' END
           FROM syncular.sync_changes ch
          WHERE CASE WHEN ch.op NOT IN (1, 2) THEN true
                     WHEN pg_catalog.jsonb_typeof(ch.scopes) <> 'object' THEN true
                     ELSE pg_catalog.jsonb_path_exists(
                            ch.scopes, 'strict $.* ? (@.type() != \"string\")', '{}', true) END
          LIMIT 1",
    ),
    // docs/DESIGN.md, invariants D4 and D6: the scope index covers live commits only.
    (
        "sync_change_scopes",
        "SELECT 'commit_missing' FROM syncular.sync_change_scopes s
          WHERE NOT EXISTS (SELECT 1 FROM syncular.sync_commits c
                             WHERE c.partition = s.partition AND c.commit_seq = s.commit_seq)
          LIMIT 1",
    ),
];

const PUSH_RESULTS_PAGE: i64 = 1000;
const PUSH_RESULTS_FIRST: &str = "\
SELECT partition, client_id, client_commit_id, result::text FROM syncular.sync_push_results
 ORDER BY partition, client_id, client_commit_id LIMIT $1";
const PUSH_RESULTS_AFTER: &str = "\
SELECT partition, client_id, client_commit_id, result::text FROM syncular.sync_push_results
 WHERE (partition, client_id, client_commit_id) > ($1 COLLATE \"C\", $2 COLLATE \"C\", $3 COLLATE \"C\")
 ORDER BY partition, client_id, client_commit_id LIMIT $4";

/// Whether some copied push result is one `get_push_result` could not read: not JSON serde can
/// represent (deeper than 128, numbers beyond f64 — where get_push_result fails), or rejected
/// by [`result::normalize`], the very rule `get_push_result` applies. Row by row, so walked in
/// pages of the primary key, each in its own SPI connection: memory stays bounded.
fn unreadable_push_result() -> Result<bool> {
    let mut after: Option<[String; 3]> = None;
    loop {
        let (rows, last, bad) = db::with_spi(|client| {
            let page = match &after {
                None => db::write(client, PUSH_RESULTS_FIRST, &[PUSH_RESULTS_PAGE.into()])?,
                Some(key) => db::write(
                    client,
                    PUSH_RESULTS_AFTER,
                    &[
                        key[0].as_str().into(),
                        key[1].as_str().into(),
                        key[2].as_str().into(),
                        PUSH_RESULTS_PAGE.into(),
                    ],
                )?,
            };
            let (mut rows, mut last) = (0, None);
            for row in page {
                crate::interrupts::check();
                rows += 1;
                let text = row.get::<String>(4)?.unwrap_or_default();
                let readable = serde_json::from_str::<Value>(&text)
                    .ok()
                    .is_some_and(|stored| result::normalize(stored).is_ok());
                if !readable {
                    return Ok((rows, None, true));
                }
                last = Some([
                    row.get::<String>(1)?.unwrap_or_default(),
                    row.get::<String>(2)?.unwrap_or_default(),
                    row.get::<String>(3)?.unwrap_or_default(),
                ]);
            }
            Ok((rows, last, false))
        })?;
        if bad {
            return Ok(true);
        }
        if rows < PUSH_RESULTS_PAGE {
            return Ok(false);
        }
        after = last;
    }
}

/// The first inconsistency of the copied log, as a refusal.
fn check_log(client: &SpiClient<'_>) -> Result<()> {
    for (table, sql) in LOG_CHECKS {
        if let Some(problem) = db::first::<String>(db::write(client, sql, &[])?)? {
            return Err(refused(
                "shape",
                table,
                &format!("inconsistent log: {problem}"),
            ));
        }
    }
    if unreadable_push_result()? {
        return Err(refused(
            "shape",
            "sync_push_results",
            "inconsistent log: unreadable_result",
        ));
    }
    Ok(())
}

fn adopt(client: &SpiClient<'_>, source: &str, app_schema: Option<&str>) -> Result<Value> {
    if source == "syncular" {
        return Err(Error::invalid_argument("source_schema", "reserved"));
    }
    let exists = db::first::<bool>(db::read(
        client,
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)",
        &[source.into()],
    )?)?;
    if exists != Some(true) {
        return Err(Error::invalid_argument("source_schema", "missing"));
    }
    let empty = access::as_extension_owner(|| {
        let any = ADOPTED
            .iter()
            .map(|(t, _)| format!("SELECT 1 FROM syncular.{t}"))
            .collect::<Vec<_>>()
            .join(" UNION ALL ");
        Ok(!Spi::get_one::<bool>(&format!("SELECT EXISTS ({any})"))?.unwrap_or(false))
    })?;
    if !empty {
        return Err(Error::invalid_argument("source_schema", "not_empty"));
    }
    // Every source is locked and checked before the first row is copied.
    let mut sources = Vec::with_capacity(ADOPTED.len());
    for (table, columns) in ADOPTED {
        sources.push((*table, prepare(client, source, table, columns)?));
    }
    let mut counts = Map::new();
    for ((table, checked), (_, columns)) in sources.iter().zip(ADOPTED) {
        pgrx::check_for_interrupts!();
        let copied = match checked {
            // Checked again right before its copy: the copies before it ran its owner's code
            // (see `copy`), which may have changed or replaced it since the first check.
            Some(_) => match prepare(client, source, table, columns)? {
                Some(checked) => copy(client, &checked)?,
                None => {
                    return Err(refused(
                        "shape",
                        table,
                        "dropped or renamed during the adoption",
                    ))
                }
            },
            None => 0,
        };
        counts.insert(table.to_string(), json!(copied));
    }
    access::as_extension_owner(|| check_log(client))?;
    let mut registered = 0;
    if let Some(app_schema) = app_schema {
        let layouts = access::as_extension_owner(|| {
            db::first::<String>(db::write(
                client,
                "SELECT layouts FROM syncular.sync_schema_meta WHERE id = 1",
                &[],
            )?)
        })?;
        let names: Vec<String> = layouts
            .and_then(|text| serde_json::from_str::<Value>(&text).ok())
            .and_then(|v| v.as_object().map(|m| m.keys().cloned().collect()))
            .unwrap_or_default();
        for name in names {
            crate::interrupts::check();
            let oid = db::first::<pg_sys::Oid>(db::read(
                client,
                "SELECT c.oid FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 AND c.relname = $2",
                &[app_schema.into(), name.as_str().into()],
            )?)?;
            if let Some(oid) = oid {
                tables::register(client, &name, oid, false, tables::Registrant::RelationOwner)?;
                registered += 1;
            }
        }
    }
    counts.insert("sync_app_tables".into(), json!(registered));
    Ok(Value::Object(counts))
}

#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.adopt_legacy_tables(source_schema name, app_schema name DEFAULT NULL)
RETURNS jsonb VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'adopt_legacy_tables_wrapper';
"#
)]
// `name` arguments arrive as pointers to NUL-terminated NameData, readable as C strings.
fn adopt_legacy_tables(
    source_schema: Option<&core::ffi::CStr>,
    app_schema: Option<&core::ffi::CStr>,
) -> JsonB {
    error::run(|| {
        // SAFETY: reads the transaction state of this backend; no allocation, never errors.
        if !unsafe { pg_sys::IsTransactionBlock() } {
            return Err(Error::invalid_transaction_state("no_transaction_block"));
        }
        db::with_spi(|client| {
            // An operator action: it writes every partition's log and reads the source with
            // the extension owner's rights.
            access::require_operator("source_schema")?;
            let text = |v: Option<&core::ffi::CStr>| v.map(|c| c.to_string_lossy().into_owned());
            let source = args::text("source_schema", text(source_schema).as_deref())?;
            let app_schema = text(app_schema).filter(|s| !s.is_empty());
            adopt(client, &source, app_schema.as_deref())
        })
        .map(JsonB)
    })
}
