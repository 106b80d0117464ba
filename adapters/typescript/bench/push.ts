// The push path of upstream's driver through the adapter, next to the shared replay of upstream
// 0.24's own statements (bench/upstream-0.24-push.py under pgbench): one push of N last-writer-
// wins updates of existing `tasks` rows, N = 1 and 10, each client on its own partition. Prints a
// table and replaces the "## TypeScript adapter" section of docs/BENCHMARKS.md.
//
//   node dist/bench/push.js     (bench/adapter-ts.sh starts a cluster and runs it)
// Environment: BENCH_TS_PG (base URL), BENCH_PG_BIN, BENCH_SECONDS (3), BENCH_ROUNDS (3),
// BENCH_CLIENTS ("1,4"), BENCH_TS_WRITE (1: write docs/BENCHMARKS.md).
import { execFileSync } from 'node:child_process';
import { readFileSync, writeFileSync, mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { SyncularServerStorage } from '../src/index.js';
import { encode, TITLED_TASKS, urlFor } from '../test/helpers.js';
import { pushCommit, type Operation } from '../test/push-driver.js';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..', '..', '..', '..');
const BASE = process.env.BENCH_TS_PG ?? 'postgres://postgres@127.0.0.1:55491/postgres';
const BIN = process.env.BENCH_PG_BIN ?? '/usr/lib/postgresql/15/bin';
const SECONDS = Number(process.env.BENCH_SECONDS ?? '3');
const ROUNDS = Number(process.env.BENCH_ROUNDS ?? '3');
const CLIENTS = (process.env.BENCH_CLIENTS ?? '1,4').split(',').map(Number);
const NS = [1, 10];
const url = (db: string, user?: string) => urlFor(db, user, BASE);
const port = new URL(BASE).port;

function psql(db: string, args: string[]): string {
  return execFileSync(`${BIN}/psql`, ['-X', '-q', '-v', 'ON_ERROR_STOP=1', '-h', '127.0.0.1', '-p', port, '-U', 'postgres', '-d', db, ...args], {
    encoding: 'utf8',
  });
}

// ---- upstream: the replay under pgbench -------------------------------------------------------

const work = mkdtempSync(join(tmpdir(), 'syncular-bench-ts-'));

function upstreamRound(n: number, clients: number): { tps: number; roundTrips: number } {
  const script = execFileSync('python3', [join(ROOT, 'bench', 'upstream-0.24-push.py'), String(n)], { encoding: 'utf8' });
  const path = join(work, `push-${n}.pgbench`);
  writeFileSync(path, script);
  const roundTrips = script.split('\n').filter((l) => l.trim() !== '' && !l.startsWith('\\')).length;
  const out = execFileSync(
    `${BIN}/pgbench`,
    ['-n', '-M', 'prepared', '-h', '127.0.0.1', '-p', port, '-U', 'postgres', '-c', String(clients), '-j', String(clients), '-T', String(SECONDS), '-f', path, 'ts_bench_upstream'],
    { encoding: 'utf8' },
  );
  const tps = Number(/tps = ([0-9.]+)/.exec(out)?.[1]);
  return { tps, roundTrips };
}

/**
 * The same replayed statements sent from node-postgres (one connection per client, simple query
 * protocol): the client-side cost of node next to the adapter's, with upstream's statements.
 */
async function upstreamNodeRound(n: number, clients: number): Promise<{ tps: number; roundTrips: number }> {
  const script = execFileSync('python3', [join(ROOT, 'bench', 'upstream-0.24-push.py'), String(n)], { encoding: 'utf8' });
  const statements = script.split('\n').filter((l) => l.trim() !== '' && !l.startsWith('\\set'));
  const pool = new pg.Pool({ connectionString: url('ts_bench_upstream'), max: clients });
  let pushes = 0;
  const deadline = Date.now() + SECONDS * 1000;
  const start = Date.now();
  await Promise.all(
    Array.from({ length: clients }, async (_, c) => {
      const client = await pool.connect();
      try {
        while (Date.now() < deadline) {
          const cc = String(Math.floor(Math.random() * 2_000_000_000));
          let commitSeq = '0';
          for (const line of statements) {
            const gset = line.endsWith('\\gset');
            const text = (gset ? line.slice(0, -'\\gset'.length) : line)
              .replaceAll(':client_id', `'node${c}'`)
              .replaceAll(':commit_seq', commitSeq)
              .replaceAll(':cc', cc);
            const result = await client.query(text);
            if (gset) commitSeq = String((result.rows[0] as { commit_seq: unknown }).commit_seq);
          }
          pushes++;
        }
      } finally {
        client.release();
      }
    }),
  );
  const elapsed = (Date.now() - start) / 1000;
  await pool.end();
  return { tps: pushes / elapsed, roundTrips: statements.length };
}

// ---- the adapter: upstream's driver calls through SyncularServerStorage ----------------------------

async function adapterRound(
  n: number,
  clients: number,
  prefetch: boolean,
  payloads: Uint8Array[],
): Promise<{ tps: number; roundTrips: number }> {
  const pool = new pg.Pool({ connectionString: url('ts_bench_adapter', 'ts_bench_server'), max: clients + 1 });
  let statements = 0;
  const storage = new SyncularServerStorage(pool, { onStatement: () => statements++ });
  await storage.ensureSchema(TITLED_TASKS);
  const ops = (): Operation[] =>
    Array.from({ length: n }, (_, i) => ({ table: 'tasks', rowId: `r${i}`, op: 'upsert', scopes: { project_id: 'proj' }, payload: payloads[i]! }));
  let pushes = 0;
  const deadline = Date.now() + SECONDS * 1000;
  const start = Date.now();
  statements = 0;
  await Promise.all(
    Array.from({ length: clients }, async (_, c) => {
      let k = 0;
      while (Date.now() < deadline) {
        const out = await pushCommit(storage, `p-${c}-${prefetch ? 'f' : 'g'}`, 'c', `${process.pid}-${Date.now()}-${k++}`, ops(), {
          runningSchemaVersion: 1,
          createdAtMs: 1_750_000_000_000,
          prefetch,
        });
        if (out.outcome !== 'applied') throw new Error(`push ${out.outcome}`);
        pushes++;
      }
    }),
  );
  const elapsed = (Date.now() - start) / 1000;
  await pool.end();
  return { tps: pushes / elapsed, roundTrips: statements / pushes };
}

function median(values: number[]): number {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)]!;
}

