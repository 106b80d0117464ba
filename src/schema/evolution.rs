//! Schema evolution (docs/DESIGN.md §Schema barrier, "Schema evolution"): what may change
//! between two schema versions, and the re-encoding of stored rows `migrate_schema` does when a
//! table's layout grew.
//!
//! Upstream's rule: the layout of a table at the new version keeps the old one as an exact
//! prefix (same name, type and nullability at every old position) and may only append nullable
//! columns; a table may be retired (left out of the new layouts). A payload decodes only under
//! the column list it was encoded with (docs/CODEC.md §Full row), so every stored
//! `_sync_payload` of a table whose layout grew is re-encoded in the migration's transaction:
//! decoded with the old layout, NULLs appended, encoded with the new. The commit log is not
//! rewritten: a log payload decodes with the layouts of its commit's `writer_version`
//! (`decode_row(…, schema_version => v)`, the layout history in `sync_schema_layouts`).

use super::digest::{self, Digest};
use super::shards;
use crate::codec::{row, CodecError, Column, ColumnType, Layout, Value as Cell};
use crate::db;
use crate::error::{Error, Result};
use crate::tables;
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::spi::SpiClient;
use serde_json::{json, Map, Value};

/// Whether this install has the layout history (`sync_schema_layouts`, 0.2.0): a 0.1.0 install
/// running this library before `ALTER EXTENSION syncular UPDATE` has not, and keeps 0.1.0's
/// contract there — `migrate_schema` stores the layouts only, the host re-encodes its rows (its
/// `sync_app_tables` lacks what the rewrite opens a relation by, too).
pub fn installed() -> bool {
    // SAFETY: two catalog-cache lookups by name inside the calling transaction; `missing_ok`
    // makes the first return InvalidOid instead of raising, and the second returns InvalidOid
    // for a missing relation (as `notify::channel_table`).
    unsafe {
        let namespace = pg_sys::get_namespace_oid(c"syncular".as_ptr(), true);
        namespace != pg_sys::InvalidOid
            && pg_sys::get_relname_relid(c"sync_schema_layouts".as_ptr(), namespace)
                != pg_sys::InvalidOid
    }
}

/// The columns of `table` in the newest layouts of the history (`sync_schema_layouts`) that name
/// it, if any do: the layout of the rows a table retired earlier still holds.
pub fn last_layout(client: &SpiClient<'_>, table: &str) -> Result<Option<Value>> {
    let last = db::first::<String>(db::write(
        client,
        "SELECT (l.layouts::pg_catalog.jsonb -> $1)::pg_catalog.text
           FROM syncular.sync_schema_layouts l
          WHERE l.layouts::pg_catalog.jsonb ? $1
          ORDER BY l.schema_version DESC LIMIT 1",
        &[DatumWithOid::from(table)],
    )?)?;
    Ok(last.and_then(|text| serde_json::from_str(&text).ok()))
}

/// The row codec's type names, in docs/CODEC.md §Column types order, as a hint spells them.
pub const CODEC_TYPES: &str = "string, integer, float, boolean, json, bytes, blob_ref, crdt";

/// The refusal of a layout column `type` that is not a row-codec type (issue: a layout stored
/// with `"text"` could never be matched by a push schema afterwards).
pub fn unknown_type(at: &str, type_name: &str) -> Error {
    Error::invalid_argument(at, "shape").with_hint(format!(
        "{at}: {type_name:?} is not a row-codec type ({CODEC_TYPES}); PostgreSQL types belong to \
         the relation (string and blob_ref → text, integer → bigint, float → double precision, \
         boolean → boolean, json → jsonb, bytes and crdt → bytea)"
    ))
}

/// A table whose layout grew between the stored version and the new one.
#[derive(Debug, PartialEq, Eq)]
pub struct Grown {
    pub table: String,
    /// The schema version of the table's old layout.
    pub from: i64,
    pub old: usize,
    pub new: usize,
}

/// A table's layout columns (none when absent or not an array).
pub(super) fn columns(value: Option<&Value>) -> &[Value] {
    match value {
        Some(Value::Array(a)) => a,
        _ => &[],
    }
}

