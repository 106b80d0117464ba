//! Backfill checkpoints (docs/DESIGN.md §Checkpoints): compare-and-set on `owner_epoch`, and
//! activation under the partition lock, only once the fence guarantees that old writers can no
//! longer change what the backfill derived.
//!
//! State machine: `declared` → `backfilling` → `activated` (terminal). An existing row is never
//! reset; its `schema_version` never changes (upstream's claim rewrote it: docs/DESIGN.md,
//! gap B5 — claim moves a checkpoint to another version).

use crate::args;
use crate::db;
use crate::error::{self, Code, Error, Result};
use crate::fence;
use crate::log;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiTupleTable};
use serde_json::json;

macro_rules! columns {
    () => {
        "partition, name, schema_version, state, watermark, owner_epoch, observed_rows, updated_at_ms"
    };
}

/// One `syncular.sync_backfill_checkpoints` row.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    pub partition: String,
    pub name: String,
    pub schema_version: i64,
    pub state: String,
    pub watermark: i64,
    pub owner_epoch: i64,
    pub observed_rows: i64,
    pub updated_at_ms: i64,
}

/// The table's row type, as functions return it.
type Row = PgHeapTuple<'static, AllocatedByRust>;

impl Checkpoint {
    fn rows(table: SpiTupleTable<'_>) -> Result<Vec<Checkpoint>> {
        let missing = || Error::Internal("NULL in a NOT NULL checkpoint column".into());
        table
            .map(|row| {
                crate::interrupts::check();
                let text = |i| row.get::<String>(i)?.ok_or_else(missing);
                let int = |i| row.get::<i64>(i)?.ok_or_else(missing);
                Ok(Checkpoint {
                    partition: text(1)?,
                    name: text(2)?,
                    schema_version: int(3)?,
                    state: text(4)?,
                    watermark: int(5)?,
                    owner_epoch: int(6)?,
                    observed_rows: int(7)?,
                    updated_at_ms: int(8)?,
                })
            })
            .collect()
    }

    fn one(table: SpiTupleTable<'_>) -> Result<Option<Checkpoint>> {
        Ok(Checkpoint::rows(table)?.into_iter().next())
    }

    /// The row as the table's composite type.
    fn into_row(self) -> Result<Row> {
        let mut tuple = PgHeapTuple::new_composite_type("syncular.sync_backfill_checkpoints")?;
        tuple.set_by_name("partition", self.partition)?;
        tuple.set_by_name("name", self.name)?;
        tuple.set_by_name("schema_version", self.schema_version)?;
        tuple.set_by_name("state", self.state)?;
        tuple.set_by_name("watermark", self.watermark)?;
        tuple.set_by_name("owner_epoch", self.owner_epoch)?;
        tuple.set_by_name("observed_rows", self.observed_rows)?;
        tuple.set_by_name("updated_at_ms", self.updated_at_ms)?;
        Ok(tuple)
    }

    fn is_activated(&self) -> bool {
        self.state == "activated"
    }
}

fn key<'a>(partition: &'a str, name: &'a str) -> [DatumWithOid<'a>; 2] {
    [DatumWithOid::from(partition), DatumWithOid::from(name)]
}

fn version_mismatch(partition: &str, name: &str, stored: i64, requested: i64) -> Error {
    Error::new(
        Code::CheckpointVersionMismatch,
        json!({"partition": partition, "projection": name,
               "storedSchemaVersion": stored, "requestedSchemaVersion": requested}),
    )
}

fn not_declared(partition: &str, name: &str) -> Error {
    Error::new(
        Code::CheckpointNotDeclared,
        json!({"partition": partition, "projection": name}),
    )
}

/// Latest committed version of the row (a fresh snapshot; waits for nothing).
fn current(client: &SpiClient<'_>, partition: &str, name: &str) -> Result<Option<Checkpoint>> {
    Checkpoint::one(db::write(
        client,
        concat!(
            "SELECT ",
            columns!(),
            " FROM syncular.sync_backfill_checkpoints
                 WHERE partition = $1 AND name = $2"
        ),
        &key(partition, name),
    )?)
}

