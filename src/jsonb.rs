//! A zero-copy reader of PostgreSQL's binary `jsonb` format, for the hot path (`append_commit`).
//!
//! The general argument type ([`crate::args::JsonArg`]) turns a `jsonb` into text and parses it
//! again with serde: two conversions and an allocation per value. For a commit document that was
//! most of the call's cost beyond the inserts themselves (docs/BENCHMARKS.md). This reader looks
//! the few keys it needs up in the detoasted datum, borrows strings from it, and hands nested
//! containers (a change's `scopes`) to SQL as `jsonb` again by copying their bytes — which is what
//! PostgreSQL itself does for a binary sub-value (`JsonbValueToJsonb`).
//!
//! Layout (`src/include/utils/jsonb.h`, unchanged from 9.4 to 18): a container is a `u32` header
//! (`count` + object/array/scalar flags), then one `JEntry` per child (objects: all keys, then the
//! values in key order), then the children's data. A `JEntry` holds the child's type and either
//! its length or, every 32nd entry, its end offset. Numerics and containers start at the next
//! 4-byte boundary. Object keys are sorted by length, then bytes. Every access is bounds-checked:
//! a malformed datum reads as [`Malformed`], never as a panic.

use pgrx::pg_sys;
use pgrx::{FromDatum, IntoDatum};

use crate::port::jsonb::*;

/// Containers nested deeper than this are refused (`too_deep`), the limit serde's parser applies
/// to the other JSON arguments.
pub const MAX_DEPTH: usize = 128;

/// The datum does not follow the jsonb layout (cannot happen for a value PostgreSQL built).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

type Read<T> = std::result::Result<T, Malformed>;

/// One container (object, array, or the one-element array that wraps a top-level scalar),
/// borrowed from a detoasted datum.
#[derive(Clone, Copy)]
pub struct Container<'a> {
    bytes: &'a [u8],
}

