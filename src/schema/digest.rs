//! The check that closes a migration's re-encoding (src/schema/evolution.rs, docs/SECURITY.md
//! rule 19): the rows a table holds after every rewrite are exactly the rows the migration
//! wrote, compared as two order-independent digests — the rows written, summed as they were
//! re-encoded, and the rows stored, read again below SQL where no host code can run.
//!
//! On one node the stored rows are one heap scan. On Citus a distributed app table's rows are in
//! shards on the workers, which no scan on the coordinator reaches (docs/SCALING.md,
//! "Migrations on Citus"): each shard is digested on its own node by [`_payload_digest`], a call
//! Citus delegates (with `force_delegation`, inside the migration's transaction) to the node of
//! a partition that shard holds — over the connection that wrote the shard's re-encoded rows,
//! which Citus keeps for the colocated shards of that partition's group — and the coordinator
//! adds the shards' digests up. The keys are drawn per migration and sent only once every
//! re-encoded row is written: no host code runs after that, so none can craft rows whose hashes
//! cancel out.

use crate::db;
use crate::error::{self, Error, Result};
use crate::tables::{self, AppRelation};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use std::hash::{Hash, Hasher};

/// The keys of a migration's digests: two 128-bit SipHash keys, as four 64-bit halves.
pub type Keys = [i64; 4];

/// Keys drawn from PostgreSQL's strong random source.
pub fn fresh_keys() -> Result<Keys> {
    Ok([
        super::stamp::drawn()?,
        super::stamp::drawn()?,
        super::stamp::drawn()?,
        super::stamp::drawn()?,
    ])
}

/// An order-independent digest of a set of stored rows: the wrapping sum of a keyed 128-bit hash
/// of each `(partition, row_id, payload)` (two SipHash-2-4 under the migration's keys), and their
/// count. The rows a migration wrote and the rows the table holds afterwards compare in memory
/// that does not grow with the table. The same keys give the same digest in every backend of
/// every node running this library, so shards digested on their own nodes add up.
#[derive(Debug)]
pub struct Digest {
    keys: Keys,
    sum: u128,
    rows: u64,
}

impl Digest {
    pub fn new(keys: &Keys) -> Digest {
        Digest {
            keys: *keys,
            sum: 0,
            rows: 0,
        }
    }

    pub fn rows(&self) -> u64 {
        self.rows
    }

    pub fn add(&mut self, partition: &str, row_id: &str, payload: &[u8]) {
        let row = (partition, row_id, payload);
        let half = |k0: i64, k1: i64| {
            // SipHash-2-4 with explicit keys: std's only keyed hasher whose keys can be given
            // (deprecated for `HashMap` use, which is not this one).
            #[allow(deprecated)]
            let mut h = std::hash::SipHasher::new_with_keys(k0 as u64, k1 as u64);
            row.hash(&mut h);
            h.finish() as u128
        };
        let high = half(self.keys[0], self.keys[1]);
        let low = half(self.keys[2], self.keys[3]);
        self.sum = self.sum.wrapping_add(high << 64 | low);
        self.rows += 1;
    }

    /// The digest as [`_payload_digest`] returns it: the sum in hex, a colon, the count.
    fn to_text(&self) -> String {
        format!("{:032x}:{}", self.sum, self.rows)
    }

    /// Adds a shard's digest in [`Digest::to_text`]'s form.
    fn merge_text(&mut self, text: &str) -> Result<()> {
        let parsed = text.split_once(':').and_then(|(sum, rows)| {
            Some((
                u128::from_str_radix(sum, 16).ok()?,
                rows.parse::<u64>().ok()?,
            ))
        });
        let Some((sum, rows)) = parsed else {
            return Err(Error::Internal(format!(
                "syncular: a shard's payload digest is not one (\"{}\")",
                text.chars().take(80).collect::<String>()
            )));
        };
        self.sum = self.sum.wrapping_add(sum);
        self.rows += rows;
        Ok(())
    }
}

