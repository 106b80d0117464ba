//! Attacks by a role holding only the host grant (docs/SECURITY.md): each one reproduced as an
//! attacker would run it, and each must fail with nothing written and nobody escalated.
//!
//! The attacker owns a schema and tables of its own and is a member of `syncular_admin` (which
//! includes `syncular_host`): the most a deployment hands an application role. Its tools are
//! its own views, rules, types, casts, policies and functions; the prize is running one of them
//! with the extension owner's (a superuser's) rights.

use postgres::Client;
use serde_json::{json, Value};
use syncular_multisession::*;

/// A role with the admin grant, its own schema `<role>` and a registered app table
/// `<role>.t` (logical name `<role>_t`), holding one row `r1` in partition `P`.
struct Attacker {
    role: String,
    tbl: String,
}

impl Attacker {
    fn new(c: &mut Client, db: &TestDb, suffix: &str) -> Attacker {
        let role = format!("{}_{suffix}", db.name);
        exec(
            c,
            &format!(
                "CREATE ROLE {role} NOLOGIN;
                 GRANT syncular_admin TO {role};
                 CREATE SCHEMA {role} AUTHORIZATION {role};"
            ),
        );
        let attacker = Attacker {
            tbl: format!("{role}_t"),
            role,
        };
        attacker.act(c);
        exec(c, &app_table_sql(&format!("{}.t", attacker.role), ""));
        exec(
            c,
            &format!(
                r#"SELECT syncular.register_table('{t}', '{r}.t');
                   INSERT INTO {r}.t VALUES ('{P}', 'r1', 1, '{{"project_id":"p1"}}', '\x01', NULL);
                   SELECT syncular.set_row_scopes('{P}', '{t}', 'r1', '{{"project_id":"p1"}}');
                   SELECT syncular.set_blob_refs('{P}', '{t}', 'r1', ARRAY['blob-1']);"#,
                r = attacker.role,
                t = attacker.tbl
            ),
        );
        attacker.leave(c);
        attacker
    }

    fn act(&self, c: &mut Client) {
        exec(c, &format!("SET ROLE {}", self.role));
    }

    fn leave(&self, c: &mut Client) {
        exec(c, "RESET ROLE");
    }

    /// A function of the attacker's that makes it superuser when run with enough rights, and
    /// otherwise says whose rights it ran with.
    fn plant_payload(&self, c: &mut Client) {
        self.act(c);
        exec(
            c,
            &format!(
                "CREATE FUNCTION {r}.pwn() RETURNS text LANGUAGE plpgsql VOLATILE AS $$
                 BEGIN
                   BEGIN
                     ALTER ROLE {r} SUPERUSER;
                   EXCEPTION WHEN insufficient_privilege THEN NULL;
                   END;
                   RAISE EXCEPTION 'ran as %', current_user;
                 END $$;",
                r = self.role
            ),
        );
        self.leave(c);
    }

    /// Runs `sql` as the attacker, `{r}` standing for its schema (and role).
    fn run(&self, c: &mut Client, sql: &str) {
        self.act(c);
        exec(c, &sql.replace("{r}", &self.role));
        self.leave(c);
    }

    /// The attacker's relation, as it is now, cannot be registered again (`shape`).
    fn refused_registration(&self, c: &mut Client) {
        self.act(c);
        invalid(
            c,
            &format!(
                "SELECT syncular.register_table('{r}_again', '{r}.t')",
                r = self.role
            ),
            "relation",
            "shape",
        );
        self.leave(c);
    }

    fn is_superuser(&self, c: &mut Client) -> bool {
        one(
            c,
            "SELECT rolsuper FROM pg_roles WHERE rolname = $1",
            &[&self.role],
        )
    }
}

/// `sql` is refused with `sync.storage.invalid_argument` and exactly this DETAIL.
#[track_caller]
fn invalid(c: &mut Client, sql: &str, argument: &str, reason: &str) {
    expect_error(
        c.execute(sql, &[]),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument": argument, "reason": reason})),
    );
}

