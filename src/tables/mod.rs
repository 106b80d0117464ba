//! The app-table registry (docs/DESIGN.md §sync_app_tables) and the one place that touches a
//! host's relations.
//!
//! A registration keeps the relation's OID (`sync_app_tables.relation`) and the role that made it
//! (`registered_by`). Every use opens the relation by that OID, takes `AccessShareLock` (held to
//! the end of the transaction, so no rename, type change, rule or ownership change can slip in
//! between the check and the read) and re-checks it from the relation cache: an ordinary or
//! partitioned table, permanent, without rewrite rules, with the meta columns of docs/DESIGN.md
//! §App tables at their exact built-in types, still owned by a role the registrant holds the
//! privileges of.
//! Host rows are then read as the relation's owner, or written as the caller, in the sandbox of
//! [`sandbox::host_code`] — every such statement is in [`statements`], the only code of
//! the extension that can make host code run — never with the extension owner's rights, and
//! read only for a caller that holds `SELECT` on the relation. docs/SECURITY.md explains the
//! rules.
//!
//! - [`statements`]: every statement over a host relation's rows;
//! - [`payloads`]: the one read of a host relation below SQL (no host code can run in it);
//! - [`row_meta`]: the row-meta trigger that keeps row scopes in step with the host's writes;
//! - [`sandbox`]: the one place host code runs (a restricted security context, the pinned
//!   `search_path`, a GUC nest level discarded afterwards).
//!
//! `register_table` and `retire_table` are SECURITY INVOKER: they check the calling role
//! (ownership of the relation, the registrant's privileges for an existing registration), then
//! switch to the extension owner only around their writes to `sync_*` tables and the trigger
//! DDL.

use crate::access;
use crate::args;
use crate::db;
use crate::error::{self, Code, Error};
use crate::rows;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{quote_identifier, quote_literal, SpiClient};
use pgrx::JsonB;
use serde_json::json;
use std::ffi::CStr;

mod payloads;
pub mod row_meta;
mod sandbox;
pub mod statements;

pub use statements::{lock_all_for_rewrite, StoredRow};

/// A registered app table's relation, checked and locked for this transaction.
pub struct AppRelation {
    pub oid: pg_sys::Oid,
    /// The logical name it is registered under.
    tbl: String,
    /// Its schema.
    namespace: pg_sys::Oid,
    owner: pg_sys::Oid,
    qualified: String,
    /// What a statement reads, updates or deletes the rows of: `ONLY` the relation when it is an
    /// ordinary table, so the rows of an inheritance child (another relation, perhaps registered
    /// under another name with another layout) are never touched through it; a partitioned table
    /// as it is (its partitions hold its rows).
    rows: String,
    /// A partitioned table (its leaf partitions hold its rows).
    partitioned: bool,
    /// Row-level security is enabled (`relrowsecurity`).
    row_security: bool,
    /// A plain table on which no trigger can fire (not partitioned, `relhastriggers` false: no
    /// host trigger, no foreign key either way). Only such a table's rows are read and written
    /// in batches by the one-call push (docs/DESIGN.md §Push path, "Batches").
    pub triggerless: bool,
    /// The caller the API's reads of its rows are made for ([`AppRelation::read_by`]).
    reader: Option<pg_sys::Oid>,
}

impl AppRelation {
    /// The quoted, schema-qualified name of the locked relation, safe to splice into SQL.
    pub fn qualified(&self) -> &str {
        &self.qualified
    }

    /// The logical name the relation is registered under.
    pub fn tbl(&self) -> &str {
        &self.tbl
    }

    /// The role a statement over the relation runs as for `caller`: the less privileged of the
    /// two (docs/SECURITY.md rule 1). The relation's owner when the caller holds the owner's
    /// privileges anyway (a superuser's maintenance call, the migrator itself): host code then
    /// never runs with more rights than its author's. The caller otherwise (the serving role):
    /// host code then runs with the caller's rights, as when the caller queries the table
    /// itself, and nothing the caller planted in its session (a temporary view a host function
    /// resolves) ever runs with the owner's rights.
    pub fn acting_role(&self, caller: pg_sys::Oid) -> pg_sys::Oid {
        if access::has_privileges_of(caller, self.owner) {
            self.owner
        } else {
            caller
        }
    }

    /// The relation, read on behalf of `caller` (checked by [`AppRelation::readable_by`]).
    pub fn read_by(self, caller: pg_sys::Oid) -> AppRelation {
        AppRelation {
            reader: Some(caller),
            ..self
        }
    }

