//! Host code runs in a sandbox (docs/SECURITY.md, rules 1, 10 and 12; issue 25's critical
//! finding): with exactly the roles the docs prescribe — a migrator in `syncular_admin` that owns
//! the app table, a server in `syncular_host` with DML on it — host code attached to the table
//! calls `set_config('search_path', '<schema>, pg_catalog', false)` in the middle of a call of the
//! API, having planted an operator `<schema>.=(text, text)`. Before the sandbox the setting
//! outlived the host statement, the extension's next statement of the same call (run with the
//! extension owner's rights) resolved its unqualified `=` to the planted operator, and the
//! operator made the migrator superuser.
//!
//! One test per kind of host code: a trigger, a column default (one row and a batch), an index
//! expression, a CHECK constraint, a domain's check, a row-level security policy (read by `pull`,
//! `scan_rows`, `get_row_scopes`, `rows_referencing_blob`). Each asserts that the planted operator
//! never ran with superuser rights, that nobody became superuser and that the session's
//! `search_path` after the call is the one it had before (nothing host code set survives its
//! statement). A last test shows host code cannot call the API from inside a call.

use postgres::Client;
use serde_json::{json, Value};
use syncular_multisession::native_push::*;
use syncular_multisession::*;

/// The migrator (`<db>_m`, owner of schema and table `<db>_m.t`, registered as `<db>_m_t`, push
/// schema version `V`) and the server (`<db>_s`, DML on the table), with the attack planted.
struct Scene {
    db: TestDb,
    /// The superuser's connection.
    c: Client,
    migrator: String,
    server: String,
    tbl: String,
}

impl Scene {
    fn new(test: &str) -> Scene {
        let db = TestDb::new(test);
        let mut c = db.connect();
        let migrator = format!("{}_m", db.name);
        let server = format!("{}_s", db.name);
        let tbl = format!("{migrator}_t");
        exec(
            &mut c,
            &format!(
                "CREATE ROLE {migrator} LOGIN; GRANT syncular_admin TO {migrator};
                 GRANT CREATE ON DATABASE {db} TO {migrator};
                 CREATE ROLE {server} LOGIN; GRANT syncular_host TO {server};",
                db = db.name
            ),
        );
        let scene = Scene {
            db,
            c,
            migrator,
            server,
            tbl,
        };
        let mut m = scene.db.connect_as(&scene.migrator);
        exec(
            &mut m,
            &scene.sql(&format!(
                "CREATE SCHEMA {{m}};
                 {table}
                 SELECT syncular.register_table('{{t}}', '{{m}}.t');
                 GRANT USAGE ON SCHEMA {{m}} TO {{s}};
                 GRANT SELECT, INSERT, UPDATE, DELETE ON {{m}}.t TO {{s}};
                 -- What the planted operator saw: whose rights it ran with.
                 CREATE TABLE {{m}}.seen (who text, superuser boolean);
                 GRANT INSERT ON {{m}}.seen TO PUBLIC;
                 CREATE FUNCTION {{m}}.eq(a text, b text) RETURNS boolean LANGUAGE plpgsql AS $$
                 BEGIN
                   INSERT INTO {{m}}.seen SELECT current_user, r.rolsuper FROM pg_catalog.pg_roles r
                    WHERE r.rolname OPERATOR(pg_catalog.=) current_user;
                   BEGIN
                     ALTER ROLE {{m}} SUPERUSER;
                   EXCEPTION WHEN insufficient_privilege THEN NULL;
                   END;
                   RETURN a OPERATOR(pg_catalog.=) b;
                 END $$;
                 CREATE OPERATOR {{m}}.= (LEFTARG = text, RIGHTARG = text, FUNCTION = {{m}}.eq);
                 -- The host code's one move: a session-level search_path naming the operator.
                 CREATE FUNCTION {{m}}.poison() RETURNS boolean LANGUAGE plpgsql AS $$
                 BEGIN
                   PERFORM pg_catalog.set_config('search_path', '{{m}}, pg_catalog', false);
                   RETURN true;
                 END $$;
                 CREATE FUNCTION {{m}}.poison_text() RETURNS text LANGUAGE sql
                   AS $$ SELECT CASE WHEN {{m}}.poison() THEN 'x' END $$;
                 CREATE FUNCTION {{m}}.poison_key(t text) RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$
                 BEGIN
                   PERFORM pg_catalog.set_config('search_path', '{{m}}, pg_catalog', false);
                   RETURN t;
                 END $$;",
                table = app_table_sql("{m}.t", "id text, project_id text, title text,")
            )),
        );
        let schema = json!({ &scene.tbl: scoped(
            json!([col("id", "string", false), col("project_id", "string", false),
                   col("title", "string", true)]),
            project("project_id"))});
        let n: i32 = one(
            &mut m,
            "SELECT syncular.set_push_schema($1, $2)",
            &[&V, &schema],
        );
        assert_eq!(n, 1);
        scene
    }

