//! Column versions (docs/CODEC.md §Column versions): the `_sync_column_versions` blob, the
//! effective version of a stored column, the conflict rule and the versions an applied update
//! writes. Pure functions over ordinals; the push decides when to call them.

use super::{CodecError, Result};

/// Versions above 1 by column ordinal, ascending; `None` = no blob (a row written before
/// column versions, or an insert).
pub type Versions = Vec<(usize, u64)>;

const CORRUPT: &str = "corrupt _sync_column_versions blob";

fn leb128(out: &mut Vec<u8>, mut value: u64) {
    loop {
        let byte = (value & 0x7F) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// The blob for these versions: `(uleb128 ordinal, uleb128 version)` pairs, ascending, only
/// versions above 1; `None` (SQL NULL, never an empty bytea) when there are none.
pub fn encode(versions: &[(usize, u64)]) -> Option<Vec<u8>> {
    let mut sorted: Vec<(usize, u64)> = versions.iter().copied().filter(|&(_, v)| v > 1).collect();
    sorted.sort_unstable_by_key(|&(ordinal, _)| ordinal);
    sorted.dedup_by_key(|&mut (ordinal, _)| ordinal);
    if sorted.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(sorted.len() * 4);
    for (ordinal, version) in sorted {
        leb128(&mut out, ordinal as u64);
        leb128(&mut out, version);
    }
    Some(out)
}

/// One unsigned LEB128 number. Upstream accumulates in doubles; every real value is below
/// 2^53, so anything larger is reported as corrupt rather than rounded.
fn read_leb128(blob: &[u8], at: &mut usize) -> Result<u64> {
    let mut value: u64 = 0;
    let mut shift = 0u32;
    loop {
        // A varint may be padded with any number of zero groups: a loop over stored bytes.
        crate::interrupts::check();
        let Some(&byte) = blob.get(*at) else {
            return Err(CodecError(format!("{CORRUPT}: truncated varint")));
        };
        *at += 1;
        let group = u64::from(byte & 0x7F);
        if group != 0 {
            if shift >= 53 || group >= (1u64 << (53 - shift)) {
                return Err(CodecError(format!("{CORRUPT}: varint above 2^53")));
            }
            value |= group << shift;
        }
        if byte & 0x80 == 0 {
            return Ok(value);
        }
        // Non-minimal encodings (trailing zero groups) decode, as upstream's do.
        shift = shift.saturating_add(7);
    }
}

/// Reads a stored blob of a table with `columns` columns. `None` (SQL NULL) is "no blob"; any
/// bytes, even none, are "a blob". Pairs are read to the end; order and uniqueness are not
/// checked (a later duplicate ordinal wins); a version at or below 1 is corrupt.
///
/// Memory is bounded by the table, not by the blob (docs/DESIGN.md §Memory): a stored blob is
/// written by whoever can write the app row and may hold millions of pairs. Only the versions of
/// the table's own columns are ever read ([`effective`], [`check`], [`after_update`] ask for
/// ordinals below `columns`), so the pairs are folded into one slot per column as they are
/// read — a pair for an ordinal past the table is checked and dropped — instead of being
/// collected, sorted and deduplicated (which took about 16 bytes per blob byte).
pub fn decode(blob: Option<&[u8]>, columns: usize) -> Result<Option<Versions>> {
    let Some(blob) = blob else {
        return Ok(None);
    };
    let mut slots: Vec<u64> = crate::alloc::try_with_capacity(columns)?;
    slots.resize(columns, 0);
    let mut at = 0;
    while at < blob.len() {
        crate::interrupts::check();
        let ordinal = read_leb128(blob, &mut at)?;
        let version = read_leb128(blob, &mut at)?;
        if version <= 1 {
            return Err(CodecError(format!(
                "{CORRUPT}: version at or below 1 is never stored"
            )));
        }
        if let Some(slot) = usize::try_from(ordinal).ok().and_then(|o| slots.get_mut(o)) {
            *slot = version;
        }
    }
    Ok(Some(
        slots
            .into_iter()
            .enumerate()
            .filter(|&(_, version)| version > 1)
            .collect(),
    ))
}

/// The effective version of column `ordinal` of a stored row: the blob's entry, else 1 if a
/// blob exists, else the row's server version.
pub fn effective(blob: Option<&[(usize, u64)]>, server_version: u64, ordinal: usize) -> u64 {
    match blob {
        None => server_version,
        Some(pairs) => pairs
            .binary_search_by_key(&ordinal, |&(o, _)| o)
            .map_or(1, |i| pairs[i].1),
    }
}

/// The outcome of the conflict rule for an update of an existing row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Check {
    /// Apply (last write wins per present column).
    Apply,
    /// Conflict; the marked column ordinals (possibly none, for `baseVersion` 0).
    Conflict(Vec<usize>),
}

/// The conflict rule (docs/CODEC.md §Column versions). `present`: the payload's present columns;
/// `crdt`: whether a column is a crdt column; `base_version`: `None` when absent.
pub fn conflict(
    base_version: Option<i64>,
    present: &[usize],
    is_crdt: impl Fn(usize) -> bool,
    primary_key: usize,
    blob: Option<&[(usize, u64)]>,
    server_version: u64,
) -> Check {
    match base_version {
        None => Check::Apply,
        Some(0) => Check::Conflict(
            present
                .iter()
                .copied()
                .filter(|&i| !is_crdt(i) && i != primary_key)
                .collect(),
        ),
        Some(base) => {
            // The primary key is not excluded here: upstream's code marks it, whatever its prose says
            // (docs/CODEC.md §Column versions).
            let marked: Vec<usize> = present
                .iter()
                .copied()
                .filter(|&i| !is_crdt(i))
                .filter(|&i| {
                    let version = effective(blob, server_version, i);
                    base < 0 || version > base as u64
                })
                .collect();
            if marked.is_empty() {
                Check::Apply
            } else {
                Check::Conflict(marked)
            }
        }
    }
}

/// `conflictColumns`: a bitmap of `ceil(columns/8)` bytes, bit i (LSB first) set ⇔ i marked.
pub fn conflict_bitmap(columns: usize, marked: &[usize]) -> Vec<u8> {
    let mut bitmap = vec![0u8; columns.div_ceil(8)];
    for &i in marked {
        if let Some(byte) = bitmap.get_mut(i >> 3) {
            *byte |= 1 << (i & 7);
        }
    }
    bitmap
}

/// The versions after an applied update to `server_version + 1`: present columns other than the
/// primary key get the new version, every other column keeps its effective version. Returns the
/// new server version and the new blob (`None` when no version exceeds 1).
pub fn after_update(
    columns: usize,
    present: &[usize],
    primary_key: usize,
    blob: Option<&[(usize, u64)]>,
    server_version: u64,
) -> (u64, Option<Vec<u8>>) {
    let next = server_version + 1;
    // The present columns as a bitmap: one look per column, so an update is linear in the
    // columns however many are present (docs/SECURITY.md, "Time").
    let mut is_present = vec![false; columns];
    for &i in present {
        if let Some(slot) = is_present.get_mut(i) {
            *slot = true;
        }
    }
    // Written directly in ascending ordinal order (what `encode` would produce), without an
    // intermediate list: this runs once per updated row.
    let mut out = Vec::with_capacity(columns * 2);
    for (i, &is_present) in is_present.iter().enumerate() {
        let version = if i != primary_key && is_present {
            next
        } else {
            effective(blob, server_version, i)
        };
        if version > 1 {
            leb128(&mut out, i as u64);
            leb128(&mut out, version);
        }
    }
    (next, (!out.is_empty()).then_some(out))
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::hex;
    use super::*;

    /// CD-06: the LEB128 example, the E2/E3 blobs, NULL for none, and the corrupt cases.
    #[test]
    fn cd06_blob_encoding() {
        let example = vec![(0, 5), (1, 300), (130, 16384)];
        let bytes = hex("00 05 01 AC 02 82 01 80 80 01");
        assert_eq!(encode(&example), Some(bytes.clone()));
        assert_eq!(decode(Some(&bytes), 131), Ok(Some(example)));
        assert_eq!(encode(&[]), None);
        assert_eq!(encode(&[(0, 1), (3, 1)]), None);
        assert_eq!(decode(None, 6), Ok(None));
        assert_eq!(decode(Some(&[]), 6), Ok(Some(vec![])));
        assert_eq!(
            decode(Some(&hex("02 80")), 6).unwrap_err().0,
            "corrupt _sync_column_versions blob: truncated varint"
        );
        assert_eq!(
            decode(Some(&hex("02")), 6).unwrap_err().0,
            "corrupt _sync_column_versions blob: truncated varint"
        );
        for low in ["02 01", "02 00", "02 81 00"] {
            assert_eq!(
                decode(Some(&hex(low)), 6).unwrap_err().0,
                "corrupt _sync_column_versions blob: version at or below 1 is never stored",
                "{low}"
            );
        }
        // Non-minimal varints decode; a later duplicate ordinal wins; order is not checked.
        assert_eq!(
            decode(Some(&hex("82 00 05 01 03 02 04")), 6),
            Ok(Some(vec![(1, 3), (2, 4)]))
        );
        assert_eq!(decode(Some(&hex("02 05 02 07")), 6), Ok(Some(vec![(2, 7)])));
        assert!(decode(Some(&hex("02 FF FF FF FF FF FF FF FF 7F")), 6).is_err());
        // Ordinals past the table are checked, then dropped; the blob's size costs nothing.
        assert_eq!(decode(Some(&hex("07 05 02 03")), 6), Ok(Some(vec![(2, 3)])));
        assert!(decode(Some(&hex("07 01 02 03")), 6).is_err());
        let huge = vec![0x02u8; 10_000_000];
        assert_eq!(decode(Some(&huge), 6), Ok(Some(vec![(2, 2)])));
    }

    const TASKS: usize = 6;
    /// The row of E3: v3, blob {2:2, 3:3, 4:3}.
    fn e3() -> Versions {
        decode(Some(&hex("02 02 03 03 04 03")), TASKS)
            .unwrap()
            .unwrap()
    }

    fn no_crdt(_: usize) -> bool {
        false
    }

    /// E2 and E3 of docs/CODEC.md: the blobs written by two patches.
    #[test]
    fn worked_examples_e2_e3_versions() {
        // E1 → E2: v1 row (blob NULL), patch {id, title}.
        let (v, blob) = after_update(TASKS, &[0, 2], 0, None, 1);
        assert_eq!((v, blob), (2, Some(hex("02 02"))));
        // E3: patch {id, done, priority} with bv 2 on the v2 row: no conflict.
        let v2 = decode(Some(&hex("02 02")), TASKS).unwrap().unwrap();
        assert_eq!(
            conflict(Some(2), &[0, 3, 4], no_crdt, 0, Some(&v2), 2),
            Check::Apply
        );
        for (i, want) in [(0, 1), (3, 1), (4, 1), (2, 2)] {
            assert_eq!(effective(Some(&v2), 2, i), want);
        }
        let (v, blob) = after_update(TASKS, &[0, 3, 4], 0, Some(&v2), 2);
        assert_eq!((v, blob), (3, Some(hex("02 02 03 03 04 03"))));
    }

    fn bitmap_of(outcome: Check) -> Vec<u8> {
        match outcome {
            Check::Conflict(marked) => conflict_bitmap(TASKS, &marked),
            Check::Apply => panic!("expected a conflict"),
        }
    }

    /// The worked examples of docs/CODEC.md §Column versions, byte for byte.
    #[test]
    fn worked_examples_conflicts() {
        let blob = e3();
        let run =
            |bv: Option<i64>, present: &[usize]| conflict(bv, present, no_crdt, 0, Some(&blob), 3);
        assert_eq!(bitmap_of(run(Some(1), &[0, 2])), hex("04"));
        assert_eq!(bitmap_of(run(Some(1), &[0, 3])), hex("08"));
        assert_eq!(run(Some(2), &[0, 2]), Check::Apply);
        assert_eq!(
            after_update(TASKS, &[0, 2], 0, Some(&blob), 3),
            (4, Some(hex("02 04 03 03 04 03")))
        );
        assert_eq!(bitmap_of(run(Some(0), &[0, 1, 2, 3, 4, 5])), hex("3E"));
        assert_eq!(bitmap_of(run(Some(-1), &[0, 2])), hex("05"));
        assert_eq!(run(None, &[0, 2]), Check::Apply);
        // bv 0 with only the PK present: still a conflict, with an empty bitmap.
        assert_eq!(bitmap_of(run(Some(0), &[0])), hex("00"));
        // crdt columns are never marked.
        let crdt = |i: usize| i == 2;
        assert_eq!(
            conflict(Some(1), &[0, 2], crdt, 0, Some(&blob), 3),
            Check::Apply
        );
    }

    /// `present` in any order, with repeats, on a wide table: the same versions as the
    /// definition (a present column other than the key gets the new version, every other
    /// column keeps its effective one), written in ordinal order.
    #[test]
    fn after_update_follows_the_definition_on_wide_rows() {
        let columns = 1600;
        let blob: Versions = (0..columns)
            .step_by(7)
            .map(|i| (i, 2 + i as u64 % 5))
            .collect();
        let present: Vec<usize> = (0..columns)
            .rev()
            .filter(|i| i % 3 != 1)
            .chain([5, 5])
            .collect();
        for (blob, server_version) in [(Some(&blob[..]), 9), (None, 4)] {
            let wanted: Vec<(usize, u64)> = (0..columns)
                .map(|i| {
                    let version = if i != 2 && present.contains(&i) {
                        server_version + 1
                    } else {
                        effective(blob, server_version, i)
                    };
                    (i, version)
                })
                .collect();
            assert_eq!(
                after_update(columns, &present, 2, blob, server_version),
                (server_version + 1, encode(&wanted))
            );
        }
    }

    /// The legacy row of docs/CODEC.md: blob NULL at server version 5, and a fresh v1 row.
    #[test]
    fn worked_examples_legacy_rows() {
        assert_eq!(
            bitmap_of(conflict(Some(4), &[0, 2], no_crdt, 0, None, 5)),
            hex("05")
        );
        assert_eq!(
            conflict(Some(5), &[0, 2], no_crdt, 0, None, 5),
            Check::Apply
        );
        assert_eq!(
            after_update(TASKS, &[0, 2], 0, None, 5),
            (6, Some(hex("00 05 01 05 02 06 03 05 04 05 05 05")))
        );
        assert_eq!(
            after_update(TASKS, &[0, 1, 2, 3, 4, 5], 0, None, 1),
            (2, Some(hex("01 02 02 02 03 02 04 02 05 02")))
        );
    }
}
