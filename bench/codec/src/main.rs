//! Measures what the push does with the codec per updated row (docs/CODEC.md §Speed): decode a
//! 6-column sparse payload, decode the stored full row, merge, compute the column versions and
//! re-encode the full row. Prints nanoseconds per row; asserts nothing about time.

use std::borrow::Cow;
use std::hint::black_box;
use std::time::Instant;
use syncular_codec_bench::codec::{row, versions, Column, ColumnType, Layout, Value};

fn main() {
    let col = |name: &str, ty, nullable| Column {
        name: name.into(),
        ty,
        nullable,
    };
    let layout = Layout {
        columns: vec![
            col("id", ColumnType::String, false),
            col("project_id", ColumnType::String, false),
            col("title", ColumnType::String, false),
            col("done", ColumnType::Boolean, false),
            col("priority", ColumnType::Integer, true),
            col("meta", ColumnType::Json, true),
        ],
        primary_key: 0,
    };
    let text = |s: &'static str| Value::Text(Cow::Borrowed(s));
    let stored = row::encode_full(
        &layout,
        &[
            text("task-000042"),
            text("project-7"),
            text("write the benchmark section"),
            Value::Bool(false),
            Value::Int(3),
            text(r#"{"tags":["a","b"],"estimate":2.5}"#),
        ],
    )
    .expect("stored row");
    // All six columns present: the heaviest sparse payload of this table.
    let patch = row::encode_sparse(
        &layout,
        &[
            Some(text("task-000042")),
            Some(text("project-7")),
            Some(text("write the benchmark section, v2")),
            Some(Value::Bool(true)),
            Some(Value::Int(300)),
            Some(text(r#"{"tags":["a","b","c"],"estimate":3}"#)),
        ],
    )
    .expect("patch");
    let blob = versions::encode(&[(2, 4), (3, 2)]).expect("blob");

    let per_row = |rounds: u32| {
        let start = Instant::now();
        for _ in 0..rounds {
            let patch = black_box(&patch[..]);
            let decoded = row::decode_sparse(&layout, patch).expect("decode");
            let present = row::present_columns(&decoded);
            let mut merged = row::decode_full(&layout, black_box(&stored[..])).expect("stored");
            row::merge(&mut merged, decoded);
            let pairs = versions::decode(Some(black_box(&blob[..]))).expect("versions");
            let (version, new_blob) =
                versions::after_update(layout.columns.len(), &present, 0, pairs.as_deref(), 5);
            let out = row::encode_full(&layout, &merged).expect("encode");
            black_box((version, new_blob, out));
        }
        start.elapsed().as_nanos() as f64 / f64::from(rounds)
    };
    per_row(200_000); // warm-up
    let runs: Vec<f64> = (0..5).map(|_| per_row(1_000_000)).collect();
    let mut sorted = runs.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "sparse decode + stored decode + merge + versions + full encode, 6 columns: median {:.0} ns/row (runs: {})",
        sorted[2],
        runs.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(", ")
    );
}
