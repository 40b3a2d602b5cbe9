#!/usr/bin/env bash
# Bounded fuzzing of the decoders that read untrusted bytes: the opaque config
# decoder (api/fuzz) and the checkpoint reader (driver/fuzz). Each target runs
# for TESSERA_FUZZ_SECONDS (default 30) from its checked-in seeds; a crash
# fails the run and leaves the reproducer in the target's artifacts folder.
#
# Needs a nightly toolchain (libFuzzer instrumentation) and cargo-fuzz, which
# is installed from crates.io when missing.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SECONDS_PER_TARGET="${TESSERA_FUZZ_SECONDS:-30}"
CACHE="${TESSERA_CACHE:-$HOME/.cache/tessera}"
say() { printf '[fuzz] %s\n' "$*" >&2; }

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
	say "SKIPPED: no nightly Rust toolchain on this machine (libFuzzer needs one)"
	exit 0
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
	say "installing cargo-fuzz"
	cargo install cargo-fuzz --locked --quiet
fi

run_target() {
	local crate_dir=$1 target=$2
	local corpus
	corpus=$(mktemp -d "${TMPDIR:-/tmp}/tessera-fuzz.XXXXXX")
	cp "$REPO_ROOT/$crate_dir/seeds/"* "$corpus/"
	say "$crate_dir: $target for ${SECONDS_PER_TARGET}s"
	(
		cd "$REPO_ROOT/$crate_dir"
		CARGO_TARGET_DIR="$CACHE/fuzz-target" cargo +nightly fuzz run "$target" "$corpus" -- \
			-max_total_time="$SECONDS_PER_TARGET" -print_final_stats=1 2>&1 | tail -5
	)
	rm -rf "$corpus"
}

run_target api/fuzz config_decode
run_target driver/fuzz checkpoint_decode
