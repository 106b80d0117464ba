//! The full-row and sparse-row codecs (docs/CODEC.md §Full row, §Sparse row): bitmaps, then
//! the non-null values in declaration order. Decoding runs exactly upstream's checks in
//! upstream's order, so the first failure — and its message — is the one upstream reports.

use super::bytes::{Reader, Writer};
use super::{json, CodecError, Column, ColumnType, Layout, Result, Value};
use std::borrow::Cow;

fn bit(bitmap: &[u8], index: usize) -> bool {
    bitmap
        .get(index >> 3)
        .is_some_and(|byte| (byte >> (index & 7)) & 1 != 0)
}

fn set_bit(bitmap: &mut [u8], index: usize) {
    if let Some(byte) = bitmap.get_mut(index >> 3) {
        *byte |= 1 << (index & 7);
    }
}

/// Whether any bit at or above `used` is set (the padding of a bitmap of `used` bits).
fn padding_set(bitmap: &[u8], used: usize) -> bool {
    (used..bitmap.len() * 8).any(|i| bit(bitmap, i))
}

fn read_value<'a>(reader: &mut Reader<'a>, column: &Column) -> Result<Value<'a>> {
    Ok(match column.ty {
        ColumnType::String => Value::Text(Cow::Borrowed(reader.str()?)),
        ColumnType::Json => {
            let raw = reader.str()?;
            if !json::parses(raw) {
                return Err(CodecError(format!(
                    "json column {} does not parse as a JSON document",
                    column.name
                )));
            }
            Value::Text(Cow::Borrowed(raw))
        }
        ColumnType::BlobRef => {
            let raw = reader.str()?;
            json::check_blob_ref(raw)?;
            Value::Text(Cow::Borrowed(raw))
        }
        ColumnType::Integer => Value::Int(reader.i64()?),
        ColumnType::Float => Value::Float(reader.f64()?),
        ColumnType::Boolean => Value::Bool(reader.bool()?),
        ColumnType::Bytes | ColumnType::Crdt => Value::Bytes(Cow::Borrowed(reader.bytes()?)),
    })
}

fn non_nullable(column: &Column) -> CodecError {
    CodecError(format!(
        "null bit set for non-nullable column {}",
        column.name
    ))
}

/// Decodes one full row (`_sync_payload`, change payloads, conflict `serverRow`).
pub fn decode_full<'a>(layout: &Layout, payload: &'a [u8]) -> Result<Vec<Value<'a>>> {
    let mut reader = Reader::new(payload);
    let nulls = reader.take(layout.bitmap_len())?;
    if padding_set(nulls, layout.columns.len()) {
        return Err(CodecError::new("non-zero padding bit in row null bitmap"));
    }
    let mut values = Vec::with_capacity(layout.columns.len());
    for (i, column) in layout.columns.iter().enumerate() {
        if bit(nulls, i) {
            if !column.nullable {
                return Err(non_nullable(column));
            }
            values.push(Value::Null);
        } else {
            values.push(read_value(&mut reader, column)?);
        }
    }
    reader.expect_end("row payload")?;
    Ok(values)
}

/// Decodes one sparse row (a push operation's payload); `None` = the column is absent.
pub fn decode_sparse<'a>(layout: &Layout, payload: &'a [u8]) -> Result<Vec<Option<Value<'a>>>> {
    let mut reader = Reader::new(payload);
    let count = layout.columns.len();
    let presence = reader.take(layout.bitmap_len())?;
    if padding_set(presence, count) {
        return Err(CodecError::new(
            "sparse row presence bitmap has a set padding bit (non-canonical encoding)",
        ));
    }
    if !bit(presence, layout.primary_key) {
        let name = layout
            .columns
            .get(layout.primary_key)
            .map_or("", |c| c.name.as_str());
        return Err(CodecError(format!(
            "sparse row is missing the primary-key column {name}"
        )));
    }
    let present_count = (0..count).filter(|&i| bit(presence, i)).count();
    let nulls = reader.take(present_count.div_ceil(8))?;
    if padding_set(nulls, present_count) {
        return Err(CodecError::new(
            "sparse row null bitmap sets a null bit for an absent column",
        ));
    }
    let mut values = Vec::with_capacity(count);
    let mut present = 0;
    for (i, column) in layout.columns.iter().enumerate() {
        if !bit(presence, i) {
            values.push(None);
            continue;
        }
        let is_null = bit(nulls, present);
        present += 1;
        if !is_null {
            values.push(Some(read_value(&mut reader, column)?));
        } else if column.nullable {
            values.push(Some(Value::Null));
        } else {
            return Err(non_nullable(column));
        }
    }
    reader.expect_end("sparse row payload")?;
    Ok(values)
}

