"""Decode steps of a MoE model through vLLM's engine (``vllm.LLM`` on CPU), with vLLM's own MoE kernels and with
the static_moe plugin (``STATIC_MOE_VLLM=1``): what bench_vllm_peer.py's layer ratio becomes inside the engine, at
the model's real expert count and routing, with attention, norms, the sampler and the scheduler around it.

The model is Qwen3-30B-A3B's layer (H 2048, 128 experts of I 768, top-8, 32 query / 4 KV heads of 128) repeated
``--layers`` times (the whole model's 48 layers do not fit this host twice), started from a folder holding only its
config and a tokenizer (``static_moe.testing.tiny_moe_checkpoint.write_qwen3_moe_config``) with vLLM's
``load_format="dummy"``: vLLM draws every weight itself, the same draw in every engine. ``--formats fp8`` starts
the same model with its routed experts in fp8 128×128 blocks (Qwen3-30B-A3B-FP8's form; the scales vLLM draws are
not powers of two, as that checkpoint's are not).

Each batch of ``B`` requests starts from distinct random prompts and samples (temperature 1, a seed per request):
vLLM's dummy weights are so small that the logits are nearly equal, so the tokens are nearly uniform over the
vocabulary, and each row of a decode step routes as its own token does. (Greedy decoding of one prompt would send
every row of a step to the same 8 experts.) With top-8 of 128 experts, a step of B rows gives each routed expert
about B / 16 rows at large B; one row at B = 1.

A step's time is (time of B requests generating 1 + ``--steps`` tokens − time generating 1) / ``--steps``: the
prefill and the engine's per-request work cancel. The MoE time in a step is the mean time of the MoE calls on B
rows (the decode steps'; the prefill's have 16 times the rows) × the layers: for vLLM's kernels from torch.profiler
in its worker (``_C::cpu_fused_moe``, or ``_C::fused_experts_cpu``, its fp8 kernel on AMX hosts: one record a
call), for the plugin from a timer around its ``run_experts`` (static_moe's whole call, the Python around its kernel
too; the profiler's records of the ops inside it would add about 0.1 ms a call, so its profile serves only to count
the calls, and its time is kept as ``moe_ms_profiled``).

Every engine runs in its own process (the plugin is chosen per process, when vLLM loads its plugins), one after
the other, ``--runs`` times in turn; each number is the best over the runs. The engine core runs in that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the tests run it), so each batch's requests all enter the first step and
vLLM's threads are all the host's; ``--engine-process`` gives it a process of its own, vLLM's default, where the
requests enter the steps as they arrive and vLLM keeps a CPU for its scheduler's process
(``VLLM_CPU_NUM_OF_RESERVED_CPU``; so one thread on two CPUs).
The fp8 ratios are against vLLM's bf16 engine, the model vLLM serves where it has no fp8 MoE kernel (the experts
dequantized, as in bench_vllm_peer.py). vLLM's fp8 MoE needs AMX tiles: on a CPU without them its fp8 engine fails
at start (printed, not retried); where it starts, the table adds static_moe's fp8 against it.

Needs the vLLM venv (``make venv-vllm``):

    OMP_NUM_THREADS=2 .venv-vllm/bin/python bench/bench_vllm_engine.py --layers 4 --batch 1 4 16 64 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# Qwen3-30B-A3B's config entries (Hugging Face's Qwen/Qwen3-30B-A3B config.json), less its 48 layers.
QWEN3_30B_A3B = {
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
}
VOCAB = 4096  # the tokenizer knows 203 words: prompts are token ids, outputs are not detokenized
# The MoE op each engine's profile is searched for: the plugin's opaque op, vLLM's bf16 and fp8 CPU kernels.
MOE_OPS = ("static_moe_vllm::routed_experts", "_C::cpu_fused_moe", "_C::fused_experts_cpu")
RESULT = "RESULT "
PROMPT = 16  # tokens of each request's prompt
MAX_LEN = 128  # tokens a request may hold: its prompt and 1 + --steps generated


def _worker_profile(worker, rows: int | None, hidden: int = 0):
    """Run in vLLM's worker (``collective_rpc``): with ``rows`` None start a torch.profiler over its thread; else
    stop it and return (total CPU µs, calls) of the MoE ops (MOE_OPS) it recorded on ``rows`` × ``hidden`` hidden
    states (a decode step's; the prefill's have 16 times the rows). The profiler is kept on the worker object: each
    call of this function arrives as a fresh copy, with fresh globals."""
    import torch

    if rows is None:
        worker._static_moe_bench_profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
        )
        worker._static_moe_bench_profiler.__enter__()
        return None
    prof = worker._static_moe_bench_profiler
    prof.__exit__(None, None, None)
    moe = [
        e for e in prof.key_averages(group_by_input_shape=True) if e.key in MOE_OPS and [rows, hidden] in e.input_shapes
    ]
    return sum(e.cpu_time_total for e in moe), sum(e.count for e in moe)


def _worker_plugin_times(worker, rows: int) -> tuple[float, int] | None:
    """Run in vLLM's worker: (µs, calls) of the plugin's ``run_experts`` on ``rows`` rows since the last call (None
    where the plugin serves no layer). The first call wraps ``run_experts`` (which the plugin's op looks up on every
    call) with a timer: the profiler's records of the ops inside static_moe's call would cost it about 0.1 ms a
    call, where vLLM's MoE op is one record."""
    from static_moe.integrations import vllm as plugin

    if not plugin.STATS["layers"]:
        return None
    if not hasattr(plugin.run_experts, "times"):
        run, times = plugin.run_experts, {}

        def timed(moe, x, *rest):
            t0 = time.perf_counter()
            out = run(moe, x, *rest)
            us, n = times.get(x.shape[0], (0.0, 0))
            times[x.shape[0]] = (us + (time.perf_counter() - t0) * 1e6, n + 1)
            return out

        timed.times = times
        plugin.run_experts = timed
    found = plugin.run_experts.times.pop(rows, (0.0, 0))
    plugin.run_experts.times.clear()
    return found


