"""GPU products as Kubernetes labels them (`nvidia.com/gpu.product`), with aliases.

Pure data and lookups: the spec validates `gpu_product` here, the cost table
prices by it, and preflight maps NVML's device name onto it.
"""

from __future__ import annotations

import difflib

# canonical label -> (memory GiB, aliases people type)
PRODUCTS: dict[str, tuple[int, tuple[str, ...]]] = {
    "Tesla-T4": (16, ("T4",)),
    "Tesla-V100-SXM2-16GB": (16, ("V100", "V100-16GB")),
    "Tesla-V100-SXM2-32GB": (32, ("V100-32GB",)),
    "NVIDIA-A10G": (24, ("A10G",)),
    "NVIDIA-A10": (24, ("A10",)),
    "NVIDIA-L4": (24, ("L4",)),
    "NVIDIA-L40S": (48, ("L40S",)),
    "NVIDIA-A100-SXM4-40GB": (40, ("A100", "A100-40GB")),
    "NVIDIA-A100-SXM4-80GB": (80, ("A100-80GB",)),
    "NVIDIA-A100-PCIE-40GB": (40, ("A100-PCIE-40GB",)),
    "NVIDIA-H100-80GB-HBM3": (80, ("H100", "H100-80GB", "H100-SXM")),
    "NVIDIA-H100-PCIe": (80, ("H100-PCIE",)),
    "NVIDIA-H200": (141, ("H200",)),
    "NVIDIA-B200": (180, ("B200",)),
    "NVIDIA-GeForce-RTX-4090": (24, ("RTX4090", "RTX-4090")),
}

_LOOKUP = {name.lower(): name for name in PRODUCTS} | {
    alias.lower(): name for name, (_, aliases) in PRODUCTS.items() for alias in aliases
}


def canonical_product(name: str) -> str:
    """Return the canonical label for a product name or alias; ValueError names close matches."""
    key = name.strip().lower().replace(" ", "-").replace("_", "-")
    if key in _LOOKUP:
        return _LOOKUP[key]
    close = difflib.get_close_matches(key, list(_LOOKUP), n=3, cutoff=0.5)
    hint = ", ".join(_LOOKUP[c] for c in close) if close else ", ".join(sorted(PRODUCTS)[:6])
    raise ValueError(f"{name!r} is not a known GPU product; use one of: {hint}")


def product_from_nvml_name(nvml_name: str) -> str:
    """Return the label gpu-feature-discovery gives a device NVML calls `nvml_name`."""
    label = nvml_name.strip().replace(" ", "-")
    try:
        return canonical_product(label)
    except ValueError:
        return label


def product_from_ec2(name: str, memory_mib: int, manufacturer: str = "NVIDIA") -> str:
    """Return the label for a GPU EC2 describes (GpuInfo: Name, MemoryInfo, Manufacturer):
    the memory picks between sizes of one product (V100 16/32 GB, A100 40/80 GB)."""
    size = f"{name}-{round(memory_mib / 1024)}GB".replace(" ", "-")
    for candidate in (size, name.replace(" ", "-")):
        found = _LOOKUP.get(candidate.lower())
        if found:
            return found
    return f"{manufacturer}-{name}".replace(" ", "-")


def product_named(spec: str, memory_mib: int) -> str:
    """Return the label for a GPU a cloud names with its maker ("NVIDIA T4", "NVIDIA A100
    80G"), as product_from_ec2 does for the name without it."""
    words = spec.replace("-", " ").split()
    maker = words[0] if words and words[0].upper() in ("NVIDIA", "AMD") else "NVIDIA"
    if words and words[0].upper() in ("NVIDIA", "AMD"):
        words = words[1:]
    words = [w for w in words if not w.upper().rstrip("B").endswith("G") or not w[0].isdigit()]
    return product_from_ec2(" ".join(words) or spec, memory_mib, maker)


# Kubernetes' names for NVIDIA GPUs: the device plugin's resource and GPU feature
# discovery's product label
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
