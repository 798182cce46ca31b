"""pytest fixtures for the local control plane (tests/conftest.py re-exports them).

- `local_cluster` (session): one running LocalCluster shared by the whole test session. A start failure is an
  error, never a skip: the test command builds everything it needs.
- `cluster_namespace` (function): a fresh namespace with its default ServiceAccount, deleted afterwards.
- `real_cluster` (session): a RealNodeCluster (tests/cluster/realnode.py): the same control plane plus two real
  nodes (containerd, runc, CNI, kubelet, kube-proxy) in network namespaces of its own. Started on first use only.
"""
from __future__ import annotations

import os
import uuid

import pytest

from tests.cluster.localcluster import LocalCluster
from tests.cluster.realnode import RealNodeCluster


@pytest.fixture(scope="session")
def local_cluster():
    # PDPAIR_KEEP_CLUSTER_DIR=1 keeps the work dir (logs, kubeconfigs) for a post-mortem.
    keep = os.environ.get("PDPAIR_KEEP_CLUSTER_DIR") == "1"
    cluster = LocalCluster(keep_workdir=keep, log=print)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
        if keep:
            print(f"local cluster work dir kept: {cluster.workdir}")


@pytest.fixture
def cluster_namespace(local_cluster: LocalCluster):
    name = f"t-{uuid.uuid4().hex[:10]}"
    local_cluster.create_namespace(name)
    yield name
    # Namespace deletion is asynchronous (kube-controller-manager empties it); don't wait for it.
    local_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def real_cluster():
    keep = os.environ.get("PDPAIR_KEEP_CLUSTER_DIR") == "1"
    cluster = RealNodeCluster(nodes=2, keep_workdir=keep, log=print)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
        left = cluster.leftovers()
        if keep:
            print(f"real cluster work dir kept: {cluster.workdir}")
        assert not left, f"real-node teardown left: {left}"