impl PartialEq for Digest {
    fn eq(&self, other: &Digest) -> bool {
        self.sum == other.sum && self.rows == other.rows
    }
}

/// The stored rows of a distributed app table, digested shard by shard on each shard's node
/// (module comment): two delegated [`_payload_digest`]s per shard of the partitions' colocation
/// group — every shard settled, then every shard digested —, each for a partition value that
/// shard holds, run as the migration's rewrite ran
/// (`AppRelation::digest_shard`). The table must be hash-distributed and colocated with
/// `sync_partitions` ([`require_checkable`]).
pub fn of_shards(
    client: &SpiClient<'_>,
    relation: &AppRelation,
    caller: pg_sys::Oid,
    keys: &Keys,
) -> Result<Digest> {
    let partitions = partition_per_shard(client)?;
    // Every shard settled first — locked, its session's deferred triggers fired — so no host
    // code runs once the keys are sent (`_payload_digest`).
    for partition in &partitions {
        crate::interrupts::check();
        relation.digest_shard(caller, partition, None)?;
    }
    let mut stored = Digest::new(keys);
    for partition in &partitions {
        crate::interrupts::check();
        stored.merge_text(&relation.digest_shard(caller, partition, Some(keys))?)?;
    }
    Ok(stored)
}

/// A distributed app table's rows are digested by the shards of the partitions' group, over the
/// connections that wrote them, as the rewrite's role: refused, `SY041` with a HINT, unless the
/// table is hash-distributed, colocated with `sync_partitions` (what `distribute()` reports and
/// says how to do) and not partitioned (its shards would be partitioned tables, not read below
/// SQL yet), and that role may call [`_payload_digest`] (a member of `syncular_admin`); and
/// `SY000` `database`/`missing` where `distribute()` has not delegated it yet.
pub fn require_checkable(
    client: &SpiClient<'_>,
    relation: &AppRelation,
    caller: pg_sys::Oid,
) -> Result<()> {
    let acting = relation.acting_role(caller);
    let (colocated, delegated, callable) = crate::access::as_extension_owner(|| {
        let rows = db::read(
            client,
            "SELECT p.partmethod = 'h' AND p.colocationid = s.colocationid,
                    EXISTS (SELECT 1 FROM pg_catalog.pg_dist_object o
                             WHERE o.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass
                               AND o.objid = 'syncular._payload_digest(text, text, bigint[])'
                                             ::pg_catalog.regprocedure
                               AND o.force_delegation),
                    pg_catalog.has_schema_privilege($2::pg_catalog.oid, 'syncular', 'USAGE')
                    AND pg_catalog.has_function_privilege($2::pg_catalog.oid,
                          'syncular._payload_digest(text, text, bigint[])', 'EXECUTE')
               FROM pg_catalog.pg_dist_partition p, pg_catalog.pg_dist_partition s
              WHERE p.logicalrelid = $1::pg_catalog.oid::pg_catalog.regclass
                AND s.logicalrelid = 'syncular.sync_partitions'::pg_catalog.regclass",
            &[DatumWithOid::from(relation.oid), DatumWithOid::from(acting)],
        )?;
        match rows.into_iter().next() {
            Some(row) => Ok((
                row.get::<bool>(1)?.unwrap_or(false),
                row.get::<bool>(2)?.unwrap_or(false),
                row.get::<bool>(3)?.unwrap_or(false),
            )),
            None => Ok((false, false, false)),
        }
    })?;
    if !colocated || relation.partitioned() {
        return Err(tables::unknown_table(relation.tbl()).with_hint(format!(
            "the relation registered as {} is distributed by Citus but is partitioned, or not \
             colocated with syncular.sync_partitions, so a migration cannot check its \
             re-encoded rows shard by shard: an unpartitioned table, colocated (SELECT \
             update_distributed_table_colocation('{}', colocate_with => \
             'syncular.sync_partitions'), as syncular.distribute() reports), docs/SCALING.md",
            relation.tbl(),
            relation.qualified().replace('\'', "''")
        )));
    }
    if !callable {
        // The digests run as the rewrite does: as the table's owner when the migrator holds its
        // privileges, and an owner that is not a member of syncular_admin cannot call them.
        return Err(tables::unknown_table(relation.tbl()).with_hint(format!(
            "on Citus a migration checks the re-encoded rows of the relation registered as {} \
             by syncular._payload_digest on each shard's node, run as the role the rewrite \
             runs as (its owner when the migrator holds the owner's privileges): grant that \
             role syncular_admin, docs/SCALING.md",
            relation.tbl()
        )));
    }
    if !delegated {
        // Distributed before this version: its digest would run here, where no shard is.
        return Err(Error::invalid_argument("database", "missing").with_hint(
            "syncular._payload_digest is not delegated by Citus yet (an install distributed by \
             an earlier version): run SELECT syncular.distribute() again on the coordinator, \
             docs/SCALING.md",
        ));
    }
    Ok(())
}

