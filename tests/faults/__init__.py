"""The fault campaign: consumer processes under SIGKILL, SIGSTOP, store restarts and cuts, garbage."""
