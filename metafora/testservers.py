"""Former name of :mod:`metafora.testing.servers` (real PostgreSQL and etcd servers for tests).

Kept so that ``from metafora.testservers import ...`` goes on working; new code imports
:mod:`metafora.testing.servers`.
"""

from __future__ import annotations

from metafora.testing import servers as _servers
from metafora.testing.servers import *  # noqa: F403  (every public name, as before the move)

__all__ = list(_servers.__all__)
