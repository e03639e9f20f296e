"""A two-node Ray cluster on this machine, for the multi-node test: ``python _two_node_cluster.py TEMP_DIR``.

Each node is a raylet of its own with one logical GPU slot; the script prints the cluster's address, then keeps
the cluster up until its stdin closes. The raylets (and so every worker on them) inherit this process's
environment, which the test keeps free of verl_mas's settings: a job must bring them in Ray's runtime environment.
"""

from __future__ import annotations

import sys

from ray.cluster_utils import Cluster


def main() -> None:
    node = {"num_cpus": 8, "num_gpus": 1, "include_dashboard": False, "temp_dir": sys.argv[1]}
    cluster = Cluster(initialize_head=True, head_node_args=node)
    cluster.add_node(num_cpus=8, num_gpus=1)
    cluster.wait_for_nodes()
    print(cluster.address, flush=True)
    sys.stdin.read()  # until the test closes our stdin
    cluster.shutdown()


if __name__ == "__main__":
    main()
