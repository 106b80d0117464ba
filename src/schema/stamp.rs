//! The marker's stamp: the trigger that records, in every row version of `sync_schema_meta`,
//! the transaction that wrote it — what the row codec's snapshot check asks once the row is
//! frozen (src/schema/marker.rs, docs/SECURITY.md rule 19).

use crate::error::{self, Error};
use pgrx::prelude::*;

/// Stamps every row version of the marker with its writer, however it is written — a
/// migration, a repair, an adoption, a restore's `COPY`, an update script, a subscriber's apply
/// (the trigger `sync_schema_meta_stamp` is `ENABLE ALWAYS`): `written_by`, the top-level
/// transaction, and `written_in`, the (sub)transaction the write runs in — the `xmin` the row
/// version gets —, as full ids. So the record always describes the row version it is in, in
/// this cluster's transaction ids — which a physical copy (a standby, a base backup, an
/// upgrade) shares and a logical one (a dump, a subscription) writes anew — and stays true
/// once the row is frozen (red team 24; docs/SECURITY.md rule 19).
#[pg_trigger]
fn schema_marker_stamp<'a>(
    trigger: &'a PgTrigger<'a>,
) -> std::result::Result<Option<PgHeapTuple<'a, AllocatedByRust>>, PgTriggerError> {
    Ok(error::run_in_host_code(|| {
        let mut new = trigger
            .new()
            .ok_or_else(|| Error::Internal("the marker stamp without a row".into()))?
            .into_owned();
        // SAFETY: this transaction's own ids (assigned if missing, as the write will).
        let (written_by, written_in) = unsafe {
            (
                pg_sys::GetTopFullTransactionId().value,
                pg_sys::GetCurrentFullTransactionId().value,
            )
        };
        new.set_by_name("written_by", written_by as i64)?;
        new.set_by_name("written_in", written_in as i64)?;
        Ok(Some(new))
    }))
}
