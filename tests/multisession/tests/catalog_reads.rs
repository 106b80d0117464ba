//! What a host can read about the extension's own state with the serving role: its table
//! registrations and the stored schema (docs/API.md, `list_tables`, `schema_state`).

use serde_json::{json, Value};
use syncular_multisession::*;

#[test]
fn the_serving_role_lists_registrations_and_reads_the_stored_schema() {
    let db = TestDb::new("catalog_reads");
    let mut c = db.connect();
    let role = format!("{}_srv", db.name);
    exec(
        &mut c,
        &format!("CREATE ROLE {role} NOLOGIN; GRANT syncular_host TO {role}"),
    );
    exec(&mut c, &format!("SET ROLE {role}"));
    let state: Option<Value> = one(&mut c, "SELECT syncular.schema_state()", &[]);
    assert_eq!(state, None, "no migration yet");
    exec(&mut c, "RESET ROLE");
    migrate(&mut c, 1, &l1(), &json!([]));
    exec(
        &mut c,
        "CREATE TABLE public.gone (LIKE public.docs INCLUDING ALL)",
    );
    exec(
        &mut c,
        "SELECT syncular.register_table('gone', 'public.gone', true)",
    );
    exec(&mut c, "DROP TABLE public.gone");
    exec(&mut c, &format!("SET ROLE {role}"));
    let state: Value = one(&mut c, "SELECT syncular.schema_state()", &[]);
    assert_eq!(
        state,
        json!({"schemaVersion": 1, "layouts": l1(), "writerFloor": 1})
    );
    let tables: Value = one(&mut c, "SELECT syncular.list_tables()", &[]);
    let summary: Vec<(String, Value, Value, Value)> = tables
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["table"].as_str().unwrap().to_string(),
                t["relation"].clone(),
                t["registeredBy"].clone(),
                t["maintainRowMeta"].clone(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            (
                "docs".into(),
                json!("public.docs"),
                json!("postgres"),
                json!(false)
            ),
            ("gone".into(), Value::Null, json!("postgres"), json!(true)),
            (
                "tasks".into(),
                json!("public.tasks"),
                json!("postgres"),
                json!(false)
            ),
        ]
    );
}
