"""Rollout servers on other nodes: the client engine, the server launcher and its worker extension."""
