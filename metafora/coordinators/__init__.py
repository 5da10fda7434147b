"""Coordinator implementations, chosen by URL scheme (see :mod:`metafora.surfaces.connect`)."""