/// `declare_checkpoint` semantics, also used by `migrate_schema` for its declarations: insert
/// `declared` if absent, leave an existing row of the same version alone, refuse another
/// version; then raise the fence to at least `version` (fence ⇐ declaration).
pub fn declare(
    client: &SpiClient<'_>,
    partition: &str,
    name: &str,
    version: i64,
    now_ms: i64,
) -> Result<Checkpoint> {
    let inserted = Checkpoint::one(db::write(
        client,
        concat!(
            "INSERT INTO syncular.sync_backfill_checkpoints
               (partition, name, schema_version, state, watermark, owner_epoch, observed_rows,
                updated_at_ms)
             VALUES ($1, $2, $3, 'declared', 0, 0, 0, $4)
             ON CONFLICT (partition, name) DO NOTHING
             RETURNING ",
            columns!()
        ),
        &[
            DatumWithOid::from(partition),
            DatumWithOid::from(name),
            DatumWithOid::from(version),
            DatumWithOid::from(now_ms),
        ],
    )?)?;
    let row = match inserted {
        Some(row) => row,
        // The conflict waited for a concurrent declarer; FOR SHARE reads the committed row.
        None => Checkpoint::one(db::write(
            client,
            concat!(
                "SELECT ",
                columns!(),
                " FROM syncular.sync_backfill_checkpoints
                     WHERE partition = $1 AND name = $2 FOR SHARE"
            ),
            &key(partition, name),
        )?)?
        .ok_or_else(|| Error::Internal("checkpoint vanished during declaration".into()))?,
    };
    if row.schema_version != version {
        return Err(version_mismatch(
            partition,
            name,
            row.schema_version,
            version,
        ));
    }
    fence::raise(client, partition, version)?;
    Ok(row)
}

/// `has_source_changes_above` in one statement, so one snapshot: a prune deletes changes and
/// raises the horizon in one transaction, so this can never see the deletions without the
/// raised horizon and never calls a pruned window clean (docs/DESIGN.md, gap B14 — a
/// concurrent prune made a pruned window look clean).
const SOURCE_CHANGES_SQL: &str = "\
SELECT CASE
  WHEN cardinality($2::text[]) = 0 THEN 'clean'
  WHEN EXISTS (SELECT 1 FROM unnest($2::text[]) AS s(tbl)
                CROSS JOIN LATERAL (
                  SELECT 1 FROM syncular.sync_changes c
                   WHERE c.partition = $1 AND c.tbl = s.tbl COLLATE \"C\" AND c.commit_seq > $3
                   LIMIT 1) AS probe)
    THEN 'changed'
  WHEN coalesce((SELECT p.horizon_seq FROM syncular.sync_partitions p
                  WHERE p.partition = $1), 0) > $3 THEN 'unverifiable'
  ELSE 'clean'
END";

fn source_changes(
    client: &SpiClient<'_>,
    partition: &str,
    tables: DatumWithOid<'_>,
    seq: i64,
    fresh: bool,
) -> Result<String> {
    let params = [
        DatumWithOid::from(partition),
        tables,
        DatumWithOid::from(seq),
    ];
    let table = if fresh {
        db::write(client, SOURCE_CHANGES_SQL, &params)?
    } else {
        db::read(client, SOURCE_CHANGES_SQL, &params)?
    };
    db::first::<String>(table)?.ok_or_else(|| Error::Internal("no source answer".into()))
}

fn activate(
    client: &SpiClient<'_>,
    partition: &str,
    name: &str,
    owner_epoch: i64,
    watermark: i64,
    sources: DatumWithOid<'_>,
    now_ms: i64,
) -> Result<&'static str> {
    // 1. Every writer that allocated before us is committed and visible from here on.
    let locked = log::lock(client, partition)?;
    let outcome = activate_locked(
        client,
        partition,
        name,
        owner_epoch,
        watermark,
        sources,
        now_ms,
    );
    // 6. Never leave behind a partition row created only to take the lock (docs/DESIGN.md,
    //    gap B7 — upstream's activation left one behind). On an error the whole call is
    //    rolled back anyway.
    if locked.created && outcome.is_ok() {
        db::write(
            client,
            "DELETE FROM syncular.sync_partitions WHERE partition = $1",
            &[DatumWithOid::from(partition)],
        )?;
    }
    outcome
}

