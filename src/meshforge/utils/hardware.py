"""Accelerator and interconnect figures the step-time model prices a layout with.

`config validate --device D` predicts a step on hardware this machine does not have, so the
figures are a table, not a measurement: each row quotes where its numbers come from. Peak
FLOP/s are dense (no 2:4 sparsity); link bandwidths are per device and per direction, the
figure a ring collective moves data at before protocol overhead (the model's bus efficiency
factor takes that off). Torch-free: `meshforge config` imports it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

_T = 1e12
_GB = 1e9
# What an "80 GB" part gives the caching allocator: 80 GiB of HBM less what the driver keeps
# (`torch.cuda.get_device_properties(0).total_memory` = 85,045,231,616 bytes on an H100 SXM5;
# nvidia-smi's 81,559 MiB total includes the reserve). A decimal 80e9 would understate it by 5 GiB.
_USABLE_80GB_GIB = 85_045_231_616 / 2**30


@dataclass(frozen=True)
class Hardware:
    """One device kind as the step-time model sees it.

    Attributes:
        name: The `--device` name.
        title: What it is, for the printed line.
        bf16_flops: Dense bf16/fp16 matmul peak, FLOP/s.
        fp8_flops: Dense fp8 matmul peak, FLOP/s (None: no fp8 tensor cores).
        fp32_flops: Dense fp32 matmul peak, FLOP/s (TF32 on NVIDIA parts).
        memory_gib: Device memory, GiB.
        memory_bandwidth: Device memory bandwidth, bytes/s.
        intra_node_bandwidth: Link bandwidth to a device of the same node, bytes/s per direction.
        devices_per_node: Devices that share the intra-node link.
        inter_node_bandwidth: Network bandwidth of one device to other nodes, bytes/s per direction.
        source: Where the figures come from.
        measured: The FLOP/s figure is an achieved training throughput, not a datasheet peak
            (no efficiency factor applies, and a utilisation against it means nothing).
    """

    name: str
    title: str
    bf16_flops: float
    fp8_flops: float | None
    fp32_flops: float
    memory_gib: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    devices_per_node: int
    inter_node_bandwidth: float
    source: str
    measured: bool = False

    def peak_flops(self, dtype: str, *, float8: bool = False) -> float:
        """The matmul peak a run computing in `dtype` (float8 linears when `float8`) reaches for."""
        if float8 and self.fp8_flops is not None:
            return self.fp8_flops
        if dtype.lower() in ("bfloat16", "bf16", "float16", "fp16"):
            return self.bf16_flops
        return self.fp32_flops

    def link_bandwidth(self, *, crosses_nodes: bool) -> float:
        """Per-device bandwidth of a collective group that does or does not leave a node."""
        return self.inter_node_bandwidth if crosses_nodes else self.intra_node_bandwidth


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        name="h100",
        title="NVIDIA H100 SXM5 80 GB",
        bf16_flops=989.4 * _T,
        fp8_flops=1978.9 * _T,
        fp32_flops=494.7 * _T,
        memory_gib=_USABLE_80GB_GIB,
        memory_bandwidth=3.35e12,
        intra_node_bandwidth=450 * _GB,
        devices_per_node=8,
        inter_node_bandwidth=50 * _GB,
        source=(
            "NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (dense = half the sparsity figures; "
            "NVLink 900 GB/s total = 450 GB/s per direction); DGX H100: 8 GPUs, one 400 Gb/s "
            "ConnectX-7 port per GPU"
        ),
    ),
    "h200": Hardware(
        name="h200",
        title="NVIDIA H200 SXM 141 GB",
        bf16_flops=989.4 * _T,
        fp8_flops=1978.9 * _T,
        fp32_flops=494.7 * _T,
        memory_gib=141e9 / 2**30,
        memory_bandwidth=4.8e12,
        intra_node_bandwidth=450 * _GB,
        devices_per_node=8,
        inter_node_bandwidth=50 * _GB,
        source=(
            "NVIDIA H200 Tensor Core GPU datasheet, SXM column (dense; NVLink 900 GB/s total); "
            "HGX H200: 8 GPUs, one 400 Gb/s NIC per GPU"
        ),
    ),
    "a100": Hardware(
        name="a100",
        title="NVIDIA A100 SXM4 80 GB",  # memory: as the H100's 80 GB
        bf16_flops=312 * _T,
        fp8_flops=None,
        fp32_flops=156 * _T,
        memory_gib=_USABLE_80GB_GIB,
        memory_bandwidth=2.039e12,
        intra_node_bandwidth=300 * _GB,
        devices_per_node=8,
        inter_node_bandwidth=25 * _GB,
        source=(
            "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column (dense; NVLink 600 GB/s total); "
            "DGX A100: 8 GPUs, one 200 Gb/s HDR InfiniBand port per GPU"
        ),
    ),
    "b200": Hardware(
        name="b200",
        title="NVIDIA B200 180 GB",
        bf16_flops=2250 * _T,
        fp8_flops=4500 * _T,
        fp32_flops=1125 * _T,
        memory_gib=180e9 / 2**30,
        memory_bandwidth=8e12,
        intra_node_bandwidth=900 * _GB,
        devices_per_node=8,
        inter_node_bandwidth=50 * _GB,
        source=(
            "NVIDIA DGX B200 datasheet (72 PFLOPS fp8 training and 1,440 GB HBM3e, 64 TB/s for 8 "
            "GPUs; dense = half the sparsity figures; NVLink 5 1.8 TB/s total); 8 x 400 Gb/s "
            "ConnectX-7 per node"
        ),
    ),
    "910b": Hardware(
        name="910b",
        title="Huawei Ascend 910B 64 GB",
        bf16_flops=313 * _T,
        fp8_flops=None,
        fp32_flops=156 * _T,
        memory_gib=64e9 / 2**30,
        memory_bandwidth=1.6e12,
        intra_node_bandwidth=196 * _GB,
        devices_per_node=8,
        inter_node_bandwidth=25 * _GB,
        source=(
            "Huawei Atlas 800T A2 public specifications (Ascend 910B: 313 TFLOPS fp16, 64 GB HBM2e "
            "at 1.6 TB/s, HCCS full mesh of 7 x 56 GB/s links, 200 Gb/s RoCE per NPU); approximate"
        ),
    ),
    "cpu": Hardware(
        name="cpu",
        title="one process on a 2-core x86 CPU (the project's test machines)",
        bf16_flops=50e9,
        fp8_flops=None,
        fp32_flops=50e9,
        memory_gib=24.0,
        memory_bandwidth=20 * _GB,
        intra_node_bandwidth=2 * _GB,
        devices_per_node=2,
        inter_node_bandwidth=1 * _GB,
        source=(
            "fp32 training throughput measured on the project's machines (the demo's eager steps: "
            "51 GFLOP/s per process, models/common/compile.py); memory and gloo loopback figures "
            "approximate; bf16 has no fast CPU path, so it is priced as fp32"
        ),
        measured=True,
    ),
}


def hardware(name: str) -> Hardware:
    """The table row for `--device NAME` (ValueError naming the valid ones)."""
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        valid = ", ".join(HARDWARE)
        raise ValueError(f"--device: unknown device {name!r}; valid: {valid}") from None
