// A minimal change listener: one connection that LISTENs on this database's notification channel
// and hands each new partition head ({partition, commitSeq}) to a callback — what a host process
// uses to wake its realtime clients of that partition instead of polling (docs/API.md, "Change
// notifications" and "Change feed"). Two sources, one channel:
// - the change feed (shared_preload_libraries = 'syncular', syncular.feed_database): one
//   notification per interval, {"heads": {"<partition>": <commitSeq>, …}}, or {"resync": true}
//   after which every partition this host serves is read again — only from the feed worker's
//   process (syncular.feed_status().pid);
// - per-commit notifications, {"partition", "commitSeq"}: the appending sessions opt in with
//   `SET syncular.notify_commits = on`.
//
// Two rules (docs/SECURITY.md, "Notifications"):
// - the channel is a random name per install, readable only through syncular.notify_channel()
//   (granted to syncular_host): PostgreSQL has no privilege on LISTEN/NOTIFY, so a name other
//   roles cannot learn is what keeps them from listening or sending;
// - a notification is a wake-up, never a fact: the listener reads the partition's head from the
//   database (syncular.max_commit_seq) and reports it only if it advanced, so a forged, repeated
//   or stale notification cannot announce a commit that does not exist.
import pg from "pg";

export interface CommitNotice {
  partition: string;
  commitSeq: number;
}

export async function listenForCommits(url: string, onCommit: (notice: CommitNotice) => void): Promise<pg.Client> {
  const listener = new pg.Client({ connectionString: url });
  await listener.connect();
  const channel: string = (await listener.query("SELECT syncular.notify_channel() AS channel")).rows[0].channel;
  const reported = new Map<string, number>(); // the last head reported, per partition
  let feedPid: number | undefined; // the feed worker's process, when the feed runs here
  const readFeedStatus = async () => {
    const status = (await listener.query("SELECT syncular.feed_status() AS s")).rows[0].s;
    feedPid = status.running ? Number(status.pid) : undefined;
  };
  await readFeedStatus();
  let reads = Promise.resolve(); // one head read at a time, in arrival order
  const readHeads = (partitions: string[]) => {
    reads = reads
      .then(async () => {
        for (const partition of partitions) {
          const head = Number(
            (await listener.query("SELECT syncular.max_commit_seq($1) AS head", [partition])).rows[0].head,
          );
          if (head > (reported.get(partition) ?? 0)) {
            reported.set(partition, head);
            onCommit({ partition, commitSeq: head });
          }
        }
      })
      .catch((error) => console.error("commit listener:", error));
  };
  listener.on("notification", (message) => {
    if (message.channel !== channel) {
      return;
    }
    let payload: { partition?: unknown; heads?: unknown; resync?: unknown };
    try {
      payload = JSON.parse(message.payload ?? "");
    } catch {
      return; // not ours: nothing to wake
    }
    if (payload.heads !== undefined || payload.resync !== undefined) {
      // From the feed: its worker's process only; a resync (a restarted worker) names a new one.
      if (payload.resync === true) {
        reads = reads.then(readFeedStatus).catch((error) => console.error("commit listener:", error));
        readHeads([...reported.keys()]);
        return;
      }
      if (message.processId !== feedPid || typeof payload.heads !== "object" || payload.heads === null) {
        return;
      }
      readHeads(Object.keys(payload.heads));
      return;
    }
    if (typeof payload.partition === "string") {
      readHeads([payload.partition]);
    }
  });
  await listener.query(`LISTEN ${listener.escapeIdentifier(channel)}`);
  return listener;
}