/// A value inside a container.
#[derive(Clone, Copy)]
pub enum Node<'a> {
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A `numeric` varlena (header included).
    Number(&'a [u8]),
    /// The string's bytes in the database encoding.
    String(&'a [u8]),
    Array(Container<'a>),
    Object(Container<'a>),
}

fn u32_at(bytes: &[u8], at: usize) -> Read<u32> {
    let word = bytes.get(at..at + 4).ok_or(Malformed)?;
    Ok(u32::from_ne_bytes(word.try_into().map_err(|_| Malformed)?))
}

impl<'a> Container<'a> {
    /// The container that starts at `bytes` (a jsonb datum's data, past its varlena header).
    pub fn new(bytes: &'a [u8]) -> Read<Self> {
        u32_at(bytes, 0)?;
        Ok(Container { bytes })
    }

    fn header(&self) -> u32 {
        u32_at(self.bytes, 0).unwrap_or(0)
    }

    /// Number of elements (arrays) or key/value pairs (objects).
    pub fn len(&self) -> usize {
        (self.header() & JB_CMASK) as usize
    }

    fn is_object(&self) -> bool {
        self.header() & JB_FOBJECT != 0
    }

    fn entries(&self) -> usize {
        if self.is_object() {
            2 * self.len()
        } else {
            self.len()
        }
    }

    fn entry(&self, i: usize) -> Read<u32> {
        u32_at(self.bytes, 4 + 4 * i)
    }

    /// The children in entry order (objects: every key, then every value), each child's offset
    /// following from the previous one's end (`getJsonbOffset` sums lengths back to the last
    /// stored offset; walking forward needs no sum at all).
    pub fn children(self) -> impl Iterator<Item = Read<Node<'a>>> {
        let base = 4 + 4 * self.entries();
        let mut end = 0usize;
        (0..self.entries()).map(move |i| {
            let entry = self.entry(i)?;
            let start = end;
            let field = (entry & JENTRY_OFFLENMASK) as usize;
            end = if entry & JENTRY_HAS_OFF != 0 {
                field
            } else {
                start + field
            };
            self.node(entry, base + start, base + end)
        })
    }

    /// The value whose data is `bytes[start..end]` (`fillJsonbValue`).
    fn node(&self, entry: u32, start: usize, end: usize) -> Read<Node<'a>> {
        let slice = |from: usize| match self.bytes.get(from..end) {
            Some(bytes) if from <= end => Ok(bytes),
            _ => Err(Malformed),
        };
        Ok(match entry & JENTRY_TYPEMASK {
            JENTRY_ISSTRING => Node::String(slice(start)?),
            JENTRY_ISNUMERIC => Node::Number(slice(int_align(start))?),
            JENTRY_ISBOOL_FALSE => Node::Bool(false),
            JENTRY_ISBOOL_TRUE => Node::Bool(true),
            JENTRY_ISNULL => Node::Null,
            JENTRY_ISCONTAINER => {
                let inner = Container::new(slice(int_align(start))?)?;
                if inner.is_object() {
                    Node::Object(inner)
                } else if inner.header() & JB_FARRAY != 0 {
                    Node::Array(inner)
                } else {
                    return Err(Malformed);
                }
            }
            _ => return Err(Malformed),
        })
    }

    /// The root value: the scalar of a scalar document, else the container itself.
    pub fn root(self) -> Read<Node<'a>> {
        let header = self.header();
        if header & JB_FSCALAR != 0 {
            self.children().next().unwrap_or(Err(Malformed))
        } else if header & JB_FOBJECT != 0 {
            Ok(Node::Object(self))
        } else if header & JB_FARRAY != 0 {
            Ok(Node::Array(self))
        } else {
            Err(Malformed)
        }
    }

    /// An object's pairs, in jsonb key order (length, then bytes).
    pub fn pairs(self) -> Read<Vec<(&'a [u8], Node<'a>)>> {
        let children = self.children().collect::<Read<Vec<_>>>()?;
        let (keys, values) = children.split_at(self.len().min(children.len()));
        keys.iter()
            .zip(values)
            .map(|(key, value)| match key {
                Node::String(key) => Ok((*key, *value)),
                _ => Err(Malformed),
            })
            .collect()
    }

    /// An object's values for `keys`, in one pass over its entries (`None`: absent).
    pub fn fields<const K: usize>(self, keys: [&str; K]) -> Read<[Option<Node<'a>>; K]> {
        let mut found = [None; K];
        // A count beyond what the bytes can hold is malformed; do not reserve for it.
        let mut wanted = Vec::with_capacity(self.len().min(self.bytes.len() / 8));
        let mut children = self.children();
        for _ in 0..self.len() {
            crate::interrupts::check();
            let Node::String(key) = children.next().ok_or(Malformed)?? else {
                return Err(Malformed);
            };
            wanted.push(keys.iter().position(|k| k.as_bytes() == key));
        }
        for slot in wanted {
            crate::interrupts::check();
            let value = children.next().ok_or(Malformed)??;
            if let Some(k) = slot {
                found[k] = Some(value);
            }
        }
        Ok(found)
    }

    /// Whether containers nest more than `limit` levels deep, counting this one. The walk looks
    /// at entry types only and stops `limit` levels down, so it is bounded whatever the input.
    pub fn nests_deeper_than(&self, limit: usize) -> Read<bool> {
        if limit == 0 {
            return Ok(true);
        }
        for child in self.children() {
            crate::interrupts::check();
            if let Node::Array(c) | Node::Object(c) = child? {
                if c.nests_deeper_than(limit - 1)? {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Whether the document below this container holds more than `limit` entries (keys and
    /// values, at every depth). Walks with an explicit stack, never recursion, and stops once
    /// the count passes `limit`, so it is bounded whatever the input.
    pub fn holds_more_than(self, limit: usize) -> Read<bool> {
        let mut pending = vec![self];
        let mut seen = 0usize;
        while let Some(container) = pending.pop() {
            seen = seen.saturating_add(container.entries());
            if seen > limit {
                return Ok(true);
            }
            for child in container.children() {
                crate::interrupts::check();
                if let Node::Array(inner) | Node::Object(inner) = child? {
                    pending.push(inner);
                }
            }
        }
        Ok(false)
    }

    /// The container's bytes (header, entries, data), position independent.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// This container as a `jsonb` value of its own (a copy of its bytes, as
    /// `JsonbValueToJsonb` makes of a binary sub-value).
    pub fn to_jsonb(self) -> RawJsonb<'a> {
        RawJsonb(self.bytes)
    }
}

/// Why a member of a JSON argument is refused: a `reason` of docs/API.md §Errors.
pub type Reason = &'static str;

/// A present, non-null value.
pub fn given(node: Option<Node<'_>>) -> Option<Node<'_>> {
    node.filter(|n| !matches!(n, Node::Null))
}

/// A required string member: `missing` (absent or null), `empty` (when `non_empty`), `type`.
pub fn string_field(node: Option<Node<'_>>, non_empty: bool) -> std::result::Result<&str, Reason> {
    match given(node) {
        None => Err("missing"),
        Some(Node::String(s)) if non_empty && s.is_empty() => Err("empty"),
        Some(Node::String(s)) => std::str::from_utf8(s).map_err(|_| "type"),
        Some(_) => Err("type"),
    }
}

/// An integer member in `min..=max`, `None` when absent or null: `range` (outside, or not a
/// safe integer), `type` (not a number, or fractional).
pub fn integer_field(
    node: Option<Node<'_>>,
    (min, max): (i64, i64),
) -> std::result::Result<Option<i64>, Reason> {
    match given(node) {
        None => Ok(None),
        Some(Node::Number(n)) => match numeric_integer(n).map_err(|_| "type")? {
            Integer::Safe(v) if (min..=max).contains(&v) => Ok(Some(v)),
            Integer::Safe(_) | Integer::Unsafe => Err("range"),
            Integer::Fractional => Err("type"),
        },
        Some(_) => Err("type"),
    }
}

/// What [`bounds`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Bounds {
    Within,
    /// The compact text is longer than allowed.
    TooLarge,
    /// A value sits deeper than allowed.
    TooDeep,
}

/// Size and depth of a stored JSON document (docs/API.md, `enqueue_reactions`): its compact
/// text — PostgreSQL's jsonb output without the blank after each `:` and `,` — over
/// `max_bytes` is `TooLarge` (checked first); a value at depth over `max_depth` (the document
/// itself at 0) is `TooDeep`. Computed from the binary form, without printing it.
/// The recursion is bounded by the depth check of the whole argument ([`read_argument`]).
pub fn bounds(node: Node<'_>, max_bytes: usize, max_depth: usize) -> Read<Bounds> {
    let mut size = 0usize;
    let mut deepest = 0usize;
    walk(node, 0, &mut size, &mut deepest, max_bytes)?;
    Ok(if size > max_bytes {
        Bounds::TooLarge
    } else if deepest > max_depth {
        Bounds::TooDeep
    } else {
        Bounds::Within
    })
}

/// Adds `node`'s compact text length to `size` (stopping once over `cap`) and records the
/// deepest depth seen.
fn walk(
    node: Node<'_>,
    depth: usize,
    size: &mut usize,
    deepest: &mut usize,
    cap: usize,
) -> Read<()> {
    *deepest = (*deepest).max(depth);
    // A scalar's text; a container's brackets and separators are counted below.
    *size += match node {
        Node::Array(_) | Node::Object(_) => 0,
        Node::Null | Node::Bool(true) => 4,
        Node::Bool(false) => 5,
        Node::Number(n) => numeric_text_len(n)?,
        Node::String(s) => escaped_len(s),
    };
    let (Node::Array(container) | Node::Object(container)) = node else {
        return Ok(());
    };
    let object = matches!(node, Node::Object(_));
    // Brackets, and a separator between entries: `,` between elements or pairs, `:` in pairs.
    let n = container.len();
    *size += 2 + n.saturating_sub(1) + if object { n } else { 0 };
    for child in container.children() {
        if *size > cap {
            return Ok(());
        }
        let child = child?;
        // An object's keys come first; they sit at the object's own depth plus one, as its values.
        walk(child, depth + 1, size, deepest, cap)?;
    }
    Ok(())
}

/// The two-character escape `escape_json` prints for `c`, if it has one.
fn short_escape(c: char) -> Option<&'static str> {
    Some(match c {
        '"' => "\\\"",
        '\\' => "\\\\",
        '\u{08}' => "\\b",
        '\u{0C}' => "\\f",
        '\n' => "\\n",
        '\r' => "\\r",
        '\t' => "\\t",
        _ => return None,
    })
}

/// Length of a string as `escape_json` prints it (quotes included): the short escapes, `\u00XX`
/// for the other control characters, everything else as it is.
fn escaped_len(s: &[u8]) -> usize {
    2 + s
        .iter()
        .map(|&b| match short_escape(b as char) {
            Some(_) => 2,
            None if b < 0x20 => 6,
            None => 1,
        })
        .sum::<usize>()
}

/// Appends `s` as a JSON string literal, escaped as `escape_json` does (see [`escaped_len`]).
pub fn push_escaped(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match short_escape(c) {
            Some(escape) => out.push_str(escape),
            None if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            None => out.push(c),
        }
    }
    out.push('"');
}

/// Length of a `numeric`'s text (`numeric_out`).
fn numeric_text_len(varlena: &[u8]) -> Read<usize> {
    // SAFETY: `varlena` is a complete numeric varlena (header included, 4-byte aligned as jsonb
    // stores numerics) inside a detoasted jsonb datum PostgreSQL built, alive for the call;
    // `numeric_out` detoasts its argument and returns a palloc'd C string, freed with the
    // call's memory context.
    unsafe {
        let text: *const std::ffi::c_char = pgrx::direct_function_call_as_datum(
            pg_sys::numeric_out,
            &[Some(pg_sys::Datum::from(varlena.as_ptr()))],
        )
        .ok_or(Malformed)?
        .cast_mut_ptr();
        Ok(std::ffi::CStr::from_ptr(text).to_bytes().len())
    }
}

/// Integer reading of a `numeric` (integers in JSON: docs/API.md §Conventions).
#[derive(Debug, PartialEq, Eq)]
pub enum Integer {
    /// Integral and within ±(2^53 − 1).
    Safe(i64),
    /// Integral, but outside ±(2^53 − 1).
    Unsafe,
    /// Has a fractional part (or is not a finite number).
    Fractional,
}

/// Reads a `numeric` varlena (`src/backend/utils/adt/numeric.c`): base-10000 digits with a
/// weight, short or long header. `2.0` is integral (jsonb keeps the scale).
pub fn numeric_integer(varlena: &[u8]) -> Read<Integer> {
    use crate::port::numeric::*;
    let first = *varlena.first().ok_or(Malformed)?;
    // 1-byte varlena header (VARATT_IS_1B) or 4-byte uncompressed (the only two jsonb stores).
    let (header_len, total) = if first & 0x01 == 0x01 {
        (1, (first >> 1) as usize)
    } else {
        (4, (u32_at(varlena, 0)? >> 2) as usize)
    };
    let body = varlena.get(header_len..total).ok_or(Malformed)?;
    let word = |at: usize| -> Read<u16> {
        let b = body.get(at..at + 2).ok_or(Malformed)?;
        Ok(u16::from_ne_bytes([b[0], b[1]]))
    };
    let head = word(0)?;
    let (negative, weight, digits_at) = match head & NUMERIC_SIGN_MASK {
        NUMERIC_SPECIAL => return Ok(Integer::Fractional),
        NUMERIC_SHORT => {
            let magnitude = (head & SHORT_WEIGHT_MASK) as i32;
            let weight = if head & SHORT_WEIGHT_SIGN != 0 {
                magnitude - 64
            } else {
                magnitude
            };
            (head & SHORT_SIGN != 0, weight, 2)
        }
        sign => (sign == NUMERIC_NEG, word(2)? as i16 as i32, 4),
    };
    let digits = body.get(digits_at..).ok_or(Malformed)?;
    if digits.len() % 2 != 0 {
        return Err(Malformed);
    }
    // Digit i is worth 10000^(weight - i). Past 10^16 (weight ≥ 4 with a non-zero digit) is
    // beyond 2^53 anyway, so i128 cannot overflow in what we do sum.
    let mut value: i128 = 0;
    let mut unsafe_magnitude = false;
    for (i, pair) in digits.chunks_exact(2).enumerate() {
        let digit = u16::from_ne_bytes([pair[0], pair[1]]) as i128;
        let exponent = weight - i as i32;
        if digit == 0 {
            continue;
        }
        if exponent < 0 {
            return Ok(Integer::Fractional);
        }
        if exponent >= 4 {
            unsafe_magnitude = true;
            continue;
        }
        value += digit * (NBASE as i128).pow(exponent as u32);
    }
    let max = crate::limits::MAX_SAFE as i128;
    if unsafe_magnitude || value > max {
        return Ok(Integer::Unsafe);
    }
    Ok(Integer::Safe(if negative { -value } else { value } as i64))
}

/// Declares `$ty` (which implements `FromDatum`) as a function argument of SQL type `jsonb`
/// (or the type `$sql` names), and lets a NULL through to the body (functions are not STRICT,
/// see [`crate::args`]).
macro_rules! jsonb_argument {
    ($ty:ident) => {
        $crate::jsonb::jsonb_argument!($ty, "jsonb");
    };
    ($ty:ident, $sql:literal) => {
        // SAFETY: the SQL type named here, `$sql`, is the type whose datums `$ty`'s `FromDatum`
        // reads (a detoastable varlena of that type).
        unsafe impl ::pgrx::pgrx_sql_entity_graph::metadata::SqlTranslatable for $ty {
            const TYPE_IDENT: &'static str = ::pgrx::pgrx_resolved_type!($ty);
            const TYPE_ORIGIN: ::pgrx::pgrx_sql_entity_graph::metadata::TypeOrigin =
                ::pgrx::pgrx_sql_entity_graph::metadata::TypeOrigin::External;
            const ARGUMENT_SQL: ::std::result::Result<
                ::pgrx::pgrx_sql_entity_graph::metadata::SqlMappingRef,
                ::pgrx::pgrx_sql_entity_graph::metadata::ArgumentError,
            > = Ok(::pgrx::pgrx_sql_entity_graph::metadata::SqlMappingRef::literal($sql));
            const RETURN_SQL: ::std::result::Result<
                ::pgrx::pgrx_sql_entity_graph::metadata::ReturnsRef,
                ::pgrx::pgrx_sql_entity_graph::metadata::ReturnsError,
            > = Ok(::pgrx::pgrx_sql_entity_graph::metadata::ReturnsRef::One(
                ::pgrx::pgrx_sql_entity_graph::metadata::SqlMappingRef::literal($sql),
            ));
        }

        // SAFETY: unboxing goes through `$ty`'s `FromDatum`, which reads a datum of `$sql` as
        // pgrx's own argument types do; pgrx calls this only for a non-NULL argument.
        unsafe impl<'fcx> ::pgrx::callconv::ArgAbi<'fcx> for $ty {
            unsafe fn unbox_arg_unchecked(arg: ::pgrx::callconv::Arg<'_, 'fcx>) -> Self {
                let index = arg.index();
                // SAFETY: the argument is a datum of this call, of the type above.
                unsafe {
                    arg.unbox_arg_using_from_datum()
                        .unwrap_or_else(|| panic!("argument {index} must not be null"))
                }
            }
        }
    };
}
pub(crate) use jsonb_argument;

/// The container bytes of a jsonb datum (past the varlena header), detoasted: the datum itself,
/// or a copy `pg_detoast_datum` makes in the current memory context.
///
/// # Safety
/// `datum` must be a non-NULL jsonb datum that stays valid for `'a`.
unsafe fn container_bytes<'a>(datum: pg_sys::Datum) -> &'a [u8] {
    // SAFETY: the caller's promise. Not the `_packed` variant: the container must keep its
    // 4-byte alignment.
    unsafe { container_of(pg_sys::pg_detoast_datum(datum.cast_mut_ptr())) }
}

/// The container bytes of a detoasted jsonb varlena (past its header).
///
/// # Safety
/// `detoasted` must be a detoasted jsonb varlena that stays valid for `'a`.
unsafe fn container_of<'a>(detoasted: *mut pg_sys::varlena) -> &'a [u8] {
    // SAFETY: the caller's promise; the header and data are read in bounds of the varlena.
    unsafe {
        let total = pgrx::varsize_any(detoasted as *const _);
        let data = pgrx::vardata_any(detoasted as *const _) as *const u8;
        let header = data as usize - detoasted as usize;
        std::slice::from_raw_parts(data, total.saturating_sub(header))
    }
}

/// `jsonb_in` of `text`: a palloc'd jsonb datum in the current memory context (`None` if the
/// text holds a NUL). Raises on text that is not JSON.
fn jsonb_in(text: &str) -> Option<pg_sys::Datum> {
    let text = std::ffi::CString::new(text).ok()?;
    // SAFETY: `jsonb_in` takes one NUL-terminated C string, which `text` is and outlives the
    // call; its result is a palloc'd jsonb datum.
    unsafe {
        pgrx::direct_function_call_as_datum(
            pg_sys::jsonb_in,
            &[Some(pg_sys::Datum::from(text.as_ptr()))],
        )
    }
}

/// A `jsonb` argument, detoasted but not parsed.
pub struct JsonbArg {
    /// The container bytes, past the varlena header. Palloc'd in the call's memory context (or
    /// the argument datum itself), so valid for the whole call.
    data: *const u8,
    len: usize,
}

/// Whether a jsonb document's container bytes are over the argument caps of
/// [`crate::limits`] (`DOCUMENT_BYTES`, `DOCUMENT_VALUES`), read without parsing it.
pub fn over_limits(bytes: &[u8]) -> bool {
    use crate::limits;
    bytes.len() > limits::DOCUMENT_BYTES
        || Container::new(bytes)
            .and_then(|c| c.holds_more_than(limits::DOCUMENT_VALUES))
            .unwrap_or(false)
}

impl JsonbArg {
    /// Whether the document is over the argument caps (checked before it is read).
    pub fn over_limits(&self) -> bool {
        // SAFETY: as in `container`.
        over_limits(unsafe { std::slice::from_raw_parts(self.data, self.len) })
    }

    /// The document's top container, borrowed for as long as the argument lives.
    pub fn container(&self) -> Read<Container<'_>> {
        // SAFETY: `data..data+len` is the detoasted datum, alive for the function call, and
        // `self` cannot outlive the call (it is an argument value).
        Container::new(unsafe { std::slice::from_raw_parts(self.data, self.len) })
    }

    /// A new argument from the text of a JSON document (for documents bound as a jsonb string).
    /// The caller only passes text it already knows parses ([`jsonb_in`] raises otherwise).
    pub fn parse(text: &str) -> Option<JsonbArg> {
        let datum = jsonb_in(text)?;
        // SAFETY: `datum` is the non-NULL jsonb just built in the current memory context.
        unsafe { JsonbArg::from_polymorphic_datum(datum, false, pg_sys::JSONBOID) }
    }
}

jsonb_argument!(JsonbArg);

impl FromDatum for JsonbArg {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        _: pg_sys::Oid,
    ) -> Option<JsonbArg> {
        if is_null {
            return None;
        }
        // SAFETY: a non-NULL jsonb datum of this call, alive for the whole call; a detoasted
        // copy stays in the call's memory context as long.
        let bytes = unsafe { container_bytes(datum) };
        Some(JsonbArg {
            data: bytes.as_ptr(),
            len: bytes.len(),
        })
    }
}

