//! A pull's writes (docs/DESIGN.md §Pull path): the registry touch (`touch_partition`) and the
//! client record (`put_client`), below SQL where both tables are on this node and the
//! transaction is READ COMMITTED, else in one statement ([`WRITE_SQL`]). Below SQL they are the
//! statement's two `INSERT … ON CONFLICT DO UPDATE`s done as the executor does them
//! (`heap::DirectInsert::upsert`): the statement was a sixth of an idle pull's backend
//! (docs/BENCHMARKS.md "Server CPU", step 13). A read-only transaction writes neither
//! (src/pull/apply.rs).

use super::window::Path;
use crate::db;
use crate::error::Result;
use crate::heap::{DirectInsert, SyncTable, Value as Cell};
use crate::registry;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use pgrx::JsonB;
use serde_json::{json, Value};
use std::ffi::CStr;

/// The request's writes in one statement: the registry touch (`touch_partition`) and, unless
/// `$9` is false, the client record (`put_client`). Returns the registry entry.
const WRITE_SQL: &str = "\
WITH touched AS (
  INSERT INTO syncular.sync_partition_registry AS r
    (partition, log_epoch, epoch_required, last_authenticated_at_ms)
  VALUES ($1, $3, false, $2)
  ON CONFLICT (partition) DO UPDATE
    SET last_authenticated_at_ms = EXCLUDED.last_authenticated_at_ms
  RETURNING partition, log_epoch, epoch_required, last_authenticated_at_ms),
recorded AS (
  INSERT INTO syncular.sync_clients
    (partition, client_id, actor_id, wire_version, cursor, subscriptions, updated_at_ms)
  SELECT $1, $4, $5, $6, $7, $8, $2 WHERE $9
  ON CONFLICT (partition, client_id) DO UPDATE
    SET actor_id = EXCLUDED.actor_id, wire_version = EXCLUDED.wire_version,
        cursor = EXCLUDED.cursor, subscriptions = EXCLUDED.subscriptions,
        updated_at_ms = EXCLUDED.updated_at_ms)
SELECT partition, log_epoch, epoch_required, last_authenticated_at_ms FROM touched";

/// `sync_partition_registry`'s columns (sql/schema.sql), and those [`WRITE_SQL`]'s conflict
/// branch sets.
const REGISTRY: &[(&CStr, pg_sys::Oid)] = &[
    (c"partition", pg_sys::TEXTOID),
    (c"log_epoch", pg_sys::TEXTOID),
    (c"epoch_required", pg_sys::BOOLOID),
    (c"last_authenticated_at_ms", pg_sys::INT8OID),
];
const REGISTRY_SET: &[bool] = &[false, false, false, true];

/// `sync_clients`' columns (sql/schema.sql), and those [`WRITE_SQL`]'s conflict branch sets.
const CLIENTS: &[(&CStr, pg_sys::Oid)] = &[
    (c"partition", pg_sys::TEXTOID),
    (c"client_id", pg_sys::TEXTOID),
    (c"actor_id", pg_sys::TEXTOID),
    (c"wire_version", pg_sys::INT4OID),
    (c"cursor", pg_sys::INT8OID),
    (c"subscriptions", pg_sys::JSONBOID),
    (c"updated_at_ms", pg_sys::INT8OID),
];
const CLIENTS_SET: &[bool] = &[false, false, true, true, true, true, true];

/// The client record a pull writes (`put_client`'s columns).
pub(super) struct Record<'a> {
    pub client_id: &'a str,
    pub actor_id: &'a str,
    pub wire_version: i32,
    pub cursor: i64,
    pub subscriptions: &'a Value,
}

/// Touches the partition's registry entry at `now_ms` (creating it at `epoch`) and writes
/// `record` when given; returns the registry entry as it stands (`registry::entry`'s object).
/// `path` is `Path::Native` but in the differential test.
pub(super) fn write(
    path: Path,
    client: &SpiClient<'_>,
    partition: &str,
    now_ms: i64,
    epoch: &str,
    record: Option<&Record<'_>>,
) -> Result<Value> {
    if path == Path::Native {
        if let Some(entry) = write_here(partition, now_ms, epoch, record)? {
            return Ok(entry);
        }
    }
    registry::single(db::write_generic(
        client,
        WRITE_SQL,
        &[
            DatumWithOid::from(partition),
            DatumWithOid::from(now_ms),
            DatumWithOid::from(epoch),
            DatumWithOid::from(record.map(|r| r.client_id)),
            DatumWithOid::from(record.map(|r| r.actor_id)),
            DatumWithOid::from(record.map(|r| r.wire_version)),
            DatumWithOid::from(record.map(|r| r.cursor)),
            DatumWithOid::from(record.map(|r| JsonB(r.subscriptions.clone()))),
            DatumWithOid::from(record.is_some()),
        ],
    )?)
}

