"""The ground floor: values and errors, and the rules every part shares (tasks, durations,
clocks, URLs and options, masking, metrics, the lease rules, the retention policy).

It imports nothing above it; every other floor builds on it (``metafora.core._layout``).
"""
