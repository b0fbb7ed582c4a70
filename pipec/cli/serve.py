"""`pipec serve`: the playground (pipec.view.serve) on loopback, until interrupted."""

from __future__ import annotations

import argparse

from pipec.cli.args import Command
from pipec.cli.envelope import Misuse


def serve_arguments(p: argparse.ArgumentParser) -> None:
    p.set_defaults(json=False)  # no JSON document: diagnostics are printed as text
    p.add_argument("--port", type=int, default=8765, help="the port (0: one the system picks; default 8765)")
    p.add_argument(
        "--host",
        default=None,
        help="the address to listen on (default 127.0.0.1: this machine only; another must be given explicitly)",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the playground (docs/view.md): a schedule's source in an editor, checked and simulated as you
    type, its parameters and costs as controls, the view beside it, and downloads of the .pipe, the Program,
    the torch CSV and the view. It listens on loopback unless --host names another address."""
    from pipec.view.serve import LOOPBACK, make_server

    host = args.host or "127.0.0.1"
    if not 0 <= args.port <= 65535:
        raise Misuse(f"--port must be between 0 and 65535, not {args.port}")
    try:
        srv = make_server(host, args.port)
    except OSError as e:
        raise Misuse(f"cannot listen on {host}:{args.port}: {e.strerror}") from None
    port = srv.server_address[1]
    shown = f"[{host}]" if ":" in host else host
    print(f"pipec playground at http://{shown}:{port}/  (Ctrl-C stops it)", flush=True)
    if host not in LOOPBACK:
        print(f"note: listening on {host}, beyond this machine: anyone who reaches it can run schedules", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


SERVE = Command(
    "serve", "serve the playground: edit a schedule, see it simulated, in the browser", serve_arguments, cmd_serve
)
