//! Reads of PostgreSQL's own catalog that the below-SQL readers share (src/heap.rs, src/citus/mod.rs,
//! src/tables/payloads.rs): a relation's columns are found by name, never by position.

use pgrx::pg_sys;
use pgrx::FromDatum;
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
        // A virtual generated column (PostgreSQL 18) has no value in the tuple: read below SQL
        // it would be NULL or empty, not what a statement computes (red team 37, F2).
        let found = attributes.iter().position(|a| {
            !a.attisdropped
                && a.attgenerated as u8 != b'v'
                && accepts(a.atttypid)
                && is_named(a, name)
        });
        found.map(|i| i as i16 + 1)
    }
}

/// Whether `attribute` is named `name`: its `NameData` compared byte for byte with the name and
/// its terminator (no `strlen` of the attribute's name: the readers below SQL look a column up
/// by name for every value they read).
pub fn is_named(attribute: &pg_sys::FormData_pg_attribute, name: &CStr) -> bool {
    let wanted = name.to_bytes_with_nul();
    let data = &attribute.attname.data;
    wanted.len() <= data.len()
        && data
            .iter()
            .zip(wanted)
            .all(|(&have, &want)| have as u8 == want)
}

/// The scan key of `column = value` for an index or heap scan (genam.h's systable scans): the
/// equality function `equality`, under `collation`.
///
/// # Safety
/// `value` is a datum of the column's type, valid as long as the key is used.
pub unsafe fn equality_key(
    column: i16,
    equality: (u32, pg_sys::Oid),
    value: pg_sys::Datum,
) -> pg_sys::ScanKeyData {
    // SAFETY: the caller's guarantee, passed on.
    unsafe { comparison_key(column, pg_sys::BTEqualStrategyNumber, equality, value) }
}

/// The scan key of `column <op> value` for an index or heap scan: the btree strategy `strategy`
/// (`BTGreaterStrategyNumber`, …) of the comparison function `procedure`, under `collation`.
///
/// # Safety
/// `value` is a datum of the column's type, valid as long as the key is used; `procedure` is
/// the comparison `strategy` names for the column's type.
pub unsafe fn comparison_key(
    column: i16,
    strategy: u32,
    (procedure, collation): (u32, pg_sys::Oid),
    value: pg_sys::Datum,
) -> pg_sys::ScanKeyData {
    // SAFETY: a plain C struct, zeroed then filled by PostgreSQL's own initializer.
    unsafe {
        let mut key: pg_sys::ScanKeyData = std::mem::zeroed();
        pg_sys::ScanKeyEntryInitialize(
            &mut key,
            0,
            column,
            strategy as pg_sys::StrategyNumber,
            pg_sys::InvalidOid,
            collation,
            pg_sys::RegProcedure::from(procedure),
            value,
        );
        key
    }
}

/// The owner of the extension named `name`, from its `pg_extension` row found through the
/// catalog's own name index under the catalog snapshot — the read `get_extension_oid` makes,
/// without a statement (a push asks once per transaction: docs/BENCHMARKS.md, "Server CPU");
/// `None` when it is not installed.
///
/// # Safety
/// Must run inside a transaction.
pub unsafe fn extension_owner(name: &CStr) -> Option<pg_sys::Oid> {
    let bytes = name.to_bytes();
    if bytes.len() >= pg_sys::NAMEDATALEN as usize {
        return None;
    }
    // SAFETY: pg_extension opened and closed here; the key is a `name` datum (a zeroed NameData
    // holding `name`, which outlives the scan) on the column found by name, compared with
    // `nameeq` under the C collation as the catalog's index is; the owner read from the
    // relation's own descriptor, checked to be an oid column, under the catalog snapshot that
    // `systable_beginscan` registers.
    unsafe {
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let table = pg_sys::table_open(pg_sys::ExtensionRelationId, lock);
        let descriptor = (*table).rd_att;
        let columns = (
            live_attribute(descriptor, c"extname", |t| t == pg_sys::NAMEOID),
            live_attribute(descriptor, c"extowner", |t| t == pg_sys::OIDOID),
        );
        let (Some(extname), Some(extowner)) = columns else {
            pg_sys::table_close(table, lock);
            return None;
        };
        let mut wanted: pg_sys::NameData = std::mem::zeroed();
        for (slot, byte) in wanted.data.iter_mut().zip(bytes) {
            *slot = *byte as std::ffi::c_char;
        }
        let mut key = equality_key(
            extname,
            (pg_sys::F_NAMEEQ, pg_sys::C_COLLATION_OID),
            pg_sys::Datum::from(&raw const wanted),
        );
        let scan = pg_sys::systable_beginscan(
            table,
            pg_sys::Oid::from(pg_sys::ExtensionNameIndexId),
            true,
            std::ptr::null_mut(),
            1,
            &mut key,
        );
        let tuple = pg_sys::systable_getnext(scan);
        let owner = (!tuple.is_null()).then(|| {
            let mut is_null = false;
            let datum = pg_sys::heap_getattr(tuple, extowner.into(), descriptor, &mut is_null);
            pg_sys::Oid::from_datum(datum, is_null)
        });
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(table, lock);
        owner.flatten()
    }
}

