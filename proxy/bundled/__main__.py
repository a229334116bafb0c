"""``python -m proxy.bundled build|model|serve``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from proxy.bundled.build import ensure_built
from proxy.bundled.cache import command_for, model_path
from proxy.bundled.flavours import SetupError

# --- command line ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The bundled llama-server and tiny model.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build and verify llama-server if needed and print its path")
    sub.add_parser("model", help="print the model's path")
    serve = sub.add_parser("serve", help="run llama-server with the model")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--ctx", type=int, default=2048)
    serve.add_argument("--threads", type=int, default=2)
    serve.add_argument("--parallel", type=int, default=1)
    serve.add_argument("extra", nargs="*", help="more llama-server flags (after --)")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(ensure_built())
        elif args.command == "model":
            print(model_path())
        else:
            binary = ensure_built()
            cmd = command_for(
                binary,
                args.port,
                ctx=args.ctx,
                threads=args.threads,
                parallel=args.parallel,
                host=args.host,
                extra=args.extra,
            )
            os.execv(cmd[0], cmd)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