    /// Whether `role` may read the relation. A role holding the owner's privileges reads as the
    /// owner ([`AppRelation::acting_role`]); any other reads as itself and needs what a query of
    /// its own would: `USAGE` on the schema, `SELECT` on the relation — and no row-level security
    /// that would filter its reads (policies are not evaluated for it: such a caller is refused
    /// rather than shown a subset the protocol cannot tell apart from the whole).
    pub fn readable_by(&self, role: pg_sys::Oid) -> bool {
        if access::has_privileges_of(role, self.owner) {
            return true;
        }
        let usage = crate::port::namespace_usage(self.namespace, role);
        // SAFETY: ACL and role lookups through the syscache; errors surface as a caught
        // PostgreSQL error.
        let (select, exempt) = unsafe {
            (
                pg_sys::pg_class_aclcheck(self.oid, role, pg_sys::ACL_SELECT as pg_sys::AclMode)
                    == pg_sys::AclResult::ACLCHECK_OK,
                pg_sys::has_bypassrls_privilege(role),
            )
        };
        usage && select && (!self.row_security || exempt)
    }
}

/// One live column of a registered relation, as the catalog holds it.
pub struct RelationColumn {
    pub name: String,
    pub type_oid: pg_sys::Oid,
    pub not_null: bool,
}

