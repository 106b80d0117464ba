//! `encode_row` and `decode_row`: the row codec (src/codec, docs/CODEC.md) for people, tests and
//! hosts, over a table's stored push schema (or, for a given schema version, its push schema or
//! stored layouts: a payload decodes only with the layout of the version it was written at). Values travel as JSON (docs/CODEC.md §JSON forms):
//! NULL as `null`, string/json/blob_ref as a JSON string holding the raw text, integer and float
//! as numbers (`"NaN"`, `"Infinity"`, `"-Infinity"` as strings), booleans, bytes and crdt as
//! standard base64.

use crate::args::{self, JsonArg};
use crate::codec::{row, CodecError, Column, ColumnType, Value};
use crate::db;
use crate::error::{self, Error};
use crate::schema::push_schema;
use crate::tables;
use base64::Engine;
use pgrx::prelude::*;
use pgrx::JsonB;
use serde_json::{Map, Number, Value as Json};
use std::borrow::Cow;

/// A codec failure: `invalid_argument` whose `reason` is the codec's message, exactly as
/// upstream would store it (docs/API.md §encode_row/decode_row).
fn codec_error(argument: &str, tbl: &str, sparse: bool, e: CodecError) -> Error {
    Error::invalid_argument(argument, e.message()).with_hint(format!(
        "table {tbl}, {} row codec",
        if sparse { "sparse" } else { "full" }
    ))
}

const BASE64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

/// The value of `column` given as JSON, or upstream's encoder message for a wrong kind.
fn from_json<'a>(column: &Column, value: &'a Json) -> std::result::Result<Value<'a>, Error> {
    let wrong = || Error::invalid_argument("values", row::wrong_kind(column).message());
    Ok(match (column.ty, value) {
        (_, Json::Null) => Value::Null,
        (ColumnType::String | ColumnType::Json | ColumnType::BlobRef, Json::String(s)) => {
            Value::Text(Cow::Borrowed(s))
        }
        (ColumnType::Integer, v) => match args::json_int(v) {
            Ok(i) => Value::Int(i),
            Err(_) => return Err(wrong()),
        },
        (ColumnType::Float, Json::Number(n)) => Value::Float(n.as_f64().ok_or_else(wrong)?),
        (ColumnType::Float, Json::String(s)) => match s.as_str() {
            "NaN" => Value::Float(f64::NAN),
            "Infinity" => Value::Float(f64::INFINITY),
            "-Infinity" => Value::Float(f64::NEG_INFINITY),
            _ => return Err(wrong()),
        },
        (ColumnType::Boolean, Json::Bool(b)) => Value::Bool(*b),
        (ColumnType::Bytes | ColumnType::Crdt, Json::String(s)) => match BASE64.decode(s) {
            Ok(bytes) => Value::Bytes(Cow::Owned(bytes)),
            Err(_) => {
                return Err(Error::invalid_argument("values", "base64")
                    .with_hint(format!("column {}", column.name)))
            }
        },
        _ => return Err(wrong()),
    })
}

pub(crate) fn to_json(value: &Value<'_>) -> Json {
    match value {
        Value::Null => Json::Null,
        Value::Text(t) => Json::String(t.to_string()),
        Value::Int(i) => Json::from(*i),
        Value::Float(f) if f.is_nan() => Json::from("NaN"),
        Value::Float(f) if f.is_infinite() => {
            Json::from(if *f > 0.0 { "Infinity" } else { "-Infinity" })
        }
        // −0 reads as 0 (jsonb's numeric has no negative zero).
        Value::Float(f) => {
            Number::from_f64(if *f == 0.0 { 0.0 } else { *f }).map_or(Json::Null, Json::Number)
        }
        Value::Bool(b) => Json::Bool(*b),
        Value::Bytes(b) => Json::String(BASE64.encode(b)),
    }
}

/// The layout of `tbl` at `schema_version` (NULL: the stored schema version, the marker
/// `migrate_schema` sets — the version stored rows are encoded at), checked for a sparse row,
/// which needs the primary key only a push schema names.
fn codec_table(
    tbl: &str,
    sparse: bool,
    schema_version: Option<i64>,
) -> error::Result<push_schema::CodecTable> {
    if schema_version.is_some_and(|v| v < 1) {
        return Err(Error::invalid_argument("schema_version", "range"));
    }
    let table = db::with_spi(|client| push_schema::codec_table(client, tbl, schema_version))?;
    if sparse && !table.keyed {
        return Err(tables::unknown_table(tbl).with_hint(format!(
            "no push schema is stored at schema version {v}: a sparse row needs the primary key \
             a push schema names (the stored layouts encode and decode full rows only); call \
             syncular.set_push_schema({v}, …) first",
            v = table.version
        )));
    }
    Ok(table)
}

