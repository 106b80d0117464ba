-- Privileges (docs/SECURITY.md). Every function pins its search_path; most are SECURITY DEFINER,
-- those that must know their caller are SECURITY INVOKER and check it. Nobody but the extension
-- owner may call anything, except through the two roles below.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA syncular FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA syncular FROM PUBLIC;

-- syncular_host / syncular_admin: created if missing and granted exactly the lists of
-- src/grants.rs. Every update script ends by running this again (docs/SECURITY.md).
SELECT syncular._grant_api_roles();

-- Writer fence (docs/API.md §Writer fence)
COMMENT ON FUNCTION syncular.writer_fence_trigger() IS
  'Native BEFORE INSERT trigger on sync_commits: refuses a commit whose writer_version is NULL or below the partition fence / global floor (SY001), read from the latest committed state.';
COMMENT ON FUNCTION syncular.writer_fence_allows(text, bigint) IS
  'The fence predicate for (partition, writer_version), evaluated exactly as the trigger does.';
COMMENT ON FUNCTION syncular.raise_writer_fence(text, bigint) IS
  'Raises the partition fence to at least the given version (never lowers); returns the effective requirement R(p).';

-- Commit log (docs/API.md §Commit log)
COMMENT ON FUNCTION syncular.lock_partition(text) IS
  'Takes the partition write lock (creating the partition row); returns max_commit_seq.';
COMMENT ON FUNCTION syncular.append_commit(text, jsonb) IS
  'Appends a whole commit (row, changes, scope index, tombstones) in one call; returns its dense commit_seq. Malformed documents: SY005.';
COMMENT ON FUNCTION syncular.max_commit_seq(text) IS
  'The partition''s last allocated commit_seq, 0 if none.';

-- Serve gate (docs/API.md §Serve gate)
COMMENT ON FUNCTION syncular.read_serve_gate(text, bigint) IS
  'The gate token {storedSchemaVersion, logEpoch, pending} from one snapshot; pending ordered by partition, name.';
COMMENT ON FUNCTION syncular.serve_gate_refusal(text, bigint, jsonb) IS
  'The refusal for a process running the given version with its declarations, or NULL to serve.';
COMMENT ON FUNCTION syncular.assert_serve_ready(text, bigint, jsonb) IS
  'Returns the gate token, or raises sync.schema_not_ready (SY002) with the refusal details.';

-- Checkpoints (docs/API.md §Checkpoints)
COMMENT ON FUNCTION syncular.declare_checkpoint(text, text, bigint, bigint) IS
  'Declares a backfill checkpoint (idempotent at the same version, SY012 at another) and raises the partition fence to its version.';
COMMENT ON FUNCTION syncular.claim_checkpoint(text, text, bigint, bigint) IS
  'Claims a checkpoint: owner_epoch + 1, state backfilling; the returned epoch is the caller''s CAS token.';
COMMENT ON FUNCTION syncular.advance_checkpoint(text, text, bigint, bigint, bigint, bigint) IS
  'Under the partition lock, records watermark and progress only if the epoch still owns the checkpoint; false otherwise.';
COMMENT ON FUNCTION syncular.activate_checkpoint(text, text, bigint, bigint, text[], bigint) IS
  'Activates a checkpoint under the partition lock if the fence covers it, no source changed above the watermark and the epoch matches: activated, stale or unverifiable.';
COMMENT ON FUNCTION syncular.read_checkpoints(text) IS
  'The partition''s checkpoints ordered by name.';
COMMENT ON FUNCTION syncular.source_coverage_seq(text, text[]) IS
  'The newest commit_seq with a change in one of the tables, 0 if none.';
COMMENT ON FUNCTION syncular.has_source_changes_above(text, text[], bigint) IS
  'clean, changed or unverifiable (history pruned) for the tables above seq, in one snapshot.';

-- Schema barrier (docs/API.md §Schema barrier)
COMMENT ON FUNCTION syncular.check_schema(bigint, jsonb, jsonb) IS
  'Startup check: current or migrate, or raises checkpoint_incomplete / schema_newer / stored_layout_mismatch.';
