//! Row metadata of the host's app rows (docs/DESIGN.md §App-table registry and row metadata):
//! the scope index of current rows, blob references, and delete-precedence tombstones. Only
//! `sync_*` tables are read and written here; reading an app row (`get_row_scopes`) is
//! [`crate::tables`]' business.

use crate::args;
use crate::db;
use crate::error::{self, Error, Result};
use crate::materialized;
use crate::scope;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use pgrx::JsonB;
use serde_json::{json, Map, Value};
use std::collections::{HashMap, HashSet};

/// Makes each row's `sync_row_scopes` entries exactly its `(var, value)` pairs, for any number
/// of rows of one table. Returns the number of entries the rows now hold.
///
/// Most writes of a row leave its scopes as they were (an update of other columns), so the
/// entries are read first and only rows whose entries differ are written. The read runs with a
/// fresh snapshot that includes this transaction's latest writes (earlier firings of the
/// row-meta trigger in the same statement).
pub fn set_scopes_many(
    client: &SpiClient<'_>,
    partition: &str,
    tbl: &str,
    rows: &[(&str, &Map<String, Value>)],
) -> Result<i64> {
    // Below SQL in READ COMMITTED only, as the insert of the missing entries: the statements
    // elsewhere, both ways held together by the differential test.
    let below_sql = match crate::heap::read_committed() {
        true => held_below_sql(partition, tbl, rows)?,
        false => None,
    };
    let mut held_by_row = match below_sql {
        Some(held) => held,
        None => held_by_statement(client, partition, tbl, rows)?,
    };
    // What each row holds and should not (stale), and should hold and does not (missing).
    let mut stale: Vec<(&str, String, String)> = Vec::new();
    let mut missing: Vec<(&str, &str, &str)> = Vec::new();
    for (row_id, scopes) in rows {
        crate::interrupts::check();
        let held = held_by_row.remove(*row_id).unwrap_or_default();
        // Sets: a row may hold as many variables as its writer gave it (red team 41, F4: the
        // pairwise comparison was quadratic in them).
        let holds: HashSet<(&str, &str)> =
            held.iter().map(|(v, x)| (v.as_str(), x.as_str())).collect();
        let want: HashSet<(&str, &str)> = entries_of(scopes).collect();
        for (var, value) in entries_of(scopes) {
            crate::interrupts::check();
            if !holds.contains(&(var, value)) {
                missing.push((*row_id, var, value));
            }
        }
        for (var, value) in &held {
            crate::interrupts::check();
            if !want.contains(&(var.as_str(), value.as_str())) {
                stale.push((*row_id, var.clone(), value.clone()));
            }
        }
    }
    // Stale entries are rare (a row whose scopes changed), each removed by its primary key: a
    // probe whatever the plan was made from. The row-meta trigger runs under the host row's
    // lock, so no other session changes the row's entries between the read and these writes;
    // two direct `set_row_scopes` calls for one row race as two statements did before.
    for (row_id, var, value) in &stale {
        crate::interrupts::check();
        db::write_generic(
            client,
            "DELETE FROM syncular.sync_row_scopes
              WHERE partition = $1 AND tbl = $2 AND var = $3 AND value = $4 AND row_id = $5",
            &[
                DatumWithOid::from(partition),
                DatumWithOid::from(tbl),
                DatumWithOid::from(var.as_str()),
                DatumWithOid::from(value.as_str()),
                DatumWithOid::from(*row_id),
            ],
        )?;
    }
    if !missing.is_empty() {
        insert_missing(client, partition, tbl, &missing)?;
    }
    Ok(rows.iter().map(|(_, scopes)| scopes.len() as i64).sum())
}

/// Each row's `(var, value)` entries, by row id.
type Held = HashMap<String, Vec<(String, String)>>;