/// Whether two layout columns agree on name, type and nullability (their other keys aside).
pub(super) fn same(a: &Value, b: &Value) -> bool {
    ["name", "type", "nullable"]
        .iter()
        .all(|k| a.get(*k) == b.get(*k))
}

fn name_of(column: &Value) -> String {
    column
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("?")
        .to_string()
}

/// Upstream's append-only rule between the layouts stored at `from` and the new `layouts`,
/// table by table in byte order of their names; the tables whose layout grew. A table of the
/// stored layouts missing from the new ones is retired (allowed); a new table has no rows.
pub fn append_only(
    stored: &Map<String, Value>,
    layouts: &Map<String, Value>,
    from: i64,
) -> Result<Vec<Grown>> {
    let mut grown = Vec::new();
    for (table, new) in layouts {
        crate::interrupts::check();
        let Some(old) = stored.get(table) else {
            continue;
        };
        let (old, new) = (columns(Some(old)), columns(Some(new)));
        if new.len() < old.len() {
            let removed: Vec<String> = old[new.len()..]
                .iter()
                .map(|c| {
                    crate::interrupts::check();
                    name_of(c)
                })
                .collect();
            return Err(
                Error::invalid_argument(&format!("layouts.{table}"), "removed").with_hint(format!(
                    "table {table}: the columns {} of schema version {from} are missing — only \
                     appending nullable columns is supported between schema versions (a table \
                     may be retired by leaving it out)",
                    removed.join(", ")
                )),
            );
        }
        for (i, (was, now)) in old.iter().zip(new).enumerate() {
            crate::interrupts::check();
            if !same(was, now) {
                return Err(
                    Error::invalid_argument(&format!("layouts.{table}[{i}]"), "changed").with_hint(
                        format!(
                            "table {table}, column {i}: {} here, {} at schema version {from} — \
                             only appending nullable columns is supported (a rename, retype, \
                             nullability change or reorder needs a new table)",
                            json!({"name": now.get("name"), "type": now.get("type"), "nullable": now.get("nullable")}),
                            json!({"name": was.get("name"), "type": was.get("type"), "nullable": was.get("nullable")}),
                        ),
                    ),
                );
            }
        }
        for (i, added) in new.iter().enumerate().skip(old.len()) {
            crate::interrupts::check();
            if added.get("nullable") != Some(&Value::Bool(true)) {
                return Err(Error::invalid_argument(
                    &format!("layouts.{table}[{i}].nullable"),
                    "not_nullable",
                )
                .with_hint(format!(
                    "table {table}: added column {} must be nullable — the rows stored at schema \
                     version {from} have no value for it",
                    name_of(added)
                )));
            }
        }
        if new.len() > old.len() {
            grown.push(Grown {
                table: table.clone(),
                from,
                old: old.len(),
                new: new.len(),
            });
        }
    }
    Ok(grown)
}

/// A layout's columns as the codec reads them, or the first column whose type is not a codec
/// type (layouts stored before their types were checked). The primary key is unknown to a
/// layout: 0, which only the sparse codec reads.
pub fn codec_layout(columns: &[Value]) -> std::result::Result<Layout, String> {
    let mut out = Vec::with_capacity(columns.len());
    for column in columns {
        crate::interrupts::check();
        let ty = column.get("type").and_then(Value::as_str).unwrap_or("");
        let Some(ty) = ColumnType::from_name(ty) else {
            return Err(format!("column {} has type {ty:?}", name_of(column)));
        };
        out.push(Column {
            name: name_of(column),
            ty,
            nullable: column.get("nullable") == Some(&Value::Bool(true)),
        });
    }
    Ok(Layout {
        columns: out,
        primary_key: 0,
    })
}

/// One stored full row re-encoded for columns appended to its layout: decoded with `old`
/// (validated as upstream decodes it), NULLs appended, encoded with `new`. Memory: the row.
pub fn reencode(
    old: &Layout,
    new: &Layout,
    payload: &[u8],
) -> std::result::Result<Vec<u8>, CodecError> {
    let mut values = row::decode_full(old, payload)?;
    values.resize(new.columns.len(), Cell::Null);
    row::encode_full(new, &values)
}