async function setup(): Promise<Uint8Array[]> {
  psql('postgres', ['-c', 'DROP DATABASE IF EXISTS ts_bench_upstream WITH (FORCE)', '-c', 'DROP DATABASE IF EXISTS ts_bench_adapter WITH (FORCE)']);
  psql('postgres', ['-c', 'CREATE DATABASE ts_bench_upstream', '-c', 'CREATE DATABASE ts_bench_adapter']);
  psql('ts_bench_upstream', ['-f', join(ROOT, 'tests', 'fixtures', 'upstream-0.24-ddl.sql')]);
  psql('ts_bench_adapter', [
    '-c', 'CREATE EXTENSION syncular',
    '-c', "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'ts_bench_server') THEN CREATE ROLE ts_bench_server LOGIN; END IF; END $$",
    '-c', 'GRANT syncular_host TO ts_bench_server',
  ]);
  // The migration as the owner (postgres here); the benchmark then serves as syncular_host.
  const admin = new pg.Pool({ connectionString: url('ts_bench_adapter'), max: 2 });
  await new SyncularServerStorage(admin).ensureSchema(TITLED_TASKS);
  await admin.query('GRANT SELECT, INSERT, UPDATE, DELETE ON public.tasks TO ts_bench_server');
  const payloads: Uint8Array[] = [];
  for (let i = 0; i < 10; i++) {
    payloads.push(await encode(admin, 'tasks', { id: `r${i}`, project_id: 'proj', title: `task ${i}` }));
  }
  await admin.end();
  return payloads;
}

interface Row {
  n: number;
  clients: number;
  upstream: { tps: number; roundTrips: number };
  upstreamNode: { tps: number; roundTrips: number };
  adapter: { tps: number; roundTrips: number };
  prefetch: { tps: number; roundTrips: number };
}