/// [`Held`] read below SQL: one scan of `sync_row_scopes_by_row` per row id, the table and index
/// opened once for all of them (`heap::with_reader_on`), with a fresh snapshot (after the command
/// counter moved past this transaction's writes, as the statement's); `None` where the index is
/// not there under its name (a Citus shard's carries a suffix) or Citus keeps the partition's
/// shard on another node: the statement reads then.
fn held_below_sql(
    partition: &str,
    tbl: &str,
    rows: &[(&str, &Map<String, Value>)],
) -> Result<Option<Held>> {
    let by_row = (
        c"sync_row_scopes_by_row",
        &[c"partition", c"tbl", c"row_id"][..],
    );
    crate::heap::with_snapshot(true, |snapshot| {
        // SAFETY: inside the call's transaction, with the snapshot registered around this
        // closure; the keys are text datums built for each scan, alive until it ends, and every
        // scan begun here is ended here.
        let read = unsafe {
            crate::heap::with_reader_on(
                crate::heap::SyncTable::RowScopes,
                Some(partition),
                Some(by_row),
                |reader, by_name| {
                    if !by_name {
                        return Ok(None);
                    }
                    let mut held = Held::new();
                    for (row_id, _) in rows {
                        crate::interrupts::check();
                        let keys = [partition, tbl, row_id].map(crate::heap::text_key);
                        let entries = held.entry((*row_id).to_string()).or_default();
                        let mut scan = reader.scan(&keys, None, snapshot)?;
                        let read = (|| -> Result<()> {
                            while let Some(entry) = scan.next(|row| {
                                let text = |column| row.text(column).map(Option::unwrap_or_default);
                                Ok((text(c"var")?, text(c"value")?))
                            })? {
                                entries.push(entry);
                            }
                            Ok(())
                        })();
                        scan.end();
                        read?;
                    }
                    Ok(Some(held))
                },
            )
        }?;
        Ok(read.flatten())
    })
}

