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

-- Both stay ENABLE ALWAYS (they fire for a subscriber's apply too) and enabled: a restore with
-- --disable-triggers runs ALTER TABLE … DISABLE TRIGGER ALL, then ENABLE TRIGGER ALL, which
-- would leave them disabled, then enabled only outside replication (red team 26). After every
-- ALTER TABLE of the marker, this puts them back, so the restore's COPY is stamped as any write.
CREATE FUNCTION syncular._stamp_guard() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
  -- Only an ALTER TABLE of the marker in the extension's own schema concerns the guard; every
  -- other one (of any table of the database) returns here.
  IF NOT EXISTS (
    SELECT 1 FROM pg_catalog.pg_event_trigger_ddl_commands() d
      JOIN pg_catalog.pg_class c ON c.oid = d.objid
      JOIN pg_catalog.pg_extension e ON e.extnamespace = c.relnamespace AND e.extname = 'syncular'
     WHERE d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass
       AND c.relname = 'sync_schema_meta') THEN
    RETURN;
  END IF;
  IF EXISTS (
    SELECT 1 FROM pg_catalog.pg_trigger t
     WHERE t.tgrelid = 'syncular.sync_schema_meta'::pg_catalog.regclass
       AND t.tgname IN ('sync_schema_meta_stamp', 'sync_schema_meta_stamp_kept')
       AND t.tgenabled <> 'A') THEN
    ALTER TABLE syncular.sync_schema_meta
      ENABLE ALWAYS TRIGGER sync_schema_meta_stamp,
      ENABLE ALWAYS TRIGGER sync_schema_meta_stamp_kept;
  END IF;
END
$$;
CREATE EVENT TRIGGER syncular_stamp_guard ON ddl_command_end
  WHEN TAG IN ('ALTER TABLE') EXECUTE FUNCTION syncular._stamp_guard();
ALTER EVENT TRIGGER syncular_stamp_guard ENABLE ALWAYS;