/// `jsonb_out`'s text as a Rust string. The extension is installed only in UTF8 databases
/// (sql/schema.sql), where it is always UTF-8; anything else is an error, never text rewritten
/// (a replaced character let one tenant's scope value match another's: red team 40, F2).
fn utf8(text: &std::ffi::CStr) -> String {
    match text.to_str() {
        Ok(text) => text.to_owned(),
        Err(_) => panic!("syncular: jsonb_out printed text that is not UTF-8"),
    }
}

/// The bytes of a jsonb container, passed to SQL as a `jsonb` value.
#[derive(Clone, Copy)]
pub struct RawJsonb<'a>(&'a [u8]);

impl RawJsonb<'_> {
    /// The value's text, as `jsonb_out` prints it.
    pub fn printed(self) -> String {
        // In a context of its own: `jsonb_out`'s buffers are not freed by it (red team 39, F3).
        let _scratch = Scratch::enter();
        let Some(datum) = self.into_datum() else {
            return String::new();
        };
        // SAFETY: `datum` is the jsonb varlena just built in the scratch context; `jsonb_out`
        // returns a palloc'd NUL-terminated string there, copied out before it is deleted.
        unsafe {
            pgrx::direct_function_call_as_datum(pg_sys::jsonb_out, &[Some(datum)]).map_or_else(
                String::new,
                |text| {
                    utf8(std::ffi::CStr::from_ptr(
                        text.cast_mut_ptr::<std::ffi::c_char>(),
                    ))
                },
            )
        }
    }
}

