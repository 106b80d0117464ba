-- syncular: tables and indexes (docs/DESIGN.md §Data model). Created once, by CREATE EXTENSION.
-- Names and columns are upstream @syncular/server 0.24's, so a 0.24 host whose search_path
-- starts with `syncular` reads and writes the same rows. Every text column is COLLATE "C":
-- ordering and pagination are byte order, whatever the database locale.

-- 0a. The database's encoding: UTF8 only. Upstream's strings are Unicode, and everything the
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

-- 0. First of all: the schema. PostgreSQL installs into an existing schema named by the control
--    file (`schema = syncular`) whoever owns it; the extension's functions, event triggers and
--    grants then resolve `syncular.<name>` there. A role that could own the schema or create
--    objects in it could later put its own function under one of those names and have it run
--    with the extension owner's rights (docs/SECURITY.md, "Installing"). So the schema must be
--    one no such role ever controlled: owned by a superuser, CREATE held by no other role (nor
--    PUBLIC), and empty but for this extension. A schema CREATE EXTENSION just made is all
--    three; so is the one a pg_dump restore creates right before CREATE EXTENSION (its grants
--    come last), and the one DROP EXTENSION leaves behind (only USAGE granted).
--    The script's search_path is `syncular, pg_temp` (pg_catalog first): every operator and
--    function below is qualified, so nothing in the schema under test is resolved.
DO $install_schema$
DECLARE
  schema_oid pg_catalog.oid;
  owner_name pg_catalog.name;
  owner_super boolean;
  creators pg_catalog.text;
  held pg_catalog.int8;
  example pg_catalog.text;
  problem pg_catalog.text;
BEGIN
  SELECT n.oid, r.rolname, r.rolsuper INTO schema_oid, owner_name, owner_super
    FROM pg_catalog.pg_namespace n
    JOIN pg_catalog.pg_authid r ON r.oid OPERATOR(pg_catalog.=) n.nspowner
   WHERE n.nspname OPERATOR(pg_catalog.=) 'syncular';
  -- CREATE granted to PUBLIC (grantee 0) or to a role that is not a superuser.
  SELECT pg_catalog.string_agg(CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0::pg_catalog.oid THEN 'PUBLIC'
                                    ELSE pg_catalog.quote_ident(g.rolname) END, ', ')
    INTO creators
    FROM pg_catalog.pg_namespace n, pg_catalog.aclexplode(n.nspacl) a
    LEFT JOIN pg_catalog.pg_authid g ON g.oid OPERATOR(pg_catalog.=) a.grantee
   WHERE n.oid OPERATOR(pg_catalog.=) schema_oid
     AND a.privilege_type OPERATOR(pg_catalog.=) 'CREATE'
     AND NOT COALESCE(g.rolsuper, false);
  -- Every object in a schema depends on it (pg_depend); this extension's own row is the one
  -- dependency a schema made by this CREATE EXTENSION already has.
  SELECT pg_catalog.count(*), pg_catalog.min(pg_catalog.pg_describe_object(d.classid, d.objid, d.objsubid))
    INTO held, example
    FROM pg_catalog.pg_depend d
   WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_namespace'::pg_catalog.regclass::pg_catalog.oid
     AND d.refobjid OPERATOR(pg_catalog.=) schema_oid
     AND NOT (d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_extension'::pg_catalog.regclass::pg_catalog.oid
              AND d.objid OPERATOR(pg_catalog.=) (SELECT e.oid FROM pg_catalog.pg_extension e
                                                   WHERE e.extname OPERATOR(pg_catalog.=) 'syncular'));
  IF NOT owner_super THEN
    problem := pg_catalog.format('It is owned by role %I, which is not a superuser.', owner_name);
  ELSIF creators IS NOT NULL THEN
    problem := pg_catalog.format('CREATE on it is granted to %s.', creators);
  ELSIF held OPERATOR(pg_catalog.>) 0 THEN
    problem := pg_catalog.format('It already holds %s object(s), e.g. %s.', held, example);
  END IF;
  IF problem IS NOT NULL THEN
    RAISE EXCEPTION 'syncular: the existing schema "syncular" is not one the extension can be installed into'
      USING ERRCODE = 'duplicate_schema', DETAIL = problem,
            HINT = 'Drop or rename the existing schema syncular (after checking what it holds), then run '
                   'CREATE EXTENSION syncular again; install the extension before granting CREATE on '
                   'the database (docs/SECURITY.md, "Installing").';
  END IF;
END
$install_schema$;

