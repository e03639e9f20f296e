"""A Ray cluster of several nodes on this machine, for the multi-node test: ``python _ray_cluster.py TEMP_DIR NODES``.

Each node is a raylet of its own with one logical GPU slot, so a placement group of one GPU bundle per node can only
land on distinct nodes; the script prints the cluster's address, then keeps the cluster up until its stdin closes.
The raylets (and so every worker on them) inherit this process's environment, which the test keeps free of
verl_mas's settings: a job must bring them in Ray's runtime environment.
"""

from __future__ import annotations

import sys

from ray.cluster_utils import Cluster


def main() -> None:
    temp_dir, nodes = sys.argv[1], int(sys.argv[2])
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 8, "num_gpus": 1, "include_dashboard": False, "temp_dir": temp_dir})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=8, num_gpus=1)
    cluster.wait_for_nodes()
    print(cluster.address, flush=True)
    sys.stdin.read()  # until the test closes our stdin
    cluster.shutdown()


if __name__ == "__main__":
    main()
