#!/usr/bin/env bash
# The project's one test command: builds the Kubernetes components, starts a
# local control plane in a fresh temporary state directory, runs the whole
# Rust workspace's tests against it, and stops it again whatever happens.
#
# The clusters run the default Kubernetes release (conformance/cluster/go.mod);
# then the scheduler suites run once more against each other release Tessera
# claims (a cluster of its own, stopped afterwards like the others).
#
# usage: conformance/test-all.sh [extra cargo test args...]
# env:   TESSERA_KEEP_STATE=1 keeps the state dir (logs, etcd) after a green run;
#        it is always kept after a failure, and its path printed.
#        TESSERA_EXTRA_KUBE_VERSIONS: releases of the extra scheduler pass
#        (default v1.36.3; none when cargo test args are given; "" skips it).
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CLUSTER="$REPO_ROOT/conformance/cluster.sh"
cd "$REPO_ROOT"

say() { printf '[test-all] %s\n' "$*" >&2; }

# --- prerequisites (conformance/cluster/prereqs.sh) ---------------------------
# The table demo.sh and cluster.sh read too: what Debian has is installed
# when missing, what it cannot provide (Go, Rust, root) stops the run now.
PREREQS="$REPO_ROOT/conformance/cluster/prereqs.sh"
"$PREREQS" ensure --for "$0" go rust cluster node
# The CDI consumer test (driver/tests/cdi_podman.rs) runs a real container
# with podman + runc from a busybox-static rootfs; the webhook test makes its
# certificates with openssl. They fail, rather than skip, when these are
# still missing. See docs/development.md.
"$PREREQS" ensure --for "the podman and webhook tests" tests ||
	say "the podman CDI and webhook tests will fail"
export TESSERA_REQUIRE_PODMAN=1
# The prerequisite step proves itself: check and ensure must name each item
# when it is missing (hidden in a mount namespace of their own). That the
# table holds every command the cluster uses, the main cluster's start
# proves below (confine).
"$PREREQS" selftest

# --- 0. static checks (fast; a formatting or lint error fails the run) ----
say "commit messages, cargo fmt --check, cargo clippy -D warnings"
"$REPO_ROOT/conformance/check-commits.sh"
cargo fmt --all --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

