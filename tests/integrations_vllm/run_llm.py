"""Run vllm.LLM (in-process engine, CPU) on model folders and print one JSON line per model: the greedy
token ids of static_moe.testing.tiny_moe_checkpoint.prompts() with, at each step, the raw logits of the chosen token
and of the best other one (equal: a tie, decided by token index), or the error. Run as a script by
test_vllm_plugin.py, with STATIC_MOE_VLLM=1 and without (the plugin's registration is per process), eager, or
with ``--compiled`` as vLLM runs by default (torch.compile, no ``enforce_eager``), and with ``--tp N`` on N
tensor-parallel worker processes (then also each worker's plugin counters). Each line also carries a digest of
every served layer's experts; ``--reload FOLDER=SOURCE`` reloads that folder's engine from another checkpoint
afterwards (vLLM's ``reload_weights``) and adds the reloaded engine's tokens, digests and sharing counts;
``--reload-kernel FOLDER=SOURCE`` reloads it in kernel form (``is_checkpoint_format=False``) from the parameters
SOURCE's engine held, SOURCE being a folder run earlier in the same process; ``--lora FOLDER`` starts that
folder's engine with LoRA adapters enabled."""

import argparse
import hashlib
import json

import torch

from static_moe.integrations import vllm as plugin
from static_moe.testing.tiny_moe_checkpoint import prompts


def _top2(request_output) -> list[list[float]]:
    """Per generated token: [its raw logit, the best other token's] (logprobs_mode="raw_logits")."""
    found = []
    for token, top in zip(request_output.outputs[0].token_ids, request_output.outputs[0].logprobs):
        others = [lp.logprob for t, lp in top.items() if t != token]
        found.append([top[token].logprob, max(others) if others else float("-inf")])
    return found


def _worker_stats(worker) -> dict:
    """The plugin's counters in a tensor-parallel worker process (vLLM's collective_rpc runs this there)."""
    return dict(plugin.STATS)


def _served(worker):
    """(vLLM layer, its StaticMoE) for every layer the plugin serves in this worker."""
    for module in worker.model_runner.model.modules():
        moe = module.__dict__.get("_static_moe")
        if moe is not None:
            yield module, moe


def _held_once(worker) -> list[int]:
    """Per served layer in this worker, how many of vLLM's expert weight parameters (w13_weight, w2_weight) lie in
    the memory of the layer's StaticMoE (the plugin's sharing)."""
    counts = []
    for module, moe in _served(worker):
        inside = 0
        for theirs, ours in (("w13_weight", moe.w13), ("w2_weight", moe.w2)):
            start, size = ours.untyped_storage().data_ptr(), ours.untyped_storage().nbytes()
            inside += start <= getattr(module, theirs).data_ptr() < start + size
        counts.append(inside)
    return counts


def _capacities(worker) -> list[int]:
    """Per served layer in this worker, the rows of its static_moe calls (larger batches run in chunks)."""
    return [moe.capacity for _, moe in _served(worker)]


def _parameters(worker) -> list[tuple[str, torch.Tensor]]:
    """Every parameter of the worker's model as it holds them after loading (vLLM's kernel form; a served layer's
    are its StaticMoE's tensors), copied: what a kernel-format reload takes."""
    return [(name, p.detach().clone()) for name, p in worker.model_runner.model.named_parameters()]


def _experts_digest(worker) -> list[str]:
    """Per served layer in this worker, a SHA-1 of every tensor its StaticMoE computes with (weights, scales,
    biases): equal digests, equal experts."""
    digests = []
    for _, moe in _served(worker):
        h = hashlib.sha1()
        for name in ("w13", "w13_scale", "w2", "w2_scale", "w13_bias", "w2_bias"):
            t = getattr(moe, name)
            if t is not None:
                h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
        digests.append(h.hexdigest())
    return digests


def _generate(llm, params) -> dict:
    out = llm.generate(prompts(), params, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in out], "top2": [_top2(o) for o in out]}


