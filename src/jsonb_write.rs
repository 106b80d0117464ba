//! A writer of PostgreSQL's binary `jsonb` layout, for documents the extension builds and
//! returns (the reaction documents of `claim_reactions`, `get_reaction`, `list_reactions`).
//!
//! Writing JSON text and handing it to `jsonb_in` parsed every document again: for a claim of
//! ten reactions that was the largest cost of the call outside its statement (docs/DESIGN.md §8,
//! "Reading reactions"). This writer lays the container out directly, in the layout
//! [`crate::jsonb`] reads (its module comment has the format), and produces exactly the bytes
//! `jsonb_in` produces for the same document — the tests below hold the two together byte for
//! byte over generated documents:
//! - object keys sorted by length, then bytes (`lengthCompareJsonbPair`); the callers' keys are
//!   distinct;
//! - every 32nd `JEntry` of a container stores its child's end offset, the others the child's
//!   length (`JB_OFFSET_STRIDE`, `convertJsonbArray` / `convertJsonbObject`);
//! - numerics and containers start on a 4-byte boundary counted from the varlena header, the
//!   padding counted in the child's length (`padBufferToInt`). The buffer here starts just past
//!   the 4-byte header ([`OwnedJsonb`]), so its offsets have the same alignment;
//! - an integer is the `numeric` `int8_numeric` makes: short header, base-10000 digits without
//!   leading or trailing zero digits (`make_result`), behind a 4-byte varlena header;
//! - a value read from a stored document ([`Node`]) is copied as it is: a container's bytes are
//!   position independent (offsets are relative to the container), which is what PostgreSQL
//!   relies on for a binary sub-value too.

use crate::jsonb::{Malformed, Node, OwnedJsonb};
use crate::port::jsonb::*;

/// `JB_OFFSET_STRIDE` (`src/include/utils/jsonb.h`).
const OFFSET_STRIDE: usize = 32;

