-- The native writer fence on syncular.sync_commits (docs/DESIGN.md §Writer fence) and the guard
-- that keeps it in force through a 0.24 host's startup DDL (docs/DESIGN.md §Fence guard).

-- The trigger function runs with the extension owner's rights, so the fence lookup never
-- depends on the inserting role's privileges; every role that can insert is fenced.
ALTER FUNCTION syncular.writer_fence_trigger()
  SECURITY DEFINER SET search_path = pg_catalog, pg_temp;

CREATE TRIGGER sync_commits_writer_fence
  BEFORE INSERT ON syncular.sync_commits
  FOR EACH ROW EXECUTE FUNCTION syncular.writer_fence_trigger();

-- A 0.24 host runs, as separate autocommit statements:
--   DROP TRIGGER IF EXISTS sync_commits_writer_fence ON sync_commits;
--   CREATE TRIGGER sync_commits_writer_fence ... EXECUTE FUNCTION syncular_writer_fence();
-- The two event triggers below make every one of those statements succeed while, after each of
-- them, exactly one enabled native fence trigger exists: a drop that removes the native trigger
-- recreates it under a temporary name in the same command; a create that installs a foreign
-- function under the canonical name is replaced by the native trigger under that name.
-- Both do nothing while an extension script of ours runs (updates manage the trigger
-- themselves) and while they are reacting to their own DDL.

-- syncular._fence_guard_busy() and syncular._fence_guard_hold(boolean) (src/fence.rs) keep the
-- guard's flag in backend memory for one transaction: not a setting, so no session can set it.

-- Number of enabled native fence triggers on sync_commits.
CREATE FUNCTION syncular._native_fence_triggers() RETURNS bigint
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
  SELECT count(*) FROM pg_catalog.pg_trigger t
   WHERE t.tgrelid = 'syncular.sync_commits'::regclass
     AND t.tgfoid = 'syncular.writer_fence_trigger()'::regprocedure
     AND t.tgenabled <> 'D' AND NOT t.tgisinternal
$$;

CREATE FUNCTION syncular._fence_guard_on_drop() RETURNS event_trigger
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

CREATE FUNCTION syncular._fence_guard_on_create() RETURNS event_trigger
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

CREATE EVENT TRIGGER syncular_fence_guard_drop ON sql_drop
  WHEN TAG IN ('DROP TRIGGER') EXECUTE FUNCTION syncular._fence_guard_on_drop();
CREATE EVENT TRIGGER syncular_fence_guard_create ON ddl_command_end
  WHEN TAG IN ('CREATE TRIGGER') EXECUTE FUNCTION syncular._fence_guard_on_create();