def _worker_facts(worker) -> dict:
    """Run in vLLM's worker: its torch thread count and the plugin's counters there."""
    import torch

    from static_moe.integrations import vllm as plugin

    return {"threads": torch.get_num_threads(), "plugin_calls": plugin.STATS["calls"]}


def child(folder: str, batches: list[int], steps: int, reps: int, eager: bool, seed: int) -> dict:
    """In an engine's own process: start vLLM on ``folder`` and time its decode steps at each batch size."""
    import torch
    from vllm import LLM, SamplingParams

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    # room for every request's whole length twice over: a batch that does not fit would be preempted and decode
    # in smaller steps (bf16 K and V per layer and token)
    token_bytes = layers * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    t0 = time.perf_counter()
    try:
        llm = LLM(
            model=folder,
            load_format="dummy",
            enforce_eager=eager,
            max_model_len=MAX_LEN,
            max_num_seqs=max(batches),
            enable_prefix_caching=False,
            seed=0,
            kv_cache_memory_bytes=max(64 << 20, 2 * max(batches) * MAX_LEN * token_bytes),
        )
    except Exception as e:  # noqa: BLE001  (reported: vLLM's fp8 engine fails at start without AMX)
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    result = {"start_s": time.perf_counter() - t0, "batches": {}}
    g = torch.Generator().manual_seed(seed)

    def generate(b: int, tokens: int, profile: bool = False):
        """(wall s, (µs, calls) of the MoE ops on b rows, or None) of b requests generating ``tokens`` tokens each."""
        prompts = [{"prompt_token_ids": torch.randint(3, VOCAB, (PROMPT,), generator=g).tolist()} for _ in range(b)]
        params = [
            SamplingParams(
                temperature=1.0,
                seed=int(torch.randint(1 << 30, (1,), generator=g)),
                max_tokens=tokens,
                ignore_eos=True,
                detokenize=False,
            )
            for _ in range(b)
        ]
        if profile:
            llm.collective_rpc(_worker_profile, args=(None,))
        t0 = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        moe = llm.collective_rpc(_worker_profile, args=(b, hidden))[0] if profile else None
        assert all(len(o.outputs[0].token_ids) == tokens for o in out)
        return wall, moe

    for b in batches:
        generate(b, steps + 1)  # warm: this batch size's graphs, the KV blocks
        short = min(generate(b, 1)[0] for _ in range(reps))
        llm.collective_rpc(_worker_plugin_times, args=(b,))  # (re)starts the plugin's timer
        long = min(generate(b, steps + 1)[0] for _ in range(reps))
        timed = llm.collective_rpc(_worker_plugin_times, args=(b,))[0]
        # the MoE calls of the decode steps, told from the prefill's by their rows: µs per call × calls per step
        profiled = generate(b, steps + 1, True)[1]
        moe_us, calls = timed or profiled
        result["batches"][str(b)] = {
            "step_ms": (long - short) / steps * 1e3,
            "moe_ms": moe_us / max(calls, 1) * layers / 1e3,
            "moe_calls": profiled[1],
            "moe_ms_profiled": profiled[0] / max(profiled[1], 1) * layers / 1e3,
        }
    return result | llm.collective_rpc(_worker_facts)[0]


