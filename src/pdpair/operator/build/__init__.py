"""Manifests, pure: pods, the router Service, the disruption budget, role objects, the engine arguments."""