/// Every reader of app rows, called on the attacker's logical table.
fn read_all(c: &mut Client, tbl: &str) -> Vec<Result<(), postgres::Error>> {
    vec![
        c.execute("SELECT syncular.get_row_scopes($1, $2, 'r1')", &[&P, &tbl])
            .map(drop),
        c.execute(
            r#"SELECT * FROM syncular.scan_rows($1, $2, '{"project_id":["p1"]}', NULL, 10)"#,
            &[&P, &tbl],
        )
        .map(drop),
        c.execute("SELECT syncular.rows_referencing_blob($1, 'blob-1')", &[&P])
            .map(drop),
    ]
}

/// Every reader of app rows refuses the caller `tbl` (`privilege`); `why` names the missing
/// right.
#[track_caller]
fn assert_every_read_refused(c: &mut Client, tbl: &str, why: &str) {
    for result in read_all(c, tbl) {
        let err = sql_error(&result.expect_err(why));
        assert_eq!(
            (err.state.as_str(), err.detail),
            (
                "SY000",
                Some(json!({"argument":"tbl","reason":"privilege"}))
            )
        );
    }
}

/// The registration is dead once its relation is gone or changed: `unknown_table` (for the
/// blob read, the table is skipped), and the payload never runs.
fn assert_registration_dead(c: &mut Client, attacker: &Attacker) {
    let results = read_all(c, &attacker.tbl);
    for result in &results[..2] {
        let err = sql_error(result.as_ref().expect_err("a dead registration is unknown"));
        assert_eq!(
            (err.state.as_str(), err.message.as_str()),
            ("SY041", "sync.storage.unknown_table"),
            "{err:?}"
        );
    }
    results[2].as_ref().expect("a dead registration is skipped");
    let referencing: Value = one(
        c,
        "SELECT syncular.rows_referencing_blob($1, 'blob-1')",
        &[&P],
    );
    assert_eq!(referencing, json!([]));
    assert!(!attacker.is_superuser(c));
}

/// A test database with an attacker whose payload function is planted.
fn armed(test: &str) -> (TestDb, Client, Attacker) {
    let db = TestDb::new(test);
    let mut c = db.connect();
    let attacker = Attacker::new(&mut c, &db, "a");
    attacker.plant_payload(&mut c);
    (db, c, attacker)
}

/// An app row as a view column list would fake it, with the payload in `_sync_payload`.
const FAKE_ROW: &str = r#"'part-1'::text AS "_sync_partition", 'r1'::text AS "_sync_row_id",
    1::bigint AS "_sync_server_version", '{}'::jsonb AS "_sync_scopes",
    {r}.pwn()::bytea AS "_sync_payload", NULL::bytea AS "_sync_column_versions""#;

#[test]
fn a_view_swapped_in_by_drop_is_never_read() {
    let (_db, mut c, attacker) = armed("sec_view_drop");
    attacker.run(
        &mut c,
        &format!("DROP TABLE {{r}}.t; CREATE VIEW {{r}}.t AS SELECT {FAKE_ROW}"),
    );
    // Every reader, by the attacker and by the superuser (a victim's routine call).
    attacker.act(&mut c);
    assert_registration_dead(&mut c, &attacker);
    attacker.leave(&mut c);
    assert_registration_dead(&mut c, &attacker);
}

#[test]
fn a_view_swapped_in_by_rename_is_never_read() {
    let (_db, mut c, attacker) = armed("sec_view_rename");
    attacker.run(
        &mut c,
        r#"ALTER TABLE {r}.t RENAME TO t_old;
           CREATE VIEW {r}.t AS SELECT "_sync_partition", "_sync_row_id", "_sync_server_version",
                  "_sync_scopes", {r}.pwn()::bytea AS "_sync_payload", "_sync_column_versions"
             FROM {r}.t_old"#,
    );
    // The registration follows the relation (its OID), not the name: the renamed table is read.
    let scopes: Value = one(
        &mut c,
        "SELECT syncular.get_row_scopes($1, $2, 'r1')",
        &[&P, &attacker.tbl],
    );
    assert_eq!(
        scopes,
        json!({"serverVersion": 1, "scopes": {"project_id": "p1"}})
    );
    for result in read_all(&mut c, &attacker.tbl) {
        result.expect("the registered relation is read, not the view");
    }
    assert!(!attacker.is_superuser(&mut c));
}

