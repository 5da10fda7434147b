"""The contracts floor: the interfaces the rest is written against (the task handler, the
balancer, the coordinator, the client and the async client, the stores' registry and backend
table, the features' verbs on the client).

It imports only the ground (``metafora.core``); the stores implement these interfaces and
the consumer and the features are written against them (``metafora.core._layout``).
"""
