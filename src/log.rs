//! Commit-seq allocation and the commit append (docs/DESIGN.md §Commit log).
//!
//! The partition row of `sync_partitions` is both the allocator (`max_commit_seq`) and the
//! partition write lock. Allocation is an increment inside the appending transaction, so a
//! rollback returns the number and committed numbers stay dense; the row lock is held until
//! commit, so commits become visible in `commit_seq` order.

use crate::args;
use crate::commit::{self, Change, Commit};
use crate::db;
use crate::error::{self, Error, Result};
use crate::heap::{self, DirectInsert, NativeTrigger, SyncTable, Value};
use crate::jsonb::JsonbArg;
use crate::notify;
use crate::push_guard;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use std::ffi::CStr;

/// The partition lock as held by this transaction.
pub struct Locked {
    /// `max_commit_seq` when the lock was granted (or as this transaction left it).
    pub max_commit_seq: i64,
    /// This call inserted the partition row (activation deletes it again: docs/DESIGN.md,
    /// gap B7 — activation left a partition row behind).
    pub created: bool,
}

/// Takes the partition write lock (L1), creating the row with `max_commit_seq = 0` if needed.
pub fn lock(client: &SpiClient<'_>, partition: &str) -> Result<Locked> {
    // Common case: the row exists. Below SQL where the table is as created and the transaction
    // READ COMMITTED (docs/DESIGN.md §Commit log); the statement otherwise.
    let below = heap::lock_by_key(
        SyncTable::Partitions,
        PARTITION_COLUMNS,
        partition,
        c"max_commit_seq",
    )?;
    if let Some(max) = below {
        return Ok(Locked {
            max_commit_seq: max,
            created: false,
        });
    }
    let key = || [DatumWithOid::from(partition)];
    // The statement: FOR UPDATE waits for the holder and returns the newest version.
    let existing = db::write(
        client,
        "SELECT max_commit_seq FROM syncular.sync_partitions WHERE partition = $1 FOR UPDATE",
        &key(),
    )?;
    if let Some(max) = db::first::<i64>(existing)? {
        return Ok(Locked {
            max_commit_seq: max,
            created: false,
        });
    }
    // New partition. Our uncommitted insert is the lock: concurrent creators wait on it.
    let inserted = db::write(
        client,
        "INSERT INTO syncular.sync_partitions (partition, max_commit_seq, horizon_seq)
         VALUES ($1, 0, 0) ON CONFLICT (partition) DO NOTHING RETURNING max_commit_seq",
        &key(),
    )?;
    if let Some(max) = db::first::<i64>(inserted)? {
        return Ok(Locked {
            max_commit_seq: max,
            created: true,
        });
    }
    // Lost the creation race: the winner has committed by now. A no-op update locks its row
    // (and raises 40001 under REPEATABLE READ when the row is newer than our snapshot).
    let raced = db::write(
        client,
        "INSERT INTO syncular.sync_partitions AS p (partition, max_commit_seq, horizon_seq)
         VALUES ($1, 0, 0)
         ON CONFLICT (partition) DO UPDATE SET max_commit_seq = p.max_commit_seq
         RETURNING p.max_commit_seq",
        &key(),
    )?;
    let max = db::first::<i64>(raced)?
        .ok_or_else(|| Error::Internal("partition upsert returned nothing".into()))?;
    Ok(Locked {
        max_commit_seq: max,
        created: false,
    })
}