    /// `sql` with `{m}`, `{s}` and `{t}` standing for the migrator, the server and the table.
    fn sql(&self, sql: &str) -> String {
        sql.replace("{m}", &self.migrator)
            .replace("{s}", &self.server)
            .replace("{t}", &self.tbl)
    }

    /// Runs `sql` as the migrator (the host code's author).
    fn as_migrator(&self, sql: &str) {
        let mut m = self.db.connect_as(&self.migrator);
        exec(&mut m, &self.sql(sql));
    }

    fn op(&mut self, id: &str, title: &str) -> Op {
        let tbl = self.tbl.clone();
        up(
            &mut self.c,
            &tbl,
            id,
            None,
            json!({"id": id, "project_id": "p1", "title": title}),
        )
    }

    /// Nobody was made superuser, the planted operator never ran with a superuser's rights.
    #[track_caller]
    fn assert_contained(&mut self) {
        let superuser: bool = one(
            &mut self.c,
            "SELECT rolsuper FROM pg_roles WHERE rolname = $1",
            &[&self.migrator],
        );
        assert!(!superuser, "the migrator became superuser");
        let seen = self.sql("{m}.seen WHERE superuser");
        let escalated = count(&mut self.c, &seen);
        assert_eq!(escalated, 0, "the planted operator ran as a superuser");
    }
}

/// `call` run on `conn`, then the session's search_path is still `path`: whatever host code set
/// ended with its statement.
#[track_caller]
fn keeps_search_path<T>(conn: &mut Client, call: impl FnOnce(&mut Client) -> T) -> T {
    let before: String = one(conn, "SELECT current_setting('search_path')", &[]);
    let out = call(conn);
    let after: String = one(conn, "SELECT current_setting('search_path')", &[]);
    assert_eq!(
        after, before,
        "a setting made by host code outlived the call"
    );
    out
}

/// The server pushes `ops` with `push_commit`; the push applies.
#[track_caller]
fn server_pushes(scene: &mut Scene, key: &str, ops: &[Op]) {
    let mut s = scene.db.connect_as(&scene.server);
    let allowed = json!({"project_id": ["p1"]});
    let out = keeps_search_path(&mut s, |s| {
        try_push_as(s, P, "c1", key, ops, Some(&allowed), &json!({})).expect("the push runs")
    });
    assert_eq!(out["outcome"], "applied", "{out}");
}

/// The server pushes one new row, then two (on a table no trigger can fire on: the batched path,
/// docs/DESIGN.md §Push path); both apply and nothing escaped the sandbox.
fn one_row_then_a_batch(scene: &mut Scene) {
    let a = scene.op("r1", "a");
    server_pushes(scene, "k1", &[a]);
    let b = scene.op("r2", "b");
    let c = scene.op("r3", "c");
    server_pushes(scene, "k2", &[b, c]);
    scene.assert_contained();
}

