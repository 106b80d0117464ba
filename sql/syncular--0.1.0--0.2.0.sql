-- syncular 0.1.0 → 0.2.0
--
-- 0.2.0: the fence trigger reads the fence and the marker with direct primary-key index scans;
-- jsonb arguments are parsed without panics (deep nesting and out-of-range numbers become
-- sync.storage.invalid_argument); new function set_rows_scopes (batch set_row_scopes).
-- tests/multisession/tests/upgrade.rs proves that an install updated by this script and a fresh
-- install of 0.2.0 have the same catalog.
--
-- Conventions for every update script of this extension:
-- - it runs in ALTER EXTENSION's single transaction, so no committed state ever lacks the fence;
-- - before touching the fence trigger it sets the guard's flag, so the event triggers do not
--   react to the script's own DDL:
--     SELECT pg_catalog.set_config('syncular.fence_guard_busy', 'on', true);
-- - released install scripts (sql/released/) and update scripts are never edited afterwards;
-- - exported symbols of the library are never removed (an update chain loads the newest
--   library for every older install script).

CREATE FUNCTION syncular.set_rows_scopes("partition" text, "tbl" text, "rows" jsonb) RETURNS integer
VOLATILE SECURITY DEFINER PARALLEL UNSAFE
SET search_path TO pg_catalog, pg_temp
LANGUAGE c AS 'MODULE_PATHNAME', 'set_rows_scopes_wrapper';
REVOKE ALL ON FUNCTION syncular.set_rows_scopes(text, text, jsonb) FROM PUBLIC;
COMMENT ON FUNCTION syncular.set_rows_scopes(text, text, jsonb) IS
  'Batch set_row_scopes: makes each listed row''s scope entries exactly its scopes, in one statement; returns the entries held.';