impl AppRelation {
    /// The relation's live columns in attribute order, from the relation cache: catalog only,
    /// no host row is read and no host code runs (`set_push_schema` compares them with the
    /// push schema, docs/CODEC.md §Push schema).
    pub fn columns(&self) -> Vec<RelationColumn> {
        // SAFETY: `open` locked the relation for the transaction, so it exists; the descriptor
        // stays valid until `relation_close`, and everything read is copied before it.
        unsafe {
            let relation =
                pg_sys::relation_open(self.oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
            let attributes = pgrx::PgTupleDesc::from_pg_unchecked((*relation).rd_att);
            let columns = attributes
                .iter()
                .filter(|a| !a.attisdropped)
                .map(|a| RelationColumn {
                    name: CStr::from_ptr(a.attname.data.as_ptr())
                        .to_string_lossy()
                        .into_owned(),
                    type_oid: a.atttypid,
                    not_null: a.attnotnull,
                })
                .collect();
            drop(attributes);
            pg_sys::relation_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
            columns
        }
    }
}

/// Whether `tbl` has a registration, usable or not ([`open`] says which).
pub fn is_registered(client: &SpiClient<'_>, tbl: &str) -> error::Result<bool> {
    Ok(registration(client, tbl, false)?.is_some())
}

pub fn unknown_table(tbl: &str) -> Error {
    Error::new(Code::UnknownTable, json!({ "table": tbl }))
}

/// The meta columns of docs/DESIGN.md §App tables: name, exact type, NOT NULL required.
const META_COLUMNS: [(&CStr, pg_sys::Oid, bool); 6] = [
    (c"_sync_partition", pg_sys::TEXTOID, true),
    (c"_sync_row_id", pg_sys::TEXTOID, true),
    (c"_sync_server_version", pg_sys::INT8OID, true),
    (c"_sync_scopes", pg_sys::JSONBOID, true),
    (c"_sync_payload", pg_sys::BYTEAOID, true),
    (c"_sync_column_versions", pg_sys::BYTEAOID, false),
];

/// A relation as the relation cache holds it now, under `AccessShareLock`.
struct Inspected {
    owner: pg_sys::Oid,
    /// An ordinary table (not partitioned).
    ordinary: bool,
    /// A partitioned table or a partition: its rows may be another registration's too.
    in_partition_tree: bool,
    row_security: bool,
    triggerless: bool,
    schema: String,
    namespace: pg_sys::Oid,
    name: String,
    /// Why it cannot serve as an app table, if it cannot.
    unfit: Option<String>,
}

impl Inspected {
    fn qualified(&self) -> String {
        statements::kept_text(
            statements::TextKind::Qualified,
            &[Some(&self.schema), Some(&self.name)],
            || {
                format!(
                    "{}.{}",
                    quote_identifier(&self.schema),
                    quote_identifier(&self.name)
                )
            },
        )
    }
}

/// Opens relation `oid` with `AccessShareLock` (kept until the transaction ends) and inspects it;
/// `None` if no relation has that OID.
fn inspect(oid: pg_sys::Oid) -> Option<Inspected> {
    // SAFETY: `try_relation_open` returns NULL or an open relation whose `rd_rel` and `rd_att`
    // stay valid until `relation_close`; everything read from them is copied before the close,
    // and the lock is kept (NoLock on close) so the checked state holds for the transaction.
    unsafe {
        let relation = pg_sys::try_relation_open(oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        if relation.is_null() {
            return None;
        }
        let form = &*(*relation).rd_rel;
        let kind = form.relkind as u8;
        let unfit = if kind != pg_sys::RELKIND_RELATION && kind != pg_sys::RELKIND_PARTITIONED_TABLE
        {
            Some("it is not a table (a view, foreign table or other relation kind)".to_string())
        } else if form.relhasrules {
            Some("it has rewrite rules".to_string())
        } else if form.relpersistence as u8 == pg_sys::RELPERSISTENCE_TEMP {
            Some("it is a temporary table".to_string())
        } else {
            meta_column_problem((*relation).rd_att)
        };
        let schema_ptr = pg_sys::get_namespace_name(form.relnamespace);
        let schema = if schema_ptr.is_null() {
            String::new()
        } else {
            CStr::from_ptr(schema_ptr).to_string_lossy().into_owned()
        };
        let inspected = Inspected {
            owner: form.relowner,
            ordinary: kind == pg_sys::RELKIND_RELATION,
            in_partition_tree: kind == pg_sys::RELKIND_PARTITIONED_TABLE || form.relispartition,
            row_security: form.relrowsecurity,
            triggerless: kind == pg_sys::RELKIND_RELATION && !form.relhastriggers,
            schema,
            namespace: form.relnamespace,
            name: CStr::from_ptr(form.relname.data.as_ptr())
                .to_string_lossy()
                .into_owned(),
            unfit,
        };
        pg_sys::relation_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
        Some(inspected)
    }
}

/// The first meta column that is missing or not exactly of its type and nullability.
///
/// # Safety
/// `descriptor` is the tuple descriptor of an open relation.
unsafe fn meta_column_problem(descriptor: pg_sys::TupleDesc) -> Option<String> {
    // SAFETY: the caller guarantees an open relation's descriptor.
    let attributes = unsafe { pgrx::PgTupleDesc::from_pg_unchecked(descriptor) };
    META_COLUMNS.iter().find_map(|(name, typ, not_null)| {
        let found = attributes
            .iter()
            .find(|a| !a.attisdropped && crate::catalog::is_named(a, name));
        let expected = || {
            let typ = match *typ {
                pg_sys::TEXTOID => "text",
                pg_sys::INT8OID => "bigint",
                pg_sys::JSONBOID => "jsonb",
                _ => "bytea",
            };
            format!(
                "column {} must be of type {typ}{}",
                name.to_string_lossy(),
                if *not_null { " NOT NULL" } else { "" }
            )
        };
        match found {
            Some(a) if a.atttypid == *typ && (a.attnotnull || !not_null) => None,
            _ => Some(expected()),
        }
    })
}

/// A registration as stored.
struct Registration {
    relation: pg_sys::Oid,
    registered_by: pg_sys::Oid,
    /// Another name the same relation is registered under (read without `FOR UPDATE` only):
    /// registrations made before `register_table` refused it (red team 5, R5-1).
    also: Option<String>,
}

/// The registration of `tbl`, read as the extension owner; `FOR UPDATE` when it will change.
/// Without, it is read below SQL — a lookup by the primary key and a scan for the relation's
/// other names, no statement (docs/BENCHMARKS.md, "Server CPU"); through SQL where Citus keeps
/// the table on another node.
fn registration(
    client: &SpiClient<'_>,
    tbl: &str,
    for_update: bool,
) -> error::Result<Option<Registration>> {
    if !for_update {
        if let Some(found) = registration_here(tbl)? {
            return Ok(found);
        }
    }
    crate::heap::registry_read_here()?;
    let args = [DatumWithOid::from(tbl)];
    let table = access::as_extension_owner(|| {
        if for_update {
            db::write(
                client,
                "SELECT a.relation::oid, a.registered_by::oid, NULL::text
                   FROM syncular.sync_app_tables a WHERE a.tbl = $1 FOR UPDATE",
                &args,
            )
        } else {
            db::read(
                client,
                "SELECT a.relation::oid, a.registered_by::oid,
                        (SELECT min(b.tbl) FROM syncular.sync_app_tables b
                          WHERE b.relation = a.relation AND b.tbl <> a.tbl)
                   FROM syncular.sync_app_tables a WHERE a.tbl = $1",
                &args,
            )
        }
    })?;
    if table.is_empty() {
        return Ok(None);
    }
    let row = table.first();
    Ok(Some(Registration {
        relation: row.get::<pg_sys::Oid>(1)?.unwrap_or(pg_sys::InvalidOid),
        registered_by: row.get::<pg_sys::Oid>(2)?.unwrap_or(pg_sys::InvalidOid),
        also: row.get::<String>(3)?,
    }))
}

/// [`registration`] below SQL: `None` when Citus keeps `sync_app_tables` on another node (read
/// it through SQL then), else the registration and the least other name (`COLLATE "C"`) of its
/// relation, both in the snapshot the statement it replaces read with (`heap::with_snapshot`).
fn registration_here(tbl: &str) -> error::Result<Option<Option<Registration>>> {
    use crate::heap::{self, SyncTable};
    heap::with_snapshot(false, |snapshot| {
        // SAFETY: the snapshot is registered around the lookups.
        let Some(found) = (unsafe { registered_in(tbl, snapshot)? }) else {
            return Ok(None);
        };
        let Some((relation, registered_by)) = found else {
            return Ok(Some(None));
        };
        let mut also: Option<String> = None;
        let key = [(
            c"relation",
            pg_sys::Datum::from(relation),
            (pg_sys::F_OIDEQ, pg_sys::InvalidOid),
        )];
        // SAFETY: as above; the key is an OID datum, passed by value.
        let here = unsafe {
            heap::rows_where(SyncTable::AppTables, None, &key, snapshot, |row| {
                let name = row.text(c"tbl")?.unwrap_or_default();
                if name != tbl && also.as_ref().is_none_or(|least| name < *least) {
                    also = Some(name);
                }
                Ok(true)
            })?
        };
        Ok(here.then_some(Some(Registration {
            relation,
            registered_by,
            also,
        })))
    })
}

/// `(relation, registered_by)` of `tbl` by the primary key of `sync_app_tables`, in `snapshot`:
/// `None` when Citus keeps the table on another node, `Some(None)` without a registration.
///
/// # Safety
/// Inside a transaction; `snapshot` is registered or active.
unsafe fn registered_in(
    tbl: &str,
    snapshot: pg_sys::Snapshot,
) -> error::Result<Option<Option<(pg_sys::Oid, pg_sys::Oid)>>> {
    use crate::heap::{self, Lookup, SyncTable};
    let key = [heap::text_key(tbl)];
    // SAFETY: the key is a text datum built here, alive for the lookup; the caller's snapshot.
    let found = unsafe {
        heap::by_primary_key(SyncTable::AppTables, None, &key, snapshot, |row| {
            row.map(|row| {
                let oid = |column| row.oid(column).map(|o| o.unwrap_or(pg_sys::InvalidOid));
                Ok((oid(c"relation")?, oid(c"registered_by")?))
            })
            .transpose()
        })?
    };
    Ok(match found {
        Lookup::Here(found, _) => Some(found),
        Lookup::Elsewhere => None,
    })
}

/// The relation registered as `tbl` now — with a fresh snapshot, as after a lock wait — below
/// SQL: `None` when Citus keeps `sync_app_tables` on another node, `Some(None)` without a
/// registration.
pub fn registered_relation_now(tbl: &str) -> error::Result<Option<Option<pg_sys::Oid>>> {
    crate::heap::with_snapshot(true, |snapshot| {
        // SAFETY: the snapshot is registered around the lookup.
        let found = unsafe { registered_in(tbl, snapshot)? };
        Ok(found.map(|found| found.map(|(relation, _)| relation)))
    })
}

/// The registered relation of `tbl`, checked and locked, or why it cannot be used (a hint for
/// `unknown_table`).
pub fn open(client: &SpiClient<'_>, tbl: &str) -> error::Result<Result<AppRelation, String>> {
    if tbl.starts_with("sync_") {
        return Ok(Err("names starting with sync_ are reserved".into()));
    }
    let Some(registration) = registration(client, tbl, false)? else {
        return Ok(Err("no relation is registered for this table".into()));
    };
    let Some(relation) = inspect(registration.relation) else {
        return Ok(Err("the registered relation no longer exists".into()));
    };
    if let Some(other) = &registration.also {
        return Ok(Err(format!(
            "the registered relation is registered as {other} too: their rows are the same \
             rows, read with two layouts; retire one of the two names (syncular.retire_table)"
        )));
    }
    if let Some(unfit) = relation.unfit {
        return Ok(Err(format!(
            "the registered relation changed and cannot be used: {unfit}; register it again"
        )));
    }
    if !access::has_privileges_of(registration.registered_by, relation.owner) {
        return Ok(Err(
            "the registered relation changed owner to a role its registrant does not hold; register it again".into(),
        ));
    }
    // Checked at registration and again here: ATTACH PARTITION can join two registered
    // relations afterwards (red team 4, C1). Only a relation of a partition tree pays the query.
    if relation.in_partition_tree {
        if let Some(other) = overlapping(client, registration.relation, tbl)? {
            return Ok(Err(format!(
                "the registered relation is now a partition, or the partitioned parent, of the \
                 relation registered as {other}: their rows are the same rows; retire one of \
                 them (syncular.retire_table) or detach the partition"
            )));
        }
    }
    let qualified = relation.qualified();
    Ok(Ok(AppRelation {
        oid: registration.relation,
        tbl: tbl.to_string(),
        namespace: relation.namespace,
        owner: relation.owner,
        rows: if relation.ordinary {
            format!("ONLY {qualified}")
        } else {
            qualified.clone()
        },
        qualified,
        partitioned: !relation.ordinary,
        row_security: relation.row_security,
        triggerless: relation.triggerless,
        reader: None,
    }))
}

/// The registered relation of `tbl` whose stored payloads `migrate_schema` re-encodes
/// (src/schema/evolution.rs): `None` when `tbl` is not registered or its relation no longer
/// exists (no stored rows to rewrite), `unknown_table` (HINT: why) when it exists but cannot be
/// used as registered — its rows would stay unreadable at the new version.
pub fn open_for_migration(client: &SpiClient<'_>, tbl: &str) -> error::Result<Option<AppRelation>> {
    let Some(registration) = registration(client, tbl, false)? else {
        return Ok(None);
    };
    if inspect(registration.relation).is_none() {
        return Ok(None);
    }
    match open(client, tbl)? {
        Ok(relation) => Ok(Some(relation)),
        Err(why) => Err(unknown_table(tbl).with_hint(format!(
            "{why}: migrate_schema re-encodes the stored rows of every registered table whose \
             layout grew (register the table again, or retire it)"
        ))),
    }
}

/// Why the relation opened as `relation` can no longer be used as it was checked, if it cannot:
/// host code of an earlier statement of the same call renamed it (so its name now names another
/// relation, or none), changed its owner, its kind, its rules, its triggers or a meta column. The
/// lock this transaction holds keeps other sessions out, not the transaction's own DDL.
fn changed_since_open(relation: &AppRelation) -> Option<String> {
    let Some(now) = inspect(relation.oid) else {
        return Some("the relation was dropped".into());
    };
    if let Some(unfit) = now.unfit.clone() {
        return Some(unfit);
    }
    if now.qualified() != relation.qualified {
        return Some(format!("the relation was renamed to {}", now.qualified()));
    }
    if now.owner != relation.owner {
        return Some("the relation changed owner".into());
    }
    if now.triggerless != relation.triggerless || now.row_security != relation.row_security {
        return Some("a trigger or row-level security was added to the relation".into());
    }
    None
}

/// `unknown_table` for a relation that changed during the call ([`changed_since_open`]).
fn unknown_table_changed(relation: &AppRelation, why: String) -> Error {
    unknown_table(&relation.tbl).with_hint(format!(
        "the registered relation changed during this call ({why}); nothing of the call is kept"
    ))
}

/// The registered relation of `tbl` for a read by `caller`: `unknown_table` when it cannot be
/// used, `invalid_argument` (`tbl`, `privilege`) when the caller may not `SELECT` from it.
pub fn open_for_read(
    client: &SpiClient<'_>,
    tbl: &str,
    caller: pg_sys::Oid,
) -> error::Result<AppRelation> {
    let relation = open(client, tbl)?.map_err(|why| unknown_table(tbl).with_hint(why))?;
    if !relation.readable_by(caller) {
        return Err(Error::invalid_argument("tbl", "privilege").with_hint(
            "the calling role needs USAGE on the registered relation's schema and SELECT on it, and no row-level security that applies to it",
        ));
    }
    Ok(relation.read_by(caller))
}

/// Reads the host's row: SECURITY INVOKER, because the caller must hold `SELECT` on the
/// relation; the row is read as the relation's owner in a restricted security context
/// ([`open_for_read`], [`statements`], docs/SECURITY.md).
#[pg_extern(stable, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn get_row_scopes(
    partition: Option<&str>,
    tbl: Option<&str>,
    row_id: Option<&str>,
) -> Option<JsonB> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let tbl = args::text("tbl", tbl)?;
        let row_id = args::key("row_id", row_id)?;
        let caller = access::current_role();
        db::with_spi(|client| {
            let relation = open_for_read(client, &tbl, caller)?;
            Ok(relation.row_scopes(client, &partition, &row_id)?.map(JsonB))
        })
    })
}

