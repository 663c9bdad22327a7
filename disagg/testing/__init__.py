"""disagg as an integration test harness: a real P/D cluster on loopback that starts in seconds, for
the routers and clients built on P/D (docs/testing.md).

    from disagg.testing import Cluster

    with Cluster(prefill_dp=2, decode_dp=1) as cluster:
        ...  # talk to cluster.router_url, or to cluster.prefill.url and cluster.decode.url
        cluster.assert_no_leaks()

The pytest plugin (`disagg_cluster` and friends) is `disagg.testing.plugin`, loaded by pytest on its
own once disagg is installed.
"""

from disagg.testing.cluster import Cluster, Metrics, Server, Worker
from disagg.testing.faults import FaultRefused, Faults
from disagg.testing.netns import NetnsCluster, QdiscUnavailable, TlsFiles, namespaces_unavailable, qdisc_unavailable

__all__ = ["Cluster", "FaultRefused", "Faults", "Metrics", "NetnsCluster", "QdiscUnavailable", "Server", "TlsFiles",
           "Worker", "namespaces_unavailable", "qdisc_unavailable"]
