# The local control plane, for this package only (torn down after its last test).
import pytest

from devcluster.fixtures import cluster_namespace, local_cluster  # noqa: F401  (pytest finds fixtures by name)
from devcluster import operator_process
from devcluster.build import helm_path
from tests.e2e.crd_support import install_crd
from tests.e2e.operator_helpers import OPERATOR_NS


# The CRD fixtures of test_crd_validation.py and test_template_validation.py (module scope: one namespace per module).
@pytest.fixture(scope="module")
def crd_namespace(local_cluster):  # noqa: F811  (the fixture imported above)
    import uuid

    install_crd(local_cluster)
    name = f"crd-{uuid.uuid4().hex[:8]}"
    local_cluster.create_namespace(name)
    yield name
    local_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def custom_api(local_cluster):  # noqa: F811  (the fixture imported above)
    from kubernetes import client

    return client.CustomObjectsApi(local_cluster.api_client())


# The operator tests' platform (tests/e2e/operator_helpers.py runs the operator on it).
@pytest.fixture(scope="module")
def platform(local_cluster):
    """CRD + chart RBAC installed, kwok nodes with IP 127.0.0.1, the operator's kubeconfig."""
    operator_process.install_crd(local_cluster)
    kubeconfig = operator_process.install_operator_rbac(local_cluster, helm_path(), OPERATOR_NS)
    for i in range(2):
        name = f"kwok-op-{i}"
        if local_cluster.kubectl("get", "node", name, check=False).returncode != 0:
            local_cluster.add_node(name, ip="127.0.0.1", capacity={"pods": "1000"})
    return local_cluster, kubeconfig
