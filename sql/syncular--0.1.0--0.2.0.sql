-- syncular 0.1.0 → 0.2.0
--
-- 0.2.0: the fence trigger reads the fence and the marker with direct primary-key index scans;
-- jsonb arguments are parsed without panics (deep nesting and out-of-range numbers become
-- sync.storage.invalid_argument); new function set_rows_scopes (batch set_row_scopes); the row
-- codec: table sync_push_schemas, set_push_schema, encode_row, decode_row (docs/CODEC.md);
-- schema evolution: migrate_schema re-encodes stored rows, table sync_schema_layouts.
-- Security (docs/SECURITY.md): registrations keep the relation's OID and their registrant; the
-- functions that read app tables run as the caller and read the table as its owner in a
-- restricted security context; control state left the session-settable settings; the roles
-- syncular_host and syncular_admin; owner-only repairs audited in sync_repairs; argument caps.
-- tests/multisession/tests/upgrade.rs proves that an install updated by this script and a fresh
-- install of 0.2.0 have the same catalog.
--
-- Conventions for every update script of this extension:
-- - it runs in ALTER EXTENSION's single transaction, so no committed state ever lacks the fence;
-- - before touching the fence trigger it sets the guard's flag, so the event triggers do not
--   react to the script's own DDL (from 0.2.0 on; a setting no longer does it):
--     SELECT syncular._fence_guard_hold(true);
-- - it ends with SELECT syncular._grant_api_roles(), so the roles keep exactly the grants of
--   the new version (src/grants.rs);
-- - it runs with search_path = syncular, pg_temp (pg_catalog first), in a schema where a role
--   given CREATE on it (a 0.24 host during a rolling upgrade) may have put functions and
--   operators of its own: every operator whose operand types have no exact match in pg_catalog
--   (oid against regclass, …) is written OPERATOR(pg_catalog.…), every function is qualified,
--   so nothing such a role made runs with the installing superuser's rights (docs/SECURITY.md,
--   "Installing");
-- - released install scripts (sql/released/) and update scripts are never edited afterwards;
-- - exported symbols of the library are never removed (an update chain loads the newest
--   library for every older install script).

-- Before anything: the database's encoding: UTF8 only. Upstream's strings are Unicode, and everything the
--    extension reads from a row (ids, scopes, documents) is taken as UTF-8 text; in another
--    encoding (SQL_ASCII stores any bytes) a value would be misread — a scope value rewritten
--    could match another tenant's (red team 40, F2).
DO $encoding$
BEGIN
  IF pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.<>) 'UTF8' THEN
    RAISE EXCEPTION 'syncular: the database encoding is %, not UTF8', pg_catalog.getdatabaseencoding()
      USING ERRCODE = 'feature_not_supported',
            HINT = 'Install syncular in a database created with ENCODING ''UTF8'' (docs/API.md, Conventions).';
  END IF;
END
$encoding$;

-- First: the schema. 0.1.0 was installed into an existing schema named syncular whoever owned
-- it; 0.2.0 installs only into one no other role controlled (sql/schema.sql, step 0). An install
-- whose schema is not the superuser-owned schema named syncular (owned by another role from the
-- start, or renamed afterwards) is refused here rather than updated.
DO $update_schema$
DECLARE
  schema_name pg_catalog.name;
  owner_name pg_catalog.name;
  owner_super boolean;
BEGIN
  SELECT n.nspname, r.rolname, r.rolsuper INTO schema_name, owner_name, owner_super
    FROM pg_catalog.pg_extension e
    JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) e.extnamespace
    JOIN pg_catalog.pg_authid r ON r.oid OPERATOR(pg_catalog.=) n.nspowner
   WHERE e.extname OPERATOR(pg_catalog.=) 'syncular';
  IF schema_name OPERATOR(pg_catalog.<>) 'syncular' OR NOT owner_super THEN
    RAISE EXCEPTION 'syncular: the extension''s schema is not the superuser-owned schema "syncular"'
      USING ERRCODE = 'invalid_schema_definition',
            DETAIL = pg_catalog.format('The extension is in schema %I, owned by role %I.', schema_name, owner_name),
            HINT = 'Another role owned or renamed the schema the extension was installed into, and '
                   'could have run code with the rights of whoever used it: check what it holds '
                   'before giving it back to a superuser or reinstalling (docs/SECURITY.md, "Installing").';
  END IF;
END
$update_schema$;

CREATE FUNCTION syncular.set_rows_scopes("partition" text, "tbl" text, "rows" jsonb) RETURNS integer
VOLATILE SECURITY DEFINER PARALLEL UNSAFE
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'set_rows_scopes_wrapper';
REVOKE ALL ON FUNCTION syncular.set_rows_scopes(text, text, jsonb) FROM PUBLIC;
COMMENT ON FUNCTION syncular.set_rows_scopes(text, text, jsonb) IS
  'Batch set_row_scopes: makes each listed row''s scope entries exactly its scopes, in one statement; returns the entries held.';

