#!/usr/bin/env bash
# The web console's browser tests (tests/console): headless Chromium from Debian's packages,
# driven by Playwright for Python, against a real server and the fake LLM.
#
#     bash tests/console.sh [pytest args]
#
# Builds the server and the fake LLM (examples/fake_llm.rs), then runs pytest. Screenshots
# land in target/console-screenshots/. Needs /usr/bin/chromium (apt-get install chromium)
# and `pip install playwright pytest`; says so and fails without them (.ci/run installs
# them when missing).
set -euo pipefail
cd "$(dirname "$0")/.."

chromium="${CHROMIUM:-/usr/bin/chromium}"
if [ ! -x "$chromium" ]; then
    echo "console.sh: no Chromium at $chromium (apt-get install chromium)" >&2
    exit 2
fi
if ! python3 -c 'import playwright, pytest' 2>/dev/null; then
    echo "console.sh: Python's playwright and pytest are missing (pip install playwright pytest)" >&2
    exit 2
fi
target_dir="${CARGO_TARGET_DIR:-target}"
cargo build --quiet --locked --bin bedrock --example fake_llm
export BEDROCK_BIN="$target_dir/debug/bedrock"
export FAKE_LLM_BIN="$target_dir/debug/examples/fake_llm"
export CHROMIUM="$chromium"
export CONSOLE_SCREENSHOTS="${CONSOLE_SCREENSHOTS:-$PWD/target/console-screenshots}"
# The page's own tests; bounded, so that a hang fails CI instead of stalling it.
timeout 900 python3 -m pytest -p no:cacheprovider -q tests/console "$@"
