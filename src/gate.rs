//! The serve gate (docs/DESIGN.md §Serve gate): may a process running schema version V, with
//! its declared backfills, serve? Whole-server semantics (upstream's): a pending checkpoint in
//! any partition refuses every partition for a process that did not declare it.
//!
//! The token is read from one snapshot, below SQL or by one statement (upstream read it in three
//! statements, possibly on different pooled connections: docs/DESIGN.md, gap B11 — torn gate
//! token), and `pending` is ordered by partition, then name (gap B9 — nondeterministic order).

use crate::args::{self, Declaration};
use crate::db;
use crate::error::{self, Code, Error, Result};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use pgrx::JsonB;
use serde_json::{json, Value};
use std::collections::HashSet;

/// What one snapshot says about the schema: the gate token plus the stored layouts text.
pub struct SchemaState {
    pub stored_schema_version: i64,
    pub stored_layouts: Option<String>,
    pub log_epoch: Option<String>,
    /// Non-activated checkpoints at the running version: (partition, name), ordered.
    pub pending: Vec<(String, String)>,
}

const STATE_SQL: &str = "\
SELECT coalesce(m.schema_version, 0),
       m.layouts,
       (SELECT r.log_epoch FROM syncular.sync_partition_registry r WHERE r.partition = $1),
       coalesce((SELECT jsonb_agg(jsonb_build_array(c.partition, c.name)
                                  ORDER BY c.partition, c.name)
                   FROM syncular.sync_backfill_checkpoints c
                  WHERE c.schema_version = $2 AND c.state <> 'activated'), '[]'::jsonb)
FROM (SELECT 1) AS one
LEFT JOIN syncular.sync_schema_meta m ON m.id = 1";

/// Reads the state from one snapshot. `fresh`: a new one (a writer that just waited for a
/// lock); otherwise the caller's, as a read-only statement has it. Below SQL — the marker and
/// the partition's registry row by their primary keys, the pending checkpoints through the
/// partial index made for them (docs/BENCHMARKS.md, "Server CPU") —; in one statement where
/// Citus keeps a table on another node.
pub fn read_state(
    client: &SpiClient<'_>,
    partition: Option<&str>,
    running: i64,
    fresh: bool,
) -> Result<SchemaState> {
    if let Some(state) = state_here(partition, running, fresh)? {
        return Ok(state);
    }
    let params = [DatumWithOid::from(partition), DatumWithOid::from(running)];
    let table = if fresh {
        db::write(client, STATE_SQL, &params)?
    } else {
        db::read(client, STATE_SQL, &params)?
    };
    let row = table.first();
    let pending = pending(row.get::<crate::jsonb::JsonValue>(4)?.map(|v| v.0));
    Ok(SchemaState {
        stored_schema_version: row.get::<i64>(1)?.unwrap_or(0),
        stored_layouts: row.get::<String>(2)?,
        log_epoch: row.get::<String>(3)?,
        pending,
    })
}

/// [`read_state`] below SQL, in one registered snapshot: `None` when a table is on another
/// Citus node, or the pending checkpoints' index is not as created (read through SQL then).
fn state_here(partition: Option<&str>, running: i64, fresh: bool) -> Result<Option<SchemaState>> {
    use crate::heap::{self, Lookup, SyncTable};
    heap::with_snapshot(fresh, |snapshot| {
        // SAFETY: every key is a datum built here (text in the current memory context, the
        // others by value), alive for its lookup; the snapshot is registered around them.
        unsafe {
            let marker_key = [heap::singleton_key()];
            let marker =
                heap::by_primary_key(SyncTable::SchemaMeta, None, &marker_key, snapshot, |row| {
                    row.map(|row| Ok((row.bigint(c"schema_version")?, row.text(c"layouts")?)))
                        .transpose()
                })?;
            let Lookup::Here(marker, _) = marker else {
                return Ok(None);
            };
            let log_epoch = match partition {
                None => None,
                Some(p) => {
                    let key = [heap::text_key(p)];
                    let epoch =
                        |row: Option<&heap::Row>| row.map_or(Ok(None), |r| r.text(c"log_epoch"));
                    match heap::by_primary_key(
                        SyncTable::PartitionRegistry,
                        Some(p),
                        &key,
                        snapshot,
                        epoch,
                    )? {
                        Lookup::Here(epoch, _) => epoch,
                        Lookup::Elsewhere => return Ok(None),
                    }
                }
            };
            let Some(pending) = pending_here(running, snapshot)? else {
                return Ok(None);
            };
            let (version, layouts) = marker.unwrap_or((None, None));
            Ok(Some(SchemaState {
                stored_schema_version: version.unwrap_or(0),
                stored_layouts: layouts,
                log_epoch,
                pending,
            }))
        }
    })
}

/// The checkpoints of schema version `running` not yet activated, (partition, name) in byte
/// order, read below SQL through the partial index made for them with `snapshot`; `None` when
/// Citus keeps the table on another node or the index is not as created (read through SQL
/// then).
///
/// # Safety
/// Must run inside a transaction; `snapshot` is registered or active.
pub unsafe fn pending_here(
    running: i64,
    snapshot: pg_sys::Snapshot,
) -> Result<Option<Vec<(String, String)>>> {
    use crate::heap::{self, SyncTable};
    let mut pending = Vec::new();
    let keys = [(
        c"schema_version",
        pg_sys::Datum::from(running),
        (pg_sys::F_INT8EQ, pg_sys::InvalidOid),
    )];
    // SAFETY: the caller's guarantees; the key is an int8 datum, by value.
    let here = unsafe {
        heap::rows_where(
            SyncTable::BackfillCheckpoints,
            Some(c"sync_backfill_checkpoints_pending"),
            &keys,
            snapshot,
            |row| {
                // The index holds only these, as created; checked all the same.
                if row.text(c"state")?.as_deref() != Some("activated") {
                    let text = |column| row.text(column).map(Option::unwrap_or_default);
                    crate::alloc::try_reserve(&mut pending, 1)?;
                    pending.push((text(c"partition")?, text(c"name")?));
                }
                Ok(true)
            },
        )?
    };
    if !here {
        return Ok(None);
    }
    // By partition, then name, both COLLATE "C": byte order (gap B9).
    pending.sort();
    Ok(Some(pending))
}

