"""State stores and task command channels, one module per coordinator backend.

Each module provides ``state_store(coordinator_or_client)`` and
``task_commands(coordinator_or_client)``, found by
:func:`metafora.statemachine.store.state_store_for` / ``commands_for``.
"""
