//! The check that closes a migration's re-encoding (src/schema/evolution.rs, docs/SECURITY.md
//! rule 19): the rows a table holds after every rewrite are exactly the rows the migration
//! wrote, compared as two order-independent digests — the rows written, summed as they were
//! re-encoded, and the rows stored, read again below SQL where no host code can run. The keys
//! are drawn per migration (on Citus per shard, on the shard's node: src/schema/shards.rs) and
//! never leave the backend that drew them, so no host code can craft rows whose hashes cancel
//! out.

use crate::error::Result;
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
/// that does not grow with the table, whatever order they are read in.
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

    /// The keys it hashes with (a digest of the same rows to compare with it uses them too).
    pub fn keys(&self) -> &Keys {
        &self.keys
    }
}

impl PartialEq for Digest {
    fn eq(&self, other: &Digest) -> bool {
        self.sum == other.sum && self.rows == other.rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_ignore_order_and_see_every_byte() {
        let keys = [1, -2, 3, i64::MIN];
        let rows = [("a", "1", &b"x"[..]), ("a", "2", b"y"), ("b", "1", b"")];
        let mut whole = Digest::new(&keys);
        rows.iter().for_each(|(p, id, b)| whole.add(p, id, b));
        let mut reversed = Digest::new(&keys);
        rows.iter()
            .rev()
            .for_each(|(p, id, b)| reversed.add(p, id, b));
        assert_eq!(reversed, whole);
        assert_eq!(reversed.rows(), 3);
        // A row missing, or one more, changes it.
        let mut fewer = Digest::new(&keys);
        rows[..2].iter().for_each(|(p, id, b)| fewer.add(p, id, b));
        assert_ne!(fewer, whole);
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
    }
}