impl IntoDatum for RawJsonb<'_> {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        let size = self.0.len() + pg_sys::VARHDRSZ;
        // SAFETY: `out` is a fresh allocation of `size` bytes: a 4-byte varlena header, then
        // exactly `self.0.len()` bytes copied from a slice that does not overlap it.
        unsafe {
            let out = pg_sys::palloc(size) as *mut u8;
            // SET_VARSIZE for a 4-byte header: the length shifted left by two (little and big
            // endian builds differ; pgrx's helper knows which one this is).
            pgrx::set_varsize_4b(out as *mut pg_sys::varlena, size as i32);
            std::ptr::copy_nonoverlapping(self.0.as_ptr(), out.add(pg_sys::VARHDRSZ), self.0.len());
            Some(pg_sys::Datum::from(out))
        }
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::JSONBOID
    }
}

/// A memory context of its own for PostgreSQL functions whose allocations nobody frees, made the
/// current one while it lives and deleted with everything in it when it drops — on an error's
/// unwinding too.
struct Scratch {
    context: pg_sys::MemoryContext,
    previous: pg_sys::MemoryContext,
}

impl Scratch {
    fn enter() -> Scratch {
        // SAFETY: a small child of the current context, made current; the name is a static
        // string, so nothing is allocated in the current context for it.
        unsafe {
            let context = pg_sys::AllocSetContextCreateExtended(
                pg_sys::CurrentMemoryContext,
                c"syncular jsonb text".as_ptr(),
                pg_sys::ALLOCSET_SMALL_MINSIZE as usize,
                pg_sys::ALLOCSET_SMALL_INITSIZE as usize,
                pg_sys::ALLOCSET_SMALL_MAXSIZE as usize,
            );
            let previous = pg_sys::MemoryContextSwitchTo(context);
            Scratch { context, previous }
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: the context made in `enter`, current since; the one before is current again
        // before it is deleted.
        unsafe {
            pg_sys::MemoryContextSwitchTo(self.previous);
            pg_sys::MemoryContextDelete(self.context);
        }
    }
}

/// A jsonb column read as a serde value, as pgrx's `JsonB` reads it — printed by `jsonb_out`
/// and parsed — but printed in a memory context of its own ([`Scratch`]): `jsonb_out`'s buffers
/// were left in the current context, which a reader's row loop does not reset, so every value
/// read grew the transaction until it ended (red team 39, F3; docs/SECURITY.md rule 14).
pub struct JsonValue(pub serde_json::Value);

impl FromDatum for JsonValue {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        _: pg_sys::Oid,
    ) -> Option<JsonValue> {
        if is_null {
            return None;
        }
        let text = {
            let _scratch = Scratch::enter();
            // SAFETY: a non-NULL jsonb datum of a result row, alive while the row is read;
            // `jsonb_out` returns a NUL-terminated string, copied out before the scratch
            // context (where it and the detoasted copy live) is deleted.
            unsafe {
                let detoasted = pg_sys::pg_detoast_datum(datum.cast_mut_ptr());
                let printed = pgrx::direct_function_call_as_datum(
                    pg_sys::jsonb_out,
                    &[Some(detoasted.into())],
                )
                .expect("jsonb_out returns a string");
                utf8(std::ffi::CStr::from_ptr(
                    printed.cast_mut_ptr::<std::ffi::c_char>(),
                ))
            }
        };
        Some(JsonValue(
            serde_json::from_str(&text).expect("the text of a jsonb value is JSON"),
        ))
    }
}

