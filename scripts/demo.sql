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

\echo '== 1. CREATE EXTENSION syncular (a superuser): tables, native fence trigger, API and two roles'
CREATE EXTENSION syncular;
SELECT count(*) AS sync_tables FROM pg_tables WHERE schemaname = 'syncular';
SELECT tgname, tgfoid::regprocedure AS function FROM pg_trigger
 WHERE tgrelid = 'syncular.sync_commits'::regclass AND NOT tgisinternal;
-- The application's login roles: app_migrator administers (syncular_admin), app_server serves
-- (syncular_host). Roles are cluster-wide: created once, kept. On PostgreSQL 15 a plain role
-- cannot create in `public`, so the migrator gets CREATE on the database for its own schema.
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'app_migrator') THEN CREATE ROLE app_migrator LOGIN; END IF;
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'app_server') THEN CREATE ROLE app_server LOGIN; END IF;
  IF NOT pg_has_role('app_migrator', 'syncular_admin', 'MEMBER') THEN GRANT syncular_admin TO app_migrator; END IF;
  IF NOT pg_has_role('app_server', 'syncular_host', 'MEMBER') THEN GRANT syncular_host TO app_server; END IF;
  EXECUTE format('GRANT CREATE ON DATABASE %I TO app_migrator', current_database());
END $$;

\echo '== 2. The migrator creates the app tables in its schema, registers them, publishes schema version 1 and its push schema'
SET ROLE app_migrator;
CREATE SCHEMA app;
CREATE TABLE app.tasks (
  "_sync_partition" text NOT NULL, "_sync_row_id" text NOT NULL,
  id text NOT NULL, project_id text NOT NULL, title text,
  "_sync_server_version" bigint NOT NULL, "_sync_scopes" jsonb NOT NULL,
  "_sync_payload" bytea NOT NULL, "_sync_column_versions" bytea,
  PRIMARY KEY ("_sync_partition", "_sync_row_id"));
CREATE TABLE app.comments (
  "_sync_partition" text NOT NULL, "_sync_row_id" text NOT NULL,
  id text NOT NULL, project_id text NOT NULL, body text NOT NULL,
  "_sync_server_version" bigint NOT NULL, "_sync_scopes" jsonb NOT NULL,
  "_sync_payload" bytea NOT NULL, "_sync_column_versions" bytea,
  PRIMARY KEY ("_sync_partition", "_sync_row_id"));
-- The server writes app rows as itself (push_commit is SECURITY INVOKER): these privileges, no more.
GRANT USAGE ON SCHEMA app TO app_server;
GRANT SELECT, INSERT, UPDATE, DELETE ON app.tasks, app.comments TO app_server;
SELECT syncular.register_table('tasks', 'app.tasks'), syncular.register_table('comments', 'app.comments');
\set layouts '{"tasks":[{"name":"id","type":"string","nullable":false},{"name":"project_id","type":"string","nullable":false},{"name":"title","type":"string","nullable":true}],"comments":[{"name":"id","type":"string","nullable":false},{"name":"project_id","type":"string","nullable":false},{"name":"body","type":"string","nullable":false}]}'
SELECT syncular.check_schema(1, :'layouts') AS startup_check;
BEGIN;
SELECT syncular.migrate_schema(1, :'layouts') AS previous_version;
COMMIT;
SELECT syncular.check_schema(1, :'layouts') AS startup_check;
-- The compiled schema the one-call push decodes payloads with: the same columns as the layouts.
SELECT syncular.set_push_schema(1, (SELECT jsonb_object_agg(tbl, jsonb_build_object('columns', columns, 'primaryKey', 'id',
         'scopes', '[{"variable":"project_id","column":"project_id"}]'::jsonb))
    FROM jsonb_each(:'layouts') AS l(tbl, columns))) AS push_schema_tables;
RESET ROLE;

\echo '== 3. The server (app_server) enters a request: register the partition and pass the serve gate in one call'
SET ROLE app_server;
SELECT jsonb_pretty(syncular.serve_entry('acme', 1750000000000, 'epoch-1', 1)) AS entry;

