//! Property tests of the codec (docs/CODEC.md §Tests): round trips of random rows of every
//! type, and arbitrary bytes against every decoder (never a panic, only documented messages).

use super::bytes::{strip_bom, MAX_SAFE};
use super::fixtures::{col, nine, tasks};
use super::{json, row, versions, ColumnType, Layout, Value};
use proptest::prelude::*;
use std::borrow::Cow;

const BLOB_ID: &str = "sha256:00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

fn text_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("\u{FEFF}".to_string()),
        Just("\u{FEFF}\u{FEFF}a".to_string()),
        any::<String>(),
        any::<String>().prop_map(|s| format!("\u{FEFF}{s}")),
        "[\\PC\u{0}]{0,300}",
    ]
}

fn json_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("{}".to_string()),
        Just("\u{FEFF}[1, 2]".to_string()),
        Just(r#"{"tags": ["a"]}"#.to_string()),
        Just(r#""\ud800""#.to_string()),
        Just("1e400".to_string()),
        // From 1: zero brackets would be "", which is not JSON (decoding refuses it).
        (1usize..2000).prop_map(|d| "[".repeat(d) + &"]".repeat(d)),
        any::<i64>().prop_map(|i| format!(" {i} ")),
        any::<String>().prop_map(|s| serde_like_string(&s)),
    ]
}

/// A JSON string literal for `s` (enough escaping for the grammar).
fn serde_like_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn blob_ref_value() -> impl Strategy<Value = String> {
    (
        0u64..=MAX_SAFE as u64,
        proptest::option::of(any::<String>()),
    )
        .prop_map(|(len, name)| {
            let name = name.map_or(String::new(), |n| {
                format!(",\"name\":{}", serde_like_string(&n))
            });
            format!("{{\"blobId\":\"{BLOB_ID}\",\"byteLength\":{len}{name}}}")
        })
}

fn float_value() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(f64::NEG_INFINITY),
        Just(0.0),
        Just(-0.0),
        Just(f64::MIN_POSITIVE / 2.0),
        any::<u64>().prop_map(f64::from_bits),
        any::<f64>(),
    ]
}

fn bytes_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(Vec::new()),
        proptest::collection::vec(any::<u8>(), 0..64),
        (0usize..300_000).prop_map(|n| vec![0xAB; n]),
    ]
}

fn value_of(ty: ColumnType) -> BoxedStrategy<Value<'static>> {
    match ty {
        ColumnType::String => text_value()
            .prop_map(|s| Value::Text(Cow::Owned(s)))
            .boxed(),
        ColumnType::Json => json_value()
            .prop_map(|s| Value::Text(Cow::Owned(s)))
            .boxed(),
        ColumnType::BlobRef => blob_ref_value()
            .prop_map(|s| Value::Text(Cow::Owned(s)))
            .boxed(),
        ColumnType::Integer => prop_oneof![
            Just(MAX_SAFE),
            Just(-MAX_SAFE),
            Just(0),
            -MAX_SAFE..=MAX_SAFE
        ]
        .prop_map(Value::Int)
        .boxed(),
        ColumnType::Float => float_value().prop_map(Value::Float).boxed(),
        ColumnType::Boolean => any::<bool>().prop_map(Value::Bool).boxed(),
        ColumnType::Bytes | ColumnType::Crdt => bytes_value()
            .prop_map(|b| Value::Bytes(Cow::Owned(b)))
            .boxed(),
    }
}

/// A random layout and a full row for it (NULL only where nullable).
fn layout_and_row() -> impl Strategy<Value = (Layout, Vec<Value<'static>>)> {
    proptest::collection::vec(
        (
            proptest::sample::select(ColumnType::ALL.to_vec()),
            any::<bool>(),
        ),
        1..20,
    )
    .prop_flat_map(|spec| {
        let pk = 0..spec.len();
        let values: Vec<BoxedStrategy<Value<'static>>> = spec
            .iter()
            .map(|&(ty, nullable)| {
                if nullable {
                    prop_oneof![1 => Just(Value::Null), 3 => value_of(ty)].boxed()
                } else {
                    value_of(ty)
                }
            })
            .collect();
        (Just(spec), pk, values)
    })
    .prop_map(|(spec, pk, values)| {
        let columns = spec
            .iter()
            .enumerate()
            .map(|(i, &(ty, nullable))| col(&format!("c{i}"), ty, nullable))
            .collect();
        (
            Layout {
                columns,
                primary_key: pk,
            },
            values,
        )
    })
}

