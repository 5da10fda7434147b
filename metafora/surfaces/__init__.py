"""The surfaces floor's loose modules: what people and programs open (``connect``:
``open_coordinator`` / ``open_client`` / ``open_async_client``). The surfaces with a package
of their own stand beside it: ``metafora.cli``, ``metafora.web``, ``metafora.demo``,
``metafora.testing`` (``metafora.core._layout``).
"""