/// The append as SQL, assembled from fragments: allocation and commit row (`$1`…`$6`), the
/// change rows and scope index (`$9`…`$18`, when they are not inserted directly), the tombstones
/// (`$7`, `$8`, when the commit deletes rows). The fence trigger fires on the `sync_commits`
/// insert; its error aborts the whole statement, increment included.
///
/// Why this shape (measured, docs/BENCHMARKS.md): arrays are unnested by set-returning functions
/// in the select list (a ProjectSet streams them; `FROM unnest(…)` would first copy each array
/// into a tuplestore). The scope index is a plain INSERT: its rows are distinct (deduplicated in
/// Rust) and carry a `commit_seq` this statement allocated, so none can conflict.
macro_rules! append_sql {
    ($($fragment:expr),*) => {
        concat!(
            "WITH alloc AS (
  INSERT INTO syncular.sync_partitions AS p (partition, max_commit_seq, horizon_seq)
  VALUES ($1, 1, 0)
  ON CONFLICT (partition) DO UPDATE SET max_commit_seq = p.max_commit_seq + 1
  RETURNING p.max_commit_seq AS seq
), commit_row AS (
  INSERT INTO syncular.sync_commits
    (partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms, writer_version)
  SELECT $1, alloc.seq, $2, $3, $4, $5, $6 FROM alloc
  RETURNING commit_seq
)",
            $($fragment,)*
            "
SELECT commit_seq FROM commit_row"
        )
    };
}

macro_rules! rows_fragment {
    () => {
        ", change_rows AS (
  INSERT INTO syncular.sync_changes
    (partition, commit_seq, idx, tbl, row_id, op, row_version, scopes, payload)
  SELECT $1, commit_row.commit_seq, unnest($9::int4[]), unnest($10::text[]), unnest($11::text[]),
         unnest($12::int2[]), unnest($13::int8[]), unnest($14::jsonb[]), unnest($15::bytea[])
  FROM commit_row
), scope_rows AS (
  INSERT INTO syncular.sync_change_scopes (partition, tbl, var, value, commit_seq)
  SELECT $1, unnest($16::text[]), unnest($17::text[]), unnest($18::text[]), commit_row.commit_seq
  FROM commit_row
)"
    };
}

macro_rules! tombstones_fragment {
    () => {
        ", tombstone_rows AS (
  INSERT INTO syncular.sync_tombstones (partition, tbl, row_id, commit_seq)
  SELECT $1, unnest($7::text[]), unnest($8::text[]), commit_row.commit_seq FROM commit_row
  ON CONFLICT (partition, tbl, row_id) DO UPDATE SET commit_seq = EXCLUDED.commit_seq
)"
    };
}

/// `[without tombstones, with tombstones]`, for each way of writing the change rows.
/// The tombstones of a commit appended below SQL (`$2`: its `commit_seq`).
const TOMBSTONES_SQL: &str =
    "INSERT INTO syncular.sync_tombstones (partition, tbl, row_id, commit_seq)
SELECT $1, unnest($3::text[]), unnest($4::text[]), $2::int8
ON CONFLICT (partition, tbl, row_id) DO UPDATE SET commit_seq = EXCLUDED.commit_seq";

/// The tombstones of a commit appended below SQL, at `seq`: one statement, or on Citus one routed
/// `INSERT … VALUES` per tombstone — Citus runs an `INSERT … SELECT` through its COPY path, which
/// takes the metadata lock of every shard of the table, so a delegated push waited while any
/// shard group on its worker was being moved (docs/SCALING.md, "Waits on a worker").
fn write_tombstones(
    client: &SpiClient<'_>,
    partition: &str,
    seq: i64,
    tables: Vec<&str>,
    rows: Vec<&str>,
) -> Result<()> {
    if !crate::citus::installed() {
        db::write(
            client,
            TOMBSTONES_SQL,
            &[
                DatumWithOid::from(partition),
                DatumWithOid::from(seq),
                DatumWithOid::from(tables),
                DatumWithOid::from(rows),
            ],
        )?;
        return Ok(());
    }
    for (tbl, row_id) in tables.into_iter().zip(rows) {
        crate::interrupts::check();
        db::write(
            client,
            "INSERT INTO syncular.sync_tombstones (partition, tbl, row_id, commit_seq)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (partition, tbl, row_id) DO UPDATE SET commit_seq = EXCLUDED.commit_seq",
            &[
                DatumWithOid::from(partition),
                DatumWithOid::from(tbl),
                DatumWithOid::from(row_id),
                DatumWithOid::from(seq),
            ],
        )?;
    }
    Ok(())
}

const COMMIT_ONLY_SQL: [&str; 2] = [append_sql!(), append_sql!(tombstones_fragment!())];
const WHOLE_COMMIT_SQL: [&str; 2] = [
    append_sql!(rows_fragment!()),
    append_sql!(rows_fragment!(), tombstones_fragment!()),
];