fn activate_locked(
    client: &SpiClient<'_>,
    partition: &str,
    name: &str,
    owner_epoch: i64,
    watermark: i64,
    sources: DatumWithOid<'_>,
    now_ms: i64,
) -> Result<&'static str> {
    // 2.
    let Some(row) = current(client, partition, name)? else {
        return Err(not_declared(partition, name));
    };
    if row.is_activated() {
        return Ok("stale");
    }
    // 3. Only certify a state that old writers can no longer change.
    let required = fence::requirement(partition)?;
    if required.is_none_or(|r| r < row.schema_version) {
        return Err(Error::new(
            Code::CheckpointFenceMissing,
            json!({"partition": partition, "projection": name,
                   "schemaVersion": row.schema_version, "requiredWriterVersion": required}),
        ));
    }
    // 4.
    match source_changes(client, partition, sources, watermark, true)?.as_str() {
        "changed" => return Ok("stale"),
        "unverifiable" => return Ok("unverifiable"),
        _ => {}
    }
    // 5. The epoch CAS.
    let updated = db::write(
        client,
        "UPDATE syncular.sync_backfill_checkpoints
            SET state = 'activated', watermark = $4, updated_at_ms = $5
          WHERE partition = $1 AND name = $2 AND owner_epoch = $3 AND state <> 'activated'
          RETURNING 1",
        &[
            DatumWithOid::from(partition),
            DatumWithOid::from(name),
            DatumWithOid::from(owner_epoch),
            DatumWithOid::from(watermark),
            DatumWithOid::from(now_ms),
        ],
    )?;
    Ok(if updated.is_empty() {
        "stale"
    } else {
        "activated"
    })
}

