//! The row codec and the push schema over SQL (docs/CODEC.md, docs/API.md §Row codec and push
//! schema): set_push_schema accepted, idempotent and every refusal; encode_row/decode_row round
//! trips on the registered fixture tables and the worked examples' bytes.

use postgres::Client;
use serde_json::{json, Value};
use syncular_multisession::*;

/// The push schema of the fixtures: `tasks` and `docs` as registered, matching `l1()`, plus
/// upstream's `tasks` test shape under another name (not registered: accepted, and the worked
/// examples' layout).
fn schema() -> Value {
    json!({
        "tasks": {"columns": l1()["tasks"], "primaryKey": "id",
                  "scopes": [{"variable": "project_id", "column": "project_id"}]},
        "docs": {"columns": l1()["docs"], "primaryKey": "id",
                 "scopes": [{"variable": "projectId", "column": "project_id"}]},
        "utasks": {"columns": [
            {"name":"id","type":"string","nullable":false},
            {"name":"project_id","type":"string","nullable":false},
            {"name":"title","type":"string","nullable":false},
            {"name":"done","type":"boolean","nullable":false},
            {"name":"priority","type":"integer","nullable":true},
            {"name":"meta","type":"json","nullable":true}],
            "primaryKey": "id", "scopes": [{"variable": "project_id", "column": "project_id"}],
            "materialize": false},
    })
}

fn set(c: &mut Client, version: i64, tables: &Value) -> Result<i32, postgres::Error> {
    try_one(
        c,
        "SELECT syncular.set_push_schema($1, $2)",
        &[&version, tables],
    )
}

fn refused(c: &mut Client, version: i64, tables: &Value, argument: &str, reason: &str) -> SqlError {
    expect_error(
        set(c, version, tables),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument": argument, "reason": reason})),
    )
}

#[test]
fn set_push_schema_is_accepted_and_idempotent() {
    let db = TestDb::new("codec_accept");
    let mut c = db.connect();
    assert_eq!(set(&mut c, 1, &schema()).unwrap(), 3);
    assert_eq!(set(&mut c, 1, &schema()).unwrap(), 3);
    assert_eq!(count(&mut c, "syncular.sync_push_schemas"), 1);
    // Normalized: defaults filled in, the descriptor as checked.
    let stored: Value = one(
        &mut c,
        "SELECT tables -> 'tasks' FROM syncular.sync_push_schemas WHERE schema_version = 1",
        &[],
    );
    assert_eq!(stored["materialize"], json!(true));
    assert_eq!(stored["references"], json!([]));
    // With the marker at version 2 and a push schema matching its layouts, still accepted.
    let mut with_layouts = schema();
    with_layouts.as_object_mut().unwrap().remove("utasks");
    assert_eq!(set(&mut c, 2, &with_layouts).unwrap(), 2);
    migrate(&mut c, 2, &l1(), &json!([]));
    assert_eq!(set(&mut c, 2, &with_layouts).unwrap(), 2);
    // A version ahead is stored next to them.
    assert_eq!(set(&mut c, 3, &schema()).unwrap(), 3);
    assert_eq!(count(&mut c, "syncular.sync_push_schemas"), 3);
}

