"""Leases held in the durable store while a run is live: one heartbeat per process renews them all."""