#[test]
fn a_table_turned_into_a_view_by_a_return_rule_is_never_read() {
    let (_db, mut c, attacker) = armed("sec_return_rule");
    attacker.run(
        &mut c,
        "DELETE FROM {r}.t; ALTER TABLE {r}.t DROP CONSTRAINT t_pkey",
    );
    // relhasindex is cleared by VACUUM only; a table with it set cannot become a view.
    attacker.run(&mut c, "VACUUM {r}.t");
    let rule =
        format!("CREATE RULE \"_RETURN\" AS ON SELECT TO {{r}}.t DO INSTEAD SELECT {FAKE_ROW}");
    let major: i32 = one(
        &mut c,
        "SELECT current_setting('server_version_num')::int / 10000",
        &[],
    );
    if major >= 16 {
        // PostgreSQL 16 removed turning a table into a view: the attack cannot even start.
        attacker.act(&mut c);
        let refused = c.batch_execute(&rule.replace("{r}", &attacker.role));
        let err = sql_error(&refused.expect_err("no ON SELECT rule on a table"));
        assert_eq!(err.state, "42809", "{err:?}");
        attacker.leave(&mut c);
        assert!(!attacker.is_superuser(&mut c));
        return;
    }
    attacker.run(&mut c, &rule);
    let kind: String = one(
        &mut c,
        &format!(
            "SELECT relkind::text FROM pg_class WHERE oid = '{}.t'::regclass",
            attacker.role
        ),
        &[],
    );
    assert_eq!(kind, "v", "the same OID is now a view");
    assert_registration_dead(&mut c, &attacker);
}

#[test]
fn a_table_with_any_rewrite_rule_is_not_usable() {
    let (_db, mut c, attacker) = armed("sec_rule");
    attacker.run(
        &mut c,
        "CREATE RULE quiet AS ON DELETE TO {r}.t DO INSTEAD NOTHING",
    );
    attacker.refused_registration(&mut c);
    assert_registration_dead(&mut c, &attacker);
}

#[test]
fn a_meta_column_of_a_host_type_with_an_implicit_cast_is_never_read() {
    let (_db, mut c, attacker) = armed("sec_cast");
    attacker.run(
        &mut c,
        r#"CREATE TYPE {r}.evil AS (v text);
           CREATE FUNCTION {r}.evil_text({r}.evil) RETURNS text LANGUAGE plpgsql AS
             $$BEGIN PERFORM {r}.pwn(); RETURN $1.v; END$$;
           CREATE CAST ({r}.evil AS text) WITH FUNCTION {r}.evil_text({r}.evil) AS IMPLICIT;
           ALTER TABLE {r}.t ALTER COLUMN "_sync_partition" TYPE {r}.evil
             USING ROW("_sync_partition")::{r}.evil"#,
    );
    assert_registration_dead(&mut c, &attacker);
    // And such a relation cannot be registered in the first place.
    attacker.refused_registration(&mut c);
}

/// A victim's routine `rows_referencing_blob` reaches the attacker's table through a planted
/// reference. The attacker's code attached to its table (a forced row-security policy) runs
/// as the attacker, in a restricted security context: it cannot escalate.
#[test]
fn code_on_a_host_table_runs_as_its_owner_when_a_victim_reads_it() {
    let (_db, mut c, attacker) = armed("sec_victim");
    attacker.run(
        &mut c,
        "ALTER TABLE {r}.t ENABLE ROW LEVEL SECURITY, FORCE ROW LEVEL SECURITY;
         CREATE POLICY everyone ON {r}.t USING ({r}.pwn() IS NOT NULL);
         GRANT SELECT ON {r}.t TO PUBLIC",
    );
    // The victim: the superuser, as a host's maintenance job would run.
    let err = sql_error(
        &c.execute("SELECT syncular.rows_referencing_blob($1, 'blob-1')", &[&P])
            .expect_err("the policy raises"),
    );
    assert_eq!(err.message, format!("ran as {}", attacker.role));
    assert!(!attacker.is_superuser(&mut c));
    for result in read_all(&mut c, &attacker.tbl) {
        let err = sql_error(&result.expect_err("the policy raises"));
        assert_eq!(err.message, format!("ran as {}", attacker.role));
    }
    assert!(!attacker.is_superuser(&mut c));
}