def main(
    folders: list[str],
    compiled: bool = False,
    tp: int = 1,
    reload: dict[str, str] | None = None,
    lora: tuple[str, ...] = (),
    reload_kernel: dict[str, str] | None = None,
) -> None:
    """``reload`` {folder: source}: after that folder's generations, reload its engine's weights from the source
    folder (vLLM's ``reload_weights``, the in-place update RL loops use) and generate again
    (``result["reloaded"]``). ``reload_kernel`` {folder: source}: the same from the parameters the source folder's
    engine held after its generations (``is_checkpoint_format=False``; the source runs earlier in ``folders``):
    ``result["kernel_reloaded"]``. ``lora``: folders whose engine serves LoRA adapters (``enable_lora``)."""
    from vllm import LLM, SamplingParams

    reload_kernel = reload_kernel or {}
    sources = {}  # {source folder: its engine's parameters}

    for folder in folders:
        before = dict(plugin.STATS)
        try:
            llm = LLM(
                model=folder,
                dtype="auto",
                enforce_eager=not compiled,  # compiled: vLLM's default, torch.compile over the model
                tensor_parallel_size=tp,
                distributed_executor_backend="mp" if tp > 1 else None,
                max_model_len=128,
                max_num_seqs=4,
                seed=0,
                gpu_memory_utilization=0.05,
                kv_cache_memory_bytes=64 << 20,
                logprobs_mode="raw_logits",
                **({"enable_lora": True, "max_lora_rank": 8} if folder in lora else {}),
            )
            params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
            result = _generate(llm, params) | {
                "digest": llm.collective_rpc(_experts_digest),
                "capacities": llm.collective_rpc(_capacities),
                "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
            }
            if folder in reload_kernel.values():
                (sources[folder],) = llm.collective_rpc(_parameters)  # one worker: tp 1
            if folder in reload_kernel:
                kwargs = {"weights_iterator": sources[reload_kernel[folder]], "is_checkpoint_format": False}
                # vLLM 0.32's kernel-form reload copies into parameters in place outside no_grad, which a
                # parameter that requires grad refuses, with or without the plugin; a caller in this process
                # (one in-process worker) can give it no_grad
                with torch.no_grad():
                    llm.collective_rpc("reload_weights", kwargs=kwargs)
                result["kernel_reloaded"] = _generate(llm, params) | {"digest": llm.collective_rpc(_experts_digest)}
            if folder in (reload or {}):
                held_once = llm.collective_rpc(_held_once)
                llm.collective_rpc("reload_weights", kwargs={"weights_path": reload[folder]})
                result["reloaded"] = _generate(llm, params) | {
                    "held_once_before": held_once,
                    "held_once_after": llm.collective_rpc(_held_once),
                    "digest": llm.collective_rpc(_experts_digest),
                }
            if tp > 1:  # the layers live in the worker processes
                result["worker_stats"] = llm.collective_rpc(_worker_stats)
                llm.llm_engine.engine_core.shutdown()  # its workers and their process group, before the next engine
            del llm
        except Exception as e:  # noqa: BLE001  (the test reads the refusal's message)
            result = {"error": f"{type(e).__name__}: {e}"}
        result["stats"] = {k: plugin.STATS[k] - before[k] for k in before}
        print("RESULT " + json.dumps({"folder": folder, **result}), flush=True)


if __name__ == "__main__":  # the guard vLLM's tensor-parallel workers need (they are spawned, and import this)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+")
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument(
        "--reload", action="append", default=[], metavar="FOLDER=SOURCE", help="then reload FOLDER's engine from SOURCE"
    )
    p.add_argument(
        "--reload-kernel",
        action="append",
        default=[],
        metavar="FOLDER=SOURCE",
        help="then reload FOLDER's engine in kernel form from the parameters of SOURCE's (run before it)",
    )
    p.add_argument("--lora", action="append", default=[], metavar="FOLDER", help="FOLDER's engine serves LoRA")
    args = p.parse_args()
    reload = dict(r.split("=", 1) for r in args.reload)
    reload_kernel = dict(r.split("=", 1) for r in args.reload_kernel)
    main(
        args.folders,
        compiled=args.compiled,
        tp=args.tp,
        reload=reload,
        lora=tuple(args.lora),
        reload_kernel=reload_kernel,
    )
