#!/usr/bin/env bash
# The main job: set up, start kvtierd on its embedded defaults and run the end-to-end demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec python3 tools/demo.py "$@"