-- Between installing the 0.2.0 library and running this update, register_table and the readers
-- of app tables need the columns added here: run ALTER EXTENSION syncular UPDATE right after
-- installing the package (the rest of the API keeps working on a 0.1.0 install).
-- Registrations: the relation by OID and the role that registered it. A registration whose
-- relation no longer exists could never be read again (every use needed the relation); it is
-- dropped here, its row metadata stays until retire_table. The registrant of an existing
-- registration is taken to be the relation's owner.
ALTER TABLE syncular.sync_app_tables ADD COLUMN relation regclass, ADD COLUMN registered_by regrole;
UPDATE syncular.sync_app_tables a
   SET relation = c.oid::regclass, registered_by = c.relowner::regrole
  FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
 WHERE n.nspname OPERATOR(pg_catalog.=) a.relation_schema AND c.relname OPERATOR(pg_catalog.=) a.relation_name;
DELETE FROM syncular.sync_app_tables WHERE relation IS NULL;
ALTER TABLE syncular.sync_app_tables
  ALTER COLUMN relation SET NOT NULL, ALTER COLUMN registered_by SET NOT NULL;

CREATE TABLE syncular.sync_repairs (
  repaired_at  timestamptz NOT NULL,
  session_role name        NOT NULL,
  acting_role  name        NOT NULL,
  action       text        COLLATE "C" NOT NULL,
  partition    text        COLLATE "C",
  before       jsonb       NOT NULL,
  after        jsonb       NOT NULL,
  reason       text        NOT NULL
);
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_repairs', '');
REVOKE ALL ON syncular.sync_repairs FROM PUBLIC;

-- The fence guard's flag: backend memory instead of a setting any session could set.
CREATE OR REPLACE FUNCTION syncular._fence_guard_busy() RETURNS boolean
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', '_fence_guard_busy_wrapper';
CREATE FUNCTION syncular._fence_guard_hold(busy boolean) RETURNS void
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', '_fence_guard_hold_wrapper';
REVOKE ALL ON FUNCTION syncular._fence_guard_hold(boolean) FROM PUBLIC;

CREATE OR REPLACE FUNCTION syncular._fence_guard_on_drop() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
  -- Only a DROP TRIGGER that dropped a trigger of sync_commits in the extension's own schema
  -- concerns the guard; every other one (on any table of the database) returns here, before a
  -- name in schema syncular is resolved (docs/SECURITY.md, "Installing").
  IF NOT EXISTS (
    SELECT 1 FROM pg_catalog.pg_event_trigger_dropped_objects() o
      JOIN pg_catalog.pg_namespace n ON n.nspname = o.address_names[1]
      JOIN pg_catalog.pg_extension e ON e.extnamespace = n.oid AND e.extname = 'syncular'
     WHERE o.object_type = 'trigger' AND o.address_names[1] = 'syncular'
       AND o.address_names[2] = 'sync_commits') THEN
    RETURN;
  END IF;
  -- (A separate statement: a name in an expression is resolved when it is planned, even where
  -- the expression would not evaluate it.)
  IF syncular._fence_guard_busy() THEN
    RETURN;
  END IF;
  IF syncular._native_fence_triggers() = 0 THEN
    PERFORM syncular._fence_guard_hold(true);
    CREATE TRIGGER sync_commits_writer_fence_guard
      BEFORE INSERT ON syncular.sync_commits
      FOR EACH ROW EXECUTE FUNCTION syncular.writer_fence_trigger();
    PERFORM syncular._fence_guard_hold(false);
  END IF;
END
$$;

CREATE OR REPLACE FUNCTION syncular._fence_guard_on_create() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
  foreign_fence boolean;
