//! Security properties of the installed API: pinned search_path, comments, no PUBLIC execute,
//! definer/invoker split, and a least-privilege host role.

use serde_json::json;
use syncular_multisession::*;

/// Functions that run as the caller on purpose: they check the caller's privileges (ownership,
/// the registrant's rights, SELECT on an app table, operator) and switch rights themselves, are
/// internal helpers of the fence guard, or read nothing at all (the stamp table's own trigger)
/// (docs/SECURITY.md).
const INVOKER: &[&str] = &[
    "_fence_guard_busy",
    "_payload_check",
    "_payload_rewrite",
    "_fence_guard_hold",
    "_grant_api_roles",
    "_native_fence_triggers",
    "adopt_legacy_tables",
    "distribute",
    "feed_status",
    "get_row_scopes",
    "migrate_schema",
    "push_commit",
    "push_finish",
    "register_table",
    "repair_schema_marker",
    "repair_writer_fence",
    "retire_table",
    "rows_referencing_blob",
    "scan_rows",
    "schema_stamp_own",
    "pull",
];

#[test]
fn every_function_pins_search_path_is_commented_and_not_public() {
    let db = TestDb::new("privfuncs");
    let mut c = db.connect();
    let rows = c
        .query(
            "SELECT p.proname::text, p.prosecdef, coalesce(p.proconfig, '{}'),
                    obj_description(p.oid, 'pg_proc') IS NOT NULL,
                    has_function_privilege('public', p.oid, 'EXECUTE')
               FROM pg_proc p WHERE p.pronamespace = 'syncular'::regnamespace ORDER BY 1",
            &[],
        )
        .unwrap();
    assert!(rows.len() >= 70, "{} functions", rows.len());
    for r in rows {
        let name: String = r.get(0);
        let definer: bool = r.get(1);
        let config: Vec<String> = r.get(2);
        assert!(
            config.contains(&"search_path=pg_catalog, pg_temp".to_string()),
            "{name}: {config:?}"
        );
        assert!(r.get::<_, bool>(3), "{name} has no COMMENT");
        assert!(!r.get::<_, bool>(4), "{name} is executable by PUBLIC");
        assert_eq!(
            definer,
            !INVOKER.contains(&name.as_str()),
            "{name}: SECURITY DEFINER = {definer}"
        );
    }
}

/// `_payload_rewrite` and `_payload_check`, a migration's calls on a Citus shard
/// (src/schema/shards.rs), answer only a role that reads the whole table, and never on one node,
/// where no shard is: a member of `syncular_admin` without `SELECT` on the table is
/// `not_readable`; with it, `SY004` `citus_local_execution`; malformed layouts, `shape` —
/// nothing of the table's rows is read or written.
#[test]
fn the_shard_calls_answer_only_a_whole_table_reader_and_never_on_one_node() {
    let db = TestDb::new("privdigest");
    let mut c = db.connect();
    let role = format!("{}_mig", db.name);
    exec(
        &mut c,
        &format!("CREATE ROLE {role}; GRANT syncular_admin TO {role}; SET ROLE {role}"),
    );
    let layouts = json!({"table": "tasks", "from": 1, "to": 2,
                         "old": [{"name": "id", "type": "string", "nullable": false}],
                         "new": [{"name": "id", "type": "string", "nullable": false},
                                 {"name": "n", "type": "integer", "nullable": true}]});
    let rewrite = "SELECT syncular._payload_rewrite('part-1', 'tasks', $1::text::jsonb)";
    let check = "SELECT syncular._payload_check('part-1', 'tasks')";
    let calls =
        |c: &mut postgres::Client, state: &str, message: &str, detail: serde_json::Value| {
            expect_error(
                c.query_one(rewrite, &[&layouts.to_string()]),
                state,
                message,
                Some(detail.clone()),
            );
            expect_error(c.query_one(check, &[]), state, message, Some(detail));
        };
    calls(
        &mut c,
        "SY000",
        "sync.storage.invalid_argument",
        json!({"argument": "tbl", "reason": "not_readable"}),
    );
    exec(&mut c, "RESET ROLE");
    exec(
        &mut c,
        &format!("GRANT SELECT ON public.tasks TO {role}; SET ROLE {role}"),
    );
    calls(
        &mut c,
        "SY004",
        "sync.storage.invalid_transaction_state",
        json!({"reason": "citus_local_execution"}),
    );
    let mut other_table = layouts.clone();
    other_table["table"] = json!("notes");
    for bad in [
        json!({}),
        json!([1]),
        other_table,
        json!({"table": "tasks", "from": 1, "to": 2,
                "old": [{"name": "id", "type": "nope"}], "new": []}),
    ] {
        let err = c.query_one(rewrite, &[&bad.to_string()]).unwrap_err();
        let err = sql_error(&err);
        assert_eq!(err.state, "SY000", "{bad}: {err:?}");
    }
    exec(&mut c, "RESET ROLE");
    exec(&mut c, &format!("DROP OWNED BY {role}; DROP ROLE {role}"));
}