/// What re-encodes the stored rows of one table from schema version `from` to `to`, here or on a
/// Citus shard's node (src/schema/shards.rs, which receives it as [`Reencoding::to_json`]).
pub struct Reencoding {
    pub table: String,
    pub from: i64,
    pub to: i64,
    old: Layout,
    new: Layout,
    /// The two layouts' columns as stored (what a shard's node is sent).
    columns: (Value, Value),
}

impl Reencoding {
    /// From the two versions' stored layouts of `table`: refused (`SY000` `layouts.<table>`
    /// `shape`) when either is not a row-codec layout.
    pub fn new(
        table: &str,
        from: i64,
        to: i64,
        old: &[Value],
        new: &[Value],
    ) -> Result<Reencoding> {
        let unreadable = |version: i64, why: String| {
            Error::invalid_argument(&format!("layouts.{table}"), "shape").with_hint(format!(
                "table {table}: the layouts of schema version {version} are not row-codec layouts \
                 ({why}), so the stored payloads of the registered table cannot be re-encoded \
                 for schema version {to}"
            ))
        };
        Ok(Reencoding {
            table: table.to_string(),
            from,
            to,
            old: codec_layout(old).map_err(|w| unreadable(from, w))?,
            new: codec_layout(new).map_err(|w| unreadable(to, w))?,
            columns: (Value::Array(old.to_vec()), Value::Array(new.to_vec())),
        })
    }

    /// `{"table", "from", "to", "old", "new"}`, what [`Reencoding::from_json`] reads back.
    pub fn to_json(&self) -> Value {
        json!({"table": self.table, "from": self.from, "to": self.to,
               "old": self.columns.0, "new": self.columns.1})
    }

    /// [`Reencoding::to_json`]'s form read back, for the table registered as `table`: refused
    /// (`SY000` `layouts` `shape`) when it is not that.
    pub fn from_json(table: &str, value: &Value) -> Result<Reencoding> {
        let shape = || Error::invalid_argument("layouts", "shape");
        let version = |key: &str| value.get(key).and_then(Value::as_i64).ok_or_else(shape);
        let layout = |key: &str| value.get(key).and_then(Value::as_array).ok_or_else(shape);
        if value.get("table").and_then(Value::as_str) != Some(table) {
            return Err(shape());
        }
        Reencoding::new(
            table,
            version("from")?,
            version("to")?,
            layout("old")?,
            layout("new")?,
        )
    }

    /// The layout rows are re-encoded for.
    pub fn new_layout(&self) -> &Layout {
        &self.new
    }

    /// One stored row of `partition` re-encoded ([`reencode`]), or why it cannot be.
    pub fn row(&self, partition: &str, row_id: &str, payload: &[u8]) -> Result<Vec<u8>> {
        reencode(&self.old, &self.new, payload).map_err(|e| {
            Error::Internal(format!(
                "syncular: migrate_schema cannot re-encode stored row {}/{row_id} of \
                 partition {partition} for schema version {}: its _sync_payload does not \
                 decode with the layout of schema version {}: {}",
                self.table,
                self.to,
                self.from,
                e.message()
            ))
        })
    }
}

