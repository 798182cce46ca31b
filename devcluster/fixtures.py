"""pytest fixtures for the local control plane. tests/e2e/conftest.py and tests/e2e_realnode/conftest.py re-export
them, so each cluster lives only as long as its package's tests: nothing of it runs (and takes CPU from the engines)
during the later packages.

- `local_cluster` (package): one running LocalCluster shared by the tests of tests/e2e. A start failure is an
  error, never a skip: the test command builds everything it needs.
- `cluster_namespace` (function): a fresh namespace with its default ServiceAccount, deleted afterwards.
- `real_cluster` (package): a RealNodeCluster (devcluster/realnode.py): the same control plane plus two real
  nodes (containerd, runc, CNI, kubelet, kube-proxy) in network namespaces of its own, with the aggregation layer
  (the custom metrics API that the autoscaling tests read through prometheus-adapter; a few certificates and flags,
  no process of its own). Started on first use only.
"""
from __future__ import annotations

import os
import uuid

import pytest
from kubernetes import client

from pdpair.contract import LABEL_PAIR_NAMESPACE, LABEL_PORT_LEASE
from devcluster.localcluster import LocalCluster
from devcluster.realnode import RealNodeCluster

OPERATOR_NAMESPACE = "pdpair-system"  # where the e2e operators keep their port leases


@pytest.fixture(scope="package")
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
    # A test that failed midway (its operator stopped before its pairs were deleted) leaves its pairs' port leases
    # in the shared operator namespace. Left there, they fill the pools of every later test, which then fail too:
    # one failure must stay one failure. A passing test has already asserted its own leases released.
    api = local_cluster.api_client()
    client.CoordinationV1Api(api).delete_collection_namespaced_lease(
        OPERATOR_NAMESPACE, label_selector=f"{LABEL_PORT_LEASE}=true,{LABEL_PAIR_NAMESPACE}={name}")
    # Namespace deletion is asynchronous (kube-controller-manager empties it); don't wait for it.
    try:
        client.CoreV1Api(api).delete_namespace(name)
    except client.ApiException as exc:
        if exc.status != 404:  # a test may have deleted it itself
            raise


@pytest.fixture(scope="package")
def real_cluster():
    keep = os.environ.get("PDPAIR_KEEP_CLUSTER_DIR") == "1"
    cluster = RealNodeCluster(nodes=2, keep_workdir=keep, log=print, aggregation_layer=True)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
        left = cluster.leftovers()
        if keep:
            print(f"real cluster work dir kept: {cluster.workdir}")
        assert not left, f"real-node teardown left: {left}"
