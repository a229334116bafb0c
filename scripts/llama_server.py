#!/usr/bin/env python3
"""Build, locate or run the bundled llama-server and tiny model (see proxy/bundled.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.bundled import main

if __name__ == "__main__":
    sys.exit(main())