const PARTITION_COLUMNS: &[(&CStr, pg_sys::Oid)] = &[
    (c"partition", pg_sys::TEXTOID),
    (c"max_commit_seq", pg_sys::INT8OID),
    (c"horizon_seq", pg_sys::INT8OID),
];

const COMMIT_COLUMNS: &[(&CStr, pg_sys::Oid)] = &[
    (c"partition", pg_sys::TEXTOID),
    (c"commit_seq", pg_sys::INT8OID),
    (c"client_id", pg_sys::TEXTOID),
    (c"client_commit_id", pg_sys::TEXTOID),
    (c"actor_id", pg_sys::TEXTOID),
    (c"created_at_ms", pg_sys::INT8OID),
    (c"writer_version", pg_sys::INT8OID),
];

const CHANGE_COLUMNS: &[(&CStr, pg_sys::Oid)] = &[
    (c"partition", pg_sys::TEXTOID),
    (c"commit_seq", pg_sys::INT8OID),
    (c"idx", pg_sys::INT4OID),
    (c"tbl", pg_sys::TEXTOID),
    (c"row_id", pg_sys::TEXTOID),
    (c"op", pg_sys::INT2OID),
    (c"row_version", pg_sys::INT8OID),
    (c"scopes", pg_sys::JSONBOID),
    (c"payload", pg_sys::BYTEAOID),
];

const SCOPE_COLUMNS: &[(&CStr, pg_sys::Oid)] = &[
    (c"partition", pg_sys::TEXTOID),
    (c"tbl", pg_sys::TEXTOID),
    (c"var", pg_sys::TEXTOID),
    (c"value", pg_sys::TEXTOID),
    (c"commit_seq", pg_sys::INT8OID),
];

/// Appends a validated commit; returns its `commit_seq`.
///
/// Below SQL where the tables are as created ([`heap::DirectInsert`]; on Citus, the partition's
/// shards on this node) and this transaction holds the partition row ([`lock`], taken here if it
/// does not yet): the fence's check (what its trigger on `sync_commits` runs), the allocation (an
/// update of the held row), the commit row, the change rows and the scope index; the tombstones,
/// an upsert, as one statement. Otherwise as SQL: the allocation and commit row as one statement
/// (an upsert taking the row lock, the fence trigger firing), the change rows and scope index
/// directly where those tables allow it, else in that statement too.
pub fn append<'a>(client: &SpiClient<'_>, partition: &str, commit: &Commit<'a>) -> Result<i64> {
    let direct = (
        DirectInsert::open(SyncTable::Changes, partition, CHANGE_COLUMNS)?,
        DirectInsert::open(SyncTable::ChangeScopes, partition, SCOPE_COLUMNS)?,
    );
    let tombstones = commit.tombstones();
    let (tombstone_tables, tombstone_rows) = (
        tombstones.iter().map(|t| t.0).collect::<Vec<_>>(),
        tombstones.iter().map(|t| t.1).collect::<Vec<_>>(),
    );
    let (Some(mut changes), Some(mut scopes)) = direct else {
        let mut args = commit_args(partition, commit);
        args.push(DatumWithOid::from(tombstone_tables));
        args.push(DatumWithOid::from(tombstone_rows));
        args.extend(change_arrays(commit));
        let sql = WHOLE_COMMIT_SQL[!tombstones.is_empty() as usize];
        return commit_seq(db::write(client, sql, &args)?);
    };
    let seq = match allocate_held(client, partition, commit)? {
        Some(seq) => {
            if !tombstones.is_empty() {
                write_tombstones(client, partition, seq, tombstone_tables, tombstone_rows)?;
            }
            seq
        }
        None => {
            let mut args = commit_args(partition, commit);
            if !tombstones.is_empty() {
                args.push(DatumWithOid::from(tombstone_tables));
                args.push(DatumWithOid::from(tombstone_rows));
            }
            commit_seq(db::write(
                client,
                COMMIT_ONLY_SQL[!tombstones.is_empty() as usize],
                &args,
            )?)?
        }
    };
    for (idx, change) in commit.changes.iter().enumerate() {
        crate::interrupts::check();
        changes.insert(&[
            Some(Value::Text(partition)),
            Some(Value::Int8(seq)),
            Some(Value::Int4(idx as i32)),
            Some(Value::Text(change.table)),
            Some(Value::Text(change.row_id)),
            Some(Value::Int2(change.op as i16)),
            change.row_version.map(Value::Int8),
            Some(Value::Jsonb(change.scopes_jsonb)),
            change.payload.as_deref().map(Value::Bytea),
        ])?;
    }
    for (table, var, value) in commit.scope_index() {
        crate::interrupts::check();
        scopes.insert(&[
            Some(Value::Text(partition)),
            Some(Value::Text(table)),
            Some(Value::Text(var)),
            Some(Value::Text(value)),
            Some(Value::Int8(seq)),
        ])?;
    }
    Ok(seq)
}