/// The `(partition, name, schema_version, now_ms)` arguments of declare and claim.
fn versioned_args(
    partition: Option<&str>,
    name: Option<&str>,
    schema_version: Option<i64>,
    now_ms: Option<i64>,
) -> Result<(String, String, i64, i64)> {
    Ok((
        args::text("partition", partition)?,
        args::text("name", name)?,
        args::at_least("schema_version", schema_version, 1)?,
        args::count("now_ms", now_ms)?,
    ))
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn declare_checkpoint(
    partition: Option<&str>,
    name: Option<&str>,
    schema_version: Option<i64>,
    now_ms: Option<i64>,
) -> pgrx::composite_type!('static, "sync_backfill_checkpoints") {
    error::run(|| {
        let (partition, name, version, now_ms) =
            versioned_args(partition, name, schema_version, now_ms)?;
        db::with_spi(|client| declare(client, &partition, &name, version, now_ms))?.into_row()
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn claim_checkpoint(
    partition: Option<&str>,
    name: Option<&str>,
    schema_version: Option<i64>,
    now_ms: Option<i64>,
) -> pgrx::composite_type!('static, "sync_backfill_checkpoints") {
    error::run(|| {
        let (partition, name, version, now_ms) =
            versioned_args(partition, name, schema_version, now_ms)?;
        db::with_spi(|client| {
            // Concurrent claims serialize on the row lock and see each other's epochs.
            let claimed = Checkpoint::one(db::write(
                client,
                concat!(
                    "UPDATE syncular.sync_backfill_checkpoints
                        SET owner_epoch = owner_epoch + 1, state = 'backfilling',
                            updated_at_ms = $4
                      WHERE partition = $1 AND name = $2 AND state <> 'activated'
                        AND schema_version = $3
                      RETURNING ",
                    columns!()
                ),
                &[
                    DatumWithOid::from(partition.as_str()),
                    DatumWithOid::from(name.as_str()),
                    DatumWithOid::from(version),
                    DatumWithOid::from(now_ms),
                ],
            )?)?;
            if let Some(row) = claimed {
                return Ok(row);
            }
            match current(client, &partition, &name)? {
                Some(row) if !row.is_activated() => Err(version_mismatch(
                    &partition,
                    &name,
                    row.schema_version,
                    version,
                )),
                _ => Err(not_declared(&partition, &name)),
            }
        })?
        .into_row()
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn advance_checkpoint(
    partition: Option<&str>,
    name: Option<&str>,
    owner_epoch: Option<i64>,
    watermark: Option<i64>,
    observed_rows: Option<i64>,
    now_ms: Option<i64>,
) -> bool {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let name = args::text("name", name)?;
        let owner_epoch = args::count("owner_epoch", owner_epoch)?;
        let watermark = args::count("watermark", watermark)?;
        let observed_rows = args::count("observed_rows", observed_rows)?;
        let now_ms = args::count("now_ms", now_ms)?;
        db::with_spi(|client| {
            if current(client, &partition, &name)?.is_none() {
                return Ok(false); // nothing locked or created
            }
            // L1 before L3: the same order as activation, so the two cannot deadlock
            // (docs/DESIGN.md §Lock order, gap B18 — advance before the partition lock).
            log::lock(client, &partition)?;
            let updated = db::write(
                client,
                "UPDATE syncular.sync_backfill_checkpoints
                    SET watermark = $4, observed_rows = $5, updated_at_ms = $6
                  WHERE partition = $1 AND name = $2 AND owner_epoch = $3
                    AND state <> 'activated'
                  RETURNING 1",
                &[
                    DatumWithOid::from(partition.as_str()),
                    DatumWithOid::from(name.as_str()),
                    DatumWithOid::from(owner_epoch),
                    DatumWithOid::from(watermark),
                    DatumWithOid::from(observed_rows),
                    DatumWithOid::from(now_ms),
                ],
            )?;
            Ok(!updated.is_empty())
        })
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn activate_checkpoint(
    partition: Option<&str>,
    name: Option<&str>,
    owner_epoch: Option<i64>,
    watermark: Option<i64>,
    sources: Option<args::TextArray>,
    now_ms: Option<i64>,
) -> &'static str {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let name = args::text("name", name)?;
        let owner_epoch = args::count("owner_epoch", owner_epoch)?;
        let watermark = args::count("watermark", watermark)?;
        let sources = args::required("sources", sources.as_ref())?;
        args::text_array("sources", Some(sources))?;
        let now_ms = args::count("now_ms", now_ms)?;
        db::with_spi(|client| {
            activate(
                client,
                &partition,
                &name,
                owner_epoch,
                watermark,
                sources.datum(),
                now_ms,
            )
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn read_checkpoints(
    partition: Option<&str>,
) -> SetOfIterator<'static, pgrx::composite_type!('static, "sync_backfill_checkpoints")> {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let rows = db::with_spi(|client| {
            Checkpoint::rows(db::read(
                client,
                concat!(
                    "SELECT ",
                    columns!(),
                    " FROM syncular.sync_backfill_checkpoints
                         WHERE partition = $1 ORDER BY name"
                ),
                &[DatumWithOid::from(partition.as_str())],
            )?)
        })?;
        let rows = rows
            .into_iter()
            .map(Checkpoint::into_row)
            .collect::<Result<Vec<_>>>()?;
        Ok(SetOfIterator::new(rows))
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn source_coverage_seq(partition: Option<&str>, tables: Option<args::TextArray>) -> i64 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let tables = args::required("tables", tables.as_ref())?;
        args::text_array("tables", Some(tables))?;
        db::with_spi(|client| {
            // One backward index probe of sync_changes_by_source per table.
            let table = db::read(
                client,
                "SELECT coalesce(max(m.seq), 0)
                   FROM unnest($2::text[]) AS s(tbl),
                        LATERAL (SELECT max(c.commit_seq) AS seq FROM syncular.sync_changes c
                                  WHERE c.partition = $1 AND c.tbl = s.tbl COLLATE \"C\") AS m",
                &[DatumWithOid::from(partition.as_str()), tables.datum()],
            )?;
            Ok(db::first::<i64>(table)?.unwrap_or(0))
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn has_source_changes_above(
    partition: Option<&str>,
    tables: Option<args::TextArray>,
    seq: Option<i64>,
) -> String {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        let tables = args::required("tables", tables.as_ref())?;
        args::text_array("tables", Some(tables))?;
        let seq = args::count("seq", seq)?;
        db::with_spi(|client| source_changes(client, &partition, tables.datum(), seq, false))
    })
}

/// In-backend tests: each runs inside one transaction that is rolled back; scenarios that need
/// commits, several sessions or locks live in `tests/multisession`.
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use crate::testing::bigint;
    use pgrx::prelude::*;

    #[pg_test]
    fn checkpoint_cas_in_one_transaction() {
        Spi::run("SELECT syncular.declare_checkpoint('p', 'x', 1, 10)").expect("declare");
        assert_eq!(
            bigint("SELECT owner_epoch FROM syncular.claim_checkpoint('p', 'x', 1, 11)"),
            1
        );
        assert_eq!(
            bigint("SELECT owner_epoch FROM syncular.claim_checkpoint('p', 'x', 1, 12)"),
            2
        );
        let stale =
            Spi::get_one::<bool>("SELECT syncular.advance_checkpoint('p', 'x', 1, 5, 5, 13)");
        assert_eq!(stale, Ok(Some(false)));
        let owner =
            Spi::get_one::<bool>("SELECT syncular.advance_checkpoint('p', 'x', 2, 5, 5, 13)");
        assert_eq!(owner, Ok(Some(true)));
        let outcome =
            Spi::get_one::<&str>("SELECT syncular.activate_checkpoint('p', 'x', 2, 5, '{}', 14)");
        assert_eq!(outcome, Ok(Some("activated")));
    }
}