\echo '== 4. A push in one call: push_commit with the client payloads (sparse rows of the row codec)'
-- A client encodes its rows with its own codec; encode_row(…, sparse => true) makes the same bytes.
SELECT syncular.encode_row('tasks', '{"id":"t1","project_id":"p1","title":"write the spec"}', true) AS t1,
       syncular.encode_row('tasks', '{"id":"t2","project_id":"p1","title":"ship it"}', true) AS t2 \gset
SELECT :'t1' AS t1_payload, :'t2' AS t2_payload;
\set allowed '{"project_id":["p1"]}'
SELECT jsonb_pretty(syncular.push_commit('acme', 'device-1', 'commit-1', 'alice', 1750000000000, 1, :'allowed',
  ARRAY['tasks', 'tasks'], ARRAY['t1', 't2'], ARRAY[1, 1]::int2[], ARRAY[NULL, NULL]::int8[], ARRAY[:'t1', :'t2']::bytea[],
  options => '{"cacheIdentity":"3f1c"}')) AS applied;
SELECT "_sync_row_id" AS row_id, title, "_sync_server_version" AS version, "_sync_scopes" AS scopes, "_sync_payload" AS payload
  FROM app.tasks ORDER BY 1;

\echo '== 5. A redelivery of the same commit is answered from the stored result (cached), nothing written'
SELECT jsonb_pretty(syncular.push_commit('acme', 'device-1', 'commit-1', 'alice', 1750000000000, 1, :'allowed',
  ARRAY['tasks', 'tasks'], ARRAY['t1', 't2'], ARRAY[1, 1]::int2[], ARRAY[NULL, NULL]::int8[], ARRAY[:'t1', :'t2']::bytea[],
  options => '{"cacheIdentity":"9d2e"}')) AS replay;

\echo '== 6. A conflict: device-1 edits t1 from version 1 (applied, version 2); device-2 then edits it from version 1 too'
SELECT syncular.push_commit('acme', 'device-1', 'commit-2', 'alice', 1750000001000, 1, :'allowed',
  ARRAY['tasks'], ARRAY['t1'], ARRAY[1]::int2[], ARRAY[1]::int8[],
  ARRAY[syncular.encode_row('tasks', '{"id":"t1","title":"write the spec, v2"}', true)],
  options => '{"cacheIdentity":"a71b"}') -> 'commitSeq' AS applied_as;
SELECT syncular.push_commit('acme', 'device-2', 'commit-1', 'bob', 1750000002000, 1, :'allowed',
  ARRAY['tasks'], ARRAY['t1'], ARRAY[1]::int2[], ARRAY[1]::int8[],
  ARRAY[syncular.encode_row('tasks', '{"id":"t1","title":"a stale edit"}', true)],
  options => '{"cacheIdentity":"c40d"}') AS conflict \gset