def _run_child(folder: str, served_by: str, args) -> dict:
    """One engine in its own process; its RESULT line."""
    # collective_rpc with this file's functions: vLLM pickles callables only when this says so
    env = dict(
        os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1", STATIC_MOE_VLLM="1" if served_by == "static_moe" else "0"
    )
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.engine_process else "0"
    env.pop("STATIC_MOE_VLLM_CAPACITY", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", folder, "--batch", *map(str, args.batch)]
    cmd += ["--steps", str(args.steps), "--reps", str(args.reps)] + (["--eager"] if args.eager else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def _best(runs: list[dict]) -> dict:
    """Per batch, each number's best (lowest) over the runs that started."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    best = {"threads": ok[0]["threads"], "plugin_calls": min(r["plugin_calls"] for r in ok), "batches": {}}
    for b in ok[0]["batches"]:
        best["batches"][b] = {k: min(r["batches"][b][k] for r in ok) for k in ok[0]["batches"][b]}
    return best


def _ratio(theirs: float, ours: float) -> str:
    return f"{theirs / ours:.2f}" if ours > 0 else "-"


def report(results: dict, args, sizes: dict) -> None:
    """The table: per batch, vLLM's step and MoE ms, and for each static_moe format its own and vLLM / ours."""
    base = results[("vllm", "bf16")]
    for key, r in results.items():
        if "error" in r:
            print(f"# {key[0]} {key[1]}: no engine ({r['error']})")
            continue
        for b, found in r["batches"].items():
            if found["moe_calls"] < args.steps * args.layers:  # preempted, or entered the steps apart
                print(
                    f"# {key[0]} {key[1]}: at B = {b} only {found['moe_calls']} MoE calls on B rows in {args.steps} steps"
                )
    if "error" in base:
        return
    shape = "Qwen3-30B-A3B" if sizes.items() >= QWEN3_30B_A3B.items() else json.dumps(args.sizes)
    print(f"# {shape} layer x {args.layers}, {base['threads']} threads, best of {args.runs} runs; ms per step")
    print("# ratio: vLLM bf16 / static_moe (> 1: static_moe faster); rows/expert: B*top-k / the experts B rows route")
    print("# to (expected, uniform routing); MoE: the MoE calls' time in a step (vLLM: torch.profiler; static_moe: a")
    print("# timer around its call)")
    ours = [(k, r) for k, r in results.items() if k[0] == "static_moe" and "error" not in r]
    # vLLM's own engine in a quantized format, where it starts (fp8: on a CPU with AMX tiles): ours against it too
    theirs_q = {k[1]: r for k, r in results.items() if k[0] == "vllm" and k[1] != "bf16" and "error" not in r}
    head = "| B | rows/expert | vLLM step | vLLM MoE |"
    for (_, fmt), _r in ours:
        head += f" ours {fmt} step | ours {fmt} MoE | MoE ratio | step ratio |"
        if fmt in theirs_q:
            head += f" vLLM {fmt} step | vLLM {fmt} MoE | {fmt} MoE ratio | {fmt} step ratio |"
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    e, k = sizes["num_experts"], sizes["num_experts_per_tok"]
    for b, theirs in base["batches"].items():
        routed = e * (1 - (1 - k / e) ** int(b))  # expected experts hit under uniform routing
        line = f"| {b} | {int(b) * k / routed:.1f} | {theirs['step_ms']:.1f} | {theirs['moe_ms']:.1f} |"
        for (_, fmt), r in ours:
            mine = r["batches"][b]
            line += f" {mine['step_ms']:.1f} | {mine['moe_ms']:.1f} | {_ratio(theirs['moe_ms'], mine['moe_ms'])} |"
            line += f" {_ratio(theirs['step_ms'], mine['step_ms'])} |"
            if fmt in theirs_q:
                same = theirs_q[fmt]["batches"][b]
                line += f" {same['step_ms']:.1f} | {same['moe_ms']:.1f} | {_ratio(same['moe_ms'], mine['moe_ms'])} |"
                line += f" {_ratio(same['step_ms'], mine['step_ms'])} |"
        print(line)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--steps", type=int, default=32, help="decode steps each timed generation adds")
    p.add_argument("--reps", type=int, default=3, help="timed generations per batch and length in a run")
    p.add_argument("--runs", type=int, default=2, help="times every engine is started, in turn")
    p.add_argument("--eager", action="store_true", help="enforce_eager (vLLM compiles the model by default)")
    p.add_argument(
        "--engine-process", action="store_true", help="vLLM's engine core in a process of its own (vLLM's default)"
    )
    p.add_argument("--sizes", type=json.loads, default={}, help="JSON config entries replacing Qwen3-30B-A3B's")
    p.add_argument("--timeout", type=int, default=1800, help="seconds one engine's process may take")
    p.add_argument("--child", metavar="FOLDER", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if PROMPT + 1 + args.steps > MAX_LEN:
        p.error(f"--steps: at most {MAX_LEN - PROMPT - 1} (a request holds {MAX_LEN} tokens)")
    if args.child:
        print(RESULT + json.dumps(child(args.child, args.batch, args.steps, args.reps, args.eager, seed=0)), flush=True)
        return {}

    from static_moe.testing.tiny_moe_checkpoint import write_qwen3_moe_config

    sizes = QWEN3_30B_A3B | {"num_hidden_layers": args.layers, "vocab_size": VOCAB} | args.sizes
    engines = [("vllm", "bf16")] + [("static_moe", f) for f in args.formats] + [("vllm", f) for f in args.formats]
    engines = list(dict.fromkeys(engines))
    runs: dict[tuple[str, str], list[dict]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {f: write_qwen3_moe_config(os.path.join(tmp, f), weights=f, **sizes) for f in args.formats + ["bf16"]}
        for run in range(args.runs):
            for served_by, fmt in engines:
                if runs[(served_by, fmt)] and "error" in runs[(served_by, fmt)][0]:
                    continue  # an engine that cannot start is tried once
                t0 = time.perf_counter()
                runs[(served_by, fmt)].append(_run_child(folders[fmt], served_by, args))
                print(f"# run {run + 1}: {served_by} {fmt} in {time.perf_counter() - t0:.0f} s", flush=True)
    results = {e: _best(r) for e, r in runs.items()}
    report(results, args, sizes)
    return results


if __name__ == "__main__":
    main()
