"""End to end on real nodes (kubelet, containerd, runc, CNI) running real vLLM engines."""