#[test]
fn reading_an_app_table_needs_select_on_it() {
    let db = TestDb::new("sec_select");
    let mut c = db.connect();
    let owner = Attacker::new(&mut c, &db, "owner");
    let other = Attacker::new(&mut c, &db, "other");
    other.act(&mut c);
    assert_every_read_refused(&mut c, &owner.tbl, "no SELECT on the owner's table");
    other.leave(&mut c);
    owner.run(
        &mut c,
        &format!("GRANT SELECT ON {{r}}.t TO {}", other.role),
    );
    // Rows are read as the caller when it does not hold the owner's privileges (docs/SECURITY.md
    // rule 1): it needs what a query of its own would, USAGE on the schema too.
    other.act(&mut c);
    assert_every_read_refused(&mut c, &owner.tbl, "no USAGE on the owner's schema");
    other.leave(&mut c);
    owner.run(
        &mut c,
        &format!("GRANT USAGE ON SCHEMA {{r}} TO {}", other.role),
    );
    other.act(&mut c);
    let scopes: Value = one(
        &mut c,
        "SELECT syncular.get_row_scopes($1, $2, 'r1')",
        &[&P, &owner.tbl],
    );
    assert_eq!(scopes["serverVersion"], json!(1));
    // Row-level security that would filter the caller's own reads: refused, not bypassed.
    other.leave(&mut c);
    owner.act(&mut c);
    exec(
        &mut c,
        &format!(
            "ALTER TABLE {r}.t ENABLE ROW LEVEL SECURITY;
             CREATE POLICY nothing ON {r}.t USING (false);",
            r = owner.role
        ),
    );
    // The owner (policies do not apply to it unless forced) still reads.
    let scopes: Value = one(
        &mut c,
        "SELECT syncular.get_row_scopes($1, $2, 'r1')",
        &[&P, &owner.tbl],
    );
    assert_eq!(scopes["serverVersion"], json!(1));
    owner.leave(&mut c);
    other.act(&mut c);
    assert_every_read_refused(&mut c, &owner.tbl, "row security applies to the caller");
}

#[test]
fn a_registration_cannot_be_hijacked_by_another_role() {
    let db = TestDb::new("sec_hijack");
    let mut c = db.connect();
    let victim = Attacker::new(&mut c, &db, "victim");
    let attacker = Attacker::new(&mut c, &db, "attacker");
    victim.run(
        &mut c,
        &format!(
            "SELECT syncular.register_table('{}', '{{r}}.t', true)",
            victim.tbl
        ),
    );
    let before: Value = one(
        &mut c,
        "SELECT to_jsonb(a) FROM syncular.sync_app_tables a WHERE tbl = $1",
        &[&victim.tbl],
    );
    let victim_oid: u32 = one(
        &mut c,
        &format!("SELECT '{}.t'::regclass::oid", victim.role),
        &[],
    );
    attacker.act(&mut c);
    invalid(
        &mut c,
        &format!(
            "SELECT syncular.register_table('{}', '{}.t')",
            victim.tbl, attacker.role
        ),
        "tbl",
        "privilege",
    );
    // Nor with the victim's relation (named by OID: the attacker may not even look into the
    // victim's schema): registering needs its ownership.
    invalid(
        &mut c,
        &format!("SELECT syncular.register_table('stolen', {victim_oid}::oid::regclass)"),
        "relation",
        "privilege",
    );
    attacker.leave(&mut c);
    let after: Value = one(
        &mut c,
        "SELECT to_jsonb(a) FROM syncular.sync_app_tables a WHERE tbl = $1",
        &[&victim.tbl],
    );
    assert_eq!(before, after);
    assert_eq!(
        count(
            &mut c,
            &format!(
                "pg_trigger WHERE tgrelid = '{}.t'::regclass AND tgname = 'syncular_row_meta'",
                victim.role
            )
        ),
        1,
        "the victim's row-meta trigger is still there"
    );
    assert_eq!(
        count(&mut c, "syncular.sync_app_tables WHERE tbl = 'stolen'"),
        0
    );
}