/// What decoding gives back for a value: one leading BOM gone, NaN canonical.
fn expected(value: &Value<'_>) -> Value<'static> {
    match value {
        Value::Text(t) => Value::Text(Cow::Owned(strip_bom(t).to_string())),
        other => other.clone().into_owned(),
    }
}

fn same(a: &Value<'_>, b: &Value<'_>) -> bool {
    match (a, b) {
        (Value::Float(x), Value::Float(y)) => {
            x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())
        }
        _ => a == b,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn full_rows_round_trip((layout, values) in layout_and_row()) {
        let bytes = row::encode_full(&layout, &values).unwrap();
        let decoded = row::decode_full(&layout, &bytes).unwrap();
        for (got, sent) in decoded.iter().zip(&values) {
            prop_assert!(same(got, &expected(sent)), "{got:?} vs {sent:?}");
        }
    }

    #[test]
    fn sparse_rows_round_trip(
        (layout, values) in layout_and_row(),
        mask in proptest::collection::vec(any::<bool>(), 20),
    ) {
        let sparse: Vec<Option<Value>> = values
            .iter()
            .enumerate()
            .map(|(i, v)| (i == layout.primary_key || mask[i]).then(|| v.clone()))
            .collect();
        let bytes = row::encode_sparse(&layout, &sparse).unwrap();
        let decoded = row::decode_sparse(&layout, &bytes).unwrap();
        for (got, sent) in decoded.iter().zip(&sparse) {
            match (got, sent) {
                (None, None) => {}
                (Some(g), Some(s)) => prop_assert!(same(g, &expected(s)), "{g:?} vs {s:?}"),
                _ => prop_assert!(false, "presence differs: {got:?} vs {sent:?}"),
            }
        }
    }

    #[test]
    fn decoders_only_fail_with_documented_messages(
        bytes in proptest::collection::vec(any::<u8>(), 0..96),
        which in 0usize..3,
    ) {
        let layout = [tasks(), nine(), files()][which].clone();
        if let Err(e) = row::decode_full(&layout, &bytes) {
            prop_assert!(documented(&e.0, &layout), "{}", e.0);
        }
        if let Err(e) = row::decode_sparse(&layout, &bytes) {
            prop_assert!(documented(&e.0, &layout), "{}", e.0);
        }
        if let Err(e) = versions::decode(Some(&bytes), layout.columns.len()) {
            prop_assert!(e.0.starts_with("corrupt _sync_column_versions blob: "), "{}", e.0);
        }
    }

    /// Valid payloads with one byte changed reach the value decoders more often.
    #[test]
    fn mutated_payloads_fail_with_documented_messages(
        (layout, values) in layout_and_row(),
        at in any::<usize>(),
        byte in any::<u8>(),
        cut in any::<bool>(),
    ) {
        let mut bytes = row::encode_full(&layout, &values).unwrap();
        let i = at % bytes.len();
        if cut { bytes.truncate(i) } else { bytes[i] = byte }
        if let Err(e) = row::decode_full(&layout, &bytes) {
            prop_assert!(documented(&e.0, &layout), "{}", e.0);
        }
    }

    #[test]
    fn json_and_blob_refs_never_panic(text in "[\\[\\]{}\",:0-9eE.+\\-\\\\u a-z\u{FEFF}\t\n]{0,64}") {
        let _ = json::parses(&text);
        if let Err(e) = json::check_blob_ref(&text) {
            prop_assert!(blob_ref_message(&e.0), "{}", e.0);
        }
    }
}

fn files() -> Layout {
    Layout {
        columns: vec![
            col("id", ColumnType::Integer, false),
            col("file", ColumnType::BlobRef, true),
            col("at", ColumnType::Float, true),
        ],
        primary_key: 0,
    }
}

fn blob_ref_message(message: &str) -> bool {
    const FIXED: [&str; 7] = [
        "blob_ref value does not parse as a JSON document (§5.9.1)",
        "blob_ref value must be a JSON object (§5.9.1)",
        "blob_ref.blobId must be \"sha256:<64 hex>\" (§5.9.1)",
        "blob_ref.byteLength must be a non-negative safe integer (§5.9.1)",
        "blob_ref.mediaType must be a string when present (§5.9.1)",
        "blob_ref.name must be a string when present (§5.9.1)",
        "blob_ref keys are not in canonical order (§5.9.1)",
    ];
    FIXED.contains(&message)
        || (message.starts_with("blob_ref has unknown key \"") && message.ends_with("\" (§5.9.1)"))
}

/// Whether `message` is one of docs/CODEC.md §Messages for this layout.
fn documented(message: &str, layout: &Layout) -> bool {
    let number = |s: &str| {
        !s.is_empty()
            && s.trim_start_matches('-')
                .bytes()
                .all(|b| b.is_ascii_digit())
    };
    let named = |prefix: &str, suffix: &str| {
        message
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix(suffix))
            .is_some_and(|name| layout.columns.iter().any(|c| c.name == name))
    };
    const FIXED: [&str; 7] = [
        "invalid UTF-8 in string",
        "non-zero padding bit in row null bitmap",
        "trailing bytes after row payload",
        "trailing bytes after sparse row payload",
        "sparse row presence bitmap has a set padding bit (non-canonical encoding)",
        "sparse row null bitmap sets a null bit for an absent column",
        "blob_ref value does not parse as a JSON document (§5.9.1)",
    ];
    if FIXED.contains(&message) || blob_ref_message(message) {
        return true;
    }
    if let Some(rest) = message.strip_prefix("truncated input: needed ") {
        return rest
            .split_once(" bytes, have ")
            .is_some_and(|(a, b)| number(a) && number(b));
    }
    if let Some(rest) = message.strip_prefix("i64 outside the safe-integer contract: ") {
        return number(rest);
    }
    if let Some(rest) = message.strip_prefix("invalid bool byte 0x") {
        return !rest.is_empty()
            && rest
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
    }
    named("null bit set for non-nullable column ", "")
        || named("sparse row is missing the primary-key column ", "")
        || named("json column ", " does not parse as a JSON document")
}
