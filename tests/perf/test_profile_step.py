"""bench/profile_step.py: the kind each kernel of a profile is counted under, by its name, and
the host's side of the gaps after the lead-in steps' marker kernel."""

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


def test_the_host_view_names_the_code_that_kept_the_gpu_waiting(tmp_path, capsys):
    from profile_step import print_host_view

    def kernel(ts, dur, corr, name=None):
        return {"ph": "X", "cat": "kernel", "name": name or f"k{corr}", "ts": ts, "dur": dur, "tid": 7,
                "args": {"correlation": corr}}

    def launch(ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": 1,
                "args": {"correlation": corr}}

    def frame(ts, dur, name):
        return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": 1}

    events = [
        frame(-200, 190, "tessera/training/trainer.py(10): train_step"),
        launch(-150, 8), kernel(-148, 10, 8),       # a lead-in step's kernel that found the GPU idle: not counted
        launch(-120, 9), kernel(-110, 5, 9, "void at::cuda::(anonymous namespace)::spin_kernel(long)"),
        frame(0, 500, "tessera/training/trainer.py(10): train_step"),
        frame(5, 10, "tessera/models/moe.py(20): forward"),
        launch(10, 1), kernel(20, 100, 1),          # queued ahead: the GPU had work
        launch(30, 2), kernel(120, 50, 2),          # queued ahead, back to back
        frame(200, 100, "tessera/training/optimizer.py(30): step"),
        launch(290, 3), kernel(293, 10, 3),         # launched after the GPU ran dry at 170: 123 us idle
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(__import__("json").dumps({"traceEvents": events}))
    print_host_view(trace, steps=1)
    out = capsys.readouterr().out
    assert "1 kernels a step found the GPU idle" in out
    assert "0.123 ms  x1     optimizer.py(30): step < trainer.py(10): train_step" in out
    assert "before k3  <- optimizer.py(30): step" in out
    assert "k8" not in out
