-- The marker's stamp (src/schema/stamp.rs, docs/SECURITY.md rule 19): every row version of
-- sync_schema_meta records the transaction that wrote it and a random number, kept in
-- sync_schema_stamp once the row is written, however it is written.

-- SECURITY DEFINER: it writes sync_schema_stamp, the owner's, for whoever writes the marker.
ALTER FUNCTION syncular.schema_marker_stamp()
  SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
CREATE TRIGGER sync_schema_meta_stamp BEFORE INSERT OR UPDATE ON syncular.sync_schema_meta
  FOR EACH ROW EXECUTE FUNCTION syncular.schema_marker_stamp();
CREATE TRIGGER sync_schema_meta_stamp_kept AFTER INSERT OR UPDATE ON syncular.sync_schema_meta
  FOR EACH ROW EXECUTE FUNCTION syncular.schema_marker_stamp();
ALTER TABLE syncular.sync_schema_meta
  ENABLE ALWAYS TRIGGER sync_schema_meta_stamp, ENABLE ALWAYS TRIGGER sync_schema_meta_stamp_kept;

-- sync_schema_stamp keeps only what the stamp wrote: a subscriber's apply of a publication
-- that includes it, a restore, a hand-made write are skipped (src/schema/stamp.rs).
ALTER FUNCTION syncular.schema_stamp_own() SET search_path = pg_catalog, pg_temp;
CREATE TRIGGER sync_schema_stamp_own BEFORE INSERT OR UPDATE ON syncular.sync_schema_stamp
  FOR EACH ROW EXECUTE FUNCTION syncular.schema_stamp_own();
ALTER TABLE syncular.sync_schema_stamp ENABLE ALWAYS TRIGGER sync_schema_stamp_own;

-- The three stay ENABLE ALWAYS (they fire for a subscriber's apply too) and enabled: a restore
-- with --disable-triggers runs ALTER TABLE … DISABLE TRIGGER ALL, then ENABLE TRIGGER ALL, which
-- would leave them disabled, then enabled only outside replication (red team 26), and CREATE OR
-- REPLACE TRIGGER enables a trigger only outside replication (red team 27). After every ALTER
-- TABLE of the two tables, and every CREATE or ALTER TRIGGER on them, this puts back each of
-- the three that exists, so the restore's COPY is stamped as any write.
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
CREATE EVENT TRIGGER syncular_stamp_guard ON ddl_command_end
  WHEN TAG IN ('ALTER TABLE', 'CREATE TRIGGER', 'ALTER TRIGGER')
  EXECUTE FUNCTION syncular._stamp_guard();
ALTER EVENT TRIGGER syncular_stamp_guard ENABLE ALWAYS;