BEGIN
  -- Only a CREATE TRIGGER on sync_commits in the extension's own schema concerns the guard
  -- (see _fence_guard_on_drop).
  IF NOT EXISTS (
    SELECT 1 FROM pg_catalog.pg_event_trigger_ddl_commands() d
      JOIN pg_catalog.pg_trigger t ON t.oid = d.objid
      JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
      JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
      JOIN pg_catalog.pg_extension e ON e.extnamespace = n.oid AND e.extname = 'syncular'
     WHERE d.classid = 'pg_catalog.pg_trigger'::pg_catalog.regclass
       AND c.relname = 'sync_commits' AND n.nspname = 'syncular') THEN
    RETURN;
  END IF;
  IF syncular._fence_guard_busy() THEN
    RETURN;
  END IF;
  SELECT EXISTS (
    SELECT 1 FROM pg_catalog.pg_trigger t
     WHERE t.tgrelid = 'syncular.sync_commits'::regclass
       AND t.tgname = 'sync_commits_writer_fence'
       AND t.tgfoid <> 'syncular.writer_fence_trigger()'::regprocedure)
    INTO foreign_fence;
  IF NOT foreign_fence THEN
    RETURN;
  END IF;
  PERFORM syncular._fence_guard_hold(true);
  DROP TRIGGER sync_commits_writer_fence ON syncular.sync_commits;
  IF EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t
              WHERE t.tgrelid = 'syncular.sync_commits'::regclass
                AND t.tgname = 'sync_commits_writer_fence_guard') THEN
    ALTER TRIGGER sync_commits_writer_fence_guard ON syncular.sync_commits
      RENAME TO sync_commits_writer_fence;
  ELSE
    CREATE TRIGGER sync_commits_writer_fence
      BEFORE INSERT ON syncular.sync_commits
      FOR EACH ROW EXECUTE FUNCTION syncular.writer_fence_trigger();
  END IF;
  PERFORM syncular._fence_guard_hold(false);
END
$$;

-- Readers of app tables need their caller: SECURITY INVOKER, switching rights themselves.
ALTER FUNCTION syncular.get_row_scopes(text, text, text) SECURITY INVOKER;
ALTER FUNCTION syncular.scan_rows(text, text, jsonb, text, integer) SECURITY INVOKER;
ALTER FUNCTION syncular.rows_referencing_blob(text, text) SECURITY INVOKER;

