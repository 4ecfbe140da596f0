#!/usr/bin/env bash
# The main job: set up what the demo needs, start kvtierd on its embedded defaults and run the
# end-to-end demo. PYTHON names the interpreter (default python3), as in tools/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh demo
exec "${PYTHON:-python3}" -m tools.demo "$@"