/// Every synced table declares a scope pattern (upstream's §3.1 rule): a table without one was
/// stored, pushed and never pulled (issue 27, item 2). A schema stored before the rule still
/// reads back: only its declaration is refused.
#[test]
fn set_push_schema_refuses_a_table_without_scopes() {
    let db = TestDb::new("codec_unscoped");
    let mut c = db.connect();
    let mut empty = schema();
    empty["utasks"]["scopes"] = json!([]);
    let err = refused(&mut c, 1, &empty, "tables.utasks.scopes", "empty");
    let hint = err.hint.unwrap_or_default();
    assert!(hint.contains("at least one scope pattern"), "{hint}");
    assert!(hint.contains(r#"{"app_id": ["*"]}"#), "{hint}");
    let mut missing = schema();
    missing["docs"].as_object_mut().unwrap().remove("scopes");
    refused(&mut c, 1, &missing, "tables.docs.scopes", "missing");
    assert_eq!(count(&mut c, "syncular.sync_push_schemas"), 0);
    // Stored by an earlier version (no check then): encode_row and decode_row still read it.
    exec(
        &mut c,
        &format!(
            "INSERT INTO syncular.sync_push_schemas (schema_version, tables, updated_at_ms)
             VALUES (1, '{}', 0)",
            missing
        ),
    );
    let payload: Vec<u8> = one(
        &mut c,
        "SELECT syncular.encode_row('docs', '{\"id\":\"d1\",\"org_id\":\"o\",\"project_id\":\"p\"}')",
        &[],
    );
    let back: Value = one(
        &mut c,
        "SELECT syncular.decode_row('docs', $1)",
        &[&payload],
    );
    assert_eq!(back, json!({"id":"d1","org_id":"o","project_id":"p"}));
}

#[test]
fn set_push_schema_refuses_what_disagrees() {
    let db = TestDb::new("codec_refuse");
    let mut c = db.connect();
    let with = |path: &str, value: Value| {
        let mut s = schema();
        *s.pointer_mut(path).unwrap() = value;
        s
    };
    refused(&mut c, 0, &schema(), "schema_version", "range");
    refused(&mut c, 1, &json!([]), "tables", "type");
    refused(
        &mut c,
        1,
        &json!({"sync_x": {}}),
        "tables.sync_x",
        "reserved",
    );
    refused(
        &mut c,
        1,
        &with("/tasks/columns/0/type", json!("text")),
        "tables.tasks.columns[0].type",
        "shape",
    );
    refused(
        &mut c,
        1,
        &with("/tasks/primaryKey", json!("nope")),
        "tables.tasks.primaryKey",
        "shape",
    );
    refused(
        &mut c,
        1,
        &with("/tasks/columns/1/name", json!("_sync_scopes")),
        "tables.tasks.columns[1].name",
        "reserved",
    );
    // Disagreement with the registered relation: a type, a missing column, nullability.
    let err = refused(
        &mut c,
        1,
        &with("/tasks/columns/2/type", json!("string")),
        "tables.tasks.columns[2]",
        "mismatch",
    );
    assert_eq!(
        err.hint.as_deref(),
        Some("table tasks, column data: string needs text in the relation, found bytea")
    );
    let err = refused(
        &mut c,
        1,
        &with("/tasks/columns/2/name", json!("blob")),
        "tables.tasks.columns[2]",
        "mismatch",
    );
    assert_eq!(
        err.hint.as_deref(),
        Some("table tasks: relation public.tasks has no column blob")
    );
    exec(
        &mut c,
        "ALTER TABLE public.docs ALTER COLUMN org_id SET NOT NULL",
    );
    let err = refused(
        &mut c,
        1,
        &with("/docs/columns/1/nullable", json!(true)),
        "tables.docs.columns[1]",
        "mismatch",
    );
    assert!(err.hint.unwrap().contains("NOT NULL in the relation"));
    // Not materialized: the app columns are not compared. (At a version of its own: a version's
    // column lists never change once stored.)
    let mut bare = with("/tasks/columns/2/type", json!("string"));
    bare["tasks"]["materialize"] = json!(false);
    assert_eq!(set(&mut c, 1, &bare).unwrap(), 3);
    // A registration that no longer fits is refused with its reason.
    exec(
        &mut c,
        "ALTER TABLE public.docs ALTER COLUMN \"_sync_payload\" TYPE text",
    );
    let err = refused(&mut c, 1, &schema(), "tables.docs", "mismatch");
    assert!(
        err.hint.unwrap().contains("_sync_payload"),
        "hint names the meta column"
    );
    exec(&mut c, "ALTER TABLE public.docs ALTER COLUMN \"_sync_payload\" TYPE bytea USING \"_sync_payload\"::bytea");

    // Disagreement with the layouts stored by migrate_schema at that version (none stored for
    // it before: a push schema stored ahead must match them whole, or the migration refuses).
    migrate(&mut c, 2, &l1(), &json!([]));
    let err = refused(&mut c, 2, &schema(), "tables.utasks", "mismatch");
    assert!(err
        .hint
        .unwrap()
        .contains("table utasks is not in the stored layouts"));
    let mut two = schema();
    two.as_object_mut().unwrap().remove("utasks");
    let mut swapped = two.clone();
    swapped["docs"]["columns"] = json!([l1()["docs"][1], l1()["docs"][0], l1()["docs"][2]]);
    refused(&mut c, 2, &swapped, "tables.docs.columns[0]", "mismatch");
    let mut fewer = two.clone();
    fewer.as_object_mut().unwrap().remove("docs");
    let err = refused(&mut c, 2, &fewer, "tables", "mismatch");
    assert!(err.hint.unwrap().contains("stored table docs is missing"));
    assert_eq!(set(&mut c, 2, &two).unwrap(), 2);
    // Stored, its columns stay: leaving a table out is refused by the stored push schema too.
    let err = refused(&mut c, 2, &fewer, "tables.docs", "mismatch");
    assert!(err.hint.unwrap().contains("which this one leaves out"));
    // A version ahead of the stored one is not compared with the marker's layouts.
    assert_eq!(set(&mut c, 3, &schema()).unwrap(), 3);
}

fn encode(
    c: &mut Client,
    tbl: &str,
    values: &Value,
    sparse: bool,
) -> Result<Vec<u8>, postgres::Error> {
    try_one(
        c,
        "SELECT syncular.encode_row($1, $2, $3)",
        &[&tbl, values, &sparse],
    )
}

fn decode(
    c: &mut Client,
    tbl: &str,
    payload: &[u8],
    sparse: bool,
) -> Result<Value, postgres::Error> {
    try_one(
        c,
        "SELECT syncular.decode_row($1, $2, $3)",
        &[&tbl, &payload, &sparse],
    )
}

fn hex(text: &str) -> Vec<u8> {
    let digits: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
    digits
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
        .collect()
}

#[test]
fn encode_and_decode_round_trip_on_registered_tables() {
    let db = TestDb::new("codec_rows");
    let mut c = db.connect();
    expect_error(
        encode(&mut c, "tasks", &json!({"id": "t1"}), true),
        "SY041",
        "sync.storage.unknown_table",
        Some(json!({"table": "tasks"})),
    );
    set(&mut c, 1, &schema()).unwrap();
    let row = json!({"id": "t1", "project_id": "p1", "data": "AAEC/w=="});
    let full = encode(&mut c, "tasks", &row, false).unwrap();
    assert_eq!(
        full,
        hex("00 | 02000000 7431 | 02000000 7031 | 04000000 000102FF")
    );
    assert_eq!(decode(&mut c, "tasks", &full, false).unwrap(), row);
    let patch = encode(&mut c, "tasks", &json!({"id": "t1", "data": null}), true).unwrap();
    assert_eq!(patch, hex("05 02 | 02000000 7431"));
    assert_eq!(
        decode(&mut c, "tasks", &patch, true).unwrap(),
        json!({"id": "t1", "data": null})
    );
    // The worked examples' bytes (E1 sparse and stored; E3's patch).
    let e1 = json!({"id":"t1","project_id":"p1","title":"task","done":false,"priority":null,"meta":null});
    let e1_sparse =
        hex("3F 30 | 02 00 00 00 74 31 | 02 00 00 00 70 31 | 04 00 00 00 74 61 73 6B | 00");
    let e1_stored =
        hex("30 | 02 00 00 00 74 31 | 02 00 00 00 70 31 | 04 00 00 00 74 61 73 6B | 00");
    assert_eq!(encode(&mut c, "utasks", &e1, true).unwrap(), e1_sparse);
    assert_eq!(encode(&mut c, "utasks", &e1, false).unwrap(), e1_stored);
    assert_eq!(decode(&mut c, "utasks", &e1_sparse, true).unwrap(), e1);
    let e3 = json!({"id": "t1", "done": true, "priority": 300});
    assert_eq!(
        encode(&mut c, "utasks", &e3, true).unwrap(),
        hex("19 00 | 02 00 00 00 74 31 | 01 | 2C 01 00 00 00 00 00 00")
    );
    // json keeps its raw text; a BOM is stripped on decode.
    let raw = json!({"id": "t1", "meta": "{\"k\": [1, 2.50]}"});
    let bytes = encode(&mut c, "utasks", &raw, true).unwrap();
    assert_eq!(decode(&mut c, "utasks", &bytes, true).unwrap(), raw);
    let bom = encode(
        &mut c,
        "utasks",
        &json!({"id": "t1", "title": "\u{FEFF}a"}),
        true,
    )
    .unwrap();
    assert_eq!(
        decode(&mut c, "utasks", &bom, true).unwrap(),
        json!({"id": "t1", "title": "a"})
    );
}

#[test]
fn bad_rows_are_refused_with_the_codec_message() {
    let db = TestDb::new("codec_bad");
    let mut c = db.connect();
    set(&mut c, 1, &schema()).unwrap();
    let bad =
        |c: &mut Client, result: Result<Value, postgres::Error>, argument: &str, reason: &str| {
            expect_error(
                result.map(|_| ()),
                "SY000",
                "sync.storage.invalid_argument",
                Some(json!({"argument": argument, "reason": reason})),
            );
            let _ = c;
        };
    // E5 of docs/CODEC.md, on upstream's tasks shape.
    for (payload, message) in [
        (
            "FF 01",
            "sparse row presence bitmap has a set padding bit (non-canonical encoding)",
        ),
        (
            "01 00 03 00 00 00 74 31",
            "truncated input: needed 3 bytes, have 2",
        ),
        (
            "02 00 02 00 00 00 74 31",
            "sparse row is missing the primary-key column id",
        ),
        (
            "01 02 02 00 00 00 74 31",
            "sparse row null bitmap sets a null bit for an absent column",
        ),
        ("01 01", "null bit set for non-nullable column id"),
        (
            "01 00 02 00 00 00 74 31 FF",
            "trailing bytes after sparse row payload",
        ),
    ] {
        let r = decode(&mut c, "utasks", &hex(payload), true);
        bad(&mut c, r, "payload", message);
    }
    let r = decode(&mut c, "utasks", &hex("01"), false);
    bad(
        &mut c,
        r,
        "payload",
        "null bit set for non-nullable column id",
    );
    let r = encode(&mut c, "utasks", &json!({"id": "t1", "meta": "{"}), true).map(|_| json!(null));
    bad(
        &mut c,
        r,
        "values",
        "json column meta does not parse as a JSON document",
    );
    let r = encode(&mut c, "utasks", &json!({"id": null}), true).map(|_| json!(null));
    bad(&mut c, r, "values", "column id is not nullable");
    let r = encode(&mut c, "utasks", &json!({"title": "x"}), true).map(|_| json!(null));
    bad(
        &mut c,
        r,
        "values",
        "sparse row is missing the primary-key column id",
    );
    let r = encode(
        &mut c,
        "utasks",
        &json!({"id": "t1", "priority": 1.5}),
        true,
    )
    .map(|_| json!(null));
    bad(
        &mut c,
        r,
        "values",
        "column priority (integer) requires a safe integer value",
    );
    let r = encode(&mut c, "utasks", &json!({"id": "t1", "nope": 1}), true).map(|_| json!(null));
    bad(&mut c, r, "values", "shape");
    let r = encode(&mut c, "utasks", &json!({"id": "t1"}), false).map(|_| json!(null));
    bad(&mut c, r, "values", "missing");
    let r = encode(&mut c, "tasks", &json!({"id": "t1", "data": "***"}), true).map(|_| json!(null));
    bad(&mut c, r, "values", "base64");
    // A NUL in a string decodes, but jsonb cannot hold it.
    let r = decode(
        &mut c,
        "utasks",
        &hex("05 00 | 02000000 7431 | 01000000 00"),
        true,
    );
    bad(&mut c, r, "payload", "range");
    expect_error(
        decode(&mut c, "nope", &[1], true),
        "SY041",
        "sync.storage.unknown_table",
        Some(json!({"table": "nope"})),
    );
}

/// The serving role encodes and decodes; only the admin role stores a push schema.
#[test]
fn the_host_role_codes_rows_and_the_admin_role_sets_the_schema() {
    let db = TestDb::new("codec_roles");
    let mut c = db.connect();
    let executable = |c: &mut Client, role: &str, signature: &str| -> bool {
        one(
            c,
            "SELECT has_function_privilege($1, $2, 'EXECUTE')",
            &[&role, &signature],
        )
    };
    for signature in [
        "syncular.encode_row(text, jsonb, boolean, bigint)",
        "syncular.decode_row(text, bytea, boolean, bigint)",
    ] {
        assert!(
            executable(&mut c, "syncular_host", signature),
            "{signature}"
        );
    }
    let set_schema = "syncular.set_push_schema(bigint, jsonb)";
    assert!(!executable(&mut c, "syncular_host", set_schema));
    assert!(executable(&mut c, "syncular_admin", set_schema));
    // A host role without any table privilege uses the stored schema.
    set(&mut c, 1, &schema()).unwrap();
    let role = format!("{}_srv", db.name);
    exec(
        &mut c,
        &format!("CREATE ROLE {role} NOLOGIN; GRANT syncular_host TO {role}"),
    );
    exec(&mut c, &format!("SET ROLE {role}"));
    let bytes = encode(&mut c, "tasks", &json!({"id": "t1"}), true).unwrap();
    assert_eq!(
        decode(&mut c, "tasks", &bytes, true).unwrap(),
        json!({"id": "t1"})
    );
    exec(
        &mut c,
        &format!("RESET ROLE; DROP OWNED BY {role}; DROP ROLE {role}"),
    );
}