/// The module path this library is loaded by (`module_pathname` in syncular.control): what
/// `pg_proc.probin` holds for the extension's C functions.
const MODULE_PATHNAME: &CStr = c"syncular";

/// Whether function `oid` is this library's C function `symbol`: `pg_proc` names language C
/// (which only a superuser can create a function in), `symbol` as its link symbol (`prosrc`)
/// and the extension's module path as its library (`probin`). Read from the catalog cache.
/// (`fmgr_info` cannot answer it: it resolves a `SECURITY DEFINER` function or one with its own
/// settings, as the fence trigger's is, to the security wrapper, not to the function.)
///
/// # Safety
/// Must run inside a transaction.
pub unsafe fn is_native_function(oid: pg_sys::Oid, symbol: &CStr) -> bool {
    /// `ClanguageId` (`pg_language.dat`: the bootstrap OID of language `c`).
    const C_LANGUAGE: pg_sys::Oid = pg_sys::Oid::from_u32(13);
    // SAFETY: a catalog-cache tuple, released below; its fixed part read as `pg_proc`'s form,
    // its two text columns read (detoasted and copied) through `SysCacheGetAttr` while held.
    unsafe {
        let cache = pg_sys::SysCacheIdentifier::PROCOID as std::ffi::c_int;
        let tuple = pg_sys::SearchSysCache1(cache, pg_sys::Datum::from(oid));
        if tuple.is_null() {
            return false;
        }
        let form = pg_sys::GETSTRUCT(tuple) as *const pg_sys::FormData_pg_proc;
        let text = |column: u32| {
            let mut is_null = false;
            let datum = pg_sys::SysCacheGetAttr(cache, tuple, column as i16, &mut is_null);
            String::from_datum(datum, is_null)
        };
        let native = (*form).prolang == C_LANGUAGE
            && text(pg_sys::Anum_pg_proc_prosrc)
                .as_deref()
                .map(str::as_bytes)
                == Some(symbol.to_bytes())
            && text(pg_sys::Anum_pg_proc_probin)
                .as_deref()
                .map(str::as_bytes)
                == Some(MODULE_PATHNAME.to_bytes());
        pg_sys::ReleaseSysCache(tuple);
        native
    }
}

/// The columns of `relation`'s primary key, by their attribute numbers in the table (what
/// `systable_beginscan` maps to the index's own), in the key's order, with the key's index;
/// `None` without a primary key. The index's definition is read from the catalog cache
/// (`pg_index` by its OID), not by opening the index: every lookup below SQL asks this, and
/// the scan that follows opens the index itself (docs/BENCHMARKS.md, "Server CPU", step 6).
///
/// # Safety
/// `relation` is an open relation.
pub unsafe fn primary_key_columns(relation: pg_sys::Relation) -> Option<(pg_sys::Oid, Vec<i16>)> {
    // SAFETY: the caller's open relation (its relcache entry keeps the primary key's OID); the
    // catalog-cache tuple is released below, its fixed part read as `pg_index`'s form, whose
    // `indkey` lies in it (as relcache.c reads it).
    unsafe {
        let index_id = crate::port::relation_primary_key_index(relation);
        if index_id == pg_sys::InvalidOid {
            return None;
        }
        let cache = pg_sys::SysCacheIdentifier::INDEXRELID as std::ffi::c_int;
        let tuple = pg_sys::SearchSysCache1(cache, pg_sys::Datum::from(index_id));
        if tuple.is_null() {
            return None;
        }
        let form = &*(pg_sys::GETSTRUCT(tuple) as *const pg_sys::FormData_pg_index);
        let columns = form
            .indkey
            .values
            .as_slice(form.indkey.dim1.max(0) as usize)
            .to_vec();
        pg_sys::ReleaseSysCache(tuple);
        Some((index_id, columns))
    }
}

/// The attribute number of `relation`'s primary key when it is one `text` column (the
/// extension's keyed tables: `sync_partitions`, `sync_writer_fence`), else `None`.
///
/// # Safety
/// `relation` is an open relation.
pub unsafe fn primary_key_text_attribute(relation: pg_sys::Relation) -> Option<i16> {
    // SAFETY: the caller's open relation; any lock keeps its primary key's definition.
    unsafe {
        let (_, columns) = primary_key_columns(relation)?;
        let [attnum] = columns[..] else {
            return None;
        };
        let attribute = pgrx::PgTupleDesc::from_pg_unchecked((*relation).rd_att)
            .get(attnum as usize - 1)
            .map(|a| a.atttypid == pg_sys::TEXTOID && !a.attisdropped);
        (attribute == Some(true)).then_some(attnum)
    }
}