COMMENT ON FUNCTION syncular.migrate_schema(bigint, jsonb, jsonb) IS
  'Opens a migration in the caller''s transaction under the barrier lock, re-validates, installs declarations, fences and the global floor, re-encodes the stored rows of registered tables whose layout grew; returns the previously stored version.';
COMMENT ON FUNCTION syncular.schema_state() IS
  'The stored schema state {schemaVersion, layouts, writerFloor}, or NULL before the first migration.';
COMMENT ON FUNCTION syncular.previous_schema() IS
  'The {schemaVersion, layouts} the last migrate_schema of this transaction started from (with rewritten: rows re-encoded per table, when it re-encoded any), or NULL.';

-- Registry and request entry (docs/API.md §Registry and request entry)
COMMENT ON FUNCTION syncular.touch_partition(text, bigint, text) IS
  'Registers the partition (keeping an existing epoch) and stamps the authentication time; returns the registry entry.';
COMMENT ON FUNCTION syncular.serve_entry(text, bigint, text, bigint, jsonb) IS
  'touch_partition and assert_serve_ready in one call: {registry, gate}; a refusal rolls the touch back.';
COMMENT ON FUNCTION syncular.rotate_log_epoch(text, text, bigint) IS
  'Under the partition lock, sets a new log epoch (epochRequired) and drops the partition''s client records.';
COMMENT ON FUNCTION syncular.get_log_epoch(text) IS 'The partition''s registry epoch, or NULL.';
COMMENT ON FUNCTION syncular.list_partition_registry() IS 'Every registry entry, ordered by partition.';
COMMENT ON FUNCTION syncular.list_partitions() IS 'Registered partition names, sorted.';
COMMENT ON FUNCTION syncular.partition_state(text) IS
  '{maxCommitSeq, horizonSeq, logEpoch, epochRequired} from one snapshot.';

-- App tables and row metadata (docs/API.md §App tables and row metadata)
COMMENT ON FUNCTION syncular.register_table(text, regclass, boolean) IS
  'Registers the relation holding an app table (caller must own it, and hold the privileges of an earlier registrant); optionally installs the row-meta trigger.';
COMMENT ON FUNCTION syncular.list_tables() IS
  'Every app-table registration: [{table, relation (NULL once gone), registeredBy, maintainRowMeta, registeredAtMs}], by name.';
COMMENT ON FUNCTION syncular.retire_table(text) IS
  'Removes a retired table''s row scopes, blob refs, registration and trigger (caller must hold the registrant''s privileges); keeps history.';
COMMENT ON FUNCTION syncular.schema_marker_stamp() IS
  'Native trigger on sync_schema_meta (ENABLE ALWAYS): BEFORE INSERT OR UPDATE stamps each row version with the transaction that writes it (written_by, written_in) and a random stamp, AFTER keeps the stamp in sync_schema_stamp, however the row is written.';
COMMENT ON FUNCTION syncular.schema_stamp_own() IS
  'Native BEFORE INSERT OR UPDATE trigger on sync_schema_stamp (ENABLE ALWAYS): lets through only the stamp''s own write; any other (a subscriber''s apply, a restore, a hand-made write) is skipped.';
COMMENT ON FUNCTION syncular._stamp_guard() IS
  'Internal: event trigger function keeping the stamp''s three triggers enabled ALWAYS after any ALTER TABLE, CREATE or ALTER TRIGGER of sync_schema_meta or sync_schema_stamp.';
COMMENT ON FUNCTION syncular.row_meta_trigger() IS
  'Row trigger installed by register_table(..., true): keeps sync_row_scopes and sync_blob_refs in step with the host''s writes.';
COMMENT ON FUNCTION syncular.set_row_scopes(text, text, text, jsonb) IS
  'Makes a row''s scope-index entries exactly its stored scopes; returns their number.';
COMMENT ON FUNCTION syncular.set_rows_scopes(text, text, jsonb) IS
  'Batch set_row_scopes: makes each listed row''s scope entries exactly its scopes, in one statement; returns the entries held.';
COMMENT ON FUNCTION syncular.delete_row_meta(text, text, text) IS
  'Removes a deleted row''s scope entries and blob refs: {rowScopes, blobRefs}.';