-- 1. Partition allocator and partition write lock. fillfactor 50 keeps the hot counter
--    update HOT (a new row version on the same page, no index update).
CREATE TABLE syncular.sync_partitions (
  partition      text   COLLATE "C" PRIMARY KEY,
  max_commit_seq bigint NOT NULL DEFAULT 0,
  horizon_seq    bigint NOT NULL DEFAULT 0
) WITH (fillfactor = 50);

-- 2. Partition registry (log generation).
CREATE TABLE syncular.sync_partition_registry (
  partition                text    COLLATE "C" PRIMARY KEY,
  log_epoch                text    COLLATE "C" NOT NULL,
  epoch_required           boolean NOT NULL DEFAULT false,
  last_authenticated_at_ms bigint  NOT NULL
);

-- 3. Inverted scope index over current rows.
CREATE TABLE syncular.sync_row_scopes (
  partition text COLLATE "C" NOT NULL,
  tbl       text COLLATE "C" NOT NULL,
  var       text COLLATE "C" NOT NULL,
  value     text COLLATE "C" NOT NULL,
  row_id    text COLLATE "C" NOT NULL,
  PRIMARY KEY (partition, tbl, var, value, row_id)
);
CREATE INDEX sync_row_scopes_by_row ON syncular.sync_row_scopes (partition, tbl, row_id);

-- 4. Commit log: one row per commit. writer_version is nullable on purpose: NULL is a writer
--    older than the fence, refused as soon as a requirement exists.
CREATE TABLE syncular.sync_commits (
  partition        text   COLLATE "C" NOT NULL,
  commit_seq       bigint NOT NULL,
  client_id        text   COLLATE "C" NOT NULL,
  client_commit_id text   COLLATE "C" NOT NULL,
  actor_id         text   COLLATE "C" NOT NULL,
  created_at_ms    bigint NOT NULL,
  writer_version   bigint,
  PRIMARY KEY (partition, commit_seq)
);
CREATE INDEX sync_commits_by_time ON syncular.sync_commits (partition, created_at_ms);

-- 5. Commit log: one row per change.
CREATE TABLE syncular.sync_changes (
  partition   text     COLLATE "C" NOT NULL,
  commit_seq  bigint   NOT NULL,
  idx         integer  NOT NULL,
  tbl         text     COLLATE "C" NOT NULL,
  row_id      text     COLLATE "C" NOT NULL,
  op          smallint NOT NULL,
  row_version bigint,
  scopes      jsonb    NOT NULL,
  payload     bytea,
  PRIMARY KEY (partition, commit_seq, idx)
);
CREATE INDEX sync_changes_by_table  ON syncular.sync_changes (partition, commit_seq, tbl, idx);
-- Serves source_coverage_seq and has_source_changes_above without walking the log.
CREATE INDEX sync_changes_by_source ON syncular.sync_changes (partition, tbl, commit_seq);

-- 6. Inverted scope index over the commit log: the only candidate source of the pull window.
CREATE TABLE syncular.sync_change_scopes (
  partition  text   COLLATE "C" NOT NULL,
  tbl        text   COLLATE "C" NOT NULL,
  var        text   COLLATE "C" NOT NULL,
  value      text   COLLATE "C" NOT NULL,
  commit_seq bigint NOT NULL,
  PRIMARY KEY (partition, tbl, var, value, commit_seq)
);

-- 7. Idempotency results: first writer wins, never updated or pruned.
CREATE TABLE syncular.sync_push_results (
  partition        text  COLLATE "C" NOT NULL,
  client_id        text  COLLATE "C" NOT NULL,
  client_commit_id text  COLLATE "C" NOT NULL,
  result           jsonb NOT NULL,
  PRIMARY KEY (partition, client_id, client_commit_id)
);

