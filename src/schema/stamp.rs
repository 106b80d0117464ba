//! The marker's stamp: the trigger that records, in every row version of `sync_schema_meta`,
//! the transaction that wrote it — what the row codec's snapshot check asks once the row is
//! frozen (src/schema/marker.rs, docs/SECURITY.md rule 19).

use crate::db;
use crate::error::{self, Error};
use crate::heap;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use std::cell::Cell;

thread_local! {
    /// While the stamp itself writes `sync_schema_stamp` ([`schema_marker_stamp`]): the only
    /// write [`schema_stamp_own`] lets through.
    static KEEPING: Cell<bool> = const { Cell::new(false) };
    /// What the `BEFORE` trigger last set in a row of this backend (`written_by`, `written_in`,
    /// `stamp`): the `AFTER` trigger keeps the number only of a row that still carries exactly
    /// that (red team 29: a later trigger of the owner's could change the record after ours).
    static DRAWN: Cell<Option<[i64; 3]>> = const { Cell::new(None) };
}

/// Sets [`KEEPING`] for its lifetime (an error unwinding through the write resets it too).
struct Keeping;

impl Keeping {
    fn begin() -> Keeping {
        KEEPING.with(|k| k.set(true));
        Keeping
    }
}

impl Drop for Keeping {
    fn drop(&mut self) {
        KEEPING.with(|k| k.set(false));
    }
}

/// Stamps every row version of the marker with its writer, however it is written — a
/// migration, a repair, an adoption, a restore's `COPY`, an update script, a subscriber's apply
/// (the triggers are `ENABLE ALWAYS`, kept so by the event trigger `syncular_stamp_guard`, which
/// also undoes a `DISABLE TRIGGER`: docs/API.md) — as the `BEFORE` trigger
/// `sync_schema_meta_stamp`: `written_by`, the top-level transaction, and `written_in`, the
/// (sub)transaction the write runs in — the `xmin` the row version gets —, as full ids. So the
/// record always describes the row version it is in, in this cluster's transaction ids — which a
/// physical copy (a standby, a base backup, an upgrade) shares and a logical one (a dump, a
/// subscription) writes anew — and stays true once the row is frozen (red team 24;
/// docs/SECURITY.md rule 19). And `stamp`, a random number drawn for the row version, which the
/// `AFTER` trigger `sync_schema_meta_stamp_kept` keeps in `sync_schema_stamp` once the row is
/// written (not for a write that ends up writing nothing, red team 26), a table no dump carries:
/// a row written with the stamp bypassed carries a record whose number is not this database's
/// last, and is not used (red team 25). SECURITY DEFINER: it writes the owner's
/// `sync_schema_stamp` for whoever writes the marker; nothing else runs.
#[pg_trigger]
fn schema_marker_stamp<'a>(
    trigger: &'a PgTrigger<'a>,
) -> std::result::Result<Option<PgHeapTuple<'a, AllocatedByRust>>, PgTriggerError> {
    Ok(error::run_in_host_code(|| {
        let new = trigger
            .new()
            .ok_or_else(|| Error::Internal("the marker stamp without a row".into()))?;
        let when = trigger
            .when()
            .map_err(|e| Error::Internal(format!("the marker stamp: {e}")))?;
        if !matches!(when, PgTriggerWhen::Before) {
            // The row is written: keep its number only if the `BEFORE` trigger stamped this row
            // version — in this (sub)transaction (`written_in`), and the row still carries
            // exactly the record it set (an owner's later trigger may have changed it, red team
            // 29). A row it did not stamp (disabled alone by the owner, red team 28) carries an
            // older record and number: keep a fresh number instead, which no row has, so that
            // record is never taken for this row version's.
            let carried = [
                new.get_by_name::<i64>("written_by")?,
                new.get_by_name::<i64>("written_in")?,
                new.get_by_name::<i64>("stamp")?,
            ];
            // SAFETY: this (sub)transaction's own id, assigned: it is writing this row.
            let current = unsafe { pg_sys::GetCurrentFullTransactionId().value } as i64;
            let drawn_here = DRAWN.with(|d| d.take());
            let stamp = match (carried, drawn_here) {
                ([Some(by), Some(within), Some(stamp)], Some(set))
                    if within == current && [by, within, stamp] == set =>
                {
                    stamp
                }
                _ => drawn()?,
            };
            let _keeping = Keeping::begin();
            db::with_spi(|client| {
                db::write(
                    client,
                    "INSERT INTO syncular.sync_schema_stamp AS s (id, stamp) VALUES (1, $1)
                     ON CONFLICT (id) DO UPDATE SET stamp = EXCLUDED.stamp",
                    &[DatumWithOid::from(stamp)],
                )
                .map(drop)
            })?;
            return Ok(None);
        }
        let mut new = new.into_owned();
        // SAFETY: this transaction's own ids (assigned if missing, as the write will).
        let (written_by, written_in) = unsafe {
            (
                pg_sys::GetTopFullTransactionId().value,
                pg_sys::GetCurrentFullTransactionId().value,
            )
        };
        let record = [written_by as i64, written_in as i64, drawn()?];
        new.set_by_name("written_by", record[0])?;
        new.set_by_name("written_in", record[1])?;
        new.set_by_name("stamp", record[2])?;
        DRAWN.with(|d| d.set(Some(record)));
        Ok(Some(new))
    }))
}

