"""What every `prorl` command shares: the server address, the connection, exit codes, errors as one line.

Exit codes (documented in the README, "The prorl command"):

    0  everything asked for was done
    1  some rollouts ended cancelled or failed as infrastructure (written, with
       their status; a rerun runs them again under new job ids)
    2  usage error, or bad task lines (named on stderr; skipped, or with
       --strict nothing was submitted)
    3  the server rejected some requests (recorded in RESULTS.rejected.jsonl)
    4  the server could not be reached, or a call failed (one line says why)
    5  another `prorl run` is writing the same output file
    130 interrupted (Ctrl-C); the jobs keep running on the server
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import grpc

from prorl_client import Client
from prorl_client._errors import RpcError

EXIT_OK = 0
EXIT_ROLLOUTS_FAILED = 1
EXIT_USAGE = 2
EXIT_REJECTED = 3
EXIT_UNREACHABLE = 4
EXIT_LOCKED = 5
EXIT_INTERRUPTED = 130

DEFAULT_PORT = 50051
# gRPC target schemes, given as they are.
SCHEMES = ("dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock")


def client_version() -> str:
    try:
        return version("prorl-client")
    except PackageNotFoundError:
        return "unknown (not installed)"


def server_target(address: str) -> str:
    """A --server value as a gRPC target: a host without a port gets the default port (50051).

    gRPC itself takes a bare host name as port 443, which no prorl server listens on.
    Targets with a scheme ("dns:///...", "unix:...", "ipv4:...") are passed as they are.
    """
    if "://" in address or address.split(":", 1)[0] in SCHEMES:
        return address
    if address.startswith("["):  # [IPv6] or [IPv6]:PORT
        return address if "]:" in address else f"{address}:{DEFAULT_PORT}"
    if address.count(":") > 1:  # a bare IPv6 address
        return f"[{address}]:{DEFAULT_PORT}"
    return address if ":" in address else f"{address}:{DEFAULT_PORT}"


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        default=os.environ.get("PRORL_SERVER", f"localhost:{DEFAULT_PORT}"),
        help=f"HOST[:PORT] of the prorl server (port {DEFAULT_PORT} when omitted; or PRORL_SERVER)",
    )
    parser.add_argument("--token", default=os.environ.get("PRORL_TOKEN"), help="bearer token (or PRORL_TOKEN)")
    parser.add_argument("--tls-ca", type=Path, help="PEM CA certificate: connect with TLS, trusting it")


def connect(args: argparse.Namespace) -> Client:
    credentials = grpc.ssl_channel_credentials(args.tls_ca.read_bytes()) if args.tls_ca else None
    return Client.connect(server_target(args.server), credentials=credentials, token=args.token)


def rpc_error_line(exc: RpcError, server: str) -> str:
    """A failed call as one line that says what to do."""
    target = server_target(server)
    if exc.code == grpc.StatusCode.UNAVAILABLE:
        why = exc.details.splitlines()[0] if exc.details else "no answer"
        return (
            f"prorl: cannot reach a prorl server at {target} ({why}); "
            "start one with `prorl-server serve`, or pass --server HOST:PORT"
        )
    if exc.code == grpc.StatusCode.UNAUTHENTICATED:
        return f"prorl: the server at {target} wants a bearer token: pass --token or set PRORL_TOKEN ({exc.details})"
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"prorl: the server at {target} did not answer in time ({exc.details})"
    return f"prorl: {exc.code.name}: {exc.details}"


def fail(message: str, code: int) -> int:
    print(message, file=sys.stderr, flush=True)
    return code