/// Every registration, by logical name: `[{table, relation, registeredBy, maintainRowMeta,
/// registeredAtMs}]`; `relation` is the relation's current qualified name, or NULL once it is
/// gone (such a registration is no longer read; retire or register it again).
#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn list_tables() -> JsonB {
    error::run(|| {
        crate::heap::registry_read_here()?;
        db::with_spi(|client| {
            let list = db::read(
                client,
                "SELECT coalesce(pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
                          'table', a.tbl,
                          'relation', CASE WHEN c.oid IS NULL THEN NULL
                                           ELSE pg_catalog.quote_ident(n.nspname) || '.'
                                                || pg_catalog.quote_ident(c.relname) END,
                          'registeredBy', r.rolname,
                          'maintainRowMeta', a.maintain_row_meta,
                          'registeredAtMs', a.registered_at_ms) ORDER BY a.tbl), '[]')
                   FROM syncular.sync_app_tables a
                   LEFT JOIN pg_catalog.pg_class c ON c.oid = a.relation
                   LEFT JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                   LEFT JOIN pg_catalog.pg_roles r ON r.oid = a.registered_by",
                &[],
            )?;
            Ok(JsonB(
                db::first::<crate::jsonb::JsonValue>(list)?.map_or_else(|| json!([]), |v| v.0),
            ))
        })
    })
}

