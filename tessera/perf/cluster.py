"""The machine a run is planned for: GPUs per node, links, and what a collective costs on them.

Collectives are costed as NCCL rings: an all-gather or reduce-scatter of a tensor of S
bytes (the full, gathered size) over n ranks moves (n-1)/n * S through every rank's
slowest link, an all-reduce twice that, plus one latency per ring step. The bandwidth
of a ring is the bus bandwidth nccl-tests reports ("busbw"), so datasheet and measured
numbers plug in directly.

A group inside one node runs over NVLink. A group that spans nodes is hierarchical: its
k ranks per node share the node's NVLink and own k NICs (one per GPU on DGX machines),
and NCCL spreads its rings over those NICs, so the bus bandwidth is the smaller of NVLink
and k times one NIC. With TP = 8 a data-parallel group has one rank per node and gets one
NIC's bandwidth; with TP = 1 it gets all eight.

An all-to-all (MoE token dispatch) is costed as every rank sending its share to every
other at once: the part bound for its own node over NVLink, the part bound for other
nodes over its own NIC, whichever takes longer, at the rings' efficiency (an estimate:
NCCL's all-to-all is not a ring, and its efficiency has not been measured here).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.perf.hardware import GPU, GPUS


@dataclass(frozen=True)
class Link:
    """One kind of link, per GPU and per direction."""

    name: str
    gb_per_s: float       # datasheet bandwidth, GB/s (1e9 bytes) per direction per GPU
    efficiency: float     # fraction of it that NCCL's large-message busbw reaches
    latency_us: float     # cost of one ring step, microseconds
    interference: float   # share of an overlapped transfer's time that still slows the kernels beside it

    @property
    def bytes_per_s(self) -> float:
        return self.gb_per_s * 1e9 * self.efficiency


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: GPU
    gpus_per_node: int
    nvlink: Link          # inside a node (NVSwitch: every pair at full speed)
    network: Link         # between nodes, per GPU (one NIC per GPU)

    def group_bandwidth(self, ranks: int, ranks_per_node: int) -> float:
        """Bus bandwidth (bytes/s) of a ring over `ranks` GPUs with `ranks_per_node` in each node."""
        if ranks <= ranks_per_node:
            return self.nvlink.bytes_per_s
        return min(self.nvlink.bytes_per_s, ranks_per_node * self.network.bytes_per_s)

    def link(self, ranks: int, ranks_per_node: int) -> Link:
        """The slowest kind of link a group's ring crosses."""
        return self.nvlink if ranks <= ranks_per_node else self.network

    def all_gather(self, nbytes: float, ranks: int, ranks_per_node: int) -> float:
        """Seconds to all-gather (or reduce-scatter) a tensor of `nbytes` gathered bytes."""
        if ranks <= 1:
            return 0.0
        steps = ranks - 1
        return steps * self.link(ranks, ranks_per_node).latency_us * 1e-6 + \
            steps / ranks * nbytes / self.group_bandwidth(ranks, ranks_per_node)

    reduce_scatter = all_gather

    def all_reduce(self, nbytes: float, ranks: int, ranks_per_node: int) -> float:
        return 2.0 * self.all_gather(nbytes, ranks, ranks_per_node)

    def all_to_all(self, nbytes: float, ranks: int, ranks_per_node: int) -> float:
        """Seconds for an all-to-all in which every rank sends `nbytes` in all, 1/ranks to each rank (itself too)."""
        if ranks <= 1:
            return 0.0
        nodes = ranks // ranks_per_node
        inside = (ranks_per_node - 1) / ranks * nbytes / self.nvlink.bytes_per_s
        across = (ranks - ranks_per_node) / ranks * nbytes / self.network.bytes_per_s
        # One step per peer in the node and per other node (an estimate: NCCL posts the sends together).
        latency = (ranks_per_node - 1) * self.nvlink.latency_us + (nodes - 1) * self.network.latency_us
        return latency * 1e-6 + max(inside, across)

    def ranks_per_node(self, ranks: int, stride: int = 1) -> int:
        """How many of a group's `ranks` share a node when consecutive members are `stride` ranks apart."""
        return max(1, min(ranks, self.gpus_per_node // stride))

    def send(self, nbytes: float, across_nodes: bool) -> float:
        """Seconds for a point-to-point transfer of `nbytes` (pipeline or context parallel)."""
        link = self.network if across_nodes else self.nvlink
        return link.latency_us * 1e-6 + nbytes / link.bytes_per_s


# Link parameters. NVLink 4 on H100/H200: 18 links, 450 GB/s per direction; on two H200s
# Megatron-Core's reference runs measured 370 GB/s p2p and 332 GB/s all-reduce busbw at
# 1 GiB, i.e. 74-82%: 0.8 is used for the 8-GPU rings (NCCL's
# published DGX H100 busbw is about 360 GB/s). NVLink 3 (A100): 300 GB/s per direction.
# Networks: ConnectX-7 NDR 400 Gb/s = 50 GB/s per GPU (DGX H100/H200), HDR 200 Gb/s =
# 25 GB/s (DGX A100); a ring across nodes reaches about 80% of line rate.
#
# Interference: an overlapped collective still costs the GEMM beside it the SMs its
# kernels occupy and the HBM traffic it adds. NVLink rings move data at ~10% of HBM speed
# on 16-32 SMs; a network ring at ~1% on a few. The two values are tuned on the
# published Megatron scaling points (docs/scaling.md).
NVLINK_INTERFERENCE, NETWORK_INTERFERENCE = 0.35, 0.05
_NVLINK4 = Link("NVLink 4 (NVSwitch)", 450.0, 0.80, 3.0, NVLINK_INTERFERENCE)
_NVLINK3 = Link("NVLink 3 (NVSwitch)", 300.0, 0.80, 3.0, NVLINK_INTERFERENCE)
_NDR = Link("InfiniBand NDR 400G", 50.0, 0.80, 8.0, NETWORK_INTERFERENCE)
# H800 NVLink: 400 GB/s in both directions together; DeepSeek-V3's report measures 160 GB/s
# per GPU over NVLink and 50 GB/s over IB, which 200 GB/s per direction at 80% gives.
_NVLINK_H800 = Link("NVLink (H800, NVSwitch)", 200.0, 0.80, 3.0, NVLINK_INTERFERENCE)
_HDR = Link("InfiniBand HDR 200G", 25.0, 0.80, 8.0, NETWORK_INTERFERENCE)

CLUSTERS: dict[str, Cluster] = {
    "dgx-h100": Cluster("DGX H100 (8x H100 SXM, NDR 400G per GPU)", GPUS["h100-sxm"], 8, _NVLINK4, _NDR),
    "dgx-h200": Cluster("DGX H200 (8x H200, NDR 400G per GPU)", GPUS["h200"], 8, _NVLINK4, _NDR),
    "dgx-a100": Cluster("DGX A100 (8x A100 80GB, HDR 200G per GPU)", GPUS["a100"], 8, _NVLINK3, _HDR),
    "hgx-h800": Cluster("HGX H800 (8x H800, 400G IB per GPU; DeepSeek-V3's)", GPUS["h800"], 8, _NVLINK_H800, _NDR),
}

# `--gpu KEY` picks the DGX machine of that GPU.
DEFAULT_CLUSTER = {"h100": "dgx-h100", "h100-sxm": "dgx-h100", "h200": "dgx-h200", "a100": "dgx-a100",
                   "h800": "hgx-h800"}


def lookup_cluster(name: str | None = None, gpu: str | None = None) -> Cluster:
    """A cluster preset by name, or the DGX machine of a GPU key ('h100', 'h200', 'a100')."""
    if name is None:
        key = (gpu or "h100").lower()
        if key not in DEFAULT_CLUSTER:
            raise ValueError(f"--gpu {gpu}: no cluster preset; choose one of {', '.join(sorted(DEFAULT_CLUSTER))} "
                             f"or give --cluster")
        name = DEFAULT_CLUSTER[key]
    if name not in CLUSTERS:
        raise ValueError(f"--cluster {name}: unknown; choose one of {', '.join(CLUSTERS)}")
    return CLUSTERS[name]
