// A minimal change listener: one connection that LISTENs on this database's notification channel
// and hands each new partition head ({partition, commitSeq}) to a callback — what a host process
// uses to wake its realtime clients of that partition instead of polling (docs/API.md, "Change
// notifications"). The appending sessions opt in with `SET syncular.notify_commits = on`.
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
  let reads = Promise.resolve(); // one head read at a time, in arrival order
  listener.on("notification", (message) => {
    if (message.channel !== channel) {
      return;
    }
    let partition: unknown;
    try {
      partition = JSON.parse(message.payload ?? "").partition;
    } catch {
      return; // not ours: nothing to wake
    }
    if (typeof partition !== "string") {
      return;
    }
    reads = reads
      .then(async () => {
        const head = Number(
          (await listener.query("SELECT syncular.max_commit_seq($1) AS head", [partition])).rows[0].head,
        );
        if (head > (reported.get(partition) ?? 0)) {
          reported.set(partition, head);
          onCommit({ partition, commitSeq: head });
        }
      })
      .catch((error) => console.error("commit listener:", error));
  });
  await listener.query(`LISTEN ${listener.escapeIdentifier(channel)}`);
  return listener;
}