/// The `[[partition, name], …]` array of the pending checkpoints, as pairs.
pub fn pending(value: Option<Value>) -> Vec<(String, String)> {
    match value {
        Some(Value::Array(items)) => items
            .into_iter()
            .filter_map(|pair| match pair {
                Value::Array(mut p) if p.len() == 2 => {
                    crate::interrupts::check();
                    let name = p.pop()?.as_str()?.to_string();
                    let partition = p.pop()?.as_str()?.to_string();
                    Some((partition, name))
                }
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

impl SchemaState {
    /// The token of `read_serve_gate`.
    pub fn token(&self) -> Value {
        json!({
            "storedSchemaVersion": self.stored_schema_version,
            "logEpoch": self.log_epoch,
            "pending": self.pending.iter()
                .map(|(p, n)| json!({"partition": p, "name": n}))
                .collect::<Vec<_>>(),
        })
    }

    /// The first pending checkpoint (in token order) that `declared` does not name.
    pub fn first_undeclared(&self, declared: &[Declaration]) -> Option<&(String, String)> {
        // A set of the declarations: one lookup per pending checkpoint, never pending times
        // declared (docs/SECURITY.md, "Time").
        let declared: HashSet<(&str, &str)> = declared
            .iter()
            .map(|d| (d.partition.as_str(), d.name.as_str()))
            .collect();
        self.pending.iter().find(|(p, n)| {
            crate::interrupts::check();
            !declared.contains(&(p.as_str(), n.as_str()))
        })
    }

    /// `serve_gate_refusal`: schema refusal first, then the first undeclared pending checkpoint.
    pub fn refusal(&self, running: i64, declared: &[Declaration]) -> Option<Value> {
        if self.stored_schema_version > running {
            return Some(json!({
                "kind": "schema",
                "storedSchemaVersion": self.stored_schema_version,
                "runningSchemaVersion": running,
            }));
        }
        self.first_undeclared(declared)
            .map(|(p, n)| json!({"kind": "checkpoint", "partition": p, "projection": n}))
    }

    /// `assert_serve_ready`: the token, or `sync.schema_not_ready` with the refusal minus `kind`.
    pub fn assert_ready(&self, running: i64, declared: &[Declaration]) -> Result<Value> {
        match self.refusal(running, declared) {
            None => Ok(self.token()),
            Some(Value::Object(mut refusal)) => {
                refusal.remove("kind");
                Err(Error::new(Code::SchemaNotReady, Value::Object(refusal)))
            }
            Some(_) => unreachable!("refusals are objects"),
        }
    }
}

/// The arguments shared by the three gate functions.
fn gate_args(partition: Option<&str>, running: Option<i64>) -> Result<(String, i64)> {
    Ok((
        args::text("partition", partition)?,
        args::count("running_schema_version", running)?,
    ))
}

fn read(partition: &str, running: i64) -> Result<SchemaState> {
    db::with_spi(|client| read_state(client, Some(partition), running, false))
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn read_serve_gate(partition: Option<&str>, running_schema_version: Option<i64>) -> JsonB {
    error::run(|| {
        let (partition, running) = gate_args(partition, running_schema_version)?;
        Ok(JsonB(read(&partition, running)?.token()))
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn serve_gate_refusal(
    partition: Option<&str>,
    running_schema_version: Option<i64>,
    declared: default!(Option<args::JsonArg>, "'[]'"),
) -> Option<JsonB> {
    error::run(|| {
        let (partition, running) = gate_args(partition, running_schema_version)?;
        let declared = args::declarations(declared)?;
        Ok(read(&partition, running)?
            .refusal(running, &declared)
            .map(JsonB))
    })
}

#[pg_extern(stable, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn assert_serve_ready(
    partition: Option<&str>,
    running_schema_version: Option<i64>,
    declared: default!(Option<args::JsonArg>, "'[]'"),
) -> JsonB {
    error::run(|| {
        let (partition, running) = gate_args(partition, running_schema_version)?;
        let declared = args::declarations(declared)?;
        Ok(JsonB(
            read(&partition, running)?.assert_ready(running, &declared)?,
        ))
    })
}

/// In-backend tests: each runs inside one transaction that is rolled back; scenarios that need
/// commits, several sessions or locks live in `tests/multisession`.
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    #[pg_test]
    fn gate_token_lists_pending_in_order() {
        Spi::run("SELECT syncular.declare_checkpoint('b', 'z', 1, 1)").expect("declare");
        Spi::run("SELECT syncular.declare_checkpoint('a', 'y', 1, 1)").expect("declare");
        let token = Spi::get_one::<pgrx::JsonB>("SELECT syncular.read_serve_gate('a', 1)")
            .expect("query")
            .expect("token");
        assert_eq!(
            token.0["pending"],
            serde_json::json!([{"partition":"a","name":"y"},{"partition":"b","name":"z"}])
        );
    }
}
