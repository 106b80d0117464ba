-- syncular walk-through: what a sync server sends, as plain SQL (psql -f scripts/demo.sql).
\set ON_ERROR_STOP 1
\pset footer off
SET client_min_messages = notice;

-- A refusal the walk-through expects: run it, print SQLSTATE, code and DETAIL, and fail the
-- demo if it does not fail.
CREATE FUNCTION pg_temp.expect_refusal(statement text) RETURNS void LANGUAGE plpgsql AS $$
DECLARE state text; msg text; detail text;
BEGIN
  EXECUTE statement;
  RAISE EXCEPTION 'expected a refusal from: %', statement;
EXCEPTION WHEN OTHERS THEN
  GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, msg = MESSAGE_TEXT, detail = PG_EXCEPTION_DETAIL;
  IF msg LIKE 'expected a refusal%' THEN RAISE; END IF;
  RAISE NOTICE 'refused as expected: SQLSTATE % | % | DETAIL %', state, msg, detail;
END $$;

\echo '== 1. CREATE EXTENSION syncular: tables, native fence trigger and API, created once'
CREATE EXTENSION syncular;
SELECT count(*) AS sync_tables FROM pg_tables WHERE schemaname = 'syncular';
SELECT tgname, tgfoid::regprocedure AS function FROM pg_trigger
 WHERE tgrelid = 'syncular.sync_commits'::regclass AND NOT tgisinternal;

\echo '== 2. The host creates its app table, registers it and publishes schema version 1'
CREATE TABLE public.tasks (
  "_sync_partition" text NOT NULL, "_sync_row_id" text NOT NULL,
  id text, project_id text, title text,
  "_sync_server_version" bigint NOT NULL, "_sync_scopes" jsonb NOT NULL,
  "_sync_payload" bytea NOT NULL, "_sync_column_versions" bytea,
  PRIMARY KEY ("_sync_partition", "_sync_row_id"));
SELECT syncular.register_table('tasks', 'public.tasks');
\set layouts '{"tasks":[{"name":"id","type":"string","nullable":false},{"name":"project_id","type":"string","nullable":false},{"name":"title","type":"string","nullable":true}]}'
SELECT syncular.check_schema(1, :'layouts') AS startup_check;
BEGIN;
SELECT syncular.migrate_schema(1, :'layouts') AS previous_version;
COMMIT;
SELECT syncular.check_schema(1, :'layouts') AS startup_check;

\echo '== 3. Request entry: register the partition and pass the serve gate in one call'
SELECT jsonb_pretty(syncular.serve_entry('acme', 1750000000000, 'epoch-1', 1)) AS entry;

\echo '== 4. A push of two rows (docs/HOST-WALKTHROUGH.md): optimistic replay check, then one transaction'
SELECT syncular.get_push_result('acme', 'device-1', 'commit-1') AS replay;
BEGIN;
SELECT syncular.push_begin('acme', 'device-1', 'commit-1', 1) AS stored_result;  -- NULL: new push
SAVEPOINT syncular_push_candidate;
INSERT INTO public.tasks VALUES ('acme', 't1', 't1', 'p1', 'write the spec', 1, '{"project_id":"p1"}', '\x0102', NULL),
                                ('acme', 't2', 't2', 'p1', 'ship it', 1, '{"project_id":"p1"}', '\x0304', NULL);
SELECT syncular.set_row_scopes('acme', 'tasks', 't1', '{"project_id":"p1"}'),
       syncular.set_row_scopes('acme', 'tasks', 't2', '{"project_id":"p1"}');
SELECT syncular.append_commit('acme', '{"clientId":"device-1","clientCommitId":"commit-1","actorId":"alice",
  "createdAtMs":1750000000000,"writerVersion":1,"changes":[
  {"table":"tasks","rowId":"t1","op":"upsert","rowVersion":1,"scopes":{"project_id":"p1"},"payload":"AQI="},
  {"table":"tasks","rowId":"t2","op":"upsert","rowVersion":1,"scopes":{"project_id":"p1"},"payload":"AwQ="}]}') AS commit_seq;
SELECT syncular.put_push_result('acme', 'device-1', 'commit-1',
  '{"status":"applied","commitSeq":1,"recordedAtMs":1750000000000,"cacheIdentity":"3f1c","results":[{"opIndex":0,"status":"applied"},{"opIndex":1,"status":"applied"}]}') AS stored;
COMMIT;

\echo '== 5. A redelivery of the same commit is answered from the stored result'
SELECT syncular.get_push_result('acme', 'device-1', 'commit-1') AS replay;

\echo '== 6. A pull: gate, bounds and the commit window in one REPEATABLE READ snapshot'
BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;
SELECT syncular.assert_serve_ready('acme', 1) AS gate;
SELECT syncular.partition_state('acme') AS state;
SELECT commit_seq, actor_id, idx, row_id, op, row_version, scopes, payload
  FROM syncular.read_commit_window('acme', 'tasks', '{"project_id":["p1"]}', 0, 1, 100);
SELECT row_id, server_version, scopes FROM syncular.scan_rows('acme', 'tasks', '{"project_id":["p1"]}', NULL, 100);
COMMIT;

\echo '== 7. Writer fence: a backfill for version 2 is declared; version-1 writers are refused'
SELECT * FROM syncular.declare_checkpoint('acme', 'tasks-titles', 2, 1750000001000);
SELECT syncular.writer_fence_allows('acme', 1) AS v1_allowed, syncular.writer_fence_allows('acme', 2) AS v2_allowed;
SELECT pg_temp.expect_refusal($$SELECT syncular.append_commit('acme', '{"clientId":"device-2","clientCommitId":"old","actorId":"bob","createdAtMs":1750000002000,"writerVersion":1}')$$);
SELECT pg_temp.expect_refusal($$INSERT INTO syncular.sync_commits (partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms) VALUES ('acme', 2, 'legacy', 'raw', 'bob', 1750000002000)$$);
SELECT syncular.max_commit_seq('acme') AS max_commit_seq_unchanged;

\echo '== 8. Serve gate: a version-2 process that did not declare the pending backfill is refused'
SELECT syncular.serve_gate_refusal('acme', 2) AS refusal;
SELECT pg_temp.expect_refusal($$SELECT syncular.assert_serve_ready('acme', 2)$$);
SELECT syncular.assert_serve_ready('acme', 2, '[{"partition":"acme","name":"tasks-titles","schemaVersion":2}]') AS declaring_worker_token;
\echo '== done'
