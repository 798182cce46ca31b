"""The kube-apiserver's own request counters (`apiserver_request_total`), for tests and benchmarks that count writes.

    before = write_counts(cluster)
    ...
    writes = counts_delta(write_counts(cluster), before)   # Counter{(verb, group, resource, subresource, code): n}
"""
from __future__ import annotations

import collections
import re
import ssl
import urllib.request

WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION", "APPLY"})
READ_VERBS = frozenset({"GET", "LIST", "WATCH"})

_SAMPLE = re.compile(r'^apiserver_request_total\{([^}]*)\} ([0-9.e+]+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def write_counts(cluster) -> collections.Counter:
    """Cumulative write requests by (verb, group, resource, subresource, code), from kube-apiserver's /metrics."""
    return request_counts(cluster, WRITE_VERBS)


def request_counts(cluster, verbs: frozenset[str]) -> collections.Counter:
    """Cumulative requests of `verbs` by (verb, group, resource, subresource, code), from kube-apiserver's /metrics."""
    ctx = ssl.create_default_context(cafile=str(cluster.ca_file))
    req = urllib.request.Request(cluster.server + "/metrics", headers={"Authorization": f"Bearer {cluster.admin_token}"})
    with urllib.request.urlopen(req, timeout=30, context=ctx) as resp:
        text = resp.read().decode()
    out: collections.Counter = collections.Counter()
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(1)))
        if labels.get("verb") in verbs:
            key = (labels["verb"], labels.get("group", ""), labels.get("resource", ""), labels.get("subresource", ""),
                   labels.get("code", ""))
            out[key] += int(float(m.group(2)))
    return out


def counts_delta(after: collections.Counter, before: collections.Counter) -> collections.Counter:
    return collections.Counter({k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0) > 0})


def by_kind(counts: collections.Counter, ok_only: bool = False) -> collections.Counter:
    """Drop the response code from the keys (ok_only: count only 2xx answers)."""
    out: collections.Counter = collections.Counter()
    for key, v in counts.items():
        if not ok_only or key[4].startswith("2"):
            out[key[:4]] += v
    return out


def key_name(key) -> str:
    verb, group, resource, sub = key[:4]
    code = f" {key[4]}" if len(key) > 4 else ""
    return f"{verb} {group + '/' if group else ''}{resource}{'/' + sub if sub else ''}{code}"