/// [`WRITE_SQL`] below SQL, or `None` with nothing written where a table is elsewhere (Citus),
/// has anything a statement would run or another unique index than its key, or the transaction
/// is not READ COMMITTED or is read-only (`DirectInsert::open_for_upsert`).
fn write_here(
    partition: &str,
    now_ms: i64,
    epoch: &str,
    record: Option<&Record<'_>>,
) -> Result<Option<Value>> {
    let Some(mut registry) =
        DirectInsert::open_for_upsert(SyncTable::PartitionRegistry, partition, REGISTRY)?
    else {
        return Ok(None);
    };
    let clients = match record {
        Some(_) => match DirectInsert::open_for_upsert(SyncTable::Clients, partition, CLIENTS)? {
            Some(clients) => Some(clients),
            None => return Ok(None),
        },
        None => None,
    };
    let row = [
        Some(Cell::Text(partition)),
        Some(Cell::Text(epoch)),
        Some(Cell::Bool(false)),
        Some(Cell::Int8(now_ms)),
    ];
    let entry = registry.upsert(&row, REGISTRY_SET, |values, nulls| {
        // SAFETY: a row of `REGISTRY`'s columns, in their order and of their types.
        unsafe {
            Ok(json!({
                "partition": String::from_datum(values[0], nulls[0]),
                "logEpoch": String::from_datum(values[1], nulls[1]),
                "epochRequired": bool::from_datum(values[2], nulls[2]),
                "lastAuthenticatedAtMs": i64::from_datum(values[3], nulls[3]),
            }))
        }
    })?;
    if let (Some(mut clients), Some(r)) = (clients, record) {
        let subscriptions = crate::jsonb::owned(r.subscriptions)?;
        let row = [
            Some(Cell::Text(partition)),
            Some(Cell::Text(r.client_id)),
            Some(Cell::Text(r.actor_id)),
            Some(Cell::Int4(r.wire_version)),
            Some(Cell::Int8(r.cursor)),
            Some(Cell::Jsonb(subscriptions.raw())),
            Some(Cell::Int8(now_ms)),
        ];
        clients.upsert(&row, CLIENTS_SET, |_, _| Ok(()))?;
    }
    Ok(Some(entry))
}

