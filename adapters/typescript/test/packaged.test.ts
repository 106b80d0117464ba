// A constraint violation rejected durably through the error class a packaged @syncular/server
// sees. Upstream's push rejects a commit only for `instanceof` its own StorageConstraintError,
// which the published package does not export and whose module its `exports` map keeps out of
// reach. A temporary host gets the package stand-in (test/fixtures/packaged-server: the exports
// map, the unexported class, the exported PostgresServerStorage producing it, the push's
// `instanceof` branch) and this adapter's build in its node_modules, and both are resolved by the
// runtime as a host's are: the adapter's default options must find the class (through the
// producer) and the push must store the rejection; with the adapter's own class the same push
// fails the request, as it did before.
import assert from 'node:assert/strict';
import { cp, mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { after, before, test } from 'node:test';
import type * as Adapter from '../src/index.js';
import type { CompiledSchema, ServerStorage, StoredPushResult } from '../src/types.js';
import { encode, freshDatabase, NOW, sourceFor, type Fixture } from './helpers.js';

const PACKAGE = join(dirname(fileURLToPath(import.meta.url)), '..', '..');

interface Upstream {
  compileSchema(schema: unknown): CompiledSchema;
  applyPush(
    storage: ServerStorage,
    partition: string,
    clientId: string,
    clientCommitId: string,
    operations: { table: string; rowId: string; scopes: Record<string, string>; payload: Uint8Array }[],
    createdAtMs: number,
  ): Promise<StoredPushResult>;
  StorageQueryError: unknown;
  SyncError: unknown;
  PostgresServerStorage: unknown;
}

interface Host {
  upstream: Upstream;
  adapter: typeof Adapter;
  deepImport(): Promise<unknown>;
}

let fx: Fixture;
let root: string;
let host: Host;

before(async () => {
  fx = await freshDatabase('packaged');
  root = await mkdtemp(join(tmpdir(), 'syncular-packaged-host-'));
  const modules = join(root, 'node_modules', '@syncular');
  await mkdir(modules, { recursive: true });
  await cp(join(PACKAGE, 'test', 'fixtures', 'packaged-server'), join(modules, 'server'), { recursive: true });
  // The adapter as `npm install` lays it out: package.json and dist/src (its `files`).
  const adapter = join(modules, 'pg-extension-storage');
  await cp(join(PACKAGE, 'package.json'), join(adapter, 'package.json'));
  await cp(join(PACKAGE, 'dist', 'src'), join(adapter, 'dist', 'src'), { recursive: true });
  await writeFile(join(root, 'package.json'), JSON.stringify({ name: 'host', private: true, type: 'module' }));
  await writeFile(
    join(root, 'host.js'),
    [
      "export * as upstream from '@syncular/server';",
      "export * as adapter from '@syncular/pg-extension-storage';",
      "export const deepImport = () => import('@syncular/server/dist/storage-errors.js');",
    ].join('\n'),
  );
  host = (await import(pathToFileURL(join(root, 'host.js')).href)) as Host;
});

after(async () => {
  await fx.close();
  await rm(root, { recursive: true, force: true });
});

const COLUMNS = [
  { name: 'id', type: 'string', nullable: false },
  { name: 'workspace_id', type: 'string', nullable: false },
  { name: 'surgery_id', type: 'string', nullable: false },
  { name: 'body', type: 'string', nullable: false },
];

function schema(): CompiledSchema {
  return host.upstream.compileSchema({
    version: 1,
    tables: [
      {
        name: 'reports',
        columns: COLUMNS,
        primaryKey: 'id',
        scopes: ['workspace:{workspace_id}'],
        indexes: [{ name: 'reports_by_surgery', columns: ['workspace_id', 'surgery_id'], unique: true }],
      },
    ],
  });
}

async function op(id: string, surgery: string, body: string) {
  const payload = await encode(fx.server, 'reports', { id, workspace_id: 'w1', surgery_id: surgery, body });
  return { table: 'reports', rowId: id, scopes: { workspace_id: 'w1' }, payload };
}

test('the packaged layout keeps StorageConstraintError out of reach', async () => {
  assert.equal((host.upstream as unknown as Record<string, unknown>).StorageConstraintError, undefined);
  await assert.rejects(host.deepImport(), (error: { code?: string; message?: string }) => {
    // node: ERR_PACKAGE_PATH_NOT_EXPORTED; Bun words it in its message.
    assert.ok(error.code === 'ERR_PACKAGE_PATH_NOT_EXPORTED' || /not exported|cannot find|resolve/i.test(String(error.message)), String(error.message));
    return true;
  });
});

test("default options: the class is obtained from upstream's producer and the push rejects durably", async () => {
  await new host.adapter.SyncularServerStorage(sourceFor(fx.migrator)).ensureSchema(schema());
  const storage = new host.adapter.SyncularServerStorage(sourceFor(fx.server));
  await storage.ensureSchema(schema());
  assert.equal(storage.errors.constraintSource, 'probed');
  const P = 'workspace-partition';
  await storage.touchPartition(P, NOW, 'epoch');
  const seed = await host.upstream.applyPush(storage, P, 'client', 'seed', [await op('existing', 'surgery-1', 'original')], NOW);
  assert.equal(seed.status, 'applied');
  const collision = [await op('sibling', 'surgery-2', 'must roll back'), await op('collision', 'surgery-1', 'must reject')];
  const first = await host.upstream.applyPush(storage, P, 'client', 'collision', collision, NOW + 1);
  assert.equal(first.status, 'rejected');
  assert.deepEqual(first.results, [
    { opIndex: 1, status: 'error', code: 'sync.constraint_violation', message: 'write violates a relational constraint', retryable: false },
  ]);
  assert.equal(await storage.getRow(P, 'reports', 'sibling'), undefined, 'the candidate writes rolled back');
  assert.equal(await storage.getMaxCommitSeq(P), 1, 'no commit_seq consumed');
  // Durable: the retry answers the stored rejection instead of failing again.
  assert.deepEqual(await host.upstream.applyPush(storage, P, 'client', 'collision', collision, NOW + 2), first);
  const next = await host.upstream.applyPush(storage, P, 'client', 'after', [await op('after', 'surgery-3', 'fine')], NOW + 3);
  assert.equal(next.status, 'applied');
  assert.equal(await storage.getMaxCommitSeq(P), 2);
});

test('upstream passed as `errors` (bundlers): the same class; the adapter-local class fails the request', async () => {
  const viaModule = new host.adapter.SyncularServerStorage(sourceFor(fx.server), { errors: host.upstream as never });
  await viaModule.ensureSchema(schema());
  assert.equal(viaModule.errors.constraintSource, 'probed');
  const local = new host.adapter.SyncularServerStorage(sourceFor(fx.server), {
    errors: { StorageConstraintError: host.adapter.StorageConstraintError },
  });
  await local.ensureSchema(schema());
  assert.equal(local.errors.constraintSource, 'injected');
  const P = 'local-class';
  await local.touchPartition(P, NOW, 'epoch');
  await host.upstream.applyPush(local, P, 'client', 'seed', [await op('l1', 'surgery-9', 'original')], NOW);
  // What a packaged host saw before: not upstream's class, so no rejection — the request fails
  // and the client retries a push that can never apply.
  await assert.rejects(
    host.upstream.applyPush(local, P, 'client', 'dup', [await op('l2', 'surgery-9', 'collides')], NOW + 1),
    { name: 'StorageConstraintError', message: 'application row violates a relational constraint' },
  );
  assert.equal(await local.getPushResult(P, 'client', 'dup'), undefined, 'nothing stored');
});
