#!/usr/bin/env bash
# The node image of the Helm chart and the Helm client, built from local
# files only: no registry, no podman, no Docker.
#
# usage: conformance/cluster/image.sh build [--binary FILE] [--out FILE] [--tag TAG]...
#        conformance/cluster/image.sh import [--binary FILE] [--tag TAG]...
#        conformance/cluster/image.sh helm
#
#   build   writes an OCI image archive (default ./tessera-image.tar) of
#           `tessera.local/tessera:<TAG>` (default tag: dev)
#   import  builds it and imports it into the containerd of the local cluster
#           in $TESSERA_CLUSTER_DIR (conformance/cluster.sh), pinned so image
#           GC never removes it; several --tag give one image several names
#   helm    prints the path of a helm binary, building it from its Go module
#           once (cached under ${TESSERA_CACHE:-~/.cache/tessera}/helm)
#
# The image is `FROM scratch`: the `tessera` binary at /bin/tessera (the
# release build, `cargo build --release -p tessera-driver`, unless --binary
# or TESSERA_IMAGE_BINARY names another) and exactly the shared libraries `ldd` says it links, at the
# paths the loader looks for them; entrypoint /bin/tessera. Nothing lives in
# /usr, so a chart may mount a host's driver directories (/usr/lib/..., /usr/bin)
# at their own paths without hiding the image's files.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE="${TESSERA_CACHE:-$HOME/.cache/tessera}"
IMAGE_REPOSITORY=tessera.local/tessera
HELM_MODULE=helm.sh/helm/v3
HELM_VERSION=v3.22.0
# Minor version of the k8s.io/client-go helm $HELM_VERSION builds with (its go.mod).
HELM_K8S_MINOR=37