/// One partition value for every shard of `sync_partitions` (so of every table colocated with
/// it): candidate values `s0`, `s1`, … hashed by Citus until each shard has one. Each shard
/// takes a share of the hash space, so a few times the shard count of candidates covers them;
/// the loop is bounded and interruptible.
fn partition_per_shard(client: &SpiClient<'_>) -> Result<Vec<String>> {
    const BATCH: i64 = 4096;
    const MAX_CANDIDATES: i64 = 64 * 1024 * 1024;
    crate::access::as_extension_owner(|| {
        let shards = db::first::<i64>(db::read(
            client,
            "SELECT pg_catalog.count(*) FROM pg_catalog.pg_dist_shard
              WHERE logicalrelid = 'syncular.sync_partitions'::pg_catalog.regclass",
            &[],
        )?)?
        .unwrap_or(0);
        let mut found: std::collections::BTreeMap<i64, String> = Default::default();
        let mut from = 0i64;
        while (found.len() as i64) < shards {
            crate::interrupts::check();
            if from >= MAX_CANDIDATES {
                return Err(Error::Internal(format!(
                    "syncular: no partition value found for {} of the {shards} shards of \
                     syncular.sync_partitions among {MAX_CANDIDATES} candidates",
                    shards - found.len() as i64
                )));
            }
            let rows = db::read(
                client,
                "SELECT DISTINCT ON (shard) shard, v
                   FROM (SELECT pg_catalog.get_shard_id_for_distribution_column(
                                  'syncular.sync_partitions'::pg_catalog.regclass, 's' || i) AS shard,
                                's' || i AS v, i
                           FROM pg_catalog.generate_series($1::pg_catalog.int8,
                                                           $2::pg_catalog.int8) i) c
                  ORDER BY shard, i",
                &[
                    DatumWithOid::from(from),
                    DatumWithOid::from(from + BATCH - 1),
                ],
            )?;
            for row in rows {
                crate::interrupts::check();
                let shard = row.get::<i64>(1)?.unwrap_or(0);
                let value = db::text_column(&row, 2)?.unwrap_or_default();
                found.entry(shard).or_insert(value);
            }
            from += BATCH;
        }
        Ok(found.into_values().collect())
    })
}

