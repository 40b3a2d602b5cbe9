#!/usr/bin/env bash
# The GPU kit: one archive with everything the GPU self-test
# (conformance/gpu-selftest.sh) needs on a bare GPU machine that has no Go,
# no Rust and no network: the release `tessera` and `tessera-selftest`
# binaries, the control plane binary (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and kubectl in one, as
# conformance/cluster.sh builds it), the scripts that start them, the
# DeviceClasses, and, for a simulated run only, the simulated GPU's
# libraries, tools and topologies. Binaries are stripped; the archive is
# xz-compressed and refused above 60 MiB. See docs/isolation.md.
#
# On the GPU machine, as root:
#   tar -xJf tessera-gpu-kit.tar.xz && tessera-gpu-kit/run-selftest.sh
#   (--simulated tessera-gpu-kit/topologies/h100x8.yaml: the simulated GPUs)
#
# usage: conformance/gpu-kit.sh [--out FILE]
#   --out FILE        where the archive goes
#                     (default: <cargo target dir>/tessera-gpu-kit.tar.xz)
# environment:
#   TESSERA_BIN_DIR   prebuilt release binaries (tessera, tessera-selftest and
#                     the fakes) instead of building them with cargo
#   TESSERA_KUBE_BIN  a prebuilt control plane binary (else the one
#                     conformance/cluster.sh kube-bin finds in its cache or
#                     builds)
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NAME=tessera-gpu-kit
MAX_BYTES=$((60 << 20))

log() { printf '[gpu-kit] %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 2
}

target=${CARGO_TARGET_DIR:-$REPO_ROOT/target}
case "$target" in /*) ;; *) target="$REPO_ROOT/$target" ;; esac
out="$target/$NAME.tar.xz"
while (($#)); do
	case "$1" in
	--out)
		(($# > 1)) || die "--out needs a file"
		out=$2
		shift 2
		;;
	-h | --help)
		sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'
		exit 0
		;;
	*) die "unknown argument '$1' (usage: $0 [--out FILE])" ;;
	esac
done
for tool in strip objdump xz tar sha256sum; do
	command -v "$tool" >/dev/null || die "$tool is missing (binutils, xz-utils, tar, coreutils)"
done

# --- what goes in ---------------------------------------------------------
BINARIES=(tessera tessera-selftest)
FAKES=(libtessera_fake_nvml.so libtessera_fake_cuda.so fake-mps-control nvidia-smi)
if [[ -n "${TESSERA_BIN_DIR:-}" ]]; then
	bin=$TESSERA_BIN_DIR
else
	bin="$target/release"
	log "building the release binaries and the simulated GPU"
	(cd "$REPO_ROOT" && cargo build --release -q \
		-p tessera-driver --bin tessera -p tessera-conformance --bin tessera-selftest \
		-p tessera-fake-nvml --bin fake-mps-control --bin nvidia-smi --lib -p tessera-fake-cuda)
fi
for f in "${BINARIES[@]}" "${FAKES[@]}"; do
	[[ -f "$bin/$f" ]] || die "missing $bin/$f (build it, or set TESSERA_BIN_DIR)"
done
kube=${TESSERA_KUBE_BIN:-$("$REPO_ROOT/conformance/cluster.sh" kube-bin)}
[[ -x "$kube" ]] || die "no control plane binary at $kube"

stage=$(mktemp -d "${TMPDIR:-/tmp}/$NAME.XXXXXX")
trap 'rm -rf "$stage"' EXIT
kit="$stage/$NAME"
mkdir -p "$kit"/{bin,simulated,topologies,deploy,conformance/cluster}

install -m 755 "$bin/tessera" "$bin/tessera-selftest" "$kube" "$kit/bin/"
[[ "$(basename "$kube")" == tessera-kube ]] || mv "$kit/bin/$(basename "$kube")" "$kit/bin/tessera-kube"
for f in "${FAKES[@]}"; do install -m 755 "$bin/$f" "$kit/simulated/"; done
# Symbols are not needed to run; the libraries keep what they export.
strip --strip-all "$kit"/bin/* "$kit/simulated/fake-mps-control" "$kit/simulated/nvidia-smi"
strip --strip-unneeded "$kit"/simulated/*.so
cp "$REPO_ROOT"/driver/fake-nvml/topologies/*.yaml "$kit/topologies/"
cp "$REPO_ROOT/deploy/deviceclasses.yaml" "$kit/deploy/"
install -m 755 "$REPO_ROOT/conformance/gpu-selftest.sh" "$REPO_ROOT/conformance/cluster.sh" "$kit/conformance/"
install -m 755 "$REPO_ROOT/conformance/cluster/containerd.sh" "$REPO_ROOT/conformance/cluster/prereqs.sh" \
	"$kit/conformance/cluster/"

cat >"$kit/run-selftest.sh" <<'EOF'
#!/usr/bin/env bash
# The GPU self-test from this kit alone (no Go, Rust or network): as root,
#   ./run-selftest.sh                      the machine's GPUs
#   ./run-selftest.sh --simulated topologies/h100x8.yaml
#   ./run-selftest.sh -- --nvml-library /usr/lib64/libnvidia-ml.so.1
# Needs bash, coreutils, curl, util-linux and mount (checked at start).
# What it does and what its table means: docs/isolation.md ("The GPU
# self-test"); VERSION says what the kit was built from.
set -euo pipefail
KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
unset TESSERA_PROFILE TESSERA_KUBE_VERSION TESSERA_CLUSTER_DIR
export TESSERA_BIN_DIR="$KIT/bin" TESSERA_FAKES_DIR="$KIT/simulated"
export TESSERA_KUBE_BIN="$KIT/bin/tessera-kube"
exec "$KIT/conformance/gpu-selftest.sh" "$@"
EOF
chmod 755 "$kit/run-selftest.sh"

{
	echo "tessera $(git -C "$REPO_ROOT" describe --always --dirty 2>/dev/null || echo unknown)"
	echo "kubernetes $("$kube" kubectl version --client -o json 2>/dev/null |
		sed -n 's/^[[:space:]]*"gitVersion": "\(.*\)",$/\1/p' | head -n 1)"
	# The oldest glibc the machine may have: the newest symbol version used.
	echo "needs glibc >= $(objdump -T "$kit"/bin/tessera "$kit"/bin/tessera-selftest 2>/dev/null |
		grep -o "GLIBC_[0-9.]*" | sort -uV | tail -n 1 | cut -d_ -f2)"
} >"$kit/VERSION"
(cd "$kit" && find . -type f ! -name SHA256SUMS -print | LC_ALL=C sort | xargs sha256sum >SHA256SUMS)

# --- pack -------------------------------------------------------------------
mkdir -p "$(dirname "$out")"
tar -C "$stage" --sort=name --owner=0 --group=0 --numeric-owner -cf - "$NAME" |
	xz -9 -T0 >"$out.tmp"
bytes=$(stat -c %s "$out.tmp")
if ((bytes > MAX_BYTES)); then
	rm -f "$out.tmp"
	die "the kit is $((bytes >> 20)) MiB, over its limit of $((MAX_BYTES >> 20)) MiB: $(cd "$kit" && du -sh bin/* | tr '\n' ' ')"
fi
mv -f "$out.tmp" "$out"
log "$out: $(awk -v b="$bytes" 'BEGIN { printf "%.1f MiB", b / 1048576 }') ($(du -sh "$kit" | cut -f1) unpacked)"
echo "$out"
