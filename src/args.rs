//! Argument decoding shared by every function: NULL checks, ranges, JSON shapes
//! (docs/API.md §Conventions).
//!
//! Functions are declared non-STRICT so that a NULL reaches us and becomes a coded
//! `sync.storage.invalid_argument` instead of a silent NULL result.

use crate::error::{Error, Result};
use crate::limits;
use pgrx::datum::{Array, DatumWithOid};
use pgrx::{pg_sys, FromDatum};
use serde_json::{Map, Value};

/// A `jsonb` argument, parsed without panicking. pgrx's `JsonB` panics (→ `XX000`) on documents
/// serde cannot represent — nesting deeper than 128, numbers beyond f64 — before the function
/// body runs; this type keeps the document (detoasted, in the call's memory context) and parses
/// it in [`JsonArg::value`], inside the body's `error::run`: a refusal becomes a coded error, and
/// a cancel or `statement_timeout` that the size check's walk honours reaches the host as itself,
/// not through pgrx's argument unboxing with a Rust backtrace in its DETAIL (red team 34, F2).
pub struct JsonArg(*mut pg_sys::varlena);

/// Why a [`JsonArg`] holds no value.
enum Unparsed {
    /// An `invalid_argument` reason (`too_large`, `too_deep`, `range`, `type`).
    Refused(&'static str),
    /// The memory its parse would take could not be had (the size tried).
    OutOfMemory(usize),
}

/// How much memory parsing a document takes, at most, per byte of its text: one `Value` per
/// element (32 bytes), each string its own allocation, arrays and maps grown by doubling (the
/// old and the new buffer live together while they grow). Measured: a 32 MB array of short
/// strings peaks at about 4.3 times its text.
const PARSE_BYTES_PER_TEXT_BYTE: usize = 5;

/// Documents whose text is at most this long are parsed without the probe: what they take is
/// small enough for the allocator's reserve.
const PROBE_ABOVE_BYTES: usize = 64 << 10;

crate::jsonb::jsonb_argument!(JsonArg);

impl FromDatum for JsonArg {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        _: pg_sys::Oid,
    ) -> Option<JsonArg> {
        if is_null {
            return None;
        }
        // Not the `_packed` variant: the size check walks the container, which must keep its
        // 4-byte alignment.
        // SAFETY: a non-NULL jsonb argument datum; the detoasted copy (or the datum itself)
        // lives in the call's memory context for the length of the call.
        Some(JsonArg(unsafe {
            pg_sys::pg_detoast_datum(datum.cast_mut_ptr())
        }))
    }
}

impl JsonArg {
    /// The parsed value, or `invalid_argument` (`too_large`, `too_deep`, `range`, `type`) for
    /// `name`, or `53200` when the parse could not have its memory.
    pub fn value(self, name: &str) -> Result<Value> {
        self.parse().map_err(|unparsed| match unparsed {
            Unparsed::Refused(reason) => Error::invalid_argument(name, reason),
            Unparsed::OutOfMemory(size) => Error::OutOfMemory(size),
        })
    }

