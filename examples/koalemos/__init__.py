"""koalemos: run shell commands as metafora tasks (``koalemosd`` daemon, ``koalemosctl`` submitter)."""