/// Re-encodes the stored payloads of every **registered** table of `grown` (tables registered
/// with `register_table`; an unregistered table's rows are the host's to rewrite), each for the
/// migrating `caller` in the sandbox (`tables::statements`: the less privileged of it and the
/// relation's owner); the rows rewritten per table, tables without rows left out. Then every
/// stored payload of those tables is read again below SQL, where no host code can run
/// (src/tables/payloads.rs), and must decode with the new layout: host code of the migration
/// that wrote a row back after it was re-encoded — a trigger of a later chunk or of another
/// table, a function planning ran — fails it (red teams 4 and 5, C2 and R5-2; docs/SECURITY.md
/// rule 19) — an old-layout payload never decodes with a layout that appended columns (the new
/// columns' null bits are clear, so their values would be read past the payload's end).
/// A table Citus distributes is rewritten and checked shard by shard on each shard's node
/// (src/schema/shards.rs), in the sandbox there.
pub fn rewrite(
    client: &SpiClient<'_>,
    grown: &[Grown],
    stored: &Map<String, Value>,
    layouts: &Map<String, Value>,
    to: i64,
    caller: pg_sys::Oid,
) -> Result<Map<String, Value>> {
    let mut counts = Map::new();
    let mut rewritten = Vec::new();
    let keys = digest::fresh_keys()?;
    let mut opened = Vec::new();
    for g in grown {
        crate::interrupts::check();
        let Some(relation) = tables::open_for_migration(client, &g.table)? else {
            continue;
        };
        if relation.distributed() {
            shards::require_checkable(client, &relation, caller)?;
        }
        opened.push((g, relation));
    }
    // All at once: a reader of two of them never holds one while the migration waits for it.
    tables::lock_all_for_rewrite(&opened.iter().map(|(_, r)| r).collect::<Vec<_>>(), caller)?;
    // On Citus, one partition value per shard of the partitions' group, found once.
    let mut per_shard: Option<Vec<String>> = None;
    for (g, relation) in &opened {
        let reencoding = Reencoding::new(
            &g.table,
            g.from,
            to,
            columns(stored.get(&g.table)),
            columns(layouts.get(&g.table)),
        )?;
        let (count, written) = if relation.distributed() {
            if per_shard.is_none() {
                per_shard = Some(shards::partition_per_shard(client)?);
            }
            let partitions = per_shard.as_deref().unwrap_or_default();
            (
                shards::rewrite(relation, caller, partitions, &reencoding)?,
                None,
            )
        } else {
            let mut written = Digest::new(&keys);
            let count = relation.rewrite_payloads(caller, &mut |partition, row_id, payload| {
                let out = reencoding.row(partition, row_id, payload)?;
                written.add(partition, row_id, &out);
                Ok(out)
            })?;
            (count, Some(written))
        };
        if count > 0 {
            counts.insert(g.table.clone(), json!(count));
        }
        rewritten.push((reencoding, written));
    }
    for (reencoding, written) in rewritten {
        crate::interrupts::check();
        let (table, new) = (reencoding.table.as_str(), reencoding.new_layout());
        // Opened again: every check of a registered relation, after what host code did.
        let Some(relation) = tables::open_for_migration(client, table)? else {
            continue;
        };
        let Some(written) = written else {
            // On Citus each shard is checked on its own node against what was written there.
            let partitions = per_shard.as_deref().unwrap_or_default();
            shards::check(&relation, caller, partitions)?;
            continue;
        };
        let mut stored = Digest::new(&keys);
        relation.scan_payloads(client, &mut |partition, row_id, payload| {
            stored.add(partition, row_id, payload);
            match row::decode_full(new, payload) {
                Ok(_) => Ok(true),
                Err(e) => Err(Error::TriggeredChange(format!(
                    "syncular: migrate_schema re-encoded the stored rows of table {table}, but \
                     row {row_id} of partition {partition} no longer decodes with the layout of \
                     schema version {to} ({}): host code of the migration (a trigger, or a \
                     function of the relation's statistics or constraints) wrote it after it \
                     was re-encoded",
                    e.message()
                ))),
            }
        })?;
        // Decoding is not enough: a crafted old payload can decode with a layout whose null
        // bitmap grew a byte (red team 6, R6-3). The stored rows must be exactly the rows
        // written: the same keys with the same bytes.
        if stored != written {
            return Err(rewritten_rows_changed(
                &format!("table {table}"),
                written.rows(),
                stored.rows(),
            ));
        }
    }
    Ok(counts)
}

