#!/usr/bin/env bash
# Pins conformance/cluster to a Kubernetes release.
#
# k8s.io/kubernetes requires its staging modules (k8s.io/api, client-go,
# kubelet, ...) at v0.0.0 and replaces them with directories inside its own
# repository, which a consumer cannot see. This script reads the release's
# go.mod, and writes a replace block that pins every staging module to the
# matching published tag (v1.X.Y -> v0.X.Y), then tidies the module.
#
# The module has one file per Kubernetes minor it is tested with: go.mod
# (the default release) and go-1.<minor>.mod + go-1.<minor>.sum for each
# other one, used with `go build -modfile` (cluster.sh picks the file from
# TESSERA_KUBE_VERSION).
#
# usage: conformance/cluster/gen-replace.sh [--modfile FILE] [v1.37.2]
#   --modfile FILE  pin FILE (e.g. go-1.36.mod; created from go.mod when
#                   missing) instead of go.mod; its sums go to FILE's .sum
#   version         default: the file's current pin
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

modfile=go.mod
if [[ "${1:-}" == --modfile ]]; then
	modfile=${2:?--modfile needs a file name}
	shift 2
fi
[[ "$modfile" == *.mod && "$modfile" != */* ]] || {
	echo "want a module file name in this directory ending in .mod, got '$modfile'" >&2
	exit 2
}
sumfile=${modfile%.mod}.sum
if [[ ! -f "$modfile" ]]; then
	cp go.mod "$modfile"
	cp go.sum "$sumfile"
fi
if [[ "$modfile" != go.mod ]]; then
	export GOFLAGS="-modfile=$modfile${GOFLAGS:+ $GOFLAGS}"
fi

version=${1:-$(awk '$1 == "k8s.io/kubernetes" { print $2; exit }' "$modfile")}
[[ "$version" =~ ^v1\.[0-9]+\.[0-9]+$ ]] || {
	echo "want a release like v1.37.2, got '$version'" >&2
	exit 2
}
staging_version="v0.${version#v1.}"

gomod=$(go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
[[ -f "$gomod" ]] || {
	echo "could not download go.mod of k8s.io/kubernetes@$version" >&2
	exit 1
}
mapfile -t staging < <(awk '$2 == "=>" && $3 ~ /^\.\/staging\// { print $1 }' "$gomod" | LC_ALL=C sort -u)
((${#staging[@]} > 0)) || {
	echo "no staging replace lines found in $gomod" >&2
	exit 1
}

go mod edit -require="k8s.io/kubernetes@$version" "$modfile"
for m in "${staging[@]}"; do
	go mod edit -replace="$m=$m@$staging_version" "$modfile"
done
# Drop replaces for staging modules that the release no longer has.
while read -r m; do
	printf '%s\n' "${staging[@]}" | grep -qxF "$m" || go mod edit -dropreplace="$m" "$modfile"
done < <(awk '$2 == "=>" && $1 ~ /^k8s\.io\// { print $1 }' "$modfile")
go mod tidy
echo "pinned k8s.io/kubernetes $version in $modfile, ${#staging[@]} staging modules at $staging_version"
