"""The features floor's loose modules: what is built on the public client and coordinator
and is no package of its own (why a pending task waits). The features with a published name
keep their packages beside it: ``metafora.statemachine``, ``metafora.gates``,
``metafora.streams``, ``metafora.messages`` (``metafora.core._layout``).
"""
