// Spawn a real `espalier serve` (tiny random model) on 127.0.0.1 with a free port; stop it after.
import { ChildProcess, spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { join } from "node:path";

export const REPO = join(__dirname, "..", "..", "..", "..");

export interface Server {
  address: string;
  process: ChildProcess;
  events: Record<string, unknown>[];
  stop(): Promise<number | null>;
}

export function startServer(args: string[] = []): Promise<Server> {
  const python = process.env.ESPALIER_PYTHON ?? join(REPO, ".venv", "bin", "python");
  const child = spawn(
    python,
    ["-m", "espalier.server.main", "serve", "--model", "tiny-random", "--port", "0", ...args],
    { cwd: REPO, stdio: ["ignore", "pipe", "inherit"], env: { ...process.env, PYTHONUNBUFFERED: "1" } },
  );
  const events: Record<string, unknown>[] = [];
  return new Promise((resolve, reject) => {
    let port = 0;
    const lines = createInterface({ input: child.stdout! });
    lines.on("line", (line) => {
      let event: Record<string, unknown>;
      try {
        event = JSON.parse(line);
      } catch {
        return;
      }
      events.push(event);
      if (event.event === "listening") port = event.port as number;
      if (event.event === "load_failed") reject(new Error(`server failed to load: ${event.error}`));
      if (event.event === "serving") {
        resolve({
          address: `127.0.0.1:${port}`,
          process: child,
          events,
          stop: () =>
            new Promise((done) => {
              child.once("exit", (code) => done(code));
              child.kill("SIGTERM");
            }),
        });
      }
    });
    child.once("exit", (code) => reject(new Error(`server exited early with ${code}`)));
  });
}
