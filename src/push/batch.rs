//! App-row upserts of the one-call push in batches (docs/DESIGN.md §Push path, "Batches").
//!
//! Upstream writes one row per statement. For a table on which no trigger can fire
//! ([`crate::tables::AppRelation::triggerless`]) and rows that occur once in the commit, the
//! same writes in one `INSERT … SELECT FROM unnest(…) ON CONFLICT … DO UPDATE` per table store
//! the same rows: without triggers nothing observes the order of distinct rows, and the unique
//! checks run row by row in operation order as they would statement by statement. What a batch
//! cannot tell is *which* operation a constraint error belongs to, so the push runs again
//! without batches after an error in a batched run (`src/push/one_call.rs`, `push`; not after a cancel,
//! timeout, deadlock or shutdown): the outcome is always the one of upstream's
//! statement-by-statement order.

use crate::codec::{ColumnType, Value as Val};
use pgrx::datum::DatumWithOid;
use serde_json::{Map, Value};

/// The values of one app column across the batch, typed as the projection binds them.
enum Column {
    Text(Vec<Option<String>>),
    Int(Vec<Option<i64>>),
    Float(Vec<Option<f64>>),
    Bool(Vec<Option<bool>>),
    Bytes(Vec<Option<Vec<u8>>>),
}

impl Column {
    fn for_type(ty: ColumnType) -> Column {
        match ty {
            ColumnType::Integer => Column::Int(Vec::new()),
            ColumnType::Float => Column::Float(Vec::new()),
            ColumnType::Boolean => Column::Bool(Vec::new()),
            ColumnType::Bytes | ColumnType::Crdt => Column::Bytes(Vec::new()),
            ColumnType::String | ColumnType::Json | ColumnType::BlobRef => Column::Text(Vec::new()),
        }
    }

    /// The array element type and, for a json column (bound as text), the cast.
    pub fn sql_type(ty: ColumnType) -> (&'static str, Option<&'static str>) {
        match ty {
            ColumnType::Integer => ("int8", None),
            ColumnType::Float => ("float8", None),
            ColumnType::Boolean => ("bool", None),
            ColumnType::Bytes | ColumnType::Crdt => ("bytea", None),
            ColumnType::Json => ("text", Some("jsonb")),
            ColumnType::String | ColumnType::BlobRef => ("text", None),
        }
    }

    /// Appends one value as the single-row projection binds it (docs/CODEC.md §Column types).
    fn push(&mut self, value: &Val<'_>) {
        match (self, value) {
            (Column::Text(c), Val::Text(t)) => c.push(Some(t.to_string())),
            (Column::Text(c), _) => c.push(None),
            (Column::Int(c), Val::Int(i)) => c.push(Some(*i)),
            (Column::Int(c), _) => c.push(None),
            // upstream's driver sends String(n), so −0 arrives as 0 (docs/CODEC.md).
            (Column::Float(c), Val::Float(f)) => c.push(Some(if *f == 0.0 { 0.0 } else { *f })),
            (Column::Float(c), _) => c.push(None),
            (Column::Bool(c), Val::Bool(b)) => c.push(Some(*b)),
            (Column::Bool(c), _) => c.push(None),
            (Column::Bytes(c), Val::Bytes(b)) => c.push(Some(b.to_vec())),
            (Column::Bytes(c), _) => c.push(None),
        }
    }

    fn datum(self) -> DatumWithOid<'static> {
        match self {
            Column::Text(c) => DatumWithOid::from(c),
            Column::Int(c) => DatumWithOid::from(c),
            Column::Float(c) => DatumWithOid::from(c),
            Column::Bool(c) => DatumWithOid::from(c),
            Column::Bytes(c) => DatumWithOid::from(c),
        }
    }
}

/// The pending upserts of one table, in operation order.
pub struct Batch {
    row_ids: Vec<String>,
    versions: Vec<i64>,
    scopes: Vec<String>,
    payloads: Vec<Vec<u8>>,
    column_versions: Vec<Option<Vec<u8>>>,
    columns: Vec<Column>,
    /// Bytes held, about (ids, payloads, column versions, scopes).
    bytes: usize,
}

/// When a batch is written before the end of the run: its rows, or bytes, reach these. A commit
/// of 100,000 operations would otherwise hold every row's copy and build arrays of all of them
/// (docs/DESIGN.md §Memory); a batch this large gains nothing more from being larger.
const BATCH_ROWS: usize = 1_000;
const BATCH_BYTES: usize = 16 << 20;

impl Batch {
    /// A batch for the app columns of `types` (none for a table that is not materialized).
    pub fn new(types: &[ColumnType]) -> Batch {
        Batch {
            row_ids: Vec::new(),
            versions: Vec::new(),
            scopes: Vec::new(),
            payloads: Vec::new(),
            column_versions: Vec::new(),
            columns: types.iter().map(|t| Column::for_type(*t)).collect(),
            bytes: 0,
        }
    }

    /// Whether the batch should be written now ([`BATCH_ROWS`], [`BATCH_BYTES`]).
    pub fn is_full(&self) -> bool {
        self.row_ids.len() >= BATCH_ROWS || self.bytes >= BATCH_BYTES
    }

    /// Whether the values can travel in arrays: a text holding U+0000 cannot (PostgreSQL's
    /// text refuses it), so its row takes the single-row statement, which raises the error.
    pub fn accepts(values: &[Val<'_>]) -> bool {
        !values
            .iter()
            .any(|v| matches!(v, Val::Text(t) if t.contains('\0')))
    }

    pub fn push(
        &mut self,
        row_id: &str,
        version: i64,
        scopes: &Map<String, Value>,
        payload: &[u8],
        column_versions: Option<&[u8]>,
        values: &[Val<'_>],
    ) {
        self.bytes += row_id.len() + payload.len() + column_versions.map_or(0, <[u8]>::len);
        self.row_ids.push(row_id.to_string());
        self.versions.push(version);
        self.scopes.push(Value::Object(scopes.clone()).to_string());
        self.payloads.push(payload.to_vec());
        self.column_versions
            .push(column_versions.map(<[u8]>::to_vec));
        for (column, value) in self.columns.iter_mut().zip(values) {
            column.push(value);
        }
    }

    /// The arguments of [`crate::tables::AppRelation::upsert_rows_sql`].
    pub fn args(self, partition: &str) -> Vec<DatumWithOid<'_>> {
        let mut args = vec![
            DatumWithOid::from(partition),
            DatumWithOid::from(self.row_ids),
            DatumWithOid::from(self.versions),
            DatumWithOid::from(self.scopes),
            DatumWithOid::from(self.payloads),
            DatumWithOid::from(self.column_versions),
        ];
        args.extend(self.columns.into_iter().map(Column::datum));
        args
    }
}

/// The element type and cast of an app column in a batch.
pub fn sql_type(ty: ColumnType) -> (&'static str, Option<&'static str>) {
    Column::sql_type(ty)
}
