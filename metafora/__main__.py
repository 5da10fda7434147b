"""``python -m metafora`` is the ``metafora`` command."""

from __future__ import annotations

import os
import sys

from metafora.cli import main

if __name__ == "__main__":
    # ``python -m`` put the working directory first on sys.path, for good: a module planted
    # there would shadow an installed one (json, click, prometheus_client, a driver). The
    # package's __init__ removed the entry before its first import (this module runs after
    # the package, too late for that); this is the fallback for a run that did not go
    # through it. The installed ``metafora`` command has no such entry; ``worker
    # MODULE:NAME`` searches the directory last, for that import only (metafora.cli._load).
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    main()