CREATE FUNCTION syncular.repair_schema_marker(schema_version bigint, writer_floor bigint, reason text)
RETURNS jsonb VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'repair_schema_marker_wrapper';
CREATE FUNCTION syncular.repair_writer_fence("partition" text, required_writer_version bigint, reason text)
RETURNS jsonb VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'repair_writer_fence_wrapper';
REVOKE ALL ON FUNCTION syncular.repair_schema_marker(bigint, bigint, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION syncular.repair_writer_fence(text, bigint, text) FROM PUBLIC;

CREATE FUNCTION syncular._grant_api_roles() RETURNS void
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', '_grant_api_roles_wrapper';
REVOKE ALL ON FUNCTION syncular._grant_api_roles() FROM PUBLIC;
COMMENT ON FUNCTION syncular._grant_api_roles() IS 'Internal, extension owner only: creates the roles syncular_host and syncular_admin if missing and grants them the API (run by every install and update script).';

COMMENT ON FUNCTION syncular._fence_guard_busy() IS 'Internal: true while the fence guard reacts to its own DDL (transaction-local state no session can set).';
COMMENT ON FUNCTION syncular._fence_guard_hold(boolean) IS 'Internal, extension owner only: sets the fence guard''s busy flag for the rest of the (sub)transaction.';
COMMENT ON FUNCTION syncular.repair_schema_marker(bigint, bigint, text) IS
  'Extension owner only: lowers the stored schema version and the global writer floor, with a reason; audited in sync_repairs.';
COMMENT ON FUNCTION syncular.repair_writer_fence(text, bigint, text) IS
  'Extension owner only: lowers a partition''s writer fence, with a reason; audited in sync_repairs.';
COMMENT ON FUNCTION syncular.register_table(text, regclass, boolean) IS
  'Registers the relation holding an app table (caller must own it, and hold the privileges of an earlier registrant); optionally installs the row-meta trigger.';
COMMENT ON FUNCTION syncular.retire_table(text) IS
  'Removes a retired table''s row scopes, blob refs, registration and trigger (caller must hold the registrant''s privileges); keeps history.';
COMMENT ON FUNCTION syncular.adopt_legacy_tables(name, name) IS
  'Extension owner or superuser only: one-time adoption of a 0.24 database''s tables into the (empty) extension tables, in the caller''s transaction.';

CREATE FUNCTION syncular.schema_state() RETURNS jsonb
STABLE STRICT SECURITY DEFINER PARALLEL UNSAFE
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'schema_state_wrapper';
CREATE FUNCTION syncular.list_tables() RETURNS jsonb
STABLE STRICT SECURITY DEFINER PARALLEL UNSAFE
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'list_tables_wrapper';
REVOKE ALL ON FUNCTION syncular.schema_state(), syncular.list_tables() FROM PUBLIC;
COMMENT ON FUNCTION syncular.schema_state() IS
  'The stored schema state {schemaVersion, layouts, writerFloor}, or NULL before the first migration.';
COMMENT ON FUNCTION syncular.list_tables() IS
  'Every app-table registration: [{table, relation (NULL once gone), registeredBy, maintainRowMeta, registeredAtMs}], by name.';

CREATE FUNCTION syncular.stats(active_since_ms bigint DEFAULT 0) RETURNS jsonb
STABLE SECURITY DEFINER PARALLEL UNSAFE
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'stats_wrapper';
REVOKE ALL ON FUNCTION syncular.stats(bigint) FROM PUBLIC;
COMMENT ON FUNCTION syncular.stats(bigint) IS
  'Health per partition: log (maxCommitSeq, horizonSeq, commits, changes), clients (all, active since the time, max active lag), pending checkpoints, reactions by state.';

-- The push schema and the row codec (docs/CODEC.md).
CREATE TABLE syncular.sync_push_schemas (
  schema_version bigint PRIMARY KEY,
  tables         jsonb  NOT NULL,
  updated_at_ms  bigint NOT NULL
);
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_push_schemas', '');
REVOKE ALL ON syncular.sync_push_schemas FROM PUBLIC;
CREATE FUNCTION syncular.set_push_schema(schema_version bigint, tables jsonb) RETURNS integer
VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'set_push_schema_wrapper';
CREATE FUNCTION syncular.encode_row(tbl text, "values" jsonb, sparse boolean DEFAULT false,
                                    schema_version bigint DEFAULT NULL) RETURNS bytea
STABLE PARALLEL UNSAFE SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'encode_row_wrapper';
CREATE FUNCTION syncular.decode_row(tbl text, payload bytea, sparse boolean DEFAULT false,
                                    schema_version bigint DEFAULT NULL) RETURNS jsonb
STABLE PARALLEL UNSAFE SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'decode_row_wrapper';
REVOKE ALL ON FUNCTION syncular.set_push_schema(bigint, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION syncular.encode_row(text, jsonb, boolean, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION syncular.decode_row(text, bytea, boolean, bigint) FROM PUBLIC;

-- Schema evolution (docs/API.md §5): the layouts of every schema version, as in
-- sql/schema.sql, table 19. migrate_schema adds the stored version's layouts on its next bump.
CREATE TABLE syncular.sync_schema_layouts (
  schema_version bigint PRIMARY KEY,
  layouts        text   NOT NULL
);
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_schema_layouts', '');
REVOKE ALL ON syncular.sync_schema_layouts FROM PUBLIC;
-- Who wrote the marker's row version, as in sql/schema.sql, table 14, stamped by its trigger on
-- every write (the row codec's snapshot check, docs/SECURITY.md rule 19).
ALTER TABLE syncular.sync_schema_meta
  ADD COLUMN written_by bigint, ADD COLUMN written_in bigint, ADD COLUMN stamp bigint;
-- sql/schema.sql, table 14b (not a configuration table: no dump carries it).
CREATE TABLE syncular.sync_schema_stamp (
  id    integer PRIMARY KEY CHECK (id = 1),
  stamp bigint  NOT NULL
);
REVOKE ALL ON syncular.sync_schema_stamp FROM PUBLIC;
CREATE FUNCTION syncular.schema_marker_stamp() RETURNS trigger
LANGUAGE c AS 'MODULE_PATHNAME', 'schema_marker_stamp_wrapper';
REVOKE ALL ON FUNCTION syncular.schema_marker_stamp() FROM PUBLIC;
COMMENT ON FUNCTION syncular.schema_marker_stamp() IS
  'Native trigger on sync_schema_meta (ENABLE ALWAYS): BEFORE INSERT OR UPDATE stamps each row version with the transaction that writes it (written_by, written_in) and a random stamp, AFTER keeps the stamp in sync_schema_stamp, however the row is written.';
-- The triggers and their guard, as sql/stamp_guard.sql installs them.
ALTER FUNCTION syncular.schema_marker_stamp()
  SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
CREATE TRIGGER sync_schema_meta_stamp BEFORE INSERT OR UPDATE ON syncular.sync_schema_meta
  FOR EACH ROW EXECUTE FUNCTION syncular.schema_marker_stamp();
CREATE TRIGGER sync_schema_meta_stamp_kept AFTER INSERT OR UPDATE ON syncular.sync_schema_meta
  FOR EACH ROW EXECUTE FUNCTION syncular.schema_marker_stamp();
ALTER TABLE syncular.sync_schema_meta
  ENABLE ALWAYS TRIGGER sync_schema_meta_stamp, ENABLE ALWAYS TRIGGER sync_schema_meta_stamp_kept;
CREATE FUNCTION syncular.schema_stamp_own() RETURNS trigger
LANGUAGE c AS 'MODULE_PATHNAME', 'schema_stamp_own_wrapper';
ALTER FUNCTION syncular.schema_stamp_own() SET search_path = pg_catalog, pg_temp;
REVOKE ALL ON FUNCTION syncular.schema_stamp_own() FROM PUBLIC;
COMMENT ON FUNCTION syncular.schema_stamp_own() IS
  'Native BEFORE INSERT OR UPDATE trigger on sync_schema_stamp (ENABLE ALWAYS): lets through only the stamp''s own write; any other (a subscriber''s apply, a restore, a hand-made write) is skipped.';
CREATE TRIGGER sync_schema_stamp_own BEFORE INSERT OR UPDATE ON syncular.sync_schema_stamp
  FOR EACH ROW EXECUTE FUNCTION syncular.schema_stamp_own();
ALTER TABLE syncular.sync_schema_stamp ENABLE ALWAYS TRIGGER sync_schema_stamp_own;
CREATE FUNCTION syncular._stamp_guard() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
  t record;
BEGIN
  -- Only DDL on the two tables in the extension's own schema concerns the guard; every other
  -- command (on any table of the database) returns here.
  IF NOT EXISTS (
    SELECT 1 FROM pg_catalog.pg_event_trigger_ddl_commands() d
      LEFT JOIN pg_catalog.pg_trigger g
        ON d.classid = 'pg_catalog.pg_trigger'::pg_catalog.regclass AND g.oid = d.objid
      JOIN pg_catalog.pg_class c
        ON c.oid = CASE WHEN d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass
                        THEN d.objid ELSE g.tgrelid END
      JOIN pg_catalog.pg_extension e ON e.extnamespace = c.relnamespace AND e.extname = 'syncular'
     WHERE c.relname IN ('sync_schema_meta', 'sync_schema_stamp')) THEN
    RETURN;
  END IF;
  -- By their functions, whatever their names (a renamed trigger too, red team 28).
  FOR t IN
    SELECT c.relname, g.tgname FROM pg_catalog.pg_trigger g
      JOIN pg_catalog.pg_class c ON c.oid = g.tgrelid
     WHERE c.relnamespace = 'syncular'::pg_catalog.regnamespace
       AND ((c.relname = 'sync_schema_meta'
             AND g.tgfoid = 'syncular.schema_marker_stamp()'::pg_catalog.regprocedure)
         OR (c.relname = 'sync_schema_stamp'
             AND g.tgfoid = 'syncular.schema_stamp_own()'::pg_catalog.regprocedure))
       AND g.tgenabled <> 'A'
  LOOP
    EXECUTE pg_catalog.format('ALTER TABLE syncular.%I ENABLE ALWAYS TRIGGER %I', t.relname, t.tgname);
  END LOOP;
END
$$;
REVOKE ALL ON FUNCTION syncular._stamp_guard() FROM PUBLIC;
COMMENT ON FUNCTION syncular._stamp_guard() IS
  'Internal: event trigger function keeping the stamp''s three triggers enabled ALWAYS after any ALTER TABLE, CREATE or ALTER TRIGGER of sync_schema_meta or sync_schema_stamp.';
CREATE EVENT TRIGGER syncular_stamp_guard ON ddl_command_end
  WHEN TAG IN ('ALTER TABLE', 'CREATE TRIGGER', 'ALTER TRIGGER')
  EXECUTE FUNCTION syncular._stamp_guard();
ALTER EVENT TRIGGER syncular_stamp_guard ENABLE ALWAYS;
-- A marker set before the update is rewritten by it, stamped with the update: a later id than
-- its own, so the check is only stricter until the next migration.
UPDATE syncular.sync_schema_meta SET id = id;
-- migrate_schema runs the host code of the tables it re-encodes for its caller, so it must know
-- it (docs/SECURITY.md rule 19): SECURITY INVOKER from 0.2.0, its sync_* statements as the owner.
ALTER FUNCTION syncular.migrate_schema(bigint, jsonb, jsonb) SECURITY INVOKER;
COMMENT ON FUNCTION syncular.migrate_schema(bigint, jsonb, jsonb) IS
  'Opens a migration in the caller''s transaction under the barrier lock, re-validates, installs declarations, fences and the global floor, re-encodes the stored rows of registered tables whose layout grew; returns the previously stored version.';
COMMENT ON FUNCTION syncular.previous_schema() IS
  'The {schemaVersion, layouts} the last migrate_schema of this transaction started from (with rewritten: rows re-encoded per table, when it re-encoded any), or NULL.';

-- Row codec and push schema (docs/API.md §Row codec and push schema, docs/CODEC.md)
COMMENT ON FUNCTION syncular.set_push_schema(bigint, jsonb) IS
  'Stores the host''s compiled schema for a schema version after checking it against the registered relations and the stored layouts; idempotent; returns the number of tables.';
COMMENT ON FUNCTION syncular.encode_row(text, jsonb, boolean, bigint) IS
  'Encodes a row given as JSON with the table''s push schema (full row, or sparse row with only the given columns), at the stored schema version or the one given; bad input: SY000 with the codec''s message as reason.';
COMMENT ON FUNCTION syncular.decode_row(text, bytea, boolean, bigint) IS
  'Decodes a full or sparse row payload with the table''s push schema (or layouts) at the stored schema version or the one given, into JSON (absent columns omitted); bad input: SY000 with the codec''s message as reason.';

-- 0.2.0: the one-call pull (docs/API.md §Pull). SECURITY INVOKER: a bootstrap reads app tables.
CREATE FUNCTION syncular."pull"(
	"partition" TEXT,
	"client_id" TEXT,
	"actor_id" TEXT,
	"now_ms" bigint,
	"initial_log_epoch" TEXT,
	"running_schema_version" bigint,
	"request" jsonb,
	"declared" jsonb DEFAULT '[]'
) RETURNS TABLE (
	"sub" INT,
	"commit_seq" bigint,
	"created_at_ms" bigint,
	"actor_id" TEXT,
	"idx" INT,
	"row_id" TEXT,
	"op" TEXT,
	"row_version" bigint,
	"scopes" jsonb,
	"payload" bytea,
	"column_versions" bytea,
	"document" jsonb
)
VOLATILE PARALLEL UNSAFE
SET search_path TO pg_catalog, pg_temp
LANGUAGE c
AS 'MODULE_PATHNAME', 'pull_wrapper';
REVOKE ALL ON FUNCTION syncular.pull(text, text, text, bigint, text, bigint, jsonb, jsonb) FROM PUBLIC;
COMMENT ON FUNCTION syncular.pull(text, text, text, bigint, text, bigint, jsonb, jsonb) IS
  'A whole pull request in one call and one snapshot: gate, client record, every subscription''s window or bootstrap page (the classic path''s decisions), registry touch and the record''s new cursor; a document row first, then the rows.';

-- 0.2.0: reactions at queue speed (docs/DESIGN.md §8 sync_reactions, "The claim index").
-- The claim reads one partial expression index in claim order; the terminal states' indexes
-- become partial. An extension script runs in one transaction, where CREATE INDEX CONCURRENTLY
-- is impossible: building an index here holds a SHARE lock on sync_reactions (reads go on;
-- enqueue, claim and acknowledgements wait) for a time proportional to the table. To avoid that
-- wait on a large outbox, build the three indexes beforehand with CREATE INDEX CONCURRENTLY and
-- exactly these definitions (docs/API.md §11, upgrading); the script keeps them after checking
-- they are what it would have built, and only drops the old ones (brief ACCESS EXCLUSIVE locks).
DROP INDEX IF EXISTS syncular.sync_reactions_due;
DROP INDEX IF EXISTS syncular.sync_reactions_lease;
DO $reaction_indexes$
DECLARE
  old_completed text := 'CREATE INDEX sync_reactions_completed ON syncular.sync_reactions USING btree (partition, status, completed_at_ms, idempotency_key)';
  old_dead text := 'CREATE INDEX sync_reactions_dead_letter ON syncular.sync_reactions USING btree (partition, status, available_at_ms, idempotency_key)';
BEGIN
  -- The 0.1.0 definitions of the two names that stay: replaced (not pre-built).
  IF pg_catalog.pg_get_indexdef('syncular.sync_reactions_completed'::pg_catalog.regclass) OPERATOR(pg_catalog.=) old_completed THEN
    DROP INDEX syncular.sync_reactions_completed;
  END IF;
  IF pg_catalog.pg_get_indexdef('syncular.sync_reactions_dead_letter'::pg_catalog.regclass) OPERATOR(pg_catalog.=) old_dead THEN
    DROP INDEX syncular.sync_reactions_dead_letter;
  END IF;
END
$reaction_indexes$;
CREATE INDEX IF NOT EXISTS sync_reactions_claim ON syncular.sync_reactions
  (partition, (CASE WHEN status = 'leased' THEN lease_expires_at_ms ELSE available_at_ms END),
   created_at_ms, idempotency_key)
  WHERE status IN ('pending', 'leased');
CREATE INDEX IF NOT EXISTS sync_reactions_completed ON syncular.sync_reactions
  (partition, completed_at_ms, idempotency_key) WHERE status = 'completed';
CREATE INDEX IF NOT EXISTS sync_reactions_dead_letter ON syncular.sync_reactions
  (partition, available_at_ms, idempotency_key) WHERE status = 'dead-letter';
DO $reaction_indexes_check$
BEGIN
  -- A pre-built index is kept only if it is the index this script builds (its definition as
  -- PostgreSQL prints it, spaces folded), and valid. All three names must now be exactly these
  -- indexes: CREATE INDEX IF NOT EXISTS also skips a name taken by some other relation.
  IF (SELECT pg_catalog.count(*) FROM pg_catalog.pg_index i
       WHERE i.indexrelid OPERATOR(pg_catalog.=) ANY (ARRAY[
               pg_catalog.to_regclass('syncular.sync_reactions_claim'),
               pg_catalog.to_regclass('syncular.sync_reactions_completed'),
               pg_catalog.to_regclass('syncular.sync_reactions_dead_letter')]::pg_catalog.oid[])
         AND i.indisvalid
         AND i.indrelid OPERATOR(pg_catalog.=) 'syncular.sync_reactions'::pg_catalog.regclass::pg_catalog.oid
         AND pg_catalog.regexp_replace(pg_catalog.pg_get_indexdef(i.indexrelid), '\s+', ' ', 'g') OPERATOR(pg_catalog.=) ANY (ARRAY[
               'CREATE INDEX sync_reactions_claim ON syncular.sync_reactions USING btree (partition, ( CASE WHEN (status = ''leased''::text) THEN lease_expires_at_ms ELSE available_at_ms END), created_at_ms, idempotency_key) WHERE (status = ANY (ARRAY[''pending''::text, ''leased''::text]))',
               'CREATE INDEX sync_reactions_completed ON syncular.sync_reactions USING btree (partition, completed_at_ms, idempotency_key) WHERE (status = ''completed''::text)',
               'CREATE INDEX sync_reactions_dead_letter ON syncular.sync_reactions USING btree (partition, available_at_ms, idempotency_key) WHERE (status = ''dead-letter''::text)']::pg_catalog.text[]))
     OPERATOR(pg_catalog.<>) 3 THEN
    RAISE EXCEPTION 'syncular: a pre-built reaction index differs from the one this update builds'
      USING HINT = 'Drop it (or let the update build it): docs/API.md, "Upgrading".';
  END IF;
END
$reaction_indexes_check$;

CREATE FUNCTION syncular."complete_reactions"(
	"partition" TEXT,
	"idempotency_keys" TEXT[],
	"lease_owner" TEXT,
	"at_ms" bigint
) RETURNS TEXT[]
VOLATILE SECURITY DEFINER PARALLEL UNSAFE
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'complete_reactions_wrapper';
REVOKE ALL ON FUNCTION syncular.complete_reactions(text, text[], text, bigint) FROM PUBLIC;
COMMENT ON FUNCTION syncular.complete_reactions(text, text[], text, bigint) IS
  'Batch complete_reaction: completes the listed reactions still leased by the owner; returns the keys completed.';
CREATE FUNCTION syncular."fail_reactions"(
	"partition" TEXT,
	"lease_owner" TEXT,
	"failures" jsonb
) RETURNS jsonb
VOLATILE SECURITY DEFINER PARALLEL UNSAFE
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'fail_reactions_wrapper';
REVOKE ALL ON FUNCTION syncular.fail_reactions(text, text, jsonb) FROM PUBLIC;
COMMENT ON FUNCTION syncular.fail_reactions(text, text, jsonb) IS
  'Batch fail_reaction with the retry cap: retry at a time unless attempts reached maxAttempts, else dead-letter; returns {pending, deadLetter} keys.';

-- The one-call push (docs/API.md §push_commit).
CREATE FUNCTION syncular.push_commit(
  partition text, client_id text, client_commit_id text, actor_id text, created_at_ms bigint,
  running_schema_version bigint, allowed jsonb,
  op_tables text[], op_row_ids text[], op_kinds smallint[], op_base_versions bigint[],
  op_payloads bytea[], declared jsonb DEFAULT '[]', options jsonb DEFAULT '{}') RETURNS jsonb
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'push_commit_wrapper';
REVOKE ALL ON FUNCTION syncular.push_commit(text, text, text, text, bigint, bigint, jsonb, text[], text[], smallint[], bigint[], bytea[], jsonb, jsonb) FROM PUBLIC;
COMMENT ON FUNCTION syncular.push_commit(text, text, text, text, bigint, bigint, jsonb, text[], text[], smallint[], bigint[], bytea[], jsonb, jsonb) IS
  'The one-call push: lock, gate, idempotency, the default path''s per-operation decisions, app-row writes as the caller, append and result in one call; returns applied/cached/rejected, or fallback where host code would run.';

-- Stage/finish of the one-call push (docs/API.md §push_finish).
CREATE FUNCTION syncular.push_finish(
  partition text, client_id text, client_commit_id text, reactions jsonb DEFAULT '[]')
RETURNS jsonb
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'push_finish_wrapper';
REVOKE ALL ON FUNCTION syncular.push_finish(text, text, text, jsonb) FROM PUBLIC;
COMMENT ON FUNCTION syncular.push_finish(text, text, text, jsonb) IS
  'Finishes a push staged by push_commit (onCommitHooks "stage") in this transaction: appends the commit, enqueues the planner''s reactions with the commit as their source, stores the applied result; returns push_commit''s applied document.';

-- Change notifications on a channel only syncular_host can name (docs/API.md, "Change
-- notifications"; docs/SECURITY.md, "Notifications"): as in sql/schema.sql, table 18.
CREATE TABLE syncular.sync_notify_channel (
  id      integer PRIMARY KEY CHECK (id = 1),
  channel text    COLLATE "C" NOT NULL
);
REVOKE ALL ON syncular.sync_notify_channel FROM PUBLIC;
INSERT INTO syncular.sync_notify_channel (id, channel)
  VALUES (1, pg_catalog.concat('syncular_commits_',
                               pg_catalog.replace(pg_catalog.gen_random_uuid()::pg_catalog.text, '-', '')));
CREATE FUNCTION syncular.notify_channel() RETURNS text
STABLE PARALLEL UNSAFE SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'notify_channel_wrapper';
REVOKE ALL ON FUNCTION syncular.notify_channel() FROM PUBLIC;
COMMENT ON FUNCTION syncular.notify_channel() IS
  'The channel (random per install) the commits of this database are notified on with syncular.notify_commits = on; syncular_host only. A notification is a wake-up: read the partition head (max_commit_seq) before acting on it.';

-- 0.2.0: the writes of a pull served by a hot standby, applied on the primary (docs/API.md
-- `apply_pull`, docs/DESIGN.md §Read replicas).
CREATE FUNCTION syncular.apply_pull(writes jsonb) RETURNS jsonb
VOLATILE SECURITY DEFINER PARALLEL UNSAFE
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'apply_pull_wrapper';
REVOKE ALL ON FUNCTION syncular.apply_pull(jsonb) FROM PUBLIC;
COMMENT ON FUNCTION syncular.apply_pull(jsonb) IS
  'Applies on the primary the writes a pull served by a hot standby returned (its document''s "writes"): the registry touch and the client record, monotonic and idempotent (a late or repeated apply never moves a cursor back or overwrites a newer record).';

-- 0.2.0: the change feed's state (docs/API.md, "Change feed").
CREATE FUNCTION syncular.feed_status() RETURNS jsonb
VOLATILE PARALLEL UNSAFE
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'feed_status_wrapper';
REVOKE ALL ON FUNCTION syncular.feed_status() FROM PUBLIC;
COMMENT ON FUNCTION syncular.feed_status() IS
  'The change feed''s state for this database: running (a worker announces each interval''s new partition heads on the notify_channel()), the worker''s pid (every feed notification''s sender: drop any other), the database and interval settings; syncular_host.';

-- 0.2.0: distribution on Citus (docs/SCALING.md), an operator action.
CREATE FUNCTION syncular.distribute() RETURNS jsonb
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'distribute_wrapper';
REVOKE ALL ON FUNCTION syncular.distribute() FROM PUBLIC;
COMMENT ON FUNCTION syncular.distribute() IS
  'Extension owner or superuser only, on a Citus coordinator: distributes the sync tables by partition (colocated), makes the global ones reference tables, delegates the one-call functions, the functions of a push transaction (also inside a transaction block) and the reaction queue by their partition; reports which registered app tables are colocated (docs/SCALING.md).';

-- 0.2.0: a migration's rewrite and check of a Citus shard, on the shard's node (docs/SCALING.md,
-- "Migrations on Citus").
CREATE FUNCTION syncular._payload_rewrite(partition text, tbl text, layouts jsonb) RETURNS bigint
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', '_payload_rewrite_wrapper';
REVOKE ALL ON FUNCTION syncular._payload_rewrite(text, text, jsonb) FROM PUBLIC;
COMMENT ON FUNCTION syncular._payload_rewrite(text, text, jsonb) IS
  'Internal, on Citus: re-encodes the stored rows of the shard of a registered app table that holds partition, on this node, in the sandbox here, and keeps a digest of what it wrote for _payload_check; migrate_schema delegates it to each shard''s node; syncular_admin, and only for a role that reads the whole table; refused where the shard is not on this node (docs/SCALING.md).';
CREATE FUNCTION syncular._payload_check(partition text, tbl text) RETURNS bigint
VOLATILE PARALLEL UNSAFE SECURITY INVOKER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', '_payload_check_wrapper';
REVOKE ALL ON FUNCTION syncular._payload_check(text, text) FROM PUBLIC;
COMMENT ON FUNCTION syncular._payload_check(text, text) IS
  'Internal, on Citus: after a migration''s _payload_rewrite of the shard holding partition in this session, checks that the shard holds exactly the rows the rewrite wrote (27000 otherwise); syncular_admin, and only for a role that reads the whole table; refused where the shard is not on this node (docs/SCALING.md).';

-- Last, as in every update script: the roles get exactly the grants of this version.
SELECT syncular._grant_api_roles();
