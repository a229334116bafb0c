"""`python -m proxy` is the `engram` command."""

from proxy.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