/// [`Held`] read by statement: one index probe per row id, whatever the kept generic plan was
/// made from — the row ids drive a nested loop into `sync_row_scopes_by_row` (a LATERAL
/// reference is a join parameter, an index condition on all three columns). `row_id = ANY ($3)`
/// instead let PostgreSQL 15 keep a plan made while the table was empty, with the array as a
/// filter over all of the table's entries in the partition: a bulk insert through the row-meta
/// trigger was quadratic (docs/DESIGN.md §App-table registry and row metadata).
fn held_by_statement(
    client: &SpiClient<'_>,
    partition: &str,
    tbl: &str,
    rows: &[(&str, &Map<String, Value>)],
) -> Result<Held> {
    let entries = db::write_generic(
        client,
        "SELECT k.row_id, r.var::text, r.value::text
           FROM pg_catalog.unnest($3::text[]) AS k(row_id),
                LATERAL (SELECT r.var, r.value FROM syncular.sync_row_scopes r
                          WHERE r.partition = $1 AND r.tbl = $2
                            AND r.row_id = k.row_id COLLATE \"C\" OFFSET 0) r",
        &[
            DatumWithOid::from(partition),
            DatumWithOid::from(tbl),
            DatumWithOid::from(rows.iter().map(|r| r.0).collect::<Vec<_>>()),
        ],
    )?;
    let mut held = Held::new();
    for entry in entries {
        crate::interrupts::check();
        let text = |i| entry.get::<String>(i).map(Option::unwrap_or_default);
        held.entry(text(1)?).or_default().push((text(2)?, text(3)?));
    }
    Ok(held)
}

const ROW_SCOPE_COLUMNS: &[(&std::ffi::CStr, pg_sys::Oid)] = &[
    (c"partition", pg_sys::TEXTOID),
    (c"tbl", pg_sys::TEXTOID),
    (c"var", pg_sys::TEXTOID),
    (c"value", pg_sys::TEXTOID),
    (c"row_id", pg_sys::TEXTOID),
];

/// Inserts the `(row_id, var, value)` entries, each unless it stands already (`ON CONFLICT DO
/// NOTHING`): below SQL where the table is as created and here (on Citus, the partition's shard
/// on this node) under READ COMMITTED, as the push result is (`heap::DirectInsert`); otherwise
/// by statement — on Citus one routed `INSERT … VALUES` per entry, as an `INSERT … SELECT` goes
/// through Citus's COPY path, which takes the metadata lock of every shard of the table (a push
/// waited while any shard group on its worker was moved: docs/SCALING.md, "Waits on a worker").
fn insert_missing(
    client: &SpiClient<'_>,
    partition: &str,
    tbl: &str,
    missing: &[(&str, &str, &str)],
) -> Result<()> {
    let direct = crate::heap::DirectInsert::open_for_conflicts(
        crate::heap::SyncTable::RowScopes,
        partition,
        ROW_SCOPE_COLUMNS,
    )?;
    if let Some(mut direct) = direct {
        for (row_id, var, value) in missing {
            crate::interrupts::check();
            let text = |t| Some(crate::heap::Value::Text(t));
            direct.insert_unless_conflict(&[
                text(partition),
                text(tbl),
                text(var),
                text(value),
                text(row_id),
            ])?;
        }
        return Ok(());
    }
    if crate::citus::installed() {
        for (row_id, var, value) in missing {
            crate::interrupts::check();
            db::write(
                client,
                "INSERT INTO syncular.sync_row_scopes (partition, tbl, var, value, row_id)
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
                &[
                    DatumWithOid::from(partition),
                    DatumWithOid::from(tbl),
                    DatumWithOid::from(*var),
                    DatumWithOid::from(*value),
                    DatumWithOid::from(*row_id),
                ],
            )?;
        }
        return Ok(());
    }
    db::write_generic(
        client,
        "INSERT INTO syncular.sync_row_scopes (partition, tbl, var, value, row_id)
         SELECT $1, $2, w.var, w.value, w.row_id
           FROM unnest($3::text[], $4::text[], $5::text[]) AS w(row_id, var, value)
         ON CONFLICT DO NOTHING",
        &[
            DatumWithOid::from(partition),
            DatumWithOid::from(tbl),
            DatumWithOid::from(missing.iter().map(|e| e.0).collect::<Vec<_>>()),
            DatumWithOid::from(missing.iter().map(|e| e.1).collect::<Vec<_>>()),
            DatumWithOid::from(missing.iter().map(|e| e.2).collect::<Vec<_>>()),
        ],
    )?;
    Ok(())
}

/// A row's scope entries as `(var, value)` text pairs (values were validated as strings).
fn entries_of(scopes: &Map<String, Value>) -> impl Iterator<Item = (&str, &str)> {
    scopes
        .iter()
        .map(|(var, value)| (var.as_str(), value.as_str().unwrap_or_default()))
}

/// One row's scope entries (set_row_scopes, the row-meta trigger).
pub fn set_scopes(
    client: &SpiClient<'_>,
    partition: &str,
    tbl: &str,
    row_id: &str,
    scopes: &Map<String, Value>,
) -> Result<i64> {
    set_scopes_many(client, partition, tbl, &[(row_id, scopes)])
}

/// Decodes the `rows` argument of `set_rows_scopes`: `[{"rowId": string, "scopes": {var: string}}]`,
/// each row id at most once.
fn scoped_rows(value: Value) -> Result<Vec<(String, Map<String, Value>)>> {
    let Value::Array(items) = value else {
        return Err(Error::invalid_argument("rows", "type"));
    };
    let mut seen = std::collections::HashSet::new();
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            crate::interrupts::check();
            let at = |key: &str| format!("rows[{i}]{key}");
            let Value::Object(mut obj) = item else {
                return Err(Error::invalid_argument(&at(""), "type"));
            };
            let row_id = match obj.remove("rowId") {
                None | Some(Value::Null) => {
                    return Err(Error::invalid_argument(&at(".rowId"), "missing"))
                }
                Some(Value::String(s)) => s,
                Some(_) => return Err(Error::invalid_argument(&at(".rowId"), "type")),
            };
            if !seen.insert(row_id.clone()) {
                return Err(Error::invalid_argument(&at(".rowId"), "shape"));
            }
            let scopes = match obj.remove("scopes") {
                None | Some(Value::Null) => {
                    return Err(Error::invalid_argument(&at(".scopes"), "missing"))
                }
                Some(scopes) => scope::stored(&at(".scopes"), scopes)?,
            };
            Ok((row_id, scopes))
        })
        .collect()
}

/// Removes a row's scope entries and blob refs; returns how many of each.
pub fn delete_meta(
    client: &SpiClient<'_>,
    partition: &str,
    tbl: &str,
    row_id: &str,
) -> Result<(i64, i64)> {
    let table = db::write(
        client,
        "WITH s AS (
           DELETE FROM syncular.sync_row_scopes
            WHERE partition = $1 AND tbl = $2 AND row_id = $3 RETURNING 1
         ), b AS (
           DELETE FROM syncular.sync_blob_refs
            WHERE partition = $1 AND tbl = $2 AND row_id = $3 RETURNING 1
         )
         SELECT (SELECT count(*) FROM s), (SELECT count(*) FROM b)",
        &[
            DatumWithOid::from(partition),
            DatumWithOid::from(tbl),
            DatumWithOid::from(row_id),
        ],
    )?;
    let row = table.first();
    Ok((
        row.get::<i64>(1)?.unwrap_or(0),
        row.get::<i64>(2)?.unwrap_or(0),
    ))
}

