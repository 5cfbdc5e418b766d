"""Topologies: compute devices, switches and duplex links, from named builders or files (OMS, BML)."""

from gradsync.topology import bcube, fattree  # noqa: F401  (register the bcube:n,k and fattree:k builders)
from gradsync.topology.builders import BUILDERS, DGX1_NVLINKS, NVLINK_GBPS, PCIE3_X16_GBPS, builder
from gradsync.topology.io import from_dict, get_topology, load, parse_spec, save
from gradsync.topology.model import COMPUTE_KINDS, DEVICE_KINDS, FORWARD_KINDS, Device, Link, Topology

__all__ = [
    "BUILDERS",
    "COMPUTE_KINDS",
    "DEVICE_KINDS",
    "DGX1_NVLINKS",
    "FORWARD_KINDS",
    "NVLINK_GBPS",
    "PCIE3_X16_GBPS",
    "Device",
    "Link",
    "Topology",
    "builder",
    "from_dict",
    "get_topology",
    "load",
    "parse_spec",
    "save",
]
