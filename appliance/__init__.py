"""Control plane of the serving appliance: config, planner, KV-cache manager, scheduler, server."""