    fn parse(&self) -> std::result::Result<Value, Unparsed> {
        // SAFETY: the detoasted jsonb datum of this call (`from_polymorphic_datum`); `jsonb_out`'s
        // text is freed right after it is parsed.
        unsafe {
            let detoasted = self.0;
            let total = pgrx::varsize_any(detoasted as *const _);
            let data = pgrx::vardata_any(detoasted as *const _) as *const u8;
            let bytes =
                std::slice::from_raw_parts(data, total - (data as usize - detoasted as usize));
            if crate::jsonb::over_limits(bytes) {
                return Err(Unparsed::Refused("too_large"));
            }
            let text: *mut std::ffi::c_char = pgrx::direct_function_call_as_datum(
                pg_sys::jsonb_out,
                &[Some(pg_sys::Datum::from(detoasted))],
            )
            .ok_or(Unparsed::Refused("type"))?
            .cast_mut_ptr();
            let text_bytes = std::ffi::CStr::from_ptr(text).to_bytes();
            // The parse's allocations are infallible: try the memory it may take first, so a
            // document that cannot be parsed ends in 53200 and not in a failure the allocator's
            // reserve cannot cover (docs/DESIGN.md §Memory). The probe is only address space: it
            // is freed untouched.
            let need = text_bytes.len().saturating_mul(PARSE_BYTES_PER_TEXT_BYTE);
            if text_bytes.len() > PROBE_ABOVE_BYTES
                && crate::alloc::try_with_capacity::<u8>(need).is_err()
            {
                pg_sys::pfree(text.cast());
                return Err(Unparsed::OutOfMemory(need));
            }
            let parsed = std::str::from_utf8(text_bytes)
                .map_err(|_| Unparsed::Refused("type"))
                .and_then(|t| {
                    serde_json::from_str::<Value>(t).map_err(|e| {
                        let message = e.to_string();
                        Unparsed::Refused(if message.contains("recursion limit") {
                            "too_deep"
                        } else if message.contains("number out of range") {
                            "range"
                        } else {
                            "type"
                        })
                    })
                });
            pg_sys::pfree(text.cast());
            parsed
        }
    }
}

pub use crate::limits::MAX_SAFE;

pub fn required<T>(name: &str, value: Option<T>) -> Result<T> {
    value.ok_or_else(|| Error::invalid_argument(name, "missing"))
}

/// A required text argument that must not be empty, copied once it is known to fit.
pub fn text(name: &str, value: Option<&str>) -> Result<String> {
    text_ref(name, value).map(str::to_string)
}

/// [`text`], borrowing the argument (hot paths).
pub fn text_ref<'a>(name: &str, value: Option<&'a str>) -> Result<&'a str> {
    let value = key_ref(name, value)?;
    if value.is_empty() {
        return Err(Error::invalid_argument(name, "empty"));
    }
    Ok(value)
}

/// A required text argument that may be empty (row ids, scope values).
pub fn key(name: &str, value: Option<&str>) -> Result<String> {
    key_ref(name, value).map(str::to_string)
}

fn key_ref<'a>(name: &str, value: Option<&'a str>) -> Result<&'a str> {
    let value = required(name, value)?;
    if value.len() > limits::KEY_BYTES {
        return Err(Error::invalid_argument(name, "too_large"));
    }
    Ok(value)
}

/// An optional text argument (NULL allowed, may be empty).
pub fn optional_key(name: &str, value: Option<&str>) -> Result<Option<String>> {
    value.map(|v| key(name, Some(v))).transpose()
}

/// A required `bytea` argument of at most [`limits::PAYLOAD_BYTES`] (`too_large`), borrowed.
pub fn bytes<'a>(name: &str, value: Option<&'a [u8]>) -> Result<&'a [u8]> {
    let value = required(name, value)?;
    if value.len() > limits::PAYLOAD_BYTES {
        return Err(Error::invalid_argument(name, "too_large"));
    }
    Ok(value)
}

/// A required `lim`-like row count: at most [`limits::RESULT_ROWS`] (`too_large`).
pub fn row_limit(name: &str, value: Option<i32>) -> Result<i32> {
    let value = required(name, value)?;
    if i64::from(value) > limits::RESULT_ROWS {
        return Err(Error::invalid_argument(name, "too_large"));
    }
    Ok(value)
}

/// A required `bigint` in `0 ..= 2^53 − 1` (sequences, versions, epochs, times).
pub fn count(name: &str, value: Option<i64>) -> Result<i64> {
    at_least(name, value, 0)
}

/// A required `bigint` in `min ..= 2^53 − 1`.
pub fn at_least(name: &str, value: Option<i64>, min: i64) -> Result<i64> {
    let value = required(name, value)?;
    if value < min || value > MAX_SAFE {
        return Err(Error::invalid_argument(name, "range"));
    }
    Ok(value)
}

