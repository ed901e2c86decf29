"""bench/profile_step.py: the kind each kernel of a profile is counted under, by its name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from profile_step import kind_of  # noqa: E402


def test_kernels_are_counted_under_their_kind():
    names = {  # names as the H200 profiles of configs A, B and M print them
        "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
        "_adamw_kernel": "optimizer",
        "Memcpy HtoD (Pinned -> Device)": "copy",
        "Memset (Device)": "copy",
        "void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)": "copy",
        "triton_red_fused__to_copy__unsafe_view_add_native_layer_norm_1": "elementwise/other",
        "triton_poi_fused__to_copy_4": "elementwise/other",
        "void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel": "gather/scatter (MoE permutation)",
    }
    assert {name: kind_of(name) for name in names} == names
