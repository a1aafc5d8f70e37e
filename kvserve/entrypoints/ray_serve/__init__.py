"""kvserve replicas on Ray Serve (`pip install kvserve[ray]`): `kvserve serve
--data-parallel-size N` and `kvserve ray` run one engine per Ray Serve replica behind Ray's
HTTP proxy and a prefix-aware ingress, on a local Ray instance or on the cluster that
RAY_ADDRESS names.

`args` (the replica settings, their flags and the deployment's options) imports neither ray
nor torch, so the command line is parsed without them; `deployment` (KVServeDeployment) needs
ray and is imported only when replicas start."""