/// `syncular._payload_digest(partition, tbl, keys)`, in two calls per shard of a migration on
/// Citus (module comment), delegated to the shard's node; `syncular_admin`, as the calling role
/// (`SECURITY INVOKER`: the migration runs it as the rewrite's role), who must be able to read
/// the whole table ([`AppRelation::readable_by`]: `SELECT` and no row-level security filtering
/// it), so a digest under keys of the caller's choosing tells nothing a query of the caller's
/// could not.
/// - `keys` NULL, first, for every shard: the shard locked against every other writer
///   (`ACCESS EXCLUSIVE`: a session writing the shard directly passes the table's lock), and the
///   deferred trigger events this session queued fired ([`AppRelation::fire_deferred_triggers`])
///   — host code, so before any key reaches this node: the keys are in the text of the next
///   call, which the session's own code and its role's other sessions can read (red team 50,
///   G1: a deferred trigger fired inside the keyed call read them and wrote rows whose hashes
///   cancelled out). Answers the empty string.
/// - `keys` given, then: the digest of every stored row of the shard ([`AppRelation::scan_shard`],
///   below SQL, no host code), and the shard sealed ([`seal`]): at `PREPARE` or `COMMIT`, after
///   any deferred trigger that host code re-armed (`SET CONSTRAINTS … DEFERRED`), it is read
///   again under keys drawn here that never leave this backend, and must be unchanged.
///
/// Refused where the shard is not placed on this node (`SY004`, `citus_local_execution`) —
/// always on one node.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular._payload_digest(partition text, tbl text, keys bigint[]) RETURNS text
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', '_payload_digest_wrapper';
"#
)]
fn _payload_digest(
    partition: Option<&str>,
    tbl: Option<&str>,
    keys: Option<pgrx::Array<'_, i64>>,
) -> String {
    error::run(|| {
        let partition = crate::args::text_ref("partition", partition)?;
        let tbl = crate::args::text_ref("tbl", tbl)?;
        // NULL, or exactly four halves, none NULL; the length is read before any element.
        let keys: Option<Keys> = match keys {
            None => None,
            Some(k) if k.len() == 4 => match (k.get(0), k.get(1), k.get(2), k.get(3)) {
                (Some(Some(a)), Some(Some(b)), Some(Some(c)), Some(Some(d))) => Some([a, b, c, d]),
                _ => return Err(Error::invalid_argument("keys", "shape")),
            },
            Some(_) => return Err(Error::invalid_argument("keys", "shape")),
        };
        db::with_spi(|client| {
            let Some(relation) = tables::open_for_migration(client, tbl)? else {
                return Err(tables::unknown_table(tbl));
            };
            // SAFETY: a syscache lookup of the session's user inside the call.
            let role = unsafe { pg_sys::GetUserId() };
            if !relation.readable_by(role) {
                return Err(
                    Error::invalid_argument("tbl", "not_readable").with_hint(format!(
                    "the digest of table {tbl}'s stored rows is for a role that reads the whole \
                     table: SELECT on it and no row-level security filtering its rows"
                )),
                );
            }
            let shard = relation.local_shard_of(partition)?;
            let Some(keys) = keys else {
                // SAFETY: a lock on the shard's OID for the rest of the transaction.
                unsafe {
                    pg_sys::LockRelationOid(shard, pg_sys::AccessExclusiveLock as pg_sys::LOCKMODE);
                }
                relation.fire_deferred_triggers(role)?;
                return Ok(String::new());
            };
            let local = fresh_keys()?;
            let (mut digest, mut sealed) = (Digest::new(&keys), Digest::new(&local));
            relation.scan_shard(shard, &mut |p, id, payload| {
                digest.add(p, id, payload);
                sealed.add(p, id, payload);
                Ok(true)
            })?;
            seal(shard, sealed);
            Ok(digest.to_text())
        })
    })
}

