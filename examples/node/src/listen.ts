// A minimal change listener: one connection that LISTENs on syncular_commits and hands each
// appended commit ({partition, commitSeq}) to a callback — what a host process uses to wake its
// realtime clients of that partition instead of polling (docs/API.md, "Change notifications").
// The appending sessions opt in with `SET syncular.notify_commits = on`.
import pg from "pg";

export interface CommitNotice {
  partition: string;
  commitSeq: number;
}

export async function listenForCommits(url: string, onCommit: (notice: CommitNotice) => void): Promise<pg.Client> {
  const listener = new pg.Client({ connectionString: url });
  await listener.connect();
  listener.on("notification", (message) => {
    if (message.channel === "syncular_commits" && message.payload) {
      onCommit(JSON.parse(message.payload) as CommitNotice);
    }
  });
  await listener.query("LISTEN syncular_commits");
  return listener;
}