/// `$1`…`$6` of the append statements: the commit row but its `commit_seq`.
fn commit_args<'a>(partition: &'a str, commit: &Commit<'a>) -> Vec<DatumWithOid<'a>> {
    vec![
        DatumWithOid::from(partition),
        DatumWithOid::from(commit.client_id),
        DatumWithOid::from(commit.client_commit_id),
        DatumWithOid::from(commit.actor_id),
        DatumWithOid::from(commit.created_at_ms),
        DatumWithOid::from(commit.writer_version),
    ]
}

/// The allocation and the commit row below SQL, when this transaction holds the partition row
/// (it took the partition lock, [`lock`], or created the row; else the lock is taken here) and
/// both tables are as created:
/// the fence checked as its trigger checks (the trigger must be there, the only one, and
/// firing), `max_commit_seq` raised by one in the held row, the commit row inserted. `None`,
/// with nothing written, otherwise: the statement does it.
fn allocate_held(
    client: &SpiClient<'_>,
    partition: &str,
    commit: &Commit<'_>,
) -> Result<Option<i64>> {
    let fence = NativeTrigger {
        symbol: c"writer_fence_trigger_wrapper",
        run: fence_row,
    };
    let (Some(mut partitions), Some(mut commits)) = (
        DirectInsert::open(SyncTable::Partitions, partition, PARTITION_COLUMNS)?,
        DirectInsert::open_with_trigger(
            SyncTable::Commits,
            partition,
            COMMIT_COLUMNS,
            Some(fence),
        )?,
    ) else {
        return Ok(None);
    };
    // Not held yet (the classic `append_commit`, which takes no partition lock first): the lock
    // below SQL, then the allocation — the statement's upsert would take the same row lock, but
    // on Citus its CTE's results go to every node and the call commits by 2PC (docs/SCALING.md).
    let seq = match partitions.increment_held(partition, c"max_commit_seq")? {
        Some(seq) => Some(seq),
        None => {
            lock(client, partition)?;
            partitions.increment_held(partition, c"max_commit_seq")?
        }
    };
    let Some(seq) = seq else {
        return Ok(None);
    };
    // As in the statement: the fence is checked on the commit row, after the allocation; its
    // error aborts both.
    commits.insert(&[
        Some(Value::Text(partition)),
        Some(Value::Int8(seq)),
        Some(Value::Text(commit.client_id)),
        Some(Value::Text(commit.client_commit_id)),
        Some(Value::Text(commit.actor_id)),
        Some(Value::Int8(commit.created_at_ms)),
        commit.writer_version.map(Value::Int8),
    ])?;
    Ok(Some(seq))
}