impl IntoDatum for JsonValue {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        pgrx::JsonB(self.0).into_datum()
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::JSONBOID
    }
}

/// A jsonb value read from a result column and kept as its container bytes: passed back to SQL
/// without a text round trip, and read in place ([`Container`]) instead of being parsed. The
/// pull path reads and returns every change's scopes this way (docs/DESIGN.md §Pull path).
pub struct OwnedJsonb(Vec<u8>);

impl OwnedJsonb {
    /// The binary form of a JSON text (`jsonb_in`, which raises on text that is not JSON: the
    /// callers pass text they wrote); `None` if the text holds a NUL.
    pub fn from_text(text: &str) -> Option<OwnedJsonb> {
        let datum = jsonb_in(text)?;
        // SAFETY: `datum` is the non-NULL jsonb just built in the current memory context; its
        // bytes are copied out.
        unsafe { OwnedJsonb::from_polymorphic_datum(datum, false, pg_sys::JSONBOID) }
    }

    /// A document from its root container's bytes ([`crate::jsonb_write::Writer`] builds them).
    pub fn from_container(bytes: Vec<u8>) -> OwnedJsonb {
        OwnedJsonb(bytes)
    }

    /// `[]`: an array container with no elements (its header alone).
    pub fn empty_array() -> OwnedJsonb {
        OwnedJsonb(JB_FARRAY.to_ne_bytes().to_vec())
    }