/// A member or element value.
#[derive(Clone, Copy)]
pub enum Value<'a> {
    /// A string's bytes, in the database encoding (jsonb stores strings unescaped).
    String(&'a [u8]),
    /// An integer, stored as the `numeric` PostgreSQL makes of it.
    Int(i64),
    /// A value read from a stored jsonb document, written as it is.
    Node(Node<'a>),
}

/// A jsonb document being written: container bytes, past the varlena header.
#[derive(Default)]
pub struct Writer {
    buf: Vec<u8>,
}

/// The `JEntry` of a child just written: its type bits (the length is filled in by the
/// container).
type EntryType = u32;

impl Writer {
    pub fn with_capacity(bytes: usize) -> Writer {
        Writer {
            buf: Vec::with_capacity(bytes),
        }
    }

    /// The document written (its root an array or object written by [`Writer::array`] or
    /// [`Writer::object`] as the first thing).
    pub fn finish(self) -> OwnedJsonb {
        OwnedJsonb::from_container(self.buf)
    }

    /// Zero bytes up to the next 4-byte boundary (`padBufferToInt`).
    fn pad(&mut self) {
        self.buf.resize(int_align(self.buf.len()), 0);
    }

    /// A container of `header` with `entries` children, child `i` written by `child(self, i)`.
    fn container(
        &mut self,
        header: u32,
        entries: usize,
        mut child: impl FnMut(&mut Writer, usize) -> Result<EntryType, Malformed>,
    ) -> Result<EntryType, Malformed> {
        self.pad();
        self.buf.extend_from_slice(&header.to_ne_bytes());
        let jentries = self.buf.len();
        self.buf.resize(jentries + 4 * entries, 0);
        let data = self.buf.len();
        for i in 0..entries {
            crate::interrupts::check();
            let start = self.buf.len();
            let kind = child(self, i)? & JENTRY_TYPEMASK;
            // The child's length counts the padding before it, as PostgreSQL counts it.
            let field = if i % OFFSET_STRIDE == 0 {
                (self.buf.len() - data) | JENTRY_HAS_OFF as usize
            } else {
                self.buf.len() - start
            };
            if self.buf.len() - data > JENTRY_OFFLENMASK as usize {
                return Err(Malformed);
            }
            let entry = kind | field as u32;
            self.buf[jentries + 4 * i..jentries + 4 * i + 4].copy_from_slice(&entry.to_ne_bytes());
        }
        Ok(JENTRY_ISCONTAINER)
    }

    /// An array of `len` elements, element `i` written by `element(self, i)` (which writes one
    /// value with [`Writer::value`], [`Writer::object`] or [`Writer::array`]).
    pub fn array(
        &mut self,
        len: usize,
        element: impl FnMut(&mut Writer, usize) -> Result<EntryType, Malformed>,
    ) -> Result<EntryType, Malformed> {
        if len > JB_CMASK as usize {
            return Err(Malformed);
        }
        self.container(len as u32 | JB_FARRAY, len, element)
    }

    /// An object of `pairs` (distinct keys, in any order).
    pub fn object(&mut self, pairs: &mut [(&str, Value<'_>)]) -> Result<EntryType, Malformed> {
        self.members(pairs, |w, value| w.value(*value))
    }

    /// An object of `pairs` (distinct keys, in any order), each value written by `write`: the
    /// keys sorted as jsonb sorts them, then the values in that order.
    fn members<V>(
        &mut self,
        pairs: &mut [(&str, V)],
        write: impl Fn(&mut Writer, &V) -> Result<EntryType, Malformed>,
    ) -> Result<EntryType, Malformed> {
        pairs.sort_unstable_by(|(a, _), (b, _)| a.len().cmp(&b.len()).then_with(|| a.cmp(b)));
        let n = pairs.len();
        if n > JB_CMASK as usize {
            return Err(Malformed);
        }
        self.container(n as u32 | JB_FOBJECT, 2 * n, |w, i| {
            if i < n {
                w.value(Value::String(pairs[i].0.as_bytes()))
            } else {
                write(w, &pairs[i - n].1)
            }
        })
    }

    /// One value.
    pub fn value(&mut self, value: Value<'_>) -> Result<EntryType, Malformed> {
        match value {
            Value::String(bytes) => {
                self.buf.extend_from_slice(bytes);
                Ok(JENTRY_ISSTRING)
            }
            Value::Int(n) => {
                self.pad();
                push_numeric(&mut self.buf, n);
                Ok(JENTRY_ISNUMERIC)
            }
            Value::Node(node) => self.node(node),
        }
    }

    fn node(&mut self, node: Node<'_>) -> Result<EntryType, Malformed> {
        match node {
            Node::Null => Ok(JENTRY_ISNULL),
            Node::Bool(false) => Ok(JENTRY_ISBOOL_FALSE),
            Node::Bool(true) => Ok(JENTRY_ISBOOL_TRUE),
            Node::String(bytes) => self.value(Value::String(bytes)),
            Node::Number(varlena) => {
                self.pad();
                self.buf.extend_from_slice(varlena);
                Ok(JENTRY_ISNUMERIC)
            }
            Node::Array(c) | Node::Object(c) => {
                self.pad();
                self.buf.extend_from_slice(c.as_bytes());
                Ok(JENTRY_ISCONTAINER)
            }
        }
    }
}

/// The binary form of `document`, an object or array whose numbers are all 64-bit integers and
/// whose strings hold no NUL — every document the extension builds itself (push results,
/// `push_commit`'s answer): the bytes `jsonb_in` makes of its text, without the text, so that
/// reading it back gives `document` again. `Ok(None)` for any other document (a float, a NUL,
/// which `jsonb_in` refuses, a scalar root, or past jsonb's sizes): the caller converts its
/// text. The buffer is reserved once, fallibly, for the most the document can take (its size
/// comes from input: `put_push_result`), so running out of memory is `53200`, not an abort.
pub fn from_json(
    document: &serde_json::Value,
) -> Result<Option<OwnedJsonb>, crate::alloc::OutOfMemory> {
    if !document.is_object() && !document.is_array() {
        return Ok(None);
    }
    let Some(bound) = bound(document) else {
        return Ok(None);
    };
    let mut w = Writer {
        buf: crate::alloc::try_with_capacity(bound)?,
    };
    Ok(w.json(document).ok().map(|_| w.finish()))
}

/// The most bytes [`Writer::json`] writes for `value` — per value or key its `JEntry` (4), at
/// most 3 bytes of alignment and a container header (4) or a numeric (at most 4 + 2 + 5 × 2),
/// plus its string bytes — or `None` when it does not write it as `jsonb_in` reads its text:
/// a number that is not an `i64`, a string or key with a NUL.
fn bound(value: &serde_json::Value) -> Option<usize> {
    const PER_VALUE: usize = 4 + 3 + 16;
    crate::interrupts::check();
    let text = |s: &str| (!s.contains('\0')).then_some(s.len());
    let own = match value {
        serde_json::Value::Number(n) => n.is_i64().then_some(0)?,
        serde_json::Value::String(s) => text(s)?,
        serde_json::Value::Array(items) => items
            .iter()
            .try_fold(0usize, |sum, item| Some(sum.saturating_add(bound(item)?)))?,
        serde_json::Value::Object(members) => members.iter().try_fold(0usize, |sum, (k, v)| {
            Some(
                sum.saturating_add(PER_VALUE + text(k)?)
                    .saturating_add(bound(v)?),
            )
        })?,
        _ => 0,
    };
    Some(own.saturating_add(PER_VALUE))
}

impl Writer {
    /// One JSON value whose numbers are `i64` ([`bound`]); any other number is refused.
    fn json(&mut self, value: &serde_json::Value) -> Result<EntryType, Malformed> {
        use serde_json::Value as Json;
        match value {
            Json::Null => Ok(JENTRY_ISNULL),
            Json::Bool(false) => Ok(JENTRY_ISBOOL_FALSE),
            Json::Bool(true) => Ok(JENTRY_ISBOOL_TRUE),
            Json::Number(n) => self.value(Value::Int(n.as_i64().ok_or(Malformed)?)),
            Json::String(s) => self.value(Value::String(s.as_bytes())),
            Json::Array(items) => self.array(items.len(), |w, i| w.json(&items[i])),
            Json::Object(members) => {
                let mut pairs: Vec<(&str, &Json)> =
                    members.iter().map(|(k, v)| (k.as_str(), v)).collect();
                self.members(&mut pairs, |w, value| w.json(value))
            }
        }
    }
}

/// Appends the `numeric` of `n` as `int8_numeric` builds it (`int64_to_numericvar`, then
/// `make_result`): a 4-byte varlena header, the short header word (sign, display scale 0,
/// weight), the base-10000 digits without leading or trailing zero digits; zero has none.
fn push_numeric(out: &mut Vec<u8>, n: i64) {
    use crate::port::numeric::{NBASE, NUMERIC_SHORT, SHORT_SIGN, SHORT_WEIGHT_MASK};
    let mut magnitude = n.unsigned_abs();
    // Digits, least significant first: at most five for a 64-bit value.
    let mut digits = [0u16; 5];
    let mut count = 0;
    while magnitude > 0 {
        digits[count] = (magnitude % NBASE) as u16;
        magnitude /= NBASE;
        count += 1;
    }
    // The weight counts every digit but the first; trailing (least significant) zero digits go.
    let weight = count.saturating_sub(1) as u16;
    let trailing = digits[..count].iter().take_while(|d| **d == 0).count();
    let kept = &digits[trailing..count];
    let size = 4 + 2 + 2 * kept.len();
    out.extend_from_slice(&varlena_header(size).to_ne_bytes());
    let sign = if n < 0 { SHORT_SIGN } else { 0 };
    let header = NUMERIC_SHORT | sign | (weight & SHORT_WEIGHT_MASK);
    out.extend_from_slice(&header.to_ne_bytes());
    for digit in kept.iter().rev() {
        out.extend_from_slice(&(*digit as i16).to_ne_bytes());
    }
}

/// `SET_VARSIZE` of a 4-byte varlena header (`src/include/varatt.h`): the size shifted left by
/// two on little-endian builds, the size itself (top bits clear) on big-endian ones.
fn varlena_header(size: usize) -> u32 {
    if cfg!(target_endian = "little") {
        (size as u32) << 2
    } else {
        size as u32 & 0x3FFF_FFFF
    }
}

/// In-backend tests (`cargo pgrx test`): the writer against `jsonb_in`, byte for byte.
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::*;
    use crate::testing::{any_json, run_cases};
    use pgrx::prelude::*;
    use proptest::prelude::*;
    use serde_json::Value as Json;

    fn parsed(text: &str) -> OwnedJsonb {
        OwnedJsonb::from_text(text).expect("no NUL")
    }

    fn bytes(doc: &OwnedJsonb) -> Vec<u8> {
        doc.container().expect("container").as_bytes().to_vec()
    }

    /// A member value of a generated document, with its JSON text.
    #[derive(Debug, Clone)]
    enum Member {
        Text(String),
        Int(i64),
        /// Any JSON value, stored first (`jsonb_in`) and copied in as a node.
        Stored(Json),
    }

    impl Member {
        fn json(&self) -> Json {
            match self {
                Member::Text(s) => Json::from(s.as_str()),
                Member::Int(n) => Json::from(*n),
                Member::Stored(v) => v.clone(),
            }
        }
    }

    fn member() -> impl Strategy<Value = Member> {
        prop_oneof![
            3 => "[^\u{0}]{0,24}".prop_map(Member::Text),
            3 => any::<i64>().prop_map(Member::Int),
            1 => prop_oneof![
                Just(0i64),
                Just(i64::MIN),
                Just(i64::MAX),
                Just(10_000),
                Just(-100_000_000),
                Just(1_750_000_000_000),
            ]
            .prop_map(Member::Int),
            2 => any_json().prop_map(Member::Stored),
        ]
    }

    /// Arrays of up to 40 objects of up to 20 members: both past one offset stride (32
    /// entries; an object has two per member), as the reaction documents are laid out.
    fn documents() -> impl Strategy<Value = Vec<Vec<(String, Member)>>> {
        prop::collection::vec(
            prop::collection::btree_map("[^\u{0}]{0,20}", member(), 0..20)
                .prop_map(|m| m.into_iter().collect::<Vec<_>>()),
            0..40,
        )
    }

    fn written(doc: &[Vec<(String, Member)>]) -> OwnedJsonb {
        // The stored values first (their containers are borrowed while writing).
        let stored: Vec<Vec<Option<OwnedJsonb>>> = doc
            .iter()
            .map(|o| {
                o.iter()
                    .map(|(_, m)| match m {
                        Member::Stored(v) => Some(parsed(&v.to_string())),
                        _ => None,
                    })
                    .collect()
            })
            .collect();
        let mut w = Writer::default();
        w.array(doc.len(), |w, i| {
            let roots: Vec<Node<'_>> = stored[i]
                .iter()
                .map(|s| match s {
                    Some(s) => s.container().and_then(|c| c.root()),
                    None => Ok(Node::Null),
                })
                .collect::<Result<_, _>>()?;
            let mut pairs: Vec<(&str, Value<'_>)> = doc[i]
                .iter()
                .zip(&roots)
                .map(|((k, m), root)| {
                    let v = match m {
                        Member::Text(s) => Value::String(s.as_bytes()),
                        Member::Int(n) => Value::Int(*n),
                        Member::Stored(_) => Value::Node(*root),
                    };
                    (k.as_str(), v)
                })
                .collect();
            w.object(&mut pairs)
        })
        .expect("written");
        w.finish()
    }

    /// Thousands of generated documents: the writer's bytes are `jsonb_in`'s for the same text.
    #[pg_test]
    fn writes_what_jsonb_in_writes() {
        run_cases(1000, documents(), |doc| {
            let text = Json::Array(
                doc.iter()
                    .map(|o| Json::Object(o.iter().map(|(k, m)| (k.clone(), m.json())).collect()))
                    .collect(),
            )
            .to_string();
            prop_assert_eq!(bytes(&written(&doc)), bytes(&parsed(&text)), "{}", text);
            Ok(())
        });
    }

    /// Thousands of generated JSON documents: [`from_json`] writes `jsonb_in`'s bytes for every
    /// one whose numbers are integers, and declines every other (a float, a scalar root).
    #[pg_test]
    fn json_documents_are_written_as_jsonb_in_writes_them() {
        let (written, declined) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
        run_cases(2000, any_json(), |doc| {
            let expected = bound(&doc).is_some() && (doc.is_object() || doc.is_array());
            match from_json(&doc).expect("memory") {
                Some(binary) => {
                    prop_assert!(binary.len() <= bound(&doc).unwrap_or(0), "{}", doc);
                    prop_assert!(expected, "{}", doc);
                    prop_assert_eq!(bytes(&binary), bytes(&parsed(&doc.to_string())), "{}", doc);
                    written.set(written.get() + 1);
                }
                None => {
                    prop_assert!(!expected, "{}", doc);
                    declined.set(declined.get() + 1);
                }
            }
            Ok(())
        });
        let (written, declined) = (written.get(), declined.get());
        assert!(
            written > 200 && declined > 200,
            "{written} written, {declined} declined"
        );
    }

    /// Every integer the digits rule can meet, against `int8_numeric` through `jsonb_in`.
    #[pg_test]
    fn integers_are_numerics_as_postgres_makes_them() {
        let mut values = vec![0, 1, -1, 9_999, 10_000, -10_000, 10_001, i64::MIN, i64::MAX];
        values.extend((0..19).map(|p| 10i64.pow(p)));
        values.extend((0..19).map(|p| -(10i64.pow(p)) - 1));
        for n in values {
            let mut w = Writer::default();
            w.array(1, |w, _| w.value(Value::Int(n))).unwrap();
            assert_eq!(bytes(&w.finish()), bytes(&parsed(&format!("[{n}]"))), "{n}");
        }
    }
}