#[test]
fn a_trigger_cannot_leave_a_setting_behind_in_push_commit() {
    let mut scene = Scene::new("sbx_trigger");
    scene.as_migrator(
        "CREATE FUNCTION {m}.trg() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM {m}.poison(); RETURN NEW; END $$;
         CREATE TRIGGER poison BEFORE INSERT OR UPDATE ON {m}.t
           FOR EACH ROW EXECUTE FUNCTION {m}.trg();",
    );
    let a = scene.op("r1", "a");
    server_pushes(&mut scene, "k1", &[a]);
    let b = scene.op("r1", "b");
    let c = scene.op("r2", "c");
    server_pushes(&mut scene, "k2", &[b, c]);
    scene.assert_contained();
}

#[test]
fn a_column_default_cannot_leave_a_setting_behind_one_row_or_a_batch() {
    let mut scene = Scene::new("sbx_default");
    scene.as_migrator("ALTER TABLE {m}.t ADD COLUMN note text DEFAULT {m}.poison_text()");
    one_row_then_a_batch(&mut scene);
    let noted = scene.sql("{m}.t WHERE note = 'x'");
    assert_eq!(count(&mut scene.c, &noted), 3);
}

#[test]
fn an_index_expression_cannot_leave_a_setting_behind() {
    let mut scene = Scene::new("sbx_index");
    scene.as_migrator("CREATE INDEX poison ON {m}.t ({m}.poison_key(id))");
    one_row_then_a_batch(&mut scene);
}

#[test]
fn a_check_constraint_cannot_leave_a_setting_behind() {
    let mut scene = Scene::new("sbx_check");
    scene.as_migrator("ALTER TABLE {m}.t ADD CONSTRAINT poison CHECK ({m}.poison())");
    one_row_then_a_batch(&mut scene);
}

#[test]
fn a_domain_check_cannot_leave_a_setting_behind() {
    let mut scene = Scene::new("sbx_domain");
    scene.as_migrator(
        "CREATE DOMAIN {m}.flag AS text CHECK ({m}.poison());
         GRANT USAGE ON TYPE {m}.flag TO {s};
         ALTER TABLE {m}.t ADD COLUMN flag {m}.flag DEFAULT 'x'",
    );
    one_row_then_a_batch(&mut scene);
}

#[test]
fn a_policy_cannot_leave_a_setting_behind_in_the_readers() {
    let mut scene = Scene::new("sbx_policy");
    let a = scene.op("r1", "a");
    let b = scene.op("r2", "b");
    server_pushes(&mut scene, "k1", &[a, b]);
    let refs = scene.sql("SELECT syncular.set_blob_refs('part-1', '{t}', 'r1', ARRAY['blob-1'])");
    exec(&mut scene.c, &refs);
    scene.as_migrator(
        "ALTER TABLE {m}.t ENABLE ROW LEVEL SECURITY, FORCE ROW LEVEL SECURITY;
         CREATE POLICY poison ON {m}.t USING ({m}.poison());",
    );
    // The migrator reads its own table (the owner is not refused under row-level security), as
    // every reader of app rows does: the policy runs as the owner, inside the sandbox.
    let mut m = scene.db.connect_as(&scene.migrator);
    let tbl = scene.tbl.clone();
    let scopes = json!({"project_id": ["p1"]});
    let request = json!({"subscriptions": [{"id": "s1", "table": tbl, "scopes": scopes,
                                             "effective": scopes, "cursor": -1}]});
    let rows: i64 = keeps_search_path(&mut m, |m| {
        one(
            m,
            "SELECT count(*) FROM syncular.pull($1, 'c1', 'a1', $2, 'e1', $3, $4) WHERE row_id IS NOT NULL",
            &[&P, &NOW, &V, &request],
        )
    });
    assert_eq!(rows, 2);
    let scanned: i64 = keeps_search_path(&mut m, |m| {
        one(
            m,
            "SELECT count(*) FROM syncular.scan_rows($1, $2, '{\"project_id\": [\"p1\"]}', NULL, 1)",
            &[&P, &tbl],
        )
    });
    assert_eq!(scanned, 1);
    let found: Option<Value> = keeps_search_path(&mut m, |m| {
        one(
            m,
            "SELECT syncular.get_row_scopes($1, $2, 'r1')",
            &[&P, &tbl],
        )
    });
    assert!(found.is_some());
    let referencing: Value = keeps_search_path(&mut m, |m| {
        one(
            m,
            "SELECT syncular.rows_referencing_blob($1, 'blob-1')",
            &[&P],
        )
    });
    assert_eq!(
        referencing.as_array().map(Vec::len),
        Some(1),
        "{referencing}"
    );
    scene.assert_contained();
}