/// The writer fence's trigger (src/fence.rs) for one `sync_commits` row in [`COMMIT_COLUMNS`].
fn fence_row(row: &[Option<Value<'_>>]) -> Result<()> {
    let writer_version = match row.get(6) {
        Some(Some(Value::Int8(w))) => Some(*w),
        _ => None,
    };
    match row.first() {
        Some(Some(Value::Text(partition))) => crate::fence::check(partition, writer_version),
        _ => Err(Error::Internal("a commit row without its partition".into())),
    }
}

/// `$9`…`$18` of the whole-commit statement: the change rows and the scope index as arrays.
fn change_arrays<'a>(commit: &Commit<'a>) -> Vec<DatumWithOid<'a>> {
    let changes = &commit.changes;
    let column = |f: fn(&Change<'a>) -> &'a str| changes.iter().map(f).collect::<Vec<_>>();
    let scopes = commit.scope_index();
    vec![
        DatumWithOid::from((0..changes.len() as i32).collect::<Vec<_>>()),
        DatumWithOid::from(column(|c| c.table)),
        DatumWithOid::from(column(|c| c.row_id)),
        DatumWithOid::from(changes.iter().map(|c| c.op as i16).collect::<Vec<_>>()),
        DatumWithOid::from(changes.iter().map(|c| c.row_version).collect::<Vec<_>>()),
        DatumWithOid::from(changes.iter().map(|c| c.scopes_jsonb).collect::<Vec<_>>()),
        DatumWithOid::from(
            changes
                .iter()
                .map(|c| c.payload.as_deref())
                .collect::<Vec<_>>(),
        ),
        DatumWithOid::from(scopes.iter().map(|s| s.0).collect::<Vec<_>>()),
        DatumWithOid::from(scopes.iter().map(|s| s.1).collect::<Vec<_>>()),
        DatumWithOid::from(scopes.iter().map(|s| s.2).collect::<Vec<_>>()),
    ]
}

fn commit_seq(table: pgrx::spi::SpiTupleTable<'_>) -> Result<i64> {
    db::first::<i64>(table)?.ok_or_else(|| Error::Internal("append returned no commit_seq".into()))
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn lock_partition(partition: Option<&str>) -> i64 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        db::with_spi(|client| Ok(lock(client, &partition)?.max_commit_seq))
    })
}