/// A `text[]` argument as it came: detoasted once (in the call's memory context), its elements
/// read in place and the array itself handed on to statements ([`TextArray::datum`]) — never
/// copied into Rust strings nor rebuilt as a new array (docs/DESIGN.md §Memory: an argument at
/// its caps is 400 MB; a copy would double it, a rebuilt array for SPI triple it).
pub struct TextArray {
    /// The detoasted array, valid for the whole call.
    datum: pg_sys::Datum,
    /// The same array, read through pgrx (it does not own the memory: the datum is already
    /// detoasted, so pgrx keeps it as it is and never frees it).
    array: Array<'static, &'static str>,
}

crate::jsonb::jsonb_argument!(TextArray, "text[]");

impl FromDatum for TextArray {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        typoid: pg_sys::Oid,
    ) -> Option<TextArray> {
        if is_null {
            return None;
        }
        // SAFETY: a non-NULL `text[]` argument datum; `pg_detoast_datum` returns it or a copy in
        // the call's memory context, which outlives the argument value.
        unsafe {
            let detoasted = pg_sys::Datum::from(pg_sys::pg_detoast_datum(datum.cast_mut_ptr()));
            let array = Array::<&str>::from_polymorphic_datum(detoasted, false, typoid)?;
            Some(TextArray {
                datum: detoasted,
                array,
            })
        }
    }
}

impl TextArray {
    /// The array as a statement parameter (`text[]`), without a copy.
    pub fn datum(&self) -> DatumWithOid<'_> {
        // SAFETY: `datum` is a detoasted `text[]` valid for the call, which outlives `self`.
        unsafe { DatumWithOid::new(self.datum, pg_sys::TEXTARRAYOID) }
    }
}

/// A required `text[]`: may be empty, but no NULL and no empty element; at most
/// [`limits::ARRAY_ELEMENTS`] elements of at most [`limits::KEY_BYTES`] each. The elements are
/// borrowed from the argument ([`TextArray`]).
pub fn text_array<'a>(name: &str, value: Option<&'a TextArray>) -> Result<Vec<&'a str>> {
    array_of(name, value, false)
}

/// [`text_array`] whose elements may be empty strings (row ids).
pub fn key_array<'a>(name: &str, value: Option<&'a TextArray>) -> Result<Vec<&'a str>> {
    array_of(name, value, true)
}

fn array_of<'a>(name: &str, value: Option<&'a TextArray>, empty_ok: bool) -> Result<Vec<&'a str>> {
    let array = &required(name, value)?.array;
    if array.len() > limits::ARRAY_ELEMENTS {
        return Err(Error::invalid_argument(name, "too_large"));
    }
    let mut out = crate::alloc::try_with_capacity(array.len())?;
    for item in array.iter() {
        crate::interrupts::check();
        out.push(match item {
            None => return Err(Error::invalid_argument(name, "missing")),
            Some("") if !empty_ok => return Err(Error::invalid_argument(name, "empty")),
            Some(s) if s.len() > limits::KEY_BYTES => {
                return Err(Error::invalid_argument(name, "too_large"))
            }
            Some(s) => s,
        });
    }
    Ok(out)
}

/// Unwraps a jsonb string that holds the text of an object or array (drivers that bind JSON
/// text as a jsonb string). Only top-level arguments are unwrapped.
pub fn unwrap_json_text(value: Value) -> Value {
    if let Value::String(text) = &value {
        if let Ok(inner @ (Value::Object(_) | Value::Array(_))) = serde_json::from_str(text) {
            return inner;
        }
    }
    value
}

/// The text of a jsonb string argument if it is the text of an object or array (the
/// [`unwrap_json_text`] rule, without building the value).
pub fn json_text(text: &str) -> Option<&str> {
    let trimmed = text.trim_start();
    let container = trimmed.starts_with('{') || trimmed.starts_with('[');
    (container && serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok()).then_some(text)
}

