"""Devices, clusters and their topology, described as data (YAML + pydantic schemas)."""
from .errors import UserInputError
from .loader import (cluster_from_device, list_clusters, list_devices, load_cluster, load_device,
                     parse_cluster, parse_device)
from .schema import Cluster, Device, FabricKind
from .topology import GroupPlacement, MeshDim, MeshPlacement, place_mesh

__all__ = [
    "UserInputError", "Cluster", "Device", "FabricKind", "GroupPlacement", "MeshDim", "MeshPlacement",
    "place_mesh", "cluster_from_device", "list_clusters", "list_devices",
    "load_cluster", "load_device", "parse_cluster", "parse_device",
]