#[test]
fn host_code_cannot_call_the_api_from_inside_a_call() {
    let mut scene = Scene::new("sbx_reenter");
    // A trigger that stores a result for the very push that fires it: had it run, the push would
    // have stored a second result for its key after checking there was none (D8).
    scene.as_migrator(
        "CREATE FUNCTION {m}.trg() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           PERFORM syncular.put_push_result('part-1', 'c1', 'k1', '{\"status\":\"rejected\",\"results\":[{\"opIndex\":0,\"status\":\"error\"}]}');
           RETURN NEW;
         END $$;
         CREATE TRIGGER reenter BEFORE INSERT ON {m}.t FOR EACH ROW EXECUTE FUNCTION {m}.trg();",
    );
    let a = scene.op("r1", "a");
    let mut s = scene.db.connect_as(&scene.server);
    let allowed = json!({"project_id": ["p1"]});
    let err = try_push_as(&mut s, P, "c1", "k1", &[a], Some(&allowed), &json!({}))
        .expect_err("the trigger's call is refused");
    let err = sql_error(&err);
    assert_eq!(err.state, "42501");
    assert_eq!(
        err.message,
        "syncular functions cannot be called by host code that runs inside a syncular call"
    );
    assert_eq!(
        count(
            &mut scene.c,
            "syncular.sync_push_results WHERE client_commit_id = 'k1'"
        ),
        0
    );
    assert_eq!(count(&mut scene.c, "syncular.sync_commits"), 0);
    // The same function called by the host itself, outside any call, is served.
    exec(
        &mut s,
        "SELECT syncular.put_push_result('part-1', 'c9', 'k9', '{\"status\":\"rejected\",\"results\":[{\"opIndex\":0,\"status\":\"error\"}]}')",
    );
}

#[test]
fn the_row_meta_trigger_keeps_a_partitioned_tables_scopes() {
    // Low finding of issue 25: the trigger PostgreSQL clones onto each partition fires on the
    // leaf, which used to be compared with the registered parent and refused every write.
    let db = TestDb::new("sbx_partitioned");
    let mut c = db.connect();
    exec(
        &mut c,
        r#"CREATE TABLE public.pt (
             "_sync_partition" text NOT NULL, "_sync_row_id" text NOT NULL,
             "_sync_server_version" bigint NOT NULL, "_sync_scopes" jsonb NOT NULL,
             "_sync_payload" bytea NOT NULL, "_sync_column_versions" bytea,
             PRIMARY KEY ("_sync_partition", "_sync_row_id")) PARTITION BY LIST ("_sync_partition");
           CREATE TABLE public.pt_1 PARTITION OF public.pt FOR VALUES IN ('part-1');
           SELECT syncular.register_table('pt', 'public.pt', true);
           INSERT INTO public.pt VALUES ('part-1', 'r1', 1, '{"project_id":"p1"}', '\x01', NULL);"#,
    );
    let scopes: Value = one(
        &mut c,
        "SELECT syncular.get_row_scopes('part-1', 'pt', 'r1')",
        &[],
    );
    assert_eq!(scopes["scopes"], json!({"project_id": "p1"}));
    assert_eq!(
        count(
            &mut c,
            "syncular.sync_row_scopes WHERE tbl = 'pt' AND row_id = 'r1'"
        ),
        1
    );
    exec(
        &mut c,
        "DELETE FROM public.pt WHERE \"_sync_row_id\" = 'r1'",
    );
    assert_eq!(
        count(&mut c, "syncular.sync_row_scopes WHERE tbl = 'pt'"),
        0
    );
}