/// Removes every scope entry and blob ref of a table, in all partitions (`retire_table`).
pub fn delete_table_meta(client: &SpiClient<'_>, tbl: &str) -> Result<(i64, i64)> {
    let table = db::write(
        client,
        "WITH s AS (DELETE FROM syncular.sync_row_scopes WHERE tbl = $1 RETURNING 1),
              b AS (DELETE FROM syncular.sync_blob_refs WHERE tbl = $1 RETURNING 1)
         SELECT (SELECT count(*) FROM s), (SELECT count(*) FROM b)",
        &[DatumWithOid::from(tbl)],
    )?;
    let row = table.first();
    Ok((
        row.get::<i64>(1)?.unwrap_or(0),
        row.get::<i64>(2)?.unwrap_or(0),
    ))
}

/// The `(partition, tbl, row_id)` arguments of the row functions: row ids may be empty.
fn row_key(
    partition: Option<&str>,
    tbl: Option<&str>,
    row_id: Option<&str>,
) -> Result<(String, String, String)> {
    Ok((
        args::text("partition", partition)?,
        scope::log_table("tbl", tbl)?,
        args::key("row_id", row_id)?,
    ))
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn set_row_scopes(
    partition: Option<&str>,
    tbl: Option<&str>,
    row_id: Option<&str>,
    scopes: Option<args::JsonArg>,
) -> i32 {
    error::run(|| {
        let (partition, tbl, row_id) = row_key(partition, tbl, row_id)?;
        let scopes = scope::stored("scopes", args::json("scopes", scopes)?)?;
        let held = db::with_spi(|client| set_scopes(client, &partition, &tbl, &row_id, &scopes))?;
        Ok(held as i32)
    })
}

/// The batch form of `set_row_scopes` for the rows of one table written by one statement: one
/// call and one set-based statement instead of one call per row.
#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn set_rows_scopes(partition: Option<&str>, tbl: Option<&str>, rows: Option<args::JsonArg>) -> i32 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let tbl = scope::log_table("tbl", tbl)?;
        let rows = scoped_rows(args::json("rows", rows)?)?;
        let rows: Vec<(&str, &Map<String, Value>)> = rows
            .iter()
            .map(|(id, scopes)| (id.as_str(), scopes))
            .collect();
        let held = db::with_spi(|client| set_scopes_many(client, &partition, &tbl, &rows))?;
        Ok(held as i32)
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn delete_row_meta(partition: Option<&str>, tbl: Option<&str>, row_id: Option<&str>) -> JsonB {
    error::run(|| {
        let (partition, tbl, row_id) = row_key(partition, tbl, row_id)?;
        let (scopes, blobs) =
            db::with_spi(|client| delete_meta(client, &partition, &tbl, &row_id))?;
        Ok(JsonB(json!({"rowScopes": scopes, "blobRefs": blobs})))
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn set_blob_refs(
    partition: Option<&str>,
    tbl: Option<&str>,
    row_id: Option<&str>,
    blob_ids: Option<args::TextArray>,
) -> i32 {
    error::run(|| {
        let (partition, tbl, row_id) = row_key(partition, tbl, row_id)?;
        let array = args::required("blob_ids", blob_ids.as_ref())?;
        let blob_ids = args::text_array("blob_ids", Some(array))?;
        db::with_spi(|client| {
            set_blobs(client, &partition, &tbl, &row_id, &blob_ids, array.datum())
        })
        .map(|held| held as i32)
    })
}

/// Makes a row's `sync_blob_refs` exactly the distinct `blob_ids` (none clears them); returns
/// how many it now holds. `array` is the same ids as a `text[]` parameter (an argument passed on
/// as it came, docs/DESIGN.md §Memory).
pub fn set_blobs(
    client: &SpiClient<'_>,
    partition: &str,
    tbl: &str,
    row_id: &str,
    blob_ids: &[&str],
    array: DatumWithOid<'_>,
) -> Result<usize> {
    let mut distinct: Vec<&str> = crate::alloc::try_with_capacity(blob_ids.len())?;
    distinct.extend_from_slice(blob_ids);
    distinct.sort_unstable();
    distinct.dedup();
    let held = distinct.len();
    drop(distinct);
    db::write(
        client,
        "WITH wanted AS (SELECT b.blob_id FROM unnest($4::text[]) AS b(blob_id)),
         stale AS (
           DELETE FROM syncular.sync_blob_refs r
            WHERE r.partition = $1 AND r.tbl = $2 AND r.row_id = $3
              AND NOT EXISTS (SELECT 1 FROM wanted w WHERE w.blob_id COLLATE \"C\" = r.blob_id)
         )
         INSERT INTO syncular.sync_blob_refs (partition, tbl, row_id, blob_id)
         SELECT $1, $2, $3, w.blob_id FROM wanted w
         ON CONFLICT DO NOTHING",
        &[
            DatumWithOid::from(partition),
            DatumWithOid::from(tbl),
            DatumWithOid::from(row_id),
            array,
        ],
    )?;
    Ok(held)
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn get_tombstone_seq(
    partition: Option<&str>,
    tbl: Option<&str>,
    row_id: Option<&str>,
) -> Option<i64> {
    error::run(|| {
        let (partition, tbl, row_id) = row_key(partition, tbl, row_id)?;
        db::with_spi(|client| tombstone_seq(client, &partition, &tbl, &row_id, false))
    })
}

/// A row's tombstone, if it has one; `fresh`: with a snapshot that sees this transaction's (and
/// this call's) latest writes. Looked up by its primary key below SQL, in the snapshot the
/// statement would read with (`heap::with_snapshot`); by statement where Citus keeps the
/// partition's shard on another node.
pub fn tombstone_seq(
    client: &SpiClient<'_>,
    partition: &str,
    tbl: &str,
    row_id: &str,
    fresh: bool,
) -> Result<Option<i64>> {
    let keys = [partition, tbl, row_id].map(crate::heap::text_key);
    let read = crate::heap::with_snapshot(fresh, |snapshot| {
        // SAFETY: the keys are text datums built above, alive for the lookup; the snapshot is
        // registered around this closure.
        unsafe {
            crate::heap::by_primary_key(
                crate::heap::SyncTable::Tombstones,
                Some(partition),
                &keys,
                snapshot,
                |row| row.map_or(Ok(None), |row| row.bigint(c"commit_seq")),
            )
        }
    })?;
    if let crate::heap::Lookup::Here(seq, _) = read {
        return Ok(seq);
    }
    const SQL: &str = "SELECT commit_seq FROM syncular.sync_tombstones
                        WHERE partition = $1 AND tbl = $2 AND row_id = $3";
    let args = [
        DatumWithOid::from(partition),
        DatumWithOid::from(tbl),
        DatumWithOid::from(row_id),
    ];
    db::first::<i64>(if fresh {
        db::write(client, SQL, &args)?
    } else {
        db::read(client, SQL, &args)?
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn tombstone_seqs(
    partition: Option<&str>,
    tbl: Option<&str>,
    row_ids: Option<args::TextArray>,
) -> materialized::TableIterator<'static, (name!(row_id, String), name!(commit_seq, i64))> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let tbl = scope::log_table("tbl", tbl)?;
        let ids = args::required("row_ids", row_ids.as_ref())?;
        args::key_array("row_ids", Some(ids))?;
        let rows = db::with_spi(|client| {
            db::read(
                client,
                "SELECT t.row_id, t.commit_seq FROM syncular.sync_tombstones t
                  WHERE t.partition = $1 AND t.tbl = $2
                    AND t.row_id IN (SELECT DISTINCT i COLLATE \"C\" FROM unnest($3::text[]) AS u(i))
                  ORDER BY t.row_id",
                &[DatumWithOid::from(partition.as_str()), DatumWithOid::from(tbl.as_str()), ids.datum()],
            )?
            .map(|row| {
                crate::interrupts::check();
                Ok((row.get::<String>(1)?.unwrap_or_default(), row.get::<i64>(2)?.unwrap_or_default()))
            })
            .collect::<Result<Vec<_>>>()
        })?;
        Ok(materialized::TableIterator::new(rows))
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn clear_tombstone(partition: Option<&str>, tbl: Option<&str>, row_id: Option<&str>) -> bool {
    error::run(|| {
        let (partition, tbl, row_id) = row_key(partition, tbl, row_id)?;
        db::with_spi(|client| delete_tombstone(client, &partition, &tbl, &row_id))
    })
}

/// Removes a row's tombstone (an explicit re-create); whether there was one.
pub fn delete_tombstone(
    client: &SpiClient<'_>,
    partition: &str,
    tbl: &str,
    row_id: &str,
) -> Result<bool> {
    let deleted = db::write(
        client,
        "DELETE FROM syncular.sync_tombstones
          WHERE partition = $1 AND tbl = $2 AND row_id = $3 RETURNING 1",
        &[
            DatumWithOid::from(partition),
            DatumWithOid::from(tbl),
            DatumWithOid::from(row_id),
        ],
    )?;
    Ok(!deleted.is_empty())
}