# --- 1. Go components (cached by source hash; seconds when unchanged) -------
# The default release, and each release of the extra scheduler pass (step 4b).
# A TESSERA_KUBE_VERSION or TESSERA_KUBE_BIN of the caller would pick the
# release of every cluster here: the releases are this script's to choose.
unset TESSERA_KUBE_VERSION TESSERA_KUBE_BIN
if (($# == 0)); then
	EXTRA_KUBE_VERSIONS=${TESSERA_EXTRA_KUBE_VERSIONS-v1.36.3}
else
	EXTRA_KUBE_VERSIONS=${TESSERA_EXTRA_KUBE_VERSIONS-}
fi
read -ra EXTRA_KUBE_VERSIONS <<<"$EXTRA_KUBE_VERSIONS"
t0=$SECONDS
"$CLUSTER" build >/dev/null
for v in "${EXTRA_KUBE_VERSIONS[@]}"; do
	TESSERA_KUBE_VERSION=$v "$CLUSTER" build >/dev/null
done
say "Kubernetes components ready: default${EXTRA_KUBE_VERSIONS[*]:+ and ${EXTRA_KUBE_VERSIONS[*]}} ($((SECONDS - t0))s)"

# --- 2. Rust: compile everything before the clusters take CPU -----------------
# Binaries and cdylibs the tests launch (tessera, the fake libnvidia-ml.so)
# come from `cargo build`; test executables from `--no-run`. Arguments after
# `--` belong to the test executables, not to cargo.
cargo_args=()
for a in "$@"; do
	[[ "$a" == -- ]] && break
	cargo_args+=("$a")
done
t0=$SECONDS
cargo build --workspace
cargo test --workspace --no-run "${cargo_args[@]}"
# Both must build each library the same way: the simulated libraries' rlibs
# (beside a cdylib) have no hash in their file names, so two builds of one
# share a file, and the tests' own cargo builds would swap it under the
# feet of whatever was compiled against the other (a crate that then "cannot
# be found"). With the features unified, a build now compiles nothing.
if cargo build --workspace 2>&1 | grep -E '^ +Compiling '; then
	say "cargo build rebuilt the above after cargo test: the build and test graphs build them" \
		"differently (unify their dependencies' features, see driver/fake-nvml/Cargo.toml)"
	exit 1
fi
say "Rust build done ($((SECONDS - t0))s)"

# --- hook: Helm chart -------------------------------------------------------
# conformance/tests/helm_install.rs installs deploy/helm/tessera with helm
# (built from its Go module, cached) and the node image of the release
# binary (conformance/cluster/image.sh imports it into the cluster). The GPU
# kit (step 4c) packs the same release build, with the self-test and the
# simulated GPU built here too.
t0=$SECONDS
cargo build --release -p tessera-driver --bin tessera -p tessera-conformance --bin tessera-selftest \
	-p tessera-fake-nvml --bin fake-mps-control --bin nvidia-smi --lib -p tessera-fake-cuda
conformance/cluster/image.sh helm >/dev/null
say "release binary and helm ready ($((SECONDS - t0))s)"

# --- 3. clusters in a fresh state directory --------------------------------
STATE=$(mktemp -d "${TMPDIR:-/tmp}/tessera-test.XXXXXX")
MAIN_DIR="$STATE/main"
DEGRADED_DIR="$STATE/degraded"
GROUPS_DIR="$STATE/groups"
EXTRA_DIRS=() # clusters of the extra scheduler pass, once started

finish() {
	local rc=$?
	trap - EXIT INT TERM
	local d
	for d in "$MAIN_DIR" "$DEGRADED_DIR" "$GROUPS_DIR" "${EXTRA_DIRS[@]}"; do
		TESSERA_CLUSTER_DIR="$d" "$CLUSTER" stop || rc=1
	done
	if ((rc != 0)); then
		say "FAILED (exit $rc); cluster state and logs kept in $STATE"
		TESSERA_CLUSTER_DIR="$MAIN_DIR" TESSERA_LOG_LINES=30 "$CLUSTER" logs >&2 2>&1 || true
		for d in "$DEGRADED_DIR" "$GROUPS_DIR" "${EXTRA_DIRS[@]}"; do
			if [[ -d "$d/logs" ]]; then
				say "cluster $d:"
				TESSERA_CLUSTER_DIR="$d" TESSERA_LOG_LINES=30 "$CLUSTER" logs >&2 2>&1 || true
			fi
		done
	elif [[ "${TESSERA_KEEP_STATE:-0}" == 1 ]]; then
		say "state kept in $STATE"
	else
		rm -rf "$STATE"
	fi
	exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

export TESSERA_CLUSTER_DIR="$MAIN_DIR"
# With a PATH of only the prerequisite table's commands: a command cluster.sh,
# containerd.sh, containerd or the kubelet look up that the table (and so
# demo.sh's prerequisite step) lacks fails this start or the tests on it.
"$PREREQS" confine go cluster node -- "$CLUSTER" start
eval "$("$CLUSTER" env)"

# --- degraded cluster ---------------------------------------------------------
# A second cluster serving the API of an older server: no partitionable
# devices, no consumable capacity. The publisher must detect that and fall
# back to the static per-GPU mode (conformance/tests/slices_degraded.rs).
# No kubelet: those tests only need the API server and the scheduler.
TESSERA_CLUSTER_DIR="$DEGRADED_DIR" TESSERA_KUBELET=0 \
	TESSERA_FEATURE_GATES=DRAPartitionableDevices=false,DRAConsumableCapacity=false \
	"$CLUSTER" start
export TESSERA_DEGRADED_KUBECONFIG="$DEGRADED_DIR/kubeconfig"

# --- groups cluster -----------------------------------------------------------
# A third one with compatibility groups (DRADeviceCompatibilityGroups, alpha
# in 1.37) on its API server and scheduler: the same mixes must be refused
# with groups published as without (conformance/tests/compatibility_groups.rs).
# No kubelet either.
TESSERA_CLUSTER_DIR="$GROUPS_DIR" TESSERA_KUBELET=0 \
	TESSERA_FEATURE_GATES=DRADeviceCompatibilityGroups=true \
	"$CLUSTER" start
export TESSERA_GROUPS_KUBECONFIG="$GROUPS_DIR/kubeconfig"

# --- 4. tests ----------------------------------------------------------------
say "running cargo test --workspace against $TESSERA_APISERVER_URL ($TESSERA_KUBE_VERSION)"
tests_rc=0
cargo test --workspace --no-fail-fast "$@" || tests_rc=$?

# --- 4b. the scheduler suites on the other releases claimed -------------------
# What the scheduler decides is what changes between releases: the suites that
# drive the real kube-scheduler run again against a main cluster (kubelet,
# all gates) and a degraded one of each extra release. The default release's
# clusters are stopped first (two cores).
SCHEDULER_TESTS=(--test scheduler_allocates --test slices_scheduler --test slices_degraded --test health_taints
	--test extended_resources)
if ((${#EXTRA_KUBE_VERSIONS[@]} > 0)); then
	TESSERA_CLUSTER_DIR="$MAIN_DIR" "$CLUSTER" stop
	TESSERA_CLUSTER_DIR="$DEGRADED_DIR" "$CLUSTER" stop
	TESSERA_CLUSTER_DIR="$GROUPS_DIR" "$CLUSTER" stop
fi
for v in "${EXTRA_KUBE_VERSIONS[@]}"; do
	vdir="$STATE/k${v//[^0-9]/}"
	EXTRA_DIRS+=("$vdir" "$vdir-degraded")
	# Nothing of the default release's cluster (its binary, its effective
	# gates) may leak into these. (`set -e` does not hold inside a subshell
	# followed by ||: each step says so itself.)
	(
		unset TESSERA_KUBE_BIN TESSERA_FEATURE_GATES TESSERA_DEGRADED_KUBECONFIG TESSERA_GROUPS_KUBECONFIG
		export TESSERA_KUBE_VERSION=$v
		TESSERA_CLUSTER_DIR="$vdir" "$CLUSTER" start || exit 1
		TESSERA_CLUSTER_DIR="$vdir-degraded" TESSERA_KUBELET=0 \
			TESSERA_FEATURE_GATES=DRAPartitionableDevices=false,DRAConsumableCapacity=false \
			"$CLUSTER" start || exit 1
		vars=$(TESSERA_CLUSTER_DIR="$vdir" "$CLUSTER" env) || exit 1
		eval "$vars"
		export TESSERA_DEGRADED_KUBECONFIG="$vdir-degraded/kubeconfig"
		say "running the scheduler suites against Kubernetes $TESSERA_KUBE_VERSION ($TESSERA_APISERVER_URL)"
		cargo test --workspace --no-fail-fast "${SCHEDULER_TESTS[@]}"
	) || tests_rc=1
	TESSERA_CLUSTER_DIR="$vdir" "$CLUSTER" stop || tests_rc=1
	TESSERA_CLUSTER_DIR="$vdir-degraded" "$CLUSTER" stop || tests_rc=1
done

# --- 4c. the GPU self-test from the GPU kit, on the simulated machine --------
# What a user runs on a real GPU node (docs/isolation.md), from what they
# would copy there: the kit (conformance/gpu-kit.sh: the release binaries,
# the cached control plane binary, the scripts) unpacked in a directory of
# its own and run from there alone, with an empty environment and a PATH of
# only the prerequisite table's base and cluster commands (no cargo, no go).
# Its own control plane without a kubelet, the node process, two Isolated
# claims, the probe under each claim's CDI edits, the hostile steps against
# the claim guard, nothing left behind. The archive must stay within 60 MiB.
KIT_MAX_BYTES=$((60 << 20))
selftest_from_kit() {
	local kit="$STATE/kit" archive bytes
	mkdir -p "$kit/unpacked" || return 1
	# TESSERA_KUBE_BIN (cluster.sh env) is the main cluster's binary.
	archive=$(conformance/gpu-kit.sh --out "$kit/tessera-gpu-kit.tar.xz") || return 1
	bytes=$(stat -c %s "$archive") || return 1
	say "GPU kit: $((bytes >> 20)) MiB ($bytes bytes; limit $((KIT_MAX_BYTES >> 20)) MiB)"
	((bytes <= KIT_MAX_BYTES)) || {
		say "the GPU kit is over its limit"
		return 1
	}
	tar -xJf "$archive" -C "$kit/unpacked" || return 1
	(
		cd "$kit/unpacked/tessera-gpu-kit" &&
			env -i HOME="$HOME" TMPDIR="${TMPDIR:-/tmp}" PATH=/usr/sbin:/usr/bin:/sbin:/bin \
				conformance/cluster/prereqs.sh confine cluster -- \
				./run-selftest.sh --simulated topologies/h100x8.yaml
	)
}
say "building the GPU kit and running its self-test on simulated H100s"
t0=$SECONDS
selftest_from_kit || tests_rc=1
say "GPU kit self-test done ($((SECONDS - t0))s)"
((tests_rc == 0)) || exit "$tests_rc"

# --- 5. bounded fuzzing of the untrusted-input decoders --------------------
conformance/fuzz-smoke.sh