#[test]
fn foreign_dangling_and_unregistered_names_are_not_retired_by_a_host() {
    let db = TestDb::new("sec_retire");
    let mut c = db.connect();
    let victim = Attacker::new(&mut c, &db, "victim");
    let attacker = Attacker::new(&mut c, &db, "attacker");
    let metadata = |c: &mut Client, tbl: &str| -> i64 {
        one(
            c,
            "SELECT (SELECT count(*) FROM syncular.sync_row_scopes WHERE tbl = $1)
                  + (SELECT count(*) FROM syncular.sync_blob_refs WHERE tbl = $1)
                  + (SELECT count(*) FROM syncular.sync_app_tables WHERE tbl = $1)",
            &[&tbl],
        )
    };
    let refused = |c: &mut Client, tbl: &str| {
        expect_error(
            c.execute("SELECT syncular.retire_table($1)", &[&tbl]),
            "SY000",
            "sync.storage.invalid_argument",
            Some(json!({"argument":"tbl","reason":"privilege"})),
        );
    };
    assert_eq!(metadata(&mut c, &victim.tbl), 3);
    // Registered by someone else.
    attacker.act(&mut c);
    refused(&mut c, &victim.tbl);
    attacker.leave(&mut c);
    // Dangling: the victim renamed, then dropped its relation; the registration is still the
    // victim's.
    victim.run(
        &mut c,
        "ALTER TABLE {r}.t RENAME TO gone; DROP TABLE {r}.gone",
    );
    attacker.act(&mut c);
    refused(&mut c, &victim.tbl);
    // Never registered: metadata written under a name nobody registered.
    exec(
        &mut c,
        &format!("SELECT syncular.set_row_scopes('{P}', 'orphan', 'o1', '{{\"x\":\"1\"}}')"),
    );
    refused(&mut c, "orphan");
    attacker.leave(&mut c);
    assert_eq!(metadata(&mut c, &victim.tbl), 3);
    assert_eq!(metadata(&mut c, "orphan"), 1);
    // The registrant retires its own dangling registration; the extension owner the orphan.
    victim.act(&mut c);
    let retired: Value = one(&mut c, "SELECT syncular.retire_table($1)", &[&victim.tbl]);
    assert_eq!(
        retired,
        json!({"rowScopes": 1, "blobRefs": 1, "registered": true})
    );
    victim.leave(&mut c);
    let retired: Value = one(&mut c, "SELECT syncular.retire_table('orphan')", &[]);
    assert_eq!(
        retired,
        json!({"rowScopes": 1, "blobRefs": 0, "registered": false})
    );
}

#[test]
fn temporary_tables_are_refused() {
    let db = TestDb::new("sec_temp");
    let mut c = db.connect();
    // A table created in pg_temp is a temporary table.
    exec(&mut c, &app_table_sql("pg_temp.tmp", ""));
    expect_error(
        c.execute("SELECT syncular.register_table('tmp', 'pg_temp.tmp')", &[]),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument":"relation","reason":"shape"})),
    );
    assert_eq!(
        count(&mut c, "syncular.sync_app_tables WHERE tbl = 'tmp'"),
        0
    );
}

