#!/usr/bin/env bash
# Generate Go stubs from proto/ and build the example clients, offline.
#
# No Go module proxy is reachable here, so this builds in GOPATH mode against
# Debian's packaged sources (golang-google-grpc-dev, golang-google-protobuf-dev
# under /usr/share/gocode). Needs: golang-go protoc-gen-go protoc-gen-go-grpc
# protobuf-compiler. Output: examples/go/bin/rollout-client (one server, RolloutStream),
# examples/go/bin/cluster-client (several servers, round_robin, Submit + Watch) and
# examples/go/bin/feed-consumer (Subscribe: the event feed, resumed from a cursor file).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
gen="$here/src/prorl/gen/prorlv1"
rm -rf "$gen" && mkdir -p "$gen"
maps=()
for proto in "$root"/proto/prorl/v1/*.proto; do
    rel="prorl/v1/$(basename "$proto")"
    maps+=("--go_opt=M$rel=prorl/gen/prorlv1" "--go-grpc_opt=M$rel=prorl/gen/prorlv1")
done
protoc -I "$root/proto" --go_out="$gen" --go_opt=paths=source_relative \
    --go-grpc_out="$gen" --go-grpc_opt=paths=source_relative "${maps[@]}" \
    "$root"/proto/prorl/v1/*.proto
mv "$gen"/prorl/v1/* "$gen"/ && rm -rf "$gen/prorl"
mkdir -p "$here/bin"
cd "$here"
build() {
    GO111MODULE=off GOPATH="$here:/usr/share/gocode" GOCACHE="${GOCACHE:-/tmp/prorl-go-cache}" GOFLAGS= \
        go build -o "$here/bin/$1" "$2"
    echo "built $here/bin/$1"
}
build rollout-client rolloutclient
build cluster-client clusterclient
build feed-consumer feedconsumer
