"""``python -m metafora`` is the ``metafora`` command."""

from __future__ import annotations

from metafora.cli import main

if __name__ == "__main__":
    main()
