"""The runtime's command line (prorl_runtime.py): `serve` the socket, or be the
`python-worker` child of a PythonSession. Each imports only the modules it runs: the
worker is where the agent's code executes, the runtime's socket it never sees.
"""

import argparse
import os


def main(argv=None):
    parser = argparse.ArgumentParser(prog="prorl_runtime")
    commands = parser.add_subparsers(dest="command")
    serve_parser = commands.add_parser("serve")
    serve_parser.add_argument("--socket", required=True)
    serve_parser.add_argument("--workdir", default=os.getcwd())
    serve_parser.add_argument("--init", action="store_true", help="run as the container's PID 1 (see serve_as_init)")
    worker_parser = commands.add_parser("python-worker")
    worker_parser.add_argument("--fd-in", type=int, required=True)
    worker_parser.add_argument("--fd-out", type=int, required=True)
    worker_parser.add_argument("--fd-ack", type=int, default=None)
    args = parser.parse_args(argv)
    if args.command == "python-worker":
        from .python_worker import python_worker

        python_worker(args.fd_in, args.fd_out, args.fd_ack)
    elif args.command == "serve":
        from .hygiene import make_non_dumpable
        from .server import serve, serve_as_init

        make_non_dumpable()
        (serve_as_init if args.init else serve)(args.socket, args.workdir)
    else:
        parser.print_help()
        return 2
    return 0