/// A host attaching the row-meta trigger itself, under another table's name, writes nothing.
#[test]
fn the_row_meta_trigger_only_works_where_register_table_put_it() {
    let db = TestDb::new("sec_trigger");
    let mut c = db.connect();
    let attacker = Attacker::new(&mut c, &db, "a");
    // Even were the trigger function granted, it refuses a relation not registered for `tasks`.
    exec(
        &mut c,
        &format!(
            "GRANT EXECUTE ON FUNCTION syncular.row_meta_trigger() TO {r};",
            r = attacker.role
        ),
    );
    attacker.act(&mut c);
    exec(
        &mut c,
        &format!(
            "CREATE TRIGGER planted AFTER INSERT ON {r}.t
               FOR EACH ROW EXECUTE FUNCTION syncular.row_meta_trigger('tasks')",
            r = attacker.role
        ),
    );
    invalid(&mut c, &format!(
                "INSERT INTO {}.t VALUES ('{P}', 'victim-row', 1, '{{\"project_id\":\"p9\"}}', '\\x01', NULL)",
                attacker.role
            ), "tbl", "privilege");
    attacker.leave(&mut c);
    assert_eq!(
        count(&mut c, "syncular.sync_row_scopes WHERE tbl = 'tasks'"),
        0
    );
}

/// Only errors raised by the extension are re-coded: a host trigger raising a message equal to
/// a catalogue code keeps its own SQLSTATE.
#[test]
fn a_host_error_that_looks_like_ours_is_not_recoded() {
    let db = TestDb::new("sec_recode");
    let mut c = db.connect();
    exec(
        &mut c,
        "CREATE FUNCTION public.fake() RETURNS trigger LANGUAGE plpgsql AS
           $$BEGIN RAISE EXCEPTION 'sync.storage.writer_fence_rejected'
                   USING DETAIL = '{\"forged\":true}'; END$$;
         CREATE TRIGGER fake BEFORE INSERT ON syncular.sync_changes
           FOR EACH ROW EXECUTE FUNCTION public.fake();",
    );
    let err =
        sql_error(&try_append(&mut c, P, "tasks", "t1", Some(1)).expect_err("the trigger raises"));
    assert_eq!(err.state, "P0001", "{err:?}");
}

/// A PostgreSQL error caught under SPI reaches the client as itself — SQLSTATE, message, DETAIL
/// and HINT — and never with a Rust backtrace appended to its DETAIL, which pgrx's rethrow adds
/// when the server runs with RUST_BACKTRACE set (scripts/cluster.sh sets it for the test
/// clusters; issue 30, item 6).
#[test]
fn a_caught_error_is_raised_again_as_itself_without_a_backtrace() {
    let db = TestDb::new("sec_caught");
    let mut c = db.connect();
    exec(
        &mut c,
        "CREATE FUNCTION public.deny() RETURNS trigger LANGUAGE plpgsql AS
           $$BEGIN RAISE EXCEPTION 'the host says no' USING ERRCODE = '22023',
                   DETAIL = 'host detail', HINT = 'host hint'; END$$;
         CREATE TRIGGER deny BEFORE INSERT ON syncular.sync_changes
           FOR EACH ROW EXECUTE FUNCTION public.deny();",
    );
    let err =
        sql_error(&try_append(&mut c, P, "tasks", "t1", Some(1)).expect_err("the trigger raises"));
    assert_eq!(err.state, "22023", "{err:?}");
    assert_eq!(err.message, "the host says no");
    assert_eq!(err.hint.as_deref(), Some("host hint"));
    let raw = try_append(&mut c, P, "tasks", "t1", Some(1)).expect_err("the trigger raises");
    assert_eq!(
        raw.as_db_error().and_then(|e| e.detail()),
        Some("host detail"),
        "{raw:?}"
    );
}