#[test]
fn a_callers_temporary_objects_never_run_with_the_owners_rights() {
    // Red team, attempt 08: the readers ran host code as the owner inside the caller's session,
    // whose temporary schema the caller fills. A host function pinned to `{m}, pg_catalog` (no
    // `pg_temp` in its path: PostgreSQL then searches the temporary schema first) evaluated while
    // planning a read resolved the server's temporary view, whose function then ran as the
    // migrator and read a table only the migrator may read.
    let mut scene = Scene::new("sbx_temp");
    let a = scene.op("r1", "a");
    server_pushes(&mut scene, "k1", &[a]);
    scene.as_migrator(
        "CREATE TABLE {m}.secret (v text); INSERT INTO {m}.secret VALUES ('migrator-only');
         CREATE TABLE {m}.settings (name text, on_ boolean);
         INSERT INTO {m}.settings VALUES ('archive', true);
         GRANT SELECT ON {m}.settings TO {s};
         CREATE FUNCTION {m}.flag(int) RETURNS boolean LANGUAGE sql IMMUTABLE
           SET search_path = {m}, pg_catalog
           AS $$ SELECT coalesce((SELECT on_ FROM settings WHERE name = 'archive'), true) $$;
         CREATE INDEX live ON {m}.t (\"_sync_partition\", \"_sync_row_id\") WHERE {m}.flag(1);
         CREATE TABLE {m}.leaks (who text, what text);
         GRANT INSERT, SELECT ON {m}.leaks TO {s};",
    );
    let mut s = scene.db.connect_as(&scene.server);
    exec(
        &mut s,
        &scene.sql(
            "CREATE FUNCTION pg_temp.steal() RETURNS boolean LANGUAGE plpgsql AS $$
             BEGIN
               BEGIN
                 INSERT INTO {m}.leaks SELECT current_user, v FROM {m}.secret;
               EXCEPTION WHEN insufficient_privilege THEN
                 INSERT INTO {m}.leaks VALUES (current_user, NULL);
               END;
               RETURN true;
             END $$;
             CREATE TEMP VIEW settings AS SELECT 'archive'::text AS name, pg_temp.steal() AS on_;
             GRANT SELECT ON settings TO PUBLIC;",
        ),
    );
    let tbl = scene.tbl.clone();
    let scanned: i64 = one(
        &mut s,
        "SELECT count(*) FROM syncular.scan_rows($1, $2, '{\"project_id\": [\"p1\"]}', NULL, 10)",
        &[&P, &tbl],
    );
    assert_eq!(scanned, 1);
    let leaks = scene.sql("{m}.leaks WHERE what IS NOT NULL");
    assert_eq!(
        count(&mut scene.c, &leaks),
        0,
        "the migrator's secret leaked"
    );
    // The host function ran as the server (as when the server queries the table itself).
    let runs = scene.sql("{m}.leaks WHERE who <> '{s}'");
    assert_eq!(count(&mut scene.c, &runs), 0);
}

#[test]
fn a_table_swapped_by_host_code_during_a_call_is_not_written() {
    // Red team, attempt 06: a trigger on the commit's first table renamed the second registered
    // table and put an impostor under its name; the second operation then wrote the impostor
    // (the transaction's own lock does not stop its own DDL).
    let mut scene = Scene::new("sbx_swap");
    scene.as_migrator(&format!(
        "{table}
         SELECT syncular.register_table('{{t}}2', '{{m}}.t2');
         GRANT SELECT, INSERT, UPDATE, DELETE ON {{m}}.t2 TO {{s}};
         CREATE FUNCTION {{m}}.swap() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
           SET search_path = pg_catalog AS $$
         BEGIN
           ALTER TABLE {{m}}.t2 RENAME TO t2_registered;
           CREATE TABLE {{m}}.t2 (LIKE {{m}}.t2_registered INCLUDING ALL);
           GRANT SELECT, INSERT, UPDATE, DELETE ON {{m}}.t2 TO {{s}};
           RETURN NULL;
         END $$;
         CREATE TRIGGER swap AFTER INSERT ON {{m}}.t FOR EACH ROW EXECUTE FUNCTION {{m}}.swap();",
        table = app_table_sql("{m}.t2", "id text, project_id text, title text,")
    ));
    let tbl2 = format!("{}2", scene.tbl);
    let columns = json!([
        col("id", "string", false),
        col("project_id", "string", false),
        col("title", "string", true)
    ]);
    let schema = json!({ &scene.tbl: scoped(columns.clone(), project("project_id")),
                         &tbl2: scoped(columns, project("project_id")) });
    let mut m = scene.db.connect_as(&scene.migrator);
    let _: i32 = one(
        &mut m,
        "SELECT syncular.set_push_schema($1, $2)",
        &[&V, &schema],
    );
    let a = scene.op("r1", "a");
    let b = up(
        &mut scene.c,
        &tbl2,
        "r2",
        None,
        json!({"id": "r2", "project_id": "p1", "title": "b"}),
    );
    let mut s = scene.db.connect_as(&scene.server);
    let allowed = json!({"project_id": ["p1"]});
    let err = s
        .query_one(
            PUSH_SQL,
            &[
                &P,
                &"c1",
                &"k1",
                &NOW,
                &V,
                &Some(&allowed),
                &vec![scene.tbl.as_str(), tbl2.as_str()],
                &vec!["r1", "r2"],
                &vec![1i16, 1],
                &vec![None::<i64>, None],
                &vec![a.payload.as_deref(), b.payload.as_deref()],
                &json!({}),
            ],
        )
        .expect_err("the swapped table is refused");
    let err = sql_error(&err);
    assert_eq!(
        (err.state.as_str(), err.message.as_str()),
        ("SY041", "sync.storage.unknown_table")
    );
    assert!(
        err.hint
            .as_deref()
            .unwrap_or("")
            .contains("changed during this call"),
        "{err:?}"
    );
    let written = scene.sql("{m}.t2");
    assert_eq!(
        count(&mut scene.c, &written),
        0,
        "the impostor was not written"
    );
    assert_eq!(count(&mut scene.c, "syncular.sync_commits"), 0);
}

#[test]
fn a_superusers_push_runs_host_code_as_the_tables_owner() {
    // Red team, attempt 10: host code fired by a push ran as the caller, a superuser included.
    // A caller holding the owner's privileges now writes as the owner: the trigger gets nothing
    // more than its author's rights.
    let mut scene = Scene::new("sbx_superuser_push");
    scene.as_migrator(
        "CREATE TABLE {m}.runs (who text); GRANT INSERT ON {m}.runs TO PUBLIC;
         CREATE FUNCTION {m}.trg() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           INSERT INTO {m}.runs VALUES (current_user);
           BEGIN
             ALTER ROLE {m} SUPERUSER;
           EXCEPTION WHEN insufficient_privilege THEN NULL;
           END;
           RETURN NEW;
         END $$;
         CREATE TRIGGER trg BEFORE INSERT ON {m}.t FOR EACH ROW EXECUTE FUNCTION {m}.trg();",
    );
    let a = scene.op("r1", "a");
    let allowed = json!({"project_id": ["p1"]});
    let out = try_push_as(
        &mut scene.c,
        P,
        "c1",
        "k1",
        &[a],
        Some(&allowed),
        &json!({}),
    )
    .unwrap();
    assert_eq!(out["outcome"], "applied", "{out}");
    scene.assert_contained();
    let runs = scene.sql("{m}.runs WHERE who = '{m}'");
    assert_eq!(
        count(&mut scene.c, &runs),
        1,
        "the trigger ran as the table's owner"
    );
}

#[test]
fn the_callers_temporary_objects_and_settings_never_reach_the_extension() {
    // Red team, attempt 07: the serving role plants temporary views, tables and functions named
    // like what the extension's statements use, and sets hostile session settings, before it
    // calls the API. Every call answers as in a clean session and no temporary code runs.
    let mut scene = Scene::new("sbx_session_state");
    scene.as_migrator("GRANT CREATE ON SCHEMA {m} TO {s}");
    let mut s = scene.db.connect_as(&scene.server);
    exec(
        &mut s,
        &scene.sql(
            "CREATE TABLE {m}.ran (who text);
             CREATE FUNCTION pg_temp.boom() RETURNS boolean LANGUAGE plpgsql AS $$
             BEGIN INSERT INTO {m}.ran VALUES (current_user); RETURN true; END $$;
             CREATE TEMP VIEW sync_commits AS SELECT 'x'::text AS partition WHERE pg_temp.boom();
             CREATE TEMP VIEW sync_changes AS SELECT 'x'::text AS partition WHERE pg_temp.boom();
             CREATE TEMP TABLE sync_app_tables (tbl text, relation oid, registered_by oid);
             CREATE TEMP VIEW t AS SELECT * FROM {m}.t WHERE pg_temp.boom();
             CREATE TEMP VIEW k AS SELECT 'r'::text AS row_id WHERE pg_temp.boom();
             CREATE TEMP VIEW a AS SELECT 1 AS x WHERE pg_temp.boom();
             CREATE TEMP TABLE jsonb (x int);
             CREATE FUNCTION pg_temp.unnest(text[]) RETURNS SETOF text LANGUAGE plpgsql
               AS $$ BEGIN PERFORM pg_temp.boom(); RETURN; END $$;
             SET search_path = pg_temp, public;
             SET standard_conforming_strings = off; SET row_security = off;
             SET plan_cache_mode = force_custom_plan; SET DateStyle = 'SQL, DMY';
             SET bytea_output = 'escape'; SET extra_float_digits = -15;",
        ),
    );
    let tbl = scene.tbl.clone();
    let a = scene.op("r1", "a\\b");
    let b = scene.op("r2", "b");
    let allowed = json!({"project_id": ["p1"]});
    let out = try_push_as(&mut s, P, "c1", "k1", &[a, b], Some(&allowed), &json!({})).unwrap();
    assert_eq!(out["outcome"], "applied", "{out}");
    let scopes = json!({"project_id": ["p1"]});
    let request = json!({"subscriptions": [{"id": "s1", "table": tbl, "scopes": scopes,
                                             "effective": scopes, "cursor": -1}]});
    let rows: i64 = one(
        &mut s,
        "SELECT count(*) FROM syncular.pull($1, 'c2', 'a1', $2, 'e1', $3, $4) WHERE row_id IS NOT NULL",
        &[&P, &NOW, &V, &request],
    );
    assert_eq!(rows, 2);
    let found: Option<Value> = one(
        &mut s,
        "SELECT syncular.get_row_scopes($1, $2, 'r1')",
        &[&P, &tbl],
    );
    assert_eq!(found.unwrap()["serverVersion"], json!(1));
    let decoded: Value = one(
        &mut s,
        &scene.sql(
            "SELECT syncular.decode_row('{t}', (SELECT \"_sync_payload\" FROM {m}.t
                                                WHERE \"_sync_row_id\" = 'r1'))",
        ),
        &[],
    );
    assert_eq!(decoded["title"], json!("a\\b"));
    assert_eq!(count(&mut scene.c, "syncular.sync_commits"), 1);
    let ran = scene.sql("{m}.ran");
    assert_eq!(count(&mut scene.c, &ran), 0, "a temporary function ran");
}
