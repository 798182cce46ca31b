import uuid

import pytest


@pytest.fixture
def cluster_ns(real_cluster):
    """A fresh namespace in the real-node cluster, deleted afterwards."""
    name = f"rn-{uuid.uuid4().hex[:8]}"
    real_cluster.create_namespace(name)
    yield name
    real_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