/// The text of a jsonb string node that holds the text of an object or array (a document bound
/// as a jsonb string by a 0.24 host's driver; data model invariant 15): what every reader of a
/// binary document reads instead of the string.
pub fn wrapped_json(node: crate::jsonb::Node<'_>) -> Option<&str> {
    match node {
        crate::jsonb::Node::String(text) => std::str::from_utf8(text).ok().and_then(json_text),
        _ => None,
    }
}

/// Runs `body` on the root of the required jsonb argument `name`, read in its binary form
/// ([`crate::jsonb`]): over the argument caps → `too_large`, nested deeper than
/// [`crate::jsonb::MAX_DEPTH`] → `too_deep`. A document bound as a jsonb string holding the text
/// of an object or array is read as that text, as [`unwrap_json_text`] does for parsed ones.
pub fn with_jsonb<R>(
    name: &str,
    document: Option<crate::jsonb::JsonbArg>,
    body: impl FnOnce(crate::jsonb::Node<'_>) -> Result<R>,
) -> Result<R> {
    use crate::jsonb::JsonbArg;
    let document = required(name, document)?;
    let root = jsonb_root(name, &document)?;
    let reparsed;
    let root = match wrapped_json(root) {
        Some(text) => {
            reparsed =
                JsonbArg::parse(text).ok_or_else(|| Error::invalid_argument(name, "type"))?;
            jsonb_root(name, &reparsed)?
        }
        None => root,
    };
    body(root)
}

fn jsonb_root<'a>(
    name: &str,
    document: &'a crate::jsonb::JsonbArg,
) -> Result<crate::jsonb::Node<'a>> {
    if document.over_limits() {
        return Err(Error::invalid_argument(name, "too_large"));
    }
    let unreadable = |_| Error::invalid_argument(name, "type");
    let container = document.container().map_err(unreadable)?;
    if container
        .nests_deeper_than(crate::jsonb::MAX_DEPTH)
        .map_err(unreadable)?
    {
        return Err(Error::invalid_argument(name, "too_deep"));
    }
    container.root().map_err(unreadable)
}

/// A required jsonb argument, unwrapped.
pub fn json(name: &str, value: Option<JsonArg>) -> Result<Value> {
    Ok(unwrap_json_text(required(name, value)?.value(name)?))
}

/// An optional jsonb argument (NULL allowed), unwrapped.
pub fn optional_json(name: &str, value: Option<JsonArg>) -> Result<Option<Value>> {
    value
        .map(|v| v.value(name).map(unwrap_json_text))
        .transpose()
}

/// How an integer-valued JSON number failed, if it did.
pub enum IntProblem {
    /// Not a number, or not integral.
    Type,
    /// Integral, but outside ±(2^53 − 1).
    Range,
}

/// Reads a JSON integer within ±(2^53 − 1). `2.0` counts as integral (jsonb may keep the scale).
pub fn json_int(value: &Value) -> std::result::Result<i64, IntProblem> {
    let Value::Number(n) = value else {
        return Err(IntProblem::Type);
    };
    if let Some(i) = n.as_i64() {
        return if (-MAX_SAFE..=MAX_SAFE).contains(&i) {
            Ok(i)
        } else {
            Err(IntProblem::Range)
        };
    }
    if n.is_u64() {
        return Err(IntProblem::Range);
    }
    match n.as_f64() {
        Some(f) if f.fract() == 0.0 && f.is_finite() => {
            if f.abs() <= MAX_SAFE as f64 {
                Ok(f as i64)
            } else {
                Err(IntProblem::Range)
            }
        }
        _ => Err(IntProblem::Type),
    }
}

/// One entry of a `declared` array (docs/API.md §Serve gate):
/// `{"partition", "name", "schemaVersion"?}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Declaration {
    pub partition: String,
    pub name: String,
    pub schema_version: Option<i64>,
}

