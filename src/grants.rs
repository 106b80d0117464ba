//! The API's grants to the roles `syncular_host` and `syncular_admin`, in one place.
//!
//! `_grant_api_roles()` creates the two roles if the cluster has none yet and grants them exactly
//! these functions. The install script runs it (sql/finalize.sql) and every update script ends by
//! running it again with the new library, so the roles keep their grants through every upgrade
//! without the lists being copied into each script (docs/SECURITY.md has the split and why).

use pgrx::prelude::*;

/// What a process serving pushes, pulls and reaction workers calls.
const HOST: &[&str] = &[
    "writer_fence_allows(text, bigint)",
    "lock_partition(text)",
    "append_commit(text, jsonb)",
    "max_commit_seq(text)",
    "read_serve_gate(text, bigint)",
    "serve_gate_refusal(text, bigint, jsonb)",
    "assert_serve_ready(text, bigint, jsonb)",
    "check_schema(bigint, jsonb, jsonb)",
    "read_checkpoints(text)",
    "touch_partition(text, bigint, text)",
    "serve_entry(text, bigint, text, bigint, jsonb)",
    "get_log_epoch(text)",
    "list_partitions()",
    "partition_state(text)",
    "set_row_scopes(text, text, text, jsonb)",
    "set_rows_scopes(text, text, jsonb)",
    "delete_row_meta(text, text, text)",
    "set_blob_refs(text, text, text, text[])",
    "get_row_scopes(text, text, text)",
    "get_push_result(text, text, text)",
    "push_begin(text, text, text, bigint, jsonb)",
    "put_push_result(text, text, text, jsonb)",
    "get_tombstone_seq(text, text, text)",
    "tombstone_seqs(text, text, text[])",
    "clear_tombstone(text, text, text)",
    "enqueue_reactions(text, jsonb)",
    "read_commit_window(text, text, jsonb, bigint, bigint, integer)",
    "scan_rows(text, text, jsonb, text, integer)",
    "latest_scoped_change_seq(text, text, jsonb)",
    "pull(text, text, text, bigint, text, bigint, jsonb, jsonb)",
    "apply_pull(jsonb)",
    "horizon_seq(text)",
    "claim_reactions(text, text, text[], bigint, bigint, integer)",
    "complete_reaction(text, text, text, bigint)",
    "extend_reaction_lease(text, text, text, bigint)",
    "complete_reactions(text, text[], text, bigint)",
    "fail_reaction(text, text, text, jsonb, bigint)",
    "fail_reactions(text, text, jsonb)",
    "get_reaction(text, text)",
    "get_client(text, text)",
    "put_client(text, jsonb)",
    "advance_client_cursor(text, text, text, text, bigint, bigint)",
    "update_client_cursor(text, text, bigint, bigint)",
    "rows_referencing_blob(text, text)",
    "referenced_blob_ids(text)",
    "list_tables()",
    "schema_state()",
    "encode_row(text, jsonb, boolean, bigint)",
    "decode_row(text, bytea, boolean, bigint)",
    "push_commit(text, text, text, text, bigint, bigint, jsonb, text[], text[], smallint[], bigint[], bytea[], jsonb, jsonb)",
    "push_finish(text, text, text, jsonb)",
    "notify_channel()",
    "feed_status()",
];

/// `HOST` plus migrations, registration, fences, checkpoints, retention, operator retries and
/// the admin reads. Neither role gets the trigger and event-trigger functions,
/// `adopt_legacy_tables` or the repairs (extension owner only).
const ADMIN: &[&str] = &[
    "raise_writer_fence(text, bigint)",
    "declare_checkpoint(text, text, bigint, bigint)",
    "claim_checkpoint(text, text, bigint, bigint)",
    "advance_checkpoint(text, text, bigint, bigint, bigint, bigint)",
    "activate_checkpoint(text, text, bigint, bigint, text[], bigint)",
    "source_coverage_seq(text, text[])",
    "has_source_changes_above(text, text[], bigint)",
    "migrate_schema(bigint, jsonb, jsonb)",
    "previous_schema()",
    "rotate_log_epoch(text, text, bigint)",
    "list_partition_registry()",
    "register_table(text, regclass, boolean)",
    "retire_table(text)",
    "set_horizon_seq(text, bigint)",
    "prune_commits_through(text, text, bigint)",
    "commit_seq_before(text, bigint)",
    "prune_commit_log(text, bigint, bigint, bigint, bigint)",
    "retry_reaction(text, text, bigint)",
    "list_reactions(text, integer, text[], text[])",
    "prune_reactions(text, bigint, bigint, integer)",
    "list_client_cursors(text)",
    "list_clients(text)",
    "active_cursor_floor(text, bigint)",
    "list_commit_metadata(text, bigint, integer, text)",
    "scope_activity(text, text, text, integer)",
    "stats(bigint)",
    "set_push_schema(bigint, jsonb)",
    // A migration's rewrite and check of a Citus shard, run as the migration's rewrite runs
    // (src/schema/shards.rs): they check their caller themselves.
    "_payload_rewrite(text, text, jsonb)",
    "_payload_check(text, text)",
];

/// Roles are cluster-wide: the first database that installs the extension creates them. Two
/// first installs in two databases at once both find no role; the second one's `CREATE ROLE`
/// then waits for the first to commit and fails on the unique name — taken as "it exists".
const ROLES_SQL: &str = "\
DO $roles$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'syncular_host') THEN
    BEGIN
      CREATE ROLE syncular_host NOLOGIN;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
    END;
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'syncular_admin') THEN
    BEGIN
      CREATE ROLE syncular_admin NOLOGIN;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
    END;
  END IF;
  IF NOT pg_catalog.pg_has_role('syncular_admin', 'syncular_host', 'MEMBER') THEN
    BEGIN
      GRANT syncular_host TO syncular_admin;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
    END;
  END IF;
END
$roles$;
GRANT USAGE ON SCHEMA syncular TO syncular_host, syncular_admin";

fn grant(functions: &[&str], role: &str) -> String {
    let list: Vec<String> = functions.iter().map(|f| format!("syncular.{f}")).collect();
    format!("GRANT EXECUTE ON FUNCTION {} TO {role}", list.join(", "))
}

#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION syncular._grant_api_roles() RETURNS void
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', '_grant_api_roles_wrapper';
"#
)]
fn _grant_api_roles() {
    crate::error::run(|| {
        Spi::run(ROLES_SQL)?;
        Spi::run(&grant(HOST, "syncular_host"))?;
        Spi::run(&grant(ADMIN, "syncular_admin"))?;
        Ok(())
    })
}