    /// The top container.
    pub fn container(&self) -> Read<Container<'_>> {
        Container::new(&self.0)
    }

    /// Bytes of the document (its container).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The document's container bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The document as a value to insert below SQL ([`crate::heap::Value::Jsonb`]).
    pub fn raw(&self) -> RawJsonb<'_> {
        RawJsonb(&self.0)
    }

    /// A `jsonb` column of a result row. The copy is fallible (a stored document may be as
    /// large as its writer made it): a failed copy is `Err` here and the call ends in `53200`
    /// (`src/alloc.rs`).
    pub fn column(
        row: &pgrx::spi::SpiHeapTupleData<'_>,
        ordinal: usize,
    ) -> crate::error::Result<Option<OwnedJsonb>> {
        let value = row.get::<OwnedJsonb>(ordinal)?;
        crate::alloc::check()?;
        Ok(value)
    }
}

/// `document` as jsonb: written directly where it can be ([`crate::jsonb_write::from_json`]),
/// else converted from its text by `jsonb_in` — the same bytes either way.
pub fn owned(document: &serde_json::Value) -> crate::error::Result<OwnedJsonb> {
    crate::jsonb_write::from_json(document)?
        .or_else(|| OwnedJsonb::from_text(&document.to_string()))
        .ok_or_else(|| crate::error::Error::Internal("syncular: a document with a NUL".into()))
}

