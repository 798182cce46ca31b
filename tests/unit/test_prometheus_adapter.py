"""The aggregation layer and prometheus-adapter parts of the dev cluster that need no cluster: the apiserver's
aggregation flags (devcluster/realnode.py), the front-proxy CA and client cert and the adapter's serving cert (checked
with `cryptography`: chains, key usages, names), the adapter's objects (devcluster/prometheus_adapter.py) and its
place in the build cache (devcluster/build.py). tests/e2e_realnode/test_realnode_custom_metrics.py runs them."""
from __future__ import annotations

import base64
import pathlib

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from devcluster import build
from devcluster.prometheus_adapter import (
    ADAPTER_PORT, API_GROUP, API_VERSIONS, NAME, PrometheusAdapter, adapter_args, manifests, serving_certs,
)
from devcluster.realnode import (
    FRONT_PROXY_CLIENT_CN, RealNodeCluster, aggregation_layer_flags, write_front_proxy_certs,
)

REPO = pathlib.Path(__file__).resolve().parents[2]


def verify_signed_by(cert: x509.Certificate, ca: x509.Certificate) -> None:
    """Raises unless `ca` signed `cert` (ECDSA, as every dev-cluster cert)."""
    ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
    assert cert.issuer == ca.subject


def cn(cert: x509.Certificate) -> str:
    return cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value


def eku(cert: x509.Certificate) -> list:
    return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_aggregation_flags_name_the_front_proxy_files_and_route_to_endpoints(tmp_path):
    flags = dict(f.split("=", 1) for f in aggregation_layer_flags(tmp_path))
    assert flags == {
        "--requestheader-client-ca-file": str(tmp_path / "front-proxy-ca.crt"),
        "--requestheader-allowed-names": FRONT_PROXY_CLIENT_CN,
        "--requestheader-extra-headers-prefix": "X-Remote-Extra-",
        "--requestheader-group-headers": "X-Remote-Group",
        "--requestheader-username-headers": "X-Remote-User",
        "--proxy-client-cert-file": str(tmp_path / "front-proxy-client.crt"),
        "--proxy-client-key-file": str(tmp_path / "front-proxy-client.key"),
        # The hub namespace has no route to the Service CIDR and no kube-proxy: dial the backend pod's IP.
        "--enable-aggregator-routing": "true",
    }


def test_front_proxy_client_cert_chains_to_its_own_ca_for_client_auth(tmp_path):
    write_front_proxy_certs(tmp_path)
    for path in aggregation_layer_flags(tmp_path):
        if path.endswith((".crt", ".key")):
            assert pathlib.Path(path.split("=", 1)[1]).is_file(), path
    ca = x509.load_pem_x509_certificate((tmp_path / "front-proxy-ca.crt").read_bytes())
    client = x509.load_pem_x509_certificate((tmp_path / "front-proxy-client.crt").read_bytes())
    key = serialization.load_pem_private_key((tmp_path / "front-proxy-client.key").read_bytes(), password=None)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    verify_signed_by(client, ca)
    verify_signed_by(ca, ca)
    assert cn(client) == FRONT_PROXY_CLIENT_CN  # --requestheader-allowed-names
    assert eku(client) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert key.public_key().public_numbers() == client.public_key().public_numbers()
    assert (tmp_path / "front-proxy-client.key").stat().st_mode & 0o077 == 0
    # A CA of its own, not the cluster's: a front-proxy cert must not pass as a client cert to the apiserver.
    assert cn(ca) != "pdpair-realnode-ca"


def test_the_cluster_option_is_off_by_default_and_adds_the_flags(tmp_path):
    plain = RealNodeCluster(tmp_path / "a", nodes=1)
    assert plain.aggregation_layer is False and plain.apiserver_aggregation_flags(tmp_path) == []
    aggregated = RealNodeCluster(tmp_path / "b", nodes=1, aggregation_layer=True)
    assert aggregated.apiserver_aggregation_flags(tmp_path) == aggregation_layer_flags(tmp_path)
    assert aggregated.describe()["aggregation_layer"] is True


def test_adapter_serving_cert_is_for_the_name_the_aggregator_verifies():
    certs = serving_certs("obs")
    ca = x509.load_pem_x509_certificate(certs["ca.crt"])
    cert = x509.load_pem_x509_certificate(certs["tls.crt"])
    key = serialization.load_pem_private_key(certs["tls.key"], password=None)
    verify_signed_by(cert, ca)
    assert eku(cert) == [ExtendedKeyUsageOID.SERVER_AUTH]
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert f"{NAME}.obs.svc" in names
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()


def test_adapter_objects():
    certs = serving_certs("obs")
    objects = manifests("obs", "localhost/pdpair/prometheus-adapter:x", "http://198.18.64.5:9090/", "rules: []\n",
                        certs)
    by = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    # One APIService per version, backed by the Service (so by the pod, through the aggregator), with our CA.
    for version in API_VERSIONS:
        api = by[("APIService", f"{version}.{API_GROUP}")]
        assert api["spec"]["service"] == {"name": NAME, "namespace": "obs", "port": 443}
        assert base64.b64decode(api["spec"]["caBundle"]) == certs["ca.crt"]
        assert "insecureSkipTLSVerify" not in api["spec"]
    service = by[("Service", NAME)]
    deployment = by[("Deployment", NAME)]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"] == adapter_args("http://198.18.64.5:9090/")
    assert f"--secure-port={ADAPTER_PORT}" in container["args"]
    assert container["imagePullPolicy"] == "Never"
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == NAME
    # RBAC of delegated authn/authz, as upstream's deploy/manifests grant it.
    refs = {(o["kind"], o["roleRef"]["name"]) for o in objects if "roleRef" in o}
    assert ("ClusterRoleBinding", "system:auth-delegator") in refs
    assert ("RoleBinding", "extension-apiserver-authentication-reader") in refs
    assert by[("RoleBinding", f"{NAME}-auth-reader-obs")]["metadata"]["namespace"] == "kube-system"
    secret = by[("Secret", f"{NAME}-serving-cert")]
    assert base64.b64decode(secret["data"]["tls.crt"]) == certs["tls.crt"]
    assert yaml.safe_load(by[("ConfigMap", NAME)]["data"]["config.yaml"]) == {"rules": []}


def test_adapter_refuses_a_cluster_without_the_aggregation_layer(tmp_path):
    with pytest.raises(ValueError, match="aggregation_layer=True"):
        PrometheusAdapter(RealNodeCluster(tmp_path, nodes=1), "obs", "img", "http://x/", "rules: []\n")


def test_adapter_binary_is_cached_like_the_control_plane(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build.addon_binary_path("prometheus-adapter") == (
        tmp_path / "pdpair" / "controlplane" / f"prometheus-adapter-{build.PROMETHEUS_ADAPTER_VERSION}"
        / "prometheus-adapter")
    gomod = (REPO / "devcluster" / "go" / "prometheus-adapter" / "go.mod").read_text()
    assert f"sigs.k8s.io/prometheus-adapter {build.PROMETHEUS_ADAPTER_VERSION}" in gomod
    assert "tool sigs.k8s.io/prometheus-adapter/cmd/adapter" in gomod


def test_a_cached_adapter_is_not_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cached = build.addon_binary_path("prometheus-adapter")
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"\x7fELF")
    monkeypatch.setattr(build, "_run_go", lambda *a, **k: pytest.fail("rebuilt a cached binary"))
    assert build.build_prometheus_adapter(log=lambda m: None) == cached
