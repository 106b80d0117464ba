//! upstream Syncular's row codec, column versions and value rules, as pure functions
//! (docs/CODEC.md). Nothing here touches SQL, SPI or PostgreSQL memory: the SQL functions that
//! use it live in `push_schema.rs`, and the module also compiles on its own (bench/codec).
//!
//! Contract of every function here: it never panics on any input, and it allocates at most a
//! small multiple of its input (plus one slot per column of the layout). Decoded values borrow
//! from the input; only what must change (nothing, today) would be copied.
//!
//! - [`bytes`]: the fixed-width little-endian primitives and their error messages;
//! - [`row`]: the full-row and sparse-row codecs over a [`Layout`];
//! - [`json`]: `JSON.parse`'s grammar as an iterative validator, and the BlobRef shape check;
//! - [`number`]: ECMAScript number-to-text and the rendering of values to scope/PK text;
//! - [`versions`]: the `_sync_column_versions` blob, effective versions and the conflict rule.

// Parts of the codec (rendering, the conflict rule) are used by the one-call push, not yet by
// the SQL functions of this version.
#![allow(dead_code)]

pub mod bytes;
pub mod json;
pub mod number;
pub mod row;
pub mod versions;

use std::borrow::Cow;
use std::fmt;

/// A failure of the codec, carrying upstream's message exactly (docs/CODEC.md §Messages): the
/// text ends up in stored rejections, so it must match character for character.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodecError(pub String);

impl CodecError {
    pub fn new(message: impl Into<String>) -> CodecError {
        CodecError(message.into())
    }
    pub fn message(&self) -> &str {
        &self.0
    }
}

/// An allocation sized by the data failed (`src/alloc.rs`): the call that decodes or encodes
/// ends in `53200` whatever becomes of this error.
impl From<crate::alloc::OutOfMemory> for CodecError {
    fn from(e: crate::alloc::OutOfMemory) -> CodecError {
        CodecError(format!("out of memory (a request of {} bytes)", e.0))
    }
}

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

pub type Result<T> = std::result::Result<T, CodecError>;

/// The eight column types of docs/CODEC.md §Column types, with their wire tags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ColumnType {
    String = 1,
    Integer = 2,
    Float = 3,
    Boolean = 4,
    Json = 5,
    Bytes = 6,
    BlobRef = 7,
    Crdt = 8,
}

impl ColumnType {
    pub const ALL: [ColumnType; 8] = [
        ColumnType::String,
        ColumnType::Integer,
        ColumnType::Float,
        ColumnType::Boolean,
        ColumnType::Json,
        ColumnType::Bytes,
        ColumnType::BlobRef,
        ColumnType::Crdt,
    ];

    /// The schema-IR name (`"string"`, `"blob_ref"`, …).
    pub fn name(self) -> &'static str {
        match self {
            ColumnType::String => "string",
            ColumnType::Integer => "integer",
            ColumnType::Float => "float",
            ColumnType::Boolean => "boolean",
            ColumnType::Json => "json",
            ColumnType::Bytes => "bytes",
            ColumnType::BlobRef => "blob_ref",
            ColumnType::Crdt => "crdt",
        }
    }

    pub fn from_name(name: &str) -> Option<ColumnType> {
        ColumnType::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The wire tag (segment column tables only; never in row payloads).
    pub fn tag(self) -> u8 {
        self as u8
    }

    /// Values of this type are `str` on the wire (string, json, blob_ref).
    pub fn is_text(self) -> bool {
        matches!(
            self,
            ColumnType::String | ColumnType::Json | ColumnType::BlobRef
        )
    }

    /// Values of this type are `bytes` on the wire (bytes, crdt).
    pub fn is_bytes(self) -> bool {
        matches!(self, ColumnType::Bytes | ColumnType::Crdt)
    }
}

/// One column of a table's layout at a schema version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    pub ty: ColumnType,
    pub nullable: bool,
}

/// A table's columns in declaration order and the index of its primary-key column.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub columns: Vec<Column>,
    pub primary_key: usize,
}

impl Layout {
    /// Bytes of a bitmap over all columns (`ceil(C/8)`).
    pub fn bitmap_len(&self) -> usize {
        self.columns.len().div_ceil(8)
    }
}

/// One decoded value. Text and bytes borrow from the payload they were decoded from (no copy:
/// docs/CODEC.md §Speed); values built elsewhere own theirs.
#[derive(Clone, Debug, PartialEq)]
pub enum Value<'a> {
    Null,
    /// `string`, `json` and `blob_ref` values (json/blob_ref: the raw text, verbatim).
    Text(Cow<'a, str>),
    Int(i64),
    Float(f64),
    Bool(bool),
    /// `bytes` and `crdt` values.
    Bytes(Cow<'a, [u8]>),
}

impl Value<'_> {
    pub fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }

    /// Whether this value has the shape column type `ty` expects (NULL fits every type).
    pub fn fits(&self, ty: ColumnType) -> bool {
        match self {
            Value::Null => true,
            Value::Text(_) => ty.is_text(),
            Value::Int(_) => ty == ColumnType::Integer,
            Value::Float(_) => ty == ColumnType::Float,
            Value::Bool(_) => ty == ColumnType::Boolean,
            Value::Bytes(_) => ty.is_bytes(),
        }
    }

    /// The same value, owning its text or bytes.
    pub fn into_owned(self) -> Value<'static> {
        match self {
            Value::Null => Value::Null,
            Value::Text(t) => Value::Text(Cow::Owned(t.into_owned())),
            Value::Int(i) => Value::Int(i),
            Value::Float(f) => Value::Float(f),
            Value::Bool(b) => Value::Bool(b),
            Value::Bytes(b) => Value::Bytes(Cow::Owned(b.into_owned())),
        }
    }
}

#[cfg(test)]
pub(crate) mod fixtures {
    //! Layouts of docs/CODEC.md's worked examples.
    use super::{Column, ColumnType, Layout};

    pub fn col(name: &str, ty: ColumnType, nullable: bool) -> Column {
        Column {
            name: name.to_string(),
            ty,
            nullable,
        }
    }

    /// upstream's test fixture `tasks`: `id string!, project_id string!, title string!,
    /// done boolean!, priority integer?, meta json?`; PK `id`.
    pub fn tasks() -> Layout {
        use ColumnType::*;
        Layout {
            columns: vec![
                col("id", String, false),
                col("project_id", String, false),
                col("title", String, false),
                col("done", Boolean, false),
                col("priority", Integer, true),
                col("meta", Json, true),
            ],
            primary_key: 0,
        }
    }

    /// The golden-vector fixture of E4: nine columns, two presence bytes.
    pub fn nine() -> Layout {
        use ColumnType::*;
        Layout {
            columns: vec![
                col("id", String, false),
                col("title", String, true),
                col("body", String, false),
                col("count", Integer, true),
                col("score", Float, false),
                col("done", Boolean, false),
                col("meta", Json, true),
                col("blob", Bytes, true),
                col("doc", Crdt, true),
            ],
            primary_key: 0,
        }
    }

    /// Hex with optional spaces and `|` separators, as the examples print bytes.
    pub fn hex(text: &str) -> Vec<u8> {
        let digits: Vec<u8> = text.bytes().filter(|b| b.is_ascii_hexdigit()).collect();
        digits
            .chunks(2)
            .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).unwrap(), 16).unwrap())
            .collect()
    }
}

#[cfg(all(test, feature = "pg_test"))]
mod props;
