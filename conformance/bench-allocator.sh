#!/usr/bin/env bash
# The scheduler's cost per claim on the slices Tessera publishes, in one
# command: `tessera slices` on a simulated node (no API server), then the
# Kubernetes scheduler's own DRA allocator (the module the harness pins)
# filling that node with claims of one class, in-process, release builds.
#
# usage: conformance/bench-allocator.sh [TOPOLOGY]   (default conformance/bench/h100x24.yaml)
# Prints Go's benchmark lines; ms/claim is the allocator's time per claim,
# averaged over the claims that fill the node (one per whole GPU).
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
TOPOLOGY=$(realpath "${1:-conformance/bench/h100x24.yaml}")
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${TESSERA_CACHE:-$HOME/.cache/tessera}/target}"

cargo build --release --quiet -p tessera-driver -p tessera-fake-nvml
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$CARGO_TARGET_DIR/release/libtessera_fake_nvml.so" "$work/libnvidia-ml.so.1"
TESSERA_FAKE_NVML_TOPOLOGY="$TOPOLOGY" TESSERA_FAKE_NVML_STATE="$work/state" \
	"$CARGO_TARGET_DIR/release/tessera" --nvml-library "$work/libnvidia-ml.so.1" \
	slices --node-name bench-node -o json >"$work/slices.json"
cd conformance/cluster
TESSERA_BENCH_SLICES="$work/slices.json" TESSERA_BENCH_CLASSES="$REPO_ROOT/deploy/deviceclasses.yaml" \
	go test ./internal/allocbench -run '^$' -bench . -benchtime 5x