/// Drops the row-meta trigger from relation `oid`, if the relation and the trigger exist (checked
/// first, so a registration prints no NOTICE).
fn drop_row_meta_trigger(client: &SpiClient<'_>, oid: pg_sys::Oid) -> error::Result<()> {
    let Some(relation) = inspect(oid) else {
        return Ok(());
    };
    let installed = db::first::<bool>(db::read(
        client,
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger
                         WHERE tgrelid = $1 AND tgname = 'syncular_row_meta')",
        &[DatumWithOid::from(oid)],
    )?)?;
    if installed == Some(true) {
        Spi::run(&format!(
            "DROP TRIGGER syncular_row_meta ON {}",
            relation.qualified()
        ))?;
    }
    Ok(())
}

/// Refuses (`invalid_argument` on `argument`, reason `privilege`) a caller that does not hold
/// the privileges of the role that made an existing registration.
fn require_registrant(caller: pg_sys::Oid, previous: &Registration) -> error::Result<()> {
    if access::has_privileges_of(caller, previous.registered_by) {
        Ok(())
    } else {
        Err(Error::invalid_argument("tbl", "privilege").with_hint(
            "this table is registered by a role whose privileges the caller does not hold",
        ))
    }
}

/// The primary key must be `(_sync_partition, _sync_row_id)`, in that order.
const PRIMARY_KEY_SQL: &str = "\
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_index i
                WHERE i.indrelid = $1 AND i.indisprimary
                  AND (SELECT array_agg(a.attname::text ORDER BY k.ord)
                         FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
                         JOIN pg_catalog.pg_attribute a ON a.attrelid = $1 AND a.attnum = k.attnum)
                      = ARRAY['_sync_partition', '_sync_row_id'])";

