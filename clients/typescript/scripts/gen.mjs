// Generate the TypeScript types of proto/espalier/v1/espalier.proto with @grpc/proto-loader's
// proto-loader-gen-types, and copy the .proto next to the package (loaded at run time).
import { execFileSync } from "node:child_process";
import { copyFileSync, existsSync, mkdirSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(dirname(fileURLToPath(import.meta.url)));
// Inside the espalier repository the contract is refreshed from its source; the package also
// carries its own copy (checked in, kept equal by tests/server/test_proto_codegen.py), so that
// this folder builds on its own.
const source = join(here, "..", "..", "proto", "espalier", "v1", "espalier.proto");
if (existsSync(source)) {
  mkdirSync(join(here, "proto", "espalier", "v1"), { recursive: true });
  copyFileSync(source, join(here, "proto", "espalier", "v1", "espalier.proto"));
}
rmSync(join(here, "src", "generated"), { recursive: true, force: true });
execFileSync(
  join(here, "node_modules", ".bin", "proto-loader-gen-types"),
  [
    "--longs=Number",
    "--enums=String",
    "--defaults",
    "--oneofs",
    "--keepCase",
    "--grpcLib=@grpc/grpc-js",
    "--includeDirs=proto",
    "--outDir=src/generated",
    "espalier/v1/espalier.proto",
    "google/rpc/details.proto",
  ],
  { cwd: here, stdio: "inherit" },
);
