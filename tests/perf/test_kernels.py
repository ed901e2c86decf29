"""Kernel curves: fitting bench/gemm.py's JSON recovers the parameters that produced it."""

import json

import pytest

from tessera.perf.kernels import PROVISIONAL, KernelCurves, fit_curves, load_curves


def synthetic_measurement(curves: KernelCurves) -> dict:
    peak = 989.0
    gemms = [{"m": m, "n": n, "k": k, "tflops": curves.gemm_efficiency(m, n, k) * peak}
             for m in (1024, 4096, 16384) for n in (512, 2048, 8192) for k in (512, 2048, 8192)]
    attention = [{"seq_length": s, "tflops": curves.attention_efficiency(s) * peak} for s in (1024, 4096, 16384)]
    return {"gpu": "synthetic", "peak_tflops": peak, "sms": curves.sms, "gemm": gemms, "attention": attention,
            "attention_dropout_slowdown": 1.3, "hbm_gb_per_s": 4200.0, "hbm_datasheet_gb_per_s": 4800.0}


def test_fit_recovers_the_parameters(tmp_path):
    truth = KernelCurves("truth", 132, 0.72, 256.0, 0.5, 2048.0, 0.9)
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps(synthetic_measurement(truth)))
    fitted = load_curves(path)
    assert fitted.gemm_max == pytest.approx(0.72)
    assert fitted.gemm_k0 == 256 and fitted.attn_s0 == 2048
    assert fitted.attn_max == pytest.approx(0.5)
    assert fitted.hbm_efficiency == pytest.approx(4200 / 4800)
    assert fitted.attn_dropout_cost == pytest.approx(0.3)


def test_h100_runs_the_h200_curve_at_its_sustained_rate():
    h100, h200 = load_curves(gpu_name="H100 SXM"), load_curves(gpu_name="H200")
    assert h100.gemm_max < h200.gemm_max and h100.gemm_k0 == h200.gemm_k0
    assert fit_curves({"peak_tflops": 989.0}).gemm_max == PROVISIONAL.gemm_max