/// In-backend tests: each runs inside one transaction that is rolled back.
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::{write, write_here, Path, Record};
    use crate::db;
    use pgrx::prelude::*;
    use serde_json::{json, Value};

    /// Both tables' rows of the partitions written, as one comparable document.
    fn stored() -> Value {
        Spi::get_one::<pgrx::JsonB>(
            "SELECT jsonb_build_array(
               (SELECT coalesce(jsonb_agg(to_jsonb(r) ORDER BY r.partition), '[]')
                  FROM syncular.sync_partition_registry r),
               (SELECT coalesce(jsonb_agg(to_jsonb(c) ORDER BY c.partition, c.client_id), '[]')
                  FROM syncular.sync_clients c))",
        )
        .expect("read")
        .expect("a document")
        .0
    }

    /// The writes below SQL and through the statement leave the same rows and answer the same
    /// registry entry, over every combination of a registry entry or none (kept epoch,
    /// `epochRequired` set or not), a stored client record of the same actor, of another actor
    /// or none, and a record written or not — and again when the same call's transaction wrote
    /// the rows a command before (the command counter moved on in between).
    #[pg_test]
    fn native_and_statement_writes_are_the_same() {
        let setups = [
            "",
            "INSERT INTO syncular.sync_partition_registry VALUES ('p1', 'e-old', true, 5)",
            "INSERT INTO syncular.sync_partition_registry VALUES ('p1', 'e-old', false, 500)",
        ];
        let clients = [
            "",
            "INSERT INTO syncular.sync_clients VALUES ('p1', 'c1', 'a1', 1, 3, '[\"x\"]', 4)",
            "INSERT INTO syncular.sync_clients VALUES ('p1', 'c1', 'a2', 2, 30, '[]', 40)",
            "INSERT INTO syncular.sync_clients VALUES ('p2', 'c1', 'a1', 1, 3, '[]', 4)",
        ];
        let subscriptions = json!([{"id": "s", "table": "tasks", "scopes": {"p": ["1", "2"]}}]);
        let record = Record {
            client_id: "c1",
            actor_id: "a1",
            wire_version: 2,
            cursor: 77,
            subscriptions: &subscriptions,
        };
        // The native side is below SQL here (a READ COMMITTED transaction, both tables here).
        assert!(write_here("p0", 1, "e0", Some(&record))
            .expect("write")
            .is_some());
        let mut compared = 0;
        for setup in setups {
            for stored_client in clients {
                for written in [None, Some(&record)] {
                    for twice in [false, true] {
                        let run = |path| {
                            Spi::run(
                                "DELETE FROM syncular.sync_partition_registry;
                                 DELETE FROM syncular.sync_clients",
                            )
                            .expect("reset");
                            for sql in [setup, stored_client] {
                                if !sql.is_empty() {
                                    Spi::run(sql).expect("setup");
                                }
                            }
                            let mut answers = Vec::new();
                            for now in if twice { vec![100, 200] } else { vec![100] } {
                                answers.push(
                                    db::with_spi(|client| {
                                        write(path, client, "p1", now, "e-new", written)
                                    })
                                    .expect("write"),
                                );
                            }
                            (answers, stored())
                        };
                        let native = run(Path::Native);
                        assert_eq!(
                            native,
                            run(Path::Sql),
                            "{setup:?} {stored_client:?} {} {twice}",
                            written.is_some()
                        );
                        compared += 1;
                    }
                }
            }
        }
        assert_eq!(compared, 48);
    }

    /// The tables the tests below change the definition of, locked first
    /// ([`crate::testing::lock_for_ddl`]).
    const DDL_TABLES: &str = "syncular.sync_partition_registry, syncular.sync_clients";

    /// Client c1 of actor a1 at cursor 1.
    fn client_one(subscriptions: &Value) -> Record<'_> {
        Record {
            client_id: "c1",
            actor_id: "a1",
            wire_version: 1,
            cursor: 1,
            subscriptions,
        }
    }

    /// Another unique index than the key (a host's, or a DBA's) sends the writes through the
    /// statement, which raises on it (23505) where below SQL a conflict on it would be taken for
    /// the key's and update another client's record (review of session 30, F1).
    #[pg_test]
    fn another_unique_index_sends_the_writes_through_the_statement() {
        crate::testing::lock_for_ddl(DDL_TABLES);
        let subscriptions = json!([]);
        let record = client_one(&subscriptions);
        assert!(write_here("p1", 1, "e", Some(&record))
            .expect("write")
            .is_some());
        Spi::run("CREATE UNIQUE INDEX one_client_per_actor ON syncular.sync_clients (actor_id)")
            .expect("index");
        assert!(write_here("p1", 2, "e", Some(&record))
            .expect("write")
            .is_none());
        // The registry alone still goes below SQL.
        assert!(write_here("p1", 3, "e", None).expect("write").is_some());
        Spi::run("DROP INDEX syncular.one_client_per_actor").expect("drop");
        Spi::run("CREATE UNIQUE INDEX one_epoch ON syncular.sync_partition_registry (log_epoch)")
            .expect("index");
        assert!(write_here("p1", 4, "e", None).expect("write").is_none());
    }

    /// A table whose updates are published without a replica identity refuses the writes below
    /// SQL as the statement refuses them (55000), before anything is written.
    #[pg_test(
        error = "cannot update table \"sync_clients\" because it does not have a replica identity and publishes updates"
    )]
    fn a_published_table_without_replica_identity_is_refused_as_the_statement_refuses_it() {
        crate::testing::lock_for_ddl(DDL_TABLES);
        Spi::run(
            "CREATE PUBLICATION syncular_clients_pub FOR TABLE syncular.sync_clients;
             ALTER TABLE syncular.sync_clients REPLICA IDENTITY NOTHING",
        )
        .expect("publication");
        let subscriptions = json!([]);
        let record = client_one(&subscriptions);
        let _ = write_here("p1", 1, "e", Some(&record));
    }
}
