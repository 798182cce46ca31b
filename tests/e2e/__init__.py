"""End to end on the local control plane (kube-apiserver, etcd, kwok): the operator, the chart, the CRD."""
