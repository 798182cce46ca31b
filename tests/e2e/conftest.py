# The local control plane, for this package only (torn down after its last test).
from devcluster.fixtures import cluster_namespace, local_cluster  # noqa: F401  (pytest finds fixtures by name)