/// The refusal of a migration whose re-encoded rows are not what the table holds afterwards.
/// `table` names what was re-encoded: "table t", or one shard of it (src/schema/shards.rs).
pub(super) fn rewritten_rows_changed(table: &str, written: u64, stored: u64) -> Error {
    Error::TriggeredChange(format!(
        "syncular: migrate_schema re-encoded {written} stored rows of {table}, but it now \
         holds {stored} rows that are not exactly those: host code of the migration \
         (a trigger, or a function of the relation's statistics or constraints) wrote, inserted \
         or deleted rows of it after they were re-encoded"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        serde_json::from_value(v).unwrap()
    }

    fn l1() -> Map<String, Value> {
        map(json!({
            "tasks":[{"name":"id","type":"string","nullable":false},
                     {"name":"n","type":"integer","nullable":true}],
            "old":[{"name":"id","type":"string","nullable":false}]}))
    }

    fn refusal(r: Result<Vec<Grown>>) -> (String, String) {
        match r {
            Err(Error::Sync {
                detail: Some(d), ..
            }) => (
                d["argument"].as_str().unwrap().into(),
                d["reason"].as_str().unwrap().into(),
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn only_appending_nullable_columns_is_allowed() {
        let mut l2 = l1();
        l2.remove("old"); // retired: allowed
        l2["tasks"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name":"note","type":"string","nullable":true}));
        l2.insert(
            "fresh".into(),
            json!([{"name":"id","type":"string","nullable":false}]),
        );
        assert_eq!(
            append_only(&l1(), &l2, 1).unwrap(),
            vec![Grown {
                table: "tasks".into(),
                from: 1,
                old: 2,
                new: 3
            }]
        );
        assert_eq!(append_only(&l1(), &l1(), 1).unwrap(), vec![]);

        let mut retyped = l1();
        retyped["tasks"][1]["type"] = json!("float");
        assert_eq!(
            refusal(append_only(&l1(), &retyped, 1)),
            ("layouts.tasks[1]".into(), "changed".into())
        );
        let mut reordered = l1();
        reordered["tasks"].as_array_mut().unwrap().reverse();
        assert_eq!(
            refusal(append_only(&l1(), &reordered, 1)),
            ("layouts.tasks[0]".into(), "changed".into())
        );
        let mut dropped = l1();
        dropped["tasks"].as_array_mut().unwrap().pop();
        assert_eq!(
            refusal(append_only(&l1(), &dropped, 1)),
            ("layouts.tasks".into(), "removed".into())
        );
        let mut not_null = l1();
        not_null["tasks"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name":"due","type":"integer","nullable":false}));
        assert_eq!(
            refusal(append_only(&l1(), &not_null, 1)),
            ("layouts.tasks[2].nullable".into(), "not_nullable".into())
        );
    }

    #[test]
    fn a_row_is_reencoded_with_nulls_appended() {
        let columns = |n: usize| -> Vec<Value> {
            (0..n)
                .map(|i| json!({"name": format!("c{i}"), "type": "string", "nullable": i > 0}))
                .collect()
        };
        // 7 → 9 columns: the null bitmap grows a byte.
        let (old, new) = (
            codec_layout(&columns(7)).unwrap(),
            codec_layout(&columns(9)).unwrap(),
        );
        let values: Vec<Cell> = (0..7)
            .map(|i| {
                if i == 3 {
                    Cell::Null
                } else {
                    Cell::Text(format!("v{i}").into())
                }
            })
            .collect();
        let payload = row::encode_full(&old, &values).unwrap();
        let out = reencode(&old, &new, &payload).unwrap();
        let mut expected = values.clone();
        expected.extend([Cell::Null, Cell::Null]);
        assert_eq!(row::decode_full(&new, &out).unwrap(), expected);
        assert_eq!(out, row::encode_full(&new, &expected).unwrap());
        // The old bytes no longer decode with the new layout, and a row that does not decode
        // with the old one is refused with the decoder's message.
        assert!(row::decode_full(&new, &payload).is_err());
        assert!(reencode(&old, &new, &payload[..payload.len() - 1]).is_err());
        assert_eq!(
            codec_layout(&[json!({"name":"id","type":"text","nullable":false})]).unwrap_err(),
            "column id has type \"text\""
        );
    }
}