/// Upstream's encoder refusal for a value of the wrong kind.
pub fn wrong_kind(column: &Column) -> CodecError {
    let name = &column.name;
    CodecError(match column.ty {
        ColumnType::String | ColumnType::Json | ColumnType::BlobRef => {
            format!(
                "column {name} ({}) requires a string value",
                column.ty.name()
            )
        }
        ColumnType::Integer => format!("column {name} (integer) requires a safe integer value"),
        ColumnType::Float => format!("column {name} (float) requires a number value"),
        ColumnType::Boolean => format!("column {name} (boolean) requires a boolean value"),
        ColumnType::Bytes | ColumnType::Crdt => {
            format!(
                "column {name} ({}) requires a Uint8Array value",
                column.ty.name()
            )
        }
    })
}

fn write_value(writer: &mut Writer, column: &Column, value: &Value<'_>) -> Result<()> {
    if !value.fits(column.ty) {
        return Err(wrong_kind(column));
    }
    match value {
        Value::Null => {}
        Value::Text(text) => writer.bytes(text.as_bytes())?,
        Value::Int(i) => writer.i64(*i).map_err(|_| wrong_kind(column))?,
        Value::Float(f) => writer.f64(*f),
        Value::Bool(b) => writer.bool(*b),
        Value::Bytes(bytes) => writer.bytes(bytes)?,
    }
    Ok(())
}

/// Bytes a value takes on the wire (NULL: none).
fn wire_size(value: &Value<'_>) -> usize {
    match value {
        Value::Null => 0,
        Value::Text(t) => 4 + t.len(),
        Value::Bytes(b) => 4 + b.len(),
        Value::Int(_) | Value::Float(_) => 8,
        Value::Bool(_) => 1,
    }
}

fn check_count(layout: &Layout, values: usize) -> Result<()> {
    if values != layout.columns.len() {
        return Err(CodecError(format!(
            "row value count {values} does not match column count {}",
            layout.columns.len()
        )));
    }
    Ok(())
}

fn not_nullable(column: &Column) -> CodecError {
    CodecError(format!("column {} is not nullable", column.name))
}

/// Encodes one full row. Refuses (upstream's encoder messages) a NULL in a non-nullable
/// column or a value of the wrong kind.
pub fn encode_full(layout: &Layout, values: &[Value<'_>]) -> Result<Vec<u8>> {
    check_count(layout, values.len())?;
    let bitmap_len = layout.bitmap_len();
    let size = bitmap_len + values.iter().map(wire_size).sum::<usize>();
    let mut writer = Writer::try_with_capacity(size)?;
    writer.out.resize(bitmap_len, 0);
    for (i, (column, value)) in layout.columns.iter().zip(values).enumerate() {
        if value.is_null() {
            if !column.nullable {
                return Err(not_nullable(column));
            }
            set_bit(&mut writer.out, i);
        }
    }
    for (column, value) in layout.columns.iter().zip(values) {
        write_value(&mut writer, column, value)?;
    }
    Ok(writer.out)
}

/// Encodes one sparse row; `None` = absent. The primary key must be present.
pub fn encode_sparse(layout: &Layout, values: &[Option<Value<'_>>]) -> Result<Vec<u8>> {
    check_count(layout, values.len())?;
    let bitmap_len = layout.bitmap_len();
    let present_count = values.iter().filter(|v| v.is_some()).count();
    let nulls_len = present_count.div_ceil(8);
    if values.get(layout.primary_key).is_none_or(Option::is_none) {
        let name = layout
            .columns
            .get(layout.primary_key)
            .map_or("", |c| c.name.as_str());
        return Err(CodecError(format!(
            "sparse row is missing the primary-key column {name}"
        )));
    }
    let size = bitmap_len + nulls_len + values.iter().flatten().map(wire_size).sum::<usize>();
    let mut writer = Writer::try_with_capacity(size)?;
    writer.out.resize(bitmap_len + nulls_len, 0);
    let mut present = 0;
    for (i, (column, value)) in layout.columns.iter().zip(values).enumerate() {
        let Some(value) = value else { continue };
        set_bit(&mut writer.out[..bitmap_len], i);
        if value.is_null() {
            if !column.nullable {
                return Err(not_nullable(column));
            }
            set_bit(&mut writer.out[bitmap_len..], present);
        }
        present += 1;
    }
    for (column, value) in layout.columns.iter().zip(values) {
        if let Some(value) = value {
            write_value(&mut writer, column, value)?;
        }
    }
    Ok(writer.out)
}

/// Step U8 of the push (docs/CODEC.md §Merge): the stored values with every present column of
/// the patch written over them (the primary key and raw crdt bytes included).
pub fn merge<'a>(stored: &mut [Value<'a>], patch: Vec<Option<Value<'a>>>) {
    for (slot, value) in stored.iter_mut().zip(patch) {
        if let Some(value) = value {
            *slot = value;
        }
    }
}