/// Whom a new registration belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Registrant {
    /// The calling role (`register_table`).
    Caller,
    /// The relation's owner: `adopt_legacy_tables`, an operator action, registers the tables of
    /// an adopted database on behalf of the roles that own them, so their migrations can
    /// re-register and retire them as before.
    RelationOwner,
}

/// Another registered table whose relation is `$1` itself (one relation under two names: red
/// team 5, R5-1) or a partition ancestor or descendant of it.
const OVERLAPPING_SQL: &str = "\
SELECT a.tbl FROM syncular.sync_app_tables a
 WHERE a.tbl <> $2
   AND a.relation::pg_catalog.oid IN (
     SELECT $1::pg_catalog.oid
     UNION ALL
     SELECT t.relid::pg_catalog.oid FROM pg_catalog.pg_partition_ancestors($1::pg_catalog.regclass) t
     UNION ALL
     SELECT t.relid::pg_catalog.oid FROM pg_catalog.pg_partition_tree($1::pg_catalog.regclass) t)
 ORDER BY a.tbl LIMIT 1";

/// The first other registered table ([`OVERLAPPING_SQL`]) whose rows are rows of `relation`,
/// registered as `tbl`, too.
fn overlapping(
    client: &SpiClient<'_>,
    relation: pg_sys::Oid,
    tbl: &str,
) -> error::Result<Option<String>> {
    crate::heap::registry_read_here()?;
    access::as_extension_owner(|| {
        db::first::<String>(db::read(
            client,
            OVERLAPPING_SQL,
            &[DatumWithOid::from(relation), DatumWithOid::from(tbl)],
        )?)
    })
}