/// A random number from PostgreSQL's strong random source.
pub fn drawn() -> error::Result<i64> {
    let mut drawn = [0u8; 8];
    // SAFETY: fills exactly the 8 bytes of the buffer; returns false when no source works.
    if !unsafe { pg_sys::pg_strong_random(drawn.as_mut_ptr().cast(), drawn.len()) } {
        return Err(Error::Internal(
            "syncular: could not generate random values".into(),
        ));
    }
    Ok(i64::from_ne_bytes(drawn))
}

/// `sync_schema_stamp` holds only what this database's stamp wrote: every other write of it is
/// skipped (the row left as it was) — a subscriber's apply of a publication that includes it
/// (`FOR ALL TABLES`, `TABLES IN SCHEMA`, which cannot leave it out), which would stall on the
/// first migration or overwrite this database's number with the publisher's (red team 27), and
/// a restore or a hand-made write. The trigger `sync_schema_stamp_own` (`BEFORE INSERT OR
/// UPDATE`, `ENABLE ALWAYS`); it reads nothing.
#[pg_trigger]
fn schema_stamp_own<'a>(
    trigger: &'a PgTrigger<'a>,
) -> std::result::Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgTriggerError> {
    Ok(KEEPING.with(Cell::get).then(|| trigger.new()).flatten())
}

/// Refuses, once this (sub)transaction wrote the marker, a row its stamp did not stamp — the
/// stamp's triggers dropped, or changed by their owner so that they do not fire (red team 30):
/// a migration, a repair or an adoption is then not made, rather than leave the previous
/// record in the row. Read below SQL as the codec reads the marker, after the command counter
/// moved past the write; nothing to check where Citus keeps the marker on another node.
pub fn require_stamped() -> error::Result<()> {
    // SAFETY: this transaction's own ids; the latest snapshot is registered around the lookup,
    // whose key is the marker's int4 primary key.
    let (read, ids) = unsafe {
        pg_sys::CommandCounterIncrement();
        let ids = [
            pg_sys::GetTopFullTransactionId().value as i64,
            pg_sys::GetCurrentFullTransactionId().value as i64,
        ];
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        let read = super::marker::singleton(
            heap::SyncTable::SchemaMeta,
            [c"written_by", c"written_in"],
            snapshot,
        );
        pg_sys::UnregisterSnapshot(snapshot);
        (read?, ids)
    };
    match read {
        heap::Lookup::Here([Some(by), Some(within)], _) if [by, within] == ids => Ok(()),
        heap::Lookup::Elsewhere => Ok(()),
        heap::Lookup::Here(..) => Err(Error::invalid_argument("database", "unstamped").with_hint(
            "the schema marker was written without its stamp: the triggers \
             sync_schema_meta_stamp (BEFORE INSERT OR UPDATE) and sync_schema_meta_stamp_kept \
             (AFTER INSERT OR UPDATE) on syncular.sync_schema_meta, FOR EACH ROW EXECUTE \
             FUNCTION syncular.schema_marker_stamp(), ENABLE ALWAYS, were dropped or changed — \
             have the extension's owner put them back (docs/API.md schema_marker_stamp); nothing \
             was written",
        )),
    }
}