async function main(): Promise<void> {
  const payloads = await setup();
  const rows: Row[] = [];
  for (const n of NS) {
    for (const clients of CLIENTS) {
      const up: number[] = [];
      const un: number[] = [];
      const ad: number[] = [];
      const pf: number[] = [];
      let upRt = 0;
      let adRt = 0;
      let pfRt = 0;
      for (let round = 0; round < ROUNDS; round++) {
        const u = upstreamRound(n, clients);
        const un1 = await upstreamNodeRound(n, clients);
        un.push(un1.tps);
        const a = await adapterRound(n, clients, false, payloads);
        const f = await adapterRound(n, clients, true, payloads);
        up.push(u.tps);
        ad.push(a.tps);
        pf.push(f.tps);
        upRt = u.roundTrips;
        adRt = a.roundTrips;
        pfRt = f.roundTrips;
        console.log(`N=${n} clients=${clients} round ${round + 1}: upstream ${u.tps.toFixed(0)} tps, upstream from node ${un1.tps.toFixed(0)} tps, adapter ${a.tps.toFixed(0)} tps, adapter+prefetch ${f.tps.toFixed(0)} tps`);
      }
      rows.push({
        n,
        clients,
        upstream: { tps: median(up), roundTrips: upRt },
        upstreamNode: { tps: median(un), roundTrips: upRt },
        adapter: { tps: median(ad), roundTrips: adRt },
        prefetch: { tps: median(pf), roundTrips: pfRt },
      });
    }
  }
  const section = render(rows);
  console.log(section);
  if (process.env.BENCH_TS_WRITE !== '0') replaceSection(section);
}

function render(rows: Row[]): string {
  const lines = [
    '## TypeScript adapter',
    '',
    'Generated by `bench/adapter-ts.sh` (`adapters/typescript/bench/push.ts`; it replaces only this section). One push of N last-writer-wins updates of existing `tasks` rows, each client on its own partition. *upstream*: `bench/upstream-0.24-push.py` (the shared replay of upstream 0.24\'s statements) under `pgbench -M prepared` (C client, prepared statements), and the same statements sent from node-postgres (*node*: the client cost a TypeScript host pays, simple query protocol). *adapter*: the storage calls of upstream 0.24\'s push driver (`adapters/typescript/test/push-driver.ts`: one `getRow` per row) through `SyncularServerStorage` on node-postgres, serving as `syncular_host`; *adapter + prefetch*: the same with the later driver\'s one `prefetchRows` per table. Round trips are statements per push (BEGIN and COMMIT included); tps is the median of ' +
      `${ROUNDS} interleaved rounds of ${SECONDS} s.`,
    '',
    '| N | clients | upstream round trips | upstream tps (pgbench) | upstream tps (node) | adapter round trips | adapter tps | adapter / upstream (node) | adapter + prefetch round trips | adapter + prefetch tps | + prefetch / upstream (node) | adapter / upstream (pgbench) |',
    '|---|---|---|---|---|---|---|---|---|---|---|---|',
  ];
  for (const r of rows) {
    lines.push(
      `| ${r.n} | ${r.clients} | ${r.upstream.roundTrips} | ${r.upstream.tps.toFixed(0)} | ${r.upstreamNode.tps.toFixed(0)} | ${r.adapter.roundTrips.toFixed(0)} | ${r.adapter.tps.toFixed(0)} | ${(r.adapter.tps / r.upstreamNode.tps).toFixed(2)} | ${r.prefetch.roundTrips.toFixed(0)} | ${r.prefetch.tps.toFixed(0)} | ${(r.prefetch.tps / r.upstreamNode.tps).toFixed(2)} | ${(r.adapter.tps / r.upstream.tps).toFixed(2)} |`,
    );
  }
  lines.push(
    '',
    'This VM has 2 cores and was shared with other builds during the run (load average 2–3.5); rounds of one side varied by up to 3×, so read the ratios as rough. Compare the adapter with *upstream (node)*: both pay node-postgres\' per-statement cost (about 0.1 ms per round trip on this machine, several times pgbench\'s), which is what an upstream TypeScript host pays too; the pgbench column is the floor of the replayed statements without any client cost. The adapter sends named prepared statements (parsed once per connection). Per row the adapter sends one row read and one statement that decodes the payload with the extension\'s codec, writes the typed row and its scope index; upstream sends a read, the upsert and two scope-index statements.',
    '',
    '',
  );
  return lines.join('\n');
}

function replaceSection(section: string): void {
  const path = join(ROOT, 'docs', 'BENCHMARKS.md');
  const text = readFileSync(path, 'utf8');
  const start = text.indexOf('## TypeScript adapter\n');
  let out: string;
  if (start >= 0) {
    const next = text.indexOf('\n## ', start + 1);
    out = text.slice(0, start) + section + (next >= 0 ? text.slice(next + 1) : '');
  } else {
    const anchor = text.indexOf('## Reading the numbers');
    out = anchor >= 0 ? text.slice(0, anchor) + section + text.slice(anchor) : `${text.trimEnd()}\n\n${section}`;
  }
  writeFileSync(path, out);
  console.log(`wrote the "## TypeScript adapter" section of ${path}`);
}

main().catch((error: unknown) => {
  console.error(error);
  process.exit(1);
});
