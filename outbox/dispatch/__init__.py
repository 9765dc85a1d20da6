"""Dispatching: the loop, its outcomes and policy, the database thread, wake-ups,
heartbeats, unresolved lookups, the process supervisor and the test failpoints."""