SELECT jsonb_pretty(:'conflict') AS conflict;
-- The conflict record carries the server's row (row codec, base64) and a bitmap of the columns
-- that moved past baseVersion (04: column 2, title); the rejection consumed no commit_seq.
SELECT syncular.decode_row('tasks', decode(:'conflict'::jsonb #>> '{result,results,0,serverRow}', 'base64')) AS server_row,
       syncular.max_commit_seq('acme') AS max_commit_seq;

\echo '== 7. Host code: comments have a row validator, so push_commit hands the commit back and the classic path runs it'
\set c1 '{"id":"c1","project_id":"p1","body":"looks good"}'
SELECT syncular.encode_row('comments', :'c1', true) AS c1_payload \gset
SELECT syncular.push_commit('acme', 'device-1', 'commit-3', 'alice', 1750000003000, 1, :'allowed',
  ARRAY['comments'], ARRAY['c1'], ARRAY[1]::int2[], ARRAY[NULL]::int8[], ARRAY[:'c1_payload']::bytea[],
  options => '{"rowValidatorTables":["comments"]}') AS fallback;
-- Nothing was stored: the classic path (docs/HOST-WALKTHROUGH.md) answers this commit, and the
-- host runs its validator between the reads and the writes.
SELECT syncular.get_push_result('acme', 'device-1', 'commit-3') AS replay;
BEGIN;
SELECT syncular.push_begin('acme', 'device-1', 'commit-3', 1) AS stored_result;  -- NULL: new push
SAVEPOINT syncular_push_candidate;
-- The host decodes the payload with its codec (decode_row stands in) and validates the values;
-- it stores the full row.
SELECT syncular.decode_row('comments', :'c1_payload', true) AS decoded;
SELECT syncular.encode_row('comments', :'c1') AS c1_row \gset
INSERT INTO app.comments VALUES ('acme', 'c1', 'c1', 'p1', 'looks good', 1, '{"project_id":"p1"}', :'c1_row', NULL);
SELECT syncular.set_row_scopes('acme', 'comments', 'c1', '{"project_id":"p1"}');
SELECT syncular.append_commit('acme', jsonb_build_object('clientId', 'device-1', 'clientCommitId', 'commit-3',
  'actorId', 'alice', 'createdAtMs', 1750000003000, 'writerVersion', 1, 'changes', jsonb_build_array(
  jsonb_build_object('table', 'comments', 'rowId', 'c1', 'op', 'upsert', 'rowVersion', 1,
                     'scopes', '{"project_id":"p1"}'::jsonb, 'payload', encode(:'c1_row', 'base64'))))) AS commit_seq;
SELECT syncular.put_push_result('acme', 'device-1', 'commit-3',
  '{"status":"applied","commitSeq":3,"recordedAtMs":1750000003000,"cacheIdentity":"5e8a","results":[{"opIndex":0,"status":"applied"}]}') AS stored;
COMMIT;

\echo '== 8. A pull in one call: gate, client record, both subscriptions and the new cursor, in one snapshot'
-- (The rows are kept in a temporary table only to print the document apart from the rows.)
CREATE TEMP TABLE pulled AS SELECT * FROM syncular.pull('acme', 'device-3', 'carol', 1750000004000, 'epoch-1', 1,
  '{"limitCommits":100,"subscriptions":[
     {"id":"s1","table":"tasks","scopes":{"project_id":["p1"]},"effective":{"project_id":["p1"]},"cursor":0},
     {"id":"s2","table":"comments","scopes":{"project_id":["p1"]},"effective":{"project_id":["p1"]},"cursor":0}]}');
SELECT jsonb_pretty(document) AS document FROM pulled WHERE document IS NOT NULL;
SELECT sub, commit_seq, actor_id, idx, row_id, op, row_version, payload FROM pulled WHERE document IS NULL
 ORDER BY sub, commit_seq, idx;
SELECT syncular.get_client('acme', 'device-3') AS client_record;
RESET ROLE;

\echo '== 9. Writer fence: the migrator declares a backfill for version 2; version-1 writers are refused'
SET ROLE app_migrator;
SELECT * FROM syncular.declare_checkpoint('acme', 'tasks-titles', 2, 1750000005000);
SELECT syncular.writer_fence_allows('acme', 1) AS v1_allowed, syncular.writer_fence_allows('acme', 2) AS v2_allowed;
SET ROLE app_server;
SELECT pg_temp.expect_refusal($$SELECT syncular.push_commit('acme', 'device-1', 'commit-4', 'alice', 1750000006000, 1,
  '{"project_id":["p1"]}', ARRAY['tasks'], ARRAY['t2'], ARRAY[2]::int2[], ARRAY[NULL]::int8[], ARRAY[NULL]::bytea[])$$);
SELECT pg_temp.expect_refusal($$SELECT syncular.append_commit('acme', '{"clientId":"device-2","clientCommitId":"old","actorId":"bob","createdAtMs":1750000006000,"writerVersion":1}')$$);
RESET ROLE;
-- Even the superuser's raw INSERT into the log is stopped by the fence trigger.
SELECT pg_temp.expect_refusal($$INSERT INTO syncular.sync_commits (partition, commit_seq, client_id, client_commit_id, actor_id, created_at_ms) VALUES ('acme', 4, 'legacy', 'raw', 'bob', 1750000006000)$$);
SELECT syncular.max_commit_seq('acme') AS max_commit_seq_unchanged;

\echo '== 10. Serve gate: a version-2 process that did not declare the pending backfill is refused'
SET ROLE app_server;
SELECT syncular.serve_gate_refusal('acme', 2) AS refusal;
SELECT pg_temp.expect_refusal($$SELECT syncular.assert_serve_ready('acme', 2)$$);
SELECT syncular.assert_serve_ready('acme', 2, '[{"partition":"acme","name":"tasks-titles","schemaVersion":2}]') AS declaring_worker_token;
RESET ROLE;
\echo '== done'