-- 8. Reaction outbox.
CREATE TABLE syncular.sync_reactions (
  partition               text    COLLATE "C" NOT NULL,
  idempotency_key         text    COLLATE "C" NOT NULL,
  type                    text    COLLATE "C" NOT NULL,
  version                 integer NOT NULL,
  payload                 jsonb   NOT NULL,
  source_client_id        text    COLLATE "C" NOT NULL,
  source_client_commit_id text    COLLATE "C" NOT NULL,
  source_commit_seq       bigint  NOT NULL,
  created_at_ms           bigint  NOT NULL,
  available_at_ms         bigint  NOT NULL,
  status                  text    COLLATE "C" NOT NULL,
  attempts                integer NOT NULL,
  max_attempts            integer NOT NULL,
  lease_owner             text    COLLATE "C",
  lease_expires_at_ms     bigint,
  completed_at_ms         bigint,
  last_failure            jsonb,
  PRIMARY KEY (partition, idempotency_key),
  CHECK (status IN ('pending', 'leased', 'completed', 'dead-letter'))
);
-- The claim order as one indexed expression, over the claimable rows only, so a claim is an
-- index range read in claim order, whatever the backlog (docs/DESIGN.md §8 sync_reactions).
-- The terminal states' indexes hold only their own rows: an enqueue writes two indexes.
CREATE INDEX sync_reactions_claim ON syncular.sync_reactions
  (partition, (CASE WHEN status = 'leased' THEN lease_expires_at_ms ELSE available_at_ms END),
   created_at_ms, idempotency_key)
  WHERE status IN ('pending', 'leased');
CREATE INDEX sync_reactions_completed ON syncular.sync_reactions
  (partition, completed_at_ms, idempotency_key) WHERE status = 'completed';
CREATE INDEX sync_reactions_dead_letter ON syncular.sync_reactions
  (partition, available_at_ms, idempotency_key) WHERE status = 'dead-letter';

-- 9. Client records and cursors.
CREATE TABLE syncular.sync_clients (
  partition     text    COLLATE "C" NOT NULL,
  client_id     text    COLLATE "C" NOT NULL,
  actor_id      text    COLLATE "C" NOT NULL,
  wire_version  integer NOT NULL DEFAULT 1,
  cursor        bigint  NOT NULL,
  subscriptions jsonb   NOT NULL,
  updated_at_ms bigint  NOT NULL,
  PRIMARY KEY (partition, client_id)
);

-- 10. Blob references of live rows.
CREATE TABLE syncular.sync_blob_refs (
  partition text COLLATE "C" NOT NULL,
  tbl       text COLLATE "C" NOT NULL,
  row_id    text COLLATE "C" NOT NULL,
  blob_id   text COLLATE "C" NOT NULL,
  PRIMARY KEY (partition, tbl, row_id, blob_id)
);
CREATE INDEX sync_blob_refs_by_blob ON syncular.sync_blob_refs (partition, blob_id);

-- 11. Delete-precedence tombstones.
CREATE TABLE syncular.sync_tombstones (
  partition  text   COLLATE "C" NOT NULL,
  tbl        text   COLLATE "C" NOT NULL,
  row_id     text   COLLATE "C" NOT NULL,
  commit_seq bigint NOT NULL,
  PRIMARY KEY (partition, tbl, row_id)
);

-- 12. Backfill checkpoints. schema_version is bigint (upstream: integer).
CREATE TABLE syncular.sync_backfill_checkpoints (
  partition      text   COLLATE "C" NOT NULL,
  name           text   COLLATE "C" NOT NULL,
  schema_version bigint NOT NULL,
  state          text   COLLATE "C" NOT NULL
                 CHECK (state IN ('declared', 'backfilling', 'activated')),
  watermark      bigint NOT NULL DEFAULT 0,
  owner_epoch    bigint NOT NULL DEFAULT 0,
  observed_rows  bigint NOT NULL DEFAULT 0,
  updated_at_ms  bigint NOT NULL,
  PRIMARY KEY (partition, name)
);
-- Keeps the gate's per-request pending read proportional to the pending checkpoints only.
CREATE INDEX sync_backfill_checkpoints_pending ON syncular.sync_backfill_checkpoints
  (schema_version, partition, name) WHERE state <> 'activated';

-- 13. Writer fence: minimum writer_version per partition. No row = no per-partition barrier.
CREATE TABLE syncular.sync_writer_fence (
  partition               text   COLLATE "C" PRIMARY KEY,
  required_writer_version bigint NOT NULL
);