/// Control state lives in backend memory: settings of the same names change nothing.
#[test]
fn control_state_is_not_settable_by_a_session() {
    let db = TestDb::new("sec_guc");
    let mut c = db.connect();
    exec(
        &mut c,
        "SET syncular.previous_schema = '{\"schemaVersion\":99,\"layouts\":{}}';
         SET syncular.fence_guard_busy = 'on';",
    );
    let previous: Option<Value> = one(&mut c, "SELECT syncular.previous_schema()", &[]);
    assert_eq!(previous, None);
    assert!(!one::<bool>(
        &mut c,
        "SELECT syncular._fence_guard_busy()",
        &[]
    ));
    // The guard still restores the fence when a (table-owning) session drops it.
    exec(
        &mut c,
        "DROP TRIGGER sync_commits_writer_fence ON syncular.sync_commits",
    );
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular._native_fence_triggers()", &[]),
        1
    );
    // previous_schema follows savepoints: a migration rolled back to a savepoint is forgotten.
    let migrate_in_tx = |c: &mut Client, v: i64, layouts: Value| {
        one::<i64>(
            c,
            "SELECT syncular.migrate_schema($1, $2, '[]')",
            &[&v, &layouts],
        )
    };
    migrate(&mut c, 1, &l1(), &json!([]));
    // A migration rolled back to its savepoint is forgotten ...
    exec(&mut c, "BEGIN; SAVEPOINT s");
    migrate_in_tx(&mut c, 2, l2());
    let inner: Value = one(&mut c, "SELECT syncular.previous_schema()", &[]);
    assert_eq!(inner["schemaVersion"], json!(1));
    exec(&mut c, "ROLLBACK TO SAVEPOINT s");
    let forgotten: Option<Value> = one(&mut c, "SELECT syncular.previous_schema()", &[]);
    assert_eq!(forgotten, None);
    exec(&mut c, "ROLLBACK");
    // ... one whose savepoint is released is kept until the transaction ends.
    exec(&mut c, "BEGIN; SAVEPOINT s");
    migrate_in_tx(&mut c, 2, l2());
    exec(&mut c, "RELEASE SAVEPOINT s");
    let kept: Value = one(&mut c, "SELECT syncular.previous_schema()", &[]);
    assert_eq!(kept["schemaVersion"], json!(1));
    exec(&mut c, "COMMIT");
    let after: Option<Value> = one(&mut c, "SELECT syncular.previous_schema()", &[]);
    assert_eq!(after, None);
}

/// The serving role gets the serving API only; internal, operator and repair functions are
/// nobody's but the owner's.
#[test]
fn the_host_role_cannot_call_triggers_adoption_repairs_or_admin_functions() {
    let db = TestDb::new("sec_roles");
    let mut c = db.connect();
    let role = format!("{}_srv", db.name);
    exec(
        &mut c,
        &format!("CREATE ROLE {role} NOLOGIN; GRANT syncular_host TO {role}"),
    );
    let executable = |c: &mut Client, role: &str, signature: &str| -> bool {
        one(
            c,
            "SELECT has_function_privilege($1, $2, 'EXECUTE')",
            &[&role, &signature],
        )
    };
    for signature in [
        "syncular.writer_fence_trigger()",
        "syncular.row_meta_trigger()",
        "syncular.schema_marker_stamp()",
        "syncular._stamp_guard()",
        "syncular.schema_stamp_own()",
        "syncular._fence_guard_on_drop()",
        "syncular._fence_guard_on_create()",
        "syncular._fence_guard_hold(boolean)",
        "syncular._grant_api_roles()",
        "syncular.adopt_legacy_tables(name, name)",
        "syncular.repair_schema_marker(bigint, bigint, text)",
        "syncular.repair_writer_fence(text, bigint, text)",
    ] {
        assert!(!executable(&mut c, &role, signature), "{signature}");
        assert!(
            !executable(&mut c, "syncular_admin", signature),
            "{signature}"
        );
    }
    for signature in [
        "syncular.migrate_schema(bigint, jsonb, jsonb)",
        "syncular.raise_writer_fence(text, bigint)",
        "syncular.register_table(text, regclass, boolean)",
        "syncular.prune_commit_log(text, bigint, bigint, bigint, bigint)",
    ] {
        assert!(!executable(&mut c, &role, signature), "{signature}");
        assert!(
            executable(&mut c, "syncular_admin", signature),
            "{signature}"
        );
    }
    for signature in [
        "syncular.push_begin(text, text, text, bigint, jsonb)",
        "syncular.append_commit(text, jsonb)",
        "syncular.read_commit_window(text, text, jsonb, bigint, bigint, integer)",
        "syncular.claim_reactions(text, text, text[], bigint, bigint, integer)",
    ] {
        assert!(executable(&mut c, &role, signature), "{signature}");
    }
}

