#!/usr/bin/env python3
"""Build, locate or run the bundled llama-server and tiny model (see proxy/bundled.py).

    .venv/bin/python -m scripts.llama_server --help     # from the repository root

The same as ``python -m proxy.bundled``; run as a module so that ``proxy`` is this checkout's.
"""

import sys

from proxy.bundled import main

if __name__ == "__main__":
    sys.exit(main())