#[test]
fn a_least_privilege_host_role_uses_the_api_but_cannot_touch_tables() {
    let db = TestDb::new("privrole");
    let mut c = db.connect();
    let role = format!("{}_api", db.name);
    exec(
        &mut c,
        &format!(
            "CREATE ROLE {role};
             GRANT syncular_admin TO {role};
             GRANT ALL ON public.tasks TO {role};"
        ),
    );
    one::<i64>(&mut c, "SELECT syncular.raise_writer_fence($1, 2)", &[&P]);
    exec(&mut c, &format!("SET ROLE {role}"));
    assert_eq!(append(&mut c, P, "tasks", "t1", Some(2)), 1);
    put_row(&mut c, P, "tasks", "t1", &p1(), 1, &[1]);
    assert_eq!(
        scan_ids(&mut c, P, "tasks", &json!({"project_id":["p1"]}), None, 10),
        vec!["t1"]
    );
    let denied = |c: &mut postgres::Client, sql: &str| {
        let err = sql_error(&c.batch_execute(sql).unwrap_err());
        assert_eq!(err.state, "42501", "{sql}: {err:?}");
    };
    denied(
        &mut c,
        "INSERT INTO syncular.sync_commits VALUES ('part-1', 2, 'c', 'k', 'a', 1, 2)",
    );
    denied(
        &mut c,
        "UPDATE syncular.sync_writer_fence SET required_writer_version = 0",
    );
    denied(&mut c, "DELETE FROM syncular.sync_writer_fence");
    denied(
        &mut c,
        "UPDATE syncular.sync_partitions SET max_commit_seq = 0",
    );
    // Through the API a fence can only go up.
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.raise_writer_fence($1, 1)", &[&P]),
        2
    );
    // register_table checks ownership of the relation as the caller.
    expect_error(
        c.execute(
            "SELECT syncular.register_table('tasks', 'public.tasks')",
            &[],
        ),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument":"relation","reason":"privilege"})),
    );
    exec(&mut c, "RESET ROLE");
    exec(&mut c, &format!("DROP OWNED BY {role}; DROP ROLE {role}"));
}

#[test]
fn an_owner_registers_its_own_table_without_table_privileges_on_sync() {
    let db = TestDb::new("privowner");
    let mut c = db.connect();
    let role = format!("{}_owner", db.name);
    exec(
        &mut c,
        &format!(
            "CREATE ROLE {role};
             GRANT USAGE, CREATE ON SCHEMA public TO {role};
             GRANT syncular_admin TO {role};
             SET ROLE {role};
             CREATE TABLE public.notes (
               \"_sync_partition\" text NOT NULL, \"_sync_row_id\" text NOT NULL,
               \"_sync_server_version\" bigint NOT NULL, \"_sync_scopes\" jsonb NOT NULL,
               \"_sync_payload\" bytea NOT NULL, \"_sync_column_versions\" bytea,
               PRIMARY KEY (\"_sync_partition\", \"_sync_row_id\"));
             SELECT syncular.register_table('notes', 'public.notes', true);
             INSERT INTO public.notes VALUES ('part-1', 'n1', 1, '{{\"project_id\":\"p1\"}}', '\\x01');"
        ),
    );
    exec(&mut c, "RESET ROLE");
    assert_eq!(
        count(
            &mut c,
            "syncular.sync_row_scopes WHERE tbl = 'notes' AND row_id = 'n1'"
        ),
        1
    );
    exec(
        &mut c,
        &format!("SET ROLE {role}; SELECT syncular.retire_table('notes'); RESET ROLE"),
    );
    assert_eq!(
        count(&mut c, "syncular.sync_app_tables WHERE tbl = 'notes'"),
        0
    );
    exec(&mut c, &format!("DROP OWNED BY {role}; DROP ROLE {role}"));
}

/// Bad input to every function: NULL for every argument is a coded refusal (never a silent NULL,
/// never an internal error) and writes nothing.
#[test]
fn every_function_refuses_null_arguments_with_a_code() {
    let db = TestDb::new("privnulls");
    let mut c = db.connect();
    let functions: Vec<(String, String)> = c
        .query(
            "SELECT p.proname::text,
                    string_agg('NULL::' || format_type(t.typ, NULL), ', ' ORDER BY t.ord)
               FROM pg_proc p
               CROSS JOIN LATERAL unnest(p.proargtypes::oid[]) WITH ORDINALITY AS t(typ, ord)
              WHERE p.pronamespace = 'syncular'::regnamespace AND p.proname NOT LIKE '\\_%'
                AND p.prorettype NOT IN ('trigger'::regtype, 'event_trigger'::regtype)
              GROUP BY p.oid, p.proname ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(
        functions.len() >= 60,
        "{} functions with arguments",
        functions.len()
    );
    for (name, nulls) in functions {
        // Inside a transaction block, so the transaction-state checks pass and argument
        // validation is what refuses.
        exec(&mut c, "BEGIN");
        let result = c.query(&format!("SELECT * FROM syncular.{name}({nulls})"), &[]);
        let err = match result {
            Ok(rows) => panic!(
                "{name}({nulls}) returned {} rows instead of refusing",
                rows.len()
            ),
            Err(e) => sql_error(&e),
        };
        exec(&mut c, "ROLLBACK");
        let expected = if name == "prune_commits_through" {
            "SY000|SY032"
        } else {
            "SY000"
        };
        assert!(
            expected.split('|').any(|s| s == err.state),
            "{name}: {err:?}"
        );
    }
    assert_eq!(count(&mut c, "syncular.sync_partitions"), 0);
}