/// The owner's way back from a marker or fence raised too far, audited; hosts cannot use it.
#[test]
fn repairs_lower_marker_and_fence_for_the_owner_only_and_leave_an_audit_record() {
    let db = TestDb::new("sec_repair");
    let mut c = db.connect();
    let max = (1i64 << 53) - 1;
    migrate(&mut c, 1, &l1(), &json!([]));
    one::<i64>(
        &mut c,
        "SELECT syncular.raise_writer_fence($1, $2)",
        &[&P, &max],
    );
    migrate(&mut c, max, &l1(), &json!([]));
    let attacker = Attacker::new(&mut c, &db, "a");
    attacker.act(&mut c);
    for sql in [
        "SELECT syncular.repair_schema_marker(1, 0, 'x')",
        "SELECT syncular.repair_writer_fence('part-1', 1, 'x')",
    ] {
        let err = sql_error(&c.execute(sql, &[]).expect_err("owner only"));
        assert_eq!(err.state, "42501", "{sql}: {err:?}");
    }
    attacker.leave(&mut c);
    expect_error(
        c.execute("SELECT syncular.repair_schema_marker(1, 1, '')", &[]),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument":"reason","reason":"empty"})),
    );
    let marker: Value = one(
        &mut c,
        "SELECT syncular.repair_schema_marker(1, 0, 'migrate_schema(2^53-1) by mistake')",
        &[],
    );
    assert_eq!(
        marker,
        json!({"before":{"schemaVersion":max,"writerFloor":max},"after":{"schemaVersion":1,"writerFloor":0}})
    );
    let fence: Value = one(
        &mut c,
        "SELECT syncular.repair_writer_fence($1, 1, 'fence raised by mistake')",
        &[&P],
    );
    assert_eq!(
        fence,
        json!({"before":{"requiredWriterVersion":max},"after":{"requiredWriterVersion":1}})
    );
    expect_error(
        c.execute(
            "SELECT syncular.repair_writer_fence($1, 2, 'raise?')",
            &[&P],
        ),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument":"required_writer_version","reason":"range"})),
    );
    assert_eq!(append(&mut c, P, "tasks", "t1", Some(1)), 1);
    let audit: Vec<(String, String)> = c
        .query(
            "SELECT action, reason FROM syncular.sync_repairs ORDER BY repaired_at",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        audit,
        vec![
            (
                "schema_marker".to_string(),
                "migrate_schema(2^53-1) by mistake".to_string()
            ),
            (
                "writer_fence".to_string(),
                "fence raised by mistake".to_string()
            ),
        ]
    );
}

/// A planning error in a session that loaded the library is an ERROR, and the session lives
/// on: the library's planner hook (src/citus/owner_sessions.rs) called PostgreSQL's planner
/// through pgrx, which turns its ERROR into a Rust panic, and let the panic unwind into
/// PostgreSQL's C frames — the first `SELECT 1/0` of such a session aborted the backend and
/// restarted every session of the cluster (seen in the memory-limited suite, an out-of-memory
/// ERROR while planning). The hook now calls the planner as C calls it, so the ERROR passes
/// through as PostgreSQL's own.
#[test]
fn a_planning_error_is_an_error_not_an_abort() {
    let db = TestDb::new("planerror");
    let mut c = db.connect();
    let _: i64 = one(&mut c, "SELECT syncular.max_commit_seq('p')", &[]);
    for sql in [
        "SELECT 1/0",
        "SELECT 1/0 WHERE syncular.max_commit_seq('p') = 0",
    ] {
        let err = sql_error(&c.batch_execute(sql).unwrap_err());
        assert_eq!(err.state, "22012", "{sql}: {err:?}");
    }
    let alive: i32 = one(&mut c, "SELECT 1", &[]);
    assert_eq!(alive, 1);
}
