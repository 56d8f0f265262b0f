#!/usr/bin/env bash
# Set up (if needed) and run the main job on a sample.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/espalier conformance ../shared/conformance/json-schema-test-suite/draft2020-12/enum.json