impl FromDatum for OwnedJsonb {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        _: pg_sys::Oid,
    ) -> Option<OwnedJsonb> {
        if is_null {
            return None;
        }
        // SAFETY: a non-NULL jsonb datum of a result row, alive while the row is read; its bytes
        // are copied out before a detoasted copy is freed (`alloc::detoasted`; red team 37, F3).
        // The `_packed` variant: the container's bytes are the same under a short header, and
        // they are copied into memory of their own, aligned as Rust allocates — so a jsonb of
        // under 127 bytes on disk is read where it lies, not first copied under a 4-byte header
        // (the pull's window reads one per change: issue 28, docs/BENCHMARKS.md step 15).
        unsafe {
            crate::alloc::detoasted(datum, pg_sys::pg_detoast_datum_packed, |varlena| {
                // A failed copy reads as NULL here, and is recorded: the call ends in `53200` at
                // its next check point ([`OwnedJsonb::column`] checks at once).
                crate::alloc::try_copy(container_of(varlena))
                    .ok()
                    .map(OwnedJsonb)
            })
        }
    }
}

impl IntoDatum for OwnedJsonb {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        RawJsonb(&self.0).into_datum()
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::JSONBOID
    }
}

jsonb_argument!(OwnedJsonb);

// SAFETY: the datum returned is a freshly palloc'd jsonb varlena in the current (the call's)
// memory context, exactly what a function returning `jsonb` must return.
unsafe impl pgrx::callconv::BoxRet for OwnedJsonb {
    unsafe fn box_into<'fcx>(
        self,
        fcinfo: &mut pgrx::callconv::FcInfo<'fcx>,
    ) -> pgrx::datum::Datum<'fcx> {
        match self.into_datum() {
            // SAFETY: as above.
            Some(datum) => unsafe { fcinfo.return_raw_datum(datum) },
            None => fcinfo.return_null(),
        }
    }
}