COMMENT ON FUNCTION syncular.set_blob_refs(text, text, text, text[]) IS
  'Replaces a row''s blob-reference set; returns its size.';
COMMENT ON FUNCTION syncular.get_row_scopes(text, text, text) IS
  '{serverVersion, scopes} of an app row read from its registered table, or NULL.';

-- Push (docs/API.md §Push)
COMMENT ON FUNCTION syncular.get_push_result(text, text, text) IS
  'The stored push result, normalized, or NULL; unreadable: SY003.';
COMMENT ON FUNCTION syncular.push_begin(text, text, text, bigint, jsonb) IS
  'Starts a push: partition lock, serve gate under the lock, idempotency re-check; returns the stored result or NULL.';
COMMENT ON FUNCTION syncular.put_push_result(text, text, text, jsonb) IS
  'Stores a push result if none exists (first writer wins); returns the canonical stored result.';
COMMENT ON FUNCTION syncular.get_tombstone_seq(text, text, text) IS 'The row''s tombstone commit_seq, or NULL.';
COMMENT ON FUNCTION syncular.tombstone_seqs(text, text, text[]) IS 'Tombstones of the given rows, ordered by row_id.';
COMMENT ON FUNCTION syncular.clear_tombstone(text, text, text) IS 'Deletes a row''s tombstone; true if one existed.';
COMMENT ON FUNCTION syncular.enqueue_reactions(text, jsonb) IS
  'Enqueues reactions with their source commit (validated; duplicates refused with SY050); returns the number inserted.';

-- Pull (docs/API.md §Pull)
COMMENT ON FUNCTION syncular.read_commit_window(text, text, jsonb, bigint, bigint, integer) IS
  'The commit window of a table for effective scopes, through the inverted scope index: whole commits, oldest first, up to the change limit.';
COMMENT ON FUNCTION syncular.scan_rows(text, text, jsonb, text, integer) IS
  'A bootstrap page of current rows matching the scopes, ordered by row_id.';
COMMENT ON FUNCTION syncular.latest_scoped_change_seq(text, text, jsonb) IS
  'The newest commit_seq indexed for the first scope variable''s values, 0 if none.';
COMMENT ON FUNCTION syncular.pull(text, text, text, bigint, text, bigint, jsonb, jsonb) IS
  'A whole pull request in one call and one snapshot: gate, client record, every subscription''s window or bootstrap page (the classic path''s decisions), registry touch and the record''s new cursor; a document row first, then the rows.';

-- Horizon and pruning (docs/API.md §Horizon and pruning)
COMMENT ON FUNCTION syncular.horizon_seq(text) IS 'The partition''s pruning horizon, 0 if none.';
COMMENT ON FUNCTION syncular.set_horizon_seq(text, bigint) IS 'Raises the horizon (never lowers); deletes nothing.';
COMMENT ON FUNCTION syncular.prune_commits_through(text, text, bigint) IS
  'Epoch-fenced prune of the log through max(horizon, seq) under the partition lock.';
COMMENT ON FUNCTION syncular.commit_seq_before(text, bigint) IS 'The newest commit_seq created before the time, 0 if none.';
COMMENT ON FUNCTION syncular.prune_commit_log(text, bigint, bigint, bigint, bigint) IS
  'Upstream''s whole retention policy (active cursor floor, age force, newest commits kept) and the prune, in one call.';

-- Reactions (docs/API.md §Reactions)
COMMENT ON FUNCTION syncular.claim_reactions(text, text, text[], bigint, bigint, integer) IS
  'Leases due reactions (FOR UPDATE SKIP LOCKED); concurrent claimers never receive the same one.';
COMMENT ON FUNCTION syncular.complete_reaction(text, text, text, bigint) IS 'Completes a reaction still leased by the owner.';
COMMENT ON FUNCTION syncular.extend_reaction_lease(text, text, text, bigint) IS 'Extends a lease still held by the owner.';
COMMENT ON FUNCTION syncular.fail_reaction(text, text, text, jsonb, bigint) IS
  'Records a failure of a reaction still leased by the owner: retry at a time, or dead-letter.';
