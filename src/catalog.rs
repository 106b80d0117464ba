//! Reads of PostgreSQL's own catalog that the below-SQL readers share (src/heap.rs, src/citus.rs,
//! src/tables/payloads.rs): a relation's columns are found by name, never by position.

use pgrx::pg_sys;
use std::ffi::CStr;

/// The attribute number (1-based) of the live column `name` of `descriptor` whose type
/// `accepts`, if there is one: found by name, so a column added or dropped never shifts what is
/// read.
///
/// # Safety
/// `descriptor` is the tuple descriptor of an open relation.
pub unsafe fn live_attribute(
    descriptor: pg_sys::TupleDesc,
    name: &CStr,
    accepts: impl Fn(pg_sys::Oid) -> bool,
) -> Option<i16> {
    // SAFETY: the caller guarantees an open relation's descriptor; `attname` is NUL-terminated.
    unsafe {
        let attributes = pgrx::PgTupleDesc::from_pg_unchecked(descriptor);
        let found = attributes.iter().position(|a| {
            !a.attisdropped
                && accepts(a.atttypid)
                && CStr::from_ptr(a.attname.data.as_ptr()) == name
        });
        found.map(|i| i as i16 + 1)
    }
}