/// In-backend tests (`cargo pgrx test`): the readers run on real `jsonb` values.
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::*;
    use pgrx::prelude::*;

    /// PostgreSQL's output of `text` as jsonb, without the blank after each `:` and `,` outside
    /// strings: the compact text [`bounds`] measures.
    fn compact(text: &str) -> String {
        let printed = Spi::get_one_with_args::<String>("SELECT $1::jsonb::text", &[text.into()])
            .unwrap()
            .unwrap();
        let (mut out, mut in_string, mut escaped, mut skip) = (String::new(), false, false, false);
        for c in printed.chars() {
            if skip && c == ' ' {
                skip = false;
                continue;
            }
            skip = false;
            if in_string {
                in_string = c != '"' || escaped;
                escaped = c == '\\' && !escaped;
            } else if c == '"' {
                in_string = true;
            } else if c == ':' || c == ',' {
                skip = true;
            }
            out.push(c);
        }
        out
    }

    fn measured(text: &str, max_bytes: usize, max_depth: usize) -> Bounds {
        let arg = JsonbArg::parse(text).expect("valid jsonb");
        let root = arg.container().and_then(|c| c.root()).expect("readable");
        bounds(root, max_bytes, max_depth).expect("bounded")
    }

    /// The size of every document is its compact text's, to the byte: at the limit it is
    /// within, one byte less is too large. Strings with every escape, numbers as `numeric`
    /// prints them (scale kept, huge and tiny magnitudes), keys, empty containers.
    #[pg_test]
    fn bounds_measure_the_compact_text() {
        let docs = [
            r#"{}"#,
            r#"[]"#,
            r#"[null, true, false]"#,
            r#"{"a": 1, "bb": [1.10, -0, 0.000001, 1e-7, 12345678901234567890123]}"#,
            r#"[1e400]"#,
            r#"{"s": "quote \" backslash \\ slash / \b\f\n\r\t \u0001 \u001f é 😀 \u2028"}"#,
            r#"{"k \" \\ \n": {"": [[], {}, [{}]]}}"#,
            r#"[[[[[[1]]]]], "x", {"y": {"z": null}}]"#,
            r#"{"a": {"a": {"a": {"a": 1}}}, "b": [1, [2, [3, [4]]]]}"#,
        ];
        for doc in docs {
            let size = compact(doc).len();
            assert_eq!(measured(doc, size, 64), Bounds::Within, "{doc}");
            assert_eq!(measured(doc, size - 1, 64), Bounds::TooLarge, "{doc}");
        }
    }

    /// Every string survives [`push_escaped`] and `jsonb_in` unchanged, and is measured as
    /// PostgreSQL prints it.
    #[pg_test]
    fn escaped_strings_round_trip() {
        let controls: String = (1u8..0x20).map(char::from).collect();
        for s in [
            "",
            "plain",
            "quote \" back \\ slash /",
            "é 😀 \u{2028} \u{7f}",
            &controls,
        ] {
            let mut text = String::new();
            push_escaped(&mut text, s);
            let parsed = OwnedJsonb::from_text(&text).expect("parses");
            let root = parsed.container().and_then(|c| c.root()).expect("readable");
            let Node::String(back) = root else {
                panic!("{text}")
            };
            assert_eq!(back, s.as_bytes(), "{text}");
            assert_eq!(escaped_len(back), compact(&text).len(), "{text}");
        }
    }

    /// Depth as upstream counts it: the document is at depth 0, each value inside a container
    /// one deeper; a too large document is reported as such even when also too deep.
    #[pg_test]
    fn bounds_measure_depth() {
        let nested = |n: usize, inner: &str| "[".repeat(n) + inner + &"]".repeat(n);
        assert_eq!(measured(&nested(16, "1"), 1000, 16), Bounds::Within);
        assert_eq!(measured(&nested(17, "1"), 1000, 16), Bounds::TooDeep);
        assert_eq!(measured(&nested(17, ""), 1000, 16), Bounds::Within);
        assert_eq!(measured(&nested(18, ""), 1000, 16), Bounds::TooDeep);
        let objects = r#"{"a":"#.repeat(17) + "1" + &"}".repeat(17);
        assert_eq!(measured(&objects, 1000, 16), Bounds::TooDeep);
        assert_eq!(measured(&objects, 10, 16), Bounds::TooLarge);
    }
}
