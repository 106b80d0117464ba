//! syncular: the storage core of the Syncular sync engine, native inside PostgreSQL.
//!
//! `lib.rs` only wires the modules together; each module owns one concern of the design
//! (docs/DESIGN.md):
//! - [`error`]: the error catalogue and the one place that raises it;
//! - [`access`]: the calling role, the extension owner, and the switches between them;
//! - [`args`], [`limits`], [`db`]: argument decoding and the size caps, SPI with kept plans; [`heap`]: the extension's
//!   tables below SQL (cached OIDs, direct inserts into the commit log);
//! - [`fence`]: the writer-fence trigger and functions (docs/DESIGN.md §Writer fence);
//! - [`jsonb`], [`commit`], [`log`]: the binary commit document, allocation and append
//!   (docs/DESIGN.md §Commit log);
//! - [`gate`]: the serve gate (docs/DESIGN.md §Serve gate);
//! - [`checkpoint`]: backfill checkpoints (docs/DESIGN.md §Checkpoints);
//! - [`barrier`]: the schema barrier (docs/DESIGN.md §Schema barrier);
//! - [`registry`], [`push`], [`prune`]: partition registry, push path and retention
//!   (docs/DESIGN.md §Around the native parts);
//! - [`scope`], [`pull`]: scope filters, the commit window and the bootstrap scan;
//! - [`tables`], [`rows`]: the app-table registry and row metadata (scopes, blobs, tombstones);
//! - [`queue`]: the reaction outbox; [`clients`]: client records and cursors;
//! - [`txn_local`]: transaction-local control state no session can set;
//! - [`admin`]: blob-reference and admin reads; [`adopt`]: adoption of a 0.24 database;
//! - [`repair`]: the owner-only way back from a marker or fence set too high;
//! - [`codec`] (pure, no SQL), [`push_schema`], [`codec_sql`]: upstream's row codec, the
//!   stored push schema and `encode_row`/`decode_row` (docs/CODEC.md);
//! - [`grants`]: what the roles `syncular_host` and `syncular_admin` may call.
//!
//! Privileges, decided per function (docs/SECURITY.md): the API functions are
//! `SECURITY DEFINER` (pinned `search_path = pg_catalog, pg_temp`) so that a host role needs only
//! membership in `syncular_host` / `syncular_admin` and can never write `sync_*` tables itself —
//! in particular it cannot insert an unfenced commit or lower a fence. Functions that must know
//! their caller (registration, adoption, the readers of app tables, the repairs) are
//! `SECURITY INVOKER` and switch rights themselves ([`access`]); no host code ever runs with the
//! extension owner's rights. The fence trigger is a definer function and reads the fence without
//! privilege checks, so every inserting role is fenced.

use pgrx::prelude::*;

mod access;
mod admin;
mod adopt;
mod args;
mod barrier;
mod checkpoint;
mod clients;
mod codec;
mod codec_sql;
mod commit;
mod db;
mod error;
mod fence;
mod gate;
mod grants;
mod heap;
mod jsonb;
mod limits;
mod log;
mod prune;
mod pull;
mod push;
mod push_schema;
mod queue;
mod registry;
mod repair;
mod rows;
mod scope;
mod tables;
mod txn_local;

::pgrx::pg_module_magic!(name, version);

// Tables first: the functions' composite return types need them.
extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
// The trigger and its guard need the trigger function.
extension_sql_file!(
    "../sql/fence_guard.sql",
    name = "fence_guard",
    requires = [
        fence::writer_fence_trigger,
        fence::_fence_guard_busy,
        fence::_fence_guard_hold
    ]
);
// The row-meta trigger function runs with the owner's rights (it writes sync_* tables).
extension_sql!(
    "ALTER FUNCTION syncular.row_meta_trigger() SECURITY DEFINER SET search_path = pg_catalog, pg_temp;",
    name = "row_meta_trigger_definer",
    requires = [tables::row_meta_trigger]
);
// Privileges and comments: after everything else.
extension_sql_file!("../sql/finalize.sql", name = "finalize", finalize);

