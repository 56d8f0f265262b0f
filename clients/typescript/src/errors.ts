// Typed errors carrying the server's google.rpc status details (ErrorInfo, BadRequest, RetryInfo).
import * as grpc from "@grpc/grpc-js";
import * as protobuf from "protobufjs";
import { join } from "node:path";

export interface FieldViolation {
  field: string;
  description: string;
  reason: string;
}

export class EspalierError extends Error {
  constructor(
    readonly code: grpc.status,
    readonly details: string,
    readonly reason: string = "",
    readonly metadata: Record<string, string> = {},
    readonly fieldViolations: FieldViolation[] = [],
    readonly retryDelayMs: number | null = null,
  ) {
    super(`${grpc.status[code]}${reason ? ` [${reason}]` : ""}: ${details}`);
    this.name = "EspalierError";
  }
}

let detailsRoot: protobuf.Root | null = null;

function root(): protobuf.Root {
  detailsRoot ??= protobuf.loadSync(join(__dirname, "..", "..", "proto", "google", "rpc", "details.proto"));
  return detailsRoot;
}

/** The typed error of a failed call (details decoded from `grpc-status-details-bin`). */
export function fromServiceError(error: grpc.ServiceError): EspalierError {
  const raw = error.metadata?.get("grpc-status-details-bin")?.[0];
  let reason = "";
  let metadata: Record<string, string> = {};
  const violations: FieldViolation[] = [];
  let retryMs: number | null = null;
  if (raw instanceof Buffer) {
    const r = root();
    const status = r.lookupType("google.rpc.Status").decode(new Uint8Array(raw)) as unknown as {
      details: { type_url: string; value: Uint8Array }[];
    };
    for (const detail of status.details ?? []) {
      const typeName = detail.type_url.split("/").pop() ?? "";
      if (typeName === "google.rpc.ErrorInfo") {
        const info = r.lookupType(typeName).toObject(r.lookupType(typeName).decode(detail.value));
        reason = info.reason ?? "";
        metadata = info.metadata ?? {};
      } else if (typeName === "google.rpc.BadRequest") {
        const bad = r.lookupType(typeName).toObject(r.lookupType(typeName).decode(detail.value));
        for (const v of bad.fieldViolations ?? bad.field_violations ?? []) {
          violations.push({ field: v.field ?? "", description: v.description ?? "", reason: v.reason ?? "" });
        }
      } else if (typeName === "google.rpc.RetryInfo") {
        const info = r.lookupType(typeName).toObject(r.lookupType(typeName).decode(detail.value), {
          longs: Number,
        });
        const delay = info.retryDelay ?? info.retry_delay ?? {};
        retryMs = (delay.seconds ?? 0) * 1000 + Math.round((delay.nanos ?? 0) / 1e6);
      }
    }
  }
  return new EspalierError(error.code, error.details, reason, metadata, violations, retryMs);
}