-- 14. Schema marker (singleton, absent until the first migration). layouts stays text for
--     0.24 hosts, which parse it; required_writer_version is the global writer floor.
CREATE TABLE syncular.sync_schema_meta (
  id                      integer PRIMARY KEY CHECK (id = 1),
  schema_version          bigint  NOT NULL,
  layouts                 text    NOT NULL DEFAULT '{}',
  required_writer_version bigint  NOT NULL DEFAULT 0,
  -- The top-level transaction (its full id, pg_current_xact_id()) that wrote this row version,
  -- stamped by the trigger sync_schema_meta_stamp on every write, however made (a migration, a
  -- repair, a restore's COPY, an update; ENABLE ALWAYS). The row codec asks whether every
  -- snapshot a transaction read through sees it (src/schema/marker.rs), which the row
  -- version's xmin cannot tell once the row is frozen (docs/SECURITY.md rule 19, red teams 19,
  -- 23, 24). NULL: written before the install was updated.
  written_by              bigint,
  -- The (sub)transaction (its full id) that wrote this row version, its xmin: it ties a
  -- migration run in a savepoint to written_by, which pg_subtrans keeps only for a while (red
  -- team 22), and tells a row written with the stamp bypassed (xmin differs). NULL as above.
  written_in              bigint,
  -- A random number the stamp drew for this row version, kept also in sync_schema_stamp, which
  -- no dump carries: a row a restore wrote with the stamp bypassed carries another database's
  -- (or an older) number, and its record is not used (red team 25). NULL as above.
  stamp                   bigint
);

-- 14b. The marker's last stamp, as the trigger sync_schema_meta_stamp drew it (singleton). Not
--      an extension configuration table: pg_dump leaves it out, so it tells this database's own
--      stamp from one a restore carried in (docs/SECURITY.md rule 19). Local to each node on
--      Citus. Written only by the stamp.
CREATE TABLE syncular.sync_schema_stamp (
  id    integer PRIMARY KEY CHECK (id = 1),
  stamp bigint  NOT NULL
);

-- 15. App-table registry: logical table name -> the host's relation. `relation` (its OID; a
-- dump writes the qualified name) is what every use opens; relation_schema / relation_name are
-- its name when it was registered, kept for reading. `registered_by` is the role that made the
-- registration: replacing or retiring it needs that role's privileges (docs/SECURITY.md).
CREATE TABLE syncular.sync_app_tables (
  tbl               text     COLLATE "C" PRIMARY KEY,
  relation_schema   name     NOT NULL,
  relation_name     name     NOT NULL,
  maintain_row_meta boolean  NOT NULL DEFAULT false,
  registered_at_ms  bigint   NOT NULL,
  relation          regclass NOT NULL,
  registered_by     regrole  NOT NULL
);

-- 16. Audit trail of the owner-only repairs (repair_schema_marker, repair_writer_fence): who
-- lowered what, from which state, and why. Stamped with the server clock: an audit record must
-- not take its time from the caller.
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

-- 17. Push schemas (docs/CODEC.md §Push schema): the host's compiled schema per schema version,
-- as syncular.set_push_schema validated and normalized it; encode_row/decode_row (and the
-- one-call push) read their codec layouts from here.
CREATE TABLE syncular.sync_push_schemas (
  schema_version bigint PRIMARY KEY,
  tables         jsonb  NOT NULL,
  updated_at_ms  bigint NOT NULL
);

-- 18. The channel of the change notifications (docs/API.md, "Change notifications"): a random
-- name per install (122 random bits of gen_random_uuid), readable by the extension owner and,
-- through syncular.notify_channel(), by syncular_host. PostgreSQL has no privilege on LISTEN or
-- NOTIFY: a channel no other role can name is what keeps other roles from listening to the
-- partitions' commits or sending on it (docs/SECURITY.md, "Notifications"). Not registered
-- below: a restored database gets a channel of its own.
CREATE TABLE syncular.sync_notify_channel (
  id      integer PRIMARY KEY CHECK (id = 1),
  channel text    COLLATE "C" NOT NULL
);
INSERT INTO syncular.sync_notify_channel (id, channel)
  VALUES (1, pg_catalog.concat('syncular_commits_',
                               pg_catalog.replace(pg_catalog.gen_random_uuid()::pg_catalog.text, '-', '')));

-- 19. Layout history (docs/API.md §5, "Schema evolution"): the layouts of every schema version
-- migrate_schema published, as it stored them in sync_schema_meta.layouts, so a payload can be
-- decoded by the version it belongs to (decode_row(…, schema_version => v): a commit's
-- writer_version).
CREATE TABLE syncular.sync_schema_layouts (
  schema_version bigint PRIMARY KEY,
  layouts        text   NOT NULL
);

-- pg_dump skips the rows of extension member tables unless they are registered here.
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_partitions', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_partition_registry', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_row_scopes', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_commits', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_changes', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_change_scopes', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_push_results', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_reactions', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_clients', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_blob_refs', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_tombstones', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_backfill_checkpoints', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_writer_fence', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_schema_meta', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_app_tables', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_repairs', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_push_schemas', '');
SELECT pg_catalog.pg_extension_config_dump('syncular.sync_schema_layouts', '');
