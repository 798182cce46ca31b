# Keep this file small: shared fixtures live next to what they set up.
from tests.cluster.fixtures import cluster_namespace, local_cluster  # noqa: F401  (pytest finds fixtures by name)