/// The presence set of a sparse row as a list of column indexes.
pub fn present_columns(values: &[Option<Value<'_>>]) -> Vec<usize> {
    values
        .iter()
        .enumerate()
        .filter_map(|(i, v)| v.as_ref().map(|_| i))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{hex, nine, tasks};
    use super::*;

    fn text(s: &str) -> Value<'_> {
        Value::Text(Cow::Borrowed(s))
    }

    fn e1_values() -> Vec<Value<'static>> {
        vec![
            text("t1"),
            text("p1"),
            text("task"),
            Value::Bool(false),
            Value::Null,
            Value::Null,
        ]
    }

    const E1_SPARSE: &str =
        "3F 30 | 02 00 00 00 74 31 | 02 00 00 00 70 31 | 04 00 00 00 74 61 73 6B | 00";
    const E1_STORED: &str =
        "30 | 02 00 00 00 74 31 | 02 00 00 00 70 31 | 04 00 00 00 74 61 73 6B | 00";

    /// CD-01, E1: the same row as a full sparse payload and as a stored full row.
    #[test]
    fn cd01_e1_sparse_and_full_differ() {
        let layout = tasks();
        let all: Vec<Option<Value>> = e1_values().into_iter().map(Some).collect();
        assert_eq!(encode_sparse(&layout, &all).unwrap(), hex(E1_SPARSE));
        assert_eq!(encode_full(&layout, &e1_values()).unwrap(), hex(E1_STORED));
        let sparse = hex(E1_SPARSE);
        assert_eq!(decode_sparse(&layout, &sparse).unwrap(), all);
        let stored = hex(E1_STORED);
        assert_eq!(decode_full(&layout, &stored).unwrap(), e1_values());
        assert_ne!(sparse, stored);
    }

    /// CD-01, E2 and E3: sparse patches, merged into the stored row and re-encoded.
    #[test]
    fn cd01_e2_e3_patches_and_merges() {
        let layout = tasks();
        let e2 = vec![Some(text("t1")), None, Some(text("v2")), None, None, None];
        let e2_bytes = hex("05 00 | 02 00 00 00 74 31 | 02 00 00 00 76 32");
        assert_eq!(encode_sparse(&layout, &e2).unwrap(), e2_bytes);
        assert_eq!(decode_sparse(&layout, &e2_bytes).unwrap(), e2);
        let stored = hex(E1_STORED);
        let mut row = decode_full(&layout, &stored).unwrap();
        merge(&mut row, decode_sparse(&layout, &e2_bytes).unwrap());
        let v2 = encode_full(&layout, &row).unwrap();
        assert_eq!(
            v2,
            hex("30 | 02 00 00 00 74 31 | 02 00 00 00 70 31 | 02 00 00 00 76 32 | 00")
        );

        let e3 = vec![
            Some(text("t1")),
            None,
            None,
            Some(Value::Bool(true)),
            Some(Value::Int(300)),
            None,
        ];
        let e3_bytes = hex("19 00 | 02 00 00 00 74 31 | 01 | 2C 01 00 00 00 00 00 00");
        assert_eq!(encode_sparse(&layout, &e3).unwrap(), e3_bytes);
        let mut row = decode_full(&layout, &v2).unwrap();
        merge(&mut row, decode_sparse(&layout, &e3_bytes).unwrap());
        let v3 = encode_full(&layout, &row).unwrap();
        assert_eq!(
            v3,
            hex("20 | 02 00 00 00 74 31 | 02 00 00 00 70 31 | 02 00 00 00 76 32 | 01 | 2C 01 00 00 00 00 00 00")
        );
        assert_eq!(v3.len(), 28);
    }

    /// CD-01, E4: the golden-vector fixture with two presence bytes.
    #[test]
    fn cd01_e4_golden_vectors() {
        let layout = nine();
        let mut values: Vec<Option<Value>> = vec![None; 9];
        values[0] = Some(text("n-1"));
        values[1] = Some(Value::Null);
        values[6] = Some(text(r#"{"tags": ["a"]}"#));
        let bytes = hex("43 00 | 02 | 03 00 00 00 6E 2D 31 | 0F 00 00 00 7B 22 74 61 67 73 22 3A 20 5B 22 61 22 5D 7D");
        assert_eq!(bytes.len(), 29);
        assert_eq!(encode_sparse(&layout, &values).unwrap(), bytes);
        assert_eq!(decode_sparse(&layout, &bytes).unwrap(), values);

        let full = vec![
            text("n-2"),
            Value::Null,
            text("body"),
            Value::Int(-7),
            Value::Float(0.125),
            Value::Bool(false),
            text(r#"{"k":true}"#),
            Value::Bytes(Cow::Borrowed(&[0x00, 0x01, 0xFE, 0xFF])),
            Value::Bytes(Cow::Borrowed(&[0x01, 0x02, 0xFE])),
        ];
        let body = "03 00 00 00 6E 2D 32 | 04 00 00 00 62 6F 64 79 | F9 FF FF FF FF FF FF FF |
            00 00 00 00 00 00 C0 3F | 00 | 0A 00 00 00 7B 22 6B 22 3A 74 72 75 65 7D | 04 00 00 00 00 01 FE FF |
            03 00 00 00 01 02 FE";
        let sparse_bytes = hex(&format!("FF 01 | 02 00 | {body}"));
        let all: Vec<Option<Value>> = full.iter().cloned().map(Some).collect();
        assert_eq!(encode_sparse(&layout, &all).unwrap(), sparse_bytes);
        assert_eq!(decode_sparse(&layout, &sparse_bytes).unwrap(), all);
        let full_bytes = hex(&format!("02 00 | {body}"));
        assert_eq!(encode_full(&layout, &full).unwrap(), full_bytes);
        assert_eq!(decode_full(&layout, &full_bytes).unwrap(), full);
    }

    fn sparse_err(bytes: &[u8]) -> String {
        decode_sparse(&tasks(), bytes).unwrap_err().0
    }

    fn full_err(layout: &Layout, bytes: &[u8]) -> String {
        decode_full(layout, bytes).unwrap_err().0
    }

    /// CD-02 with E5: every decode failure, its message, and which wins when two coexist.
    #[test]
    fn cd02_e5_decode_failures_in_order() {
        assert_eq!(
            sparse_err(&hex("FF 01")),
            "sparse row presence bitmap has a set padding bit (non-canonical encoding)"
        );
        // A padding bit beats an absent primary key.
        assert_eq!(
            sparse_err(&hex("FE")),
            "sparse row presence bitmap has a set padding bit (non-canonical encoding)"
        );
        assert_eq!(
            sparse_err(&hex("01 00 03 00 00 00 74 31")),
            "truncated input: needed 3 bytes, have 2"
        );
        assert_eq!(
            sparse_err(&hex("02 00 02 00 00 00 70 31")),
            "sparse row is missing the primary-key column id"
        );
        assert_eq!(
            sparse_err(&hex("01 02 02 00 00 00 74 31")),
            "sparse row null bitmap sets a null bit for an absent column"
        );
        assert_eq!(
            sparse_err(&hex("01 01")),
            "null bit set for non-nullable column id"
        );
        assert_eq!(sparse_err(&[]), "truncated input: needed 1 bytes, have 0");
        assert_eq!(
            sparse_err(&hex("01")),
            "truncated input: needed 1 bytes, have 0"
        );
        let mut long = hex(E1_SPARSE);
        long.push(0xFF);
        assert_eq!(sparse_err(&long), "trailing bytes after sparse row payload");
        assert_eq!(
            sparse_err(&hex("09 00 | 02 00 00 00 74 31 | 02")),
            "invalid bool byte 0x2"
        );
        // Column order decides between null-bit and value errors: title's null bit (column 2)
        // before done's bad byte (column 3); title's bad UTF-8 before done's null bit.
        assert_eq!(
            sparse_err(&hex("0D 02 | 02 00 00 00 74 31 | 02")),
            "null bit set for non-nullable column title"
        );
        assert_eq!(
            sparse_err(&hex("0D 04 | 02 00 00 00 74 31 | 01 00 00 00 FF")),
            "invalid UTF-8 in string"
        );
        // Values are validated as they are read: meta's JSON before the trailing byte.
        assert_eq!(
            sparse_err(&hex("21 00 | 02 00 00 00 74 31 | 01 00 00 00 7B | 00")),
            "json column meta does not parse as a JSON document"
        );
        assert_eq!(
            sparse_err(&hex("11 00 | 02 00 00 00 74 31 | 00 00 00 00 00 00 20 00")),
            "i64 outside the safe-integer contract: 9007199254740992"
        );
        assert_eq!(
            sparse_err(&hex("01 00 | 02 00 00 00 C3 28")),
            "invalid UTF-8 in string"
        );

        let layout = tasks();
        assert_eq!(
            full_err(&layout, &hex("70")),
            "non-zero padding bit in row null bitmap"
        );
        assert_eq!(
            full_err(&layout, &hex("01")),
            "null bit set for non-nullable column id"
        );
        let mut long = hex(E1_STORED);
        long.push(0);
        assert_eq!(full_err(&layout, &long), "trailing bytes after row payload");
        // Padding beats the non-nullable null bit in the same byte.
        assert_eq!(
            full_err(&layout, &hex("C1")),
            "non-zero padding bit in row null bitmap"
        );
        // Nine columns: the padding lives in the second byte.
        assert_eq!(
            full_err(&nine(), &hex("00 02")),
            "non-zero padding bit in row null bitmap"
        );
    }

    /// CD-03 for strings: one leading BOM is removed on decode and the stored row loses it.
    #[test]
    fn cd03_bom_is_stripped_from_strings() {
        let layout = tasks();
        let payload =
            hex("3F 30 | 02 00 00 00 74 31 | 02 00 00 00 70 31 | 04 00 00 00 EF BB BF 61 | 00");
        let decoded = decode_sparse(&layout, &payload).unwrap();
        assert_eq!(decoded[2], Some(text("a")));
        let row: Vec<Value> = decoded.into_iter().map(Option::unwrap).collect();
        let stored = encode_full(&layout, &row).unwrap();
        assert_eq!(
            stored,
            hex("30 | 02 00 00 00 74 31 | 02 00 00 00 70 31 | 01 00 00 00 61 | 00")
        );
    }

    /// CD-03 for json and blob_ref: the BOM goes before `JSON.parse` sees the text, so
    /// `\u{FEFF}{}` is accepted as json and stored without it.
    #[test]
    fn cd03_bom_is_stripped_from_json_and_blob_refs() {
        use super::super::fixtures::col;
        let layout = Layout {
            columns: vec![
                col("id", ColumnType::String, false),
                col("meta", ColumnType::Json, true),
                col("file", ColumnType::BlobRef, true),
            ],
            primary_key: 0,
        };
        let blob_ref = format!(
            "\u{FEFF}{{\"blobId\":\"sha256:{}\",\"byteLength\":1}}",
            "a".repeat(64)
        );
        let row = vec![text("\u{FEFF}x"), text("\u{FEFF}{}"), text(&blob_ref)];
        let bytes = encode_full(&layout, &row).unwrap();
        let decoded = decode_full(&layout, &bytes).unwrap();
        assert_eq!(decoded[0], text("x"));
        assert_eq!(decoded[1], text("{}"));
        assert_eq!(decoded[2], text(&blob_ref["\u{FEFF}".len()..]));
        let stored = encode_full(&layout, &decoded).unwrap();
        assert_eq!(stored.len(), bytes.len() - 9);
        // Two BOMs: one stays, and JSON.parse then refuses it.
        let twice = vec![text("a"), text("\u{FEFF}\u{FEFF}{}"), Value::Null];
        assert_eq!(
            decode_full(&layout, &encode_full(&layout, &twice).unwrap())
                .unwrap_err()
                .0,
            "json column meta does not parse as a JSON document"
        );
    }

    #[test]
    fn encoder_refusals_use_upstream_messages() {
        let layout = tasks();
        let mut row = e1_values();
        row[0] = Value::Null;
        assert_eq!(
            encode_full(&layout, &row).unwrap_err().0,
            "column id is not nullable"
        );
        let mut row = e1_values();
        row[4] = Value::Text(Cow::Borrowed("x"));
        assert_eq!(
            encode_full(&layout, &row).unwrap_err().0,
            "column priority (integer) requires a safe integer value"
        );
        row[4] = Value::Int(1 << 53);
        assert_eq!(
            encode_full(&layout, &row).unwrap_err().0,
            "column priority (integer) requires a safe integer value"
        );
        let patch = vec![None, Some(text("p")), None, None, None, None];
        assert_eq!(
            encode_sparse(&layout, &patch).unwrap_err().0,
            "sparse row is missing the primary-key column id"
        );
        assert_eq!(
            encode_full(&layout, &row[..2]).unwrap_err().0,
            "row value count 2 does not match column count 6"
        );
    }
}