/// `register_table` for an already validated name; shared with `adopt_legacy_tables`.
/// The barrier's lock (`EXCLUSIVE` on `sync_partitions`, as `migrate_schema` takes it), for a
/// registration change: it waits for every push holding a partition lock and keeps new ones out
/// until it commits, so a one-call push never writes with a registration that changed under it
/// (it reads them again once it holds its lock: src/push/open.rs, red team 11, C1). Taken first,
/// before any lock on the app relation, as the migration takes it (docs/DESIGN.md §Lock order).
fn hold_pushes(client: &SpiClient<'_>) -> error::Result<()> {
    access::as_extension_owner(|| db::lock_barrier(client))
}

pub fn register(
    client: &SpiClient<'_>,
    tbl: &str,
    relation: pg_sys::Oid,
    maintain_row_meta: bool,
    registrant: Registrant,
) -> error::Result<()> {
    if tbl.starts_with("sync_") {
        return Err(Error::invalid_argument("tbl", "reserved"));
    }
    // The barrier's lock before any lock on the relation: a migration holds it while its DDL
    // waits for the relation, so taking them the other way round deadlocks with a host's startup
    // (red team 12, C3).
    hold_pushes(client)?;
    let caller = access::current_role();
    let Some(target) = inspect(relation) else {
        return Err(Error::invalid_argument("relation", "missing"));
    };
    if !access::has_privileges_of(caller, target.owner) {
        return Err(Error::invalid_argument("relation", "privilege")
            .with_hint("the calling role must own the relation"));
    }
    if let Some(unfit) = &target.unfit {
        return Err(Error::invalid_argument("relation", "shape").with_hint(unfit.clone()));
    }
    let keyed = db::first::<bool>(db::read(
        client,
        PRIMARY_KEY_SQL,
        &[DatumWithOid::from(relation)],
    )?)?;
    if keyed != Some(true) {
        return Err(Error::invalid_argument("relation", "shape")
            .with_hint("the primary key must be (_sync_partition, _sync_row_id)"));
    }
    let previous = registration(client, tbl, true)?;
    let registered_by = match registrant {
        Registrant::Caller => caller,
        Registrant::RelationOwner => target.owner,
    };
    if let Some(previous) = &previous {
        require_registrant(caller, previous)?;
        // Adoption registers on behalf of the relation's owner: the operator holds every role's
        // privileges, the owner may not (a 0.24 schema a host prepared would otherwise re-point
        // another role's registration to the host's own table).
        require_registrant(registered_by, previous)?;
    }
    // The relation registered under another name, a partition of a registered partitioned
    // table, or the partitioned parent of a registered partition holds the other registration's
    // rows: every statement over it reads and writes them too, with its own push schema and
    // layouts (red teams 3 and 5). One of the two.
    if let Some(other) = overlapping(client, relation, tbl)? {
        return Err(
            Error::invalid_argument("relation", "shape").with_hint(format!(
                "the relation is registered as {other} already, or is a partition or the \
             partitioned parent of the relation registered as {other}: their rows are the same \
             rows; register only one of them"
            )),
        );
    }
    access::as_extension_owner(|| {
        if let Some(previous) = &previous {
            drop_row_meta_trigger(client, previous.relation)?;
        }
        drop_row_meta_trigger(client, relation)?;
        db::write(
            client,
            "INSERT INTO syncular.sync_app_tables
               (tbl, relation_schema, relation_name, maintain_row_meta, registered_at_ms,
                relation, registered_by)
             VALUES ($1, $2, $3, $4,
                     (extract(epoch FROM pg_catalog.transaction_timestamp()) * 1000)::bigint,
                     $5::oid::regclass, $6::oid::regrole)
             ON CONFLICT (tbl) DO UPDATE
               SET relation_schema = EXCLUDED.relation_schema,
                   relation_name = EXCLUDED.relation_name,
                   maintain_row_meta = EXCLUDED.maintain_row_meta,
                   registered_at_ms = EXCLUDED.registered_at_ms,
                   relation = EXCLUDED.relation,
                   registered_by = EXCLUDED.registered_by",
            &[
                DatumWithOid::from(tbl),
                DatumWithOid::from(target.schema.as_str()),
                DatumWithOid::from(target.name.as_str()),
                DatumWithOid::from(maintain_row_meta),
                DatumWithOid::from(relation),
                DatumWithOid::from(registered_by),
            ],
        )?;
        if maintain_row_meta {
            Spi::run(&format!(
                "CREATE TRIGGER syncular_row_meta
                   AFTER INSERT OR UPDATE OF \"_sync_scopes\" OR DELETE ON {}
                   FOR EACH ROW EXECUTE FUNCTION syncular.row_meta_trigger({})",
                target.qualified(),
                quote_literal(tbl)
            ))?;
        }
        Ok(())
    })?;
    // A new registration names the layout its relation's rows are read with; rows it already
    // holds were written under no name (the host's own bytes) or under another one (a relation
    // retired and registered again: red team 10, B1; red team 9, R9-2), of a layout nothing
    // records. Adoption registers 0.24's tables with their rows (`Registrant::RelationOwner`),
    // whose layouts it adopts with the marker.
    let renamed = previous.as_ref().is_none_or(|p| p.relation != relation);
    if renamed && matches!(registrant, Registrant::Caller) {
        if let Ok(registered) = open(client, tbl)? {
            registered.lock_against_writers(caller)?;
            if registered.has_rows(client, caller)? {
                return Err(
                    Error::invalid_argument("relation", "not_empty").with_hint(format!(
                        "relation {} holds rows, and registering it as {tbl} would read them with \
                     the layouts of {tbl}, which nothing says they have (written by the host \
                     itself, or under another name): register it empty, then write its rows \
                     (encode_row at the stored schema version), or keep its registration",
                        target.qualified()
                    )),
                );
            }
        }
    }
    Ok(())
}