#[pg_extern(
    stable,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.encode_row(tbl text, "values" jsonb, sparse boolean DEFAULT false,
                                    schema_version bigint DEFAULT NULL) RETURNS bytea
STABLE PARALLEL UNSAFE SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'encode_row_wrapper';
"#
)]
fn encode_row(
    tbl: Option<&str>,
    values: Option<JsonArg>,
    sparse: Option<bool>,
    schema_version: Option<i64>,
) -> Vec<u8> {
    error::run_in_host_code(|| {
        let tbl = args::text("tbl", tbl)?;
        let Json::Object(values) = args::json("values", values)? else {
            return Err(Error::invalid_argument("values", "type"));
        };
        let sparse = args::required("sparse", sparse)?;
        let schema = codec_table(&tbl, sparse, schema_version)?;
        let layout = &schema.layout;
        let names: std::collections::HashSet<&str> =
            layout.columns.iter().map(|c| c.name.as_str()).collect();
        if let Some(unknown) = values.keys().find(|k| {
            crate::interrupts::check();
            !names.contains(k.as_str())
        }) {
            return Err(Error::invalid_argument("values", "shape")
                .with_hint(format!("table {tbl} has no column {unknown}")));
        }
        let mut row_values: Vec<Option<Value>> = Vec::with_capacity(layout.columns.len());
        for column in &layout.columns {
            row_values.push(match values.get(&column.name) {
                Some(v) => Some(from_json(column, v)?),
                None if sparse => None,
                None => {
                    return Err(
                        Error::invalid_argument("values", "missing").with_hint(format!(
                            "column {}: a full row needs every column (null for NULL)",
                            column.name
                        )),
                    )
                }
            });
        }
        let encoded = if sparse {
            row::encode_sparse(layout, &row_values)
        } else {
            let full: Vec<Value> = row_values.into_iter().flatten().collect();
            row::encode_full(layout, &full)
        }
        .map_err(|e| codec_error("values", &tbl, sparse, e))?;
        // What the decoder would refuse (json that JSON.parse rejects, a malformed BlobRef) is
        // refused here too, with the decoder's message: encode_row never builds a payload a
        // server would reject at decode.
        let checked = if sparse {
            row::decode_sparse(layout, &encoded).map(drop)
        } else {
            row::decode_full(layout, &encoded).map(drop)
        };
        checked.map_err(|e| codec_error("values", &tbl, sparse, e))?;
        Ok(encoded)
    })
}

#[pg_extern(
    stable,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular.decode_row(tbl text, payload bytea, sparse boolean DEFAULT false,
                                    schema_version bigint DEFAULT NULL) RETURNS jsonb
STABLE PARALLEL UNSAFE SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'decode_row_wrapper';
"#
)]
fn decode_row(
    tbl: Option<&str>,
    payload: Option<&[u8]>,
    sparse: Option<bool>,
    schema_version: Option<i64>,
) -> JsonB {
    error::run_in_host_code(|| {
        let tbl = args::text("tbl", tbl)?;
        let payload = args::bytes("payload", payload)?;
        let sparse = args::required("sparse", sparse)?;
        let schema = codec_table(&tbl, sparse, schema_version)?;
        let layout = &schema.layout;
        let decoded: Vec<Option<Value>> = if sparse {
            row::decode_sparse(layout, payload)
        } else {
            row::decode_full(layout, payload).map(|v| v.into_iter().map(Some).collect())
        }
        .map_err(|e| codec_error("payload", &tbl, sparse, e))?;
        let mut out = Map::new();
        for (column, value) in layout.columns.iter().zip(&decoded) {
            let Some(value) = value else { continue };
            if matches!(value, Value::Text(t) if t.contains('\0')) {
                return Err(
                    Error::invalid_argument("payload", "range").with_hint(format!(
                        "column {} holds U+0000, which jsonb cannot represent",
                        column.name
                    )),
                );
            }
            out.insert(column.name.clone(), to_json(value));
        }
        Ok(JsonB(Json::Object(out)))
    })
}