/// Decodes a `declared` argument. NULL counts as `[]`; a malformed array is `invalid_argument`
/// with `argument` pointing into it (e.g. `declared[1].name`).
pub fn declarations(value: Option<JsonArg>) -> Result<Vec<Declaration>> {
    let Some(value) = optional_json("declared", value)? else {
        return Ok(Vec::new());
    };
    let Value::Array(items) = value else {
        return Err(Error::invalid_argument("declared", "type"));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            crate::interrupts::check();
            let at = |key: &str| format!("declared[{i}].{key}");
            let Value::Object(obj) = item else {
                return Err(Error::invalid_argument(&format!("declared[{i}]"), "type"));
            };
            let partition = json_text_field(obj, "partition", &at("partition"))?;
            let name = json_text_field(obj, "name", &at("name"))?;
            let schema_version = match obj.get("schemaVersion") {
                None | Some(Value::Null) => None,
                Some(v) => match json_int(v) {
                    Ok(n) if n >= 1 => Some(n),
                    Ok(_) | Err(IntProblem::Range) => {
                        return Err(Error::invalid_argument(&at("schemaVersion"), "range"))
                    }
                    Err(IntProblem::Type) => {
                        return Err(Error::invalid_argument(&at("schemaVersion"), "type"))
                    }
                },
            };
            Ok(Declaration {
                partition,
                name,
                schema_version,
            })
        })
        .collect()
}

/// An integer member `key` of a JSON object argument within `min ..= max` (`range`), an
/// integral number (`type`); absent or null is `default`, or `missing` without one. `at` is the
/// member's path for the refusal (e.g. `reactions[2].version`).
pub fn json_int_field(
    obj: &Map<String, Value>,
    key: &str,
    at: &str,
    (min, max): (i64, i64),
    default: Option<i64>,
) -> Result<i64> {
    match obj.get(key) {
        None | Some(Value::Null) => default.ok_or_else(|| Error::invalid_argument(at, "missing")),
        Some(v) => match json_int(v) {
            Ok(n) if (min..=max).contains(&n) => Ok(n),
            Ok(_) | Err(IntProblem::Range) => Err(Error::invalid_argument(at, "range")),
            Err(IntProblem::Type) => Err(Error::invalid_argument(at, "type")),
        },
    }
}

/// A required, non-empty string member of a JSON object argument.
pub fn json_text_field(obj: &Map<String, Value>, key: &str, path: &str) -> Result<String> {
    match obj.get(key) {
        None | Some(Value::Null) => Err(Error::invalid_argument(path, "missing")),
        Some(Value::String(s)) if s.is_empty() => Err(Error::invalid_argument(path, "empty")),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(Error::invalid_argument(path, "type")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_int_bounds() {
        assert!(matches!(json_int(&json!(MAX_SAFE)), Ok(MAX_SAFE)));
        assert!(matches!(
            json_int(&json!(MAX_SAFE + 1)),
            Err(IntProblem::Range)
        ));
        assert!(matches!(
            json_int(&json!(-MAX_SAFE - 1)),
            Err(IntProblem::Range)
        ));
        assert!(matches!(json_int(&json!(u64::MAX)), Err(IntProblem::Range)));
        assert!(matches!(json_int(&json!(1.5)), Err(IntProblem::Type)));
        assert!(matches!(json_int(&json!(2.0)), Ok(2)));
        assert!(matches!(json_int(&json!(1e300)), Err(IntProblem::Range)));
        assert!(matches!(json_int(&json!("1")), Err(IntProblem::Type)));
    }

    #[test]
    fn string_wrapped_json_is_unwrapped_once() {
        assert_eq!(unwrap_json_text(json!("{\"a\":1}")), json!({"a": 1}));
        assert_eq!(unwrap_json_text(json!("[1]")), json!([1]));
        assert_eq!(unwrap_json_text(json!("5")), json!("5"));
        assert_eq!(unwrap_json_text(json!("\"{}\"")), json!("\"{}\""));
    }
}