#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn append_commit(partition: Option<&str>, commit: Option<JsonbArg>) -> i64 {
    error::run(|| {
        let partition = args::text_ref("partition", partition)?;
        // Validate everything before anything is locked or written.
        commit::with_commit(commit, |commit| {
            push_guard::check_append(partition, commit.client_id, commit.client_commit_id)?;
            let seq = db::with_spi(|client| append(client, partition, commit))?;
            push_guard::appended(seq);
            notify::appended(partition, seq);
            crate::feed::appended(partition, seq);
            Ok(seq)
        })
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn max_commit_seq(partition: Option<&str>) -> i64 {
    error::run(|| {
        let partition = args::text("partition", partition)?;
        db::with_spi(|client| {
            let table = db::read(
                client,
                "SELECT max_commit_seq FROM syncular.sync_partitions WHERE partition = $1",
                &[DatumWithOid::from(partition.as_str())],
            )?;
            Ok(db::first::<i64>(table)?.unwrap_or(0))
        })
    })
}

/// In-backend tests: each runs inside one transaction that is rolled back; scenarios that need
/// commits, several sessions or locks live in `tests/multisession`.
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use crate::testing::{bigint, COMMIT};
    use pgrx::prelude::*;

    #[pg_test]
    fn appends_in_one_transaction_are_dense() {
        for expected in 1..=3 {
            assert_eq!(
                bigint(&format!("SELECT syncular.append_commit('p', {COMMIT})")),
                expected
            );
        }
        assert_eq!(bigint("SELECT syncular.max_commit_seq('p')"), 3);
        assert_eq!(
            bigint("SELECT count(*) FROM syncular.sync_change_scopes"),
            3
        );
    }

    /// A virtual generated column (PostgreSQL 18) where the log has a stored one is neither read
    /// below SQL — its value is not in the tuple: the change's `row_version` read back as NULL —
    /// nor written there (a heap insert would store the value given); the reader refuses the
    /// table as not as created (red team 37, F2, an owner's change), and the append goes through
    /// its statement, which PostgreSQL refuses for that column.
    #[cfg(feature = "pg18")]
    #[pg_test]
    fn a_virtual_generated_column_is_never_read_or_written_below_sql() {
        crate::testing::lock_for_ddl("syncular.sync_changes");
        Spi::run(&format!(
            "SELECT syncular.append_commit('virtual', {COMMIT})"
        ))
        .expect("append");
        Spi::run(
            "ALTER TABLE syncular.sync_changes DROP COLUMN row_version;
             ALTER TABLE syncular.sync_changes
               ADD COLUMN row_version bigint GENERATED ALWAYS AS (commit_seq * 1000 + idx) VIRTUAL",
        )
        .expect("alter");
        Spi::run(
            "CREATE FUNCTION pg_temp.refusal(q text) RETURNS text LANGUAGE plpgsql AS
               $$DECLARE r text; BEGIN EXECUTE q INTO r; RETURN 'done ' || coalesce(r, '-'); EXCEPTION WHEN OTHERS THEN RETURN SQLERRM; END$$",
        )
        .expect("helper");
        let refusal = |q: &str| {
            Spi::get_one_with_args::<String>("SELECT pg_temp.refusal($1)", &[q.into()])
                .expect("query")
                .unwrap_or_default()
        };
        let read = refusal(
            "SELECT string_agg(row_id || ':' || coalesce(row_version::text, 'null'), ',') FROM syncular.read_commit_window('virtual', 'tasks', '{\"project_id\":[\"p1\"]}', 0, 1, 10)",
        );
        assert!(read.contains("has no column"), "{read}");
        let written = refusal(&format!(
            "SELECT syncular.append_commit('virtual', {COMMIT})"
        ));
        assert!(written.contains("row_version"), "{written}");
    }

    /// The change rows and scope index are inserted below SQL only while their tables are as
    /// created: with a trigger on `sync_changes` (or a column added) the whole commit is one
    /// statement again, the trigger fires for every change, and the rows are the same.
    #[pg_test]
    fn direct_and_statement_appends_write_the_same_rows() {
        crate::testing::lock_for_ddl("syncular.sync_changes, syncular.sync_change_scopes");
        let rows = |p: &str| {
            Spi::get_one::<String>(&format!(
                "SELECT string_agg(format('%s|%s|%s|%s|%s|%s|%s|%s', commit_seq, idx, tbl, row_id, op,
                                          row_version, scopes, encode(payload, 'hex')), ';' ORDER BY commit_seq, idx)
                 || '/' || (SELECT string_agg(format('%s|%s|%s|%s', tbl, var, value, commit_seq), ';'
                                              ORDER BY tbl, var, value, commit_seq)
                            FROM syncular.sync_change_scopes WHERE partition = '{p}')
                 || '/' || (SELECT string_agg(format('%s|%s|%s', tbl, row_id, commit_seq), ';' ORDER BY tbl, row_id)
                            FROM syncular.sync_tombstones WHERE partition = '{p}')
                 FROM syncular.sync_changes WHERE partition = '{p}'"
            ))
            .expect("query")
            .expect("rows")
        };
        let commit = r#"'{"clientId":"c1","clientCommitId":"k","actorId":"a1","createdAtMs":1,
            "changes":[{"table":"tasks","rowId":"t1","op":"upsert","rowVersion":3,
                        "scopes":{"project_id":"p1","org":"o"},"payload":"AQID"},
                       {"table":"tasks","rowId":"t2","op":"delete","scopes":{"project_id":"p1"}},
                       {"table":"notes","rowId":"n1","op":"upsert","scopes":{}}]}'"#;
        let append = |p: &str| {
            Spi::run(&format!("SELECT syncular.append_commit('{p}', {commit})")).expect("append")
        };
        append("direct");
        Spi::run(
            "CREATE TABLE public.audit (n int);
             CREATE FUNCTION public.audit_change() RETURNS trigger LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.audit VALUES (NEW.idx); RETURN NEW; END$$;
             CREATE TRIGGER audit AFTER INSERT ON syncular.sync_changes
               FOR EACH ROW EXECUTE FUNCTION public.audit_change();",
        )
        .expect("trigger");
        append("triggered");
        assert_eq!(bigint("SELECT count(*) FROM public.audit"), 3);
        // The statement form without tombstones, too.
        Spi::run(
            r#"SELECT syncular.append_commit('no-deletes', '{"clientId":"c1","clientCommitId":"k",
                 "actorId":"a1","createdAtMs":1,"changes":[{"table":"tasks","rowId":"t1",
                 "op":"upsert","scopes":{"project_id":"p1"}}]}')"#,
        )
        .expect("append");
        assert_eq!(bigint("SELECT count(*) FROM public.audit"), 4);
        Spi::run("DROP TRIGGER audit ON syncular.sync_changes").expect("drop");
        Spi::run("ALTER TABLE syncular.sync_change_scopes ADD COLUMN note text").expect("alter");
        append("altered");
        let direct = rows("direct");
        assert!(direct.contains("tasks|org|o|1"), "{direct}");
        assert_eq!(rows("triggered"), direct);
        assert_eq!(rows("altered"), direct);
    }

    /// How often this transaction called the fence's trigger function (`track_functions`).
    fn fence_trigger_calls() -> i64 {
        bigint(
            "SELECT coalesce(sum(calls), 0)::bigint FROM pg_catalog.pg_stat_xact_user_functions
              WHERE schemaname = 'syncular' AND funcname = 'writer_fence_trigger'",
        )
    }

    /// Where this transaction holds the partition row (`lock_partition`), the allocation and the
    /// commit row are written below SQL: the fence is checked natively (its trigger function is
    /// never called), the numbers stay dense, and the row's primary-key index follows its new
    /// versions once they leave their page (hundreds of updates of one row in one transaction,
    /// none prunable). Without the lock (a partition this transaction never locked, as the
    /// classic `append_commit` is called) the append takes it below SQL first and appends the
    /// same way — before issue 30's local writes, the statement appended, firing the trigger (on
    /// Citus, with a two-phase commit across every node: docs/SCALING.md).
    #[pg_test]
    fn a_held_partition_is_appended_below_sql_and_its_index_follows() {
        Spi::run("SET LOCAL track_functions = 'all'").expect("set");
        Spi::run("SELECT syncular.lock_partition('held')").expect("lock");
        for expected in 1..=400 {
            assert_eq!(
                bigint(&format!("SELECT syncular.append_commit('held', {COMMIT})")),
                expected
            );
        }
        assert_eq!(fence_trigger_calls(), 0);
        assert_eq!(
            bigint("SELECT count(*) FROM syncular.sync_commits WHERE partition = 'held'"),
            400
        );
        // Through the index alone: the newest version is found by its key, and is no longer on
        // the row's first page (so its index entry was written here, not inherited by HOT).
        Spi::run("SET LOCAL enable_seqscan = off").expect("set");
        Spi::run("SET LOCAL enable_bitmapscan = off").expect("set");
        let plan = Spi::get_one::<String>(
            "EXPLAIN (COSTS OFF) SELECT max_commit_seq FROM syncular.sync_partitions
              WHERE partition = 'held'",
        )
        .expect("explain")
        .expect("plan");
        assert!(plan.contains("Index Scan"), "{plan}");
        assert_eq!(
            bigint("SELECT max_commit_seq FROM syncular.sync_partitions WHERE partition = 'held'"),
            400
        );
        assert!(
            bigint(
                "SELECT (ctid::text::point)[0]::bigint FROM syncular.sync_partitions
                  WHERE partition = 'held'"
            ) > 0
        );
        let amcheck = Spi::get_one::<bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_available_extensions WHERE name = 'amcheck')",
        )
        .expect("query")
        .expect("answer");
        if amcheck {
            Spi::run("CREATE EXTENSION IF NOT EXISTS amcheck").expect("amcheck");
            Spi::run("SELECT bt_index_check('syncular.sync_partitions_pkey'::regclass, true)")
                .expect("every row version the heap holds is in the index");
        }
        for expected in 1..=3 {
            assert_eq!(
                bigint(&format!(
                    "SELECT syncular.append_commit('unheld', {COMMIT})"
                )),
                expected
            );
        }
        assert_eq!(fence_trigger_calls(), 0);
        assert_eq!(
            bigint(
                "SELECT max_commit_seq FROM syncular.sync_partitions WHERE partition = 'unheld'"
            ),
            3
        );
    }

    /// The allocation below SQL finds the held row at the place the lock (or the last
    /// allocation) left it, and trusts that place only while the row was not changed since: a
    /// statement that updates the held row in between moves it, and the next allocation looks it
    /// up by its key again — still below SQL, the numbers still dense.
    #[pg_test]
    fn a_held_row_changed_by_a_statement_is_looked_up_again() {
        Spi::run("SET LOCAL track_functions = 'all'").expect("set");
        Spi::run("SELECT syncular.lock_partition('moved')").expect("lock");
        let append = || bigint(&format!("SELECT syncular.append_commit('moved', {COMMIT})"));
        assert_eq!(append(), 1);
        Spi::run(
            "UPDATE syncular.sync_partitions SET horizon_seq = horizon_seq WHERE partition = 'moved'",
        )
        .expect("update");
        assert_eq!(append(), 2);
        assert_eq!(append(), 3);
        assert_eq!(fence_trigger_calls(), 0);
        assert_eq!(
            bigint("SELECT max_commit_seq FROM syncular.sync_partitions WHERE partition = 'moved'"),
            3
        );
    }

    /// The commit row goes below SQL only under the fence trigger alone, firing: with another
    /// trigger beside it, or in a session where it does not fire (`session_replication_role =
    /// replica`: it is enabled for origin sessions), the statement appends, and the outcome is
    /// the statement's — every trigger fires, and the fence is checked exactly where its
    /// trigger fires.
    #[pg_test]
    fn the_commit_row_goes_below_sql_only_under_the_fence_alone() {
        crate::testing::lock_for_ddl("syncular.sync_commits");
        Spi::run("SET LOCAL track_functions = 'all'").expect("set");
        Spi::run(
            "CREATE TABLE public.commit_audit (seq bigint);
             CREATE FUNCTION public.audit_commit() RETURNS trigger LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.commit_audit VALUES (NEW.commit_seq); RETURN NEW; END$$;
             CREATE TRIGGER commit_audit AFTER INSERT ON syncular.sync_commits
               FOR EACH ROW EXECUTE FUNCTION public.audit_commit();",
        )
        .expect("trigger");
        Spi::run("SELECT syncular.lock_partition('audited')").expect("lock");
        let append = |p: &str| bigint(&format!("SELECT syncular.append_commit('{p}', {COMMIT})"));
        assert_eq!(append("audited"), 1);
        assert_eq!(bigint("SELECT count(*) FROM public.commit_audit"), 1);
        assert_eq!(fence_trigger_calls(), 1);
        Spi::run("DROP TRIGGER commit_audit ON syncular.sync_commits").expect("drop");
        assert_eq!(append("audited"), 2);
        assert_eq!(fence_trigger_calls(), 1);
        // The commit's writer version is 2: below a fence of 3, which only a firing trigger checks.
        Spi::run("SELECT syncular.raise_writer_fence('replica', 3)").expect("fence");
        Spi::run("SET LOCAL session_replication_role = replica").expect("set");
        Spi::run("SELECT syncular.lock_partition('replica')").expect("lock");
        assert_eq!(append("replica"), 1);
        assert_eq!(fence_trigger_calls(), 1);
    }

    #[pg_test(error = "sync.storage.writer_fence_rejected")]
    fn a_held_partition_below_its_fence_is_refused_below_sql() {
        Spi::run("SELECT syncular.raise_writer_fence('fenced', 3)").expect("fence");
        Spi::run("SELECT syncular.lock_partition('fenced')").expect("lock");
        Spi::run(&format!(
            "SELECT syncular.append_commit('fenced', {COMMIT})"
        ))
        .expect("refused");
    }

    #[pg_test(error = "sync.storage.invalid_commit")]
    fn malformed_commit_is_refused() {
        Spi::run("SELECT syncular.append_commit('p', '{\"clientId\":\"c1\"}')").expect("refused");
    }

    #[pg_test(error = "sync.storage.invalid_argument")]
    fn null_partition_is_refused() {
        Spi::run("SELECT syncular.max_commit_seq(NULL)").expect("refused");
    }
}