log() { printf '[image] %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

# containerd.sh (oci_archive, ctr_, ensure_containerd) expects these.
GO_BUILD_FLAGS=(-trimpath -buildvcs=false)
DIR="${TESSERA_CLUSTER_DIR:-$REPO_ROOT/.tessera/cluster}"
case "$DIR" in /*) ;; *) DIR="$PWD/$DIR" ;; esac
NODE_DIR="$DIR/node"
# shellcheck source=conformance/cluster/containerd.sh
source "$REPO_ROOT/conformance/cluster/containerd.sh"

# The release binary, built when missing or stale (cargo decides; a no-op
# when nothing changed).
release_binary() {
	local target="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
	case "$target" in /*) ;; *) target="$REPO_ROOT/$target" ;; esac
	(cd "$REPO_ROOT" && cargo build --release --quiet -p tessera-driver --bin tessera) >&2 ||
		die "cargo build --release -p tessera-driver failed"
	echo "$target/release/tessera"
}

# The image's root filesystem: the binary and what it links.
tessera_rootfs() {
	local root=$1 bin=$2 line lib
	mkdir -p "$root"/{bin,etc,dev,proc,sys,tmp,run}
	chmod 755 "$root"
	chmod 1777 "$root/tmp"
	cp "$bin" "$root/bin/tessera"
	chmod 755 "$root/bin/tessera"
	# `ldd` lines: "name => /path (addr)", "/path/to/loader (addr)", and the
	# vDSO without a path. A library ldd cannot find fails the build.
	while read -r line; do
		case "$line" in
		*"not found"*) die "$bin links a library the host does not have: $line" ;;
		*"=> /"*) lib=${line#*=> } ;;
		/*) lib=$line ;;
		*) continue ;;
		esac
		lib=${lib%% (*}
		mkdir -p "$root$(dirname "$lib")"
		cp -L "$lib" "$root$lib"
	done < <(ldd "$bin")
	[[ -n "$(find "$root" -name 'ld-linux*' -print -quit)" ]] || die "ldd named no dynamic loader for $bin"
	echo 'root:x:0:0:root:/:/bin/tessera' >"$root/etc/passwd"
	echo 'root:x:0:' >"$root/etc/group"
}

# build_archive OUT BINARY TAG...
build_archive() {
	local out=$1 bin=$2 rootfs t
	shift 2
	local -a names=()
	for t in "$@"; do names+=("$IMAGE_REPOSITORY:$t"); done
	mkdir -p "$(ctrd_dir)"
	rootfs=$(mktemp -d "$(ctrd_dir)/tessera-rootfs.XXXXXX")
	tessera_rootfs "$rootfs" "$bin"
	oci_archive "$rootfs" "$out" '["/bin/tessera"]' "${names[@]}"
	rm -rf "$rootfs"
	log "wrote $out (${names[*]}, $(du -h "$out" | cut -f1))"
}

# Prints the directory holding helm, building it when needed (once per Helm
# and Go version; concurrent callers wait for one build).
ensure_helm() {
	local out
	prereq_check --for "building helm" go || exit 1
	out="$CACHE/helm/$HELM_VERSION-k1.$HELM_K8S_MINOR-$(go env GOVERSION)"
	if [[ ! -x "$out/helm" ]]; then
		mkdir -p "$CACHE/helm"
		exec 8>"$CACHE/helm/.build.lock"
		flock 8
		if [[ ! -x "$out/helm" ]]; then
			log "building helm $HELM_VERSION into $out"
			local t0=$SECONDS
			rm -rf "$out.tmp"
			mkdir -p "$out.tmp"
			# Stamped as helm's own release build does: its version, and the
			# Kubernetes version `helm template` and `helm lint` assume (that of
			# the client-go it builds with; unstamped it is 1.20).
			local ldflags=(-s -w -X "$HELM_MODULE/internal/version.version=$HELM_VERSION") pkg
			for pkg in pkg/lint/rules pkg/chartutil; do
				ldflags+=(-X "$HELM_MODULE/$pkg.k8sVersionMajor=1" -X "$HELM_MODULE/$pkg.k8sVersionMinor=$HELM_K8S_MINOR")
			done
			(cd "$out.tmp" && GOBIN="$out.tmp" go install "${GO_BUILD_FLAGS[@]}" \
				-ldflags "${ldflags[*]}" "$HELM_MODULE/cmd/helm@$HELM_VERSION") >&2
			rm -rf "$out"
			mv "$out.tmp" "$out"
			log "built helm in $((SECONDS - t0))s"
		fi
		flock -u 8
		exec 8>&-
	fi
	echo "$out/helm"
}

main() {
	local cmd=${1:-} bin=${TESSERA_IMAGE_BINARY:-} out="" a
	local -a tags=()
	[[ $# -gt 0 ]] && shift
	while (($#)); do
		a=$1
		shift
		case "$a" in
		--binary | --out | --tag)
			(($#)) || die "$a needs a value"
			case "$a" in
			--binary) bin=$1 ;;
			--out) out=$1 ;;
			*) tags+=("$1") ;;
			esac
			shift
			;;
		*) die "unknown argument '$a'" ;;
		esac
	done
	((${#tags[@]})) || tags=(dev)
	case "$cmd" in
	build)
		[[ -n "$bin" ]] || bin=$(release_binary)
		[[ -n "$out" ]] || out="$PWD/tessera-image.tar"
		case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
		# No cluster needed: containerd.sh's scratch space in a temporary dir.
		DIR=$(mktemp -d)
		trap 'rm -rf "$DIR"' EXIT
		build_archive "$out" "$bin" "${tags[@]}"
		;;
	import)
		[[ -f "$DIR/cluster.env" ]] || die "no cluster in $DIR (conformance/cluster.sh start)"
		[[ -S "$(ctrd_socket)" ]] || die "the cluster in $DIR runs no containerd"
		[[ -n "$bin" ]] || bin=$(release_binary)
		CTRD_BIN=$(ensure_containerd)
		local archive
		archive="$(ctrd_dir)/tessera-image-$$.tar"
		build_archive "$archive" "$bin" "${tags[@]}"
		ctr_ images import --label io.cri-containerd.pinned=pinned "$archive" >/dev/null 2>>"$(ctrd_dir)/import.log" || {
			rm -f "$archive"
			die "importing $archive failed (see $(ctrd_dir)/import.log)"
		}
		rm -f "$archive"
		local t
		for t in "${tags[@]}"; do echo "$IMAGE_REPOSITORY:$t"; done
		log "imported into the containerd of $DIR"
		;;
	helm) ensure_helm ;;
	*)
		sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//' >&2
		exit 2
		;;
	esac
}

main "$@"