thread_local! {
    /// The shards digested in this transaction on this node, each with its digest under keys
    /// drawn here ([`seal`]); checked again at `PREPARE` or `COMMIT`.
    static SEALED: std::cell::RefCell<Vec<(pg_sys::Oid, Digest)>> =
        const { std::cell::RefCell::new(Vec::new()) };
    /// Whether [`at_transaction_end`] is registered in this backend.
    static REGISTERED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Keeps `shard`'s digest under keys only this backend knows, for [`at_transaction_end`].
fn seal(shard: pg_sys::Oid, digest: Digest) {
    if !REGISTERED.get() {
        // SAFETY: a plain function living as long as the library; PostgreSQL keeps it for the
        // backend's lifetime.
        unsafe { pg_sys::RegisterXactCallback(Some(at_transaction_end), std::ptr::null_mut()) };
        REGISTERED.set(true);
    }
    SEALED.with(|sealed| sealed.borrow_mut().push((shard, digest)));
}

/// At `PREPARE` or `COMMIT` (after the deferred triggers fired), every sealed shard read again
/// below SQL under its own keys: a change since its digest — host code the migration armed to run
/// at commit — fails the transaction (`27000`, as every interference with a re-encoding; red team
/// 50). Nothing is kept past the transaction.
///
/// # Safety
/// Called by PostgreSQL only, as the transaction callback registered by [`seal`].
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn at_transaction_end(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::XactEvent::*;
    if matches!(event, XACT_EVENT_PRE_COMMIT | XACT_EVENT_PRE_PREPARE) {
        let sealed = SEALED.with(|sealed| std::mem::take(&mut *sealed.borrow_mut()));
        let mut changed = None;
        for (shard, kept) in &sealed {
            crate::interrupts::check();
            let mut now = Digest::new(&kept.keys);
            let read = tables::scan_shard_rows(*shard, &mut |p, id, payload| {
                now.add(p, id, payload);
                Ok(true)
            });
            if read.is_err() || now != *kept {
                changed = Some((kept.rows(), now.rows()));
                break;
            }
        }
        // Nothing of ours left alive past the raise, which leaves by PostgreSQL's longjmp.
        drop(sealed);
        if let Some((then, now)) = changed {
            crate::error::raise(
                "27000",
                format!(
                    "syncular: a shard of a table migrate_schema re-encoded changed after its rows \
                     were checked ({then} rows then, {now} now): host code of the migration (a \
                     deferred trigger) wrote it at the end of the transaction"
                ),
                None,
                Some(
                    "make the relation's deferred triggers leave _sync_payload alone, or disable \
                     them for the migration"
                        .into(),
                ),
            );
        }
    }
    if matches!(
        event,
        XACT_EVENT_COMMIT | XACT_EVENT_ABORT | XACT_EVENT_PREPARE | XACT_EVENT_PARALLEL_ABORT
    ) {
        SEALED.with(|sealed| sealed.borrow_mut().clear());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_add_up_across_shards_and_see_every_byte() {
        let keys = [1, -2, 3, i64::MIN];
        let rows = [("a", "1", &b"x"[..]), ("a", "2", b"y"), ("b", "1", b"")];
        let mut whole = Digest::new(&keys);
        rows.iter().for_each(|(p, id, b)| whole.add(p, id, b));
        // Two "shards", digested apart and merged in their text form.
        let (mut one, mut two) = (Digest::new(&keys), Digest::new(&keys));
        one.add(rows[2].0, rows[2].1, rows[2].2);
        two.add(rows[0].0, rows[0].1, rows[0].2);
        two.add(rows[1].0, rows[1].1, rows[1].2);
        let mut merged = Digest::new(&keys);
        merged.merge_text(&one.to_text()).unwrap();
        merged.merge_text(&two.to_text()).unwrap();
        assert_eq!(merged, whole);
        assert_eq!(merged.rows(), 3);
        // One byte of one row, or another key, changes it.
        let mut other = Digest::new(&keys);
        other.add("a", "1", b"x");
        other.add("a", "2", b"z");
        other.add("b", "1", b"");
        assert_ne!(other, whole);
        let mut rekeyed = Digest::new(&[1, -2, 3, 4]);
        rows.iter().for_each(|(p, id, b)| rekeyed.add(p, id, b));
        assert_ne!(rekeyed.sum, whole.sum);
        // The boundary between fields counts: ("ab", "") is not ("a", "b").
        let (mut x, mut y) = (Digest::new(&keys), Digest::new(&keys));
        x.add("ab", "", b"");
        y.add("a", "b", b"");
        assert_ne!(x, y);
        assert!(merged.merge_text("zz:1").is_err());
        assert!(merged.merge_text("00").is_err());
    }
}