#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.register_table(tbl text, relation regclass, maintain_row_meta boolean DEFAULT false)
RETURNS void VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'register_table_wrapper';
"#
)]
fn register_table(
    tbl: Option<&str>,
    relation: Option<pg_sys::Oid>,
    maintain_row_meta: Option<bool>,
) {
    error::run(|| {
        let tbl = args::text("tbl", tbl)?;
        let relation = args::required("relation", relation)?;
        let maintain = maintain_row_meta.unwrap_or(false);
        db::with_spi(|client| register(client, &tbl, relation, maintain, Registrant::Caller))
    })
}

#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.retire_table(tbl text) RETURNS jsonb
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'retire_table_wrapper';
"#
)]
fn retire_table(tbl: Option<&str>) -> JsonB {
    error::run(|| {
        let tbl = args::text("tbl", tbl)?;
        if tbl.starts_with("sync_") {
            return Err(unknown_table(&tbl));
        }
        let caller = access::current_role();
        db::with_spi(|client| {
            hold_pushes(client)?;
            let previous = registration(client, &tbl, true)?;
            match &previous {
                Some(previous) => require_registrant(caller, previous)?,
                // Metadata under a name nobody registered belongs to no host: operators only.
                None if !access::is_operator(caller)? => {
                    return Err(Error::invalid_argument("tbl", "privilege").with_hint(
                        "only the extension owner or a superuser retires a table that is not registered",
                    ))
                }
                None => {}
            }
            access::as_extension_owner(|| {
                let (row_scopes, blob_refs) = rows::delete_table_meta(client, &tbl)?;
                if let Some(previous) = &previous {
                    drop_row_meta_trigger(client, previous.relation)?;
                    db::write(
                        client,
                        "DELETE FROM syncular.sync_app_tables WHERE tbl = $1",
                        &[DatumWithOid::from(tbl.as_str())],
                    )?;
                }
                Ok(JsonB(
                    json!({"rowScopes": row_scopes, "blobRefs": blob_refs, "registered": previous.is_some()}),
                ))
            })
        })
    })
}
