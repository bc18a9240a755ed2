#!/usr/bin/env bash
# Generate C++ stubs from proto/ and build the example client.
# Needs Debian's protobuf-compiler, protobuf-compiler-grpc, libgrpc++-dev, g++,
# pkg-config. Output: examples/cpp/bin/rollout-client (unoptimised: a quicker compile,
# and the client spends its time waiting on the server)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
gen="$here/gen"
rm -rf "$gen" && mkdir -p "$gen" "$here/bin"
protoc -I "$root/proto" --cpp_out="$gen" --grpc_out="$gen" \
    --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" "$root"/proto/prorl/v1/*.proto
g++ -std=c++17 -O0 -pipe -I "$gen" "$here/rollout_client.cc" "$gen"/prorl/v1/*.cc \
    $(pkg-config --cflags --libs grpc++ protobuf) -o "$here/bin/rollout-client"
echo "built $here/bin/rollout-client"