COMMENT ON FUNCTION syncular.complete_reactions(text, text[], text, bigint) IS
  'Batch complete_reaction: completes the listed reactions still leased by the owner; returns the keys completed.';
COMMENT ON FUNCTION syncular.fail_reactions(text, text, jsonb) IS
  'Batch fail_reaction with the retry cap: retry at a time unless attempts reached maxAttempts, else dead-letter; returns {pending, deadLetter} keys.';
COMMENT ON FUNCTION syncular.retry_reaction(text, text, bigint) IS 'Operator retry of a dead letter.';
COMMENT ON FUNCTION syncular.get_reaction(text, text) IS 'The reaction object, or NULL.';
COMMENT ON FUNCTION syncular.list_reactions(text, integer, text[], text[]) IS 'Reactions newest first, optionally filtered.';
COMMENT ON FUNCTION syncular.prune_reactions(text, bigint, bigint, integer) IS
  'Deletes aged completed and dead-letter reactions, oldest first, bounded: {completed, deadLetter}.';

-- Clients (docs/API.md §Clients and cursors)
COMMENT ON FUNCTION syncular.apply_pull(jsonb) IS
  'Applies on the primary the writes a pull served by a hot standby returned (its document''s "writes"): the registry touch and the client record, monotonic and idempotent (a late or repeated apply never moves a cursor back or overwrites a newer record).';
COMMENT ON FUNCTION syncular.get_client(text, text) IS 'The client record, or NULL.';
COMMENT ON FUNCTION syncular.put_client(text, jsonb) IS 'Upserts (overwrites) a client record.';
COMMENT ON FUNCTION syncular.advance_client_cursor(text, text, text, text, bigint, bigint) IS
  'Monotonic cursor advance guarded by actor and log epoch; true if the record matched.';
COMMENT ON FUNCTION syncular.update_client_cursor(text, text, bigint, bigint) IS 'Monotonic cursor advance without guards.';
COMMENT ON FUNCTION syncular.list_client_cursors(text) IS '[{clientId, cursor, updatedAtMs}] ordered by client id.';
COMMENT ON FUNCTION syncular.list_clients(text) IS 'Client records, most recently updated first.';
COMMENT ON FUNCTION syncular.active_cursor_floor(text, bigint) IS
  'The lowest cursor of clients active since the cutoff, or NULL.';

-- Blob references and admin reads (docs/API.md §Blob references and admin reads)
COMMENT ON FUNCTION syncular.rows_referencing_blob(text, text) IS '[{table, rowId, scopes}] of live rows referencing a blob.';
COMMENT ON FUNCTION syncular.referenced_blob_ids(text) IS 'Distinct referenced blob ids, sorted (the orphan sweep keep-set).';
COMMENT ON FUNCTION syncular.list_commit_metadata(text, bigint, integer, text) IS 'Commit metadata newest first.';
COMMENT ON FUNCTION syncular.stats(bigint) IS
  'Health per partition: log (maxCommitSeq, horizonSeq, commits, changes), clients (all, active since the time, max active lag), pending checkpoints, reactions by state.';
COMMENT ON FUNCTION syncular.scope_activity(text, text, text, integer) IS 'The newest commits per table touching a scope value.';

-- Row codec and push schema (docs/API.md §Row codec and push schema, docs/CODEC.md)
COMMENT ON FUNCTION syncular.set_push_schema(bigint, jsonb) IS
  'Stores the host''s compiled schema for a schema version after checking it against the registered relations and the stored layouts; idempotent; returns the number of tables.';
COMMENT ON FUNCTION syncular.encode_row(text, jsonb, boolean, bigint) IS
  'Encodes a row given as JSON with the table''s push schema (full row, or sparse row with only the given columns), at the stored schema version or the one given; bad input: SY000 with the codec''s message as reason.';
COMMENT ON FUNCTION syncular.decode_row(text, bytea, boolean, bigint) IS
  'Decodes a full or sparse row payload with the table''s push schema (or layouts) at the stored schema version or the one given, into JSON (absent columns omitted); bad input: SY000 with the codec''s message as reason.';
