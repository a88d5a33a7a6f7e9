"""Fleet limits: a gate that takes a run's leases before its slot, a dispatcher that publishes parked messages."""