/// In-backend tests: each runs inside one transaction that is rolled back. The scenarios that
/// need commits, several sessions or locks live in `tests/multisession` (real client).
#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use pgrx::prelude::*;

    fn bigint(sql: &str) -> i64 {
        Spi::get_one::<i64>(sql).expect("query").expect("a value")
    }

    const COMMIT: &str = r#"'{"clientId":"c1","clientCommitId":"k","actorId":"a1","createdAtMs":1,
        "writerVersion":2,"changes":[{"table":"tasks","rowId":"t1","op":"upsert",
        "scopes":{"project_id":"p1"},"payload":"AQID"}]}'"#;

    #[pg_test]
    fn appends_in_one_transaction_are_dense() {
        for expected in 1..=3 {
            assert_eq!(
                bigint(&format!("SELECT syncular.append_commit('p', {COMMIT})")),
                expected
            );
        }
        assert_eq!(bigint("SELECT syncular.max_commit_seq('p')"), 3);
        assert_eq!(
            bigint("SELECT count(*) FROM syncular.sync_change_scopes"),
            3
        );
    }

    /// The change rows and scope index are inserted below SQL only while their tables are as
    /// created: with a trigger on `sync_changes` (or a column added) the whole commit is one
    /// statement again, the trigger fires for every change, and the rows are the same.
    #[pg_test]
    fn direct_and_statement_appends_write_the_same_rows() {
        let rows = |p: &str| {
            Spi::get_one::<String>(&format!(
                "SELECT string_agg(format('%s|%s|%s|%s|%s|%s|%s|%s', commit_seq, idx, tbl, row_id, op,
                                          row_version, scopes, encode(payload, 'hex')), ';' ORDER BY commit_seq, idx)
                 || '/' || (SELECT string_agg(format('%s|%s|%s|%s', tbl, var, value, commit_seq), ';'
                                              ORDER BY tbl, var, value, commit_seq)
                            FROM syncular.sync_change_scopes WHERE partition = '{p}')
                 || '/' || (SELECT string_agg(format('%s|%s|%s', tbl, row_id, commit_seq), ';' ORDER BY tbl, row_id)
                            FROM syncular.sync_tombstones WHERE partition = '{p}')
                 FROM syncular.sync_changes WHERE partition = '{p}'"
            ))
            .expect("query")
            .expect("rows")
        };
        let commit = r#"'{"clientId":"c1","clientCommitId":"k","actorId":"a1","createdAtMs":1,
            "changes":[{"table":"tasks","rowId":"t1","op":"upsert","rowVersion":3,
                        "scopes":{"project_id":"p1","org":"o"},"payload":"AQID"},
                       {"table":"tasks","rowId":"t2","op":"delete","scopes":{"project_id":"p1"}},
                       {"table":"notes","rowId":"n1","op":"upsert","scopes":{}}]}'"#;
        let append = |p: &str| {
            Spi::run(&format!("SELECT syncular.append_commit('{p}', {commit})")).expect("append")
        };
        append("direct");
        Spi::run(
            "CREATE TABLE public.audit (n int);
             CREATE FUNCTION public.audit_change() RETURNS trigger LANGUAGE plpgsql AS
               $$BEGIN INSERT INTO public.audit VALUES (NEW.idx); RETURN NEW; END$$;
             CREATE TRIGGER audit AFTER INSERT ON syncular.sync_changes
               FOR EACH ROW EXECUTE FUNCTION public.audit_change();",
        )
        .expect("trigger");
        append("triggered");
        assert_eq!(bigint("SELECT count(*) FROM public.audit"), 3);
        // The statement form without tombstones, too.
        Spi::run(
            r#"SELECT syncular.append_commit('no-deletes', '{"clientId":"c1","clientCommitId":"k",
                 "actorId":"a1","createdAtMs":1,"changes":[{"table":"tasks","rowId":"t1",
                 "op":"upsert","scopes":{"project_id":"p1"}}]}')"#,
        )
        .expect("append");
        assert_eq!(bigint("SELECT count(*) FROM public.audit"), 4);
        Spi::run("DROP TRIGGER audit ON syncular.sync_changes").expect("drop");
        Spi::run("ALTER TABLE syncular.sync_change_scopes ADD COLUMN note text").expect("alter");
        append("altered");
        let direct = rows("direct");
        assert!(direct.contains("tasks|org|o|1"), "{direct}");
        assert_eq!(rows("triggered"), direct);
        assert_eq!(rows("altered"), direct);
    }

    /// The fence reads the latest committed state plus this transaction's own earlier writes.
    #[pg_test]
    fn fence_sees_the_transactions_own_raise() {
        assert_eq!(bigint("SELECT syncular.raise_writer_fence('p', 2)"), 2);
        assert_eq!(crate::fence::requirement("p").expect("lookup"), Some(2));
        assert!(!crate::fence::allows(Some(2), Some(1)));
        assert_eq!(
            bigint(&format!("SELECT syncular.append_commit('p', {COMMIT})")),
            1
        );
    }

    #[pg_test(error = "sync.storage.writer_fence_rejected")]
    fn fence_rejects_an_old_writer_in_the_same_transaction() {
        Spi::run("SELECT syncular.raise_writer_fence('p', 3)").expect("raise");
        Spi::run(&format!("SELECT syncular.append_commit('p', {COMMIT})")).expect("refused");
    }

    #[pg_test(error = "sync.storage.invalid_commit")]
    fn malformed_commit_is_refused() {
        Spi::run("SELECT syncular.append_commit('p', '{\"clientId\":\"c1\"}')").expect("refused");
    }

    #[pg_test(error = "sync.storage.invalid_argument")]
    fn null_partition_is_refused() {
        Spi::run("SELECT syncular.max_commit_seq(NULL)").expect("refused");
    }

    #[pg_test]
    fn checkpoint_cas_in_one_transaction() {
        Spi::run("SELECT syncular.declare_checkpoint('p', 'x', 1, 10)").expect("declare");
        assert_eq!(
            bigint("SELECT owner_epoch FROM syncular.claim_checkpoint('p', 'x', 1, 11)"),
            1
        );
        assert_eq!(
            bigint("SELECT owner_epoch FROM syncular.claim_checkpoint('p', 'x', 1, 12)"),
            2
        );
        let stale =
            Spi::get_one::<bool>("SELECT syncular.advance_checkpoint('p', 'x', 1, 5, 5, 13)");
        assert_eq!(stale, Ok(Some(false)));
        let owner =
            Spi::get_one::<bool>("SELECT syncular.advance_checkpoint('p', 'x', 2, 5, 5, 13)");
        assert_eq!(owner, Ok(Some(true)));
        let outcome =
            Spi::get_one::<&str>("SELECT syncular.activate_checkpoint('p', 'x', 2, 5, '{}', 14)");
        assert_eq!(outcome, Ok(Some("activated")));
    }

    #[pg_test]
    fn gate_token_lists_pending_in_order() {
        Spi::run("SELECT syncular.declare_checkpoint('b', 'z', 1, 1)").expect("declare");
        Spi::run("SELECT syncular.declare_checkpoint('a', 'y', 1, 1)").expect("declare");
        let token = Spi::get_one::<pgrx::JsonB>("SELECT syncular.read_serve_gate('a', 1)")
            .expect("query")
            .expect("token");
        assert_eq!(
            token.0["pending"],
            serde_json::json!([{"partition":"a","name":"y"},{"partition":"b","name":"z"}])
        );
    }
}

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![]
    }
}