COMMENT ON FUNCTION syncular.push_commit(text, text, text, text, bigint, bigint, jsonb, text[], text[], smallint[], bigint[], bytea[], jsonb, jsonb) IS
  'The one-call push: lock, gate, idempotency, the default path''s per-operation decisions, app-row writes as the caller, append and result in one call; returns applied/cached/rejected, or fallback where host code would run.';
COMMENT ON FUNCTION syncular.push_finish(text, text, text, jsonb) IS
  'Finishes a push staged by push_commit (onCommitHooks "stage") in this transaction: appends the commit, enqueues the planner''s reactions with the commit as their source, stores the applied result; returns push_commit''s applied document.';

-- Change notifications (docs/API.md, "Change notifications")
COMMENT ON FUNCTION syncular.notify_channel() IS
  'The channel (random per install) the commits of this database are notified on with syncular.notify_commits = on; syncular_host only. A notification is a wake-up: read the partition head (max_commit_seq) before acting on it.';
-- The change feed (docs/API.md, "Change feed")
COMMENT ON FUNCTION syncular.feed_status() IS
  'The change feed''s state for this database: running (a worker announces each interval''s new partition heads on the notify_channel()), the worker''s pid (every feed notification''s sender: drop any other), the database and interval settings; syncular_host.';

-- Administration (docs/API.md §Administration)
COMMENT ON FUNCTION syncular.adopt_legacy_tables(name, name) IS
  'Extension owner or superuser only: one-time adoption of a 0.24 database''s tables into the (empty) extension tables, in the caller''s transaction.';

-- Internal: the fence guard (docs/DESIGN.md §Fence guard)
COMMENT ON FUNCTION syncular._fence_guard_on_drop() IS 'Event trigger: recreates the native fence trigger dropped by a 0.24 host''s startup DDL.';
COMMENT ON FUNCTION syncular._fence_guard_on_create() IS 'Event trigger: replaces a foreign sync_commits_writer_fence trigger with the native one.';
COMMENT ON FUNCTION syncular._fence_guard_busy() IS 'Internal: true while the fence guard reacts to its own DDL (transaction-local state no session can set).';
COMMENT ON FUNCTION syncular._fence_guard_hold(boolean) IS 'Internal, extension owner only: sets the fence guard''s busy flag for the rest of the (sub)transaction.';

-- Distribution on Citus (docs/SCALING.md)
COMMENT ON FUNCTION syncular.distribute() IS
  'Extension owner or superuser only, on a Citus coordinator: distributes the sync tables by partition (colocated), makes the global ones reference tables, delegates the one-call functions, the functions of a push transaction (also inside a transaction block) and the reaction queue by their partition; reports which registered app tables are colocated (docs/SCALING.md).';
COMMENT ON FUNCTION syncular._payload_rewrite(text, text, jsonb) IS
  'Internal, on Citus: re-encodes the stored rows of the shard of a registered app table that holds partition, on this node, in the sandbox here, and keeps a digest of what it wrote for _payload_check; migrate_schema delegates it to each shard''s node; syncular_admin, and only for a role that reads the whole table; refused where the shard is not on this node (docs/SCALING.md).';
COMMENT ON FUNCTION syncular._payload_check(text, text) IS
  'Internal, on Citus: after a migration''s _payload_rewrite of the shard holding partition in this session, checks that the shard holds exactly the rows the rewrite wrote (27000 otherwise); syncular_admin, and only for a role that reads the whole table; refused where the shard is not on this node (docs/SCALING.md).';

-- Repairs (docs/SECURITY.md)
COMMENT ON FUNCTION syncular.repair_schema_marker(bigint, bigint, text) IS
  'Extension owner only: lowers the stored schema version and the global writer floor, with a reason; audited in sync_repairs.';
COMMENT ON FUNCTION syncular.repair_writer_fence(text, bigint, text) IS
  'Extension owner only: lowers a partition''s writer fence, with a reason; audited in sync_repairs.';
COMMENT ON FUNCTION syncular._grant_api_roles() IS 'Internal, extension owner only: creates the roles syncular_host and syncular_admin if missing and grants them the API (run by every install and update script).';
COMMENT ON FUNCTION syncular._native_fence_triggers() IS 'Internal: number of enabled native fence triggers on sync_commits.';
